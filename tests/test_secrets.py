"""The leak check: the API key, env values and stdin never leak, whatever
route a run takes, and no credential but X-Api-Key is ever sent.

Every route (stream faults and resume, chaos, protocol violations, creation
trouble, containment: Ctrl-C, cancel, a raising on_output, timeout; HTTP
errors whose bodies echo the request back on every endpoint; a caller's
session or a ~/.netrc carrying other credentials; refused arguments; the
command line) is run with distinctive secrets. Then the secrets must appear
in no exception (message, repr, args, any link of its __cause__ /
__context__ graph, its formatted traceback, its attributes and pickle), no
log record (DEBUG and up: message, args, exception text), no repr of the
client or result, no process record of the sandbox (what anyone listing its
processes reads), no request line the server logged, and on no stream of the
command line. Redirects are never followed: the key never reaches the
Location host.

docs/protocol.md §1: the service reads Authorization, X-Auth-Token and
X-Access-Token before X-Api-Key, so one sent by accident decides whose call
it is; the local server answers such a request 401. `requests` adds
Authorization: Basic on its own from a ~/.netrc entry, and a caller's
session may carry any of them: every route here runs with such an entry.
"""

from __future__ import annotations

import base64
import glob
import json
import logging
import os
import pickle
import random
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
from hashlib import sha256
from secrets import token_hex
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import pytest
import requests
from local_server import STOLEN_LOCATION, LocalServer, endpoint_of
from support import (
    SANDBOX,
    chain,
    cli_argv,
    cli_env,
    figures_at_end,
    make_client,
    remove_spool,
)

import createos_exec as cx

# Distinctive secrets. Each carries a random hex token that survives any
# encoding (JSON, URL, repr) unchanged, so a partial or escaped leak is found
# too; the full values are never spelled out in this file. (Not support.KEY,
# which is a constant: every run here searches for a key of its own.)
KEY = "KEY-5ecret-" + token_hex(12)
ENV_A = "ENV-5ecret-" + token_hex(12)
ENV_B = "ENV-5ecret-" + token_hex(12) + "\nsecond line = 'quoted' $HOME \"x\""
STDIN = "STDIN-5ecret-" + token_hex(12) + "\nmore stdin \u20ac\n"
ENV = {"SECRET_A": ENV_A, "SECRET_B": ENV_B}
SECRETS = {"api key": KEY, "env SECRET_A": ENV_A, "env SECRET_B": ENV_B, "stdin": STDIN}
NEEDLES = []
for _label, _value in SECRETS.items():
    NEEDLES.append((_label, _value))
    NEEDLES.append((_label + " token", re.search(r"5ecret-([0-9a-f]+)", _value).group(1)))

# What the command prints: a digest proving env and stdin arrived, never them.
# One os.write per line, so one line is one frame (PYTHONUNBUFFERED would
# split a print() into two writes).
DIGEST = sha256(f"{ENV_A}|{ENV_B}|{STDIN}".encode("utf-8")).hexdigest()
PROGRAM = (
    "import hashlib, os, sys, time\n"
    "data = (os.environ['SECRET_A'] + '|' + os.environ['SECRET_B'] + '|').encode()\n"
    "os.write(1, (hashlib.sha256(data + sys.stdin.buffer.read()).hexdigest() + '\\n').encode())\n"
    "for i in range(int(sys.argv[1])):\n"
    "    time.sleep(float(sys.argv[2]))\n"
    "    os.write(1, b'line %d\\n' % i)\n"
    "time.sleep(float(sys.argv[3]))\n"
    "sys.exit(int(sys.argv[4]))\n"
)


def program(lines=4, delay=0.05, tail=0.0, code=0):
    """argv of the command: the digest, then `lines` lines, a quiet `tail`, exit `code`."""
    return [sys.executable, "-c", PROGRAM, str(lines), str(delay), str(tail), str(code)]


def printed(lines=4):
    return DIGEST + "\n" + "".join(f"line {i}\n" for i in range(lines))


