"""The deadline holds when nobody waits (docs/design.md rule 12), with real processes.

With `timeout=T` the wrapper's watchdog terminates the tree in the sandbox at
T (SIGTERM, the grace period, SIGKILL) even when the client is gone: here a
real client process is killed with SIGKILL after `start()`. Everything else
stays as it was: a program that ends before T reports its own status, sees
the same argv, $0, cwd, env, stdin and output, keeps what it put in the
background, and the watchdog goes away with it. Every test runs against both
readings of the local server.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import pytest
from local_server import LocalServer
from support import (
    DAEMON,
    ROOT,
    SANDBOX,
    alive,
    campaign_size,
    daemon_pid,
    figures_at_end,
    make_client,
    require_cgroup,
    until,
)

import createos_exec as cx

if sys.platform == "win32":  # pragma: no cover - the local server is Linux only
    pytest.skip("POSIX signals and /proc", allow_module_level=True)

GRACE = cx._TERMINATE_GRACE  # the clients here have cleanup_timeout >= 2 s
SLACK = 1.0  # seconds allowed beyond the deadline and the grace period
# Clients killed at random: one batch of AT_ONCE in the suite, both scripts,
# killed before and after their process started, waiting or not.
RUNS = campaign_size("CREATEOS_DEADLINE_RUNS", 10, 20)
AT_ONCE = 10  # of those, how many run side by side

# Programs whose whole tree ignores SIGTERM (the ignored disposition is
# inherited), so only the watchdog's SIGKILL ends them.
IGNORES_TERM = "trap '' TERM; echo ready; sleep 60"
WITH_GRANDCHILD = "trap '' TERM; bash -c 'sleep 60 & wait' & echo ready; wait"

# A client in a process of its own: it creates the process, prints its id and
# then waits on it (or sleeps), until the test kills it with SIGKILL.
CLIENT = """\
import sys, time
import createos_exec as cx
url, key, script, timeout, wait = sys.argv[1:]
client = cx.Client(url, key, rate_limit=None)
proc = client.start("sb_local", script, shell=True, timeout=float(timeout))
print(proc.process_id, flush=True)
if wait == "wait":
    proc.wait()
