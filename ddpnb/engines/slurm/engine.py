"""The slurm engine, kernel side: one `srun` job step per attempt inside the kernel's allocation, one task per node
(outside one, inside a job asked for with `salloc` for the attempt: `submit.py`). That task is the node's host
(`host.py`): it forks the node's ranks from its forkserver, which imports torch once per node, maps the notebook
data into them from memory files it received once per node, and relays their events.

The kernel listens on the address the allocation's nodes reach it at (port 0), and only for this attempt; the
step's stdin gives every host that address and a fresh secret, and each connects proving it (HMAC, through
`multiprocessing.connection`). Everything of the run travels on those connections: setup and data out; each rank's
output, messages and end back, in the order its node's reader saw them. The reader thread (`serve`) multiplexes
the connections, srun's pipes (the hosts' own words, and srun's account of a host's end: `step.py`) and new
arrivals with one selector. A host whose connection ends before it said its ranks ended was lost with its node: its
ranks failed, saying so. Stopping: each host signals its ranks (SIGTERM, then SIGKILL); `close` shuts the
connections, which ends every host and what it forked, and cancels the step (`scancel`) if anything of it is still
there.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

from ddpnb.core import pickling
from ddpnb.core.engine import AttemptStart, Capabilities, Flag, RunEvents
from ddpnb.core.spec import LaunchError, Plan, WorkerSpec
from ddpnb.engines.slurm import allocation, detach, submit
from ddpnb.engines.slurm.options import SlurmOptions
from ddpnb.engines.slurm.step import SRUN_WAIT, SrunStep, command
from ddpnb.node import forked
from ddpnb.node.rank import Seat
from ddpnb.node.shared import MemoryShipment
from ddpnb.remote.connections import HostConnections, HostLink

STOP_GRACE = forked.STOP_GRACE  # seconds between a host's SIGTERM and SIGKILL to its ranks
STACK_WAIT = forked.STACK_WAIT + 2.0  # seconds hosts get to send their ranks' stacks
DRAIN_WAIT = 2.0  # seconds a host's last events may trail srun's report of its end
COALESCE = forked.COALESCE  # seconds between two wake-ups of the reader while every rank is busy (see `serve`)


class SlurmType:
    """The slurm engine before a run: srun on PATH, and the kernel inside a running allocation, or salloc to ask
    for one."""

    name: ClassVar[str] = "slurm"
    # ranks on other nodes: notebook data travels once per node, results pickled, on the channel; no run directory
    # in common
    capabilities: ClassVar[Capabilities] = Capabilities(
        commands=True, announce_every=COALESCE, stop_wait=STOP_GRACE + STACK_WAIT + SRUN_WAIT + 5
    )
    Options: ClassVar[type] = SlurmOptions
    flags: ClassVar[list[Flag]] = [
        Flag(
            "--nodes",
            metavar="N",
            help="with --engine slurm: spread the ranks over N nodes (inside an allocation, default: all it holds, "
            "at most one per rank).",
        ),
        Flag(
            "--srun-args",
            metavar="'ARGS'",
            help="with --engine slurm: more srun options for the ranks' job step, quoted as one argument "
            "(e.g. --srun-args '--cpus-per-task=4 --mem=8G').",
        ),
        Flag(
            "--partition",
            metavar="NAME",
            help="with --engine slurm outside an allocation: the partition of the job ddpnb asks for (salloc).",
        ),
        Flag(
            "--time",
            metavar="LIMIT",
            help="with --engine slurm outside an allocation: the job's time limit, as salloc takes it (30, 2:00:00).",
        ),
        Flag("--account", metavar="NAME", help="with --engine slurm outside an allocation: the job's account."),
        Flag("--qos", metavar="NAME", help="with --engine slurm outside an allocation: the job's quality of service."),
        Flag(
            "--constraint",
            metavar="FEATURES",
            help="with --engine slurm outside an allocation: node features the job needs (salloc --constraint).",
        ),
        Flag(
            "--job-args",
            metavar="'ARGS'",
            help="with --engine slurm outside an allocation: more salloc options for the job, quoted as one "
            "argument (e.g. --job-args '--mem=16G --exclusive').",
        ),
    ]

    def check(self, options: SlurmOptions) -> None:
        allocation.srun_path()
        if allocation.inside():
            job = allocation.current()
            if options.submits:
                given = ", ".join(f"--{name.replace('_', '-')}" for name in options.submits)
                raise LaunchError(
                    f"{given}: options of a job ddpnb asks for outside an allocation, and this kernel "
                    f"runs inside Slurm job {job.job}, whose nodes the ranks use. Leave them out, or "
                    "pass srun options for the step with --srun-args."
                )
        else:
            submit.salloc_path()

    def shipment(self) -> MemoryShipment:
        return MemoryShipment()  # memory files in the kernel, sent once to each node's host (`wire.send_data`)

    def gpus_available(self) -> int | None:
        return None

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        return dict(env)  # srun gives the tasks the kernel's environment (--export=ALL); the spec adds `env`

    def torch_threads(self, plan: Plan, environ: dict[str, str]) -> int | None:
        return None  # each rank takes its share of its node's CPUs in the step (`host._threads_per_rank`)

    def create(self, spec: WorkerSpec, options: SlurmOptions) -> SlurmEngine:
        return SlurmEngine(spec, options)

    def supervisor_home(self, options: SlurmOptions, spec: WorkerSpec) -> detach.BatchHome | None:
        """`--detach`: outside an allocation, a batch job of the run's own (`detach.py`); inside one, None: a
        process of its own on this node, as the local engine's, which lives as long as the allocation."""
        if allocation.inside():
            return None
        return detach.BatchHome(options, spec.world_size, spec.use_gpus)


