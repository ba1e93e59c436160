"""The stream's frames, and the output they carry: docs/failures.md's "Malformed input
from the service" table (every row but the last, which tests/test_recovery.py
holds) and the rows "invalid frame", "HTTP 410 or an output_offset_expired
frame" and "exit frame without a status" of the failure table (docs/design.md
rules 2 and 5: drop a replay, fail closed on a gap or a bad frame; 7 and 8:
exact text, bounded memory; 15: bytes are bytes, with text=False).

Canned streams (responses) first; then the reader, base64, exit statuses and
the output capture (tails and decoders), called directly.
"""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import json
import random
import string
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import responses
from local_server import READINGS
from support import (
    CONNECT,
    EXEC,
    EXIT0,
    PID,
    PROC,
    PROCS,
    SANDBOX,
    SB,
    SPOOL_GONE,
    WAIT,
    add_connect,
    add_created,
    add_deleted,
    agrees_with_json,
    assert_clean,
    assert_deleted_once,
    blocks,
    calls,
    data,
    exited,
    frames,
    make_client,
    nd,
    ok,
    process_record,
    query,
    reader_with_deliveries,
    remove_spool,
)

import createos_exec as cx

# --------------------------------------------------------------------------
# A run's stream: exit statuses, replays, text, tails
# --------------------------------------------------------------------------


def _run(rsps: responses.RequestsMock, body: str, **kw: Any) -> cx.ExecResult:
    add_created(rsps)
    add_connect(rsps, body)
    add_deleted(rsps)
    return make_client().execute(SB, ["true"], **kw)


def test_duplicate_seq_is_dropped(rsps: responses.RequestsMock) -> None:
    seen: List[Any] = []
    result = _run(
        rsps,
        nd(
            data(1, "stdout", b"a"),
            data(1, "stdout", b"a"),
            data(2, "stderr", b"b"),
            data(1, "stdout", b"DUP"),
            data(2, "stderr", b"DUP"),
            data(3, "stdout", b"c"),
            EXIT0,
        ),
        on_output=lambda s, t: seen.append((s, t)),
    )
    assert result.stdout == "ac" and result.stderr == "b"
    assert seen == [("stdout", "a"), ("stderr", "b"), ("stdout", "c")]


def test_utf8_split_across_frames_and_streams(rsps: responses.RequestsMock) -> None:
    euro = "€".encode()
    seen: List[Any] = []
    result = _run(
        rsps,
        nd(
            data(1, "stdout", euro[:1]),
            data(2, "stderr", "é".encode()[:1]),
            data(3, "stdout", euro[1:2]),
            data(4, "stderr", "é".encode()[1:]),
            data(5, "stdout", euro[2:] + b"!"),
            data(6, "stdout", b""),
            EXIT0,
        ),
        on_output=lambda s, t: seen.append((s, t)),
    )
    assert result.stdout == "€!" and result.stderr == "é"
    assert seen == [("stderr", "é"), ("stdout", "€!")]


def test_the_stream_is_asked_for_without_compression(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(EXIT0))
    make_client().execute(SB, ["true"])
    assert calls(rsps, "GET", CONNECT)[0].request.headers["Accept-Encoding"] == "identity"
    created = calls(rsps, "POST", PROCS)[0].request.headers["Accept-Encoding"]
    assert created != "identity"  # answers that are read whole may come compressed


# --------------------------------------------------------------------------
# Malformed frames fail closed, and the tree is terminated
# --------------------------------------------------------------------------


PROTOCOL_ERRORS = {
    "gap": nd(data(1, "stdout", b"a"), data(3, "stdout", b"c"), EXIT0),
    "first seq 2": nd(data(2, "stdout", b"a"), EXIT0),
    "seq true": nd({**data(1, "stdout", b"a"), "seq": True}, EXIT0),
    'seq "3"': nd({**data(1, "stdout", b"a"), "seq": "3"}, EXIT0),
    'seq "1"': nd({**data(1, "stdout", b"a"), "seq": "1"}, EXIT0),
    "seq 0": nd({**data(1, "stdout", b"a"), "seq": 0}, EXIT0),
    "seq -1": nd({**data(1, "stdout", b"a"), "seq": -1}, EXIT0),
    "seq 1.0": nd({**data(1, "stdout", b"a"), "seq": 1.0}, EXIT0),
    "seq null": nd({**data(1, "stdout", b"a"), "seq": None}, EXIT0),
    "seq missing": nd({"type": "data", "stream": "stdout", "data_base64": "YQ=="}, EXIT0),
    "stream pty": nd(data(1, "pty", b"a"), EXIT0),
    "stream missing": nd({"type": "data", "seq": 1, "data_base64": "YQ=="}, EXIT0),
    "non-canonical base64": nd({**data(1, "stdout", b"A"), "data_base64": "QR=="}, EXIT0),
    "base64 bad alphabet": nd({**data(1, "stdout", b"A"), "data_base64": "Q-_="}, EXIT0),
    "base64 missing padding": nd({**data(1, "stdout", b"A"), "data_base64": "QQ"}, EXIT0),
    "base64 with newline": nd({**data(1, "stdout", b"A"), "data_base64": "QQ==\n"}, EXIT0),
    "base64 not a string": nd({**data(1, "stdout", b"A"), "data_base64": None}, EXIT0),
    "invalid JSON": nd("{not json", EXIT0),
    "empty line": nd("", EXIT0),
    "JSON array line": nd("[1, 2]", EXIT0),
    "JSON string line": nd('"data"', EXIT0),
    "no type": nd({"seq": 1}, EXIT0),
    "type not a string": nd({"type": 1}, EXIT0),
    "unknown type": nd({"type": "progress"}, EXIT0),
    "error frame, other code": nd({"type": "error", "error": "internal"}),
    "exit code 256": nd({"type": "exit", "exit_code": 256}),
    "exit code -1": nd({"type": "exit", "exit_code": -1}),
    "exit code bool": nd({"type": "exit", "exit_code": True}),
    "exit code str": nd({"type": "exit", "exit_code": "0"}),
    "exit unknown signal": nd({"type": "exit", "signal": "exploded"}),
    "exit signal not str": nd({"type": "exit", "signal": 9}),
    "invalid UTF-8 line": b"\xff\xfe{}\n",
    "line over 1 MiB": nd('{"type":"heartbeat","pad":"' + "x" * (1024 * 1024) + '"}', EXIT0),
    "unterminated line over 1 MiB": '{"type":"heartbeat","pad":"' + "x" * (1024 * 1024 + 10),
}


