"""The journal file: a magic line, a header frame (JSON: the versions that wrote it), then one frame per record.

A frame is its payload's length (8 bytes, little-endian), the payload's CRC32 (4 bytes), then the payload. The owner
appends whole frames, batched, each batch with one `os.write` on a file opened O_APPEND, so a crash tears at most
the batch being written; a reader takes every whole frame before the first torn or corrupt one and says how many
bytes it could not read (`Torn`). A follower (`Follower`) reads a journal still being written: a frame not whole
yet is waited for, not taken for a tear.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"ddpnb journal\n"
FRAME = struct.Struct("<QI")  # payload length, CRC32 of the payload
FLUSH_BYTES = 1 << 18  # a batch this big is written at once, whatever the time since the last
FLUSH_EVERY = 0.1  # seconds a record may wait in memory before it is written (a crash of the owner loses those)


class JournalError(Exception):
    """A journal that cannot be read: not a journal, or written by an incompatible ddpnb."""


@dataclass(frozen=True)
class Torn:
    """Where reading stopped short of the file's end: `offset` of the first record not read, `lost` bytes from there
    to the end, and `why` ('cut short': the owner died mid-write; 'corrupt': a record's checksum is wrong)."""

    offset: int
    lost: int
    why: str

    def __str__(self) -> str:
        return f"the journal is {self.why} at byte {self.offset}: the last {self.lost} bytes could not be read"


def frame(payload: bytes) -> bytes:
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def parse(data: bytes | memoryview, start: int, payloads: list[bytes]) -> tuple[int, str]:
    """Append the payload of every whole frame in `data` from `start` to `payloads`; returns where the first frame
    not read begins and why it was not: '' (the data ends there), 'cut short' (it ends inside a frame), 'corrupt'."""
    end, unpack, crc32 = len(data), FRAME.unpack_from, zlib.crc32
    head = FRAME.size
    with memoryview(data) as view:
        while start < end:
            if end - start < head:
                return start, "cut short"
            size, checksum = unpack(view, start)
            body = start + head
            if end - body < size:
                return start, "cut short"
            payload = bytes(view[body : body + size])
            if crc32(payload) != checksum:
                return start, "corrupt"
            payloads.append(payload)
            start = body + size
    return start, ""


class _NotYet(JournalError):
    """The file is (so far) a beginning of a journal: its header is not whole yet."""


def _header(data: bytes, path: Path) -> tuple[dict[str, Any], int]:
    """The header and where the records begin; raises JournalError where `data` is no journal (`_NotYet`: not yet)."""
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):
            raise _NotYet(f"{path} has no header yet: its run has written nothing so far")
        raise JournalError(f"{path} is not a ddpnb journal (it does not begin with {MAGIC!r})")
    payloads: list[bytes] = []
    stop, why = parse(data[: len(MAGIC) + FRAME.size + _header_size(data)], len(MAGIC), payloads)
    if not payloads:
        if why in ("cut short", ""):  # "": the data ends right after the magic (a journal read in pieces)
            raise _NotYet(f"{path}'s header is cut short: the journal cannot be read")
        raise JournalError(f"{path}'s header is corrupt: the journal cannot be read")
    try:
        header = json.loads(payloads[0])
    except ValueError as exc:
        raise JournalError(f"{path}'s header is not readable ({exc})") from None
    if not isinstance(header, dict):
        raise JournalError(f"{path}'s header is not a ddpnb journal's")
    return header, stop


def _header_size(data: bytes) -> int:
    if len(data) < len(MAGIC) + FRAME.size:
        return 0
    size, _ = FRAME.unpack_from(data, len(MAGIC))
    return min(size, len(data))


