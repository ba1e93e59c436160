"""Containment (docs/design.md rules 5 and 6): docs/failures.md's rows
"`timeout` expires", "`cancel` is set", "`on_output` raises", "Ctrl-C" and
"termination not confirmed".

First against the local server's real processes. The command's tree holds
children that ignore SIGTERM (a bash subshell with `trap '' TERM` and a
python child with SIG_IGN), so only the SIGKILL after the grace period of
`DELETE …?grace_ms=` removes them. For each interruption — a real SIGINT to
the command line, `cancel` set from another thread, an `on_output` that
raises, Ctrl-C inside the library, and `timeout` — the call must end the way
docs/design.md says, within the client's `cleanup_timeout` (plus a little slack)
of the interruption, and the whole tree must already be gone when it does:
the DELETE confirmed it, so nothing is awaited before looking. A second
Ctrl-C during a slow cleanup must end the command line at once.

Then with canned answers (responses): each route sends one DELETE with a
grace period, a 404 counts as gone, a termination that is not confirmed is a
CleanupError chained from the original error (Ctrl-C excepted), and a staged
file is removed.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import requests
import responses
from support import (
    CANNED_RETRY,
    CONNECT,
    DAEMON,
    EXEC,
    EXIT0,
    FILES,
    PID,
    PROC,
    PROCS,
    SANDBOX,
    SB,
    add_connect,
    add_created,
    add_deleted,
    add_stalled_connect,
    alive,
    assert_deleted_once,
    body_of,
    calls,
    chain,
    cli_argv,
    cli_env,
    daemon_pid,
    data,
    exited,
    figures_at_end,
    make_client,
    nd,
    ok,
    process_record,
    query,
    require_cgroup,
    until,
)

import createos_exec as cx

# The local server is Linux only; the canned answers at the end run anywhere.
posix_only = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and /proc")

CLEANUP = 5.0  # cleanup_timeout of the library clients here
CLI_CLEANUP = 30.0  # the command line's Client uses the default
SLACK = 1.5  # seconds allowed beyond the cleanup deadline
READY_TIMEOUT = 20.0  # for the tree to start and report

PY_CHILD = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('py-ready', flush=True)\n"
    "time.sleep(60)\n"
)
# Leader: a bash that prints during its grace period; children ignore SIGTERM.
TREE = (
    "(trap '' TERM; echo sub-ready; exec sleep 60) & sub=$!\n"
    f"{shlex.quote(sys.executable)} -c {shlex.quote(PY_CHILD)} & py=$!\n"
    'echo "pids $sub $py"\n'
    "trap 'echo grace-output; exit 0' TERM\n"
    "echo ready\n"
    "wait\n"
)

# One entry per scenario: (name, seconds from interruption to return, tree left).
SCENARIOS: List[Tuple[str, float, bool]] = []


def containment_figures() -> Optional[Dict[str, float]]:
    if not SCENARIOS:
        return None
    return dict(
        scenarios=len(SCENARIOS),
        trees_left=sum(left for _, _, left in SCENARIOS),
        max_return_seconds=round(max(seconds for _, seconds, _ in SCENARIOS), 3),
    )


_figures = figures_at_end("4. containment", containment_figures)


def ready_pids(text: str) -> List[int]:
    """The two child pids once every member of the tree has reported; else []."""
    lines = text.splitlines()
    pids = [line.split()[1:] for line in lines if line.startswith("pids ")]
    if not pids or not {"ready", "sub-ready", "py-ready"} <= set(lines):
        return []
    return [int(pid) for pid in pids[0]]


def assert_tree_gone(server: Any, process_id: str, pids: List[int]) -> None:
    # Immediately, without waiting: the confirmed DELETE already emptied it.
    assert not server.tree_alive(process_id)
    assert not [pid for pid in pids if alive(pid)]
    assert server.wait_tree_gone(process_id, timeout=5)
    deletes = server.requests_to("delete")
    assert deletes and deletes[-1].status == 200
    assert deletes[-1].path.endswith("/" + process_id)


def only_process(server: Any) -> str:
    (record,) = server.processes()
    return str(record["process_id"])


class Watch:
    """An on_output that notices when the whole tree is up, and what it printed."""

    def __init__(self) -> None:
        self.text = ""
        self.ready = threading.Event()
        self.pids: List[int] = []

    def __call__(self, stream: str, text: str) -> None:
        if stream == "stdout":
            self.text += text
        if not self.ready.is_set():
            self.pids = ready_pids(self.text)
            if self.pids:
                self.ready.set()
                self.on_ready()

    def on_ready(self) -> None:
        pass


# -- the command line: a real SIGINT ------------------------------------------------


def start_cli(server: Any) -> "subprocess.Popen[bytes]":
    return subprocess.Popen(
        cli_argv("--shell", SANDBOX, "--", TREE),
        env=cli_env(server),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def read_until_ready(child: "subprocess.Popen[bytes]") -> List[int]:
    """Read the CLI's stdout (bounded) until the whole remote tree has reported."""
    assert child.stdout is not None
    fd = child.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        pids = ready_pids(seen.decode("utf-8", "replace"))
        if pids:
            return pids
        left = deadline - time.monotonic()
        assert left > 0, f"the tree never reported ready: {seen!r}"
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            chunk = os.read(fd, 4096)
            assert chunk, f"the command line ended early: {seen!r}"
            seen += chunk


