"""Failures injected by the local server: resume, recover, fail closed, contain."""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from local_server import LocalServer
from support import FAST_RETRY, SANDBOX, THREE_TRIES, TWO_TRIES, make_client

import createos_exec as cx

SLOW_LINES = "for i in 1 2 3 4 5 6; do echo line $i; sleep 0.05; done"
SLOW_OUTPUT = "".join(f"line {i}\n" for i in range(1, 7))


def connects(server):
    return len(server.requests_to("connect"))


# -- 2. resume, don't restart ----------------------------------------------------


@pytest.mark.parametrize(
    "inject",
    [
        pytest.param(lambda s: s.drop_stream(after_frames=2), id="reset"),
        pytest.param(lambda s: s.drop_stream(after_frames=2, mid_frame=True), id="mid-frame"),
        pytest.param(lambda s: s.end_stream(after_frames=2), id="clean-eof"),
        pytest.param(lambda s: s.fail("connect", 503, count=2), id="503-on-connect"),
        pytest.param(lambda s: s.fail("connect", 502), id="502-on-connect"),
        pytest.param(lambda s: s.drop_stream(after_frames=6), id="reset-before-exit-frame"),
        pytest.param(
            lambda s: s.replay_ignoring_after(count=2) or s.drop_stream(after_frames=3),
            id="replay-ignores-after",
        ),
    ],
)
def test_transport_failures_resume_the_same_process(client, server, inject):
    inject(server)
    result = client.execute(SANDBOX, SLOW_LINES, shell=True)
    assert result.stdout == SLOW_OUTPUT
    assert result.exit_code == 0
    assert result.reconnects >= 1
    assert len(server.requests_to("create")) == 1
    after = [r.query.get("after") for r in server.requests_to("connect")]
    assert after[0] in ("0", ["0"])


def test_resume_asks_for_frames_after_the_last_accepted_seq(client, server):
    server.drop_stream(after_frames=3)
    client.execute(SANDBOX, SLOW_LINES, shell=True)
    queries = [str(r.query) for r in server.requests_to("connect")]
    assert len(queries) == 2
    assert "3" in queries[1]


def test_stall_is_detected_by_the_idle_timeout(server):
    server.stall_stream(after_frames=1, seconds=5)
    with make_client(server, stream_idle_timeout=0.5) as client:
        started = time.monotonic()
        result = client.execute(SANDBOX, SLOW_LINES, shell=True)
    assert result.stdout == SLOW_OUTPUT and result.reconnects == 1
    assert time.monotonic() - started < 4


def test_429_retry_after_is_honoured(client, server):
    server.fail("connect", 429, retry_after="1")
    started = time.monotonic()
    result = client.execute(SANDBOX, ["echo", "paced"])
    assert result.stdout == "paced\n" and result.reconnects == 1
    assert time.monotonic() - started >= 0.9


def test_budget_resets_on_progress_so_separated_blips_all_survive(client, server):
    # Twelve drops, each after one new frame: more failures than max_attempts (6),
    # but never more than one in a row without progress.
    for _ in range(12):
        server.drop_stream(after_frames=1)
    script = "for i in $(seq 1 14); do echo n$i; sleep 0.02; done"
    result = client.execute(SANDBOX, script, shell=True)
    assert result.stdout == "".join(f"n{i}\n" for i in range(1, 15))
    assert result.reconnects == 12 and not result.exit_recovered


# -- 4. recover the exit status out of band -----------------------------------------


def test_exit_status_recovered_by_wait_when_the_stream_cannot_deliver_it(client, server):
    # Drop the exit frame, right after the last data frame: the only one, plus
    # under the alternative reading the empty frames of the two pipes' EOF.
    server.drop_stream(after_frames=3 if server.reading.eof_data_frame else 1)
    server.fail("connect", 503, count=50)
    result = client.execute(SANDBOX, "echo done; exit 4", shell=True)
    assert result.exit_code == 4 and result.stdout == "done\n"
    assert result.exit_recovered
    assert connects(server) == FAST_RETRY.max_attempts  # the budget was spent
    assert len(server.requests_to("wait")) >= 1


def test_missing_output_is_replayed_and_the_wait_record_is_the_status(client, server):
    server.drop_stream(after_frames=1)
    server.fail("connect", 503, count=5)  # attempts 2-6 fail: the budget of 6 is spent
    result = client.execute(SANDBOX, "echo a; sleep 0.2; echo b; exit 2", shell=True)
    assert result.stdout == "a\nb\n" and result.exit_code == 2
    # The record's status holds as soon as the replay reached its newest seq.
    assert result.exit_recovered
    assert connects(server) == 7


