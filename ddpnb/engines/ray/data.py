"""Notebook data for Ray ranks through Ray's object store: put once by the kernel, fetched by every rank.

Kernel side: a launch's (or a session command's) `ObjectStoreShipment`, consulted by the pickler as
`node.shared.MemoryShipment` is on the local engine, keeps each big CPU tensor's storage and each big NumPy array out of
the pickle and leaves a key there; `put` puts each one into the object store once (`ray.put`) and hands every rank
the references. The `RefStore` keeps the references the latest launches used, by the notebook object they came
from, so that the next launch reuses what did not change instead of putting it again. Rank side (`fetched`): `rebuild_tensor`
/ `rebuild_array` map the memory file the node's host fetched the object into (`host.py`), copy-on-write, or fetch
it (a Ray Train worker) and copy it into the rank's own memory, since the object store's copy is read-only: a rank
that writes into its tensor changes neither the notebook's nor another rank's, as with a pickle.
"""

from __future__ import annotations

import itertools
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ddpnb import _compat
from ddpnb.core import data as notebook_data
from ddpnb.core.data import CHUNK, KEEP_LAUNCHES, MIN_BYTES
from ddpnb.core.record import DataSent
from ddpnb.engines.ray.fetched import rebuild_array, rebuild_from_cuda, rebuild_tensor
from ddpnb.rank.data import from_cuda


# --- kernel side ---------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Held:
    """One tensor storage's or array's bytes in the object store, and the notebook object they were taken from."""

    ref: Any  # its ObjectRef: holding it keeps the object in the store
    nbytes: int
    source: weakref.ref  # the notebook's storage or array: its death lets the object go
    version: int | None  # a tensor's version counter when put; None for an array (compared instead)
    launch: int = 0  # the latest launch that used it


class RefStore(notebook_data.BySource[Held]):
    """The object references the latest launches used, by the notebook object they came from; the kernel has
    one. Unlike memory files, each object stands alone in Ray's store: one dropped reference frees one object."""

    def __init__(self) -> None:
        super().__init__()
        self.connection: tuple[str, ...] | None = None  # the Ray connection the references belong to

    def connected(self, connection: tuple[str, ...]) -> None:
        """References from an earlier connection (another cluster, or Ray restarted) name nothing now: drop them."""
        with self.lock:
            if connection != self.connection:
                self.entries, self.connection = {}, connection

    def keep(self, used: Iterable[Held]) -> None:
        """Hold what a launch used next to what the KEEP_LAUNCHES before it used (as `node.shared.Store` does),
        while the notebook still holds each source; the rest is let go, so the object store does not grow run
        after run."""
        with self.lock:
            self.launches += 1
            held_now = dict(self.entries)
            for held in used:
                held.launch = self.launches
                if (source := held.source()) is not None:
                    held_now[id(source)] = held
            self.entries = {
                key: held
                for key, held in held_now.items()
                if held.source() is not None and held.launch > self.launches - KEEP_LAUNCHES
            }

    def held_bytes(self) -> int:
        with self.lock:
            return sum(held.nbytes for held in self.entries.values())


store = RefStore()


@dataclass
class _Unplaced:
    """An object the pickler kept out of the pickle, not put yet."""

    source: weakref.ref
    version: int | None
    data: Callable[[], Any]  # makes the bytes to put, a flat uint8 array: only when put, so no two copies are held


