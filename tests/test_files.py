"""put() and get() against the local server: a file arrives whole or not at all
(docs/design.md, behaviour 16), from every kind of source into every kind of
destination, and under injected faults (RELIABILITY.md item 13), with nothing
left behind on either side. The local server's files are this machine's, so
"the sandbox's directory" is a temporary directory here."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import random
import shutil
import stat
import subprocess
import tarfile
import threading

import pytest
import responses
from support import (
    EXEC,
    FILES,
    SANDBOX,
    SB,
    calls,
    campaign_size,
    figures_at_end,
    make_client,
    ok,
    until,
)

import createos_exec as cx

# The bounded run keeps a few MiB; the campaign a size past every piece size.
LARGE = campaign_size("CREATEOS_FILES_LARGE", 3 * 1024 * 1024 + 17, 40 * 1024 * 1024 + 17)
CONTENTS = {
    "empty": b"",
    "all 256 byte values": bytes(range(256)) * 3,
    "large": bytes(range(256)) * (LARGE // 256) + b"\x00\xff\n\r",
}


def leftovers(*directories: str) -> list:
    """Every temporary copy or tree left in `directories` (their whole trees)."""
    return [
        name
        for directory in directories
        for _, folders, names in os.walk(directory)
        for name in folders + names
        if name.endswith(".part")
    ]


def info_of(path: str, data: bytes) -> cx.FileInfo:
    return cx.FileInfo(path, len(data), hashlib.sha256(data).hexdigest())


class Unseekable(io.RawIOBase):
    """A binary stream that cannot seek (a pipe's, a socket's), that can raise
    `interrupt` once `after` bytes went through it."""

    def __init__(self, data: bytes = b"", after: int = -1, interrupt=KeyboardInterrupt):
        self._data, self._done, self._after, self._interrupt = data, 0, after, interrupt
        self.written = bytearray()

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._check(len(buffer))
        piece = self._data[self._done : self._done + len(buffer)]
        buffer[: len(piece)] = piece
        self._done += len(piece)
        return len(piece)

    def write(self, piece) -> int:
        self._check(len(piece))
        self.written += piece
        self._done += len(piece)
        return len(piece)

    def _check(self, amount: int) -> None:
        if 0 <= self._after < self._done + amount:
            raise self._interrupt()


class ReadAlone:
    """A source with read() and nothing else: it cannot say whether it seeks."""

    def __init__(self, data: bytes):
        self.read = io.BytesIO(data).read


def sources(data: bytes, tmp_path) -> dict:
    local = tmp_path / "local-source"
    local.write_bytes(data)
    return {
        "path": str(local),
        "pathlike": local,
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "seekable file": io.BytesIO(data),
        "file that cannot seek": io.BufferedReader(Unseekable(data)),
        "object with read() alone": ReadAlone(data),
    }


# --------------------------------------------------------------------------
# Both ways, every kind of source and destination


@pytest.mark.both_readings
@pytest.mark.parametrize("content", list(CONTENTS))
def test_every_source_arrives_whole_in_a_new_directory_and_comes_back(client, tmp_path, content):
    data = CONTENTS[content]
    remote = tmp_path / "sandbox"
    for kind, source in sources(data, tmp_path).items():
        path = str(remote / kind / "deeper" / "file.bin")  # parents that do not exist yet
        assert client.put(SANDBOX, source, path) == info_of(path, data), kind
        assert open(path, "rb").read() == data, kind
    path = str(remote / "bytes" / "deeper" / "file.bin")
    local = tmp_path / "here" / "copy.bin"  # its directory made by get()
    assert client.get(SANDBOX, path) == data
    assert client.get(SANDBOX, path, str(local)) == info_of(str(local), data)
    assert local.read_bytes() == data
    into = io.BytesIO(b"kept ahead:")
    into.seek(0, io.SEEK_END)
    assert client.get(SANDBOX, path, into) == info_of(path, data)
    assert into.getvalue() == b"kept ahead:" + data
    unseekable = Unseekable()
    client.get(SANDBOX, path, unseekable)
    assert bytes(unseekable.written) == data
    assert leftovers(str(tmp_path)) == []


def test_module_level_functions_use_the_environment(server, tmp_path, monkeypatch):
    monkeypatch.setenv("CREATEOS_API_URL", server.url)
    monkeypatch.setenv("CREATEOS_API_KEY", server.api_key)
    path = str(tmp_path / "module.txt")
    assert cx.put(SANDBOX, b"module", path) == info_of(path, b"module")
    assert cx.get(SANDBOX, path) == b"module"
    with make_client(server) as client:
        assert cx.get(SANDBOX, path, client=client, max_bytes=6) == b"module"
        assert cx.put(SANDBOX, b"again", path, client=client, mode=0o600).size == 5


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_modes_come_from_mode_then_the_local_file_then_the_replaced_file_then_the_umask(
    client, tmp_path
):
    """As scp -p and fabric: a local file's mode travels with it, both ways."""
    umask = os.umask(0o022)
    os.umask(umask)
    local, remote, back = tmp_path / "tool.sh", tmp_path / "tool", tmp_path / "back"
    local.write_bytes(b"#!/bin/sh\n")
    local.chmod(0o751)
    client.put(SANDBOX, str(local), str(remote))
    assert mode_of(remote) == 0o751
    client.put(SANDBOX, b"#!/bin/sh\necho new\n", str(remote))
    assert mode_of(remote) == 0o751 and remote.read_bytes() == b"#!/bin/sh\necho new\n"
    client.put(SANDBOX, str(local), str(remote), mode=0o700)
    assert mode_of(remote) == 0o700
    client.put(SANDBOX, b"new", str(tmp_path / "fresh"))
    assert mode_of(tmp_path / "fresh") == 0o666 & ~umask
    client.get(SANDBOX, str(remote), str(back))
    assert mode_of(back) == 0o700


