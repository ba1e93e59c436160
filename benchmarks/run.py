"""createos_exec performance benchmark: throughput, memory, output tail and latency.

    python benchmarks/run.py                    # everything, full size (a few minutes)
    python benchmarks/run.py --repeat 7
    python benchmarks/run.py --scale 0.001      # every size times 0.001: a quick check
    python benchmarks/run.py --only throughput,latency

Prints one plain-text report. Exit status 0 whatever the targets say (this is
a measurement, not a test); 1 only when a measurement could not be made (a
reader crashed or did not receive exactly what was sent).

What is measured
----------------
throughput  A synthetic CreateOS server (stream_server.py, a process of its
            own) serves the same pre-generated output stream to every reader,
            for four shapes: 64 KiB frames (256 MiB); 100-byte frames, one
            HTTP chunk per frame (32 MiB); the same 100-byte frames in 64 KiB
            HTTP chunks; and a mixed stream of 100-byte frames in 64 KiB
            HTTP chunks (32 MiB in all), with stdout and stderr interleaved
            as in a build log (seeded: runs of 1 to 32 stdout frames, 1 to 4
            stderr frames between them), a heartbeat line after every 500th
            data frame, and the text of the other shapes (2- and 3-byte
            characters among ASCII) split across the frames of each stream.
            All but the mixed one are stdout only. Readers
            (readers.py), interleaved (each repetition runs every reader
            once on every shape, so that a target comparing two shapes
            compares figures taken seconds apart): the server alone
            (drain to EOF, no parsing), the per-line decode ceiling (raw
            socket, hand-made de-chunking, one json.loads per line, strict
            base64, incremental UTF-8, one decoder per stream, heartbeats
            skipped), the batched ceiling (one json.loads
            per block of lines), createos_exec's Client.execute() end to end,
            and the official SDK's processes.connect(), and start() with a
            loop over iter_output() (at least 0.9x of execute()'s on_output
            on the 64 KiB and the 100-byte frames), and execute(text=False),
            the bytes decoded by nothing (at least as fast as text mode on
            the 64 KiB frames and the 100-byte frames in 64 KiB chunks). Every
            reader's output
            is verified, each stream on its own. MB/s = 10^6 bytes of decoded
            payload (both streams) per second. Besides execute() against
            the other readers on each shape, a target compares execute()
            with itself: on the mixed shape it should keep at least 85 % of
            its MB/s on the stdout-only 100-byte frames in 64 KiB chunks.
memory      Peak RSS of a child process (memory_probe.py) while execute()
            streams 64 MiB and 1 GiB of output with the default
            max_output_chars, against the same process idle; and the same
            through start() and a loop over iter_output() that keeps nothing.
tail        createos_exec's output capture (_Output: the UTF-8 decoder and
            the tails of 4 Mi characters, as execute() keeps output) fed
            8, 16 and 32 Mi characters in 100-character chunks (ns per
            character), against the naive `s = (s + chunk)[-cap:]` on the
            text alone, timed on a sample and extrapolated.
latency     Against tests/local_server.py (real bash processes): requests and
            TCP connections of one execute("true"); its wall time against the
            same HTTP requests sent with a bare requests.Session; the default
            rate limiter against rate_limit=None; execute(["true"]) with
            timeout=60 against without, under both readings of the server;
            the pause between the last output before a connection reset and
            the first after the resume.
pacing      Against tests/local_server.py answering 429 to the address over
            40 requests per 1 s (tests/pacing.py): 4 spawned processes x 25
            commands, each client paced at (40, 1 s), first sharing one
            window file, then with windows of their own (machines behind one
            address; once more with the narrowing after a 429 turned off, for
            comparison); and 64 threads sharing one client for 256 commands.
            Exact results, processes created, errors, 429s, the most
            arrivals in any window, and the wall time against the floor (two
            requests a command at the limit).
stdin       Against tests/local_server.py: 16 MiB written to a process's
            stdin through RemoteProcess.write() and through the official
            SDK's processes.input_bytes() (in pieces as large as write()'s,
            the most a request may carry), interleaved, into one process
            each that hashes what it reads: requests per MiB and MB/s of
            raw input, medians, and write()'s throughput against the SDK's.
            Both unpaced (rate_limit=None), as the SDK is; the server runs
            in a process of its own.
files       Against tests/local_server.py in a process of its own
            (transfers.py): put() and get() of a 256 MiB file against a bare
            requests PUT and GET of the same file, interleaved, with their
            verification, over loopback and through a proxy paced at 1 Gbit/s
            (and at 100 Mbit/s, 64 MiB); where the time of one put() and one
            get() went, request by request; the peak RSS of a child process
            during a put() and a get() of 1 GiB; the requests of a 1 KiB put()
            and get(), and of a directory of 10,000 small files each way.
keys        Against tests/local_server.py in a process of its own: keystroke
            round trips on a terminal (start(..., pty=True), `cat` behind it):
            one byte written, its echo read through a loop over
            iter_output(), median and p90; beside them, in the same run and
            interleaved, a bare round trip: one POST /input with a bare
            requests.Session and the echo's frame read from a stream kept
            open (target: the session's median at most 1.5x the bare one);
            and a paste of 64 KiB in one write(): its requests and how long
            until the whole paste came back. Unpaced (rate_limit=None).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gc
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import readers  # noqa: E402
import requests  # noqa: E402
import transfers  # noqa: E402
import urllib3  # noqa: E402
from local_server import DEFAULT_API_KEY as LOCAL_KEY  # noqa: E402
from local_server import DEFAULT_SANDBOX as LOCAL_SANDBOX  # noqa: E402
from local_server import READINGS, LocalServer  # noqa: E402
from stream_server import Shape, StreamServer, connect_path, payload  # noqa: E402

import createos_exec  # noqa: E402

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
SECTIONS = ("throughput", "memory", "tail", "latency", "pacing", "stdin", "files", "keys")

SHAPE_64K = "frames-64KiB"
SHAPE_100B = "frames-100B-chunk-each"
SHAPE_100B_CHUNKED = "frames-100B-chunks-64KiB"
SHAPE_MIXED = "frames-100B-mixed-chunks-64KiB"
SHAPE_LABELS = {
    SHAPE_64K: "64 KiB frames, one HTTP chunk per frame",
    SHAPE_100B: "100-byte frames, one HTTP chunk per frame",
    SHAPE_100B_CHUNKED: "100-byte frames in 64 KiB HTTP chunks",
    SHAPE_MIXED: (
        "100-byte frames in 64 KiB chunks, stdout and stderr interleaved, heartbeats, "
        "multi-byte text"
    ),
}
WARMUP_SHAPES = (
    Shape("warmup", 256 * KiB, 100, 64 * KiB),
    Shape("warmup-mixed", 256 * KiB, 100, 64 * KiB, mixed=True),
)

SERVER_ALONE = "server alone (drain, no parsing)"
PER_LINE = "per-line ceiling (raw socket)"
BATCHED = "batched ceiling (raw socket)"
EXECUTE = "createos_exec Client.execute()"
EXECUTE_BYTES = "createos_exec execute(text=False)"
ITERATE = "createos_exec iter_output() loop"
SDK = "official SDK processes.connect()"


class Target(NamedTuple):
    """One target line: `measured` compared with `bound` (None: could not be measured)."""

    text: str
    measured: Optional[float]
    bound: float
    at_most: bool = False  # measured <= bound (else >=)
    unit: str = "x"

    @property
    def verdict(self) -> str:
        if self.measured is None:
            return "n/a"
        met = self.measured <= self.bound if self.at_most else self.measured >= self.bound
        return "met" if met else "MISSED"

    def line(self) -> str:
        sign = "<=" if self.at_most else ">="
        value = "n/a" if self.measured is None else _number(self.measured, self.unit)
        return "  [%s] %s: %s (target %s %s)" % (
            self.verdict,
            self.text,
            value,
            sign,
            _number(self.bound, self.unit),
        )


def _number(value: float, unit: str) -> str:
    if unit == "":
        return "%g" % value
    if unit == "x":
        return "%.2fx" % value
    if unit == "ms":
        return "%.2f ms" % value
    return "%.1f %s" % (value, unit)


class Report:
    """Prints as it goes; remembers targets and failed measurements."""

    def __init__(self) -> None:
        self.targets: List[Target] = []
        self.failures: List[str] = []

    def line(self, text: str = "") -> None:
        print(text, flush=True)

    def heading(self, text: str) -> None:
        self.line()
        self.line("== %s ==" % text)

    def target(self, target: Target) -> None:
        self.targets.append(target)
        self.line(target.line())

    def failure(self, text: str) -> None:
        self.failures.append(text)
        self.line("  FAILED: " + text)


def progress(text: str) -> None:
    print("... " + text, file=sys.stderr, flush=True)


def size_label(size: float) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if size >= unit:
            return "%g %s" % (round(size / unit, 3), name)
    return "%d B" % size


def median_min_max(values: Sequence[float]) -> str:
    return "%11.1f   %.1f-%.1f" % (statistics.median(values), min(values), max(values))


def scaled(size: int, scale: float, floor: int) -> int:
    return max(floor, int(size * scale))


# --------------------------------------------------------------------------
# Header


def versions() -> List[str]:
    sdk = readers.load_sdk()
    if sdk is None:
        sdk_text = "createos-sandbox SDK n/a (not importable)"
    else:
        sdk_text = "createos-sandbox %s (httpx %s)" % (
            _distribution_version("createos-sandbox"),
            _distribution_version("httpx"),
        )
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    return [
        "Python %s (%s) · requests %s · urllib3 %s · %s · createos_exec %s"
        % (
            platform.python_version(),
            platform.python_implementation(),
            requests.__version__,
            urllib3.__version__,
            sdk_text,
            createos_exec.__version__,
        ),
        "machine: %s %s, nproc %d (cpu_count %s)"
        % (platform.system(), platform.machine(), usable, os.cpu_count()),
    ]


def _distribution_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 -- a version string is only informative
        return "?"


# --------------------------------------------------------------------------
# Throughput


def throughput_shapes(scale: float) -> List[Shape]:
    return [
        Shape(SHAPE_64K, scaled(256 * MiB, scale, 64 * KiB), 64 * KiB),
        Shape(SHAPE_100B, scaled(32 * MiB, scale, 100), 100),
        Shape(SHAPE_100B_CHUNKED, scaled(32 * MiB, scale, 100), 100, 64 * KiB),
        Shape(SHAPE_MIXED, scaled(32 * MiB, scale, 100), 100, 64 * KiB, mixed=True),
    ]


def make_readers(
    server: StreamServer,
    execute: readers.ExecuteReader,
    iterate: readers.ExecuteReader,
    in_bytes: readers.ExecuteReader,
    sdk: Optional[readers.SdkReader],
) -> Dict[str, Optional[Callable[[str], readers.Received]]]:
    """Each reader as a function of the shape name (None: not available)."""
    address = server.address

    def drain(name: str) -> readers.Received:
        return readers.drain(address, connect_path(name), server.expected[name])

    return {
        SERVER_ALONE: drain,
        PER_LINE: lambda name: readers.read_per_line(address, connect_path(name)),
        BATCHED: lambda name: readers.read_batched(address, connect_path(name)),
        EXECUTE: execute.read,
        EXECUTE_BYTES: in_bytes.read,
        ITERATE: iterate.read,
        SDK: sdk.read if sdk is not None else None,
    }


def run_throughput(report: Report, repeat: int, scale: float) -> None:
    shapes = throughput_shapes(scale)
    report.heading(
        "Throughput: MB/s of decoded payload (10^6 B/s), median and min-max of %d "
        "interleaved repetitions" % repeat
    )
    progress("generating the streams in the server process")
    medians: Dict[str, Dict[str, Optional[float]]] = {}
    with StreamServer(list(WARMUP_SHAPES) + shapes) as server:
        execute = readers.ExecuteReader(server.url)
        iterate = readers.ExecuteReader(server.url, iterate=True)
        in_bytes = readers.ExecuteReader(server.url, text=False)
        sdk_module = readers.load_sdk()
        sdk = readers.SdkReader(sdk_module, server.url) if sdk_module is not None else None
        try:
            reader_of = make_readers(server, execute, iterate, in_bytes, sdk)
            warm_up(report, reader_of, server)
            timings = {shape.name: Timings(reader_of) for shape in shapes}
            for rep in range(repeat):
                progress("repetition %d of %d" % (rep + 1, repeat))
                for shape in shapes:
                    timings[shape.name].time_each_reader(reader_of, server, shape)
            for shape in shapes:
                medians[shape.name] = report_shape(report, server, shape, timings[shape.name])
        finally:
            execute.close()
            iterate.close()
            in_bytes.close()
            if sdk is not None:
                sdk.close()
    throughput_targets(report, medians)


def warm_up(report: Report, reader_of: Dict[str, Any], server: StreamServer) -> None:
    """Untimed reads per reader: connections open, code paths (stderr too) warm."""
    for name, read in reader_of.items():
        if read is None:
            continue
        for shape in WARMUP_SHAPES:
            try:
                readers.verify(name, read(shape.name), server.expected[shape.name])
            except Exception as exc:  # noqa: BLE001 -- reported, and the row will fail too
                report.failure(
                    "warm-up of %s on %s: %s: %s" % (name, shape.name, type(exc).__name__, exc)
                )


class Timings:
    """MB/s of every reader on one shape, a figure per repetition, and the
    first error of a reader that failed (it is then left out)."""

    def __init__(self, reader_of: Dict[str, Any]) -> None:
        self.speeds: Dict[str, List[float]] = {name: [] for name in reader_of}
        self.errors: Dict[str, str] = {}

    def time_each_reader(
        self,
        reader_of: Dict[str, Optional[Callable[[str], readers.Received]]],
        server: StreamServer,
        shape: Shape,
    ) -> None:
        """One repetition: every reader once, one after another."""
        expected = server.expected[shape.name]
        for name, read in reader_of.items():
            if read is None or name in self.errors:
                continue
            gc.collect()
            try:
                started = time.perf_counter()
                received = read(shape.name)
                elapsed = time.perf_counter() - started
                readers.verify(name, received, expected)
            except Exception as exc:  # noqa: BLE001 -- a failed reader is reported, not fatal
                self.errors[name] = "%s: %s" % (type(exc).__name__, exc)
                continue
            self.speeds[name].append(expected.payload_bytes / elapsed / 1e6)


def report_shape(
    report: Report, server: StreamServer, shape: Shape, timings: Timings
) -> Dict[str, Optional[float]]:
    """Print the rows of one shape; the medians."""
    expected = server.expected[shape.name]
    report.line()
    mix = ""
    if expected.stream_bytes["stderr"]:
        mix = " (stdout %s, stderr %s, %d heartbeats)" % (
            size_label(expected.stream_bytes["stdout"]),
            size_label(expected.stream_bytes["stderr"]),
            expected.heartbeats,
        )
    report.line(
        "%s: %s of payload%s, %d frames, %.1f MB chunked body"
        % (
            SHAPE_LABELS[shape.name],
            size_label(shape.payload_bytes),
            mix,
            expected.frames,
            expected.body_bytes / 1e6,
        )
    )
    report.line("  %-36s %s" % ("reader", "median MB/s   min-max"))
    medians: Dict[str, Optional[float]] = {}
    for name, speeds in timings.speeds.items():
        if name in timings.errors:
            report.line("  %-36s %9s" % (name, "n/a"))
            report.failure("%s on %s: %s" % (name, shape.name, timings.errors[name]))
            medians[name] = None
        elif not speeds:
            report.line("  %-36s %9s" % (name, "n/a (SDK not importable)"))
            medians[name] = None
        else:
            report.line("  %-36s %s" % (name, median_min_max(speeds)))
            medians[name] = statistics.median(speeds)
    report.line("  ratios: " + " · ".join(ratio_texts(medians)))
    return medians


def ratio(medians: Dict[str, Optional[float]], top: str, bottom: str) -> Optional[float]:
    numerator, denominator = medians.get(top), medians.get(bottom)
    if numerator is None or denominator is None:
        return None
    return numerator / denominator


def shape_ratio(
    medians: Dict[str, Dict[str, Optional[float]]], reader: str, shape_name: str, reference: str
) -> Optional[float]:
    """`reader`'s median on `shape_name` over its median on `reference` (None if unknown)."""
    numerator = medians.get(shape_name, {}).get(reader)
    denominator = medians.get(reference, {}).get(reader)
    if numerator is None or denominator is None:
        return None
    return numerator / denominator


