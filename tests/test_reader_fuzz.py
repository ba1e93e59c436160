"""8. Fuzzing the reader: arbitrary and mostly-valid byte streams, chunked anywhere.

Two levels:

(a) the internals, layer by layer as `_Reader.read` drives them:
    `_Reader.blocks` (bytes -> blocks of complete lines, bounded by the frame
    limit) -> `cx._frames` (block -> the JSON value of each line, exactly as
    json.loads would parse each line alone) -> `cx._data_frame` + a
    `cx._Output` decoder for data frames, `cx._exit_status` for exit frames;
(b) the public path: `Client.execute()` against canned answers served by
    `responses`, the connect bodies delivered in hypothesis-chosen chunks and
    cut where hypothesis says.

Whatever the input: nothing hangs (a pytest-timeout per test: bounded
counts of examples, so no wall-clock deadline per example that a loaded
machine could miss), nothing but a `CreateOSError` escapes, a valid stream comes back
exactly, and the reader never holds more than the frame limit of an
unterminated line.
"""

from __future__ import annotations

import base64
import codecs
import collections
import contextlib
import dataclasses
import io
import itertools
import json
import string
import types
import urllib.parse
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest
import responses
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support import (
    CANNED_RETRY,
    CANNED_THREE_TRIES,
    CONNECT,
    PID,
    PROC,
    PROCS,
    SB,
    WAIT,
    add_created,
    add_deleted,
    agrees_with_json,
    assert_clean,
    blocks,
    calls,
    data,
    exited,
    figures_at_end,
    frames,
    full_campaign,
    make_client,
    nd,
    ok,
    process_record,
    take_block,
    taken,
    utf8_text,
)

import createos_exec as cx

LIMIT = cx._FRAME_LIMIT  # 1 MiB: the longest NDJSON line the reader accepts
STREAMS = ("stdout", "stderr")

# Figures of this file, recorded once at the end (see `_figures`).
STATS = {"examples": 0, "max_pending": 0, "errors_other_than_createos": 0}

