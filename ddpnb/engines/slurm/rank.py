"""A Slurm rank: one task of the run's `srun` step (`python -c "...rank import main; main()"`), on any node.

It reads the kernel's address and the run's secret from its stdin (srun gives every task the line the kernel
wrote), connects over TCP proving the secret, says who it is, receives the spec, and runs the function. Its
stdout and stderr stay srun's (`--label` tags each line with the rank, and slurmstepd reads them even as the
rank crashes, so a C++ abort's last words are never lost). The connection is also its lifeline: when it closes
(the kernel is gone, or ended the run), the rank kills its own process group, which holds whatever it started
even after that left the step's process tree (proctrack/linuxproc would not find it).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Client, Connection

from ddpnb.core import messages as msg
from ddpnb.core.spec import WorkerSpec
from ddpnb.core.stacks import thread_stack
from ddpnb.engines.slurm.wire import FLUSHED, Control, Hello, Setup, read_invitation
from ddpnb.rank import context as ctx
from ddpnb.rank import group
from ddpnb.rank.main import exit_code, run_function

INIT_BARRIER = {"TORCH_DIST_INIT_BARRIER": "1"}  # see node/rank.py: a quick rank must not leave early


class SocketLink:
    """The rank's channel to the kernel: frames on its authenticated connection, one writer at a time. A
    session's commands arrive on the same connection, read by the rank's channel thread (`_serve_kernel`)."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank = rank
        self.conn = conn
        self.lock = threading.Lock()
        self.commands: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # None: the kernel sends no more

    def send(self, message: msg.Message) -> None:
        self._write(msg.encode(message))

    def send_metric(self, step: int | None, values: dict[str, float]) -> None:
        self._write(msg.encode_metric(self.rank, step, time.time(), values))

    def flush(self) -> None:
        """What was printed so far goes ahead of the next message: the kernel holds a session's answer until
        the FLUSHED mark written after it on each stream came through srun (C-level output too: same fds)."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd in (1, 2):
            try:
                os.write(fd, FLUSHED + b"\n")
            except OSError:  # the step's output is gone: the kernel delivers the answer after FLUSH_WAIT
                continue

    def receive(self) -> bytes | None:
        """A session's next command, as the kernel sent it (big data is in its pickle on this engine)."""
        return self.commands.get()

    def _write(self, data: bytes) -> None:
        with self.lock:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the kernel is gone: the lifeline ends this rank
                return


_finished = threading.Event()


def main() -> None:
    rank = int(os.environ["SLURM_PROCID"])
    try:
        os.setsid()  # a process group of our own, which the lifeline kills with whatever the rank started
    except PermissionError:  # slurmstepd made us a group leader already
        pass
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # a pipe to slurmstepd: every line reaches the notebook as printed
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a crash's stacks, through srun like any output
    address, secret = read_invitation(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the user's code reading stdin gets EOF, not the rest of the step's input
    os.close(devnull)
    conn = Client(address, family="AF_INET", authkey=secret)
    host = _address_towards(address)
    store_socket = None
    if rank == 0:  # the run's TCPStore: bound here, port 0, on the address the kernel reached us from
        store_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        store_socket.bind((host, 0))
    conn.send_bytes(pickle.dumps(Hello(
        rank=rank, node=os.environ.get("SLURMD_NODENAME", socket.gethostname()), host=host, pid=os.getpid(),
        step=f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}",
        store_port=store_socket.getsockname()[1] if store_socket else 0)))
    kind, setup = pickle.loads(conn.recv_bytes())
    assert kind is Control.SETUP
    link = SocketLink(rank, conn)
    context = ctx.RankContext(rank=rank, link=link, suggests_preload=False)
    threading.Thread(target=_serve_kernel, args=(conn, link, threading.get_ident()), name="ddpnb-lifeline",
                     daemon=True).start()
    store_fd = store_socket.detach() if store_socket else None
    code = 0
    try:
        run_function(context, setup.spec_payload, lambda r, spec: _setup(r, spec, setup),
                     lambda c, spec: _join_group(c, spec, setup, store_fd))
        group.leave_store(context)
    except SystemExit as exc:
        code = exit_code(exc)
    finally:
        _finished.set()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: user threads or CUDA state must not hang the exit


def _serve_kernel(conn: Connection, link: SocketLink, training_thread: int) -> None:
    """What the kernel asks (stacks, a session's commands and interrupts); when the connection closes, the run
    is over for this rank: end its group."""
    try:
        while True:
            kind, value = pickle.loads(conn.recv_bytes())
            if kind is Control.STACKS:
                link.send(msg.Stacks(rank=link.rank, text=thread_stack(training_thread)))
            elif kind is Control.COMMAND:
                link.commands.put(value)
            elif kind is Control.INTERRUPT:  # as the local engine's SIGINT: KeyboardInterrupt in the command
                signal.pthread_kill(training_thread, signal.SIGINT)
    except (EOFError, OSError):
        pass
    link.commands.put(None)
    if not _finished.is_set():
        os.killpg(0, signal.SIGKILL)


def _address_towards(address: tuple[str, int]) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # sends nothing: asks the routing table which local address reaches the kernel
        return probe.getsockname()[0]


def _setup(rank: int, spec: WorkerSpec, setup: Setup) -> str:
    """torchrun's environment from Slurm's (SLURM_PROCID, SLURM_LOCALID, ...), the rank's threads and device."""
    import torch

    os.environ.update(INIT_BARRIER)
    os.environ.update(spec.environ)
    local_rank = int(os.environ.get("SLURM_LOCALID", "0"))
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(_tasks_on_this_node()), "GROUP_RANK": os.environ.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": setup.master_addr, "MASTER_PORT": str(setup.master_port), "DDPNB_WORKER": "1",
    })
    if setup.master_addr.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # every node is this host: keep gloo on loopback
    threads = spec.torch_threads or _first_int(os.environ.get("OMP_NUM_THREADS")) \
        or _first_int(os.environ.get("SLURM_CPUS_PER_TASK")) or 1
    torch.set_num_threads(threads)
    if spec.use_gpus:  # the step's GPUs on this node, in LOCAL_RANK order (--gpu-bind=none: torchrun's view)
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return "cpu"


def _join_group(context: ctx.RankContext, spec: WorkerSpec, setup: Setup, store_fd: int | None) -> None:
    import torch.distributed as dist

    context.store = dist.TCPStore(setup.master_addr, setup.master_port, spec.world_size,
                                  is_master=context.rank == 0, master_listen_fd=store_fd,
                                  timeout=datetime.timedelta(seconds=spec.timeout + 60 if spec.timeout else 1800))
    group.new_group(spec.backend)


def _tasks_on_this_node() -> int:
    """From SLURM_TASKS_PER_NODE ('2(x2)', '3,1') and SLURM_NODEID."""
    counts: list[int] = []
    for part in os.environ.get("SLURM_TASKS_PER_NODE", "1").split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
    node = int(os.environ.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else 1


def _first_int(value: str | None) -> int | None:
    try:
        number = int((value or "").split(",")[0])
    except ValueError:
        return None
    return number if number > 0 else None



if __name__ == "__main__":
    main()
