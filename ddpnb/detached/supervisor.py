"""The owner of a detached run: a process of its own session, forked from the kernel's forkserver (torch is
imported there already), that runs the run's `Lifecycle` with the journal on, as the kernel does for an ordinary
run, until the run ends and everything is written.

It forks its ranks from a forkserver of its own, forked from itself before it starts any thread (a process with
threads must not fork); the ranks' lifeline is the supervisor, so its death ends them as the kernel's ends an
ordinary run's. Both forks are made ahead of the run: each detached launch hands its plan to a supervisor forked
after the one before (a standby), and forks the next one. Commands across the gap (status, stacks, stop) come
through a door (`remote.door`) that lets in only a connection proving the run's secret; a stranger is refused and
logged in the supervisor's log.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import pickle
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cloudpickle

from ddpnb import engines
from ddpnb.core.journal import entries
from ddpnb.core.policy import RestartPolicy
from ddpnb.core.record import Outcome
from ddpnb.core.run import Run, RunSetup
from ddpnb.core.spec import LaunchError, WorkerSpec
from ddpnb.detached import files
from ddpnb.node import forkserver, orphans
from ddpnb.node.rank import PROCESS_PREFIX
from ddpnb.remote.door import Door

if TYPE_CHECKING:
    from ddpnb.core.engine import SupervisorHome

START_WAIT = 120.0  # seconds the kernel waits for the supervisor to have started every rank
LET_GO_WAIT = 10.0  # seconds a standby let go of may take to end, with its forkserver


@dataclass(frozen=True)
class DetachedPlan:
    """What the kernel checked and planned for a detached run: all the supervisor needs to own it."""

    spec: WorkerSpec
    devices: list[str]
    engine: str
    engine_options: Any
    function: str
    max_restarts: int
    stall: float | None
    notes: list[str]


def start(plan: DetachedPlan) -> tuple[str, files.RunSource]:
    """Start the run's supervisor and wait until it has started every rank; a line saying where it runs, and where
    a viewer reads the run. On this machine it is forked from the kernel's forkserver; an engine with a
    `supervisor_home` (a batch job, a detached actor) starts it there from the plan written into the run directory.
    Raises LaunchError with the supervisor's own words where it could not start the run."""
    engine_type = engines.engine_type(plan.engine)
    home = getattr(engine_type, "supervisor_home", None)
    place = None if home is None else home(plan.engine_options, plan.spec)  # None: this machine's, here
    run_dir = Path(plan.spec.run_dir)
    if place is None:
        return f"supervisor: process {_fork(plan)} on this machine", files.RunDir(run_dir)
    return _start_at(place, plan)


def _start_at(home: SupervisorHome, plan: DetachedPlan) -> tuple[str, files.RunSource]:
    run_dir = Path(plan.spec.run_dir)
    files.private_write(run_dir / files.PLAN, cloudpickle.dumps(plan))  # the args may hold notebook objects
    try:
        where = home.start(str(run_dir))
    except BaseException:
        # a launch refused leaves no run directory (`rundir.remove_if_empty`)
        (run_dir / files.PLAN).unlink(missing_ok=True)
        raise
    served = getattr(home, "source", lambda run_dir: None)(str(run_dir))
    source = served or files.RunDir(run_dir)
    if served is None:  # any later kernel asks it too (`files.supervised`)
        files.private_write(run_dir / files.HOME, pickle.dumps(home))
        # listed (`ddpnb.runs()`, queued while its job waits) from now on: a kernel that dies meanwhile leaves it
        # queued
        files.write_unless_there(run_dir / files.MARKER, _marker(plan))
    try:
        _await_start(home, source, where, str(run_dir))
    except BaseException:  # given up (an interrupt, too): a supervisor must not start later for a launch that failed
        source.end()
        if served is None:
            (run_dir / files.MARKER).unlink(missing_ok=True)  # a launch that failed is no run to list
        raise
    return f"supervisor: {where}", source


