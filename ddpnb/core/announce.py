"""How views learn that a run changed: numbered announcements, without timers of their own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Announcer:
    """The reader marks news as it reads (`news`, `turn`); `maybe` announces output at most once an `every`, and
    a turn (a rank starting, returning, failing or exiting, the run stopping) at once. Views wait in `watch`."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._changes = threading.Condition()
        self.generation = 0  # how many announcements so far
        self.news = False  # something was read or changed since the last announcement
        self.turn = False  # ... and it is a turn
        self._last = 0.0

    def mark(self, turn: bool = False) -> None:
        self.news = True
        self.turn = self.turn or turn

    def maybe(self) -> None:
        if self.turn or (self.news and time.monotonic() - self._last >= self.every):
            self.now()
            self._last = time.monotonic()

    def now(self) -> None:
        with self._changes:
            self.generation += 1
            self.news = self.turn = False
            self._changes.notify_all()

    def watch(self, seen: int, timeout: float, done: Callable[[], bool]) -> int:
        """Wait until an announcement after number `seen` (or `done()`), at most `timeout`; the latest number."""
        with self._changes:
            self._changes.wait_for(lambda: self.generation != seen or done(), timeout)
            return self.generation
