"""`--profile`: which steps a run profiles, the marks a rank's trace carries, and, in the kernel, the ranks'
traces merged into one on one time base with each rank's step time broken down (docs/profiling.md).

The ranks (`rank.profile`) import this module for the names below only; the rest runs in the kernel when an
attempt that profiled ends (`Traces.finish`).

Alignment: ranks on one machine read one clock and need none. Across machines, each rank measures its clock
against rank 0's when the profile starts, as Cristian's algorithm does, through the run's store and in the
profiler's own timestamps: it marks `ping` in its trace and sets a key; rank 0, once every rank's key is there,
marks `serve` and answers; the rank marks `pong` when the answer comes. Rank 0's `serve` happened between the
rank's `ping` and `pong`, so the rank's offset is (ping + pong) / 2 - serve, within half the round trip. Of
EXCHANGES round trips the shortest is taken (on a loaded machine a process can wait milliseconds for a CPU, but
rarely every time), and of a machine's ranks the one measured best. The same exchanges when the profile stops
give the drift.

The breakdown splits each profiled step of a rank's training thread, instant by instant, into the first that
applies of: data loading (a DataLoader's `__next__`), compute (an operator running on any of the rank's threads,
or a kernel on its GPU, collectives aside), waiting in a collective (the rank's part of a collective before the
last rank started its part of the same one: the k-th collective of each name, matched across ranks), communication
(the rest of the collective) and other (Python between operators, ddpnb, idle). So the parts add up to the step.
"""

from __future__ import annotations

import bisect
import gzip
import itertools
import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ddpnb.core.messages import Profiled
from ddpnb.core.rundir import private
from ddpnb.core.spec import LaunchError

EXCHANGES = 5  # clock round trips per rank with rank 0, at the start and at the end of a profile
DEFAULT_STEPS = (3, 5)  # bare --profile: three steps after a warm-up of the first ones
START_MARK = "ddpnb/clock-sync"  # then "/ping", "/serve", "/pong" (see the module's docstring)
END_MARK = "ddpnb/clock-sync-end"
STEP_SPAN = "ProfilerStep#"  # a profiled step, as torch.profiler's schedule names it (TensorBoard and HTA read it)
REGION_SPAN = "ddpnb.profile"  # a `with ddpnb.profile():` region
RANK_FILE = "rank{rank}.pt.trace.json.gz"  # TensorBoard's profiler plugin reads `*.pt.trace.json.gz` as workers
MERGED_FILE = "trace.json.gz"
TOP_OPS = 5
WAITED_AT_LEAST = 0.05  # a share of the step below which a rank is not said to wait for another
PARTS = ("compute", "communication", "waiting", "data", "other")
_COLLECTIVE = re.compile(r"^(gloo:|nccl:|c10d::|record_param_comms)")
_GPU_COLLECTIVE = re.compile(r"^nccl", re.IGNORECASE)
_GPU_TID = 1_000_000_000  # a GPU stream's thread in its rank's process: above any OS thread id


def profile_steps(value: object) -> tuple[int, int] | None:
    """--profile / `profile=`: None or False (off), True or '' (the default steps), 'A-B', 'A', N or (A, B)."""
    if value is None or value is False:
        return None
    if value is True or value == "":
        return DEFAULT_STEPS
    first = last = None
    if isinstance(value, int):
        first = last = value
    elif isinstance(value, (tuple, list, range)) and len(value) >= 1 and all(isinstance(v, int) for v in value):
        first, last = value[0], value[-1]
    elif isinstance(value, str) and (found := re.fullmatch(r"\s*(\d+)\s*(?:[-:]\s*(\d+))?\s*", value)):
        first = int(found.group(1))
        last = int(found.group(2)) if found.group(2) is not None else first
    if first is None or last is None or isinstance(value, bool) or first < 1 or last < first:
        raise LaunchError(
            f"profile takes the steps to profile, counted by ddpnb.log(step=...), as FIRST-LAST with "
            f"1 <= FIRST <= LAST (e.g. --profile 5-7), or no value for steps {DEFAULT_STEPS[0]}-"
            f"{DEFAULT_STEPS[1]}; not {value!r}."
        )
    return first, last


def steps_words(steps: tuple[int, int] | None) -> str:
    if steps is None:
        return "the ddpnb.profile() region"
    return f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}-{steps[1]}"


