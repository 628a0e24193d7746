"""One attempt's ranks forked on this machine, read through one epoll selector: the local engine's ranks, and a
Ray node's (its host, `engines/ray/host.py`, relays their events to the kernel).

Each rank gets private pipes from the process that forks it (the kernel, or a Ray node's host): stdout, stderr (fd
level), a message channel, and a lifeline that tells it when that process is gone. One thread (inside `serve`)
multiplexes them plus the process sentinels; nothing it does waits on a view.
"""

from __future__ import annotations

import fcntl
import functools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import selectors
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ddpnb import _compat
from ddpnb.core import messages as msg
from ddpnb.core.engine import RunEvents
from ddpnb.core.spec import Stream
from ddpnb.core.stacks import user_stack_dump
from ddpnb.node import forkserver, orphans
from ddpnb.node.rank import PROCESS_PREFIX, FdForChild, Seat, entry

STOP_GRACE = 2.0  # seconds between SIGTERM and SIGKILL when ranks are stopped
STACK_WAIT = 1.0  # seconds a stalled rank gets to dump its Python stacks before it is stopped
DRAIN_WAIT = 2.0  # seconds the output pipes may stay open after every rank exited (a process that escaped)
PIPE_SIZE = 1 << 20  # bytes a rank may write before it waits for the kernel to read (Linux pipe buffer)
# seconds between two wake-ups of the reader while every rank is busy (see `serve`), and so between two redraws
# of the views: ipykernel sends a cell's printed output every 0.2 s too
COALESCE = 0.2
_running: set[int] = set()  # every running rank this process forked, whichever run it belongs to


