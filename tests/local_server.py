"""A CreateOS-compatible HTTP server backed by REAL local subprocesses.

WARNING: this server RUNS COMMANDS ON THIS MACHINE, as the user who started
it, for anyone who knows its API key. It binds loopback addresses only.

It speaks the managed-process, files and exec endpoints of the CreateOS
Sandbox REST API (see ``docs/protocol.md``), and the GET of a sandbox that SDKs
use to get a handle on one: JSend envelopes, ``X-Api-Key`` auth,
NDJSON output streams over chunked HTTP/1.1 with heartbeats, a bounded
replay journal with whole-frame eviction, ``wait`` long-polls and
termination of the whole tree with a grace period, and PTY processes on real
pseudo-terminals (resize, the foreground job). Tests can also inject faults
(error statuses, dropped / ended / stalled / corrupted streams, eviction, a
lost create response, a lost answer to a delivered input or to an exec, a
streamed exec cut or with a character changed, a file upload or download cut
or corrupted), and turn on strict
POST framing and a per-address rate limit
(``LocalServer(strict=True, rate_limit=(N, seconds))``).

Where docs/protocol.md §11 leaves the service open, ``LocalServer(reading=...)``
answers as one frozen ``Reading`` says, one field per question: the
conservative way (the default), the alternative way, or any mix of the two
(see ``LocalServer``), so that a client can be tested against each.

Python API::

    with LocalServer() as server:          # sandbox "sb_local" exists
        server.url, server.api_key         # http://127.0.0.1:PORT, "local-dev-key"
        server.drop_stream(after_frames=2) # next connect breaks after 2 data frames

Command line::

    python tests/local_server.py --port 0  # prints the base URL, serves until SIGINT/SIGTERM

A managed process's tree is its cgroup where the server may make one (root,
a writable cgroup v2 hierarchy with ``cgroup.kill``: Linux 5.14 or later), as
the service's is: ``tree_exited``, ``wait?scope=tree``, DELETE and ``stop()``
then reach every process started in it, a double-forked daemon included.
Elsewhere, or with ``cgroups=False``, it is the process group the leader
leads and which its descendants keep unless they leave it (``setsid``).

Only the standard library is used; Linux only (process groups are inspected
through ``/proc``, cgroups through ``/sys/fs/cgroup``).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import codecs
import collections
import contextlib
import dataclasses
import datetime
import errno
import fcntl
import functools
import hmac
import ipaddress
import itertools
import json
import math
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any, Callable, Iterable, Iterator, NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

__all__ = ["LocalServer", "RequestRecord", "main"]

DEFAULT_API_KEY = "local-dev-key"
DEFAULT_SANDBOX = "sb_local"

FRAME_LIMIT = 64 * 1024  # raw bytes per data frame (one os.read)
JSON_BODY_LIMIT = 256 * 1024  # the API's request limit (docs/protocol.md §5.5, §8)
FILE_SIZE_LIMIT = 500 * 1000 * 1000  # the vendor's "Max 500 MB per file" (docs/protocol.md §7)
FILE_PIECE = 256 * 1024  # bytes of a file read or written at once
POLL_INTERVAL = 0.02  # seconds between /proc scans while waiting for a tree, at most
# The first look again comes sooner: a tree usually empties within a few ms of
# its leader's end (the sandbox's watchdog leaves on its pipe's end), and a
# first pause of the whole interval would add it to every such wait.
FIRST_POLL = 0.001
KILL_TIMEOUT = 10.0  # seconds a SIGKILLed group gets to disappear
WAIT_DEFAULT_MS = 30000  # a wait long-poll that names no timeout_ms
LIST_LIMIT_MAX = 500  # the largest page of a paginated listing (the SDKs ask for 500)
STOLEN_LOCATION = "http://127.0.0.2:1/stolen"

# How Go's syscall.Signal.String() spells signals (Linux), for the alternative reading.
GO_SIGNAL_WORDS = {
    "SIGHUP": "hangup",
    "SIGINT": "interrupt",
    "SIGQUIT": "quit",
    "SIGILL": "illegal instruction",
    "SIGTRAP": "trace/breakpoint trap",
    "SIGABRT": "aborted",
    "SIGBUS": "bus error",
    "SIGFPE": "floating point exception",
    "SIGKILL": "killed",
    "SIGUSR1": "user defined signal 1",
    "SIGSEGV": "segmentation fault",
    "SIGUSR2": "user defined signal 2",
    "SIGPIPE": "broken pipe",
    "SIGALRM": "alarm clock",
    "SIGTERM": "terminated",
    "SIGSTKFLT": "stack fault",
    "SIGCHLD": "child exited",
    "SIGCONT": "continued",
    "SIGSTOP": "stopped (signal)",
    "SIGTSTP": "stopped",
    "SIGTTIN": "stopped (tty input)",
    "SIGTTOU": "stopped (tty output)",
    "SIGURG": "urgent I/O condition",
    "SIGXCPU": "CPU time limit exceeded",
    "SIGXFSZ": "file size limit exceeded",
    "SIGVTALRM": "virtual timer expired",
    "SIGPROF": "profiling timer expired",
    "SIGWINCH": "window changed",
    "SIGIO": "I/O possible",
    "SIGPWR": "power failure",
    "SIGSYS": "bad system call",
}

ALLOWED_SIGNALS = (
    "SIGHUP",
    "SIGINT",
    "SIGQUIT",
    "SIGKILL",
    "SIGTERM",
    "SIGUSR1",
    "SIGUSR2",
    "SIGWINCH",
)
ENDPOINTS = (
    "create",
    "list",
    "get",
    "connect",
    "input",
    "stdin_close",
    "resize",
    "signal",
    "wait",
    "delete",
    "files_get",
    "files_put",
    "exec",
    "sandbox",
    "sandbox_create",
    "sandbox_pause",
    "sandbox_resume",
    "sandbox_destroy",
    "tunnel",
)
# The headers that carry a credential: X-Api-Key, and those read before it.
CREDENTIAL_HEADERS = ("X-Api-Key", "Authorization", "X-Auth-Token", "X-Access-Token")
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
SANDBOX_ID = re.compile(r"[A-Za-z0-9_-]{1,200}\Z")
UNSIGNED = re.compile(r"[0-9]+\Z")
WINSIZE_MAX = 65535  # rows and cols are unsigned shorts in the kernel's winsize

_SB = r"/v1/sandboxes/([^/]+)"
_PROC = _SB + r"/processes/([^/]+)"
# "METHOD endpoint name" by path pattern; path groups are URL-decoded ids.
_ENDPOINTS_BY_PATH = {
    r"/healthz": "GET healthz",
    r"/v1/sandboxes": "POST sandbox_create",
    _SB: "GET sandbox, DELETE sandbox_destroy",
    _SB + r"/pause": "POST sandbox_pause",
    _SB + r"/resume": "POST sandbox_resume",
    _SB + r"/processes": "POST create, GET list",
    _PROC: "GET get, DELETE delete",
    _PROC + r"/connect": "GET connect",
    _PROC + r"/input": "POST input",
    _PROC + r"/stdin/close": "POST stdin_close",
    _PROC + r"/resize": "POST resize",
    _PROC + r"/signal": "POST signal",
    _PROC + r"/wait": "GET wait",
    _SB + r"/files": "GET files_get, PUT files_put",
    _SB + r"/exec": "POST exec",
    _SB + r"/tunnel/([0-9]{1,5})": "POST tunnel",
}
# (method, path pattern, endpoint name)
ROUTES = tuple(
    (method, re.compile(path + r"\Z"), endpoint)
    for path, endpoints in _ENDPOINTS_BY_PATH.items()
    for method, endpoint in (pair.split() for pair in endpoints.split(", "))
)

# Fault kinds. The faults of one endpoint wait in one FIFO and each is
# consumed at the moment it applies to: a status fault at request start, a
# stream fault once a stream has started, a lost or refused (429) response after a create or
# after an input written to the process, an exec stream's once its command started. A
# head fault that does not apply yet holds back those behind it, so
# drop_stream() then fail("connect", 503) breaks the first stream and answers
# 503 to the next connect. A replay fault only moves a connect's starting
# point: it has a FIFO of its own and combines with the fault of that connect.
# A lifecycle fault pauses or destroys the sandbox at a request's start, or,
# on a connect, as a stream fault; the request then meets the sandbox so.
LIFECYCLE_FAULTS = ("pause", "destroy")
STREAM_FAULTS = ("drop", "end", "stall", "corrupt") + LIFECYCLE_FAULTS


# How the server answers each open question of docs/protocol.md §11: one field per
# question it branches on, described in LocalServer's docstring. Values that
# are words are checked against READING_CHOICES.
@dataclasses.dataclass(frozen=True)
class Reading:
    name: str = "conservative"
    create_status: int = 200  # §11.1
    heartbeat_interval: float = 5.0  # §11.2
    heartbeat_first: bool = False  # §11.2
    stream_lifetime: float | None = None  # §11.2
    expired_410: str = "always"  # §11.3
    expired_410_body: str = "map"  # §11.3
    live_eviction: str = "error_frame"  # §11.3
    output_bytes: str = "raw"  # §11.4
    record_omits_empty: bool = False  # §5.2
    oldest_seq_before_output: int = 0  # §5.2
    exit_after: str = "leader"  # §11.5
    signal_spelling: str = "SIGNAME"  # §11.7
    signal_exit_code: int | None = None  # §11.7
    exit_frame_seq: bool = False  # §11.8
    eof_data_frame: bool = False  # §11.8
    stdin_close_idempotent: bool = False  # §11.10
    signal_after_exit: int = 409  # §11.10
    signal_target: str = "group"  # §11.10
    wait_default_scope: str = "leader"  # §11.11
    wait_default_ms: int = WAIT_DEFAULT_MS  # §11.11
    wait_cap: float | None = None  # §11.11
    after_default: int = 0  # §5.4
    delete_default_grace_ms: int = 1000  # §11.12
    delete_forgets: bool = False  # §11.12
    upload_creates_parents: bool = False  # §11.16
    listing: str = "unpaginated"  # §5.3
    pty_term: str | None = None  # §11.20
    pty_default_size: str = "24x80"  # §11.20
    pty_signal_target: str = "foreground"  # §11.20
    idle_activity: str = "requests"  # §11.14
    paused_answer: int = 409  # §11.17
    paused_stream: str = "reset"  # §11.17
    resume_keeps_processes: bool = True  # §11.18
    destroyed_view: int = 404  # §11.19

    def __post_init__(self) -> None:
        for field, choices in READING_CHOICES.items():
            if getattr(self, field) not in choices:
                raise ValueError("%s must be one of: %s" % (field, ", ".join(choices)))
        for field in ("heartbeat_interval", "stream_lifetime", "wait_cap"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError("%s must be positive" % field)


READING_CHOICES = {
    "expired_410": ("always", "when_final"),
    "expired_410_body": ("map", "string"),
    "live_eviction": ("error_frame", "cut"),
    "output_bytes": ("raw", "base64"),
    "oldest_seq_before_output": (0, 1),
    "exit_after": ("leader", "tree"),
    "signal_spelling": ("SIGNAME", "go"),
    "signal_exit_code": (None, -1),
    "signal_after_exit": (409, 200),
    "signal_target": ("group", "leader"),
    "wait_default_scope": ("leader", "tree"),
    "listing": ("unpaginated", "paginated"),
    "pty_term": (None, "xterm"),
    "pty_default_size": ("24x80", "0x0"),
    "pty_signal_target": ("foreground", "leader"),
    "idle_activity": ("requests", "streams"),
    "paused_answer": (409, 404, 503),
    "paused_stream": ("reset", "eof"),
    "destroyed_view": (404, 200),
}

# The two readings of docs/protocol.md §11 (see LocalServer's docstring): the
# conservative one is docs/protocol.md §9; the alternative one flips every unknown
# whose other answer is plausible and that a client must survive.
CONSERVATIVE = Reading()
ALTERNATIVE = Reading(
    name="alternative",
    create_status=201,
    heartbeat_first=True,
    stream_lifetime=2.0,
    expired_410="when_final",
    expired_410_body="string",
    live_eviction="cut",
    output_bytes="base64",
    record_omits_empty=True,
    oldest_seq_before_output=1,
    exit_after="tree",
    signal_spelling="go",
    signal_exit_code=-1,
    exit_frame_seq=True,
    eof_data_frame=True,
    stdin_close_idempotent=True,
    signal_after_exit=200,
    signal_target="leader",
    wait_cap=1.0,
    delete_forgets=True,
    upload_creates_parents=True,
    listing="paginated",
    pty_term="xterm",
    pty_default_size="0x0",
    pty_signal_target="leader",
    idle_activity="streams",
    paused_answer=404,
    paused_stream="eof",
    resume_keeps_processes=False,
    destroyed_view=200,
)
READINGS = (CONSERVATIVE, ALTERNATIVE)
READINGS_BY_NAME = {reading.name: reading for reading in READINGS}


def reading_of(reading: Reading | str) -> Reading:
    """A Reading, or the one of READINGS with that name."""
    if isinstance(reading, Reading):
        return reading
    if reading not in READINGS_BY_NAME:
        raise ValueError("reading must be one of: %s" % ", ".join(READINGS_BY_NAME))
    return READINGS_BY_NAME[reading]


def reading_with(reading: Reading, setting: str) -> Reading:
    """``reading`` with one field changed by a ``FIELD=VALUE`` of ``--set``."""
    name, sep, text = setting.partition("=")
    fields = {field.name: field for field in dataclasses.fields(Reading)}
    if not sep or name not in fields or name == "name":
        raise ValueError("--set takes FIELD=VALUE, FIELD one of: %s" % ", ".join(list(fields)[1:]))
    kind = str(fields[name].type)
    value: object
    if text.lower() == "none" and "None" in kind:
        value = None
    elif kind == "bool":
        if text.lower() not in ("true", "false"):
            raise ValueError("%s takes true or false, not %r" % (name, text))
        value = text.lower() == "true"
    elif kind.startswith(("int", "float")):
        try:
            value = (int if kind.startswith("int") else float)(text)
        except ValueError:
            raise ValueError("%s takes a number, not %r" % (name, text)) from None
    else:
        value = text
    return dataclasses.replace(reading, **{name: value})


class RequestRecord(NamedTuple):
    """One request seen by the server.

    ``query`` is a dict of query parameters (last value wins); ``status`` is
    the HTTP status answered, or 0 when the connection was dropped on purpose
    (``drop_stream``, ``stall_stream``, ``lose_create_response``);
    ``credentials`` names the credential headers the request carried.
    """

    time: float
    method: str
    path: str
    query: dict[str, str]
    status: int
    client_port: int
    credentials: tuple[str, ...] = ()


class ApiError(Exception):
    """An answer other than success: a JSend fail (4xx) or error (5xx)."""

    def __init__(self, status: int, data: object, headers: dict[str, str] | None = None):
        super().__init__(status, data)
        self.status = status
        self.data = data
        self.headers = headers or {}


def envelope(status: int, data: object) -> dict[str, Any]:
    """The JSend envelope that goes with an HTTP status."""
    if status < 300:
        return {"status": "success", "data": data}
    if status < 500:
        return {"status": "fail", "data": data}
    return {"status": "error", "message": str(data), "code": status}


def utc_now() -> str:
    """The current time as an RFC 3339 UTC timestamp."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "SIG%d" % signum


