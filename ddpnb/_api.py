"""`run`, `launch` and `spawn`: build a worker spec from the caller's arguments and start a `Run`."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddpnb import _forkserver, _pickling, _supervisor, _worker
from ddpnb._forkserver import PreloadError
from ddpnb._record import RunRecord
from ddpnb._supervisor import Run

CPU_FALLBACK_VAR = "DDPNB_CPU_FALLBACK"
VIEW_VAR = "DDPNB_VIEW"
VIEWS = ("auto", "widget", "text", "none")
MAX_LINES_VAR = "DDPNB_MAX_LINES"
DEFAULT_MAX_LINES = 1000  # lines of output the text view shows; every line is in the logs
DEFAULT_CPU_RANKS = 2
ENGINES = ("local", "ray")

_last_record: RunRecord | None = None  # the record only: a finished run's value belongs to the caller


class LaunchError(ValueError):
    """The run cannot start as asked (bad arguments, too many GPUs). Nothing was started."""


def _enabled(name: str) -> bool:
    """An on/off environment variable: unset, empty, 0, false, no and off are off."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _usable_cpus() -> int:
    """The CPUs this process may run on (taskset, a container's cpuset), not every CPU the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _gpu_count() -> int:
    """GPUs this process may use, counted through NVML: CUDA is not initialised in the kernel."""
    import torch

    return torch.cuda.device_count()


def plan(gpus: int | str | None, nprocs: int | None, backend: str | None,
         engine: str = "local") -> tuple[int, bool, str, str]:
    """(world size, use GPUs, backend, note) for the flags given; raises LaunchError for impossible ones."""
    if engine not in ENGINES:
        raise LaunchError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}.")
    if nprocs is not None and (not isinstance(nprocs, int) or nprocs < 1):
        raise LaunchError(f"nprocs must be a positive integer, not {nprocs!r}.")
    if backend is not None and backend not in ("nccl", "gloo"):
        raise LaunchError(f"backend must be 'nccl' or 'gloo', not {backend!r}.")
    if engine == "ray":  # the GPUs are the cluster's, not this machine's
        from ddpnb import _ray

        return _ray.plan(gpus, nprocs, backend)
    note = ""
    if gpus is None:
        world_size, use_gpus = nprocs or DEFAULT_CPU_RANKS, False
    else:
        available = _gpu_count()
        if gpus == "all":
            if available == 0 and not _enabled(CPU_FALLBACK_VAR):
                raise LaunchError(_no_gpus_message("all", available))
            wanted = available or nprocs or DEFAULT_CPU_RANKS
        else:
            try:
                wanted = int(gpus)
            except ValueError:
                raise LaunchError(f"--gpus takes a number or 'all', not {gpus!r}.") from None
            if wanted < 1:
                raise LaunchError(f"--gpus must be at least 1, not {wanted}.")
        if nprocs is not None and nprocs != wanted:
            raise LaunchError(f"--gpus {gpus} starts one rank per GPU; leave out --nprocs {nprocs}.")
        if wanted <= available:
            world_size, use_gpus = wanted, True
        elif _enabled(CPU_FALLBACK_VAR):
            world_size, use_gpus = wanted, False
            note = (f"[ddpnb] {available} GPU(s) here: running --gpus {gpus} as {wanted} CPU ranks over gloo "
                    f"({CPU_FALLBACK_VAR} is set)")
        else:
            raise LaunchError(_no_gpus_message(gpus, available))
    if backend == "nccl" and not use_gpus:
        raise LaunchError("the nccl backend needs GPUs; use --gpus N, or gloo for CPU ranks.")
    return world_size, use_gpus, backend or ("nccl" if use_gpus else "gloo"), note


def _no_gpus_message(gpus: int | str, available: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    have = f"{available} GPU(s) visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
    fewer = f"use --gpus {available} or fewer, " if available else ""
    return (f"--gpus {gpus} asks for more GPUs than this machine has: {have}. To go on, {fewer}run on CPU ranks "
            f"with -n N (gloo), or set {CPU_FALLBACK_VAR}=1 to dry-run --gpus notebooks on CPU ranks.")


def check_options(view: str | None, engine: str, address: str | None,
                  placement: str | None) -> tuple[str, str | None]:
    """(view, placement) as the run will use them; raises LaunchError for options that cannot be used. `%%ddp`
    calls it, with `plan`, before the cell runs: a bad flag or setting defines nothing and starts nothing."""
    view = choose_view(view)
    if view == "text":
        max_lines()
    if engine == "ray":
        from ddpnb import _ray

        return view, _ray.check_placement(placement)
    if address is not None or placement is not None:
        raise LaunchError("address and placement are for the ray engine: add engine='ray' (--engine ray).")
    return view, placement


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


def choose_view(view: str | None = None) -> str:
    """'widget', 'text' or 'none': `view`, else $DDPNB_VIEW, else 'auto'.

    'auto' is the dashboard inside a Jupyter kernel (ZMQInteractiveShell) where ipywidgets imports, plain text
    everywhere else (terminal IPython, scripts). A kernel cannot tell whether its front end renders widgets, so
    executing notebooks headless (nbclient, nbconvert) without storing widget state should set DDPNB_VIEW=text
    to get `[rank N]` lines as stream output; the dashboard's own fallback is the final summary.
    """
    choice = (view or os.environ.get(VIEW_VAR) or "auto").strip().lower()
    if choice not in VIEWS:
        raise LaunchError(f"view must be one of {', '.join(VIEWS)}, not {choice!r} (from {VIEW_VAR} or view=).")
    if choice != "auto":
        return choice
    shell_module = sys.modules.get("IPython")
    shell = shell_module.get_ipython() if shell_module is not None else None
    if shell is None or not any(cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__):
        return "text"
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return "text"
    return "widget"


def launch(fn: Callable[..., Any], *, gpus: int | str | None = None, nprocs: int | None = None,
           backend: str | None = None, timeout: float | None = None, env: Mapping[str, str] | None = None,
           args: Sequence[Any] = (), view: str | None = None, engine: str = "local", address: str | None = None,
           placement: str | None = None) -> Run:
    """Start `fn` on every rank and return the `Run` handle at once; the run goes on in the background.

    The handle has `wait()`, `result()`, `stop()`, `done` and `status`. `view` is 'auto' (default: the live
    dashboard in Jupyter, text elsewhere; see $DDPNB_VIEW), 'widget', 'text' or 'none'. In a notebook the
    dashboard keeps updating while other cells run and has a Stop button; the text view prints the ranks'
    output when `wait()` or `result()` is called.

    `engine='ray'` runs the ranks on a Ray cluster through Ray Train (`pip install 'ddpnb[ray]'`): `address` is
    the cluster's ('auto', 'HOST:PORT', 'ray://HOST:PORT', 'local'; default: see the README), `placement` 'pack'
    (default: few nodes) or 'spread' (across nodes).
    """
    return start(fn, gpus=gpus, nprocs=nprocs, backend=backend, timeout=timeout, env=env, args=args, view=view,
                 foreground=False, engine=engine, address=address, placement=placement)


def function_name(fn: Any) -> str:
    """`train`, `Trainer.fit`, `partial(train)`; an object with `__call__`: its class."""
    if isinstance(fn, functools.partial):
        return f"partial({function_name(fn.func)})"
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _check_callable(fn: Any, args: tuple[Any, ...], call_style: str) -> None:
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
    call = _worker.call_arguments(fn, "rank", "world_size", tuple(f"args[{i}]" for i in range(len(args))), call_style)
    try:
        signature.bind(*call)
    except TypeError as exc:
        shown = ", ".join(map(str, call))
        rule = ("ddpnb.spawn calls fn(rank, *args), as torch.multiprocessing.spawn does" if call_style == "spawn" else
                "ranks call fn(), fn(rank) or fn(rank, world_size), by the parameters without defaults, then the "
                "extra args given")
        raise LaunchError(f"{name}{signature} cannot be called as each rank would call it, {name}({shown}): {exc}; "
                          f"{rule}.") from None


def _check_working_directory() -> None:
    """Ranks start in the kernel's working directory, as every multiprocessing child does."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise LaunchError("this kernel's working directory no longer exists (deleted, or moved?), and ranks start in "
                          "it: change to one that exists (os.chdir(...), or %cd in a notebook), then run the cell "
                          "again.") from None


