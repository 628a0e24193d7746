"""Every rank's metrics as TensorBoard event files, written from the kernel while the run goes (`tensorboard=DIR`).

One writer per rank, in `DIR/<run name>/rank<N>`, so TensorBoard lists the ranks as runs of their own and
`tensorboard --logdir DIR` compares them and earlier runs. It reads the run's record, as the views do, in a
thread of its own at most once a `FLUSH_INTERVAL` and once more at the end: nothing runs on a rank for it.

The files are written by TensorBoard's own `EventFileWriter` (the optional `tensorboard` extra), with scalars as
`simple_value`s, as `torch.utils.tensorboard.SummaryWriter` writes them (without importing torch in the kernel):
TensorBoard's readers list them as scalars. That is half the kernel's CPU per point of `tensorboard.summary.Writer`
(its tensor protos): 34 against 74 us here.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ddpnb.core.record import RankRecord
from ddpnb.core.run import Run
from ddpnb.core.spec import LaunchError

FLUSH_INTERVAL = 1.0  # seconds between two writes of the new points (and flushes to disk)
QUEUE = 10_000  # events a rank's writer holds before its writing thread catches up


def check(directory: str | os.PathLike[str]) -> Path:
    """The directory as the writer will use it; raises LaunchError, before anything starts, without tensorboard
    or where the directory cannot be created."""
    try:
        import tensorboard.summary  # noqa: F401
    except ImportError:
        raise LaunchError(
            "tensorboard= (--tensorboard) needs TensorBoard: pip install tensorboard "
            "(or pip install -e '.[tensorboard]'), then run the cell again."
        ) from None
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(
            f"tensorboard directory {str(directory)!r} cannot be created ({exc.strerror}): pass a "
            "directory you can write to."
        ) from None
    return path


class TensorBoardWriter:
    """Writes `run`'s metrics under `directory/<run name>/rank<N>` as they arrive; with restarts allowed, each
    attempt in `rank<N>.attempt<K>`, as its logs are named (the steps since the checkpoint come again). A point
    logged without a step gets its index in its series."""

    def __init__(self, run: Run, directory: Path) -> None:
        self.run: Run | None = run
        self.record = run.record
        self.directory = directory / run.record.run_dir.name
        self._writers: dict[tuple[int, int], Any] = {}  # (attempt, rank) -> its EventFileWriter
        self._written: dict[tuple[int, int, str], int] = {}  # (attempt, rank, name) -> points written
        self._lock = threading.RLock()  # TensorBoard's writer is not thread-safe: its thread, and wait()'s
        self._closed = False
        self._failed = False
        run.subscribe(self._on_wait, news=False)
        threading.Thread(target=self._loop, name="ddpnb-tensorboard", daemon=True).start()

    def _loop(self) -> None:
        seen = 0
        while (run := self.run) is not None and not run.done:
            next_write = time.monotonic() + FLUSH_INTERVAL
            while not run.done and (left := next_write - time.monotonic()) > 0:
                seen = run.watch(seen, left)
            self._write()
        self.close()

    def _on_wait(self) -> None:
        """Called when `Run.wait()` returns: a foreground cell ends with every point on disk."""
        run = self.run
        if run is None or run.done:
            self.close()

    def close(self) -> None:
        """Write what is left, then close every rank's file (once)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._write()
            run, self.run = self.run, None
            if run is not None:  # a background run's `wait()`, which would let go of its views, may never come
                run.unsubscribe(self._on_wait)
            for writer in self._writers.values():
                try:
                    writer.close()
                except OSError:  # said once already, by _write
                    pass
            self._writers.clear()

    def _write(self) -> None:
        with self._lock:
            if self._failed:
                return
            try:
                record = self.record
                wrote = False
                for attempt, ranks in [*((a.number, a.ranks) for a in record.attempts), (record.attempt, record.ranks)]:
                    for rank in ranks:
                        wrote = self._write_rank(attempt, rank) or wrote
                if wrote:
                    for writer in self._writers.values():
                        writer.flush()
            except OSError as exc:  # a full disk: the run goes on, without its event files
                print(f"[ddpnb] TensorBoard files in {self.directory} not written: {exc}", file=sys.stderr)
                self._failed = True

    def _write_rank(self, attempt: int, rank: RankRecord) -> bool:
        wrote = False
        for name, points in list(rank.metrics.items()):
            key = (attempt, rank.rank, name)
            done = self._written.get(key, 0)
            new = points.since(done)  # indexed as logged: a thinned series is shorter
            if not new:
                continue
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary

            writer = self._writers.get((attempt, rank.rank))
            if writer is None:
                from tensorboard.summary.writer.event_file_writer import EventFileWriter

                subdir = f"rank{rank.rank}.attempt{attempt}" if self.record.max_restarts else f"rank{rank.rank}"
                # flushed here once a FLUSH_INTERVAL; its own queue and timer only need to stay out of the way
                writer = self._writers[(attempt, rank.rank)] = EventFileWriter(
                    str(self.directory / subdir), max_queue_size=QUEUE, flush_secs=3600
                )
            for index, (step, at, value) in new:
                writer.add_event(
                    Event(
                        wall_time=at,
                        step=index if step is None else step,
                        summary=Summary(value=[Summary.Value(tag=name, simple_value=value)]),
                    )
                )
            self._written[key] = new[-1][0] + 1
            wrote = True
        return wrote
