"""Background processes: a web server used and left, a log followed as it
grows and taken up again by another client, and a REPL driven line by line.

    python examples/background.py

client.start() returns as soon as the process exists, like subprocess.Popen;
leaving the `with` block terminates the server's tree and confirms it. The
local server (tests/local_server.py) runs the commands ON THIS MACHINE, in a
temporary directory, and listens on loopback only.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from local_server import LocalServer  # noqa: E402

import createos_exec as cx  # noqa: E402

SANDBOX = "sb_local"

# Small programs the sandbox runs: ask the system for a free port, and fetch a URL.
FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())"
# A build that logs its steps, a tenth of a second apart.
BUILD = (
    "import time\nfor step in range(1, 6):\n    print('step', step, 'done')\n    time.sleep(0.1)"
)


def demo(client: cx.Client) -> None:
    # -- README.md: background processes --
    script = "mkdir -p site && echo 'hello from the sandbox' > site/index.html && cd site && pwd"
    site = client.execute(SANDBOX, script, shell=True, check=True).stdout.strip()
    port = client.execute(SANDBOX, ["python3", "-c", FREE_PORT], check=True).stdout.strip()

    server = ["python3", "-u", "-m", "http.server", port, "--bind", "127.0.0.1"]
    with client.start(SANDBOX, server, cwd=site) as web:
        print("server started:", web.process_id, "poll() ->", web.poll())  # None: it runs
        web.wait_for_port(int(port))  # a TCP connect inside the sandbox succeeded
        page = client.execute(
            SANDBOX, ["python3", "-c", FETCH, f"http://127.0.0.1:{port}/"], timeout=30, check=True
        )
        print("fetched:", page.stdout.strip())
    # Leaving the block terminated the server's tree (confirmed) and read
    # everything it printed until then.
    result = web.wait()
    print("server ended by", result.signal, "poll() ->", web.poll())  # SIGTERM, -15
    print("its log:", result.stderr.splitlines()[-1])
    # -- end --


def follow_a_log(client: cx.Client, later: cx.Client) -> None:
    # -- docs/background-processes.md: follow a log --
    build = client.start(SANDBOX, ["python3", "-u", "-c", BUILD])
    for stream, line in build.iter_output(lines=True):  # as it arrives
        print(f"{stream}: {line}", end="")
        if line.startswith("step 2"):
            break  # only stops reading: the build runs on
    # Another client (a restarted kernel, another script) takes it up by its id:
    # the journal replays its log from the start (or from seq `after=`).
    again = later.process(SANDBOX, build.process_id)
    last = [line for stream, line in again.iter_output(lines=True)][-1]
    print("taken up:", again.args == build.args, "| last:", last.strip(), "| rc", again.returncode)
    build.wait()  # the first handle sees the same end
    # -- end --


def drive_a_repl(client: cx.Client) -> None:
    # -- docs/background-processes.md: a REPL --
    with client.start(SANDBOX, ["python3", "-i", "-u", "-q"], stdin=cx.PIPE) as repl:
        answers = repl.iter_output(lines=True)
        repl.write("6 * 7\n")
        answer = next(text for stream, text in answers if stream == "stdout")
        print("6 * 7 ->", answer.strip())
        repl.write(f"{answer.strip()} + 1\n")  # the next line depends on the last answer
        print("... ->", next(text for stream, text in answers if stream == "stdout").strip())
        out, err = repl.communicate("print('bye')\n")  # write, close stdin, wait
    print("the REPL said", out.split()[-1], "and exited", repl.wait().exit_code)
    # -- end --


def main() -> None:
    with LocalServer() as local:
        with cx.Client(api_url=local.url, api_key=local.api_key) as client:
            demo(client)
            with cx.Client(api_url=local.url, api_key=local.api_key) as later:
                follow_a_log(client, later)
            drive_a_repl(client)


if __name__ == "__main__":
    main()
