"""Background processes: start a web server in the sandbox, use it, leave it.

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


def demo(client: cx.Client) -> None:
    # -- README: background processes --
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


def main() -> None:
    with LocalServer() as local:
        with cx.Client(api_url=local.url, api_key=local.api_key) as client:
            demo(client)


if __name__ == "__main__":
    main()
