"""Where a run's checkpoints live and which one is complete: shared by the kernel (`--resume`, the views) and the
ranks (`rank.checkpoint`, which writes them)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ddpnb.core import rundir
from ddpnb.core.spec import LaunchError

COMPLETE = re.compile(r"step-(\d+)")  # a complete checkpoint's directory; one being written ends in PARTIAL_SUFFIX
PARTIAL_SUFFIX = ".partial"
POINTER = "checkpoints.path"  # in a run directory whose checkpoints are elsewhere (--checkpoint-dir)


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def latest(root: str | Path) -> tuple[int, Path] | None:
    """The complete checkpoint with the highest step under `root` (a `.partial` one never counts)."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return None
    found = [
        (int(match.group(1)), Path(root, name))
        for name in names
        if (match := COMPLETE.fullmatch(name)) and Path(root, name, ".metadata").is_file()
    ]
    return max(found) if found else None


def for_run(run_dir: Path, base: str | os.PathLike[str] | None) -> Path:
    """A new run's checkpoint directory: `<run dir>/checkpoints`, or `<base>/<run name>` with --checkpoint-dir
    (each run its own, so runs sharing `base` never load or prune each other's), which the run directory then
    points to for `--resume`."""
    if base is None:
        return run_dir / "checkpoints"
    path = Path(base).expanduser().resolve() / run_dir.name
    with open(run_dir / POINTER, "w", opener=rundir.private) as pointer:
        pointer.write(str(path))
    return path


def of(path: Path) -> Path:
    """The checkpoint directory that `path` names: a run directory's, or `path` itself."""
    pointer = path / POINTER
    if pointer.is_file():
        return Path(pointer.read_text().strip())
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def resume_source(resume: str | os.PathLike[str]) -> tuple[Path, int]:
    """The checkpoint directory `--resume` names ('last': the newest ended run with a complete checkpoint) and
    the step it would continue from now; LaunchError, saying what to do, where there is none."""
    if str(resume) == "last":
        root = rundir.runs_root()
        for run_dir in sorted((p for p in root.iterdir() if p.is_dir()), reverse=True):
            if rundir.running(run_dir):  # a run still going is not one to continue
                continue
            found = latest(of(run_dir))
            if found is not None:
                return of(run_dir), found[0]
        raise LaunchError(
            f"--resume last: no earlier run under {root} has a complete checkpoint (ranks write them "
            "with ddpnb.save_checkpoint(state, step=...)). Run without --resume to start from the "
            "beginning, or pass the run directory (or checkpoint directory) to continue from."
        )
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise LaunchError(
            f"--resume {resume}: no such directory. Pass 'last', a run directory (its path is in the "
            "run's output and in ddpnb.last_run().run_dir), or a checkpoint directory."
        )
    found = latest(of(path))
    if found is None:
        raise LaunchError(
            f"--resume {resume}: {of(path)} holds no complete checkpoint (a save that was cut short "
            "never counts). Run without --resume to start from the beginning."
        )
    return of(path), found[0]


def hold(checkpoint_dir: Path) -> int | None:
    """Lock the run directory `checkpoint_dir` belongs to against retention, for a run that resumes from it (the
    caller closes the fd when the run ends); None where it is no run directory's (--checkpoint-dir)."""
    if checkpoint_dir.name != "checkpoints":
        return None
    try:
        return rundir.lock(checkpoint_dir.parent, shared=True)
    except FileNotFoundError:
        raise LaunchError(
            f"--resume: {checkpoint_dir.parent} was deleted meanwhile (run directory retention); "
            "pass another run directory, or run without --resume."
        ) from None
