"""Wire fidelity: the official CreateOS Python SDK drives the local server, unmodified.

The SDK (`createos-sandbox` on PyPI, module `createos`) is what the real
service is built to talk to: if it accepts every answer of the local server,
through every endpoint that createos_exec uses, the local server speaks the
real wire format, not a dialect of our own client. The SDK is found through
the environment variables a user sets (CREATEOS_SANDBOX_BASE_URL,
CREATEOS_API_KEY). Each test runs against both readings of docs/protocol.md §11
(the `server` fixture), so the alternative reading is proved decodable too.

The SDK needs Python 3.10+: skipped on older Pythons; on newer ones a
missing SDK is a failure in CI (support.require).

The last sections need no SDK: they drive createos_exec through the switches
of the alternative reading that its other tests do not reach on purpose
(recycled streams, an exit frame that waits for the tree, eviction met as a
cut stream, Go-style signal words).
"""

from __future__ import annotations

import os
import sys
import time

import local_server
import pytest
from support import SANDBOX, alive, make_client, require

import createos_exec as cx

# Every answer the SDK reads here is one the open questions of docs/protocol.md §11
# shape: each test reads both readings' answers.
pytestmark = pytest.mark.both_readings

SDK_PYTHON = (3, 10)  # createos-sandbox 0.1.3: Requires-Python >=3.10


@pytest.fixture
def sdk():
    if sys.version_info < SDK_PYTHON:
        pytest.skip("the createos-sandbox SDK needs Python 3.10 or newer")
    module = require("createos")
    assert hasattr(module, "SandboxInstance"), "`createos` is not the createos-sandbox SDK"
    return module


@pytest.fixture
def sdk_client(sdk, server, monkeypatch):
    """An SDK client configured only by the environment, as a user would."""
    monkeypatch.setenv("CREATEOS_SANDBOX_BASE_URL", server.url)
    monkeypatch.setenv("CREATEOS_API_KEY", server.api_key)
    with sdk.Client() as client:
        yield client


@pytest.fixture
def sandbox(sdk_client):
    return sdk_client.get_sandbox(SANDBOX)


def follow(sdk, sandbox, process_id, after=0):
    """Connect and read to the exit event; (data events, exit event).

    Like any SDK user, resume with after_sequence when a stream ends without
    an exit event (the alternative reading recycles streams).
    """
    kinds = sdk.ManagedProcessConnectEventType
    data = []
    for _ in range(20):
        options = sdk.ManagedProcessConnectOptions(after_sequence=after)
        with sandbox.processes.connect(process_id, options) as stream:
            for event in stream:
                if event.type == kinds.DATA:
                    data.append(event)
                    after = event.sequence
                elif event.type == kinds.EXIT:
                    return data, event
                else:
                    assert event.type == kinds.HEARTBEAT, event
    raise AssertionError("no exit event after 20 connects")


def joined(events, stream):
    return b"".join(event.data for event in events if event.stream == stream)


def listed(sdk, sandbox, server):
    """Process ids of the listing, as the SDK reads them.

    ``processes.list()`` of SDK 0.1.3 reads only the unpaginated form
    (``data.processes``): on the alternative reading's paginated form it finds
    nothing. That form is the one of the SDK's other listings (templates,
    networks, disks), so the SDK's own page-following reader of those proves
    it decodable.
    """
    if server.reading.listing == "unpaginated":
        return [p.process_id for p in sandbox.processes.list()]
    assert sandbox.processes.list() == []
    fetch_all = sdk.services._fetch_all
    path = sandbox.processes._path()
    pages = fetch_all(sandbox._transport, path, sdk.ManagedProcess, sdk.PaginationOptions())
    return [p.process_id for p in pages]


def wait_for_tree(sdk, processes, process_id):
    """The record once the whole tree is gone, 5 s at most."""
    options = sdk.ManagedProcessWaitOptions(
        scope=sdk.ManagedProcessWaitScope.TREE, wait_timeout=5.0
    )
    return processes.wait(process_id, options)


def signal_spelling(server, name, go_word):
    """(exit_code, signal) of a death by `name` as this reading spells it."""
    spelled = go_word if server.reading.signal_spelling == "go" else name
    return server.reading.signal_exit_code, spelled


def test_the_sdk_reads_the_sandbox(sdk, sandbox, server):
    assert sandbox.id == SANDBOX
    assert sandbox.status == sdk.SandboxStatus.RUNNING
    with sdk.Client() as configured:  # the documented override is honoured
        assert configured.base_url == server.url


