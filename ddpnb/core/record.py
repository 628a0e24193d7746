"""What a run is and how it ended, as plain data; `WorkerError` is raised from it."""

from __future__ import annotations

import enum
import re
import signal
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ddpnb.core.messages import Hardware, Progress, StepTimes
from ddpnb.core.spec import Stream

KEEP_CLOSED_BARS = 4
STRAGGLER_RATIO = 1.25  # compute per step, against the median of the other ranks', that flags a rank
RECENT_REPORTS = 20  # StepTimes reports per rank the radar compares (about the last ten seconds)
MIN_STEPS = 3  # steps a rank must have reported before it is compared
HARDWARE_HISTORY = 120  # hardware samples kept per rank (two minutes at one a second)


class OutputLine(NamedTuple):
    """One line a rank printed, as the views get it (`Run.lines_since`)."""

    seq: int  # the run's count of lines so far, this one included
    rank: int
    stream: Stream
    text: str


class Point(NamedTuple):
    """One logged value of a metric (`RunRecord.metrics`): the step given to `ddpnb.log` (or None), when the rank
    logged it (`time.time()`), and the value."""

    step: int | None
    time: float
    value: float


def format_duration(seconds: float) -> str:
    """How long something took, one way in every view: '0.4 s', '12 s', '4 min 05 s', '1 h 02 min'."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


class _Worded(enum.Enum):
    """States and outcomes print as their words: `str(Outcome.TIMED_OUT)` is 'timed out'."""

    def __str__(self) -> str:
        return str(self.value)


class RankState(_Worded):
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # ended by ddpnb because of another rank, a timeout, an interrupt or stop()


class Outcome(_Worded):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed out"
    INTERRUPTED = "interrupted"
    STOPPED = "stopped"


def describe_exit(exitcode: int | None) -> str:
    """`-11` -> 'killed by SIGSEGV', `3` -> 'exited with code 3'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


# What a collective says when a peer died or stopped answering: such a failure is a consequence, not the cause.
_KNOCK_ON_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
_KNOCK_ON_TEXT = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "remote worker", "remote process",
    "communicator was aborted", "ncclremoteerror", "watchdog caught collective operation timeout", "timed out",
    "socket timeout", "failed to recv", "recvvalue failed", "connection refused",
)


def is_knock_on(exc_type: str, message: str) -> bool:
    """True for the errors a rank gets because *another* rank died or hung (collective aborts, resets, timeouts).

    When one rank dies, the others fail in their next collective moments later, often before the kernel even
    notices the death; these errors are ranked after the root cause, whatever their time.
    """
    if exc_type in _KNOCK_ON_TYPES:
        return True
    text = message.lower()
    return exc_type == "RuntimeError" and any(pattern in text for pattern in _KNOCK_ON_TEXT)  # gloo raises these


@dataclass
class Failure:
    rank: int
    time: float
    summary: str  # one line: "ValueError: bad batch" or "killed by SIGSEGV"
    traceback: str = ""  # the worker's own traceback, when it raised
    knock_on: bool = False  # a collective error caused by another rank's failure (see `is_knock_on`)


@dataclass
class RankRecord:
    rank: int
    device: str = "cpu"
    pid: int | None = None
    state: RankState = RankState.STARTING
    exitcode: int | None = None
    started: float = field(default_factory=time.time)
    ended: float | None = None
    lines: int = 0
    last_line: str = ""
    last_text: str = ""  # the latest line that is not a progress bar's (the dashboard shows bars on their own)
    log_path: Path | None = None
    node: str = ""  # Ray: the ID of the node the rank runs on
    stack: str = ""  # Python stacks dumped at a stall (timeout)
    stalled_state: RankState | None = None  # the rank's state when its stack was dumped
    metrics: dict[str, list[Point]] = field(default_factory=dict)
    progress: dict[int, Progress] = field(default_factory=dict)  # the rank's tqdm bars, oldest first
    gpu_memory: tuple[int, int] | None = None  # GPU runs: (reserved now, peak) in bytes
    step_times: deque[StepTimes] = field(default_factory=lambda: deque(maxlen=RECENT_REPORTS))
    slower_by: float | None = None  # a straggler: its compute per step over the others' median, less one (0.38)
    hardware: deque[Hardware] = field(default_factory=lambda: deque(maxlen=HARDWARE_HISTORY))

    @property
    def compute_per_step(self) -> float | None:
        """Seconds of the rank's own compute per step over its recent reports (None before MIN_STEPS)."""
        times = list(self.step_times)
        steps = sum(t.steps for t in times)
        return sum(t.compute for t in times) / steps if steps >= MIN_STEPS else None

    @property
    def straggler(self) -> str:
        """'38% slower compute' for a flagged rank, else ''."""
        return f"{self.slower_by:.0%} slower compute" if self.slower_by is not None else ""

    @property
    def duration(self) -> float:
        return (self.ended or time.time()) - self.started

    def update_progress(self, bar: Progress) -> None:
        """Keep every open bar and the latest few closed ones (a bar per epoch must not grow the record)."""
        self.progress[bar.bar] = bar
        closed = [key for key, known in self.progress.items() if known.closed]
        for key in closed[:-KEEP_CLOSED_BARS]:
            del self.progress[key]

    @property
    def active_progress(self) -> list[Progress]:
        """The bars to show: the open ones (outer loop first), else the last one that closed."""
        bars = list(self.progress.values())
        return [bar for bar in bars if not bar.closed] or bars[-1:]


