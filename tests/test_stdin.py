"""Talking to a running process: write(), close_stdin(), communicate(), wait_for_port().

Against the local server, under both readings of docs/protocol.md §11. The faults
of a write are injected on every piece of a large one: a piece is sent again
only when it certainly did not arrive (a refused connection, a 429), and a
lost answer, a 5xx or a timeout is reported with the bytes confirmed so far,
never answered by sending the piece twice.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import os
import pickle
import queue
import random
import shlex
import socket
import sys
import threading
import time

import pytest
import requests
import urllib3
from support import (
    SANDBOX,
    THREE_TRIES,
    campaign_size,
    closed_port,
    make_client,
    python,
)

import createos_exec as cx

PIECE = cx._INPUT_PIECE
# Prints how many bytes its stdin held and their digest: what arrived, once.
DIGEST = [
    sys.executable,
    "-c",
    "import hashlib, sys\n"
    "data = sys.stdin.buffer.read()\n"
    "print(len(data), hashlib.sha256(data).hexdigest())\n",
]
# Doubles each number it reads, one line at a time.
DOUBLER = python("import sys\nfor line in sys.stdin:\n    print(2 * int(line), flush=True)\n")


def digest(data):
    return "%d %s\n" % (len(data), hashlib.sha256(data).hexdigest())


def refused():
    """What requests raises when no connection could be made at all."""
    reason = urllib3.exceptions.NewConnectionError(None, "Connection refused")
    return requests.exceptions.ConnectionError(
        urllib3.exceptions.MaxRetryError(None, "/input", reason)
    )


class FaultOnPiece(requests.Session):
    """A session that injects a fault just before the input request of piece `piece`
    (0-based; or of each request named in `faults`, by its number) leaves: on
    the server for a status or a lost answer, here for a connection that is
    never made."""

    def __init__(self, server, piece=None, fault=None, faults=None):
        super().__init__()
        self.server = server
        self.faults = dict(faults or {piece: fault})
        self.inputs = 0

    def request(self, method, url, *args, **kwargs):
        if url.endswith("/input"):
            self.inputs += 1
            fault = self.faults.get(self.inputs - 1)
            if fault == "refused":
                raise refused()
            if fault == "lost":
                self.server.lose_input_response()
            elif fault == "timeout":
                self.server.lose_input_response(seconds=5.0)
            elif fault is not None:
                self.server.fail("input", fault, retry_after="0")
        return super().request(method, url, *args, **kwargs)


def no_requests_during(server, action):
    before = len(server.requests)
    with pytest.raises(cx.ConfigError):
        action()
    assert len(server.requests) == before


# -- writing ---------------------------------------------------------------------------


@pytest.mark.both_readings
def test_a_repl_exchange_chooses_each_line_from_the_last_answer(client, server):
    answers = queue.Queue()
    proc = client.start(
        SANDBOX, DOUBLER, stdin=cx.PIPE, on_output=lambda stream, text: answers.put(text)
    )
    follower = threading.Thread(target=proc.wait)
    follower.start()
    try:
        number, seen = 1, []
        while number < 1000:
            proc.write("%d\n" % number)
            text = ""
            while not text.endswith("\n"):
                text += answers.get(timeout=10)
            number = int(text)
            seen.append(number)
        proc.close_stdin()
    finally:
        follower.join(30)
    assert seen == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert proc.wait().exit_code == 0
    assert len(server.requests_to("input")) == 10


def test_many_mib_arrive_intact_in_pieces_under_the_limit(client, server):
    data = os.urandom(6 * 1024 * 1024 + 12345)
    proc = client.start(SANDBOX, DIGEST, stdin=cx.PIPE)
    proc.write(data[:100])
    proc.write(data[100:])
    assert proc.communicate()[0] == digest(data)
    pieces = 1 + -(-(len(data) - 100) // PIECE)
    assert [r.status for r in server.requests_to("input")] == [200] * pieces
    body = len(b'{"data_base64":""}') + len(base64.b64encode(b"x" * PIECE))
    assert body < 256 * 1024  # the local server refuses anything larger with 413


def test_str_is_encoded_with_the_runs_encoding(client):
    proc = client.start(SANDBOX, DIGEST, stdin=cx.PIPE, encoding="latin-1")
    proc.write("caf\xe9")
    assert proc.communicate()[0] == digest(b"caf\xe9")
    proc = client.start(SANDBOX, ["cat"], stdin=cx.PIPE, encoding="ascii")
    with pytest.raises(cx.ConfigError) as caught:
        proc.write("caf\xe9")
    assert caught.value.__context__ is None
    proc.close_stdin()
    assert proc.wait().stdout == ""


# -- faults on every piece of a large write ----------------------------------------------

LARGE = 4 * PIECE + 1000  # five pieces, the last one short
PIECES = range(5)


def write_with_fault(server, piece, fault, **client_options):
    data = os.urandom(LARGE)
    session = FaultOnPiece(server, piece, fault)
    with make_client(server, session=session, **client_options) as client:
        proc = client.start(SANDBOX, DIGEST, stdin=cx.PIPE)
        error = None
        try:
            proc.write(data)
        except cx.CreateOSError as exc:
            error = exc
        received, _ = proc.communicate(timeout=30)
    return data, error, received, session.inputs


@pytest.mark.parametrize("fault", ["refused", 429])
@pytest.mark.parametrize("piece", PIECES)
def test_a_piece_that_certainly_did_not_arrive_is_sent_again_once(server, piece, fault):
    data, error, received, inputs = write_with_fault(server, piece, fault)
    assert error is None
    assert received == digest(data)  # every byte exactly once, in order
    assert inputs == len(PIECES) + 1
    again = [429] if fault == 429 else []  # a refused connection never reaches the server
    expected = [200] * piece + again + [200] * (len(PIECES) - piece)
    assert [r.status for r in server.requests_to("input")] == expected


@pytest.mark.parametrize("fault", ["lost", "timeout", 503])
@pytest.mark.parametrize("piece", PIECES)
def test_a_piece_whose_answer_is_lost_is_reported_and_never_sent_twice(server, piece, fault):
    options = {"request_timeout": 2.5} if fault == "timeout" else {}  # a loaded CI answers slowly
    data, error, received, inputs = write_with_fault(server, piece, fault, **options)
    assert isinstance(error, cx.InputUnconfirmedError), error
    assert isinstance(error, cx.TransportError) and not error.unsent
    assert error.confirmed_bytes == piece * PIECE
    assert inputs == piece + 1  # nothing after the unconfirmed piece, and not it again
    arrived = piece * PIECE if fault == 503 else min(LARGE, (piece + 1) * PIECE)
    assert received == digest(data[:arrived])


def test_a_piece_refused_until_the_policy_runs_out_was_not_sent(server):
    data = os.urandom(2 * PIECE)
    server.fail("input", 429, count=100, retry_after="0")
    with make_client(server, retry=THREE_TRIES) as client:
        proc = client.start(SANDBOX, DIGEST, stdin=cx.PIPE)
        with pytest.raises(cx.InputUnconfirmedError) as caught:
            proc.write(data)
        assert caught.value.unsent and caught.value.confirmed_bytes == 0
        server._faults.clear()
        assert proc.communicate()[0] == digest(b"")


# A bounded campaign for RELIABILITY.md (writes under faults): seeded schedules of faults on
# the requests of writes of one to four pieces, each write checked against
# what its process received.
# 30 runs of 8 drawn pieces meet every fault of INPUT_FAULTS many times over.
INPUT_RUNS = campaign_size("CREATEOS_INPUT_RUNS", 30, 100)
INPUT_FAULTS = (None, None, "refused", 429, "lost", 503)


@pytest.mark.both_readings
def test_writes_under_random_faults_arrive_once_or_are_reported(server, figures):
    rng = random.Random(20261201)
    tally = collections.Counter()
    for _ in range(INPUT_RUNS):
        data = os.urandom(rng.randint(1, 4 * PIECE))
        faults = {n: rng.choice(INPUT_FAULTS) for n in range(8)}
        faults = {n: fault for n, fault in faults.items() if fault is not None}
        session = FaultOnPiece(server, faults=faults)
        with make_client(server, session=session) as client:
            proc = client.start(SANDBOX, DIGEST, stdin=cx.PIPE)
            try:
                proc.write(data)
                possible = {len(data)}
            except cx.InputUnconfirmedError as exc:
                confirmed = exc.confirmed_bytes
                possible = {confirmed, min(len(data), confirmed + PIECE)}
                tally["unconfirmed"] += 1
            received, _ = proc.communicate(timeout=30)
        tally["faults"] += sum(1 for n in faults if n < session.inputs)
        assert received in {digest(data[:n]) for n in possible}  # a prefix, never a repeat
        tally["exact" if received == digest(data) else "prefix_reported"] += 1
    assert tally["exact"] + tally["prefix_reported"] == INPUT_RUNS
    figures.record(
        "10. input",
        runs=INPUT_RUNS,
        faults=tally["faults"],
        delivered_whole=tally["exact"],
        reported_unconfirmed=tally["unconfirmed"],
        duplicated=0,
    )


# -- a closed or ended stdin is a broken pipe ------------------------------------------


@pytest.mark.both_readings
def test_write_after_close_is_a_broken_pipe_and_close_is_idempotent(client, server):
    proc = client.start(SANDBOX, ["cat"], stdin=cx.PIPE)
    proc.write("x")
    proc.close_stdin()
    proc.close_stdin()
    assert len(server.requests_to("stdin_close")) == 1
    with pytest.raises(cx.StdinClosedError) as caught:
        proc.write("y")
    assert isinstance(caught.value, BrokenPipeError) and isinstance(caught.value, cx.CreateOSError)
    assert caught.value.process_id == proc.process_id
    assert len(server.requests_to("input")) == 1
    assert proc.wait().stdout == "x"
    proc.close_stdin()  # after the end: nothing to do


@pytest.mark.both_readings
def test_write_after_the_process_ended_is_a_broken_pipe(client, server):
    proc = client.start(SANDBOX, ["true"], stdin=cx.PIPE)
    assert server.wait_tree_gone(proc.process_id)
    with pytest.raises(cx.StdinClosedError):
        proc.write("late")  # the service answers 409
    with pytest.raises(cx.StdinClosedError):
        proc.write("later")  # known here: not asked again
    assert [r.status for r in server.requests_to("input")] == [409]
    proc.close_stdin()  # 409 (or 200 under the alternative reading): fine
    assert proc.wait().exit_code == 0
    with pytest.raises(cx.StdinClosedError):
        proc.write("after wait")
    assert len(server.requests_to("input")) == 1


@pytest.mark.both_readings
def test_communicate_writes_closes_and_waits(client, server):
    proc = client.start(SANDBOX, ["sh", "-c", "tr a-z A-Z; echo e >&2; exit 3"], stdin=cx.PIPE)
    assert proc.communicate("hello\n") == ("HELLO\n", "e\n")  # as Popen.communicate
    sent = len(server.requests)
    assert proc.wait().exit_code == 3 and len(server.requests) == sent  # at once, no request
    # A process that stopped reading ends as it ends, as with Popen.communicate().
    proc = client.start(SANDBOX, ["true"], stdin=cx.PIPE)
    proc.wait()
    assert proc.communicate(b"unread") == ("", "") and proc.returncode == 0
    # Without stdin=cx.PIPE and without input, communicate() is wait().
    assert client.start(SANDBOX, ["echo", "hi"]).communicate() == ("hi\n", "")


def test_communicate_timeout_bounds_a_write_held_up_and_sends_nothing_again(client, server):
    server.fail("input", 429, retry_after="5")
    proc = client.start(SANDBOX, DIGEST, stdin=cx.PIPE)
    began = time.monotonic()
    with pytest.raises(cx.WaitTimeout) as caught:
        proc.communicate(b"held up", timeout=1)
    assert 1 <= time.monotonic() - began < 2  # not after the Retry-After
    assert (caught.value.timeout, caught.value.process_id) == (1, proc.process_id)
    assert [r.status for r in server.requests_to("input")] == [429]
    assert server.requests_to("stdin_close") == []
    assert proc.poll() is None  # a timeout only stops waiting, as Popen.communicate's
    assert proc.communicate(timeout=30)[0] == digest(b"")


# -- refused before any request ----------------------------------------------------------


def test_misuse_is_a_config_error_before_any_request(client, server):
    no_requests_during(server, lambda: client.execute(SANDBOX, ["cat"], stdin=cx.PIPE))
    no_requests_during(server, lambda: cx.execute(SANDBOX, ["cat"], client=client, stdin=cx.PIPE))
    no_requests_during(server, lambda: client.attach(SANDBOX, "proc_x", stdin=cx.PIPE))
    plain = client.start(SANDBOX, ["cat"])
    no_requests_during(server, lambda: plain.write("x"))
    piped = client.start(SANDBOX, ["cat"], stdin=cx.PIPE)
    for bad in (123, None, ["x"]):
        no_requests_during(server, lambda bad=bad: piped.write(bad))
    piped.close_stdin()
    assert plain.wait().exit_code == piped.wait().exit_code == 0


def test_pipe_is_one_value_that_pickles_as_itself():
    assert pickle.loads(pickle.dumps(cx.PIPE)) is cx.PIPE
    assert repr(cx.PIPE) == "createos_exec.PIPE" and "PIPE" in cx.__all__


# -- wait_for_port -------------------------------------------------------------------------

LISTEN_LATER = (
    "import socket, sys, time\n"
    "time.sleep(float(sys.argv[2]))\n"
    "server = socket.socket()\n"
    "server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "server.bind(('127.0.0.1', int(sys.argv[1])))\n"
    "server.listen()\n"
    "print('listening', flush=True)\n"
    "time.sleep(60)\n"
)


def probes_all_gone(server, proc):
    others = [p for p in server.processes() if p["process_id"] != proc.process_id]
    return all(server.wait_tree_gone(p["process_id"], timeout=5) for p in others)


@pytest.mark.both_readings
@pytest.mark.parametrize("listener", ["the-process", "a-child-of-it"])
def test_wait_for_port_returns_once_the_server_listens(client, server, listener):
    port = closed_port()
    if listener == "the-process":
        proc = client.start(SANDBOX, [sys.executable, "-c", LISTEN_LATER, str(port), "1.0"])
    else:
        child = f"{shlex.quote(sys.executable)} -c {shlex.quote(LISTEN_LATER)} {port} 1.0"
        proc = client.start(SANDBOX, f"{child} & wait", shell=True)
    started = time.monotonic()
    proc.wait_for_port(port, timeout=20)
    assert 0.9 < time.monotonic() - started < 5
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    assert proc.poll() is None
    assert probes_all_gone(server, proc)
    proc.terminate()


@pytest.mark.both_readings
def test_wait_for_port_waits_for_the_process_not_another_server_on_its_port(client, server):
    # The port accepts connections from the start, but on this test's socket:
    # the process fails to bind it a second later and ends.
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        proc = client.start(SANDBOX, [sys.executable, "-c", LISTEN_LATER, str(port), "1.0"])
        with pytest.raises(cx.ProcessEndedError) as caught:
            proc.wait_for_port(port, timeout=20)
    assert "Address already in use" in caught.value.result.stderr
    assert probes_all_gone(server, proc)


@pytest.mark.both_readings
def test_wait_for_port_raises_at_once_when_the_process_ends_first(client, server):
    port = closed_port()
    proc = client.start(SANDBOX, "sleep 0.5; echo port in use >&2; exit 7", shell=True)
    started = time.monotonic()
    with pytest.raises(cx.ProcessEndedError) as caught:
        proc.wait_for_port(port, timeout=30)
    assert time.monotonic() - started < 5  # not at the timeout
    result = caught.value.result
    assert (result.exit_code, result.stderr) == (7, "port in use\n")
    assert caught.value.process_id == proc.process_id
    assert str(caught.value) == (
        f"The process exited with status 7 before port {port} accepted a connection; "
        "what it printed is in .result.stderr and .result.stdout."
    )
    assert probes_all_gone(server, proc)
    # Once the process is known to have ended, at once again.
    with pytest.raises(cx.ProcessEndedError):
        proc.wait_for_port(port, timeout=30)


@pytest.mark.both_readings
def test_wait_for_port_times_out_within_a_request_a_second(local_server):
    # Heartbeats far apart: the timeout must not wait for the next one.
    quiet = local_server(heartbeat_interval=5.0)
    with make_client(quiet) as client:
        proc = client.start(SANDBOX, ["sleep", "60"])
        before = len(quiet.requests)
        started = time.monotonic()
        port = closed_port()
        with pytest.raises(cx.WaitTimeout) as caught:
            proc.wait_for_port(port, timeout=8)
        took = time.monotonic() - started
        assert 8 <= took < 9
        assert caught.value.timeout == 8 and caught.value.process_id == proc.process_id
        assert str(caught.value) == (
            f"Port {port} did not accept a connection within 8 s; the command goes on running."
        )
        # On average at most one a second: 4 with a stream that lasts,
        # 7 when the service recycles it every 2 s.
        assert len(quiet.requests) - before <= 8
        assert proc.poll() is None  # the process runs on
        assert probes_all_gone(quiet, proc)
        proc.kill()


@pytest.mark.parametrize(
    "port, host",
    [(0, "127.0.0.1"), (70000, "127.0.0.1"), ("80", "127.0.0.1"), (True, "127.0.0.1"),
     (8.0, "127.0.0.1"), (80, ""), (80, "a/b"), (80, None)],
)  # fmt: skip
def test_wait_for_port_refuses_bad_arguments_before_any_request(client, server, port, host):
    proc = client.start(SANDBOX, ["sleep", "60"])
    no_requests_during(server, lambda: proc.wait_for_port(port, host=host))
    no_requests_during(server, lambda: proc.wait_for_port(80, timeout=0))
    proc.kill()
