"""A viewer's handle on a detached run: `attach(...)` from any kernel (the one that launched it too), built on the
journal's replay (`core.journal.replay.Replay.follow`): the record, the lines and the views get the run's whole
history, then follow it live; commands go to the supervisor through its door (`files.ask`). A run whose run
directory this kernel does not see (Ray Client) is read and commanded through its engine (`files.RunSource`)."""

from __future__ import annotations

import functools
import os
import pickle
import pwd
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpnb import engines
from ddpnb._options import choose_view
from ddpnb.core import hints, rundir
from ddpnb.core.announce import Subscribers
from ddpnb.core.journal import JOURNAL_FILE
from ddpnb.core.journal.frames import JournalError
from ddpnb.core.journal.replay import Replay
from ddpnb.core.record import Outcome, OutputLine, RunRecord
from ddpnb.core.report import WorkerError, diagnosis_summary
from ddpnb.core.run import TICK
from ddpnb.core.spec import LaunchError, ViewKind, is_seconds
from ddpnb.core.words import format_duration, ranks_text
from ddpnb.detached import files

SERVED_POLL = 0.5  # seconds a served run's follower waits at the journal's end for more in one call (a long poll)
FIRST_RECORD_WAIT = 30.0  # seconds attach waits for a just-launched run's journal to say what the run is
RESULT_WAIT = 10.0  # seconds `result()` waits, after the run's end, for the supervisor to have kept the value
ORPHAN_CHECK = 1.0  # seconds between two looks at whether the supervisor is still alive while waiting
QUEUE_POLL = 0.2  # seconds between two looks at a queued run's state (its home asks the queue less often)
START_WAIT = 120.0  # seconds attach waits, once a queued run's job runs, for its supervisor to start the ranks


