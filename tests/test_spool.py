"""Output outlives the journal (docs/design.md item 19): what the journal evicted
before it was read comes back from the spool in the sandbox, byte-exact, and
the rest of the output with it; a spool gone or full is the eviction, saying
what was lost; the spool is removed once nothing more needs it. The eviction
of output no spool gives back is test_frames.py's; the spool's scripts alone
are test_scripts.py's.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import random
import re
import subprocess
import time
from typing import Any, Dict, List, Tuple

import pytest
import responses
from local_server import READINGS, LocalServer
from support import (
    EXEC,
    PROC,
    SANDBOX,
    SB,
    WAIT,
    add_connect,
    add_created,
    add_deleted,
    assert_deleted_once,
    body_of,
    calls,
    campaign_size,
    cli_argv,
    cli_env,
    data,
    exited,
    make_client,
    nd,
    ok,
    ran,
    spool_files,
    spooled,
    until,
)

import createos_exec as cx

EVICTED = {"type": "error", "error": "output_offset_expired", "oldest_available_seq": 9}

# -- canned: the spool read in pieces, and what fails closed ---------------------------


def run_evicted(rsps: responses.RequestsMock, first: bytes, *readings: Any) -> cx.ExecResult:
    """execute() whose stream gives `first`, then the eviction; the spool gives `readings`."""
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", first), EVICTED))
    for reading in readings:
        rsps.add(responses.POST, EXEC, json=reading)
    rsps.add(responses.GET, WAIT, json=ok(exited(9, exit_code=4)))
    add_deleted(rsps)
    got: List[Tuple[str, str]] = []
    result = make_client().execute(SB, ["true"], on_output=lambda *piece: got.append(piece))
    for name in ("stdout", "stderr"):  # handed out as the result holds it
        assert "".join(text for stream, text in got if stream == name) == getattr(result, name)
    return result


def test_evicted_output_comes_back_from_the_spool_each_stream_from_where_it_stood(rsps):
    result = run_evicted(
        rsps,
        b"a",
        spooled(b"bc", b"E", held=(1, 0), ended=False),
        spooled(b"", b"", held=(3, 1), ended=False),  # nothing new: read again later
        spooled(b"d\xe2\x82", b"", held=(3, 1), ended=False),
        spooled(b"\xac", b"", held=(6, 1)),
    )
    assert (result.stdout, result.stderr, result.exit_code) == ("abcd€", "E", 4)
    assert result.exit_recovered and not result.output_evicted
    readings, removal = (lambda c: (c[:-1], c[-1]))(calls(rsps, "POST", EXEC))
    # The bytes of each stream held, given to each reading; then the spool removed.
    assert [body_of(c)["args"][-3:-1] for c in readings] == [
        ["1", "0"], ["3", "1"], ["3", "1"], ["6", "1"]
    ]  # fmt: skip
    removed = body_of(removal)
    assert removed["cmd"] == "rm" and [p.split(".", 2)[-1] for p in removed["args"][2:]] == [
        "stdout", "stderr", "stdout.end", "stderr.end"
    ]  # fmt: skip
    assert not calls(rsps, "DELETE", PROC)


@pytest.mark.parametrize(
    "reading",
    [
        spooled(b"", b"", held=(0, 0)),  # holds less than the stream read already
        ran("3 1\n!!!!\n0 1\n\n"),  # no base64
        ran("9 1\nYg==\n0 1\n\n"),  # says 8 bytes more, gives 1
        ran("a spool"),
    ],
    ids=["shorter", "not base64", "short piece", "not its form"],
)
def test_a_reading_of_the_spool_that_does_not_fit_fails_closed(rsps, reading):
    with pytest.raises(cx.ProtocolError) as caught:
        run_evicted(rsps, b"a", reading)
    assert type(caught.value) is cx.ProtocolError and caught.value.result.stdout == "a"
    assert_deleted_once(rsps)


def test_a_full_spool_loses_what_came_past_it_and_says_so(rsps, monkeypatch):
    monkeypatch.setattr(cx, "_SPOOL_LIMIT", 4)
    with pytest.raises(cx.OutputEvictedError) as caught:
        run_evicted(rsps, b"abcd", spooled(held=(4, 0), ended=False))
    assert caught.value.spool == "full" and caught.value.oldest_available_seq == 9
    assert "keeps the first 4 bytes of each stream" in str(caught.value)
    assert_deleted_once(rsps)


# -- against the local server ------------------------------------------------------------

LINES = 2 * 2**20 // 100  # 2 MiB of numbered lines: the 1 MiB journal keeps the last half
EXPECTED = "".join("%099d\n" % i for i in range(LINES))
FLOOD = ["python3", "-c", f"import sys\nfor i in range({LINES}): sys.stdout.write('%099d\\n' % i)"]


def gone(files: List[str]) -> bool:
    return not any(os.path.exists(path) for path in files)


def ended(server: Any, process_id: str) -> str:
    """`process_id` once its tree is gone: its journal then keeps the last 1 MiB only."""
    assert server.wait_tree_gone(process_id)
    return process_id


@pytest.mark.both_readings
@pytest.mark.parametrize("route", ["on_output", "iter_output, bytes"])
def test_a_consumer_that_falls_behind_gets_every_byte_once(client, server, route):
    # The stream breaks after its first frame, and the consumer takes its time
    # with that one: by the time it asks for more, the journal has evicted it.
    server.drop_stream(after_frames=1)
    got: List[str] = []

    def slow(stream: str, text: str) -> None:
        if not got:
            (record,) = server.processes()
            ended(server, record["process_id"])
        got.append(text)

    if route == "on_output":
        result = client.execute(SANDBOX, FLOOD, on_output=slow)
    else:
        proc = client.start(SANDBOX, FLOOD, text=False)
        for stream, piece in proc.iter_output():
            slow(stream, piece.decode())
        result = proc.wait()
    assert "".join(got) == EXPECTED and result.exit_code == 0
    assert result.exit_recovered and not result.output_evicted  # the spool was read
    assert (result.stdout if route == "on_output" else result.stdout.decode()) == EXPECTED
    until(lambda: gone(spool_files(server, result.process_id)), what="the spool's removal")


@pytest.mark.parametrize("route", ["process()", "--attach"])
def test_a_process_taken_up_after_the_journal_moved_on_is_read_whole(client, server, route):
    process_id = ended(server, client.start(SANDBOX, FLOOD).process_id)
    if route == "process()":
        taken = client.process(SANDBOX, process_id)
        result = taken.wait()
        got, code = result.stdout.encode(), result.exit_code
    else:
        done = subprocess.run(
            cli_argv("--attach", process_id, SANDBOX), env=cli_env(server), capture_output=True
        )
        got, code = done.stdout, done.returncode
    assert code == 0 and hashlib.sha256(got).digest() == hashlib.sha256(EXPECTED.encode()).digest()
    assert gone(spool_files(server, process_id))


@pytest.mark.parametrize(
    "run",
    [
        {"command": ["echo", "hi"]},  # the spoolers drop a spool the journal keeps whole
        {"command": ["head", "-c", "600000", "/dev/zero"]},  # the client drops a bigger one
        {"command": ["sleep", "30"], "timeout": 0.5},  # and what a killed tree left
    ],
    ids=["small", "big", "terminated"],
)
def test_the_spool_is_removed_once_nothing_needs_it(client, server, run):
    result = client.execute(SANDBOX, run.pop("command"), **run)
    files = spool_files(server, result.process_id)
    until(lambda: gone(files), what="the spool's removal")
    removals = [r for r in server.requests_to("exec")]
    assert len(removals) == (0 if result.stdout == "hi\n" else 1)


# -- the campaign: evictions at random points (RELIABILITY.md item 18) -------------------
#
# Each run prints 0.6 to 2 MiB of numbered lines on both streams, in bursts; the
# consumer falls behind at random; the journal holds 64 KiB to 1 MiB, drops
# everything at a random point, and the stream breaks, and (where a resumed
# sandbox keeps its processes) the sandbox is paused and resumed with
# resume=True at random points. Each stream must arrive whole, once, in order.
#
#   CREATEOS_SPOOL_RUNS=240       # runs (default: 12; 240 in the full campaign)
#   CREATEOS_SPOOL_SEED=20261207  # base seed; run i uses base + i

BURSTS = (
    "import sys, time\n"
    "for burst in range(%d):\n"
    "    for i in range(%d):\n"
    "        (sys.stderr if i %% 7 == 0 else sys.stdout).write('%%d %%090d\\n' %% (burst, i))\n"
    "    time.sleep(0.01)\n"
)


def bursts_expected(bursts: int, lines: int) -> Tuple[str, str]:
    out, err = [], []
    for burst in range(bursts):
        for i in range(lines):
            (err if i % 7 == 0 else out).append("%d %090d\n" % (burst, i))
    return "".join(out), "".join(err)


class SpoolLog(logging.Handler):
    """The bytes each process's output had read back from its spool (the client's log)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: Dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(
            r"Read (\d+) bytes of the output of (\S+) from its spool", record.getMessage()
        )
        if found:
            self.read[found.group(2)] = int(found.group(1))


