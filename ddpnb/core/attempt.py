"""One attempt of a run: every rank started once on one engine, until all have ended.

The attempt is what its engine reports to (`core.engine.RunEvents`): it turns messages and exits into rank
states and failures in its own record (`AttemptRecord`, which it alone writes), feeds the rank logs and the
watchdog, holds rank 0's result, and stops every rank against one deadline; what other threads ask of its ranks
(debugger answers, stacks) goes through its `Broker`. It announces what changed to the run's views. Whether another attempt follows is the restart
policy's decision (`core.policy`), acted on by the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from ddpnb.core import flight, hints
from ddpnb.core import messages as msg
from ddpnb.core import profile as profiling
from ddpnb.core.announce import Announcer
from ddpnb.core.broker import Broker
from ddpnb.core.channel import CommandChannel
from ddpnb.core.data import Shipment
from ddpnb.core.engine import AttemptStart, Capabilities, Engine, RunEvents
from ddpnb.core.failures import Failure, FrameLocals, is_knock_on
from ddpnb.core.output import LineBuffer
from ddpnb.core.policy import AttemptSnapshot
from ddpnb.core.ranklogs import FLUSH_EVERY, RankLogs
from ddpnb.core.record import AttemptRecord, Diagnosis, Outcome, Queued, RankState, Stall, bug_text
from ddpnb.core.result import ResultSlot
from ddpnb.core.series import Series, Spill
from ddpnb.core.spec import Stream, WorkerSpec
from ddpnb.core.stall import diagnose
from ddpnb.core.watchdog import Alarm, Watchdog
from ddpnb.core.words import describe_exit

_RUNNING = (RankState.STARTING, RankState.RUNNING)
StopAsk = tuple[Outcome, str]


class StopRequest:
    """The stop a run was asked for (an interrupt, the user, a session), shared with its attempts: a plain slot,
    written by the asking thread, read by the reader's at each tick."""

    def __init__(self) -> None:
        self.asked: StopAsk | None = None