def finish(child: "subprocess.Popen[bytes]", timeout: float) -> Tuple[bytes, bytes]:
    try:
        return child.communicate(timeout=timeout)
    finally:
        reap(child)


def reap(child: "subprocess.Popen[bytes]") -> None:
    """Kill the command line if a test left it running."""
    if child.poll() is None:
        child.kill()
        child.communicate(timeout=10)


@posix_only
def test_sigint_to_the_cli_terminates_the_tree_then_exits_130(server):
    child = start_cli(server)
    try:
        pids = read_until_ready(child)
        process_id = only_process(server)
        assert server.tree_alive(process_id) and all(alive(pid) for pid in pids)
        child.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        _, err = finish(child, CLI_CLEANUP + SLACK)
        elapsed = time.monotonic() - interrupted
    finally:
        reap(child)
    assert child.returncode == 130
    assert err == b"python -m createos_exec: interrupted\n"
    assert elapsed <= CLI_CLEANUP + SLACK
    assert elapsed < 15  # the first DELETE confirms the tree gone: no retries waited for
    assert_tree_gone(server, process_id, pids)
    assert len(server.requests_to("delete")) == 1
    SCENARIOS.append(("cli SIGINT", elapsed, server.tree_alive(process_id)))


@posix_only
@pytest.mark.both_readings
def test_a_second_sigint_aborts_a_slow_cleanup_at_once(server):
    # Cleanup made slow: the first DELETE is answered 503 with Retry-After: 20,
    # which the default policy honours (cleanup deadline 30 s), so without a
    # second Ctrl-C the command line would sleep 20 s before trying again.
    server.fail("delete", 503, count=1, retry_after="20")
    child = start_cli(server)
    try:
        pids = read_until_ready(child)
        process_id = only_process(server)
        child.send_signal(signal.SIGINT)
        until(lambda: server.requests_to("delete"), 10, "the cleanup")
        time.sleep(1.0)  # no second DELETE meanwhile: none may come before Retry-After
        # Still cleaning up (waiting out Retry-After), and no second attempt yet.
        assert child.poll() is None
        assert [r.status for r in server.requests_to("delete")] == [503]
        child.send_signal(signal.SIGINT)
        second = time.monotonic()
        _, err = finish(child, 10)
        elapsed = time.monotonic() - second
    finally:
        reap(child)
    assert child.returncode == 130
    assert elapsed < 2.0
    assert err.decode() == (
        f"python -m createos_exec: interrupted again before the termination of process "
        f"{process_id} was confirmed: its remote tree may still run.\n"
    )
    # The aborted cleanup left the tree running (what a second Ctrl-C means):
    # terminate it ourselves through the API, then check nothing survived.
    assert server.tree_alive(process_id)
    answer = requests.delete(
        f"{server.url}/v1/sandboxes/{SANDBOX}/processes/{process_id}",
        params={"grace_ms": 100},
        headers={"X-Api-Key": server.api_key},
        timeout=30,
    )
    assert answer.status_code == 200 and answer.json()["data"]["tree_exited"] is True
    assert_tree_gone(server, process_id, pids)
    SCENARIOS.append(("second SIGINT", elapsed, server.tree_alive(process_id)))


