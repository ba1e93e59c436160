"""Each message says what happened, to what, and what to do: its essential parts pinned.

Not the whole wording: the command's program, the seconds, the host and
port, the option, the variable to set. Against the local server where the
message comes from a real run, with canned answers where one is enough.
"""

from __future__ import annotations

import pickle
import socket
import time

import pytest
import requests
import responses
import urllib3
from support import (
    KEY,
    NO_RETRY,
    PROCS,
    SANDBOX,
    SB,
    TWO_TRIES,
    assert_clean,
    closed_port,
    make_client,
)

import createos_exec as cx


def result_of(**fields):
    values = dict(args=["make", "--token", "s3cret"], exit_code=2, signal=None, timed_out=False)
    values.update(stdout="", stderr="", process_id="proc_1")
    values.update(fields)
    return cx.ExecResult(**values)


# -- CommandError: the program, the process, the seconds, where the output is ---


def test_a_failed_command_names_its_program_and_process_and_points_at_stderr(client):
    with pytest.raises(cx.CommandError) as raised:
        client.execute(SANDBOX, ["sh", "-c", "echo oops >&2; exit 3"], check=True)
    message = str(raised.value)
    assert "'sh'" in message and f"(process {raised.value.process_id})" in message
    assert "exited with status 3" in message and ".stderr" in message
    assert "oops" not in message  # output stays out of messages
    assert raised.value.stderr == "oops\n"


def test_a_failed_shell_script_is_named_by_its_script(client):
    with pytest.raises(cx.CommandError) as raised:
        client.execute(SANDBOX, "exit 4", shell=True, check=True)
    assert "'exit 4'" in str(raised.value) and "status 4" in str(raised.value)


def test_a_timed_out_command_says_after_how_many_seconds(client):
    with pytest.raises(cx.CommandError) as raised:
        client.execute(SANDBOX, ["sleep", "30"], timeout=0.5, check=True)
    message = str(raised.value)
    assert "'sleep'" in message and "timed out after 0.5 s" in message
    assert "terminated" in message
    assert raised.value.timeout == 0.5
    again = pickle.loads(pickle.dumps(raised.value))
    assert (str(again), again.timeout) == (message, 0.5)


def test_a_killed_command_names_the_signal(client):
    with pytest.raises(cx.CommandError) as raised:
        client.execute(SANDBOX, "kill -KILL $$", shell=True, check=True)
    assert "'kill -KILL $$'" in str(raised.value) and "killed by SIGKILL" in str(raised.value)


def test_only_the_program_is_named_never_the_other_arguments():
    message = str(cx.CommandError(result_of()))
    assert "'make'" in message and "s3cret" not in message and "--token" not in message
    assert "(process proc_1)" in message


def test_a_long_script_is_cut_and_an_unknown_command_is_not_named():
    script = "echo start; " + "x" * 500
    long = str(cx.CommandError(result_of(args=script)))
    assert "'echo start; " in long and "x" * 100 not in long
    followed = str(cx.CommandError(result_of(args=None, process_id=None)))
    assert followed.startswith("The command exited with status 2;")


def test_check_returncode_of_a_timed_out_result_still_says_it_timed_out():
    with pytest.raises(cx.CommandError) as raised:
        result_of(exit_code=None, timed_out=True).check_returncode()
    assert "timed out and its remote process tree was terminated" in str(raised.value)
    assert raised.value.timeout is None


# -- the wrapper: a string is one program name --------------------------------


def test_a_command_line_given_as_one_string_says_how_to_give_it(client):
    result = client.execute(SANDBOX, "echo hi")
    assert result.exit_code == 127
    assert "echo hi: command not found" in result.stderr
    assert "ONE program name" in result.stderr
    assert "list of arguments" in result.stderr and "shell=True" in result.stderr
    with_path = client.execute(SANDBOX, "ls /tmp")
    assert with_path.exit_code == 127
    assert "ls /tmp: No such file or directory" in with_path.stderr
    assert "ONE program name" in with_path.stderr


def test_a_missing_program_without_blanks_reads_as_the_shells(client):
    result = client.execute(SANDBOX, "no-such-program-x")
    assert result.stderr == "createos_exec: no-such-program-x: command not found\n"


# -- local errors: nothing is sent ---------------------------------------------


@pytest.fixture
def nothing_sent(rsps):
    yield make_client()  # nothing is canned: any request would fail the test
    assert len(rsps.calls) == 0


def test_encoding_none_says_output_is_always_text(nothing_sent):
    with pytest.raises(cx.ConfigError) as raised:
        nothing_sent.execute(SB, ["cat"], encoding=None)
    message = str(raised.value)
    assert "encoding=None" in message and "always text" in message
    assert 'errors="surrogateescape"' in message


def test_an_unknown_codec_or_handler_is_named(nothing_sent):
    with pytest.raises(cx.ConfigError, match="'utf-9'"):
        nothing_sent.execute(SB, ["cat"], encoding="utf-9")
    with pytest.raises(cx.ConfigError) as raised:
        nothing_sent.execute(SB, ["cat"], errors="bogus")
    assert "'bogus'" in str(raised.value) and "surrogateescape" in str(raised.value)


