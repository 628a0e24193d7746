"""Many ranks at a glance: from GROUP_FROM ranks up, every view groups the ranks and names the exceptions.

A 1,024-rank run reads as a 4-rank one does only if nothing is said once per rank: the summary table says each
state once with its ranks and their typical figures (the failed first, then the stalled), and names the few ranks
that stand out (the slowest and fastest, the stragglers the others wait for); the stall doctor says each place
ranks wait once (at most MAX_GROUPS places, one stack each); rank lists read as ranges, or as everyone but the
few (`ranks 0-1023 but 17`). Below GROUP_FROM every view is as it always was, a row and a line per rank. Plain
data and its words, for every view (`core.report` words the rest).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ddpnb.core.record import Diagnosis, RankRecord, RankWhere, RunRecord
from ddpnb.core.words import format_duration, size_text

GROUP_FROM = 32  # ranks from which views group them: a table of 32 rows and its header is a screen already
RANGES_FROM = 8  # ranks in one list from which it is said as ranges ('ranks 0-16,18-63'), not one by one
MAX_GROUPS = 10  # places the stall doctor names at most; the rest are counted as elsewhere
EXTREMES = 3  # the slowest and fastest ranks named under a grouped table, where one is SPREAD off the median
SPREAD = 0.05
BUT_AT_MOST = 4  # `ranks 0-1023 but 17`: everyone but at most this many
WORDS_LIMIT = 60  # characters a list of ranks takes at most: past it, its first ranges and the count


def grouped(world_size: int) -> bool:
    return world_size >= GROUP_FROM


def ranges(ranks: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs)


def ranks_words(ranks: Sequence[int], world_size: int, limit: int = WORDS_LIMIT) -> str:
    """The ranks as ranges, or, when they are nearly everyone, as everyone but the few: '0-1023 but 17, 300'; past
    `limit` characters, the first ranges and the count: '0-7,16-31,40-71,… (1,016 ranks)'."""
    listed = ranges(ranks)
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing and len(missing) <= BUT_AT_MOST and len(ranks) > len(missing):
        said = f"0-{world_size - 1} but {', '.join(map(str, missing))}"
        listed = said if len(said) < len(listed) else listed
    if len(listed) <= limit:
        return listed
    return f"{listed[: listed.rindex(',', 0, limit - 16) + 1]}… ({len(ranks):,} ranks)"


def named(ranks: Sequence[int], world_size: int) -> str:
    """'rank 17', 'ranks 0-16,18-1023' or 'ranks 0-1023 but 17'."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks_words(ranks, world_size)}"


def count(ranks: Sequence[int]) -> str:
    return f"{len(ranks):,} rank{'s' if len(ranks) != 1 else ''}"


# --- the summary table ---------------------------------------------------------------------------------------------
@dataclass
class StateGroup:
    """The ranks in one state (a failed rank's as its role), and how they exited."""

    state: str
    exit: str
    ranks: list[int]
    first: float  # the earliest failure's time among them, for the order (failed first)


def state_groups(
    record: RunRecord, state_words: Callable[[RankRecord], str], exit_words: Callable[[RankRecord], str]
) -> list[StateGroup]:
    """The ranks grouped by state and exit: failed first (the root cause's group first), then stalled, running,
    stopped, finished."""
    failed_at = {failure.rank: failure.time for failure in record.failures}
    groups: dict[tuple[str, str], StateGroup] = {}
    for rank in record.ranks:
        state, exit_text = state_words(rank), exit_words(rank)
        group = groups.setdefault((state, exit_text), StateGroup(state, exit_text, [], float("inf")))
        group.ranks.append(rank.rank)
        group.first = min(group.first, failed_at.get(rank.rank, float("inf")))
    order = ["failed first", "failed", "stopped: peer failed", "stalled", "starting", "running", "stopped", "finished"]

    def key(group: StateGroup) -> tuple[int, float]:  # failures by role, then by time; then the states in order
        return (order.index(group.state) if group.state in order else len(order), group.first)

    return sorted(groups.values(), key=key)


def most_common(lines: Iterable[str]) -> str:
    """The line most ranks share ('' if none): one count per line, where a thousand ranks' lines all differ."""
    counted = Counter(line for line in lines if line).most_common(1)
    return counted[0][0] if counted else ""