# -- the library: cancel, a raising callback, Ctrl-C, timeout ----------------------------


@pytest.mark.both_readings
@posix_only
def test_cancel_from_another_thread_raises_cancelled_after_termination(server):
    cancel = threading.Event()
    watch = Watch()
    marks: Dict[str, float] = {}

    def cancel_when_ready() -> None:
        if watch.ready.wait(READY_TIMEOUT):
            marks["interrupted"] = time.monotonic()
            cancel.set()

    canceller = threading.Thread(target=cancel_when_ready, daemon=True)
    canceller.start()
    with make_client(server, cleanup_timeout=CLEANUP) as client:
        with pytest.raises(cx.CancelledError) as caught:
            client.execute(SANDBOX, TREE, shell=True, cancel=cancel, on_output=watch)
    returned = time.monotonic()
    canceller.join(timeout=5)
    elapsed = returned - marks["interrupted"]
    assert elapsed <= CLEANUP + SLACK
    error = caught.value
    assert error.result is not None and "py-ready" in error.result.stdout
    assert_tree_gone(server, error.process_id, watch.pids)
    SCENARIOS.append(("cancel", elapsed, server.tree_alive(error.process_id)))


class Boom(Exception):
    """The caller's own failure, raised from on_output."""


@posix_only
@pytest.mark.parametrize(
    "error_class, scenario",
    [(Boom, "raising on_output"), (KeyboardInterrupt, "KeyboardInterrupt")],
    ids=["raising callback", "ctrl-c"],
)
def test_what_on_output_raises_is_reraised_itself_after_termination(server, error_class, scenario):
    """A callback's own exception, or Ctrl-C inside the library: not wrapped."""
    raised: Dict[str, Any] = {}

    class Raiser(Watch):
        def on_ready(self) -> None:
            raised["error"] = error_class()
            raised["at"] = time.monotonic()
            raise raised["error"]

    watch = Raiser()
    with make_client(server, cleanup_timeout=CLEANUP) as client:
        with pytest.raises(error_class) as caught:
            client.execute(SANDBOX, TREE, shell=True, on_output=watch)
    elapsed = time.monotonic() - raised["at"]
    assert caught.value is raised["error"]
    assert elapsed <= CLEANUP + SLACK
    process_id = only_process(server)
    assert_tree_gone(server, process_id, watch.pids)
    SCENARIOS.append((scenario, elapsed, server.tree_alive(process_id)))


@posix_only
def test_timeout_returns_timed_out_after_termination(server):
    timeout = 2.5
    watch = Watch()
    with make_client(server, cleanup_timeout=CLEANUP) as client:
        started = time.monotonic()
        result = client.execute(SANDBOX, TREE, shell=True, timeout=timeout, on_output=watch)
    returned = time.monotonic()
    assert watch.ready.is_set(), "the tree was not up before the deadline"
    assert result.timed_out and result.exit_code is None and not result.ok
    assert "py-ready\n" in result.stdout and "sub-ready\n" in result.stdout
    assert result.stdout == watch.text  # delivered live, once
    elapsed = returned - (started + timeout)
    assert -0.1 <= elapsed <= CLEANUP + SLACK
    assert_tree_gone(server, result.process_id, watch.pids)
    SCENARIOS.append(("timeout", elapsed, server.tree_alive(result.process_id)))


