"""Every use of another library's private API, in one place, so an upgrade that breaks one breaks here, loudly.

`tests/test_compat.py` calls each of these against the installed versions; a failure there names the helper and
the library to look at. Nothing else in ddpnb reaches into multiprocessing's, argparse's, cloudpickle's, torch's
(tensors, c10d, torch.cuda) or Ray's internals.
"""

from __future__ import annotations

import argparse
import multiprocessing.forkserver
import multiprocessing.spawn
import sys
from collections.abc import Callable
from typing import Any


# --- multiprocessing: the forkserver every local rank is forked from ----------------------------------------------
def forkserver_pid() -> int | None:
    """The PID of this process's forkserver, None if it is not running (multiprocessing keeps one per process)."""
    return multiprocessing.forkserver._forkserver._forkserver_pid


def forget_forkserver() -> None:
    """Reap a killed forkserver and forget its address, so that `ensure_running` starts a new one."""
    multiprocessing.forkserver._forkserver._stop()


Preparation = Callable[[str], dict[str, Any]]


def wrap_preparation_data(wrapper: Callable[[Preparation], Preparation]) -> None:
    """Replace `multiprocessing.spawn.get_preparation_data` (what a new process is told about the parent's main
    module) by `wrapper(original)`, once per process."""
    original = multiprocessing.spawn.get_preparation_data
    if getattr(original, "ddpnb_original", None) is not None:
        return
    wrapped = wrapper(original)
    wrapped.ddpnb_original = original  # type: ignore[attr-defined]
    multiprocessing.spawn.get_preparation_data = wrapped


# --- argparse ------------------------------------------------------------------------------------------------------
def parser_options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string `parser` takes (`-n`, `--nprocs`, `--timeout`, ...), in the order they were added."""
    return [option for action in parser._actions for option in action.option_strings]


# --- cloudpickle -------------------------------------------------------------------------------------------------
def code_reduce(code: Any) -> tuple[Any, tuple[Any, ...]]:
    """cloudpickle's reduction of a code object (rebuild function, its arguments), to keep the real filename."""
    import cloudpickle.cloudpickle as internals

    return internals._code_reduce(code)


# --- torch ---------------------------------------------------------------------------------------------------------
def default_store() -> Any:
    """The store the default process group rendezvoused on (Ray Train made the group: ddpnb reuses its store)."""
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_default_store()


def tensor_version(tensor: Any) -> int:
    """torch's count of in-place writes to `tensor`, shared with its views: while it stays the same, the data that
    was written from the tensor's storage before is still its data."""
    return tensor._version


def has_backward_hooks(tensor: Any) -> bool:
    """Whether hooks were registered on `tensor` (`Tensor.register_hook`): such a tensor is more than its storage."""
    return bool(tensor._backward_hooks)


def collective_arrivals(backend: str) -> list[tuple[str, int, int]] | None:
    """The collectives in torch's Flight Recorder ring (it records one where TORCH_FR_BUFFER_SIZE, or NCCL's
    TORCH_NCCL_TRACE_BUFFER_SIZE, was set before the process group was made), oldest first, each as (process
    group, its collective number in that group, when this rank issued it in ns since the epoch); None where this
    torch keeps no record for `backend` (gloo's since torch 2.7)."""
    import pickle

    import torch.distributed as dist

    try:
        import torch._C._distributed_c10d as c10d

        dump = c10d._dump_nccl_trace if backend == "nccl" else c10d._dump_fr_trace
        entries = pickle.loads(dump(True, False, False)).get("entries", [])  # collectives, no stacks, all states
        return [
            (str(e["process_group"][0]), int(e["collective_seq_id"]), int(e["time_created_ns"]))
            for e in entries
            if not e.get("is_p2p")
        ]
    # a torch without it, or whose dump reads otherwise: the radar goes without, the training never fails for it
    except (
        AttributeError,
        ImportError,
        RuntimeError,
        dist.DistError,
        KeyError,
        IndexError,
        TypeError,
        ValueError,
        pickle.UnpicklingError,
    ):
        return None


def in_bad_fork() -> bool:
    """torch's own flag: this process was forked after CUDA was initialised in its parent."""
    import torch

    return bool(getattr(torch.cuda, "_is_in_bad_fork", lambda: False)())


# --- Ray -------------------------------------------------------------------------------------------------------------
def canonical_ray_address(address: str | None) -> str | None:
    """The cluster address `ray.init(address)` would use; with None, the latest `ray start` on this machine."""
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(address)


def ray_in_worker() -> bool:
    """Whether this process is one of a Ray cluster's workers (an actor or a task), not a driver."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def ray_train_v2() -> bool:
    """Whether `TorchTrainer` is Ray Train v2 (the default in recent Ray; RAY_TRAIN_V2_ENABLED=1 in 2.43 and on)."""
    try:
        from ray.train.v2._internal.constants import is_v2_enabled
    except ImportError:
        return False
    return is_v2_enabled()


def ray_controller_callback() -> type:
    """Ray Train v2's controller callback base class: how ddpnb learns the controller it can ask to abort."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    return ControllerCallback


def ray_restart_failure(state: object) -> object | None:
    """The failure a Ray Train v2 controller state restarts the workers after (its RestartingState's error), or
    None for any other state: how ddpnb learns which rank's failure Ray Train is retrying (FailureConfig)."""
    from ray.train.v2._internal.execution.controller.state import RestartingState

    return state.training_failed_error if isinstance(state, RestartingState) else None


def ray_route_raylet_lines(route: Callable[[list[str]], None]) -> None:
    """Hand `route` the raylet's messages (a worker that died) that Ray's driver thread prints to this process's
    stdout, coloured, as `(raylet) ...` (`listen_error_messages`, even with log_to_driver=False); whatever else Ray
    prints is left alone. Once per process: later calls change the route."""
    from ray._private import worker

    global _raylet_route
    _raylet_route = route
    if getattr(worker.print_to_stdstream, "ddpnb_routed", False):
        return
    original = worker.print_to_stdstream

    def print_to_stdstream(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet" and _raylet_route is not None:
            _raylet_route(list(data.get("lines") or ()))
        else:
            original(data, ignore_prefix)

    print_to_stdstream.ddpnb_routed = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = print_to_stdstream


_raylet_route: Callable[[list[str]], None] | None = None


def ray_report_logger() -> object:
    """The logger Ray Train v2 writes a line to at every `ray.train.report` of every worker ("Reporting training
    result ..."), named by its module's file, outside `ray.train`'s logger tree (its LoggingConfig misses it)."""
    import logging

    from ray.train.v2._internal.execution import context

    return logging.getLogger(context.__file__)


def front_end_takes_input() -> bool:
    """Whether the cell running now can ask the front end for a line (`input()`): an IPython kernel whose
    execute request allowed stdin (JupyterLab does; nbclient does not). Outside a kernel (a script), False."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    kernel = getattr(shell, "kernel", None)
    return bool(getattr(kernel, "_allow_stdin", False))