def _await_start(home: SupervisorHome, source: files.RunSource, where: str, run_dir: str) -> None:
    """Until the supervisor started every rank; while its home waits in a queue, say so (no deadline runs then)."""
    deadline, said = time.monotonic() + START_WAIT, ""
    waiting = getattr(home, "waiting", None)
    while source.read(files.STARTED) is None:
        failed = source.read(files.FAILED)
        if failed is not None:
            raise LaunchError(failed.decode())
        queued = waiting(run_dir) if waiting is not None else ""
        if queued:
            if queued != said:
                print(
                    f"[ddpnb] the detached run waits in the queue: {queued}; it starts when its job runs, and outlives "
                    "this kernel from now on (interrupt to cancel it)",
                    file=sys.stderr,
                    flush=True,
                )
            said, deadline = queued, time.monotonic() + START_WAIT
        elif home.alive(run_dir) is False and source.read(files.STARTED) is None:
            raise LaunchError(
                f"the detached run's supervisor ({where}) ended while starting: see {files.LOG} in {source.place}"
            )
        if time.monotonic() > deadline:
            raise LaunchError(
                f"the detached run's supervisor ({where}) did not start its ranks within {START_WAIT:g} s: see "
                f"{files.LOG} in {source.place}"
            )
        time.sleep(0.05)


def main(run_dir: str, facing: str = "") -> None:
    """A supervisor started by its engine's home (`python -m ddpnb.detached.supervisor RUN_DIR [HOST]`): own the
    run planned in `run_dir` until it ends; say it started, or why not, in that directory. Its door listens on
    this machine's address on the route to `facing` (the launching kernel's host), else on its full name."""
    path = Path(run_dir)
    _log_to(path / files.LOG)

    def said(what: str, value: Any) -> None:
        files.private_write(path / (files.STARTED if what == "started" else files.FAILED), str(value).encode())

    try:
        plan = _rooted(pickle.loads((path / files.PLAN).read_bytes()), path)
    except LaunchError as exc:
        said("failed", exc)
        raise

    _supervise(plan, said, door_host=_address_facing(facing) if facing else socket.getfqdn())


def _rooted(plan: DetachedPlan, run_dir: Path) -> DetachedPlan:
    """The plan with its run in `run_dir`: a served run's supervisor keeps it in a run directory of its own node's,
    not the kernel's (its checkpoints too, unless --checkpoint-dir named where)."""
    spec = plan.spec
    if Path(spec.run_dir) == run_dir:
        return plan
    checkpoints = spec.checkpoint_dir
    if Path(checkpoints).parent == Path(spec.run_dir):
        checkpoints = str(run_dir / Path(checkpoints).name)
    if spec.resume_dir and not Path(spec.resume_dir).is_dir():
        raise LaunchError(
            f"the run to resume from, {spec.resume_dir}, is not on the node of the detached run's supervisor: a "
            "run served through Ray Client resumes from a run directory on that node, or leave out resume."
        )
    return dataclasses.replace(plan, spec=dataclasses.replace(spec, run_dir=str(run_dir), checkpoint_dir=checkpoints))


def _address_facing(host: str) -> str:
    """This machine's address on the route to `host` (a connected UDP socket sends nothing: it asks the routes)."""
    try:
        target = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            return probe.getsockname()[0]
    except OSError:  # the name does not resolve here: this machine's full name then
        return socket.getfqdn()


def _fork(plan: DetachedPlan) -> int:
    """Hand the run to a supervisor forked from the kernel's forkserver (the standby forked after the last
    detached launch, else one forked now), wait until it has started every rank, then fork the next standby in
    the background; the supervisor's PID."""
    name = f"{PROCESS_PREFIX}supervisor"
    # the args may hold objects defined in the notebook; sys.path and the directory as they are now, not as
    # they were when the standby was forked
    preparation = multiprocessing.spawn.get_preparation_data(name)
    preparation["authkey"] = bytes(preparation["authkey"])  # pickled only as plain bytes, over a socketpair
    for main in ("init_main_from_name", "init_main_from_path"):  # never the script's main module, as for a rank
        preparation.pop(main, None)
    payload = cloudpickle.dumps((plan, preparation))
    standby = _Standby.take()
    try:
        standby.conn.send_bytes(payload)
    except OSError:  # it died meanwhile (ended by hand, or by a `preload`): one forked now instead
        standby.conn.close()
        standby = _Standby(forkserver.context())
        standby.conn.send_bytes(payload)
    try:
        if not standby.conn.poll(START_WAIT):
            os.kill(standby.pid, signal.SIGKILL)
            raise LaunchError(
                f"the detached run's supervisor did not start its ranks within {START_WAIT:g} s: see "
                f"{Path(plan.spec.run_dir) / files.LOG}"
            )
        said, value = pickle.loads(standby.conn.recv_bytes())
    except EOFError:
        raise LaunchError(
            f"the detached run's supervisor died while starting: see {Path(plan.spec.run_dir) / files.LOG}"
        ) from None
    finally:
        standby.conn.close()
    threading.Thread(target=_Standby.prepare, name="ddpnb-standby", daemon=True).start()
    if said != "started":
        raise LaunchError(value)
    return value


