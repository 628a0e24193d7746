"""Notebook data for the ranks: written once into shared memory, mapped copy-on-write by every rank.

Kernel side: a launch's `Shipment`, consulted by the pickler (`pickling.dumps(..., shared=)`), places each CPU
tensor's storage and each NumPy array of MIN_BYTES or more in the launch's `Segment` (anonymous memory files,
`os.memfd_create`, written in parallel once the pickle is made) and leaves in the pickle only where the bytes are. The `Store` keeps what the latest launch
sent, so that the next launch reuses what did not change. Rank side: `attach` maps each segment MAP_PRIVATE, and
the rebuild functions below make tensors and arrays of its pages: reads share the kernel's one copy, a write
copies only the pages written, in that rank alone.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from ddpnb.core.record import DataSent
from ddpnb.core.spec import LaunchError
from ddpnb.core.words import size_text

MIN_BYTES = 1 << 20  # smaller storages and arrays travel in the pickle: a mapping per megabyte is not worth it
ALIGN = mmap.ALLOCATIONGRANULARITY  # every block starts on a page, so a rank can map it on its own
KEEP_LAUNCHES = 4  # what the latest launches used is kept for reuse; older data is let go
MAX_SEGMENTS = 8  # segments the store may hold; beyond it the oldest's blocks are let go (each holds fds)
CHUNK = 16 << 20  # bytes compared at a time when checking whether an array changed
STRIPE = 64 << 20  # a segment's bytes alternate over its files in runs this long (`Segment`)
WRITERS = max(1, min(8, len(os.sched_getaffinity(0))))  # a segment's files, at most: one writer thread each
NOTE_BYTES = 100 * 2**20  # a launch that writes this much says so in its header


class _FromSource(Protocol):
    source: weakref.ref


Entry = TypeVar("Entry", bound=_FromSource)


# --- kernel side ---------------------------------------------------------------------------------------------------
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
            raise LaunchError(f"ddpnb: the notebook data the function uses ({size_text(self.size)}) could not be "
                              f"written into shared memory for the ranks: {exc.strerror or exc}. Nothing was started "
                              "and nothing in the notebook changed: free memory (del tensors you no longer need) or "
                              "give the ranks less data (e.g. load it inside the function).") from exc
        finally:
            self._queued = []

    def _write_blocks(self, writers: ThreadPoolExecutor, blocks: list[tuple[int, memoryview]]) -> None:
        work: list[list[tuple[int, memoryview]]] = [[] for _ in self.fds]
        for offset, data in blocks:
            for index, at, start, stop in _pieces(offset, len(data), len(self.fds)):
                work[index].append((at, data[start:stop]))
        list(writers.map(_write, self.fds, work))  # raises the first writer's error, if any

    def same(self, offset: int, data: memoryview) -> bool:
        """Whether the bytes at `offset` are `data`, compared a chunk at a time (bytearray compares with memcmp)."""
        for index, at, start, stop in _pieces(offset, len(data), len(self.fds)):
            for first in range(start, stop, CHUNK):
                part = data[first:min(first + CHUNK, stop)]
                buffer = bytearray(len(part))
                if os.preadv(self.fds[index], [buffer], at + first - start) != len(part) or buffer != part:
                    return False
        return True


def _pieces(offset: int, length: int, files: int) -> Iterator[tuple[int, int, int, int]]:
    """Where the segment's bytes [offset, offset + length) lie: (file index, offset in that file, start, stop),
    start and stop counted from `offset`."""
    position, end = offset, offset + length
    while position < end:
        stripe, within = divmod(position, STRIPE)
        stop = min(end, (stripe + 1) * STRIPE)
        yield stripe % files, (stripe // files) * STRIPE + within, position - offset, stop - offset
        position = stop


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
            live = {key: block for key, block in blocks.items()
                    if block.source() is not None and block.launch > self.launches - KEEP_LAUNCHES}
            held: dict[Segment, int] = {}
            for block in live.values():
                held[block.segment] = held.get(block.segment, 0) + block.nbytes
            newest = sorted(held, key=lambda segment: segment.id)[-MAX_SEGMENTS:]
            self.entries = {key: block for key, block in live.items()
                           if block.segment in newest and 2 * held[block.segment] >= block.segment.size}

    def held_bytes(self) -> int:
        """The memory the store keeps for reuse: every segment it still holds a block in."""
        with self.lock:
            return sum(segment.size for segment in {block.segment for block in self.entries.values()})


store = Store()


class Shipment:
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
            copy = cpu_copy(tensor)  # tensor), moved to each rank's own device there (`_from_cuda`)
            return _from_cuda, (copy,)
        if not _plain_tensor(tensor, torch):
            return None
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < MIN_BYTES:
            return None
        block = self._block(storage, tensor._version, nbytes, lambda: _storage_bytes(storage, nbytes))
        return _rebuild_tensor, (block.segment.id, block.offset, nbytes, tensor.dtype, tensor.storage_offset(),
                                 tuple(tensor.size()), tuple(tensor.stride()), tensor.requires_grad,
                                 type(tensor) is torch.nn.Parameter)

    def reduce_array(self, array: Any) -> tuple[Any, ...] | None:
        numpy = sys.modules["numpy"]
        if type(array) is not numpy.ndarray or array.dtype.hasobject or array.nbytes < MIN_BYTES:
            return None
        order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
        block = self._block(array, None, array.nbytes, lambda: memoryview(_flat(array, numpy).view(numpy.uint8)),
                            in_place=array.flags.forc)
        return _rebuild_array, (block.segment.id, block.offset, array.nbytes, array.dtype, array.shape, order)

    def _block(self, source: Any, version: int | None, nbytes: int, data: Callable[[], memoryview],
               in_place: bool = True) -> Block:
        """The block `source` (its bytes: `data()`, a view of them in place or, not `in_place`, a copy) lies in for
        this launch: one an earlier launch wrote, if unchanged, or one placed in this launch's segment now."""
        key = id(source)
        block = self.used.get(key)
        if block is not None and block.source() is source:  # twice in one launch (views of one storage)
            return block
        began = time.perf_counter()
        block = self.store.find(key, source)
        if block is not None and (block.version == version if version is not None
                                  else block.segment.same(block.offset, data())):
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