def one_eviction_run(rng: random.Random, reading: Any) -> Dict[str, int]:
    bursts, lines = rng.randint(8, 20), rng.randint(700, 1100)
    expected = bursts_expected(bursts, lines)
    journal = rng.choice([64 * 1024, 256 * 1024, 1024 * 1024])
    with LocalServer(
        heartbeat_interval=0.5, reading=reading, journal_limit=journal, resume_seconds=0.1
    ) as server:
        got: Dict[str, List[str]] = {"stdout": [], "stderr": []}
        evict_at, pause_at = rng.randint(1, 30), rng.randint(1, 60)
        pauses = reading.resume_keeps_processes and rng.random() < 0.5

        def consume(stream: str, text: str) -> None:
            got[stream].append(text)
            taken = len(got["stdout"]) + len(got["stderr"])
            if taken == evict_at:
                (record,) = server.processes()
                server.evict(record["process_id"])
            if pauses and taken == pause_at:
                server.pause()
            if rng.random() < 0.1:
                time.sleep(rng.uniform(0.0, 0.1))

        server.drop_stream(after_frames=rng.randint(0, 40))
        with make_client(server, cleanup_timeout=10.0) as client:
            command = ["python3", "-c", BURSTS % (bursts, lines)]
            result = client.execute(SANDBOX, command, on_output=consume, resume=True)
        assert ("".join(got["stdout"]), "".join(got["stderr"])) == expected
        assert result.exit_code == 0 and (result.stdout, result.stderr) == expected
        return {
            "produced": sum(map(len, expected)),
            "evicted": server.evicted_bytes(result.process_id),
            "spooled": SPOOL_LOG.read.get(result.process_id, 0),
            "reconnects": result.reconnects,
            "paused": len(server.requests_to("sandbox_resume")),
        }


