"""A detached run's supervisor on Ray (`--engine ray --detach`, docs/detached.md "On Ray"): a detached actor in
the cluster, named after the run in ddpnb's namespace, that runs the same supervisor the local engine forks
(`ddpnb.detached.supervisor.main`), with this engine inside the cluster.

The actor, not the kernel, owns what the run asks of Ray: the nodes' hosts (which fork the ranks) and the run's
placement group. Ray ends both with the actor, so its death (killed, or its node lost) ends the ranks, as the
kernel's does for an ordinary run. Where the kernel and the actor share the run directory (the same machine, or a
file system both mount), the plan, the journal, the door and the result live there, and the actor exits once the
run has ended and everything is written. Where they do not (a kernel connected through Ray Client, `ray://`), the
run is *served*: the plan travels in the call that starts the actor, which keeps the run directory on its node and
serves what a viewer reads (`read`) and the commands (`ask`) as actor methods, which only holders of the
cluster's access reach; it exits once a viewer collected the run's end (`collected`), or KEEP_SERVED after it.
"""

from __future__ import annotations

import importlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from ddpnb.core import rundir
from ddpnb.core.spec import LaunchError

NAMESPACE = "ddpnb"  # Ray namespace of every detached run's supervisor
PREFIX = "ddpnb-supervisor-"  # + the run's name: the supervisor actor's name
# by name, as a Slurm batch job runs it (`python -m`): engines sit below detached runs in ddpnb's layers
SUPERVISOR = "ddpnb.detached.supervisor"
FILES = "ddpnb.detached.files"
CALL_WAIT = 120.0  # seconds a new actor may take to start (its worker imports ddpnb)
ASK_WAIT = 30.0  # seconds a viewer's command may take, as at the door (`ddpnb.detached.files.ASK_WAIT`)
KEEP_SERVED = 24 * 3600.0  # seconds a served run's actor keeps its end and result for a viewer after the run ended
READ_WAIT = 0.5  # seconds a viewer's `read` waits at the end of a growing file for more (a long poll)
READ_MOST = 4 << 20  # bytes one `read` returns at most
SERVING = 16  # calls the actor answers at once: the run's own, and viewers' reads and commands


def actor_name(run_dir: str) -> str:
    return PREFIX + Path(run_dir).name


def run_name(actor: str) -> str:
    return actor.removeprefix(PREFIX)


