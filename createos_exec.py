"""Run one command in a CreateOS sandbox and get its exit status, whatever the network does.

    import createos_exec as cx

    result = cx.execute("sb_123", ["python3", "-c", "print(6 * 7)"], timeout=60)
    print(result.exit_code, result.stdout)

    with cx.Client() as client:          # $CREATEOS_API_URL, $CREATEOS_API_KEY
        client.execute("sb_123", "make test", shell=True, check=True, on_output=cx.echo)

A command runs as a CreateOS managed process. It is created exactly once; its
output is read from a replayable NDJSON stream that is resumed from the last
accepted sequence number whenever the connection breaks; when the stream cannot
deliver the exit status, it is recovered out of band; and on any failure the
remote process tree is terminated. `python -m createos_exec --help` is the
command line.
"""

from __future__ import annotations

import argparse
import binascii
import codecs
import collections
import contextlib
import dataclasses
import email.utils
import functools
import http.client
import ipaddress
import itertools
import json
import logging
import math
import os
import random
import re
import secrets
import signal as _signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import (
    Any,
    Callable,
    Deque,
    Dict,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Type,
    Union,
)

import requests
import urllib3

__version__ = "0.1.0"

__all__ = [
    "APIError",
    "CancelledError",
    "CleanupError",
    "Client",
    "CommandError",
    "ConfigError",
    "CreateOSError",
    "ExecResult",
    "OutputEvictedError",
    "ProtocolError",
    "RetryPolicy",
    "StreamEndedError",
    "TransportError",
    "echo",
    "execute",
    "main",
]

logger = logging.getLogger("createos_exec")

OutputCallback = Callable[[str, str], Any]
Command = Union[str, Sequence[str]]


# --------------------------------------------------------------------------
# Public types: the result, the errors, the retry policy
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class ExecResult:
    """How a remote command ended, and the tail of what it printed.

    `stdout` and `stderr` each keep their last `max_output_chars` characters;
    `output` keeps the last `max_output_chars` of both, interleaved by sequence
    number: the order CreateOS received them from the two pipes.
    """

    args: Any
    exit_code: Optional[int]
    signal: Optional[str]
    timed_out: bool
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    process_id: Optional[str] = None
    reconnects: int = 0
    exit_recovered: bool = False
    creation_recovered: bool = False
    duration: float = 0.0
    output: str = ""
    combined_truncated: bool = False

    @property
    def output_truncated(self) -> bool:
        """The head of stdout, stderr or `output` was dropped to respect the cap."""
        return self.stdout_truncated or self.stderr_truncated or self.combined_truncated

    @property
    def returncode(self) -> Optional[int]:
        """subprocess convention: the exit code, or minus the signal number."""
        if self.signal is not None:
            number = _signal_number(self.signal)
            return -number if number is not None else None
        return self.exit_code

    @property
    def ok(self) -> bool:
        """The command ran to completion and exited 0."""
        return self.exit_code == 0 and self.signal is None and not self.timed_out

    def check_returncode(self) -> None:
        """Raise CommandError unless the command exited 0."""
        if not self.ok:
            raise CommandError(self)

    def __repr__(self) -> str:
        # The output can be megabytes: show its size, never its text.
        return (
            f"ExecResult(args={self.args!r}, exit_code={self.exit_code!r}, "
            f"signal={self.signal!r}, timed_out={self.timed_out!r}, "
            f"stdout=<{len(self.stdout)} chars>, stderr=<{len(self.stderr)} chars>, "
            f"output=<{len(self.output)} chars>, "
            f"process_id={self.process_id!r}, reconnects={self.reconnects!r})"
        )


def _restore_error(
    cls: Type[BaseException], args: Tuple[Any, ...], state: Dict[str, Any]
) -> BaseException:
    error: BaseException = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class CreateOSError(Exception):
    """Root of every error raised by createos_exec."""

    def __init__(
        self,
        message: str,
        *,
        process_id: Optional[str] = None,
        result: Optional[ExecResult] = None,
    ) -> None:
        # Exception.__init__ directly: a co-base such as CalledProcessError
        # must not receive our message as its own arguments.
        Exception.__init__(self, message)
        self.process_id = process_id
        self.result = result

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> Any:
        # Rebuild without calling __init__, whose signature differs per class.
        return (_restore_error, (type(self), self.args, dict(self.__dict__)))


class ConfigError(CreateOSError, ValueError):
    """An invalid setting or argument, found before any request was sent."""


class APIError(CreateOSError):
    """CreateOS answered a request with a non-2xx status."""

    def __init__(self, status: int, operation: str, *, process_id: Optional[str] = None) -> None:
        self.status = status
        self.operation = operation
        super().__init__(f"CreateOS answered HTTP {status} to {operation}.", process_id=process_id)


class TransportError(CreateOSError):
    """CreateOS could not be reached within the retry policy."""

    def __init__(self, operation: str, *, process_id: Optional[str] = None) -> None:
        self.operation = operation
        super().__init__(f"CreateOS could not be reached for {operation}.", process_id=process_id)


class StreamEndedError(TransportError):
    """The output stream kept failing and the exit status could not be recovered."""

    def __init__(self, *, process_id: Optional[str] = None) -> None:
        super().__init__("output connection", process_id=process_id)
        self.args = ("CreateOS process stream ended without an exit status.",)


class ProtocolError(CreateOSError):
    """CreateOS sent something this client does not understand; it fails closed."""

    def __init__(self, problem: str, *, process_id: Optional[str] = None) -> None:
        self.problem = problem
        super().__init__(f"CreateOS sent an invalid answer: {problem}.", process_id=process_id)


class OutputEvictedError(ProtocolError):
    """Output that had not been read yet was evicted from the process journal."""

    def __init__(
        self,
        oldest_available_seq: Optional[int],
        *,
        process_id: Optional[str] = None,
    ) -> None:
        self.oldest_available_seq = oldest_available_seq
        CreateOSError.__init__(
            self,
            "Output this client had not read yet was evicted from the CreateOS journal.",
            process_id=process_id,
        )
        self.problem = "output evicted"


class CleanupError(CreateOSError):
    """The remote process may still exist: destroy the sandbox before reusing it."""

    def __init__(
        self, *, process_id: Optional[str] = None, creation_unconfirmed: bool = False
    ) -> None:
        self.creation_unconfirmed = creation_unconfirmed
        if creation_unconfirmed:
            message = (
                "Process creation could not be confirmed; destroy the sandbox "
                "(or audit its processes) before reusing it."
            )
        else:
            message = (
                "Termination of the remote process tree could not be confirmed; "
                "destroy the sandbox before reusing it."
            )
        super().__init__(message, process_id=process_id)


class CancelledError(CreateOSError):
    """The cancel event was set; the remote process tree was terminated."""

    def __init__(self, *, process_id: Optional[str] = None) -> None:
        super().__init__(
            "The command was cancelled and its remote process tree terminated.",
            process_id=process_id,
        )


