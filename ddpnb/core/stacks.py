"""One filter for ddpnb's own frames: tracebacks and stacks shown to users start at the user's function."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import traceback

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ddpnb/
_STARTERS = (os.path.dirname(multiprocessing.__file__), "<string>")  # what starts a local rank


def is_plumbing(filename: str) -> bool:
    """A frame of ddpnb's or of what starts a rank (multiprocessing, Ray's worker), not of the user's code."""
    if filename.startswith(PACKAGE_DIR) or filename.startswith(_STARTERS):
        return True
    ray = sys.modules.get("ray")
    return ray is not None and filename.startswith(os.path.dirname(getattr(ray, "__file__", None) or "\0"))


def user_traceback(exc: BaseException) -> str:
    """The traceback without ddpnb's own frames at the top, so it starts at the user's function; "" when ddpnb
    itself raised it (a result it cannot send: the message says it all)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
        tb = tb.tb_next
    if tb is None:
        return ""
    return "".join(traceback.format_exception(type(exc), exc, tb))


def user_stack_dump(dump: str, skip_thread: str = "in _watch_kernel") -> str:
    """faulthandler's dump of every thread without ddpnb's watchdog thread and without plumbing frames: what is
    left starts at the user's function. The raw dump stays on disk."""
    threads = []
    for block in dump.strip().split("\n\n"):
        lines = block.splitlines()
        frames = [line for line in lines[1:] if not _dumped_plumbing(line)]
        if lines and skip_thread not in block and frames:
            threads.append("\n".join([lines[0], *frames]))
    return "\n\n".join(threads)


def _dumped_plumbing(line: str) -> bool:
    start = line.find('File "')
    return start >= 0 and is_plumbing(line[start + 6:line.find('"', start + 6)])


def thread_stack(thread_id: int) -> str:
    """One thread's Python stack, from the first frame of the user's code down."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame)
    stdlib = os.path.dirname(threading.__file__)
    user = [i for i, entry in enumerate(frames)
            if not (is_plumbing(entry.filename) or entry.filename.startswith(stdlib))]
    kept = frames[user[0]:] if user else frames
    return "Stack of the training thread (most recent call last):\n" + "".join(traceback.format_list(kept))
