"""The tests' shared scaffolding, written once: clients, retry policies, canned
answers, frames and records, the walk of an exception's chain that every
secret check uses, the reader's probes, and the campaigns' sizes.

Fixtures and hooks live in conftest.py; everything a test imports by name
lives here.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import responses

# The repository's module, also in processes that import this file without
# pytest (the fault matrix's workers, the example scripts' helpers).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from local_server import DEFAULT_SANDBOX  # noqa: E402

import createos_exec as cx  # noqa: E402

SANDBOX = DEFAULT_SANDBOX  # the local server's sandbox, there from the start

# Canned answers: a service that is never reached, at a name that cannot resolve.
BASE = "https://api.example.test"
KEY = "KEY-must-not-leak-4711"
SB = "sb_1"
PID = "proc_x"
PROCS = f"{BASE}/v1/sandboxes/{SB}/processes"
PROC = f"{PROCS}/{PID}"
CONNECT = f"{PROC}/connect"
WAIT = f"{PROC}/wait"
FILES = f"{BASE}/v1/sandboxes/{SB}/files"
EXEC = f"{BASE}/v1/sandboxes/{SB}/exec"


# --------------------------------------------------------------------------
# Retry policies: fast but real, one per purpose
# --------------------------------------------------------------------------

# Against the local server: backoff in milliseconds, room for a few faults in a row.
FAST_RETRY = cx.RetryPolicy(max_attempts=6, budget=10.0, initial_backoff=0.01, max_backoff=0.05)
# Canned answers: two attempts without progress and no waiting, so that a test
# counts the requests a route makes.
CANNED_RETRY = cx.RetryPolicy(
    max_attempts=2, budget=10.0, initial_backoff=0, max_backoff=0, max_retry_after=0.05
)
# Canned answers, a third try: for a test that counts the requests of a policy
# that runs out after three.
CANNED_THREE_TRIES = dataclasses.replace(CANNED_RETRY, max_attempts=3)
# A failure is final at once: what a route does when nothing may be sent again.
NO_RETRY = cx.RetryPolicy(max_attempts=1)
# A second or third try after a short backoff, for a fault injected once or twice.
TWO_TRIES = cx.RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02)
THREE_TRIES = cx.RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)
# The campaigns: many faults in a row on one run, still within seconds.
CAMPAIGN_RETRY = cx.RetryPolicy(
    max_attempts=12, budget=30.0, initial_backoff=0.002, max_backoff=0.05
)


# --------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------


def make_client(server: Any = None, **overrides: Any) -> cx.Client:
    """A client of the local `server`, or of the canned service when there is none.

    No rate limit (the tests pace nothing unless they say so), a short idle
    timeout for the stall tests; `overrides` are Client keywords. Requests to
    the local server keep the default request timeout: a creation forks a
    process, which a loaded machine can make slower than a few seconds, and
    an answer that times out sends the run down the ambiguous-creation route.
    """
    canned = server is None
    settings: Dict[str, Any] = dict(
        api_url=BASE if canned else server.url,
        api_key=KEY if canned else server.api_key,
        retry=CANNED_RETRY if canned else FAST_RETRY,
        rate_limit=None,
        stream_idle_timeout=2.0,
        cleanup_timeout=10.0,
    )
    settings.update(overrides)
    return cx.Client(**settings)


def campaign_client(server: Any, **overrides: Any) -> cx.Client:
    """A client for a campaign's local server: CAMPAIGN_RETRY, and one request
    bounded at 10 s, so that an answer a fault stalls costs a run seconds, not
    the default 30."""
    settings: Dict[str, Any] = dict(retry=CAMPAIGN_RETRY, request_timeout=10.0)
    settings.update(overrides)
    return make_client(server, **settings)


# --------------------------------------------------------------------------
# Records and frames, as the service sends them
# --------------------------------------------------------------------------


def ok(data: Any) -> Dict[str, Any]:
    """A JSend success envelope, as CreateOS answers a 2xx."""
    return {"status": "success", "data": data}


def process_record(process_id: str = PID, *, newest: int = 0, **fields: Any) -> Dict[str, Any]:
    """A running ManagedProcess record (docs/protocol.md 5.2), with `fields` overriding."""
    record = {
        "process_id": process_id,
        "kind": "process",
        "pid": 42,
        "state": "running",
        "leader_exited": False,
        "tree_exited": False,
        "created_at": "2024-01-01T00:00:00Z",
        "output": {"oldest_seq": 0, "newest_seq": newest, "bytes": 0},
    }
    record.update(fields)
    return record


def exited(newest: int, **fields: Any) -> Dict[str, Any]:
    """The record of a process whose tree is gone, its journal at `newest`."""
    fields.setdefault("state", "exited")
    return process_record(
        leader_exited=True,
        tree_exited=True,
        output={"oldest_seq": 1 if newest else 0, "newest_seq": newest, "bytes": 1},
        **fields,
    )


def data(seq: Any, stream: str, raw: bytes) -> Dict[str, Any]:
    """A data frame carrying `raw`."""
    return {
        "type": "data",
        "seq": seq,
        "stream": stream,
        "data_base64": base64.b64encode(raw).decode("ascii"),
    }


EXIT0 = {"type": "exit", "exit_code": 0}


def nd(*frames: Any) -> str:
    """An NDJSON body: dicts are dumped, strings are sent as raw lines."""
    return "".join((f if isinstance(f, str) else json.dumps(f)) + "\n" for f in frames)


# --------------------------------------------------------------------------
# Canned answers (responses)
# --------------------------------------------------------------------------


def add_created(rsps: responses.RequestsMock, pid: str = PID) -> None:
    rsps.add(responses.POST, PROCS, json=ok(process_record(pid)))


def add_connect(rsps: responses.RequestsMock, body: Any, status: int = 200, **kw: Any) -> None:
    """One answer to the stream's connect: `body` is an NDJSON text (see nd())."""
    rsps.add(
        responses.GET, CONNECT, body=body, status=status,
        content_type="application/x-ndjson", **kw,
    )  # fmt: skip


