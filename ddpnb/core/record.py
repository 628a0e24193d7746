"""What a run is and how it ended, as plain data: the run's record, its ranks', attempts' and stalls' records.

Which failure is the cause is `core.failures`'s to say; how a record reads to the user (the summary table, the
exceptions a run raises) is `core.report`'s.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ddpnb.core.failures import Failure, FailureRole, role, root_cause
from ddpnb.core.messages import Hardware, Progress, StepTimes
from ddpnb.core.series import Point, Series
from ddpnb.core.spec import Stream
from ddpnb.core.words import Named, format_duration, ranks_text

if TYPE_CHECKING:
    from ddpnb.core.profile import Profile

KEEP_CLOSED_BARS = 4
RECENT_REPORTS = 20  # StepTimes reports per rank the radar compares (about the last ten seconds)
MIN_STEPS = 3  # steps a rank must have reported before it is compared
HARDWARE_HISTORY = 120  # hardware samples kept per rank (two minutes at one a second)


class OutputLine(NamedTuple):
    """One line a rank printed, as the views get it (`Run.lines_since`)."""

    seq: int  # the run's count of lines so far, this one included
    rank: int
    stream: Stream
    text: str


class RankState(Named):
    """Where one rank is in its life, as every view shows it."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # ended by ddpnb because of another rank, a timeout, an interrupt or stop()


class Outcome(Named):
    """How a run ended (RUNNING until it has)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed out"
    INTERRUPTED = "interrupted"
    STOPPED = "stopped"

    @property
    def ended_by_ddpnb(self) -> bool:
        """A timeout, an interrupt or a stop: ddpnb ended the run, so failures after it are its consequences."""
        return self in (Outcome.TIMED_OUT, Outcome.INTERRUPTED, Outcome.STOPPED)


@dataclass(repr=False)
class RankRecord:
    """One rank in one attempt, as plain data: its process, state, output, metrics, progress and samples."""

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
    breakpoint_at: str = ""  # where the rank waits at a debugger prompt ('Cell In[5], line 7, in train'), if it does
    metrics: dict[str, Series] = field(default_factory=dict)  # every point, in bounded memory (`core.series`)
    progress: dict[int, Progress] = field(default_factory=dict)  # the rank's tqdm bars, oldest first
    gpu_memory: tuple[int, int] | None = None  # GPU runs: (reserved now, peak) in bytes
    step_times: deque[StepTimes] = field(default_factory=lambda: deque(maxlen=RECENT_REPORTS))  # `add_step_times`
    _per_step: tuple[float, float] | None = field(default=None, init=False, repr=False)  # compute, wall a step
    late: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_REPORTS))  # per reported step: seconds
    # it came to that step's collectives after the other ranks (`core.stragglers`)
    holds_others: float | None = None  # a straggler: seconds a step the others typically wait for it
    hardware: deque[Hardware] = field(default_factory=lambda: deque(maxlen=HARDWARE_HISTORY))

    def __repr__(self) -> str:  # a short line: the full dataclass repr runs to thousands of characters
        # a copy of the items: the reader thread may add a metric meanwhile
        metrics = ", ".join(f"{name}: {len(points)}" for name, points in list(self.metrics.items()))
        return (
            f"<RankRecord rank {self.rank} {self.state.value} exit={self.exitcode} pid={self.pid} "
            f"device={self.device}{f' node={self.node}' if self.node else ''} lines={self.lines}"
            f"{f' metrics ({metrics})' if metrics else ''}>"
        )

    def _repr_html_(self) -> str:
        last = f"<div>last line: <code>{escape(self.last_line[:200])}</code></div>" if self.last_line else ""
        return f"<div class='ddpnb-record'><code>{escape(repr(self))}</code>{last}</div>"

    def add_step_times(self, report: StepTimes) -> None:
        """Keep `report` among the recent ones and their per-step figures with them: a thousand ranks' table reads
        them every redraw, a rank's report comes about every half second."""
        self.step_times.append(report)
        steps = sum(t.steps for t in self.step_times)
        self._per_step = (
            (sum(t.compute for t in self.step_times) / steps, sum(t.wall for t in self.step_times) / steps)
            if steps >= MIN_STEPS
            else None
        )

    @property
    def compute_per_step(self) -> float | None:
        """Seconds of the rank's own compute per step over its recent reports (None before MIN_STEPS)."""
        return self._per_step[0] if self._per_step is not None else None

    @property
    def step_time(self) -> float | None:
        """Seconds a step took over the rank's recent reports (None before MIN_STEPS)."""
        return self._per_step[1] if self._per_step is not None else None

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


