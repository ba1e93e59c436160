"""Executes from a ProcessPoolExecutor: results and errors cross the process boundary intact.

The workers are fresh "spawn" interpreters: everything they return or raise
reaches the parent by pickle. Each worker builds its own Client from the
environment (a Client is not meant to cross); the local server runs in threads
of this process and the workers only talk HTTP to it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor

import pytest
from support import SANDBOX, run_example

import createos_exec as cx

RESULT_TIMEOUT = 60  # seconds to wait for any one future

# (command, options): exit codes, both streams, multi-byte text, a signal, a timeout.
RUNS = [
    (["echo", "one"], {}),
    (["sh", "-c", "echo two; echo 'to stderr' >&2; exit 3"], {}),
    ("printf 'caf\\303\\251 \\342\\202\\254\\n'", {"shell": True}),
    (["sh", "-c", "kill -TERM $$"], {}),
    (["sh", "-c", "echo started; sleep 30"], {"timeout": 1.0}),
]
EXPECTED = [
    dict(exit_code=0, signal=None, timed_out=False, stdout="one\n", stderr="", returncode=0),
    dict(exit_code=3, signal=None, timed_out=False, stdout="two\n", stderr="to stderr\n"),
    dict(exit_code=0, signal=None, timed_out=False, stdout="caf\u00e9 \u20ac\n", stderr=""),
    dict(exit_code=None, signal="SIGTERM", timed_out=False, stdout="", returncode=-15),
    dict(exit_code=None, timed_out=True, stdout="started\n", stderr=""),
]


def observable(result):
    """Everything a caller can see of a result, except its process id and duration.

    The interleaving of stdout and stderr in `output` depends on thread timing
    on the server, so `output` is compared as its set of lines.
    """
    seen = {
        field.name: getattr(result, field.name)
        for field in dataclasses.fields(cx.ExecResult)
        if field.name not in ("process_id", "duration", "output")
    }
    seen.update(
        output_lines=sorted(result.output.splitlines(keepends=True)),
        output_truncated=result.output_truncated,
        returncode=result.returncode,
        ok=result.ok,
    )
    return seen


@pytest.fixture
def pool(server, monkeypatch):
    # The workers are spawned after this, so they inherit the API settings.
    monkeypatch.setenv("CREATEOS_API_URL", server.url)
    monkeypatch.setenv("CREATEOS_API_KEY", server.api_key)
    monkeypatch.delenv("CREATEOS_SANDBOX_API_KEY", raising=False)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=3, mp_context=context) as executor:
        yield executor


def in_pool(pool, command, **options):
    """`cx.execute` in a worker: its result, or the error it raised, in the parent."""
    return pool.submit(cx.execute, SANDBOX, command, **options)


def raised_there_and_here(pool, expected, sandbox, command, **options):
    """What `cx.execute` raises in a worker, as the parent gets it, and what the
    same call raises here; both must be `expected`."""
    future = pool.submit(cx.execute, sandbox, command, **options)
    with pytest.raises(expected) as there:
        future.result(timeout=RESULT_TIMEOUT)
    with pytest.raises(expected) as here:
        cx.execute(sandbox, command, **options)
    return there.value, here.value


def test_results_cross_the_process_boundary_intact(server, pool):
    futures = [in_pool(pool, command, **options) for command, options in RUNS]
    pooled = [future.result(timeout=RESULT_TIMEOUT) for future in futures]
    direct = [cx.execute(SANDBOX, command, **options) for command, options in RUNS]

    for (command, _), result, same, expected in zip(RUNS, pooled, direct, EXPECTED):
        assert type(result) is cx.ExecResult
        assert observable(result) == observable(same)
        assert {name: getattr(result, name) for name in expected} == expected
        assert result.args == command
        assert sorted(result.output.splitlines()) == sorted(
            (result.stdout + result.stderr).splitlines()
        )
        assert result.duration > 0
        assert isinstance(result.process_id, str) and result.process_id
    assert pooled[4].duration >= 1.0  # it ran until its own deadline

    pooled_ids = [result.process_id for result in pooled]
    direct_ids = [result.process_id for result in direct]
    assert len(set(pooled_ids + direct_ids)) == 2 * len(RUNS)  # one process per execute
    records = {record["process_id"]: record for record in server.processes()}
    assert set(records) == set(pooled_ids + direct_ids)
    assert records[pooled_ids[1]]["exit_code"] == 3
    assert records[pooled_ids[3]]["signal"] == "SIGTERM"
    for process_id in pooled_ids:
        assert server.wait_tree_gone(process_id, timeout=10)


def test_a_command_error_arrives_as_a_command_error(server, pool):
    command = ["sh", "-c", "echo partial; echo oops >&2; exit 5"]
    error, same = raised_there_and_here(pool, cx.CommandError, SANDBOX, command, check=True)

    assert type(error) is cx.CommandError and type(error.result) is cx.ExecResult
    # What the message and the attributes say is test_errors' row; here: they arrive whole.
    assert str(error) == str(same).replace(same.process_id, error.process_id)
    assert (error.returncode, error.cmd, error.stdout) == (5, command, "partial\n")
    assert (error.output, error.stderr) == (same.output, same.stderr)
    assert observable(error.result) == observable(same.result)
    assert error.result.stdout == "partial\n" and error.result.exit_code == 5
    assert error.process_id == error.result.process_id
    assert error.process_id in {record["process_id"] for record in server.processes()}
    assert error.process_id != same.process_id


def test_a_timeout_or_signal_with_check_arrives_as_a_command_error(pool):
    timed = in_pool(pool, ["sh", "-c", "echo t; sleep 30"], timeout=1.0, check=True)
    killed = in_pool(pool, ["sh", "-c", "kill -KILL $$"], check=True)

    with pytest.raises(cx.CommandError) as raised:
        timed.result(timeout=RESULT_TIMEOUT)
    assert raised.value.result.timed_out is True and raised.value.result.stdout == "t\n"
    assert raised.value.process_id == raised.value.result.process_id is not None
    assert "timed out" in str(raised.value)

    with pytest.raises(cx.CommandError) as raised:
        killed.result(timeout=RESULT_TIMEOUT)
    assert raised.value.returncode == -9
    assert raised.value.result.signal == "SIGKILL"
    assert f"(process {raised.value.process_id}) was killed by SIGKILL;" in str(raised.value)


def test_a_config_error_arrives_as_a_config_error_and_value_error(server, pool):
    error, same = raised_there_and_here(pool, cx.ConfigError, "not a sandbox!", ["true"])

    assert type(error) is cx.ConfigError and str(error) == str(same)
    assert error.process_id is None and error.result is None
    assert server.requests == []  # found before anything was sent


def test_an_api_error_keeps_its_status_and_operation(server, pool):
    error, same = raised_there_and_here(pool, cx.APIError, "sb_unknown", ["true"])

    assert type(error) is cx.SandboxGoneError  # an APIError: the sandbox was looked at
    assert (error.status, error.operation) == (same.status, same.operation)
    assert (error.status, error.operation) == (404, "process creation")
    assert (error.sandbox_id, error.sandbox_status) == ("sb_unknown", "not found")
    assert str(error) == str(same)
    assert error.process_id is None


def test_the_example_runs():
    done = run_example("process_pool.py")
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    assert done.stderr == b""
    process_id = r"process_id=proc_[A-Za-z0-9_-]+"
    assert re.search(
        r"\['echo', 'hello from a worker'\]: exit_code=0 .*stdout='hello from a worker\\n' "
        r"stderr='' " + process_id,
        out,
    )
    assert re.search(r"exit_code=0 .*stdout='42\\n'", out)
    assert re.search(r"exit_code=3 signal=None returncode=3 stdout='' stderr='to stderr\\n'", out)
    assert "exit_code=None signal=SIGTERM returncode=-15" in out
    assert re.search(
        r"CommandError: The command 'sh' \(process proc_[A-Za-z0-9_-]+\) exited with "
        r"status 4; what it printed is in \.stderr and \.stdout\. returncode=4 "
        r"stdout='about to fail\\n' " + process_id,
        out,
    )
    assert "also a subprocess.CalledProcessError: True" in out