@pytest.mark.parametrize("body", PROTOCOL_ERRORS.values(), ids=list(PROTOCOL_ERRORS))
def test_protocol_errors_fail_closed_and_terminate(rsps: responses.RequestsMock, body: Any) -> None:
    with pytest.raises(cx.ProtocolError) as info:
        _run(rsps, body)
    assert not isinstance(info.value, cx.OutputEvictedError)
    assert info.value.process_id == PID
    assert info.value.problem
    assert len(calls(rsps, "GET", CONNECT)) == 1  # never reconnects
    assert not calls(rsps, "GET", WAIT)
    assert_deleted_once(rsps)


def test_protocol_error_carries_partial_result(rsps: responses.RequestsMock) -> None:
    with pytest.raises(cx.ProtocolError) as info:
        _run(rsps, nd(data(1, "stdout", b"SECRET-OUTPUT\n"), data(5, "stdout", b"x")))
    assert info.value.result is not None
    assert info.value.result.stdout == "SECRET-OUTPUT\n"
    assert info.value.result.exit_code is None
    assert_clean(info.value, "SECRET-OUTPUT")


def test_messages_never_echo_frame_content(rsps: responses.RequestsMock) -> None:
    with pytest.raises(cx.ProtocolError) as info:
        _run(rsps, nd({"type": "SECRET-BODY"}))
    assert_clean(info.value, "SECRET-BODY")


# --------------------------------------------------------------------------
# Evicted output that the spool cannot give back (it is gone): never skipped
# over. What the spool gives back is test_spool.py's.
# --------------------------------------------------------------------------


def test_evicted_frame_mid_stream(rsps: responses.RequestsMock) -> None:
    evicted = {"type": "error", "error": "output_offset_expired", "oldest_available_seq": 5}
    rsps.add(responses.POST, EXEC, json=SPOOL_GONE)
    with pytest.raises(cx.OutputEvictedError) as info:
        _run(rsps, nd(data(1, "stdout", b"hello\n"), evicted), on_output=lambda *_: None)
    err = info.value
    assert isinstance(err, cx.ProtocolError)
    assert err.oldest_available_seq == 5 and err.spool == "gone"
    assert "after byte 6 of stdout or byte 0 of stderr may be lost" in str(err)
    assert err.process_id == PID
    assert err.result is not None and err.result.stdout == "hello\n"
    assert len(calls(rsps, "GET", CONNECT)) == 1
    assert_deleted_once(rsps)


EXPIRED = {"error": "output_offset_expired"}


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"status": "fail", "data": {**EXPIRED, "oldest_available_seq": 5}}, 5),
        ({"status": "fail", "data": EXPIRED}, None),
        ({"status": "fail", "data": "gone"}, None),
        ([1, 2], None),
        ("not json at all", None),
    ],
)
def test_410_on_connect_is_eviction(
    rsps: responses.RequestsMock, body: Any, expected: Optional[int]
) -> None:
    add_created(rsps)
    text = body if isinstance(body, str) else json.dumps(body)
    rsps.add(responses.GET, CONNECT, status=410, body=text, content_type="application/json")
    add_deleted(rsps)
    rsps.add(responses.POST, EXEC, json=SPOOL_GONE)
    with pytest.raises(cx.OutputEvictedError) as info:
        make_client().execute(SB, ["true"], on_output=lambda *_: None)  # a live consumer
    assert info.value.oldest_available_seq == expected
    assert isinstance(info.value, cx.ProtocolError)
    assert len(calls(rsps, "GET", CONNECT)) == 1
    assert_deleted_once(rsps)