def ratio_texts(medians: Dict[str, Optional[float]]) -> List[str]:
    pairs = (
        ("execute/per-line", EXECUTE, PER_LINE),
        ("execute/batched", EXECUTE, BATCHED),
        ("execute/SDK", EXECUTE, SDK),
        ("iter_output/execute", ITERATE, EXECUTE),
        ("text=False/execute", EXECUTE_BYTES, EXECUTE),
        ("server alone/per-line", SERVER_ALONE, PER_LINE),
    )
    texts = []
    for label, top, bottom in pairs:
        value = ratio(medians, top, bottom)
        texts.append("%s %s" % (label, "n/a" if value is None else "%.2fx" % value))
    return texts


THROUGHPUT_TARGETS = (
    ("execute / per-line ceiling, 64 KiB frames", SHAPE_64K, PER_LINE, 0.95),
    (
        "execute / per-line ceiling, 100-byte frames in 64 KiB chunks",
        SHAPE_100B_CHUNKED,
        PER_LINE,
        1.2,
    ),
    ("execute / per-line ceiling, 100-byte frames one chunk each", SHAPE_100B, PER_LINE, 0.65),
    ("execute / SDK, 100-byte frames one chunk each", SHAPE_100B, SDK, 3.0),
    ("execute / SDK, 100-byte frames in 64 KiB chunks", SHAPE_100B_CHUNKED, SDK, 3.5),
    ("execute / SDK, 64 KiB frames", SHAPE_64K, SDK, 1.15),
    (
        "execute / SDK, 100-byte frames in 64 KiB chunks, stdout and stderr mixed",
        SHAPE_MIXED,
        SDK,
        3.5,
    ),
)
# The loop over iter_output() against execute()'s on_output, on one shape.
ITERATE_TARGETS = (
    ("iter_output() loop / on_output callback (execute), 64 KiB frames", SHAPE_64K, 0.9),
    (
        "iter_output() loop / on_output callback (execute), 100-byte frames one chunk each",
        SHAPE_100B,
        0.9,
    ),
)
# execute(text=False) against execute() in text mode, on one shape: bytes,
# decoded by nothing, at least as fast.
BYTES_TARGETS = (
    ("execute(text=False) / execute() in text mode, 64 KiB frames", SHAPE_64K, 1.0),
    (
        "execute(text=False) / execute() in text mode, 100-byte frames in 64 KiB chunks",
        SHAPE_100B_CHUNKED,
        1.0,
    ),
)
# One reader on two shapes: (text, reader, shape, reference shape, bound) for
# reader's MB/s on shape / its MB/s on the reference shape.
SHAPE_TARGETS = (
    (
        "execute, mixed stdout/stderr with heartbeats and multi-byte text / stdout only, "
        "100-byte frames in 64 KiB chunks (within 15 %)",
        EXECUTE,
        SHAPE_MIXED,
        SHAPE_100B_CHUNKED,
        0.85,
    ),
)


