"""Tests of tests/local_server.py itself, over real sockets with plain requests."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import select
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
import types

import pytest
import requests
import urllib3

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from local_server import DEFAULT_API_KEY, DEFAULT_SANDBOX, LocalServer, cgroup2_mount  # noqa: E402
from support import DAEMON, alive, daemon_pid, require_cgroup  # noqa: E402

SERVER_CLI = [sys.executable, os.path.join(HERE, "local_server.py")]  # its command line

PROCESS_ID = re.compile(r"proc_[A-Za-z0-9_-]{22}")
RFC3339_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")
THREE_FRAMES = "printf 1; sleep 0.1; printf 2 >&2; sleep 0.1; printf 3"
THREE = [(1, "stdout", "MQ=="), (2, "stderr", "Mg=="), (3, "stdout", "Mw==")]


class Api:
    """A tiny client for one sandbox of a LocalServer."""

    def __init__(self, server: LocalServer, sandbox: str = DEFAULT_SANDBOX):
        self.server = server
        self.base = "%s/v1/sandboxes/%s" % (server.url, sandbox)
        self.session = requests.Session()
        self.session.headers["X-Api-Key"] = server.api_key

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        kwargs.setdefault("timeout", 10)
        kwargs.setdefault("allow_redirects", False)
        return self.session.request(method, self.base + path, **kwargs)

    def create(self, *argv: str, **spec) -> str:
        response = self.request(
            "POST", "/processes", json=dict(spec, cmd=argv[0], args=list(argv[1:]))
        )
        assert response.status_code in (200, 201), response.text  # 201: alternative reading
        return response.json()["data"]["process_id"]

    def sh(self, script: str) -> str:
        return self.create("sh", "-c", script)

    def connect(self, process_id: str, after: int = 0) -> requests.Response:
        return self.request(
            "GET", "/processes/%s/connect" % process_id, params={"after": after}, stream=True
        )

    def frames(self, process_id: str, after: int = 0) -> list:
        response = self.connect(process_id, after)
        assert response.status_code == 200, response.text
        return read_frames(response)

    def wait(self, process_id: str, scope: str = "tree", timeout_ms: int = 5000) -> dict:
        response = self.request(
            "GET",
            "/processes/%s/wait" % process_id,
            params={"scope": scope, "timeout_ms": timeout_ms},
        )
        assert response.status_code == 200, response.text
        return response.json()["data"]


def read_frames(response: requests.Response, frames: list | None = None) -> list:
    """Decode an NDJSON stream into `frames`, checking that every HTTP chunk holds
    exactly one line."""
    frames = [] if frames is None else frames
    for chunk in response.raw.read_chunked(decode_content=False):
        assert chunk.endswith(b"\n") and chunk.count(b"\n") == 1, chunk
        frames.append(json.loads(chunk))
    return frames


def payloads(frames: list) -> list:
    return [
        (f["seq"], f["stream"], base64.b64decode(f["data_base64"]))
        for f in frames
        if f["type"] == "data"
    ]


def frames_to_the_exit(api: Api, process_id: str) -> list:
    """The frames up to the exit frame, a stream recycled while the process was
    quiet (§11.2: a loaded machine can keep it quiet that long) taken up again."""
    frames: list = []
    for _ in range(20):
        frames += api.frames(process_id, max([seq for seq, _, _ in payloads(frames)], default=0))
        if frames and frames[-1]["type"] == "exit":
            return frames
    raise AssertionError("no exit frame in 20 streams")


def streams_of(frames: list) -> dict:
    """Each stream's bytes, once the frames' seqs are checked to run 1, 2, 3, ...
    in one sequence: where a loaded machine's reads cut the output into frames
    does not matter to what the tests built on it check."""
    data = payloads(frames)
    assert [seq for seq, _, _ in data] == list(range(1, len(data) + 1))
    joined: dict = {}
    for _, stream, piece in data:
        joined[stream] = joined.get(stream, b"") + piece
    return joined


def exchange(host: str, port: int, request: bytes, source: str = "") -> bytes:
    """Send `request` on a bare socket and read until the server closes it."""
    received = b""
    with socket.create_connection((host, port), 10, (source, 0) if source else None) as sock:
        sock.sendall(request)
        while True:
            part = sock.recv(65536)
            if not part:
                return received
            received += part


def raw_connect(server: LocalServer, process_id: str, after: int = 0) -> tuple:
    """GET …/connect on a bare socket with Connection: close, read until the server closes.

    Returns (status line, chunks, terminated cleanly, bytes of an unfinished chunk).
    """
    host, port = server.url[len("http://") :].rsplit(":", 1)
    request = (
        "GET /v1/sandboxes/sb_local/processes/%s/connect?after=%d HTTP/1.1\r\n"
        "Host: %s\r\nX-Api-Key: %s\r\nConnection: close\r\n\r\n"
        % (process_id, after, host, server.api_key)
    )
    received = exchange(host, int(port), request.encode("ascii"))
    head, _, body = received.partition(b"\r\n\r\n")
    chunks = []
    while True:
        size_line, found, rest = body.partition(b"\r\n")
        if not found:
            return head.split(b"\r\n")[0], chunks, False, body
        size = int(size_line, 16)
        if size == 0:
            return head.split(b"\r\n")[0], chunks, True, b""
        if len(rest) < size + 2:
            return head.split(b"\r\n")[0], chunks, False, rest
        chunks.append(rest[:size])
        body = rest[size + 2 :]


def raw_request(
    server: LocalServer,
    method: str,
    path: str,
    head: str = "",
    body: bytes = b"",
    *,
    source: str = "127.0.0.1",
):
    """One request on a bare socket, framed exactly as given: (status, JSON body or None).

    `head` holds extra header lines, each ending in CRLF; nothing is added but
    Host, the API key and Connection: close. `source` is the client's address.
    """
    host, port = server.url[len("http://") :].rsplit(":", 1)
    request = "%s /v1/sandboxes/sb_local%s HTTP/1.1\r\nHost: %s\r\nX-Api-Key: %s\r\n%s" % (
        method,
        path,
        host,
        server.api_key,
        head,
    )
    sent = request.encode("ascii") + b"Connection: close\r\n\r\n" + body
    received = exchange(host, int(port), sent, source)
    status_line, _, rest = received.partition(b"\r\n")
    content = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(content) if content else None


def finished_three_frames(api: Api) -> str:
    """A process whose journal holds seq 1 (stdout "1"), 2 (stderr "2"), 3 (stdout "3").

    The frames are the server's reads of the two pipes: a machine too loaded to
    read "1" before "3" is written makes one frame of both, so the process is
    run again until its journal is the one the tests read."""
    for _ in range(10):
        process_id = api.sh(THREE_FRAMES)
        api.wait(process_id)
        journal = [json.loads(f.line) for f in api.server._get_process(process_id).journal]
        if [(f["seq"], f["stream"], f["data_base64"]) for f in journal] == THREE:
            return process_id
    raise AssertionError("ten runs in a row had their frames merged")


@pytest.fixture
def server(request):
    """A local server; parametrized indirectly, with or without cgroups (see BOTH_TREES)."""
    local = LocalServer(cgroups=getattr(request, "param", True)).start()
    yield local
    local.stop()


# A test of how a tree is waited for and ended runs with each kind of tree: a
# cgroup per process where the server may make one, else the process group.
BOTH_TREES = pytest.mark.parametrize(
    "server", [True, False], ids=["cgroup", "process-group"], indirect=True
)


@pytest.fixture
def api(server):
    return Api(server)


# -- envelopes, auth, validation ---------------------------------------------------


def test_healthz_needs_no_key_and_the_api_does(server, api):
    health = requests.get(server.url + "/healthz", timeout=5)
    assert health.status_code == 200
    assert health.json() == {"status": "success", "data": {"up": True}}
    for headers in ({}, {"X-Api-Key": "wrong"}):
        response = requests.get(api.base + "/processes", headers=headers, timeout=5)
        assert response.status_code == 401
        assert response.json()["status"] == "fail"
        assert isinstance(response.json()["data"], dict)
    assert [r.status for r in server.requests_to("list")] == [401, 401]
    listed = api.request("GET", "/processes")
    assert listed.json() == {"status": "success", "data": {"processes": []}}


@pytest.mark.parametrize("header", ["Authorization", "X-Auth-Token", "X-Access-Token"])
def test_a_credential_read_before_the_key_is_another_identity(server, api, header):
    # docs/protocol.md §1: the service reads these before X-Api-Key.
    response = api.request("GET", "/processes", headers={header: "someone else"})
    assert response.status_code == 401 and response.json()["status"] == "fail"
    (record,) = server.requests_to("list")
    assert record.credentials == ("X-Api-Key", header)
    assert api.request("GET", "/processes").status_code == 200


def test_unknown_ids_and_bad_requests_are_refused(server, api):
    other = requests.get(
        server.url + "/v1/sandboxes/sb_nope/processes",
        headers={"X-Api-Key": server.api_key},
        timeout=5,
    )
    assert other.status_code == 404 and other.json()["status"] == "fail"
    assert api.request("GET", "/processes/proc_missing").status_code == 404
    assert api.request("GET", "/processes/proc_missing/connect?after=0").status_code == 404
    assert api.request("DELETE", "/processes/proc_missing").status_code == 404
    bad_bodies = [
        ({"data": b"{not json"}, "body"),
        ({"json": [1, 2]}, "body"),
        ({"json": {"cmd": ""}}, "cmd"),
        ({"json": {"cmd": "true", "args": "x"}}, "args"),
        ({"json": {"cmd": "no-such-command-for-the-local-server"}}, "cmd"),
        ({"json": {"cmd": "true", "cwd": "/no/such/dir"}}, "cwd"),
        ({"json": {"cmd": "true", "pty": [24, 80]}}, "pty"),
        ({"json": {"cmd": "true", "env": {"UNDECLARED": "1"}}}, "env"),
    ]
    for kwargs, field in bad_bodies:
        response = api.request("POST", "/processes", **kwargs)
        assert response.status_code == 400, kwargs
        assert response.json()["status"] == "fail" and field in response.json()["data"]
    assert server.processes() == []


def test_declared_env_keys_may_be_overridden(server):
    server.add_sandbox("sb_env", envs={"GREETING": "hello", "OTHER": "x"})
    api = Api(server, "sb_env")
    process_id = api.create(
        "sh", "-c", 'printf "%s %s" "$GREETING" "$OTHER"', env={"GREETING": "bye"}
    )
    assert payloads(api.frames(process_id)) == [(1, "stdout", b"bye x")]
    assert server.processes("sb_env")[0]["process_id"] == process_id
    assert server.processes() == []


def test_process_record_shape(server, api):
    process_id = api.create("sleep", "5")
    assert PROCESS_ID.fullmatch(process_id)
    record = api.request("GET", "/processes/%s" % process_id).json()["data"]
    # The fields the official SDK reads are its test's (test_sdk_fidelity); these are the rest.
    assert record["process_id"] == process_id and RFC3339_UTC.fullmatch(record["created_at"])
    assert os.path.isdir(record["cwd"])
    assert record["output"] == {"oldest_seq": 0, "newest_seq": 0, "bytes": 0}
    listed = api.request("GET", "/processes").json()["data"]["processes"]
    assert [p["process_id"] for p in listed] == [process_id]
    assert server.process(process_id)["pid"] == record["pid"]
    with pytest.raises(KeyError):
        server.process("proc_unknown")


def listing(api: Api, **params) -> dict:
    response = api.request("GET", "/processes", params=params)
    assert response.status_code == 200, response.text
    return response.json()["data"]


def test_the_alternative_listing_is_paginated():
    with LocalServer(reading="alternative", list_page_size=2) as server:
        api = Api(server)
        assert listing(api) == {"data": [], "pagination": {"limit": 2, "offset": 0, "total": 0}}
        created = [api.create("sleep", "100") for _ in range(5)]
        # Following the pages is the SDK's (test_sdk_fidelity) and the client's (test_listing).
        first = listing(api)
        assert first["pagination"] == {"limit": 2, "offset": 0, "total": 5}
        assert [p["process_id"] for p in first["data"]] == created[:2]
        assert [p["process_id"] for p in listing(api, limit=3, offset=1)["data"]] == created[1:4]
        assert listing(api, limit=1000)["pagination"]["limit"] == 500  # clamped
        assert listing(api, offset=9) == {
            "data": [],
            "pagination": {"limit": 2, "offset": 9, "total": 5},
        }
        for params in ({"limit": 0}, {"limit": "x"}, {"offset": -1}):
            response = api.request("GET", "/processes", params=params)
            assert response.status_code == 400 and response.json()["status"] == "fail", params
        api.request("DELETE", "/processes/%s" % created[0], params={"grace_ms": 0})
        after_delete = listing(api, limit=10)  # a deleted process is forgotten
        assert [p["process_id"] for p in after_delete["data"]] == created[1:]
        assert after_delete["pagination"]["total"] == 4
    with pytest.raises(ValueError):
        LocalServer(list_page_size=0)
    with pytest.raises(ValueError):
        LocalServer(list_page_size=501)


def test_the_conservative_listing_is_not_paginated():
    with LocalServer(list_page_size=1) as server:
        api = Api(server)
        created = [api.create("sleep", "100") for _ in range(3)]
        for params in ({}, {"limit": 1, "offset": 1}):  # both ignored
            data = listing(api, **params)
            assert list(data) == ["processes"]
            assert [p["process_id"] for p in data["processes"]] == created


# -- output streams --------------------------------------------------------------


def test_stdout_and_stderr_share_one_sequence_then_exit(server, api):
    process_id = api.sh("printf a; sleep 0.1; printf b >&2; sleep 0.1; printf c; exit 3")
    response = api.connect(process_id)
    assert response.headers["Content-Type"] == "application/x-ndjson"
    assert response.headers["Transfer-Encoding"] == "chunked"
    frames = read_frames(response)
    assert streams_of(frames) == {"stdout": b"ac", "stderr": b"b"}
    assert frames[-1] == {"type": "exit", "exit_code": 3}
    newest = len(payloads(frames))
    assert server.process(process_id)["output"] == {
        "oldest_seq": 1,
        "newest_seq": newest,
        "bytes": 3,
    }
    # The connection stays usable after the stream's terminating chunk.
    assert api.request("GET", "/processes").status_code == 200
    ports = {r.client_port for r in server.requests if r.path.endswith(("/connect", "/processes"))}
    assert len(ports) == 1


def test_heartbeats_fill_silence():
    with LocalServer(heartbeat_interval=0.2) as server:
        api = Api(server)
        frames = api.frames(api.create("sleep", "0.9"))
    assert frames[-1] == {"type": "exit", "exit_code": 0}
    assert all(f == {"type": "heartbeat"} for f in frames[:-1])
    assert 3 <= len(frames) - 1 <= 5


def test_after_replays_only_newer_frames(server, api):
    process_id = finished_three_frames(api)
    assert [p[0] for p in payloads(api.frames(process_id, after=0))] == [1, 2, 3]
    tail = api.frames(process_id, after=2)
    assert payloads(tail) == [(3, "stdout", b"3")] and tail[-1]["type"] == "exit"
    assert api.frames(process_id, after=3) == [{"type": "exit", "exit_code": 0}]
    for bad in ("-1", "x", "1.5", ""):
        response = api.request("GET", "/processes/%s/connect" % process_id, params={"after": bad})
        assert response.status_code == 400, bad


def test_connect_without_after_serves_from_the_start(server, api):
    process_id = api.sh("printf 1; sleep 0.3; printf 2")
    live = api.request("GET", "/processes/%s/connect" % process_id, stream=True)
    assert live.status_code == 200
    frames = read_frames(live)  # attached while running: replay, then live frames
    assert streams_of(frames) == {"stdout": b"12"}
    assert frames[-1] == {"type": "exit", "exit_code": 0}
    finished = api.request("GET", "/processes/%s/connect" % process_id, stream=True)
    assert read_frames(finished) == frames  # after exit: the whole journal again
    assert [r.query for r in server.requests_to("connect")] == [{}, {}]


def test_several_readers_see_the_same_live_output(server, api):
    process_id = api.sh("sleep 0.2; printf x; sleep 0.2; printf y >&2")

    def read():
        return Api(server).frames(process_id)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first, second = list(pool.map(lambda _: read(), range(2)))
    assert payloads(first) == payloads(second)
    assert streams_of(first) == {"stdout": b"x", "stderr": b"y"}
    assert first[-1] == second[-1] == {"type": "exit", "exit_code": 0}


def test_evicted_output_answers_410(server, api):
    process_id = finished_three_frames(api)
    server.evict(process_id)
    assert server.process(process_id)["output"] == {"oldest_seq": 4, "newest_seq": 3, "bytes": 0}
    for after in (0, 2):
        response = api.connect(process_id, after)
        assert response.status_code == 410
        assert response.json() == {
            "status": "fail",
            "data": {"error": "output_offset_expired", "oldest_available_seq": 4},
        }
    assert api.frames(process_id, after=3) == [{"type": "exit", "exit_code": 0}]


def test_reader_behind_eviction_gets_an_error_frame():
    with LocalServer(journal_limit=64 * 1024) as server:
        api = Api(server)
        # The pause lets the stream start before any output exists (else 410).
        response = api.connect(api.sh("sleep 0.3; head -c 30000000 /dev/zero"))
        assert response.status_code == 200
        time.sleep(1.3)  # the output outruns the socket buffers and the 64 KiB journal
        frames = read_frames(response)
    seqs = [f["seq"] for f in frames[:-1]]  # may be empty: eviction can win at once
    assert seqs == list(range(1, len(seqs) + 1))
    assert frames[-1]["type"] == "error" and frames[-1]["error"] == "output_offset_expired"
    assert frames[-1]["oldest_available_seq"] > len(seqs) + 1


# -- wait, delete, stdin, signal ------------------------------------------------------


@BOTH_TREES
def until_told(go) -> str:
    """A child left in the background that lives until the file `go` exists."""
    return "(while [ ! -e %s ]; do sleep 0.02; done) >/dev/null 2>&1 &" % shlex.quote(str(go))


def test_wait_for_leader_and_for_tree(server, api, tmp_path):
    process_id = api.sh(until_told(tmp_path / "go") + " exit 0")
    leader = api.wait(process_id, scope="leader")
    assert leader["leader_exited"] is True and leader["tree_exited"] is False
    expired = api.request(
        "GET", "/processes/%s/wait" % process_id, params={"scope": "tree", "timeout_ms": 50}
    )
    assert expired.status_code == 408 and expired.json()["status"] == "fail"
    assert server.tree_alive(process_id)
    (tmp_path / "go").touch()
    assert api.wait(process_id, scope="tree")["tree_exited"] is True
    assert not server.tree_alive(process_id)
    for params in ({"scope": "all"}, {"scope": "tree", "timeout_ms": "soon"}):
        response = api.request("GET", "/processes/%s/wait" % process_id, params=params)
        assert response.status_code == 400, params


def test_wait_without_scope_waits_for_the_leader(server, api, tmp_path):
    process_id = api.sh("sleep 0.2; " + until_told(tmp_path / "go") + " exit 0")
    for params in ({}, {"scope": ""}):  # left out (PY, Java, Rust) or empty (Go)
        response = api.request("GET", "/processes/%s/wait" % process_id, params=params)
        assert response.status_code == 200, params
        record = response.json()["data"]
        assert record["leader_exited"] is True and record["tree_exited"] is False
    (tmp_path / "go").touch()
    assert server.wait_tree_gone(process_id)


def test_wait_without_timeout_is_a_bounded_long_poll(server, api):
    server.reading = dataclasses.replace(server.reading, wait_default_ms=300)  # not 30 000
    process_id = api.create("sleep", "100")
    started = time.monotonic()
    response = api.request("GET", "/processes/%s/wait" % process_id)
    assert response.status_code == 408 and response.json()["status"] == "fail"
    assert 0.3 <= time.monotonic() - started < 5


@BOTH_TREES
def test_delete_kills_a_tree_that_ignores_sigterm(server, api):
    process_id = api.sh('trap "" TERM; sleep 100 & sleep 100')
    time.sleep(0.2)  # let both sleeps start
    assert server.tree_alive(process_id)
    started = time.monotonic()
    response = api.request("DELETE", "/processes/%s?grace_ms=300" % process_id)
    assert response.status_code == 200
    assert time.monotonic() - started >= 0.3
    record = response.json()["data"]
    assert record["tree_exited"] is True and record["leader_exited"] is True
    assert (record["signal"], record["state"]) == ("SIGKILL", "exited")
    assert not server.tree_alive(process_id)
    again = api.request("DELETE", "/processes/%s?grace_ms=300" % process_id)
    assert again.status_code == 200 and again.json()["data"]["tree_exited"] is True
    assert api.request("GET", "/processes/%s" % process_id).status_code == 200
    assert api.frames(process_id)[-1] == {"type": "exit", "signal": "SIGKILL"}


def test_input_reaches_stdin_and_close_is_409_twice(server, api):
    process_id = api.create("cat")

    def send(data: bytes) -> requests.Response:
        return api.request(
            "POST",
            "/processes/%s/input" % process_id,
            json={"data_base64": base64.b64encode(data).decode()},
        )

    assert send(b"hello ").json() == {"status": "success", "data": {"input_seq": 1}}
    assert send(b"world").json()["data"] == {"input_seq": 2}
    close = "/processes/%s/stdin/close" % process_id
    assert api.request("POST", close).json() == {"status": "success", "data": {"ok": True}}
    assert api.request("POST", close).status_code == 409
    assert send(b"late").status_code == 409
    frames = api.frames(process_id)
    assert b"".join(p[2] for p in payloads(frames)) == b"hello world"
    assert frames[-1] == {"type": "exit", "exit_code": 0}
    assert api.request("POST", close).status_code == 409
    bad = api.request("POST", "/processes/%s/input" % process_id, json={"data_base64": "@@"})
    assert bad.status_code == 400


def test_input_is_refused_after_exit_and_when_too_big(server, api):
    process_id = api.create("cat")
    big = base64.b64encode(b"x" * 300 * 1024).decode()
    too_big = api.request("POST", "/processes/%s/input" % process_id, json={"data_base64": big})
    assert too_big.status_code in (400, 413)
    api.request("POST", "/processes/%s/stdin/close" % process_id)
    api.wait(process_id, scope="leader")
    late = api.request("POST", "/processes/%s/input" % process_id, json={"data_base64": "eA=="})
    assert late.status_code == 409


def test_signal_is_delivered(server, api):
    process_id = api.create("sleep", "100")
    path = "/processes/%s/signal" % process_id
    for name in ("SIGSTOP", "TERM", None):
        assert api.request("POST", path, json={"signal": name}).status_code == 400
    ok = api.request("POST", path, json={"signal": "SIGUSR1"})
    assert ok.json() == {"status": "success", "data": {"ok": True}}
    assert api.wait(process_id, scope="leader")["signal"] == "SIGUSR1"
    assert api.request("POST", path, json={"signal": "SIGTERM"}).status_code == 409


def cgroup_of(pid: int) -> str:
    """The directory of the cgroup v2 that `pid` is in ("" without cgroup v2)."""
    with open("/proc/%d/cgroup" % pid) as cgroups:
        paths = [line[3:].strip() for line in cgroups if line.startswith("0::")]
    return str(cgroup2_mount()) + paths[0] if paths else ""


def test_a_cgroup_holds_a_double_forked_daemon_in_the_tree_until_it_ends():
    with LocalServer() as server:
        require_cgroup(server)
        api = Api(server)
        process_id = api.sh(DAEMON)
        workdir = server.process(process_id)["cwd"]
        daemon = daemon_pid(workdir)
        os.remove(os.path.join(workdir, "daemon"))
        api.sh(DAEMON)  # left to stop()
        survivor = daemon_pid(workdir)
        cgroup = cgroup_of(daemon)
        assert cgroup.endswith("/" + process_id)
        assert cgroup_of(server.process(process_id)["pid"]) == cgroup != cgroup_of(survivor)
        path = "/processes/%s" % process_id
        assert api.request("POST", path + "/signal", json={"signal": "SIGKILL"}).status_code == 200
        assert api.wait(process_id, scope="leader")["tree_exited"] is False
        expired = api.request("GET", path + "/wait", params={"scope": "tree", "timeout_ms": 50})
        assert expired.status_code == 408 and alive(daemon)
        deleted = api.request("DELETE", path + "?grace_ms=5000")
        assert deleted.json()["data"]["tree_exited"] is True
        assert not alive(daemon) and not os.path.exists(cgroup)
        assert alive(survivor)
    assert not alive(survivor) and not os.path.exists(os.path.dirname(cgroup))


def test_without_cgroups_a_double_forked_daemon_is_out_of_the_tree():
    with LocalServer(cgroups=False) as server:
        assert server.containment == "process group"
        api = Api(server)
        process_id = api.sh(DAEMON)
        daemon = daemon_pid(server.process(process_id)["cwd"])
        try:
            deleted = api.request("DELETE", "/processes/%s?grace_ms=300" % process_id)
            assert deleted.json()["data"]["tree_exited"] is True and alive(daemon)
        finally:
            os.kill(daemon, signal.SIGKILL)


# -- strict mode ------------------------------------------------------------------


def test_strict_mode_wants_framed_json_posts():
    with LocalServer(strict=True) as server:
        api = Api(server)
        for content_type in ("application/json", "Application/JSON; charset=utf-8"):
            created = api.request(
                "POST", "/processes", data=b'{"cmd": "cat"}', headers={"Content-Type": content_type}
            )
            assert created.status_code == 200, content_type
            process_id = created.json()["data"]["process_id"]
        create = json.dumps({"cmd": "true"}).encode()
        for head in ("", "Content-Type: text/plain\r\n", "Content-Type: application/jsonx\r\n"):
            framed = head + "Content-Length: %d\r\n" % len(create)
            status, answer = raw_request(server, "POST", "/processes", framed, create)
            assert (status, answer["status"]) == (400, "fail"), head
            assert "content_type" in answer["data"]
        chunked = "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        body = b"%X\r\n%s\r\n0\r\n\r\n" % (len(create), create)
        assert raw_request(server, "POST", "/processes", chunked, body)[0] == 200
        assert len(server.processes()) == 3  # the refused ones started nothing

        close = "/processes/%s/stdin/close" % process_id
        json_type = "Content-Type: application/json\r\n"
        status, answer = raw_request(server, "POST", close, json_type)  # no Content-Length
        assert (status, answer["status"]) == (411, "fail") and "body" in answer["data"]
        status, _ = raw_request(server, "POST", close, "Content-Length: 0\r\n")  # not JSON
        assert status == 400
        assert raw_request(server, "POST", close, json_type + "Content-Length: 0\r\n")[0] == 200
        assert [r.status for r in server.requests_to("stdin_close")] == [411, 400, 200]


def test_without_strict_mode_posts_need_no_framing_headers(server):
    process_id = Api(server).create("cat")
    close = "/processes/%s/stdin/close" % process_id
    assert raw_request(server, "POST", close)[0] == 200  # neither Content-Length nor type
    create = b'{"cmd": "true"}'
    head = "Content-Type: text/plain\r\nContent-Length: %d\r\n" % len(create)
    assert raw_request(server, "POST", "/processes", head, create)[0] == 200


# -- rate limit -------------------------------------------------------------------


def test_rate_limit_refuses_without_acting_and_says_when_to_come_back():
    with LocalServer(rate_limit=(3, 2.0)) as server:
        api = Api(server)
        started = time.monotonic()
        assert [api.request("GET", "/processes").status_code for _ in range(3)] == [200] * 3
        admitted_by = time.monotonic()
        refused = api.request("POST", "/processes", json={"cmd": "sleep", "args": ["5"]})
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "2"  # the first admission leaves in 2 s
        assert refused.json()["status"] == "fail" and "rate_limit" in refused.json()["data"]
        assert server.processes() == []  # not created
        assert requests.get(server.url + "/healthz", timeout=5).status_code == 429  # any path
        time.sleep(max(0.0, started + 1.2 - time.monotonic()))
        assert api.request("GET", "/processes").headers["Retry-After"] == "1"  # 0.8 s, rounded up
        time.sleep(max(0.0, admitted_by + 2.05 - time.monotonic()))
        assert api.create("true")  # a place is free again: the keep-alive connection works
        statuses = [r.status for r in server.requests]
        assert statuses == [200, 200, 200, 429, 429, 429, 200]
        assert len(server.requests_to("create")) == 2  # the refused one is recorded too
        api_ports = {r.client_port for r in server.requests if r.path.endswith("/processes")}
        assert len(api_ports) == 1  # a refused POST's body was read: keep-alive holds


def test_rate_limit_counts_only_admitted_requests():
    with LocalServer(rate_limit=(2, 0.6)) as server:
        api = Api(server)
        started = time.monotonic()
        assert [api.request("GET", "/processes").status_code for _ in range(2)] == [200, 200]
        admitted_by = time.monotonic()
        while time.monotonic() - started < 0.5:  # refused, and not counted
            assert api.request("GET", "/processes").status_code == 429
            time.sleep(0.02)
        time.sleep(max(0.0, admitted_by + 0.65 - time.monotonic()))
        assert [api.request("GET", "/processes").status_code for _ in range(3)] == [200, 200, 429]


def test_rate_limit_is_per_client_address_and_thread_safe():
    with LocalServer(rate_limit=(5, 60.0)) as server:
        server.fail("list", 503, count=100)  # a refused request must not consume faults

        def ask(_):
            return raw_request(server, "GET", "/processes")[0]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(ask, range(40)))
        assert sorted(statuses) == [429] * 35 + [503] * 5
        other = [raw_request(server, "GET", "/processes", source="127.0.0.2")[0] for _ in range(6)]
        assert other == [503] * 5 + [429]
        assert sum(r.status == 429 for r in server.requests) == 36
    for bad in ((0, 1.0), (1, 0), (1.5, 1.0), (1, float("inf"))):
        with pytest.raises(ValueError):
            LocalServer(rate_limit=bad)


# -- files and exec ---------------------------------------------------------------


@pytest.mark.parametrize("reading", ["conservative", "alternative"])
def test_files_put_and_get(tmp_path, reading):
    with LocalServer(reading=reading) as server:
        put_and_get(Api(server), tmp_path / "new" / "dir" / "secret.bin")


def put_and_get(api: Api, target) -> None:
    server = api.server
    payload = bytes(range(256)) * 8
    octets = {"Content-Type": "application/octet-stream"}
    put = api.request("PUT", "/files", params={"path": str(target)}, data=payload, headers=octets)
    if not server.reading.upload_creates_parents:
        assert put.status_code == 404 and not target.parent.exists()
        target.parent.mkdir(parents=True)
        put = api.request("PUT", "/files", params={"path": str(target)}, data=iter([payload]))
    assert put.json() == {"status": "success", "data": {"path": str(target), "bytes": 2048}}
    assert target.read_bytes() == payload
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    got = api.request("GET", "/files", params={"path": str(target)})
    assert got.status_code == 200 and got.content == payload
    assert got.headers["Content-Type"] == "application/octet-stream"
    assert api.request("GET", "/files", params={"path": "relative"}).status_code == 400
    assert api.request("PUT", "/files", params={"path": "relative"}, data=b"x").status_code == 400


def test_files_larger_than_the_limit_are_refused_with_413(tmp_path):
    with LocalServer(file_size_limit=10) as server:
        api = Api(server)
        for body in (b"x" * 11, iter([b"x" * 6, b"x" * 5])):  # Content-Length, then chunked
            answer = api.request("PUT", "/files", params={"path": str(tmp_path / "f")}, data=body)
            assert answer.status_code == 413
        assert os.listdir(tmp_path) == []
        answer = api.request("PUT", "/files", params={"path": str(tmp_path / "f")}, data=b"x" * 10)
        assert answer.status_code == 200
    with pytest.raises(ValueError):
        LocalServer(file_size_limit=-1)


def test_file_faults_cut_corrupt_and_lose_answers(server, api, tmp_path):
    path = str(tmp_path / "f")
    server.drop_upload(after_bytes=3)
    with pytest.raises(requests.ConnectionError):
        api.request("PUT", "/files", params={"path": path}, data=b"abcdef")
    assert open(path, "rb").read() == b"abc"  # what a cut upload leaves
    server.corrupt_files("files_put")
    api.request("PUT", "/files", params={"path": path}, data=b"abcdef")
    assert open(path, "rb").read() == b"\x9ebcdef"
    server.drop_download(after_bytes=2)
    with pytest.raises(requests.exceptions.ChunkedEncodingError):  # a body cut short
        api.request("GET", "/files", params={"path": path})
    server.corrupt_files("files_get")
    assert api.request("GET", "/files", params={"path": path}).content == b"abcdef"  # flipped back
    server.drop_download(after_bytes=1, skip=1)  # the next download is whole, the one after cut
    assert api.request("GET", "/files", params={"path": path}).content == b"\x9ebcdef"
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        api.request("GET", "/files", params={"path": path})
    server.lose_exec_response()
    with pytest.raises(requests.ConnectionError):
        api.request("POST", "/exec", json={"cmd": "touch", "args": [path + ".ran"]})
    assert os.path.exists(path + ".ran")  # it ran, its answer was lost
    with pytest.raises(ValueError):
        server.corrupt_files("exec")


def test_a_buffered_exec_answers_once_the_command_ended(server, api):
    response = api.request(
        "POST",
        "/exec",
        json={"cmd": "sh", "args": ["-c", "cat; printf err >&2; exit 4"], "stdin": "in"},
    )
    data = response.json()["data"]
    assert data["result"] == {"stdout": "in", "stderr": "err", "exit_code": 4}
    assert isinstance(data["exec_ms"], float) and data["exec_ms"] >= 0


def exec_stream(api: Api, script: str, **spec) -> tuple:
    """A streamed exec of `script` (sh -c): (its lines, whether its body ended cleanly)."""
    body = dict(spec, cmd="sh", args=["-c", script])
    response = api.request("POST", "/exec?stream=true", json=body, stream=True)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"] == "application/x-ndjson"
    lines: list = []
    try:
        read_frames(response, lines)
    except urllib3.exceptions.ProtocolError:  # broken, or closed without the last chunk
        return lines, False
    return lines, True


def runs_of(lines: list) -> list:
    """(stream, text) of each run of output lines of one stream, heartbeats left out."""
    runs: list = []
    for line in lines:
        ((stream, text),) = line.items()
        if stream in ("stdout", "stderr"):
            if runs and runs[-1][0] == stream:
                runs[-1] = (stream, runs[-1][1] + text)
            else:
                runs.append((stream, text))
    return runs


def test_a_streamed_exec_relays_both_streams_as_written_then_the_exit_code(server, api):
    # "é" is written in two halves a tenth of a second apart: two reads of the pipe.
    script = "cat; printf 'h\\303'; sleep 0.1; printf '\\251\\n'; sleep 0.1; printf err >&2; exit 4"
    lines, ended = exec_stream(api, script, stdin="in")
    assert ended and lines[-1] == {"exit_code": 4}
    # Each stream whole and in its order (which of the two is read first is the machine's).
    texts = {name: "".join(line.get(name, "") for line in lines) for name in ("stdout", "stderr")}
    assert texts == {"stdout": "inh\u00e9\n", "stderr": "err"}
    assert exec_stream(api, "kill -KILL $$") == ([{"exit_code": 137}], True)
    body = {"cmd": "/nonexistent/command", "stream": True}  # the body's field, as ?stream=true
    refused = api.request("POST", "/exec", json=body)
    assert refused.status_code == 400 and "cannot start" in refused.json()["data"]["cmd"]
    server.fail("exec", 503)
    assert api.request("POST", "/exec", json=dict(body, cmd="true")).status_code == 503


def test_a_silent_streamed_exec_sends_heartbeats():
    with LocalServer(heartbeat_interval=0.2) as server:
        lines, ended = exec_stream(Api(server), "sleep 0.7; echo done")
    assert ended and lines[-2:] == [{"stdout": "done\n"}, {"exit_code": 0}]
    assert len(lines) >= 3 and all(line == {"hb": True} for line in lines[:-2])


EXEC_SCRIPT = "printf 'head\\n'; sleep 0.1; printf 'ABC\\n'; sleep 0.1; printf end"
EXEC_OUTPUT = "head\nABC\nend"


@pytest.mark.parametrize(
    "fault, stdout, exit_code",
    [("drop", "head\nAB", None), ("corrupt", "head\nBBC\nend", 0), ("lose", EXEC_OUTPUT, None)],
)
def test_exec_stream_faults_cut_change_or_lose_the_end(
    server, api, tmp_path, fault, stdout, exit_code
):
    if fault == "lose":
        server.lose_exec_response()
    else:  # a buffered exec leaves them queued, and `skip` spares a whole stream
        options = {"after_bytes": 7} if fault == "drop" else {}
        getattr(server, fault + "_exec_stream")(skip=1, **options)
        buffered = api.request("POST", "/exec", json={"cmd": "sh", "args": ["-c", EXEC_SCRIPT]})
        assert buffered.json()["data"]["result"]["stdout"] == EXEC_OUTPUT
        assert exec_stream(api, EXEC_SCRIPT)[0][-1] == {"exit_code": 0}
    pid_file = tmp_path / "pid"
    # A cut stream's command is killed: it would otherwise sleep on.
    linger = "echo $$ > %s; %s; exec sleep 60" % (shlex.quote(str(pid_file)), EXEC_SCRIPT)
    lines, ended = exec_stream(api, linger if fault == "drop" else EXEC_SCRIPT)
    assert runs_of(lines) == [("stdout", stdout)]
    assert ended == (exit_code is not None)
    assert ("exit_code" in lines[-1]) == ended and lines[-1].get("exit_code") == exit_code
    if fault == "drop":
        assert not alive(int(pid_file.read_text()))
    lines, ended = exec_stream(api, EXEC_SCRIPT)  # the fault is spent
    assert ended and runs_of(lines) == [("stdout", EXEC_OUTPUT)]


# -- fault injection ------------------------------------------------------------


def test_fail_answers_without_performing_the_operation(server, api):
    server.fail("create", 503, retry_after="2")
    response = api.request("POST", "/processes", json={"cmd": "sleep", "args": ["5"]})
    assert response.status_code == 503 and response.headers["Retry-After"] == "2"
    assert response.json()["status"] == "error" and response.json()["code"] == 503
    assert server.processes() == []
    server.fail("list", 429, count=2)
    answers = [api.request("GET", "/processes") for _ in range(3)]
    assert [a.status_code for a in answers] == [429, 429, 200]
    assert answers[0].json()["status"] == "fail" and "Retry-After" not in answers[0].headers
    server.fail("list", 302)
    redirect = api.request("GET", "/processes")
    assert redirect.status_code == 302
    assert redirect.headers["Location"] == "http://127.0.0.2:1/stolen"
    server.fail("list", 200, body={"not": "jsend"})
    assert api.request("GET", "/processes").json() == {"not": "jsend"}
    with pytest.raises(ValueError):
        server.fail("nonsense", 500)


def test_faults_queue_fifo_per_endpoint_and_replay_combines(server, api):
    process_id = finished_three_frames(api)
    server.drop_stream(after_frames=1)
    server.fail("connect", 500)
    status, chunks, complete, _ = raw_connect(server, process_id)
    assert status.endswith(b"200 OK") and len(chunks) == 1 and not complete
    assert api.connect(process_id).status_code == 500
    server.fail("connect", 503)
    server.end_stream()
    assert api.connect(process_id).status_code == 503
    assert api.frames(process_id) == []
    server.replay_ignoring_after()
    server.drop_stream(after_frames=2)  # both hit the next connect
    _, chunks, complete, _ = raw_connect(server, process_id, after=2)
    assert [json.loads(c)["seq"] for c in chunks] == [1, 2] and not complete
    server.end_stream(after_frames=0)
    server.end_stream(after_frames=1)  # first in, first used
    assert api.frames(process_id) == []
    assert len(api.frames(process_id)) == 1
    assert len(payloads(api.frames(process_id))) == 3


def test_drop_stream_closes_the_socket(server, api, capfd):
    process_id = finished_three_frames(api)
    server.drop_stream(after_frames=2)
    _, chunks, complete, partial = raw_connect(server, process_id)
    assert [json.loads(c)["seq"] for c in chunks] == [1, 2]
    assert not complete and partial == b""
    assert server.requests_to("connect")[-1].status == 0

    server.drop_stream(after_frames=1, mid_frame=True)
    _, chunks, complete, partial = raw_connect(server, process_id)
    assert [json.loads(c)["seq"] for c in chunks] == [1]
    assert not complete and partial.startswith(b'{"type":"data","seq":2')
    assert not partial.endswith(b"\n")

    server.drop_stream(after_frames=3)  # the trigger also fires before the exit frame
    _, chunks, complete, _ = raw_connect(server, process_id)
    assert len(chunks) == 3 and not complete
    assert capfd.readouterr() == ("", "")  # dropped connections make no noise


def test_end_stream_ends_the_body_without_exit(server, api):
    process_id = finished_three_frames(api)
    server.end_stream(after_frames=1)
    _, chunks, complete, _ = raw_connect(server, process_id)
    assert [json.loads(c)["type"] for c in chunks] == ["data"] and complete
    server.end_stream(after_frames=2)
    assert [f["type"] for f in api.frames(process_id)] == ["data", "data"]
    assert api.request("GET", "/processes").status_code == 200  # keep-alive survives
    last = server.requests_to("connect")[-1:] + server.requests_to("list")[-1:]
    assert len({r.client_port for r in last}) == 1


def test_stall_stream_sends_nothing_then_closes():
    with LocalServer(heartbeat_interval=0.1) as server:
        api = Api(server)
        process_id = finished_three_frames(api)
        server.stall_stream(after_frames=1, seconds=0.6)
        started = time.monotonic()
        _, chunks, complete, _ = raw_connect(server, process_id)
        assert time.monotonic() - started >= 0.6
    assert [json.loads(c)["seq"] for c in chunks] == [1]  # no heartbeat during the stall
    assert not complete


def test_corrupt_stream_inserts_a_line(server, api):
    process_id = finished_three_frames(api)
    server.corrupt_stream(b"not json", after_frames=1)
    _, chunks, complete, _ = raw_connect(server, process_id)
    assert chunks[1] == b"not json\n" and len(chunks) == 5 and complete
    kept = [json.loads(c)["type"] for i, c in enumerate(chunks) if i != 1]
    assert kept == ["data"] * 3 + ["exit"]


def test_corrupt_stream_can_end_the_body_after_the_line(server, api):
    process_id = finished_three_frames(api)
    server.corrupt_stream(b'{"type":"exit"}', after_frames=1, last=True)
    _, chunks, complete, _ = raw_connect(server, process_id)
    assert [json.loads(c) for c in chunks] == [
        {"type": "data", "seq": 1, "stream": "stdout", "data_base64": "MQ=="},
        {"type": "exit"},
    ]
    assert complete  # a clean end, as after a real exit frame


def test_replay_ignoring_after(server, api):
    process_id = finished_three_frames(api)
    server.replay_ignoring_after()
    assert [p[0] for p in payloads(api.frames(process_id, after=2))] == [1, 2, 3]
    assert [p[0] for p in payloads(api.frames(process_id, after=2))] == [3]
    server.evict(process_id)
    server.replay_ignoring_after()  # an expired cursor is not refused either
    assert api.frames(process_id, after=0) == [{"type": "exit", "exit_code": 0}]
    assert api.connect(process_id, after=0).status_code == 410


# -- lifecycle and command line ---------------------------------------------------


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup", "process-group"])
def test_stop_kills_remaining_groups_and_removes_temp_dirs(cgroups):
    server = LocalServer(cgroups=cgroups).start()
    api = Api(server)
    process_id = api.sh("sleep 100 & sleep 100")
    time.sleep(0.1)
    workdir = server.process(process_id)["cwd"]
    server.stop()
    assert not server.tree_alive(process_id)
    assert not os.path.exists(workdir)
    with pytest.raises(requests.ConnectionError):
        requests.get(server.url + "/healthz", timeout=2)


def test_binds_loopback_only():
    for host in ("0.0.0.0", "192.0.2.1", "example.com"):
        with pytest.raises(ValueError):
            LocalServer(host=host)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_cli_prints_its_url_first_and_stops_on_a_signal(signum):
    cli = subprocess.Popen(
        [*SERVER_CLI, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert select.select([cli.stdout], [], [], 10)[0], "no URL within 10 s"
        url = cli.stdout.readline().decode()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+\n", url)
        health = requests.get(url.strip() + "/healthz", timeout=5)
        assert health.json()["data"] == {"up": True}
        cli.send_signal(signum)
        assert cli.wait(timeout=10) == 0
        assert cli.stdout.read() == b"" and cli.stderr.read() == b""
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        cli.stdout.close()
        cli.stderr.close()


@contextlib.contextmanager
def cli_server(*args: str):
    """The command-line server started with `args`, as an Api on its sandbox."""
    cli = subprocess.Popen(
        [*SERVER_CLI, "--port", "0", *args],
        stdout=subprocess.PIPE,
    )
    try:
        assert select.select([cli.stdout], [], [], 10)[0], "no URL within 10 s"
        url = cli.stdout.readline().decode().strip()
        yield Api(types.SimpleNamespace(url=url, api_key=DEFAULT_API_KEY))  # type: ignore[arg-type]
    finally:
        cli.send_signal(signal.SIGTERM)
        try:
            cli.wait(timeout=10)
        finally:
            if cli.poll() is None:
                cli.kill()
                cli.wait()
            cli.stdout.close()


def refusal(*args: str) -> bytes:
    """What the command-line server prints to stderr when it refuses `args`
    (it must exit with status 2, the status of a usage error)."""
    shown = subprocess.run([*SERVER_CLI, *args], stderr=subprocess.PIPE, timeout=10)
    assert shown.returncode == 2, (args, shown.stderr)
    return shown.stderr


def test_cli_strict_flag():
    with cli_server("--strict") as api:
        answer = api.request(
            "POST", "/processes", data=b'{"cmd": "true"}', headers={"Content-Type": "text/plain"}
        )
        assert answer.status_code == 400 and "content_type" in answer.json()["data"]
        assert api.request("POST", "/processes", json={"cmd": "true"}).status_code == 200


def test_cli_rate_limit_flag():
    with cli_server("--rate-limit", "2/60") as api:
        statuses = [api.request("GET", "/processes").status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
    for bad in ("2", "x/60", "0/60", "2/0", "2/-1"):
        assert b"N/SECONDS" in refusal("--rate-limit", bad), bad


def test_cli_reading_and_list_page_size_flags():
    with cli_server("--reading", "alternative", "--list-page-size", "1") as api:
        created = [api.create("true") for _ in range(2)]
        page = api.request("GET", "/processes").json()["data"]
        assert [p["process_id"] for p in page["data"]] == created[:1]
        assert page["pagination"] == {"limit": 1, "offset": 0, "total": 2}
    assert b"list_page_size" in refusal("--list-page-size", "0")


def test_cli_set_flag_changes_one_field_of_the_reading():
    with cli_server("--set", "create_status=201", "--set", "listing=paginated") as api:
        assert api.request("POST", "/processes", json={"cmd": "true"}).status_code == 201
        assert "pagination" in api.request("GET", "/processes").json()["data"]
    for bad in ("create_status", "nothing=1", "exit_after=never", "wait_cap=soon"):
        assert b"error:" in refusal("--set", bad), bad


def test_cli_help_carries_the_warning():
    shown = subprocess.run(
        [*SERVER_CLI, "--help"],
        stdout=subprocess.PIPE,
        timeout=10,
        check=True,
    ).stdout.decode()
    text = " ".join(shown.split())
    assert "RUNS COMMANDS ON THIS MACHINE" in text and "loopback" in text
    assert "signal_target group / leader" in text  # every field of the reading, both values
    assert "cgroup v2 of its own where it may" in text and "--no-cgroups" in text


def test_cli_no_streamed_exec_flag_answers_a_streamed_exec_404():
    with cli_server("--no-streamed-exec") as api:
        for path, body in (("/exec?stream=true", {}), ("/exec", {"stream": True})):
            refused = api.request("POST", path, json=dict(body, cmd="true"))
            assert refused.status_code == 404 and refused.json()["status"] == "fail"
        answer = api.request("POST", "/exec", json={"cmd": "echo", "args": ["buffered"]})
        assert answer.json()["data"]["result"]["stdout"] == "buffered\n"


def test_cli_no_cgroups_flag():
    with cli_server("--no-cgroups") as api:
        record = api.request("GET", "/processes/%s" % api.create("sleep", "30")).json()["data"]
        assert cgroup_of(record["pid"]) == cgroup_of(os.getpid())


# -- PTY processes -------------------------------------------------------------------


@pytest.fixture
def terminal_api(server_reading):
    """An Api on a server that plays the test's reading (§11.20 for terminals)."""
    with LocalServer(reading=server_reading) as local:
        yield Api(local)