def note(sent: DataSent) -> str:
    """What a launch that wrote a lot says in its header, so users see where its time went; else ''."""
    if sent.written < NOTE_BYTES:
        return ""
    reused = f", {size_text(sent.reused)} reused from earlier launches" if sent.reused else ""
    return (f"wrote {size_text(sent.written)} of notebook data into {sent.into} for the ranks in "
            f"{sent.seconds:.2f} s{reused} (later launches reuse it while it is unchanged)")


def cpu_copy(tensor: Any) -> Any:
    """A notebook CUDA tensor's CPU copy, a `Parameter` still a `Parameter`, with its `requires_grad`."""
    import torch

    copy = tensor.detach().cpu()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copy, tensor.requires_grad)
    return copy.requires_grad_(tensor.requires_grad)


def _flat(array: Any, numpy: Any) -> Any:
    """An array's elements in one flat run, in its own memory order: a view where it is contiguous, else a copy."""
    return array.ravel(order="K") if array.flags.forc else numpy.ascontiguousarray(array).ravel()


def _plain_tensor(tensor: Any, torch: Any) -> bool:
    """A dense CPU tensor that pickling would send as storage + offset + size + stride and nothing else."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout is torch.strided
            and not tensor.is_quantized and not tensor.is_conj() and not tensor.is_neg()
            and tensor.grad_fn is None and not tensor.__dict__ and not tensor._backward_hooks
            and not any(getattr(tensor, "names", None) or ()))


def _storage_bytes(storage: Any, nbytes: int) -> memoryview:
    """The storage's bytes in place (no numpy needed in the kernel); the caller holds the storage meanwhile."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(storage.data_ptr())).cast("B")


# --- rank side -----------------------------------------------------------------------------------------------------
_maps: dict[int, mmap.mmap] = {}  # segment id -> its private mapping
# (segment, offset) -> the storage rebuilt there, while anything uses it: views share it, and pages a rank wrote
# go when the rank lets go of its tensors
_storages: weakref.WeakValueDictionary[tuple[int, int], Any] = weakref.WeakValueDictionary()
_device: str | None = None  # this rank's device, once set up
_pending: list[Any] = []  # tensors from notebook CUDA tensors, waiting for the rank's device


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
    for index, at, first, stop in _pieces(0, size, len(files)):
        where = libc.mmap(base + first, stop - first, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_PRIVATE | _MAP_FIXED, files[index], at)
        if where != base + first:
            raise OSError(ctypes.get_errno(), f"ddpnb: could not map notebook data into this rank: "
                                              f"{os.strerror(ctypes.get_errno())}")
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


def set_device(device: str) -> None:
    """The rank's device is set up: tensors that were CUDA tensors in the notebook move onto it (CPU ranks keep
    them on the CPU)."""
    global _device
    _device = device
    while _pending:
        _move(_pending.pop())


def _segment(segment_id: int) -> mmap.mmap:
    try:
        return _maps[segment_id]
    except KeyError:
        raise RuntimeError("ddpnb: notebook data was sent through shared memory this rank was not given; "
                           "this is a bug in ddpnb, please report it") from None


def _rebuild_tensor(segment_id: int, offset: int, nbytes: int, dtype: Any, storage_offset: int,
                    size: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool, parameter: bool) -> Any:
    import torch

    key = (segment_id, offset)
    storage = _storages.get(key)
    if storage is None:
        storage = torch.frombuffer(_segment(segment_id), dtype=torch.uint8, count=nbytes,
                                   offset=offset).untyped_storage()
        _storages[key] = storage
    tensor = torch.empty(0, dtype=dtype).set_(storage, storage_offset, size, stride)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad)
    return tensor.requires_grad_(requires_grad)


def _rebuild_array(segment_id: int, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...], order: str) -> Any:
    import numpy

    flat = numpy.frombuffer(_segment(segment_id), dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
    return flat.reshape(shape, order=order)


def _from_cuda(tensor: Any) -> Any:
    """A notebook CUDA tensor, sent as a CPU copy: on each GPU rank's own device (never every rank on cuda:0),
    on the CPU on CPU ranks. Moved in place (`.data`), so it stays the same object, Parameter or not."""
    if _device is None:  # unpickled before the rank's device is set up (CUDA must not start before that)
        _pending.append(tensor)
    else:
        _move(tensor)
    return tensor


def _move(tensor: Any) -> None:
    if _device is not None and _device.startswith("cuda"):
        tensor.data = tensor.data.to(_device)