def throughput_targets(report: Report, medians: Dict[str, Dict[str, Optional[float]]]) -> None:
    report.line()
    report.line("Throughput targets (medians of this run):")
    for text, shape_name, bottom, bound in THROUGHPUT_TARGETS:
        report.target(Target(text, ratio(medians[shape_name], EXECUTE, bottom), bound))
    for text, shape_name, bound in ITERATE_TARGETS:
        report.target(Target(text, ratio(medians[shape_name], ITERATE, EXECUTE), bound))
    for text, shape_name, bound in BYTES_TARGETS:
        report.target(Target(text, ratio(medians[shape_name], EXECUTE_BYTES, EXECUTE), bound))
    for text, reader, shape_name, reference, bound in SHAPE_TARGETS:
        value = shape_ratio(medians, reader, shape_name, reference)
        report.target(Target(text, value, bound))
    server_margin = [ratio(by_reader, SERVER_ALONE, PER_LINE) for by_reader in medians.values()]
    known = [value for value in server_margin if value is not None]
    if known:
        slowest = min(known)
        verdict = "not the bottleneck" if slowest >= 3 else "MAY BE THE BOTTLENECK"
        report.line(
            "  server alone is at least %.1fx faster than the per-line ceiling on every "
            "shape: %s" % (slowest, verdict)
        )


# --------------------------------------------------------------------------
# Memory


MEMORY_ROUTES = ("on_output", "iter_output")


def run_memory(report: Report, scale: float) -> None:
    small = Shape("memory-small", scaled(64 * MiB, scale, 64 * KiB), 64 * KiB)
    large = Shape("memory-large", scaled(1 * GiB, scale, 64 * KiB), 64 * KiB)
    warmup = Shape("memory-warmup", 1 * KiB, 64 * KiB)
    report.heading(
        "Memory: RSS of a child process streaming through execute() with on_output, and "
        "through a loop over iter_output() (default max_output_chars, 64 KiB frames)"
    )
    progress("generating the memory streams in the server process")
    diffs: Dict[str, Dict[str, float]] = {route: {} for route in MEMORY_ROUTES}
    with StreamServer([warmup, small, large]) as server:
        for route in MEMORY_ROUTES:
            for shape in (small, large):
                peak_over_idle = measure_memory(report, server, shape, warmup, route)
                if peak_over_idle is not None:
                    diffs[route][shape.name] = peak_over_idle
    for route in MEMORY_ROUTES:
        memory_targets(report, route, diffs[route], small, large)


