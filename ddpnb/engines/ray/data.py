"""Notebook data for Ray ranks through Ray's object store: put once by the kernel, fetched by every rank.

Kernel side: a launch's `ObjectStoreShipment`, consulted by the pickler as `core.shared.Shipment` is on the local
engine, keeps each big CPU tensor's storage and each big NumPy array out of the pickle and leaves a key there;
the engine puts each one into the object store once (`ray.put`) and hands every rank the references. Rank side:
`_rebuild_tensor` / `_rebuild_array` fetch the object (on the rank's node Ray keeps one copy in shared memory,
which every rank there reads) and copy it into the rank's own memory, since the object store's copy is read-only:
a rank that writes into its tensor changes neither the notebook's nor another rank's, as with a pickle.
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import Any

from ddpnb.core.record import DataSent
from ddpnb.core.shared import MIN_BYTES


# --- kernel side ---------------------------------------------------------------------------------------------------
class ObjectStoreShipment:
    """One launch's data for Ray: what the pickler kept out of the pickle, and its object references once put."""

    def __init__(self) -> None:
        self.objects: dict[int, Any] = {}  # key -> the bytes to put (a uint8 view of a storage, or an array)
        self.refs: dict[int, Any] = {}  # key -> its ObjectRef, once put; held for the run's life
        self._keys: dict[int, tuple[weakref.ref, int]] = {}  # id(source) -> (source, key), within this launch
        self.written = 0
        self.seconds = 0.0

    def reduce_tensor(self, tensor: Any) -> tuple[Any, ...] | None:
        import torch

        if (tensor.device.type != "cpu" or type(tensor) not in (torch.Tensor, torch.nn.Parameter)
                or tensor.layout is not torch.strided or tensor.grad_fn is not None or tensor.is_quantized
                or tensor.is_conj() or tensor.is_neg() or tensor.__dict__):
            return None
        storage = tensor.untyped_storage()
        if storage.nbytes() < MIN_BYTES:
            return None
        key = self._key(storage, lambda: torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
        return _rebuild_tensor, (key, tensor.dtype, tensor.storage_offset(), tuple(tensor.size()),
                                 tuple(tensor.stride()), tensor.requires_grad, type(tensor) is torch.nn.Parameter)

    def reduce_array(self, array: Any) -> tuple[Any, ...] | None:
        numpy = sys.modules["numpy"]
        if type(array) is not numpy.ndarray or array.dtype.hasobject or array.nbytes < MIN_BYTES:
            return None
        return _rebuild_array, (self._key(array, lambda: array),)

    def _key(self, source: Any, data: Any) -> int:
        found = self._keys.get(id(source))
        if found is not None and found[0]() is source:  # twice in one launch (views of one storage)
            return found[1]
        key = len(self._keys)
        self._keys[id(source)] = (weakref.ref(source), key)
        self.objects[key] = data()
        return key

    def put(self) -> dict[int, Any]:
        """Put what is not in the object store yet, once (a restart's new engine reuses the references)."""
        import ray

        began = time.perf_counter()
        for key, data in list(self.objects.items()):
            if key not in self.refs:
                self.refs[key] = ray.put(data)
                self.written += data.nbytes
            del self.objects[key]  # the object store has its copy; the notebook's object is not held
        self.seconds += time.perf_counter() - began
        return dict(self.refs)

    def fds(self) -> dict[int, int]:
        return {}

    def commit(self) -> DataSent:
        """What this launch put into the object store (the references stay, for a restart, until the run goes)."""
        return DataSent(written=self.written, reused=0, blocks=len(self.refs), seconds=self.seconds)


# --- rank side -----------------------------------------------------------------------------------------------------
_refs: dict[int, Any] = {}  # key -> ObjectRef, given by the run (`receive`)
_storages: dict[int, Any] = {}  # key -> the storage rebuilt from it in this rank: views share it


def receive(refs: dict[int, Any]) -> None:
    """The references of this run's data, before anything refers to them is unpickled."""
    _refs.update(refs)


def _fetch(key: int) -> Any:
    import ray

    try:
        ref = _refs[key]
    except KeyError:
        raise RuntimeError("ddpnb: notebook data was sent through Ray's object store without its reference; this "
                           "is a bug in ddpnb, please report it") from None
    return ray.get(ref).copy()  # the object store's copy is read-only: this rank's own, as a pickle's would be


def _rebuild_tensor(key: int, dtype: Any, storage_offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                    requires_grad: bool, parameter: bool) -> Any:
    import torch

    storage = _storages.get(key)
    if storage is None:
        storage = _storages[key] = torch.from_numpy(_fetch(key)).untyped_storage()
    tensor = torch.empty(0, dtype=dtype).set_(storage, storage_offset, size, stride)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad)
    return tensor.requires_grad_(requires_grad)


def _rebuild_array(key: int) -> Any:
    return _fetch(key)
