"""Typed messages a rank sends to the kernel, one set and one codec for every engine.

On the wire a message is the pickle of a plain tuple, its class name then its fields (`encode`/`decode`):
pickling a dataclass instance looks its class up by name every time, which is slow inside a training step.
Locally each one travels in a frame on the rank's channel pipe (`header`, `Frames`: its length, big-endian, then
its bytes, the layout of `multiprocessing.connection`) and raw output on pipes of its own; on Ray, encoded
messages travel in batches through the run actor, output included (`Output`).
"""

from __future__ import annotations

import enum
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Started:
    """The rank has its spec and its device, and now joins the process group and runs the function."""

    rank: int
    device: str


@dataclass(frozen=True)
class Metric:
    """What one `ddpnb.log(step=..., name=value, ...)` call sent."""

    rank: int
    step: int | None
    time: float
    values: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    """A progress bar (tqdm) inside a worker, at most ten times a second per bar, and once when it closes."""

    rank: int
    bar: int  # tells a rank's bars apart (nested bars, one bar per epoch)
    desc: str
    n: float
    total: float | None
    text: str  # tqdm's own counters: "45/100 [00:01<00:01, 40.0it/s]"
    closed: bool = False


@dataclass(frozen=True)
class GpuMemory:
    """GPU runs: the rank's memory held by PyTorch's caching allocator, sampled every few seconds."""

    rank: int
    reserved: int  # bytes, now
    peak: int  # bytes, the most so far


@dataclass(frozen=True)
class StepTimes:
    """The rank's own compute over its latest `steps` (counted by `ddpnb.log(step=...)`), a few times a second:
    `wall` seconds went by, of which its thread was busy `compute` (on a CPU, or ready and waiting for one);
    the rest it slept, which is where it waits in collectives (`rank.radar`). `arrivals`: the collectives of the
    reported `step` as (process group, number, ns since the epoch when the rank issued it), from torch's Flight
    Recorder; every rank reports the same steps, so the kernel sees who came last to each."""

    rank: int
    steps: int
    wall: float
    compute: float
    step: int = 0
    arrivals: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class Hardware:
    """What the rank's process uses, sampled by the rank itself once a second (`rank.radar.sample_hardware`);
    the GPU fields come from NVML on GPU runs where `nvidia-ml-py` is installed, else None."""

    rank: int
    time: float
    cpu: float  # percent of one core over the last interval, every thread of the process
    rss: int  # resident memory, bytes
    gpu_util: float | None = None  # percent
    gpu_memory: int | None = None  # bytes in use on the device (every process's)
    gpu_power: float | None = None  # watts


@dataclass(frozen=True)
class Returned:
    """The function returned. Only rank 0 carries its value: cloudpickled in `payload`, or, when it holds tensors,
    `saved` with torch.save in the run's result file (see `rank.main._dump_result`)."""

    rank: int
    payload: bytes | None = None
    saved: bool = False


@dataclass(frozen=True)
class Failed:
    """The function raised. `traceback` is the worker's own, with ddpnb's frames removed."""

    rank: int
    time: float
    exc_type: str
    message: str
    traceback: str
    # the user's frames where it raised, outermost first: (file, line, function, ((name, bounded repr), ...))
    frames: tuple[tuple[str, int, str, tuple[tuple[str, str], ...]], ...] = ()


@dataclass(frozen=True)
class Imported:
    """Rebuilding the function made rank 0 import `modules` (top-level packages the forkserver does not hold)
    for `seconds`: what every launch spends on them, and what `ddpnb.preload` would save."""

    rank: int
    seconds: float
    modules: tuple[str, ...]


@dataclass(frozen=True)
class Stacks:
    """Where the rank's threads are, from the user's function down (sent when the kernel asks)."""

    rank: int
    text: str


@dataclass(frozen=True)
class Output:
    """A chunk of a rank's stdout or stderr, as written to the fd (Ray: local ranks write to pipes instead)."""

    rank: int
    stream: str
    data: bytes


@dataclass(frozen=True)
class Placed:
    """Where the cluster put the rank (Ray); local ranks are placed by the kernel itself."""

    rank: int
    node_id: str
    node_ip: str
    pid: int
    placement_group: Any = None  # the cluster's reservation for the run: released by the kernel if it must kill


