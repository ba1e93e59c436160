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

from local_server import READINGS, LocalServer  # noqa: E402

import createos_exec as cx  # noqa: E402

SANDBOX = "sb_local"

# Fast but real: backoff in milliseconds, a short idle timeout for stall tests.
FAST_RETRY = cx.RetryPolicy(max_attempts=6, budget=10.0, initial_backoff=0.01, max_backoff=0.05)


# Modules whose tests run against both readings of protocol.md §11 (see
# LocalServer): each test that uses `server` (or `client`) runs twice, with ids
# [conservative] and [alternative]. Other modules keep the conservative
# reading only: doubling them all would cost CI more than it finds.
BOTH_READINGS = ("test_execute", "test_resilience", "test_sdk_fidelity")


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
    return cx._frames(block, cx._utf8_text(block))


def run_with_deliveries(encoding="utf-8", errors="replace"):
    """A `_Run` to hand blocks to, and the (stream, text) pairs it delivers."""
    delivered = []
    options = cx._options(
        None, lambda *args: delivered.append(args), False, 100, encoding, errors, None
    )
    client = cx.Client("http://127.0.0.1:9", "k", rate_limit=None)  # never called
    return cx._Run(client, "sb", "p1", options, args=[], started=0), delivered


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


def require(name):
    """Import a test-only dependency: skipped locally when missing, an error in CI."""
    if os.environ.get("CI", "").strip().lower() in ("", "0", "false", "no"):
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
    """Cursor, deliveries, failure and value of take(run) on a fresh `_Run` at `cursor`."""
    run, delivered = run_with_deliveries("latin-1", "strict")
    run.cursor = cursor
    try:
        value = take(run)
    except cx.ProtocolError:
        return run.cursor, delivered, True, None
    return run.cursor, delivered, False, value


def take_block(block):
    return lambda run: run._take_block(block, cx._Budget(cx.RetryPolicy()))


def next_frame_agrees(block, cursor):
    """Whether _take_next_frame took `block`; it must take it exactly as _take_block
    would, or leave it untouched."""
    cursor_after, delivered, failed, took = taken(lambda run: run._take_next_frame(block), cursor)
    assert not failed, "it never fails: it leaves the block to _take_block"
    if not took:
        assert (cursor_after, delivered) == (cursor, [])
        return False
    assert (cursor_after, delivered, False) == taken(take_block(block), cursor)[:3]
    return True
