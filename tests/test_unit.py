"""Unit tests of createos_exec: canned HTTP answers (responses) and module internals.

No server runs here: every HTTP exchange is a canned answer registered with
`responses`, and the internals (frame reader, decoders, tails, retry budget,
rate limiter, wrapper script) are called directly. End-to-end behaviour
against the local CreateOS-compatible server is covered elsewhere.
"""

from __future__ import annotations

import base64
import dataclasses
import email.utils
import itertools
import json
import logging
import os
import pickle
import random
import re
import shutil
import string
import subprocess
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

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
    WAIT,
    add_connect,
    add_created,
    add_deleted,
    agrees_with_json,
    assert_clean,
    assert_deleted_once,
    blocks,
    body_of,
    calls,
    chain,
    data,
    exited,
    frames,
    make_client,
    nd,
    ok,
    process_record,
    query,
    reader_with_deliveries,
)

import createos_exec as cx

EVIL = "https://evil.example.test/"
FAST = CANNED_RETRY
record = process_record


# --------------------------------------------------------------------------
# Client construction and URL validation
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, expected",
    [
        ("https://api.example.test", "https://api.example.test"),
        ("https://api.example.test/", "https://api.example.test"),
        ("https://api.example.test/v1", "https://api.example.test"),
        ("https://api.example.test/v1/", "https://api.example.test"),
        ("https://api.example.test:8443/prefix/v1/", "https://api.example.test:8443/prefix"),
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080"),
        ("http://[::1]:8080/", "http://[::1]:8080"),
        ("http://localhost:9000/v1/", "http://localhost:9000"),
        ("http://LOCALHOST:9000", "http://LOCALHOST:9000"),
    ],
)
def test_client_accepts_and_normalises_url(url: str, expected: str) -> None:
    client = cx.Client(url, KEY, rate_limit=None)
    assert client.api_url == expected


@pytest.mark.parametrize(
    "url",
    [
        "http://api.example.test",  # plain http off loopback
        "http://10.0.0.1:8080",
        "http://localhost.evil.test",
        "http://127.0.0.1.evil.test",
        "https://user:pw@api.example.test",
        "https://user@api.example.test",
        "https://api.example.test/?x=1",
        "https://api.example.test/?",
        "https://api.example.test/#frag",
        "https://api.example.test#",
        "https://api.example.test:99999",
        "https://api.example.test:abc",
        "ftp://api.example.test",
        "ws://127.0.0.1",
        "file:///etc/passwd",
        "api.example.test",
        "https://",
        "https:///v1",
        "http://::1/",
    ],
)
def test_client_refuses_bad_url(url: str) -> None:
    with pytest.raises(cx.ConfigError) as info:
        cx.Client(url, KEY, rate_limit=None)
    assert isinstance(info.value, ValueError)


def test_client_url_from_environment_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cx.Client(api_key=KEY, rate_limit=None).api_url == cx.DEFAULT_API_URL
    monkeypatch.setenv("CREATEOS_API_URL", "https://other.example.test/v1/")
    assert cx.Client(api_key=KEY, rate_limit=None).api_url == "https://other.example.test"
    monkeypatch.setenv("CREATEOS_API_URL", "http://evil.example.test")
    with pytest.raises(cx.ConfigError):
        cx.Client(api_key=KEY, rate_limit=None)


def test_api_key_sources(monkeypatch: pytest.MonkeyPatch, rsps: responses.RequestsMock) -> None:
    def sent_key(client: cx.Client) -> str:
        rsps.add(responses.GET, f"{BASE}/probe", json=ok({}))
        client._transport.send("GET", "/probe", operation="probe", timeout=(1, 1)).close()
        return str(rsps.calls[-1].request.headers["X-Api-Key"])

    with pytest.raises(cx.ConfigError):
        cx.Client(BASE, rate_limit=None)  # nothing anywhere
    monkeypatch.setenv("CREATEOS_SANDBOX_API_KEY", "sandbox-key")
    assert sent_key(cx.Client(BASE, rate_limit=None)) == "sandbox-key"
    monkeypatch.setenv("CREATEOS_API_KEY", "api-key")
    assert sent_key(cx.Client(BASE, rate_limit=None)) == "api-key"  # preferred
    assert sent_key(cx.Client(BASE, "explicit", rate_limit=None)) == "explicit"  # argument wins


def test_missing_key_is_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CREATEOS_API_KEY", "")
    with pytest.raises(cx.ConfigError):
        cx.Client(BASE, rate_limit=None)
    with pytest.raises(cx.ConfigError):
        cx.Client(BASE, "", rate_limit=None)


@pytest.mark.parametrize("key", ["a\rb", "a\nb", "abc\r\n", "a\0b", " padded ", b"bytes-key", 123])
def test_key_that_cannot_be_a_header_is_refused(key: Any) -> None:
    with pytest.raises(cx.ConfigError) as info:
        cx.Client(BASE, key, rate_limit=None)
    if isinstance(key, str):
        assert key.strip() not in str(info.value)


def test_repr_never_shows_key() -> None:
    client = cx.Client(BASE, KEY, rate_limit=None)
    assert KEY not in repr(client)
    assert KEY not in str(client)
    assert BASE in repr(client)


@pytest.mark.parametrize("name", ["request_timeout", "stream_idle_timeout", "cleanup_timeout"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), "5", True, None])
def test_client_refuses_bad_timeouts(name: str, value: Any) -> None:
    with pytest.raises(cx.ConfigError):
        cx.Client(BASE, KEY, rate_limit=None, **{name: value})


@pytest.mark.parametrize(
    "value",
    [
        (0, 60.0),
        (-1, 60.0),
        (10, 0),
        (10, -1.0),
        (1.5, 1.0),
        (True, 1.0),
        (1, True),
        "300/60",
        (1, 2, 3),
        5,
    ],
)
def test_client_refuses_bad_rate_limit(value: Any) -> None:
    with pytest.raises(cx.ConfigError):
        cx.Client(BASE, KEY, rate_limit=value)


def test_client_refuses_bad_retry_and_session() -> None:
    with pytest.raises(cx.ConfigError):
        cx.Client(BASE, KEY, rate_limit=None, retry={"max_attempts": 3})
    with pytest.raises(cx.ConfigError):
        cx.Client(BASE, KEY, rate_limit=None, session=object())


@pytest.mark.parametrize(
    "kw",
    [
        {"max_attempts": 0},
        {"max_attempts": 1.5},
        {"max_attempts": True},
        {"budget": -1},
        {"initial_backoff": -0.1},
        {"max_backoff": "1"},
        {"max_retry_after": None},
    ],
)
def test_retry_policy_refuses_bad_values(kw: Dict[str, Any]) -> None:
    with pytest.raises(cx.ConfigError):
        cx.RetryPolicy(**kw)


@pytest.mark.parametrize("name", ["budget", "initial_backoff", "max_backoff", "max_retry_after"])
def test_retry_policy_refuses_nan(name: str) -> None:
    with pytest.raises(cx.ConfigError):
        cx.RetryPolicy(**{name: float("nan")})


def test_retry_policy_is_frozen() -> None:
    policy = cx.RetryPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_attempts = 3  # type: ignore[misc]


def test_callers_session_is_used_and_not_closed(rsps: responses.RequestsMock) -> None:
    class CountingSession(requests.Session):
        closed = 0
        requests_sent = 0

        def close(self) -> None:
            CountingSession.closed += 1
            super().close()

        def request(self, *a: Any, **kw: Any) -> Any:  # type: ignore[override]
            CountingSession.requests_sent += 1
            return super().request(*a, **kw)

    session = CountingSession()
    rsps.add(responses.GET, f"{BASE}/probe", json=ok({}))
    with cx.Client(BASE, KEY, rate_limit=None, session=session) as client:
        client._transport.send("GET", "/probe", operation="probe", timeout=(1, 1))
    assert CountingSession.requests_sent == 1
    assert CountingSession.closed == 0


# --------------------------------------------------------------------------
# execute() / attach() argument validation: ConfigError before any request
# --------------------------------------------------------------------------

