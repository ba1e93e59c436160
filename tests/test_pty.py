"""PTY processes (docs/design.md item 18): start(..., pty=...) against the local
server's real pseudo-terminals, under both readings where docs/protocol.md
§11.20 matters, and the frames a terminal may send (canned)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, List

import pytest
import responses
from support import (
    CONNECT,
    EXIT0,
    PID,
    PROCS,
    SANDBOX,
    SB,
    THREE_TRIES,
    add_connect,
    add_deleted,
    assert_deleted_once,
    calls,
    data,
    make_client,
    nd,
    ok,
    process_record,
)

import createos_exec as cx

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")

# Whether all three standard streams are the terminal, its size and its type.
SEES_A_TERMINAL = '[ -t 0 ] && [ -t 1 ] && [ -t 2 ] && tty >/dev/null && echo "$(stty size) $TERM"'


def typed_until(proc: cx.RemoteProcess, wanted: str) -> str:
    """The output read up to the first piece that completes `wanted`."""
    seen = ""
    for stream, text in proc.iter_output(timeout=30):
        assert stream == "pty"
        seen += text
        if wanted in seen:
            return seen
    raise AssertionError(f"the output ended without {wanted!r}: {seen!r}")


@pytest.mark.both_readings
@pytest.mark.parametrize(
    "pty, env, seen",
    [
        (True, None, "24 80 xterm-256color"),
        ((30, 100), None, "30 100 xterm-256color"),
        ([50, 132], {"TERM": "dumb"}, "50 132 dumb"),
    ],
)
def test_a_program_runs_on_a_terminal_of_the_size_asked(client, pty, env, seen):
    pieces: List[Any] = []
    result = client.execute(
        SANDBOX,
        SEES_A_TERMINAL,
        shell=True,
        pty=pty,
        env=env,
        timeout=30,  # the sandbox-side deadline runs beside the terminal
        on_output=lambda stream, text: pieces.append(stream),
    )
    assert (result.exit_code, result.stdout, result.stderr) == (0, seen + "\r\n", "")
    assert result.output == result.stdout and set(pieces) == {"pty"}


@pytest.mark.both_readings
def test_a_python_repl_is_driven_by_typing_and_taken_up_by_its_id(client):
    repl = client.start(SANDBOX, [sys.executable, "-q"], pty=True)  # no stdin=cx.PIPE
    typed_until(repl, ">>> ")
    repl.write("6 * 7\n")
    assert "42\r\n>>> " in typed_until(repl, "42\r\n>>> ")
    with pytest.raises(cx.ConfigError, match="no stdin to close"):
        repl.close_stdin()
    again = client.process(SANDBOX, repl.process_id)
    assert again.pid == repl.pid and isinstance(again.pid, int)
    assert typed_until(again, "42").startswith(">>> 6 * 7\r\n")  # the replay, echo included
    out, err = repl.communicate(b"exit()\n", timeout=30)  # nothing to close: it exits
    result = repl.wait()
    assert (out, err) == (result.stdout, "")
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout.startswith(">>> 6 * 7\r\n42\r\n>>> exit()\r\n")
    assert again.wait(timeout=30).stdout == result.stdout


WINCH = "trap 'stty size' WINCH; echo ready; while :; do sleep 0.02; done"


def test_a_resize_reaches_the_programs_sigwinch_handler(client, server):
    shell = client.start(SANDBOX, ["bash", "-c", WINCH], pty=(24, 80))
    typed_until(shell, "ready")
    for rows, cols in ((0, 80), (24, 65536), (True, 80), (24.0, 80)):
        with pytest.raises(cx.ConfigError, match="rows, cols"):
            shell.resize(rows, cols)
    shell.resize(40, 120)
    assert typed_until(shell, "40 120\r\n").endswith("40 120\r\n")
    shell.terminate()
    assert shell.wait().signal == "SIGTERM"
    resizes = len(server.requests_to("resize"))
    shell.resize(10, 10)  # the process has ended: nothing is sent
    assert len(server.requests_to("resize")) == resizes == 1
    pipes = client.start(SANDBOX, ["true"])
    with pytest.raises(cx.ConfigError, match="pty="):
        pipes.resize(24, 80)
    pipes.wait()


COUNTED = "for i in $(seq 1 150); do echo line$i; [ $((i % 10)) = 0 ] && sleep 0.05; done; exit 3"


@pytest.mark.both_readings
def test_output_is_exact_across_injected_reconnects(client, server):
    server.drop_stream(after_frames=2)
    server.end_stream(after_frames=3)
    server.fail("connect", 503)
    server.drop_stream(after_frames=1)
    result = client.execute(SANDBOX, COUNTED, shell=True, pty=True, timeout=60)
    assert result.stdout == "".join(f"line{i}\r\n" for i in range(1, 151))
    assert result.exit_code == 3 and result.reconnects >= 3


@pytest.mark.both_readings
def test_the_deadline_and_containment_hold_for_a_terminal(client, server):
    result = client.execute(SANDBOX, "echo started; exec sleep 60", shell=True, pty=True, timeout=2)
    assert result.timed_out and result.stdout == "started\r\n"
    assert server.wait_tree_gone(result.process_id)


@pytest.mark.both_readings
def test_a_terminals_exit_status_is_recovered_out_of_band(server):
    # Three connects end after the first frame or a heartbeat alone: no progress,
    # the budget is spent, `wait` gives the status, and a replay what is missing.
    server.corrupt_stream(b'{"type":"heartbeat"}\n', after_frames=1, last=True)
    server.corrupt_stream(b'{"type":"heartbeat"}\n', last=True, count=2)
    with make_client(server, retry=THREE_TRIES) as client:
        result = client.execute(SANDBOX, "echo done; exit 4", shell=True, pty=True, timeout=60)
    assert (result.exit_code, result.stdout, result.exit_recovered) == (4, "done\r\n", True)


def test_pty_false_is_pipes():
    assert cx._Options(pty=False).pty is None and cx._Options(pty=[3, 4]).pty == (3, 4)


@pytest.mark.parametrize("kind, stream", [("pty", "stdout"), ("pty", "stderr"), ("process", "pty")])
def test_a_stream_of_the_other_kind_of_process_fails_closed(rsps, kind, stream):
    rsps.add(responses.POST, PROCS, json=ok(process_record(kind=kind)))
    add_connect(rsps, nd(data(1, stream, b"a"), EXIT0))
    add_deleted(rsps)
    with pytest.raises(cx.ProtocolError, match="other kind") as info:
        make_client().execute(SB, ["sh"], pty=True if kind == "pty" else None)
    assert info.value.process_id == PID
    assert len(calls(rsps, "GET", CONNECT)) == 1
    assert_deleted_once(rsps)


def test_keys_written_while_one_is_in_flight_go_together_in_the_next(client, server):
    terminal = client.start(SANDBOX, ["cat"], pty=True)
    server.lose_input_response(seconds=1.0)  # the first request is answered late: lost

    def first():
        with pytest.raises(cx.InputUnconfirmedError):
            terminal.write("a")

    typists = [threading.Thread(target=first)]
    typists[0].start()
    while terminal._stdin._next == 0:  # until "a" has left (its answer takes 1 s)
        time.sleep(0.01)
    typists += [threading.Thread(target=terminal.write, args=(key,)) for key in "bcd"]
    for typist in typists[1:]:
        typist.start()
    for typist in typists:
        typist.join()
    assert len(server.requests_to("input")) == 2  # "a", then the three together, none again
    shown = ""
    for _, text in terminal.iter_output():
        shown += text
        if len(shown) >= 4:
            break
    assert sorted(shown) == ["a", "b", "c", "d"] and shown[0] == "a"
    terminal.kill()


def test_keys_still_waiting_at_the_deadline_are_taken_back(client, server):
    terminal = client.start(SANDBOX, ["cat"], pty=True, timeout=1.0)
    server.lose_input_response(seconds=3.0)
    first = threading.Thread(target=lambda: pytest.raises(cx.CreateOSError, terminal.write, "a"))
    first.start()
    while terminal._stdin._next == 0:
        time.sleep(0.01)
    with pytest.raises(cx.WaitTimeout):
        terminal.write("b")
    assert terminal._stdin._waiting == []  # never to be sent
    first.join()
    assert len(server.requests_to("input")) <= 1
    terminal.kill()
