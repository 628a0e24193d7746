"""Folded output: the same line printed by several ranks at about the same time shows once, `[ranks 0-3] text`.

Shared by the text view, the dashboard's all-ranks log and a session's output. Pure: it is fed the run's lines
(`Run.lines_since`) and the time, and returns what to show; the per-rank logs and tabs never go through it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ddpnb.core.record import OutputLine
from ddpnb.core.spec import Stream

FOLD_WINDOW = 0.5  # seconds a line waits for the other ranks to print it too (the reader passes every 0.2 s)


def rank_ranges(ranks: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs)


@dataclass(eq=False)  # identity: two printings of one text are two lines
class FoldedLine:
    """A line to show and every rank that printed it (one rank when nothing folded)."""

    seq: int  # the first printing's line number (`OutputLine.seq`)
    ranks: list[int]
    stream: Stream
    text: str
    opened: float = field(default=0.0, repr=False)  # when the first printing arrived

    @property
    def rank(self) -> int:
        return self.ranks[0]

    @property
    def tag(self) -> str:
        """'[rank 2]', '[ranks 0-3]', '[ranks 0-2,5]'."""
        return f"[rank {self.ranks[0]}]" if len(self.ranks) == 1 else f"[ranks {rank_ranges(self.ranks)}]"


def single(line: OutputLine) -> FoldedLine:
    """A line shown as printed, by its one rank."""
    return FoldedLine(line.seq, [line.rank], line.stream, line.text)


class Folder:
    """Folds identical lines from different ranks that arrive within `window` seconds of the first.

    A line is released once its window has closed, or at once when every rank has printed it; lines come out in
    the order of their first printing. A rank printing the same text twice starts a second line (a loop that
    prints the same text each step is not folded into one). `enabled=False` passes every line straight through.
    """

    def __init__(self, world_size: int, window: float = FOLD_WINDOW, enabled: bool = True) -> None:
        self.world_size = world_size
        self.window = window
        self.enabled = enabled and world_size > 1
        self._pending: list[FoldedLine] = []  # in order of first printing
        self._open: dict[tuple[Stream, str], list[FoldedLine]] = {}  # the pending lines of each text, oldest first

    def add(self, lines: Iterable[OutputLine], now: float) -> list[FoldedLine]:
        """Take new lines (arrived at `now`, a monotonic time); return the lines ready to show."""
        if not self.enabled:
            return [single(line) for line in lines]
        for line in lines:
            same = self._open.setdefault((line.stream, line.text), [])
            joined = next((folded for folded in same if line.rank not in folded.ranks
                           and now - folded.opened < self.window), None)
            if joined is not None:
                joined.ranks.append(line.rank)
            else:
                folded = FoldedLine(line.seq, [line.rank], line.stream, line.text, now)
                same.append(folded)
                self._pending.append(folded)
        return self.ready(now)

    def ready(self, now: float) -> list[FoldedLine]:
        """The lines whose window has closed or that every rank printed, up to the first that is still open."""
        done = 0
        for folded in self._pending:
            if len(folded.ranks) < self.world_size and now - folded.opened < self.window:
                break
            done += 1
        return self._release(done)

    def flush(self) -> list[FoldedLine]:
        """Every line still waiting (the run ended, or a restart begins)."""
        return self._release(len(self._pending))

    def _release(self, count: int) -> list[FoldedLine]:
        released, self._pending = self._pending[:count], self._pending[count:]
        for folded in released:
            key = (folded.stream, folded.text)
            self._open[key].remove(folded)
            if not self._open[key]:
                del self._open[key]
            folded.ranks.sort()
        return released

    @property
    def waiting(self) -> int:
        return len(self._pending)
