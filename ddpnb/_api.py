"""`run`, `launch` and `spawn`: check the caller's options once (`_options`), start a `Run` on the engine they name,
and its view. The public functions in `ddpnb` are these."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddpnb import _compat
from ddpnb._options import DEFAULT_KEEP, Launch, LaunchOptions, max_lines
from ddpnb.core import checkpoints, data, flight, live, pickling, rundir
from ddpnb.core.cellnames import cell_names_of
from ddpnb.core.journal import JOURNAL_VAR
from ddpnb.core.journal.frames import JournalError
from ddpnb.core.policy import RestartPolicy
from ddpnb.core.record import RunRecord
from ddpnb.core.run import Run, RunSetup
from ddpnb.core.spec import (
    DEFAULT_CPU_RANKS,
    CallStyle,
    LaunchError,
    ViewKind,
    WorkerSpec,
    check_platform,
    enabled,
    local_gpu_count,
)
from ddpnb.core.stacks import the_callers
from ddpnb.detached import supervisor
from ddpnb.detached.attach import DetachedRun, Listed, listed
from ddpnb.detached.attach import attach as attach_to
from ddpnb.rank import context as rank_context
from ddpnb.rank.main import call_arguments
from ddpnb.views import tensorboard as board
from ddpnb.views.frontend import CellFrontEnd

__all__ = [
    "DEFAULT_CPU_RANKS",
    "DEFAULT_KEEP",
    "JournalError",
    "LaunchError",
    "LaunchOptions",
    "attach",
    "attempt",
    "device",
    "last_run",
    "launch",
    "log",
    "profile",
    "run",
    "runs",
    "spawn",
    "start",
]

_last_record: RunRecord | None = None  # the record only: a finished run's value belongs to the caller


def launch(fn: Callable[..., Any], /, **options: Any) -> Run | DetachedRun:
    """Start `fn` on every rank and return the `Run` handle at once; the run goes on in the background.

    The handle has `wait()`, `result()`, `stop()`, `stacks()`, `done` and `status`. The options are
    `ddpnb.LaunchOptions`' (gpus, nprocs, backend, timeout, env, args, view, engine, max_restarts, checkpoint_dir,
    keep_checkpoints, resume, fold, tensorboard, stall) and the engine's own beside them (`engine='ray'`:
    `address`, `placement`). `view` is 'auto' (default: the live dashboard in Jupyter, text elsewhere; see
    $DDPNB_VIEW), 'widget', 'text' or 'none'. In a notebook the dashboard keeps updating while other cells run
    and has a Stop button; the text view prints the ranks' output when `wait()` or `result()` is called.

    `max_restarts=N`: when a rank fails (an error, a crash, the timeout), every rank is stopped and all start
    again as fresh processes, up to N times; `timeout` bounds each attempt. `ddpnb.save_checkpoint` writes under
    the run directory, or under `checkpoint_dir/<run name>`, keeping the newest `keep_checkpoints`;
    `ddpnb.load_checkpoint` reads the latest complete one. `resume='last'` (or a run directory) starts from the
    latest checkpoint of an earlier run that was stopped or failed.

    `fold=False` shows every rank's copy of a line the ranks all print (by default the text view and the
    dashboard's all-ranks log show it once, as `[ranks 0-3] ...`). `tensorboard=DIR` writes every rank's metrics
    as TensorBoard event files in `DIR/<run name>/rank<N>` while the run goes (`pip install tensorboard`).

    `profile='5-7'` (or True: steps 3-5): torch.profiler on every rank over those steps, counted by
    `ddpnb.log(step=...)`; one merged trace, aligned across ranks, in `<run dir>/profile/trace.json.gz`, and each
    rank's step time split into compute, communication, waiting and data loading in `record.profile`
    (docs/profiling.md). `with ddpnb.profile():` profiles a region instead.

    `stall=S`: when no rank has made progress (output, a metric, a progress tick) for S seconds, the run is marked
    stalled, with where each rank is, and goes on (default: adapted to the run; 0: never). `run.stacks()` gives
    every rank's stack at any time.
    """
    return start(fn, LaunchOptions.of(options).check(), foreground=False)


def function_name(fn: Any) -> str:
    """`train`, `Trainer.fit`, `partial(train)`; an object with `__call__`: its class."""
    if isinstance(fn, functools.partial):
        return f"partial({function_name(fn.func)})"
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _check_callable(fn: Any, args: tuple[Any, ...], call_style: CallStyle) -> None:
    """Refuse, before anything starts, a function the ranks could not call as ddpnb calls it."""
    name = function_name(fn)
    if not callable(fn):
        raise LaunchError(
            f"{name} is not a function (its type is {type(fn).__name__}): pass the function the ranks should run."
        )
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        kind = "an async function" if inspect.iscoroutinefunction(fn) else "a generator function"
        raise LaunchError(
            f"{name} is {kind}: each rank calls it and takes what it returns, so its body would never "
            "run. Define it with a plain `def` (inside, asyncio.run(...) runs async code; return a "
            "list instead of yielding)."
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension callable: the rank will say
        return
    call = call_arguments(fn, "rank", "world_size", tuple(f"args[{i}]" for i in range(len(args))), call_style)
    try:
        signature.bind(*call)
    except TypeError as exc:
        shown = ", ".join(map(str, call))
        rule = (
            "ddpnb.spawn calls fn(rank, *args), as torch.multiprocessing.spawn does"
            if call_style is CallStyle.SPAWN
            else "ranks call fn(), fn(rank) or fn(rank, world_size), by the parameters without defaults, then the "
            "extra args given"
        )
        raise LaunchError(
            f"{name}{signature} cannot be called as each rank would call it, {name}({shown}): {exc}; {rule}."
        ) from None


def start(fn: Callable[..., Any], launch: Launch, *, foreground: bool, commands: bool = False) -> Run | DetachedRun:
    """Start a checked launch, telling the view whether the caller is about to wait (`run`, `%%ddp`) or not
    (`--background`); `commands`: the ranks also take commands over the engine's channel (a session's ranks,
    running `rank.session.serve`)."""
    global _last_record
    check_platform()
    options, engine_type = launch.options, launch.engine
    if commands and not engine_type.capabilities.commands:
        raise LaunchError(
            f"the {options.engine} engine cannot run sessions (it has no command channel to its "
            "ranks): use %%ddp / ddpnb.run on it, or a session on the local engine."
        )
    args = tuple(options.args)
    _check_callable(fn, args, CallStyle(options.call_style))
    # the function's (and then the args') big tensors and arrays go where the engine's ranks read them: shared
    # memory they map (local), Ray's object store (ray)
    detach = options.detach
    # a detached run's data cannot be memory files of the kernel's: they go with the kernel; it travels pickled
    shipment = None if detach else engine_type.shipment()
    payload = pickling.dump_function(fn, shipment)  # before anything starts: an unpicklable function starts nothing
    if options.checkpoint_dir is not None:
        try:
            Path(options.checkpoint_dir).expanduser().mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise LaunchError(
                f"checkpoint_dir {str(options.checkpoint_dir)!r} cannot be created ({exc.strerror}): "
                "pass a directory you can write to."
            ) from None
    resumed = launch.resumed
    held = checkpoints.hold(resumed[0]) if resumed else None  # before retention (`rundir.prune`) may delete it
    try:
        run_dir = rundir.new_run_dir()
    except BaseException:
        if held is not None:
            os.close(held)
        raise
    planned = launch.plan
    environ = {key: str(value) for key, value in engine_type.environment(dict(options.env)).items()}
    environ = {**flight.radar_environment(), **environ}  # the user's own settings win
    if planned.backend == "nccl" and engine_type.capabilities.shares_run_dir:  # dumped at a stall or timeout
        environ = {**flight.environment(run_dir), **environ}
    sources = pickling.notebook_sources()
    # a rank's breakpoint() asks the front end where it takes input: the cell that waits for the run (or a
    # session's command); for a run whose cell returned, its dashboard's console, `.wait()` or `.debug(rank)`
    prompts = engine_type.capabilities.commands and _compat.front_end_takes_input() and not detach
    if options.debug and not prompts:
        print(
            "[ddpnb] --debug needs a front end that takes input (Jupyter, not nbclient or a script): the run "
            "goes on without post-mortem prompts.",
            file=sys.stderr,
        )
    spec = WorkerSpec(
        fn_payload=payload,
        args=args,
        call_style=CallStyle(options.call_style),
        world_size=planned.world_size,
        backend=planned.backend,
        use_gpus=planned.use_gpus,
        environ=environ,
        run_dir=str(run_dir),
        sources=sources,
        cell_names=cell_names_of(sources),
        torch_threads=engine_type.torch_threads(planned, environ),
        timeout=options.timeout,
        checkpoint_dir=str(checkpoints.for_run(run_dir, options.checkpoint_dir)),
        resume_dir=str(resumed[0]) if resumed else "",
        keep_checkpoints=options.keep_checkpoints,
        prompts=prompts,
        debug=options.debug and prompts,
        profile=launch.profile,
    )
    devices = [f"cuda:{r}" if planned.use_gpus else "cpu" for r in range(planned.world_size)]
    if detach:
        return _start_detached(fn, launch, spec, devices, held)
    run = Run(
        RunSetup(
            spec=spec,
            devices=devices,
            engine=options.engine,
            capabilities=engine_type.capabilities,
            new_engine=functools.partial(engine_type.create, options=launch.engine_options),
            front_end=CellFrontEnd(launch.view, options.fold),
            function="session" if commands else function_name(fn),
            policy=RestartPolicy(options.max_restarts),
            shipment=shipment,
            stall=launch.stall,
            commands=commands,
            journal=enabled(JOURNAL_VAR),
        )
    )
    run.hold(held)
    run.record.add_launch_note(planned.note)  # before any view: each view's header says them
    if resumed:
        run.record.add_launch_note(
            f"resuming from {resumed[0]}: its latest complete checkpoint is step "
            f"{resumed[1]} (ddpnb.load_checkpoint loads it)"
        )
    run.start()
    if shipment is not None:  # every rank has what the pickles refer to: the store keeps it for the next launch
        run.record.data = shipment.commit()
        run.record.add_launch_note(data.note(run.record.data))
    if not commands:  # a session is not a run of the user's function: `last_run()` stays the latest one
        _last_record = run.record
    if launch.view is ViewKind.WIDGET:
        from ddpnb.views.dashboard import Dashboard

        Dashboard(run, foreground=foreground, fold=options.fold)
    elif launch.view is ViewKind.TEXT:
        from ddpnb.views.text import TextView

        TextView(run, max_lines(), fold=options.fold)
        if not foreground:
            print(
                "[ddpnb] running in the background: its output shows here when you call .wait() or .result(), "
                "which also ask a rank's breakpoint() prompts (or .debug(rank))"
            )
    if launch.tensorboard is not None:
        board.TensorBoardWriter(run, launch.tensorboard)
    return run


def _start_detached(
    fn: Callable[..., Any], launch: Launch, spec: WorkerSpec, devices: list[str], held: int | None
) -> DetachedRun:
    """Hand the checked launch to a supervisor of its own (`detached.supervisor`); the viewer's handle on it."""
    options, resumed = launch.options, launch.resumed
    notes = [launch.plan.note, "detached: its supervisor owns it, not this kernel (ddpnb.attach from any kernel)"]
    if resumed:
        notes.append(
            f"resuming from {resumed[0]}: its latest complete checkpoint is step {resumed[1]} "
            "(ddpnb.load_checkpoint loads it)"
        )
    plan = supervisor.DetachedPlan(
        spec=spec,
        devices=devices,
        engine=options.engine,
        engine_options=launch.engine_options,
        function=function_name(fn),
        max_restarts=options.max_restarts,
        stall=launch.stall,
        notes=[note for note in notes if note],
    )
    try:
        _, source = supervisor.start(plan)
    except BaseException:
        rundir.remove_if_empty(Path(spec.run_dir))
        raise
    finally:
        if held is not None:
            os.close(held)
    handle = DetachedRun(getattr(source, "path", Path(spec.run_dir)), source)
    if launch.view is ViewKind.WIDGET:
        from ddpnb.views.dashboard import Dashboard

        Dashboard(handle, foreground=False, fold=options.fold)  # type: ignore[arg-type]
    elif launch.view is ViewKind.TEXT:
        from ddpnb.views.text import TextView

        TextView(handle, max_lines(), fold=options.fold)  # type: ignore[arg-type]
        print(
            f"[ddpnb] detached as {handle.name}: it outlives this kernel; its output shows here when you call "
            ".wait() or .result(); ddpnb.attach('last') from any kernel"
        )
    return handle


