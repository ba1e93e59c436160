"""The sandbox around the process (design item 17): looked at once when something
failed, paused or gone said as such, resumed with resume=True, client.sandbox()
and client.resume(). Against the local server, under both readings where the
answers of a paused or destroyed sandbox (protocol §11.14, 17-19) decide."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import random
import shlex
import sys
import time

import pytest
import requests
import responses

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from local_server import LocalServer  # noqa: E402
from support import (  # noqa: E402
    BASE,
    CONNECT,
    EXIT0,
    PID,
    PROC,
    PROCS,
    SB,
    add_connect,
    add_created,
    add_deleted,
    assert_deleted_once,
    calls,
    campaign_size,
    data,
    make_client,
    nd,
    ok,
    process_record,
)

import createos_exec as cx  # noqa: E402

SANDBOX = "sb_local"
# Twenty numbered lines, one each 50 ms: a pause after 3 frames falls mid-run.
COUNT = "for i in $(seq 1 20); do echo $i; sleep 0.05; done"
COUNTED = "".join("%d\n" % i for i in range(1, 21))
SHORT = cx.RetryPolicy(max_attempts=4, budget=2.0, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture
def lifecycle(local_server):
    """A server of the test's reading whose resumes take 0.2 s, and a client of it.
    Its frames hold two bytes at most: COUNT's first nine lines are a frame each,
    however a loaded machine bunches them."""
    local = local_server(resume_seconds=0.2, frame_limit=2)
    with make_client(local, retry=SHORT) as client:
        yield local, client


def counting_until(fault, error, client):
    """The error a counting run ends in when `fault` (pause_at, destroy_at) meets
    it after its third line."""
    fault("connect", after_frames=3)
    with pytest.raises(error) as caught:
        client.execute(SANDBOX, COUNT, shell=True)
    return caught.value


@pytest.mark.both_readings
def test_a_pause_mid_run_is_a_paused_error_with_the_cursor_and_nothing_terminated(lifecycle):
    server, client = lifecycle
    paused = counting_until(server.pause_at, cx.SandboxPausedError, client)
    assert isinstance(paused, cx.SandboxError) and isinstance(paused, cx.APIError)
    assert (paused.sandbox_id, paused.sandbox_status, paused.after) == (SANDBOX, "paused", 3)
    assert paused.result is not None and paused.result.stdout == "1\n2\n3\n"
    assert "client.process('sb_local', '%s', after=3)" % paused.process_id in str(paused)
    assert server.requests_to("delete") == [] and len(server.requests_to("sandbox")) == 1
    assert server.tree_alive(paused.process_id)  # frozen, not ended
    if server.reading.resume_keeps_processes:  # taken up again, nothing lost or repeated
        again = client.process(SANDBOX, paused.process_id, after=paused.after, resume=True)
        rest = again.wait()
        assert paused.result.stdout + rest.stdout == COUNTED and rest.exit_code == 0
    else:  # the service lost it: said, never filled in
        assert client.resume(SANDBOX).running
        with pytest.raises(cx.APIError) as lost:
            client.process(SANDBOX, paused.process_id, after=paused.after)
        assert lost.value.status == 404 and "is running." in str(lost.value)


@pytest.mark.both_readings
def test_a_sandbox_destroyed_mid_run_is_gone_with_nothing_to_terminate(lifecycle):
    server, client = lifecycle
    gone = counting_until(server.destroy_at, cx.SandboxGoneError, client)
    expected = "destroyed" if server.reading.destroyed_view == 200 else "not found"
    assert (gone.sandbox_status, gone.result.stdout) == (expected, "1\n2\n3\n")
    assert "nothing of this run" in str(gone) and gone.process_id is not None
    assert server.requests_to("delete") == [] and len(server.requests_to("sandbox")) == 1
    assert server.wait_tree_gone(gone.process_id)


@pytest.mark.both_readings
def test_a_handle_whose_sandbox_was_destroyed_polls_and_waits_gone(lifecycle):
    server, client = lifecycle
    proc = client.start(SANDBOX, ["sleep", "30"])
    assert proc.poll() is None and server.destroy()
    for call in (proc.poll, proc.wait):  # not the 404 of a process endpoint
        with pytest.raises(cx.SandboxGoneError) as caught:
            call()
        assert caught.value.process_id == proc.process_id
    assert server.requests_to("delete") == []


@pytest.mark.both_readings
def test_resume_true_goes_on_at_the_cursor_or_says_the_process_was_lost(lifecycle):
    server, client = lifecycle
    server.pause_at("connect", after_frames=3)
    server.pause_at("connect", after_frames=5)  # paused twice
    if server.reading.resume_keeps_processes:
        result = client.execute(SANDBOX, COUNT, shell=True, resume=True)
        assert (result.stdout, result.exit_code) == (COUNTED, 0)  # exactly, as without a pause
        assert len(server.requests_to("sandbox_resume")) == 2
        return
    with pytest.raises(cx.APIError) as caught:
        client.execute(SANDBOX, COUNT, shell=True, resume=True)
    lost = caught.value
    assert "lost the process across the sandbox's pause" in str(lost)
    assert lost.status == 404 and lost.result.stdout == "1\n2\n3\n"
    assert server.wait_tree_gone(lost.process_id)


# A character cut by the pause: its first byte, then the rest once the sandbox was paused.
CUT_BY_THE_PAUSE = "printf 'a\\303'; until [ -e %s ]; do sleep 0.01; done; printf '\\251b\\n'"


@pytest.mark.parametrize("text", [True, False], ids=["text", "bytes"])
@pytest.mark.both_readings
def test_a_pause_resumed_mid_run_hands_out_exactly_what_the_result_holds(
    local_server, server_reading, tmp_path, text
):
    # Either reading's pause (a reset or a clean end, then 409 or 404), with processes kept.
    reading = dataclasses.replace(server_reading, resume_keeps_processes=True)
    server = local_server(reading=reading, resume_seconds=0.2)
    go, handed = tmp_path / "go", []

    def pause_at_the_first_piece(stream: str, piece) -> None:
        if not handed:
            assert server.pause()
            go.touch()  # the rest is printed once the tree is thawed
        handed.append(piece)

    with make_client(server, retry=SHORT) as client:
        proc = client.start(
            SANDBOX,
            CUT_BY_THE_PAUSE % shlex.quote(str(go)),
            shell=True,
            resume=True,
            text=text,
            on_output=pause_at_the_first_piece,
        )
        looped = [piece for _, piece in proc.iter_output()]
        result = proc.wait()
    whole = "a\u00e9b\n" if text else "a\u00e9b\n".encode()
    assert whole[:0].join(handed) == whole[:0].join(looped) == result.stdout == whole
    assert result.exit_code == 0 and len(server.requests_to("sandbox_resume")) == 1


@pytest.mark.both_readings
def test_a_sandbox_on_its_way_back_is_waited_for_without_resume(lifecycle):
    server, client = lifecycle
    paused: list = []

    def pause_and_resume_once(stream: str, text: str) -> None:
        if not paused:
            paused.append(server.pause() and server.resume())  # "resuming" for 0.2 s

    if server.reading.resume_keeps_processes:
        result = client.execute(SANDBOX, COUNT, shell=True, on_output=pause_and_resume_once)
        assert (result.stdout, result.exit_code) == (COUNTED, 0)
        assert server.requests_to("sandbox_resume") == []  # nothing asked of it
    else:
        with pytest.raises(cx.APIError, match="lost the process"):
            client.execute(SANDBOX, COUNT, shell=True, on_output=pause_and_resume_once)
    assert paused == [True]


@pytest.mark.both_readings
def test_a_sandbox_found_paused_before_creation_is_said_or_resumed(lifecycle):
    server, client = lifecycle
    server.pause()
    with pytest.raises(cx.SandboxPausedError) as caught:
        client.execute(SANDBOX, ["echo", "hi"])
    assert caught.value.process_id is None and "no process was started" in str(caught.value)
    assert server.processes() == []
    result = client.execute(SANDBOX, ["echo", "hi"], resume=True)
    assert result.stdout == "hi\n" and len(server.processes()) == 1


@pytest.mark.both_readings
def test_a_write_to_a_paused_sandbox_is_no_broken_pipe(lifecycle):
    server, client = lifecycle
    with client.start(SANDBOX, ["cat"], stdin=cx.PIPE) as proc:
        proc.write("one\n")
        server.pause()
        with pytest.raises(cx.SandboxPausedError) as caught:
            proc.write("two\n")
        assert caught.value.process_id == proc.process_id
        client.resume(SANDBOX)
        if server.reading.resume_keeps_processes:
            proc.close_stdin()
            assert proc.wait().stdout == "one\n"
        else:
            with pytest.raises(cx.APIError, match="is running"):  # lost in the pause
                proc.wait()
    with client.start(SANDBOX, ["true"], stdin=cx.PIPE) as ended:
        ended.wait()
        with pytest.raises(cx.StdinClosedError):  # the sandbox runs: a broken pipe
            ended._stdin.write("late", cx._ENDLESS)


def test_a_trivial_command_asks_nothing_of_the_sandbox(server, client):
    assert client.execute(SANDBOX, ["true"]).exit_code == 0
    assert [r.method for r in server.requests] == ["POST", "GET"]


@pytest.mark.both_readings
def test_client_sandbox_and_resume(lifecycle):
    server, client = lifecycle
    assert client.sandbox(SANDBOX) == cx.SandboxInfo(SANDBOX, "running", True)
    assert client.resume(SANDBOX).running and server.requests_to("sandbox_resume") == []
    server.pause()
    assert client.sandbox(SANDBOX) == cx.SandboxInfo(SANDBOX, "paused", False)
    with pytest.raises(cx.SandboxPausedError):  # still resuming at its timeout
        client.resume(SANDBOX, timeout=0.05)
    assert client.resume(SANDBOX, timeout=10) == cx.SandboxInfo(SANDBOX, "running", True)
    server.destroy()
    expected = "destroyed" if server.reading.destroyed_view == 200 else "not found"
    assert client.sandbox(SANDBOX).status == expected
    with pytest.raises(cx.SandboxGoneError):
        client.resume(SANDBOX)
    with pytest.raises(cx.ConfigError):
        client.execute(SANDBOX, ["true"], resume="yes")


# -- an outage of the API (design item 17, its last sentences) ----------------------

# Forty lines, one each 50 ms: an outage of a second falls in the middle.
LONG_COUNT = "for i in $(seq 1 40); do echo $i; sleep 0.05; done"
LONG_COUNTED = "".join("%d\n" % i for i in range(1, 41))
# A budget of 1.5 s, as the default's 60 s scaled down: its attempts spread over it.
OUTAGE_RETRY = cx.RetryPolicy(max_attempts=8, budget=1.5, initial_backoff=0.01, max_backoff=0.1)


def outage_at_the_first_output(server, seconds: float, comebacks: list):
    """An on_output that takes the API down for `seconds` when the first output arrives."""

    def take_down(stream: str, text: str) -> None:
        if not comebacks:
            comebacks.append(server.outage(seconds))

    return take_down


def test_an_outage_shorter_than_the_budget_costs_nothing(server):
    comebacks: list = []
    with make_client(server, retry=OUTAGE_RETRY, stream_idle_timeout=0.5) as client:
        result = client.execute(
            SANDBOX,
            LONG_COUNT,
            shell=True,
            on_output=outage_at_the_first_output(server, 1.0, comebacks),
        )
    assert (result.stdout, result.exit_code) == (LONG_COUNTED, 0)
    assert result.reconnects >= 1 and not comebacks[0].is_alive()


def test_past_the_budget_the_error_says_how_to_take_the_process_up_again(server):
    with make_client(
        server, retry=OUTAGE_RETRY, stream_idle_timeout=0.5, cleanup_timeout=1.0
    ) as client:
        comebacks: list = []
        take_down = outage_at_the_first_output(server, 8.0, comebacks)  # past every budget
        proc = client.start(SANDBOX, LONG_COUNT, shell=True, on_output=take_down)
        with pytest.raises(cx.CleanupError) as caught:
            proc.wait()
        unconfirmed = caught.value
        assert unconfirmed.unreachable and not unconfirmed.creation_unconfirmed
        # The cursor of what was accepted (lines may share a frame: the end checks it).
        assert unconfirmed.after >= 1 and unconfirmed.args == (str(unconfirmed),)
        taken_up = "client.process('sb_local', '%s', after=%d)" % (
            proc.process_id,
            unconfirmed.after,
        )
        assert "could not be reached" in str(unconfirmed) and taken_up in str(unconfirmed)
        assert "destroy" not in str(unconfirmed)  # the honest advice: it runs on
        comebacks[0].join()
        rest = client.process(SANDBOX, proc.process_id, after=unconfirmed.after).wait()
    assert unconfirmed.result.stdout + rest.stdout == LONG_COUNTED  # nothing lost


# -- the campaign (RELIABILITY.md item 13) ------------------------------------------
#
# The sandbox paused (resumed by the run with resume=True, or not) or destroyed
# at a random moment of a run: its creation, its stream, its recovery, the
# grace period of its termination, a write, wait_for_port; under both readings.
# Each run ends in the exact result or in the right error with nothing lost
# before it, and, once the sandbox runs again and what it says to do is done,
# nothing left running.
#
#   CREATEOS_SANDBOX_RUNS=360      # runs (default: 36, each moment, change and
#                                  # reading once; 360 in the full campaign)
#   CREATEOS_SANDBOX_SEED=20261202 # base seed; run i uses base + i

MOMENTS = ("creation", "streaming", "recovery", "grace", "write", "wait_for_port")
CHANGES = ("pause, resume=True", "pause", "destroy")
COMBINATIONS = [
    (moment, change, reading)
    for moment in MOMENTS
    for change in CHANGES
    for reading in ("conservative", "alternative")
]
THIRTY = "for i in $(seq 1 30); do echo $i; sleep 0.02; done"
THIRTY_LINES = "".join("%d\n" % i for i in range(1, 31))
CAMPAIGN_POLICY = cx.RetryPolicy(max_attempts=3, budget=2.0, initial_backoff=0.01, max_backoff=0.02)
SERVE = (
    "import socket,time;time.sleep(0.3);s=socket.socket();"
    "s.bind(('127.0.0.1',%d));s.listen();time.sleep(30)"
)


def queue_change(server, moment: str, change: str, rng) -> None:
    at = server.destroy_at if change == "destroy" else server.pause_at
    if moment == "creation":
        at("create")
    elif moment == "streaming":
        at("connect", after_frames=rng.randint(0, 28))
    elif moment == "recovery":  # the stream keeps failing, then the status is asked
        server.drop_stream(after_frames=rng.randint(0, 10))
        server.fail("connect", 503, count=CAMPAIGN_POLICY.max_attempts)
        at("wait")
    else:
        at({"grace": "delete", "write": "input", "wait_for_port": "get"}[moment])


def take_up(client, server, error, ends: bool) -> str:
    """What the run's error says to do, once the sandbox runs: the rest of the output
    of a paused process that `ends` by itself, or its termination; nothing for one
    gone."""
    if isinstance(error, cx.SandboxPausedError):
        assert server.sandbox_status() == "paused"
        client.resume(SANDBOX)
        if error.process_id is not None and server.reading.resume_keeps_processes:
            proc = client.process(SANDBOX, error.process_id, after=error.after or 0)
            with proc:
                return proc.wait(timeout=30).stdout if ends else ""
    return ""


def run_one(server, client, moment: str, change: str, rng) -> str:
    """One run: what it ended in. Asserts that nothing was lost or repeated, in the
    result and in what on_output was handed."""
    resume = change == "pause, resume=True"
    handed: list = []
    if moment != "write":
        queue_change(server, moment, change, rng)
    try:
        if moment == "grace":
            # a deadline that a loaded machine's creation cannot outrun
            client.execute(SANDBOX, ["sleep", "30"], timeout=2.0, resume=resume)
            raise AssertionError("the DELETE met a sandbox that runs")
        if moment == "write":
            with client.start(SANDBOX, ["cat"], stdin=cx.PIPE, resume=resume) as proc:
                proc.write("a\n")
                queue_change(server, moment, change, rng)
                try:
                    proc.write("b\n")
                except cx.SandboxError as error:
                    assert error.process_id == proc.process_id
                    paused = isinstance(error, cx.SandboxPausedError)
                    if not (paused and server.reading.resume_keeps_processes):
                        raise
                    client.resume(SANDBOX)
                    proc.write("b\n")  # it did not arrive: 409 and 404 come before any write
                proc.close_stdin()
                assert proc.wait().stdout == "a\nb\n"
                return "exact"
        if moment == "wait_for_port":
            port = rng.randint(20000, 60000)
            with client.start(SANDBOX, ["python3", "-c", SERVE % port], resume=resume) as proc:
                proc.wait_for_port(port, timeout=10)
                return "exact"
        result = client.execute(
            SANDBOX, THIRTY, shell=True, resume=resume, on_output=lambda _, t: handed.append(t)
        )
        assert (result.stdout, "".join(handed), result.exit_code) == (THIRTY_LINES,) * 2 + (0,)
        return "exact"
    except cx.CreateOSError as error:
        expected = cx.SandboxGoneError if change == "destroy" else cx.SandboxPausedError
        lost = resume and not server.reading.resume_keeps_processes
        if isinstance(error, cx.APIError) and "lost the process" in str(error):
            assert lost and moment in ("streaming", "recovery", "wait_for_port"), error
        elif isinstance(error, cx.StdinClosedError):  # the write's process lost in the pause
            assert moment == "write" and not server.reading.resume_keeps_processes
        else:
            assert isinstance(error, expected), repr(error)
        before = error.result.stdout if error.result is not None else ""
        ends = moment in ("creation", "streaming", "recovery")
        assert not ends or "".join(handed) == before  # what was handed out is its result
        rest = take_up(client, server, error, ends)
        if ends and error.process_id and rest:
            assert before + rest == THIRTY_LINES  # nothing lost, nothing repeated
        else:
            assert THIRTY_LINES.startswith(before) or moment != "streaming"
        return type(error).__name__


def campaign_settings():
    runs = campaign_size("CREATEOS_SANDBOX_RUNS", len(COMBINATIONS), 10 * len(COMBINATIONS))
    return runs, int(os.environ.get("CREATEOS_SANDBOX_SEED", "20261202"))


def test_the_sandbox_paused_resumed_or_destroyed_at_random_moments(figures):
    runs, seed = campaign_settings()
    outcomes: dict = {}
    failures = []

    def one(i: int) -> None:
        moment, change, reading = COMBINATIONS[i % len(COMBINATIONS)]
        rng = random.Random(seed + i)
        try:
            with LocalServer(heartbeat_interval=0.5, reading=reading, resume_seconds=0.1) as server:
                with make_client(server, retry=CAMPAIGN_POLICY, cleanup_timeout=5.0) as client:
                    outcome = run_one(server, client, moment, change, rng)
                if server.sandbox_status() == "paused":
                    server.resume()
                    server._await(lambda: server.sandbox_status() == "running", 5.0)
                for record in server.processes():  # nothing left running
                    pid = record["process_id"]
                    if not server.wait_tree_gone(pid, 35.0):
                        raise AssertionError("the tree of %s was left running" % pid)
            key = (moment, change, outcome)
            outcomes[key] = outcomes.get(key, 0) + 1
        except BaseException as exc:  # reported with its seed below
            failures.append(
                "run %d (seed %d, %s, %s, %s): %r" % (i, seed + i, moment, change, reading, exc)
            )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(runs)))
    assert not failures, "\n".join(failures[:5])
    by_outcome: dict = {}
    for (_, _, outcome), count in outcomes.items():
        by_outcome[outcome] = by_outcome.get(outcome, 0) + count
    figures.record("14. the sandbox around the process", runs=runs, seed=seed, **by_outcome)


# The outage of the API at random moments of a run, for random lengths around
# its retry budget (0.3 to 4 budgets of 1 s, the default's 60 s scaled down):
# shorter than 0.8 budgets it must cost nothing; longer, the run may end in a
# CleanupError that says how to take the process up again, which must then
# give the rest of its output, nothing lost or repeated, or, when the API is
# back in time for the DELETE, in a confirmed termination.
#
#   CREATEOS_OUTAGE_RUNS=60        # runs (default: 8; 60 in the full campaign)

OUTAGE_BUDGET = dataclasses.replace(OUTAGE_RETRY, budget=1.0)


def run_through_outage(client, take_down, comebacks) -> tuple:
    """(how the run ended, the whole output it gives): "exact"; "taken_up", the
    process followed on after the CleanupError that says how; "terminated", the
    retry policy spent but the API back in time to confirm the termination."""
    try:
        result = client.execute(SANDBOX, LONG_COUNT, shell=True, on_output=take_down)
        return "exact", result.stdout
    except cx.StreamEndedError as ended:
        return "terminated", ended.result.stdout
    except cx.CleanupError as unreachable:
        assert unreachable.unreachable, repr(unreachable)
        comebacks[0].join()
        proc = client.process(SANDBOX, unreachable.process_id, after=unreachable.after)
        return "taken_up", unreachable.result.stdout + proc.wait(timeout=30).stdout


def test_outages_at_random_moments_around_the_budget(figures):
    runs = campaign_size("CREATEOS_OUTAGE_RUNS", 8, 60)
    seed = int(os.environ.get("CREATEOS_SANDBOX_SEED", "20261202"))
    outcomes: dict = {}
    failures = []

    def one(i: int) -> None:
        rng = random.Random(seed + i)
        at_line = rng.randint(1, 30)
        seconds = OUTAGE_BUDGET.budget * rng.uniform(0.3, 4.0)
        comebacks: list = []

        def take_down(stream: str, text: str) -> None:
            if not comebacks and text.count("\n") and text.split()[-1] == str(at_line):
                comebacks.append(server.outage(seconds))

        try:
            with LocalServer(heartbeat_interval=0.5) as server:
                with make_client(
                    server, retry=OUTAGE_BUDGET, stream_idle_timeout=0.5, cleanup_timeout=1.0
                ) as client:
                    outcome, output = run_through_outage(client, take_down, comebacks)
                assert seconds > 0.8 * OUTAGE_BUDGET.budget or outcome == "exact", seconds
                if outcome == "terminated":  # the API was back for the DELETE: confirmed
                    assert LONG_COUNTED.startswith(output)
                else:
                    assert output == LONG_COUNTED
                for record in server.processes():
                    assert server.wait_tree_gone(record["process_id"], 10.0)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        except BaseException as exc:  # reported with its seed below
            failures.append("run %d (seed %d, %.2f s): %r" % (i, seed + i, seconds, exc))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(runs)))
    assert not failures, "\n".join(failures[:5])
    figures.record("14. the sandbox around the process, outages", outage_runs=runs, **outcomes)


# -- canned answers: what the view and the resume may answer -------------------------

VIEW = f"{BASE}/v1/sandboxes/{SB}"
PAUSED = {"status": "fail", "data": {"sandbox": "sandbox is not running; resume it first"}}


def add_views(rsps, *statuses: str) -> None:
    """The sandbox's view, answering each status in turn (the last one then on)."""
    for status in statuses:
        rsps.add(responses.GET, VIEW, json=ok({"id": SB, "status": status}))