def send_input(api: Api, process_id: str, data: bytes) -> requests.Response:
    body = {"data_base64": base64.b64encode(data).decode()}
    return api.request("POST", "/processes/%s/input" % process_id, json=body)


def read_until(lines, wanted: bytes) -> bytes:
    """The pty bytes of a live stream's lines up to the first that hold `wanted`."""
    seen = b""
    for line in lines:
        frame = json.loads(line)
        if frame["type"] == "data":
            assert frame["stream"] == "pty"
            seen += base64.b64decode(frame["data_base64"])
            if wanted in seen:
                return seen
    raise AssertionError("the stream ended without %r: %r" % (wanted, seen))


@pytest.mark.both_readings
def test_a_pty_process_runs_on_a_terminal_of_its_size_with_input_typed(terminal_api):
    api = terminal_api
    script = "tty; stty size; echo TERM=$TERM; read line; echo got $line"
    record = api.request(
        "POST",
        "/processes",
        json={"cmd": "sh", "args": ["-c", script], "pty": {"rows": 30, "cols": 100}},
    ).json()["data"]
    assert record["kind"] == "pty"
    process_id = record["process_id"]
    assert b"TERM=" in read_until(api.connect(process_id).iter_lines(), b"TERM=")
    assert send_input(api, process_id, b"hi\n").json()["data"] == {"input_seq": 1}
    close = api.request("POST", "/processes/%s/stdin/close" % process_id)
    assert close.status_code == 409
    frames = frames_to_the_exit(api, process_id)
    output = b"".join(data for _, stream_name, data in payloads(frames))
    term = api.server.reading.pty_term or ""
    assert output == b"/dev/pts/%s\r\n30 100\r\nTERM=%s\r\nhi\r\ngot hi\r\n" % (
        output.split(b"/dev/pts/")[1].split(b"\r")[0],
        term.encode(),
    )
    assert {name for _, name, _ in payloads(frames)} == {"pty"}
    assert frames[-1]["type"] == "exit" and frames[-1]["exit_code"] == 0
    assert api.wait(process_id)["tree_exited"] is True
    assert (
        api.request(
            "POST", "/processes/%s/resize" % process_id, json={"rows": 5, "cols": 5}
        ).status_code
        == 409
    )