def attach(which: str | os.PathLike[str] = "last") -> DetachedRun:
    """The handle of a detached run (`launch(fn, detach=True)`, `%%ddp --detach`) from any kernel: 'last' (the
    newest), its name (`ddpnb.runs()` lists them) or its run directory. It has `launch`'s API (`wait`, `result`,
    `stop`, `stacks`, `record`, `status`); displayed, the dashboard with the run's whole history, then live. A run
    whose batch job still waits in the queue is waited for, saying so (an interrupt stops the waiting, not the run)."""
    return attach_to(which)


def run(fn: Callable[..., Any], /, **options: Any) -> Any:
    """Run `fn` on every rank, show their output here, and return rank 0's return value.

    `fn` is called as `fn()`, `fn(rank)` or `fn(rank, world_size)` (by its signature), followed by `args`.
    `gpus=N|'all'` starts one rank per GPU over NCCL; otherwise `nprocs` CPU ranks over gloo (default 2).
    Every other option: see `launch` and `ddpnb.LaunchOptions`.
    Raises `WorkerError` if a rank fails (in the last attempt), with that rank's own traceback.
    """
    return start(fn, LaunchOptions.of(options).check(), foreground=True).result()


def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    **options: Any,
) -> Run | None:
    """Drop-in for `torch.multiprocessing.spawn`: calls `fn(rank, *args)` on `nprocs` ranks.

    Unlike mp.spawn it works with functions defined in a notebook and streams their output. Ranks use one
    GPU each (device set, NCCL) when the machine has `nprocs` GPUs, else CPU ranks over gloo. `join=False`
    returns the `Run`, whose `join()` waits like mp.spawn's context. `daemon` and `start_method` are accepted for
    compatibility and ignored: ranks are always fresh processes that ddpnb stops. Other options (`fold`,
    `tensorboard`, `stall`, ...): see `launch`.
    """
    del daemon, start_method
    gpus = nprocs if nprocs <= local_gpu_count() else None
    checked = LaunchOptions.of(
        {**options, "gpus": gpus, "nprocs": None if gpus else nprocs, "args": args, "call_style": CallStyle.SPAWN}
    ).check()
    handle = start(fn, checked, foreground=join)
    if not join:
        return handle
    handle.result()
    return None


