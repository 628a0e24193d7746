"""Nothing a rank starts outlives the rank, whatever session or process group it moved to.

Stopping a rank's process group ends what stayed in it (DataLoader workers); a double-forked daemon or a
`Popen(..., start_new_session=True)` child left it. So each rank is a child subreaper (`prctl`): whatever is
orphaned below it while it runs becomes its child, never init's. When the rank ends, its orphans pass to the next
subreaper up, the forkserver it was forked from (also a subreaper, `node/shield.py`), and the process that forked
the ranks (the kernel, or a node's host) ends them there (`end_orphans`, after each rank's exit). Linux only, as
ddpnb is; where prctl is refused (never on Linux >= 3.4) the process group is all that is stopped.

Orphans are told apart from the forkserver's other children by session: the forkserver's own children (a
`preload` check, a forkserver pool of the notebook's) stay in its session; a rank leads a session of its own, and
whatever it starts is in that session or in one it made.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Collection

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
SWEEP_WAIT = 2.0  # seconds end_orphans keeps ending what the processes it killed had started in turn


def become_subreaper() -> bool:
    """Orphaned descendants of this process become its children (not init's) while it runs."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc with prctl: the process group is all that is stopped
        return False


def end_orphans(server: int | None, ranks: Collection[int]) -> list[int]:
    """SIGKILL every process the forkserver `server` adopted from a dead rank (a child of it outside its session
    that is not one of the running `ranks`), then what those had started in turn (adopted next). Their PIDs."""
    if server is None:
        return []
    try:
        session = os.getsid(server)
    except ProcessLookupError:  # the forkserver is gone: so is everything it could adopt
        return []
    ended: list[int] = []
    deadline = time.monotonic() + SWEEP_WAIT
    while time.monotonic() < deadline:
        found = [pid for pid in children(server) if pid not in ranks and _session(pid) not in (None, session)]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            ended.append(pid)
        time.sleep(0.01)  # a killed process's children are adopted as it exits
    return ended


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (its children's children too), parents before children."""
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in children(queue.pop()):
            if _session(child) is not None:
                found.append(child)
                queue.append(child)
    return found


def children(pid: int) -> list[int]:
    """The children of `pid`, every thread's (a thread that forked is the parent)."""
    return [int(child) for listing in per_task(pid, "children") for child in listing.split()]


def per_task(pid: int, name: str) -> list[str]:
    """`/proc/PID/task/*/NAME` of each of the process's threads ('comm', 'children'); none once it is gone, and
    none of a file this kernel's /proc lacks."""
    found: list[str] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/{name}") as file:
                found.append(file.read())
        except OSError:  # the thread ended meanwhile, or no such file here
            continue
    return found


def running(pid: int) -> bool:
    """Whether the process runs (a zombie has ended: only its parent's wait is left)."""
    return _session(pid) is not None


def _session(pid: int) -> int | None:
    """The session of a live process; None once it has exited (a zombie waits only to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return None if fields[0] == b"Z" else int(fields[3])
