"""A detached run's supervisor on Ray (`--engine ray --detach`, docs/detached.md "On Ray"): a detached actor in
the cluster, named after the run in ddpnb's namespace, that runs the same supervisor the local engine forks
(`ddpnb.detached.supervisor.main`), with this engine inside the cluster.

The actor, not the kernel, owns what the run asks of Ray: the nodes' hosts (which fork the ranks) and the run's
placement group. Ray ends both with the actor, so its death (killed, or its node lost) ends the ranks, as the
kernel's does for an ordinary run; the actor exits once the run has ended and everything is written, leaving
nothing in the cluster. The kernel and the actor share the run directory (the same machine, or a file system both
mount): the plan, the journal, the door and the result live there.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ddpnb.core.spec import LaunchError

NAMESPACE = "ddpnb"  # Ray namespace of every detached run's supervisor
PREFIX = "ddpnb-supervisor-"  # + the run's name: the supervisor actor's name
# by name, as a Slurm batch job runs it (`python -m`): engines sit below detached runs in ddpnb's layers
SUPERVISOR = "ddpnb.detached.supervisor"
CALL_WAIT = 120.0  # seconds a new actor may take to start (its worker imports ddpnb)


def actor_name(run_dir: str) -> str:
    return PREFIX + Path(run_dir).name


class Supervisor:
    """The detached actor (0 CPUs: the ranks' bundles hold the run's resources) that owns one detached run."""

    def sees(self, run_dir: str) -> str:
        """Where this actor runs, if the kernel's run directory is there too; '' where it is not (no shared file
        system between the kernel and this node)."""
        import socket

        return socket.getfqdn() if Path(run_dir).is_dir() else ""

    def supervise(self, run_dir: str) -> None:
        """Own the run until it ends and everything is written, then leave the cluster (this actor exits)."""
        import traceback

        import ray

        try:
            importlib.import_module(SUPERVISOR).main(run_dir)
        except BaseException:  # noqa: BLE001 - into supervisor.log (main sends stderr there); the kernel reads why
            traceback.print_exc()
        finally:
            ray.actor.exit_actor()


class RayHome:
    """`SupervisorHome` on Ray: the supervisor as a detached actor, in the cluster the options name."""

    def __init__(self, address: str | None) -> None:
        self.address = address

    def start(self, run_dir: str) -> str:
        import ray

        from ddpnb.engines.ray import cluster
        from ddpnb.engines.ray.train import near_this_kernel

        connected = cluster.connect_lasting(self.address)
        name = actor_name(run_dir)
        actor = (
            ray.remote(Supervisor)
            .options(
                name=name,
                namespace=NAMESPACE,
                lifetime="detached",  # not the kernel's: it stays when the kernel goes
                num_cpus=0,
                max_restarts=0,  # a supervisor started again would start the run again
                scheduling_strategy=near_this_kernel(),  # the kernel's node where it is one: its files are there
            )
            .remote()
        )
        try:
            node = ray.get(actor.sees.remote(run_dir), timeout=CALL_WAIT)
        except Exception as exc:  # noqa: BLE001 - Ray's: a timeout, the actor's worker died while starting
            ray.kill(actor)
            raise LaunchError(
                f"the detached run's supervisor could not start in the Ray cluster ({type(exc).__name__}: {exc})"
            ) from None
        if not node:
            ray.kill(actor)
            raise LaunchError(
                f"the Ray node the detached run's supervisor went to does not see this kernel's run directory "
                f"{run_dir}: a detached Ray run needs a file system both share. Run the notebook on a node of "
                "the cluster, or set DDPNB_RUNS_DIR to a directory every node and this kernel mount; or leave out "
                "detach."
            )
        actor.supervise.remote(run_dir)
        return f"Ray actor {name} (namespace {NAMESPACE}) on {node}; {connected.removeprefix('[ddpnb] ')}"

    def alive(self, run_dir: str) -> bool | None:
        """Whether the run's supervisor actor lives, as the cluster says; None where this kernel has no Ray."""
        import ray

        if not ray.is_initialized():
            return None
        try:
            ray.get_actor(actor_name(run_dir), namespace=NAMESPACE)
        except ValueError:  # Ray's word for a name no live actor has
            return False
        return True
