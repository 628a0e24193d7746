"""One filter for ddpnb's own frames: tracebacks and stacks shown to users start at the user's function."""

from __future__ import annotations

import linecache
import multiprocessing
import os
import re
import sys
import threading
import traceback
from types import TracebackType

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ddpnb/
_STARTERS = (os.path.dirname(multiprocessing.__file__), "<string>")  # what starts a local rank


def is_plumbing(filename: str) -> bool:
    """A frame of ddpnb's or of what starts a rank (multiprocessing, Ray's worker), not of the user's code."""
    if filename.startswith(PACKAGE_DIR) or filename.startswith(_STARTERS):
        return True
    ray = sys.modules.get("ray")
    return ray is not None and filename.startswith(os.path.dirname(getattr(ray, "__file__", None) or "\0"))


def the_callers(exc: BaseException) -> BaseException:
    """Marks an error ddpnb's API raises about how it was called (`ddpnb.log(loss=[1, 2])`): its traceback ends on
    the user's line, as a built-in's would, without ddpnb's frames below it."""
    exc.__ddpnb_callers__ = True  # type: ignore[attr-defined]
    return exc


def user_traceback(exc: BaseException) -> str:
    """The traceback without ddpnb's own frames at the top, so it starts at the user's function, nor below the
    user's line for an error about the user's call (`the_callers`); "" when ddpnb itself raised it (a result it
    cannot send: the message says it all)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
        tb = tb.tb_next
    if tb is None:
        return ""
    if not getattr(exc, "__ddpnb_callers__", False):
        return "".join(traceback.format_exception(type(exc), exc, tb))
    return "".join(
        [
            "Traceback (most recent call last):\n",
            *traceback.format_list(traceback.extract_tb(to_the_callers(tb))),
            *traceback.format_exception_only(type(exc), exc),
        ]
    )


def to_the_callers(tb: TracebackType | None) -> TracebackType | None:
    """`tb` up to its last frame outside ddpnb: where an error about the user's call (`the_callers`) is shown, and
    where `--debug` opens it."""
    kept = []
    while tb is not None:
        kept.append(tb)
        tb = tb.tb_next
    while len(kept) > 1 and kept[-1].tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
        kept.pop()
    for link in reversed(kept):
        tb = TracebackType(tb, link.tb_frame, link.tb_lasti, link.tb_lineno)
    return tb


def user_stack_dump(dump: str, skip_thread: str = "in _watch_kernel", only_users: bool = False) -> str:
    """faulthandler's dump of every thread without ddpnb's watchdog thread and without plumbing frames: what is
    left starts at the user's function. The raw dump stays on disk."""
    threads = []
    for block in dump.strip().split("\n\n"):
        lines = block.splitlines()
        frames = [line for line in lines[1:] if not _dumped_plumbing(line)]
        # `only_users`: not ddpnb's other threads either (the hardware sampler), where only threading's start is
        # left once their own frames went (`readable` counts them instead)
        ours = only_users and len(frames) < len(lines) - 1 and all(f'"{threading.__file__}"' in line for line in frames)
        if lines and skip_thread not in block and frames and not ours:
            threads.append("\n".join([lines[0], *frames]))
    return "\n\n".join(threads)


LOCALS_SHOWN = 20  # local variables kept per frame of a failure
REPR_CHARS = 200  # characters kept of each one's repr
LOCALS_FRAMES = 5  # the user's innermost frames whose locals are kept


def user_locals(exc: BaseException) -> tuple[tuple[str, int, str, tuple[tuple[str, str], ...]], ...]:
    """The user's frames where `exc` was raised (the innermost LOCALS_FRAMES, outermost first), each with bounded
    reprs of its local variables: what the kernel keeps of them once the rank is gone. Modules, functions and
    classes are left out (the code shows them); a repr that raises says so instead."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not _library(code.co_filename):
            values = [
                (name, _bounded_repr(value))
                for name, value in tb.tb_frame.f_locals.items()
                if not name.startswith("__") and not _definition(value)
            ]
            frames.append((code.co_filename, tb.tb_lineno, code.co_name, tuple(values[:LOCALS_SHOWN])))
        tb = tb.tb_next
    return tuple(frames[-LOCALS_FRAMES:])


def _definition(value: object) -> bool:
    import inspect

    return inspect.ismodule(value) or inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value)


def _bounded_repr(value: object) -> str:
    """A short repr: a tensor by its shape, dtype, device and first values (never its whole data)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and isinstance(value, torch.Tensor):
            head = value.detach().flatten()[:4].tolist() if value.device.type == "cpu" else "..."
            text = (
                f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device}, "
                f"values={head}{'...' if value.numel() > 4 else ''})"
            )
        else:
            import reprlib

            limits = reprlib.Repr()
            limits.maxstring = limits.maxother = REPR_CHARS
            text = limits.repr(value)
    except Exception as error:  # noqa: BLE001 - the user's __repr__ failed: say so, keep the rest
        text = f"<repr failed: {type(error).__name__}>"
    return text if len(text) <= REPR_CHARS else text[: REPR_CHARS - 3] + "..."


