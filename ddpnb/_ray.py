"""The ray engine: a run on a Ray cluster through Ray Train's `TorchTrainer`, seen exactly like a local run.

    kernel                                 Ray cluster
    RayRun (a `Run`), one thread ───────►  run actor (0 CPUs, owned by the kernel: it dies with it)
      drains the channel ten times a         hosts TorchTrainer.fit() and the ranks' channel to the kernel
      second                                 │ owns Ray Train's controller, which owns the workers
                                             ▼
                                           rank × N (Ray Train workers): fds 1/2 → pipes → channel (and on to
                                           Ray's own log), then `_worker._run_function`: the same call, result
                                           and failure code as a local rank, with Ray Train's process group

Ranks report through ddpnb's own channel (the run actor), never through Ray's driver log forwarding, which
loses the rank, drops repeated lines and prints into whichever cell is running. A run is stopped (Ctrl-C,
--timeout, a failed rank) the way Ray Train's own Ctrl-C does it: its controller aborts, stopping the workers and
releasing their placement group. Where that is not possible or too slow, the run actor is killed: Ray then kills
the controller it owns and the workers the controller owns, and ddpnb releases the placement group.

This module imports Ray only inside functions: it is imported for `--engine ray` alone, and on the workers.
"""

from __future__ import annotations

import enum
import importlib.metadata
import importlib.util
import logging
import os
import pickle
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpnb import _messages as msg
from ddpnb import _pickling, _supervisor, _worker
from ddpnb._record import Failure, Outcome, RankState
from ddpnb._supervisor import Run

RAY_REQUIREMENT = "ray[train]>=2.44,<3"  # tested: 2.44.1 (Train v1), 2.60.0 (v2)
INSTALL_HINT = (f"--engine ray needs Ray Train: pip install 'ddpnb[ray]' (that is, {RAY_REQUIREMENT!r}) here and "
                "on every node of the cluster.")
LOCAL = "local"  # `_connection` when this kernel runs the local Ray instance ddpnb started
POLL = 0.1  # seconds between two drains of the channel
FAILURE_GRACE = 20.0  # seconds Ray Train gets to stop the other ranks itself after one failed
ABORT_WAIT = 15.0  # seconds Ray Train's own abort gets to end a stopped run before ddpnb kills the run actor
STACK_WAIT = 3.0  # seconds ranks get to send their stacks at a timeout
SEND_INTERVAL = 0.05  # a rank batches what it sends for this long: one actor call, not one per line or metric
COMMAND_POLL = 30.0  # seconds a rank's long poll for commands (send your stacks) waits in the run actor
CLOSE_WAIT = 10.0  # seconds a finished rank waits for its last messages to reach the run actor
LOCAL_START_ATTEMPTS = 2  # Ray gives a raylet 30 s to start, which a busy machine can overrun
TRAIN_STORAGE = os.path.join(tempfile.gettempdir(), "ddpnb-ray-train")  # Ray Train's per-run directories

_connection: str | None = None  # how ddpnb connected this kernel to Ray: LOCAL, an address, or None (not ddpnb)
_local_resources: dict[str, int] = {}


class Placement(enum.Enum):
    """How Ray places the ranks: Ray Train's placement-group strategies."""

    PACK = "pack"  # as few nodes as possible (Ray Train's default)
    SPREAD = "spread"  # across as many nodes as possible


# --- planning and connecting (in the kernel) -------------------------------------------------------------------
def plan(gpus: int | str | None, nprocs: int | None, backend: str | None) -> tuple[int, bool, str, str]:
    """`_api.plan` for a cluster: the GPUs are counted by Ray on the cluster, not on this machine."""
    from ddpnb._api import DEFAULT_CPU_RANKS, LaunchError

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        raise LaunchError(INSTALL_HINT)
    if gpus is None:
        world_size, use_gpus = nprocs or DEFAULT_CPU_RANKS, False
    else:
        try:
            world_size = int(gpus)
        except ValueError:
            raise LaunchError(f"--engine ray takes a number of GPUs (--gpus N), not {gpus!r}: the ranks go where "
                              "the cluster has GPUs, so 'all' has no meaning there.") from None
        if world_size < 1:
            raise LaunchError(f"--gpus must be at least 1, not {world_size}.")
        if nprocs is not None and nprocs != world_size:
            raise LaunchError(f"--gpus {gpus} starts one rank per GPU; leave out --nprocs {nprocs}.")
        use_gpus = True
    if backend == "nccl" and not use_gpus:
        raise LaunchError("the nccl backend needs GPUs; use --gpus N, or gloo for CPU ranks.")
    return world_size, use_gpus, backend or ("nccl" if use_gpus else "gloo"), ""


