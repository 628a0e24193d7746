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


class Subscribers:
    """The views a run feeds from the thread in its `wait()`: with the reader's news (and once a tick anyway), or,
    subscribed with `news=False`, only when `wait()` returns. A view that raises (a bug of ddpnb's) costs the run
    neither its result nor its end: `notify` hands it back once, by its class's name."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[], None]] = []
        self._enders: list[Callable[[], None]] = []
        self._said: set[str] = set()  # the views whose failure was handed on

    def __bool__(self) -> bool:
        """Some view is fed with the news."""
        return bool(self._listeners)

    def subscribe(self, callback: Callable[[], None], news: bool) -> None:
        (self._listeners if news else self._enders).append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        # new lists, not removals: `notify` may be going over the old ones in another thread
        self._listeners = [c for c in self._listeners if c != callback]
        self._enders = [c for c in self._enders if c != callback]

    def notify(self, ending: bool = False, ended: bool = False) -> list[tuple[str, Exception]]:
        """Feed every view (`ending`: `wait()` returns, so those fed only then too); once the run has `ended` and
        they have drawn it, let go of them, so that the run and its value go with the caller's last reference.
        Returns the views that failed for the first time, and how."""
        failed = []
        for callback in [*self._listeners, *(self._enders if ending else ())]:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - a view's bug must cost the run neither its result nor its end
                view = getattr(callback, "__qualname__", repr(callback)).split(".")[0]
                if view not in self._said:
                    self._said.add(view)
                    failed.append((view, exc))
        if ending and ended:
            self._listeners.clear()
            self._enders.clear()
        return failed