def start(fn: Callable[..., Any], *, gpus: int | str | None = None, nprocs: int | None = None,
          backend: str | None = None, timeout: float | None = None, env: Mapping[str, str] | None = None,
          args: Sequence[Any] = (), call_style: str = "auto", view: str | None = None,
          foreground: bool, engine: str = "local", address: str | None = None, placement: str | None = None) -> Run:
    """`launch`, telling the view whether the caller is about to wait (`run`, `%%ddp`) or not (`--background`)."""
    global _last_record
    if timeout is not None and not timeout > 0:  # nan too
        raise LaunchError(f"timeout must be a positive number of seconds, not {timeout!r}.")
    _check_callable(fn, tuple(args), call_style)
    world_size, use_gpus, backend, note = plan(gpus, nprocs, backend, engine)
    view, placement = check_options(view, engine, address, placement)
    if engine == "local":
        _check_working_directory()
    payload = _pickling.dump_function(fn)  # before anything starts: an unpicklable function starts nothing
    run_dir = _supervisor.new_run_dir()
    # a cluster's nodes keep their own environment: only the variables asked for travel there
    environ = {**os.environ, **(env or {})} if engine == "local" else dict(env or {})
    spec = _worker.WorkerSpec(
        fn_payload=payload, args=tuple(args), call_style=call_style, world_size=world_size, backend=backend,
        use_gpus=use_gpus, master_port=0, environ={k: str(v) for k, v in environ.items()}, run_dir=str(run_dir),
        sources=_pickling.notebook_sources(),
        torch_threads=None if use_gpus or engine == "ray" or "OMP_NUM_THREADS" in environ
        else max(1, _usable_cpus() // world_size),
    )
    devices = [f"cuda:{r}" if use_gpus else "cpu" for r in range(world_size)]
    if engine == "ray":
        from ddpnb import _ray

        run: Run = _ray.RayRun(spec, devices, timeout=timeout, address=address, placement=placement)
    else:
        run = Run(spec, devices, timeout=timeout)
    run.record.function = function_name(fn)
    if note:
        print(note, file=sys.stderr)
    run.start()
    _last_record = run.record
    if view == "widget":
        from ddpnb._dashboard import Dashboard

        Dashboard(run, foreground=foreground)
    elif view == "text":
        from ddpnb._text_view import TextView

        TextView(run, max_lines())
        if not foreground:
            print("[ddpnb] running in the background: its output shows here when you call .wait() or .result()")
    return run


def run(fn: Callable[..., Any], *, gpus: int | str | None = None, nprocs: int | None = None,
        backend: str | None = None, timeout: float | None = None, env: Mapping[str, str] | None = None,
        args: Sequence[Any] = (), view: str | None = None, engine: str = "local", address: str | None = None,
        placement: str | None = None) -> Any:
    """Run `fn` on every rank, show their output here, and return rank 0's return value.

    `fn` is called as `fn()`, `fn(rank)` or `fn(rank, world_size)` (by its signature), followed by `args`.
    `gpus=N|'all'` starts one rank per GPU over NCCL; otherwise `nprocs` CPU ranks over gloo (default 2).
    `view`, `engine`, `address`, `placement`: see `launch`. Raises `WorkerError` if a rank fails, with that
    rank's own traceback.
    """
    handle = start(fn, gpus=gpus, nprocs=nprocs, backend=backend, timeout=timeout, env=env, args=args,
                   view=view, foreground=True, engine=engine, address=address, placement=placement)
    return handle.result()


def spawn(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True,
          daemon: bool = False, start_method: str = "spawn") -> Run | None:
    """Drop-in for `torch.multiprocessing.spawn`: calls `fn(rank, *args)` on `nprocs` ranks.

    Unlike mp.spawn it works with functions defined in a notebook and streams their output. Ranks use one
    GPU each (device set, NCCL) when the machine has `nprocs` GPUs, else CPU ranks over gloo. `join=False`
    returns the `Run`, whose `join()` waits like mp.spawn's context. `daemon` and `start_method` are accepted for
    compatibility and ignored: ranks are always fresh processes that ddpnb stops.
    """
    del daemon, start_method
    gpus = nprocs if nprocs <= _gpu_count() else None
    handle = start(fn, gpus=gpus, nprocs=None if gpus else nprocs, args=args, call_style="spawn", foreground=join)
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
    if _worker.current() is not None:
        raise PreloadError("ddpnb.preload is for the notebook (it prepares the process ranks start from), not a rank.")
    _check_working_directory()
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
    return _forkserver.preload(origins, busy=_supervisor.local_run_going)


def last_run() -> RunRecord | None:
    """The record of the latest run in this process: per-rank exit codes, durations, metrics, log paths."""
    return _last_record


def log(step: int | None = None, **scalars: float) -> None:
    """Send metrics from a worker to the notebook's dashboard: `ddpnb.log(step=i, loss=loss.item())`.

    Outside a ddpnb worker it does nothing, so the same function also runs as a plain script.
    """
    context = _worker.current()
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
    return _worker.device()
