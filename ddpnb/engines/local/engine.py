"""The local engine, kernel side: ranks forked from the pre-warmed forkserver (`node/forkserver.py`), read
through one epoll selector (`node/forked.py`), each with a pipe to the kernel for its output and messages."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from ddpnb.core import pickling
from ddpnb.core.engine import AttemptStart, Capabilities, Flag, RunEvents
from ddpnb.core.spec import LaunchError, Plan, WorkerSpec, local_gpu_count
from ddpnb.node import forkserver
from ddpnb.node.forked import COALESCE, STACK_WAIT, STOP_GRACE, ForkedRanks, bind_store_socket
from ddpnb.node.rank import Seat
from ddpnb.node.shared import MemoryShipment


@dataclass(frozen=True)
class LocalOptions:
    """The local engine takes no options of its own: its ranks are this machine's processes."""


class LocalType:
    """The local engine before a run: this machine's GPUs, the kernel's environment."""

    name: ClassVar[str] = "local"
    capabilities: ClassVar[Capabilities] = Capabilities(
        shares_memory=True,
        shares_run_dir=True,
        commands=True,
        announce_every=COALESCE,
        stop_wait=STOP_GRACE + STACK_WAIT + 5,
        ranks_here=True,
    )
    Options: ClassVar[type] = LocalOptions
    flags: ClassVar[list[Flag]] = []

    def check(self, options: LocalOptions) -> None:
        try:  # ranks start in the kernel's working directory, as every multiprocessing child does
            os.getcwd()
        except FileNotFoundError:
            raise LaunchError(
                "this kernel's working directory no longer exists (deleted, or moved?), and ranks start "
                "in it: change to one that exists (os.chdir(...), or %cd in a notebook), then run the "
                "cell again."
            ) from None

    def shipment(self) -> MemoryShipment:
        return MemoryShipment()

    def gpus_available(self) -> int | None:
        return local_gpu_count()

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        return {**os.environ, **env}

    def torch_threads(self, plan: Plan, environ: dict[str, str]) -> int | None:
        """The CPUs this process may run on, split between CPU ranks (torchrun sets OMP_NUM_THREADS=1)."""
        if plan.use_gpus or "OMP_NUM_THREADS" in environ:
            return None
        try:
            usable = len(os.sched_getaffinity(0))  # taskset, a container's cpuset: not every CPU the machine has
        except AttributeError:  # not Linux
            usable = os.cpu_count() or 1
        return max(1, usable // plan.world_size)

    def create(self, spec: WorkerSpec, options: LocalOptions) -> LocalEngine:
        return LocalEngine(spec)


class LocalEngine:
    """One attempt's ranks as processes forked from the forkserver, all on this machine."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._ranks: ForkedRanks | None = None

    def start(self, events: RunEvents, start: AttemptStart) -> None:
        store_socket = bind_store_socket()
        try:
            # before any rank starts: arguments that cannot be sent
            spec_payload = pickling.dump_spec(self.spec, start.shipment)
        except BaseException:
            store_socket.close()
            raise
        seats = Seat.local(self.spec.world_size, self.spec.use_gpus, self.spec.run_dir, store_socket.getsockname()[1])
        self._ranks = ForkedRanks(seats)
        # every rank maps the same memory files of notebook data (the function's and the args')
        data = start.shipment.fds() if isinstance(start.shipment, MemoryShipment) else {}
        # under the forkserver's lock until every rank is forked: `preload` must not restart the forkserver meanwhile
        with forkserver.lock:
            self._ranks.start(
                events, forkserver.context_held(), spec_payload, data, store_socket, start.result_fd, start.commands
            )

    def serve(self) -> None:
        self._forked.serve()

    def stop(self, ranks: list[int], failed: bool) -> float | None:
        return self._forked.stop(ranks)

    def escalate(self) -> float | None:
        return self._forked.escalate()

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        return self._forked.collect_stacks(ranks)

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        self._forked.send(ranks, command, shipment.fds() if isinstance(shipment, MemoryShipment) else {})

    def interrupt(self, ranks: list[int]) -> None:
        self._forked.interrupt(ranks)

    def close(self) -> None:
        if self._ranks is not None:
            self._ranks.close()

    @property
    def _forked(self) -> ForkedRanks:
        assert self._ranks is not None, "the engine was not started"
        return self._ranks
