"""What an engine implements, and what it tells the attempt it runs (in the spirit of torch elastic's `PContext`).

An engine moves bytes and processes: it starts one attempt's ranks, reads what they send, signals them, and says
when each has ended. What a run *means* (the record, failures and their root cause, the stop deadline, restarts,
the result, the views) is core's, written once for every engine. Everything specific to an engine (its options
and magic flags, its checks, how it places ranks) lives in its own package under `engines/`, found by name in
the registry (`ddpnb.engines`). All `Engine` calls but `start`, `send` and `interrupt` come from the attempt's
reader thread, inside `serve`. Adding an engine: see docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ddpnb.core.messages import Message
from ddpnb.core.spec import Plan, Stream, WorkerSpec

if TYPE_CHECKING:
    from ddpnb.core.data import Shipment


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond starting, reading and stopping ranks; core asks these, never the engine's name."""

    shares_memory: bool = False  # ranks map memory files the kernel writes: notebook data in, rank 0's result out
    shares_run_dir: bool = False  # ranks write into the kernel's run directory (NCCL's flight recorder dumps)
    commands: bool = False  # a command channel to running ranks (`Engine.send`, `interrupt`): sessions
    announce_every: float = 0.2  # seconds between two announcements of output to the views (a rank's turn: at once)
    stop_wait: float = 10.0  # seconds `Run.stop()` waits for the ranks to be gone
    ranks_here: bool = False  # every rank is a process of this machine: its CPUs and process limit bound them


