"""`Lifecycle`: a run's one loop, in its reader thread, and the one writer of its record.

It starts the first attempt, serves each until its ranks are gone, asks the restart policy (`core.policy`) what
next, and acts on it: the next attempt on a fresh engine (or on the engine that restarted its ranks itself), or
the run's end. Each attempt writes its own record (`core.attempt`); the lifecycle files it in the run's.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ddpnb.core import live, rundir
from ddpnb.core.announce import Announcer
from ddpnb.core.attempt import Attempt, CurrentAttempt, StopRequest
from ddpnb.core.channel import CommandChannel
from ddpnb.core.engine import Engine
from ddpnb.core.journal.tee import JournalTee
from ddpnb.core.output import LineBuffer
from ddpnb.core.policy import Decision
from ddpnb.core.ranklogs import log_paths
from ddpnb.core.record import AttemptRecord, Outcome, RankRecord, RunRecord, bug_text
from ddpnb.core.report import RunInterrupted
from ddpnb.core.spec import WorkerSpec
from ddpnb.core.watchdog import Watchdog

if TYPE_CHECKING:
    from ddpnb.core.live import LiveRun
    from ddpnb.core.run import RunSetup


class Lifecycle:
    """One run's attempts in turn, its record, and what every attempt shares: the output lines, the announcer,
    the stop asked for, the command channel and the notebook data."""

    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        self._handle: LiveRun | None = None  # the user's, listed as live from `start` until the end
        spec = setup.spec
        self.record = RunRecord(
            run_dir=Path(spec.run_dir),
            world_size=spec.world_size,
            backend=spec.backend,
            engine=setup.engine,
            function=setup.function,
            max_restarts=setup.policy.max_restarts,
            checkpoint_dir=Path(spec.checkpoint_dir) if spec.checkpoint_dir else None,
            resumed_from=Path(spec.resume_dir) if spec.resume_dir else None,
        )
        self.shared = setup.shipment
        self.channel = CommandChannel() if setup.commands else None
        self.lines = LineBuffer()
        self.announcer = Announcer(setup.capabilities.announce_every)
        self.stop_request = StopRequest()  # what `Run.stop()` asked for, read by the attempt in the reader thread
        self.done = threading.Event()
        self.locks: list[int] = []  # the run directory's, and those on directories it reads (`Run.hold`)
        self.attempt = self._new_attempt(0, spec)
        self.record.current = self.attempt.record
        relay = CurrentAttempt(self.attempt, self._restarted)
        # a journaled run's engine tells the journal, which tells the attempt (`core.journal`)
        self.journal = (
            JournalTee(relay, self.record, setup.devices, setup.capabilities, self._journal_broken)
            if setup.journal
            else None
        )
        self._relay: CurrentAttempt | JournalTee | None = self.journal or relay

    def start(self, handle: LiveRun) -> None:
        """Start every rank of the first attempt, then the reader thread; on any failure nothing is left running
        and the empty run directory is removed."""
        self._handle = handle
        run_dir = Path(self.setup.spec.run_dir)
        # the directory's lock says "live" to retention in every kernel, for every engine, until the run ends
        self.locks.insert(0, rundir.lock(run_dir))
        try:
            self.record.started = time.time()
            self.attempt.start(
                self.setup.new_engine,
                self._relay,
                self.shared,  # type: ignore[arg-type]
                self._restarts_left(),
            )
            self.record.started = self.attempt.record.started
            live.add(handle)
            rundir.prune()  # only now: a launch refused before its ranks started deletes no earlier run's logs
            threading.Thread(target=self._serve, name=f"ddpnb-{self.record.engine}-run", daemon=True).start()
        except BaseException as exc:
            self.attempt.abandon()
            self._release()
            if self.journal is not None:
                self.journal.discard()
            rundir.remove_if_empty(run_dir)
            if isinstance(exc, KeyboardInterrupt):  # the ranks that had started are gone: say so, not where
                self.record.outcome, self.record.ended = Outcome.INTERRUPTED, time.time()
                raise RunInterrupted(self.record, starting=True) from None
            raise

    def _journal_broken(self, words: str) -> None:
        """The journal could not be written (a full disk): every view's header says so; the run goes on."""
        self.record.add_launch_note(words)
        self.announcer.mark(turn=True)

    def view_failed(self, view: str, exc: Exception) -> None:
        """Keep a view's bug (ddpnb's own) in the record."""
        self.record.view_errors.append(bug_text(f"drawing the {view}", exc))

    def _serve(self) -> None:
        """Serve each attempt until it ends; the policy decides whether another follows; then conclude."""
        try:
            while True:
                self._serve_attempt()
                if self.setup.policy.decide(self.attempt.snapshot()) is Decision.END or not self._next_attempt():
                    return
        finally:  # whatever failed above (a full disk), release everything and let `wait()` return
            self.attempt.release_waiters()
            self._release()
            self._conclude()

    def _serve_attempt(self) -> None:
        """Serve the attempt until its ranks have ended, then end it. An error of ddpnb's own in either (a bug)
        ends the attempt failed, saying so, its traceback in the record; `end` closes the engine: no rank is left."""
        try:
            self.attempt.engine.serve()
        except Exception as exc:  # noqa: BLE001 - said in the run's outcome, not only on the kernel's stderr
            self.attempt.failed_inside(exc)
        finally:
            try:
                self.attempt.end()
            except Exception as exc:  # noqa: BLE001 - likewise
                self.attempt.failed_inside(exc)

    def _next_attempt(self, engine: Engine | None = None) -> bool:
        """File the attempt that ended in the record and begin the next, on a fresh engine (or on `engine`, which
        restarted the ranks itself). False where it could not start: the run ends, failed, saying why."""
        ended = self.attempt
        ended.result.close()  # what its rank 0 sent is not the run's result now
        learned = ended.learned(self.lines.count)
        self.attempt = self._new_attempt(ended.number + 1, replace(ended.spec, attempt=ended.number + 1))
        self.record.attempts.append(learned)
        self.record.current = self.attempt.record
        assert self._relay is not None  # released only when the run ends
        self._relay.retarget(self.attempt)
        try:
            if engine is not None:
                self.attempt.adopt(engine)
            else:
                self.attempt.start(
                    self.setup.new_engine,
                    self._relay,
                    self.shared,  # type: ignore[arg-type]
                    self._restarts_left(),
                )
        except Exception as exc:  # noqa: BLE001 - the run ends, failed, saying why the restart could not start
            self.attempt.abandon(f"attempt {self.attempt.number} could not start: {type(exc).__name__}: {exc}")
            return False
        self.announcer.now()  # the views show the new attempt at once
        return True

    def _restarted(self) -> None:
        """RunEvents, from an engine that restarted every rank itself (Ray Train's FailureConfig), after the ranks
        of the attempt that failed have `exited`: the policy decides, as for any attempt."""
        if self.setup.policy.decide(self.attempt.snapshot()) is Decision.END:
            self.attempt.refuse_restart()
            return
        self.attempt.end(close_engine=False)
        self._next_attempt(engine=self.attempt.engine)

    def _new_attempt(self, number: int, spec: WorkerSpec) -> Attempt:
        """The attempt `number`, with a record of its own (filed in the run's as `record.current`)."""
        numbered = self.setup.policy.max_restarts > 0  # each attempt's logs and traces under their own names
        paths = log_paths(Path(spec.run_dir), spec.world_size, number, numbered)
        record = AttemptRecord(
            number,
            [RankRecord(rank=r, device=self.setup.devices[r], log_path=paths[r]) for r in range(spec.world_size)],
        )
        channel = self.channel
        watchdog = Watchdog(
            spec.world_size,
            spec.timeout,
            self.setup.stall,
            paused=channel.idle if channel is not None else lambda: False,
        )
        return Attempt(
            spec,
            self.setup.capabilities,
            record,
            self.lines,
            watchdog,
            self.announcer,
            channel,
            self.stop_request,
            numbered,
        )

    def _restarts_left(self) -> int:
        return self.setup.policy.restarts_left(self.attempt.number, self.stop_request.asked is not None)

    def _release(self) -> None:
        for fd in self.locks:
            os.close(fd)
        self.locks = []
        self.shared = None  # no restart comes now: the notebook data the ranks were given may go
        self._relay = None  # it holds `_restarted`: the run goes with the caller's last reference, not at a gc
        if self._handle is not None:  # the handle goes with the caller's last reference, not at a gc
            live.discard(self._handle)
            self._handle = None

    def _conclude(self) -> None:
        """The run's outcome: its last attempt's; then `wait()` returns."""
        record = self.record
        learned = self.attempt.learned(self.lines.count)
        record.ended = time.time()
        record.outcome, record.note = learned.outcome, learned.note or record.note
        if self.journal is not None:
            self.journal.concluded()
        self.attempt.result.settle(record.outcome is Outcome.SUCCEEDED)
        self.done.set()
        self.announcer.now()