class _Standby:
    """A supervisor forked ahead of its run: in a session of its own, its own forkserver forked, waiting for a
    plan on its connection. The next detached launch then costs no fork of a process holding torch (two, ~18 ms
    each); it exits when the kernel lets go of it (the kernel's exit, or a `preload` restarting the forkserver
    it was forked from)."""

    _next: _Standby | None = None
    _lock = threading.Lock()

    def __init__(self, context: multiprocessing.context.BaseContext) -> None:
        self.conn, theirs = context.Pipe(duplex=True)
        with forkserver.lock:  # the orphan sweep must know it as a supervisor before it leaves the session
            process = context.Process(target=stand_by, args=(theirs,), name=f"{PROCESS_PREFIX}supervisor", daemon=False)
            process.start()
            forkserver.spare(process.pid, self.let_go)
        theirs.close()
        # the kernel never joins it: at the kernel's exit multiprocessing would wait for the run to end
        multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
        self.pid = process.pid

    def let_go(self) -> None:
        """End it before `preload` replaces the forkserver it was forked from: close its connection (it returns)
        and wait until it and its own forkserver have ended. That forkserver, orphaned, goes to the kernel's
        forkserver (a subreaper) for a moment, where `preload` would take it for a pool of the user's."""
        below = orphans.children(self.pid)
        self.conn.close()
        deadline = time.monotonic() + LET_GO_WAIT
        while any(map(orphans.running, [self.pid, *below])) and time.monotonic() < deadline:
            time.sleep(0.01)

    @classmethod
    def take(cls) -> _Standby:
        """The standby ready for this launch, or one forked now (the first detached launch in this kernel)."""
        with cls._lock:
            standby, cls._next = cls._next, None
        return standby if standby is not None else cls(forkserver.context())

    @classmethod
    def prepare(cls) -> None:
        """Fork the next launch's standby (on a thread of the kernel's: the fork is the forkserver's)."""
        try:
            standby = cls(forkserver.context())
        except Exception:  # noqa: BLE001 - the kernel shuts down, say: the next launch forks its own, as the first
            return
        with cls._lock:
            standby, cls._next = cls._next, standby
        if standby is not None:  # two launches at once each forked one: one is enough
            standby.conn.close()


def standby() -> list[int]:
    """The PIDs of the supervisor waiting for this process's next detached launch and of its forkserver, kept
    like the kernel's forkserver for the whole session; [] before the first detached launch, or once it is gone."""
    waiting = _Standby._next
    if waiting is None or waiting.conn.closed:
        return []
    return [pid for pid in [waiting.pid, *orphans.children(waiting.pid)] if os.path.exists(f"/proc/{pid}")]


def stand_by(conn: multiprocessing.connection.Connection) -> None:
    """multiprocessing target, in the process forked for the next detached run: get ready (a session and a
    forkserver of its own, before any thread), wait for its plan, then own the run until it ends."""
    os.setsid()  # out of the kernel's session and process group: what ends the kernel does not reach it
    _own_forkserver(conn.fileno())  # first: no thread runs yet
    # looked up once in a process, from package metadata (~15 ms): before the plan comes, not after
    engines.names(), entries.version(), entries.schema()
    try:
        payload = conn.recv_bytes()
    except EOFError:  # let go of before a launch came
        return
    plan, preparation = pickle.loads(payload)
    multiprocessing.spawn.prepare(preparation)
    _log_to(Path(plan.spec.run_dir) / files.LOG)

    def said(what: str, value: Any) -> None:
        conn.send_bytes(pickle.dumps((what, value)))
        if what == "started":
            conn.close()

    _supervise(plan, said, door_host="127.0.0.1")


def _supervise(plan: DetachedPlan, said: Callable[[str, Any], None], door_host: str) -> None:
    """Own the run until it ends and everything is written; `said` tells the kernel it started, or why not."""
    run_dir = Path(plan.spec.run_dir)
    alive = files.hold_alive(run_dir)
    files.private_write(run_dir / files.MARKER, _marker(plan, pid=os.getpid()))
    try:
        run = _owned(plan)
        door = _open_door(run, run_dir, door_host)
        run.start()
    except BaseException as exc:  # the kernel says it: the launch failed; raised on, into the log
        said("failed", str(exc) if isinstance(exc, LaunchError) else f"{type(exc).__name__}: {exc}")
        raise
    said("started", os.getpid())
    record = run.wait()
    _keep_result(run, run_dir)
    files.private_write(
        run_dir / files.ENDED,
        json.dumps({"outcome": record.outcome.value, "note": record.note, "duration": record.duration}).encode(),
    )
    door.close()
    os.close(alive)