BAD_EXECUTE_CALLS = {
    "sandbox id with slash": (("sb/1", ["true"]), {}),
    "empty sandbox id": (("", ["true"]), {}),
    "sandbox id of 201 chars": (("a" * 201, ["true"]), {}),
    "sandbox id ..": (("..", ["true"]), {}),
    "sandbox id with dot": (("sb.1", ["true"]), {}),
    "sandbox id not str": ((1, ["true"]), {}),
    "NUL in argv": ((SB, ["echo", "a\0b"]), {}),
    "NUL in program": ((SB, "ec\0ho"), {}),
    "NUL in cwd": ((SB, ["true"]), {"cwd": "/tmp\0x"}),
    "cwd not str": ((SB, ["true"]), {"cwd": b"/tmp"}),
    "NUL in env value": ((SB, ["true"]), {"env": {"A": "x\0y"}}),
    "env value not str": ((SB, ["true"]), {"env": {"A": 1}}),
    "env value lone surrogate": ((SB, ["true"]), {"env": {"A": "\ud800"}}),
    "NUL in shell script": ((SB, "echo a\0b"), {"shell": True}),
    "env name 1A": ((SB, ["true"]), {"env": {"1A": "x"}}),
    "env name A-B": ((SB, ["true"]), {"env": {"A-B": "x"}}),
    "env name A=B": ((SB, ["true"]), {"env": {"A=B": "x"}}),
    "env name empty": ((SB, ["true"]), {"env": {"": "x"}}),
    "env name not str": ((SB, ["true"]), {"env": {1: "x"}}),
    "env name with newline": ((SB, ["true"]), {"env": {"A\nB": "x"}}),
    "env not a dict": ((SB, ["true"]), {"env": [("A", "x")]}),
    "env a string": ((SB, ["true"]), {"env": "A=x"}),
    "non-string argv item": ((SB, ["echo", 1]), {}),
    "None argv item": ((SB, ["echo", None]), {}),
    "bytes command": ((SB, b"echo hi"), {}),
    "bytearray command": ((SB, bytearray(b"echo")), {}),
    "bytes argv item": ((SB, ["echo", b"hi"]), {}),
    "empty list": ((SB, []), {}),
    "not a sequence": ((SB, 42), {}),
    "a set": ((SB, {"echo"}), {}),
    "shell=True with a list": ((SB, ["echo", "hi"]), {"shell": True}),
    "timeout 0": ((SB, ["true"]), {"timeout": 0}),
    "timeout negative": ((SB, ["true"]), {"timeout": -1}),
    "timeout NaN": ((SB, ["true"]), {"timeout": float("nan")}),
    "timeout bool": ((SB, ["true"]), {"timeout": True}),
    "timeout str": ((SB, ["true"]), {"timeout": "10"}),
    "max_output_chars negative": ((SB, ["true"]), {"max_output_chars": -1}),
    "max_output_chars float": ((SB, ["true"]), {"max_output_chars": 1.5}),
    "unknown encoding": ((SB, ["true"]), {"encoding": "no-such-codec"}),
    "unknown errors handler": ((SB, ["true"]), {"errors": "no-such-handler"}),
    "on_output not callable": ((SB, ["true"]), {"on_output": "print"}),
    "cancel not an event": ((SB, ["true"]), {"cancel": True}),
    "stdin of wrong type": ((SB, ["cat"]), {"stdin": 5}),
}


@pytest.mark.parametrize("args, kwargs", BAD_EXECUTE_CALLS.values(), ids=list(BAD_EXECUTE_CALLS))
def test_execute_validates_before_any_request(args: Any, kwargs: Dict[str, Any]) -> None:
    client = make_client()
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        with pytest.raises(cx.ConfigError) as info:
            client.execute(*args, **kwargs)
        assert len(mock.calls) == 0
    assert isinstance(info.value, ValueError)
    assert "x\0y" not in str(info.value)


@pytest.mark.parametrize(
    "process_id, kwargs",
    [
        ("proc/x", {}),
        ("", {}),
        ("p" * 201, {}),
        ("..", {}),
        (None, {}),
        (PID, {"after": -1}),
        (PID, {"after": 1.0}),
        (PID, {"after": True}),
        (PID, {"after": "3"}),
        (PID, {"timeout": 0}),
    ],
)
def test_attach_validates_before_any_request(process_id: Any, kwargs: Dict[str, Any]) -> None:
    client = make_client()
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        with pytest.raises(cx.ConfigError):
            client.attach(SB, process_id, **kwargs)
        assert len(mock.calls) == 0


def test_module_execute_without_key_fails_before_any_request() -> None:
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        with pytest.raises(cx.ConfigError):
            cx.execute(SB, ["true"])
        assert len(mock.calls) == 0


# --------------------------------------------------------------------------
# The normal run, and what is sent
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
    assert not result.output_truncated
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
    assert "cd -- '/srv/app dir' 2>/dev/null || " in script
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


def test_attach_resumes_after_given_seq(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.GET, PROC, json=ok(record(cmd="sh", args=["-c", "echo"])))
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


def test_module_level_execute_with_client(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"x"), EXIT0))
    assert cx.execute(SB, "true", client=make_client()).stdout == "x"


def test_module_level_execute_from_environment(
    rsps: responses.RequestsMock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CREATEOS_API_URL", BASE + "/v1")
    monkeypatch.setenv("CREATEOS_SANDBOX_API_KEY", KEY)
    add_created(rsps)
    add_connect(rsps, nd(EXIT0))
    assert cx.execute(SB, "true").exit_code == 0
    assert rsps.calls[0].request.headers["X-Api-Key"] == KEY


def test_check_true_raises_command_error(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"SECRET-OUTPUT\n"), {"type": "exit", "exit_code": 2}))
    with pytest.raises(cx.CommandError) as info:
        make_client().execute(SB, ["false"], check=True)
    err = info.value
    assert isinstance(err, subprocess.CalledProcessError)
    assert err.returncode == 2
    assert err.output == "SECRET-OUTPUT\n"
    assert err.result is not None and err.result.exit_code == 2
    assert err.process_id == PID
    assert_clean(err, "SECRET-OUTPUT")
    assert not calls(rsps, "DELETE", PROC)  # it exited: nothing to contain


def test_logs_never_show_key_env_or_output(
    rsps: responses.RequestsMock, caplog: pytest.LogCaptureFixture
) -> None:
    rsps.add(responses.PUT, FILES, json=ok({}))
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"SECRET-OUTPUT"), EXIT0))
    caplog.set_level(logging.DEBUG, logger="createos_exec")
    make_client().execute(SB, ["true"], env={"T": "SECRET-ENV"})
    assert "POST /v1/sandboxes/sb_1/processes" in caplog.text
    for secret in (KEY, "SECRET-ENV", "SECRET-OUTPUT"):
        assert secret not in caplog.text


# --------------------------------------------------------------------------
# Process creation: status handling, ambiguity and the marker
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


# A 429 is waited out (see the tests of pacing below); the others are final.
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
    assert len(rsps.calls) == 1  # no retry, no listing, no connect


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


REFUSED = (429, {"Retry-After": "0"}, json.dumps({"status": "fail", "data": "SECRET-BODY"}))


def add_refused_creation(rsps: responses.RequestsMock, *, listed: bool) -> None:
    """A creation answered 429, then a listing that shows its process or not."""
    creation = _Creation(REFUSED)
    rsps.add_callback(responses.POST, PROCS, callback=creation)
    rsps.add_callback(responses.GET, PROCS, callback=_listing(creation, include=listed))


def public_chain(exc: BaseException) -> bool:
    """No exception a caller can reach from `exc` is a private class of the module."""
    return all(not type(link).__name__.startswith("_") for link in chain(exc))


def test_creation_429_is_waited_out_and_sent_again_after_a_listing(
    rsps: responses.RequestsMock,
) -> None:
    add_refused_creation(rsps, listed=False)
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
    add_refused_creation(rsps, listed=True)
    add_connect(rsps, nd(data(1, "stdout", b"adopted\n"), EXIT0))
    result = make_client().execute(SB, ["true"])
    assert result.stdout == "adopted\n" and result.process_id == PID
    assert result.creation_recovered is True
    assert len(calls(rsps, "POST", PROCS)) == 1


def test_creation_429_until_the_policy_runs_out_is_api_error_429(
    rsps: responses.RequestsMock,
) -> None:
    rsps.add(responses.PUT, FILES, json=ok({}))
    add_refused_creation(rsps, listed=False)
    rsps.add(responses.POST, EXEC, json=ok({"result": {"exit_code": 0}}))
    with pytest.raises(cx.APIError) as info:
        make_client().execute(SB, ["true"], env={"A": "1"})
    err = info.value
    assert (err.status, err.operation, err.process_id) == (429, "process creation", None)
    advice = CREATION_REFUSALS[429]
    assert str(err) == f"CreateOS answered HTTP 429 to process creation: {advice}."
    assert public_chain(err)
    assert_clean(err, "SECRET-BODY")
    # FAST allows two attempts: a listing before the second, and one after the
    # last (a 429 may come from a proxy that forwarded the creation).
    assert len(calls(rsps, "POST", PROCS)) == FAST.max_attempts
    assert len(calls(rsps, "GET", PROCS)) == FAST.max_attempts
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
        return (200, {}, json.dumps(ok(record())))

    rsps.add_callback(responses.POST, PROCS, callback=refuse_once)
    rsps.add(responses.GET, PROCS, json=ok({"processes": []}))
    add_connect(rsps, nd(EXIT0))
    policy = dataclasses.replace(FAST, max_retry_after=5.0)
    assert make_client(retry=policy).execute(SB, ["true"]).exit_code == 0
    assert len(stamps) == 2 and stamps[1] - stamps[0] >= 0.9


def test_creation_429_is_not_waited_out_past_the_deadline(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.POST, PROCS, status=429, headers={"Retry-After": "30"}, body="")
    rsps.add(responses.GET, PROCS, json=ok({"processes": []}))
    policy = dataclasses.replace(FAST, max_attempts=8, max_retry_after=60.0)
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
            record(process_id="proc_other", args=["-c", "x", "createos_exec-" + "0" * 24]),
            record(process_id="proc_no_args"),
        ]
        if include:
            processes.append(record(process_id=pid, args=creation.args if args is None else args))
        return (200, {}, json.dumps(ok({"processes": processes})))

    return callback


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
    "2xx bad process_id": (200, {}, json.dumps(ok(record(process_id="../etc")))),
    "204 empty": (204, {}, ""),
}