class AttemptState(enum.Enum):
    """STARTING (the engine starts the ranks) → RUNNING (the reader serves them) → STOPPING (a rank failed, the
    timeout passed, or a stop was asked: every rank is being stopped against one deadline) → ENDED (every rank
    has exited and the engine is closed). An attempt can go from RUNNING to ENDED directly (every rank returned),
    and from STOPPING to ENDED only; a start that raises ends it at once."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    ENDED = "ended"


class Attempt:
    """One attempt's ranks, as its engine reports them (`RunEvents`, but `restarted`, which is the run's).
    `record`: this attempt's, written here alone (`learned` hands it back complete); `stop_request`: the run's,
    read each tick; `numbered`: the run may restart, so each attempt's logs and traces have their own names."""

    def __init__(
        self,
        spec: WorkerSpec,
        capabilities: Capabilities,
        record: AttemptRecord,
        lines: LineBuffer,
        watchdog: Watchdog,
        announcer: Announcer,
        channel: CommandChannel | None,
        stop_request: StopRequest,
        numbered: bool,
    ) -> None:
        self.number = record.number
        self.spec = spec
        self.engine: Engine = None  # type: ignore[assignment]  # from `start` or `adopt` on
        self.capabilities = capabilities
        self.record = record
        self._lines = lines
        self.logs: RankLogs | None = None
        self._spill: Spill | None = None  # the metrics' written-out points, from the first metric on
        self._flush_at = 0.0  # when the rank logs are next written (`time.monotonic()`)
        self.watchdog = watchdog
        self.announcer = announcer
        self.channel = channel
        self.result = ResultSlot(memory_file=capabilities.shares_memory)
        self.state = AttemptState.STARTING
        self.clock: Callable[[], float] = time.time  # what the attempt writes times with (a journal records it)
        self._request = stop_request
        self._returned: set[int] = set()
        self._placed: set[int] = set()  # ranks whose process exists
        self._stopping: dict[int, float] = {}  # rank -> when the engine was first asked to stop it (time.time())
        self._stop: StopAsk | None = None  # why every rank is being stopped (a failure, the timeout, a stop)
        self._escalate_at: float | None = None  # the stop's one deadline: when the engine stops harder
        self._said: set[str] = set()  # what ddpnb could not read, said once an attempt (`_aside`)
        self.reader_failed = False  # ddpnb's own handling of the ranks raised (`failed_inside`)
        # the prompts and stack requests of other threads (the waiting cell, the console, `Run.stacks`)
        self.broker = Broker(record.ranks, lambda: self._stop[1] if self._stop is not None else None)
        self.traces = profiling.Traces(
            profiling.profile_dir(Path(spec.run_dir), self.number, numbered), spec.world_size, self.number
        )

    # --- lifecycle, driven by the run -------------------------------------------------------------------------
    def start(
        self, new_engine: Callable[[WorkerSpec], Engine], events: RunEvents, shipment: Shipment | None, restarts: int
    ) -> None:
        """Open the logs, make the engine and start every rank, reporting to `events` (a relay to this attempt);
        raises with nothing left running (`abandon` then lets go of the logs and the result file)."""
        self.record.started = time.time()
        self._open()
        self._bind(new_engine(self.spec))
        self.engine.start(
            events,
            AttemptStart(
                result_fd=self.result.fd,
                shipment=shipment,
                commands=self.channel is not None or self.spec.prompts,
                restarts=restarts,
            ),
        )
        self.record.started = self.record.ranks[0].started  # the duration counts from the first rank's start
        self._running()

    def adopt(self, engine: Engine) -> None:
        """Take over the ranks `engine` restarted itself (it reports to the same relay)."""
        self._open()
        self._bind(engine)
        self._running()

    def _bind(self, engine: Engine) -> None:
        self.engine = self.broker.engine = engine
        if self.channel is not None:
            self.channel.engine = engine

    def _open(self) -> None:
        for rank in self.record.ranks:
            rank.started = self.record.started
        self.logs = RankLogs(self.record.ranks, self.record.failures, self._lines)

    def _running(self) -> None:
        self.state = AttemptState.RUNNING
        self.watchdog.begin()

    def abandon(self, why: str = "") -> None:
        """The attempt could not start: nothing runs; `why` becomes its outcome's note."""
        self._stop = (Outcome.FAILED, why)
        for rank in self.record.ranks:
            rank.state = RankState.STOPPED
        self.state = AttemptState.ENDED
        if self.logs is not None:
            self.logs.release()
        self.result.close()

    def end(self, close_engine: bool = True) -> None:
        """The attempt's ranks are gone: close its engine (unless the next attempt keeps it), end its logs."""
        self.state = AttemptState.ENDED
        try:
            if close_engine:
                self.engine.close()  # first: whatever fails below, nothing of the attempt outlives it
                for rank in self.record.ranks:  # never reported gone (ddpnb's reader failed): the close ended it
                    if rank.state in _RUNNING:
                        rank.state, rank.ended = RankState.STOPPED, rank.ended or self.clock()
            if self.is_queued():  # the engine ended without saying the wait was over
                self.queued(self.record.queued.what, "")  # type: ignore[union-attr]
            self._judge_stragglers(at_once=True)  # the last count too
            self._merge_profile()
        finally:
            if self.logs is not None:
                self.logs.close(self._stop[1] if self._stop else "")
            self.release_waiters()

    def _merge_profile(self) -> None:
        """The ranks' traces merged into one, and the breakdown, into the record (`--profile`)."""
        try:
            profile = self.traces.finish()
        except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:  # a trace torch wrote that we cannot read
            profile = profiling.Profile(
                trace=None,
                rank_traces=dict(self.traces.files),
                steps=profiling.steps_words(self.spec.profile),
                notes=[
                    (
                        f"the traces could not be merged ({type(exc).__name__}: {exc}); each rank's own is in the "
                        "profile folder"
                    )
                ],
                attempt=self.number,
            )
        if profile is None and self.spec.profile is not None:  # --profile was asked for: say why there is none
            profile = profiling.Profile(
                trace=None,
                rank_traces={},
                steps=profiling.steps_words(self.spec.profile),
                notes=[
                    "no rank sent a profile: the attempt ended before any rank finished the profiled steps or returned"
                ],
                attempt=self.number,
            )
        if profile is not None:
            self.record.profile = profile
            self.announcer.mark(turn=True)

    def release_waiters(self) -> None:
        self.broker.release()
        if self.channel is not None:
            self.channel.release()

    def failed_inside(self, exc: Exception) -> None:
        """ddpnb's own handling of the ranks raised `exc` (a bug of ddpnb's): the attempt ends failed, saying so,
        its traceback in the record; `end` closes the engine, which stops every rank. No restart follows."""
        self.reader_failed = True
        self.record.internal_errors.append(bug_text("ddpnb's reader failed", exc))
        self._stop = (
            Outcome.FAILED,
            f"ddpnb's reader failed: {type(exc).__name__}: {exc} — a ddpnb bug; every rank was stopped",
        )
        self.announcer.mark(turn=True)

    def outcome(self) -> StopAsk:
        """The attempt's outcome from its stop and its ranks' states."""
        if self._stop is not None:
            return self._stop
        if all(r.state is RankState.FINISHED for r in self.record.ranks):
            return Outcome.SUCCEEDED, ""
        return Outcome.FAILED, "not every rank finished"

    def learned(self, last_line: int) -> AttemptRecord:
        """The attempt's record, complete: how it ended, and the run's count of output lines then (`last_line`)."""
        self.record.outcome, self.record.note = self.outcome()
        self.record.ended, self.record.last_line = self.clock(), last_line
        return self.record

    def snapshot(self) -> AttemptSnapshot:
        return AttemptSnapshot(
            self.number, self.outcome()[0], stop_asked=self._request.asked is not None, reader_failed=self.reader_failed
        )

    def refuse_restart(self) -> None:
        """The engine restarted its ranks itself, but the run ends: stop what it started."""
        after = self.engine.stop(list(range(self.spec.world_size)), failed=False)
        self._escalate_at = None if after is None else time.monotonic() + after

    # --- RunEvents: what the engine reports, from the reader thread -------------------------------------------
    def placed(self, rank: int, pid: int | None, node: str = "") -> None:
        record = self.record.ranks[rank]
        record.pid, record.started = pid, self.clock()
        record.node = node or record.node
        self._placed.add(rank)
        if len(self._placed) == len(self.record.ranks):
            self.watchdog.all_placed(time.monotonic())
        self.announcer.mark()

    def output(self, rank: int, stream: Stream, data: bytes) -> None:
        added, explained = self.logs.output(rank, stream, data)  # type: ignore[union-attr]
        if added:
            self.watchdog.stamp(rank)
            self.announcer.mark(turn=explained)

    def message(self, rank: int, message: msg.Message) -> None:
        """A rank's typed message, read by the handler its type has (`_HANDLERS`); an unknown type is ignored.
        Progress is stamped by the handlers (output in `output`): a stuck rank sends GPU memory and stacks too.
        What only feeds views and diagnostics is read `_aside`: a bug of ddpnb's there must not end the training.
        A metric is not: it is the user's own value, which the record promises to keep, and a step's progress."""
        self.announcer.mark(isinstance(message, (msg.Started, msg.Returned, msg.Failed, msg.Reply)))
        handler = self._HANDLERS.get(type(message))
        if handler is not None:
            handler(self, rank, message)

    def _metric(self, rank: int, message: msg.Metric) -> None:
        self.watchdog.stamp(rank)
        metrics = self.record.ranks[rank].metrics
        for name, value in message.values.items():
            series = metrics.get(name)
            if series is None:
                if self._spill is None:
                    self._spill = Spill()
                series = metrics[name] = Series(self._spill)
            series.add(message.step, message.time, value)

    def _output(self, rank: int, message: msg.Output) -> None:
        self.output(rank, Stream(message.stream), message.data)

    def _progress(self, rank: int, message: msg.Progress) -> None:
        self.watchdog.stamp(rank)
        with self._aside(rank, "progress bars"):
            self.record.ranks[rank].update_progress(message)

    def _gpu_memory(self, rank: int, message: msg.GpuMemory) -> None:
        with self._aside(rank, "GPU memory"):
            self.record.ranks[rank].gpu_memory = (message.reserved, message.peak)

    def _step_times(self, rank: int, message: msg.StepTimes) -> None:
        with self._aside(rank, "step times"):
            self.record.ranks[rank].add_step_times(message)
            self.watchdog.step_reported(self.record.ranks, message)

    def _hardware(self, rank: int, message: msg.Hardware) -> None:
        with self._aside(rank, "hardware samples"):
            self.record.ranks[rank].hardware.append(message)

    def _imported(self, rank: int, message: msg.Imported) -> None:
        with self._aside(rank, "import times"):
            self.record.hint = hints.preload_hint(message)

    def _started(self, rank: int, message: msg.Started) -> None:
        record = self.record.ranks[rank]
        record.state, record.device = RankState.RUNNING, message.device
        self.watchdog.stamp(rank)

    def _returned_message(self, rank: int, message: msg.Returned) -> None:
        self.watchdog.stamp(rank)
        self._returned.add(rank)
        if rank == 0:
            self.result.returned(message.payload, message.saved)

    def _reply(self, rank: int, message: msg.Reply) -> None:
        self.watchdog.stamp(rank)
        if self.channel is not None:
            self.channel.answered(message)  # released at the end of this read pass, after the output read with it

    def _profiled(self, rank: int, message: msg.Profiled) -> None:
        with self._aside(rank, "profile"):
            self.traces.add(message)

    def _prompt(self, rank: int, message: msg.Prompt) -> None:
        if self._stop is not None:  # every rank is being stopped: nobody is asked (the engine ends this one)
            return
        self.broker.prompted(rank, message)
        self.announcer.mark(turn=True)  # the waiting cell asks the front end at once

    @contextlib.contextmanager
    def _aside(self, rank: int | None, what: str) -> Iterator[None]:
        """Reading what only feeds views and diagnostics (`what`: rank `rank`'s "step times"; with no rank, what
        is done with every rank's: "judge the stragglers"): an error there is a bug of ddpnb's, said once an
        attempt in the rank's output and log (rank 0's), its traceback kept in the record; the run goes on."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - said and kept below: a view's data must not end the training
            if what in self._said:
                return
            self._said.add(what)
            doing, done = (
                (f"reading rank {rank}'s {what}", f"read rank {rank}'s {what}")
                if rank is not None
                else (f"trying to {what}", what)
            )
            self.record.internal_errors.append(bug_text(doing, exc))
            assert self.logs is not None  # open while the engine reports
            self.logs.say(
                rank or 0,
                f"could not {done} ({type(exc).__name__}: {exc}): a ddpnb bug, please report "
                "it with the run directory; the run goes on",
            )

    def _judge_stragglers(self, at_once: bool = False) -> None:
        with self._aside(None, "judge the stragglers"):
            self.watchdog.judge_stragglers(self.record.ranks, time.monotonic(), at_once)

    def queued(self, what: str, state: str) -> None:
        queued = self.record.queued
        if state:
            if queued is None or not queued.ongoing or queued.what != what:
                self.record.queued = Queued(what, state, since=self.clock())
            else:
                queued.state = state
        elif queued is not None and queued.ongoing:
            queued.until = self.clock()
        self.announcer.mark(turn=True)

    def _failed(self, rank: int, message: msg.Failed) -> None:
        self.record.ranks[rank].state = RankState.FAILED
        if message.exc_type == "SystemExit":
            summary = f"called sys.exit({message.message}) before its function returned"
        else:
            summary = f"{message.exc_type}: {message.message}" if message.message else message.exc_type
        # an error raised after ddpnb began stopping this rank (a SIGTERM handler that raises) is a consequence;
        # one raised before, but read after, is the rank's own
        knock_on = is_knock_on(message.exc_type, message.message) or message.time >= self._stopping.get(
            rank, float("inf")
        )
        frames = tuple(FrameLocals(*frame) for frame in message.frames)
        self.record.failures.append(Failure(rank, message.time, summary, message.traceback, knock_on, frames))
        self._begin_stop(Outcome.FAILED, f"rank {rank} raised {message.exc_type}")

    def exited(
        self, rank: int, exitcode: int | None, *, stopped: bool = False, cause: str = "", traceback: str = ""
    ) -> None:
        record = self.record.ranks[rank]
        self.announcer.mark(turn=True)
        record.exitcode, record.ended = exitcode, record.ended or self.clock()
        self.broker.withdraw([rank])  # a rank gone from its prompt waits for no answer
        if self.logs is not None:  # a rank that ended has its log whole on disk at once
            self.logs.flush(rank)
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
            self.record.failures.append(Failure(rank, self.clock(), cause, traceback))
            self.logs.explain_crash(rank)  # type: ignore[union-attr]
            self._begin_stop(Outcome.FAILED, f"rank {rank} {cause}")

    def quiet(self) -> bool:
        eager = self.channel is not None and self.channel.eager()
        return not eager and not self._returned and self._stop is None and self._request.asked is None

    def tick(self) -> None:
        if self.channel is not None:
            self.channel.release()
        if self.logs is not None and time.monotonic() >= self._flush_at:
            self._flush_at = time.monotonic() + FLUSH_EVERY
            self.logs.flush()
        self.broker.serve_stack_requests()  # asked for by other threads: collected in the reader's
        asked = self._request.asked
        if asked and self._stop is None:
            self._begin_stop(*asked)
        self._judge_stragglers()
        alarm = self.watchdog.check(
            time.monotonic(),
            self.record.ranks,
            self.record.stall,
            self._returned,
            armed=self._stop is None,
            held=bool(self.broker.waiting) or self.is_queued(),
        )
        if alarm is Alarm.TIMEOUT:
            self.record.at_timeout = self.diagnose(keep=True)  # the stacks stay in the record for its report
            self._begin_stop(Outcome.TIMED_OUT, f"stopped after the {self.watchdog.timeout:g} s timeout (--timeout)")
        elif alarm is Alarm.STALL:
            self.record.stall = Stall(
                since=self.watchdog.last_progress(),
                threshold=self.watchdog.stall.threshold(),
                diagnosis=self.diagnose(),
            )
            self.announcer.mark(turn=True)
        elif alarm is Alarm.STILL_STALLED and self.record.stall is not None:
            # where each rank is now, for the views' stacks; the flight recorder's summary is the stall's first
            stall = self.record.stall
            stall.diagnosis = dataclasses.replace(self.diagnose(recorder=False), flight=stall.diagnosis.flight)
            self.announcer.mark(turn=True)
        elif alarm is Alarm.RESUMED and self.record.stall is not None:
            self.record.stall.resumed = self.clock()
            self.announcer.mark(turn=True)
        if self._escalate_at is not None and time.monotonic() > self._escalate_at:
            after = self.engine.escalate()
            self._escalate_at = None if after is None else time.monotonic() + after
        self.announcer.maybe()  # output at most once an `announce_every`, however it floods in; a turn at once

    # --- stopping and stacks ------------------------------------------------------------------------------------
    def _begin_stop(self, outcome: Outcome, note: str) -> None:
        if self._stop is not None:
            return
        self._stop = (outcome, note)
        self.announcer.mark(turn=True)
        if self.state is not AttemptState.RUNNING:  # the engine has ended already (its own account of the ranks)
            return
        self.state = AttemptState.STOPPING
        going = [
            r.rank
            for r in self.record.ranks
            if r.exitcode is None and r.ended is None and r.state is not RankState.FAILED
        ]  # a failed rank exits by itself
        now = self.clock()
        for rank in going:
            self._stopping.setdefault(rank, now)
        self.broker.withdraw(going)  # a rank being stopped is asked nothing more: its prompt goes with it
        after = self.engine.stop(going, failed=outcome is Outcome.FAILED)
        self._escalate_at = None if after is None else time.monotonic() + after

    def diagnose(self, keep: bool = False, recorder: bool = True) -> Diagnosis:
        """Where every rank is now: its stack (`keep`: left in the record, as a timeout's report shows them) and,
        on NCCL runs whose ranks write into the run directory, its flight recorder (unless not `recorder`)."""
        running = [r.rank for r in self.record.ranks if r.state in _RUNNING]
        recorder = recorder and self.spec.backend == "nccl" and self.capabilities.shares_run_dir
        asked = flight.request(self.spec.run_dir, running) if recorder else 0.0  # dumped while the stacks come
        stacks = self.broker.collect_stacks(running)
        if keep:
            for rank, stack in stacks.items():
                kept = self.record.ranks[rank]
                kept.stack, kept.stalled_state = stack, kept.state
        recorded = flight.summarise(flight.collect(self.spec.run_dir, running, asked), running) if recorder else []
        return diagnose(self.record.ranks, stacks, self.watchdog.active, self._returned, recorded)

    def is_queued(self) -> bool:
        return self.record.queued is not None and self.record.queued.ongoing

    def running_ranks(self) -> list[int]:
        return [r.rank for r in self.record.ranks if r.state in _RUNNING]

    _HANDLERS: ClassVar[dict[type, Callable[[Attempt, int, Any], None]]] = {
        msg.Metric: _metric,
        msg.Output: _output,
        msg.Progress: _progress,
        msg.GpuMemory: _gpu_memory,
        msg.StepTimes: _step_times,
        msg.Hardware: _hardware,
        msg.Imported: _imported,
        msg.Started: _started,
        msg.Returned: _returned_message,
        msg.Reply: _reply,
        msg.Failed: _failed,
        msg.Profiled: _profiled,
        msg.Prompt: _prompt,
    }


class CurrentAttempt:
    """The events an engine reports to (`RunEvents`), bound to the attempt running now: an engine that restarts
    its ranks itself keeps reporting to one object while the run puts the next attempt behind it (`restarted`)."""

    def __init__(self, attempt: Attempt, restarted: Callable[[], None]) -> None:
        self.restarted = restarted
        self.retarget(attempt)

    def retarget(self, attempt: Attempt) -> None:
        # bound methods, not forwarding calls: an event costs what it cost before there were several attempts
        self.attempt = attempt
        self.placed, self.message, self.output = attempt.placed, attempt.message, attempt.output
        self.queued = attempt.queued
        self.exited, self.tick, self.quiet = attempt.exited, attempt.tick, attempt.quiet