@pytest.mark.parametrize("restart", ["frame", "410 body", "record"])
def test_eviction_nobody_reads_live_is_the_head_of_a_result(
    rsps: responses.RequestsMock, restart: str
) -> None:
    # Nobody takes the output as it comes: what was evicted is the head of
    # the output. The result is the contiguous tail from the oldest kept
    # frame on, with the process's own status, and no tree is terminated.
    add_created(rsps)
    rsps.add(responses.POST, EXEC, json=SPOOL_GONE)
    if restart == "frame":
        evicted = nd(
            data(1, "stdout", b"old\n"),
            {"type": "error", "error": "output_offset_expired", "oldest_available_seq": 5},
        )
        add_connect(rsps, evicted)
    else:
        data_410 = {"error": "output_offset_expired"}
        if restart == "410 body":
            data_410["oldest_available_seq"] = 5
        else:
            kept = {"oldest_seq": 5, "newest_seq": 6}
            rsps.add(responses.GET, PROC, json=ok(process_record(output=kept)))
        body = json.dumps({"status": "fail", "data": data_410})
        rsps.add(responses.GET, CONNECT, status=410, body=body, content_type="application/json")
    add_connect(rsps, nd(data(5, "stdout", b"kept "), data(6, "stderr", b"e"), EXIT0))
    result = make_client().execute(SB, ["true"])
    assert (result.stdout, result.stderr, result.output) == ("kept ", "e", "kept e")
    assert result.output_evicted and result.stdout_truncated and result.stderr_truncated
    assert result.exit_code == 0 and result.reconnects == 0
    assert [query(c)["after"] for c in calls(rsps, "GET", CONNECT)] == ["0", "4"]
    assert not calls(rsps, "DELETE", PROC)


def test_eviction_that_keeps_the_next_frame_fails_closed(rsps: responses.RequestsMock) -> None:
    # A 410 whose record says the next frame is still kept contradicts itself.
    add_created(rsps)
    rsps.add(
        responses.GET, PROC, json=ok(process_record(output={"oldest_seq": 1, "newest_seq": 3}))
    )
    rsps.add(responses.GET, CONNECT, status=410, json={"status": "fail", "data": "gone"})
    add_deleted(rsps)
    rsps.add(responses.POST, EXEC, json=SPOOL_GONE)
    with pytest.raises(cx.OutputEvictedError):
        make_client().execute(SB, ["true"])
    assert_deleted_once(rsps)


# --------------------------------------------------------------------------
# An exit frame without a status is checked once against wait
# --------------------------------------------------------------------------


def test_exit_without_status_recovered_from_wait(rsps: responses.RequestsMock) -> None:
    add_created(rsps)
    add_connect(rsps, nd(data(1, "stdout", b"x"), {"type": "exit"}))
    rsps.add(responses.GET, WAIT, json=ok(exited(1, exit_code=3)))
    result = make_client().execute(SB, ["true"])
    assert result.exit_code == 3
    assert result.exit_recovered is True
    assert result.stdout == "x"
    waits = calls(rsps, "GET", WAIT)
    assert len(waits) == 1
    assert {"scope", "timeout_ms"} <= set(query(waits[0]))
    assert not calls(rsps, "DELETE", PROC)


@pytest.mark.parametrize(
    "answer",
    [
        (200, json.dumps(ok(exited(1, exit_code=None)))),
        (200, json.dumps(ok(process_record()))),  # not exited
        (200, "not json"),
        (408, ""),
        (404, json.dumps({"status": "fail", "data": "gone"})),
    ],
    ids=["no status", "not exited", "not json", "408", "404"],
)
def test_exit_without_status_unrecoverable(rsps: responses.RequestsMock, answer: Any) -> None:
    rsps.add(responses.GET, WAIT, status=answer[0], body=answer[1])
    with pytest.raises(cx.ProtocolError):
        _run(rsps, nd({"type": "exit", "exit_code": None, "signal": None}))
    assert len(calls(rsps, "GET", WAIT)) == 1  # checked once
    assert len(calls(rsps, "GET", CONNECT)) == 1
    assert_deleted_once(rsps)


# --------------------------------------------------------------------------
# The reader: lines, blocks, frames
# --------------------------------------------------------------------------


def test_blocks_split_only_on_newline_and_come_as_soon_as_complete() -> None:
    sep = "\u2028".encode("utf-8")
    chunks = [b'{"a":"x' + sep[:1], sep[1:] + b'y"}\n{"b":', b"1}\r\n", b"\n", b"last\nnext\n"]
    cut = list(blocks(chunks))
    assert cut == [b'{"a":"x' + sep + b'y"}\n', b'{"b":1}\r\n', b"\n", b"last\nnext\n"]
    assert json.loads(cut[0]) == {"a": "x\u2028y"}


def test_blocks_unterminated_last_line_is_retryable() -> None:
    with pytest.raises(cx._Retryable):
        list(blocks([b"done\n", b'{"type":"exit"']))
    assert list(blocks([])) == []
    assert list(blocks([b"a\n", b""])) == [b"a\n"]


def test_blocks_length_limit() -> None:
    assert list(blocks([b"x" * 10 + b"\n"], limit=10)) == [b"x" * 10 + b"\n"]
    with pytest.raises(cx.ProtocolError):
        list(blocks([b"x" * 11 + b"\n"], limit=10))
    with pytest.raises(cx.ProtocolError):
        list(blocks([b"x" * 6, b"x" * 5 + b"\n"], limit=10))
    with pytest.raises(cx.ProtocolError):
        list(blocks([b"x" * 6, b"x" * 6], limit=10))  # fails before EOF


