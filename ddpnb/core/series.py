"""One rank's values of one metric, every point kept in bounded memory: the record's `RankRecord.metrics`.

A point as a `Point` tuple costs about 150 bytes; 1,024 ranks logging two values at 5 steps a second would grow the
kernel by 1.5 MB a second. A `Series` keeps its points as columns (step, time, value: 24 bytes a point) and, once
CHUNK of them are kept, writes them to a file of the attempt's (`Spill`, an unlinked temporary file that lives as long
as the record does, so run-directory retention cannot take it), keeping in memory only the latest points and a
sample of the whole (SAMPLE to 2 * SAMPLE evenly spaced points) that the plots draw. It reads as a sequence of
`Point`s: `len`, indexing, slicing and iteration read the file where they must.
"""

from __future__ import annotations

import os
import tempfile
import threading
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, overload

CHUNK = 256  # points a series holds in memory before it writes them to its spill file
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
    """One attempt's file of written-out chunks, shared by its series: appended by the reader, read by any thread."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="ddpnb-metrics-")  # noqa: SIM115  # unlinked: gone with the record
        self._end = 0
        self._lock = threading.Lock()
        self.swap = threading.Lock()  # a series' chunk written out: its memory and its chunks change together

    def write(self, data: bytes) -> int:
        """Append `data`; its offset."""
        with self._lock:
            offset, self._end = self._end, self._end + len(data)
        os.pwrite(self._file.fileno(), data, offset)
        return offset

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self._file.fileno(), size, offset)


class Series(Sequence[Point]):
    """A metric's points on one rank, oldest first (see the module's docstring). `add` is the reader's alone."""

    def __init__(self, spill: Spill | None = None) -> None:
        self._spill = spill
        self._chunks: list[int] = []  # offsets in the spill file of the written chunks, CHUNK points each
        self._tail: Columns = (array("q"), array("d"), array("d"))  # the points not written out
        self._sample: Columns = (array("q"), array("d"), array("d"))
        self._every = 1  # the sample holds the points whose index is a multiple of this
        self._count = 0  # points added

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
            offset = self._spill.write(steps.tobytes() + times.tobytes() + values.tobytes())
            with self._spill.swap:
                self._chunks.append(offset)
                self._tail = (array("q"), array("d"), array("d"))

    def _state(self) -> tuple[int, Columns]:
        """The written chunks and the points in memory as of one moment: the reader thread adds meanwhile."""
        if self._spill is None:
            chunks, tail = 0, self._tail
        else:
            with self._spill.swap:
                chunks, tail = len(self._chunks), self._tail
        kept = len(tail[2])
        return chunks, (tail[0][:kept], tail[1][:kept], tail[2][:kept])

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
        last = len(self) - 1
        if last >= 0 and (last % every or (last // every) % stride or last // every >= kept):
            rows.append(self[last])
        return rows

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Point: ...
    @overload
    def __getitem__(self, index: slice) -> list[Point]: ...
    def __getitem__(self, index: int | slice) -> Point | list[Point]:
        chunks, (steps, times, values) = self._state()
        written = chunks * CHUNK
        count = written + len(values)
        if isinstance(index, slice):
            start, stop, stride = index.indices(count)
            if min(start, stop) >= written:  # the latest points only: no read
                window = slice(start - written, stop - written, stride)
                return [_point(*row) for row in zip(steps[window], times[window], values[window])]
            return list(self)[index]
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError("series index out of range")
        if index >= written:
            index -= written
            return _point(steps[index], times[index], values[index])
        steps, times, values = self._chunk(index // CHUNK)
        index %= CHUNK
        return _point(steps[index], times[index], values[index])

    def __iter__(self) -> Iterator[Point]:
        chunks, tail = self._state()
        for steps, times, values in [*(self._chunk(number) for number in range(chunks)), tail]:
            yield from (_point(*row) for row in zip(steps, times, values))

    def _chunk(self, number: int) -> Columns:
        assert self._spill is not None
        data = self._spill.read(self._chunks[number], CHUNK * 24)
        columns: Columns = (array("q"), array("d"), array("d"))
        for at, column in enumerate(columns):
            column.frombytes(data[at * CHUNK * 8 : (at + 1) * CHUNK * 8])
        return columns

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
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
