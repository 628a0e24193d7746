"""`Run`: one run's handle and bookkeeping, the same for every engine.

The run keeps the record, turns what its engine reports into state (`RunEvents`), picks the root cause of a
failure, stops every rank against one deadline, holds the run directory's lock and rank 0's result, and feeds
its views. The engine (`core.engine.Engine`) only starts, reads and signals the ranks.

Restarts (`--max-restarts`) live here too, the same for every engine: an attempt that fails with restarts left
is kept in the record (`RunRecord.attempts`), its engine is closed, and a fresh engine starts every rank again
(`_restart`). The handle, the record, the output lines and the views span all attempts; what is one attempt's
(rank records, failures, logs, the stop, rank 0's result) starts afresh.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddpnb.core import checkpoints, flight, pickling, rundir
from ddpnb.core import messages as msg
from ddpnb.core.cellnames import cell_names
from ddpnb.core.engine import Engine
from ddpnb.core.failures import Failure, is_knock_on
from ddpnb.core.output import LineBuffer, LineDecoder, last_text
from ddpnb.core.record import Attempt, Diagnosis, Outcome, OutputLine, Point, RankRecord, RankState, RunRecord, Stall
from ddpnb.core.report import RunInterrupted, WorkerError
from ddpnb.core.shared import Shipment
from ddpnb.core.spec import EngineKind, Stream, WorkerSpec
from ddpnb.core.stacks import CrashDump
from ddpnb.core.stall import StallWatch, diagnose
from ddpnb.core.stragglers import flag_stragglers
from ddpnb.core.words import describe_exit, format_duration

STACK_WAIT = 1.0  # seconds a stalled rank gets to dump its Python stacks before it is stopped
STACKS_WAIT = 10.0  # seconds `Run.stacks()` waits for every rank's stack
_RUNNING = (RankState.STARTING, RankState.RUNNING)
EAGER = 1.0  # seconds after a session command during which the engine reads without pausing (a quick answer)
TICK = 1.0  # seconds between two redraws of a view when nothing changed (its clocks move on)
RADAR_INTERVAL = 0.5  # seconds between two straggler verdicts while compute reports arrive

_live_runs: set[Run] = set()


class Run:
    """A set of ranks, one process each, and what they report. Use `wait()`, `result()`, `stop()`."""

    def __init__(self, spec: WorkerSpec, devices: list[str], engine: Engine, timeout: float | None = None,
                 function: str = "", max_restarts: int = 0,
                 new_engine: Callable[[WorkerSpec], Engine] | None = None, shared: Shipment | None = None,
                 stall: float | None = None) -> None:
        """`engine` runs the first attempt; `new_engine(spec)` makes the engine of each restart (up to
        `max_restarts`), with the attempt's own spec. `timeout` bounds each attempt. `shared`: the notebook data
        the ranks map (`core.shared`); the caller commits it after `start`. `stall`: seconds without progress
        that mark the run stalled (None: adapted to the run, `core.stall`; 0: never)."""
        self.spec = spec
        self.engine = engine
        self.shared = shared  # the notebook data the ranks map (`core.shared`); the caller commits it after `start`
        self.timeout = timeout
        self.max_restarts = max_restarts if new_engine is not None else 0
        self._new_engine = new_engine
        self._devices = devices
        run_dir = Path(spec.run_dir)
        self.record = RunRecord(run_dir=run_dir, world_size=spec.world_size, backend=spec.backend,
                                engine=engine.kind, function=function, max_restarts=self.max_restarts,
                                checkpoint_dir=Path(spec.checkpoint_dir) if spec.checkpoint_dir else None,
                                resumed_from=Path(spec.resume_dir) if spec.resume_dir else None)
        self.record.ranks = self._rank_records(0)
        self._attempt_started = 0.0  # the timeout counts from here, per attempt
        self._lines = LineBuffer()
        self._decoders: dict[tuple[int, Stream], LineDecoder] = {}
        self._crashes: dict[int, CrashDump] = {}  # faulthandler's report in each rank's stderr, once it starts
        self._logs: list[Any] = []
        self._dir_lock: int | None = None
        self._held: list[int] = []  # locks on directories the run reads (`hold`), released with the run's own
        self._payload: bytes | None = None  # rank 0's value, pickled; or, `_saved`, in the result file
        self._saved = False
        self._result_fd: int | None = None
        self._result_closer: Any = None
        self._value: Any = None
        self._returned: set[int] = set()
        self._stopping: dict[int, float] = {}  # rank -> when the engine was first asked to stop it (time.time())
        self._stop_reason: Outcome | None = None
        self._stop_note = ""
        self._stop_requested: tuple[Outcome, str] | None = None
        self._escalate_at: float | None = None  # the stop's one deadline: when the engine stops harder
        self._serving = False
        self._stack_requests: list[tuple[list[int], dict[int, str], threading.Event]] = []
        self._done = threading.Event()
        self._listeners: list[Callable[[], None]] = []  # fed by `wait()` with the reader's news
        self._enders: list[Callable[[], None]] = []  # called when `wait()` returns
        self._changes = threading.Condition()  # views wait on it for the reader's news (`watch`)
        self._generation = 0  # how many times the reader announced news
        self._news = False  # something was read or changed since the last announcement
        self._turn = False  # ... and it is a rank starting, returning, failing or exiting, or the run stopping
        self._last_news = 0.0
        self.replies: queue.SimpleQueue[msg.Reply] = queue.SimpleQueue()  # sessions: the ranks' answers
        self._answers: list[msg.Reply] = []
        self._sent_at = 0.0  # when the latest session command was sent
        self._stall_setting = stall
        self._watch = StallWatch(spec.world_size, stall)
        self._active = self._watch.active  # each rank's latest activity, stamped with `_clock`
        self._clock = time.monotonic()  # the reader's clock, read once a pass (`tick`): a message stores it
        self._stalled_latest = 0.0  # the run's latest activity when the ongoing stall began
        self._awaiting: set[int] = set()  # sessions: the ranks whose answer to a command is awaited
        self._radar_due = False  # compute reports arrived since the last straggler verdict
        self._radar_at = 0.0

    # --- public lifecycle -----------------------------------------------------------------------------------
    def start(self) -> Run:
        """Start every rank through the engine; on any failure nothing is left running and the empty run
        directory is removed."""
        run_dir = Path(self.spec.run_dir)
        # the directory's lock says "live" to retention in every kernel, for every engine, until the run ends
        self._dir_lock = rundir.lock(run_dir)
        try:
            self._open_attempt()
            self.record.started = time.time()
            for record in self.record.ranks:
                record.started = self.record.started
            self.engine.start(self, self._result_fd, self.shared)
            # the duration and the timeout count from the first rank's start, not from the forkserver's first import
            self.record.started = self._attempt_started = self.record.ranks[0].started
            self._watch.idle(time.monotonic())  # the ranks' start is no quiet spell of theirs
            _live_runs.add(self)
            self._serving = True
            threading.Thread(target=self._serve, name=f"ddpnb-{self.engine.kind}-run", daemon=True).start()
        except BaseException as exc:
            self._release()
            self._close_result_file()
            rundir.remove_if_empty(run_dir)
            if isinstance(exc, KeyboardInterrupt):  # the ranks that had started are gone: say so, not where
                self.record.outcome, self.record.ended = Outcome.INTERRUPTED, time.time()
                raise RunInterrupted(self.record, starting=True) from None
            raise
        return self

    def hold(self, lock: int | None) -> None:
        """Keep a lock (`rundir.lock`) on a directory the run reads, such as the run it resumes, until it ends."""
        if lock is not None:
            self._held.append(lock)

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
        stalled = f", stalled: {record.stall.diagnosis.summary()}" if record.stall and record.stalled else ""
        return f"{record.outcome.value} after {format_duration(record.duration)} (ranks {ranks}){stalled}"

    @property
    def nodes(self) -> dict[int, str]:
        """Ray: each rank's node ID, once it started."""
        return {r.rank: r.node for r in self.record.ranks if r.node}

    def __repr__(self) -> str:
        record = self.record  # read when shown, so a handle displayed again later says how the run is now
        return (f"<ddpnb run of {record.function or 'a function'} on {record.world_size} ranks ({record.backend}): "
                f"{self.status}; .wait() .result() .stop()>")

    def wait(self, timeout: float | None = None) -> RunRecord:
        """Block until every rank has ended (or `timeout` passes); Ctrl-C stops the run and re-raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = 0
        try:
            while not self._done.is_set():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._listeners:  # no view to feed: sleep until the end (Ctrl-C still wakes this wait)
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

    def watch(self, seen: int, timeout: float) -> int:
        """Wait until the reader announces news after announcement number `seen`, or `timeout` passes; return the
        latest announcement's number. Output is announced at most once an engine's `announce_every`, a rank starting,
        returning, failing or exiting at once, and the run's end: how views redraw without timers of their own."""
        with self._changes:
            self._changes.wait_for(lambda: self._generation != seen or self._done.is_set(), timeout)
            return self._generation

    def lines_since(self, seen: int) -> tuple[list[OutputLine], int, int]:
        """The output lines after line number `seen` (the latest 2,000 are kept), how many after it are no longer
        kept, and the number of the latest line: how views read the run's output."""
        return self._lines.since(seen)

    def result(self) -> Any:
        """Rank 0's return value; raises `WorkerError` if the run did not succeed."""
        self.wait()
        if self.record.outcome is not Outcome.SUCCEEDED:
            raise WorkerError(self.record, hint=hint(self.record))
        if self._payload is not None:  # unpickled once; the bytes are dropped so a big result is not held twice
            self._value, self._payload = pickle.loads(self._payload), None
        elif self._saved:  # mapped, not read: the tensors are the file's pages
            assert self._result_fd is not None
            self._value, self._saved = pickling.load(self._result_fd), False
            self._close_result_file()
        return self._value

    def join(self, timeout: float | None = None) -> bool:
        """Like mp.spawn's `ProcessContext.join`: True once every rank has ended, raises `WorkerError` on
        failure, False if `timeout` passed first."""
        self.wait(timeout)
        if not self.done:
            return False
        if self.record.outcome is not Outcome.SUCCEEDED:
            raise WorkerError(self.record, hint=hint(self.record))
        return True

    def stop(self, outcome: Outcome = Outcome.STOPPED, note: str = "stopped by the user") -> None:
        """Stop every rank (gently, then by force after the engine's grace period) and wait until all are gone."""
        if self._done.is_set():
            return
        self._stop_requested = (outcome, note)
        deadline = time.monotonic() + self.engine.stop_wait
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

    def _notify(self, ending: bool = False) -> None:
        for callback in [*self._listeners, *(self._enders if ending else ())]:
            callback()
        if ending and self._done.is_set():  # the views have drawn the end: let go of them, so that the run and
            self._listeners.clear()        # its value go with the caller's last reference, not at the next gc
            self._enders.clear()

    # --- RunEvents: what the engine reports, from the reader thread -------------------------------------------
    def placed(self, rank: int, pid: int | None, node: str = "") -> None:
        record = self.record.ranks[rank]
        record.pid, record.started = pid, time.time()
        record.node = node or record.node
        self._news = True

    def output(self, rank: int, stream: Stream, data: bytes) -> None:
        lines = self._decoders[(rank, stream)].feed(data, final=not data)
        if lines:
            self._add_lines(rank, stream, lines)

    def _add_lines(self, rank: int, stream: Stream, lines: list[str]) -> None:
        record = self.record.ranks[rank]
        self._news = True
        self._active[rank] = self._clock
        self._lines.add(rank, stream, lines)
        record.lines += len(lines)
        own = lines
        if stream is Stream.STDERR:  # a fatal error's report is not the rank's last line: it says where it died
            crash = self._crashes.get(rank) or CrashDump()
            own = crash.own_lines(lines)
            if crash.lines:
                self._crashes[rank] = crash
                self._explain_crash(rank)
        if own:
            record.last_line = own[-1]
            # a rank with tqdm bars writes each bar's final state as a line; the dashboard shows the bar already
            text = last_text(own) if record.progress else own[-1]
            record.last_text = record.last_text if text is None else text

    def message(self, rank: int, message: msg.Message) -> None:
        record = self.record.ranks[rank]
        self._news = True
        self._turn = self._turn or isinstance(message, (msg.Started, msg.Returned, msg.Failed))
        # progress is stamped in its branches (output in `_add_lines`); a stuck rank sends GPU memory and stacks too
        if isinstance(message, msg.Metric):
            self._active[rank] = self._clock
            for name, value in message.values.items():
                record.metrics.setdefault(name, []).append(Point(message.step, message.time, value))
        elif isinstance(message, msg.Output):
            self.output(rank, Stream(message.stream), message.data)
        elif isinstance(message, msg.Progress):
            self._active[rank] = self._clock
            record.update_progress(message)
        elif isinstance(message, msg.GpuMemory):
            record.gpu_memory = (message.reserved, message.peak)
        elif isinstance(message, msg.StepTimes):
            record.step_times.append(message)
            self._radar_due = True  # judged in `tick`, at most once a RADAR_INTERVAL however many ranks report
        elif isinstance(message, msg.Hardware):
            record.hardware.append(message)
        elif isinstance(message, msg.Placed):
            self.placed(rank, message.pid, message.node_id)
            line = f"[ddpnb] on Ray node {message.node_id[:12]} ({message.node_ip}), pid {message.pid}\n"
            self.output(rank, Stream.STDOUT, line.encode())
        elif isinstance(message, msg.Imported):
            self.record.hint = _preload_hint(message)
        elif isinstance(message, msg.Started):
            record.state, record.device = RankState.RUNNING, message.device
            self._active[rank] = self._clock
        elif isinstance(message, msg.Returned):
            self._active[rank] = self._clock
            self._returned.add(rank)
            if rank == 0:
                self._payload, self._saved = message.payload, message.saved
        elif isinstance(message, msg.Reply):
            self._awaiting.discard(rank)
            self._active[rank] = self._clock
            self._turn = True  # an answer is what the session waits for: announce it at once
            self._answers.append(message)  # released at the end of this read pass, after the output read with it
        elif isinstance(message, msg.Failed):
            record.state = RankState.FAILED
            if message.exc_type == "SystemExit":
                summary = f"called sys.exit({message.message}) before its function returned"
            else:
                summary = f"{message.exc_type}: {message.message}" if message.message else message.exc_type
            # an error raised after ddpnb began stopping this rank (a SIGTERM handler that raises) is a consequence;
            # one raised before, but read after, is the rank's own
            knock_on = is_knock_on(message.exc_type, message.message) \
                or message.time >= self._stopping.get(rank, float("inf"))
            self.record.failures.append(Failure(rank, message.time, summary, message.traceback, knock_on))
            self._begin_stop(Outcome.FAILED, f"rank {rank} raised {message.exc_type}")

    def exited(self, rank: int, exitcode: int | None, *, stopped: bool = False, cause: str = "",
               traceback: str = "") -> None:
        record = self.record.ranks[rank]
        self._news = self._turn = True
        record.exitcode, record.ended = exitcode, record.ended or time.time()
        if record.state is RankState.FAILED:
            return
        if exitcode == 0 and rank in self._returned:
            record.state = RankState.FINISHED
        elif stopped:  # ended by ddpnb's stop, not by itself
            record.state = RankState.STOPPED
        else:
            record.state = RankState.FAILED
            if not cause:
                cause = describe_exit(exitcode)
                if exitcode is not None and exitcode >= 0:
                    cause += " before its function returned (os._exit, or exit() in C code?)"
            self.record.failures.append(Failure(rank, time.time(), cause, traceback))
            self._explain_crash(rank)
            self._begin_stop(Outcome.FAILED, f"rank {rank} {cause}")

    def _explain_crash(self, rank: int) -> None:
        """A rank killed by a signal, with faulthandler's report read: its failure says where, in the user's code,
        it died (`killed by SIGSEGV in crash (Cell In[3], line 4)`), and holds the report as its traceback."""
        crash = self._crashes.get(rank)
        failure = next((f for f in self.record.failures if f.rank == rank), None)
        code = self.record.ranks[rank].exitcode
        if crash is None or failure is None or code is None or code >= 0 or not crash.complete:
            return
        if not failure.traceback:
            failure.traceback = crash.stack()
        frame = crash.crash_frame()
        if frame and failure.summary == describe_exit(code):
            filename, line, function = frame
            location = f'File "{filename}", line {line}'
            named = cell_names(location)
            failure.summary += f" in {function} ({named if named != location else f'{filename}, line {line}'})"
            self._news = self._turn = True

    def quiet(self) -> bool:
        eager = time.monotonic() - self._sent_at < EAGER
        return not eager and not self._returned and self._stop_reason is None and self._stop_requested is None

    # --- sessions: commands to ranks that stay --------------------------------------------------------------------
    def send(self, ranks: list[int], command: bytes, shared: Any = None) -> None:
        """Deliver a session command to `ranks`; their `Reply` messages arrive in `replies`. `shared`: the
        engine's shipment of the command's big tensors and arrays (`EngineType.shipment`)."""
        self._sent_at = time.monotonic()
        self._awaiting.update(ranks)
        self.engine.send(ranks, command, shared)

    def interrupt(self, ranks: list[int]) -> None:
        self.engine.interrupt(ranks)

    def stacks(self, wait: float = STACKS_WAIT) -> dict[int, str]:
        """Every running rank's Python stack now, from the user's code down: `{rank: text}` (local ranks: every
        thread's; Ray: the training thread's). The run goes on; `{}` once it has ended."""
        if self.done:
            return {}
        return self.collect_stacks([r.rank for r in self.record.ranks if r.state in _RUNNING], wait)

    def collect_stacks(self, ranks: list[int], wait: float) -> dict[int, str]:
        """Each of `ranks`' stacks now, from the user's code down (asked from any thread but the reader's)."""
        taken: dict[int, str] = {}
        collected = threading.Event()
        self._stack_requests.append((list(ranks), taken, collected))
        deadline = time.monotonic() + wait
        while not collected.wait(0.1) and not self._done.is_set() and time.monotonic() < deadline:
            continue  # a run that ends meanwhile sends no stacks
        return {rank: taken.get(rank, "") for rank in ranks}

    def tick(self) -> None:
        self._clock = time.monotonic()
        self._release_answers()
        self._judge_stragglers()
        while self._stack_requests:  # asked for by another thread: collected in the reader's thread
            ranks, taken, collected = self._stack_requests.pop(0)
            taken.update(self.engine.collect_stacks(ranks))
            collected.set()
        if self._stop_requested and self._stop_reason is None:
            self._begin_stop(*self._stop_requested)
        elif self.timeout and self._stop_reason is None and time.time() - self._attempt_started > self.timeout:
            self.record.at_timeout = self._diagnose(keep=True)  # the stacks stay in the record for its report
            self._begin_stop(Outcome.TIMED_OUT, f"stopped after the {self.timeout:g} s timeout (--timeout)")
        elif self._watch.enabled and self._stop_reason is None:
            self._check_stall()
        if self._escalate_at is not None and time.monotonic() > self._escalate_at:
            after = self.engine.escalate()
            self._escalate_at = None if after is None else time.monotonic() + after
        if self._turn or (self._news and time.monotonic() - self._last_news >= self.engine.announce_every):
            self._announce()  # output at most once an `announce_every`, however it floods in; a turn at once
            self._last_news = time.monotonic()

    def _judge_stragglers(self, now: bool = False) -> None:
        if self._radar_due and (now or time.monotonic() - self._radar_at >= RADAR_INTERVAL):
            self._radar_due, self._radar_at = False, time.monotonic()
            flag_stragglers(self.record.ranks)

    # --- stopping and ending -----------------------------------------------------------------------------------
    def _release_answers(self) -> None:
        """A session's answers go out once the read pass that brought them is over: the output a rank wrote before
        answering, which sat in its pipes then, has been read by now."""
        answers, self._answers = self._answers, []
        for answer in answers:
            self.replies.put(answer)

    def _begin_stop(self, outcome: Outcome, note: str) -> None:
        if self._stop_reason is not None:
            return
        self._stop_reason, self._stop_note = outcome, note
        self._news = self._turn = True
        if not self._serving:  # the engine has ended already (its own account of the ranks): nothing to stop
            return
        going = [r.rank for r in self.record.ranks if r.exitcode is None and r.ended is None
                 and r.state is not RankState.FAILED]  # a failed rank exits by itself
        now = time.time()
        for rank in going:
            self._stopping.setdefault(rank, now)
        after = self.engine.stop(going, failed=outcome is Outcome.FAILED)
        self._escalate_at = None if after is None else time.monotonic() + after

    # --- the stall doctor ----------------------------------------------------------------------------------------
    def _check_stall(self) -> None:
        """Mark the run stalled once no rank made progress for the threshold, and unmark it when one does."""
        watch, record, now = self._watch, self.record, self._clock
        quiet = watch.update(now)
        stall = record.stall
        if stall is not None and stall.ongoing:
            if watch.latest > self._stalled_latest:  # a rank made progress again
                stall.resumed = time.time()
                self._news = self._turn = True
            return
        if self.spec.interactive and not self._awaiting:  # a session between commands: waiting is its job
            watch.idle(now)
            return
        threshold = watch.threshold()
        if quiet <= threshold or not any(r.state in _RUNNING and r.rank not in self._returned for r in record.ranks):
            return
        self._stalled_latest = watch.latest
        record.stall = Stall(since=time.time() - quiet, threshold=threshold, diagnosis=self._diagnose())
        self._news = self._turn = True

    def _diagnose(self, keep: bool = False) -> Diagnosis:
        """Where every rank is now: its stack (`keep`: left in the record, as a timeout's report shows them) and,
        on NCCL runs, its flight recorder."""
        running = [r.rank for r in self.record.ranks if r.state in _RUNNING]
        nccl = self.record.backend == "nccl" and self.record.engine is EngineKind.LOCAL
        asked = flight.request(self.spec.run_dir, running) if nccl else 0.0  # dumped while the stacks come
        stacks = self.engine.collect_stacks(running)
        if keep:
            for rank, stack in stacks.items():
                kept = self.record.ranks[rank]
                kept.stack, kept.stalled_state = stack, kept.state
        recorded = flight.summarise(flight.collect(self.spec.run_dir, running, asked), running) if nccl else []
        return diagnose(self.record.ranks, stacks, self._active, self._returned, recorded)

    def _serve(self) -> None:
        """The reader thread: serve each attempt until the last one ends, then conclude the run."""
        try:
            while True:
                try:
                    self.engine.serve()
                finally:
                    self._serving = False
                    self._end_attempt()
                if not self._restart():
                    return
        finally:  # whatever failed above (a full disk), release everything and let `wait()` return
            for _, _, collected in self._stack_requests:  # no stacks will come now
                collected.set()
            self._release_answers()
            self._release()
            self._conclude()

    def _end_attempt(self) -> None:
        """The attempt's ranks are gone: close its engine, and end its logs with how each rank ended."""
        try:
            self._judge_stragglers(now=True)  # the last reports count too
            self.engine.close()
        finally:
            self._close_logs()

    def _close_logs(self) -> None:
        """End the attempt's logs with how each rank ended, and close them."""
        try:
            for (rank, stream), decoder in self._decoders.items():  # a last line without its newline
                if decoder.partial or decoder.partial_cut:
                    self._add_lines(rank, stream, decoder.feed(b"", final=True))
            for rank, crash in self._crashes.items():  # a report cut short (no extension modules line)
                crash.complete = True
                self._explain_crash(rank)
            self._write_endings()
        finally:
            for log in self._logs:
                log.close()
            self._logs = []

    # --- restarts ----------------------------------------------------------------------------------------------
    def _restart(self) -> bool:
        """After an attempt that failed (a rank's error or crash, or the timeout) with restarts left, and nobody
        asked to stop: keep the attempt in the record and start every rank again, fresh, on a new engine. Returns
        False where the run ends instead. An interrupt or `stop()` never restarts (`_stop_requested`)."""
        record = self.record
        outcome, note = self._outcome()
        if outcome not in (Outcome.FAILED, Outcome.TIMED_OUT) or not self.restarts_left() or self._new_engine is None:
            return False
        self._next_attempt(outcome, note)
        try:
            self.engine = self._new_engine(self.spec)
            self._open_attempt()
            self._attempt_started = time.time()
            for rank in record.ranks:
                rank.started = self._attempt_started
            self.engine.start(self, self._result_fd, self.shared)
        except Exception as exc:  # noqa: BLE001 - the run ends, failed, saying why the restart could not start
            self._stop_reason = Outcome.FAILED
            self._stop_note = f"attempt {record.attempt} could not start: {type(exc).__name__}: {exc}"
            for rank in record.ranks:
                rank.state = RankState.STOPPED
            return False
        self._attempt_started = record.ranks[0].started
        self._watch.idle(time.monotonic())
        self._serving = True
        self._announce()  # the views show the new attempt at once
        return True

    def restarts_left(self) -> int:
        """Restarts this run may still make (none once an interrupt or `stop()` asked it to end)."""
        if self._stop_requested is not None:
            return 0
        return max(0, self.max_restarts - self.record.attempt)

    def restarted(self) -> bool:
        """RunEvents: the engine restarted every rank itself (Ray Train's FailureConfig), after the ranks of the
        attempt that failed have `exited`. The attempt is kept in the record as `_restart` keeps one; False (the
        engine must then stop its ranks) where the run may not restart."""
        outcome, note = self._outcome()
        if outcome is not Outcome.FAILED or not self.restarts_left():
            return False
        self._close_logs()
        self._next_attempt(outcome, note)
        self._open_attempt()
        self._attempt_started = time.time()
        for rank in self.record.ranks:
            rank.started = self._attempt_started
        self._announce()
        return True

    def _next_attempt(self, outcome: Outcome, note: str) -> None:
        """Keep the attempt that ended in the record; what is one attempt's starts afresh (the record, the lines,
        the directory's lock and the views stay)."""
        record = self.record
        record.attempts.append(Attempt(number=record.attempt, ranks=record.ranks, failures=record.failures,
                                       outcome=outcome, note=note, started=self._attempt_started,
                                       ended=time.time(), last_line=self._lines.count))
        record.attempt += 1
        record.failures = []
        record.stall = record.at_timeout = None
        self._watch = StallWatch(self.spec.world_size, self._stall_setting)
        self._active = self._watch.active
        record.ranks = self._rank_records(record.attempt)
        self._decoders, self._crashes = {}, {}
        self._payload, self._saved = None, False
        self._close_result_file()
        self._returned, self._stopping, self._radar_due = set(), {}, False
        self._stop_reason, self._stop_note, self._escalate_at = None, "", None
        self.spec = replace(self.spec, attempt=record.attempt, master_port=0)

    def _rank_records(self, attempt: int) -> list[RankRecord]:
        """An attempt's rank records; with restarts, each attempt has its own logs (`rank1.attempt0.log`)."""
        run_dir = Path(self.spec.run_dir)
        names = [f"rank{r}.attempt{attempt}.log" if self.max_restarts else f"rank{r}.log"
                 for r in range(self.spec.world_size)]
        return [RankRecord(rank=r, device=self._devices[r], log_path=run_dir / names[r])
                for r in range(self.spec.world_size)]

    def _open_attempt(self) -> None:
        """The attempt's log files, their decoders, and rank 0's result file."""
        for record in self.record.ranks:
            log = open(record.log_path, "wb", buffering=0, opener=rundir.private)  # noqa: SIM115
            self._logs.append(log)
            for stream in Stream:
                self._decoders[(record.rank, stream)] = LineDecoder(log)
        if self.engine.maps_results:
            self._create_result_file()

    def _release(self) -> None:
        for log in self._logs:
            log.close()
        self._logs = []
        if self._dir_lock is not None:
            os.close(self._dir_lock)
            self._dir_lock = None
        for fd in self._held:
            os.close(fd)
        self._held = []
        self.shared = None  # no restart comes now: the notebook data the ranks were given may go
        _live_runs.discard(self)

    def _outcome(self) -> tuple[Outcome, str]:
        """The current attempt's outcome from its stop and its ranks' states."""
        if self._stop_reason is not None:
            return self._stop_reason, self._stop_note
        if all(r.state is RankState.FINISHED for r in self.record.ranks):
            return Outcome.SUCCEEDED, ""
        return Outcome.FAILED, "not every rank finished"

    def _conclude(self) -> None:
        """The run's outcome: its last attempt's; then `wait()` returns."""
        record = self.record
        record.ended = time.time()
        outcome, note = self._outcome()
        record.outcome, record.note = outcome, note or record.note
        if record.outcome is not Outcome.SUCCEEDED:  # `result()` raises: what rank 0 sent is not needed
            self._payload, self._saved = None, False
        if not self._saved:
            self._close_result_file()
        self._done.set()
        self._announce()

    def _announce(self) -> None:
        with self._changes:
            self._generation += 1
            self._news = self._turn = False
            self._changes.notify_all()

    def _write_endings(self) -> None:
        """End each rank's log with how the rank ended, so the file alone tells the story."""
        failures = {failure.rank: failure for failure in self.record.failures}
        for rank, log in zip(self.record.ranks, self._logs):
            if rank.state is RankState.FINISHED:
                continue
            failure = failures.get(rank.rank)
            if failure is not None:
                ending = f"rank {rank.rank} failed: {failure.summary}\n{failure.traceback}".rstrip()
            elif rank.state is RankState.STOPPED:
                ending = f"rank {rank.rank} stopped by ddpnb ({describe_exit(rank.exitcode)}): {self._stop_note}"
            else:
                ending = f"rank {rank.rank} {describe_exit(rank.exitcode)}"
            log.write(f"\n[ddpnb] {ending}\n".encode())

    # --- rank 0's result file ------------------------------------------------------------------------------------
    def _create_result_file(self) -> None:
        """Where rank 0 writes a value holding tensors (`rank.main.dump_result`); without one (no memfd_create
        here, or refused) every value travels in rank 0's last message."""
        try:
            self._result_fd = os.memfd_create("ddpnb-result", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return
        self._result_closer = weakref.finalize(self, os.close, self._result_fd)  # a result nobody took

    def _close_result_file(self) -> None:
        """The file's memory goes with the last reference to it: this fd, or a tensor mapped from it."""
        if self._result_fd is not None:
            self._result_closer()
            self._result_fd = None


def hint(record: RunRecord) -> str:
    """What to do next, under a failed run's report; and how to continue from its checkpoint, where it has one."""
    found = checkpoints.latest(record.checkpoint_dir) if record.checkpoint_dir else None
    resume = (f"\nIts latest complete checkpoint is step {found[0]}: `%%ddp --resume last` (or resume='last') "
              "continues from it." if found else "")
    return _next_step(record) + resume


def _next_step(record: RunRecord) -> str:
    if record.outcome is Outcome.TIMED_OUT:
        return "The stacks above show where each rank waited; a rank that never reaches a collective hangs the others."
    if record.outcome is Outcome.INTERRUPTED:
        return "Every rank was stopped; run the cell again when ready."
    if record.outcome is Outcome.STOPPED:
        return "Run the cell again to start afresh; the kernel and its variables are unchanged."
    first = record.first_failure
    if first and first.summary.startswith("killed by"):
        return ("A rank died from a signal (a crash in C/C++ code, or the out-of-memory killer); its log shows its last "
                "output and, after a crash, where Python was.")
    return "Fix the error above and run the cell again; the kernel and its variables are unchanged."


_hinted: set[tuple[str, ...]] = set()  # modules `_preload_hint` already named in this kernel


def _preload_hint(imported: msg.Imported) -> str:
    """Once per kernel and set of modules: what rank 0 spent importing at this launch, and how to stop paying."""
    if imported.modules in _hinted:
        return ""
    _hinted.add(imported.modules)
    names = ", ".join(map(repr, imported.modules))
    return (f"rebuilding the function took rank 0 {imported.seconds:.1f} s, importing {names}, as every rank does at "
            f"every launch; ddpnb.preload({names}) imports {'it' if len(imported.modules) == 1 else 'them'} once, in "
            "the process ranks are forked from.")


def live_runs(kind: EngineKind | None = None) -> list[Run]:
    """The runs of this kernel still going (of one engine), oldest first."""
    return sorted((run for run in list(_live_runs) if kind is None or run.engine.kind is kind),
                  key=lambda run: run.record.started)


def stop_all_runs() -> None:
    """atexit: a kernel that shuts down takes its runs with it."""
    for run in live_runs():
        run.stop(Outcome.STOPPED, "the kernel shut down")
