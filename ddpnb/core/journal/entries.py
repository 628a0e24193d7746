"""What one journal record says, and the versions a journal must match to be read.

Two kinds are hot (every metric and every chunk of output), packed with `struct` and the messages' own codec
(`core.messages`); every other kind is rare and a pickled tuple, its name first (`Entry`). Each event carries the
clock reads the owner's attempt made while handling it (`Attempt.clock`), so a replay reads the same times.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import pickle
import struct
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from ddpnb.core import messages as msg
from ddpnb.core.journal.frames import JournalError
from ddpnb.core.spec import Stream

FORMAT = 1  # the layout of frames and entries; a change to a message or record class changes `schema()` too

MESSAGE = 0x4D  # b"M": rank, clock reads, an encoded message
OUTPUT = 0x4F  # b"O": rank, stream, clock reads, raw bytes
OTHER = 0x50  # b"P": a pickled tuple, (kind, *fields)
_HOT = struct.Struct("<IBH")  # rank, stream (0 stdout, 1 stderr; 0 for a message), number of clock reads
_STREAMS = (Stream.STDOUT, Stream.STDERR)


class Entry(enum.Enum):
    """The rare kinds, in the order a run writes them. Events (what the engine told the attempt):"""

    PLACED = "placed"  # rank, pid, node, reads
    EXITED = "exited"  # rank, exitcode, stopped, cause, traceback, reads
    QUEUED = "queued"  # what, state, reads
    # what only the owner decides or knows:
    RUN = "run"  # the run's fixed fields, the ranks' devices, the first attempt's spec (`replay.RunStart`)
    NOTES = "notes"  # record.started, the attempt's start, launch note, data sent
    STOP = "stop"  # outcome, note, reads: the owner began stopping every rank (a stop asked, the timeout)
    AT_TIMEOUT = "at timeout"  # the diagnosis, and {rank: (stack, state)} kept in the ranks' records
    STALL = "stall"  # the record's stall as it is now (begun, looked at again, resumed), or None
    STRAGGLERS = "stragglers"  # each rank's holds_others
    ERRORS = "errors"  # ddpnb's own errors, the whole list
    NEXT = "next"  # an attempt ended and the next begins (`replay.Boundary`)
    END = "end"  # the run ended (`replay.Boundary`)


def message(rank: int, reads: list[float], encoded: bytes) -> bytes:
    head = _HOT.pack(rank, 0, len(reads))
    return b"M" + head + (struct.pack(f"<{len(reads)}d", *reads) if reads else b"") + encoded


def output(rank: int, stream: Stream, reads: list[float], data: bytes) -> bytes:
    head = _HOT.pack(rank, stream is Stream.STDERR, len(reads))
    return b"O" + head + (struct.pack(f"<{len(reads)}d", *reads) if reads else b"") + data


def other(kind: Entry, *fields: Any) -> bytes:
    return b"P" + pickle.dumps((kind.value, *fields), protocol=pickle.HIGHEST_PROTOCOL)


def hot(payload: bytes) -> tuple[int, Stream, list[float], int]:
    """A MESSAGE or OUTPUT entry's rank, stream, clock reads, and where its body begins."""
    rank, stderr, count = _HOT.unpack_from(payload, 1)
    start = 1 + _HOT.size
    reads = list(struct.unpack_from(f"<{count}d", payload, start)) if count else []
    return rank, _STREAMS[stderr], reads, start + 8 * count


def decode_other(payload: bytes) -> tuple[Entry, tuple[Any, ...]]:
    kind, *fields = pickle.loads(payload[1:])
    return Entry(kind), tuple(fields)


# --- versions -------------------------------------------------------------------------------------------------
@cache
def version() -> str:
    try:
        return metadata.version("ddpnb")
    except metadata.PackageNotFoundError:  # a checkout on the path, not installed
        return "unknown"


@cache
def schema() -> str:
    """A fingerprint of every class a journal pickles (their names and fields): two ddpnbs whose fingerprints differ
    cannot read each other's journals, whatever their version numbers say."""
    from ddpnb.core import failures, profile, record, spec

    classes = [
        *msg.KINDS.values(),
        spec.WorkerSpec,
        failures.Failure,
        failures.FrameLocals,
        profile.Profile,
        *(
            getattr(record, name)
            for name in (
                "RunRecord",
                "RankRecord",
                "AttemptRecord",
                "Diagnosis",
                "RankWhere",
                "Stall",
                "Queued",
                "DataSent",
                "Point",
            )
        ),
    ]
    described = []
    for kind in classes:
        fields = [f.name for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else list(kind._fields)
        described.append(f"{kind.__module__}.{kind.__qualname__}({','.join(fields)})")
    described.append(",".join(entry.value for entry in Entry))
    return hashlib.sha256(f"{FORMAT};{';'.join(described)}".encode()).hexdigest()[:16]


def header() -> dict[str, Any]:
    return {"ddpnb": version(), "format": FORMAT, "schema": schema()}


def check(header: dict[str, Any], path: Path) -> None:
    """Refuse a journal this ddpnb cannot read, saying which ddpnb wrote it."""
    if header.get("format") == FORMAT and header.get("schema") == schema():
        return
    wrote = header.get("ddpnb", "an unknown version")
    raise JournalError(
        f"{path} was written by ddpnb {wrote} (journal format {header.get('format')}, schema {header.get('schema')}); "
        f"this is ddpnb {version()} (format {FORMAT}, schema {schema()}), which cannot read it: attach from a kernel "
        f"with ddpnb {wrote} installed (pip install ddpnb=={wrote}); its rank logs are plain text in {path.parent}."
    )
