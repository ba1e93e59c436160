"""Item 2 of the reliability campaign: seeded random fault schedules, all exact.

Each schedule i is drawn from `random.Random(base_seed + i)`: a process
(a burst on both streams, a slow writer whose pauses let heartbeats in
between frames, a silent one, a single stream; multi-byte text cut anywhere;
an exit code or a SIGKILL) and a list of faults queued on a fresh LocalServer
(resets, mid-frame cuts, clean EOFs, stalls past `stream_idle_timeout`,
5xx and 429 on connect, replays that ignore `after`, and restart-like bursts
of consecutive connect failures, longer than one backoff but within the
retry budget). Every schedule must end exact: stdout, stderr, the interleaved
output and the `on_output` text per stream, the exit status, one creation,
and `reconnects` equal to the number of connects minus one. Every other
schedule (odd seeds) is also read by a loop over `iter_output()`, which must
see exactly the pieces `on_output` sees.

    CREATEOS_CHAOS_RUNS=500        # schedules per run (default: 40, 500 in the full campaign)
    CREATEOS_CHAOS_SEED=20261130   # base seed; schedule i uses base + i
    CREATEOS_CHAOS_THREADS=8       # schedules run at once, each on its own server

A failure prints each failing schedule's seed, the schedule, and the command
that replays it alone.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import tempfile
import threading
import time
import traceback

import pytest
from local_server import LocalServer
from support import CAMPAIGN_RETRY, SANDBOX, Recorder, campaign_client, campaign_size

DEFAULT_SEED = 20261130
# The first 17 schedules from DEFAULT_SEED already take every route in ROUTES:
# 40 leaves room for a change of the drawing, which the test checks.
BOUNDED_RUNS = 40
IDLE_TIMEOUT = 0.3  # the client's stream_idle_timeout
STALL = 0.5  # seconds a stalled stream sends nothing: longer than IDLE_TIMEOUT
# Connect faults per schedule: fewer than CAMPAIGN_RETRY.max_attempts, even back to back.
MAX_FAILURES = CAMPAIGN_RETRY.max_attempts - 1
RUN_TIMEOUT = 60.0  # a hang becomes a reported failure, not a stuck suite
SHOWN = 3  # failing schedules quoted in full in the assertion message

ALPHABET = "abcxyz 019\n" + "éüß€中ñ😀🎉"
EXITS = (0, 0, 1, 2, 3, 42, 127, 255)
SIGKILL = "SIGKILL"
PAST_DATE = "Wed, 21 Oct 2015 07:28:00 GMT"  # a Retry-After in the past: retry at once


def settings():
    runs = campaign_size("CREATEOS_CHAOS_RUNS", BOUNDED_RUNS, 500)
    seed = int(os.environ.get("CREATEOS_CHAOS_SEED", str(DEFAULT_SEED)))
    threads = int(os.environ.get("CREATEOS_CHAOS_THREADS", "8"))
    return runs, seed, threads


# -- drawing a schedule ------------------------------------------------------------


def draw_text(rng, size):
    """`size` characters of mixed ASCII / multi-byte text, as UTF-8 bytes."""
    return "".join(rng.choice(ALPHABET) for _ in range(size)).encode("utf-8")


def cut(rng, data, pieces):
    """`data` cut at random byte offsets (often inside a character)."""
    if not data:
        return []
    offsets = sorted(set(rng.randint(1, len(data)) for _ in range(pieces - 1)) | {len(data)})
    parts, start = [], 0
    for end in offsets:
        if end > start:
            parts.append(data[start:end])
            start = end
    return parts


def draw_process(rng):
    """(shape, writes, ending): writes are (stream, bytes, sleep after) in order."""
    shape = rng.choice(["burst", "burst", "slow", "slow", "silent", "one-stream"])
    if shape == "silent":
        writes = []
        pause = rng.choice([0.0, 0.0, round(rng.uniform(0.05, 0.3), 3)])
    else:
        streams = ["stdout", "stderr"]
        if shape == "one-stream":
            streams = [rng.choice(streams)]
        many = shape == "slow"
        per_stream = {
            name: cut(
                rng,
                draw_text(rng, rng.randint(1, 250 if many else 1500)),
                rng.randint(2, 5) if many else rng.randint(1, 3),
            )
            for name in streams
        }
        writes = []
        while any(per_stream.values()):  # a random merge that keeps each stream's order
            name = rng.choice([n for n in streams if per_stream[n]])
            sleep = round(rng.uniform(0.0, 0.25), 3) if many and rng.random() < 0.7 else 0.0
            writes.append((name, per_stream[name].pop(0), sleep))
        pause = 0.0
    if writes and pause:
        writes[-1] = (writes[-1][0], writes[-1][1], pause)
    elif pause:
        writes.append(("stdout", b"", pause))
    ending = SIGKILL if rng.random() < 0.08 else rng.choice(EXITS)
    return shape, writes, ending


BREAKS = {  # a broken stream: the server's method and its options
    "reset": ("drop_stream", {}),
    "mid-frame": ("drop_stream", {"mid_frame": True}),
    "eof": ("end_stream", {}),
}


def draw_faults(rng):
    """A list of (method name, keyword arguments), queued in order."""
    faults = []
    failures = 0  # connect attempts that may fail, at most MAX_FAILURES
    stalled = False
    for _ in range(rng.randint(1, 5)):
        kind = rng.choices(
            ["reset", "mid-frame", "eof", "stall", "5xx", "429", "replay", "burst"],
            weights=[4, 4, 3, 1, 3, 2, 2, 2],
        )[0]
        after = rng.choice([0, 0, 1, 1, 2, 3, 5, 8, 13, 40, 100])
        if kind in BREAKS and failures < MAX_FAILURES:
            name, extra = BREAKS[kind]
            faults.append((name, {"after_frames": after, **extra}))
            failures += 1
        elif kind == "stall" and not stalled and failures < MAX_FAILURES:
            faults.append(("stall_stream", {"after_frames": after, "seconds": STALL}))
            stalled = True
            failures += 1
        elif kind == "5xx" and failures < MAX_FAILURES:
            count = min(rng.randint(1, 3), MAX_FAILURES - failures)
            status = rng.choice([500, 502, 503, 504])
            faults.append(("fail", {"endpoint": "connect", "status": status, "count": count}))
            failures += count
        elif kind == "429" and failures < MAX_FAILURES:
            retry_after = rng.choice([None, "0", PAST_DATE])
            faults.append(
                ("fail", {"endpoint": "connect", "status": 429, "retry_after": retry_after})
            )
            failures += 1
        elif kind == "replay":
            faults.append(("replay_ignoring_after", {"count": rng.randint(1, 2)}))
        elif kind == "burst" and MAX_FAILURES - failures >= 4:
            # A restart: consecutive connect failures at 0 frames, more than one
            # backoff long, fewer than max_attempts.
            for _ in range(rng.randint(4, min(8, MAX_FAILURES - failures))):
                if rng.random() < 0.3:
                    faults.append(("drop_stream", {"after_frames": 0}))
                else:
                    status = rng.choice([502, 503, 503])
                    faults.append(("fail", {"endpoint": "connect", "status": status}))
                failures += 1
    if not faults:
        faults.append(("drop_stream", {"after_frames": 0}))
    return faults


def draw_schedule(seed):
    rng = random.Random(seed)
    shape, writes, ending = draw_process(rng)
    return {
        "seed": seed,
        "shape": shape,
        "writes": writes,
        "ending": ending,
        "frame_limit": rng.choice([7, 7, 13, 64, 4096]),
        "heartbeat_interval": round(rng.uniform(0.05, 0.2), 3),
        "faults": draw_faults(rng),
    }


# Every kind of fault, process shape, ending and frame size a schedule can draw.
ROUTES = frozenset(
    ["reset", "reset-mid", "end_stream", "stall_stream", "5xx", "replay_ignoring_after"]
    + ["429:None", "429:0", "429:" + PAST_DATE]
    + ["shape:" + shape for shape in ("burst", "slow", "silent", "one-stream")]
    + ["ending:signal", "ending:zero", "ending:nonzero"]
    + ["frame_limit:%d" % size for size in (7, 13, 64, 4096)]
)


def routes_of(schedule):
    """The ROUTES that one schedule takes."""
    ending = schedule["ending"]
    taken = {
        "shape:" + schedule["shape"],
        "frame_limit:%d" % schedule["frame_limit"],
        "ending:" + ("signal" if ending == SIGKILL else "zero" if ending == 0 else "nonzero"),
    }
    for name, kwargs in schedule["faults"]:
        if name == "drop_stream":
            taken.add("reset-mid" if kwargs.get("mid_frame") else "reset")
        elif name == "fail":
            status = kwargs["status"]
            taken.add("429:%s" % kwargs.get("retry_after") if status == 429 else "5xx")
        else:
            taken.add(name)
    return taken


def describe(schedule):
    """The schedule as one JSON line (writes as stream, byte count, sleep)."""
    shown = dict(schedule)
    shown["writes"] = [[stream, len(data), sleep] for stream, data, sleep in schedule["writes"]]
    return json.dumps(shown, sort_keys=True)


def fault_uses(faults):
    return sum(kwargs.get("count", 1) for _, kwargs in faults)


# -- running one schedule ------------------------------------------------------------


def script_for(schedule, directory):
    """A bash script that writes each piece with one cat, sleeping where asked."""
    lines = []
    for index, (stream, data, sleep) in enumerate(schedule["writes"]):
        if data:
            path = os.path.join(directory, "piece%d" % index)
            with open(path, "wb") as piece:
                piece.write(data)
            lines.append("cat %s%s" % (shlex.quote(path), " >&2" if stream == "stderr" else ""))
        if sleep:
            lines.append("sleep %s" % sleep)
    ending = schedule["ending"]
    lines.append("kill -KILL $$" if ending == SIGKILL else "exit %d" % ending)
    return "\n".join(lines)


def expected_text(schedule, stream):
    return b"".join(data for name, data, _ in schedule["writes"] if name == stream).decode("utf-8")


def looped(schedule):
    """Every other schedule is read by a loop over iter_output() too."""
    return schedule["seed"] % 2 == 1


def run_schedule(schedule, directory):
    """Run one schedule on a fresh server; (problems, reconnects)."""
    script = script_for(schedule, directory)
    seen = Recorder()
    with LocalServer(
        frame_limit=schedule["frame_limit"],
        heartbeat_interval=schedule["heartbeat_interval"],
        journal_limit=1024 * 1024,
    ) as server:
        for method, kwargs in schedule["faults"]:
            kwargs = dict(kwargs)
            if method == "fail":
                server.fail(kwargs.pop("endpoint"), kwargs.pop("status"), **kwargs)
            else:
                getattr(server, method)(**kwargs)
        with campaign_client(server, stream_idle_timeout=IDLE_TIMEOUT) as client:
            iterated = None
            try:
                proc = client.start(
                    SANDBOX, script, shell=True, timeout=RUN_TIMEOUT, on_output=seen
                )
                if looped(schedule):  # the loop sees what on_output sees, and wait() then ends
                    iterated = list(proc.iter_output())
                result = proc.wait()
            except Exception as exc:
                return ["raised %s: %s" % (type(exc).__name__, exc)], 0
        creates = server.requests_to("create")
        connects = server.requests_to("connect")
    problems = []
    ending = schedule["ending"]
    status = (None, SIGKILL) if ending == SIGKILL else (ending, None)
    if (result.exit_code, result.signal, result.timed_out) != status + (False,):
        problems.append(
            "exit %r signal %r timed_out %r, expected %r"
            % (result.exit_code, result.signal, result.timed_out, status)
        )
    for stream in ("stdout", "stderr"):
        expected = expected_text(schedule, stream)
        if getattr(result, stream) != expected:
            problems.append("%s is not exact" % stream)
        if seen.text(stream) != expected:
            problems.append("on_output %s is not exact" % stream)
    if result.output != seen.output():
        problems.append("output is not the on_output text in order")
    if iterated is not None and iterated != seen.deliveries:
        problems.append("the iter_output() loop did not see what on_output saw")
    if result.reconnects != len(connects) - 1:
        problems.append(
            "reconnects %d, but %d connects were made" % (result.reconnects, len(connects))
        )
    if len(creates) != 1:
        problems.append("%d creations" % len(creates))
    afters = [int(request.query.get("after", -1)) for request in connects]
    if not afters or afters[0] != 0 or afters != sorted(afters):
        problems.append("connects asked for after=%r: a restart, not a resume" % afters)
    if {request.path for request in connects} != {
        "/v1/sandboxes/%s/processes/%s/connect" % (SANDBOX, result.process_id)
    }:
        problems.append("connects went to another process")
    return problems, result.reconnects


@pytest.mark.timeout(900)
def test_chaos_schedules_all_come_back_exact(tmp_path, figures):
    runs, base_seed, threads = settings()
    schedules = [draw_schedule(base_seed + index) for index in range(runs)]
    if base_seed == DEFAULT_SEED and runs >= BOUNDED_RUNS:  # not one asked for by hand
        taken = set().union(*map(routes_of, schedules))
        assert taken == ROUTES, "routes not taken: %s" % sorted(ROUTES - taken)
    pending = list(reversed(schedules))
    failures = []
    totals = {"runs": 0, "reconnects": 0}
    lock = threading.Lock()

    def worker(number):
        while True:
            with lock:
                if not pending:
                    return
                schedule = pending.pop()
            directory = tempfile.mkdtemp(prefix="chaos%d-" % number, dir=str(tmp_path))
            try:
                problems, reconnects = run_schedule(schedule, directory)
            except Exception:
                problems, reconnects = ["the check failed: " + traceback.format_exc(limit=4)], 0
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            with lock:
                totals["runs"] += 1
                totals["reconnects"] += reconnects
                if problems:
                    failures.append((schedule, problems))

    started = time.monotonic()
    workers = [
        threading.Thread(target=worker, args=(number,), daemon=True) for number in range(threads)
    ]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(max(1.0, started + 600 - time.monotonic()))
    seconds = time.monotonic() - started
    stuck = sum(thread.is_alive() for thread in workers)
    faults = sum(fault_uses(schedule["faults"]) for schedule in schedules)
    print(
        "\nchaos: %d schedules from seed %d, %d fault uses, %d reconnects, %d failing, "
        "%.1f s (%d threads)"
        % (totals["runs"], base_seed, faults, totals["reconnects"], len(failures), seconds, threads)
    )
    figures.record(
        "2. chaos",
        runs=totals["runs"],
        faults=faults,
        exact=totals["runs"] - len(failures),
        seconds=round(seconds, 1),
        seed=base_seed,
        reconnects=totals["reconnects"],
    )
    failures.sort(key=lambda failure: failure[0]["seed"])
    told = [
        "seed %d: %s\n  schedule: %s\n  replay: CREATEOS_CHAOS_SEED=%d CREATEOS_CHAOS_RUNS=1 "
        "python -m pytest tests/test_chaos.py"
        % (schedule["seed"], "; ".join(problems), describe(schedule), schedule["seed"])
        for schedule, problems in failures
    ]
    for failure in told:
        print("FAILED chaos " + failure)
    assert not stuck, "%d worker threads still running after 600 s" % stuck
    assert not failures, "%d of %d chaos schedules failed (seeds %s); first:\n%s" % (
        len(failures),
        runs,
        ", ".join(str(schedule["seed"]) for schedule, _ in failures),
        "\n".join(told[:SHOWN]),
    )
    assert totals["runs"] == runs
