"""Notebook data for local ranks, rank side: the kernel's memory files mapped MAP_PRIVATE, and the tensors and
arrays rebuilt on their pages: reads share the kernel's one copy, a write copies only the pages written, in that
rank alone. The kernel side is `shared`."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import weakref
from collections.abc import Iterator
from typing import Any

STRIPE = 64 << 20  # a segment's bytes alternate over its files in runs this long (`shared.Segment`)

_maps: dict[int, mmap.mmap] = {}  # segment id -> its private mapping
# (segment, offset) -> the storage rebuilt there, while anything uses it: views share it, and pages a rank wrote
# go when the rank lets go of its tensors
_storages: weakref.WeakValueDictionary[tuple[int, int], Any] = weakref.WeakValueDictionary()


def pieces(offset: int, length: int, files: int) -> Iterator[tuple[int, int, int, int]]:
    """Where the segment's bytes [offset, offset + length) lie: (file index, offset in that file, start, stop),
    start and stop counted from `offset`."""
    position, end = offset, offset + length
    while position < end:
        stripe, within = divmod(position, STRIPE)
        stop = min(end, (stripe + 1) * STRIPE)
        yield stripe % files, (stripe // files) * STRIPE + within, position - offset, stop - offset
        position = stop


def attach(fds: dict[int, tuple[int, ...]]) -> None:
    """Map every segment this rank was given, copy-on-write, and close its fds (the mapping keeps the files)."""
    for segment_id, files in fds.items():
        try:
            _maps[segment_id] = _map_stripes(files)
        finally:  # mapped or not, the fds are done with
            for fd in files:
                os.close(fd)


def _map_stripes(files: tuple[int, ...]) -> mmap.mmap:
    """A segment's stripes mapped back to back, MAP_PRIVATE, into one range: reserved as an anonymous mapping,
    whose Python object is the buffer the tensors are made of, and which unmaps the whole range when it goes."""
    size = sum(os.fstat(fd).st_size for fd in files)
    reserved = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    start = ctypes.c_char.from_buffer(reserved)
    base = ctypes.addressof(start)
    del start  # no buffer of it may stay exported, or it could never be unmapped
    libc = _libc()
    for index, at, first, stop in pieces(0, size, len(files)):
        where = libc.mmap(
            base + first,
            stop - first,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_PRIVATE | _MAP_FIXED,
            files[index],
            at,
        )
        if where != base + first:
            raise OSError(
                ctypes.get_errno(),
                f"ddpnb: could not map notebook data into this rank: {os.strerror(ctypes.get_errno())}",
            )
    return reserved


_MAP_FIXED = 0x10  # Linux's value; Python's mmap module does not offer MAP_FIXED


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc


def attach_from(pid: int, fds: dict[int, tuple[int, ...]]) -> None:
    """Map segments the kernel (process `pid`) holds open as `fds`, into a rank that is already running (a
    session's `push`): opened through /proc, since no fd can be handed to it any more. A segment mapped before
    (an earlier push of the same data) is mapped afresh, so that what this rank wrote into the tensors it rebuilt
    then is not in the ones rebuilt now: a push always brings the notebook's values."""
    for segment_id, files in fds.items():
        for key in [key for key in list(_storages.keys()) if key[0] == segment_id]:
            _storages.pop(key, None)  # tensors rebuilt earlier keep their storage (and the old mapping)
        attach({segment_id: tuple(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC) for fd in files)})


def has(segment_id: int) -> bool:
    return segment_id in _maps


def size(segment_id: int) -> int:
    return len(_segment(segment_id))


def _segment(segment_id: int) -> mmap.mmap:
    try:
        return _maps[segment_id]
    except KeyError:
        raise RuntimeError(
            "ddpnb: notebook data was sent through shared memory this rank was not given; "
            "this is a bug in ddpnb, please report it"
        ) from None


def rebuild_tensor(
    segment_id: int,
    offset: int,
    nbytes: int,
    dtype: Any,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
) -> Any:
    import torch

    key = (segment_id, offset)
    storage = _storages.get(key)
    if storage is None:
        storage = torch.frombuffer(
            _segment(segment_id), dtype=torch.uint8, count=nbytes, offset=offset
        ).untyped_storage()
        _storages[key] = storage
    tensor = torch.empty(0, dtype=dtype).set_(storage, storage_offset, size, stride)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad)
    return tensor.requires_grad_(requires_grad)


def rebuild_array(segment_id: int, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...], order: str) -> Any:
    import numpy

    flat = numpy.frombuffer(_segment(segment_id), dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
    return flat.reshape(shape, order=order)