@pytest.mark.parametrize("way", ["put", "get"])
def test_a_directory_or_a_trailing_slash_takes_a_file_in_under_its_own_name(client, tmp_path, way):
    here, there = tmp_path / "here", tmp_path / "there"
    (here / "in").mkdir(parents=True)
    (there / "in").mkdir(parents=True)
    source = (here if way == "put" else there) / "report.txt"
    source.write_bytes(b"report")
    into = there if way == "put" else here
    move = client.put if way == "put" else client.get
    for given, lands in [(into / "in", into / "in"), (f"{into}/new/", into / "new")]:
        info = move(SANDBOX, str(source), str(given))
        assert info == info_of(str(lands / "report.txt"), b"report")
        assert (lands / "report.txt").read_bytes() == b"report"
    assert leftovers(str(tmp_path)) == []


def test_a_symlink_at_the_destination_is_written_through_both_ways(client, tmp_path):
    """As scp writes through a link (it opens the path): the link stays, its target
    changes, atomically, wherever it lies."""
    (tmp_path / "elsewhere").mkdir()
    for way in ("put", "get"):
        target, link = tmp_path / "elsewhere" / f"{way}.conf", tmp_path / f"{way}.conf"
        target.write_bytes(b"old")
        link.symlink_to(target)
        if way == "put":
            client.put(SANDBOX, b"new", str(link))
        else:
            (tmp_path / "remote.conf").write_bytes(b"new")
            client.get(SANDBOX, str(tmp_path / "remote.conf"), str(link))
        assert link.is_symlink() and target.read_bytes() == b"new", way
    assert leftovers(str(tmp_path)) == []


# --------------------------------------------------------------------------
# A source that changes while it is read


def aged(path) -> None:
    """An old modification time: a rewrite at once is sure to move it."""
    os.utime(path, (1e9, 1e9))


@pytest.mark.parametrize("change", ["shrinks", "grows", "is rewritten"])
@pytest.mark.parametrize("kind", ["a file", "a file of a directory"])
def test_a_local_file_that_changes_while_sent_is_refused_at_once(
    client, server, tmp_path, change, kind
):
    """Not a request waiting for the bytes its length promised: a TransferError
    naming the local file, the destination as it was. Nor a request cut off:
    the service may handle that one after the removal of its temporary copy,
    and leave a part of it (held here until put() has raised). Its body ends
    there, whole, and its answer comes before the removal."""
    source = tmp_path / "source"
    changing = source / "data.bin" if kind != "a file" else source
    changing.parent.mkdir(exist_ok=True)
    changing.write_bytes(os.urandom(1024 * 1024))
    aged(changing)
    rewrites = {"shrinks": "r+b", "grows": "ab", "is rewritten": "r+b"}

    def progress(done, total):
        if progress.once:
            progress.once = False
            with open(changing, rewrites[change]) as file:
                file.write(b"changed")
                if change == "shrinks":
                    file.truncate(100_000)

    progress.once = True
    remote, put_raised = tmp_path / "remote", threading.Event()
    server.hold_cut_upload(until=put_raised)
    with pytest.raises(cx.TransferError) as raised:
        client.put(SANDBOX, str(source), str(remote), progress=progress)
    put_raised.set()
    assert raised.value.reason == "source_changed" and repr(str(changing)) in str(raised.value)
    answered = until(lambda: [seen.status for seen in server.requests if seen.method == "PUT"])
    assert leftovers(str(tmp_path)) == [] and not remote.exists() and answered == [200]