def measure_memory(
    report: Report, server: StreamServer, shape: Shape, warmup: Shape, route: str
) -> Optional[float]:
    """One probe's line of the report; its peak - idle in MiB (None: no figure)."""
    label = size_label(shape.payload_bytes)
    progress("memory: %s through %s in a child process" % (label, route))
    probe = run_memory_probe(server, shape, warmup, route)
    if probe is None or not probe["verified"]:
        report.failure("memory probe for %s through %s: %r" % (label, route, probe))
        return None
    if probe["method"] != "clear_refs":
        report.line(
            "  (the RSS high-water mark could not be reset: peak is the process's "
            "lifetime maximum from resource.getrusage)"
        )
    idle, peak = probe["idle_kib"] / 1024, probe["peak_kib"] / 1024
    reset = probe["method"] == "clear_refs"
    method = "VmHWM reset via /proc/self/clear_refs" if reset else "getrusage"
    report.line(
        "  %-11s %-9s of output: idle %.1f MiB, peak %.1f MiB, peak - idle %.1f MiB "
        "(streamed in %.1f s, %s)"
        % (route, label, idle, peak, peak - idle, probe["seconds"], method)
    )
    return peak - idle


def memory_targets(
    report: Report, route: str, diffs: Dict[str, float], small: Shape, large: Shape
) -> None:
    for shape in (small, large):
        report.target(
            Target(
                "peak - idle, %s of output through %s" % (size_label(shape.payload_bytes), route),
                diffs.get(shape.name),
                64.0,
                at_most=True,
                unit="MiB",
            )
        )
    growth = None
    if small.name in diffs and large.name in diffs:
        growth = abs(diffs[large.name] - diffs[small.name])
    report.target(
        Target(
            "|diff(%s) - diff(%s)| through %s"
            % (size_label(large.payload_bytes), size_label(small.payload_bytes), route),
            growth,
            5.0,
            at_most=True,
            unit="MiB",
        )
    )


def run_memory_probe(
    server: StreamServer, shape: Shape, warmup: Shape, route: str
) -> Optional[Dict[str, Any]]:
    expected = server.expected[shape.name]
    spec = {
        "route": route,
        "url": server.url,
        "shape": shape.name,
        "warmup": warmup.name,
        "chars": expected.chars["stdout"],
        "tail": expected.tails["stdout"],
    }
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "memory_probe.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------
# Tail


def tail_chunks(count: int) -> List[str]:
    """`count` chunks of 100 characters of the benchmark text, from a pool of 1024."""
    text = payload(300 * KiB).decode("utf-8")
    pool = [text[i * 100 : i * 100 + 100] for i in range(1024)]
    return [pool[i & 1023] for i in range(count)]


