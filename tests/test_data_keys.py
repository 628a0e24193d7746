"""Notebook data keyed by id(source): an id freed between two pickles of one launch (a temporary a reducer made,
or a source the notebook let go before a restart re-pickles) must not make two objects share a block or a key."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

import ddpnb
from ddpnb.engines.ray.data import ObjectStoreShipment, RefStore
from ddpnb.node import mapped as rank_side
from ddpnb.node import shared
from tests.conftest import private_runs_dir

MIB = 1 << 20


def _fresh_arrays(count: int, start: int) -> list[np.ndarray]:
    return [np.full(MIB // 8, start + i, dtype=np.float64) for i in range(count)]


def test_a_freed_sources_id_taken_by_another_keeps_the_first_ones_segment_in_the_launch():
    store = shared.Store()
    first = shared.MemoryShipment(store)
    old = np.full(MIB // 8, 1.0)
    first.reduce_array(old)
    first.fds()
    first.commit()  # `old` now lies in an earlier launch's segment, reused below
    launch = shared.MemoryShipment(store)
    segments = {launch.reduce_array(old)[1][0]}
    del old  # the first pickle's temporary, gone before the next pickle of the same launch
    gc.collect()
    held = []
    for new in _fresh_arrays(50, 2):  # the freed id is taken again by one of these, in practice
        segments.add(launch.reduce_array(new)[1][0])
        held.append(new)
    assert segments <= set(launch.fds()), "a pickle refers to a segment the ranks are not given"
    launch.commit()


def test_object_store_keys_stay_distinct_when_a_freed_id_is_taken_again():
    shipment = ObjectStoreShipment(RefStore())
    base = np.arange(MIB // 4, dtype=np.float64).reshape(256, -1)
    view = base[:, ::2]  # not contiguous: what is put is a copy, so nothing else holds the view
    keys = [shipment.reduce_array(view)[1][0]]
    freed = id(view)
    del view
    gc.collect()
    taker = None
    for factor in range(2, 200):  # one of these takes the freed id, in practice (unless the shipment holds it)
        array = base[:, 1::2] if factor % 2 else (base * factor)[:, ::2]
        if id(array) == freed:
            taker = array
            break
        del array
    arrays = [taker if taker is not None else (base * 2)[:, ::2], (base * 1000)[:, 1::2]]
    keys += [shipment.reduce_array(array)[1][0] for array in arrays]
    assert len(set(keys)) == len(keys)
    for key, array in zip(keys[1:], arrays):
        assert np.array_equal(shipment.pending[key].data().view(np.float64).reshape(array.shape), array)


@pytest.fixture
def runs_dir(tmp_path_factory):
    with private_runs_dir(tmp_path_factory) as path:
        yield path


def test_a_restart_gives_the_ranks_the_segment_of_the_functions_closure_data_again(runs_dir, tmp_path):
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB in the closure: in the function's pickle, by segment
    marker = tmp_path / "failed-once"

    def train(rank, world_size):
        if not marker.exists():
            marker.touch()  # by every rank: the one that fails first may be the only one not stopped before it
            raise RuntimeError("the first attempt fails")
        return float(big.sum())

    result = ddpnb.run(train, nprocs=2, max_restarts=1, view="none")
    assert result == float(big.sum())


def test_a_pickle_after_the_ranks_were_given_the_files_never_rewrites_what_they_map():
    """A restart pickles the args again with the launch's shipment: a new source then must not rewrite the segment
    earlier blocks lie in (new files holding only the new bytes, zeros where the earlier ones were)."""
    shipment = shared.MemoryShipment(shared.Store())
    first, second = torch.full((MIB,), 3.0), torch.full((MIB,), 5.0)
    shipment.reduce_tensor(first)
    shipment.fds()  # the first attempt's ranks
    shipment.reduce_tensor(first)  # the restart's pickle: the same block ...
    shipment.reduce_tensor(second)  # ... and a new source (a CUDA tensor's fresh CPU copy, say)
    files = shipment.fds()
    for tensor in (first, second):
        block = shipment.used[id(tensor.untyped_storage())]
        copies = tuple(os.dup(fd) for fd in files[block.segment.id])
        mapped = rank_side._map_stripes(copies)
        for fd in copies:
            os.close(fd)
        assert mapped[block.offset : block.offset + block.nbytes] == tensor.numpy().tobytes()
        mapped.close()
    shipment.commit()
