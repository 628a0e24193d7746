"""The owner's side of the journal: what its engine tells the attempt, and what only the owner decides.

`JournalTee` stands where the run's relay stands (`RunEvents`): each event goes on to the attempt, then into the
journal with the clock reads it caused (`Attempt.clock`). After each tick (the engine's loop wakes up) it writes
what the tick decided: a stop asked for or the timeout, a stall, the straggler radar's verdict, and what the launch
added to the record; at each attempt's end and the run's, how it ended. Records wait in memory and are written in
one batch on the reader thread every FLUSH_EVERY at most (`frames.Writer`): a rank never waits for the disk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpnb.core import messages as msg
from ddpnb.core.attempt import Attempt, AttemptState, CurrentAttempt
from ddpnb.core.journal import JOURNAL_FILE, entries
from ddpnb.core.journal.entries import Entry
from ddpnb.core.journal.frames import Writer
from ddpnb.core.record import AttemptRecord, RunRecord
from ddpnb.core.spec import Stream, WorkerSpec

if TYPE_CHECKING:
    from ddpnb.core.engine import Capabilities


def spec_for_views(spec: WorkerSpec) -> WorkerSpec:
    """The spec without what a viewer has no use for and must not read: the function, its arguments, the ranks'
    environment (tokens), the notebook's sources."""
    return replace(spec, fn_payload=b"", args=(), environ={}, sources={}, cell_names={})


