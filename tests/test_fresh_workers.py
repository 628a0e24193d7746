"""Every run gets fresh worker processes: nothing one run leaves behind is there at the start of the next.

Workers are forked from a pre-warmed forkserver that imported torch once; these tests pin that this speed-up
keeps the semantics of brand-new processes (new PIDs; no Python globals, environment, threads, random state,
process group or CUDA state carried over). Each function reports what it finds when it starts and then leaves
marks of its own behind, so running it twice shows whether the second run sees the first one's marks.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

import ddpnb
from tests.conftest import left_in_groups

# Defined the way a notebook cell defines things: in `__main__`, so cloudpickle sends it by value, with its
# module-level global MARK.
NOTEBOOK_CELL = textwrap.dedent("""
    import os
    import sys

    MARK = None

    def leave_marks(rank, world_size, token):
        import json

        import __main__
        global MARK
        found = {
            "notebook global": MARK,
            "__main__ attribute": getattr(__main__, "ddpnb_test_mark", None),
            "environment variable": os.environ.get("DDPNB_TEST_MARK"),
            "attribute on an imported module": getattr(json, "ddpnb_test_mark", None),
            "module in sys.modules": "ddpnb_test_leaked_module" in sys.modules,
        }
        MARK = token
        __main__.ddpnb_test_mark = token
        os.environ["DDPNB_TEST_MARK"] = token
        json.ddpnb_test_mark = token
        sys.modules["ddpnb_test_leaked_module"] = type(sys)("ddpnb_test_leaked_module")
        return found
""")
CLEAN = {
    "notebook global": None,
    "__main__ attribute": None,
    "environment variable": None,
    "attribute on an imported module": None,
    "module in sys.modules": False,
}


def _notebook_function():
    namespace = {"__name__": "__main__"}
    exec(compile(NOTEBOOK_CELL, "<notebook cell>", "exec"), namespace)  # noqa: S102 - our own constant
    return namespace["leave_marks"]


def _rank_pids() -> list[int]:
    record = ddpnb.last_run()
    assert record is not None
    return [rank.pid for rank in record.ranks]


def _report_pid():
    import os

    return os.getpid()


def test_every_run_gets_new_worker_processes():
    import os

    seen: list[list[int]] = []
    for _ in range(3):
        rank0_pid = ddpnb.run(_report_pid, nprocs=2)
        pids = _rank_pids()
        assert rank0_pid == pids[0]
        assert os.getpid() not in pids
        assert left_in_groups(pids) == [], "what the workers of a finished run started is still alive"
        seen.append(pids)
    every = [pid for pids in seen for pid in pids]
    assert len(set(every)) == len(every), f"a PID was reused across runs: {seen}"


def test_globals_environment_and_modules_set_in_one_run_are_unset_in_the_next():
    leave_marks = _notebook_function()
    first = ddpnb.run(leave_marks, nprocs=2, args=("run-1",))
    second = ddpnb.run(leave_marks, nprocs=2, args=("run-2",))
    assert first == CLEAN
    assert second == CLEAN, "the second run saw what the first one left behind"


def _seeds(rank, world_size, seed):
    import torch
    import torch.distributed as dist

    found = (torch.initial_seed(), torch.rand(3).tolist())
    if seed is not None:
        torch.manual_seed(seed)
        torch.rand(1000)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, found)
    return everyone


def test_torch_random_state_starts_fresh_every_run():
    first = ddpnb.run(_seeds, nprocs=2, args=(1234,))
    second = ddpnb.run(_seeds, nprocs=2, args=(None,))
    seeds = [seed for seed, _ in first + second]
    draws = [tuple(draw) for _, draw in first + second]
    assert 1234 not in seeds, "the second run started from the seed the first one set"
    assert len(set(seeds)) == len(seeds), f"ranks or runs share a random seed: {seeds}"
    assert len(set(draws)) == len(draws), "ranks or runs draw the same random numbers"


def _leave_a_thread(rank, world_size, name):
    import threading
    import time

    found = sorted(t.name for t in threading.enumerate() if t.name.startswith("ddpnb-test-"))
    if name:
        threading.Thread(target=time.sleep, args=(3600,), name=name, daemon=False).start()
    return found


def test_a_thread_started_in_one_run_is_gone_in_the_next():
    assert ddpnb.run(_leave_a_thread, nprocs=2, args=("ddpnb-test-sleeper",)) == []
    assert ddpnb.run(_leave_a_thread, nprocs=2, args=(None,)) == []


def _cuda_state(rank, world_size):
    import os

    import torch

    def maps(pid: int | str) -> str:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()

    return {
        "initialised": torch.cuda.is_initialized(),
        "bad fork": torch.cuda._is_in_bad_fork(),
        "libcuda in this worker": "libcuda.so" in maps("self"),
        "libcuda in the process it was forked from": "libcuda.so" in maps(os.getppid()),
    }


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="without a usable GPU nothing can initialise CUDA, so every check here holds whatever the forkserver does",
)
def test_cuda_is_not_initialised_at_the_start_of_a_worker():
    """The forkserver never touches CUDA, so a worker forked from it may still initialise CUDA itself.

    A CPU-rank run on a GPU machine checks the same forkserver the GPU runs fork from.
    """
    assert ddpnb.run(_cuda_state, nprocs=2) == {
        "initialised": False,
        "bad fork": False,
        "libcuda in this worker": False,
        "libcuda in the process it was forked from": False,
    }


def _process_group_state(rank, world_size, leave_marks):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    found = {
        "initialised": dist.is_initialized(),
        "groups": len(c10d._world.pg_map),
        "store key from an earlier run": store.check(["ddpnb-test-mark"]),
    }
    if leave_marks:
        group = dist.new_group(ranks=list(range(world_size)))  # a second group the next run must not see
        dist.barrier(group=group)
        store.set("ddpnb-test-mark", "run-1")
    dist.barrier()  # rank 0 holds the store: keep it up until every rank has looked
    return found


def test_the_process_group_of_one_run_does_not_exist_in_the_next():
    from torch.distributed import distributed_c10d as c10d

    if not (hasattr(c10d, "_get_default_store") and hasattr(c10d, "_world")):
        pytest.skip("this torch has no _get_default_store / _world to inspect the process group with")
    fresh = {"initialised": True, "groups": 1, "store key from an earlier run": False}
    assert ddpnb.run(_process_group_state, nprocs=2, args=(True,)) == fresh
    assert ddpnb.run(_process_group_state, nprocs=2, args=(False,)) == fresh
