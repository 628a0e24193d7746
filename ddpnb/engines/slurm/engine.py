"""The slurm engine, kernel side: one `srun` job step per attempt inside the kernel's allocation, one task per node
(outside one, inside a job asked for with `salloc` for the attempt: `submit.py`). That task is the node's host
(`host.py`): it forks the node's ranks from its forkserver, which imports torch once per node, maps the notebook
data into them from memory files it received once per node, and relays their events.

The kernel listens on the address the allocation's nodes reach it at (port 0), and only for this attempt; the
step's stdin gives every host that address and a fresh secret, and each connects proving it (HMAC, through
`multiprocessing.connection`). Everything of the run travels on those connections: setup and data out; each rank's
output, messages and end back, in the order its node's reader saw them. The reader thread (`serve`) multiplexes
the connections, srun's pipes (the hosts' own words, and srun's account of a host's end) and new arrivals with one
selector. A host whose connection ends before it said its ranks ended was lost with its node: its ranks failed,
saying so. Stopping: each host signals its ranks (SIGTERM, then SIGKILL); `close` shuts the connections, which
ends every host and what it forked, and cancels the step (`scancel`) if anything of it is still there.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from ddpnb.core import pickling
from ddpnb.core.engine import AttemptStart, Capabilities, Flag, RunEvents
from ddpnb.core.spec import LaunchError, Plan, Stream, WorkerSpec
from ddpnb.engines.slurm import allocation, detach, submit
from ddpnb.engines.slurm.options import SlurmOptions
from ddpnb.node import forked
from ddpnb.node.rank import Seat
from ddpnb.node.shared import MemoryShipment
from ddpnb.remote.connections import HostConnections, HostLink

STOP_GRACE = forked.STOP_GRACE  # seconds between a host's SIGTERM and SIGKILL to its ranks
STACK_WAIT = forked.STACK_WAIT + 2.0  # seconds hosts get to send their ranks' stacks
DRAIN_WAIT = 2.0  # seconds a host's last events may trail srun's report of its end
SRUN_WAIT = 5.0  # seconds srun gets to exit once the hosts were told to end, before the step is cancelled
COALESCE = forked.COALESCE  # seconds between two wake-ups of the reader while every rank is busy (see `serve`)
# what srun runs on each node: `-c` rather than `-m`, whose runpy frames would head every stack a rank sends (a
# stack is shown from the first frame that is not ddpnb's or a library's; "<string>" starts local ranks too)
HOST_MAIN = "from ddpnb.engines.slurm.host import main; main()"
# srun's account of a task's end (src/srun: `_task_finish`): "srun: error: n2: task 1: Killed",
# "srun: error: n1: tasks 0-1: Exited with exit code 5"
TASK_END = re.compile(rb"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+?)\s*$")
# srun's words for a step Slurm never created (src/srun: `existing_allocation`, `launch_common_create_job_step`):
# nothing of it ran anywhere
NO_STEP = re.compile(r"Unable to (confirm allocation|create step) for job")
LABEL = re.compile(rb"^ *(\d+): ")  # --label: every line a host wrote, "1: ..." (padded to the widest task)
# what srun and slurmstepd say when ddpnb cancels a step: not news once the run is being stopped
STOP_NOISE = (
    b"forcing job termination",
    b"Job step aborted",
    b"Force Terminated",
    b"CANCELLED AT",
    b"Terminating StepId",
    b"Waiting up to",
)


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
    channel (`ddpnb.remote`); this class does Slurm's part: the job, the step, srun's lines."""

    def __init__(self, spec: WorkerSpec, options: SlurmOptions) -> None:
        self.spec = spec
        self.options = options
        self.world_size = spec.world_size
        self._events: RunEvents | None = None
        self._conns = HostConnections(self.world_size, spec.run_dir, self._seats, where="Slurm node")
        self._srun: subprocess.Popen[bytes] | None = None
        self._closing = False
        self._pending_lines: dict[int, bytes] = {}  # srun's stdout/stderr fd -> its unfinished line
        self._streams: dict[int, Stream] = {}
        self._srun_said: list[str] = []  # srun's own lines (not a host's), for a step that never started
        self._task_ended: dict[int, tuple[str, float]] = {}  # node index -> srun's account of its host's end, and when
        self._cancelled = False  # the step was cancelled (`_cancel_step`, once)
        self._srun_done_at: float | None = None
        self._command: list[str] = []  # srun's, and what it is given on its stdin
        self._invitation = b""
        self._said_from = 0  # where the current srun's lines begin in `_srun_said`
        self._retries = 0  # srun started again: a step Slurm's messaging failed to create (`_retry_step`)
        self._retry_at: float | None = None  # when the next try starts
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
        self._invitation = self._conns.listen(allocation.reachable_address(job.nodes[0]), counts)
        self._command = [
            allocation.srun_path(),
            f"--jobid={job.job}",
            f"--nodes={len(counts)}",
            f"--ntasks={len(counts)}",
            "--ntasks-per-node=1",
            f"--cpus-per-task={max(counts)}",
            "--overlap",
            "--kill-on-bad-exit=0",
            "--label",
            f"--job-name=ddpnb-{Path(self.spec.run_dir).name}",
            *([f"--gpus-per-node={max(counts)}", "--gpu-bind=none"] if self.spec.use_gpus else []),
            *shlex.split(self.options.srun_args or ""),
            sys.executable,
            "-c",
            HOST_MAIN,
        ]
        self._srun = self._start_step()
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

    def _start_step(self) -> subprocess.Popen[bytes]:
        """srun, given the door's address and the secret on its stdin (it gives them to every host); its pipes
        read by `serve`."""
        # its own session: the kernel's interrupt (sent to the kernel's process group) must not reach srun,
        # which would cancel the step at once; ddpnb stops it in its own order
        srun = subprocess.Popen(
            self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        assert srun.stdin is not None
        try:
            srun.stdin.write(self._invitation)
            srun.stdin.close()
        except BrokenPipeError:  # srun failed at once: `serve` reads why
            pass
        self._said_from = len(self._srun_said)
        for pipe, stream in ((srun.stdout, Stream.STDOUT), (srun.stderr, Stream.STDERR)):
            assert pipe is not None
            self._streams[pipe.fileno()] = stream
            self._pending_lines[pipe.fileno()] = b""
            self._conns.watch(pipe.fileno(), self._read_srun)
        return srun

    def _retry_step(self, now: float) -> bool:
        """srun ended: whether its step is tried again (now or after a pause: True meanwhile). Only a step Slurm
        never created, for its messaging failing under load (`allocation.transient`), and so that no host, and no
        rank, of it can exist; a few times, further apart each time, said in the run's output."""
        assert self._events is not None and self._srun is not None
        if self._conns.stopping or self._closing or self._conns.arrived():
            return False
        if self._retry_at is None:
            failed = next(
                (
                    line
                    for line in self._srun_said[self._said_from :]
                    if NO_STEP.search(line) and allocation.transient(line)
                ),
                None,
            )
            if failed is None or self._retries >= allocation.RETRIES:
                return False
            self._retries += 1
            pause = allocation.BACKOFF * 2 ** (self._retries - 1)
            self._retry_at = now + pause
            self._events.output(
                0,
                Stream.STDERR,
                (
                    f"[ddpnb] srun could not start the step ({failed.removeprefix('srun: error: ')}): Slurm's "
                    f"messaging failed before any rank started; trying again in {pause:g} s ({self._retries} of "
                    f"{allocation.RETRIES})\n"
                ).encode(),
            )
            return True
        if now < self._retry_at:
            return True
        self._retry_at = None
        for pipe in (self._srun.stdin, self._srun.stdout, self._srun.stderr):
            if pipe is not None:
                pipe.close()
        self._srun, self._srun_done_at = self._start_step(), None
        return True

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
            if self._srun is None and not self._await_job():
                return
            assert self._srun is not None
            last_wake = 0.0
            while True:
                woken = time.monotonic()
                if woken - last_wake < COALESCE and events.quiet() and self._srun.poll() is None:
                    time.sleep(COALESCE - (woken - last_wake))
                last_wake = time.monotonic()
                conns.read_ready(0.1)
                self._settle()
                events.tick()
                if conns.hosts.all_ended() and self._srun_done_at is not None:
                    break
        finally:
            conns.selector.close()

    def _read_srun(self, fd: int) -> None:
        data = os.read(fd, 1 << 16)
        if not data:
            self._conns.selector.unregister(fd)
            rest = self._pending_lines.pop(fd)
            if rest:
                self._srun_line(fd, rest)
            return
        lines = (self._pending_lines[fd] + data).split(b"\n")
        self._pending_lines[fd] = lines.pop()
        for line in lines:
            self._srun_line(fd, line + b"\n")

    def _srun_line(self, fd: int, line: bytes) -> None:
        """A line from srun: a host's own (labelled with its node's place in the step), or srun's (a host's end,
        an error). Ranks' output never comes this way: it travels with their events."""
        assert self._events is not None
        quiet, links = self._conns.stopping or self._closing, self._conns.links
        labelled = LABEL.match(line)
        if labelled and int(labelled.group(1)) < len(links):
            if not (quiet and any(noise in line for noise in STOP_NOISE)):
                self._events.output(links[int(labelled.group(1))].ranks[0], self._streams[fd], line[labelled.end() :])
            return
        ended = TASK_END.match(line)
        if ended:
            for index in _task_ids(ended.group("tasks").decode()):
                if index < len(links):
                    self._task_ended.setdefault(index, (line.decode(errors="replace").strip(), time.monotonic()))
            return
        if quiet and any(noise in line for noise in STOP_NOISE):
            return
        self._srun_said.append(line.decode(errors="replace").rstrip())
        self._events.output(0, Stream.STDERR, line)  # srun's own news: shown with rank 0's output

    def _settle(self) -> None:
        """End the ranks no host will report: a host that hung up before its ranks ended (its node lost), one srun
        said ended whose last words did not come, or one that never came (the step did not start)."""
        assert self._srun is not None
        conns, now = self._conns, time.monotonic()
        if self._srun_done_at is None and self._srun.poll() is not None and not self._pending_lines:
            self._srun_done_at = now
        if self._srun_done_at is not None and self._retry_step(now):
            return
        srun_done = self._srun_done_at is not None
        for link in conns.links:
            said = self._task_ended.get(link.index)
            drained = said is not None and now - said[1] > DRAIN_WAIT
            if link.hello is None and (srun_done or drained):
                why = "; ".join(self._srun_said[-3:]) or (said or ("srun exited",))[0]
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
            self._cancel_step()  # every rank ended, but srun waits for something that holds the step

    # --- stopping, stacks and commands ------------------------------------------------------------------------------
    def stop(self, ranks: list[int], failed: bool) -> float | None:
        self._conns.stop(ranks)
        return STOP_GRACE

    def escalate(self) -> float | None:
        """SIGKILL from each host to its ranks; hosts that never came are ended with the step."""
        if not self._conns.escalate():
            self._cancel_step()
        return None

    def _cancel_step(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        step = next(
            (
                link.hello.step
                for link in self._conns.links
                if link.hello is not None and not link.hello.step.endswith(".")
            ),
            "",
        )
        if step:
            allocation.scancel(step)
        if self._srun is not None and self._srun.poll() is None:
            self._srun.send_signal(signal.SIGTERM)

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
        srun = self._srun
        if srun is not None and srun.poll() is None:
            try:
                srun.wait(SRUN_WAIT)
            except subprocess.TimeoutExpired:
                self._cancel_step()
                try:
                    srun.wait(SRUN_WAIT)
                except subprocess.TimeoutExpired:
                    srun.kill()
                    srun.wait()
        if srun is not None:
            for pipe in (srun.stdin, srun.stdout, srun.stderr):
                if pipe is not None:
                    pipe.close()
        self._conns.shut_door()
        if self._own_job is not None:  # the step is gone: the job waits a moment for the next launch, then goes back
            self._own_job.park()
            self._own_job = None
        self._events = None  # the run and its value go with the caller's last reference, not at the next gc


def _task_ids(text: str) -> list[int]:
    """srun's task list: '3', '0-1', '0,2-3'."""
    ids: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids
