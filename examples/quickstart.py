"""Quick start: run commands through createos_exec against a local CreateOS server.

    python examples/quickstart.py

The local server (tests/local_server.py) runs the commands ON THIS MACHINE, in
a temporary directory, and listens on loopback only. One of the commands below
has its output connection cut on purpose to show the stream being resumed.
"""

from __future__ import annotations

import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from local_server import LocalServer  # noqa: E402

import createos_exec as cx  # noqa: E402

SANDBOX = "sb_local"


def live(stream: str, text: str) -> None:
    """Print output as it arrives; stderr lines are marked."""
    for line in text.splitlines(keepends=True):
        print(("  err| " if stream == "stderr" else "  out| ") + line, end="")
    sys.stdout.flush()


def show(title: str, result: cx.ExecResult) -> None:
    print(
        f"-> {title}: exit_code={result.exit_code} signal={result.signal} "
        f"timed_out={result.timed_out} reconnects={result.reconnects} "
        f"duration={result.duration:.2f}s\n",
        flush=True,
    )


def main() -> None:
    # Reconnects are logged at INFO: show them.
    logging.basicConfig(level=logging.INFO, format="  log| %(message)s", stream=sys.stdout)
    with LocalServer() as server:
        client = cx.Client(api_url=server.url, api_key=server.api_key)

        print("1. A program and its arguments (no shell involved):")
        result = cx.execute(
            SANDBOX, ["echo", "hello from", "a sandbox"], client=client, on_output=live
        )
        show("echo", result)

        print("2. A bash script, env and stdin (staged privately, never in the process list):")
        result = cx.execute(
            SANDBOX,
            'echo "GREETING=$GREETING"; tr a-z A-Z; echo oops >&2; exit 3',
            shell=True,
            env={"GREETING": "hi"},
            stdin="shout this\n",
            client=client,
            on_output=live,
        )
        show("script", result)

        print("3. The output connection is cut after 3 frames; the stream resumes:")
        server.drop_stream(after_frames=3)
        result = cx.execute(
            SANDBOX,
            "for i in 1 2 3 4 5 6; do echo line $i; sleep 0.1; done",
            shell=True,
            client=client,
            on_output=live,
        )
        show("resumed", result)

        print("4. A deadline: the remote tree is terminated, its output kept:")
        result = cx.execute(
            SANDBOX, "echo started; sleep 30", shell=True, timeout=1, client=client, on_output=live
        )
        show("timeout", result)
        client.close()


if __name__ == "__main__":
    main()