def go_signal_word(signum: int) -> str:
    """The signal as Go's syscall.Signal.String() spells it ("killed", "signal 34")."""
    return GO_SIGNAL_WORDS.get(signal_name(signum), "signal %d" % signum)


def live_process_groups() -> set[int]:
    """Process group ids that still have a member which is not a zombie.

    Scans /proc rather than calling ``os.killpg(pgid, 0)``: that succeeds
    for zombies too, and reparented zombies may never be reaped in a
    container whose PID 1 does not reap.
    """
    groups = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as stat_file:
                stat = stat_file.read()
        except OSError:  # exited since listdir
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields and fields[0] not in (b"Z", b"X"):
            groups.add(int(fields[2]))
    return groups


def loopback_host(host: str) -> str:
    """Return the address to bind, refusing anything that is not loopback."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError("host must be a loopback IP address, not %r" % host) from None
    if not address.is_loopback:
        raise ValueError("refusing to bind %s: the local server binds loopback only" % host)
    return host


# --------------------------------------------------------------------------
# State: sandboxes, managed processes, faults


class Frame:
    """One journalled data frame, kept pre-encoded as its NDJSON line."""

    __slots__ = ("seq", "size", "encoded_size", "line")

    def __init__(self, seq: int, stream: str, data: bytes):
        self.seq = seq
        self.size = len(data)
        self.encoded_size = 4 * ((len(data) + 2) // 3)
        self.line = frame_line(
            {
                "type": "data",
                "seq": seq,
                "stream": stream,
                "data_base64": base64.b64encode(data).decode("ascii"),
            }
        )


def frame_line(frame: dict[str, Any]) -> bytes:
    return json.dumps(frame, separators=(",", ":")).encode("ascii") + b"\n"


HEARTBEAT_LINE = frame_line({"type": "heartbeat"})
STOP = object()  # "the server is stopping" marker of OutputStream
CUT = object()  # "break the connection without a frame" marker of OutputStream
END = object()  # "end the body cleanly without an exit frame" marker of OutputStream


class Sandbox:
    """A named sandbox: declared env variables, a lazily created work dir, and
    its lifecycle (docs/protocol.md §4.1): its ``status``, when it was last
    active and how many connect streams it serves (for the idle auto-pause)."""

    def __init__(self, sandbox_id: str, envs: dict[str, str]):
        self.id = sandbox_id
        self.envs = envs
        self.created_at = utc_now()
        self.status = "running"  # running, paused, resuming, destroyed
        self.last_active = time.monotonic()
        self.open_streams = 0
        self._workdir: str | None = None
        self._lock = threading.Lock()

    def view(self) -> dict[str, Any]:
        # Only the names of the declared variables, as the real GET (docs/protocol.md §4).
        return {
            "id": self.id,
            "status": self.status,
            "created_at": self.created_at,
            "envs": sorted(self.envs),
        }

    def workdir(self) -> str:
        with self._lock:
            if self._workdir is None:
                self._workdir = tempfile.mkdtemp(prefix="createos-%s-" % self.id)
            return self._workdir

    def remove_workdir(self) -> None:
        with self._lock:
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)
                self._workdir = None


# --------------------------------------------------------------------------
# The tree of a managed process: its cgroup, or its process group


class ProcessGroup:
    """The tree as the process group the leader leads (start_new_session): a
    descendant that leaves it (``setsid``, a double-forked daemon) is out of reach."""

    def __init__(self, pgid: int):
        self.pgid = pgid

    def signal_all(self, signum: int) -> None:
        try:
            os.killpg(self.pgid, signum)
        except ProcessLookupError:
            pass

    def freeze(self, frozen: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) every member, as a paused VM does."""
        self.signal_all(signal.SIGSTOP if frozen else signal.SIGCONT)

    def empty(self, groups: set[int] | None = None) -> bool:
        """No live member left (`groups`: a scan of live_process_groups() already made)."""
        return self.pgid not in (live_process_groups() if groups is None else groups)

    def remove(self) -> None:
        """Nothing to remove: a process group ends with its last member."""


class Cgroup:
    """A cgroup v2 directory. A process put in it before it runs anything, and
    every descendant it starts, stay in it whatever they do short of writing to
    another cgroup's ``cgroup.procs``, as in the service's sandbox."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def create(cls, path: str) -> Cgroup:
        os.mkdir(path, 0o755)
        return cls(path)

    def child(self, name: str) -> Cgroup:
        return Cgroup.create(os.path.join(self.path, name))

    def join(self) -> None:
        """Move the calling process into this cgroup (a preexec_fn: between
        fork and exec, so that nothing the command runs starts outside it)."""
        self._write("cgroup.procs", b"0")  # 0: the writer itself

    def signal_all(self, signum: int) -> None:
        """SIGKILL at once to the whole cgroup (``cgroup.kill``: nothing forked
        meanwhile escapes); another signal to each process listed, once."""
        if signum == signal.SIGKILL:
            self._write("cgroup.kill", b"1")
            return
        for pid in self.members():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # ended since the listing
                pass

    def freeze(self, frozen: bool) -> None:
        """Freeze or thaw the whole cgroup at once (``cgroup.freeze``: no signal
        that a shell could see as a stopped job, nothing forked escapes)."""
        self._write("cgroup.freeze", b"1" if frozen else b"0")

    def members(self) -> list[int]:
        """The pids in it (an exited process, a zombie, is no longer listed)."""
        with open(os.path.join(self.path, "cgroup.procs"), "rb") as procs:
            return [int(pid) for pid in procs.read().split()]

    def empty(self, groups: set[int] | None = None) -> bool:
        """No live process left in it (a zombie does not count): ``populated 0``."""
        try:
            with open(os.path.join(self.path, "cgroup.events"), "rb") as events:
                return b"populated 0" in events.read().splitlines()
        except OSError as exc:  # removed, before or while it was read: it was empty
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                raise
            return True

    def remove(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:  # gone already, or a tree that survived SIGKILL keeps it
            pass

    def _write(self, name: str, data: bytes) -> None:
        fd = os.open(os.path.join(self.path, name), os.O_WRONLY)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def cgroup2_mount() -> str | None:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup``, or
    ``/sys/fs/cgroup/unified`` beside v1 controllers), or None."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                # "ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE ..."
                fields = line.split()
                if fields[fields.index("-") + 1] == "cgroup2":
                    return fields[4]
    except (OSError, ValueError, IndexError):
        pass
    return None


def server_cgroup() -> Cgroup | None:
    """A cgroup of this server's own, under which each managed process gets one,
    if this machine lets it: it is made, a probe process is put in it and ends,
    and it has ``cgroup.kill``. None: the process groups are the trees."""
    mount = cgroup2_mount()
    if mount is None:
        return None
    name = "local_server-%d-%s" % (os.getpid(), secrets.token_hex(4))  # xdist runs many
    try:
        parent = Cgroup.create(os.path.join(mount, name))
    except OSError:
        return None
    try:
        if not os.path.exists(os.path.join(parent.path, "cgroup.kill")):  # Linux < 5.14
            raise OSError("no cgroup.kill")
        subprocess.run(["true"], preexec_fn=parent.join, check=True)
    except (OSError, subprocess.SubprocessError):
        parent.remove()
        return None
    return parent


class Process:
    """A managed process: a real subprocess leading its own process group,
    in a cgroup of its own where the server may make one (``tree``).

    ``cond`` guards every field below it. The leader is reaped only while
    ``cond`` is held, so code holding ``cond`` may signal ``pid`` without
    racing pid reuse.
    """

    def __init__(
        self,
        process_id: str,
        sandbox_id: str,
        popen: subprocess.Popen[bytes],
        tree: ProcessGroup | Cgroup,
        cmd: str,
        args: list[str],
        cwd: str,
        journal_limit: int,
        frame_limit: int = FRAME_LIMIT,
        reading: Reading = CONSERVATIVE,
        created_at: str | None = None,
    ):
        self.id = process_id
        self.sandbox_id = sandbox_id
        self.pid = popen.pid  # also the process group id (start_new_session)
        self.tree = tree
        self.cmd, self.args, self.cwd = cmd, args, cwd
        # Stamped before the spawn by the caller: a record is created before its
        # process runs, so that finished_at - created_at bounds how long it ran.
        self.created_at = created_at or utc_now()
        self._popen = popen
        self._stdin, self._outputs = self._streams(popen)
        self._journal_limit = journal_limit
        self._frame_limit = frame_limit
        self.reading = reading
        self._stdin_lock = threading.Lock()  # serialises writes and close of stdin
        self._input_seq = 0
        self._threads: list[threading.Thread] = []

        self.cond = threading.Condition()
        self.returncode: int | None = None  # set once the leader is reaped
        self.finished_at: str | None = None
        self.terminating = False
        self.journal: collections.deque[Frame] = collections.deque()
        self.journal_bytes = 0
        self.journal_encoded_bytes = 0  # the same frames' data_base64 lengths
        self.newest_seq = 0
        self.evicted_through = 0  # highest seq dropped from the journal
        self.evicted_bytes = 0  # raw bytes of the frames dropped from it
        self._open_pipes = len(self._outputs)
        self._tree_gone = False  # latched: once empty, the group id may be reused
        self.deleted = False  # answered a DELETE (forgotten if reading.delete_forgets)
        self.lost = False  # forgotten by a resume (reading.resume_keeps_processes False)

    kind = "process"

    def _streams(
        self, popen: subprocess.Popen[bytes]
    ) -> tuple[IO[bytes], tuple[tuple[IO[bytes], str], ...]]:
        """Where input goes, and each output with its stream name."""
        assert popen.stdin and popen.stdout and popen.stderr  # started with three PIPEs
        return popen.stdin, ((popen.stdout, "stdout"), (popen.stderr, "stderr"))

    def start(self) -> None:
        targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
            (self._pump, output) for output in self._outputs
        ]
        targets.append((self._reap, ()))
        for target, args in targets:
            thread = threading.Thread(
                target=target, args=args, daemon=True, name="%s-%s" % (self.id, target.__name__)
            )
            thread.start()
            self._threads.append(thread)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- output ------------------------------------------------------------

    def _pump(self, pipe: IO[bytes], stream: str) -> None:
        """Journal one output pipe until EOF, one frame per read."""
        fd = pipe.fileno()
        while True:
            try:
                data = os.read(fd, self._frame_limit)
            except OSError:
                data = b""
            if not data:
                break
            with self.cond:
                self._append(stream, data)
        with self.cond:  # a terminal's foreground is read through its reader under cond
            pipe.close()
            if self.reading.eof_data_frame:  # an empty data frame marks the end of the stream
                self._append(stream, b"")
            self._open_pipes -= 1
            self.cond.notify_all()

    def _append(self, stream: str, data: bytes) -> None:
        self.newest_seq += 1
        frame = Frame(self.newest_seq, stream, data)
        self.journal.append(frame)
        self.journal_bytes += frame.size
        self.journal_encoded_bytes += frame.encoded_size
        # Evict whole frames, oldest first, but always keep the newest one so
        # that a reader keeping up never loses output to a tiny limit.
        while self.journal_bytes > self._journal_limit and len(self.journal) > 1:
            self._drop_oldest()
        self.cond.notify_all()

    def _drop_oldest(self) -> None:
        frame = self.journal.popleft()
        self.journal_bytes -= frame.size
        self.journal_encoded_bytes -= frame.encoded_size
        self.evicted_through = frame.seq
        self.evicted_bytes += frame.size

    def evict_all(self) -> None:
        with self.cond:
            while self.journal:
                self._drop_oldest()
            self.evicted_through = self.newest_seq
            self.cond.notify_all()

    def frames_after(self, cursor: int) -> list[Frame]:
        """Retained frames with seq > cursor (caller holds cond)."""
        if not self.journal:
            return []
        start = max(0, cursor + 1 - self.journal[0].seq)
        return list(itertools.islice(self.journal, start, None))

    @property
    def output_finished(self) -> bool:
        """Leader reaped and both pipes at EOF (and, if reading.exit_after is
        "tree", the whole tree gone): time for the exit frame."""
        return (
            self.returncode is not None
            and self._open_pipes == 0
            and (self._tree_gone or self.reading.exit_after == "leader")
        )

    def exit_line(self) -> bytes:
        """The exit frame (caller holds cond and has seen output_finished)."""
        frame: dict[str, Any] = {"type": "exit"}
        if self.reading.exit_frame_seq:
            frame["seq"] = self.newest_seq + 1
        frame.update(self._exit_status())
        return frame_line(frame)

    def _exit_status(self) -> dict[str, Any]:
        """exit_code / signal of the reaped leader, as this reading spells them."""
        code = self.returncode
        assert code is not None
        if code >= 0:
            return {"exit_code": code}
        status: dict[str, Any] = {}
        if self.reading.signal_exit_code is not None:  # Go's ProcessState.ExitCode(): -1
            status["exit_code"] = self.reading.signal_exit_code
        spell = go_signal_word if self.reading.signal_spelling == "go" else signal_name
        status["signal"] = spell(-code)
        return status

    # -- lifetime ------------------------------------------------------------

    def _reap(self) -> None:
        # Wait without reaping, then reap under cond: signal senders holding
        # cond therefore never hit a recycled pid.
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        finished_at = utc_now()  # when it exited, not when cond came free
        with self.cond:
            self._popen.wait()
            self.returncode = self._popen.returncode
            self.finished_at = finished_at
            self.cond.notify_all()
        # Nobody may write after the leader exited. A write still blocked in
        # write_input holds the lock; it closes the pipe itself when done.
        if self._stdin_lock.acquire(blocking=False):
            try:
                self._close_stdin_pipe()
            finally:
                self._stdin_lock.release()
        if self.reading.exit_after == "tree":  # the exit frame waits for it: watch it
            pause = FIRST_POLL
            while not self.tree_exited():
                time.sleep(pause)
                pause = min(2 * pause, POLL_INTERVAL)
            with self.cond:
                self.cond.notify_all()

    def tree_exited(self, groups: set[int] | None = None) -> bool:
        """Leader reaped and no live process left in its tree (cgroup or process
        group; `groups`: a scan of live_process_groups() already made). The
        tree's cgroup is removed once it is empty."""
        with self.cond:
            if self._tree_gone or self.returncode is None:
                return self._tree_gone
        empty = self.tree.empty(groups)
        with self.cond:
            if empty and not self._tree_gone:
                self._tree_gone = True
                self.tree.remove()
            return self._tree_gone

    def leader_exited(self) -> bool:
        with self.cond:
            return self.returncode is not None

    def settled(self) -> bool:
        """The tree gone and both pipes read to their end: the journal is complete,
        as docs/protocol.md §5.6 has a client assume when `wait?scope=tree` answers."""
        if not self.tree_exited():
            return False
        with self.cond:
            return self._open_pipes == 0

    def kill_tree(self, signum: int) -> None:
        with self.cond:
            if not self._tree_gone:
                self.tree.signal_all(signum)

    def freeze(self, frozen: bool) -> None:
        """Freeze or thaw the tree; wake its streams, which look at the sandbox."""
        with self.cond:
            if not self._tree_gone:
                self.tree.freeze(frozen)
            self.cond.notify_all()

    def send_signal(self, signum: int) -> None:
        """Signal the process group, as the vendor CLI documents for pipe
        processes, or the leader alone (reading.signal_target)."""
        with self.cond:
            if self.returncode is None:  # the leader is not reaped yet: its group exists
                self._deliver(signum)
            elif self.reading.signal_after_exit != 200:
                raise ApiError(
                    self.reading.signal_after_exit, {"process": "the leader has already exited"}
                )

    def _deliver(self, signum: int) -> None:
        if self.reading.signal_target == "leader":
            os.kill(self.pid, signum)
        else:
            os.killpg(self.pid, signum)

    # -- stdin ---------------------------------------------------------------

    def write_input(self, data: bytes) -> int:
        with self._stdin_lock:
            self._check_stdin_open()
            try:
                _write_all(self._stdin.fileno(), data)
            except OSError:
                self._close_stdin_pipe()
                raise ApiError(409, {"stdin": "the process no longer reads its stdin"}) from None
            finally:
                if self.leader_exited():
                    self._close_stdin_pipe()
            self._input_seq += 1
            return self._input_seq

    def resize(self, rows: int, cols: int) -> None:
        raise ApiError(409, {"process": "not a terminal"})

    def close_stdin(self) -> None:
        with self._stdin_lock:
            if not self.reading.stdin_close_idempotent:
                self._check_stdin_open()
            self._close_stdin_pipe()

    def _check_stdin_open(self) -> None:
        if self.leader_exited():
            raise ApiError(409, {"process": "the leader has already exited"})
        if self._stdin.closed:
            raise ApiError(409, {"stdin": "stdin is already closed"})

    def _close_stdin_pipe(self) -> None:
        try:
            self._stdin.close()
        except OSError:  # a broken pipe is closed all the same
            pass

    # -- record --------------------------------------------------------------

    def record(self, groups: set[int] | None = None) -> dict[str, Any]:
        """The ManagedProcess object of docs/protocol.md §5.2."""
        tree_exited = self.tree_exited(groups)
        with self.cond:
            code = self.returncode
            if code is not None:
                state = "exited"
            else:
                state = "terminating" if self.terminating else "running"
            record: dict[str, Any] = {
                "process_id": self.id,
                "kind": self.kind,
                "pid": self.pid,
                "state": state,
                "leader_exited": code is not None,
                "tree_exited": tree_exited,
                "created_at": self.created_at,
                "finished_at": self.finished_at,
                "exit_code": None,
                "signal": None,
                "cmd": self.cmd,
                "args": list(self.args),
                "cwd": self.cwd,
                "output": self._output_window(),
            }
            if code is not None:
                record.update(self._exit_status())
            record.update(self._terminal_view())
        if self.reading.record_omits_empty:  # Go's omitempty: no null, no empty cmd/args/cwd
            record = {key: value for key, value in record.items() if value not in (None, "", [])}
        return record

    def _terminal_view(self) -> dict[str, Any]:
        """The fields a terminal adds to the record (caller holds cond)."""
        return {}

    def _output_window(self) -> dict[str, int]:
        if self.newest_seq == 0:
            return {
                "oldest_seq": self.reading.oldest_seq_before_output,
                "newest_seq": 0,
                "bytes": 0,
            }
        encoded = self.reading.output_bytes == "base64"
        return {
            "oldest_seq": self.evicted_through + 1,
            "newest_seq": self.newest_seq,
            "bytes": self.journal_encoded_bytes if encoded else self.journal_bytes,
        }


