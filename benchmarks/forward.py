"""forward(): a download and a 1-byte round trip through the forward, against the
same straight from the server, side by side in one run.

    python benchmarks/forward.py [--scale S] [--runs N]   # S=1: 256 MiB, 2,000 round trips

The server is a process of its own on this machine (which is the local
server's "sandbox"): to each connection it sends SIZE bytes then closes, or
(its first byte "p") echoes every byte as it comes. tests/local_server.py runs
in a process of its own too; the forwards and the client are this process.
One client code reads every route, each connection opened its own way:

- straight: a connection to the server itself;
- tunnel: a tunnel of the local server opened by this process and read as
  it is, without a forward: the service's stand-in alone, which every
  forward goes through;
- forward: client.forward(), as it runs here (splice() where it can);
- selector: client.forward() made to copy through its selector, as it does
  over TLS and where os.splice is not (Python 3.8 and 3.9, not Linux).

Rows: the download's MiB/s; the CPU seconds per GiB that the three
processes (the server, the local server, and this one: the client and the
forwards) spent during it, from /proc (Linux); and the 1-byte round trip.
Medians of `--runs` runs, the routes interleaved. The ratio, and the targets
it is held to (download at least 0.8x, round trip at most 2x), are forward
against straight.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, Iterator, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from local_server import DEFAULT_API_KEY, DEFAULT_SANDBOX  # noqa: E402

import createos_exec  # noqa: E402

FULL_SIZE = 256 * 1024 * 1024
FULL_TRIPS = 2_000
ROUTES = ("straight", "tunnel", "forward", "selector")
ROWS = {"download MiB/s": ".0f", "CPU s/GiB": ".2f", "round trip µs": ".1f"}  # their formats
TARGETS = {"download MiB/s": ("≥", 0.8), "round trip µs": ("≤", 2.0)}  # forward / straight
SERVER = r"""
import socket, sys, threading
size = int(sys.argv[1])
listener = socket.create_server(("127.0.0.1", 0), backlog=16)
print(listener.getsockname()[1], flush=True)
piece = bytes(256 * 1024)

def serve(connection):
    with connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        first = connection.recv(1)
        if first == b"p":
            while True:
                byte = connection.recv(1)
                if not byte:
                    return
                connection.sendall(byte)
        view, left = memoryview(piece), size if first else 0  # none: the entry's check
        while left:
            left -= connection.send(view[: min(left, len(piece))])

while True:
    threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()
"""

Connect = Callable[[], socket.socket]


def started(argv: List[str]) -> "tuple[subprocess.Popen[str], str]":
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def download(connect: Connect) -> float:
    """Seconds to connect and read the server's bytes to their end."""
    buffer = bytearray(256 * 1024)
    began = time.perf_counter()
    with connect() as connection:
        connection.sendall(b"d")
        while connection.recv_into(buffer):
            pass
    return time.perf_counter() - began


def round_trips(connect: Connect, trips: int) -> float:
    """The median seconds of a 1-byte round trip, on one connection."""
    with connect() as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.sendall(b"p")
        times = []
        for _ in range(trips):
            began = time.perf_counter()
            connection.sendall(b"x")
            connection.recv(1)
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def cpu_seconds(pids: List[int]) -> float:
    """The user and system CPU seconds these processes have spent so far (NaN without /proc)."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return math.nan
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def to_port(port: int) -> Connect:
    return lambda: socket.create_connection(("127.0.0.1", port))


def to_tunnel(forward: createos_exec.Forward) -> Connect:
    """A tunnel opened as the forward opens each of its own, then read here."""

    def connect() -> socket.socket:
        sock, early = forward._bridge._tunnels.open()
        assert not early  # the server speaks only once spoken to
        return sock

    return connect


@contextlib.contextmanager
def without_splice() -> Iterator[None]:
    """A forward made meanwhile copies through its selector, as over TLS."""
    splice, createos_exec._SPLICE = createos_exec._SPLICE, None
    try:
        yield
    finally:
        createos_exec._SPLICE = splice


def measure(scale: float, runs: int) -> Dict[str, Dict[str, float]]:
    size, trips = max(1, int(FULL_SIZE * scale)), max(10, int(FULL_TRIPS * scale))
    server, port = started([sys.executable, "-c", SERVER, str(size)])
    local, url = started([sys.executable, os.path.join(ROOT, "tests", "local_server.py")])
    try:
        client = createos_exec.Client(url, DEFAULT_API_KEY, rate_limit=None)
        with contextlib.ExitStack() as stack:
            stack.enter_context(client)
            fw = stack.enter_context(client.forward(DEFAULT_SANDBOX, int(port)))
            with without_splice():
                selector = stack.enter_context(client.forward(DEFAULT_SANDBOX, int(port)))
            routes: Dict[str, Connect] = {
                "straight": to_port(int(port)),
                "tunnel": to_tunnel(fw),
                "forward": to_port(fw.local_port),
                "selector": to_port(selector.local_port),
            }
            pids = [server.pid, local.pid, os.getpid()]
            figures: Dict[str, Dict[str, List[float]]] = {t: {r: [] for r in routes} for t in ROWS}
            for _ in range(runs):
                for route, to in routes.items():
                    began = cpu_seconds(pids)
                    seconds = download(to)
                    figures["CPU s/GiB"][route].append((cpu_seconds(pids) - began) * 2**30 / size)
                    figures["download MiB/s"][route].append(size / 2**20 / seconds)
                for route, to in routes.items():
                    figures["round trip µs"][route].append(round_trips(to, trips) * 1e6)
            assert fw.failures == selector.failures == 0
    finally:
        for process in (local, server):
            process.terminate()
            process.wait()
    return {
        test: {route: statistics.median(values) for route, values in by_route.items()}
        for test, by_route in figures.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="of 256 MiB and 2,000 trips")
    parser.add_argument("--runs", type=int, default=5)
    options = parser.parse_args()
    size = max(1, int(FULL_SIZE * options.scale))
    way = "splice()" if createos_exec._SPLICE is not None else "its selector (no os.splice here)"
    print(f"forward(): {size / 2**20:g} MiB download, medians of {options.runs} runs")
    print(f"the forward moves bytes with {way}")
    print(" " * 16 + "".join(f"{route:>10}" for route in ROUTES) + "   forward/straight")
    for row, by_route in measure(options.scale, options.runs).items():
        straight, forward = by_route["straight"], by_route["forward"]
        ratio = forward / straight if straight else math.inf  # a tiny run may spend no tick
        verdict = ""
        if row in TARGETS:
            sign, target = TARGETS[row]
            met = ratio >= target if sign == "≥" else ratio <= target
            verdict = f"  [{'met' if met else 'MISSED'}: {sign} {target:g}x]"
        figures = "".join(f"{by_route[route]:10{ROWS[row]}}" for route in ROUTES)
        print(f"{row:16}{figures} {ratio:8.2f}x{verdict}")


if __name__ == "__main__":
    main()
