"""execute() end to end: a real server, real sockets, real processes."""

from __future__ import annotations

import logging
import pickle
import threading

import pytest
from support import SANDBOX, make_client

import createos_exec as cx


def test_argv_runs_without_a_shell(client, server):
    result = client.execute(SANDBOX, ["printf", "%s|", "a b", "$(echo no)", "*", "'q'"])
    assert result.exit_code == 0
    assert result.stdout == "a b|$(echo no)|*|'q'|"
    assert result.stderr == ""
    assert result.signal is None and not result.timed_out
    assert result.process_id.startswith("proc_")
    assert result.returncode == 0 and result.ok
    assert result.reconnects == 0 and not result.exit_recovered


@pytest.mark.both_readings
def test_shell_script_exit_code_and_both_streams(client):
    result = client.execute(SANDBOX, "echo out; echo err >&2; exit 7", shell=True)
    assert (result.exit_code, result.stdout, result.stderr) == (7, "out\n", "err\n")
    assert result.returncode == 7 and not result.ok


def test_cwd_env_and_stdin(client, server):
    result = client.execute(
        SANDBOX,
        ["sh", "-c", 'pwd; printf "%s|%s\\n" "$ONE" "$TWO"; cat'],
        cwd="/usr",
        env={"ONE": "it's $(not run) `x`", "TWO": "line1\nline2"},
        stdin=b"from stdin\x00binary\n",
    )
    assert result.exit_code == 0
    assert result.stdout == "/usr\nit's $(not run) `x`|line1\nline2\nfrom stdin\x00binary\n"


@pytest.mark.both_readings
def test_stdin_none_is_eof(client):
    result = client.execute(SANDBOX, ["cat"], timeout=20)
    assert result.exit_code == 0 and result.stdout == ""


def marker_of(server, process_id):
    """The random part of the marker the process was created with."""
    (record,) = [p for p in server.processes() if p["process_id"] == process_id]
    return record["args"][2][len("createos_exec-") :]


def test_missing_cwd_fails_the_command(client, server):
    result = client.execute(SANDBOX, ["true"], cwd="/no/such/dir")
    assert result.exit_code == 1
    assert result.stderr == "createos_exec: cd: /no/such/dir: No such file or directory\n"
    assert marker_of(server, result.process_id) not in result.stderr
    shell = client.execute(SANDBOX, "true", shell=True, cwd="/etc/passwd")
    assert (shell.exit_code, shell.stderr) == (
        1,
        "createos_exec: cd: /etc/passwd: Not a directory\n",
    )


def test_a_missing_program_is_named_never_the_marker(client, server):
    result = client.execute(SANDBOX, ["no-such-program-x", "--flag"])
    assert result.exit_code == 127
    assert result.stderr == "createos_exec: no-such-program-x: command not found\n"
    assert marker_of(server, result.process_id) not in result.stderr
    path = client.execute(SANDBOX, ["./no/such/program"], env={"A": "1"}, stdin="x")
    assert path.exit_code == 127
    assert path.stderr == "createos_exec: ./no/such/program: No such file or directory\n"
    in_script = client.execute(SANDBOX, "no-such-program-x", shell=True)
    assert in_script.exit_code == 127
    assert in_script.stderr == "bash: line 1: no-such-program-x: command not found\n"


def test_an_unreadable_staged_file_is_125_never_the_marker(client, server):
    server.fail("files_put", 200)  # answered as written, but nothing was written
    result = client.execute(SANDBOX, ["cat"], stdin="never read")
    assert result.exit_code == 125
    assert result.stderr == "createos_exec: cannot read the staged file of env and stdin\n"
    assert marker_of(server, result.process_id) not in result.stderr


@pytest.mark.both_readings
def test_on_output_live_in_order_never_twice(client, server):
    seen = []
    server.drop_stream(after_frames=2)
    result = client.execute(
        SANDBOX,
        "for i in 1 2 3 4 5; do echo o$i; echo e$i >&2; sleep 0.02; done",
        shell=True,
        on_output=lambda stream, text: seen.append((stream, text)),
    )
    assert result.reconnects == 1
    assert "".join(t for s, t in seen if s == "stdout") == result.stdout
    assert "".join(t for s, t in seen if s == "stderr") == result.stderr
    assert result.stdout == "".join(f"o{i}\n" for i in range(1, 6))
    assert result.stderr == "".join(f"e{i}\n" for i in range(1, 6))


@pytest.mark.both_readings
def test_multibyte_text_split_across_frames_and_a_reconnect(client, server):
    # Each printf is its own frame: the euro sign's three bytes arrive in three frames.
    script = "printf '\\342'; sleep 0.1; printf '\\202'; sleep 0.1; printf '\\254'; echo"
    server.drop_stream(after_frames=1)
    pieces = []
    result = client.execute(SANDBOX, script, shell=True, on_output=lambda s, t: pieces.append(t))
    assert result.stdout == "\u20ac\n"
    assert "".join(pieces) == "\u20ac\n"
    assert result.reconnects == 1


def test_large_output_is_exact(local_server):
    # A journal larger than the output: a reader slowed down by a loaded
    # machine must not turn this into a test of eviction (tested elsewhere).
    server = local_server(journal_limit=64 * 1024 * 1024)
    with make_client(server) as client:
        result = client.execute(SANDBOX, ["seq", "1", "300000"])
    assert result.stdout == "".join(f"{i}\n" for i in range(1, 300001))


@pytest.mark.both_readings
def test_attach_follows_a_process_started_elsewhere(client, server):
    result = client.execute(SANDBOX, "echo one; sleep 0.1; echo two", shell=True)
    again = client.attach(SANDBOX, result.process_id)
    assert again.stdout == "one\ntwo\n" and again.exit_code == 0
    assert again.args == "echo one; sleep 0.1; echo two"  # as it was given, out of the wrapper
    tail = client.attach(SANDBOX, result.process_id, after=1)
    assert tail.stdout == "two\n"


