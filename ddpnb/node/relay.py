"""A node's forked ranks' events (`RunEvents`), queued for the process that forwards them to the kernel: a Ray
node's host (`engines/ray/host.py`, long-polled by the kernel) or a Slurm node's (`remote/host.py`, which
sends each batch on its connection). Both forward the same batches, so both keep the local engine's order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ddpnb.core.channel import EAGER
from ddpnb.core.spec import Stream

if TYPE_CHECKING:  # the kernel's side only: a node's host never replays
    from ddpnb.core.engine import RunEvents

HOLD_BYTES = 64 << 20  # the events a node holds for the kernel before its reader waits for the kernel to take them
EVENT_BYTES = 256  # what an event but output is counted as, whatever it holds

Event = tuple[Any, ...]  # ("placed", rank, pid) | ("output", rank, stream, data) | ("message", rank, message)
# | ("exited", rank, exitcode, stopped)


class Relay:
    """The forked ranks' events (`RunEvents`), queued for the kernel's next `drain`. Events become visible at the
    end of each read pass (`tick`), as the local engine announces them: an answer never overtakes the output its
    rank wrote before it. A kernel that takes them slower than the ranks write holds the reader back once
    `hold_bytes` wait: the ranks' pipes fill and their writes wait, as on the local engine, instead of this
    node's memory filling."""

    def __init__(self, hold_bytes: int = HOLD_BYTES) -> None:
        self.lock = threading.Condition()
        self._reading: list[Event] = []  # this read pass's events
        self._ready: list[Event] = []  # passes over, not drained yet
        self._reading_bytes = self._ready_bytes = 0
        self.hold_bytes = hold_bytes
        self.done = False
        self.abandoned = False  # the kernel takes nothing more: the reader never waits for it
        self.commanded = 0.0  # when the kernel last sent a command: answers are awaited

    def placed(self, rank: int, pid: int | None, node: str = "") -> None:
        self._put(("placed", rank, pid))

    def message(self, rank: int, message: Any) -> None:
        self._put(("message", rank, message))

    def output(self, rank: int, stream: Stream, data: bytes) -> None:
        self._put(("output", rank, stream, data))

    def exited(
        self, rank: int, exitcode: int | None, *, stopped: bool = False, cause: str = "", traceback: str = ""
    ) -> None:
        self._put(("exited", rank, exitcode, stopped))

    def restarted(self) -> None:
        """Forked ranks are never restarted by their engine: a restart is the run's new attempt."""

    def tick(self) -> None:
        with self.lock:
            if self._reading:
                self._ready += self._reading
                self._ready_bytes += self._reading_bytes
                self._reading, self._reading_bytes = [], 0
                self.lock.notify_all()
            self.lock.wait_for(lambda: self._ready_bytes < self.hold_bytes or self.abandoned)

    def abandon(self) -> None:
        """The host is closing: its reader waits for no kernel any more."""
        with self.lock:
            self.abandoned = True
            self.lock.notify_all()

    def quiet(self) -> bool:
        return time.monotonic() - self.commanded > EAGER

    def finish(self) -> None:
        with self.lock:
            self._ready += self._reading
            self._reading, self.done = [], True
            self.lock.notify_all()

    def take(self, wait: float) -> tuple[list[Event], bool]:
        """What is ready, once something is or after `wait` seconds; and whether the ranks' reader is done."""
        with self.lock:
            self.lock.wait_for(lambda: self._ready or self.done, timeout=wait)
            batch, self._ready, self._ready_bytes = self._ready, [], 0
            self.lock.notify_all()  # a reader held back goes on
            return batch, self.done and not self._reading

    def _put(self, event: Event) -> None:
        with self.lock:
            self._reading.append(event)
            self._reading_bytes += len(event[3]) if event[0] == "output" else EVENT_BYTES


def replay(
    batch: list[Event],
    events: RunEvents,
    node: str,
    exited: Callable[[int, int | None, bool], None],
    placed: Callable[[int, int | None], None] | None = None,
) -> None:
    """A relayed batch played into the kernel's `events`, in order, as the local engine would have reported it:
    ranks placed on `node` (then `placed`, for the engine's own word on it); each exit through `exited(rank,
    exitcode, stopped)`, which the engine words (a crash on its node, which ranks it counts as gone)."""
    for kind, rank, *rest in batch:
        if kind == "output":
            events.output(rank, *rest)
        elif kind == "message":
            events.message(rank, *rest)
        elif kind == "placed":
            events.placed(rank, rest[0], node)
            if placed is not None:
                placed(rank, rest[0])
        elif kind == "exited":
            exited(rank, *rest)
