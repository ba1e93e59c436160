"""Pacing (docs/design.md rule 10; docs/threads-and-pools.md): one
window per origin, shared by the threads of a process and the processes of a
user, adding no delay below the limit, and narrowed after a 429 (the
narrowing the failure-table rows "429 on process creation" and "5xx/429 on
connect" speak of).

Unit tests of one process's window, the window file and its narrowing; then,
against the local server with its per-address limit turned on, a client that
asks for more than the server allows, and spawned processes behind one
address (tests/pacing.py: here at CI size, in benchmarks/run.py at full size).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import subprocess
import sys
import threading
import time
from typing import List

import pytest
from local_server import LocalServer
from pacing import run_scenario
from support import BASE, ROOT, SANDBOX, closed_port, make_client

import createos_exec as cx

ORIGIN = "https://pace.example.test"


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """A private $XDG_RUNTIME_DIR of the test's own, as a login session has one."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    return folder


def shared_limiter(limit, period, origin=ORIGIN):
    """A limiter on the shared window file, as for_origin builds it in each process.

    Two of them in one process stand for two processes: flock locks belong to
    an open file, and each limiter opens the file itself.
    """
    window = cx._window_file(origin, limit, period)
    assert window is not None
    return cx._RateLimiter(limit, period, window)


def window_path(limiter):
    return limiter._file.path


def files_in(runtime_dir):
    return list((runtime_dir / f"createos_exec-{os.getuid()}").iterdir())


def seconds_for(limiter, count, status=200):
    """Seconds that `count` places take, each released at once with `status`."""
    started = time.monotonic()
    for _ in range(count):
        limiter.release(limiter.acquire(1.0), status)
    return time.monotonic() - started


def churn(origin, count):
    """Windows that come and go beside others: each holds one place for a moment."""
    for n in range(count):
        limiter = shared_limiter(1, 0.001, f"{origin}/churn-{n}")
        limiter.release(limiter.acquire(1.0), 200)


# -- the window file ------------------------------------------------------------


def test_one_private_file_holds_a_window_per_origin_and_limit(runtime_dir):
    limiters = [
        shared_limiter(5, 1.0),
        shared_limiter(5, 1.0, "https://other.example.test"),
        shared_limiter(6, 1.0),
        shared_limiter(5, 2.0),
    ]
    for limiter in limiters:
        limiter.release(limiter.acquire(2.0), 200)
    folder = runtime_dir / f"createos_exec-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (path,) = folder.iterdir()
    assert {window_path(limiter) for limiter in limiters} == {str(path)}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    content = path.read_bytes()
    assert content.startswith(cx._WINDOW_MAGIC)
    # Four windows, each with one answered place: when it frees.
    assert len(content) == cx._FILE_HEAD.size + 4 * (cx._WINDOW_HEAD.size + 8)
    assert len({limiter._file._key for limiter in limiters}) == 4
    assert cx._window_file(ORIGIN, 5, 1.0)._key == limiters[0]._file._key


def test_a_window_leaves_the_file_once_it_holds_no_place(runtime_dir):
    for port in range(40000, 40050):  # a local server per test, each on a port of its own
        limiter = shared_limiter(5, 0.05, f"http://127.0.0.1:{port}")
        limiter.release(limiter.acquire(1.0), 200)
    time.sleep(0.1)  # every place freed
    limiter._update(lambda window, now: None)
    (path,) = files_in(runtime_dir)
    assert len(path.read_bytes()) == cx._FILE_HEAD.size  # the head alone


def test_a_narrowed_window_stays_until_it_could_have_won_its_limit_back(runtime_dir):
    period = 0.05
    limiter = shared_limiter(4, period)
    limiter.release(limiter.acquire(1.0), 429)
    time.sleep(2 * period)  # no place held, the narrowing kept
    assert limiter._update(lambda window, now: window.allowance) == 2
    time.sleep(cx._WIN_BACK * period)
    assert limiter._update(lambda window, now: window.allowance) == 4
    (path,) = files_in(runtime_dir)
    assert len(path.read_bytes()) == cx._FILE_HEAD.size


