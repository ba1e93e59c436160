"""Resume and recovery: the README's failure-table rows "reset, refused, truncated
chunk, clean EOF before the exit frame, 5xx/429 on connect" and "failures
without progress exhaust the retry policy", and the last row of "Malformed
input from the service" (an unterminated last line is a broken connection)
(design.md rules 2, 3 and 4): the run reconnects to the same process after its
cursor, under a retry budget that progress resets, and recovers the exit
status out of band when the budget is spent.

Canned HTTP answers (responses); the retry budget and Retry-After parsing are
called directly.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

import pytest
import requests
import responses
from support import (
    CANNED_RETRY,
    CONNECT,
    EXIT0,
    PID,
    PROC,
    PROCS,
    SB,
    WAIT,
    add_connect,
    add_created,
    add_deleted,
    assert_clean,
    assert_deleted_once,
    calls,
    data,
    exited,
    make_client,
    nd,
    ok,
    process_record,
    query,
)

import createos_exec as cx

# --------------------------------------------------------------------------
# Resume after the cursor
# --------------------------------------------------------------------------


def test_clean_eof_resumes_after_cursor(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"a"), data(2, "stderr", b"b")))
    add_connect(
        rsps, nd(data(1, "stdout", b"a"), data(2, "stderr", b"b"), data(3, "stdout", b"c"), EXIT0)
    )
    result = make_client().execute(SB, ["true"])
    assert result.stdout == "ac" and result.stderr == "b"
    assert result.reconnects == 1
    assert [query(c)["after"] for c in calls(rsps, "GET", CONNECT)] == ["0", "2"]
    assert len(calls(rsps, "POST", PROCS)) == 1


def test_progress_resets_the_failure_budget(rsps: responses.RequestsMock) -> None:
    # CANNED_RETRY allows 2 consecutive failures; four blips separated by progress survive.
    add_created(rsps)
    for n in range(1, 5):
        add_connect(rsps, nd(*[data(i, "stdout", str(i).encode()) for i in range(1, n + 1)]))
    add_connect(rsps, nd(data(5, "stdout", b"5"), EXIT0))
    result = make_client().execute(SB, ["true"])
    assert result.stdout == "12345"
    assert result.reconnects == 4 and not result.exit_recovered
    assert [query(c)["after"] for c in calls(rsps, "GET", CONNECT)] == ["0", "1", "2", "3", "4"]
    assert not calls(rsps, "GET", WAIT)


def test_unterminated_last_line_resumes(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"a")) + '{"type":"data","seq":2,"str')
    add_connect(rsps, nd(data(2, "stdout", b"b"), EXIT0))
    result = make_client().execute(SB, ["true"])
    assert result.stdout == "ab" and result.reconnects == 1


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_connect_transient_status_reconnects(rsps: responses.RequestsMock, status: int) -> None:
    add_created(rsps)
    rsps.add(responses.GET, CONNECT, status=status, headers={"Retry-After": "0"}, body="")
    add_connect(rsps, nd(data(1, "stdout", b"ok"), EXIT0))
    result = make_client().execute(SB, ["true"])
    assert result.stdout == "ok" and result.reconnects == 1
    assert len(calls(rsps, "GET", CONNECT)) == 2


def test_connection_error_on_connect_reconnects(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    rsps.add(responses.GET, CONNECT, body=requests.exceptions.ConnectionError("reset"))
    add_connect(rsps, nd(EXIT0))
    assert make_client().execute(SB, ["true"]).reconnects == 1


def test_garbage_retry_after_header_on_connect_is_ignored(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    rsps.add(responses.GET, CONNECT, status=503, headers={"Retry-After": "whenever"}, body="")
    add_connect(rsps, nd(EXIT0))
    assert make_client().execute(SB, ["true"]).reconnects == 1


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_connect_4xx_is_api_error(rsps: responses.RequestsMock, status: int) -> None:
    add_created(rsps)
    rsps.add(responses.GET, CONNECT, status=status, json={"status": "fail", "data": "SECRET-BODY"})
    add_deleted(rsps)
    with pytest.raises(cx.APIError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.status == status and info.value.operation == "output connection"
    assert len(calls(rsps, "GET", CONNECT)) == 1
    assert_deleted_once(rsps)
    assert_clean(info.value, "SECRET-BODY")


def test_attach_resumes_after_given_seq(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.GET, PROC, json=ok(process_record(cmd="sh", args=["-c", "echo"])))
    add_connect(
        rsps,
        nd(
            data(2, "stdout", b"old\n"),
            data(3, "stdout", b"new\n"),
            {"type": "exit", "exit_code": 4},
        ),
    )
    result = make_client().attach(SB, PID, after=2)
    assert query(calls(rsps, "GET", CONNECT)[0]) == {"after": "2"}
    assert result.stdout == "new\n"
    assert result.exit_code == 4 and result.args == ["sh", "-c", "echo"]  # as listed
    assert not calls(rsps, "POST", PROCS)


# --------------------------------------------------------------------------
# Out-of-band recovery once the budget is spent
# --------------------------------------------------------------------------


def test_budget_spent_then_exit_recovered(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"a\n")))  # repeats: never an exit frame
    rsps.add(responses.GET, WAIT, json=ok(exited(1, exit_code=7)))
    result = make_client().execute(SB, ["true"])
    assert result.exit_code == 7 and result.exit_recovered is True
    assert result.stdout == "a\n"
    waits = calls(rsps, "GET", WAIT)
    assert len(waits) == 1 and query(waits[0])["scope"] == "tree"
    assert len(calls(rsps, "GET", CONNECT)) == CANNED_RETRY.max_attempts


def test_recovery_replays_missing_output_once(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"a")))
    add_connect(rsps, nd(data(1, "stdout", b"a")))
    add_connect(rsps, nd(data(2, "stdout", b"b"), {"type": "exit", "exit_code": 0}))
    rsps.add(responses.GET, WAIT, json=ok(exited(2, exit_code=0)))
    result = make_client().execute(SB, ["true"])
    assert result.stdout == "ab" and result.exit_code == 0
    assert [query(c)["after"] for c in calls(rsps, "GET", CONNECT)] == ["0", "1", "1"]


def test_recovery_replay_still_incomplete_is_output_incomplete(
    rsps: responses.RequestsMock,
) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"a")))
    rsps.add(responses.GET, WAIT, json=ok(exited(2, exit_code=7)))
    add_deleted(rsps)
    with pytest.raises(cx.OutputIncompleteError) as info:
        make_client().execute(SB, ["true"])
    assert str(info.value) == (
        "The command ended with a known exit status, but its output could not be "
        "read in full from CreateOS; .result holds the status and the output received."
    )
    assert isinstance(info.value, cx.StreamEndedError)
    result = info.value.result
    assert result is not None and result.stdout == "a"
    assert result.exit_code == 7 and result.exit_recovered
    # The live stream's budget, then the replay window's own.
    assert len(calls(rsps, "GET", CONNECT)) == 2 * CANNED_RETRY.max_attempts
    assert len(calls(rsps, "GET", WAIT)) == 1
    assert_deleted_once(rsps)


def test_recovery_journal_behind_cursor_is_protocol_error(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"a"), data(2, "stdout", b"b")))
    rsps.add(responses.GET, WAIT, json=ok(exited(1, exit_code=0)))
    add_deleted(rsps)
    with pytest.raises(cx.ProtocolError):
        make_client().execute(SB, ["true"])
    assert_deleted_once(rsps)


@pytest.mark.parametrize(
    "wait",
    [
        (500, json.dumps({"status": "error", "message": "x"})),
        (200, json.dumps(ok(exited(0)))),  # exited, but neither code nor signal
    ],
    ids=["wait 500", "no status"],
)
def test_recovery_failure_is_stream_ended(rsps: responses.RequestsMock, wait: Any) -> None:
    add_created(rsps)
    add_connect(rsps, "")
    rsps.add(responses.GET, WAIT, status=wait[0], body=wait[1])
    add_deleted(rsps)
    with pytest.raises(cx.StreamEndedError):
        make_client().execute(SB, ["true"])
    assert_deleted_once(rsps)


# --------------------------------------------------------------------------
# The retry budget and Retry-After
# --------------------------------------------------------------------------


def test_budget_counts_attempts_and_resets_on_progress() -> None:
    budget = cx._Budget(cx.RetryPolicy(max_attempts=3, budget=60, initial_backoff=0, max_backoff=0))
    assert budget.next_delay() == 0
    assert budget.next_delay() == 0
    assert budget.next_delay() is None  # third consecutive failure: spent
    budget.progress()
    assert budget.next_delay() == 0
    assert budget.next_delay() == 0
    assert budget.next_delay() is None
    assert cx._Budget(cx.RetryPolicy(max_attempts=1)).next_delay() is None


def test_budget_seconds_and_reset() -> None:
    policy = cx.RetryPolicy(max_attempts=1000, budget=0.1, initial_backoff=0, max_backoff=0)
    budget = cx._Budget(policy)
    assert budget.next_delay() is not None
    time.sleep(0.15)
    assert budget.next_delay() is None
    budget.progress()
    assert budget.next_delay() is not None  # the clock restarted


def test_budget_backoff_grows_with_jitter_and_cap() -> None:
    policy = cx.RetryPolicy(max_attempts=100, budget=1000, initial_backoff=0.1, max_backoff=0.5)
    budget = cx._Budget(policy)
    delays = [budget.next_delay() for _ in range(30)]
    ceilings = [min(0.5, 0.1 * 2**i) for i in range(30)]
    for delay, ceiling in zip(delays, ceilings):
        assert delay is not None and 0 <= delay <= ceiling
    assert len(set(delays)) > 5  # jittered, not constant
    assert max(delays) > 0.1  # it grew past the first ceiling


def test_budget_honours_retry_after_with_caps() -> None:
    policy = cx.RetryPolicy(
        max_attempts=100, budget=60, initial_backoff=0, max_backoff=0, max_retry_after=5
    )
    budget = cx._Budget(policy)
    assert budget.next_delay(2.0) == 2.0  # honoured, although backoff says 0
    assert budget.next_delay(100.0) == 5.0  # capped by max_retry_after
    small = cx._Budget(cx.RetryPolicy(max_attempts=100, budget=1.0, max_retry_after=60))
    delay = small.next_delay(30.0)
    assert delay is not None and delay <= 1.0  # capped by what is left of the budget


def test_retry_after_values() -> None:
    assert cx._retry_after("5") == 5.0
    assert cx._retry_after(" 7 ") == 7.0
    assert cx._retry_after("0") == 0.0
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= cx._retry_after(future) <= 31  # type: ignore[operator]
    past = email.utils.formatdate(time.time() - 3600, usegmt=True)
    assert cx._retry_after(past) == 0.0
    for garbage in (
        None,
        "",
        "soon",
        "-5",
        "1.5",
        "5s",
        "Wed, 99 Foo 2015 07:28:00 GMT",
        "Wed, 21 Oct 2015 07:28:00",
    ):  # the last has no zone
        assert cx._retry_after(garbage) is None, garbage


@pytest.mark.parametrize("value", ["\xb2", "\xb9", "1\xb3"])
def test_retry_after_unicode_digits_are_garbage(value: str) -> None:
    assert cx._retry_after(value) is None
