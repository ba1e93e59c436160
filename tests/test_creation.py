"""Creating the process: the rows of docs/failures.md's table "4xx on process
creation other than 429", "429 on process creation", "connection refused on
creation" and "creation answer lost, timed out or 5xx" (docs/design.md rule 1), and
what a normal run sends: the wrapper script, its marker, and env and stdin
staged in a file, never in the process record (rule 9).

Canned HTTP answers (responses); the wrapper script itself runs in a local bash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
from typing import Any, List, Optional

import pytest
import requests
import responses
from support import (
    BASE,
    CANNED_RETRY,
    CONNECT,
    EXEC,
    EXIT0,
    FILES,
    KEY,
    PID,
    PROC,
    PROCS,
    SB,
    add_connect,
    add_created,
    assert_clean,
    body_of,
    calls,
    chain,
    data,
    make_client,
    nd,
    ok,
    process_record,
    query,
)

import createos_exec as cx

# --------------------------------------------------------------------------
# The normal run: what is sent, and in which order
# --------------------------------------------------------------------------


def test_normal_run_exact_output_and_requests(
    rsps: responses.RequestsMock, evil: List[str]
) -> None:
    add_created(rsps)
    add_connect(
        rsps,
        nd(
            data(1, "stdout", b"hello\n"),
            {"type": "heartbeat"},
            data(2, "stderr", b"oops\n"),
            data(3, "stdout", b"world\n"),
            EXIT0,
        ),
    )
    seen: List[Any] = []
    result = make_client().execute(
        SB, ["echo", "hello"], on_output=lambda s, t: seen.append((s, t))
    )
    assert result.stdout == "hello\nworld\n"
    assert result.stderr == "oops\n"
    assert result.exit_code == 0 and result.signal is None and not result.timed_out
    assert result.returncode == 0
    assert result.process_id == PID
    assert result.reconnects == 0
    assert not result.exit_recovered and not result.creation_recovered
    assert not result.output_truncated and result.output_evicted is False
    assert result.args == ["echo", "hello"]
    assert result.duration >= 0
    assert seen == [("stdout", "hello\n"), ("stderr", "oops\n"), ("stdout", "world\n")]
    # one creation, one connect with after=0, nothing else
    assert len(calls(rsps, "POST", PROCS)) == 1
    connects = calls(rsps, "GET", CONNECT)
    assert len(connects) == 1 and query(connects[0]) == {"after": "0"}
    assert not calls(rsps, "DELETE", PROC)
    for call in rsps.calls:
        assert call.request.url.startswith(BASE + "/v1/sandboxes/sb_1/")
        assert call.request.headers["X-Api-Key"] == KEY
    assert evil == []


def test_created_process_runs_the_command_behind_a_marker(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(EXIT0))
    make_client().execute(SB, ["printf", "%s", "it's $HOME"], cwd="/srv/app dir")
    body = body_of(calls(rsps, "POST", PROCS)[0])
    assert body["cmd"] == "bash"
    assert body["args"][0] == "-c"
    assert re.fullmatch(r"createos_exec-[0-9a-f]{24}", body["args"][2])
    script = body["args"][1]
    assert script.endswith('exec -- "$@"\n')  # the argv follows, untouched by quoting
    assert body["args"][3:] == ["printf", "%s", "it's $HOME"]
    assert "\n_cx_enter '/srv/app dir'\n" in script
    assert "exec 0</dev/null" in script  # no stdin: EOF at once
    assert "env" not in body and "pty" not in body


def test_env_and_stdin_are_staged_never_in_process_record(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.PUT, FILES, json=ok({"bytes": 1}))
    add_created(rsps)
    add_connect(rsps, nd(EXIT0))
    make_client().execute(
        SB, ["cat"], env={"TOKEN": "env-SECRET-value", "B": "x=y"}, stdin="stdin-SECRET-text"
    )
    put = calls(rsps, "PUT", FILES)
    assert len(put) == 1
    staged_path = query(put[0])["path"]
    assert re.fullmatch(r"/tmp/\.createos_exec-[0-9a-f]{24}", staged_path)
    assert put[0].request.headers["Content-Type"] == "application/octet-stream"
    assert put[0].request.body == b"TOKEN=env-SECRET-value\0B=x=y\0\0stdin-SECRET-text"
    post = calls(rsps, "POST", PROCS)[0]
    raw = post.request.body.decode() if isinstance(post.request.body, bytes) else post.request.body
    assert "SECRET" not in raw
    assert staged_path in body_of(post)["args"][1]
    # the staging came first
    methods = [c.request.method for c in rsps.calls]
    assert methods.index("PUT") < methods.index("POST")


def test_module_level_execute_with_a_client_or_from_the_environment(
    rsps: responses.RequestsMock, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"x"), EXIT0))
    assert cx.execute(SB, "true", client=make_client(api_key="other-key")).stdout == "x"
    monkeypatch.setenv("CREATEOS_API_URL", BASE + "/v1")
    monkeypatch.setenv("CREATEOS_SANDBOX_API_KEY", KEY)
    add_created(rsps)
    add_connect(rsps, nd(EXIT0))
    assert cx.execute(SB, "true").exit_code == 0
    assert rsps.calls[-1].request.headers["X-Api-Key"] == KEY


# --------------------------------------------------------------------------
# A refused creation: 4xx is final, 429 is waited out
# --------------------------------------------------------------------------


# What each refusal of process creation says to do: fixed sentences, no body text.
CREATION_REFUSALS = {
    400: "the request was refused as invalid (an option this sandbox does not accept?)",
    401: "the API key was refused; check CREATEOS_API_KEY",
    402: "the account needs a payment method or more credit",
    403: "the API key was refused for this (another account's sandbox, or a spent quota)",
    404: "no sandbox with this id here (a wrong id, or a sandbox in another region)",
    409: "the sandbox is not running (paused or stopped?); resume it first",
    422: "the request was refused as invalid (an option this sandbox does not accept?)",
    429: (
        "too many requests from this IP address; try again later, and give each program "
        "that shares the address a lower rate limit"
    ),
}


# A 429 is waited out (its tests follow the 404's); the others are final.
@pytest.mark.parametrize("status", [status for status in CREATION_REFUSALS if status != 429])
def test_creation_4xx_is_api_error_without_retry(rsps: responses.RequestsMock, status: int) -> None:
    rsps.add(
        responses.POST,
        PROCS,
        status=status,
        json={"status": "fail", "data": {"echo": "SECRET-BODY"}},
        headers={"Retry-After": "0"},
    )
    with pytest.raises(cx.APIError) as info:
        make_client().execute(SB, ["true"])
    err = info.value
    assert err.status == status
    assert err.operation == "process creation"
    assert err.process_id is None
    advice = CREATION_REFUSALS[status]
    assert str(err) == f"CreateOS answered HTTP {status} to process creation: {advice}."
    assert_clean(err, "SECRET-BODY")
    # No retry, no listing, no connect; after a 404 or 409 the sandbox's view, once
    # (not canned here: a lookup that fails changes nothing).
    assert len(rsps.calls) == (2 if status in (404, 409) else 1)


def test_creation_4xx_removes_staged_file(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.PUT, FILES, json=ok({}))
    rsps.add(responses.POST, PROCS, status=400, json={"status": "fail", "data": "bad"})
    rsps.add(responses.POST, EXEC, json=ok({"result": {"exit_code": 0}}))
    with pytest.raises(cx.APIError):
        make_client().execute(SB, ["true"], env={"A": "1"})
    staged = query(calls(rsps, "PUT", FILES)[0])["path"]
    cleanup = calls(rsps, "POST", EXEC)
    assert len(cleanup) == 1
    assert body_of(cleanup[0]) == {"cmd": "rm", "args": ["-f", "--", staged]}
    assert len(calls(rsps, "POST", PROCS)) == 1


def test_error_envelope_on_404(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.POST, PROCS, status=404, json={"status": "error", "code": 42})
    with pytest.raises(cx.APIError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.status == 404
    assert "42" not in str(info.value)


class _Creation:
    """A POST callback that records the marker and answers as told."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.args: Optional[List[str]] = None

    def __call__(self, request: Any) -> Any:
        self.args = json.loads(request.body)["args"]
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def _listing(creation: _Creation, include: bool, pid: Any = PID, args: Any = None) -> Any:
    def callback(request: Any) -> Any:
        assert creation.args is not None
        processes = [
            process_record(process_id="proc_other", args=["-c", "x", "createos_exec-" + "0" * 24]),
            process_record(process_id="proc_no_args"),
        ]
        if include:
            processes.append(
                process_record(process_id=pid, args=creation.args if args is None else args)
            )
        return (200, {}, json.dumps(ok({"processes": processes})))

    return callback