def check_placement(placement: str | None) -> str:
    from ddpnb._api import LaunchError

    try:
        return Placement(placement or Placement.PACK.value).value
    except ValueError:
        choices = ", ".join(p.value for p in Placement)
        raise LaunchError(f"placement must be one of {choices}, not {placement!r}.") from None


def connect(address: str | None, cpus: int, gpus: int) -> str:
    """Connect this kernel to Ray by the rule the README documents; returns a line saying where runs go.

    Without `address`: the connection this kernel already has (`ray.init` by the user, or an earlier run), else
    where Ray itself would connect ($RAY_ADDRESS, or a cluster started with `ray start` on this machine), else a
    local Ray instance with the CPUs and GPUs this run needs ('local' asks for that instance in any case). That
    instance stays for later runs of this kernel, is restarted bigger between runs when a run needs more, and
    stops with the kernel. ddpnb never stops a cluster it connected to; an `address` other than the current
    cluster's disconnects from it first.
    """
    global _connection
    import ray

    wants_local = address == LOCAL  # `--address local`: the local instance, even where a cluster is running
    address = None if wants_local else address
    if ray.is_initialized():
        if wants_local:
            same = _connection == LOCAL
        else:
            same = address is None or address == _connection or _is_current(address)
        if same:
            if _connection == LOCAL and not _local_fits(cpus, gpus):
                _restart_local(cpus, gpus)
                return _describe("restarted the local Ray instance ddpnb started, with more room")
            return _describe("Ray" + (" (local instance started by ddpnb)" if _connection == LOCAL else ""))
        ray.shutdown()
        _connection = None
    found = None if wants_local else address or _discover()
    if found is None:
        _start_local(cpus, gpus)
        return _describe("started a local Ray instance for this kernel")
    try:
        ray.init(address=found, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError, ...
        from ddpnb._api import LaunchError

        where = "" if address else " (from $RAY_ADDRESS or a `ray start` on this machine; pass --address to choose)"
        raise LaunchError(f"cannot connect to the Ray cluster at {found}{where}: {type(exc).__name__}: {exc}") from None
    _connection = address or found
    return _describe("connected to Ray")


def _is_current(address: str) -> bool:
    """Whether `address` names the cluster this kernel is connected to (as Ray resolves it)."""
    import ray

    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(address) == ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - a private helper, or a client connection without a GCS address: not provable
        return False


def _discover() -> str | None:
    """The cluster `ray.init()` would join: $RAY_ADDRESS, else the latest `ray start` on this machine."""
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return None if env == LOCAL else env
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(None)
    except Exception:  # noqa: BLE001 - Ray's own discovery is best effort: without it a local instance starts
        return None


def _local_fits(cpus: int, gpus: int) -> bool:
    return cpus <= _local_resources.get("CPU", 0) and gpus <= _local_resources.get("GPU", 0)


def _start_local(cpus: int, gpus: int) -> None:
    global _connection
    import ray

    from ddpnb._api import LaunchError, _gpu_count, _no_gpus_message

    if gpus and gpus > _gpu_count():
        raise LaunchError(_no_gpus_message(gpus, _gpu_count()))
    for attempt in range(LOCAL_START_ATTEMPTS):
        try:
            # no dashboard (ddpnb has its own), no log forwarding (ranks report through ddpnb's channel)
            ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING)
            break
        except Exception as exc:  # noqa: BLE001 - Ray gives its raylet 30 s to start; a busy machine needs longer
            ray.shutdown()
            if attempt + 1 == LOCAL_START_ATTEMPTS:
                raise LaunchError(f"could not start a local Ray instance: {type(exc).__name__}: {exc}") from None
    _connection = LOCAL
    _local_resources.clear()
    _local_resources.update(CPU=cpus, GPU=gpus)


