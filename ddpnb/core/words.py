"""How values read to users, one way in every view and report: enums as their words, durations, byte sizes, exit
codes, sparklines.

It imports nothing of ddpnb, so code in any process may word a value with it.
"""

from __future__ import annotations

import enum
import signal


class Named(str, enum.Enum):
    """An enum whose members are their words: each prints as its value (`str(Outcome.TIMED_OUT)` is 'timed out')
    and equals it, so users may also write the string (`engine="ray"`)."""

    def __str__(self) -> str:
        return self.value


def format_duration(seconds: float) -> str:
    """How long something took, one way in every view: '0.4 s', '12 s', '4 min 05 s', '1 h 02 min'."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def ranks_text(count: int) -> str:
    """'1 rank', '4 ranks': a one-GPU run is common enough to read right."""
    return f"{count} rank{'' if count == 1 else 's'}"


def size_text(count: float) -> str:
    """Bytes as '512.0 MiB', '1.2 GiB': the one byte format of every view, binary as torch's memory summaries
    and nvidia-smi print memory, so a number reads the same in both."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def describe_exit(exitcode: int | None) -> str:
    """`-11` -> 'killed by SIGSEGV', `3` -> 'exited with code 3'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], top: float | None = None, bottom: float = 0.0) -> str:
    """'▁▃▇█': each value as a block, from `bottom` (the lowest block) to `top` (the tallest; else the largest
    value)."""
    top = top if top is not None else max(values, default=0.0)
    if not values or top <= bottom:
        return ""
    return "".join(
        _BLOCKS[min(len(_BLOCKS) - 1, max(0, round((v - bottom) / (top - bottom) * (len(_BLOCKS) - 1))))]
        for v in values
    )
