"""A forked rank: a process forked from the CUDA-free forkserver, its fds, environment, store and exit.

Nothing here runs in the kernel except `FdForChild`, `Seat` and the names below; `entry` is the multiprocessing
target. A local run's ranks sit on this machine alone; a Ray run's ranks are forked on each node by its host
(`engines/ray/host.py`), each told its seat in the whole run.
"""

from __future__ import annotations

import faulthandler
import gc
import io
import os
import pickle
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from ddpnb.core import messages as msg
from ddpnb.core import rundir
from ddpnb.core.spec import WorkerSpec
from ddpnb.node import mapped, orphans
from ddpnb.rank import context as ctx
from ddpnb.rank import group
from ddpnb.rank.main import exit_code, run_function

PROCESS_PREFIX = "ddpnb-"  # names ddpnb's processes: `ddpnb-rank0`, `ddpnb-preload-check`
# init_process_group returns once this rank's group is up, not every rank's: a rank whose function is quick can
# take its group down (or exit) while a peer is still connecting gloo's full mesh, which then fails ("Gloo
# connectFullMesh failed ... Connection closed by peer"). torch's own store barrier closes that gap.
INIT_BARRIER = {"TORCH_DIST_INIT_BARRIER": "1"}


@dataclass(frozen=True)
class Seat:
    """Where one rank sits in its run: its rank, its place on its node, the rendezvous, its device, the file its
    stacks go to. A one-machine run's seats (`Seat.local`) rendezvous over loopback."""

    rank: int
    local_rank: int
    local_world_size: int
    stack_dir: str  # where `rankN.stack` is written (SIGUSR1): a directory on the rank's own node
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # rank 0's TCPStore: the port of the socket rank 0 is handed
    gpu: int | None = None  # with --gpus: the device index the rank uses
    environ: dict[str, str] = field(default_factory=dict)  # the node's environment, under the spec's (Ray: its own)

    @property
    def loopback(self) -> bool:
        return self.master_addr == "127.0.0.1"

    @classmethod
    def local(cls, world_size: int, use_gpus: bool, stack_dir: str, master_port: int) -> list[Seat]:
        return [
            cls(rank, rank, world_size, stack_dir, master_port=master_port, gpu=rank if use_gpus else None)
            for rank in range(world_size)
        ]


class FdForChild:
    """A file descriptor passed to a rank as a `Process` argument: duplicated into the child over the
    forkserver's socket, as multiprocessing does for pipes and sockets; the child receives the int."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicated: Any) -> int:
    return duplicated.detach()


class PipeLink:
    """The rank's channel to the kernel: the write end of a pipe, each message one frame (`messages.header`,
    then its bytes), written with as few `os.write` calls as possible, because this runs inside the user's
    training step."""

    def __init__(self, rank: int, channel: Connection, commands: Connection | None = None) -> None:
        self.rank = rank
        self.channel = channel  # keeps the fd open
        self.fd = channel.fileno()
        self.lock = threading.Lock()
        self.commands = commands  # sessions: the kernel's commands to this rank

    def flush(self) -> None:
        sys.stdout.flush()  # the pipes keep the order: what is written there is ahead of what is sent next
        sys.stderr.flush()

    def receive(self) -> bytes | None:
        """A command, with the notebook data its pickle refers to mapped first (`LocalEngine.send`)."""
        if self.commands is None:
            return None
        try:
            kernel, segments, command = pickle.loads(self.commands.recv_bytes())
        except (EOFError, OSError):  # the kernel closed its end: the session is over
            return None
        mapped.attach_from(kernel, segments)  # the command's big tensors and arrays are in the kernel's memory
        return command

    def send(self, message: msg.Message) -> None:
        self._write(msg.encode(message))

    def send_metric(self, step: int | None, values: dict[str, float]) -> None:
        self._write(msg.encode_metric(self.rank, step, time.time(), values))  # no dataclass built first

    def _write(self, data: bytes) -> None:
        header = msg.header(len(data))
        with self.lock:
            if len(data) <= 4000:  # one write up to PIPE_BUF (4 KiB) is never split nor interleaved
                os.write(self.fd, header + data)
                return
            os.write(self.fd, header)
            view = memoryview(data)  # a big value: written in place, not copied into a frame first
            while view:
                view = view[os.write(self.fd, view) :]


_store_fd: int | None = None  # rank 0: the kernel's bound 127.0.0.1 socket its TCPStore listens on


def entry(
    seat: Seat,
    channel: Connection,
    lifeline: Connection,
    out: Connection,
    err: Connection,
    spec_payload: bytes,
    data: dict[int, tuple[int, ...]],
    store_socket: socket.socket | None = None,
    result_fd: int | None = None,
    commands: Connection | None = None,
) -> None:
    """multiprocessing target: runs once per rank. `channel` carries messages to the kernel; `lifeline` is a pipe
    the kernel never writes to, so it reads EOF only when the kernel is gone. `spec_payload` is the cloudpickled
    `WorkerSpec`, unpickled after the output is redirected, so that a failure to rebuild it is reported like any
    other. `data`: the memory files holding the notebook's big tensors and arrays (`shared`), mapped before
    anything is unpickled. Rank 0 also gets the socket for its TCPStore and the file for its result; a session's
    ranks get a pipe for the kernel's commands."""
    global _store_fd
    rank = seat.rank
    # what the forkserver imported (torch: ~200,000 objects) is never garbage: keep the garbage collector from
    # walking it at every full collection, which also copied every page it touched out of the shared memory
    gc.freeze()
    os.setsid()  # own process group: the kernel's SIGINT never reaches us, and we can be killed as a group
    orphans.become_subreaper()  # what it starts stays below it, whatever session that moves to (node/orphans.py)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, which the forkserver's shield set aside
    _redirect_output(out, err)
    context = ctx.RankContext(rank=rank, link=PipeLink(rank, channel, commands))
    threading.Thread(target=_watch_kernel, args=(lifeline,), name="ddpnb-watchdog", daemon=True).start()
    if store_socket is not None:
        _store_fd = store_socket.detach()  # the TCPStore takes it over

    code = 0
    try:
        mapped.attach(data)
        run_function(
            context,
            spec_payload,
            lambda rank, spec: _setup(seat, spec),
            lambda context, spec: _join_group(seat, context, spec),
            result_fd,
        )
        group.leave_store(context)
    except SystemExit as exc:  # sys.exit(n) inside the function: exit as asked (the kernel reports it)
        code = exit_code(exc)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: user threads or CUDA state must not hang the exit


