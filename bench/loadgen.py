"""N simulated ranks against the real kernel side: the `sim` engine, for the scale test and the bench's scale section.

Only the training is simulated. Each simulated node is a host process of its own (`python -c ... host_main`) that
is invited, admitted and set up exactly as a Slurm node's host is (`remote/wire.py`'s invitation on its stdin, the
door's HMAC challenge, `Hello`, `Setup`), and that sends what a real node's host sends, in the same frames and the
same codec: batches of `node.relay` events (placed, Started, a `Metric` per step, output lines, `StepTimes` with
collective arrivals every few steps, `Hardware` once a second, Returned or Failed, the exit), a read pass apart.
It obeys the kernel's STOP, ESCALATE and STACKS, answering stacks in faulthandler's format over a real source file,
so the stall doctor reads them as it reads a real rank's. The kernel side is `SimEngine`: the remote layer's
`HostConnections`, as the Slurm engine uses it, minus Slurm. A `Scenario` says the rates and the cues: a rank that
stalls (the others then wait in all_reduce), a rank that fails, a straggler, a node that answers no stacks.

    ddpnb.launch(train, engine="sim", nprocs=1024, view="text", ranks_per_node=8, steps=50, stall_rank=17,
                 stall_at=3.0, fail_rank=300, fail_at=9.0, stall=2)
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any, ClassVar

from ddpnb.core import messages as msg
from ddpnb.core import pickling
from ddpnb.core.engine import AttemptStart, Capabilities, Flag, RunEvents
from ddpnb.core.spec import LaunchError, Plan, Stream, WorkerSpec
from ddpnb.node.rank import Seat
from ddpnb.remote import wire
from ddpnb.remote.connections import HostConnections, HostLink

ROOT = Path(__file__).resolve().parent.parent
PASS = 0.2  # seconds between two batches from a host: a real host's reader pass (node.forked.COALESCE)
STOP_GRACE = 2.0  # seconds between STOP and ESCALATE, as a real node's
STACK_WAIT = 3.0  # seconds hosts get to answer a stacks request
HOST_WAIT = 30.0  # seconds a host may take to come (the box is loaded: 128 Python processes start at once)
HOST_MAIN = "from bench.loadgen import host_main; host_main()"
# the simulated training's source: real lines, so that the stall doctor reads them as a rank's (`linecache`)
SOURCE = """\
import time
import torch.distributed as dist


def train(steps):
    for step in range(steps):
        loss = model(batch)
        if rank == stall_rank:
            time.sleep(3600)
        dist.all_reduce(loss)
        ddpnb.log(step=step, loss=loss)
"""
SLEEP_LINE, ALL_REDUCE_LINE, TRAIN_LINE = 9, 10, 6
C10D = "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py"
C10D_LOGGER = "/usr/lib/python3/site-packages/torch/distributed/c10d_logger.py"


@dataclass(frozen=True)
class Scenario:
    """What the simulated ranks do: the `sim` engine's options. Times are seconds after training began (`start_at`)."""

    ranks_per_node: int = 8
    start_at: float = 0.0  # training begins this long after the launch on every node at once (as after the rendezvous)
    steps_per_second: float = 5.0  # a `Metric` per step per rank (loss, lr)
    lines_per_second: float = 2.0  # output lines per rank
    steps: int = 50  # every rank returns after this many steps (unless it stalled or failed first)
    stall_rank: int = -1  # this rank sleeps from `stall_at` on; every other rank then waits in all_reduce
    stall_at: float = 0.0
    stall_for: float = 3600.0  # ... and goes on after this long
    fail_rank: int = -1  # this rank raises at `fail_at`
    fail_at: float = 0.0
    straggler: int = -1  # this rank comes to each collective `late` seconds after the others
    late: float = 0.04
    mute_node: int = -1  # this node answers no stacks request (its ranks "have not reported")
    source: str = ""  # the training's source file (a temporary one by default)

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.steps_per_second <= 0 or self.steps < 1:
            raise LaunchError("ranks_per_node and steps must be at least 1, steps_per_second above 0")


