"""No process left behind by a 429, a cancel noticed at once in every wait of a
run, and one deadline for every request of it (docs/design.md rules 1, 5 and 6).

Against the real local server: a proxy that forwards a creation and answers
429 is its `refuse_created` fault; the waits are long `Retry-After`s (5 s)
on every endpoint a run waits on, a pacing window of one request per 30 s,
and the cancel comes while the client waits. Each run ends with every tree
the server started gone.
"""

from __future__ import annotations

import functools
import itertools
import random
import signal
import statistics
import threading
import time

import pytest
from support import (
    FAST_RETRY,
    NO_RETRY,
    SANDBOX,
    THREE_TRIES,
    TWO_TRIES,
    Listener,
    closed_port,
    make_client,
)

import createos_exec as cx

# A Retry-After that no test waits out, and that fits in the retry budget and
# the cleanup's deadline (10 s both), which a longer one would end at once.
LONG = "5"
BOUND = 0.5  # seconds from the cancel to the error: 0.1 s, plus the containment and slack
SLEEPER = ["sleep", "30"]
SEED = 20261201
LATENCIES: dict[str, list[float]] = {}


def assert_nothing_runs(server):
    for record in server.processes():
        assert server.wait_tree_gone(record["process_id"], 5.0), record["process_id"]


# -- 3. no process left behind by a 429 ----------------------------------------------


@pytest.mark.both_readings
def test_429_when_the_deadline_allows_no_other_attempt_terminates_what_it_created(server):
    server.refuse_created(retry_after=LONG)
    with make_client(server) as client:
        started = time.monotonic()
        with pytest.raises(cx.APIError) as caught:
            client.start(SANDBOX, SLEEPER, timeout=1.0, env={"SECRET": "s"})
    assert caught.value.status == 429
    assert time.monotonic() - started < 5  # the 30 s were never waited
    (created,) = server.processes()
    assert not server.tree_alive(created["process_id"])
    assert len(server.requests_to("create")) == 1
    assert len(server.requests_to("exec")) == 1  # the staged file removed


@pytest.mark.both_readings
def test_429_whose_process_cannot_be_looked_up_is_unconfirmed(server):
    server.refuse_created(retry_after="0")
    server.fail("list", 500, count=10)
    with make_client(server, retry=NO_RETRY) as client:
        with pytest.raises(cx.CleanupError) as caught:
            client.start(SANDBOX, SLEEPER)
    assert caught.value.creation_unconfirmed
    assert len(server.requests_to("create")) == 1
    # Left running, as the error says (the server's stop kills it).
    (created,) = server.processes()
    assert server.tree_alive(created["process_id"])


@pytest.mark.both_readings
@pytest.mark.parametrize("schedule", list(itertools.product("pf", repeat=3)), ids="".join)
def test_429s_answered_to_forwarded_creations_at_every_attempt(server, schedule, figures):
    """Every schedule of plain (p) and forwarded (f) 429s over the three attempts
    allowed: the first forwarded one is followed when another attempt was
    allowed, terminated when it was the last; nothing is sent after it."""
    for answer in schedule:
        if answer == "p":
            server.fail("create", 429, retry_after="0")
        else:
            server.refuse_created(retry_after="0")
    first = schedule.index("f") if "f" in schedule else None
    with make_client(server, retry=THREE_TRIES) as client:
        try:
            with client.start(SANDBOX, SLEEPER) as process:
                followed = process.process_id
        except cx.APIError as refused:
            assert refused.status == 429
            followed = None
    if first is not None and first < len(schedule) - 1:
        assert followed is not None
    else:
        assert followed is None
    attempts = len(schedule) if first is None else first + 1
    assert len(server.requests_to("create")) == attempts
    assert len(server.processes()) == (first is not None)
    assert_nothing_runs(server)
    figures.record(
        "11. 429 behind a forwarded creation",
        runs=1,
        forwarded=schedule.count("f"),
        followed=int(followed is not None),
        terminated=int(first is not None and followed is None),
        left_running=0,
    )


# -- 4. a cancel is noticed at once, in every wait -------------------------------------


