"""What a rank measures of itself for the straggler radar and the hardware columns (docs/stragglers-and-hardware.md).

Compute per step: between two reports (`StepClock`, driven by `ddpnb.log(step=...)`), the time the logging
thread was busy, on a CPU or ready and waiting for one, from the kernel's own scheduler accounting
(`/proc/thread-self/schedstat`). A thread waiting in a collective sleeps (gloo's work and DDP's reducer wait on a
condition variable, in C++ where Python cannot time them), so that time is left out wherever the wait is issued.

Hardware: a daemon thread samples the rank's own process once a second (CPU, resident memory; utilisation, memory
and power of its GPU through NVML where `nvidia-ml-py` is installed) and sends one message: the same code on every
engine, since Ray's ranks run on nodes the kernel cannot read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpnb import _compat
from ddpnb.core.messages import Hardware, Message, StepTimes

STEP_REPORT_INTERVAL = 0.5  # seconds between two StepTimes messages from a rank, at least
HARDWARE_INTERVAL = 1.0  # seconds between two hardware samples of a rank
ARRIVALS_KEPT = 64  # a report's collectives at most: one step's, for the kernel to see who came last
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def thread_busy() -> float:
    """Seconds this thread has spent on a CPU or runnable and waiting for one; where the kernel keeps no
    scheduler statistics, its CPU time alone."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as stat:
            on_cpu, waiting, _ = stat.read().split()
    except (OSError, ValueError):
        return time.thread_time()
    return (int(on_cpu) + int(waiting)) / 1e9


def step_arrivals(since_ns: int) -> tuple[tuple[str, int, int], ...]:
    """The collectives this rank issued after `since_ns` (the previous `ddpnb.log`: the step just ended), as
    (process group, number, ns); none without a process group or where torch keeps no record."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return ()  # one rank waits for nobody
    if (dist.get_rank(), dist.get_world_size()) != (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])):
        return ()  # a group of the user's own in place of the run's (`group.own_group`, which this cannot import)
    arrivals = _compat.collective_arrivals(str(dist.get_backend()))
    return tuple([a for a in arrivals or () if a[2] > since_ns][-ARRIVALS_KEPT:])


class StepClock:
    """Turns `ddpnb.log(step=...)` calls into a `StepTimes` message about every STEP_REPORT_INTERVAL: two clock
    reads per call; at a report, one scheduler read and the step's collectives from torch's Flight Recorder.

    Reports fall on steps every rank shares: a multiple of a power of two steps, sized from the rank's own pace,
    which DDP keeps the same on every rank. So the kernel gets every rank's arrivals at the same collectives."""

    def __init__(self, arrivals: Callable[[int], tuple[tuple[str, int, int], ...]] = step_arrivals) -> None:
        self.arrivals = arrivals
        self.step: int | None = None  # at the latest report
        self.at = 0.0
        self.busy = 0.0
        self.thread = 0
        self.every = 1  # steps between two reports: a power of two
        self.previous_ns = 0  # the latest call's wall clock: where this step's collectives begin

    def tick(self, rank: int, step: int) -> StepTimes | None:
        """The report due at this step, if one is."""
        previous, self.previous_ns = self.previous_ns, time.time_ns()
        thread = threading.get_ident()
        # a step counted down (a new epoch from 0) or another thread logging: start again rather than mix clocks
        if self.step is None or step <= self.step or thread != self.thread:
            self.step, self.at, self.busy, self.thread = step, time.monotonic(), thread_busy(), thread
            return None
        # steps that never fall on a multiple (all odd) still report, unaligned
        if step % self.every and step - self.step < 4 * self.every:
            return None
        now = time.monotonic()
        if now - self.at < STEP_REPORT_INTERVAL / 2:  # faster than planned: report half as often
            self.every *= 2
            return None
        busy, steps, wall = thread_busy(), step - self.step, now - self.at
        while self.every > 1 and wall / steps * self.every / 2 >= STEP_REPORT_INTERVAL:
            self.every //= 2
        while wall / steps * self.every < STEP_REPORT_INTERVAL:
            self.every *= 2
        due = StepTimes(
            rank=rank, steps=steps, wall=wall, compute=busy - self.busy, step=step, arrivals=self.arrivals(previous)
        )
        self.step, self.at, self.busy = step, now, busy
        return due


def process_sample() -> tuple[float, int | None]:
    """The process's CPU seconds so far (every thread) and its resident memory in bytes (None where unknown)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            rss: int | None = int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        rss = None
    return time.process_time(), rss


class Gpu:
    """The rank's GPU through NVML, or nothing: without `nvidia-ml-py`, a driver, or the device, `read()` is None.
    NVML reads the driver's counters and creates no CUDA context."""

    def __init__(self, device: str) -> None:
        self.nvml: Any = None
        self.handle: Any = None
        if not device.startswith("cuda"):
            return
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            self.handle = _nvml_handle(pynvml, device)
            self.nvml = pynvml
        except pynvml.NVMLError:
            self.handle = None

    def read(self) -> tuple[float, int, float] | None:
        """(utilisation %, memory used in bytes, power in watts)."""
        if self.handle is None:
            return None
        nvml = self.nvml
        try:
            return (
                float(nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu),
                int(nvml.nvmlDeviceGetMemoryInfo(self.handle).used),
                nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000,
            )
        except nvml.NVMLError:
            return None


def _nvml_handle(pynvml: Any, device: str) -> Any:
    """The NVML device behind `cuda:N`: CUDA numbers the devices CUDA_VISIBLE_DEVICES lists (indices or UUIDs),
    NVML every device on the machine."""
    index = int(device.partition(":")[2] or 0)
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    entry = visible[index] if index < len(visible) else str(index)
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)


def sample_hardware(
    rank: int, device: str, send: Callable[[Message], None], interval: float = HARDWARE_INTERVAL
) -> None:
    """The hardware thread: one `Hardware` message an `interval`, for the rank's whole life."""
    gpu = Gpu(device)
    cpu_before, _ = process_sample()
    before = time.monotonic()
    while True:
        time.sleep(interval)
        cpu, rss = process_sample()
        now = time.monotonic()
        used = gpu.read()
        send(
            Hardware(
                rank=rank,
                time=time.time(),
                cpu=100 * (cpu - cpu_before) / (now - before),
                rss=rss or 0,
                gpu_util=used[0] if used else None,
                gpu_memory=used[1] if used else None,
                gpu_power=used[2] if used else None,
            )
        )
        cpu_before, before = cpu, now
