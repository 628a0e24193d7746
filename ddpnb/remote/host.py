"""A node's host over TCP: the one process on its node (a Slurm step's task there) that forks the node's ranks.

It learns the kernel's address and the run's secret from the invitation (the engine's entry delivers it: srun on
stdin), connects over TCP proving the secret, says which node it is, and receives its node's seats, the spec and
the notebook data (once per node, into memory files). Meanwhile its forkserver imports torch, once per node. It
then forks the node's ranks (`node.forked`, as the local engine and a Ray node's host do), each with its own
pipes, and sends their events to the kernel in the order its reader saw them (`node.relay`). The connection is
the ranks' lifeline: when it closes (the kernel is gone, or ended the run), the host kills every rank's process
group, which holds whatever the rank started even after that left the host's process tree.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Client, Connection
from typing import Any

from ddpnb.node import forkserver
from ddpnb.node.forked import ForkedRanks, bind_store_socket
from ddpnb.node.relay import Relay
from ddpnb.remote.wire import Control, Hello, Holdings, Report, Setup, close_files, keepalive, receive_data

HOLD = 0.5  # seconds the sender waits for events before it looks again
READER_WAIT = 10.0  # seconds the host waits for its reader to see every rank end before it closes their pipes


@dataclass(frozen=True)
class Place:
    """Where a host runs, as its scheduler says: its node's place among the run's hosts, the node's name, the
    scheduler's name for the host's task (to cancel it), the CPUs it was given (0: those it may run on)."""

    node_index: int
    node: str
    step: str = ""
    cpus: int = 0
    engine: str = "remote"  # names the host's files and threads (`ddpnb-ENGINE-...`)


class NodeHost:
    """This node's part of one attempt: its ranks, the relay of their events, the connection to the kernel."""

    def __init__(self, conn: Connection, setup: Setup, files: dict[int, tuple[int, ...]], place: Place) -> None:
        self.conn = conn
        self.place = place
        self.lock = threading.Lock()  # one frame at a time on the connection
        self.relay = Relay()
        self.scratch = tempfile.mkdtemp(prefix=f"ddpnb-{place.engine}-")  # the ranks' stack files, on this node
        threads = _threads_per_rank(len(setup.seats), place.cpus)
        environ = dict(os.environ)  # the host's environment on this node (its scheduler's, CUDA_VISIBLE_DEVICES)
        seats = [
            replace(seat, stack_dir=self.scratch, environ={**environ, **threads, **seat.environ})
            for seat in setup.seats
        ]
        self.ranks = ForkedRanks(seats)
        self.files = dict(files)  # segment id -> this host's memory files of it, while `holdings` holds it
        self.holdings = Holdings(files)
        self.reader: threading.Thread | None = None

    def start(self, setup: Setup, store: socket.socket | None) -> None:
        with forkserver.lock:
            self.ranks.start(
                self.relay, forkserver.context_held(), setup.spec_payload, self.files, store, None, setup.commands
            )
        self.reader = threading.Thread(target=self._serve, name=f"ddpnb-{self.place.engine}-reader", daemon=True)
        self.reader.start()
        threading.Thread(target=self._forward, name=f"ddpnb-{self.place.engine}-sender", daemon=True).start()

    def _serve(self) -> None:
        try:
            self.ranks.serve()
        finally:
            self.relay.finish()

    def _forward(self) -> None:
        """The ranks' events, a read pass at a time, until every rank on this node has ended."""
        while True:
            batch, done = self.relay.take(HOLD)
            if batch:
                self.report(Report.EVENTS, batch)
            if done:
                self.report(Report.DONE)
                return

    def report(self, kind: Report, value: Any = None) -> None:
        with self.lock:
            try:
                self.conn.send_bytes(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:  # the kernel is gone: the control loop sees it too
                return

    def obey(self) -> None:
        """The kernel's controls, in the order it sent them, until it closes the connection."""
        while True:
            kind, value = pickle.loads(self.conn.recv_bytes())
            if kind is Control.STOP:
                self.ranks.stop(value)
            elif kind is Control.ESCALATE:
                self.ranks.escalate()
            elif kind is Control.STACKS:  # takes a second (the ranks write their stacks): not in this loop
                threading.Thread(
                    target=self._send_stacks, args=value, name=f"ddpnb-{self.place.engine}-stacks", daemon=True
                ).start()
            elif kind is Control.COMMAND:  # with the segments this host lacks; the others it holds
                ranks, command, shape, ids = value
                self.files.update(receive_data(self.conn.fileno(), shape, self.place.engine) if shape else {})
                self.relay.commanded = time.monotonic()
                self.ranks.send(ranks, command, {segment: self.files[segment] for segment in ids})
                if ids:
                    for segment in self.holdings.used(ids):
                        close_files({segment: self.files.pop(segment)})
            elif kind is Control.INTERRUPT:
                self.ranks.interrupt(value)

    def _send_stacks(self, ranks: list[int], number: int) -> None:
        """The request's own ranks and number, bound when it came (a lambda read the loop's, rebound by the next
        control: another request's ranks, or a command's)."""
        self.report(Report.STACKS, (number, self.ranks.collect_stacks(ranks)))

    def close(self) -> None:
        """Nothing of this node's part may outlive the run."""
        self.relay.abandon()
        self.ranks.escalate()
        if self.reader is not None:
            self.reader.join(READER_WAIT)
        self.ranks.close()
        close_files(self.files)
        shutil.rmtree(self.scratch, ignore_errors=True)


def serve(address: tuple[str, int], secret: bytes, place: Place) -> None:
    """Be this node's host for one attempt: connect proving `secret`, say `place`, fork what the kernel sends, relay
    the ranks' events until the kernel closes the connection; then nothing of this node's part is left."""
    forkserver.warm_up_in_background()  # `import torch` once per node, while the kernel sends the setup
    conn = Client(address, family="AF_INET", authkey=secret)
    keepalive(conn)
    here = _address_towards(address)
    store = bind_store_socket(here) if place.node_index == 0 else None  # rank 0's TCPStore, on this node
    conn.send_bytes(
        pickle.dumps(
            Hello(
                node_index=place.node_index,
                node=place.node or socket.gethostname(),
                host=here,
                pid=os.getpid(),
                step=place.step,
                store_port=store.getsockname()[1] if store else 0,
            )
        )
    )
    host = None
    try:
        kind, setup = pickle.loads(conn.recv_bytes())
        assert kind is Control.SETUP, kind
        files = receive_data(conn.fileno(), setup.layout, place.engine)
        host = NodeHost(conn, setup, files, place)
        host.start(setup, store)
        host.obey()
    except (EOFError, OSError):  # the kernel closed the connection: the run is over here
        pass
    finally:
        if host is not None:
            host.close()
        conn.close()


def _threads_per_rank(ranks: int, cpus: int) -> dict[str, str]:
    """Each rank's share of the CPUs the host was given (torchrun's rule is one thread: ddpnb splits what the host
    holds), unless the user's OMP_NUM_THREADS says otherwise."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (cpus or len(os.sched_getaffinity(0))) // max(1, ranks)))}


def _address_towards(address: tuple[str, int]) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # sends nothing: asks the routing table which local address reaches the kernel
        return probe.getsockname()[0]