# The campaign's count of examples; in `tests` a quarter of it, always the
# same ones (a fixed seed), so that a run in CI can be repeated as it was.
FULL = full_campaign()
FUZZ = settings(
    max_examples=150 if FULL else 40,
    deadline=None,  # a hang is caught by the test's timeout, not a loaded machine's pace
    derandomize=not FULL,
    database=None,  # write nothing into the working tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def examples(full: int) -> int:
    return full if FULL else full // 4


def fuzz(full: Optional[int] = None, timeout: int = 180) -> Callable[[Any], Any]:
    """FUZZ's settings (`full` examples in the campaign, a quarter in CI), and a hang guard."""
    tuned = settings(FUZZ, max_examples=examples(full)) if full else FUZZ
    return lambda test: pytest.mark.timeout(timeout)(tuned(test))


def fuzz_figures() -> Dict[str, float]:
    return dict(
        examples=STATS["examples"],
        max_pending=STATS["max_pending"],
        frame_limit=LIMIT,
        errors_other_than_createos=STATS["errors_other_than_createos"],
    )


_figures = figures_at_end("8. reader fuzz", fuzz_figures)


# --------------------------------------------------------------------------
# A chunked stream that watches the reader's memory
# --------------------------------------------------------------------------


def split(data: bytes, sizes: Sequence[int]) -> List[bytes]:
    """`data` cut into chunks of the given sizes, cycled."""
    chunks = []
    offset = 0
    for size in itertools.cycle(sizes):
        if offset >= len(data):
            return chunks
        chunks.append(data[offset : offset + size])
        offset += size
    raise AssertionError("unreachable")


class Feed:
    """A byte stream in chunks; counts what the reader pulled and gave back.

    When `_Reader.blocks` asks for the next chunk it has handed out every complete
    line of the previous one, so `consumed - emitted` is exactly the unterminated
    tail it buffers (its `pending`) at that moment.
    """

    def __init__(self, chunks: Sequence[bytes], limit: int = LIMIT) -> None:
        self.chunks = list(chunks)
        self.limit = limit
        self.pulled = 0  # chunks
        self.consumed = 0  # bytes pulled
        self.emitted = 0  # bytes returned as lines, newline included
        self.max_pending = 0
        self.exhausted = False

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    def _pull(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            self._watch()
            self.pulled += 1
            self.consumed += len(chunk)
            yield chunk
        self._watch()
        self.exhausted = True

    def _watch(self) -> None:
        pending = self.consumed - self.emitted
        assert pending <= self.limit, "the reader buffered more than the frame limit"
        self.max_pending = max(self.max_pending, pending)
        if self.limit == LIMIT:
            STATS["max_pending"] = max(STATS["max_pending"], pending)

    def blocks(self) -> Iterator[bytes]:
        for block in blocks(self._pull(), self.limit):
            assert block.endswith(b"\n")
            self.emitted += len(block)
            yield block

    def lines(self) -> Iterator[bytes]:
        for block in self.blocks():
            yield from block.split(b"\n")[:-1]


RETRY = "resume"  # the reader's verdict for a stream that ends inside a line


class Decoded:
    """What the reader's layers made of a stream (up to its exit frame)."""

    def __init__(self) -> None:
        self.frames: List[Dict[str, Any]] = []
        self.output = cx._Output("utf-8", "replace", 4 * 1024 * 1024, self.hand_out)
        self.status: Optional[cx._Exit] = None
        self.text = {name: "" for name in STREAMS}

    def hand_out(self, stream: str, text: str) -> None:
        self.text[stream] += text


def read(feed: Feed) -> Decoded:
    """Drive the layers the way `_Reader.read`/`take` do (seq checks aside)."""
    decoded = Decoded()
    for frame in (frame for block in feed.blocks() for frame in frames(block)):
        decoded.frames.append(frame)
        kind = frame.get("type") if type(frame) is dict else None
        if type(kind) is not str:  # as _Reader._take_frames decides
            raise cx.ProtocolError("an output frame is not an object with a type")
        if kind == "data":
            _, stream, text = cx._data_frame(frame)
            decoded.output.feed(stream, cx._base64(text))
        elif kind == "exit":
            decoded.status = cx._exit_status(frame)
            break  # the reader stops at the exit frame
    decoded.output.finish()
    # A clean EOF without an exit frame ends here too; _Reader.read then
    # raises _Retryable ("clean EOF before the exit frame") and resumes.
    return decoded


def outcome(feed: Feed) -> Any:
    """`read(feed)`, or the error it failed closed with; anything else fails the test."""
    STATS["examples"] += 1
    try:
        return read(feed)
    except cx.CreateOSError as exc:
        return exc
    except cx._Retryable:
        # The one non-public exception allowed: `_Reader.blocks` raises it at the
        # END of the input when the last line is unterminated. That is the
        # documented "broken connection" signal; `_Follower.follow` turns it into
        # a resume from the cursor, so it never reaches the caller.
        assert feed.exhausted and feed.data and not feed.data.endswith(b"\n")
        return RETRY
    except BaseException:
        STATS["errors_other_than_createos"] += 1
        raise


# --------------------------------------------------------------------------
# Strategies: arbitrary bytes, valid NDJSON streams, corruption
# --------------------------------------------------------------------------

CHUNK_SIZES = st.lists(st.integers(1, 64), min_size=1, max_size=8)
NASTY = [b"\n", b"\r", b"\xff", b"\xe2\x82", b"\x00", b'"', b"{", b"}", b"[", b"\\", b",", b":"]
BYTES = st.lists(
    st.binary(max_size=24) | st.sampled_from(NASTY) | st.sampled_from([b'{"type":"heartbeat"}']),
    max_size=30,
).map(b"".join)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 256, 1.0, 2.5, float("nan"), float("inf")])
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
SIGNALS = {
    "SIGKILL": "SIGKILL",
    "SIGTERM": "SIGTERM",
    "SIGRTMIN1": "SIGRTMIN1",
    "killed": "SIGKILL",
    "Terminated": "SIGTERM",
    "segmentation fault": "SIGSEGV",
}


@st.composite
def outputs(draw: Any) -> List[Tuple[str, bytes]]:
    """(stream, payload) per data frame; text is cut at random byte offsets, so
    multi-byte characters are split across frames (and across the streams)."""
    frames: List[Tuple[str, bytes]] = []
    for _ in range(draw(st.integers(0, 8))):
        stream = draw(st.sampled_from(STREAMS))
        blob = draw(
            st.binary(max_size=16)
            | st.text(max_size=8).map(lambda text: text.encode("utf-8", "surrogatepass"))
        )
        cuts = sorted(draw(st.lists(st.integers(0, len(blob)), max_size=3)))
        edges = [0, *cuts, len(blob)]
        frames.extend((stream, blob[a:b]) for a, b in zip(edges, edges[1:]))
    return frames