@pytest.mark.parametrize("when", ["read whole", "a cut reading goes on"])
def test_a_remote_file_that_changes_while_read_is_said_to_have_changed(
    client, server, tmp_path, monkeypatch, when
):
    """Whether the sandbox described it before, during or after the change: its
    stamp moved, or it was written while the download ran. Once its first bytes
    arrived, its start is rewritten (what arrived is no longer in it) and its
    end (which the download then reads, past what the sockets between can
    hold: a receiving buffer grows to 32 MiB here), so that no version of the
    file is what was read."""
    size, rewritten = 64 * 1024 * 1024, 16 * 1024 * 1024
    if when != "read whole":
        monkeypatch.setattr(cx, "_PIECE_SIZE", 256 * 1024)
        size, rewritten = 2 * 1024 * 1024, 1024
        server.drop_download(after_bytes=size // 2)
    remote = tmp_path / "growing.log"
    remote.write_bytes(os.urandom(size))
    aged(remote)

    def rewrite(done, total):
        if rewrite.once:
            rewrite.once = False
            with open(remote, "r+b") as file:
                file.write(os.urandom(1024))
                file.seek(-rewritten, io.SEEK_END)
                file.write(os.urandom(rewritten))

    rewrite.once = True
    local = tmp_path / "here.log"
    with pytest.raises(cx.TransferError, match="changed while it was read") as raised:
        client.get(SANDBOX, str(remote), str(local), progress=rewrite)
    assert raised.value.reason == "changed"
    assert not local.exists() and leftovers(str(tmp_path)) == []


def requests_of(server, call) -> list:
    """The requests `call()` made, as (method, endpoint, status), in the order they came."""
    before = len(server.requests)
    call()
    return [(r.method, r.path.rsplit("/", 1)[-1], r.status) for r in server.requests[before:]]


@pytest.mark.both_readings
def test_a_small_file_takes_few_requests(client, server, tmp_path):
    """A 1 KiB put: the PUT and one exec (a missing parent: one mkdir exec more,
    and the PUT again where the service does not create parents); a get: one
    exec and the GET, sent together."""
    data = os.urandom(1024)
    path = str(tmp_path / "new" / "small.bin")
    first = requests_of(server, lambda: client.put(SANDBOX, data, path))
    if server.reading.upload_creates_parents:
        assert first == [("PUT", "files", 200), ("POST", "exec", 200)]
    else:
        assert first == [("PUT", "files", 404)] + [("POST", "exec", 200), ("PUT", "files", 200)] + [
            ("POST", "exec", 200)
        ]
    assert requests_of(server, lambda: client.put(SANDBOX, data, path)) == [
        ("PUT", "files", 200),
        ("POST", "exec", 200),
    ]
    assert sorted(requests_of(server, lambda: client.get(SANDBOX, path))) == [
        ("GET", "files", 200),
        ("POST", "exec", 200),
    ]


# --------------------------------------------------------------------------
# A large file in pieces: a cut or a damaged piece is sent or read again alone

PIECE = 256 * 1024  # a read's size: a cut loses the read it happens in


class Counted(io.BytesIO):
    """A seekable binary file that counts the bytes read from it and written to it."""

    def __init__(self, data: bytes = b""):
        super().__init__(data)
        self.moved = 0

    def read(self, amount=-1):
        piece = super().read(amount)
        self.moved += len(piece)
        return piece

    def write(self, piece):
        self.moved += len(piece)
        return super().write(piece)


@pytest.fixture
def pieces(monkeypatch):
    monkeypatch.setattr(cx, "_PIECE_SIZE", PIECE)


@pytest.mark.parametrize("fault", ["", "cut", "corrupted", "corrupted last"])
def test_a_large_file_goes_in_pieces_and_a_cut_or_damaged_one_is_sent_again_alone(
    client, server, tmp_path, pieces, fault
):
    data = os.urandom(5 * PIECE + 100)  # 5 whole pieces and a short one
    source, path = Counted(data), str(tmp_path / "big.bin")
    if fault:  # on the third piece, or on the last
        inject(server, "files_put", fault.split()[0], PIECE // 3, skip=5 if "last" in fault else 2)
    told = []
    info = client.put(SANDBOX, source, path, progress=lambda *seen: told.append(seen))
    assert info == info_of(path, data) and open(path, "rb").read() == data
    sent_again = {"": 0, "corrupted last": len(data) - 5 * PIECE}.get(fault, PIECE)
    assert source.moved - len(data) == sent_again
    assert len(server.requests_to("files_put")) == 6 + bool(fault)
    assert told[-1] == (len(data), len(data)) and leftovers(str(tmp_path)) == []
    assert sorted(told) == told or fault  # back to the piece's start when it is sent again


@pytest.mark.parametrize("into", ["a local path", "bytes", "a file that seeks"])
@pytest.mark.parametrize("then", [None, "cut", "corrupted"])
def test_a_cut_get_goes_on_from_the_last_whole_piece(
    client, server, tmp_path, monkeypatch, pieces, into, then
):
    data = os.urandom(5 * PIECE + 100)
    remote, local = tmp_path / "remote.bin", str(tmp_path / "here.bin")
    remote.write_bytes(data)
    server.drop_download(after_bytes=2 * PIECE + PIECE // 2)
    if then:  # and on the piece after the first one read again
        inject(server, "files_get", then, PIECE // 3, skip=1)
    written = Counted()  # what reaches the destination, whatever its kind
    destination = {"bytes": None, "a local path": local}.get(into, written)
    if into != "a file that seeks":
        kind = cx._Sink if into == "bytes" else cx._FileSink
        moving = kind.write
        counted = lambda sink, piece: (written.write(piece), moving(sink, piece))  # noqa: E731
        monkeypatch.setattr(kind, "write", counted)
    got = client.get(SANDBOX, str(remote), destination)
    if into != "bytes":
        got = written.getvalue() if destination is written else open(local, "rb").read()
    assert got == data
    assert written.moved - len(data) <= PIECE // 2 + (PIECE if then else 0)
    gets = [r.query["path"] for r in server.requests_to("files_get")]
    assert gets[0] == str(remote) and len(gets) == 1 + 4 + bool(then)  # and the pieces 2 to 5
    assert leftovers(str(tmp_path)) == []


# --------------------------------------------------------------------------
# Directories: one archive each way, a staged tree renamed into place, each entry checked


def tree_of(root) -> dict:
    """Every entry under `root` by its path: its type and mode, a file's bytes, a link's target."""
    found = {}
    for folder, folders, names in os.walk(root):
        for name in folders + names:
            path = os.path.join(folder, name)
            mode = os.lstat(path).st_mode
            found[os.path.relpath(path, root)] = (
                ("link", os.readlink(path))
                if stat.S_ISLNK(mode)
                else (stat.S_IMODE(mode), None if stat.S_ISDIR(mode) else open(path, "rb").read())
            )
    return found


LONG = "n" * 150  # past a tar header's 100 characters: GNU's long names, pax records


def make_tree(root, big: int = 2 * 1024 * 1024) -> dict:
    """A tree of what a tree may hold: empty files and directories, modes,
    symlinks, a hard link, a name with a tab and a space, long names and a long
    link target, a read-only directory, a file hashed by openssl there (1 MiB or
    more); tree_of() it."""
    (root / "sub" / "empty dir").mkdir(parents=True)
    for name, data, mode in [
        ("a.txt", b"alpha\n", 0o644),
        ("empty", b"", 0o600),
        ("odd\tname with space", bytes(range(256)), 0o640),
        ("sub/run.sh", b"#!/bin/sh\n", 0o750),
        ("frozen/kept", b"kept", 0o444),
        (f"{LONG}/{LONG}", b"long", 0o644),
        ("big.bin", os.urandom(big), 0o644),
    ]:
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_bytes(data)
        (root / name).chmod(mode)
    (root / "sub" / "link").symlink_to("../a.txt")
    (root / "far").symlink_to(f"{LONG}/{LONG}")
    os.link(root / "a.txt", root / "sub" / "hard")
    (root / "frozen").chmod(0o555)
    return tree_of(root)


def files_in(tree: dict) -> list:
    return [entry[1] for entry in tree.values() if entry[0] != "link" and entry[1] is not None]


@pytest.mark.both_readings
def test_a_directory_moves_whole_both_ways_with_its_modes_empty_files_and_links(client, tmp_path):
    made = make_tree(tmp_path / "src")
    remote, back = tmp_path / "sandbox" / "new" / "app", tmp_path / "back"
    info = client.put(SANDBOX, f"{tmp_path}/src/", str(remote))
    assert tree_of(remote) == made
    contents = files_in(made)
    assert (info.path, info.files, info.size) == (
        str(remote),
        len(contents),
        sum(map(len, contents)),
    )
    assert client.get(SANDBOX, str(remote), str(back)) == dataclasses.replace(info, path=str(back))
    assert tree_of(back) == made and leftovers(str(tmp_path)) == []


@pytest.mark.parametrize("way", ["put", "get"])
def test_a_directory_replaces_the_one_there_whole_and_a_slash_takes_it_in(client, tmp_path, way):
    source, there = tmp_path / "src", tmp_path / "there"
    made = make_tree(source, big=0)
    for place in ("app", "inbox/src"):
        (there / place).mkdir(parents=True)
        (there / place / "stale.txt").write_bytes(b"from before")
    (there / "plain").write_bytes(b"a file")
    move = client.put if way == "put" else client.get
    move(SANDBOX, str(source), str(there / "app"))
    move(SANDBOX, str(source), f"{there}/inbox/")
    assert tree_of(there / "app") == tree_of(there / "inbox" / "src") == made
    with pytest.raises(cx.TransferError) as raised:
        move(SANDBOX, str(source), str(there / "plain"))
    assert raised.value.reason == "not_renamed" and (there / "plain").read_bytes() == b"a file"
    assert leftovers(str(tmp_path)) == []


@pytest.mark.parametrize("streams", [True, False], ids=["exec streamed", "exec answered whole"])
def test_a_directory_of_many_files_takes_the_requests_of_one_file(local_server, tmp_path, streams):
    """One archive, not a request a file: a put is its PUT and one exec; a get is
    one streamed exec, which describes the path and then prints its archive (the
    GET of the path itself too, sent beside it, unless the path ends in "/").
    Where the control plane answers a streamed exec 404, learned once by the
    first get, even one that fails, a get's exec packs an archive beside the
    path, then its GET and its removal."""
    server = local_server(streamed_exec=streams)
    (tmp_path / "many").mkdir()
    for number in range(300):
        (tmp_path / "many" / f"{number}.txt").write_bytes(b"%d\n" % number)
    remote, back = str(tmp_path / "sandbox"), str(tmp_path / "back")
    with make_client(server) as client:
        put = requests_of(server, lambda: client.put(SANDBOX, str(tmp_path / "many"), remote))
        assert put == [("PUT", "files", 200), ("POST", "exec", 200)]
        learned = requests_of(server, lambda: get_missing(client, remote + "-missing/", back))
        slashed = requests_of(server, lambda: client.get(SANDBOX, remote + "/", back))
        get = requests_of(server, lambda: client.get(SANDBOX, remote, back))
    exec_ = ("POST", "exec", 200)
    if streams:
        assert learned == slashed == [exec_]
        assert sorted(get) == [("GET", "files", 400), exec_]
    else:
        assert learned == [("POST", "exec", 404), exec_]
        assert slashed == [exec_, ("GET", "files", 200), exec_]
        assert sorted(get) == [("GET", "files", 200), ("GET", "files", 400), exec_, exec_]
    assert tree_of(tmp_path / "back") == tree_of(tmp_path / "many")


def get_missing(client: cx.Client, path: str, local: str) -> None:
    with pytest.raises(cx.TransferError) as raised:
        client.get(SANDBOX, path, local)
    assert raised.value.reason == "missing" and not os.path.exists(local)


def test_the_tree_reader_takes_pax_and_gnu_archives_and_nothing_that_leads_outside(tmp_path):
    """What _TreeSink reads as it comes, in pieces of any size: the archive put()
    makes (pax), GNU tar's (long names, hard links); an archive whose entry would
    land outside the tree is damaged: nothing is written there."""
    made = make_tree(tmp_path / "src", big=0)
    ours = cx._Tree(str(tmp_path / "src"))
    archives = {"pax": ours.read(10**9)}
    gnu = subprocess.run(["tar", "-c", "-f", "-", "-C", str(tmp_path / "src"), "."], stdout=-1)
    archives["gnu"] = gnu.stdout
    for kind, archive in archives.items():
        sink = cx._TreeSink(str(tmp_path / kind), "/remote")
        for start in range(0, len(archive), 7919):
            sink.write(archive[start : start + 7919])
        assert sink.commit(ours.manifest()).files == len(files_in(made))
        assert tree_of(tmp_path / kind) == made, kind
    for entries in (["../escape"], ["./d/", "./d/../../escape"], ["./l->..", "./l/escape"]):
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as archive:
            for entry in entries:
                info = tarfile.TarInfo(entry.split("->")[0])
                info.type = tarfile.SYMTYPE if "->" in entry else info.type
                info.linkname = entry.partition("->")[2]
                info.type = tarfile.DIRTYPE if entry.endswith("/") else info.type
                archive.addfile(info, io.BytesIO())
        sink = cx._TreeSink(str(tmp_path / "hostile"), "/remote")
        with pytest.raises(cx.TransferError, match="differs"):
            sink.write(tar.getvalue())
        sink.discard()
    assert not (tmp_path / "escape").exists() and leftovers(str(tmp_path)) == []


def test_what_a_tree_cannot_hold_is_refused(server, client, tmp_path):
    """A FIFO in a local tree: before any request; in the sandbox's: by its pack."""
    (tmp_path / "local").mkdir()
    (tmp_path / "remote").mkdir()
    os.mkfifo(tmp_path / "local" / "fifo")
    os.mkfifo(tmp_path / "remote" / "fifo")
    with pytest.raises(cx.ConfigError, match="'fifo' in .* is none of them"):
        client.put(SANDBOX, str(tmp_path / "local"), str(tmp_path / "r"))
    assert server.requests == []
    with pytest.raises(cx.TransferError) as raised:
        client.get(SANDBOX, str(tmp_path / "remote"), str(tmp_path / "here"))
    assert raised.value.reason == "special" and leftovers(str(tmp_path)) == []


# --------------------------------------------------------------------------
# Progress


def test_progress_is_told_in_the_transfers_thread_up_to_the_total_and_what_it_raises_ends_it(
    client, tmp_path
):
    data, path = os.urandom(600_000), str(tmp_path / "file.bin")
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "file").write_bytes(data)
    calls = {
        "put": lambda progress: client.put(SANDBOX, data, path, progress=progress),
        "unsized": lambda progress: client.put(
            SANDBOX, io.BufferedReader(Unseekable(data)), path, progress=progress
        ),
        "get": lambda progress: client.get(SANDBOX, path, progress=progress),
        "tree": lambda progress: client.get(
            SANDBOX, str(tmp_path / "tree"), str(tmp_path / "back"), progress=progress
        ),
    }
    for name, call in calls.items():
        told: list = []
        call(lambda done, total, told=told: told.append((done, total, threading.current_thread())))
        done, total, _ = told[-1]
        assert total == {"unsized": None, "tree": done}.get(name, len(data)), name
        assert done >= len(data) and [seen[0] for seen in told] == sorted(seen[0] for seen in told)
        assert {thread for _, _, thread in told} == {threading.current_thread()}, name

    def stop(done, total):
        raise LookupError("stop")

    for call in calls.values():
        with pytest.raises(LookupError, match="stop"):
            call(stop)
    assert open(path, "rb").read() == data and leftovers(str(tmp_path)) == []


# --------------------------------------------------------------------------
# What is refused, and what cannot be done


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c, d: c.put(SANDBOX, b"x", "relative/file"), "'relative/file'"),
        (lambda c, d: c.put(SANDBOX, b"x", d + "/dir/"), "name a file"),
        (lambda c, d: c.get(SANDBOX, "notes.txt"), "'notes.txt'"),
        (lambda c, d: c.put(SANDBOX, "text", d + "/f", mode=0o7777 + 1), "mode"),
        (lambda c, d: c.put(SANDBOX, 42, d + "/f"), "not int"),
        (lambda c, d: c.put(SANDBOX, io.StringIO("text"), d + "/f"), "binary mode"),
        (lambda c, d: c.get(SANDBOX, d + "/f", io.StringIO()), "binary mode"),
        (lambda c, d: c.get(SANDBOX, d + "/f", 42), "not int"),
        (lambda c, d: c.get(SANDBOX, d + "/f", max_bytes=-1), "max_bytes"),
        (lambda c, d: c.get(SANDBOX, d + "/dir/"), "comes into a local path"),
        (lambda c, d: c.get(SANDBOX, d + "/f", progress=42), "progress must be"),
        (lambda c, d: c.put(SANDBOX, d, d + "/f", mode=0o755), "for a file"),
    ],
)
def test_bad_arguments_are_refused_before_any_request(server, client, tmp_path, call, message):
    with pytest.raises(cx.ConfigError, match=message):
        call(client, str(tmp_path))
    assert server.requests == []