@dataclass(repr=False)
class AttemptRecord:
    """One attempt of a run (every rank started once), as plain data written by that attempt alone
    (`core.attempt`): its ranks, failures, stall, wait in the queue, profile and how it ended. The run files it:
    the attempt going on (or the last) is `RunRecord.current`, whose fields the run record's `ranks`, `failures`,
    `stall` and the rest read; the attempts that ended before a restart are in `RunRecord.attempts`."""

    number: int
    ranks: list[RankRecord]
    failures: list[Failure] = field(default_factory=list)
    outcome: Outcome = Outcome.RUNNING
    note: str = ""
    started: float = field(default_factory=time.time)
    ended: float | None = None
    last_line: int = 0  # the run's count of output lines when it ended: where views show the restart
    stall: Stall | None = None  # the latest stall, ongoing or resumed
    at_timeout: Diagnosis | None = None  # where every rank was when the timeout stopped it
    queued: Queued | None = None  # its wait for its engine's resources, ongoing or over
    profile: Profile | None = None  # --profile: its merged trace and breakdown (`core.profile`)
    hint: str = ""  # how to make the next launch faster (`ddpnb.preload`), said once per kernel
    internal_errors: list[str] = field(default_factory=list)  # bugs of ddpnb's own in reading its ranks

    @property
    def first_failure(self) -> Failure | None:
        return root_cause(self.failures, self.outcome.ended_by_ddpnb)

    def __repr__(self) -> str:
        first = self.first_failure
        return (
            f"<Attempt {self.number} {self.outcome.value}"
            f"{f', rank {first.rank} failed first' if first else ''}, {len(self.ranks)} ranks>"
        )

    def _repr_html_(self) -> str:
        return _record_html(repr(self), self.ranks)


@dataclass(frozen=True)
class RankWhere:
    """Where one rank is, in a few words, from its stack (`core.stall.locate`)."""

    rank: int
    quiet: float  # seconds since the rank's last output, metric, progress tick or message
    waits_in: str = ""  # the collective or store wait it is blocked in ("all_reduce"); "" outside one
    call: str = ""  # outside one: the call on its line ("time.sleep"), where the line says
    at: str = ""  # its line: "Cell In[4], line 6" or 'File "train.py", line 6'; "" where no stack came
    ended: str = ""  # a rank no longer in its function: "returned", "finished", "failed", "stopped"
    starting: bool = False  # no line of the user's on its stack, and it has not said it started
    unreported: bool = False  # from `groups.GROUP_FROM` ranks up: a running rank whose stack did not come


@dataclass
class Diagnosis:
    """Where every rank is, at a stall or at the timeout: one phrase per rank, and the stacks it came from."""

    taken: float  # time.time()
    ranks: list[RankWhere]
    stacks: dict[int, str] = field(default_factory=dict)
    flight: list[str] = field(default_factory=list)  # NCCL runs: the flight recorder's summary (`core.flight`)


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


@dataclass
class Queued:
    """The ranks waited for their engine's resources before starting (a job in Slurm's queue): no clock of the
    run's ran meanwhile (timeout, stall)."""

    what: str  # what waited, as the engine names it: 'slurm job 1234'
    state: str  # its latest state, as the engine said it: 'pending (Priority)'
    since: float = field(default_factory=time.time)
    until: float | None = None  # when it stopped waiting (granted, or the run ended)

    @property
    def ongoing(self) -> bool:
        return self.until is None

    def words(self) -> str:
        """'slurm job 1234 pending (Priority), 2 min so far' while it waits; 'slurm job 1234 queued 2 min'."""
        waited = format_duration((self.until or time.time()) - self.since)
        return f"{self.what} {self.state}, {waited} so far" if self.ongoing else f"{self.what} queued {waited}"


@dataclass(frozen=True)
class DataSent:
    """What a launch sent the ranks through shared memory (`node.shared`) or Ray's object store rather than in a
    pickle."""

    written: int  # bytes written into memory files at this launch
    reused: int  # bytes earlier launches wrote that were unchanged, so not written again
    blocks: int  # tensor storages and arrays sent this way
    seconds: float  # spent writing them (and comparing arrays with what was written before)
    into: str = "shared memory"  # where they went, as the launch's note names it


