"""The entry point inside each rank: fds, environment, device, process group, the call, the result.

Runs in a process forked from the pre-warmed, CUDA-free forkserver (see `_supervisor`). Nothing here runs in
the kernel except `WorkerSpec` construction.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import inspect
import io
import linecache
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from ddpnb import _messages as msg

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
PROCESS_PREFIX = "ddpnb-"  # names ddpnb's processes: `ddpnb-rank0`, `ddpnb-preload-check`


@dataclass
class WorkerSpec:
    """What every rank needs; sent through the forkserver's private socket, never argv or the environment."""

    fn_payload: bytes  # cloudpickled function
    args: tuple[Any, ...]
    call_style: str  # "spawn": fn(rank, *args); "auto": fn(), fn(rank) or fn(rank, world_size)
    world_size: int
    backend: str
    use_gpus: bool
    master_port: int
    environ: dict[str, str]
    run_dir: str
    sources: dict[str, list[str]] = field(default_factory=dict)  # notebook cells, so tracebacks show lines
    torch_threads: int | None = None


class FdForChild:
    """A file descriptor passed to a worker as a `Process` argument: duplicated into the child over the
    forkserver's socket, as multiprocessing does for pipes and sockets; the child receives the int."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicated: Any) -> int:
    return duplicated.detach()


class _Context:
    """The running worker's link to the kernel; `ddpnb.log` sends through it.

    The channel is the write end of a pipe; each message is one frame (`_messages.header`, then its bytes),
    written with as few `os.write` calls as possible, because this runs inside the user's training step.
    """

    def __init__(self, rank: int, channel: Connection) -> None:
        self.rank = rank
        self.channel = channel  # keeps the fd open
        self.fd = channel.fileno()
        self.lock = threading.Lock()

    def send(self, message: msg.Message) -> None:
        self._write(msg.encode(message))

    def send_metric(self, step: int | None, values: dict[str, float]) -> None:
        """`ddpnb.log`'s path, inside the training step: what `send(Metric(...))` writes, without building the
        dataclass first (76 µs a call instead of 120 µs, with the caches cold from the step)."""
        self._write(msg.encode_metric(self.rank, step, time.time(), values))

    def _write(self, data: bytes) -> None:
        header = msg.header(len(data))
        with self.lock:
            if len(data) <= 4000:  # one write up to PIPE_BUF (4 KiB) is never split nor interleaved
                os.write(self.fd, header + data)
                return
            os.write(self.fd, header)
            view = memoryview(data)  # a big value: written in place, not copied into a frame first
            while view:
                view = view[os.write(self.fd, view):]


_context: _Context | None = None
_store: Any = None  # the TCPStore every process group of this run rendezvouses on
_store_uses = 0
_device: str = "cpu"
_stack_file: io.TextIOBase | None = None
_store_fd: int | None = None  # rank 0: the kernel's bound 127.0.0.1 socket its TCPStore listens on
_result_fd: int | None = None  # rank 0: the kernel's anonymous memory file for a result that holds tensors
LEAVE_WAIT = 0.05  # seconds rank 0 waits for the other ranks to finish before it takes down its process group


def current() -> _Context | None:
    return _context


def device() -> str:
    return _device


def entry(rank: int, channel: Connection, lifeline: Connection, out: Connection, err: Connection,
          spec_payload: bytes, store_socket: socket.socket | None = None, result_fd: int | None = None) -> None:
    """multiprocessing target: runs once per rank. `channel` carries messages to the kernel; `lifeline` is a pipe
    the kernel never writes to, so it reads EOF only when the kernel is gone. `spec_payload` is the cloudpickled
    `WorkerSpec`, unpickled here, after the output is redirected, so that a failure to rebuild it is reported
    like any other. Rank 0 also gets the socket for its TCPStore and the file for its result."""
    global _context, _store_fd, _result_fd
    # what the forkserver imported (torch: ~200,000 objects) is never garbage: keep the garbage collector from
    # walking it, which took ~110 ms a full collection and copied every page it touched out of the shared memory
    gc.freeze()
    os.setsid()  # own process group: the kernel's SIGINT never reaches us, and we can be killed as a group
    _redirect_output(out, err)
    _context = _Context(rank, channel)
    threading.Thread(target=_watch_kernel, args=(lifeline,), name="ddpnb-watchdog", daemon=True).start()
    if store_socket is not None:
        _store_fd = store_socket.detach()  # the TCPStore takes it over
    _result_fd = result_fd

    code = 0
    try:
        _run_function(rank, spec_payload)
        _leave_store(rank)
    except SystemExit as exc:  # sys.exit(n) inside the function: exit as asked (the kernel reports it)
        code = _exit_code(exc)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: user threads or CUDA state must not hang the exit


def _leave_store(rank: int) -> None:
    """Rank 0 hosts the run's TCPStore, so it exits only once every rank's function has returned: a rank still
    running needs the store. The others say they are done and exit, their process group with them (exiting
    closes its sockets; `destroy_process_group` would cost each rank 20 ms of the launch here).

    Ranks usually finish together; if one is still going after LEAVE_WAIT, rank 0 first takes down its process
    group, so that a rank waiting in a collective rank 0 will never join fails now rather than after the
    backend's timeout (gloo; an NCCL peer still waits for NCCL's). Best effort: the rank's function has returned,
    so nothing here is the user's failure.
    """
    if _store is None:
        return
    try:
        if rank:
            _store.set(f"ddpnb/done/{rank}", b"")
            return
        others = [f"ddpnb/done/{r}" for r in range(1, int(os.environ["WORLD_SIZE"]))]
        deadline = time.monotonic() + LEAVE_WAIT
        # `check`, not `wait` with a timeout: a wait that times out prints c10d warnings into the rank's output
        while not _store.check(others):
            if time.monotonic() > deadline:
                _destroy_process_group()
                _store.wait(others, datetime.timedelta(days=365))
                return
            time.sleep(0.005)
    except Exception:  # noqa: BLE001 - a store gone with a failed rank: the kernel reports that rank
        return


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter would exit with: sys.exit() is 0, sys.exit("message") prints it and is 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _prepare(rank: int, spec: WorkerSpec) -> None:
    _install_stack_dump(spec.run_dir, rank)
    os.environ.clear()
    os.environ.update(INIT_BARRIER)  # unless the kernel's environment or --env says otherwise
    os.environ.update(spec.environ)
    os.environ.update(_torchrun_env(rank, spec))
    loopback = _loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        # ranks of a local run talk over loopback: gloo would otherwise listen on the address the hostname
        # resolves to, which on many machines is reachable from the network
        os.environ["GLOO_SOCKET_IFNAME"] = loopback


def _omp_num_threads() -> int | None:
    """The user's OMP_NUM_THREADS (`--env`, or set in the kernel after the forkserver started): torch read the
    variable when the forkserver imported it, so a rank must apply the value it was given itself."""
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        return None
    return threads if threads > 0 else None


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in names if name in ("lo", "lo0")), None)


def _redirect_output(out: Connection, err: Connection) -> None:
    """Point fds 1 and 2 at the kernel's pipes, so C/C++ writes and crash messages are captured too."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)


