"""The sandbox around the process (design item 17): looked at once when something
failed, paused or gone said as such, resumed with resume=True, client.sandbox()
and client.resume(). Against the local server, under both readings where the
answers of a paused or destroyed sandbox (protocol §11.14, 17-19) decide."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from local_server import LocalServer  # noqa: E402
from support import make_client  # noqa: E402

import createos_exec as cx  # noqa: E402

SANDBOX = "sb_local"
# Twenty numbered lines, one each 50 ms: a pause after 3 frames falls mid-run.
COUNT = "for i in $(seq 1 20); do echo $i; sleep 0.05; done"
COUNTED = "".join("%d\n" % i for i in range(1, 21))
SHORT = cx.RetryPolicy(max_attempts=4, budget=2.0, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture
def lifecycle(server_reading):
    """A server of the test's reading whose resumes take 0.2 s, and a client of it."""
    with LocalServer(heartbeat_interval=0.5, reading=server_reading, resume_seconds=0.2) as local:
        with make_client(local, retry=SHORT) as client:
            yield local, client


@pytest.mark.both_readings
def test_a_pause_mid_run_is_a_paused_error_with_the_cursor_and_nothing_terminated(lifecycle):
    server, client = lifecycle
    server.pause_at("connect", after_frames=3)
    with pytest.raises(cx.SandboxPausedError) as caught:
        client.execute(SANDBOX, COUNT, shell=True)
    paused = caught.value
    assert isinstance(paused, cx.SandboxError) and isinstance(paused, cx.APIError)
    assert (paused.sandbox_id, paused.sandbox_status, paused.after) == (SANDBOX, "paused", 3)
    assert paused.result is not None and paused.result.stdout == "1\n2\n3\n"
    assert "client.process('sb_local', '%s', after=3)" % paused.process_id in str(paused)
    assert server.requests_to("delete") == [] and len(server.requests_to("sandbox")) == 1
    assert server.tree_alive(paused.process_id)  # frozen, not ended
    assert client.resume(SANDBOX).running
    if server.reading.resume_keeps_processes:  # taken up by hand, nothing lost or repeated
        rest = client.process(SANDBOX, paused.process_id, after=paused.after).wait()
        assert paused.result.stdout + rest.stdout == COUNTED and rest.exit_code == 0
    else:  # the service lost it: said, never filled in
        with pytest.raises(cx.APIError) as lost:
            client.process(SANDBOX, paused.process_id, after=paused.after)
        assert lost.value.status == 404 and "is running." in str(lost.value)


@pytest.mark.both_readings
def test_a_sandbox_destroyed_mid_run_is_gone_with_nothing_to_terminate(lifecycle):
    server, client = lifecycle
    server.destroy_at("connect", after_frames=3)
    with pytest.raises(cx.SandboxGoneError) as caught:
        client.execute(SANDBOX, COUNT, shell=True)
    gone = caught.value
    expected = "destroyed" if server.reading.destroyed_view == 200 else "not found"
    assert (gone.sandbox_status, gone.result.stdout) == (expected, "1\n2\n3\n")
    assert "nothing of this run" in str(gone) and gone.process_id is not None
    assert server.requests_to("delete") == [] and len(server.requests_to("sandbox")) == 1
    assert server.wait_tree_gone(gone.process_id)


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


def test_a_lookup_that_fails_changes_nothing(server, client):
    server.fail("connect", 404)
    server.fail("sandbox", 503)
    with pytest.raises(cx.APIError) as caught:
        client.execute(SANDBOX, ["sleep", "5"])
    assert type(caught.value) is cx.APIError and caught.value.status == 404
    assert str(caught.value).endswith("no longer keeps).")  # nothing added
    assert len(server.requests_to("sandbox")) == 1  # once, never retried


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
        take_down = outage_at_the_first_output(server, 6.0, comebacks)
        proc = client.start(SANDBOX, LONG_COUNT, shell=True, on_output=take_down)
        with pytest.raises(cx.CleanupError) as caught:
            proc.wait()
        unconfirmed = caught.value
        assert unconfirmed.unreachable and not unconfirmed.creation_unconfirmed
        assert unconfirmed.after == len(unconfirmed.result.stdout.splitlines())
        taken_up = "client.process('sb_local', '%s', after=%d)" % (
            proc.process_id,
            unconfirmed.after,
        )
        assert "could not be reached" in str(unconfirmed) and taken_up in str(unconfirmed)
        assert "destroy" not in str(unconfirmed)  # the honest advice: it runs on
        comebacks[0].join()
        rest = client.process(SANDBOX, proc.process_id, after=unconfirmed.after).wait()
    assert unconfirmed.result.stdout + rest.stdout == LONG_COUNTED  # nothing lost