def test_blocks_hand_out_the_lines_before_one_that_is_too_long() -> None:
    seen = []
    with pytest.raises(cx.ProtocolError):
        for block in blocks([b"ok\nfine\n" + b"x" * 11 + b"\nnever\n"], limit=10):
            seen.append(block)
    assert seen == [b"ok\nfine\n"]


def test_blocks_fail_before_buffering_an_endless_line() -> None:
    consumed = 0

    def endless() -> Any:
        nonlocal consumed
        for chunk in itertools.repeat(b"y" * 1024):
            consumed += 1
            yield chunk

    with pytest.raises(cx.ProtocolError):
        list(blocks(endless()))
    assert consumed <= 1025  # bounded by 1 MiB, not by the stream


def test_frames_of_a_block_in_order() -> None:
    block = (
        b'{"type":"heartbeat"}\n'
        b' {"type":"data","seq":1} \r\n'  # whitespace around a value: parsed alone
        b'{"type":"exit","exit_code":0}\n'
    )
    assert list(frames(block)) == [
        {"type": "heartbeat"},
        {"type": "data", "seq": 1},
        {"type": "exit", "exit_code": 0},
    ]


@pytest.mark.parametrize(
    "bad",
    [
        b'{"type":"a"},{"type":"b"}\n',  # two values on one line
        b'{"type":"a","x":"\n"}\n',  # one value over two lines
        b'{"type":\n"a"}\n',  # the same, the newline between its tokens
        b"\n",
        b'{"type":"a"}x\n',
        b'{"type":"a","x":"\xff"}\n',  # not UTF-8
        b'{"type":"a","x":"\xed\xa0\x80"}\n',  # a surrogate, UTF-8-encoded
        b"nul\n",
    ],
)
def test_frames_hand_out_the_good_lines_then_fail_on_the_bad_one(bad: bytes) -> None:
    seen = []
    with pytest.raises(cx.ProtocolError):
        for frame in frames(b'{"type":"heartbeat"}\n' + bad + b'{"type":"never"}\n'):
            seen.append(frame)
    assert seen == [{"type": "heartbeat"}]


def test_deeply_nested_frame_is_protocol_error() -> None:
    with pytest.raises(cx.ProtocolError):
        cx._line_value("[" * 100_000 + "]" * 100_000)
    with pytest.raises(cx.ProtocolError):
        list(frames(b"[" * 100_000 + b"]" * 100_000 + b"\n"))


def test_line_value_parsing() -> None:
    assert cx._line_value('{"type":"heartbeat"}') == {"type": "heartbeat"}
    assert cx._line_value(' {"type":"heartbeat"}\r') == {"type": "heartbeat"}
    for bad in ("", " ", "\udcff", '{"type":"x"', "{} {}", "nul"):
        with pytest.raises(cx.ProtocolError):
            cx._line_value(bad)


@pytest.mark.parametrize(
    "value", [None, 1, "x", [], ["data"], {}, {"type": None}, {"type": 1}, float("nan")]
)
def test_a_frame_is_an_object_with_a_string_type(value: Any) -> None:
    reader, _ = reader_with_deliveries()
    block = json.dumps(value).encode() + b"\n"
    with pytest.raises(cx.ProtocolError, match="not an object with a type"):
        reader.take(block)


def plain_line(seq: int, text: str, stream: str = "stdout", data: Optional[str] = None) -> bytes:
    data = base64.b64encode(text.encode()).decode() if data is None else data
    line = '{"type":"data","seq":%d,"stream":"%s","data_base64":"%s"}\n'
    return (line % (seq, stream, data)).encode()


def test_a_block_of_data_is_delivered_once_per_run_of_one_stream() -> None:
    reader, delivered = reader_with_deliveries()
    block = b"".join(
        [plain_line(1, "a"), plain_line(2, "b"), plain_line(3, "E", "stderr"), plain_line(4, "c")]
    )
    reader.take(block + plain_line(5, "d"))
    assert delivered == [("stdout", "ab"), ("stderr", "E"), ("stdout", "cd")]
    assert reader.cursor == 5
    reader.take(plain_line(6, "e") + plain_line(7, "f"))
    assert delivered[-1] == ("stdout", "ef") and reader.cursor == 7


def test_a_replayed_block_adds_only_what_is_new() -> None:
    reader, delivered = reader_with_deliveries()
    reader.take(plain_line(1, "a") + plain_line(2, "b"))
    reader.take(plain_line(1, "a") + plain_line(2, "b") + plain_line(3, "c"))
    assert delivered == [("stdout", "ab"), ("stdout", "c")] and reader.cursor == 3
    with pytest.raises(cx.ProtocolError, match="jumped from 4 to 6"):
        reader.take(plain_line(4, "d") + plain_line(6, "f") + plain_line(7, "g"))
    assert delivered[-1] == ("stdout", "d") and reader.cursor == 4


# "QR==" and "AAAA====" are not in the data-line pattern; the others are,
# but are not whole quanta of base64.
@pytest.mark.parametrize("bad", ["QR==", "AAAA====", "QQ", "QUJDA==", "QUJDQ=", "QUJDQUI"])
def test_a_bad_frame_in_a_block_fails_after_the_good_ones_are_delivered(bad: str) -> None:
    reader, delivered = reader_with_deliveries()
    block = plain_line(1, "a") + plain_line(2, "b") + plain_line(3, "", data=bad)
    with pytest.raises(cx.ProtocolError):
        reader.take(block + plain_line(4, "d"))
    assert delivered == [("stdout", "ab")] and reader.cursor == 2