def _marker(plan: DetachedPlan, **more: Any) -> bytes:
    about = {
        "function": plan.function,
        "world_size": plan.spec.world_size,
        "engine": plan.engine,
        "started": time.time(),
        "ddpnb": entries.version(),
        "uid": os.getuid(),
    }
    return json.dumps({**about, **more}).encode()


class _Unattended:
    """The front end of a run nobody waits on: no prompts (a detached run takes none), no view."""

    def answer_prompts(self, run: Run) -> None:
        pass

    def debug(self, run: Run, rank: int) -> None:
        raise RuntimeError("a detached run takes no debugger answers")

    def show(self, run: Run) -> None:
        pass  # nobody displays the supervisor's handle: viewers attach

    def view_failed(self, view: str, exc: Exception) -> None:
        print(f"[ddpnb supervisor] the {view} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _owned(plan: DetachedPlan) -> Run:
    engine_type = engines.engine_type(plan.engine)
    run = Run(
        RunSetup(
            spec=plan.spec,
            devices=plan.devices,
            engine=plan.engine,
            capabilities=engine_type.capabilities,
            new_engine=functools.partial(engine_type.create, options=plan.engine_options),
            front_end=_Unattended(),
            function=plan.function,
            policy=RestartPolicy(plan.max_restarts),
            stall=plan.stall,
            journal=True,
        )
    )
    for note in plan.notes:
        run.record.add_launch_note(note)
    return run


def _keep_result(run: Run, run_dir: Path) -> None:
    """Rank 0's value into the run directory: the memory file it arrived in goes with this process."""
    if run.record.outcome is not Outcome.SUCCEEDED:
        return
    try:
        files.private_write(run_dir / files.RESULT, cloudpickle.dumps(run.attempt.result.take()))
    except Exception as exc:  # noqa: BLE001 - a value that cannot be pickled again: said where `result()` looks
        files.private_write(run_dir / files.RESULT_ERROR, f"{type(exc).__name__}: {exc}".encode())


def _open_door(run: Run, run_dir: Path, host: str) -> Door:
    secret = secrets.token_bytes(32)
    fd = os.open(run_dir / files.SECRET, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)

    def admit(conn: multiprocessing.connection.Connection, ask: files.Ask) -> None:
        threading.Thread(target=_answer, args=(run, conn, ask), name="ddpnb-detached-ask", daemon=True).start()

    def refuse(peer: Any, exc: BaseException) -> None:
        print(
            f"[ddpnb supervisor] {time.strftime('%H:%M:%S')} refused a connection from {peer}: it did not prove "
            f"the run's secret ({type(exc).__name__}: {exc})",
            file=sys.stderr,
            flush=True,
        )

    door = Door(host, secret, admit, refuse, greeting=files.Ask)
    files.private_write(run_dir / files.DOOR, json.dumps({"host": door.address[0], "port": door.address[1]}).encode())
    return door


def _answer(run: Run, conn: multiprocessing.connection.Connection, ask: files.Ask) -> None:
    with conn:
        try:
            if ask.what == "status":
                value: Any = run.status
            elif ask.what == "stacks":
                value = run.stacks()
            elif ask.what == "stop":
                run.stop()
                value = run.record.outcome.value
            else:
                raise ValueError(f"no such command {ask.what!r}: status, stacks or stop")
            answer = ("ok", value)
        except Exception as exc:  # noqa: BLE001 - told to the viewer that asked
            answer = ("error", f"{type(exc).__name__}: {exc}")
        try:
            conn.send_bytes(pickle.dumps(answer))
        except OSError:  # the viewer went away
            pass


def _log_to(path: Path) -> None:
    """stdout and stderr into the run directory: the kernel's, inherited, may be gone any moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def _own_forkserver(unshared: int) -> None:
    """multiprocessing's forkserver main loop in a child forked from this process (torch is imported here
    already, so it costs a fork, not an import), made this process's forkserver; the child closes `unshared`
    (the kernel's connection: the supervisor's death must show there). The kernel's forkserver is let go of: it
    ends with the kernel, whatever this run does."""
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    address = multiprocessing.connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            os.close(unshared)
            orphans.become_subreaper()  # a dead rank's orphans come here, as to the kernel's forkserver
            multiprocessing.forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


if __name__ == "__main__":
    main(*sys.argv[1:3])