@dataclass(frozen=True)
class Flag:
    """One of an engine's options as a magic flag (`--address`): its option is the flag's name without the dashes,
    `-` read as `_`. Plain data, so the engine imports no IPython; the magics build their parser from it."""

    name: str
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | list[str] | None = None

    @property
    def option(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class AttemptStart:
    """What one attempt's `Engine.start` is given."""

    result_fd: int | None = None  # the kernel's memory file for rank 0's result (engines that share memory)
    shipment: Shipment | None = None  # where the spec's big tensors and arrays go (`EngineType.shipment`)
    commands: bool = False  # open the command channel (a session's ranks)
    restarts: int = 0  # restarts the engine may make itself (Ray Train's FailureConfig), from the run's policy


class RunEvents(Protocol):
    """What an engine tells the attempt it runs, from inside `Engine.serve`. Events only: an engine never asks."""

    def placed(self, rank: int, pid: int | None, node: str = "") -> None:
        """The rank's process exists (locally: forked; on a cluster: placed on a node)."""

    def message(self, rank: int, message: Message) -> None:
        """A typed message the rank sent."""

    def output(self, rank: int, stream: Stream, data: bytes) -> None:
        """Raw bytes the rank wrote to its stdout or stderr (b"": the stream ended)."""

    def exited(
        self, rank: int, exitcode: int | None, *, stopped: bool = False, cause: str = "", traceback: str = ""
    ) -> None:
        """The rank has ended. `stopped`: by the engine's stop, not by itself; `cause`: why it failed, where the
        engine knows better than its exit code (Ray Train's own account)."""

    def restarted(self) -> None:
        """The engine started every rank again itself (within `AttemptStart.restarts`), once the failed attempt's
        ranks have all `exited`. The run keeps that attempt and opens the next; where its policy says the run ends
        after all (a stop was asked meanwhile), it stops the new ranks through `Engine.stop`."""

    def queued(self, what: str, state: str) -> None:
        """The ranks wait for resources the engine asked for (`what`, 'slurm job 1234', is in its cluster's queue),
        `state` in the engine's words ('pending (Priority)'), said again when it changes; `state` '' once they no
        longer wait. Meanwhile neither the timeout's clock runs nor is the quiet a stall, and a stop cancels it."""

    def tick(self) -> None:
        """Called after every wake-up of the engine's loop: the attempt checks its stop, watchdog and announcements."""

    def quiet(self) -> bool:
        """Whether nothing is ending and no answer is awaited soon. An engine may then wait longer between two
        reads (local: COALESCE) without delaying anything that matters."""


class Engine(Protocol):
    """One attempt's ranks on one engine."""

    def start(self, events: RunEvents, start: AttemptStart) -> None:
        """Start every rank, or raise with nothing left running. Pickle the spec with `start.shipment` and give
        every rank what it refers to. An engine whose resources wait in a queue may return once they are asked
        for, and start the ranks from `serve` when they come (`RunEvents.queued`)."""

    def serve(self) -> None:
        """Read what the ranks send, delivering it to `events`, until every rank has ended."""

    def stop(self, ranks: list[int], failed: bool) -> float | None:
        """Begin stopping `ranks` (`failed`: because a rank failed). Returns seconds until `escalate`, or None."""

    def escalate(self) -> float | None:
        """Stop harder (SIGKILL; kill the run's actor). Returns seconds until the next escalation, or None."""

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """`ranks`' Python stacks now, from the user's code down, by rank (one that sent none in time is missing)."""

    def send(self, ranks: list[int], command: bytes, shipment: Shipment | None = None) -> None:
        """Capabilities.commands: deliver one command to each of `ranks` (any thread), with the shipment its
        pickle refers to; the rank side's `Link.receive` returns `command` with that data in place."""

    def interrupt(self, ranks: list[int]) -> None:
        """Capabilities.commands: raise KeyboardInterrupt in the command `ranks` are running (any thread)."""

    def close(self) -> None:
        """Release everything, the `events` given to `start` included; nothing of the attempt may outlive this."""


class EngineType(Protocol):
    """An engine before a run: its name, options, magic flags, capabilities and checks (see `ddpnb.engines`)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type]  # a frozen dataclass of the engine's own options (`ddpnb.run(..., **options)`)
    flags: ClassVar[list[Flag]]  # those options' magic flags (`%%ddp --address ...`)

    def check(self, options: Any) -> None:
        """Raise LaunchError where the options, or this kernel, cannot run the engine (before anything starts)."""

    def shipment(self) -> Shipment | None:
        """Where a launch's big notebook tensors and arrays go instead of the pickle; None: in the pickle."""

    def gpus_available(self) -> int | None:
        """GPUs `--gpus` can use here; None where the cluster places the ranks."""

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """The ranks' environment: what they inherit, plus `env`."""

    def torch_threads(self, plan: Plan, environ: dict[str, str]) -> int | None:
        """CPU threads per rank, or None to leave torch's choice."""

    def create(self, spec: WorkerSpec, options: Any) -> Engine:
        """The engine for one attempt (a fresh one per attempt)."""

    # optional: `supervisor_home(options, spec) -> SupervisorHome | None` where a detached run's supervisor must
    # live out of this machine's reach (a batch job, a detached actor); without it, or None, a process of its own
    # on this machine; and `served_runs() -> list`, the detached runs its supervisors serve to viewers that do not
    # see their run directories (each with `ddpnb.detached.files.RunSource`'s methods), for `ddpnb.runs()`


class SupervisorHome(Protocol):
    """Where an engine keeps a detached run's supervisor (`--detach`), out of the kernel's reach: a Slurm batch job,
    a detached Ray actor. There it runs `ddpnb.detached.supervisor.main(run_dir)` (`python -m
    ddpnb.detached.supervisor RUN_DIR`), which reads the plan the kernel wrote into the run directory, owns the run,
    and says it started (or why not) in that directory, which the kernel must be able to read."""

    def start(self, run_dir: str) -> str:
        """Start the supervisor for the run in `run_dir`; a line saying where (the job, the actor) for its notes.
        Raise LaunchError, saying why, where it cannot be started."""

    def alive(self, run_dir: str) -> bool | None:
        """Whether that supervisor still runs, or waits to (in a queue), as the platform says; None where it
        cannot tell. The home is pickled into the run directory: any later kernel asks it too."""

    # optional: `source(run_dir)`, where a viewer reads the run when the kernel does not see the supervisor's run
    # directory (a `ddpnb.detached.files.RunSource`; None where it does); `waiting(run_dir) -> str`, what it waits for while it cannot start yet ('slurm job 12 pending
    # (Priority)'; '' once it can): the launch says it and waits with no deadline; and `end(run_dir)`, ending it
    # by the platform's means (scancel), for a stop whose door cannot be reached and a launch that gave up
