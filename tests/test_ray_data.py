"""Notebook data on `--engine ray` (issue 16): through Ray's object store, reused across launches while unchanged,
bounded, a session's pushes and arguments too, CUDA tensors' rank side.

One kernel and one local Ray instance (started by ddpnb in that kernel) for the module, as in tests/test_ray.py;
a Ray session of its own for each session test (a session holds the instance's CPUs, which a run needs).
"""

from __future__ import annotations

import re
import time

import pytest

from ddpnb.core.data import KEEP_LAUNCHES
from tests.test_ray import CELL_TIMEOUT, RAY_TEST_TIMEOUT, needs_ray, ray_kernel, run_actors_left

__all__ = ["ray_kernel"]  # the module's one kernel and Ray instance (a fixture)

pytestmark = [needs_ray, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(RAY_TEST_TIMEOUT)]
MB = 1 << 20


def last_lines(kernel, code: str, count: int = 1) -> list[str]:
    run = kernel.execute(code, timeout=CELL_TIMEOUT)
    assert run.error is None, "\n".join(run.error["traceback"]) + run.stdout + run.stderr
    return run.stdout.strip().splitlines()[-count:]


@pytest.fixture
def ray_session(ray_kernel):
    """A session of 2 Ray ranks, as `s` in the kernel: one per test, since it holds the CPUs of the module's Ray
    instance that the other tests' runs need, whichever order they run in."""
    last_lines(
        ray_kernel,
        "import numpy as np, gc\nfrom ddpnb.engines.ray import data as ray_data\n"
        "s = ddpnb.session(engine='ray', nprocs=2)",
    )
    yield ray_kernel
    last_lines(ray_kernel, "s.stop(); print('stopped')")


def test_a_tensor_launched_again_unchanged_is_not_put_again_and_an_in_place_change_is(ray_kernel):
    """Two launches with the same 64 MB tensor (and a 4 MB array): the second puts nothing and reuses both; after
    an in-place change in the notebook the next launch puts them again and the ranks see the new values."""
    code = """
weights = torch.zeros(16 << 20)  # 64 MB
labels = np.zeros(4 << 20, dtype=np.uint8)

def reads(rank):
    return [weights[-1].item(), int(labels[-1]), weights.sum().item()]

sent = []
for change in (False, False, True):
    if change:
        weights[-1] = 5  # in place: the tensor's version counter moves
        labels[-1] = 3  # an array has none: its bytes are compared with the object store's copy
    value = ddpnb.run(reads, engine="ray", nprocs=2, view="none")
    data = ddpnb.last_run().data
    sent.append((value, data.written, data.reused, data.blocks))
for row in sent:
    print(row)
"""
    first, again, changed = last_lines(ray_kernel, "import numpy as np\n" + code, 3)
    both = 64 * MB + 4 * MB
    assert first == f"([0.0, 0, 0.0], {both}, 0, 2)"
    assert again == f"([0.0, 0, 0.0], 0, {both}, 2)"  # nothing put again
    assert changed == f"([5.0, 3, 5.0], {both}, 0, 2)"
    assert run_actors_left([ray_kernel.pid]) == []


def _plasma(kernel) -> tuple[float, int]:
    """The object store's use as Ray reports it (a private helper: this is a test), in MiB and objects."""
    line = last_lines(
        kernel,
        "from ray._private.internal_api import memory_summary\n"
        # by address: without one Ray looks for every instance on the machine (the session's `ray start` too)
        "summary = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)\n"
        "print([l for l in summary.splitlines() if 'Plasma memory' in l])",
    )[0]
    found = re.search(r"usage (\d+) MiB, (\d+) objects", line)
    assert found, line
    return float(found.group(1)), int(found.group(2))