def _restart_local(cpus: int, gpus: int) -> None:
    import ray

    from ddpnb._api import LaunchError

    if any(isinstance(run, RayRun) for run in list(_supervisor._live_runs)):
        raise LaunchError(f"the local Ray instance has {_local_resources.get('CPU', 0)} CPUs and "
                          f"{_local_resources.get('GPU', 0)} GPUs, and a run is still using it: wait for that run "
                          "(or stop it) before starting a bigger one.")
    wanted = (max(cpus, _local_resources.get("CPU", 0)), max(gpus, _local_resources.get("GPU", 0)))
    ray.shutdown()
    _start_local(*wanted)


def _describe(what: str) -> str:
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    total = ray.cluster_resources()
    return (f"[ddpnb] {what}: {len(nodes)} node(s), {total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs")


def _versions() -> dict[str, str]:
    """What must match between the kernel and the cluster's nodes."""
    found = {"python": ".".join(platform.python_version_tuple()[:2])}
    for package in ("ddpnb", "torch", "ray", "cloudpickle"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


# --- messages only the ray engine sends (local ranks use pipes and signals for these) --------------------------
@dataclass(frozen=True)
class Output:
    """A chunk of a rank's stdout or stderr, as written to the fd."""

    rank: int
    stream: str
    data: bytes


@dataclass(frozen=True)
class Placed:
    """Where Ray put the rank."""

    rank: int
    node_id: str
    node_ip: str
    pid: int
    placement_group: Any = None  # Ray Train's placement group for the run: released by ddpnb if it must kill


@dataclass(frozen=True)
class Stacks:
    """The rank's training thread, where it was when the kernel asked (at a timeout)."""

    rank: int
    text: str


# --- the run, in the kernel ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _FitRequest:
    name: str
    spec_payload: bytes
    world_size: int
    use_gpus: bool
    backend: str
    placement: str
    group_timeout_s: int
    versions: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _FitOutcome:
    error: str = ""  # Ray Train's error when fit() raised
    rank_errors: dict[int, str] = field(default_factory=dict)  # Ray Train's per-rank errors (a worker that died)


class RayRun(Run):
    """A `Run` whose ranks are Ray Train workers: the same record, views, `wait`, `result`, `stop`, `WorkerError`.

    `nodes` maps each rank to the ID of the Ray node it runs on, once it started.
    """

    stop_wait = STACK_WAIT + 2 * ABORT_WAIT + 5  # Ray Train's abort, then (if need be) killing the run actor

    def __init__(self, spec: _worker.WorkerSpec, devices: list[str], timeout: float | None = None,
                 address: str | None = None, placement: str = Placement.PACK.value) -> None:
        super().__init__(spec, devices, timeout)
        self.record.engine = "ray"
        self.address = address
        self.placement = Placement(placement)
        self.nodes: dict[int, str] = {}
        self._actor: Any = None
        self._fit_ref: Any = None
        self._fit: _FitOutcome | None = None
        self._abort_at: float | None = None  # when to ask Ray Train to abort the run
        self._hard_stop_at: float | None = None  # when to kill the run actor if the abort did not end the run
        self._aborted = False  # the run actor was killed
        self._placement_groups: dict[str, Any] = {}
        self._ray_streams: dict[tuple[int, str], _supervisor._Stream] = {}
        self._logs: list[Any] = []

    def start(self) -> RayRun:
        import ray

        spec = self.spec
        # retention in any kernel keeps a locked run directory: lock it before connecting, which can take minutes
        self._dir_lock = _supervisor._lock_run_dir(Path(spec.run_dir))
        try:
            spec_payload = _pickling.dump_spec(spec)  # before anything starts: args that cannot be sent
            print(connect(self.address, cpus=spec.world_size, gpus=spec.world_size if spec.use_gpus else 0))
        except BaseException:
            os.close(self._dir_lock)
            Path(spec.run_dir).rmdir()  # still empty: a run that never started leaves nothing
            raise
        self._warn_if_too_small()
        for record in self.record.ranks:
            log = open(record.log_path, "wb", buffering=0, opener=_worker._private)  # noqa: SIM115
            self._logs.append(log)
            for name in ("stdout", "stderr"):
                self._ray_streams[(record.rank, name)] = _supervisor._Stream(record.rank, name, log)
        request = _FitRequest(
            name=f"ddpnb-{Path(spec.run_dir).name}", spec_payload=spec_payload, world_size=spec.world_size,
            use_gpus=spec.use_gpus, backend=spec.backend, placement=self.placement.name,
            group_timeout_s=int(self.timeout) + 60 if self.timeout else 1800, versions=_versions(),
        )
        actor_class = ray.remote(_RunActor)
        self._actor = actor_class.options(
            num_cpus=0, max_concurrency=2 * spec.world_size + 8, scheduling_strategy=_near_this_kernel(),
        ).remote()
        self.record.started = time.time()
        for record in self.record.ranks:
            record.started = self.record.started
        self._fit_ref = self._actor.fit.remote(request)
        _supervisor._live_runs.add(self)
        threading.Thread(target=self._loop, name="ddpnb-ray-run", daemon=True).start()
        return self

    def _warn_if_too_small(self) -> None:
        import ray

        total = ray.cluster_resources()
        cpus, gpus = self.spec.world_size, self.spec.world_size if self.spec.use_gpus else 0
        if total.get("CPU", 0) < cpus or total.get("GPU", 0) < gpus:
            print(f"[ddpnb] the Ray cluster has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs in all; "
                  f"this run needs {cpus} CPUs and {gpus} GPUs. It waits until the cluster has room (an autoscaler "
                  "may add nodes); --timeout bounds the wait.", file=sys.stderr)

    # --- the loop -------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        import ray

        try:
            while True:
                ready, _ = ray.wait([self._fit_ref], timeout=POLL)
                if not self._aborted:
                    self._drain()  # after fit() returned too: the ranks flushed everything before they returned
                if self._news:
                    self._announce()
                if ready:
                    break
                self._check_stop()
            self._fit = ray.get(self._fit_ref) if not self._aborted else None
        except Exception as exc:  # noqa: BLE001 - Ray failed under us (the cluster went away): end the run, saying why
            if not self._aborted:
                self._fit = _FitOutcome(error=f"lost the Ray run: {type(exc).__name__}: {exc}")
        finally:
            self._finish()

    def _drain(self) -> None:
        import ray

        for data in ray.get(self._actor.drain.remote()):
            message = pickle.loads(data)
            self._handle(message.rank, message)

    def _handle(self, rank: int, message: Any) -> None:
        record = self.record.ranks[rank]
        if isinstance(message, Output):
            lines = self._ray_streams[(rank, message.stream)].feed(message.data)
            if lines:
                self._add_lines(rank, message.stream, lines)
        elif isinstance(message, Placed):
            self.nodes[rank] = message.node_id
            record.pid = message.pid
            if message.placement_group is not None:
                self._placement_groups[message.placement_group.id.hex()] = message.placement_group
            line = f"[ddpnb] on Ray node {message.node_id[:12]} ({message.node_ip}), pid {message.pid}\n"
            self._add_lines(rank, "stdout", self._ray_streams[(rank, "stdout")].feed(line.encode()))
        elif isinstance(message, Stacks):
            record.stack, record.stalled_state = message.text, record.state
        elif isinstance(message, msg.Imported):  # Ray's workers import for themselves: preload does not apply
            pass
        else:
            if isinstance(message, msg.Returned):
                record.ended = time.time()
            super()._handle(rank, message)

    def _begin_stop(self, outcome: Outcome, note: str) -> None:
        if self._stop_reason is not None:
            return
        self._stop_reason, self._stop_note = outcome, note
        # after a rank failed, Ray Train stops the others itself (their last output still arrives); else: now
        grace = FAILURE_GRACE if outcome is Outcome.FAILED else 0.0
        self._abort_at = time.monotonic() + grace

    def _check_stop(self) -> None:
        super()._check_stop()  # a requested stop, or the timeout, lands in `_begin_stop` above
        now = time.monotonic()
        if self._abort_at is not None and now >= self._abort_at:
            self._abort_at = None
            self._abort()
        elif self._hard_stop_at is not None and now >= self._hard_stop_at and not self._aborted:
            self._kill()

    def _abort(self) -> None:
        """Stop the run the way Ray Train's own Ctrl-C does: its controller stops the workers, releases their
        placement group and exits. Where it cannot (Ray Train v1), or takes too long, the run actor is killed."""
        import ray

        try:
            graceful = ray.get(self._actor.abort.remote(), timeout=ABORT_WAIT)
        except (ray.exceptions.RayError, TimeoutError):  # the run actor is gone or stuck
            graceful = False
        if graceful:
            self._hard_stop_at = time.monotonic() + ABORT_WAIT
        else:
            self._kill()

    def _kill(self) -> None:
        """Kill the run actor: Ray kills the Train controller it owns, and the controller's workers with it. The
        workers' placement group outlives its creator (it belongs to the kernel's job), so it is removed here."""
        from ray.util import remove_placement_group

        self._aborted = True
        self._kill_quietly()
        for group in self._placement_groups.values():
            try:
                remove_placement_group(group)
            except Exception as exc:  # noqa: BLE001 - say so: its CPUs/GPUs stay reserved until the kernel exits
                self._stop_note += f"; its placement group could not be released ({type(exc).__name__}: {exc})"

    def _dump_stacks(self) -> None:
        import ray

        self._actor.request.remote("stacks")
        deadline = time.monotonic() + STACK_WAIT
        running = [r for r in self.record.ranks if r.state is RankState.RUNNING]
        while time.monotonic() < deadline and not all(r.stack for r in running):
            ready, _ = ray.wait([self._fit_ref], timeout=POLL)
            self._drain()
            if ready:
                return

    def _finish(self) -> None:
        try:
            self._settle_ranks()
            for stream in self._ray_streams.values():  # a last line without its newline
                lines = stream.feed(b"", final=True)
                if lines:
                    self._add_lines(stream.rank, stream.name, lines)
            self._write_endings()
        finally:
            if self._actor is not None and not self._aborted:
                self._kill_quietly()
            for log in self._logs:
                log.close()
            os.close(self._dir_lock)
            self._conclude()

    def _kill_quietly(self) -> None:
        import ray

        try:
            ray.kill(self._actor)
        except Exception:  # noqa: BLE001 - Ray already shut down (the kernel is exiting): the actor went with it
            return

    def _settle_ranks(self) -> None:
        """Each rank's final state: Ray reports no exit codes, so they are inferred as a local run's would be."""
        stopped = self._stop_reason not in (None, Outcome.FAILED)  # by the user or the timeout: not a failure
        fit = _FitOutcome() if self._fit is None or stopped else self._fit
        now = time.time()
        unexplained = []
        for record in self.record.ranks:
            record.ended = record.ended or now
            if record.state is RankState.FAILED:
                record.exitcode = 1 if record.exitcode is None else record.exitcode
            elif record.rank in self._returned:
                record.state, record.exitcode = RankState.FINISHED, 0
            elif record.rank in fit.rank_errors:
                record.state, record.exitcode = RankState.FAILED, 1
                self.record.failures.append(Failure(record.rank, now, fit.rank_errors[record.rank]))
            else:
                unexplained.append(record)
        if fit.error and not self.record.failures and unexplained and self._stop_reason is None:
            first = unexplained.pop(0)  # Ray Train failed before any rank could say why (e.g. ddpnb is missing there)
            first.state, first.exitcode = RankState.FAILED, 1
            self.record.failures.append(Failure(first.rank, now, fit.error.splitlines()[0], fit.error + _hint(fit)))
        if self.record.failures and self._stop_reason is None:
            self._stop_reason, self._stop_note = Outcome.FAILED, f"rank {self.record.first_failure.rank} failed"
        for record in unexplained:
            record.state = RankState.STOPPED
            record.exitcode = -signal.SIGKILL  # ray.kill: by Ray Train after another rank failed, or by ddpnb


def _hint(fit: _FitOutcome) -> str:
    if "No module named" in fit.error:
        return (f"\n\nThe Ray cluster's nodes need the same packages as this kernel: {RAY_REQUIREMENT}, and ddpnb, "
                f"torch and cloudpickle at the kernel's versions ({_versions()}).")
    return ""


def _near_this_kernel() -> Any:
    """Put the run actor on the kernel's own node when the kernel is on one (the channel stays local)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
    except Exception:  # noqa: BLE001 - a Ray Client connection has no node of its own: anywhere will do
        return "DEFAULT"


# --- the run actor, on the cluster ------------------------------------------------------------------------------
class _RunActor:
    """One per run: hosts `TorchTrainer.fit()` and the channel between the ranks and the kernel.

    A threaded actor: `fit` runs for the whole run while ranks `put` and long-poll `next_command` and the kernel
    `drain`s and `request`s. Messages are kept as the ranks pickled them; only the kernel unpickles them.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._inbox: list[bytes] = []
        self._commands: list[str] = []
        self._controller: Any = None  # Ray Train's controller, once it announced itself
        self._fit_started = False
        self._announcing = False  # Ray Train v2: the controller announces itself (`_AnnounceController`)
        self._abort_requested = False

    def put(self, batch: list[bytes]) -> None:
        with self._lock:
            self._inbox.extend(batch)

    def drain(self) -> list[bytes]:
        with self._lock:
            batch, self._inbox = self._inbox, []
        return batch

    def request(self, command: str) -> None:
        with self._lock:
            self._commands.append(command)
            self._lock.notify_all()

    def next_command(self, seen: int, wait: float) -> tuple[int, str | None]:
        with self._lock:
            self._lock.wait_for(lambda: len(self._commands) > seen, timeout=wait)
            if len(self._commands) > seen:
                return seen + 1, self._commands[seen]
            return seen, None

    def set_controller(self, controller: Any) -> None:
        with self._lock:
            self._controller = controller
            abort = self._abort_requested
        if abort:
            controller.abort.remote()

    def abort(self) -> bool:
        """Ask Ray Train to abort the run (now, or as soon as its controller announces itself). False where it
        cannot be asked (Ray Train v1): the kernel then kills this actor."""
        with self._lock:
            self._abort_requested = True
            controller = self._controller
            graceful = controller is not None or self._announcing or not self._fit_started
        if controller is not None:
            controller.abort.remote()
        return graceful

    def fit(self, request: _FitRequest) -> _FitOutcome:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"  # ranks print to their fds, which ddpnb captures
        me = ray.get_runtime_context().current_actor
        callbacks = _announce_controller_to(me) if _train_v2() else []
        # Ray Train v1 reserves a CPU for its coordinator by default: a 2-CPU machine could not run 2 ranks
        coordinator = {} if _train_v2() else {"trainer_resources": {"CPU": 0}}
        trainer = TorchTrainer(
            _rank_main,
            train_loop_config={"spec": request.spec_payload, "channel": me, "versions": request.versions},
            scaling_config=ScalingConfig(num_workers=request.world_size, use_gpu=request.use_gpus,
                                         placement_strategy=request.placement, **coordinator),
            torch_config=TorchConfig(backend=request.backend, timeout_s=request.group_timeout_s),
            # Ray Train keeps a directory per run; ddpnb reports no checkpoints, so it goes to the temp dir
            run_config=RunConfig(name=request.name, storage_path=TRAIN_STORAGE,
                                 failure_config=FailureConfig(max_failures=0),
                                 **({"callbacks": callbacks} if callbacks else {})),
        )
        with self._lock:
            if self._abort_requested:
                return _FitOutcome(error="stopped before it started")
            self._fit_started, self._announcing = True, bool(callbacks)
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 - Ray Train's account of a failed run goes to the kernel as data
            failures = getattr(exc, "worker_failures", None) or {}
            return _FitOutcome(error=_describe_error(exc),
                               rank_errors={int(rank): _describe_error(error).splitlines()[0]
                                            for rank, error in failures.items()})
        finally:
            shutil.rmtree(os.path.join(TRAIN_STORAGE, request.name), ignore_errors=True)
        return _FitOutcome()


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _train_v2() -> bool:
    """Whether `TorchTrainer` is Ray Train v2 (the default in recent Ray; RAY_TRAIN_V2_ENABLED=1 in 2.43 and on)."""
    try:
        from ray.train.v2._internal.constants import is_v2_enabled
    except ImportError:
        return False
    return is_v2_enabled()


def _announce_controller_to(run_actor: Any) -> list[Any]:
    """A Ray Train v2 controller callback that hands the controller to the run actor as it starts, so a stop can
    use the controller's own abort (Ray Train v1 has no such controller)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    class AnnounceController(ControllerCallback):
        def __init__(self, run_actor: Any) -> None:
            self.run_actor = run_actor

        def after_controller_start(self, train_run_context: Any) -> None:
            import ray

            self.run_actor.set_controller.remote(ray.get_runtime_context().current_actor)

    return [AnnounceController(run_actor)]


# --- a rank, on a Ray Train worker --------------------------------------------------------------------------------
class RankFailed(RuntimeError):
    """Raised to Ray Train so it stops the other ranks; the rank's own traceback already went to the notebook."""


def _rank_main(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker`: one rank of a ddpnb run."""
    import ray
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    channel = config["channel"]
    link = _Link(rank, channel)
    _worker._context = link
    context = ray.get_runtime_context()
    link.send(Placed(rank=rank, node_id=context.get_node_id(), node_ip=ray.util.get_node_ip_address(),
                     pid=os.getpid(), placement_group=ray.util.get_current_placement_group()))
    finished = threading.Event()
    threading.Thread(target=_serve_commands, args=(link, channel, finished, threading.get_ident()),
                     name="ddpnb-commands", daemon=True).start()
    capture = _Capture(link)
    try:
        _warn_about_versions(config["versions"])
        _worker._run_function(rank, config["spec"], setup=_setup_on_ray, join_group=_join_ray_group)
        # Ray Train's workers outlive the rank: take its group down, so that a peer left in a collective this rank
        # never joins (one all_reduce too many) fails now (gloo) instead of waiting for the group's timeout
        _worker._destroy_process_group()
    except SystemExit:  # the rank failed and said so (`_worker._report`): Ray Train must now stop the others
        raise RankFailed(f"rank {rank} failed; its traceback is in the notebook") from None
    finally:
        finished.set()
        capture.close()
        link.close()
        _worker._context = None


def _setup_on_ray(rank: int, spec: _worker.WorkerSpec) -> str:
    """The rank's environment and device. Ray Train set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ... already;
    the node keeps its own environment, plus the run's --env values."""
    import ray.train.torch
    import torch

    os.environ.update(spec.environ)
    os.environ["DDPNB_WORKER"] = "1"
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return str(device)
    return "cpu"


def _join_ray_group(rank: int, spec: _worker.WorkerSpec) -> None:
    """Ray Train formed the process group; a call to `init_process_group` for another backend reuses its store."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not dist.is_initialized():
        raise RuntimeError("Ray Train did not initialise the torch process group")
    _worker._store = c10d._get_default_store()


def _warn_about_versions(kernel: dict[str, str]) -> None:
    here = _versions()
    differ = [f"{name} {here.get(name)} here, {version} in the kernel" for name, version in kernel.items()
              if here.get(name) != version]
    if differ:
        print(f"[ddpnb] this node's versions differ from the kernel's: {'; '.join(differ)}. Functions and results "
              "travel pickled between them: install the same versions on both.", file=sys.stderr)


class _Link(_worker._Context):
    """A rank's channel to the kernel through the run actor. `send` never waits: one thread sends what piled up,
    one actor call at a time (so messages arrive in order), every SEND_INTERVAL."""

    def __init__(self, rank: int, channel: Any) -> None:  # not the local context's: no pipe here
        self.rank = rank
        self.channel = channel
        self.lock = threading.Condition()
        self._pending: list[bytes] = []
        self._closing = False
        self._thread = threading.Thread(target=self._send_loop, name="ddpnb-link", daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            self._pending.append(data)
            self.lock.notify()

    def send_metric(self, step: int | None, values: dict[str, float]) -> None:
        self.send(msg.Metric(rank=self.rank, step=step, time=time.time(), values=values))

    def _send_loop(self) -> None:
        import ray

        while True:
            with self.lock:
                self.lock.wait_for(lambda: self._pending or self._closing)
                batch, self._pending = self._pending, []
                closing = self._closing
            if batch:
                try:
                    ray.get(self.channel.put.remote(batch))
                except ray.exceptions.RayActorError:  # the run is over (stopped, or the kernel went away)
                    return
            if closing and not batch:
                return
            if not closing:
                time.sleep(SEND_INTERVAL)

    def close(self) -> None:
        """Deliver what is pending (a finished rank's last lines and result), then stop."""
        with self.lock:
            self._closing = True
            self.lock.notify()
        self._thread.join(CLOSE_WAIT)


class _Capture:
    """Fds 1 and 2 of this worker go through pipes while the rank runs, so C/C++ writes are captured too. Each
    chunk goes to the kernel, tagged with the rank, and on to where the fd pointed before: Ray's worker log."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, name in ((1, "stdout"), (2, "stderr")):
            read_end, write_end = os.pipe()
            self._saved[fd] = os.dup(fd)
            os.dup2(write_end, fd)
            os.close(write_end)
            thread = threading.Thread(target=self._forward, args=(read_end, self._saved[fd], name),
                                      name=f"ddpnb-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)

    def _forward(self, read_end: int, original: int, name: str) -> None:
        try:
            while data := os.read(read_end, 1 << 16):
                self.link.send(Output(self.link.rank, name, data))
                _write_all(original, data)
        finally:
            os.close(read_end)

    def close(self) -> None:
        """Put the fds back; the pipes' last write ends close, so the forwarders read to the end and stop."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, original in self._saved.items():
            os.dup2(original, fd)
        for thread in self._threads:
            thread.join(CLOSE_WAIT / 2)  # longer only if a child process still holds the pipe (then: it keeps it)
        if not any(thread.is_alive() for thread in self._threads):
            for original in self._saved.values():
                os.close(original)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:  # Ray's log file went away: the kernel still has the output
        return


def _serve_commands(link: _Link, channel: Any, finished: threading.Event, training_thread: int) -> None:
    """Long-poll the run actor for commands from the kernel. If the run actor is gone, so is the run: a rank
    still going then ends itself, as a local rank does when the kernel dies."""
    import ray

    seen = 0
    while not finished.is_set():
        try:
            seen, command = ray.get(channel.next_command.remote(seen, COMMAND_POLL))
        except ray.exceptions.RayActorError:
            if not finished.is_set():
                os.kill(os.getpid(), signal.SIGKILL)
            return
        if command == "stacks":
            link.send(Stacks(rank=link.rank, text=_stack_of(training_thread)))


def _stack_of(thread_id: int) -> str:
    """The training thread's Python stack, from the user's function down (Ray's and ddpnb's frames left out)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame)
    skip = (os.path.dirname(_worker.__file__), os.path.dirname(importlib.util.find_spec("ray").origin or ""),
            os.path.dirname(threading.__file__))
    user = [i for i, entry in enumerate(frames) if not entry.filename.startswith(skip)]
    kept = frames[user[0]:] if user else frames
    return "Stack of the training thread (most recent call last):\n" + "".join(traceback.format_list(kept))