def _watch_kernel(lifeline: Connection) -> None:
    """Parent-death watchdog: the kernel holds the write end of `lifeline`; EOF means it is gone."""
    try:
        while True:
            lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os.killpg(0, signal.SIGKILL)  # this rank and whatever it started (DataLoader workers, ...)


def _install_stack_dump(run_dir: str, rank: int) -> None:
    """SIGUSR1 writes every thread's Python stack to a file: how the kernel learns where a stalled rank is."""
    global _stack_file
    faulthandler.enable(file=sys.stderr, all_threads=True)
    _stack_file = open(os.path.join(run_dir, f"rank{rank}.stack"), "w", opener=_private)  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


# init_process_group returns once this rank's group is up, not every rank's: a rank whose function is quick can
# take its group down (or exit) while a peer is still connecting gloo's full mesh, and that peer fails with
# "Gloo connectFullMesh failed ... Connection closed by peer" (2 runs in 30 of 8 ranks here, with any launcher).
# torch's own store barrier at the end of init_process_group closes that gap; ddpnb turns it on.
INIT_BARRIER = {"TORCH_DIST_INIT_BARRIER": "1"}


def _torchrun_env(rank: int, spec: WorkerSpec) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(spec.master_port),
        "DDPNB_WORKER": "1",
    }


def _run_function(rank: int, spec_payload: bytes, setup: Callable[[int, WorkerSpec], str] | None = None,
                  join_group: Callable[[int, WorkerSpec], None] | None = None) -> None:
    """Everything a rank does, its failures reported as data. An engine that places ranks and forms the process
    group itself (Ray Train, see `_ray`) passes `setup` (environment; returns the device) and `join_group`."""
    global _device
    assert _context is not None
    try:
        import cloudpickle
        import torch

        spec: WorkerSpec = cloudpickle.loads(spec_payload)
        _reseed()
        if setup is not None:
            _device = setup(rank, spec)
        else:
            _prepare(rank, spec)
            threads = spec.torch_threads or _omp_num_threads()
            if threads:
                torch.set_num_threads(threads)
            if spec.use_gpus:
                torch.cuda.set_device(rank)
                _device = f"cuda:{rank}"
        _context.send(msg.Started(rank=rank, device=_device))
        linecache.cache.update({name: (len("".join(lines)), None, lines, name) for name, lines in spec.sources.items()})
        _patch_init_process_group()
        _install_progress_hook()
        if _device.startswith("cuda"):
            threading.Thread(target=_report_gpu_memory, name="ddpnb-gpu-memory", daemon=True).start()
        (join_group or _init_process_group)(rank, spec)
        fn = _load_function(rank, spec.fn_payload)
        value = fn(*call_arguments(fn, rank, spec.world_size, spec.args, spec.call_style))
        _context.send(_dump_result(value) if rank == 0 else msg.Returned(rank=rank))
    except SystemExit as exc:  # reported (where it was called), then honoured by `entry`
        _report(rank, exc, message=repr(exc.code) if exc.code is not None else "")
        raise
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the user's failure: report it as data, exit non-zero
        _report(rank, exc, message=str(exc))
        raise SystemExit(1) from None