def test_twenty_pushes_of_fresh_data_keep_the_refs_held_and_the_object_store_bounded(ray_session):
    """20 commands each sending a new 16 MB tensor the notebook keeps: the kernel holds the references of the
    latest KEEP_LAUNCHES only, and Ray's object store frees the rest; once the notebook lets the tensors go, so
    does the kernel. (Pushes into a running session rather than 20 launches: the same store, the same `commit`,
    without 20 Ray Train start-ups.)"""
    before = _plasma(ray_session)  # what the module's earlier tests left there (their notebook values, held)
    held = last_lines(
        ray_session,
        """
kept = []
for i in range(20):
    kept.append(torch.full((4 << 20,), float(i)))  # 16 MB, new every time
    s.push(fresh=kept[-1])
    assert s.data.written == 16 << 20 and s.data.reused == 0, s.data
print(s.pull("fresh")[0][0].item(), len(ray_data.store.entries), ray_data.store.held_bytes())
""",
    )[0]
    assert held.split() == ["19.0", str(KEEP_LAUNCHES), str(KEEP_LAUNCHES * 16 * MB)]
    deadline = time.monotonic() + 60  # Ray frees an object once no reference to it is left, asynchronously
    # those the kernel keeps, and at most the latest command's, which its ranks hold until the next one
    bounded = (before[1] + KEEP_LAUNCHES + 1, before[0] + (KEEP_LAUNCHES + 1) * 16 + 1)
    while (
        (used := _plasma(ray_session))
        and (used[1] > bounded[0] or used[0] > bounded[1])
        and time.monotonic() < deadline
    ):
        time.sleep(1)
    assert used[1] <= bounded[0] and used[0] <= bounded[1], (used, before)
    released = last_lines(ray_session, "del kept\ngc.collect()\nprint(len(ray_data.store.entries))")[0]
    assert released == "0"


def test_a_session_push_and_call_on_ray_put_big_data_once_and_writes_stay_in_their_rank(ray_session):
    """`push(data=...)` and a `call`'s arguments on a Ray session: put into the object store once, not pickled
    into each rank's command; right values on both ranks, a rank's in-place write its own, the notebook's tensor
    unchanged; pushed again unchanged, nothing is put again."""
    lines = last_lines(
        ray_session,
        """
big = torch.arange(16 << 20, dtype=torch.float32)  # 64 MB
table = np.arange(1 << 20, dtype=np.int32).reshape(1024, 1024)  # 4 MB
s.push(big=big, table=table)
pushed = s.data
s.execute("if rank == 1:\\n    big.add_(1); table[:] = -1")
seen = s.execute("(big[0].item(), big[-1].item(), int(table[0, 1]), table.shape, table.dtype.str)")
def total(tensor, array):
    tensor.mul_(0)  # in this rank's copy only
    return tensor.sum().item(), int(array.sum(dtype=np.int64))
called = s.call(total, big, table)
via_call = s.data
s.push(big=big)
print(pushed.written, pushed.blocks, via_call.written, via_call.reused, s.data.written, s.data.reused)
print(list(seen))
print(list(called), big[0].item(), big[-1].item(), int(table[0, 1]))
""",
        3,
    )
    sent, seen, called = lines
    both = 64 * MB + 4 * MB
    assert sent.split() == [str(both), "2", "0", str(both), "0", str(64 * MB)], lines
    last = float((16 << 20) - 1)
    assert seen == f"[(0.0, {last}, 1, (1024, 1024), '<i4'), (1.0, {last + 1}, -1, (1024, 1024), '<i4')]", lines
    table_sum = sum(range(1 << 20))
    assert called == f"[(0.0, {table_sum}), (0.0, {table_sum})] 0.0 {last} 1", lines


def test_a_notebook_cuda_tensor_put_as_its_cpu_copy_is_rebuilt_on_a_cpu_rank_as_it_was(ray_session):
    """CUDA tensors on Ray, the part a machine without a GPU can run: a CUDA tensor's CPU copy, put into the object
    store, is rebuilt by the rank-side function the kernel's reduction names (`fetched.rebuild_from_cuda`), a Parameter
    still a Parameter with its requires_grad, and kept on the CPU on a CPU rank (a GPU rank moves it onto its own
    device, `rank.data.from_cuda`). No CUDA tensor can be made here, so the rank puts the copy itself."""
    shown = last_lines(
        ray_session,
        """
def rebuilt_on_this_rank():
    import ray
    from ddpnb.engines.ray import fetched as data
    copy = torch.arange(1 << 20, dtype=torch.float32)
    data.receive({0: ray.put(torch.empty(0, dtype=torch.uint8).set_(copy.untyped_storage()).numpy())})
    tensor = data.rebuild_from_cuda(0, torch.float32, 0, (1 << 20,), (1,), True, True)
    return type(tensor).__name__, tensor.requires_grad, tensor.device.type, torch.equal(tensor.data, copy)
print(list(s.call(rebuilt_on_this_rank)))
""",
    )[0]
    assert shown == "[('Parameter', True, 'cpu', True), ('Parameter', True, 'cpu', True)]"