# --------------------------------------------------------------------------
# base64: only text that re-encodes identically
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("aGVsbG8K", b"hello\n"),
        ("", b""),
        ("QQ==", b"A"),
        ("QUI=", b"AB"),
        ("QUJD", b"ABC"),
        ("////", b"\xff\xff\xff"),
        ("+/+/", b"\xfb\xff\xbf"),
    ],
)
def test_base64_accepts_canonical(text: str, expected: bytes) -> None:
    assert cx._base64(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "QR==",
        "QUJ=",
        "QQ",
        "QQ=",
        "Q===",
        "====",
        "QQ==QQ==",
        "aGV sbG8K",
        "aGVsbG8K\n",
        "-_-_",
        "aGVsbG8",
        "AAAA====",
        "QQ==\x00",
    ],
)
def test_base64_rejects(text: Any) -> None:
    with pytest.raises(cx.ProtocolError):
        cx._base64(text)


def test_base64_round_trips_every_length() -> None:
    rng = random.Random(1)
    for n in range(0, 40):
        raw = bytes(rng.randrange(256) for _ in range(n))
        assert cx._base64(base64.b64encode(raw).decode()) == raw


def strict_accepts(text: str) -> bool:
    try:
        cx._base64(text)
    except cx.ProtocolError:
        return False
    return True


ONE_LINE = '{"type":"data","seq":1,"stream":"stdout","data_base64":"%s"}\n'


@pytest.mark.parametrize("last", string.ascii_letters + string.digits + "+/")
def test_one_data_line_takes_only_canonical_last_characters(last: str) -> None:
    """Every character before one and two "=": taken exactly when strict decoding accepts."""
    for padded in ("QUJDQ%s==" % last, "QU%s=" % last):
        took = agrees_with_json((ONE_LINE % padded).encode(), 0)
        assert took == strict_accepts(padded)


@pytest.mark.parametrize(
    "data",
    ["", "aGk=", "QQ==QQ==", "aGk=    ", "aGk=\t\t\t\t", "a\\/k=", "aGk\\u003d", "=aGk",
     "aG==", "A===", "aGk==", "aGk=aGk=", "aGké", "aGk=\\", "QUJD\nQUJD"],
)  # fmt: skip
def test_one_data_line_is_read_exactly_as_json(data: str) -> None:
    """Whitespace, escapes, misplaced padding: on any Python, the reader takes
    one data line exactly as the JSON route does (json.loads, then _base64)."""
    block = (ONE_LINE % data).encode("utf-8")
    try:
        value = json.loads(block)
    except ValueError:
        expected = False
    else:
        expected = strict_accepts(value["data_base64"])
    assert agrees_with_json(block, 0) == expected


# --------------------------------------------------------------------------
# Exit statuses
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"exit_code": 0}, (0, None)),
        ({"exit_code": 255}, (255, None)),
        ({"signal": "SIGKILL"}, (None, "SIGKILL")),
        ({"signal": "SIGRTMIN1"}, (None, "SIGRTMIN1")),
        ({"signal": "killed"}, (None, "SIGKILL")),
        ({"signal": "Terminated"}, (None, "SIGTERM")),
        ({"signal": "segmentation fault"}, (None, "SIGSEGV")),
        ({"signal": "interrupt"}, (None, "SIGINT")),
        ({"signal": "SIGKILL", "exit_code": 137}, (None, "SIGKILL")),
        ({"signal": None, "exit_code": 1}, (1, None)),
        ({}, None),
        ({"exit_code": None, "signal": None}, None),
    ],
)
def test_exit_status_accepts(fields: Dict[str, Any], expected: Any) -> None:
    assert cx._exit_status(fields) == (None if expected is None else cx._Exit(*expected))


@pytest.mark.parametrize(
    "fields",
    [
        {"exit_code": 256},
        {"exit_code": -1},
        {"exit_code": True},
        {"exit_code": False},
        {"exit_code": 1.0},
        {"exit_code": "0"},
        {"signal": 9},
        {"signal": "bogus"},
        {"signal": ""},
        {"signal": "sigkill"},
        {"signal": "SIG"},
        {"signal": ["SIGKILL"]},
    ],
)
def test_exit_status_rejects(fields: Dict[str, Any]) -> None:
    with pytest.raises(cx.ProtocolError):
        cx._exit_status(fields)


@pytest.mark.parametrize(
    "words, name, number",
    [
        ("profiling timer expired", "SIGPROF", 27),
        ("Bad system call", "SIGSYS", 31),
        ("signal 34", "SIG34", 34),
    ],
)
def test_go_signal_words_past_sigterm_and_numbered_signals(words, name, number) -> None:
    status = cx._exit_status({"signal": words, "exit_code": -1})
    assert status == cx._Exit(None, name)
    assert cx.ExecResult(None, None, name, False, "", "").returncode == -number


# --------------------------------------------------------------------------
# Output capture: decoders and tails
# --------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 1, 5, 64, 1000])
def test_tail_keeps_exactly_the_last_chars(limit: int) -> None:
    rng = random.Random(limit)
    tail = cx._Tail(limit)
    reference = ""
    for _ in range(2000):
        piece = "".join(rng.choice("ab€\n\U0001d11e") for _ in range(rng.randint(0, 12)))
        tail.append(piece)
        reference += piece
        assert tail.truncated == (len(reference) > limit)
        if rng.random() < 0.1:
            assert tail.text() == (reference[-limit:] if limit else "")
    assert tail.text() == (reference[-limit:] if limit else "")