@pytest.mark.parametrize(
    "answer, error",
    [
        (dict(json=ok("running")), cx.ProtocolError),
        (dict(json=ok({"id": SB})), cx.ProtocolError),
        (dict(status=401, json={"status": "fail", "data": {}}), cx.APIError),
    ],
    ids=["not an object", "no status", "401"],
)
def test_a_view_that_says_nothing_is_an_error_of_its_own(rsps, answer, error):
    rsps.add(responses.GET, VIEW, **answer)
    with pytest.raises(error) as caught:
        make_client().sandbox(SB)
    assert not isinstance(caught.value, cx.SandboxError)


@pytest.mark.parametrize(
    "view", [dict(body="not json"), dict(status=401, json={}), dict(status=503, json={})]
)
def test_a_lookup_that_cannot_be_read_changes_nothing(rsps, view):
    rsps.add(responses.POST, PROCS, status=409, json=PAUSED)
    rsps.add(responses.GET, VIEW, **view)
    with pytest.raises(cx.APIError) as caught:
        make_client().execute(SB, ["true"], resume=True)
    assert type(caught.value) is cx.APIError and str(caught.value).endswith("resume it first.")
    assert len(calls(rsps, "GET", VIEW)) == 1  # asked once, never again


def test_a_refused_process_lookup_other_than_404_or_409_is_not_looked_into(rsps):
    rsps.add(responses.GET, PROC, status=400, json={"status": "fail", "data": {}})
    with pytest.raises(cx.APIError) as caught:
        make_client().process(SB, PID)
    assert caught.value.status == 400 and len(rsps.calls) == 1


