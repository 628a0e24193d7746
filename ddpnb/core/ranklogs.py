"""One attempt's rank logs: each rank's output decoded into lines, written to its log file, crash reports read.

Raw bytes go to `rankN.log` (or `rankN.attemptK.log` with restarts), written once a FLUSH_EVERY; decoded lines go to the run's
line buffer (which views read) and to the rank's record (its latest line). A rank killed by a signal has its
faulthandler report read from its stderr, so its failure can say where in the user's code it died. When the
attempt ends, each log closes with how its rank ended, so the file alone tells the story.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpnb.core import rundir
from ddpnb.core.cellnames import cell_names
from ddpnb.core.failures import Failure
from ddpnb.core.output import LineBuffer, LineDecoder, last_text
from ddpnb.core.record import RankRecord, RankState
from ddpnb.core.spec import Stream
from ddpnb.core.stacks import FATAL_ERROR, CrashDump
from ddpnb.core.words import describe_exit, size_text

FLUSH_EVERY = 1.0  # seconds a rank's output may wait in memory before its log file has it (`RankLogs.flush`)
FLUSH_SIZE = 1 << 16  # bytes of one rank's output written at once whenever they come


def log_paths(run_dir: Path, world_size: int, attempt: int, restarts: bool) -> list[Path]:
    """Each rank's log; with restarts, each attempt has its own (`rank1.attempt0.log`)."""
    return [run_dir / (f"rank{r}.attempt{attempt}.log" if restarts else f"rank{r}.log") for r in range(world_size)]


class _Log:
    """A rank's log file that a full disk (or a file size limit) cuts short, not the run: the first write that
    fails is said once, in the rank's output, and the log takes nothing more. What comes is held until `flush`
    (or FLUSH_SIZE of it): a write per rank per read pass was the reader's largest cost at 1,024 ranks, each
    write handing the interpreter's lock to the views' threads and waiting to get it back."""

    def __init__(self, file: Any, cut: Callable[[OSError], None]) -> None:
        self.file = file
        self.written = 0
        self._cut = cut
        self.failed: OSError | None = None
        self.pending = bytearray()

    def write(self, data: bytes) -> None:
        if self.failed is None and data:
            self.pending += data
            if len(self.pending) >= FLUSH_SIZE:
                self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        data, self.pending = self.pending, bytearray()
        if self.failed is not None:
            return
        view = memoryview(data)
        try:
            while view:  # a write that meets the limit writes part: the next says why
                count = self.file.write(view) or 0
                self.written, view = self.written + count, view[count:]
        except OSError as exc:  # the training goes on: its output still reaches the cell
            self.failed = exc
            self._cut(exc)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.file.close()


