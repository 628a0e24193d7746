"""What the kernel and a node's host say to each other over the run's TCP channel (both sides import this).

A host learns the kernel's address and the run's secret from one line on its stdin (the invitation: srun gives it
to every task of a Slurm step), so the secret is never in a host's argv or environment, and nodes need no shared
filesystem to learn it. A host
then connects with `multiprocessing.connection.Client(authkey=secret)`: both sides prove the secret by HMAC
challenge before a byte of the run travels, and a connection that cannot is dropped. Frames are multiprocessing's:
the host's first is its `Hello`, then `(Report, value)` pairs; the kernel's are `(Control, value)` pairs. Notebook
data follows the frame that announces it (`SETUP`, `COMMAND`) as raw bytes, each memory file's in turn (`Layout`),
sent with `sendfile` and received straight into the host's own memory files: one copy per node.
"""

from __future__ import annotations

import enum
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ddpnb.node.rank import Seat

Layout = dict[int, tuple[int, ...]]  # notebook data: segment id -> the sizes of its memory files, sent in this order
RECENT_COMMANDS = 4  # session commands whose data a host keeps (its ranks map it as each takes its command)
CHUNK = 64 << 20  # bytes sent per call while notebook data crosses
BUFFER = 16 << 20  # bytes received at a time


class Control(enum.Enum):
    SETUP = "setup"  # value: `Setup`; the first thing a host receives, then the data its `layout` names
    STOP = "stop"  # value: ranks; SIGTERM to those on this node
    ESCALATE = "escalate"  # SIGKILL to every rank on this node
    STACKS = "stacks"  # value: (ranks, request number); the host answers `Report.STACKS`
    COMMAND = "command"  # value: (ranks, command bytes, layout, segment ids), then the data: a session command
    INTERRUPT = "interrupt"  # value: ranks; KeyboardInterrupt in the session command that is running


class Report(enum.Enum):
    EVENTS = "events"  # value: a batch of `node.relay` events, in the order this node's reader saw them
    STACKS = "stacks"  # value: (request number, {rank: stack text})
    DONE = "done"  # every rank on this node ended and was reported


@dataclass(frozen=True)
class Hello:
    """A host's first frame: which node of the step it is, and where. Node 0's also says where rank 0's TCPStore
    will listen (a socket it bound, port 0, handed to rank 0 when it is forked)."""

    node_index: int  # this host's place among the run's hosts (Slurm: SLURM_NODEID)
    node: str  # the node's name (Slurm: SLURMD_NODENAME)
    host: str  # the address this node reaches the kernel from (and its peers reach it at)
    pid: int
    step: str  # the scheduler's name for the host's task, to cancel it (Slurm: JOBID.STEPID, for scancel)
    store_port: int = 0  # node 0: its bound store socket's port


@dataclass(frozen=True)
class Setup:
    spec_payload: bytes
    seats: list[Seat]  # this node's ranks
    layout: Layout
    commands: bool  # a session: each rank gets a pipe for the kernel's commands


class Holdings:
    """The notebook data a node's host holds, by segment id: the launch's, and what the latest RECENT_COMMANDS
    commands with data used. The host keeps its memory files by this account; the kernel keeps the same account
    for each node, and so sends a command only the segments its host lacks: a session's push of data that did
    not change costs nothing on the wire."""

    def __init__(self, launch: Iterable[int]) -> None:
        self.launch = set(launch)
        self.recent: list[set[int]] = []

    def held(self) -> set[int]:
        return self.launch.union(*self.recent)

    def lacks(self, ids: Iterable[int]) -> list[int]:
        held = self.held()
        return [segment for segment in ids if segment not in held]

    def used(self, ids: Iterable[int]) -> set[int]:
        """A command with data used `ids`: what is no longer held since."""
        before = self.held()
        self.recent = [*self.recent, set(ids)][-RECENT_COMMANDS:]
        return before - self.held()


def invitation(host: str, port: int, secret: bytes) -> bytes:
    return f"{host} {port} {secret.hex()}\n".encode()


def read_invitation(fd: int = 0) -> tuple[tuple[str, int], bytes]:
    """The kernel's address and the secret, from the invitation's line on `fd` (srun delivers it on stdin)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 256)
        if not chunk:
            raise EOFError("the step's stdin ended before the kernel's invitation (was this started by ddpnb?)")
        line += chunk
    host, port, secret = line.decode().split()
    return (host, int(port)), bytes.fromhex(secret)


def layout(files: dict[int, tuple[int, ...]]) -> Layout:
    """The layout of the kernel's memory files `files` (segment id -> fds)."""
    return {segment: tuple(os.fstat(fd).st_size for fd in fds) for segment, fds in files.items()}


def send_data(sock: int, files: dict[int, tuple[int, ...]]) -> None:
    """Every memory file's bytes, in `layout` order, on the connection's socket (the caller holds its lock)."""
    for fds in files.values():
        for fd in fds:
            size, offset = os.fstat(fd).st_size, 0
            while offset < size:
                offset += os.sendfile(sock, fd, offset, min(CHUNK, size - offset))


def receive_data(sock: int, shape: Layout, engine: str) -> dict[int, tuple[int, ...]]:
    """The bytes `send_data` sent, each file's into a memory file of this process (named for `engine`, as a
    rank's /proc/self/maps shows it): segment id -> its fds."""
    files: dict[int, tuple[int, ...]] = {}
    try:
        for segment, sizes in shape.items():
            fds = []
            for size in sizes:
                fd = os.memfd_create(f"ddpnb-{engine}-data-{segment}", os.MFD_CLOEXEC)
                fds.append(fd)
                os.ftruncate(fd, size)
                _receive_into(sock, fd, size)
            files[segment] = tuple(fds)
    except BaseException:
        close_files({**files, -1: tuple(fds)})
        raise
    return files


def _receive_into(sock: int, fd: int, size: int) -> None:
    """Through one buffer, written with `pwrite`: a fresh memory file mapped and received into faults in every
    page, which took 40% more CPU (bench/RESULTS.md, section 8)."""
    buffer = memoryview(bytearray(min(size, BUFFER)))
    with socket.socket(fileno=os.dup(sock)) as raw:
        got = 0
        while got < size:
            read = raw.recv_into(buffer[: min(BUFFER, size - got)])
            if not read:
                raise EOFError("the kernel's connection closed while notebook data was arriving")
            written = 0
            while written < read:
                written += os.pwrite(fd, buffer[written:read], got + written)
            got += read


def close_files(files: dict[int, tuple[int, ...]]) -> None:
    for fds in files.values():
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                continue


def keepalive(sock: Any) -> None:
    """TCP keepalive on the channel: a node that vanishes without a word (power, network) is noticed in about 20
    s, where Slurm's own node timeout may take minutes; and a send to one (data unacknowledged, where keepalive
    does not probe) gives up after 2 min rather than TCP's 15 minutes of retries."""
    with socket.socket(fileno=os.dup(sock.fileno())) as raw:  # a duplicate: the option is the socket's own
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (
            ("TCP_KEEPIDLE", 10),
            ("TCP_KEEPINTVL", 3),
            ("TCP_KEEPCNT", 3),
            ("TCP_USER_TIMEOUT", 120_000),
        ):
            if hasattr(socket, option):
                raw.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
