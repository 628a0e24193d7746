"""A session's command channel: commands out to running ranks through the engine, their answers back.

`Session` owns it; the run only holds it, and its attempt hands it each `Reply` it reads. An answer is released
once the read pass that brought it is over, so the output a rank wrote before answering has been read by then.
"""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING

from ddpnb.core import messages as msg

if TYPE_CHECKING:
    from ddpnb.core.data import Shipment
    from ddpnb.core.engine import Engine

EAGER = 1.0  # seconds after a command during which the engine reads without pausing (a quick answer)


class CommandChannel:
    """Commands out to a session's ranks and their answers back, released after the read pass that brought them."""

    def __init__(self) -> None:
        self.engine: Engine | None = None  # the running attempt's (set as it starts)
        self.replies: queue.SimpleQueue[msg.Reply] = queue.SimpleQueue()
        self.awaiting: set[int] = set()  # the ranks whose answer to a command is awaited
        self._answers: list[msg.Reply] = []
        self._sent_at = 0.0

    def send(self, ranks: list[int], command: bytes, shipment: Shipment | None = None) -> None:
        """Deliver a command to `ranks`; their `Reply` messages arrive in `replies`."""
        self._sent_at = time.monotonic()
        self.awaiting.update(ranks)
        assert self.engine is not None
        self.engine.send(ranks, command, shipment)

    def interrupt(self, ranks: list[int]) -> None:
        assert self.engine is not None
        self.engine.interrupt(ranks)

    def answered(self, reply: msg.Reply) -> None:
        """From the reader thread: held until `release`."""
        self.awaiting.discard(reply.rank)
        self._answers.append(reply)

    def release(self) -> None:
        answers, self._answers = self._answers, []
        for answer in answers:
            self.replies.put(answer)

    def eager(self) -> bool:
        return time.monotonic() - self._sent_at < EAGER

    def idle(self) -> bool:
        """No answer is awaited: waiting is the ranks' job, not a stall."""
        return not self.awaiting