def test_create_input_close_connect_list_get_and_wait(sdk, sandbox, server):
    processes = sandbox.processes
    created = processes.create(
        sdk.ManagedProcessCreateRequest(
            command="sh",
            arguments=["-c", 'read x; echo "got $x"; wc -c; sleep 0.2; echo err >&2'],
        )
    )
    process_id = created.process_id
    assert process_id.startswith("proc_") and len(process_id) >= 21
    assert created.kind == sdk.ManagedProcessKind.PROCESS
    assert created.pid > 0 and created.created_at is not None
    assert created.command == "sh" and created.arguments[0] == "-c"
    assert not created.tree_exited

    first = processes.input(process_id, "hello\n")
    second = processes.input_bytes(process_id, b"more\n")
    assert 0 <= first < second
    processes.close_standard_input(process_id)  # `wc -c` ends only at EOF
    if not server.reading.stdin_close_idempotent:
        with pytest.raises(sdk.APIError) as caught:
            processes.close_standard_input(process_id)
        assert caught.value.status_code == 409
    else:
        processes.close_standard_input(process_id)  # idempotent

    events, exit_event = follow(sdk, sandbox, process_id)
    assert joined(events, sdk.ManagedProcessStream.STDOUT) == b"got hello\n5\n"
    assert joined(events, sdk.ManagedProcessStream.STDERR) == b"err\n"
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert (exit_event.exit_code, exit_event.signal) == (0, None)
    newest = events[-1].sequence
    # The exit frame's seq is an open question (§11.8): absent, or the next one.
    expected_seq = newest + 1 if server.reading.exit_frame_seq else 0
    assert exit_event.sequence == expected_seq

    # A later connect replays from `after`: only the newer frames, then the exit.
    tail, again = follow(sdk, sandbox, process_id, after=newest - 1)
    assert [e.sequence for e in tail] == [newest] and again.exit_code == 0

    assert process_id in listed(sdk, sandbox, server)
    record = processes.get(process_id)
    assert record.process_id == process_id
    assert record.state == sdk.ManagedProcessState.EXITED
    assert record.leader_exited and record.exit_code == 0 and record.signal is None
    assert record.finished_at is not None and record.finished_at >= record.created_at
    assert record.output.newest_sequence == newest and record.output.oldest_sequence == 1

    waited = wait_for_tree(sdk, processes, process_id)
    assert waited.tree_exited and waited.exit_code == 0


def test_the_listing_holds_every_process_in_creation_order(sdk, sandbox, server, monkeypatch):
    monkeypatch.setattr(local_server, "LIST_LIMIT_MAX", 2)  # the SDK asks for 500 a page
    create = sdk.ManagedProcessCreateRequest(command="sleep", arguments=["30"])
    created = [sandbox.processes.create(create).process_id for _ in range(5)]
    assert listed(sdk, sandbox, server) == created
    pages = [r.query for r in server.requests_to("list")]
    if server.reading.listing == "paginated":  # list() once, then three pages of two
        assert [q.get("offset") for q in pages] == [None, "0", "2", "4"]
        assert {q.get("limit") for q in pages[1:]} == {"500"}


def test_the_sdks_defaults_are_served(sdk, sandbox, server):
    processes = sandbox.processes
    process_id = processes.create(
        sdk.ManagedProcessCreateRequest(
            command="sh", arguments=["-c", "echo hi; sleep 1 >/dev/null 2>&1 &"]
        )
    ).process_id
    record = processes.wait(process_id)  # no scope, no timeout: the leader, 30 s at most
    assert record.leader_exited and not record.tree_exited and record.exit_code == 0
    assert server.requests_to("wait")[-1].query == {}
    with processes.connect(process_id) as stream:  # no options
        data = [e for e in stream if e.type == sdk.ManagedProcessConnectEventType.DATA]
    # From the start. The alternative reading journals each pipe's EOF as an
    # empty frame: a busy machine may read stderr's before stdout's "hi".
    assert data[0].sequence == 1 and b"".join(e.data for e in data) == b"hi\n"
    # The SDK always sends `after` (0 by default); the server would default it too.
    assert server.requests_to("connect")[-1].query == {"after": "0"}
    assert server.wait_tree_gone(process_id)


def test_signal_then_wait_for_the_tree(sdk, sandbox, server):
    processes = sandbox.processes
    process_id = processes.create(
        sdk.ManagedProcessCreateRequest(command="sleep", arguments=["30"])
    ).process_id
    before = processes.get(process_id)
    assert before.state == sdk.ManagedProcessState.RUNNING and not before.leader_exited
    assert before.exit_code is None and before.signal is None and before.finished_at is None

    processes.signal(process_id, sdk.ManagedProcessSignal.TERMINATE)
    record = wait_for_tree(sdk, processes, process_id)
    expected = signal_spelling(server, "SIGTERM", "terminated")
    assert record.leader_exited and record.tree_exited
    assert (record.exit_code, record.signal) == expected
    events, exit_event = follow(sdk, sandbox, process_id)
    assert b"".join(e.data for e in events) == b""
    assert (exit_event.exit_code, exit_event.signal) == expected


