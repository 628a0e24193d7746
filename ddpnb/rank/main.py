"""Everything a rank does once its engine has set up the process: the spec, the device, the process group, the
call, the result, and failures reported as data."""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpnb.core import messages as msg
from ddpnb.core.failures import is_knock_on
from ddpnb.core.spec import CallStyle, WorkerSpec
from ddpnb.core.stacks import user_locals, user_traceback
from ddpnb.rank import cells, checkpoint, data, debug, group, notebook, progress, radar
from ddpnb.rank import context as ctx

SLOW_IMPORTS = 0.5  # seconds rebuilding the function (its imports, mostly) that make rank 0 suggest ddpnb.preload

Setup = Callable[[int, WorkerSpec], str]  # the rank's environment and device; returns the device
JoinGroup = Callable[[ctx.RankContext, WorkerSpec], None]  # the process group, ready when the function starts


def run_function(
    context: ctx.RankContext, spec_payload: bytes, setup: Setup, join_group: JoinGroup, result_fd: int | None = None
) -> None:
    """The rank's whole life inside its engine: raises SystemExit(1) after reporting a failure, SystemExit(n)
    after reporting the function's own sys.exit(n)."""
    rank = context.rank
    ctx.enter(context)
    try:
        import cloudpickle

        notebook.fresh_main()
        spec: WorkerSpec = cloudpickle.loads(spec_payload)
        context.spec = spec
        _reseed()
        context.device = setup(rank, spec)
        data.set_device(context.device)  # notebook CUDA tensors onto this rank's own device, now it is set up
        context.send(msg.Started(rank=rank, device=context.device))
        cells.register(spec.sources, spec.cell_names)
        group.patch_init_process_group()
        progress.install_hook()
        if context.device.startswith("cuda"):
            threading.Thread(
                target=progress.report_gpu_memory, args=(context,), name="ddpnb-gpu-memory", daemon=True
            ).start()
        threading.Thread(
            target=radar.sample_hardware, args=(rank, context.device, context.send), name="ddpnb-hardware", daemon=True
        ).start()
        join_group(context, spec)
        debug.install(context, spec.prompts)
        if spec.profile is not None:  # only then: a run without --profile never imports the profiler's code
            from ddpnb.rank import profile

            context.profiler = profile.StepWindow(context, *spec.profile)
        fn = _load_function(context, spec.fn_payload)
        notebook.adopt(fn)  # its notebook classes and functions, findable by name in the processes it starts
        value = fn(*call_arguments(fn, rank, spec.world_size, spec.args, spec.call_style))
        checkpoint.finish()  # an asynchronous save the function left being written completes before the result
        if context.profiler is not None:
            context.profiler.finish()
        context.send(_dump_result(value, result_fd) if rank == 0 else msg.Returned(rank=rank))
    except SystemExit as exc:  # reported (where it was called), then honoured by the engine's rank code
        _report(context, exc, message=repr(exc.code) if exc.code is not None else "")
        raise
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the user's failure: report it as data, exit non-zero
        # --debug: at the raising frame first, then the usual report; not where the rank only saw a peer fail
        if (
            context.spec is not None
            and context.spec.debug
            and not isinstance(exc, KeyboardInterrupt)
            and not is_knock_on(type(exc).__name__, str(exc))
        ):
            debug.post_mortem(context, exc)
        _report(context, exc, message=str(exc))
        raise SystemExit(1) from None


def _load_function(context: ctx.RankContext, payload: bytes) -> Any:
    """The user's function, rebuilt; unpickling imports the modules it refers to (a notebook's `torchvision`).
    Rank 0 says which top-level packages that took when it is slow, so the kernel can suggest `ddpnb.preload`."""
    import cloudpickle

    watch = context.rank == 0 and context.suggests_preload
    known = set(sys.modules) if watch else set()
    began = time.perf_counter()
    fn = cloudpickle.loads(payload)
    seconds = time.perf_counter() - began
    if watch and seconds >= SLOW_IMPORTS:
        new = {top for name in sys.modules.keys() - known if (top := name.partition(".")[0]) not in known}
        new -= set(sys.stdlib_module_names)
        named = _named_in(payload, new)
        if named:
            context.send(msg.Imported(rank=0, seconds=seconds, modules=named))
    return fn


