"""A synthetic CreateOS server that streams pre-generated NDJSON output as fast as it can.

It runs in a process of its own (``StreamServer`` starts it with
``subprocess``), so that it never shares a GIL with the readers being
measured. Every stream body, chunk framing included, is generated once at
start-up; while a reader is timed the server only calls ``sendall`` with
1 MiB slices of it.

Each ``Shape`` is a stream: an amount of UTF-8 text (mostly ASCII, with 2- and
3-byte characters, cut at fixed byte sizes so that characters are split
across frames), the data-frame size, and the HTTP chunking (one chunk per
frame, or fixed-size chunks that cut lines anywhere). A mixed shape
interleaves stdout and stderr frames (runs of 1 to 32 stdout frames and 1 to 4
stderr frames, from a seeded generator, as a build log interleaves them),
sends a heartbeat line after every 500th data frame, and its two texts are
the text of the other shapes (2- and 3-byte characters among ASCII), each
stream cut into frames on its own: a character split by a frame boundary is
finished by the next frame of the same stream, often after frames of the
other one.

Endpoints, for any sandbox id (the answers mimic ``tests/local_server.py``):

- ``GET /v1/sandboxes/{id}``: a running sandbox (the official SDK asks for it);
- ``POST /v1/sandboxes/{id}/processes``: a process record whose id names the
  shape; the shape is the ``cmd`` or any of the ``args`` of the request;
- ``GET …/processes/{pid}/connect?after=N``: the shape's frames with
  ``seq`` > N, then ``{"type":"exit","exit_code":0}``;
- ``GET …/processes``, ``GET …/processes/{pid}``, ``…/wait``, ``DELETE …``
  and ``PUT …/files``: what a client may need when something goes wrong.

Run by ``StreamServer``: ``python stream_server.py SPEC_JSON`` prints one JSON
line (port and, per shape, what a reader must receive), then serves until its
standard input is closed.
"""

from __future__ import annotations

import binascii
import dataclasses
import datetime
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
from typing import Any, Dict, Iterable, List, Optional, Tuple

SANDBOX = "sb_bench"
API_KEY = "bench-key"
TAIL_CHARS = 1000  # characters at the end of each stream that readers check
SEND_SLICE = 1024 * 1024  # bytes per sendall while streaming

# About one character in six is not ASCII: 2-byte Latin and 3-byte CJK, dash, quotes, euro.
_LINE_TEXT = (
    " The quick brown fox jumps over the lazy dog - déjà vu, naïve façade, smörgåsbord;"
    " 日本語のテキスト — “quoted” €12.50 text, ASCII mostly."
)
_BLOCK_TEXT = (_LINE_TEXT * 8 + "\n").encode("utf-8")
# The texts of a mixed shape: the characters of the other shapes (2- and
# 3-byte ones among ASCII), marked per stream, so that it differs from them
# in its framing alone (interleaving, heartbeats). A 4-byte character would
# make every decoded text twice as wide in memory (UCS-4).
_MIXED_TEXTS = {
    "stdout": " out:" + _LINE_TEXT * 8 + "\n",
    "stderr": " err:" + _LINE_TEXT * 8 + "\n",
}
_MIXED_BLOCKS = {name: text.encode("utf-8") for name, text in _MIXED_TEXTS.items()}
_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))
_EXIT_LINE = b'{"type":"exit","exit_code":0}\n'
_HEARTBEAT_LINE = b'{"type":"heartbeat"}\n'
STREAMS = ("stdout", "stderr")
MIXED_SEED = 20240601  # the interleaving of a mixed shape is the same on every run
# Frames per run of one stream in a mixed shape, at least and at most: stdout
# in runs with stderr between them, as a build log interleaves them.
MIXED_RUNS = ((1, 32), (1, 4))  # stdout, stderr
HEARTBEAT_EVERY = 500  # data frames between heartbeats in a mixed shape