@pytest.mark.parametrize("answer", AMBIGUOUS.values(), ids=list(AMBIGUOUS))
def test_ambiguous_creation_is_found_by_marker(rsps: responses.RequestsMock, answer: Any) -> None:
    creation = _Creation(answer)
    rsps.add_callback(responses.POST, PROCS, callback=creation)
    rsps.add_callback(responses.GET, PROCS, callback=_listing(creation, include=True))
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
    creation = _Creation(answer)
    rsps.add_callback(responses.POST, PROCS, callback=creation)
    rsps.add_callback(responses.GET, PROCS, callback=_listing(creation, include=False))
    with pytest.raises(cx.CleanupError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.creation_unconfirmed is True
    assert len(calls(rsps, "POST", PROCS)) == 1
    assert not calls(rsps, "GET", CONNECT)
    assert_clean(info.value, "SECRET-BODY")


def add_listing(rsps: responses.RequestsMock, listing: Any) -> None:
    """The answer to GET …/processes: (status, headers, body), or an exception raised."""
    if isinstance(listing, BaseException):
        rsps.add(responses.GET, PROCS, body=listing)
    else:
        status, headers, text = listing
        rsps.add(responses.GET, PROCS, status=status, headers=headers, body=text)


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
    creation = _Creation((500, {}, ""))
    rsps.add_callback(responses.POST, PROCS, callback=creation)
    add_listing(rsps, listing)
    with pytest.raises(cx.CleanupError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.creation_unconfirmed is True
    assert isinstance(info.value.__cause__, cx.CreateOSError)
    assert len(calls(rsps, "POST", PROCS)) == 1
    assert not calls(rsps, "GET", CONNECT)


def test_refused_connection_on_creation_means_not_created(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.POST, PROCS, body=requests.exceptions.ConnectTimeout("no route"))
    with pytest.raises(cx.TransportError) as info:
        make_client().execute(SB, ["true"])
    assert not isinstance(info.value, cx.CleanupError)
    assert info.value.operation == "process creation"
    assert len(rsps.calls) == 1  # no retry, no listing


def test_marker_record_with_invalid_id_is_unconfirmed(rsps: responses.RequestsMock) -> None:
    creation = _Creation((500, {}, ""))
    rsps.add_callback(responses.POST, PROCS, callback=creation)
    rsps.add_callback(responses.GET, PROCS, callback=_listing(creation, True, pid="bad/id"))
    with pytest.raises(cx.CleanupError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.creation_unconfirmed is True


def test_listing_record_with_odd_args_is_not_a_crash(rsps: responses.RequestsMock) -> None:
    creation = _Creation((500, {}, ""))
    rsps.add_callback(responses.POST, PROCS, callback=creation)
    rsps.add(
        responses.GET,
        PROCS,
        json=ok({"processes": [record(process_id="proc_other", args=5)]}),
    )
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
# Redirects are never followed
# --------------------------------------------------------------------------

REDIRECTS = [301, 302, 303, 307, 308]


@pytest.mark.parametrize("status", REDIRECTS)
def test_redirect_on_create_not_followed(
    rsps: responses.RequestsMock, evil: List[str], status: int
) -> None:
    rsps.add(responses.POST, PROCS, status=status, headers={"Location": EVIL})
    with pytest.raises(cx.APIError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.status == status
    assert info.value.operation == "process creation"
    assert evil == []
    assert len(rsps.calls) == 1


@pytest.mark.parametrize("status", REDIRECTS)
def test_redirect_on_connect_not_followed(
    rsps: responses.RequestsMock, evil: List[str], status: int
) -> None:
    add_created(rsps)
    rsps.add(responses.GET, CONNECT, status=status, headers={"Location": EVIL + "connect"})
    add_deleted(rsps)
    with pytest.raises(cx.APIError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.status == status
    assert info.value.operation == "output connection"
    assert info.value.process_id == PID
    assert evil == []
    assert len(calls(rsps, "GET", CONNECT)) == 1
    assert_deleted_once(rsps)


@pytest.mark.parametrize("status", REDIRECTS)
def test_redirect_on_exit_check_wait_not_followed(
    rsps: responses.RequestsMock, evil: List[str], status: int
) -> None:
    # An exit frame without status is checked once against `wait`; a redirect
    # there is not followed and the run fails closed with a ProtocolError.
    add_created(rsps)
    add_connect(rsps, nd({"type": "exit"}))
    rsps.add(responses.GET, WAIT, status=status, headers={"Location": EVIL})
    add_deleted(rsps)
    with pytest.raises(cx.ProtocolError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.problem == "the exit frame carries no exit status"
    assert evil == []
    waits = calls(rsps, "GET", WAIT)
    assert len(waits) == 1 and waits[0].response.status_code == status
    assert_deleted_once(rsps)


@pytest.mark.parametrize("status", REDIRECTS)
def test_redirect_on_recovery_wait_not_followed(
    rsps: responses.RequestsMock, evil: List[str], status: int
) -> None:
    # The stream keeps ending without an exit frame; out-of-band recovery
    # meets a redirect: StreamEndedError, caused by the APIError.
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"a")))
    rsps.add(responses.GET, WAIT, status=status, headers={"Location": EVIL})
    add_deleted(rsps)
    with pytest.raises(cx.StreamEndedError) as info:
        make_client().execute(SB, ["true"])
    cause = info.value.__cause__
    assert isinstance(cause, cx.APIError) and cause.status == status
    assert cause.operation == "exit status wait"
    assert evil == []
    assert len(calls(rsps, "GET", WAIT)) == 1
    assert_deleted_once(rsps)


@pytest.mark.parametrize("status", [301, 307])
def test_redirect_on_delete_is_cleanup_error(
    rsps: responses.RequestsMock, evil: List[str], status: int
) -> None:
    add_created(rsps)
    add_connect(rsps, nd("[1]"))
    rsps.add(responses.DELETE, PROC, status=status, headers={"Location": EVIL})
    with pytest.raises(cx.CleanupError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.creation_unconfirmed is False
    assert isinstance(info.value.__cause__, cx.ProtocolError)
    assert evil == []


# --------------------------------------------------------------------------
# The stream: frame rules (protocol.md §5.4 / §10.4)
# --------------------------------------------------------------------------


def _run(rsps: responses.RequestsMock, body: str, **kw: Any) -> cx.ExecResult:
    add_created(rsps)
    add_connect(rsps, body)
    add_deleted(rsps)
    return make_client().execute(SB, ["true"], **kw)


def test_exit_by_go_style_signal(rsps: responses.RequestsMock) -> None:
    result = _run(rsps, nd(data(1, "stdout", b"x"), {"type": "exit", "signal": "killed"}))
    assert result.signal == "SIGKILL"
    assert result.exit_code is None
    assert result.returncode == -9
    assert not result.ok


def test_exit_signal_wins_over_code(rsps: responses.RequestsMock) -> None:
    result = _run(rsps, nd({"type": "exit", "exit_code": 143, "signal": "SIGTERM"}))
    assert result.signal == "SIGTERM" and result.exit_code is None and result.returncode == -15


def test_duplicate_seq_is_dropped(rsps: responses.RequestsMock) -> None:
    seen: List[Any] = []
    result = _run(
        rsps,
        nd(
            data(1, "stdout", b"a"),
            data(1, "stdout", b"a"),
            data(2, "stderr", b"b"),
            data(1, "stdout", b"DUP"),
            data(2, "stderr", b"DUP"),
            data(3, "stdout", b"c"),
            EXIT0,
        ),
        on_output=lambda s, t: seen.append((s, t)),
    )
    assert result.stdout == "ac" and result.stderr == "b"
    assert seen == [("stdout", "a"), ("stderr", "b"), ("stdout", "c")]


def test_utf8_split_across_frames_and_streams(rsps: responses.RequestsMock) -> None:
    euro = "€".encode()
    seen: List[Any] = []
    result = _run(
        rsps,
        nd(
            data(1, "stdout", euro[:1]),
            data(2, "stderr", "é".encode()[:1]),
            data(3, "stdout", euro[1:2]),
            data(4, "stderr", "é".encode()[1:]),
            data(5, "stdout", euro[2:] + b"!"),
            data(6, "stdout", b""),
            EXIT0,
        ),
        on_output=lambda s, t: seen.append((s, t)),
    )
    assert result.stdout == "€!" and result.stderr == "é"
    assert seen == [("stderr", "é"), ("stdout", "€!")]


def test_incomplete_character_at_end_is_replaced_once(rsps: responses.RequestsMock) -> None:
    seen: List[Any] = []
    result = _run(
        rsps,
        nd(data(1, "stdout", b"ok\xe2\x82"), EXIT0),
        on_output=lambda s, t: seen.append((s, t)),
    )
    assert result.stdout == "ok\ufffd"
    assert "".join(t for s, t in seen if s == "stdout") == "ok\ufffd"


def test_output_tail_is_kept(rsps: responses.RequestsMock) -> None:
    frames = [data(i, "stdout", f"{i:03d}\n".encode()) for i in range(1, 101)]
    result = _run(rsps, nd(*frames, data(101, "stderr", b"e"), EXIT0), max_output_chars=8)
    assert result.stdout == "099\n100\n"
    assert result.stdout_truncated and not result.stderr_truncated and result.output_truncated
    assert result.stderr == "e"


PROTOCOL_ERRORS = {
    "gap": nd(data(1, "stdout", b"a"), data(3, "stdout", b"c"), EXIT0),
    "first seq 2": nd(data(2, "stdout", b"a"), EXIT0),
    "seq true": nd({**data(1, "stdout", b"a"), "seq": True}, EXIT0),
    'seq "3"': nd({**data(1, "stdout", b"a"), "seq": "3"}, EXIT0),
    'seq "1"': nd({**data(1, "stdout", b"a"), "seq": "1"}, EXIT0),
    "seq 0": nd({**data(1, "stdout", b"a"), "seq": 0}, EXIT0),
    "seq -1": nd({**data(1, "stdout", b"a"), "seq": -1}, EXIT0),
    "seq 1.0": nd({**data(1, "stdout", b"a"), "seq": 1.0}, EXIT0),
    "seq missing": nd({"type": "data", "stream": "stdout", "data_base64": "YQ=="}, EXIT0),
    "stream pty": nd(data(1, "pty", b"a"), EXIT0),
    "stream missing": nd({"type": "data", "seq": 1, "data_base64": "YQ=="}, EXIT0),
    "non-canonical base64": nd({**data(1, "stdout", b"A"), "data_base64": "QR=="}, EXIT0),
    "base64 bad alphabet": nd({**data(1, "stdout", b"A"), "data_base64": "Q-_="}, EXIT0),
    "base64 missing padding": nd({**data(1, "stdout", b"A"), "data_base64": "QQ"}, EXIT0),
    "base64 with newline": nd({**data(1, "stdout", b"A"), "data_base64": "QQ==\n"}, EXIT0),
    "base64 not a string": nd({**data(1, "stdout", b"A"), "data_base64": None}, EXIT0),
    "invalid JSON": nd("{not json", EXIT0),
    "empty line": nd("", EXIT0),
    "JSON array line": nd("[1, 2]", EXIT0),
    "JSON string line": nd('"data"', EXIT0),
    "no type": nd({"seq": 1}, EXIT0),
    "type not a string": nd({"type": 1}, EXIT0),
    "unknown type": nd({"type": "progress"}, EXIT0),
    "error frame, other code": nd({"type": "error", "error": "internal"}),
    "exit code 256": nd({"type": "exit", "exit_code": 256}),
    "exit code -1": nd({"type": "exit", "exit_code": -1}),
    "exit code bool": nd({"type": "exit", "exit_code": True}),
    "exit code str": nd({"type": "exit", "exit_code": "0"}),
    "exit unknown signal": nd({"type": "exit", "signal": "exploded"}),
    "exit signal not str": nd({"type": "exit", "signal": 9}),
    "invalid UTF-8 line": b"\xff\xfe{}\n",
    "line over 1 MiB": nd('{"type":"heartbeat","pad":"' + "x" * (1024 * 1024) + '"}', EXIT0),
    "unterminated line over 1 MiB": '{"type":"heartbeat","pad":"' + "x" * (1024 * 1024 + 10),
}


@pytest.mark.parametrize("body", PROTOCOL_ERRORS.values(), ids=list(PROTOCOL_ERRORS))
def test_protocol_errors_fail_closed_and_terminate(rsps: responses.RequestsMock, body: Any) -> None:
    add_created(rsps)
    add_connect(rsps, body)
    add_deleted(rsps)
    with pytest.raises(cx.ProtocolError) as info:
        make_client().execute(SB, ["true"])
    assert not isinstance(info.value, cx.OutputEvictedError)
    assert info.value.process_id == PID
    assert info.value.problem
    assert len(calls(rsps, "GET", CONNECT)) == 1  # never reconnects
    assert not calls(rsps, "GET", WAIT)
    assert_deleted_once(rsps)


def test_protocol_error_carries_partial_result(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"SECRET-OUTPUT\n"), data(5, "stdout", b"x")))
    add_deleted(rsps)
    with pytest.raises(cx.ProtocolError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.result is not None
    assert info.value.result.stdout == "SECRET-OUTPUT\n"
    assert info.value.result.exit_code is None
    assert_clean(info.value, "SECRET-OUTPUT")


def test_messages_never_echo_frame_content(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd({"type": "SECRET-BODY"}))
    add_deleted(rsps)
    with pytest.raises(cx.ProtocolError) as info:
        make_client().execute(SB, ["true"])
    assert_clean(info.value, "SECRET-BODY")


def test_evicted_frame_mid_stream(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(
        rsps,
        nd(
            data(1, "stdout", b"hello\n"),
            {"type": "error", "error": "output_offset_expired", "oldest_available_seq": 5},
        ),
    )
    add_deleted(rsps)
    with pytest.raises(cx.OutputEvictedError) as info:
        make_client().execute(SB, ["true"], on_output=lambda *_: None)  # a live consumer
    err = info.value
    assert isinstance(err, cx.ProtocolError)
    assert err.oldest_available_seq == 5
    assert err.process_id == PID
    assert err.result is not None and err.result.stdout == "hello\n"
    assert len(calls(rsps, "GET", CONNECT)) == 1
    assert_deleted_once(rsps)


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            {
                "status": "fail",
                "data": {"error": "output_offset_expired", "oldest_available_seq": 5},
            },
            5,
        ),
        ({"status": "fail", "data": {"error": "output_offset_expired"}}, None),
        ({"status": "fail", "data": "gone"}, None),
        ([1, 2], None),
        ("not json at all", None),
    ],
)
def test_410_on_connect_is_eviction(
    rsps: responses.RequestsMock, body: Any, expected: Optional[int]
) -> None:
    add_created(rsps)
    text = body if isinstance(body, str) else json.dumps(body)
    rsps.add(responses.GET, CONNECT, status=410, body=text, content_type="application/json")
    add_deleted(rsps)
    with pytest.raises(cx.OutputEvictedError) as info:
        make_client().execute(SB, ["true"], on_output=lambda *_: None)  # a live consumer
    assert info.value.oldest_available_seq == expected
    assert isinstance(info.value, cx.ProtocolError)
    assert len(calls(rsps, "GET", CONNECT)) == 1
    assert_deleted_once(rsps)


@pytest.mark.parametrize("restart", ["frame", "410 body", "record"])
def test_eviction_nobody_reads_live_is_the_head_of_a_result(
    rsps: responses.RequestsMock, restart: str
) -> None:
    # Nobody takes the output as it comes: what was evicted is the head of
    # the output. The result is the contiguous tail from the oldest kept
    # frame on, with the process's own status, and no tree is terminated.
    add_created(rsps)
    if restart == "frame":
        evicted = nd(
            data(1, "stdout", b"old\n"),
            {"type": "error", "error": "output_offset_expired", "oldest_available_seq": 5},
        )
        add_connect(rsps, evicted)
    else:
        data_410 = {"error": "output_offset_expired"}
        if restart == "410 body":
            data_410["oldest_available_seq"] = 5
        else:
            kept = {"oldest_seq": 5, "newest_seq": 6}
            rsps.add(responses.GET, PROC, json=ok(record(output=kept)))
        body = json.dumps({"status": "fail", "data": data_410})
        rsps.add(responses.GET, CONNECT, status=410, body=body, content_type="application/json")
    add_connect(rsps, nd(data(5, "stdout", b"kept "), data(6, "stderr", b"e"), EXIT0))
    result = make_client().execute(SB, ["true"])
    assert (result.stdout, result.stderr, result.output) == ("kept ", "e", "kept e")
    assert result.output_evicted and result.stdout_truncated and result.stderr_truncated
    assert result.exit_code == 0 and result.reconnects == 0
    assert [query(c)["after"] for c in calls(rsps, "GET", CONNECT)] == ["0", "4"]
    assert not calls(rsps, "DELETE", PROC)


def test_eviction_that_keeps_the_next_frame_fails_closed(rsps: responses.RequestsMock) -> None:
    # A 410 whose record says the next frame is still kept contradicts itself.
    add_created(rsps)
    rsps.add(responses.GET, PROC, json=ok(record(output={"oldest_seq": 1, "newest_seq": 3})))
    rsps.add(responses.GET, CONNECT, status=410, json={"status": "fail", "data": "gone"})
    add_deleted(rsps)
    with pytest.raises(cx.OutputEvictedError):
        make_client().execute(SB, ["true"])
    assert_deleted_once(rsps)


def test_results_say_no_output_was_evicted_otherwise(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"x"), EXIT0))
    assert make_client().execute(SB, ["true"]).output_evicted is False


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


