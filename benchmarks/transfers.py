"""The files section of benchmarks/run.py: put() and get() against a bare requests
PUT and GET of the same file, where their time goes, their peak memory, and their
requests for a small file and for a directory of many.

    python benchmarks/transfers.py probe URL put|get SIZE DIRECTORY   # one memory probe
    python benchmarks/transfers.py link PORT BYTES_PER_SECOND         # one paced link

Against tests/local_server.py in a process of its own (its "sandbox" is this
machine, so a file goes from one directory of it to another), in the same run:

- seconds of put() (a local path) and get() (into a local path), interleaved
  with a bare requests PUT streamed from the same file and a bare GET
  streamed into a file, of a file of random bytes (256 MiB at full size):
  put() and get() with their verification (the sandbox's SHA-256 and this
  side's), in pieces where they go in pieces;
- where the time of one put() and one get() went: each request's span, from
  the call's start, and what one SHA-256 of the file costs here (hashlib) and
  in the sandbox (openssl, sha256sum);
- peak RSS of a child process (this file's `probe`) during a put() and a get()
  of a 1 GiB file (at full size), against the same process idle, measured as
  memory_probe.py measures it;
- the same seconds through a link of a given bandwidth (this file's `link`:
  a proxy in a process of its own, both directions paced, each at that many
  bytes per second, shared by its connections), where the transfer costs
  what a network makes it cost and the hashing a smaller share of it;
- the requests of a 1 KiB put() (its parent directory there) and get(), and
  of a put() and a get() of a directory of 10,000 small files, against the
  one of `tar c | ssh host tar x` (one connection, one command).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.dirname(HERE))

import requests  # noqa: E402
from local_server import DEFAULT_API_KEY, DEFAULT_SANDBOX  # noqa: E402
from memory_probe import lifetime_peak_kib, reset_high_water_mark, status_kib  # noqa: E402

import createos_exec  # noqa: E402

ROUTES = ("put()", "bare PUT", "get()", "bare GET")


class TimedSession(requests.Session):
    """Counts the requests that leave, and each one's span in `spans`: its method and
    endpoint, its start and end in seconds from `started`, and whether it was sent
    beside the call's own thread."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: List[str] = []
        self.spans: List[Tuple[str, float, float, bool]] = []
        self.started = time.perf_counter()

    def request(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
        what = "%s %s" % (method, str(url).rsplit("/", 1)[-1])
        self.sent.append(what)
        began = time.perf_counter() - self.started
        beside = threading.current_thread() is not threading.main_thread()
        try:
            return super().request(method, url, *args, **kwargs)
        finally:
            self.spans.append((what, began, time.perf_counter() - self.started, beside))


def random_file(path: str, size: int) -> str:
    """Write `size` random bytes to `path`, a MiB at a time; their SHA-256."""
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for offset in range(0, size, 1 << 20):
            piece = os.urandom(min(1 << 20, size - offset))
            digest.update(piece)
            out.write(piece)
    return digest.hexdigest()


def bare_put(session: requests.Session, url: str, local: str, remote: str) -> None:
    with open(local, "rb") as source:
        session.put(
            url + "/v1/sandboxes/%s/files" % DEFAULT_SANDBOX,
            params={"path": remote},
            data=source,
            headers={"X-Api-Key": DEFAULT_API_KEY, "Content-Type": "application/octet-stream"},
            timeout=600,
        ).raise_for_status()


def bare_get(session: requests.Session, url: str, remote: str, local: str) -> None:
    with session.get(
        url + "/v1/sandboxes/%s/files" % DEFAULT_SANDBOX,
        params={"path": remote},
        headers={"X-Api-Key": DEFAULT_API_KEY},
        stream=True,
        timeout=600,
    ) as answer, open(local, "wb") as out:
        answer.raise_for_status()
        for piece in answer.iter_content(256 * 1024):
            out.write(piece)


def time_transfers(url: str, size: int, repeat: int) -> Tuple[Dict[str, List[float]], bool]:
    """Seconds of each route, interleaved `repeat` times, and whether every copy was exact."""
    seconds: Dict[str, List[float]] = {name: [] for name in ROUTES}
    exact = True
    directory = tempfile.mkdtemp(prefix="createos-files-bench-")
    try:
        local = os.path.join(directory, "local.bin")
        remote = os.path.join(directory, "sandbox", "remote.bin")
        back = os.path.join(directory, "back.bin")
        os.mkdir(os.path.dirname(remote))
        sha256 = random_file(local, size)
        client = createos_exec.Client(url, DEFAULT_API_KEY, rate_limit=None)
        bare = requests.Session()
        routes = {
            "put()": lambda: client.put(DEFAULT_SANDBOX, local, remote),
            "bare PUT": lambda: bare_put(bare, url, local, remote),
            "get()": lambda: client.get(DEFAULT_SANDBOX, remote, back),
            "bare GET": lambda: bare_get(bare, url, remote, back),
        }
        for _ in range(repeat):
            for name, route in routes.items():
                started = time.perf_counter()
                route()
                seconds[name].append(time.perf_counter() - started)
                copy = back if "get" in name.lower() else remote
                exact = exact and file_sha256(copy) == sha256
        client.close()
        bare.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return seconds, exact


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for piece in iter(lambda: source.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def requests_per_small_file(url: str) -> Dict[str, List[str]]:
    """The requests of a 1 KiB put() into a directory that exists, and of its get()."""
    directory = tempfile.mkdtemp(prefix="createos-files-bench-")
    try:
        session = TimedSession()
        with createos_exec.Client(url, DEFAULT_API_KEY, rate_limit=None, session=session) as client:
            remote = os.path.join(directory, "small.bin")
            client.put(DEFAULT_SANDBOX, os.urandom(1024), remote)
            put = list(session.sent)
            client.get(DEFAULT_SANDBOX, remote)
            return {"put()": put, "get()": session.sent[len(put) :]}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def profile(url: str, size: int) -> Dict[str, Any]:
    """Where one put() and one get() of `size` bytes spend their time: each request's
    span (seconds from the call's start; `beside` when sent from a thread of the
    transfer's own, as the checks of pieces and get()'s description are), the call's
    seconds, and the seconds of one SHA-256 of the file here (hashlib) and as the
    sandbox hashes it (openssl, and sha256sum)."""
    directory = tempfile.mkdtemp(prefix="createos-files-bench-")
    try:
        local, remote = os.path.join(directory, "local.bin"), os.path.join(directory, "remote.bin")
        random_file(local, size)
        found: Dict[str, Any] = {}
        for name in ("put()", "get()"):
            session = TimedSession()
            with createos_exec.Client(url, DEFAULT_API_KEY, rate_limit=None, session=session) as c:
                session.started = time.perf_counter()
                if name == "put()":
                    c.put(DEFAULT_SANDBOX, local, remote)
                else:
                    c.get(DEFAULT_SANDBOX, remote, local + ".back")
                found[name] = (time.perf_counter() - session.started, session.spans)
        started = time.perf_counter()
        file_sha256(local)
        found["hashlib"] = time.perf_counter() - started
        for tool in ("openssl dgst -sha256", "sha256sum"):
            started = time.perf_counter()
            with open(local, "rb") as source:
                done = subprocess.run(tool.split(), stdin=source, stdout=subprocess.DEVNULL)
            found[tool.split()[0]] = time.perf_counter() - started if not done.returncode else None
        return found
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def tree_requests(url: str, files: int) -> Dict[str, Tuple[List[str], float]]:
    """The requests and seconds of a put() and of a get() (its path ending in "/",
    and not) of a directory of `files` small files (0 to 511 bytes, in 100 folders)."""
    directory = tempfile.mkdtemp(prefix="createos-files-bench-")
    try:
        tree = os.path.join(directory, "tree")
        for number in range(files):
            folder = os.path.join(tree, "d%02d" % (number % 100))
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "%05d.txt" % number), "wb") as out:
                out.write(os.urandom(number % 512))
        remote = os.path.join(directory, "remote")
        calls = {
            "put()": lambda c: c.put(DEFAULT_SANDBOX, tree, remote),
            'get() of a path ending in "/"': lambda c: c.get(DEFAULT_SANDBOX, remote + "/", tree),
            "get()": lambda c: c.get(DEFAULT_SANDBOX, remote, tree),
        }
        found = {}
        for name, call in calls.items():
            session = TimedSession()
            with createos_exec.Client(url, DEFAULT_API_KEY, rate_limit=None, session=session) as c:
                started = time.perf_counter()
                info = call(c)
                found[name] = (session.sent, time.perf_counter() - started)
            if info.files != files:
                raise AssertionError("%s moved %d files of %d" % (name, info.files, files))
        return found
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def probe_memory(url: str, direction: str, size: int) -> Optional[Dict[str, Any]]:
    """Peak RSS of a child process during one put() or get() of `size` bytes."""
    directory = tempfile.mkdtemp(prefix="createos-files-bench-")
    try:
        local = os.path.join(directory, "local.bin")
        remote = os.path.join(directory, "remote.bin")
        random_file(remote if direction == "get" else local, size)
        done = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "probe",
                url,
                direction,
                str(size),
                directory,
            ],
            capture_output=True,
            text=True,
            timeout=1200,
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe(argv: Sequence[str]) -> int:
    """The child of probe_memory(): its idle RSS, then its peak during the transfer (KiB)."""
    url, direction, size, directory = argv[0], argv[1], int(argv[2]), argv[3]
    local, remote = os.path.join(directory, "local.bin"), os.path.join(directory, "remote.bin")
    client = createos_exec.Client(url, DEFAULT_API_KEY, rate_limit=None)
    client.put(DEFAULT_SANDBOX, b"warm-up", os.path.join(directory, "warm"))
    client.get(DEFAULT_SANDBOX, os.path.join(directory, "warm"))
    gc.collect()
    reset = reset_high_water_mark()
    figures = status_kib()
    idle = figures["VmRSS"] if figures else lifetime_peak_kib()
    started = time.perf_counter()
    if direction == "put":
        info = client.put(DEFAULT_SANDBOX, local, remote)
    else:
        info = client.get(DEFAULT_SANDBOX, remote, local)
    seconds = time.perf_counter() - started
    figures = status_kib()
    peak = figures["VmHWM"] if figures and reset else lifetime_peak_kib()
    print(
        json.dumps(
            {
                "idle_kib": idle,
                "peak_kib": peak,
                "method": "clear_refs" if reset else "getrusage",
                "seconds": seconds,
                "verified": info.size == size,
            }
        )
    )
    return 0