def runs() -> list[Run | Listed]:
    """The runs of this kernel still going, oldest first: the handles of background cells and `launch`es, each
    with `.stop()`, `.wait()`, `.result()` and a repr that says how it is now; then this user's detached runs on
    this machine, each with its state ('queued' while its batch job waits, with the job's ID, 'running', 'orphaned'
    where its supervisor is gone, or how it ended) and `.attach()`."""
    return [*live.runs(), *listed()]  # type: ignore[list-item]


def last_run() -> RunRecord | None:
    """The record of the latest run in this process (`%%ddp`, `run`, `launch`, `spawn`): per-rank exit codes,
    durations, metrics, log paths. Sessions do not count; a session's own record is `session.run.record`."""
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
                raise the_callers(
                    TypeError(
                        f"ddpnb.log: {name} must be a number or a one-element tensor, not "
                        f"{type(value).__name__}{shape}: {value!r:.80}"
                    )
                ) from None
        context.send_metric(step, values)


def profile() -> contextlib.AbstractContextManager[None]:
    """In a rank: `with ddpnb.profile():` profiles the region with torch.profiler, on every rank (enter it on
    every rank, as a collective), into the run's merged trace and `record.profile`, as `--profile` does for steps.
    A rank profiles once per attempt. Outside a worker it does nothing."""
    context = rank_context.current()
    if context is None:
        return contextlib.nullcontext()
    from ddpnb.rank import profile as rank_profile

    return rank_profile.region(context)


def device() -> str:
    """This rank's device: 'cuda:LOCAL_RANK' on GPU runs, 'cpu' on CPU ranks (and outside a worker)."""
    return rank_context.device()


def attempt() -> int:
    """In a rank: which attempt of the run this is, 0 until a restart (`max_restarts`); 0 outside a worker."""
    return rank_context.attempt()