def add_creation(
    rsps: responses.RequestsMock, answer: Any, listed: Any = None, **record: Any
) -> None:
    """A creation answered `answer`; then, unless `listed` is None, a listing that
    shows its process (with the `record` fields of _listing) or not."""
    creation = _Creation(answer)
    rsps.add_callback(responses.POST, PROCS, callback=creation)
    if listed is not None:
        rsps.add_callback(responses.GET, PROCS, callback=_listing(creation, listed, **record))


def add_listing(rsps: responses.RequestsMock, listing: Any) -> None:
    """The answer to GET …/processes: (status, headers, body), or an exception raised."""
    if isinstance(listing, BaseException):
        rsps.add(responses.GET, PROCS, body=listing)
    else:
        status, headers, text = listing
        rsps.add(responses.GET, PROCS, status=status, headers=headers, body=text)


REFUSED = (429, {"Retry-After": "0"}, json.dumps({"status": "fail", "data": "SECRET-BODY"}))


def public_chain(exc: BaseException) -> bool:
    """No exception a caller can reach from `exc` is a private class of the module."""
    return all(not type(link).__name__.startswith("_") for link in chain(exc))


def test_creation_429_is_waited_out_and_sent_again_after_a_listing(
    rsps: responses.RequestsMock,
) -> None:
    add_creation(rsps, REFUSED, listed=False)
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"once\n"), EXIT0))
    result = make_client().execute(SB, ["true"])
    assert result.stdout == "once\n" and result.process_id == PID
    assert result.creation_recovered is False  # the second creation was answered
    sent = [(c.request.method, c.request.url.split("?")[0]) for c in rsps.calls]
    assert sent == [("POST", PROCS), ("GET", PROCS), ("POST", PROCS), ("GET", CONNECT)]
    first, second = calls(rsps, "POST", PROCS)
    assert body_of(first) == body_of(second)  # the same marker: findable either way