def time_tail(chunks: List[str], encoded: List[bytes], cap: int) -> float:
    """Seconds to feed `encoded` to a fresh capture of `cap` characters; its text is checked."""
    capture = createos_exec._Output("utf-8", "strict", cap, None)
    started = time.perf_counter()
    for chunk in encoded:
        capture.feed("stdout", chunk)
    capture.finish()
    elapsed = time.perf_counter() - started
    expected = "".join(chunks[-(cap // 100 + 1) :])[-cap:]
    if capture.tails["stdout"].text() != expected or capture.combined.text() != expected:
        raise readers.VerificationError("the capture kept the wrong text")
    return elapsed


def time_naive_tail(chunks: List[str], cap: int, sample: int) -> float:
    """Seconds for `sample` naive appends, starting with the buffer already full."""
    text = ("".join(chunks[:1024]) * (cap // (1024 * 100) + 2))[-cap:]
    started = time.perf_counter()
    for chunk in chunks[:sample]:
        text = (text + chunk)[-cap:]
    elapsed = time.perf_counter() - started
    if len(text) != cap:
        raise readers.VerificationError("the naive tail has the wrong length")
    return elapsed


def run_tail(report: Report, repeat: int, scale: float) -> None:
    cap = scaled(4 * MiB, scale, 1000)
    sizes = [scaled(size, scale, 2000) // 100 * 100 for size in (8 * MiB, 16 * MiB, 32 * MiB)]
    report.heading(
        "Tail: createos_exec._Output (UTF-8 decoder, tails of %s characters) fed in "
        "100-character chunks, median of %d" % (size_label(cap).replace("B", ""), repeat)
    )
    chunks = tail_chunks(sizes[-1] // 100)
    encoded = [chunk.encode("utf-8") for chunk in chunks]
    timings: Dict[int, List[float]] = {size: [] for size in sizes}
    for _ in range(repeat):
        for size in sizes:
            gc.collect()
            timings[size].append(time_tail(chunks[: size // 100], encoded[: size // 100], cap))
    per_char = {}
    for size in sizes:
        seconds = statistics.median(timings[size])
        per_char[size] = seconds * 1e9 / size
        report.line(
            "  %-9s characters: %6.1f ns/char (%.3f s)"
            % (size_label(size).replace("B", ""), per_char[size], seconds)
        )
    steady = (
        (statistics.median(timings[sizes[-1]]) - statistics.median(timings[sizes[-2]]))
        * 1e9
        / (sizes[-1] - sizes[-2])
    )
    report.line(
        "  with the tail full (the characters from %s to %s): %.1f ns/char"
        % (size_label(sizes[-2]).replace("B", ""), size_label(sizes[-1]).replace("B", ""), steady)
    )
    growth = per_char[sizes[-1]] / per_char[sizes[0]]
    report.line(
        "  ns/char at %s / at %s: %.2f -> %s"
        % (
            size_label(sizes[-1]).replace("B", ""),
            size_label(sizes[0]).replace("B", ""),
            growth,
            "constant per character: O(1) amortised" if growth < 1.5 else "GROWS with the size",
        )
    )
    sample = scaled(2000, scale, 50)
    naive_seconds = time_naive_tail(chunks, cap, sample)
    naive_per_char = naive_seconds * 1e9 / (sample * 100)
    report.line(
        "  naive s = (s + chunk)[-cap:]: %d chunks timed with the buffer already full: "
        "%.1f ns/char" % (sample, naive_per_char)
    )
    report.line(
        "  -> %s would take about %.0f s naively (extrapolated, not run) against %.3f s "
        "with the capture (%.0fx)"
        % (
            size_label(sizes[-1]).replace("B", "") + " characters",
            naive_per_char * sizes[-1] / 1e9,
            per_char[sizes[-1]] * sizes[-1] / 1e9,
            naive_per_char / per_char[sizes[-1]],
        )
    )


# --------------------------------------------------------------------------
# Latency


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation: the noise of a series of timings."""
    middle = statistics.median(values)
    return statistics.median(abs(value - middle) for value in values)


def capture_requests(server: Any) -> List[requests.PreparedRequest]:
    """What one execute("true") sends, recorded by a response hook on its session."""
    seen: List[requests.PreparedRequest] = []
    session = requests.Session()
    session.hooks["response"].append(lambda response, *_, **__: seen.append(response.request))
    with createos_exec.Client(
        server.url, server.api_key, session=session, rate_limit=None
    ) as client:
        client.execute(LOCAL_SANDBOX, "true")
    session.close()
    return seen


def replay(session: requests.Session, captured: List[requests.PreparedRequest], key: str) -> None:
    """Send the captured requests again, the new process id in place of the old one."""
    process_id = None
    headers = {"X-Api-Key": key, "Content-Type": "application/json"}
    for request in captured:
        url = str(request.url)
        if process_id is not None:
            url = re.sub(r"/processes/[^/?]+", "/processes/" + process_id, url)
        response = session.request(
            str(request.method), url, data=request.body, headers=headers, stream=True
        )
        if request.method == "POST" and url.endswith("/processes"):
            process_id = response.json()["data"]["process_id"]
        else:
            for _ in response.iter_content(None):
                pass
        response.close()


def run_latency(report: Report, runs: int, resume_runs: int) -> None:
    report.heading("Latency against tests/local_server.py (real bash processes)")
    with LocalServer() as server:
        captured = capture_requests(server)
        client = createos_exec.Client(server.url, server.api_key)
        count_requests_of_one_execute(report, server, client)
        unpaced = createos_exec.Client(server.url, server.api_key, rate_limit=None)
        unpaced.execute(LOCAL_SANDBOX, "true")
        bare = requests.Session()
        replay(bare, captured, server.api_key)
        timings = time_latency_rounds(client, unpaced, bare, captured, server.api_key, runs)
        report_latency(report, timings, runs)
        for closable in (client, unpaced, bare):
            closable.close()
    for reading in READINGS:
        run_deadline_cost(report, reading, runs)
    run_resume(report, resume_runs)


def count_requests_of_one_execute(report: Report, server: Any, client: Any) -> None:
    """Requests and TCP connections the server sees for one execute("true"), warm client."""
    client.execute(LOCAL_SANDBOX, "true")  # the measured run may reuse this connection
    warm_port = server.requests[-1].client_port
    before = len(server.requests)
    client.execute(LOCAL_SANDBOX, "true")
    seen = server.requests[before:]
    ports = {record.client_port for record in seen}
    report.line(
        '  one execute("true") after a warm-up: %d requests (%s) on %d TCP connection(s), '
        "%d of them new"
        % (
            len(seen),
            ", ".join("%s %s" % (r.method, re.sub(r"proc_[\w-]+", "{id}", r.path)) for r in seen),
            len(ports),
            len(ports - {warm_port}),
        )
    )
    report.target(Target('requests of one execute("true")', len(seen), 3, True, ""))
    report.target(Target("TCP connections it used", len(ports), 1, True, ""))
    report.target(
        Target(
            "new TCP connections it opened (warm one kept alive)",
            len(ports - {warm_port}),
            0,
            True,
            "",
        )
    )


def time_latency_rounds(
    client: Any, unpaced: Any, bare: requests.Session, captured: Any, key: str, runs: int
) -> Dict[str, List[float]]:
    """Interleaved: execute (default rate limit), the bare replay, execute (rate_limit=None)."""
    timings: Dict[str, List[float]] = {"execute": [], "bare": [], "unpaced": []}
    steps = (
        ("execute", lambda: client.execute(LOCAL_SANDBOX, "true")),
        ("bare", lambda: replay(bare, captured, key)),
        ("unpaced", lambda: unpaced.execute(LOCAL_SANDBOX, "true")),
    )
    for _ in range(runs):
        for name, step in steps:
            started = time.perf_counter()
            step()
            timings[name].append((time.perf_counter() - started) * 1000)
    return timings


def report_latency(report: Report, timings: Dict[str, List[float]], runs: int) -> None:
    execute, bare, unpaced = timings["execute"], timings["bare"], timings["unpaced"]
    report.line(
        '  execute("true"): median %.2f ms (%.2f-%.2f) over %d runs; the same requests '
        "with a bare requests.Session: median %.2f ms (%.2f-%.2f); execute's own cost %.2f ms"
        % (
            statistics.median(execute),
            min(execute),
            max(execute),
            runs,
            statistics.median(bare),
            min(bare),
            max(bare),
            statistics.median(execute) - statistics.median(bare),
        )
    )
    difference = statistics.median(execute) - statistics.median(unpaced)
    noise = max(mad(execute), mad(unpaced))
    report.line(
        "  rate limiter: default (300 per 60 s) median %.2f ms, rate_limit=None median %.2f ms, "
        "difference %+.2f ms; noise (largest median absolute deviation) %.2f ms"
        % (statistics.median(execute), statistics.median(unpaced), difference, noise)
    )
    report.target(
        Target(
            "rate limiter delay (default - rate_limit=None, none if negative), bound: the noise",
            max(0.0, difference),
            noise,
            at_most=True,
            unit="ms",
        )
    )
    own, shared = limiter_cost_us(shared=False), limiter_cost_us(shared=True)
    report.line(
        "  rate limiter alone: acquire + release below the limit take %.2f us per request "
        "in a window of this process, %.2f us in a window shared through its file "
        '(median of 20 windows of 300); %.3f %% and %.3f %% of execute("true")'
        % (
            own,
            shared,
            own / 1000 / statistics.median(execute) * 100,
            shared / 1000 / statistics.median(execute) * 100,
        )
    )


def limiter_cost_us(shared: bool) -> float:
    """The pacing of one request below the limit, in microseconds: a fresh window of 300."""
    costs = []
    with tempfile.TemporaryDirectory() as folder:
        for n in range(20):
            window = None
            if shared:
                path = os.path.join(folder, "window-%d" % n)
                window = createos_exec._SharedWindow(path, bytes(16), 300, 60.0)
            limiter = createos_exec._RateLimiter(300, 60.0, window)
            started = time.perf_counter()
            for _ in range(300):
                limiter.release(limiter.acquire(60.0), 200)
            costs.append((time.perf_counter() - started) / 300 * 1e6)
    return statistics.median(costs)


def run_deadline_cost(report: Report, reading: Any, runs: int) -> None:
    """execute(["true"]) with timeout=60 (the watchdog in the sandbox) against
    without, interleaved, under one reading of the local server."""
    timings: Dict[str, List[float]] = {"without": [], "timeout": []}
    steps = (("without", {}), ("timeout", {"timeout": 60}))
    with LocalServer(reading=reading) as server:
        with createos_exec.Client(server.url, server.api_key, rate_limit=None) as client:
            client.execute(LOCAL_SANDBOX, ["true"], timeout=60)
            for _ in range(runs):
                for name, options in steps:
                    started = time.perf_counter()
                    client.execute(LOCAL_SANDBOX, ["true"], **options)
                    timings[name].append((time.perf_counter() - started) * 1000)
    without, timeout = timings["without"], timings["timeout"]
    difference = statistics.median(timeout) - statistics.median(without)
    noise = max(mad(without), mad(timeout))
    report.line(
        '  execute(["true"], timeout=60) under the %s reading: median %.2f ms (%.2f-%.2f), '
        "without timeout= %.2f ms (%.2f-%.2f), difference %+.2f ms; noise %.2f ms"
        % (
            reading.name,
            statistics.median(timeout),
            min(timeout),
            max(timeout),
            statistics.median(without),
            min(without),
            max(without),
            difference,
            noise,
        )
    )
    report.target(
        Target(
            "cost of timeout= (%s reading; none if negative), bound: the noise" % reading.name,
            max(0.0, difference),
            noise,
            at_most=True,
            unit="ms",
        )
    )


RESUME_COMMAND = ["seq", "1", "3000"]  # 13,893 bytes at once: 14+ frames of 1 KiB
RESUME_FRAME_LIMIT = 1024
RESUME_AFTER_FRAMES = 5


def stamper(stamps: List[float], clock: Callable[[], float]) -> Callable[[str, str], None]:
    """An on_output that records when each delivery happens."""

    def on_output(stream: str, text: str) -> None:
        stamps.append(clock())

    return on_output


def run_resume(report: Report, runs: int) -> None:
    """The pause in on_output around a connection reset, with the default Client settings."""
    expected = "".join("%d\n" % number for number in range(1, 3001))
    gaps, normal = [], []
    with LocalServer(frame_limit=RESUME_FRAME_LIMIT) as server:
        client = createos_exec.Client(server.url, server.api_key)
        client.execute(LOCAL_SANDBOX, "true")
        for _ in range(runs):
            server.drop_stream(after_frames=RESUME_AFTER_FRAMES)
            stamps: List[float] = []
            result = client.execute(
                LOCAL_SANDBOX, RESUME_COMMAND, on_output=stamper(stamps, time.perf_counter)
            )
            if (
                result.stdout != expected
                or result.reconnects != 1
                or len(stamps) <= RESUME_AFTER_FRAMES
            ):
                report.failure(
                    "resume run: %d reconnects, %d deliveries, output %s"
                    % (
                        result.reconnects,
                        len(stamps),
                        "intact" if result.stdout == expected else "WRONG",
                    )
                )
                continue
            k = RESUME_AFTER_FRAMES
            gaps.append((stamps[k] - stamps[k - 1]) * 1000)
            normal.extend((b - a) * 1000 for a, b in zip(stamps[: k - 1], stamps[1:k]))
        client.close()
    if gaps:
        report.line(
            "  resume after a connection reset (drop after %d frames of `%s`): gap between the "
            "last output before the break and the first after it: median %.1f ms (%.1f-%.1f) "
            "over %d runs; between frames without a break: median %.3f ms"
            % (
                RESUME_AFTER_FRAMES,
                " ".join(RESUME_COMMAND),
                statistics.median(gaps),
                min(gaps),
                max(gaps),
                len(gaps),
                statistics.median(normal) if normal else float("nan"),
            )
        )
    report.target(
        Target(
            "median resume gap after a connection reset",
            statistics.median(gaps) if gaps else None,
            50.0,
            at_most=True,
            unit="ms",
        )
    )


# --------------------------------------------------------------------------
# Pacing

PACING_LIMIT = (40, 1.0)


def run_pacing(report: Report, scale: float) -> None:
    import pacing

    commands = scaled(25, scale, 2)
    report.heading(
        "Pacing: many clients behind one address (tests/local_server.py answering 429 "
        "over %d requests per %g s)" % PACING_LIMIT
    )
    label = "4 spawned processes x %d commands" % commands
    progress("pacing: 4 processes sharing one window")
    shared = pacing.run_scenario(processes=4, commands=commands, limit=PACING_LIMIT, shared=True)
    pacing_line(report, label + ", one shared window", shared)
    report.target(Target("requests answered 429, shared window", shared.refused, 20, True, ""))
    report.target(Target("wall time / floor, shared window", shared.ratio, 1.5, True))
    own = "windows of their own (machines behind one address)"
    for threads in (1, 4):
        for narrowing in (True, False):
            progress(
                "pacing: 4 processes, own windows, %d threads, narrowing %s" % (threads, narrowing)
            )
            figures = pacing.run_scenario(
                processes=4,
                commands=commands,
                limit=PACING_LIMIT,
                shared=False,
                threads=threads,
                narrowing=narrowing,
            )
            text = "%s, %s%s%s" % (
                label,
                own,
                ", on 4 threads each" if threads > 1 else "",
                "" if narrowing else ", for comparison without narrowing after a 429",
            )
            pacing_line(report, text, figures)
    progress("pacing: 64 threads sharing one client")
    threads = pacing.run_threads(threads=64, commands=scaled(256, scale, 64), limit=PACING_LIMIT)
    pacing_line(report, "64 threads x %d commands, one Client" % threads.commands, threads)
    report.target(
        Target(
            "most arrivals in any window, 64 threads",
            threads.max_in_window,
            PACING_LIMIT[0],
            True,
            "",
        )
    )


def pacing_line(report: Report, label: str, figures: Any) -> None:
    report.line(
        "  %s: %d/%d exact, %d processes created (%d commands twice), %d errors reached a "
        "caller, %d of %d requests answered 429 (%d on creation), at most %d arrivals in any "
        "%g s window; %.2f s, floor %.2f s: %.2fx"
        % (
            label,
            figures.exact,
            figures.commands,
            figures.created,
            figures.created_twice,
            figures.errors,
            figures.refused,
            figures.requests,
            figures.refused_creations,
            figures.max_in_window,
            figures.period,
            figures.seconds,
            figures.floor,
            figures.ratio,
        )
    )
    kept = figures.exact == figures.commands == figures.created and not figures.errors
    if not kept or figures.created_twice:
        report.failure("pacing, %s: a promise was broken" % label)


# --------------------------------------------------------------------------
# Stdin

STDIN_SINK = (
    "import hashlib, sys\n"
    "data = sys.stdin.buffer.read()\n"
    "print(len(data), hashlib.sha256(data).hexdigest())\n"
)


def run_stdin(report: Report, repeat: int, scale: float) -> None:
    size = scaled(16 * MiB, scale, 64 * KiB)
    data = os.urandom(size)
    expected = "%d %s\n" % (size, hashlib.sha256(data).hexdigest())
    report.heading(
        "Stdin: %s written to a process, median and min-max of %d interleaved repetitions"
        % (size_label(size), repeat)
    )
    sdk_module = readers.load_sdk()
    timings: Dict[str, List[float]] = {"write": [], "sdk": []}
    requests_per_mib: List[float] = []
    with local_server_process() as url:
        session = CountingSession()
        client = createos_exec.Client(url, LOCAL_KEY, rate_limit=None, session=session)
        sdk_client = sandbox = None
        if sdk_module is not None:
            sdk_client = sdk_module.Client(api_key=LOCAL_KEY, base_url=url)
            sandbox = sdk_client.get_sandbox(LOCAL_SANDBOX)
        try:
            for rep in range(repeat):
                progress("stdin: repetition %d of %d" % (rep + 1, repeat))
                before = session.inputs
                timings["write"].append(time_one_write(report, client, data, expected, None))
                requests_per_mib.append((session.inputs - before) / (size / MiB))
                if sandbox is not None:
                    timings["sdk"].append(time_one_write(report, client, data, expected, sandbox))
        finally:
            client.close()
            if sdk_client is not None:
                sdk_client.close()
    report_stdin(report, size, timings, requests_per_mib)


@contextlib.contextmanager
def local_server_process(*options: str) -> Iterator[str]:
    """tests/local_server.py in a process of its own (its work does not compete with the
    writers' for one interpreter), started with `options`; its base URL."""
    server = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "local_server.py"), "--port", "0", *options],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        yield server.stdout.readline().strip()
    finally:
        server.terminate()
        server.wait(30)


class CountingSession(requests.Session):
    """Counts the input requests that leave, to report requests per MiB."""

    inputs = 0

    def request(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
        if str(url).endswith("/input"):
            self.inputs += 1
        return super().request(method, url, *args, **kwargs)


def time_one_write(report: Report, client: Any, data: bytes, expected: str, sandbox: Any) -> float:
    """Seconds to write `data` to a fresh process (by write(), or the SDK's pieces), verified."""
    proc = client.start(LOCAL_SANDBOX, [sys.executable, "-c", STDIN_SINK], stdin=createos_exec.PIPE)
    piece = createos_exec._INPUT_PIECE
    started = time.perf_counter()
    if sandbox is None:
        proc.write(data)
    else:
        for offset in range(0, len(data), piece):
            sandbox.processes.input_bytes(proc.process_id, data[offset : offset + piece])
    seconds = time.perf_counter() - started
    if proc.communicate()[0] != expected:
        report.failure("stdin: the process did not receive exactly what was written")
    return seconds


def report_stdin(
    report: Report, size: int, timings: Dict[str, List[float]], requests_per_mib: List[float]
) -> None:
    report.line("  %-44s %11s   %s" % ("writer", "MB/s", "min-max"))
    medians: Dict[str, Optional[float]] = {}
    for name, label in (("write", "RemoteProcess.write()"), ("sdk", "SDK processes.input_bytes()")):
        if not timings[name]:
            report.line("  %-44s n/a (SDK not importable)" % label)
            medians[name] = None
            continue
        rates = [size / 1e6 / seconds for seconds in timings[name]]
        report.line("  %-44s %s" % (label, median_min_max(rates)))
        medians[name] = statistics.median(rates)
    report.line("  write() requests per MiB: %s" % median_min_max(requests_per_mib).strip())
    report.target(
        Target("write() requests per MiB", statistics.median(requests_per_mib), 8, True, "")
    )
    write, sdk = medians["write"], medians["sdk"]
    ratio_value = write / sdk if write is not None and sdk else None
    report.target(Target("write() MB/s / SDK input MB/s", ratio_value, 1.0))


# --------------------------------------------------------------------------
# Keys: a terminal's round trips


def run_keys(report: Report, scale: float) -> None:
    rounds = max(10, int(200 * min(1.0, scale)))
    report.heading("Keys: %d keystroke round trips on a terminal, and a 64 KiB paste" % rounds)
    with local_server_process() as url:
        session = CountingSession()
        client = createos_exec.Client(url, LOCAL_KEY, rate_limit=None, session=session)
        try:
            process = client.start(LOCAL_SANDBOX, PASTE_READER, pty=True, text=False)
            echoes = Echoes(data for _, data in process.iter_output())
            bare = BareTerminal(url, process.process_id)
            timings: Dict[str, List[float]] = {"session": [], "bare": []}
            for typed in range(1, 2 * rounds, 2):
                timings["session"].append(key_round_trip(process.write, echoes, typed))
                timings["bare"].append(key_round_trip(bare.write, bare.echoes, typed + 1))
            bare.close()
            before = session.inputs
            paste_seconds = time_paste(process, echoes)
            paste_requests = session.inputs - before
            process.kill()
        finally:
            client.close()
    report_keys(report, timings, paste_seconds, paste_requests)


# The terminal's program: it gives each line back marked, so that the paste's last
# line is told from its echo (which a loaded machine's terminal may drop: its echo
# buffer is bounded); a key alone it gives nothing back for, the terminal echoes it.
PASTE_READER = ["sed", "-u", "s/^/+/"]


class Echoes:
    """A stream of the terminal's output, and the keys' echoes read from it so far:
    both streams see every key's echo, whichever of them wrote it."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._pieces = pieces
        self.keys = 0

    def until(self, keys: int) -> None:
        """Read until `keys` keys in all have been echoed here."""
        while self.keys < keys:
            self.keys += next(self._pieces).count(b"k")

    def until_seen(self, mark: bytes) -> None:
        seen = bytearray()
        while mark not in seen:
            seen += next(self._pieces)


def key_round_trip(write: Callable[[bytes], Any], echoes: Echoes, typed: int) -> float:
    """Seconds from a key written (the `typed`-th of the terminal) to its echo read."""
    started = time.perf_counter()
    write(b"k")
    echoes.until(typed)
    return time.perf_counter() - started


class BareTerminal:
    """The same terminal through a bare requests.Session: POST /input, and the
    echo's frame read from one stream kept open (the last seq onwards)."""

    def __init__(self, url: str, process_id: str) -> None:
        self._path = "%s/v1/sandboxes/%s/processes/%s" % (url, LOCAL_SANDBOX, process_id)
        self._session = requests.Session()
        self._session.headers["X-Api-Key"] = LOCAL_KEY
        newest = self._session.get(self._path).json()["data"].get("newest_seq", 0)
        self._stream = self._session.get(
            self._path + "/connect", params={"after": newest}, stream=True
        )
        self.echoes = Echoes(self._frames())

    def write(self, data: bytes) -> None:
        body = {"data_base64": base64.b64encode(data).decode()}
        self._session.post(self._path + "/input", json=body).raise_for_status()

    def _frames(self) -> Iterator[bytes]:
        for line in self._stream.iter_lines(chunk_size=1):
            frame = json.loads(line)
            if "data_base64" in frame:
                yield base64.b64decode(frame["data_base64"])

    def close(self) -> None:
        self._stream.close()
        self._session.close()


def time_paste(process: Any, echoes: Echoes) -> float:
    """Seconds from a 64 KiB paste (lines of 64 bytes) written at once to its
    last line given back by the program."""
    line = b"%063d\n"
    paste = b"".join(line % n for n in range(1023)) + b"end-of-paste".ljust(63, b".") + b"\n"
    assert len(paste) == 64 * KiB
    started = time.perf_counter()
    process.write(paste)
    echoes.until_seen(b"+end-of-paste")
    return time.perf_counter() - started


def report_keys(
    report: Report, timings: Dict[str, List[float]], paste_seconds: float, paste_requests: int
) -> None:
    report.line("  %-44s %11s %11s" % ("round trip", "median ms", "p90 ms"))
    medians = {}
    for name, label in (("session", "write() + iter_output()"), ("bare", "bare /input + frame")):
        ms = sorted(seconds * 1000 for seconds in timings[name])
        medians[name] = statistics.median(ms)
        p90 = ms[min(len(ms) - 1, int(len(ms) * 0.9))]
        report.line("  %-44s %11.2f %11.2f" % (label, medians[name], p90))
    report.line(
        "  64 KiB paste: %d requests, %.0f ms to its last line given back"
        % (paste_requests, paste_seconds * 1000)
    )
    ratio_value = medians["session"] / medians["bare"] if medians["bare"] else None
    report.target(Target("keystroke round trip / bare /input + frame", ratio_value, 1.5, True))


# --------------------------------------------------------------------------
# Files


# The links of the files section: loopback, as fast as the two cores go, and
# two networks (transfers.py's paced proxy, each direction at this many bytes
# per second), where hashing costs a smaller share of a transfer; and the part
# of the file each moves (a quarter at 100 Mbit/s, 5 s a transfer).
LINKS = (("loopback", None, 1), ("a 1 Gbit/s link", 125e6, 1), ("a 100 Mbit/s link", 12.5e6, 4))
TREE_FILES = 10_000  # the small files of the directory whose requests are counted


def run_files(report: Report, repeat: int, scale: float) -> None:
    size = scaled(256 * MiB, scale, 64 * KiB)
    big = scaled(1 * GiB, scale, 64 * KiB)
    report.heading(
        "Files: put() and get() of %s against a bare requests PUT and GET, median and "
        "min-max of %d interleaved repetitions" % (size_label(size), repeat)
    )
    with local_server_process("--file-size-limit", str(4 * GiB)) as url:
        for link, rate, part in LINKS:
            moved = max(size // part, 64 * KiB)
            report.line("  %s, %s:" % (link, size_label(moved)))
            progress("files: %d repetitions of %s each way, %s" % (repeat, size_label(moved), link))
            with transfers.paced_link(url, rate) if rate else contextlib.nullcontext(url) as via:
                seconds, exact = transfers.time_transfers(via, moved, repeat)
            if not exact:
                report.failure("files: a copy differs from the file sent (%s)" % link)
            report_transfers(report, moved, seconds, link)
        progress("files: where the time of a put() and a get() goes")
        report_profile(report, transfers.profile(url, size), size)
        sent = transfers.requests_per_small_file(url)
        for route, requests_sent in sent.items():
            report.line(
                "  requests of a 1 KiB %s: %d (%s)"
                % (route, len(requests_sent), ", ".join(requests_sent))
            )
            report.target(Target("requests of a 1 KiB %s" % route, len(requests_sent), 2, True, ""))
        files = scaled(TREE_FILES, scale, 50)
        progress("files: a directory of %d small files each way" % files)
        for route, (requests_sent, taken) in transfers.tree_requests(url, files).items():
            report.line(
                "  requests of a %s of a directory of %d files: %d (%s), %.2f s"
                % (route, files, len(requests_sent), ", ".join(requests_sent), taken)
            )
            text = "requests of a %s of %d files / tar | ssh's 1" % (route, files)
            report.target(Target(text, len(requests_sent), 3, True, "x"))
        for direction in ("put", "get"):
            progress("files: memory of a %s() of %s" % (direction, size_label(big)))
            measured = transfers.probe_memory(url, direction, big)
            if measured is None or not measured["verified"]:
                report.failure("files: memory probe of %s(): %r" % (direction, measured))
                continue
            idle, peak = measured["idle_kib"] / 1024, measured["peak_kib"] / 1024
            report.line(
                "  %s() of %s: idle %.1f MiB, peak %.1f MiB, peak - idle %.1f MiB (%.1f s, %s)"
                % (
                    direction,
                    size_label(big),
                    idle,
                    peak,
                    peak - idle,
                    measured["seconds"],
                    measured["method"],
                )
            )
            report.target(
                Target(
                    "peak - idle, %s() of %s" % (direction, size_label(big)),
                    peak - idle,
                    64.0,
                    True,
                    "MiB",
                )
            )


def report_transfers(report: Report, size: int, seconds: Dict[str, List[float]], link: str) -> None:
    report.line("  %-44s %11s   %s" % ("route", "MB/s", "min-max"))
    rates = {}
    for name in transfers.ROUTES:
        values = [size / 1e6 / taken for taken in seconds[name]]
        rates[name] = statistics.median(values)
        report.line("  %-44s %s" % (name, median_min_max(values)))
    for ours, bare in (("put()", "bare PUT"), ("get()", "bare GET")):
        report.target(
            Target(
                "%s MB/s / %s MB/s, verified, %s" % (ours, bare, link),
                rates[ours] / rates[bare],
                0.9,
            )
        )


def report_profile(report: Report, found: Dict[str, Any], size: int) -> None:
    """Where one put() and one get() spent their time over loopback, and what one
    SHA-256 of the file costs here and there. A put()'s PUTs end when their
    bodies are sent; a get()'s GET when its head came, its body read after."""
    for call in ("put()", "get()"):
        taken, spans = found[call]
        moving = [span for span in spans if span[0].endswith("files") and not span[3]]
        beside = [span[2] - span[1] for span in spans if span[3]]
        last = max(end for _, _, end, _ in moving)
        after = ", %.3f s after the last PUT" % (taken - last) if call == "put()" else ""
        report.line(
            "  where a %s of %s went: %.2f s; %d file requests, %d execs beside them "
            "(median %.3f s)%s"
            % (
                call,
                size_label(size),
                taken,
                len(moving),
                len(beside),
                statistics.median(beside) if beside else 0.0,
                after,
            )
        )
    report.line(
        "  one SHA-256 of %s: %.3f s here (hashlib), %s s by openssl, %s s by sha256sum"
        % tuple(
            [size_label(size), found["hashlib"]]
            + ["%.3f" % found[tool] if found[tool] else "-" for tool in ("openssl", "sha256sum")]
        )
    )


# --------------------------------------------------------------------------
# Main


def parse_arguments(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="createos_exec performance benchmark (see the module docstring)."
    )
    parser.add_argument("--repeat", type=int, default=5, help="repetitions per reader (default 5)")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiplies every size (default 1; 0.001: tiny)"
    )
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help="comma-separated sections among %s (default: all)" % ",".join(SECTIONS),
    )
    options = parser.parse_args(argv)
    options.sections = [name.strip() for name in options.only.split(",") if name.strip()]
    unknown = sorted(set(options.sections) - set(SECTIONS))
    if unknown:
        parser.error("unknown section(s): %s" % ", ".join(unknown))
    if options.repeat < 1 or not options.scale > 0:
        parser.error("--repeat must be >= 1 and --scale > 0")
    return options


def main(argv: Optional[Sequence[str]] = None) -> int:
    options = parse_arguments(argv)
    started = time.monotonic()
    report = Report()
    report.line("createos_exec performance benchmark")
    for line in versions():
        report.line("  " + line)
    report.line(
        "  settings: --repeat %d --scale %g --only %s"
        % (options.repeat, options.scale, ",".join(options.sections))
    )
    if "throughput" in options.sections:
        run_throughput(report, options.repeat, options.scale)
    if "memory" in options.sections:
        run_memory(report, options.scale)
    if "tail" in options.sections:
        run_tail(report, options.repeat, options.scale)
    if "latency" in options.sections:
        run_latency(
            report, runs=scaled(50, options.scale, 3), resume_runs=scaled(15, options.scale, 2)
        )
    if "pacing" in options.sections:
        run_pacing(report, options.scale)
    if "stdin" in options.sections:
        run_stdin(report, options.repeat, options.scale)
    if "files" in options.sections:
        run_files(report, options.repeat, options.scale)
    if "keys" in options.sections:
        run_keys(report, options.scale)
    report.heading("Summary")
    met = sum(1 for target in report.targets if target.verdict == "met")
    missed = [target for target in report.targets if target.verdict == "MISSED"]
    report.line(
        "  targets: %d met, %d missed, %d n/a"
        % (met, len(missed), len(report.targets) - met - len(missed))
    )
    for target in missed:
        report.line(target.line())
    for failure in report.failures:
        report.line("  FAILED: " + failure)
    report.line("  total time: %.0f s" % (time.monotonic() - started))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