def test_stream_ended_error_only_after_budget_and_recovery_both_fail(client, server):
    server.drop_stream(after_frames=1)
    server.fail("connect", 503, count=50)
    server.fail("wait", 503, count=50)
    with pytest.raises(cx.StreamEndedError) as caught:
        client.execute(SANDBOX, "echo a; sleep 0.2; echo b; sleep 30", shell=True)
    error = caught.value
    assert str(error) == "CreateOS process stream ended without an exit status."
    assert isinstance(error, cx.TransportError)
    # Condition 1: the retry budget was spent on the stream (6 attempts)...
    assert connects(server) == FAST_RETRY.max_attempts
    # ...condition 2: out-of-band recovery was tried and failed.
    assert len(server.requests_to("wait")) >= 1
    assert error.result is not None and error.result.stdout == "a\n"
    assert server.wait_tree_gone(error.process_id)


def test_output_incomplete_when_the_replay_window_fails_too(client, server):
    server.drop_stream(after_frames=0)
    server.fail("connect", 503, count=5)
    # The replay window has a budget of its own, and spends it as well.
    server.fail("connect", 503, count=FAST_RETRY.max_attempts)
    with pytest.raises(cx.OutputIncompleteError) as caught:
        client.execute(SANDBOX, "echo lost; exit 3", shell=True)
    assert isinstance(caught.value, cx.StreamEndedError)  # what older handlers catch
    assert caught.value.result.exit_code == 3 and caught.value.result.stdout == ""


def test_exit_frame_without_status_is_checked_against_wait(client, server):
    server.corrupt_stream(b'{"type":"exit"}', after_frames=1)
    # The pause keeps x the first frame: the alternative reading journals each
    # pipe's EOF as a frame, and stderr's could otherwise come first.
    result = client.execute(SANDBOX, "echo x; sleep 0.1; exit 3", shell=True)
    assert result.exit_code == 3 and result.exit_recovered and result.stdout == "x\n"


def test_exit_frame_without_status_and_no_answer_is_a_protocol_error(client, server):
    # The body ends after the exit frame, as it does on the service: the error
    # then comes while the tree still runs, and the tree is seen contained.
    server.corrupt_stream(b'{"type":"exit","exit_code":null}', after_frames=1, last=True)
    server.fail("wait", 500, count=50)
    with pytest.raises(cx.ProtocolError) as caught:
        client.execute(SANDBOX, "echo x; sleep 0.2; echo y; sleep 30", shell=True)
    assert type(caught.value) is cx.ProtocolError
    assert connects(server) == 1  # checked against wait once, never a reconnect
    assert server.wait_tree_gone(caught.value.process_id)
    assert server.process(caught.value.process_id).get("signal")  # killed, not run out


# -- 5. fail closed and contain --------------------------------------------------------

VIOLATIONS = {
    "gap": b'{"type":"data","seq":9,"stream":"stdout","data_base64":"eA=="}',
    "seq-true": b'{"type":"data","seq":true,"stream":"stdout","data_base64":"eA=="}',
    "seq-string": b'{"type":"data","seq":"2","stream":"stdout","data_base64":"eA=="}',
    "seq-float": b'{"type":"data","seq":2.0,"stream":"stdout","data_base64":"eA=="}',
    "bad-stream": b'{"type":"data","seq":2,"stream":"pty","data_base64":"eA=="}',
    "non-canonical-base64": b'{"type":"data","seq":2,"stream":"stdout","data_base64":"eR=="}',
    "bad-base64": b'{"type":"data","seq":2,"stream":"stdout","data_base64":"e*=="}',
    "invalid-json": b'{"type":"data",',
    "not-an-object": b'["data"]',
    "unknown-type": b'{"type":"progress"}',
    "error-frame": b'{"type":"error","error":"internal"}',
    "bad-signal": b'{"type":"exit","signal":"SIG kill"}',
    "oversized": b'{"type":"heartbeat","pad":"' + b"x" * (1024 * 1024) + b'"}',
}


