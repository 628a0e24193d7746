"""What a run is asked to be: the names users pass as strings, as enums; the spec every rank receives; planning."""

from __future__ import annotations

import os
import re
import resource
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
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
        raise LaunchError(
            f"ddpnb runs on Linux only (it uses memory files, epoll and /proc), not on {sys.platform}: "
            "run the Jupyter kernel in WSL2, a Linux container or a Linux VM."
        )


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
        raise LaunchError(
            f"stall takes a number of seconds without progress after which the run is marked stalled "
            f"(0 turns this off; leave it out to adapt to the run), not {stall!r}: e.g. --stall 120."
        )
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


def plan(
    gpus: int | str | None, nprocs: int | None, backend: str | None, available: int | None, engine: str = "local"
) -> Plan:
    """The world size, devices and backend for the flags given; raises LaunchError for impossible ones.
    `available` is the GPUs `engine` can count here, None where its cluster places the ranks."""
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise LaunchError(f"nprocs must be a positive integer, not {nprocs!r}: e.g. nprocs=2 (-n 2).")
    if isinstance(gpus, bool):  # int(True) is 1
        raise LaunchError(f"gpus takes a number of GPUs or 'all', not {gpus!r}: e.g. gpus=2 or gpus='all'.")
    if backend is not None and backend not in ("nccl", "gloo"):
        raise LaunchError(f"backend must be 'nccl' or 'gloo', not {backend!r}.")
    note = ""
    if gpus is None:
        world_size, use_gpus = nprocs or DEFAULT_CPU_RANKS, False
    else:
        if gpus == "all":
            if available is None:
                raise LaunchError(
                    f"--engine {engine} takes a number of GPUs (--gpus N), not 'all': the ranks go where "
                    "the cluster has GPUs, so 'all' has no meaning there."
                )
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
            note = (
                f"{available} GPU(s) here: running --gpus {gpus} as {wanted} CPU ranks over gloo "
                f"({CPU_FALLBACK_VAR} is set)"
            )
        else:
            raise LaunchError(no_gpus_message(gpus, available))
    if backend == "nccl" and not use_gpus:
        raise LaunchError("the nccl backend needs GPUs; use --gpus N, or gloo for CPU ranks.")
    return Plan(world_size, use_gpus, backend or ("nccl" if use_gpus else "gloo"), note)


RANKS_PER_CPU = 8  # CPU ranks per usable CPU beyond which a local launch needs `oversubscribe`
FEWEST_BOUND = 16  # ... but never fewer than this many, so a small machine can still rehearse a bigger run
PROCESS_LIMITS = ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max")


def bound_local_ranks(plan: Plan, oversubscribe: bool) -> None:
    """CPU ranks forked on this machine: more than it can hold is refused before one is forked. Above the
    process limit (a rank is at least one process) none of them could all start; above RANKS_PER_CPU a usable
    CPU (at least FEWEST_BOUND) they would crawl, unless `oversubscribe` says that is meant."""
    if plan.use_gpus:  # one rank per GPU: the GPUs bound them
        return
    ranks, cpus = plan.world_size, usable_cpus()
    limit, named = process_limit()
    if ranks >= limit:
        raise LaunchError(
            f"nprocs={ranks} (-n {ranks}) is more processes than this machine allows ({named}), so "
            f"the ranks could never all start: pass fewer, e.g. nprocs={cpus} (-n {cpus}), one per CPU."
        )
    bound = max(FEWEST_BOUND, RANKS_PER_CPU * cpus)
    if ranks > bound and not oversubscribe:
        raise LaunchError(
            f"nprocs={ranks} (-n {ranks}) is more than {RANKS_PER_CPU} ranks for each of the {cpus} "
            f"CPUs this kernel may use (at most {bound} here): pass fewer, e.g. nprocs={cpus} (-n "
            f"{cpus}), or oversubscribe=True (--oversubscribe) to start {ranks} anyway."
        )


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, a container's cpuset), not every CPU the machine has."""
    return len(os.sched_getaffinity(0))


def process_limit() -> tuple[int, str]:
    """The fewest processes this user may have: RLIMIT_NPROC (not for root), the kernel's pid_max and
    threads-max; with how it reads ('ulimit -u 4096')."""
    found = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:
        found.append((soft, f"ulimit -u {soft}"))
    for path in PROCESS_LIMITS:
        try:
            value = int(Path(path).read_text())
        except (OSError, ValueError):  # unreadable here
            continue
        found.append((value, f"{path} is {value}"))
    return min(found, default=(sys.maxsize, "no limit"))


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what a shell can export, and every rank's os.environ can hold


def check_env(env: object) -> None:
    """env= / --env: the variables every rank gets, names and values as strings; LaunchError saying what to pass."""
    if not isinstance(env, Mapping):
        example = "{'FOO': '1'}"
        if isinstance(env, str) and "=" in env:
            name, _, value = env.partition("=")
            example = f"{{{name.strip()!r}: {value.strip()!r}}}"
        raise LaunchError(
            f"env takes a dict of environment variable names to values, not {env!r}: e.g. "
            f"env={example} (in %%ddp: --env NAME=VALUE)."
        )
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise LaunchError(
                f"env: {name!r} is not an environment variable's name (--env NAME=VALUE): a name is "
                "letters, digits and underscores, not starting with a digit, e.g. NCCL_DEBUG."
            )
        if not isinstance(value, str):
            raise LaunchError(
                f"env: {name}'s value must be a string, not {type(value).__name__} {value!r}: pass "
                f"env={{{name!r}: str({value!r})}}, as the environment holds only strings."
            )
        if "\0" in value:
            raise LaunchError(
                f"env: {name}'s value {value!r} holds a NUL character, which no environment variable can: leave it out."
            )


def local_gpu_count() -> int:
    """GPUs this process may use, counted through NVML: CUDA is not initialised in the kernel."""
    import torch

    return torch.cuda.device_count()


def no_gpus_message(gpus: int | str, available: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    have = f"{available} GPU(s) visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
    fewer = f"use --gpus {available} or fewer, " if available else ""
    return (
        f"--gpus {gpus} asks for more GPUs than this machine has: {have}. To go on, {fewer}run on CPU ranks "
        f"with -n N (gloo), or set {CPU_FALLBACK_VAR}=1 to dry-run --gpus notebooks on CPU ranks."
    )