class ForkedRanks:
    """One attempt's ranks on this machine (all of a local run's; a Ray run's on one node), forked from the
    forkserver, each at its `Seat`."""

    def __init__(self, seats: list[Seat]) -> None:
        self.seats = {seat.rank: seat for seat in seats}
        self._procs: dict[int, Any] = {}
        self._conns: dict[Any, int] = {}  # each rank's channel, read end -> rank
        self._frames: dict[Any, msg.Frames] = {}
        self._streams: dict[int, tuple[int, Stream]] = {}  # output pipe's read fd -> (rank, stream)
        self._kernel_ends: list[Any] = []  # the kernel's other pipe ends: stdout/stderr read ends, lifelines
        self._signalled: dict[int, set[int]] = {}  # rank -> the stop signals sent to it
        self._pipe_room = PIPE_SIZE  # what the smallest of the run's pipes holds
        self._events: RunEvents | None = None
        self._open_commands = False  # a session: each rank gets a pipe for the kernel's commands
        self._commands: dict[int, Any] = {}  # sessions: each rank's command pipe, the kernel's (write) end
        self._send_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()  # ends the reader's pause when a session command was sent
        os.set_blocking(self._wake_w, False)

    # --- start -------------------------------------------------------------------------------------------------
    def start(
        self,
        events: RunEvents,
        context: multiprocessing.context.BaseContext,
        spec_payload: bytes,
        data: dict[int, tuple[int, ...]],
        store_socket: socket.socket | None,
        result_fd: int | None,
        commands: bool,
    ) -> None:
        """Fork every seat's rank from `context` (the forkserver's; its caller holds `forkserver.lock`). Rank 0
        gets `store_socket`, for its TCPStore, and `result_fd`; every rank maps `data`'s memory files."""
        self._events = events
        self._open_commands = commands
        try:
            shared = {segment: tuple(map(FdForChild, files)) for segment, files in data.items()}
            for rank in self.seats:
                self._start_rank(context, rank, spec_payload, shared, *((store_socket, result_fd) if rank == 0 else ()))
        except BaseException:  # a rank could not start: the ones that did must not outlive this call
            self.close()
            raise
        finally:
            if store_socket is not None:
                store_socket.close()  # rank 0 has its own copy now

    def _start_rank(
        self,
        context: Any,
        rank: int,
        spec_payload: bytes,
        data: dict[int, tuple[FdForChild, ...]],
        store_socket: socket.socket | None = None,
        result_fd: int | None = None,
    ) -> None:
        """Fork one rank, with its pipes: stdout, stderr and the message channel (rank to kernel), and a lifeline
        the kernel never writes to, whose EOF tells the rank's watchdog that the kernel is gone."""
        assert self._events is not None
        channel, channel_w = multiprocessing.Pipe(duplex=False)
        lifeline_r, lifeline = multiprocessing.Pipe(duplex=False)
        out_r, out_w = multiprocessing.Pipe(duplex=False)
        err_r, err_w = multiprocessing.Pipe(duplex=False)
        self._conns[channel] = rank
        self._frames[channel] = msg.Frames()
        self._kernel_ends += [out_r, err_r, lifeline]
        self._streams[out_r.fileno()] = (rank, Stream.STDOUT)
        self._streams[err_r.fileno()] = (rank, Stream.STDERR)
        self._pipe_room = min(self._pipe_room, *(_enlarge_pipe(end.fileno()) for end in (channel_w, out_w, err_w)))
        result = None if result_fd is None else FdForChild(result_fd)
        commands_r = None
        if self._open_commands:
            commands_r, commands_w = multiprocessing.Pipe(duplex=False)
            _enlarge_pipe(commands_w.fileno())  # a command (or a debugger's answer) never waits for a busy rank
            self._commands[rank] = commands_w
        proc = context.Process(
            target=entry,
            args=(
                self.seats[rank],
                channel_w,
                lifeline_r,
                out_w,
                err_w,
                spec_payload,
                data,
                store_socket,
                result,
                commands_r,
            ),
            name=f"{PROCESS_PREFIX}rank{rank}",
            daemon=False,
        )
        try:
            proc.start()
        finally:
            for end in (channel_w, lifeline_r, out_w, err_w, commands_r):
                if end is not None:
                    end.close()
        self._procs[rank] = proc
        _running.add(proc.pid)
        self._events.placed(rank, proc.pid)

    # --- the reader --------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Read everything the ranks send until all have exited, with one epoll selector for the run's life.

        While every rank is busy in its function, wake-ups are spaced COALESCE apart (the views redraw no more
        often): a training loop that prints and logs every step then costs the kernel a few wake-ups a second,
        not one per line, and a rank's write never waits for the kernel to wake. The pipes hold what arrives
        meanwhile, and each wake-up reads them empty; when one read more than a quarter of what a pipe holds,
        output is flowing fast and the next pass reads without pausing. A rank that exits ends a pause at once.
        """
        events = self._events
        assert events is not None
        self._selector = selectors.DefaultSelector()
        for fd in self._streams:
            self._selector.register(fd, selectors.EVENT_READ, self._read_stream)
        for conn in self._conns:
            self._selector.register(conn, selectors.EVENT_READ, self._read_channel)
        for rank, proc in self._procs.items():
            self._selector.register(proc.sentinel, selectors.EVENT_READ, functools.partial(self._on_exit, rank))
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._woken)
        self._exits = len(self._procs)
        self._wake_bytes = 0  # read since the last wake-up
        self._buffer = memoryview(bytearray(PIPE_SIZE))  # every read lands here first
        all_exited: float | None = None
        last_wake, hurry = 0.0, False
        try:
            while len(self._selector.get_map()) > 1:  # more than the wake-up pipe
                woken = time.monotonic()
                if woken - last_wake < COALESCE and not hurry and self._exits == len(self._procs) and events.quiet():
                    # let more arrive, so a burst is one read; a rank that exits ends the pause at once
                    multiprocessing.connection.wait(
                        [*(proc.sentinel for proc in self._procs.values()), self._wake_r],
                        timeout=COALESCE - (woken - last_wake),
                    )
                last_wake, self._wake_bytes = time.monotonic(), 0
                timeout = 0.1
                while ready := self._selector.select(timeout):  # until nothing is left to read
                    for key, _ in ready:
                        if key.fd in self._selector.get_map():  # not closed by an earlier event of this batch
                            key.data(key.fileobj)  # one read of a pipe (a rank's exit drains and closes its channel)
                    timeout = 0
                    if time.monotonic() - last_wake > COALESCE:  # flooded: still check timeouts and stops
                        break
                hurry = self._wake_bytes >= self._pipe_room // 4
                events.tick()
                if not self._exits:
                    all_exited = all_exited or time.monotonic()
                    if time.monotonic() - all_exited > DRAIN_WAIT:  # a process that left the rank's group
                        break  # still holds its output pipe open: stop reading rather than hang the cell
        finally:
            self._selector.close()
            self._buffer = memoryview(b"")

    def _woken(self, fd: int) -> None:
        os.read(fd, 4096)

    def _read_stream(self, fd: int) -> None:
        assert self._events is not None
        rank, stream = self._streams[fd]
        size = os.readv(fd, [self._buffer])
        self._wake_bytes += size
        if not size:
            self._selector.unregister(fd)
            del self._streams[fd]
        self._events.output(rank, stream, bytes(self._buffer[:size]))

    def _read_channel(self, conn: Any) -> None:
        assert self._events is not None
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
            self._events.message(rank, message)

    def _close_channel(self, conn: Any) -> None:
        self._selector.unregister(conn)
        del self._conns[conn], self._frames[conn]
        conn.close()

    def _on_exit(self, rank: int, sentinel: int) -> None:
        assert self._events is not None
        self._selector.unregister(sentinel)
        self._exits -= 1
        proc = self._procs[rank]
        _signal_group(proc.pid, signal.SIGKILL)  # whatever the rank started dies with it
        _end_orphans(proc.pid)  # and what it started that left its group
        self._drain_channel(rank)
        code = self._exitcode(rank)
        stopped = code is not None and code < 0 and -code in self._signalled.get(rank, ())
        self._events.exited(rank, code, stopped=stopped)

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

    # --- stopping ------------------------------------------------------------------------------------------------
    def stop(self, ranks: list[int]) -> float | None:
        for rank in self._here(ranks):
            if self._exitcode(rank) is None:
                self._signal(rank, signal.SIGTERM)
        return STOP_GRACE

    def escalate(self) -> float | None:
        for rank in self._procs:
            if self._exitcode(rank) is None:
                self._signal(rank, signal.SIGKILL)
        return None

    def _signal(self, rank: int, sig: signal.Signals) -> None:
        self._signalled.setdefault(rank, set()).add(sig)
        _kill_group(self._procs[rank].pid, sig)

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """SIGUSR1 makes each rank's faulthandler write every thread's stack to its `rankN.stack` file."""
        live = [rank for rank in self._here(ranks) if self._exitcode(rank) is None]
        stacks = {}
        for rank in live:
            _kill_group(self._procs[rank].pid, signal.SIGUSR1, group=False)
        time.sleep(STACK_WAIT)
        for rank in live:
            path = Path(self.seats[rank].stack_dir) / f"rank{rank}.stack"
            # the rank writes at its own offset: an earlier dump, truncated away, leaves zeros before this one
            stacks[rank] = user_stack_dump(path.read_text(errors="replace").lstrip("\0")) if path.exists() else ""
            if path.exists():
                os.truncate(path, 0)
        return stacks

    def send(self, ranks: list[int], command: bytes, fds: dict[int, tuple[int, ...]]) -> None:
        """A session command for `ranks`, with the memory files its pickle refers to: a running rank maps them
        through /proc/<this pid>/fd (`PipeLink.receive`)."""
        payload = pickle.dumps((os.getpid(), fds, command))
        with self._send_lock:
            for rank in self._here(ranks):
                try:
                    self._commands[rank].send_bytes(payload)
                except OSError:  # the rank is gone: its exit tells the run
                    continue
        try:
            if self._wake_w >= 0:  # not after the run's end
                os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the reader has wake-ups pending already
            pass

    def interrupt(self, ranks: list[int]) -> None:
        for rank in self._here(ranks):
            if self._exitcode(rank) is None:
                _kill_group(self._procs[rank].pid, signal.SIGINT, group=False)  # the rank, not what it started

    def close(self) -> None:
        for rank, proc in self._procs.items():  # belt and braces: nothing of this run may outlive it
            if self._exitcode(rank) is None:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.join(5)
            if proc.pid in _running:
                _end_orphans(proc.pid)
        for end in [*self._kernel_ends, *self._conns, *self._commands.values()]:
            end.close()
        self._kernel_ends, self._conns, self._commands = [], {}, {}
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:  # once: a second close() could close a descriptor the number was given to since
                os.close(fd)
        self._wake_r = self._wake_w = -1
        for rank, proc in self._procs.items():
            if self._exitcode(rank) is not None:
                proc.close()  # its sentinel fds; the record keeps the exit code
        self._events = None  # the run and its value go with the caller's last reference, not at the next gc

    def _exitcode(self, rank: int) -> int | None:
        """The rank's exit code, read under a lock: multiprocessing reads it from the forkserver's pipe once, and a
        second thread reading at the same moment (a Ray host's stop beside its reader) would get 255 instead."""
        with self._poll_lock:
            return self._procs[rank].exitcode

    def _here(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` forked here (a Ray node's host is asked about every rank of the run)."""
        return [rank for rank in ranks if rank in self._procs]


def bind_store_socket(address: str = "127.0.0.1") -> socket.socket:
    """A socket bound to `address` (127.0.0.1: reachable from this machine only), port 0, for rank 0's TCPStore
    to listen on. Rank 0 receives the socket itself, so no other process can take its port; the forking process
    closes its copy once rank 0 has it, and never listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, 0))
    return sock


def _enlarge_pipe(fd: int) -> int:
    """Let a rank write a burst of output without waiting for the kernel (best effort: Linux only); returns
    how many bytes the pipe holds."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return 1 << 16  # the usual size elsewhere
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:  # above /proc/sys/fs/pipe-max-size, or the user's pipe budget is spent: keep the default
        return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)


def _end_orphans(rank_pid: int) -> None:
    """An ended rank's orphans, adopted by the forkserver (`node/orphans.py`); under the forkserver's lock, so that
    a rank of another run, forked meanwhile, is known as a rank before it is looked at."""
    with forkserver.lock:
        _running.discard(rank_pid)
        orphans.end_orphans(_compat.forkserver_pid(), _running | forkserver.spared())


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
