"""`run`, `launch` and `spawn`: check the caller's arguments, plan the run with its engine, start a `Run` and its
view. The public functions in `ddpnb` are these."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpnb import engines
from ddpnb.core import checkpoints, flight, pickling, rundir, shared
from ddpnb.core.cellnames import cell_names_of
from ddpnb.core.record import RunRecord
from ddpnb.core.run import Run, live_runs
from ddpnb.core.spec import (
    DEFAULT_CPU_RANKS,
    CallStyle,
    EngineKind,
    LaunchError,
    Plan,
    ViewKind,
    WorkerSpec,
    check_platform,
    local_gpu_count,
    stall_seconds,
)
from ddpnb.engines.local import forkserver
from ddpnb.engines.local.forkserver import PreloadError
from ddpnb.rank import context as rank_context
from ddpnb.rank.main import call_arguments
from ddpnb.views import tensorboard as board

__all__ = ["DEFAULT_CPU_RANKS", "LaunchError", "attempt", "check_options", "check_restarts", "device", "last_run",
           "launch", "log", "plan", "preload", "run", "runs", "spawn", "stall_seconds", "start"]

VIEW_VAR = "DDPNB_VIEW"
MAX_LINES_VAR = "DDPNB_MAX_LINES"
DEFAULT_MAX_LINES = 1000  # lines of output the text view shows; every line is in the logs

DEFAULT_KEEP = 3  # complete checkpoints a run keeps
_last_record: RunRecord | None = None  # the record only: a finished run's value belongs to the caller


def plan(gpus: int | str | None, nprocs: int | None, backend: str | None,
         engine: str | EngineKind = EngineKind.LOCAL) -> Plan:
    """The world size, devices and backend for the flags given, counted by the engine; raises LaunchError for
    impossible ones. `%%ddp` calls it, with `check_options`, before the cell runs."""
    from ddpnb.core import spec

    engine_type = engines.engine_type(engines.kind_of(engine))  # raises if the engine cannot be used here
    available = None if gpus is None else engine_type.gpus_available()
    return spec.plan(gpus, nprocs, backend, available)


def check_options(view: str | None, engine: str | EngineKind, address: str | None,
                  placement: str | None) -> tuple[ViewKind, dict[str, Any]]:
    """(view, the engine's options) as the run will use them; raises LaunchError for options that cannot be used.
    `%%ddp` calls it, with `plan`, before the cell runs: a bad flag or setting defines nothing and starts nothing."""
    chosen = choose_view(view)
    if chosen is ViewKind.TEXT:
        max_lines()
    return chosen, engines.engine_type(engines.kind_of(engine)).check(address, placement)


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
        raise LaunchError(f"{MAX_LINES_VAR} must be a number of lines (0 or more), not {value!r}: set it to one, "
                          f"or unset it for the default ({DEFAULT_MAX_LINES}).")
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


def launch(fn: Callable[..., Any], *, gpus: int | str | None = None, nprocs: int | None = None,
           backend: str | None = None, timeout: float | None = None, env: Mapping[str, str] | None = None,
           args: Sequence[Any] = (), view: str | None = None, engine: str = "local", address: str | None = None,
           placement: str | None = None, max_restarts: int = 0, checkpoint_dir: str | os.PathLike[str] | None = None,
           keep_checkpoints: int = DEFAULT_KEEP, resume: str | os.PathLike[str] | None = None, fold: bool = True,
           tensorboard: str | os.PathLike[str] | None = None, stall: float | None = None) -> Run:
    """Start `fn` on every rank and return the `Run` handle at once; the run goes on in the background.

    The handle has `wait()`, `result()`, `stop()`, `done` and `status`. `view` is 'auto' (default: the live
    dashboard in Jupyter, text elsewhere; see $DDPNB_VIEW), 'widget', 'text' or 'none'. In a notebook the
    dashboard keeps updating while other cells run and has a Stop button; the text view prints the ranks'
    output when `wait()` or `result()` is called.

    `engine='ray'` runs the ranks on a Ray cluster through Ray Train (`pip install -e '.[ray]'`): `address` is
    the cluster's ('auto', 'HOST:PORT', 'ray://HOST:PORT', 'local'; default: see the README), `placement` 'pack'
    (default: few nodes) or 'spread' (across nodes).

    `max_restarts=N`: when a rank fails (an error, a crash, the timeout), every rank is stopped and all start
    again as fresh processes, up to N times; `timeout` bounds each attempt. `ddpnb.save_checkpoint` writes under
    the run directory, or under `checkpoint_dir/<run name>`, keeping the newest `keep_checkpoints`;
    `ddpnb.load_checkpoint` reads the latest complete one. `resume='last'` (or a run directory) starts from the
    latest checkpoint of an earlier run that was stopped or failed.

    `fold=False` shows every rank's copy of a line the ranks all print (by default the text view and the
    dashboard's all-ranks log show it once, as `[ranks 0-3] ...`). `tensorboard=DIR` writes every rank's metrics
    as TensorBoard event files in `DIR/<run name>/rank<N>` while the run goes (`pip install tensorboard`).

    `stall=S`: when no rank has made progress (output, a metric, a progress tick) for S seconds, the run is marked
    stalled, with where each rank is, and goes on (default: adapted to the run; 0: never). `run.stacks()` gives
    every rank's stack at any time.
    """
    return start(fn, gpus=gpus, nprocs=nprocs, backend=backend, timeout=timeout, env=env, args=args, view=view,
                 foreground=False, engine=engine, address=address, placement=placement, max_restarts=max_restarts,
                 checkpoint_dir=checkpoint_dir, keep_checkpoints=keep_checkpoints, resume=resume, fold=fold,
                 tensorboard=tensorboard, stall=stall)


def function_name(fn: Any) -> str:
    """`train`, `Trainer.fit`, `partial(train)`; an object with `__call__`: its class."""
    if isinstance(fn, functools.partial):
        return f"partial({function_name(fn.func)})"
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _check_callable(fn: Any, args: tuple[Any, ...], call_style: CallStyle) -> None:
    """Refuse, before anything starts, a function the ranks could not call as ddpnb calls it."""
    name = function_name(fn)
    if not callable(fn):
        raise LaunchError(f"{name} is not a function (its type is {type(fn).__name__}): pass the function the ranks "
                          "should run.")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        kind = "an async function" if inspect.iscoroutinefunction(fn) else "a generator function"
        raise LaunchError(f"{name} is {kind}: each rank calls it and takes what it returns, so its body would never "
                          "run. Define it with a plain `def` (inside, asyncio.run(...) runs async code; return a "
                          "list instead of yielding).")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension callable: the rank will say
        return
    call = call_arguments(fn, "rank", "world_size", tuple(f"args[{i}]" for i in range(len(args))), call_style)
    try:
        signature.bind(*call)
    except TypeError as exc:
        shown = ", ".join(map(str, call))
        rule = ("ddpnb.spawn calls fn(rank, *args), as torch.multiprocessing.spawn does" if call_style is CallStyle.SPAWN else
                "ranks call fn(), fn(rank) or fn(rank, world_size), by the parameters without defaults, then the "
                "extra args given")
        raise LaunchError(f"{name}{signature} cannot be called as each rank would call it, {name}({shown}): {exc}; "
                          f"{rule}.") from None


def start(fn: Callable[..., Any], *, gpus: int | str | None = None, nprocs: int | None = None,
          backend: str | None = None, timeout: float | None = None, env: Mapping[str, str] | None = None,
          args: Sequence[Any] = (), call_style: CallStyle = CallStyle.AUTO, view: str | None = None,
          foreground: bool, engine: str = "local", address: str | None = None, placement: str | None = None,
          max_restarts: int = 0, checkpoint_dir: str | os.PathLike[str] | None = None,
          keep_checkpoints: int = DEFAULT_KEEP, resume: str | os.PathLike[str] | None = None,
          interactive: bool = False, fold: bool = True, tensorboard: str | os.PathLike[str] | None = None,
          stall: float | None = None) -> Run:
    """`launch`, telling the view whether the caller is about to wait (`run`, `%%ddp`) or not (`--background`);
    `interactive`: the ranks also take commands (a session's ranks, running `rank.session.serve`)."""
    global _last_record
    check_platform()
    if timeout is not None and not timeout > 0:  # nan too
        raise LaunchError(f"timeout must be a positive number of seconds, not {timeout!r}.")
    check_restarts(max_restarts, keep_checkpoints)
    stall = stall_seconds(stall)
    call_style = CallStyle(call_style)
    _check_callable(fn, tuple(args), call_style)
    kind = engines.kind_of(engine)
    planned = plan(gpus, nprocs, backend, kind)
    chosen_view, options = check_options(view, kind, address, placement)
    engine_type = engines.engine_type(kind)
    # the function's (and then the args') big tensors and arrays go where the engine's ranks read them: shared
    # memory they map (local), Ray's object store (ray)
    shipment = engine_type.shipment()
    payload = pickling.dump_function(fn, shipment)  # before anything starts: an unpicklable function starts nothing
    resumed = checkpoints.resume_source(resume) if resume is not None else None  # before the run dir: none if refused
    board_dir = check_tensorboard(tensorboard) if tensorboard is not None else None
    if checkpoint_dir is not None:
        try:
            Path(checkpoint_dir).expanduser().mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise LaunchError(f"checkpoint_dir {str(checkpoint_dir)!r} cannot be created ({exc.strerror}): pass a "
                              "directory you can write to.") from None
    held = checkpoints.hold(resumed[0]) if resumed else None  # before retention (`new_run_dir`) may delete it
    try:
        run_dir = rundir.new_run_dir()
    except BaseException:
        if held is not None:
            os.close(held)
        raise
    environ = {key: str(value) for key, value in engine_type.environment(dict(env or {})).items()}
    if planned.backend == "nccl" and kind is EngineKind.LOCAL:  # the kernel can dump it at a stall or timeout
        environ = {**flight.environment(run_dir), **environ}  # the user's own settings win
    sources = pickling.notebook_sources()
    spec = WorkerSpec(
        fn_payload=payload, args=tuple(args), call_style=call_style, world_size=planned.world_size,
        backend=planned.backend, use_gpus=planned.use_gpus, master_port=0, environ=environ, run_dir=str(run_dir),
        sources=sources, cell_names=cell_names_of(sources), torch_threads=engine_type.torch_threads(planned, environ),
        checkpoint_dir=str(checkpoints.for_run(run_dir, checkpoint_dir)),
        resume_dir=str(resumed[0]) if resumed else "", keep_checkpoints=keep_checkpoints, interactive=interactive,
    )
    devices = [f"cuda:{r}" if planned.use_gpus else "cpu" for r in range(planned.world_size)]
    run = Run(spec, devices, engine_type.create(spec, timeout, options), timeout=timeout, function=function_name(fn),
              max_restarts=max_restarts,
              new_engine=lambda attempt_spec: engine_type.create(attempt_spec, timeout, options),
              shared=shipment, stall=stall)
    run.hold(held)
    run.record.add_launch_note(planned.note)  # before any view: each view's header says them
    if resumed:
        run.record.add_launch_note(f"resuming from {resumed[0]}: its latest complete checkpoint is step "
                                   f"{resumed[1]} (ddpnb.load_checkpoint loads it)")
    run.start()
    if shipment is not None:  # every rank has the memory files: the store keeps them for the next launch
        run.record.data = shipment.commit()
        run.record.add_launch_note(shared.note(run.record.data))
    _last_record = run.record
    if chosen_view is ViewKind.WIDGET:
        from ddpnb.views.dashboard import Dashboard

        Dashboard(run, foreground=foreground, fold=fold)
    elif chosen_view is ViewKind.TEXT:
        from ddpnb.views.text import TextView

        TextView(run, max_lines(), fold=fold)
        if not foreground:
            print("[ddpnb] running in the background: its output shows here when you call .wait() or .result()")
    if board_dir is not None:
        board.TensorBoardWriter(run, board_dir)
    return run


def run(fn: Callable[..., Any], *, gpus: int | str | None = None, nprocs: int | None = None,
        backend: str | None = None, timeout: float | None = None, env: Mapping[str, str] | None = None,
        args: Sequence[Any] = (), view: str | None = None, engine: str = "local", address: str | None = None,
        placement: str | None = None, max_restarts: int = 0, checkpoint_dir: str | os.PathLike[str] | None = None,
        keep_checkpoints: int = DEFAULT_KEEP, resume: str | os.PathLike[str] | None = None, fold: bool = True,
        tensorboard: str | os.PathLike[str] | None = None, stall: float | None = None) -> Any:
    """Run `fn` on every rank, show their output here, and return rank 0's return value.

    `fn` is called as `fn()`, `fn(rank)` or `fn(rank, world_size)` (by its signature), followed by `args`.
    `gpus=N|'all'` starts one rank per GPU over NCCL; otherwise `nprocs` CPU ranks over gloo (default 2).
    `view`, `engine`, `address`, `placement`, restarts, checkpoints, `fold`, `tensorboard`, `stall`: see `launch`.
    Raises `WorkerError` if a rank fails (in the last attempt), with that rank's own traceback.
    """
    handle = start(fn, gpus=gpus, nprocs=nprocs, backend=backend, timeout=timeout, env=env, args=args,
                   view=view, foreground=True, engine=engine, address=address, placement=placement,
                   max_restarts=max_restarts, checkpoint_dir=checkpoint_dir, keep_checkpoints=keep_checkpoints,
                   resume=resume, fold=fold, tensorboard=tensorboard, stall=stall)
    return handle.result()


def spawn(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True,
          daemon: bool = False, start_method: str = "spawn", *, fold: bool = True,
          tensorboard: str | os.PathLike[str] | None = None, stall: float | None = None) -> Run | None:
    """Drop-in for `torch.multiprocessing.spawn`: calls `fn(rank, *args)` on `nprocs` ranks.

    Unlike mp.spawn it works with functions defined in a notebook and streams their output. Ranks use one
    GPU each (device set, NCCL) when the machine has `nprocs` GPUs, else CPU ranks over gloo. `join=False`
    returns the `Run`, whose `join()` waits like mp.spawn's context. `daemon` and `start_method` are accepted for
    compatibility and ignored: ranks are always fresh processes that ddpnb stops. `fold`, `tensorboard`, `stall`:
    see `launch`.
    """
    del daemon, start_method
    gpus = nprocs if nprocs <= local_gpu_count() else None
    handle = start(fn, gpus=gpus, nprocs=None if gpus else nprocs, args=args, call_style=CallStyle.SPAWN,
                   foreground=join, fold=fold, tensorboard=tensorboard, stall=stall)
    if not join:
        return handle
    handle.result()
    return None


def preload(*modules: str) -> list[str]:
    """Import `modules` once in the process ranks are forked from, so that every later launch starts with them:
    `ddpnb.preload("torchvision")` in a notebook's first cell. Ranks are still fresh processes; a module's import
    just happened before the fork instead of in every rank at every launch.

    Restarts that process (one `import torch` plus every preloaded module, now, in this call; calling it again
    re-imports a module you edited) and checks it: if a module cannot be imported there, is imported from another
    file than here, starts a thread or initialises CUDA when imported, nothing is added, with a `PreloadError`
    that says why. Returns every module preloaded so far; `ddpnb.preload()` only returns them.
    Do not preload a library that reads RANK or LOCAL_RANK when it is imported: it would read the kernel's.
    For the local engine only: Ray's workers import for themselves.
    """
    if rank_context.current() is not None:
        raise PreloadError("ddpnb.preload is for the notebook (it prepares the process ranks start from), not a rank.")
    engines.engine_type(EngineKind.LOCAL).check(None, None)  # ranks start in the kernel's working directory
    origins: dict[str, str | None] = {}  # where this kernel finds each module's top-level package
    for name in modules:
        if not isinstance(name, str) or not name or not all(part.isidentifier() for part in name.split(".")):
            raise PreloadError(f"ddpnb.preload takes module names such as 'torchvision', not {name!r}.")
        top = name.partition(".")[0]
        try:  # the top-level name only: finding a submodule would import its package here, in the kernel
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):  # ValueError: __main__, or a module without a spec
            found = None
        if found is None:
            raise PreloadError(f"ddpnb.preload: no module named {top!r} here; install it, or check the name.")
        origins[name] = found.origin if found.has_location else None
    return forkserver.preload(origins, busy=lambda: bool(live_runs(EngineKind.LOCAL)))


def runs() -> list[Run]:
    """The runs of this kernel still going, oldest first: the handles of background cells and `launch`es, each
    with `.stop()`, `.wait()`, `.result()` and a repr that says how it is now."""
    return live_runs()


def last_run() -> RunRecord | None:
    """The record of the latest run in this process: per-rank exit codes, durations, metrics, log paths."""
    return _last_record


def log(step: int | None = None, **scalars: float) -> None:
    """Send metrics from a worker to the notebook's dashboard: `ddpnb.log(step=i, loss=loss.item())`.

    Outside a ddpnb worker it does nothing, so the same function also runs as a plain script.
    """
    context = rank_context.current()
    if context is not None:
        values = {}
        for name, value in scalars.items():
            try:
                values[name] = float(value)
            except (TypeError, ValueError):
                shape = f" of shape {tuple(value.shape)}" if hasattr(value, "shape") else ""
                raise TypeError(f"ddpnb.log: {name} must be a number or a one-element tensor, not "
                                f"{type(value).__name__}{shape}: {value!r:.80}") from None
        context.send_metric(step, values)


def device() -> str:
    """This rank's device: 'cuda:LOCAL_RANK' on GPU runs, 'cpu' on CPU ranks (and outside a worker)."""
    return rank_context.device()


def attempt() -> int:
    """In a rank: which attempt of the run this is, 0 until a restart (`max_restarts`); 0 outside a worker."""
    return rank_context.attempt()


def check_tensorboard(directory: str | os.PathLike[str]) -> Path:
    """Refuse `tensorboard=` without TensorBoard installed, or with a directory that cannot be created (`%%ddp`
    calls it before the cell runs)."""
    return board.check(directory)


def check_restarts(max_restarts: int, keep_checkpoints: int, resume: str | os.PathLike[str] | None = None) -> None:
    """Refuse restart settings that cannot be used, and a `resume` with nothing to resume (`%%ddp` calls it
    before the cell runs)."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise LaunchError(f"max_restarts must be a whole number of 0 or more, not {max_restarts!r}.")
    if isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
        raise LaunchError(f"keep_checkpoints must be a whole number of 1 or more, not {keep_checkpoints!r}.")
    if resume is not None:
        checkpoints.resume_source(resume)
