"""Notebook data reaching the ranks once, through shared memory mapped copy-on-write (`ddpnb/node/shared.py`).

Each function is defined inside its test, so that it travels by value with what it closes over, as a notebook
cell's does. Every rank also says whether its tensor's bytes are pages of one of ddpnb's memory files
(`/proc/self/maps`), so these tests fail if the data quietly travelled in the pickle again.
"""

from __future__ import annotations

import collections
import gc
import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import psutil
import pytest
import torch

import ddpnb
from ddpnb.core import data as notebook_data
from ddpnb.node import mapped, shared
from ddpnb.rank import data as rank_data

MB = 1 << 20


def _mapped_from_memory_file(address: int) -> bool:
    """In a rank: whether `address` lies in a mapping of one of ddpnb's data files."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split(maxsplit=5)
            start, end = (int(part, 16) for part in span.split("-"))
            if start <= address < end:
                return "ddpnb-data" in (rest[-1] if len(rest) == 5 else "")
    return False


def _kernel_memory_files() -> dict[str, int]:
    """This process's open ddpnb data files (by fd) and their sizes: the shared memory the kernel holds."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            if "ddpnb-data" in target:
                found[f"{target} (fd {name})"] = os.fstat(int(name)).st_size
        except OSError:  # the listing's own fd, or one closed meanwhile
            continue
    return found


def test_closure_and_tensor_dataset_arrive_mapped_and_writes_stay_in_their_rank(monkeypatch):
    # whatever would start CUDA in the kernel (a tensor moved to a GPU, a device query) goes through
    # torch.cuda._lazy_init, GPU or not: it is recorded here instead
    cuda_started = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: cuda_started.append(True))
    big = torch.arange(64 * MB, dtype=torch.int32)  # 256 MB
    dataset = torch.utils.data.TensorDataset(torch.randn(2 * MB, 2), torch.arange(2 * MB))
    mapped = _mapped_from_memory_file

    def train(rank):
        import torch.distributed as dist

        x, y = dataset.tensors
        if rank == 1:  # in place, in rank 1 only
            big.add_(1)
            x.mul_(0)
        dist.barrier()
        return {
            "big": [big[0].item(), big[-1].item()],
            "x": [x[:3].tolist(), (x == 0).sum().item()],
            "y": y[-1].item(),
            "mapped": [mapped(t.data_ptr()) for t in (big, x, y)],
            "n": len(dataset),
        }

    seen = ddpnb.run(train, nprocs=2, view="none")
    assert seen["mapped"] == [True, True, True]
    assert seen["big"] == [0, 64 * MB - 1] and seen["y"] == 2 * MB - 1 and seen["n"] == 2 * MB
    # rank 1's mul_ never reached rank 0
    assert seen["x"] == [dataset.tensors[0][:3].tolist(), (dataset.tensors[0] == 0).sum().item()]
    assert big[0].item() == 0 and big[-1].item() == 64 * MB - 1  # nor the notebook
    sent = ddpnb.last_run().data
    assert sent.blocks == 3 and sent.written == big.nbytes + dataset.tensors[0].nbytes + dataset.tensors[1].nbytes
    assert cuda_started == []  # ddpnb never makes the kernel initialise CUDA