class SimType:
    """The `sim` engine before a run: nothing to check but the scenario."""

    name: ClassVar[str] = "sim"
    capabilities: ClassVar[Capabilities] = Capabilities(announce_every=PASS, stop_wait=STOP_GRACE + STACK_WAIT + 10)
    Options: ClassVar[type] = Scenario
    flags: ClassVar[list[Flag]] = []

    def check(self, options: Scenario) -> None:
        """Nothing beyond `Scenario.__post_init__`."""

    def shipment(self) -> None:
        return None

    def gpus_available(self) -> int | None:
        return None

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        return dict(env)

    def torch_threads(self, plan: Plan, environ: dict[str, str]) -> int | None:
        return None

    def create(self, spec: WorkerSpec, options: Scenario) -> SimEngine:
        return SimEngine(spec, options)


def source_file(scenario: Scenario) -> str:
    """The training's source, written once per scenario that names none."""
    if scenario.source:
        return scenario.source
    path = Path(tempfile.gettempdir()) / "ddpnb-loadgen-train.py"
    if not path.exists() or path.read_text() != SOURCE:
        path.write_text(SOURCE)
    return str(path)


class SimEngine:
    """One attempt's simulated nodes: a host process each, over the remote layer's channel (`HostConnections`)."""

    def __init__(self, spec: WorkerSpec, scenario: Scenario) -> None:
        self.spec = spec
        self.scenario = dataclasses.replace(scenario, source=source_file(scenario))
        self.world_size = spec.world_size
        self._conns = HostConnections(self.world_size, spec.run_dir, self._seats, where="simulated node")
        self._hosts: list[subprocess.Popen[bytes]] = []
        self._started = 0.0

    def start(self, events: RunEvents, start: AttemptStart) -> None:
        try:
            self._conns.start(events, pickling.dump_spec(self.spec, start.shipment), {}, start.commands)
            per = self.scenario.ranks_per_node
            spread = [min(per, self.world_size - first) for first in range(0, self.world_size, per)]
            invitation = self._conns.listen("127.0.0.1", spread)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            # one epoch for every node: the ranks of a DDP run make their steps together
            plan = json.dumps(
                {"world_size": self.world_size, "epoch": time.time(), **dataclasses.asdict(self.scenario)}
            )
            for index in range(len(spread)):
                host = subprocess.Popen(
                    [sys.executable, "-c", HOST_MAIN, str(index), plan],
                    stdin=subprocess.PIPE,
                    env=env,
                    start_new_session=True,  # the kernel's interrupt is not the hosts': the run stops them
                )
                assert host.stdin is not None
                host.stdin.write(invitation)
                host.stdin.close()
                self._hosts.append(host)
            self._started = time.monotonic()
            self._conns.hosts.open()
        except BaseException:
            self.close()
            raise

    def _seats(self, link: HostLink, master: tuple[str, int]) -> list[Seat]:
        return [Seat(rank, local, len(link.ranks), "", link.index, *master) for local, rank in enumerate(link.ranks)]

    def serve(self) -> None:
        events, conns = self._conns.hosts.events, self._conns
        assert events is not None
        last_wake = 0.0
        try:
            while not conns.hosts.all_ended():
                woken = time.monotonic()
                if woken - last_wake < PASS and events.quiet():
                    time.sleep(PASS - (woken - last_wake))
                last_wake = time.monotonic()
                conns.read_ready(0.1)
                self._settle()
                events.tick()
        finally:
            conns.selector.close()

    def _settle(self) -> None:
        """A host that hung up before its ranks ended, or never came: its ranks fail (or, stopping, end)."""
        conns, now = self._conns, time.monotonic()
        for link, host in zip(conns.links, self._hosts):
            left = conns.hosts.left(link.index)
            if not left:
                continue
            if link.closed_at is not None or (
                link.hello is None and (host.poll() is not None or now - self._started > HOST_WAIT)
            ):
                conns.hosts.lose(left, f"its simulated node {link.name} was lost", stopped=conns.stopping)

    def stop(self, ranks: list[int], failed: bool) -> float | None:
        self._conns.stop(ranks)
        return STOP_GRACE

    def escalate(self) -> float | None:
        self._conns.escalate()
        return None

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        return self._conns.collect_stacks(ranks, STACK_WAIT)

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        raise LaunchError("the sim engine has no command channel")

    def interrupt(self, ranks: list[int]) -> None:
        raise LaunchError("the sim engine has no command channel")

    def close(self) -> None:
        self._conns.close()
        deadline = time.monotonic() + 5.0
        for host in self._hosts:
            try:
                host.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                host.kill()
                host.wait()
        self._conns.shut_door()


