"""Item 1 of the reliability campaign: a connection reset at every frame boundary.

One process prints exactly 2,000 frames: 7,000 bytes of multi-byte UTF-8 on
stdout and 7,000 on stderr, written in alternating blocks, against a server
that reads each pipe 7 bytes at a time (so characters straddle frames), and
exits 3. For every boundary k = 0 … 2,000 (before frame k + 1; k = 2,000 is
the exit frame) one run resets the connection there, and one run resets it in
the middle of the next frame's line. Every run must come back exact: stdout,
stderr, the interleaved output and the `on_output` text, exit code 3, and
exactly one reconnect, asking for `after=k`.

That is 4,002 runs through `Client.execute()` over real sockets in the full
campaign (`python -m nox -s campaign`). The suite runs the boundaries of
`bounded_boundaries()`, 2 x 53 runs: every class of boundary (the first and
last frame, the exit frame, each switch between the streams and the frames
either side of it) and every position of a frame's cut inside a character. One Python
process runs them at about one core (the server, the client and the pipe
readers share one GIL: ~65 ms a run, ~260 s in all), so the boundaries are
shared among a few worker processes, this file run as a script; each worker
runs threads, each with its own LocalServer (fault queues are per server) and
its own Client reused for all its runs. Workers report failures as JSON.

    CREATEOS_MATRIX_PROCESSES=N   # default: twice the CPUs, from 2 to 8
    CREATEOS_MATRIX_THREADS=1     # per process, the default (more only adds GIL contention)
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import traceback

import pytest
import requests
from local_server import LocalServer
from support import SANDBOX, Recorder, campaign_client, full_campaign

HERE = os.path.dirname(os.path.abspath(__file__))

FRAME_LIMIT = 7  # the server reads each pipe 7 bytes at a time
FRAMES = 2000
EXIT_CODE = 3
# 7,000 bytes each; 11-byte units against 7-byte frames: every split position occurs.
STDOUT_TEXT = "aé€😀\n" * 636 + "abcd"
STDERR_TEXT = "😀€üz\n" * 636 + "wxyz"
BLOCK = 3500  # bytes per write: a multiple of 7, so each write is exactly 500 frames
RUN_TIMEOUT = 60.0  # seconds for one run: a hang becomes a reported failure
SHOWN = 5  # failing boundaries quoted in an assertion message


def bounded_boundaries():
    """Boundaries that take every route of the full matrix once at least.

    Each block of 500 frames starts a run of 11 consecutive boundaries: 11
    frames of 7 bytes cut the 11-byte units of both texts at each of their
    11 offsets, and the block's first boundary is a switch of stream (or the
    first frame). The one before it ends the previous block; the last two are
    the last data frame and the exit frame.
    """
    starts = range(0, FRAMES, BLOCK // FRAME_LIMIT)
    chosen = {k for start in starts for k in range(start - 1, start + 12)}
    chosen |= {FRAMES - 1, FRAMES}
    return sorted(k for k in chosen if 0 <= k <= FRAMES)


def write_blocks(directory):
    """Write the four blocks (stdout, stderr, stdout, stderr) and return the script."""
    names = []
    for stream, text in (("out", STDOUT_TEXT), ("err", STDERR_TEXT)):
        data = text.encode("utf-8")
        assert len(data) == 2 * BLOCK
        for half in (0, 1):
            path = os.path.join(directory, "%s%d.bin" % (stream, half))
            with open(path, "wb") as block:
                block.write(data[half * BLOCK : (half + 1) * BLOCK])
            names.append(path)
    out0, out1, err0, err1 = (shlex.quote(name) for name in names)
    # cat writes each 3,500-byte block with one write(): the pipe readers never
    # see a partial block, so every read returns exactly 7 bytes.
    return "cat %s; cat %s >&2; cat %s; cat %s >&2; exit %d" % (
        out0,
        err0,
        out1,
        err1,
        EXIT_CODE,
    )


def matrix_server():
    return LocalServer(frame_limit=FRAME_LIMIT, journal_limit=1024 * 1024, heartbeat_interval=30.0)


def matrix_client(server):
    """The campaigns' client, allowing 10 s of silence on a stream: the
    matrix's server sends a heartbeat only every 30 s."""
    return campaign_client(server, stream_idle_timeout=10.0)


