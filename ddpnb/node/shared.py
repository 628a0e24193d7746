"""Notebook data for local ranks, kernel side: written once into shared memory, mapped copy-on-write by every rank.

A launch's `MemoryShipment`, consulted by the pickler (`pickling.dumps(..., shared=)`), places each CPU tensor's storage
and each NumPy array of MIN_BYTES or more in the launch's `Segment` (anonymous memory files, `os.memfd_create`,
written in parallel once the pickle is made) and leaves in the pickle only where the bytes are. The `Store` keeps
what the latest launch sent, so that the next launch reuses what did not change. The rank side is `mapped`.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import sys
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ddpnb import _compat
from ddpnb.core.data import CHUNK, KEEP_LAUNCHES, MIN_BYTES, BySource, cpu_copy, flat, plain_tensor
from ddpnb.core.record import DataSent
from ddpnb.core.spec import LaunchError
from ddpnb.core.words import size_text
from ddpnb.node.mapped import STRIPE, pieces, rebuild_array, rebuild_tensor
from ddpnb.rank.data import from_cuda

ALIGN = mmap.ALLOCATIONGRANULARITY  # every block starts on a page, so a rank can map it on its own
MAX_SEGMENTS = 8  # segments the store may hold; beyond it the oldest's blocks are let go (each holds fds)
WRITERS = max(1, min(8, len(os.sched_getaffinity(0))))  # a segment's files, at most: one writer thread each


class Segment:
    """The memory files of one launch, written once. A segment's bytes go round-robin over its files in runs of
    STRIPE bytes, so that each file gets its own writer thread: writes into one shared-memory file are serialised
    (on its inode's lock), writes into separate files run in parallel. A rank maps the stripes back to back, as one
    range (`attach`). The files have no name, so nothing can leak: their memory goes when the last fd (the store's,
    a rank's) and the last mapping of them are gone."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id = next(Segment._ids)
        self.fds: tuple[int, ...] = ()  # made by `write`, once the size is known
        self.size = 0
        # (offset, length, the bytes or what makes them, what keeps them alive) until `write`
        self._queued: list[tuple[int, int, memoryview | Callable[[], memoryview], Any]] = []

    def append(self, nbytes: int, data: memoryview | Callable[[], memoryview], owner: Any) -> int:
        """Place `nbytes` at the next page, to be written by `write`: `data`, the bytes in place, or a function that
        makes them (a copy, such as a strided array's: made only then, one at a time, so that no two are held at
        once); `owner` keeps their memory alive till then."""
        offset = -(-self.size // ALIGN) * ALIGN
        self._queued.append((offset, nbytes, data, owner))
        self.size = offset + nbytes
        return offset

    def write(self) -> None:
        """Write everything appended: one thread per file."""
        if not self._queued:
            return
        files = min(WRITERS, -(-self.size // STRIPE))
        fds: list[int] = []
        closing = weakref.finalize(self, _close, fds)  # with the last block held in it
        in_place = [(offset, data) for offset, _, data, _ in self._queued if isinstance(data, memoryview)]
        copies = [(offset, data) for offset, _, data, _ in self._queued if not isinstance(data, memoryview)]
        try:
            fds.extend(os.memfd_create(f"ddpnb-data-{self.id}", os.MFD_CLOEXEC) for _ in range(files))
            self.fds = tuple(fds)
            for fd, length in zip(fds, _file_sizes(self.size, files)):
                os.ftruncate(fd, length)  # exactly the stripes it holds: a rank adds the sizes up to the segment's
            with ThreadPoolExecutor(files, thread_name_prefix="ddpnb-data") as writers:
                self._write_blocks(writers, in_place)
                for offset, make in copies:
                    self._write_blocks(writers, [(offset, make())])  # each copy goes once written
        except OSError as exc:
            closing()  # what was written goes at once
            self.fds = ()
            raise LaunchError(
                f"ddpnb: the notebook data the function uses ({size_text(self.size)}) could not be "
                f"written into shared memory for the ranks: {exc.strerror or exc}. Nothing was started "
                "and nothing in the notebook changed: free memory (del tensors you no longer need) or "
                "give the ranks less data (e.g. load it inside the function)."
            ) from exc
        finally:
            self._queued = []

    def _write_blocks(self, writers: ThreadPoolExecutor, blocks: list[tuple[int, memoryview]]) -> None:
        work: list[list[tuple[int, memoryview]]] = [[] for _ in self.fds]
        for offset, data in blocks:
            for index, at, start, stop in pieces(offset, len(data), len(self.fds)):
                work[index].append((at, data[start:stop]))
        list(writers.map(_write, self.fds, work))  # raises the first writer's error, if any

    def same(self, offset: int, data: memoryview) -> bool:
        """Whether the bytes at `offset` are `data`, compared a chunk at a time (bytearray compares with memcmp)."""
        for index, at, start, stop in pieces(offset, len(data), len(self.fds)):
            for first in range(start, stop, CHUNK):
                part = data[first : min(first + CHUNK, stop)]
                buffer = bytearray(len(part))
                if os.preadv(self.fds[index], [buffer], at + first - start) != len(part) or buffer != part:
                    return False
        return True


def _file_sizes(size: int, files: int) -> list[int]:
    sizes = [0] * files
    for stripe in range(-(-size // STRIPE)):
        sizes[stripe % files] += min(STRIPE, size - stripe * STRIPE)
    return sizes


def _write(fd: int, pieces: list[tuple[int, memoryview]]) -> None:
    for at, data in pieces:
        written = 0
        while written < len(data):  # one pwrite moves at most ~2 GiB
            written += os.pwrite(fd, data[written:], at + written)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


@dataclass(eq=False)
class Block:
    """One tensor storage's or array's bytes in a segment, and the notebook object they were taken from."""

    segment: Segment
    offset: int
    nbytes: int
    source: weakref.ref  # the notebook's storage or array: its death lets the block go
    version: int | None  # a tensor's version counter when written; None for an array (compared instead)
    launch: int = 0  # the latest launch that used it


class Store(BySource[Block]):
    """What the latest launches sent, by the notebook object it came from; the kernel has one."""

    def keep(self, used: dict[int, Block]) -> None:
        """Hold what a launch used, next to what the KEEP_LAUNCHES before it used (a quick evaluation launch
        between two training launches must not cost the training data's copy), while the notebook still holds
        each source. A segment less than half of which is still held, or beyond the MAX_SEGMENTS newest, is let go
        whole (a later launch writes its blocks anew), so kernel memory stays under twice what those launches sent."""
        with self.lock:
            self.launches += 1
            for block in used.values():
                block.launch = self.launches
            blocks = {**self.entries, **used}
            live = {
                key: block
                for key, block in blocks.items()
                if block.source() is not None and block.launch > self.launches - KEEP_LAUNCHES
            }
            held: dict[Segment, int] = {}
            for block in live.values():
                held[block.segment] = held.get(block.segment, 0) + block.nbytes
            newest = sorted(held, key=lambda segment: segment.id)[-MAX_SEGMENTS:]
            self.entries = {
                key: block
                for key, block in live.items()
                if block.segment in newest and 2 * held[block.segment] >= block.segment.size
            }

    def held_bytes(self) -> int:
        """The memory the store keeps for reuse: every segment it still holds a block in."""
        with self.lock:
            return sum(segment.size for segment in {block.segment for block in self.entries.values()})


store = Store()


class MemoryShipment:
    """One launch's data: what the pickler wrote or reused, and the segments the ranks must map."""

    def __init__(self, target: Store | None = None) -> None:
        self.store = target or store
        self.used: dict[int, Block] = {}
        self.segment: Segment | None = None
        # the sources pickled, held until `fds`: `used` is by id, and one freed between two pickles of a launch
        # (a temporary a reducer made) must not lend its id to another, which would drop its block from `used`
        self._sources: list[Any] = []
        # every segment handed to the ranks, kept past `commit`: a restart re-pickles the args but not the function,
        # whose pickle still names the segments its closure's data lies in (the run drops its shipment at its end)
        self.sent: dict[int, Segment] = {}
        self.written = self.reused = 0
        self.seconds = 0.0

    # the pickler's hooks: a reduction, or None to pickle the object as usual
    def reduce_tensor(self, tensor: Any) -> tuple[Any, ...] | None:
        import torch

        if tensor.device.type != "cpu":  # copied to the CPU here (this kernel already runs CUDA: it holds the
            copy = cpu_copy(tensor)  # tensor), moved to each rank's own device there (`rank.data.from_cuda`)
            return from_cuda, (copy,)
        if not plain_tensor(tensor, torch):
            return None
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < MIN_BYTES:
            return None
        block = self._block(storage, _compat.tensor_version(tensor), nbytes, lambda: _storage_bytes(storage, nbytes))
        return rebuild_tensor, (
            block.segment.id,
            block.offset,
            nbytes,
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
        block = self._block(
            array,
            None,
            array.nbytes,
            lambda: memoryview(flat(array, numpy).view(numpy.uint8)),
            in_place=array.flags.forc,
        )
        return rebuild_array, (block.segment.id, block.offset, array.nbytes, array.dtype, array.shape, order)

    def _block(
        self, source: Any, version: int | None, nbytes: int, data: Callable[[], memoryview], in_place: bool = True
    ) -> Block:
        """The block `source` (its bytes: `data()`, a view of them in place or, not `in_place`, a copy) lies in for
        this launch: one an earlier launch wrote, if unchanged, or one placed in this launch's segment now."""
        key = id(source)
        block = self.used.get(key)
        if block is not None and block.source() is source:  # twice in one launch (views of one storage)
            return block
        began = time.perf_counter()
        block = self.store.find(key, source)
        if block is not None and (
            block.version == version if version is not None else block.segment.same(block.offset, data())
        ):
            self.reused += block.nbytes
        else:
            if self.segment is None:
                self.segment = Segment()
            offset = self.segment.append(nbytes, data() if in_place else data, source)
            ref = weakref.ref(source, lambda ref, key=key, target=self.store: target.forget(key, ref))
            block = Block(self.segment, offset, nbytes, ref, version)
            self.written += block.nbytes
        self.seconds += time.perf_counter() - began
        self.used[key] = block
        self._sources.append(source)
        return block

    def fds(self) -> dict[int, tuple[int, ...]]:
        """Segment id -> its files, for every segment this launch's pickles refer to. The ranks map them next, so
        what the pickler placed in this launch's segment is written now."""
        self._write()
        self._sources = []
        self.sent.update({block.segment.id: block.segment for block in self.used.values()})
        return {segment_id: segment.fds for segment_id, segment in self.sent.items()}

    def _write(self) -> None:
        if self.segment is not None and self.segment.size:
            began = time.perf_counter()
            self.segment.write()
            self.seconds += time.perf_counter() - began
        self.segment = None  # written once: what a later pickle (a restart's) places goes into a segment of its own

    def commit(self) -> DataSent:
        """Every rank has its fds (they are duplicated into a rank as it starts): the store now holds what this
        launch used, for the next launch; what it used no longer is let go."""
        self._write()  # written already by `fds`; a segment is never kept unwritten
        sent = DataSent(written=self.written, reused=self.reused, blocks=len(self.used), seconds=self.seconds)
        self.store.keep(self.used)
        self.used, self.segment = {}, None
        self.written = self.reused = 0
        self.seconds = 0.0
        return sent


def _storage_bytes(storage: Any, nbytes: int) -> memoryview:
    """The storage's bytes in place (no numpy needed in the kernel); the caller holds the storage meanwhile."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(storage.data_ptr())).cast("B")
