"""The examples run, and the docs show them as written."""

from __future__ import annotations

import os
import re

import pytest
from support import ROOT, run_example, shown_parts


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


def test_background_example_starts_a_server_uses_it_and_leaves_it():
    done = run_example("background.py")
    assert done.returncode == 0, done.stderr.decode()
    lines = done.stdout.decode().splitlines()
    assert len(lines) == 10, lines
    assert re.fullmatch(r"server started: proc_[A-Za-z0-9_-]+ poll\(\) -> None", lines[0])
    assert lines[1] == "fetched: hello from the sandbox"
    assert lines[2] == "server ended by SIGTERM poll() -> -15"
    assert re.fullmatch(r'its log: 127\.0\.0\.1 - - \[.+\] "GET / HTTP/1\.1" 200 -', lines[3])
    assert lines[4:7] == [
        "stdout: step 1 done",
        "stdout: step 2 done",
        "taken up: True | last: step 5 done | rc 0",
    ]
    assert lines[7:] == ["6 * 7 -> 42", "... -> 43", "the REPL said bye and exited 0"]


def test_the_example_marks_the_parts_the_docs_show():
    assert [(name, part) for name, part, _ in shown_parts()] == [
        ("README.md", "background processes"),
        ("docs/background-processes.md", "follow a log"),
        ("docs/background-processes.md", "a REPL"),
    ]


@pytest.mark.parametrize(
    "name, part, code", [pytest.param(*shown, id=shown[1]) for shown in shown_parts()]
)
def test_the_docs_show_the_background_examples_that_run(name, part, code):
    with open(os.path.join(ROOT, name), encoding="utf-8") as handle:
        text = handle.read()
    assert f"```python\n{code}\n```" in text, (name, part)
