"""The readers compared by the throughput benchmark, each checked against what it must receive.

- ``drain``: the server alone: reads the response to EOF and counts bytes.
- ``read_per_line``: the decode ceiling: a raw socket, hand-made HTTP/1.1
  de-chunking, and per line only the unavoidable work: one ``json.loads``,
  strict base64, incremental UTF-8 decoding (one decoder per stream;
  heartbeats are counted and skipped).
- ``read_batched``: the same, but one ``json.loads`` per block of complete
  lines (``[line,line,…]``).
- ``ExecuteReader``: ``createos_exec.Client.execute`` end to end, with an
  ``on_output`` callback that counts characters; or ``start()`` and a loop
  over ``iter_output()`` that counts them; or, with ``text=False``, the bytes.
- ``SdkReader``: the official SDK (``createos``): ``processes.create`` and the
  ``processes.connect`` iteration, decoding each data event with the same
  incremental UTF-8 decoder.

Every reader returns a ``Received`` that ``verify`` compares with the
stream's ``Expected``, stdout and stderr each on its own (bytes, characters,
last characters): a reader that skips work, or mixes up the streams, cannot
pass. The raw readers and the SDK also check that ``seq`` grows by one.
"""

from __future__ import annotations

import binascii
import codecs
import json
import socket
import sys
from typing import Any, Callable, Dict, Iterable, Iterator, NamedTuple, Optional, Tuple

from stream_server import API_KEY, SANDBOX, STREAMS, TAIL_CHARS, Expected

RECV_BYTES = 256 * 1024
DIRECT_CHUNK_BYTES = 16 * 1024  # a chunk at least this big that outgrows the buffer
MAX_OUTPUT_CHARS = 4 * 1024 * 1024  # createos_exec's default max_output_chars
STRICT_BASE64 = sys.version_info >= (3, 11)  # a2b_base64(strict_mode=True)


class VerificationError(Exception):
    """A reader did not receive exactly the stream it was sent."""


class Received(NamedTuple):
    """What a reader got, per stream name (stdout, stderr)."""

    stream_bytes: Optional[Dict[str, int]]  # None: the reader does not see bytes (execute)
    chars: Optional[Dict[str, int]]  # None: the reader does not decode (execute(text=False))
    tails: Dict[str, str]  # the last characters the reader decoded of each stream
    exit_code: Optional[int]
    heartbeats: Optional[int] = None  # None: the reader does not see them


def verify(reader: str, got: Received, expected: Expected) -> None:
    problems = []
    for name in STREAMS:
        if got.stream_bytes is not None and got.stream_bytes[name] != expected.stream_bytes[name]:
            problems.append(
                "%d %s payload bytes, expected %d"
                % (got.stream_bytes[name], name, expected.stream_bytes[name])
            )
        if got.chars is not None and got.chars[name] != expected.chars[name]:
            problems.append(
                "%d %s characters, expected %d" % (got.chars[name], name, expected.chars[name])
            )
        tail, expected_tail = got.tails[name][-TAIL_CHARS:], expected.tails[name]
        if bool(tail) != bool(expected_tail) or not expected_tail.endswith(tail):
            problems.append("the last characters of %s differ from the stream's" % name)
    if got.heartbeats is not None and got.heartbeats != expected.heartbeats:
        problems.append("%d heartbeats, expected %d" % (got.heartbeats, expected.heartbeats))
    if got.exit_code != 0:
        problems.append("exit code %r" % (got.exit_code,))
    if problems:
        raise VerificationError("%s: %s" % (reader, "; ".join(problems)))


def received(
    out: Tuple[int, int, str, Any], err: Tuple[int, int, str, Any], exit_code: Any, heartbeats: int
) -> Received:
    """What a reader counted of each stream (bytes, characters, last text, decoder),
    with the characters its decoder still held at the end."""
    counted = {}
    for name, (size, chars, last, decode) in zip(STREAMS, (out, err)):
        rest = decode(b"", True)
        counted[name] = (size, chars + len(rest), last + rest)
    return Received(
        {name: c[0] for name, c in counted.items()},
        {name: c[1] for name, c in counted.items()},
        {name: c[2] for name, c in counted.items()},
        exit_code,
        heartbeats,
    )


# --------------------------------------------------------------------------
# Raw sockets