def profile_dir(run_dir: Path, attempt: int, restarts: bool) -> Path:
    """Where an attempt's traces go: `profile/`, or with restarts one folder per attempt (`profile/attempt1/`)."""
    return run_dir / "profile" / f"attempt{attempt}" if restarts else run_dir / "profile"


# --- the figures ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankTime:
    """One rank's profiled steps: seconds per step, split into parts that add up to `step`."""

    rank: int
    name: str  # "rank 1 (host, cpu)", as the merged trace names its process
    spans: int  # profiled steps measured (1 for a region)
    step: float
    compute: float
    communication: float
    waiting: float
    data: float
    other: float
    waited_for: dict[int, float] = field(default_factory=dict)  # seconds per step waited, by the rank waited for
    top_ops: tuple[tuple[str, float], ...] = ()  # (operator, self seconds per step), most first
    offset: float = 0.0  # seconds its events were shifted by to align them with rank 0's
    drift: float | None = None  # how much that offset changed by the end mark, in seconds (None: no end mark)

    def share(self, part: str) -> float:
        return getattr(self, part) / self.step if self.step > 0 else 0.0


@dataclass
class Profile:
    """An attempt's profile: the merged trace, each rank's own, and the breakdown (`RunRecord.profile`)."""

    trace: Path | None  # the merged trace (Chrome trace format, gzipped); None where no rank sent one
    rank_traces: dict[int, Path]
    steps: str  # what was profiled, in words ("steps 5-7")
    ranks: list[RankTime] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what is missing or partial, in words
    attempt: int = 0
    merge_seconds: float = 0.0  # the kernel's time to merge and break down
    size: int = 0  # bytes of the merged trace

    def __repr__(self) -> str:
        return f"<Profile of {self.steps}, {len(self.ranks)} ranks, {self.trace}>"

    def waited(self) -> tuple[list[int], int, list[float]] | None:
        """(the ranks that waited, the rank they waited for, each one's share of its step), for the rank waited
        for the most; None where no rank waited WAITED_AT_LEAST of its step for another."""
        totals: dict[int, float] = defaultdict(float)
        for rank in self.ranks:
            for other, seconds in rank.waited_for.items():
                totals[other] += seconds
        if not totals:
            return None
        slow = max(totals, key=totals.__getitem__)
        waiters = [
            (r.rank, r.waited_for.get(slow, 0.0) / r.step)
            for r in self.ranks
            if r.rank != slow and r.step > 0 and r.waited_for.get(slow, 0.0) / r.step >= WAITED_AT_LEAST
        ]
        if not waiters:
            return None
        return [rank for rank, _ in waiters], slow, [share for _, share in waiters]


# --- the kernel's side: traces in, merged and broken down -----------------------------------------------------
class Traces:
    """One attempt's traces as the ranks send them (`messages.Profiled`): each written to its file at once; merged
    when the attempt ends."""

    def __init__(self, directory: Path, world_size: int, attempt: int = 0) -> None:
        self.directory = directory
        self.world_size = world_size
        self.attempt = attempt
        self.sent: dict[int, Profiled] = {}  # rank -> its message, the trace's bytes left out once written
        self.files: dict[int, Path] = {}
        self.unwritten: dict[int, str] = {}  # rank -> why its trace could not be written (a full disk)

    def add(self, message: Profiled) -> None:
        if message.trace:
            path = self.directory / RANK_FILE.format(rank=message.rank)
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                with open(path, "wb", opener=private) as file:
                    file.write(message.trace)
            except OSError as exc:  # the disk's doing, not the rank's: the profile goes on without it, saying why
                self.unwritten[message.rank] = f"{type(exc).__name__}: {exc}"
                path.unlink(missing_ok=True)  # no cut-short trace that a viewer would half load
            else:
                self.files[message.rank] = path
        self.sent[message.rank] = replace(message, trace=b"")

    def finish(self) -> Profile | None:
        """The merged trace and breakdown; None where no rank profiled."""
        if not self.sent:
            return None
        began = time.perf_counter()
        first = next(iter(self.sent.values()))
        steps = steps_words(tuple(first.steps) if first.steps else None)
        notes = [f"rank {rank}: {message.note}" for rank, message in sorted(self.sent.items()) if message.note]
        notes += [
            f"rank {rank}'s trace could not be written ({why}): it is not in the merged trace"
            for rank, why in sorted(self.unwritten.items())
        ]
        missing = [r for r in range(self.world_size) if r not in self.files and r not in self.unwritten]
        if missing and len(missing) < self.world_size:
            notes.append(f"no trace from {_ranks_words(missing)}: only the others are in the merged trace")
        profile = Profile(
            trace=None, rank_traces=dict(sorted(self.files.items())), steps=steps, notes=notes, attempt=self.attempt
        )
        if self.files:
            names = {rank: f"rank {rank} ({m.host}, {m.device})" for rank, m in self.sent.items()}
            merged = self.directory / MERGED_FILE
            profile.ranks, more = merge(self.files, names, merged, {rank: m.host for rank, m in self.sent.items()})
            profile.notes += more
            profile.trace, profile.size = merged, merged.stat().st_size
        profile.merge_seconds = time.perf_counter() - began
        return profile