def add_stalled_connect(rsps: responses.RequestsMock, seconds: float, body: str) -> None:
    """One answer to the stream's connect that comes only after `seconds` of silence."""

    def answer(request: Any) -> Any:
        time.sleep(seconds)
        return (200, {}, body)

    rsps.add_callback(responses.GET, CONNECT, callback=answer, content_type="application/x-ndjson")


def add_deleted(rsps: responses.RequestsMock) -> None:
    rsps.add(responses.DELETE, PROC, json=ok(exited(0, exit_code=0)))


def ran(stdout: str = "", exit_code: int = 0) -> Dict[str, Any]:
    """An exec's answer (docs/protocol.md 6)."""
    return ok({"result": {"stdout": stdout, "stderr": "", "exit_code": exit_code}})


def spooled(stdout: bytes = b"", stderr: bytes = b"", *, held: Any = (0, 0), ended: bool = True):
    """A reading of the spool (cx._SPOOL_READ) that gives each stream's bytes past `held`."""
    lines = "".join(
        f"{before + len(raw)} {int(ended)}\n{base64.b64encode(raw).decode()}\n"
        for raw, before in zip((stdout, stderr), held)
    )
    return ran(lines)


SPOOL_GONE = ran(exit_code=3)  # a reading of a spool that is no longer there


def spool_files(server: Any, process_id: str) -> List[str]:
    """The spool of a process the local server runs: its files in this machine's /tmp."""
    marker = server.process(process_id)["args"][2]
    return [f"/tmp/.{marker}.{end}" for end in ("stdout", "stderr", "stdout.end", "stderr.end")]


def remove_spool(server: Any, process_id: str) -> None:
    for path in spool_files(server, process_id):
        if os.path.exists(path):
            os.remove(path)


def calls(rsps: responses.RequestsMock, method: str, url: str) -> List[Any]:
    """The requests made to `url` (its query aside) with `method`."""
    return [
        c
        for c in rsps.calls
        if c.request.method == method and c.request.url.split("?", 1)[0] == url
    ]


def query(call: Any) -> Dict[str, str]:
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(call.request.url).query))


def body_of(call: Any) -> Any:
    raw = call.request.body
    return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)


def assert_deleted_once(rsps: responses.RequestsMock) -> None:
    """The tree was terminated once, with a grace period."""
    deletes = calls(rsps, "DELETE", PROC)
    assert len(deletes) == 1
    grace = query(deletes[0]).get("grace_ms")
    assert grace is not None and int(grace) > 0


# --------------------------------------------------------------------------
# Exceptions and secrets
# --------------------------------------------------------------------------


def chain(exc: Optional[BaseException]) -> List[BaseException]:
    """Every exception reachable from `exc` through __cause__ and __context__,
    once each: a __context__ behind a set __cause__ is searched too."""
    seen: List[BaseException] = []
    todo = [exc]
    while todo:
        link = todo.pop()
        if link is None or any(link is known for known in seen):
            continue
        seen.append(link)
        todo.extend((link.__cause__, link.__context__))
    return seen


