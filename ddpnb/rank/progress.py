"""Progress bars and GPU memory, reported from inside a rank.

tqdm (and tqdm.auto, which is tqdm here: a rank has no notebook) redraws its line with '\r' about ten times a
second. In a rank its display() sends a typed `Progress` message instead, so the dashboard draws one bar per
rank; the bar's final state is still written once, as a line, so the log file and the text view keep it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ddpnb.core.messages import GpuMemory, Progress
from ddpnb.rank import context as ctx

PROGRESS_INTERVAL = 0.1  # seconds between two messages for one bar, whatever the bar's own mininterval


def install_hook() -> None:
    try:
        from tqdm import std
    except ImportError:
        return
    std.tqdm.display = _tqdm_display
    # tqdm's default lock holds a multiprocessing semaphore, which a rank's os._exit would leak (and Python's
    # resource tracker warn about); the rank's bars need only a thread lock
    std.tqdm.set_lock(threading.RLock())


def _tqdm_display(bar: Any, msg: str | None = None, pos: int | None = None) -> bool:
    closing = bool(bar.disable)  # tqdm.close() sets disable before its last display()
    now = time.monotonic()
    if not closing and bar.n != bar.total and now - getattr(bar, "_ddpnb_sent", 0.0) < PROGRESS_INTERVAL:
        return True
    bar._ddpnb_sent = now
    if closing and msg is None:  # leave=True: the final bar stays, as one line
        bar.fp.write("\r" + bar.__str__())
    context = ctx.current()
    if context is not None:
        counters = bar.format_dict
        layout = (
            "{n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
            if bar.total
            else "{n_fmt} [{elapsed}, {rate_fmt}{postfix}]"
        )
        text = bar.format_meter(**{**counters, "prefix": "", "bar_format": layout})
        context.send(
            Progress(
                rank=context.rank,
                bar=id(bar),
                desc=str(bar.desc or "").rstrip(": "),
                n=bar.n,
                total=bar.total,
                text=text,
                closed=closing,
            )
        )
    return True


GPU_MEMORY_INTERVAL = 2.0  # seconds between two samples of a rank's GPU memory


def report_gpu_memory(context: ctx.RankContext) -> None:
    """GPU runs: the caching allocator's counters (host-side reads, no CUDA sync) for the dashboard's rows."""
    import torch

    index = torch.device(context.device).index or 0  # not current_device(): that is per thread
    while True:
        context.send(
            GpuMemory(
                rank=context.rank,
                reserved=torch.cuda.memory_reserved(index),
                peak=torch.cuda.max_memory_reserved(index),
            )
        )
        time.sleep(GPU_MEMORY_INTERVAL)
