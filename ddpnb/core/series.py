"""One rank's values of one metric, every point kept in bounded memory: the record's `RankRecord.metrics`.

A point as a `Point` tuple costs about 150 bytes; 1,024 ranks logging two values at 5 steps a second would grow the
kernel by 1.5 MB a second. A `Series` keeps its points as columns (step, time, value: 24 bytes a point) and, once
CHUNK of them are kept, writes them to a file of the attempt's (`Spill`, an unlinked temporary file that lives as long
as the record does, so run-directory retention cannot take it), keeping in memory only the latest points and a
sample of the whole (SAMPLE to 2 * SAMPLE evenly spaced points) that the plots draw. It reads as a sequence of
`Point`s: `len`, indexing, slicing and iteration read the file where they must.

The file is bounded too: an attempt's series share DISK bytes of it (512 MiB: 1,024 ranks logging two values at 5
steps a second fill it in 36 minutes; each series' share is at least LEAST_CHUNKS chunks). Every point is kept until
a series' share is full; from then on each chunk it writes merges two of its chunks of equal resolution into one of
every other point (the oldest two of the finest resolution more than a quarter of its share holds, else the oldest
two), so the latest points stay whole and the older ones thin by halves, oldest most, as RRD archives do (once each
chunk is twice as sparse as the next, the share grows by one chunk each time the points logged double). Such a series is shorter than the points logged (`logged`; `thinned` says so); `since(n)` gives the points kept
from the n-th logged on, with their index, for a reader that follows it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, overload

CHUNK = 256  # points a series holds in memory before it writes them to its spill file
CHUNK_BYTES = CHUNK * 24
DISK = 512 << 20  # bytes of spill file an attempt's series share (see the module's docstring)
LEAST_CHUNKS = 8  # a series' share in chunks, however many share the file
SAMPLE = 200  # a series keeps between SAMPLE and 2 * SAMPLE evenly spaced points for the plots
NO_STEP = -(2**63)  # a point logged without a step (`ddpnb.log(loss=...)`)


Columns = tuple["array[int]", "array[float]", "array[float]"]  # steps, times, values


class Point(NamedTuple):
    """One logged value of a metric (`RunRecord.metrics`): the step given to `ddpnb.log` (or None), when the rank
    logged it (`time.time()`), and the value."""

    step: int | None
    time: float
    value: float


class Spill:
    """One attempt's file of written-out chunks, shared by its series: appended by the reader, read by any thread.
    A chunk's slot freed by a merge is written again before the file grows."""

    def __init__(self, disk: int | None = None) -> None:
        self._file = tempfile.TemporaryFile(prefix="ddpnb-metrics-")  # noqa: SIM115  # unlinked: gone with the record
        self._end = 0
        self._free: list[int] = []
        self.disk = DISK if disk is None else disk
        self.series = 0  # series sharing the file: each one's share of `disk`
        self.swap = threading.Lock()  # a series' chunks change (written out, merged) or are read: one at a time

    def share(self) -> int:
        """Chunks one series may hold."""
        return max(LEAST_CHUNKS, self.disk // (CHUNK_BYTES * max(1, self.series)))

    def size(self) -> int:
        """Bytes the file holds."""
        return self._end

    def write(self, data: bytes, offset: int | None = None) -> int:
        """Write one chunk at `offset`, else in a free slot or at the end; its offset. Only the reader writes."""
        if offset is None and self._free:
            offset = self._free.pop()
        elif offset is None:
            offset, self._end = self._end, self._end + CHUNK_BYTES
        os.pwrite(self._file.fileno(), data, offset)
        return offset

    def free(self, offset: int) -> None:
        self._free.append(offset)

    def read(self, offset: int) -> Columns:
        data = os.pread(self._file.fileno(), CHUNK_BYTES, offset)
        columns: Columns = (array("q"), array("d"), array("d"))
        for at, column in enumerate(columns):
            column.frombytes(data[at * CHUNK * 8 : (at + 1) * CHUNK * 8])
        return columns


class Chunk(NamedTuple):
    """CHUNK points written out: where, the index (among the points logged) of its first, and the logged points
    between two of its points (1 until merged)."""

    offset: int
    first: int
    stride: int


class Series(Sequence[Point]):
    """A metric's points on one rank, oldest first (see the module's docstring). `add` is the reader's alone."""

    def __init__(self, spill: Spill | None = None) -> None:
        self._spill = spill
        if spill is not None:
            spill.series += 1
        self._chunks = array("q")  # the written chunks, oldest first, CHUNK points each: a `Chunk` per three
        self._tail: Columns = (array("q"), array("d"), array("d"))  # the points not written out
        self._sample: Columns = (array("q"), array("d"), array("d"))
        self._every = 1  # the sample holds the points whose index is a multiple of this
        self._count = 0  # points added

    @property
    def logged(self) -> int:
        """Points added, kept or not."""
        return self._count

    @property
    def thinned(self) -> bool:
        """Whether older points were thinned to keep the spill file in its bound (`len` < `logged`)."""
        return len(self) < self._count

    def add(self, step: int | None, time: float, value: float) -> None:
        stepped = NO_STEP if step is None else step
        if self._count % self._every == 0:
            for column, item in zip(self._sample, (stepped, time, value)):
                column.append(item)  # type: ignore[arg-type]
            if len(self._sample[0]) >= 2 * SAMPLE:  # twice as sparse: every other point of the sample goes
                self._sample = tuple(column[::2] for column in self._sample)  # type: ignore[assignment]
                self._every *= 2
        steps, times, values = self._tail
        steps.append(stepped)
        times.append(time)
        values.append(value)  # last: readers count the points in memory by it
        self._count += 1
        if self._spill is not None and len(values) >= CHUNK:
            self._write_out()

    def _write_out(self) -> None:
        spill = self._spill
        assert spill is not None
        steps, times, values = self._tail
        chunk = Chunk(spill.write(steps.tobytes() + times.tobytes() + values.tobytes()), self._count - CHUNK, 1)
        with spill.swap:
            self._chunks.extend(chunk)
            self._tail = (array("q"), array("d"), array("d"))
            if len(self._chunks) > 3 * spill.share():
                self._merge(spill)

    def _merge(self, spill: Spill) -> None:
        """Two chunks into one of every other point (under `swap`): the oldest pair of the finest stride that more
        than a quarter of the share holds, else the oldest pair; strides never grow from oldest to newest."""
        strides = self._chunks[2::3]
        pairs = [at for at in range(len(strides) - 1) if strides[at] == strides[at + 1]]
        if not pairs:  # each chunk twice as sparse as the next: one more, once a doubling of the points logged
            return
        counts = Counter(strides)
        crowded = [at for at in pairs if counts[strides[at]] > spill.share() // 4]
        at = min(crowded, key=lambda at: (strides[at], at)) if crowded else pairs[0]
        older, newer = self._chunk(at), self._chunk(at + 1)
        both = [a + b for a, b in zip(spill.read(older.offset), spill.read(newer.offset))]
        merged = b"".join(column[::2].tobytes() for column in both)
        spill.write(merged, older.offset)  # in place: readers wait on swap
        self._chunks[3 * at : 3 * at + 6] = array("q", (older.offset, older.first, older.stride * 2))
        spill.free(newer.offset)

    def _chunk(self, at: int) -> Chunk:
        return Chunk(*self._chunks[3 * at : 3 * at + 3])

    def _state(self, read: slice | None = None) -> tuple[int, list[Columns], Columns]:
        """As of one moment (the reader thread adds meanwhile): the number of written chunks, the columns of those
        in `read`, and the points in memory."""
        if self._spill is None:
            return 0, [], self._tail
        with self._spill.swap:
            tail = self._tail
            kept = len(tail[2])
            count = len(self._chunks) // 3
            chunks = [self._chunk(at) for at in range(count)[read]] if read is not None else []
            return count, [self._spill.read(c.offset) for c in chunks], tuple(c[:kept] for c in tail)

    def since(self, logged: int) -> list[tuple[int, Point]]:
        """The points kept from the `logged`-th logged on, each with its index among the points logged: for a
        reader that follows the series (a thinned series' `len` shrinks, its indices do not move)."""
        chunks: list[Chunk] = []
        read: list[Columns] = []
        if self._spill is None:
            out, tail = 0, self._tail
        else:
            with self._spill.swap:
                last = self._chunk(len(self._chunks) // 3 - 1) if self._chunks else None
                out, tail = (last.first + CHUNK * last.stride if last else 0), self._tail
                at = len(self._chunks) // 3
                while at and (chunk := self._chunk(at - 1)).first + (CHUNK - 1) * chunk.stride >= logged:
                    at -= 1  # from the newest back: a follower asks for the latest points
                chunks = [self._chunk(number) for number in range(at, len(self._chunks) // 3)]
                read = [self._spill.read(chunk.offset) for chunk in chunks]
        rows = [
            (chunk.first + at * chunk.stride, _point(*row))
            for chunk, columns in zip(chunks, read)
            for at, row in enumerate(zip(*columns))
            if chunk.first + at * chunk.stride >= logged
        ]
        skip, kept = max(0, logged - out), len(tail[2])
        rows.extend((out + at, _point(*row)) for at, row in enumerate(zip(*(c[skip:kept] for c in tail)), skip))
        return rows

    def sample(self, limit: int) -> list[tuple[int | None, float, float]]:
        """At most about `limit` evenly spaced points as (step, time, value), always with the last one: what a plot
        draws, from memory (plain tuples: a redraw at 1,024 ranks reads hundreds of thousands)."""
        (steps, times, values), every = self._sample, self._every
        kept = len(values)
        stride = max(1, -(-kept // limit))
        rows: list[tuple[int | None, float, float]] = list(
            zip(steps[:kept:stride], times[:kept:stride], values[:kept:stride])
        )
        if NO_STEP in steps:
            rows = [(None if step == NO_STEP else step, time, value) for step, time, value in rows]
        last = self._count - 1
        if last >= 0 and (last % every or (last // every) % stride or last // every >= kept):
            rows.append(self[-1])
        return rows

    def sample_columns(self) -> tuple[array[int], array[float], int]:
        """The sample's steps and values (`NO_STEP` for a point logged without one) and the index step between two
        of its points: a thousand ranks' band read column by column (`views.html`)."""
        (steps, _, values), every = self._sample, self._every
        kept = len(values)
        return steps[:kept], values[:kept], every

    def __len__(self) -> int:
        """Points kept: `logged` until the spill file's bound thinned the oldest."""
        if self._spill is None:
            return self._count
        with self._spill.swap:
            return len(self._chunks) // 3 * CHUNK + len(self._tail[2])

    @overload
    def __getitem__(self, index: int) -> Point: ...
    @overload
    def __getitem__(self, index: slice) -> list[Point]: ...
    def __getitem__(self, index: int | slice) -> Point | list[Point]:
        if not isinstance(index, slice):
            return self._at(index)
        chunks, _, (steps, times, values) = self._state()
        written = chunks * CHUNK
        start, stop, stride = index.indices(written + len(values))
        if min(start, stop) >= written:  # the latest points only: no read
            window = slice(start - written, stop - written, stride)
            return [_point(*row) for row in zip(steps[window], times[window], values[window])]
        return list(self)[index]

    def _at(self, index: int) -> Point:
        """One point; one in memory (the latest, which every plot of a thousand ranks reads) without a copy."""
        with self._spill.swap if self._spill is not None else contextlib.nullcontext():
            steps, times, values = self._tail
            written = len(self._chunks) // 3 * CHUNK if self._spill is not None else 0
            count = written + len(values)  # the reader thread appends the values last: steps and times are there
            if index < 0:
                index += count
            if not 0 <= index < count:
                raise IndexError("series index out of range")
            if index >= written:
                index -= written
                return _point(steps[index], times[index], values[index])
        _, read, _ = self._state(slice(index // CHUNK, index // CHUNK + 1))
        steps, times, values = read[0]  # a merge meanwhile moves later points to this index: as if read after it
        index %= CHUNK
        return _point(steps[index], times[index], values[index])

    def __iter__(self) -> Iterator[Point]:
        _, read, tail = self._state(slice(None))
        for steps, times, values in [*read, tail]:
            yield from (_point(*row) for row in zip(steps, times, values))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        if self.thinned:
            return f"<Series of {len(self):,} points, the oldest thinned, of {self._count:,} logged>"
        return f"<Series of {len(self):,} points>"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its points, in memory: the spill file is this process's."""
        return _rebuilt, (list(self),)


def _point(step: int, time: float, value: float) -> Point:
    return Point(None if step == NO_STEP else step, time, value)


def _rebuilt(points: list[Point]) -> Series:
    series = Series()
    for point in points:
        series.add(*point)
    return series