@pytest.mark.parametrize(
    "name, reason, says",
    [
        ("missing", "missing", "no such file"),
        ("directory", "not_a_file", "a directory"),
        ("big", "over_cap", "pass destination="),
    ],
)
def test_a_file_that_cannot_be_read_is_named_with_the_reason(client, tmp_path, name, reason, says):
    (tmp_path / "directory").mkdir()
    (tmp_path / "big").write_bytes(b"x" * 11)
    path = str(tmp_path / name)
    with pytest.raises(cx.TransferError, match=says) as raised:
        client.get(SANDBOX, path, max_bytes=10)
    assert (raised.value.path, raised.value.reason) == (path, reason)
    assert repr(path) in str(raised.value)


def test_a_local_destination_that_cannot_be_made_is_named_before_any_request(
    server, client, tmp_path
):
    (tmp_path / "plain").write_bytes(b"a file, not a directory")
    blocked = str(tmp_path / "plain" / "out.bin")
    with pytest.raises(OSError) as raised:
        client.get(SANDBOX, "/etc/hostname", blocked)
    assert raised.value.filename == blocked and ".part" not in str(raised.value)
    assert server.requests == []


@pytest.mark.parametrize("hasher", [None, "sha256sum", "openssl"])
def test_the_sandbox_hashes_with_what_it_has_and_without_a_hasher_renames_nothing(
    client, tmp_path, monkeypatch, hasher
):
    if hasher is not None and shutil.which(hasher) is None:
        pytest.skip(f"no {hasher} on this machine")
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "stat", "rm", "mv", "chmod", "mkdir") + ((hasher,) if hasher else ()):
        os.symlink(shutil.which(tool), tools / tool)
    monkeypatch.setenv("PATH", str(tools))  # the local server's execs inherit it
    path = tmp_path / "kept.txt"
    path.write_bytes(b"old")
    if hasher is not None:
        assert client.put(SANDBOX, b"new", str(path)) == info_of(str(path), b"new")
        assert client.get(SANDBOX, str(path)) == b"new"
        return
    monkeypatch.setattr(cx, "_PIECE_SIZE", 64 * 1024)
    for call in (
        lambda: client.put(SANDBOX, b"new", str(path)),
        lambda: client.put(SANDBOX, os.urandom(200_000), str(path)),  # in pieces
        lambda: client.get(SANDBOX, str(path)),
    ):
        with pytest.raises(cx.TransferError, match="bash and sha256sum") as raised:
            call()
        assert raised.value.reason == "no_tools"
    assert path.read_bytes() == b"old"
    assert leftovers(str(tmp_path)) == []


