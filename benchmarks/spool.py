"""The spool (docs/design.md item 19): what it costs a run that never overflows the
journal, and what a run whose reader falls behind gets back from it.

    python benchmarks/spool.py [--runs N] [--sizes 8,64]

Against tests/local_server.py in a process of its own (its 1 MiB journal). First,
interleaved, medians of `--runs`: execute() of commands whose output the journal
keeps whole, with the spool (as shipped), without it (the wrapper as it was
before the spool: `_plan(..., spooled=False)`), and with the least any copier
costs (each stream through a `cat` of its own, nothing kept), and their ratios
to the run without a spool. Then, for each
size in MiB, a child process runs execute(on_output=slow) on a command printing
that many MiB of numbered lines, the consumer falling behind early (forty 50 ms
pauses): whether every byte arrived once and in order (SHA-256 of what on_output
got against the command's own), the bytes read back from the spool, the seconds,
and the peak RSS above idle (Linux's VmHWM, reset before the run).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from local_server import DEFAULT_API_KEY, DEFAULT_SANDBOX  # noqa: E402

import createos_exec as cx  # noqa: E402

# Commands whose output the journal keeps whole: nothing, a line, and 588 KiB
# (over the size from which the client removes the spool itself).
KEPT = {
    "true": ["true"],
    "echo hi": ["echo", "hi"],
    "seq 100000 (588 KiB)": ["seq", "100000"],
}
LINE = 100  # bytes of each numbered line of the big runs
PAUSES, PAUSE = 40, 0.05
PLAN = cx._plan  # as shipped: the runs below swap the module's for a variant


def lines_command(mib: int) -> List[str]:
    count = mib * 2**20 // LINE
    code = f"import sys\nw = sys.stdout.write\nfor i in range({count}): w('%099d\\n' % i)"
    return ["python3", "-c", code]


def started_server() -> "tuple[subprocess.Popen[str], str]":
    argv = [sys.executable, os.path.join(ROOT, "tests", "local_server.py"), "--port", "0"]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    return server, server.stdout.readline().strip()


def copied_plan(*args: Any, **kwargs: Any) -> Any:
    """The wrapper without a spool, each stream copied by a `cat` of its own: the
    least any copier in the sandbox costs (no spool file, no count, no fork off)."""
    plan = PLAN(*args, spooled=False, **kwargs)
    copiers = "exec > >(exec cat) 2> >(exec cat >&2)"
    plan.body["args"][1] = plan.body["args"][1].replace(cx._NAMED, f"{copiers}\n{cx._NAMED}", 1)
    return plan


def time_kept_runs(url: str, runs: int) -> Dict[str, Dict[str, float]]:
    """Medians in ms, with the spool, without, and with a bare copier, of each
    command of KEPT."""
    plans = {
        "spool": PLAN,
        "none": functools.partial(PLAN, spooled=False),
        "cat": copied_plan,
    }
    times: Dict[str, Dict[str, List[float]]] = {name: {w: [] for w in plans} for name in KEPT}
    with cx.Client(url, DEFAULT_API_KEY, rate_limit=None) as client:
        # A command at a time: the local server keeps every ended process and
        # its journal, so that a big output run many times slows what follows.
        for name, command in KEPT.items():
            for _ in range(runs + 3):  # the first three warm up
                for way, plan in plans.items():
                    cx._plan = plan  # type: ignore[assignment]
                    began = time.perf_counter()
                    client.execute(DEFAULT_SANDBOX, command)
                    times[name][way].append(time.perf_counter() - began)
    cx._plan = PLAN  # type: ignore[assignment]
    return {
        name: {way: statistics.median(values[3:]) * 1000 for way, values in by_way.items()}
        for name, by_way in times.items()
    }


def probe(url: str, mib: int) -> Dict[str, Any]:
    """One run of `mib` MiB with a consumer that falls behind early (a child process)."""
    command = lines_command(mib)
    expected = hashlib.sha256()
    for i in range(mib * 2**20 // LINE):
        expected.update(b"%099d\n" % i)
    spooled: List[int] = []

    class Spooled(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found = re.match(r"Read (\d+) bytes", record.getMessage())
            if found:
                spooled.append(int(found.group(1)))

    logger = logging.getLogger("createos_exec")
    logger.addHandler(Spooled())
    logger.setLevel(logging.INFO)
    got, pauses = hashlib.sha256(), [PAUSES]

    def slow(stream: str, text: str) -> None:
        got.update(text.encode())
        if pauses[0]:
            pauses[0] -= 1
            time.sleep(PAUSE)

    with cx.Client(url, DEFAULT_API_KEY) as client:
        client.execute(DEFAULT_SANDBOX, ["true"])
        idle = reset_high_water_mark()
        began = time.perf_counter()
        result = client.execute(DEFAULT_SANDBOX, command, on_output=slow)
        seconds = time.perf_counter() - began
    return {
        "exact": got.digest() == expected.digest() and result.exit_code == 0,
        "spooled": sum(spooled),
        "seconds": seconds,
        "peak_mib": (high_water_kib() - idle) / 1024,
    }


def reset_high_water_mark() -> int:
    """VmHWM reset to the RSS (Linux), which is returned, in KiB."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
        clear_refs.write("5")
    return status_kib("VmRSS")


def high_water_kib() -> int:
    return status_kib("VmHWM")


def status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        return int(re.search(field + r":\s+(\d+) kB", status.read()).group(1))  # type: ignore[union-attr]


def in_child(url: str, mib: int) -> Dict[str, Any]:
    argv = [sys.executable, __file__, "--probe", json.dumps({"url": url, "mib": mib})]
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def report(runs: int, sizes: List[int], measure: Callable[[str, int], Dict[str, Any]]) -> None:
    server, url = started_server()
    try:
        print(f"runs the journal keeps whole: median ms of {runs}, interleaved")
        print(f"{'':24} {'no spool':>9} {'spool':>9} {'ratio':>7} {'cat':>9} {'ratio':>7}")
        for name, by_way in time_kept_runs(url, runs).items():
            none, spool, cat = by_way["none"], by_way["spool"], by_way["cat"]
            print(
                f"{name:24} {none:9.2f} {spool:9.2f} {spool / none:6.2f}x"
                f" {cat:9.2f} {cat / none:6.2f}x"
            )
        print("\nruns whose consumer falls behind early (1 MiB journal)")
        print(f"{'MiB':>5} {'exact':>6} {'from spool':>12} {'seconds':>8} {'peak MiB':>9}")
        for mib in sizes:
            got = measure(url, mib)
            print(
                f"{mib:5} {str(got['exact']):>6} {got['spooled']:12,} "
                f"{got['seconds']:8.2f} {got['peak_mib']:9.1f}"
            )
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--sizes", default="8,64", help="MiB of the runs that fall behind")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.probe:
        spec = json.loads(options.probe)
        print(json.dumps(probe(spec["url"], spec["mib"])))
        return
    report(options.runs, [int(size) for size in options.sizes.split(",")], in_child)


if __name__ == "__main__":
    main()