@pytest.mark.both_readings
def test_a_pty_size_left_out_is_the_readings_default_and_a_bad_one_is_refused(terminal_api):
    api = terminal_api
    for bad in ([], {"rows": 0}, {"rows": True}, {"cols": 70000}, {"rows": "24"}):
        refused = api.request("POST", "/processes", json={"cmd": "true", "pty": bad})
        assert refused.status_code == 400, bad
    process_id = api.create("stty", "size", pty={"cols": 90})
    output = b"".join(p[2] for p in payloads(frames_to_the_exit(api, process_id)))
    rows = api.server.reading.pty_default_size.split("x")[0]
    assert output == b"%s 90\r\n" % rows.encode()


WINCH_SCRIPT = "trap 'stty size' WINCH; echo ready; while :; do sleep 0.02; done"


def test_a_resize_is_seen_by_the_program_and_a_pipe_has_none(server, api):
    process_id = api.create("bash", "-c", WINCH_SCRIPT, pty={"rows": 24, "cols": 80})
    stream = api.connect(process_id).iter_lines()
    read_until(stream, b"ready")
    resize = "/processes/%s/resize" % process_id
    for bad in ({"rows": 10}, {"rows": 0, "cols": 5}, {"rows": 1.5, "cols": 5}):
        assert api.request("POST", resize, json=bad).status_code == 400
    ok = api.request("POST", resize, json={"rows": 40, "cols": 120})
    assert ok.json() == {"status": "success", "data": {"ok": True}}
    assert b"40 120" in read_until(stream, b"40 120")
    deleted = api.request("DELETE", "/processes/" + process_id).json()["data"]
    assert deleted["tree_exited"] is True and deleted["foreground"] is None
    pipe = api.create("sleep", "5")
    assert (
        api.request("POST", "/processes/%s/resize" % pipe, json={"rows": 5, "cols": 5}).status_code
        == 409
    )
    assert "foreground" not in api.server.process(pipe)