class PtyProcess(Process):
    """A managed process on a pseudo-terminal (docs/protocol.md §5.5): the leader
    leads a session whose controlling terminal is the slave; the master takes
    its input and its resizes, and gives its one output stream, ``"pty"``.

    Input and resizes use the master until the leader exits (as a pipe's stdin
    does); the output is read through a descriptor of its own until no process
    holds the slave any more (EIO), and the foreground job is read through
    that one, under ``cond``.
    """

    kind = "pty"

    def __init__(self, *args: Any, master: int, **kwargs: Any):
        self._master = master
        super().__init__(*args, **kwargs)

    def _streams(
        self, popen: subprocess.Popen[bytes]
    ) -> tuple[IO[bytes], tuple[tuple[IO[bytes], str], ...]]:
        reader = os.fdopen(os.dup(self._master), "rb", buffering=0)
        return os.fdopen(self._master, "wb", buffering=0), ((reader, "pty"),)

    def close_stdin(self) -> None:
        raise ApiError(409, {"stdin": "a terminal has no stdin to close"})

    def resize(self, rows: int, cols: int) -> None:
        with self._stdin_lock:
            self._check_stdin_open()
            set_window_size(self._stdin.fileno(), rows, cols)  # the kernel sends SIGWINCH

    def _deliver(self, signum: int) -> None:
        """The terminal's foreground group, as the vendor CLI's help says, or the
        leader alone (reading.pty_signal_target, §11.20)."""
        group = None if self.reading.pty_signal_target == "leader" else self._foreground_group()
        if group is None:
            os.kill(self.pid, signum)
        else:
            os.killpg(group, signum)

    def _foreground_group(self) -> int | None:
        """The terminal's foreground process group, while a process holds the
        terminal (caller holds cond)."""
        reader = self._outputs[0][0]
        if reader.closed:
            return None
        try:
            return os.tcgetpgrp(reader.fileno()) or None  # 0: no foreground group
        except OSError:
            return None

    def _terminal_view(self) -> dict[str, Any]:
        group = self._foreground_group()
        return {"foreground": None if group is None else foreground_job(group)}


def foreground_job(group: int) -> dict[str, Any]:
    """``{pid, cmd, args}`` of a process group's leader, as its argv says."""
    try:
        with open("/proc/%d/cmdline" % group, "rb") as file:
            argv = file.read().decode("utf-8", "replace").split("\0")[:-1]
    except OSError:  # it has just ended
        argv = []
    return {"pid": group, "cmd": argv[0] if argv else "", "args": argv[1:]}


def set_window_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def window_size(value: object, default: tuple[int, int] | None = None) -> tuple[int, int]:
    """``rows`` and ``cols`` of a create's ``pty`` or of a resize's body: integers
    from 1 to WINSIZE_MAX; one left out takes ``default``'s (400 without it)."""
    if not isinstance(value, dict):
        raise ApiError(400, {"pty": "must be an object"})
    size = []
    for index, name in enumerate(("rows", "cols")):
        if name not in value and default is not None:
            size.append(default[index])
            continue
        number = value.get(name)
        if isinstance(number, bool) or not isinstance(number, int):
            number = 0
        if not 0 < number <= WINSIZE_MAX:
            raise ApiError(400, {name: "must be an integer from 1 to %d" % WINSIZE_MAX})
        size.append(number)
    return size[0], size[1]


def spawn(
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    cgroup: Cgroup | None,
    size: tuple[int, int] | None,
) -> tuple[subprocess.Popen[bytes], int | None]:
    """The leader, in a session of its own (setsid() runs before preexec_fn): on
    three pipes, or (``size`` given) on a new pseudo-terminal of that size, its
    controlling terminal; and the terminal's master."""
    master = slave = None
    if size is not None:
        master, slave = os.openpty()
        set_window_size(master, *size)
    preexec = functools.partial(take_terminal, cgroup) if size else cgroup and cgroup.join
    stream = subprocess.PIPE if slave is None else slave
    try:
        popen = subprocess.Popen(
            argv,
            stdin=stream,
            stdout=stream,
            stderr=stream,
            cwd=cwd,
            env=env,
            start_new_session=True,
            preexec_fn=preexec or None,
            bufsize=0,
        )
    except BaseException:
        if master is not None:
            os.close(master)
        raise
    finally:
        if slave is not None:
            os.close(slave)  # else the output would never reach EIO
    return popen, master


def take_terminal(cgroup: Cgroup | None) -> None:
    """In the child, a session leader: join the cgroup, make stdin's terminal the
    controlling one."""
    if cgroup is not None:
        cgroup.join()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def guest_environment() -> dict[str, str]:
    """What every process in a sandbox inherits before the sandbox's and the
    request's variables: this machine's environment (a test's command finds the
    same interpreter), without what measures this machine's own Python processes
    (coverage's COVERAGE_* variables): a guest's programs are not the client's
    code, and a coverage hook started in each of them doubled the suite's CPU."""
    return {key: value for key, value in os.environ.items() if not key.startswith("COVERAGE_")}


def terminal_inheritance(reading: Reading) -> dict[str, str]:
    """What a terminal's program inherits: the guest's environment without this
    machine's TERM, which a guest would not share, then the TERM the reading's
    service sets, if any (§11.20)."""
    env = {key: value for key, value in guest_environment().items() if key != "TERM"}
    if reading.pty_term is not None:
        env["TERM"] = reading.pty_term
    return env


class SlidingWindow:
    """At most ``limit`` admitted requests per client address in any ``seconds``.

    Only admitted requests count: a refused one was not served, and counting
    it would keep a client that asks again too early locked out for ever.
    Thread-safe: the server handles each connection in a thread of its own.
    """

    def __init__(self, limit: int, seconds: float):
        self.limit = limit
        self.seconds = seconds
        self._admitted: dict[str, collections.deque[float]] = {}
        self._lock = threading.Lock()

    def admit(self, address: str) -> int | None:
        """None if the request is admitted (and counted), else the whole
        seconds, at least 1, until the oldest admission leaves the window."""
        now = time.monotonic()
        with self._lock:
            admitted = self._admitted.setdefault(address, collections.deque())
            while admitted and admitted[0] <= now - self.seconds:
                admitted.popleft()
            if len(admitted) < self.limit:
                admitted.append(now)
                return None
            return max(1, math.ceil(admitted[0] + self.seconds - now))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@dataclasses.dataclass(eq=False)  # two faults alike are still two faults
class Fault:
    """A queued fault, and how many more requests it applies to (`remaining`,
    the `count` it was queued with), once `skip` more have passed untouched."""

    kind: str
    remaining: int
    status: int = 0
    retry_after: str | None = None
    body: object = None
    after_frames: int = 0
    after_bytes: int = 0
    mid_frame: bool = False
    seconds: float = 0.0
    line: bytes = b""
    last: bool = False
    skip: int = 0
    until: threading.Event | None = None

    def __post_init__(self) -> None:
        if self.remaining < 1:
            raise ValueError("count must be at least 1")
        if self.after_frames < 0 or self.after_bytes < 0 or self.skip < 0:
            raise ValueError("after_frames, after_bytes and skip must be >= 0")


# --------------------------------------------------------------------------
# HTTP plumbing


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default 5 resets connections under 64 clients

    def __init__(self, address: tuple[str, int], app: LocalServer):
        self.app = app
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients vanish mid-stream all the time; only talk when asked to.
        if self.app.verbose:
            super().handle_error(request, client_address)