def open_stream(address: Tuple[str, int], path: str) -> Tuple[socket.socket, bytes]:
    """Send GET `path` (Connection: close); the socket and the body bytes already read."""
    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = (
        "GET %s HTTP/1.1\r\nHost: %s:%d\r\nX-Api-Key: %s\r\n"
        "Accept: application/x-ndjson\r\nConnection: close\r\n\r\n"
    ) % (path, address[0], address[1], API_KEY)
    sock.sendall(request.encode("ascii"))
    head = b""
    end = -1
    while end < 0:
        data = sock.recv(65536)
        if not data:
            sock.close()
            raise VerificationError("the server closed the connection before its headers")
        head += data
        end = head.find(b"\r\n\r\n")
    status_line, *header_lines = head[:end].decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    if status_line.split(" ")[1] != "200" or headers.get("transfer-encoding") != "chunked":
        sock.close()
        raise VerificationError("unexpected answer to the connect: %s" % status_line)
    return sock, head[end + 4 :]


def drain(address: Tuple[str, int], path: str, expected: Expected) -> Received:
    """The server alone: read the response to EOF without parsing; count bytes."""
    sock, initial = open_stream(address, path)
    with sock:
        buf = bytearray(RECV_BYTES)
        view = memoryview(buf)
        recv_into = sock.recv_into
        total = len(initial)
        last = initial
        n = recv_into(buf)
        while n:
            total += n
            last = bytes(view[max(0, n - 5) : n]) if n >= 5 else last[-5:] + bytes(view[:n])
            n = recv_into(buf)
    if total != expected.body_bytes or not last.endswith(b"0\r\n\r\n"):
        raise VerificationError("drain: %d body bytes, expected %d" % (total, expected.body_bytes))
    # Nothing was decoded: report the stream's own figures, the bytes were counted.
    return Received(expected.stream_bytes, expected.chars, expected.tails, 0, expected.heartbeats)


def dechunked(sock: socket.socket, initial: bytes) -> Iterator[bytes]:
    """The de-chunked body of a chunked HTTP/1.1 response: one bytes object per recv.

    Receives into one 256 KiB buffer; the chunk data of each recv is sliced
    out of it without copies and joined once. A big chunk that goes on past
    the buffer is received straight into a buffer of its own instead.
    """
    buf = bytearray(RECV_BYTES)
    view = memoryview(buf)
    n = len(initial)
    buf[:n] = initial
    find = buf.find
    recv_into = sock.recv_into
    pos = 0
    need = 0  # bytes of the current chunk not seen yet
    skip = 0  # 2 once a chunk's data ended: its CRLF precedes the next size line
    while True:
        pieces = []
        while pos < n:
            if not need:
                start = pos + skip
                eol = find(b"\r\n", start, n)
                if eol < 0:
                    break  # the size line goes on in the next recv
                need = int(buf[start:eol], 16)
                pos = eol + 2
                skip = 2
                if not need:  # the last chunk
                    if pieces:
                        yield b"".join(pieces)
                    return
            end = pos + need
            if end > n:
                if need >= DIRECT_CHUNK_BYTES:  # receive the rest of it in place
                    if pieces:
                        yield b"".join(pieces)
                        pieces = []
                    yield receive_rest_of_chunk(sock, view[pos:n], need)
                    need = 0
                    pos = n
                    break
                end = n
            pieces.append(view[pos:end])
            need -= end - pos
            pos = end
        if pieces:
            yield b"".join(pieces)
            del pieces
        rest = n - pos  # an unfinished size line moves to the front
        if rest:
            buf[:rest] = bytes(view[pos:n])
        received = recv_into(view[rest:])
        if not received:
            raise VerificationError("the body ended before its last chunk")
        n = rest + received
        pos = 0


def receive_rest_of_chunk(sock: socket.socket, start: memoryview, size: int) -> bytearray:
    """A chunk of `size` bytes whose first bytes are `start`, received straight into place."""
    chunk = bytearray(size)
    have = len(start)
    chunk[:have] = start
    into = memoryview(chunk)
    recv_into = sock.recv_into
    while have < size:
        received = recv_into(into[have:], size - have)
        if not received:
            raise VerificationError("the body ended inside a chunk")
        have += received
    return chunk


def ndjson_text(blocks: Iterator[bytes]) -> Iterator[str]:
    """`blocks` decoded from UTF-8 (a character cut by a block waits for the next)."""
    utf_8_decode = codecs.utf_8_decode
    carry = b""
    for block in blocks:
        if carry:
            block = carry + block
        text, used = utf_8_decode(block, "strict", False)
        carry = block[used:]
        yield text
    if carry:
        raise VerificationError("the body ends inside a UTF-8 character")


