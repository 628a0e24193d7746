"""The supervisor: a `Run` owns its worker processes from start to teardown.

Workers are forked from the pre-warmed forkserver (`_forkserver`); each run gets new, clean processes in
milliseconds.
Each rank gets private pipes from the kernel: stdout, stderr (fd level), a message channel to the kernel, and a
lifeline that tells it when the kernel is gone. One thread per run multiplexes them plus the process sentinels;
nothing it does waits on a view.
"""

from __future__ import annotations

import codecs
import fcntl
import functools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import selectors
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from itertools import repeat
from pathlib import Path
from typing import Any

from ddpnb import _forkserver, _pickling, _worker
from ddpnb import _messages as msg
from ddpnb._record import (
    Failure,
    Outcome,
    RankRecord,
    RankState,
    RunInterrupted,
    RunRecord,
    WorkerError,
    describe_exit,
    is_knock_on,
)

KEEP_RUNS = 50  # run directories kept; older ones are deleted when a new run starts
STOP_GRACE = 2.0  # seconds between SIGTERM and SIGKILL when ranks are stopped
STACK_WAIT = 1.0  # seconds a stalled rank gets to dump its Python stacks before it is stopped
DRAIN_WAIT = 2.0  # seconds the output pipes may stay open after every rank exited (a process that escaped)
MAX_LINE_CHARS = 10_000  # longer lines are cut in memory and in the views; the log file keeps every byte
PIPE_SIZE = 1 << 20  # bytes a rank may write before it waits for the kernel to read (Linux pipe buffer)
# seconds between two wake-ups of a run's reader while every rank is busy (see `Run._loop`), and so between two
# redraws of its views: ipykernel sends a cell's printed output every 0.2 s too
COALESCE = 0.2
TICK = 1.0  # seconds between two redraws of a view when nothing changed (its clocks move on)

_live_runs: set[Run] = set()
def runs_root() -> Path:
    """Where run directories live: $DDPNB_RUNS_DIR, else <tmp>/ddpnb-<uid>; private to this user."""
    root = Path(os.environ.get("DDPNB_RUNS_DIR") or Path(tempfile.gettempdir()) / f"ddpnb-{os.getuid()}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = root.lstat()
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid():
        # in a shared /tmp another user could have made it first, to read or swap the logs
        raise PermissionError(f"{root} is not a directory owned by you; set DDPNB_RUNS_DIR to a private directory.")
    if info.st_mode & 0o077:
        root.chmod(0o700)
    return root


def new_run_dir() -> Path:
    """A fresh private directory for one run. Retention, applied here: the newest KEEP_RUNS - 1 directories of
    ended runs are kept (KEEP_RUNS with the new one), and those of runs still going in any process (see
    `_lock_run_dir`); older ones are deleted."""
    root = runs_root()
    ended = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not _run_dir_in_use(p))
    for stale in ended[: max(0, len(ended) - KEEP_RUNS + 1)]:  # names sort by creation time
        shutil.rmtree(stale, ignore_errors=True)
    now = time.time()
    path = root / f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}.{int(now % 1 * 1e6):06d}-{uuid.uuid4().hex[:6]}"
    path.mkdir(mode=0o700)
    return path


def _lock_run_dir(path: Path) -> int:
    """Hold a lock on the run directory while the run lives (released by the kernel's death too), so that
    retention in this or another kernel never deletes the logs of a run still going."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _run_dir_in_use(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:  # another kernel's retention got there first
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _bind_store_socket() -> socket.socket:
    """A socket bound to 127.0.0.1, port 0, for rank 0's TCPStore to listen on. Rank 0 receives the socket
    itself, so the store is reachable from this machine only and no other process can take its port; the
    kernel closes its copy once rank 0 has it, and never listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def _remove_if_empty(run_dir: Path) -> None:
    """A run that never got going leaves nothing behind, unless a rank wrote something already."""
    if run_dir.is_dir() and all(not path.stat().st_size for path in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)