def last(text: Any, limit: int) -> Any:
    return text[-limit:] if limit else text[:0]


# Pieces are cut from one random text drawn once: drawing each character anew
# made these cases the slowest of the suite (up to half a minute each, on every
# Python) for no route the cut text does not take.
CAPTURE_TEXT = "".join(random.Random(5).choices("ab€\n\U0001d11e", k=1 << 16))


# Limits below and above 16 parts; lengths that end on a part and between parts.
# Decoded (UTF-8), or with text=False (encoding None) the bytes, counted as bytes.
@pytest.mark.parametrize("encoding", ["utf-8", None])
@pytest.mark.parametrize("limit", [0, 1, 5, 64, 1000, 70_000])
@pytest.mark.parametrize("pieces", [1, 37, 1200, 5000])
def test_capture_keeps_the_last_chars_of_each_stream_and_both(
    limit: int, pieces: int, encoding: Optional[str]
) -> None:
    rng = random.Random(limit * 7919 + pieces)
    handed_out: List[Tuple[str, Any]] = []
    capture = cx._Output(encoding, "strict", limit, lambda *args: handed_out.append(args))
    written: List[Tuple[str, Any]] = []
    for _ in range(pieces):
        stream = rng.choice(cx._STREAMS)
        size = rng.choice([0, 1, 12, 100, 5000])
        length = rng.randint(0, size)
        start = rng.randrange(len(CAPTURE_TEXT) - length + 1)
        piece = CAPTURE_TEXT[start : start + length]
        capture.feed(stream, piece.encode("utf-8"))
        if piece:
            written.append((stream, piece if encoding else piece.encode("utf-8")))
    capture.finish()
    assert handed_out == written  # as it came, nothing held back
    nothing = "" if encoding else b""
    both = nothing.join(text for _, text in written)
    assert capture.combined.text() == last(both, limit)
    assert capture.combined.truncated == (len(both) > limit)
    for name, tail in capture.tails.items():
        mine = nothing.join(text for stream, text in written if stream == name)
        assert tail.text() == last(mine, limit)
        assert tail.truncated == (len(mine) > limit)


def test_tail_memory_stays_bounded() -> None:
    tail = cx._Tail(1000)
    for i in range(20000):
        tail.append(f"{i:09d}\n")
    assert tail.text().endswith("000019999\n") and len(tail.text()) == 1000
    assert sum(len(part) for part in tail._parts) <= 1000 + 1000 // 4 + 10


def test_capture_memory_stays_bounded() -> None:
    capture = cx._Output("utf-8", "strict", 1000, None)
    for i in range(20000):
        capture.feed(cx._STREAMS[i % 2], b"%09d\n" % i)
    held = [sum(len(part) for part in tail._parts) for tail in capture.tails.values()]
    held.append(sum(len(part) for part in capture.combined._parts))
    assert max(held) <= 1000 + 1000 // 4 + 1000 // 16 + 10
    assert capture._recent_size <= 1000 // 16 + 10


def test_tail_not_truncated_at_exact_limit() -> None:
    tail = cx._Tail(4)
    tail.append("ab")
    tail.append("cd")
    assert tail.text() == "abcd" and not tail.truncated
    tail.append("e")
    assert tail.text() == "bcde" and tail.truncated


@pytest.mark.parametrize("cut", [1, 2, 3, 4])
def test_capture_decodes_multibyte_split_anywhere(cut: int) -> None:
    text = "h€llo wörld 𝄞 – ok"
    raw = text.encode("utf-8")
    pieces: List[str] = []
    capture = cx._Output("utf-8", "replace", 100, lambda stream, text: pieces.append(text))
    for i in range(0, len(raw), cut):
        capture.feed("stdout", raw[i : i + cut])
    capture.finish()
    assert "".join(pieces) == text
    assert all(pieces)  # a cut character waits for its rest, not handed out as ""
    assert capture.tails["stdout"].text() == text == capture.combined.text()


def test_a_partial_result_changes_nothing_and_the_end_hands_out_a_cut_character() -> None:
    pieces: List[Tuple[str, str]] = []
    capture = cx._Output("utf-8", "replace", 100, lambda *args: pieces.append(args))
    euro = "€".encode("utf-8")
    capture.feed("stderr", b"ok" + euro[:-1])
    assert pieces == [("stderr", "ok")]
    # An error's result (a pause, the run may go on): what was handed out, nothing more.
    partial = capture.result(None, timed_out=False, partial=True, args=[])
    assert partial.stderr == "ok" == partial.output and pieces == [("stderr", "ok")]
    capture.feed("stderr", euro[-1:])  # the rest of the character, after the partial result
    capture.feed("stdout", euro[:1])  # cut off at the end
    final = capture.result(cx._Exit(0, None), timed_out=False, partial=False, args=[])
    assert pieces == [("stderr", "ok"), ("stderr", "€"), ("stdout", "\ufffd")]
    assert (final.stdout, final.stderr, final.output) == ("\ufffd", "ok€", "ok€\ufffd")