class ObjectStoreShipment:
    """One launch's data for Ray: what the pickler kept out of the pickle, and its object references once put."""

    def __init__(self, target: RefStore | None = None) -> None:
        self.store = target or store
        self.pending: dict[int, _Unplaced] = {}  # key -> what to put
        self.used: dict[int, Held] = {}  # key -> what this launch sent, put or reused
        self.refs: dict[int, Any] = {}  # key -> its ObjectRef, once put; held for the run's life (a restart's)
        self._keys: dict[int, tuple[weakref.ref, int]] = {}  # id(source) -> (source, key), within this launch
        self._numbers = itertools.count()  # keys are never reused: an id freed and taken again gets a new key
        self._sources: list[Any] = []  # the sources pickled, held until `put`, so their ids stay theirs
        self.written = self.reused = 0
        self.seconds = 0.0

    # the pickler's hooks: a reduction, or None to pickle the object as usual
    def reduce_tensor(self, tensor: Any) -> tuple[Any, ...] | None:
        import torch

        if tensor.device.type != "cpu":  # copied to the CPU here (this kernel already runs CUDA: it holds the
            copy = notebook_data.cpu_copy(
                tensor
            )  # tensor), moved to each rank's own device there (`rank.data.from_cuda`)
            reduced = self._reduce_cpu(copy, torch)
            return (rebuild_from_cuda, reduced[1]) if reduced is not None else (from_cuda, (copy,))
        return self._reduce_cpu(tensor, torch)

    def _reduce_cpu(self, tensor: Any, torch: Any) -> tuple[Any, ...] | None:
        if not notebook_data.plain_tensor(tensor, torch):
            return None
        storage = tensor.untyped_storage()
        if storage.nbytes() < MIN_BYTES:
            return None
        key = self._key(
            storage, _compat.tensor_version(tensor), lambda: torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        )
        return rebuild_tensor, (
            key,
            tensor.dtype,
            tensor.storage_offset(),
            tuple(tensor.size()),
            tuple(tensor.stride()),
            tensor.requires_grad,
            type(tensor) is torch.nn.Parameter,
        )

    def reduce_array(self, array: Any) -> tuple[Any, ...] | None:
        numpy = sys.modules["numpy"]
        if type(array) is not numpy.ndarray or array.dtype.hasobject or array.nbytes < MIN_BYTES:
            return None
        order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
        key = self._key(array, None, lambda: notebook_data.flat(array, numpy).view(numpy.uint8))
        return rebuild_array, (key, array.dtype, array.shape, order)

    def _key(self, source: Any, version: int | None, data: Any) -> int:
        found = self._keys.get(id(source))
        if found is not None and found[0]() is source:  # twice in one launch (views of one storage)
            return found[1]
        key = next(self._numbers)
        self._keys[id(source)] = (weakref.ref(source), key)
        self._sources.append(source)
        self.pending[key] = _Unplaced(weakref.ref(source), version, data)
        return key

    def put(self) -> dict[int, Any]:
        """Put what the object store does not hold yet, once: what an earlier launch put for the same, unchanged
        source is reused (a restart's new engine reuses this launch's references too)."""
        began = time.perf_counter()
        self.store.connected(_connection())
        for key, pending in list(self.pending.items()):
            if key not in self.refs:
                held = self._held(pending)
                self.used[key] = held
                self.refs[key] = held.ref
            del self.pending[key]  # the object store has its copy; the notebook's object is not held
        self._sources = []
        self.seconds += time.perf_counter() - began
        return dict(self.refs)

    def _held(self, pending: _Unplaced) -> Held:
        """What an earlier launch put for this very source, if it is unchanged; else the source, put now."""
        import ray

        source = pending.source()
        if source is None:  # gone since it was pickled: put, not kept
            held = None
        else:
            source_key = id(source)
            held = self.store.find(source_key, source)
        data = pending.data()
        if held is not None and _unchanged(held, pending.version, data):
            self.reused += held.nbytes
            return held
        ref = (
            pending.source
            if source is None
            else weakref.ref(source, lambda ref, key=source_key, target=self.store: target.forget(key, ref))
        )
        self.written += data.nbytes
        return Held(ray.put(data), data.nbytes, ref, pending.version)

    def fds(self) -> dict[int, int]:
        return {}

    def commit(self) -> DataSent:
        """What this launch put into the object store and reused; the store now holds what it used, for the next
        launch (this launch's references stay too, for a restart, until the run goes)."""
        sent = DataSent(
            written=self.written,
            reused=self.reused,
            blocks=len(self.refs),
            seconds=self.seconds,
            into="Ray's object store",
        )
        self.store.keep(self.used.values())
        self.used = {}
        return sent


def _unchanged(held: Held, version: int | None, data: Any) -> bool:
    """A tensor: its version counter has not moved. An array has none: its bytes are compared with the object
    store's copy, which `ray.get` maps in place on the kernel's node (a chunk at a time, no copy)."""
    if held.version is not None or version is not None:
        return held.version == version
    import ray

    stored = ray.get(held.ref)
    if stored.nbytes != data.nbytes:
        return False
    return all(
        (stored[start : start + CHUNK] == data[start : start + CHUNK]).all() for start in range(0, stored.nbytes, CHUNK)
    )


def _connection() -> tuple[str, ...]:
    """This kernel's Ray connection: a new node (Ray restarted, another cluster) or job (reconnected) is another."""
    import ray

    context = ray.get_runtime_context()
    try:
        return context.get_job_id(), context.get_node_id()
    except Exception:  # noqa: BLE001 - a Ray Client connection has no node of its own: its job names it
        return (context.get_job_id(),)
