"""Errors and results: docs/failures.md's rows "bad URL, missing key,
invalid sandbox id, env name, NUL byte, bad option" (ConfigError before
anything is sent; docs/design.md rule 9), "any 3xx" (never followed), "check=True
and exit code != 0, signal or timeout" (CommandError), and the sentences after
the table: every error a CreateOSError with .process_id and .result, fixed
messages that show no key, body or output, results and errors that pickle
(rule 10; what the logs show, rule 14, is test_execute's). RemoteProcess.poll() and
send_signal() send one request and raise its failures.

Canned HTTP answers (responses) and the classes themselves.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import subprocess
from typing import Any, Dict, List, Optional

import pytest
import requests
import responses
import urllib3
from support import (
    BASE,
    CONNECT,
    KEY,
    NO_RETRY,
    PID,
    PROC,
    PROCS,
    SANDBOX,
    SB,
    TWO_TRIES,
    WAIT,
    Listener,
    add_connect,
    add_created,
    add_deleted,
    assert_clean,
    assert_deleted_once,
    body_of,
    calls,
    closed_port,
    data,
    exited,
    make_client,
    nd,
    ok,
    process_record,
)

import createos_exec as cx

EVIL = "https://evil.example.test/"

# --------------------------------------------------------------------------
# Client settings: ConfigError before anything is sent
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
        client._transport.send("GET", "/probe", operation="probe", deadline=cx._ENDLESS).close()
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
    assert KEY not in repr(client._transport._auth)
    assert BASE in repr(client)


@pytest.mark.parametrize("name", ["request_timeout", "stream_idle_timeout", "cleanup_timeout"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), "5", True, None])
def test_client_refuses_bad_timeouts(name: str, value: Any) -> None:
    with pytest.raises(cx.ConfigError):
        cx.Client(BASE, KEY, rate_limit=None, **{name: value})


@pytest.mark.parametrize(
    "settings",
    [
        *(
            {"rate_limit": value}
            for value in [(0, 60.0), (-1, 60.0), (10, 0), (10, -1.0), (1.5, 1.0), (True, 1.0)]
        ),
        *({"rate_limit": value} for value in [(1, True), "300/60", (1, 2, 3), 5]),
        {"rate_limit": None, "retry": {"max_attempts": 3}},
        {"rate_limit": None, "session": object()},
    ],
)
def test_client_refuses_bad_rate_limit_retry_and_session(settings: Dict[str, Any]) -> None:
    with pytest.raises(cx.ConfigError):
        cx.Client(BASE, KEY, **settings)


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
        *[{name: float("nan")} for name in ("budget", "initial_backoff", "max_backoff")],
        {"max_retry_after": float("nan")},
    ],
)
def test_retry_policy_refuses_bad_values(kw: Dict[str, Any]) -> None:
    with pytest.raises(cx.ConfigError):
        cx.RetryPolicy(**kw)


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
        client._transport.send("GET", "/probe", operation="probe", deadline=cx._ENDLESS)
    assert CountingSession.requests_sent == 1
    assert CountingSession.closed == 0


# --------------------------------------------------------------------------
# execute() / attach() arguments: ConfigError before any request
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
    "pty of one number": ((SB, ["sh"]), {"pty": 24}),
    "pty of no rows": ((SB, ["sh"]), {"pty": (0, 80)}),
    "pty too wide": ((SB, ["sh"]), {"pty": (24, 65536)}),
    "pty of three numbers": ((SB, ["sh"]), {"pty": (24, 80, 1)}),
    "pty of floats": ((SB, ["sh"]), {"pty": (24.0, 80)}),
    "pty of bools": ((SB, ["sh"]), {"pty": (True, True)}),
    "pty as a string": ((SB, ["sh"]), {"pty": "24x80"}),
    "pty with stdin data": ((SB, ["sh"]), {"pty": True, "stdin": "ls\n"}),
    "pty with input": ((SB, ["sh"]), {"pty": True, "input": b"ls\n"}),
    "text not a bool": ((SB, ["true"]), {"text": None}),
    "text=False with an encoding": ((SB, ["true"]), {"text": False, "encoding": "latin-1"}),
    "text=False with errors": ((SB, ["true"]), {"text": False, "errors": "surrogateescape"}),
    "text=False with str input": ((SB, ["cat"]), {"text": False, "input": "x"}),
    "text=False with str stdin": ((SB, ["cat"]), {"text": False, "stdin": "x"}),
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
        (PID, {"pty": True}),
        (PID, {"pty": (24, 80)}),
        (PID, {"text": False, "errors": "strict"}),
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
# Redirects are never followed
# --------------------------------------------------------------------------


REDIRECTS = [301, 302, 303, 307, 308]


@pytest.mark.parametrize("location", [EVIL, BASE + "/v1/moved"], ids=["cross", "same-origin"])
@pytest.mark.parametrize("status", REDIRECTS)
def test_redirect_on_create_not_followed(
    rsps: responses.RequestsMock, evil: List[str], status: int, location: str
) -> None:
    rsps.add(responses.POST, PROCS, status=status, headers={"Location": location})
    with pytest.raises(cx.APIError) as info:
        make_client().execute(SB, ["true"])
    assert info.value.status == status
    assert info.value.operation == "process creation"
    assert evil == []
    assert len(rsps.calls) == 1  # a request to the same origin would be a call too


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


def redirected_wait(rsps: responses.RequestsMock, stream: str, status: int, error: Any) -> Any:
    """A run whose `wait` is answered with a redirect: the `error` it raises, once the
    one `wait` was answered `status` and the tree was terminated."""
    add_created(rsps)
    add_connect(rsps, stream)
    rsps.add(responses.GET, WAIT, status=status, headers={"Location": EVIL})
    add_deleted(rsps)
    with pytest.raises(error) as info:
        make_client().execute(SB, ["true"])
    waits = calls(rsps, "GET", WAIT)
    assert len(waits) == 1 and waits[0].response.status_code == status
    assert_deleted_once(rsps)
    return info.value


@pytest.mark.parametrize("status", REDIRECTS)
def test_redirect_on_exit_check_wait_not_followed(
    rsps: responses.RequestsMock, evil: List[str], status: int
) -> None:
    # An exit frame without status is checked once against `wait`; a redirect
    # there is not followed and the run fails closed with a ProtocolError.
    error = redirected_wait(rsps, nd({"type": "exit"}), status, cx.ProtocolError)
    assert error.problem == "the exit frame carries no exit status"
    assert evil == []


@pytest.mark.parametrize("status", REDIRECTS)
def test_redirect_on_recovery_wait_not_followed(
    rsps: responses.RequestsMock, evil: List[str], status: int
) -> None:
    # The stream keeps ending without an exit frame; out-of-band recovery
    # meets a redirect: StreamEndedError, caused by the APIError.
    error = redirected_wait(rsps, nd(data(1, "stdout", b"a")), status, cx.StreamEndedError)
    cause = error.__cause__
    assert isinstance(cause, cx.APIError) and cause.status == status
    assert cause.operation == "exit status wait"
    assert evil == []


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
# check=True, and what the logs show
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# RemoteProcess: poll() and send_signal() send one request, never retried
# --------------------------------------------------------------------------


def _started(rsps: responses.RequestsMock) -> cx.RemoteProcess:
    add_created(rsps)
    return make_client().start(SB, ["sleep", "9"])


def test_poll_reads_the_record_once_and_raises_its_failures(rsps: responses.RequestsMock) -> None:
    process = _started(rsps)
    rsps.add(responses.GET, PROC, json=ok(process_record()))
    rsps.add(responses.GET, PROC, status=503, json={"status": "error", "message": "SECRET-BODY"})
    rsps.add(responses.GET, PROC, body=requests.exceptions.ConnectionError("reset"))
    rsps.add(responses.GET, PROC, json=ok(["not", "a", "record"]))
    rsps.add(responses.GET, PROC, json=ok(process_record(leader_exited=True, state="exited")))
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
        {"signal": name} for name in ("SIGTERM", "SIGINT", "SIGHUP")
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
        cx.CancelledError(created=False),
        cx.CommandError(_sample_result()),
        cx.CommandError(_sample_result(exit_code=None, timed_out=True)),
        cx.CommandError(_sample_result(exit_code=None, signal="SIGKILL")),
        cx.WaitTimeout(["sleep", "9"], 0.5, process_id=PID),
        cx.WaitTimeout(["sleep", "9"], 2, process_id=PID, port=8000),
        cx.StdinClosedError(process_id=PID),
        cx.InputUnconfirmedError(393120, process_id=PID),
        cx.InputUnconfirmedError(0, unsent=True, process_id=PID),
        cx.ProcessEndedError(8000, process_id=PID, result=_sample_result()),
        cx.ProcessEndedError(8000, result=_sample_result(exit_code=None, signal="SIGSEGV")),
        *(cx.TransferError("/app/out.tar", reason) for reason in cx._TRANSFER_FAILURES),
        cx.SandboxError(SB, "creating", status=409, operation="process creation"),
        cx.SandboxPausedError(SB, "paused", status=409, operation="stdin write"),
        cx.SandboxPausedError(
            SB, "paused", status=409, operation="output connection", process_id=PID, after=7
        ),
        cx.SandboxGoneError(SB, "not found", status=404, operation="process lookup"),
        cx.SandboxGoneError(SB, "destroyed", status=404, operation="process cleanup"),
    ]


def test_the_public_names_are_listed_once_classes_first_each_kind_in_order() -> None:
    assert cx.__all__ == sorted(set(cx.__all__), key=lambda name: (name[0].islower(), name))
    assert all(hasattr(cx, name) for name in cx.__all__)


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
    names = "process_id result status operation problem oldest_available_seq"
    names += " sandbox_id sandbox_status after"
    names += " creation_unconfirmed returncode cmd output stderr timeout confirmed_bytes unsent"
    names += " path reason"
    for attr in names.split():
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
    err = cx.CommandError(_sample_result(exit_code=3))  # a CalledProcessError: see check=True
    assert (err.cmd, err.output, err.stderr) == (["echo", "x"], "SECRET-OUTPUT", "err")
    assert cx.CommandError(_sample_result(exit_code=None, signal="SIGKILL")).returncode == -9
    assert cx.CommandError(_sample_result(exit_code=None, timed_out=True)).returncode is None


def test_wait_timeout_is_also_subprocess_timeout_expired() -> None:
    error = cx.WaitTimeout(["sleep", "9"], 0.5, process_id=PID)
    assert isinstance(error, cx.CreateOSError) and isinstance(error, subprocess.TimeoutExpired)
    assert (error.cmd, error.timeout) == (["sleep", "9"], 0.5)
    assert error.output is error.stdout is error.stderr is None
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
        (418, "process creation", None),  # no advice: the plain sentence
    ],
)
def test_api_error_says_what_a_status_means(status: int, operation: str, advice: str) -> None:
    message = str(cx.APIError(status, operation))
    plain = f"CreateOS answered HTTP {status} to {operation}"
    assert message == plain + "." if advice is None else message.startswith(f"{plain}: {advice}")
    assert message.endswith(".")
    assert str(cx.APIError(status, operation)) == message  # deterministic


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


# -- messages: each says what happened, to what, and what to do ------------------
# Their essential parts pinned, not the whole wording: the command's program, the
# seconds, the host and port, the option, the variable to set. Against the local
# server where the message comes from a real run.


# -- messages: CommandError names the program, the process, the seconds, where the output is ---


def test_a_failed_command_names_its_program_and_process_and_points_at_stderr(client):
    with pytest.raises(cx.CommandError) as raised:
        client.execute(SANDBOX, ["sh", "-c", "echo oops >&2; exit 3"], check=True)
    message = str(raised.value)
    assert "'sh'" in message and f"(process {raised.value.process_id})" in message
    assert "exited with status 3" in message and ".stderr" in message
    assert "oops" not in message  # output stays out of messages
    assert raised.value.stderr == "oops\n"


def test_a_timed_out_command_says_after_how_many_seconds(client):
    with pytest.raises(cx.CommandError) as raised:
        client.execute(SANDBOX, ["sleep", "30"], timeout=0.5, check=True)
    message = str(raised.value)
    assert "'sleep'" in message and "timed out after 0.5 s" in message
    assert "terminated" in message
    assert raised.value.timeout == 0.5
    again = pickle.loads(pickle.dumps(raised.value))
    assert (str(again), again.timeout) == (message, 0.5)


def test_a_killed_command_names_the_signal(client):
    with pytest.raises(cx.CommandError) as raised:
        client.execute(SANDBOX, "kill -KILL $$", shell=True, check=True)
    assert "'kill -KILL $$'" in str(raised.value) and "killed by SIGKILL" in str(raised.value)


def test_only_the_program_is_named_never_the_other_arguments():
    message = str(cx.CommandError(_sample_result(args=["make", "--token", "s3cret"])))
    assert "'make'" in message and "s3cret" not in message and "--token" not in message
    assert f"(process {PID})" in message
    long = str(cx.CommandError(_sample_result(args="echo start; " + "x" * 500)))
    assert "'echo start; " in long and "x" * 100 not in long  # a long script is cut
    followed = str(cx.CommandError(_sample_result(args=None, process_id=None)))
    assert followed.startswith("The command exited with status 1;")  # none: not named


def test_check_returncode_of_a_timed_out_result_still_says_it_timed_out():
    with pytest.raises(cx.CommandError) as raised:
        _sample_result(exit_code=None, timed_out=True).check_returncode()
    assert "timed out and its remote process tree was terminated" in str(raised.value)
    assert raised.value.timeout is None


# -- the wrapper: a string is one program name --------------------------------


def test_a_command_line_given_as_one_string_says_how_to_give_it(client):
    assert client.execute(SANDBOX, "true").exit_code == 0  # a string is one program name
    result = client.execute(SANDBOX, "echo hi")
    assert result.exit_code == 127 and result.stdout == ""
    assert "echo hi: command not found" in result.stderr
    assert "ONE program name" in result.stderr
    assert "list of arguments" in result.stderr and "shell=True" in result.stderr
    with_path = client.execute(SANDBOX, "ls /tmp")
    assert with_path.exit_code == 127
    assert "ls /tmp: No such file or directory" in with_path.stderr
    assert "ONE program name" in with_path.stderr


# -- local errors: nothing is sent ---------------------------------------------


@pytest.fixture
def nothing_sent(rsps):
    yield make_client()  # nothing is canned: any request would fail the test
    assert len(rsps.calls) == 0


@pytest.mark.parametrize(
    "call, sandbox, command, kwargs, words",
    [
        ("execute", SB, ["cat"], {"encoding": None}, "encoding=None .* text=False does"),
        ("execute", SB, ["cat"], {"text": False, "encoding": None}, "for text mode only"),
        ("execute", SB, ["cat"], {"text": False, "encoding": "utf-8"}, "for text mode only"),
        ("attach", SB, "proc_x", {"text": False, "errors": "replace"}, "for text mode only"),
        ("start", SB, ["cat"], {"text": False, "input": "secret"}, r"input=data\.encode\(\)"),
        ("execute", SB, ["cat"], {"encoding": "utf-9"}, "'utf-9'"),
        ("execute", SB, ["cat"], {"errors": "bogus"}, "'bogus'.* \"surrogateescape\".*text=False"),
        ("execute", SB, ["true"], {"env": {"1A": "x"}}, "'1A'"),
        ("execute", "sb/x", ["true"], {}, "'sb/x'"),
        ("execute", SB, ["true"], {"timeout": -1}, "timeout must be a positive number.* -1"),
        ("execute", SB, [], {}, "at least the program"),
    ],
)
def test_invalid_arguments_are_named(nothing_sent, call, sandbox, command, kwargs, words):
    with pytest.raises(cx.ConfigError, match=words):
        getattr(nothing_sent, call)(sandbox, command, **kwargs)


def test_an_api_key_with_a_newline_says_so():
    with pytest.raises(cx.ConfigError, match="newline") as raised:
        make_client(api_key=KEY + "\n")
    assert_clean(raised.value)


def test_an_unknown_signal_is_refused_before_any_request(client, server):
    with client.start(SANDBOX, ["sleep", "30"]) as process:
        for bad in ("SIGFOO", "FOO", "sigint", 10**6):
            with pytest.raises(cx.ConfigError) as raised:
                process.send_signal(bad)
            assert repr(bad) in str(raised.value) and "kill -l" in str(raised.value)
        assert server.requests_to("signal") == []
    assert cx._signal_name("USR1") == cx._signal_name("SIGUSR1") == "SIGUSR1"  # as kill takes it


# -- TransportError: host and port, the kind of failure, no process ------------


def test_a_refused_connection_names_host_port_and_says_no_process_started():
    port = closed_port()
    with make_client(api_url=f"http://127.0.0.1:{port}", retry=TWO_TRIES) as client:
        with pytest.raises(cx.TransportError) as raised:
            client.execute(SB, ["true"])
    error = raised.value
    assert (error.address, error.reason) == (f"127.0.0.1:{port}", "refused")
    assert error.operation == "process creation"
    message = str(error)
    assert f"127.0.0.1:{port}" in message and "refused" in message
    assert "No process was started" in message
    assert "/v1" not in message and SB not in message  # never requests' text with URLs
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.address, again.reason) == (message, error.address, "refused")


def below(exc, *causes):
    """`exc` with `causes` chained under it as urllib3 chains them (`raise ... from`)."""
    inner = exc
    for cause in causes:
        inner.__cause__ = cause
        inner = cause
    return exc


def not_connected(*causes):
    """What requests raises when no connection could be made, as urllib3 chains it."""
    reason = below(urllib3.exceptions.NewConnectionError(None, "x"), *causes)
    return requests.exceptions.ConnectionError(urllib3.exceptions.MaxRetryError(None, "/", reason))


@pytest.mark.parametrize(
    "failure, reason, words",
    [
        (not_connected(), None, "the connection failed"),
        (not_connected(socket.gaierror(-2, "Name or service not known")), "dns", "DNS"),
        (not_connected(ConnectionRefusedError(111, "x")), "refused", "refused"),
        (requests.exceptions.ConnectTimeout("x"), "timeout", "timed out"),
        (requests.exceptions.SSLError("x"), "tls", "TLS"),
    ],
)
def test_each_kind_of_unreachable_api_is_told(failure, reason, words):
    with responses.RequestsMock() as rsps:
        rsps.add(responses.POST, PROCS, body=failure)
        with pytest.raises(cx.TransportError) as raised:
            make_client(retry=NO_RETRY).execute(SB, ["true"])
    assert raised.value.reason == reason
    assert "api.example.test:443" in str(raised.value) and words in str(raised.value)
    assert "'x'" not in str(raised.value)


def test_the_other_errors_say_what_to_do():
    later = str(cx.TransportError("process status", address="h:1", reason="reset"))
    assert "h:1" in later and "reset" in later and "No process" not in later  # after creation
    assert "No process was started" in str(cx.TransportError("staging of env and stdin"))
    assert "proc_9" in str(cx.CleanupError(process_id="proc_9"))
    assert "destroy the sandbox" in str(cx.CleanupError(creation_unconfirmed=True))
    assert "print less" in str(cx.OutputEvictedError(3)) and "get(" in str(cx.OutputEvictedError(3))
    assert ".result" in str(cx.OutputIncompleteError())
    assert "proxy" in str(cx.ProtocolError("a frame is not JSON"))
    for status in (400, 401, 403, 404, 409, 429, 500):
        assert "rate_limit" not in str(cx.APIError(status, "process creation"))


# -- the transport: what requests reads from the environment still holds ---------


class RefusingProxy(Listener):
    """A forward proxy on loopback that answers 403 to every request it gets."""

    def __init__(self):
        self.requests = []
        super().__init__(self._refuse)

    def _refuse(self, connection):
        with connection:
            head = b""
            while b"\r\n\r\n" not in head:
                piece = connection.recv(65536)
                if not piece:
                    break
                head += piece
            self.requests.append(head.split(b"\r\n", 1)[0].decode("latin-1"))
            connection.sendall(
                b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )


def test_proxies_from_the_environment_are_still_used(server, monkeypatch):
    proxy = RefusingProxy()
    try:
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("http_proxy", proxy.url)
        with make_client(server) as client, pytest.raises(cx.APIError) as caught:
            client.execute(SANDBOX, ["true"])
        assert caught.value.status == 403 and caught.value.operation == "process creation"
        # The request went to the proxy, as an absolute URL of the API.
        assert proxy.requests and proxy.requests[0].startswith("POST " + server.url + "/v1/")
        assert server.requests == []
    finally:
        proxy.close()


def test_the_client_passes_the_strict_control_forwarder(local_server):
    """Under strict mode every POST needs a Content-Length and a JSON Content-Type
    (the vendor's control forwarder answers 411 or 400 otherwise)."""
    strict = local_server(strict=True)
    with make_client(strict) as client:
        done = client.execute(SANDBOX, "cat; echo $A", shell=True, env={"A": "1"}, stdin="x")
        late = client.execute(SANDBOX, ["sleep", "30"], timeout=0.3)
        strict.lose_create_response()
        found = client.execute(SANDBOX, ["echo", "found"])
    assert done.stdout == "x1\n" and late.timed_out and found.creation_recovered
    statuses = {(record.method, record.status) for record in strict.requests}
    assert all(status < 400 for _, status in statuses), statuses
    assert ("POST", 200) in statuses
