"""The run actor, on the Ray cluster: one per run, it hosts Ray Train's `TorchTrainer.fit()` and the channel
between the ranks and the kernel."""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

from ddpnb import _compat
from ddpnb.engines.ray.rank import rank_main

TRAIN_STORAGE = os.path.join(tempfile.gettempdir(), "ddpnb-ray-train")  # Ray Train's per-run directories


@dataclass(frozen=True)
class FitRequest:
    name: str
    spec_payload: bytes
    world_size: int
    use_gpus: bool
    backend: str
    placement: str
    group_timeout_s: int
    versions: dict[str, str] = field(default_factory=dict)
    max_failures: int = 0  # Ray Train restarts the workers itself this many times (FailureConfig; v2 only)
    checkpoint_dir: str = ""  # the run's checkpoints: Ray Train's storage where it restarts the workers
    data: dict[int, Any] = field(default_factory=dict)  # the notebook data's object references (`data.py`)


@dataclass(frozen=True)
class NewAttempt:
    """In the channel, between two attempts' messages: Ray Train restarted every rank after `rank_errors`."""

    restarts: int  # restarts Ray Train made in this fit so far
    rank_errors: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FitOutcome:
    error: str = ""  # Ray Train's error when fit() raised
    rank_errors: dict[int, str] = field(default_factory=dict)  # Ray Train's per-rank errors (a worker that died)


class RunActor:
    """One per run: hosts `TorchTrainer.fit()` and the channel between the ranks and the kernel.

    A threaded actor: `fit` runs for the whole run while ranks `put` and long-poll `next_command` and the kernel
    `drain`s and `request`s. Messages are kept as the ranks pickled them; only the kernel unpickles them.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._inbox: list[bytes | NewAttempt] = []
        self._commands: list[str] = []
        # sessions: each rank's commands, with their data's object references
        self._cells: dict[int, collections.deque[tuple[bytes, dict[int, Any]]]] = collections.defaultdict(
            collections.deque
        )
        self._controller: Any = None  # Ray Train's controller, once it announced itself
        self._fit_started = False
        self._announcing = False  # Ray Train v2: the controller announces itself (`_AnnounceController`)
        self._abort_requested = False
        self._restarts = 0  # Ray Train's restarts of the workers in this fit (FailureConfig)
        self._joined: set[int] = set()  # the ranks of the current attempt that started
        self._restarting: dict[int, str] | None = None  # Ray Train restarts the workers after these ranks' errors

    def join(self, rank: int) -> int:
        """A rank starts: how many times Ray Train restarted the workers before it. The first rank of a new
        attempt puts the `NewAttempt` mark in the channel: every rank of the attempt before is gone by then."""
        with self._lock:
            if self._restarting is not None or rank in self._joined:
                self._restarts += 1
                self._inbox.append(NewAttempt(self._restarts, self._restarting or {}))
                self._joined, self._restarting = set(), None
            self._joined.add(rank)
            return self._restarts

    def restarting(self, rank_errors: dict[int, str]) -> None:
        """Ray Train's controller is restarting the workers after these ranks' errors."""
        with self._lock:
            self._restarting = rank_errors

    def put(self, batch: list[bytes]) -> None:
        with self._lock:
            self._inbox.extend(batch)

    def drain(self) -> list[bytes | NewAttempt]:
        with self._lock:
            batch, self._inbox = self._inbox, []
        return batch

    def request(self, command: str) -> None:
        with self._lock:
            self._commands.append(command)
            self._lock.notify_all()

    def send_cell(self, ranks: list[int], command: bytes, data: dict[int, Any] | None = None) -> None:
        """Sessions: a command for each of `ranks`, taken by the rank's `next_cell`, with the object references of
        its notebook data (`data.py`): nested in a dict, they travel as references, not fetched here."""
        with self._lock:
            for rank in ranks:
                self._cells[rank].append((command, data or {}))
            self._lock.notify_all()

    def next_cell(self, rank: int, wait: float) -> tuple[bytes, dict[int, Any]] | None:
        with self._lock:
            self._lock.wait_for(lambda: bool(self._cells[rank]), timeout=wait)
            return self._cells[rank].popleft() if self._cells[rank] else None

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

    def fit(self, request: FitRequest) -> FitOutcome:
        import ray
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"  # ranks print to their fds, which ddpnb captures
        me = ray.get_runtime_context().current_actor
        callbacks = _announce_controller_to(me) if _compat.ray_train_v2() else []
        # Ray Train v1 reserves a CPU for its coordinator by default: a 2-CPU machine could not run 2 ranks
        coordinator = {} if _compat.ray_train_v2() else {"trainer_resources": {"CPU": 0}}
        native = request.max_failures > 0  # the kernel asks for it on Ray Train v2 only (`RayEngine.start`)
        if native:  # Ray Train's storage is the run's checkpoint directory: the checkpoints ranks report live there
            storage, name = os.path.split(os.path.normpath(request.checkpoint_dir))
        else:  # Ray Train v1: ddpnb reports no checkpoints to it, and restarts the ranks itself
            storage, name = TRAIN_STORAGE, request.name
        trainer = TorchTrainer(
            rank_main,
            train_loop_config={
                "spec": request.spec_payload,
                "channel": me,
                "versions": request.versions,
                "report_checkpoints": native,
                "data": request.data,
            },
            scaling_config=ScalingConfig(
                num_workers=request.world_size,
                use_gpu=request.use_gpus,
                placement_strategy=request.placement,
                **coordinator,
            ),
            torch_config=TorchConfig(backend=request.backend, timeout_s=request.group_timeout_s),
            run_config=RunConfig(
                name=name,
                storage_path=storage,
                failure_config=FailureConfig(max_failures=request.max_failures),
                # ddpnb keeps the newest K itself (`rank.checkpoint._prune`)
                checkpoint_config=CheckpointConfig(num_to_keep=None),
                **({"callbacks": callbacks} if callbacks else {}),
            ),
        )
        with self._lock:
            if self._abort_requested:
                return FitOutcome(error="stopped before it started")
            self._fit_started, self._announcing = True, bool(callbacks)
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 - Ray Train's account of a failed run goes to the kernel as data
            failures = getattr(exc, "worker_failures", None) or {}
            return FitOutcome(
                error=_describe_error(exc),
                rank_errors={int(rank): _describe_error(error).splitlines()[0] for rank, error in failures.items()},
            )
        finally:
            if not native:
                shutil.rmtree(os.path.join(TRAIN_STORAGE, request.name), ignore_errors=True)
        return FitOutcome()


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _announce_controller_to(run_actor: Any) -> list[Any]:
    """A Ray Train v2 controller callback that hands the controller to the run actor as it starts, so a stop can
    use the controller's own abort (Ray Train v1 has no such controller), and tells it when the controller restarts
    the workers (FailureConfig) and after which ranks' errors."""

    class AnnounceController(_compat.ray_controller_callback()):  # type: ignore[misc]
        def __init__(self, run_actor: Any) -> None:
            self.run_actor = run_actor

        def after_controller_start(self, train_run_context: Any) -> None:
            import ray

            self.run_actor.set_controller.remote(ray.get_runtime_context().current_actor)

        def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
            error = _compat.ray_restart_failure(current_state)
            if error is not None:  # FailureConfig: Ray Train restarts the workers; the kernel learns who failed
                failures = getattr(error, "worker_failures", None) or {}
                self.run_actor.restarting.remote(
                    {int(rank): _describe_error(failure).splitlines()[0] for rank, failure in failures.items()}
                )

    return [AnnounceController(run_actor)]