def assert_clean(exc: BaseException, *secrets: str) -> None:
    """Neither the error nor anything in its chain shows the key or a secret."""
    for link in chain(exc):
        for secret in (KEY,) + secrets:
            assert secret not in str(link), (type(link), str(link))
            assert secret not in repr(link), (type(link), repr(link))


# --------------------------------------------------------------------------
# The frame reader, probed directly
# --------------------------------------------------------------------------


def utf8_text(block: bytes) -> Optional[str]:
    """`block` decoded as the reader decodes it, or None when it is not UTF-8."""
    try:
        return block.decode("utf-8")
    except UnicodeDecodeError:
        return None


def frames(block: bytes) -> Any:
    """The JSON values of a block of complete lines, decoded as the reader does."""
    return cx._frames(block, utf8_text(block))


def reader_with_deliveries(encoding: str = "utf-8", errors: str = "replace") -> Any:
    """A `_Reader` to hand blocks to, and the (stream, text) pairs it delivers."""
    delivered: List[Any] = []
    output = cx._Output(encoding, errors, 100, lambda *args: delivered.append(args))
    return cx._Reader(output), delivered


def blocks(chunks: Any, limit: int = cx._FRAME_LIMIT) -> Any:
    """The blocks of complete lines the reader cuts `chunks` into."""
    return cx._Reader(cx._Output("utf-8", "replace", 0, None), limit=limit).blocks(chunks)


def taken(take: Any, cursor: int = 0) -> Any:
    """Cursor, deliveries, failure and value of take(reader) on a fresh `_Reader` at `cursor`."""
    reader, delivered = reader_with_deliveries("latin-1", "strict")
    reader.cursor = cursor
    try:
        value = take(reader)
    except cx.ProtocolError:
        return reader.cursor, delivered, True, None
    return reader.cursor, delivered, False, value


def take_block(block: bytes) -> Any:
    return lambda reader: reader.take(block)


def by_json(block: bytes) -> Any:
    """What the JSON route alone, json.loads of each line, does with `block`."""
    return lambda reader: reader._take_frames(frames(block))


def agrees_with_json(block: bytes, cursor: int = 0) -> bool:
    """Whether the reader took `block` without failing; whatever route it took,
    it must leave exactly the cursor, deliveries and verdict of the JSON route."""
    fast = taken(take_block(block), cursor)
    assert fast == taken(by_json(block), cursor)
    return not fast[2]


# --------------------------------------------------------------------------
# Programs: remote commands, their output, the command line, the examples, sockets
# --------------------------------------------------------------------------


def python(code: str) -> List[str]:
    """argv of a Python program that prints unbuffered."""
    return [sys.executable, "-u", "-c", code]


# A script that starts a daemon as a service does (a session of its own, a
# second fork, reparented to init, stdio on /dev/null), writes its pid to
# ./daemon, and then sleeps: only a cgroup still holds the daemon in its tree.
DAEMON = "setsid -w sh -c 'sleep 300 </dev/null >/dev/null 2>&1 & echo $! >daemon'; exec sleep 300"


def daemon_pid(directory: str) -> int:
    """The pid DAEMON, run in `directory`, wrote there (waited for, 10 s at most)."""
    path = os.path.join(directory, "daemon")
    deadline = time.monotonic() + 10.0
    while True:
        try:
            with open(path) as written:
                line = written.read()
        except FileNotFoundError:
            line = ""
        if line.endswith("\n"):
            return int(line)
        assert time.monotonic() < deadline, "DAEMON wrote no pid"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Whether a process with this pid lives; a zombie, which a reparented
    child may stay for good, does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def cli_argv(*args: str) -> List[str]:
    return [sys.executable, "-m", "createos_exec", *args]


def cli_env(server: Any, **extra: str) -> Dict[str, str]:
    """The environment of a command-line run against `server`."""
    env = dict(os.environ)
    env.update(CREATEOS_API_URL=server.url, CREATEOS_API_KEY=server.api_key, PYTHONPATH=ROOT)
    env.update(extra)
    env.pop("CREATEOS_SANDBOX_API_KEY", None)
    return env


def run_example(name: str) -> "subprocess.CompletedProcess[bytes]":
    """Run examples/<name> as a user would, from the repository root."""
    return subprocess.run(
        [sys.executable, os.path.join("examples", name)],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )


class Recorder:
    """An on_output that keeps every delivery and when it came."""

    def __init__(self) -> None:
        self.deliveries: List[Tuple[str, str]] = []
        self.times: List[float] = []

    def __call__(self, stream: str, text: str) -> None:
        self.deliveries.append((stream, text))
        self.times.append(time.monotonic())

    def text(self, stream: str = "stdout") -> str:
        return "".join(text for name, text in self.deliveries if name == stream)

    def output(self) -> str:
        """Everything delivered, both streams, in the order it came."""
        return "".join(text for _, text in self.deliveries)