GRACE = "trap 'echo grace-output; exit 0' TERM\necho ready\nsleep 60 & wait\n"


@pytest.mark.both_readings
@posix_only
def test_timeout_keeps_what_the_grace_period_printed(server):
    # Read on a stream opened before the DELETE: a service that forgets a
    # deleted process (§11.12) cannot lose it. The loop reads when the
    # deadline comes; on_output and the result see what it sees.
    handed: List[str] = []
    with make_client(server, cleanup_timeout=CLEANUP) as client:
        proc = client.start(
            SANDBOX, GRACE, shell=True, timeout=1.0, on_output=lambda _, text: handed.append(text)
        )
        looped = [text for _, text in proc.iter_output()]
        result = proc.wait()
    assert result.timed_out and result.exit_code is None
    assert "".join(looped) == "".join(handed) == result.stdout == "ready\ngrace-output\n"
    assert not server.tree_alive(result.process_id)


@posix_only
@pytest.mark.both_readings
def test_terminate_ends_a_double_forked_daemon_of_the_tree(server, tmp_path):
    require_cgroup(server)  # a daemon leaves the process group: only its cgroup holds it
    with make_client(server, cleanup_timeout=CLEANUP) as client:
        proc = client.start(SANDBOX, DAEMON, shell=True, cwd=str(tmp_path))
        daemon = daemon_pid(str(tmp_path))
        assert alive(daemon)
        proc.terminate()
    assert not alive(daemon) and not server.tree_alive(proc.process_id)
    assert proc.wait().signal == "SIGTERM"


# -- canned answers: each interruption ends with the tree terminated -------------------


def test_timeout_terminates_and_returns_grace_output(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_stalled_connect(rsps, 0.35, nd(data(1, "stdout", b"late")))
    add_connect(
        rsps,
        nd(
            data(1, "stdout", b"partial\n"),
            data(2, "stderr", b"grace\n"),
            {"type": "exit", "signal": "SIGTERM"},
        ),
    )
    add_deleted(rsps)
    result = make_client().execute(SB, ["sleep", "100"], timeout=0.2)
    assert result.timed_out is True
    assert result.exit_code is None
    assert result.stdout == "partial\n" and result.stderr == "grace\n"
    assert not result.ok
    methods = [(c.request.method, c.request.url.split("?")[0]) for c in rsps.calls]
    # The drain reads the grace output while the DELETE runs: their order is free.
    assert methods.count(("GET", CONNECT)) == 2
    assert_deleted_once(rsps)


def test_cancel_terminates(rsps: responses.RequestsMock) -> None:
    cancel = threading.Event()

    def created_then_cancelled(request: Any) -> Any:
        cancel.set()
        return (200, {}, json.dumps(ok(process_record())))

    rsps.add_callback(responses.POST, PROCS, callback=created_then_cancelled)
    add_connect(rsps, nd(data(1, "stdout", b"x"), EXIT0))
    add_deleted(rsps)
    with pytest.raises(cx.CancelledError) as info:
        make_client().execute(SB, ["true"], cancel=cancel)
    assert info.value.process_id == PID
    assert_deleted_once(rsps)


def test_cancel_before_creation_creates_nothing(rsps: responses.RequestsMock) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(cx.CancelledError) as info:
        make_client().execute(SB, ["true"], cancel=cancel)
    assert info.value.process_id is None
    assert not rsps.calls


def test_raising_callback_terminates_and_propagates(rsps: responses.RequestsMock) -> None:
    def on_output(stream: str, text: str) -> None:
        raise Boom()

    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"x"), EXIT0))
    add_deleted(rsps)
    with pytest.raises(Boom):
        make_client().execute(SB, ["true"], on_output=on_output)
    assert_deleted_once(rsps)