def test_creation_429_that_went_through_is_adopted_not_created_again(
    rsps: responses.RequestsMock,
) -> None:
    # A proxy that answers 429 to a request it forwarded all the same.
    add_creation(rsps, REFUSED, listed=True)
    add_connect(rsps, nd(data(1, "stdout", b"adopted\n"), EXIT0))
    result = make_client().execute(SB, ["true"])
    assert result.stdout == "adopted\n" and result.process_id == PID
    assert result.creation_recovered is True
    assert len(calls(rsps, "POST", PROCS)) == 1


def test_creation_429_until_the_policy_runs_out_is_api_error_429(
    rsps: responses.RequestsMock,
) -> None:
    rsps.add(responses.PUT, FILES, json=ok({}))
    add_creation(rsps, REFUSED, listed=False)
    rsps.add(responses.POST, EXEC, json=ok({"result": {"exit_code": 0}}))
    with pytest.raises(cx.APIError) as info:
        make_client().execute(SB, ["true"], env={"A": "1"})
    err = info.value
    assert (err.status, err.operation, err.process_id) == (429, "process creation", None)
    advice = CREATION_REFUSALS[429]
    assert str(err) == f"CreateOS answered HTTP 429 to process creation: {advice}."
    assert public_chain(err)
    assert_clean(err, "SECRET-BODY")
    # CANNED_RETRY allows two attempts: a listing before the second, and one after the
    # last (a 429 may come from a proxy that forwarded the creation).
    assert len(calls(rsps, "POST", PROCS)) == CANNED_RETRY.max_attempts
    assert len(calls(rsps, "GET", PROCS)) == CANNED_RETRY.max_attempts
    staged = query(calls(rsps, "PUT", FILES)[0])["path"]
    (cleanup,) = calls(rsps, "POST", EXEC)
    assert body_of(cleanup) == {"cmd": "rm", "args": ["-f", "--", staged]}
    assert not calls(rsps, "GET", CONNECT)


def test_creation_429_honours_retry_after(rsps: responses.RequestsMock) -> None:
    stamps: List[float] = []

    def refuse_once(request: Any) -> Any:
        stamps.append(time.monotonic())
        if len(stamps) == 1:
            return (429, {"Retry-After": "1"}, "")
        return (200, {}, json.dumps(ok(process_record())))

    rsps.add_callback(responses.POST, PROCS, callback=refuse_once)
    rsps.add(responses.GET, PROCS, json=ok({"processes": []}))
    add_connect(rsps, nd(EXIT0))
    policy = dataclasses.replace(CANNED_RETRY, max_retry_after=5.0)
    assert make_client(retry=policy).execute(SB, ["true"]).exit_code == 0
    assert len(stamps) == 2 and stamps[1] - stamps[0] >= 0.9


