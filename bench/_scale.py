"""The bench's scale probe (bench/run.py's section 13): one run of N simulated ranks (bench/loadgen.py) in this
process, which plays the kernel, with the text view and the dashboard both drawing it; prints one JSON line.

    python bench/_scale.py RANKS SECONDS [--profile FILE] [--disk MIB]

Measured: the kernel's CPU share (this process's CPU time over the run's wall time: the hosts are processes of
their own), the lag from a rank's send (its metric's time) to a view's state (a subscriber fed as the text view
is), the kernel's resident memory and the metrics' spill file every 10 s (`--disk`: the file's bound, MiB, in
place of `ddpnb.core.series.DISK`), the text view's lines (all, and the stall's and summary's at the
end), and the dashboard's size (its HTML) and its redraw's time in the kernel. The ranks train for SECONDS once
every node has come; then rank 17 (or the last) stalls, and rank 3 fails once the stall was reported (the stall
threshold is longer than the nodes' start, which is quiet too).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH / "engines")]  # the `sim` engine's registration

import ddpnb
from ddpnb.core.record import Outcome

MEMORY_EVERY = 10.0  # seconds between two samples of the kernel's memory
LAG_RANKS = 16  # ranks whose metrics' lag the probe follows (spread over the nodes)


def train() -> None:
    """Never called: the simulated nodes play the ranks."""


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ranks, seconds = int(sys.argv[1]), float(sys.argv[2])
    profile_to = sys.argv[sys.argv.index("--profile") + 1] if "--profile" in sys.argv else None
    if "--disk" in sys.argv:
        from ddpnb.core import series

        series.DISK = int(float(sys.argv[sys.argv.index("--disk") + 1]) * 2**20)
    steps = int(seconds * 5)
    stall_rank = 17 if ranks > 17 else ranks - 1
    start_at = 5 + ranks / 40  # every node's host has come (128 Python processes start on 2 busy cores)
    scenario = {
        "ranks_per_node": 8,
        "start_at": start_at,
        "steps": steps + 1000,  # the failure ends the run
        "stall_rank": stall_rank,
        "stall_at": seconds,
        "fail_rank": 3,
        "fail_at": seconds + start_at + 12,
        "straggler": 5,
    }
    profiler = None
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()

        def enable_in_reader(*_: object) -> None:
            sys.setprofile(None)
            if threading.current_thread().name.endswith("-run"):
                profiler.enable()

        threading.setprofile(enable_in_reader)
    text = io.StringIO()
    cpu0, wall0 = time.process_time(), time.monotonic()
    with contextlib.redirect_stdout(text):
        run = ddpnb.launch(
            train, engine="sim", nprocs=ranks, view="text", stall=start_at + 5, timeout=seconds + 120, **scenario
        )
    from ddpnb.views.dashboard import Dashboard

    dashboard = Dashboard(run, foreground=False)
    threading.setprofile(None)
    record = run.record
    followed = sorted({(ranks * i) // LAG_RANKS for i in range(LAG_RANKS)})
    seen = dict.fromkeys(followed, 0)
    lags: list[float] = []
    memory: list[tuple[float, int]] = []
    spilled: list[tuple[float, int]] = []  # the metrics' spill file's bytes
    renders: list[float] = []

    def probe() -> None:  # fed from wait()'s thread as the text view is: what it shows, when
        now = time.time()
        for rank in followed:
            points = record.ranks[rank].metrics.get("loss")
            new = points.since(seen[rank]) if points is not None else []
            lags.extend(now - point.time for _, point in new)
            seen[rank] = new[-1][0] + 1 if new else seen[rank]

    run.subscribe(probe)
    next_sample = time.monotonic()
    with contextlib.redirect_stdout(text):
        while not run.done:
            run.wait(timeout=1.0)
            if time.monotonic() >= next_sample:
                memory.append((round(time.monotonic() - wall0, 1), rss()))
                spill = run.attempt._spill  # the probe reads the kernel's insides
                spilled.append((memory[-1][0], spill.size() if spill else 0))
                next_sample += MEMORY_EVERY
                started = time.perf_counter()
                dashboard._render()  # the dashboard's own redraw, timed here (its thread redraws too)
                renders.append(time.perf_counter() - started)
    wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    try:
        run.result()
    except ddpnb.WorkerError as exc:  # what the cell shows under the text view when the run failed
        text.write(exc.report() + "\n")
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_to)
    shown = text.getvalue()
    stall_at = shown.find("[ddpnb] stalled")
    end_at = shown.find("[ddpnb] run ")
    dashboard_bytes = sum(
        len(widget.value)
        for widget in (
            dashboard.header,
            dashboard.ranks,
            dashboard.stall,
            dashboard.stall_stacks,
            dashboard.plots,
            dashboard.log,
            dashboard.error,
        )
    )
    print(
        "@@SCALE "
        + json.dumps(
            {
                "ranks": ranks,
                "seconds": round(wall, 1),
                "outcome": record.outcome.value,
                "kernel_cpu_share": round(cpu / wall, 3),
                "lag_median": round(statistics.median(lags), 3) if lags else None,
                "lag_p99": round(sorted(lags)[int(len(lags) * 0.99)], 3) if lags else None,
                "lag_max": round(max(lags), 3) if lags else None,
                "memory": memory,
                "spill_bytes": spilled,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10,
                "text_lines": shown.count("\n"),
                "stall_lines": shown[stall_at:].count("\n[ddpnb] ---") if stall_at >= 0 else None,
                "stall_report_lines": shown[stall_at:end_at].count("\n") if 0 <= stall_at < end_at else None,
                "end_lines": shown[end_at:].count("\n") if end_at >= 0 else None,
                "dashboard_bytes": dashboard_bytes,
                "dashboard_render_s": round(statistics.median(renders), 4) if renders else None,
                "failed_named": "rank 3" in shown,
                "stalled_named": f"rank {stall_rank}" in shown,
                "succeeded": record.outcome is Outcome.SUCCEEDED,
            }
        ),
        flush=True,
    )
    if "--show" in sys.argv:
        sys.stderr.write(shown[stall_at:] if stall_at >= 0 else shown[-5000:])


if __name__ == "__main__":
    main()
