"""`python -m createos_exec` in a REAL pseudo-terminal (pexpect) against the local server.

A pipe hides what a user at a terminal sees: that output arrives live, that
both streams reach the screen, and that the Ctrl-C key (the terminal driver's
SIGINT to the foreground process group) stops the remote tree before the CLI
exits 130.

Only what needs a terminal is here; the rest of the command line is in
tests/test_cli.py.
"""

from __future__ import annotations

import io
import sys
import time

import pytest
from support import ROOT, SANDBOX, cli_argv, cli_env, require

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