def test_exit_without_status_recovered_from_wait(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"x"), {"type": "exit"}))
    rsps.add(responses.GET, WAIT, json=ok(exited(1, exit_code=3)))
    result = make_client().execute(SB, ["true"])
    assert result.exit_code == 3
    assert result.exit_recovered is True
    assert result.stdout == "x"
    waits = calls(rsps, "GET", WAIT)
    assert len(waits) == 1
    assert {"scope", "timeout_ms"} <= set(query(waits[0]))
    assert not calls(rsps, "DELETE", PROC)


@pytest.mark.parametrize(
    "answer",
    [
        (200, json.dumps(ok(exited(1, exit_code=None)))),
        (200, json.dumps(ok(record()))),  # not exited
        (200, "not json"),
        (408, ""),
        (404, json.dumps({"status": "fail", "data": "gone"})),
    ],
    ids=["no status", "not exited", "not json", "408", "404"],
)
def test_exit_without_status_unrecoverable(rsps: responses.RequestsMock, answer: Any) -> None:
    add_created(rsps)
    add_connect(rsps, nd({"type": "exit", "exit_code": None, "signal": None}))
    rsps.add(responses.GET, WAIT, status=answer[0], body=answer[1])
    add_deleted(rsps)
    with pytest.raises(cx.ProtocolError):
        make_client().execute(SB, ["true"])
    assert len(calls(rsps, "GET", WAIT)) == 1  # checked once
    assert len(calls(rsps, "GET", CONNECT)) == 1
    assert_deleted_once(rsps)


# --------------------------------------------------------------------------
# Resume and out-of-band recovery with canned answers
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
    # FAST allows 2 consecutive failures; four blips separated by progress survive.
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


