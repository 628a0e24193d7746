"""The supervisor: a `Run` owns its worker processes from start to teardown.

Workers are forked from multiprocessing's forkserver, a fresh process (never a fork of the kernel) that has
imported torch once but never touches CUDA; each run therefore gets new, clean processes in milliseconds.
Each rank gets three private pipes from the kernel: stdout, stderr (fd level) and a duplex message channel.
One thread per run multiplexes all of them plus the process sentinels; nothing it does waits on a view.
"""

from __future__ import annotations

import codecs
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpnb import _messages as msg
from ddpnb import _worker
from ddpnb._record import Failure, Outcome, RankRecord, RankState, RunRecord, WorkerError, describe_exit

PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch.utils.data", "cloudpickle", "ddpnb._worker"]
KEEP_RUNS = 50  # run directories kept; older ones are deleted when a new run starts
STOP_GRACE = 2.0  # seconds between SIGTERM and SIGKILL when ranks are stopped
STACK_WAIT = 1.0  # seconds a stalled rank gets to dump its Python stacks before it is stopped

_live_runs: set[Run] = set()
_forkserver_lock = threading.Lock()


def forkserver_context() -> multiprocessing.context.BaseContext:
    """The pre-warmed process workers are forked from; starting it costs one `import torch`, once per kernel."""
    with _forkserver_lock:
        multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
        context = multiprocessing.get_context("forkserver")
        multiprocessing.forkserver.ensure_running()
        return context


def warm_up_in_background() -> None:
    threading.Thread(target=forkserver_context, name="ddpnb-warm-up", daemon=True).start()


