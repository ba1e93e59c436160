"""The files section of benchmarks/run.py: put() and get() against a bare requests
PUT and GET of the same file, their peak memory, and their requests per small file.

    python benchmarks/transfers.py probe URL put|get SIZE DIRECTORY   # one memory probe

Against tests/local_server.py in a process of its own (its "sandbox" is this
machine, so a file goes from one directory of it to another), in the same run:

- seconds of put() (a local path) and get() (into a local path), interleaved
  with a bare requests PUT streamed from the same file and a bare GET
  streamed into a file, of a file of random bytes (64 MiB at full size). put()
  and get() include their verification (the sandbox's SHA-256 and this
  side's); "without the sandbox's check" subtracts the time of the exec
  requests that compute it (put() then still hashes what it sends, get() what
  it receives);
- peak RSS of a child process (this file's `probe`) during a put() and a get()
  of a 1 GiB file (at full size), against the same process idle, measured as
  memory_probe.py measures it;
- the requests of a 1 KiB put() (its parent directory there) and get().
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.dirname(HERE))

import requests  # noqa: E402
from local_server import DEFAULT_API_KEY, DEFAULT_SANDBOX  # noqa: E402
from memory_probe import lifetime_peak_kib, reset_high_water_mark, status_kib  # noqa: E402

import createos_exec  # noqa: E402

ROUTES = ("put()", "bare PUT", "get()", "bare GET")


class TimedSession(requests.Session):
    """Counts the requests that leave and the seconds spent in exec requests."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: List[str] = []
        self.exec_seconds = 0.0

    def request(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
        self.sent.append("%s %s" % (method, str(url).rsplit("/", 1)[-1]))
        started = time.perf_counter()
        try:
            return super().request(method, url, *args, **kwargs)
        finally:
            if str(url).endswith("/exec"):
                self.exec_seconds += time.perf_counter() - started


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
    """Seconds of each route, interleaved `repeat` times, and whether every copy was exact;
    the sandbox's checks' seconds under "put() check" and "get() check"."""
    seconds: Dict[str, List[float]] = {name: [] for name in ROUTES + ("put() check", "get() check")}
    exact = True
    directory = tempfile.mkdtemp(prefix="createos-files-bench-")
    try:
        local = os.path.join(directory, "local.bin")
        remote = os.path.join(directory, "sandbox", "remote.bin")
        back = os.path.join(directory, "back.bin")
        os.mkdir(os.path.dirname(remote))
        sha256 = random_file(local, size)
        session = TimedSession()
        client = createos_exec.Client(url, DEFAULT_API_KEY, rate_limit=None, session=session)
        bare = requests.Session()
        routes = {
            "put()": lambda: client.put(DEFAULT_SANDBOX, local, remote),
            "bare PUT": lambda: bare_put(bare, url, local, remote),
            "get()": lambda: client.get(DEFAULT_SANDBOX, remote, back),
            "bare GET": lambda: bare_get(bare, url, remote, back),
        }
        for _ in range(repeat):
            for name, route in routes.items():
                before = session.exec_seconds
                started = time.perf_counter()
                route()
                seconds[name].append(time.perf_counter() - started)
                if name in ("put()", "get()"):
                    seconds[name + " check"].append(session.exec_seconds - before)
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


if __name__ == "__main__":
    if sys.argv[1:2] != ["probe"]:
        sys.exit(__doc__)
    sys.exit(probe(sys.argv[2:]))