class Valid:
    """A valid NDJSON stream and what the client must make of it."""

    def __init__(
        self,
        items: List[Tuple[int, Dict[str, Any]]],
        payloads: List[Tuple[str, bytes]],
        status: cx._Exit,
        encode: Any,
    ) -> None:
        self.items = items  # (seq of the last data frame so far, frame), exit frame last
        self.payloads = payloads
        self.status = status
        self.encode = encode  # frame -> line bytes, newline included

    @property
    def frames(self) -> List[Dict[str, Any]]:
        return [frame for _, frame in self.items]

    def body(self, after: int = 0) -> Tuple[bytes, List[Tuple[int, int]]]:
        """The connect body that replays from seq `after` + 1, and (end offset, seq)
        of each data line in it."""
        parts: List[bytes] = []
        ends: List[Tuple[int, int]] = []
        size = 0
        for position, frame in self.items:
            if frame["type"] == "data" and frame["seq"] <= after:
                continue
            if frame["type"] == "heartbeat" and position < after:
                continue
            line = self.encode(frame)
            parts.append(line)
            size += len(line)
            if frame["type"] == "data":
                ends.append((size, frame["seq"]))
        return b"".join(parts), ends

    def text(self, stream: str) -> str:
        raw = b"".join(p for s, p in self.payloads if s == stream)
        return raw.decode("utf-8", "replace")

    def callbacks(self) -> Tuple[List[Tuple[str, str]], str]:
        """What on_output must see, in order, and the combined `output`."""
        decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in STREAMS}
        seen = [(s, decoders[s].decode(p)) for s, p in self.payloads]
        seen += [(s, decoders[s].decode(b"", True)) for s in STREAMS]
        seen = [(s, t) for s, t in seen if t]
        return seen, "".join(t for _, t in seen)


@st.composite
def valid_streams(draw: Any) -> Valid:
    payloads = draw(outputs())
    items: List[Tuple[int, Dict[str, Any]]] = []
    seq = 0
    for stream, payload in payloads:
        if draw(st.integers(0, 3)) == 0:
            items.append((seq, {"type": "heartbeat"}))
        seq += 1
        frame: Dict[str, Any] = {
            "type": "data",
            "seq": seq,
            "stream": stream,
            "data_base64": base64.b64encode(payload).decode("ascii"),
        }
        if draw(st.integers(0, 4)) == 0:  # unknown extra fields are ignored
            frame["note"] = draw(st.text(max_size=6)) + "\u2028é€😀"
        items.append((seq, frame))
    kind = draw(st.sampled_from(["code", "signal", "both"]))
    code = draw(st.integers(0, 255))
    word = draw(st.sampled_from(sorted(SIGNALS)))
    exit_frame: Dict[str, Any] = {"type": "exit"}
    if kind in ("code", "both"):
        exit_frame["exit_code"] = code
    if kind in ("signal", "both"):
        exit_frame["signal"] = word
    elif draw(st.booleans()):
        exit_frame["signal"] = None
    items.append((seq, exit_frame))
    status = cx._Exit(code, None) if kind == "code" else cx._Exit(None, SIGNALS[word])

    ensure_ascii, sort_keys, compact, crlf = draw(st.tuples(*[st.booleans()] * 4))

    def encode(frame: Dict[str, Any]) -> bytes:
        text = json.dumps(
            frame,
            ensure_ascii=ensure_ascii,
            sort_keys=sort_keys,
            separators=(",", ":") if compact else None,
        )
        return text.encode("utf-8", "surrogatepass") + (b"\r\n" if crlf else b"\n")

    return Valid(items, payloads, status, encode)


FIELDS = ["type", "seq", "stream", "data_base64", "exit_code", "signal", "error", "note"]
FIELD_EDITS = st.lists(
    st.tuples(st.integers(0, 30), st.sampled_from(FIELDS), st.just(None) | JSON.map(lambda v: [v])),
    max_size=3,
)
BYTE_EDITS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "delete", "insert", "truncate", "duplicate"]),
        st.floats(0, 1),
        st.sampled_from(NASTY) | st.binary(min_size=1, max_size=3),
    ),
    max_size=4,
)