class Writer:
    """The owner's end: records appended in memory (`append`), written in batches (`flush`), each batch one write.
    The file is created at the first flush, 0600. A write that fails (a full disk) is kept in `failed`, and the
    journal takes nothing more: the run goes on without it."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self._pending = bytearray(MAGIC + frame(json.dumps(header).encode()))
        self._fd: int | None = None
        self._flushed = time.monotonic()
        self.written = 0
        self.failed: OSError | None = None

    def append(self, payload: bytes) -> None:
        pending = self._pending
        pending += FRAME.pack(len(payload), zlib.crc32(payload))
        pending += payload

    def due(self) -> bool:
        """Whether the batch should be written now (big enough, or old enough)."""
        return bool(self._pending) and (
            len(self._pending) >= FLUSH_BYTES or time.monotonic() - self._flushed >= FLUSH_EVERY
        )

    def flush(self) -> None:
        self._flushed = time.monotonic()
        if not self._pending or self.failed is not None:
            return
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            with memoryview(self._pending) as view:
                done = 0
                while done < len(view):  # a write cut short by a signal or a file size limit: the rest follows
                    done += os.write(self._fd, view[done:])
            self.written += len(self._pending)
        except OSError as exc:
            self.failed = exc
        self._pending.clear()

    def discard(self) -> None:
        """Nothing more is written (the run never started): what waits in memory goes."""
        self._pending.clear()
        self.close()

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Reader:
    """A journal's records, from the first to the last whole one (`records`); `torn` says where it stopped short.
    `header` is the header as written (its versions: `entries.check` refuses an incompatible one)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            raise JournalError(
                f"{self.path} does not exist: the run has no journal (only runs with a journal, such "
                "as detached ones, can be replayed)"
            ) from None
        self.header, self.offset = _header(data, self.path)
        self._data = data
        self.torn: Torn | None = None

    def records(self) -> list[bytes]:
        """Every whole record; sets `torn` where the file goes on past the last one."""
        payloads: list[bytes] = []
        stop, why = parse(self._data, self.offset, payloads)
        if why:
            self.torn = Torn(stop, len(self._data) - stop, why)
        self.offset = stop
        self._data = b""
        return payloads


class Follower:
    """A journal still being written, read from where the last `poll` stopped. A frame not whole yet is waited for;
    one whose checksum is wrong is read again a few times (the writer may be inside that write) before the journal
    is called corrupt (`torn`), and nothing after it is read."""

    RETRIES = 5
    SOURCE_MOST = 1 << 20  # bytes asked of a read function at once

    def __init__(self, path: Path, read: Callable[[int, int], bytes | None] | None = None) -> None:
        self.path = Path(path)
        # the file's bytes from an offset, at most so many (None while it does not exist): where the journal is not
        # a file here
        self._source = read
        # the last poll of a read function took all there was (less than it asked for): a live journal's follower
        # may be handed a little more at every poll, and never find one empty
        self.drained = False
        self.header: dict[str, Any] | None = None
        self.torn: Torn | None = None
        self._fd: int | None = None
        self._read = 0  # bytes of the file read so far
        self._tail = b""  # the end of them, past the last whole frame
        self._corrupt = 0  # polls in a row that found the next frame corrupt

    @property
    def offset(self) -> int:
        """Where the first record not returned yet begins in the file."""
        return self._read - len(self._tail)

    def poll(self) -> list[bytes]:
        """The records written since the last poll (none while the file does not exist yet)."""
        if self.torn is not None:
            return []
        if self._source is None and self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return []
        chunks = [self._tail]
        if self._source is not None:  # one call a poll: the source may wait a while for more (a long poll)
            chunk = self._source(self._read, self.SOURCE_MOST)
            if chunk is None:
                return []
            self.drained = len(chunk) < self.SOURCE_MOST
            chunks.append(chunk)
            self._read += len(chunk)
        else:
            while chunk := os.pread(self._fd, 1 << 20, self._read):  # type: ignore[arg-type]
                chunks.append(chunk)
                self._read += len(chunk)
        data = b"".join(chunks)
        start = 0
        if self.header is None:
            try:
                self.header, start = _header(data, self.path)
            except _NotYet:
                self._tail = data
                return []
        payloads: list[bytes] = []
        stop, why = parse(data, start, payloads)
        self._corrupt = self._corrupt + 1 if why == "corrupt" and not payloads else 0
        if self._corrupt >= self.RETRIES:
            self.torn = Torn(self._read - len(data) + stop, len(data) - stop, why)
        self._tail = data[stop:]
        return payloads

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