def flag_stragglers(ranks: list[RankRecord]) -> None:
    """Flag each rank whose compute per step is at least STRAGGLER_RATIO times the median of the other ranks'."""
    computes = {r.rank: c for r in ranks if (c := r.compute_per_step) is not None}
    ordered = sorted(computes.values())
    for rank in ranks:
        mine = computes.get(rank.rank)
        rank.slower_by = None
        if mine is None or len(ordered) < 2:
            continue
        others = list(ordered)
        others.remove(mine)
        median = statistics.median(others)
        if median > 0 and mine >= STRAGGLER_RATIO * median:
            rank.slower_by = mine / median - 1


_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], top: float | None = None) -> str:
    """'▁▃▇█': each value as a block, the tallest at `top` (else the largest value)."""
    top = top if top is not None else max(values, default=0.0)
    if not values or top <= 0:
        return ""
    return "".join(_BLOCKS[min(len(_BLOCKS) - 1, max(0, round(v / top * (len(_BLOCKS) - 1))))] for v in values)


def size_text(count: float) -> str:
    """Bytes as '512.0 MiB', '1.2 GiB': the one byte format of every view, binary as torch's memory summaries
    and nvidia-smi print memory, so a number reads the same in both."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def hardware_text(rank: RankRecord, points: int = 10) -> tuple[str, str, str]:
    """The rank's latest CPU, memory and GPU use as text, each with a sparkline of its last `points` samples
    (CPU on 100% of one core; the others on their own largest); '' where there is no sample."""
    samples = list(rank.hardware)[-points:]
    if not samples:
        return "", "", ""
    last = samples[-1]
    cpu = f"{last.cpu:.0f}% {sparkline([s.cpu for s in samples], max(100.0, *(s.cpu for s in samples)))}"
    rss = f"{size_text(last.rss)} {sparkline([float(s.rss) for s in samples])}"
    gpu = ""
    if last.gpu_util is not None:
        gpu = (f"{last.gpu_util:.0f}% {sparkline([s.gpu_util or 0.0 for s in samples], 100.0)} "
               f"{size_text(last.gpu_memory or 0)} {last.gpu_power or 0:.0f} W")
    return cpu, rss, gpu


class FailureRole(enum.Enum):
    """How a failed rank's failure relates to the run's: what the views call it."""

    ROOT_CAUSE = "failed first"
    OWN = "failed"  # an error of its own, after the root cause (the same bug on another rank)
    KNOCK_ON = "stopped: peer failed"  # a collective's abort because another rank died (see `is_knock_on`)


def root_cause(failures: list[Failure], outcome: Outcome = Outcome.FAILED) -> Failure | None:
    """The earliest failure that is not a knock-on of another rank's (else the earliest); None where ddpnb ended
    the run (a timeout, an interrupt, a stop) and every failure is a consequence of that: the stop is the cause."""
    first = min(failures, key=lambda f: (f.knock_on, f.time)) if failures else None
    return None if first is not None and first.knock_on and outcome in _ENDED_BY_DDPNB else first


_ENDED_BY_DDPNB = (Outcome.TIMED_OUT, Outcome.INTERRUPTED, Outcome.STOPPED)


@dataclass
class Attempt:
    """One ended attempt of a run that was restarted after it (`--max-restarts`): its ranks and failures as they
    were when it ended. The attempt going on (or the last one) is the run record's own `ranks` and `failures`."""

    number: int
    ranks: list[RankRecord]
    failures: list[Failure]
    outcome: Outcome
    note: str
    started: float
    ended: float
    last_line: int  # the run's count of output lines when it ended: where views show the restart

    @property
    def first_failure(self) -> Failure | None:
        return root_cause(self.failures, self.outcome)

    def describe(self) -> str:
        """'rank 1 failed first: killed by SIGKILL', or the outcome and why."""
        first = self.first_failure
        return f"rank {first.rank} failed first: {first.summary}" if first else f"{self.outcome.value}: {self.note}"


