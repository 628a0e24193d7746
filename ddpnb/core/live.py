"""The runs of this kernel still going: what `ddpnb.runs()` lists, and what a shutting-down kernel stops."""

from __future__ import annotations

import atexit
from typing import Any, Protocol

from ddpnb.core.record import Outcome, RunRecord


class LiveRun(Protocol):
    """What the registry needs of a run (`core.run.Run`, which registers itself here)."""

    record: RunRecord

    def stop(self, outcome: Outcome = ..., note: str = ...) -> None: ...


_live: set[Any] = set()
_stops_at_exit = False


def add(run: LiveRun) -> None:
    global _stops_at_exit
    if not _stops_at_exit:  # after multiprocessing's own exit handler, so it runs first: that one joins the ranks
        atexit.register(stop_all)
        _stops_at_exit = True
    _live.add(run)


def discard(run: LiveRun) -> None:
    _live.discard(run)


def runs(engine: str | None = None) -> list[LiveRun]:
    """The runs still going (of one engine, by name), oldest first."""
    return sorted(
        (run for run in list(_live) if engine is None or run.record.engine == engine),
        key=lambda run: run.record.started,
    )


def stop_all() -> None:
    """atexit: a kernel or script that ends takes its runs with it (a session's ranks would wait for commands, and
    multiprocessing's exit handler for them)."""
    for run in runs():
        run.stop(Outcome.STOPPED, "the kernel shut down")
