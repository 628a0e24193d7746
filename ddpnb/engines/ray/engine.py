"""The ray engine, kernel side: its options and flags, and the choice of launch for each run.

A run that may restart goes through Ray Train (`train.py`): its FailureConfig restarts every rank within one
fit, and its checkpoints say where they resume. Any other run, and every session, is forked by a warm host on
each node (`warm.py`): a later launch then costs a placement group and a fork, not new Ray workers that each
import torch (figures: bench/RESULTS.md).
"""

from __future__ import annotations

import enum
import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ddpnb import _compat
from ddpnb.core.engine import AttemptStart, Capabilities, Flag, RunEvents
from ddpnb.core.spec import LaunchError, Plan, WorkerSpec
from ddpnb.engines.ray import RAY_REQUIREMENT
from ddpnb.engines.ray.data import ObjectStoreShipment

if TYPE_CHECKING:
    from ddpnb.engines.ray.detach import RayHome, ServedRun

INSTALL_HINT = (
    f"--engine ray needs Ray Train: pip install -e '.[ray]' (that is, {RAY_REQUIREMENT!r}) here and on "
    "every node of the cluster."
)
ANNOUNCE_EVERY = 0.1  # seconds between two announcements of output to the views
# seconds `Run.stop()` waits for the ranks to be gone: Ray Train's abort, then the run actor killed
STOP_WAIT = 3.0 + 2 * 15.0 + 5


class Placement(enum.Enum):
    """How Ray places the ranks: Ray Train's placement-group strategies."""

    PACK = "pack"  # as few nodes as possible (Ray Train's default)
    SPREAD = "spread"  # across as many nodes as possible


@dataclass(frozen=True)
class RayOptions:
    """`address`: the cluster ('auto', 'HOST:PORT', 'ray://HOST:PORT', 'local'; default: the one this kernel is
    connected to, else $RAY_ADDRESS or a `ray start` cluster here, else a local Ray instance sized for the run);
    `placement`: 'pack' (few nodes, the default) or 'spread' (across nodes)."""

    address: str | None = None
    placement: Placement = Placement.PACK

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "placement", Placement(self.placement))
        except ValueError:
            choices = ", ".join(p.value for p in Placement)
            raise LaunchError(f"placement must be one of {choices}, not {self.placement!r}.") from None


class RayType:
    """The ray engine before a run: Ray Train installed, a placement; the GPUs are the cluster's."""

    name: ClassVar[str] = "ray"
    # ranks may be on other nodes: notebook data goes through Ray's object store (`shipment`), results in messages
    capabilities: ClassVar[Capabilities] = Capabilities(
        commands=True, announce_every=ANNOUNCE_EVERY, stop_wait=STOP_WAIT
    )
    Options: ClassVar[type] = RayOptions
    flags: ClassVar[list[Flag]] = [
        Flag(
            "--address",
            metavar="auto|HOST:PORT|ray://HOST:PORT|local",
            help="with --engine ray: the cluster to use (default: the one this kernel is connected to, else "
            "$RAY_ADDRESS or a `ray start` cluster on this machine, else a local Ray instance sized for the "
            "run, which 'local' asks for in any case).",
        ),
        Flag(
            "--placement",
            choices=[p.value for p in Placement],
            help="with --engine ray: 'pack' ranks onto few nodes (default) or 'spread' them across nodes.",
        ),
    ]

    def __init__(self) -> None:
        if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
            raise LaunchError(INSTALL_HINT)

    def check(self, options: RayOptions) -> None:
        """Nothing more to check before the cluster is reached (`cluster.connect`, at start)."""

    def shipment(self) -> ObjectStoreShipment:
        return ObjectStoreShipment()

    def gpus_available(self) -> int | None:
        return None

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        return dict(env)  # a cluster's nodes keep their own environment: only the variables asked for travel

    def torch_threads(self, plan: Plan, environ: dict[str, str]) -> int | None:
        return None  # Ray Train sets the workers' threads from their CPUs

    def create(self, spec: WorkerSpec, options: RayOptions) -> RayEngine:
        return RayEngine(spec, options.address, options.placement)

    def supervisor_home(self, options: RayOptions, spec: WorkerSpec) -> RayHome:
        """A detached run's supervisor: a detached actor in the cluster (`detach.py`), not in the kernel."""
        from ddpnb.engines.ray.detach import RayHome

        return RayHome(options.address)

    def served_runs(self) -> list[ServedRun]:
        """The detached runs whose supervisor actors live in the cluster this kernel is connected to (none where
        it has no connection: listing makes none)."""
        from ddpnb.engines.ray.detach import served_runs

        return served_runs()


class RayEngine:
    """One attempt on Ray: through Ray Train where the run may restart (`AttemptStart.restarts`, or a restart
    already), else forked by the nodes' warm hosts. Every call goes to the launch chosen at `start`."""

    def __init__(self, spec: WorkerSpec, address: str | None, placement: Placement) -> None:
        self.spec = spec
        self.address = address
        self.placement = placement
        self.launch: Any = None  # TrainEngine | WarmEngine, from `start`

    def start(self, events: RunEvents, start: AttemptStart) -> None:
        from ddpnb.engines.ray import cluster

        connect = functools.partial(cluster.connect_for_run, self.address, self.spec.world_size, self.spec.use_gpus)
        if (start.restarts and _compat.ray_train_v2()) or self.spec.attempt:
            from ddpnb.engines.ray.train import TrainEngine

            self.launch = TrainEngine(self.spec, self.placement.name, connect)
        else:
            from ddpnb.engines.ray.warm import WarmEngine

            self.launch = WarmEngine(self.spec, self.placement.name, connect)
        self.launch.start(events, start)

    def serve(self) -> None:
        self.launch.serve()

    def stop(self, ranks: list[int], failed: bool) -> float | None:
        return self.launch.stop(ranks, failed)

    def escalate(self) -> float | None:
        return self.launch.escalate()

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        return self.launch.collect_stacks(ranks)

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        self.launch.send(ranks, command, shipment)

    def interrupt(self, ranks: list[int]) -> None:
        self.launch.interrupt(ranks)

    def close(self) -> None:
        if self.launch is not None:
            self.launch.close()