@pytest.mark.parametrize("obstacle", ["a directory at the destination", "a file as its parent"])
def test_a_destination_that_cannot_be_written_is_left_as_it_was(client, tmp_path, obstacle):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "inside").write_bytes(b"old")
    (tmp_path / "plain").write_bytes(b"old")
    path, reason = {
        "a directory at the destination": (tmp_path / "taken", "not_renamed"),
        "a file as its parent": (tmp_path / "plain" / "child", "no_parent"),
    }[obstacle]
    with pytest.raises(cx.TransferError) as raised:
        client.put(SANDBOX, b"new", str(path))
    assert raised.value.reason == reason
    assert (
        (tmp_path / "taken" / "inside").read_bytes() == (tmp_path / "plain").read_bytes() == b"old"
    )
    assert leftovers(str(tmp_path)) == []


@pytest.mark.parametrize(
    "interrupt", [lambda: OSError(5, "I/O error"), KeyboardInterrupt], ids=["I/O error", "Ctrl-C"]
)
def test_a_source_that_fails_while_read_raises_its_own_error(client, server, tmp_path, interrupt):
    """After its request ended whole and was answered, as one whose source
    changed; a Ctrl-C that comes while it is read too (a cut upload would be
    handled after the removal of its temporary file here)."""
    path, put_raised = tmp_path / "kept.txt", threading.Event()
    path.write_bytes(b"old")
    server.hold_cut_upload(until=put_raised)
    failing = Unseekable(b"x" * 100_000, after=50_000, interrupt=interrupt)
    with pytest.raises((OSError, KeyboardInterrupt)) as raised:
        client.put(SANDBOX, io.BufferedReader(failing), str(path))
    put_raised.set()
    assert type(raised.value) is type(interrupt())  # the caller's own, not a CreateOSError
    answered = until(lambda: [seen.status for seen in server.requests if seen.method == "PUT"])
    assert path.read_bytes() == b"old" and leftovers(str(tmp_path)) == [] and answered == [200]


