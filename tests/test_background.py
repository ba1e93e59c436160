"""A background process one can live with: iter_output(), returncode,
client.process() and client.processes(), a log nobody reads, a dropped handle.

From the user's side: a real local server, real sockets, real processes;
under both readings of the local server where an open question changes the
outcome (marked both_readings).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import signal
import subprocess
import threading
import time
import warnings

import pytest
import requests
from support import SANDBOX, Recorder, make_client, python, remove_spool, until

import createos_exec as cx

# Numbered lines on both pipes, 20 ms apart, then exit 3.
LOG = python(
    "import sys, time\n"
    "for i in range(12):\n"
    "    print('out', i)\n"
    "    if i % 3 == 0: print('err', i, file=sys.stderr)\n"
    "    time.sleep(0.02)\n"
    "sys.exit(3)\n"
)
LOG_OUT = "".join(f"out {i}\n" for i in range(12))
LOG_ERR = "".join(f"err {i}\n" for i in range(0, 12, 3))
# Says it is up, then waits to be told to go; SIGTERM alone does not end it.
WAITS = python(
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('up')\ntime.sleep(60)\n"
)


def connects(server):
    return len(server.requests_to("connect"))


def by_stream(pieces):
    return {name: "".join(t for s, t in pieces if s == name) for name in ("stdout", "stderr")}


# -- iter_output ---------------------------------------------------------------


def test_output_is_iterated_while_the_process_runs(client):
    proc = client.start(SANDBOX, python("import time\nprint('first')\ntime.sleep(1)\nprint('x')"))
    loop = proc.iter_output(lines=True)
    assert next(loop) == ("stdout", "first\n")
    assert proc.poll() is None  # it runs on: the piece came as it arrived
    assert list(loop) == [("stdout", "x\n")]
    assert proc.wait().stdout == "first\nx\n"


def test_each_piece_once_in_order_and_the_result_is_what_was_iterated(client, server):
    proc = client.start(SANDBOX, LOG)
    pieces = list(proc.iter_output())
    assert by_stream(pieces) == {"stdout": LOG_OUT, "stderr": LOG_ERR}
    reads = connects(server)
    result = proc.wait()  # at once, without reading again
    assert connects(server) == reads
    assert (result.stdout, result.stderr, result.exit_code) == (LOG_OUT, LOG_ERR, 3)
    assert result.output == "".join(text for _, text in pieces)
    assert proc.returncode == 3 and list(proc.iter_output()) == []


def test_leaving_the_loop_only_stops_reading(client, server):
    proc = client.start(SANDBOX, LOG)
    seen = []
    for piece in proc.iter_output():
        seen.append(piece)
        break
    assert proc.poll() is None and server.tree_alive(proc.process_id)
    seen.extend(proc.iter_output())  # goes on at the cursor: nothing lost, nothing twice
    assert by_stream(seen) == {"stdout": LOG_OUT, "stderr": LOG_ERR}
    assert proc.wait().exit_code == 3


def test_a_loop_left_with_its_iterator_kept_gives_way_to_wait(client):
    proc = client.start(SANDBOX, LOG)
    loop = proc.iter_output()
    first = next(loop)
    result = proc.wait(timeout=30)  # the same thread: no deadlock on the kept loop
    assert result.output.startswith(first[1]) and result.stdout == LOG_OUT
    assert list(loop) == []  # that loop was closed


@pytest.mark.both_readings
def test_a_loop_survives_broken_connections(client, server):
    server.drop_stream(after_frames=2)
    server.drop_stream(after_frames=3, mid_frame=True)
    proc = client.start(SANDBOX, LOG)
    pieces = list(proc.iter_output())
    assert by_stream(pieces) == {"stdout": LOG_OUT, "stderr": LOG_ERR}
    result = proc.wait()
    assert result.reconnects >= 2 and result.exit_code == 3


def test_lines_are_whole_across_frames_and_reconnects(client, server):
    code = (
        "import sys, time\n"
        "for part in ['hel', 'lo\\nwor', 'ld\\n', 'no end']:\n"
        "    sys.stdout.write(part); sys.stdout.flush(); time.sleep(0.1)\n"
        "sys.stderr.write('e1\\ne'); sys.stderr.flush()\n"
    )
    server.drop_stream(after_frames=1)
    proc = client.start(SANDBOX, python(code))
    lines = list(proc.iter_output(lines=True))
    assert [t for s, t in lines if s == "stdout"] == ["hello\n", "world\n", "no end"]
    assert [t for s, t in lines if s == "stderr"] == ["e1\n", "e"]
    assert proc.wait().stdout == "hello\nworld\nno end"


# Lines on both pipes written in pieces, a character split between two writes, and
# a line of 200,000 characters in two pieces.
PIECEMEAL = python(
    "import os, sys, time\n"
    "def put(fd, data): os.write(fd, data); time.sleep(0.02)\n"
    "for i in range(4):\n"
    "    put(1, b'log %d part1 ' % i); put(1, b'part2 caf\\xc3'); put(1, b'\\xa9\\n')\n"
    "    put(2, b'err %d ' % i); put(2, b'end\\n')\n"
    "put(1, b'a' * 100000); put(1, b'b' * 100000 + b'\\n'); put(1, b'last')\n"
)
PIECEMEAL_OUT = "".join(f"log {i} part1 part2 caf\u00e9\n" for i in range(4))
PIECEMEAL_OUT += "a" * 100000 + "b" * 100000 + "\nlast"
PIECEMEAL_ERR = "".join(f"err {i} end\n" for i in range(4))


@pytest.mark.parametrize("lines", [True, False], ids=["lines", "pieces"])
@pytest.mark.both_readings
def test_loops_left_after_each_piece_hand_out_everything_once(client, server, lines):
    server.drop_stream(after_frames=3)  # broken connections on the way, besides the loops'
    server.drop_stream(after_frames=5, mid_frame=True)
    proc = client.start(SANDBOX, PIECEMEAL)
    seen = []
    while True:  # a new loop (a new connection) for each piece, left by `break`
        for piece in proc.iter_output(lines=lines):
            seen.append(piece)
            break
        else:
            break
    assert by_stream(seen) == {"stdout": PIECEMEAL_OUT, "stderr": PIECEMEAL_ERR}
    if lines:
        texts = [text for _, text in seen]
        assert all(text.endswith("\n") for text in texts if text != "last")
        assert [t for s, t in seen if s == "stdout"] == PIECEMEAL_OUT.splitlines(keepends=True)
    result = proc.wait()
    assert (result.stdout, result.stderr) == (PIECEMEAL_OUT, PIECEMEAL_ERR)


def test_the_loop_timeout_only_stops_waiting(client, server):
    proc = client.start(SANDBOX, WAITS)
    seen = []
    with pytest.raises(cx.WaitTimeout) as caught:
        for piece in proc.iter_output(timeout=3.0):  # "up" comes first, even when loaded
            seen.append(piece)
    assert by_stream(seen)["stdout"] == "up\n" and caught.value.timeout == 3.0
    assert isinstance(caught.value, subprocess.TimeoutExpired)
    assert proc.poll() is None and server.tree_alive(proc.process_id)
    proc.kill()
    assert proc.wait().signal == "SIGKILL"


def test_on_output_sees_the_pieces_the_loop_sees(client):
    called = []
    proc = client.start(SANDBOX, LOG, on_output=lambda stream, text: called.append((stream, text)))
    assert list(proc.iter_output()) == called


@pytest.mark.both_readings
def test_the_command_timeout_contains_the_tree_during_a_loop(client, server):
    proc = client.start(SANDBOX, WAITS, timeout=1.0)
    pieces = list(proc.iter_output())  # ends with the run
    result = proc.wait()
    assert by_stream(pieces)["stdout"] == "up\n" and result.timed_out and result.exit_code is None
    assert server.wait_tree_gone(proc.process_id)


@pytest.mark.both_readings
def test_eviction_during_a_loop_raises_with_what_was_read(client, server, tmp_path):
    server.drop_stream(after_frames=1)  # the connection breaks after "one"
    go = tmp_path / "go"
    code = (
        "import os, time\nos.write(1, b'one\\n')\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "os.write(1, b'two\\nthree\\n')\n"
    )
    proc = client.start(SANDBOX, python(code + "time.sleep(60)"))
    loop = proc.iter_output()
    assert next(loop) == ("stdout", "one\n")
    go.touch()
    # The loop's body takes its time: "two" and "three" are journalled meanwhile.
    until(lambda: server.process(proc.process_id)["output"]["newest_seq"] >= 2)
    server.evict(proc.process_id)  # and lost before the loop reads them, spool and all
    remove_spool(server, proc.process_id)
    with pytest.raises(cx.OutputEvictedError) as caught:
        list(loop)  # a live reader is never handed output after a gap
    assert caught.value.result is not None and caught.value.result.stdout == "one\n"
    assert server.wait_tree_gone(proc.process_id)  # contained, as any error after creation


def test_wait_timeout_carries_the_output_read_so_far(client):
    proc = client.start(
        SANDBOX,
        python(
            "import sys\nprint('so far')\nprint('e', file=sys.stderr)\nimport time; time.sleep(60)"
        ),
    )
    deadline = time.monotonic() + 10
    while True:
        with pytest.raises(cx.WaitTimeout) as caught:
            proc.wait(timeout=0.3)
        if caught.value.output and caught.value.stderr:
            break
        assert time.monotonic() < deadline
    assert (caught.value.output, caught.value.stderr) == ("so far\n", "e\n")
    proc.kill()


def test_bad_loop_timeouts_are_refused_before_anything_is_read(client):
    proc = client.start(SANDBOX, ["true"])
    for bad in (-1, "1", float("nan")):
        with pytest.raises(cx.ConfigError):
            proc.iter_output(timeout=bad)
    assert proc.wait().exit_code == 0


# -- process() and processes() ----------------------------------------------------


@pytest.mark.both_readings
def test_a_process_started_earlier_is_taken_up_as_a_handle(client, server):
    started = client.start(SANDBOX, LOG)
    with make_client(server) as later:  # a restarted kernel: another client, the id kept
        proc = later.process(SANDBOX, started.process_id)
        assert proc.args == LOG and proc.returncode is None
        pieces = list(proc.iter_output())
        assert by_stream(pieces) == {"stdout": LOG_OUT, "stderr": LOG_ERR}
        assert proc.wait().exit_code == 3 and proc.poll() == 3
    started.wait()


@pytest.mark.both_readings
def test_a_handle_taken_up_later_terminates_and_signals(client, server):
    first = client.start(SANDBOX, WAITS)
    proc = client.process(SANDBOX, first.process_id, after=0)
    proc.send_signal("SIGKILL")
    assert proc.wait().signal == "SIGKILL"
    assert server.wait_tree_gone(first.process_id)
    first.wait()


@pytest.mark.both_readings
def test_processes_lists_what_createos_exec_started_as_it_was_given(client, server):
    argv = ["printf", "%s|", "two words", "it's"]
    script = "echo 'a b' | wc -w"
    done = client.execute(SANDBOX, argv)
    shelled = client.execute(SANDBOX, script, shell=True)
    running = client.start(SANDBOX, WAITS)
    assert next(running.iter_output(lines=True)) == ("stdout", "up\n")  # it ignores SIGTERM now
    foreign = requests.post(
        server.url + f"/v1/sandboxes/{SANDBOX}/processes",
        json={"cmd": "sleep", "args": ["0"]},
        headers={"X-Api-Key": server.api_key},
        timeout=10,
    ).json()["data"]["process_id"]
    listed = {info.process_id: info for info in client.processes(SANDBOX)}
    pid = server.process(done.process_id)["pid"]
    assert listed[done.process_id] == cx.ProcessInfo(
        done.process_id, argv, "exited", 0, None, True, pid
    )
    assert listed[shelled.process_id].args == script and listed[shelled.process_id].ours
    assert listed[running.process_id].state == "running"
    assert listed[running.process_id].exit_code is None
    assert listed[foreign].args == ["sleep", "0"] and not listed[foreign].ours
    running.kill()
    assert running.wait().signal == "SIGKILL"


def test_processes_follows_the_pages_of_a_paginated_listing(local_server):
    paged = local_server(reading="alternative", list_page_size=2)
    with make_client(paged) as client:
        ids = [client.execute(SANDBOX, ["true"]).process_id for _ in range(5)]
        assert [info.process_id for info in client.processes(SANDBOX)][-5:] == ids
    with pytest.raises(cx.ConfigError):
        make_client(paged).processes("bad id")


# -- a log nobody reads keeps its ending --------------------------------------------


# Prints far more than the journal holds, quickly, then exits 3.
FLOOD = python(
    "import sys\n"
    "for i in range(40000):\n"
    "    sys.stdout.write('%07d\\n' % i)\n"
    "sys.stdout.flush()\n"
    "sys.exit(3)\n"
)
FLOOD_OUT = "".join("%07d\n" % i for i in range(40000))


@pytest.fixture
def small_journal(local_server):
    # Frames of 4 KiB: the journal holds several, whatever the reading adds at EOF.
    return local_server(journal_limit=32768, frame_limit=4096)


@pytest.mark.both_readings
def test_evicted_output_nobody_read_is_the_head_of_the_result(small_journal):
    with make_client(small_journal) as client:
        proc = client.start(SANDBOX, FLOOD)
        until(lambda: proc.poll() is not None)  # nobody reads: the journal drops its oldest
        remove_spool(small_journal, proc.process_id)  # and nothing else keeps it
        result = proc.wait()
    assert result.exit_code == 3 and result.output_evicted
    assert result.stdout_truncated and result.output_truncated
    assert 0 < len(result.stdout) < len(FLOOD_OUT) and FLOOD_OUT.endswith(result.stdout)
    assert result.output == result.stdout


# -- a dropped handle ------------------------------------------------------------------


def test_a_handle_dropped_while_its_process_runs_warns(client, server):
    proc = client.start(SANDBOX, WAITS)
    process_id = proc.process_id
    with pytest.warns(ResourceWarning, match=process_id):
        del proc
        gc.collect()
    client.process(SANDBOX, process_id).kill()


def test_no_warning_once_the_run_has_ended(client):
    proc = client.start(SANDBOX, ["true"])
    proc.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        del proc
        gc.collect()


# -- the signatures hold the options they build -----------------------------------------


FOLLOW_KEYWORDS = {
    "timeout", "on_output", "check", "max_output_chars", "encoding", "errors", "cancel", "text",
    "resume",
}  # fmt: skip
RUN_KEYWORDS = {field.name for field in dataclasses.fields(cx._Options)}
RUN_METHODS, RUN_FUNCTIONS = (cx.Client.execute, cx.Client.start), (cx.execute, cx.start)


@pytest.mark.parametrize("output", ["Text", "Bytes", "Any"])  # what each overload takes
def test_the_typed_keywords_are_the_options(output):
    assert set(getattr(cx, f"_{output}Run").__annotations__) == RUN_KEYWORDS
    assert set(getattr(cx, f"_{output}Follow").__annotations__) == FOLLOW_KEYWORDS


@pytest.mark.parametrize(
    "function, own, keywords",
    [
        *((method, {"self", "sandbox_id", "command"}, RUN_KEYWORDS) for method in RUN_METHODS),
        *(
            (function, {"sandbox_id", "command", "client"}, RUN_KEYWORDS)
            for function in RUN_FUNCTIONS
        ),
        *(
            (method, {"self", "sandbox_id", "process_id", "after", "stdin", "pty"}, FOLLOW_KEYWORDS)
            for method in (cx.Client.process, cx.Client.attach)
        ),
    ],
)
def test_help_shows_each_keyword_with_the_options_own_default(function, own, keywords):
    parameters = dict(inspect.signature(function).parameters)
    assert set(parameters) - own == keywords
    for name in keywords:
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert parameters[name].default == getattr(cx._Options(), name), name


@pytest.mark.parametrize("method", ["execute", "start", "process", "attach"])
def test_a_keyword_the_method_does_not_take_is_a_type_error_before_any_request(
    client, server, method
):
    with pytest.raises(
        TypeError, match=rf"^{method}\(\) got an unexpected keyword argument 'shel'"
    ):
        getattr(client, method)(SANDBOX, "proc_x", shel=True)
    assert server.requests_to("create") == server.requests_to("get") == []


def test_every_keyword_reaches_the_options(client, monkeypatch):
    built = []
    real = cx._Options.__init__

    def spy(self, given=frozenset(), **options):
        built.append(options)  # `given`, their names, is the checks' own
        real(self, given=given, **options)

    monkeypatch.setattr(cx._Options, "__init__", spy)
    cancel = threading.Event()
    values = dict(
        shell=True, cwd="/", env={"A": "1"}, input="in", timeout=30.0, on_output=print,
        check=True, max_output_chars=7, encoding="latin-1", errors="strict", cancel=cancel,
        capture_output=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    result = client.execute(SANDBOX, "cat", **values)
    assert built[-1] == values and result.stdout == "in"
    proc = client.process(SANDBOX, result.process_id, after=0, timeout=9.0, check=True)
    assert built[-1] == dict(timeout=9.0, check=True)
    assert proc.wait().stdout == "in"


# -- ported from subprocess.run and Popen ---------------------------------------------
# Each snippet runs as it is against subprocess and against the local server: what
# docs/api.md's and docs/background-processes.md's tables call "the same".


def ported_run(run, popen):
    piped, script = subprocess.PIPE, ["sh", "-c", "cat; echo err >&2"]
    done = run(script, input="in\n", stdout=piped, stderr=piped, text=True)
    return done.returncode, done.stdout, done.stderr


def ported_bytes(run, popen):
    script = ["sh", "-c", r"printf '\377\000'; cat; printf '\200' >&2; exit 3"]
    try:
        run(script, input=bytes(range(256)), capture_output=True, text=False, check=True)
    except subprocess.CalledProcessError as failed:
        ran = failed.returncode, failed.stdout, failed.stderr
    piped = subprocess.PIPE
    proc = popen(["cat"], stdin=piped, stdout=piped, stderr=piped, text=False)
    return ran, proc.communicate(b"\x00\xff")


def ported_check(run, popen):
    script = ["sh", "-c", "echo out; echo err >&2; exit 3"]
    try:
        run(script, capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError as failed:
        return failed.returncode, failed.cmd, failed.stdout, failed.stderr


def ported_stderr_into_stdout(run, popen):
    script = "echo 1; sleep 0.1; echo 2 >&2; sleep 0.1; echo 3"
    done = run(script, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return done.stdout, bool(done.stderr)


def ported_devnull_cwd_and_shell(run, popen):
    script = "cat; pwd; echo $((6 * 7))"
    nothing, piped = subprocess.DEVNULL, subprocess.PIPE
    return run(script, shell=True, cwd="/", stdin=nothing, stdout=piped, text=True).stdout


def ported_communicate(run, popen):
    proc = popen(
        ["sh", "-c", "tr a-z A-Z; echo e >&2; exit 3"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return proc.communicate("hi\n"), proc.returncode


def ported_poll_wait_kill(run, popen):
    proc = popen(["sleep", "30"])
    running = proc.poll()
    try:
        proc.wait(timeout=0.2)
    except subprocess.TimeoutExpired as stopped:
        waited = stopped.timeout
    still = proc.poll()
    proc.kill()
    proc.wait()
    return running, waited, still, proc.returncode


def ported_terminate_and_send_signal(run, popen):
    terminated, signalled = popen(["sleep", "30"]), popen(["sleep", "30"])
    terminated.terminate()
    signalled.send_signal(signal.SIGUSR1)
    terminated.wait(), signalled.wait()
    return terminated.returncode, signalled.returncode


def ported_dropped_handle_warns(run, popen):
    proc = popen(["sleep", "2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del proc
        gc.collect()
    return [warning.category for warning in caught]


PORTED = [value for name, value in list(globals().items()) if name.startswith("ported_")]


@pytest.mark.parametrize("snippet", PORTED, ids=lambda snippet: snippet.__name__[7:])
@pytest.mark.both_readings
def test_ported_lines_do_what_subprocess_does(client, snippet):
    remote = snippet(
        functools.partial(client.execute, SANDBOX), functools.partial(client.start, SANDBOX)
    )
    assert remote == snippet(subprocess.run, subprocess.Popen)


@pytest.mark.both_readings
def test_stderr_into_stdout_is_merged_in_order_wherever_output_goes(client):
    recorder = Recorder()
    # Each line is written once the one before has come here: the order is certain.
    script = "echo o1; read _; echo e1 >&2; read _; echo o2; read _; exit 1"
    proc = client.start(
        SANDBOX, script, shell=True, stdin=subprocess.PIPE, stderr=subprocess.STDOUT,
        on_output=recorder, check=True,
    )  # fmt: skip
    looped = []
    for piece in proc.iter_output(lines=True):
        looped.append(piece)
        if len(looped) == 3:
            break
        proc.write("\n")
    with pytest.raises(cx.WaitTimeout) as waited:
        proc.wait(timeout=0.2)
    proc.close_stdin()
    with pytest.raises(cx.CommandError) as failed:
        proc.wait()
    merged = "o1\ne1\no2\n"
    assert looped == [("stdout", "o1\n"), ("stdout", "e1\n"), ("stdout", "o2\n")]
    assert (recorder.text(), recorder.text("stderr")) == (merged, "")
    assert (waited.value.output, waited.value.stderr) == (merged, "")
    assert (failed.value.stdout, failed.value.stderr) == (merged, "")
    assert (failed.value.result.output, failed.value.result.stderr_truncated) == (merged, False)


@pytest.mark.parametrize(
    "keywords, part",
    [
        (dict(capture_output=False), "always captured"),
        (dict(text=0), "text must be True or False"),
        (dict(stdin="a", input="b"), "input="),
        (dict(stdout=subprocess.DEVNULL), "stdout can only be subprocess.PIPE or None"),
        (dict(stdout=subprocess.STDOUT), "stdout can only be subprocess.PIPE or None"),
        (dict(stderr=subprocess.DEVNULL), "stderr can only be .* subprocess.STDOUT"),
        (dict(stderr=True), "stderr can only"),
        (dict(stdin=subprocess.STDOUT), "stdin must be"),
        (dict(stdin=subprocess.PIPE), "needs start()"),
    ],
)
def test_ported_keywords_that_cannot_hold_are_refused_first(client, server, keywords, part):
    with pytest.raises(cx.ConfigError, match=part):
        client.execute(SANDBOX, ["cat"], **keywords)
    assert server.requests_to("create") == []
