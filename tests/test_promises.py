"""Promises of design.md held from the caller's side, where a broken stream, a
proxy or a failed cleanup used to bend them.

Each test talks to a real LocalServer over real sockets. Where the server's
own fault injection cannot play a misbehaviour (a proxy that rewrites the
NDJSON stream of `connect`), a small HTTP/1.1 reverse proxy on loopback sits
between the client and the server and plays it.

- "Behaviour that must hold" 4: an exit status learned from `wait` is the
  result once the replayed output reaches the journal's newest seq, exit
  frame or not; output that cannot be replayed is `OutputIncompleteError`.
- 3: heartbeats only prove a stream alive, so a stream that never delivers
  still spends the retry budget, while a quiet live job keeps being followed.
- 5 and 6: a timeout whose termination is unconfirmed still hands over the
  output it read, and nothing private leaks into the chain the caller sees.
- 5: whatever interrupts the grace period of a timeout, the error reaches the
  caller only once the DELETE has answered.
"""

from __future__ import annotations

import dataclasses
import http.client
import os
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, List, Optional, Tuple

import pytest
from support import SANDBOX, THREE_TRIES, Recorder, chain, make_client

import createos_exec as cx

# Three lines in three frames (the pauses keep the writes apart), then status 3.
THREE_LINES = "echo one; sleep 0.05; echo two; sleep 0.05; echo six; exit 3"
THREE_LINES_OUTPUT = "one\ntwo\nsix\n"

NO_STATUS = "CreateOS process stream ended without an exit status."

HEARTBEAT = b'{"type":"heartbeat"}\n'


def connects(server: Any) -> int:
    return len(server.requests_to("connect"))


def only_process(server: Any) -> str:
    (record,) = server.processes()
    return str(record["process_id"])


def exit_status_known_later(server: Any) -> None:
    """The stream fails while `wait` already knows the status and output is unread.

    The first connect waits out a Retry-After of 1 s, so the command (0.1 s)
    has exited long before the budget is spent; the second brings the first
    line and breaks; two more break at once: three failures without progress.
    """
    server.fail("connect", 503, retry_after="1")
    server.drop_stream(after_frames=1)
    server.drop_stream(after_frames=0, count=2)


# -- 4. recover the exit status out of band ----------------------------------------


def test_exit_status_from_wait_is_the_result_once_the_replay_brings_the_output(server):
    # Promise 4: once the replayed output reaches the `wait` record's newest seq,
    # that record's status is the result, exit frame or not.
    exit_status_known_later(server)
    server.end_stream(after_frames=2)  # the replay brings two and six, then no exit frame
    server.end_stream(after_frames=0, count=50)  # and no later connect brings one either
    seen = Recorder()
    with make_client(server, retry=THREE_TRIES) as client:
        result = client.execute(SANDBOX, THREE_LINES, shell=True, on_output=seen)
    assert result.exit_code == 3 and result.signal is None
    assert result.exit_recovered is True
    assert result.stdout == THREE_LINES_OUTPUT and result.stderr == ""
    assert seen.text() == THREE_LINES_OUTPUT  # each line delivered exactly once
    assert len(server.requests_to("wait")) >= 1
    assert len(server.requests_to("create")) == 1


def test_output_that_cannot_be_replayed_is_output_incomplete_with_the_known_status(server):
    # Promise 4: output that cannot be replayed raises OutputIncompleteError (a
    # StreamEndedError) carrying the status learned from `wait` and the output
    # received; it does not claim that the status is missing.
    exit_status_known_later(server)
    server.fail("connect", 503, count=100)  # no connection brings the missing output
    with make_client(server, retry=THREE_TRIES) as client:
        with pytest.raises(cx.StreamEndedError) as caught:
            client.execute(SANDBOX, THREE_LINES, shell=True)
    error = caught.value
    assert type(error).__name__ == "OutputIncompleteError", (
        f"{type(error).__name__}: {error}; the exit status was known from wait"
    )
    assert isinstance(error, cx.OutputIncompleteError)
    assert isinstance(error, cx.StreamEndedError) and isinstance(error, cx.TransportError)
    assert "without an exit status" not in str(error)
    assert error.process_id == only_process(server)
    assert error.result is not None
    assert error.result.exit_code == 3 and error.result.exit_recovered is True
    assert error.result.stdout == "one\n"  # what arrived before the stream gave out
    assert THREE_LINES_OUTPUT.startswith(error.result.stdout)


