"""What the ranks run in the benchmarks, identical under every launcher.

Only the standard library at module level: under ddpnb these functions are pickled by value (as a notebook's
would be), and under torch.multiprocessing.spawn and torchrun this module is imported in every rank.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

RESULT_CHUNK_BYTES = 16 << 20  # one tensor of the big state dict
TRAIN_WARMUP_STEPS = 20

# Every parameter after (rank, world_size) is required: ddpnb passes `args` after as many of rank, world_size as
# the required parameters leave room for, so a defaulted parameter filled from `args` would shift them.


def init_from_env() -> None:
    """Join the process group the way a script for torchrun or mp.spawn does (a no-op under ddpnb)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")


def trivial(rank: int | None = None, world_size: int | None = None) -> dict[str, Any]:
    """The launch-latency workload: one all_reduce of one number."""
    import torch
    import torch.distributed as dist

    init_from_env()
    value = torch.ones(1)
    dist.all_reduce(value)
    return {"sum": value.item(), "pid": os.getpid()}


def trivial_with_torchvision(rank: int | None = None, world_size: int | None = None) -> dict[str, Any]:
    """The launch-latency workload of a cell that uses a library besides torch (torchvision: 2.6 s to import)."""
    import torchvision

    return {**trivial(rank, world_size), "torchvision": torchvision.__version__}


def trivial_after_matmul(rank: int | None = None, world_size: int | None = None) -> dict[str, Any]:
    """`trivial` after a multi-threaded 1500×1500 matmul in the rank, as the first step of any training does."""
    import torch

    a = torch.randn(1500, 1500)
    (a @ a).sum().item()
    return trivial()


def train(rank: int, world_size: int, steps: int, report: bool) -> dict[str, float]:
    """A small MLP on synthetic data under DDP; returns rank 0's steps/s over the timed steps.

    `report=True` calls `ddpnb.log(...)` and `print(...)` every step, as a user watching a run would.
    """
    import torch.distributed as dist

    step_once = _training_step(rank)
    log = _reporter() if report else None
    for step in range(TRAIN_WARMUP_STEPS):
        step_once(step, log)
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(TRAIN_WARMUP_STEPS, TRAIN_WARMUP_STEPS + steps):
        step_once(step, log)
    dist.barrier()
    elapsed = time.perf_counter() - started
    cpu = [0.0] * world_size
    dist.all_gather_object(cpu, (time.process_time() - cpu_started) / steps)
    # CPU time per step is what the rank itself spent, whatever else the machine's 2 cores were doing
    return {"steps_per_s": steps / elapsed, "seconds": elapsed, "cpu_per_step": sum(cpu) / world_size}


def _training_step(rank: int) -> Any:
    """The step `train` times: forward, backward and SGD on a DDP MLP, then the reporting."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # the same in every launcher: 2 ranks on 2 cores
    init_from_env()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(64, 256, generator=generator), torch.randint(0, 10, (64,), generator=generator)) for _ in range(16)
    ]
    loss_fn = torch.nn.CrossEntropyLoss()

    def step_once(step: int, log: Any) -> None:
        inputs, targets = batches[step % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        if log is not None:
            value = loss.item()
            log(step=step, loss=value)
            print(f"step {step} loss {value:.4f}")

    return step_once


def _reporter() -> Any:
    import ddpnb

    return ddpnb.log


def stream(rank: int, world_size: int, lines: int, rate: float) -> dict[str, Any]:
    """Print `lines` numbered lines as fast as print() goes, or at `rate` lines/s (in bursts of 100).

    Times each print to find the longest stall. Paced, it also tells a write that blocked (the pipe to the kernel
    was full: the thread slept, a voluntary context switch) from one that was merely descheduled (involuntary).
    """
    import resource

    import torch.distributed as dist

    write = print
    clock = time.perf_counter
    switches = (lambda: resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw) if rate else (lambda: 0)
    dist.barrier()
    started = time.time()
    begin = clock()
    worst = worst_blocked = 0.0
    over_5ms = blocked = 0
    for i in range(lines):
        if rate and i % 100 == 0:
            ahead = begin + i / rate - clock()
            if ahead > 0:
                time.sleep(ahead)
        slept = switches()
        before = clock()
        write(f"rank {rank} line {i}")
        took = clock() - before
        if switches() != slept:
            blocked += 1
            worst_blocked = max(worst_blocked, took)
        if took > 0.005:
            over_5ms += 1
            worst = max(worst, took)
    sys.stdout.flush()
    mine = {
        "ended": time.time(),
        "worst_stall_s": worst,
        "stalls_over_5ms": over_5ms,
        "blocked_writes": blocked,
        "worst_blocked_s": worst_blocked,
    }
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return {"started": started, "ranks": everyone}


def big_result(rank: int, world_size: int, nbytes: int) -> dict[str, Any]:
    """Rank 0 returns a state dict of `nbytes` of float32 tensors, stamped with the time it returns."""
    import torch

    if rank != 0:
        return {}
    count = max(1, nbytes // RESULT_CHUNK_BYTES)
    elements = RESULT_CHUNK_BYTES // 4
    state = {f"layer{i}.weight": torch.full((elements,), float(i)) for i in range(count)}
    state["_returned_at"] = time.time()
    return state


def checkpoints(rank: int, world_size: int, nbytes: int, saves: int) -> dict[str, Any]:
    """A DDP model of `nbytes` float32 parameters: `saves` synchronous, then `saves` asynchronous
    `ddpnb.save_checkpoint` calls, each after a training step; how long each call kept the step waiting, and
    how long the last asynchronous one took to be written (waited for at the end of the function)."""
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddpnb

    side = int((nbytes / 4) ** 0.5)
    model = DistributedDataParallel(torch.nn.Linear(side, side, bias=False))
    x = torch.randn(4, side)
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    step = 0
    for mode in ("sync", "async"):
        for _ in range(saves):
            model(x).sum().backward()
            step += 1
            started = time.perf_counter()
            ddpnb.save_checkpoint({"model": model}, step=step, asynchronous=mode == "async")
            blocked[mode].append(time.perf_counter() - started)
    started = time.perf_counter()
    from ddpnb.rank import checkpoint

    checkpoint.finish()  # what the end of the function waits for
    return {"blocked": blocked, "last_async_written_after": time.perf_counter() - started, "bytes": side * side * 4}
