"""Run commands from a process pool: results and errors come back intact.

    python examples/process_pool.py

Each worker process calls `cx.execute`, which builds its own `Client` from
$CREATEOS_API_URL and $CREATEOS_API_KEY (a Client holds a connection pool and
locks: it stays in the process that made it). What crosses the process
boundary is the `ExecResult` or the error, both of which pickle.

The local server (tests/local_server.py) runs the commands ON THIS MACHINE, in
a temporary directory, and listens on loopback only. It runs in threads of
this parent process; the workers only talk HTTP to it.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from local_server import LocalServer  # noqa: E402

import createos_exec as cx  # noqa: E402

SANDBOX = "sb_local"

COMMANDS = [
    ["echo", "hello from a worker"],
    ["sh", "-c", "echo $((6 * 7))"],
    ["sh", "-c", "echo to stderr >&2; exit 3"],
    ["sh", "-c", "kill -TERM $$"],
]


def run(command: List[str], check: bool = False) -> cx.ExecResult:
    """Runs in a worker process: one command, with a client built from the environment."""
    return cx.execute(SANDBOX, command, timeout=60, check=check)


def main() -> None:
    with LocalServer() as server:
        # Workers inherit the environment: that is how they find the API.
        os.environ["CREATEOS_API_URL"] = server.url
        os.environ["CREATEOS_API_KEY"] = server.api_key

        # "spawn": fresh interpreters, the same on every platform, and no fork()
        # of a parent whose server threads hold locks.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=3, mp_context=context) as pool:
            print(f"{len(COMMANDS)} commands in a pool of 3 worker processes:")
            for command, result in zip(COMMANDS, pool.map(run, COMMANDS, timeout=120)):
                print(
                    f"  {command!r}: exit_code={result.exit_code} signal={result.signal} "
                    f"returncode={result.returncode} stdout={result.stdout!r} "
                    f"stderr={result.stderr!r} process_id={result.process_id}"
                )

            print("A command that fails with check=True; the error is raised in the parent:")
            failing = ["sh", "-c", "echo about to fail; exit 4"]
            try:
                pool.submit(run, failing, True).result(timeout=120)
            except cx.CommandError as error:
                print(
                    f"  {type(error).__name__}: {error} returncode={error.returncode} "
                    f"stdout={error.result.stdout!r} process_id={error.process_id}"
                )
                print(
                    "  also a subprocess.CalledProcessError:",
                    isinstance(error, subprocess.CalledProcessError),
                )
            else:
                raise SystemExit("the failing command did not raise CommandError")


if __name__ == "__main__":
    main()
