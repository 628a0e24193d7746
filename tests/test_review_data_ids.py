"""Notebook data keyed by id(source): an id freed between two pickles of one launch (a temporary a reducer made,
or a source the notebook let go before a restart re-pickles) must not make two objects share a block or a key."""

from __future__ import annotations

import gc

import numpy as np

from ddpnb.core import shared
from ddpnb.engines.ray.data import ObjectStoreShipment, RefStore

MIB = 1 << 20


def _fresh_arrays(count: int, start: int) -> list[np.ndarray]:
    return [np.full(MIB // 8, start + i, dtype=np.float64) for i in range(count)]


def test_a_freed_sources_id_taken_by_another_keeps_the_first_ones_segment_in_the_launch():
    store = shared.Store()
    first = shared.Shipment(store)
    old = np.full(MIB // 8, 1.0)
    first.reduce_array(old)
    first.fds()
    first.commit()  # `old` now lies in an earlier launch's segment, reused below
    launch = shared.Shipment(store)
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
        assert np.array_equal(shipment.pending[key].data.view(np.float64).reshape(array.shape), array)