def _enlarge_pipe(fd: int) -> int:
    """Let a rank write a burst of output without waiting for the kernel (best effort: Linux only); returns
    how many bytes the pipe holds."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return 1 << 16  # the usual size elsewhere
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:  # above /proc/sys/fs/pipe-max-size, or the user's pipe budget is spent: keep the default
        return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)


class _Stream:
    """One rank's stdout or stderr: raw bytes to the log file, decoded lines to the record.

    Memory stays bounded whatever the rank writes: a line longer than MAX_LINE_CHARS is cut (the log file keeps
    it whole), and a progress bar redrawing one line with carriage returns keeps only its latest redraw.
    """

    def __init__(self, rank: int, name: str, log: Any) -> None:
        self.rank = rank
        self.name = name
        self.log = log
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.partial = ""  # the line being written, not yet ended by a newline
        self.partial_cut = 0  # characters of that line already dropped from memory

    def feed(self, data: bytes, final: bool = False) -> list[str]:
        self.log.write(data)
        text = self.partial + self.decoder.decode(data, final=final)
        pieces = text.split("\n")
        self.partial = pieces.pop()
        if pieces:
            pieces[0] = _visible(pieces[0], self.partial_cut)
            self.partial_cut = 0
        if len(pieces) > 1 and ("\r" in text or max(map(len, pieces)) > MAX_LINE_CHARS):
            pieces[1:] = [_visible(piece) for piece in pieces[1:]]
        redraw = self.partial.rfind("\r", 0, len(self.partial) - 1)
        if redraw >= 0:  # only the latest redraw is visible
            self.partial, self.partial_cut = self.partial[redraw + 1:], 0
        if len(self.partial) > MAX_LINE_CHARS:
            self.partial_cut += len(self.partial) - MAX_LINE_CHARS
            self.partial = self.partial[:MAX_LINE_CHARS]
        if final and (self.partial or self.partial_cut):
            pieces.append(_visible(self.partial, self.partial_cut))
            self.partial, self.partial_cut = "", 0
        return pieces


def _visible(line: str, cut: int = 0) -> str:
    """What a terminal would show of `line`: the text after its last carriage return, cut to MAX_LINE_CHARS."""
    redraw = line.rfind("\r", 0, len(line) - 1)
    if redraw >= 0:
        line, cut = line[redraw + 1:], 0
    line = line.rstrip("\r")
    if len(line) > MAX_LINE_CHARS:
        line, cut = line[:MAX_LINE_CHARS], cut + len(line) - MAX_LINE_CHARS
    return f"{line} [... {cut} more characters in the log]" if cut else line


class Run:
    """A set of worker processes, one per rank, and what they report. Use `wait()`, `result()`, `stop()`."""

    stop_wait = STOP_GRACE + STACK_WAIT + 5  # seconds `stop()` waits for every rank to be gone

    def __init__(self, spec: _worker.WorkerSpec, devices: list[str], timeout: float | None = None) -> None:
        self.spec = spec
        self.timeout = timeout
        self.record = RunRecord(run_dir=Path(spec.run_dir), world_size=spec.world_size, backend=spec.backend)
        self.record.ranks = [
            RankRecord(rank=r, device=devices[r], log_path=Path(spec.run_dir) / f"rank{r}.log")
            for r in range(spec.world_size)
        ]
        self.lock = threading.Lock()  # guards record.recent and line counters against view threads
        self.line_seq = 0
        self._payload: bytes | None = None  # rank 0's value, pickled; or, `_saved`, in the result file
        self._saved = False
        self._result_fd: int | None = None
        self._value: Any = None
        self._returned: set[int] = set()
        self._stop_reason: Outcome | None = None
        self._stop_note = ""
        self._stop_requested: tuple[Outcome, str] | None = None
        self._kill_at: float | None = None
        self._signalled: dict[int, set[int]] = {}  # rank -> the stop signals ddpnb sent it
        self._signalled_at: dict[int, float] = {}  # rank -> when ddpnb first signalled it (time.time())
        self._done = threading.Event()
        self._procs: list[Any] = []
        self._listeners: list[Callable[[], None]] = []  # fed by `wait()` with the reader's news
        self._enders: list[Callable[[], None]] = []  # called when `wait()` returns
        self._changes = threading.Condition()  # views wait on it for the reader's news (`watch`)
        self._generation = 0  # how many times the reader announced news
        self._news = False  # something was read or changed since the last announcement
        self._turn = False  # ... and it is a rank starting, returning, failing or exiting, or the run stopping
        self._pipe_room = PIPE_SIZE  # what the smallest of the run's pipes holds

    # --- public lifecycle -----------------------------------------------------------------------------------
    def start(self) -> Run:
        # under the forkserver's lock until the run counts as live: `preload` must not restart the forkserver
        # while ranks are being forked from it
        try:
            with _forkserver.lock:
                self._start_ranks(_forkserver.context_held())
        except KeyboardInterrupt:  # the ranks that had started are gone (`_start_ranks`): say so, not where
            self.record.outcome, self.record.ended = Outcome.INTERRUPTED, time.time()
            _remove_if_empty(Path(self.spec.run_dir))
            raise RunInterrupted(self.record, starting=True) from None
        return self

    def _start_ranks(self, context: multiprocessing.context.BaseContext) -> None:
        self._dir_lock = _lock_run_dir(Path(self.spec.run_dir))
        store_socket = _bind_store_socket()
        self.spec.master_port = store_socket.getsockname()[1]
        try:
            spec_payload = _pickling.dump_spec(self.spec)  # before any rank starts: args that cannot be sent
        except _pickling.NotPicklableError:
            store_socket.close()
            os.close(self._dir_lock)
            Path(self.spec.run_dir).rmdir()  # still empty: a run that never started leaves nothing
            raise
        self._conns: dict[Any, int] = {}  # each rank's channel, read end -> rank
        self._frames: dict[Any, msg.Frames] = {}
        self._streams: dict[int, _Stream] = {}
        self._logs: list[Any] = []
        self._kernel_ends: list[Any] = []  # the kernel's other pipe ends: stdout/stderr read ends, lifelines
        # rank 0 writes a value holding tensors to an anonymous memory file; the kernel maps it (`result()`)
        try:
            self._create_result_file()
            for rank in range(self.spec.world_size):
                self._start_rank(context, rank, spec_payload, *((store_socket, self._result_fd) if rank == 0 else ()))
                if rank == 0:
                    store_socket.close()  # rank 0 has its own copy now
            # the duration and the timeout count from the first rank's start, not from the forkserver's first import
            self.record.started = self.record.ranks[0].started
            _live_runs.add(self)
            threading.Thread(target=self._loop, name="ddpnb-run", daemon=True).start()
        except BaseException:  # a rank could not start: the ones that did must not outlive this call
            _live_runs.discard(self)
            store_socket.close()
            os.close(self._dir_lock)
            for proc in self._procs:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.join(5)
            for end in [*self._logs, *self._kernel_ends, *self._conns]:
                end.close()
            self._close_result_file()
            raise

    def _start_rank(self, context: Any, rank: int, spec_payload: bytes, store_socket: socket.socket | None = None,
                    result_fd: int | None = None) -> None:
        """Fork one rank, with its pipes: stdout, stderr and the message channel (rank to kernel), and a lifeline
        the kernel never writes to, whose EOF tells the rank's watchdog that the kernel is gone."""
        record = self.record.ranks[rank]
        log = open(record.log_path, "wb", buffering=0, opener=_worker._private)  # noqa: SIM115
        self._logs.append(log)
        channel, channel_w = multiprocessing.Pipe(duplex=False)
        lifeline_r, lifeline = multiprocessing.Pipe(duplex=False)
        out_r, out_w = multiprocessing.Pipe(duplex=False)
        err_r, err_w = multiprocessing.Pipe(duplex=False)
        self._conns[channel] = rank
        self._frames[channel] = msg.Frames()
        self._kernel_ends += [out_r, err_r, lifeline]
        self._streams[out_r.fileno()] = _Stream(rank, "stdout", log)
        self._streams[err_r.fileno()] = _Stream(rank, "stderr", log)
        self._pipe_room = min(self._pipe_room, *(_enlarge_pipe(end.fileno()) for end in (channel_w, out_w, err_w)))
        result = None if result_fd is None else _worker.FdForChild(result_fd)
        proc = context.Process(
            target=_worker.entry, args=(rank, channel_w, lifeline_r, out_w, err_w, spec_payload, store_socket, result),
            name=f"{_worker.PROCESS_PREFIX}rank{rank}", daemon=False,
        )
        try:
            proc.start()
        finally:
            for end in (channel_w, lifeline_r, out_w, err_w):
                end.close()
        self._procs.append(proc)
        record.pid, record.started = proc.pid, time.time()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def outcome(self) -> Outcome:
        return self.record.outcome

    @property
    def status(self) -> str:
        """One line: the outcome so far, the time, and each rank's state."""
        record = self.record
        ranks = ", ".join(f"{r.rank}: {r.state.value}" for r in record.ranks)
        return f"{record.outcome.value} after {record.duration:.1f} s (ranks {ranks})"

    def __repr__(self) -> str:
        return (f"<ddpnb run of {self.record.world_size} ranks ({self.record.backend}): {self.status}; "
                f".wait() .result() .stop()>")

    def wait(self, timeout: float | None = None) -> RunRecord:
        """Block until every rank has ended (or `timeout` passes); Ctrl-C stops the run and re-raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = 0
        try:
            while not self._done.is_set():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._listeners:  # no view to feed: sleep until the end (Ctrl-C still wakes this wait)
                    self._done.wait(left)
                else:  # feed the views whenever the reader has news
                    seen = self.watch(seen, TICK if left is None else min(TICK, left))
                    self._notify()
                if deadline is not None and time.monotonic() >= deadline:
                    break
        except KeyboardInterrupt:
            self.stop(Outcome.INTERRUPTED, "interrupted by the user (Ctrl-C / kernel interrupt)")
            raise RunInterrupted(self.record) from None
        finally:
            self._notify(ending=True)
        return self.record

    def watch(self, seen: int, timeout: float) -> int:
        """Wait until the reader announces news after announcement number `seen`, or `timeout` passes; return the
        latest announcement's number. Lines and metrics are announced at most once a COALESCE (once a POLL on
        Ray), a rank starting, returning, failing or exiting at once, and the run's end. How views redraw without
        waking on a timer of their own."""
        with self._changes:
            self._changes.wait_for(lambda: self._generation != seen or self._done.is_set(), timeout)
            return self._generation

    def _announce(self) -> None:
        with self._changes:
            self._generation += 1
            self._news = self._turn = False
            self._changes.notify_all()

    def result(self) -> Any:
        """Rank 0's return value; raises `WorkerError` if the run did not succeed."""
        self.wait()
        if self.record.outcome is not Outcome.SUCCEEDED:
            raise WorkerError(self.record, hint=_hint(self.record))
        if self._payload is not None:  # unpickled once; the bytes are dropped so a big result is not held twice
            self._value, self._payload = pickle.loads(self._payload), None
        elif self._saved:  # mapped, not read: the tensors are the file's pages
            assert self._result_fd is not None
            self._value, self._saved = _pickling.load(self._result_fd), False
            self._close_result_file()
        return self._value

    def _create_result_file(self) -> None:
        """Where rank 0 writes a value holding tensors (`_worker._dump_result`); without one (no memfd_create
        here, or refused) every value travels in rank 0's last message."""
        try:
            self._result_fd = os.memfd_create("ddpnb-result", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return
        self._result_closer = weakref.finalize(self, os.close, self._result_fd)  # a result nobody took

    def _close_result_file(self) -> None:
        """The file's memory goes with the last reference to it: this fd, or a tensor mapped from it."""
        if self._result_fd is not None:
            self._result_closer()
            self._result_fd = None

    def join(self, timeout: float | None = None) -> bool:
        """Like mp.spawn's `ProcessContext.join`: True once every rank has ended, raises `WorkerError` on
        failure, False if `timeout` passed first."""
        self.wait(timeout)
        if not self.done:
            return False
        if self.record.outcome is not Outcome.SUCCEEDED:
            raise WorkerError(self.record, hint=_hint(self.record))
        return True

    def stop(self, outcome: Outcome = Outcome.STOPPED, note: str = "stopped by the user") -> None:
        """Stop every rank (SIGTERM, then SIGKILL after a grace period) and wait until all are gone."""
        if self._done.is_set():
            return
        self._stop_requested = (outcome, note)
        deadline = time.monotonic() + self.stop_wait
        while not self._done.is_set() and time.monotonic() < deadline:
            try:
                self._done.wait(0.1)
            except KeyboardInterrupt:  # a second interrupt while stopping: keep stopping, we are nearly done
                continue

    def subscribe(self, callback: Callable[[], None], *, news: bool = True) -> None:
        """Call `callback()` from the thread in `wait()` when the record changed and once a TICK anyway (views
        redraw from the record), and when `wait()` returns; with `news=False`, only when `wait()` returns (a view
        with a thread of its own, which must still be complete before a foreground cell ends)."""
        (self._listeners if news else self._enders).append(callback)

    def _notify(self, ending: bool = False) -> None:
        for callback in [*self._listeners, *(self._enders if ending else ())]:
            callback()
        if ending and self._done.is_set():  # the views have drawn the end: let go of them, so that the run and
            self._listeners.clear()        # its value go with the caller's last reference, not at the next gc
            self._enders.clear()

    # --- the loop ---------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Read everything the ranks send until all have exited, with one epoll selector for the run's life.

        While every rank is busy in its function, wake-ups are spaced COALESCE apart (the views redraw no more
        often): a training loop that prints and logs every step then costs the kernel five wake-ups a second, not
        one per line, and a rank's write never waits for the kernel to wake (on a virtual machine a wake-up can
        cost 0.3 ms of CPU). The pipes hold what arrives meanwhile, and each wake-up reads them empty; when one
        wake-up read more than a quarter of what a pipe holds, output is flowing fast and the next pass reads
        without pausing. A pause ends early when a rank exits (a rank exits right after its function returns
        or fails; rank 0 once the others are done too), so the end of a run is seen at once.
        """
        self._selector = selectors.DefaultSelector()
        for fd in self._streams:
            self._selector.register(fd, selectors.EVENT_READ, self._read_stream)
        for conn in self._conns:
            self._selector.register(conn, selectors.EVENT_READ, self._read_channel)
        for rank, proc in enumerate(self._procs):
            self._selector.register(proc.sentinel, selectors.EVENT_READ, functools.partial(self._on_exit, rank))
        self._exits = len(self._procs)
        self._wake_bytes = 0  # read since the last wake-up
        self._buffer = memoryview(bytearray(PIPE_SIZE))  # every read lands here first
        all_exited: float | None = None
        last_wake, last_news, hurry = 0.0, 0.0, False
        try:
            while self._selector.get_map():
                woken = time.monotonic()
                if woken - last_wake < COALESCE and not hurry and self._steady():
                    # let more arrive, so a burst is one read; a rank that exits ends the pause at once
                    multiprocessing.connection.wait([proc.sentinel for proc in self._procs],
                                                    timeout=COALESCE - (woken - last_wake))
                last_wake, self._wake_bytes = time.monotonic(), 0
                timeout = 0.1
                while events := self._selector.select(timeout):  # until nothing is left to read
                    for key, _ in events:
                        if key.fd in self._selector.get_map():  # not closed by an earlier event of this batch
                            key.data(key.fileobj)  # one read of a pipe (a rank's exit drains and closes its channel)
                    timeout = 0
                    if time.monotonic() - last_wake > COALESCE:  # flooded: still check timeouts and stops
                        break
                hurry = self._wake_bytes >= self._pipe_room // 4
                self._check_stop()
                if self._turn or (self._news and time.monotonic() - last_news >= COALESCE):
                    self._announce()  # output at most once a COALESCE, however it floods in; a turn at once
                    last_news = time.monotonic()
                if not self._exits:
                    all_exited = all_exited or time.monotonic()
                    if time.monotonic() - all_exited > DRAIN_WAIT:  # a process that left the rank's group
                        break  # still holds its output pipe open: stop reading rather than hang the cell
        finally:
            self._selector.close()
            self._buffer = memoryview(b"")
            self._finish()

    def _steady(self) -> bool:
        """Every rank is still inside its function and nothing is ending: waking later costs no latency."""
        return self._exits == len(self._procs) and not self._returned and self._stop_reason is None \
            and self._stop_requested is None

    def _read_stream(self, fd: int) -> None:
        stream = self._streams[fd]
        size = os.readv(fd, [self._buffer])
        self._wake_bytes += size
        data = bytes(self._buffer[:size])
        lines = stream.feed(data, final=not data)
        if not data:
            self._selector.unregister(fd)
            del self._streams[fd]
        if lines:
            self._add_lines(stream.rank, stream.name, lines)

    def _add_lines(self, rank: int, stream: str, lines: list[str]) -> None:
        record = self.record.ranks[rank]
        self._news = True
        with self.lock:
            self.line_seq += len(lines)
            kept = lines[-(self.record.recent.maxlen or len(lines)):]  # older ones would fall out at once
            self.record.recent.extend(
                zip(range(self.line_seq - len(kept) + 1, self.line_seq + 1), repeat(rank), repeat(stream), kept))
            record.lines += len(lines)
            record.last_line = lines[-1]

    def _read_channel(self, conn: Any) -> None:
        size = os.readv(conn.fileno(), [self._buffer])
        if not size:
            self._close_channel(conn)
            return
        self._wake_bytes += size
        rank = self._conns[conn]
        for data in self._frames[conn].feed(self._buffer[:size]):
            try:
                message = msg.decode(data)
            except Exception:  # noqa: BLE001 - a frame cut short (a rank killed mid-write): nothing more to trust
                self._close_channel(conn)
                return
            self._handle(rank, message)

    def _close_channel(self, conn: Any) -> None:
        self._selector.unregister(conn)
        del self._conns[conn], self._frames[conn]
        conn.close()

    def _handle(self, rank: int, message: msg.Message) -> None:
        record = self.record.ranks[rank]
        self._news = True
        self._turn = self._turn or isinstance(message, (msg.Started, msg.Returned, msg.Failed))
        if isinstance(message, msg.Metric):
            for name, value in message.values.items():
                record.metrics.setdefault(name, []).append((message.step, message.time, value))
        elif isinstance(message, msg.Progress):
            record.update_progress(message)
        elif isinstance(message, msg.GpuMemory):
            record.gpu_memory = (message.reserved, message.peak)
        elif isinstance(message, msg.Imported):
            self.record.hint = _preload_hint(message)
        elif isinstance(message, msg.Started):
            record.state, record.device = RankState.RUNNING, message.device
        elif isinstance(message, msg.Returned):
            self._returned.add(rank)
            if rank == 0:
                self._payload, self._saved = message.payload, message.saved
        elif isinstance(message, msg.Failed):
            record.state = RankState.FAILED
            if message.exc_type == "SystemExit":
                summary = f"called sys.exit({message.message}) before its function returned"
            else:
                summary = f"{message.exc_type}: {message.message}" if message.message else message.exc_type
            # an error raised after ddpnb began stopping this rank (a SIGTERM handler that raises) is a consequence;
            # one raised before, but read after, is the rank's own
            knock_on = is_knock_on(message.exc_type, message.message) \
                or message.time >= self._signalled_at.get(rank, float("inf"))
            self.record.failures.append(Failure(rank, message.time, summary, message.traceback, knock_on))
            self._begin_stop(Outcome.FAILED, f"rank {rank} raised {message.exc_type}")

    def _on_exit(self, rank: int, sentinel: int) -> None:
        self._selector.unregister(sentinel)
        self._news = self._turn = True
        self._exits -= 1
        proc, record = self._procs[rank], self.record.ranks[rank]
        record.exitcode, record.ended = proc.exitcode, time.time()
        _signal_group(proc.pid, signal.SIGKILL)  # whatever the rank started dies with it
        self._drain_channel(rank)
        if record.state is RankState.FAILED:
            return
        code = record.exitcode if record.exitcode is not None else 0
        if code == 0 and rank in self._returned:
            record.state = RankState.FINISHED
        elif code < 0 and -code in self._signalled.get(rank, ()):  # ended by ddpnb's stop, not by itself
            record.state = RankState.STOPPED
        else:
            record.state = RankState.FAILED
            cause = describe_exit(record.exitcode)
            if record.exitcode is not None and record.exitcode >= 0:
                cause += " before its function returned (os._exit, or exit() in C code?)"
            self.record.failures.append(Failure(rank, time.time(), cause))
            self._begin_stop(Outcome.FAILED, f"rank {rank} {cause}")

    def _drain_channel(self, rank: int) -> None:
        """A rank's last messages (its traceback) may still sit in the pipe after it exited: read them all."""
        for conn, owner in list(self._conns.items()):
            if owner != rank:
                continue
            deadline = time.monotonic() + DRAIN_WAIT
            while conn in self._conns and time.monotonic() < deadline and conn.poll(1.0):
                self._read_channel(conn)  # closes it at EOF
            if conn in self._conns:  # a process the rank started still holds the channel: stop waiting for it
                self._close_channel(conn)

    def _begin_stop(self, outcome: Outcome, note: str) -> None:
        if self._stop_reason is not None:
            return
        self._stop_reason, self._stop_note = outcome, note
        self._news = self._turn = True
        for proc, rank in zip(self._procs, self.record.ranks):
            if proc.exitcode is None and rank.state is not RankState.FAILED:  # a failed rank exits by itself
                self._signal(rank.rank, signal.SIGTERM)
        self._kill_at = time.monotonic() + STOP_GRACE

    def _check_stop(self) -> None:
        if self._stop_requested and self._stop_reason is None:
            self._begin_stop(*self._stop_requested)
        elif self.timeout and self._stop_reason is None and self.record.duration > self.timeout:
            self._dump_stacks()
            self._begin_stop(Outcome.TIMED_OUT, f"stopped after the {self.timeout:g} s timeout (--timeout)")
        if self._kill_at is not None and time.monotonic() > self._kill_at:
            for rank, proc in enumerate(self._procs):
                if proc.exitcode is None:
                    self._signal(rank, signal.SIGKILL)
            self._kill_at = None

    def _signal(self, rank: int, sig: signal.Signals) -> None:
        self._signalled.setdefault(rank, set()).add(sig)
        self._signalled_at.setdefault(rank, time.time())
        _kill_group(self._procs[rank].pid, sig)

    def _dump_stacks(self) -> None:
        live = [proc for proc in self._procs if proc.exitcode is None]
        for proc in live:
            _kill_group(proc.pid, signal.SIGUSR1, group=False)
        time.sleep(STACK_WAIT)
        for rank, proc in enumerate(self._procs):
            if proc in live:
                record = self.record.ranks[rank]
                path = Path(self.spec.run_dir) / f"rank{rank}.stack"
                record.stack = _user_stack(path.read_text(errors="replace")) if path.exists() else ""
                record.stalled_state = record.state

    def _finish(self) -> None:
        try:
            for proc in self._procs:  # belt and braces: nothing of this run may outlive it
                if proc.exitcode is None:
                    _kill_group(proc.pid, signal.SIGKILL)
                    proc.join(5)
            self._write_endings()
        finally:  # whatever failed above (a full disk), release everything and let `wait()` return
            for end in [*self._logs, *self._kernel_ends, *self._conns]:
                end.close()
            os.close(self._dir_lock)
            for proc in self._procs:
                if proc.exitcode is not None:
                    proc.close()  # its sentinel fds; the record keeps the exit code
            self._conclude()

    def _conclude(self) -> None:
        """The run's outcome from its ranks' states; then `wait()` returns. Every engine ends here."""
        record = self.record
        record.ended = time.time()
        if self._stop_reason is not None:
            record.outcome, record.note = self._stop_reason, self._stop_note
        elif all(r.state is RankState.FINISHED for r in record.ranks):
            record.outcome = Outcome.SUCCEEDED
        else:
            record.outcome, record.note = Outcome.FAILED, "not every rank finished"
        if record.outcome is not Outcome.SUCCEEDED:  # `result()` raises: what rank 0 sent is not needed
            self._payload, self._saved = None, False
        if not self._saved:
            self._close_result_file()
        _live_runs.discard(self)
        self._done.set()
        self._announce()

    def _write_endings(self) -> None:
        """End each rank's log with how the rank ended, so the file alone tells the story."""
        failures = {failure.rank: failure for failure in self.record.failures}
        for rank, log in zip(self.record.ranks, self._logs):
            if rank.state is RankState.FINISHED:
                continue
            failure = failures.get(rank.rank)
            if failure is not None:
                ending = f"rank {rank.rank} failed: {failure.summary}\n{failure.traceback}".rstrip()
            elif rank.state is RankState.STOPPED:
                ending = f"rank {rank.rank} stopped by ddpnb ({describe_exit(rank.exitcode)}): {self._stop_note}"
            else:
                ending = f"rank {rank.rank} {describe_exit(rank.exitcode)}"
            log.write(f"\n[ddpnb] {ending}\n".encode())