def test_a_sandbox_that_goes_back_to_paused_is_not_resumed_unasked(rsps):
    rsps.add(responses.POST, PROCS, status=409, json=PAUSED)
    add_views(rsps, "resuming", "paused")
    with pytest.raises(cx.SandboxPausedError) as caught:
        make_client().execute(SB, ["true"])
    assert caught.value.sandbox_status == "resuming" and calls(rsps, "POST", VIEW + "/resume") == []


def test_a_sandbox_not_resumed_within_the_deadline_stays_paused(rsps):
    rsps.add(responses.POST, PROCS, status=409, json=PAUSED)
    rsps.add(responses.POST, VIEW + "/resume", status=202, json=ok({"status": "resuming"}))
    add_views(rsps, "paused")
    with pytest.raises(cx.SandboxPausedError) as caught:
        make_client().execute(SB, ["true"], resume=True, timeout=0.4)
    assert caught.value.process_id is None and calls(rsps, "POST", PROCS)


def read_past_the_deadline(request):
    time.sleep(0.1)  # past every deadline below, then the read times out
    raise requests.exceptions.ReadTimeout("read timed out")


@pytest.mark.parametrize(
    "call",
    [
        lambda client: client.resume(SB, timeout=0.05),
        lambda client: client.execute(SB, ["true"], resume=True, timeout=0.05),
    ],
    ids=["resume()", "execute(resume=True)"],
)
def test_a_resume_request_cut_short_by_the_deadline_ends_as_the_deadline(rsps, call):
    rsps.add(responses.POST, PROCS, status=409, json=PAUSED)
    add_views(rsps, "paused")
    rsps.add_callback(responses.POST, VIEW + "/resume", callback=read_past_the_deadline)
    with pytest.raises(cx.SandboxPausedError):  # not a TransportError: the network is fine
        call(make_client())