def test_creation_429_is_not_waited_out_past_the_deadline(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.POST, PROCS, status=429, headers={"Retry-After": "30"}, body="")
    rsps.add(responses.GET, PROCS, json=ok({"processes": []}))
    policy = dataclasses.replace(CANNED_RETRY, max_attempts=8, max_retry_after=60.0)
    started = time.monotonic()
    with pytest.raises(cx.APIError) as info:
        make_client(retry=policy).execute(SB, ["true"], timeout=0.5)
    assert info.value.status == 429
    assert time.monotonic() - started < 5  # the 30 s were never waited
    # Not sent again; listed once, as after any last 429: it shows no process.
    assert [c.request.method for c in rsps.calls] == ["POST", "GET"]


@pytest.mark.parametrize(
    "listing",
    [(500, {}, ""), (200, {}, "not json"), requests.exceptions.ConnectionError("down")],
    ids=["500", "not json", "unreachable"],
)
def test_creation_429_with_a_failed_listing_is_never_sent_again(
    rsps: responses.RequestsMock, listing: Any
) -> None:
    rsps.add(responses.POST, PROCS, status=429, headers={"Retry-After": "0"}, body="")
    add_listing(rsps, listing)
    # The look once more fails too: nobody knows whether the 429 was a proxy's.
    with pytest.raises(cx.CleanupError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.creation_unconfirmed
    assert isinstance(info.value.__cause__, cx.CreateOSError)  # what the listing met
    assert public_chain(info.value)
    assert len(calls(rsps, "POST", PROCS)) == 1


# --------------------------------------------------------------------------
# Nothing was sent: a refused connection
# --------------------------------------------------------------------------


def test_refused_connection_on_creation_means_not_created(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.POST, PROCS, body=requests.exceptions.ConnectTimeout("no route"))
    with pytest.raises(cx.TransportError) as info:
        make_client().execute(SB, ["true"])
    assert not isinstance(info.value, cx.CleanupError)
    assert info.value.operation == "process creation"
    assert len(rsps.calls) == 1  # no retry, no listing


# --------------------------------------------------------------------------
# The outcome is unknown: found by its marker, or unconfirmed
# --------------------------------------------------------------------------


AMBIGUOUS = {
    "500": (500, {}, json.dumps({"status": "error", "message": "SECRET-BODY", "code": 1})),
    "502": (502, {}, "bad gateway SECRET-BODY"),
    "503": (503, {"Retry-After": "0"}, ""),
    "408": (408, {}, ""),
    "connection error": requests.exceptions.ConnectionError("reset"),
    "read timeout": requests.exceptions.ReadTimeout("slow"),
    "2xx not JSON": (200, {}, "<html>SECRET-BODY</html>"),
    "2xx not JSend": (200, {}, json.dumps({"status": "fail", "data": {"echo": "SECRET-BODY"}})),
    "2xx data not an object": (200, {}, json.dumps(ok(["proc_x"]))),
    "2xx data null": (201, {}, json.dumps(ok(None))),
    "2xx bad process_id": (200, {}, json.dumps(ok(process_record(process_id="../etc")))),
    "204 empty": (204, {}, ""),
}


@pytest.mark.parametrize("answer", AMBIGUOUS.values(), ids=list(AMBIGUOUS))
def test_ambiguous_creation_is_found_by_marker(rsps: responses.RequestsMock, answer: Any) -> None:
    add_creation(rsps, answer, listed=True)
    add_connect(rsps, nd(data(1, "stdout", b"found\n"), EXIT0))
    result = make_client().execute(SB, ["true"])
    assert result.creation_recovered is True
    assert result.process_id == PID
    assert result.stdout == "found\n" and result.exit_code == 0
    assert len(calls(rsps, "POST", PROCS)) == 1  # never re-sent
    assert len(calls(rsps, "GET", PROCS)) == 1


@pytest.mark.parametrize("answer", AMBIGUOUS.values(), ids=list(AMBIGUOUS))
def test_ambiguous_creation_not_listed_is_unconfirmed(
    rsps: responses.RequestsMock, answer: Any
) -> None:
    add_creation(rsps, answer, listed=False)
    with pytest.raises(cx.CleanupError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.creation_unconfirmed is True
    assert len(calls(rsps, "POST", PROCS)) == 1
    assert not calls(rsps, "GET", CONNECT)
    assert_clean(info.value, "SECRET-BODY")


@pytest.mark.parametrize(
    "listing",
    [
        (500, {}, json.dumps({"status": "error", "message": "down"})),
        (403, {}, json.dumps({"status": "fail", "data": "no"})),
        (200, {}, "not json"),
        (200, {}, json.dumps(ok({"processes": "none"}))),
        (200, {}, json.dumps(ok([]))),
        requests.exceptions.ConnectionError("down"),
    ],
    ids=["500", "403", "not json", "processes not a list", "data a list", "unreachable"],
)
def test_ambiguous_creation_with_failed_listing_is_unconfirmed(
    rsps: responses.RequestsMock, listing: Any
) -> None:
    add_creation(rsps, (500, {}, ""))
    add_listing(rsps, listing)
    with pytest.raises(cx.CleanupError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.creation_unconfirmed is True
    assert isinstance(info.value.__cause__, cx.CreateOSError)
    assert len(calls(rsps, "POST", PROCS)) == 1
    assert not calls(rsps, "GET", CONNECT)


@pytest.mark.parametrize(
    "pid, args", [("bad/id", None), ("proc_other", 5)], ids=["bad id", "odd args"]
)
def test_a_listed_record_that_cannot_be_the_process_is_unconfirmed(
    rsps: responses.RequestsMock, pid: str, args: Any
) -> None:
    add_creation(rsps, (500, {}, ""), listed=True, pid=pid, args=args)
    with pytest.raises(cx.CleanupError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.creation_unconfirmed is True


def test_markers_are_random_per_command() -> None:
    plans = [cx._plan(["true"], cx._Options()) for _ in range(5)]
    markers = {plan.marker for plan in plans}
    assert len(markers) == 5
    for plan in plans:
        assert plan.body["args"][2] == plan.marker
        assert plan.staged_path is None and plan.staged is None


# --------------------------------------------------------------------------
# The wrapper script, run by a local bash
# --------------------------------------------------------------------------


def test_quote_survives_bash() -> None:
    assert cx._quote("it's") == "'it'\\''s'"
    assert cx._quote("") == "''"


needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run_wrapper(plan: Any) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    if plan.staged_path is not None:
        with open(plan.staged_path, "wb") as handle:
            handle.write(plan.staged)
    try:
        assert plan.body["cmd"] == "bash"
        return subprocess.run(["bash"] + plan.body["args"], capture_output=True, timeout=10)
    finally:
        if plan.staged_path is not None and os.path.exists(plan.staged_path):
            os.unlink(plan.staged_path)


@needs_bash
def test_wrapper_script_runs_argv_verbatim() -> None:
    argv = ["printf", "%s|", "a b", "it's", "$HOME", "x\ny", "", "*", "-n", "`id`", "é"]
    plan = cx._plan(argv, cx._Options())
    done = _run_wrapper(plan)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == "|".join(argv[2:]) + "|"


@needs_bash
def test_wrapper_script_stages_env_stdin_and_cwd() -> None:
    env = {"FOO": "v a'l\nue=x", "_B": ""}
    stdin = b"line1\nline2\0bin\xff"
    plan = cx._plan(
        'printf "%s|%s|" "$FOO" "${_B-unset}"; pwd; od -An -c',
        cx._Options(shell=True, cwd="/", env=env, stdin=stdin),
    )
    done = _run_wrapper(plan)
    assert done.returncode == 0, done.stderr
    out = done.stdout.decode()
    assert out.startswith("v a'l\nue=x||/\n")
    assert "l   i   n   e   1  \\n" in out and "\\0   b   i   n" in out
    assert plan.staged_path is not None and not os.path.exists(plan.staged_path)  # removed


@needs_bash
def test_wrapper_script_missing_cwd_fails() -> None:
    plan = cx._plan(["true"], cx._Options(cwd="/no/such/dir-x"))
    assert _run_wrapper(plan).returncode == 1


@needs_bash
def test_wrapper_script_keeps_env_named_like_loop_variable() -> None:
    plan = cx._plan(
        'printf "%s" "${_cx_var-UNSET}"', cx._Options(shell=True, env={"_cx_var": "kept"})
    )
    assert _run_wrapper(plan).stdout == b"kept"
