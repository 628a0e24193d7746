"""The one owner of restarts: a policy that decides from a frozen snapshot of the attempt that ended.

Whoever decides does not act: the run acts on the decision (`Run._serve`), and an engine that restarts its ranks
itself (Ray Train's FailureConfig) is only told, at start, how many restarts it may make (`restarts_left`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ddpnb.core.record import Outcome


class Decision(enum.Enum):
    """What the policy decided after an attempt ended."""

    RESTART = "restart"  # keep the attempt in the record and start every rank again, fresh
    END = "end"  # the run ends with this attempt's outcome


@dataclass(frozen=True)
class AttemptSnapshot:
    """How an attempt ended, as the policy sees it."""

    number: int  # 0 for the first attempt
    outcome: Outcome
    stop_asked: bool  # an interrupt or `stop()` asked the run to end
    reader_failed: bool = False  # ddpnb's own handling of the ranks raised: a bug, which a restart would meet again


class RestartPolicy:
    """`--max-restarts N`: an attempt that failed or timed out is followed by a fresh one, N times at most; an
    interrupt, `stop()` or a bug of ddpnb's never restarts."""

    RESTARTABLE = (Outcome.FAILED, Outcome.TIMED_OUT)

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts

    def restarts_left(self, number: int, stop_asked: bool = False) -> int:
        """Restarts still allowed after attempt `number`."""
        return 0 if stop_asked else max(0, self.max_restarts - number)

    def decide(self, snapshot: AttemptSnapshot) -> Decision:
        if (
            snapshot.outcome in self.RESTARTABLE
            and not snapshot.reader_failed
            and self.restarts_left(snapshot.number, snapshot.stop_asked)
        ):
            return Decision.RESTART
        return Decision.END