def _ranks_words(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rb") as file:
        return json.load(file)


def _marks(events: list[dict[str, Any]], name: str, base: float) -> list[float]:
    """The times of a rank's marks of one kind, in order (µs since the epoch)."""
    return sorted(e["ts"] + base for e in events if e.get("ph") == "X" and e.get("name") == name)


def _clock(marks: dict[int, dict[str, list[float]]], rank: int) -> tuple[float, float] | None:
    """(offset of `rank`'s clock to rank 0's, round trip) from the shortest of its exchanges, in µs."""
    trips = [
        (pong - ping, (ping + pong) / 2 - serve)
        for ping, pong, serve in zip(marks[rank]["ping"], marks[rank]["pong"], marks.get(0, {}).get("serve", []))
    ]
    return min(trips) if trips else None


def _offsets(
    starts: dict[int, dict[str, list[float]]], ends: dict[int, dict[str, list[float]]], hosts: dict[int, str]
) -> tuple[dict[int, float], dict[int, float | None], list[int]]:
    """Each rank's clock offset to rank 0's and its drift by the end (µs), one per host, the host's best measured
    rank's; and the ranks that could not be aligned (on another host than rank 0, without exchanges)."""
    home = hosts.get(0, hosts.get(min(hosts), "")) if hosts else ""
    offset: dict[int, float] = {}
    drift: dict[int, float | None] = {}
    unaligned = []
    for host in set(hosts.values()):
        ranks = [rank for rank, on in hosts.items() if on == host]
        if host == home:
            offset.update(dict.fromkeys(ranks, 0.0))
            drift.update(dict.fromkeys(ranks, 0.0 if 0 in ends else None))
            continue
        began = [found for rank in ranks if (found := _clock(starts, rank)) is not None]
        if not began:
            offset.update(dict.fromkeys(ranks, 0.0))
            drift.update(dict.fromkeys(ranks, None))
            unaligned += ranks
            continue
        ended = [found for rank in ranks if rank in ends and (found := _clock(ends, rank)) is not None]
        offset.update(dict.fromkeys(ranks, min(began)[1]))
        drift.update(dict.fromkeys(ranks, min(ended)[1] - min(began)[1] if ended else None))
    return offset, drift, sorted(unaligned)


def merge(
    files: dict[int, Path], names: dict[int, str], out: Path, hosts: dict[int, str] | None = None
) -> tuple[list[RankTime], list[str]]:
    """Each rank's trace read, aligned on the marks and written as one process per rank into `out`; returns the
    breakdown per rank and notes on what could not be aligned. `hosts`: each rank's machine (one clock each)."""
    hosts = hosts or {}
    traces = {rank: _load(path) for rank, path in sorted(files.items())}
    notes: list[str] = []
    base = {rank: trace.get("baseTimeNanoseconds", 0) / 1000 for rank, trace in traces.items()}  # µs
    starts, ends = (
        {
            rank: {
                kind: _marks(trace["traceEvents"], f"{name}/{kind}", base[rank]) for kind in ("ping", "serve", "pong")
            }
            for rank, trace in traces.items()
        }
        for name in (START_MARK, END_MARK)
    )
    ends = {rank: kinds for rank, kinds in ends.items() if any(kinds.values())}
    origin = base[0 if 0 in traces else min(traces)]
    # µs to subtract from each rank's absolute times
    offset, drift, unaligned = _offsets(starts, ends, {rank: hosts.get(rank, "") for rank in traces})
    if unaligned:
        notes.append(
            f"{_ranks_words(unaligned)} could not be aligned with rank 0's clock (no exchange with rank 0 at "
            "the first profiled step); its clock is taken as it is"
        )
    worst = max((abs(d) for d in drift.values() if d is not None), default=0.0)
    if worst > 1000:
        notes.append(f"the ranks' clocks drifted apart by up to {worst / 1000:.1f} ms over the profile")

    events_out: list[dict[str, Any]] = []
    aligned: dict[int, list[dict[str, Any]]] = {}
    world = max(traces) + 1
    for rank, trace in traces.items():
        shift = base[rank] - origin - offset[rank]
        events = trace["traceEvents"]
        main = next((e["pid"] for e in events if e.get("name", "").startswith((STEP_SPAN, REGION_SPAN))), None) or next(
            (e["pid"] for e in events if e.get("cat") == "cpu_op"), None
        )
        pid = rank + 1  # pid 0 is the idle process to some viewers
        mine: list[dict[str, Any]] = []
        for event in events:
            if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue
            event = dict(event)
            if "ts" in event:
                event["ts"] = round(event["ts"] + shift, 3)
            if event.get("pid") != main:  # the GPU's timelines, as threads of the rank's process
                tid = event.get("tid", 0)
                event["tid"] = _GPU_TID + (tid if isinstance(tid, int) else abs(hash(tid)) % _GPU_TID)
            event["pid"] = pid
            if event.get("ph") in ("s", "f", "t") and isinstance(event.get("id"), int):
                event["id"] = event["id"] * world + rank  # flow ids are per process: unique across ranks now
            mine.append(event)
        events_out += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": names[rank]}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": rank}},
        ]
        events_out += mine
        aligned[rank] = mine
    times = [_with_clock(t, offset[t.rank], drift[t.rank]) for t in breakdown(aligned, names)]
    clocks = [
        {
            "rank": t.rank,
            "name": t.name,
            "offset_us": round(offset[t.rank], 3),
            "drift_us": None if t.drift is None else round(t.drift * 1e6, 3),
        }
        for t in times
    ]
    document = {
        "traceEvents": events_out,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": int(origin * 1000),
        "ddpnb": {"ranks": clocks, "notes": notes},
    }
    with open(out, "wb", opener=private) as file, gzip.GzipFile(fileobj=file, mode="wb", compresslevel=3) as packed:
        packed.write(json.dumps(document, separators=(",", ":")).encode())
    return times, notes


