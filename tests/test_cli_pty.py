"""`python -m createos_exec` in a REAL pseudo-terminal (pexpect) against the local server.

A pipe hides what a user at a terminal sees: that output arrives live, that
both streams reach the screen, and that the Ctrl-C key (the terminal driver's
SIGINT to the foreground process group) stops the remote tree before the CLI
exits 130.

Only what needs a terminal is here; the rest of the command line is in
tests/test_cli.py.
"""

from __future__ import annotations

import collections
import io
import os
import random
import re
import signal
import sys
import time

import pytest
from local_server import LocalServer
from support import ROOT, SANDBOX, campaign_size, cli_argv, cli_env, require, until

if sys.platform == "win32":  # pragma: no cover - the local server is Linux only
    pytest.skip("pseudo-terminals are POSIX", allow_module_level=True)

pexpect = require("pexpect")

EXPECT_TIMEOUT = 30  # seconds for any single expectation


def spawn(server, program, args):
    child = pexpect.spawn(
        program,
        args,
        env=cli_env(server),
        cwd=ROOT,
        encoding="utf-8",
        codec_errors="replace",
        timeout=EXPECT_TIMEOUT,
        dimensions=(24, 200),
    )
    child.logfile_read = io.StringIO()  # everything the terminal showed
    return child


def spawn_cli(server, *args):
    program, *rest = cli_argv(*args)
    return spawn(server, program, rest)


def finish(child):
    """Read the terminal to EOF; the CLI's exit status (it must not die of a signal)."""
    child.expect(pexpect.EOF)
    child.wait()
    assert child.signalstatus is None
    return child.exitstatus


def screen_lines(child):
    """The lines the terminal showed (the tty driver turns \\n into \\r\\n)."""
    return child.logfile_read.getvalue().replace("\r\n", "\n").splitlines()


@pytest.fixture
def cleanup():
    children = []
    yield children.append
    for child in children:
        if child.isalive():
            child.close(force=True)


def test_output_is_shown_live_before_the_command_ends(server, cleanup, tmp_path):
    # A handshake, not a race: the remote command prints `second` only after
    # the test has SEEN `first` on the terminal and created the `go` file (or
    # after 30 s, long after `first` must have been seen).
    go = tmp_path / "go"
    script = (
        f"echo first; for i in $(seq 600); do [ -e '{go}' ] && break; sleep 0.05; done; echo second"
    )
    child = spawn_cli(server, "--shell", SANDBOX, "--", script)
    cleanup(child)
    child.expect_exact("first", timeout=10)
    assert "second" not in child.buffer
    assert child.isalive()  # the command is still running
    go.touch()
    child.expect_exact("second")
    assert finish(child) == 0


def test_both_streams_reach_the_terminal_and_the_status_passes_through(server, cleanup):
    script = "echo to-stdout; echo to-stderr >&2; echo done; exit 7"
    child = spawn_cli(server, "--shell", SANDBOX, "--", script)
    cleanup(child)
    assert finish(child) == 7
    lines = screen_lines(child)
    assert sorted(lines) == ["done", "to-stderr", "to-stdout"]
    assert lines.index("to-stdout") < lines.index("done")  # one stream stays in order


def test_stderr_goes_to_stderr_while_stdout_stays_on_the_terminal(server, cleanup, tmp_path):
    # The same CLI behind a shell redirect: the streams are written apart.
    errors = tmp_path / "stderr.txt"
    script = (
        f'"$0" -m createos_exec --shell {SANDBOX} -- "echo to-stdout; echo to-stderr >&2" '
        f"2>'{errors}'"
    )
    child = spawn(server, "/bin/sh", ["-c", script, sys.executable])
    cleanup(child)
    assert finish(child) == 0
    assert screen_lines(child) == ["to-stdout"]
    assert errors.read_text() == "to-stderr\n"


