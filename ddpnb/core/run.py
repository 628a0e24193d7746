"""`Run`: the user's handle on one run (wait, result, stop, stacks, subscribe, record), the same for every engine.

A run is a sequence of attempts (`core.attempt`), each every rank started once on a fresh engine; its lifecycle
(`core.lifecycle`, the one loop, in the reader thread) serves each, asks the restart policy (`core.policy`) what
next and files each attempt's record in the run's. The handle, the record, the output lines and the views span
all attempts; what is one attempt's (rank records, failures, logs, the stop, rank 0's result) starts afresh.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ddpnb.core import hints
from ddpnb.core import messages as msg
from ddpnb.core.announce import Subscribers
from ddpnb.core.attempt import Attempt
from ddpnb.core.cellnames import cell_names
from ddpnb.core.channel import CommandChannel
from ddpnb.core.data import Shipment
from ddpnb.core.engine import Capabilities, Engine
from ddpnb.core.lifecycle import Lifecycle
from ddpnb.core.policy import RestartPolicy
from ddpnb.core.record import Outcome, OutputLine, RunRecord
from ddpnb.core.report import RunInterrupted, WorkerError, diagnosis_summary
from ddpnb.core.spec import WorkerSpec, is_seconds
from ddpnb.core.words import format_duration, ranks_text

STACKS_WAIT = 10.0  # seconds `Run.stacks()` waits for every rank's stack
TICK = 1.0  # seconds between two redraws of a view when nothing changed (its clocks move on)


class FrontEnd(Protocol):
    """The front end a run was started from, as the run asks it (`views.frontend`): its input box answers the
    ranks' debugger prompts, it says a view's failure, and it shows the run where its handle is displayed."""

    def answer_prompts(self, run: Run) -> None: ...

    def debug(self, run: Run, rank: int) -> None: ...

    def view_failed(self, view: str, exc: Exception) -> None: ...

    def show(self, run: Run) -> None: ...


@dataclass
class RunSetup:
    """What a run is made of, checked and planned by the API."""

    spec: WorkerSpec
    devices: list[str]  # each rank's device, as planned
    engine: str  # the engine's name
    capabilities: Capabilities
    new_engine: Callable[[WorkerSpec], Engine]  # a fresh engine for each attempt, given the attempt's spec
    front_end: FrontEnd
    function: str = ""
    policy: RestartPolicy = field(default_factory=lambda: RestartPolicy(0))
    shipment: Shipment | None = None  # the notebook data the ranks map; the caller commits it after `start`
    stall: float | None = None  # --stall: None adapts to the run, 0 never (`core.stall`)
    commands: bool = False  # a session: the ranks take commands over the engine's channel
    journal: bool = False  # write the run's journal into its directory (`core.journal`: replay, attach)


class Run:
    """The user's handle on one run, across its attempts: `wait()`, `result()`, `stop()`, `stacks()`, `record`
    and the views' subscriptions."""

    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        self._life = Lifecycle(setup)
        self.record: RunRecord = self._life.record  # written by the lifecycle and the attempts alone
        self.channel: CommandChannel | None = self._life.channel
        self._done = self._life.done
        self._views = Subscribers()  # fed by `wait()`
        # set by a foreground dashboard once its summary (the rank table, the logs' place) is above the cell's error
        self.summary_above = False

    def start(self) -> Run:
        """Start every rank through the engine; on any failure nothing is left running and the empty run
        directory is removed."""
        self._life.start(self)
        return self

    def hold(self, lock: int | None) -> None:
        """Keep a lock (`rundir.lock`) on a directory the run reads, such as the run it resumes, until it ends."""
        if lock is not None:
            self._life.locks.append(lock)

    @property
    def attempt(self) -> Attempt:
        """The attempt going on (or the last)."""
        return self._life.attempt

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def outcome(self) -> Outcome:
        return self.record.outcome

    @property
    def status(self) -> str:
        """One line: the outcome so far, the time, and each rank's state."""
        record = self.record
        ranks = ", ".join(f"{r.rank}: {r.state.value}" for r in record.ranks)
        stalled = f", stalled: {diagnosis_summary(record.stall.diagnosis)}" if record.stall and record.stalled else ""
        return f"{record.outcome.value} after {format_duration(record.duration)} (ranks {ranks}){stalled}"

    @property
    def spec(self) -> WorkerSpec:
        """What the current attempt's ranks were given (its pickled function in `fn_payload`)."""
        return self.attempt.spec

    @property
    def timeout(self) -> float | None:
        """Seconds each attempt may run (--timeout); set it while the run goes to bound this attempt and the next."""
        return self.attempt.watchdog.timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self.attempt.watchdog.timeout = seconds
        self.attempt.spec = replace(self.attempt.spec, timeout=seconds)  # the next attempt's spec derives from it

    @property
    def nodes(self) -> dict[int, str]:
        """Each rank's node, once placed, where the engine places ranks on a cluster's nodes."""
        return {r.rank: r.node for r in self.record.ranks if r.node}

    def __repr__(self) -> str:
        record = self.record  # read when shown, so a handle displayed again later says how the run is now
        return (
            f"<ddpnb run of {record.function or 'a function'} on {ranks_text(record.world_size)} "
            f"({record.backend}): {self.status}; .wait() .result() .stop()>"
        )

    def _ipython_display_(self) -> None:
        """The handle displayed in a cell, a later one too: the front end's view of the run (its live dashboard
        again while it goes on, where the launch drew one)."""
        self.setup.front_end.show(self)

    def wait(self, timeout: float | None = None) -> RunRecord:
        """Block until every rank has ended (or `timeout` passes); Ctrl-C stops the run and re-raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = 0
        try:
            while not self._done.is_set():
                self.answer_prompts()
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._views and not self.attempt.spec.prompts:  # no view to feed, no prompt to ask:
                    # sleep until the end (Ctrl-C still wakes this wait)
                    self._done.wait(left)
                else:  # feed the views whenever the reader has news
                    seen = self.watch(seen, TICK if left is None else min(TICK, left))
                    self.notify()
                if deadline is not None and time.monotonic() >= deadline:
                    break
        except KeyboardInterrupt:
            self.stop(Outcome.INTERRUPTED, "interrupted by the user (Ctrl-C / kernel interrupt)")
            raise RunInterrupted(self.record) from None
        finally:
            self.notify(ending=True)
        return self.record

    def answer_prompts(self) -> None:
        """Each rank's debugger prompt in turn, asked in the front end's input box (from the thread of the cell
        that waits for the run, or for a session's command: it holds the kernel's stdin)."""
        self.setup.front_end.answer_prompts(self)

    def debug(self, rank: int) -> None:
        """Answer `rank`'s debugger prompts (`breakpoint()`, `--debug`) in this cell's input box until it goes on
        (`c`) or quits (`q`): for a `--background` run, whose own cell has returned. Ctrl-C leaves it, with the
        rank still waiting."""
        self.setup.front_end.debug(self, rank)

    def answer(self, prompt: msg.Prompt, line: str) -> bool:
        """Send `line` to the rank waiting at `prompt`; False where that prompt no longer waits (answered first
        elsewhere)."""
        return self.attempt.broker.answer(prompt, line)

    def not_waiting(self, rank: int) -> str:
        """Why `rank`'s prompt took no answer (`answer` said False)."""
        return self.attempt.broker.not_waiting(rank)

    def watch(self, seen: int, timeout: float) -> int:
        """Wait until the reader announces news after announcement number `seen`, or `timeout` passes; return the
        latest announcement's number. Output is announced at most once an engine's `announce_every`, a rank starting,
        returning, failing or exiting at once, and the run's end: how views redraw without timers of their own."""
        return self._life.announcer.watch(seen, timeout, self._done.is_set)

    def lines_since(self, seen: int) -> tuple[list[OutputLine], int, int]:
        """The output lines after line number `seen` (the latest 2,000 are kept), how many after it are no longer
        kept, and the number of the latest line: how views read the run's output."""
        return self._life.lines.since(seen)

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value; raises `WorkerError` if the run did not succeed, and, as a future's `result`
        does, `TimeoutError` if it has not ended within `timeout` seconds (the run goes on)."""
        if timeout is not None and not is_seconds(timeout, zero=True):
            raise ValueError(f"timeout is a number of seconds to wait, 0 or more, not {timeout!r}.")
        self.wait(timeout)
        if not self._done.is_set():
            raise TimeoutError(
                f"the run has not ended within {timeout:g} s, and goes on: .result() again waits for "
                "it, .stop() ends it."
            )
        if self.record.outcome is not Outcome.SUCCEEDED:
            raise WorkerError(self.record, hint=hints.hint(self.record), summary_above=self.summary_above)
        return self.attempt.result.take()

    def join(self, timeout: float | None = None) -> bool:
        """Like mp.spawn's `ProcessContext.join`: True once every rank has ended, raises `WorkerError` on
        failure, False if `timeout` passed first."""
        self.wait(timeout)
        if not self.done:
            return False
        if self.record.outcome is not Outcome.SUCCEEDED:
            raise WorkerError(self.record, hint=hints.hint(self.record), summary_above=self.summary_above)
        return True

    def stop(self, outcome: Outcome = Outcome.STOPPED, note: str = "stopped by the user") -> None:
        """Stop every rank (gently, then by force after the engine's grace period) and wait until all are gone.
        No restart follows a stop."""
        if self._done.is_set():
            return
        self._life.stop_request.asked = (outcome, note)
        deadline = time.monotonic() + self.setup.capabilities.stop_wait
        while not self._done.is_set() and time.monotonic() < deadline:
            try:
                self._done.wait(0.1)
            except KeyboardInterrupt:  # a second interrupt while stopping: keep stopping, we are nearly done
                continue

    def subscribe(self, callback: Callable[[], None], *, news: bool = True) -> None:
        """Call `callback()` from the thread in `wait()` when the record changed and once a TICK anyway (views
        redraw from the record), and when `wait()` returns; with `news=False`, only when `wait()` returns (a view
        with a thread of its own, which must still be complete before a foreground cell ends)."""
        self._views.subscribe(callback, news)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        """No more calls to `callback`: a view that has drawn the end lets go of the run, and the run of it (a
        background run's `wait()`, which would let go of its views, may never come)."""
        self._views.unsubscribe(callback)

    def notify(self, ending: bool = False) -> None:
        """Feed the views the run's news now (`ending`: `wait()` returns); a view's bug, once per view, is kept
        in the record and said by the front end."""
        for view, exc in self._views.notify(ending, ended=self._done.is_set()):
            self._life.view_failed(view, exc)
            self.setup.front_end.view_failed(view, exc)

    def stacks(self, wait: float = STACKS_WAIT, ranks: Iterable[int] | None = None) -> dict[int, str]:
        """Every running rank's Python stack now, as a traceback reads: `{rank: text}`, the threads that run your
        code (on Ray Train: the training thread), oldest call first, notebook cells named `Cell In[N]`, with their
        source lines; `ranks`: only those (`run.stacks(ranks=[17])`). The run goes on; `{}` once it has ended."""
        asked = None if ranks is None else set(ranks)
        if asked is not None and not asked <= set(range(self.record.world_size)):
            raise ValueError(
                f"run.stacks(ranks=...): this run's ranks are 0 to {self.record.world_size - 1}; "
                f"got {sorted(asked - set(range(self.record.world_size)))}"
            )
        if self.done:
            return {}
        running = [rank for rank in self.attempt.running_ranks() if asked is None or rank in asked]
        if not running:
            return {}
        return {rank: cell_names(stack) for rank, stack in self.collect_stacks(running, wait).items()}

    def collect_stacks(self, ranks: list[int], wait: float) -> dict[int, str]:
        """Each of `ranks`' stacks now, from the user's code down (asked from any thread but the reader's)."""
        return self.attempt.broker.request_stacks(ranks, wait, self._done.is_set)