class CommandError(CreateOSError, subprocess.CalledProcessError):
    """check=True and the command did not exit 0 (including timeout and signal)."""

    def __init__(self, result: ExecResult) -> None:
        if result.timed_out:
            message = "The command timed out and its remote process tree was terminated."
        elif result.signal is not None:
            message = f"The command was killed by {result.signal}."
        else:
            message = f"The command exited with status {result.exit_code}."
        super().__init__(message, process_id=result.process_id, result=result)
        # The attributes of subprocess.CalledProcessError, set by hand so that
        # its __init__ does not put the output into args.
        # None when the command timed out and then exited by itself.
        self.returncode = result.returncode  # type: ignore[assignment]
        self.cmd = result.args
        self.output = result.stdout
        self.stderr = result.stderr


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying while the API or the stream fails without progress."""

    max_attempts: int = 8
    budget: float = 60.0
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    max_retry_after: float = 60.0

    def __post_init__(self) -> None:
        if not _is_int(self.max_attempts) or self.max_attempts < 1:
            raise ConfigError("RetryPolicy.max_attempts must be a positive integer.")
        for name in ("budget", "initial_backoff", "max_backoff", "max_retry_after"):
            value = getattr(self, name)
            if not _is_number(value) or value != value or value < 0:
                raise ConfigError(f"RetryPolicy.{name} must be a number of seconds >= 0.")


# --------------------------------------------------------------------------
# Configuration and HTTP plumbing
# --------------------------------------------------------------------------

DEFAULT_API_URL = "https://api.sb.createos.sh"
_HEADER_SAFE = re.compile(r"[!-~]+\Z")  # printable ASCII, no spaces at all
_HOST = re.compile(r"[A-Za-z0-9._:-]+\Z")  # a name, IPv4 or (unbracketed) IPv6
_ID = re.compile(r"[A-Za-z0-9_-]{1,200}\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_FRAME_LIMIT = 1024 * 1024  # longest NDJSON line accepted, in bytes
_READ_SIZE = 256 * 1024  # most bytes taken at once from a body that is not chunked
_WAIT_POLL_MS = 30_000  # server-side long-poll of one `wait`
_TERMINATE_GRACE = 1.0  # seconds between SIGTERM and SIGKILL when terminating
_PACING_POLL = 0.05  # seconds between looks at a full window
_CANCEL_POLL = 0.1  # seconds between looks at the cancel event while a read blocks
_EXIT_CHECK_MS = 5_000  # how long an exit frame without status is checked against `wait`


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_seconds(name: str, value: Any) -> float:
    if not _is_number(value) or not value > 0 or value != value:
        raise ConfigError(f"{name} must be a positive number of seconds.")
    return float(value)


def _api_base(url: str) -> str:
    """Check an API URL and return it as scheme://host[:port][/prefix] without /v1."""
    if not isinstance(url, str) or not url:
        raise ConfigError("The API URL must be a non-empty string.")
    try:
        parts = urllib.parse.urlsplit(url)
        hostname = parts.hostname
        parts.port  # noqa: B018 -- raises ValueError on a malformed port
    except ValueError:
        raise ConfigError("The API URL is not a valid URL.") from None
    if parts.username is not None or parts.password is not None:
        raise ConfigError("The API URL must not contain user information.")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ConfigError("The API URL must not contain a query or a fragment.")
    if not hostname or not _HOST.match(hostname):
        raise ConfigError("The API URL has no valid host.")
    if parts.scheme == "http":
        if not _is_loopback(hostname):
            raise ConfigError("The API URL must use https (plain http only to loopback).")
    elif parts.scheme != "https":
        raise ConfigError("The API URL must use https (plain http only to loopback).")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


def _is_loopback(hostname: str) -> bool:
    if hostname.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


def _api_key(key: Optional[str]) -> str:
    if key is None:
        key = os.environ.get("CREATEOS_API_KEY") or os.environ.get("CREATEOS_SANDBOX_API_KEY")
    if not key:
        raise ConfigError(
            "No API key: pass api_key= or set CREATEOS_API_KEY (or CREATEOS_SANDBOX_API_KEY)."
        )
    if not isinstance(key, str) or not _HEADER_SAFE.match(key):
        raise ConfigError("The API key contains characters that cannot be sent in a header.")
    return key


def _checked_id(kind: str, value: Any) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise ConfigError(f"Invalid {kind} id: expected 1-200 characters of A-Z a-z 0-9 _ -.")
    return value


class _RateLimiter:
    """Sliding-window pacing of every request this process sends to one API origin.

    A request holds its place from the moment it is let through until its
    answer starts (or it fails), and for one period after that: a server that
    counts arrivals never sees more than `limit` in any window, however long
    requests queue on the way.
    """

    _shared: Dict[Tuple[str, int, float], "_RateLimiter"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, limit: int, period: float) -> None:
        self._limit = limit
        self._period = period
        self._held: Deque[List[float]] = collections.deque()  # [time answered], inf until then
        self._lock = threading.Lock()

    @classmethod
    def for_origin(cls, origin: str, limit: int, period: float) -> "_RateLimiter":
        with cls._shared_lock:
            key = (origin, limit, period)
            if key not in cls._shared:
                cls._shared[key] = cls(limit, period)
            return cls._shared[key]

    def acquire(self) -> List[float]:
        """Wait for a place in the window; hand it to release() once answered."""
        while True:
            with self._lock:
                now = time.monotonic()
                while self._held and self._held[0][0] <= now - self._period:
                    self._held.popleft()
                if len(self._held) < self._limit:
                    place = [math.inf]
                    self._held.append(place)
                    return place
                delay = min(self._held[0][0] + self._period - now, _PACING_POLL)
            time.sleep(delay)

    def release(self, place: List[float]) -> None:
        with self._lock:
            place[0] = time.monotonic()


def _rate_limit(value: Any) -> Optional[Tuple[int, float]]:
    if value is None:
        return None
    try:
        limit, period = value
    except (TypeError, ValueError):
        raise ConfigError("rate_limit must be (requests, seconds) or None.") from None
    if not _is_int(limit) or limit < 1 or not _is_number(period) or not period > 0:
        raise ConfigError("rate_limit must be (requests, seconds) or None.")
    return limit, float(period)


class _Retryable(Exception):
    """A failure worth another attempt: transport trouble, 408/429/5xx."""

    def __init__(
        self,
        operation: str,
        *,
        status: Optional[int] = None,
        retry_after: Optional[float] = None,
        maybe_sent: bool = True,
    ) -> None:
        super().__init__(operation)
        self.operation = operation
        self.status = status
        self.retry_after = retry_after
        self.maybe_sent = maybe_sent

    def final(self, process_id: Optional[str]) -> CreateOSError:
        """The public error to raise once no attempt is left."""
        if self.status is not None:
            return APIError(self.status, self.operation, process_id=process_id)
        return TransportError(self.operation, process_id=process_id)


class _TimedOut(Exception):
    """The command's own deadline expired."""


# What the HTTP stack raises: urllib3's and http.client's errors and OSError,
# which requests' own exceptions are too.
_LOW_LEVEL_ERRORS = (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)
_TRANSIENT_REQUEST_ERRORS = (
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    requests.exceptions.ContentDecodingError,
)


@contextlib.contextmanager
def _transport_errors(operation: str) -> Iterator[None]:
    """Exceptions of the HTTP stack raised inside, translated by _transport_failure."""
    try:
        yield
    except _LOW_LEVEL_ERRORS as exc:
        raise _transport_failure(exc, operation) from exc


def _transport_failure(exc: BaseException, operation: str) -> Exception:
    """The one place where exceptions of the HTTP stack are translated.

    Their text is never copied: requests puts URLs (and so ids) into messages.
    """
    if isinstance(exc, requests.exceptions.SSLError):
        return TransportError(operation)
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return _Retryable(operation, maybe_sent=False)
    if isinstance(exc, requests.exceptions.ConnectionError):
        reason = getattr(exc.args[0], "reason", None) if exc.args else None
        not_sent = isinstance(reason, urllib3.exceptions.NewConnectionError)
        return _Retryable(operation, maybe_sent=not not_sent)
    if isinstance(exc, requests.exceptions.RequestException) and not isinstance(
        exc, _TRANSIENT_REQUEST_ERRORS
    ):
        return TransportError(operation)  # a request that could not be made as asked
    return _Retryable(operation)