class Canceller:
    """Sets the cancel event (or calls `act`) `delay` seconds after the server
    has answered the next request of `endpoint`, and keeps when."""

    def __init__(self, server, endpoint, *, delay=0.2, act=None):
        self.event = threading.Event()
        self._act = act or self.event.set
        self.at = None
        count = len(server.requests_to(endpoint)) + 1
        self._thread = threading.Thread(
            target=self._run, args=(server, endpoint, count, delay), daemon=True
        )
        self._thread.start()

    def _run(self, server, endpoint, count, delay):
        limit = time.monotonic() + 20
        while len(server.requests_to(endpoint)) < count and time.monotonic() < limit:
            time.sleep(0.005)
        time.sleep(delay)
        self.at = time.monotonic()
        self._act()

    def latency(self):
        """Seconds from the cancel to now (the error raised)."""
        now = time.monotonic()
        self._thread.join(5)
        assert self.at is not None
        return now - self.at


def _creation_refused(server):
    server.fail("create", 429, retry_after=LONG)
    return "create", {}, 0


def _forwarded_creation_refused(server):
    server.refuse_created(retry_after=LONG)
    return "create", {}, 1


def _connect_refused(server):
    server.fail("connect", 429, retry_after=LONG)
    return "connect", {}, 1


def _wait_refused(server):
    # Two broken connects spend the policy: then the `wait` long-poll, answered 429.
    server.fail("connect", 503, count=2)
    server.fail("wait", 429, retry_after=LONG)
    return "wait", {"client": {"retry": TWO_TRIES}}, 1


def _delete_refused(server):
    # The deadline's DELETE is answered 429: the cancel ends its wait and the
    # DELETE goes at once, confirmed.
    server.fail("delete", 429, retry_after=LONG)
    return "delete", {"run": {"timeout": 0.3}}, 1


_PERIODS = itertools.count()


def _pacing(server):
    # One request per 30 s: the creation takes the place, the connect waits. A
    # window of its own for each run (a window is shared by origin, limit and period).
    period = 30.0 + next(_PERIODS) / 1000
    return "create", {"client": {"rate_limit": (1, period)}}, 1


def _staging(server):
    server.fail("files_put", 503, retry_after=LONG)
    return "files_put", {"run": {"env": {"SECRET": "s"}}}, 0


def _listing(server):
    server.fail("create", 429, retry_after="0")
    server.fail("list", 429, retry_after=LONG)
    return "list", {}, 0


WAITS = {
    "creation Retry-After": _creation_refused,
    "forwarded creation Retry-After": _forwarded_creation_refused,
    "connect Retry-After": _connect_refused,
    "wait Retry-After": _wait_refused,
    "delete Retry-After": _delete_refused,
    "pacing window": _pacing,
    "staging Retry-After": _staging,
    "listing Retry-After": _listing,
}


def cancelled_run(server, wait, delay=0.2):
    """Run SLEEPER with the cancel set `delay` s into `wait`; the seconds it took to raise."""
    creations, processes = len(server.requests_to("create")), len(server.processes())
    endpoint, settings, created = WAITS[wait](server)
    canceller = Canceller(server, endpoint, delay=delay)
    with make_client(server, **settings.get("client", {})) as client:
        try:
            result = client.execute(
                SANDBOX, SLEEPER, cancel=canceller.event, **settings.get("run", {})
            )
        except cx.CancelledError as cancelled:
            assert (cancelled.process_id is None) == (created == 0)
            assert ("nothing was created" in str(cancelled)) == (created == 0)
        else:  # the deadline ended the run before the cancel: only its DELETE waited
            assert wait == "delete Retry-After" and result.timed_out
        latency = canceller.latency()
    assert len(server.requests_to("create")) <= creations + 1  # none sent after a cancel
    assert len(server.processes()) == processes + created
    assert_nothing_runs(server)
    LATENCIES.setdefault(wait, []).append(latency)
    return latency


@pytest.mark.parametrize("run", [dict(), dict(env={"SECRET": "s"}, stdin="staged")])
@pytest.mark.both_readings
def test_a_cancel_set_before_the_call_creates_nothing(server, run):
    cancel = threading.Event()
    cancel.set()
    with make_client(server) as client:
        with pytest.raises(cx.CancelledError) as caught:
            client.start(SANDBOX, SLEEPER, cancel=cancel, **run)
    assert str(caught.value) == (
        "The command was cancelled before its process was created: nothing was created."
    )
    assert caught.value.process_id is None and server.requests == []


@pytest.mark.parametrize("wait", list(WAITS))
def test_cancel_ends_every_wait_at_once(server, wait):
    assert cancelled_run(server, wait) < BOUND