def test_invalid_arguments_are_named(nothing_sent):
    with pytest.raises(cx.ConfigError, match="'1A'"):
        nothing_sent.execute(SB, ["true"], env={"1A": "x"})
    with pytest.raises(cx.ConfigError, match="'sb/x'"):
        nothing_sent.execute("sb/x", ["true"])
    with pytest.raises(cx.ConfigError, match="timeout must be a positive number.* -1"):
        nothing_sent.execute(SB, ["true"], timeout=-1)
    with pytest.raises(cx.ConfigError, match="at least the program"):
        nothing_sent.execute(SB, [])


def test_an_api_key_with_a_newline_says_so():
    with pytest.raises(cx.ConfigError, match="newline") as raised:
        make_client(api_key=KEY + "\n")
    assert_clean(raised.value)


def test_an_unknown_signal_is_refused_before_any_request(client, server):
    with client.start(SANDBOX, ["sleep", "30"]) as process:
        for bad in ("SIGFOO", "FOO", "sigint", 10**6):
            with pytest.raises(cx.ConfigError) as raised:
                process.send_signal(bad)
            assert repr(bad) in str(raised.value) and "kill -l" in str(raised.value)
        assert server.requests_to("signal") == []


def test_a_signal_is_taken_as_kill_takes_it(client, server, tmp_path):
    assert cx._signal_name("USR1") == cx._signal_name("SIGUSR1") == "SIGUSR1"
    trapped = tmp_path / "trapped"  # the local server runs commands on this machine
    script = f"trap 'echo got USR1; exit 0' USR1; touch '{trapped}'; while :; do sleep 0.05; done"
    with client.start(SANDBOX, script, shell=True, timeout=20) as process:
        for _ in range(400):
            if trapped.exists():
                break
            time.sleep(0.025)
        process.send_signal("USR1")
        result = process.wait()
    assert result.exit_code == 0 and "got USR1" in result.stdout
    assert [sent.status for sent in server.requests_to("signal")] == [200]


# -- TransportError: host and port, the kind of failure, no process ------------


def test_a_refused_connection_names_host_port_and_says_no_process_started():
    port = closed_port()
    with make_client(api_url=f"http://127.0.0.1:{port}", retry=TWO_TRIES) as client:
        with pytest.raises(cx.TransportError) as raised:
            client.execute(SB, ["true"])
    error = raised.value
    assert (error.address, error.reason, error.operation) == (
        f"127.0.0.1:{port}",
        "refused",
        "process creation",
    )
    message = str(error)
    assert f"127.0.0.1:{port}" in message and "refused" in message
    assert "No process was started" in message
    assert "/v1" not in message and SB not in message  # never requests' text with URLs
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.address, again.reason) == (message, error.address, "refused")


def below(exc, *causes):
    """`exc` with `causes` chained under it as urllib3 chains them (`raise ... from`)."""
    inner = exc
    for cause in causes:
        inner.__cause__ = cause
        inner = cause
    return exc


def not_connected(*causes):
    """What requests raises when no connection could be made, as urllib3 chains it."""
    reason = below(urllib3.exceptions.NewConnectionError(None, "x"), *causes)
    return requests.exceptions.ConnectionError(urllib3.exceptions.MaxRetryError(None, "/", reason))


@pytest.mark.parametrize(
    "failure, reason, words",
    [
        (not_connected(), None, "the connection failed"),
        (not_connected(socket.gaierror(-2, "Name or service not known")), "dns", "DNS"),
        (not_connected(ConnectionRefusedError(111, "x")), "refused", "refused"),
        (requests.exceptions.ConnectTimeout("x"), "timeout", "timed out"),
        (requests.exceptions.SSLError("x"), "tls", "TLS"),
    ],
)
def test_each_kind_of_unreachable_api_is_told(failure, reason, words):
    with responses.RequestsMock() as rsps:
        rsps.add(responses.POST, PROCS, body=failure)
        with pytest.raises(cx.TransportError) as raised:
            make_client(retry=NO_RETRY).execute(SB, ["true"])
    assert raised.value.reason == reason
    assert "api.example.test:443" in str(raised.value) and words in str(raised.value)
    assert "'x'" not in str(raised.value)


def test_no_process_started_is_said_only_before_the_process():
    later = str(cx.TransportError("process status", address="h:1", reason="reset"))
    assert "h:1" in later and "reset" in later and "No process" not in later
    assert "No process was started" in str(cx.TransportError("staging of env and stdin"))


def test_the_stream_ended_message_is_the_contracts():
    assert str(cx.StreamEndedError()) == "CreateOS process stream ended without an exit status."


def test_the_other_errors_say_what_to_do():
    assert "proc_9" in str(cx.CleanupError(process_id="proc_9"))
    assert "destroy the sandbox" in str(cx.CleanupError(creation_unconfirmed=True))
    assert "print less" in str(cx.OutputEvictedError(3))
    assert ".result" in str(cx.OutputIncompleteError())
    assert "proxy" in str(cx.ProtocolError("a frame is not JSON"))
    for status in (400, 401, 403, 404, 409, 429, 500):
        assert "rate_limit" not in str(cx.APIError(status, "process creation"))
