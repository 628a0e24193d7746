"""The ray engine's launch through Ray Train, kernel side, for a run that may restart: a run actor on the cluster
hosts Ray Train's fit, whose FailureConfig restarts every rank and whose checkpoints say where they resume; the
kernel drains the run actor's channel.

A run is stopped (Ctrl-C, --timeout, a failed rank) the way Ray Train's own Ctrl-C does it: its controller
aborts, stopping the workers and releasing their placement group. Where that is not possible or too slow, the
run actor is killed: Ray then kills the controller it owns and the workers the controller owns, and ddpnb
releases the placement group.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpnb import _compat
from ddpnb.core import messages as msg
from ddpnb.core import pickling
from ddpnb.core.engine import AttemptStart, RunEvents
from ddpnb.core.spec import Stream, WorkerSpec
from ddpnb.engines.ray import RAY_REQUIREMENT, versions
from ddpnb.engines.ray.actor import FitOutcome, FitRequest, NewAttempt
from ddpnb.engines.ray.data import ObjectStoreShipment

POLL = 0.1  # seconds between two drains of the channel
FAILURE_GRACE = 20.0  # seconds Ray Train gets to stop the other ranks itself after one failed
ABORT_WAIT = 15.0  # seconds Ray Train's own abort gets to end a stopped run before ddpnb kills the run actor
STACK_WAIT = 3.0  # seconds ranks get to send their stacks at a timeout


class TrainEngine:
    """One run's ranks as Ray Train workers (one engine for every attempt Ray Train restarts itself)."""

    def __init__(self, spec: WorkerSpec, placement: str, connect: Callable[[], None]) -> None:
        self.spec = spec
        self.timeout = spec.timeout
        self.placement = placement
        self._connect = connect
        self._events: RunEvents | None = None
        self._actor: Any = None
        self._fit_ref: Any = None
        self._fit: FitOutcome | None = None
        self._aborted = False  # asked Ray Train to abort
        self._killed = False  # the run actor was killed
        self._stopped = False  # stopped by the user or the timeout: Ray Train's account is not a failure
        self._served = False
        self._placement_groups: dict[str, Any] = {}
        self._returned: set[int] = set()
        self._failed: set[int] = set()
        self._stacks: dict[int, str] = {}  # the stacks ranks sent, until `collect_stacks` hands them over
        self._ray_restarts = 0  # restarts Ray Train makes itself (FailureConfig); the run's others are ddpnb's
        self._restarted = 0  # ... of which it made so far

    def start(self, events: RunEvents, start: AttemptStart) -> None:
        import ray

        from ddpnb.engines.ray.actor import RunActor

        self._events = events
        self._ray_restarts = start.restarts if _compat.ray_train_v2() else 0  # the run's policy's budget
        shared = start.shipment
        spec = self.spec
        spec_payload = pickling.dump_spec(spec, shared)  # before anything starts: args that cannot be sent
        self._connect()
        # the function's and args' big tensors and arrays: put into the object store once, fetched by each rank
        data = shared.put() if isinstance(shared, ObjectStoreShipment) else {}
        request = FitRequest(
            name=f"ddpnb-{Path(spec.run_dir).name}",
            spec_payload=spec_payload,
            world_size=spec.world_size,
            use_gpus=spec.use_gpus,
            backend=spec.backend,
            placement=self.placement,
            group_timeout_s=int(self.timeout) + 60 if self.timeout else 1800,
            versions=versions(),
            # Ray Train v2 restarts the workers itself after a rank's failure, and tells the run (`NewAttempt`);
            # a timeout, and Ray Train v1, still end the fit and leave the restart to the run (a new engine)
            max_failures=self._ray_restarts,
            checkpoint_dir=spec.checkpoint_dir,
            data=data,
        )
        self._actor = (
            ray.remote(RunActor)
            .options(
                # per rank: its batches, its long poll for commands and (sessions) for cells; then the kernel's calls
                num_cpus=0,
                max_concurrency=3 * spec.world_size + 8,
                scheduling_strategy=near_this_kernel(),
            )
            .remote()
        )
        self._fit_ref = self._actor.fit.remote(request)

    # --- the reader ------------------------------------------------------------------------------------------------
    def serve(self) -> None:
        import ray

        assert self._events is not None
        try:
            while True:
                ready, _ = ray.wait([self._fit_ref], timeout=POLL)
                if not self._killed:
                    self._drain()  # after fit() returned too: the ranks flushed everything before they returned
                if ready:
                    break
                self._events.tick()
            self._fit = ray.get(self._fit_ref) if not self._killed else None
        except Exception as exc:  # noqa: BLE001 - Ray failed under us (the cluster went away): end the run, saying why
            if not self._killed:
                self._fit = FitOutcome(error=f"lost the Ray run: {type(exc).__name__}: {exc}")
        finally:
            self._served = True
            self._settle_ranks()

    def _drain(self) -> None:
        import ray

        assert self._events is not None
        for data in ray.get(self._actor.drain.remote()):
            if isinstance(data, NewAttempt):
                self._new_attempt(data)
                continue
            message = msg.decode(data)
            if isinstance(message, msg.Placed):
                self._placed(message)
                continue
            if isinstance(message, msg.Returned):
                self._returned.add(message.rank)
            elif isinstance(message, msg.Failed):
                self._failed.add(message.rank)
            elif isinstance(message, msg.Stacks):  # the answer `collect_stacks` waits for, not the run's news
                self._stacks[message.rank] = message.text
                continue
            self._events.message(message.rank, message)

    def _new_attempt(self, mark: NewAttempt) -> None:
        """Ray Train restarted every rank (FailureConfig): the ranks of the attempt before end, then the run opens
        a new attempt; if it may not restart after all, Ray Train's run is stopped."""
        assert self._events is not None
        self._settle_ranks(FitOutcome(rank_errors=mark.rank_errors))
        self._restarted = mark.restarts
        self._returned, self._failed, self._stacks = set(), set(), {}
        self._events.restarted()  # where the run's policy says it ends after all, it stops us (`stop`)

    def _placed(self, message: msg.Placed) -> None:
        assert self._events is not None
        if message.placement_group is not None:
            self._placement_groups[message.placement_group.id.hex()] = message.placement_group
        self._events.placed(message.rank, message.pid, message.node_id)
        line = f"[ddpnb] on Ray node {message.node_id[:12]} ({message.node_ip}), pid {message.pid}\n"
        self._events.output(message.rank, Stream.STDOUT, line.encode())

    def _settle_ranks(self, outcome: FitOutcome | None = None) -> None:
        """Each rank's end: Ray reports no exit codes, so they are inferred as a local run's would be."""
        assert self._events is not None
        fit = outcome or (FitOutcome() if self._fit is None or self._stopped else self._fit)
        unexplained = []
        for rank in range(self.spec.world_size):
            if rank in self._failed:
                self._events.exited(rank, 1)
            elif rank in self._returned:
                self._events.exited(rank, 0)
            elif rank in fit.rank_errors:
                self._events.exited(rank, 1, cause=fit.rank_errors[rank])
            else:
                unexplained.append(rank)
        if fit.error and not (self._failed or fit.rank_errors) and unexplained and not self._stopped:
            first = unexplained.pop(0)  # Ray Train failed before any rank could say why (e.g. ddpnb is missing there)
            self._events.exited(first, 1, cause=fit.error.splitlines()[0], traceback=fit.error + _missing_hint(fit))
        for rank in unexplained:  # ray.kill: by Ray Train after another rank failed, or by ddpnb
            self._events.exited(rank, -signal.SIGKILL, stopped=True)

    # --- stopping ---------------------------------------------------------------------------------------------------
    def stop(self, ranks: list[int], failed: bool) -> float | None:
        if self._served:
            return None
        if failed and self._restarted < self._ray_restarts:  # Ray Train restarts every rank itself (`NewAttempt`)
            return None
        if failed:  # Ray Train stops the others itself (their last output still arrives); abort if it does not
            return FAILURE_GRACE
        self._stopped = True
        return self.escalate()

    def escalate(self) -> float | None:
        """First Ray Train's own abort; where it cannot (Ray Train v1), or takes too long, kill the run actor."""
        import ray

        if self._served or self._killed:
            return None
        if not self._aborted:
            self._aborted = True
            try:
                graceful = ray.get(self._actor.abort.remote(), timeout=ABORT_WAIT)
            except (ray.exceptions.RayError, TimeoutError):  # the run actor is gone or stuck
                graceful = False
            if graceful:
                return ABORT_WAIT
        self._kill()
        return None

    def _kill(self) -> None:
        """Kill the run actor: Ray kills the Train controller it owns, and the controller's workers with it. The
        workers' placement group outlives its creator (it belongs to the kernel's job), so it is removed here."""
        from ray.util import remove_placement_group

        self._killed = True
        self._kill_quietly()
        for group in self._placement_groups.values():
            try:
                remove_placement_group(group)
            except Exception as exc:  # noqa: BLE001 - say so: its CPUs/GPUs stay reserved until the kernel exits
                print(
                    f"[ddpnb] the run's Ray placement group could not be released ({type(exc).__name__}: {exc}); "
                    "its CPUs and GPUs stay reserved until this kernel exits.",
                    file=sys.stderr,
                )

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        import ray

        for rank in ranks:  # an earlier request's late answers: wait for the new ones
            self._stacks.pop(rank, None)
        self._actor.request.remote("stacks")
        deadline = time.monotonic() + STACK_WAIT
        while time.monotonic() < deadline and not set(ranks) <= self._stacks.keys():
            ready, _ = ray.wait([self._fit_ref], timeout=POLL)
            self._drain()
            if ready:
                break
        return {rank: self._stacks[rank] for rank in ranks if rank in self._stacks}

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        # the command's big tensors and arrays: put once (or reused), their references travel with the command
        data = shipment.put() if isinstance(shipment, ObjectStoreShipment) else {}
        self._actor.send_cell.remote(ranks, command, data)

    def interrupt(self, ranks: list[int]) -> None:
        self._actor.request.remote("interrupt:" + ",".join(map(str, ranks)))

    def close(self) -> None:
        if self._actor is not None and not self._killed:
            self._kill_quietly()
        self._events = None  # the run and its value go with the caller's last reference, not at the next gc

    def _kill_quietly(self) -> None:
        import ray

        try:
            ray.kill(self._actor)
        except Exception:  # noqa: BLE001 - Ray already shut down (the kernel is exiting): the actor went with it
            return


def _missing_hint(fit: FitOutcome) -> str:
    if "No module named" in fit.error:
        return (
            f"\n\nThe Ray cluster's nodes need the same packages as this kernel: {RAY_REQUIREMENT}, and ddpnb, "
            f"torch and cloudpickle at the kernel's versions ({versions()})."
        )
    return ""


def near_this_kernel() -> Any:
    """Put an actor (a run actor, a detached run's supervisor) on the kernel's own node when the kernel is on one
    (its channel, and the run directory, stay local)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
    except Exception:  # noqa: BLE001 - a Ray Client connection has no node of its own: anywhere will do
        return "DEFAULT"