def test_a_sigterm_reaches_the_background_child_too(sdk, sandbox, server):
    processes = sandbox.processes
    process_id = processes.create(
        sdk.ManagedProcessCreateRequest(command="sh", arguments=["-c", "sleep 30 & echo $!; wait"])
    ).process_id
    with processes.connect(process_id) as stream:  # the SDK's default `after`
        child = next(
            int(e.data) for e in stream if e.type == sdk.ManagedProcessConnectEventType.DATA
        )
    assert alive(child)

    processes.signal(process_id, sdk.ManagedProcessSignal.TERMINATE)
    if server.reading.signal_target == "group":  # the child is not spared
        record = wait_for_tree(sdk, processes, process_id)
        assert record.tree_exited and record.signal == "SIGTERM"
        assert not alive(child)
    else:  # the leader alone: its child lives on until DELETE
        record = processes.wait(process_id)  # the default scope is the leader
        assert record.leader_exited and not record.tree_exited
        assert (record.exit_code, record.signal) == (-1, "terminated")
        assert alive(child)
        assert processes.delete(process_id).tree_exited
        assert not alive(child)


def test_delete_terminates_the_tree_with_sigterm_first(sdk, sandbox, server):
    processes = sandbox.processes
    script = 'trap "echo bye; exit 3" TERM; echo ready; while :; do sleep 0.05; done'
    process_id = processes.create(
        sdk.ManagedProcessCreateRequest(command="sh", arguments=["-c", script])
    ).process_id
    deadline = time.monotonic() + 10
    while processes.get(process_id).output.newest_sequence < 1:  # the trap is set
        assert time.monotonic() < deadline
        time.sleep(0.02)

    record = processes.delete(process_id, sdk.ManagedProcessDeleteOptions(grace_period=2.0))
    assert record.tree_exited and record.leader_exited
    assert (record.exit_code, record.signal) == (3, None)
    assert not server.tree_alive(process_id)
    if not server.reading.delete_forgets:  # the record is kept, DELETE is repeatable
        again = processes.delete(process_id, sdk.ManagedProcessDeleteOptions(grace_period=1.0))
        assert again.tree_exited and again.exit_code == 3
        events, _ = follow(sdk, sandbox, process_id)
        assert joined(events, sdk.ManagedProcessStream.STDOUT) == b"ready\nbye\n"
    else:  # a deleted process is forgotten
        for call in (processes.get, processes.delete):
            with pytest.raises(sdk.APIError) as caught:
                call(process_id)
            assert caught.value.status_code == 404
        assert process_id not in listed(sdk, sandbox, server)


def test_eviction_of_finished_output_is_a_410(sdk, sandbox, server):
    processes = sandbox.processes
    process_id = processes.create(
        sdk.ManagedProcessCreateRequest(command="sh", arguments=["-c", "echo a; echo b"])
    ).process_id
    wait_for_tree(sdk, processes, process_id)
    newest = processes.get(process_id).output.newest_sequence
    server.evict(process_id)
    with pytest.raises(sdk.APIError) as caught:
        processes.connect(process_id)  # the SDK's default `after` (0)
    assert caught.value.status_code == 410
    if server.reading.expired_410_body == "map":  # a string map naming the restart point
        assert "output_offset_expired" in str(caught.value)
        assert "oldest_available_seq: %d" % (newest + 1) in str(caught.value)
    else:  # a plain string, no restart point
        assert "output offset expired" in str(caught.value)
        assert "oldest_available_seq" not in str(caught.value)


def test_eviction_of_live_output_is_a_410_or_an_error_event(sdk, sandbox, server):
    processes = sandbox.processes
    process_id = processes.create(
        sdk.ManagedProcessCreateRequest(command="sh", arguments=["-c", "echo a; sleep 30"])
    ).process_id
    deadline = time.monotonic() + 10
    while processes.get(process_id).output.newest_sequence < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    server.evict(process_id)
    if server.reading.expired_410 == "always":
        with pytest.raises(sdk.APIError) as caught:
            processes.connect(process_id)
        assert caught.value.status_code == 410
    else:
        with processes.connect(process_id) as stream:
            events = [e for e in stream if e.type != sdk.ManagedProcessConnectEventType.HEARTBEAT]
        (error,) = events
        assert error.type == sdk.ManagedProcessConnectEventType.ERROR
        assert error.error_message == "output_offset_expired"
        assert error.oldest_available_sequence == 2
    processes.delete(process_id)