# --- a simulated node's host ---------------------------------------------------------------------------------------
class SimNode:
    """One simulated node's ranks, played a read pass at a time into batches of relay events."""

    def __init__(
        self, conn: Connection, ranks: list[int], node: int, world_size: int, scenario: Scenario, epoch: float
    ) -> None:
        self.conn = conn
        self.ranks = ranks
        self.node = node
        self.world_size = world_size
        self.s = scenario
        self.lock = threading.Lock()  # one frame at a time; `running` and `pending`
        self.running = set(ranks)
        self.pending: list[tuple[Any, ...]] = []  # events of this pass: the controls' answers join them
        self.t0 = epoch + scenario.start_at  # when training begins
        self.step = 0  # steps every running rank has made (they run in step: DDP)
        self.lines = 0  # lines every running rank printed
        self.hardware_at = 0.0

    def report(self, kind: wire.Report, value: Any = None) -> None:
        frame = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            self.conn.send_bytes(frame)

    def play(self) -> None:
        placed = False
        while True:
            time.sleep(PASS)
            with self.lock:
                if not placed and time.time() >= self.t0:  # forked once every node came, as after a warm-up
                    placed = True
                    self.pending += [("placed", rank, os.getpid()) for rank in self.ranks]
                    self.pending += [("message", rank, msg.Started(rank, "cpu")) for rank in self.ranks]
                if placed:
                    self._pass(time.time())
                batch, self.pending = self.pending, []
                done = not self.running
            if batch:
                self.report(wire.Report.EVENTS, batch)
            if done:
                self.report(wire.Report.DONE)
                return

    def _stalled(self, since: float) -> bool:
        s = self.s
        return 0 <= s.stall_rank < self.world_size and s.stall_at <= since < s.stall_at + s.stall_for

    def _pass(self, now: float) -> None:
        """What the running ranks sent since the last pass (the lock held)."""
        s, since, events = self.s, now - self.t0, self.pending
        if 0 <= s.fail_rank and s.fail_rank in self.running and since >= s.fail_at:
            rank = s.fail_rank
            events.append(("message", rank, msg.Failed(rank, now, "RuntimeError", "simulated failure", _tb(s))))
            events.append(("exited", rank, 1, False))
            self.running.discard(rank)
        if now - self.hardware_at >= 1.0:  # a heartbeat, stalled or not
            self.hardware_at = now
            events += [("message", r, msg.Hardware(r, now, 98.0 + r % 3, 900 << 20)) for r in sorted(self.running)]
        if self._stalled(since):
            return
        due = min(s.steps, max(0, int(since * s.steps_per_second)))
        for step in range(self.step + 1, due + 1):
            at = self.t0 + step / s.steps_per_second
            for rank in sorted(self.running):
                values = {"loss": 2.0 / step + rank * 1e-4, "lr": 0.001}
                events.append(("message", rank, msg.Metric(rank, step, at, values)))
            if step % 4 == 0:  # the radar's report, about every 0.5 s at 5 steps/s
                for rank in sorted(self.running):
                    late = s.late if rank == s.straggler else 0.0
                    ns = int((at + late) * 1e9)
                    arrivals = (("0", step * 2, ns), ("0", step * 2 + 1, ns + 1_000_000))
                    events.append(("message", rank, msg.StepTimes(rank, 4, 0.8, 0.6 - late, step, arrivals)))
        self.step = max(self.step, due)
        lines = max(0, int(since * s.lines_per_second))
        if lines > self.lines:  # what a rank printed since the last pass: one read of its pipe
            steps = [max(1, int(line / s.lines_per_second * s.steps_per_second)) for line in range(self.lines, lines)]
            text = "".join(f"step {step} loss {2.0 / step:.4f}\n" for step in steps).encode()
            events += [("output", rank, Stream.STDOUT, text) for rank in sorted(self.running)]
        self.lines = lines
        if self.step >= s.steps:
            for rank in sorted(self.running):
                payload = pickle.dumps(self.step) if rank == 0 else None
                events += [("message", rank, msg.Returned(rank, payload)), ("exited", rank, 0, False)]
            self.running.clear()

    def stack(self, rank: int) -> str:
        """The rank's stack as faulthandler dumps it (newest first): asleep in the user's line, or in all_reduce."""
        stalled = rank == self.s.stall_rank and self._stalled(time.time() - self.t0)
        frames = [f'  File "{self.s.source}", line {TRAIN_LINE} in <module>']
        if stalled:
            frames.insert(0, f'  File "{self.s.source}", line {SLEEP_LINE} in train')
        else:
            frames[:0] = [
                f'  File "{C10D}", line 2501 in all_reduce',
                f'  File "{C10D_LOGGER}", line 83 in wrapper',
                f'  File "{self.s.source}", line {ALL_REDUCE_LINE} in train',
            ]
        return "Thread 0x00007f00 (most recent call first):\n" + "\n".join(frames) + "\n"

    def obey(self) -> None:
        """The kernel's controls until it hangs up; then this node's part is over."""
        while True:
            try:
                kind, value = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                os._exit(0)
            if kind is wire.Control.STACKS:
                ranks, number = value
                if self.node != self.s.mute_node:
                    with self.lock:
                        stacks = {rank: self.stack(rank) for rank in ranks if rank in self.running}
                    self.report(wire.Report.STACKS, (number, stacks))
            elif kind in (wire.Control.STOP, wire.Control.ESCALATE):
                code = -signal.SIGTERM if kind is wire.Control.STOP else -signal.SIGKILL
                with self.lock:
                    ended = [
                        rank for rank in (value if kind is wire.Control.STOP else self.ranks) if rank in self.running
                    ]
                    self.pending += [("exited", rank, code, True) for rank in ended]
                    self.running -= set(ended)


