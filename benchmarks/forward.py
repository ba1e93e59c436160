"""forward(): a download and a 1-byte round trip through the forward, against the
same straight from the server, side by side in one run.

    python benchmarks/forward.py [--scale S] [--runs N]   # S=1: 256 MiB, 2,000 round trips

The server is a process of its own on this machine (which is the local
server's "sandbox"): to each connection it sends SIZE bytes then closes, or
(its first byte "p") echoes every byte as it comes. tests/local_server.py runs
in a process of its own too; the forward and the client are this process.
"Straight" connects to the server itself; "forward" goes through
client.forward(): this process's selector thread, a tunnel to the local
server, and its copy to the server. Medians of `--runs` runs, interleaved.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from local_server import DEFAULT_API_KEY, DEFAULT_SANDBOX  # noqa: E402

import createos_exec  # noqa: E402

FULL_SIZE = 256 * 1024 * 1024
FULL_TRIPS = 2_000
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


def started(argv: List[str]) -> "tuple[subprocess.Popen[str], str]":
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def download(port: int) -> float:
    """Seconds to read the server's bytes to their end."""
    buffer = bytearray(256 * 1024)
    began = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.sendall(b"d")
        while connection.recv_into(buffer):
            pass
    return time.perf_counter() - began


def round_trips(port: int, trips: int) -> float:
    """The median seconds of a 1-byte round trip, on one connection."""
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.sendall(b"p")
        times = []
        for _ in range(trips):
            began = time.perf_counter()
            connection.sendall(b"x")
            connection.recv(1)
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(scale: float, runs: int) -> Dict[str, Dict[str, float]]:
    size, trips = max(1, int(FULL_SIZE * scale)), max(10, int(FULL_TRIPS * scale))
    server, port = started([sys.executable, "-c", SERVER, str(size)])
    local, url = started([sys.executable, os.path.join(ROOT, "tests", "local_server.py")])
    try:
        client = createos_exec.Client(url, DEFAULT_API_KEY, rate_limit=None)
        with client, client.forward(DEFAULT_SANDBOX, int(port)) as fw:
            routes: Dict[str, int] = {"straight": int(port), "forward": fw.local_port}
            tests: Dict[str, Callable[[int], float]] = {
                "download MiB/s": lambda to: size / 2**20 / download(to),
                "round trip µs": lambda to: round_trips(to, trips) * 1e6,
            }
            figures: Dict[str, Dict[str, List[float]]] = {t: {r: [] for r in routes} for t in tests}
            for _ in range(runs):
                for test, run in tests.items():
                    for route, to in routes.items():
                        figures[test][route].append(run(to))
            assert fw.failures == 0
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
    print(f"forward(): {size / 2**20:g} MiB download, median of {options.runs} runs")
    print(f"{'':16} {'straight':>10} {'forward':>10} {'ratio':>7}")
    for test, by_route in measure(options.scale, options.runs).items():
        straight, forward = by_route["straight"], by_route["forward"]
        ratio = forward / straight
        print(f"{test:16} {straight:10.1f} {forward:10.1f} {ratio:6.2f}x")


if __name__ == "__main__":
    main()