def corrupt(valid: Valid, field_edits: Any, byte_edits: Any) -> bytes:
    """The valid stream with some fields replaced (or removed) and some bytes mangled."""
    frames = [dict(frame) for frame in valid.frames]
    for index, field, value in field_edits:
        frame = frames[index % len(frames)]
        if value is None:
            frame.pop(field, None)
        else:
            frame[field] = value[0]
    data = b"".join(json.dumps(frame).encode("utf-8", "surrogatepass") + b"\n" for frame in frames)
    for op, where, blob in byte_edits:
        at = int(where * len(data))
        if op == "flip" and at < len(data):
            data = data[:at] + bytes([data[at] ^ (blob[0] or 1)]) + data[at + 1 :]
        elif op == "delete":
            data = data[:at] + data[at + len(blob) :]
        elif op == "insert":
            data = data[:at] + blob + data[at:]
        elif op == "truncate":
            data = data[:at]
        elif op == "duplicate":
            data = data[:at] + data[at // 2 : at] + data[at:]
    return data


# --------------------------------------------------------------------------
# (a) the internals
# --------------------------------------------------------------------------


def lines_oracle(data: bytes, limit: int) -> Tuple[List[bytes], Any]:
    """The lines `_Reader.blocks` must hand out for `data`, however it is chunked."""
    *lines, tail = data.split(b"\n")
    good: List[bytes] = []
    for line in lines:
        if len(line) > limit:
            return good, cx.ProtocolError
        good.append(line)
    if not tail:
        return good, None
    return good, cx.ProtocolError if len(tail) > limit else cx._Retryable


@fuzz()
@given(data=BYTES, limit=st.integers(0, 40), sizes=CHUNK_SIZES)
def test_lines_split_exactly_and_never_buffer_past_the_limit(data, limit, sizes):
    STATS["examples"] += 1
    feed = Feed(split(data, sizes), limit)
    expected_lines, expected_error = lines_oracle(data, limit)
    got: List[bytes] = []
    error = None
    try:
        for line in feed.lines():
            got.append(line)
    except (cx.ProtocolError, cx._Retryable) as exc:
        error = type(exc)
    assert got == expected_lines
    assert error is expected_error
    # An oversized line fails as soon as its buffered part passes the limit,
    # not when (if ever) its newline arrives.
    assert feed.max_pending <= limit


@fuzz()
@given(data=BYTES | st.binary(max_size=400), sizes=CHUNK_SIZES)
def test_arbitrary_bytes_fail_closed(data, sizes):
    result = outcome(Feed(split(data, sizes)))
    if isinstance(result, Decoded):  # it happened to be a valid stream
        assert all(isinstance(frame["type"], str) for frame in result.frames)


@fuzz()
@given(valid=valid_streams(), sizes=CHUNK_SIZES)
def test_valid_ndjson_in_any_chunks_decodes_exactly(valid, sizes):
    data, _ = valid.body()
    feed = Feed(split(data, sizes))
    result = outcome(feed)
    assert isinstance(result, Decoded), result
    assert result.frames == valid.frames
    assert result.status == valid.status
    for name in STREAMS:
        assert result.text[name] == valid.text(name)
        assert result.output.tails[name].text() == valid.text(name)
    assert feed.emitted == len(data) and feed.consumed == len(data)


@fuzz()
@given(valid=valid_streams(), fields=FIELD_EDITS, edits=BYTE_EDITS, sizes=CHUNK_SIZES)
def test_corrupted_ndjson_fails_closed(valid, fields, edits, sizes):
    data = corrupt(valid, fields, edits)
    result = outcome(Feed(split(data, sizes)))
    if isinstance(result, cx.CreateOSError):
        assert type(result) is cx.ProtocolError, type(result)
        assert result.problem and "{" not in str(result)  # a fixed sentence, no frame text
    if not fields and not edits:
        assert isinstance(result, Decoded) and result.status == valid.status


@fuzz(300)
@given(text=st.text(alphabet="AQgw/+=9aZ_-\n ", max_size=13) | JSON)
def test_base64_accepts_only_canonical_text(text):
    STATS["examples"] += 1
    if not isinstance(text, str):  # _data_frame lets only strings through
        frame = {"type": "data", "seq": 1, "stream": "stdout", "data_base64": text}
        with pytest.raises(cx.ProtocolError):
            cx._data_frame(frame)
        return
    try:
        payload = cx._base64(text)
    except cx.ProtocolError:
        return
    assert base64.b64encode(payload).decode("ascii") == text


LINE_PIECES = st.sampled_from(
    [
        b'{"type":"heartbeat"}',
        b'{"type":"exit","exit_code":0}',
        b'{"type":"a"},{"type":"b"}',  # two objects on one line
        b'{"type":"c","x":"',  # a string left open ...
        b'"}',  # ... closed on the next line
        b'{"type":"d","x":[{"y":1}',  # an array left open ...
        b'{"z":2}]}',  # ... closed on the next line
        b"null",
        b",null,",
        b'{"type":"e","x":null}',
        b" ",
        b"\r",
        b"\t",
        b"\xff",
        b"\xed\xa0\x80",  # a UTF-8-encoded surrogate
        b"[",
        b"]",
        b",",
        b"",
    ]
)
LINES = st.lists(
    st.lists(LINE_PIECES | JSON.map(lambda v: json.dumps(v).encode()), max_size=3).map(b"".join),
    min_size=1,
    max_size=8,
)


def per_nd(lines: List[bytes]) -> Tuple[List[Any], bool]:
    """What a reader that parses one line at a time makes of `lines`."""
    values = []
    for line in lines:
        try:
            values.append(json.loads(line.decode("utf-8")))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError among them
            return values, True
    return values, False


@fuzz(400)
@given(lines=LINES)
@example(lines=[b'{"type":"a"},{"type":"b"}', b'{"type":"c","x":"', b'"}'])  # 3 lines, 3 objects
@example(lines=[b'{"type":"a"},{"type":"b"}', b'{"type":"d","x":[{"y":1}', b'{"z":2}]}'])
@example(lines=[b'{"type":"a"},null,{"type":"b"}', b'{"type":"d","x":[{"y":1}', b'{"z":2}]}'])
def test_a_block_is_parsed_exactly_as_its_lines_one_at_a_time(lines):
    """Parsing a block in one pass may never accept a line that alone would fail
    (two values on one line, a value spread over lines) nor reject a good one."""
    STATS["examples"] += 1
    expected, fails = per_nd(lines)
    got = []
    failed = False
    try:
        for frame in frames(b"".join(line + b"\n" for line in lines)):
            got.append(frame)
    except cx.ProtocolError:
        failed = True
    assert json.dumps(got) == json.dumps(expected)  # NaN != NaN, its spelling is equal
    assert failed is fails


PLAIN = {"head": "", "seq": "7", "stream": '"stdout"', "data": '"aGk="', "tail": "}"}
PLAIN_VARIANTS = {  # each makes a line that is not in the service's own form, or not JSON
    "head": [" ", "\t", "x"],
    "seq": ["0", "01", "-1", "1.0", "1e2", "9" * 19, "true", '"7"'],
    "stream": ['"stderr"', '"pty"', '"std\\u006fut"', "null"],
    "data": ['""', '"QQ=="', '"a\\u0047k="', '"a\\/k="', '"aGk"', '"é"', '"a Gk="', "5", '"aGk\\"'],
    "tail": ["} ", "}\r", ',"x":1}', "}}", "", "]", "}\udcff", ',"seq":8}'],
}


@st.composite
def plain_lines(draw: Any) -> bytes:
    """A data line in the service's form, with at most one field changed."""
    fields = dict(PLAIN)
    field = draw(st.sampled_from([None, *PLAIN_VARIANTS]))
    if field is not None:
        fields[field] = draw(st.sampled_from(PLAIN_VARIANTS[field]))
    text = '%(head)s{"type":"data","seq":%(seq)s,"stream":%(stream)s,"data_base64":%(data)s'
    return (text % fields + fields["tail"]).encode("utf-8", "surrogateescape")


PLAIN_LINES = st.lists(
    plain_lines()
    | st.sampled_from(
        [
            b'{"seq":1,"type":"data","stream":"stdout","data_base64":"aGk="}',
            b'{"type":"heartbeat"}',
        ]
    ),
    min_size=1,
    max_size=4,
)


@fuzz(400)
@given(lines=PLAIN_LINES)
def test_plain_data_lines_are_read_exactly_as_json(lines):
    """The pattern for lines in the service's own form may only take lines whose
    JSON value is exactly what its groups say; a block it takes whole must be
    read exactly as the JSON route reads it."""
    STATS["examples"] += 1
    block = b"".join(line + b"\n" for line in lines)
    text = utf8_text(block)
    found = None if text is None else cx._service_lines(text)
    if found is not None:
        assert len(found) == len(lines)
        for line, (seq, stream, data) in zip(lines, found):
            value = json.loads(line)
            if not seq:
                assert value == {"type": "heartbeat"} and list(value) == ["type"]
                continue
            assert value == {"type": "data", "seq": int(seq), "stream": stream, "data_base64": data}
            assert type(value["seq"]) is int
            assert list(value) == ["type", "seq", "stream", "data_base64"]
            assert int(seq) >= 1 and stream in cx._ALL_STREAMS  # what _data_frame checks
    for cursor in (0, 1):
        agrees_with_json(block, cursor)


LONG = base64.b64encode(bytes(range(256)) * 2 + b"tail").decode()  # 692 characters, "=" at the end
LONG_VARIANTS = [  # each is a line the JSON scanner must decide
    '"%s"' % LONG.replace("/", "\\/", 1),  # an escape JSON allows
    '"%s\\u0041%s"' % (LONG[:100], LONG[101:]),
    '"%s"' % LONG.replace("=", "", 1),
    '"%s"' % (LONG[:-2] + "Q="),  # unused bits set
    '"%s"' % (LONG[:300] + " " + LONG[300:]),
    '"%s","x":"y"' % LONG,
    '"%s"}\n{"type":"data","seq":8,"stream":"stdout","data_base64":"%s"' % (LONG, LONG),
]


@fuzz(200)
@given(
    field=st.sampled_from([None, *PLAIN_VARIANTS]),
    data=st.sampled_from(['"%s"' % LONG, *LONG_VARIANTS]),
    choice=st.integers(0, 10),
)
def test_a_long_data_line_is_read_exactly_as_json(field, data, choice):
    """A long line in the service's form is read without the JSON scanner;
    whatever that path takes must be exactly what JSON and _data_frame say."""
    STATS["examples"] += 1
    fields = dict(PLAIN, data=data)
    if field is not None and field != "data":
        fields[field] = PLAIN_VARIANTS[field][choice % len(PLAIN_VARIANTS[field])]
    line = '%(head)s{"type":"data","seq":%(seq)s,"stream":%(stream)s,"data_base64":%(data)s'
    text = line % fields + fields["tail"] + "\n"
    own = fields == dict(PLAIN, data='"%s"' % LONG)
    line = cx._service_lines(text)
    assert line is not None or not own  # the service's own form is taken without JSON
    if line is not None:
        value = json.loads(text)
        assert list(value) == ["type", "seq", "stream", "data_base64"] and value["type"] == "data"
        assert line == [(str(value["seq"]), value["stream"], value["data_base64"])]
    agrees_with_json(text.encode("utf-8", "surrogateescape"), 6)


@st.composite
def base64_texts(draw: Any) -> str:
    """Base64 of some bytes, often with one character changed, removed or added."""
    text = base64.b64encode(draw(st.binary(max_size=7))).decode()
    edit = draw(st.sampled_from(["none", "change", "remove", "add"]))
    if edit == "none":
        return text
    place = draw(st.integers(0, len(text)))
    character = draw(st.sampled_from(string.ascii_letters + string.digits + "+/="))
    if edit == "change" and place < len(text):
        return text[:place] + character + text[place + 1 :]
    if edit == "remove":
        return text[:place] + text[place + 1 :]
    return text[:place] + character + text[place:]


def frame_by_frame(texts: List[str]) -> Tuple[bytes, bool]:
    """The payload _base64 accepts of `texts`, one at a time, and whether one failed."""
    payload = b""
    for text in texts:
        try:
            payload += cx._base64(text)
        except cx.ProtocolError:
            return payload, True
    return payload, False


def as_one_block(texts: List[str]) -> Tuple[bytes, bool]:
    """The payload delivered of a block of data lines with `texts`, and whether it failed."""
    line = '{"type":"data","seq":%d,"stream":"stdout","data_base64":"%s"}\n'
    block = "".join(line % (seq, text) for seq, text in enumerate(texts, 1)).encode()
    _, delivered, failed, _ = taken(take_block(block))
    return "".join(text for _, text in delivered).encode("latin-1"), failed


@fuzz(400)
@given(texts=st.lists(base64_texts(), min_size=1, max_size=4))
@example(texts=["QUI=", "QUJDA==", "QQ=="])  # in the pattern, but not whole quanta
def test_a_run_of_data_lines_decodes_exactly_as_frame_by_frame(texts):
    """A block of data lines that simply continue one stream is decoded in one
    pass; it must accept and decode exactly what _base64 does frame by
    frame, up to the first bad frame."""
    STATS["examples"] += 1
    assert as_one_block(texts) == frame_by_frame(texts)


# --------------------------------------------------------------------------
# (b) the public path: Client.execute() against canned answers
# --------------------------------------------------------------------------

EXITED = exited(0, exit_code=0)


class Body(io.BufferedReader):
    """A response body read in the given pieces, optionally reset after them.

    `responses` hands a BufferedReader body to urllib3 as it is, so each
    `read1()` here is one chunk as the reader takes it (the body is not
    chunked); the reset surfaces from urllib3 as a real one does.
    """

    def __init__(self, pieces: Sequence[bytes], reset: bool = False) -> None:
        super().__init__(io.BytesIO(b""))  # type: ignore[arg-type]
        self._pieces = collections.deque(pieces)
        self._reset = reset

    def read(self, size: Optional[int] = -1) -> bytes:
        if self._pieces:
            return self._pieces.popleft()
        if self._reset:
            self._reset = False
            raise ConnectionResetError("connection reset by peer")
        self.close()
        return b""

    read1 = read  # a body that is not chunked is read with read1()


def after_of(request: Any) -> int:
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(request.url).query))
    return int(query["after"])


