"""Smoke test of benchmarks/run.py: at a tiny scale it runs every section and reports every row.

No timing is asserted anywhere: the benchmark measures and prints its targets
as met or MISSED; whether they are met is not a test result.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT

SHAPES = (
    "64 KiB frames, one HTTP chunk per frame",
    "100-byte frames, one HTTP chunk per frame",
    "100-byte frames in 64 KiB HTTP chunks",
)
READERS = (
    "server alone (drain, no parsing)",
    "per-line ceiling (raw socket)",
    "batched ceiling (raw socket)",
    "createos_exec Client.execute()",
    "official SDK processes.connect()",
)
HEADINGS = (
    "== Throughput",
    "Throughput targets",
    "== Memory",
    "== Tail",
    "== Latency",
    "== Summary",
)
NUMBER = r"[0-9]+(?:\.[0-9]+)?"


def run_tiny_benchmark():
    return subprocess.run(
        [sys.executable, os.path.join("benchmarks", "run.py"), "--scale", "0.001", "--repeat", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )


def rows_with_a_number(report, label):
    pattern = r"^\s+%s\s+(%s)\s+%s-%s$" % (re.escape(label), NUMBER, NUMBER, NUMBER)
    return re.findall(pattern, report, flags=re.MULTILINE)


def test_the_tiny_benchmark_reports_every_section_and_reader():
    done = run_tiny_benchmark()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = done.stdout
    for heading in HEADINGS:
        assert heading in report, heading
    for shape in SHAPES:
        assert shape in report, shape
    sdk_missing = "SDK n/a (not importable)" in report
    for reader in READERS:
        if reader.startswith("official SDK") and sdk_missing:
            assert report.count(reader + " ") == len(SHAPES)
            continue
        assert len(rows_with_a_number(report, reader)) == len(SHAPES), reader
    assert len(re.findall(r"^  ratios: execute/per-line %sx" % NUMBER, report, re.M)) == 3
    assert len(re.findall(r"of output: idle %s MiB, peak %s MiB" % (NUMBER, NUMBER), report)) == 2
    assert len(re.findall(r"characters: +%s ns/char" % NUMBER, report)) == 3
    assert re.search(r"naive .* %s ns/char" % NUMBER, report)
    assert re.search(r'one execute\("true"\) after a warm-up: [0-9]+ requests', report)
    assert re.search(r"rate limiter: default .* median %s ms, rate_limit=None" % NUMBER, report)
    assert re.search(r"resume after a connection reset .* median %s ms" % NUMBER, report)
    assert re.search(r"targets: [0-9]+ met, [0-9]+ missed", report)
    assert "FAILED" not in report