def _with_clock(times: RankTime, offset: float, drift: float | None) -> RankTime:
    """`times` with its clock's offset and drift, given in µs, kept in seconds."""
    return RankTime(**{**times.__dict__, "offset": offset / 1e6, "drift": None if drift is None else drift / 1e6})


# --- the breakdown ---------------------------------------------------------------------------------------------
@dataclass
class _Collective:
    rank: int
    start: float
    end: float
    wait_end: float = 0.0
    last: int = -1  # the rank that started its part last


def _collectives(events: list[dict[str, Any]]) -> dict[str, list[_Collective]]:
    """A rank's collectives by name, in order: its GPU's NCCL kernels where it has any, else the `gloo:`/`nccl:`
    spans torch records where each collective runs."""
    kernels = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "kernel" and _GPU_COLLECTIVE.match(e.get("name", ""))
    ]
    chosen = kernels or [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith(("gloo:", "nccl:"))
    ]
    named: dict[str, list[_Collective]] = defaultdict(list)
    for event in sorted(chosen, key=lambda e: e["ts"]):
        named[event["name"]].append(_Collective(-1, event["ts"], event["ts"] + event.get("dur", 0)))
    return named


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        elif end > start:
            merged.append((start, end))
    return merged


def _inside(union: list[tuple[float, float]], starts: list[float], at: float) -> bool:
    index = bisect.bisect_right(starts, at) - 1
    return index >= 0 and union[index][1] > at