# The leader hands the terminal to a child in a group of its own; a SIGINT then
# says who got it.
FOREGROUND_CHILD = """
import os, signal, sys, time
def said(who):
    return lambda *_: (print(who, flush=True), os._exit(0))
signal.signal(signal.SIGINT, said("leader"))
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, said("child"))
    os.tcsetpgrp(0, os.getpgrp())
    print("ready", flush=True)
    time.sleep(30)
    os._exit(1)
os.waitpid(child, 0)
"""


@pytest.mark.both_readings
def test_the_view_shows_the_foreground_job_and_sigint_reaches_it_or_the_leader(terminal_api):
    api = terminal_api
    process_id = api.create(sys.executable, "-c", FOREGROUND_CHILD, pty={"rows": 24, "cols": 80})
    read_until(api.connect(process_id).iter_lines(), b"ready")
    record = api.server.process(process_id)
    foreground = record["foreground"]
    assert foreground["pid"] != record["pid"]
    assert (foreground["cmd"], foreground["args"][:1]) == (sys.executable, ["-c"])
    signal_path = "/processes/%s/signal" % process_id
    assert api.request("POST", signal_path, json={"signal": "SIGINT"}).status_code == 200
    output = b"".join(p[2] for p in payloads(frames_to_the_exit(api, process_id)))
    who = b"leader" if api.server.reading.pty_signal_target == "leader" else b"child"
    assert output.endswith(who + b"\r\n")
    api.request("DELETE", "/processes/" + process_id)