@contextlib.contextmanager
def paced_link(url: str, rate: float) -> Iterator[str]:
    """`url` reached through this file's `link` at `rate` bytes per second each way; its URL."""
    port = url.rsplit(":", 1)[1].rstrip("/")
    proxy = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "link", port, str(rate)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None
        yield "http://127.0.0.1:%s" % proxy.stdout.readline().strip()
    finally:
        proxy.terminate()
        proxy.wait(30)


class Pace:
    """One direction of a link: bytes pass at `rate` per second, whichever connection sends."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.lock = threading.Lock()
        self.free_at = time.monotonic()

    def take(self, size: int) -> None:
        with self.lock:
            now = time.monotonic()
            # Up to 5 ms of credit: the time a sleep overshoots is made up.
            self.free_at = max(self.free_at, now - 0.005) + size / self.rate
            wait = self.free_at - now
        if wait > 0:
            time.sleep(wait)


def forward(source: socket.socket, target: socket.socket, pace: Pace) -> None:
    try:
        for piece in iter(lambda: source.recv(256 * 1024), b""):
            pace.take(len(piece))
            target.sendall(piece)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)


def link(argv: Sequence[str]) -> int:
    """A proxy to 127.0.0.1:PORT, each direction paced at BYTES_PER_SECOND; prints its port."""
    upstream, rate = int(argv[0]), float(argv[1])
    up, down = Pace(rate), Pace(rate)
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        near, _ = listener.accept()
        far = socket.create_connection(("127.0.0.1", upstream))
        for source, target, pace in ((near, far, up), (far, near, down)):
            threading.Thread(target=forward, args=(source, target, pace), daemon=True).start()


if __name__ == "__main__":
    commands = {"probe": probe, "link": link}
    if sys.argv[1:2] == [] or sys.argv[1] not in commands:
        sys.exit(__doc__)
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
