"""The interface between a `Run` and the engine that runs its ranks (in the spirit of torch elastic's `PContext`).

An engine moves bytes and processes: it starts the ranks, reads what they send, signals them, and says when each
has ended. Everything a run *means* (the record, failures and their root cause, the stop deadline, the result,
the views) is the `Run`'s, written once for every engine. All engine calls but `start` come from the run's reader
thread, inside `serve`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ddpnb.core.messages import Message
from ddpnb.core.spec import EngineKind, Plan, Stream, WorkerSpec

if TYPE_CHECKING:
    from ddpnb.core.shared import Shipment


class RunEvents(Protocol):
    """What an engine tells its run, from inside `Engine.serve`."""

    def placed(self, rank: int, pid: int | None, node: str = "") -> None:
        """The rank's process exists (locally: forked; on Ray: placed on a node)."""

    def message(self, rank: int, message: Message) -> None:
        """A typed message the rank sent."""

    def output(self, rank: int, stream: Stream, data: bytes) -> None:
        """Raw bytes the rank wrote to its stdout or stderr."""

    def exited(self, rank: int, exitcode: int | None, *, stopped: bool = False, cause: str = "",
               traceback: str = "") -> None:
        """The rank has ended. `stopped`: by the engine's stop, not by itself; `cause`: why it failed, where the
        engine knows better than its exit code (Ray Train's own account)."""

    def restarts_left(self) -> int:
        """How many more times the run may restart its ranks (`--max-restarts`), for an engine that restarts them
        itself (Ray Train's FailureConfig)."""

    def restarted(self) -> bool:
        """The engine started every rank again itself after a failure, once the failed attempt's ranks have all
        `exited`: the run opens a new attempt. False: the run may not restart, and the engine must stop."""

    def tick(self) -> None:
        """Called after every wake-up of the engine's loop: the run checks its stops, timeout and announcements."""

    def quiet(self) -> bool:
        """Whether nothing is ending and no answer is awaited soon: no rank has returned or failed, no stop
        began, no session command was just sent. An engine may then wait longer between two reads (local:
        COALESCE) without delaying anything that matters."""


class Engine(Protocol):
    """One run's ranks on one engine."""

    kind: EngineKind
    stop_wait: float  # seconds `Run.stop()` waits for the ranks to be gone
    maps_results: bool  # rank 0 can write a result holding tensors into the kernel's memory file
    announce_every: float  # seconds between two announcements of output to the views (a rank's turn: at once)

    def start(self, events: RunEvents, result_fd: int | None, shared: Shipment | None = None) -> None:
        """Start every rank, or raise with nothing left running. `shared`: where the spec's big tensors and arrays
        go (pickle the spec with it, and give every rank its `fds()`), where the engine type `maps_data`."""

    def serve(self) -> None:
        """Read what the ranks send, delivering it to `events`, until every rank has ended."""

    def stop(self, ranks: list[int], failed: bool) -> float | None:
        """Begin stopping `ranks` (`failed`: because a rank failed). Returns seconds until `escalate`, or None."""

    def escalate(self) -> float | None:
        """Stop harder (SIGKILL; kill the run's actor). Returns seconds until the next escalation, or None."""

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """`ranks`' Python stacks now, from the user's code down, by rank (one that sent none in time is missing);
        they are the caller's, never the record's."""

    def send(self, ranks: list[int], command: bytes, shared: Any = None) -> None:
        """Sessions: deliver one command to each of `ranks` (any thread; the ranks answer with `Reply`), with
        the shipment its pickle refers to (`EngineType.shipment`)."""

    def interrupt(self, ranks: list[int]) -> None:
        """Sessions: raise KeyboardInterrupt in the command `ranks` are running (any thread)."""

    def close(self) -> None:
        """Release everything, the `events` given to `start` included; nothing of the run may outlive this."""


class EngineType(Protocol):
    """What the API asks of an engine before a run exists: its own checks, GPU count and environment."""

    kind: EngineKind
    maps_data: bool  # ranks can map memory files the kernel writes (`core.shared`): notebook data goes that way

    def check(self, address: str | None, placement: str | None) -> dict[str, Any]:
        """The engine's options from the user's, or LaunchError."""

    def shipment(self) -> Shipment | None:
        """Where a launch's big notebook tensors and arrays go instead of the pickle (`core.shared.Shipment`, or
        an engine's own with the same `reduce_tensor`, `reduce_array`, `fds` and `commit`); None: the pickle."""

    def gpus_available(self) -> int | None:
        """GPUs `--gpus` can use here; None where the cluster places the ranks."""

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """The ranks' environment: what they inherit, plus `env`."""

    def torch_threads(self, plan: Plan, environ: dict[str, str]) -> int | None:
        """CPU threads per rank, or None to leave torch's choice."""

    def create(self, spec: WorkerSpec, timeout: float | None, options: dict[str, Any]) -> Engine:
        """The engine for one run."""
