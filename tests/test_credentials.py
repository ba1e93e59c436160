"""Every request carries exactly one credential, X-Api-Key (protocol.md §1).

The service reads Authorization, X-Auth-Token and X-Access-Token before
X-Api-Key, so one sent by accident decides whose call it is; the local
server answers such a request 401, as that other identity would be refused.
`requests` adds Authorization: Basic on its own from a ~/.netrc entry, and a
caller's session may carry any of them. Proxies and the other settings
`requests` reads from the environment keep working.
"""

from __future__ import annotations

import pytest
import requests
from support import KEY, SANDBOX, Listener, make_client

import createos_exec as cx

NETRC_PASSWORD = "netrc-password-never-sent"
OTHER_CREDENTIALS = {
    "Authorization": "Bearer someone-else",
    "X-Auth-Token": "session-of-someone-else",
    "X-Access-Token": "oauth-of-someone-else",
}


def credentials_seen(server):
    return {record.credentials for record in server.requests}


@pytest.fixture
def netrc_everywhere(tmp_path, monkeypatch):
    """A real .netrc with a `default` entry: it applies to every host."""
    netrc = tmp_path / ".netrc"
    netrc.write_text(f"default login someone password {NETRC_PASSWORD}\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(netrc))
    # The premise: requests itself would send the entry to the API.
    assert requests.utils.get_netrc_auth("http://127.0.0.1:1/v1") == ("someone", NETRC_PASSWORD)
    return netrc


def test_a_netrc_entry_never_reaches_createos(server, netrc_everywhere):
    with make_client(server) as client:
        result = client.execute(SANDBOX, "echo fine", shell=True, env={"A": "1"}, stdin="in")
    assert result.exit_code == 0 and result.stdout == "fine\n"
    assert credentials_seen(server) == {("X-Api-Key",)}


@pytest.mark.parametrize("header", sorted(OTHER_CREDENTIALS))
def test_a_sessions_other_credential_headers_are_not_sent(server, header):
    session = requests.Session()
    session.headers[header] = OTHER_CREDENTIALS[header]
    with make_client(server, session=session) as client:
        result = client.execute(SANDBOX, ["echo", "fine"])
    assert result.stdout == "fine\n"
    assert credentials_seen(server) == {("X-Api-Key",)}
    assert session.headers[header] == OTHER_CREDENTIALS[header]  # the caller's session is intact


def test_a_sessions_own_auth_is_not_used(server):
    session = requests.Session()
    session.auth = ("someone", "else")
    with make_client(server, session=session) as client:
        assert client.execute(SANDBOX, ["true"]).exit_code == 0
    assert credentials_seen(server) == {("X-Api-Key",)}


def test_a_session_with_every_header_still_sends_the_key_only(server):
    session = requests.Session()
    session.headers.update(OTHER_CREDENTIALS)
    session.headers["X-Api-Key"] = "a-stale-key"
    with make_client(server, session=session) as client:
        assert client.execute(SANDBOX, ["true"]).exit_code == 0
    assert credentials_seen(server) == {("X-Api-Key",)}


class RefusingProxy(Listener):
    """A forward proxy on loopback that answers 403 to every request it gets."""

    def __init__(self):
        self.requests = []
        super().__init__(self._refuse)

    def _refuse(self, connection):
        with connection:
            head = b""
            while b"\r\n\r\n" not in head:
                piece = connection.recv(65536)
                if not piece:
                    break
                head += piece
            self.requests.append(head.split(b"\r\n", 1)[0].decode("latin-1"))
            connection.sendall(
                b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )


def test_proxies_from_the_environment_are_still_used(server, monkeypatch):
    proxy = RefusingProxy()
    try:
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("http_proxy", proxy.url)
        with make_client(server) as client, pytest.raises(cx.APIError) as caught:
            client.execute(SANDBOX, ["true"])
        assert caught.value.status == 403 and caught.value.operation == "process creation"
        # The request went to the proxy, as an absolute URL of the API.
        assert proxy.requests and proxy.requests[0].startswith("POST " + server.url + "/v1/")
        assert server.requests == []
    finally:
        proxy.close()


def test_the_key_is_not_in_the_credential_objects_repr():
    client = make_client()
    assert KEY not in repr(client._transport._auth)
    assert KEY not in repr(client)


def test_the_client_passes_the_strict_control_forwarder():
    """Under strict mode every POST needs a Content-Length and a JSON Content-Type
    (the vendor's control forwarder answers 411 or 400 otherwise)."""
    from local_server import LocalServer

    with LocalServer(strict=True, heartbeat_interval=0.5) as strict:
        with make_client(strict) as client:
            done = client.execute(SANDBOX, "cat; echo $A", shell=True, env={"A": "1"}, stdin="x")
            late = client.execute(SANDBOX, ["sleep", "30"], timeout=0.3)
            strict.lose_create_response()
            found = client.execute(SANDBOX, ["echo", "found"])
        assert done.stdout == "x1\n" and late.timed_out and found.creation_recovered
        statuses = {(record.method, record.status) for record in strict.requests}
        assert all(status < 400 for _, status in statuses), statuses
        assert ("POST", 200) in statuses