@dataclass(frozen=True)
class RankWhere:
    """Where one rank is, in a few words, from its stack (`core.stall.locate`)."""

    rank: int
    quiet: float  # seconds since the rank's last output, metric, progress tick or message
    waits_in: str = ""  # the collective or store wait it is blocked in ("all_reduce"); "" outside one
    call: str = ""  # outside one: the call on its line ("time.sleep"), where the line says
    at: str = ""  # its line: "Cell In[4], line 6" or 'File "train.py", line 6'; "" where no stack came
    ended: str = ""  # a rank no longer in its function: "returned", "finished", "failed", "stopped"

    def phrase(self, plural: bool = False) -> str:
        """'waits in all_reduce (Cell In[4], line 7)', 'is in time.sleep (...)', 'is at ...' ('wait'/'are')."""
        at = f" ({self.at})" if self.at else ""
        if self.ended:
            return f"{'have' if plural else 'has'} {self.ended}"
        if self.waits_in:
            return f"{'wait' if plural else 'waits'} in {self.waits_in}{at}"
        if self.call:
            return f"{'are' if plural else 'is'} in {self.call}{at}"
        return f"{'are' if plural else 'is'} at {self.at}" if self.at else "sent no stack"


@dataclass
class Diagnosis:
    """Where every rank is, at a stall or at the timeout: one phrase per rank, and the stacks it came from."""

    taken: float  # time.time()
    ranks: list[RankWhere]
    stacks: dict[int, str] = field(default_factory=dict)
    flight: list[str] = field(default_factory=list)  # NCCL runs: the flight recorder's summary (`core.flight`)

    def summary(self) -> str:
        """One line, ranks grouped by where they are, those not waiting first: 'rank 1 is in time.sleep (Cell
        In[4], line 6); ranks 0, 2 wait in all_reduce (Cell In[4], line 7)'."""
        groups: dict[tuple[str, str, str, str], list[int]] = {}
        for where in self.ranks:
            groups.setdefault((where.ended, where.waits_in, where.call, where.at), []).append(where.rank)
        first = {where.rank: where for where in self.ranks}
        order = sorted(groups.items(), key=lambda item: (bool(item[0][0]), bool(item[0][1]), item[1][0]))
        return "; ".join(f"{named(ranks)} {first[ranks[0]].phrase(len(ranks) > 1)}" for _, ranks in order)

    def rank_lines(self) -> list[str]:
        """One line per rank with its time since its last activity."""
        return [f"rank {w.rank}: {w.phrase()}, {format_duration(w.quiet)} since its last activity" for w in self.ranks]


@dataclass
class Stall:
    """No rank made progress for `threshold` seconds: the run goes on, marked stalled, until one does."""

    since: float  # time.time() of the last progress of any rank
    threshold: float  # seconds (--stall, or adapted to the run: `core.stall.StallWatch`)
    diagnosis: Diagnosis
    resumed: float | None = None  # when a rank made progress again

    @property
    def ongoing(self) -> bool:
        return self.resumed is None

    def headline(self) -> str:
        quiet = self.diagnosis.taken - self.since
        return (f"stalled: no rank has made progress for {format_duration(quiet)} (threshold {self.threshold:g} s): "
                f"{self.diagnosis.summary()}")


def named(ranks: list[int]) -> str:
    """'rank 1', 'ranks 0, 2'"""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