def test_strict_mode_refuses_only_the_sdks_body_less_post(sdk, local_server, monkeypatch):
    strict = local_server(strict=True)
    monkeypatch.setenv("CREATEOS_SANDBOX_BASE_URL", strict.url)
    monkeypatch.setenv("CREATEOS_API_KEY", strict.api_key)
    with sdk.Client() as client:
        processes = client.get_sandbox(SANDBOX).processes
        process_id = processes.create(
            sdk.ManagedProcessCreateRequest(command="sleep", arguments=["30"])
        ).process_id
        processes.input(process_id, "x")
        # httpx sends Content-Length: 0 and no Content-Type on a POST without
        # a body, which strict mode refuses as the vendor forwarder would.
        with pytest.raises(sdk.APIError) as caught:
            processes.close_standard_input(process_id)
        assert caught.value.status_code == 400 and "application/json" in str(caught.value)
        processes.signal(process_id, sdk.ManagedProcessSignal.KILL)
        assert processes.wait(process_id).leader_exited
        sandbox = client.get_sandbox(SANDBOX)
        path = os.path.join(strict.process(process_id)["cwd"], "blob")
        sandbox.files.upload(path, b"raw")  # a PUT: not a JSON POST
    assert [r.status for r in strict.requests_to("stdin_close")] == [400]
    posts = [r.status for r in strict.requests if r.method == "POST"]
    assert posts[0] in (200, 201) and posts[1:] == [200, 400, 200]  # create, input, …


def test_files_upload_then_download_the_same_bytes(sdk, sandbox, server, tmp_path):
    payload = bytes(range(256)) * 257  # every byte value, not a multiple of any block
    path = str(tmp_path / "blob.bin")
    sandbox.files.upload(path, payload)
    with sandbox.files.download(path) as download:
        assert download.read() == payload
    assert (tmp_path / "blob.bin").read_bytes() == payload
    with pytest.raises(sdk.APIError) as caught:
        sandbox.files.download(str(tmp_path / "missing"))
    assert caught.value.status_code == 404
    nested = str(tmp_path / "new" / "blob.bin")  # are missing parents created? (§11.16)
    if server.reading.upload_creates_parents:
        sandbox.files.upload(nested, b"x")
        assert (tmp_path / "new" / "blob.bin").read_bytes() == b"x"
    else:
        with pytest.raises(sdk.APIError) as caught:
            sandbox.files.upload(nested, b"x")
        assert caught.value.status_code == 404 and not (tmp_path / "new").exists()


def test_errors_are_jsend_the_sdk_understands(sdk, sandbox, server):
    with pytest.raises(sdk.APIError) as caught:
        sandbox.processes.get("proc_" + "x" * 22)
    assert caught.value.status_code == 404 and "not found" in str(caught.value)
    assert caught.value.request_id  # X-Request-ID reaches the SDK's error
    with sdk.Client(api_key="wrong", base_url=server.url) as stranger:
        with pytest.raises(sdk.APIError) as caught:
            stranger.get_sandbox(SANDBOX).processes.list()
    assert caught.value.status_code == 401


def test_sdk_and_createos_exec_follow_each_others_processes(sdk, sandbox, server):
    argv = ["sh", "-c", "echo from-sdk; echo to-err >&2; exit 5"]
    started = sandbox.processes.create(
        sdk.ManagedProcessCreateRequest(command=argv[0], arguments=argv[1:])
    )
    with make_client(server) as client:
        attached = client.attach(SANDBOX, started.process_id)
        assert attached.args == argv  # as the record lists it: not one of ours
        assert (attached.stdout, attached.stderr) == ("from-sdk\n", "to-err\n")
        assert attached.exit_code == 5
        result = client.execute(SANDBOX, ["echo", "from-cx"])
    record = sandbox.processes.get(result.process_id)
    assert record.command == "bash" and record.exit_code == 0
    events, exit_event = follow(sdk, sandbox, result.process_id)
    assert b"".join(e.data for e in events) == b"from-cx\n" and exit_event.exit_code == 0


def test_the_sdk_and_createos_exec_write_to_one_stdin(sdk, sandbox, server):
    piece = bytes(range(256)) * (cx._INPUT_PIECE // 256)  # as large as createos_exec sends
    with make_client(server) as client:
        proc = client.start(SANDBOX, ["cat"], stdin=cx.PIPE, encoding="latin-1")
        first = sandbox.processes.input_bytes(proc.process_id, piece)
        proc.write(b"\x00 from cx ")
        second = sandbox.processes.input(proc.process_id, "from sdk")
        assert 0 <= first < second
        sandbox.processes.close_standard_input(proc.process_id)
        with pytest.raises(cx.StdinClosedError):  # closed by the SDK: the service says 409
            proc.write("late")
        result = proc.wait()
    assert result.stdout.encode("latin-1") == piece + b"\x00 from cx from sdk"
    with pytest.raises(sdk.APIError) as caught:
        sandbox.processes.input(proc.process_id, "after the end")
    assert caught.value.status_code == 409