def test_a_local_server_per_test_leaves_one_file(runtime_dir):
    for _ in range(10):  # ten origins: ports of this process's own, never one twice
        with LocalServer(port=closed_port()) as server:
            with make_client(server, rate_limit=(300, 60.0)) as client:
                client.execute(SANDBOX, ["true"])
    (path,) = files_in(runtime_dir)
    reader = cx._SharedWindow(str(path), bytes(16), 1, 1.0)
    _, others = reader._read(path.read_bytes(), time.monotonic())
    assert len(others) == 10  # each in use for a period (a minute) after its last answer


def test_without_a_runtime_dir_the_file_is_in_the_temp_dir(runtime_dir, monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    window = cx._window_file(ORIGIN, 5, 1.0)
    assert os.path.dirname(window.path) == str(tmp_path / f"createos_exec-{os.getuid()}")


def test_without_a_usable_temp_dir_each_process_paces_alone(runtime_dir, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR")

    def no_temp_dir():
        raise FileNotFoundError("No usable temporary directory found")

    monkeypatch.setattr("tempfile.gettempdir", no_temp_dir)
    assert cx._window_file(ORIGIN, 5, 1.0) is None
    assert cx.Client(ORIGIN, "key", rate_limit=(5, 1.0))._transport._limiter is not None


def test_limiters_on_one_file_share_the_window(runtime_dir):
    first, second = shared_limiter(2, 0.6), shared_limiter(2, 0.6)
    started = time.monotonic()
    first.release(first.acquire(1.0), 200)
    second.release(second.acquire(1.0), 200)
    assert time.monotonic() - started < 0.4  # below the limit nothing waits
    second.release(second.acquire(1.0), 200)  # the third waits for the first place
    assert time.monotonic() - started >= 0.55


DIES_HOLDING = """\
import os, sys
sys.path.insert(0, sys.argv[1])
import createos_exec as cx
limiter = cx._RateLimiter(2, 0.5, cx._window_file(sys.argv[2], 2, 0.5))
print(limiter.acquire(1.0).let_through, flush=True)
limiter.acquire(1.0)
os._exit(0)  # gone while its requests were on their way: release() never comes
"""


def test_a_process_that_dies_holding_places_does_not_starve_the_others(runtime_dir):
    done = subprocess.run(
        [sys.executable, "-c", DIES_HOLDING, ROOT, ORIGIN],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    let_through = float(done.stdout)  # of its first place; the monotonic clock is the machine's
    limiter = shared_limiter(2, 0.5)
    place = limiter.acquire(1.0)
    # Held for its hold (1 s) and a period, then freed: no longer.
    assert let_through + 1.5 <= place.let_through < let_through + 6


RACER = """\
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
import createos_exec as cx
origin, start, seed = sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
limiter = cx._RateLimiter(3, 0.15, cx._window_file(origin, 3, 0.15))
time.sleep(max(0.0, start - time.monotonic()))
places = []
for n in range(12):
    place = limiter.acquire(5.0)
    time.sleep(rng.uniform(0.0, 0.03))
    places.append((place.let_through, time.monotonic()))
    limiter.release(place, 200)
    for m in range(3):  # windows that come and go beside it
        other = cx._RateLimiter(1, 0.001, cx._window_file(f"{origin}/{seed}-{n}-{m}", 1, 0.001))
        other.release(other.acquire(1.0), 200)
    time.sleep(rng.choice([0.0, rng.uniform(0.0, 0.4)]))  # at times the window empties
print(json.dumps(places))
"""


@pytest.mark.timeout(120)
def test_racing_processes_never_exceed_the_window_while_windows_come_and_go(runtime_dir):
    limit, period = 3, 0.15
    start = time.monotonic() + 2.5  # the clock is the machine's: all begin at once
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, ROOT, ORIGIN, repr(start), str(seed)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in range(4)
    ]
    places = [place for racer in racers for place in json.loads(racer.communicate(timeout=100)[0])]
    assert [racer.returncode for racer in racers] == [0] * 4
    # A place holds from when it was let through to a period after its answer
    # (a little later than the racer's stamp): count those held at each start.
    held = [sum(1 for t, answered in places if t <= then < answered + period) for then, _ in places]
    assert max(held) == limit  # the window was full at times, and never more
    (path,) = files_in(runtime_dir)
    time.sleep(period)
    shared_limiter(limit, period)._update(lambda window, now: None)
    assert len(path.read_bytes()) == cx._FILE_HEAD.size


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork()")
def test_a_forked_child_shares_the_window(runtime_dir):
    limiter = shared_limiter(5, 30.0)
    limiter.release(limiter.acquire(1.0), 200)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's coverage is not collected
        try:
            limiter.release(limiter.acquire(1.0), 200)
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    held = limiter._update(lambda window, now: window.held())
    assert held == 2  # the child's place is in the file too


KEY = b"k" * 16


def read_window(path, limit=4):
    """(places held, allowance) of the window of KEY in the file at `path`."""
    shared = cx._SharedWindow(path, KEY, limit, 1.0)
    return shared.update(lambda window, now: (window.held(), window.allowance))


def write_window(path, *, epoch_shift=0.0, allowance=4.0, frees=(), tail=b""):
    now = time.monotonic()
    head = cx._FILE_HEAD.pack(cx._WINDOW_MAGIC, time.time() - now + epoch_shift)
    until = now + max(frees, default=0.0)
    window = cx._WINDOW_HEAD.pack(KEY, until, 1.0, allowance, -math.inf, 0, len(frees))
    answered = b"".join(struct.pack("=d", now + seconds) for seconds in frees)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "wb") as handle:
        handle.write(head + window + answered + tail)


@pytest.mark.parametrize(
    "arrange",
    [
        dict(epoch_shift=60.0),  # another boot, or a clock stepped
        dict(allowance=5.0),  # more than the limit
        dict(allowance=math.nan),
        dict(tail=b"\x01\x02\x03"),  # not whole records
        dict(frees=(10.0, 2 * 86_400.0)),  # a place held for days: garbage
    ],
    ids=["epoch", "allowance over the limit", "allowance nan", "torn", "held for days"],
)
def test_a_window_file_that_is_not_sound_starts_afresh(tmp_path, arrange):
    path = str(tmp_path / "window")
    write_window(path, frees=(10.0, 20.0))
    assert read_window(path) == (2, 4.0)
    write_window(path, **{"frees": (10.0, 20.0), **arrange})
    assert read_window(path) == (0, 4.0)


def test_garbage_in_the_window_file_is_written_over(runtime_dir):
    limiter = shared_limiter(3, 5.0)
    limiter._update(lambda window, now: None)  # the file exists, 0600
    with open(window_path(limiter), "wb") as handle:
        handle.write(os.urandom(1000))
    assert seconds_for(limiter, 3) < 2.5  # garbage holds no place
    with open(window_path(limiter), "rb") as handle:
        assert handle.read().startswith(cx._WINDOW_MAGIC)


# -- where there is no shared window --------------------------------------------------


def test_without_fcntl_each_process_paces_alone(runtime_dir, monkeypatch):
    monkeypatch.setattr(cx, "fcntl", None)  # as on Windows
    assert cx._window_file(ORIGIN, 3, 1.0) is None
    limiter = cx._RateLimiter.for_origin("https://no-fcntl.example.test", 3, 0.3)
    assert limiter._file is None
    assert seconds_for(limiter, 4) >= 0.25  # still paced, per process


def test_a_window_file_others_can_read_is_not_used(runtime_dir):
    limiter = shared_limiter(2, 0.3)
    with open(window_path(limiter), "wb"):
        pass  # created 0644 under the usual umask
    os.chmod(window_path(limiter), 0o644)
    limiter.release(limiter.acquire(1.0), 200)
    assert limiter._file is None  # paced by this process alone


def test_a_folder_others_can_write_to_is_not_used(runtime_dir):
    folder = runtime_dir / f"createos_exec-{os.getuid()}"
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)
    assert cx._window_file(ORIGIN, 3, 1.0) is None
    folder.chmod(0o700)
    assert cx._window_file(ORIGIN, 3, 1.0) is not None


