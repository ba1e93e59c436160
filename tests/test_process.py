"""start() and RemoteProcess, the counterpart of subprocess.Popen.

From the user's side: a real local server, real sockets, real processes. Each
promise of start() has a test here; those an open question of the protocol
changes run under both readings of the local server (marked both_readings).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest
from support import NO_RETRY, SANDBOX, make_client, python, until

import createos_exec as cx

# A program that says it is up, then waits; on SIGTERM it says bye and exits 7.
TRAPS_TERM = python(
    "import signal, sys, time\n"
    "def bye(*_): print('bye'); sys.exit(7)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "print('up')\n"
    "time.sleep(60)\n"
)


def wait_until_printed(proc, seen, text, limit=10.0):
    """Follow `proc` in short waits until `text` was printed (seen: the on_output list)."""
    deadline = time.monotonic() + limit
    while text not in "".join(piece for _, piece in seen):
        assert time.monotonic() < deadline, "the process never printed " + repr(text)
        with pytest.raises(cx.WaitTimeout):
            proc.wait(timeout=0.2)


def collector():
    seen = []
    return seen, lambda stream, text: seen.append((stream, text))


def started_up(client, command=TRAPS_TERM, seen=None):
    """`command` started, once it has printed "up" (its on_output adds to `seen`)."""
    seen = [] if seen is None else seen
    proc = client.start(SANDBOX, command, on_output=lambda *piece: seen.append(piece))
    wait_until_printed(proc, seen, "up\n")
    return proc


def deletes(server, process_id):
    return [r for r in server.requests_to("delete") if r.path.endswith("/" + process_id)]


# -- start(): created once, returned at once ------------------------------------


@pytest.mark.both_readings
def test_start_returns_once_the_process_is_created(client, server):
    began = time.monotonic()
    proc = client.start(SANDBOX, ["sleep", "30"])
    try:
        assert time.monotonic() - began < 5
        assert proc.sandbox_id == SANDBOX
        assert proc.process_id.startswith("proc_")
        assert proc.args == ["sleep", "30"]
        assert server.tree_alive(proc.process_id)
        assert len(server.requests_to("create")) == 1
        assert server.requests_to("connect") == []  # nothing is read before wait()
        assert repr(proc) == (
            f"RemoteProcess(sandbox_id='sb_local', process_id={proc.process_id!r}, "
            "args=['sleep', '30'])"
        )
    finally:
        proc.kill()


def test_start_stages_secrets_and_adopts_a_creation_whose_answer_was_lost(client, server):
    server.lose_create_response()
    proc = client.start(
        SANDBOX, ["sh", "-c", 'printf "%s|" "$TOKEN"; cat'], env={"TOKEN": "t0k3n"}, stdin="in"
    )
    (record,) = server.processes()
    assert record["process_id"] == proc.process_id  # found again by its marker
    assert proc.pid == record["pid"]  # as the listing showed it
    assert "t0k3n" not in repr(record) and "in" not in record["args"]  # staged, never listed
    result = proc.wait()
    assert (result.exit_code, result.stdout) == (0, "t0k3n|in")
    assert result.creation_recovered is True
    assert len(server.requests_to("create")) == 1  # never re-sent


def test_module_level_start_builds_a_client_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("CREATEOS_API_URL", server.url)
    monkeypatch.setenv("CREATEOS_API_KEY", server.api_key)
    with cx.start(SANDBOX, ["echo", "from", "the environment"]) as proc:
        result = proc.wait()
    assert (result.exit_code, result.stdout) == (0, "from the environment\n")
    with make_client(server) as client:
        assert cx.start(SANDBOX, ["true"], client=client).wait().exit_code == 0


# -- poll() ------------------------------------------------------------------------


@pytest.mark.both_readings
def test_pid_is_the_leaders_on_every_handle_and_in_the_listing(client, server):
    proc = client.start(SANDBOX, ["true"])
    again = client.process(SANDBOX, proc.process_id)
    listed = {info.process_id: info.pid for info in client.processes(SANDBOX)}
    pid = server.process(proc.process_id)["pid"]
    assert proc.pid == again.pid == listed[proc.process_id] == pid > 0
    assert proc.wait().ok and again.wait().ok


@pytest.mark.both_readings
def test_poll_is_none_while_it_runs_then_its_returncode_one_request_at_most(client, server):
    proc = client.start(SANDBOX, "sleep 0.5; exit 3", shell=True)
    before = len(server.requests)
    assert proc.poll() is None and proc.returncode is None  # returncode asks nothing
    assert len(server.requests) == before + 1
    codes = []
    deadline = time.monotonic() + 10
    while not codes or codes[-1] is None:
        assert time.monotonic() < deadline
        before = len(server.requests)
        codes.append(proc.poll())
        assert len(server.requests) == before + 1  # one request per call
        time.sleep(0.05)
    assert codes[-1] == 3 == proc.returncode and set(codes[:-1]) <= {None}
    assert proc.wait().exit_code == 3
    before = len(server.requests)
    assert proc.poll() == 3
    assert len(server.requests) == before  # known: no request at all


# -- wait(): every guarantee of execute() ------------------------------------------


@pytest.mark.both_readings
def test_wait_resumes_a_broken_stream(client, server):
    server.drop_stream(after_frames=2)
    proc = client.start(SANDBOX, "for i in 1 2 3 4 5; do echo $i; sleep 0.05; done", shell=True)
    result = proc.wait()
    assert result.stdout == "1\n2\n3\n4\n5\n"
    assert result.reconnects == 1
    assert proc.wait() is result  # once ended, every wait() gives the same result


def test_wait_contains_an_invalid_stream_and_raises_again_later(client, server):
    server.corrupt_stream(b"not json\n", after_frames=1)
    proc = client.start(SANDBOX, "echo first; sleep 0.2; echo second; sleep 30", shell=True)
    with pytest.raises(cx.ProtocolError) as caught:
        proc.wait()
    assert caught.value.process_id == proc.process_id
    assert not server.tree_alive(proc.process_id)  # contained before the error came
    assert len(deletes(server, proc.process_id)) == 1
    with pytest.raises(cx.ProtocolError) as again:
        proc.wait()
    assert again.value is caught.value
    proc.terminate()  # already ended: nothing more is sent
    assert len(deletes(server, proc.process_id)) == 1


def test_the_commands_own_timeout_counts_from_start_and_terminates_the_tree(client, server):
    proc = client.start(SANDBOX, "echo started; sleep 30", shell=True, timeout=0.5)
    assert server.wait_tree_gone(proc.process_id)  # the deadline passes before anyone waits
    began = time.monotonic()
    result = proc.wait()
    assert result.timed_out and result.exit_code is None
    assert result.stdout == "started\n"
    assert time.monotonic() - began < 5
    assert not server.tree_alive(proc.process_id)


# -- wait(timeout=): only stops waiting ------------------------------------------


@pytest.mark.both_readings
def test_wait_timeout_only_stops_waiting(client, server):
    proc = client.start(SANDBOX, "echo one; sleep 0.6; echo two; exit 4", shell=True)
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        proc.wait(timeout=0.3)
    assert 0.25 < time.monotonic() - began < 2
    error = caught.value
    assert isinstance(error, cx.WaitTimeout) and isinstance(error, cx.CreateOSError)
    assert (error.cmd, error.timeout, error.process_id) == (proc.args, 0.3, proc.process_id)
    assert server.tree_alive(proc.process_id)  # it goes on running
    assert deletes(server, proc.process_id) == []
    assert proc.poll() is None
    result = proc.wait()
    assert (result.exit_code, result.stdout) == (4, "one\ntwo\n")
    assert result.reconnects == 0


def test_a_later_wait_resumes_at_the_cursor_nothing_lost_or_repeated(client, server):
    seen, on_output = collector()
    script = "for i in $(seq 1 8); do echo line $i; echo err $i >&2; sleep 0.08; done"
    proc = client.start(SANDBOX, script, shell=True, on_output=on_output)
    stops = 0
    while True:
        try:
            result = proc.wait(timeout=0.1)
            break
        except cx.WaitTimeout:
            stops += 1
    assert stops >= 3
    expected_out = "".join(f"line {i}\n" for i in range(1, 9))
    expected_err = "".join(f"err {i}\n" for i in range(1, 9))
    assert "".join(text for stream, text in seen if stream == "stdout") == expected_out
    assert "".join(text for stream, text in seen if stream == "stderr") == expected_err
    assert (result.stdout, result.stderr, result.exit_code) == (expected_out, expected_err, 0)
    afters = [int(r.query.get("after", 0)) for r in server.requests_to("connect")]
    assert afters == sorted(afters) and afters[0] == 0 and afters[-1] > 0
    assert len(afters) == stops + 1  # each wait resumed once, where the last one stopped


@pytest.mark.both_readings
def test_a_wait_timeout_of_zero_does_not_block(client):
    proc = client.start(SANDBOX, ["sleep", "30"])
    try:
        began = time.monotonic()
        with pytest.raises(cx.WaitTimeout):
            proc.wait(timeout=0)
        assert time.monotonic() - began < 1
        with pytest.raises(cx.ConfigError):
            proc.wait(timeout=-1)
    finally:
        proc.kill()


def iterate(proc, timeout):
    for _ in proc.iter_output(timeout=timeout):
        pass


@pytest.mark.parametrize("wait", [cx.RemoteProcess.wait, iterate], ids=["wait", "iter_output"])
@pytest.mark.both_readings
def test_a_wait_timeout_holds_between_heartbeats_far_apart(local_server, wait):
    # Each heartbeat starts the read timeout again: a deadline checked only
    # between blocks would end this wait at the first heartbeat, at 5 s; the
    # margin to it is one a loaded machine keeps.
    quiet = local_server(heartbeat_interval=5.0)
    with make_client(quiet, stream_idle_timeout=30.0) as client:
        proc = client.start(SANDBOX, ["sleep", "30"])
        began = time.monotonic()
        with pytest.raises(cx.WaitTimeout):
            wait(proc, 2.5)
        assert 2.5 <= time.monotonic() - began < 4.5
        assert proc.poll() is None
        proc.kill()


# -- terminate(), kill(), send_signal() ------------------------------------------


@pytest.mark.both_readings
def test_terminate_ends_the_tree_with_its_grace_period_confirmed(client, server):
    seen: list = []
    proc = started_up(client, seen=seen)
    proc.terminate()
    assert not server.tree_alive(proc.process_id)  # confirmed before terminate() returned
    (delete,) = deletes(server, proc.process_id)
    assert delete.query["grace_ms"] == "1000"
    # The grace period's stream is opened first: a deleted process may be forgotten (§11.12).
    assert server.requests_to("connect")[-1].time < delete.time
    result = proc.wait()
    assert (result.exit_code, result.signal) == (7, None)
    # What it printed in its grace period was read, and handed out.
    assert result.stdout == "up\nbye\n" == "".join(text for _, text in seen)
    assert proc.poll() == 7


@pytest.mark.both_readings
def test_kill_sends_sigkill_first_then_confirms_the_tree_gone(client, server):
    proc = started_up(client)  # SIGTERM would say bye
    proc.kill()
    assert not server.tree_alive(proc.process_id)
    (delete,) = deletes(server, proc.process_id)
    assert delete.query["grace_ms"] == "0"
    (sent,) = server.requests_to("signal")
    assert sent.time < delete.time
    result = proc.wait()
    assert (result.signal, result.returncode, result.stdout) == ("SIGKILL", -9, "up\n")
    assert proc.poll() == -signal.SIGKILL == proc.returncode


@pytest.mark.parametrize("ending", ["terminate", "with", "kill"])
@pytest.mark.both_readings
def test_the_last_words_of_the_grace_period_reach_the_callback_a_loop_and_the_result(
    client, server, ending
):
    seen, on_output = collector()
    proc = client.start(SANDBOX, TRAPS_TERM, on_output=on_output)
    looped: list = []
    loop = threading.Thread(target=lambda: looped.extend(text for _, text in proc.iter_output()))
    loop.start()  # reads while another thread ends the process
    until(lambda: "".join(looped) == "up\n")
    if ending == "with":
        with proc:
            pass
    else:
        getattr(proc, ending)()
    loop.join(10)
    last_words = "" if ending == "kill" else "bye\n"  # SIGKILL first: no grace period
    assert "".join(looped) == "".join(text for _, text in seen) == proc.wait().stdout
    assert proc.wait().stdout == "up\n" + last_words and not loop.is_alive()


@pytest.mark.both_readings
def test_send_signal_reaches_the_process(client, server):
    handler = python(
        "import signal, sys, time\n"
        "def got(number, _): print('got', number); sys.exit(3)\n"
        "signal.signal(signal.SIGINT, got)\n"
        "signal.signal(signal.SIGUSR1, got)\n"
        "print('up')\n"
        "time.sleep(60)\n"
    )
    first = started_up(client, handler)
    first.send_signal("SIGINT")
    assert first.wait().stdout == f"up\ngot {int(signal.SIGINT)}\n"
    second = started_up(client, handler)
    second.send_signal(signal.SIGUSR1)
    result = second.wait()
    assert (result.exit_code, result.stdout) == (3, f"up\ngot {int(signal.SIGUSR1)}\n")
    sent = len(server.requests_to("signal"))
    second.send_signal("SIGINT")  # ended: nothing is sent
    assert len(server.requests_to("signal")) == sent == 2
    with pytest.raises(cx.ConfigError):
        second.send_signal("INT; rm -rf /")


def test_terminate_from_another_thread_ends_a_wait_in_progress(client, server):
    proc = started_up(client)
    results, reads = [], len(server.requests_to("connect"))
    waiter = threading.Thread(target=lambda: results.append(proc.wait()))
    waiter.start()
    until(lambda: len(server.requests_to("connect")) > reads)  # the waiter reads the stream
    proc.terminate()
    assert not server.tree_alive(proc.process_id)
    waiter.join(10)
    assert not waiter.is_alive()
    (result,) = results
    assert (result.exit_code, result.stdout) == (7, "up\nbye\n")


# -- the `with` block ------------------------------------------------------------


@pytest.mark.both_readings
def test_leaving_the_block_terminates_a_tree_that_still_runs(client, server):
    with client.start(SANDBOX, ["sleep", "30"]) as proc:
        assert proc.poll() is None
    assert not server.tree_alive(proc.process_id)
    assert len(deletes(server, proc.process_id)) == 1
    assert proc.wait().signal == "SIGTERM"
    assert proc.poll() == -signal.SIGTERM


def test_leaving_the_block_by_an_error_terminates_and_raises_it(client, server):
    with pytest.raises(RuntimeError, match="boom"):
        with client.start(SANDBOX, ["sleep", "30"]) as proc:
            raise RuntimeError("boom")
    assert not server.tree_alive(proc.process_id)


@pytest.mark.both_readings
def test_leaving_the_block_after_the_process_ended_sends_nothing(client, server):
    with client.start(SANDBOX, ["true"]) as proc:
        assert proc.wait().exit_code == 0
    assert deletes(server, proc.process_id) == []


@pytest.mark.both_readings
def test_leaving_the_block_with_termination_unconfirmed_raises_cleanup_error(server):
    with make_client(server, retry=NO_RETRY, cleanup_timeout=0.5) as client:
        with pytest.raises(cx.CleanupError) as caught:
            with client.start(SANDBOX, ["sleep", "30"]) as proc:
                server.fail("delete", 500, count=5)
                raise RuntimeError("boom")
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert caught.value.process_id == proc.process_id
        assert server.tree_alive(proc.process_id)  # what CleanupError warns of
        with pytest.raises(cx.CleanupError):
            with client.start(SANDBOX, ["sleep", "30"]):
                server.fail("delete", 500, count=5)


# -- execute() and attach() are the same machinery ---------------------------------


def test_execute_and_attach_follow_through_remote_process_wait(client, monkeypatch):
    waits = []
    original = cx.RemoteProcess.wait

    def counted(self, timeout=None):
        waits.append(self.process_id)
        return original(self, timeout)

    monkeypatch.setattr(cx.RemoteProcess, "wait", counted)
    result = client.execute(SANDBOX, ["echo", "hi"])
    assert waits == [result.process_id]
    again = client.attach(SANDBOX, result.process_id)
    assert waits == [result.process_id] * 2
    assert again.stdout == result.stdout == "hi\n"
