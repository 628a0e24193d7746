"""The journal (issue 42): what writing it costs the owner's reader per event, and how long a viewer takes to replay
a journal of 100,000 metric points and 50,000 lines into a record: `python bench/journal.py [--points N --lines N]`.

The owner here is a real `Run` over an engine that plays its ranks as fast as it can (no process: the reader's own
cost is what is measured), once journaled and once not, interleaved; then `Replay.read` of that journal. Figures
only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddpnb.core import messages as msg
from ddpnb.core.engine import AttemptStart, Capabilities, RunEvents
from ddpnb.core.journal.replay import Replay
from ddpnb.core.run import Run, RunSetup
from ddpnb.core.spec import CallStyle, Stream, WorkerSpec
from ddpnb.views.frontend import CellFrontEnd

RANKS = 2


class Flood:
    """Two ranks that log `points` values (two per `ddpnb.log` call) and print `lines` lines, one line a read,
    a tick every 100 events, as the local engine's reader would deliver them from very fast ranks."""

    def __init__(self, points: int, lines: int) -> None:
        self.points, self.lines = points, lines

    def start(self, events: RunEvents, start: AttemptStart) -> None:
        self.events = events
        for rank in range(RANKS):
            events.placed(rank, 1000 + rank, "")

    def serve(self) -> None:
        events, now = self.events, time.time()
        for rank in range(RANKS):
            events.message(rank, msg.Started(rank, "cpu"))
        calls, lines = self.points // 2, self.lines
        for i in range(max(calls, lines)):
            rank = i % RANKS
            if i < calls:
                events.message(rank, msg.Metric(rank, i // RANKS, now + i * 1e-4, {"loss": 1.0 / (i + 1), "acc": 0.5}))
            if i < lines:
                events.output(
                    rank, Stream.STDOUT, f"rank {rank} step {i // RANKS}: loss {1.0 / (i + 1):.5f}\n".encode()
                )
            if i % 100 == 0:
                events.tick()
        for rank in range(RANKS):
            events.message(rank, msg.Returned(rank, None))
            events.output(rank, Stream.STDOUT, b"")
            events.output(rank, Stream.STDERR, b"")
            events.exited(rank, 0)
        events.tick()

    def stop(self, ranks: list[int], failed: bool) -> float | None:
        return None

    def escalate(self) -> float | None:
        return None

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        return {}

    def send(self, ranks, command, shipment=None) -> None:
        raise NotImplementedError

    def interrupt(self, ranks) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def owner(root: Path, points: int, lines: int, journal: bool) -> tuple[float, Path]:
    run_dir = Path(tempfile.mkdtemp(dir=root))
    spec = WorkerSpec(
        fn_payload=b"",
        args=(),
        call_style=CallStyle.AUTO,
        world_size=RANKS,
        backend="gloo",
        use_gpus=False,
        environ={},
        run_dir=str(run_dir),
    )
    run = Run(
        RunSetup(
            spec=spec,
            devices=["cpu"] * RANKS,
            engine="bench",
            capabilities=Capabilities(),
            new_engine=lambda spec: Flood(points, lines),
            front_end=CellFrontEnd(),
            function="bench",
            journal=journal,
        )
    )
    began = time.perf_counter()
    run.start()
    run.wait()
    return time.perf_counter() - began, run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=5)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        os.environ["DDPNB_RUNS_DIR"] = root  # retention (`rundir.prune`) stays inside
        plain, journaled, replays = [], [], []
        for _ in range(options.repeat):  # interleaved: load from elsewhere hits both alike
            plain.append(owner(Path(root), options.points, options.lines, journal=False)[0])
            seconds, run_dir = owner(Path(root), options.points, options.lines, journal=True)
            journaled.append(seconds)
            began = time.perf_counter()
            replayed = Replay.read(run_dir)
            replays.append(time.perf_counter() - began)
            assert replayed.done and sum(len(r.metrics["loss"]) * 2 for r in replayed.record.ranks) == options.points
        size = (run_dir / "journal").stat().st_size
    events = options.points // 2 + options.lines
    cost = (statistics.median(journaled) - statistics.median(plain)) / events * 1e6
    print(
        f"events: {events:,} ({options.points:,} metric points in {options.points // 2:,} messages, "
        f"{options.lines:,} lines), journal {size / 1e6:.1f} MB"
    )
    print(
        f"owner's reader, no journal: {statistics.median(plain):.3f} s; journaled: "
        f"{statistics.median(journaled):.3f} s ({cost:+.2f} us an event, on the reader thread)"
    )
    print(
        f"replay into a record: {statistics.median(replays):.3f} s (median of {options.repeat}; "
        f"min {min(replays):.3f} s)"
    )


if __name__ == "__main__":
    main()