class RankLogs:
    """The attempt's ranks' output: `output` as it arrives, `close` at the attempt's end."""

    def __init__(self, ranks: list[RankRecord], failures: list[Failure], lines: LineBuffer) -> None:
        self._ranks = ranks
        self._failures = failures  # the attempt's, appended to by the attempt: crashes are explained in place
        self._lines = lines
        self._logs: list[Any] = []
        self._decoders: dict[tuple[int, Stream], LineDecoder] = {}
        self._crashes: dict[int, CrashDump] = {}  # faulthandler's report in each rank's stderr, once it starts
        try:
            for record in ranks:
                file = open(record.log_path, "wb", buffering=0, opener=rundir.private)  # noqa: SIM115
                log = _Log(file, functools.partial(self._cut, record.rank))
                self._logs.append(log)
                for stream in Stream:
                    self._decoders[(record.rank, stream)] = LineDecoder(log)
        except BaseException:
            self.release()
            raise

    def output(self, rank: int, stream: Stream, data: bytes) -> tuple[int, bool]:
        """Take a rank's raw bytes (b"": the stream ended); returns (lines added, whether a crash's failure now
        says where it died)."""
        lines = self._decoders[(rank, stream)].feed(data, final=not data)
        return (len(lines), self._add(rank, stream, lines)) if lines else (0, False)

    def _add(self, rank: int, stream: Stream, lines: list[str]) -> bool:
        record = self._ranks[rank]
        record.lines += len(lines)  # the log file has every line
        own, shown, explained = lines, lines, False
        if stream is Stream.STDERR:  # a fatal error's report is not the rank's last line: it says where it died
            crash = self._crashes.get(rank) or CrashDump()
            own = crash.own_lines(lines)
            if crash.lines:
                self._crashes[rank] = crash
                explained = self.explain_crash(rank)
                shown = _shown(lines, own)
        self._lines.add(rank, stream, shown)
        if own:
            record.last_line = own[-1]
            # a rank with tqdm bars writes each bar's final state as a line; the dashboard shows the bar already
            text = last_text(own) if record.progress else own[-1]
            record.last_text = record.last_text if text is None else text
        return explained

    def say(self, rank: int, text: str) -> None:
        """ddpnb's own line about the rank, `[ddpnb] text`, among its output (its stderr) and in its log."""
        line = f"[ddpnb] {text}"
        cut = any(self._decoders[(rank, stream)].partial for stream in Stream)  # a line of the rank's own is open
        self._logs[rank].write((b"\n" if cut else b"") + f"{line}\n".encode())
        self._ranks[rank].lines += 1
        self._lines.add(rank, Stream.STDERR, [line])

    def flush(self, rank: int | None = None) -> None:
        """What came since the last flush, into the log files (`rank`: that rank's only). The attempt flushes every
        FLUSH_EVERY, a rank's log as the rank ends, and every log at the end."""
        for log in self._logs if rank is None else self._logs[rank : rank + 1]:
            log.flush()

    def _cut(self, rank: int, exc: OSError) -> None:
        log = self._logs[rank]
        line = (
            f"[ddpnb] rank {rank}'s log stops at {size_text(log.written)}: writing {self._ranks[rank].log_path} "
            f"failed ({type(exc).__name__}: {exc}); its output goes on here, and the run with it. Free space in "
            "the run directory's file system (or point DDPNB_RUNS_DIR elsewhere) for the next run's logs."
        )
        self._lines.add(rank, Stream.STDERR, [line])

    def explain_crash(self, rank: int) -> bool:
        """A rank killed by a signal, with faulthandler's report read: its failure says where, in the user's code,
        it died (`killed by SIGSEGV in crash (Cell In[3], line 4)`), and holds the report as its traceback.
        Returns whether the failure's summary changed."""
        crash = self._crashes.get(rank)
        failure = next((f for f in self._failures if f.rank == rank), None)
        code = self._ranks[rank].exitcode
        if crash is None or failure is None or code is None or code >= 0 or not crash.complete:
            return False
        if not failure.traceback:
            failure.traceback = crash.stack()
        frame = crash.crash_frame()
        if not frame or failure.summary != describe_exit(code):
            return False
        filename, line, function = frame
        location = f'File "{filename}", line {line}'
        named = cell_names(location)
        failure.summary += f" in {function} ({named if named != location else f'{filename}, line {line}'})"
        return True

    def close(self, stop_note: str) -> None:
        """The attempt's ranks are gone: the last partial lines, the crash reports cut short, then each log's
        ending (`stop_note`: why ddpnb stopped the ranks it stopped)."""
        try:
            for (rank, stream), decoder in self._decoders.items():  # a last line without its newline
                if decoder.partial or decoder.partial_cut:
                    self._add(rank, stream, decoder.feed(b"", final=True))
            for rank, crash in self._crashes.items():  # a report cut short (no extension modules line)
                crash.complete = True
                self.explain_crash(rank)
            self._write_endings(stop_note)
        finally:
            self.release()

    def _write_endings(self, stop_note: str) -> None:
        failures = {failure.rank: failure for failure in self._failures}
        for rank, log in zip(self._ranks, self._logs):
            if rank.state is RankState.FINISHED:
                continue
            failure = failures.get(rank.rank)
            if failure is not None:
                ending = f"rank {rank.rank} failed: {failure.summary}\n{failure.traceback}".rstrip()
            elif rank.state is RankState.STOPPED:  # no exit code where the engine's close ended it
                how = f" ({describe_exit(rank.exitcode)})" if rank.exitcode is not None else ""
                ending = f"rank {rank.rank} stopped by ddpnb{how}: {stop_note}"
            else:
                ending = f"rank {rank.rank} {describe_exit(rank.exitcode)}"
            log.write(f"\n[ddpnb] {ending}\n".encode())

    def release(self) -> None:
        for log in self._logs:
            log.close()
        self._logs = []


def _shown(lines: list[str], own: list[str]) -> list[str]:
    """What views show of lines holding a fatal error's report: the rank's own lines, and the report's first line
    pointing to the rest, which the failure holds (shown once, in the error) and the log file keeps."""
    shown, mine = [], iter(own)
    next_own = next(mine, None)
    for line in lines:
        if line is next_own:
            shown.append(line)
            next_own = next(mine, None)
        elif line.startswith(FATAL_ERROR):
            shown.append(f"{line} (where: in the error below; the whole report: in the rank's log)")
    return shown
