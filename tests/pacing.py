"""Many clients behind one address, against a local server that enforces the limit.

The scenarios of tests/test_pacing.py (at CI size) and of the `pacing` section
of benchmarks/run.py (at full size):

- run_scenario(): `processes` freshly spawned interpreters, each with a Client
  paced at `limit`, run `commands` trivial commands one after another, all
  starting at once. shared=True: they share one $XDG_RUNTIME_DIR, so one
  window file, as processes of one user on one machine do; shared=False: each
  has a runtime dir of its own, standing in for machines behind one address.
- run_threads(): `threads` threads of this process share one Client.

The server (tests/local_server.py) answers 429 to the address over `limit`,
as the service does. Figures are what the server saw and what the callers got.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import functools
import multiprocessing
import os
import tempfile
import time
from collections import Counter
from typing import Any, List, NamedTuple, Optional, Tuple

from local_server import DEFAULT_SANDBOX, LocalServer

RESULT_TIMEOUT = 300.0  # seconds for a whole scenario


class Figures(NamedTuple):
    commands: int
    exact: int  # outputs exactly as expected
    errors: int  # exceptions that reached a caller
    created: int  # processes the server created
    created_twice: int  # commands with more than one process
    requests: int  # requests the server saw, refused ones included
    refused: int  # of them answered 429
    refused_creations: int
    max_in_window: int  # the most arrivals in any window of the period, 429s included
    limit: int
    period: float
    seconds: float  # from the common start to the last result

    @property
    def floor(self) -> float:
        """Two requests a command (create, connect) at the limit."""
        return 2 * self.commands * self.period / self.limit

    @property
    def ratio(self) -> float:
        return self.seconds / self.floor


def command(i: int) -> List[str]:
    return ["sh", "-c", 'echo "out-$1-$(($1 * 7))"; echo "err-$1" >&2', "sh", str(i)]


def expected(i: int) -> Tuple[str, str]:
    return f"out-{i}-{i * 7}\n", f"err-{i}\n"


Outcome = Tuple[int, Optional[Tuple[str, str]], str]


def run_commands(client: Any, numbers: Any, threads: int = 1) -> List[Outcome]:
    """Run the commands of `numbers` on `threads` threads sharing `client`."""
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(functools.partial(run_command, client), numbers))


def run_command(client: Any, i: int) -> Outcome:
    """(i, (stdout, stderr) or None, the error's repr or "")."""
    try:
        result = client.execute(DEFAULT_SANDBOX, command(i), timeout=RESULT_TIMEOUT)
    except Exception as exc:  # counted: no error may reach a caller
        return (i, None, repr(exc))
    return (i, (result.stdout, result.stderr), "")


class Work(NamedTuple):
    """What a spawned process is to do."""

    url: str
    key: str
    limit: Tuple[int, float]
    commands: int
    threads: int
    narrowing: bool


def _worker(index: int, work: Work, runtime: str, start: Any, results: Any) -> None:
    """One spawned process: its own Client, its share of the commands."""
    os.environ["XDG_RUNTIME_DIR"] = runtime  # read when the client's limiter is made
    import createos_exec as cx

    if not work.narrowing:  # for comparison only: what 429s cost a window that never narrows
        cx._RateLimiter._settle = _settle_without_narrowing
    with cx.Client(work.url, work.key, rate_limit=work.limit) as client:
        start.wait()
        numbers = range(index * work.commands, (index + 1) * work.commands)
        results.put((run_commands(client, numbers, work.threads), time.monotonic()))


def _settle_without_narrowing(
    limiter: Any, place: Any, status: Any, window: Any, now: float
) -> None:
    window.answer(place.token, now + limiter._period)


def run_scenario(
    *,
    processes: int,
    commands: int,
    limit: Tuple[int, float],
    shared: bool,
    threads: int = 1,
    narrowing: bool = True,
) -> Figures:
    """`commands` per process, each process running them on `threads` threads."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(processes + 1)
    results = context.Queue()
    with tempfile.TemporaryDirectory() as runtime, server_limited_to(limit) as server:
        work = Work(server.url, server.api_key, limit, commands, threads, narrowing)
        folders = [
            os.path.join(runtime, "shared" if shared else f"own-{n}") for n in range(processes)
        ]
        for folder in set(folders):
            os.mkdir(folder, 0o700)
        workers = [
            context.Process(target=_worker, args=(n, work, folders[n], start, results))
            for n in range(processes)
        ]
        for worker in workers:
            worker.start()
        start.wait(timeout=120)  # every worker has imported the module and built its client
        started, first_request = time.monotonic(), len(server.requests)
        gathered = [results.get(timeout=RESULT_TIMEOUT) for _ in workers]
        for worker in workers:
            worker.join(30)
        outcomes = [outcome for part, _ in gathered for outcome in part]
        finished = max(done for _, done in gathered)
        return figures_of(server, first_request, outcomes, finished - started, limit)


def run_threads(*, threads: int, commands: int, limit: Tuple[int, float]) -> Figures:
    """`threads` threads of this process share one Client for `commands` commands."""
    import createos_exec as cx

    with server_limited_to(limit) as server, cx.Client(
        server.url, server.api_key, rate_limit=limit
    ) as client:
        first_request = len(server.requests)
        started = time.monotonic()
        outcomes = run_commands(client, range(commands), threads)
        seconds = time.monotonic() - started
        return figures_of(server, first_request, outcomes, seconds, limit)


def server_limited_to(limit: Tuple[int, float]) -> LocalServer:
    return LocalServer(heartbeat_interval=0.5, rate_limit=limit)


def figures_of(
    server: LocalServer,
    first_request: int,
    outcomes: List[Any],
    seconds: float,
    limit: Tuple[int, float],
) -> Figures:
    records = server.requests[first_request:]
    per_command = Counter(record["args"][-1] for record in server.processes())
    return Figures(
        commands=len(outcomes),
        exact=sum(1 for i, out, _ in outcomes if out == expected(i)),
        errors=sum(1 for _, _, error in outcomes if error),
        created=sum(per_command.values()),
        created_twice=sum(1 for count in per_command.values() if count > 1),
        requests=len(records),
        refused=sum(1 for record in records if record.status == 429),
        refused_creations=sum(
            1
            for r in records
            if r.status == 429 and r.method == "POST" and r.path.endswith("/processes")
        ),
        max_in_window=max_in_window(sorted(record.time for record in records), limit[1]),
        limit=limit[0],
        period=limit[1],
        seconds=seconds,
    )


def max_in_window(times: List[float], length: float) -> int:
    """The largest number of the sorted `times` inside any half-open window of `length`."""
    best = 0
    for i, start in enumerate(times):
        best = max(best, bisect.bisect_left(times, start + length, lo=i) - i)
    return best