class DetachedRun:
    """The handle of a detached run, as `launch`'s: `wait()`, `result()`, `stop()`, `stacks()`, `record`,
    `status`, `done`; displayed in a notebook, the live dashboard, its history replayed first."""

    def __init__(self, run_dir: Path, source: files.RunSource | None = None) -> None:
        self.run_dir = run_dir  # on the supervisor's machine, which may not be this kernel's (`source.place`)
        self.name = run_dir.name
        self._source = source or files.RunDir(run_dir)
        self._replay = Replay()
        self._leave = threading.Event()
        self._failed: BaseException | None = None
        self._views = Subscribers()
        self.summary_above = False
        threading.Thread(target=self._follow, name="ddpnb-attached", daemon=True).start()
        deadline = time.monotonic() + FIRST_RECORD_WAIT
        while not self._replay.caught_up.is_set():  # the history first: the handle's record holds it
            if self._failed is not None:
                raise self._failed
            if not self._source.supervised() and time.monotonic() > deadline - FIRST_RECORD_WAIT + 2:
                raise JournalError(
                    f"{self._source.place} holds no record of its run: its supervisor is gone (see {files.LOG} there)"
                )
            if time.monotonic() > deadline:
                raise JournalError(f"{run_dir}'s journal said nothing within {FIRST_RECORD_WAIT:g} s")
            self._replay.caught_up.wait(0.02)
        if self._failed is not None:
            raise self._failed
        if self._replay.record is None:
            raise JournalError(f"{run_dir}'s journal holds no whole record: {self._replay.torn or 'it is empty'}")
        self.record: RunRecord = self._replay.record

    def _follow(self) -> None:
        source = self._source
        read = None if isinstance(source, files.RunDir) else functools.partial(self._journal_from, source)
        try:
            self._replay.follow(self.run_dir / JOURNAL_FILE, self._leave, read)
        except BaseException as exc:  # noqa: BLE001 - raised where the caller is: `attach`, or `wait`
            self._failed = exc

    @staticmethod
    def _journal_from(source: files.RunSource, offset: int, most: int) -> bytes | None:
        return source.read(JOURNAL_FILE, offset, wait=SERVED_POLL, most=most)

    # --- the handle ---------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._replay.done

    @property
    def orphaned(self) -> bool:
        """The supervisor is gone and the journal never said the run ended: its state is unknown."""
        return not self.done and not self._source.supervised() and not self._catching_up()

    def _catching_up(self) -> bool:
        """The journal may hold records the follower has not read yet (it looks every 50 ms)."""
        time.sleep(0.2 if isinstance(self._source, files.RunDir) else 2 * SERVED_POLL)
        return self.done

    @property
    def outcome(self) -> Outcome:
        return self.record.outcome

    @property
    def attempt(self) -> Any:
        return self._replay.attempt

    @property
    def status(self) -> str:
        record = self.record
        ranks = ", ".join(f"{r.rank}: {r.state.value}" for r in record.ranks)
        stalled = f", stalled: {diagnosis_summary(record.stall.diagnosis)}" if record.stall and record.stalled else ""
        state = "orphaned (its supervisor is gone)" if self.orphaned else record.outcome.value
        return f"{state} after {format_duration(record.duration)} (ranks {ranks}){stalled}"

    def __repr__(self) -> str:
        record = self.record
        return (
            f"<ddpnb detached run {self.name} of {record.function or 'a function'} on "
            f"{ranks_text(record.world_size)} ({record.backend}): {self.status}; .wait() .result() .stop()>"
        )

    def _ipython_display_(self) -> None:
        """The live dashboard, drawn anew in each cell that displays the handle: the whole history replayed, then
        live; its one-line status where this kernel's view is text (`DDPNB_VIEW`, or no widgets)."""
        from IPython.display import display

        if choose_view() is ViewKind.WIDGET:
            from ddpnb.views.dashboard import Dashboard

            Dashboard(self, foreground=False)  # type: ignore[arg-type]
        else:
            display({"text/plain": repr(self)}, raw=True)

    def wait(self, timeout: float | None = None) -> RunRecord:
        """Block until the run has ended (or `timeout` passes, or its supervisor is found gone)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen, looked = 0, time.monotonic()
        try:
            while not self.done:
                if self._failed is not None:
                    raise self._failed
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                seen = self.watch(seen, TICK if left is None else min(TICK, left))
                self.notify()
                if time.monotonic() - looked > ORPHAN_CHECK:
                    looked = time.monotonic()
                    if self.orphaned:
                        break
                if deadline is not None and time.monotonic() >= deadline:
                    break
        finally:
            self.notify(ending=True)
        return self.record

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value, kept by the supervisor in the run directory; raises `WorkerError` if the run
        did not succeed, TimeoutError if it has not ended within `timeout` (it goes on)."""
        if timeout is not None and not is_seconds(timeout, zero=True):
            raise ValueError(f"timeout is a number of seconds to wait, 0 or more, not {timeout!r}.")
        self.wait(timeout)
        if not self.done:
            if self.orphaned:
                raise RuntimeError(
                    f"the run's supervisor is gone and the run's end was never written: its result is "
                    f"lost (its logs, and why in {files.LOG}: {self._source.place})"
                )
            raise TimeoutError(
                f"the run has not ended within {timeout:g} s, and goes on: .result() again waits for "
                "it, .stop() ends it."
            )
        if self.record.outcome is not Outcome.SUCCEEDED:
            self._source.collected()
            raise WorkerError(self.record, hint=hints.hint(self.record), summary_above=self.summary_above)
        value = self._kept()
        self._source.collected()  # a served run's supervisor may leave now (`engines.ray.detach`)
        return value

    def _kept(self) -> Any:
        source = self._source
        deadline = time.monotonic() + RESULT_WAIT
        while True:
            kept, error = source.read(files.RESULT), source.read(files.RESULT_ERROR)
            if kept is not None or error is not None or not source.supervised() or time.monotonic() > deadline:
                break
            time.sleep(0.002)  # the supervisor writes it right after the journal's end: a few ms
        if kept is not None:
            return pickle.loads(kept)
        if error is not None:
            raise RuntimeError(f"rank 0 returned a value the supervisor could not keep: {error.decode()}")
        raise RuntimeError(
            f"rank 0's value is not in {source.place} (cleaned, or the supervisor died before "
            f"keeping it: see {files.LOG} there)"
        )

    def stop(self, outcome: Outcome = Outcome.STOPPED, note: str = "stopped by the user") -> None:
        """Stop every rank (through the supervisor) and wait until all are gone."""
        del outcome, note  # the supervisor says why: stopped by the user
        if self.done:
            return
        try:
            self._source.ask("stop")
        except RuntimeError:  # the run ended meanwhile (its answer went with the supervisor), or the door cannot
            # be reached: then the supervisor is ended by its platform where it can (`scancel`)
            if files.json_of(self._source, files.ENDED) is None and not self._source.end():
                raise
        self.wait(5.0)
        if self.done:  # the viewer that stopped it has its end: a served run's supervisor may leave
            self._source.collected()

    def stacks(self, wait: float = 10.0) -> dict[int, str]:
        """Every running rank's Python stack now, asked of the supervisor; `{}` once the run has ended."""
        if self.done:
            return {}
        return self._source.ask("stacks", timeout=wait + 5)

    def leave(self) -> None:
        """Stop following the journal (the run goes on)."""
        self._leave.set()

    # --- what views read ---------------------------------------------------------------------------------------
    def watch(self, seen: int, timeout: float) -> int:
        return self._replay.watch(seen, timeout)

    def lines_since(self, seen: int) -> tuple[list[OutputLine], int, int]:
        return self._replay.lines_since(seen)

    def subscribe(self, callback: Callable[[], None], *, news: bool = True) -> None:
        self._views.subscribe(callback, news)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        self._views.unsubscribe(callback)

    def notify(self, ending: bool = False) -> None:
        for view, exc in self._views.notify(ending, ended=self.done):
            self.record.view_errors.append(f"drawing the {view}: {type(exc).__name__}: {exc}")

    def answer(self, prompt: Any, line: str) -> bool:
        return False  # a detached run takes no debugger answers

    def not_waiting(self, rank: int) -> str:
        return "a detached run takes no debugger answers"


