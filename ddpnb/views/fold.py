"""Folded output: the same line printed by several ranks at about the same time shows once, `[ranks 0-3] text`.

Shared by the text view, the dashboard's all-ranks log and a session's output. Pure: it is fed the run's lines
(`Run.lines_since`) and the time, and returns what to show; the per-rank logs and tabs never go through it.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ddpnb.core import groups
from ddpnb.core.record import OutputLine
from ddpnb.core.spec import Stream

FOLD_WINDOW = 0.5  # seconds a line waits for the other ranks to print it too (the reader passes every 0.2 s)
# torch's C++ log lines: "[rank1]:[W1201 19:22:41.862542944 reducer.cpp:1400] Warning: ...". The rank prefix says
# what ddpnb's tag says already, and the time differs from rank to rank: neither may keep a warning that every rank
# printed from folding.
TORCH_RANK = re.compile(r"\[rank(\d+)\]:")
GLOG_TIME = re.compile(r"^\[([IWEF])\d{4} \d\d:\d\d:\d\d(?:\.\d+)? ")


rank_ranges = groups.ranges  # (0, 1, 2, 5) -> '0-2,5'


@dataclass(eq=False, slots=True)  # identity: two printings of one text are two lines
class FoldedLine:
    """A line to show and every rank that printed it (one rank when nothing folded)."""

    seq: int  # the first printing's line number (`OutputLine.seq`)
    ranks: list[int]
    stream: Stream
    text: str
    opened: float = field(default=0.0, repr=False)  # when the first printing arrived
    world_size: int = field(default=0, repr=False)  # the run's: from `groups.GROUP_FROM` up, `[ranks 0-1023 but 17]`

    @property
    def rank(self) -> int:
        return self.ranks[0]

    @property
    def tag(self) -> str:
        """'[rank 2]', '[ranks 0-3]', '[ranks 0-2,5]'; in a run of many ranks '[ranks 0-1023 but 17]'."""
        if len(self.ranks) == 1:
            return f"[rank {self.ranks[0]}]"
        if groups.grouped(self.world_size):
            return f"[ranks {groups.ranks_words(self.ranks, self.world_size)}]"
        return f"[ranks {rank_ranges(self.ranks)}]"


def single(line: OutputLine) -> FoldedLine:
    """A line shown as printed, by its one rank."""
    return FoldedLine(line.seq, [line.rank], line.stream, line.text)


def own_text(line: OutputLine) -> str:
    """The line without torch's `[rankN]:` prefix where N is the rank that printed it (ddpnb's tag says it)."""
    prefix = TORCH_RANK.match(line.text)
    return line.text[prefix.end() :] if prefix and int(prefix.group(1)) == line.rank else line.text


class _Same:
    """The pending lines of one text, oldest first, and for each rank the first of them it may still join: a rank
    joins the oldest open line it is not in, so the lines it is in come before that one."""

    def __init__(self) -> None:
        self.lines: deque[FoldedLine] = deque()
        self.first = 0  # the number of lines[0] among every line of this text so far
        self.next_for: dict[int, int] = {}  # rank -> the number of the first line it is not in


class Folder:
    """Folds identical lines from different ranks that arrive within `window` seconds of the first.

    A line is released once its window has closed, or at once when every rank has printed it; lines come out in
    the order of their first printing. A rank printing the same text twice makes two lines, each joined by the
    other ranks' copies in turn. `enabled=False` passes every line straight through.
    """

    def __init__(self, world_size: int, window: float = FOLD_WINDOW, enabled: bool = True) -> None:
        self.world_size = world_size
        self.window = window
        self.enabled = enabled and world_size > 1
        self._pending: list[FoldedLine] = []  # in order of first printing
        self._open: dict[tuple[Stream, str], _Same] = {}

    def add(self, lines: Iterable[OutputLine], now: float) -> list[FoldedLine]:
        """Take new lines (arrived at `now`, a monotonic time); return the lines ready to show."""
        if not self.enabled:
            return [single(line) for line in lines]
        for line in lines:
            text = own_text(line)
            key = (line.stream, GLOG_TIME.sub(r"[\1 ", text))
            same = self._open.get(key)
            if same is None:  # a text not waiting already: the usual case, made short
                folded = FoldedLine(line.seq, [line.rank], line.stream, text, now, self.world_size)
                same = self._open[key] = _Same()
                same.lines.append(folded)
                same.next_for[line.rank] = 1
                self._pending.append(folded)
                continue
            number = max(same.next_for.get(line.rank, 0), same.first)
            while number - same.first < len(same.lines) and now - same.lines[number - same.first].opened >= self.window:
                number += 1  # closed: too late to join
            if number - same.first < len(same.lines):
                same.lines[number - same.first].ranks.append(line.rank)
            else:
                folded = FoldedLine(line.seq, [line.rank], line.stream, text, now, self.world_size)
                same.lines.append(folded)
                self._pending.append(folded)
                number = same.first + len(same.lines) - 1
            same.next_for[line.rank] = number + 1
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
        for folded in released:  # a text's lines are released in their order: each is its text's oldest
            key = (folded.stream, GLOG_TIME.sub(r"[\1 ", folded.text))
            same = self._open[key]
            same.lines.popleft()
            same.first += 1
            if not same.lines:
                del self._open[key]
            folded.ranks.sort()
        return released

    @property
    def waiting(self) -> int:
        return len(self._pending)