def read_per_line(address: Tuple[str, int], path: str) -> Received:
    """The per-line ceiling: de-chunk by hand, one json.loads per NDJSON line."""
    return read_ndjson(address, path, "per-line", parse_lines)


def parse_lines(lines: str) -> Iterable[Any]:
    if lines.find("\n") == len(lines) - 1:
        return (json.loads(lines),)  # one line: json.loads ignores its newline
    return map(json.loads, lines[:-1].split("\n"))


def read_batched(address: Tuple[str, int], path: str) -> Received:
    """The batched ceiling: de-chunk by hand, one json.loads per block of complete lines.

    The complete lines of each recv become one JSON array: NDJSON lines never
    hold a raw newline, so replacing each "\\n" with "," joins them.
    """
    return read_ndjson(address, path, "batched", parse_block)


def parse_block(lines: str) -> Iterable[Any]:
    if lines.find("\n") == len(lines) - 1:
        return (json.loads(lines),)  # one line: no array to build
    return json.loads("[%s]" % lines[:-1].replace("\n", ","))  # type: ignore[no-any-return]


def read_ndjson(
    address: Tuple[str, int], path: str, reader: str, parse: Callable[[str], Iterable[Any]]
) -> Received:
    """Read the stream, `parse` each run of complete lines (newlines included), then
    do the unavoidable work per frame: strict base64, incremental UTF-8 decoding
    with one decoder per stream. The two streams keep their figures in locals
    of their own: this loop is the ceiling, a lookup per frame would lower it."""
    sock, initial = open_stream(address, path)
    with sock:
        a2b = binascii.a2b_base64
        decode_out = codecs.getincrementaldecoder("utf-8")("replace").decode
        decode_err = codecs.getincrementaldecoder("utf-8")("replace").decode
        seq = out_bytes = out_chars = err_bytes = err_chars = heartbeats = 0
        out_last = err_last = ""
        exit_code = None
        pending = ""  # a line cut by the end of a recv
        for text in ndjson_text(dechunked(sock, initial)):
            if pending:
                text = pending + text
            cut = text.rfind("\n") + 1
            if cut < len(text):
                pending = text[cut:]
                text = text[:cut]
            else:
                pending = ""
            if not text:
                continue
            for frame in parse(text):
                kind = frame["type"]
                if kind == "data":
                    seq += 1
                    if frame["seq"] != seq:
                        raise VerificationError(
                            "%s: seq %r, expected %d" % (reader, frame["seq"], seq)
                        )
                    if STRICT_BASE64:
                        raw = a2b(frame["data_base64"], strict_mode=True)  # novermin
                    else:
                        raw = a2b(frame["data_base64"])
                    stream = frame["stream"]
                    if stream == "stdout":
                        out_bytes += len(raw)
                        output = decode_out(raw)
                        out_chars += len(output)
                        out_last = output or out_last
                    elif stream == "stderr":
                        err_bytes += len(raw)
                        output = decode_err(raw)
                        err_chars += len(output)
                        err_last = output or err_last
                    else:
                        raise VerificationError("%s: unknown stream %r" % (reader, stream))
                elif kind == "heartbeat":
                    heartbeats += 1
                elif kind == "exit":
                    exit_code = frame.get("exit_code")
                else:
                    raise VerificationError("%s: unexpected frame %r" % (reader, kind))
        if pending:
            raise VerificationError("%s: the body ended inside a line" % reader)
        out = (out_bytes, out_chars, out_last, decode_out)
        return received(out, (err_bytes, err_chars, err_last, decode_err), exit_code, heartbeats)


# --------------------------------------------------------------------------
# createos_exec and the official SDK