def test_data_striped_over_several_files_arrives_in_order_byte_for_byte():
    """A segment alternates over its files in STRIPE-long runs, written in parallel; a rank maps them back to back.
    A tensor over several stripes and an array starting mid-stripe must come out whole and in order."""
    big = torch.randint(0, 1 << 30, (7 * mapped.STRIPE // 8 // 2 + 12345,), dtype=torch.int64)  # 3.5 stripes
    array = np.random.default_rng(0).integers(0, 255, 3 * mapped.STRIPE // 2, dtype=np.uint8)

    def digest(values: torch.Tensor) -> list[int]:  # a position-weighted sum: a stripe out of place changes it
        weights = torch.arange(1, len(values) + 1, dtype=torch.int64) % 1009
        return [int((values * weights).sum()), int(values.sum()), len(values)]

    def train(rank):
        return [digest(big), digest(torch.from_numpy(array).long()), _mapped_from_memory_file(big.data_ptr())]

    expected = [digest(big), digest(torch.from_numpy(array).long()), True]
    assert ddpnb.run(train, nprocs=2, view="none") == expected
    segment_files = [name for name in _kernel_memory_files() if "ddpnb-data" in name]
    assert len(segment_files) >= min(shared.WRITERS, 2)  # more than one file written, where there are cores


def test_views_of_one_storage_still_share_it_and_a_parameter_keeps_requires_grad():
    base = torch.randn(1024, 1024, dtype=torch.float64)
    row, transposed = base[3, 10:], base.t()  # an offset view, a non-contiguous one
    weight = torch.nn.Parameter(torch.randn(MB))
    frozen = torch.nn.Parameter(torch.randn(MB), requires_grad=False)
    mapped = _mapped_from_memory_file

    def check(rank, row, transposed, weight, frozen):
        shares = row.untyped_storage().data_ptr() == transposed.untyped_storage().data_ptr()
        row.fill_(7)  # through one view: seen through the other, as in the notebook
        return {
            "shares": shares,
            "seen": transposed[10:, 3].unique().tolist(),
            "row": (row.storage_offset(), row.shape, row.stride(), row.dtype),
            "transposed": (transposed.shape, transposed.stride(), transposed.is_contiguous()),
            "weight": (type(weight).__name__, weight.requires_grad, weight.is_leaf),
            "frozen": (type(frozen).__name__, frozen.requires_grad),
            "mapped": mapped(weight.data_ptr()) and mapped(row.data_ptr()),
        }

    seen = ddpnb.run(check, nprocs=2, args=(row, transposed, weight, frozen), view="none")
    assert seen["shares"] and seen["seen"] == [7.0] and seen["mapped"]
    assert seen["row"] == (3 * 1024 + 10, torch.Size([1014]), (1,), torch.float64)
    assert seen["transposed"] == (torch.Size([1024, 1024]), (1, 1024), False)
    assert seen["weight"] == ("Parameter", True, True) and seen["frozen"] == ("Parameter", False)
    assert (base[3, 10:] != 7).any()  # the notebook's storage is untouched


def test_a_numpy_array_in_args_arrives_with_its_dtype_and_values_and_writes_stay_in_the_rank():
    table = np.arange(512 * 1024, dtype=np.int16).reshape(512, 1024)
    fortran = np.asfortranarray(np.random.default_rng(0).random((256, 1024), dtype=np.float32))
    mapped = _mapped_from_memory_file

    def check(rank, table, fortran):
        before = int(table.sum(dtype=np.int64))
        table[:] = -1
        fortran *= 0
        return {
            "dtype": table.dtype.str,
            "shape": table.shape,
            "sum": before,
            "writable": table.flags.writeable,
            "fortran": (fortran.dtype.str, fortran.flags.f_contiguous),
            "mapped": mapped(table.ctypes.data),
        }

    seen = ddpnb.run(check, nprocs=2, args=(table, fortran), view="none")
    assert seen["dtype"] == table.dtype.str and seen["shape"] == (512, 1024) and seen["writable"]
    assert seen["sum"] == int(table.sum(dtype=np.int64)) and seen["mapped"]
    assert seen["fortran"] == (fortran.dtype.str, True)
    assert table[0, 1] == 1 and fortran.sum() > 0  # the ranks' writes never reached the notebook
    assert ddpnb.last_run().data.blocks == 2


def test_unchanged_data_is_not_written_again_and_a_change_in_the_notebook_is():
    weights = torch.zeros(16 * MB)
    labels = np.zeros(8 * MB, dtype=np.uint8)

    def first(rank):
        return [weights[-1].item(), int(labels[-1])]

    assert ddpnb.run(first, nprocs=2, view="none") == [0.0, 0]
    assert ddpnb.last_run().data.written == weights.nbytes + labels.nbytes
    assert ddpnb.run(first, nprocs=2, view="none") == [0.0, 0]
    again = ddpnb.last_run().data
    assert again.written == 0 and again.reused == weights.nbytes + labels.nbytes
    assert ddpnb.run(lambda: "an evaluation cell in between", nprocs=1, view="none")
    assert ddpnb.run(first, nprocs=2, view="none") == [0.0, 0]
    assert ddpnb.last_run().data.written == 0  # still kept for reuse
    weights[-1] = 5  # in place, in the notebook: the tensor's version counter moves
    labels[-1] = 3  # an array has none: compared with what was written
    assert ddpnb.run(first, nprocs=2, view="none") == [5.0, 3]
    assert ddpnb.last_run().data.written == weights.nbytes + labels.nbytes


def test_a_released_tensors_copy_goes_away_and_nothing_is_left_after_a_failed_pickle():
    held_before = shared.store.held_bytes()

    def launch_and_let_go() -> None:
        data = torch.ones(32 * MB // 4)
        assert ddpnb.run(lambda: data.sum().item(), nprocs=1, view="none") == 32 * MB // 4
        assert shared.store.held_bytes() >= held_before + data.nbytes

    launch_and_let_go()  # the notebook lets go of the tensor: so does the kernel's copy
    gc.collect()
    assert shared.store.held_bytes() <= held_before

    import threading

    lock, big = threading.Lock(), torch.ones(8 * MB)
    files_before = _kernel_memory_files()
    try:
        ddpnb.run(lambda: (big, lock), nprocs=1, view="none")
    except ddpnb.NotPicklableError as exc:
        assert "_thread.lock" in str(exc)
    gc.collect()
    assert _kernel_memory_files() == files_before  # the launch that never started holds nothing


@pytest.mark.slow  # 50 launches: 10-30 s on the 2-core box
def test_fifty_launches_with_new_data_keep_kernel_memory_and_shared_memory_bounded():
    """The notebook keeps the latest ten tensors; ddpnb keeps what the latest launches sent, no more."""
    process = psutil.Process()
    kept: collections.deque[torch.Tensor] = collections.deque(maxlen=10)

    def launch() -> None:
        data = torch.full((16 * MB,), float(len(kept)))  # 64 MB, new at every launch
        kept.append(data)
        assert ddpnb.run(lambda: data[-1].item(), nprocs=1, view="none") == data[-1].item()
        assert ddpnb.last_run().data.written == data.nbytes

    for _ in range(10):
        launch()
    gc.collect()
    rss = process.memory_info().rss
    for _ in range(40):
        launch()
        held = _kernel_memory_files()
        assert (
            len(held) <= notebook_data.KEEP_LAUNCHES and sum(held.values()) <= notebook_data.KEEP_LAUNCHES * 64 * MB
        ), held
    gc.collect()
    assert process.memory_info().rss - rss < 64 * MB  # not one tensor's worth of growth over 40 launches
    kept.clear()  # the notebook lets go of them all: so does ddpnb
    gc.collect()
    assert _kernel_memory_files() == {}


def test_data_that_cannot_be_written_is_a_clear_error_that_starts_nothing_and_loses_nothing(tmp_path):
    """A fresh Python whose files may not grow past 32 MiB (RLIMIT_FSIZE: the memory files hit it as they would a
    full memory) launches over a 64 MiB tensor: a LaunchError saying what to do, no rank, no memory file kept, the
    tensor as it was, and the next launch without it runs."""
    script = tmp_path / "limited.py"
    script.write_text(
        textwrap.dedent("""
        import os, resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 20, 32 << 20))
        import torch, ddpnb
        data = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
        try:
            ddpnb.run(lambda: data.sum().item(), nprocs=2, view="none")
        except ddpnb.LaunchError as exc:
            print("ERROR:", exc)
        held = [n for n in os.listdir("/proc/self/fd") if "ddpnb-data" in os.path.realpath(f"/proc/self/fd/{n}")]
        print("HELD:", held, "INTACT:", data[-1].item() == (16 << 20) - 1)
        print("NEXT:", ddpnb.run(lambda: 7, nprocs=2, view="none"))
    """)
    )
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    error = next(line for line in done.stdout.splitlines() if line.startswith("ERROR:"))
    assert "64.0 MiB" in error and "could not be written into shared memory" in error and "File too large" in error
    assert "Nothing was started" in error and "del tensors you no longer need" in error
    assert "HELD: [] INTACT: True" in done.stdout and "NEXT: 7" in done.stdout, done.stdout


def test_strided_arrays_are_copied_one_at_a_time_as_they_are_written():
    """A strided array must be copied to be written in one run; four of 32 MiB each cost the kernel one copy at a
    time (numpy's allocations, as tracemalloc traces them), not all four held until the write, and arrive right."""
    bases = [np.full((2048, 4096), float(i)) for i in range(4)]  # 64 MiB each
    views = [base[:, ::2] for base in bases]  # 32 MiB each, not contiguous
    tracemalloc.start()
    try:
        held_before = tracemalloc.get_traced_memory()[0]
        seen = ddpnb.run(lambda: [float(v.sum()) for v in views], nprocs=1, view="none")
        peak = tracemalloc.get_traced_memory()[1] - held_before
    finally:
        tracemalloc.stop()
    assert seen == [float(v.sum()) for v in views]
    assert ddpnb.last_run().data.written == 4 * 32 * MB
    assert peak < 48 * MB, peak / MB  # one 32 MiB copy at a time; all four held until the write: 128 MiB


class _CudaCopy:
    """Stands in for a notebook CUDA tensor's CPU copy on a rank (no GPU here): records where `.data` is moved."""

    def __init__(self) -> None:
        self.moved_to: list[str] = []

    @property
    def data(self) -> _CudaCopy:
        return self

    @data.setter
    def data(self, value: _CudaCopy) -> None:
        assert value is self

    def to(self, device: str) -> _CudaCopy:
        self.moved_to.append(device)
        return self


@pytest.mark.parametrize("device", ["cuda:1", "cuda:3"])
def test_a_notebook_cuda_tensor_goes_onto_its_ranks_own_device_once_that_is_set_up(monkeypatch, device):
    """What a GPU rank does with a notebook CUDA tensor's CPU copy (`rank.data.from_cuda`, also called by the Ray
    engine's `fetched.rebuild_from_cuda`): unpickled before the rank's device is set up, it waits; then it goes onto that
    device, the rank's own, never cuda:0 for every rank. A CPU rank keeps it on the CPU."""
    monkeypatch.setattr(rank_data, "_device", None)
    monkeypatch.setattr(rank_data, "_pending", [])
    early, late, on_cpu = _CudaCopy(), _CudaCopy(), _CudaCopy()
    assert rank_data.from_cuda(early) is early and early.moved_to == []  # CUDA must not start before set-up
    rank_data.set_device(device)
    assert early.moved_to == [device]
    assert rank_data.from_cuda(late) is late and late.moved_to == [device]
    monkeypatch.setattr(rank_data, "_device", None)
    rank_data.from_cuda(on_cpu)
    rank_data.set_device("cpu")
    assert on_cpu.moved_to == []