def runs_root() -> Path:
    root = Path(os.environ.get("DDPNB_RUNS_DIR") or Path(tempfile.gettempdir()) / f"ddpnb-{os.getuid()}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return root


def new_run_dir() -> Path:
    root = runs_root()
    old = sorted(p for p in root.iterdir() if p.is_dir())
    for stale in old[: max(0, len(old) - KEEP_RUNS + 1)]:
        shutil.rmtree(stale, ignore_errors=True)
    path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    path.mkdir(mode=0o700)
    return path


def _reserve_port() -> socket.socket:
    """Bind port 0 and hold it (bound, not listening, SO_REUSEADDR) until the run ends: no other bind(0)
    on this machine gets it, yet rank 0's TCPStore can still listen on it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class _Stream:
    """One rank's stdout or stderr: raw bytes to the log file, decoded lines to the record."""

    def __init__(self, rank: int, name: str, log: Any) -> None:
        self.rank = rank
        self.name = name
        self.log = log
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.partial = ""

    def feed(self, data: bytes, final: bool = False) -> list[str]:
        self.log.write(data)
        text = self.partial + self.decoder.decode(data, final=final)
        lines = text.split("\n")
        self.partial = "" if final else lines.pop()
        # a carriage return redraws the line (progress bars): keep what is visible
        return [line.rsplit("\r", 1)[-1] if "\r" in line else line for line in lines if line or not final]


class Run:
    """A set of worker processes, one per rank, and what they report. Use `wait()`, `result()`, `stop()`."""

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
        self._payload: bytes | None = None
        self._returned: set[int] = set()
        self._stop_reason: Outcome | None = None
        self._stop_note = ""
        self._stop_requested: tuple[Outcome, str] | None = None
        self._kill_at: float | None = None
        self._done = threading.Event()
        self._procs: list[Any] = []
        self._listeners: list[Callable[[], None]] = []

    # --- public lifecycle -----------------------------------------------------------------------------------
    def start(self) -> Run:
        context = forkserver_context()
        self._port_holder = _reserve_port()
        self.spec.master_port = self._port_holder.getsockname()[1]
        self._conns: dict[Any, int] = {}
        self._streams: dict[int, _Stream] = {}
        self._logs: list[Any] = []
        self._read_ends: list[Any] = []  # the Connections that own the stdout/stderr read fds
        for rank in range(self.spec.world_size):
            log = open(self.record.ranks[rank].log_path, "wb", buffering=0, opener=_worker._private)  # noqa: SIM115
            self._logs.append(log)
            channel, child_channel = multiprocessing.Pipe(duplex=True)
            out_r, out_w = multiprocessing.Pipe(duplex=False)
            err_r, err_w = multiprocessing.Pipe(duplex=False)
            proc = context.Process(
                target=_worker.entry, args=(rank, child_channel, out_w, err_w, self.spec),
                name=f"ddpnb-rank{rank}", daemon=False,
            )
            proc.start()
            for end in (child_channel, out_w, err_w):
                end.close()
            self._procs.append(proc)
            self.record.ranks[rank].pid = proc.pid
            self._conns[channel] = rank
            self._streams[out_r.fileno()] = _Stream(rank, "stdout", log)
            self._streams[err_r.fileno()] = _Stream(rank, "stderr", log)
            self._read_ends += [out_r, err_r]
        _live_runs.add(self)
        threading.Thread(target=self._loop, name="ddpnb-run", daemon=True).start()
        return self

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def outcome(self) -> Outcome:
        return self.record.outcome

    def wait(self, timeout: float | None = None) -> RunRecord:
        """Block until every rank has ended (or `timeout` passes); Ctrl-C stops the run and re-raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(0.1):
                self._notify()
                if deadline is not None and time.monotonic() > deadline:
                    break
        except KeyboardInterrupt:
            self.stop(Outcome.INTERRUPTED, "interrupted by the user (Ctrl-C / kernel interrupt)")
            raise
        finally:
            self._notify()
        return self.record

    def result(self) -> Any:
        """Rank 0's return value; raises `WorkerError` if the run did not succeed."""
        self.wait()
        if self.record.outcome is not Outcome.SUCCEEDED:
            raise WorkerError(self.record, hint=_hint(self.record))
        return pickle.loads(self._payload) if self._payload is not None else None

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
        deadline = time.monotonic() + STOP_GRACE + STACK_WAIT + 5
        while not self._done.is_set() and time.monotonic() < deadline:
            try:
                self._done.wait(0.1)
            except KeyboardInterrupt:  # a second interrupt while stopping: keep stopping, we are nearly done
                continue

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback()` from the waiting thread about ten times a second (views redraw from the record)."""
        self._listeners.append(callback)

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    # --- the loop ---------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        try:
            while sentinels or self._streams or self._conns:
                waitables = [*self._streams, *self._conns, *sentinels]
                for ready in multiprocessing.connection.wait(waitables, timeout=0.1):
                    if ready in self._streams:
                        self._read_stream(ready)
                    elif ready in self._conns:
                        self._read_channel(ready)
                    else:
                        self._on_exit(sentinels.pop(ready))
                self._check_stop()
        finally:
            self._finish()

    def _read_stream(self, fd: int) -> None:
        stream = self._streams[fd]
        data = os.read(fd, 1 << 16)
        lines = stream.feed(data, final=not data)
        if not data:
            del self._streams[fd]
        if lines:
            self._add_lines(stream.rank, stream.name, lines)

    def _add_lines(self, rank: int, stream: str, lines: list[str]) -> None:
        record = self.record.ranks[rank]
        with self.lock:
            for line in lines:
                self.line_seq += 1
                self.record.recent.append((self.line_seq, rank, stream, line))
            record.lines += len(lines)
            record.last_line = lines[-1]

    def _read_channel(self, conn: Any) -> None:
        rank = self._conns[conn]
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            del self._conns[conn]
            conn.close()
            return
        self._handle(rank, message)

    def _handle(self, rank: int, message: msg.Message) -> None:
        record = self.record.ranks[rank]
        if isinstance(message, msg.Metric):
            for name, value in message.values.items():
                record.metrics.setdefault(name, []).append((message.step, message.time, value))
        elif isinstance(message, msg.Started):
            record.state, record.device = RankState.RUNNING, message.device
        elif isinstance(message, msg.Returned):
            self._returned.add(rank)
            if rank == 0:
                self._payload = message.payload
        elif isinstance(message, msg.Failed):
            record.state = RankState.FAILED
            summary = f"{message.exc_type}: {message.message}" if message.message else message.exc_type
            self.record.failures.append(Failure(rank, message.time, summary, message.traceback))
            self._begin_stop(Outcome.FAILED, f"rank {rank} raised {message.exc_type}")

    def _on_exit(self, rank: int) -> None:
        proc, record = self._procs[rank], self.record.ranks[rank]
        record.exitcode, record.ended = proc.exitcode, time.time()
        _kill_group(proc.pid, signal.SIGKILL)  # whatever the rank started dies with it
        self._drain_channel(rank)
        if record.state is RankState.FAILED:
            return
        if record.exitcode == 0 and rank in self._returned:
            record.state = RankState.FINISHED
        elif self._stop_reason is not None:
            record.state = RankState.STOPPED
        else:
            record.state = RankState.FAILED
            cause = describe_exit(record.exitcode)
            if record.exitcode is not None and record.exitcode >= 0:
                cause += " before its function returned (sys.exit or os._exit?)"
            self.record.failures.append(Failure(rank, time.time(), cause))
            self._begin_stop(Outcome.FAILED, f"rank {rank} {cause}")

    def _drain_channel(self, rank: int) -> None:
        """A rank's last messages (its traceback) may still sit in the pipe after it exited: read them all."""
        for conn, owner in list(self._conns.items()):
            if owner != rank:
                continue
            while conn.poll(1.0):
                try:
                    self._handle(rank, pickle.loads(conn.recv_bytes()))
                except (EOFError, OSError):
                    break
            del self._conns[conn]
            conn.close()

    def _begin_stop(self, outcome: Outcome, note: str) -> None:
        if self._stop_reason is not None:
            return
        self._stop_reason, self._stop_note = outcome, note
        for proc, rank in zip(self._procs, self.record.ranks):
            if proc.exitcode is None and rank.state is not RankState.FAILED:  # a failed rank exits by itself
                _kill_group(proc.pid, signal.SIGTERM)
        self._kill_at = time.monotonic() + STOP_GRACE

    def _check_stop(self) -> None:
        if self._stop_requested and self._stop_reason is None:
            self._begin_stop(*self._stop_requested)
        elif self.timeout and self._stop_reason is None and self.record.duration > self.timeout:
            self._dump_stacks()
            self._begin_stop(Outcome.TIMED_OUT, f"stopped after the {self.timeout:g} s timeout (--timeout)")
        if self._kill_at is not None and time.monotonic() > self._kill_at:
            for proc in self._procs:
                if proc.exitcode is None:
                    _kill_group(proc.pid, signal.SIGKILL)
            self._kill_at = None

    def _dump_stacks(self) -> None:
        live = [proc for proc in self._procs if proc.exitcode is None]
        for proc in live:
            _kill_group(proc.pid, signal.SIGUSR1, group=False)
        time.sleep(STACK_WAIT)
        for rank, proc in enumerate(self._procs):
            if proc in live:
                path = Path(self.spec.run_dir) / f"rank{rank}.stack"
                self.record.ranks[rank].stack = path.read_text(errors="replace") if path.exists() else ""

    def _finish(self) -> None:
        for proc in self._procs:  # belt and braces: nothing of this run may outlive it
            if proc.exitcode is None:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.join(5)
        for log in self._logs:
            log.close()
        for conn in [*self._read_ends, *self._conns]:
            conn.close()
        self._port_holder.close()
        record = self.record
        record.ended = time.time()
        if self._stop_reason is not None:
            record.outcome, record.note = self._stop_reason, self._stop_note
        elif all(r.state is RankState.FINISHED for r in record.ranks):
            record.outcome = Outcome.SUCCEEDED
        else:
            record.outcome, record.note = Outcome.FAILED, "not every rank finished"
        _live_runs.discard(self)
        self._done.set()


def _kill_group(pid: int | None, sig: int, group: bool = True) -> None:
    """Signal a rank's process group (it calls setsid first thing); fall back to the process itself."""
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


def _hint(record: RunRecord) -> str:
    if record.outcome is Outcome.TIMED_OUT:
        return "The stacks above show where each rank waited; a rank that never reaches a collective hangs the others."
    if record.outcome is Outcome.INTERRUPTED:
        return "Every rank was stopped; run the cell again when ready."
    first = record.first_failure
    if first and first.summary.startswith("killed by"):
        return "A rank died from a signal (a crash in C/C++ code, or the out-of-memory killer); its log shows its last output."
    return "Fix the error above and run the cell again; the kernel and its variables are unchanged."


def stop_all_runs() -> None:
    """atexit: a kernel that shuts down takes its runs with it."""
    for run in list(_live_runs):
        run.stop(Outcome.STOPPED, "the kernel shut down")

