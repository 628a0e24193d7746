"""Detached runs (issue 42): `python bench/detached.py [--reps N] [--points N --lines N]`.

1. attach: a live detached-style run whose journal holds 100,000 metric points and 50,000 lines (its owner, a
   process of its own, holds the run open with the supervisor's lock); a real Jupyter kernel (jupyter_client, the
   dashboard view) runs `ddpnb.attach(PATH)` and displays the handle: the time from the cell's request to the
   dashboard's display message on the client's iopub, the first attach in the kernel (it imports the dashboard's
   modules) and later ones.
2. launch: a process that plays the kernel warms both kinds, then alternates an ordinary `ddpnb.run` of a 2-rank
   gloo all_reduce with the same `ddpnb.launch(..., detach=True).result()`; medians, and where the detached launch
   returns its handle.

Figures only: nothing here asserts a timing. `bench/run.py --only detached` runs both as its section 13.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

WIDGET = "application/vnd.jupyter.widget-view+json"

# the owner: bench/journal.py's flood of events into a real Run with the journal on, held open (no rank exits)
# until its stdin closes; it prints the run directory once every event is in the journal
OWNER = """
import json, os, sys, tempfile, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import journal as bench
from ddpnb.core import messages as msg
from ddpnb.detached import files

class Held(bench.Flood):
    def serve(self):
        events, now = self.events, time.time()
        for rank in range(bench.RANKS):
            events.message(rank, msg.Started(rank, "cpu"))
        calls = self.points // 2
        for i in range(max(calls, self.lines)):
            rank = i % bench.RANKS
            if i < calls:
                events.message(rank, msg.Metric(rank, i // bench.RANKS, now + i * 1e-4, {"loss": 1.0 / (i + 1), "acc": 0.5}))
            if i < self.lines:
                events.output(rank, bench.Stream.STDOUT, f"rank {rank} step {i // bench.RANKS}\\n".encode())
            if i % 100 == 0:
                events.tick()
        events.tick()
        self.served.set()
        while not self.release.wait(0.05):
            events.tick()
        for rank in range(bench.RANKS):
            events.message(rank, msg.Returned(rank, None))
            events.exited(rank, 0)
        events.tick()

points, lines = int(sys.argv[2]), int(sys.argv[3])
flood = Held(points, lines)
flood.served, flood.release = threading.Event(), threading.Event()
bench.Flood = lambda points, lines: flood
root = Path(os.environ["DDPNB_RUNS_DIR"])
threading.Thread(target=bench.owner, args=(root, points, lines, True), daemon=True).start()
flood.served.wait()
run_dir = next(path for path in root.iterdir() if path.is_dir())
alive = files.hold_alive(run_dir)
files.private_write(run_dir / files.MARKER, json.dumps({"function": "bench", "world_size": bench.RANKS, "engine": "bench", "pid": os.getpid()}).encode())
time.sleep(0.5)  # the last batch written (every 0.1 s)
print(run_dir, flush=True)
sys.stdin.read()
flood.release.set()
time.sleep(0.5)
"""

LAUNCH = """
import json, statistics, sys, time
import ddpnb

def reduce(rank):
    import torch
    import torch.distributed as dist

    one = torch.ones(1)
    dist.all_reduce(one)
    return one.item()

ddpnb.run(reduce, nprocs=2, view="none")
ddpnb.launch(reduce, nprocs=2, view="none", detach=True).result()
plain, detached, handed = [], [], []
for _ in range(int(sys.argv[1])):
    began = time.perf_counter()
    ddpnb.run(reduce, nprocs=2, view="none")
    plain.append(time.perf_counter() - began)
    began = time.perf_counter()
    handle = ddpnb.launch(reduce, nprocs=2, view="none", detach=True)
    handed.append(time.perf_counter() - began)
    assert handle.result() == 2.0
    detached.append(time.perf_counter() - began)
print("@@DETACHED " + json.dumps({"plain": plain, "detached": detached, "handed": handed}))
"""


def attach_figures(points: int, lines: int, attaches: int) -> dict[str, Any]:
    """Seconds from the attach cell's request to its dashboard on the client, for each attach in one kernel."""
    from jupyter_client.manager import start_new_kernel

    with tempfile.TemporaryDirectory() as root:
        env = {**os.environ, "DDPNB_RUNS_DIR": root, "DDPNB_VIEW": "widget"}
        owner = subprocess.Popen(
            [sys.executable, "-c", OWNER, str(BENCH), str(points), str(lines)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            run_dir = owner.stdout.readline().strip()
            size = Path(run_dir, "journal").stat().st_size
            manager, client = start_new_kernel(kernel_name="python3", env=env)
            try:
                client.execute_interactive("import ddpnb", timeout=120)
                shown = [_until_shown(client, f"handle = ddpnb.attach({run_dir!r})\nhandle") for _ in range(attaches)]
                whole = f"assert sum(len(handle.record.metrics('loss', r)) for r in (0, 1)) * 2 == {points}"
                if client.execute_interactive(whole, timeout=60)["content"]["status"] != "ok":
                    raise RuntimeError("the attached handle does not hold the journal's every point")
                client.execute_interactive("handle.leave()", timeout=60)
            finally:
                client.stop_channels()
                manager.shutdown_kernel(now=True)
        finally:
            owner.stdin.close()
            owner.wait(30)
    return {"journal_bytes": size, "shown": shown}


def _until_shown(client: Any, cell: str) -> float:
    began = time.perf_counter()
    msg_id = client.execute(cell)
    while True:
        message = client.get_iopub_msg(timeout=120)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "display_data" and WIDGET in message["content"]["data"]:
            seconds = time.perf_counter() - began
            break
        if message["msg_type"] == "error":
            raise RuntimeError(f"the attach failed: {message['content']['evalue']}")
    while not (message["msg_type"] == "status" and message["content"]["execution_state"] == "idle"):
        message = client.get_iopub_msg(timeout=120)
    return seconds


def launch_figures(reps: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as root:
        done = subprocess.run(
            [sys.executable, "-c", LAUNCH, str(reps)],
            capture_output=True,
            text=True,
            env={**os.environ, "DDPNB_RUNS_DIR": root},
            check=True,
            timeout=900,
        )
    line = next(line for line in done.stdout.splitlines() if line.startswith("@@DETACHED "))
    return json.loads(line.removeprefix("@@DETACHED "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--attaches", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    options = parser.parse_args()
    attached = attach_figures(options.points, options.lines, options.attaches)
    shown = attached["shown"]
    print(
        f"attach to a live run of {options.points:,} metric points and {options.lines:,} lines (journal "
        f"{attached['journal_bytes'] / 1e6:.1f} MB), request to dashboard shown: first {shown[0]:.2f} s, later "
        f"{statistics.median(shown[1:]) if shown[1:] else float('nan'):.2f} s"
    )
    launched = launch_figures(options.reps)
    plain, detached = statistics.median(launched["plain"]), statistics.median(launched["detached"])
    print(
        f"launch to result, 2-rank gloo all_reduce, median of {options.reps}: ordinary {plain * 1000:.0f} ms, "
        f"detached {detached * 1000:.0f} ms ({detached / plain:.2f}x; its handle after "
        f"{statistics.median(launched['handed']) * 1000:.0f} ms)"
    )


if __name__ == "__main__":
    main()