def test_a_window_file_that_fails_falls_back_to_this_process(runtime_dir):
    limiter = shared_limiter(2, 0.3)
    os.mkdir(window_path(limiter))  # cannot be opened as a file
    assert seconds_for(limiter, 3) >= 0.25  # paced all the same
    assert limiter._file is None


def test_for_origin_shares_the_file_and_none_disables_pacing(runtime_dir):
    limiter = cx._RateLimiter.for_origin("https://for-origin.example.test", 9, 1.0)
    assert limiter._file is not None
    assert os.path.dirname(window_path(limiter)).startswith(str(runtime_dir))
    client = cx.Client("https://for-origin.example.test", "key", rate_limit=None)
    assert client._transport._limiter is None


# -- one process's window -------------------------------------------------------------


def test_rate_limiter_waits_only_above_limit() -> None:
    limiter = cx._RateLimiter(3, 0.5)
    start = time.monotonic()
    for _ in range(3):
        limiter.release(limiter.acquire())
    assert time.monotonic() - start < 0.2  # no delay below the limit
    limiter.release(limiter.acquire())
    waited = time.monotonic() - start
    assert 0.4 <= waited < 1.5  # the 4th waited until the window freed


def test_rate_limiter_paces_requests_without_delay_below_the_limit(server, runtime_dir):
    with make_client(server, rate_limit=(4, 1.0)) as client:
        started = time.monotonic()
        client.execute(SANDBOX, ["true"])  # two requests: create + connect
        below = time.monotonic() - started
        client.execute(SANDBOX, ["true"])
        client.execute(SANDBOX, ["true"])  # requests 5 and 6 wait for the window
        paced = time.monotonic() - started
    assert below < 0.9
    assert paced >= 0.9
    stamps = sorted(r.time for r in server.requests)
    assert all(b - a >= 0.9 for a, b in zip(stamps, stamps[4:]))