def _tb(scenario: Scenario) -> str:
    return (
        "Traceback (most recent call last):\n"
        f'  File "{scenario.source}", line {ALL_REDUCE_LINE - 3}, in train\n'
        "RuntimeError: simulated failure\n"
    )


def host_main() -> None:
    """A simulated node's host: `python -c HOST_MAIN NODE_INDEX PLAN`, the invitation on stdin."""
    node, plan = int(sys.argv[1]), json.loads(sys.argv[2])
    world_size, epoch = plan.pop("world_size"), plan.pop("epoch")
    scenario = Scenario(**plan)
    address, secret = wire.read_invitation(0)
    conn = Client(address, family="AF_INET", authkey=secret)
    conn.send_bytes(pickle.dumps(wire.Hello(node, f"sim{node}", "127.0.0.1", os.getpid(), step="")))
    try:
        kind, setup = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    assert kind is wire.Control.SETUP, kind
    wire.close_files(wire.receive_data(conn.fileno(), setup.layout, "sim"))
    sim = SimNode(conn, [seat.rank for seat in setup.seats], node, world_size, scenario, epoch)
    threading.Thread(target=sim.obey, name="sim-obey", daemon=True).start()
    try:
        sim.play()
    except OSError:  # the kernel hung up
        return
    threading.Event().wait()  # after DONE: `obey` ends the process once the kernel hangs up