# -- the sandbox's lifecycle -------------------------------------------------------

# A process that counts to 40 into a file, 20 times a second: whether it runs shows.
COUNTER = (  # the count written whole (renamed into place): a reader never sees it empty
    "i=0; while [ $i -lt 40 ]; do i=$((i+1)); echo $i > c; mv c count; echo $i; sleep 0.05; done"
)


@contextlib.contextmanager
def lifecycle_server(reading, cgroups: bool = True, **options):
    with LocalServer(reading=reading, cgroups=cgroups, resume_seconds=0.1, **options) as local:
        yield local, Api(local)


def counted(api: Api) -> int:
    path = os.path.join(api.server._sandboxes[DEFAULT_SANDBOX].workdir(), "count")
    try:
        with open(path) as count:
            return int(count.read())
    except FileNotFoundError:  # not written yet
        return 0


def frames_until_halted(stream: requests.Response, reading) -> list:
    """The frames of a stream that its sandbox's pause or destruction ends: cut
    or ended cleanly as the reading says, never with an exit frame."""
    frames: list = []
    cut = (requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError)
    with pytest.raises(cut) if reading.paused_stream == "reset" else contextlib.nullcontext():
        for chunk in stream.raw.read_chunked(decode_content=False):
            frames.append(json.loads(chunk))
    assert all(f["type"] != "exit" for f in frames)
    return frames


