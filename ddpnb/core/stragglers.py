"""The straggler radar's verdict, kernel side: the rank the others wait for.

Every rank reports the same steps (`rank/radar.py`), each with the collectives it issued in that step and when,
from torch's Flight Recorder. At each collective, a rank that arrives after the others makes them wait: its
lateness is its arrival less the median of the other ranks' arrivals, and a step's is its largest over the step's
collectives (DDP's buckets of one backward pass are all late by the same delay: counted once). A rank is flagged
when its typical lateness over the recent steps is both over an absolute floor and a share of the step.
"""

from __future__ import annotations

import statistics

from ddpnb.core.messages import StepTimes
from ddpnb.core.record import RankRecord

MIN_SAMPLES = 3  # steps every rank reported before anyone is judged
FLOOR = 0.005  # seconds a step the others wait for a rank, below which it is not flagged (noise)
SHARE = 0.10  # of the rank's step time, below which it is not flagged either
PENDING_STEPS = 64  # reported steps kept while the other ranks' reports of them are on their way


class Arrivals:
    """Each reported step's collectives, kept until every rank's report of that step has come; then each rank's
    lateness at it goes to its record (`RankRecord.late`)."""

    def __init__(self) -> None:
        self.pending: dict[int, dict[int, tuple[tuple[str, int, int], ...]]] = {}

    def add(self, ranks: list[RankRecord], report: StepTimes) -> None:
        if not report.arrivals or len(ranks) < 2:  # one rank waits for nobody
            return
        reports = self.pending.setdefault(report.step, {})
        reports[report.rank] = report.arrivals
        if len(reports) < len(ranks):
            while len(self.pending) > PENDING_STEPS:
                del self.pending[min(self.pending)]
            return
        # each rank reports its steps in order: an earlier step some rank left out will not complete now
        for step in [step for step in self.pending if step <= report.step]:
            del self.pending[step]
        for rank, late in lateness(reports).items():
            ranks[rank].late.append(late)


def lateness(reports: dict[int, tuple[tuple[str, int, int], ...]]) -> dict[int, float]:
    """Seconds each rank came after the median of the others, at worst over the collectives every rank reported
    (a subgroup's, or one cut off a report, are left out); no entry where no collective was common to all."""
    issued: dict[tuple[str, int], dict[int, int]] = {}
    for rank, arrivals in reports.items():
        for group, number, ns in arrivals:
            issued.setdefault((group, number), {})[rank] = ns
    late: dict[int, float] = {}
    for times in issued.values():
        if len(times) < max(len(reports), 2):
            continue
        ordered = sorted(times.items(), key=lambda item: item[1])  # once: at 1,024 ranks a median per rank was 1 s
        values = [ns for _, ns in ordered]
        for index, (rank, ns) in enumerate(ordered):
            late[rank] = max(late.get(rank, 0.0), (ns - _median_without(values, index)) / 1e9)
    return late


def _median_without(values: list[int], index: int) -> float:
    """The median of sorted `values` but the one at `index`."""
    rest = len(values) - 1

    def at(position: int) -> int:  # the position-th of the others
        return values[position if position < index else position + 1]

    middle = rest // 2
    return float(at(middle)) if rest % 2 else (at(middle - 1) + at(middle)) / 2


def flag_stragglers(ranks: list[RankRecord]) -> None:
    """Flag each rank the others wait for at least FLOOR seconds and SHARE of a step, typically (the median over
    its recent reported steps)."""
    for rank in ranks:
        rank.holds_others = None
        late, step = list(rank.late), rank.step_time
        if len(ranks) < 2 or len(late) < MIN_SAMPLES or step is None:
            continue
        held = statistics.median(late)
        if held >= FLOOR and held >= SHARE * step:
            rank.holds_others = held