@dataclass(frozen=True)
class DataSent:
    """What a launch sent the ranks through shared memory (`core.shared`) or Ray's object store rather than in a
    pickle."""

    written: int  # bytes written into memory files at this launch
    reused: int  # bytes earlier launches wrote that were unchanged, so not written again
    blocks: int  # tensor storages and arrays sent this way
    seconds: float  # spent writing them (and comparing arrays with what was written before)
    into: str = "shared memory"  # where they went, as the launch's note names it


@dataclass
class RunRecord:
    """Everything known about one run; `ddpnb.last_run()` and `Run.record` return it."""

    run_dir: Path
    world_size: int
    backend: str
    engine: str = "local"  # the engine's name (`ddpnb.engines`)
    function: str = ""  # the name of the function the ranks run
    ranks: list[RankRecord] = field(default_factory=list)
    outcome: Outcome = Outcome.RUNNING
    failures: list[Failure] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    ended: float | None = None
    note: str = ""  # why a run was stopped (timeout, interrupt, ...)
    hint: str = ""  # how to make the next launch faster (`ddpnb.preload`), said once per kernel
    # restarts: the attempt going on (0 until a restart), the earlier attempts, and how many restarts are allowed
    attempt: int = 0
    attempts: list[Attempt] = field(default_factory=list)
    max_restarts: int = 0
    checkpoint_dir: Path | None = None  # where `ddpnb.save_checkpoint` writes this run's checkpoints
    resumed_from: Path | None = None  # the checkpoints of the run this one continues (--resume)
    data: DataSent | None = None  # notebook data sent out of the pickle (shared memory, Ray's object store)
    # how the launch went, said in every view's header: a CPU fallback, the checkpoint it resumes, the data it wrote
    launch_note: str = ""
    stall: Stall | None = None  # the latest stall of this attempt, ongoing or resumed (`stalled`)
    at_timeout: Diagnosis | None = None  # where every rank was when the timeout stopped the run

    def add_launch_note(self, note: str) -> None:
        """One more thing about the launch for the headers (information, not a warning on stderr)."""
        if note:
            self.launch_note = f"{self.launch_note}; {note}" if self.launch_note else note

    @property
    def stalled(self) -> bool:
        """No rank has made progress for the stall threshold, and the run is still going."""
        return self.stall is not None and self.stall.ongoing and self.outcome is Outcome.RUNNING

    @property
    def first_failure(self) -> Failure | None:
        """The root cause of the last attempt's failure (see `root_cause`); earlier attempts' are in `attempts`."""
        return root_cause(self.failures, self.outcome)

    def failure_role(self, rank: int) -> FailureRole | None:
        """How `rank` failed in the current attempt; None where it did not fail."""
        failure = next((f for f in self.failures if f.rank == rank), None)
        if failure is None:
            return None
        if failure is self.first_failure:
            return FailureRole.ROOT_CAUSE
        return FailureRole.KNOCK_ON if failure.knock_on else FailureRole.OWN

    @property
    def exit_codes(self) -> dict[int, int | None]:
        return {r.rank: r.exitcode for r in self.ranks}

    @property
    def duration(self) -> float:
        return (self.ended or time.time()) - self.started

    def metrics(self, name: str, rank: int = 0, attempt: int | None = None) -> list[Point]:
        """The values logged with `ddpnb.log(name=...)` on one rank, as `Point(step, time, value)`: those of one
        attempt, or of every attempt in turn (after a restart the steps since the checkpoint it loaded come
        again)."""
        records = [*(a.ranks[rank] for a in self.attempts), self.ranks[rank]]
        if attempt is not None:
            records = records[attempt:attempt + 1]
        return [point for record in records for point in record.metrics.get(name, [])]

    def metrics_frame(self) -> Any:
        """Every point `ddpnb.log` sent, from every rank and attempt, as a pandas DataFrame in long format: one row
        per point, columns `rank`, `attempt`, `step` (nullable Int64: None where logged without a step), `time`
        (seconds since the run started), `name` and `value`. Needs pandas (`pip install pandas`); e.g.
        `frame.pivot_table(index="step", columns="rank", values="value")` for one name per rank."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("RunRecord.metrics_frame needs pandas, which ddpnb does not install: "
                              "pip install pandas (record.metrics(name, rank) gives one series without it)") from None
        columns: dict[str, list[Any]] = {"rank": [], "attempt": [], "step": [], "time": [], "name": [], "value": []}
        for attempt, ranks in [*((a.number, a.ranks) for a in self.attempts), (self.attempt, self.ranks)]:
            for rank in ranks:
                for name, points in list(rank.metrics.items()):
                    points = points[:]  # a copy: a running run's reader appends to the record's list
                    if not points:
                        continue
                    steps, times, values = zip(*points)
                    columns["rank"] += [rank.rank] * len(points)
                    columns["attempt"] += [attempt] * len(points)
                    columns["step"] += steps
                    columns["time"] += [at - self.started for at in times]
                    columns["name"] += [name] * len(points)
                    columns["value"] += values
        return pd.DataFrame({
            "rank": pd.Series(columns["rank"], dtype="int64"),
            "attempt": pd.Series(columns["attempt"], dtype="int64"),
            "step": pd.Series(columns["step"], dtype="Int64"),
            "time": pd.Series(columns["time"], dtype="float64"),
            "name": pd.Series(columns["name"], dtype="object"),
            "value": pd.Series(columns["value"], dtype="float64"),
        })

    def summary_table(self) -> str:
        radar = radar_columns(self.ranks)
        rows = [f"{'rank':>4}  {'state':<9} {'exit':<22} {'time':>10}  {radar[0]}last line"]
        for r, extra in zip(self.ranks, radar[1:]):
            rows.append(
                f"{r.rank:>4}  {r.state.value:<9} {describe_exit(r.exitcode):<22} "
                f"{format_duration(r.duration):>10}  {extra}{r.last_line[:60]}"
            )
        return "\n".join(rows)


def radar_columns(ranks: list[RankRecord]) -> list[str]:
    """The summary table's compute and hardware columns, header first, each padded; none where no rank has data."""
    hardware = [hardware_text(r) for r in ranks]
    cells = [[_compute_text(r) for r in ranks], *([h[i] for h in hardware] for i in range(3))]
    names = ["compute/step", "cpu", "rss", "gpu"]
    shown = [(name, column) for name, column in zip(names, cells) if any(column)]
    widths = [max(len(name), *(len(cell) for cell in column)) for name, column in shown]
    header = "".join(f"{name:<{width}}  " for (name, _), width in zip(shown, widths))
    return [header, *("".join(f"{column[i]:<{width}}  " for (_, column), width in zip(shown, widths))
                      for i in range(len(ranks)))]