def await_status(server: LocalServer, status: str, timeout: float = 5.0) -> None:
    assert server._await(lambda: server.sandbox_status() == status, timeout), status


@pytest.mark.both_readings
@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup", "process-group"])
def test_pause_freezes_the_tree_cuts_streams_and_resume_goes_on_as_the_reading_says(
    server_reading, cgroups
):
    with lifecycle_server(server_reading, cgroups) as (server, api):
        if cgroups:
            require_cgroup(server)
        process_id = api.sh(COUNTER)
        stream = api.connect(process_id)
        time.sleep(0.3)
        assert api.request("POST", "/pause").status_code == 202
        assert api.request("POST", "/pause").status_code == 200  # paused already
        frames_until_halted(stream, server_reading)
        frozen = counted(api)
        time.sleep(0.3)
        assert counted(api) == frozen  # frozen, not ended
        paused = server_reading.paused_answer
        for method, path in (("GET", "/processes/" + process_id), ("POST", "/exec")):
            assert api.request(method, path, json={"cmd": "true"}).status_code == paused
        assert api.request("GET", "").json()["data"]["status"] == "paused"
        resumed = api.request("POST", "/resume")
        assert (resumed.status_code, resumed.json()["data"]["status"]) == (202, "resuming")
        await_status(server, "running")
        if server_reading.resume_keeps_processes:
            assert server._await(lambda: counted(api) > frozen, 5.0)  # it goes on
            output = b"".join(data for _, _, data in payloads(api.frames(process_id)))
            assert output.split() == [b"%d" % i for i in range(1, 41)]  # journal intact
        else:
            assert api.request("GET", "/processes/" + process_id).status_code == 404
            assert server.wait_tree_gone(process_id)  # lost, and nothing left running