def test_capture_other_encoding_and_strict_errors() -> None:
    pieces: List[str] = []
    capture = cx._Output("latin-1", "strict", 10, lambda stream, text: pieces.append(text))
    capture.feed("stderr", b"caf\xe9")
    assert pieces == ["café"]
    strict = cx._Output("utf-8", "strict", 10, None)
    with pytest.raises(UnicodeDecodeError):
        strict.feed("stdout", b"\xff")


# --------------------------------------------------------------------------
# Against the local server: every malformed input fails closed and the remote
# tree is gone (item 3 of RELIABILITY.md); eviction on the stream and on a
# reconnect, the spool gone
# --------------------------------------------------------------------------


def connects(server: Any) -> int:
    return len(server.requests_to("connect"))


def losing_the_spool(server: Any, seen: List[str]) -> Any:
    """An on_output that keeps what it is given and, at the first, removes the spool
    of the server's one process (its journal then cannot be made good)."""

    def take(stream: str, text: str) -> None:
        if not seen:
            (record,) = server.processes()
            remove_spool(server, record["process_id"])
        seen.append(text)

    return take


VIOLATIONS = {
    "gap": b'{"type":"data","seq":9,"stream":"stdout","data_base64":"eA=="}',
    "seq-true": b'{"type":"data","seq":true,"stream":"stdout","data_base64":"eA=="}',
    "seq-string": b'{"type":"data","seq":"2","stream":"stdout","data_base64":"eA=="}',
    "seq-float": b'{"type":"data","seq":2.0,"stream":"stdout","data_base64":"eA=="}',
    "bad-stream": b'{"type":"data","seq":2,"stream":"pty","data_base64":"eA=="}',
    "non-canonical-base64": b'{"type":"data","seq":2,"stream":"stdout","data_base64":"eR=="}',
    "bad-base64": b'{"type":"data","seq":2,"stream":"stdout","data_base64":"e*=="}',
    "invalid-json": b'{"type":"data",',
    "not-an-object": b'["data"]',
    "unknown-type": b'{"type":"progress"}',
    "error-frame": b'{"type":"error","error":"internal"}',
    "bad-signal": b'{"type":"exit","signal":"SIG kill"}',
    "oversized": b'{"type":"heartbeat","pad":"' + b"x" * (1024 * 1024) + b'"}',
}


@pytest.mark.both_readings
@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_protocol_violation_fails_closed_and_terminates_the_tree(client, server, name, figures):
    server.corrupt_stream(VIOLATIONS[name], after_frames=1)
    with pytest.raises(cx.ProtocolError) as caught:
        client.execute(
            SANDBOX, "echo first; sleep 0.2; echo second; sleep 30 & sleep 30", shell=True
        )
    error = caught.value
    assert type(error) is cx.ProtocolError
    assert connects(server) == 1  # never a reconnect after a bad frame
    assert error.process_id is not None
    assert error.result is not None and error.result.stdout == "first\n"
    assert server.wait_tree_gone(error.process_id)
    assert server.requests_to("delete")
    figures.record("3. protocol violations", runs=1, failed_closed=1, reconnects_after=0)


@pytest.mark.both_readings
def test_eviction_frame_is_its_own_error(client, server):
    server.corrupt_stream(
        b'{"type":"error","error":"output_offset_expired","oldest_available_seq":5}',
        after_frames=1,
    )
    # A live reader (on_output) is never handed output after a gap.
    seen: List[str] = []
    with pytest.raises(cx.OutputEvictedError) as caught:
        client.execute(
            SANDBOX,
            "echo a; sleep 0.2; echo b; sleep 30",
            shell=True,
            on_output=losing_the_spool(server, seen),
        )
    assert seen == ["a\n"] and caught.value.spool == "gone"
    assert connects(server) == 1
    assert server.wait_tree_gone(caught.value.process_id)


@pytest.mark.both_readings
def test_410_on_reconnect_is_eviction(client, server):
    def evict_then_break(stream, text):
        if text == "1\n":
            time.sleep(0.4)  # let the process print more, then lose it, and its spool
            (record,) = [p for p in server.processes() if "seq 2 4" in p["args"][-1]]
            server.evict(record["process_id"])
            remove_spool(server, record["process_id"])

    server.drop_stream(after_frames=1)
    with pytest.raises(cx.OutputEvictedError) as caught:
        client.execute(
            SANDBOX, "seq 1 1; sleep 0.1; seq 2 4; sleep 30", shell=True, on_output=evict_then_break
        )
    assert connects(server) == 2
    assert caught.value.result.stdout == "1\n"
    assert server.wait_tree_gone(caught.value.process_id)


