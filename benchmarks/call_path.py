"""How a plain execute() runs down createos_exec.py.

One `execute(sb, ["echo", "hello"])` against the local server, traced: the
module's definitions it enters (functions, methods and classes' code, not
comprehensions), in the order each is first entered, with how often that
order steps back up the file and how often it jumps more than 1,000 lines.
A reader who follows the call reads the file in that order. From the
repository's root:

    python benchmarks/call_path.py            # the definitions, then the figures
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType
from typing import Any, Callable, List, Set, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

from local_server import LocalServer  # noqa: E402

import createos_exec as cx  # noqa: E402

MODULE = os.path.abspath(cx.__file__)
COMMAND = ["echo", "hello"]


def entered(run: Callable[[], Any]) -> List[Tuple[int, str]]:
    """(first line, name) of each definition of the module that `run` enters, once, in order."""
    order: List[Tuple[int, str]] = []
    seen: Set[Any] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" or code in seen or code.co_filename != MODULE:
            return
        seen.add(code)
        if not code.co_name.startswith("<"):  # comprehensions: inlined since Python 3.12
            order.append((code.co_firstlineno, getattr(code, "co_qualname", code.co_name)))

    threading.setprofile(profile)  # the cleanup and watcher threads too
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return order


def main() -> int:
    with LocalServer() as server:
        with cx.Client(server.url, server.api_key, rate_limit=None) as client:
            client.execute("sb_local", COMMAND)  # imports, the first connection
            order = entered(lambda: client.execute("sb_local", COMMAND))
    pairs = list(zip(order, order[1:]))
    back = sum(1 for (a, _), (b, _) in pairs if b < a)
    far = sum(1 for (a, _), (b, _) in pairs if abs(b - a) > 1000)
    for line, name in order:
        print(f"{line:6d}  {name}")
    print(
        f"definitions entered: {len(order)}; steps back up the file: {back}; "
        f"jumps over 1,000 lines: {far}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
