"""What a run is and how it ended, as plain data; `WorkerError` is raised from it."""

from __future__ import annotations

import enum
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ddpnb.core.messages import Progress
from ddpnb.core.spec import EngineKind, Stream

KEEP_CLOSED_BARS = 4


class OutputLine(NamedTuple):
    """One line a rank printed, as the views get it (`Run.lines_since`)."""

    seq: int  # the run's count of lines so far, this one included
    rank: int
    stream: Stream
    text: str


class RankState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"  # ended by ddpnb because of another rank, a timeout, an interrupt or stop()


class Outcome(enum.Enum):
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
    log_path: Path | None = None
    node: str = ""  # Ray: the ID of the node the rank runs on
    stack: str = ""  # Python stacks dumped at a stall (timeout)
    stalled_state: RankState | None = None  # the rank's state when its stack was dumped
    metrics: dict[str, list[tuple[int | None, float, float]]] = field(default_factory=dict)
    progress: dict[int, Progress] = field(default_factory=dict)  # the rank's tqdm bars, oldest first
    gpu_memory: tuple[int, int] | None = None  # GPU runs: (reserved now, peak) in bytes

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


class FailureRole(enum.Enum):
    """How a failed rank's failure relates to the run's: what the views call it."""

    ROOT_CAUSE = "failed first"
    OWN = "failed"  # an error of its own, after the root cause (the same bug on another rank)
    KNOCK_ON = "stopped: peer failed"  # a collective's abort because another rank died (see `is_knock_on`)


def root_cause(failures: list[Failure]) -> Failure | None:
    """The earliest failure that is not a knock-on of another rank's (else the earliest)."""
    return min(failures, key=lambda f: (f.knock_on, f.time)) if failures else None


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
        return root_cause(self.failures)

    def describe(self) -> str:
        """'rank 1 failed first: killed by SIGKILL', or the outcome and why."""
        first = self.first_failure
        return f"rank {first.rank} failed first: {first.summary}" if first else f"{self.outcome.value}: {self.note}"


@dataclass(frozen=True)
class DataSent:
    """What a launch sent the ranks through shared memory (`core.shared`) rather than in a pickle."""

    written: int  # bytes written into memory files at this launch
    reused: int  # bytes earlier launches wrote that were unchanged, so not written again
    blocks: int  # tensor storages and arrays sent this way
    seconds: float  # spent writing them (and comparing arrays with what was written before)


@dataclass
class RunRecord:
    """Everything known about one run; `ddpnb.last_run()` and `Run.record` return it."""

    run_dir: Path
    world_size: int
    backend: str
    engine: EngineKind = EngineKind.LOCAL
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
    data: DataSent | None = None  # notebook data sent through shared memory (local engine)

    @property
    def first_failure(self) -> Failure | None:
        """The root cause of the last attempt's failure (see `root_cause`); earlier attempts' are in `attempts`."""
        return root_cause(self.failures)

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

    def metrics(self, name: str, rank: int = 0, attempt: int | None = None) -> list[tuple[int | None, float]]:
        """(step, value) pairs logged with `ddpnb.log(name=...)` on one rank: those of one attempt, or of every
        attempt in turn (after a restart the steps since the checkpoint it loaded come again)."""
        records = [*(a.ranks[rank] for a in self.attempts), self.ranks[rank]]
        if attempt is not None:
            records = records[attempt:attempt + 1]
        return [(step, value) for record in records for step, _, value in record.metrics.get(name, [])]

    def summary_table(self) -> str:
        rows = [f"{'rank':>4}  {'state':<9} {'exit':<22} {'time':>7}  last line"]
        for r in self.ranks:
            rows.append(
                f"{r.rank:>4}  {r.state.value:<9} {describe_exit(r.exitcode):<22} "
                f"{r.duration:>6.1f}s  {r.last_line[:60]}"
            )
        return "\n".join(rows)


def cell_names(traceback: str) -> str:
    """`File "/tmp/ipykernel_7/2718.py", line 5` as IPython names its own cells: `Cell In[7], line 5`."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    name_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if name_of is None:
        return traceback

    def cell(match: re.Match[str]) -> str:
        named = name_of(match.group(1))
        return f"{' '.join(named)}, line {match.group(2)}" if named else match.group(0)

    return re.sub(r'File "([^"]+)", line (\d+)', cell, traceback)


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
        else:
            parts.append(f"ddpnb: run {record.outcome.value}: {record.note}")
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
                         f"ddpnb: run interrupted after {record.duration:.1f} s; every rank was stopped")

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
