"""The running rank's link to the kernel and what it knows of itself; `ddpnb.log` and `ddpnb.device` read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ddpnb.core.messages import Message
from ddpnb.core.spec import WorkerSpec
from ddpnb.rank.radar import StepClock


class Link(Protocol):
    """How a rank's messages reach the kernel: a pipe (local) or the run actor (Ray)."""

    def send(self, message: Message) -> None: ...

    def receive(self) -> bytes | None:
        """Sessions: the next command from the kernel, None once the kernel will send no more."""

    def flush(self) -> None:
        """Sessions: what the rank printed so far reaches the kernel ahead of what is sent next."""

    def send_metric(self, step: int | None, values: dict[str, float]) -> None:
        """`ddpnb.log`'s path, inside the training step: what `send(Metric(...))` sends, as cheaply as possible."""


class CheckpointHooks(Protocol):
    """An engine's own checkpoint bookkeeping next to ddpnb's (Ray Train: `ray.train.report`, `get_checkpoint`)."""

    def saved(self, step: int, path: Path) -> None:
        """Every rank, once the checkpoint of `step` at `path` is complete (a collective)."""

    def latest(self) -> Path | None:
        """Rank 0: the engine's latest complete checkpoint, read ahead of ddpnb's own listing; None if none."""


@dataclass
class RankContext:
    rank: int
    link: Link
    device: str = "cpu"
    store: Any = None  # the store every process group of this run rendezvouses on
    store_uses: int = 0  # process groups made on it so far (each gets its own key prefix)
    suggests_preload: bool = True  # rank 0 reports slow imports (`ddpnb.preload` applies to this engine)
    spec: WorkerSpec | None = None  # the run's spec, once unpickled (its attempt, its checkpoint directories)
    clock: StepClock = field(default_factory=StepClock)  # the straggler radar's compute per step
    checkpoints: CheckpointHooks | None = None  # the engine's own checkpoint bookkeeping, where it has one
    profiler: Any = None  # --profile's window over the steps (`rank.profile.StepWindow`), only when asked for

    def send(self, message: Message) -> None:
        self.link.send(message)

    def send_metric(self, step: int | None, values: dict[str, float]) -> None:
        self.link.send_metric(step, values)
        if step is not None:
            times = self.clock.tick(self.rank, step)
            if times is not None:
                self.link.send(times)
            if self.profiler is not None:
                self.profiler.at_step(step)


_current: RankContext | None = None


def current() -> RankContext | None:
    """This rank's context; None outside a rank (in the notebook, in a plain script)."""
    return _current


def enter(context: RankContext | None) -> None:
    global _current
    _current = context


def device() -> str:
    return _current.device if _current is not None else "cpu"


def attempt() -> int:
    return _current.spec.attempt if _current is not None and _current.spec is not None else 0
