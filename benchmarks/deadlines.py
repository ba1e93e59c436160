"""How far past its timeout a wait returns, when heartbeats are far apart.

    python benchmarks/deadlines.py              # 5 runs of each wait (about a minute and a half)
    python benchmarks/deadlines.py --repeat 3 --timeout 6 --heartbeat 5

Against tests/local_server.py with heartbeats every `--heartbeat` seconds
(default 3), a quiet `sleep 600` is waited for (4 s by default: a heartbeat
comes before the timeout) with wait(timeout=),
iter_output(timeout=) and wait_for_port(timeout=) on a port nobody opens;
each raises WaitTimeout. Printed: the overshoot (seconds from the timeout to
the error), median and min-max over the runs, and whether the median is
within the target of 0.2 s. A measurement, not a test: the exit status is 0
whatever the figures say, and 1 only when a wait did not end in WaitTimeout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from local_server import DEFAULT_SANDBOX as LOCAL_SANDBOX  # noqa: E402
from local_server import LocalServer  # noqa: E402
from support import closed_port  # noqa: E402

import createos_exec  # noqa: E402

TARGET = 0.2  # seconds past the timeout at most


def wait(proc: Any, timeout: float) -> None:
    proc.wait(timeout=timeout)


def iterate(proc: Any, timeout: float) -> None:
    for _ in proc.iter_output(timeout=timeout):
        pass


def wait_for_port(proc: Any, timeout: float) -> None:
    proc.wait_for_port(closed_port(), timeout=timeout)


WAITS: Dict[str, Callable[[Any, float], None]] = {
    "wait(timeout=)": wait,
    "iter_output(timeout=)": iterate,
    "wait_for_port(timeout=)": wait_for_port,
}


def overshoot(proc: Any, name: str, timeout: float) -> Optional[float]:
    """Seconds from the timeout to the WaitTimeout of one wait; None when it did not raise one."""
    started = time.monotonic()
    try:
        WAITS[name](proc, timeout)
    except createos_exec.WaitTimeout:
        return time.monotonic() - started - timeout
    return None


def measure(repeat: int, timeout: float, heartbeat: float) -> Dict[str, List[Optional[float]]]:
    """The overshoots of every wait, interleaved, each run on one quiet process."""
    figures: Dict[str, List[Optional[float]]] = {name: [] for name in WAITS}
    with LocalServer(heartbeat_interval=heartbeat) as server:
        client = createos_exec.Client(server.url, server.api_key, rate_limit=None)
        with client, client.start(LOCAL_SANDBOX, ["sleep", "600"]) as proc:
            for run in range(repeat):
                for name in WAITS:
                    print("%s: run %d of %d" % (name, run + 1, repeat), file=sys.stderr)
                    figures[name].append(overshoot(proc, name, timeout))
    return figures


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each wait (default 5)")
    parser.add_argument("--timeout", type=float, default=4.0, help="each wait's (default 4 s)")
    parser.add_argument("--heartbeat", type=float, default=3.0, help="seconds (default 3)")
    options = parser.parse_args(argv)
    figures = measure(options.repeat, options.timeout, options.heartbeat)
    print(
        "Overshoot past timeout=%g s, heartbeats every %g s, median (min-max) of %d runs"
        % (options.timeout, options.heartbeat, options.repeat)
    )
    failed = False
    for name, values in figures.items():
        measured = [value for value in values if value is not None]
        if len(measured) < len(values):
            print("  %-26s FAILED: a wait did not end in WaitTimeout" % name)
            failed = True
            continue
        median = statistics.median(measured)
        verdict = "met" if median <= TARGET else "MISSED"
        print(
            "  %-26s %6.2f s (%.2f-%.2f)  [%s: at most %.1f s]"
            % (name, median, min(measured), max(measured), verdict, TARGET)
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