def echo_body(status):
    """An answer body that echoes the whole request back, secrets included."""
    echoed = {
        "headers": {"X-Api-Key": KEY, "Content-Type": "application/octet-stream"},
        "env": dict(ENV),
        "stdin": STDIN,
        "staged": base64.b64encode(
            f"SECRET_A={ENV_A}\0SECRET_B={ENV_B}\0\0{STDIN}".encode()
        ).decode("ascii"),
        "raw": f"SECRET_A={ENV_A}\0SECRET_B={ENV_B}\0\0{STDIN}",
    }
    if status < 300:
        return {"status": "odd", "echo": echoed, "message": f"key {KEY} stdin {STDIN}"}
    if status < 500:
        return {"status": "fail", "data": echoed}
    return {
        "status": "error",
        "message": "request was " + json.dumps(echoed),
        "code": status,
        "data": echoed,
    }


# --------------------------------------------------------------------------
# The leak scanner and the figures
# --------------------------------------------------------------------------


class Tally:
    """Totals over the module, for the figures of the campaign."""

    def __init__(self):
        self.paths = set()  # distinct failure paths scanned
        self.checks = 0  # texts searched for every secret
        self.leaks = 0  # secrets found where they must not be
        self.stolen_capture = 0  # a capture server listened on the local server's Location
        self.staged_left = 0  # staged files the client could not remove (all 0600)


TALLY = Tally()


def secrets_figures():
    return dict(
        paths=len(TALLY.paths),
        checks=TALLY.checks,
        leaks=TALLY.leaks,
        stolen_capture=TALLY.stolen_capture,
        staged_left=TALLY.staged_left,
    )


_secrets_figures = figures_at_end("5. secrets", secrets_figures)


class Scan:
    """Collects every place a secret shows up; a test asserts it found none."""

    def __init__(self, detail=""):
        self.found = []
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        TALLY.paths.add(test + detail)

    def text(self, where, value):
        if value is None:
            return
        TALLY.checks += 1
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", "backslashreplace")
        if not isinstance(value, str):
            value = repr(value)
        for label, needle in NEEDLES:
            if needle in value:
                TALLY.leaks += 1
                self.found.append(f"{label} in {where}")

    def error(self, exc):
        """The exception, every link of its cause/context graph, its traceback."""
        self.text(
            "formatted traceback",
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )
        for link in chain(exc):
            name = type(link).__name__
            self.text(f"str({name})", str(link))
            self.text(f"repr({name})", repr(link))
            self.text(f"{name}.args", repr(link.args))
            for arg in link.args:
                self.text(f"{name}.args item", str(arg))
            if isinstance(link, cx.CreateOSError):
                self.text(f"vars({name})", repr(vars(link)))
                self.text(f"pickle({name})", pickle.dumps(link))
                if link.result is not None:
                    self.text(f"{name}.result", repr(link.result))

    def logs(self, caplog):
        for record in caplog.records:
            where = f"log {record.name}:{record.levelname}"
            self.text(where + " message", record.getMessage())
            self.text(where + " msg", str(record.msg))
            self.text(where + " args", repr(record.args))
            self.text(where + " exc_text", record.exc_text)
            if record.exc_info:
                self.text(where + " exc_info", logging.Formatter().formatException(record.exc_info))
                if record.exc_info[1] is not None:
                    self.error(record.exc_info[1])
            self.text(where + " stack_info", record.stack_info)
        self.text("caplog.text", caplog.text)

    def server(self, server):
        """What anyone listing the sandbox's processes or reading one reads, and
        the request log."""
        self.text("server.processes()", repr(server.processes()))
        self.text("server request log", repr(server.requests))
        self.text("GET …/processes", get(server))
        for record in server.processes():
            self.text("GET …/processes/ID", get(server, "/" + record["process_id"]))

    def staged_files(self):
        """Staged env/stdin files left behind: private (0600), then removed by us."""
        left = 0
        for path in glob.glob("/tmp/.createos_exec-*"):
            try:
                with open(path, "rb") as handle:
                    content = handle.read()
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except OSError:  # removed meanwhile by its wrapper
                continue
            if not any(needle.encode() in content for _, needle in NEEDLES):
                continue  # not ours
            left += 1
            TALLY.staged_left += 1
            if mode & 0o077:
                self.found.append(f"staged file {path} has mode {oct(mode)}")
            os.remove(path)
        return left

    def assert_clean(self):
        assert self.found == [], self.found


