"""Interactive sessions: ranks that stay, keep their namespaces across cells, and fail the way runs do.

A session is a `Run` whose ranks run `rank.session.serve`: they start, join their process group and die exactly
as a `%%ddp` run's ranks do; between commands they wait for the next one. `%ddp_start`, `%%ranks`,
`%ddp_restart` and `%ddp_stop` are sugar over `ddpnb.session()` and this class.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import keyword
import pickle
import queue
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from ddpnb import _api
from ddpnb._options import Launch, LaunchOptions
from ddpnb.core import messages as msg
from ddpnb.core.cellnames import cell_name, cell_names
from ddpnb.core.failures import known_cause
from ddpnb.core.pickling import dump_command, dumps
from ddpnb.core.record import DataSent, Outcome, OutputLine, RankState
from ddpnb.core.report import WorkerError
from ddpnb.core.run import Run
from ddpnb.core.spec import Stream, is_seconds
from ddpnb.core.stacks import where
from ddpnb.core.words import ranks_text
from ddpnb.rank.session import serve
from ddpnb.views.fold import Folder
from ddpnb.views.text import stall_lines

GRACE = 5.0  # seconds the other ranks get to answer once one rank failed or was interrupted
START_WAIT = 600.0  # seconds the ranks may take to start (a kernel's first session imports torch once)
STACK_WAIT = 3.0  # seconds stuck ranks get to say where they are
STOP_WAIT = 10.0  # seconds the ranks get to leave on their own at `stop()` before they are stopped
# what a session takes of the launch options (and its engine's own): where and how many ranks, and how it shows
OPTIONS = ("gpus", "nprocs", "backend", "env", "engine", "fold", "stall", "oversubscribe")


class SessionState(enum.Enum):
    """READY from the start until STOPPED: by `stop()`, or because a rank died or got stuck (its process group
    cannot be trusted then). A stopped session has no ranks; `restart()` makes it READY with fresh ones."""

    READY = "ready"
    STOPPED = "stopped"


class SessionError(RuntimeError):
    """A command failed on some ranks; the session and every namespace are as the command left them."""

    def __init__(self, summary: str, report: str) -> None:
        super().__init__(summary)
        self.report = report

    def __str__(self) -> str:
        return self.report

    def _render_traceback_(self) -> list[str]:  # IPython shows the ranks' tracebacks, not the kernel's stack
        return self.report.splitlines()


class SessionBroken(SessionError):
    """The session had to end: a rank died, or got stuck where the others cannot reach it. Nothing is left
    running; `restart()` (`%ddp_restart`) starts fresh ranks with the same flags."""


class PerRank(list):
    """One value per selected rank, in rank order; `ranks` says which. Shown with rank labels."""

    def __init__(self, ranks: Iterable[int], values: Iterable[Any]) -> None:
        super().__init__(values)
        self.ranks = list(ranks)

    def by_rank(self) -> dict[int, Any]:
        return dict(zip(self.ranks, self))

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        from IPython.lib.pretty import pretty

        for index, (rank, value) in enumerate(zip(self.ranks, self)):
            if index:
                printer.break_()
            label = f"[rank {rank}] "
            shown = pretty(value, max_width=max(20, printer.max_width - len(label)))
            printer.text(label + shown.replace("\n", "\n" + " " * len(label)))


_current: Session | None = None  # the session the magics use: one per kernel


class Session:
    """Ranks that keep their state across commands. Use `execute`, `push`, `pull`, `call`, `restart`, `stop`, or
    `with ddpnb.session(nprocs=2) as s: ...`."""

    def __init__(self, **options: Any) -> None:
        """`options`: gpus, nprocs, backend, env, engine (and the engine's own), fold, stall; see `ddpnb.session`."""
        chosen = LaunchOptions.of(options, allowed=OPTIONS)
        # checked once: `restart()` starts the same ranks again
        self._launch: Launch = dataclasses.replace(chosen, view="none").check()
        self._fold = chosen.fold  # the same line from every rank shows once (`views.fold`)
        self._number = 0
        self._stall_said: object = None  # the run's stall whose lines were printed
        self.data: DataSent | None = None  # what the latest command sent out of its pickle (`push`)
        self.state = SessionState.STOPPED
        self.stopped_by = ""  # why the ranks are gone, when a failure rather than `stop()` ended them
        self.run: Run | None = None
        self._start()

    # --- lifecycle ---------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        self.run = _api.start(serve, self._launch, foreground=False, commands=True)
        record = self.run.record
        self._say(
            f"session of {ranks_text(record.world_size)} ({record.engine}, {record.backend}, "
            f"{', '.join(sorted({r.device for r in record.ranks}))}); logs in {record.run_dir}"
        )
        self.state, self.stopped_by = SessionState.READY, ""
        # a name every rank's namespace has, as the notebook's does (a module travels by name)
        self._command(msg.CommandKind.PUSH, None, START_WAIT, values={"ddpnb": sys.modules["ddpnb"]})

    @property
    def world_size(self) -> int:
        assert self.run is not None
        return self.run.record.world_size

    @property
    def pids(self) -> list[int | None]:
        assert self.run is not None
        return [r.pid for r in self.run.record.ranks]

    def restart(self) -> None:
        """Fresh ranks with the same flags: new processes, new process group, empty namespaces."""
        self.stop()
        self._start()

    def stop(self) -> None:
        """End every rank; the session's namespaces are gone."""
        run = self.run
        if run is not None and not run.done:
            assert run.channel is not None
            run.channel.send(list(range(run.record.world_size)), dumps(msg.Command(self._next(), msg.CommandKind.STOP)))
            run.wait(STOP_WAIT)
            if not run.done:
                run.stop(Outcome.STOPPED, "the session was stopped")
            size = run.record.world_size
            self._say(
                f"session stopped: its {ranks_text(size)} {'has' if size == 1 else 'have'} ended, and their "
                "namespaces with them"
            )
        self.state = SessionState.STOPPED

    def __enter__(self) -> Session:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        ranks = ranks_text(self.world_size) if self.run is not None else "no ranks"
        why = f" ({self.stopped_by})" if self.stopped_by else ""
        return f"<ddpnb session of {ranks}: {self.state.value}{why}>"

    # --- commands ------------------------------------------------------------------------------------------------------
    def execute(
        self, code: str, ranks: Iterable[int] | None = None, timeout: float | None = None, filename: str = ""
    ) -> PerRank | None:
        """Run `code` in each selected rank's namespace (every rank by default); the value of its last
        expression on each rank, or None when it has none. Output streams here as it is printed."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a string of Python, not {type(code).__name__}: e.g. s.execute('x = 1').")
        ast.parse(code, filename or "<session cell>")  # a syntax error is shown as Python shows it, and not sent
        lines = tuple(code.splitlines(keepends=True))
        values = self._command(
            msg.CommandKind.EXECUTE,
            ranks,
            timeout,
            code=code,
            filename=filename,
            lines=lines,
            cell_name=cell_name(filename),
        )
        return None if all(value is None for value in values) else values

    def debug(self, rank: int = 0) -> None:
        """Post-mortem on `rank`'s last failed command (`%ddp_debug RANK`): pdb at the frame that raised, in this
        cell's input box, the rank's namespace intact; the session goes on once you leave it (q or c)."""
        self._command(msg.CommandKind.DEBUG, [rank], None)

    def push(self, **values: Any) -> None:
        """Bind names in every rank's namespace: `s.push(lr=0.1, data=tensor)`."""
        bad = [name for name in values if not name.isidentifier() or keyword.iskeyword(name)]
        if bad:
            raise ValueError(
                f"push binds Python names, and {', '.join(map(repr, bad))} "
                f"{'is not one' if len(bad) == 1 else 'are not'}: e.g. s.push(lr=0.1)."
            )
        self._command(msg.CommandKind.PUSH, None, None, values=values)

    def pull(self, *names: str, ranks: Iterable[int] | None = None) -> PerRank:
        """The value of `names` on each selected rank (a tuple per rank for several names)."""
        if not names:
            raise ValueError("pull needs a name, e.g. s.pull('loss').")
        return self._command(msg.CommandKind.PULL, ranks, None, names=names)

    def call(self, fn: Callable[..., Any], *args: Any, ranks: Iterable[int] | None = None, **kwargs: Any) -> PerRank:
        """`fn(*args, **kwargs)` on each selected rank; what each returned."""
        if not callable(fn):
            raise TypeError(
                f"call runs a function on the ranks, and {type(fn).__name__} is not one: s.call(fn, *args)."
            )
        return self._command(msg.CommandKind.CALL, ranks, None, call=(fn, args, kwargs))

    def _next(self) -> int:
        self._number += 1
        return self._number

    def _selected(self, ranks: Iterable[int] | None) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        given = (
            [ranks]
            if isinstance(ranks, int)
            else list(ranks)
            if isinstance(ranks, Iterable) and not isinstance(ranks, str | bytes)
            else None
        )
        if given is None or not all(isinstance(rank, int) and not isinstance(rank, bool) for rank in given):
            raise ValueError(f"ranks takes rank numbers, e.g. ranks=[0, 2] (in %%ranks: 0,2 or 1-3), not {ranks!r}.")
        chosen = sorted(set(given))
        bad = [rank for rank in chosen if not 0 <= rank < self.world_size]
        if not chosen or bad:
            raise ValueError(
                f"ranks must be between 0 and {self.world_size - 1} in this session of {self.world_size} "
                f"ranks, not {bad or 'none'}."
            )
        return chosen

    def _command(
        self, kind: msg.CommandKind, ranks: Iterable[int] | None, timeout: float | None, **fields: Any
    ) -> PerRank:
        if self.state is not SessionState.READY or self.run is None or self.run.done:
            advice = "%ddp_restart (or .restart())" if self.run is not None else "%ddp_start (or ddpnb.session())"
            why = f" ({self.stopped_by})" if self.stopped_by else ""
            raise SessionBroken(
                f"the session is {self.state.value}{why}",
                f"ddpnb: this session is {self.state.value}{why}: start fresh ranks with {advice}.",
            )
        run, channel = self.run, self.run.channel
        assert channel is not None
        selected = self._selected(ranks)
        if timeout is not None and not is_seconds(timeout):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}.")
        command = msg.Command(self._next(), kind, **fields)
        # big tensors and arrays go as a launch's do: through shared memory (local), Ray's object store (ray)
        shipment = self._launch.engine.shipment()
        # here, before anything is sent: what cannot travel is the caller's error
        body = dump_command(command, shared=shipment)
        seen = run.lines_since(0)[2]
        folder = Folder(len(selected), enabled=self._fold)  # a command's output, folded across its ranks
        channel.send(selected, body, shipment)
        answers: dict[int, msg.Reply] = {}
        began = time.monotonic()
        ending_at: float | None = None  # a rank failed or was interrupted: the others answer by then, or are stuck
        interrupted = False
        queue_said: tuple[str, str] | None = None
        try:
            while len(answers) < len(selected):
                # an interrupt may land anywhere in here (a busy kernel): it is the cell's, never lost, and a reply
                # is kept the moment it is taken
                try:
                    run.answer_prompts()  # a rank at breakpoint(): this cell's input box answers it
                    try:
                        reply = channel.replies.get(timeout=0.1)
                    except queue.Empty:
                        reply = None
                    if reply is not None and reply.command == command.number:
                        answers[reply.rank] = reply
                        if reply.exc_type and ending_at is None:
                            ending_at = time.monotonic() + GRACE
                    new, skipped, seen = run.lines_since(seen)  # read before shown: an interrupt shows none twice
                    self._show_output(run, new, skipped, folder)
                    if run.done:
                        self._died(run)
                    now = time.monotonic()
                    queued = run.record.queued
                    if queued is not None and queued.ongoing:  # the ranks' job waits its turn: no command's time yet
                        began = now
                        if (queued.what, queued.state) != queue_said:
                            queue_said = (queued.what, queued.state)
                            self._say(f"{queued.words()} (interrupt to cancel it)")
                    if timeout is not None and ending_at is None and now - began > timeout:
                        channel.interrupt([rank for rank in selected if rank not in answers])
                        ending_at = now + GRACE
                    if ending_at is not None and now > ending_at and len(answers) < len(selected):
                        timed_out = timeout is not None and now - began > timeout
                        cause = "an interrupt" if interrupted or timed_out else "a failure"
                        self._break(selected, answers, f"within {GRACE:g} s of {cause}")
                except KeyboardInterrupt:
                    if interrupted:  # a second interrupt: stop waiting for ranks that do not come back
                        self._break(selected, answers, "a second interrupt ended the wait")
                    interrupted = True
                    channel.interrupt([rank for rank in selected if rank not in answers])
                    ending_at = time.monotonic() + GRACE
        finally:  # however the wait ended, every line read is shown, those still waiting to be folded too
            new, skipped, seen = run.lines_since(seen)
            self._show_output(run, new, skipped, folder, final=True)
        if shipment is not None and shipment.used:  # every rank has it: the store keeps it for the next push
            self.data = shipment.commit()
        failed = {rank: reply for rank, reply in answers.items() if reply.exc_type}
        if failed:
            self._raise(failed, selected)
        return PerRank(
            selected, [None if answers[r].payload is None else pickle.loads(answers[r].payload) for r in selected]
        )

    def _show_output(self, run: Run, new: list[OutputLine], skipped: int, folder: Folder, final: bool = False) -> None:
        """Write a command's new lines (`Run.lines_since`), folded across its ranks, and a stall once it is found."""
        if skipped:
            print(f"[ddpnb] {skipped} lines not shown here; every line is in the logs: {run.record.run_dir}")
        lines = folder.add(new, time.monotonic()) + (folder.flush() if final else [])
        for line in lines:
            stream = sys.stderr if line.stream is Stream.STDERR else sys.stdout
            stream.write(f"{line.tag} {line.text}\n")
        stall = run.record.stall
        if stall is not None and stall.ongoing and stall is not self._stall_said:  # a command that stopped moving
            self._stall_said = stall
            sys.stdout.write(stall_lines(stall, going="the command"))
        if lines or stall is self._stall_said:
            sys.stdout.flush()
            sys.stderr.flush()

    # --- how commands fail -------------------------------------------------------------------------------------------
    def _raise(self, failed: dict[int, msg.Reply], selected: list[int]) -> None:
        first = failed[min(failed)]
        interrupted = all(reply.exc_type == "KeyboardInterrupt" for reply in failed.values())
        parts = [
            f"ddpnb: {'interrupted on' if interrupted else 'failed on'} {_named(failed)} of {len(selected)}: "
            f"{first.exc_type}: {first.message}".rstrip(": ")
        ]
        parts += _tracebacks(failed)
        meaning = known_cause(f"{first.exc_type}: {first.message}", first.traceback)
        if meaning:
            parts.append(f"ddpnb: {meaning}")
        parts.append("\nThe session and every rank's namespace are as the command left them; run the next cell.")
        raise SessionError(f"rank {min(failed)}: {first.exc_type}: {first.message}", "\n".join(parts))

    def _break(self, selected: list[int], answers: dict[int, msg.Reply], why: str) -> None:
        """Ranks that do not answer are stuck (in a collective a failed rank will never join, or in C++): say where,
        then end the session, since its process group cannot be trusted."""
        assert self.run is not None
        stuck = [rank for rank in selected if rank not in answers]
        stacks = self.run.collect_stacks(stuck, STACK_WAIT)
        failed = {rank: reply for rank, reply in answers.items() if reply.exc_type}
        lines = []
        if failed:  # the root cause first, as a run's error leads with the rank that failed first
            first = failed[min(failed)]
            lines.append(
                f"ddpnb: rank {min(failed)} of {len(selected)} failed first: {first.exc_type}: {first.message}".rstrip(
                    ": "
                )
            )
        lines.append(
            f"{'' if failed else 'ddpnb: '}{_named(stuck)} did not come back ({why}), so the session was "
            "stopped: a process group with a rank stuck in it cannot be trusted."
        )
        for rank in stuck:
            lines.append(f"  rank {rank} is stuck {cell_names(where(stacks.get(rank, '')))}")
        lines += _tracebacks(failed)
        self.run.stop(Outcome.STOPPED, f"{_named(stuck)} stuck")
        self.state, self.stopped_by = SessionState.STOPPED, f"{_named(stuck)} stuck"
        lines.append(
            f"\nNo rank is left running. %ddp_restart (or .restart()) starts {self.world_size} fresh ranks "
            "with the same flags; their namespaces start empty."
        )
        short = f"rank {min(failed)}: {failed[min(failed)].exc_type}" if failed else f"{_named(stuck)} stuck"
        raise SessionBroken(short, "\n".join(lines)) from None

    def _died(self, run: Run) -> None:
        self.state, self.stopped_by = SessionState.STOPPED, "a rank died"
        record = run.record
        if record.first_failure is None and all(r.state is RankState.FINISHED for r in record.ranks):
            self.stopped_by = "the ranks left"
            raise SessionBroken(
                "the ranks left",
                "ddpnb: the session's ranks left (sys.exit in a cell?); "
                "%ddp_restart (or .restart()) starts fresh ones.",
            )
        report = WorkerError(record).report()
        raise SessionBroken(
            "a rank died",
            f"{report}\n\nThe session ended with it; no rank is left running. "
            "%ddp_restart (or .restart()) starts fresh ranks with the same flags.",
        )

    def _say(self, text: str) -> None:
        print(f"[ddpnb] {text}")