@contextlib.contextmanager
def mocked() -> Iterator[Tuple[responses.RequestsMock, Any]]:
    """The canned API, and a record whose `calls` outlive the mock's reset (for
    support.calls). Not the `rsps` fixture: hypothesis runs many examples in one test.
    """
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        add_created(mock)
        add_deleted(mock)
        made = types.SimpleNamespace(calls=[])
        try:
            yield mock, made
        finally:
            made.calls.extend(mock.calls)


CUTS = st.lists(
    st.tuples(
        st.integers(0, 3),  # replay overlap: frames re-sent from before `after`
        st.floats(0, 0.999),  # where the body is cut
        st.booleans(),  # True: a connection reset; False: a clean EOF
    ),
    max_size=5,
)


def through_execute(max_examples: int, **strategies: Any) -> Callable[[Any], Any]:
    """A fuzz test of execute() on canned answers: valid_streams() read in
    CHUNK_SIZES and `strategies`, `max_examples` examples, 120 s in all."""

    hunt = given(valid=valid_streams(), sizes=CHUNK_SIZES, **strategies)
    return lambda test: fuzz(max_examples, timeout=120)(hunt(test))


@through_execute(100, cuts=CUTS, limit=st.just(4 * 1024 * 1024) | st.integers(0, 40))
def test_valid_streams_through_execute_come_back_exactly(valid, cuts, sizes, limit):
    STATS["examples"] += 1
    afters: List[int] = []
    expected_afters = [0]

    def connect(request: Any) -> Any:
        after = after_of(request)
        afters.append(after)
        number = len(afters) - 1
        if number >= len(cuts):
            body, _ = valid.body(after)
            return (200, {}, Body(split(body, sizes)))
        overlap, where, reset = cuts[number]
        body, ends = valid.body(max(0, after - overlap))
        cut = int(where * len(body))
        # The cursor the client must resume from: the last data line that
        # arrived whole, newline included.
        expected_afters.append(max([after] + [seq for end, seq in ends if end <= cut]))
        return (200, {}, Body(split(body[:cut], sizes), reset=reset))

    seen: List[Tuple[str, str]] = []
    # Up to five cuts without progress in a row (CUTS), each a failure of the policy.
    retry = dataclasses.replace(CANNED_RETRY, max_attempts=10)
    with mocked() as (mock, made), make_client(retry=retry) as local:
        mock.add_callback(responses.GET, CONNECT, callback=connect)
        try:
            result = local.execute(
                SB,
                ["fuzz"],
                max_output_chars=limit,
                on_output=lambda stream, text: seen.append((stream, text)),
            )
        except BaseException:
            STATS["errors_other_than_createos"] += 1
            raise
    expected_seen, combined = valid.callbacks()
    assert seen == expected_seen  # live, in order, never twice
    for name in STREAMS:
        full = valid.text(name)
        assert getattr(result, name) == (full[-limit:] if limit else "")
        assert getattr(result, name + "_truncated") == (len(full) > limit)
    assert result.output == (combined[-limit:] if limit else "")
    assert (result.exit_code, result.signal) == tuple(valid.status)
    assert not result.timed_out and not result.exit_recovered
    assert result.process_id == PID
    assert result.reconnects == len(cuts) == len(afters) - 1
    assert afters == expected_afters  # resumed after the last accepted seq, every time
    assert len(calls(made, "POST", PROCS)) == 1