@pytest.mark.parametrize(
    "record, error",
    [
        (dict(json=ok(process_record(newest=0))), cx.ProtocolError),  # behind the cursor
        (dict(status=400, json={"status": "fail", "data": {}}), cx.APIError),
    ],
    ids=["journal behind the cursor", "record refused"],
)
def test_after_a_resume_the_process_must_go_on_at_the_cursor(rsps, record, error):
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"one\n")))  # then the stream ends
    rsps.add(responses.GET, CONNECT, status=409, json=PAUSED)
    add_views(rsps, "paused", "running")
    rsps.add(responses.POST, VIEW + "/resume", status=202, json=ok({"status": "resuming"}))
    rsps.add(responses.GET, PROC, **record)
    add_deleted(rsps)
    with pytest.raises(error) as caught:
        make_client().execute(SB, ["true"], resume=True)
    assert caught.value.result.stdout == "one\n"  # nothing made up after it
    assert_deleted_once(rsps)


def test_a_delete_refused_with_409_while_the_sandbox_runs_is_unconfirmed(rsps):
    add_created(rsps)
    rsps.add(responses.DELETE, PROC, status=409, json={"status": "fail", "data": {}})
    add_views(rsps, "running")
    proc = make_client().start(SB, ["sleep", "9"])
    with pytest.raises(cx.CleanupError) as caught:
        proc.terminate()
    assert "is running." in str(caught.value.__cause__)


