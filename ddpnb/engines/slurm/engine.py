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

import logging
import os
import pickle
import queue
import re
import secrets
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

from ddpnb.core import messages as msg
from ddpnb.core import pickling, rundir
from ddpnb.core.engine import AttemptStart, Capabilities, Flag, RunEvents
from ddpnb.core.spec import LaunchError, Plan, Stream, WorkerSpec
from ddpnb.core.words import describe_exit
from ddpnb.engines.slurm import allocation, submit
from ddpnb.engines.slurm.options import SlurmOptions
from ddpnb.node import forked
from ddpnb.node.rank import Seat
from ddpnb.node.relay import replay
from ddpnb.node.shared import MemoryShipment
from ddpnb.remote.door import Door
from ddpnb.remote.wire import Control, Hello, Holdings, Report, Setup, invitation, keepalive, layout, send_data

STOP_GRACE = forked.STOP_GRACE  # seconds between a host's SIGTERM and SIGKILL to its ranks
STACK_WAIT = forked.STACK_WAIT + 2.0  # seconds hosts get to send their ranks' stacks
DRAIN_WAIT = 2.0  # seconds a host's last events may trail srun's report of its end
SRUN_WAIT = 5.0  # seconds srun gets to exit once the hosts were told to end, before the step is cancelled
COALESCE = forked.COALESCE  # seconds between two wake-ups of the reader while every rank is busy (see `serve`)
# what srun runs on each node: `-c` rather than `-m`, whose runpy frames would head every stack a rank sends (a
# stack is shown from the first frame that is not ddpnb's or a library's; "<string>" starts local ranks too)
HOST_MAIN = "from ddpnb.engines.slurm.host import main; main()"
CHANNEL_LOG = "channel.log"  # in the run directory: connections refused for want of the secret
# srun's account of a task's end (src/srun: `_task_finish`): "srun: error: n2: task 1: Killed",
# "srun: error: n1: tasks 0-1: Exited with exit code 5"
TASK_END = re.compile(rb"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+?)\s*$")
# srun's words for a step Slurm never created (src/srun: `existing_allocation`, `launch_common_create_job_step`):
# nothing of it ran anywhere
NO_STEP = re.compile(r"Unable to (confirm allocation|create step) for job")
LABEL = re.compile(rb"^ *(\d+): ")  # --label: every line a host wrote, "1: ..." (padded to the widest task)
# what srun and slurmstepd say when ddpnb cancels a step: not news once the run is being stopped
STOP_NOISE = (b"forcing job termination", b"Job step aborted", b"Force Terminated", b"CANCELLED AT",
              b"Terminating StepId", b"Waiting up to")
log = logging.getLogger(__name__)


class SlurmType:
    """The slurm engine before a run: srun on PATH, and the kernel inside a running allocation, or salloc to ask
    for one."""

    name: ClassVar[str] = "slurm"
    # ranks on other nodes: notebook data travels once per node, results pickled, on the channel; no run directory
    # in common
    capabilities: ClassVar[Capabilities] = Capabilities(
        commands=True, announce_every=COALESCE, stop_wait=STOP_GRACE + STACK_WAIT + SRUN_WAIT + 5)
    Options: ClassVar[type] = SlurmOptions
    flags: ClassVar[list[Flag]] = [
        Flag("--nodes", metavar="N",
             help="with --engine slurm: spread the ranks over N nodes (inside an allocation, default: all it holds, "
                  "at most one per rank)."),
        Flag("--srun-args", metavar="'ARGS'",
             help="with --engine slurm: more srun options for the ranks' job step, quoted as one argument "
                  "(e.g. --srun-args '--cpus-per-task=4 --mem=8G')."),
        Flag("--partition", metavar="NAME",
             help="with --engine slurm outside an allocation: the partition of the job ddpnb asks for (salloc)."),
        Flag("--time", metavar="LIMIT",
             help="with --engine slurm outside an allocation: the job's time limit, as salloc takes it (30, 2:00:00)."),
        Flag("--account", metavar="NAME", help="with --engine slurm outside an allocation: the job's account."),
        Flag("--qos", metavar="NAME", help="with --engine slurm outside an allocation: the job's quality of service."),
        Flag("--constraint", metavar="FEATURES",
             help="with --engine slurm outside an allocation: node features the job needs (salloc --constraint)."),
        Flag("--job-args", metavar="'ARGS'",
             help="with --engine slurm outside an allocation: more salloc options for the job, quoted as one "
                  "argument (e.g. --job-args '--mem=16G --exclusive')."),
    ]

    def check(self, options: SlurmOptions) -> None:
        allocation.srun_path()
        if allocation.inside():
            job = allocation.current()
            if options.submits:
                given = ", ".join(f"--{name.replace('_', '-')}" for name in options.submits)
                raise LaunchError(f"{given}: options of a job ddpnb asks for outside an allocation, and this kernel "
                                  f"runs inside Slurm job {job.job}, whose nodes the ranks use. Leave them out, or "
                                  "pass srun options for the step with --srun-args.")
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




