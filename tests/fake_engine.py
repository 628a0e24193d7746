"""A scripted engine: ranks played as data, so that the core, the restart policy, the watchdog and the views are
tested in milliseconds, without a process, and the engine contract (tests/test_engine_contract.py) has a case that
plays every promise from a script.

A script is a story, played by `serve` in order: rank 0 is placed, starts, logs steps 1..3, rank 1 fails, and so
on. Each step may wait first (`after`), or wait for the test (`Gate`: a handshake, not a sleep). A rank the script
never places is placed at `start`, as the local engine's are; a rank the script never ends runs until the attempt
stops it, and a stopped rank says nothing more. It is registered for the tests only, through the `ddpnb.engines`
entry point group, as another package's engine is (tests/engines/, put on the path by conftest.py).

    ddpnb.launch(fn, engine="fake", nprocs=2, view="none", script=Script([
        started(0), started(1), metric(0, 1, loss=0.9), Print(0, "step 1"),
        failed(1, "ValueError", "bad batch", after=0.1), Exit(1, 1),
    ]))
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import cloudpickle

from ddpnb.core import messages as msg
from ddpnb.core.engine import AttemptStart, Capabilities, Flag, RunEvents
from ddpnb.core.spec import LaunchError, Plan, Stream, WorkerSpec

TICK = 0.01  # seconds between two passes of the fake's loop (each one a `tick` of the attempt)
SIGTERM_EXIT, SIGKILL_EXIT = -15, -9  # how a stopped rank's exit reads, as a real one's does
NODE = "fake"

_open: set[FakeEngine] = set()  # engines started and not closed yet: the contract's "close leaves nothing"


def open_engines() -> list[FakeEngine]:
    return list(_open)


# --- the steps of a script ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One thing that happens; `after`: seconds to wait once the step before it has happened."""

    after: float = field(default=0.0, kw_only=True)


@dataclass(frozen=True)
class Place(Step):
    """The rank's process exists: scripting it keeps `start` from placing the rank (placed late, as after a queue)."""

    rank: int
    node: str = NODE


@dataclass(frozen=True)
class Send(Step):
    """A message the rank sends (`started`, `metric`, `returned`, `failed` build the usual ones)."""

    rank: int
    message: msg.Message


@dataclass(frozen=True)
class Print(Step):
    """Text the rank writes to its stdout or stderr (a line unless it says otherwise: end it with "\\n")."""

    rank: int
    text: str
    stream: Stream = Stream.STDOUT


@dataclass(frozen=True)
class Exit(Step):
    """The rank's process ends with `code` (None: unknown), by itself; `cause` says why where the engine knows
    better than the code (a lost node)."""

    rank: int
    code: int | None = 0
    cause: str = ""
    traceback: str = ""


@dataclass(frozen=True)
class Queue(Step):
    """The ranks wait in the cluster's queue (`state` '': they no longer wait)."""

    what: str
    state: str


@dataclass(frozen=True)
class Gate(Step):
    """Nothing more happens until the test sets `event` (or the attempt stops every rank)."""

    event: threading.Event


def _rank(step: Step) -> int | None:
    return getattr(step, "rank", None)


def started(rank: int, device: str = "cpu", after: float = 0.0) -> Send:
    return Send(rank, msg.Started(rank, device), after=after)


def metric(rank: int, step: int | None, after: float = 0.0, **values: float) -> Send:
    return Send(rank, msg.Metric(rank, step, time.time(), values), after=after)


def returned(rank: int, value: Any = None, after: float = 0.0) -> Send:
    """The function returned `value`; only rank 0's travels, pickled, as on every engine without shared memory."""
    return Send(rank, msg.Returned(rank, cloudpickle.dumps(value) if rank == 0 else None), after=after)


def failed(rank: int, exc_type: str, message: str, traceback: str = "", after: float = 0.0) -> Send:
    traceback = (
        traceback or f'Traceback (most recent call last):\n  File "<cell>", line 1, in fn\n{exc_type}: {message}'
    )
    return Send(rank, msg.Failed(rank, time.time(), exc_type, message, traceback), after=after)


def finishes(rank: int, value: Any = None) -> list[Step]:
    """The rank starts, returns `value` and exits 0."""
    return [started(rank), returned(rank, value), Exit(rank, 0)]


def raises(rank: int, exc_type: str, message: str) -> list[Step]:
    """The rank starts, raises and exits 1, as a rank whose function raised does."""
    return [started(rank), failed(rank, exc_type, message), Exit(rank, 1)]


@dataclass(frozen=True)
class Script:
    """One attempt's story. `stacks`: what `collect_stacks` answers for each running rank; `stop_after`: what
    `stop` returns (seconds until `escalate`); `ignores_stop`: ranks that end only at `escalate`, as a rank that
    ignores SIGTERM does."""

    steps: Sequence[Step] = ()
    stacks: Mapping[int, str] = field(default_factory=dict)
    stop_after: float | None = None
    ignores_stop: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "ignores_stop", frozenset(self.ignores_stop))
        if self.ignores_stop and self.stop_after is None:
            raise ValueError("ranks that ignore the stop end only at escalate: give stop_after too")


def every_rank_finishes(world_size: int, value: Any = None) -> Script:
    return Script([step for rank in range(world_size) for step in finishes(rank, value if rank == 0 else None)])


# --- the engine --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FakeOptions:
    """`script`: one Script, or one per attempt (the last one again for later attempts); None: every rank
    finishes, returning None."""

    script: Script | Sequence[Script] | None = None

    def for_attempt(self, attempt: int, world_size: int) -> Script:
        if self.script is None:
            return every_rank_finishes(world_size)
        if isinstance(self.script, Script):
            return self.script
        return self.script[min(attempt, len(self.script) - 1)]