# What the server may answer to a later connect or to a wait, in the corrupted runs.
ANSWERS = st.one_of(
    st.tuples(st.sampled_from([200, 410, 404, 408, 429, 500, 503]), JSON | st.binary(max_size=40)),
    st.tuples(st.just(200), BYTES),
)


@through_execute(
    150,
    fields=FIELD_EDITS,
    edits=BYTE_EDITS,
    reset=st.booleans(),
    later=st.lists(ANSWERS, max_size=3),
    waits=st.lists(ANSWERS | st.tuples(st.just(200), st.just(ok(EXITED))), max_size=3),
)
def test_corrupted_streams_through_execute_fail_closed(
    valid, fields, edits, sizes, reset, later, waits
):
    STATS["examples"] += 1
    first = corrupt(valid, fields, edits)
    connects: List[int] = []
    waited: List[int] = []

    def canned(status: int, body: Any) -> Any:
        if isinstance(body, bytes):
            return (status, {}, Body(split(body, sizes)))
        return (status, {"Content-Type": "application/json"}, json.dumps(body))

    def connect(request: Any) -> Any:
        connects.append(after_of(request))
        if len(connects) == 1:
            return (200, {}, Body(split(first, sizes), reset=reset))
        if len(connects) - 2 < len(later):
            return canned(*later[len(connects) - 2])
        return (503, {}, "")  # bounded: the run must end once the answers run out

    def wait(request: Any) -> Any:
        waited.append(1)
        if len(waited) <= len(waits):
            return canned(*waits[len(waited) - 1])
        return (503, {}, "")

    with mocked() as (mock, made), make_client(retry=CANNED_THREE_TRIES) as local:
        mock.add_callback(responses.GET, CONNECT, callback=connect)
        mock.add_callback(responses.GET, WAIT, callback=wait)
        try:
            result = local.execute(SB, ["fuzz"], on_output=lambda stream, text: None)
        except cx.CreateOSError as exc:
            # Contained: whatever went wrong after creation, the tree was deleted.
            assert len(calls(mock, "DELETE", PROC)) == 1
            assert exc.process_id == PID
            assert_clean(exc)
            assert "{" not in str(exc)
            return
        except BaseException:
            STATS["errors_other_than_createos"] += 1
            raise
    assert isinstance(result, cx.ExecResult)
    assert result.exit_code is not None or result.signal is not None
    if not fields and not edits and not reset:
        assert (result.exit_code, result.signal) == tuple(valid.status)
        assert (result.stdout, result.stderr) == (valid.text("stdout"), valid.text("stderr"))


