"""Smoke test of benchmarks/run.py: at a tiny scale it runs every section and reports every row.

No timing is asserted anywhere: the benchmark measures and prints its targets
as met or MISSED; whether they are met is not a test result.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys

import pytest
from support import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import readers  # noqa: E402
import run as run_module  # noqa: E402
import stream_server  # noqa: E402
from local_server import guest_environment  # noqa: E402

SHAPES = (
    "64 KiB frames, one HTTP chunk per frame",
    "100-byte frames, one HTTP chunk per frame",
    "100-byte frames in 64 KiB HTTP chunks",
    "100-byte frames in 64 KiB chunks, stdout and stderr interleaved, heartbeats, multi-byte text",
)
READERS = (
    "server alone (drain, no parsing)",
    "per-line ceiling (raw socket)",
    "batched ceiling (raw socket)",
    "createos_exec Client.execute()",
    "createos_exec execute(text=False)",
    "official SDK processes.connect()",
)
NUMBER = r"[0-9]+(?:\.[0-9]+)?"
# The benchmarks run unmeasured, as the sandbox's processes do: they drive the
# routes the suite measures already, and coverage's hook in each of their
# processes was a tenth of the suite's CPU.
UNMEASURED = guest_environment()


def run_tiny_benchmark(section):
    return subprocess.run(
        [
            sys.executable, os.path.join("benchmarks", "run.py"),
            "--scale", "0.001", "--repeat", "1", "--only", section,
        ],
        cwd=ROOT,
        env=UNMEASURED,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard only: a loaded machine takes minutes
    )  # fmt: skip


def rows_with_a_number(report, label):
    pattern = r"^\s+%s\s+(%s)\s+%s-%s$" % (re.escape(label), NUMBER, NUMBER, NUMBER)
    return re.findall(pattern, report, flags=re.MULTILINE)


def throughput(report):
    assert "Throughput targets" in report
    for shape in SHAPES:
        assert shape in report, shape
    sdk_missing = "SDK n/a (not importable)" in report
    for reader in READERS:
        if reader.startswith("official SDK") and sdk_missing:
            assert report.count(reader + " ") == len(SHAPES)
            continue
        assert len(rows_with_a_number(report, reader)) == len(SHAPES), reader
    assert len(re.findall(r"^  ratios: execute/per-line %sx" % NUMBER, report, re.M)) == len(SHAPES)
    assert re.search(r"\] execute, mixed .* \(within 15 %%\): %sx" % NUMBER, report)
    assert re.search(r"\] iter_output\(\) loop / on_output callback .*: %sx" % NUMBER, report)
    in_bytes = r"\] (execute\(text=False\) / execute\(\) in text mode, .*): %sx" % NUMBER
    assert len(set(re.findall(in_bytes, report))) == 2  # each shape's (the summary repeats)


def memory(report):
    memory_rows = r"(on_output|iter_output) +\S+ \S+ +of output: idle %s MiB, peak %s MiB"
    assert [route for route in re.findall(memory_rows % (NUMBER, NUMBER), report)] == [
        "on_output", "on_output", "iter_output", "iter_output"
    ]  # fmt: skip


def tail(report):
    assert len(re.findall(r"characters: +%s ns/char" % NUMBER, report)) == 3
    assert re.search(r"naive .* %s ns/char" % NUMBER, report)


def latency(report):
    assert re.search(r'one execute\("true"\) after a warm-up: [0-9]+ requests', report)
    assert re.search(r"rate limiter: default .* median %s ms, rate_limit=None" % NUMBER, report)
    assert re.search(r"resume after a connection reset .* median %s ms" % NUMBER, report)
    deadline_cost = (
        r'execute\(\["true"\], timeout=60\) under the \w+ reading: median %s ms' % NUMBER
    )
    assert len(re.findall(deadline_cost, report)) == 2
    assert re.search(
        r"rate limiter alone: .* %s us in a window shared through its file" % NUMBER, report
    )


def pacing(report):
    pacing = r"^  .*%s[^:]*: ([0-9]+)/\1 exact, \1 processes created \(0 commands twice\), 0 err"
    for label in ("one shared window", "windows of their own", "without narrowing", "one Client"):
        assert re.search(pacing % re.escape(label), report, re.M), label


def stdin(report):
    assert len(rows_with_a_number(report, "RemoteProcess.write()")) == 1
    assert re.search(r"^  write\(\) requests per MiB: %s" % NUMBER, report, re.M)


def files(report):
    links = ("loopback", "a 1 Gbit/s link", "a 100 Mbit/s link")
    for route in ("put()", "bare PUT", "get()", "bare GET"):
        assert len(rows_with_a_number(report, route)) == len(links), route
    verified = r"\] (\w+\(\)) MB/s / bare \w+ MB/s, verified, ([\w /]+): %sx" % NUMBER
    assert set(re.findall(verified, report)) == {
        (f, link) for f in ("put()", "get()") for link in links
    }
    went = r"^  where a (\w+\(\)) of .* went: %s s; [0-9]+ file requests, [0-9]+ execs beside"
    assert re.findall(went % NUMBER, report, re.M) == ["put()", "get()"]
    assert re.search(r"^  one SHA-256 of .*: %s s here \(hashlib\)" % NUMBER, report, re.M)
    requests_sent = r"^  requests of a 1 KiB (\w+\(\)): [0-9]+ \([A-Z]+ \w+, [A-Z]+ \w+\)$"
    assert re.findall(requests_sent, report, re.M) == ["put()", "get()"]
    tree = r"^  requests of a (.*) of a directory of [0-9]+ files: ([0-9]+) \(.*\), %s s$" % NUMBER
    assert [route for route, _ in re.findall(tree, report, re.M)] == [
        "put()",
        'get() of a path ending in "/"',
        "get()",
    ]
    assert len(re.findall(r"^  \w+\(\) of .*: idle %s MiB, peak" % NUMBER, report, re.M)) == 2


def keys(report):
    for route in ("write() + iter_output()", "bare /input + frame"):
        assert re.search(r"^  %s +%s +%s$" % (re.escape(route), NUMBER, NUMBER), report, re.M)
    assert re.search(r"64 KiB paste: 1 requests, [0-9]+ ms", report)
    assert re.search(r"\] keystroke round trip / bare /input \+ frame: %sx" % NUMBER, report)


# Each section of benchmarks/run.py and what its report must hold; each runs
# alone, so that the sections share the test workers.
SECTIONS = {
    check.__name__: check
    for check in (throughput, memory, tail, latency, pacing, stdin, files, keys)
}


@pytest.mark.timeout(360)
@pytest.mark.parametrize("section", SECTIONS)
def test_the_tiny_benchmark_reports_every_row_of_a_section(section):
    done = run_tiny_benchmark(section)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = done.stdout
    assert "\n== %s" % section.capitalize() in report and "\n== Summary" in report
    SECTIONS[section](report)
    assert re.search(r"targets: [0-9]+ met, [0-9]+ missed", report)
    assert "FAILED" not in report


def test_every_section_of_the_benchmark_is_checked():
    assert tuple(SECTIONS) == run_module.SECTIONS


def mixed_shape():
    shape = stream_server.Shape("mixed", 100 * 1000, 100, 64 * 1024, mixed=True)
    data = stream_server.stream_data(shape)
    return shape, data, [json.loads(line) for line in stream_server.frame_lines(shape, data)]


def test_the_mixed_shape_interleaves_streams_and_splits_multi_byte_characters():
    shape, data, frames = mixed_shape()
    data_frames = [frame for frame in frames if frame["type"] == "data"]
    assert [frame["seq"] for frame in data_frames] == list(range(1, shape.frames + 1))
    assert sum(len(payload) for payload in data.values()) == shape.payload_bytes
    for name, payload in data.items():  # each stream's frames, in order, are its text
        mine = [f["data_base64"] for f in data_frames if f["stream"] == name]
        assert b"".join(base64.b64decode(text) for text in mine) == payload
    order = "".join("o" if frame["stream"] == "stdout" else "e" for frame in data_frames)
    for stream, (fewest, most) in zip("oe", stream_server.MIXED_RUNS):
        runs = {len(run.group()) for run in re.finditer(stream + "+", order)}
        assert runs <= set(range(fewest, most + 1)) and len(runs) >= min(most, 4)
    beats = [i for i, frame in enumerate(frames) if frame["type"] == "heartbeat"]
    every = stream_server.HEARTBEAT_EVERY
    assert [frames[i - 1]["seq"] for i in beats] == list(range(every, shape.frames + 1, every))
    widths = set()
    for frame in data_frames:  # the width of a character the frame's end cuts
        raw = base64.b64decode(frame["data_base64"])
        for back in range(1, 4):
            lead = raw[-back]
            if lead < 0x80 or lead >= 0xC0:  # not a continuation byte: a character starts
                width = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
                if width > back:
                    widths.add(width)
                break
    assert widths == {2, 3}  # the characters of the other shapes, cut at every width


def test_verify_tells_the_streams_apart():
    shape, data, _ = mixed_shape()
    expected = stream_server.expected_of(shape, data, 0)
    right = readers.Received(
        expected.stream_bytes, expected.chars, expected.tails, 0, expected.heartbeats
    )
    readers.verify("right", right, expected)
    swapped = {"stdout": expected.tails["stderr"], "stderr": expected.tails["stdout"]}
    with pytest.raises(readers.VerificationError, match="stdout differ"):
        readers.verify("swapped", right._replace(tails=swapped), expected)
    with pytest.raises(readers.VerificationError, match="heartbeats"):
        readers.verify("deaf", right._replace(heartbeats=0), expected)


def test_the_tiny_forward_benchmark_reports_both_figures_of_every_route_side_by_side():
    report = subprocess.run(
        [sys.executable, os.path.join("benchmarks", "forward.py"), "--scale", "0.001"],
        cwd=ROOT,
        env=UNMEASURED,
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard only
    )
    assert report.returncode == 0, report.stderr
    header = r"^ +straight +tunnel +forward +selector +forward/straight$"
    assert re.search(header, report.stdout, re.M)
    for label in ("download MiB/s", "round trip µs"):
        figures = r" +".join([label] + [NUMBER] * 4 + [NUMBER + "x"])
        assert re.search(r"^%s +\[(met|MISSED): [≥≤] [0-9.]+x\]$" % figures, report.stdout, re.M)