class FakeType:
    """The fake engine before a run: no GPUs, no processes, nothing of the kernel's environment."""

    name: ClassVar[str] = "fake"
    capabilities: ClassVar[Capabilities] = Capabilities(stop_wait=5.0)  # announced as often as a real engine
    Options: ClassVar[type] = FakeOptions
    flags: ClassVar[list[Flag]] = []

    def check(self, options: FakeOptions) -> None:
        scripts = (
            [options.script] if isinstance(options.script, Script) or options.script is None else list(options.script)
        )
        if not scripts or not all(script is None or isinstance(script, Script) for script in scripts):
            raise LaunchError(f"script must be a Script or a list of them (one per attempt), not {options.script!r}")

    def shipment(self) -> None:
        return None

    def gpus_available(self) -> int | None:
        return 0

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        return dict(env)

    def torch_threads(self, plan: Plan, environ: dict[str, str]) -> int | None:
        return None

    def create(self, spec: WorkerSpec, options: FakeOptions) -> FakeEngine:
        return FakeEngine(spec, options.for_attempt(spec.attempt, spec.world_size))


class FakeEngine:
    """One attempt's ranks, played from `script`: the events a real engine would report, in the script's order."""

    def __init__(self, spec: WorkerSpec, script: Script) -> None:
        self.spec = spec
        self.script = script
        self.world_size = spec.world_size
        self._events: RunEvents | None = None
        self._alive: set[int] = set()  # placed or not, not ended
        self._terminating: set[int] = set()  # asked to stop, ending at the next pass (unless they ignore it)
        self._killing: set[int] = set()  # escalated: ending at the next pass, whatever they do
        self.stops: list[tuple[list[int], bool]] = []  # what the attempt asked, in order (stop's arguments)
        self.escalations = 0

    def start(self, events: RunEvents, start: AttemptStart) -> None:
        if any(not 0 <= (_rank(step) or 0) < self.world_size for step in self.script.steps):
            raise LaunchError(f"the script names a rank outside 0..{self.world_size - 1}")
        self._events = events
        self._alive = set(range(self.world_size))
        _open.add(self)
        scripted = {step.rank for step in self.script.steps if isinstance(step, Place)}
        for rank in range(self.world_size):
            if rank not in scripted:
                events.placed(rank, None, NODE)

    def serve(self) -> None:
        events = self._events
        assert events is not None, "the engine was not started"
        steps = deque(self.script.steps)
        due = time.monotonic() + (steps[0].after if steps else 0)
        while self._alive:
            while steps and time.monotonic() >= due:
                if self._waits_at(steps[0]):
                    due = time.monotonic()  # what follows a gate is timed from its opening
                    break
                self._play(events, steps.popleft())
                due += steps[0].after if steps else 0  # from when the step was due: a pass plays all that are
            for rank in sorted(self._killing | (self._terminating - self.script.ignores_stop)):
                self._end(events, rank, SIGKILL_EXIT if rank in self._killing else SIGTERM_EXIT, stopped=True)
            events.tick()
            time.sleep(TICK)

    def _waits_at(self, step: Step) -> bool:
        stopping = self._terminating | self._killing
        return isinstance(step, Gate) and not step.event.is_set() and not (self._alive <= stopping)

    def _play(self, events: RunEvents, step: Step) -> None:
        rank = _rank(step)
        if rank is not None and (rank not in self._alive or rank in self._terminating | self._killing):
            return  # an ended or stopped rank says nothing more
        if isinstance(step, Place):
            events.placed(step.rank, None, step.node)
        elif isinstance(step, Send):  # a message's own time is when it is sent, not when the script was written
            message = step.message
            events.message(step.rank, replace(message, time=time.time()) if hasattr(message, "time") else message)
        elif isinstance(step, Print):
            events.output(
                step.rank, step.stream, (step.text if step.text.endswith("\n") else step.text + "\n").encode()
            )
        elif isinstance(step, Exit):
            self._end(events, step.rank, step.code, cause=step.cause, traceback=step.traceback)
        elif isinstance(step, Queue):
            events.queued(step.what, step.state)

    def _end(
        self,
        events: RunEvents,
        rank: int,
        code: int | None,
        stopped: bool = False,
        cause: str = "",
        traceback: str = "",
    ) -> None:
        self._alive.discard(rank)
        self._terminating.discard(rank)
        self._killing.discard(rank)
        events.exited(rank, code, stopped=stopped, cause=cause, traceback=traceback)
        for stream in Stream:  # its pipes read to their end after the exit, as the local engine's are
            events.output(rank, stream, b"")

    def stop(self, ranks: list[int], failed: bool) -> float | None:
        self.stops.append((list(ranks), failed))
        self._terminating |= set(ranks) & self._alive
        return self.script.stop_after

    def escalate(self) -> float | None:
        self.escalations += 1
        self._killing |= self._terminating & self._alive
        return None

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        return {rank: self.script.stacks[rank] for rank in ranks if rank in self.script.stacks and rank in self._alive}

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        raise NotImplementedError("the fake engine has no command channel (Capabilities.commands is False)")

    def interrupt(self, ranks: list[int]) -> None:
        raise NotImplementedError("the fake engine has no command channel (Capabilities.commands is False)")

    def close(self) -> None:
        self._alive.clear()
        self._events = None
        _open.discard(self)