def test_a_transfer_draws_its_progress_on_the_terminal(server, cleanup, tmp_path):
    (tmp_path / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    child = spawn_cli(server, "--put", f"{tmp_path}/big.bin:{tmp_path}/copy.bin", SANDBOX)
    cleanup(child)
    assert finish(child) == 0
    shown = child.logfile_read.getvalue()
    assert shown.startswith("\r--put ") and "3.0 MiB of 3.0 MiB, 100%" in shown


def test_ctrl_c_terminates_the_remote_tree_then_exits_130(server, cleanup):
    child = spawn_cli(
        server, "--shell", SANDBOX, "--", "echo ready; trap '' TERM; sleep 60 & sleep 60"
    )
    cleanup(child)
    child.expect_exact("ready")
    (record,) = server.processes()
    process_id = record["process_id"]
    assert server.tree_alive(process_id)
    assert server.requests_to("delete") == []
    started = time.monotonic()
    child.sendintr()  # the terminal's INTR character: SIGINT to the foreground group
    child.expect_exact("python -m createos_exec: interrupted")
    assert finish(child) == 130
    assert time.monotonic() - started < 15
    # (The terminal may echo the key itself as "^C".)
    shown = [line.replace("^C", "") for line in screen_lines(child)]
    assert shown == ["ready", "python -m createos_exec: interrupted"]
    # Checked right after the exit, with no waiting: the CLI confirmed it first.
    assert not server.tree_alive(process_id)
    assert [r.path for r in server.requests_to("delete")] == [
        f"/v1/sandboxes/{SANDBOX}/processes/{process_id}"
    ]


# -- -t: a terminal session ----------------------------------------------------

termios = require("termios")


class Session:
    """The command line with -t, started by a shell on the test's terminal once
    the test has read the terminal's settings; the shell prints `ended N` after
    it, runs `then` (what reads the terminal next) and keeps the terminal open,
    so its settings can be read again."""

    def __init__(self, server, tmp_path, *args, dimensions=(24, 80), then=""):
        self.go = tmp_path / "go"
        wait_for_go = f"while [ ! -e '{self.go}' ]; do sleep 0.02; done"
        script = wait_for_go + '; "$@"; echo "ended $?"; ' + then + "sleep 60"
        argv = cli_argv("-t", *args)
        self.child = pexpect.spawn(
            "/bin/sh",
            ["-c", script, "sh", *argv],
            env=cli_env(server, TERM="xterm-test"),
            cwd=ROOT,
            timeout=EXPECT_TIMEOUT,
            dimensions=dimensions,
        )
        self.child.logfile_read = io.BytesIO()
        time.sleep(0.2)  # the shell set the terminal up
        self.before = termios.tcgetattr(self.child.child_fd)
        self.go.touch()

    def cli_pid(self):
        for _ in range(200):
            with open(f"/proc/{self.child.pid}/task/{self.child.pid}/children") as listed:
                children = listed.read().split()
            if children:
                return int(children[0])
            time.sleep(0.05)
        raise AssertionError("the command line did not start")

    def ended(self):
        """The command line's exit status, once the terminal's settings are its own again."""
        self.child.expect(rb"ended (\d+)\r\n")
        assert termios.tcgetattr(self.child.child_fd) == self.before
        return int(self.child.match.group(1))

    def shown(self):
        return self.child.logfile_read.getvalue()


@pytest.fixture
def session(server, tmp_path, cleanup):
    def make(*args, **kw):
        made = Session(server, tmp_path, *args, **kw)
        cleanup(made.child)
        return made

    return make


WAIT = "echo ready; while :; do sleep 0.1; done"
BASH = (SANDBOX, "--", "bash", "--norc", "-i")
TRAPPED = f"trap 'echo caught-INT; exit 5' INT; {WAIT}"


def _end(how, made, server):
    if how == "ctrl-c":
        made.child.send(b"\x03")
    elif how == "remote failure":
        made.child.send(b"x")  # its echo comes after the corrupt frame
    else:
        os.kill(made.cli_pid(), {"SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP}[how])


@pytest.mark.parametrize(
    "how, status",
    [("ctrl-c", 5), ("SIGTERM", 128 + 15), ("SIGHUP", 128 + 1), ("remote failure", 125)],
)
def test_a_session_ending_restores_the_terminal_exactly(session, server, how, status):
    if how == "remote failure":
        server.corrupt_stream(b"not json\n", after_frames=1)
    made = session("--shell", SANDBOX, "--", TRAPPED)
    made.child.expect_exact(b"ready")
    assert termios.tcgetattr(made.child.child_fd) != made.before  # raw meanwhile
    _end(how, made, server)
    assert made.ended() == status
    if how == "ctrl-c":  # a key typed, not a local interrupt: the remote trap saw it
        assert b"caught-INT" in made.shown()
    else:
        (record,) = server.processes()
        assert server.wait_tree_gone(record["process_id"])  # contained, as after Ctrl-C


def test_a_session_that_cannot_start_restores_the_terminal(session, server):
    server.fail("create", 403)
    made = session(SANDBOX, "--", "bash")
    assert made.ended() == 125


def test_keys_size_and_term_reach_the_remote_terminal(session, server):
    made = session("--env", "PS1=prompt> ", *BASH, dimensions=(30, 100))
    made.child.expect_exact(b"prompt> ")
    made.child.send(b"stty size; echo T=$TERM\r")
    made.child.expect_exact(b"30 100")
    made.child.expect_exact(b"T=xterm-test")
    made.child.setwinsize(40, 120)  # SIGWINCH to the command line
    made.child.expect_exact(b"prompt> ")
    made.child.send(b"stty size\r")
    made.child.expect_exact(b"40 120")
    server.fail("resize", 400)
    made.child.setwinsize(20, 70)  # refused: said on the terminal, and the session goes on
    made.child.expect_exact(b"the new size was not sent")
    made.child.send(b"exit 3\r")
    assert made.ended() == 3


def test_ctrl_bracket_detaches_and_the_screen_is_rebuilt_on_attach(session, server, tmp_path):
    made = session("--shell", SANDBOX, "--", "echo first-line; " + WAIT)
    made.child.expect_exact(b"ready")
    made.child.send(b"\x1d")
    assert made.ended() == 0
    (record,) = server.processes()
    process_id = record["process_id"]
    assert server.tree_alive(process_id)
    assert server.requests_to("input") == []  # nothing was sent to it
    again_line = f"To attach again: python -m createos_exec -t --attach {process_id} {SANDBOX}"
    assert again_line.encode() in made.shown()
    (tmp_path / "again").mkdir()
    again = Session(server, tmp_path / "again", "--attach", process_id, SANDBOX)
    again.child.expect_exact(b"\x1bc")  # reset, then the replay from the first frame
    again.child.expect_exact(b"first-line")
    again.child.send(b"\x03")
    assert again.ended() == 130
    again.child.close(force=True)


def test_a_stream_cut_mid_session_loses_and_doubles_nothing(session, server):
    server.drop_stream(after_frames=2, mid_frame=True)
    server.drop_stream(after_frames=5)
    made = session("--shell", SANDBOX, "--", "seq 1 3000")
    assert made.ended() == 0
    shown = re.sub(rb"\x1b7.*?\x1b\[m|\x1b8\x1b\[K", b"", made.shown())
    numbers = re.findall(rb"(?m)^(\d+)\r$", shown.split(b"ended")[0])
    assert numbers == [str(n).encode() for n in range(1, 3001)]
    assert server.requests_to("connect")[1:]  # it did reconnect, and said so meanwhile
    assert 0 < made.shown().count(b"reconnecting") <= made.shown().count(b"\x1b8\x1b[K")


def test_output_lost_while_away_draws_the_screen_anew_and_the_session_goes_on(session, server):
    # The stream stalls after the first line; meanwhile the journal loses the next.
    server.stall_stream(after_frames=1, seconds=1.0)
    made = session(
        "--shell", SANDBOX, "--", 'echo first; sleep 0.2; echo gone; read x; echo "got $x"'
    )
    made.child.expect_exact(b"first")
    (record,) = server.processes()
    until(lambda: server.process(record["process_id"])["output"]["newest_seq"] >= 2)
    server.evict(record["process_id"])
    made.child.expect_exact(b"\x1bc")  # a blank screen, then what is kept
    made.child.expect_exact(b"output was lost while away")
    made.child.send(b"hi\r")
    made.child.expect_exact(b"got hi")
    assert made.ended() == 0 and b"gone" not in made.shown()


def test_a_lost_input_answer_is_reported_and_never_sent_again(session, server):
    made = session("--env", "PS1=prompt> ", *BASH)
    made.child.expect_exact(b"prompt> ")
    server.lose_input_response()
    made.child.send(b"echo one-$((1+1))\r")
    # The command's output and the notice come from two threads, in either order.
    made.child.expect_exact(b"keys may not have arrived")
    made.child.send(b"exit\r")
    assert made.ended() == 0
    assert made.shown().count(b"one-2") == 1


def test_keys_typed_before_a_session_reach_its_program_and_after_it_the_next_reader(
    session, server, tmp_path
):
    remote = tmp_path / "remote.txt"
    remote.write_bytes(b"made remotely\n")
    server.fail("files_get", 503, retry_after="3")  # the --get's second try comes 3 s later
    get = f"{remote}:{tmp_path / 'local.txt'}"
    program = 'read -r line; echo "remote read: $line"; exit 3'
    reads_next = 'read -r line; echo "read: $line"; '
    made = session("--get", get, "--shell", SANDBOX, "--", program, then=reads_next)
    made.child.send(b"typed ahead\r")  # before the session: for its program
    made.child.expect_exact(b"remote read: typed ahead")
    until(lambda: server.requests_to("files_get"), what="the --get")
    typed_at = time.time()
    made.child.send(b"typed meanwhile\r")  # the session has ended: for the shell
    assert made.ended() == 3
    made.child.expect_exact(b"read: typed meanwhile")
    assert [r.status for r in server.requests_to("files_get")] == [503, 200]
    assert typed_at < server.requests_to("files_get")[-1].time  # typed while the --get ran
    assert (tmp_path / "local.txt").read_bytes() == b"made remotely\n"


def test_i_gives_the_terminals_lines_to_a_pipe_process(server, cleanup):
    child = spawn_cli(server, "-i", SANDBOX, "--", "sed", "-u", "s/^/got: /")
    cleanup(child)
    child.sendline("first line")
    child.expect_exact("got: first line")
    child.sendeof()  # Ctrl-D: the command's stdin ends, and so does sed
    assert finish(child) == 0


def test_t_on_a_process_without_a_terminal_is_an_error_and_leaves_it(session, server, client):
    process = client.start(SANDBOX, ["sleep", "30"])
    made = session("--attach", process.process_id, SANDBOX)
    assert made.ended() == 125
    assert b"has no terminal: attach without -t" in made.shown()
    assert process.poll() is None
    process.terminate()


# -- the campaign: terminal sessions under injected faults (RELIABILITY.md item 14) --

TERMINAL_RUNS = campaign_size("CREATEOS_TERMINAL_RUNS", 4, 40)
TERMINAL_SEED = int(os.environ.get("CREATEOS_TERMINAL_SEED", "20261202"))
BURST = 400  # lines the remote program prints at its end
# Raw, it records each byte it receives and says so; `q` ends it with its size and a burst.
RECORDER = """
import os, signal, sys, tty
tty.setraw(0)
signal.signal(signal.SIGWINCH, lambda *_: None)
received = open(sys.argv[1], "ab", buffering=0)
os.write(1, b"ready\\r\\n")
while True:
    for key in os.read(0, 4096):
        if key == ord("q"):
            size = os.get_terminal_size(0)
            os.write(1, b"size %d %d\\r\\n" % (size.lines, size.columns))
            os.write(1, b"".join(b"line %d\\r\\n" % n for n in range(1, BURST + 1)))
            sys.exit(0)
        received.write(bytes([key]))
        os.write(1, b"got %02x\\r\\n" % key)
""".replace("BURST", str(BURST))
KEYS = bytes(range(1, 128)).replace(b"q", b"").replace(b"\x1d", b"")  # Ctrl-C among them


def _schedule(seed):
    rng = random.Random(seed)
    cuts = [(rng.randrange(0, 12), rng.random() < 0.5) for _ in range(rng.randrange(1, 4))]
    typing = []  # (keys, pause after, size to set then or None)
    for _ in range(rng.randrange(5, 15)):
        keys = bytes(rng.choice(KEYS) for _ in range(rng.randrange(1, 6)))
        size = (rng.randrange(10, 60), rng.randrange(40, 200)) if rng.random() < 0.3 else None
        typing.append((keys, rng.uniform(0, 0.05), size))
    return cuts, rng.randrange(0, 3), typing


def _run_session(seed, tmp_path):
    cuts, lost_answers, typing = _schedule(seed)
    received = tmp_path / "received.bin"
    with LocalServer(heartbeat_interval=0.5) as server:
        for after_frames, mid_frame in cuts:
            server.drop_stream(after_frames=after_frames, mid_frame=mid_frame)
        if lost_answers:
            server.lose_input_response(count=lost_answers)
        args = (SANDBOX, "--", sys.executable, "-c", RECORDER, str(received))
        made = Session(server, tmp_path, *args)
        try:
            made.child.expect_exact(b"ready")
            size = (24, 80)
            for keys, pause, new_size in typing:
                made.child.send(keys)
                if new_size is not None:
                    size = new_size
                    made.child.setwinsize(*size)
                time.sleep(pause)
            made.child.send(b"q")
            assert made.ended() == 0, seed
            reconnects = len(server.requests_to("connect")) - 1
        finally:
            made.child.close(force=True)
    typed = b"".join(keys for keys, _, _ in typing)
    assert received.read_bytes() == typed, seed  # every key once, in order
    shown = re.sub(rb"\x1b7.*?\x1b\[m|\x1b8\x1b\[K", b"", made.shown()).split(b"ended")[0]
    lines = re.findall(rb"(?m)^(got ..|size \d+ \d+|line \d+)\r$", shown)
    expected = [b"got %02x" % key for key in typed] + [b"size %d %d" % size]
    assert lines == expected + [b"line %d" % n for n in range(1, BURST + 1)], seed
    return len(cuts) + lost_answers, reconnects, len(typed)


def test_sessions_under_random_faults_double_and_lose_nothing(tmp_path, figures):
    totals = collections.Counter()
    for index in range(TERMINAL_RUNS):
        seed = TERMINAL_SEED + index
        directory = tmp_path / str(seed)
        directory.mkdir()
        faults, reconnects, keys = _run_session(seed, directory)
        totals.update(runs=1, faults=faults, reconnects=reconnects, keys=keys)
    assert totals["reconnects"] > 0
    figures.record("15. terminal sessions", seed=TERMINAL_SEED, **totals)