def _compute_text(rank: RankRecord) -> str:
    compute = rank.compute_per_step
    if compute is None:
        return ""
    return f"{compute * 1000:.1f} ms" + (f" ({rank.straggler})" if rank.straggler else "")


def cell_names(traceback: str) -> str:
    """`File "/tmp/ipykernel_7/2718.py", line 5` as IPython names its own cells: `Cell In[7], line 5`."""

    def cell(match: re.Match[str]) -> str:
        name = cell_name(match.group(1))
        return f"{name}, line {match.group(2)}" if name else match.group(0)

    return re.sub(r'File "([^"]+)", line (\d+)', cell, traceback)


def cell_name(filename: str) -> str:
    """'Cell In[7]' for the file IPython compiled cell 7 as, in this kernel; '' for any other file (or outside
    IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    name_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    named = name_of(filename) if name_of is not None else None
    return " ".join(named) if named else ""


def cell_names_of(filenames: Iterable[str]) -> dict[str, str]:
    """{filename: 'Cell In[7]'} for those of `filenames` that are this kernel's cells: what ranks name them by."""
    return {filename: name for filename in filenames if (name := cell_name(filename))}


def stopped_line(record: RunRecord) -> str:
    """A stopped run, said as what happened rather than as an error: 'run stopped by the user at 12:01:05, 12 s
    after it started; it has no value (the ranks were stopped before every one had returned)'."""
    note = record.note or "stopped"
    said = note if note.startswith("stopped") else f"stopped ({note})"
    at = time.strftime("%H:%M:%S", time.localtime(record.ended or time.time()))
    return (f"run {said} at {at}, {format_duration(record.duration)} after it started; it has no value (the "
            "ranks were stopped before every one had returned)")


