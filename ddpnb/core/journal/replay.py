"""A viewer's side of the journal: the owner's attempts played again from it, into a record equal to the owner's.

The journal's events drive the same `Attempt` code the owner ran (`ReplayAttempt`), as an engine drives it, with
the owner's clock reads for its times; what the owner decided (a stop asked for, the timeout, stalls, the radar's
verdicts, each attempt's outcome, restarts) is applied from the journal, never decided again: a viewer stops
nothing, raises no stall and restarts nothing. Nothing is written: the owner writes the rank logs and traces.
`replay(path)` reads a whole journal; `Replay.follow` reads one still being written, then follows it live.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ddpnb.core import messages as msg
from ddpnb.core.announce import Announcer
from ddpnb.core.attempt import Attempt, AttemptState, StopRequest
from ddpnb.core.engine import Capabilities
from ddpnb.core.journal import JOURNAL_FILE, entries
from ddpnb.core.journal.entries import MESSAGE, OUTPUT, Entry
from ddpnb.core.journal.frames import Follower, JournalError, Reader, Torn
from ddpnb.core.output import KEEP_LINES, LineBuffer
from ddpnb.core.ranklogs import log_paths
from ddpnb.core.record import AttemptRecord, Outcome, OutputLine, RankRecord, RunRecord
from ddpnb.core.spec import WorkerSpec
from ddpnb.core.watchdog import Watchdog

FOLLOW_EVERY = 0.01  # seconds between two looks at a live journal that had nothing new (a read: cheap)


class JournalEngine:
    """The engine of a replayed attempt: its ranks are the journal's, so there is nothing to start, stop or ask."""

    def start(self, events: Any, start: Any) -> None:
        raise NotImplementedError("a replayed attempt starts nothing")

    def serve(self) -> None:
        pass

    def stop(self, ranks: list[int], failed: bool) -> float | None:
        return None  # the owner stops its ranks; the journal says so

    def escalate(self) -> float | None:
        return None

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        return {}

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        raise RuntimeError("a replayed run takes no commands here: they go to the run's owner")

    def interrupt(self, ranks: list[int]) -> None:
        raise RuntimeError("a replayed run takes no commands here: they go to the run's owner")

    def close(self) -> None:
        pass


def _skip(attempt: Attempt, rank: int, message: Any) -> None:
    """A profile's trace: the owner wrote it, and the journal holds the merged profile."""


class ReplayAttempt(Attempt):
    """An attempt as a viewer plays it: the owner's code for what its ranks said, none of the owner's decisions."""

    _HANDLERS: ClassVar[dict[type, Callable[[Attempt, int, Any], None]]] = {**Attempt._HANDLERS, msg.Profiled: _skip}

    def begin(self, started: float) -> None:
        self.engine = self.broker.engine = JournalEngine()
        self.record.started = started
        ranks = self.record.ranks
        paths = [rank.log_path for rank in ranks]
        for rank in ranks:  # the owner writes the rank logs: the viewer's go nowhere
            rank.log_path = Path(os.devnull)
        try:
            self._open()
        finally:
            for rank, path in zip(ranks, paths):
                rank.log_path = path
        self._running()

    def _judge_stragglers(self, at_once: bool = False) -> None:
        """The owner's verdicts come from the journal (`Entry.STRAGGLERS`)."""

    def _merge_profile(self) -> None:
        """The owner's merged profile comes from the journal (its attempt's end)."""


