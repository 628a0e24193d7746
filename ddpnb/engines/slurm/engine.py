"""The slurm engine, kernel side: one `srun` job step per attempt inside the kernel's allocation, one task per rank
(outside one, inside a job asked for with `salloc` for the attempt: `submit.py`).

The kernel listens on the address the allocation's nodes reach it at (port 0), and only for this attempt; the
step's stdin gives every task that address and a fresh secret, and each rank connects proving it (HMAC, through
`multiprocessing.connection`). Messages travel on those connections; output is srun's own (`--label`), read from
its pipes; each rank's end is what srun reports of its task (`task 3: Killed`) or, for a rank that returned, its
connection closing. The reader thread (`serve`) multiplexes srun's pipes, the connections and the new arrivals
with one selector. Stopping: SIGTERM to the step (`scancel --signal=TERM`), SIGKILL after STOP_GRACE; every rank
also ends its own process group when its connection closes, so nothing it started outlives the run.
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
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any, ClassVar

from ddpnb.core import messages as msg
from ddpnb.core import pickling, rundir
from ddpnb.core.engine import AttemptStart, Capabilities, Flag, RunEvents
from ddpnb.core.spec import LaunchError, Plan, Stream, WorkerSpec
from ddpnb.core.words import describe_exit
from ddpnb.engines.slurm import allocation, submit
from ddpnb.engines.slurm.options import SlurmOptions
from ddpnb.engines.slurm.wire import FLUSHED, Control, Hello, Setup, invitation

STOP_GRACE = 2.0  # seconds between SIGTERM and SIGKILL to the step
STACK_WAIT = 2.0  # seconds ranks get to send their stacks
DRAIN_WAIT = 2.0  # seconds a rank's last messages may trail srun's report of its exit; srun may outlive its ranks
SRUN_WAIT = 5.0  # seconds srun gets to exit once its step was cancelled, before it is killed
FLUSH_WAIT = 2.0  # seconds a session's answer waits for the output its rank wrote before it (srun's path is slower)
COALESCE = 0.2  # seconds between two wake-ups of the reader while every rank is busy (see `serve`)
# what srun runs on each node: `-c` rather than `-m`, whose runpy frames would head every stack the rank sends (a
# stack is shown from the first frame that is not ddpnb's or a library's; "<string>" starts local ranks too)
RANK_MAIN = "from ddpnb.engines.slurm.rank import main; main()"
CHANNEL_LOG = "channel.log"  # in the run directory: connections refused for want of the secret
# srun's account of a task's end (src/srun: `_task_finish`): "srun: error: n2: task 3: Killed",
# "srun: error: n1: tasks 0-1: Exited with exit code 5"
TASK_END = re.compile(rb"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+?)\s*$")
EXIT_CODE = re.compile(r"Exited with exit code (\d+)")
LABEL = re.compile(rb"^ *(\d+): ")  # --label: every line a task wrote, "3: ..." (padded to the widest rank)
# what srun and slurmstepd say when ddpnb cancels a step: not news once the run is being stopped
STOP_NOISE = (b"forcing job termination", b"Job step aborted", b"Force Terminated", b"CANCELLED AT",
              b"Terminating StepId", b"Waiting up to")
_SIGNAL_WORDS = {signal.strsignal(sig): -sig for sig in signal.Signals if signal.strsignal(sig)}
log = logging.getLogger(__name__)


class SlurmType:
    """The slurm engine before a run: srun on PATH, and the kernel inside a running allocation, or salloc to ask
    for one."""

    name: ClassVar[str] = "slurm"
    # ranks on other nodes: notebook data and results travel pickled on the channel; no run directory in common
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

    def shipment(self) -> None:
        return None

    def gpus_available(self) -> int | None:
        return None

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        return dict(env)  # srun gives the tasks the kernel's environment (--export=ALL); the spec adds `env`

    def torch_threads(self, plan: Plan, environ: dict[str, str]) -> int | None:
        return None  # each rank takes its step's CPUs per task (SLURM_CPUS_PER_TASK), as torchrun's one thread

    def create(self, spec: WorkerSpec, options: SlurmOptions) -> SlurmEngine:
        return SlurmEngine(spec, options)


class SlurmEngine:
    """One attempt's ranks as the tasks of one srun step."""

    def __init__(self, spec: WorkerSpec, options: SlurmOptions) -> None:
        self.spec = spec
        self.options = options
        self.world_size = spec.world_size
        self._events: RunEvents | None = None
        self._srun: subprocess.Popen[bytes] | None = None
        self._listener: Listener | None = None
        self._closing = False
        self._arrivals: queue.SimpleQueue[tuple[Connection, Hello]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._conns: dict[int, tuple[int, Connection, msg.Frames]] = {}  # fd -> rank, connection, frames
        self._hellos: dict[int, Hello] = {}
        self._setup: Setup | None = None
        self._spec_payload = b""
        self._pending_lines: dict[int, bytes] = {}  # srun's stdout/stderr fd -> its unfinished line
        self._streams: dict[int, Stream] = {}
        self._srun_said: list[str] = []  # srun's own lines (not a task's), for a step that never started
        self._reports: dict[int, tuple[int, float]] = {}  # rank -> exit code srun reported, when
        self._said: dict[int, type] = {}  # rank -> Returned or Failed
        self._closed: dict[int, float] = {}  # rank -> when its connection closed
        self._ended: set[int] = set()
        self._stacks: dict[int, str] = {}
        self._sent: set[int] = set()  # the signals ddpnb sent the step (none: not stopping); a rank killed by
        # another signal failed by itself
        self._srun_done_at: float | None = None
        self._own_job: submit.OwnJob | None = None  # outside an allocation: the job asked for this attempt
        # the command channel: `send` and `interrupt` come from the session's thread, the rest from the reader
        self._send_lock = threading.Lock()  # one frame at a time on a connection; `_ready` and `_queued` too
        self._ready: dict[int, Connection] = {}  # rank -> its connection, once it has its setup
        self._queued: dict[int, list[tuple[Control, Any]]] = {}  # what was sent to a rank before its setup
        self._flushes: dict[tuple[int, Stream], int] = {}  # FLUSHED marks read per rank and stream
        self._replies: dict[int, int] = {}  # session answers read per rank
        self._held: dict[int, list[tuple[int, float, msg.Reply]]] = {}  # answers whose output is still on its way

    # --- start -------------------------------------------------------------------------------------------------
    def start(self, events: RunEvents, start: AttemptStart) -> None:
        self._events = events
        spec = self.spec
        srun = allocation.srun_path()
        self._spec_payload = pickling.dump_spec(spec, None)  # before anything starts: args that cannot be sent
        try:
            job = allocation.current() if allocation.inside() else self._ask_for_job()
            nodes = self._nodes(job)
            secret = secrets.token_bytes(32)
            host = allocation.reachable_address(job.nodes[0])
            self._listener = Listener((host, 0), family="AF_INET", authkey=secret)
            threading.Thread(target=self._accept, name="ddpnb-slurm-accept", daemon=True).start()
            command = [srun, f"--jobid={job.job}", f"--nodes={nodes}", f"--ntasks={spec.world_size}", "--overlap",
                       "--kill-on-bad-exit=0", "--label", f"--job-name=ddpnb-{Path(spec.run_dir).name}",
                       *(["--gpus-per-task=1", "--gpu-bind=none"] if spec.use_gpus else []),
                       *shlex.split(self.options.srun_args or ""),
                       sys.executable, "-c", RANK_MAIN]
            # its own session: the kernel's interrupt (sent to the kernel's process group) must not reach srun,
            # which would cancel the step at once; ddpnb stops it in its own order
            self._srun = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True)
            assert self._srun.stdin is not None
            try:
                self._srun.stdin.write(invitation(*self._listener.address, secret))  # srun gives it to every task
                self._srun.stdin.close()
            except BrokenPipeError:  # srun failed at once: `serve` reads why
                pass
        except BaseException:
            self.close()
            raise
        for pipe, stream in ((self._srun.stdout, Stream.STDOUT), (self._srun.stderr, Stream.STDERR)):
            assert pipe is not None
            self._streams[pipe.fileno()] = stream
            self._pending_lines[pipe.fileno()] = b""
            self._selector.register(pipe.fileno(), selectors.EVENT_READ, self._read_srun)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._welcome)

    def _ask_for_job(self) -> allocation.Allocation:
        """Outside an allocation: a job of this attempt's own, for its ranks; its queue state is said in the cell
        (the views start with the ranks) while it waits, and an interrupt meanwhile cancels it (`close`)."""
        request = submit.JobRequest(name=f"ddpnb-{Path(self.spec.run_dir).name}", tasks=self.spec.world_size,
                                    gpus=self.spec.use_gpus, options=self.options)
        self._own_job = submit.OwnJob(request, say=lambda line: print(f"[ddpnb] {line}", flush=True))
        return self._own_job.wait()

    def _nodes(self, job: allocation.Allocation) -> int:
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
            raise LaunchError(f"{spec.world_size} ranks need {spec.world_size} CPUs, one per task, and {held}: "
                              f"use -n {job.cpus} or fewer, or an allocation with more tasks (salloc -n "
                              f"{spec.world_size} ...), or --srun-args --overcommit to share CPUs.")
        return nodes

    # --- the channel's door -------------------------------------------------------------------------------------
    def _accept(self) -> None:
        """Admit the ranks: each connection must prove the secret (the listener's HMAC challenge), then say who it
        is. Anything else is dropped and logged, and the door stays open for the ranks."""
        listener = self._listener
        assert listener is not None
        while not self._closing:
            try:
                conn = listener.accept()
            except (AuthenticationError, EOFError, OSError, ValueError) as exc:
                if self._closing:
                    return
                self._refused(listener.last_accepted, exc)
                continue
            try:
                hello = pickle.loads(conn.recv_bytes())
                if not isinstance(hello, Hello):
                    raise TypeError(f"not a rank's hello: {type(hello).__name__}")
            except (EOFError, OSError, TypeError, ValueError, pickle.UnpicklingError) as exc:
                conn.close()
                self._refused(listener.last_accepted, exc)
                continue
            self._arrivals.put((conn, hello))
            try:
                os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):  # wake-ups pending already, or the run is over
                pass

    def _refused(self, peer: Any, exc: BaseException) -> None:
        line = (f"{time.strftime('%Y-%m-%d %H:%M:%S')} refused a connection from {_peer(peer)}: "
                f"{type(exc).__name__}: {exc or 'it closed before proving the secret'}\n")
        log.warning("ddpnb slurm channel: %s", line.strip())
        try:
            with open(Path(self.spec.run_dir) / CHANNEL_LOG, "a", opener=rundir.private) as file:
                file.write(line)
        except OSError:  # the run directory went away: the warning above still says it
            return

    def _welcome(self, fd: int) -> None:
        os.read(fd, 4096)
        while True:
            try:
                conn, hello = self._arrivals.get_nowait()
            except queue.Empty:
                return
            self._arrived(conn, hello)

    def _arrived(self, conn: Connection, hello: Hello) -> None:
        assert self._events is not None
        if not 0 <= hello.rank < self.world_size or hello.rank in self._hellos:
            conn.close()  # a task of another step with this secret cannot exist: a bug, not a guest
            return
        self._hellos[hello.rank] = hello
        self._conns[conn.fileno()] = (hello.rank, conn, msg.Frames())
        self._selector.register(conn.fileno(), selectors.EVENT_READ, self._read_channel)
        self._events.placed(hello.rank, hello.pid, hello.node)
        if hello.rank == 0:
            self._setup = Setup(self._spec_payload, hello.host, hello.store_port)
            for rank, other, _ in list(self._conns.values()):
                self._set_up(rank, other)
        elif self._setup is not None:
            self._set_up(hello.rank, conn)

    def _set_up(self, rank: int, conn: Connection) -> None:
        """The rank's setup, then what a session sent it meanwhile, in order; from now on `send` writes directly."""
        assert self._setup is not None
        with self._send_lock:
            _write(conn, Control.SETUP, self._setup)
            for kind, value in self._queued.pop(rank, []):
                _write(conn, kind, value)
            self._ready[rank] = conn

    def _send(self, conn: Connection, kind: Control, value: Any = None) -> None:
        with self._send_lock:
            _write(conn, kind, value)

    # --- the reader --------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Read srun's pipes, the ranks' connections and new arrivals until every rank has ended and srun with
        them. While every rank is busy, wake-ups are COALESCE apart (the views redraw no more often); srun's
        account of a task's end (its stderr) ends a pause at once."""
        events = self._events
        assert events is not None and self._srun is not None
        last_wake = 0.0
        try:
            while True:
                woken = time.monotonic()
                if woken - last_wake < COALESCE and events.quiet() and self._srun.poll() is None:
                    stderr = self._srun.stderr
                    assert stderr is not None
                    selectors_wait([stderr.fileno(), self._wake_r], COALESCE - (woken - last_wake))
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

    def _read_channel(self, fd: int) -> None:
        assert self._events is not None
        rank, conn, frames = self._conns[fd]
        data = os.read(fd, 1 << 20)
        if not data:
            self._selector.unregister(fd)
            del self._conns[fd]
            with self._send_lock:
                self._ready.pop(rank, None)
            conn.close()
            self._closed[rank] = time.monotonic()
            return
        for frame in frames.feed(data):
            message = msg.decode(frame)
            if isinstance(message, msg.Stacks):  # the answer `collect_stacks` waits for, not the run's news
                self._stacks[message.rank] = message.text
                continue
            if isinstance(message, msg.Reply):
                self._replies[rank] = number = self._replies.get(rank, 0) + 1
                self._held.setdefault(rank, []).append((number, time.monotonic(), message))
                self._release(rank)
                continue
            if isinstance(message, (msg.Returned, msg.Failed)):
                self._said[rank] = type(message)
            self._events.message(rank, message)

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
        """A line from srun: a task's (labelled with its rank), or srun's own (a task's end, an error)."""
        assert self._events is not None
        stream = self._streams[fd]
        labelled = LABEL.match(line)
        if labelled and int(labelled.group(1)) < self.world_size:
            rank, text = int(labelled.group(1)), line[labelled.end():]
            if FLUSHED in text:  # what the rank wrote before its session answer is all here now
                text = text.replace(FLUSHED + b"\n", b"").replace(FLUSHED, b"")
                self._flushes[rank, stream] = self._flushes.get((rank, stream), 0) + 1
                if text:
                    self._events.output(rank, stream, text)
                self._release(rank)
                return
            if not (self._sent and any(noise in text for noise in STOP_NOISE)):
                self._events.output(rank, stream, text)
            return
        ended = TASK_END.match(line)
        if ended:
            how = ended.group("how").decode(errors="replace")
            code = int(EXIT_CODE.match(how).group(1)) if EXIT_CODE.match(how) else \
                _SIGNAL_WORDS.get(how.replace(" (core dumped)", ""), 1)
            for rank in _task_ids(ended.group("tasks").decode()):
                self._reports.setdefault(rank, (code, time.monotonic()))
            return
        if self._sent and any(noise in line for noise in STOP_NOISE):
            return
        self._srun_said.append(line.decode(errors="replace").rstrip())
        self._events.output(0, Stream.STDERR, line)  # srun's own news: shown with rank 0's output

    def _release(self, rank: int, everything: bool = False) -> None:
        """A session's answers travel on the channel, ahead of the output its rank printed before it, which takes
        srun's longer way: each answer is delivered once the rank's FLUSHED mark (written just before it, on
        stdout and stderr) came through both, so the cell shows its output before its value. After FLUSH_WAIT,
        or once the rank ended, it is delivered anyway."""
        assert self._events is not None
        flushed = min(self._flushes.get((rank, stream), 0) for stream in (Stream.STDOUT, Stream.STDERR))
        held = self._held.get(rank, [])
        now = time.monotonic()
        while held and (everything or held[0][0] <= flushed or now - held[0][1] > FLUSH_WAIT):
            self._events.message(rank, held.pop(0)[2])

    def _settle(self) -> None:
        """Report each rank's end once it is known: srun's account of its task, else its connection closing after
        it returned or failed, else srun's own end (a task srun did not report exited with 0)."""
        assert self._events is not None and self._srun is not None
        now = time.monotonic()
        for rank in list(self._held):
            self._release(rank)
        if self._srun_done_at is None and self._srun.poll() is not None and not self._pending_lines:
            self._srun_done_at = now
        srun_done = self._srun_done_at is not None
        for rank in range(self.world_size):
            if rank in self._ended:
                continue
            report = self._reports.get(rank)
            connected = rank in self._hellos and rank not in self._closed
            if report is not None and (not connected or now - report[1] > DRAIN_WAIT or srun_done):
                self._end(rank, report[0])
            elif rank in self._closed and rank in self._said:
                self._end(rank, report[0] if report else 0 if self._said[rank] is msg.Returned else 1)
            elif srun_done:
                self._end(rank, report[0] if report else self._srun.returncode if rank not in self._hellos else 0)
        if len(self._ended) == self.world_size and not srun_done and now - max(
                [*self._closed.values(), *(when for _, when in self._reports.values()), 0.0]) > DRAIN_WAIT:
            self._cancel_step()  # every rank ended, but srun waits for something they left holding the step

    def _end(self, rank: int, code: int) -> None:
        assert self._events is not None
        self._release(rank, everything=True)
        self._ended.add(rank)
        hello = self._hellos.get(rank)
        cause = ""
        if hello is None and code:
            said = "; ".join(self._srun_said[-3:]) or f"srun exited with code {code}"
            cause = f"did not start: {said}"
        elif code < 0 and hello is not None:
            cause = f"{describe_exit(code)} (on Slurm node {hello.node})"
        # srun reports a task's end after the fact, maybe after another rank's knock-on error began the stop: a
        # death by a signal ddpnb never sent (a SIGKILL before the escalation, a SIGSEGV) is the rank's own failure
        stopped = bool(self._sent) and code != 0 and not (code < 0 and -code not in self._sent)
        self._events.exited(rank, code, stopped=stopped, cause=cause)

    # --- stopping ------------------------------------------------------------------------------------------------
    def stop(self, ranks: list[int], failed: bool) -> float | None:
        self._signal_step("TERM")
        return STOP_GRACE

    def escalate(self) -> float | None:
        self._signal_step("KILL")
        for _, conn, _ in self._conns.values():  # each rank's lifeline: it kills its own process group
            _shut(conn)
        return None

    def _signal_step(self, name: str) -> None:
        self._sent.add(signal.Signals[f"SIG{name}"])
        step = self._step()
        if step:
            allocation.scancel(f"--signal={name}", step)
        elif self._srun is not None and self._srun.poll() is None:  # no task has said its step yet: srun ends it
            self._srun.send_signal(signal.SIGTERM)

    def _step(self) -> str:
        hello = next(iter(self._hellos.values()), None)
        return hello.step if hello is not None and not hello.step.endswith(".") else ""

    def _cancel_step(self) -> None:
        self._sent |= {signal.SIGTERM, signal.SIGKILL}  # scancel's own way: TERM, then KILL
        step = self._step()
        if step:
            allocation.scancel(step)
        if self._srun is not None and self._srun.poll() is None:
            self._srun.send_signal(signal.SIGTERM)

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each rank's training thread's stack, sent by the rank's own channel thread when asked."""
        asked = []
        for rank in ranks:
            self._stacks.pop(rank, None)  # an earlier request's late answer: wait for the new one
            conn = self._conn_of(rank)
            if conn is not None:
                self._send(conn, Control.STACKS)
                asked.append(rank)
        deadline = time.monotonic() + STACK_WAIT
        while time.monotonic() < deadline and not set(asked) <= self._stacks.keys():
            self._read_ready(0.05)
        return {rank: self._stacks.pop(rank) for rank in ranks if rank in self._stacks}

    def _conn_of(self, rank: int) -> Connection | None:
        return next((conn for owner, conn, _ in self._conns.values() if owner == rank), None)

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        """A session's command to each of `ranks`, on its connection (no shipment: big data is in the pickle)."""
        for rank in ranks:
            self._deliver(rank, Control.COMMAND, command)
        try:
            if self._wake_w >= 0:  # the reader reads at once, not after its pause: the answer may be quick
                os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # wake-ups pending already, or the run just ended
            pass

    def interrupt(self, ranks: list[int]) -> None:
        """Each rank's channel thread raises SIGINT in its main thread: KeyboardInterrupt in the running command."""
        for rank in ranks:
            self._deliver(rank, Control.INTERRUPT)

    def _deliver(self, rank: int, kind: Control, value: Any = None) -> None:
        """On the rank's connection once it has its setup; until then queued behind it (`_set_up`)."""
        with self._send_lock:
            conn = self._ready.get(rank)
            if conn is not None:
                _write(conn, kind, value)
            elif rank not in self._closed:
                self._queued.setdefault(rank, []).append((kind, value))

    def close(self) -> None:
        """The step ended or cancelled, srun gone, the door shut, every connection closed (each rank's lifeline)."""
        self._closing = True
        srun = self._srun
        if srun is not None and srun.poll() is None:
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
        if self._listener is not None:
            _knock(self._listener.address)  # wakes the acceptor's accept(), which then sees `_closing`
            self._listener.close()
            self._listener = None
        with self._send_lock:
            for _, conn, _ in self._conns.values():
                conn.close()
            self._conns, self._ready, self._queued = {}, {}, {}
        while not self._arrivals.empty():
            self._arrivals.get_nowait()[0].close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        self._selector.close()
        if self._own_job is not None:  # the step is gone: the job asked for it goes back
            self._own_job.release()
            self._own_job = None
        self._events = None  # the run and its value go with the caller's last reference, not at the next gc


def selectors_wait(fds: list[int], timeout: float) -> None:
    """Until one of `fds` is readable or `timeout` passes."""
    with selectors.DefaultSelector() as waiter:
        for fd in fds:
            waiter.register(fd, selectors.EVENT_READ)
        waiter.select(max(0.0, timeout))


def _write(conn: Connection, kind: Control, value: Any = None) -> None:
    """One frame to a rank (under the engine's send lock)."""
    try:
        conn.send_bytes(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:  # the rank is gone: srun says how
        return


def _task_ids(text: str) -> list[int]:
    """srun's task list: '3', '0-1', '0,2-3'."""
    ids: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids


def _shut(conn: Connection) -> None:
    try:
        socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)
    except OSError:
        return


def _knock(address: tuple[str, int]) -> None:
    try:
        socket.create_connection(address, timeout=1).close()
    except OSError:
        return


def _peer(peer: Any) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) == 2 else str(peer)