def _tracebacks(failed: dict[int, msg.Reply]) -> list[str]:
    """Each failed rank's traceback, once for the ranks whose tracebacks read the same ('--- ranks 0, 1 ---')."""
    shown: dict[str, list[int]] = {}
    for rank, reply in sorted(failed.items()):
        text = cell_names(reply.traceback).rstrip() or f"{reply.exc_type}: {reply.message}"
        shown.setdefault(text, []).append(rank)
    return [f"\n--- {_named(ranks)} ---\n{text}" for text, ranks in shown.items()]


def _ranks(ranks: Iterable[int]) -> str:
    """'0', '0, 2'"""
    return ", ".join(map(str, sorted(ranks)))


def _named(ranks: Iterable[int]) -> str:
    """'rank 0', 'ranks 0, 2'"""
    chosen = sorted(ranks)
    return f"rank{'s' if len(chosen) > 1 else ''} {_ranks(chosen)}"


def session(**options: Any) -> Session:
    """Start ranks that keep their state across commands (`%ddp_start` in a notebook). Its options are
    `ddpnb.run`'s that say where and how many ranks run (gpus, nprocs, oversubscribe, backend, env, engine and the
    engine's own), `fold`, and `stall`: seconds a command may go without progress on any rank before the session
    says where each rank is. `rank`, `world_size` and `ddpnb` are defined in every rank's namespace, and the
    process group is up."""
    return Session(**options)


def current_session() -> Session | None:
    """The session `%ddp_start` started in this kernel (None if none): for `push`, `pull` and `call` from Python."""
    return _current


def start_for_magics(**options: Any) -> Session:
    """`%ddp_start`: one session per kernel."""
    global _current
    if _current is not None and _current.state is SessionState.READY:
        raise _api.LaunchError(
            f"a session of {ranks_text(_current.world_size)} is already running in this kernel: "
            "%ddp_restart gives fresh ranks with its flags, %ddp_stop ends it (then %ddp_start "
            "with new flags)."
        )
    _current = Session(**options)
    return _current