time.sleep(60)
"""

KILLED: List[float] = []  # per killed client: seconds from its deadline to its tree gone


def killed_figures() -> Optional[Dict[str, float]]:
    if not KILLED:
        return None
    return dict(
        runs=len(KILLED),
        trees_left=sum(seconds == float("inf") for seconds in KILLED),
        median_seconds_to_gone=round(statistics.median(KILLED), 3),
        max_seconds_to_gone=round(max(KILLED), 3),
    )


_figures = figures_at_end("9. deadline kept in the sandbox", killed_figures)


def spawn_client(
    server: LocalServer, script: str, timeout: float, wait: bool
) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.url, server.api_key, script, str(timeout),
         "wait" if wait else "sleep"],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )  # fmt: skip


def seconds_to_gone(server: LocalServer, process_id: str, deadline: float) -> float:
    """Seconds from `deadline` (monotonic) to no process of the tree alive; inf: past the bound."""
    bound = deadline + GRACE + SLACK
    while server.tree_alive(process_id):
        if time.monotonic() > bound:
            return float("inf")
        time.sleep(0.02)
    return time.monotonic() - deadline


def killed_client_run(
    server: LocalServer, script: str, timeout: float, kill_after: float, wait: bool
) -> float:
    """Start `script` from a client process, SIGKILL it `kill_after` s after creation;
    the seconds from the deadline to the tree gone (inf: still there past the bound)."""
    child = spawn_client(server, script, timeout, wait)
    try:
        assert child.stdout is not None
        process_id = child.stdout.readline().strip()
        created = time.monotonic()  # the process exists: its deadline is no earlier than this + T
        assert process_id, "the client process did not create the process"
        time.sleep(kill_after)
        child.kill()
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    try:
        return seconds_to_gone(server, process_id, created + timeout)
    finally:
        # Nothing may stay behind, whatever the verdict: DELETE whatever is left.
        with make_client(server) as cleaner:
            cx._Endpoints(cx._Sandbox(cleaner._transport, SANDBOX), process_id).delete(grace=0.0)


# -- 1. the sandbox keeps the deadline -----------------------------------------


@pytest.mark.both_readings
@pytest.mark.parametrize(
    "script", [IGNORES_TERM, WITH_GRANDCHILD], ids=["ignores-term", "grandchild"]
)
def test_a_client_killed_after_start_leaves_no_tree_past_the_deadline(server, script):
    seconds = killed_client_run(server, script, 2.0, kill_after=0.0, wait=False)
    KILLED.append(seconds)
    assert seconds <= GRACE + SLACK, "the tree outlived its deadline"
    # The tree ignored SIGTERM: only the SIGKILL after the grace period ended it.
    assert seconds >= GRACE - 0.1


def test_clients_killed_at_random_moments_leave_no_tree(local_server):
    # Once, under the conservative reading: the alternative one is measured above.
    server = local_server()
    killed_at_random(server)


def killed_at_random(server: LocalServer) -> None:
    rng = random.Random(20261201)
    runs = [
        (rng.choice([IGNORES_TERM, WITH_GRANDCHILD]), rng.uniform(0.0, 1.0), rng.random() < 0.5)
        for _ in range(RUNS)
    ]
    results: Dict[int, float] = {}

    def one(index: int) -> None:
        script, kill_after, wait = runs[index]
        results[index] = killed_client_run(server, script, 1.0, kill_after, wait)

    for first in range(0, RUNS, AT_ONCE):
        threads = [
            threading.Thread(target=one, args=(index,))
            for index in range(first, min(first + AT_ONCE, RUNS))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(results) == RUNS
    KILLED.extend(results.values())
    assert max(results.values()) <= GRACE + SLACK, sorted(results.values())


@pytest.mark.both_readings
def test_the_watchdog_ends_a_tree_that_obeys_sigterm_at_once(server, monkeypatch):
    # A grace period long beside what a loaded machine takes to scan and signal
    # a tree: one gone well before it could end was ended by SIGTERM alone.
    monkeypatch.setattr(cx, "_TERMINATE_GRACE", 6.0)
    with make_client(server, cleanup_timeout=12.0) as client:
        assert client._transport.termination_grace == 6.0
        proc = client.start(SANDBOX, "sleep 60 & sleep 60", shell=True, timeout=1.0)
        created = time.monotonic()
        seconds = seconds_to_gone(server, proc.process_id, created + 1.0)
        assert seconds <= GRACE + SLACK, "the watchdog waited out its grace period"
        result = proc.wait()
    assert result.timed_out and result.exit_code is None and result.signal == "SIGTERM"


@pytest.mark.both_readings
def test_a_run_that_timed_out_leaves_no_double_forked_daemon(client, server, tmp_path):
    require_cgroup(server)  # a daemon leaves the process group: only its cgroup holds it
    result = client.execute(SANDBOX, DAEMON, shell=True, cwd=str(tmp_path), timeout=1.0)
    assert result.timed_out
    assert not alive(daemon_pid(str(tmp_path))) and not server.tree_alive(result.process_id)


@pytest.mark.both_readings
def test_a_result_waited_for_after_the_watchdog_fired_is_timed_out_with_grace_output(
    client, server
):
    script = (
        "trap 'echo in-grace; sleep 0.2; echo grace-done; exit 7' TERM; "
        "echo started; sleep 30 & wait"
    )
    proc = client.start(SANDBOX, script, shell=True, timeout=1.0)
    # Nobody waits: the sandbox keeps the deadline alone.
    assert server.wait_tree_gone(proc.process_id, 1.0 + GRACE + SLACK + 10)
    result = proc.wait()
    assert result.timed_out and result.exit_code is None
    assert result.stdout == "started\nin-grace\ngrace-done\n"


# -- 2. nothing else changes ---------------------------------------------------


@pytest.mark.both_readings
@pytest.mark.parametrize("later", [False, True], ids=["at-once", "waited-for-after-it"])
@pytest.mark.parametrize(
    "script, exit_code, signal",
    [("exit 3", 3, None), ("kill -SEGV $$", None, "SIGSEGV"), ("exit 0", 0, None)],
    ids=["exit-3", "sigsegv", "exit-0"],
)
def test_a_program_that_ends_before_its_deadline_reports_its_own_status(
    client, server, script, exit_code, signal, later
):
    if later:  # the client's deadline passes before anyone waits
        proc = client.start(SANDBOX, "echo out; " + script, shell=True, timeout=0.5)
        time.sleep(1.0)
        result = proc.wait()
        assert result.stdout == "out\n" and not server.tree_alive(proc.process_id)
    else:
        result = client.execute(SANDBOX, script, shell=True, timeout=30.0)
    assert (result.exit_code, result.signal, result.timed_out) == (exit_code, signal, False)


PROBE = [
    "bash",
    "-c",
    # argv and $0, cwd, env, stdin, the open fds, and whether it has a child it
    # did not start (os.waitpid would reap the watchdog if it were one)
    'printf "%s|" "$0" "$@"; echo; pwd; printf "%s\\n" "$SECRET_ONE"; cat; echo;'
    " ls /proc/self/fd | wc -l;"
    f' exec {sys.executable} -c \'import os\ntry: os.waitpid(-1, os.WNOHANG); print("child")\n'
    'except ChildProcessError: print("no child")\'',
    "zero",
    "a b",
    "it's",
]


def test_argv_cwd_env_stdin_and_output_are_those_of_a_run_without_timeout(client, server):
    options: Dict[str, Any] = dict(cwd="/tmp", env={"SECRET_ONE": "v'1 $x"}, stdin="in\nput")
    plain = client.execute(SANDBOX, PROBE, **options)
    watched = client.execute(SANDBOX, PROBE, timeout=30.0, **options)
    assert plain.stdout.endswith("no child\n") and plain.exit_code == 0, plain.stderr
    assert (watched.stderr, watched.exit_code, watched.signal) == (
        plain.stderr,
        plain.exit_code,
        plain.signal,
    )
    # The one difference: the program holds the write end of the pipe whose
    # end of file tells the watchdog that it ended.
    *seen, fds, child = plain.stdout.split("\n")[:-1]
    assert watched.stdout == "\n".join([*seen, str(int(fds) + 1), child, ""])
    record = server.process(watched.process_id)
    assert "v'1 $x" not in repr(record) and "in\nput" not in repr(record)  # staged, as before
    assert record["args"][2].startswith("createos_exec-")  # the marker


@pytest.mark.both_readings
def test_what_the_program_left_in_the_background_is_left_alone(client, server, tmp_path):
    pid_file = tmp_path / "background"
    script = f"sleep 3 </dev/null >/dev/null 2>&1 & echo $! >{pid_file}; echo out"
    proc = client.start(SANDBOX, script, shell=True, timeout=1.0)
    # The leader; under the alternative reading no exit frame comes before the tree ended.
    until(lambda: proc.poll() is not None)
    background = int(pid_file.read_text())
    try:
        time.sleep(1.0 + GRACE + 0.3)  # past the deadline and the grace period
        assert alive(background), "the watchdog killed what the program left behind"
    finally:
        if alive(background):
            os.kill(background, 9)
        assert server.wait_tree_gone(proc.process_id, 5.0)
    result = proc.wait()  # after the deadline, of a process that ended on its own
    assert (result.exit_code, result.timed_out, result.stdout) == (0, False, "out\n")


def test_the_watchdog_goes_with_the_program(client, server):
    proc = client.start(SANDBOX, ["true"], timeout=60.0)
    result = proc.wait()
    assert result.exit_code == 0 and not result.timed_out
    # `wait?scope=tree` waits for this: the watchdog leaves with the program,
    # not at its deadline, a minute away.
    assert server.wait_tree_gone(proc.process_id, 10.0), "the watchdog outlived the program"


def test_without_timeout_nothing_is_added_to_the_wrapper(client, server):
    plain = cx._plan(["true"], cx._Options()).body["args"][1]
    kept = cx._plan(["true"], cx._Options(timeout=5.0)).body["args"][1]
    assert "_cx_watch" not in plain and "_cx_scan" not in plain
    assert kept.startswith(plain.rsplit("\n", 2)[0]) and "_cx_watch" in kept
    result = client.execute(SANDBOX, ["true"])
    assert "_cx_watch" not in server.process(result.process_id)["args"][1]


@pytest.mark.parametrize("timeout", [1e-9, 1e12, float("inf")])
def test_any_timeout_makes_a_valid_wrapper(timeout):
    plan = cx._plan(["true"], cx._Options(timeout=timeout))
    checked = subprocess.run(["bash", "-n", "-c", plan.body["args"][1]], capture_output=True)
    assert checked.returncode == 0, checked.stderr


# -- 3. the record says whether the deadline fired --------------------------------


def record_times(created: Optional[str], finished: Optional[str]) -> Dict[str, Any]:
    return {"created_at": created, "finished_at": finished, "leader_exited": True}


@pytest.mark.parametrize(
    "created, finished, timeout, by_deadline",
    [
        ("2026-01-01T00:00:00Z", "2026-01-01T00:00:01.999Z", 2.0, False),
        ("2026-01-01T00:00:00Z", "2026-01-01T00:00:02Z", 2.0, True),
        ("2026-01-01T00:00:00.5Z", "2026-01-01T00:00:03.000000001Z", 2.5, True),
        ("2026-01-01T00:00:00+01:00", "2025-12-31T23:00:01z", 2.0, False),
        ("2026-01-01t00:00:00-00:30", "2026-01-01T00:30:05Z", 2.0, True),
        ("2026-01-01T00:00:59Z", "2026-01-01T00:01:00.5Z", 2.0, False),
        (None, "2026-01-01T00:00:01Z", 2.0, True),
        ("2026-01-01T00:00:00Z", None, 2.0, True),
        ("2026-13-01T00:00:00Z", "2026-01-01T00:00:01Z", 2.0, True),
        ("yesterday", "2026-01-01T00:00:01Z", 2.0, True),
        (1767225600, "2026-01-01T00:00:01Z", 2.0, True),
    ],
)
def test_ended_by_deadline_reads_the_records_times(created, finished, timeout, by_deadline):
    assert cx._ended_by_deadline(record_times(created, finished), timeout) is by_deadline