def first_difference(got, expected):
    """Where two texts part, for a short failure message."""
    for index, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return "differs at char %d (%r != %r)" % (index, a, b)
    return "length %d != %d" % (len(got), len(expected))


def check_run(server, boundary, script, mid_frame, client):
    """One run with a reset at `boundary`; the list of what was wrong (empty: exact)."""
    seen = Recorder()
    first_request = len(server.requests)
    server.drop_stream(after_frames=boundary, mid_frame=mid_frame)
    try:
        result = client.execute(SANDBOX, script, shell=True, timeout=RUN_TIMEOUT, on_output=seen)
    except Exception as exc:  # a failure of this run, reported with the others
        return ["raised %s: %s (cause %r)" % (type(exc).__name__, exc, exc.__cause__)]
    problems = []
    if (result.exit_code, result.signal, result.timed_out) != (EXIT_CODE, None, False):
        problems.append(
            "exit %r signal %r timed_out %r" % (result.exit_code, result.signal, result.timed_out)
        )
    for name, got, expected in (
        ("stdout", result.stdout, STDOUT_TEXT),
        ("stderr", result.stderr, STDERR_TEXT),
        ("on_output stdout", seen.text("stdout"), STDOUT_TEXT),
        ("on_output stderr", seen.text("stderr"), STDERR_TEXT),
    ):
        if got != expected:
            problems.append("%s %s" % (name, first_difference(got, expected)))
    combined = seen.output()
    if result.output != combined or len(combined) != len(STDOUT_TEXT) + len(STDERR_TEXT):
        problems.append("output is not the on_output text in order")
    if result.reconnects != 1 or result.exit_recovered or result.creation_recovered:
        problems.append(
            "reconnects %d exit_recovered %r creation_recovered %r"
            % (result.reconnects, result.exit_recovered, result.creation_recovered)
        )
    connects = [
        (r.query.get("after"), r.status)
        for r in server.requests[first_request:]
        if r.method == "GET" and r.path.endswith("/connect")
    ]
    if connects != [("0", 0), (str(boundary), 200)]:
        problems.append("connects (after, status) %r" % (connects,))
    newest = server.process(result.process_id)["output"]["newest_seq"]
    if newest != FRAMES:
        problems.append("the process wrote %d frames" % newest)
    server.evict(result.process_id)  # frees its journal: 4,000 of them would not fit
    return problems


def run_boundaries(boundaries, script, mid_frame, report):
    """One worker thread: its own server, one client for all its runs.

    After a failed run both are replaced, so that a fault it left queued
    cannot spill into the next boundary.
    """
    pending = list(boundaries)
    while pending:
        with matrix_server() as server, matrix_client(server) as client:
            while pending:
                boundary = pending.pop(0)
                try:
                    problems = check_run(server, boundary, script, mid_frame, client)
                except Exception:
                    problems = ["the check itself failed: " + traceback.format_exc(limit=3)]
                report(boundary, problems)
                if problems:
                    break


def worker_main(spec):
    """A worker process: THREADS threads over its share of the boundaries."""
    failures = []
    runs = [0]
    lock = threading.Lock()

    def report(boundary, problems):
        with lock:
            runs[0] += 1
            if problems:
                failures.append({"boundary": boundary, "problems": problems})

    threads = [
        threading.Thread(
            target=run_boundaries,
            args=(spec["boundaries"][index :: spec["threads"]], spec["script"], spec["mid_frame"]),
            kwargs={"report": report},
            daemon=True,
        )
        for index in range(spec["threads"])
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + spec["timeout"]
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(thread.is_alive() for thread in threads)
    return {"runs": runs[0], "failures": failures, "stuck": stuck}


def run_matrix(script, mid_frame, boundaries, processes, threads, timeout):
    """Share the boundaries among worker processes; (runs, failures, notes)."""
    workers = []
    runs, failures, notes = 0, [], []
    try:
        for index in range(processes):
            spec = {
                "boundaries": boundaries[index::processes],
                "script": script,
                "mid_frame": mid_frame,
                "threads": threads,
                "timeout": timeout,
            }
            workers.append(
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=HERE,
                )
            )
        deadline = time.monotonic() + timeout + 30
        for worker in workers:
            try:
                out, err = worker.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                out, err = worker.communicate()
                notes.append("a worker did not finish in time and was killed")
            lines = out.decode("utf-8", "replace").strip().splitlines()
            if worker.returncode != 0 or not lines:
                notes.append(
                    "worker exited %r: %s"
                    % (worker.returncode, err.decode("utf-8", "replace")[-2000:])
                )
                continue
            report = json.loads(lines[-1])
            if report["stuck"]:
                notes.append("%d worker threads were still running" % report["stuck"])
            runs += report["runs"]
            failures.extend(report["failures"])
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    return runs, sorted(failures, key=lambda failure: failure["boundary"]), notes