@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_protocol_violation_fails_closed_and_terminates_the_tree(client, server, name, figures):
    server.corrupt_stream(VIOLATIONS[name], after_frames=1)
    with pytest.raises(cx.ProtocolError) as caught:
        client.execute(
            SANDBOX, "echo first; sleep 0.2; echo second; sleep 30 & sleep 30", shell=True
        )
    error = caught.value
    assert type(error) is cx.ProtocolError
    assert connects(server) == 1  # never a reconnect after a bad frame
    assert error.process_id is not None
    assert error.result is not None and error.result.stdout == "first\n"
    assert server.wait_tree_gone(error.process_id)
    assert server.requests_to("delete")
    figures.record("3. protocol violations", runs=1, failed_closed=1, reconnects_after=0)


def test_eviction_frame_is_its_own_error(client, server):
    server.corrupt_stream(
        b'{"type":"error","error":"output_offset_expired","oldest_available_seq":5}',
        after_frames=1,
    )
    # A live reader (on_output) is never handed output after a gap.
    seen = []
    with pytest.raises(cx.OutputEvictedError) as caught:
        client.execute(
            SANDBOX,
            "echo a; sleep 0.2; echo b; sleep 30",
            shell=True,
            on_output=lambda stream, text: seen.append(text),
        )
    assert seen == ["a\n"] and caught.value.oldest_available_seq == 5
    assert connects(server) == 1
    assert server.wait_tree_gone(caught.value.process_id)


def test_410_on_reconnect_is_eviction(client, server):
    def evict_then_break(stream, text):
        if text == "1\n":
            time.sleep(0.4)  # let the process print more, then lose it
            (record,) = [p for p in server.processes() if "seq 2 4" in p["args"][-1]]
            server.evict(record["process_id"])

    server.drop_stream(after_frames=1)
    with pytest.raises(cx.OutputEvictedError) as caught:
        client.execute(
            SANDBOX, "seq 1 1; sleep 0.1; seq 2 4; sleep 30", shell=True, on_output=evict_then_break
        )
    assert connects(server) == 2
    assert caught.value.result.stdout == "1\n"
    assert server.wait_tree_gone(caught.value.process_id)


def test_unconfirmed_termination_raises_cleanup_error_chained(client, server):
    server.corrupt_stream(VIOLATIONS["gap"], after_frames=1)
    server.fail("delete", 503, count=100)
    with pytest.raises(cx.CleanupError) as caught:
        client.execute(SANDBOX, "echo a; sleep 0.2; echo b; sleep 30", shell=True)
    error = caught.value
    assert not error.creation_unconfirmed
    assert isinstance(error.__cause__, cx.ProtocolError)
    assert error.process_id is not None


def test_ctrl_c_with_failing_cleanup_still_reraises_itself(client, server, caplog):
    server.fail("delete", 503, count=100)

    def interrupt(stream, text):
        raise KeyboardInterrupt

    with caplog.at_level(logging.WARNING, logger="createos_exec"):
        with pytest.raises(KeyboardInterrupt):
            client.execute(SANDBOX, "echo hi; sleep 30", shell=True, on_output=interrupt)
    assert any(r.levelno == logging.WARNING for r in caplog.records)


# -- 1. one creation, ever --------------------------------------------------------------


def test_lost_create_response_is_adopted_by_marker(client, server):
    server.lose_create_response()
    result = client.execute(SANDBOX, ["echo", "adopted"])
    assert result.stdout == "adopted\n" and result.exit_code == 0
    assert result.creation_recovered
    assert len(server.processes()) == 1  # created once, never again
    assert len(server.requests_to("create")) == 1
    assert len(server.requests_to("list")) == 1


def test_5xx_on_create_without_a_process_is_unconfirmed(client, server):
    server.fail("create", 500)
    with pytest.raises(cx.CleanupError) as caught:
        client.execute(SANDBOX, ["true"])
    assert caught.value.creation_unconfirmed
    assert len(server.requests_to("create")) == 1
    assert server.processes() == []


def test_failed_listing_after_ambiguous_create_is_unconfirmed(client, server):
    server.lose_create_response()
    server.fail("list", 503, count=100)
    with pytest.raises(cx.CleanupError) as caught:
        client.execute(SANDBOX, ["true"])
    assert caught.value.creation_unconfirmed
    assert isinstance(caught.value.__cause__, cx.TransportError) or isinstance(
        caught.value.__cause__, cx.APIError
    )
    assert len(server.requests_to("create")) == 1


