"""What a detached run keeps in its run directory besides what every run does, and the client of its door.

Every file is the user's alone (0600 in the 0700 run directory). The secret is written there and nowhere else:
never in an environment or a command line.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
from dataclasses import dataclass
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any, Protocol

# JSON: what the run is (function, ranks, engine, ddpnb version; the supervisor's PID once it runs): written by the
# kernel when a supervisor elsewhere was accepted (a batch job in the queue), then by the supervisor as it starts
MARKER = "detached"
SECRET = "secret"  # the run's secret: bytes a viewer proves at the door
DOOR = "door"  # JSON: the door's host and port
ALIVE = "supervisor.lock"  # held (flock) by the supervisor for its whole life
LOG = "supervisor.log"  # the supervisor's stdout and stderr: what it refused, what went wrong
RESULT = "result.pickle"  # rank 0's value, kept until the run directory is cleaned
RESULT_ERROR = "result.error"  # why rank 0's value could not be kept
ENDED = "ended.json"  # the outcome, written when the run has ended and everything is written
PLAN = "plan.pickle"  # what the kernel checked and planned, for a supervisor its engine starts elsewhere
STARTED = "started"  # written by such a supervisor once every rank started (its PID)
FAILED = "failed"  # ...or why it could not start the run
HOME = "home.pickle"  # such a supervisor's home (`core.engine.SupervisorHome`): whether it lives, how to end it
ASK_WAIT = 30.0  # seconds a command across the gap may take (stacks: a few; a stop: the engine's grace)


@dataclass(frozen=True)
class Ask:
    """A viewer's command at the door, once the secret is proven: 'status', 'stacks' or 'stop'."""

    what: str


def private_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all (a reader never sees half), readable by this user only."""
    partial = _written(path.with_name(path.name + ".partial"), data)
    os.replace(partial, path)


def write_unless_there(path: Path, data: bytes) -> None:
    """`private_write`, but a file already at `path` stays: written meanwhile by the one who knows better."""
    partial = _written(path.with_name(path.name + ".first"), data)
    try:
        os.link(partial, path)  # atomic, and never over an existing file (os.replace would be)
    except FileExistsError:
        pass
    finally:
        partial.unlink()


def _written(path: Path, data: bytes) -> Path:
    """`path`, made (or emptied) readable by this user only, holding `data`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return path


def hold_alive(run_dir: Path) -> int:
    """The supervisor's lock: held until it exits, however it exits (SIGKILL included)."""
    fd = os.open(run_dir / ALIVE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def supervised(run_dir: Path) -> bool:
    """Whether the run's supervisor is alive: it holds its lock, or its home elsewhere says it lives (a batch job
    still in the queue or running: a lock taken on another machine may not show here, on a shared filesystem)."""
    if _locked(run_dir):
        return True
    where = home(run_dir)
    return where is not None and where.alive(str(run_dir)) is True


def _locked(run_dir: Path) -> bool:
    try:
        fd = os.open(run_dir / ALIVE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def home(run_dir: Path) -> Any:
    """The home an engine keeps the run's supervisor in (a `core.engine.SupervisorHome`), or None: this machine."""
    try:
        return pickle.loads((run_dir / HOME).read_bytes())
    except (OSError, pickle.UnpicklingError, ImportError, AttributeError):
        return None


def queued(run_dir: Path) -> str:
    """What the run's supervisor waits for in its platform's queue ('slurm job 12 pending (Priority)'), else ''."""
    if _locked(run_dir):  # it runs: no need to ask the queue (whose answer is kept a while, and would be stale)
        return ""
    waiting = getattr(home(run_dir), "waiting", None)
    return waiting(str(run_dir)) if waiting is not None else ""


def end_supervisor(run_dir: Path) -> bool:
    """End the supervisor by its platform's means (`scancel` of its batch job), where its home can; whether it
    could. For a stop whose door cannot be reached, and a launch that gave up on its supervisor."""
    where = home(run_dir)
    end = getattr(where, "end", None)
    if end is None:
        return False
    end(str(run_dir))
    return True


def marker(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def ended(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / ENDED).read_text())
    except (OSError, ValueError):
        return None


class RunSource(Protocol):
    """Where a viewer reads a detached run and sends its commands: its run directory (`RunDir`), or the engine
    that serves it from a run directory this kernel does not see (`engines.ray.detach.ServedRun`)."""

    name: str
    place: str  # where the run's files are, for messages

    def read(self, name: str, offset: int = 0, wait: float = 0.0, most: int = -1) -> bytes | None: ...
    def ask(self, what: str, timeout: float = ASK_WAIT) -> Any: ...
    def supervised(self) -> bool: ...
    def queued(self) -> str: ...
    def end(self) -> bool: ...
    def collected(self) -> None: ...


class RunDir:
    """A viewer's way to a detached run whose run directory this kernel sees (the same machine, a shared file
    system). A run served through its engine (`engines.ray.detach.ServedRun`) has the same methods."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.name
        self.place = str(path)

    def read(self, name: str, offset: int = 0, wait: float = 0.0, most: int = -1) -> bytes | None:
        """The bytes of the run directory's file `name` from `offset` (at most `most`); None where it does not
        exist (yet)."""
        del wait  # a file here is read again at once: no call to save
        try:
            with open(self.path / name, "rb") as file:
                file.seek(offset)
                return file.read(most)
        except FileNotFoundError:
            return None

    def ask(self, what: str, timeout: float = ASK_WAIT) -> Any:
        return ask(self.path, what, timeout)

    def supervised(self) -> bool:
        return supervised(self.path)

    def queued(self) -> str:
        return queued(self.path)

    def end(self) -> bool:
        return end_supervisor(self.path)

    def collected(self) -> None:
        """Nothing to release: the run directory keeps the result until it is cleaned."""


def json_of(source: RunSource, name: str) -> dict[str, Any] | None:
    """The JSON file `name` (MARKER, ENDED) of the run `source` reads; None where it is not there (yet)."""
    data = source.read(name)
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        return None


def ask(run_dir: Path, what: str, timeout: float = ASK_WAIT) -> Any:
    """Send a command to the run's supervisor through its door, proving the secret; its answer. RuntimeError
    where the supervisor is gone or said it could not."""
    try:
        secret = (run_dir / SECRET).read_bytes()
        where = json.loads((run_dir / DOOR).read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"the run in {run_dir} takes no commands: its door is not there ({exc})") from None
    try:
        with Client((where["host"], where["port"]), authkey=secret) as conn:
            conn.send_bytes(pickle.dumps(Ask(what)))
            if not conn.poll(timeout):
                raise RuntimeError(f"the run's supervisor did not answer {what!r} within {timeout:g} s")
            status, value = pickle.loads(conn.recv_bytes())
    except (OSError, EOFError) as exc:
        raise RuntimeError(
            f"the run's supervisor cannot be reached ({type(exc).__name__}: {exc}): "
            f"{'it is gone' if not supervised(run_dir) else 'see ' + str(run_dir / LOG)}"
        ) from None
    if status != "ok":
        raise RuntimeError(f"the run's supervisor could not {what}: {value}")
    return value