def get(server, below=""):
    """The raw JSON of GET …/processes`below`, past any faults still queued for it."""
    for _ in range(100):
        response = requests.get(
            server.url + f"/v1/sandboxes/{SANDBOX}/processes" + below,
            headers={"X-Api-Key": KEY},
            timeout=10,
            allow_redirects=False,  # the key must not go to a queued redirect's Location
            auth=lambda request: request,  # not the ~/.netrc entry requests would add
        )
        if response.status_code == 200 and response.json().get("status") == "success":
            return response.text
    raise AssertionError("GET …/processes%s kept failing" % below)


@pytest.fixture
def server(local_server):
    local = local_server(api_key=KEY)
    yield local


@pytest.fixture(autouse=True)
def _netrc_everywhere(tmp_path, monkeypatch):
    """A real .netrc with a `default` entry, which applies to every host."""
    netrc = tmp_path / ".netrc"
    netrc.write_text("default login someone password netrc-password-never-sent\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(netrc))
    # The premise: requests itself would send the entry to the API.
    assert requests.utils.get_netrc_auth("http://127.0.0.1:1/v1")[0] == "someone"


@pytest.fixture(autouse=True)
def _debug_logs(caplog):
    caplog.set_level(logging.DEBUG)  # every logger, createos_exec and urllib3 included
    caplog.set_level(logging.DEBUG, logger="createos_exec")


def run_and_scan(server, caplog, run, command, *, client_options, **options):
    """Run the command with env and stdin, the way `run` does; scan everything.

    Returns (result, error, the server's request log as the client left it,
    the staged files left behind).
    """
    result = error = None
    with make_client(server, **client_options) as client:
        try:
            result = run(client, command, **options)
        except (Exception, KeyboardInterrupt) as exc:  # KeyboardInterrupt: a path under test
            error = exc
        scan = Scan()
        scan.text("repr(client)", repr(client))
        scan.text("str(client)", str(client))
    partial = getattr(error, "result", None)
    for name, value in (("result", result), ("error.result", partial)):
        if value is not None:  # the wrapper must not print what it reads either
            scan.text(f"repr({name})", repr(value))
            scan.text(f"{name} output", (value.args, value.stdout, value.stderr, value.output))
    if error is not None:
        scan.error(error)
    # Let containment and wrappers finish before looking at the records.
    for record in server.processes():
        server.wait_tree_gone(record["process_id"], timeout=15)
    sent = list(server.requests)  # before our own look at the listing adds to it
    assert {r.credentials for r in sent} <= {("X-Api-Key",)}  # one credential, ever
    scan.logs(caplog)
    scan.server(server)
    left = scan.staged_files()
    assert any(r.name == "createos_exec" and r.levelno == logging.DEBUG for r in caplog.records), (
        "the DEBUG request log was not captured"
    )
    for record in caplog.records:
        if record.name == "createos_exec" and record.levelno == logging.DEBUG:
            assert re.fullmatch(r"(GET|POST|PUT|DELETE) /v1/[A-Za-z0-9_/.-]+", record.getMessage())
    scan.assert_clean()
    return result, error, sent, left


# --------------------------------------------------------------------------
# Every route a run can take, with env and stdin
# --------------------------------------------------------------------------

GAP = b'{"type":"data","seq":9,"stream":"stdout","data_base64":"eA=="}'
VIOLATIONS = {
    "gap": GAP,
    "invalid-json": b'{"type":"data",',
    "bad-base64": b'{"type":"data","seq":2,"stream":"stdout","data_base64":"e*=="}',
    "unknown-type": b'{"type":"progress"}',
    "error-frame": b'{"type":"error","error":"internal"}',
    "oversized": b'{"type":"heartbeat","pad":"' + b"x" * (1024 * 1024) + b'"}',
    "eviction-frame": b'{"type":"error","error":"output_offset_expired","oldest_available_seq":5}',
}


class CallbackBoom(Exception):
    """What the raising on_output raises."""


def _raise(exc):
    def on_output(stream, text):
        raise exc

    return on_output


def _cancel_at_first_output(server):
    cancel = threading.Event()
    return {"cancel": cancel, "on_output": lambda stream, text: cancel.set()}


def _cancel_while_silent(server):
    cancel = threading.Event()
    timer = threading.Timer(1.0, cancel.set)
    timer.daemon = True
    timer.start()
    return {"cancel": cancel}


def _read_live(arrange):
    """`arrange`, with a live reader that first removes the spool: for it, eviction
    the spool cannot make good is an error, not a head dropped."""

    def with_reader(server):
        options = arrange(server) or {}
        options.setdefault("on_output", _losing_the_spool(server))
        return options

    return with_reader


def _losing_the_spool(server, act=lambda process_id: None):
    """An on_output that, at its first call, does `act` to the server's one process,
    then removes its spool: what the journal loses is lost for good."""
    fired = []

    def on_output(stream, text):
        if not fired:
            fired.append(True)
            (record,) = server.processes()
            act(record["process_id"])
            remove_spool(server, record["process_id"])

    return on_output


def _evict_then_break(server):
    server.drop_stream(after_frames=1)

    def evict(process_id):
        time.sleep(0.4)  # let the process print more, then lose it
        server.evict(process_id)

    return {"on_output": _losing_the_spool(server, evict)}


def _chaos(seed):
    def arrange(server):
        rng = random.Random(seed)
        for _ in range(6):
            kind = rng.choice(["drop", "mid", "end", "503", "429", "replay"])
            after = rng.randint(0, 3)
            if kind == "drop":
                server.drop_stream(after_frames=after)
            elif kind == "mid":
                server.drop_stream(after_frames=after, mid_frame=True)
            elif kind == "end":
                server.end_stream(after_frames=after)
            elif kind == "replay":
                server.replay_ignoring_after()
            else:
                server.fail("connect", int(kind), retry_after="0", body=echo_body(int(kind)))
        return {}

    return arrange


def _faults(*calls):
    """An arrange step: call each (method name, args, kwargs) on the server."""

    def arrange(server):
        for name, args, kwargs in calls:
            getattr(server, name)(*args, **kwargs)
        return {}

    return arrange


def _f(name, *args, **kwargs):
    return (name, args, kwargs)


def _echo_fail(endpoint, status, count=50):
    return _f("fail", endpoint, status, count=count, body=echo_body(status))


LONG = program(lines=1, delay=0.2, tail=30)
SHORT = program(lines=1, delay=0.2, tail=3)  # outlives a cleanup that fails, briefly
OK = "ok"


def _options(**options):
    """An arrange step that injects nothing and gives execute() these options."""
    return lambda server: options


def execute(client, command, **options):
    """The run of most routes: execute() with env and stdin."""
    return client.execute(SANDBOX, command, env=ENV, stdin=STDIN, **options)


def write_to_a_pipe(client, command, **options):
    """A handle's run: env, then stdin written through write(), then communicate();
    its result is then wait()'s."""
    with client.start(SANDBOX, command, env=ENV, stdin=cx.PIPE, **options) as process:
        process.write(STDIN)
        process.communicate()
        return process.wait()


class Route(NamedTuple):
    """How a run reaches its end, and which end it must reach."""

    arrange: Callable[[LocalServer], Any]  # fault injection; returns extra execute options
    command: List[str]
    ends: Any  # OK, "timed_out", an exception class, or None: any (an echoing answer)
    client: Callable[[], Dict[str, Any]] = dict  # extra Client keywords
    echoed: Tuple[str, int] = ("", 0)  # the endpoint that echoes the request, its status
    run: Callable[..., Any] = execute


def session_with(**settings):
    """Client keywords: a caller's session that carries other credentials."""

    def client():
        session = requests.Session()
        session.headers.update(settings.get("headers", {}))
        session.auth = settings.get("auth")
        return {"session": session}

    return client


OTHER_CREDENTIALS = {
    "Authorization": "Bearer someone-else",
    "X-Auth-Token": "session-of-someone-else",
    "X-Access-Token": "oauth-of-someone-else",
}


def arrange_echo(server, endpoint, status):
    """Make the run reach `endpoint`, which then answers `status` with an echo."""
    if endpoint == "create":
        server.fail("create", status, body=echo_body(status))
    elif endpoint in ("files_put", "connect"):
        server.fail(endpoint, status, count=50, body=echo_body(status))
    elif endpoint == "wait":  # the stream cannot deliver the exit status: ask wait
        server.drop_stream(after_frames=1)
        server.fail("connect", 503, count=50, body=echo_body(503))
        server.fail("wait", status, count=50, body=echo_body(status))
    elif endpoint == "delete":  # a protocol violation: terminate the tree
        server.corrupt_stream(GAP, after_frames=1)
        server.fail("delete", status, count=50, body=echo_body(status))
    elif endpoint == "list":  # an ambiguous creation: look for it
        server.lose_create_response()
        server.fail("list", status, count=50, body=echo_body(status))
    else:  # exec: creation refused, so the staged file is removed through exec
        server.fail("create", 400, body=echo_body(400))
        server.fail("exec", status, count=50, body=echo_body(status))


class Capture:
    """Listens where a redirect points and keeps what reaches it (nothing must)."""

    def __init__(self, host, port):
        self.requests = []
        self._socket = socket.create_server((host, port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            with connection:
                self.requests.append(connection.recv(65536))

    def close(self):
        self._socket.close()


@pytest.fixture(scope="module")
def stolen():
    """A capture server on the local server's redirect target, when it can be bound."""
    host, port = re.match(r"http://([^:/]+):(\d+)/", STOLEN_LOCATION).groups()
    try:
        capture = Capture(host, int(port))
    except OSError:  # port 1 needs privileges; then nothing listens there at all
        yield None
        return
    TALLY.stolen_capture = 1
    yield capture
    capture.close()


ROUTES = {
    # 2./3. resume, don't restart; the retry policy
    "plain-success": Route(_faults(), program(), OK),
    "drop": Route(_faults(_f("drop_stream", after_frames=2)), program(), OK),
    "drop-mid-frame": Route(
        _faults(_f("drop_stream", after_frames=2, mid_frame=True)), program(), OK
    ),
    "clean-eof": Route(_faults(_f("end_stream", after_frames=2)), program(), OK),
    "stall": Route(
        _faults(_f("stall_stream", after_frames=1, seconds=5)),
        program(),
        OK,
        client=lambda: {"stream_idle_timeout": 0.5},
    ),
    "connect-503-retry-after": Route(
        _faults(_f("fail", "connect", 503, count=2, retry_after="0", body=echo_body(503))),
        program(),
        OK,
    ),
    "connect-429": Route(
        _faults(_f("fail", "connect", 429, retry_after="0", body=echo_body(429))), program(), OK
    ),
    "replay-ignoring-after": Route(
        _faults(_f("replay_ignoring_after", count=2), _f("drop_stream", after_frames=3)),
        program(),
        OK,
    ),
    "separated-blips": Route(_faults(*[_f("drop_stream", after_frames=1)] * 4), program(6), OK),
    # chaos: seeded mixes of stream faults
    **{f"chaos-{seed}": Route(_chaos(seed), program(lines=6), OK) for seed in (1, 2, 3)},
    # 4. the exit status out of band
    "exit-recovered-by-wait": Route(
        _faults(_f("drop_stream", after_frames=1), _echo_fail("connect", 503)), program(0), OK
    ),
    "replay-window": Route(
        _faults(_f("drop_stream", after_frames=1), _echo_fail("connect", 503, count=5)),
        program(lines=1, delay=0.2),
        OK,
    ),
    "stream-ended": Route(
        _faults(
            _f("drop_stream", after_frames=1),
            _echo_fail("connect", 503),
            _echo_fail("wait", 503),
        ),
        LONG,
        cx.StreamEndedError,
    ),
    "exit-without-status-recovered": Route(
        _faults(_f("corrupt_stream", b'{"type":"exit"}', after_frames=1)), program(0), OK
    ),
    "exit-without-status-unanswered": Route(
        _faults(
            # The body ends after it, as after the service's exit frame.
            _f("corrupt_stream", b'{"type":"exit","exit_code":null}', after_frames=1, last=True),
            _echo_fail("wait", 500),
        ),
        LONG,
        cx.ProtocolError,
    ),
    # protocol violations fail closed
    **{
        f"violation-{name}": Route(
            _read_live(_faults(_f("corrupt_stream", line, after_frames=1))),
            LONG,
            cx.OutputEvictedError if name == "eviction-frame" else cx.ProtocolError,
        )
        for name, line in VIOLATIONS.items()
    },
    "410-on-reconnect": Route(
        _evict_then_break, program(lines=3, delay=0.1, tail=30), cx.OutputEvictedError
    ),
    # 1. one creation, ever
    "lost-create-answer-adopted": Route(_faults(_f("lose_create_response")), program(), OK),
    "lost-create-answer-listing-fails": Route(
        _faults(_f("lose_create_response"), _echo_fail("list", 503)), program(0), cx.CleanupError
    ),
    "create-500-not-found": Route(
        _faults(_echo_fail("create", 500, count=1)), program(), cx.CleanupError
    ),
    # 5. containment
    "timeout": Route(_options(timeout=1.5), LONG, "timed_out"),
    "timeout-check": Route(_options(timeout=1.5, check=True), LONG, cx.CommandError),
    "cancel-at-output": Route(_cancel_at_first_output, LONG, cx.CancelledError),
    "cancel-while-silent": Route(_cancel_while_silent, program(0, tail=30), cx.CancelledError),
    "raising-on-output": Route(
        _options(on_output=_raise(CallbackBoom("callback failed"))), LONG, CallbackBoom
    ),
    "ctrl-c-in-on-output": Route(
        _options(on_output=_raise(KeyboardInterrupt())), LONG, KeyboardInterrupt
    ),
    "ctrl-c-cleanup-fails": Route(
        lambda server: (
            server.fail("delete", 503, count=100, body=echo_body(503))
            or {"on_output": _raise(KeyboardInterrupt())}
        ),
        SHORT,
        KeyboardInterrupt,
        client=lambda: {"cleanup_timeout": 2.0},
    ),
    "cleanup-unconfirmed": Route(
        _faults(_f("corrupt_stream", GAP, after_frames=1), _echo_fail("delete", 503, count=100)),
        SHORT,
        cx.CleanupError,
        client=lambda: {"cleanup_timeout": 2.0},
    ),
    "stdin-written-to-a-pipe": Route(_faults(), program(0), OK, run=write_to_a_pipe),
    "stdin-written-to-a-pipe-answer-lost": Route(
        _faults(_f("lose_input_response")),
        program(0),
        cx.InputUnconfirmedError,
        run=write_to_a_pipe,
    ),
    "check-nonzero-exit": Route(_options(check=True), program(1, code=3), cx.CommandError),
    "wrong-key-401": Route(
        _faults(), program(), cx.APIError, client=lambda: {"api_key": KEY + "-wrong"}
    ),
    # a caller's session carrying other credentials: X-Api-Key alone is sent
    **{
        f"session-with-{header}": Route(
            _faults(), program(), OK, client=session_with(headers={header: value})
        )
        for header, value in OTHER_CREDENTIALS.items()
    },
    "session-with-auth": Route(
        _faults(), program(), OK, client=session_with(auth=("someone", "else"))
    ),
    "session-with-every-header-and-a-stale-key": Route(
        _faults(),
        program(),
        OK,
        client=session_with(headers={**OTHER_CREDENTIALS, "X-Api-Key": "a-stale-key"}),
    ),
    # HTTP answers that echo the request back, on every endpoint the client uses
    **{
        f"{endpoint}-answers-{status}": Route(
            lambda server, endpoint=endpoint, status=status: arrange_echo(server, endpoint, status),
            program(lines=0, tail=0.5 if endpoint == "delete" else 0),
            None,
            echoed=(endpoint, status),
        )
        for endpoint in ("create", "connect", "wait", "delete", "list", "files_put", "exec")
        for status in (200, 301, 302, 303, 307, 308, 400, 401, 404, 409, 429, 500, 503)
    },
    # requests' own redirect handling is never asked, whoever made the session
    "create-answers-307-through-a-callers-session": Route(
        lambda server: arrange_echo(server, "create", 307),
        program(lines=0),
        cx.APIError,
        client=session_with(),
        echoed=("create", 307),
    ),
}


@pytest.mark.parametrize("name", list(ROUTES))
def test_no_secret_leaks_through(server, caplog, stolen, name):
    route = ROUTES[name]
    options = route.arrange(server) or {}
    before = len(stolen.requests) if stolen else 0
    result, error, sent, left = run_and_scan(
        server, caplog, route.run, route.command, client_options=route.client(), **options
    )
    if route.ends == OK:
        assert error is None, repr(error)
        assert result.exit_code == 0
        # Not vacuous: env and stdin did reach the process.
        assert result.stdout == printed(int(route.command[3]))
    elif route.ends == "timed_out":
        assert error is None and result.timed_out
        assert result.stdout.startswith(DIGEST + "\n")
    elif route.ends is not None:
        assert type(error) is route.ends, repr(error)
    endpoint, status = route.echoed
    if endpoint:
        answered = [r.status for r in sent if endpoint_of(r.method, r.path) == endpoint]
        assert status in answered, (endpoint, answered)  # the route was really taken
        if 300 <= status < 400:  # never followed: asked once
            assert answered.count(status) == 1
    if stolen:  # nothing at the Location of a redirect
        assert stolen.requests[before:] == []
    # Only a failed removal leaves the staged file behind (private, see Scan).
    assert left == (1 if endpoint == "exec" else 0)
    if endpoint == "exec" and status != 200:
        assert "Could not remove the staged env/stdin file" in caplog.text
    if name == "ctrl-c-cleanup-fails":
        assert any(r.levelno == logging.WARNING for r in caplog.records)


# --------------------------------------------------------------------------
# The command line: failing servers, --json, and SIGINT
# --------------------------------------------------------------------------

CLI_ARGS = [f"--env=SECRET_A={ENV_A}", f"--env=SECRET_B={ENV_B}", "--stdin", "-"]
CLI_CASES = {
    "success": (_faults(), program(lines=1), 0),
    "create-400-echo": (_faults(_echo_fail("create", 400, count=1)), program(), 125),
    "staging-401-echo": (_faults(_echo_fail("files_put", 401)), program(), 125),
    "create-302": (_faults(_echo_fail("create", 302, count=1)), program(), 125),
    "protocol-violation": (_faults(_f("corrupt_stream", GAP, after_frames=1)), LONG, 125),
    # The command line has no retry options: statuses it does not retry keep it quick.
    "cleanup-unconfirmed-with-warnings": (
        _faults(_f("corrupt_stream", GAP, after_frames=1), _echo_fail("delete", 409)),
        SHORT,
        125,
    ),
}


def assert_cli_clean(server, out, err):
    """Nothing of a secret on the command line's streams, the server's records or
    the staged files, once every tree the run left is gone."""
    scan = Scan()
    scan.text("CLI stdout", out)
    scan.text("CLI stderr", err)
    for record in server.processes():
        server.wait_tree_gone(record["process_id"], timeout=15)
    scan.server(server)
    scan.staged_files()
    scan.assert_clean()


@pytest.mark.parametrize("json_mode", [False, True], ids=["live", "json"])
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_command_line_leaks_no_secret(server, case, json_mode):
    arrange, command, code = CLI_CASES[case]
    arrange(server)
    args = (["--json"] if json_mode else []) + CLI_ARGS + [SANDBOX, "--", *command]
    done = subprocess.run(
        cli_argv(*args),
        env=cli_env(server),
        input=STDIN.encode("utf-8"),
        capture_output=True,
        timeout=90,
    )
    assert done.returncode == code, done.stderr
    assert_cli_clean(server, done.stdout, done.stderr)
    if case == "success":
        assert DIGEST.encode() in done.stdout  # env and stdin arrived
    elif case.startswith("cleanup") and not json_mode:
        assert b"Termination of" in done.stderr  # the WARNING reached stderr, clean


def read_line(pipe, timeout):
    """One line from a pipe, waiting at most `timeout` seconds."""
    fd, data, deadline = pipe.fileno(), b"", time.monotonic() + timeout
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("cleanup", ["works", "fails"])
def test_sigint_to_the_command_line_leaks_no_secret(server, cleanup):
    if cleanup == "fails":
        server.fail("delete", 409, count=10, body=echo_body(409))
    # stdin: a pipe already holding the secret and closed, as `--stdin -` reads to EOF.
    reader, writer = os.pipe()
    os.write(writer, STDIN.encode("utf-8"))
    os.close(writer)
    try:
        child = subprocess.Popen(
            # A cleanup that fails leaves the command running: then only briefly.
            cli_argv(
                *CLI_ARGS, SANDBOX, "--", *program(lines=0, tail=60 if cleanup == "works" else 4)
            ),
            env=cli_env(server),
            stdin=reader,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    finally:
        os.close(reader)
    try:
        first = read_line(child.stdout, 30)
        assert first == DIGEST.encode() + b"\n"  # running, env and stdin arrived
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait(10)
    assert child.returncode == 130, err
    assert_cli_clean(server, first + out, err)
    assert b"interrupted" in err
    if cleanup == "fails":
        assert b"Termination of" in err  # logged at WARNING, reaches stderr, clean


# --------------------------------------------------------------------------
# Refused arguments: the ConfigError never carries the secret it refuses
# --------------------------------------------------------------------------


def refusal(build_and_run):
    """The exception of a call that must be refused before any request is sent."""
    try:
        build_and_run()
    except Exception as exc:  # any type: the test asserts which one
        return exc
    raise AssertionError("the call was not refused")


@pytest.mark.parametrize(
    "name, call",
    [
        ("NUL in an env value", lambda c: c.execute(SANDBOX, ["true"], env={"A": ENV_A + "\0"})),
        ("env value not a str", lambda c: c.execute(SANDBOX, ["true"], env={"A": [ENV_A]})),
        ("bad env name", lambda c: c.execute(SANDBOX, ["true"], env={"A B": ENV_A})),
        ("stdin of a bad type", lambda c: c.execute(SANDBOX, ["true"], stdin=[STDIN])),
        ("key with CR LF", lambda c: cx.Client(c.api_url, KEY + "\r\nX-Evil: 1")),
        ("key with spaces", lambda c: cx.Client(c.api_url, " " + KEY)),
        ("key in the URL", lambda c: cx.Client(c.api_url.replace("//", f"//u:{KEY}@"), KEY)),
        # A pasted ellipsis: not Latin-1, not sendable in a header.
        ("key not Latin-1", lambda c: cx.Client(c.api_url, KEY + "\u2026")),
        # os.environ values on POSIX, and text read with errors="surrogateescape",
        # carry lone surrogates for undecodable bytes.
        (
            "env value not Unicode",
            lambda c: c.execute(SANDBOX, ["true"], env={"A": ENV_A + "\udcff"}),
        ),
        ("stdin not Unicode", lambda c: c.execute(SANDBOX, ["cat"], stdin=STDIN + "\udcff")),
    ],
)
def test_refused_arguments_do_not_echo_secrets(server, caplog, name, call):
    with make_client(server) as client:
        error = refusal(lambda: call(client))
    assert isinstance(error, cx.ConfigError), repr(error)
    assert server.requests == []  # refused before anything was sent
    scan = Scan()
    scan.error(error)
    scan.logs(caplog)
    scan.assert_clean()