@dataclass(repr=False)
class RunRecord:
    """Everything known about one run; `ddpnb.last_run()` and `Run.record` return it. Its repr is one line; its
    fields hold the rest (`ranks`, `attempts`, `failures`, `metrics(...)`, `metrics_frame()`)."""

    run_dir: Path
    world_size: int
    backend: str
    engine: str = "local"  # the engine's name (`ddpnb.engines`)
    function: str = ""  # the name of the function the ranks run
    outcome: Outcome = Outcome.RUNNING
    started: float = field(default_factory=time.time)
    ended: float | None = None
    note: str = ""  # why a run was stopped (timeout, interrupt, ...)
    # the attempt going on (or the last), and those that ended before a restart; each written by its attempt alone
    current: AttemptRecord = field(default_factory=lambda: AttemptRecord(0, []))
    attempts: list[AttemptRecord] = field(default_factory=list)
    max_restarts: int = 0
    checkpoint_dir: Path | None = None  # where `ddpnb.save_checkpoint` writes this run's checkpoints
    resumed_from: Path | None = None  # the checkpoints of the run this one continues (--resume)
    data: DataSent | None = None  # notebook data sent out of the pickle (shared memory, Ray's object store)
    # how the launch went, said in every view's header: a CPU fallback, the checkpoint it resumes, the data it wrote
    launch_note: str = ""
    view_errors: list[str] = field(default_factory=list)  # bugs of ddpnb's own in drawing a view

    # the current attempt's, read where they are written (`current`): a record held across a restart reads the new
    # attempt's, and an attempt's own record keeps its ranks as they ended
    @property
    def attempt(self) -> int:
        return self.current.number

    @property
    def ranks(self) -> list[RankRecord]:
        return self.current.ranks

    @property
    def failures(self) -> list[Failure]:
        return self.current.failures

    @property
    def stall(self) -> Stall | None:
        """The latest stall of the current attempt, ongoing or resumed (`stalled`)."""
        return self.current.stall

    @property
    def at_timeout(self) -> Diagnosis | None:
        """Where every rank was when the timeout stopped the run."""
        return self.current.at_timeout

    @property
    def queued(self) -> Queued | None:
        """The current attempt's wait for its engine's resources, ongoing or over."""
        return self.current.queued

    @property
    def profile(self) -> Profile | None:
        """--profile: the latest attempt's merged trace and breakdown (`core.profile`)."""
        return next((a.profile for a in reversed([*self.attempts, self.current]) if a.profile is not None), None)

    @property
    def hint(self) -> str:
        """How to make the next launch faster (`ddpnb.preload`), said once per kernel."""
        return next((a.hint for a in reversed([*self.attempts, self.current]) if a.hint), "")

    @property
    def internal_errors(self) -> list[str]:
        """Bugs of ddpnb's own (reading the ranks, drawing a view), each what it was doing and the traceback."""
        return [*self.view_errors, *(e for a in [*self.attempts, self.current] for e in a.internal_errors)]

    def __repr__(self) -> str:
        first = self.first_failure
        bugs = len(self.internal_errors)
        said = f", {bugs} ddpnb error{'s' if bugs > 1 else ''} in .internal_errors" if bugs else ""
        return (
            f"<RunRecord {self.function or 'run'} on {self.engine}: {self.outcome.value}"
            f"{f', rank {first.rank} failed first' if first else ''}, {ranks_text(self.world_size)} "
            f"({self.backend}), attempt {self.attempt}, {self.duration:.1f} s, {self.run_dir}{said}>"
        )

    def _repr_html_(self) -> str:
        """In a notebook: the one line, and a row per rank (where it ran, its state and exit); the rest is in the
        fields."""
        return _record_html(repr(self), self.ranks)

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
        """The root cause of the last attempt's failure (see `core.failures.root_cause`); earlier attempts' are in `attempts`."""
        return root_cause(self.failures, self.outcome.ended_by_ddpnb)

    def failure_role(self, rank: int) -> FailureRole | None:
        """How `rank` failed in the current attempt; None where it did not fail."""
        failure = next((f for f in self.failures if f.rank == rank), None)
        return None if failure is None else role(failure, self.first_failure)

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
            records = records[attempt : attempt + 1]
        return [point for record in records for point in record.metrics.get(name, [])]

    def metrics_frame(self) -> Any:
        """Every point `ddpnb.log` sent, from every rank and attempt, as a pandas DataFrame in long format: one row
        per point, columns `rank`, `attempt`, `step` (nullable Int64: None where logged without a step), `time`
        (seconds since the run started), `name` and `value`. Needs pandas (`pip install pandas`); e.g.
        `frame.pivot_table(index="step", columns="rank", values="value")` for one name per rank."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError(
                "RunRecord.metrics_frame needs pandas, which ddpnb does not install: "
                "pip install pandas (record.metrics(name, rank) gives one series without it)"
            ) from None
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
        return pd.DataFrame(
            {
                "rank": pd.Series(columns["rank"], dtype="int64"),
                "attempt": pd.Series(columns["attempt"], dtype="int64"),
                "step": pd.Series(columns["step"], dtype="Int64"),
                "time": pd.Series(columns["time"], dtype="float64"),
                "name": pd.Series(columns["name"], dtype="object"),
                "value": pd.Series(columns["value"], dtype="float64"),
            }
        )


def bug_text(doing: str, exc: BaseException) -> str:
    """A bug of ddpnb's own, as a record keeps it: what it was `doing` ("reading rank 1's step times") and its
    traceback."""
    return f"{doing}:\n{''.join(traceback.format_exception(exc)).rstrip()}"


def _record_html(line: str, ranks: list[RankRecord]) -> str:
    """A record's one line, then a short row per rank: a notebook's display of a run or an attempt."""
    rows = "".join(
        f"<tr><td>{r.rank}</td><td>{escape(r.node or '')}</td><td>{r.state.value}</td>"
        f"<td>{'' if r.exitcode is None else r.exitcode}</td><td>{r.lines}</td></tr>"
        for r in ranks
    )
    return (
        f"<div class='ddpnb-record'><code>{escape(line)}</code><table><thead><tr><th>rank</th><th>node</th>"
        f"<th>state</th><th>exit</th><th>lines</th></tr></thead><tbody>{rows}</tbody></table></div>"
    )