def readable(dump: str) -> str:
    """A faulthandler dump as a traceback reads (a stack already in that form comes back as it is): the threads
    that run the user's code, oldest call first, each frame with its source line (from this kernel's linecache,
    which holds the notebook's cells), and each run of frames inside one library shown by its innermost frame
    alone (torch's logging wrappers around a collective go, the collective stays). How many other threads (ddpnb's,
    libraries' idle ones) were left out is said last. File names stay: `cellnames.cell_names` names the cells."""
    if "most recent call first" not in dump:
        return dump
    shown, left = [], 0
    for block in dump.strip().split("\n\n"):
        frames = [(file, int(line), name) for file, line, name in _FRAME.findall(block)][::-1]
        if all(_library(file) for file, _, _ in frames):
            left += 1
            continue
        header = block.splitlines()[0]
        title = "Stack" if header.startswith("Current thread") else header.partition(" (")[0]
        lines = [f"{title} (most recent call last):"]
        for index, (file, line, name) in enumerate(frames):
            inner = frames[index + 1][0] if index + 1 < len(frames) else None
            if inner is not None and _library(file) and _library(inner) and _package(file) == _package(inner):
                continue  # inside one library: its innermost frame stands for the run
            lines.append(f'  File "{file}", line {line}, in {name}')
            if source := linecache.getline(file, line).strip():
                lines.append(f"    {source}")
        shown.append("\n".join(lines))
    if left:
        shown.append(f"({left} other thread{'s' if left > 1 else ''}, not running your code, left out)")
    return "\n\n".join(shown)


def _package(filename: str) -> str:
    """The library a file belongs to: its top-level package under site-packages, or the standard library."""
    parts = filename.split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1]
    return "python" if filename.startswith(_STDLIB) else os.path.dirname(filename)


def _dumped_plumbing(line: str) -> bool:
    start = line.find('File "')
    return start >= 0 and is_plumbing(line[start + 6 : line.find('"', start + 6)])


def thread_stack(thread_id: int) -> str:
    """One thread's Python stack, from the first frame of the user's code down."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame)
    user = [i for i, entry in enumerate(frames) if not _library(entry.filename)]
    kept = frames[user[0] :] if user else frames
    return "Stack of the training thread (most recent call last):\n" + "".join(traceback.format_list(kept))


# what a rank blocked on a peer waits in: torch.distributed's collectives and point-to-point calls
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "wait",
    }
)
# what a rank waits in on the run's store (torch's own store barriers and waits; `store.get` blocks until set)
STORE_WAITS = frozenset({"_store_based_barrier", "store_based_barrier", "synchronize", "get_all", "wait_for_workers"})
_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')


def _library(filename: str) -> bool:
    """A frame of ddpnb, the standard library or an installed package: not where the user's code is."""
    parts = filename.split(os.sep)
    return (
        is_plumbing(filename)
        or filename.startswith((_STDLIB, "<frozen "))
        or "site-packages" in parts
        or "dist-packages" in parts
    )


_STDLIB = os.path.dirname(threading.__file__) + os.sep


def frames_of(stack: str) -> list[tuple[str, int, str]]:
    """The (file, line, function) frames of the first thread in `stack` that runs the user's code, oldest first
    (faulthandler's dump lists them newest first, a traceback oldest first); [] when no thread does."""
    for block in stack.split("\n\n"):
        frames = [(file, int(line), name) for file, line, name in _FRAME.findall(block)]
        if "most recent call first" in block:
            frames.reverse()
        if any(not _library(file) for file, _, _ in frames):
            return frames
    return []


def is_library(filename: str) -> bool:
    """A frame of ddpnb, the standard library or an installed package: not where the user's code is."""
    return _library(filename)


def where(stack: str) -> str:
    """Where a rank is, in a few words, from its stack (faulthandler's or traceback's format): the collective it
    waits in, if any, and the user's line — 'in all_reduce, at File "...", line 3'."""
    for block in stack.split("\n\n"):
        frames = _FRAME.findall(block)
        if "most recent call first" in block:
            frames.reverse()  # oldest first, as a traceback lists them
        user = [frame for frame in frames if not _library(frame[0])]
        if not user:
            continue
        waits = [name for _, _, name in frames if name in COLLECTIVES]
        at = f'at File "{user[-1][0]}", line {user[-1][1]}'
        return f"in {waits[-1]}, {at}" if waits else at
    return "somewhere without Python frames of its own"


# faulthandler's report of a fatal error (SIGSEGV, SIGABRT, ...) on a rank's stderr, line by line: its first line,
# then what it may hold (thread headers, frames, the runtime state, the extension modules)
FATAL_ERROR = "Fatal Python error: "
_DUMP_LINE = re.compile(r"|  .*|(Current thread|Thread|Stack|Python runtime state|Extension modules|<Cannot show)\b.*")


class CrashDump:
    """A rank's fatal-error report, picked out of its stderr, so that its last line stays its own (`about to
    crash`, not `Extension modules: ...`) and the failure can say where it died."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.reading = False
        self.complete = False  # its last line ("Extension modules: ...") was read

    def own_lines(self, lines: list[str]) -> list[str]:
        """Those of `lines` that are the rank's own; the report's lines are kept here."""
        own = []
        for line in lines:
            if line.startswith(FATAL_ERROR) and not self.lines:
                self.reading = True
            elif self.reading and not _DUMP_LINE.fullmatch(line):
                self.reading = False  # not faulthandler's: the report ended without its usual last line
            if self.reading:
                self.lines.append(line)
                if line.startswith("Extension modules: "):
                    self.reading, self.complete = False, True
            else:
                own.append(line)
        return own

    def stack(self) -> str:
        """The report without ddpnb's threads and frames: its first line, then the threads the user's code ran."""
        text = "\n".join(self.lines)
        return f"{self.lines[0]}\n\n{user_stack_dump(text, only_users=True)}".rstrip() if self.lines else ""

    def crash_frame(self) -> tuple[str, int, str] | None:
        """(file, line, function) of the user's innermost frame in the thread that crashed."""
        current = next(
            (block for block in "\n".join(self.lines).split("\n\n") if block.startswith("Current thread")), ""
        )
        for filename, line, function in _FRAME.findall(current):  # most recent call first
            if not _library(filename):
                return filename, int(line), function
        return None
