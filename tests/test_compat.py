"""Every private API ddpnb uses (`ddpnb/_compat.py`), called against the installed libraries. A failure here
means an upgrade moved one: the message names the helper and the library version to look at."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import multiprocessing.spawn
import os
import time
from collections.abc import Callable
from typing import Any

import pytest

import ddpnb
from ddpnb import _compat

HAVE_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.train") is not None


def call(helper: Callable[..., Any], library: str, *args: Any) -> Any:
    try:
        return helper(*args)
    except (AttributeError, ImportError, TypeError) as exc:
        pytest.fail(
            f"_compat.{helper.__name__} no longer works with {library} "
            f"{importlib.metadata.version(library) if library != 'python' else ''}: "
            f"{type(exc).__name__}: {exc}"
        )


def test_forkserver_internals_still_name_and_restart_the_forkserver():
    from ddpnb.node import forkserver

    forkserver.context()
    first = call(_compat.forkserver_pid, "python")
    assert isinstance(first, int) and os.path.exists(f"/proc/{first}"), "the forkserver PID is not a live process"
    with forkserver.lock:
        forkserver._stop()  # kills it, then `forget_forkserver`
    assert call(_compat.forkserver_pid, "python") is None
    forkserver.context()
    assert call(_compat.forkserver_pid, "python") not in (None, first)
    assert ddpnb.run(lambda: 7, nprocs=1, view="none") == 7  # ranks fork from the new one


def test_preparation_data_wrapper_keeps_the_main_module_out_of_ranks_only():
    from ddpnb.node import forkserver

    forkserver.context()
    wrapped = multiprocessing.spawn.get_preparation_data
    assert getattr(wrapped, "ddpnb_original", None) is not None, "spawn.get_preparation_data was not wrapped"
    assert "sys_path" in call(wrapped, "python", "ddpnb-rank0"), "get_preparation_data(name) changed its result"


def test_cloudpickle_code_reduce_rebuilds_a_code_object():
    def sample(x):
        return x + 1

    rebuild, args = call(_compat.code_reduce, "cloudpickle", sample.__code__)
    # ddpnb's pickler swaps cloudpickle's '<dynamic-code>' for the real filename in these arguments
    assert {"<dynamic-code>", sample.__code__.co_filename} & set(args), "the code's filename is no longer an argument"
    assert rebuild(*args).co_code == sample.__code__.co_code


def _store_kind():
    from ddpnb import _compat

    return type(_compat.default_store()).__name__


def test_c10d_default_store_is_reachable_in_a_rank():
    assert ddpnb.run(_store_kind, nprocs=1, view="none").endswith("Store")


def _arrivals_after_two_all_reduces(rank: int) -> tuple[list, int]:
    import torch
    import torch.distributed as dist

    from ddpnb import _compat

    for _ in range(2):
        dist.all_reduce(torch.ones(1))
    return _compat.collective_arrivals("gloo"), time.time_ns()


def test_flight_recorder_gives_each_collectives_group_number_and_wall_clock_time_on_gloo():
    arrivals, now = ddpnb.run(_arrivals_after_two_all_reduces, nprocs=2, view="none")
    assert arrivals is not None, "torch keeps no Flight Recorder for gloo"
    assert [(group, number) for group, number, _ in arrivals[-2:]] == [("0", 1), ("0", 2)], arrivals
    assert all(0 < now - ns < 60e9 for _, _, ns in arrivals[-2:]), (arrivals, now)  # the epoch's ns, as time_ns


def test_argparse_parser_options_are_every_flag_in_order():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("-n", "--nprocs")
    parser.add_argument("--timeout")
    assert call(_compat.parser_options, "python", parser) == ["-h", "--help", "-n", "--nprocs", "--timeout"]


def test_tensor_version_counts_in_place_writes_through_views_too():
    import torch

    tensor = torch.zeros(8)
    before = call(_compat.tensor_version, "torch", tensor)
    assert isinstance(before, int)
    tensor.add_(1)
    written = _compat.tensor_version(tensor)
    assert written > before, "an in-place write no longer moves the tensor's version"
    tensor[2:].mul_(2)  # a view's write changes the base's data: the reuse of its written bytes must see it
    assert _compat.tensor_version(tensor) > written, "a view's in-place write no longer moves its base's version"
    torch.ones(8) + tensor  # reading changes nothing
    assert _compat.tensor_version(tensor) == written + 1


def test_backward_hooks_are_seen_on_a_tensor():
    import torch

    tensor = torch.zeros(2, requires_grad=True)
    assert call(_compat.has_backward_hooks, "torch", tensor) is False
    tensor.register_hook(lambda grad: grad)
    assert call(_compat.has_backward_hooks, "torch", tensor) is True


def test_torch_bad_fork_flag_is_readable():
    import torch

    # the helper falls back to False without torch's private flag: that fallback must not hide the flag's loss
    assert hasattr(torch.cuda, "_is_in_bad_fork"), "torch.cuda._is_in_bad_fork is gone: in_bad_fork says False"
    assert call(_compat.in_bad_fork, "torch") is torch.cuda._is_in_bad_fork()


@pytest.mark.skipif(not HAVE_RAY, reason="ray[train] is not installed")
def test_ray_private_helpers_still_exist():
    assert call(_compat.canonical_ray_address, "ray", "127.0.0.1:6379").endswith(":6379")
    assert isinstance(call(_compat.ray_train_v2, "ray"), bool)
    callback = call(_compat.ray_controller_callback, "ray")
    assert hasattr(callback, "after_controller_start"), "Ray Train's ControllerCallback lost after_controller_start"
    assert hasattr(callback, "after_controller_state_update"), "Ray Train lost after_controller_state_update"
    assert call(_compat.ray_restart_failure, "ray", object()) is None
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.execution.controller.state import RestartingState

    error = WorkerGroupError("rank 1 died", {1: RuntimeError("died")})
    assert _compat.ray_restart_failure(RestartingState(training_failed_error=error)) is error
    assert call(_compat.ray_report_logger, "ray").name.endswith("context.py")
    from ray._private import worker

    # the raylet's messages still go through the module's print_to_stdstream, looked up at each call
    assert "print_to_stdstream" in worker.listen_error_messages.__code__.co_names
    routed: list[list[str]] = []
    call(_compat.ray_route_raylet_lines, "ray", routed.append)
    worker.print_to_stdstream({"lines": ["A worker died"], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert routed == [["A worker died"]]