@dataclass(frozen=True)
class Reply:
    """A session rank's answer to one command (a cell, push, pull or call): its value pickled, or its error."""

    rank: int
    command: int  # the command's number, so a late answer to an abandoned command is never taken for the next's
    payload: bytes | None = None  # the value (None: the code had no value)
    exc_type: str = ""  # set when the command raised; then `message` and `traceback` say what
    message: str = ""
    traceback: str = ""


@dataclass(frozen=True)
class Prompt:
    """The rank is at a debugger prompt (`breakpoint()`): what pdb wrote since its last prompt, the prompt last.
    The rank waits for the answer (one line) on its command channel."""

    rank: int
    text: str


@dataclass(frozen=True)
class Profiled:
    """The rank's profile (`--profile`, `ddpnb.profile()`): torch.profiler's Chrome trace, gzipped, or b"" where
    nothing was profiled (`note` says why). It travels as any message does, so every engine brings it back."""

    rank: int
    host: str
    device: str
    trace: bytes
    steps: tuple[int, int] | None = None  # the steps asked for; None for a ddpnb.profile() region
    note: str = ""  # what is missing or partial, in words


Message = (
    Started
    | Metric
    | Progress
    | GpuMemory
    | StepTimes
    | Hardware
    | Returned
    | Failed
    | Imported
    | Stacks
    | Output
    | Placed
    | Reply
    | Prompt
    | Profiled
)

KINDS: dict[str, Any] = {
    kind.__name__: kind
    for kind in (
        Started,
        Metric,
        Progress,
        GpuMemory,
        StepTimes,
        Hardware,
        Returned,
        Failed,
        Imported,
        Stacks,
        Output,
        Placed,
        Reply,
        Prompt,
        Profiled,
    )
}


class CommandKind(enum.Enum):
    """What a session command asks of a rank."""

    EXECUTE = "execute"  # run a cell's code in the rank's namespace; its last expression is the value
    PUSH = "push"  # bind names in the namespace
    PULL = "pull"  # the values of names
    CALL = "call"  # call a function with arguments
    STOP = "stop"  # end the session: the rank returns
    DEBUG = "debug"  # post-mortem on the rank's last failed command (the kernel answers its prompts)


@dataclass(frozen=True)
class Command:
    """What a session's kernel asks of its ranks (kernel to rank; pickled with `core.pickling`, so user objects
    travel as everywhere else). Every rank answers a command with one `Reply`, except STOP."""

    number: int
    kind: CommandKind
    code: str = ""  # EXECUTE: the cell, as IPython transformed it
    filename: str = ""  # EXECUTE: the name IPython gave the cell, so tracebacks say `Cell In[N], line L`
    lines: tuple[str, ...] = ()  # EXECUTE: the cell's source for the rank's tracebacks
    cell_name: str = ""  # EXECUTE: 'Cell In[N]', so the rank's warnings name the cell
    values: dict[str, Any] = field(default_factory=dict)  # PUSH
    names: tuple[str, ...] = ()  # PULL
    call: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None  # CALL: fn, args, kwargs


def encode(message: Message) -> bytes:
    return pickle.dumps((type(message).__name__, *vars(message).values()), protocol=pickle.HIGHEST_PROTOCOL)


def encode_metric(rank: int, step: int | None, time: float, values: dict[str, float]) -> bytes:
    """`encode(Metric(...))` without building the dataclass first: `ddpnb.log`'s path, inside a training step."""
    return pickle.dumps(("Metric", rank, step, time, values), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    kind, *fields = pickle.loads(data)
    return KINDS[kind](*fields)


def header(size: int) -> bytes:
    """A frame's header: its length, as `multiprocessing.connection` writes it."""
    return struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size)


class Frames:
    """The kernel's end of one channel: bytes in as they are read, whole frames out."""

    def __init__(self) -> None:
        self.pending = bytearray()

    def feed(self, data: bytes | memoryview) -> list[bytes]:
        pending = self.pending
        pending += data
        frames, start = [], 0
        with memoryview(pending) as view:  # released before `pending` is resized below
            while len(pending) - start >= 4:
                (size,) = struct.unpack_from("!i", pending, start)
                head = 4
                if size == -1:  # over 2 GiB: the length follows as 8 bytes
                    if len(pending) - start < 12:
                        break
                    (size,) = struct.unpack_from("!Q", pending, start + 4)
                    head = 12
                if len(pending) - start - head < size:
                    break
                frames.append(bytes(view[start + head : start + head + size]))  # one copy
                start += head + size
        del pending[:start]
        return frames
