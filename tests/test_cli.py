"""The command line (docs/design.md "Command line"; docs/command-line.md):
the remote exit code, 128+N for signal N, 124 on timeout, 125 with one line
for the library's, the API's and the connection's errors (the ConfigError and
APIError rows of the failure table), 2 for a usage error; options reach the
command; `--json`; files in with `--put` and out with `--get`.

In this process with canned answers first, then as a real subprocess against
the local server. What needs a terminal is in tests/test_cli_pty.py; Ctrl-C's
termination of the remote tree (the "Ctrl-C" row) is in tests/test_containment.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, List

import pytest
import responses
from support import (
    BASE,
    EXIT0,
    FILES,
    KEY,
    PROCS,
    SANDBOX,
    SB,
    add_connect,
    add_created,
    add_deleted,
    add_stalled_connect,
    assert_deleted_once,
    body_of,
    calls,
    cli_argv,
    cli_env,
    closed_port,
    data,
    in_ci,
    make_client,
    nd,
    ok,
)

import createos_exec as cx

# -- in process, with canned answers ---------------------------------------------------


@pytest.fixture
def key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The API key in $CREATEOS_API_KEY, where the command line reads it."""
    monkeypatch.setenv("CREATEOS_API_KEY", KEY)


def run_main(*args: str) -> int:
    """main() in this process, against the canned service."""
    return cx.main(["--api-url", BASE, *args])


