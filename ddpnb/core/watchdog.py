"""One attempt's clocks: its timeout and the stall doctor behind one `check(now)`, and the straggler radar's pace.

The watchdog decides and the attempt acts: `check` says what it found (`Alarm`), and the attempt takes the stacks,
writes the record and stops the ranks. Progress is stamped with the reader's clock, read once a pass.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from ddpnb.core.messages import StepTimes
from ddpnb.core.record import RankRecord, RankState, Stall
from ddpnb.core.stall import StallWatch
from ddpnb.core.stragglers import Arrivals, flag_stragglers

RADAR_INTERVAL = 0.5  # seconds between two straggler verdicts while compute reports arrive
STALL_REFRESH = 5.0  # seconds to the first look again at where each rank is while the run stays stalled
STALL_REFRESH_MAX = 60.0  # ... each look then waits twice as long as the one before, up to this
_RUNNING = (RankState.STARTING, RankState.RUNNING)


class Alarm(enum.Enum):
    """What the watchdog found at a check."""

    TIMEOUT = "timeout"  # the attempt ran past --timeout
    STALL = "stall"  # no rank made progress for the stall threshold (since `last_progress()`)
    RESUMED = "resumed"  # a rank made progress again after a stall
    STILL_STALLED = "still stalled"  # STALL_REFRESH seconds since the last look at a stall that goes on


class Watchdog:
    """Watches one attempt's clocks and says what is due (`check(now)` -> `Alarm`); the attempt acts on it.
    `timeout`: seconds an attempt may run (None: no limit); `stall`: --stall's seconds (None: adaptive, 0: off);
    `paused()`: whether waiting is the ranks' job just now (a session between commands), so quiet is no stall."""

    def __init__(
        self, world_size: int, timeout: float | None, stall: float | None, paused: Callable[[], bool] = lambda: False
    ) -> None:
        self.timeout = timeout
        self.stall = StallWatch(world_size, stall)
        self.active = self.stall.active  # each rank's latest progress, on the reader's clock
        self.paused = paused
        self.clock = time.monotonic()  # the reader's clock, read once a pass: what `stamp` stores
        self.started = self.clock
        self._stalled_latest = 0.0  # the run's latest progress when the ongoing stall began
        self._looked_at = 0.0  # when the ongoing stall's ranks were last looked at
        self._refresh = STALL_REFRESH  # seconds until the next look
        self._radar_due = False
        self._arrivals = Arrivals()
        self._radar_at = 0.0
        self._held_at: float | None = None  # since when a rank has been at a debugger prompt

    def begin(self) -> None:
        """The ranks are up: the timeout counts from now, and their start was no quiet spell of theirs."""
        self.started = time.monotonic()
        self.stall.idle(self.started)

    def all_placed(self, now: float) -> None:
        """Every rank's process exists (on a cluster: forked once its node had imported torch, one node after
        another): waiting for the last was the launch's, no rank's stall. The timeout still counts from `begin`."""
        self.stall.idle(now)

    def stamp(self, rank: int) -> None:
        """The rank made progress (output, a metric, a progress tick, an answer)."""
        self.active[rank] = self.clock

    def step_reported(self, ranks: list[RankRecord], report: StepTimes) -> None:
        """A rank reported a step (its compute, its collectives): judged at the next check, at most once a
        RADAR_INTERVAL."""
        self._arrivals.add(ranks, report)
        self._radar_due = True

    def judge_stragglers(self, ranks: list[RankRecord], now: float, at_once: bool = False) -> None:
        """The radar's verdict on the steps reported since the last, at most once a RADAR_INTERVAL (unless
        `at_once`); the attempt asks each pass, apart from `check`: a bug in it must not stop the clocks."""
        if self._radar_due and (at_once or now - self._radar_at >= RADAR_INTERVAL):
            self._radar_due, self._radar_at = False, now
            flag_stragglers(ranks)

    def last_progress(self) -> float:
        """When (`time.time()`) any rank last made progress, as of the last check."""
        return time.time() - (time.monotonic() - self.stall.latest)

    def check(
        self,
        now: float,
        ranks: list[RankRecord],
        stall: Stall | None,
        returned: set[int],
        armed: bool = True,
        held: bool = False,
    ) -> Alarm | None:
        """What the clocks say at `now` (monotonic). `armed`: False once the attempt is stopping (nothing is due
        then). `held`: a rank is at a debugger prompt: neither the timeout's clock runs meanwhile nor is anyone's
        waiting a stall."""
        self.clock = now
        if held:
            self._held_at = self._held_at or now
            self.stall.idle(now)
            return None
        if self._held_at is not None:
            self.started += now - self._held_at
            self._held_at = None
        if not armed:
            return None
        if self.timeout and now - self.started > self.timeout:
            return Alarm.TIMEOUT
        if not self.stall.enabled:
            return None
        quiet = self.stall.update(now)
        if stall is not None and stall.ongoing:
            if self.stall.latest > self._stalled_latest:
                return Alarm.RESUMED
            if now - self._looked_at < self._refresh:
                return None
            # each look stops the reader a moment and signals every rank: less often the longer the stall lasts
            self._looked_at, self._refresh = now, min(2 * self._refresh, STALL_REFRESH_MAX)
            return Alarm.STILL_STALLED
        if self.paused():
            self.stall.idle(now)
            return None
        if quiet <= self.stall.threshold() or not any(r.state in _RUNNING and r.rank not in returned for r in ranks):
            return None
        self._stalled_latest, self._looked_at, self._refresh = self.stall.latest, now, STALL_REFRESH
        return Alarm.STALL