def test_rate_limiter_threads_share_the_window() -> None:
    limiter = cx._RateLimiter(2, 0.3)
    stamps: List[float] = []
    lock = threading.Lock()
    start = time.monotonic()

    def worker() -> None:
        limiter.release(limiter.acquire())
        with lock:
            stamps.append(time.monotonic() - start)

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    stamps.sort()
    assert len(stamps) == 5
    assert stamps[1] < 0.2 and stamps[2] >= 0.25 and stamps[4] >= 0.55
    assert stamps[4] < 2.0


@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "through-the-file"])
def test_rate_limiter_holds_a_place_until_the_answer_starts(runtime_dir, shared):
    # A request still on its way may arrive late: its place in the window runs
    # from its answer, so the server never counts more than the limit.
    first = shared_limiter(1, 0.2) if shared else cx._RateLimiter(1, 0.2)
    second = shared_limiter(1, 0.2) if shared else first  # another process: a limiter of its own
    place = first.acquire(5.0)
    admitted = []
    waiter = threading.Thread(target=lambda: admitted.append(second.acquire(5.0)))
    waiter.start()
    if shared:
        churn(ORIGIN, 50)  # windows added and dropped beside it by a third limiter
    time.sleep(0.4)  # two periods: a place stamped when let through would have freed
    assert admitted == []
    first.release(place, 200)
    released = time.monotonic()
    waiter.join(3)
    assert admitted and admitted[0].let_through - released >= 0.15


def test_rate_limiter_shared_per_origin(runtime_dir) -> None:
    a = cx.Client(BASE + "/v1", "k1", rate_limit=(7, 1.0))
    b = cx.Client(BASE + "/other", "k2", rate_limit=(7, 1.0))
    c = cx.Client("https://elsewhere.example.test", "k1", rate_limit=(7, 1.0))
    assert a._transport._limiter is b._transport._limiter
    assert a._transport._limiter is not c._transport._limiter
    assert cx.Client(BASE, "k1", rate_limit=None)._transport._limiter is None


