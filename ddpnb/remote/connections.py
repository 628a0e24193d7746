"""The kernel's end of a run's TCP channel to its hosts, one connection each: admission through the door, each
host's set-up, the controls sent to it (queued until it has its setup), its reports read, and its hang-up.

One selector multiplexes the hosts' connections, new arrivals and whatever the engine adds (`watch`: srun's
pipes); the engine's reader thread calls `read_ready`. A host whose connection ends before it said its ranks ended
was lost with its node: the engine says how, and its ranks fail (`Hosts.lose`). Closing shuts every
connection, which ends every host and what it forked.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpnb.core import messages as msg
from ddpnb.core import rundir
from ddpnb.node.rank import Seat
from ddpnb.node.shared import MemoryShipment
from ddpnb.remote.door import Door
from ddpnb.remote.hosts import Hosts
from ddpnb.remote.wire import Control, Hello, Holdings, Report, Setup, invitation, keepalive, layout, send_data

if TYPE_CHECKING:
    from ddpnb.core.engine import RunEvents

CHANNEL_LOG = "channel.log"  # in the run directory: connections refused for want of the secret
log = logging.getLogger(__name__)

Files = dict[int, tuple[int, ...]]  # notebook data: segment id -> the kernel's memory files of it
# a host's seats, from its place and rank 0's TCPStore (node 0's host says where it bound it)
Seats = Callable[["HostLink", tuple[str, int]], list[Seat]]


class HostLink:
    """One node's host as the kernel holds it: its connection, its ranks, what it was sent."""

    def __init__(self, index: int, ranks: list[int], data: Files) -> None:
        self.index = index
        self.ranks = ranks
        self.hello: Hello | None = None
        self.conn: Connection | None = None
        self.frames = msg.Frames()
        self.lock = threading.Lock()  # `ready`, `queued`, `closed_at`
        self.send_lock = threading.Lock()  # one frame (and the data after it) at a time on the connection
        self.ready = False  # its setup was sent: controls go out at once
        self.queued: list[tuple[Control, Any, Files, Any]] = []  # controls sent before that
        self.done = False  # the host said every rank here ended
        self.closed_at: float | None = None  # its connection ended
        self.holdings = Holdings(data)  # the data its host holds (the host's own account, kept alike): `send`

    @property
    def name(self) -> str:
        return self.hello.node if self.hello is not None else f"node {self.index} of the step"