@dataclasses.dataclass(frozen=True)
class Shape:
    """One output stream: `payload_bytes` of text in frames of `frame_bytes`.

    `chunk_bytes` 0 sends each frame as one HTTP chunk (as CreateOS does);
    otherwise the NDJSON text is cut into HTTP chunks of that size. `mixed`:
    the payload is shared by stdout and stderr, interleaved in runs of
    MIXED_RUNS frames, with a heartbeat after every HEARTBEAT_EVERY data
    frames; otherwise it is all stdout.
    """

    name: str
    payload_bytes: int
    frame_bytes: int
    chunk_bytes: int = 0
    mixed: bool = False

    @property
    def frames(self) -> int:
        return -(-self.payload_bytes // self.frame_bytes)


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a reader of a shape must end up with; per stream, by stream name."""

    payload_bytes: int  # both streams
    frames: int  # data frames
    heartbeats: int
    body_bytes: int  # size of the chunked body, framing included
    stream_bytes: Dict[str, int]
    chars: Dict[str, int]
    tails: Dict[str, str]  # the last TAIL_CHARS characters of each stream ("" if none)


# --------------------------------------------------------------------------
# Payload and body generation


def payload(size: int, text: bytes = _BLOCK_TEXT) -> bytes:
    """`size` bytes of numbered lines of `text`, cut at `size`; ends on a whole character."""
    parts = []
    total = 0
    number = 0
    while total < size:
        block = b"%09d" % number + text
        parts.append(block)
        total += len(block)
        number += 1
    data = b"".join(parts)[:size]
    return _whole_last_character(data)


def _whole_last_character(data: bytes) -> bytes:
    """Replace a character cut by the end of `data` with dots (same size)."""
    start = len(data) - 1
    while start > 0 and data[start] & 0xC0 == 0x80:
        start -= 1
    if start < 0:
        return data
    lead = data[start]
    width = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    if start + width > len(data):
        return data[:start] + b"." * (len(data) - start)
    return data


def stream_order(frames: int) -> bytes:
    """The stream of each data frame of a mixed shape (0 stdout, 1 stderr), in order:
    runs of MIXED_RUNS frames, the streams alternating, the lengths seeded."""
    rng = random.Random(MIXED_SEED)
    order = bytearray()
    stream = 0
    while len(order) < frames:
        order += bytes((stream,)) * rng.randint(*MIXED_RUNS[stream])
        stream ^= 1
    return bytes(order[:frames])


def stream_data(shape: Shape) -> Dict[str, bytes]:
    """The payload of each stream of `shape`: all on stdout, or shared as its frames are."""
    if not shape.mixed:
        return {"stdout": payload(shape.payload_bytes), "stderr": b""}
    order = stream_order(shape.frames)
    last = shape.payload_bytes - (shape.frames - 1) * shape.frame_bytes  # the last frame's size
    sizes = [order.count(index) * shape.frame_bytes for index in (0, 1)]
    sizes[order[-1]] -= shape.frame_bytes - last
    return {name: payload(size, _MIXED_BLOCKS[name]) for name, size in zip(STREAMS, sizes)}


def expected_of(shape: Shape, data: Dict[str, bytes], body_bytes: int) -> Expected:
    chars, tails = {}, {}
    for name, text in data.items():
        chars[name] = len(text.translate(None, _CONTINUATION_BYTES))  # one lead byte each
        tails[name] = text[-4 * TAIL_CHARS :].decode("utf-8", "ignore")[-TAIL_CHARS:]
    return Expected(
        payload_bytes=sum(len(text) for text in data.values()),
        frames=shape.frames,
        heartbeats=shape.frames // HEARTBEAT_EVERY if shape.mixed else 0,
        body_bytes=body_bytes,
        stream_bytes={name: len(text) for name, text in data.items()},
        chars=chars,
        tails=tails,
    )


def frame_lines(shape: Shape, data: Dict[str, bytes], first_seq: int = 1) -> Iterable[bytes]:
    """The NDJSON lines of the data frames from `first_seq` on (and of the heartbeats
    among them), newline included."""
    if not shape.mixed:
        view = memoryview(data["stdout"])
        size = shape.frame_bytes
        for offset in range((first_seq - 1) * size, len(view), size):
            encoded = binascii.b2a_base64(view[offset : offset + size], newline=False)
            seq = offset // size + 1
            yield b'{"type":"data","seq":%d,"stream":"stdout","data_base64":"%s"}\n' % (
                seq,
                encoded,
            )
        return
    views = [memoryview(data[name]) for name in STREAMS]
    names = [name.encode("ascii") for name in STREAMS]
    offsets = [0, 0]
    for seq, index in enumerate(stream_order(shape.frames), 1):
        offset = offsets[index]
        offsets[index] = offset + shape.frame_bytes
        if seq < first_seq:
            continue
        encoded = binascii.b2a_base64(
            views[index][offset : offset + shape.frame_bytes], newline=False
        )
        yield b'{"type":"data","seq":%d,"stream":"%s","data_base64":"%s"}\n' % (
            seq,
            names[index],
            encoded,
        )
        if seq % HEARTBEAT_EVERY == 0:
            yield _HEARTBEAT_LINE


def chunked_body(shape: Shape, data: Dict[str, bytes], first_seq: int = 1) -> bytearray:
    """The whole chunked HTTP body of a connect: data frames, exit frame, last chunk."""
    body = bytearray()
    lines = frame_lines(shape, data, first_seq)
    if shape.chunk_bytes == 0:
        for line in lines:
            body += b"%X\r\n" % len(line)
            body += line
            body += b"\r\n"
        body += b"%X\r\n%s\r\n" % (len(_EXIT_LINE), _EXIT_LINE)
    else:
        text = b"".join(lines) + _EXIT_LINE
        for offset in range(0, len(text), shape.chunk_bytes):
            piece = text[offset : offset + shape.chunk_bytes]
            body += b"%X\r\n" % len(piece)
            body += piece
            body += b"\r\n"
    body += b"0\r\n\r\n"
    return body


# --------------------------------------------------------------------------
# HTTP


class _Request:
    def __init__(self, method: str, target: str, headers: Dict[str, str], body: bytes) -> None:
        self.method = method
        self.path, _, query = target.partition("?")
        self.query = dict(item.partition("=")[::2] for item in query.split("&") if item)
        self.headers = headers
        self.body = body


_STATUS_TEXT = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found"}
_SANDBOX_PATH = re.compile(r"/v1/sandboxes/([^/]+)\Z")
_PROCESSES_PATH = re.compile(r"/v1/sandboxes/([^/]+)/processes\Z")
_PROCESS_PATH = re.compile(r"/v1/sandboxes/([^/]+)/processes/([^/]+)(/connect|/wait)?\Z")
_FILES_PATH = re.compile(r"/v1/sandboxes/([^/]+)/files\Z")


def _read_request(reader: Any) -> Optional[_Request]:
    line = reader.readline(65537)
    if not line.strip():
        return None
    method, target, _version = line.decode("latin-1").split(" ", 2)
    headers = {}
    while True:
        header = reader.readline(65537)
        if header in (b"\r\n", b"\n", b""):
            break
        name, _, value = header.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length") or 0)
    return _Request(method, target, headers, reader.read(length) if length else b"")


def _utc_now() -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _App:
    """The endpoints, answering from the pre-generated bodies."""

    def __init__(self, shapes: List[Shape]) -> None:
        self.shapes = {shape.name: shape for shape in shapes}
        self.bodies: Dict[str, bytearray] = {}
        self.expected: Dict[str, Expected] = {}
        self._counter = 0
        self._lock = threading.Lock()
        for shape in shapes:
            data = stream_data(shape)
            body = chunked_body(shape, data)
            self.bodies[shape.name] = body
            self.expected[shape.name] = expected_of(shape, data, len(body))

    def serve_connection(self, sock: socket.socket) -> None:
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = sock.makefile("rb")
            try:
                while True:
                    request = _read_request(reader)
                    if request is None:
                        return
                    self.answer(sock, request)
                    if request.headers.get("connection", "").lower() == "close":
                        return
            except OSError:  # the reader went away
                return

    def answer(self, sock: socket.socket, request: _Request) -> None:
        if request.headers.get("x-api-key") != API_KEY:
            return _send_json(sock, 401, {"status": "fail", "data": {"auth": "invalid key"}})
        path, method = request.path, request.method
        process = _PROCESS_PATH.match(path)
        if process and method == "GET" and process.group(3) == "/connect":
            return self._stream(sock, process.group(2), request.query)
        if process and (method == "DELETE" or (method == "GET" and process.group(3) != "/connect")):
            return self._send_record(sock, process.group(2), exited=True)
        if _PROCESSES_PATH.match(path) and method == "POST":
            return self._create(sock, request)
        if _PROCESSES_PATH.match(path) and method == "GET":
            return _send_json(sock, 200, _success({"processes": []}))
        sandbox = _SANDBOX_PATH.match(path)
        if sandbox and method == "GET":
            record = {"id": sandbox.group(1), "status": "running", "envs": []}
            return _send_json(sock, 200, _success(record))
        if _FILES_PATH.match(path) and method == "PUT":
            stored = {"path": request.query.get("path", ""), "bytes": len(request.body)}
            return _send_json(sock, 200, _success(stored))
        return _send_json(sock, 404, {"status": "fail", "data": {"path": "no such endpoint"}})

    def _create(self, sock: socket.socket, request: _Request) -> None:
        spec = json.loads(request.body)
        words = [spec.get("cmd")] + list(spec.get("args") or [])
        names = [word for word in words if word in self.shapes]
        if not names:
            return _send_json(sock, 400, {"status": "fail", "data": {"cmd": "no known shape"}})
        with self._lock:
            self._counter += 1
            process_id = "proc_%016d_%s" % (self._counter, names[-1])
        self._send_record(sock, process_id, exited=False, spec=spec)

    def _send_record(
        self, sock: socket.socket, process_id: str, *, exited: bool, spec: Any = None
    ) -> None:
        shape = self._shape_of(process_id)
        if shape is None:
            return _send_json(sock, 404, {"status": "fail", "data": {"process": "not found"}})
        newest = shape.frames if exited else 0
        record = {
            "process_id": process_id,
            "kind": "process",
            "pid": 4242,
            "state": "exited" if exited else "running",
            "leader_exited": exited,
            "tree_exited": exited,
            "created_at": _utc_now(),
            "finished_at": _utc_now() if exited else None,
            "exit_code": 0 if exited else None,
            "signal": None,
            "cmd": (spec or {}).get("cmd", shape.name),
            "args": list((spec or {}).get("args") or []),
            "cwd": "/",
            "output": {"oldest_seq": 1 if newest else 0, "newest_seq": newest, "bytes": 0},
        }
        _send_json(sock, 200, _success(record))

    def _shape_of(self, process_id: str) -> Optional[Shape]:
        parts = process_id.split("_", 2)
        return self.shapes.get(parts[2]) if len(parts) == 3 else None

    def _stream(self, sock: socket.socket, process_id: str, query: Dict[str, str]) -> None:
        shape = self._shape_of(process_id)
        if shape is None:
            return _send_json(sock, 404, {"status": "fail", "data": {"process": "not found"}})
        after = int(query.get("after") or 0)
        if after == 0:
            body = self.bodies[shape.name]
        else:  # a resume: rare here, so generated on demand
            body = chunked_body(shape, stream_data(shape), min(after, shape.frames) + 1)
        sock.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
            b"Cache-Control: no-store\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        view = memoryview(body)
        for offset in range(0, len(body), SEND_SLICE):
            sock.sendall(view[offset : offset + SEND_SLICE])


def _success(data: Any) -> Dict[str, Any]:
    return {"status": "success", "data": data}


def _send_json(sock: socket.socket, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode("utf-8")
    head = "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
        status,
        _STATUS_TEXT.get(status, "Error"),
        len(body),
    )
    sock.sendall(head.encode("ascii") + body)


def _accept_forever(listener: socket.socket, app: _App) -> None:
    while True:
        sock, _ = listener.accept()
        threading.Thread(target=app.serve_connection, args=(sock,), daemon=True).start()


def main(argv: List[str]) -> int:
    spec = json.loads(argv[1])
    app = _App([Shape(**shape) for shape in spec["shapes"]])
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    threading.Thread(target=_accept_forever, args=(listener, app), daemon=True).start()
    ready = {
        "port": listener.getsockname()[1],
        "expected": {name: dataclasses.asdict(exp) for name, exp in app.expected.items()},
    }
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    sys.stdin.buffer.read()  # serve until the parent closes our standard input
    os._exit(0)  # skip freeing gigabytes of bodies


# --------------------------------------------------------------------------
# The parent's side


class StreamServer:
    """Starts the server process for `shapes`; a context manager.

    `url`, `address` and `expected[shape name]` are set once it is ready.
    """

    def __init__(self, shapes: Iterable[Shape]) -> None:
        spec = {"shapes": [dataclasses.asdict(shape) for shape in shapes]}
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("the stream server did not start")
        ready = json.loads(line)
        self.address: Tuple[str, int] = ("127.0.0.1", ready["port"])
        self.url = "http://127.0.0.1:%d" % ready["port"]
        self.expected = {name: Expected(**exp) for name, exp in ready["expected"].items()}

    def close(self) -> None:
        process = self._process
        if process.stdin is not None and not process.stdin.closed:
            process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def __enter__(self) -> "StreamServer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def connect_path(shape_name: str, number: int = 0) -> str:
    """The connect path of a process of `shape_name` that nobody created (raw readers)."""
    return "/v1/sandboxes/%s/processes/proc_%016d_%s/connect?after=0" % (
        SANDBOX,
        number,
        shape_name,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv))
