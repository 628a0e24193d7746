"""One set of launch options for `ddpnb.run`, `launch`, `session` and the magics, checked once.

`LaunchOptions` holds what the caller asked for; `check` turns it into a `Launch`: the engine found in the
registry with its own options, the plan (world size, devices, backend), the view, and every other value
validated. Nothing has started when it raises, and what it raises says what to do.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpnb import engines
from ddpnb.core import checkpoints
from ddpnb.core.engine import EngineType
from ddpnb.core.profile import profile_steps
from ddpnb.core.spec import (
    CallStyle,
    LaunchError,
    Plan,
    ViewKind,
    bound_local_ranks,
    check_env,
    is_seconds,
    plan,
    stall_seconds,
)
from ddpnb.views import tensorboard as board

VIEW_VAR = "DDPNB_VIEW"
MAX_LINES_VAR = "DDPNB_MAX_LINES"
DEFAULT_MAX_LINES = 1000  # lines of output the text view shows; every line is in the logs
DEFAULT_KEEP = 3  # complete checkpoints a run keeps


@dataclass(frozen=True)
class LaunchOptions:
    """Every option a launch takes, whatever its engine; an engine's own (Ray's `address`, `placement`) are its
    `Options` dataclass's, passed by name beside these (`ddpnb.run(fn, engine="ray", address="auto")`).

    gpus: one rank per GPU over NCCL, a number or 'all'; else `nprocs` CPU ranks over gloo (default 2).
    backend: 'nccl' or 'gloo' instead of the planned one. timeout: seconds each attempt may run. env: variables
    set in every rank. args: passed after rank (and world_size). view: 'auto', 'widget', 'text' or 'none'.
    engine: 'local' (default), 'ray', or any registered engine. max_restarts: fresh attempts after a failure.
    checkpoint_dir, keep_checkpoints, resume: where `ddpnb.save_checkpoint` writes, how many complete ones it
    keeps, and an earlier run ('last' or its directory) to continue from. fold: one copy of a line every rank
    prints. tensorboard: a directory for TensorBoard event files. stall: seconds without progress that mark the
    run stalled (None: adapted to the run; 0: never). debug: the first rank that raises opens a post-mortem
    prompt at the raising frame (a foreground cell whose front end takes input). profile: the steps to profile on
    every rank, counted by `ddpnb.log(step=...)` ('5-7', or True for steps 3-5): one merged trace in the run
    directory and each rank's step time broken down in `record.profile` (docs/profiling.md). oversubscribe: start
    more CPU ranks on this machine than 8 a usable CPU (at least 16), which is refused without it. detach: the run
    is owned by a supervisor process of its own, not the kernel, so it outlives the kernel; `ddpnb.attach` from any
    later kernel (docs/detached.md).
    """

    gpus: int | str | None = None
    nprocs: int | None = None
    backend: str | None = None
    timeout: float | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    args: Sequence[Any] = ()
    call_style: CallStyle = CallStyle.AUTO
    view: str | None = None
    engine: str = engines.DEFAULT
    max_restarts: int = 0
    checkpoint_dir: str | os.PathLike[str] | None = None
    keep_checkpoints: int = DEFAULT_KEEP
    resume: str | os.PathLike[str] | None = None
    fold: bool = True
    tensorboard: str | os.PathLike[str] | None = None
    stall: float | None = None
    debug: bool = False
    profile: bool | str | int | tuple[int, int] | None = None
    oversubscribe: bool = False
    detach: bool = False
    engine_options: Mapping[str, Any] = field(default_factory=dict)  # the engine's own, by name

    @classmethod
    def of(cls, given: Mapping[str, Any], allowed: Sequence[str] | None = None) -> LaunchOptions:
        """From keyword arguments: these options by name, the engine's own beside them. `allowed`: the only
        options of ours the caller takes (a session's), the engine's own always."""
        ours = {f.name for f in dataclasses.fields(cls)} - {"engine_options"}
        taken = set(allowed) | {"engine"} if allowed is not None else ours
        own = {key: value for key, value in given.items() if key in taken}
        rest = {key: value for key, value in given.items() if key not in taken}
        for key in rest:
            if key in ours:  # ours, but not for this caller
                raise LaunchError(
                    f"{key} is not an option here; this takes {', '.join(sorted(taken))} and the engine's own options."
                )
        engine = str(own.get("engine") or engines.DEFAULT)
        known = sorted(ours | {name for other in engines.names() for name in _engine_option_names(other)})
        for key in rest:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                raise LaunchError(
                    f"there is no option {key!r}"
                    + (f" (did you mean {close[0]}?)" if close else "")
                    + ": see help(ddpnb.LaunchOptions)."
                )
        return cls(**{**own, "engine": engine}, engine_options=rest)

    def check(self) -> Launch:
        """Every value validated, the engine found and planned; LaunchError saying what to do, before anything
        starts."""
        if self.timeout is not None and not is_seconds(self.timeout):
            raise LaunchError(f"timeout must be a positive number of seconds, not {self.timeout!r}.")
        if isinstance(self.args, (str, bytes)) or not isinstance(self.args, Sequence):
            raise LaunchError(
                f"args must be a tuple of the function's extra arguments, not {self.args!r}: for one, "
                f"args=({self.args!r},)."
            )
        _check_whole(self.max_restarts, "max_restarts", 0)
        _check_whole(self.keep_checkpoints, "keep_checkpoints", 1)
        for name in ("fold", "debug", "oversubscribe", "detach"):
            if not isinstance(getattr(self, name), bool):
                raise LaunchError(f"{name} takes True or False, not {getattr(self, name)!r}.")
        check_env(self.env)
        if self.detach:
            _check_detach(self)
        stall = stall_seconds(self.stall)
        engine_type = engines.engine_type(self.engine)  # raises if the engine cannot be used here
        engine_options = engines.options(self.engine, dict(self.engine_options))
        engine_type.check(engine_options)
        available = None if self.gpus is None else engine_type.gpus_available()
        planned = plan(self.gpus, self.nprocs, self.backend, available, self.engine)
        if engine_type.capabilities.ranks_here:
            bound_local_ranks(planned, self.oversubscribe)
        elif self.oversubscribe:
            raise LaunchError(
                f"oversubscribe (--oversubscribe) is for ranks on this machine, not on the {self.engine} "
                "engine's, whose cluster places them: leave it out."
            )
        view = choose_view(self.view)
        if view is ViewKind.TEXT:
            max_lines()
        resumed = checkpoints.resume_source(self.resume) if self.resume is not None else None
        board_dir = board.check(self.tensorboard) if self.tensorboard is not None else None
        return Launch(
            self,
            engine_type,
            engine_options,
            planned,
            view,
            stall,
            resumed,
            board_dir,
            profile=profile_steps(self.profile),
        )


@dataclass(frozen=True)
class Launch:
    """Checked options, as a run uses them."""

    options: LaunchOptions
    engine: EngineType
    engine_options: Any
    plan: Plan
    view: ViewKind
    stall: float | None
    resumed: tuple[Path, int] | None  # the checkpoint directory --resume continues from, and its step
    tensorboard: Path | None
    profile: tuple[int, int] | None = None  # the first and last step to profile (--profile)


def _engine_option_names(name: str) -> list[str]:
    try:
        return engines.option_names(name)
    except ImportError:
        return []


def _check_detach(options: LaunchOptions) -> None:
    """What a detached run cannot do (yet), refused saying why."""
    # the local engine's supervisor is a process of this machine; another engine's lives where it says
    if options.engine != engines.DEFAULT and not hasattr(engines.find(options.engine), "supervisor_home"):
        raise LaunchError(
            f"detach (--detach) runs on the local, slurm and ray engines, not on {options.engine!r} yet "
            "(docs/detached.md). Leave out detach, or use one of those engines."
        )
    if options.debug:
        raise LaunchError(
            "detach (--detach) and debug (--debug) do not go together: a detached run's prompts would "
            "have no front end to ask in once the kernel is gone. Leave out one of them."
        )
    if options.tensorboard is not None:
        raise LaunchError(
            "detach (--detach) and tensorboard do not go together yet: the event files are written by "
            "the kernel's view of a run. Leave out tensorboard, or detach."
        )


def _check_whole(value: object, name: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise LaunchError(f"{name} must be a whole number of {least} or more, not {value!r}.")


def max_lines() -> int:
    """How many lines of output the text view shows: $DDPNB_MAX_LINES, else DEFAULT_MAX_LINES."""
    value = os.environ.get(MAX_LINES_VAR, "").strip()
    if not value:
        return DEFAULT_MAX_LINES
    try:
        lines = int(value)
    except ValueError:
        lines = -1
    if lines < 0:
        raise LaunchError(
            f"{MAX_LINES_VAR} must be a number of lines (0 or more), not {value!r}: set it to one, "
            f"or unset it for the default ({DEFAULT_MAX_LINES})."
        )
    return lines


def choose_view(view: str | None = None) -> ViewKind:
    """'widget', 'text' or 'none': `view`, else $DDPNB_VIEW, else 'auto'.

    'auto' is the dashboard inside a Jupyter kernel (ZMQInteractiveShell) where ipywidgets imports, plain text
    everywhere else (terminal IPython, scripts). A kernel cannot tell whether its front end renders widgets, so
    executing notebooks headless (nbclient, nbconvert) without storing widget state should set DDPNB_VIEW=text
    to get `[rank N]` lines as stream output; the dashboard's own fallback is the final summary.
    """
    choice = (view or os.environ.get(VIEW_VAR) or "auto").strip().lower()
    try:
        chosen = ViewKind(choice)
    except ValueError:
        names = ", ".join(kind.value for kind in ViewKind)
        raise LaunchError(f"view must be one of {names}, not {choice!r} (from {VIEW_VAR} or view=).") from None
    if chosen is not ViewKind.AUTO:
        return chosen
    shell_module = sys.modules.get("IPython")
    shell = shell_module.get_ipython() if shell_module is not None else None
    if shell is None or not any(cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__):
        return ViewKind.TEXT
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return ViewKind.TEXT
    return ViewKind.WIDGET