def test_keyboard_interrupt_reraised_even_if_cleanup_fails(rsps: responses.RequestsMock) -> None:
    def on_output(stream: str, text: str) -> None:
        raise KeyboardInterrupt

    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"x"), EXIT0))
    rsps.add(responses.DELETE, PROC, status=500, body="")
    with pytest.raises(KeyboardInterrupt):
        make_client().execute(SB, ["true"], on_output=on_output)
    assert 1 <= len(calls(rsps, "DELETE", PROC)) <= CANNED_RETRY.max_attempts


@pytest.mark.parametrize(
    "delete",
    [
        (500, ""),
        (200, json.dumps(ok(process_record(tree_exited=False)))),
        (200, json.dumps(ok(None))),
        (200, "garbage"),
        (403, json.dumps({"status": "fail", "data": "no"})),
    ],
    ids=["500", "tree not exited", "no record", "not json", "403"],
)
def test_unconfirmed_termination_is_cleanup_error(
    rsps: responses.RequestsMock, delete: Any
) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"x"), data(3, "stdout", b"y")))
    rsps.add(responses.DELETE, PROC, status=delete[0], body=delete[1])
    with pytest.raises(cx.CleanupError) as info:
        make_client().execute(SB, ["true"])
    err = info.value
    assert err.creation_unconfirmed is False
    assert err.process_id == PID
    assert isinstance(err.__cause__, cx.ProtocolError)
    assert err.result is not None and err.result.stdout == "x"


def test_delete_404_counts_as_gone(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd("[]"))
    rsps.add(responses.DELETE, PROC, status=404, json={"status": "fail", "data": "gone"})
    with pytest.raises(cx.ProtocolError):
        make_client().execute(SB, ["true"])
    assert len(calls(rsps, "DELETE", PROC)) == 1


def test_a_terminated_process_its_service_forgot_ends_as_the_delete_said(
    rsps: responses.RequestsMock,
) -> None:
    add_created(rsps)
    rsps.add(responses.DELETE, PROC, json=ok(exited(0, signal="SIGTERM")))
    rsps.add(responses.GET, CONNECT, status=404, json={"status": "fail", "data": "no such process"})
    proc = make_client().start(SB, ["sleep", "30"])
    proc.terminate()  # the stream of the grace period answers 404: forgotten once deleted
    assert (proc.wait().signal, proc.returncode) == ("SIGTERM", -signal.SIGTERM)
    assert len(calls(rsps, "DELETE", PROC)) == 1


def test_failure_after_creation_removes_staged_file(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.PUT, FILES, json=ok({}))
    add_created(rsps)
    add_connect(rsps, nd("[]"))
    add_deleted(rsps)
    rsps.add(responses.POST, EXEC, json=ok({"result": {"exit_code": 0}}))
    with pytest.raises(cx.ProtocolError):
        make_client().execute(SB, ["true"], stdin=b"data")
    staged = query(calls(rsps, "PUT", FILES)[0])["path"]
    (removal,) = calls(rsps, "POST", EXEC)  # with the spool the killed tree left
    assert body_of(removal)["args"][-1] == staged


# -- against the local server: a timeout whose termination is unconfirmed, and one
# interrupted during its grace period -----------------------------------------------


def private_classes(error: BaseException) -> List[str]:
    return [
        type(e).__name__
        for e in chain(error)
        if type(e).__module__ == cx.__name__ and type(e).__name__.startswith("_")
    ]


