"""The straggler radar's verdict, kernel side: which ranks spend markedly more compute per step than the others
(`rank/radar.py` measures it on the ranks)."""

from __future__ import annotations

import statistics

from ddpnb.core.record import RankRecord

STRAGGLER_RATIO = 1.25  # compute per step, against the median of the other ranks', that flags a rank


def flag_stragglers(ranks: list[RankRecord]) -> None:
    """Flag each rank whose compute per step is at least STRAGGLER_RATIO times the median of the other ranks'."""
    computes = {r.rank: c for r in ranks if (c := r.compute_per_step) is not None}
    ordered = sorted(computes.values())
    for rank in ranks:
        mine = computes.get(rank.rank)
        rank.slower_by = None
        if mine is None or len(ordered) < 2:
            continue
        others = list(ordered)
        others.remove(mine)
        median = statistics.median(others)
        if median > 0 and mine >= STRAGGLER_RATIO * median:
            rank.slower_by = mine / median - 1
