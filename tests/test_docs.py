"""Every code block of README.md, docs/*.md and benchmarks/README.md runs
against the local server, or says why it does not.

A block is one of:

- run: a ```python block runs as a script of its own, a ```sh block in bash,
  in a fresh process whose CREATEOS_API_URL and CREATEOS_API_KEY point at one
  local server (the sandboxes `sb_123`, which the docs use, and `sb_local`
  exist there). `createos-exec` is the installed script when it is installed
  beside this Python, else `python -m createos_exec`, the same command line;
- shown: a ```python block that is a marked part of examples/background.py,
  which tests/test_example.py runs and holds the docs to;
- marked: output or a listing (```text, ```console), or a block just after
  an HTML comment `<!-- not run: why -->`.

Any other block fails the test: a new block is run, or marked with a reason.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from typing import List, NamedTuple, Optional

import pytest
from local_server import LocalServer
from support import ROOT, cli_env, shown_parts

SANDBOX = "sb_123"  # the sandbox id of the docs' examples
DOCUMENTS = ["README.md", "benchmarks/README.md"] + sorted(
    os.path.relpath(path, ROOT).replace(os.sep, "/")
    for path in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
OUTPUT = ("text", "console")
RUN = ("python", "sh")
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->")
FENCE = re.compile(r"\s*```")
TIMEOUT = 120


class Block(NamedTuple):
    document: str
    line: int  # of the opening fence, from 1
    section: str  # the heading above it
    info: str  # the fence's info string: python, sh, text, ...
    code: str
    not_run: Optional[str]  # the reason of a <!-- not run: ... --> just before it

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line} {self.section}"


def blocks_of(document: str) -> List[Block]:
    with open(os.path.join(ROOT, document), encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    found: List[Block] = []
    section = "top"
    previous = ""  # the last non-blank line outside a block
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        if line.startswith("```"):
            end = index + 1
            while not lines[end].startswith("```"):
                end += 1
            marker = NOT_RUN.fullmatch(previous.strip())
            found.append(
                Block(
                    document,
                    index + 1,
                    section,
                    line[3:].strip(),
                    "\n".join(lines[index + 1 : end]) + "\n",
                    marker.group(1) if marker else None,
                )
            )
            index, previous = end + 1, ""
            continue
        if line.strip():
            previous = line
        index += 1
    return found


BLOCKS = [block for document in DOCUMENTS for block in blocks_of(document)]


# The parts of examples/background.py that the docs show (see test_example.py).
SHOWN = [code + "\n" for _, _, code in shown_parts()]


def kind(block: Block) -> str:
    if block.not_run is not None or block.info in OUTPUT:
        return "marked"
    if block.info == "python" and block.code in SHOWN:
        return "shown"
    if block.info in RUN:
        return "run"
    return "unmarked"


RUNNABLE = [pytest.param(block, id=block.id) for block in BLOCKS if kind(block) == "run"]


def test_every_block_is_run_shown_or_marked():
    unmarked = [block.id for block in BLOCKS if kind(block) == "unmarked"]
    assert not unmarked, "run these blocks, or mark them <!-- not run: why -->: %s" % unmarked
    kinds = [kind(block) for block in BLOCKS]
    assert kinds.count("shown") == len(SHOWN), "every shown part of the example is in the docs"
    assert kinds.count("run") >= 10


def test_every_not_run_comment_stands_before_a_block_and_gives_a_reason():
    for document in DOCUMENTS:
        with open(os.path.join(ROOT, document), encoding="utf-8") as handle:
            lines = handle.read().split("\n")
        for number, line in enumerate(lines):
            if not line.lstrip().startswith("<!-- not run"):
                continue
            marker = NOT_RUN.fullmatch(line.strip())
            assert marker and marker.group(1).strip(), f"{document}:{number + 1}: no reason"
            following = next(later for later in lines[number + 1 :] if later.strip())
            assert following.startswith("```"), f"{document}:{number + 1}: no block after it"


def test_no_block_hides_in_an_indented_fence():
    """An indented fence would escape the extraction above (and render differently)."""
    for document in DOCUMENTS:
        with open(os.path.join(ROOT, document), encoding="utf-8") as handle:
            for number, line in enumerate(handle.read().split("\n")):
                if FENCE.match(line):
                    assert line.startswith("```"), f"{document}:{number + 1}"


@pytest.fixture(scope="module")
def docs_server():
    """One local server for every block of this module, with the docs' sandbox."""
    with LocalServer(heartbeat_interval=0.5) as local:
        local.add_sandbox(SANDBOX)
        yield local


def shell_prelude() -> str:
    """`python` is this Python; `createos-exec` its script, or the module's command line."""
    here = os.path.dirname(sys.executable)
    prelude = f'set -euo pipefail\nexport PATH="{here}:$PATH"\n'
    script = os.path.join(here, "createos-exec")
    if not os.path.exists(os.path.join(here, "python")):
        prelude += f'python() {{ "{sys.executable}" "$@"; }}\n'
    if not os.path.exists(script):
        prelude += f'createos-exec() {{ "{sys.executable}" -m createos_exec "$@"; }}\n'
    return prelude


@pytest.mark.parametrize("block", RUNNABLE)
def test_the_block_runs(block, docs_server, tmp_path):
    if block.info == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code, encoding="utf-8")
        argv = [sys.executable, str(script)]
    else:
        script = tmp_path / "block.sh"
        script.write_text(shell_prelude() + block.code, encoding="utf-8")
        argv = ["bash", str(script)]
    done = subprocess.run(
        argv,
        cwd=str(tmp_path),
        env=cli_env(docs_server),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=TIMEOUT,
    )
    shown = f"\n--- stdout\n{done.stdout.decode()}\n--- stderr\n{done.stderr.decode()}"
    assert done.returncode == 0, f"{block.id} exited {done.returncode}" + shown
    assert b"Traceback" not in done.stderr, shown


# --------------------------------------------------------------------------
# Links between the documents
# --------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors_of(path: str) -> List[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    with open(path, encoding="utf-8") as handle:
        text = re.sub(r"^```.*?^```", "", handle.read(), flags=re.M | re.S)
    anchors: List[str] = []
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = sum(1 for anchor in anchors if re.fullmatch(re.escape(slug) + r"(-\d+)?", anchor))
        anchors.append(f"{slug}-{count}" if count else slug)
    return anchors


@pytest.mark.parametrize("document", DOCUMENTS + ["RELIABILITY.md"])
def test_every_link_between_the_documents_leads_somewhere(document):
    source = os.path.join(ROOT, document)
    with open(source, encoding="utf-8") as handle:
        text = re.sub(r"^```.*?^```", "", handle.read(), flags=re.M | re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(source), path)) if path else source
        if not os.path.exists(resolved):
            broken.append(target)
        elif anchor and anchor not in anchors_of(resolved):
            broken.append(target)
    assert not broken, f"{document}: {broken}"