@dataclass(frozen=True)
class Listed:
    """One detached run, as `ddpnb.runs()` lists it."""

    name: str
    path: Path  # on the supervisor's machine (a served run's: its node's)
    function: str
    world_size: int
    # 'queued' (its supervisor's job waits in its platform's queue), 'running', 'orphaned' (its supervisor is gone,
    # the end never written) or the outcome
    state: str
    progress: str  # what it waits for in the queue; the supervisor's status line while it runs; how it ended after
    source: files.RunSource = field(repr=False, compare=False)

    def attach(self) -> DetachedRun:
        return DetachedRun(self.path, self.source)

    def __repr__(self) -> str:
        return (
            f"<ddpnb detached run {self.name}: {self.function} on {ranks_text(self.world_size)}, {self.state}; "
            f"{self.progress}; .attach()>"
        )


def listed() -> list[Listed]:
    """This user's detached runs in the runs directory, then those served by engines to this kernel (a Ray
    cluster it reaches through Ray Client), oldest first in each."""
    found = []
    for path in sorted(rundir.runs_root().iterdir()):
        if path.stat().st_uid != os.getuid():  # not this user's, whoever put it there
            continue
        run = _listed(files.RunDir(path), path)
        if run is not None:
            found.append(run)
    here = {run.name for run in found}
    for source in _served():
        if source.name not in here:  # its run directory is here too: listed already
            run = _listed(source, None)
            if run is not None:
                found.append(run)
    return found


def _served() -> list[files.RunSource]:
    served: list[files.RunSource] = []
    for name in engines.names():
        if not hasattr(engines.find(name), "served_runs"):
            continue
        try:
            served.extend(engines.engine_type(name).served_runs())
        except LaunchError:  # its platform is not installed here: it serves nothing here either
            continue
    return served