class WorkerError(RuntimeError):
    """A run did not succeed. Shows the first failing rank's own traceback, not ddpnb's stack."""

    def __init__(self, record: RunRecord, hint: str = "") -> None:
        self.record = record
        self.hint = hint
        first = record.first_failure
        self.rank = first.rank if first else None
        headline = (
            f"rank {first.rank} failed first: {first.summary}"
            if first
            else stopped_line(record) if record.outcome is Outcome.STOPPED
            else f"run {record.outcome.value}: {record.note}"
        )
        if record.attempts:  # every attempt's first failure, the last one's first
            headline = f"attempt {record.attempt}: {headline}; " + "; ".join(
                f"attempt {a.number}: {a.describe()}" for a in reversed(record.attempts))
        super().__init__(headline)

    def report(self) -> str:
        record = self.record
        first = record.first_failure
        parts = []
        if first is not None:
            again = f" (attempt {record.attempt})" if record.attempts else ""
            parts.append(f"ddpnb: rank {first.rank} of {record.world_size} failed first{again}: {first.summary}")
            if first.traceback:
                shown = cell_names(first.traceback).rstrip()
                parts.append(f"\n--- rank {first.rank} traceback (in the worker) ---\n{shown}")
            others = [f for f in sorted(record.failures, key=lambda f: f.time) if f is not first]
            own = [f for f in others if not f.knock_on]  # an error of the rank's own, not a collective's abort
            if own:
                parts.append("\nalso failed:")
                parts.extend(f"  rank {f.rank}: " + ("the same error" if f.summary == first.summary
                                                     else f.summary) for f in own)
            if len(own) < len(others):
                parts.append("\nthen, as a consequence:")
                parts.extend(f"  rank {f.rank}: {f.summary}" for f in others if f.knock_on)
        elif record.outcome is Outcome.STOPPED:
            parts.append(f"ddpnb: {stopped_line(record)}.")
        else:
            parts.append(f"ddpnb: run {record.outcome.value}: {record.note}")
            if record.at_timeout is not None:  # where each rank was, one line each, before the stacks
                parts.append(f"where each rank was: {record.at_timeout.summary()}")
                parts.extend(f"  {line}" for line in record.at_timeout.rank_lines())
                parts.extend(f"  {line}" for line in record.at_timeout.flight)
        if first is None and record.failures:  # ranks that failed because ddpnb stopped the others
            parts.append("\nthen, as a consequence:")
            parts.extend(f"  rank {f.rank}: {f.summary}" for f in sorted(record.failures, key=lambda f: f.time))
        if record.attempts:
            parts.append(f"\nthat was attempt {record.attempt}, the last (--max-restarts {record.max_restarts}); "
                         "the earlier ones, each ended by stopping every rank and starting them all again:")
            parts.extend(f"  attempt {a.number}: {a.describe()}" for a in record.attempts)
        stacks = [r for r in record.ranks if r.stack]
        if stacks:
            parts.append("\nwhere each rank was when the run was stopped:")
            for r in stacks:
                state = (r.stalled_state or r.state).value
                parts.append(f"--- rank {r.rank} ({state}, last line: {r.last_line!r}) ---\n{r.stack.rstrip()}")
        parts.append("\n" + record.summary_table())
        parts.append(f"\nfull per-rank logs: {record.run_dir}")
        if self.hint:
            parts.append(self.hint)
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.report()

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines instead of the kernel-side stack, which is ddpnb's, not the user's.
        return self.report().splitlines()


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or Jupyter's interrupt stopped a run. Still a KeyboardInterrupt (loops and scripts stop as they
    would); in IPython it shows what happened instead of ddpnb's waiting stack."""

    def __init__(self, record: RunRecord, starting: bool = False) -> None:
        self.record = record
        self.starting = starting  # before every rank had started: nothing ran, nothing is kept
        super().__init__("ddpnb: interrupted while the ranks were starting; none is running" if starting else
                         f"ddpnb: run interrupted after {format_duration(record.duration)}; every rank was stopped")

    def report(self) -> str:
        if self.starting:
            return (f"KeyboardInterrupt: {self.args[0]}.\nRun the cell again when ready (a kernel's first run waits "
                    "while ddpnb's worker process imports torch); the kernel and its variables are unchanged.")
        return "\n".join([
            f"KeyboardInterrupt: {self.args[0]}.", "", self.record.summary_table(), "",
            f"full per-rank logs: {self.record.run_dir}",
            "Run the cell again when ready; the kernel and its variables are unchanged.",
        ])

    def _render_traceback_(self) -> list[str]:
        return self.report().splitlines()