class ExecuteReader:
    """createos_exec.Client(...).execute(sandbox, shape, on_output=count): one client, reused.

    With `iterate`, the same command through start() and a loop over
    iter_output() that counts, then wait(): the two routes to live output.
    With `text` false, execute(text=False): it counts bytes, and the last
    characters are those its last bytes decode to.
    """

    def __init__(self, url: str, iterate: bool = False, text: bool = True) -> None:
        import createos_exec

        self.client = createos_exec.Client(url, API_KEY)
        self.iterate = iterate
        self.text = text
        self.label = "iter_output" if iterate else "execute" if text else "execute(text=False)"

    def read(self, shape_name: str) -> Received:
        out_chars = err_chars = 0
        strangers = []

        def count(stream: str, text: str) -> None:
            nonlocal out_chars, err_chars
            if stream == "stdout":
                out_chars += len(text)
            elif stream == "stderr":
                err_chars += len(text)
            else:
                strangers.append(stream)

        if self.iterate:
            process = self.client.start(SANDBOX, shape_name)
            for stream, text in process.iter_output():
                count(stream, text)
            result = process.wait()
        else:
            result = self.client.execute(SANDBOX, shape_name, on_output=count, text=self.text)
        kept = {"stdout": result.stdout, "stderr": result.stderr, "output": result.output}
        counted = {"stdout": out_chars, "stderr": err_chars, "output": out_chars + err_chars}
        for name, text in kept.items():
            if len(text) != min(counted[name], MAX_OUTPUT_CHARS):
                raise VerificationError(
                    "%s: %s holds %d characters of %d"
                    % (self.label, name, len(text), counted[name])
                )
        if strangers or result.reconnects:
            raise VerificationError(
                "%s: output of streams %r, %d reconnects"
                % (self.label, strangers, result.reconnects)
            )
        counts = {"stdout": out_chars, "stderr": err_chars}
        if not self.text:  # a character cut at the start of the last bytes is left out
            last = {
                name: kept[name][-4 * TAIL_CHARS :].decode("utf-8", "ignore") for name in counts
            }
            return Received(counts, None, last, result.exit_code)
        return Received(
            None,
            counts,
            {"stdout": result.stdout[-TAIL_CHARS:], "stderr": result.stderr[-TAIL_CHARS:]},
            result.exit_code,
        )

    def close(self) -> None:
        self.client.close()


def load_sdk() -> Any:
    """The official SDK module, or None when it cannot be imported (it needs Python 3.10+)."""
    try:
        import createos
    except ImportError:
        return None
    return createos if hasattr(createos, "SandboxInstance") else None


class SdkReader:
    """The official SDK: processes.create, then iterate processes.connect(), decoding data."""

    def __init__(self, sdk: Any, url: str) -> None:
        self.sdk = sdk
        self.client = sdk.Client(api_key=API_KEY, base_url=url)
        self.sandbox = self.client.get_sandbox(SANDBOX)

    def read(self, shape_name: str) -> Received:
        sdk = self.sdk
        processes = self.sandbox.processes
        created = processes.create(sdk.ManagedProcessCreateRequest(command=shape_name))
        data_kind = sdk.ManagedProcessConnectEventType.DATA
        exit_kind = sdk.ManagedProcessConnectEventType.EXIT
        heartbeat_kind = sdk.ManagedProcessConnectEventType.HEARTBEAT
        stdout, stderr = sdk.ManagedProcessStream.STDOUT, sdk.ManagedProcessStream.STDERR
        decode_out = codecs.getincrementaldecoder("utf-8")("replace").decode
        decode_err = codecs.getincrementaldecoder("utf-8")("replace").decode
        seq = out_bytes = out_chars = err_bytes = err_chars = heartbeats = 0
        out_last = err_last = ""
        exit_code = None
        options = sdk.ManagedProcessConnectOptions(after_sequence=0)
        with processes.connect(created.process_id, options) as events:
            for event in events:  # to the end of the body: the connection is reused
                if event.type == data_kind:
                    seq += 1
                    if event.sequence != seq:
                        raise VerificationError("SDK: seq %r, expected %d" % (event.sequence, seq))
                    if event.stream is stdout:
                        out_bytes += len(event.data)
                        text = decode_out(event.data)
                        out_chars += len(text)
                        out_last = text or out_last
                    elif event.stream is stderr:
                        err_bytes += len(event.data)
                        text = decode_err(event.data)
                        err_chars += len(text)
                        err_last = text or err_last
                    else:
                        raise VerificationError("SDK: unknown stream %r" % (event.stream,))
                elif event.type == heartbeat_kind:
                    heartbeats += 1
                elif event.type == exit_kind:
                    exit_code = event.exit_code
        out = (out_bytes, out_chars, out_last, decode_out)
        return received(out, (err_bytes, err_chars, err_last, decode_err), exit_code, heartbeats)

    def close(self) -> None:
        self.client.close()
