"""A rank's output in the kernel: raw bytes to its log file, decoded lines to the run, the latest kept for views."""

from __future__ import annotations

import codecs
import re
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from ddpnb.core.record import AttemptRecord, OutputLine
from ddpnb.core.spec import Stream

MAX_LINE_CHARS = 10_000  # longer lines are cut in memory and in the views; the log file keeps every byte
KEEP_LINES = 2000  # lines a run keeps for its views; every line is in the rank's log file


# the counters tqdm ends its bar with: "[00:01<00:02, 9.50it/s]", "[1:02:03, 2.1s/it, loss=0.3]"
_BAR_TAIL = re.compile(r"\[(?:\d+:)?\d\d:\d\d(?:<(?:(?:\d+:)?\d\d:\d\d|\?))?, [^\]]*/[^\]]*\]\s*$")


def is_progress_line(line: str) -> bool:
    """A tqdm bar's line (its final state, which a rank writes once as a line: see `rank.progress`)."""
    return _BAR_TAIL.search(line[-200:]) is not None


def last_text(lines: list[str]) -> str | None:
    """The latest of `lines` that is not a progress bar's, or None if all are."""
    return next((line for line in reversed(lines) if not is_progress_line(line)), None)


class LineDecoder:
    """One rank's stdout or stderr: raw bytes to the log file, decoded lines to the record.

    Memory stays bounded whatever the rank writes: a line longer than MAX_LINE_CHARS is cut (the log file keeps
    it whole), and a progress bar redrawing one line with carriage returns keeps only its latest redraw.
    """

    def __init__(self, log: Any) -> None:
        self.log = log
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.partial = ""  # the line being written, not yet ended by a newline
        self.partial_cut = 0  # characters of that line already dropped from memory

    def feed(self, data: bytes, final: bool = False) -> list[str]:
        self.log.write(data)
        text = self.partial + self.decoder.decode(data, final=final)
        pieces = text.split("\n")
        self.partial = pieces.pop()
        if pieces:
            pieces[0] = _visible(pieces[0], self.partial_cut)
            self.partial_cut = 0
        if len(pieces) > 1 and ("\r" in text or max(map(len, pieces)) > MAX_LINE_CHARS):
            pieces[1:] = [_visible(piece) for piece in pieces[1:]]
        redraw = self.partial.rfind("\r", 0, len(self.partial) - 1)
        if redraw >= 0:  # only the latest redraw is visible
            self.partial, self.partial_cut = self.partial[redraw + 1 :], 0
        if len(self.partial) > MAX_LINE_CHARS:
            self.partial_cut += len(self.partial) - MAX_LINE_CHARS
            self.partial = self.partial[:MAX_LINE_CHARS]
        if final and (self.partial or self.partial_cut):
            pieces.append(_visible(self.partial, self.partial_cut))
            self.partial, self.partial_cut = "", 0
        return pieces


def _visible(line: str, cut: int = 0) -> str:
    """What a terminal would show of `line`: the text after its last carriage return, cut to MAX_LINE_CHARS."""
    redraw = line.rfind("\r", 0, len(line) - 1)
    if redraw >= 0:
        line, cut = line[redraw + 1 :], 0
    line = line.rstrip("\r")
    if len(line) > MAX_LINE_CHARS:
        line, cut = line[:MAX_LINE_CHARS], cut + len(line) - MAX_LINE_CHARS
    return f"{line} [... {cut} more characters in the log]" if cut else line


class LineBuffer:
    """The latest KEEP_LINES lines of every rank, numbered; views read them with `since`, never under a lock of
    another object's."""

    def __init__(self, keep: int = KEEP_LINES) -> None:
        self._lines: deque[OutputLine] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.count = 0  # lines added so far

    def add(self, rank: int, stream: Stream, lines: list[str]) -> None:
        with self._lock:
            kept = lines[-(self._lines.maxlen or len(lines)) :]  # older ones would fall out at once
            first = self.count + len(lines) - len(kept) + 1
            self._lines.extend(OutputLine(seq, rank, stream, text) for seq, text in enumerate(kept, first))
            self.count += len(lines)

    def since(self, seen: int) -> tuple[list[OutputLine], int, int]:
        """(the lines after line number `seen` still kept, how many after it were no longer kept, the count now)."""
        with self._lock:
            new = []
            for line in reversed(self._lines):  # newest first, stopping at what was seen
                if line.seq <= seen:
                    break
                new.append(line)
            count = self.count
        new.reverse()
        return new, count - seen - len(new), count


def split_at_restarts(
    new: list[OutputLine], attempts: Sequence[AttemptRecord], seen: int
) -> Iterator[tuple[list[OutputLine], AttemptRecord | None]]:
    """New lines cut where each of `attempts` (ended, not marked in the view yet) had its last line, once the view
    read up to line `seen`: (the lines before the restart, the attempt that ended there), then (the rest, None).
    How views put a restart's line where it happened."""
    for attempt in attempts:
        if attempt.last_line > seen:
            break
        before = [line for line in new if line.seq <= attempt.last_line]
        new = new[len(before) :]
        yield before, attempt
    yield new, None