@pytest.mark.both_readings
def test_destroy_kills_every_tree_and_the_view_answers_as_the_reading_says(server_reading):
    with lifecycle_server(server_reading) as (server, api):
        process_id = api.sh("sleep 30")
        api.request("POST", "/pause")
        stream_at = api.request("DELETE", "")
        assert (stream_at.status_code, stream_at.json()["data"]["status"]) == (202, "destroying")
        assert server.wait_tree_gone(process_id)  # a frozen tree too
        view = api.request("GET", "")
        assert view.status_code == server_reading.destroyed_view
        if view.status_code == 200:
            assert view.json()["data"]["status"] == "destroyed"
        for method, path in (("GET", "/processes/" + process_id), ("POST", "/resume")):
            expected = 404 if method == "GET" or view.status_code == 404 else 409
            assert api.request(method, path).status_code == expected


def test_a_new_sandbox_is_made_and_lifecycle_changes_are_refused_out_of_turn(server, api):
    made = requests.post(
        server.url + "/v1/sandboxes", headers={"X-Api-Key": server.api_key}, json={}, timeout=10
    )
    assert made.status_code == 201 and made.json()["data"]["status"] == "running"
    other = Api(server, made.json()["data"]["id"])
    assert other.request("POST", "/resume").status_code == 200  # running already
    assert other.request("POST", "/processes", json={"cmd": "true"}).status_code == 200
    server.pause(made.json()["data"]["id"])  # not sb_local:
    assert api.request("POST", "/processes", json={"cmd": "true"}).status_code == 200
    server.destroy(made.json()["data"]["id"])
    assert other.request("POST", "/pause").status_code == 404