class Listener:
    """A socket on loopback that hands each connection it accepts to
    `handle(connection)`, on a thread of its own, until close()."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.url = "http://127.0.0.1:%d" % self._socket.getsockname()[1]
        self._handle = handle
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            self._handle(connection)

    def close(self) -> None:
        self._socket.close()


def shown_parts() -> List[Tuple[str, str, str]]:
    """The parts of examples/background.py that a Markdown file shows, as
    (file, part, code): between `# -- FILE.md: part --` and `# -- end --`."""
    with open(os.path.join(ROOT, "examples", "background.py"), encoding="utf-8") as handle:
        example = handle.read()
    marked = re.finditer(
        r"\n    # -- (\S+\.md): ([^\n]+) --\n(.*?)\n    # -- end --", example, re.S
    )
    return [(m.group(1), m.group(2), textwrap.dedent(m.group(3)).strip()) for m in marked]


# Ports below the kernel's ephemeral range (32768 and up here), a block of
# them for each test process: a port the kernel hands out for a bind to 0 or
# an outgoing connection, or another test process, can never take one.
_OWN_PORTS = itertools.cycle(
    range(10000 + os.getpid() % 1000 * 20, 10020 + os.getpid() % 1000 * 20)
)


def closed_port() -> int:
    """A loopback port nobody listens on, and that nothing else on this
    machine is given while the test uses it (see _OWN_PORTS)."""
    for port in itertools.islice(_OWN_PORTS, 20):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:  # held by a program outside the suite, or in TIME_WAIT
                continue
            return port
    raise RuntimeError("every port of this test process's block is taken")


# --------------------------------------------------------------------------
# Campaign sizes, CI and test-only dependencies
# --------------------------------------------------------------------------


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def full_campaign() -> bool:
    """Whether the reliability campaigns run at full size (``python -m nox -s
    campaign`` sets CREATEOS_CAMPAIGN=full), not at the bounded sizes of the
    suite, which still take every route of each campaign at least once."""
    return os.environ.get("CREATEOS_CAMPAIGN", "").strip().lower() == "full"


def campaign_size(variable: str, bounded: int, full: int) -> int:
    """A campaign's size: $variable if set, else `full` or `bounded`."""
    value = os.environ.get(variable, "").strip()
    if value:
        return int(value)
    return full if full_campaign() else bounded


def require(name: str) -> Any:
    """Import a test-only dependency: skipped locally when missing, an error in CI."""
    if not in_ci():
        return pytest.importorskip(name)
    return importlib.import_module(name)


def require_cgroup(server: Any) -> None:
    """For a test of a local server that puts each process in a cgroup of its
    own: skipped where it may not (not root, no writable cgroup2), an error in CI."""
    if server.containment != "cgroup":
        assert not in_ci(), "the local server made no cgroup in CI"
        pytest.skip("the local server may make no cgroup on this machine")


class Figures:
    """Figures of the reliability campaign, appended as JSON lines to the file
    named by $CREATEOS_RELIABILITY_REPORT (nothing is written when it is unset)."""

    def __init__(self, path: Optional[str]) -> None:
        self._path = path

    def record(self, item: str, **figures: float) -> None:
        """`item`: its row of RELIABILITY.md's table, e.g. "1. fault matrix"; figures:
        runs=, faults=, exact=, ... (numbers)."""
        if self._path:
            with open(self._path, "a", encoding="utf-8") as report:
                report.write(json.dumps({"item": item, **figures}) + "\n")


def figures_at_end(item: str, figures_of: Callable[[], Optional[Dict[str, float]]]) -> Any:
    """A module's autouse fixture that records `item` once the module's tests
    are done, with the figures figures_of() returns then (none: nothing is
    recorded). Assign it to a module-level name:
    ``_figures = figures_at_end("9. deadline kept in the sandbox", killed_figures)``."""

    @pytest.fixture(scope="module", autouse=True)
    def _figures_at_end(figures: Figures) -> Any:
        yield
        found = figures_of()
        if found:
            figures.record(item, **found)

    return _figures_at_end


def until(condition: Callable[[], Any], timeout: float = 15.0, what: str = "it") -> Any:
    """Wait until `condition()` is true (polled every 10 ms) and return its value;
    fail the test when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not come within {timeout} s"
        time.sleep(0.01)