def _signal_group(pid: int, sig: int) -> None:
    """Signal what is left of an exited rank's process group. Never the PID itself: it was reaped and may be
    reused, whereas a process-group ID is not reused while any member of the group is alive."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone with the rank: nothing left to stop
        return


def _kill_group(pid: int | None, sig: int, group: bool = True) -> None:
    """Signal a running rank's process group (it calls setsid first thing); fall back to the process itself."""
    if pid is None:
        return
    try:
        if group:
            os.killpg(pid, sig)
            return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


_PLUMBING = (os.path.dirname(os.path.abspath(_worker.__file__)), os.path.dirname(multiprocessing.__file__), "<string>")


def _user_stack(dump: str) -> str:
    """faulthandler's dump of every thread, without ddpnb's watchdog thread and without the frames that start a
    rank (ddpnb, multiprocessing): what is left starts at the user's function. The raw dump stays on disk."""
    threads = []
    for block in dump.strip().split("\n\n"):
        lines = block.splitlines()
        frames = [line for line in lines[1:] if not any(f'File "{place}' in line for place in _PLUMBING)]
        if lines and "in _watch_kernel" not in block and frames:
            threads.append("\n".join([lines[0], *frames]))
    return "\n\n".join(threads)


def _hint(record: RunRecord) -> str:
    if record.outcome is Outcome.TIMED_OUT:
        return "The stacks above show where each rank waited; a rank that never reaches a collective hangs the others."
    if record.outcome is Outcome.INTERRUPTED:
        return "Every rank was stopped; run the cell again when ready."
    first = record.first_failure
    if first and first.summary.startswith("killed by"):
        return ("A rank died from a signal (a crash in C/C++ code, or the out-of-memory killer); its log shows its last "
                "output and, after a crash, where Python was.")
    return "Fix the error above and run the cell again; the kernel and its variables are unchanged."


_hinted: set[tuple[str, ...]] = set()  # modules `_preload_hint` already named in this kernel


def _preload_hint(imported: msg.Imported) -> str:
    """Once per kernel and set of modules: what rank 0 spent importing at this launch, and how to stop paying."""
    if imported.modules in _hinted:
        return ""
    _hinted.add(imported.modules)
    names = ", ".join(map(repr, imported.modules))
    return (f"rebuilding the function took rank 0 {imported.seconds:.1f} s, importing {names}, as every rank does at "
            f"every launch; ddpnb.preload({names}) imports {'it' if len(imported.modules) == 1 else 'them'} once, in "
            "the process ranks are forked from.")


def local_run_going() -> bool:
    """Whether a run's ranks, forked from the forkserver, are still going (Ray runs do not count)."""
    return any(run.record.engine == "local" for run in list(_live_runs))


def stop_all_runs() -> None:
    """atexit: a kernel that shuts down takes its runs with it."""
    for run in list(_live_runs):
        run.stop(Outcome.STOPPED, "the kernel shut down")