def test_cli_exit_code_and_separate_streams(
    rsps: responses.RequestsMock, key_in_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    add_created(rsps)
    add_connect(
        rsps,
        nd(
            data(1, "stdout", b"out-1\n"),
            data(2, "stderr", b"err-1\n"),
            data(3, "stdout", b"out-2\n"),
            {"type": "exit", "exit_code": 3},
        ),
    )
    assert run_main(SB, "--", "make", "test") == 3
    captured = capsys.readouterr()
    assert captured.out == "out-1\nout-2\n"
    assert captured.err == "err-1\n"
    body = body_of(calls(rsps, "POST", PROCS)[0])
    assert body["args"][3:] == ["make", "test"]


def test_cli_zero_exit(rsps: responses.RequestsMock, key_in_env: None) -> None:
    add_created(rsps)
    add_connect(rsps, nd(EXIT0))
    assert run_main(SB, "--", "true") == 0


@pytest.mark.parametrize("signal, code", [("SIGKILL", 137), ("terminated", 143), ("SIGINT", 130)])
def test_cli_signal_exit_code(
    rsps: responses.RequestsMock, key_in_env: None, signal: str, code: int
) -> None:
    add_created(rsps)
    add_connect(rsps, nd({"type": "exit", "signal": signal}))
    assert run_main(SB, "--", "sleep", "9") == code


def test_cli_timeout_is_124(
    rsps: responses.RequestsMock, key_in_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    add_created(rsps)
    add_stalled_connect(rsps, 0.3, nd())
    add_connect(rsps, nd(data(1, "stdout", b"bye\n"), {"type": "exit", "signal": "SIGTERM"}))
    add_deleted(rsps)
    assert run_main("--timeout", "0.15", SB, "--", "sleep", "100") == 124
    captured = capsys.readouterr()
    assert captured.out == "bye\n"
    (line,) = captured.err.splitlines()  # one line that says what happened
    assert line.startswith("python -m createos_exec: ")
    assert "timed out after 0.15 s" in line and "terminated" in line
    assert_deleted_once(rsps)


def test_cli_api_error_is_125_with_one_line(
    rsps: responses.RequestsMock, key_in_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    rsps.add(responses.POST, PROCS, status=403, json={"status": "fail", "data": "SECRET-BODY"})
    assert run_main(SB, "--", "true") == 125
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "python -m createos_exec: CreateOS answered HTTP 403 to process creation: the API key was "
        "refused for this (another account's sandbox, or a spent quota).\n"
    )
    assert KEY not in captured.err and "SECRET-BODY" not in captured.err


def test_cli_config_errors_are_125(
    rsps: responses.RequestsMock, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(SB, "--", "true") == 125  # no key
    err = capsys.readouterr().err
    assert err.startswith("python -m createos_exec: no API key: set ")
    assert "CREATEOS_API_KEY" in err and "api_key=" not in err  # the variable, not the keyword
    assert run_main("--json", SB, "--", "true") == 125
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "ConfigError" and "status" not in error
    assert cx.main(["--api-url", "http://api.example.test", SB, "--", "true"]) == 125
    assert len(rsps.calls) == 0


def test_cli_messages_carry_the_program_name_as_typed(
    monkeypatch: pytest.MonkeyPatch, key_in_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["/usr/local/bin/createos-exec"])
    assert cx.main(["--api-url", "http://api.example.test", SB, "--", "true"]) == 125
    assert capsys.readouterr().err.startswith("createos-exec: The API URL must use https")
    with pytest.raises(SystemExit):
        cx.main(["--timeout", "0", SB, "--", "true"])
    assert "createos-exec: error: argument --timeout" in capsys.readouterr().err


def test_cli_invalid_sandbox_is_125(
    rsps: responses.RequestsMock, key_in_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main("sb/../x", "--", "true") == 125
    assert len(rsps.calls) == 0
    assert capsys.readouterr().err.startswith("python -m createos_exec: Invalid sandbox id")


def test_cli_unreadable_stdin_file_is_125(
    rsps: responses.RequestsMock,
    key_in_env: None,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Any,
) -> None:
    assert run_main("--stdin", str(tmp_path / "missing"), SB, "--", "cat") == 125
    missing = tmp_path / "missing"
    assert capsys.readouterr().err == (
        f"python -m createos_exec: cannot read the --stdin file {missing}: "
        "No such file or directory.\n"
    )
    assert run_main("--stdin", str(tmp_path), SB, "--", "cat") == 125
    assert "Is a directory" in capsys.readouterr().err
    assert len(rsps.calls) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--env", "NOVALUE", SB, "--", "true"],
        ["--env", "", SB, "--", "true"],
        [SB],  # no command
        [SB, "--"],
        ["--shell", SB, "--", "echo", "two"],
        ["--put", "no-colon", SB, "--", "true"],
        ["--put", "here:relative/there", SB],
        ["--get", "relative:here", SB],
        ["--get", "/there:", SB],
        ["--json", "--get", "/there:-", SB],  # both would write to stdout
        ["--timeout", "soon", SB, "--", "true"],
        [],
        ["-t", SB, "--", "bash"],  # no terminal here
        ["-t", "--json", SB, "--", "bash"],
        ["-i", "-n", SB, "--", "cat"],
        ["--attach", "proc_1", SB, "--", "true"],
        ["--after", "3", SB, "--", "true"],
        ["--attach", "proc_1", "--after", "-1", SB],
    ],
)
def test_cli_usage_errors_exit_2(
    rsps: responses.RequestsMock,
    key_in_env: None,
    args: List[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        run_main(*args)
    assert info.value.code == 2
    assert len(rsps.calls) == 0


@pytest.mark.parametrize(
    "option, value, complaint",
    [
        *[
            ("--timeout", value, "positive number of seconds")
            for value in ("0", "-1", "nan", "soon")
        ],
        ("--env", "1A=2", "invalid name '1A': names must match [A-Za-z_][A-Za-z0-9_]*"),
        ("--env", "A-B=2", "invalid name 'A-B'"),
    ],
)
def test_cli_bad_option_value_is_a_usage_error_naming_the_option(
    option: str, value: str, complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        run_main(option, value, SB, "--", "true")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and complaint in err


def test_cli_env_shell_cwd_and_stdin_file(
    rsps: responses.RequestsMock, key_in_env: None, tmp_path: Any
) -> None:
    stdin_file = tmp_path / "in.bin"
    stdin_file.write_bytes(b"payload\n")
    rsps.add(responses.PUT, FILES, json=ok({}))
    add_created(rsps)
    add_connect(rsps, nd(EXIT0))
    options = ["--env", "A=b=c", "--env", "EMPTY=", "--cwd", "/work", "--stdin", str(stdin_file)]
    assert run_main(*options, "--shell", SB, "--", "cat | wc -c") == 0
    assert calls(rsps, "PUT", FILES)[0].request.body == b"A=b=c\0EMPTY=\0\0payload\n"
    args = body_of(calls(rsps, "POST", PROCS)[0])["args"]
    assert "\n_cx_enter '/work'\n" in args[1]
    assert args[1].endswith('exec bash -c -- "$1"\n') and args[3:] == ["cat | wc -c"]


def test_cli_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cx.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "124" in out and "125" in out and "128+N" in out and "usage error" in out
    assert "examples:" in out and "python -m createos_exec sb_123 -- uname -a" in out
    assert "CREATEOS_API_KEY" in out and "api_key=" not in out


# -- as a subprocess, against the local server ------------------------------------------


def run_cli(server, *args, stdin=None, **extra):
    return subprocess.run(
        cli_argv(*args),
        env=cli_env(server, **extra),
        input=stdin,
        capture_output=True,
        timeout=60,
    )


def test_options_reach_the_command(server):
    options = ["--cwd", "/usr", "--env", "A=b=c", "--stdin", "-", "--shell"]
    done = run_cli(server, *options, SANDBOX, "--", 'pwd; echo "$A"; cat', stdin=b"piped\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"/usr\nb=c\npiped\n"


def console_script():
    """The `createos-exec` script installed beside this Python (pip install -e . puts it there)."""
    script = shutil.which("createos-exec", path=os.path.dirname(sys.executable))
    if script is None:
        if in_ci():
            pytest.fail("the package was installed without its createos-exec script")
        pytest.skip("createos-exec is not installed beside this Python")
    return script


def test_the_console_script_is_the_same_command_line(server):
    script = console_script()
    version = subprocess.run([script, "--version"], capture_output=True, timeout=60)
    assert version.stdout.decode() == f"createos-exec {cx.__version__}\n"
    done = subprocess.run(
        [script, SANDBOX, "--", "sh", "-c", "echo out; echo err >&2; exit 3"],
        env=cli_env(server),
        capture_output=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, b"out\n", b"err\n")
    usage = subprocess.run([script, "--help"], capture_output=True, timeout=60)
    assert b"createos-exec --timeout 600" in usage.stdout


def test_output_bytes_pass_through_exactly(server):
    done = run_cli(
        server, "--shell", SANDBOX, "--", "printf 'a\\377\\342\\202\\254b'; printf '\\300' >&2"
    )
    assert done.returncode == 0
    assert done.stdout == b"a\xff\xe2\x82\xacb"
    assert done.stderr == b"\xc0"


def test_a_closed_local_pipe_stops_the_remote_command(server):
    reader = subprocess.Popen(["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    writer = subprocess.Popen(
        cli_argv("--shell", SANDBOX, "--", "while :; do echo y; sleep 0.01; done"),
        env=cli_env(server),
        stdout=reader.stdin,
        stderr=subprocess.PIPE,
    )
    reader.stdin.close()
    try:
        _, err = writer.communicate(timeout=30)
    finally:
        writer.kill()
        reader.wait(timeout=10)
    assert writer.returncode == 141
    assert err == b""
    (record,) = server.processes()
    assert server.wait_tree_gone(record["process_id"])


def test_json_prints_one_object_and_keeps_the_exit_code(server):
    script = "echo out; sleep 0.1; echo err >&2; exit 3"  # the sleep fixes the order
    done = run_cli(server, "--json", "--shell", SANDBOX, "--", script)
    assert done.returncode == 3
    assert done.stderr == b""
    (line,) = done.stdout.splitlines()
    result = json.loads(line)
    assert result["exit_code"] == 3 and result["returncode"] == 3
    assert (result["stdout"], result["stderr"]) == ("out\n", "err\n")
    assert result["output"] == "out\nerr\n"
    assert result["process_id"].startswith("proc_")
    assert result["timed_out"] is False and result["output_truncated"] is False
    assert result["args"] == script


def test_json_reports_errors_as_one_object(server):
    done = run_cli(server, "--json", "sb_missing", "--", "true")
    assert done.returncode == 125
    error = json.loads(done.stdout)["error"]
    assert (error["type"], error["status"]) == ("SandboxGoneError", 404)
    assert error["operation"] == "process creation"
    assert error["message"] == (
        "the sandbox sb_missing was not found (a wrong id, another region's, or one "
        "destroyed): nothing of this run runs there. Check the sandbox id, or run the "
        "command in another sandbox."
    )
    closed = f"http://127.0.0.1:{closed_port()}"
    unreachable = run_cli(server, "--json", SANDBOX, "--", "true", CREATEOS_API_URL=closed)
    error = json.loads(unreachable.stdout)["error"]
    assert error["type"] == "TransportError" and error["operation"] == "process creation"
    assert "status" not in error


def test_errors_say_what_to_do_in_the_librarys_own_sentences(server):
    done = run_cli(server, SANDBOX, "--", "true", CREATEOS_API_KEY="not-the-key")
    assert done.returncode == 125 and done.stdout == b""
    assert done.stderr == (
        b"python -m createos_exec: CreateOS answered HTTP 401 to process creation: "
        b"the API key was refused; check CREATEOS_API_KEY.\n"
    )
    assert b"not-the-key" not in done.stderr


# -- files: --put before the command, --get after it -------------------------------------


def test_files_go_in_before_the_command_and_come_out_after_whatever_it_exited(server, tmp_path):
    source = tmp_path / "src.txt"
    source.write_bytes(bytes(range(256)))
    remote = tmp_path / "sandbox"
    script = f"wc -c < {remote}/in/src.txt > {remote}/report.txt; exit 3"
    done = run_cli(
        server,
        *("--put", f"{source}:{remote}/in/src.txt", "--get", f"{remote}/report.txt:{tmp_path}/r"),
        *("--get", f"{remote}/in/src.txt:{tmp_path}/back.bin", "--shell", SANDBOX, "--", script),
    )
    assert (done.returncode, done.stderr) == (3, b"")
    assert (tmp_path / "r").read_bytes() == b"256\n"
    assert (tmp_path / "back.bin").read_bytes() == bytes(range(256))


def test_directories_move_a_file_comes_to_stdout_and_into_a_directory(server, tmp_path):
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "a.txt").write_bytes(b"alpha\n")
    (tmp_path / "src" / "sub" / "b").write_bytes(b"beta")
    remote = tmp_path / "sandbox" / "app"
    done = run_cli(
        server,
        *("--put", f"{tmp_path}/src:{remote}", "--get", f"{remote}:{tmp_path}/back"),
        *("--get", f"{remote}/a.txt:-", "--get", f"{remote}/a.txt:{tmp_path}/into/", SANDBOX),
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, b"alpha\n", b"")
    assert (tmp_path / "back" / "sub" / "b").read_bytes() == b"beta"
    assert (tmp_path / "into" / "a.txt").read_bytes() == b"alpha\n"


def test_json_lists_what_each_transfer_moved_with_the_result_or_the_error(server, tmp_path):
    (tmp_path / "a").write_bytes(b"alone")
    remote, sent = f"{tmp_path}/sandbox/a", hashlib.sha256(b"alone").hexdigest()
    put = {"option": "--put", "path": remote, "size": 5, "sha256": sent, "files": None}
    with_command = run_cli(
        server, "--json", "--put", f"{tmp_path}/a:{remote}", SANDBOX, "--", "true"
    )
    assert json.loads(with_command.stdout)["transfers"] == [put]
    alone = run_cli(server, "--json", "--get", f"{remote}:{tmp_path}/b", SANDBOX)
    got = dict(put, option="--get", path=f"{tmp_path}/b")
    assert json.loads(alone.stdout) == {"transfers": [got]}
    failed = run_cli(
        server, "--json", "--put", f"{tmp_path}/a:{remote}", "--get", "/no/such:here", SANDBOX
    )
    said = json.loads(failed.stdout)
    assert failed.returncode == 125 and said["transfers"] == [put]
    assert said["error"]["type"] == "TransferError"


def test_transfers_without_a_command_are_all_that_happens(server, tmp_path):
    (tmp_path / "a").write_bytes(b"alone")
    remote = f"{tmp_path}/sandbox/a"
    done = run_cli(
        server, "--put", f"{tmp_path}/a:{remote}", "--get", f"{remote}:{tmp_path}/b", SANDBOX
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    assert (tmp_path / "b").read_bytes() == b"alone"
    assert server.processes() == []


@pytest.mark.parametrize(
    "option, names",
    [("--put", "{tmp}/missing:{tmp}/remote"), ("--get", "{tmp}/missing:{tmp}/local")],
)
def test_a_failed_transfer_exits_125_and_names_the_file(server, tmp_path, option, names):
    spec = names.format(tmp=tmp_path)
    done = run_cli(server, option, spec, "--shell", SANDBOX, "--", f"touch {tmp_path}/ran")
    assert done.returncode == 125
    said = done.stderr.decode()
    assert said.startswith(f"python -m createos_exec: {option} {spec} failed: ")
    assert said.count("\n") == 1 and ("No such file" in said or "no such file" in said)
    assert os.path.exists(tmp_path / "ran") == (option == "--get")  # a --put first stops it
    assert not os.path.exists(tmp_path / "local")


def test_the_eviction_message_gives_a_line_that_fetches_the_output(server, tmp_path):
    line = str(cx.OutputEvictedError(3)).split("on the command line ")[1].split(" with ")[0]
    assert line == "--get /tmp/out.log:out.log"
    command = "seq 200000 > /tmp/out.log"
    done = subprocess.run(
        cli_argv(*line.split(), "--shell", SANDBOX, "--", command),
        env=cli_env(server),
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.log").read_bytes() == b"".join(b"%d\n" % n for n in range(1, 200001))


def test_files_come_out_after_a_command_that_failed_once_started(
    server, tmp_path, monkeypatch, capfd
):
    monkeypatch.setenv("CREATEOS_API_URL", server.url)
    monkeypatch.setenv("CREATEOS_API_KEY", server.api_key)
    server.corrupt_stream(b"not json\n", after_frames=1)
    remote = tmp_path / "made.txt"
    script = f"echo made > {remote}; echo one; sleep 0.5; echo two"
    code = cx.main(["--get", f"{remote}:{tmp_path}/here.txt", "--shell", SANDBOX, "--", script])
    assert code == 125
    assert "CreateOS sent an invalid answer" in capfd.readouterr().err
    assert (tmp_path / "here.txt").read_bytes() == b"made\n"


def test_a_stdin_that_is_no_terminal_is_forwarded_and_n_gives_eof(server):
    assert run_cli(server, SANDBOX, "--", "cat", stdin=b"hi\n").stdout == b"hi\n"
    assert run_cli(server, SANDBOX, "--", "wc", "-l", stdin=b"a\nb\nc\n").stdout.strip() == b"3"
    assert run_cli(server, "-n", SANDBOX, "--", "cat", stdin=b"hi\n").stdout == b""
    both = run_cli(server, "-n", "--stdin", "-", SANDBOX, "--", "cat")
    assert both.returncode == 2 and b"not allowed with" in both.stderr


def test_stdin_is_forwarded_as_it_comes_not_read_to_its_end_first(server):
    script = 'read x; echo "got $x"; read y; echo "got $y"'
    child = subprocess.Popen(
        cli_argv(SANDBOX, "--", "sh", "-c", script),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=cli_env(server),
    )
    try:
        child.stdin.write(b"one\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"got one\n"  # while this tool's stdin stays open
        child.stdin.write(b"two\n")
        child.stdin.close()
        assert child.stdout.read() == b"got two\n"
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("lost", [0, 1], ids=["delivered", "an answer lost"])
def test_forwarding_in_process_says_when_stdin_was_not_all_given(server, monkeypatch, capfd, lost):
    read, write = os.pipe()
    os.write(write, b"hi\n")
    os.close(write)
    for name, value in cli_env(server).items():
        monkeypatch.setenv(name, value)
    if lost:
        server.lose_input_response()
    with open(read, "rb") as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        assert cx.main([SANDBOX, "--", "cat"]) == 0
    out, err = capfd.readouterr()
    assert out == "hi\n"  # a lost answer's piece arrived all the same, once
    assert ("stdin was not all given to the command" in err) == bool(lost)


def test_only_a_stdin_that_is_a_real_file_and_no_terminal_without_i_is_forwarded(monkeypatch):
    master, terminal = os.openpty()
    with open(terminal, "rb") as tty, open(os.devnull, "rb") as null, open(master, "rb"):
        for stdin, forwarded in ((io.StringIO("x"), None), (None, None), (tty, None)):
            monkeypatch.setattr(sys, "stdin", stdin)
            assert cx._forwarded_stdin(interactive=False) is forwarded
        assert cx._forwarded_stdin(interactive=True) == tty.fileno()  # -i: its lines
        monkeypatch.setattr(sys, "stdin", null)
        assert cx._forwarded_stdin(interactive=False) == null.fileno()


def test_keys_typed_while_a_piece_is_sent_go_together_in_the_next_within_the_rate_limit(server):
    read, write = os.pipe()
    failures: List[Any] = []
    with make_client(server, rate_limit=(5, 1.0)) as client:
        cat = client.start(SANDBOX, ["cat"], stdin=cx.PIPE)
        forwarding = threading.Thread(target=cx._forward_stdin, args=(read, cat, failures))
        forwarding.start()
        for _ in range(200):  # a key every 3 ms: faster than 5 requests a second
            os.write(write, b"k")
            time.sleep(0.003)
        os.close(write)
        forwarding.join(30)
        result = cat.wait(timeout=30)
    os.close(read)
    assert result.stdout == "k" * 200 and failures == []
    # One at a time, each with what came meanwhile, within the window however
    # long a loaded machine took to type: never a request a key.
    sent = server.requests_to("input")
    assert len(sent) <= 5 * (sent[-1].time - sent[0].time + 1) and len(sent) <= 50


class Typed:
    """A process's stand-in that records what forwarding gives it."""

    def __init__(self, refusal: Any = None) -> None:
        self.given: List[Any] = []
        self.refusal = refusal

    def write(self, piece: bytes) -> None:
        self.given.append(piece)
        if self.refusal is not None:
            raise self.refusal

    def close_stdin(self) -> None:
        self.given.append("EOF")


def test_forwarding_ends_quietly_when_the_command_stops_reading_or_stdin_cannot_be_read():
    read, write = os.pipe()
    os.write(write, b"x")
    failures: List[Any] = []
    stopped = Typed(cx.StdinClosedError())
    cx._forward_stdin(read, stopped, failures)
    assert stopped.given == [b"x"] and failures == []
    os.close(write)
    os.close(read)
    unreadable = Typed()
    cx._forward_stdin(read, unreadable, failures)  # a closed descriptor: as its end
    assert unreadable.given == ["EOF"] and failures == []


def test_a_paused_sandbox_is_one_line_and_resume_goes_on_before_or_mid_run(server):
    server.pause()
    done = run_cli(server, SANDBOX, "--", "echo", "hi")
    assert done.returncode == 125 and done.stdout == b""
    assert done.stderr == (
        b"python -m createos_exec: the sandbox sb_local is paused: no process was started; "
        b"resume it, or run again with --resume.\n"
    )
    resumed = run_cli(server, "--resume", SANDBOX, "--", "echo", "hi")
    assert (resumed.returncode, resumed.stdout) == (0, b"hi\n")
    server.pause_at("connect", after_frames=1)  # paused again between its two lines
    script = "echo one; sleep 0.5; echo two >&2; exit 3"
    mid_run = run_cli(server, "--resume", "--shell", SANDBOX, "--", script)
    assert (mid_run.returncode, mid_run.stdout, mid_run.stderr) == (3, b"one\n", b"two\n")
    assert len(server.requests_to("sandbox_resume")) == 2


@pytest.mark.parametrize("change", ["pause", "destroy"])
def test_a_sandbox_paused_or_gone_mid_run_is_one_line_for_a_shell_user(server, change):
    getattr(server, change + "_at")("connect", after_frames=1)
    done = run_cli(server, "--shell", SANDBOX, "--", "echo one; sleep 1; echo two")
    assert done.returncode == 125 and done.stdout == b"one\n"
    line = done.stderr.decode()
    assert line.count("\n") == 1 and "client." not in line and "resume=" not in line
    expected = "is frozen with it, not ended" if change == "pause" else "was not found"
    assert expected in line
    assert cx._in_shell_words(
        cx.CleanupError(process_id="proc_1", sandbox_id="sb_1", unreachable=True)
    ).startswith("CreateOS could not be reached to terminate process proc_1: it may still run;")
    unknown = cx.SandboxError(
        "sb_1", "hibernating", status=409, operation="output connection", process_id="p_1", after=4
    )
    assert cx._in_shell_words(unknown) == (
        "the sandbox sb_1 is in a state this client does not know: process p_1 was not "
        "terminated and is no longer followed here; once the sandbox runs, --attach p_1 "
        "--after 4 follows it on."
    )


def test_attach_follows_a_process_from_after(server, client, monkeypatch, capfd):
    for name, value in cli_env(server).items():
        monkeypatch.setenv(name, value)
    process = client.start(SANDBOX, "echo one; sleep 0.3; echo two; exit 4", shell=True)
    process.wait()
    assert cx.main(["--attach", process.process_id, SANDBOX]) == 4
    assert capfd.readouterr().out == "one\ntwo\n"
    assert cx.main(["--attach", process.process_id, "--after", "1", SANDBOX]) == 4
    assert capfd.readouterr().out == "two\n"