def _median(values: Iterable[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def grouped_table(
    record: RunRecord,
    state_words: Callable[[RankRecord], str],
    exit_words: Callable[[RankRecord], str],
    straggler_words: Callable[[RankRecord], str],
) -> str:
    """A row per state (its ranks, their median time, compute per step and memory, their most common last line),
    then the ranks that stand out, by name."""
    groups = state_groups(record, state_words, exit_words)
    ranks = record.ranks
    width = max(len(group.state) for group in groups)
    exit_width = max(4, *(len(group.exit) for group in groups))
    said = [named(group.ranks, record.world_size) for group in groups]
    said_width = min(40, max(len(words) for words in said))
    head = f"{'state':<{width}}  {'ranks':<{said_width}}  {'exit':<{exit_width}} {'time':>10}  {'compute/step':<12}  "
    rows = [
        f"{record.world_size:,} ranks: " + ", ".join(f"{len(g.ranks):,} {g.state}" for g in groups),
        f"{head}{'rss':<10}  last line (most ranks')",
    ]
    for group, words in zip(groups, said):
        members = [ranks[rank] for rank in group.ranks]
        duration = _median(r.duration for r in members)
        compute = _median(r.compute_per_step for r in members)
        rss = _median(r.hardware[-1].rss if r.hardware else None for r in members)
        last = most_common(r.last_line for r in members)
        shown = words if len(words) <= said_width else words[: said_width - 1] + "…"
        rows.append(
            f"{group.state:<{width}}  {shown:<{said_width}}  {group.exit:<{exit_width}} "
            f"{format_duration(duration) if duration is not None else '':>10}  "
            f"{f'{compute * 1000:.1f} ms' if compute is not None else '':<12}  "
            f"{size_text(int(rss)) if rss is not None else '':<10}  {last[:40]}".rstrip()
        )
    rows += exceptions(record, straggler_words)
    rows.append("a rank's own row: ddpnb.core.report.summary_table(record, ranks=[N])")
    return "\n".join(rows)


def exceptions(record: RunRecord, straggler_words: Callable[[RankRecord], str]) -> list[str]:
    """The stragglers the others wait for, and the slowest and fastest ranks by their own compute per step."""
    lines = []
    stragglers = sorted((r for r in record.ranks if r.holds_others is not None), key=lambda r: -(r.holds_others or 0))
    if stragglers:
        lines.append(
            "others wait for: "
            + "; ".join(f"rank {r.rank} ({straggler_words(r)})" for r in stragglers[:EXTREMES])
            + (f"; and {len(stragglers) - EXTREMES} more" if len(stragglers) > EXTREMES else "")
        )
    timed = sorted((r for r in record.ranks if r.compute_per_step is not None), key=lambda r: r.compute_per_step or 0)
    typical = statistics.median(r.compute_per_step or 0 for r in timed) if timed else 0
    if (
        len(timed) > 2 * EXTREMES
        and not (1 - SPREAD) * typical
        <= (timed[0].compute_per_step or 0)
        <= (timed[-1].compute_per_step or 0)
        <= (1 + SPREAD) * typical
    ):  # named only where some rank stands out

        def said(part: list[RankRecord]) -> str:
            return ", ".join(f"rank {r.rank} {(r.compute_per_step or 0) * 1000:.1f} ms" for r in part)

        lines.append(f"slowest compute/step: {said(timed[::-1][:EXTREMES])}; fastest: {said(timed[:EXTREMES])}")
    return lines


# --- where the ranks are --------------------------------------------------------------------------------------------
def place_key(where: RankWhere) -> tuple[str, str, str, str, bool, bool]:
    return (where.ended, where.waits_in, where.call, where.at, where.starting, where.unreported)


def place_groups(diagnosis: Diagnosis) -> list[list[RankWhere]]:
    """The ranks grouped by where they are, those not waiting first (the ranks the others wait for), at most
    MAX_GROUPS: past that, the smallest groups go together into the last."""
    groups: dict[tuple[str, str, str, str, bool, bool], list[RankWhere]] = {}
    for where in diagnosis.ranks:
        groups.setdefault(place_key(where), []).append(where)
    order = sorted(groups.items(), key=lambda item: (bool(item[0][0]), bool(item[0][1]), item[1][0].rank))
    shown = [places for _, places in order]
    if len(shown) > MAX_GROUPS:
        keep = sorted(sorted(shown, key=len, reverse=True)[: MAX_GROUPS - 1], key=shown.index)
        rest = [where for places in shown if not any(places is kept for kept in keep) for where in places]
        shown = [*keep, sorted(rest, key=lambda where: where.rank)]
    return shown


def elsewhere(places: list[RankWhere]) -> bool:
    """The last group of `place_groups`, when it gathers ranks in several places."""
    return len({place_key(where) for where in places}) > 1


def quiet_words(places: list[RankWhere], later: float) -> str:
    quiet = [where.quiet + later for where in places]
    low, high = min(quiet), max(quiet)
    return format_duration(low) if high - low < 1 else f"{format_duration(low)}–{format_duration(high)}"