class _HTTPServerV6(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    """HTTP mechanics; every endpoint lives on LocalServer."""

    protocol_version = "HTTP/1.1"
    server_version = "createos-local-server/1"
    disable_nagle_algorithm = True  # frames and heartbeats must leave at once

    server: _HTTPServer
    # Per request, set by begin() and LocalServer._dispatch().
    raw_path: str
    query: dict[str, str]
    arrived: float
    answered: int | None  # status once the answer started, 0 = dropped
    body: bytes

    def setup(self) -> None:
        super().setup()
        self.server.app._track_connection(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.app._untrack_connection(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.app.verbose:
            sys.stderr.write("local_server: %s %s\n" % (self.address_string(), format % args))

    def do_GET(self) -> None:
        self.server.app._handle(self)

    do_POST = do_PUT = do_DELETE = do_GET

    # -- request -----------------------------------------------------------

    def begin(self) -> None:
        """Parse the request line's target; set per-request attributes."""
        target = urlsplit(self.path)
        self.raw_path = target.path
        self.query = dict(parse_qsl(target.query, keep_blank_values=True))
        self.arrived = time.time()
        self.answered = None

    def read_body(self, limit: int) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked_body(limit)
        length = self.headers.get("Content-Length", "0")
        if not UNSIGNED.match(length):
            self.close_connection = True
            raise ApiError(400, {"body": "invalid Content-Length"})
        if int(length) > limit:
            self.close_connection = True  # the body stays unread
            raise ApiError(413, {"body": "request body larger than %d bytes" % limit})
        return self.rfile.read(int(length))

    def _read_chunked_body(self, limit: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size = self._chunk_size()
            if size == 0:
                return b"".join(parts)
            total += size
            if total > limit:
                self.close_connection = True
                raise ApiError(413, {"body": "request body larger than %d bytes" % limit})
            parts.append(self.rfile.read(size))
            self.rfile.readline(1024)

    def body_pieces(self) -> Iterator[bytes]:
        """The body, piece by piece as it arrives (chunked or of a Content-Length)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = self._chunk_size()
                if size == 0:
                    return
                yield from self._raw_pieces(size)
                self.rfile.readline(1024)
        length = self.headers.get("Content-Length", "0")
        if not UNSIGNED.match(length):
            raise ApiError(400, {"body": "invalid Content-Length"})
        yield from self._raw_pieces(int(length))

    def _chunk_size(self) -> int:
        size_line = self.rfile.readline(1024).split(b";")[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            self.close_connection = True
            raise ApiError(400, {"body": "invalid chunked encoding"}) from None
        if size == 0:
            while self.rfile.readline(1024).strip():  # trailers
                pass
        return size

    def _raw_pieces(self, length: int) -> Iterator[bytes]:
        while length > 0:
            piece = self.rfile.read(min(length, FILE_PIECE))
            if not piece:
                raise ApiError(400, {"body": "the body ended early"})
            length -= len(piece)
            yield piece

    def discard_body(self) -> None:
        """Read and drop the body of a request refused before it was read, so
        that the next request on the connection starts where it should (a body
        that cannot be read closes the connection instead)."""
        try:
            self.body = self.read_body(JSON_BODY_LIMIT)
        except ApiError:
            self.body = b""

    def json_body(self) -> dict[str, Any]:
        try:
            value = json.loads(self.body.decode("utf-8"))
        except ValueError:
            raise ApiError(400, {"body": "not valid JSON"}) from None
        if not isinstance(value, dict):
            raise ApiError(400, {"body": "must be a JSON object"})
        return value

    # -- answers -----------------------------------------------------------

    def _start_answer(
        self, status: int, headers: dict[str, str], recorded_status: int | None = None
    ) -> None:
        self._record(status if recorded_status is None else recorded_status)
        self.send_response(status)
        self.send_header("X-Request-ID", secrets.token_hex(8))
        for name, value in headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")

    def _record(self, status: int) -> None:
        self.answered = status
        record = RequestRecord(
            self.arrived,
            self.command,
            self.raw_path,
            self.query,
            status,
            self.client_address[1],
            tuple(name for name in CREDENTIAL_HEADERS if name in self.headers),
        )
        self.server.app.requests.append(record)

    def send_json(
        self, status: int, payload: object, headers: dict[str, str] | None = None
    ) -> None:
        body = b"" if status in (204, 304) else json.dumps(payload).encode("utf-8")
        self._start_answer(status, headers or {})
        if body:
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def start_raw(self, length: int) -> None:
        """Start a raw body of `length` bytes, which the caller writes."""
        self._start_answer(200, {})
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def start_chunked(self, content_type: str, recorded_status: int) -> None:
        """Start a streamed body: chunked, or (``chunked=False``) until the socket closes."""
        self._start_answer(200, {}, recorded_status)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-store")
        if self.server.app.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

    def write_chunk(self, data: bytes) -> None:
        if self.server.app.chunked:
            self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))
        else:
            self.wfile.write(data)
            self.wfile.flush()

    def write_half_chunk(self, data: bytes) -> None:
        """A chunk header announcing all of data, followed by only its first half."""
        head = b"%X\r\n" % len(data) if self.server.app.chunked else b""
        self.wfile.write(head + data[: len(data) // 2])

    def end_chunked(self) -> None:
        if self.server.app.chunked:
            self.wfile.write(b"0\r\n\r\n")

    def abort(self) -> None:
        """Close the socket abruptly: no further bytes, no terminating chunk."""
        if self.answered is None:
            self._record(0)
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.connection.close()


def match_route(method: str, path: str) -> tuple[str, list[str]]:
    """(endpoint, url-decoded path ids) for a request; ApiError 404/405 otherwise."""
    path_known = False
    for route_method, pattern, endpoint in ROUTES:
        match = pattern.match(path)
        if match:
            path_known = True
            if route_method == method:
                return endpoint, [unquote(group) for group in match.groups()]
    if path_known:
        raise ApiError(405, {"method": "%s is not allowed here" % method})
    raise ApiError(404, {"path": "no such endpoint"})


def check_post_framing(req: _Handler, json: bool = True) -> None:
    """Refuse a POST the way the vendor's control forwarder does (strict mode).

    Every POST must frame its body, ``Content-Length`` (0 when there is
    none) or chunked, else 411; and every POST must be JSON, ``Content-Type:
    application/json`` (parameters such as ``; charset=utf-8`` allowed),
    else 400. That holds for body-less POSTs (``stdin/close``) too: the
    forwarder rejects POSTs whose type is not JSON, and the vendor CLI sends
    ``application/json`` on every request. File upload is a PUT: unchecked;
    a tunnel's upgrade (not `json`) carries no body and no type.
    """
    if req.command != "POST":
        return
    chunked = req.headers.get("Transfer-Encoding", "").lower() == "chunked"
    if req.headers.get("Content-Length") is None and not chunked:
        raise ApiError(411, {"body": "Content-Length required"})
    if not json:
        return
    media_type = req.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(400, {"content_type": "must be application/json"})


def endpoint_of(method: str, path: str) -> str | None:
    try:
        return match_route(method, path)[0]
    except ApiError:
        return None


# --------------------------------------------------------------------------
# Request validation helpers


def uint_param(query: dict[str, str], name: str, default: int | None = None) -> int:
    value = query.get(name)
    if value is None:
        if default is None:
            raise ApiError(400, {name: "required"})
        return default
    if not UNSIGNED.match(value):
        raise ApiError(400, {name: "must be an integer >= 0"})
    return int(value)


def page_of(items: list[Any], query: dict[str, str], default_limit: int) -> dict[str, Any]:
    """One page of a listing in the paginated form of the vendor's other listings.

    ``limit`` (default ``default_limit``, at least 1; more than
    ``LIST_LIMIT_MAX`` is clamped to it) and ``offset`` (default 0) pick the
    page; ``pagination`` echoes both, as used, and the ``total`` of the whole
    listing, so a client follows pages while ``offset + len(page) < total``.
    An offset past the end gives an empty page.
    """
    limit = min(uint_param(query, "limit", default_limit), LIST_LIMIT_MAX)
    if limit < 1:
        raise ApiError(400, {"limit": "must be at least 1"})
    offset = uint_param(query, "offset", 0)
    return {
        "data": items[offset : offset + limit],
        "pagination": {"limit": limit, "offset": offset, "total": len(items)},
    }


def absolute_path(query: dict[str, str]) -> str:
    path = query.get("path", "")
    if not path.startswith("/") or "\0" in path:
        raise ApiError(400, {"path": "must be an absolute path"})
    return path


def command_of(spec: dict[str, Any]) -> tuple[str, list[str]]:
    cmd = spec.get("cmd")
    args = spec.get("args", [])
    if args is None:
        args = []
    if not isinstance(cmd, str) or not cmd:
        raise ApiError(400, {"cmd": "must be a non-empty string"})
    if not isinstance(args, list) or not all(isinstance(arg, str) for arg in args):
        raise ApiError(400, {"args": "must be a list of strings"})
    return cmd, args


def environment_of(
    spec: dict[str, Any], sandbox: Sandbox, inherited: dict[str, str] | None = None
) -> dict[str, str]:
    """The guest's environment (or ``inherited``) + sandbox envs + request env
    (declared keys only, docs/protocol.md §4)."""
    env = spec.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in env.items()
    ):
        raise ApiError(400, {"env": "must be an object of strings"})
    undeclared = sorted(key for key in env if key not in sandbox.envs)
    if undeclared:
        raise ApiError(
            400, {"env": "keys not declared for this sandbox: %s" % ", ".join(undeclared)}
        )
    merged = guest_environment() if inherited is None else dict(inherited)
    merged.update(sandbox.envs)
    merged.update(env)
    return merged


def raise_expired(reading: Reading, oldest_available_seq: int, finished: bool) -> None:
    """The 410 of a connect whose reader's next frame is gone, if this reading sends one
    (``reading.expired_410``); otherwise the stream starts and sends the error frame."""
    if reading.expired_410 == "always" or finished:
        if reading.expired_410_body == "string":
            raise ApiError(410, "output offset expired")
        raise ApiError(
            410, {"error": "output_offset_expired", "oldest_available_seq": oldest_available_seq}
        )


def corrupted(piece: bytes) -> bytes:
    """`piece` with its first byte flipped, or one byte where it is empty."""
    return bytes([piece[0] ^ 0xFF]) + piece[1:] if piece else b"\x00"


def pieces_then(pieces: list[bytes], exc: BaseException) -> Iterator[bytes]:
    """`pieces`, then `exc` raised where they end: a body cut short, read again."""
    yield from pieces
    raise exc


def start_error(exc: BaseException) -> ApiError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return ApiError(400, {"cmd": "cannot start the command: %s" % reason})


# --------------------------------------------------------------------------
# The output stream of GET …/connect


class OutputStream:
    """Writes one connect response: replay, live frames, terminal frame.

    A fault, if any, fires when the stream is about to write a data or
    terminal frame after ``after_frames`` data frames have been written.
    """

    def __init__(
        self, app: LocalServer, req: _Handler, proc: Process, cursor: int, fault: Fault | None
    ):
        self.app = app
        self.req = req
        self.proc = proc
        self.cursor = cursor  # seq of the last data frame this reader has
        self.fault = fault
        self.data_frames = 0
        self.last_write = time.monotonic()
        self.reading = proc.reading
        self.sandbox = app._sandbox(proc.sandbox_id, running=False)
        lifetime = self.reading.stream_lifetime  # recycled after a while, or never
        self.expires = None if lifetime is None else self.last_write + lifetime

    def run(self) -> None:
        dropping = self.fault is not None and self.fault.kind in ("drop", "stall")
        self.req.start_chunked("application/x-ndjson", 0 if dropping else 200)
        try:
            if self.reading.heartbeat_first:
                self._write(HEARTBEAT_LINE)  # before any other frame
            self._follow()
        except OSError:  # the client went away
            self.req.close_connection = True

    def _follow(self) -> None:
        while True:
            frames, final = self._wait_for_output()
            for frame in frames:
                if not self._emit(frame.line):
                    return
                self.data_frames += 1
                self.cursor = frame.seq
            if final is STOP or final is CUT:
                self.req.abort()
                return
            if final is END:
                self.req.end_chunked()
                return
            if final is HEARTBEAT_LINE:
                self._write(final)
            elif isinstance(final, bytes):  # exit or error frame: the stream ends
                if self._emit(final):
                    self.req.end_chunked()
                return

    def _wait_for_output(self) -> tuple[list[Frame], object]:
        """Block until there is something to write.

        Returns (data frames, final): final is None after data frames, else
        HEARTBEAT_LINE, a terminal (exit / error) line, STOP when the server
        is stopping, halted() once the sandbox is paused or destroyed, END
        when the stream has lived its time (reading.stream_lifetime) and CUT
        when a live reader fell behind the journal (reading.live_eviction).
        """
        proc = self.proc
        with proc.cond:
            while True:
                if self.sandbox.status != "running":  # paused or destroyed: the host is gone
                    return [], self.halted()
                if self.cursor < proc.evicted_through:
                    if self.reading.live_eviction == "cut" and self.data_frames:
                        return [], CUT  # the reader learns of it when it reconnects
                    return [], frame_line(
                        {
                            "type": "error",
                            "error": "output_offset_expired",
                            "oldest_available_seq": proc.evicted_through + 1,
                        }
                    )
                frames = proc.frames_after(self.cursor)
                if frames:
                    return frames, None
                now = time.monotonic()
                if self.expires is not None and now >= self.expires:
                    return [], END
                if proc.output_finished:
                    return [], proc.exit_line()
                if self.app._stopping.is_set():
                    return [], STOP
                idle = self.last_write + self.app.heartbeat_interval - now
                if idle <= 0:
                    return [], HEARTBEAT_LINE
                proc.cond.wait(idle if self.expires is None else min(idle, self.expires - now))

    def _emit(self, line: bytes) -> bool:
        """Write a data or terminal frame, firing the fault first if due."""
        fault = self.fault
        if fault is not None and self.data_frames >= fault.after_frames:
            self.fault = None
            if fault.kind == "corrupt":
                self._write(fault.line if fault.line.endswith(b"\n") else fault.line + b"\n")
                if fault.last:
                    self.req.end_chunked()
                    return False
            elif fault.kind == "end":
                self.req.end_chunked()
                return False
            elif fault.kind == "stall":
                self.app._stopping.wait(fault.seconds)
                self.req.abort()
                return False
            elif fault.kind in LIFECYCLE_FAULTS:
                self.app.change_sandbox(fault.kind, self.proc.sandbox_id)
                if self.halted() is END:
                    self.req.end_chunked()
                else:
                    self.req.abort()
                return False
            else:  # drop
                if fault.mid_frame:
                    self.req.write_half_chunk(line)
                self.req.abort()
                return False
        self._write(line)
        return True

    def _write(self, line: bytes) -> None:
        self.req.write_chunk(line)
        self.last_write = time.monotonic()

    def halted(self) -> object:
        """How a stream ends when its sandbox stops running (reading.paused_stream)."""
        return CUT if self.reading.paused_stream == "reset" else END


# --------------------------------------------------------------------------
# The answer of a streamed exec (POST …/exec?stream=true)

EXEC_STOP_CHECK = 0.2  # seconds a silent streamed exec waits before it looks for a stop


def shell_status(returncode: int) -> int:
    """An exec's exit_code: a signal death as 128 + N, the shell's convention."""
    return returncode if returncode >= 0 else 128 - returncode


class ExecStream:
    """Relays one running exec as NDJSON lines (docs/protocol.md §6):
    ``{"stdout": text}`` and ``{"stderr": text}`` as the command writes them,
    ``{"hb": true}`` after a heartbeat interval without a line, and
    ``{"exit_code": n}`` last, once both pipes ended and the command exited.

    A thread per pipe puts what it reads (at most ``FRAME_LIMIT`` bytes at a
    time) in one queue, so the two streams keep the order they were written
    in; each is decoded incrementally, so that a character split between two
    reads arrives whole. A fault changes what is sent (see
    ``drop_exec_stream``, ``corrupt_exec_stream``, ``lose_exec_response``). A
    stream broken before the command's end, by a fault, its client or the
    server's stop, SIGKILLs the command's process group.
    """

    def __init__(
        self,
        app: LocalServer,
        req: _Handler,
        child: subprocess.Popen[bytes],
        stdin: bytes,
        fault: Fault | None,
    ):
        self.app = app
        self.req = req
        self.child = child
        self.fault_kind = None if fault is None else fault.kind
        self.pieces: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.decoders = {
            stream: codecs.getincrementaldecoder("utf-8")("replace")
            for stream in ("stdout", "stderr")
        }
        # The stdout characters still to send before a drop fault breaks the stream.
        self.stdout_left = fault.after_bytes if fault and fault.kind == "drop" else math.inf
        self.corrupting = self.fault_kind == "corrupt"
        self.past_header = False  # the stdout text went past its first newline
        self.last_write = time.monotonic()
        assert child.stdin and child.stdout and child.stderr  # started with three PIPEs
        feed = (self._feed, (child.stdin, stdin))
        pumps = [
            (self._pump, (pipe, name))
            for pipe, name in ((child.stdout, "stdout"), (child.stderr, "stderr"))
        ]
        for target, args in [feed] + pumps:
            threading.Thread(target=target, args=args, daemon=True).start()

    @staticmethod
    def _feed(pipe: IO[bytes], data: bytes) -> None:
        with contextlib.suppress(OSError), pipe:  # a command may leave its stdin unread
            pipe.write(data)

    def _pump(self, pipe: IO[bytes], stream: str) -> None:
        """Queue what one pipe gives until its end, queued as an empty piece."""
        with pipe:
            while True:
                try:
                    data = os.read(pipe.fileno(), FRAME_LIMIT)
                except OSError:
                    data = b""
                self.pieces.put((stream, data))
                if not data:
                    return

    def run(self) -> None:
        kind = self.fault_kind
        self.req.start_chunked("application/x-ndjson", 0 if kind in ("drop", "lose") else 200)
        try:
            whole = self._relay()
            if not whole:
                self._kill()
            code = self.child.wait()
            if whole and kind in (None, "corrupt"):
                self._write({"exit_code": shell_status(code)})
                self.req.end_chunked()
            else:
                self.req.abort()  # without the exit_code line
        except OSError:  # the client went away
            self.req.close_connection = True
        finally:
            self._kill()  # nothing once the command was reaped
            self.child.wait()

    def _relay(self) -> bool:
        """Send the output until both pipes ended (True), or until the stream is to
        break: a drop fault's characters sent, or the server stopping (False)."""
        open_pipes = 2
        while open_pipes:
            idle = self.last_write + self.app.heartbeat_interval - time.monotonic()
            try:
                stream, data = self.pieces.get(timeout=max(0.0, min(idle, EXEC_STOP_CHECK)))
            except queue.Empty:
                if self.app._stopping.is_set():
                    return False
                if idle <= 0:
                    self._write({"hb": True})
                continue
            open_pipes -= not data
            text = self.decoders[stream].decode(data, final=not data)
            if text and not self._send(stream, text):
                return False
        return True

    def _send(self, stream: str, text: str) -> bool:
        """Send one piece of text; False once a drop fault's characters are sent."""
        if stream == "stdout":
            if self.corrupting:
                text = self._corrupted(text)
            if len(text) >= self.stdout_left:
                if self.stdout_left:
                    self._write({stream: text[: int(self.stdout_left)]})
                return False
            self.stdout_left -= len(text)
        self._write({stream: text})
        return True

    def _corrupted(self, text: str) -> str:
        """`text` with the first character after the stdout's first newline changed
        to "A" ("B" where it is "A"), once: the byte of a payload after a header."""
        start = 0
        if not self.past_header:
            newline = text.find("\n")
            if newline < 0:
                return text
            self.past_header = True
            start = newline + 1
        if start == len(text):
            return text
        self.corrupting = False
        return text[:start] + ("B" if text[start] == "A" else "A") + text[start + 1 :]

    def _write(self, line: dict[str, Any]) -> None:
        self.req.write_chunk(frame_line(line))
        self.last_write = time.monotonic()

    def _kill(self) -> None:
        """SIGKILL the command's process group while its leader is unreaped (its
        id cannot have been reused then)."""
        if self.child.returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(self.child.pid, signal.SIGKILL)


# --------------------------------------------------------------------------
# The server


class LocalServer:
    """A CreateOS-compatible server on loopback that RUNS COMMANDS ON THIS MACHINE.

    ``reading`` (a ``Reading``, or the name of one of ``READINGS``) says how
    it answers where docs/protocol.md (§11) leaves the real service open, one
    field per question. ``CONSERVATIVE`` (the default, docs/protocol.md §9) and
    ``ALTERNATIVE`` (which flips every unknown whose other answer is
    plausible and that a client must survive) are two values of it; any
    field can be set alone (``dataclasses.replace``, ``--set FIELD=VALUE``).
    The fields, conservative value first:

    - ``create_status``: 200 or **201** to a create (§11.1);
    - ``heartbeat_interval``: seconds of stream silence before a heartbeat
      frame, 5 (§11.2); the ``heartbeat_interval`` argument, when given,
      overrides it (tests use short ones);
    - ``heartbeat_first``: whether every connect stream starts with a
      heartbeat, before any replayed frame (§11.2);
    - ``stream_lifetime``: None, or seconds (2) after which a connect stream
      with nothing to send ends cleanly without an exit frame, as a
      recycling proxy would (§11.2);
    - ``expired_410``: a connect whose ``after`` is behind the journal gets
      a 410 ``"always"``, or only ``"when_final"`` (the exit frame is due):
      while output is still produced it gets a 200 stream whose first frame
      (after any heartbeat) is the ``output_offset_expired`` error frame
      (§11.3);
    - ``expired_410_body``: that 410's ``data``: the ``"map"``
      ``{"error": "output_offset_expired", "oldest_available_seq": N}``, or
      the plain ``"string"`` ``"output offset expired"``, which names no
      seq, as the vendor CLI's reading of it suggests (§11.3);
    - ``live_eviction``: a live reader that falls behind the journal gets
      the ``"error_frame"``, or has its connection ``"cut"`` without any
      frame and meets the error frame or the 410 when it reconnects (a
      reader sent no data frame yet gets the error frame at once) (§11.3);
    - ``output_bytes``: the record's ``output.bytes`` counts ``"raw"`` bytes
      or ``"base64"`` text (§11.4);
    - ``record_omits_empty``: whether process records omit null and empty
      fields (``exit_code``, ``signal``, ``finished_at``…) as Go's
      ``omitempty`` does, instead of sending null (§5.2);
    - ``oldest_seq_before_output``: the record's ``output.oldest_seq``
      before any output, 0 or 1 (``newest_seq`` is 0) (§5.2);
    - ``exit_after``: the exit frame follows the ``"leader"`` (reaped, both
      pipes at EOF) or waits for the whole ``"tree"`` (process group empty)
      too (§11.5);
    - ``signal_spelling``: death by signal is spelled ``"SIGNAME"``
      (``SIGKILL``) or ``"go"`` (``"killed"``, ``"terminated"``, ``"signal
      34"``…), in exit frames and records (§11.7);
    - ``signal_exit_code``: the ``exit_code`` beside a signal: None (null or
      absent) or -1 (§11.7);
    - ``exit_frame_seq``: whether the exit frame carries a ``seq``, the next
      number of the journal's counter (§11.8);
    - ``eof_data_frame``: whether each output pipe's EOF is journalled as an
      empty data frame (``data_base64: ""``, a seq of its own) (§11.8);
    - ``stdin_close_idempotent``: a second ``stdin/close``, or one after
      exit, answers 409 or (True) 200 (§11.10);
    - ``signal_after_exit``: a ``signal`` after the leader exited answers
      409 or is a 200 no-op (§11.10);
    - ``signal_target``: ``signal`` reaches the process ``"group"``, or the
      ``"leader"`` alone: a background child it started survives a SIGTERM
      (§11.10);
    - ``wait_default_scope`` and ``wait_default_ms``: what a ``wait`` that
      names no ``scope`` (PY's ``wait(pid)``, Java, Rust; an empty one from
      Go) or no ``timeout_ms`` gets: ``"leader"``, 30 000 ms, the duration
      clients use, in both readings (§11.11);
    - ``wait_cap``: None, or the most seconds (1) a ``wait`` long-polls
      whatever ``timeout_ms`` asks, before its 408 (§11.11);
    - ``after_default``: the ``after`` of a connect that names none (the
      vendor CLI leaves it out when it is 0): 0 in both readings (§5.4);
    - ``delete_default_grace_ms``: the grace of a DELETE that names no
      ``grace_ms``: 1000 in both readings (§11.12);
    - ``delete_forgets``: whether a DELETE forgets the process: afterwards
      get, connect, wait, input, signal and a second DELETE answer 404 and
      the listing omits it (``processes()`` and ``process()`` still show it
      to tests) (§11.12);
    - ``upload_creates_parents``: whether a file upload answers 404 to a
      path whose parent directory is missing (the SDK docs' reading), or
      creates the missing parents (the vendor CLI's) (§11.16);
    - ``listing``: the process listing is ``"unpaginated"``,
      ``{"processes": [...]}`` ignoring ``limit`` and ``offset``, or
      ``"paginated"`` like the vendor's other listings: ``{"data": [...],
      "pagination": {"limit", "offset", "total"}}``, taking ``limit``
      (default ``list_page_size``, at most ``LIST_LIMIT_MAX``) and
      ``offset`` (default 0) (§5.3);
    - ``pty_term``: the ``TERM`` a PTY process gets when neither the sandbox
      nor the request sets one: None (none at all) or ``"xterm"`` (§11.20);
    - ``pty_default_size``: the size of a terminal created with ``pty: {}``
      (or without ``rows`` or ``cols``): ``"24x80"`` or ``"0x0"`` (§11.20);
    - ``pty_signal_target``: ``signal`` to a PTY process reaches the
      terminal's ``"foreground"`` process group, as the vendor CLI's help
      says, or the ``"leader"`` alone (§11.20);
    - ``idle_activity``: what keeps a sandbox from its idle auto-pause
      (``auto_pause_after``): ``"requests"`` naming it only, or open
      ``"streams"`` too (§11.14);
    - ``paused_answer``: what process, files and exec endpoints answer while
      the sandbox is paused or resuming: 409 or **404** (503 by ``--set``)
      (§11.17);
    - ``paused_stream``: an open connect stream, when its sandbox is paused or
      destroyed, is ``"reset"`` or ends cleanly (``"eof"``) without an exit
      frame (§11.17);
    - ``resume_keeps_processes``: after a resume the trees go on with their
      journals and seq, or (False) the process registry is lost: its trees
      are killed and their endpoints answer 404 (§11.18);
    - ``destroyed_view``: the view of a destroyed sandbox is 404, or **200**
      with ``status: "destroyed"`` (§11.19); its process endpoints are 404
      in both.

    ``file_size_limit`` is the largest file an upload may carry (500 MB,
    as the vendor says): a larger one is refused with **413**, before its
    body is read when its ``Content-Length`` says so.

    The sandbox's lifecycle (docs/protocol.md §4.1): ``pause()`` freezes every
    tree (``cgroup.freeze``, or SIGSTOP to a process group) and cuts its
    streams; ``resume()`` makes it ``resuming`` for ``resume_seconds``, then
    running; ``destroy()`` kills every tree; ``pause_at()`` and
    ``destroy_at()`` do it at a chosen moment; the HTTP endpoints do the same.
    ``auto_pause_after``: None, or seconds of idleness after which a running
    sandbox is paused.

    ``list_page_size`` is the default page size of that paginated listing
    (100), small in tests so that a few processes fill several pages.

    ``cgroups=True`` (the default) puts each managed process, before it runs
    anything, in a cgroup v2 of its own where the server may (see
    ``server_cgroup``; ``containment`` says which it got): the tree that
    ``tree_exited`` and ``wait?scope=tree`` wait for and that DELETE and
    ``stop()`` end is then every process of that cgroup, as on the service
    (docs/protocol.md §5.2), a double-forked daemon included: DELETE sends SIGTERM to
    each, waits the grace period, then ``cgroup.kill``. Elsewhere, or with
    ``cgroups=False``, it is the leader's process group, which a descendant
    leaves with ``setsid``. A ``signal`` reaches the process group either way.

    ``strict=True`` frames POSTs as the vendor's control forwarder does
    (whatever the reading): 411 to a POST that names no ``Content-Length`` (and is
    not chunked), 400 to a POST that is not ``application/json``, body-less
    ones included (see ``check_post_framing``). It is checked after the
    route, before the API key.

    ``rate_limit=(N, seconds)`` admits at most N requests from one client
    address (the peer IP) in any sliding window of that many seconds, as the
    service's per-IP limit does (docs/protocol.md §3). Every request counts at its
    arrival, whatever its path (a connect stream once); only admitted ones
    count (see ``SlidingWindow``). Others get **429** with ``Retry-After``
    (whole seconds until a place frees, at least 1) and a JSend fail, before
    anything else is looked at: no process is created, no fault is consumed.
    They are recorded in ``requests`` like every answer. ``None`` (the
    default): no limit.

    ``streamed_exec=True`` (the default) answers an exec with ``?stream=true``
    (or ``"stream": true``) as a stream of NDJSON lines, as the service
    documents it (see ``ExecStream``); ``False`` answers it 404 with a JSend
    fail, as some control planes do (docs/protocol.md §6).
    """

    def __init__(
        self,
        *,
        api_key: str = DEFAULT_API_KEY,
        host: str = "127.0.0.1",
        port: int = 0,
        heartbeat_interval: float | None = None,
        journal_limit: int = 1024 * 1024,
        frame_limit: int = FRAME_LIMIT,
        reading: Reading | str = CONSERVATIVE,
        chunked: bool = True,
        list_page_size: int = 100,
        strict: bool = False,
        rate_limit: tuple[int, float] | None = None,
        file_size_limit: int = FILE_SIZE_LIMIT,
        cgroups: bool = True,
        auto_pause_after: float | None = None,
        resume_seconds: float = 0.2,
        streamed_exec: bool = True,
        verbose: bool = False,
    ):
        reading = reading_of(reading)
        if auto_pause_after is not None and not auto_pause_after > 0:
            raise ValueError("auto_pause_after must be positive")
        if not resume_seconds >= 0:
            raise ValueError("resume_seconds must be >= 0")
        if heartbeat_interval is None:
            heartbeat_interval = reading.heartbeat_interval
        if not 1 <= list_page_size <= LIST_LIMIT_MAX:
            raise ValueError("list_page_size must be from 1 to %d" % LIST_LIMIT_MAX)
        if rate_limit is not None:
            count, seconds = rate_limit
            if not (isinstance(count, int) and count >= 1 and 0 < seconds < math.inf):
                raise ValueError("rate_limit must be (requests >= 1, seconds > 0)")
        if heartbeat_interval <= 0:
            raise ValueError("heartbeat_interval must be positive")
        if journal_limit < 1:
            raise ValueError("journal_limit must be positive")
        if file_size_limit < 0:
            raise ValueError("file_size_limit must be >= 0")
        if not 1 <= frame_limit <= FRAME_LIMIT:
            raise ValueError("frame_limit must be from 1 to %d" % FRAME_LIMIT)
        self.api_key = api_key
        self.host = loopback_host(host)
        self.port = port
        self.heartbeat_interval = heartbeat_interval
        self.journal_limit = journal_limit
        # Tests use a tiny frame_limit for a known number of frames: a process
        # that writes N bytes at once is journalled in ceil(N / frame_limit) frames.
        self.frame_limit = frame_limit
        self.reading = reading  # its heartbeat_interval is overridden by the one above
        # chunked=False answers `connect` as a proxy that removes the chunking
        # would: no Transfer-Encoding, the body ends when the connection closes.
        self.chunked = chunked
        self.list_page_size = list_page_size
        self.strict = strict
        self._rate_window = None if rate_limit is None else SlidingWindow(*rate_limit)
        self.file_size_limit = file_size_limit
        self.cgroups = cgroups
        self.auto_pause_after = auto_pause_after
        self.resume_seconds = resume_seconds
        self.streamed_exec = streamed_exec
        self._cgroup: Cgroup | None = None  # the parent of the processes' cgroups, once started
        self.verbose = verbose
        self.url = ""
        self.requests: list[RequestRecord] = []
        # The bytes the files endpoints received (files_put) and sent (files_get).
        self.file_bytes: collections.Counter[str] = collections.Counter()

        self._lock = threading.Lock()  # sandboxes, processes, faults, connections
        self._sandboxes = {DEFAULT_SANDBOX: Sandbox(DEFAULT_SANDBOX, {})}
        self._processes: dict[str, Process] = {}
        self._faults: dict[tuple[str, bool], collections.deque[Fault]] = {}
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> LocalServer:
        if self._httpd is not None or self._stopping.is_set():
            raise RuntimeError("a LocalServer can be started once")
        self._listen(self.port)
        self._cgroup = server_cgroup() if self.cgroups else None
        port = self._httpd.server_address[1]  # type: ignore[union-attr]
        host = "[%s]" % self.host if ":" in self.host else self.host
        self.url = "http://%s:%d" % (host, port)
        if self.auto_pause_after is not None:
            threading.Thread(target=self._auto_pause, daemon=True, name="auto-pause").start()
        return self

    def _listen(self, port: int) -> None:
        server_class = _HTTPServerV6 if ":" in self.host else _HTTPServer
        self._httpd = server_class((self.host, port), self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            daemon=True,
            name="local-server",
        )
        self._thread.start()

    def outage(self, seconds: float) -> threading.Thread:
        """The API goes down for `seconds`, the sandbox and its processes running on:
        once this returns every connection is refused and every open one was cut;
        then it serves again on the same port (the returned thread ends then)."""
        assert self._httpd is not None and self._thread is not None, "not started"
        port = self._httpd.server_address[1]
        with self._lock:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join()
            connections = list(self._connections)
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

        def back() -> None:
            self._stopping.wait(seconds)
            with self._lock:
                if not self._stopping.is_set():
                    self._listen(port)

        comeback = threading.Thread(target=back, daemon=True, name="outage")
        comeback.start()
        return comeback

    @property
    def containment(self) -> str:
        """What a managed process's tree is: ``"cgroup"`` or ``"process group"``."""
        return "process group" if self._cgroup is None else "cgroup"

    def stop(self) -> None:
        """Stop serving, SIGKILL every remaining tree, remove its cgroups and the temp dirs."""
        if self._httpd is None or self._thread is None or self._stopping.is_set():
            return
        with self._lock:  # an outage may be listening again
            self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
        with self._lock:
            processes = list(self._processes.values())
            connections = dict(self._connections)
        for proc in processes:
            proc.kill_tree(signal.SIGKILL)
        self._await(
            lambda: all(proc.tree_exited() for proc in processes), KILL_TIMEOUT, stoppable=False
        )
        if self._cgroup is not None:
            self._cgroup.remove()  # each tree removed its own once empty
        remove_files_left(processes)
        for proc in processes:
            with proc.cond:
                proc.cond.notify_all()  # wake streams so they see _stopping
            proc.join(1.0)
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes handlers idle in keep-alive
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for thread in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        for sandbox in self._sandboxes.values():
            sandbox.remove_workdir()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _track_connection(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections[sock] = threading.current_thread()

    def _untrack_connection(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.pop(sock, None)

    # -- sandboxes and inspection ----------------------------------------------

    def add_sandbox(self, sandbox_id: str, *, envs: dict[str, str] | None = None) -> None:
        """Create a sandbox; `envs` are exported into its commands and are the only
        keys a request's `env` may override (docs/protocol.md §4)."""
        envs = dict(envs or {})
        if not SANDBOX_ID.match(sandbox_id):
            raise ValueError("invalid sandbox id %r" % sandbox_id)
        for key, value in envs.items():
            if not ENV_KEY.match(key) or not isinstance(value, str):
                raise ValueError("invalid env entry %r" % key)
        with self._lock:
            if sandbox_id in self._sandboxes:
                raise ValueError("sandbox %r already exists" % sandbox_id)
            self._sandboxes[sandbox_id] = Sandbox(sandbox_id, envs)

    def processes(self, sandbox_id: str = DEFAULT_SANDBOX) -> list[dict[str, Any]]:
        """Records of the sandbox's processes, as GET …/processes lists them
        (deleted ones included, which a reading that forgets them no longer lists)."""
        with self._lock:
            if sandbox_id not in self._sandboxes:
                raise KeyError(sandbox_id)
            procs = [p for p in self._processes.values() if p.sandbox_id == sandbox_id]
        groups = live_process_groups() if self._cgroup is None else None  # one scan for all
        return [proc.record(groups) for proc in procs]

    def process(self, process_id: str) -> dict[str, Any]:
        return self._get_process(process_id).record()

    def journalled(self, process_id: str) -> list[tuple[str, bytes]]:
        """The data frames the journal holds, oldest first, as (stream, data): a
        frame holds what one read of a pipe brought, which a loaded machine can
        make two writes of the program."""
        proc = self._get_process(process_id)
        with proc.cond:
            frames = [json.loads(frame.line) for frame in proc.journal]
        return [(frame["stream"], base64.b64decode(frame["data_base64"])) for frame in frames]

    def tree_alive(self, process_id: str) -> bool:
        """Whether the leader or any non-zombie process of its tree lives."""
        return not self._get_process(process_id).tree_exited()

    def wait_tree_gone(self, process_id: str, timeout: float = 10.0) -> bool:
        """Poll until the process tree is gone; False if it outlived `timeout` seconds."""
        proc = self._get_process(process_id)
        return self._await(proc.tree_exited, timeout, stoppable=False)

    def requests_to(self, endpoint: str) -> list[RequestRecord]:
        """The recorded requests of one endpoint ("create", "connect", …)."""
        return [r for r in list(self.requests) if endpoint_of(r.method, r.path) == endpoint]

    def _get_process(self, process_id: str) -> Process:
        with self._lock:
            return self._processes[process_id]

    def sandbox_status(self, sandbox_id: str = DEFAULT_SANDBOX) -> str:
        with self._lock:
            return self._sandboxes[sandbox_id].status

    # -- the sandbox's lifecycle (docs/protocol.md §4.1) ---------------------------

    def pause(self, sandbox_id: str = DEFAULT_SANDBOX) -> bool:
        """Freeze every tree of a running sandbox and cut its streams (False: not running)."""
        if not self._move(sandbox_id, ("running",), "paused"):
            return False
        for proc in self._processes_of(sandbox_id):
            proc.freeze(True)
        return True

    def resume(self, sandbox_id: str = DEFAULT_SANDBOX) -> bool:
        """Bring a paused sandbox back, ``resume_seconds`` later (False: not paused).
        Its trees go on, or, when the reading loses the process registry, are gone."""
        if not self._move(sandbox_id, ("paused",), "resuming"):
            return False
        timer = threading.Timer(self.resume_seconds, self._resumed, (sandbox_id,))
        timer.daemon = True
        timer.start()
        return True

    def destroy(self, sandbox_id: str = DEFAULT_SANDBOX) -> bool:
        """Kill every tree of the sandbox and cut its streams (False: destroyed already)."""
        if not self._move(sandbox_id, ("running", "paused", "resuming"), "destroyed"):
            return False
        procs = self._processes_of(sandbox_id)
        for proc in procs:
            proc.kill_tree(signal.SIGKILL)
            proc.freeze(False)  # a frozen tree dies once thawed
        remove_files_left(procs)
        return True

    def change_sandbox(self, change: str, sandbox_id: str = DEFAULT_SANDBOX) -> bool:
        """``pause``, ``resume`` or ``destroy`` the sandbox (a lifecycle fault's change)."""
        return bool(getattr(self, change)(sandbox_id))

    def _resumed(self, sandbox_id: str) -> None:
        procs = self._processes_of(sandbox_id)
        if not self.reading.resume_keeps_processes:
            for proc in procs:
                proc.lost = True  # as E2B users saw: the registry is empty after a resume
                proc.kill_tree(signal.SIGKILL)
        for proc in procs:
            proc.freeze(False)
        self._move(sandbox_id, ("resuming",), "running")

    def _move(self, sandbox_id: str, sources: tuple[str, ...], target: str) -> bool:
        with self._lock:
            sandbox = self._sandboxes[sandbox_id]
            if sandbox.status not in sources:
                return False
            sandbox.status = target
            sandbox.last_active = time.monotonic()
            return True

    def _processes_of(self, sandbox_id: str) -> list[Process]:
        with self._lock:
            return [p for p in self._processes.values() if p.sandbox_id == sandbox_id]

    def _auto_pause(self) -> None:
        """Pause every running sandbox idle for auto_pause_after seconds: no request,
        nor (reading.idle_activity "streams") an open stream, meanwhile."""
        limit = self.auto_pause_after or 0.0
        while not self._stopping.wait(min(limit / 10, POLL_INTERVAL * 5)):
            now = time.monotonic()
            with self._lock:
                sandboxes = list(self._sandboxes.values())
            for sandbox in sandboxes:
                if sandbox.open_streams and self.reading.idle_activity == "streams":
                    sandbox.last_active = now
                elif sandbox.status == "running" and now - sandbox.last_active >= limit:
                    self.pause(sandbox.id)

    # -- fault injection -----------------------------------------------------

    def fail(
        self,
        endpoint: str,
        status: int,
        *,
        count: int = 1,
        retry_after: str | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        """Answer the next `count` requests of `endpoint` with `status`, doing nothing.

        The body is a JSend fail (< 500) or error (>= 500) unless `body` is
        given; 3xx answers also carry a Location to a foreign host.
        """
        if not 200 <= status <= 599:
            raise ValueError("status must be between 200 and 599")
        self._queue(
            endpoint, Fault("status", count, status=status, retry_after=retry_after, body=body)
        )

    def drop_stream(
        self, *, after_frames: int = 0, mid_frame: bool = False, count: int = 1
    ) -> None:
        """Break the socket (no terminating chunk) before the next data or final frame
        once `after_frames` data frames were sent; `mid_frame` sends half of it first."""
        self._queue("connect", Fault("drop", count, after_frames=after_frames, mid_frame=mid_frame))

    def end_stream(self, *, after_frames: int = 0, count: int = 1) -> None:
        """Same trigger as drop_stream, but end the body cleanly without the exit frame."""
        self._queue("connect", Fault("end", count, after_frames=after_frames))

    def stall_stream(self, *, after_frames: int = 0, seconds: float = 60.0, count: int = 1) -> None:
        """Same trigger as drop_stream: send nothing (no heartbeat) for `seconds`, then break."""
        self._queue("connect", Fault("stall", count, after_frames=after_frames, seconds=seconds))

    def corrupt_stream(
        self, line: bytes, *, after_frames: int = 0, count: int = 1, last: bool = False
    ) -> None:
        """Same trigger as drop_stream: insert `line` as a chunk of its own, then go on;
        or, `last`, end the body cleanly after it, as after an exit frame."""
        fault = Fault("corrupt", count, after_frames=after_frames, line=bytes(line), last=last)
        self._queue("connect", fault)

    def replay_ignoring_after(self, *, count: int = 1) -> None:
        """Start the next connects at the oldest retained frame, whatever `after` says."""
        self._queue("connect", Fault("replay", count))

    def lose_create_response(self, *, count: int = 1) -> None:
        """Start the next created processes, then close the socket without an answer."""
        self._queue("create", Fault("lose", count))

    def refuse_created(self, *, count: int = 1, retry_after: str | None = None) -> None:
        """Start the next created processes, then answer 429 (with `retry_after`), as a
        proxy does that forwarded the creation and then refused to pass its answer on."""
        self._queue("create", Fault("refuse", count, status=429, retry_after=retry_after))

    def lose_input_response(self, *, count: int = 1, seconds: float = 0.0) -> None:
        """Write the next `count` inputs to the process's stdin, then close the socket
        without an answer, after `seconds` (longer than a client's read timeout: a
        timeout rather than a reset)."""
        if seconds < 0:
            raise ValueError("seconds must be >= 0")
        self._queue("input", Fault("lose", count, seconds=seconds))

    def drop_upload(self, *, after_bytes: int = 0, count: int = 1, skip: int = 0) -> None:
        """Write the first `after_bytes` bytes of the next uploads (after `skip` more
        whole ones: the pieces of one file) to their file (as a cut upload leaves it),
        then break the connection without an answer."""
        self._queue("files_put", Fault("drop", count, after_bytes=after_bytes, skip=skip))

    def hold_cut_upload(self, until: threading.Event) -> None:
        """Read the next upload's body whole before its file is opened; when its
        connection ends before the body does (its client gave up on it), open and
        write the file, as a cut upload leaves it, only once `until` is set (or a
        minute passed): a service that gets to an abandoned upload after what its
        client sent next (docs/protocol.md 7)."""
        self._queue("files_put", Fault("hold", 1, seconds=60.0, until=until))

    def drop_download(self, *, after_bytes: int = 0, count: int = 1, skip: int = 0) -> None:
        """Answer the next downloads (after `skip` more whole ones) with a Content-Length
        for the whole file, send its first `after_bytes` bytes, then break the connection."""
        self._queue("files_get", Fault("drop", count, after_bytes=after_bytes, skip=skip))

    def corrupt_files(self, endpoint: str, *, count: int = 1, skip: int = 0) -> None:
        """Flip the first byte of the next uploads (``files_put``) or downloads
        (``files_get``), after `skip` more whole ones, or add one to an empty file,
        as a faulty proxy or disk would."""
        if endpoint not in ("files_put", "files_get"):
            raise ValueError("corrupt_files takes files_put or files_get")
        self._queue(endpoint, Fault("corrupt", count, skip=skip))

    def lose_exec_response(self, *, count: int = 1) -> None:
        """Run the next execs to their end, then close the socket without an answer:
        a streamed one sends every line but its ``exit_code`` line."""
        self._queue("exec", Fault("lose", count))

    def drop_exec_stream(self, *, after_bytes: int = 0, count: int = 1, skip: int = 0) -> None:
        """Send only the first `after_bytes` characters of the stdout of the next
        streamed execs (after `skip` more whole ones), the last ``stdout`` line cut
        to fit, then break the connection, without an ``exit_code`` line; the
        command's process group is then SIGKILLed. A buffered exec leaves it queued."""
        self._queue("exec", Fault("drop", count, after_bytes=after_bytes, skip=skip))

    def corrupt_exec_stream(self, *, count: int = 1, skip: int = 0) -> None:
        """Change one character of the stdout of the next streamed execs (after `skip`
        more whole ones): the first after its first newline (after a header line)
        becomes "A", or "B" where it is "A"; the rest, ``exit_code`` included, as
        usual. A buffered exec leaves it queued."""
        self._queue("exec", Fault("corrupt", count, skip=skip))

    def pause_at(self, endpoint: str, *, after_frames: int = 0, count: int = 1) -> None:
        """Pause the sandbox when the next `count` requests of `endpoint` arrive, which
        then meet it paused; on `connect`, with drop_stream's trigger, cutting the stream."""
        self._queue(endpoint, Fault("pause", count, after_frames=after_frames))

    def destroy_at(self, endpoint: str, *, after_frames: int = 0) -> None:
        """As pause_at, but destroy the sandbox."""
        self._queue(endpoint, Fault("destroy", 1, after_frames=after_frames))

    def evict(self, process_id: str) -> None:
        """Drop every retained data frame of the process (older cursors then get 410)."""
        self._get_process(process_id).evict_all()

    def evicted_bytes(self, process_id: str) -> int:
        """The bytes of output the process's journal has dropped, by eviction or evict()."""
        process = self._get_process(process_id)
        with process.cond:
            return process.evicted_bytes

    def _queue(self, endpoint: str, fault: Fault) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError("unknown endpoint %r" % endpoint)
        with self._lock:
            self._fault_queue(endpoint, fault.kind).append(fault)

    def _fault_queue(self, endpoint: str, kind: str) -> collections.deque[Fault]:
        """The FIFO that faults of this kind wait in (caller holds _lock)."""
        return self._faults.setdefault((endpoint, kind == "replay"), collections.deque())

    def _take_fault(self, endpoint: str, kinds: tuple[str, ...]) -> Fault | None:
        """Consume one use of the oldest queued fault if it is of one of these kinds."""
        with self._lock:
            queue = self._fault_queue(endpoint, kinds[0])
            if not queue or queue[0].kind not in kinds:
                return None
            fault = queue[0]
            if fault.skip:
                fault.skip -= 1
                return None
            fault.remaining -= 1
            if fault.remaining == 0:
                queue.popleft()
            return fault

    # -- request dispatch ------------------------------------------------------

    def _handle(self, req: _Handler) -> None:
        req.begin()
        try:
            self._dispatch(req)
        except ApiError as exc:
            req.send_json(exc.status, envelope(exc.status, exc.data), exc.headers)
        except Exception:  # a bug here must not kill the connection silently
            if self.verbose:
                traceback.print_exc()
            if req.answered is None:
                req.send_json(500, envelope(500, "internal error in the local server"))
            else:
                req.abort()

    def _dispatch(self, req: _Handler) -> None:
        self._admit(req)
        try:
            endpoint, ids = match_route(req.command, req.raw_path)
        except ApiError:
            req.body = req.read_body(JSON_BODY_LIMIT)  # keep the connection in sync
            raise
        if endpoint == "files_put":
            # Its body is the file, streamed to disk by the endpoint: a refusal
            # before it is read closes the connection.
            req.body = b""
            req.close_connection = True
        else:
            req.body = req.read_body(JSON_BODY_LIMIT)
        if self.strict:
            check_post_framing(req, json=endpoint != "tunnel")
        if endpoint == "healthz":
            req.send_json(200, envelope(200, {"up": True}))
            return
        self._authenticate(req)
        kinds = ("status",) if endpoint == "connect" else ("status",) + LIFECYCLE_FAULTS
        fault = self._take_fault(endpoint, kinds)
        if fault is not None and fault.kind in LIFECYCLE_FAULTS:
            self.change_sandbox(fault.kind, ids[0])
        elif fault is not None:
            self._send_fault(req, fault)
            return
        result = getattr(self, "_ep_" + endpoint)(req, *ids)
        if result is not None:
            status = self.reading.create_status if endpoint == "create" else 200
            req.send_json(status, envelope(status, result))

    def _admit(self, req: _Handler) -> None:
        """Refuse with 429, doing nothing else, a client over its rate limit."""
        if self._rate_window is None:
            return
        wait = self._rate_window.admit(req.client_address[0])
        if wait is None:
            return
        req.discard_body()
        limit, seconds = self._rate_window.limit, self._rate_window.seconds
        raise ApiError(
            429,
            {"rate_limit": "more than %d requests in %g s from this address" % (limit, seconds)},
            {"Retry-After": str(wait)},
        )

    def _authenticate(self, req: _Handler) -> None:
        # The service reads these before X-Api-Key (docs/protocol.md §1): whichever
        # comes first decides the caller, so a stray one is another identity.
        if any(name in req.headers for name in CREDENTIAL_HEADERS[1:]):
            raise ApiError(401, {"auth": "credentials other than X-Api-Key"})
        key = req.headers.get("X-Api-Key", "")
        if not hmac.compare_digest(key.encode("utf-8"), self.api_key.encode("utf-8")):
            raise ApiError(401, {"auth": "missing or invalid X-Api-Key"})

    @staticmethod
    def _send_fault(req: _Handler, fault: Fault) -> None:
        headers = {}
        if fault.retry_after is not None:
            headers["Retry-After"] = fault.retry_after
        if 300 <= fault.status < 400:
            headers["Location"] = STOLEN_LOCATION
        payload = fault.body
        if payload is None:
            payload = envelope(
                fault.status,
                {} if fault.status < 300 else {"fault": "injected HTTP %d" % fault.status},
            )
        req.send_json(fault.status, payload, headers)

    def _sandbox(self, sandbox_id: str, *, running: bool = True) -> Sandbox:
        """The sandbox a request names; it is active now. Unless the request is
        about the sandbox itself (not `running`), one that does not run answers
        as the reading says (docs/protocol.md §11.17)."""
        with self._lock:
            sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise ApiError(404, {"sandbox": "not found"})
        sandbox.last_active = time.monotonic()
        if running or self.reading.destroyed_view == 404:
            self._check_running(sandbox, running)
        return sandbox

    def _check_running(self, sandbox: Sandbox, running: bool = True) -> None:
        if sandbox.status == "destroyed":
            raise ApiError(404, {"sandbox": "not found"})
        if running and sandbox.status != "running":
            status = self.reading.paused_answer
            raise ApiError(status, {"sandbox": "sandbox is not running; resume it first"})

    def _process(self, sandbox_id: str, process_id: str) -> Process:
        self._sandbox(sandbox_id)
        with self._lock:
            proc = self._processes.get(process_id)
        if (
            proc is None
            or proc.sandbox_id != sandbox_id
            or proc.lost
            or (proc.deleted and self.reading.delete_forgets)
        ):
            raise ApiError(404, {"process": "not found"})
        return proc

    def _await(
        self, predicate: Callable[[], bool], timeout: float, *, stoppable: bool = True
    ) -> bool:
        """Poll predicate until true (True) or until timeout / server stop (False)."""
        deadline = time.monotonic() + timeout
        pause = FIRST_POLL
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (stoppable and self._stopping.is_set()):
                return False
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, POLL_INTERVAL)
        return True

    # -- endpoints: processes ----------------------------------------------------

    def _ep_create(self, req: _Handler, sandbox_id: str) -> dict[str, Any] | None:
        sandbox = self._sandbox(sandbox_id)
        spec = req.json_body()
        size = None
        if spec.get("pty") is not None:
            rows, cols = self.reading.pty_default_size.split("x")
            size = window_size(spec["pty"], (int(rows), int(cols)))
        cmd, args = command_of(spec)
        cwd = spec.get("cwd") or sandbox.workdir()
        if not isinstance(cwd, str) or not cwd.startswith("/"):
            raise ApiError(400, {"cwd": "must be an absolute path"})
        if not os.path.isdir(cwd):
            raise ApiError(400, {"cwd": "no such directory"})
        inherited = None if size is None else terminal_inheritance(self.reading)
        env = environment_of(spec, sandbox, inherited)
        created_at = utc_now()
        process_id = "proc_" + secrets.token_urlsafe(16)
        cgroup = None if self._cgroup is None else self._cgroup.child(process_id)
        try:
            popen, master = spawn([cmd] + args, cwd, env, cgroup, size)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            if cgroup is not None:
                cgroup.remove()
            raise start_error(exc) from None
        kind = Process if master is None else functools.partial(PtyProcess, master=master)
        proc = kind(
            process_id,
            sandbox_id,
            popen,
            ProcessGroup(popen.pid) if cgroup is None else cgroup,
            cmd,
            args,
            cwd,
            self.journal_limit,
            self.frame_limit,
            self.reading,
            created_at,
        )
        with self._lock:
            self._processes[proc.id] = proc
        proc.start()
        fault = self._take_fault("create", ("lose", "refuse"))
        if fault is not None and fault.kind == "refuse":
            self._send_fault(req, fault)
            return None
        if fault is not None:
            req.abort()
            return None
        return proc.record()

    def _ep_list(self, req: _Handler, sandbox_id: str) -> dict[str, Any]:
        """Every retained process, in creation order: unpaginated as
        ``{"processes": [...]}`` (which ignores ``limit`` and ``offset``), or
        one page of them (see ``page_of``), as ``reading.listing`` says."""
        self._sandbox(sandbox_id)
        records = self.processes(sandbox_id)
        if self.reading.delete_forgets:
            records = [r for r in records if not self._get_process(r["process_id"]).deleted]
        if self.reading.listing == "unpaginated":
            return {"processes": records}
        return page_of(records, req.query, self.list_page_size)

    def _ep_get(self, req: _Handler, sandbox_id: str, process_id: str) -> dict[str, Any]:
        return self._process(sandbox_id, process_id).record()

    def _ep_connect(self, req: _Handler, sandbox_id: str, process_id: str) -> None:
        proc = self._process(sandbox_id, process_id)
        # The vendor CLI leaves `after` out when it is 0: the service defaults it.
        after = uint_param(req.query, "after", self.reading.after_default)
        with proc.cond:
            evicted_through = proc.evicted_through
            finished = proc.output_finished
        if self._take_fault("connect", ("replay",)) is not None:
            after = evicted_through  # replay from the oldest retained frame
        elif after < evicted_through:
            raise_expired(self.reading, evicted_through + 1, finished)
        stream = OutputStream(self, req, proc, after, self._take_fault("connect", STREAM_FAULTS))
        sandbox = stream.sandbox
        with self._lock:
            sandbox.open_streams += 1
        try:
            stream.run()
        finally:
            with self._lock:
                sandbox.open_streams -= 1

    def _ep_input(self, req: _Handler, sandbox_id: str, process_id: str) -> dict[str, Any] | None:
        proc = self._process(sandbox_id, process_id)
        encoded = req.json_body().get("data_base64")
        if not isinstance(encoded, str):
            raise ApiError(400, {"data_base64": "must be a base64 string"})
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, {"data_base64": "invalid base64"}) from None
        input_seq = proc.write_input(data)
        lost = self._take_fault("input", ("lose",))
        if lost is not None:  # delivered, but the answer never leaves
            if lost.seconds:
                self._stopping.wait(lost.seconds)
            req.abort()
            return None
        return {"input_seq": input_seq}

    def _ep_stdin_close(self, req: _Handler, sandbox_id: str, process_id: str) -> dict[str, Any]:
        self._process(sandbox_id, process_id).close_stdin()
        return {"ok": True}

    def _ep_resize(self, req: _Handler, sandbox_id: str, process_id: str) -> dict[str, Any]:
        proc = self._process(sandbox_id, process_id)
        proc.resize(*window_size(req.json_body()))
        return {"ok": True}

    def _ep_signal(self, req: _Handler, sandbox_id: str, process_id: str) -> dict[str, Any]:
        proc = self._process(sandbox_id, process_id)
        name = req.json_body().get("signal")
        if name not in ALLOWED_SIGNALS:
            raise ApiError(400, {"signal": "must be one of " + " ".join(ALLOWED_SIGNALS)})
        proc.send_signal(getattr(signal, name))
        return {"ok": True}

    def _ep_wait(self, req: _Handler, sandbox_id: str, process_id: str) -> dict[str, Any]:
        """Long-poll for the exit of the leader or of the whole tree.

        SDKs that send neither parameter (PY's ``wait(pid)``, Java, Rust) or an
        empty scope (Go's zero value) get the reading's defaults.
        """
        proc = self._process(sandbox_id, process_id)
        scope = req.query.get("scope") or self.reading.wait_default_scope
        if scope not in ("leader", "tree"):
            raise ApiError(400, {"scope": "must be leader or tree"})
        timeout = uint_param(req.query, "timeout_ms", self.reading.wait_default_ms) / 1000.0
        if self.reading.wait_cap is not None:
            timeout = min(timeout, self.reading.wait_cap)
        condition = proc.leader_exited if scope == "leader" else proc.settled
        sandbox = self._sandbox(sandbox_id)
        if not self._await(lambda: condition() or sandbox.status != "running", timeout):
            raise ApiError(408, {"timeout": "the %s has not exited yet" % scope})
        self._check_running(sandbox)  # paused or destroyed during the long-poll
        return proc.record()

    def _ep_delete(self, req: _Handler, sandbox_id: str, process_id: str) -> dict[str, Any]:
        proc = self._process(sandbox_id, process_id)
        grace = uint_param(req.query, "grace_ms", self.reading.delete_default_grace_ms) / 1000.0
        if not proc.tree_exited():
            with proc.cond:
                proc.terminating = True
            proc.kill_tree(signal.SIGTERM)
            if not self._await(proc.tree_exited, grace):
                proc.kill_tree(signal.SIGKILL)
                if not self._await(proc.tree_exited, KILL_TIMEOUT):
                    raise ApiError(500, "the process tree survived SIGKILL")
        record = proc.record()
        proc.deleted = True
        return record

    # -- endpoints: sandboxes ------------------------------------------------------

    def _ep_sandbox(self, req: _Handler, sandbox_id: str) -> dict[str, Any]:
        return self._sandbox(sandbox_id, running=False).view()

    def _ep_sandbox_create(self, req: _Handler) -> None:
        envs = req.json_body().get("envs") or {}
        sandbox_id = "sb_" + secrets.token_hex(8)
        try:
            self.add_sandbox(sandbox_id, envs=envs)
        except ValueError:
            raise ApiError(400, {"envs": "invalid env entry"}) from None
        req.send_json(201, envelope(201, self._sandbox(sandbox_id).view()))

    def _ep_sandbox_pause(self, req: _Handler, sandbox_id: str) -> dict[str, Any] | None:
        return self._lifecycle(req, sandbox_id, self.pause, "paused", "pausing")

    def _ep_sandbox_resume(self, req: _Handler, sandbox_id: str) -> dict[str, Any] | None:
        return self._lifecycle(req, sandbox_id, self.resume, "running", "resuming")

    def _ep_sandbox_destroy(self, req: _Handler, sandbox_id: str) -> dict[str, Any] | None:
        return self._lifecycle(req, sandbox_id, self.destroy, "destroyed", "destroying")

    def _lifecycle(
        self,
        req: _Handler,
        sandbox_id: str,
        change: Callable[[str], bool],
        done: str,
        moving: str,
    ) -> dict[str, Any] | None:
        """200 and the view when the sandbox is there already; 202 and the transitional
        status once the change is under way; 409 when it cannot be made from here."""
        sandbox = self._sandbox(sandbox_id, running=False)
        if sandbox.status == done or (sandbox.status == moving == "resuming"):
            return sandbox.view()
        if not change(sandbox_id):
            raise ApiError(409, {"sandbox": "sandbox is %s" % sandbox.status})
        req.send_json(202, envelope(202, dict(sandbox.view(), status=moving)))
        return None

    # -- endpoints: files and exec -------------------------------------------------

    def _ep_files_get(self, req: _Handler, sandbox_id: str) -> None:
        self._sandbox(sandbox_id)
        path = absolute_path(req.query)
        try:
            source = open(path, "rb")
        except (FileNotFoundError, NotADirectoryError):
            raise ApiError(404, {"path": "no such file"}) from None
        except OSError as exc:
            raise ApiError(400, {"path": exc.strerror or "cannot read"}) from None
        fault = self._take_fault("files_get", ("drop", "corrupt"))
        with source:
            size = os.fstat(source.fileno()).st_size
            corrupt = fault is not None and fault.kind == "corrupt"
            req.start_raw(size + (corrupt and size == 0))
            most = size if fault is None or corrupt else fault.after_bytes
            sent = 0
            while sent < most or corrupt:
                piece = source.read(min(FILE_PIECE, most - sent))
                if corrupt:
                    piece, corrupt = corrupted(piece), False
                if not piece:
                    break
                req.wfile.write(piece)
                sent += len(piece)
                self.file_bytes["files_get"] += len(piece)
        if fault is not None and fault.kind == "drop":
            req.wfile.flush()
            req.abort()

    def _ep_files_put(self, req: _Handler, sandbox_id: str) -> dict[str, Any] | None:
        self._sandbox(sandbox_id)
        path = absolute_path(req.query)
        length = req.headers.get("Content-Length")
        if length is not None and UNSIGNED.match(length) and int(length) > self.file_size_limit:
            raise ApiError(413, {"body": "file larger than %d bytes" % self.file_size_limit})
        if not self.reading.upload_creates_parents and not os.path.isdir(os.path.dirname(path)):
            raise ApiError(404, {"path": "the parent directory does not exist"})
        fault = self._take_fault("files_put", ("drop", "corrupt", "hold"))
        pieces: Iterable[bytes] = req.body_pieces()
        if fault is not None and fault.kind == "hold":
            pieces = self._held_if_cut(pieces, fault)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # 0600 from the start: staged files may hold secrets (env, stdin).
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise ApiError(400, {"path": exc.strerror or "cannot write"}) from None
        with os.fdopen(fd, "wb") as target:
            written = self._receive_file(pieces, target, fault)
        if fault is not None and fault.kind == "drop":
            req.abort()  # the file keeps what arrived, as an upload cut short leaves it
            return None
        if written > self.file_size_limit:
            os.unlink(path)
            raise ApiError(413, {"body": "file larger than %d bytes" % self.file_size_limit})
        req.close_connection = False
        return {"path": path, "bytes": written}

    def _held_if_cut(self, pieces: Iterable[bytes], fault: Fault) -> Iterable[bytes]:
        """The body, read whole; cut short, handed on once the fault's `until` is set
        (or its seconds passed), the cut raised after its pieces."""
        arrived: list[bytes] = []
        try:
            arrived.extend(pieces)
        except (ApiError, OSError) as cut:
            assert fault.until is not None
            self._await(fault.until.is_set, fault.seconds)
            return pieces_then(arrived, cut)
        return arrived

    def _receive_file(self, pieces: Iterable[bytes], target: IO[bytes], fault: Fault | None) -> int:
        """Copy the body's pieces to `target` (up to the fault's bytes, or just past
        the size limit); the number of bytes written."""
        drop = fault is not None and fault.kind == "drop"
        most = fault.after_bytes if drop else self.file_size_limit + 1
        corrupt = fault is not None and fault.kind == "corrupt"
        written = 0
        for piece in pieces:
            piece = piece[: most - written]
            if corrupt:
                piece, corrupt = corrupted(piece), False
            target.write(piece)
            written += len(piece)
            self.file_bytes["files_put"] += len(piece)
            if written >= most:
                break
        if corrupt:
            target.write(corrupted(b""))
            written += 1
        return written

    def _ep_exec(self, req: _Handler, sandbox_id: str) -> dict[str, Any] | None:
        sandbox = self._sandbox(sandbox_id)
        spec = req.json_body()
        streamed = req.query.get("stream") == "true" or spec.get("stream") is True
        if streamed and not self.streamed_exec:
            raise ApiError(404, {"stream": "streaming exec is not supported by the local server"})
        cmd, args = command_of(spec)
        env = environment_of(spec, sandbox)
        stdin = spec.get("stdin")
        if stdin is not None and not isinstance(stdin, str):
            raise ApiError(400, {"stdin": "must be a string"})
        started = time.monotonic()
        try:
            child = subprocess.Popen(
                [cmd] + args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=sandbox.workdir(),
                env=env,
                start_new_session=True,
            )
        except (OSError, ValueError) as exc:
            raise start_error(exc) from None
        given = (stdin or "").encode("utf-8")
        if streamed:
            # Only a streamed exec takes these: a buffered one leaves them queued.
            fault = self._take_fault("exec", ("lose", "drop", "corrupt"))
            ExecStream(self, req, child, given, fault).run()
            return None
        stdout, stderr = child.communicate(given)
        if self._take_fault("exec", ("lose",)) is not None:
            req.abort()
            return None
        return {
            "result": {
                "stdout": stdout.decode("utf-8", "replace"),
                "stderr": stderr.decode("utf-8", "replace"),
                "exit_code": shell_status(child.returncode),
            },
            "exec_ms": (time.monotonic() - started) * 1000.0,
        }

    # -- endpoint: tunnels ----------------------------------------------------------

    def _ep_tunnel(self, req: _Handler, sandbox_id: str, port: str) -> None:
        """An upgrade to a raw pipe to 127.0.0.1:port on this machine (docs/protocol.md
        §7b): 101, then both directions copied, each one's end passed on; 502 when
        nothing listens there, 400 without the upgrade's two headers."""
        self._sandbox(sandbox_id)
        connection = req.headers.get("Connection", "").lower()
        if req.headers.get("Upgrade", "").lower() != "tcp-tunnel" or "upgrade" not in connection:
            raise ApiError(400, {"upgrade": "expected Connection: Upgrade, Upgrade: tcp-tunnel"})
        try:
            upstream = socket.create_connection(("127.0.0.1", int(port)), timeout=5.0)
        except OSError:
            raise ApiError(502, {"port": "nothing listens on port %s" % port}) from None
        upstream.settimeout(None)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._track_connection(upstream)
        try:
            req._start_answer(101, {"Connection": "Upgrade", "Upgrade": "tcp-tunnel"})
            req.end_headers()
            req.close_connection = True
            early = buffered_bytes(req)
            out = threading.Thread(target=pipe_one_way, args=(req.connection, upstream, early))
            out.start()
            pipe_one_way(upstream, req.connection)
            out.join()
        finally:
            self._untrack_connection(upstream)
            upstream.close()


# What a client's wrapper leaves in the sandbox's /tmp, named after its marker: the
# staged file, and the spool of each stream with its end (createos_exec's _SPOOL).
CLIENT_MARKER = re.compile(r"createos_exec-[0-9a-f]{24}\Z")
CLIENT_FILES = ("", ".stdout", ".stderr", ".stdout.end", ".stderr.end")


def remove_files_left(procs: list[Process]) -> None:
    """Remove what the processes' wrappers left in /tmp, which is this machine's: a
    sandbox that goes takes its files with it, and its processes are gone."""
    for proc in procs:
        marker = proc.args[2] if len(proc.args) > 2 else ""
        if proc.cmd == "bash" and CLIENT_MARKER.match(marker):
            for ending in CLIENT_FILES:
                with contextlib.suppress(OSError):
                    os.remove("/tmp/.%s%s" % (marker, ending))


def buffered_bytes(req: _Handler) -> bytes:
    """What the request's reader holds past the head: the first bytes of the pipe."""
    req.connection.setblocking(False)
    try:
        return req.rfile.read1(FILE_PIECE) or b""
    except OSError:  # nothing buffered, nothing arrived
        return b""
    finally:
        req.connection.setblocking(True)


def pipe_one_way(source: socket.socket, sink: socket.socket, first: bytes = b"") -> None:
    """Copy `source` to `sink` until it ends, then pass the end on (a half-close);
    a failure ends both directions."""
    try:
        sink.sendall(first)
        (spliced if hasattr(os, "splice") else copied)(source, sink)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def spliced(source: socket.socket, sink: socket.socket) -> None:
    """`source` to `sink` through a pipe, in the kernel (Linux): no copy through here."""
    splice = os.splice  # novermin: called only where os has it (3.10 and later)
    read_end, write_end = os.pipe()
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, 1031, FILE_PIECE)  # F_SETPIPE_SZ: a piece at once
        while True:
            count = splice(source.fileno(), write_end, FILE_PIECE)
            if not count:
                return
            while count:
                count -= splice(read_end, sink.fileno(), count)
    finally:
        os.close(read_end)
        os.close(write_end)


def copied(source: socket.socket, sink: socket.socket) -> None:
    piece = bytearray(FILE_PIECE)
    view = memoryview(piece)
    while True:
        count = source.recv_into(piece)
        if not count:
            return
        sink.sendall(view[:count])


# --------------------------------------------------------------------------
# Command line


def rate_limit_option(value: str) -> tuple[int, float]:
    """``N/SECONDS`` of ``--rate-limit``, e.g. ``300/60``."""
    count, _, seconds = value.partition("/")
    try:
        parsed = int(count), float(seconds)
    except ValueError:
        parsed = (0, 0.0)
    if parsed[0] < 1 or not 0 < parsed[1] < math.inf:
        raise argparse.ArgumentTypeError("expected N/SECONDS, e.g. 300/60, not %r" % value)
    return parsed


def reading_fields_help() -> str:
    """The fields of a Reading and their value in each of READINGS, for --help."""

    def shown(value: object) -> str:
        return str(value).lower() if value is None or isinstance(value, bool) else str(value)

    names = [field.name for field in dataclasses.fields(Reading)][1:]
    width = max(map(len, names))
    lines = ["reading fields (%s; see LocalServer's docstring):" % " / ".join(READINGS_BY_NAME)]
    for name in names:
        values = [getattr(reading, name) for reading in READINGS]
        others = [c for c in READING_CHOICES.get(name, ()) if c not in values]
        hint = "  (or %s)" % ", ".join(map(shown, others)) if others else ""
        lines.append("  %-*s  %s%s" % (width, name, " / ".join(map(shown, values)), hint))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="local_server.py",
        description=(
            "CreateOS-compatible test server. WARNING: it RUNS COMMANDS ON THIS "
            "MACHINE, as you, for anyone holding the API key. It binds loopback "
            "addresses only. Prints its base URL as the first line of stdout, "
            "then serves until SIGINT or SIGTERM. Sandbox 'sb_local' exists.\n\n"
            "Each managed process runs in a cgroup v2 of its own where it may (root, a "
            "writable cgroup2 mount with cgroup.kill: Linux 5.14 or later): tree_exited, "
            "wait?scope=tree and DELETE then reach every process of that cgroup, a "
            "double-forked daemon included, as on the service. Elsewhere, or with "
            "--no-cgroups, they reach the leader's process group, which a process leaves "
            "with setsid."
        ),
        epilog=reading_fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="loopback address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port, 0 = any free port (default 0)")
    parser.add_argument(
        "--api-key",
        default=DEFAULT_API_KEY,
        help="expected X-Api-Key (default %s)" % DEFAULT_API_KEY,
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        help="seconds of stream silence before a heartbeat frame (default: the reading's, 5)",
    )
    parser.add_argument(
        "--reading",
        choices=list(READINGS_BY_NAME),
        default=CONSERVATIVE.name,
        help="how to answer where docs/protocol.md §11 leaves the service open (default %s)"
        % CONSERVATIVE.name,
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="change one field of the reading (repeatable; the fields are listed below)",
    )
    parser.add_argument(
        "--list-page-size",
        type=int,
        default=100,
        metavar="N",
        help="default page size of the paginated process listing (reading field listing) "
        "(default 100, at most %d)" % LIST_LIMIT_MAX,
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="answer 411 to a POST without Content-Length and 400 to a POST that is not "
        "application/json, as the vendor's control forwarder does",
    )
    parser.add_argument(
        "--rate-limit",
        type=rate_limit_option,
        metavar="N/SECONDS",
        help="answer 429 to a client address over N requests in any SECONDS (default: no limit)",
    )
    parser.add_argument(
        "--file-size-limit",
        type=int,
        default=FILE_SIZE_LIMIT,
        metavar="BYTES",
        help="answer 413 to an upload of a larger file (default %d, the vendor's 500 MB)"
        % FILE_SIZE_LIMIT,
    )
    parser.add_argument(
        "--no-cgroups",
        dest="cgroups",
        action="store_false",
        help="make no cgroup: a process's tree is its process group, even where a cgroup "
        "could be made",
    )
    parser.add_argument(
        "--auto-pause",
        type=float,
        metavar="SECONDS",
        help="pause a sandbox idle that long (reading field idle_activity says what counts); "
        "POST /v1/sandboxes/{id}/pause, /resume and DELETE /v1/sandboxes/{id} act at once "
        "(default: never)",
    )
    parser.add_argument(
        "--resume-seconds",
        type=float,
        default=0.2,
        metavar="SECONDS",
        help="how long a sandbox stays 'resuming' before it runs again (default 0.2)",
    )
    parser.add_argument(
        "--no-streamed-exec",
        dest="streamed_exec",
        action="store_false",
        help="answer an exec with ?stream=true 404, as some control planes do (default: "
        "a stream of NDJSON lines, as the service documents it)",
    )
    parser.add_argument("--verbose", action="store_true", help="log requests to stderr")
    options = parser.parse_args(argv)
    try:
        reading = reading_of(options.reading)
        for setting in options.set:
            reading = reading_with(reading, setting)
        server = LocalServer(
            api_key=options.api_key,
            host=options.host,
            port=options.port,
            heartbeat_interval=options.heartbeat,
            reading=reading,
            list_page_size=options.list_page_size,
            strict=options.strict,
            rate_limit=options.rate_limit,
            file_size_limit=options.file_size_limit,
            cgroups=options.cgroups,
            auto_pause_after=options.auto_pause,
            resume_seconds=options.resume_seconds,
            streamed_exec=options.streamed_exec,
            verbose=options.verbose,
        )
    except ValueError as exc:
        parser.error(str(exc))
    received: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        # Only record it: a handler must not take a lock the main thread may hold.
        signal.signal(signum, lambda number, _frame: received.append(number))
    try:
        server.start()
    except OSError as exc:
        sys.stderr.write("local_server: cannot listen: %s\n" % exc.strerror)
        return 1
    try:
        print(server.url, flush=True)
        # Short sleeps, not one long lock wait: Python runs signal handlers
        # only in the main thread, when it is back in the interpreter.
        while not received:
            time.sleep(0.1)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