class HostConnections:
    """One attempt's hosts over TCP, seen from the kernel: `listen`, then the engine starts the hosts with the
    invitation (the door's address and the run's secret), and reads with `read_ready` until its ranks ended."""

    def __init__(self, world_size: int, run_dir: str, seats: Seats, where: str) -> None:
        self.hosts: Hosts[int] = Hosts(world_size)
        self.links: list[HostLink] = []
        self.selector = selectors.DefaultSelector()
        self.stopping = False
        self._run_dir = run_dir
        self._seats = seats
        self._where = where  # how a rank's node is named, before its name ("Slurm node")
        self._closing = False
        self._door: Door | None = None
        self._arrivals: queue.SimpleQueue[tuple[Connection, Hello]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # a wake-up is never written to the pipe's number once it is closed
        self._by_fd: dict[int, HostLink] = {}
        self._master: tuple[str, int] | None = None  # rank 0's TCPStore, once node 0's host said where
        self._setup: tuple[bytes, Files, bool] = (b"", {}, False)  # the spec's payload, the data, commands

    # --- admission ----------------------------------------------------------------------------------------------------
    def start(self, events: RunEvents, payload: bytes, data: Files, commands: bool) -> None:
        """The attempt's events, and what every host is set up with: the spec's payload, the launch's notebook
        data, whether its ranks take a session's commands."""
        self.hosts.events = events
        self._setup = (payload, data, commands)

    def listen(self, host: str, spread: list[int]) -> bytes:
        """Hosts for `spread` (ranks per node, numbered node by node) let in at the door on `host` (port 0);
        returns the invitation that tells them where, and the secret."""
        first = 0
        for index, count in enumerate(spread):
            self.links.append(HostLink(index, list(range(first, first + count)), self._setup[1]))
            self.hosts.place(index, self.links[-1].ranks)
            first += count
        secret = secrets.token_bytes(32)
        self._door = Door(host, secret, admit=self._admit, refuse=self._refused)
        self.selector.register(self._wake_r, selectors.EVENT_READ, self._welcome)
        return invitation(*self._door.address, secret)

    def _admit(self, conn: Connection, hello: Hello) -> None:
        """A host proved the secret (the door's HMAC challenge) and said which node it is: the reader takes it."""
        if self._closing:
            conn.close()
            return
        self._arrivals.put((conn, hello))
        self.wake()

    def _refused(self, peer: Any, exc: BaseException) -> None:
        line = (
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} refused a connection from {_peer(peer)}: "
            f"{type(exc).__name__}: {exc or 'it closed before proving the secret'}\n"
        )
        log.warning("ddpnb channel: %s", line.strip())
        try:
            with open(Path(self._run_dir) / CHANNEL_LOG, "a", opener=rundir.private) as file:
                file.write(line)
        except OSError:  # the run directory went away: the warning above still says it
            return

    def wake(self) -> None:
        """The reader reads at once, not after its pause."""
        with self._wake_lock:
            try:
                if self._wake_w >= 0:
                    os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):  # wake-ups pending already
                pass

    def _welcome(self, fd: int) -> None:
        os.read(fd, 4096)
        while True:
            try:
                conn, hello = self._arrivals.get_nowait()
            except queue.Empty:
                return
            self._arrived(conn, hello)

    def _arrived(self, conn: Connection, hello: Hello) -> None:
        if (
            not 0 <= hello.node_index < len(self.links)
            or self.links[hello.node_index].hello is not None
            or self.stopping
        ):
            conn.close()  # a stopped run forks nothing more; a second host for a node cannot exist: a bug
            return
        link = self.links[hello.node_index]
        link.hello, link.conn = hello, conn
        keepalive(conn)
        self._by_fd[conn.fileno()] = link
        self.selector.register(conn.fileno(), selectors.EVENT_READ, self._read_host)
        if hello.node_index == 0:
            self._master = (hello.host, hello.store_port)
            for other in self.links:
                if other.hello is not None:
                    self._set_up(other)
        elif self._master is not None:
            self._set_up(link)

    def _set_up(self, link: HostLink) -> None:
        """The node's seats, the spec and the notebook data, then what was sent meanwhile, in order; sent by a
        thread of its own, so that a gigabyte of data on its way to one node holds nothing else up."""
        assert self._master is not None
        payload, data, commands = self._setup
        setup = Setup(payload, self._seats(link, self._master), layout(data), commands)

        def send() -> None:
            queued: list[tuple[Control, Any, Files, Any]] = [(Control.SETUP, setup, data, None)]
            while queued:
                for kind, value, files, _ in queued:
                    _send(link, kind, value, files)
                with link.lock:  # what came meanwhile, in order; then `_control` sends directly
                    queued, link.queued = link.queued, []
                    link.ready = not queued

        threading.Thread(target=send, name=f"ddpnb-setup-{link.index}", daemon=True).start()

    def _control(
        self, link: HostLink, kind: Control, value: Any = None, files: Files | None = None, keep: Any = None
    ) -> None:
        """To the node's host once it has its setup; until then queued behind it (`keep`: what must live till it
        is sent, a session command's shipment)."""
        with link.lock:
            if link.closed_at is not None:  # its host is gone: its ranks' end says so
                return
            if not link.ready:  # its host has not come yet, or its setup is on the way
                link.queued.append((kind, value, files or {}, keep))
                return
        _send(link, kind, value, files or {})

    def arrived(self) -> bool:
        """Whether any host came."""
        return any(link.hello is not None for link in self.links)

    # --- the reader ---------------------------------------------------------------------------------------------------
    def watch(self, fd: int, read: Callable[[int], None]) -> None:
        """`read(fd)` by the reader whenever the engine's own `fd` is readable."""
        self.selector.register(fd, selectors.EVENT_READ, read)

    def read_ready(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            if key.fd in self.selector.get_map():  # not closed by an earlier event of this batch
                key.data(key.fd)

    def _read_host(self, fd: int) -> None:
        link = self._by_fd[fd]
        try:
            data = os.read(fd, 1 << 20)
        except OSError:  # reset, or the keepalive found no one there
            data = b""
        if not data:
            self._hang_up(link)
            return
        for frame in link.frames.feed(data):
            kind, value = pickle.loads(frame)
            if kind is Report.EVENTS:
                self.hosts.replay(link.index, link.name, value, where=f"{self._where} {link.name}")
            elif kind is Report.STACKS:
                self.hosts.answered(*value)
            elif kind is Report.DONE:
                link.done = True
                self._hang_up(link)  # the host ends its part once its connection closes
                return

    def _hang_up(self, link: HostLink) -> None:
        """Stop reading the host's connection and close it (from the reader thread): the host ends its ranks and
        exits; the engine ends whatever of its ranks it did not report (`Hosts.lose`)."""
        assert link.conn is not None
        if link.closed_at is None:
            fd = link.conn.fileno()
            if fd in self._by_fd:
                self.selector.unregister(fd)
                del self._by_fd[fd]
        _disconnect(link)

    # --- stopping, stacks and commands -------------------------------------------------------------------------------
    def stop(self, ranks: list[int]) -> None:
        """SIGTERM from each host to its ranks. A host that has not got its setup forked nothing: it is hung up
        (it exits, and its ranks end as stopped); one busy receiving a session's data is left to `escalate`."""
        self.stopping = True
        for link in self.links:
            if not link.ready:
                if link.conn is not None and link.closed_at is None:
                    self._hang_up(link)
                continue
            _send(link, Control.STOP, [rank for rank in ranks if rank in link.ranks], wait=False)

    def escalate(self) -> bool:
        """SIGKILL from each host to its ranks; a host that cannot be told at once is hung up, which ends its ranks
        (their lifeline). Whether every host came: one that did not is the engine's to end (its task)."""
        for link in self.links:
            if (
                link.conn is not None
                and link.closed_at is None
                and not (link.ready and _send(link, Control.ESCALATE, wait=False))
            ):
                self._hang_up(link)
        return all(link.hello is not None for link in self.links)

    def collect_stacks(self, ranks: list[int], wait: float) -> dict[int, str]:
        """Each rank's stack, written by its faulthandler when its host asked (SIGUSR1), and sent back."""
        number = self.hosts.ask_stacks()
        asked = 0
        for link in self.links:
            mine = [rank for rank in ranks if rank in link.ranks and rank not in self.hosts.ended]
            if mine and link.ready and _send(link, Control.STACKS, (mine, number), wait=False):
                asked += 1  # (a node busy receiving a session's data gives none this time)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self.hosts.stack_answers < asked:
            self.read_ready(0.05)
        return self.hosts.stacks(ranks)

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        """A session's command to each of `ranks`, through its node's host, with the notebook data its pickle
        refers to that the host does not hold yet (once per node); kept till the hosts are listened for."""
        self.hosts.in_order(lambda _: self._send_now(ranks, command, shipment))

    def _send_now(self, ranks: list[int], command: bytes, shipment: Any) -> None:
        files = shipment.fds() if isinstance(shipment, MemoryShipment) else {}
        senders = []
        for link in self.links:
            mine = [rank for rank in ranks if rank in link.ranks]
            if not mine:
                continue
            if not files:
                self._control(link, Control.COMMAND, (mine, command), files, shipment)
                continue
            # every node's data at once; each sender holds the shipment, whose files it reads, till it is done
            senders.append(
                threading.Thread(
                    target=self._control,
                    args=(link, Control.COMMAND, (mine, command), files, shipment),
                    name=f"ddpnb-send-{link.index}",
                    daemon=True,
                )
            )
            senders[-1].start()
        for sender in senders:
            sender.join()
        self.wake()  # the reader reads at once, not after its pause: the answer may be quick

    def interrupt(self, ranks: list[int]) -> None:
        """Each rank's host raises SIGINT in it: KeyboardInterrupt in the running command."""
        for link in self.links:
            mine = [rank for rank in ranks if rank in link.ranks]
            if mine:
                self._control(link, Control.INTERRUPT, mine)

    def close(self) -> None:
        """Every connection closed (each host then ends its ranks and itself); the door shut after them, so none
        comes in after."""
        self._closing = True
        for link in self.links:
            _disconnect(link)

    def shut_door(self) -> None:
        if self._door is not None:
            self._door.close()
            self._door = None
        while not self._arrivals.empty():
            self._arrivals.get_nowait()[0].close()
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
        self.selector.close()


def _send(link: HostLink, kind: Control, value: Any = None, files: Files | None = None, wait: bool = True) -> bool:
    """One frame to a node's host, and the notebook data it announces; False where it was not sent (the host is
    gone, or, not `wait`ing, the connection is busy with another send). A session command's data is what the host
    lacks, by the account host and kernel keep alike, kept here, in the order the wire takes. A send that fails
    once bytes went out (or is interrupted) ends the connection: the host must never read what follows as data."""
    if not link.send_lock.acquire(blocking=wait):
        return False
    try:
        if link.conn is None or link.closed_at is not None:
            return False
        files = files or {}
        if kind is Control.COMMAND:
            ranks, command = value
            lacking = {segment: files[segment] for segment in link.holdings.lacks(files)}
            if files:
                link.holdings.used(files)
            value, files = (ranks, command, layout(lacking), list(files)), lacking
        frame = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            link.conn.send_bytes(frame)
            send_data(link.conn.fileno(), files)
        except BaseException as exc:
            _shut(link.conn)  # the reader sees the host hang up; the host sees the kernel go
            if isinstance(exc, OSError):
                return False
            raise
        return True
    finally:
        link.send_lock.release()


def _shut(conn: Connection) -> None:
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as raw:
            raw.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected any more
        pass


def _disconnect(link: HostLink) -> None:
    """Close the host's connection, once: shut down first, so that a send in progress (a gigabyte of data) fails
    at once, then closed under the send lock, so no sender can write to its number after it was given to another
    file."""
    with link.lock:
        if link.conn is None or link.closed_at is not None:
            return
        link.closed_at = time.monotonic()
    _shut(link.conn)
    with link.send_lock:
        link.conn.close()


def _peer(peer: Any) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) == 2 else str(peer)