def test_a_file_over_the_services_limit_is_refused_whole_and_its_size_named(local_server, tmp_path):
    server = local_server(file_size_limit=1000)
    with make_client(server) as client:
        for source, says in [
            (b"x" * 1001, "refused 1,001 bytes in one request as too large"),
            (io.BufferedReader(Unseekable(b"x" * 1001)), "refused it as too large"),  # unsized
        ]:
            with pytest.raises(cx.TransferError, match=says) as raised:
                client.put(SANDBOX, source, str(tmp_path / "big"))
            assert raised.value.reason == "too_large"
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------
# Canned answers: what the service may say that the local server does not

SUM = hashlib.sha256(b"hello").hexdigest()
DESCRIBED = f"file 5 {SUM} 644 1 5 1.0\n"  # _cx_describe's line for b"hello"


def exec_answer(**result) -> dict:
    return ok({"result": result, "exec_ms": 1.0})


@pytest.mark.parametrize(
    "answer, raised, says",
    [
        (ok({"exec_ms": 1.0}), cx.ProtocolError, "holds no result"),
        (exec_answer(stdout="", exit_code="0"), cx.ProtocolError, "holds no exit code"),
        (exec_answer(stdout=f"5 {SUM}\n", exit_code=0), cx.ProtocolError, "not describe a file"),
        (exec_answer(error="exec: bash not found"), cx.TransferError, "bash and sha256sum"),
        (exec_answer(stdout="", exit_code=7), cx.TransferError, "changed while it was read"),
    ],
)
def test_an_exec_answer_that_says_nothing_usable_stops_a_get(rsps, answer, raised, says):
    """The check's failure wins over the GET sent beside it, which is not read again."""
    rsps.add(responses.POST, EXEC, json=answer)
    rsps.add(responses.GET, FILES, body=b"hello")
    with make_client() as client, pytest.raises(raised, match=says):
        client.get(SB, "/app/x")
    assert len(calls(rsps, "GET", FILES)) <= 1


DAMAGED = "what arrived differs from what was sent"


def frames(*frames) -> bytes:
    return b"".join(json.dumps(frame).encode() + b"\n" for frame in frames)


