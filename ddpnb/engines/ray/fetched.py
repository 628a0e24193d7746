"""Notebook data on Ray, rank side: the tensors and arrays a launch's or session command's pickle names by key,
rebuilt from the memory file the node's host filled (a forked rank: `node.mapped`, copy-on-write), or from the
object reference the rank was given (a Ray Train worker: fetched and copied). The kernel side is `data`."""

from __future__ import annotations

from typing import Any

from ddpnb.node import mapped
from ddpnb.rank.data import from_cuda

_refs: dict[int, Any] = {}  # key -> ObjectRef, given by the run or the session command (`receive`)
_storages: dict[int, Any] = {}  # key -> the storage rebuilt from it in this rank: views share it


def receive(refs: dict[int, Any]) -> None:
    """The references of a launch's (or a session command's) data, before anything that refers to them is
    unpickled. Each command's keys are its own: what an earlier one rebuilt is not reused (a push always brings
    the notebook's values, not what this rank wrote into an earlier copy)."""
    _refs.clear()
    _storages.clear()
    _refs.update(refs)


def _fetch(key: int) -> Any:
    import ray

    try:
        ref = _refs[key]
    except KeyError:
        raise RuntimeError(
            "ddpnb: notebook data was sent through Ray's object store without its reference; this "
            "is a bug in ddpnb, please report it"
        ) from None
    return ray.get(ref).copy()  # the object store's copy is read-only: this rank's own, as a pickle's would be


def rebuild_tensor(
    key: int,
    dtype: Any,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
) -> Any:
    import torch

    if mapped.has(key):  # a rank forked by its node's host: the object is in a memory file the host filled
        return mapped.rebuild_tensor(
            key, 0, mapped.size(key), dtype, storage_offset, size, stride, requires_grad, parameter
        )
    storage = _storages.get(key)
    if storage is None:
        storage = _storages[key] = torch.from_numpy(_fetch(key)).untyped_storage()
    tensor = torch.empty(0, dtype=dtype).set_(storage, storage_offset, size, stride)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad)
    return tensor.requires_grad_(requires_grad)


def rebuild_from_cuda(*args: Any) -> Any:
    """A notebook CUDA tensor, put as a CPU copy: rebuilt on the CPU, then onto this rank's own device once it is
    set up, as on the local engine (`rank.data.from_cuda`)."""
    return from_cuda(rebuild_tensor(*args))


def rebuild_array(key: int, dtype: Any, shape: tuple[int, ...], order: str) -> Any:
    if mapped.has(key):
        return mapped.rebuild_array(key, 0, mapped.size(key), dtype, shape, order)
    return _fetch(key).view(dtype).reshape(shape, order=order)