# --------------------------------------------------------------------------
# Found while fuzzing (fixed): JSON nested too deeply for json.loads
# --------------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000  # RecursionError inside json.loads
FIRST = nd(data(1, "stdout", b"first\n"))


@pytest.mark.timeout(180)  # a hang guard
@pytest.mark.parametrize("where", ["410 on connect", "wait", "create", "delete"])
def test_deeply_nested_json_answers_are_protocol_errors(where):
    mock = responses.RequestsMock(assert_all_requests_are_fired=False)
    with mock, make_client() as local:
        if where == "create":
            mock.add(responses.POST, PROCS, body=DEEP)
            mock.add(responses.GET, PROCS, json=ok({"processes": []}))
        else:
            mock.add(responses.POST, PROCS, json=ok(process_record()))
        mock.add(
            responses.DELETE,
            PROC,
            **({"body": DEEP} if where == "delete" else {"json": ok(EXITED)}),
        )
        if where == "410 on connect":
            mock.add(responses.GET, CONNECT, status=410, body=DEEP)
        elif where == "wait":
            mock.add(responses.GET, CONNECT, body=FIRST + nd({"type": "exit"}))
            mock.add(responses.GET, WAIT, body=DEEP)
        else:  # a gap: the run fails and the tree is deleted
            mock.add(responses.GET, CONNECT, body=FIRST + nd(data(3, "stdout", b"x")))
        with pytest.raises(cx.CreateOSError):
            local.execute(SB, ["fuzz"])