@pytest.mark.both_readings
def test_auto_pause_counts_requests_and_by_reading_open_streams(server_reading):
    # One stream for the whole run: none recycled on the way (§11.2 is not asked here).
    reading = dataclasses.replace(server_reading, stream_lifetime=None)
    with lifecycle_server(reading, auto_pause_after=0.5) as (server, api):
        process_id = api.sh("sleep 2.5; echo done")
        stream = api.connect(process_id)
        if server_reading.idle_activity == "streams":
            time.sleep(1.0)  # a quiet stream, no request: twice the idle time allowed
            assert server.sandbox_status() == "running"
            assert b"".join(data for _, _, data in payloads(read_frames(stream))) == b"done\n"
            await_status(server, "paused")  # idle once the stream is over
        else:
            await_status(server, "paused")  # the open stream counts for nothing:
            assert server.journalled(process_id) == []  # frozen before it said "done"
        stream.close()


@pytest.mark.both_readings
@pytest.mark.parametrize("change", ["pause", "destroy"])
def test_pause_or_destroy_at_a_chosen_moment(server_reading, change):
    with lifecycle_server(server_reading) as (server, api):
        process_id = api.sh(COUNTER)
        getattr(server, change + "_at")("connect", after_frames=3)
        stream = api.connect(process_id)
        assert len(payloads(frames_until_halted(stream, server_reading))) == 3
        assert server.sandbox_status() == change.rstrip("e") + "ed"
        if server.resume():
            await_status(server, "running")
        getattr(server, change + "_at")("get")  # at a request's start: it meets the change
        expected = server_reading.paused_answer if change == "pause" else 404
        assert api.request("GET", "/processes/" + process_id).status_code in (expected, 404)
        assert server.sandbox_status() in ("paused", "destroyed")


def test_cli_auto_pause_and_resume_seconds_flags():
    with cli_server("--auto-pause", "0.3", "--resume-seconds", "0.5") as api:
        time.sleep(0.8)
        assert api.request("GET", "").json()["data"]["status"] == "paused"
        assert api.request("POST", "/resume").json()["data"]["status"] == "resuming"
        assert api.request("GET", "").json()["data"]["status"] == "resuming"
    assert b"auto_pause_after" in refusal("--auto-pause", "0")