SLOW_IMPORTS = 0.5  # seconds rebuilding the function (its imports, mostly) that make rank 0 suggest ddpnb.preload


def _load_function(rank: int, payload: bytes) -> Any:
    """The user's function, rebuilt; unpickling imports the modules it refers to (a notebook's `torchvision`).
    Rank 0 says which top-level packages that took when it is slow, so the kernel can suggest `ddpnb.preload`."""
    import cloudpickle

    assert _context is not None
    known = set(sys.modules) if rank == 0 else set()
    began = time.perf_counter()
    fn = cloudpickle.loads(payload)
    seconds = time.perf_counter() - began
    if rank == 0 and seconds >= SLOW_IMPORTS:
        new = {top for name in sys.modules.keys() - known if (top := name.partition(".")[0]) not in known}
        new -= set(sys.stdlib_module_names)
        named = _named_in(payload, new)
        if named:
            _context.send(msg.Imported(rank=0, seconds=seconds, modules=named))
    return fn


def _named_in(payload: bytes, modules: set[str]) -> tuple[str, ...]:
    """Which of the newly imported top-level `modules` to suggest preloading: installed packages (a module of
    one's own, edited next to the notebook, would go stale in the forkserver) that the pickle names itself
    (cloudpickle writes the name of every module and by-reference object it refers to), rather than those they
    imported in turn: 'torchvision', not the 30 packages torchvision pulls in."""
    import pickletools

    installed = {name for name in modules if _installed(sys.modules.get(name))}
    named: set[str] = set()
    if len(payload) <= 10_000_000:  # reading a big closure's opcodes would delay the function
        named = {top for _, arg, _ in pickletools.genops(payload)
                 if isinstance(arg, str) and (top := arg.partition(".")[0]) in installed}
    return tuple(sorted(named or {name for name in installed if not name.startswith("_")}))


def _installed(module: Any) -> bool:
    path = getattr(module, "__file__", None) or ""
    return any(part in ("site-packages", "dist-packages") for part in path.split(os.sep))


def _report(rank: int, exc: BaseException, message: str) -> None:
    assert _context is not None
    _context.send(msg.Failed(rank=rank, time=time.time(), exc_type=type(exc).__qualname__,
                             message=message, traceback=_user_traceback(exc)))


def _reseed() -> None:
    """Fresh random state, as a fresh process would have: the forkserver seeded torch (and numpy) once, so
    every rank of every run would otherwise draw the same numbers. (Python's `random` reseeds itself at fork.)"""
    import torch

    torch.seed()  # CPU generator only until CUDA is initialised; CUDA generators seed themselves lazily
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def call_arguments(fn: Any, rank: Any, world_size: Any, args: tuple[Any, ...], call_style: str) -> tuple[Any, ...]:
    """What the rank calls `fn` with: `fn(rank, *args)` for `spawn`; otherwise fn(), fn(rank) or
    fn(rank, world_size) by its parameters, then `args`. The kernel checks the call with stand-ins first."""
    if call_style == "spawn":
        return (rank, *args)
    positional = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if args:  # rank and world_size fill the positional slots the args leave, defaulted ones included
        leading = len(positional) - len(args)
    else:  # fn(), fn(rank), fn(rank, world_size): defaulted parameters keep their defaults
        leading = sum(p.default is p.empty for p in positional)
    return (*(rank, world_size)[: max(0, min(leading, 2))], *args)


