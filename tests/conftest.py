"""Shared fixtures: a local CreateOS server on a real socket and a client for it."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, ROOT)

from local_server import READINGS, LocalServer, Reading  # noqa: E402

import createos_exec as cx  # noqa: E402

SANDBOX = "sb_local"

# Fast but real: backoff in milliseconds, a short idle timeout for stall tests.
FAST_RETRY = cx.RetryPolicy(max_attempts=6, budget=10.0, initial_backoff=0.01, max_backoff=0.05)


# Modules whose tests run against both readings of protocol.md §11 (see
# LocalServer): each test that uses `server` (or `client`) runs twice, with ids
# [conservative] and [alternative]. Other modules keep the conservative
# reading only: doubling them all would cost CI more than it finds.
BOTH_READINGS = (
    "test_execute",
    "test_resilience",
    "test_sdk_fidelity",
    "test_process",
    "test_stdin",
    "test_background",
    "test_cancel",
)


def pytest_make_parametrize_id(config, val, argname):
    """A reading's test id is its name: [conservative], [alternative]."""
    return val.name if isinstance(val, Reading) else None


def pytest_generate_tests(metafunc):
    module = metafunc.module.__name__.rpartition(".")[2]
    if module in BOTH_READINGS and "server" in metafunc.fixturenames:
        metafunc.parametrize("server", READINGS, indirect=True)


@pytest.fixture
def server(request):
    """A local server; `server.reading` says which reading of protocol §11 it plays."""
    reading = getattr(request, "param", "conservative")
    with LocalServer(heartbeat_interval=0.5, reading=reading) as local:
        yield local


def python(code):
    """argv of a Python program that prints unbuffered."""
    return [sys.executable, "-u", "-c", code]


def make_client(server, **overrides):
    settings = dict(
        api_url=server.url,
        api_key=server.api_key,
        retry=FAST_RETRY,
        stream_idle_timeout=2.0,
        cleanup_timeout=10.0,
        rate_limit=None,
    )
    settings.update(overrides)
    return cx.Client(**settings)


@pytest.fixture
def client(server):
    with make_client(server) as local_client:
        yield local_client


def frames(block):
    """The JSON values of a block of complete lines, decoded as the reader does."""
    return cx._frames(block, utf8_text(block))


def utf8_text(block):
    """`block` decoded as the reader decodes it, or None when it is not UTF-8."""
    try:
        return block.decode("utf-8")
    except UnicodeDecodeError:
        return None


def reader_with_deliveries(encoding="utf-8", errors="replace"):
    """A `_Reader` to hand blocks to, and the (stream, text) pairs it delivers."""
    delivered = []
    output = cx._Output(encoding, errors, 100, lambda *args: delivered.append(args))
    return cx._Reader(output), delivered


def blocks(chunks, limit=cx._FRAME_LIMIT):
    """The blocks of complete lines the reader cuts `chunks` into."""
    return cx._Reader(cx._Output("utf-8", "replace", 0, None), limit=limit).blocks(chunks)


def jsend_ok(data):
    """A JSend success envelope, as CreateOS answers a 2xx."""
    return {"status": "success", "data": data}


def process_record(process_id, /, *, newest=0, **fields):
    """A running ManagedProcess record (protocol.md 5.2), with `fields` overriding."""
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


def cli_argv(*args):
    return [sys.executable, "-m", "createos_exec", *args]


def cli_env(server, **extra):
    """The environment of a command-line run against `server`."""
    env = dict(os.environ)
    env.update(CREATEOS_API_URL=server.url, CREATEOS_API_KEY=server.api_key, PYTHONPATH=ROOT)
    env.update(extra)
    env.pop("CREATEOS_SANDBOX_API_KEY", None)
    return env


def run_example(name):
    """Run examples/<name> as a user would, from the repository root."""
    return subprocess.run(
        [sys.executable, os.path.join("examples", name)],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )


def in_ci():
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def full_campaign():
    """Whether the reliability campaigns run at full size (``python -m nox -s
    campaign`` sets CREATEOS_CAMPAIGN=full), not at the bounded sizes of the
    suite, which still take every route of each campaign at least once."""
    return os.environ.get("CREATEOS_CAMPAIGN", "").strip().lower() == "full"


def campaign_size(variable, bounded, full):
    """A campaign's size: $variable if set, else `full` or `bounded`."""
    value = os.environ.get(variable, "").strip()
    if value:
        return int(value)
    return full if full_campaign() else bounded


def require(name):
    """Import a test-only dependency: skipped locally when missing, an error in CI."""
    if not in_ci():
        return pytest.importorskip(name)
    return importlib.import_module(name)


class Figures:
    """Figures of the reliability campaign, appended as JSON lines to the file
    named by $CREATEOS_RELIABILITY_REPORT (nothing is written when it is unset)."""

    def __init__(self, path):
        self._path = path

    def record(self, item, **figures):
        """`item`: e.g. "1. fault matrix"; figures: runs=, faults=, exact=, ... (numbers)."""
        if self._path:
            with open(self._path, "a", encoding="utf-8") as report:
                report.write(json.dumps({"item": item, **figures}) + "\n")


@pytest.fixture(scope="session")
def figures():
    return Figures(os.environ.get("CREATEOS_RELIABILITY_REPORT"))


def taken(take, cursor=0):
    """Cursor, deliveries, failure and value of take(reader) on a fresh `_Reader` at `cursor`."""
    reader, delivered = reader_with_deliveries("latin-1", "strict")
    reader.cursor = cursor
    try:
        value = take(reader)
    except cx.ProtocolError:
        return reader.cursor, delivered, True, None
    return reader.cursor, delivered, False, value


def take_block(block):
    return lambda reader: reader.take(block)


def by_json(block):
    """What the JSON route alone, json.loads of each line, does with `block`."""
    return lambda reader: reader._take_frames(frames(block))


def agrees_with_json(block, cursor=0):
    """Whether the reader took `block` without failing; whatever route it took,
    it must leave exactly the cursor, deliveries and verdict of the JSON route."""
    fast = taken(take_block(block), cursor)
    assert fast == taken(by_json(block), cursor)
    return not fast[2]