SPOOL_LOG = SpoolLog()


def test_output_past_the_journal_at_random_points_arrives_whole(figures):
    runs = campaign_size("CREATEOS_SPOOL_RUNS", 12, 240)
    seed = int(os.environ.get("CREATEOS_SPOOL_SEED", "20261207"))
    totals = dict.fromkeys(("produced", "evicted", "spooled", "reconnects", "paused"), 0)
    failures: List[str] = []
    logger = logging.getLogger("createos_exec")
    logger.addHandler(SPOOL_LOG)
    level = logger.level
    logger.setLevel(logging.INFO)  # not .level =: the logger caches what it lets through

    def one(i: int) -> None:
        reading = READINGS[i % 2]
        try:
            for name, value in one_eviction_run(random.Random(seed + i), reading).items():
                totals[name] += value
        except BaseException as exc:  # reported with its seed below
            failures.append("run %d (seed %d, %s): %r" % (i, seed + i, reading.name, exc))

    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(runs)))
    finally:
        logger.removeHandler(SPOOL_LOG)
        logger.setLevel(level)
    assert not failures, "\n".join(failures[:5])
    assert totals["evicted"] > 0 and totals["spooled"] > 0  # the spool was needed, and read
    figures.record("18. output past the journal", runs=runs, seed=seed, lost=0, **totals)
