"""Run one command in a CreateOS sandbox and get its exit status, whatever the network does.

    import createos_exec as cx

    result = cx.execute("sb_123", ["python3", "-c", "print(6 * 7)"], timeout=60)
    print(result.exit_code, result.stdout)

    with cx.Client() as client:          # $CREATEOS_API_URL, $CREATEOS_API_KEY
        client.execute("sb_123", "make test", shell=True, check=True, on_output=cx.echo)
        with client.start("sb_123", ["python3", "-m", "http.server", "8000"]) as server:
            server.wait_for_port(8000)
            client.execute("sb_123", ["curl", "-s", "localhost:8000"])   # the server runs on
        print(server.wait().signal)      # leaving the block terminated it: SIGTERM
        build = client.start("sb_123", ["make", "all"])
        for stream, line in build.iter_output(lines=True):   # as it arrives
            print(stream, line, end="")
        again = client.process("sb_123", build.process_id)   # taken up later, by its id
        client.put("sb_123", "src/", "/app/src")             # a tree or a file, whole or not at all
        report = client.get("sb_123", "/app/report.html")    # bytes, checked by SHA-256
        tar = client.execute("sb_123", ["tar", "c", "out"], text=False).stdout   # bytes
        repl = client.start("sb_123", ["python3"], pty=True)   # a terminal: write() types
        client.execute("sb_123", ["make"], resume=True)      # a paused sandbox is resumed

A command runs as a CreateOS managed process. It is created exactly once; its
output is read from a replayable NDJSON stream that is resumed from the last
accepted sequence number whenever the connection breaks; when the stream cannot
deliver the exit status, it is recovered out of band; and on any failure the
remote process tree is terminated. start() returns a RemoteProcess at once, the
counterpart of subprocess.Popen; execute() is start(...).wait(), and
client.process() is a handle on a process started earlier. put() and get()
move files and directories in and out: streamed, checked by SHA-256 on both
sides, renamed into place only once whole, a large file in pieces that a cut
does not send again. forward() leads a port of this machine to one in
the sandbox, a tunnel per connection. When the sandbox itself is paused or gone, the
error says so (SandboxPausedError, SandboxGoneError), and resume=True goes on
where the run stopped.
`createos-exec --help` (or `python -m createos_exec --help`) is the command line;
with -t, a terminal session that survives the network.

Contents, in the order a call runs through them (each section opens with its contract):

     1. Public types: the result, the errors, the retry policy
     2. Entry points: the client, execute(), start(), process()
     3. The process: one object owns its run
     4. Following: the stream read to its end, resumed after every failure
     5. Launch: the plan, the staged secrets, one creation
     6. The service: what a sandbox and a process answer
     7. Files: put() and get(), whole or not at all
     8. The stream: bytes -> blocks of complete lines -> frames
     9. Capture: incremental decoders and bounded tails
    10. Transport: requests, retries, the one exception map
    11. Deadlines and pacing
    12. Configuration checks: the URL, the key, ids, numbers
    13. Sandbox-side scripts
    14. Port forwarding: a local listener, a tunnel per connection
    15. The command line, and its terminal sessions (-t)
"""

from __future__ import annotations

import argparse
import array
import binascii
import bisect
import codecs
import collections
import contextlib
import dataclasses
import datetime
import email.utils
import functools
import hashlib
import http.client
import inspect
import io
import ipaddress
import itertools
import json
import logging
import math
import os
import posixpath
import queue
import random
import re
import secrets
import selectors
import shutil
import signal as _signal
import socket
import ssl
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.parse
import warnings
import weakref
from typing import (
    TYPE_CHECKING,
    AbstractSet,
    Any,
    BinaryIO,
    Callable,
    Deque,
    Dict,
    Generator,
    Generic,
    Iterable,
    Iterator,
    List,
    Literal,
    Mapping,
    NamedTuple,
    NoReturn,
    Optional,
    Sequence,
    Set,
    Tuple,
    Type,
    TypedDict,
    TypeVar,
    Union,
    overload,
)

import requests
import urllib3

if sys.version_info >= (3, 11):
    from typing import Unpack  # novermin: the branch runs on 3.11 and later only
elif TYPE_CHECKING:
    from typing_extensions import Unpack
if TYPE_CHECKING:
    from typing_extensions import Required

try:
    import fcntl
except ImportError:  # Windows: each process paces its requests alone
    fcntl = None  # type: ignore[assignment]

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
    "FileInfo",
    "Forward",
    "InputUnconfirmedError",
    "OutputEvictedError",
    "OutputIncompleteError",
    "PIPE",
    "ProcessEndedError",
    "ProcessInfo",
    "ProtocolError",
    "RemoteProcess",
    "RetryPolicy",
    "SandboxError",
    "SandboxGoneError",
    "SandboxInfo",
    "SandboxPausedError",
    "StdinClosedError",
    "StreamEndedError",
    "TransferError",
    "TransportError",
    "WaitTimeout",
    "echo",
    "execute",
    "forward",
    "get",
    "main",
    "put",
    "start",
]

logger = logging.getLogger("createos_exec")

# on_output's type: (stream, text), or (stream, bytes) with text=False.
OutputCallback = Callable[[str, Any], Any]
Command = Union[str, Sequence[str]]
# put()'s source: a local path (a file or a directory), bytes-like, or a binary
# file object; get()'s destination: None (bytes returned), a local path, or a
# binary file object; their progress: (done_bytes, total_bytes or None).
FileSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]
FileDestination = Union[str, "os.PathLike[str]", BinaryIO]
ProgressCallback = Callable[[int, Optional[int]], Any]


class _Pipe:
    """The type of PIPE: a single value that pickles as itself."""

    def __repr__(self) -> str:
        return "createos_exec.PIPE"

    def __reduce__(self) -> str:
        return "PIPE"


# start(..., stdin=PIPE) keeps the process's stdin open for RemoteProcess.write().
PIPE = _Pipe()
Stdin = Union[str, bytes, None, _Pipe]


_T = TypeVar("_T")
# What the output is: str, or bytes with text=False. Type checkers see str as its
# default, so that a bare ExecResult or RemoteProcess in users' code means text.
if TYPE_CHECKING:
    from typing_extensions import TypeVar as _DefaultedTypeVar

    _AnyStr = _DefaultedTypeVar("_AnyStr", str, bytes, default=str)
else:
    _AnyStr = TypeVar("_AnyStr", str, bytes)

# The numbers a reader may want to change, in one place.
_FRAME_LIMIT = 1024 * 1024  # longest NDJSON line accepted, in bytes
_READ_SIZE = 256 * 1024  # most bytes taken at once from a body that is not chunked
_TERMINATE_GRACE = 1.0  # seconds between SIGTERM and SIGKILL when terminating
_CANCEL_POLL = 0.1  # seconds between looks at the cancel event while a read blocks
_EXIT_CHECK_MS = 5_000  # how long an exit frame without status is checked against `wait`
_LIVENESS_POLL_MS = 1_000  # the `wait` that tells a quiet process from an exited one
_KILLED_POLL_MS = 2_000  # the `wait` for the leader's end after kill()'s SIGKILL
_GRACE_CONNECT = 2.0  # seconds the stream may take to open before a DELETE is sent anyway
_LISTING_PAGE_SIZE = 500  # the most the service's paginated lists hold in a page
_LISTING_PAGES = 20  # pages of the process listing read at most: 10,000 processes
_RESUME_POLL = 0.25  # seconds before the first look at a resuming sandbox; it doubles
_RESUME_POLL_MAX = 2.0  # seconds between looks at most (a resume takes 10-13 s)
# The spool (design item 19): what a stream's spool keeps at most (its first bytes),
# the output under which both spools are dropped at their end (the ~1 MiB journal,
# counted raw or in base64, keeps it all), what one read of it brings of each stream,
# and the pauses between reads of a spool that has nothing new (they double).
_SPOOL_LIMIT = 256 * 1024 * 1024
_SPOOL_KEPT_FROM = 512 * 1024
_SPOOL_PIECE = 1024 * 1024
_SPOOL_POLL = 0.05
_SPOOL_POLL_MAX = 1.0


# ==========================================================================
# 1. Public types: the result, the errors, the retry policy
# ==========================================================================
#
# What a caller holds. ExecResult is how a run ended; every error is a
# CreateOSError that carries the process id and, where output had arrived,
# the partial result. Messages are fixed sentences built from attributes,
# never from a response body, the key or command output; every error
# survives a pickle. RetryPolicy is frozen data.


@dataclasses.dataclass(frozen=True, repr=False)
class ExecResult(Generic[_AnyStr]):
    """How a remote command ended, and the tail of what it printed.

    `stdout` and `stderr` each keep their last `max_output_chars` characters
    (bytes with text=False, as ExecResult[bytes]); `output` keeps the last
    `max_output_chars` of both, interleaved by sequence number: the order
    CreateOS received them from the two pipes.
    """

    args: Any
    exit_code: Optional[int]
    signal: Optional[str]
    timed_out: bool
    stdout: _AnyStr
    stderr: _AnyStr
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    process_id: Optional[str] = None
    reconnects: int = 0
    exit_recovered: bool = False
    creation_recovered: bool = False
    duration: float = 0.0
    output: _AnyStr = ""  # type: ignore[assignment]  # a result built by hand is text
    combined_truncated: bool = False
    output_evicted: bool = False

    @property
    def output_truncated(self) -> bool:
        """The head of stdout, stderr or `output` was dropped to respect the cap."""
        return self.stdout_truncated or self.stderr_truncated or self.combined_truncated

    @property
    def returncode(self) -> Optional[int]:
        """subprocess convention: the exit code, or minus the signal number."""
        return _returncode(self.exit_code, self.signal)

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
        unit = "chars" if isinstance(self.stdout, str) else "bytes"
        return (
            f"ExecResult(args={self.args!r}, exit_code={self.exit_code!r}, "
            f"signal={self.signal!r}, timed_out={self.timed_out!r}, "
            f"stdout=<{len(self.stdout)} {unit}>, stderr=<{len(self.stderr)} {unit}>, "
            f"output=<{len(self.output)} {unit}>, "
            f"process_id={self.process_id!r}, reconnects={self.reconnects!r})"
        )


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """A managed process of a sandbox, as Client.processes() lists it.

    `args` is the command as it was given, for a process createos_exec
    started (`ours`): its argv, or the shell=True script; otherwise the
    listed `cmd` and `args`. `state` is "running" or "exited" (its leader).
    `pid` is the leader's pid in the sandbox (None when the record shows none).
    """

    process_id: str
    args: Any
    state: str
    exit_code: Optional[int]
    signal: Optional[str]
    ours: bool
    pid: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """A file as it stands after put() or get(): its path (in the sandbox for
    put(), on this machine for get()), its size in bytes and the hex SHA-256
    of its content, which both sides computed alike. For a directory (a tree),
    `files` counts its regular files, `size` their bytes, and `sha256` is that
    of its manifest: every entry's path, type, mode, and size and SHA-256 (or
    a symlink's target), as both sides listed them; `files` is None for a file."""

    path: str
    size: int
    sha256: str
    files: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as its view shows it (Client.sandbox()): `status` is the service's
    word ("running", "paused", "destroyed"... or one new to this client);
    `running` says whether its processes run, exec and files are served."""

    sandbox_id: str
    status: str
    running: bool


def _returncode(exit_code: Optional[int], signal: Optional[str]) -> Optional[int]:
    if signal is not None:
        number = _signal_number(signal)
        return -number if number is not None else None
    return exit_code


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
        result: Optional[ExecResult[Any]] = None,
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
        advice = _advice(status, operation)
        super().__init__(
            f"CreateOS answered HTTP {status} to {operation}" + (f": {advice}." if advice else "."),
            process_id=process_id,
        )


# What a refusal means and what to do about it, by status. The operations
# that name a sandbox, not a process, give 404 a meaning of their own.
_ADVICE = {
    400: "the request was refused as invalid (an option this sandbox does not accept?)",
    401: "the API key was refused; check CREATEOS_API_KEY",
    402: "the account needs a payment method or more credit",
    403: "the API key was refused for this (another account's sandbox, or a spent quota)",
    404: (
        "no such process in this sandbox (a wrong id, a sandbox in another region, "
        "or a process the service no longer keeps)"
    ),
    408: "the service gave up waiting; try again",
    409: "the sandbox is not running (paused or stopped?); resume it first",
    422: "the request was refused as invalid (an option this sandbox does not accept?)",
    429: (
        "too many requests from this IP address; try again later, and give each program "
        "that shares the address a lower rate limit"
    ),
}
_SANDBOX_OPERATIONS = (
    "process creation",
    "staging of env and stdin",
    "process listing",
    "sandbox lookup",
)
# The operations of put() and get(), each followed by the file's path.
_OF_A_FILE = ("upload of ", "download of ", "check of ", "creation of the directory of ")
_NO_SANDBOX = "no sandbox with this id here (a wrong id, or a sandbox in another region)"
_AFTER_RESUME = "process lookup after the sandbox's resume"
_TUNNEL_TO = "tunnel to port "  # forward()'s operation, its port after it
_LOST_IN_PAUSE = (
    "the service lost the process across the sandbox's pause; what it printed after "
    ".result, and how it ended, are unknown"
)


def _advice(status: int, operation: str) -> str:
    """The sentence that says what a status means for an operation ("" when none fits)."""
    if status == 404 and (operation in _SANDBOX_OPERATIONS or operation.startswith(_OF_A_FILE)):
        return _NO_SANDBOX
    if status == 404 and operation == _AFTER_RESUME:
        return _LOST_IN_PAUSE
    if 300 <= status < 400:
        return "a redirect was refused (a proxy in between, or a wrong API URL?)"
    if status >= 500:
        return "CreateOS is in trouble; try again later"
    return _ADVICE.get(status, "")


class TransportError(CreateOSError):
    """CreateOS could not be reached within the retry policy."""

    def __init__(
        self,
        operation: str,
        *,
        process_id: Optional[str] = None,
        address: Optional[str] = None,
        reason: Optional[str] = None,
    ) -> None:
        self.operation = operation
        self.address = address  # "host:port" of the API URL
        self.reason = reason  # a key of _UNREACHABLE: "dns", "refused", "tls", "timeout", ...
        what, advice = _UNREACHABLE.get(reason or "", _UNREACHABLE[""])
        where = f" at {address}" if address else ""
        started = " No process was started." if operation in _BEFORE_THE_PROCESS else ""
        super().__init__(
            f"CreateOS could not be reached{where} for {operation}: {what}.{started} {advice}.",
            process_id=process_id,
        )


# Why the API could not be reached, and what to look at, by TransportError.reason.
_UNREACHABLE = {
    "dns": ("the host name could not be resolved (DNS)", "Check the host in the API URL"),
    "refused": (
        "the connection was refused",
        "Check the port in the API URL, and that the service listens there",
    ),
    "tls": (
        "the TLS handshake failed",
        "A proxy that intercepts TLS needs its CA bundle: set REQUESTS_CA_BUNDLE to its file",
    ),
    "timeout": (
        "the connection timed out",
        "Check the network, a proxy or a firewall on the way, then try again",
    ),
    "reset": ("the connection was reset", "Check the network or a proxy, then try again"),
    "": ("the connection failed", "Check the API URL and the network, then try again"),
}
_BEFORE_THE_PROCESS = ("staging of env and stdin", "process creation")


class StreamEndedError(TransportError):
    """The output stream kept failing and the exit status could not be recovered."""

    def __init__(self, *, process_id: Optional[str] = None) -> None:
        super().__init__("output connection", process_id=process_id)
        self.args = ("CreateOS process stream ended without an exit status.",)


class OutputIncompleteError(StreamEndedError):
    """The exit status is known, but the output after the cursor could not be read."""

    def __init__(
        self, *, process_id: Optional[str] = None, result: Optional[ExecResult[Any]] = None
    ) -> None:
        super().__init__(process_id=process_id)
        self.result = result
        self.args = (
            "The command ended with a known exit status, but its output could not be "
            "read in full from CreateOS; .result holds the status and the output received.",
        )


class ProtocolError(CreateOSError):
    """CreateOS sent something this client does not understand; it fails closed."""

    def __init__(self, problem: str, *, process_id: Optional[str] = None) -> None:
        self.problem = problem
        super().__init__(
            f"CreateOS sent an invalid answer: {problem}. Nothing was guessed; a proxy that "
            "rewrites or buffers answers is a common cause.",
            process_id=process_id,
        )


class OutputEvictedError(ProtocolError):
    """Output not read yet was evicted from the journal, and the spool could not give it back."""

    def __init__(
        self,
        oldest_available_seq: Optional[int],
        *,
        process_id: Optional[str] = None,
        spool: Optional[str] = None,
        held: Optional[Mapping[str, int]] = None,
        limit: int = 0,
    ) -> None:
        self.oldest_available_seq = oldest_available_seq
        # Why the spool did not give it back: "gone" (removed, or never written),
        # "full" (past its limit), or None (the process has no spool read here).
        self.spool = spool
        CreateOSError.__init__(
            self,
            "Output this client had not read yet was evicted from the CreateOS journal"
            f"{_spool_loss(spool, held or {}, limit)}; print less, or write large output "
            "to a file in the sandbox and fetch that: get(sandbox_id, '/tmp/out.log', "
            "'out.log'), or on the command line --get /tmp/out.log:out.log with "
            "'> /tmp/out.log' in the command.",
            process_id=process_id,
        )
        self.problem = "output evicted"


def _spool_loss(spool: Optional[str], held: Mapping[str, int], limit: int) -> str:
    """What the spool could not give back, and from where, for OutputEvictedError."""
    if spool == "full":
        return (
            f", and its spool in the sandbox keeps the first {limit:,} bytes of each stream: "
            "what the command printed past that is lost"
        )
    if spool == "gone":
        return (
            ", and its spool in the sandbox is gone (removed, /tmp not writable, or no tee "
            f"there): what the command printed after byte {held.get('stdout', 0)} of "
            f"stdout or byte {held.get('stderr', 0)} of stderr may be lost"
        )
    return ""


class CleanupError(CreateOSError):
    """The remote process may still exist: take it up again, or destroy the sandbox."""

    # `unreachable`: the API could not be reached to terminate it. The process
    # is then known and may simply run on: `.sandbox_id`, `.process_id` and
    # `.after` (the cursor) say how to take it up again once the API answers.

    def __init__(
        self,
        *,
        process_id: Optional[str] = None,
        creation_unconfirmed: bool = False,
        sandbox_id: Optional[str] = None,
        unreachable: bool = False,
    ) -> None:
        super().__init__("", process_id=process_id)
        self.creation_unconfirmed = creation_unconfirmed
        self.sandbox_id = sandbox_id
        self.unreachable = unreachable
        self.after: Optional[int] = None
        self.args = (str(self),)

    def __str__(self) -> str:
        if self.creation_unconfirmed:
            return (
                "Process creation could not be confirmed: the process may run unseen; destroy "
                "the sandbox (or audit its processes) before reusing it."
            )
        if self.unreachable and self.process_id and self.sandbox_id:
            return (
                f"CreateOS could not be reached to terminate process {self.process_id}: it "
                "may still run. Once the API answers, "
                f"client.process({self.sandbox_id!r}, {self.process_id!r}, "
                f"after={self.after or 0}) takes it up again: wait() for the rest of its "
                "output, or terminate()."
            )
        of = f" of {self.process_id}" if self.process_id else ""
        return (
            f"Termination of the remote process tree{of} could not be confirmed: it may "
            "still run; destroy the sandbox before reusing it."
        )


class CancelledError(CreateOSError):
    """The cancel event was set; the remote process tree was terminated, or never created."""

    def __init__(self, *, process_id: Optional[str] = None, created: bool = True) -> None:
        super().__init__(
            "The command was cancelled and its remote process tree terminated."
            if created
            else "The command was cancelled before its process was created: nothing was created.",
            process_id=process_id,
        )


class CommandError(CreateOSError, subprocess.CalledProcessError):
    """check=True and the command did not exit 0 (including timeout and signal)."""

    def __init__(self, result: ExecResult[Any], *, timeout: Optional[float] = None) -> None:
        who = _command_named(result.args, result.process_id)
        if result.timed_out:
            after = f" after {timeout:g} s" if timeout is not None else ""
            ended = f"timed out{after} and its remote process tree was terminated"
        else:
            ended = _how_it_ended(result)
        message = f"{who} {ended}; what it printed is in .stderr and .stdout."
        super().__init__(message, process_id=result.process_id, result=result)
        self.timeout = timeout  # the run's `timeout=`, when it is known
        # The attributes of subprocess.CalledProcessError, set by hand so that
        # its __init__ does not put the output into args.
        # None when the command timed out and then exited by itself.
        self.returncode = result.returncode  # type: ignore[assignment]
        self.cmd = result.args
        self.output = result.stdout
        self.stderr = result.stderr


def _command_named(args: Any, process_id: Optional[str]) -> str:
    """ "The command 'make' (process proc_1)": its program, as subprocess names a command.

    Only the program (the first argument, or the string given): the other
    arguments may carry secrets. A long script is cut to its start.
    """
    program = args if isinstance(args, str) else None
    if isinstance(args, (list, tuple)) and args and isinstance(args[0], str):
        program = args[0]
    who = "The command" if program is None else f"The command {_shown(program)}"
    return who + (f" (process {process_id})" if process_id else "")


def _shown(value: Any, limit: int = 60) -> str:
    """A value of the caller's as a message shows it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class WaitTimeout(CreateOSError, subprocess.TimeoutExpired):
    """A wait's timeout (wait, iter_output, wait_for_port) passed; the command goes on running."""

    def __init__(
        self,
        args: Any,
        timeout: float,
        *,
        process_id: Optional[str] = None,
        output: Union[str, bytes, None] = None,
        stderr: Union[str, bytes, None] = None,
        port: Optional[int] = None,
    ) -> None:
        waited = (
            f"The wait ended after {timeout:g} seconds"
            if port is None
            else f"Port {port} did not accept a connection within {timeout:g} s"
        )
        super().__init__(f"{waited}; the command goes on running.", process_id=process_id)
        # The attributes of subprocess.TimeoutExpired, set by hand (see CommandError).
        self.cmd = args
        self.timeout = timeout
        self.output = output  # stdout read so far, where subprocess puts it
        self.stderr = stderr  # type: ignore[assignment]


class StdinClosedError(CreateOSError, BrokenPipeError):
    """write() after close_stdin() or after the process ended: a broken pipe, as locally."""

    def __init__(self, *, process_id: Optional[str] = None) -> None:
        super().__init__(
            "The process's stdin is closed (by close_stdin(), or the process ended); "
            "nothing was written.",
            process_id=process_id,
        )


class InputUnconfirmedError(TransportError):
    """A write to stdin stopped before all of it was confirmed; nothing is sent twice."""

    # `confirmed_bytes` of this write() are known to have arrived. Where the
    # answer to a piece was lost after it left (a broken connection, a 5xx, a
    # timeout), that piece may or may not have reached the process and is
    # never sent again. Where `unsent`, the rest certainly did not leave: the
    # API could not be reached, or kept answering 429, within the retry policy.

    def __init__(
        self, confirmed_bytes: int, *, unsent: bool = False, process_id: Optional[str] = None
    ) -> None:
        super().__init__("stdin write", process_id=process_id)
        self.confirmed_bytes = confirmed_bytes
        self.unsent = unsent
        if unsent:
            message = (
                f"CreateOS could not be reached to write to the process's stdin: "
                f"{confirmed_bytes} bytes of this write arrived, the rest was not sent."
            )
        else:
            message = (
                f"The answer to a write to the process's stdin was lost: {confirmed_bytes} "
                f"bytes of this write are confirmed, the next piece may or may not have "
                f"arrived, and nothing is sent again."
            )
        self.args = (message,)


class ProcessEndedError(CreateOSError):
    """wait_for_port(): the process ended before the port opened; `.result` is its result."""

    def __init__(
        self,
        port: Optional[int] = None,
        *,
        process_id: Optional[str] = None,
        result: Optional[ExecResult[Any]] = None,
    ) -> None:
        the_port = "the port" if port is None else f"port {port}"
        message = f"The process ended before {the_port} accepted a connection."
        if result is not None:
            message = (
                f"The process {_how_it_ended(result)} before {the_port} accepted a "
                "connection; what it printed is in .result.stderr and .result.stdout."
            )
        super().__init__(message, process_id=process_id, result=result)


class TransferError(CreateOSError):
    """put() or get() could not move the file whole: the destination is left as it was."""

    def __init__(
        self, path: str, reason: str, *, size: Optional[int] = None, local: Optional[str] = None
    ) -> None:
        self.path = path  # the file in the sandbox
        self.reason = reason  # a key of _TRANSFER_FAILURES
        self.size = size  # of "too_large": the bytes of the request refused, when known
        self.local = local  # of "source_changed": the local file
        what = "it" if size is None else f"{size:,} bytes in one request"
        said = _TRANSFER_FAILURES[reason].format(what=what, local=_shown(local or "", 200))
        super().__init__(f"The file {_shown(path, 200)} in the sandbox: {said}.")


# Why a transfer failed, by TransferError.reason: what happened, and what was left.
_TRANSFER_FAILURES = {
    "mismatch": (
        "what arrived differs from what was sent (size or SHA-256); the destination "
        "was left as it was"
    ),
    "too_large": (
        "the service refused {what} as too large (HTTP 413); the destination was left as it was"
    ),
    "over_cap": (
        "it is larger than max_bytes; pass destination= (a local path or a binary file) "
        "to stream it to disk"
    ),
    "missing": "no such file",
    "not_a_file": (
        "it is a directory or not a regular file (a directory comes into a local path, "
        "and with its tools there: tar and find)"
    ),
    "unreadable": "the sandbox cannot read it (permissions?)",
    "no_tools": (
        "the sandbox cannot check it: bash and sha256sum (coreutils) are needed there, "
        "and for a directory tar and find too; nothing was renamed"
    ),
    "no_parent": "its parent directory could not be created (a file in the way, or permissions?)",
    "not_renamed": (
        "it arrived whole but could not be moved into place (permissions, or something of "
        "another kind in the way: a directory for a file, a file for a directory?); the "
        "destination was left as it was"
    ),
    "changed": (
        "it changed while it was read (its size or modification time moved); nothing was "
        "renamed: fetch it again once it is written"
    ),
    "source_changed": (
        "its source {local} changed while it was read (its size or modification time "
        "moved); nothing was renamed: send it again once it is written"
    ),
    "special": (
        "it holds something other than files, directories and symlinks (a device, FIFO "
        "or socket), which is not copied; nothing was renamed"
    ),
    "vanished": (
        "its temporary copy disappeared before it could be checked; the destination "
        "was left as it was"
    ),
}


class SandboxError(APIError):
    """The sandbox itself is not running: what happened to it, not to the process."""

    # `.sandbox_status` is the service's word for it ("not found" when it
    # answered 404); `.status` and `.operation` are those of the answer that
    # made the client look at the sandbox (0 after a stream that could not be
    # resumed). The message is built from these, and from `.after` (the
    # cursor) where there is a process to take up again.

    def __init__(
        self,
        sandbox_id: str,
        sandbox_status: str,
        *,
        status: int,
        operation: str,
        process_id: Optional[str] = None,
        after: Optional[int] = None,
    ) -> None:
        super().__init__(status, operation, process_id=process_id)
        self.sandbox_id = sandbox_id
        self.sandbox_status = sandbox_status
        self.after = after
        self.args = (str(self),)

    def __str__(self) -> str:
        sandbox = self.sandbox_id
        if self.process_id is None:
            return f"The sandbox {sandbox} {self._is()}: it does not run."
        # A state new to this client: the process may run on, frozen or lost.
        return (
            f"The sandbox {sandbox} {self._is()}: process {self.process_id} was not "
            f"terminated and is no longer followed. Look at the sandbox (client.sandbox("
            f"{sandbox!r})); once it runs, take the process up again with client.process("
            f"{sandbox!r}, {self.process_id!r}, after={self.after or 0}).wait()."
        )

    def _is(self) -> str:
        return _sandbox_is(self.sandbox_status)

    def _no_tunnel(self, advice: str) -> str:
        """forward()'s: the tunnel (its operation names the port) and what to do."""
        return f"The sandbox {self.sandbox_id} {self._is()}: no {self.operation}; {advice}."


class SandboxPausedError(SandboxError):
    """The sandbox is paused: the process is frozen with it, not ended; `.after` is the cursor."""

    def __str__(self) -> str:
        sandbox = self.sandbox_id
        if self.operation.startswith(_TUNNEL_TO):
            return self._no_tunnel("resume it, then forward again")
        if self.process_id is None:
            return (
                f"The sandbox {sandbox} {self._is()}: no process was started. Resume it "
                f"(client.resume({sandbox!r})) and run the command again, or pass resume=True."
            )
        return (
            f"The sandbox {sandbox} {self._is()}: process {self.process_id} is frozen with "
            "it, not ended, and nothing was terminated. Resume the sandbox "
            f"(client.resume({sandbox!r})), then take the process up again with "
            f"client.process({sandbox!r}, {self.process_id!r}, after={self.after or 0}).wait(); "
            "or pass resume=True."
        )


class SandboxGoneError(SandboxError):
    """The sandbox is destroyed, failed or unknown: its processes went with it."""

    def __str__(self) -> str:
        if self.operation.startswith(_TUNNEL_TO):
            return self._no_tunnel("check the sandbox id, or forward to another sandbox")
        return f"The sandbox {self.sandbox_id} {self._is()}: {_GONE_ADVICE[self._unknown()]}."

    def _unknown(self) -> bool:
        return self.sandbox_status == "not found"


def _taken_up_at(
    error: Union[CleanupError, SandboxError], process_id: Optional[str], after: Optional[int]
) -> None:
    """Name the process and the cursor to take it up at in an error made before
    they were known: its message names them, and so must its args, which
    repr() and logging show."""
    error.process_id, error.after = process_id, after
    error.args = (str(error),)


# The sandbox's statuses (docs/protocol.md 4): those on the way to running,
# waited out within a run's deadline; those in which its processes are frozen
# (the first of them too, past the deadline); those in which they are gone;
# and every word this client knows.
_SANDBOX_ON_THE_WAY = ("creating", "resuming", "forking")
_SANDBOX_PAUSED = ("pausing", "paused") + _SANDBOX_ON_THE_WAY
_SANDBOX_GONE = ("destroying", "destroyed", "failed", "error", "not found")
_SANDBOX_STATUSES = ("running",) + _SANDBOX_PAUSED + _SANDBOX_GONE


# What a sandbox gone means, and what to do: one that was there (False), one not found (True).
_GONE_ADVICE = {
    False: "its processes went with it, and nothing of this run is left running. Run the "
    "command in another sandbox",
    True: "nothing of this run runs there. Check the sandbox id, or run the command in "
    "another sandbox",
}


def _not_running(word: str) -> Optional[Type[SandboxError]]:
    """The error of a sandbox whose status is `word`: None while it runs; a word
    new to this client is a SandboxError of its own (tolerated, never taken for
    running: the run is neither followed on nor terminated into it)."""
    if word == "running":
        return None
    if word in _SANDBOX_PAUSED:
        return SandboxPausedError
    return SandboxGoneError if word in _SANDBOX_GONE else SandboxError


def _sandbox_is(word: str) -> str:
    """The sandbox's status in a sentence ("is paused", "was not found"...); a word
    new to this client is not repeated: it comes from a response."""
    if word == "not found":
        return "was not found (a wrong id, another region's, or one destroyed)"
    return f"is {word}" if word in _SANDBOX_STATUSES else "is in a state this client does not know"


def _how_it_ended(result: ExecResult[Any]) -> str:
    if result.timed_out:
        return "timed out"
    if result.signal is not None:
        return f"was killed by {result.signal}"
    return f"exited with status {result.exit_code}"


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


# ==========================================================================
# 2. Entry points: the client, execute(), start(), process()
# ==========================================================================
#
# Every keyword of a run is written once, typed, in _RunKeywords (with its
# default and its check in _Options) and checked before any request is sent;
# `text` and `on_output`, whose types follow from the output being str or
# bytes, are written once per kind (_TextOutput, _BytesOutput, _EitherOutput),
# on which the overloads of each entry point key.
# start() plans the run, launches it and hands it to a RemoteProcess;
# execute() is start(...).wait(); process() and attach() take up a process
# started elsewhere. The module-level functions build a client from the
# environment.
#
# At some 850 lines it is one section on purpose: the keywords and every entry
# point that takes them (the client's methods, the module's functions, their
# overloads for str and bytes) are one contract, the API a user calls, which
# a reader checks against docs/design.md in one place.


class _FollowKeywords(TypedDict, total=False):
    """The keywords of a run that follows a process: those of process() and attach(),
    with `text` and `on_output` from one of the kinds of output below."""

    timeout: Optional[float]
    check: bool
    max_output_chars: int
    encoding: str
    errors: str
    cancel: Optional[threading.Event]
    resume: bool


class _RunKeywords(_FollowKeywords, total=False):
    """The keywords of a run that creates its process too: those of execute() and
    start(), cx.execute() and cx.start(). A new keyword is a line here (its type,
    as users' type checkers see it) and a field of _Options (its default and
    its check)."""

    shell: bool
    cwd: Optional[str]
    env: Optional[Dict[str, str]]
    stdin: Stdin
    input: Union[str, bytes, None]
    capture_output: Literal[True]  # subprocess's; output is always captured
    stdout: Optional[int]  # subprocess.PIPE or None: captured all the same
    stderr: Optional[int]  # also subprocess.STDOUT: merged into stdout
    pty: Union[bool, Tuple[int, int], None]  # True or (rows, cols): on a terminal


class _TextOutput(TypedDict, total=False):
    """Text mode, the default: the output is decoded to str."""

    text: Literal[True]
    on_output: Optional[Callable[[str, str], Any]]


class _BytesOutput(TypedDict, total=False):
    """text=False, as subprocess's: the output is the bytes the process wrote."""

    text: Required[Literal[False]]
    on_output: Optional[Callable[[str, bytes], Any]]


class _EitherOutput(TypedDict, total=False):
    """`text` known only when the program runs: on_output must take either."""

    text: bool
    on_output: Optional[Callable[[str, Union[str, bytes]], Any]]


# The keywords of each entry point for each kind of output, as its overloads take them.
class _TextFollow(_FollowKeywords, _TextOutput): ...


class _BytesFollow(_FollowKeywords, _BytesOutput): ...


class _AnyFollow(_FollowKeywords, _EitherOutput): ...


class _TextRun(_RunKeywords, _TextOutput): ...


class _BytesRun(_RunKeywords, _BytesOutput): ...


class _AnyRun(_RunKeywords, _EitherOutput): ...


_RUN_KEYWORDS = frozenset(_AnyRun.__annotations__)
_FOLLOW_KEYWORDS = frozenset(_AnyFollow.__annotations__)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The keywords of a run (_RunKeywords) with their defaults, checked when built.

    The signatures that help() shows name these defaults (see _shows).
    """

    shell: bool = False
    cwd: Optional[str] = None
    env: Optional[Dict[str, str]] = None
    stdin: Stdin = None
    input: Union[str, bytes, None] = None
    timeout: Optional[float] = None
    on_output: Optional[OutputCallback] = None
    check: bool = False
    max_output_chars: int = 4 * 1024 * 1024
    encoding: str = "utf-8"
    errors: str = "replace"
    cancel: Optional[threading.Event] = None
    resume: bool = False
    capture_output: bool = True
    text: bool = True
    stdout: Optional[int] = None
    stderr: Optional[int] = None
    pty: Union[bool, Tuple[int, int], None] = None  # checked: None or (rows, cols)
    # The keywords the call gave (not a field): with text=False, an encoding= or
    # errors= given at all is refused, as subprocess would take either for text mode.
    given: dataclasses.InitVar[AbstractSet[str]] = frozenset()

    def __post_init__(self, given: AbstractSet[str]) -> None:
        if self.stdin is not None:
            object.__setattr__(self, "stdin", _ported_stdin(self.stdin))
        if (self.stdout, self.stderr) != (None, None):
            _check_ported("stdout", self.stdout, (subprocess.PIPE,))
            _check_ported("stderr", self.stderr, (subprocess.PIPE, subprocess.STDOUT))
        if self.timeout is not None:
            _positive_seconds("timeout", self.timeout)
        if self.env is not None and not isinstance(self.env, dict):
            raise ConfigError("env must be a dict of str to str.")
        if self.stdin is not None and self.input is not None:
            raise ConfigError("Give the stdin data once: stdin= or input= (its subprocess name).")
        if not self.capture_output:
            raise ConfigError("Output is always captured: capture_output can only be True.")
        if not isinstance(self.text, bool):
            raise ConfigError(f"text must be True or False, not {_shown(self.text)}.")
        if not self.text:
            self._check_bytes_mode(given)
        if self.on_output is not None and not callable(self.on_output):
            raise ConfigError("on_output must be callable.")
        if not _is_int(self.max_output_chars) or self.max_output_chars < 0:
            raise ConfigError("max_output_chars must be an integer >= 0.")
        try:
            codecs.getincrementaldecoder(self.encoding)
            codecs.lookup_error(self.errors)
        except (LookupError, TypeError):
            raise _codec_error(self.encoding, self.errors) from None
        if self.cancel is not None and not callable(getattr(self.cancel, "is_set", None)):
            raise ConfigError("cancel must be a threading.Event.")
        if self.pty is not None:
            object.__setattr__(self, "pty", _terminal_size(self.pty))
        if self.pty is not None and (self.input is not None or self.stdin not in (None, PIPE)):
            raise ConfigError(
                "A terminal's input is typed: start(..., pty=...) takes no stdin data; "
                "write() it once started."
            )
        if not isinstance(self.resume, bool):
            raise ConfigError("resume must be True or False.")

    def _check_bytes_mode(self, given: AbstractSet[str]) -> None:
        """text=False: bytes in and out, as in subprocess's binary mode; nothing is decoded."""
        if {"encoding", "errors"} & given:
            raise ConfigError(
                "text=False gives the bytes the process wrote, decoded by nothing: "
                "encoding and errors are for text mode only."
            )
        if isinstance(self.stdin, str) or isinstance(self.input, str):
            raise ConfigError(
                "With text=False, stdin data is bytes (as subprocess's binary mode): "
                "pass input=data.encode()."
            )


_F = TypeVar("_F", bound=Callable[..., Any])


def _shows(keywords: Any) -> Callable[[_F], _F]:
    """Show each of the `keywords` (a TypedDict of them) with its default in the
    signature that help() and inspect give, in place of **options."""

    def show(function: _F) -> _F:
        signature = inspect.signature(function)
        own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        types = keywords.__annotations__
        shown = [
            inspect.Parameter(
                field.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=field.default,
                annotation=getattr(types[field.name], "__forward_arg__", types[field.name]),
            )
            for field in dataclasses.fields(_Options)
            if field.name in types
        ]
        function.__signature__ = signature.replace(parameters=own + shown)  # type: ignore[attr-defined]
        return function

    return show


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
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError("retry must be a RetryPolicy.")
        if session is not None and not isinstance(session, requests.Session):
            raise ConfigError("session must be a requests.Session.")
        pacing = _rate_limit(rate_limit)
        parts = urllib.parse.urlsplit(base)
        limiter = (
            _RateLimiter.for_origin(f"{parts.scheme}://{parts.netloc}", *pacing) if pacing else None
        )
        used = session if session is not None else _new_session()
        self._own_session = None if used is session else used  # we close only our own
        self._transport = _Transport(
            base,
            key,
            used,
            limiter,
            request_timeout=_positive_seconds("request_timeout", request_timeout),
            stream_idle_timeout=_positive_seconds("stream_idle_timeout", stream_idle_timeout),
            cleanup_timeout=_positive_seconds("cleanup_timeout", cleanup_timeout),
            retry=retry or RetryPolicy(),
        )

    @property
    def api_url(self) -> str:
        return self._transport.base

    @property
    def retry(self) -> RetryPolicy:
        return self._transport.retry

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

    @overload
    def execute(
        self, sandbox_id: str, command: Command, **options: Unpack[_TextRun]
    ) -> ExecResult[str]: ...
    @overload
    def execute(
        self, sandbox_id: str, command: Command, **options: Unpack[_BytesRun]
    ) -> ExecResult[bytes]: ...
    @overload
    def execute(
        self, sandbox_id: str, command: Command, **options: Unpack[_AnyRun]
    ) -> ExecResult[Any]: ...
    @_shows(_AnyRun)
    def execute(self, sandbox_id: str, command: Command, **options: Any) -> ExecResult[Any]:
        """Run `command` in the sandbox and return how it ended: start(...).wait()."""
        if not _RUN_KEYWORDS.issuperset(options):
            raise _unexpected("execute", options, _RUN_KEYWORDS)
        if options.get("stdin") in (PIPE, subprocess.PIPE):
            raise ConfigError(
                "stdin=cx.PIPE needs start(): nothing can write while execute() waits."
            )
        return self.start(sandbox_id, command, **options).wait()

    @overload
    def start(
        self, sandbox_id: str, command: Command, **options: Unpack[_TextRun]
    ) -> RemoteProcess[str]: ...
    @overload
    def start(
        self, sandbox_id: str, command: Command, **options: Unpack[_BytesRun]
    ) -> RemoteProcess[bytes]: ...
    @overload
    def start(
        self, sandbox_id: str, command: Command, **options: Unpack[_AnyRun]
    ) -> RemoteProcess[Any]: ...
    @_shows(_AnyRun)
    def start(self, sandbox_id: str, command: Command, **options: Any) -> RemoteProcess[Any]:
        """Create the process (exactly once) and return at once, as subprocess.Popen does.

        The options are execute()'s; `timeout` counts from now: staging,
        creation and the run share its one deadline, and whichever wait
        meets it terminates the tree.
        """
        started = time.monotonic()
        if not _RUN_KEYWORDS.issuperset(options):
            raise _unexpected("start", options, _RUN_KEYWORDS)
        checked = _Options(**options, given=options.keys())
        deadline = _Deadline.after(checked.timeout, "command", started, checked.cancel)
        sandbox = _Sandbox(self._transport, sandbox_id)
        plan = _plan(command, checked, self._transport.termination_grace)
        launch = _Launch(sandbox, plan)
        while True:
            try:
                endpoints, recovered = launch.create(deadline)
                break
            except CancelledError as cancelled:
                if cancelled.process_id is not None:
                    raise
                raise CancelledError(created=False) from None
            except APIError as refused:
                _until_it_runs(sandbox, refused, checked.resume, deadline)
        args = command if isinstance(command, str) else list(command)
        follower = _Follower(
            endpoints,
            checked,
            args=args,
            started=started,
            creation_recovered=recovered,
            terminal=checked.pty is not None,
            spool=None if plan.spool is None else _Spool(sandbox, plan.spool, _SPOOL_LIMIT),
        )
        return RemoteProcess(follower, deadline, launch)

    @overload
    def process(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        after: int = 0,
        stdin: None = None,
        pty: None = None,
        **options: Unpack[_TextFollow],
    ) -> RemoteProcess[str]: ...
    @overload
    def process(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        after: int = 0,
        stdin: None = None,
        pty: None = None,
        **options: Unpack[_BytesFollow],
    ) -> RemoteProcess[bytes]: ...
    @overload
    def process(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        after: int = 0,
        stdin: None = None,
        pty: None = None,
        **options: Unpack[_AnyFollow],
    ) -> RemoteProcess[Any]: ...
    @_shows(_AnyFollow)
    def process(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        after: int = 0,
        stdin: None = None,
        pty: None = None,
        **options: Any,
    ) -> RemoteProcess[Any]:
        """A handle on a process started elsewhere or earlier (a restarted kernel,
        another script), its output read from seq `after` + 1.

        One request first shows that it exists: a wrong id or region is the
        APIError 404 itself, and nothing needs destroying. `timeout` counts
        from now; the handle does all that start()'s does, on a terminal too
        when the record says the process has one.
        """
        started = time.monotonic()
        if stdin is not None:
            raise ConfigError(
                "process() and attach() take no stdin: they follow a process started elsewhere."
            )
        if pty is not None:
            raise ConfigError(
                "process() and attach() take no pty: whether a process has a terminal is its own."
            )
        if not _FOLLOW_KEYWORDS.issuperset(options):
            raise _unexpected("process", options, _FOLLOW_KEYWORDS)
        checked = _Options(**options, given=options.keys())
        deadline = _Deadline.after(checked.timeout, "command", started, checked.cancel)
        sandbox = _Sandbox(self._transport, sandbox_id)
        endpoints = _Endpoints(sandbox, _checked_id("process", process_id))
        if not _is_int(after) or after < 0:
            raise ConfigError("after must be an integer >= 0.")
        while True:
            try:
                record = endpoints.record(deadline)
                break
            except APIError as refused:
                _until_it_runs(
                    sandbox, refused, checked.resume, deadline, endpoints.process_id, after
                )
        follower = _Follower(
            endpoints,
            checked,
            args=_process_info(record).args,
            started=started,
            cursor=after,
            terminal=record.get("kind") == "pty",
            spool=_spool_of(sandbox, record),
        )
        return RemoteProcess(follower, deadline)

    @overload
    def attach(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        after: int = 0,
        stdin: None = None,
        pty: None = None,
        **options: Unpack[_TextFollow],
    ) -> ExecResult[str]: ...
    @overload
    def attach(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        after: int = 0,
        stdin: None = None,
        pty: None = None,
        **options: Unpack[_BytesFollow],
    ) -> ExecResult[bytes]: ...
    @overload
    def attach(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        after: int = 0,
        stdin: None = None,
        pty: None = None,
        **options: Unpack[_AnyFollow],
    ) -> ExecResult[Any]: ...
    @_shows(_AnyFollow)
    def attach(
        self,
        sandbox_id: str,
        process_id: str,
        *,
        after: int = 0,
        stdin: None = None,
        pty: None = None,
        **options: Any,
    ) -> ExecResult[Any]:
        """Follow a process started elsewhere to its end: process(...).wait()."""
        if not _FOLLOW_KEYWORDS.issuperset(options):
            raise _unexpected("attach", options, _FOLLOW_KEYWORDS)
        process = self.process(sandbox_id, process_id, after=after, stdin=stdin, pty=pty, **options)
        return process.wait()

    def processes(self, sandbox_id: str) -> List[ProcessInfo]:
        """Every managed process the sandbox keeps, running or exited."""
        return [
            _process_info(record)
            for record in _Sandbox(self._transport, sandbox_id).processes(_ENDLESS)
        ]

    def sandbox(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox as its view shows it: running, paused, destroyed... ("not found"
        when the service does not know it)."""
        return _Sandbox(self._transport, sandbox_id).info(_ENDLESS)

    def resume(self, sandbox_id: str, *, timeout: float = 120.0) -> SandboxInfo:
        """Resume a paused sandbox; return once it runs (at once when it does).

        SandboxGoneError when it is gone; SandboxPausedError when it does not
        run within `timeout` seconds. Its processes go on where they stopped:
        client.process(sandbox_id, error.process_id, after=error.after) takes one up.
        """
        sandbox = _Sandbox(self._transport, sandbox_id)
        try:
            return sandbox.resume(_Deadline.after(timeout, "wait", time.monotonic()))
        except _TimedOut:
            raise SandboxPausedError(
                sandbox.sandbox_id, "resuming", status=0, operation="sandbox resume"
            ) from None

    def put(
        self,
        sandbox_id: str,
        source: FileSource,
        path: str,
        *,
        mode: Optional[int] = None,
        progress: Optional[ProgressCallback] = None,
    ) -> FileInfo:
        """Write `source` (a local path, bytes-like, or a binary file object) to the
        absolute `path` in the sandbox, whole or not at all; a local directory
        moves as a tree.

        It is streamed under a temporary name beside `path` (parents created;
        a `path` ending in "/", or naming a directory, takes a local file in
        under its own name), checked there against the size and SHA-256 of
        what was sent, given `mode` (by default a local file's own; else the
        mode of the file it replaces), and only then renamed into place (a
        symlink there is written through). A file larger than a piece goes in
        pieces, each checked: a cut one is sent again, not the whole. A tree
        replaces a directory at `path` whole: each file checked, then renamed
        into place. progress(done_bytes, total_bytes) is called as bytes go.
        """
        target = _remote_path(path)
        if mode is not None and not (_is_int(mode) and 0 <= mode <= 0o7777):
            raise ConfigError("mode must be None or an integer permission such as 0o755.")
        _check_progress(progress)
        if mode is not None and isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
            raise ConfigError("A directory keeps each entry's mode: mode= is for a file.")
        with _Source(source) as outgoing:
            if target.endswith("/"):
                target = target.rstrip("/") + "/" + _named(outgoing.name, target)
            upload = _Upload(
                _Sandbox(self._transport, sandbox_id), target, outgoing, mode, progress
            )
            return upload.run(_ENDLESS)

    @overload
    def get(
        self,
        sandbox_id: str,
        path: str,
        destination: None = None,
        *,
        max_bytes: int = ...,
        progress: Optional[ProgressCallback] = ...,
    ) -> bytes: ...
    @overload
    def get(
        self,
        sandbox_id: str,
        path: str,
        destination: FileDestination,
        *,
        max_bytes: int = ...,
        progress: Optional[ProgressCallback] = ...,
    ) -> FileInfo: ...
    def get(
        self,
        sandbox_id: str,
        path: str,
        destination: Optional[FileDestination] = None,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        progress: Optional[ProgressCallback] = None,
    ) -> Any:
        """The file at the absolute `path` in the sandbox, checked against the size
        and SHA-256 the sandbox computed: its bytes (at most `max_bytes`), or,
        given a `destination` (a local path or a binary file object), written
        there and described by the FileInfo returned.

        A local path is written under a temporary name beside it (parents
        created) and renamed into place once checked, with the remote file's
        mode; a directory there, or a path ending in a separator, takes it in
        under its own name. A cut after a piece or more goes on from the last
        whole piece. A directory in the sandbox comes to a local path as a tree
        (a `path` ending in "/" says it is one), replacing a directory there
        whole. progress(done_bytes, total_bytes) is called as bytes come.
        """
        source = _remote_path(path)
        if not _is_int(max_bytes) or max_bytes < 0:
            raise ConfigError("max_bytes must be an integer >= 0.")
        _check_progress(progress)
        if source.endswith("/") and not isinstance(destination, (str, os.PathLike)):
            raise ConfigError("A directory comes into a local path: give get() one as destination.")
        sink = _sink_for(destination, max_bytes, posixpath.basename(source.rstrip("/")))
        try:
            download = _Download(_Sandbox(self._transport, sandbox_id), source, sink, progress)
            return download.run(_ENDLESS)
        finally:
            sink.discard()

    def forward(
        self, sandbox_id: str, port: int, *, local_port: int = 0, bind: str = "127.0.0.1"
    ) -> Forward:
        """Listen at `bind`:`local_port` (0: a free port) on this machine and lead
        every connection there to `port` in the sandbox, each through a tunnel of
        its own, until close() (a context manager, as `with` closes it).

        One tunnel is opened and closed first: a port nothing listens on, a
        sandbox paused or gone, a refused tunnel raise here, naming both.
        """
        return _forward(self._transport, sandbox_id, port, local_port, bind)


@overload
def execute(
    sandbox_id: str,
    command: Command,
    *,
    client: Optional[Client] = None,
    **options: Unpack[_TextRun],
) -> ExecResult[str]: ...
@overload
def execute(
    sandbox_id: str,
    command: Command,
    *,
    client: Optional[Client] = None,
    **options: Unpack[_BytesRun],
) -> ExecResult[bytes]: ...
@overload
def execute(
    sandbox_id: str,
    command: Command,
    *,
    client: Optional[Client] = None,
    **options: Unpack[_AnyRun],
) -> ExecResult[Any]: ...
@_shows(_AnyRun)
def execute(
    sandbox_id: str,
    command: Command,
    *,
    client: Optional[Client] = None,
    **options: Any,
) -> ExecResult[Any]:
    """Client.execute() with a client built from the environment (or the one given)."""
    return _on_a_client(client, lambda on: on.execute(sandbox_id, command, **options))


@overload
def start(
    sandbox_id: str,
    command: Command,
    *,
    client: Optional[Client] = None,
    **options: Unpack[_TextRun],
) -> RemoteProcess[str]: ...
@overload
def start(
    sandbox_id: str,
    command: Command,
    *,
    client: Optional[Client] = None,
    **options: Unpack[_BytesRun],
) -> RemoteProcess[bytes]: ...
@overload
def start(
    sandbox_id: str,
    command: Command,
    *,
    client: Optional[Client] = None,
    **options: Unpack[_AnyRun],
) -> RemoteProcess[Any]: ...
@_shows(_AnyRun)
def start(
    sandbox_id: str,
    command: Command,
    *,
    client: Optional[Client] = None,
    **options: Any,
) -> RemoteProcess[Any]:
    """Client.start() with a client built from the environment (or the one given).

    A client built here belongs to the process: it is closed once the run has
    ended or its `with` block is left.
    """
    if client is not None:
        return client.start(sandbox_id, command, **options)
    own = Client()
    try:
        process = own.start(sandbox_id, command, **options)
    except BaseException:
        own.close()
        raise
    process._owner = own
    return process


def put(
    sandbox_id: str,
    source: FileSource,
    path: str,
    *,
    mode: Optional[int] = None,
    progress: Optional[ProgressCallback] = None,
    client: Optional[Client] = None,
) -> FileInfo:
    """Client.put() with a client built from the environment (or the one given)."""
    return _on_a_client(
        client, lambda on: on.put(sandbox_id, source, path, mode=mode, progress=progress)
    )


@overload
def get(
    sandbox_id: str,
    path: str,
    destination: None = None,
    *,
    max_bytes: int = ...,
    progress: Optional[ProgressCallback] = ...,
    client: Optional[Client] = None,
) -> bytes: ...
@overload
def get(
    sandbox_id: str,
    path: str,
    destination: FileDestination,
    *,
    max_bytes: int = ...,
    progress: Optional[ProgressCallback] = ...,
    client: Optional[Client] = None,
) -> FileInfo: ...
def get(
    sandbox_id: str,
    path: str,
    destination: Optional[FileDestination] = None,
    *,
    max_bytes: int = 64 * 1024 * 1024,
    progress: Optional[ProgressCallback] = None,
    client: Optional[Client] = None,
) -> Any:
    """Client.get() with a client built from the environment (or the one given)."""
    return _on_a_client(
        client,
        lambda on: on.get(sandbox_id, path, destination, max_bytes=max_bytes, progress=progress),
    )


def forward(
    sandbox_id: str,
    port: int,
    *,
    local_port: int = 0,
    bind: str = "127.0.0.1",
    client: Optional[Client] = None,
) -> Forward:
    """Client.forward() with a client built from the environment (or the one given);
    a client built here is closed with the forward."""
    if client is not None:
        return client.forward(sandbox_id, port, local_port=local_port, bind=bind)
    own = Client()
    try:
        forwarded = own.forward(sandbox_id, port, local_port=local_port, bind=bind)
    except BaseException:
        own.close()
        raise
    forwarded._owner = own
    return forwarded


def _on_a_client(client: Optional[Client], call: Callable[[Client], _T]) -> _T:
    """call() on `client`, or on a client built from the environment and closed after."""
    if client is not None:
        return call(client)
    with Client() as own:
        return call(own)


def _until_it_runs(
    sandbox: _Sandbox,
    refused: APIError,
    resume: bool,
    deadline: _Deadline,
    process_id: Optional[str] = None,
    after: Optional[int] = None,
) -> None:
    """A request that changes nothing was refused (a creation, a process's first
    lookup): return to send it again once the sandbox runs again (one on its
    way to running, or with `resume` a paused one); otherwise raise what
    happened to the sandbox (`process_id` and the cursor, `after`, in its error)."""
    if not _blames_the_sandbox(refused):
        raise refused
    looked = sandbox.diagnosed(refused, process_id, after)
    if not (isinstance(looked, SandboxPausedError) and _to_wait_for(looked, resume)):
        raise looked
    try:
        running = sandbox.resume(deadline, resume).running
    except _TimedOut:
        raise looked from None
    if not running:
        raise looked


def echo(stream: str, text: Union[str, bytes]) -> None:
    """A ready `on_output`: print output live, stderr to stderr (terminals, notebooks).
    Bytes (text=False) go through as they are where the stream takes bytes."""
    out = sys.stderr if stream == "stderr" else sys.stdout
    binary = getattr(out, "buffer", None) if isinstance(text, bytes) else None
    if binary is None:
        shown = text if isinstance(text, str) else text.decode("utf-8", "replace")
        print(shown, end="", file=out, flush=True)
    else:
        out.flush()  # what was printed before comes first
        binary.write(text)
        binary.flush()


def _unexpected(function: str, given: Mapping[str, Any], keywords: AbstractSet[str]) -> TypeError:
    """TypeError, as Python's own, for a keyword that `function` does not take."""
    unknown = sorted(set(given) - keywords)
    return TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")


def _ported_stdin(stdin: Any) -> Any:
    """stdin= of a ported subprocess call: its PIPE is ours, DEVNULL is no data (EOF at once)."""
    if _is_int(stdin) and stdin in (subprocess.PIPE, subprocess.DEVNULL):
        return PIPE if stdin == subprocess.PIPE else None
    return stdin


def _check_ported(name: str, value: Any, accepted: Tuple[int, ...]) -> None:
    """stdout= and stderr= of a ported subprocess call: output is always captured."""
    if value is not None and not (_is_int(value) and value in accepted):
        merge = ", or subprocess.STDOUT to merge it into stdout" if name == "stderr" else ""
        raise ConfigError(
            f"{name} can only be subprocess.PIPE or None{merge}: output is always captured "
            f"(not {_shown(value)})."
        )


def _codec_error(encoding: Any, errors: Any) -> ConfigError:
    """What is wrong with `encoding` or `errors` of text mode."""
    if encoding is None:
        return ConfigError("encoding=None does not give bytes here: text=False does.")
    if not _codec_known(codecs.getincrementaldecoder, encoding):
        return ConfigError(f'Unknown encoding {_shown(encoding)}: name a codec such as "utf-8".')
    return ConfigError(
        f'Unknown error handler {_shown(errors)}: use "replace", "strict" or '
        '"surrogateescape" (or text=False for the bytes themselves).'
    )


def _codec_known(lookup: Callable[[Any], Any], name: Any) -> bool:
    try:
        lookup(name)
    except (LookupError, TypeError):
        return False
    return True


# ==========================================================================
# 3. The process: one object owns its run
# ==========================================================================
#
# RemoteProcess is the counterpart of subprocess.Popen: one object per remote
# process holds its whole run, hands the output over as it arrives and
# decides how the run ended. Whatever ends it (the exit, the deadline, an
# error, Ctrl-C, an asked termination) goes through _end: the tree is
# terminated and that confirmed unless the process ended by itself, then the
# result, or the error with the partial result attached.
#
# At about 800 lines it is the longest section, and one on purpose: the
# handle (RemoteProcess, Popen's methods and the loop over the output), its
# ending (_end, _Termination) and how the result is built share one state,
# the run's, which a reader follows in one place from start() to the result.


class RemoteProcess(Generic[_AnyStr]):
    """A command running in a sandbox, the counterpart of subprocess.Popen
    (RemoteProcess[bytes] with text=False, as Popen[bytes]).

    Made by start() or Client.process(); it owns the process's whole run, as
    Popen owns its engine. wait() follows the output stream with every
    guarantee of execute() (execute() is start(...).wait()); iter_output()
    hands the output over as it arrives, with the same guarantees; poll(),
    terminate(), kill() and send_signal() act on the remote tree, write()
    and resize() on a terminal's (start(..., pty=...)); leaving a
    `with` block terminates a tree that still runs. One thread follows the
    stream at a time; terminate() and kill() from another thread end it for
    that one. The run's deadline was made once, from `timeout`; a wait may
    stop earlier without ending the run; containment has a deadline of its
    own (cleanup_timeout).
    """

    def __init__(
        self, follower: _Follower, deadline: _Deadline, launch: Optional[_Launch] = None
    ) -> None:
        options = follower.options
        # Typed: mypy checks the body once per kind of output (str, bytes).
        self._endpoints: _Endpoints = follower.endpoints
        endpoints = self._endpoints
        self.sandbox_id: str = endpoints.sandbox_id
        self.process_id: str = endpoints.process_id
        self.args = follower.args
        self._follower: _Follower = follower
        self._check: bool = options.check
        self._deadline: _Deadline = deadline
        self._launch: Optional[_Launch] = launch  # its staged file is removed when the run fails
        self._handover: Optional[_Handover] = None  # made by the first loop over the output
        self._longest_line: int = max(options.max_output_chars, _TAIL_PART)
        self._turn: _Turn = _Turn()  # to read the stream
        self._outcome: Union[ExecResult[Any], BaseException, None] = None  # once the run has ended
        self._exited: Optional[_Exit] = None  # learned by poll()
        self._owner: Optional[Client] = None  # the client of cx.start(), closed at the end
        self._terminal = follower.terminal  # its input is typed, its output one stream, "pty"
        piped = isinstance(options.stdin, _Pipe) or self._terminal
        encoding = options.encoding if options.text else None  # None: bytes only, as Popen's
        self._stdin = _StdinWriter(endpoints, encoding) if piped else None

    def __repr__(self) -> str:
        return (
            f"RemoteProcess(sandbox_id={self.sandbox_id!r}, process_id={self.process_id!r}, "
            f"args={self.args!r})"
        )

    @property
    def pid(self) -> Optional[int]:
        """The leader's pid in the sandbox, as its record says (None until one said it)."""
        return self._endpoints.pid

    @property
    def returncode(self) -> Optional[int]:
        """None until poll() or wait() learns the status, then as ExecResult.returncode."""
        exited = self._known_exit()
        return None if exited is None else _returncode(exited.exit_code, exited.signal)

    def poll(self) -> Optional[int]:
        """None while the process runs, else its returncode (as ExecResult.returncode).

        At most one request: none once the exit status is known. A sandbox that
        does not run is said as for wait() (SandboxPausedError, SandboxGoneError).
        """
        if self._known_exit() is None:
            with self._interruptible():
                self._exited = self._endpoints.exited()
        return self.returncode

    def _known_exit(self) -> Optional[_Exit]:
        outcome = self._outcome
        result = outcome if isinstance(outcome, ExecResult) else getattr(outcome, "result", None)
        if isinstance(result, ExecResult) and (result.exit_code, result.signal) != (None, None):
            return _Exit(result.exit_code, result.signal)
        return self._exited

    def wait(self, timeout: Optional[float] = None) -> ExecResult[_AnyStr]:
        """Follow the process to its end and return its result (see execute()).

        A `timeout` only stops waiting, as Popen.wait's does: WaitTimeout (also
        a subprocess.TimeoutExpired, with the output read so far) is raised
        and the process goes on running; a later wait() continues from the
        last output read. Once the run has ended, every wait() gives its
        result (or raises its error).
        """
        return self._wait(_Deadline.after(timeout, "wait", time.monotonic()))

    def _wait(self, until: _Deadline) -> ExecResult[Any]:
        with self._turn.held(until) as mine:
            if not mine:
                raise self._wait_timeout(until, read=False)
            if self._handover is not None:
                self._handover.clear()  # what a loop left is in the result
            if self._outcome is None:
                collections.deque(self._run(until), maxlen=0)  # every step, none taken
                if self._outcome is None:
                    raise self._wait_timeout(until)
        outcome = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        if self._check and not outcome.ok:
            raise CommandError(outcome, timeout=self._deadline.seconds)
        return outcome

    def iter_output(
        self, timeout: Optional[float] = None, *, lines: bool = False
    ) -> Iterator[Tuple[str, _AnyStr]]:
        """(stream, text) as the output arrives, in order, each piece once.

        Every guarantee of wait() holds while it runs. Leaving the loop only
        stops reading: the next iter_output() or wait() goes on at the cursor.
        `timeout` is for the whole loop, from now: WaitTimeout, and the
        process runs on. Once the loop is exhausted the run has ended and
        wait() gives its result at once. `lines=True` gives whole lines per
        stream, "\\n" kept (an unterminated last line at the end; a line over
        max_output_chars in pieces of that size). With text=False, bytes
        (split on b"\\n").
        """
        until = _Deadline.after(timeout, "wait", time.monotonic())
        me: List[Any] = []  # the loop, weakly: the loop must die with its last reference
        loop = self._iterate(until, bool(lines), me)
        me.append(weakref.ref(loop))
        return loop

    def _iterate(self, until: _Deadline, lines: bool, me: List[Any]) -> Iterator[_Piece]:
        handover = self._handover = self._handover or _Handover(
            self._longest_line, self._follower.options.text
        )
        with self._turn.held(until, loop=me[0]) as mine:
            if not mine:
                raise self._wait_timeout(until, read=False)
            self._follower.hand_to(handover.keep)
            try:
                yield from handover.pieces(lines)
                if self._outcome is None:
                    yield from handover.as_read(self._run(until), lines)
            finally:
                self._follower.hand_to(None)
        yield from handover.pieces(lines, end=self._outcome is not None)
        if self._outcome is None:
            raise self._wait_timeout(until)
        if isinstance(self._outcome, BaseException):
            raise self._outcome

    def _wait_timeout(self, until: _Deadline, read: bool = True) -> WaitTimeout:
        """The error of a wait that `until` ended; with the output read so far
        when this thread holds the turn (`read`), since no other reads it then."""
        stdout, stderr = self._follower.texts() if read else (None, None)
        return WaitTimeout(
            self.args,
            until.seconds or 0.0,
            process_id=self.process_id,
            output=stdout,
            stderr=stderr,
        )

    def terminate(self) -> None:
        """Terminate the whole tree (SIGTERM, a grace period, SIGKILL) and confirm it.

        The output printed meanwhile is read, so a later wait() gives the
        result. CleanupError when the termination cannot be confirmed.
        """
        self._stop(None)

    def kill(self) -> None:
        """SIGKILL to the process group first, as Popen.kill (the result says SIGKILL,
        returncode -9), then the whole tree terminated at once and that confirmed."""
        self._stop(0.0, kill_first=True)

    def _stop(self, grace: Optional[float], kill_first: bool = False) -> None:
        if self._outcome is not None:
            return
        with self._turn.held(_Deadline(time.monotonic())) as mine:
            killed = self._killed() if kill_first else None
            if not mine:
                # Another thread reads the stream: it reads the end; confirm the termination here.
                self._endpoints.delete(grace)
            elif self._outcome is None:
                asked = _Ending(exited=killed, asked=True, grace=grace)
                collections.deque(self._end(asked), maxlen=0)

    def _killed(self) -> Optional[_Exit]:
        """SIGKILL to the process group, and the leader's status it brought, asked
        before the DELETE (a service may forget a deleted process); None if unknown."""
        endpoints = self._endpoints
        try:
            endpoints.signal("SIGKILL")
            record = endpoints.exit_record("leader", _KILLED_POLL_MS, endpoints.cleanup_deadline())
        except CreateOSError:  # the termination that follows kills the tree all the same
            logger.info("SIGKILL to %s was not confirmed; terminating it", self.process_id)
            return None
        return None if record is None else _exit_status(record)

    def send_signal(self, signal: Union[str, int]) -> None:
        """Send a signal (a name such as "SIGINT", or its number) to the process group.

        Nothing is sent once the process has ended.
        """
        name = _signal_name(signal)
        if self._outcome is None:
            self._endpoints.signal(name)

    def write(self, data: Union[str, bytes]) -> None:
        """Write to stdin (start(..., stdin=cx.PIPE)); see _StdinWriter.write. The command's
        `timeout`, passing meanwhile, is a WaitTimeout (the next wait() ends the
        run), and its `cancel` a CancelledError."""
        self._write(data, self._deadline)

    def close_stdin(self) -> None:
        """EOF on stdin; idempotent, and nothing to do without stdin=cx.PIPE.
        A terminal has none to close: ConfigError."""
        if self._terminal:
            raise ConfigError(
                "A terminal has no stdin to close: its program ends with exit, or Ctrl-D "
                "typed (write('\\x04'))."
            )
        self._close_stdin(self._deadline)

    def resize(self, rows: int, cols: int) -> None:
        """Give the terminal (start(..., pty=...)) a new size: the program gets
        SIGWINCH and sees it. Nothing is sent once the process has ended."""
        size = _terminal_size((rows, cols))
        if not self._terminal:
            raise ConfigError("resize() needs a process started with pty=True or (rows, cols).")
        if self._outcome is None and size is not None:
            with self._interruptible():
                self._endpoints.resize(size, self._deadline)

    def communicate(
        self, input: Union[str, bytes, None] = None, timeout: Optional[float] = None
    ) -> Tuple[_AnyStr, _AnyStr]:
        """Write `input`, close stdin and wait(timeout); (stdout, stderr), as
        Popen.communicate returns them (closing stdin also lets a process that
        stopped reading it end as it ends). wait() then gives the ExecResult at once.
        `timeout` bounds the writes too: WaitTimeout, the process running on."""
        until = _Deadline.after(timeout, "wait", time.monotonic())
        writing = self._deadline.sooner(until)
        with contextlib.suppress(StdinClosedError):
            if input is not None:
                self._write(input, writing)
            self._close_stdin(writing)
        result = self._wait(until)
        return result.stdout, result.stderr

    def _write(self, data: Union[str, bytes], deadline: _Deadline) -> None:
        if self._stdin is None:
            raise ConfigError("write() needs a process started with stdin=cx.PIPE.")
        write = self._stdin.type if self._terminal else self._stdin.write
        with self._interruptible():
            write(data, deadline, ended=self._outcome is not None)

    def _close_stdin(self, deadline: _Deadline) -> None:
        if self._stdin is not None and self._outcome is None and not self._terminal:
            with self._interruptible():
                self._stdin.close(deadline)

    @contextlib.contextmanager
    def _interruptible(self) -> Iterator[None]:
        """A wait outside the run (stdin, a port, poll()): its deadline is a
        WaitTimeout, the process running on; the cancel ends the run as it
        always does (the tree terminated, then CancelledError). A sandbox that
        does not run is said as for the run (the port probe's refusals
        included): this process and the cursor; the run itself goes on."""
        try:
            yield
        except _TimedOut as expired:
            raise self._wait_timeout(expired.args[0], read=False) from None
        except CancelledError as cancelled:
            cancelled.process_id = self.process_id
            self.wait()
            raise
        except APIError as refused:
            looked: CreateOSError = refused
            if _blames_the_sandbox(refused):
                looked = self._endpoints.sandbox.diagnosed(
                    refused, self.process_id, self._follower.cursor
                )
            elif isinstance(looked, SandboxError):  # the probe's own: named after this process
                _taken_up_at(looked, self.process_id, self._follower.cursor)
            raise looked  # noqa: B904 (itself, or chained from it by diagnosed())

    def wait_for_port(self, port: int, *, host: str = "127.0.0.1", timeout: float = 30.0) -> None:
        """Return once a TCP connect to host:port succeeds inside the sandbox, on a socket
        that this process or a descendant listens on; see _PortWait."""
        probe = _PortWait(self._endpoints, self.args, port=port, host=host, timeout=timeout)
        with self._interruptible():
            probe.until_open(self.wait, self._deadline.cancel)

    def __enter__(self) -> RemoteProcess[_AnyStr]:
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], traceback: Any) -> None:
        """Terminate a tree that still runs, confirmed, whether the block raised or not."""
        try:
            self.terminate()
        except CleanupError as cleanup:
            if isinstance(error, KeyboardInterrupt):
                return  # Ctrl-C is raised itself; the failed cleanup was logged
            if error is None:
                raise
            raise cleanup from error
        finally:
            if self._owner is not None:
                self._owner.close()

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        # As Popen's: a handle dropped while its process may run is a
        # forgotten wait() or `with` (a bound default: warnings may be gone
        # at interpreter exit).
        if getattr(self, "_outcome", 0) is None and self._exited is None:
            _warn(
                f"The remote process {self.process_id} may still be running: its handle "
                "was dropped without wait(), terminate() or a with block.",
                ResourceWarning,
                source=self,
            )

    # -- the run: followed to its end, then contained --------------------------

    def _run(self, until: _Deadline) -> _Steps[Optional[ExecResult[Any]]]:
        """Follow the process to its end; None when `until` (a wait's own limit)
        passed first: the process goes on running, and the run with it."""
        run = self._deadline
        late = self._launch is not None and run.at is not None and run.expired()
        try:
            exited = yield from self._follower.follow(
                run if until.at is None else run.sooner(until)
            )
            ending = _Ending(exited=exited)
        except _TimedOut as expired:
            if expired.args[0].kind != "command":
                return None
            gone = (yield from self._after_deadline()) if late else None
            ending = gone or _Ending(timed_out=True)
        except GeneratorExit:  # a loop was left: nothing ends
            raise
        except BaseException as exc:  # contained by _end, then raised again
            ending = _Ending(error=exc)
            if _blames_the_sandbox(exc):
                resumed = self._after_resume(self._looked_at(ending))
                if resumed is None:
                    return (yield from self._run(until))  # the run goes on
                ending = resumed
        return (yield from self._end(ending))

    def _end(self, ending: _Ending) -> _Steps[Optional[ExecResult[Any]]]:
        """The one way a run ends. Unless the process ended by itself, its tree
        is terminated and that confirmed first; then the result, or the error
        with the partial result attached: the outcome every later wait gives."""
        try:
            if not ending.gone and (ending.timed_out or ending.error is not None or ending.asked):
                ending = yield from self._contain(ending)
            if ending.error is not None:
                raise ending.error
            self._outcome = self._follower.result(ending.exited, timed_out=ending.timed_out)
        except GeneratorExit:  # a loop was left during containment: the run goes on
            raise
        except BaseException as exc:
            self._outcome = exc
            raise
        finally:
            if self._outcome is not None and self._owner is not None:
                self._owner.close()  # the client of cx.start(): the run has ended
        return self._outcome

    def _looked_at(self, ending: _Ending) -> _Ending:
        """A failure that may be the sandbox's doing, once its view was asked: a
        sandbox paused or gone is the error, and leaves nothing to terminate
        (no DELETE while it is paused, none into a sandbox gone)."""
        follower = self._follower
        assert isinstance(ending.error, CreateOSError)  # see _blames_the_sandbox
        error = self._endpoints.sandbox.diagnosed(ending.error, self.process_id, follower.cursor)
        if not isinstance(error, SandboxError):
            return ending._replace(error=error)
        error.result = follower.result(None, partial=True)
        return _Ending(error=error, gone=True)

    def _after_resume(self, ending: _Ending) -> Optional[_Ending]:
        """A sandbox on its way to running (resuming, creating, forking), or with
        resume=True a paused one resumed, waited for within the run's deadline:
        None when it runs again with this process still served and its journal
        going on at the cursor (the run goes on). Otherwise how the run ends:
        `ending` (still paused at the deadline, or not to be resumed), or what
        went wrong meanwhile (a process the service lost across the pause is
        an APIError that says so)."""
        paused = ending.error
        if not (
            isinstance(paused, SandboxPausedError)
            and _to_wait_for(paused, self._follower.options.resume)
        ):
            return ending
        endpoints = self._endpoints
        try:
            if not endpoints.sandbox.resume(self._deadline, self._follower.options.resume).running:
                return ending  # paused, and not to be resumed
            record = endpoints.record(self._deadline)
            if _output_seq(record, "newest_seq") < self._follower.cursor:
                raise ProtocolError("the journal ends before output already read")
        except _TimedOut:
            return ending  # still paused: nothing to terminate
        except SandboxError as gone:  # destroyed while it resumed, or in a state unknown
            gone.result = paused.result
            _taken_up_at(gone, self.process_id, paused.after)
            return _Ending(error=gone, gone=True)
        except APIError as refused:
            if refused.status != 404:
                return _Ending(error=refused)
            lost = APIError(404, _AFTER_RESUME, process_id=self.process_id)
            lost.result = paused.result
            return _Ending(error=lost)
        except BaseException as exc:  # contained by _end, then raised again
            return _Ending(error=exc)
        return None

    def _contain(self, ending: _Ending) -> _Steps[_Ending]:
        """Terminate the tree and confirm it, then say how the run ended.

        After a timeout or an asked termination, the output of the grace period
        is read while the DELETE waits it out, on a stream opened before the
        DELETE is sent (a service may forget a process once it is deleted, and
        answer a later connect 404); whatever ends that reading, the DELETE is
        waited for (a second Ctrl-C ends that wait).
        """
        opened = None
        reads_grace = ending.timed_out or ending.asked
        if reads_grace:
            try:
                opened = self._follower.opened(_GRACE_CONNECT, self._deadline)
            except BaseException as exc:  # Ctrl-C: raised once the tree is confirmed gone
                ending, reads_grace = ending._replace(error=exc), False
        termination = _Termination(self._endpoints, ending.grace, self._deadline.cancel)
        if reads_grace:
            ending = yield from self._through_termination(ending, opened)
        first = ending.error
        unconfirmed = termination.unconfirmed()
        if first is None and ending.exited is None and termination.record is not None:
            # An asked termination or a timeout whose stream could not tell (a service
            # may forget a process once it is deleted): the DELETE's final record does.
            with contextlib.suppress(ProtocolError):
                ending = ending._replace(exited=_exit_status(termination.record))
        ending = self._contained(ending, unconfirmed)
        if unconfirmed is None and not isinstance(first, KeyboardInterrupt):
            # What the killed tree left: its spool, and the staged file the wrapper
            # may not have removed when the run failed.
            left = self._follower.forget_spool()
            if first is not None and self._launch is not None:
                left += self._launch.staged_files()
            self._endpoints.sandbox.remove(left, "what the run left", self._deadline.cancel)
        return ending

    def _after_deadline(self) -> _Steps[Optional[_Ending]]:
        """First followed after its deadline: a tree already gone (the sandbox's
        watchdog, or its own end) needs no containment. Its output is read to
        the end, and its record says whether the deadline ended it. None to
        contain it as at any deadline (one that still runs, or trouble)."""
        follower = self._follower
        try:
            record = self._endpoints.current_record()
        except CreateOSError:
            return None
        if record.get("tree_exited") is not True:
            return None
        ended_by_deadline = _ended_by_deadline(record, self._deadline.seconds or 0.0)
        try:
            exited = yield from follower.follow(follower.reading_deadline(self._deadline))
        except (_TimedOut, CreateOSError):
            return None
        return _Ending(exited=exited, timed_out=ended_by_deadline, gone=True)

    def _through_termination(
        self, ending: _Ending, opened: Optional[requests.Response]
    ) -> _Steps[_Ending]:
        """While the tree is terminated: read what the process prints in its grace period.

        A cancel, a callback's error or Ctrl-C ends the reading and becomes
        how the run ended; trouble with the stream only ends the reading.
        """
        follower = self._follower
        try:
            reading = follower.reading_deadline(self._deadline)
            exited = yield from follower.follow(reading, opened)
        except CancelledError as exc:
            return ending._replace(error=exc)
        except (_TimedOut, CreateOSError):
            logger.warning(
                "Output of %s printed during its termination could not be read", self.process_id
            )
            return ending
        except GeneratorExit:  # a loop was left: the termination goes on
            raise
        except BaseException as exc:  # raised once the tree is confirmed gone
            return ending._replace(error=exc)
        return ending._replace(exited=exited)

    def _contained(self, ending: _Ending, unconfirmed: Optional[CreateOSError]) -> _Ending:
        """How a run ended once its termination was waited for: its error names the
        process and carries what was read; an unconfirmed termination is the error
        then, chained from the first (but for Ctrl-C, which is raised itself)."""
        follower = self._follower
        error = ending.error
        if isinstance(error, CreateOSError):
            error.process_id = error.process_id or self.process_id
            if error.result is None and (ending.timed_out or follower.cursor > follower.first_seq):
                error.result = follower.result(
                    ending.exited, timed_out=ending.timed_out, partial=True
                )
        if unconfirmed is None or isinstance(error, KeyboardInterrupt):
            return ending  # Ctrl-C is raised itself; a failed cleanup was logged
        if isinstance(unconfirmed, CleanupError):
            _taken_up_at(unconfirmed, unconfirmed.process_id, follower.cursor)
        if error is None:
            unconfirmed.result = follower.result(
                ending.exited, timed_out=ending.timed_out, partial=True
            )
        else:
            unconfirmed.result = getattr(error, "result", None)
            unconfirmed.__cause__ = error
        return _Ending(error=unconfirmed)


_Steps = Generator[None, None, _T]  # a run's steps: one after each block a loop takes


def _to_wait_for(error: SandboxPausedError, resume: bool) -> bool:
    """Whether the sandbox that `error` found not running is waited for: one on its
    way to running, or a paused one to be resumed."""
    if not (resume or error.sandbox_status in _SANDBOX_ON_THE_WAY):
        return False
    logger.info("Sandbox %s is %s; waiting for it to run", error.sandbox_id, error.sandbox_status)
    return True


def _blames_the_sandbox(error: BaseException) -> bool:
    """Whether `error` may be the sandbox's doing, to be looked at before it is
    raised: a 404 or 409 answer, or an output stream that could not be resumed."""
    if isinstance(error, APIError):
        return error.status in (404, 409) and not isinstance(error, SandboxError)
    return isinstance(error, StreamEndedError) and not isinstance(error, OutputIncompleteError)


def _to_end(steps: _Steps[_T]) -> _T:
    """Take every step; what the steps came to."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value  # type: ignore[no-any-return]


class _Ending(NamedTuple):
    """How following a process ended, before containment: a status, the
    deadline, an error (a callback's and Ctrl-C included), or a termination
    the caller asked for (terminate(), kill(), leaving a `with` block)."""

    exited: Optional[_Exit] = None
    timed_out: bool = False
    error: Optional[BaseException] = None
    asked: bool = False
    grace: Optional[float] = None  # of an asked termination; None: the usual grace period
    gone: bool = False  # the tree is known to be gone: nothing to terminate


@dataclasses.dataclass
class _Turn:
    """The stream is read by one thread at a time: whose turn it is.

    A loop over iter_output() keeps the turn between its steps. One that this
    thread left without closing it (its iterator kept) gives the turn up to
    the next wait() or loop of the same thread: leaving a loop only stops it.
    """

    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _loop: Optional[Tuple[int, Any]] = None  # the thread and loop (weakly) holding it

    @contextlib.contextmanager
    def held(self, until: _Deadline, loop: Any = None) -> Iterator[bool]:
        """The turn, for the block: True once taken, False when `until` passed first."""
        held = self._loop
        left_loop = held[1]() if held is not None and held[0] == threading.get_ident() else None
        if left_loop is not None:
            left_loop.close()
        wait = -1 if until.at is None else max(0.0, until.at - time.monotonic())
        if not self._lock.acquire(timeout=wait):
            yield False
            return
        self._loop = None if loop is None else (threading.get_ident(), loop)
        try:
            yield True
        finally:
            self._loop = None
            self._lock.release()


class _Termination:
    """A tree's DELETE in a thread of its own, so that the grace period's output can be read."""

    def __init__(
        self, endpoints: _Endpoints, grace: Optional[float], hurry: Optional[threading.Event]
    ) -> None:
        # The run's cancel hurries the termination (see _Deadline.pause); after Ctrl-C
        # it goes at the pace of the window and the service, and a second Ctrl-C ends it.
        self._failure: Optional[BaseException] = None
        self.record: Optional[Dict[str, Any]] = None  # the process's final one, once confirmed
        self._thread = threading.Thread(
            target=self._delete, args=(endpoints, grace, hurry), name="createos_exec-cleanup"
        )
        self._thread.daemon = True
        self._thread.start()

    def _delete(
        self, endpoints: _Endpoints, grace: Optional[float], hurry: Optional[threading.Event]
    ) -> None:
        try:
            self.record = endpoints.delete(grace, hurry)
        except BaseException as exc:  # handed over by unconfirmed()
            self._failure = exc

    def unconfirmed(self) -> Optional[CreateOSError]:
        """The CleanupError when termination is unconfirmed, the SandboxError when
        the sandbox left nothing to terminate, None once it is confirmed."""
        self._thread.join()
        if self._failure is not None and not isinstance(
            self._failure, (CleanupError, SandboxError)
        ):
            raise self._failure  # not a cleanup failure: a fault of this module
        return self._failure


_Piece = Tuple[str, Any]  # (stream, its text, or bytes with text=False)


class _Handover:
    """Output read while a loop over iter_output() runs, until the loop takes it:
    the pieces as they came, or whole lines per stream (of text or of bytes).

    A piece or line leaves the handover before it is handed out, and nothing
    is held between two of them but here: a loop left at any point (`break`)
    leaves the next loop what it did not hand out, nothing twice.
    """

    def __init__(self, longest_line: int, text: bool) -> None:
        self._pieces: Deque[_Piece] = collections.deque()
        self._lines_ready: Deque[_Piece] = collections.deque()
        self._partial: Dict[str, List[Any]] = {name: [] for name in _ALL_STREAMS}
        self._partial_size = dict.fromkeys(_ALL_STREAMS, 0)
        self._longest_line = longest_line
        self._newline: Any = "\n" if text else b"\n"
        self._nothing = self._newline[:0]

    def keep(self, stream: str, text: Any) -> None:
        self._pieces.append((stream, text))

    def clear(self) -> None:
        self._pieces.clear()
        self._lines_ready.clear()
        for name in _ALL_STREAMS:
            self._partial[name].clear()
            self._partial_size[name] = 0

    def as_read(self, steps: Iterator[None], lines: bool) -> Iterator[_Piece]:
        """What each step takes, handed on after it (a step is one block read)."""
        if lines:
            for _ in steps:
                yield from self.pieces(lines=True)
            return
        pending = self._pieces
        for _ in steps:  # the usual loop: nothing between a block and its pieces
            while pending:
                yield pending.popleft()

    def pieces(self, lines: bool, end: bool = False) -> Iterator[_Piece]:
        """What was taken, in order; with `end`, the unterminated last lines too."""
        ready, pending = self._lines_ready, self._pieces
        if not lines:
            self._unterminated()  # left by a loop over lines
        while ready or pending:
            if ready:
                yield ready.popleft()
            elif lines:
                self._split(*pending.popleft())
            else:
                yield pending.popleft()
        if end:
            self._unterminated()
            while ready:
                yield ready.popleft()

    def _split(self, stream: str, text: Any) -> None:
        """The whole lines of `text` (after what the stream left unterminated) made ready."""
        partial, newline = self._partial[stream], self._newline
        start = 0
        end = text.find(newline) + 1
        while end:
            if partial:
                partial.append(text[start:end])
                self._unterminated(stream)
            else:
                self._lines_ready.append((stream, text[start:end]))
            start = end
            end = text.find(newline, start) + 1
        if start < len(text):
            partial.append(text[start:] if start else text)
            self._partial_size[stream] += len(text) - start
            if self._partial_size[stream] >= self._longest_line:
                self._unterminated(stream)

    def _unterminated(self, *streams: str) -> None:
        """What the streams hold of a line, made ready as it stands."""
        for name in streams or _ALL_STREAMS:
            partial = self._partial[name]
            if partial:
                self._lines_ready.append((name, self._nothing.join(partial)))  # one is not copied
                partial.clear()
                self._partial_size[name] = 0


def _signal_name(value: Any) -> str:
    """The SIG name of a signal given as kill -l lists it ("SIGUSR1" or "USR1"), or its number."""
    if _is_int(value):
        with contextlib.suppress(ValueError):
            return _signal.Signals(value).name
    elif isinstance(value, str):
        name = value if value.startswith("SIG") else "SIG" + value
        if name in _LINUX_SIGNALS:
            return name
    raise ConfigError(
        f"Unknown signal {_shown(value)}: give a name in capitals as kill -l lists it "
        '("TERM", "SIGUSR1", ...) or a signal number; nothing was sent.'
    )


_ENDED_GRACE = 5.0  # seconds at least to read the output of a process the probe saw end


class _PortWait:
    """wait_for_port(): until a TCP connect inside the sandbox succeeds.

    A managed process probes (see _PROBE_SCRIPT) while the client follows its
    output stream, which costs one request per stream (a stream lives as long
    as the service keeps it), plus a look at the target's record, the probe's
    creation and its DELETE, which always comes before the call returns.
    """

    def __init__(
        self, endpoints: _Endpoints, args: Any, *, port: Any, host: Any, timeout: Any
    ) -> None:
        if not _is_int(port) or not 1 <= port <= 65535:
            raise ConfigError("port must be an integer from 1 to 65535.")
        if not isinstance(host, str) or not _HOST.match(host):
            raise ConfigError("host must be a host name or an IP address.")
        self._timeout = _positive_seconds("timeout", timeout)
        self._endpoints = endpoints
        self._process_id = endpoints.process_id
        self._args = args
        self._port = port
        self._host = host

    def until_open(
        self, finish: Callable[[float], ExecResult[Any]], cancel: Optional[threading.Event]
    ) -> None:
        """Return once the port accepts a connection. ProcessEndedError, with the
        result `finish` (the process's wait) gives, when the process ends first;
        WaitTimeout at the timeout, the process running on; CancelledError once
        `cancel` (the run's) is set."""
        deadline = _Deadline.after(self._timeout, "wait", time.monotonic(), cancel)
        pid = self._target_pid(deadline)
        exited = _PROBE_GONE if pid is None else self._probe(pid, deadline)
        if exited == _PROBE_OPEN:
            return
        if exited == _PROBE_GONE:
            self._raise_ended(finish, deadline)
        if exited is not None and exited != _PROBE_LIMIT:
            raise CreateOSError(
                "The port probe in the sandbox ended without an answer.",
                process_id=self._process_id,
            )
        raise WaitTimeout(self._args, self._timeout, process_id=self._process_id, port=self._port)

    def _target_pid(self, deadline: _Deadline) -> Optional[int]:
        """The target's pid, or None once its leader has exited (or it is gone)."""
        try:
            record = self._endpoints.record(deadline)
        except APIError as refused:
            if refused.status == 404:  # the service no longer keeps it: it has ended
                return None
            raise
        if record.get("leader_exited") is True:
            return None
        pid = _leader_pid(record)
        if pid is None:
            raise ProtocolError("the process record has no valid pid", process_id=self._process_id)
        return pid

    def _probe(self, pid: int, deadline: _Deadline) -> Optional[_Exit]:
        """The probe's exit status, or None at the deadline (a cancel goes on up); the probe
        is gone either way."""
        limit = math.ceil(self._timeout) + 2  # a backstop: the DELETE comes first
        argv = [str(pid), self._host, str(self._port), str(limit)]
        command = ["bash", "-c", _PROBE_SCRIPT, "createos_exec-port-probe", *argv]
        sandbox = self._endpoints.sandbox
        probe, _ = _Launch(sandbox, _plan(command, _Options(), spooled=False)).create(deadline)
        try:
            follower = _Follower(probe, _Options(), args=command, started=time.monotonic())
            return _to_end(follower.follow(deadline))
        except _TimedOut:  # a cancel goes on up, after the probe is deleted
            return None
        finally:
            with contextlib.suppress(CleanupError):  # logged; the probe's limit ends it
                probe.delete(grace=0.0)

    def _raise_ended(
        self, finish: Callable[[float], ExecResult[Any]], deadline: _Deadline
    ) -> NoReturn:
        result: Optional[ExecResult[Any]]
        try:
            result = finish(max(_ENDED_GRACE, deadline.remaining() or 0.0))
        except CommandError as failed:  # check=True: the result all the same
            result = failed.result
        raise ProcessEndedError(self._port, process_id=self._process_id, result=result)


# ==========================================================================
# 4. Following: the stream read to its end, resumed after every failure
# ==========================================================================
#
# One process's output followed from the cursor: every transport failure
# resumes it at the last accepted seq; once the retry budget is spent, the
# exit status is recovered out of band (wait?scope=tree) and the missing
# output replayed; a protocol error never reconnects. Output the journal
# evicted before it was read is read from the spool in the sandbox, and the
# rest of the output with it (design item 19).


class _Follower:
    """The output stream of one process followed from the cursor: resumed after
    every transport failure, its exit status recovered out of band.

    What it holds outlives one wait: the cursor, the decoders and tails, the
    failures without progress and an exited process's record, so that a wait
    that stops early is continued by the next one with nothing lost or
    repeated. Every wait takes the deadline it runs under as an argument.
    Following is a generator of steps, one after each block of output while
    a loop over iter_output() takes the output (none otherwise). It is the
    one way a run is built (start(), process(), the port probe); how the run
    ends is for RemoteProcess to decide.
    """

    def __init__(
        self,
        endpoints: _Endpoints,
        options: _Options,
        *,
        args: Any,
        started: float,
        cursor: int = 0,
        creation_recovered: bool = False,
        terminal: bool = False,
        spool: Optional[_Spool] = None,
    ) -> None:
        self.endpoints = endpoints
        self.options = options
        self.process_id = endpoints.process_id
        self._spool = spool
        # Whether the bytes of each stream read so far say where the spool goes on
        # (from the first byte on, nothing dropped), and whether it is read now.
        self._spool_readable = spool is not None and cursor == 0
        self._spooling = False
        self._oldest_kept: Optional[int] = None  # what the journal said it kept when it evicted
        self._output = _Output(
            options.encoding if options.text else None,
            options.errors,
            options.max_output_chars,
            options.on_output,
            merges_stderr=options.stderr == subprocess.STDOUT,
        )
        self._reader = _Reader(self._output, cursor, terminal=terminal)
        self._budget: Optional[_Budget] = None  # made at the first broken connection
        self._progress_mark = cursor  # the cursor when the budget last saw progress
        self._record: Optional[Dict[str, Any]] = None  # the exited process's, once known
        self.started = started
        self.first_seq: int = cursor
        self.args: Any = args
        self.reconnects = 0
        self.exit_recovered = False
        self.creation_recovered = creation_recovered
        self.terminal = terminal
        # Told True when a broken connection is to be resumed, False once it is (a notice).
        self.on_reconnect: Optional[Callable[[bool], None]] = None
        self._reconnecting = False
        # A live reader that takes a gap when it is told of it (a terminal session, which
        # then draws its screen anew from the output kept): told before that output comes.
        self.on_gap: Optional[Callable[[], None]] = None

    @property
    def cursor(self) -> int:
        return self._reader.cursor

    def hand_to(self, consumer: Optional[OutputCallback]) -> None:
        """Hand the output to `consumer` too as it is read, a step a block; None: stop."""
        self._output.hand_to(consumer)
        self._reader.stepwise = consumer is not None

    def texts(self) -> Tuple[Any, Any]:
        """stdout and stderr as read so far (str, or bytes with text=False); the run goes on."""
        return self._output.texts()

    def result(
        self, exited: Optional[_Exit], *, timed_out: bool = False, partial: bool = False
    ) -> ExecResult[Any]:
        """The output's result, with what following the process learned. A final
        one (not `partial`: the run has ended) ends the spool's use too: a spool
        its spoolers kept for this client (the output too big for them to drop
        it, or how big is not known here), or one a deadline's kill left behind
        (`timed_out`), is removed."""
        if not partial and self._spool is not None:
            small = sum(self._output.received.values()) < _SPOOL_KEPT_FROM
            if timed_out or not (small and self._spool_readable):
                self.endpoints.sandbox.remove(self.forget_spool(), "the spool")
        return self._output.result(
            exited,
            timed_out=timed_out,
            partial=partial,
            args=self.args,
            process_id=self.process_id,
            reconnects=self.reconnects,
            exit_recovered=self.exit_recovered,
            creation_recovered=self.creation_recovered,
            duration=time.monotonic() - self.started,
        )

    def opened(self, seconds: float, run: _Deadline) -> Optional[requests.Response]:
        """The stream from the cursor, opened now for a follow() to come, within
        `seconds` and the run's cancel; None when it does not open at once (that
        follow() connects as ever)."""
        deadline = _Deadline.after(seconds, "cleanup", time.monotonic(), run.cancel)
        try:
            return self.endpoints.connect(self._reader.cursor, deadline)
        except (_Retryable, _TimedOut, CreateOSError):
            return None

    def follow(
        self, deadline: _Deadline, opened: Optional[requests.Response] = None
    ) -> _Steps[_Exit]:
        """Follow the stream to its end, resuming it after every transport failure;
        on `opened` first, a stream of opened().

        Only a new frame is progress. When the retry policy is spent without
        any, a short `wait` tells a quiet process (followed on, with a fresh
        budget) from one that has exited: its record is then the result, once
        the output it says there is has been replayed. A connection the
        deadline cut is no failure: the deadline ends the following.
        """
        while True:
            if self._spooling:
                spooled = yield from self._from_spool(deadline)
                if spooled is not None:
                    return spooled
            deadline.check(self.process_id)
            record, cursor, beats = self._record, self._reader.cursor, self._reader.heartbeats
            until = None if record is None else _output_seq(record, "newest_seq")
            ended: Union[_Exit, None, _Retryable]  # what ended one connection
            try:
                response = opened or self.endpoints.connect(cursor, deadline)
                opened = None
                unblocked = (
                    _unblocked_by(deadline, response)
                    if deadline.at is not None or deadline.cancel is not None
                    else contextlib.nullcontext()  # nothing can end the read sooner
                )
                with contextlib.closing(response), unblocked:
                    if self._reconnecting:  # a notice's hook may raise: the response is closed
                        self._tell_reconnecting(False)
                    interrupted = functools.partial(deadline.check, self.process_id)
                    ended = yield from self._reader.read(_arriving(response), interrupted, until)
            except _Retryable as failure:
                ended = failure
            except OutputEvictedError as evicted:
                self._after_eviction(evicted, deadline)
                continue
            if ended is None:
                return self._recovered(record)
            if isinstance(ended, _Exit):
                return ended if ended != _NO_STATUS else self._exit_of_bare_frame(deadline)
            recovered = self._resume_after(ended, deadline, cursor, beats)
            if recovered is not None:
                return recovered

    def _resume_after(
        self, failure: _Retryable, deadline: _Deadline, cursor: int, beats: int
    ) -> Optional[_Exit]:
        """A broken connection: pause before the next one, or the status recovered
        out of band when the retry policy is spent and the process has exited."""
        budget = self._budget = self._budget or _Budget(self.endpoints.transport.retry)
        if self._reader.cursor != self._progress_mark:
            self._progress_mark = self._reader.cursor
            budget.progress()
        deadline.check(self.process_id)
        delay = budget.next_delay(failure.retry_after)
        if delay is None:
            self._record = record = self._when_spent(self._record, deadline, failure)
            if record is not None and self._caught_up(record):
                return self._recovered(record)
            self._budget = _Budget(self.endpoints.transport.retry)
            delay = 0.0
        logger.info(
            "Output stream of %s broke after %d new frames and %d heartbeats; "
            "resuming after seq %d in %.2f s",
            self.process_id,
            self._reader.cursor - cursor,
            self._reader.heartbeats - beats,
            self._reader.cursor,
            delay,
        )
        if not self._reconnecting:
            self._tell_reconnecting(True)
        self._pause(delay, deadline)
        self.reconnects += 1
        return None

    def _tell_reconnecting(self, under_way: bool) -> None:
        self._reconnecting = under_way
        if self.on_reconnect is not None:
            self.on_reconnect(under_way)

    def _after_eviction(self, evicted: OutputEvictedError, deadline: _Deadline) -> None:
        """The journal evicted output not read yet: read on from the spool, or
        without one go on from the oldest output kept when nobody reads live;
        `evicted` otherwise (a consumer is never handed output after a gap it
        was not told of)."""
        if self._spool_readable:
            logger.info(
                "Output of %s after seq %d was evicted from the journal; reading it from "
                "the spool in the sandbox",
                self.process_id,
                self._reader.cursor,
            )
            self._spooling, self._oldest_kept = True, evicted.oldest_available_seq
            return
        if self._output.live and self.on_gap is None:
            raise evicted
        self._skip_to_kept(evicted, deadline)

    def _skip_to_kept(self, evicted: OutputEvictedError, deadline: _Deadline) -> None:
        """Nobody reads live (or the reader takes a gap it is told of): the evicted
        output is the head of the output, not a hole in it. Drop what was read
        and go on from the oldest output kept."""
        oldest = evicted.oldest_available_seq
        if oldest is None:
            oldest = _output_seq(self.endpoints.record(deadline), "oldest_seq")
        if oldest <= self._reader.cursor + 1:
            raise evicted  # the next frame is kept after all: fail closed
        logger.info(
            "Output of %s up to seq %d was evicted unread; following on from seq %d",
            self.process_id,
            oldest - 1,
            oldest,
        )
        self._output.drop_all()
        self._spool_readable = self._spooling = False
        self._reader.cursor = oldest - 1
        if self.on_gap is not None:
            self.on_gap()

    def _exit_of_bare_frame(self, deadline: _Deadline) -> _Exit:
        """An exit frame came without a status: the record's, checked once."""
        logger.info("Exit frame of %s has no status; asking the process record", self.process_id)
        problem = ProtocolError("the exit frame carries no exit status", process_id=self.process_id)
        try:
            record = self.endpoints.exit_record("leader", _EXIT_CHECK_MS, deadline)
        except CreateOSError as exc:
            deadline.check(self.process_id)  # the deadline cut the wait short
            raise problem from exc
        recovered = _exit_status(record) if record is not None else None
        if recovered is None:
            raise problem
        self.exit_recovered = True
        return recovered

    def reading_deadline(self, run: _Deadline) -> _Deadline:
        """A fresh deadline for reading what is left once nothing is waited for,
        under the cancel of the `run`'s deadline."""
        return self.endpoints.cleanup_deadline(cancel=run.cancel)

    def _pause(self, delay: float, deadline: _Deadline) -> None:
        deadline.sleep(delay)
        deadline.check(self.process_id)

    # -- recover ---------------------------------------------------------------

    def _when_spent(
        self, record: Optional[Dict[str, Any]], deadline: _Deadline, failure: _Retryable
    ) -> Optional[Dict[str, Any]]:
        """The retry policy is spent without progress: the exited process's record,
        or None while it still runs (a quiet job behind connections that end)."""
        if record is not None:  # the replay of the output the record promised failed too
            self.exit_recovered = True
            exited = _exit_status(record)
            raise OutputIncompleteError(
                process_id=self.process_id, result=self.result(exited, partial=True)
            )
        logger.info("Output stream of %s keeps failing; asking whether it runs", self.process_id)
        try:
            record = self.endpoints.exit_record("tree", _LIVENESS_POLL_MS, deadline)
        except (TransportError, APIError) as exc:
            deadline.check(self.process_id)  # the deadline cut the wait short
            raise StreamEndedError(process_id=self.process_id) from exc
        if record is None:
            logger.info("Process %s still runs; following it on", self.process_id)
        elif _exit_status(record) is None:
            raise StreamEndedError(process_id=self.process_id) from failure.__cause__
        return record

    def _caught_up(self, record: Dict[str, Any]) -> bool:
        """Whether the output read reaches the end of the exited process's journal."""
        newest = _output_seq(record, "newest_seq")
        if newest < self._reader.cursor:
            raise ProtocolError("the journal ends before output already read")
        return newest == self._reader.cursor

    def _recovered(self, record: Optional[Dict[str, Any]]) -> _Exit:
        exited = _exit_status(record) if record is not None else None
        if exited is None:  # _when_spent lets only a record with an exit status through
            raise ProtocolError("the wait answer carries no exit status")
        self.exit_recovered = True
        logger.info("Recovered the exit status of %s out of band", self.process_id)
        return exited

    # -- the spool -------------------------------------------------------------

    def _from_spool(self, deadline: _Deadline) -> _Steps[Optional[_Exit]]:
        """The rest of the output, from the spool: each stream from the bytes held
        on, a piece at a time, to its end; then the exit status, from the
        record. None when the spool cannot go on and nobody reads live: the
        journal's oldest output on, then.

        No gap and no repeat in each stream; what came of both in one piece is
        handed out stdout first (where they interleaved is not known). A
        stream that its spooler could not mark ended (killed with the tree)
        is read to its end once the record shows the tree gone.
        """
        spool, output = self._spool, self._output
        assert spool is not None  # see _after_eviction
        spooled, pause, settled = 0, _SPOOL_POLL, False
        while True:
            deadline.check(self.process_id)
            pieces = self._spooled(spool, deadline)
            if pieces is None:
                return None
            for stream, piece in zip(_STREAMS, pieces):
                if piece.data:
                    output.feed(stream, piece.data)
                    spooled += len(piece.data)
            if all(piece.left == 0 and (piece.ended or settled) for piece in pieces):
                break
            if any(piece.data for piece in pieces):
                pause = _SPOOL_POLL
                if self._reader.stepwise:
                    yield
                continue
            if pause >= _SPOOL_POLL_MAX and not settled:
                settled = self.endpoints.record(deadline).get("tree_exited") is True
                if settled:
                    continue  # what the spool holds now is all of it
            self._pause(pause, deadline)
            pause = min(2 * pause, _SPOOL_POLL_MAX)
        logger.info("Read %d bytes of the output of %s from its spool", spooled, self.process_id)
        exited = self._exit_after_spool(deadline)
        self.endpoints.sandbox.remove(self.forget_spool(), "the spool")
        return exited

    def _spooled(self, spool: _Spool, deadline: _Deadline) -> Optional[List[_Spooled]]:
        """A piece of each stream's spool past the bytes held. A spool gone, or full
        where a stream goes on past it, is the eviction, with what it lost, for
        a consumer that reads live; None without one, after going back to the
        journal's oldest output."""
        held = self._output.received
        try:
            pieces = spool.read(held, deadline)
            lost = "full" if any(held[s] >= spool.limit for s in _STREAMS) else None
        except _SpoolGone:
            lost = "gone"
        if lost is None:
            return pieces
        evicted = OutputEvictedError(
            self._oldest_kept,
            process_id=self.process_id,
            spool=lost,
            held=dict(held),
            limit=spool.limit,
        )
        self._spool_readable = False
        self._after_eviction(evicted, deadline)
        return None

    def _exit_after_spool(self, deadline: _Deadline) -> _Exit:
        """The exit status once the spool was read to its end: the record's, once
        the leader has exited (its streams may end before it does)."""
        record = None
        while record is None:
            record = self.endpoints.exit_record("leader", _LIVENESS_POLL_MS, deadline)
        return self._recovered(record)

    def forget_spool(self) -> List[str]:
        """The spool's files, to remove now that its use is over, forgotten here."""
        spool, self._spool = self._spool, None
        self._spool_readable = self._spooling = False
        return [] if spool is None else spool.files()


class _Spooled(NamedTuple):
    """A piece of one stream's spool: its bytes past those held, how many more
    it holds (a read brings _SPOOL_PIECE at most), and whether the stream has
    ended (the spool then holds all of it)."""

    data: bytes
    left: int
    ended: bool


class _SpoolGone(Exception):
    """A spool was removed, or could not be written or read."""


# What the chore prints: for stdout, then stderr, "SIZE ENDED" and a line of base64.
_SPOOLED = re.compile(r"([0-9]{1,15}) ([01])\n([A-Za-z0-9+/=]*)\n" * 2)


def _spooled(held: int, size: str, ended: str, text: str) -> _Spooled:
    """One stream's piece, as the chore printed it, checked against the bytes held."""
    try:
        data = _a2b_base64(text, strict_mode=True)  # novermin: its own before 3.11
    except ValueError:
        raise ProtocolError("the reading of the spool carries invalid base64") from None
    if int(size) < held or len(data) != min(int(size) - held, _SPOOL_PIECE):
        raise ProtocolError("the spool does not hold the output already read")
    return _Spooled(data, int(size) - held - len(data), ended == "1")


class _Spool(NamedTuple):
    """The spool of one process in the sandbox (design item 19, see _SPOOL): each
    of its streams as the wrapper copied it into a file of its own, from the
    first byte, `limit` bytes at most; read a piece at a time by a chore
    (_SPOOL_READ) through the exec endpoint, which reading twice does no harm."""

    sandbox: _Sandbox
    path: str
    limit: int

    def read(self, held: Mapping[str, int], deadline: _Deadline) -> List[_Spooled]:
        """What each stream's spool holds past the bytes `held` of it; _SpoolGone
        when a spool is gone or cannot be read."""
        argv = ["bash", "-c", _SPOOL_READ, "createos_exec-spool", self.path]
        argv += [str(held[stream]) for stream in _STREAMS] + [str(_SPOOL_PIECE)]
        ran = self.sandbox.exec(argv, "reading of the spool", deadline, repeatable=True)
        if ran.exited != 0:
            raise _SpoolGone()  # 3: a spool is gone; another: it cannot be read
        said = _SPOOLED.fullmatch(ran.stdout)
        if said is None:
            raise ProtocolError("the reading of the spool says nothing this client knows")
        fields = said.groups()
        return [_spooled(held[s], *fields[3 * i : 3 * i + 3]) for i, s in enumerate(_STREAMS)]

    def files(self) -> List[str]:
        """Both spools and their ends."""
        return [
            f"{self.path}.{ending}" for ending in ("stdout", "stderr", "stdout.end", "stderr.end")
        ]


# ==========================================================================
# 5. Launch: the plan, the staged secrets, one creation
# ==========================================================================
#
# The wrapper script and the private file of env and stdin (never in the
# process record), then the creation, exactly once: a 4xx means not
# created; a 429 is waited out and sent again only once a listing shows no
# process with the run's marker; an unknown outcome is looked for by that
# marker, and reported as unconfirmed when it cannot be found.


class _Plan(NamedTuple):
    """What is sent to create the process, the private file staged beforehand,
    and where the process's spool will be (None: it has none)."""

    marker: str
    body: Dict[str, Any]
    staged_path: Optional[str]
    staged: Optional[bytes]
    spool: Optional[str]


def _plan(
    command: Command, options: _Options, grace: float = _TERMINATE_GRACE, *, spooled: bool = True
) -> _Plan:
    """Build the bash wrapper that runs the command: `bash -c WRAPPER MARKER ARGV...`.

    The random marker ($0) lets an ambiguously created process be found again.

    Env values and stdin are secrets: anyone listing the sandbox's processes
    reads cmd/args. They travel in a private file instead, which the wrapper
    opens as its stdin, reads the variables from and removes at once. With
    stdin=PIPE, and on a terminal (`pty`), the wrapper reads that file on a
    descriptor of its own and leaves its stdin, the service's pipe or the
    terminal, to the command; a terminal gets TERM=xterm-256color unless
    `env` gives its own.

    With a `timeout`, the wrapper forks a watchdog (see _WATCHDOG) that keeps
    the deadline in the sandbox, with `grace` seconds between SIGTERM and
    SIGKILL; without one, nothing is added.

    A pipe process's streams are `spooled` first of all, so that every byte
    they carry is in the spool too (see _SPOOL); a terminal's are not.
    """
    marker = _MARKER_PREFIX + secrets.token_hex(12)
    argv = _argv(command, options.shell)
    piped = isinstance(options.stdin, _Pipe) or options.pty is not None
    stdin = None if piped else (options.stdin if options.input is None else options.input)
    staged = _staged_bytes(options.env, stdin) if options.env or stdin is not None else None
    staged_path = f"/tmp/.{marker}" if staged is not None else None
    spool = f"/tmp/.{marker}" if spooled and options.pty is None else None
    lines = [_WRAPPER_HEAD, _SPOOLING, _NAMED] if spool is not None else [_WRAPPER_HEAD, _NAMED]
    if options.pty is not None and "TERM" not in (options.env or {}):
        lines.append(_TERMINAL_TYPE)
    if staged_path is not None:
        lines.extend(_reading_staged(staged_path, marker, piped))
    elif not piped:
        lines.append("exec 0</dev/null")
    if options.cwd is not None:
        lines.extend([_ENTER, _call("_cx_enter", _checked_text("cwd", options.cwd))])
    # The command travels as the wrapper's positional parameters, untouched by
    # any quoting, each its own exec string (Linux caps one at 128 KiB).
    if not options.shell:
        lines.extend([_FIND_PROGRAM, '_cx_find_program "$1"'])
    if options.timeout is not None:
        lines.extend(_watchdog(options.timeout, grace))
    lines.append(_RUN_SCRIPT if options.shell else _RUN_ARGV)
    body: Dict[str, Any] = {"cmd": "bash", "args": ["-c", "\n".join(lines) + "\n", marker, *argv]}
    if isinstance(options.pty, tuple):  # checked: (rows, cols)
        body["pty"] = dict(zip(("rows", "cols"), options.pty))
    return _Plan(marker, body, staged_path, staged, spool)


_MARKER_PREFIX = "createos_exec-"
_MARKER = re.compile(re.escape(_MARKER_PREFIX) + r"[0-9a-f]{24}\Z")


def _given_command(cmd: Any, args: Any) -> Tuple[Any, bool]:
    """A listed process's command as it was given, and whether createos_exec
    started it: its argv (or shell=True script) out of the wrapper, else
    `cmd` + `args` as listed."""
    args = args if isinstance(args, list) else []
    ours = (
        cmd == "bash"
        and len(args) >= 3
        and args[0] == "-c"
        and isinstance(args[1], str)
        and isinstance(args[2], str)
        and _MARKER.match(args[2]) is not None
    )
    if not ours:
        return ([cmd] if isinstance(cmd, str) else []) + args, False
    argv = args[3:]
    if args[1].rstrip("\n").endswith(_RUN_SCRIPT) and len(argv) == 1:
        return argv[0], True
    return argv, True


def _spool_of(sandbox: _Sandbox, record: Dict[str, Any]) -> Optional[_Spool]:
    """The spool of a listed process, where its wrapper made one (see _SPOOLING)."""
    args: Any = record.get("args")
    if not _given_command(record.get("cmd"), args)[1]:
        return None
    found = _SPOOL_CALL.search(args[1])
    return None if found is None else _Spool(sandbox, f"/tmp/.{args[2]}", int(found[1]) * 1024)


def _argv(command: Command, shell: bool) -> List[str]:
    if shell:
        if not isinstance(command, str):
            raise ConfigError("With shell=True the command must be one string.")
        return [_checked_text("The shell script", command)]
    if isinstance(command, str):
        command = [command]
    if isinstance(command, (bytes, bytearray)) or not isinstance(command, Sequence):
        raise ConfigError(
            f"The command must be a list of strings (or one string), not {type(command).__name__}."
        )
    if not command:
        raise ConfigError("The command is empty: give at least the program to run.")
    for arg in command:
        if type(arg) is not str or "\0" in arg:
            _checked_text("Each command argument", arg)  # says which is wrong
    return list(command)


def _checked_text(what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a string, not {type(value).__name__}.")
    if "\0" in value:
        raise ConfigError(f"{what} contains a NUL byte, which no argument or file name can hold.")
    return value


def _staged_bytes(env: Optional[Dict[str, str]], stdin: Any) -> bytes:
    """NUL-terminated NAME=value entries, an empty entry, then the stdin bytes."""
    entries = []
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise ConfigError(
                f"Invalid env name {_shown(name)}: names must match [A-Za-z_][A-Za-z0-9_]*."
            )
        what = f"The value of env {name}"
        entries.append(
            name.encode("ascii") + b"=" + _utf8(what, _checked_text(what, value)) + b"\0"
        )
    if isinstance(stdin, str):
        stdin = _utf8("stdin", stdin)
    elif stdin is not None and not isinstance(stdin, (bytes, bytearray)):
        raise ConfigError(f"stdin must be str, bytes or None, not {type(stdin).__name__}.")
    return b"".join(entries) + b"\0" + bytes(stdin or b"")


def _utf8(what: str, text: str) -> bytes:
    """UTF-8 of a secret (env or stdin)."""
    return _encoded(text, "utf-8", f"{what} is not valid Unicode (pass bytes for binary stdin).")


def _encoded(text: str, encoding: str, complaint: str) -> bytes:
    """`text` encoded; the error for what cannot be encoded must not carry the text."""
    try:
        encoded: Optional[bytes] = text.encode(encoding)
    except UnicodeEncodeError:
        encoded = None  # raised below, outside the handler: no __context__ holding the text
    if encoded is None:
        raise ConfigError(complaint)
    return encoded


@dataclasses.dataclass(frozen=True)
class _Launch:
    """Staging the private file and creating the process, exactly once: the
    policy; the requests are the sandbox's."""

    sandbox: _Sandbox
    plan: _Plan

    def _stage(self, path: str, staged: bytes, deadline: _Deadline) -> None:
        if deadline.cancelled():
            raise CancelledError()  # before anything is written
        try:
            operation = "staging of env and stdin"
            write = functools.partial(self.sandbox.put_file, path, staged, operation)
            self.sandbox.transport.retried(write, deadline)
        except CancelledError:
            self.unstage(deadline.cancel)  # an attempt before the wait may have written it
            raise

    def create(self, deadline: _Deadline) -> Tuple[_Endpoints, bool]:
        """Stage the private file, if any, then create the process: the new process,
        and whether it had to be found by its marker.

        A 4xx other than 429, or a refused connection, means no process; a
        lost answer or a 5xx means it may exist, so look for it: neither is
        sent again. A 429 is the service's "not done": it is waited out under
        the retry policy and within `deadline`, and the creation sent again
        only once a listing shows no process with the marker. After a cancel
        nothing is sent again. An error raised once an attempt may have
        reached the service means that no process exists (see _left_behind).
        """
        plan = self.plan
        if plan.staged_path is not None and plan.staged is not None:
            self._stage(plan.staged_path, plan.staged, deadline)
        budget: Optional[_Budget] = None  # of the 429s, once there is one
        reached = False  # whether an attempt may have reached the service
        try:
            while not deadline.cancelled():
                try:
                    answer = self.sandbox.create(plan.body, deadline)
                except ProtocolError as unreadable:
                    return self._unreadable(unreadable), True
                if not isinstance(answer, _Retryable):
                    return answer, False
                if answer.status != 429:
                    return self._unanswered(answer), True
                reached = True  # a proxy may answer 429 to a request it forwarded
                budget = budget or _Budget(self.sandbox.transport.retry)
                found = self._after_refusal(answer, budget, deadline)
                if found is not None:
                    return found, True
            raise CancelledError()
        except KeyboardInterrupt:
            self._abandon()
            raise
        except CleanupError:
            raise
        except CreateOSError as error:
            if reached:
                self._left_behind(error, deadline.cancel)
            self.unstage(deadline.cancel)
            raise

    def _unanswered(self, failure: _Retryable) -> _Endpoints:
        """After a failure other than 429: no process if nothing was sent, else find it."""
        if not failure.maybe_sent:
            raise failure.final(None) from failure.__cause__
        logger.info("Process creation is ambiguous; looking for it by its marker")
        return self._find_created()

    def _after_refusal(
        self, refusal: _Retryable, budget: _Budget, deadline: _Deadline
    ) -> Optional[_Endpoints]:
        """After a 429: wait, then list. The process, if the refused request went
        through after all, or None to send it again. APIError 429 when the retry
        policy or the deadline runs out (or the listing fails); CancelledError
        when a cancel ends the wait or the listing."""
        delay = budget.delay_within(refusal.retry_after, deadline)
        if delay is None:
            raise refusal.final(None)
        logger.info("Process creation was answered 429; asking again in %.2f s", delay)
        deadline.pause(delay)
        try:
            found = self._marked(deadline)
        except CancelledError:
            raise
        except CreateOSError as problem:
            raise refusal.final(None) from problem
        if found is None and deadline.expired():
            raise refusal.final(None)
        return found

    def _left_behind(self, error: CreateOSError, hurry: Optional[threading.Event]) -> NoReturn:
        """Creation ends with `error` after an attempt that may have reached the
        service: the marker is looked up once more (under the cleanup's own
        deadline, which no cancel cuts), and a process found is terminated and
        that confirmed before `error` is raised; `error` then means that no
        process exists. CleanupError when either cannot be confirmed."""
        try:
            found = self._terminate_marked(hurry)
        except CleanupError as cleanup:
            if cleanup.__cause__ is None:
                raise cleanup from error
            raise
        self.unstage(hurry)
        if found is not None and isinstance(error, CancelledError):
            raise CancelledError(process_id=found)  # created after all, and terminated
        raise error

    def _terminate_marked(self, hurry: Optional[threading.Event] = None) -> Optional[str]:
        """Terminate the process with the run's marker, if the listing shows one, and
        return its id; CleanupError when the listing or the termination fails."""
        found = self._marked_or_unconfirmed(_Deadline(kind="cleanup", hurry=hurry))
        if found is None:
            return None
        logger.info("Terminating process %s: its creation ended in error", found.process_id)
        found.delete(hurry=hurry)
        return found.process_id

    def _unreadable(self, unreadable: ProtocolError) -> _Endpoints:
        """Created, but unnamed: it may run unseen. Find it by its marker."""
        logger.info("Process creation answer is unreadable; looking for it by its marker")
        try:
            return self._find_created()
        except CleanupError as cleanup:
            raise cleanup from unreadable

    def _find_created(self) -> _Endpoints:
        """Find the process by the marker in its arguments, or fail as unconfirmed."""
        found = self._marked_or_unconfirmed(_ENDLESS)
        if found is None:
            self.unstage()
            raise CleanupError(creation_unconfirmed=True)
        return found

    def _marked(self, deadline: _Deadline) -> Optional[_Endpoints]:
        """The process with the run's marker, or None when the listing shows none."""
        listed = self.sandbox.processes(deadline)
        mine = next((record for record in listed if self._has_marker(record)), None)
        if mine is None:
            return None
        process_id = _checked_process_id(mine.get("process_id"))
        logger.info("Found process %s by its marker; following it", process_id)
        return _Endpoints(self.sandbox, process_id, mine)

    def _marked_or_unconfirmed(self, deadline: _Deadline) -> Optional[_Endpoints]:
        """_marked(); a listing that fails leaves the creation unconfirmed."""
        try:
            return self._marked(deadline)
        except CreateOSError as exc:
            raise CleanupError(creation_unconfirmed=True) from exc

    def _has_marker(self, record: Any) -> bool:
        args = record.get("args") if isinstance(record, dict) else None
        return isinstance(args, list) and self.plan.marker in args

    def _abandon(self) -> None:
        """Ctrl-C while creating: find the process if it exists and terminate it."""
        try:
            self._terminate_marked()
        except CleanupError:
            logger.warning("Could not confirm that no process was left running")

    def staged_files(self) -> List[str]:
        """The staged secrets file, if there is one."""
        return [] if self.plan.staged_path is None else [self.plan.staged_path]

    def unstage(self, hurry: Optional[threading.Event] = None) -> None:
        """Remove the staged secrets file, best-effort, when the wrapper may not have;
        a cleanup, which `hurry` hurries through the pacing window."""
        self.sandbox.remove(self.staged_files(), "the staged env/stdin file", hurry)


# ==========================================================================
# 6. The service: what a sandbox and a process answer
# ==========================================================================
#
# One place for each request and for what each of its statuses means: the
# sandbox's (creation, the listing, its view, files, exec) and the
# process's (connect, wait, record, signal, delete, input, stdin, resize). Records
# are checked here, before anything reads them.


class _Sandbox:
    """The requests that one sandbox answers, and what each status means for it.

    404 to any of them: no sandbox with this id here (a wrong id, another
    region's, or one destroyed); 409: the sandbox is not running (pausing,
    paused, resuming), which nothing here waits out. To a creation, a 4xx
    other than 429 means no process, 429 means not done yet, and a lost
    answer or a 5xx a process that may exist: _Launch decides what follows.
    The view, the listing and a file written are asked under the retry
    policy (asking twice does no harm); a creation and an exec are sent once.
    """

    def __init__(self, transport: _Transport, sandbox_id: str) -> None:
        self.transport = transport
        self.sandbox_id = _checked_id("sandbox", sandbox_id)
        self.path = f"/v1/sandboxes/{self.sandbox_id}"

    def view(self, deadline: _Deadline) -> Dict[str, Any]:
        """The sandbox's own view (protocol 4.1): its `id`, its `status` (a word
        that may be new to this client) and what else the service tells."""
        response = self.transport.call(
            "GET", self.path, operation="sandbox lookup", deadline=deadline
        )
        view = _jsend_data(response, "sandbox lookup")
        if not isinstance(view, dict):
            raise ProtocolError("the sandbox's view is not an object")
        return view

    def info(self, deadline: _Deadline) -> SandboxInfo:
        """Its view as a SandboxInfo; one that the service does not know is "not found"."""
        try:
            status = self.view(deadline).get("status")
        except APIError as refused:
            if refused.status != 404:
                raise
            status = "not found"
        if not isinstance(status, str):
            raise ProtocolError("the sandbox's view has no status")
        return SandboxInfo(self.sandbox_id, status, status == "running")

    def resume(self, deadline: _Deadline, ask: bool = True) -> SandboxInfo:
        """Resume it if it is paused (`ask`; otherwise return it paused), and return
        once it runs: its view asked at a growing pace within `deadline`
        (_TimedOut; its cancel, CancelledError). SandboxGoneError when it is
        gone, or goes meanwhile; a SandboxError in a state this client does not
        know (nothing says that it ever runs again). A request the deadline cuts
        short ends the wait as the deadline does (_TimedOut), not as a network
        failure."""
        pace = _RESUME_POLL
        try:
            while True:
                info = self.info(deadline)
                kind = _not_running(info.status)
                if kind is None:
                    return info
                if kind is not SandboxPausedError:  # gone, or a state this client cannot wait on
                    raise kind(self.sandbox_id, info.status, status=404, operation="sandbox resume")
                if not ask and info.status not in _SANDBOX_ON_THE_WAY:
                    return info  # paused, and not to be resumed
                if info.status == "paused":  # 409: it moved meanwhile; its view says how
                    self.transport.call(
                        "POST",
                        self.path + "/resume",
                        operation="sandbox resume",
                        deadline=deadline,
                        json_body={},
                        ok_statuses=(409,),
                    ).close()
                deadline.pause(pace)
                deadline.check()
                pace = min(2 * pace, _RESUME_POLL_MAX)
        except TransportError:
            deadline.check()
            raise

    def diagnosed(
        self, error: CreateOSError, process_id: Optional[str] = None, after: Optional[int] = None
    ) -> CreateOSError:
        """What `error` (a 404 or 409 from a request to the sandbox, a stream that
        could not be resumed) means, once its view was asked, once: a
        SandboxPausedError (with the cursor, `after`), a SandboxGoneError, a
        SandboxError (a state this client does not know), or, while it runs,
        `error` itself, whose message then says so. A lookup that fails changes
        nothing."""
        word = self._status_once()
        if word is None:
            return error
        kind = _not_running(word)
        if kind is None:
            error.args = (f"{error} The sandbox {self.sandbox_id} {_sandbox_is(word)}.",)
            return error
        found = kind(
            self.sandbox_id,
            word,
            status=getattr(error, "status", 0),
            operation=getattr(error, "operation", "output connection"),
            process_id=process_id or error.process_id,
            after=after,
        )
        found.__cause__ = error
        return found

    def _status_once(self) -> Optional[str]:
        """Its status word, from one request ("not found" after a 404); None when
        the request fails or the answer does not say."""
        try:
            answer = self.transport.attempt(
                "GET", self.path, operation="sandbox lookup", deadline=_ENDLESS, ok_statuses=(404,)
            )
            if isinstance(answer, _Retryable):
                return None
            if answer.status_code == 404:
                answer.close()
                return "not found"
            view = _jsend_data(answer, "sandbox lookup")
        except CreateOSError:
            return None
        status = view.get("status") if isinstance(view, dict) else None
        return status if isinstance(status, str) else None

    def create(self, body: Dict[str, Any], deadline: _Deadline) -> Union[_Endpoints, _Retryable]:
        """One attempt to create a process, its timeouts cut to what remains of
        `deadline`: the new process, or the failure. ProtocolError when the
        answer does not say which process was created (it may run all the same)."""
        try:
            answer = self.transport.send(
                "POST",
                self.path + "/processes",
                operation="process creation",
                deadline=deadline,
                json_body=body,
            )
        except _Retryable as failure:
            return failure  # returned: the error raised for it must not have it as context
        record = _jsend_data(answer, "process creation")
        if not isinstance(record, dict):
            raise ProtocolError("the created process record is not an object")
        return _Endpoints(self, _checked_process_id(record.get("process_id")), record)

    def processes(self, deadline: _Deadline) -> Iterator[Any]:
        """Its process records, page after page (a bounded number of them),
        within `deadline` and a cleanup_timeout of their own."""
        transport = self.transport
        own = time.monotonic() + transport.cleanup_timeout
        deadline = deadline._replace(at=own if deadline.at is None else min(own, deadline.at))
        offset = 0
        params: Optional[Dict[str, int]] = None  # the first page as the service chooses it
        for _ in range(_LISTING_PAGES):
            response = transport.call(
                "GET",
                self.path + "/processes",
                operation="process listing",
                deadline=deadline,
                params=params,
            )
            records, following = _listing_page(_jsend_data(response, "process listing"), offset)
            yield from records
            if following is None:
                return
            offset = following
            params = {"limit": _LISTING_PAGE_SIZE, "offset": offset}
        raise ProtocolError("the process listing has more pages than this client reads")

    def put_file(self, path: str, body: Any, operation: str, deadline: _Deadline) -> None:
        """One attempt to write `body` (bytes, or an iterator of pieces: chunked) to
        the file at `path` (absolute), replacing it in place."""
        self.transport.send(
            "PUT",
            self.path + "/files",
            operation=operation,
            deadline=deadline,
            params={"path": path},
            data=body,
        ).close()

    def get_file(self, path: str, operation: str, deadline: _Deadline) -> requests.Response:
        """One attempt to read the file at `path` (absolute): its raw bytes, streamed."""
        transport = self.transport
        return transport.send(
            "GET",
            self.path + "/files",
            operation=operation,
            deadline=deadline,
            read_timeout=transport.stream_idle_timeout,
            params={"path": path},
            stream=True,
        )

    def exec(
        self,
        argv: List[str],
        operation: str,
        deadline: _Deadline,
        *,
        repeatable: bool = False,
        read_timeout: Optional[float] = None,
    ) -> _Ran:
        """Run a short chore to its end and say how it ended: one attempt (a
        command run twice is not run once) unless it is `repeatable` (it ends
        the same however often it runs), each answer awaited for `read_timeout`
        (by default a cleanup_timeout) at most."""
        transport = self.transport

        def once(now: _Deadline) -> _Ran:
            answer = transport.send(
                "POST",
                self.path + "/exec",
                operation=operation,
                read_timeout=read_timeout or transport.cleanup_timeout,
                deadline=now,
                json_body={"cmd": argv[0], "args": argv[1:]},
            )
            return _ran(_jsend_data(answer, operation), operation)

        return transport.retried(once, deadline, repeatable=repeatable)

    def exec_output(self, argv: List[str], operation: str, deadline: _Deadline) -> _ExecOutput:
        """One attempt at a chore whose stdout is read as it comes: a streamed exec
        (docs/protocol.md 6), its heartbeats awaited as a stream's are."""
        transport = self.transport
        response = transport.send(
            "POST",
            self.path + "/exec",
            operation=operation,
            deadline=deadline,
            read_timeout=transport.stream_idle_timeout,
            json_body={"cmd": argv[0], "args": argv[1:], "stream": True},
            stream=True,
        )
        return _ExecOutput(response, operation, transport.base)

    def remove(
        self, path: Union[str, Sequence[str]], what: str, hurry: Optional[threading.Event] = None
    ) -> None:
        """Remove a file this client left at `path` (or each of several, if any),
        best-effort, within a cleanup_timeout: `what` names it in the warning when
        that fails."""
        if not path:
            return
        now = time.monotonic()
        cleanup = _Deadline.after(self.transport.cleanup_timeout, "cleanup", now, hurry=hurry)
        paths = [path] if isinstance(path, str) else list(path)
        try:
            self.exec(["rm", "-f", "--", *paths], f"removal of {what}", cleanup)
        except CreateOSError:
            logger.warning("Could not remove %s from the sandbox", what)


class _Endpoints:
    """The requests that one process answers, and what each status means for it.

    Every process here was created through this origin or found there
    first (another region's API answers 404 for a process it never had), so
    404 to a DELETE means gone. 408 to a `wait` is a long-poll that expired;
    409 to a signal, a leader that has exited; 410 to a connect, output
    evicted before it was read.
    """

    def __init__(
        self, sandbox: _Sandbox, process_id: str, record: Optional[Dict[str, Any]] = None
    ) -> None:
        self.sandbox = sandbox
        self.transport = sandbox.transport
        self.sandbox_id = sandbox.sandbox_id
        self.process_id = process_id
        # The leader's pid, as the last record that showed one said.
        self.pid = None if record is None else _leader_pid(record)
        self._path = f"{sandbox.path}/processes/{process_id}"

    def cleanup_deadline(
        self, cancel: Optional[threading.Event] = None, hurry: Optional[threading.Event] = None
    ) -> _Deadline:
        """A fresh deadline of cleanup_timeout, from now, with its cancel or its hurry."""
        now = time.monotonic()
        return _Deadline.after(self.transport.cleanup_timeout, "cleanup", now, cancel, hurry)

    def connect(self, after: int, deadline: _Deadline) -> requests.Response:
        """The output stream from seq `after` + 1; OutputEvictedError on 410."""
        transport = self.transport
        response = transport.send(
            "GET",
            self._path + "/connect",
            operation="output connection",
            read_timeout=transport.stream_idle_timeout,
            deadline=deadline,
            process_id=self.process_id,
            params={"after": after},
            stream=True,
            ok_statuses=(410,),
        )
        if response.status_code == 410:
            raise OutputEvictedError(_evicted_seq(response), process_id=self.process_id)
        return response

    def exit_record(
        self, scope: str, poll_ms: int, deadline: _Deadline
    ) -> Optional[Dict[str, Any]]:
        """One `wait` long-poll: the exited process's record, or None when it expired."""
        transport = self.transport
        response = transport.call(
            "GET",
            self._path + "/wait",
            operation="exit status wait",
            deadline=deadline,
            process_id=self.process_id,
            read_timeout=poll_ms / 1000 + transport.request_timeout,
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

    def record(self, deadline: _Deadline) -> Dict[str, Any]:
        """The process record, asked under the retry policy: it shows the process exists."""
        response = self.transport.call(
            "GET", self._path, operation="process lookup", deadline=deadline
        )
        return self._checked_record(_jsend_data(response, "process lookup"))

    def current_record(self) -> Dict[str, Any]:
        """The process record as it is now: one request, not retried."""
        answer = self._once("GET", "", "process status")
        return self._checked_record(_jsend_data(answer, "process status"))

    def exited(self) -> Optional[_Exit]:
        """The exit status in the process record (one request), or None while its leader runs."""
        record = self.current_record()
        if record.get("leader_exited") is not True:
            return None
        exited = _exit_status(record)
        if exited is None:
            raise ProtocolError("the process record has no exit status", process_id=self.process_id)
        return exited

    def signal(self, name: str) -> None:
        """Signal the process group; a leader that has exited (409) has nothing to signal."""
        self._once(
            "POST", "/signal", "signal delivery", json_body={"signal": name}, ok_statuses=(409,)
        ).close()

    def delete(
        self, grace: Optional[float] = None, hurry: Optional[threading.Event] = None
    ) -> Optional[Dict[str, Any]]:
        """Terminate the tree with a grace period (None: the usual one), confirmed,
        under a fresh deadline of its own, whose waits `hurry` cuts short: the
        process's final record (None after a 404).

        Raises CleanupError unless the answer is `tree_exited: true`, or 404.
        """
        transport = self.transport
        if grace is None:
            grace = transport.termination_grace
        deadline = self.cleanup_deadline(hurry=hurry)
        try:
            response = transport.call(
                "DELETE",
                self._path,
                operation="process cleanup",
                deadline=deadline,
                process_id=self.process_id,
                read_timeout=grace + transport.request_timeout,
                params={"grace_ms": int(grace * 1000)},
                ok_statuses=(404, 409),
            )
            if response.status_code in (404, 409):
                response.close()
                refused = self.sandbox_runs(APIError(response.status_code, "process cleanup"))
                if refused.status == 409:
                    raise refused
                return None
            record = _jsend_data(response, "process cleanup")
        except SandboxError:
            raise
        except CreateOSError as exc:
            logger.warning("Termination of %s failed", self.process_id)
            raise CleanupError(
                process_id=self.process_id,
                sandbox_id=self.sandbox_id,
                unreachable=isinstance(exc, TransportError),
            ) from exc
        if not isinstance(record, dict) or record.get("tree_exited") is not True:
            logger.warning("Termination of %s is unconfirmed", self.process_id)
            raise CleanupError(process_id=self.process_id)
        return record

    def sandbox_runs(self, refused: APIError) -> APIError:
        """`refused` (a 404 or 409 of this process), once the sandbox's view said it
        runs (or could not say); the SandboxError is raised when it does not."""
        looked = self.sandbox.diagnosed(refused, self.process_id)
        if isinstance(looked, SandboxError):
            raise looked
        return refused

    def input(self, body: bytes, deadline: _Deadline) -> Union[requests.Response, _Retryable]:
        """One attempt to write a piece to stdin (a JSON body): never sent twice here.
        404 and 409 (closed, or the process ended) are answers too."""
        return self.transport.attempt(
            "POST",
            self._path + "/input",
            operation="stdin write",
            deadline=deadline,
            process_id=self.process_id,
            data=body,
            data_type="application/json",
            ok_statuses=(404, 409),
        )

    def close_stdin(self, deadline: _Deadline) -> None:
        """EOF on stdin; closing twice does no harm, so unlike a write it is retried.
        404 and 409 (closed already, the process ended) are fine."""
        # A JSON body: the service's forwarder refuses a POST of no type.
        self._post_twice_harmless("/stdin/close", "stdin close", {}, deadline)

    def resize(self, size: Tuple[int, int], deadline: _Deadline) -> None:
        """The terminal's new size (rows, cols); the same size twice is one resize,
        so it is retried. 404 and 409 (the process ended) are fine."""
        body = dict(zip(("rows", "cols"), size))
        self._post_twice_harmless("/resize", "terminal resize", body, deadline)

    def _post_twice_harmless(
        self, rest: str, operation: str, body: Dict[str, Any], deadline: _Deadline
    ) -> None:
        self.transport.call(
            "POST",
            self._path + rest,
            operation=operation,
            deadline=deadline,
            process_id=self.process_id,
            json_body=body,
            ok_statuses=(404, 409),
        ).close()

    def _checked_record(self, record: Any) -> Dict[str, Any]:
        if not isinstance(record, dict):
            raise ProtocolError("the process record is not an object", process_id=self.process_id)
        self.pid = _leader_pid(record) or self.pid
        return record

    def _once(self, method: str, rest: str, operation: str, **request: Any) -> requests.Response:
        """One request, never retried: acting on the process twice may not be once."""
        answer = self.transport.attempt(
            method,
            self._path + rest,
            operation=operation,
            deadline=_ENDLESS,  # one attempt: its request timeout bounds it
            process_id=self.process_id,
            **request,
        )
        if isinstance(answer, _Retryable):
            raise answer.final(self.process_id) from answer.__cause__
        return answer


# Raw bytes per input request: base64 makes 4 of every 3, and with the JSON
# around them a request body stays under 256 KiB (docs/protocol.md 5.5), whether
# the service counts raw or encoded bytes.
_INPUT_PIECE = 3 * 65_520


class _StdinWriter:
    """The stdin of one process, written piece by piece, each confirmed before the next.

    A piece is sent again only when it certainly did not reach the process:
    the connection was never made, or a 429. After any other failure it may
    have arrived (a piece whose answer the deadline cut too), so nothing is
    re-sent: InputUnconfirmedError says how much of the write is confirmed.
    A 409 (stdin closed, the process ended) is a broken pipe. Writing and
    closing stop at their deadline (_TimedOut) or its cancel (CancelledError),
    waits between attempts included. Nothing written ever enters a message,
    a repr or a log record.
    """

    def __init__(self, endpoints: _Endpoints, encoding: Optional[str]) -> None:
        self._endpoints = endpoints
        self._process_id = endpoints.process_id
        self._encoding = encoding
        self._lock = threading.Lock()  # one write or close at a time: the pieces keep their order
        self._closed = False
        self._typed = threading.Condition()  # a terminal's keys, see type()
        self._waiting: List[bytearray] = []  # keys typed while a request is in flight
        self._next = 0  # the number of the request the waiting keys go in
        self._answered = -1  # the last request answered, or failed
        self._failed: Dict[int, CreateOSError] = {}

    def __repr__(self) -> str:
        return f"_StdinWriter(process_id={self._process_id!r}, closed={self._closed!r})"

    def write(self, data: Union[str, bytes], deadline: _Deadline, *, ended: bool = False) -> None:
        """Return once the service has accepted every byte of `data` (str is encoded
        with the run's encoding). StdinClosedError once closed, or `ended` (the
        run is known to be over); InputUnconfirmedError when a piece's fate is
        unknown."""
        payload = _input_bytes(data, self._encoding)
        with self._lock:
            if self._closed or ended:
                raise StdinClosedError(process_id=self._process_id)
            budget = _Budget(self._endpoints.transport.retry)
            view = memoryview(payload)
            for confirmed in range(0, len(payload), _INPUT_PIECE):
                piece = view[confirmed : confirmed + _INPUT_PIECE]
                self._send(piece, confirmed, budget, deadline)
                budget.progress()

    def type(self, data: Union[str, bytes], deadline: _Deadline, *, ended: bool = False) -> None:
        """A terminal's keys, from any number of threads, as a typist's: one request in
        flight, and the keys typed meanwhile wait and go together in the next. Each
        returns once the request its keys went in is accepted; when that request
        fails, every write in it raises its error, and nothing is sent again."""
        keys = bytearray(_input_bytes(data, self._encoding))  # its own object: taken back by it
        with self._typed:
            self._waiting.append(keys)
            mine = self._next
            while self._answered < mine and not self._turn_of(mine):
                if deadline.expired() or deadline.cancelled():
                    self._give_up(keys, mine, deadline)
                self._typed.wait(deadline.within(_PACING_POLL))
            if self._answered >= mine:
                failure = self._failed.get(mine)
                if failure is not None:
                    raise failure
                return
            batch, self._waiting = b"".join(self._waiting), []
            self._next += 1
        try:
            self.write(batch, deadline, ended=ended)
        except CreateOSError as error:
            self._failed[mine] = error
            raise
        finally:
            with self._typed:
                self._answered = mine
                self._typed.notify_all()

    def _turn_of(self, request: int) -> bool:
        """Whether `request` may go now: the one before it answered, and it not taken yet."""
        return self._answered == request - 1 and self._next == request

    def _give_up(self, keys: bytearray, mine: int, deadline: _Deadline) -> NoReturn:
        """The deadline came while the keys waited: taken back while their request
        has not left (the deadline's error), else their fate is the request's."""
        if self._next == mine:
            del self._waiting[next(i for i, kept in enumerate(self._waiting) if kept is keys)]
            deadline.check(self._process_id)
        raise InputUnconfirmedError(0, process_id=self._process_id)

    def close(self, deadline: _Deadline) -> None:
        """EOF on the process's stdin; a second close, or one after the end, is fine."""
        with self._lock:
            if self._closed:
                return
            try:
                self._endpoints.close_stdin(deadline)
            except CreateOSError:
                deadline.check(self._process_id)  # the deadline cut the close short
                raise
            self._closed = True

    def _send(
        self, piece: memoryview, confirmed: int, budget: _Budget, deadline: _Deadline
    ) -> None:
        # Base64 needs no JSON escaping: the body is built as bytes, not by json.dumps.
        body = b'{"data_base64":"' + binascii.b2a_base64(piece, newline=False) + b'"}'
        while True:
            deadline.check(self._process_id)
            answer = self._endpoints.input(body, deadline)
            if not isinstance(answer, _Retryable):
                return self._accepted(answer)
            if answer.maybe_sent and answer.status != 429:
                raise InputUnconfirmedError(
                    confirmed, process_id=self._process_id
                ) from answer.__cause__
            delay = budget.next_delay(answer.retry_after)
            if delay is None:
                raise InputUnconfirmedError(
                    confirmed, unsent=True, process_id=self._process_id
                ) from answer.__cause__
            deadline.pause(delay)

    def _accepted(self, response: requests.Response) -> None:
        """A 2xx accepted the piece (its input_seq is not needed); 404 or 409: no pipe,
        when the sandbox runs (a SandboxError otherwise)."""
        response.close()
        if response.status_code in (404, 409):
            self._endpoints.sandbox_runs(APIError(response.status_code, "stdin write"))
            self._closed = True
            raise StdinClosedError(process_id=self._process_id)


def _input_bytes(data: Any, encoding: Optional[str]) -> bytes:
    """The bytes of a write() (None: a run of text=False takes bytes only); the
    error for text that cannot be encoded does not carry it."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if encoding is None:
        raise ConfigError("write() takes bytes with text=False, as Popen's binary stdin.")
    if not isinstance(data, str):
        raise ConfigError("write() takes str or bytes.")
    complaint = "The input cannot be encoded with the run's encoding; pass bytes."
    return _encoded(data, encoding, complaint)


def _listing_page(listing: Any, offset: int) -> Tuple[List[Any], Optional[int]]:
    """The records of a page of the process listing, and the offset of the next page.

    Either `{"processes": [...]}`, all at once, or the paginated form of the
    vendor's other lists, `{"data": [...], "pagination": {"total": N, ...}}`;
    anything else fails closed.
    """
    if not isinstance(listing, dict):
        raise ProtocolError("the process listing is not an object")
    if "pagination" not in listing and isinstance(listing.get("processes"), list):
        return listing["processes"], None
    records, page = listing.get("data"), listing.get("pagination")
    if not isinstance(page, dict):
        page = {}
    total: Any = page.get("total")
    if not isinstance(records, list) or not _is_int(total) or page.get("offset", offset) != offset:
        raise ProtocolError("the process listing is in no form this client knows")
    following = offset + len(records)
    if following >= total:
        return records, None
    if not records:
        raise ProtocolError("a page of the process listing is empty before its end")
    return records, following


def _checked_process_id(value: Any) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise ProtocolError("a process record has an invalid process_id")
    return value


def _process_info(record: Any) -> ProcessInfo:
    """A listed (or looked up) process record as the public ProcessInfo."""
    if not isinstance(record, dict):
        raise ProtocolError("a process record is not an object")
    args, ours = _given_command(record.get("cmd"), record.get("args"))
    leader_exited = record.get("leader_exited") is True
    exited = _exit_status(record) if leader_exited else None
    return ProcessInfo(
        process_id=_checked_process_id(record.get("process_id")),
        args=args,
        state="exited" if leader_exited else "running",
        exit_code=None if exited is None else exited.exit_code,
        signal=None if exited is None else exited.signal,
        ours=ours,
        pid=_leader_pid(record),
    )


def _leader_pid(record: Dict[str, Any]) -> Optional[int]:
    """The leader's pid in the record, or None when it shows none (yet)."""
    pid: Any = record.get("pid")
    return int(pid) if _is_int(pid) and pid >= 1 else None


def _ended_by_deadline(record: Dict[str, Any], timeout: float) -> bool:
    """Whether an exited process's record shows its deadline ended it, not the program.

    The sandbox's watchdog fires `timeout` after the wrapper starts, which is
    after the record's created_at: a process that finished sooner than that
    ended on its own. Both times are the sandbox's clock, so no local clock
    is compared with them. A record that does not tell (a time missing or
    unreadable) counts as ended by the deadline: the client's own view.
    """
    created, finished = (_rfc3339(record.get(name)) for name in ("created_at", "finished_at"))
    if created is None or finished is None:
        return True
    return finished - created >= timeout


_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})"
    r"(?:\.([0-9]{1,9}))?(?:[Zz]|([+-])([0-9]{2}):([0-9]{2}))\Z"
)


def _rfc3339(value: Any) -> Optional[float]:
    """Seconds since the epoch of an RFC 3339 time ("…T…Z", Go's nanoseconds too), else None.

    By hand: datetime.fromisoformat reads neither "Z" nor 9 digits before Python 3.11.
    """
    match = _RFC3339.match(value) if isinstance(value, str) else None
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(part) for part in match.groups()[:6])
    fraction, sign, offset_hours, offset_minutes = match.groups()[6:]
    try:
        when = datetime.datetime(
            year, month, day, hour, minute, min(second, 59), tzinfo=datetime.timezone.utc
        )
    except ValueError:
        return None
    seconds = when.timestamp() + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)
    if sign is not None:
        offset = int(offset_hours) * 3600 + int(offset_minutes) * 60
        seconds -= offset if sign == "+" else -offset
    return seconds


def _output_seq(record: Dict[str, Any], field: str) -> int:
    """The record's output.newest_seq or output.oldest_seq: its journal's window."""
    output = record.get("output")
    seq: Any = output.get(field) if isinstance(output, dict) else None
    if not _is_int(seq) or seq < 0:
        raise ProtocolError(f"the process record has no valid output.{field}")
    return int(seq)


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


# ==========================================================================
# 7. Files: put() and get(), whole or not at all
# ==========================================================================
#
# The service writes and reads a file whole and in place, unchecked
# (docs/protocol.md 7: no Range, no rename). put() sends a file under a
# temporary name beside its path, and a script in the sandbox (_PUT_FINISH)
# checks its size and SHA-256, gives it its mode and renames it into place;
# get() has the sandbox describe it (_GET_DESCRIBE) while the bytes come,
# hashes them on their way to the destination, which a local path gets under
# a temporary name beside it, and checks both before anything is renamed or
# returned. A file larger than a piece that can be read again goes in pieces:
# each is staged beside the path, then checked and appended there
# (_PUT_APPEND) while the next one travels; a get() cut past a piece goes on
# from the last whole one, the rest cut into pieces in the sandbox (_GET_CUT),
# each checked. A directory moves as one tar archive, made as it is read here
# (_Tree) or by tar there (_cx_stream, printed through a streamed exec;
# _cx_pack, staged, where none is), unpacked into a staged tree whose
# manifest (_tree_record) is checked, and renamed into place whole. Every
# temporary file is removed on every failure, once the requests that write
# it were answered: an upload this side stops still ends whole (_Outgoing).
#
# At some 1,600 lines it is the longest section, and one on purpose: a file, a
# file in pieces and a tree share one shape (a temporary beside the
# destination, a check, one rename) and one set of failures (TransferError's
# reasons, every temporary removed), which a reader follows in one place; the
# scripts they run in the sandbox are with the others, in section 13.

# A file larger than this goes in pieces of this size when it can be read
# again: a cut costs at most one piece sent again. A piece costs two requests
# (its sending, its check), so that a GiB at 1 Gbit/s, 64 of them in 9 s,
# stays well within the service's rate limit of 300 a minute.
_PIECE_SIZE = 32 * 1024 * 1024
# How often a piece found different on arrival is sent or read again before the
# transfer fails as a mismatch.
_DAMAGED_RETRIES = 2
# How many pieces may wait in the sandbox for their check (the disk they take).
_PIECES_AHEAD = 4
# How many reads (_READ_SIZE each) may wait for this side's hashing thread.
_HASHED_AHEAD = 8
# The slowest a sandbox is taken to hash a file, in bytes per second: a check
# is awaited for request_timeout plus the time this rate takes over the file.
_HASH_RATE = 50e6
# The largest file the service takes ("Max 500 MB per file", docs/protocol.md 7):
# a check of a file whose size is not known yet is awaited for this one's time.
_SERVICE_FILE_LIMIT = 500e6
# What the packing of a directory (tar, then a hash of each file) is awaited
# for, in bytes read: a directory of 4 GB, read twice (190 s at _HASH_RATE).
_TREE_PACKED = 2 * 4e9
_TAR_BLOCK = 512
_DESCRIPTION_LIMIT = 4096  # the longest first line a streamed description may have
_PAX_LIMIT = 1024 * 1024  # the longest extended header (names, link targets) an archive may hold


class _Ran(NamedTuple):
    """How an exec ended: its exit code (None: it could not be started), its stdout."""

    exited: Optional[int]
    stdout: str


def _ran(data: Any, operation: str) -> _Ran:
    """The `result` of an exec's answer (docs/protocol.md 6)."""
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, dict):
        raise ProtocolError(f"the answer to {operation} holds no result")
    if result.get("error"):
        return _Ran(None, "")
    exited, stdout = result.get("exit_code"), result.get("stdout", "")
    if not _is_int(exited) or not isinstance(stdout, str):
        raise ProtocolError(f"the answer to {operation} holds no exit code")
    return _Ran(exited, stdout)


class _ExecOutput:
    """The stdout of a streamed exec as it comes (docs/protocol.md 6), then how
    it ended: its NDJSON frames read strictly, a frame of any other shape a
    ProtocolError; a stream that ends before its exit code was cut (_Retryable).
    stderr is read and left: the scripts say what went wrong by their exits."""

    _KEYS = frozenset({"stdout", "stderr", "error", "exit_code", "hb"})

    def __init__(self, response: requests.Response, operation: str, origin: str) -> None:
        self._response = response
        self._operation = operation
        self._origin = origin
        self._texts = self._stdout()
        self._kept = ""  # read past the last line() asked for
        self.exited: Optional[int] = None  # None once ended: the command could not start

    def line(self, most: int) -> str:
        """The next line of stdout, its "\n" included, or what is left ("" at its end)."""
        while "\n" not in self._kept and len(self._kept) <= most:
            text = next(self._texts, None)
            if text is None:
                break
            self._kept += text
        if len(self._kept.partition("\n")[0]) > most:
            raise ProtocolError(f"the answer to the {self._operation} has a line too long")
        line, newline, self._kept = self._kept.partition("\n")
        return line + newline

    def rest(self) -> Iterator[str]:
        """The rest of stdout, as it comes."""
        if self._kept:
            yield self._kept
            self._kept = ""
        yield from self._texts

    def close(self) -> None:
        self._texts.close()
        self._response.close()

    def _stdout(self) -> Generator[str, None, None]:
        with self._response, _transport_errors(self._operation, self._origin):
            for line in self._response.iter_lines(_READ_SIZE):
                if not line:
                    continue
                frame = self._frame(line)
                if "stdout" in frame:
                    yield frame["stdout"]
                if "error" in frame or "exit_code" in frame:
                    self.exited = frame.get("exit_code") if "error" not in frame else None
                    return
        address = _address(self._origin)
        raise _Retryable(self._operation, address=address, reason="reset")

    def _frame(self, line: bytes) -> Dict[str, Any]:
        try:
            frame = json.loads(line)
        except (ValueError, RecursionError):
            frame = None
        valid = (
            isinstance(frame, dict)
            and bool(frame)
            and self._KEYS.issuperset(frame)
            and all(isinstance(frame.get(key, ""), str) for key in ("stdout", "stderr", "error"))
            and frame.get("hb", True) is True
            and _is_int(frame.get("exit_code", 0))
        )
        if not valid:
            raise ProtocolError(f"the answer to the {self._operation} holds a frame not understood")
        return frame  # type: ignore[no-any-return]


def _hashing_time(transport: _Transport, size: float) -> float:
    """How long the answer to a check of a file of `size` bytes is awaited."""
    return transport.request_timeout + size / _HASH_RATE


def _temp_name(name: str) -> str:
    """A hidden name beside the file `name`, for its copy until it is checked."""
    return f".{name[:200]}.{secrets.token_hex(8)}.part"


def _position(file: Any) -> Optional[int]:
    """Where a file stands, when it can seek back there (None when it cannot)."""
    try:
        return int(file.tell()) if file.seekable() else None
    except (AttributeError, OSError, ValueError):
        return None


def _stamp(status: os.stat_result) -> Tuple[int, int]:
    """What a write to a file changes: its size and modification time."""
    return status.st_size, status.st_mtime_ns


def _padded(size: int) -> int:
    """`size` bytes of a tar archive's data, with the zeros that end its last block."""
    return -(-size // _TAR_BLOCK) * _TAR_BLOCK


def _tree_record(kind: str, mode: int, size: int, digest: bytes, path: bytes) -> bytes:
    """One entry of a directory's manifest, as _cx_records writes it in the sandbox:
    "f MODE SIZE SHA256", "d MODE 0 -" or, `digest` a symlink's target, "l 777 0
    LENGTH:TARGET"; then LENGTH:PATH (its path in the tree, "" for the tree itself),
    ended by a NUL. The manifest is its entries' records sorted bytewise; its
    SHA-256 stands for the whole tree."""
    if kind == "l":
        mode, digest = 0o777, b"%d:%s" % (len(digest), digest)
    return b"%s %o %d %s %d:%s\0" % (kind.encode(), mode, size, digest, len(path), path)


class _Carried(Exception):
    """An exception of the caller's (its source's read, its progress callback) raised
    where it would be taken for another (in the HTTP stack, in a request's body):
    args[0], raised again as itself once past it."""


class _SourceChanged(Exception):
    """put()'s source changed while it was read: args[0] is the local file."""


def _teller(progress: Optional[ProgressCallback], total: Optional[int]) -> Callable[[int], None]:
    """progress(done, total) as a transfer calls it, what it raises carried past the HTTP stack."""

    def tell(done: int) -> None:
        if progress is None:
            return
        try:
            progress(done, total)
        except Exception as error:
            raise _Carried(error) from None

    return tell


class _Described:
    """The sandbox's description of get()'s path, asked for in a thread of its own
    so that the bytes come meanwhile (the sandbox hashes while they travel);
    result() waits for it and raises what asking raised."""

    def __init__(self, ask: Callable[[], "_Remote"]) -> None:
        self._answer: Optional[_Remote] = None
        self._failure: Optional[BaseException] = None
        self._done = threading.Event()
        thread = threading.Thread(target=self._ask, args=(ask,), name="createos_exec-check")
        thread.daemon = True  # after Ctrl-C it ends with its exec's read timeout
        thread.start()

    def _ask(self, ask: Callable[[], "_Remote"]) -> None:
        try:
            self._answer = ask()
        except BaseException as exc:  # handed over by result()
            self._failure = exc
        finally:
            self._done.set()

    def failed(self) -> bool:
        return self._done.is_set() and self._failure is not None

    def result(self) -> "_Remote":
        self._done.wait()
        if self._failure is not None:
            raise self._failure
        assert self._answer is not None
        return self._answer


class _Hashing:
    """SHA-256s (hashlib's objects) of the bytes that pass, updated in a thread
    of their own beside the sending or the writing, as hashlib lets go of the
    GIL while it hashes: another core hashes while this one moves the bytes (a
    get() of 256 MiB over loopback, on two loaded cores: 0.77 s inline, 0.47 s
    so). At most a few reads wait. wait() returns once every read given is
    hashed; done() ends it, and must be called, whatever happened."""

    def __init__(self, *digests: Any) -> None:
        self._digests = [digest for digest in digests if digest is not None]
        self._reads: "queue.Queue[Optional[bytes]]" = queue.Queue(_HASHED_AHEAD)
        self._thread = threading.Thread(target=self._run, name="createos_exec-hash")
        self._thread.daemon = True
        self._thread.start()

    def _run(self) -> None:
        for read in iter(self._reads.get, None):
            for digest in self._digests:
                digest.update(read)
            self._reads.task_done()

    def update(self, read: bytes) -> None:
        self._reads.put(read)

    def wait(self) -> None:
        self._reads.join()

    def done(self) -> None:
        if self._thread.is_alive():
            self._reads.put(None)
            self._thread.join()


# --------------------------------------------------------------------------
# put(): what is sent


class _Outgoing:
    """One sending of put()'s source, from where its reader stands, of `length`
    bytes (None: to its end), as a request body: its pieces, each read, hashed
    (into `sha256`, and into `whole` when given, once finish() returned) and
    counted on its way, never past `length`; `tell` hears of each. Chunked,
    not of a Content-Length, so that what stops it midway (the source changed
    or failed while read, `tell` raised, a Ctrl-C came meanwhile) can end it
    there, whole: raise_stopped() raises that once the service has answered,
    having written what came, and only then is the temporary file removed. A
    request cut off instead (the network, a Ctrl-C while a piece is on its
    way) may be handled after that removal, and leave a part behind. An
    iterator, not file-like: the HTTP stack sends each piece whole, where it
    would read a file-like body 16 KiB at a time (a third slower over
    loopback, its hashing included)."""

    def __init__(
        self,
        read: Callable[[int], Any],
        length: Optional[int],
        tell: Callable[[int], None],
        whole: Optional[Any] = None,
    ) -> None:
        self._read = read
        self._length = length
        self._tell = tell
        self.sent = 0
        self.sha256 = hashlib.sha256()
        self.whole = whole
        self._stopped: Optional[BaseException] = None
        self._hashing = _Hashing(self.sha256, whole)

    def finish(self) -> None:
        self._hashing.done()

    def _piece(self) -> bytes:
        amount = _READ_SIZE if self._length is None else min(_READ_SIZE, self._length - self.sent)
        if not amount:
            return b""
        try:
            piece = bytes(self._read(amount) or b"")
        except OSError as error:
            raise _Carried(error) from None
        if not piece and self._length is not None:
            raise _SourceChanged(None)  # it ends before its size: it shrank while read
        self.sent += len(piece)
        self._hashing.update(piece)
        self._tell(self.sent)
        return piece

    def body(self) -> Iterator[bytes]:
        """What requests sends, chunked: the pieces, up to what stops them."""
        try:
            piece = self._piece()
            while piece:
                yield piece
                piece = self._piece()
        except (Exception, KeyboardInterrupt) as stopped:  # raised by raise_stopped()
            self._stopped = stopped  # a Ctrl-C as the source is read too: ended whole

    def raise_stopped(self) -> None:
        """What stopped the body, if anything did: the caller's own exception
        (its source's read, its progress callback, a Ctrl-C meanwhile), or
        _SourceChanged."""
        if isinstance(self._stopped, _Carried):
            raise self._stopped.args[0] from None
        if self._stopped is not None:
            raise self._stopped from None


class _Source:
    """put()'s source, a context manager: a local file, bytes or a binary file
    object, or a local directory (`tree`, read as its archive). reader(offset)
    reads it from `offset`, again whenever it is `rereadable` (a path, bytes, a
    file that seeks); a local path gives its `name` (kept inside a directory
    at the destination) and its `mode` (kept, as scp -p keeps it); check()
    raises _SourceChanged once a local file was written since it was opened."""

    def __init__(self, source: Any) -> None:
        self._opened: Any = None
        self.local: Optional[str] = None
        self.name: Optional[str] = None
        self.mode: Optional[int] = None
        self.tree: Optional[_Tree] = None
        self._stamp: Optional[Tuple[int, int]] = None
        if isinstance(source, (bytes, bytearray, memoryview)):
            source = io.BytesIO(source)
        elif isinstance(source, (str, os.PathLike)):
            self.local = os.fspath(source)
            self.name = os.path.basename(os.path.abspath(self.local))
            if os.path.isdir(self.local):
                source = self._opened = self.tree = _Tree(self.local)
            else:
                source = self._opened = open(self.local, "rb")  # closed on __exit__
                status = os.fstat(source.fileno())
                self.mode = stat.S_IMODE(status.st_mode)
                if stat.S_ISREG(status.st_mode):  # a pipe's (/dev/stdin's) moves as it is read
                    self._stamp = _stamp(status)
        elif not callable(getattr(source, "read", None)) or isinstance(source, io.TextIOBase):
            raise ConfigError(
                "put()'s source must be a local path, bytes, or a file opened in binary "
                f"mode ('rb'), not {type(source).__name__}."
            )
        self._file = source
        self._start = _position(source)
        self.size = None if self._start is None else source.seek(0, io.SEEK_END) - self._start
        self.rereadable = self._start is not None

    def reader(self, offset: int) -> Callable[[int], Any]:
        if self._start is not None:
            self._file.seek(self._start + offset)
        return self._file.read  # type: ignore[no-any-return]

    def check(self) -> None:
        if self._stamp is not None and _stamp(os.fstat(self._file.fileno())) != self._stamp:
            raise _SourceChanged(self.local)

    def __enter__(self) -> "_Source":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._opened is not None:
            self._opened.close()


class _Entry(NamedTuple):
    """One entry of a _Tree: its path in the tree ("" for the tree itself), its
    lstat, a symlink's target, where it starts in the archive and its header's length."""

    path: str
    status: os.stat_result
    target: str
    start: int
    header: int


class _Reading(NamedTuple):
    """The file of a _Tree being read: its entry's number, the file, where in it
    the next read starts, and its hash so far (None: not read from its start)."""

    entry: int
    file: BinaryIO
    at: int
    sha256: Optional[Any]


class _Tree:
    """A local directory as the tar archive put() sends, readable as a file that
    seeks: walked once, in order (symlinks kept as links), each entry's pax
    header (tarfile's) and data read where they lie when that part of the archive
    is read, so that any piece of it can be read again. Each file is hashed as
    its data goes by, for the manifest the sandbox checks the unpacked tree
    against; one that changed since the walk is _SourceChanged. `files` and
    `bytes` count its regular files and their bytes."""

    def __init__(self, root: str) -> None:
        self._root = root
        self._entries: List[_Entry] = []
        self.files = self.bytes = 0
        offset = 0
        for path, status in self._walk(root, ""):
            target = os.readlink(self._local(path)) if stat.S_ISLNK(status.st_mode) else ""
            entry = _Entry(path, status, target, offset, 0)
            entry = entry._replace(header=len(self._header(entry)))
            self._entries.append(entry)
            offset += entry.header + _padded(self._size_of(entry))
            if stat.S_ISREG(status.st_mode):
                self.files, self.bytes = self.files + 1, self.bytes + status.st_size
        self._starts = [entry.start for entry in self._entries]
        self._data_end = offset
        self._end = offset + 2 * _TAR_BLOCK  # two blocks of zeros end an archive
        self._at = 0
        self._reading: Optional[_Reading] = None
        self._sums: Dict[int, str] = {}

    @classmethod
    def _walk(cls, root: str, path: str) -> Iterator[Tuple[str, os.stat_result]]:
        """The tree's entries, each directory before what it holds, in name order;
        ConfigError for one that is no file, directory or symlink."""
        if not path:
            yield path, os.stat(root)  # a symlink named as the tree is followed, as by cp -r
        with os.scandir(os.path.join(root, path)) as listing:
            names = sorted(entry.name for entry in listing)
        for name in names:
            inside = f"{path}/{name}" if path else name
            status = os.lstat(os.path.join(root, inside))
            if stat.S_IFMT(status.st_mode) not in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):
                raise ConfigError(
                    f"put() moves files, directories and symlinks: {_shown(inside, 200)} in "
                    f"{_shown(root, 200)} is none of them (a device, FIFO or socket?)."
                )
            yield inside, status
            if stat.S_ISDIR(status.st_mode):
                yield from cls._walk(root, inside)

    def _local(self, path: str) -> str:
        return os.path.join(self._root, *path.split("/")) if path else self._root

    @staticmethod
    def _size_of(entry: _Entry) -> int:
        return entry.status.st_size if stat.S_ISREG(entry.status.st_mode) else 0

    @staticmethod
    def _header(entry: _Entry) -> bytes:
        """The entry's header: owner root (the sandbox's extracting user takes it
        over), whole-second times, pax records where a field does not fit."""
        info = tarfile.TarInfo(f"./{entry.path}" if entry.path else ".")
        mode = entry.status.st_mode
        info.mode, info.mtime = stat.S_IMODE(mode), int(entry.status.st_mtime)
        if stat.S_ISDIR(mode):
            info.type = tarfile.DIRTYPE
        elif stat.S_ISLNK(mode):
            info.type, info.linkname = tarfile.SYMTYPE, entry.target
        else:
            info.size = entry.status.st_size
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._at = offset + {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._end}[whence]
        return self._at

    def read(self, amount: int) -> bytes:
        parts = []
        left = min(amount, self._end - self._at)
        while left > 0:
            part = self._part(left)
            parts.append(part)
            self._at += len(part)
            left -= len(part)
        return b"".join(parts)

    def _part(self, most: int) -> bytes:
        """What the archive holds from where it stands: a header, data, or zeros."""
        if self._at >= self._data_end:
            return bytes(min(most, self._end - self._at))
        index = bisect.bisect_right(self._starts, self._at) - 1
        entry = self._entries[index]
        inside = self._at - entry.start
        if inside < entry.header:
            return self._header(entry)[inside : inside + most]
        inside -= entry.header
        size = self._size_of(entry)
        if inside < size:
            return self._data(index, inside, min(most, size - inside))
        return bytes(min(most, _padded(size) - inside))

    def _data(self, index: int, offset: int, amount: int) -> bytes:
        """`amount` bytes of a file from `offset`, hashed when read in order from its start."""
        reading = self._reading
        entry = self._entries[index]
        if reading is None or reading.entry != index:
            self.close()
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
            file = os.fdopen(os.open(self._local(entry.path), flags), "rb")
            reading = _Reading(index, file, 0, hashlib.sha256())
            self._reading = reading
            self._unchanged(reading)
        if offset != reading.at:
            reading.file.seek(offset)
            reading = reading._replace(at=offset, sha256=hashlib.sha256() if offset == 0 else None)
        data = reading.file.read(amount)
        if len(data) < amount:
            raise _SourceChanged(self._local(entry.path))
        if reading.sha256 is not None:
            reading.sha256.update(data)
        self._reading = reading = reading._replace(at=offset + amount)
        if reading.at == entry.status.st_size:
            self._unchanged(reading)
            if reading.sha256 is not None:
                self._sums[index] = reading.sha256.hexdigest()
        return data

    def _unchanged(self, reading: _Reading) -> None:
        entry = self._entries[reading.entry]
        if _stamp(os.fstat(reading.file.fileno())) != _stamp(entry.status):
            raise _SourceChanged(self._local(entry.path))

    def close(self) -> None:
        if self._reading is not None:
            self._reading.file.close()
            self._reading = None

    def manifest(self) -> str:
        """The SHA-256 of the tree's manifest (see _tree_record); a file whose data
        did not go by whole and in order is read again for it."""
        records = []
        for index, entry in enumerate(self._entries):
            mode, path = entry.status.st_mode, os.fsencode(entry.path)
            if stat.S_ISDIR(mode):
                records.append(_tree_record("d", stat.S_IMODE(mode), 0, b"-", path))
            elif stat.S_ISLNK(mode):
                records.append(_tree_record("l", 0, 0, os.fsencode(entry.target), path))
            else:
                if index not in self._sums:
                    self.seek(entry.start + entry.header)
                    self.read(entry.status.st_size)  # hashed on its way
                digest = self._sums.get(index) or hashlib.sha256().hexdigest()
                size = entry.status.st_size
                records.append(_tree_record("f", stat.S_IMODE(mode), size, digest.encode(), path))
        return hashlib.sha256(b"".join(sorted(records))).hexdigest()


# --------------------------------------------------------------------------
# put(): the upload


class _Upload:
    """put(): the source sent under a temporary name beside `path` (in pieces
    there when it is large and can be read again), checked there by the
    sandbox, given its mode and renamed into place; a directory's archive
    unpacked beside it, its tree checked, then renamed. On any failure every
    temporary file is removed and the destination is as it was."""

    def __init__(
        self,
        sandbox: _Sandbox,
        path: str,
        source: _Source,
        mode: Optional[int],
        progress: Optional[ProgressCallback],
    ) -> None:
        self.sandbox = sandbox
        self.path = path
        self.source = source
        kept = source.mode if mode is None else mode
        self.mode = "" if kept is None else format(kept, "o")
        head, name = posixpath.split(path)
        self.temp = posixpath.join(head, _temp_name(name))
        self.made: List[str] = []  # the temporary files this upload may have left there
        self.tell = _teller(progress, source.size)
        self.operation = f"upload of {_shown(path, 200)}"

    def run(self, deadline: _Deadline) -> FileInfo:
        try:
            try:
                return self._move(deadline)
            except _SourceChanged as changed:
                local = changed.args[0] or self.source.local
                raise TransferError(self.path, "source_changed", local=local) from None
        except BaseException:
            if self.made:
                self.sandbox.remove(self.made, f"the temporary copy of {_shown(self.path, 200)}")
            raise

    def _move(self, deadline: _Deadline) -> FileInfo:
        size = self.source.size
        if size is None or not self.source.rereadable or size <= _PIECE_SIZE:
            sent = self._send(self.temp, 0, size, deadline)
            self.source.check()
            return self._finish(sent.sent, sent.sha256.hexdigest(), deadline)
        return self._send_pieces(size, deadline)

    def _send_pieces(self, size: int, deadline: _Deadline) -> FileInfo:
        """The source in pieces, each staged beside the path, and checked and
        appended to the staged copy by the sandbox (_Checks) while the next ones
        travel; those the checks left (the first differed) checked again here."""
        self.made.append(self.temp)
        whole: Any = hashlib.sha256()
        checks = _Checks(functools.partial(self._append, deadline=deadline))
        try:
            for offset in range(0, size, _PIECE_SIZE):
                length = min(_PIECE_SIZE, size - offset)
                piece = f"{self.temp[: -len('.part')]}.{offset // _PIECE_SIZE}.part"
                sent = self._send(piece, offset, length, deadline, whole)
                whole = sent.whole
                self.source.check()
                if offset + length < size:
                    checks.landed(piece, offset, sent)
            left = checks.result()
            for again in left:
                self._appended_again(*again, deadline)
            if left:
                self.tell(size)  # back at the whole, after the pieces sent again
        finally:
            checks.stop()
        return self._finish(size, whole.hexdigest(), deadline, last=(piece, offset, sent))

    def _appended_again(
        self, piece: str, offset: int, sent: _Outgoing, deadline: _Deadline
    ) -> None:
        """A piece the checks left appended now: sent again while found different."""
        for _ in range(_DAMAGED_RETRIES):
            if self._append(piece, offset, sent, deadline):
                return
            sent = self._send(piece, offset, sent.sent, deadline)
        if not self._append(piece, offset, sent, deadline):
            raise TransferError(self.path, "mismatch")

    def _send(
        self,
        name: str,
        offset: int,
        length: Optional[int],
        deadline: _Deadline,
        whole: Optional[Any] = None,
    ) -> _Outgoing:
        """The source's `length` bytes from `offset` (None: to its end) written to
        `name`: at once where a refusal for want of a parent directory (404) can be
        followed by a second sending, else once the parent directory was made."""
        if self.source.rereadable:
            try:
                return self._put(name, offset, length, deadline, whole)
            except APIError as refused:
                if refused.status != 404:
                    raise
        self._make_parent(deadline)
        return self._put(name, offset, length, deadline, whole)

    def _put(
        self,
        name: str,
        offset: int,
        length: Optional[int],
        deadline: _Deadline,
        whole: Optional[Any],
    ) -> _Outgoing:
        sendings: List[_Outgoing] = []

        def once(now: _Deadline) -> _Outgoing:
            """One sending; what stopped its body is what happened, whatever the
            service answered to it, and ends the retries."""
            tell = functools.partial(self._told, offset)
            start = None if whole is None else whole.copy()  # each sending hashes from there
            sending = _Outgoing(self.source.reader(offset), length, tell, start)
            sendings.append(sending)
            try:
                self.sandbox.put_file(name, sending.body(), self.operation, now)
            except Exception:
                sending.raise_stopped()
                raise
            sending.raise_stopped()
            return sending

        if name not in self.made:
            self.made.append(name)
        try:
            return self.sandbox.transport.retried(once, deadline, repeatable=self.source.rereadable)
        except APIError as refused:
            if refused.status == 413:
                raise TransferError(self.path, "too_large", size=length) from None
            raise
        finally:
            for sending in sendings:
                sending.finish()

    def _told(self, offset: int, sent: int) -> None:
        self.tell(offset + sent)

    def _make_parent(self, deadline: _Deadline) -> None:
        argv = ["mkdir", "-p", "--", posixpath.dirname(self.path)]
        operation = f"creation of the directory of {_shown(self.path, 200)}"
        if self.sandbox.exec(argv, operation, deadline, repeatable=True).exited != 0:
            raise TransferError(self.path, "no_parent")

    def _append(self, piece: str, offset: int, sent: _Outgoing, deadline: _Deadline) -> bool:
        """Whether the sandbox found `piece` whole and appended it to the staged copy
        (False: it differs, and was removed)."""
        ran = self.sandbox.exec(
            ["bash", "-c", _PUT_APPEND, "createos_exec-put", self.temp, piece, str(offset)]
            + [str(sent.sent), sent.sha256.hexdigest()],
            f"check of {_shown(self.path, 200)}",
            deadline,
            repeatable=True,
            read_timeout=_hashing_time(self.sandbox.transport, sent.sent),
        )
        if ran.exited not in (0, 5):
            raise TransferError(self.path, _PUT_FAILURES.get(ran.exited or 0, "no_tools"))
        return ran.exited == 0

    def _finish(
        self,
        size: int,
        sha256: str,
        deadline: _Deadline,
        last: Optional[Tuple[str, int, _Outgoing]] = None,
    ) -> FileInfo:
        """The staged copy checked (whole; sent in pieces, the `last` one checked
        and appended first, and sent again should it differ), given its mode and
        renamed into place; a directory's archive unpacked and its tree checked."""
        tree = self.source.tree
        manifest = "" if tree is None else tree.manifest()
        if tree is None:
            finish = ["file", self.path, str(size), sha256, self.mode, self.source.name or ""]
        else:
            finish = ["tree", self.path, str(size), sha256, manifest]
        hashed = size + (0 if tree is None else tree.bytes)
        ran = self._finished(finish, last, hashed, deadline)
        for _ in range(_DAMAGED_RETRIES):
            if ran.exited != 9 or last is None:
                break
            piece, offset, sent = last
            last = (piece, offset, self._send(piece, offset, sent.sent, deadline))
            ran = self._finished(finish, last, hashed, deadline)
        if ran.exited != 0:
            raise TransferError(self.path, _PUT_FAILURES.get(ran.exited or 0, "no_tools"))
        if tree is not None:
            return FileInfo(self.path, tree.bytes, manifest, tree.files)
        into = ran.stdout == "into\n" and self.source.name
        return FileInfo(posixpath.join(self.path, into) if into else self.path, size, sha256)

    def _finished(
        self,
        finish: List[str],
        last: Optional[Tuple[str, int, _Outgoing]],
        hashed: int,
        deadline: _Deadline,
    ) -> _Ran:
        """How the finish (_cx_finish or _cx_unpack, after the last piece) ended."""
        kind, *whole = finish
        if last is None:
            script = _PUT_FINISH if kind == "file" else _PUT_UNPACK
            argv = [self.temp, *whole, ""]
        else:
            piece, offset, sent = last
            script = _PUT_LAST
            argv = [self.temp, piece, str(offset), str(sent.sent), sent.sha256.hexdigest()]
            argv += [kind, *whole]
        return self.sandbox.exec(
            ["bash", "-c", script, "createos_exec-put", *argv],
            f"check of {_shown(self.path, 200)}",
            deadline,
            repeatable=True,
            read_timeout=_hashing_time(self.sandbox.transport, hashed),
        )


class _Checks:
    """The sandbox's checks of an upload's pieces, one after another in a thread
    of their own as the pieces land, so that each is hashed and appended there
    while the next ones travel; at most a few wait (a sandbox slower than the
    network holds the sending back, not its disk). The first piece found
    different stops them: result() gives it and those after it, to be checked
    again, or raises what a check raised."""

    def __init__(self, check: Callable[[str, int, _Outgoing], bool]) -> None:
        self._check = check
        self._landed: "queue.Queue[Optional[Tuple[str, int, _Outgoing]]]" = queue.Queue(
            _PIECES_AHEAD
        )
        self._left: List[Tuple[str, int, _Outgoing]] = []
        self._failure: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="createos_exec-checks")
        self._thread.daemon = True  # after Ctrl-C it ends with its exec's read timeout
        self._thread.start()

    def landed(self, piece: str, offset: int, sent: _Outgoing) -> None:
        if self._failure is not None:
            self.result()
        self._landed.put((piece, offset, sent))

    def _run(self) -> None:
        for landed in iter(self._landed.get, None):
            if self._left or self._failure is not None:
                self._left.append(landed)
                continue
            try:
                if not self._check(*landed):
                    self._left.append(landed)
            except BaseException as exc:  # raised by result()
                self._failure = exc

    def result(self) -> List[Tuple[str, int, _Outgoing]]:
        self._landed.put(None)
        self._thread.join()
        if self._failure is not None:
            raise self._failure
        return self._left

    def stop(self) -> None:
        """No check more once the one under way is done (whose end is waited for:
        the staged copy it appends to is then removed)."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(queue.Empty):
            while True:
                self._landed.get_nowait()
        self._landed.put(None)
        self._thread.join()


# --------------------------------------------------------------------------
# get(): the download


class _Remote(NamedTuple):
    """What the sandbox says of get()'s path: a file ("file": its size, SHA-256,
    mode in octal and stamp) or a directory it packed ("tree": the archive's size,
    -1 when not known, the SHA-256 of the tree's manifest, and in `where` the
    archive's path, "" when the archive follows in the stream that said it)."""

    kind: str
    size: int
    sha256: str
    mode: str
    where: str


class _Cut(NamedTuple):
    """A piece of a file cut in the sandbox: its size, SHA-256 and path there."""

    size: int
    sha256: str
    path: str


class _Received:
    """The bytes of one reading as they come: written to the sink, hashed into
    `digest` (complete once finish() returned), counted in `got` (from `offset`)
    and told; `kept` holds where the last whole piece ended and the digest
    there, where a cut reading goes on."""

    def __init__(self, sink: "_Sink", offset: int, digest: Any, tell: Callable[[int], None]):
        self.sink = sink
        self.got = offset
        self.digest = digest
        self.kept = (offset, digest.copy())
        self._tell = tell
        self._hashing = _Hashing(digest)

    def finish(self) -> None:
        self._hashing.done()

    def take(self, data: bytes) -> bool:
        """False, with nothing written, when it would fill the sink past its most."""
        if self.got + len(data) > self.sink.most:
            return False
        into = _PIECE_SIZE - self.got % _PIECE_SIZE  # bytes to the end of this piece
        while len(data) >= into:
            self._write(data[:into])
            self._hashing.wait()
            self.kept = (self.got, self.digest.copy())
            data, into = data[into:], _PIECE_SIZE
        if data:
            self._write(data)
        return True

    def _write(self, data: bytes) -> None:
        self.sink.write(data)
        self._hashing.update(data)
        self.got += len(data)
        self._tell(self.got)


class _Download:
    """get(): the file's bytes, hashed on their way into `sink`, while the
    sandbox describes it (or packs a directory), then checked against what it
    said. A connection cut past a piece goes on from the last whole piece where
    the sink can (the rest cut into pieces in the sandbox, each checked), else
    the whole is read again when the sink can start over. A file that changed
    while it was read is TransferError "changed", not damage. A directory's
    archive is read into a _TreeSink."""

    def __init__(
        self, sandbox: _Sandbox, path: str, sink: "_Sink", progress: Optional[ProgressCallback]
    ) -> None:
        self.sandbox = sandbox
        self.path = path
        self.sink = sink
        self.progress = progress
        self.total: Optional[int] = None  # what progress() is told the whole is
        self.operation = f"download of {_shown(path, 200)}"
        self.made: List[str] = []  # the temporary files of this download in the sandbox
        self.archive: Optional[_ExecOutput] = None  # a directory's, read after its description
        self.began = time.monotonic()
        self._done = threading.Event()  # run() has returned or raised

    def run(self, deadline: _Deadline) -> Any:
        described = _Described(functools.partial(self._describe, deadline))
        try:
            remote = self._file(described, deadline)
            if remote.kind == "tree":
                return self._tree(remote, deadline)
            info = FileInfo(self.sink.name or self.path, remote.size, remote.sha256)
            return self.sink.commit(info, remote.mode)
        except _Carried as carried:
            raise carried.args[0] from None
        finally:
            self._done.set()
            if self.archive is not None:
                self.archive.close()
            self._remove(list(self.made))

    def _remove(self, made: List[str]) -> None:
        if made:
            self.sandbox.remove(made, f"the temporary copy of {_shown(self.path, 200)}")

    def _tell(self, done: int) -> None:
        _teller(self.progress, self.total)(done)

    def _describe(self, deadline: _Deadline) -> _Remote:
        """The sandbox's description of the path: a file hashed, or, where the sink
        takes a directory, one packed, its archive streamed after the description
        (_streamed), or staged in the sandbox where the control plane streams no
        exec (_TREE_PACKED says for how long its packing is awaited)."""
        transport = self.sandbox.transport
        if self.sink.takes_trees and transport.streams_exec:
            try:
                return transport.retried(self._streamed, deadline)
            except APIError as refused:
                if refused.status != 404:
                    raise
            return self._staged(deadline, after_404=True)
        return self._staged(deadline)

    def _staged(self, deadline: _Deadline, *, after_404: bool = False) -> _Remote:
        """The description through an exec answered at its end: a file's, or a
        directory's packed into an archive staged beside it. `after_404`: a
        streamed exec was answered 404, by a control plane that has none or by
        a sandbox gone; this exec's answer, whatever it says, tells which."""
        archive, most = "", _SERVICE_FILE_LIMIT
        if self.sink.takes_trees:
            head, name = posixpath.split(self.path.rstrip("/"))
            archive, most = posixpath.join(head, _temp_name(name + ".tar")), _TREE_PACKED
        operation = f"check of {_shown(self.path, 200)}"
        ran = self.sandbox.exec(
            ["bash", "-c", _GET_DESCRIBE, "createos_exec-get", self.path, archive],
            operation,
            deadline,
            repeatable=True,
            read_timeout=_hashing_time(self.sandbox.transport, most),
        )
        if after_404:
            self.sandbox.transport.streams_exec = False
        remote = self._described(ran.exited, ran.stdout, operation)
        if remote.kind == "tree":
            self.made.append(remote.where)
            if self._done.is_set():  # nobody waits for it any more
                self._remove([remote.where])
        return remote

    def _streamed(self, deadline: _Deadline) -> _Remote:
        """The description through a streamed exec: a file's whole, or a directory's
        first line, its archive then kept in `archive` to be read."""
        operation = f"check of {_shown(self.path, 200)}"
        argv = ["bash", "-c", _GET_DESCRIBE, "createos_exec-get", self.path, "-"]
        output = self.sandbox.exec_output(argv, operation, deadline)
        try:
            said = output.line(_DESCRIPTION_LIMIT)
            tree = re.fullmatch(r"tree ([0-9a-f]{64}) ([0-9]+|-)\n", said)
            if tree is not None:
                self.archive = output
                if self._done.is_set():  # nobody reads it any more
                    self.archive = None
                size = -1 if tree[2] == "-" else int(tree[2])
                return _Remote("tree", size, tree[1], "-", "")
            if any(output.rest()):
                raise ProtocolError(f"the answer to the {operation} does not describe a file")
            return self._described(output.exited, said, operation)
        finally:
            if self.archive is not output:
                output.close()

    def _described(self, exited: Optional[int], said: str, operation: str) -> _Remote:
        """The description an exec printed, or the TransferError its exit says."""
        self._check_exit(exited)
        found = re.fullmatch(r"(file|tree) ([0-9]+) ([0-9a-f]{64}) ([0-7]+|-) (.+)\n", said, re.S)
        if found is None:
            raise ProtocolError(f"the answer to the {operation} does not describe a file")
        return _Remote(found[1], int(found[2]), found[3], found[4], found[5])

    def _check_exit(self, exited: Optional[int]) -> None:
        if exited != 0:
            raise TransferError(self.path, _DESCRIBE_FAILURES.get(exited or 0, "no_tools"))

    def _file(self, described: _Described, deadline: _Deadline) -> _Remote:
        """The file, read whole; or the description of a directory (a path that
        ends in "/" is one: its GET is not sent beside its description)."""
        if self.path.endswith("/") and described.result().kind == "tree":
            return described.result()
        return self.sandbox.transport.retried(
            functools.partial(self._receive, described),
            deadline,
            repeatable=self.sink.restartable,
        )

    def _receive(self, described: _Described, deadline: _Deadline) -> _Remote:
        """One reading of the file whole, stopped early once the description has
        failed or the sink is full (a failed description says more than the
        GET's failure: a missing file, a directory, no hasher; it wins). Cut
        past a piece, it goes on from there (_resume)."""
        self.sink.restart(0)
        received = _Received(self.sink, 0, hashlib.sha256(), self._tell)
        base = self.sandbox.transport.base
        try:
            response = self.sandbox.get_file(self.path, self.operation, deadline)
            with response, _transport_errors(self.operation, base):
                self.total = _content_length(response)
                for data in response.iter_content(_READ_SIZE):
                    if described.failed() or not received.take(data):
                        break
            received.finish()
            remote = described.result()
            if remote.kind == "file":
                self.sink.expect(remote.size, self.path)
                # Cut short, yet without an error of the connection's:
                if received.got < remote.size:
                    raise _Retryable(self.operation, address=_address(base), reason="reset")
        except _Retryable:
            remote = described.result()
            if remote.kind == "file" and received.kept[0] and self.sink.restartable:
                return self._resume(remote, received.kept, deadline)
            raise
        except APIError:
            if described.result().kind == "tree":  # a directory, which the GET cannot read
                return described.result()
            raise
        except Exception:
            described.result()
            raise
        finally:
            received.finish()
        if remote.kind == "file":
            self._check(remote, received.got, received.digest, deadline)
        return remote

    def _resume(self, remote: _Remote, kept: Tuple[int, Any], deadline: _Deadline) -> _Remote:
        """Go on from the last whole piece read: the rest cut into pieces in the
        sandbox, each read and checked on its own, then the whole checked."""
        offset, digest = kept
        head, name = posixpath.split(self.path)
        where, before = posixpath.join(head, _temp_name(name)), ""
        self.total = remote.size
        while offset < remote.size:
            length = min(_PIECE_SIZE, remote.size - offset)
            piece = self._cut(remote, where, offset, length, before, deadline)
            before = piece.path
            digest = self._fetch(piece, offset, digest, deadline)
            offset += length
        self._check(remote, offset, digest, deadline)
        return remote

    def _cut(
        self,
        remote: _Remote,
        where: str,
        offset: int,
        length: int,
        before: str,
        deadline: _Deadline,
    ) -> _Cut:
        """The piece of `length` bytes from `offset` cut from the file in the sandbox
        (the one `before` removed), described there."""
        operation = f"check of {_shown(self.path, 200)}"
        ran = self.sandbox.exec(
            ["bash", "-c", _GET_CUT, "createos_exec-get", self.path, remote.where, where]
            + [str(offset), str(length), before],
            operation,
            deadline,
            repeatable=True,
            read_timeout=_hashing_time(self.sandbox.transport, 2 * length),
        )
        if ran.exited != 0:
            raise TransferError(self.path, _DESCRIBE_FAILURES.get(ran.exited or 0, "no_tools"))
        said = re.fullmatch(r"([0-9]+) ([0-9a-f]{64}) (.+)\n", ran.stdout, re.S)
        if said is None:
            raise ProtocolError(f"the answer to the {operation} does not describe a piece")
        self.made.append(said[3])
        return _Cut(int(said[1]), said[2], said[3])

    def _fetch(self, piece: _Cut, offset: int, digest: Any, deadline: _Deadline) -> Any:
        """A piece read into the sink from `offset` and checked, read again when it
        arrived different; the file's digest to its end."""
        for _ in range(_DAMAGED_RETRIES + 1):
            received = self.sandbox.transport.retried(
                functools.partial(self._fetch_once, piece, offset, digest), deadline
            )
            if received is not None:
                return received.digest
        raise TransferError(self.path, "mismatch")

    def _fetch_once(
        self, piece: _Cut, offset: int, digest: Any, deadline: _Deadline
    ) -> Optional[_Received]:
        self.sink.restart(offset)
        received = _Received(self.sink, offset, digest.copy(), self._tell)
        own = hashlib.sha256()
        base = self.sandbox.transport.base
        try:
            response = self.sandbox.get_file(piece.path, self.operation, deadline)
            with response, _transport_errors(self.operation, base):
                for data in response.iter_content(_READ_SIZE):
                    own.update(data)
                    received.take(data)
        finally:
            received.finish()
        if received.got - offset < piece.size:
            raise _Retryable(self.operation, address=_address(base), reason="reset")
        if received.got - offset > piece.size or own.hexdigest() != piece.sha256:
            return None
        return received

    def _check(self, remote: _Remote, got: int, digest: Any, deadline: _Deadline) -> None:
        """The bytes read against the description: a difference is a file that
        changed while it was read (its stamp moved since, or it was written
        since the download began: its GET may have read it before the
        description did) or damage on the way."""
        if got == remote.size and digest.hexdigest() == remote.sha256:
            return
        began = str(math.ceil(time.monotonic() - self.began) + 1)
        ran = self.sandbox.exec(
            ["bash", "-c", _GET_UNCHANGED, "createos_exec-get", self.path, remote.where, began],
            f"check of {_shown(self.path, 200)}",
            deadline,
            repeatable=True,
        )
        raise TransferError(self.path, "changed" if ran.exited == 7 else "mismatch")

    def _tree(self, remote: _Remote, deadline: _Deadline) -> FileInfo:
        """The directory's archive, unpacked as it comes into a tree beside the
        destination (from its start again after a cut: the stream asked for
        anew, or the staged archive read again), checked and renamed into place."""
        tree = self.sink.tree(posixpath.basename(self.path.rstrip("/")), self.path)
        unpack = self._unpack if remote.where else self._unpack_streamed
        try:
            manifest = self.sandbox.transport.retried(
                functools.partial(unpack, tree, remote), deadline
            )
            return tree.commit(manifest)
        finally:
            tree.discard()

    def _unpack_streamed(self, tree: "_TreeSink", remote: _Remote, deadline: _Deadline) -> str:
        if self.archive is None:  # cut before: the directory described anew
            remote = self._streamed(deadline)
            if self.archive is None:
                raise TransferError(self.path, "changed")  # no directory any more
        output, self.archive = self.archive, None
        self.total = None if remote.size < 0 else remote.size
        try:
            self._fill(tree, _base64_decoded(output.rest(), self.path))
        finally:
            output.close()
        self._check_exit(output.exited)
        return remote.sha256

    def _unpack(self, tree: "_TreeSink", remote: _Remote, deadline: _Deadline) -> str:
        self.total = remote.size
        base = self.sandbox.transport.base
        response = self.sandbox.get_file(remote.where, self.operation, deadline)
        with response, _transport_errors(self.operation, base):
            got = self._fill(tree, response.iter_content(_READ_SIZE))
        if got < remote.size:
            raise _Retryable(self.operation, address=_address(base), reason="reset")
        return remote.sha256

    def _fill(self, tree: "_TreeSink", archive: Iterable[bytes]) -> int:
        """An archive's pieces, from its start, into `tree`; how many bytes came."""
        tree.restart()
        got = 0
        for data in archive:
            tree.write(data)
            got += len(data)
            self._tell(got)
        return got


def _base64_decoded(texts: Iterable[str], path: str) -> Iterator[bytes]:
    """The bytes of base64 text that comes in pieces of any length, decoded four
    characters at a time; a character outside its alphabet, or an end that
    cuts a group of four, is damage on the way."""
    kept = ""
    for text in texts:
        kept = kept + text if kept else text
        whole = len(kept) - len(kept) % 4
        if whole:
            if _BASE64_TEXT.fullmatch(kept, 0, whole) is None:
                raise TransferError(path, "mismatch")
            yield binascii.a2b_base64(kept[:whole])
            kept = kept[whole:]
    if kept:
        raise TransferError(path, "mismatch")


_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _content_length(response: requests.Response) -> Optional[int]:
    length = response.headers.get("Content-Length", "")
    return int(length) if length.isdigit() else None


class _Sink:
    """Where get() writes: here, memory, at most `most` bytes; started over, or
    cut back to the end of a piece, when a reading is cut."""

    name: Optional[str] = None  # the local path written, for its FileInfo
    restartable = True
    takes_trees = False  # a directory can come here (a local path)

    def __init__(self, most: float) -> None:
        self.most = most
        self._data = bytearray()

    def expect(self, size: int, path: str) -> None:
        if size > self.most:
            raise TransferError(path, "over_cap")

    def restart(self, at: int) -> None:
        del self._data[at:]

    def write(self, piece: bytes) -> None:
        self._data += piece

    def commit(self, info: FileInfo, mode: str) -> Any:
        return bytes(self._data)

    def tree(self, name: str, remote: str) -> "_TreeSink":
        raise TransferError(remote, "not_a_file")  # told to the sandbox: it refused one

    def discard(self) -> None:
        """Whatever a failure leaves here is removed."""


class _FileSink(_Sink):
    """A caller's binary file, written as the bytes arrive (started over where it can seek)."""

    def __init__(self, file: Any) -> None:
        self.most = math.inf  # a file takes any size
        self._file = file
        self._start = _position(file)
        self.restartable = self._start is not None

    def restart(self, at: int) -> None:
        if self._start is not None:
            self._file.seek(self._start + at)
            self._file.truncate()

    def write(self, piece: bytes) -> None:
        self._file.write(piece)

    def commit(self, info: FileInfo, mode: str) -> Any:
        self._file.flush()
        return info


class _PathSink(_FileSink):
    """A local path, written under a temporary name beside it (its parents made),
    given the remote file's mode and renamed into place once checked: inside it
    when it is a directory or ends in a separator (under the remote file's
    `name`); through it to its target when it is a symlink. A directory from the
    sandbox comes to it whole instead (tree())."""

    takes_trees = True

    def __init__(self, path: Any, name: str) -> None:
        self._given = os.fspath(path)
        into = self._given.endswith(("/", os.sep)) or os.path.isdir(self._given)
        self.name = os.path.join(self._given, name) if into else self._given
        self._target = _written_through(self.name)
        head, tail = os.path.split(os.path.abspath(self._target))
        self._temp: Optional[str] = os.path.join(head, _temp_name(tail))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        try:
            os.makedirs(head, exist_ok=True)
            descriptor = os.open(self._temp, flags, 0o600)
        except OSError as error:  # named by the destination, not by the temporary name
            raise type(error)(error.errno, error.strerror, self.name) from None
        super().__init__(os.fdopen(descriptor, "wb"))

    def commit(self, info: FileInfo, mode: str) -> Any:
        self._file.close()
        os.chmod(str(self._temp), int(mode, 8))
        os.replace(str(self._temp), self._target)
        self._temp = None
        return info

    def tree(self, name: str, remote: str) -> "_TreeSink":
        self.discard()
        given = self._given
        return _TreeSink(
            os.path.join(given, name) if given.endswith(("/", os.sep)) else given, remote
        )

    def discard(self) -> None:
        self._file.close()
        if self._temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._temp)
            self._temp = None


def _written_through(path: str) -> str:
    """Where a write to the local `path` goes: a symlink's target, else itself."""
    return os.path.realpath(path) if os.path.islink(path) else path


def _remove_tree(path: str) -> None:
    """Remove a local directory this client made or set aside, read-only ones within included."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for folder, inner, _ in os.walk(path):
        for name in inner:
            if not os.path.islink(os.path.join(folder, name)):
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(folder, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)


class _TreeSink:
    """A local directory that get() unpacks a tar archive into as its bytes come
    (a tar reader fed piece by piece): a staged directory beside `destination`,
    entry by entry, none outside it (an absolute name, "..", or a parent that is
    no directory made here is refused as a damaged archive); its manifest kept
    as it goes (_tree_record). commit() checks that against the sandbox's, then
    renames the tree into place: a directory there is renamed aside first, then
    removed."""

    def __init__(self, destination: str, remote: str) -> None:
        self.name = destination
        self._remote = remote  # the path in the sandbox, which errors name
        self._target = _written_through(destination)
        head, tail = os.path.split(os.path.abspath(self._target))
        os.makedirs(head, exist_ok=True)
        self._staged = os.path.join(head, _temp_name(tail))
        self._aside = os.path.join(head, _temp_name(tail))
        self._file: Optional[BinaryIO] = None
        self.restart()

    def restart(self) -> None:
        """An empty staged tree, and the reader at an archive's start."""
        self.discard()
        os.mkdir(self._staged, 0o700)
        self._block = bytearray()  # a header, or an extended header's data, as it comes
        self._collecting: Optional[Tuple[bytes, int]] = None  # its type and size
        self._extended: Dict[str, str] = {}  # what it says of the next entry
        self._left = self._pad = 0  # data of the current file, then zeros, still to come
        self._ended = False
        self._current = ("", 0, 0.0, hashlib.sha256())  # the file written: path, mode, mtime, hash
        self._files: Dict[str, Tuple[bytes, int, int]] = {}  # path -> SHA-256, mode, size
        self._directories: List[Tuple[str, int, float]] = []  # their modes and times, set last
        self._made: Set[str] = set()  # the directories made, by their paths in the tree
        self._records: List[bytes] = []
        self.files = self.bytes = 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self._ended:
            view = self._take(view)

    def _take(self, view: memoryview) -> memoryview:
        """What the archive's current part takes of `view`; the rest."""
        if self._left:
            part = view[: self._left]
            assert self._file is not None
            self._file.write(part)
            self._current[3].update(part)
            self._left -= len(part)
            if not self._left:
                self._close_file()
            return view[len(part) :]
        if self._pad:
            part = view[: self._pad]
            self._pad -= len(part)
            return view[len(part) :]
        kind, size = self._collecting or (b"", _TAR_BLOCK)
        part = view[: size - len(self._block)]
        self._block += part
        if len(self._block) == size:
            block, self._block = bytes(self._block), bytearray()
            if self._collecting is None:
                self._header(block)
            else:
                self._collecting = None
                self._pad = _padded(size) - size
                self._extend(kind, block)
        return view[len(part) :]

    def _damaged(self) -> TransferError:
        return TransferError(self._remote, "mismatch")

    def _header(self, block: bytes) -> None:
        if not any(block):
            self._ended = True  # the blocks of zeros that end an archive
            return
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            raise self._damaged() from None
        kind = info.type
        if kind in (
            tarfile.XHDTYPE,
            tarfile.XGLTYPE,
            tarfile.GNUTYPE_LONGNAME,
            tarfile.GNUTYPE_LONGLINK,
        ):
            if info.size > _PAX_LIMIT:
                raise self._damaged()
            self._collecting = (kind, info.size)
            if not info.size:
                self._collecting = None
            return
        said, self._extended = self._extended, {}
        name = said.get("path", info.name)
        size = int(said.get("size", info.size))
        mtime = float(said.get("mtime", info.mtime))
        self._entry(
            kind,
            self._inside(name, kind),
            said.get("linkpath", info.linkname),
            size,
            info.mode,
            mtime,
        )

    def _extend(self, kind: bytes, data: bytes) -> None:
        """An extended header's data: pax records, or a GNU long name or link target."""
        if kind == tarfile.GNUTYPE_LONGNAME or kind == tarfile.GNUTYPE_LONGLINK:
            field = "path" if kind == tarfile.GNUTYPE_LONGNAME else "linkpath"
            self._extended[field] = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            return
        while data:
            length, _, rest = data.partition(b" ")
            if not length.isdigit() or not len(length) < int(length) <= len(data):
                raise self._damaged()
            key, _, value = rest[: int(length) - len(length) - 2].partition(b"=")
            if kind == tarfile.XHDTYPE:
                self._extended[key.decode("utf-8", "surrogateescape")] = value.decode(
                    "utf-8", "surrogateescape"
                )
            data = data[int(length) :]

    def _inside(self, name: str, kind: bytes) -> str:
        """An entry's path in the tree ("" for the tree itself), refused when it would
        land outside the staged tree."""
        parts = [part for part in name.split("/") if part not in ("", ".")]
        path = "/".join(parts)
        parent = path.rpartition("/")[0]
        if name.startswith("/") or ".." in parts or (path and parent not in self._made):
            raise self._damaged()
        if not path and kind != tarfile.DIRTYPE:
            raise self._damaged()
        return path

    def _local(self, path: str) -> str:
        return os.path.join(self._staged, *path.split("/")) if path else self._staged

    def _entry(
        self, kind: bytes, path: str, target: str, size: int, mode: int, mtime: float
    ) -> None:
        local, mode = self._local(path), mode & 0o7777
        encoded = os.fsencode(path)
        if kind == tarfile.DIRTYPE:
            if path:
                os.mkdir(local, 0o700)
            self._made.add(path)
            self._directories.append((local, mode, mtime))
            self._records.append(_tree_record("d", mode, 0, b"-", encoded))
            self._pad = _padded(size)
        elif kind == tarfile.SYMTYPE:
            os.symlink(target, local)
            self._records.append(_tree_record("l", 0, 0, os.fsencode(target), encoded))
        elif kind == tarfile.LNKTYPE:
            source = self._inside(target, kind)
            if source not in self._files:
                raise self._damaged()
            os.link(self._local(source), local)
            self._counted(path, *self._files[source])
        elif kind in tarfile.REGULAR_TYPES:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            self._file = os.fdopen(os.open(local, flags | getattr(os, "O_BINARY", 0), 0o600), "wb")
            self._current = (path, mode, mtime, hashlib.sha256())
            self._left, self._pad = size, _padded(size) - size
            if not size:
                self._close_file()
        else:
            raise TransferError(self._remote, "special")

    def _close_file(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        path, mode, mtime, digest = self._current
        local = self._local(path)
        os.chmod(local, mode)
        os.utime(local, (mtime, mtime))
        self._counted(path, digest.hexdigest().encode(), mode, os.path.getsize(local))

    def _counted(self, path: str, digest: bytes, mode: int, size: int) -> None:
        self._files[path] = (digest, mode, size)
        self._records.append(_tree_record("f", mode, size, digest, os.fsencode(path)))
        self.files, self.bytes = self.files + 1, self.bytes + size

    def commit(self, manifest: str) -> FileInfo:
        """The tree checked against the sandbox's manifest and renamed into place."""
        if not self._ended or self._file is not None:
            raise self._damaged()  # the archive ends before its last entry does
        for local, mode, mtime in reversed(self._directories):
            os.chmod(local, mode)
            os.utime(local, (mtime, mtime))
        sha256 = hashlib.sha256(b"".join(sorted(self._records))).hexdigest()
        if sha256 != manifest:
            raise self._damaged()
        target = self._target
        if os.path.isdir(target):
            os.rename(target, self._aside)
            try:
                os.rename(self._staged, target)
            except OSError:
                os.rename(self._aside, target)
                raise
            _remove_tree(self._aside)
        elif os.path.lexists(target):
            raise TransferError(self._remote, "not_renamed")
        else:
            os.rename(self._staged, target)
        return FileInfo(self.name, self.bytes, sha256, self.files)

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if os.path.lexists(self._staged):
            _remove_tree(self._staged)


def _sink_for(destination: Any, most: int, name: str) -> _Sink:
    """get()'s destination as a sink: None (bytes), a local path or a binary file;
    `name` is the remote file's, for a local directory it goes into."""
    if destination is None:
        return _Sink(most)
    if isinstance(destination, (str, os.PathLike)):
        return _PathSink(destination, name)
    if callable(getattr(destination, "write", None)) and not isinstance(destination, io.TextIOBase):
        return _FileSink(destination)
    raise ConfigError(
        "get()'s destination must be None (the bytes are returned), a local path, or a "
        f"file opened in binary mode ('wb'), not {type(destination).__name__}."
    )


# ==========================================================================
# 8. The stream: bytes -> blocks of complete lines -> frames
# ==========================================================================
#
# A response's bytes become blocks of complete lines (b"\n" only), lines
# become frames, frames are checked (seq, stream, canonical base64, exit
# status) and their data goes to the capture. Anything not understood fails
# closed; a stream that ends inside a line is a broken connection.


def _arriving(response: requests.Response) -> Iterator[bytes]:
    """The body as it arrives: HTTP chunk by HTTP chunk, or what the socket holds.

    Straight from urllib3 (requests' iter_content() adds a layer per chunk
    and would wait for the end of a body that is not chunked: a proxy may
    remove the chunking, and all live output would be held back). This is
    where the bytes come from, so this is where the HTTP stack's errors
    become a broken connection.
    """
    raw = response.raw
    if raw.chunked or not hasattr(raw, "read1"):  # read1: urllib3 2.2 and later
        chunks = raw.stream(None, decode_content=True)
    else:
        chunks = iter(functools.partial(raw.read1, _READ_SIZE, decode_content=True), b"")
    with _transport_errors("output connection"):
        yield from chunks


@contextlib.contextmanager
def _unblocked_by(deadline: _Deadline, response: requests.Response) -> Iterator[None]:
    """While reading `response`, let `deadline` or its cancel end a read that is
    waiting for data.

    A quiet process sends nothing but heartbeats, whose interval is unknown,
    and each of them starts the read timeout again: without this, a wait
    could go on that long past its deadline or its cancel. Shutting the
    socket down wakes the blocked read; the reader then sees the cancel or
    the deadline.
    """
    done = threading.Event()
    finishing = threading.Lock()
    watcher = threading.Thread(
        target=_shut_down_at,
        args=(deadline, done, finishing, response),
        name="createos_exec-deadline",
    )
    watcher.daemon = True
    watcher.start()
    try:
        yield
    finally:
        with finishing:  # from here on the connection may serve another request
            done.set()  # the watcher ends within one poll; nothing waits for it


def _shut_down_at(
    deadline: _Deadline, done: threading.Event, finishing: threading.Lock, response: Any
) -> None:
    while not done.is_set():
        deadline.sleep(_CANCEL_POLL)
        if deadline.cancelled() or deadline.expired():
            with finishing:
                if done.is_set():
                    return
                connection: Any = getattr(response.raw, "connection", None)
                with contextlib.suppress(OSError, AttributeError):
                    connection.sock.shutdown(socket.SHUT_RDWR)
            return


@dataclasses.dataclass
class _Reader:
    """The output stream of one process, read from a cursor on.

    bytes -> blocks of complete lines -> frames -> the capture. It owns the
    cursor (the seq of the last data frame accepted), the bytes of a line cut
    between chunks, the heartbeats seen and the routes by which data lines are
    taken: lines in the service's own form by one pattern (nearly every block),
    a block that is one long data line by its head and strict base64, anything
    else as JSON, line by line, with the verdict json.loads gives each line.
    Whatever the route, data frames end in _take_data: _base64 is the one
    base64 decoder, and _take_data holds the one sequence check.
    """

    output: _Output
    cursor: int = 0  # the seq of the last data frame accepted
    limit: int = _FRAME_LIMIT  # the longest line, in bytes
    terminal: bool = False  # a PTY process: its one stream is "pty", a pipe's are the others
    heartbeats: int = dataclasses.field(default=0, init=False)
    stepwise: bool = dataclasses.field(default=False, init=False)  # a step after each block

    def read(
        self,
        chunks: Iterator[bytes],
        interrupted: Callable[[], None],
        until: Optional[int] = None,
    ) -> Generator[None, None, Optional[_Exit]]:
        """Read one connection: the exit frame's status, or None once the cursor reaches `until`.

        A connection that ends before either is a broken one (_Retryable).
        `interrupted` runs before each block: a stream that keeps flowing can
        still be cancelled or time out. While `stepwise`, a step is yielded
        after each block, for a loop to take what it held.
        """
        for block in self.blocks(chunks):
            interrupted()
            exited = self.take(block)
            if exited is not None:
                # Finish the body (at most 64 KiB more, whatever follows is
                # ignored) so that the connection can be reused.
                read = 0
                with contextlib.suppress(_Retryable, TransportError):
                    for chunk in chunks:
                        read += len(chunk)
                        if read > 65536:
                            break
                return exited
            if until is not None and self.cursor >= until:
                return None
            if self.stepwise:
                yield
        raise _Retryable("output connection")  # clean EOF before the exit frame

    def blocks(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The complete lines of a byte stream, as soon as they arrive, a block at a time.

        Every block ends with b"\\n" (the only line break: U+2028 is legal
        inside JSON). A stream that ends inside a line is a broken
        connection (_Retryable), not a frame.
        """
        limit = self.limit
        pending: List[Union[bytes, memoryview]] = []
        pending_size = 0
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
                yield from _within_limit(block, limit) if len(block) > limit else (block,)
                pending_size = 0
            if end < len(chunk):
                pending.append(chunk[end:] if end else chunk)
                pending_size += len(chunk) - end
                if pending_size > limit:
                    raise ProtocolError("an output frame is longer than 1 MiB")
        if pending:
            raise _Retryable("output connection")

    def take(self, block: bytes) -> Optional[_Exit]:
        """Act on a block of complete lines; the exit status when it holds the exit frame.

        An exit frame without a status gives _NO_STATUS.
        """
        try:
            text: Optional[str] = block.decode("utf-8")
        except UnicodeDecodeError:
            text = None  # its lines are then decoded alone, to fail at the first bad one
        lines = None if text is None else _service_lines(text)
        if lines is None:
            return self._take_frames(_frames(block, text))
        self._take_data(lines)
        return None

    def _take_frames(self, frames: Iterator[Any]) -> Optional[_Exit]:
        """Act on parsed frames in order; the exit status when one is the exit frame.

        Data frames are gathered and taken together, before whatever ends
        the block: a later frame, its failure, or the block's end.
        """
        data: List[Tuple[Any, str, Any]] = []
        try:
            for frame in frames:
                kind = frame.get("type") if type(frame) is dict else None
                if type(kind) is not str:
                    raise ProtocolError("an output frame is not an object with a type")
                if kind == "data":
                    data.append(_data_frame(frame))
                    continue
                done, data = data, []  # never taken twice, even if that fails
                self._take_data(done)
                if kind == "exit":
                    return _exit_status(frame) or _NO_STATUS
                if kind == "error":
                    raise _stream_error(frame)
                if kind != "heartbeat":
                    raise ProtocolError("an output frame has an unknown type")
                self.heartbeats += 1
            return None
        finally:
            self._take_data(data)

    def _take_data(self, lines: Iterable[Sequence[Any]]) -> None:
        """Accept data frames (seq, stream, base64) in order; an empty seq is a heartbeat.

        Every route ends here: _base64 is the one decoder, and this the one
        sequence check. The next frame is kept, a frame read before (a
        replay after a resume) is dropped, a frame beyond the next fails
        closed after those before it. Each run of one stream's frames is
        delivered to the capture in one piece.
        """
        cursor = self.cursor
        run: List[bytes] = []
        run_stream = ""
        try:
            for seq, stream, base64 in lines:
                if not seq:
                    self.heartbeats += 1
                    continue
                payload = _base64(base64)
                number = int(seq)
                if number != cursor + 1:
                    if number <= cursor:
                        continue
                    raise ProtocolError(f"output seq jumped from {cursor} to {number}")
                if stream != run_stream:
                    if (stream == "pty") is not self.terminal:
                        raise ProtocolError("a data frame names a stream of the other kind")
                    if run:
                        done, run = run, []  # never handed out twice, even if that fails
                        self.output.feed(run_stream, b"".join(done))
                    run_stream = stream
                run.append(payload)
                cursor = number
        finally:
            self.cursor = cursor
            if run:
                self.output.feed(run_stream, b"".join(run))  # one payload: not copied


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


_STREAMS = ("stdout", "stderr")  # a pipe process's, and a result's: a terminal's is stdout
_ALL_STREAMS = _STREAMS + ("pty",)  # and a terminal's one

# A line in the form the service writes (docs/protocol.md 5.4): a data frame or a
# heartbeat. Such a line is a JSON object whose fields the groups give (a
# heartbeat has empty groups): digits and one of three words need no unescaping,
# and base64 text needs none when the block holds no backslash. The base64 is
# taken as whatever stands between the quotes (`[^"]*`, a fast path in `re`;
# a character class costs several times more): _base64 checks it.
_DATA_HEAD = (
    r'\{"type":"data","seq":([1-9][0-9]{0,17}),"stream":"(stdout|stderr|pty)","data_base64":"'
)
_SERVICE_FORM = "(?:" + _DATA_HEAD + r'([^"]*)"\}|\{"type":"heartbeat"\})'
_SERVICE_LINE = re.compile("^" + _SERVICE_FORM + "$", re.MULTILINE)
_ONE_SERVICE_LINE = re.compile(_SERVICE_FORM + "\n\\Z")
_LONG_DATA_HEAD = re.compile(_DATA_HEAD)
_SHORT_LINE = 512  # characters; a block that starts with a longer line skips the pattern
_Line = Tuple[str, ...]  # seq digits, stream, base64 text; all empty for a heartbeat


def _service_lines(text: str) -> Optional[List[_Line]]:
    """The fields of every line of `text` when all are in the service's form, else None.

    Exactly the lines whose JSON value is what the groups say: the block
    holds no escape, each line is one match and none spans lines. The
    pattern scans a long line more slowly than strict base64 decoding checks
    it, so a block that starts with one is only looked at as one data line.
    """
    if "\\" in text:
        return None  # an escape: JSON decides what it stands for
    if len(text) <= _SHORT_LINE:
        line = _ONE_SERVICE_LINE.match(text)  # the usual block of live output
        if line is not None:
            return [line.groups("")]  # as findall gives it: "" for no group
    first_end = text.find("\n")
    if first_end > _SHORT_LINE:  # one long data line by its head; else JSON is faster
        return _long_data_line(text) if first_end == len(text) - 1 else None
    lines: List[_Line] = _SERVICE_LINE.findall(text)
    return lines if len(lines) == text.count("\n") else None


def _long_data_line(text: str) -> Optional[List[_Line]]:
    """A block that is one long data line in the service's form, as one line's fields.

    With no quote between its quotes, the line is exactly what its head and
    its end say.
    """
    head = _LONG_DATA_HEAD.match(text)
    if head is None or not text.endswith('"}\n'):
        return None
    base64 = text[head.end() : -3]
    return None if '"' in base64 else [(head.group(1), head.group(2), base64)]


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
        # The line's first newline must end the value: whitespace around it, a
        # value spread over lines ("[" then "]"), or worse, is judged line by line.
        if end < 0 or text.find("\n", position, end + 1) != end:
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


def _data_frame(frame: Dict[str, Any]) -> Tuple[int, str, str]:
    """seq, stream and base64 text of a data frame, checked but for the base64."""
    seq: Any = frame.get("seq")
    if not _is_int(seq) or seq < 1:
        raise ProtocolError("a data frame has no positive integer seq")
    stream = frame.get("stream")
    if stream not in _ALL_STREAMS:
        raise ProtocolError("a data frame names an unknown stream")
    text = frame.get("data_base64")
    if type(text) is not str:
        raise ProtocolError("a data frame has no data_base64 string")
    return seq, stream, text


def _stream_error(frame: Dict[str, Any]) -> ProtocolError:
    """The error an `error` frame reports."""
    if frame.get("error") == "output_offset_expired":
        oldest = frame.get("oldest_available_seq")
        return OutputEvictedError(oldest if _is_int(oldest) else None)
    return ProtocolError("the output stream reported an error")


# By bytes in the last quantum (1 or 2): the characters allowed before its
# padding, those whose unused bits are zero.
_CANONICAL_LAST = ("", "AQgw", "AEIMQUYcgkosw048")
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?\Z")


if sys.version_info >= (3, 11):
    _a2b_base64 = binascii.a2b_base64
else:

    def _a2b_base64(text: str, strict_mode: bool = False) -> bytes:
        """a2b_base64 with the strict_mode of Python 3.11 (standard, padded base64 only)."""
        if strict_mode and not _BASE64.match(text):
            raise binascii.Error("not strict base64")
        return binascii.a2b_base64(text)


def _base64(text: str) -> bytes:
    """The payload of canonical base64: standard alphabet, "=" padding, unused bits zero.

    The one definition of what a data frame may carry, whatever route took it.
    """
    try:
        payload = _a2b_base64(text, strict_mode=True)  # novermin: its own before 3.11
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


_NO_STATUS = _Exit(None, None)  # an exit frame that carries no status


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


# The signals of Linux, where the sandboxes run: a name outside them would be
# refused by the service after the request.
_LINUX_SIGNALS = frozenset(_SIGNAL_WORDS.values())


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


# ==========================================================================
# 9. Capture: incremental decoders and bounded tails
# ==========================================================================
#
# Each stream has its own incremental decoder, so a character split across
# frames or reconnects decodes once, and a tail of at most max_output_chars,
# kept in O(1) amortised per character: memory stays bounded whatever the
# output's size. The output object builds the result from its tails. With
# text=False the decoder hands the bytes on as they came, and the tails
# count and join bytes: the same path, nothing decoded.


_TAIL_PART = 16384  # characters; shorter texts are gathered into one part for the tails


class _Output:
    """What the process printed: a decoder and a tail per stream, plus the tail
    of both in the order they were written (what `2>&1` would have shown).

    Text goes to on_output (and to a loop over iter_output()) as soon as it
    is decoded. The tails get it in parts of about _TAIL_PART characters (a
    long text alone is a part without a copy): a frame costs two list
    appends here, not an append to each of two tails.
    """

    def __init__(
        self,
        encoding: Optional[str],  # None: text=False, bytes as they came
        errors: str,
        limit: int,
        on_output: Optional[OutputCallback],
        merges_stderr: bool = False,
    ) -> None:
        self._decoder: Callable[[], Any] = (
            _Undecoded
            if encoding is None
            else functools.partial(codecs.getincrementaldecoder(encoding), errors)
        )
        self._nothing: Any = "" if encoding is not None else b""  # what the tails join with
        # The stream each stream's text is: with stderr=subprocess.STDOUT, stderr's
        # is stdout's everywhere it goes (decoded apart: each pipe's bytes are whole).
        # A terminal's is its own, "pty", kept as stdout.
        self._into = {
            "stdout": "stdout",
            "stderr": "stdout" if merges_stderr else "stderr",
            "pty": "pty",
        }
        self._limit = limit
        self._on_output = on_output
        self._deliver = on_output  # on_output, a loop's taker, both, or None
        self._part_size = min(_TAIL_PART, limit // 16)
        self.evicted = False  # the service dropped output nobody had read
        self._decoders = {name: self._decoder() for name in _ALL_STREAMS}
        self.received = dict.fromkeys(_ALL_STREAMS, 0)  # bytes of each stream, from its first
        self.tails = {name: _Tail(limit, self._nothing) for name in _STREAMS}
        self.combined = _Tail(limit, self._nothing)
        # Texts not yet in the tails: per stream (a terminal's are stdout's), and of both in order.
        stdout: List[Any] = []
        self._recent: Dict[str, List[Any]] = {"stdout": stdout, "stderr": [], "pty": stdout}
        self._recent_both: List[Any] = []
        self._recent_size = 0

    def drop_all(self) -> None:
        """Forget what was read: the output after it is what is kept now, its head dropped."""
        self.evicted = True
        self._decoders = {name: self._decoder() for name in _ALL_STREAMS}
        self.tails = {name: _Tail(self._limit, self._nothing, dropped=True) for name in _STREAMS}
        self.combined = _Tail(self._limit, self._nothing, dropped=True)
        for texts in self._recent.values():
            texts.clear()
        self._recent_both.clear()
        self._recent_size = 0

    @property
    def live(self) -> bool:
        """Whether someone takes the output as it comes (and would see a gap in it)."""
        return self._deliver is not None

    def hand_to(self, taker: Optional[OutputCallback]) -> None:
        """Hand each text to `taker` too, after on_output; None: to on_output alone."""
        on_output = self._on_output
        if taker is None or on_output is None:
            self._deliver = taker or on_output
            return

        def both(stream: str, text: Any) -> None:
            on_output(stream, text)
            taker(stream, text)

        self._deliver = both

    def feed(self, stream: str, payload: bytes, final: bool = False) -> None:
        self.received[stream] += len(payload)
        text = self._decoders[stream].decode(payload, final)
        if text:
            stream = self._into[stream]
            self._recent[stream].append(text)
            self._recent_both.append(text)
            self._recent_size += len(text)
            if self._recent_size > self._part_size:
                self._file_recent()
            if self._deliver is not None:
                self._deliver(stream, text)

    def _file_recent(self) -> None:
        for name in _STREAMS:
            texts = self._recent[name]
            if texts:
                self.tails[name].append(self._nothing.join(texts))  # one text is not copied
                texts.clear()
        if self._recent_both:
            self.combined.append(self._nothing.join(self._recent_both))
            self._recent_both.clear()
        self._recent_size = 0

    def texts(self) -> Tuple[Any, Any]:
        """The tails of stdout and stderr as they stand; the decoders keep what they hold."""
        self._file_recent()
        return self.tails["stdout"].text(), self.tails["stderr"].text()

    def finish(self) -> None:
        """The output has ended: what the decoders hold back (a character cut off
        at the end) is decoded and handed out, and the tails are filled."""
        for name in _ALL_STREAMS:
            self.feed(name, b"", final=True)
        self._file_recent()

    def result(
        self, exited: Optional[_Exit], *, timed_out: bool, partial: bool, **about: Any
    ) -> ExecResult[Any]:
        """The result of a run that ended with `status` (None: not known) or at its
        deadline, and `about` the run, ExecResult's other fields. A `partial` one
        (an error's, the run may go on: a pause resumed) changes nothing of the
        run: it holds what was handed out, the decoders keep a character cut
        off (its rest may come) and the output is handed out as before."""
        if partial:
            self._file_recent()
        else:
            self.finish()
        out, err = self.tails["stdout"], self.tails["stderr"]
        return ExecResult(
            exit_code=None if timed_out or exited is None else exited.exit_code,
            signal=None if exited is None else exited.signal,
            timed_out=timed_out,
            stdout=out.text(),
            stderr=err.text(),
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            output=self.combined.text(),
            combined_truncated=self.combined.truncated,
            output_evicted=self.evicted,
            **about,
        )


class _Undecoded:
    """The decoder of text=False: the bytes as they came, nothing held back."""

    def decode(self, payload: bytes, final: bool = False) -> bytes:
        return payload


class _Tail:
    """The last `limit` characters (or bytes) of a stream, O(1) amortised per character.

    It is handed parts, not single frames (_Output gathers them), and drops
    its head in whole parts, a quarter of `limit` at a time: the deque sees
    one part per thousands of characters. `nothing` ("" or b"") joins them.
    """

    def __init__(self, limit: int, nothing: Any = "", dropped: bool = False) -> None:
        self._limit = limit
        self._nothing = nothing
        self._high = limit + limit // 4  # held at most, beyond the part just appended
        self._parts: Deque[Any] = collections.deque()
        self._size = 0  # characters in _parts
        self.truncated = dropped  # its head was dropped, or will be: it outgrew the limit

    def append(self, part: Any) -> None:
        self._parts.append(part)
        self._size += len(part)
        if self._size > self._limit:
            self.truncated = True
            if self._size > self._high:
                self._drop_head()

    def _drop_head(self) -> None:
        """Drop whole parts while the rest still holds `limit` characters."""
        parts = self._parts
        while parts and self._size - len(parts[0]) >= self._limit:
            self._size -= len(parts.popleft())

    def text(self) -> Any:
        """What it keeps, joined (str, or bytes with text=False)."""
        if self._size > self._limit:
            self._drop_head()
        parts = iter(self._parts)
        head = next(parts, self._nothing)[max(0, self._size - self._limit) :]
        return self._nothing.join(itertools.chain((head,), parts))  # one copy of the tail


# ==========================================================================
# 10. Transport: requests, retries, the one exception map
# ==========================================================================
#
# Every request goes through _Transport: paced by the shared window, its
# timeouts cut to the one deadline, its transport failures translated in one
# place (_transport_failure), never redirected, the key sent only as
# X-Api-Key. What is worth another attempt is a _Retryable, spent against a
# _Budget that resets on progress.


class _Transport:
    """Requests to one API origin: pacing, the key header, no redirects, status
    triage, and retries under the client's policy. It holds the client's
    timeouts too: everything that sends a request asks it."""

    def __init__(
        self,
        base: str,
        api_key: str,
        session: requests.Session,
        limiter: Optional[_RateLimiter],
        *,
        request_timeout: float,
        stream_idle_timeout: float,
        cleanup_timeout: float,
        retry: RetryPolicy,
    ) -> None:
        self.base = base
        self.request_timeout = request_timeout
        self.stream_idle_timeout = stream_idle_timeout
        self.cleanup_timeout = cleanup_timeout
        # Between SIGTERM and SIGKILL, capped so that a DELETE that waits it out
        # fits in the cleanup deadline; the sandbox's watchdog keeps the same.
        self.termination_grace = min(_TERMINATE_GRACE, cleanup_timeout / 2)
        self.retry = retry
        # Whether the control plane streams an exec's output: some answer 404
        # (docs/protocol.md 6), which is learned once, at the first one asked.
        self.streams_exec = True
        self._auth = _OnlyTheKey(api_key)
        self._session = session
        self._limiter = limiter

    def call(
        self,
        method: str,
        path: str,
        *,
        operation: str,
        deadline: _Deadline,
        read_timeout: Optional[float] = None,
        process_id: Optional[str] = None,
        **request: Any,
    ) -> requests.Response:
        """One request, retried under the retry policy while it fails and time remains.
        A cancel ends its waits (see _Deadline.pause)."""

        def once(now: _Deadline) -> requests.Response:
            return self.send(
                method,
                path,
                operation=operation,
                read_timeout=read_timeout,
                deadline=now,
                process_id=process_id,
                **request,
            )

        return self.retried(once, deadline, process_id=process_id)

    def retried(
        self,
        once: Callable[[_Deadline], _T],
        deadline: _Deadline,
        *,
        repeatable: bool = True,
        process_id: Optional[str] = None,
    ) -> _T:
        """once(deadline): a step of several requests (or one that builds its body
        afresh), taken again under the retry policy while it fails and time
        remains, when it is `repeatable`; else its first failure is final (and
        names `process_id`)."""
        budget = _Budget(self.retry)
        while True:
            try:
                return once(deadline)
            except _Retryable as failure:
                failed = failure  # raised below: the public error must not have it as context
            delay = budget.delay_within(failed.retry_after, deadline) if repeatable else None
            if delay is None:
                raise failed.final(process_id) from failed.__cause__
            deadline = deadline.pause(delay)  # the run names the process on a cancel

    def attempt(self, method: str, path: str, **send: Any) -> Union[requests.Response, _Retryable]:
        """The response, or the failure worth another attempt (returned, not raised:
        the public error raised for it must not have it as its context)."""
        try:
            return self.send(method, path, **send)
        except _Retryable as failure:
            return failure

    def send(
        self,
        method: str,
        path: str,
        *,
        operation: str,
        deadline: _Deadline,
        read_timeout: Optional[float] = None,
        process_id: Optional[str] = None,
        params: Optional[Dict[str, Any]] = None,
        json_body: Any = None,
        data: Any = None,
        data_type: str = "application/octet-stream",
        stream: bool = False,
        ok_statuses: Tuple[int, ...] = (),
    ) -> requests.Response:
        """One attempt: a 2xx (or an `ok_statuses`) response; any other status raises.

        Connecting takes at most request_timeout, reading `read_timeout` (by default
        request_timeout too), both cut to what remains of `deadline`, which with its cancel
        ends a wait in the pacing window too (one that the deadline ends is a request
        never sent). `data` is a raw body of `data_type`: bytes (a JSON body built by
        hand costs less), a file-like object of known length, or an iterable of pieces
        (with a length: sent with Content-Length, else chunked)."""
        logger.debug("%s %s", method, path)
        headers = {}
        if data is not None:
            headers["Content-Type"] = data_type
        if stream:
            # Compression on the way (gzip in a proxy) would hold live output back.
            headers["Accept-Encoding"] = "identity"
        timeout = (
            deadline.within(self.request_timeout),
            deadline.within(read_timeout or self.request_timeout),
        )
        place = None
        if self._limiter is not None:
            place = self._limiter.acquire(sum(timeout), deadline)
            if place is None:
                address = _address(self.base)
                raise _Retryable(operation, maybe_sent=False, address=address, reason="timeout")
        status: Optional[int] = None
        try:
            with _transport_errors(operation, self.base):
                response = self._session.request(
                    method,
                    self.base + path,
                    params=params,
                    json=json_body,
                    data=data,
                    headers=headers,
                    auth=self._auth,
                    timeout=timeout,
                    stream=stream,
                    allow_redirects=False,  # requests would forward X-Api-Key to the new host
                )
            status = response.status_code
        finally:
            if place is not None and self._limiter is not None:
                self._limiter.release(place, status)
        if 200 <= response.status_code < 300 or response.status_code in ok_statuses:
            return response
        raise _refusal(response, operation, process_id)

    def for_a_tunnel(self) -> Tuple[str, Optional[_RateLimiter], Dict[str, Any]]:
        """What a tunnel's upgrade (section 14), the one request requests cannot
        make, takes from here: the key, the pacing window, and the TLS settings
        the session would use for this origin (`verify`, `cert`)."""
        tls = self._session.merge_environment_settings(self.base, {}, None, None, None)
        return self._auth._api_key, self._limiter, dict(tls)


class _OnlyTheKey(requests.auth.AuthBase):
    """Every request's one credential: X-Api-Key.

    As a request's own auth it keeps requests from reading ~/.netrc (which
    would add Authorization: Basic), and it removes the other credential
    headers from whatever the session adds.
    """

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        for name in _OTHER_CREDENTIALS:
            request.headers.pop(name, None)
        request.headers["X-Api-Key"] = self._api_key
        return request

    def __repr__(self) -> str:
        return "_OnlyTheKey(<key>)"


# Headers the service reads before X-Api-Key (docs/protocol.md 1): sent by
# accident, one of them decides whose call it is.
_OTHER_CREDENTIALS = ("Authorization", "X-Auth-Token", "X-Access-Token")


def _refusal(
    response: requests.Response, operation: str, process_id: Optional[str]
) -> Union[_Retryable, APIError]:
    """What a status other than 2xx says: one worth another attempt, or an APIError."""
    status = response.status_code
    retry_after = _retry_after(response.headers.get("Retry-After"))
    response.close()
    if status in (408, 429) or status >= 500:
        return _Retryable(operation, status=status, retry_after=retry_after)
    return APIError(status, operation, process_id=process_id)


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


def _new_session() -> requests.Session:
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=64)  # threads share one client
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return session


@dataclasses.dataclass(eq=False)
class _Retryable(Exception):
    """A failure worth another attempt: transport trouble, 408/429/5xx."""

    operation: str
    status: Optional[int] = None
    retry_after: Optional[float] = None
    maybe_sent: bool = True
    address: Optional[str] = None  # of TransportError
    reason: Optional[str] = None  # of TransportError

    def final(self, process_id: Optional[str]) -> CreateOSError:
        """The public error to raise once no attempt is left."""
        if self.status is not None:
            return APIError(self.status, self.operation, process_id=process_id)
        return TransportError(
            self.operation, process_id=process_id, address=self.address, reason=self.reason
        )


# What the HTTP stack raises: urllib3's and http.client's errors and OSError,
# which requests' own exceptions are too.
_LOW_LEVEL_ERRORS = (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)
_TRANSIENT_REQUEST_ERRORS = (
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    requests.exceptions.ContentDecodingError,
)


@contextlib.contextmanager
def _transport_errors(operation: str, origin: Optional[str] = None) -> Iterator[None]:
    """Exceptions of the HTTP stack raised inside, translated by _transport_failure."""
    try:
        yield
    except _LOW_LEVEL_ERRORS as exc:
        raise _transport_failure(exc, operation, origin) from exc


def _transport_failure(exc: BaseException, operation: str, origin: Optional[str]) -> Exception:
    """The one place where exceptions of the HTTP stack are translated.

    Their text is never copied: requests puts URLs (and so ids) into messages.
    What is kept is the API's host and port, and the kind of failure.
    """
    address, kind = _address(origin), _unreachable_reason(exc)
    if isinstance(exc, requests.exceptions.SSLError):
        return TransportError(operation, address=address, reason=kind)
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return _Retryable(operation, maybe_sent=False, address=address, reason=kind)
    if isinstance(exc, requests.exceptions.ConnectionError):
        reason = getattr(exc.args[0], "reason", None) if exc.args else None
        not_sent = isinstance(reason, urllib3.exceptions.NewConnectionError)
        return _Retryable(operation, maybe_sent=not not_sent, address=address, reason=kind)
    if isinstance(exc, requests.exceptions.RequestException) and not isinstance(
        exc, _TRANSIENT_REQUEST_ERRORS
    ):
        # A request that could not be made as asked.
        return TransportError(operation, address=address, reason=kind)
    return _Retryable(operation, address=address, reason=kind)


def _address(origin: Optional[str]) -> Optional[str]:
    """host:port of an API URL (never a secret: _api_base refuses user information)."""
    if origin is None:
        return None
    parts = urllib.parse.urlsplit(origin)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# The exceptions below an HTTP failure that say what kind it was, the most
# telling first. Not urllib3's timeout classes: its NewConnectionError is one
# too, whatever the failure; a real timeout has socket.timeout below it.
_FAILURE_KINDS: Tuple[Tuple[str, Tuple[Type[BaseException], ...]], ...] = (
    ("dns", (socket.gaierror, getattr(urllib3.exceptions, "NameResolutionError", socket.gaierror))),
    ("refused", (ConnectionRefusedError,)),
    ("tls", (urllib3.exceptions.SSLError, requests.exceptions.SSLError)),
    ("timeout", (socket.timeout, requests.exceptions.Timeout)),
    ("reset", (ConnectionResetError,)),
)


def _unreachable_reason(exc: BaseException) -> Optional[str]:
    """The kind of an HTTP failure (a key of _UNREACHABLE), found in its chain of causes."""
    causes = list(_causes(exc))
    for kind, classes in _FAILURE_KINDS:
        if any(isinstance(cause, classes) for cause in causes):
            return kind
    return None


def _causes(exc: BaseException, most: int = 16) -> Iterator[BaseException]:
    """exc and what lies below it: urllib3's `reason`, wrapped arguments, causes, contexts."""
    pending: List[BaseException] = [exc]
    seen: Set[int] = set()
    while pending and len(seen) < most:
        cause = pending.pop(0)
        if id(cause) in seen:
            continue
        seen.add(id(cause))
        yield cause
        below = [getattr(cause, "reason", None), *cause.args, cause.__cause__, cause.__context__]
        pending.extend(item for item in below if isinstance(item, BaseException))


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


class _Budget:
    """The failures of one run without progress; it resets whenever progress is made.

    Spent after max_attempts failures in a row, or `budget` seconds after the
    first of them. From the second failure in a row on, the waits spread the
    attempts left over what remains of the budget (none longer than twice
    max_backoff): with the defaults, 8 attempts over 60 s, an outage of the
    API shorter than the budget costs a run nothing.
    """

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
        policy = self._policy
        if retry_after is not None:
            delay = min(retry_after, policy.max_retry_after)
        elif self._failures == 1:
            # A connection that breaks after progress (a recycled proxy
            # connection, a reset) is most likely fine at once; back off
            # only when failures follow each other.
            delay = 0.0
        else:
            ceiling = policy.initial_backoff * 2 ** (self._failures - 2)
            delay = random.uniform(0, min(policy.max_backoff, ceiling))
            # Attempts are not spent faster than the budget: the attempts left
            # share what remains of it, so that an outage of the API as long as
            # the budget passes (each wait at most twice max_backoff).
            share = left / (policy.max_attempts - self._failures)
            delay = max(delay, min(share, 2 * policy.max_backoff))
        return min(delay, left)

    def delay_within(self, retry_after: Optional[float], deadline: _Deadline) -> Optional[float]:
        """next_delay(), or None too when the deadline would pass before it is over."""
        delay = self.next_delay(retry_after)
        left = deadline.remaining()
        return None if delay is None or (left is not None and left <= delay) else delay


# ==========================================================================
# 11. Deadlines and pacing
# ==========================================================================
#
# One deadline type for every wait: when it ends, which kind of limit it
# is, and the events that end it sooner (a run's cancel, a cleanup's hurry).
# The rate limiter is a sliding window per API origin, shared by threads and
# by this user's processes through one file; below the limit it adds no
# delay.


class _Deadline(NamedTuple):
    """When waiting must stop, on the monotonic clock (None: never), and which
    kind of limit that is: the command's `timeout`, a wait's own
    (`wait(timeout=)`, `iter_output(timeout=)`, `wait_for_port(timeout=)`,
    `communicate(timeout=)`) or a cleanup's. The one who meets it knows which
    fired. What may end a wait sooner travels with when it must end: `cancel`,
    the run's event, stops every wait under it (CancelledError); `hurry`, the
    event that asked for a cleanup, cuts the cleanup's next wait short, once.
    A deadline carries one of the two at most. Every wait under a deadline
    ends at it, or at its event, whichever comes first."""

    at: Optional[float] = None
    kind: str = "command"
    seconds: Optional[float] = None  # the timeout it was made from
    cancel: Optional[threading.Event] = None
    hurry: Optional[threading.Event] = None

    @classmethod
    def after(
        cls,
        seconds: Optional[float],
        kind: str,
        now: float,
        cancel: Optional[threading.Event] = None,
        hurry: Optional[threading.Event] = None,
    ) -> "_Deadline":
        """`seconds` (None: no deadline) from `now`; a ConfigError for anything but
        a number >= 0, before anything waits."""
        if seconds is None:
            return cls(None, kind, None, cancel, hurry)
        if not _is_number(seconds) or not seconds >= 0:
            raise ConfigError(f"The {kind} timeout must be a number of seconds >= 0, or None.")
        return cls(now + seconds, kind, seconds, cancel, hurry)

    def sooner(self, other: "_Deadline") -> "_Deadline":
        """Whichever comes first (this one on a tie), with either's events."""
        first = self if other.at is None or (self.at is not None and self.at <= other.at) else other
        return first._replace(cancel=self.cancel or other.cancel, hurry=self.hurry or other.hurry)

    def remaining(self) -> Optional[float]:
        return None if self.at is None else self.at - time.monotonic()

    def within(self, seconds: float) -> float:
        """`seconds`, cut to what remains; never 0 (urllib3 refuses a zero timeout):
        an expired deadline is caught by the caller."""
        if self.at is None:
            return seconds
        return max(0.001, min(seconds, self.at - time.monotonic()))

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def check(self, process_id: Optional[str] = None) -> None:
        """CancelledError once the cancel is set; _TimedOut once the deadline has passed."""
        if self.cancel is not None and self.cancel.is_set():
            raise CancelledError(process_id=process_id)
        if self.at is not None and time.monotonic() >= self.at:
            raise _TimedOut(self)

    def sleep(self, seconds: float) -> bool:
        """The one place a run sleeps: `seconds`, at most to the deadline, or until
        the cancel or the hurry is set (then True). Ctrl-C interrupts either
        (Event.wait is interruptible, as time.sleep is)."""
        left = self.remaining()
        seconds = seconds if left is None else max(0.0, min(seconds, left))
        event = self.cancel or self.hurry
        if event is None:
            time.sleep(seconds)
            return False
        return event.wait(seconds)

    def pause(self, seconds: float) -> "_Deadline":
        """Wait `seconds` (at most to the deadline) before the next attempt; the
        deadline to go on under.

        The cancel ends the wait at once: CancelledError. The hurry cuts it
        short once instead, and the cleanup goes on at once, then at its own pace.
        """
        if not self.sleep(seconds):
            return self
        if self.cancelled():
            raise CancelledError()
        return self._replace(hurry=None)


class _TimedOut(Exception):
    """A wait's deadline expired; args[0] is that _Deadline."""


_ENDLESS = _Deadline()  # no deadline, nothing that interrupts


_PACING_POLL = 0.05  # seconds between looks at a full window
_LONGEST_HOLD = 86_400.0  # seconds a request holds its place at most before it is answered
_EPOCH_SLACK = 5.0  # seconds the epoch of the monotonic clock may move between two writers
_WIN_BACK = 16  # periods a narrowed window takes at the fastest to win its whole limit back


class _Place(NamedTuple):
    """A request's place in a window: its token, and when it was let through."""

    token: int
    let_through: float


@dataclasses.dataclass
class _Window:
    """One sliding window, on the monotonic clock: the places of requests on
    their way (token -> the latest they free), the times at which the places
    of answered requests free (in order), and how many places it allows now
    (the limit, or fewer since a 429)."""

    allowance: float
    narrowed_at: float = -math.inf
    on_the_way: Dict[int, float] = dataclasses.field(default_factory=dict)
    answered: array.array[float] = dataclasses.field(default_factory=lambda: array.array("d"))

    def expire(self, now: float) -> None:
        del self.answered[: bisect.bisect_right(self.answered, now)]
        if self.on_the_way and min(self.on_the_way.values()) <= now:  # its process died
            self.on_the_way = {t: frees for t, frees in self.on_the_way.items() if frees > now}

    def held(self) -> int:
        return len(self.on_the_way) + len(self.answered)

    def first_free(self) -> float:
        return min(itertools.chain(self.answered[:1], self.on_the_way.values()))

    def answer(self, token: int, frees: float) -> None:
        self.on_the_way.pop(token, None)
        bisect.insort(self.answered, frees)


_WINDOWS_FILE = "windows"  # the one file of every shared window, in the folder of _window_file
_WINDOW_MAGIC = b"cxpace2\n"
_FILE_HEAD = struct.Struct("=8sd")
_WINDOW_HEAD = struct.Struct("=16sddddQQ")
_WINDOW_PLACE = struct.Struct("=dQ")
_WINDOW_TIME = struct.Struct("=d")  # array "d", native


class _SharedWindow:
    """The window of one origin and limit, kept with those of every other in
    the one file that the processes of this user on this machine share (see
    _window_file).

    The file, in native byte order (it never leaves the machine), is a head
    (_FILE_HEAD: magic, clock epoch) and then the windows one after the
    other to its end, each a head (_WINDOW_HEAD: its key, until when it is
    of use, period, allowance, narrowed at, how many places are on their
    way, how many are answered), the places on their way
    (_WINDOW_PLACE: the latest each frees, its token), then the times the
    answered ones free, ascending (_WINDOW_TIME). The key is the first 16
    bytes of the SHA-256 of the origin, the limit and the period.

    The file is opened and locked (flock) only while it is read and written,
    never while a request is on its way. Times are on the monotonic clock,
    which the processes of one machine share; the head keeps its epoch (wall
    time minus monotonic time). A file whose epoch differs (another boot, a
    clock stepped) or that is not whole starts afresh, and so does a window
    that no process can have written. A place held by a process that died
    frees when its time is over, like any other.

    Each write leaves out the windows that are of use no more (they hold no
    place, and no narrowing younger than _WIN_BACK periods), so the file
    holds the windows in use and no more; those of other origins and limits
    are copied as they are, read no further than their heads. Being one
    file for every origin, it is never removed: nothing piles up however
    many origins come and go (local servers on random ports), and no
    process can lock a file that another has just removed, with the places
    it then wrote seen by nobody.
    """

    def __init__(self, path: str, key: bytes, limit: int, period: float) -> None:
        self.path = path
        self._key = key
        self._limit = limit
        self._period = period

    def update(self, change: Callable[[_Window, float], _T]) -> _T:
        """`change` applied to the window, which the file holds before and after."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when the file is closed
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise PermissionError("the shared window file is not this user's alone")
            now = time.monotonic()
            window, others = self._read(os.pread(fd, info.st_size, 0), now)
            result = change(window, now)
            epoch = time.time() - now
            data = b"".join(
                [_FILE_HEAD.pack(_WINDOW_MAGIC, epoch), *others, self._encoded(window, now)]
            )
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            return result
        finally:
            os.close(fd)

    def _read(self, data: bytes, now: float) -> Tuple[_Window, List[bytes]]:
        """This window in the file's `data` (a fresh one unless the file holds a
        sound one), and the records of the other windows still of use."""
        fresh = _Window(float(self._limit))
        if len(data) < _FILE_HEAD.size:
            return fresh, []
        magic, epoch = _FILE_HEAD.unpack_from(data)
        if magic != _WINDOW_MAGIC or not abs(epoch - (time.time() - now)) <= _EPOCH_SLACK:
            return fresh, []
        window, others, offset = fresh, [], _FILE_HEAD.size
        while offset < len(data):  # each other window costs a look at its head, no more
            if len(data) - offset < _WINDOW_HEAD.size:
                return fresh, []  # torn, or not written by this code
            head = _WINDOW_HEAD.unpack_from(data, offset)
            key, until, period, _, _, on_the_way, answered = head
            start, offset = offset, offset + _WINDOW_HEAD.size
            offset += on_the_way * _WINDOW_PLACE.size + answered * _WINDOW_TIME.size
            if offset > len(data):
                return fresh, []
            if not now < until < now + _LONGEST_HOLD + _WIN_BACK * period:
                continue  # of no use any more, or written by no process
            if key != self._key:
                others.append(data[start:offset])
            else:
                window = self._window(data, start, head, now) or fresh
        return window, others

    def _window(
        self, data: bytes, offset: int, head: Tuple[Any, ...], now: float
    ) -> Optional[_Window]:
        """The window whose record is at `offset`; None unless some process can have written it."""
        _, _, _, allowance, narrowed_at, on_the_way, answered = head
        places = offset + _WINDOW_HEAD.size
        times = places + on_the_way * _WINDOW_PLACE.size
        window = _Window(allowance, narrowed_at)
        for frees, token in _WINDOW_PLACE.iter_unpack(data[places:times]):
            window.on_the_way[token] = frees
        window.answered.frombytes(data[times : times + answered * _WINDOW_TIME.size])
        sound = 1 <= allowance <= self._limit and narrowed_at <= now
        return window if sound and self._last(window) < now + _LONGEST_HOLD + self._period else None

    def _encoded(self, window: _Window, now: float) -> bytes:
        """The record of `window`, or nothing once it is of no use: it holds no
        place, and no narrowing it has not won back."""
        window.expire(now)
        until = self._last(window)
        if window.allowance < self._limit:
            until = max(until, window.narrowed_at + _WIN_BACK * self._period)
        if until <= now:
            return b""
        head = (self._key, until, self._period, window.allowance, window.narrowed_at)
        return b"".join(
            [
                _WINDOW_HEAD.pack(*head, len(window.on_the_way), len(window.answered)),
                *(_WINDOW_PLACE.pack(f, t) for t, f in window.on_the_way.items()),
                window.answered.tobytes(),
            ]
        )

    @staticmethod
    def _last(window: _Window) -> float:
        """When the last of its places frees: the answered ones free in order."""
        return max(
            itertools.chain(window.answered[-1:], window.on_the_way.values()), default=-math.inf
        )


def _window_file(origin: str, limit: int, period: float) -> Optional[_SharedWindow]:
    """The shared window of this origin and limit, or None where there is none.

    Its file, the one of every window, is in a folder of this user's alone
    (mode 0700) under $XDG_RUNTIME_DIR, else the temp directory; without
    fcntl (Windows), or when that folder is not safely ours, each process
    paces alone.
    """
    if fcntl is None:
        return None
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if not (os.path.isabs(runtime) and os.path.isdir(runtime)):
        runtime = ""
    try:  # gettempdir() raises when no temp directory is usable
        folder = os.path.join(runtime or tempfile.gettempdir(), f"createos_exec-{os.getuid()}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        info = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        logger.debug("Pacing is per process: %s is not this user's alone", folder)
        return None
    key = hashlib.sha256(f"{origin} {limit} {period!r}".encode()).digest()[:16]
    return _SharedWindow(os.path.join(folder, _WINDOWS_FILE), key, limit, period)


class _RateLimiter:
    """Sliding-window pacing of every request sent to one API origin.

    A request holds its place from the moment it is let through until its
    answer starts (or it fails), and for one period after that: a server that
    counts arrivals never sees more than `limit` in any window, however long
    requests queue on the way. The window is shared by the threads of this
    process and, through a file, by the processes of this user on this
    machine. After a 429 it allows half as many requests (once per round of
    requests let through), and wins the rest back as answers come.
    """

    _shared: Dict[Tuple[str, int, float], "_RateLimiter"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, limit: int, period: float, file: Optional[_SharedWindow] = None) -> None:
        self._limit = limit
        self._period = period
        self._own = _Window(float(limit))  # the window, unless `file` holds it
        self._file = file
        self._lock = threading.Lock()

    @classmethod
    def for_origin(cls, origin: str, limit: int, period: float) -> "_RateLimiter":
        with cls._shared_lock:
            key = (origin, limit, period)
            if key not in cls._shared:
                cls._shared[key] = cls(limit, period, _window_file(origin, limit, period))
            return cls._shared[key]

    def acquire(self, hold: float = math.inf, deadline: _Deadline = _ENDLESS) -> Optional[_Place]:
        """Wait for a place in the window; hand it to release() once answered.
        None when `deadline` passed first.

        `hold` is the longest the request can take to arrive (its timeouts):
        should release() never come, the place frees that long plus a period
        after it was let through. The cancel of `deadline` ends the wait; its
        hurry lets it through at once, over the limit if need be: the
        termination a cancel asks for waits for no other request.
        """
        hold = min(hold, _LONGEST_HOLD)
        first = False
        while True:
            taken = self._update(functools.partial(self._take, hold, first))
            if isinstance(taken, _Place):
                return taken
            if deadline.expired():
                return None
            hurried = deadline.pause(min(taken, _PACING_POLL))
            first = hurried.hurry is None and deadline.hurry is not None
            deadline = hurried

    def release(self, place: _Place, status: Optional[int] = None) -> None:
        """The answer to the request of `place` started (its status), or it failed (None)."""
        self._update(functools.partial(self._settle, place, status))

    def _update(self, change: Callable[[_Window, float], _T]) -> _T:
        with self._lock:
            if self._file is not None:
                try:
                    return self._file.update(change)
                except OSError:
                    logger.debug("Pacing is per process from now on: the window file failed")
                    self._file = None
            return change(self._own, time.monotonic())

    def _take(self, hold: float, first: bool, window: _Window, now: float) -> Union[_Place, float]:
        """A place (`first`: even in a full window), or the seconds until the first one frees."""
        window.expire(now)
        if first or window.held() < int(window.allowance):
            place = _Place(random.getrandbits(64), now)
            window.on_the_way[place.token] = now + hold + self._period
            return place
        return window.first_free() - now

    def _settle(self, place: _Place, status: Optional[int], window: _Window, now: float) -> None:
        window.answer(place.token, now + self._period)
        if status == 429 and place.let_through >= window.narrowed_at:
            window.allowance = max(1.0, window.allowance / 2)
            window.narrowed_at = now
            logger.info(
                "Answered 429: pacing narrowed to %d requests per %g s",
                window.allowance,
                self._period,
            )
        elif status is not None and status != 429 and window.allowance < self._limit:
            # At most a limit's worth in _WIN_BACK periods: a window allows
            # `allowance` answers a period.
            gain = self._limit / (_WIN_BACK * window.allowance)
            window.allowance = min(float(self._limit), window.allowance + gain)


# ==========================================================================
# 12. Configuration checks: the URL, the key, ids, numbers
# ==========================================================================
#
# What a caller gives is checked before anything is sent; a ConfigError
# names the option, never a value that could be a secret.


DEFAULT_API_URL = "https://api.sb.createos.sh"
_HEADER_SAFE = re.compile(r"[!-~]+\Z")  # printable ASCII, no spaces at all
_HOST = re.compile(r"[A-Za-z0-9._:-]+\Z")  # a name, IPv4 or (unbracketed) IPv6
_ID = re.compile(r"[A-Za-z0-9_-]{1,200}\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


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
        key = _key_from_environment()
    if not key:
        raise ConfigError(
            "No API key: pass api_key= to the Client, or set CREATEOS_API_KEY "
            "(or CREATEOS_SANDBOX_API_KEY) in the environment."
        )
    if not isinstance(key, str) or not _HEADER_SAFE.match(key):
        raise ConfigError(
            "The API key contains characters that cannot be sent in a header (a space or a "
            "newline copied with it?)."
        )
    return key


def _key_from_environment() -> Optional[str]:
    return os.environ.get("CREATEOS_API_KEY") or os.environ.get("CREATEOS_SANDBOX_API_KEY") or None


def _checked_id(kind: str, value: Any) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise ConfigError(
            f"Invalid {kind} id {_shown(value)}: expected 1-200 characters of A-Z a-z 0-9 _ -."
        )
    return value


def _remote_path(path: Any) -> str:
    """A path in the sandbox: absolute, naming a file or a directory (one that ends
    in "/" says it is a directory)."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if (
        not isinstance(text, str)
        or not text.startswith("/")
        or "\0" in text
        or posixpath.basename(text.rstrip("/")) in ("", ".", "..")
    ):
        raise ConfigError(
            "The path in the sandbox must be absolute and name a file, as in "
            f"/app/data.csv (not {_shown(text, 200)})."
        )
    return text


def _named(name: Optional[str], path: str) -> str:
    """The name a source takes in the directory `path` of the sandbox: a local path's own."""
    if name is None:
        raise ConfigError(
            "The path in the sandbox must name a file for bytes or a file object, as in "
            f"/app/data.csv (not {_shown(path, 200)})."
        )
    return name


def _check_progress(progress: Any) -> None:
    if progress is not None and not callable(progress):
        raise ConfigError("progress must be None or callable(done_bytes, total_bytes).")


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


_TERMINAL = (24, 80)  # rows and cols of pty=True
_WINSIZE_MAX = 65535  # rows and cols are unsigned shorts in a terminal's winsize


def _terminal_size(value: Any) -> Optional[Tuple[int, int]]:
    """pty=: True (24 x 80), (rows, cols), or False (pipes, as None)."""
    if value is True or value is False:
        return _TERMINAL if value else None
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(_is_int(number) and 0 < number <= _WINSIZE_MAX for number in value)
    ):
        return value[0], value[1]
    raise ConfigError(
        f"A terminal's size must be (rows, cols), integers from 1 to {_WINSIZE_MAX}, "
        f"not {_shown(value)} (pty=True is {_TERMINAL[0]} x {_TERMINAL[1]})."
    )


def _positive_seconds(name: str, value: Any) -> float:
    if not _is_number(value) or not value > 0 or value != value:
        raise ConfigError(f"{name} must be a positive number of seconds, not {_shown(value)}.")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ==========================================================================
# 13. Sandbox-side scripts
# ==========================================================================


# Every line of bash this module sends lives here. Each string is complete:
# its functions open and close every parenthesis and quote within it, one
# statement a line, and values reach them only as arguments, single-quoted by
# _quote, never spliced into code. They need bash 5.0 or newer (the wrapper
# refuses an older one with exit 125) and /proc; of coreutils, rm for the
# staged file, tee for the spool (stat, tail, head and base64 to read it
# back), readlink for the port probe, and those the files' checks name. At
# some 850 lines they are one section on purpose: one set of rules (quoting,
# bash 5, names that start with _cx_) and one check hold them all. The names they set
# start with `_cx_` and are local or assigned before they are read, so that
# a caller's env, which the wrapper exports before the watchdog starts,
# changes none of them. tests/shellcheck_scripts.py checks each one with
# shellcheck (in `nox -s lint`); tests/test_scripts.py runs their functions
# alone.

# The wrapper's own failures read as a shell's would: they name the program
# or the directory, never the marker (its $0, which BASH_ARGV0 renames once
# the spool is named after it, for whatever bash reports itself). Its first
# act is to refuse a bash too old for what follows.
_WRAPPER_HEAD = r'''_cx_fail() {
    printf 'createos_exec: %s\n' "$2" >&2
    exit "$1"
}
_cx_need_bash() {
    # $1: this bash's major version, $2: its whole version
    (($1 >= 5)) && return
    _cx_fail 125 "bash $2 is too old: createos_exec needs bash 5.0 or newer in the sandbox"
}
_cx_need_bash "${BASH_VERSINFO[0]}" "$BASH_VERSION"'''
_NAMED = "BASH_ARGV0=createos_exec"
_READ_STAGED = r"""_cx_read_staged() {
    # $1: the staged file, opened on fd 3 and removed at once; $2: "stdin"
    # when the rest of it is the command's stdin; $3: the name of a variable
    # no caller's env can hold, for each of its NAME=value entries.
    { exec 3<"$1"; } 2>/dev/null || _cx_fail 125 'cannot read the staged file of env and stdin'
    rm -f -- "$1"
    while IFS= read -r -d '' -u 3 "$3" && [[ -n ${!3} ]]; do
        export "${!3}"
    done
    unset "$3"
    if [[ $2 == stdin ]]; then
        exec 0<&3
    fi
    exec 3<&-
}"""
_ENTER = r"""_cx_enter() {
    # $1: the working directory; a failure says bash's reason, as cd would
    local why
    cd -- "$1" 2>/dev/null && return
    why=$(cd -- "$1" 2>&1 || :)
    _cx_fail 1 "cd: $1: ${why##*: }"
}"""
# A program name with blanks in it is most often a command line given as one
# string ("echo hi"): the message says so, and what to give instead.
_FIND_PROGRAM = r"""_cx_missing() {
    # $1: the program, $2: why it cannot be run
    local advice="a string is ONE program name: give the command as a list of arguments,"
    advice+=" or use shell=True or --shell"
    case $1 in
        *[[:space:]]*) _cx_fail 127 "$1: $2 ($advice)" ;;
    esac
    _cx_fail 127 "$1: $2"
}
_cx_find_program() {
    case $1 in
        */*) [[ -e $1 ]] || _cx_missing "$1" "No such file or directory" ;;
        *) type -P -- "$1" >/dev/null || _cx_missing "$1" "command not found" ;;
    esac
}"""
# A terminal's type, unless the caller's env names one (a service may set none).
_TERMINAL_TYPE = "export TERM=xterm-256color"
# The spool (design item 19): each stream of a pipe process goes through a
# spooler, a process substitution the command inherits as its stdout or
# stderr. Its tee copies what comes to the spool, a file of the stream's own
# in /tmp (mode 0600, kept to its first $2 KiB by RLIMIT_FSIZE; tee goes on
# to the service alone past it), then to the service's pipe: the spool is
# never behind what the service has. The spooler holds the spool open on a
# descriptor it shares with tee, whose position is then the bytes written:
# when its stream ends, it writes that count as the stream's "end", and the
# second to end drops both spools when together they hold fewer than $3
# bytes, which the service's journal keeps whole; bigger ones are the
# client's to remove once it has read everything. A spooler ignores the
# signals sent to the process group from its birth, so that a command's
# last words in its grace period still reach the service, and a signal the
# command meets as it starts takes nothing it wrote; it says nothing
# anywhere itself.
_SPOOL = r"""set +o posix
_cx_spool() {
    # $1: the spool's path, to which each stream's name is added; $2: the
    # most KiB a stream's spool keeps; $3: the bytes under which the spools
    # are dropped once both streams have ended. Each stream's pipe leads to a
    # process substitution that forks its spooler off and leaves, and is
    # waited for: the command gains no child it did not start.
    local out err forking
    exec {out}> >(_cx_fork_spooler "$1" stdout stderr "$2" "$3")
    forking=$!
    exec {err}> >(_cx_fork_spooler "$1" stderr stdout "$2" "$3" >&2)
    wait "$forking" "$!"
    exec >&"$out" 2>&"$err" {out}>&- {err}>&-
}
_cx_fork_spooler() {
    # The spooler is born ignoring the group's signals: one sent as the
    # command starts would otherwise end it before its trap, and with it
    # what the command had written to its pipe.
    local stream
    trap '' HUP INT QUIT TERM USR1 USR2 ALRM XFSZ
    exec {stream}<&0
    _cx_spooler "$@" <&"$stream" &
}
_cx_spooler() {
    # $1: the spool's path, $2: this stream, $3: the other; $4, $5: as for
    # _cx_spool. stdin: the command's stream; stdout: the service's pipe,
    # closed here only once the end is written.
    local spool pipe bytes other
    exec 2>/dev/null
    IFS=$' \t\n'
    umask 077
    ulimit -f "$4"
    exec {spool}>"$1.$2" || exec {spool}>/dev/null
    exec {pipe}>&1 >/dev/null
    tee -- "/dev/fd/$pipe" <&0 >&"$spool" &
    wait "$!"
    read -r _ bytes <"/proc/$BASHPID/fdinfo/$spool"
    printf '%s\n' "$bytes" >"$1.$2.end"
    exec {pipe}>&-
    read -r other <"$1.$3.end" || return 0
    ((bytes + other < $5)) || return 0
    rm -f -- "$1.stdout" "$1.stderr" "$1.stdout.end" "$1.stderr.end"
}"""
# The spool of a wrapper, named after its marker ($0), as the wrapper calls it,
# and that line as a listed process shows it (its limit, for a handle taken up).
# Without tee there is no spool (a pipe nobody reads would end the command).
_SPOOLING = _SPOOL + (
    f'\ntype -P tee >/dev/null && _cx_spool "/tmp/.$0" {_SPOOL_LIMIT // 1024} {_SPOOL_KEPT_FROM}'
)
_SPOOL_CALL = re.compile(
    r'^type -P tee >/dev/null && _cx_spool "/tmp/\.\$0" ([0-9]{1,9}) [0-9]+$', re.MULTILINE
)
# The wrapper's last line, for a script (shell=True) or an argv.
_RUN_SCRIPT = 'exec bash -c -- "$1"'
_RUN_ARGV = 'exec -- "$@"'

# The processes of a tree, as /proc shows them: shared by the watchdog and the
# port probe. A tree is a string " pid pid ... " to look pids up in, and the
# array _cx_members of the same pids.
_PROCESSES = r"""_cx_stat() {
    # Fields 3, 4, 5 and 22 of /proc/PID/stat (proc(5)): state, ppid, pgrp
    # and starttime, counted after the last ")", since the command's name
    # (field 2) may hold blanks and parentheses.
    local line
    local -a field
    { read -r line <"/proc/$1/stat"; } 2>/dev/null || return 1
    # shellcheck disable=SC2206  # numbers and a state letter: nothing to glob
    field=(${line##*) })
    _cx_state=${field[0]}
    _cx_ppid=${field[1]}
    _cx_pgrp=${field[2]}
    _cx_starttime=${field[19]}
}
_cx_leader_runs() {
    # Whether the leader ($_cx_leader, started at $_cx_born) runs: a zombie,
    # or a pid of another start time, has ended.
    _cx_stat "$_cx_leader" || return 1
    [[ $_cx_state != [ZX] && $_cx_starttime == "$_cx_born" ]]
}
_cx_scan() {
    # Every live process but this shell, in three columns: pid, ppid, pgrp.
    local stat pid
    _cx_pids=()
    _cx_ppids=()
    _cx_pgrps=()
    for stat in /proc/[0-9]*/stat; do
        pid=${stat//[^0-9]/}
        [[ $pid != "$BASHPID" ]] || continue
        _cx_stat "$pid" || continue
        [[ $_cx_state != [ZX] ]] || continue
        _cx_pids+=("$pid")
        _cx_ppids+=("$_cx_ppid")
        _cx_pgrps+=("$_cx_pgrp")
    done
}
_cx_plant() {
    # A tree of the pids given, and nothing else.
    _cx_tree=' '
    _cx_members=()
    local pid
    for pid in "$@"; do
        _cx_join "$pid"
    done
}
_cx_join() {
    [[ $_cx_tree != *" $1 "* ]] || return 0
    _cx_tree+="$1 "
    _cx_members+=("$1")
}
_cx_grow() {
    # Adds to the tree every scanned process whose parent is in it.
    local i grew=1
    while ((grew)); do
        grew=0
        for i in "${!_cx_pids[@]}"; do
            [[ $_cx_tree == *" ${_cx_ppids[i]} "* ]] || continue
            [[ $_cx_tree != *" ${_cx_pids[i]} "* ]] || continue
            _cx_join "${_cx_pids[i]}"
            grew=1
        done
    done
}"""
# The sandbox keeps a `timeout` itself, for a client that died or lost the
# network. Just before the final exec, the wrapper opens a pipe to a process
# substitution that forks the watchdog and leaves: the program (the wrapper's
# pid after exec, so its own exit code and signal are reported) keeps the
# pipe's write end and gains no child it did not start; the watchdog, an
# orphan the sandbox's init reaps, keeps its read end and nothing of the
# program's stdio. It waits on the pipe, whose end of file comes the moment
# the program ends (unless what it put in the background holds the pipe
# too), and looks at the leader in /proc every 0.1 s all the same; it leaves
# once the leader has ended, leaving alone what the program put in the
# background. At the deadline it sends
# SIGTERM to the tree: the leader's process group, where the leader leads one
# (never a group it does not lead, which may hold the sandbox's agent), the
# processes of the leader's cgroup, where it has one of its own (not the
# agent's), and the descendants of them all, found by a scan of /proc; each
# process once, so that a handler runs once. It leaves as soon as nothing of
# the tree lives (so `wait?scope=tree` is not held up): it looks at the
# processes it signalled every 0.1 s, and scans again once they have all
# ended; else it sends SIGKILL after the grace period, to a tree scanned
# afresh. It ignores the signals sent to the group from its birth, and sets
# again what a caller's env could have changed for it: IFS, GLOBIGNORE,
# POSIX mode (set off before the functions are read: bash 5.0 reads no
# process substitution in it). Bash builtins only: the clock is /proc/uptime
# (in centiseconds) and a read -t on a pipe nobody writes to is its sleep.
_WATCHDOG = r"""set +o posix
_cx_start_watchdog() {
    # $1, $2: the deadline and the grace period, in centiseconds. The pipe's
    # write end stays open here, for the program; the process substitution
    # forks the watchdog off with its read end, and is waited for.
    local holds
    # shellcheck disable=SC2034  # what is kept is the descriptor, not its number
    exec {holds}> >(_cx_fork_watchdog "$$" "$PPID" "$1" "$2")
    wait "$!"
}
_cx_fork_watchdog() {
    # Born ignoring the group's signals, as a spooler is (_cx_fork_spooler).
    local ends
    trap '' HUP INT QUIT TERM USR1 USR2
    exec {ends}<&0
    ( _cx_watch "$@" "$ends" ) </dev/null >/dev/null 2>&1 &
}
_cx_watch() {
    # $1: the leader's pid, $2: the agent's (the wrapper's parent); $3, $4:
    # the deadline and the grace period, in centiseconds; $5: the read end of
    # the pipe the leader keeps open.
    IFS=$' \t\n'
    unset GLOBIGNORE
    set +o posix
    _cx_leader=$1
    _cx_agent=$2
    _cx_stat "$_cx_leader" || return 0
    _cx_born=$_cx_starttime
    _cx_group=
    if [[ $_cx_pgrp == "$_cx_leader" ]]; then
        _cx_group=$_cx_leader
    fi
    exec {_cx_nap}<> <(:)
    _cx_wake=$5
    _cx_now
    _cx_end=$((_cx_uptime + $3))
    while _cx_leader_runs; do
        _cx_sleep_until "$_cx_end" && continue
        _cx_terminate "$4"
        return 0
    done
}
_cx_now() {
    # The uptime in centiseconds, in _cx_uptime.
    local seconds
    read -r seconds _ </proc/uptime
    _cx_uptime=$((10#${seconds/./}))
}
_cx_sleep_until() {
    # Sleeps 0.1 s, or until $1 (centiseconds of uptime) if that comes first,
    # or until the leader's pipe ends; status 1, without sleeping, once $1 has
    # come.
    local left status=0
    _cx_now
    left=$(($1 - _cx_uptime))
    ((left > 0)) || return 1
    ((left < 10)) || left=10
    printf -v left 0.%02d "$left"
    read -r -t "$left" -u "$_cx_wake" _ || status=$?
    if ((status == 1 && _cx_wake != _cx_nap)); then
        _cx_wake=$_cx_nap
        _cx_let_the_leader_end
    fi
}
_cx_let_the_leader_end() {
    # The pipe ended: the leader closes its files just before it becomes a
    # zombie, which looks 2 ms apart see (20 ms at most: a leader that closed
    # the pipe itself runs on, and is looked at as before).
    local look
    for ((look = 0; look < 10; look++)); do
        _cx_leader_runs || return 0
        read -r -t 0.002 -u "$_cx_nap" _
    done
}
_cx_terminate() {
    # SIGTERM to the tree; SIGKILL $1 centiseconds later, unless it has all ended.
    _cx_signal TERM
    _cx_end=$((_cx_uptime + $1))
    while _cx_sleep_until "$_cx_end"; do
        _cx_all_ended || continue
        _cx_targets
        ((${#_cx_members[@]})) || return 0
    done
    _cx_signal KILL
}
_cx_signal() {
    # Signal $1 to the tree, each process once: its group by the group's id,
    # the others by their pids.
    _cx_targets
    if ((${#_cx_apart[@]})); then
        kill -s "$1" -- "${_cx_apart[@]}" 2>/dev/null
    fi
    if [[ -n $_cx_group ]]; then
        kill -s "$1" -- "-$_cx_group" 2>/dev/null
    fi
}
_cx_all_ended() {
    local pid
    for pid in "${_cx_members[@]}"; do
        _cx_stat "$pid" || continue
        [[ $_cx_state == [ZX] ]] || return 1
    done
}
_cx_targets() {
    # The tree as it is now: the leader's group (where it leads one), the
    # leader, the processes of its own cgroup, and all their descendants;
    # in _cx_apart, those outside the group.
    local i grouped
    local -a group=()
    _cx_scan
    if [[ -n $_cx_group ]]; then
        for i in "${!_cx_pids[@]}"; do
            [[ ${_cx_pgrps[i]} != "$_cx_group" ]] || group+=("${_cx_pids[i]}")
        done
    fi
    _cx_plant "${group[@]}"
    grouped=$_cx_tree
    if _cx_leader_runs; then
        _cx_join "$_cx_leader"
    fi
    _cx_join_cgroup
    _cx_grow
    _cx_apart=()
    for i in "${_cx_members[@]}"; do
        [[ $grouped == *" $i "* ]] || _cx_apart+=("$i")
    done
}
_cx_join_cgroup() {
    # Adds the scanned processes of the leader's cgroup, where it has one of
    # its own, to the tree.
    local pid i listed=' '
    _cx_own_cgroup "$_cx_leader" "$_cx_agent" || return 0
    while read -r pid; do
        listed+="$pid "
    done 2>/dev/null <"$_cx_cgroup_procs"
    for i in "${!_cx_pids[@]}"; do
        [[ $listed != *" ${_cx_pids[i]} "* ]] || _cx_join "${_cx_pids[i]}"
    done
}
_cx_own_cgroup() {
    # The cgroup.procs file of pid $1's cgroup, where that is not pid $2's,
    # in _cx_cgroup_procs: of cgroup v2, else of v1's "pids" controller.
    _cx_own_cgroup_in 0 "$1" "$2" /sys/fs/cgroup/unified /sys/fs/cgroup ||
        _cx_own_cgroup_in pids "$1" "$2" /sys/fs/cgroup/pids
}
_cx_own_cgroup_in() {
    # $1: the hierarchy, $2 and $3: the pids, the rest: where it may be mounted.
    local leader mount
    _cx_cgroup_procs=
    _cx_cgroup_of "$2" "$1" || return 1
    leader=$_cx_cgroup
    _cx_cgroup_of "$3" "$1" || return 1
    [[ $leader != "$_cx_cgroup" ]] || return 1
    shift 3
    for mount in "$@"; do
        [[ -f $mount$leader/cgroup.procs ]] || continue
        _cx_cgroup_procs=$mount$leader/cgroup.procs
        return 0
    done
    return 1
}
_cx_cgroup_of() {
    # The path of pid $1 in the hierarchy $2 of /proc/PID/cgroup ("0" for v2,
    # "pids" for v1's controller), in _cx_cgroup.
    local id controllers path
    while IFS=: read -r id controllers path; do
        [[ $id$controllers == 0 && $2 == 0 || ,$controllers, == *",$2,"* ]] || continue
        _cx_cgroup=$path
        return 0
    done 2>/dev/null <"/proc/$1/cgroup"
    return 1
}"""
_LONGEST_WATCH = 1e9  # seconds; a longer deadline is kept as this one (31 years)


def _watchdog(timeout: float, grace: float) -> List[str]:
    """The wrapper's lines that fork the watchdog: SIGTERM at `timeout`, SIGKILL `grace` later."""
    due, kill_after = (str(math.ceil(min(s, _LONGEST_WATCH) * 100)) for s in (timeout, grace))
    return [_PROCESSES, _WATCHDOG, _call("_cx_start_watchdog", due, kill_after)]


def _reading_staged(path: str, marker: str, piped: bool) -> List[str]:
    """The wrapper's lines that read the staged file: its variables, and on
    stdin the rest of it, unless the command's stdin is the service's pipe."""
    var = "_" + marker.replace("-", "_")  # a name no caller's variable can have
    return [_READ_STAGED, _call("_cx_read_staged", path, "env" if piped else "stdin", var)]


def _call(function: str, *args: str) -> str:
    """A line that calls one of the functions above with `args`, each quoted."""
    return " ".join([function, *map(_quote, args)])


def _quote(text: str) -> str:
    """Single-quote for bash: nothing inside is expanded."""
    return "'" + text.replace("'", "'\\''") + "'"


# The port probe of wait_for_port(): bash alone for the connect (/dev/tcp: no
# curl or nc), one connect a round, each cut after a second (a host that drops
# packets). A connection accepted is not enough: some other server may hold
# the port. The probe returns only once a socket listening on the port is
# open in the target's tree (the target and its descendants): its inode, in
# /proc/net/tcp or tcp6, among the links of their /proc/PID/fd, which
# coreutils' readlink reads. The target's pid is watched between rounds, so
# that its end is seen at once. Its own limit ends it even if nobody deletes
# it. Sleeping is a read that times out: no /bin/sleep needed.
_PROBE = r"""_cx_probe() {
    # $1: the target's pid, $2 and $3: the host and port, $4: the probe's
    # own limit, in seconds. Exits 0 (the target listens), 3 (it has ended)
    # or 4 (the limit).
    exec {_cx_nap}<> <(:)
    _cx_leader=$1
    _cx_stat "$_cx_leader" || exit 3
    _cx_born=$_cx_starttime
    while ((SECONDS < $4)); do
        if _cx_connects "$2" "$3" && _cx_listens "$1" "$3"; then
            exit 0
        fi
        _cx_leader_runs || exit 3
        read -r -t 0.1 -u "$_cx_nap" _
    done
    exit 4
}
_cx_connects() {
    # Whether host $1 accepts a TCP connection on port $2 within a second.
    local try look
    ( : 3<>"/dev/tcp/$1/$2" ) 2>/dev/null &
    try=$!
    for ((look = 0; look < 10; look++)); do
        kill -0 "$try" 2>/dev/null || break
        read -r -t 0.1 -u "$_cx_nap" _
    done
    kill "$try" 2>/dev/null
    wait "$try"
}
_cx_listens() {
    # Whether a socket listening on TCP port $2 is open in the tree of pid $1.
    local table line hex pid link listening=' '
    local -a lines field fds=()
    printf -v hex ':%04X' "$2"
    for table in /proc/net/tcp /proc/net/tcp6; do
        # Read whole: bash reads a file line by line a byte at a time, and
        # each read of /proc/net/tcp walks the table again.
        mapfile -t lines 2>/dev/null <"$table" || continue
        for line in "${lines[@]}"; do
            # Fields 2, 4 and 10 of proc(5)'s table: local_address, st, inode.
            # shellcheck disable=SC2206  # hex, numbers and colons: nothing to glob
            field=($line)
            [[ ${field[3]} == 0A && ${field[1]} == *"$hex" ]] || continue
            listening+="socket:[${field[9]}] "
        done
    done
    [[ $listening != ' ' ]] || return 1
    _cx_scan
    _cx_plant "$1"
    _cx_grow
    for pid in "${_cx_members[@]}"; do
        fds+=(/proc/"$pid"/fd/*)
    done
    while read -r link; do
        [[ $listening != *" $link "* ]] || return 0
    done < <(readlink -- "${fds[@]}" 2>/dev/null)
    return 1
}
_cx_probe "$@"
"""
_PROBE_SCRIPT = _PROCESSES + "\n" + _PROBE
# The probe's exits: the port opened, the target's pid is gone, its own limit.
_PROBE_OPEN, _PROBE_GONE, _PROBE_LIMIT = _Exit(0, None), _Exit(3, None), _Exit(4, None)

# The scripts of put() and get() (section 7): bash 4.4 or newer and, of
# coreutils, stat, sha256sum (or openssl), chmod, mv, rm, cat, head, tail and
# truncate; for a directory tar, find and xargs too. A file's size and SHA-256
# come from one stat and one read of it. Each may run twice (its answer lost):
# a second run ends as the first did, from what the first left.
_FILE_SUMS = r"""_cx_can_hash() {
    type -P sha256sum >/dev/null || type -P openssl >/dev/null
}
_cx_measure() {
    # The size and SHA-256 of file $1 (a symlink followed), in _cx_size and
    # _cx_sum: openssl's for a file of 1 MiB or more (it uses the CPU's SHA
    # instructions, several times faster, but takes some 10 ms to start) or
    # without sha256sum, else sha256sum's.
    local line
    _cx_size=$(stat -L -c %s -- "$1") || return 1
    if type -P openssl >/dev/null &&
        { ((_cx_size >= 1048576)) || ! type -P sha256sum >/dev/null; }; then
        line=$(openssl dgst -sha256 -r <"$1") || return 1
    else
        line=$(sha256sum -b <"$1") || return 1
    fi
    _cx_sum=${line%% *}
}
_cx_matches() {
    # Whether file $1 has the size $2 and the SHA-256 $3.
    _cx_measure "$1" 2>/dev/null && [[ $_cx_size == "$2" && $_cx_sum == "$3" ]]
}
_cx_stamp() {
    # What a write to file $1 (a symlink followed) changes: its inode, size
    # and modification time.
    stat -L -c '%i %s %.9Y' -- "$1" 2>/dev/null
}
_cx_drop() {
    # Remove the file $1 and exit $2.
    rm -f -- "$1"
    exit "$2"
}"""
# A directory's manifest, as _tree_record() writes it in section 7: a record
# an entry, "TYPE MODE SIZE DIGEST LENGTH:PATH" ended by a NUL, sorted
# bytewise, hashed. find and the sums are read with mapfile, not read: bash
# reads a pipe a byte at a time.
_TREE_SUMS = r"""_cx_tree_sums() {
    # "SUM *./PATH", NUL-ended, of every regular file under the current
    # directory: sha256sum's of the small ones in one run, _cx_measure's of
    # each of the others.
    local file
    find . -type f -size -1048576c -print0 | xargs -0 -r sha256sum -bz -- || return 1
    while IFS= read -r -d '' file; do
        _cx_measure "$file" || return 1
        printf '%s *%s\0' "$_cx_sum" "$file"
    done < <(find . -type f -size +1048575c -print0)
}
_cx_records() {
    # The manifest's records of the tree at the current directory, unsorted;
    # returns 1 when a file cannot be read, 8 when it holds something other
    # than files, directories and symlinks.
    local LC_ALL=C line kind mode size path target digest i
    local -a sums entries
    local -A sum_of=()
    mapfile -d '' sums < <(_cx_tree_sums)
    wait "$!" || return 1
    for line in "${sums[@]}"; do
        sum_of[${line:68}]=${line:0:64}
    done
    mapfile -d '' entries < <(find . -printf '%y %m %s %P\0%l\0')
    for ((i = 0; i < ${#entries[@]}; i += 2)); do
        line=${entries[i]}
        kind=${line%% *} line=${line#* }
        mode=${line%% *} line=${line#* }
        size=${line%% *} path=${line#* }
        target=${entries[i + 1]}
        case $kind in
            f) digest=${sum_of[$path]-} && [[ -n $digest ]] || return 1 ;;
            d) size=0 digest=- ;;
            l) size=0 mode=777 digest=${#target}:$target ;;
            *) return 8 ;;
        esac
        printf '%s %s %s %s %s:%s\0' "$kind" "$mode" "$size" "$digest" "${#path}" "$path"
    done
}
_cx_manifest() {
    # The SHA-256 of the manifest of the directory $1 in _cx_manifest; fails
    # as _cx_records does.
    local line
    line=$(
        set -o pipefail
        cd -- "$1" && _cx_records | LC_ALL=C sort -z | sha256sum
    ) || return
    _cx_manifest=${line%% *}
}
_cx_tree_stamp() {
    # What a change to the tree at $1 changes: a hash of every entry's inode,
    # size, modification time and path.
    (cd -- "$1" && find . -printf '%i %s %T@ %P\0' | sha256sum)
}
_cx_need_tar() {
    # Whether the tools of a directory's transfer are here.
    type -P tar >/dev/null && type -P find >/dev/null && type -P xargs >/dev/null &&
        type -P sha256sum >/dev/null
}"""
# put(): a file arrives under a temporary name beside its destination, or in
# pieces there (each checked and appended while the next travels), and is
# checked, given its mode and renamed into place; a directory arrives as an
# archive, which is unpacked beside its destination and its manifest checked.
_PLACE = r"""_cx_place() {
    # Rename $1 to $2 (a symlink there written through, to its target), by
    # way of a temporary name beside it where $1 lies in another directory
    # (mv copies from another filesystem); returns 1, having removed what it
    # made, when it cannot.
    local to=$2 beside
    if [[ -L $to ]]; then
        to=$(readlink -f -- "$to") || return 1
    fi
    if [[ ${1%/*} != "${to%/*}" ]]; then
        beside=${to%/*}/.${to##*/}.$$.part
        mv -f -T -- "$1" "$beside" 2>/dev/null || return 1
        set -- "$beside"
    fi
    mv -f -T -- "$1" "$to" 2>/dev/null || _cx_drop "$1" 6
}"""
_FINISH = r"""_cx_finish() {
    # $1: the staged copy, $2: the destination, $3 and $4: the size and
    # SHA-256 sent, $5: the mode in octal ("": the replaced file's, else what
    # the umask gives a new one), $6: its name in a directory at $2 ("": it
    # cannot go in one), $7: "pieces" when its pieces were checked already.
    # Prints "into" when it went inside a directory at $2. Exits 0 (in
    # place), 3 (the copy is gone), 4 (no sha256sum), 5 (what landed differs)
    # or 6 (it could not be moved into place); the copy is removed on each.
    local to=$2 mode=$5
    _cx_can_hash || _cx_drop "$1" 4
    if [[ -d $to && -n $6 ]]; then
        to=$to/$6
        printf 'into\n'
    fi
    if [[ ! -e $1 ]]; then
        _cx_matches "$to" "$3" "$4" && exit 0
        exit 3
    fi
    if [[ $7 == pieces ]]; then
        [[ $(stat -c %s -- "$1") == "$3" ]] || _cx_drop "$1" 5
    else
        _cx_matches "$1" "$3" "$4" || _cx_drop "$1" 5
    fi
    if [[ -z $mode && -f $to ]]; then
        mode=$(stat -L -c %a -- "$to")
    elif [[ -z $mode ]]; then
        printf -v mode '%o' $((8#666 & ~8#$(umask)))
    fi
    chmod -- "$mode" "$1" 2>/dev/null || _cx_drop "$1" 6
    _cx_place "$1" "$to" || _cx_drop "$1" 6
}"""
_APPEND = r"""_cx_append() {
    # $1: the staged copy, $2: a piece of it that landed, $3, $4 and $5: the
    # piece's offset, size and SHA-256. The piece is checked, then appended
    # (the first becomes the copy) and removed. Exits 3 (the copy is short of
    # the pieces before), 4 (no sha256sum), 5 (it differs, or is gone without
    # having been appended: a first run found it different; to be sent
    # again) or 6 (it could not be appended).
    local size
    _cx_can_hash || _cx_drop "$2" 4
    if [[ ! -e $2 ]]; then
        size=$(stat -c %s -- "$1" 2>/dev/null) && ((size == $3 + $4)) && return
        exit 5
    fi
    _cx_matches "$2" "$4" "$5" || _cx_drop "$2" 5
    if (($3 == 0)); then
        mv -f -T -- "$2" "$1" 2>/dev/null || _cx_drop "$2" 6
        return
    fi
    if ! size=$(stat -c %s -- "$1" 2>/dev/null) || ((size < $3)); then
        _cx_drop "$2" 3
    fi
    if ((size > $3)); then
        truncate -s "$3" -- "$1" 2>/dev/null || _cx_drop "$2" 6
    fi
    cat -- "$2" >>"$1" 2>/dev/null || _cx_drop "$2" 6
    rm -f -- "$2"
}
_cx_last() {
    # The last piece appended ($1 to $5, as _cx_append's; exits 9 when it
    # differs), then the copy finished: $6 is "file" (_cx_finish) or "tree"
    # (_cx_unpack), the rest their $2 and on. A second run finds the piece
    # and the copy gone, and the finish checks the destination.
    if [[ -e $1 || -e $2 ]]; then
        (_cx_append "$1" "$2" "$3" "$4" "$5") || exit $(($? == 5 ? 9 : $?))
    fi
    case $6 in
        file) _cx_finish "$1" "${@:7}" pieces ;;
        *) _cx_unpack "$1" "${@:7}" pieces ;;
    esac
}"""
_UNPACK = r"""_cx_unpack() {
    # $1: the staged archive, $2: the destination, $3 and $4: the archive's
    # size and SHA-256, $5: the tree's manifest's, $6: "pieces" when its
    # pieces were checked already. The archive is unpacked beside $2 and
    # removed; the tree is checked, then renamed into place: a directory
    # there is renamed aside first and removed after. Exits as _cx_finish,
    # and 8 (a directory of another kind, or a file, in the way).
    local tree=${1%.part}.d.part old=${1%.part}.old.part to=$2
    _cx_need_tar || _cx_drop "$1" 4
    if [[ -L $to ]]; then
        to=$(readlink -f -- "$to") || _cx_drop "$1" 6
    fi
    if [[ ! -e $1 ]]; then
        [[ -d $to ]] && _cx_manifest "$to" && [[ $_cx_manifest == "$5" ]] && exit 0
        exit 3
    fi
    if [[ $6 == pieces ]]; then
        [[ $(stat -c %s -- "$1") == "$3" ]] || _cx_drop "$1" 5
    else
        _cx_matches "$1" "$3" "$4" || _cx_drop "$1" 5
    fi
    [[ ! -e $to || -d $to ]] || _cx_drop "$1" 8
    mkdir -m 700 -- "$tree" 2>/dev/null || _cx_drop "$1" 6
    if ! tar -x -p --no-same-owner -f "$1" -C "$tree" 2>/dev/null; then
        rm -rf -- "$tree"
        _cx_drop "$1" 6
    fi
    rm -f -- "$1"
    if ! _cx_manifest "$tree" || [[ $_cx_manifest != "$5" ]]; then
        rm -rf -- "$tree"
        exit 5
    fi
    if [[ -d $to ]] && ! mv -T -- "$to" "$old" 2>/dev/null; then
        rm -rf -- "$tree"
        exit 6
    fi
    if ! mv -T -- "$tree" "$to" 2>/dev/null; then
        [[ ! -e $old ]] || mv -T -- "$old" "$to"
        rm -rf -- "$tree"
        exit 6
    fi
    rm -rf -- "$old" 2>/dev/null || { chmod -R u+w -- "$old" && rm -rf -- "$old"; }
}"""
# get(): the sandbox describes the file (its stamp, read before and after its
# hash, says whether it changed meanwhile) while the bytes come, or packs a
# directory into an archive; a download cut past a piece goes on from pieces
# cut there, each described.
_SCRATCH = r"""_cx_scratch() {
    # A new file at $1, or in $TMPDIR (or /tmp) where that cannot be made;
    # prints its path.
    if (set -o noclobber && : >"$1") 2>/dev/null; then
        printf '%s\n' "$1"
        return
    fi
    mktemp -- "${TMPDIR:-/tmp}/.createos_exec.XXXXXXXXXX.part"
}"""
_DESCRIBE_FILE = r"""_cx_listed() {
    # $1: a directory, its stamp then put in _cx_tree_was and the SHA-256 of
    # its manifest in _cx_manifest; exits 6 (unreadable) or 8 (it holds
    # something other than files, directories and symlinks).
    _cx_tree_was=$(_cx_tree_stamp "$1") || exit 6
    _cx_manifest "$1"
    case $? in
        0) ;;
        8) exit 8 ;;
        *) exit 6 ;;
    esac
}
_cx_pack() {
    # $1: a directory, $2: where its archive goes. Prints "tree", the
    # archive's size, the SHA-256 of the tree's manifest, "-" and the
    # archive's path; exits 4 (no tools), 6 (unreadable), 7 (it changed
    # while it was packed) or 8 (it holds something other than files,
    # directories and symlinks).
    local archive
    _cx_need_tar || exit 4
    rm -f -- "$2"
    _cx_listed "$1"
    archive=$(_cx_scratch "$2") || exit 6
    tar -c -f "$archive" -C "$1" . 2>/dev/null || _cx_drop "$archive" 6
    [[ $(_cx_tree_stamp "$1") == "$_cx_tree_was" ]] || _cx_drop "$archive" 7
    printf 'tree %s %s - %s\n' "$(stat -c %s -- "$archive")" "$_cx_manifest" "$archive"
}
_cx_stream() {
    # $1: a directory. Prints "tree", the SHA-256 of the tree's manifest and
    # its archive's size ("-" where tar cannot tell it beforehand) on a line,
    # then the archive in base64 on one line; exits as _cx_pack does (7 once
    # the archive was printed).
    local totals size=-
    _cx_need_tar && type -P base64 >/dev/null || exit 4
    _cx_listed "$1"
    # GNU tar counts an archive written to /dev/null without reading the files.
    totals=$(LC_ALL=C tar -c -f /dev/null --totals -C "$1" . 2>&1 >/dev/null) || :
    if [[ $totals =~ ^Total\ bytes\ written:\ ([0-9]+) ]]; then
        size=${BASH_REMATCH[1]}
    fi
    printf 'tree %s %s\n' "$_cx_manifest" "$size"
    set -o pipefail
    tar -c -f - -C "$1" . 2>/dev/null | base64 -w 0 || exit 6
    [[ $(_cx_tree_stamp "$1") == "$_cx_tree_was" ]] || exit 7
}
_cx_describe() {
    # $1: a path, $2: where a directory's archive goes ("": a directory is
    # refused; "-": its archive follows, as _cx_stream prints it). Prints
    # "file", its size, SHA-256, mode in octal and stamp (_cx_stamp), or a
    # directory's as _cx_pack; exits 3 (no such file), 4 (no sha256sum), 5
    # (not a regular file), 6 (unreadable) or 7 (it changed while it was
    # hashed).
    local stamp
    [[ -e $1 ]] || exit 3
    if [[ -d $1 && $2 == - ]]; then
        _cx_stream "$1"
        exit
    fi
    if [[ -d $1 && -n $2 ]]; then
        _cx_pack "$1" "$2"
        exit
    fi
    [[ -f $1 ]] || exit 5
    _cx_can_hash || exit 4
    stamp=$(_cx_stamp "$1")
    _cx_measure "$1" 2>/dev/null || exit 6
    [[ $(_cx_stamp "$1") == "$stamp" ]] || exit 7
    printf 'file %s %s %s %s\n' "$_cx_size" "$_cx_sum" "$(stat -L -c %a -- "$1")" "$stamp"
}"""
_CUT = r"""_cx_cut() {
    # $1: a file, $2: its stamp when it was described, $3: where the piece
    # goes, $4 and $5: its offset and size, $6: the piece before, removed.
    # Prints the piece's size, SHA-256 and path; exits 6 (unreadable, or no
    # room) or 7 (the file changed). A second run makes the piece again.
    local piece
    rm -f -- "$3" "$6"
    [[ $(_cx_stamp "$1") == "$2" ]] || exit 7
    piece=$(_cx_scratch "$3") || exit 6
    tail -c "+$(($4 + 1))" -- "$1" 2>/dev/null | head -c "$5" >"$piece" || _cx_drop "$piece" 6
    _cx_measure "$piece" 2>/dev/null || _cx_drop "$piece" 6
    [[ $(_cx_stamp "$1") == "$2" ]] || _cx_drop "$piece" 7
    printf '%s %s %s\n' "$_cx_size" "$_cx_sum" "$piece"
}
_cx_unchanged() {
    # Exits 7 when file $1 no longer has the stamp $2, or was written in the
    # last $3 seconds (while it was read, before it was described).
    local written now
    [[ $(_cx_stamp "$1") == "$2" ]] || exit 7
    written=$(stat -L -c %Y -- "$1") || exit 7
    printf -v now '%(%s)T' -1
    ((now - written > $3)) || exit 7
}"""
_PUT_FINISH = f'{_FILE_SUMS}\n{_PLACE}\n{_FINISH}\n_cx_finish "$@"\n'
_PUT_APPEND = f'{_FILE_SUMS}\n{_APPEND}\n_cx_append "$@"\n'
_PUT_LAST = (
    f'{_FILE_SUMS}\n{_TREE_SUMS}\n{_PLACE}\n{_FINISH}\n{_UNPACK}\n{_APPEND}\n_cx_last "$@"\n'
)
_PUT_UNPACK = f'{_FILE_SUMS}\n{_TREE_SUMS}\n{_UNPACK}\n_cx_unpack "$@"\n'
_GET_DESCRIBE = f'{_FILE_SUMS}\n{_TREE_SUMS}\n{_SCRATCH}\n{_DESCRIBE_FILE}\n_cx_describe "$@"\n'
_GET_CUT = f'{_FILE_SUMS}\n{_SCRATCH}\n{_CUT}\n_cx_cut "$@"\n'
_GET_UNCHANGED = f'{_FILE_SUMS}\n{_SCRATCH}\n{_CUT}\n_cx_unchanged "$@"\n'
# What their exits say (TransferError.reason); any other: they could not run.
_PUT_FAILURES = {
    3: "vanished",
    4: "no_tools",
    5: "mismatch",
    6: "not_renamed",
    8: "not_renamed",
    9: "mismatch",
}
_DESCRIBE_FAILURES = {
    3: "missing",
    4: "no_tools",
    5: "not_a_file",
    6: "unreadable",
    7: "changed",
    8: "special",
}

# What the journal evicted, read back from the spool (see _SPOOL and _Spool):
# coreutils' stat, tail, head and base64. Whether a stream has ended is looked
# at before its size, so that the size of an ended stream is its last.
_SPOOL_READ = r"""_cx_spool_read() {
    # $1: the spool's path; $2, $3: the bytes of stdout and of stderr held
    # already; $4: the most bytes of each to print. Exits 3 when a spool is
    # gone.
    _cx_slice "$1.stdout" "$2" "$4"
    _cx_slice "$1.stderr" "$3" "$4"
}
_cx_slice() {
    # $1: a stream's spool, $2: its bytes held, $3: the most to print.
    # Prints "SIZE ENDED" (ENDED: 1 once the stream has ended), then the
    # base64 of its bytes from $2 on, up to SIZE, on a line of its own.
    local ended=0 size count
    [[ ! -e $1.end ]] || ended=1
    size=$(stat -c %s -- "$1" 2>/dev/null) || exit 3
    count=$((size - $2 < $3 ? size - $2 : $3))
    printf '%s %s\n' "$size" "$ended"
    if ((count > 0)); then
        tail -c "+$(($2 + 1))" -- "$1" | head -c "$count" | base64 -w 0
    fi
    printf '\n'
}
_cx_spool_read "$@"
"""


# ==========================================================================
# 14. Port forwarding: a local listener, a tunnel per connection
# ==========================================================================
#
# forward() listens on this machine, and each connection it accepts gets a
# tunnel of its own to the sandbox's port (protocol 7b): one HTTP/1.1
# Upgrade, written by hand on a socket of ours (requests cannot hand an
# upgraded connection over), its answer's head read strictly; after a 101
# the socket is a raw pipe. Each direction holds at most one piece and is
# ended on its own (half-close). Over a plain tunnel where os.splice is
# (Linux, Python 3.10 and later), the thread that opened a connection's
# tunnel and one more move its two directions, each blocked in splice(),
# through a pipe of one piece: the bytes never come up into Python, and a
# byte waits for no selector (benchmarks/README.md has the figures). Over
# TLS, or without splice, one thread serves the forward's connections
# through a selector. The forward's thread accepts in both cases. The key
# goes into the upgrade's header only, to the API origin.


_TUNNEL_PIECE = 256 * 1024  # most bytes read at once, and held, per direction
_TUNNEL_HEAD_LIMIT = 64 * 1024  # longest head of an answer to an upgrade
_TUNNEL_TURNS = 16  # pieces one direction moves before the others get their turn
# Bytes moved in the kernel, socket to pipe to socket (Linux, Python 3.10 and later).
_SPLICE: Optional[Callable[[int, int, int], int]] = getattr(os, "splice", None)
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9])(?: [\t !-~\x80-\xff]*)?\Z")
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[\t ]*([\t !-~\x80-\xff]*?)[\t ]*\Z")
# What a refused tunnel means, by status, where the module's advice does not fit.
_TUNNEL_ADVICE = {
    404: "no sandbox with this id here, or a service without tunnels",
    502: "nothing listens on that port in the sandbox; start the server there first, on "
    "127.0.0.1 or 0.0.0.0, and wait until it listens",
}
_TUNNEL_BROKE = "a connection's tunnel broke, and the connection was closed"  # its warning


class Forward:
    """A port on this machine that leads to `port` in the sandbox (Client.forward()).

    Every connection accepted at `address` ("host:port"; `url` is its
    http:// URL) gets a tunnel of its own; both directions are copied until
    both have ended, an end passed on as a half-close. A connection whose
    tunnel cannot be opened, or breaks, is closed alone, counted in
    `failures` and logged at WARNING. close() (or leaving the `with` block)
    stops listening and closes every connection.
    """

    def __init__(
        self, sandbox_id: str, port: int, listener: socket.socket, tunnels: _Tunnels
    ) -> None:
        self.sandbox_id = sandbox_id
        self.port = port
        host, self.local_port = listener.getsockname()[:2]
        self.address = f"[{host}]:{self.local_port}" if ":" in host else f"{host}:{self.local_port}"
        self.url = f"http://{self.address}/"
        self._bridge = _Bridge(listener, tunnels)
        self._owner: Optional[Client] = None  # cx.forward()'s own client, closed with it

    @property
    def failures(self) -> int:
        """Connections closed because their tunnel could not be opened or broke."""
        return self._bridge.failures

    def close(self) -> None:
        """Stop listening and close every connection (at once, as ssh -L does on exit)."""
        self._bridge.stop()
        if self._owner is not None:
            self._owner.close()

    def __enter__(self) -> "Forward":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Forward(address={self.address!r}, sandbox_id={self.sandbox_id!r}, "
            f"port={self.port!r}, failures={self.failures!r})"
        )


def _forward(
    transport: _Transport,
    sandbox_id: str,
    port: int,
    local_port: int,
    bind: str,
    *,
    check: bool = True,
) -> Forward:
    """Listen at `bind`:`local_port`, then (`check`) open one tunnel and close it,
    so that a port nothing listens on or a sandbox that does not run is an error
    now, not at the first connection."""
    tunnels = _Tunnels(_Sandbox(transport, sandbox_id), _tunnel_port("port", port, 1))
    listener = _listener(bind, _tunnel_port("local_port", local_port, 0))
    try:
        if check:
            tunnels.check()
        return Forward(sandbox_id, port, listener, tunnels)
    except BaseException:
        listener.close()
        raise


def _tunnel_port(name: str, value: Any, lowest: int) -> int:
    if not _is_int(value) or not lowest <= value <= 65535:
        raise ConfigError(
            f"{name} must be a port number from {lowest} to 65535, not {_shown(value)}."
        )
    return int(value)


def _listener(bind: Any, port: int) -> socket.socket:
    """The listening socket; a ConfigError when the address cannot be had."""
    if not isinstance(bind, str) or not _HOST.match(bind.strip("[]")):
        raise ConfigError(f"bind must be a host name or an IP address, not {_shown(bind)}.")
    host = bind.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as error:
        why = os.strerror(error.errno) if error.errno else "it cannot be had"
        raise ConfigError(f"Cannot listen on {bind}:{port} here: {why}.") from None


class _Tunnels:
    """The tunnels to one port of one sandbox, each opened by an upgrade request of
    its own, paced as every request is, its timeouts the client's request_timeout."""

    def __init__(self, sandbox: _Sandbox, port: int) -> None:
        self.sandbox = sandbox
        self.port = port
        self.operation = f"{_TUNNEL_TO}{port}"
        transport = sandbox.transport
        key, self._limiter, tls = transport.for_a_tunnel()
        origin = urllib.parse.urlsplit(transport.base)
        self.https = origin.scheme == "https"
        self._host = origin.hostname or ""
        self._origin_port = origin.port or (443 if self.https else 80)
        self._address = _address(transport.base)
        self._timeout = transport.request_timeout
        self._tls = _tls_context(tls.get("verify", True), tls.get("cert")) if self.https else None
        self._request = (
            f"POST {origin.path}{sandbox.path}/tunnel/{port} HTTP/1.1\r\n"
            f"Host: {origin.netloc}\r\nX-Api-Key: {key}\r\nConnection: Upgrade\r\n"
            "Upgrade: tcp-tunnel\r\nContent-Length: 0\r\n\r\n"
        ).encode("ascii")

    def check(self) -> None:
        """One tunnel opened and closed, under the retry policy; what refused it, raised."""
        transport = self.sandbox.transport
        try:
            transport.retried(lambda now: self.open(now)[0].close(), _ENDLESS)
        except APIError as refused:
            raise self._refused(refused) from None

    def open(self, deadline: _Deadline = _ENDLESS) -> Tuple[socket.socket, bytes]:
        """One tunnel: its socket, and the first bytes of the pipe (read with the head).

        _Retryable for what is worth another attempt (transport trouble, 408,
        429, a 5xx other than 502), APIError for any other refusal,
        ProtocolError for an answer that is not HTTP/1.1 as it should be."""
        place = None
        if self._limiter is not None:
            place = self._limiter.acquire(3 * self._timeout, deadline)
            if place is None:
                raise _Retryable(self.operation, maybe_sent=False, address=self._address)
        status: Optional[int] = None
        try:
            sock = self._connect(deadline)
            try:
                sock.sendall(self._request)
                status, headers, early = self._answer(sock)
            except BaseException:
                sock.close()
                raise
        except ssl.SSLError:
            raise TransportError(self.operation, address=self._address, reason="tls") from None
        except OSError as error:
            raise _transport_failure(error, self.operation, self.sandbox.transport.base) from None
        finally:
            if place is not None and self._limiter is not None:
                self._limiter.release(place, status)
        if status == 101:
            sock.settimeout(None)
            return sock, early
        sock.close()
        if status in (408, 429) or (status >= 500 and status != 502):
            retry_after = _retry_after(headers.get("retry-after"))
            raise _Retryable(self.operation, status=status, retry_after=retry_after)
        raise APIError(status, self.operation)

    def _connect(self, deadline: _Deadline) -> socket.socket:
        timeout = deadline.within(self._timeout)
        raw = socket.create_connection((self._host, self._origin_port), timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is None:
            return raw
        try:
            return self._tls.wrap_socket(raw, server_hostname=self._host)
        except BaseException:
            raw.close()
            raise

    def _answer(self, sock: socket.socket) -> Tuple[int, Dict[str, str], bytes]:
        """The status and headers of the answer, and what came after its head."""
        data = bytearray()
        while True:
            end = data.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(data) > _TUNNEL_HEAD_LIMIT:
                raise ProtocolError("the head of the answer to a tunnel is too long")
            piece = sock.recv(_TUNNEL_PIECE)
            if not piece:
                raise ConnectionResetError("the connection closed before the answer's head")
            data += piece
        status_line, *lines = bytes(data[:end]).split(b"\r\n")
        status = _STATUS_LINE.match(status_line)
        fields = [_HEADER_LINE.match(line) for line in lines]
        if status is None or not all(fields):
            raise ProtocolError("the answer to a tunnel is not an HTTP/1.1 head")
        headers = {f.group(1).decode().lower(): f.group(2).decode("latin-1") for f in fields if f}
        return int(status.group(1)), headers, bytes(data[end + 4 :])

    def _refused(self, refused: APIError) -> CreateOSError:
        """The entry's refusal in words that name the sandbox and the port, and
        for a 404 or 409 what the sandbox's view says of it."""
        status = refused.status
        advice = _TUNNEL_ADVICE.get(status) or _advice(status, self.operation)
        refused.args = (
            f"CreateOS refused a tunnel to port {self.port} of the sandbox "
            f"{self.sandbox.sandbox_id} (HTTP {status})" + (f": {advice}." if advice else "."),
        )
        return self.sandbox.diagnosed(refused) if status in (404, 409) else refused


def _tls_context(verify: Any, cert: Any) -> ssl.SSLContext:
    """TLS as the session would make it for the API (its CA bundle, REQUESTS_CA_BUNDLE,
    verify=False, a client certificate), ALPN http/1.1: HTTP/2 carries no Upgrade."""
    context = ssl.create_default_context()
    if verify is False:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        bundle = requests.utils.DEFAULT_CA_BUNDLE_PATH if verify is True else verify
        if os.path.isdir(bundle):
            context.load_verify_locations(capath=bundle)
        else:
            context.load_verify_locations(cafile=bundle)
    if cert:
        context.load_cert_chain(*((cert,) if isinstance(cert, str) else cert))
    context.set_alpn_protocols(["http/1.1"])
    return context


# A socket that would block (TLS: one that needs the other way first): wait for the selector.
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class _Broken(Exception):
    """A connection's socket failed: `sock` is the one."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock


class _Spliced:
    """A connection over a plain tunnel, moved by os.splice: each direction a thread
    blocked in splice() through a pipe of one piece (a full pipe waits for its
    sink: back-pressure passed on), its end passed on as a half-close. A socket
    that fails, or cut(), ends both directions at once."""

    def __init__(
        self,
        local: socket.socket,
        remote: socket.socket,
        early: bytes,
        splice: Callable[[int, int, int], int],
    ) -> None:
        self.local = local
        self.remote = remote
        self.done = threading.Event()  # set once both sockets are closed
        self._early = early
        self._splice = splice
        self._lock = threading.Lock()  # no shutdown() races a close() of the same socket
        self._over = False
        self._broken: Optional[socket.socket] = None

    def run(self) -> Optional[socket.socket]:
        """Both directions to their ends, the outgoing one on a thread of its own,
        then both sockets closed: the socket that failed, if one did before any cut()."""
        try:
            for sock in (self.local, self.remote):
                sock.settimeout(None)  # blocking, whatever socket.setdefaulttimeout() says
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            outgoing = threading.Thread(
                target=self._one_way, args=(self.local, self.remote), daemon=True
            )
            outgoing.start()
            self._one_way(self.remote, self.local, self._early)
            outgoing.join()
        finally:
            with self._lock:
                self._over = True
                self.local.close()
                self.remote.close()
            self.done.set()
        return self._broken

    def cut(self, broken: Optional[socket.socket] = None) -> None:
        """End both directions now: a shutdown wakes a splice() that waits. The first
        cut says why (`broken`, or none: the forward was closed)."""
        with self._lock:
            if self._over:
                return
            self._over = True
            self._broken = broken
            for sock in (self.local, self.remote):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _one_way(self, source: socket.socket, sink: socket.socket, first: bytes = b"") -> None:
        """`first`, then `source` to `sink` through a pipe, a piece at a time, until
        `source` ends; then that end passed on. A socket that fails cuts both ways."""
        pipe: Tuple[int, ...] = ()
        failing: Optional[socket.socket] = None  # the socket the call under way would fail on
        try:
            read_end, write_end = pipe = os.pipe()  # none (out of descriptors): closed, uncounted
            with contextlib.suppress(OSError):  # else the system's 64 KiB: smaller still
                fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, _TUNNEL_PIECE)  # novermin: with splice
            failing = sink
            sink.sendall(first)
            while True:
                failing = source
                count = self._splice(source.fileno(), write_end, _TUNNEL_PIECE)
                failing = sink
                if not count:
                    break
                while count:
                    count -= self._splice(read_end, sink.fileno(), count)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            self.cut(failing)
        finally:
            for end in pipe:
                os.close(end)


class _Flow:
    """One direction of a connection: the piece read from `source` and not yet
    all written to `sink`, whether `source` has ended, and whether that end was
    passed on to `sink`."""

    __slots__ = ("source", "sink", "buffer", "pending", "ended", "shut")

    def __init__(self, source: socket.socket, sink: socket.socket, early: bytes = b"") -> None:
        self.source = source
        self.sink = sink
        self.buffer = bytearray(_TUNNEL_PIECE)
        self.pending = memoryview(early)
        self.ended = False
        self.shut = False

    def move(self) -> bool:
        """Write what is pending, read the next piece, and so on until a side would
        block, _TUNNEL_TURNS pieces at most: True when it stopped at that count.
        _Broken when a socket fails."""
        for _ in range(_TUNNEL_TURNS):
            if not self._written():
                return False
            if self.ended:
                self._shut_sink()
                return False
            try:
                count = self.source.recv_into(self.buffer)
            except _WOULD_BLOCK:
                return False
            except OSError as error:
                raise _Broken(self.source) from error
            self.ended = not count
            self.pending = memoryview(self.buffer)[:count]
            if 0 < count < len(self.buffer) and not self._buffered():
                self._written()  # the source is drained: the selector says when more comes
                return False
        return True

    def _buffered(self) -> bool:
        """TLS: bytes read and decrypted already, which no selector sees."""
        return isinstance(self.source, ssl.SSLSocket) and self.source.pending() > 0

    def _written(self) -> bool:
        while self.pending:
            try:
                self.pending = self.pending[self.sink.send(self.pending) :]
            except _WOULD_BLOCK:
                return False
            except OSError as error:
                raise _Broken(self.sink) from error
        return True

    def _shut_sink(self) -> None:
        """The half-close: a FIN. Not over TLS: its ssl module has no close_notify
        that leaves the connection readable (unwrap() does not, shutdown() drops
        TLS at once, and a bare FIN breaks the tunnel), so a tunnel over TLS stays
        open that way until the sandbox's side ends too."""
        if self.shut:
            return
        self.shut = True
        if isinstance(self.sink, ssl.SSLSocket):
            return
        try:
            self.sink.shutdown(socket.SHUT_WR)
        except OSError as error:
            raise _Broken(self.sink) from error


class _Bridge:
    """A forward's thread: it accepts connections, and each one's tunnel is opened on
    a thread of its own (the service is awaited there), which then splices the
    connection (_Spliced) or hands it to this thread's selector, which copies
    both directions of every connection it is given."""

    def __init__(self, listener: socket.socket, tunnels: _Tunnels) -> None:
        self.failures = 0
        self._listener = listener
        self._tunnels = tunnels
        self._splice = None if tunnels.https else _SPLICE
        self._spliced: Set[_Spliced] = set()
        self._selector = selectors.DefaultSelector()
        self._wake, self._woken = socket.socketpair()
        self._opened: Deque[Tuple[socket.socket, socket.socket, bytes]] = collections.deque()
        self._flows: Dict[socket.socket, List[_Flow]] = {}  # socket -> the flows it is in
        self._lock = threading.Lock()
        self._stopped = False
        listener.setblocking(False)
        self._woken.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._woken, selectors.EVENT_READ)
        name = f"createos_exec forward {tunnels.sandbox.sandbox_id}:{tunnels.port}"
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            spliced = list(self._spliced)
        for connection in spliced:
            connection.cut()
        self._nudge()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        for connection in spliced:
            connection.done.wait()

    def _nudge(self) -> None:
        with contextlib.suppress(OSError):  # closed: the thread is gone, and knows
            self._wake.send(b"\0")

    def _serve(self) -> None:
        again: List[_Flow] = []  # flows that stopped at their turns, not at a block
        try:
            while not self._stopped:
                ready = self._selector.select(0 if again else None)
                flows, again = again, []
                for key, events in ready:
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._woken:
                        self._take_opened()
                    else:
                        flows.extend(self._flows_of(key.fileobj, events))  # type: ignore[arg-type]
                again = [flow for flow in dict.fromkeys(flows) if self._moved(flow)]
        finally:
            self._close_all()

    def _flows_of(self, sock: socket.socket, events: int) -> List[_Flow]:
        """The flows that `sock` being readable or writable (`events`) moves on."""
        return [
            flow
            for flow in self._flows.get(sock, ())
            if (flow.source is sock and events & selectors.EVENT_READ)
            or (flow.sink is sock and events & selectors.EVENT_WRITE)
        ]

    def _accept(self) -> None:
        while True:
            try:
                local, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: the connection waits in the backlog
                logger.warning("The forward to %s could not accept a connection", self._named())
                return
            threading.Thread(target=self._open, args=(local,), daemon=True).start()

    def _open(self, local: socket.socket) -> None:
        """The tunnel of one local connection (the connection closed if there is none),
        then the connection spliced on this thread, or handed to the selector's."""
        try:
            remote, early = self._tunnels.open()
        except (CreateOSError, _Retryable) as error:
            failure = error.final(None) if isinstance(error, _Retryable) else error
            self._failed(f"a connection was closed: {failure}")
            local.close()
            return
        spliced = None if self._splice is None else _Spliced(local, remote, early, self._splice)
        with self._lock:
            if self._stopped:
                local.close()
                remote.close()
                return
            if spliced is None:
                self._opened.append((local, remote, early))
                self._nudge()
                return
            self._spliced.add(spliced)
        if spliced.run() is remote:
            self._failed(_TUNNEL_BROKE)
        with self._lock:
            self._spliced.discard(spliced)

    def _take_opened(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._woken.recv(4096):
                pass
        while self._opened:
            local, remote, early = self._opened.popleft()
            for sock in (local, remote):
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            outgoing, incoming = _Flow(local, remote), _Flow(remote, local, early)
            self._flows[local] = self._flows[remote] = [outgoing, incoming]
            for sock in (local, remote):
                self._selector.register(sock, selectors.EVENT_READ)
            for flow in (outgoing, incoming):
                self._moved(flow)

    def _moved(self, flow: _Flow) -> bool:
        """Move `flow` on, then watch its sockets for what it waits for now; a failed
        socket closes its connection (a failure when it is the tunnel's). True
        when it has more to move at once."""
        pair = self._flows.get(flow.source)
        if pair is None:  # its connection was closed meanwhile
            return False
        try:
            more = flow.move()
        except _Broken as broken:
            self._close(pair)
            if broken.sock is pair[0].sink:
                self._failed(_TUNNEL_BROKE)
            return False
        if all(each.shut for each in pair):
            self._close(pair)
            return False
        for sock in (flow.source, flow.sink):
            self._watch(sock, pair)
        return more

    def _watch(self, sock: socket.socket, pair: List[_Flow]) -> None:
        """Wait to read from `sock` while its direction has room, to write while the
        other direction has a piece for it."""
        events = 0
        for flow in pair:
            if flow.source is sock and not flow.pending and not flow.ended:
                events |= selectors.EVENT_READ
            if flow.sink is sock and flow.pending:
                events |= selectors.EVENT_WRITE
        key = self._selector.get_map().get(sock)
        if key is not None and events == 0:
            self._selector.unregister(sock)
        elif key is None and events:
            self._selector.register(sock, events)
        elif key is not None and key.events != events:
            self._selector.modify(sock, events)

    def _close(self, pair: List[_Flow]) -> None:
        for sock in (pair[0].source, pair[0].sink):
            self._flows.pop(sock, None)
            if sock in self._selector.get_map():
                self._selector.unregister(sock)
            sock.close()

    def _failed(self, what: str) -> None:
        with self._lock:
            self.failures += 1
        logger.warning("The forward to %s: %s", self._named(), what)

    def _named(self) -> str:
        return f"port {self._tunnels.port} of the sandbox {self._tunnels.sandbox.sandbox_id}"

    def _close_all(self) -> None:
        with self._lock:
            self._stopped = True
            opened = list(self._opened)
            self._opened.clear()
        for local, remote, _ in opened:
            local.close()
            remote.close()
        for sock in list(self._flows):
            sock.close()
        self._flows.clear()
        self._selector.close()
        for sock in (self._listener, self._wake, self._woken):
            sock.close()


# ==========================================================================
# 15. The command line, and its terminal sessions (-t)
# ==========================================================================
#
# createos-exec: its messages speak to a shell user (the variable to set, the
# program typed, never a Python keyword); main() is the one place that prints
# or exits, and it comes last. A -t session (_Session) makes this terminal
# the remote one; whatever ends it, the terminal's settings come back first.
#
# At some 880 lines it is one section on purpose: the command line is one
# program (its options, transfers, forwards and sessions share main()'s one
# way of printing, exiting and saying an error), read in one place.


_EXAMPLES = """\
examples:
  {prog} sb_123 -- uname -a
  {prog} --timeout 600 --env CI=1 sb_123 -- make test
  {prog} --shell sb_123 -- 'cd /app && ls | wc -l'
  echo hello | {prog} sb_123 -- cat   # a pipe or a file on stdin is forwarded as it comes
  {prog} -n sb_123 -- make            # EOF on the command's stdin at once
  {prog} -t sb_123 -- bash            # a terminal session; Ctrl-] detaches
  {prog} -t --attach proc_42 sb_123   # its screen rebuilt, the session taken up again
  {prog} --json sb_123 -- ls /    # one JSON object, for scripts
  {prog} --put src.tar:/app/src.tar --get /app/report.html:report.html \
      sb_123 -- bash -c 'cd /app && tar xf src.tar && make report'
  {prog} --get /var/log/app.log:app.log sb_123     # transfers only
  {prog} --put src/:/app/src --get /app/out:out sb_123 -- make -C /app   # directories
  {prog} --get /app/report.csv:- sb_123 | head     # a file to stdout
  {prog} --forward 8080:8000 sb_123   # localhost:8080 here is port 8000 there, until Ctrl-C

Files: each --put is written before the command, each --get fetched after it
ends, whatever its exit status; a file arrives whole or not at all, a directory
as a whole tree that replaces the one there. On a terminal, a progress bar.

Each ARG reaches the program as it is; with --shell, COMMAND is one bash script.

exit status: the remote exit code; 128+N when killed by signal N; 124 on
timeout; 130 after Ctrl-C (the remote tree is terminated first); 125 for
errors of this tool, the API or the connection; 2 for a usage error.
The API key is read from $CREATEOS_API_KEY (or $CREATEOS_SANDBOX_API_KEY).
"""


def _parser() -> argparse.ArgumentParser:
    # The console script of an installed package, or the module (a vendored copy has no script).
    called = os.path.basename(sys.argv[0]) if sys.argv else ""
    prog = "createos-exec" if called.startswith("createos-exec") else "python -m createos_exec"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run one command in a CreateOS sandbox, streaming its output.",
        epilog=_EXAMPLES.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--api-url", help="default: $CREATEOS_API_URL or " + DEFAULT_API_URL)
    parser.add_argument("--cwd", help="working directory of the command")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="extra environment variable (repeatable)",
    )
    parser.add_argument(
        "--timeout",
        type=_timeout_option,
        metavar="S",
        help="seconds the command may run; then its remote tree is terminated (exit status 124)",
    )
    parser.add_argument("--shell", action="store_true", help="COMMAND is one bash script string")
    stdin = parser.add_mutually_exclusive_group()
    stdin.add_argument(
        "--stdin",
        metavar="FILE|-",
        help="feed FILE to the command's stdin (-: this tool's stdin, read to its end first); "
        "without it, a stdin that is not a terminal is forwarded as it comes",
    )
    stdin.add_argument(
        "-n", "--no-stdin", action="store_true", help="the command's stdin ends at once (EOF)"
    )
    stdin.add_argument(
        "-i",
        "--interactive",
        action="store_true",
        help="forward this terminal's lines to the command as typed (Ctrl-D: EOF)",
    )
    parser.add_argument(
        "-t",
        "--tty",
        action="store_true",
        help="a terminal session: this terminal's keys, size and TERM go to a remote "
        "terminal; the session survives a dropped connection; Ctrl-] detaches",
    )
    parser.add_argument(
        "--attach",
        metavar="PROCESS_ID",
        help="instead of -- COMMAND: follow a process that runs already "
        "(with -t: its screen rebuilt from the output kept)",
    )
    parser.add_argument(
        "--after",
        type=_after_option,
        default=0,
        metavar="N",
        help="with --attach: the output after its N-th frame (default 0: all that is kept)",
    )
    parser.add_argument(
        "--put",
        action="append",
        default=[],
        type=_transfer_option("--put", remote_first=False),
        metavar="LOCAL:REMOTE",
        help="copy a local file or directory to an absolute path in the sandbox before the "
        "command (repeatable; REMOTE ending in / or naming a directory: a file goes in it)",
    )
    parser.add_argument(
        "--get",
        action="append",
        default=[],
        type=_transfer_option("--get", remote_first=True),
        metavar="REMOTE:LOCAL",
        help="copy a file or directory of the sandbox here once the command has ended, "
        "whatever its exit status (repeatable; LOCAL - is stdout)",
    )
    parser.add_argument(
        "--forward",
        action="append",
        default=[],
        type=_forward_option,
        metavar="[BIND:]LOCAL:REMOTE",
        help="listen at BIND:LOCAL here (BIND 127.0.0.1 unless given; LOCAL 0: a free port) and "
        "lead each connection to port REMOTE in the sandbox, as ssh -L does (repeatable); "
        "until Ctrl-C, or with a command for as long as it runs",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="resume the sandbox when it is found paused (before or during the run) and go on",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="no live output; print the result (or the error) as one JSON object",
    )
    parser.add_argument("sandbox_id", metavar="SANDBOX_ID")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG...]")
    return parser


class _Transfer(NamedTuple):
    """One --put or --get: the option, the option as typed, and its two paths."""

    option: str
    typed: str
    local: str
    remote: str


def _transfer_option(option: str, remote_first: bool) -> Callable[[str], _Transfer]:
    """The type of --put (LOCAL:REMOTE) or --get (REMOTE:LOCAL): split at the first colon."""

    def transfer(text: str) -> _Transfer:
        first, colon, second = text.partition(":")
        remote, local = (first, second) if remote_first else (second, first)
        if not colon or not local or not remote.startswith("/"):
            shape = "REMOTE:LOCAL" if remote_first else "LOCAL:REMOTE"
            raise argparse.ArgumentTypeError(
                f"expected {shape}, REMOTE an absolute path in the sandbox, not {_shown(text)}"
            )
        return _Transfer(option, f"{option} {text}", local, remote)

    return transfer


class _ForwardSpec(NamedTuple):
    """One --forward: where to listen, and the port in the sandbox."""

    bind: str
    local: int
    remote: int


_FORWARD_SPEC = re.compile(r"(?:(\[[0-9A-Fa-f:.]+\]|[^:\[\]]+):)?([0-9]{1,5}):([0-9]{1,5})\Z")


def _forward_option(text: str) -> _ForwardSpec:
    """--forward [BIND:]LOCAL:REMOTE: ssh -L's without its host (the sandbox is the
    host); BIND an address ([::1] bracketed, * for every interface)."""
    match = _FORWARD_SPEC.match(text)
    local, remote = (int(match.group(2)), int(match.group(3))) if match else (-1, 0)
    if match is None or local > 65535 or not 0 < remote <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected [BIND:]LOCAL:REMOTE, ports from 1 to 65535 (LOCAL 0: a free one), "
            f"as in 8080:80 or 127.0.0.1:8080:80, not {_shown(text)}"
        )
    bind = (match.group(1) or "127.0.0.1").strip("[]")
    return _ForwardSpec("0.0.0.0" if bind == "*" else bind, local, remote)


def _forwarding(
    client: Client, options: argparse.Namespace, serving: bool, say: Callable[[str], None]
) -> contextlib.ExitStack:
    """Every --forward open (checked at once when `serving`: no command starts the
    server), each saying where it listens; closed with the stack returned."""
    with contextlib.ExitStack() as opening:
        for spec in options.forward:
            transport, sandbox_id = client._transport, options.sandbox_id
            fw = opening.enter_context(
                _forward(transport, sandbox_id, spec.remote, spec.local, spec.bind, check=serving)
            )
            until = "Ctrl-C stops" if serving else "while the command runs"
            say(f"forwarding {fw.address} to port {fw.port} of the sandbox {sandbox_id} ({until})")
        return opening.pop_all()


def _after_option(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a frame number >= 0, not {_shown(text)}")
    return int(text)


def _timeout_option(text: str) -> float:
    """--timeout's value; argparse names the option in its usage error."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0:  # NaN too
        raise argparse.ArgumentTypeError(
            f"expected a positive number of seconds, not {_shown(text)}"
        )
    return seconds


def _command_and_env(
    parser: argparse.ArgumentParser, options: argparse.Namespace
) -> Tuple[Optional[Command], Optional[Dict[str, str]]]:
    """The command (None: --attach, or transfers only) and its env."""
    command: List[str] = options.command
    _check_terminal_options(parser, options)
    if options.attach is not None and command:
        parser.error("give --attach PROCESS_ID or -- COMMAND, not both")
    if options.after and options.attach is None:
        parser.error("--after goes with --attach PROCESS_ID")
    if options.json and any(transfer.local == "-" for transfer in options.get):
        parser.error("--get REMOTE:- writes to stdout, where --json writes its object: give one")
    wanted = options.put or options.get or options.forward or options.attach is not None
    if not command and wanted:
        return None, None
    if not command:
        parser.error("no command given: put it after --, as in: SANDBOX_ID -- uname -a")
    if options.shell and len(command) != 1:
        parser.error("with --shell, give the script as one quoted argument: -- 'cd /app && ls'")
    env = {}
    for item in options.env:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error("argument --env: expected K=V, as in --env CI=1")
        if not _ENV_NAME.match(name):
            parser.error(
                f"argument --env: invalid name {_shown(name)}: "
                "names must match [A-Za-z_][A-Za-z0-9_]*"
            )
        env[name] = value
    return (command[0] if options.shell else command), (env or None)


def _check_terminal_options(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    """-t takes this terminal over: it needs one, and no other use of stdin or stdout."""
    if not options.tty:
        return
    if options.stdin is not None or options.no_stdin or options.json:
        parser.error("-t takes no --stdin, -n or --json: the session is this terminal")
    fd = _stdin_fd()
    if fd is None or not os.isatty(fd):
        parser.error("-t needs a terminal on stdin; without one, leave -t out")


def _stdin_fd() -> Optional[int]:
    """This tool's stdin; None when closed, or no real file (in tests)."""
    try:
        return sys.stdin.fileno()
    except (AttributeError, ValueError, OSError):
        return None


def _read_stdin_option(name: Optional[str]) -> Optional[bytes]:
    if name is None:
        return None
    if name == "-":
        return sys.stdin.buffer.read()
    with open(name, "rb") as handle:
        return handle.read()


def _forwarded_stdin(interactive: bool) -> Optional[int]:
    """This tool's stdin, to forward as it comes: a pipe or a file, as ssh does,
    or with -i a terminal's lines; None for a terminal without -i (EOF at once)
    or no stdin."""
    fd = _stdin_fd()
    return None if fd is None or (os.isatty(fd) and not interactive) else fd


def _forward_stdin(fd: int, process: RemoteProcess, failures: List[CreateOSError]) -> None:
    """Each piece of `fd` as it comes, through write(); its end closes the command's
    stdin. A command that ended or closed its stdin ends the forwarding, as a
    pipe's reader going away does, and so does its deadline. Any other failure
    is kept in `failures`: nothing more is sent, and the command gets EOF."""
    for step in (functools.partial(_write_pieces, fd, process.write), process.close_stdin):
        try:
            step()
        except (StdinClosedError, WaitTimeout):
            return
        except CreateOSError as failure:
            failures.append(failure)


def _write_pieces(
    fd: int, write: Callable[[bytes], None], more: Callable[[], bool] = lambda: True
) -> None:
    """Each piece as it comes: what arrives while one is written goes in the next.
    `more` waits for something to read: False, read nothing more."""
    while more():
        try:
            piece = os.read(fd, _INPUT_PIECE)
        except OSError:
            return  # unreadable from here on: as its end
        if not piece:
            return
        write(piece)


def _unreadable_stdin(name: str, error: OSError) -> str:
    why = error.strerror or "it could not be read"
    if name == "-":
        return f"cannot read this tool's stdin for --stdin -: {why}."
    return f"cannot read the --stdin file {name}: {why}."


# The command line has no api_key=: only the variables can give it a key.
_NO_KEY_HERE = "no API key: set CREATEOS_API_KEY (or CREATEOS_SANDBOX_API_KEY) in the environment."


def _run_command(
    client: Client,
    options: argparse.Namespace,
    command: Optional[Command],
    env: Optional[Dict[str, str]],
    stdin: Union[bytes, int, None],
    started: List[RemoteProcess],
    failures: List[CreateOSError],
) -> ExecResult:
    """Run the command, or follow the --attach process, with -t as a terminal
    session; `started` gets its process once there is one (Ctrl-C names it).
    `stdin`: its data, or a descriptor forwarded as it comes (`failures` gets
    what stopped the forwarding)."""
    output: Dict[str, Any] = {"timeout": options.timeout, "resume": options.resume}
    session = _Session(sys.stdin.fileno()) if options.tty else None
    if session is not None:  # the terminal's bytes, decoded by nothing
        output.update(on_output=session.show, text=False)
        if "TERM" in os.environ:
            env = {"TERM": os.environ["TERM"], **(env or {})}
    else:  # live output passes through byte-exact; JSON needs valid text
        on_output = None if options.json else _print_live
        output.update(on_output=on_output, errors="replace" if options.json else "surrogateescape")
    if command is None:
        process = client.process(options.sandbox_id, options.attach, after=options.after, **output)
    else:
        process = client.start(
            options.sandbox_id,
            command,
            shell=options.shell,
            cwd=options.cwd,
            env=env,
            stdin=PIPE if isinstance(stdin, int) else stdin,
            pty=None if session is None else session.size(),
            **output,
        )
    started.append(process)
    if session is not None:
        return session.run(process, rebuild=command is None)
    if isinstance(stdin, int):
        forwarding = (stdin, process, failures)
        threading.Thread(target=_forward_stdin, args=forwarding, daemon=True).start()
    return process.wait()


class _Detached(Exception):
    """Ctrl-] ended the session: the process runs on, nothing was sent to it."""


class _SignalledAway(Exception):
    """SIGTERM or SIGHUP ended the session (the remote tree is terminated)."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.number = number


_DETACH_KEY = b"\x1d"  # Ctrl-], as telnet's escape
_RESET_TERMINAL = b"\x1bc"


class _Session:
    """-t: this terminal, raw, becomes the remote one. Its keys are typed as they
    come (each write() one /input, keys typed meanwhile together in the next),
    its size follows SIGWINCH, the output is shown byte for byte; the follower
    reconnects by itself (a notice meanwhile). However the session ends, the
    terminal's own settings come back exactly, before anything is said, and
    no key is read once it has ended: what is typed then (while a --get
    runs) stays in the terminal for whatever reads it next, the shell."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._status = _StatusLine()
        self._done = threading.Event()
        self._outcome: List[Union[ExecResult, BaseException]] = []
        self._detached = False
        self._sent_size: Optional[Tuple[int, int]] = None  # the size the program was told

    def size(self) -> Tuple[int, int]:
        """(rows, cols) of this terminal; pty=True's when it tells none."""
        columns, lines = os.get_terminal_size(self._fd)
        return (lines, columns) if lines and columns else _TERMINAL

    def show(self, stream: str, data: bytes) -> None:
        self._status.clear()
        echo("stdout", data)

    def run(self, process: RemoteProcess, rebuild: bool) -> ExecResult:
        """The session to its end: the process's result, or _Detached."""
        if not process._terminal:
            raise ConfigError(f"process {process.process_id} has no terminal: attach without -t.")
        process._follower.on_reconnect = self._reconnecting
        process._follower.on_gap = self._drawn_anew
        if rebuild:  # the replay draws the screen again from a blank one
            echo("stdout", _RESET_TERMINAL)
        try:
            # SIGWINCH's handler tells the typing thread through this pair.
            self._winched, self._winch = socket.socketpair()
            with _raw_terminal(self._fd), self._signals(), self._winched, self._winch:
                self._resized(process)
                stop_typing, typing_stopped = socket.socketpair()
                threading.Thread(target=self._follow, args=(process,), daemon=True).start()
                threading.Thread(
                    target=self._type, args=(process, typing_stopped), daemon=True
                ).start()
                try:
                    self._done.wait()
                finally:
                    stop_typing.close()  # its peer reads the end: no key is read from now on
                    self._status.clear()
        except BaseException:
            process.terminate()  # the terminal is restored: an ending like Ctrl-C's
            raise
        if self._detached:
            raise _Detached
        outcome = self._outcome[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """SIGWINCH wakes the typing thread, which sends the new size; SIGTERM and
        SIGHUP end the session."""

        def away(number: int, frame: Any) -> None:
            raise _SignalledAway(number)

        def winched(number: int, frame: Any) -> None:
            with contextlib.suppress(OSError):  # full: a wake-up is on its way already
                self._winch.send(b"\0")

        self._winch.setblocking(False)
        handlers = {_signal.SIGWINCH: winched, _signal.SIGTERM: away, _signal.SIGHUP: away}
        before = {number: _signal.signal(number, handler) for number, handler in handlers.items()}
        try:
            yield
        finally:
            for number, handler in before.items():
                _signal.signal(number, handler)

    def _resized(self, process: RemoteProcess) -> None:
        """The terminal's size, sent when it is not the one the program was told."""
        size = self.size()
        if size == self._sent_size:
            return
        try:
            process.resize(*size)
            self._sent_size = size
        except CreateOSError as failure:
            self._status.show(f"the new size was not sent: {failure}")

    def _follow(self, process: RemoteProcess) -> None:
        try:
            self._outcome.append(process.wait())
        except BaseException as error:  # raised in the main thread, the terminal restored
            self._outcome.append(error)
        self._done.set()

    def _type(self, process: RemoteProcess, stopped: socket.socket) -> None:
        """Keys and new sizes, in the order they came: the size is looked at before
        each piece of keys is sent, so that keys typed after a resize reach the
        program after it (the kernel knows the size before SIGWINCH is handled)."""

        def typed(keys: bytes) -> None:
            self._resized(process)
            before, detach, _ = keys.partition(_DETACH_KEY)
            try:
                if before:
                    process.write(before)
            except InputUnconfirmedError:
                self._status.show("keys may not have arrived (not sent again); check the screen")
            if detach:
                raise _Detached

        def keys_come() -> bool:
            """Wait for keys (False: the session has ended), sending new sizes meanwhile."""
            while True:
                ready = {key.fileobj for key, _ in waiting.select()}
                if stopped in ready:  # a key is read only while the session runs
                    return False
                if self._winched in ready:
                    with contextlib.suppress(BlockingIOError):
                        self._winched.recv(4096)
                    self._resized(process)
                if self._fd in ready:
                    return True

        self._winched.setblocking(False)
        try:
            with selectors.DefaultSelector() as waiting, stopped:
                for source in (self._fd, stopped, self._winched):
                    waiting.register(source, selectors.EVENT_READ)
                _write_pieces(self._fd, typed, keys_come)
        except _Detached:
            self._detached = True
            self._done.set()
        except CreateOSError:
            return  # the program ended (its end is being read) or cannot be reached

    def _drawn_anew(self) -> None:
        """Output the service no longer kept was lost while this session was away:
        the screen is drawn anew from a blank one, with what it kept."""
        echo("stdout", _RESET_TERMINAL)
        self._status.show("output was lost while away; the screen shows what CreateOS kept")

    def _reconnecting(self, under_way: bool) -> None:
        if under_way:
            self._status.show("connection lost; reconnecting (nothing is lost)")
        else:
            self._status.clear()


class _StatusLine:
    """This tool's one line on a session's terminal: written at the cursor
    (saved first), taken back (the cursor restored, the rest of the line
    erased) before the next output, so the remote screen stays as it was."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shown = False

    def show(self, message: str) -> None:
        with self._lock:
            take_back = b"\x1b8\x1b[K" if self._shown else b""
            line = f"\x1b7\x1b[7m[{message}]\x1b[m".encode("utf-8", "replace")
            echo("stderr", take_back + line)
            self._shown = True

    def clear(self) -> None:
        with self._lock:
            if self._shown:
                echo("stderr", b"\x1b8\x1b[K")
                self._shown = False


@contextlib.contextmanager
def _raw_terminal(fd: int) -> Iterator[None]:
    """The terminal raw (keys as bytes: Ctrl-C too), its settings restored exactly.
    Both changes wait for the output to drain and keep what was typed and not
    read yet (TCSADRAIN, not TCSAFLUSH): keys typed while the session starts are
    its program's, and those typed after it are for what reads the terminal next."""
    import termios  # POSIX only, as -t
    import tty

    saved = termios.tcgetattr(fd)
    tty.setraw(fd, termios.TCSADRAIN)
    try:
        yield
    finally:
        with contextlib.suppress(termios.error):  # a terminal hung up has nothing to restore
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _run_with_files(
    options: argparse.Namespace,
    command: Optional[Command],
    env: Optional[Dict[str, str]],
    stdin: Union[bytes, int, None],
    started: List[RemoteProcess],
    failures: List[CreateOSError],
    report: "_Report",
) -> Optional[ExecResult]:
    """The --forward listeners, the --put files, the command (if any), then the --get
    files once a command that was started has ended, however it ended: the command's
    error is raised after them. Forwards without a command serve until Ctrl-C."""
    serving = command is None and options.attach is None
    say = report.line
    with Client(api_url=options.api_url) as client, _forwarding(client, options, serving, say):
        for transfer in options.put:
            report.moved.append(_transfer(client, options.sandbox_id, transfer, report.bars))
        while serving and options.forward:
            time.sleep(3600)  # until Ctrl-C's KeyboardInterrupt
        result, failure = None, None
        try:
            if command is not None or options.attach is not None:
                result = _run_command(client, options, command, env, stdin, started, failures)
        except CreateOSError as error:
            if not started:
                raise
            failure = error
        for transfer in options.get:
            report.moved.append(_transfer(client, options.sandbox_id, transfer, report.bars))
        if failure is not None:
            raise failure
        return result


class _TransferFailed(Exception):
    """A --put or --get that failed: `message` names it and says why."""

    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


def _transfer(client: Client, sandbox_id: str, transfer: _Transfer, bar: bool) -> Dict[str, Any]:
    """One --put or --get (LOCAL "-" of --get: this tool's stdout), with a progress
    bar on stderr when `bar`; what it moved, for --json."""
    progress = _ProgressBar(transfer.typed) if bar else None
    try:
        if transfer.option == "--put":
            info = client.put(sandbox_id, transfer.local, transfer.remote, progress=progress)
        elif transfer.local == "-":
            sys.stdout.flush()
            info = client.get(sandbox_id, transfer.remote, sys.stdout.buffer, progress=progress)
        else:
            info = client.get(sandbox_id, transfer.remote, transfer.local, progress=progress)
    except CreateOSError as error:
        raise _TransferFailed(f"{transfer.typed} failed: {error}", error) from None
    except BrokenPipeError:
        raise  # the reader of stdout went away: as for a command's output
    except OSError as error:
        why = f"{error.filename or transfer.local}: {error.strerror or 'it could not be opened'}"
        raise _TransferFailed(f"{transfer.typed} failed: {why}.", error) from None
    finally:
        if progress is not None:
            progress.end()
    return dict(dataclasses.asdict(info), option=transfer.option)


class _ProgressBar:
    """A transfer's progress on stderr, a terminal: one line, redrawn at most ten
    times a second and at the end: the bytes moved, of how many, how fast."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._started = time.monotonic()
        self._drawn: Optional[float] = None

    def __call__(self, done: int, total: Optional[int]) -> None:
        now = time.monotonic()
        if self._drawn is not None and now - self._drawn < 0.1 and done != total:
            return
        self._drawn = now
        of = "" if total is None else f" of {_in_units(total)}, {done * 100 // max(total, 1)}%"
        figures = f"{_in_units(done)}{of}, {_in_units(done / max(now - self._started, 1e-3))}/s"
        room = shutil.get_terminal_size().columns - len(figures) - 3
        label = self._label if len(self._label) <= room else self._label[: max(room - 3, 0)] + "..."
        sys.stderr.write(f"\r{label}  {figures}\x1b[K")
        sys.stderr.flush()

    def end(self) -> None:
        if self._drawn is not None:
            sys.stderr.write("\n")


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced, or closed
        return False


def _in_units(count: float) -> str:
    """A number of bytes as a person reads it: 512 B, 1.5 KiB, 3.0 GiB."""
    if count < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.1f} {unit}"


@contextlib.contextmanager
def _counted_interrupts(interrupts: List[int]) -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt as usual, and is counted in `interrupts`: the
    second one cuts the termination of the remote tree short. Left alone where SIGINT
    is handled otherwise (ignored in a background job) or cannot be (not the main thread)."""

    def interrupted(number: int, frame: Any) -> None:
        interrupts.append(number)
        raise KeyboardInterrupt

    ours = threading.current_thread() is threading.main_thread()
    if not ours or _signal.getsignal(_signal.SIGINT) is not _signal.default_int_handler:
        yield
        return
    _signal.signal(_signal.SIGINT, interrupted)
    try:
        yield
    finally:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)


def _cleanup_cut_short(started: List[RemoteProcess]) -> str:
    if not started:
        return (
            "interrupted again during the cleanup: a process may have been created "
            "and may still run."
        )
    return (
        f"interrupted again before the termination of process {started[0].process_id} "
        "was confirmed: its remote tree may still run."
    )


def _print_live(stream: str, text: str) -> None:
    """Write output through as the bytes it was (decoded with surrogateescape);
    a terminal's ("pty") to stdout."""
    out = sys.stderr if stream == "stderr" else sys.stdout
    if getattr(out, "buffer", None) is None:
        out.write(text)
    else:
        echo(stream, text.encode("utf-8", "surrogateescape"))


def _attach_again(prog: str, options: argparse.Namespace, process: RemoteProcess) -> str:
    where = f" --api-url {_quote(options.api_url)}" if options.api_url else ""
    again = f"{prog}{where} -t --attach {process.process_id} {process.sandbox_id}"
    return f"detached; process {process.process_id} runs on. To attach again: {again}"


def _in_shell_words(error: CreateOSError) -> str:
    """The error's sentence, in a shell user's words where the library's names a Python call."""
    if isinstance(error, CleanupError) and error.unreachable and error.process_id:
        return (
            f"CreateOS could not be reached to terminate process {error.process_id}: it may "
            f"still run; its output after seq {error.after or 0} is kept, and the process "
            "can be taken up again by its id once the API answers."
        )
    if not isinstance(error, SandboxError) or error.operation.startswith(_TUNNEL_TO):
        return str(error)
    sandbox = f"the sandbox {error.sandbox_id} {_sandbox_is(error.sandbox_status)}"
    if isinstance(error, SandboxGoneError):
        return f"{sandbox}: {_GONE_ADVICE[error._unknown()]}."
    if error.process_id is None:
        return f"{sandbox}: no process was started; resume it, or run again with --resume."
    if not isinstance(error, SandboxPausedError):
        return (
            f"{sandbox}: process {error.process_id} was not terminated and is no longer "
            f"followed here; once the sandbox runs, --attach {error.process_id} --after "
            f"{error.after or 0} follows it on."
        )
    return (
        f"{sandbox}: process {error.process_id} is frozen with it, not ended, and no longer "
        "followed here; resuming the sandbox lets it go on (--resume has this tool "
        "resume it and follow on)."
    )


def _cli_exit_code(result: ExecResult) -> int:
    if result.timed_out:
        return 124
    if result.signal is not None:
        number = _signal_number(result.signal)
        return 128 + number if number is not None else 125
    return int(result.exit_code if result.exit_code is not None else 125)


class _Report:
    """The command line's own lines on stderr, each after the program name as typed;
    the transfers' progress bars there, on a terminal; with --json, what they moved."""

    def __init__(self, prog: str, as_json: bool, transfers: bool) -> None:
        self._prog = prog
        self._as_json = as_json
        self._transfers = transfers  # there are --put or --get options
        self.bars = not as_json and _is_terminal(sys.stderr)
        self.moved: List[Dict[str, Any]] = []  # each transfer's FileInfo, and its option

    def json(self, fields: Dict[str, Any]) -> None:
        """One JSON object on stdout: `fields`, and the transfers if any were asked for."""
        print(json.dumps(dict(fields, transfers=self.moved) if self._transfers else fields))

    def line(self, message: str) -> None:
        print(f"{self._prog}: {message}", file=sys.stderr)

    def failure(self, kind: str, message: str, error: Optional[BaseException] = None) -> int:
        """An error of this tool, the API or the connection: one line, or with --json
        one object a script can branch on (`status`, `operation`, where there are)."""
        if not self._as_json:
            self.line(message)
            return 125
        fields = {
            "type": kind,
            "message": message,
            "process_id": getattr(error, "process_id", None),
        }
        for name in ("status", "operation"):
            if hasattr(error, name):
                fields[name] = getattr(error, name)
        self.json({"error": fields})
        return 125


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status (see --help)."""
    parser = _parser()
    options = parser.parse_args(argv)
    command, env = _command_and_env(parser, options)
    report = _Report(parser.prog, options.json, bool(options.put or options.get))
    if _key_from_environment() is None:
        return report.failure("ConfigError", _NO_KEY_HERE)
    try:
        stdin: Union[bytes, int, None] = _read_stdin_option(options.stdin)
    except OSError as exc:
        return report.failure(type(exc).__name__, _unreadable_stdin(options.stdin, exc))
    if options.stdin is None and not options.no_stdin and not options.tty and not options.attach:
        stdin = _forwarded_stdin(options.interactive)
    started: List[RemoteProcess] = []
    interrupts: List[int] = []
    failures: List[CreateOSError] = []
    try:
        with _counted_interrupts(interrupts):
            result = _run_with_files(options, command, env, stdin, started, failures, report)
    except KeyboardInterrupt:
        report.line("interrupted" if len(interrupts) < 2 else _cleanup_cut_short(started))
        return 130
    except _Detached:
        report.line(_attach_again(parser.prog, options, started[0]))
        return 0
    except _SignalledAway as away:
        return 128 + away.number
    except BrokenPipeError:
        # Our reader went away (`| head`): like a local pipeline, the command
        # was stopped. Later flushes of stdout must not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE, as a shell reports it
    except CreateOSError as exc:
        return report.failure(type(exc).__name__, _in_shell_words(exc), exc)
    except _TransferFailed as failed:
        return report.failure(type(failed.cause).__name__, str(failed), failed.cause)
    for failure in failures:
        report.line(f"this tool's stdin was not all given to the command: {failure}")
    if result is None:
        if options.json:
            report.json({})
        return 0
    if result.timed_out and options.timeout is not None:
        report.line(
            f"the command timed out after {options.timeout:g} s; "
            "its remote process tree was terminated."
        )
    if options.json:
        derived = {"output_truncated": result.output_truncated, "returncode": result.returncode}
        report.json(dict(dataclasses.asdict(result), **derived))
    return _cli_exit_code(result)


if __name__ == "__main__":
    sys.exit(main())