def assert_staged_then_removed(server):
    """The env and stdin file was written, then removed by one `rm -f` (this
    run's own file: other tests stage theirs in the same folder meanwhile)."""
    (staged,) = server.requests_to("files_put")
    assert staged.status == 200
    assert len(server.requests_to("exec")) == 1
    assert not os.path.exists(staged.query["path"])


@pytest.mark.parametrize("status", [400, 409])  # 429: below
def test_4xx_on_create_means_not_created_and_removes_the_staged_file(client, server, status):
    server.fail("create", status)
    with pytest.raises(cx.APIError) as caught:
        client.execute(SANDBOX, ["true"], env={"SECRET": "s"}, stdin="in")
    assert caught.value.status == status
    assert len(server.requests_to("create")) == 1
    assert_staged_then_removed(server)


def test_429_on_create_is_waited_out_and_one_process_runs(client, server):
    server.fail("create", 429, retry_after="1")  # within FAST_RETRY's max_retry_after
    result = client.execute(SANDBOX, ["echo", "once"], env={"K": "v"})
    assert result.stdout == "once\n" and result.exit_code == 0
    assert len(server.processes()) == 1
    sent = [(r.method, r.status) for r in server.requests if r.path.endswith("/processes")]
    created = server.reading.create_status
    assert sent == [("POST", 429), ("GET", 200), ("POST", created)]


def test_429_on_create_until_the_policy_runs_out_means_not_created(server):
    server.fail("create", 429, count=50, retry_after="0")
    with make_client(server, retry=THREE_TRIES) as client:
        with pytest.raises(cx.APIError) as caught:
            client.execute(SANDBOX, ["true"], env={"SECRET": "s"}, stdin="in")
    assert (caught.value.status, caught.value.operation) == (429, "process creation")
    assert server.processes() == []
    assert len(server.requests_to("create")) == 3
    # One before each attempt sent again, and one after the last: the 429 of a
    # proxy that forwarded it leaves no process behind.
    assert len(server.requests_to("list")) == 3
    assert_staged_then_removed(server)


def test_refused_connection_is_a_transport_error_without_creation():
    with make_client(api_url="http://127.0.0.1:9", retry=TWO_TRIES) as client:
        with pytest.raises(cx.TransportError) as caught:
            client.execute(SANDBOX, ["true"])
    assert not isinstance(caught.value, cx.CleanupError)
    assert caught.value.operation == "process creation"


# -- property: whatever the cuts, the output comes back exactly once --------------------

WRITER = (
    "import base64,json,sys,time\n"
    "for fd,chunk in json.load(sys.stdin):\n"
    "    (sys.stdout if fd == 1 else sys.stderr).buffer.write(base64.b64decode(chunk))\n"
    "    (sys.stdout if fd == 1 else sys.stderr).flush()\n"
    "    time.sleep(0.003)\n"
)


@settings(max_examples=25, deadline=None)
@given(
    pieces=st.lists(
        st.tuples(st.sampled_from([1, 2]), st.binary(min_size=1, max_size=300)),
        min_size=1,
        max_size=12,
    ),
    cuts=st.lists(st.tuples(st.integers(0, 6), st.booleans()), max_size=4),
)
def test_random_output_and_random_cuts_come_back_exactly_once(pieces, cuts):
    payload = json.dumps([[fd, base64.b64encode(chunk).decode()] for fd, chunk in pieces])
    seen = {"stdout": [], "stderr": []}
    with LocalServer(heartbeat_interval=0.5) as server, make_client(server) as client:
        for after_frames, mid_frame in cuts:
            server.drop_stream(after_frames=after_frames, mid_frame=mid_frame)
        result = client.execute(
            SANDBOX,
            [sys.executable, "-c", WRITER],
            stdin=payload,
            on_output=lambda stream, text: seen[stream].append(text),
        )
        connects = len(server.requests_to("connect"))
    expected_out = b"".join(c for fd, c in pieces if fd == 1).decode("utf-8", "replace")
    expected_err = b"".join(c for fd, c in pieces if fd == 2).decode("utf-8", "replace")
    assert result.exit_code == 0
    assert result.stdout == expected_out and "".join(seen["stdout"]) == expected_out
    assert result.stderr == expected_err and "".join(seen["stderr"]) == expected_err
    # One connect, plus one per cut that fired (one placed after more frames
    # than the process wrote never fires).
    assert result.reconnects == connects - 1
    if cuts and cuts[0][0] == 0:
        assert result.reconnects >= 1