class Replay:
    """A journal played into a record (`record`), the output lines (`lines_since`) and announcements (`watch`), as
    the owner's run had them. `torn`: where the journal stopped short, if it did."""

    def __init__(self, keep_lines: int = KEEP_LINES) -> None:
        self.record: RunRecord = None  # type: ignore[assignment]  # from the journal's first record on
        self.attempt: ReplayAttempt = None  # type: ignore[assignment]
        self.lines = LineBuffer(keep_lines)
        self.announcer = Announcer(Capabilities().announce_every)
        self.torn: Torn | None = None
        # `follow` has played the journal to its end as it was (its first attempt begun), or stopped: what an
        # attaching viewer waits for, so that its handle's record holds the history, never half of its first record
        self.caught_up = threading.Event()
        self._done = threading.Event()
        self._stop_request = StopRequest()  # set from the journal only, to stop as the owner did
        self._devices: list[str] = []
        self._reads: list[float] = []
        self._now = 0.0

    # --- reading ------------------------------------------------------------------------------------------------
    @classmethod
    def read(cls, path: Path | str, keep_lines: int = KEEP_LINES) -> Replay:
        """Every whole record of the journal at `path` (a run directory, or its journal file) played."""
        path = journal_path(path)
        reader = Reader(path)
        entries.check(reader.header, path)
        replay = cls(keep_lines)
        replay.apply(reader.records())
        replay.torn = reader.torn
        return replay

    def follow(
        self,
        path: Path | str,
        stop: threading.Event | None = None,
        read: Callable[[int, int], bytes | None] | None = None,
    ) -> None:
        """Play the journal at `path` from its first record, then as it grows, until the run's end is played, the
        journal is found torn, or `stop` is set. Views wait in `watch` meanwhile. `read`: the journal's bytes from
        an offset (at most so many), where it is not a file here (a run served by its supervisor's engine)."""
        follower = Follower(journal_path(path), read)
        stop = stop or threading.Event()
        checked = False
        try:
            while not self._done.is_set() and not stop.is_set():
                records = follower.poll()
                if follower.header is not None and not checked:
                    entries.check(follower.header, follower.path)
                    checked = True
                self.apply(records)
                self.announcer.maybe()
                if follower.torn is not None:
                    self.torn = follower.torn
                    return
                if self.record is not None and (not records or follower.drained):
                    self.caught_up.set()
                if not records:
                    stop.wait(FOLLOW_EVERY)
        finally:
            follower.close()
            self.caught_up.set()
            self.announcer.now()

    def apply(self, payloads: list[bytes]) -> None:
        """Play `payloads`, records of the journal in order."""
        hot, decode, handlers = entries.hot, msg.decode, self._HANDLERS
        for payload in payloads:
            tag = payload[0]
            if tag == MESSAGE:
                rank, _, self._reads, start = hot(payload)
                self.attempt.message(rank, decode(memoryview(payload)[start:]))
            elif tag == OUTPUT:
                rank, stream, self._reads, start = hot(payload)
                self.attempt.output(rank, stream, payload[start:])
            else:
                kind, fields = entries.decode_other(payload)
                handlers[kind](self, *fields)

    # --- what views read ------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def watch(self, seen: int, timeout: float) -> int:
        return self.announcer.watch(seen, timeout, self._done.is_set)

    def lines_since(self, seen: int) -> tuple[list[OutputLine], int, int]:
        return self.lines.since(seen)

    # --- the journal's records --------------------------------------------------------------------------------
    def _clock(self) -> float:
        """The attempt's clock: the owner's reads in the order it made them (its last one, past them)."""
        if self._reads:
            self._now = self._reads.pop(0)
        return self._now

    def _run(
        self, fields: dict[str, Any], devices: list[str], spec: WorkerSpec, started: float, announce_every: float
    ) -> None:
        self.record = RunRecord(**fields)
        self.record.started = started
        self._devices = devices
        self.announcer.every = announce_every
        self._new_attempt(0, spec, started)

    def _new_attempt(self, number: int, spec: WorkerSpec, started: float) -> None:
        """As `Lifecycle._new_attempt` makes one (its own record, filed as the run's `current`), and as
        `Attempt.start` opens it; its engine is the journal."""
        numbered = self.record.max_restarts > 0
        paths = log_paths(Path(spec.run_dir), spec.world_size, number, numbered)
        own = AttemptRecord(
            number, [RankRecord(rank=r, device=self._devices[r], log_path=paths[r]) for r in range(spec.world_size)]
        )
        watchdog = Watchdog(spec.world_size, timeout=None, stall=0)  # it never alarms: the journal says what did
        self.attempt = ReplayAttempt(
            spec, Capabilities(), own, self.lines, watchdog, self.announcer, None, self._stop_request, numbered
        )
        self.attempt.clock = self._clock
        self.attempt.begin(started)
        self.record.current = own

    def _placed(self, rank: int, pid: int | None, node: str, reads: list[float]) -> None:
        self._reads = reads
        self.attempt.placed(rank, pid, node)

    def _exited(
        self, rank: int, exitcode: int | None, stopped: bool, cause: str, traceback: str, reads: list[float]
    ) -> None:
        self._reads = reads
        self.attempt.exited(rank, exitcode, stopped=stopped, cause=cause, traceback=traceback)

    def _queued(self, what: str, state: str, reads: list[float]) -> None:
        self._reads = reads
        self.attempt.queued(what, state)

    def _notes(self, started: float, attempt_started: float, launch_note: str, data: Any) -> None:
        record = self.record
        record.started, self.attempt.record.started, record.launch_note, record.data = (
            started,
            attempt_started,
            launch_note,
            data,
        )
        self.announcer.mark()

    def _stop(self, outcome: Outcome, note: str, reads: list[float]) -> None:
        """The owner began stopping every rank at a tick (a stop asked for, the timeout): the attempt does the
        same, through the same request a stop() makes, unless its ranks' own records began it already."""
        if self.attempt.state is not AttemptState.RUNNING:
            return
        self._reads = reads
        self._stop_request.asked = (outcome, note)
        try:
            self.attempt.tick()
        finally:
            self._stop_request.asked = None

    def _at_timeout(self, diagnosis: Any, kept: dict[int, tuple[str, Any]]) -> None:
        own = self.attempt.record
        own.at_timeout = diagnosis
        for rank, (stack, state) in kept.items():
            own.ranks[rank].stack, own.ranks[rank].stalled_state = stack, state

    def _stall(self, stall: Any) -> None:
        self.attempt.record.stall = stall
        self.announcer.mark(turn=True)

    def _stragglers(self, held: tuple[float | None, ...]) -> None:
        for rank, holds in zip(self.attempt.record.ranks, held):
            rank.holds_others = holds

    def _errors(self, errors: list[str]) -> None:
        # the owner's attempt's, which this attempt's own reading reproduced, and more
        self.attempt.record.internal_errors = errors

    def _end_attempt(
        self, reads: list[float], ending: tuple[Any, ...], account: tuple[Any, ...], abandoned: bool = False
    ) -> AttemptRecord:
        """The attempt's end as the owner's, then its record as the owner's `learned` filed it."""
        self._reads = reads
        _, outcome, note, started, ended, last_line = account
        attempt = self.attempt
        if abandoned:
            attempt.abandon(note)
        else:
            attempt.end()
        profile, held, errors, (launch_note, data) = ending
        self.record.launch_note, self.record.data = launch_note, data
        own = attempt.learned(last_line)
        own.profile, own.internal_errors = profile, errors
        own.outcome, own.note, own.started, own.ended = outcome, note, started, ended  # decided by the owner
        self._stragglers(held)
        return own

    def _next(
        self,
        reads: list[float],
        ending: tuple[Any, ...],
        account: tuple[Any, ...],
        begins: tuple[int, WorkerSpec, float],
    ) -> None:
        """As `Lifecycle._next_attempt`, with the owner's account of the attempt that ended."""
        learned = self._end_attempt(reads, ending, account)
        self.attempt.result.close()
        self.record.attempts.append(learned)
        self._new_attempt(*begins)
        self.announcer.now()

    def _end(self, reads: list[float], ending: tuple[Any, ...], account: tuple[Any, ...], end: tuple[Any, ...]) -> None:
        """As `Lifecycle._conclude`, with the owner's outcome."""
        abandoned, outcome, note, started, ended = end
        self._end_attempt(reads, ending, account, abandoned)
        record = self.record
        record.outcome, record.note, record.started, record.ended = outcome, note, started, ended
        self.attempt.result.settle(outcome is Outcome.SUCCEEDED)
        self._done.set()
        self.announcer.now()

    _HANDLERS: ClassVar[dict[Entry, Callable[..., None]]] = {
        Entry.RUN: _run,
        Entry.PLACED: _placed,
        Entry.EXITED: _exited,
        Entry.QUEUED: _queued,
        Entry.NOTES: _notes,
        Entry.STOP: _stop,
        Entry.AT_TIMEOUT: _at_timeout,
        Entry.STALL: _stall,
        Entry.STRAGGLERS: _stragglers,
        Entry.ERRORS: _errors,
        Entry.NEXT: _next,
        Entry.END: _end,
    }


def journal_path(path: Path | str) -> Path:
    """The journal of the run directory `path`, or `path` itself where it is a journal file."""
    path = Path(path).expanduser()
    return path / JOURNAL_FILE if path.is_dir() else path


def replay(path: Path | str) -> RunRecord:
    """The record of the run whose journal is at `path` (its run directory, or the journal file), as its owner had
    it when the journal's last whole record was written. Raises JournalError where there is no journal, or one
    this ddpnb cannot read."""
    replayed = Replay.read(path)
    if replayed.record is None:
        raise JournalError(f"{journal_path(path)} holds no record of a run yet")
    return replayed.record