def breakdown(events: dict[int, list[dict[str, Any]]], names: dict[int, str]) -> list[RankTime]:
    """Each rank's profiled steps split into PARTS (see the module's docstring), from its aligned events."""
    collectives = {rank: _collectives(evs) for rank, evs in events.items()}
    for name in {name for named in collectives.values() for name in named}:
        count = min(len(named.get(name, [])) for named in collectives.values())
        for k in range(count):
            group = [named[name][k] for named in collectives.values()]
            for rank, collective in zip(collectives, group):
                collective.rank = rank
            last = max(group, key=lambda c: c.start)
            for collective in group:
                collective.wait_end = min(collective.end, max(collective.start, last.start))
                collective.last = last.rank
    return [
        _rank_time(rank, evs, [c for named in collectives[rank].values() for c in named], names[rank])
        for rank, evs in events.items()
    ]


def _rank_time(rank: int, events: list[dict[str, Any]], collectives: list[_Collective], name: str) -> RankTime:
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    spans = [e for e in complete if e.get("name", "").startswith(STEP_SPAN) or e.get("name") == REGION_SPAN]
    thread = spans[0]["tid"] if spans else None
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == thread]
    data = _union(
        [
            (e["ts"], e["ts"] + e["dur"])
            for e in complete
            if e["tid"] == thread and "DataLoader" in e.get("name", "") and "__next__" in e.get("name", "")
        ]
    )
    computing = [
        e
        for e in complete
        if (e.get("cat") == "cpu_op" or (e.get("cat") == "kernel"))
        and not _COLLECTIVE.match(e.get("name", ""))
        and not _GPU_COLLECTIVE.match(e.get("name", ""))
    ]
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in computing])
    waits = [(c.start, c.wait_end, c.last) for c in collectives if c.wait_end > c.start and c.last != rank]
    waiting = _union([(start, end) for start, end, _ in waits])
    moving = _union([(c.wait_end if c.last >= 0 else c.start, c.end) for c in collectives])
    parts = dict.fromkeys(PARTS, 0.0)
    waited_for: dict[int, float] = defaultdict(float)
    layers = [("data", data), ("compute", compute), ("waiting", waiting), ("communication", moving)]
    starts = {part: [s for s, _ in union] for part, union in layers}
    for span_start, span_end in spans:
        cuts = {span_start, span_end}
        for _, union in layers:
            cuts.update(t for interval in union for t in interval if span_start < t < span_end)
        edges = sorted(cuts)
        for left, right in itertools.pairwise(edges):
            middle = (left + right) / 2
            part = next((part for part, union in layers if _inside(union, starts[part], middle)), "other")
            parts[part] += right - left
            if part == "waiting":
                waited = next((who for start, end, who in waits if start <= middle < end), None)
                if waited is not None:
                    waited_for[waited] += right - left
    count = max(1, len(spans))
    per_step = {part: seconds / count / 1e6 for part, seconds in parts.items()}
    step = sum((end - start) for start, end in spans) / count / 1e6
    return RankTime(
        rank=rank,
        name=name,
        spans=len(spans),
        step=step,
        **per_step,
        waited_for={who: seconds / count / 1e6 for who, seconds in waited_for.items()},
        top_ops=_top_ops(computing, spans, count),
    )


def _top_ops(
    events: list[dict[str, Any]], spans: list[tuple[float, float]], count: int
) -> tuple[tuple[str, float], ...]:
    """Operators (and GPU kernels) by self time inside the profiled steps, most first."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        by_thread[(event["pid"], event["tid"])].append(event)
    span_starts = [start for start, _ in spans]
    totals: dict[str, float] = defaultdict(float)
    for thread_events in by_thread.values():
        stack: list[list[Any]] = []  # [end, name, self time, counted]
        for event in sorted(thread_events, key=lambda e: (e["ts"], -e["dur"])):
            start, end = event["ts"], event["ts"] + event["dur"]
            while stack and stack[-1][0] <= start:
                _close(stack.pop(), totals)
            if stack:
                stack[-1][2] -= min(end, stack[-1][0]) - start
            index = bisect.bisect_right(span_starts, start) - 1
            counted = index >= 0 and spans[index][1] > start
            stack.append([end, event["name"], end - start, counted])
        while stack:
            _close(stack.pop(), totals)
    ranked = sorted(totals.items(), key=lambda item: -item[1])[:TOP_OPS]
    return tuple((name, seconds / count / 1e6) for name, seconds in ranked)


def _close(entry: list[Any], totals: dict[str, float]) -> None:
    if entry[3]:
        totals[entry[1]] += max(0.0, entry[2])