@pytest.mark.parametrize(
    "answer, raised, says",
    [
        (frames({"stdout": DESCRIBED, "exit": 0}), cx.ProtocolError, "frame not understood"),
        (frames({"stdout": 5}, {"exit_code": 0}), cx.ProtocolError, "frame not understood"),
        (frames({"hb": False}, {"exit_code": 0}), cx.ProtocolError, "frame not understood"),
        (b"{}\n", cx.ProtocolError, "frame not understood"),
        (b"\n{no json}\n", cx.ProtocolError, "frame not understood"),
        (frames({"stdout": DESCRIBED + "more"}, {"exit_code": 0}), cx.ProtocolError, "describe"),
        (frames({"stdout": "x" * 5000}), cx.ProtocolError, "line too long"),
        (frames({"error": "exec: bash not found"}), cx.TransferError, "bash and sha256sum"),
        (frames({"stdout": DESCRIBED}), cx.TransportError, "connection was reset"),
        (frames({"stdout": f"tree {SUM} -\nAA*A"}, {"exit_code": 0}), cx.TransferError, DAMAGED),
        (frames({"stdout": f"tree {SUM} 9\nAAAAA"}, {"exit_code": 0}), cx.TransferError, DAMAGED),
    ],
)
def test_a_streamed_exec_is_read_strictly(rsps, tmp_path, answer, raised, says):
    """A get into a path reads its description from a streamed exec's frames: one
    it does not understand stops it, one that ends before its exit code is cut;
    a directory's archive after it that is not base64 arrived damaged."""
    rsps.add(responses.POST, EXEC, body=answer, content_type="application/x-ndjson")
    rsps.add(responses.GET, FILES, body=b"hello")
    with make_client() as client, pytest.raises(raised, match=says):
        client.get(SB, "/app/x/", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_a_body_cut_short_without_an_error_is_read_again_then_given_up(rsps):
    rsps.add(responses.POST, EXEC, json=exec_answer(stdout=DESCRIBED, exit_code=0))
    rsps.add(responses.GET, FILES, body=b"hel")
    with make_client() as client, pytest.raises(cx.TransportError, match="download of '/app/x'"):
        client.get(SB, "/app/x")
    assert len(calls(rsps, "GET", FILES)) == 2  # the retry policy's two attempts


@pytest.mark.parametrize(
    "status, says, sent",
    [
        (403, "upload of '/app/x': the API key was refused", ["PUT", "POST"]),  # POST: rm -f
        (404, "no sandbox", ["PUT", "POST", "POST"]),  # mkdir -p, then rm -f
    ],
)
def test_a_refused_upload_names_the_file_and_what_the_status_means(rsps, status, says, sent):
    rsps.add(responses.PUT, FILES, status=status, json={"status": "fail"})
    rsps.add(responses.POST, EXEC, status=status, json={"status": "fail"})
    with make_client() as client, pytest.raises(cx.APIError, match=says):
        client.put(SB, b"hello", "/app/x")
    assert [call.request.method for call in rsps.calls] == sent


# --------------------------------------------------------------------------
# The campaign (RELIABILITY.md item 13): every fault at several points of an
# upload and a download, every content, a source or a destination that can
# start over and one that cannot. The destination is the old file or the
# whole new one; nothing is left on either side; an error names the file.

OLD = b"the old content\n"
TALLY = dict.fromkeys(["runs", "faults met", "whole new", "old kept", "errors naming the file"], 0)
_figures = figures_at_end("13. files under faults", lambda: dict(TALLY) if TALLY["runs"] else None)


class Interrupting(io.BytesIO):
    """A seekable binary file that raises KeyboardInterrupt (Ctrl-C) once `after`
    of its bytes were read or written."""

    def __init__(self, data: bytes, after: int):
        super().__init__(data)
        self._after = after

    def read(self, amount=-1):
        self._check(amount if amount is not None and amount >= 0 else len(self.getvalue()))
        return super().read(amount)

    def write(self, piece):
        self._check(len(piece))
        return super().write(piece)

    def _check(self, amount: int) -> None:
        if self.tell() + max(amount, 1) > self._after:
            raise KeyboardInterrupt


def points(size: int) -> list:
    """Where a transfer is cut: its start, its first byte, its middle, its last
    byte, its end; in the full campaign every 32nd of it too."""
    every = range(0, size, max(1, size // 32)) if campaign_size("CREATEOS_FILES_ALL", 0, 1) else ()
    return sorted({0, min(1, size), size // 2, max(0, size - 1), size, *every})


def faults(size: int) -> list:
    """Each fault of a transfer of `size` bytes: (its name, where a cut or a Ctrl-C comes)."""
    cuts = [("cut", at) for at in points(size)]
    others = [("503", None), ("429", None), ("corrupted", None), ("check's answer lost", None)]
    return cuts + others + ([("Ctrl-C", size // 2)] if size else [])


def inject(server, endpoint: str, name: str, at, skip: int = 0) -> None:
    """The fault `name` on the next request of `endpoint` (a cut `at` bytes, or
    characters of a streamed exec's output), or the one after `skip` more."""
    if name == "cut":
        drops = {"files_put": server.drop_upload, "exec": server.drop_exec_stream}
        drops.get(endpoint, server.drop_download)(after_bytes=at, skip=skip)
    elif name in ("503", "429"):
        server.fail(endpoint, int(name), retry_after="0")
    elif name == "corrupted" and endpoint == "exec":
        server.corrupt_exec_stream(skip=skip)
    elif name == "corrupted":
        server.corrupt_files(endpoint, skip=skip)
    elif name == "check's answer lost":
        server.lose_exec_response()


def run(server, call, name: str, path: str, new: bytes, directories) -> object:
    """One transfer under its fault: what it left is checked and counted; its error returned."""
    with open(path, "wb") as old:
        old.write(OLD)
    failure = None
    try:
        call()
    except (cx.CreateOSError, KeyboardInterrupt) as raised:
        failure = raised
    assert not any(server._faults.values()), f"{name}: the fault was not met"
    TALLY["runs"] += 1
    TALLY["faults met"] += name != "Ctrl-C" or failure is not None
    with open(path, "rb") as left:
        found = left.read()
    assert found in (OLD, new), name
    TALLY["whole new" if found == new else "old kept"] += 1
    assert leftovers(*directories) == [], name
    if isinstance(failure, cx.CreateOSError):
        assert repr(getattr(failure, "path", "")) in str(failure) or "of '/" in str(failure)
        TALLY["errors naming the file"] += 1
    return failure


def expected_failure(
    name: str, restartable: bool, whole_before_the_cut: bool = False, in_pieces: bool = False
) -> bool:
    """Whether a transfer fails under the fault `name`: a download cut after its
    last byte has all it needs; an upload in pieces sends a damaged one again."""
    cut_short = name in ("503", "429") or (name == "cut" and not whole_before_the_cut)
    damaged = name == "corrupted" and not in_pieces
    return damaged or name == "Ctrl-C" or (not restartable and cut_short)


@pytest.mark.parametrize("content", list(CONTENTS))
@pytest.mark.parametrize("restartable", [True, False], ids=["source that seeks", "one that cannot"])
def test_uploads_under_faults_leave_the_old_file_or_the_whole_new_one(
    server, tmp_path, content, restartable
):
    data = CONTENTS[content]
    path = str(tmp_path / "destination.bin")
    with make_client(server) as client:
        for name, at in faults(len(data)):
            stop = at if name == "Ctrl-C" else -1
            source = Interrupting(data, stop if stop >= 0 else len(data) + 1)
            if not restartable:
                source = io.BufferedReader(Unseekable(data, stop))
            inject(server, "files_put", name, at)
            put = functools.partial(client.put, SANDBOX, source, path)
            failure = run(server, put, name, path, data, [str(tmp_path)])
            in_pieces = restartable and len(data) > cx._PIECE_SIZE
            expected = expected_failure(name, restartable, in_pieces=in_pieces)
            assert (failure is not None) == expected, (name, at, failure)


def download_into(client, remote: str, local, into: str, sink, ctrl_c, monkeypatch) -> None:
    """get() `remote` into a destination of the kind `into` (`sink` for a file),
    its bytes then written to `local` whatever the kind. For a local path,
    `ctrl_c` (an Interrupting, or None) is written beside its temporary file."""
    if into == "a local path":
        written = cx._FileSink.write
        with monkeypatch.context() as patch:
            if ctrl_c is not None:
                patch.setattr(
                    cx._FileSink,
                    "write",
                    lambda out, piece: written(out, ctrl_c.write(piece) and piece),
                )
            client.get(SANDBOX, remote, str(local))
        return
    got = client.get(SANDBOX, remote, sink)
    if sink is not None:
        got = sink.getvalue() if isinstance(sink, io.BytesIO) else bytes(sink.written)
    local.write_bytes(got)


@pytest.mark.parametrize("content", list(CONTENTS))
@pytest.mark.parametrize("into", ["bytes", "a local path", "a file that seeks", "one that cannot"])
def test_downloads_under_faults_leave_the_old_file_or_the_whole_new_one(
    server, tmp_path, monkeypatch, content, into
):
    data = CONTENTS[content]
    remote, local = tmp_path / "sandbox" / "file.bin", tmp_path / "here" / "file.bin"
    remote.parent.mkdir()
    local.parent.mkdir()
    remote.write_bytes(data)
    with make_client(server) as client:
        for name, at in faults(len(data)):
            if into == "bytes" and name == "Ctrl-C":
                continue  # nothing of the caller's runs during it
            stop = at if name == "Ctrl-C" else -1
            seeks = Interrupting(b"", stop if stop >= 0 else len(data) + 1)
            sink = {"a file that seeks": seeks, "one that cannot": Unseekable(after=stop)}.get(into)
            ctrl_c = seeks if name == "Ctrl-C" else None
            download = functools.partial(
                download_into, client, str(remote), local, into, sink, ctrl_c, monkeypatch
            )
            inject(server, "files_get", name, at)
            failure = run(server, download, name, str(local), data, [str(tmp_path)])
            expected = expected_failure(name, into != "one that cannot", at == len(data))
            assert (failure is not None) == expected, (name, at, failure)


# The campaign of RELIABILITY.md item 16: a directory under each fault, both
# ways. The destination is the old tree or the whole new one, nothing is left
# on either side, and an error names the directory.

TREES = dict.fromkeys(["runs", "faults met", "whole new", "old kept", "damaged trees found"], 0)
_tree_figures = figures_at_end(
    "16. directories under faults", lambda: dict(TREES) if TREES["runs"] else None
)


@pytest.mark.parametrize("way", ["put", "get", "get, exec answered whole"])
def test_directories_under_faults_leave_the_old_tree_or_the_whole_new_one(
    local_server, tmp_path, way
):
    """A get reads the archive its streamed exec prints, or, where the control
    plane answers that 404, the one its exec staged."""
    server = local_server(streamed_exec=way == "get")
    big = campaign_size("CREATEOS_FILES_TREE", 64 * 1024, 8 * 1024 * 1024 + 17)
    new, old = make_tree(tmp_path / "new", big=big), make_tree(tmp_path / "old", big=3)
    there = tmp_path / "there" / "app"
    endpoint, named = {
        "put": ("files_put", there),
        "get": ("exec", f"{tmp_path}/new/"),
    }.get(way, ("files_get", f"{tmp_path}/new/"))
    with make_client(server) as client:
        move = functools.partial(client.put if way == "put" else client.get, SANDBOX)
        told: list = []
        move(
            f"{tmp_path}/new/", str(tmp_path / "measured"), progress=lambda *seen: told.append(seen)
        )
        for name, at in faults(told[-1][1]):  # the size of the archive that moves
            shutil.rmtree(there, ignore_errors=True)
            shutil.copytree(tmp_path / "old", there, symlinks=True)
            inject(server, endpoint, name, at)

            def ctrl_c(done, total, at=at, name=name):
                if name == "Ctrl-C" and done >= at:
                    raise KeyboardInterrupt

            failure = None
            try:
                move(f"{tmp_path}/new/", str(there), progress=ctrl_c)
            except (cx.CreateOSError, KeyboardInterrupt) as raised:
                failure = raised
            assert not any(server._faults.values()), f"{name}: the fault was not met"
            found = tree_of(there)
            TREES["runs"] += 1
            TREES["faults met"] += name != "Ctrl-C" or failure is not None
            TREES["whole new" if found == new else "old kept" if found == old else "damaged"] += 1
            assert found in (old, new) and leftovers(str(tmp_path)) == [], (name, at)
            assert (failure is not None) == expected_failure(name, True, at == told[-1][1])
            if isinstance(failure, cx.CreateOSError):
                assert repr(str(named)) in str(failure) or "of '/" in str(failure), failure


# The campaign of RELIABILITY.md item 17: files in pieces both ways, under
# seeded schedules of one to three faults each (a piece cut, or damaged on the
# way, or the answer to a check lost; a get's first cut on its whole reading,
# past a piece). Each arrives exact, having moved again at most two pieces'
# bytes a fault: the pieces it kept are not sent again.

RESUMED = dict.fromkeys(
    ["runs", "cuts survived", "damaged pieces sent again", "lost answers", "bytes re-sent"], 0
)
_resumed_figures = figures_at_end(
    "17. resumed transfers",
    lambda: dict(RESUMED, **{"damaged files found": 0}) if RESUMED["runs"] else None,
)


def resumed_faults(rng, way: str, size: int) -> list:
    """A run's faults: (name, skip, where a cut comes)."""
    chosen = [("cut", 0, rng.randrange(2 * PIECE, 3 * PIECE))] if way == "get" else []
    for _ in range(rng.randint(1, 3) - len(chosen)):
        name = rng.choice(["cut", "cut", "corrupted", "check's answer lost"])
        chosen.append((name, rng.randrange(way == "get", 3), rng.randrange(1, PIECE)))
    return chosen


def test_files_in_pieces_under_faults_survive_seeded_cuts_damage_and_lost_answers(
    server, tmp_path, pieces
):
    rng = random.Random(20261207)
    remote, local = tmp_path / "remote.bin", tmp_path / "local.bin"
    with make_client(server) as client:
        for number in range(campaign_size("CREATEOS_RESUMED_RUNS", 8, 100)):
            way = ("put", "get")[number % 2]
            data = os.urandom(rng.randrange(6 * PIECE, 9 * PIECE))
            (remote if way == "get" else local).write_bytes(data)
            if way == "get":
                aged(remote)  # damage to a file written long ago is damage, not a change
            schedule = resumed_faults(rng, way, len(data))
            for name, skip, at in schedule:
                inject(server, "files_put" if way == "put" else "files_get", name, at, skip)
            before = dict(server.file_bytes)
            source = Counted(data)
            if way == "put":
                assert client.put(SANDBOX, source, str(remote)).size == len(data)
                again = source.moved - len(data)
            else:
                assert client.get(SANDBOX, str(remote), str(local)).size == len(data)
                again = server.file_bytes["files_get"] - before.get("files_get", 0) - len(data)
            assert not any(server._faults.values()), schedule
            assert (remote if way == "put" else local).read_bytes() == data, schedule
            assert again <= 2 * PIECE * len(schedule) and leftovers(str(tmp_path)) == [], schedule
            names = [name for name, _, _ in schedule]
            RESUMED["runs"] += 1
            RESUMED["cuts survived"] += names.count("cut")
            RESUMED["damaged pieces sent again"] += names.count("corrupted")
            RESUMED["lost answers"] += names.count("check's answer lost")
            RESUMED["bytes re-sent"] += again