def test_the_process_writes_exactly_2000_frames_of_both_streams(tmp_path):
    """The premise of the matrix: 2,000 frames of 7 bytes, stdout and stderr interleaved."""
    script = write_blocks(str(tmp_path))
    with matrix_server() as server, matrix_client(server) as client:
        result = client.execute(SANDBOX, script, shell=True, timeout=RUN_TIMEOUT)
        assert (result.exit_code, result.stdout, result.stderr) == (
            EXIT_CODE,
            STDOUT_TEXT,
            STDERR_TEXT,
        )
        (record,) = server.processes()
        assert record["output"]["newest_seq"] == FRAMES
        response = requests.get(
            "%s/v1/sandboxes/%s/processes/%s/connect" % (server.url, SANDBOX, record["process_id"]),
            params={"after": 0},
            headers={"X-Api-Key": server.api_key},
            timeout=30,
        )
        frames = [json.loads(line) for line in response.content.splitlines()]
    data = [frame for frame in frames if frame["type"] == "data"]
    assert [frame["seq"] for frame in data] == list(range(1, FRAMES + 1))
    assert frames[-1] == {"type": "exit", "exit_code": EXIT_CODE}
    sizes = {len(base64.b64decode(frame["data_base64"])) for frame in data}
    assert sizes == {FRAME_LIMIT}
    streams = [frame["stream"] for frame in data]
    assert streams.count("stdout") == streams.count("stderr") == FRAMES // 2
    switches = sum(1 for a, b in zip(streams, streams[1:]) if a != b)
    assert switches >= 1
    print("\n2,000-frame process: %d switches between stdout and stderr" % switches)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "mid_frame", [False, True], ids=["reset-at-boundary", "reset-mid-next-frame"]
)
def test_a_reset_at_every_frame_boundary_comes_back_exact(tmp_path, figures, mid_frame):
    script = write_blocks(str(tmp_path))
    default = max(2, min(8, 2 * (os.cpu_count() or 1)))
    processes = int(os.environ.get("CREATEOS_MATRIX_PROCESSES", str(default)))
    threads = int(os.environ.get("CREATEOS_MATRIX_THREADS", "1"))
    # k = FRAMES: the reset comes before the exit frame.
    boundaries = list(range(FRAMES + 1)) if full_campaign() else bounded_boundaries()
    started = time.monotonic()
    runs, failures, notes = run_matrix(script, mid_frame, boundaries, processes, threads, 600.0)
    seconds = time.monotonic() - started
    variant = "mid-next-frame" if mid_frame else "at-boundary"
    print(
        "\nfault matrix, reset %s: %d runs, %d failing, %.1f s (%d processes x %d threads)"
        % (variant, runs, len(failures), seconds, processes, threads)
    )
    figures.record(
        "1. fault matrix",
        runs=runs,
        faults=runs,
        exact=runs - len(failures),
        seconds=round(seconds, 1),
    )
    assert not notes, notes
    assert not failures, "%d of %d boundaries failed, first: %s" % (
        len(failures),
        runs,
        json.dumps(failures[:SHOWN], ensure_ascii=False),
    )
    assert runs == len(boundaries)


def orphan_watch():
    """A worker ends itself when the test that started it is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    threading.Thread(target=orphan_watch, daemon=True).start()
    print(json.dumps(worker_main(json.loads(sys.argv[2]))))