def _listed(source: files.RunSource, path: Path | None) -> Listed | None:
    about = files.json_of(source, files.MARKER)
    if about is None:
        return None
    try:
        where = path or source.path  # type: ignore[attr-defined]
    except RuntimeError:  # the served run's supervisor left meanwhile
        return None
    return Listed(source.name, where, about.get("function", ""), about.get("world_size", 0), *_state(source), source)


def _state(source: files.RunSource) -> tuple[str, str]:
    end = files.json_of(source, files.ENDED)
    if end is not None:
        return end["outcome"], f"ended after {format_duration(end['duration'])}" + (
            f": {end['note']}" if end.get("note") else ""
        )
    queued = source.queued()
    if queued:
        return "queued", f"{queued}: it starts when its job runs"
    if source.supervised():
        try:
            return "running", source.ask("status", timeout=5)
        except RuntimeError as exc:
            return "running", str(exc)
    return "orphaned", f"its supervisor is gone and its end was never written; its logs are in {source.place}"


def attach(which: str | os.PathLike[str] = "last") -> DetachedRun:
    """The handle of a detached run: 'last' (the newest), its name (`ddpnb.runs()` lists them), or its run
    directory's path."""
    found = find(which)
    if isinstance(found, Listed):  # served by its engine: the cluster's access control is the check
        return found.attach()
    owner = found.stat().st_uid
    if owner != os.getuid():
        raise PermissionError(
            f"{found} is {_user(owner)}'s run: only the user who launched a run may attach to it (its journal, "
            "logs, result and secret are that user's alone). Attach to one of your runs: ddpnb.runs() lists them."
        )
    _out_of_queue(found)
    return DetachedRun(found)


def _out_of_queue(path: Path) -> None:
    """While the run's supervisor waits in its platform's queue (its batch job pending), wait with it, saying so
    (no deadline: the queue decides; an interrupt stops the waiting, not the run); then until it has started."""
    said = ""
    while queued := files.queued(path):
        if queued != said:
            print(
                f"[ddpnb] the detached run {path.name} waits in the queue: {queued}; attach returns once its job "
                "runs (interrupt to stop waiting: the run stays queued, and ddpnb.runs() lists it)",
                file=sys.stderr,
                flush=True,
            )
            said = queued
        time.sleep(QUEUE_POLL)
    deadline = time.monotonic() + START_WAIT
    while said and not (path / files.STARTED).exists() and files.supervised(path) and time.monotonic() < deadline:
        time.sleep(QUEUE_POLL)  # its journal is written once the supervisor runs: it may take a fresh interpreter


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def find(which: str | os.PathLike[str]) -> Path | Listed:
    """The run directory `which` names, or the listed run a served one is."""
    if not isinstance(which, (str, os.PathLike)):
        raise TypeError(f"attach takes 'last', a run's name or its run directory, not {type(which).__name__}")
    runs = listed()
    if str(which) == "last":
        if not runs:
            raise LookupError(
                f"there is no detached run in {rundir.runs_root()}: launch one with "
                "ddpnb.launch(fn, detach=True) or %%ddp --detach."
            )
        return _found(runs[-1])
    path = Path(which).expanduser()
    if path.is_dir() and (path.stat().st_uid != os.getuid() or (path / files.MARKER).exists()):
        return path  # another user's (whose insides this user may not even see): refused, saying whose
    named = rundir.runs_root() / str(which)
    if os.sep not in str(which) and named.is_dir() and (named / files.MARKER).exists():
        return named
    for run in runs:
        if run.name == str(which) or str(run.path) == str(which):
            return _found(run)
    there = "; ".join(f"{run.name} ({run.state})" for run in runs) or "none"
    raise LookupError(
        f"no detached run {str(which)!r} in {rundir.runs_root()}. The detached runs there are: "
        f"{there}. Pass one of these names, 'last', or a run directory."
    )


def _found(run: Listed) -> Path | Listed:
    return run.path if isinstance(run.source, files.RunDir) else run
