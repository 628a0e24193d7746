"""What a run is asked to be: the names users pass as strings, as enums; the spec every rank receives; planning."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from ddpnb.core.words import Named


class ViewKind(Named):
    """How a run is shown: the dashboard, text lines, nothing, or the first that fits the front end."""

    AUTO = "auto"
    WIDGET = "widget"
    TEXT = "text"
    NONE = "none"


class Stream(Named):
    """Which of a rank's output streams a chunk or line came from."""

    STDOUT = "stdout"
    STDERR = "stderr"


class CallStyle(Named):
    """How each rank calls the function it is given."""

    AUTO = "auto"  # fn(), fn(rank) or fn(rank, world_size) by its parameters, then the extra args
    SPAWN = "spawn"  # fn(rank, *args), as torch.multiprocessing.spawn calls it


class LaunchError(ValueError):
    """The run cannot start as asked (bad arguments, too many GPUs). Nothing was started."""


def check_platform() -> None:
    """ddpnb needs Linux: its ranks' memory files (`memfd_create`), the kernel's epoll reader and `/proc`."""
    if not sys.platform.startswith("linux"):
        raise LaunchError(f"ddpnb runs on Linux only (it uses memory files, epoll and /proc), not on {sys.platform}: "
                          "run the Jupyter kernel in WSL2, a Linux container or a Linux VM.")


@dataclass
class WorkerSpec:
    """What every rank needs; sent to the ranks pickled, never in argv or the environment."""

    fn_payload: bytes  # cloudpickled function
    args: tuple[Any, ...]
    call_style: CallStyle
    world_size: int
    backend: str
    use_gpus: bool
    environ: dict[str, str]
    run_dir: str
    sources: dict[str, list[str]] = field(default_factory=dict)  # notebook cells, so tracebacks show lines
    cell_names: dict[str, str] = field(default_factory=dict)  # their files' names, 'Cell In[7]', for warnings
    torch_threads: int | None = None
    timeout: float | None = None  # seconds an attempt may run (--timeout); an engine may bound its own waits by it
    # restarts and checkpoints (`--max-restarts`, `ddpnb.save_checkpoint`): each attempt gets its own spec
    attempt: int = 0  # 0 for the first attempt, n after n restarts (`ddpnb.attempt()`)
    checkpoint_dir: str = ""  # where this run's checkpoints go (under the run directory unless --checkpoint-dir)
    resume_dir: str = ""  # an earlier run's checkpoints, read while this run has none of its own (--resume)
    keep_checkpoints: int = 3  # complete checkpoints kept; older ones are deleted after each save
    prompts: bool = False  # the front end answers a rank's debugger prompt (a foreground cell that takes input)
    debug: bool = False  # --debug: a rank that raises opens a post-mortem prompt first (where `prompts`)
    profile: tuple[int, int] | None = None  # --profile: the first and last step to profile (`rank.profile`)


def stall_seconds(stall: object) -> float | None:
    """--stall / `stall=`: seconds without progress that mark a run stalled; None (adapt to the run) or 0 (off)."""
    if stall is None:
        return None
    try:
        seconds = float(stall) if not isinstance(stall, bool) else -1.0
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):  # nan too
        raise LaunchError(f"stall takes a number of seconds without progress after which the run is marked stalled "
                          f"(0 turns this off; leave it out to adapt to the run), not {stall!r}: e.g. --stall 120.")
    return seconds


CPU_FALLBACK_VAR = "DDPNB_CPU_FALLBACK"
DEFAULT_CPU_RANKS = 2


@dataclass(frozen=True)
class Plan:
    """How a launch's flags were read: the world size, whether ranks use GPUs, the backend."""

    world_size: int
    use_gpus: bool
    backend: str
    note: str = ""  # said in the run's header: how the request was read (a CPU fallback)


def enabled(name: str) -> bool:
    """An on/off environment variable: unset, empty, 0, false, no and off are off."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def is_seconds(value: object, zero: bool = False) -> bool:
    """A number of seconds a caller may pass: a real number above 0 (or 0 too, with `zero`); not a bool, a string,
    nor nan."""
    return not isinstance(value, bool) and isinstance(value, int | float) and (value >= 0 if zero else value > 0)


def plan(gpus: int | str | None, nprocs: int | None, backend: str | None, available: int | None,
         engine: str = "local") -> Plan:
    """The world size, devices and backend for the flags given; raises LaunchError for impossible ones.
    `available` is the GPUs `engine` can count here, None where its cluster places the ranks."""
    if nprocs is not None and (not isinstance(nprocs, int) or nprocs < 1):
        raise LaunchError(f"nprocs must be a positive integer, not {nprocs!r}.")
    if backend is not None and backend not in ("nccl", "gloo"):
        raise LaunchError(f"backend must be 'nccl' or 'gloo', not {backend!r}.")
    note = ""
    if gpus is None:
        world_size, use_gpus = nprocs or DEFAULT_CPU_RANKS, False
    else:
        if gpus == "all":
            if available is None:
                raise LaunchError(f"--engine {engine} takes a number of GPUs (--gpus N), not 'all': the ranks go where "
                                  "the cluster has GPUs, so 'all' has no meaning there.")
            if available == 0 and not enabled(CPU_FALLBACK_VAR):
                raise LaunchError(no_gpus_message("all", available))
            wanted = available or nprocs or DEFAULT_CPU_RANKS
        else:
            try:
                wanted = int(gpus)
            except ValueError:
                raise LaunchError(f"--gpus takes a number or 'all', not {gpus!r}.") from None
            if wanted < 1:
                raise LaunchError(f"--gpus must be at least 1, not {wanted}.")
        if nprocs is not None and nprocs != wanted:
            raise LaunchError(f"--gpus {gpus} starts one rank per GPU; leave out --nprocs {nprocs}.")
        if available is None or wanted <= available:
            world_size, use_gpus = wanted, True
        elif enabled(CPU_FALLBACK_VAR):
            world_size, use_gpus = wanted, False
            note = (f"{available} GPU(s) here: running --gpus {gpus} as {wanted} CPU ranks over gloo "
                    f"({CPU_FALLBACK_VAR} is set)")
        else:
            raise LaunchError(no_gpus_message(gpus, available))
    if backend == "nccl" and not use_gpus:
        raise LaunchError("the nccl backend needs GPUs; use --gpus N, or gloo for CPU ranks.")
    return Plan(world_size, use_gpus, backend or ("nccl" if use_gpus else "gloo"), note)


def local_gpu_count() -> int:
    """GPUs this process may use, counted through NVML: CUDA is not initialised in the kernel."""
    import torch

    return torch.cuda.device_count()


def no_gpus_message(gpus: int | str, available: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    have = f"{available} GPU(s) visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
    fewer = f"use --gpus {available} or fewer, " if available else ""
    return (f"--gpus {gpus} asks for more GPUs than this machine has: {have}. To go on, {fewer}run on CPU ranks "
            f"with -n N (gloo), or set {CPU_FALLBACK_VAR}=1 to dry-run --gpus notebooks on CPU ranks.")
