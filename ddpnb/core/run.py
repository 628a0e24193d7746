"""`Run`: the user's handle on one run (wait, result, stop, stacks, subscribe, record), the same for every engine.

A run is a sequence of attempts (`core.attempt`), each every rank started once on a fresh engine; the restart
policy (`core.policy`) decides from a snapshot of the attempt that ended whether another follows, and the run's
one loop (`_serve`, in the reader thread) acts on it. The handle, the record, the output lines and the views
span all attempts; what is one attempt's (rank records, failures, logs, the stop, rank 0's result) starts afresh.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ddpnb.core import hints, live, rundir
from ddpnb.core import messages as msg
from ddpnb.core.announce import Announcer
from ddpnb.core.attempt import Attempt, CurrentAttempt, StopRequest
from ddpnb.core.cellnames import cell_names, pdb_cell_names
from ddpnb.core.channel import CommandChannel
from ddpnb.core.data import Shipment
from ddpnb.core.engine import Capabilities, Engine
from ddpnb.core.journal.tee import JournalTee
from ddpnb.core.output import LineBuffer
from ddpnb.core.policy import Decision, RestartPolicy
from ddpnb.core.ranklogs import log_paths
from ddpnb.core.record import AttemptRecord
from ddpnb.core.record import Outcome, OutputLine, RankRecord, RunRecord
from ddpnb.core.report import RunInterrupted, WorkerError, diagnosis_summary, named
from ddpnb.core.spec import WorkerSpec, is_seconds
from ddpnb.core.watchdog import Watchdog
from ddpnb.core.words import format_duration, ranks_text

STACKS_WAIT = 10.0  # seconds `Run.stacks()` waits for every rank's stack
GOES_ON = frozenset({"c", "cont", "continue", "q", "quit", "exit"})  # pdb commands that leave its prompt
TICK = 1.0  # seconds between two redraws of a view when nothing changed (its clocks move on)


@dataclass
class RunSetup:
    """What a run is made of, checked and planned by the API."""

    spec: WorkerSpec
    devices: list[str]  # each rank's device, as planned
    engine: str  # the engine's name
    capabilities: Capabilities
    new_engine: Callable[[WorkerSpec], Engine]  # a fresh engine for each attempt, given the attempt's spec
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
        spec = setup.spec
        self.record = RunRecord(run_dir=Path(spec.run_dir), world_size=spec.world_size, backend=spec.backend,
                                engine=setup.engine, function=setup.function,
                                max_restarts=setup.policy.max_restarts,
                                checkpoint_dir=Path(spec.checkpoint_dir) if spec.checkpoint_dir else None,
                                resumed_from=Path(spec.resume_dir) if spec.resume_dir else None)
        self.shared = setup.shipment
        self.channel = CommandChannel() if setup.commands else None
        self._lines = LineBuffer()
        self._announcer = Announcer(setup.capabilities.announce_every)
        self._stop_request = StopRequest()  # what `stop()` asked for, read by the attempt in the reader thread
        self._done = threading.Event()
        self._locks: list[int] = []  # the run directory's, and those on directories it reads (`hold`)
        self._listeners: list[Callable[[], None]] = []  # fed by `wait()` with the reader's news
        self._enders: list[Callable[[], None]] = []  # called when `wait()` returns
        self._views_failed: set[str] = set()  # the views whose bug was said (`_view_failed`)
        # set by a foreground dashboard once its summary (the rank table, the logs' place) is above the cell's error
        self.summary_above = False
        self.attempt = self._new_attempt(0, spec)
        self._relay: CurrentAttempt | JournalTee | None = CurrentAttempt(self.attempt, self._restarted)
        self.journal = JournalTee(self._relay, self.record, setup.devices, setup.capabilities) \
            if setup.journal else None
        self._relay = self.journal or self._relay  # the engine tells the journal, which tells the attempt

    # --- public lifecycle -----------------------------------------------------------------------------------
    def start(self) -> Run:
        """Start every rank through the engine; on any failure nothing is left running and the empty run
        directory is removed."""
        run_dir = Path(self.setup.spec.run_dir)
        # the directory's lock says "live" to retention in every kernel, for every engine, until the run ends
        self._locks.insert(0, rundir.lock(run_dir))
        try:
            self.record.started = self.attempt.started = time.time()
            self.attempt.start(self.setup.new_engine, self._relay, self.shared,  # type: ignore[arg-type]
                               self._restarts_left())
            self.record.started = self.attempt.started
            live.add(self)
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
        return self

    def hold(self, lock: int | None) -> None:
        """Keep a lock (`rundir.lock`) on a directory the run reads, such as the run it resumes, until it ends."""
        if lock is not None:
            self._locks.append(lock)

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
        return (f"<ddpnb run of {record.function or 'a function'} on {ranks_text(record.world_size)} "
                f"({record.backend}): {self.status}; .wait() .result() .stop()>")

    def wait(self, timeout: float | None = None) -> RunRecord:
        """Block until every rank has ended (or `timeout` passes); Ctrl-C stops the run and re-raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = 0
        try:
            while not self._done.is_set():
                self.answer_prompts()
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._listeners and not self.attempt.spec.prompts:  # no view to feed, no prompt to ask:
                    # sleep until the end (Ctrl-C still wakes this wait)
                    self._done.wait(left)
                else:  # feed the views whenever the reader has news
                    seen = self.watch(seen, TICK if left is None else min(TICK, left))
                    self._notify()
                if deadline is not None and time.monotonic() >= deadline:
                    break
        except KeyboardInterrupt:
            self.stop(Outcome.INTERRUPTED, "interrupted by the user (Ctrl-C / kernel interrupt)")
            raise RunInterrupted(self.record) from None
        finally:
            self._notify(ending=True)
        return self.record

    def answer_prompts(self) -> None:
        """Each rank's debugger prompt in turn, asked in the front end's input box (from the thread of the cell
        that waits for the run, or for a session's command: it holds the kernel's stdin); a Ctrl-C there
        interrupts that wait as anywhere else in it."""
        while (prompt := self.attempt.next_prompt()) is not None:
            self._ask(prompt)

    def debug(self, rank: int) -> None:
        """Answer `rank`'s debugger prompts (`breakpoint()`, `--debug`) in this cell's input box until it goes on
        (`c`) or quits (`q`): for a `--background` run, whose own cell has returned. Ctrl-C leaves it, with the
        rank still waiting."""
        waiting = self.attempt.waiting.get(rank)
        if waiting is None:
            at = sorted(self.attempt.waiting)
            print(f"[ddpnb] rank {rank} is not at a debugger prompt"
                  + (f"; {named(at)} {'is' if len(at) == 1 else 'are'}: .debug({at[0]})" if at else "") + ".")
            return
        print(f"[ddpnb] rank {rank}'s debugger, until it goes on (c) or quits (q); Ctrl-C returns here with the "
              "rank still waiting", flush=True)
        seen = 0
        while not self.done:
            prompt = self.attempt.waiting.get(rank)
            if prompt is None:  # the rank is running its command: its next prompt, or its end
                seen = self.watch(seen, TICK)
                continue
            line, sent = self._ask(prompt)
            if not sent:
                return
            if line.strip().split(" ")[0] in GOES_ON:
                return

    def answer(self, prompt: msg.Prompt, line: str) -> bool:
        """Send `line` to the rank waiting at `prompt`; False where that prompt no longer waits (answered first
        elsewhere)."""
        return self.attempt.answer(prompt, line)

    def not_waiting(self, rank: int) -> str:
        """Why `rank`'s prompt took no answer (`answer` said False)."""
        return self.attempt.not_waiting(rank)

    def _ask(self, prompt: msg.Prompt) -> tuple[str, bool]:
        """The front end's line for `prompt`, and whether it was sent; where not (answered elsewhere meanwhile, or
        the run ended while the input box waited), says so."""
        self._notify()  # the rank's output up to its breakpoint first
        said, _, ask = prompt.text.rpartition("\n")
        if said:
            print(pdb_cell_names(said), flush=True)
        try:
            line = input(f"(rank {prompt.rank}) {ask}")
        except (EOFError, NotImplementedError):  # no more input, or this cell's front end takes none (IPython's
            # StdinNotImplementedError): the rank goes on
            print(f"[ddpnb] rank {prompt.rank}'s debugger prompt cannot be answered here: it continues.",
                  file=sys.stderr)
            line = "c"
        sent = self.attempt.answer(prompt, line)
        if not sent:
            print(f"[ddpnb] {line!r} was not sent: rank {prompt.rank} no longer waits at that prompt: "
                  f"{self.attempt.not_waiting(prompt.rank)}", flush=True)
        return line, sent

    def watch(self, seen: int, timeout: float) -> int:
        """Wait until the reader announces news after announcement number `seen`, or `timeout` passes; return the
        latest announcement's number. Output is announced at most once an engine's `announce_every`, a rank starting,
        returning, failing or exiting at once, and the run's end: how views redraw without timers of their own."""
        return self._announcer.watch(seen, timeout, self._done.is_set)

    def lines_since(self, seen: int) -> tuple[list[OutputLine], int, int]:
        """The output lines after line number `seen` (the latest 2,000 are kept), how many after it are no longer
        kept, and the number of the latest line: how views read the run's output."""
        return self._lines.since(seen)

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value; raises `WorkerError` if the run did not succeed, and, as a future's `result`
        does, `TimeoutError` if it has not ended within `timeout` seconds (the run goes on)."""
        if timeout is not None and not is_seconds(timeout, zero=True):
            raise ValueError(f"timeout is a number of seconds to wait, 0 or more, not {timeout!r}.")
        self.wait(timeout)
        if not self._done.is_set():
            raise TimeoutError(f"the run has not ended within {timeout:g} s, and goes on: .result() again waits for "
                               "it, .stop() ends it.")
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
        self._stop_request.asked = (outcome, note)
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
        (self._listeners if news else self._enders).append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        """No more calls to `callback`: a view that has drawn the end lets go of the run, and the run of it (a
        background run's `wait()`, which would let go of its views, may never come)."""
        # new lists, not removals: `_notify` may be going over the old ones in another thread
        self._listeners = [c for c in self._listeners if c != callback]
        self._enders = [c for c in self._enders if c != callback]

    def _notify(self, ending: bool = False) -> None:
        for callback in [*self._listeners, *(self._enders if ending else ())]:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - a view's bug must cost the run neither its result nor its end
                self._view_failed(callback, exc)
        if ending and self._done.is_set():  # the views have drawn the end: let go of them, so that the run and
            self._listeners.clear()        # its value go with the caller's last reference, not at the next gc
            self._enders.clear()

    def _view_failed(self, callback: Callable[[], None], exc: Exception) -> None:
        """Said once a view (a bug of ddpnb's), on the kernel's stderr, its traceback kept in the record."""
        view = getattr(callback, "__qualname__", repr(callback)).split(".")[0]
        if view in self._views_failed:
            return
        self._views_failed.add(view)
        self.record.internal_error(f"drawing the {view}", exc)
        print(f"[ddpnb] the {view} could not draw ({type(exc).__name__}: {exc}): a ddpnb bug, please report it with "
              "the run directory; the run and its result are unaffected", file=sys.stderr, flush=True)

    def stacks(self, wait: float = STACKS_WAIT) -> dict[int, str]:
        """Every running rank's Python stack now, as a traceback reads: `{rank: text}`, the threads that run your
        code (on Ray Train: the training thread), oldest call first, notebook cells named `Cell In[N]`, with their
        source lines. The run goes on; `{}` once it has ended."""
        if self.done:
            return {}
        return {rank: cell_names(stack) for rank, stack in
                self.collect_stacks(self.attempt.running_ranks(), wait).items()}

    def collect_stacks(self, ranks: list[int], wait: float) -> dict[int, str]:
        """Each of `ranks`' stacks now, from the user's code down (asked from any thread but the reader's)."""
        return self.attempt.request_stacks(ranks, wait, self._done.is_set)

    # --- the attempts: one loop, in the reader thread --------------------------------------------------------
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
        """Keep the attempt that ended in the record and begin the next, on a fresh engine (or on `engine`, which
        restarted the ranks itself). False where it could not start: the run ends, failed, saying why."""
        ended = self.attempt
        ended.result.close()  # what its rank 0 sent is not the run's result now
        outcome, note = ended.outcome()
        record = self.record
        record.attempts.append(AttemptRecord(number=ended.number, ranks=record.ranks, failures=record.failures,
                                             outcome=outcome, note=note, started=ended.started, ended=time.time(),
                                             last_line=self._lines.count))
        record.stall = record.at_timeout = record.queued = None
        spec = replace(ended.spec, attempt=ended.number + 1)
        self.attempt = self._new_attempt(ended.number + 1, spec)
        assert self._relay is not None  # released only when the run ends
        self._relay.retarget(self.attempt)
        try:
            if engine is not None:
                self.attempt.adopt(engine)
            else:
                self.attempt.start(self.setup.new_engine, self._relay, self.shared,  # type: ignore[arg-type]
                                   self._restarts_left())
        except Exception as exc:  # noqa: BLE001 - the run ends, failed, saying why the restart could not start
            self.attempt.abandon(f"attempt {self.attempt.number} could not start: {type(exc).__name__}: {exc}")
            return False
        self._announcer.now()  # the views show the new attempt at once
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
        paths = log_paths(Path(spec.run_dir), spec.world_size, number, self.setup.policy.max_restarts > 0)
        record = self.record
        record.attempt, record.failures = number, []
        record.ranks = [RankRecord(rank=r, device=self.setup.devices[r], log_path=paths[r])
                        for r in range(spec.world_size)]
        channel = self.channel
        watchdog = Watchdog(spec.world_size, spec.timeout, self.setup.stall,
                            paused=channel.idle if channel is not None else lambda: False)
        return Attempt(number, spec, self.setup.capabilities, record, self._lines, watchdog, self._announcer,
                       channel, self._stop_request)

    def _restarts_left(self) -> int:
        return self.setup.policy.restarts_left(self.attempt.number, self._stop_request.asked is not None)

    def _release(self) -> None:
        for fd in self._locks:
            os.close(fd)
        self._locks = []
        self.shared = None  # no restart comes now: the notebook data the ranks were given may go
        self._relay = None  # it holds `_restarted`: the run goes with the caller's last reference, not at a gc
        live.discard(self)

    def _conclude(self) -> None:
        """The run's outcome: its last attempt's; then `wait()` returns."""
        record = self.record
        record.ended = time.time()
        outcome, note = self.attempt.outcome()
        record.outcome, record.note = outcome, note or record.note
        if self.journal is not None:
            self.journal.concluded()
        self.attempt.result.settle(record.outcome is Outcome.SUCCEEDED)
        self._done.set()
        self._announcer.now()
