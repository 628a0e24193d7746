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

from ddpnb.core.messages import Hardware, Message, StepTimes

STEP_REPORT_INTERVAL = 0.5  # seconds between two StepTimes messages from a rank, at most
HARDWARE_INTERVAL = 1.0  # seconds between two hardware samples of a rank
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


class StepClock:
    """Turns `ddpnb.log(step=...)` calls into a `StepTimes` message at most every STEP_REPORT_INTERVAL: one clock
    read per call, one scheduler read per report."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.at = 0.0
        self.busy = 0.0
        self.thread = 0

    def tick(self, rank: int, step: int) -> StepTimes | None:
        """The report due at this step, if one is."""
        now = time.monotonic()
        if self.step is not None and now - self.at < STEP_REPORT_INTERVAL:
            return None
        busy, thread = thread_busy(), threading.get_ident()
        due = None
        # a step counted down (a new epoch from 0) or another thread logging: start again rather than mix clocks
        if self.step is not None and step > self.step and thread == self.thread:
            due = StepTimes(rank=rank, steps=step - self.step, wall=now - self.at, compute=busy - self.busy)
        self.step, self.at, self.busy, self.thread = step, now, busy, thread
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
            return (float(nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu),
                    int(nvml.nvmlDeviceGetMemoryInfo(self.handle).used),
                    nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000)
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


def sample_hardware(rank: int, device: str, send: Callable[[Message], None],
                    interval: float = HARDWARE_INTERVAL) -> None:
    """The hardware thread: one `Hardware` message an `interval`, for the rank's whole life."""
    gpu = Gpu(device)
    cpu_before, _ = process_sample()
    before = time.monotonic()
    while True:
        time.sleep(interval)
        cpu, rss = process_sample()
        now = time.monotonic()
        used = gpu.read()
        send(Hardware(rank=rank, time=time.time(), cpu=100 * (cpu - cpu_before) / (now - before),
                      rss=rss or 0, gpu_util=used[0] if used else None,
                      gpu_memory=used[1] if used else None, gpu_power=used[2] if used else None))
        cpu_before, before = cpu, now
