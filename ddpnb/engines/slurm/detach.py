"""Where a detached run's supervisor lives on Slurm (`--engine slurm --detach`, docs/detached.md).

From a login node (outside an allocation) it is a batch job of its own (`sbatch`), asking for the run's ranks as
the engine's own job would (`submit.JobRequest`): the batch script runs the supervisor on the job's first node,
and the supervisor runs the ranks as the engine does inside an allocation, one srun step per attempt. Nothing ties
the job to the kernel (no `salloc`, no keeper), so it outlives it; while it waits in the queue the launch says so.
Inside an allocation there is no home here (`SlurmType.supervisor_home` is None): the supervisor is a process of its
own on the kernel's node, as on the local engine, and lives as long as the allocation.

The run directory must be on a filesystem the kernel's machine and the batch host both see (a shared home or
scratch: `DDPNB_RUNS_DIR`): the plan, the journal, the door and the result travel through it.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ddpnb.core.spec import LaunchError
from ddpnb.engines.slurm import allocation, submit
from ddpnb.engines.slurm.options import SlurmOptions

JOB = "slurm.job"  # in the run directory: the supervisor's batch job's ID
# squeue's states of a job whose batch script may still run (COMPLETING: it ended, the job is being cleaned up)
ALIVE = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING")
WAITING = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "SUSPENDED")  # its supervisor not running yet
GONE = "Invalid job id"  # squeue's words for a job no longer known (ended, MinJobAge ago)


def sbatch_path() -> str:
    return allocation.command(
        "sbatch",
        "--engine slurm --detach outside an allocation runs the run's supervisor as a batch job (sbatch), and "
        "there is no sbatch on this kernel's PATH: load Slurm's module (e.g. `module load slurm`).",
    )


@dataclass(frozen=True)
class BatchHome:
    """A detached run's supervisor as a Slurm batch job: `start` submits it, `alive` and `waiting` ask squeue,
    `end` cancels it (a stop whose door cannot be reached). Pickled into the run directory by the kernel, so any
    later kernel asks the same of it."""

    options: SlurmOptions
    tasks: int  # the run's ranks, one task each (one GPU each on GPU runs), as the engine's own job asks
    gpus: bool

    def start(self, run_dir: str) -> str:
        path = Path(run_dir)
        request = submit.JobRequest(name=f"ddpnb-{path.name}", tasks=self.tasks, gpus=self.gpus, options=self.options)
        # the supervisor's door faces this host: the batch host binds its address on the route here
        script = shlex.join([sys.executable, "-m", "ddpnb.detached.supervisor", run_dir, socket.gethostname()])
        command = request.sbatch(
            sbatch_path(), f"exec {script}", output=str(path / "supervisor.log")
        )  # the supervisor logs there too
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=allocation.SCONTROL_WAIT, check=False
            )
        except subprocess.TimeoutExpired:
            raise LaunchError(
                f"sbatch did not answer in {allocation.SCONTROL_WAIT:g} s: is the Slurm controller reachable?"
            ) from None
        job = done.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;CLUSTER"
        if done.returncode or not job.isdigit():
            said = done.stderr.strip().removeprefix("sbatch: ") or "no reason given"
            shown = " ".join(shlex.quote(arg) for arg in command[1:-2])
            raise LaunchError(
                f"Slurm refused the detached run's batch job (sbatch {shown}): {said}. Check --partition, --account, "
                "--qos, --time and --constraint against `sinfo`; nothing was started."
            )
        (path / JOB).write_text(job)
        return f"slurm batch job {job}"

    def alive(self, run_dir: str) -> bool | None:
        state = _state(run_dir)
        return None if state is None else state.partition(" ")[0] in ALIVE

    def waiting(self, run_dir: str) -> str:
        """The job's queue state while its supervisor cannot run yet ('slurm job 12 pending (Priority)'), else ''."""
        state = _state(run_dir)
        if not state or state.partition(" ")[0] not in WAITING:
            return ""
        head, _, reason = state.partition(" ")
        return f"slurm job {_job(run_dir)} {head.lower()}" + (f" ({reason})" if reason and reason != "None" else "")

    def end(self, run_dir: str) -> None:
        job = _job(run_dir)
        if job:
            allocation.scancel(job)


def _job(run_dir: str) -> str:
    try:
        return (Path(run_dir) / JOB).read_text().strip()
    except OSError:
        return ""


_seen: dict[str, tuple[float, str | None]] = {}  # job -> when squeue was asked, what it said (POLL apart at most)


def _state(run_dir: str) -> str | None:
    """'RUNNING', 'PENDING Priority', ... as squeue says the job's; '' when it is gone; None when squeue cannot
    tell (it failed, or no job was submitted)."""
    job = _job(run_dir)
    if not job:
        return None
    asked, said = _seen.get(job, (0.0, None))
    if time.monotonic() - asked < submit.POLL:
        return said
    try:
        done = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%T %r"],
            capture_output=True,
            text=True,
            timeout=allocation.SCONTROL_WAIT,
            check=False,
        )
        said = done.stdout.strip() if not done.returncode else ("" if GONE in done.stderr else None)
    except (OSError, subprocess.TimeoutExpired):
        said = None
    _seen[job] = (time.monotonic(), said)
    return said
