"""The README's quick-start command works as written."""

from __future__ import annotations

from conftest import run_example


def test_quickstart_runs_and_shows_a_resumed_stream():
    done = run_example("quickstart.py")
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    assert "out| hello from a sandbox" in out
    assert "out| SHOUT THIS" in out and "err| oops" in out and "exit_code=3" in out
    assert "resuming after seq 3" in out
    lines = [line for line in out.splitlines() if "out| line" in line]
    assert lines == [f"  out| line {i}" for i in range(1, 7)]
    assert "reconnects=1" in out
    assert "timed_out=True" in out