class SlurmEngine:
    """One attempt's ranks, forked by the hosts of one srun step (a task per node), over the remote layer's
    channel (`ddpnb.remote`); this class does Slurm's part: the job, its step (`step.SrunStep`: srun and its lines),
    the ranks of hosts the step lost."""

    def __init__(self, spec: WorkerSpec, options: SlurmOptions) -> None:
        self.spec = spec
        self.options = options
        self.world_size = spec.world_size
        self._events: RunEvents | None = None
        self._conns = HostConnections(self.world_size, spec.run_dir, self._seats, where="Slurm node")
        self._step: SrunStep | None = None  # once the job runs
        self._closing = False  # `close` began: srun's stop noise is not news, and no step is tried again
        self._own_job: submit.OwnJob | None = None  # outside an allocation: the job asked for this attempt

    # --- start -------------------------------------------------------------------------------------------------
    def start(self, events: RunEvents, start: AttemptStart) -> None:
        """The step on the allocation the kernel runs in, or on a job of the run's own: one kept from the run
        before or granted at once starts the step now; one that waits in the queue, once it runs (`serve`)."""
        self._events = events
        allocation.srun_path()
        try:
            payload = pickling.dump_spec(self.spec, start.shipment)  # first: args that cannot be sent
            data = start.shipment.fds() if isinstance(start.shipment, MemoryShipment) else {}
            self._conns.start(events, payload, data, start.commands)
            job = allocation.current() if allocation.inside() else self._ask_for_job()
            if job is not None:
                self._launch(job)
        except BaseException:
            self.close()
            raise

    def _launch(self, job: allocation.Allocation) -> None:
        """The step: a host per node, each given the door's address and the secret on srun's stdin."""
        counts = allocation.spread(job, self.world_size, self.options.nodes, self.options.srun_args or "")
        invitation = self._conns.listen(allocation.reachable_address(job.nodes[0]), counts)
        assert self._events is not None
        self._step = SrunStep(
            command(job, counts, self.spec, self.options.srun_args or ""),
            invitation,
            self._events,
            self._conns,
            quiet=lambda: self._conns.stopping or self._closing,
        )
        self._conns.hosts.open()  # a session's commands sent while the job waited go first, in order

    def _seats(self, link: HostLink, master: tuple[str, int]) -> list[Seat]:
        """A node's seats, with the variables srun gives each task of a step."""
        return [
            Seat(
                rank,
                local,
                len(link.ranks),
                "",
                link.index,
                *master,
                local if self.spec.use_gpus else None,
                {
                    "SLURM_PROCID": str(rank),
                    "SLURM_LOCALID": str(local),
                    "SLURM_NTASKS": str(self.world_size),
                    "SLURM_STEP_NUM_TASKS": str(self.world_size),
                },
            )
            for local, rank in enumerate(link.ranks)
        ]

    def _ask_for_job(self) -> allocation.Allocation | None:
        """Outside an allocation: a job of this attempt's own, for its ranks. A job kept from the run before, or
        one granted at once, is returned; None: it waits in the queue (`_await_job`)."""
        request = submit.JobRequest(
            name=f"ddpnb-{Path(self.spec.run_dir).name}",
            tasks=self.spec.world_size,
            gpus=self.spec.use_gpus,
            options=self.options,
        )
        kept = submit.take_kept(request)
        if kept is not None:
            self._own_job = kept
            print(f"[ddpnb] slurm job {kept.job}, kept from the run before, runs this one too", flush=True)
            return allocation.describe(kept.job)
        self._own_job = submit.OwnJob(request)
        self._own_job.ask()
        return allocation.describe(self._own_job.job) if self._own_job.granted else None

    def _await_job(self) -> bool:
        """The run's own job waits in the queue: say its state to the run, then start the step once it runs (True).
        False where every rank ended before: the run was stopped (the job is cancelled with `close`), or Slurm
        ended the job in the queue, or the step could not start on it."""
        events, job = self._events, self._own_job
        assert events is not None and job is not None
        said = job.state() or "pending"
        events.queued(job.what, said)  # at once: no clock of the run's runs from now on
        try:
            while not self._conns.stopping and not job.granted_within(submit.POLL):
                state = job.state()
                if state and state != said:
                    events.queued(job.what, state)
                    said = state
                events.tick()  # a stop, the views
        except LaunchError as exc:
            return self._never_started(stopped=False, cause=f"{job.what} ended in the queue: {exc}")
        finally:
            events.queued(job.what, "")
        if self._conns.stopping:
            return self._never_started(stopped=True)
        try:
            self._launch(allocation.describe(job.job))
        except (LaunchError, OSError) as exc:
            return self._never_started(stopped=False, cause=f"could not start on {job.what}: {exc}")
        return True

    def _never_started(self, stopped: bool, cause: str = "") -> bool:
        assert self._events is not None
        for rank in range(self.world_size):
            self._events.exited(rank, None, stopped=stopped, cause=cause)
        return False

    # --- the reader --------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Read the hosts' connections, srun's pipes and new arrivals until every rank has ended and srun with
        them. While every rank is busy, wake-ups are COALESCE apart (the views redraw no more often)."""
        events, conns = self._events, self._conns
        assert events is not None
        try:
            if self._step is None and not self._await_job():
                return
            step = self._step
            assert step is not None
            last_wake = 0.0
            while True:
                woken = time.monotonic()
                if woken - last_wake < COALESCE and events.quiet() and step.running():
                    time.sleep(COALESCE - (woken - last_wake))
                last_wake = time.monotonic()
                conns.read_ready(0.1)
                self._settle()
                events.tick()
                if conns.hosts.all_ended() and step.done_at is not None:
                    break
        finally:
            conns.selector.close()

    def _settle(self) -> None:
        """End the ranks no host will report: a host that hung up before its ranks ended (its node lost), one srun
        said ended whose last words did not come, or one that never came (the step did not start)."""
        step, conns, now = self._step, self._conns, time.monotonic()
        assert step is not None
        if step.tried_again(now):
            return
        srun_done = step.done_at is not None
        for link in conns.links:
            said = step.task_ended.get(link.index)
            drained = said is not None and now - said[1] > DRAIN_WAIT
            if link.hello is None and (srun_done or drained):
                why = "; ".join(step.said[-3:]) or (said or ("srun exited",))[0]
                conns.hosts.lose(conns.hosts.left(link.index), f"did not start: {why}", stopped=conns.stopping, code=1)
            elif link.hello is not None and (link.closed_at is not None or drained):
                how = f": {said[0]}" if said else ""
                conns.hosts.lose(
                    conns.hosts.left(link.index),
                    f"its Slurm node {link.name} was lost (ddpnb's host there ended{how})",
                    stopped=conns.stopping,
                )
        if (
            conns.hosts.all_ended()
            and not srun_done
            and all(
                link.closed_at is not None and now - link.closed_at > SRUN_WAIT
                for link in conns.links
                if link.hello is not None
            )
        ):
            step.cancel()  # every rank ended, but srun waits for something that holds the step

    # --- stopping, stacks and commands ------------------------------------------------------------------------------
    def stop(self, ranks: list[int], failed: bool) -> float | None:
        self._conns.stop(ranks)
        return STOP_GRACE

    def escalate(self) -> float | None:
        """SIGKILL from each host to its ranks; hosts that never came are ended with the step."""
        if not self._conns.escalate() and self._step is not None:
            self._step.cancel()
        return None

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        return self._conns.collect_stacks(ranks, STACK_WAIT)

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        self._conns.send(ranks, command, shipment)

    def interrupt(self, ranks: list[int]) -> None:
        self._conns.interrupt(ranks)

    def close(self) -> None:
        """Every connection closed (each host then ends its ranks and itself), srun gone, the door shut, the step
        cancelled if anything of it is left."""
        self._closing = True
        self._conns.close()
        if self._step is not None:
            self._step.close()
        self._conns.shut_door()
        if self._own_job is not None:  # the step is gone: the job waits a moment for the next launch, then goes back
            self._own_job.park()
            self._own_job = None
        self._events = None  # the run and its value go with the caller's last reference, not at the next gc