def _user_traceback(exc: BaseException) -> str:
    """The traceback without ddpnb's own frames at the top, so it starts at the user's function."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    if tb is None:  # raised by ddpnb itself (a result it cannot send): the message says it all
        return ""
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _dump_result(value: Any) -> msg.Returned:
    """Rank 0's value for the kernel, every tensor moved to the CPU however deeply it is nested.

    Without tensors it is cloudpickled into the message. With tensors (a state dict), and where the kernel gave
    this rank a result file (an anonymous memory file, `Run.start`), it is written there with torch.save: the
    tensor bytes once and raw, which the kernel then maps (`torch.load(mmap=True)`) instead of reading; no
    pickle of the bytes, no pipe, no second copy in the kernel.
    """
    from ddpnb._pickling import HoldsTensors, NotPicklableError, dumps, save, unpicklable_path

    try:
        if _result_fd is not None:
            try:
                return msg.Returned(rank=0, payload=dumps(value, tensors=False))
            except HoldsTensors:
                save(value, _result_fd)
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


# --- progress bars -----------------------------------------------------------------------------------------
# tqdm (and tqdm.auto, which is tqdm here: a worker has no notebook) redraws its line with '\r' about ten times a
# second. In a worker its display() sends a typed `Progress` message instead, so the dashboard draws one bar per
# rank; the bar's final state is still written once, as a line, so the log file and the text view keep it.

PROGRESS_INTERVAL = 0.1  # seconds between two messages for one bar, whatever the bar's own mininterval


def _install_progress_hook() -> None:
    try:
        from tqdm import std
    except ImportError:
        return
    std.tqdm.display = _tqdm_display
    # tqdm's default lock holds a multiprocessing semaphore, which a rank's os._exit would leak (and Python's
    # resource tracker warn about); the rank's bars need only a thread lock
    std.tqdm.set_lock(threading.RLock())


def _tqdm_display(bar: Any, msg: str | None = None, pos: int | None = None) -> bool:
    from ddpnb._messages import Progress  # `msg` is tqdm's parameter name here, not the module

    closing = bool(bar.disable)  # tqdm.close() sets disable before its last display()
    now = time.monotonic()
    if not closing and bar.n != bar.total and now - getattr(bar, "_ddpnb_sent", 0.0) < PROGRESS_INTERVAL:
        return True
    bar._ddpnb_sent = now
    if closing and msg is None:  # leave=True: the final bar stays, as one line
        bar.fp.write("\r" + bar.__str__())
    if _context is not None:
        counters = bar.format_dict
        layout = "{n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]" if bar.total else \
            "{n_fmt} [{elapsed}, {rate_fmt}{postfix}]"
        text = bar.format_meter(**{**counters, "prefix": "", "bar_format": layout})
        _context.send(Progress(rank=_context.rank, bar=id(bar), desc=str(bar.desc or "").rstrip(": "),
                               n=bar.n, total=bar.total, text=text, closed=closing))
    return True


GPU_MEMORY_INTERVAL = 2.0  # seconds between two samples of a rank's GPU memory


def _report_gpu_memory() -> None:
    """GPU runs: the caching allocator's counters (host-side reads, no CUDA sync) for the dashboard's rows."""
    import torch

    assert _context is not None
    index = torch.device(_device).index or 0  # not current_device(): that is per thread
    while True:
        _context.send(msg.GpuMemory(rank=_context.rank, reserved=torch.cuda.memory_reserved(index),
                                    peak=torch.cuda.max_memory_reserved(index)))
        time.sleep(GPU_MEMORY_INTERVAL)


# --- process group -----------------------------------------------------------------------------------------
# The group is ready when the function starts. Code written for mp.spawn/torchrun that calls
# init_process_group itself keeps working: a call that matches the ready group is a no-op; one that asks for
# another backend replaces it, rendezvousing on this run's store (never on a port the user code hard-codes).

_real_init = None


def _patch_init_process_group() -> None:
    global _real_init
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _real_init = c10d.init_process_group
    dist.init_process_group = c10d.init_process_group = _init_from_user_code


def _init_from_user_code(backend: str | None = None, init_method: str | None = None, **kwargs: Any) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        if backend is None or backend.lower() == dist.get_backend().lower() or not _usable(backend):
            return
        dist.destroy_process_group()
    kwargs.pop("store", None)
    kwargs.pop("rank", None)
    kwargs.pop("world_size", None)
    _new_group(backend if backend and _usable(backend) else None, **kwargs)


def _usable(backend: str) -> bool:
    """NCCL asked for on a CPU rank (a GPU notebook dry-run on a laptop) keeps the gloo group instead."""
    return not (backend.lower() == "nccl" and _device == "cpu")


def _init_process_group(rank: int, spec: WorkerSpec) -> None:
    global _store
    import torch.distributed as dist

    # rank 0 listens on the socket the kernel bound to 127.0.0.1 (never on every interface, never a raced port)
    _store = dist.TCPStore("127.0.0.1", spec.master_port, spec.world_size, is_master=rank == 0,
                           master_listen_fd=_store_fd if rank == 0 else None)
    _new_group(spec.backend)


def _new_group(backend: str | None, **kwargs: Any) -> None:
    global _store_uses
    import torch.distributed as dist

    _store_uses += 1
    assert _real_init is not None
    _real_init(
        backend=backend or _default_backend(),
        store=dist.PrefixStore(f"ddpnb/{_store_uses}", _store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        **kwargs,
    )


def _default_backend() -> str:
    return "nccl" if _device != "cpu" else "gloo"


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