def _retry_after(value: Optional[str]) -> Optional[float]:
    """Retry-After as seconds (delta-seconds or HTTP date); unparsable means absent."""
    if not value:
        return None
    value = value.strip()
    if re.fullmatch(r"[0-9]+", value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def _remaining(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else deadline - time.monotonic()


def _within(seconds: float, deadline: Optional[float]) -> float:
    left = _remaining(deadline)
    # Never 0: urllib3 refuses a zero timeout; an expired deadline is caught by the caller.
    return seconds if left is None else max(0.001, min(seconds, left))


class _Budget:
    """The failures of one run without progress; it resets whenever progress is made."""

    def __init__(self, policy: RetryPolicy) -> None:
        self._policy = policy
        self._failures = 0
        self._since: Optional[float] = None

    def progress(self) -> None:
        self._failures = 0
        self._since = None

    def next_delay(self, retry_after: Optional[float] = None) -> Optional[float]:
        """Count one failure; the delay before the next attempt, or None when spent."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        self._failures += 1
        left = self._policy.budget - (now - self._since)
        if self._failures >= self._policy.max_attempts or left <= 0:
            return None
        if retry_after is not None:
            delay = min(retry_after, self._policy.max_retry_after)
        elif self._failures == 1:
            # A connection that breaks after progress (a recycled proxy
            # connection, a reset) is most likely fine at once; back off
            # only when failures follow each other.
            delay = 0.0
        else:
            ceiling = self._policy.initial_backoff * 2 ** (self._failures - 2)
            delay = random.uniform(0, min(self._policy.max_backoff, ceiling))
        return min(delay, left)


class _Transport:
    """Sends one request: pacing, the key header, no redirects, status triage."""

    def __init__(
        self,
        base: str,
        api_key: str,
        session: requests.Session,
        limiter: Optional[_RateLimiter],
    ) -> None:
        self.base = base
        self._headers = {"X-Api-Key": api_key}
        self._session = session
        self._limiter = limiter

    def send(
        self,
        method: str,
        path: str,
        *,
        operation: str,
        timeout: Tuple[float, float],
        params: Optional[Dict[str, Any]] = None,
        json_body: Any = None,
        data: Optional[bytes] = None,
        stream: bool = False,
        ok_statuses: Tuple[int, ...] = (),
    ) -> requests.Response:
        """A 2xx (or an `ok_statuses`) response; any other status raises."""
        logger.debug("%s %s", method, path)
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/octet-stream"
        if stream:
            # Compression on the way (gzip in a proxy) would hold live output back.
            headers["Accept-Encoding"] = "identity"
        place = self._limiter.acquire() if self._limiter is not None else None
        try:
            with _transport_errors(operation):
                response = self._session.request(
                    method,
                    self.base + path,
                    params=params,
                    json=json_body,
                    data=data,
                    headers=headers,
                    timeout=timeout,
                    stream=stream,
                    allow_redirects=False,  # requests would forward X-Api-Key to the new host
                )
        finally:
            if place is not None and self._limiter is not None:
                self._limiter.release(place)
        status = response.status_code
        if 200 <= status < 300 or status in ok_statuses:
            return response
        retry_after = _retry_after(response.headers.get("Retry-After"))
        response.close()
        if status in (408, 429) or status >= 500:
            raise _Retryable(operation, status=status, retry_after=retry_after)
        raise APIError(status, operation)


def _jsend_data(response: requests.Response, operation: str) -> Any:
    """The `data` of a JSend success envelope."""
    if response.status_code in (204, 205) and not response.content:
        return None
    try:
        body = response.json()
    except (ValueError, RecursionError):
        raise ProtocolError(f"the answer to {operation} is not JSON") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        raise ProtocolError(f"the answer to {operation} is not a JSend success envelope")
    return body.get("data")


# --------------------------------------------------------------------------
# Wire protocol: bytes -> blocks of complete lines -> frames
# --------------------------------------------------------------------------


def _blocks(chunks: Iterable[bytes], limit: int = _FRAME_LIMIT) -> Iterator[bytes]:
    """The complete lines of a byte stream, as soon as they arrive, a block at a time.

    Every block ends with b"\\n" (the only line break: U+2028 is legal inside
    JSON). A stream that breaks, also one that ends inside a line, is a
    broken connection (_Retryable), not a frame.
    """
    pending: List[Union[bytes, memoryview]] = []
    pending_size = 0
    try:
        for chunk in chunks:
            if not pending and chunk.endswith(b"\n") and len(chunk) <= limit:
                yield chunk  # the usual chunk: whole lines, nothing before or after
                continue
            end = chunk.rfind(b"\n") + 1
            if end:
                if pending:
                    pending.append(memoryview(chunk)[:end])  # joined without a copy of its own
                    block = b"".join(pending)
                    pending.clear()
                else:
                    block = chunk if end == len(chunk) else chunk[:end]
                if len(block) > limit:
                    yield from _within_limit(block, limit)
                else:
                    yield block
                pending_size = 0
            if end < len(chunk):
                pending.append(chunk[end:] if end else chunk)
                pending_size += len(chunk) - end
                if pending_size > limit:
                    raise ProtocolError("an output frame is longer than 1 MiB")
    except _LOW_LEVEL_ERRORS as exc:
        raise _transport_failure(exc, "output connection") from exc
    if pending:
        raise _Retryable("output connection")


def _within_limit(block: bytes, limit: int) -> Iterator[bytes]:
    """A block longer than `limit`, or the lines before its first line that is, then the error."""
    start = 0
    while start < len(block):
        end = block.index(b"\n", start)
        if end - start > limit:
            if start:
                yield block[:start]
            raise ProtocolError("an output frame is longer than 1 MiB")
        start = end + 1
    yield block


# A data frame as the service writes it (protocol.md 5.4). A line in exactly
# this form is a JSON object whose fields the groups give: digits, one of two
# words and base64 characters need no unescaping. The base64 ends as only
# canonical base64 can: the character before "=" or "==" leaves no bits set
# (_CANONICAL_LAST; a lookbehind, which costs less than backtracking); the
# length is left to _plain_base64.
_DATA_HEAD = r'\{"type":"data","seq":([1-9][0-9]{0,17}),"stream":"(stdout|stderr)","data_base64":"'
_PLAIN_DATA_LINE = re.compile(
    "^" + _DATA_HEAD + r'([A-Za-z0-9+/]*(?:(?<=[AQgw])==|(?<=[AEIMQUYcgkosw048])=)?)"\}$',
    re.MULTILINE,
)
_LONG_DATA_HEAD = re.compile(_DATA_HEAD)
# A block that is one data line, the usual block of live output. Strict base64
# decoding (_strict_a2b) checks its characters anyway, on Python 3.11 and later
# faster than a pattern can, so this pattern takes anything between the quotes
# and checks only the canonical end.
_ONE_DATA_LINE = re.compile(_DATA_HEAD + r'([^"]*)(?<![^AQgw]==)(?<![^AEIMQUYcgkosw048=]=)"\}\n\Z')
_PlainData = List[Tuple[str, str, str]]  # seq digits, stream, base64 of each line
_PLAIN_LINE_LENGTH = 512  # bytes; a block that starts with a longer line skips the patterns


def _utf8_text(block: bytes) -> Optional[str]:
    """`block` decoded, or None when it is not UTF-8 (its lines are then taken alone)."""
    try:
        return block.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _plain_data(text: str) -> Optional[_PlainData]:
    """The fields of every line of `text` when all are plain data frames, else None.

    Nearly every block is just that: one pattern search costs less than
    parsing each line as JSON. The pattern scans a long line more slowly
    than the JSON scanner does, so a block that starts with one is left to
    _long_data_line and the scanner.
    """
    if len(text) > _PLAIN_LINE_LENGTH and text.find("\n", 0, _PLAIN_LINE_LENGTH) < 0:
        return None
    lines: _PlainData = _PLAIN_DATA_LINE.findall(text)
    return lines if len(lines) == text.count("\n") else None


def _long_data_line(text: str) -> Optional[_Data]:
    """seq, stream and payload when `text` is one data line in the service's form.

    A long line is not worth the pattern; strict base64 decoding checks its
    characters instead. Base64 it accepts holds no escape, quote or line
    break, so the line is exactly what its head and its end say, without the
    JSON scanner. Anything else (escapes, more keys) is left to it, and so is
    a block of several lines: its first line's base64 would be decoded twice.
    """
    head = _LONG_DATA_HEAD.match(text)
    if head is None or not text.endswith('"}\n') or text.find("\n") < len(text) - 1:
        return None
    try:
        return int(head.group(1)), head.group(2), _strict_base64(text[head.end() : -3])
    except ProtocolError:
        return None


_JSON = json.JSONDecoder()


def _frames(block: bytes, text: Optional[str]) -> Iterator[Any]:
    """The JSON value of each line of a block of complete lines, in order.

    `text` is the block decoded (None: not UTF-8). A line that is not
    exactly one JSON value fails after the lines before it were handed out,
    exactly as json.loads of each line alone decides.
    """
    if text is None:
        for line in block.split(b"\n")[:-1]:
            yield _line_value(_utf8_line(line))
        return
    position = 0
    while position < len(text):
        try:
            value, end = _JSON.raw_decode(text, position)
        except (ValueError, RecursionError):
            end = -1
        if end < 0 or text[end] != "\n":  # whitespace around the value, or worse
            end = text.index("\n", position)
            value = _line_value(text[position:end])
        yield value
        position = end + 1


def _utf8_line(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("an output frame is not UTF-8") from None


def _line_value(line: str) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        raise ProtocolError("an output frame is not valid JSON") from None


def _frame_type(value: Any) -> str:
    """The type of a frame: a JSON object with a string `type`."""
    kind = value.get("type") if type(value) is dict else None
    if type(kind) is not str:
        raise ProtocolError("an output frame is not an object with a type")
    return kind


_STREAMS = ("stdout", "stderr")
_Data = Tuple[int, str, bytes]  # seq, stream, payload (a plain tuple: this runs per frame)


def _data_frame(frame: Dict[str, Any]) -> _Data:
    seq: Any = frame.get("seq")
    if not _is_int(seq) or seq < 1:
        raise ProtocolError("a data frame has no positive integer seq")
    stream = frame.get("stream")
    if stream not in _STREAMS:
        raise ProtocolError("a data frame names an unknown stream")
    return seq, stream, _strict_base64(frame.get("data_base64"))


# By bytes in the last quantum (1 or 2): the characters allowed before its
# padding, those whose unused bits are zero.
_CANONICAL_LAST = ("", "AQgw", "AEIMQUYcgkosw048")
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?\Z")


if sys.version_info >= (3, 11):

    def _strict_a2b(text: str) -> bytes:
        """a2b_base64 of standard, padded base64 only; binascii.Error for anything else."""
        return binascii.a2b_base64(text, strict_mode=True)  # novermin

else:

    def _strict_a2b(text: str) -> bytes:
        """a2b_base64 of standard, padded base64 only; binascii.Error for anything else."""
        if not _BASE64.match(text):
            raise binascii.Error("not strict base64")
        return binascii.a2b_base64(text)


def _plain_base64(text: str) -> bytes:
    """The payload of base64 that _PLAIN_DATA_LINE took (alphabet, padding, unused bits).

    Such text is canonical base64 if it is whole 4-character quanta; then
    a2b_base64 decodes it exactly, even before Python 3.11 and its strict mode.
    """
    if len(text) % 4:
        raise ProtocolError("a data frame carries invalid base64")
    return binascii.a2b_base64(text)


def _strict_base64(text: Any) -> bytes:
    """Standard-alphabet padded base64 whose unused bits are zero (canonical)."""
    if type(text) is not str:
        raise ProtocolError("a data frame has no data_base64 string")
    try:
        payload = _strict_a2b(text)
    except ValueError:  # binascii.Error, or a character beyond ASCII
        raise ProtocolError("a data frame carries invalid base64") from None
    # strict_mode lets "=" follow a whole last quantum; the length tells.
    last = len(payload) % 3
    if len(text) != (len(payload) + 2) // 3 * 4 or (
        last and text[last - 4] not in _CANONICAL_LAST[last]
    ):
        raise ProtocolError("a data frame carries non-canonical base64")
    return payload


class _Exit(NamedTuple):
    exit_code: Optional[int]
    signal: Optional[str]


# Go-style spellings of signals, as some agents report them.
_SIGNAL_WORDS = {
    "hangup": "SIGHUP",
    "interrupt": "SIGINT",
    "quit": "SIGQUIT",
    "illegal instruction": "SIGILL",
    "trace/breakpoint trap": "SIGTRAP",
    "aborted": "SIGABRT",
    "bus error": "SIGBUS",
    "floating point exception": "SIGFPE",
    "killed": "SIGKILL",
    "user defined signal 1": "SIGUSR1",
    "segmentation fault": "SIGSEGV",
    "user defined signal 2": "SIGUSR2",
    "broken pipe": "SIGPIPE",
    "alarm clock": "SIGALRM",
    "terminated": "SIGTERM",
    "stack fault": "SIGSTKFLT",
    "child exited": "SIGCHLD",
    "continued": "SIGCONT",
    "stopped (signal)": "SIGSTOP",
    "stopped": "SIGTSTP",
    "stopped (tty input)": "SIGTTIN",
    "stopped (tty output)": "SIGTTOU",
    "urgent i/o condition": "SIGURG",
    "cpu time limit exceeded": "SIGXCPU",
    "file size limit exceeded": "SIGXFSZ",
    "virtual timer expired": "SIGVTALRM",
    "profiling timer expired": "SIGPROF",
    "window changed": "SIGWINCH",
    "i/o possible": "SIGIO",
    "power failure": "SIGPWR",
    "bad system call": "SIGSYS",
}
_SIGNAL_NUMBER_WORD = re.compile(r"signal ([1-9][0-9]?)\Z")  # Go's words for the others
_SIGNAL_NAME = re.compile(r"SIG[A-Z0-9]{1,16}\Z")


def _exit_status(fields: Dict[str, Any]) -> Optional[_Exit]:
    """exit_code/signal of an exit frame or a process record; None when neither is set.

    The signal is authoritative: a process that died of one has no exit code.
    """
    signal, code = fields.get("signal"), fields.get("exit_code")
    if signal is not None:
        if not isinstance(signal, str):
            raise ProtocolError("an exit status names its signal with a non-string")
        name = signal if _SIGNAL_NAME.match(signal) else _signal_from_words(signal.lower())
        if name is None:
            raise ProtocolError("an exit status names an unknown signal")
        return _Exit(None, name)
    if code is None:
        return None
    if not _is_int(code) or not 0 <= code <= 255:
        raise ProtocolError("an exit status is not an integer from 0 to 255")
    return _Exit(code, None)


def _signal_from_words(words: str) -> Optional[str]:
    numbered = _SIGNAL_NUMBER_WORD.match(words)
    return "SIG" + numbered.group(1) if numbered else _SIGNAL_WORDS.get(words)


def _signal_number(name: str) -> Optional[int]:
    """The number of a signal name; SIG34 style names (real-time signals) included."""
    if name[3:].isdigit():
        return int(name[3:])
    try:
        return int(_signal.Signals[name])
    except KeyError:
        return None


# --------------------------------------------------------------------------
# Output capture: incremental decoders and bounded tails
# --------------------------------------------------------------------------


_TAIL_PART = 4096  # characters; shorter texts are gathered into one part for the tails


class _Tail:
    """The last `limit` characters of a stream, O(1) amortised per character.

    It is handed parts, not single frames (_Output gathers them), and drops
    its head in whole parts, a quarter of `limit` at a time: the deque sees
    one part per thousands of characters.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._high = limit + limit // 4  # held at most, beyond the part just appended
        self._parts: Deque[str] = collections.deque()
        self._size = 0  # characters in _parts
        self._dropped = False

    @property
    def truncated(self) -> bool:
        return self._dropped or self._size > self._limit

    def append(self, part: str) -> None:
        self._parts.append(part)
        self._size += len(part)
        if self._size > self._high:
            self._drop_head()

    def _drop_head(self) -> None:
        """Drop whole parts while the rest still holds `limit` characters."""
        parts = self._parts
        while parts and self._size - len(parts[0]) >= self._limit:
            self._size -= len(parts.popleft())
            self._dropped = True

    def text(self) -> str:
        self._drop_head()
        parts = iter(self._parts)
        head = next(parts, "")[max(0, self._size - self._limit) :]
        return "".join(itertools.chain((head,), parts))  # one copy of the tail, no more


class _Output:
    """What the process printed: a decoder and a tail per stream, plus the tail
    of both in the order they were written (what `2>&1` would have shown).

    Text goes to on_output as soon as it is decoded. The tails get it in
    parts of about _TAIL_PART characters (a long text alone is a part
    without a copy): a frame costs a list append here, not an append to
    each of two tails.
    """

    def __init__(
        self, encoding: str, errors: str, limit: int, on_output: Optional[OutputCallback]
    ) -> None:
        self._decoders = {name: codecs.getincrementaldecoder(encoding)(errors) for name in _STREAMS}
        self._on_output = on_output
        self.tails = {name: _Tail(limit) for name in _STREAMS}
        self.combined = _Tail(limit)
        self._part_size = min(_TAIL_PART, limit // 16)
        self._recent: List[Tuple[str, str]] = []  # (stream, text), not yet in the tails
        self._recent_size = 0

    def feed(self, stream: str, payload: bytes, final: bool = False) -> None:
        text: str = self._decoders[stream].decode(payload, final)
        if text:
            self._recent.append((stream, text))
            self._recent_size += len(text)
            if self._recent_size > self._part_size:
                self._file_recent()
            if self._on_output is not None:
                self._on_output(stream, text)

    def _file_recent(self) -> None:
        recent = self._recent
        for name, tail in self.tails.items():
            part = "".join([text for stream, text in recent if stream == name])
            if part:
                tail.append(part)
        if recent:
            self.combined.append("".join([text for _, text in recent]))  # one is not copied
        recent.clear()
        self._recent_size = 0

    def finish(self, hand_out: bool) -> None:
        """Decode what the decoders hold back (a character cut off at the end),
        handing it to on_output unless `hand_out` is false, and fill the tails."""
        if not hand_out:
            self._on_output = None
        for name in _STREAMS:
            self.feed(name, b"", final=True)
        self._file_recent()


# --------------------------------------------------------------------------
# The command: plan (wrapper script, staged secrets), then create, follow,
# recover, contain
# --------------------------------------------------------------------------


def _quote(text: str) -> str:
    """Single-quote for bash: nothing inside is expanded."""
    return "'" + text.replace("'", "'\\''") + "'"


class _Plan(NamedTuple):
    """What is sent to create the process, and the private file staged beforehand."""

    marker: str
    body: Dict[str, Any]
    staged_path: Optional[str]
    staged: Optional[bytes]


def _plan(
    command: Command,
    *,
    shell: bool,
    cwd: Optional[str],
    env: Optional[Dict[str, str]],
    stdin: Union[str, bytes, None],
) -> _Plan:
    """Build the bash wrapper that runs the command: `bash -c WRAPPER MARKER ARGV...`.

    The random marker ($0) lets an ambiguously created process be found again.

    Env values and stdin are secrets: anyone listing the sandbox's processes
    reads cmd/args. They travel in a private file instead, which the wrapper
    opens as its stdin, reads the variables from and removes at once.
    """
    marker = "createos_exec-" + secrets.token_hex(12)
    argv = _argv(command, shell)
    staged = _staged_bytes(env, stdin)
    staged_path = f"/tmp/.{marker}" if staged is not None else None
    lines = []
    if staged_path is None:
        lines.append("exec 0</dev/null")
    else:
        quoted = _quote(staged_path)
        lines.append(f"exec 0<{quoted} || exit 125")
        lines.append(f"rm -f -- {quoted}")
        var = "_" + marker.replace("-", "_")  # a name no caller's variable can have
        lines.append(
            f"while IFS= read -r -d '' {var} && [ -n \"${var}\" ]; "
            f'do export "${var}"; done; unset {var}'
        )
    if cwd is not None:
        lines.append(f"cd -- {_quote(_checked_text('cwd', cwd))} || exit 1")
    # The command travels as the wrapper's positional parameters, untouched by
    # any quoting, each its own exec string (Linux caps one at 128 KiB).
    lines.append('exec bash -c -- "$1"' if shell else 'exec -- "$@"')
    body = {"cmd": "bash", "args": ["-c", "\n".join(lines) + "\n", marker, *argv]}
    return _Plan(marker, body, staged_path, staged)


def _checked_text(what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a string.")
    if "\0" in value:
        raise ConfigError(f"{what} contains a NUL byte.")
    return value


def _argv(command: Command, shell: bool) -> List[str]:
    if shell:
        if not isinstance(command, str):
            raise ConfigError("With shell=True the command must be one string.")
        return [_checked_text("The shell script", command)]
    if isinstance(command, str):
        command = [command]
    if isinstance(command, (bytes, bytearray)) or not isinstance(command, Sequence):
        raise ConfigError("The command must be a sequence of strings (or one string).")
    if not command:
        raise ConfigError("The command is empty.")
    return [_checked_text("Each command argument", arg) for arg in command]


def _staged_bytes(env: Optional[Dict[str, str]], stdin: Union[str, bytes, None]) -> Optional[bytes]:
    """NUL-terminated NAME=value entries, an empty entry, then the stdin bytes."""
    if not env and stdin is None:
        return None
    entries = []
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise ConfigError("Env names must match [A-Za-z_][A-Za-z0-9_]*.")
        what = f"The value of env {name}"
        entries.append(
            name.encode("ascii") + b"=" + _utf8(what, _checked_text(what, value)) + b"\0"
        )
    if isinstance(stdin, str):
        stdin = _utf8("stdin", stdin)
    elif stdin is not None and not isinstance(stdin, (bytes, bytearray)):
        raise ConfigError("stdin must be str, bytes or None.")
    return b"".join(entries) + b"\0" + bytes(stdin or b"")


def _utf8(what: str, text: str) -> bytes:
    """UTF-8 of a secret; the error raised for a lone surrogate must not carry the text."""
    try:
        encoded: Optional[bytes] = text.encode("utf-8")
    except UnicodeEncodeError:
        encoded = None  # raised below, outside the handler: no __context__ holding the text
    if encoded is None:
        raise ConfigError(f"{what} is not valid Unicode (pass bytes for binary stdin).")
    return encoded


class _Options(NamedTuple):
    """The per-call options shared by execute() and attach(), checked."""

    timeout: Optional[float]
    on_output: Optional[OutputCallback]
    check: bool
    max_output_chars: int
    encoding: str
    errors: str
    cancel: Optional[threading.Event]


def _options(
    timeout: Optional[float],
    on_output: Optional[OutputCallback],
    check: bool,
    max_output_chars: int,
    encoding: str,
    errors: str,
    cancel: Optional[threading.Event],
) -> _Options:
    if timeout is not None:
        timeout = _positive_seconds("timeout", timeout)
    if on_output is not None and not callable(on_output):
        raise ConfigError("on_output must be callable.")
    if not _is_int(max_output_chars) or max_output_chars < 0:
        raise ConfigError("max_output_chars must be an integer >= 0.")
    try:
        codecs.getincrementaldecoder(encoding)
        codecs.lookup_error(errors)
    except (LookupError, TypeError):
        raise ConfigError("Unknown encoding or error handler.") from None
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise ConfigError("cancel must be a threading.Event.")
    return _Options(timeout, on_output, bool(check), max_output_chars, encoding, errors, cancel)


class Client:
    """A connection to the CreateOS API; thread-safe, reusable, a context manager."""

    def __init__(
        self,
        api_url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        request_timeout: float = 30.0,
        stream_idle_timeout: float = 30.0,
        cleanup_timeout: float = 30.0,
        retry: Optional[RetryPolicy] = None,
        rate_limit: Optional[Tuple[int, float]] = (300, 60.0),
        session: Optional[requests.Session] = None,
    ) -> None:
        base = _api_base(api_url or os.environ.get("CREATEOS_API_URL") or DEFAULT_API_URL)
        key = _api_key(api_key)
        self.request_timeout = _positive_seconds("request_timeout", request_timeout)
        self.stream_idle_timeout = _positive_seconds("stream_idle_timeout", stream_idle_timeout)
        self.cleanup_timeout = _positive_seconds("cleanup_timeout", cleanup_timeout)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError("retry must be a RetryPolicy.")
        self.retry = retry or RetryPolicy()
        if session is not None and not isinstance(session, requests.Session):
            raise ConfigError("session must be a requests.Session.")
        pacing = _rate_limit(rate_limit)
        parts = urllib.parse.urlsplit(base)
        limiter = (
            _RateLimiter.for_origin(f"{parts.scheme}://{parts.netloc}", *pacing) if pacing else None
        )
        used = session if session is not None else _new_session()
        self._own_session = None if used is session else used  # we close only our own
        self._transport = _Transport(base, key, used, limiter)

    @property
    def api_url(self) -> str:
        return self._transport.base

    def __repr__(self) -> str:
        return f"Client(api_url={self.api_url!r})"

    def __reduce__(self) -> Any:
        # A session and a key do not belong in a pickle: build a client per process.
        raise TypeError("A createos_exec.Client cannot be pickled; create one in each process.")

    def close(self) -> None:
        """Close the HTTP session, unless it was the caller's."""
        if self._own_session is not None:
            self._own_session.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def execute(
        self,
        sandbox_id: str,
        command: Command,
        *,
        shell: bool = False,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        stdin: Union[str, bytes, None] = None,
        timeout: Optional[float] = None,
        on_output: Optional[OutputCallback] = None,
        check: bool = False,
        max_output_chars: int = 4 * 1024 * 1024,
        encoding: str = "utf-8",
        errors: str = "replace",
        cancel: Optional[threading.Event] = None,
    ) -> ExecResult:
        """Run `command` in the sandbox and return how it ended (see the module doc)."""
        started = time.monotonic()
        sandbox_id = _checked_id("sandbox", sandbox_id)
        options = _options(timeout, on_output, check, max_output_chars, encoding, errors, cancel)
        if env is not None and not isinstance(env, dict):
            raise ConfigError("env must be a dict of str to str.")
        plan = _plan(command, shell=shell, cwd=cwd, env=env, stdin=stdin)
        args = command if isinstance(command, str) else list(command)
        launch = _Launch(self, sandbox_id, plan)
        launch.stage()
        process_id, recovered = launch.create()
        run = _Run(
            self,
            sandbox_id,
            process_id,
            options,
            args=args,
            started=started,
            launch=launch,
            creation_recovered=recovered,
        )
        return run.run()

    def attach(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        after: int = 0,
        timeout: Optional[float] = None,
        on_output: Optional[OutputCallback] = None,
        check: bool = False,
        max_output_chars: int = 4 * 1024 * 1024,
        encoding: str = "utf-8",
        errors: str = "replace",
        cancel: Optional[threading.Event] = None,
    ) -> ExecResult:
        """Follow a process started elsewhere, from output seq `after` + 1.

        Failures are contained exactly as for execute(): the process tree is
        terminated on timeout, cancel, Ctrl-C or any error.
        """
        started = time.monotonic()
        sandbox_id = _checked_id("sandbox", sandbox_id)
        process_id = _checked_id("process", process_id)
        if not _is_int(after) or after < 0:
            raise ConfigError("after must be an integer >= 0.")
        options = _options(timeout, on_output, check, max_output_chars, encoding, errors, cancel)
        run = _Run(self, sandbox_id, process_id, options, args=None, started=started, cursor=after)
        return run.run()

    def _call(
        self,
        method: str,
        path: str,
        *,
        operation: str,
        deadline: Optional[float],
        read_timeout: Optional[float] = None,
        process_id: Optional[str] = None,
        **request: Any,
    ) -> requests.Response:
        """One request, retried under the retry policy while it fails and time remains."""
        budget = _Budget(self.retry)
        while True:
            limit = _within(self.request_timeout, deadline)
            try:
                return self._transport.send(
                    method,
                    path,
                    operation=operation,
                    timeout=(limit, _within(read_timeout or self.request_timeout, deadline)),
                    **request,
                )
            except APIError as error:
                error.process_id = process_id
                raise
            except _Retryable as failure:
                delay = budget.next_delay(failure.retry_after)
                left = _remaining(deadline)
                if delay is None or (left is not None and left <= delay):
                    raise failure.final(process_id) from failure.__cause__
                time.sleep(delay)


def _new_session() -> requests.Session:
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=64)  # threads share one client
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return session


def _sandbox_path(sandbox_id: str, rest: str = "") -> str:
    return f"/v1/sandboxes/{sandbox_id}{rest}"


class _Launch:
    """Staging the private file and creating the process, exactly once."""

    def __init__(self, client: Client, sandbox_id: str, plan: _Plan) -> None:
        self._client = client
        self._sandbox_id = sandbox_id
        self._plan = plan

    def stage(self) -> None:
        if self._plan.staged_path is None:
            return
        self._client._call(
            "PUT",
            _sandbox_path(self._sandbox_id, "/files"),
            operation="staging of env and stdin",
            deadline=None,
            params={"path": self._plan.staged_path},
            data=self._plan.staged,
        )

    def create(self) -> Tuple[str, bool]:
        """The new process id, and whether it had to be found by its marker.

        Never retried: a 4xx (429 included) or a refused connection means no
        process; a lost answer or a 5xx means it may exist, so look for it.
        """
        client = self._client
        try:
            response = client._transport.send(
                "POST",
                _sandbox_path(self._sandbox_id, "/processes"),
                operation="process creation",
                timeout=(client.request_timeout, client.request_timeout),
                json_body=self._plan.body,
            )
        except _Retryable as failure:
            if failure.status == 429 or not failure.maybe_sent:
                self.unstage()
                raise failure.final(None) from failure.__cause__
            logger.info("Process creation is ambiguous; looking for it by its marker")
            return self._find_created(), True
        except KeyboardInterrupt:
            self._abandon()
            raise
        except APIError:
            self.unstage()
            raise
        try:
            record = _jsend_data(response, "process creation")
            if not isinstance(record, dict):
                raise ProtocolError("the created process record is not an object")
            return _checked_process_id(record.get("process_id")), False
        except ProtocolError as exc:
            # Created, but unnamed: it may run unseen. Find it by its marker.
            logger.info("Process creation answer is unreadable; looking for it by its marker")
            try:
                return self._find_created(), True
            except CleanupError as cleanup:
                raise cleanup from exc

    def _find_created(self) -> str:
        """Find the process by the marker in its arguments, or fail as unconfirmed."""
        try:
            response = self._client._call(
                "GET",
                _sandbox_path(self._sandbox_id, "/processes"),
                operation="process listing",
                deadline=time.monotonic() + self._client.cleanup_timeout,
            )
            listing = _jsend_data(response, "process listing")
            processes = listing.get("processes") if isinstance(listing, dict) else None
            if not isinstance(processes, list):
                raise ProtocolError("the process listing has no list of processes")
            mine = [p for p in processes if self._has_marker(p)]
            if mine:
                process_id = _checked_process_id(mine[0].get("process_id"))
                logger.info("Found process %s by its marker; following it", process_id)
                return process_id
        except CreateOSError as exc:
            raise CleanupError(creation_unconfirmed=True) from exc
        self.unstage()
        raise CleanupError(creation_unconfirmed=True)

    def _has_marker(self, record: Any) -> bool:
        args = record.get("args") if isinstance(record, dict) else None
        return isinstance(args, list) and self._plan.marker in args

    def _abandon(self) -> None:
        """Ctrl-C while creating: find the process if it exists and terminate it."""
        try:
            process_id = self._find_created()
            _terminate(self._client, self._sandbox_id, process_id)
        except CleanupError:
            logger.warning("Could not confirm that no process was left running")

    def unstage(self) -> None:
        """Remove the staged secrets file, best-effort, when the wrapper may not have."""
        if self._plan.staged_path is None:
            return
        client = self._client
        try:
            client._transport.send(
                "POST",
                _sandbox_path(self._sandbox_id, "/exec"),
                operation="removal of the staged file",
                timeout=(client.request_timeout, client.cleanup_timeout),
                json_body={"cmd": "rm", "args": ["-f", "--", self._plan.staged_path]},
            ).close()
        except (CreateOSError, _Retryable):
            logger.warning("Could not remove the staged env/stdin file from the sandbox")


def _checked_process_id(value: Any) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise ProtocolError("a process record has an invalid process_id")
    return value


def _terminate(client: Client, sandbox_id: str, process_id: str) -> None:
    """DELETE the tree with a grace period and a fresh deadline.

    Raises CleanupError unless the answer is 404 (gone) or `tree_exited: true`.
    """
    grace = min(_TERMINATE_GRACE, client.cleanup_timeout / 2)
    try:
        response = client._call(
            "DELETE",
            _sandbox_path(sandbox_id, f"/processes/{process_id}"),
            operation="process cleanup",
            deadline=time.monotonic() + client.cleanup_timeout,
            process_id=process_id,
            read_timeout=grace + client.request_timeout,
            params={"grace_ms": int(grace * 1000)},
            ok_statuses=(404,),
        )
        if response.status_code == 404:
            response.close()
            return
        record = _jsend_data(response, "process cleanup")
    except CreateOSError as exc:
        logger.warning("Termination of %s failed", process_id)
        raise CleanupError(process_id=process_id) from exc
    if not isinstance(record, dict) or record.get("tree_exited") is not True:
        logger.warning("Termination of %s is unconfirmed", process_id)
        raise CleanupError(process_id=process_id)


class _Run:
    """Following one process to its end: the stream, recovery and containment."""

    def __init__(
        self,
        client: Client,
        sandbox_id: str,
        process_id: str,
        options: _Options,
        *,
        args: Any,
        started: float,
        cursor: int = 0,
        launch: Optional[_Launch] = None,
        creation_recovered: bool = False,
    ) -> None:
        self._client = client
        self._options = options
        self._sandbox_id = sandbox_id
        self._path = _sandbox_path(sandbox_id, f"/processes/{process_id}")
        self._launch = launch
        self._args = args
        self._started = started
        self._first_seq = cursor
        self.process_id = process_id
        self.cursor = cursor
        self.reconnects = 0
        self.exit_recovered = False
        self.creation_recovered = creation_recovered
        self.deadline = None if options.timeout is None else started + options.timeout
        self._output = _Output(
            options.encoding, options.errors, options.max_output_chars, options.on_output
        )
        self._pending: List[bytes] = []  # accepted payloads of one stream, not yet delivered
        self._pending_stream = _STREAMS[0]

    # -- the whole run -----------------------------------------------------

    def run(self) -> ExecResult:
        status: Optional[_Exit]
        try:
            status = self._follow()
            timed_out = False
        except _TimedOut:
            status = self._terminate_and_drain()
            timed_out = True
        except BaseException as exc:
            self._contain_after(exc)
            raise
        result = self._result(status, timed_out=timed_out)
        if self._options.check and not result.ok:
            raise CommandError(result)
        return result

    def _result(
        self, status: Optional[_Exit], *, timed_out: bool = False, partial: bool = False
    ) -> ExecResult:
        self._output.finish(hand_out=not partial)
        out, err = self._output.tails["stdout"], self._output.tails["stderr"]
        return ExecResult(
            args=self._args,
            exit_code=None if timed_out or status is None else status.exit_code,
            signal=None if status is None else status.signal,
            timed_out=timed_out,
            stdout=out.text(),
            stderr=err.text(),
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            output=self._output.combined.text(),
            combined_truncated=self._output.combined.truncated,
            process_id=self.process_id,
            reconnects=self.reconnects,
            exit_recovered=self.exit_recovered,
            creation_recovered=self.creation_recovered,
            duration=time.monotonic() - self._started,
        )

    # -- follow: read the stream, resume it on every transport failure -------

    def _follow(self) -> _Exit:
        budget = _Budget(self._client.retry)
        while True:
            self._check_interrupts()
            cursor = self.cursor
            try:
                return self._read_stream(budget)
            except _Retryable as failure:
                if self.cursor != cursor:
                    budget.progress()  # the connection that broke brought output
                self._check_interrupts()
                delay = budget.next_delay(failure.retry_after)
                if delay is None:
                    return self._recover(failure)
                logger.info(
                    "Output stream of %s broke; resuming after seq %d in %.2f s",
                    self.process_id,
                    self.cursor,
                    delay,
                )
                self._pause(delay)
                self.reconnects += 1

    def _read_stream(self, budget: _Budget) -> _Exit:
        """Connect after the cursor and read until the exit frame."""
        response = self._connect()
        with contextlib.closing(response), _unblocked_by(self._options.cancel, response):
            chunks = _arriving(response)
            for block in _blocks(chunks):
                self._check_interrupts()
                if self._take_next_frame(block):
                    continue
                status = self._take_block(block, budget)
                if status is not None:
                    _read_to_end(chunks)
                    return status
        raise _Retryable("output connection")  # clean EOF before the exit frame

    def _connect(self) -> requests.Response:
        client = self._client
        try:
            response = client._transport.send(
                "GET",
                self._path + "/connect",
                operation="output connection",
                timeout=(
                    _within(client.request_timeout, self.deadline),
                    _within(client.stream_idle_timeout, self.deadline),
                ),
                params={"after": self.cursor},
                stream=True,
                ok_statuses=(410,),
            )
        except APIError as error:
            error.process_id = self.process_id
            raise
        if response.status_code == 410:
            raise OutputEvictedError(_evicted_seq(response), process_id=self.process_id)
        return response

    def _take_next_frame(self, block: bytes) -> bool:
        """Take a block that is just the next data frame, in the service's form.

        Live output comes a frame per HTTP chunk, so this is the usual block,
        and it skips the block machinery. Anything else, also base64 that
        strict decoding refuses, is left to _take_block, which decides exactly.
        """
        if len(block) > _PLAIN_LINE_LENGTH:
            return False
        try:
            line = _ONE_DATA_LINE.match(block.decode("ascii"))
        except UnicodeDecodeError:
            return False  # not in the service's form
        if line is None:
            return False
        seq, stream, text = line.groups()
        if int(seq) != self.cursor + 1 or len(text) % 4:
            return False
        try:
            payload = _strict_a2b(text)
        except ValueError:
            return False
        self.cursor += 1
        self._output.feed(stream, payload)
        return True

    def _take_block(self, block: bytes, budget: _Budget) -> Optional[_Exit]:
        """Act on the frames of a block; the exit status when it holds the exit frame.

        Data arriving together is delivered together: one base64 decode and
        one feed of the capture per run of frames of one stream.
        """
        try:
            text = _utf8_text(block)
            if text is not None:
                plain = _plain_data(text)
                if plain is not None:
                    self._take_plain(plain)
                    return None
                data = _long_data_line(text)
                if data is not None:
                    self._accept(*data)
                    return None
            return self._take_frames(_frames(block, text), budget)
        finally:
            self._deliver()  # what was accepted before a failure counts too

    def _take_plain(self, plain: _PlainData) -> None:
        """Accept plain data lines: many at once when they simply continue the output."""
        if len(plain) > 1:
            seqs, streams, texts = zip(*plain)
            first = self.cursor + 1
            next_in_order = list(map(int, seqs)) == list(range(first, first + len(plain)))
            if next_in_order and streams.count(self._pending_stream) == len(plain):
                self._accept_run(texts)
                return
        for seq, stream, text in plain:
            self._accept(int(seq), stream, _plain_base64(text))

    def _accept_run(self, texts: Sequence[str]) -> None:
        """Accept the base64 of the next data frames of the stream in hand."""
        payloads: List[bytes] = []
        try:
            payloads.extend(map(_plain_base64, texts))
        finally:  # the frames before a bad one are accepted
            self._pending.extend(payloads)
            self.cursor += len(payloads)

    def _take_frames(self, frames: Iterator[Any], budget: _Budget) -> Optional[_Exit]:
        """Act on parsed frames one at a time; the exit status when one is the exit frame."""
        for frame in frames:
            if type(frame) is dict and frame.get("type") == "data":
                self._accept(*_data_frame(frame))
                continue
            self._deliver()
            status = self._take(frame, budget)
            if status is not None:
                return status
        return None

    def _take(self, frame: Any, budget: _Budget) -> Optional[_Exit]:
        """Act on a frame other than data; the exit status when it is the exit frame."""
        kind = _frame_type(frame)
        if kind == "heartbeat":
            budget.progress()
        elif kind == "exit":
            return self._exit_from_frame(frame)
        elif kind == "error":
            if frame.get("error") == "output_offset_expired":
                oldest = frame.get("oldest_available_seq")
                raise OutputEvictedError(
                    oldest if _is_int(oldest) else None, process_id=self.process_id
                )
            raise ProtocolError("the output stream reported an error")
        else:
            raise ProtocolError("an output frame has an unknown type")
        return None

    def _accept(self, seq: int, stream: str, payload: bytes) -> None:
        if seq <= self.cursor:
            return  # replayed overlap after a resume
        if seq != self.cursor + 1:
            raise ProtocolError(f"output seq jumped from {self.cursor} to {seq}")
        if stream != self._pending_stream:
            self._deliver()
            self._pending_stream = stream
        self._pending.append(payload)
        self.cursor = seq

    def _deliver(self) -> None:
        """Hand the accepted, not yet delivered output to the capture and on_output."""
        if not self._pending:
            return
        payload = b"".join(self._pending)  # one payload is joined without a copy
        self._pending.clear()
        self._output.feed(self._pending_stream, payload)

    def _exit_from_frame(self, frame: Dict[str, Any]) -> _Exit:
        status = _exit_status(frame)
        if status is not None:
            return status
        logger.info("Exit frame of %s has no status; asking the process record", self.process_id)
        problem = ProtocolError("the exit frame carries no exit status", process_id=self.process_id)
        try:
            record = self._wait("leader", _EXIT_CHECK_MS)
        except CreateOSError as exc:
            raise problem from exc
        status = _exit_status(record) if record is not None else None
        if status is None:
            raise problem
        self.exit_recovered = True
        return status

    def _check_interrupts(self) -> None:
        cancel = self._options.cancel
        if cancel is not None and cancel.is_set():
            raise CancelledError(process_id=self.process_id)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise _TimedOut()

    def _pause(self, delay: float) -> None:
        delay = _within(delay, self.deadline)
        cancel = self._options.cancel
        if cancel is not None:
            cancel.wait(delay)
        else:
            time.sleep(delay)
        self._check_interrupts()

    # -- recover: the exit status out of band --------------------------------

    def _recover(self, failure: _Retryable) -> _Exit:
        logger.info(
            "Output stream of %s kept failing; recovering its exit status out of band",
            self.process_id,
        )
        try:
            record = self._wait_for_tree()
            newest = _newest_seq(record)
            if newest < self.cursor:
                raise ProtocolError("the journal ends before output already read")
            if newest > self.cursor:
                # Output is missing: one bounded replay window to fetch it.
                self.reconnects += 1
                return self._read_stream(_Budget(self._client.retry))
            status = _exit_status(record)
        except (_Retryable, TransportError, APIError) as exc:
            self._check_interrupts()
            raise StreamEndedError(process_id=self.process_id) from exc
        if status is None:
            raise StreamEndedError(process_id=self.process_id) from failure
        self.exit_recovered = True
        logger.info("Recovered the exit status of %s out of band", self.process_id)
        return status

    def _wait_for_tree(self) -> Dict[str, Any]:
        """Long-poll until the whole tree has exited (or the deadline passes)."""
        while True:
            self._check_interrupts()
            poll = _within(_WAIT_POLL_MS / 1000, self.deadline)
            record = self._wait("tree", max(1, int(poll * 1000)))
            if record is not None:
                return record

    def _wait(self, scope: str, poll_ms: int) -> Optional[Dict[str, Any]]:
        """One `wait` long-poll: the exited process record, or None when it expired."""
        client = self._client
        response = client._call(
            "GET",
            self._path + "/wait",
            operation="exit status wait",
            deadline=self.deadline,
            process_id=self.process_id,
            read_timeout=poll_ms / 1000 + client.request_timeout,
            params={"scope": scope, "timeout_ms": poll_ms},
            ok_statuses=(408,),
        )
        if response.status_code == 408:
            response.close()
            return None
        record = _jsend_data(response, "exit status wait")
        if not isinstance(record, dict) or record.get("leader_exited") is not True:
            raise ProtocolError("the wait answer is not an exited process record")
        return record

    # -- contain: terminate the remote tree ----------------------------------

    def _terminate_and_drain(self) -> Optional[_Exit]:
        """After the deadline: terminate, reading what the grace period prints meanwhile.

        The reading starts while the DELETE is still waiting out the grace
        period: a service may forget a process once it is deleted.
        """
        termination = _Background(_terminate, self._client, self._sandbox_id, self.process_id)
        self.deadline = time.monotonic() + self._client.cleanup_timeout
        try:
            status: Optional[_Exit] = self._follow()
        except (_TimedOut, CreateOSError):
            logger.warning(
                "Output of %s printed after its timeout could not be read", self.process_id
            )
            status = None
        termination.join()
        return status

    def _contain_after(self, exc: BaseException) -> None:
        """Terminate the tree after `exc`; the caller re-raises it unless this raises."""
        if isinstance(exc, CreateOSError):
            exc.process_id = exc.process_id or self.process_id
            if exc.result is None and self.cursor > self._first_seq:
                exc.result = self._result(None, partial=True)
        try:
            _terminate(self._client, self._sandbox_id, self.process_id)
        except CleanupError as cleanup:
            if isinstance(exc, KeyboardInterrupt):
                return  # Ctrl-C is re-raised itself; the failure is logged
            cleanup.result = getattr(exc, "result", None)
            raise cleanup from exc
        if self._launch is not None and not isinstance(exc, KeyboardInterrupt):
            self._launch.unstage()


def _arriving(response: requests.Response) -> Iterator[bytes]:
    """The body as it arrives: HTTP chunk by HTTP chunk, or what the socket holds.

    Straight from urllib3 (requests' iter_content() adds a layer per chunk
    and would wait for the end of a body that is not chunked: a proxy may
    remove the chunking, and all live output would be held back).
    """
    raw = response.raw
    if raw.chunked or not hasattr(raw, "read1"):  # read1: urllib3 2.2 and later
        return raw.stream(None, decode_content=True)
    return iter(functools.partial(raw.read1, _READ_SIZE, decode_content=True), b"")


@contextlib.contextmanager
def _unblocked_by(cancel: Optional[threading.Event], response: requests.Response) -> Iterator[None]:
    """While reading `response`, let `cancel` end a read that is waiting for data.

    A quiet process sends nothing but heartbeats, whose interval is unknown:
    without this, cancelling could wait that long. Shutting the socket down
    wakes the blocked read; the reader then sees the cancel event.
    """
    if cancel is None:
        yield
        return
    done = threading.Event()
    watcher = threading.Thread(
        target=_shut_down_on, args=(cancel, done, response), name="createos_exec-cancel"
    )
    watcher.daemon = True
    watcher.start()
    try:
        yield
    finally:
        done.set()  # the watcher ends within one poll; nothing waits for it


def _shut_down_on(cancel: threading.Event, done: threading.Event, response: Any) -> None:
    while not done.is_set():
        if cancel.wait(_CANCEL_POLL):
            connection: Any = getattr(response.raw, "connection", None)
            with contextlib.suppress(OSError, AttributeError):
                connection.sock.shutdown(socket.SHUT_RDWR)
            return


class _Background:
    """A call running in a daemon thread; join() re-raises what it raised."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(function, args))
        self._thread.daemon = True
        self._thread.start()

    def _run(self, function: Callable[..., Any], args: Tuple[Any, ...]) -> None:
        try:
            function(*args)
        except BaseException as exc:  # handed over to join()
            self._error = exc

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _read_to_end(chunks: Iterator[bytes]) -> None:
    """Finish the body after the exit frame so the connection can be reused.

    Whatever follows the exit frame is ignored, and at most 64 KiB is read.
    """
    read = 0
    with contextlib.suppress(requests.RequestException, *_LOW_LEVEL_ERRORS):
        for chunk in chunks:
            read += len(chunk)
            if read > 65536:
                return


def _newest_seq(record: Dict[str, Any]) -> int:
    output = record.get("output")
    newest: Any = output.get("newest_seq") if isinstance(output, dict) else None
    if not _is_int(newest) or newest < 0:
        raise ProtocolError("the process record has no valid output.newest_seq")
    return int(newest)


def _evicted_seq(response: requests.Response) -> Optional[int]:
    """oldest_available_seq from a 410 body, when it has one."""
    try:
        data = response.json().get("data")
        oldest = data.get("oldest_available_seq")
    except (ValueError, AttributeError, RecursionError):
        return None
    finally:
        response.close()
    return oldest if _is_int(oldest) else None


def execute(
    sandbox_id: str,
    command: Command,
    *,
    client: Optional[Client] = None,
    **options: Any,
) -> ExecResult:
    """Client.execute() with a client built from the environment (or the one given)."""
    if client is not None:
        return client.execute(sandbox_id, command, **options)
    with Client() as own:
        return own.execute(sandbox_id, command, **options)


def echo(stream: str, text: str) -> None:
    """A ready `on_output`: print output live, stderr to stderr (terminals, notebooks)."""
    print(text, end="", file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

_EXAMPLES = """\
examples:
  python -m createos_exec sb_123 -- uname -a
  python -m createos_exec --timeout 600 --env CI=1 sb_123 -- make test
  python -m createos_exec --shell sb_123 -- 'cd /app && ls | wc -l'
  echo hello | python -m createos_exec --stdin - sb_123 -- cat
  python -m createos_exec --json sb_123 -- ls /    # one JSON object, for scripts

exit status: the remote exit code; 128+N when killed by signal N; 124 on
timeout; 130 after Ctrl-C (the remote tree is terminated first); 125 for
errors of this tool, the API or the connection.
The API key is read from $CREATEOS_API_KEY (or $CREATEOS_SANDBOX_API_KEY).
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m createos_exec",
        description="Run one command in a CreateOS sandbox, streaming its output.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--api-url", help="default: $CREATEOS_API_URL or " + DEFAULT_API_URL)
    parser.add_argument("--cwd", help="working directory of the command")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="extra environment variable (repeatable)",
    )
    parser.add_argument("--timeout", type=float, metavar="S", help="seconds for the command")
    parser.add_argument("--shell", action="store_true", help="COMMAND is one bash script string")
    parser.add_argument("--stdin", metavar="FILE|-", help="feed this file (- for our stdin)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="no live output; print the result (or the error) as one JSON object",
    )
    parser.add_argument("sandbox_id", metavar="SANDBOX_ID")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG...]")
    return parser


