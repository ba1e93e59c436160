"""Fixtures and hooks: a local CreateOS server on a real socket, a client for
it, canned answers, and an environment without CreateOS variables. The helpers
tests import by name are in support.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys

import pytest
import responses

# The helpers beside this file; support.py puts the repository's module on the path.
sys.path.insert(0, os.path.dirname(__file__))

from local_server import CONSERVATIVE, READINGS, LocalServer, Reading  # noqa: E402
from support import Figures, make_client  # noqa: E402

# A suite started in the background of a shell without job control inherits
# SIGINT ignored, and so would every program it starts (an ignored signal
# survives exec): the tests of Ctrl-C would then see nothing arrive. Python's
# own handler here is reset to the default in every child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The docs' examples, and the line an eviction message gives, run in "the
# sandbox" of the local server, which is this machine: what they write there
# is removed once the whole run is over (by the controller, after every
# worker), unless it was there before.
IN_THE_SANDBOX = ("/tmp/demo", "/tmp/out.log")


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_NEW_IN_THE_SANDBOX] = [
            path for path in IN_THE_SANDBOX if not os.path.lexists(path)
        ]


def pytest_sessionfinish(session):
    for path in session.config.stash.get(_NEW_IN_THE_SANDBOX, []):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)


_NEW_IN_THE_SANDBOX = pytest.StashKey[list]()


def pytest_make_parametrize_id(config, val, argname):
    """A reading's test id is its name: [conservative], [alternative]."""
    return val.name if isinstance(val, Reading) else None


def pytest_generate_tests(metafunc):
    """A test marked `both_readings` (its outcome depends on an open question of
    docs/protocol.md §11, see Reading) runs twice, with ids [conservative] and
    [alternative]; every other test plays the conservative reading only."""
    if metafunc.definition.get_closest_marker("both_readings") is None:
        return
    if "server_reading" not in metafunc.fixturenames:
        raise pytest.UsageError(
            "%s is marked both_readings but takes no server" % metafunc.definition.nodeid
        )
    metafunc.parametrize("server_reading", READINGS, indirect=True)


@pytest.fixture
def server_reading(request):
    """The reading of docs/protocol.md §11 that the test's servers play: each of them
    for a test marked `both_readings`, else the conservative one. A test that needs a
    server built otherwise takes this, not a `server` it would leave unused."""
    return getattr(request, "param", CONSERVATIVE)


@pytest.fixture
def local_server(server_reading):
    """Every local server of a test: `local_server(**options)` starts one of the
    test's reading (unless `reading=` says otherwise), heartbeats every 0.5 s
    unless told, and stops it when the test ends, however it ends."""
    started = []

    def start(**options):
        options.setdefault("reading", server_reading)
        options.setdefault("heartbeat_interval", 0.5)
        started.append(LocalServer(**options).start())
        return started[-1]

    yield start
    for local in reversed(started):
        local.stop()


@pytest.fixture
def server(local_server):
    """A local server; `server.reading` says which reading of docs/protocol.md §11 it plays."""
    return local_server()


@pytest.fixture
def client(server):
    with make_client(server) as local_client:
        yield local_client


@pytest.fixture(scope="session")
def figures():
    return Figures(os.environ.get("CREATEOS_RELIABILITY_REPORT"))


@pytest.fixture(autouse=True)
def _no_createos_environment(monkeypatch):
    """A test sees only the CreateOS variables it sets itself."""
    for name in ("CREATEOS_API_URL", "CREATEOS_API_KEY", "CREATEOS_SANDBOX_API_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def rsps():
    """Canned HTTP answers (see support.add_created and its neighbours)."""
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield mock


@pytest.fixture
def evil(rsps):
    """Every request to the redirect target is recorded here (it must stay empty)."""
    hits = []

    def trap(request):
        hits.append(f"{request.method} {request.url} {request.headers.get('X-Api-Key')}")
        return (599, {}, "must never be reached")

    pattern = re.compile(r"https://evil\.example\.test.*")
    for method in (responses.GET, responses.POST, responses.DELETE, responses.PUT):
        rsps.add_callback(method, pattern, callback=trap)
    return hits