@pytest.mark.parametrize(
    "views, resume, timeout, error",
    [
        (("creating", "running"), False, None, None),
        (("resuming", "running"), False, None, None),
        (("forking", "running"), False, None, None),
        (("resuming", "paused"), False, None, cx.SandboxPausedError),
        (("paused",), True, 0.6, cx.SandboxPausedError),
        (("hibernating",), False, None, cx.SandboxError),
        (("resuming", "hibernating"), False, None, cx.SandboxError),
        (("paused", "hibernating"), True, None, cx.SandboxError),
    ],
    ids=[
        "creating",
        "resuming",
        "forking",
        "paused again, not to be resumed",
        "not back within the deadline",
        "a state this client does not know",
        "that state met on the way back",
        "that state met while it resumes",
    ],
)
def test_a_sandbox_met_mid_run_on_its_way_to_running_is_waited_for_else_said(
    rsps, views, resume, timeout, error
):
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"one\n")))  # then the stream ends
    rsps.add(responses.GET, CONNECT, status=409, json=PAUSED)
    rsps.add(responses.POST, VIEW + "/resume", status=202, json=ok({"status": "resuming"}))
    add_views(rsps, *views)
    rsps.add(responses.GET, PROC, json=ok(process_record(newest=1)))
    add_connect(rsps, nd(data(2, "stdout", b"two\n"), EXIT0))
    handed: list = []
    client = make_client()
    options = dict(resume=resume, timeout=timeout, on_output=lambda _, text: handed.append(text))
    if error is None:  # the run goes on, nothing asked of the sandbox but its view
        result = client.execute(SB, ["true"], **options)
        assert result.stdout == "".join(handed) == "one\ntwo\n"
        assert calls(rsps, "POST", VIEW + "/resume") == []
        return
    with pytest.raises(error) as caught:
        client.execute(SB, ["true"], **options)
    said = caught.value
    assert type(said) is error and said.after == 1
    assert said.result.stdout == "one\n" and handed == ["one\n"]
    assert calls(rsps, "DELETE", PROC) == []  # nothing terminated while it does not run
    if error is cx.SandboxError:  # the word is kept, not repeated; never a CleanupError
        assert said.sandbox_status == "hibernating" and "hibernating" not in str(said)
        assert "client.process('sb_1', 'proc_x', after=1)" in str(said)


def test_a_sandbox_destroyed_while_it_resumes_is_gone_with_nothing_deleted(rsps):
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"one\n")))  # then the stream ends
    rsps.add(responses.GET, CONNECT, status=409, json=PAUSED)
    add_views(rsps, "paused", "destroyed")
    rsps.add(responses.POST, VIEW + "/resume", status=202, json=ok({"status": "resuming"}))
    with pytest.raises(cx.SandboxGoneError) as caught:
        make_client().execute(SB, ["true"], resume=True)
    assert caught.value.result.stdout == "one\n"
    assert [call.request.method for call in rsps.calls].count("DELETE") == 0