@pytest.mark.parametrize("reading", READINGS)
def test_a_reader_left_behind_by_the_journal_gets_output_evicted(local_server, reading):
    server = local_server(journal_limit=64 * 1024, reading=reading)
    seen = []

    def fall_behind(stream, text):
        if not seen:  # meanwhile the flood outruns the socket buffers and the journal
            seen.append(text)
            time.sleep(1.3)
            (process_id,) = [p["process_id"] for p in server.processes()]
            assert server.wait_tree_gone(process_id)  # and the output is final
            remove_spool(server, process_id)

    script = "echo first; sleep 0.3; head -c 30000000 /dev/zero"
    with make_client(server) as client, pytest.raises(cx.OutputEvictedError) as caught:
        client.execute(SANDBOX, script, shell=True, on_output=fall_behind)
    connects = [r.status for r in server.requests_to("connect")]
    assert seen == ["first\n"] and caught.value.result.stdout.startswith("first\n")
    # Conservative: an error frame on the live stream, naming the restart point.
    # Alternative: the stream is cut, and the reconnect meets a 410 whose plain
    # string names no seq (the output is final by then).
    if reading.live_eviction == "error_frame":
        assert connects == [200] and caught.value.oldest_available_seq > 2
    else:
        assert connects == [200, 410]
        oldest = caught.value.oldest_available_seq
        assert oldest is None or oldest > 2


# --------------------------------------------------------------------------
# Against the local server: bytes are bytes (docs/design.md item 15), every
# byte once, in order, through the result, a loop and the callback alike,
# across reconnects
# --------------------------------------------------------------------------

EVERY_BYTE = bytes(range(256))
# The 256 values from stdin, then random bytes the sandbox draws, whose SHA-256 it
# prints to stderr; the local server makes a frame of each read of a pipe.
BINARY = (
    'cat; f=$(mktemp); head -c 300000 /dev/urandom > "$f"; cat "$f"; '
    'sha256sum < "$f" | cut -c1-64 >&2; rm -f "$f"'
)


FAULTS = {
    "unbroken": lambda s: None,
    "mid-frame": lambda s: s.drop_stream(after_frames=1, mid_frame=True),
    "clean-eof": lambda s: s.end_stream(after_frames=2),
    "replay-ignores-after": lambda s: (
        s.replay_ignoring_after(count=2) or s.drop_stream(after_frames=3)
    ),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_byte_arrives_once_in_order_through_result_loop_and_callback(client, server, fault):
    FAULTS[fault](server)
    called: List[Tuple[str, bytes]] = []
    proc = client.start(
        SANDBOX,
        BINARY,
        shell=True,
        input=EVERY_BYTE * 3,
        text=False,
        on_output=lambda *piece: called.append(piece),
    )
    looped = list(proc.iter_output())
    result = proc.wait()
    out = result.stdout
    assert out[:768] == EVERY_BYTE * 3 and len(out) == 768 + 300_000
    assert hashlib.sha256(out[768:]).hexdigest().encode() + b"\n" == result.stderr
    for pieces in (looped, called):
        assert all(type(data) is bytes and data for _, data in pieces)
        assert b"".join(data for stream, data in pieces if stream == "stdout") == out
    assert looped == called and b"".join(data for _, data in looped) == result.output
    assert result.reconnects == len(server.requests_to("connect")) - 1
    assert result.reconnects >= (fault != "unbroken")
    assert client.attach(SANDBOX, proc.process_id, text=False).stdout == out  # taken up again


def test_lines_of_bytes_split_on_newline_and_the_tail_counts_bytes(client):
    script = r"printf 'one\ntw\377\n\000\200 no end'; printf '€€€€' >&2"
    proc = client.start(SANDBOX, script, shell=True, text=False, max_output_chars=10)
    lines = list(proc.iter_output(lines=True))
    result = proc.wait()
    assert lines == [
        ("stdout", b"one\n"),
        ("stdout", b"tw\xff\n"),
        ("stdout", b"\x00\x80 no end"),
        ("stderr", "€€€€".encode()),
    ]
    assert result.stdout == b"\n\x00\x80 no end" and result.stdout_truncated
    assert result.stderr == "€€€€".encode()[-10:] and len(result.output) == 10
    assert "stdout=<10 bytes>" in repr(result)


def test_communicate_and_the_errors_of_a_bytes_run_carry_bytes(client, server):
    proc = client.start(SANDBOX, ["cat"], stdin=cx.PIPE, text=False)
    with pytest.raises(cx.ConfigError, match="bytes with text=False"):
        proc.write("text")  # as Popen's binary stdin: refused, nothing sent
    assert server.requests_to("input") == []
    assert proc.communicate(b"\x00\xff\n") == (b"\x00\xff\n", b"")
    script = r"printf '\377'; sleep 2; printf '\376' >&2; exit 3"
    failing = client.start(SANDBOX, script, shell=True, text=False, check=True)
    next(failing.iter_output())
    with pytest.raises(cx.WaitTimeout) as waited:
        failing.wait(timeout=0.1)
    with pytest.raises(cx.CommandError) as failed:
        failing.wait()
    assert (waited.value.output, waited.value.stderr) == (b"\xff", b"")
    assert (failed.value.stdout, failed.value.stderr) == (b"\xff", b"\xfe")


def test_echo_prints_bytes_through_where_the_stream_takes_bytes(monkeypatch):
    binary, notebook = io.BytesIO(), io.StringIO()  # a terminal's stdout; a stderr without bytes
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(binary, encoding="utf-8"))
    monkeypatch.setattr(sys, "stderr", notebook)
    for stream, piece in [
        ("stdout", "tö "),
        ("stdout", b"\xff\n"),
        ("stderr", b"\xff!"),
        ("stderr", "ok"),
    ]:
        cx.echo(stream, piece)
    assert binary.getvalue() == "tö ".encode() + b"\xff\n"
    assert notebook.getvalue() == "\ufffd!ok"