class Supervisor:
    """The detached actor (0 CPUs: the ranks' bundles hold the run's resources) that owns one detached run."""

    def __init__(self) -> None:
        self.run_dir = ""
        self._collected = threading.Event()

    def sees(self, run_dir: str) -> str:
        """Where this actor runs, if the kernel's run directory is there too; '' where it is not (no shared file
        system between the kernel and this node)."""
        import socket

        return socket.getfqdn() if Path(run_dir).is_dir() else ""

    def supervise(self, run_dir: str) -> None:
        """Own the run until it ends and everything is written, then leave the cluster (this actor exits)."""
        self.run_dir = run_dir
        self._own(run_dir)
        self._exit()

    def place(self, name: str, plan: bytes) -> tuple[str, str]:
        """Make the run directory of this node's for the run planned in `plan` (the kernel's pickled plan); where
        it is (`where`). A call of its own, answered before `serve`: this actor's calls run concurrently."""
        path = rundir.runs_root() / name
        path.mkdir(mode=0o700)
        importlib.import_module(FILES).private_write(path / importlib.import_module(FILES).PLAN, plan)
        self.run_dir = str(path)
        return self.where()

    def serve(self) -> None:
        """Own the run `place` planned, serving it to viewers meanwhile; once it ended, keep serving its end until
        a viewer collected it (or KEEP_SERVED)."""
        path = Path(self.run_dir)
        self._own(self.run_dir)
        if (path / importlib.import_module(FILES).ENDED).exists():  # else it never ran, or its end is lost: leave
            self._collected.wait(KEEP_SERVED)
        self._exit()

    def where(self) -> tuple[str, str]:
        """The node this actor runs on and its run directory there."""
        import socket

        return socket.getfqdn(), self.run_dir

    def read(self, name: str, offset: int = 0, wait: float = 0.0, most: int = -1) -> bytes | None:
        """The bytes of the run directory's file `name` from `offset` (at most `most`, and READ_MOST); None where
        it does not exist (yet). With `wait`, a file with nothing past `offset` is waited on that long for more."""
        if not self.run_dir or os.sep in name or name in ("", ".", "..", importlib.import_module(FILES).SECRET):
            return None
        deadline = time.monotonic() + min(wait, READ_WAIT)
        while True:
            try:
                fd = os.open(Path(self.run_dir) / name, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                data = None
            else:
                try:
                    data = os.pread(fd, READ_MOST if most < 0 else min(most, READ_MOST), offset)
                finally:
                    os.close(fd)
            if data or time.monotonic() >= deadline:
                return data
            time.sleep(0.02)

    def ask(self, what: str, timeout: float) -> tuple[str, Any]:
        """A viewer's command (status, stacks, stop) sent on to the supervisor's door on this node: ('ok',
        answer) or ('error', why)."""
        try:
            return "ok", importlib.import_module(FILES).ask(Path(self.run_dir), what, timeout)
        except RuntimeError as exc:
            return "error", str(exc)

    def collected(self) -> None:
        """A viewer has the run's end (its result, or why there is none): this actor may leave once it ended."""
        self._collected.set()

    def _own(self, run_dir: str) -> None:
        import traceback

        try:
            importlib.import_module(SUPERVISOR).main(run_dir)
        except BaseException:  # noqa: BLE001 - into supervisor.log (main sends stderr there); the kernel reads why
            traceback.print_exc()

    def _exit(self) -> None:
        import ray

        ray.actor.exit_actor()


class RayHome:
    """`SupervisorHome` on Ray: the supervisor as a detached actor, in the cluster the options name. `served`:
    the kernel does not see the actor's run directory (Ray Client, or no shared file system), so the actor serves
    the run (`ServedRun`)."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.served = False

    def start(self, run_dir: str) -> str:
        import ray

        from ddpnb.engines.ray import cluster
        from ddpnb.engines.ray.train import near_this_kernel

        connected = cluster.connect_lasting(self.address)
        name = actor_name(run_dir)
        actor = (
            ray.remote(Supervisor)
            .options(
                name=name,
                namespace=NAMESPACE,
                lifetime="detached",  # not the kernel's: it stays when the kernel goes
                num_cpus=0,
                max_restarts=0,  # a supervisor started again would start the run again
                max_concurrency=SERVING,  # viewers' reads and commands while the run's own call owns it
                scheduling_strategy=near_this_kernel(),  # the kernel's node where it is one: its files are there
            )
            .remote()
        )
        try:
            node = ray.get(actor.sees.remote(run_dir), timeout=CALL_WAIT)
        except Exception as exc:  # noqa: BLE001 - Ray's: a timeout, the actor's worker died while starting
            ray.kill(actor)
            raise LaunchError(
                f"the detached run's supervisor could not start in the Ray cluster ({type(exc).__name__}: {exc})"
            ) from None
        # through Ray Client the kernel reads nothing of the cluster's nodes, even where it runs on one of them
        self.served = client_connected() or not node
        if self.served:
            plan = (Path(run_dir) / importlib.import_module(FILES).PLAN).read_bytes()  # the kernel's `_start_at`'s
            # the run lives in the actor's node's run directory of the same name: where that is this machine's runs
            # directory too, the kernel's must not be in the way (the kernel keeps nothing of a served run)
            shutil.rmtree(run_dir, ignore_errors=True)
            node = ray.get(actor.place.remote(Path(run_dir).name, plan), timeout=CALL_WAIT)[0]
            actor.serve.remote()
            how = "served to this kernel through Ray (it keeps the run directory on its node)"
        else:
            actor.supervise.remote(run_dir)
            how = "sharing this kernel's run directory"
        return f"Ray actor {name} (namespace {NAMESPACE}) on {node}, {how}; {connected.removeprefix('[ddpnb] ')}"

    def alive(self, run_dir: str) -> bool | None:
        """Whether the run's supervisor actor lives, as the cluster says; None where this kernel has no Ray."""
        import ray

        if not ray.is_initialized():
            return None
        try:
            ray.get_actor(actor_name(run_dir), namespace=NAMESPACE)
        except ValueError:  # Ray's word for a name no live actor has
            return False
        return True

    def end(self, run_dir: str) -> None:
        """Kill the supervisor actor (a launch given up on, a stop whose door cannot be reached)."""
        import ray

        try:
            ray.kill(ray.get_actor(actor_name(run_dir), namespace=NAMESPACE))
        except ValueError:  # gone already
            pass

    def source(self, run_dir: str) -> ServedRun | None:
        """How a viewer reads the run: through the actor where it is served; None: the run directory."""
        return ServedRun(Path(run_dir).name) if self.served else None


def client_connected() -> bool:
    """Whether this process reaches Ray through Ray Client (`ray://`)."""
    import ray

    return ray.util.client.ray.is_connected()


def served_runs() -> list[ServedRun]:
    """The detached runs whose supervisor actors live in the cluster this kernel is connected to, served to it or
    not; none where this kernel has no connection to Ray (none is made for it)."""
    import sys

    if "ray" not in sys.modules:
        return []
    import ray

    if not ray.is_initialized():
        return []
    actors = ray.util.list_named_actors(all_namespaces=True)
    named = sorted(a["name"] for a in actors if a["namespace"] == NAMESPACE and a["name"].startswith(PREFIX))
    return [ServedRun(run_name(name)) for name in named]


class ServedRun:
    """A viewer's way to a detached run through its supervisor actor (`Supervisor.read`, `.ask`): what
    `ddpnb.detached.files.RunDir` is for a run directory this kernel sees."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._actor: Any = None
        self._where: tuple[str, str] | None = None

    def _handle(self) -> Any:
        import ray

        if self._actor is None:
            self._actor = ray.get_actor(PREFIX + self.name, namespace=NAMESPACE)
        return self._actor

    def _call(self, method: str, *args: Any, timeout: float = CALL_WAIT) -> Any:
        """The actor's answer; RuntimeError where it is gone."""
        import ray

        try:
            return ray.get(getattr(self._handle(), method).remote(*args), timeout=timeout)
        except ValueError:  # no live actor has the name
            raise RuntimeError(f"the run {self.name}'s supervisor actor is gone from the Ray cluster") from None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise RuntimeError(
                f"the run {self.name}'s supervisor actor cannot be reached ({type(exc).__name__})"
            ) from None

    @property
    def path(self) -> Path:
        """The run directory, on the actor's node (this kernel may not see it)."""
        if self._where is None:
            self._where = self._call("where")
        return Path(self._where[1])

    @property
    def place(self) -> str:
        """Where the run's files are, for messages."""
        if self._where is None:
            try:
                self._where = self._call("where")
            except RuntimeError:
                return f"Ray actor {PREFIX}{self.name}'s node (gone)"
        return f"{self._where[1]} on Ray node {self._where[0]}"

    def read(self, name: str, offset: int = 0, wait: float = 0.0, most: int = -1) -> bytes | None:
        try:
            return self._call("read", name, offset, wait, most)
        except RuntimeError:
            return None

    def ask(self, what: str, timeout: float = ASK_WAIT) -> Any:
        status, value = self._call("ask", what, timeout, timeout=timeout + CALL_WAIT)
        if status != "ok":
            raise RuntimeError(value)
        return value

    def supervised(self) -> bool:
        return RayHome(None).alive(self.name) is True

    def queued(self) -> str:
        """Nothing: the actor serving it exists once the run is launched (it is what serves this)."""
        return ""

    def end(self) -> bool:
        RayHome(None).end(self.name)
        return True

    def collected(self) -> None:
        try:
            self._call("collected")
        except RuntimeError:  # gone already: nothing to release
            pass