def _print_live(stream: str, text: str) -> None:
    """Write output through as the bytes it was (decoded with surrogateescape)."""
    out = sys.stdout if stream == "stdout" else sys.stderr
    binary = getattr(out, "buffer", None)
    if binary is None:
        out.write(text)
    else:
        out.flush()
        binary.write(text.encode("utf-8", "surrogateescape"))
        binary.flush()


def _cli_exit_code(result: ExecResult) -> int:
    if result.timed_out:
        return 124
    if result.signal is not None:
        number = _signal_number(result.signal)
        return 128 + number if number is not None else 125
    return int(result.exit_code if result.exit_code is not None else 125)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status (see --help)."""
    parser = _parser()
    options = parser.parse_args(argv)
    command, env = _command_and_env(parser, options)
    try:
        stdin = _read_stdin_option(options.stdin)
    except OSError:
        print("createos_exec: cannot read the --stdin file.", file=sys.stderr)
        return 125
    try:
        with Client(api_url=options.api_url) as client:
            result = client.execute(
                options.sandbox_id,
                command,
                shell=options.shell,
                cwd=options.cwd,
                env=env,
                stdin=stdin,
                timeout=options.timeout,
                on_output=None if options.json else _print_live,
                # Live output passes through byte-exact; JSON needs valid text.
                errors="replace" if options.json else "surrogateescape",
            )
    except KeyboardInterrupt:
        print("createos_exec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Our reader went away (`| head`): like a local pipeline, the command
        # was stopped. Later flushes of stdout must not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE, as a shell reports it
    except CreateOSError as exc:
        if options.json:
            error = {"type": type(exc).__name__, "message": str(exc), "process_id": exc.process_id}
            print(json.dumps({"error": error}))
        else:
            print(f"createos_exec: {exc}", file=sys.stderr)
        return 125
    if options.json:
        derived = {"output_truncated": result.output_truncated, "returncode": result.returncode}
        print(json.dumps(dict(dataclasses.asdict(result), **derived)))
    return _cli_exit_code(result)


def _command_and_env(
    parser: argparse.ArgumentParser, options: argparse.Namespace
) -> Tuple[Command, Optional[Dict[str, str]]]:
    command: List[str] = options.command
    if not command:
        parser.error("no command given (put it after --)")
    if options.shell and len(command) != 1:
        parser.error("with --shell, give the script as one argument")
    env = {}
    for item in options.env:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error("--env takes K=V")
        env[name] = value
    return (command[0] if options.shell else command), (env or None)


def _read_stdin_option(name: Optional[str]) -> Optional[bytes]:
    if name is None:
        return None
    if name == "-":
        return sys.stdin.buffer.read()
    with open(name, "rb") as handle:
        return handle.read()


if __name__ == "__main__":
    sys.exit(main())