def test_budget_spent_then_exit_recovered(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"a\n")))  # repeats: never an exit frame
    rsps.add(responses.GET, WAIT, json=ok(exited(1, exit_code=7)))
    result = make_client().execute(SB, ["true"])
    assert result.exit_code == 7 and result.exit_recovered is True
    assert result.stdout == "a\n"
    waits = calls(rsps, "GET", WAIT)
    assert len(waits) == 1 and query(waits[0])["scope"] == "tree"
    assert len(calls(rsps, "GET", CONNECT)) == FAST.max_attempts


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
    assert len(calls(rsps, "GET", CONNECT)) == 2 * FAST.max_attempts
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
# Containment: timeout, cancel, callbacks, Ctrl-C, failing cleanup
# --------------------------------------------------------------------------


def _stalling_connect(seconds: float, body: str) -> Any:
    def callback(request: Any) -> Any:
        time.sleep(seconds)
        return (200, {}, body)

    return callback


def test_timeout_terminates_and_returns_grace_output(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    rsps.add_callback(
        responses.GET,
        CONNECT,
        callback=_stalling_connect(0.35, nd(data(1, "stdout", b"late"))),
        content_type="application/x-ndjson",
    )
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


def test_timeout_with_check_raises_command_error(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    rsps.add_callback(
        responses.GET,
        CONNECT,
        callback=_stalling_connect(0.3, nd()),
        content_type="application/x-ndjson",
    )
    add_connect(rsps, nd({"type": "exit", "signal": "SIGTERM"}))
    add_deleted(rsps)
    with pytest.raises(cx.CommandError) as info:
        make_client().execute(SB, ["sleep", "100"], timeout=0.15, check=True)
    assert info.value.result is not None and info.value.result.timed_out
    assert "timed out" in str(info.value)


def test_cancel_terminates(rsps: responses.RequestsMock) -> None:
    cancel = threading.Event()

    def created_then_cancelled(request: Any) -> Any:
        cancel.set()
        return (200, {}, json.dumps(ok(record())))

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
    class Boom(Exception):
        pass

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
    assert 1 <= len(calls(rsps, "DELETE", PROC)) <= FAST.max_attempts


@pytest.mark.parametrize(
    "delete",
    [
        (500, ""),
        (200, json.dumps(ok(record(tree_exited=False)))),
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


def test_failure_after_creation_removes_staged_file(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.PUT, FILES, json=ok({}))
    add_created(rsps)
    add_connect(rsps, nd("[]"))
    add_deleted(rsps)
    rsps.add(responses.POST, EXEC, json=ok({"result": {"exit_code": 0}}))
    with pytest.raises(cx.ProtocolError):
        make_client().execute(SB, ["true"], stdin=b"data")
    staged = query(calls(rsps, "PUT", FILES)[0])["path"]
    assert [body_of(c)["args"][-1] for c in calls(rsps, "POST", EXEC)] == [staged]


# --------------------------------------------------------------------------
# RemoteProcess: poll() and send_signal() send one request, never retried
# --------------------------------------------------------------------------


def _started(rsps: responses.RequestsMock) -> cx.RemoteProcess:
    add_created(rsps)
    return make_client().start(SB, ["sleep", "9"])


def test_poll_reads_the_record_once_and_raises_its_failures(rsps: responses.RequestsMock) -> None:
    process = _started(rsps)
    rsps.add(responses.GET, PROC, json=ok(record()))
    rsps.add(responses.GET, PROC, status=503, json={"status": "error", "message": "SECRET-BODY"})
    rsps.add(responses.GET, PROC, body=requests.exceptions.ConnectionError("reset"))
    rsps.add(responses.GET, PROC, json=ok(["not", "a", "record"]))
    rsps.add(responses.GET, PROC, json=ok(record(leader_exited=True, state="exited")))
    rsps.add(responses.GET, PROC, json=ok(exited(0, signal="killed", exit_code=-1)))
    assert process.poll() is None
    with pytest.raises(cx.APIError) as unavailable:
        process.poll()
    assert (unavailable.value.status, unavailable.value.operation) == (503, "process status")
    assert_clean(unavailable.value, "SECRET-BODY")
    with pytest.raises(cx.TransportError) as unreachable:
        process.poll()
    assert unreachable.value.process_id == PID
    with pytest.raises(cx.ProtocolError):
        process.poll()
    with pytest.raises(cx.ProtocolError):
        process.poll()  # exited, but no status: never taken for "running"
    assert process.poll() == -9
    assert process.poll() == -9  # kept: no request
    assert len(calls(rsps, "GET", PROC)) == 6


def test_send_signal_is_sent_once_and_a_gone_leader_is_no_error(
    rsps: responses.RequestsMock,
) -> None:
    process = _started(rsps)
    rsps.add(responses.POST, f"{PROC}/signal", json=ok({"ok": True}))
    rsps.add(responses.POST, f"{PROC}/signal", status=409, json={"status": "fail", "data": "x"})
    rsps.add(responses.POST, f"{PROC}/signal", status=502, body="")
    process.send_signal("SIGTERM")
    process.send_signal(2)
    with pytest.raises(cx.APIError) as caught:
        process.send_signal("SIGHUP")
    assert caught.value.status == 502  # never re-sent: a signal must not arrive twice
    sent = calls(rsps, "POST", f"{PROC}/signal")
    assert [body_of(c) for c in sent] == [
        {"signal": "SIGTERM"},
        {"signal": "SIGINT"},
        {"signal": "SIGHUP"},
    ]
    for bad in ("sigint", "SIG", 0, True, None, 10**6):
        with pytest.raises(cx.ConfigError):
            process.send_signal(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Error classes
# --------------------------------------------------------------------------


def _sample_result(**kw: Any) -> cx.ExecResult:
    fields: Dict[str, Any] = dict(
        args=["echo", "x"],
        exit_code=1,
        signal=None,
        timed_out=False,
        stdout="SECRET-OUTPUT",
        stderr="err",
        process_id=PID,
    )
    fields.update(kw)
    return cx.ExecResult(**fields)


def _error_samples() -> List[BaseException]:
    return [
        cx.CreateOSError("Root error.", process_id=PID, result=_sample_result()),
        cx.ConfigError("Bad setting."),
        cx.APIError(404, "process creation", process_id=PID),
        cx.TransportError("output connection", process_id=PID),
        cx.StreamEndedError(process_id=PID),
        cx.OutputIncompleteError(process_id=PID, result=_sample_result()),
        cx.ProtocolError("a thing is wrong", process_id=PID),
        cx.OutputEvictedError(5, process_id=PID),
        cx.CleanupError(process_id=PID),
        cx.CleanupError(creation_unconfirmed=True),
        cx.CancelledError(process_id=PID),
        cx.CommandError(_sample_result()),
        cx.CommandError(_sample_result(exit_code=None, timed_out=True)),
        cx.CommandError(_sample_result(exit_code=None, signal="SIGKILL")),
        cx.WaitTimeout(["sleep", "9"], 0.5, process_id=PID),
        cx.StdinClosedError(process_id=PID),
        cx.InputUnconfirmedError(393120, process_id=PID),
        cx.InputUnconfirmedError(0, unsent=True, process_id=PID),
        cx.ProcessEndedError(process_id=PID, result=_sample_result()),
    ]


def test_every_public_error_class_is_sampled() -> None:
    public = {
        getattr(cx, name)
        for name in cx.__all__
        if isinstance(getattr(cx, name), type) and issubclass(getattr(cx, name), BaseException)
    }
    assert public == {type(e) for e in _error_samples()}
    for cls in public:
        assert issubclass(cls, cx.CreateOSError)
        assert cls.__doc__ and "\n" not in cls.__doc__.strip()


@pytest.mark.parametrize("error", _error_samples(), ids=lambda e: type(e).__name__)
def test_error_pickle_round_trip(error: BaseException) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.args == error.args
    assert vars(copy) == vars(error)
    for attr in (
        "process_id",
        "result",
        "status",
        "operation",
        "problem",
        "oldest_available_seq",
        "creation_unconfirmed",
        "returncode",
        "cmd",
        "output",
        "stderr",
        "timeout",
        "confirmed_bytes",
        "unsent",
    ):
        assert getattr(copy, attr, None) == getattr(error, attr, None)
    assert len(error.args) == 1 and isinstance(error.args[0], str)
    assert str(error).endswith(".")
    assert_clean(error, "SECRET-OUTPUT")


def test_error_attributes() -> None:
    api = cx.APIError(503, "process cleanup", process_id=PID)
    assert (api.status, api.operation, api.process_id) == (503, "process cleanup", PID)
    evicted = cx.OutputEvictedError(None)
    assert evicted.oldest_available_seq is None and isinstance(evicted, cx.ProtocolError)
    assert isinstance(cx.StreamEndedError(), cx.TransportError)
    assert str(cx.StreamEndedError()) == "CreateOS process stream ended without an exit status."
    assert isinstance(cx.ConfigError("x"), ValueError)
    err = cx.CommandError(_sample_result(exit_code=3))
    assert isinstance(err, subprocess.CalledProcessError)
    assert (err.returncode, err.cmd, err.output, err.stderr) == (
        3,
        ["echo", "x"],
        "SECRET-OUTPUT",
        "err",
    )
    assert err.process_id == PID
    assert cx.CommandError(_sample_result(exit_code=None, signal="SIGKILL")).returncode == -9
    assert cx.CommandError(_sample_result(exit_code=None, timed_out=True)).returncode is None
    with pytest.raises(subprocess.CalledProcessError):
        raise err


def test_wait_timeout_is_also_subprocess_timeout_expired() -> None:
    error = cx.WaitTimeout(["sleep", "9"], 0.5, process_id=PID)
    assert isinstance(error, cx.CreateOSError) and isinstance(error, subprocess.TimeoutExpired)
    assert (error.cmd, error.timeout, error.output, error.stdout, error.stderr) == (
        ["sleep", "9"],
        0.5,
        None,
        None,
        None,
    )
    assert error.process_id == PID and error.result is None
    assert str(error) == "The wait ended after 0.5 seconds; the command goes on running."


@pytest.mark.parametrize(
    "status, operation, advice",
    [
        (404, "output connection", "no such process in this sandbox"),
        (404, "staging of env and stdin", "no sandbox with this id here"),
        (409, "signal delivery", "the sandbox is not running (paused or stopped?)"),
        (500, "process cleanup", "CreateOS is in trouble; try again later"),
        (503, "exit status wait", "CreateOS is in trouble; try again later"),
        (302, "output connection", "a redirect was refused"),
        (401, "process status", "the API key was refused; check CREATEOS_API_KEY"),
    ],
)
def test_api_error_says_what_a_status_means(status: int, operation: str, advice: str) -> None:
    message = str(cx.APIError(status, operation))
    assert message.startswith(f"CreateOS answered HTTP {status} to {operation}: {advice}")
    assert message.endswith(".")
    assert str(cx.APIError(status, operation)) == message  # deterministic


def test_api_error_without_advice_keeps_the_plain_sentence() -> None:
    assert str(cx.APIError(418, "process creation")) == (
        "CreateOS answered HTTP 418 to process creation."
    )


# --------------------------------------------------------------------------
# ExecResult
# --------------------------------------------------------------------------


def test_exec_result_repr_hides_output() -> None:
    result = _sample_result(stdout="SECRET-OUTPUT" * 10, stderr="SECRET-ERR")
    text = repr(result)
    assert "SECRET" not in text
    assert "130 chars" in text and "10 chars" in text
    assert PID in text


@pytest.mark.parametrize(
    "fields, returncode, ok",
    [
        ({"exit_code": 0}, 0, True),
        ({"exit_code": 3}, 3, False),
        ({"exit_code": None, "signal": "SIGKILL"}, -9, False),
        ({"exit_code": None, "signal": "SIGTERM"}, -15, False),
        ({"exit_code": None, "signal": "SIGNOPE"}, None, False),
        ({"exit_code": None, "timed_out": True}, None, False),
    ],
)
def test_exec_result_returncode(
    fields: Dict[str, Any], returncode: Optional[int], ok: bool
) -> None:
    result = _sample_result(**fields)
    assert result.returncode == returncode
    assert result.ok is ok
    if ok:
        result.check_returncode()
    else:
        with pytest.raises(cx.CommandError) as info:
            result.check_returncode()
        assert info.value.result is result


def test_exec_result_truncation_flags_and_pickle() -> None:
    assert not _sample_result().output_truncated
    assert _sample_result(stdout_truncated=True).output_truncated
    assert _sample_result(stderr_truncated=True).output_truncated
    result = _sample_result(
        reconnects=2, exit_recovered=True, creation_recovered=True, duration=1.5
    )
    copy = pickle.loads(pickle.dumps(result))
    assert copy == result and copy.stdout == "SECRET-OUTPUT"
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.exit_code = 0  # type: ignore[misc]


# --------------------------------------------------------------------------
# Internals: tails, decoders, lines, base64, exit status, Retry-After,
# retry budget, rate limiter, the wrapper script
# --------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 1, 5, 64, 1000])
def test_tail_keeps_exactly_the_last_chars(limit: int) -> None:
    rng = random.Random(limit)
    tail = cx._Tail(limit)
    reference = ""
    for _ in range(2000):
        piece = "".join(rng.choice("ab€\n\U0001d11e") for _ in range(rng.randint(0, 12)))
        tail.append(piece)
        reference += piece
        assert tail.truncated == (len(reference) > limit)
        if rng.random() < 0.1:
            assert tail.text() == (reference[-limit:] if limit else "")
    assert tail.text() == (reference[-limit:] if limit else "")


def last(text: str, limit: int) -> str:
    return text[-limit:] if limit else ""


# Pieces are cut from one random text drawn once: drawing each character anew
# made these cases the slowest of the suite (up to half a minute each, on every
# Python) for no route the cut text does not take.
CAPTURE_TEXT = "".join(random.Random(5).choices("ab€\n\U0001d11e", k=1 << 16))


# Limits below and above 16 parts; lengths that end on a part and between parts.
@pytest.mark.parametrize("limit", [0, 1, 5, 64, 1000, 70_000])
@pytest.mark.parametrize("pieces", [1, 37, 1200, 5000])
def test_capture_keeps_the_last_chars_of_each_stream_and_both(limit: int, pieces: int) -> None:
    rng = random.Random(limit * 7919 + pieces)
    handed_out: List[Tuple[str, str]] = []
    capture = cx._Output("utf-8", "strict", limit, lambda *args: handed_out.append(args))
    written: List[Tuple[str, str]] = []
    for _ in range(pieces):
        stream = rng.choice(cx._STREAMS)
        size = rng.choice([0, 1, 12, 100, 5000])
        length = rng.randint(0, size)
        start = rng.randrange(len(CAPTURE_TEXT) - length + 1)
        piece = CAPTURE_TEXT[start : start + length]
        capture.feed(stream, piece.encode("utf-8"))
        if piece:
            written.append((stream, piece))
    capture.finish(hand_out=True)
    assert handed_out == written  # as it came, nothing held back
    both = "".join(text for _, text in written)
    assert capture.combined.text() == last(both, limit)
    assert capture.combined.truncated == (len(both) > limit)
    for name, tail in capture.tails.items():
        mine = "".join(text for stream, text in written if stream == name)
        assert tail.text() == last(mine, limit)
        assert tail.truncated == (len(mine) > limit)


def test_tail_memory_stays_bounded() -> None:
    tail = cx._Tail(1000)
    for i in range(20000):
        tail.append(f"{i:09d}\n")
    assert tail.text().endswith("000019999\n") and len(tail.text()) == 1000
    assert sum(len(part) for part in tail._parts) <= 1000 + 1000 // 4 + 10


def test_capture_memory_stays_bounded() -> None:
    capture = cx._Output("utf-8", "strict", 1000, None)
    for i in range(20000):
        capture.feed(cx._STREAMS[i % 2], b"%09d\n" % i)
    held = [sum(len(part) for part in tail._parts) for tail in capture.tails.values()]
    held.append(sum(len(part) for part in capture.combined._parts))
    assert max(held) <= 1000 + 1000 // 4 + 1000 // 16 + 10
    assert capture._recent_size <= 1000 // 16 + 10


def test_tail_not_truncated_at_exact_limit() -> None:
    tail = cx._Tail(4)
    tail.append("ab")
    tail.append("cd")
    assert tail.text() == "abcd" and not tail.truncated
    tail.append("e")
    assert tail.text() == "bcde" and tail.truncated


@pytest.mark.parametrize("cut", [1, 2, 3, 4])
def test_capture_decodes_multibyte_split_anywhere(cut: int) -> None:
    text = "h€llo wörld 𝄞 – ok"
    raw = text.encode("utf-8")
    pieces: List[str] = []
    capture = cx._Output("utf-8", "replace", 100, lambda stream, text: pieces.append(text))
    for i in range(0, len(raw), cut):
        capture.feed("stdout", raw[i : i + cut])
    capture.finish(hand_out=True)
    assert "".join(pieces) == text
    assert all(pieces)  # a cut character waits for its rest, not handed out as ""
    assert capture.tails["stdout"].text() == text == capture.combined.text()


@pytest.mark.parametrize("hand_out", [True, False])
def test_capture_hands_out_a_character_cut_off_at_the_end_unless_told_not_to(
    hand_out: bool,
) -> None:
    pieces: List[Tuple[str, str]] = []
    capture = cx._Output("utf-8", "replace", 100, lambda *args: pieces.append(args))
    capture.feed("stderr", "ok€".encode("utf-8")[:-1])
    assert pieces == [("stderr", "ok")]
    capture.finish(hand_out=hand_out)
    assert pieces == [("stderr", "ok")] + [("stderr", "\ufffd")] * hand_out
    assert capture.tails["stderr"].text() == "ok\ufffd" == capture.combined.text()


def test_capture_other_encoding_and_strict_errors() -> None:
    pieces: List[str] = []
    capture = cx._Output("latin-1", "strict", 10, lambda stream, text: pieces.append(text))
    capture.feed("stderr", b"caf\xe9")
    assert pieces == ["café"]
    strict = cx._Output("utf-8", "strict", 10, None)
    with pytest.raises(UnicodeDecodeError):
        strict.feed("stdout", b"\xff")


def test_blocks_split_only_on_newline_and_come_as_soon_as_complete() -> None:
    sep = "\u2028".encode("utf-8")
    chunks = [b'{"a":"x' + sep[:1], sep[1:] + b'y"}\n{"b":', b"1}\r\n", b"\n", b"last\nnext\n"]
    cut = list(blocks(chunks))
    assert cut == [b'{"a":"x' + sep + b'y"}\n', b'{"b":1}\r\n', b"\n", b"last\nnext\n"]
    assert json.loads(cut[0]) == {"a": "x\u2028y"}


def test_blocks_unterminated_last_line_is_retryable() -> None:
    with pytest.raises(cx._Retryable):
        list(blocks([b"done\n", b'{"type":"exit"']))
    assert list(blocks([])) == []
    assert list(blocks([b"a\n", b""])) == [b"a\n"]


def test_blocks_length_limit() -> None:
    assert list(blocks([b"x" * 10 + b"\n"], limit=10)) == [b"x" * 10 + b"\n"]
    with pytest.raises(cx.ProtocolError):
        list(blocks([b"x" * 11 + b"\n"], limit=10))
    with pytest.raises(cx.ProtocolError):
        list(blocks([b"x" * 6, b"x" * 5 + b"\n"], limit=10))
    with pytest.raises(cx.ProtocolError):
        list(blocks([b"x" * 6, b"x" * 6], limit=10))  # fails before EOF


def test_blocks_hand_out_the_lines_before_one_that_is_too_long() -> None:
    seen = []
    with pytest.raises(cx.ProtocolError):
        for block in blocks([b"ok\nfine\n" + b"x" * 11 + b"\nnever\n"], limit=10):
            seen.append(block)
    assert seen == [b"ok\nfine\n"]


def test_blocks_fail_before_buffering_an_endless_line() -> None:
    consumed = 0

    def endless() -> Any:
        nonlocal consumed
        for chunk in itertools.repeat(b"y" * 1024):
            consumed += 1
            yield chunk

    with pytest.raises(cx.ProtocolError):
        list(blocks(endless()))
    assert consumed <= 1025  # bounded by 1 MiB, not by the stream


def test_frames_of_a_block_in_order() -> None:
    block = (
        b'{"type":"heartbeat"}\n'
        b' {"type":"data","seq":1} \r\n'  # whitespace around a value: parsed alone
        b'{"type":"exit","exit_code":0}\n'
    )
    assert list(frames(block)) == [
        {"type": "heartbeat"},
        {"type": "data", "seq": 1},
        {"type": "exit", "exit_code": 0},
    ]


@pytest.mark.parametrize(
    "bad",
    [
        b'{"type":"a"},{"type":"b"}\n',  # two values on one line
        b'{"type":"a","x":"\n"}\n',  # one value over two lines
        b"\n",
        b'{"type":"a"}x\n',
        b'{"type":"a","x":"\xff"}\n',  # not UTF-8
        b'{"type":"a","x":"\xed\xa0\x80"}\n',  # a surrogate, UTF-8-encoded
        b"nul\n",
    ],
)
def test_frames_hand_out_the_good_lines_then_fail_on_the_bad_one(bad: bytes) -> None:
    seen = []
    with pytest.raises(cx.ProtocolError):
        for frame in frames(b'{"type":"heartbeat"}\n' + bad + b'{"type":"never"}\n'):
            seen.append(frame)
    assert seen == [{"type": "heartbeat"}]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("aGVsbG8K", b"hello\n"),
        ("", b""),
        ("QQ==", b"A"),
        ("QUI=", b"AB"),
        ("QUJD", b"ABC"),
        ("////", b"\xff\xff\xff"),
        ("+/+/", b"\xfb\xff\xbf"),
    ],
)
def test_base64_accepts_canonical(text: str, expected: bytes) -> None:
    assert cx._base64(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "QR==",
        "QUJ=",
        "QQ",
        "QQ=",
        "Q===",
        "====",
        "QQ==QQ==",
        "aGV sbG8K",
        "aGVsbG8K\n",
        "-_-_",
        "aGVsbG8",
        "AAAA====",
        "QQ==\x00",
    ],
)
def test_base64_rejects(text: Any) -> None:
    with pytest.raises(cx.ProtocolError):
        cx._base64(text)


def test_base64_round_trips_every_length() -> None:
    rng = random.Random(1)
    for n in range(0, 40):
        raw = bytes(rng.randrange(256) for _ in range(n))
        assert cx._base64(base64.b64encode(raw).decode()) == raw


def strict_accepts(text: str) -> bool:
    try:
        cx._base64(text)
    except cx.ProtocolError:
        return False
    return True


ONE_LINE = '{"type":"data","seq":1,"stream":"stdout","data_base64":"%s"}\n'


@pytest.mark.parametrize("last", string.ascii_letters + string.digits + "+/")
def test_one_data_line_takes_only_canonical_last_characters(last: str) -> None:
    """Every character before one and two "=": taken exactly when strict decoding accepts."""
    for padded in ("QUJDQ%s==" % last, "QU%s=" % last):
        took = agrees_with_json((ONE_LINE % padded).encode(), 0)
        assert took == strict_accepts(padded)


@pytest.mark.parametrize(
    "data",
    ["", "aGk=", "QQ==QQ==", "aGk=    ", "aGk=\t\t\t\t", "a\\/k=", "aGk\\u003d", "=aGk",
     "aG==", "A===", "aGk==", "aGk=aGk=", "aGké", "aGk=\\", "QUJD\nQUJD"],
)  # fmt: skip
def test_one_data_line_is_read_exactly_as_json(data: str) -> None:
    """Whitespace, escapes, misplaced padding: on any Python, the reader takes
    one data line exactly as the JSON route does (json.loads, then _base64)."""
    block = (ONE_LINE % data).encode("utf-8")
    try:
        value = json.loads(block)
    except ValueError:
        expected = False
    else:
        expected = strict_accepts(value["data_base64"])
    assert agrees_with_json(block, 0) == expected


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"exit_code": 0}, (0, None)),
        ({"exit_code": 255}, (255, None)),
        ({"signal": "SIGKILL"}, (None, "SIGKILL")),
        ({"signal": "SIGRTMIN1"}, (None, "SIGRTMIN1")),
        ({"signal": "killed"}, (None, "SIGKILL")),
        ({"signal": "Terminated"}, (None, "SIGTERM")),
        ({"signal": "segmentation fault"}, (None, "SIGSEGV")),
        ({"signal": "interrupt"}, (None, "SIGINT")),
        ({"signal": "SIGKILL", "exit_code": 137}, (None, "SIGKILL")),
        ({"signal": None, "exit_code": 1}, (1, None)),
        ({}, None),
        ({"exit_code": None, "signal": None}, None),
    ],
)
def test_exit_status_accepts(fields: Dict[str, Any], expected: Any) -> None:
    assert cx._exit_status(fields) == (None if expected is None else cx._Exit(*expected))