def test_staged_file_is_private_and_removed(client, server, tmp_path):
    result = client.execute(
        SANDBOX,
        ["sh", "-c", "ls -l /proc/self/fd/0; stat -L -c %a /proc/self/fd/0"],
        env={"A": "1"},
    )
    assert result.exit_code == 0
    assert "(deleted)" in result.stdout  # stdin is the staged file, already unlinked
    assert result.stdout.split()[-1] == "600"


def test_many_threads_share_one_client(client):
    results = {}

    def run(i):
        results[i] = client.execute(SANDBOX, ["sh", "-c", f"echo {i}; echo e{i} >&2"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {i: (r.stdout, r.stderr) for i, r in results.items()} == {
        i: (f"{i}\n", f"e{i}\n") for i in range(16)
    }


def test_logging_reconnects_at_info_requests_at_debug_without_secrets(client, server, caplog):
    server.drop_stream(after_frames=1)
    with caplog.at_level(logging.DEBUG, logger="createos_exec"):
        client.execute(SANDBOX, ["sh", "-c", "echo a; sleep 0.1; echo b"], env={"K": "envsecret"})
    messages = [r.getMessage() for r in caplog.records]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(m.startswith("POST /v1/sandboxes/sb_local/processes") for m in debug)
    assert any("resuming after seq 1" in m for m in info)
    assert all(server.api_key not in m and "envsecret" not in m for m in messages)
    assert all("?" not in m for m in debug)  # method + path only


@pytest.mark.both_readings
def test_combined_output_interleaves_in_write_order_across_a_reconnect(client, server):
    server.drop_stream(after_frames=3)
    # Each line is written once the one before has come here: the order is certain.
    script = "for i in 1 2 3 4; do echo o$i; read -r _; echo e$i >&2; read -r _; done"
    proc = client.start(SANDBOX, script, shell=True, stdin=cx.PIPE)
    for _ in proc.iter_output():
        proc.write("\n")
    result = proc.wait()
    assert result.output == "".join(f"o{i}\ne{i}\n" for i in range(1, 5))
    assert result.reconnects == 1 and not result.output_truncated


def test_combined_output_keeps_its_own_tail(client):
    # stderr is written once stdout has come here: the order is certain, whatever the load.
    script = "printf 12345678; read -r _; printf abcdefgh >&2"
    proc = client.start(SANDBOX, script, shell=True, max_output_chars=10, stdin=cx.PIPE)
    pieces = proc.iter_output()
    assert next(pieces) == ("stdout", "12345678")  # one write, one frame
    proc.write("go\n")
    assert list(pieces) == [("stderr", "abcdefgh")]
    result = proc.wait()
    assert (result.stdout, result.stderr) == ("12345678", "abcdefgh")
    assert not result.stdout_truncated and not result.stderr_truncated
    assert result.output == "78abcdefgh"
    assert result.combined_truncated and result.output_truncated


def test_echo_prints_live_output_to_the_matching_stream(client, capsys):
    client.execute(SANDBOX, "echo out; echo err >&2", shell=True, on_output=cx.echo)
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("out\n", "err\n")


def test_a_client_refuses_to_be_pickled(client):
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(client)


def test_arguments_larger_than_one_exec_string_limit(client):
    # Linux caps ONE execve string at 128 KiB; two 100 KiB arguments must still work.
    first, second = "a" * 100_000, "b" * 100_000
    result = client.execute(SANDBOX, ["printf", "%s|%s", first, second])
    assert result.exit_code == 0
    assert result.stdout == f"{first}|{second}"


def test_a_stream_without_chunking_is_still_delivered_as_it_arrives(tmp_path, local_server):
    """A proxy may remove the chunking: the body then ends only with the connection.

    The command prints one line, then waits (at most 10 s) until on_output has
    seen it before printing the next; output held back until the end of the
    body would show up as "held back".
    """
    seen = tmp_path / "seen"
    script = 'echo first; for _ in $(seq 100); do [ -e "$1" ] && break; sleep 0.1; done; '
    script += '[ -e "$1" ] && echo second || echo held back'
    delivered = []

    def on_output(stream, text):
        delivered.append(text)
        seen.touch()

    server = local_server(chunked=False)
    with make_client(server) as client:
        command = ["bash", "-c", script, "-", str(seen)]
        result = client.execute(SANDBOX, command, on_output=on_output)
        connects = [r for r in server.requests if r.path.endswith("/connect")]
    assert result.exit_code == 0 and result.stdout == "first\nsecond\n"
    assert delivered[0] == "first\n"
    assert result.reconnects == 0 and len(connects) == 1


# -- the open questions of docs/protocol.md §11 that change what a run sees ------------


@pytest.mark.both_readings
def test_the_exit_frame_may_wait_for_the_whole_tree(client, server):
    script = "sleep 0.6 >/dev/null 2>&1 & echo leader done"
    result = client.execute(SANDBOX, script, shell=True)
    assert (result.stdout, result.exit_code) == ("leader done\n", 0)
    if server.reading.exit_after == "tree":  # not before the background sleep ended
        assert result.duration >= 0.5
        assert server.process(result.process_id)["tree_exited"] is True


@pytest.mark.both_readings
@pytest.mark.parametrize("name", ["SIGKILL", "SIGTERM", "SIGPIPE", "SIGPROF", "SIGVTALRM"])
def test_the_client_names_a_killing_signal_in_either_spelling(client, server, name):
    result = client.execute(SANDBOX, f"kill -{name[3:]} $$", shell=True)
    assert (result.exit_code, result.signal) == (None, name)
