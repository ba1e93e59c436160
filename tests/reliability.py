"""Rerun the reliability campaign and print its figures (the table in RELIABILITY.md).

    python tests/reliability.py                            # the full campaign's counts
    CREATEOS_CHAOS_RUNS=5000 python tests/reliability.py   # more chaos schedules
    CREATEOS_DEADLINE_RUNS=200 python tests/reliability.py # more clients killed at random

Every figure comes from the tests themselves, through the `figures` fixture
of conftest.py: each test appends what it ran and what it checked.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAMPAIGN = [
    "tests/test_fault_matrix.py",
    "tests/test_chaos.py",
    "tests/test_frames.py",
    "tests/test_containment.py",
    "tests/test_secrets.py",
    "tests/test_hostile_input.py",
    "tests/test_load.py",
    "tests/test_reader_fuzz.py",
    "tests/test_deadline.py",
    "tests/test_stdin.py",
    "tests/test_cancel.py",
    "tests/test_files.py",
    "tests/test_cli_pty.py",
    "tests/test_sandbox.py",
    "tests/test_spool.py",
]
KEPT_LAST = ("seed", "limit", "threads", "median_latency_ms")  # settings and medians, not counts


def merge(rows):
    """One entry per item: counts summed, maxima kept, settings as last seen."""
    items = collections.OrderedDict()
    for row in rows:
        merged = items.setdefault(row.pop("item"), {})
        for key, value in row.items():
            if key.startswith("max_"):
                merged[key] = max(merged.get(key, value), value)
            elif key in KEPT_LAST or not isinstance(value, (int, float)):
                merged[key] = value
            else:
                merged[key] = merged.get(key, 0) + value
    return items


def table(items):
    lines = ["| item | figures |", "|---|---|"]
    for item in sorted(items, key=lambda name: int(name.split(".")[0])):
        figures = ", ".join(
            f"{key} {round(value, 1) if isinstance(value, float) else value}"
            for key, value in items[item].items()
        )
        lines.append(f"| {item} | {figures} |")
    return "\n".join(lines)


def main():
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "figures.jsonl")
        env = dict(os.environ, CREATEOS_RELIABILITY_REPORT=report)
        env.setdefault("CREATEOS_CAMPAIGN", "full")  # the table's counts, not the suite's
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CAMPAIGN]
        status = subprocess.call(command, cwd=ROOT, env=env)
        rows = []
        if os.path.exists(report):
            with open(report, encoding="utf-8") as lines:
                rows = [json.loads(line) for line in lines]
    print()
    print(table(merge(rows)))
    return status


if __name__ == "__main__":
    sys.exit(main())
