"""Notebook data for the ranks, engine-neutral: the shipment the pickler hands big tensors and arrays to, the
store of what earlier launches sent, and how a launch says what it sent.

Each engine brings its own shipment (local: shared memory the ranks map, `node.shared`; ray: Ray's object
store, `engines.ray.data`); the pickler (`pickling.dumps(..., shared=)`) asks it about every tensor and array it
meets, and the API commits it once every rank has what the pickle refers to.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Generic, Protocol, TypeVar

from ddpnb import _compat
from ddpnb.core.record import DataSent
from ddpnb.core.words import size_text

MIN_BYTES = 1 << 20  # smaller storages and arrays travel in the pickle: a mapping per megabyte is not worth it
KEEP_LAUNCHES = 4  # what the latest launches used is kept for reuse; older data is let go
NOTE_BYTES = 100 * 2**20  # a launch that writes this much says so in its header
CHUNK = 16 << 20  # bytes compared at a time when checking whether an array changed


class Shipment(Protocol):
    """One launch's (or session command's) big tensors and arrays, placed outside its pickle."""

    used: dict[int, Any]  # what this launch's pickles placed or reused, by the id of its source

    def reduce_tensor(self, tensor: Any) -> tuple[Any, ...] | None:
        """The pickler's hook: a reduction that leaves the tensor's bytes outside the pickle, or None (pickle it)."""

    def reduce_array(self, array: Any) -> tuple[Any, ...] | None:
        """The same for a NumPy array."""

    def commit(self) -> DataSent:
        """Every rank has what the pickles refer to: keep it for the next launch, and say what was sent."""


class _FromSource(Protocol):
    """An entry kept for a notebook object: a weak reference to it."""

    source: weakref.ref


Entry = TypeVar("Entry", bound=_FromSource)


class BySource(Generic[Entry]):
    """Entries by the id of the notebook object each was taken from (its `source`, a weakref): one is found only
    for that very object, and goes when the object dies. What a launch sent, kept for the next: `Store` here, the
    Ray engine's `RefStore`."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.launches = 0  # launches committed so far
        self.lock = threading.RLock()  # a source may die (and `forget`) in any thread

    def find(self, key: int, source: Any) -> Entry | None:
        with self.lock:
            entry = self.entries.get(key)
        return entry if entry is not None and entry.source() is source else None

    def forget(self, key: int, ref: weakref.ref) -> None:
        with self.lock:
            if (entry := self.entries.get(key)) is not None and entry.source is ref:
                del self.entries[key]


def note(sent: DataSent) -> str:
    """What a launch that wrote a lot says in its header, so users see where its time went; else ''."""
    if sent.written < NOTE_BYTES:
        return ""
    reused = f", {size_text(sent.reused)} reused from earlier launches" if sent.reused else ""
    return (
        f"wrote {size_text(sent.written)} of notebook data into {sent.into} for the ranks in "
        f"{sent.seconds:.2f} s{reused} (later launches reuse it while it is unchanged)"
    )


def cpu_copy(tensor: Any) -> Any:
    """A notebook CUDA tensor's CPU copy, a `Parameter` still a `Parameter`, with its `requires_grad`."""
    import torch

    copy = tensor.detach().cpu()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copy, tensor.requires_grad)
    return copy.requires_grad_(tensor.requires_grad)


def flat(array: Any, numpy: Any) -> Any:
    """An array's elements in one flat run, in its own memory order: a view where it is contiguous, else a copy."""
    return array.ravel(order="K") if array.flags.forc else numpy.ascontiguousarray(array).ravel()


def plain_tensor(tensor: Any, torch: Any) -> bool:
    """A dense CPU tensor that pickling would send as storage + offset + size + stride and nothing else."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout is torch.strided
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.grad_fn is None
        and not tensor.__dict__
        and not _compat.has_backward_hooks(tensor)
        and not any(getattr(tensor, "names", None) or ())
    )
