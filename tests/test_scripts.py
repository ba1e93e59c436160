"""The scripts createos_exec sends to the sandbox, their functions run alone in
bash against synthetic process trees on this machine: the wrapper's refusal of
an old bash, the spoolers' limit and their leaving, the watchdog's tree (its
group, its descendants, its own cgroup), its signals, and its leaving when the
program ends; and the manifest of a directory, which the sandbox must list as
this side does. What the whole wrapper
does through the local server is in test_deadline.py and test_creation.py.
(shellcheck_scripts.py checks the same scripts with shellcheck.)
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import time
from typing import Iterator, List, Set

import pytest
from support import alive, until

import createos_exec as cx

if sys.platform != "linux":  # pragma: no cover - /proc
    pytest.skip("the scripts read Linux's /proc", allow_module_level=True)

WATCHDOG = cx._PROCESSES + "\n" + cx._WATCHDOG + "\n"
TOO_OLD = "bash {} is too old: createos_exec needs bash 5.0 or newer in the sandbox"

# A tree as the watchdog finds one: the leader leads a group; in it a child
# and a grandchild its parent left (reparented); outside it a child that
# started a session of its own. Each of them prints its pid.
TREE = """\
sleep 30 & echo "$!"
(sleep 30 & echo "$!")
setsid sleep 30 & echo "$!"
echo ready
wait
"""
# The same leader with a daemon that double-forked out of its group and its
# tree (setsid, then a fork whose parent leaves): only its cgroup holds it.
WITH_DAEMON = """\
setsid bash -c 'sleep 30 & echo "$!"'
echo ready
exec sleep 30
"""


def bash(script: str, *args: str, **options: object) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(
        ["bash", "-c", script, "test", *args], capture_output=True, text=True, timeout=10,
        **options,  # type: ignore[call-overload]
    )  # fmt: skip


def started(script: str, **options: object) -> "subprocess.Popen[str]":
    """A leader in a process group of its own; its members' pids follow in `.members`."""
    leader = subprocess.Popen(
        ["bash", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True,
        **options,  # type: ignore[call-overload]
    )  # fmt: skip
    assert leader.stdout is not None
    leader.members = [int(line) for line in iter(leader.stdout.readline, "ready\n")]  # type: ignore[attr-defined]
    return leader


def targets(leader: int, agent: int) -> List[Set[int]]:
    """The watchdog's tree of `leader` and the part of it outside the group."""
    done = bash(
        WATCHDOG + '_cx_leader=$1 _cx_agent=$2 _cx_group=$1\n_cx_stat "$1"\n'
        '_cx_born=$_cx_starttime\n_cx_targets\necho "${_cx_members[*]}"\necho "${_cx_apart[*]}"',
        str(leader), str(agent),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [{int(pid) for pid in line.split()} for line in done.stdout.split("\n")[:2]]


def terminate(leader: int, agent: str) -> None:
    """The watchdog's SIGTERM to the tree of `leader`, sent as by `agent` ("$$": bash's own)."""
    done = bash(WATCHDOG + f"_cx_leader=$1 _cx_agent={agent} _cx_group=$1\n_cx_signal TERM",
                str(leader))  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.fixture
def tree() -> Iterator["subprocess.Popen[str]"]:
    leader = started(TREE)
    yield leader
    end(leader)


def end(leader: "subprocess.Popen[str]") -> None:
    for pid in leader.members:  # type: ignore[attr-defined]
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    leader.kill()
    leader.wait()
    assert leader.stdout is not None
    leader.stdout.close()


@pytest.mark.parametrize("major, status", [(4, 125), (3, 125), (5, 0), (6, 0)])
def test_the_wrapper_refuses_a_bash_older_than_5_with_125_and_a_sentence(major, status):
    # The check is given the version as arguments: what is shown is the branch
    # taken for each, not a run under a real older bash.
    version = f"{major}.2.1(1)-release"
    head = cx._WRAPPER_HEAD.replace('"${BASH_VERSINFO[0]}" "$BASH_VERSION"', '"$1" "$2"')
    assert head != cx._WRAPPER_HEAD
    done = bash(head + "\necho ran on", str(major), version)
    assert done.returncode == status
    if status:
        assert (done.stdout, done.stderr) == ("", f"createos_exec: {TOO_OLD.format(version)}\n")
    else:
        assert (done.stdout, done.stderr) == ("ran on\n", "")


@pytest.mark.parametrize("kept_from", [0, 10_000])
def test_the_spools_keep_the_first_bytes_and_are_dropped_when_the_journal_keeps_all(
    tmp_path, kept_from
):
    spool = str(tmp_path / "spool")
    script = cx._SPOOL + '\n_cx_spool "$1" 1 "$2"\nhead -c 3000 /dev/urandom; printf e >&2\n'
    done = subprocess.run(
        ["bash", "-c", script, "test", spool, str(kept_from)], capture_output=True
    )
    assert len(done.stdout) == 3000 and done.stderr == b"e"  # past the limit too, in full
    if kept_from:  # 3,001 bytes in all: the journal keeps them
        until(lambda: not os.listdir(tmp_path), 5, "the spools' removal")
        return
    ends = [f"{spool}.{stream}.end" for stream in ("stdout", "stderr")]
    until(lambda: all(map(os.path.exists, ends)), 5, "both ends")
    with open(f"{spool}.stdout", "rb") as out, open(f"{spool}.stderr", "rb") as err:
        assert (out.read(), err.read()) == (done.stdout[:1024], b"e")  # the first KiB
    assert [pathlib.Path(end).read_text() for end in ends] == ["1024\n", "1\n"]


def test_a_sandbox_without_tee_runs_the_command_without_a_spool(tmp_path):
    for program in ("bash", "printf"):  # a PATH with what the command needs, and no tee
        (tmp_path / program).symlink_to(shutil.which(program))
    wrapper = cx._plan(["printf", "%s", "out"], cx._Options()).body["args"][1]
    done = bash(wrapper, "printf", "%s", "out", env={"PATH": str(tmp_path)})
    assert (done.returncode, done.stdout, done.stderr) == (0, "out", "")


def test_the_spoolers_and_the_watchdog_outlive_a_signal_to_the_group_as_it_starts():
    # The command signals its group at once, when the spoolers and the watchdog,
    # forked just before, may not have run a line of their own yet (a race: runs
    # at once make it likely). What it wrote stays, and the deadline still holds.
    script = "trap 'echo got' USR1; kill -USR1 0; echo err >&2; echo end; exec sleep 30"
    wrapper = cx._plan(["bash", "-c", script], cx._Options(timeout=0.3)).body["args"][1]

    def run(_: int) -> "tuple[int, str, str]":
        marker = cx._MARKER_PREFIX + secrets.token_hex(12)  # a spool of its own
        done = subprocess.run(
            ["bash", "-c", wrapper, marker, "bash", "-c", script],
            capture_output=True, text=True, timeout=20, start_new_session=True,
        )  # fmt: skip
        return done.returncode, done.stdout, done.stderr

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = collections.Counter(pool.map(run, range(40)))
    assert outcomes == {(-signal.SIGTERM, "got\nend\n", "err\n"): 40}


def test_the_tree_is_the_group_the_reparented_and_the_descendants_outside_it(tree):
    child, orphan, apart = tree.members
    # Its pid is printed at the fork, before setsid has made it a session of its own.
    until(lambda: os.getsid(apart) == apart, 5, "the session of its own")
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        members, outside = targets(tree.pid, os.getpid())
    finally:
        stranger.kill()
        stranger.wait()
    assert members == {tree.pid, child, orphan, apart}
    assert outside == {apart}  # the others get the signal once, sent to the group


def test_a_signal_reaches_each_process_of_the_tree_and_no_other(tree):
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        terminate(tree.pid, "$$")
        assert tree.wait(5) == -signal.SIGTERM
        until(lambda: not any(map(alive, tree.members)), 5, "the end of the tree")
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def watched(script: str, due_cs: int) -> "tuple[subprocess.Popen[str], subprocess.Popen[str]]":
    """A leader running `script` and its watchdog alone, due in `due_cs` centiseconds,
    on a pipe whose write end (`{write}` in the script) the leader holds."""
    read, write = os.pipe()
    leader = subprocess.Popen(
        ["bash", "-c", script.format(write=write)], pass_fds=(write,), start_new_session=True
    )
    watchdog = subprocess.Popen(
        ["bash", "-c", WATCHDOG + '_cx_watch "$@"', "watchdog", str(leader.pid), str(os.getpid()),
         str(due_cs), "10", str(read)],
        pass_fds=(read,),
    )  # fmt: skip
    os.close(read)
    os.close(write)
    return leader, watchdog


@pytest.mark.parametrize("leader_script", ["sleep 0.2", "sleep 30 >/dev/null & sleep 0.2"])
def test_the_watchdog_leaves_when_the_leader_ends_whoever_holds_the_pipe(leader_script):
    # With a background child the pipe stays open: the look at /proc sees the end.
    leader, watchdog = watched(leader_script, 6000)
    try:
        leader.wait(5)
        assert watchdog.wait(1.0) == 0  # generous: it has 0.1 s at most
    finally:
        with contextlib.suppress(ProcessLookupError):  # the background child
            os.killpg(leader.pid, signal.SIGKILL)
        watchdog.kill()
        watchdog.wait()


def test_a_leader_that_closed_the_pipe_is_still_ended_at_the_deadline():
    leader, watchdog = watched("exec {write}>&-; sleep 30", 30)
    try:
        assert leader.wait(5) == -signal.SIGTERM
        assert watchdog.wait(5) == 0
    finally:
        leader.kill()
        leader.wait()
        watchdog.kill()
        watchdog.wait()


@pytest.fixture
def cgroup() -> Iterator[str]:
    """A cgroup of the v1 "pids" controller of this test's own, removed afterwards."""
    root = "/sys/fs/cgroup/pids"
    path = f"{root}/createos-exec-test-{secrets.token_hex(4)}"
    try:
        os.mkdir(path)
    except OSError as error:
        pytest.skip(f"the v1 pids hierarchy is not writable here ({error.strerror})")
    yield path
    with open(f"{path}/cgroup.procs") as procs:
        for pid in procs.read().split():
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.02)
    os.rmdir(path)


def test_the_leaders_own_cgroup_holds_the_daemon_the_tree_misses(cgroup):
    procs = f"{cgroup}/cgroup.procs"
    leader = started(f"echo $$ >{procs}\n" + WITH_DAEMON)
    try:
        (daemon,) = leader.members
        members, outside = targets(leader.pid, os.getpid())
        assert daemon in members and daemon in outside
        # The cgroup of the agent (here the leader itself) is not one of its own.
        assert daemon not in targets(leader.pid, leader.pid)[0]
        terminate(leader.pid, str(os.getpid()))
        until(lambda: not alive(daemon), 5, "the daemon's end")
    finally:
        end(leader)


# -- the manifest of a directory, in the sandbox and here ---------------------------


def test_a_trees_manifest_is_the_same_on_both_sides_whatever_its_names(tmp_path):
    """_cx_manifest (bash, find and sha256sum there) and _Tree.manifest() (here)
    list a tree alike, names with blanks, newlines, backslashes and bytes that
    are no UTF-8 included, and differ as soon as one entry does."""
    root = tmp_path / "tree"
    for name in ("a b", "tab\tand\nnewline", "back\\slash", "-leading dash", "\udcff\udcfe"):
        (root / "d" / name).mkdir(parents=True)
        (root / "d" / name / name).write_bytes(name.encode("utf-8", "surrogateescape"))
        (root / "d" / f"{name}.link").symlink_to(f"../{name} target")
    (root / "big").write_bytes(os.urandom(1024 * 1024))  # openssl's, not sha256sum's
    (root / "empty").mkdir()
    script = cx._FILE_SUMS + "\n" + cx._TREE_SUMS + '\n_cx_manifest "$1" && echo "$_cx_manifest"'

    def both() -> "tuple[str, str]":
        there = bash(script, str(root))
        assert there.returncode == 0, there.stderr
        return there.stdout.strip(), cx._Tree(str(root)).manifest()

    first = both()
    assert first[0] == first[1]
    (root / "empty").chmod(0o700)
    assert both()[0] == both()[1] != first[0]
