"""Run directories: one private directory per run for its logs and stacks, and the retention that bounds them."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
import uuid
from pathlib import Path

KEEP_RUNS = 50  # run directories kept; older ones are deleted when a new run has started (`prune`)


def runs_root() -> Path:
    """Where run directories live: $DDPNB_RUNS_DIR, else <tmp>/ddpnb-<uid>; private to this user."""
    root = Path(os.environ.get("DDPNB_RUNS_DIR") or Path(tempfile.gettempdir()) / f"ddpnb-{os.getuid()}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = root.lstat()
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid():
        # in a shared /tmp another user could have made it first, to read or swap the logs
        raise PermissionError(f"{root} is not a directory owned by you; set DDPNB_RUNS_DIR to a private directory.")
    if info.st_mode & 0o077:
        root.chmod(0o700)
    return root


def prune() -> None:
    """Retention, applied once a new run has started (a launch refused before it starts deletes nothing): the
    newest KEEP_RUNS - 1 directories of ended runs are kept (KEEP_RUNS with the new run's), and those of runs
    still going in any process (see `lock`); older ones are deleted."""
    root = runs_root()
    ended = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not in_use(p))
    for stale in ended[: max(0, len(ended) - KEEP_RUNS + 1)]:  # names sort by creation time
        shutil.rmtree(stale, ignore_errors=True)


def new_run_dir() -> Path:
    """A fresh private directory for one run (named by its creation time, so names sort by age)."""
    root = runs_root()
    now = time.time()
    path = (
        root / f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}.{int(now % 1 * 1e6):06d}-{uuid.uuid4().hex[:6]}"
    )
    path.mkdir(mode=0o700)
    return path


def lock(path: Path, shared: bool = False) -> int:
    """Hold a lock on the run directory while the run lives (released by the kernel's death too), so that
    retention in this or another kernel never deletes the logs of a run still going. `shared`: a run reading
    another run's directory (`--resume`) holds it too; any number of runs may."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    return fd


def in_use(path: Path) -> bool:
    """Whether a run lives in the directory, or reads from it (`lock`): retention keeps it."""
    return _locked(path, fcntl.LOCK_EX)


def running(path: Path) -> bool:
    """Whether the directory's own run is still going (a run only resuming from it does not count)."""
    return _locked(path, fcntl.LOCK_SH)


def _locked(path: Path, how: int) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:  # another kernel's retention got there first
        return True
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_if_empty(run_dir: Path) -> None:
    """A run that never got going leaves nothing behind, unless a rank wrote something already."""
    if run_dir.is_dir() and all(not path.stat().st_size for path in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)


def private(path: str, flags: int) -> int:
    """An `open` opener for files only this user may read: the logs hold whatever the ranks print."""
    return os.open(path, flags, 0o600)
