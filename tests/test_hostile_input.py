"""Hostile strings reach the command exactly, through the local server's real bash."""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from local_server import LocalServer
from support import SANDBOX, make_client

CANARY = os.path.join(tempfile.gettempdir(), "createos_exec-canary")
FRAGMENTS = [
    "'", '"', "\\", "$(touch " + CANARY + ")", "`touch " + CANARY + "`", "${HOME}", "$0",
    "\n", "\r", "\t", "*", "?", "[a]", "~", "-", "--", "-rf", ";", "&&", "|", ">", "<",
    "!", "#", " ", "é", "\u2028", "\U0001f600", "%s",
]  # fmt: skip
# Any text without NUL (refused up front) or lone surrogates (not encodable).
TEXT = st.lists(
    st.sampled_from(FRAGMENTS)
    | st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")),
    max_size=6,
).map("".join)
NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True).filter(
    lambda name: name not in ("PWD", "OLDPWD", "SHLVL", "_")  # bash sets these itself
)

REPORT = (
    "import json, os, sys\n"
    "print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(),"
    " 'env': {k: os.environ.get(k) for k in json.loads(sys.argv[1])},"
    " 'stdin': sys.stdin.buffer.read().decode()}))\n"
)


@pytest.fixture(scope="module")
def local():
    with LocalServer(heartbeat_interval=0.5) as server, make_client(server) as client:
        yield server, client


@settings(max_examples=40, deadline=None)
@given(
    argv=st.lists(TEXT, max_size=4),
    dirname=TEXT.filter(lambda s: s not in ("", ".", "..") and "/" not in s and len(s) < 60),
    env=st.dictionaries(NAME, TEXT, max_size=3),
    stdin=TEXT,
)
def test_hostile_strings_round_trip_exactly(
    local, tmp_path_factory, figures, argv, dirname, env, stdin
):
    server, client = local
    cwd = os.path.join(str(tmp_path_factory.mktemp("cwd")), dirname)
    os.mkdir(cwd)
    names = json.dumps(sorted(env))
    result = client.execute(
        SANDBOX,
        [sys.executable, "-c", REPORT, names, *argv],
        cwd=cwd,
        env=env,
        stdin=stdin,
    )
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"argv": [names, *argv], "cwd": cwd, "env": env, "stdin": stdin}
    assert not os.path.exists(CANARY)
    figures.record("6. hostile input", runs=1, exact=1, strings=len(argv) + len(env) + 2)


@settings(max_examples=20, deadline=None)
@given(script=TEXT)
def test_a_shell_script_is_passed_to_bash_unchanged(local, figures, script):
    server, client = local
    result = client.execute(SANDBOX, "printf %s " + shlex.quote(script), shell=True)
    assert result.exit_code == 0
    assert result.stdout == script
    assert not os.path.exists(CANARY)
    figures.record("6. hostile input", runs=1, exact=1, strings=1)


def test_hundred_kib_strings_everywhere(local, tmp_path):
    server, client = local
    big = "x'$(y)\n" * (100 * 1024 // 8)
    result = client.execute(
        SANDBOX,
        ["sh", "-c", 'printf "%s|%s|" "$1" "$BIG" | wc -c; wc -c', "sh", big],
        env={"BIG": big},
        stdin=big,
    )
    assert result.stdout.split() == [str(2 * len(big) + 2), str(len(big))]
