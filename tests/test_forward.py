"""Port forwarding (design item 20, protocol §7b): forward() and --forward
against the local server, whose tunnels lead to 127.0.0.1 of this machine."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import threading

import pytest
from support import assert_clean, cli_argv, cli_env, closed_port

import createos_exec as cx


@pytest.fixture(params=["splice", "selector"])
def moved_by(request, monkeypatch):
    """Each way a forward moves bytes: splice() where the platform has it (Linux,
    Python 3.10 and later, a plain tunnel), the selector of TLS and of the others."""
    if request.param == "selector":
        monkeypatch.setattr(cx, "_SPLICE", None)
    elif cx._SPLICE is None:
        pytest.skip("os.splice is not here")
    return request.param


def reverser() -> int:
    """A server that reads each connection to its end, then answers it reversed:
    an answer comes only once the end (a half-close) has been passed on."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)

    def answer(connection: socket.socket) -> None:
        with connection:
            connection.sendall(received(connection)[::-1])

    def serve() -> None:
        while True:
            connection, _ = listener.accept()
            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1])


def received(connection: socket.socket) -> bytes:
    pieces = []
    while True:
        piece = connection.recv(1 << 16)
        if not piece:
            return b"".join(pieces)
        pieces.append(piece)


def round_trip(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(data)
        connection.shutdown(socket.SHUT_WR)
        return received(connection)


def greeted(fw: cx.Forward, target: socket.socket) -> "tuple[socket.socket, socket.socket]":
    """A connection through `fw` that `target` (where it leads) accepted and greeted,
    and its far end: its tunnel is open and its bytes move."""
    connection = socket.create_connection(("127.0.0.1", fw.local_port), timeout=30)
    far, _ = target.accept()
    far.sendall(b"!")
    assert connection.recv(1) == b"!"
    return connection, far


def answer_or_nothing(port: int, data: bytes) -> bytes:
    """round_trip's answer, or b"" for a connection the forward closed before it
    was written to, half-closed or read: a reset, ENOTCONN and EPIPE all say "closed"."""
    try:
        return round_trip(port, data)
    except OSError as error:
        if error.errno in (errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE):
            return b""
        raise


def test_concurrent_connections_are_byte_exact_both_ways_with_the_half_close_passed_on(
    client, server, moved_by
):
    payloads = [os.urandom(size) for size in (1, 70_000, 1 << 20, 3 << 20)]
    answers = {}
    with client.forward("sb_local", reverser()) as fw:
        assert fw.url == f"http://127.0.0.1:{fw.local_port}/" and fw.address in fw.url

        def fetch(index: int) -> None:
            answers[index] = round_trip(fw.local_port, payloads[index])

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(len(payloads))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert fw.failures == 0
    assert answers == {i: data[::-1] for i, data in enumerate(payloads)}
    tunnels = server.requests_to("tunnel")
    assert [r.status for r in tunnels] == [101] * (1 + len(payloads))  # the entry's, then one each
    assert {r.credentials for r in tunnels} == {("X-Api-Key",)}
    with pytest.raises(ConnectionRefusedError):  # closed: nothing listens any more
        socket.create_connection(("127.0.0.1", fw.local_port), timeout=5)


def test_close_ends_the_connections_still_open(client, moved_by):
    target = socket.create_server(("127.0.0.1", 0))
    with target, client.forward("sb_local", target.getsockname()[1]) as fw:
        target.accept()[0].close()  # the entry's check
        idle, far = greeted(fw, target)
    with idle, far:
        assert idle.recv(1) == b""  # its end, though the far end is still open


def test_a_tunnel_cut_midway_closes_its_connection_alone_counted_and_warned(
    client, server, moved_by, caplog
):
    target = socket.create_server(("127.0.0.1", 0))
    with target, client.forward("sb_local", target.getsockname()[1]) as fw:
        target.accept()[0].close()
        cut, far = greeted(fw, target)
        with cut, far, caplog.at_level(logging.WARNING, logger="createos_exec"):
            server.outage(0.1).join()  # its tunnel cut, the API back
            with pytest.raises(ConnectionError):  # the forward closed it: its tunnel takes no bytes
                while True:
                    cut.sendall(bytes(1 << 16))
        for end in greeted(fw, target):  # the next one goes through
            end.close()
        assert fw.failures == 1
    assert "tunnel broke" in caplog.text and "sb_local" in caplog.text
    assert server.api_key not in caplog.text


@pytest.mark.parametrize("state", ["closed port", "paused", "gone"])
def test_a_refusal_at_entry_is_a_typed_error_naming_the_sandbox_and_the_port(client, server, state):
    port = closed_port() if state == "closed port" else reverser()
    if state == "paused":
        server.pause("sb_local")
    sandbox = "sb_nowhere" if state == "gone" else "sb_local"
    expected = {"closed port": cx.APIError, "paused": cx.SandboxPausedError}
    with pytest.raises(expected.get(state, cx.SandboxGoneError)) as raised:
        client.forward(sandbox, port, local_port=0)
    message = str(raised.value)
    assert sandbox in message and f"port {port}" in message
    assert ("nothing listens" in message) == (state == "closed port")
    assert ("resume it" in message) == (state == "paused")
    assert_clean(raised.value, server.api_key)


def test_a_connection_whose_tunnel_is_refused_later_is_closed_counted_and_warned(
    client, server, caplog
):
    with client.forward("sb_local", reverser()) as fw:
        server.fail("tunnel", 503)
        with caplog.at_level(logging.WARNING, logger="createos_exec"):
            assert answer_or_nothing(fw.local_port, b"lost") == b""  # closed, nothing through
        assert round_trip(fw.local_port, b"next") == b"txen"  # the others go on
        assert fw.failures == 1
    assert "port" in caplog.text and "sb_local" in caplog.text and "503" in caplog.text
    assert server.api_key not in caplog.text


@pytest.mark.parametrize(
    "spec, parsed",
    [
        ("8080:80", ("127.0.0.1", 8080, 80)),
        ("0.0.0.0:0:5432", ("0.0.0.0", 0, 5432)),
        ("[::1]:8080:80", ("::1", 8080, 80)),
        ("*:8080:80", ("0.0.0.0", 8080, 80)),
        ("80", None),
        ("8080:0", None),
        ("70000:80", None),
        ("host:a:80", None),
    ],
)
def test_cli_forward_specs(spec, parsed, capsys):
    if parsed is not None:
        assert tuple(cx._forward_option(spec)) == parsed
        return
    with pytest.raises(SystemExit) as exited:
        cx.main(["--forward", spec, "sb_local"])
    assert exited.value.code == 2 and "--forward" in capsys.readouterr().err


def test_cli_forward_serves_until_ctrl_c(server):
    cli = subprocess.Popen(
        cli_argv("--forward", f"0:{reverser()}", "sb_local"),
        env=cli_env(server),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = cli.stderr.readline()  # where it listens
        assert "forwarding 127.0.0.1:" in line and "sb_local" in line, line
        port = int(line.split("127.0.0.1:")[1].split()[0])
        assert round_trip(port, b"through the tunnel") == b"lennut eht hguorht"
        cli.send_signal(signal.SIGINT)
        assert cli.wait(timeout=30) == 130
    finally:
        cli.kill()
        cli.stderr.close()