def _setup(seat: Seat, spec: WorkerSpec) -> str:
    """The environment torchrun would give the rank, its CPU threads and its device."""
    import torch

    _install_stack_dump(seat.stack_dir, seat.rank)
    os.environ.clear()
    os.environ.update(INIT_BARRIER)  # unless the kernel's environment or --env says otherwise
    os.environ.update(seat.environ)
    os.environ.update(spec.environ)
    os.environ.update(_torchrun_env(seat, spec))
    loopback = _loopback_interface() if seat.loopback else None
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        # ranks of a local run talk over loopback: gloo would otherwise listen on the address the hostname
        # resolves to, which on many machines is reachable from the network
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    threads = spec.torch_threads or _omp_num_threads()
    if threads:
        torch.set_num_threads(threads)
    if spec.use_gpus and seat.gpu is not None:
        torch.cuda.set_device(seat.gpu)
        return f"cuda:{seat.gpu}"
    return "cpu"


def _join_group(seat: Seat, context: ctx.RankContext, spec: WorkerSpec) -> None:
    import torch.distributed as dist

    # rank 0 listens on the socket the kernel (or its node's host) bound: 127.0.0.1 for a one-machine run, its
    # node's address for a run across nodes; never every interface, never a raced port
    context.store = dist.TCPStore(
        seat.master_addr,
        seat.master_port,
        spec.world_size,
        is_master=context.rank == 0,
        master_listen_fd=_store_fd if context.rank == 0 else None,
    )
    group.new_group(spec.backend)


def _omp_num_threads() -> int | None:
    """The user's OMP_NUM_THREADS (`--env`, or set in the kernel after the forkserver started): torch read the
    variable when the forkserver imported it, so a rank must apply the value it was given itself."""
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        return None
    return threads if threads > 0 else None


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in names if name in ("lo", "lo0")), None)


def _redirect_output(out: Connection, err: Connection) -> None:
    """Point fds 1 and 2 at the kernel's pipes, so C/C++ writes and crash messages are captured too."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )


def _watch_kernel(lifeline: Connection) -> None:
    """Parent-death watchdog: the kernel holds the write end of `lifeline`; EOF means it is gone."""
    try:
        while True:
            lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    for pid in orphans.descendants(os.getpid()):  # those that left this rank's process group first
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    os.killpg(0, signal.SIGKILL)  # this rank and whatever it started (DataLoader workers, ...)


_stack_file: io.TextIOBase | None = None


def _install_stack_dump(run_dir: str, rank: int) -> None:
    """SIGUSR1 writes every thread's Python stack to a file: how the kernel learns where a stalled rank is."""
    global _stack_file
    faulthandler.enable(file=sys.stderr, all_threads=True)
    _stack_file = open(os.path.join(run_dir, f"rank{rank}.stack"), "w", opener=rundir.private)  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def _torchrun_env(seat: Seat, spec: WorkerSpec) -> dict[str, str]:
    return {
        "RANK": str(seat.rank),
        "LOCAL_RANK": str(seat.local_rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(seat.local_world_size),
        "GROUP_RANK": str(seat.node_rank),
        "MASTER_ADDR": seat.master_addr,
        "MASTER_PORT": str(seat.master_port),
        "DDPNB_WORKER": "1",
    }