def test_unconfirmed_termination_after_a_timeout_keeps_the_partial_result(server):
    # Promises 5 and 6: the timeout's termination cannot be confirmed, so
    # CleanupError is raised; it carries the timed-out partial result with the
    # output read so far, and no private exception of the module is in its chain.
    server.fail("delete", 500, count=100)
    with make_client(server, cleanup_timeout=2.0) as client:
        with pytest.raises(cx.CleanupError) as caught:
            client.execute(SANDBOX, "echo started; sleep 30", shell=True, timeout=1.0)
    error = caught.value
    process_id = only_process(server)
    assert error.process_id == process_id and not error.creation_unconfirmed
    lost, private = error.result is None, private_classes(error)
    assert not lost and not private, (
        f"partial result lost: {lost}; private exceptions in the chain: {private}"
    )
    assert error.result.timed_out is True and error.result.exit_code is None
    assert error.result.stdout == "started\n"
    # The client could not confirm the termination, and said so; the sandbox
    # keeps the deadline itself (the wrapper's watchdog), so the tree goes
    # all the same, at the deadline and its grace period.
    assert server.wait_tree_gone(process_id)
    server.stop()  # the server's stop kills what the client could not
    assert not server.tree_alive(process_id)


# The leader prints during its grace period and takes 0.5 s more to exit, so
# the DELETE (grace 1 s with cleanup_timeout=5) is answered about 0.5 s after
# "bye" reached the client.
GRACEFUL = "trap 'echo bye; sleep 0.5; exit 0' TERM\necho started\nsleep 30 &\nwait\n"


def settle(server: Any) -> None:
    """Let a DELETE still in flight finish, so that nothing outlives the test."""
    until(lambda: server.requests_to("delete"), 15, "the DELETE")
    assert server.wait_tree_gone(only_process(server))


class CallbackFailed(Exception):
    """Raised by the test's on_output."""


@pytest.mark.parametrize("interruption", ["callback-raises", "ctrl-c", "cancel"])
def test_an_interruption_during_the_grace_period_returns_after_the_delete_answered(
    server, interruption
):
    # Promise 5: after a callback that raises, Ctrl-C or cancel, the tree is
    # terminated, confirmed, before the error reaches the caller; here each
    # comes while the timeout's DELETE is waiting out the grace period.
    cancel = threading.Event()
    raised = CallbackFailed("from on_output")

    def on_output(stream: str, text: str) -> None:
        if "bye" not in text:
            return
        if interruption == "callback-raises":
            raise raised
        if interruption == "ctrl-c":
            raise KeyboardInterrupt
        cancel.set()

    caught: Optional[BaseException] = None
    with make_client(server, cleanup_timeout=5.0) as client:
        try:
            client.execute(
                SANDBOX, GRACEFUL, shell=True, timeout=1.0, on_output=on_output, cancel=cancel
            )
        except BaseException as exc:
            # At once, before anything else can happen: was the DELETE answered?
            answered = [r.status for r in server.requests_to("delete")]
            alive = server.tree_alive(only_process(server))
            caught = exc
    settle(server)
    assert caught is not None, "execute() returned instead of raising"
    assert answered == [200] and not alive, (
        f"{type(caught).__name__} reached the caller before the DELETE was answered "
        f"(DELETE answers {answered}, tree alive: {alive})"
    )
    if interruption == "callback-raises":
        assert caught is raised or (
            isinstance(caught, cx.CreateOSError) and any(e is raised for e in chain(caught))
        ), repr(caught)
    elif interruption == "ctrl-c":
        assert type(caught) is KeyboardInterrupt
    else:
        assert isinstance(caught, cx.CancelledError), repr(caught)


def test_cancel_is_prompt_even_without_heartbeats(local_server):
    # No byte for a minute and a long idle timeout: the cancel must not wait
    # for the next byte (or for the idle timeout) to be seen.
    server = local_server(heartbeat_interval=60)
    with make_client(server, stream_idle_timeout=30) as client:
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()
        started = time.monotonic()
        with pytest.raises(cx.CancelledError) as caught:
            client.execute(SANDBOX, "echo go; sleep 30", shell=True, cancel=cancel)
        assert time.monotonic() - started < 3
        assert server.wait_tree_gone(caught.value.process_id)
    watchers = [t for t in threading.enumerate() if t.name == "createos_exec-cancel"]
    for watcher in watchers:
        watcher.join(timeout=5)  # it ends within one poll of the cancel event
    assert not [watcher for watcher in watchers if watcher.is_alive()]