@pytest.mark.parametrize(
    "fields",
    [
        {"exit_code": 256},
        {"exit_code": -1},
        {"exit_code": True},
        {"exit_code": False},
        {"exit_code": 1.0},
        {"exit_code": "0"},
        {"signal": 9},
        {"signal": "bogus"},
        {"signal": ""},
        {"signal": "sigkill"},
        {"signal": "SIG"},
        {"signal": ["SIGKILL"]},
    ],
)
def test_exit_status_rejects(fields: Dict[str, Any]) -> None:
    with pytest.raises(cx.ProtocolError):
        cx._exit_status(fields)


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


def test_the_stream_is_asked_for_without_compression(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(EXIT0))
    make_client().execute(SB, ["true"])
    assert calls(rsps, "GET", CONNECT)[0].request.headers["Accept-Encoding"] == "identity"
    created = calls(rsps, "POST", PROCS)[0].request.headers["Accept-Encoding"]
    assert created != "identity"  # answers that are read whole may come compressed


def test_garbage_retry_after_header_on_connect_is_ignored(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    rsps.add(responses.GET, CONNECT, status=503, headers={"Retry-After": "whenever"}, body="")
    add_connect(rsps, nd(EXIT0))
    assert make_client().execute(SB, ["true"]).reconnects == 1


def test_deeply_nested_frame_is_protocol_error() -> None:
    with pytest.raises(cx.ProtocolError):
        cx._line_value("[" * 100_000 + "]" * 100_000)
    with pytest.raises(cx.ProtocolError):
        list(frames(b"[" * 100_000 + b"]" * 100_000 + b"\n"))


def test_line_value_parsing() -> None:
    assert cx._line_value('{"type":"heartbeat"}') == {"type": "heartbeat"}
    assert cx._line_value(' {"type":"heartbeat"}\r') == {"type": "heartbeat"}
    for bad in ("", " ", "\udcff", '{"type":"x"', "{} {}", "nul"):
        with pytest.raises(cx.ProtocolError):
            cx._line_value(bad)


@pytest.mark.parametrize(
    "value", [None, 1, "x", [], ["data"], {}, {"type": None}, {"type": 1}, float("nan")]
)
def test_a_frame_is_an_object_with_a_string_type(value: Any) -> None:
    reader, _ = reader_with_deliveries()
    block = json.dumps(value).encode() + b"\n"
    with pytest.raises(cx.ProtocolError, match="not an object with a type"):
        reader.take(block)


def plain_line(seq: int, text: str, stream: str = "stdout", data: Optional[str] = None) -> bytes:
    data = base64.b64encode(text.encode()).decode() if data is None else data
    line = '{"type":"data","seq":%d,"stream":"%s","data_base64":"%s"}\n'
    return (line % (seq, stream, data)).encode()


def test_a_block_of_data_is_delivered_once_per_run_of_one_stream() -> None:
    reader, delivered = reader_with_deliveries()
    block = b"".join(
        [plain_line(1, "a"), plain_line(2, "b"), plain_line(3, "E", "stderr"), plain_line(4, "c")]
    )
    reader.take(block + plain_line(5, "d"))
    assert delivered == [("stdout", "ab"), ("stderr", "E"), ("stdout", "cd")]
    assert reader.cursor == 5
    reader.take(plain_line(6, "e") + plain_line(7, "f"))
    assert delivered[-1] == ("stdout", "ef") and reader.cursor == 7


def test_a_replayed_block_adds_only_what_is_new() -> None:
    reader, delivered = reader_with_deliveries()
    reader.take(plain_line(1, "a") + plain_line(2, "b"))
    reader.take(plain_line(1, "a") + plain_line(2, "b") + plain_line(3, "c"))
    assert delivered == [("stdout", "ab"), ("stdout", "c")] and reader.cursor == 3
    with pytest.raises(cx.ProtocolError, match="jumped from 4 to 6"):
        reader.take(plain_line(4, "d") + plain_line(6, "f") + plain_line(7, "g"))
    assert delivered[-1] == ("stdout", "d") and reader.cursor == 4


# "QR==" and "AAAA====" are not in the data-line pattern; the others are,
# but are not whole quanta of base64.
@pytest.mark.parametrize("bad", ["QR==", "AAAA====", "QQ", "QUJDA==", "QUJDQ=", "QUJDQUI"])
def test_a_bad_frame_in_a_block_fails_after_the_good_ones_are_delivered(bad: str) -> None:
    reader, delivered = reader_with_deliveries()
    block = plain_line(1, "a") + plain_line(2, "b") + plain_line(3, "", data=bad)
    with pytest.raises(cx.ProtocolError):
        reader.take(block + plain_line(4, "d"))
    assert delivered == [("stdout", "ab")] and reader.cursor == 2


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


def test_rate_limiter_waits_only_above_limit() -> None:
    limiter = cx._RateLimiter(3, 0.5)
    start = time.monotonic()
    for _ in range(3):
        limiter.release(limiter.acquire())
    assert time.monotonic() - start < 0.2  # no delay below the limit
    limiter.release(limiter.acquire())
    waited = time.monotonic() - start
    assert 0.4 <= waited < 1.5  # the 4th waited until the window freed


def test_rate_limiter_threads_share_the_window() -> None:
    limiter = cx._RateLimiter(2, 0.3)
    stamps: List[float] = []
    lock = threading.Lock()
    start = time.monotonic()

    def worker() -> None:
        limiter.release(limiter.acquire())
        with lock:
            stamps.append(time.monotonic() - start)

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    stamps.sort()
    assert len(stamps) == 5
    assert stamps[1] < 0.2 and stamps[2] >= 0.25 and stamps[4] >= 0.55
    assert stamps[4] < 2.0


def test_rate_limiter_shared_per_origin() -> None:
    a = cx.Client(BASE + "/v1", KEY, rate_limit=(7, 1.0))
    b = cx.Client(BASE + "/other", "k2", rate_limit=(7, 1.0))
    c = cx.Client("https://elsewhere.example.test", KEY, rate_limit=(7, 1.0))
    assert a._transport._limiter is b._transport._limiter
    assert a._transport._limiter is not c._transport._limiter
    assert cx.Client(BASE, KEY, rate_limit=None)._transport._limiter is None


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


# --------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CREATEOS_API_KEY", KEY)


def _cli(*args: str) -> int:
    return cx.main(["--api-url", BASE, *args])


def test_cli_exit_code_and_separate_streams(
    rsps: responses.RequestsMock, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    add_created(rsps)
    add_connect(
        rsps,
        nd(
            data(1, "stdout", b"out-1\n"),
            data(2, "stderr", b"err-1\n"),
            data(3, "stdout", b"out-2\n"),
            {"type": "exit", "exit_code": 3},
        ),
    )
    assert _cli(SB, "--", "make", "test") == 3
    captured = capsys.readouterr()
    assert captured.out == "out-1\nout-2\n"
    assert captured.err == "err-1\n"
    body = body_of(calls(rsps, "POST", PROCS)[0])
    assert body["args"][3:] == ["make", "test"]


def test_cli_zero_exit(rsps: responses.RequestsMock, cli_env: None) -> None:
    add_created(rsps)
    add_connect(rsps, nd(EXIT0))
    assert _cli(SB, "--", "true") == 0


@pytest.mark.parametrize("signal, code", [("SIGKILL", 137), ("terminated", 143), ("SIGINT", 130)])
def test_cli_signal_exit_code(
    rsps: responses.RequestsMock, cli_env: None, signal: str, code: int
) -> None:
    add_created(rsps)
    add_connect(rsps, nd({"type": "exit", "signal": signal}))
    assert _cli(SB, "--", "sleep", "9") == code


def test_cli_timeout_is_124(
    rsps: responses.RequestsMock, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    add_created(rsps)
    rsps.add_callback(
        responses.GET,
        CONNECT,
        callback=_stalling_connect(0.3, nd()),
        content_type="application/x-ndjson",
    )
    add_connect(rsps, nd(data(1, "stdout", b"bye\n"), {"type": "exit", "signal": "SIGTERM"}))
    add_deleted(rsps)
    assert _cli("--timeout", "0.15", SB, "--", "sleep", "100") == 124
    assert capsys.readouterr().out == "bye\n"
    assert_deleted_once(rsps)


def test_cli_api_error_is_125_with_one_line(
    rsps: responses.RequestsMock, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    rsps.add(responses.POST, PROCS, status=403, json={"status": "fail", "data": "SECRET-BODY"})
    assert _cli(SB, "--", "true") == 125
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "python -m createos_exec: CreateOS answered HTTP 403 to process creation: the API key was "
        "refused for this (another account's sandbox, or a spent quota).\n"
    )
    assert KEY not in captured.err and "SECRET-BODY" not in captured.err


def test_cli_config_errors_are_125(
    rsps: responses.RequestsMock, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(SB, "--", "true") == 125  # no key
    assert capsys.readouterr().err.startswith("python -m createos_exec: no API key: set ")
    assert cx.main(["--api-url", "http://api.example.test", SB, "--", "true"]) == 125
    assert len(rsps.calls) == 0


def test_cli_invalid_sandbox_and_env_name_are_125(
    rsps: responses.RequestsMock, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli("sb/../x", "--", "true") == 125
    assert _cli("--env", "1A=x", SB, "--", "true") == 125
    assert len(rsps.calls) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("python -m createos_exec: ") for line in lines)


def test_cli_unreadable_stdin_file_is_125(
    rsps: responses.RequestsMock, cli_env: None, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    assert _cli("--stdin", str(tmp_path / "missing"), SB, "--", "cat") == 125
    missing = tmp_path / "missing"
    assert capsys.readouterr().err == (
        f"python -m createos_exec: cannot read the --stdin file {missing}: "
        "No such file or directory.\n"
    )
    assert len(rsps.calls) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--env", "NOVALUE", SB, "--", "true"],
        ["--env", "", SB, "--", "true"],
        [SB],  # no command
        [SB, "--"],
        ["--shell", SB, "--", "echo", "two"],
        ["--timeout", "soon", SB, "--", "true"],
        [],
    ],
)
def test_cli_usage_errors_exit_2(
    rsps: responses.RequestsMock,
    cli_env: None,
    args: List[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        _cli(*args)
    assert info.value.code == 2
    assert len(rsps.calls) == 0


def test_cli_env_shell_cwd_and_stdin_file(
    rsps: responses.RequestsMock, cli_env: None, tmp_path: Any
) -> None:
    stdin_file = tmp_path / "in.bin"
    stdin_file.write_bytes(b"payload\n")
    rsps.add(responses.PUT, FILES, json=ok({}))
    add_created(rsps)
    add_connect(rsps, nd(EXIT0))
    code = _cli(
        "--env",
        "A=b=c",
        "--env",
        "EMPTY=",
        "--cwd",
        "/work",
        "--stdin",
        str(stdin_file),
        "--shell",
        SB,
        "--",
        "cat | wc -c",
    )
    assert code == 0
    assert calls(rsps, "PUT", FILES)[0].request.body == b"A=b=c\0EMPTY=\0\0payload\n"
    args = body_of(calls(rsps, "POST", PROCS)[0])["args"]
    assert "cd -- '/work' 2>/dev/null || " in args[1]
    assert args[1].endswith('exec bash -c -- "$1"\n') and args[3:] == ["cat | wc -c"]


def test_cli_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cx.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "124" in out and "125" in out and "128+N" in out


@pytest.mark.parametrize(
    "words, name, number",
    [
        ("profiling timer expired", "SIGPROF", 27),
        ("Bad system call", "SIGSYS", 31),
        ("signal 34", "SIG34", 34),
    ],
)
def test_go_signal_words_past_sigterm_and_numbered_signals(words, name, number) -> None:
    status = cx._exit_status({"signal": words, "exit_code": -1})
    assert status == cx._Exit(None, name)
    assert cx.ExecResult(None, None, name, False, "", "").returncode == -number


def test_rate_limiter_holds_a_place_until_the_answer_starts() -> None:
    # A request still on its way may arrive late: its place in the window runs
    # from its answer, so the server never counts more than the limit.
    limiter = cx._RateLimiter(1, 0.2)
    place = limiter.acquire()
    admitted: List[float] = []

    def second() -> None:
        limiter.acquire()
        admitted.append(time.monotonic())

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.4)  # two periods: a place stamped at acquire() would have expired
    assert admitted == []
    limiter.release(place)
    released = time.monotonic()
    thread.join(2)
    assert admitted and admitted[0] - released >= 0.15