class JournalTee:
    """RunEvents for a journaled run, in front of the run's relay (`CurrentAttempt`), with its `retarget` and
    `restarted`; the lifecycle calls `concluded` when the run has ended (or `discard` when it never started).
    `broken`: told once, in words, that the journal could not be written (the lifecycle puts it in the record)."""

    def __init__(
        self,
        relay: CurrentAttempt,
        record: RunRecord,
        devices: list[str],
        capabilities: Capabilities,
        broken: Callable[[str], None],
    ) -> None:
        self.relay = relay
        self.record = record
        self._broken = broken
        self._devices = devices
        self._announce_every = capabilities.announce_every
        self.writer = Writer(Path(record.run_dir) / JOURNAL_FILE, entries.header())
        self._reads: list[float] = []  # the attempt's clock reads since the last record that holds them
        self._begun = False
        self._said = False
        self._bind(relay.attempt)

    # --- RunEvents ------------------------------------------------------------------------------------------
    def placed(self, rank: int, pid: int | None, node: str = "") -> None:
        self._begin()
        reads = self._reads = []
        try:
            self._placed(rank, pid, node)
        finally:
            self._other(Entry.PLACED, rank, pid, node, reads)
            self._flush()  # rare (once a rank an attempt): a viewer waiting for the run to begin sees it at once

    def message(self, rank: int, message: msg.Message) -> None:
        self._begin()
        reads = self._reads = []
        try:
            self._message(rank, message)
        finally:
            if type(message) is msg.Profiled:  # its trace is in the run directory's profile folder
                message = replace(message, trace=b"")
            self.writer.append(entries.message(rank, reads, msg.encode(message)))

    def output(self, rank: int, stream: Stream, data: bytes) -> None:
        self._begin()
        reads = self._reads = []
        try:
            self._output(rank, stream, data)
        finally:
            self.writer.append(entries.output(rank, stream, reads, data))

    def exited(
        self, rank: int, exitcode: int | None, *, stopped: bool = False, cause: str = "", traceback: str = ""
    ) -> None:
        self._begin()
        reads = self._reads = []
        try:
            self._exited(rank, exitcode, stopped=stopped, cause=cause, traceback=traceback)
        finally:
            self._other(Entry.EXITED, rank, exitcode, stopped, cause, traceback, reads)

    def queued(self, what: str, state: str) -> None:
        self._begin()
        reads = self._reads = []
        try:
            self._queued(what, state)
        finally:
            self._other(Entry.QUEUED, what, state, reads)

    def tick(self) -> None:
        self._begin()
        attempt = self.relay.attempt
        before = attempt.state
        reads = self._reads = []
        self._ticked = True
        try:
            self._tick()
        finally:
            self._observe(attempt, before is AttemptState.RUNNING and attempt.state is AttemptState.STOPPING, reads)
            self._reads = []  # a read no record holds (a stall's end: its record holds it) is no later event's
            if self.writer.due():
                self._flush()

    def quiet(self) -> bool:
        return self._quiet()

    def restarted(self) -> None:
        self.relay.restarted()  # the run's policy decides; a next attempt comes through `retarget`

    # --- the run's boundaries -------------------------------------------------------------------------------
    def retarget(self, attempt: Attempt) -> None:
        """The attempt that ended is in the record's `attempts`; `attempt` begins (`Lifecycle._next_attempt`)."""
        self._begin()
        ended = self.record.attempts[-1]
        self._other(
            Entry.NEXT,
            self._reads,
            self._ending(ended),
            _account(ended),
            (attempt.number, spec_for_views(attempt.spec), attempt.record.started),
        )
        self._reads = []
        self.relay.retarget(attempt)
        self._bind(attempt)
        self._flush()

    def concluded(self) -> None:
        """The run has ended: its outcome is in the record. The journal's last record, then the file is closed."""
        self._begin()
        attempt, record = self.relay.attempt, self.record
        # an attempt whose start failed (`Attempt.abandon`) never served its ranks: no tick came from its engine
        abandoned = attempt.number > 0 and not self._ticked
        self._other(
            Entry.END,
            self._reads,
            self._ending(attempt.record),
            _account(attempt.record),
            (abandoned, record.outcome, record.note, record.started, record.ended),
        )
        self.writer.close()
        self._tell()

    def discard(self) -> None:
        """The run never started: no journal (its empty run directory is removed)."""
        self.writer.discard()

    # --- inside ---------------------------------------------------------------------------------------------
    def _bind(self, attempt: Attempt) -> None:
        relay = self.relay
        self._placed, self._message, self._output = relay.placed, relay.message, relay.output
        self._exited, self._queued, self._tick, self._quiet = relay.exited, relay.queued, relay.tick, relay.quiet
        attempt.clock = self._clock
        self._ticked = False
        record, own = self.record, attempt.record
        self._at_timeout = own.at_timeout
        self._stall = (own.stall, None, None)
        self._held = tuple(r.holds_others for r in own.ranks)
        self._notes = (record.started, own.started, record.launch_note, record.data)
        self._errors = len(own.internal_errors)

    def _clock(self) -> float:
        now = time.time()
        self._reads.append(now)
        return now

    def _begin(self) -> None:
        """The journal's first record, at the run's first event: the attempt has its start time by then."""
        if self._begun:
            return
        self._begun = True
        record, attempt = self.record, self.relay.attempt
        fields = {
            name: getattr(record, name)
            for name in (
                "run_dir",
                "world_size",
                "backend",
                "engine",
                "function",
                "max_restarts",
                "checkpoint_dir",
                "resumed_from",
            )
        }
        self._other(
            Entry.RUN,
            fields,
            list(self._devices),
            spec_for_views(attempt.spec),
            attempt.record.started,
            self._announce_every,
        )

    def _observe(self, attempt: Attempt, stopped: bool, reads: list[float]) -> None:
        """What the tick decided, in the order the attempt decides it."""
        record, own = self.record, attempt.record
        if own.at_timeout is not self._at_timeout:
            self._at_timeout = own.at_timeout
            kept = {r.rank: (r.stack, r.stalled_state) for r in own.ranks if r.stack or r.stalled_state}
            self._other(Entry.AT_TIMEOUT, own.at_timeout, kept)
        if stopped:
            self._other(Entry.STOP, *attempt.outcome(), reads)
        stall = own.stall
        seen, resumed, diagnosis = self._stall
        if stall is not seen or (stall is not None and (stall.resumed != resumed or stall.diagnosis is not diagnosis)):
            self._stall = (stall, None, None) if stall is None else (stall, stall.resumed, stall.diagnosis)
            self._other(Entry.STALL, stall)
        held = tuple(r.holds_others for r in own.ranks)
        if held != self._held:
            self._held = held
            self._other(Entry.STRAGGLERS, held)
        notes = (record.started, own.started, record.launch_note, record.data)
        if notes != self._notes:
            self._notes = notes
            self._other(Entry.NOTES, *notes)
        if len(own.internal_errors) != self._errors:
            self._errors = len(own.internal_errors)
            self._other(Entry.ERRORS, list(own.internal_errors))

    def _ending(self, ended: AttemptRecord) -> tuple[Any, ...]:
        """What an attempt's end decided besides its ranks' events: its profile, the last radar verdict, ddpnb's
        own errors and what the launch added to the run's record."""
        record = self.record
        return (
            ended.profile,
            tuple(r.holds_others for r in ended.ranks),
            list(ended.internal_errors),
            (record.launch_note, record.data),
        )

    def _other(self, kind: Entry, *fields: Any) -> None:
        self.writer.append(entries.other(kind, *fields))

    def _flush(self) -> None:
        self.writer.flush()
        self._tell()

    def _tell(self) -> None:
        """A journal that could not be written is told once (`broken`: the record says it); the run goes on."""
        if self.writer.failed is not None and not self._said:
            self._said = True
            self._broken(
                f"the run's journal stops at {self.writer.written} bytes: writing {self.writer.path} failed "
                f"({type(self.writer.failed).__name__}: {self.writer.failed}); the run goes on, its rank logs "
                "with it, but it cannot be attached to or replayed past that point"
            )


def _account(ended: AttemptRecord) -> tuple[Any, ...]:
    """How an attempt ended, as its owner's `learned` filed it."""
    return ended.number, ended.outcome, ended.note, ended.started, ended.ended, ended.last_line
