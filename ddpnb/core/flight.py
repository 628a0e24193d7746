"""NCCL's Flight Recorder for GPU runs: switched on in the ranks' environment, dumped at a stall or timeout, read.

torch keeps a ring buffer of each rank's last collectives (TORCH_FR_BUFFER_SIZE entries; TORCH_NCCL_TRACE_BUFFER_SIZE
before torch 2.7). With
TORCH_NCCL_DEBUG_INFO_PIPE_FILE set, each rank's NCCL monitor thread listens on a named pipe,
`<stem><rank>.pipe`, and writing to it makes the rank dump the buffer to `<stem><rank>`
(TORCH_FR_DUMP_TEMP_FILE; TORCH_NCCL_DEBUG_INFO_TEMP_FILE before torch 2.7): a pickle of a dict whose "entries" each have "collective_seq_id",
"profiling_name" ("nccl:all_reduce"), "state" ("scheduled", "started", "completed"), "process_group" (name,
description) and more. The dump is made by torch's C++ thread, so it comes even while the rank's Python is
blocked in a collective; the kernel only writes a byte to each pipe and reads the files.
"""

from __future__ import annotations

import importlib.metadata
import os
import pickle
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENTRIES = 128  # collectives each rank keeps: its latest ones say who is behind; the radar reads the ring at each
# step report, and a dump costs about 5 µs an entry (2000 entries: 17 ms)
STEM = "nccl_trace_rank"  # in the run directory: nccl_trace_rank0 (the dump), nccl_trace_rank0.pipe
DUMP_WAIT = 3.0  # seconds the ranks get to write their dumps (torch's monitor reads its pipe once a second)


def environment(run_dir: str | os.PathLike[str]) -> dict[str, str]:
    """What an NCCL run's ranks need in their environment for the kernel to dump their flight recorders."""
    stem = str(Path(run_dir) / STEM)
    return {
        **radar_environment(),
        _name("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): stem,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": stem,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }


def radar_environment() -> dict[str, str]:
    """What every run's ranks need in their environment for torch to keep their collectives' arrival times, which
    the straggler radar reads (`rank/radar.py`); gloo's ring since torch 2.7. NCCL runs get `environment` too."""
    return {_name("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): str(ENTRIES)}


def _name(current: str, older: str) -> str:
    """The variable's name the installed torch reads: the Flight Recorder's own since torch 2.7, which warns on
    every rank where the older NCCL name is set; the NCCL one before. Read from the package's metadata: the kernel
    never imports torch."""
    try:
        major, minor = (int(part) for part in re.findall(r"\d+", importlib.metadata.version("torch"))[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return current
    return current if (major, minor) >= (2, 7) else older


def request(run_dir: str | os.PathLike[str], ranks: list[int]) -> float:
    """Ask each rank for its dump through its pipe (ranks with no pipe are skipped); returns when it asked."""
    asked = time.time()
    for rank in ranks:
        try:  # non-blocking: a pipe nobody reads (a rank without NCCL yet) refuses at once (ENXIO)
            fd = os.open(Path(run_dir) / f"{STEM}{rank}.pipe", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.write(fd, b"1")
        except OSError:
            pass  # the rank's monitor is gone: no dump from it
        finally:
            os.close(fd)
    return asked


def collect(
    run_dir: str | os.PathLike[str], ranks: list[int], since: float, wait: float = DUMP_WAIT
) -> dict[int, dict[str, Any]]:
    """The dumps the ranks wrote after `since`, read as they complete, for up to `wait` seconds."""
    dumps: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + wait
    while True:
        for rank in ranks:
            if rank not in dumps and (dump := read(Path(run_dir) / f"{STEM}{rank}", since)) is not None:
                dumps[rank] = dump
        if len(dumps) == len(ranks) or time.monotonic() >= deadline:
            return dumps
        time.sleep(0.2)


def read(path: Path, since: float = 0.0) -> dict[str, Any] | None:
    """One dump, or None while it is missing, older than `since`, or still being written."""
    try:
        if path.stat().st_mtime < since:
            return None
        with open(path, "rb") as file:
            dump = pickle.load(file)  # written by the run's own ranks, into its private directory
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    return dump if isinstance(dump, dict) and "entries" in dump else None


@dataclass(frozen=True)
class LastCollective:
    """A rank's latest collective in one process group, from its dump."""

    rank: int
    group: str  # "0 (default_pg)"
    seq: int  # the group's collective sequence number: every rank issues the same sequence
    name: str  # "all_reduce"
    state: str  # "scheduled", "started", "completed"


def last_collectives(rank: int, dump: dict[str, Any]) -> list[LastCollective]:
    """The latest collective of each process group in one rank's dump (point-to-point calls left out)."""
    latest: dict[str, LastCollective] = {}
    for entry in dump.get("entries", []):
        if entry.get("is_p2p"):
            continue
        seq = entry.get("collective_seq_id", entry.get("seq_id"))  # "seq_id" in the first dump versions
        if seq is None:
            continue
        name, desc = (list(entry.get("process_group", ("?", ""))) + [""])[:2]
        group = f"{name} ({desc})" if desc and desc != "undefined" else str(name)
        found = LastCollective(
            rank,
            group,
            int(seq),
            str(entry.get("profiling_name", "?")).removeprefix("nccl:"),
            str(entry.get("state", "?")),
        )
        if group not in latest or found.seq >= latest[group].seq:
            latest[group] = found
    return list(latest.values())


def summarise(dumps: dict[int, dict[str, Any]], ranks: list[int]) -> list[str]:
    """Lines saying, per process group, each rank's last collective and sequence number, and who is behind."""
    if not dumps:
        return []
    by_group: dict[str, dict[int, LastCollective]] = {}
    for rank, dump in sorted(dumps.items()):
        for last in last_collectives(rank, dump):
            by_group.setdefault(last.group, {})[rank] = last
    lines = []
    for group, lasts in sorted(by_group.items()):
        ahead = max(last.seq for last in lasts.values())
        shown = "; ".join(f"rank {r} #{last.seq} {last.name} ({last.state})" for r, last in sorted(lasts.items()))
        behind = sorted(r for r, last in lasts.items() if last.seq < ahead)
        missing = [r for r in ranks if r not in lasts]
        tail = (
            f"; behind: {', '.join(f'rank {r} (#{lasts[r].seq} of #{ahead})' for r in behind)}"
            if behind
            else "; no rank is behind"
        )
        if missing:
            tail += f"; no entry from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        lines.append(f"NCCL flight recorder, group {group}: {shown}{tail}")
    return lines