@pytest.mark.both_readings
@pytest.mark.parametrize("wait", list(WAITS))
def test_cancel_at_random_moments_of_every_wait(server, wait, figures):
    rng = random.Random(f"{SEED} {wait} {server.reading.name}")
    latencies = [cancelled_run(server, wait, rng.uniform(0.0, 0.3)) for _ in range(2)]
    assert max(latencies) < BOUND
    figures.record(
        "12. cancel in every wait",
        runs=len(latencies),
        left_running=0,
        seed=SEED,
        max_latency_ms=round(max(latencies) * 1000),
    )


@pytest.mark.parametrize(
    "wait",
    [
        "forwarded creation Retry-After",
        "connect Retry-After",
        "staging Retry-After",
        "wait Retry-After",
    ],
)
def test_ctrl_c_ends_every_wait_at_once(server, wait):
    """Ctrl-C, a real SIGINT to the thread that waits, as the cancel does. (Its
    cleanup then goes at the pace of the window and of the service, which a
    second Ctrl-C ends: see test_containment.)"""
    processes = len(server.processes())
    endpoint, settings, created = WAITS[wait](server)
    interrupt = functools.partial(signal.pthread_kill, threading.get_ident(), signal.SIGINT)
    with make_client(server, **settings.get("client", {})) as client:
        interrupter = Canceller(server, endpoint, act=interrupt)
        with pytest.raises(KeyboardInterrupt):
            client.execute(SANDBOX, SLEEPER, **settings.get("run", {}))
        assert interrupter.latency() < BOUND
    assert len(server.processes()) == processes + created
    assert_nothing_runs(server)


def test_cancel_ends_a_write_waiting_to_send_again(server):
    server.fail("input", 429, retry_after=LONG)
    canceller = Canceller(server, "input")
    with make_client(server) as client:
        proc = client.start(SANDBOX, ["cat"], stdin=cx.PIPE, cancel=canceller.event)
        with pytest.raises(cx.CancelledError) as caught:
            proc.write("refused once, never sent again")
        assert canceller.latency() < BOUND  # the tree terminated by then, as a cancel ends a run
        assert caught.value.process_id == proc.process_id
        assert not server.tree_alive(proc.process_id)
        with pytest.raises(cx.CancelledError):
            proc.wait()
    assert [r.status for r in server.requests_to("input")] == [429]


def test_cancel_ends_a_wait_for_port_and_its_probe(server):
    with make_client(server) as client:
        canceller = Canceller(server, "create", delay=0.5)  # half a second into the wait
        proc = client.start(SANDBOX, SLEEPER, cancel=canceller.event)
        with pytest.raises(cx.CancelledError) as caught:
            proc.wait_for_port(closed_port(), timeout=20)
        assert canceller.latency() < BOUND  # the tree terminated by then, as a cancel ends a run
        assert caught.value.process_id == proc.process_id
    assert_nothing_runs(server)  # the probe included


def test_cancel_latencies_are_reported(figures):
    """The medians, per wait, of every cancel measured in this module's run."""
    for wait, latencies in sorted(LATENCIES.items()):
        print(f"{wait}: median {statistics.median(latencies):.3f} s, n={len(latencies)}")
    measured = [latency for latencies in LATENCIES.values() for latency in latencies]
    if measured:
        median = round(statistics.median(measured) * 1000)
        figures.record("12. cancel in every wait", median_latency_ms=median)


# -- 5. one deadline for every request of a run --------------------------------------


class BlackHole(Listener):
    """A listening socket that accepts connections and never answers."""

    def __init__(self):
        self._held = []
        super().__init__(self._held.append)

    def close(self):
        super().close()
        for connection in self._held:
            connection.close()


@pytest.mark.parametrize("staged", [False, True], ids=["creation", "staging"])
def test_requests_take_their_timeouts_from_the_deadline(staged):
    hole = BlackHole()
    try:
        options = {"env": {"SECRET": "s"}} if staged else {}
        client = make_client(
            api_url=hole.url, request_timeout=30.0, cleanup_timeout=1.0, retry=FAST_RETRY
        )
        started = time.monotonic()
        with client, pytest.raises((cx.TransportError, cx.CleanupError)) as caught:
            client.execute(SANDBOX, ["true"], timeout=1.0, **options)
        elapsed = time.monotonic() - started
    finally:
        hole.close()
    # 1 s of the deadline, then the cleanup's own 1 s to look for the marker
    # (and to remove the staged file): never request_timeout's 30.
    assert elapsed < 5.0
    if not staged:  # a creation the deadline cut is ambiguous: looked for, unconfirmed
        assert isinstance(caught.value, cx.CleanupError) and caught.value.creation_unconfirmed