def _named_in(payload: bytes, modules: set[str]) -> tuple[str, ...]:
    """Which of the newly imported top-level `modules` to suggest preloading: installed packages (a module of
    one's own, edited next to the notebook, would go stale in the forkserver) that the pickle names itself
    (cloudpickle writes the name of every module it imports and by-reference object it refers to), never those
    they imported in turn: 'torchvision', not the 30 packages torchvision pulls in, nor the sympy that torch
    imports lazily for a `torch.fx` name (the user's code never names it: preloading it is torch's business)."""
    import pickletools

    installed = {name for name in modules if _installed(sys.modules.get(name))}
    if not installed or len(payload) > 10_000_000:  # reading a big closure's opcodes would delay the function
        return ()
    return tuple(
        sorted(
            {
                top
                for _, arg, _ in pickletools.genops(payload)
                if isinstance(arg, str) and (top := arg.partition(".")[0]) in installed
            }
        )
    )


def _installed(module: Any) -> bool:
    path = getattr(module, "__file__", None) or ""
    return any(part in ("site-packages", "dist-packages") for part in path.split(os.sep))


def _report(context: ctx.RankContext, exc: BaseException, message: str) -> None:
    context.send(
        msg.Failed(
            rank=context.rank,
            time=time.time(),
            exc_type=type(exc).__qualname__,
            message=message,
            traceback=user_traceback(exc),
            frames=user_locals(exc),
        )
    )


def _reseed() -> None:
    """Fresh random state, as a fresh process would have: the forkserver seeded torch (and numpy) once, so
    every rank of every run would otherwise draw the same numbers. (Python's `random` reseeds itself at fork.)"""
    import torch

    torch.seed()  # CPU generator only until CUDA is initialised; CUDA generators seed themselves lazily
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def call_arguments(
    fn: Any, rank: Any, world_size: Any, args: tuple[Any, ...], call_style: CallStyle
) -> tuple[Any, ...]:
    """What the rank calls `fn` with: `fn(rank, *args)` for `spawn`; otherwise fn(), fn(rank) or
    fn(rank, world_size) by its parameters, then `args`. The kernel checks the call with stand-ins first."""
    if call_style is CallStyle.SPAWN:
        return (rank, *args)
    positional = [
        p for p in inspect.signature(fn).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if args:  # rank and world_size fill the positional slots the args leave, defaulted ones included
        leading = len(positional) - len(args)
    else:  # fn(), fn(rank), fn(rank, world_size): defaulted parameters keep their defaults
        leading = sum(p.default is p.empty for p in positional)
    return (*(rank, world_size)[: max(0, min(leading, 2))], *args)


def _dump_result(value: Any, result_fd: int | None) -> msg.Returned:
    """Rank 0's value for the kernel, every tensor moved to the CPU however deeply it is nested.

    Without tensors it is cloudpickled into the message. With tensors (a state dict), and where the kernel gave
    this rank a result file (an anonymous memory file, `Run.start`), it is written there with torch.save: the
    tensor bytes once and raw, which the kernel then maps (`torch.load(mmap=True)`) instead of reading; no
    pickle of the bytes, no pipe, no second copy in the kernel.
    """
    from ddpnb.core.pickling import HoldsTensors, NotPicklableError, dumps, save, unpicklable_path

    try:
        if result_fd is not None:
            try:
                return msg.Returned(rank=0, payload=dumps(value, tensors=False))
            except HoldsTensors:
                save(value, result_fd)
                return msg.Returned(rank=0, saved=True)
        return msg.Returned(rank=0, payload=dumps(value))
    except OSError:  # out of memory for the result file: say so as it is
        raise
    except Exception as exc:  # noqa: BLE001 - cloudpickle raises TypeError, PicklingError, AttributeError, ...
        raise NotPicklableError(
            f"rank 0's return value cannot be sent back to the notebook: {unpicklable_path(value, 'return value')} "
            f"cannot be pickled ({type(exc).__name__}: {exc}).\n"
            "Return plain data (tensors, numbers, lists, dicts, a state_dict()), or save the object to a file and "
            "return its path."
        ) from None


def exit_code(exc: SystemExit) -> int:
    """What the interpreter would exit with: sys.exit() is 0, sys.exit("message") prints it and is 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1