# -- narrowing after a 429 ---------------------------------------------------------


def test_a_429_halves_the_allowance_once_a_round_and_answers_win_it_back():
    limiter = cx._RateLimiter(8, 0.05)
    round_one = [limiter.acquire(1.0) for _ in range(4)]
    for place in round_one:  # all let through before the first 429: one narrowing
        limiter.release(place, 429)
    assert limiter._own.allowance == 4
    limiter.release(limiter.acquire(1.0), 429)
    assert limiter._own.allowance == 2
    for _ in range(5):
        limiter.release(limiter.acquire(1.0), 429)
    assert limiter._own.allowance == 1  # never below one
    limiter.release(limiter.acquire(1.0), None)  # a failure wins nothing back
    assert limiter._own.allowance == 1
    answers = 0
    while limiter._own.allowance < 8:
        limiter.release(limiter.acquire(1.0), 200)
        answers += 1
    assert limiter._own.allowance == 8
    # Each answer wins limit / (_WIN_BACK * allowance): from 1 to 8, about 63 answers.
    assert 55 <= answers <= 70


def test_a_narrowed_window_waits_for_places_to_free():
    limiter = cx._RateLimiter(4, 0.6)
    limiter.release(limiter.acquire(1.0), 429)  # allowance 2, one place held
    started = time.monotonic()
    limiter.release(limiter.acquire(1.0), 200)
    assert time.monotonic() - started < 0.4
    limiter.release(limiter.acquire(1.0), 200)  # the third waits: two fill the window now
    assert time.monotonic() - started >= 0.5


def test_the_narrowing_is_shared_through_the_file(runtime_dir):
    first, second = shared_limiter(8, 1.0), shared_limiter(8, 1.0)
    first.release(first.acquire(1.0), 429)  # allowance 4, one place held
    started = time.monotonic()
    assert seconds_for(second, 3, None) < 0.5
    second.release(second.acquire(1.0), None)  # the fifth: the window allows four
    assert time.monotonic() - started >= 0.8


# -- creation against the local server's own limit -------------------------------------


def test_a_refused_creation_narrows_the_window_and_succeeds(local_server, runtime_dir):
    server = local_server(rate_limit=(4, 1.0))
    with make_client(server, rate_limit=(8, 1.0)) as client:
        results = [client.execute(SANDBOX, ["echo", str(i)]) for i in range(4)]
        allowance = client._transport._limiter._update(lambda window, now: window.allowance)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]
    assert len(server.processes()) == 4
    refused = [r for r in server.requests if r.status == 429]
    assert refused  # the client's limit was twice the server's
    assert allowance < 8


# -- many processes behind one address (CI size; the benchmark runs them at full size) ---


def run_and_report(name, capsys, **scenario):
    figures = run_scenario(processes=4, commands=5, limit=(10, 1.0), **scenario)
    with capsys.disabled():
        print(
            f"\n{name}: {figures.exact}/{figures.commands} exact, {figures.created} processes "
            f"created ({figures.created_twice} twice), {figures.errors} errors, "
            f"{figures.refused} answered 429, at most {figures.max_in_window} requests in a "
            f"window (limit {figures.limit}), {figures.seconds:.2f} s = {figures.ratio:.2f}x "
            "the floor"
        )
    assert figures.errors == 0 and figures.exact == figures.commands == 20
    assert figures.created == 20 and figures.created_twice == 0
    return figures


@pytest.mark.timeout(120)
def test_spawned_processes_share_one_window(capsys):
    figures = run_and_report("4 processes, one shared window", capsys, shared=True)
    assert figures.refused == 0
    assert figures.max_in_window <= 10  # every arrival, as the server counts them


@pytest.mark.timeout(120)
def test_spawned_processes_with_windows_of_their_own_still_get_exact_results(capsys):
    # Four machines behind one address: no file can be shared; narrowing after 429s.
    run_and_report("4 processes, windows of their own", capsys, shared=False)