class _Node:
    """One node of the step: its host's connection, and its ranks."""

    def __init__(self, index: int, ranks: list[int]) -> None:
        self.index = index
        self.ranks = ranks
        self.hello: Hello | None = None
        self.conn: Connection | None = None
        self.frames = msg.Frames()
        self.lock = threading.Lock()  # `ready`, `queued`, `closed_at`
        self.send_lock = threading.Lock()  # one frame (and the data after it) at a time on the connection
        self.ready = False  # its setup was sent: controls go out at once
        self.queued: list[tuple[Control, Any, dict[int, tuple[int, ...]], Any]] = []  # controls sent before that
        self.done = False  # the host said every rank here ended
        self.closed_at: float | None = None  # its connection ended
        self.srun_said: tuple[str, float] | None = None  # srun's account of the host task's end, and when
        self.holdings = Holdings(())  # the data its host holds (the host's own account, kept alike): `send`

    @property
    def name(self) -> str:
        return self.hello.node if self.hello is not None else f"node {self.index} of the step"


class SlurmEngine:
    """One attempt's ranks, forked by the hosts of one srun step (a task per node)."""

    def __init__(self, spec: WorkerSpec, options: SlurmOptions) -> None:
        self.spec = spec
        self.options = options
        self.world_size = spec.world_size
        self._events: RunEvents | None = None
        self._srun: subprocess.Popen[bytes] | None = None
        self._door: Door | None = None
        self._closing = False
        self._stopping = False
        self._arrivals: queue.SimpleQueue[tuple[Connection, Hello]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # a wake-up is never written to the pipe's number once it is closed
        self._selector = selectors.DefaultSelector()
        self._nodes: list[_Node] = []
        self._by_fd: dict[int, _Node] = {}
        self._master: tuple[str, int] | None = None  # rank 0's TCPStore, once node 0's host said where
        self._payload = b""
        self._data: dict[int, tuple[int, ...]] = {}  # the launch's notebook data: segment id -> the kernel's fds
        self._commands = False
        self._pending_lines: dict[int, bytes] = {}  # srun's stdout/stderr fd -> its unfinished line
        self._streams: dict[int, Stream] = {}
        self._srun_said: list[str] = []  # srun's own lines (not a host's), for a step that never started
        self._ended: set[int] = set()
        self._stacks: dict[int, str] = {}
        self._stack_answers = 0
        self._stack_request = 0  # the number of the latest stacks request: a late answer to an earlier one is dropped
        self._cancelled = False  # the step was cancelled (`_cancel_step`, once)
        self._srun_done_at: float | None = None
        self._command: list[str] = []  # srun's, and what it is given on its stdin
        self._invitation = b""
        self._said_from = 0  # where the current srun's lines begin in `_srun_said`
        self._retries = 0  # srun started again: a step Slurm's messaging failed to create (`_retry_step`)
        self._retry_at: float | None = None  # when the next try starts
        self._own_job: submit.OwnJob | None = None  # outside an allocation: the job asked for this attempt
        # a session's commands sent while the run's own job waits in the queue (ranks, command, shipment)
        self._early: list[tuple[list[int], bytes, Any]] = []
        self._early_lock = threading.Lock()

    # --- start -------------------------------------------------------------------------------------------------
    def start(self, events: RunEvents, start: AttemptStart) -> None:
        """The step on the allocation the kernel runs in, or on a job of the run's own: one kept from the run
        before or granted at once starts the step now; one that waits in the queue, once it runs (`serve`)."""
        self._events = events
        self._commands = start.commands
        allocation.srun_path()
        try:
            self._payload = pickling.dump_spec(self.spec, start.shipment)  # first: args that cannot be sent
            self._data = start.shipment.fds() if isinstance(start.shipment, MemoryShipment) else {}
            job = allocation.current() if allocation.inside() else self._ask_for_job()
            if job is not None:
                self._launch(job)
        except BaseException:
            self.close()
            raise

    def _launch(self, job: allocation.Allocation) -> None:
        """The step: a host per node, each given the door's address and the secret on srun's stdin."""
        spec = self.spec
        counts = self._spread(self._node_count(job))
        first = 0
        nodes = []
        for index, count in enumerate(counts):
            node = _Node(index, list(range(first, first + count)))
            node.holdings = Holdings(self._data)
            nodes.append(node)
            first += count
        secret = secrets.token_bytes(32)
        host = allocation.reachable_address(job.nodes[0])
        self._door = Door(host, secret, admit=self._admit, refuse=self._refused)
        self._invitation = invitation(*self._door.address, secret)
        self._command = [allocation.srun_path(), f"--jobid={job.job}", f"--nodes={len(counts)}",
                         f"--ntasks={len(counts)}", "--ntasks-per-node=1", f"--cpus-per-task={max(counts)}",
                         "--overlap", "--kill-on-bad-exit=0", "--label", f"--job-name=ddpnb-{Path(spec.run_dir).name}",
                         *([f"--gpus-per-node={max(counts)}", "--gpu-bind=none"] if spec.use_gpus else []),
                         *shlex.split(self.options.srun_args or ""),
                         sys.executable, "-c", HOST_MAIN]
        srun = self._start_step()
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._welcome)
        with self._early_lock:  # a session's commands sent while the job waited go first, in order
            self._nodes, self._srun = nodes, srun
            for ranks, command_bytes, shipment in self._early:
                self._send_now(ranks, command_bytes, shipment)  # queued behind each node's setup: at once
            self._early = []

    def _start_step(self) -> subprocess.Popen[bytes]:
        """srun, given the door's address and the secret on its stdin (it gives them to every host); its pipes
        read by `serve`."""
        # its own session: the kernel's interrupt (sent to the kernel's process group) must not reach srun,
        # which would cancel the step at once; ddpnb stops it in its own order
        srun = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
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
            self._selector.register(pipe.fileno(), selectors.EVENT_READ, self._read_srun)
        return srun

    def _retry_step(self, now: float) -> bool:
        """srun ended: whether its step is tried again (now or after a pause: True meanwhile). Only a step Slurm
        never created, for its messaging failing under load (`allocation.transient`), and so that no host, and no
        rank, of it can exist; a few times, further apart each time, said in the run's output."""
        assert self._events is not None and self._srun is not None
        if self._stopping or self._closing or any(node.hello is not None for node in self._nodes):
            return False
        if self._retry_at is None:
            failed = next((line for line in self._srun_said[self._said_from:]
                           if NO_STEP.search(line) and allocation.transient(line)), None)
            if failed is None or self._retries >= allocation.RETRIES:
                return False
            self._retries += 1
            pause = allocation.BACKOFF * 2 ** (self._retries - 1)
            self._retry_at = now + pause
            self._events.output(0, Stream.STDERR, (
                f"[ddpnb] srun could not start the step ({failed.removeprefix('srun: error: ')}): Slurm's "
                f"messaging failed before any rank started; trying again in {pause:g} s ({self._retries} of "
                f"{allocation.RETRIES})\n").encode())
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
        request = submit.JobRequest(name=f"ddpnb-{Path(self.spec.run_dir).name}", tasks=self.spec.world_size,
                                    gpus=self.spec.use_gpus, options=self.options)
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
            while not self._stopping and not job.granted_within(submit.POLL):
                state = job.state()
                if state and state != said:
                    events.queued(job.what, state)
                    said = state
                events.tick()  # a stop, the views
        except LaunchError as exc:
            return self._never_started(stopped=False, cause=f"{job.what} ended in the queue: {exc}")
        finally:
            events.queued(job.what, "")
        if self._stopping:
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

    def _node_count(self, job: allocation.Allocation) -> int:
        """How many nodes the step spans; LaunchError where the allocation cannot hold the run, quoting Slurm."""
        spec, asked = self.spec, self.options.nodes
        held = f"Slurm job {job.job} holds {job.quote('NumNodes', 'NumCPUs', 'NodeList')}"
        if asked is not None and asked > len(job.nodes):
            raise LaunchError(f"--nodes {asked} asks for more nodes than this allocation has: {held}. Use "
                              f"--nodes {len(job.nodes)} or fewer, or allocate more (salloc -N {asked} ...).")
        nodes = asked or min(len(job.nodes), spec.world_size)
        if nodes > spec.world_size:
            raise LaunchError(f"--nodes {nodes} needs at least one rank per node, and this run has "
                              f"{spec.world_size}: use -n {nodes} or more, or fewer nodes.")
        overcommit = any(arg in ("-O", "--overcommit") for arg in shlex.split(self.options.srun_args or ""))
        if spec.world_size > job.cpus and not overcommit:
            raise LaunchError(f"{spec.world_size} ranks need {spec.world_size} CPUs, one per rank, and {held}: "
                              f"use -n {job.cpus} or fewer, or an allocation with more tasks (salloc -n "
                              f"{spec.world_size} ...), or --srun-args --overcommit to share CPUs.")
        return nodes

    def _spread(self, nodes: int) -> list[int]:
        """Ranks per node, in blocks as srun's own default distribution: the first nodes take one more."""
        each, extra = divmod(self.world_size, nodes)
        return [each + (index < extra) for index in range(nodes)]

    # --- the channel's door -------------------------------------------------------------------------------------
    def _admit(self, conn: Connection, hello: Hello) -> None:
        """A host proved the secret (the door's HMAC challenge) and said which node it is: the reader takes it."""
        if self._closing:
            conn.close()
            return
        self._arrivals.put((conn, hello))
        self._wake()

    def _refused(self, peer: Any, exc: BaseException) -> None:
        line = (f"{time.strftime('%Y-%m-%d %H:%M:%S')} refused a connection from {_peer(peer)}: "
                f"{type(exc).__name__}: {exc or 'it closed before proving the secret'}\n")
        log.warning("ddpnb slurm channel: %s", line.strip())
        try:
            with open(Path(self.spec.run_dir) / CHANNEL_LOG, "a", opener=rundir.private) as file:
                file.write(line)
        except OSError:  # the run directory went away: the warning above still says it
            return

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                if self._wake_w >= 0:
                    os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):  # wake-ups pending already
                pass

    def _welcome(self, fd: int) -> None:
        os.read(fd, 4096)
        while True:
            try:
                conn, hello = self._arrivals.get_nowait()
            except queue.Empty:
                return
            self._arrived(conn, hello)

    def _arrived(self, conn: Connection, hello: Hello) -> None:
        if not 0 <= hello.node_index < len(self._nodes) or self._nodes[hello.node_index].hello is not None \
                or self._stopping:
            conn.close()  # a stopped run forks nothing more; a second host for a node cannot exist: a bug
            return
        node = self._nodes[hello.node_index]
        node.hello, node.conn = hello, conn
        keepalive(conn)
        self._by_fd[conn.fileno()] = node
        self._selector.register(conn.fileno(), selectors.EVENT_READ, self._read_host)
        if hello.node_index == 0:
            self._master = (hello.host, hello.store_port)
            for other in self._nodes:
                if other.hello is not None:
                    self._set_up(other)
        elif self._master is not None:
            self._set_up(node)

    def _set_up(self, node: _Node) -> None:
        """The node's seats, the spec and the notebook data, then what a session sent meanwhile, in order; sent by
        a thread of its own, so that a gigabyte of data on its way to one node holds nothing else up."""
        assert self._master is not None
        master_addr, master_port = self._master
        seats = [Seat(rank, local, len(node.ranks), "", node.index, master_addr, master_port,
                      local if self.spec.use_gpus else None,
                      {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NTASKS": str(self.world_size),
                       "SLURM_STEP_NUM_TASKS": str(self.world_size)})
                 for local, rank in enumerate(node.ranks)]
        setup = Setup(self._payload, seats, layout(self._data), self._commands)

        def send() -> None:
            queued: list[tuple[Control, Any, dict[int, tuple[int, ...]], Any]] = [
                (Control.SETUP, setup, self._data, None)]
            while queued:
                for kind, value, files, _ in queued:
                    _send(node, kind, value, files)
                with node.lock:  # what came meanwhile, in order; then `_control` sends directly
                    queued, node.queued = node.queued, []
                    node.ready = not queued

        threading.Thread(target=send, name=f"ddpnb-slurm-setup-{node.index}", daemon=True).start()

    def _control(self, node: _Node, kind: Control, value: Any = None,
                 files: dict[int, tuple[int, ...]] | None = None, keep: Any = None) -> None:
        """To the node's host once it has its setup; until then queued behind it (`keep`: what must live till it
        is sent, a session command's shipment)."""
        with node.lock:
            if node.closed_at is not None:  # its host is gone: its ranks' end says so
                return
            if not node.ready:  # its host has not come yet, or its setup is on the way
                node.queued.append((kind, value, files or {}, keep))
                return
        _send(node, kind, value, files or {})

    # --- the reader --------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Read the hosts' connections, srun's pipes and new arrivals until every rank has ended and srun with
        them. While every rank is busy, wake-ups are COALESCE apart (the views redraw no more often)."""
        events = self._events
        assert events is not None
        if self._srun is None and not self._await_job():
            self._selector.close()
            return
        assert self._srun is not None
        last_wake = 0.0
        try:
            while True:
                woken = time.monotonic()
                if woken - last_wake < COALESCE and events.quiet() and self._srun.poll() is None:
                    time.sleep(COALESCE - (woken - last_wake))
                last_wake = time.monotonic()
                self._read_ready(0.1)
                self._settle()
                events.tick()
                if len(self._ended) == self.world_size and self._srun_done_at is not None:
                    break
        finally:
            self._selector.close()

    def _read_ready(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            if key.fd in self._selector.get_map():  # not closed by an earlier event of this batch
                key.data(key.fd)

    def _read_host(self, fd: int) -> None:
        node = self._by_fd[fd]
        try:
            data = os.read(fd, 1 << 20)
        except OSError:  # reset, or the keepalive found no one there
            data = b""
        if not data:
            self._hang_up(node)
            return
        for frame in node.frames.feed(data):
            kind, value = pickle.loads(frame)
            if kind is Report.EVENTS:
                self._replay(node, value)
            elif kind is Report.STACKS:
                number, stacks = value
                if number == self._stack_request:  # not a late answer to an earlier request
                    self._stacks.update(stacks)
                    self._stack_answers += 1
            elif kind is Report.DONE:
                node.done = True
                self._hang_up(node)  # the host ends its part once its connection closes
                return

    def _hang_up(self, node: _Node) -> None:
        """Stop reading the host's connection and close it (from the reader thread): the host ends its ranks and
        exits; `_settle` reports whatever of them it did not."""
        assert node.conn is not None
        if node.closed_at is None:
            fd = node.conn.fileno()
            if fd in self._by_fd:
                self._selector.unregister(fd)
                del self._by_fd[fd]
        _disconnect(node)

    def _replay(self, node: _Node, batch: list[tuple[Any, ...]]) -> None:
        assert self._events is not None

        def exited(rank: int, code: int | None, stopped: bool) -> None:
            cause = f"{describe_exit(code)} (on Slurm node {node.name})" if code and code < 0 and not stopped else ""
            self._end(rank, code, stopped=stopped, cause=cause)

        replay(batch, self._events, node.name, exited)

    def _read_srun(self, fd: int) -> None:
        data = os.read(fd, 1 << 16)
        if not data:
            self._selector.unregister(fd)
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
        quiet = self._stopping or self._closing
        labelled = LABEL.match(line)
        if labelled and int(labelled.group(1)) < len(self._nodes):
            node = self._nodes[int(labelled.group(1))]
            if not (quiet and any(noise in line for noise in STOP_NOISE)):
                self._events.output(node.ranks[0], self._streams[fd], line[labelled.end():])
            return
        ended = TASK_END.match(line)
        if ended:
            for index in _task_ids(ended.group("tasks").decode()):
                if index < len(self._nodes) and self._nodes[index].srun_said is None:
                    self._nodes[index].srun_said = (line.decode(errors="replace").strip(), time.monotonic())
            return
        if quiet and any(noise in line for noise in STOP_NOISE):
            return
        self._srun_said.append(line.decode(errors="replace").rstrip())
        self._events.output(0, Stream.STDERR, line)  # srun's own news: shown with rank 0's output

    def _settle(self) -> None:
        """End the ranks no host will report: a host that hung up before its ranks ended (its node lost), or that
        never came (the step did not start)."""
        assert self._srun is not None
        now = time.monotonic()
        if self._srun_done_at is None and self._srun.poll() is not None and not self._pending_lines:
            self._srun_done_at = now
        if self._srun_done_at is not None and self._retry_step(now):
            return
        srun_done = self._srun_done_at is not None
        for node in self._nodes:
            left = [rank for rank in node.ranks if rank not in self._ended]
            if not left:
                continue
            if node.hello is None:
                if srun_done or (node.srun_said is not None and now - node.srun_said[1] > DRAIN_WAIT):
                    said = "; ".join(self._srun_said[-3:]) or (node.srun_said or ("srun exited",))[0]
                    for rank in left:
                        self._end(rank, 1, stopped=self._stopping, cause="" if self._stopping else
                                  f"did not start: {said}")
            elif node.closed_at is not None or (node.srun_said is not None and now - node.srun_said[1] > DRAIN_WAIT):
                how = f": {node.srun_said[0]}" if node.srun_said else ""
                for rank in left:
                    self._end(rank, -signal.SIGKILL if self._stopping else 1, stopped=self._stopping,
                              cause="" if self._stopping else
                              f"its Slurm node {node.name} was lost (ddpnb's host there ended{how})")
        if len(self._ended) == self.world_size and not srun_done and all(
                node.closed_at is not None and now - node.closed_at > SRUN_WAIT for node in self._nodes
                if node.hello is not None):
            self._cancel_step()  # every rank ended, but srun waits for something that holds the step

    def _end(self, rank: int, code: int | None, *, stopped: bool, cause: str = "") -> None:
        assert self._events is not None
        if rank in self._ended:
            return
        self._ended.add(rank)
        self._events.exited(rank, code, stopped=stopped, cause=cause)

    # --- stopping, stacks and commands ------------------------------------------------------------------------------
    def stop(self, ranks: list[int], failed: bool) -> float | None:
        """SIGTERM from each host to its ranks. A host that has not got its setup forked nothing: it is hung up
        (it exits, and its ranks end as stopped); one busy receiving a session's data is left to `escalate`."""
        self._stopping = True
        for node in self._nodes:
            if not node.ready:
                if node.conn is not None and node.closed_at is None:
                    self._hang_up(node)
                continue
            _send(node, Control.STOP, [rank for rank in ranks if rank in node.ranks], wait=False)
        return STOP_GRACE

    def escalate(self) -> float | None:
        """SIGKILL from each host to its ranks; a host that cannot be told at once is hung up, which ends its ranks
        (their lifeline); hosts that never came are ended with the step."""
        for node in self._nodes:
            if node.conn is not None and node.closed_at is None and \
                    not (node.ready and _send(node, Control.ESCALATE, wait=False)):
                self._hang_up(node)
        if any(node.hello is None for node in self._nodes):
            self._cancel_step()
        return None

    def _cancel_step(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        step = next((node.hello.step for node in self._nodes
                     if node.hello is not None and not node.hello.step.endswith(".")), "")
        if step:
            allocation.scancel(step)
        if self._srun is not None and self._srun.poll() is None:
            self._srun.send_signal(signal.SIGTERM)

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each rank's stack, written by its faulthandler when its host asked (SIGUSR1), and sent back."""
        self._stacks, self._stack_answers = {}, 0
        self._stack_request += 1
        asked = 0
        for node in self._nodes:
            mine = [rank for rank in ranks if rank in node.ranks and rank not in self._ended]
            if mine and node.ready and _send(node, Control.STACKS, (mine, self._stack_request), wait=False):
                asked += 1  # (a node busy receiving a session's data gives none this time)
        deadline = time.monotonic() + STACK_WAIT
        while time.monotonic() < deadline and self._stack_answers < asked:
            self._read_ready(0.05)
        return {rank: self._stacks[rank] for rank in ranks if rank in self._stacks}

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        """A session's command to each of `ranks`, through its node's host, with the notebook data its pickle
        refers to that the host does not hold yet (once per node)."""
        with self._early_lock:
            if self._srun is None:  # the job waits in the queue: sent once the step starts
                self._early.append((ranks, command, shipment))
                return
        self._send_now(ranks, command, shipment)

    def _send_now(self, ranks: list[int], command: bytes, shipment: Any) -> None:
        files = shipment.fds() if isinstance(shipment, MemoryShipment) else {}
        senders = []
        for node in self._nodes:
            mine = [rank for rank in ranks if rank in node.ranks]
            if not mine:
                continue
            if not files:
                self._control(node, Control.COMMAND, (mine, command), files, shipment)
                continue
            # every node's data at once; each sender holds the shipment, whose files it reads, till it is done
            senders.append(threading.Thread(target=self._control,
                                            args=(node, Control.COMMAND, (mine, command), files, shipment),
                                            name=f"ddpnb-slurm-send-{node.index}", daemon=True))
            senders[-1].start()
        for sender in senders:
            sender.join()
        self._wake()  # the reader reads at once, not after its pause: the answer may be quick

    def interrupt(self, ranks: list[int]) -> None:
        """Each rank's host raises SIGINT in it: KeyboardInterrupt in the running command."""
        for node in self._nodes:
            mine = [rank for rank in ranks if rank in node.ranks]
            if mine:
                self._control(node, Control.INTERRUPT, mine)

    def close(self) -> None:
        """Every connection closed (each host then ends its ranks and itself), srun gone, the door shut, the step
        cancelled if anything of it is left."""
        self._closing = True
        for node in self._nodes:
            _disconnect(node)
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
        if self._door is not None:
            self._door.close()
            self._door = None
        while not self._arrivals.empty():
            self._arrivals.get_nowait()[0].close()
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
        self._selector.close()
        if self._own_job is not None:  # the step is gone: the job waits a moment for the next launch, then goes back
            self._own_job.park()
            self._own_job = None
        self._events = None  # the run and its value go with the caller's last reference, not at the next gc


def _send(node: _Node, kind: Control, value: Any = None, files: dict[int, tuple[int, ...]] | None = None,
          wait: bool = True) -> bool:
    """One frame to a node's host, and the notebook data it announces; False where it was not sent (the host is
    gone, or, not `wait`ing, the connection is busy with another send). A session command's data is what the host
    lacks, by the account host and kernel keep alike, kept here, in the order the wire takes. A send that fails
    once bytes went out (or is interrupted) ends the connection: the host must never read what follows as data."""
    if not node.send_lock.acquire(blocking=wait):
        return False
    try:
        if node.conn is None or node.closed_at is not None:
            return False
        files = files or {}
        if kind is Control.COMMAND:
            ranks, command = value
            lacking = {segment: files[segment] for segment in node.holdings.lacks(files)}
            if files:
                node.holdings.used(files)
            value, files = (ranks, command, layout(lacking), list(files)), lacking
        frame = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            node.conn.send_bytes(frame)
            send_data(node.conn.fileno(), files)
        except BaseException as exc:
            _shut(node.conn)  # the reader sees the host hang up; the host sees the kernel go
            if isinstance(exc, OSError):
                return False
            raise
        return True
    finally:
        node.send_lock.release()


def _shut(conn: Connection) -> None:
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as raw:
            raw.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected any more
        pass


def _disconnect(node: _Node) -> None:
    """Close the host's connection, once: shut down first, so that a send in progress (a gigabyte of data) fails
    at once, then closed under the send lock, so no sender can write to its number after it was given to another
    file."""
    with node.lock:
        if node.conn is None or node.closed_at is not None:
            return
        node.closed_at = time.monotonic()
    _shut(node.conn)
    with node.send_lock:
        node.conn.close()


def _task_ids(text: str) -> list[int]:
    """srun's task list: '3', '0-1', '0,2-3'."""
    ids: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids


def _peer(peer: Any) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) == 2 else str(peer)