def test_stream_ended_error_keeps_its_message_when_wait_cannot_tell_the_status(server):
    # Promise 4 (guard): StreamEndedError, with its fixed message, only when no
    # status could be learned at all.
    server.drop_stream(after_frames=1)
    server.fail("connect", 503, count=100)
    server.fail("wait", 503, count=100)
    with make_client(server, retry=THREE_TRIES) as client:
        with pytest.raises(cx.StreamEndedError) as caught:
            client.execute(SANDBOX, THREE_LINES, shell=True)
    error = caught.value
    assert type(error) is cx.StreamEndedError
    assert str(error) == NO_STATUS
    assert error.result is not None and error.result.stdout == "one\n"
    assert error.result.exit_code is None
    assert server.wait_tree_gone(error.process_id)


# -- 3. heartbeats prove a stream alive, they are not progress ------------------------


class MisbehavingProxy:
    """An HTTP/1.1 reverse proxy on loopback in front of a LocalServer.

    Every request is forwarded on a fresh upstream connection. A 200 answer
    to `connect` is relayed line by line through `rewrite(line)`, which
    returns the lines to send instead and whether to end the body after them
    (cleanly: the terminating chunk, then the connection closes). Everything
    else is relayed as it came.
    """

    UPSTREAM_TIMEOUT = 60.0  # longer than a `wait` long-poll (30 s)
    HOP_BY_HOP = {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "te",
        "trailer",
        "upgrade",
        "host",
        "proxy-connection",
    }

    def __init__(self, upstream: str, rewrite: Callable[[bytes], Tuple[List[bytes], bool]]):
        parts = urllib.parse.urlsplit(upstream)
        self._upstream = (parts.hostname, parts.port)
        self._rewrite = rewrite
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                proxy._forward(self)

            do_POST = do_PUT = do_DELETE = do_GET

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> MisbehavingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def _forward(self, req: BaseHTTPRequestHandler) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        body = req.rfile.read(length) if length else None
        headers = {k: v for k, v in req.headers.items() if k.lower() not in self.HOP_BY_HOP}
        host, port = self._upstream
        upstream = http.client.HTTPConnection(host, port, timeout=self.UPSTREAM_TIMEOUT)
        try:
            upstream.request(req.command, req.path, body=body, headers=headers)
            answer = upstream.getresponse()
            path = urllib.parse.urlsplit(req.path).path
            if req.command == "GET" and path.endswith("/connect") and answer.status == 200:
                self._relay_stream(req, answer)
            else:
                self._relay_whole(req, answer)
        except OSError:  # either side went away: drop this connection
            req.close_connection = True
        finally:
            upstream.close()

    def _relay_headers(self, req: BaseHTTPRequestHandler, answer: Any) -> None:
        req.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in self.HOP_BY_HOP:
                req.send_header(name, value)

    def _relay_whole(self, req: BaseHTTPRequestHandler, answer: Any) -> None:
        data = answer.read()
        self._relay_headers(req, answer)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def _relay_stream(self, req: BaseHTTPRequestHandler, answer: Any) -> None:
        self._relay_headers(req, answer)
        req.send_header("Transfer-Encoding", "chunked")
        req.send_header("Connection", "close")
        req.close_connection = True
        req.end_headers()
        while True:
            line = answer.readline(2 * 1024 * 1024)
            if not line:
                break  # the upstream body ended
            lines, end = self._rewrite(line)
            for out in lines:
                req.wfile.write(b"%X\r\n%s\r\n" % (len(out), out))
            req.wfile.flush()
            if end:
                break
        req.wfile.write(b"0\r\n\r\n")
        req.wfile.flush()


def heartbeat_instead_of_exit(line: bytes) -> Tuple[List[bytes], bool]:
    """Relay data; in place of the exit frame send a heartbeat and end the body."""
    if line.startswith(b'{"type":"exit"'):
        return [HEARTBEAT], True
    return [line], False


def end_after_a_heartbeat(line: bytes) -> Tuple[List[bytes], bool]:
    """Relay everything, but end the body right after the first heartbeat."""
    return [line], line.startswith(b'{"type":"heartbeat"')


def run_bounded(call: Callable[[threading.Event], Any], seconds: float) -> Tuple[bool, Any]:
    """Run call(cancel) in a thread; (finished in time, its result or exception).

    A call still running after `seconds` is stopped through its cancel event
    and joined, so that nothing keeps running after the test.
    """
    cancel = threading.Event()
    outcome: List[Any] = []

    def target() -> None:
        try:
            outcome.append(call(cancel))
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    finished = not thread.is_alive()
    if not finished:
        cancel.set()
        thread.join(30)
        assert not thread.is_alive(), "execute() ignored its cancel event"
    return finished, outcome[0] if outcome else None


@pytest.mark.timeout(90)
def test_a_stream_that_only_sends_heartbeats_still_ends_with_the_status_recovered(server):
    # Promise 3: progress is a new frame, heartbeats only prove the stream alive,
    # so connections that bring nothing but a heartbeat spend the budget and the
    # exit status is recovered out of band (promise 4), even without a timeout.
    seen = Recorder()
    with MisbehavingProxy(server.url, heartbeat_instead_of_exit) as proxy:
        with make_client(server, api_url=proxy.url, retry=THREE_TRIES) as client:
            finished, outcome = run_bounded(
                lambda cancel: client.execute(
                    SANDBOX, "echo done; exit 4", shell=True, on_output=seen, cancel=cancel
                ),
                10.0,
            )
    assert finished, (
        f"execute() was still reconnecting after 10 s ({connects(server)} connects), "
        f"counting heartbeats as progress"
    )
    assert isinstance(outcome, cx.ExecResult), repr(outcome)
    assert outcome.exit_code == 4 and outcome.exit_recovered is True
    assert outcome.stdout == "done\n" and seen.text() == "done\n"


QUIET_SECONDS = float(os.environ.get("CREATEOS_QUIET_JOB_SECONDS", "12"))


@pytest.mark.timeout(QUIET_SECONDS + 90)
def test_a_quiet_job_behind_a_proxy_that_closes_after_each_heartbeat_completes_live(server):
    # Promise 3: when the budget is spent, a short `wait` poll tells a quiet live
    # job from an exited one and the live one keeps being followed with a fresh
    # budget: silent for several whole budgets, it still completes exactly, with
    # its output live. ($CREATEOS_QUIET_JOB_SECONDS sets how long it is quiet.)
    script = f"echo first; sleep {QUIET_SECONDS}; echo second"
    seen = Recorder()
    with MisbehavingProxy(server.url, end_after_a_heartbeat) as proxy:
        # A budget of 2 s, so that the quiet job is silent for several whole budgets.
        quiet = dataclasses.replace(THREE_TRIES, budget=2.0)
        with make_client(server, api_url=proxy.url, retry=quiet) as client:
            started = time.monotonic()
            result = client.execute(SANDBOX, script, shell=True, on_output=seen)
            returned = time.monotonic()
    assert result.exit_code == 0 and result.signal is None and not result.timed_out
    assert result.stdout == "first\nsecond\n" and result.stderr == ""
    assert seen.deliveries == [("stdout", "first\n"), ("stdout", "second\n")]
    first, second = seen.times
    assert first - started < QUIET_SECONDS / 2, "the first line was not delivered live"
    assert second - first >= QUIET_SECONDS * 0.8
    assert returned - second < QUIET_SECONDS / 2
    assert result.reconnects >= 3  # the proxy did cut the quiet stream, more than a budget


# -- 5 and 6. a timeout whose termination is unconfirmed --------------------------------


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


# -- 5. interrupted during the grace period of a timeout ---------------------------------

# The leader prints during its grace period and takes 0.5 s more to exit, so
# the DELETE (grace 1 s with cleanup_timeout=5) is answered about 0.5 s after
# "bye" reached the client.
GRACEFUL = "trap 'echo bye; sleep 0.5; exit 0' TERM\necho started\nsleep 30 &\nwait\n"


def settle(server: Any) -> None:
    """Let a DELETE still in flight finish, so that nothing outlives the test."""
    deadline = time.monotonic() + 15
    while not server.requests_to("delete") and time.monotonic() < deadline:
        time.sleep(0.05)
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
