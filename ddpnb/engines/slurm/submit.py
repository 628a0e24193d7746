"""A job of the run's own, for a kernel outside any allocation (a login node): asked for with `salloc`, its queue
state said to the run while it waits (the engine's `serve`), and given back when the attempt ends — KEEP_JOB
seconds later, so that the next launch asking for the same (a session's `%ddp_restart`, a restart, the next cell)
takes it without queueing.

`salloc` runs `cat` on this host for as long as the job should live: ddpnb closes `cat`'s stdin to give the job
back, and a kernel that dies closes it too (end of file), so no allocation outlives its kernel, however it ended;
salloc's parent, `keeper.py`, reads the same pipe, so a job still in the queue goes the same way. `scancel` backs
that up. The ranks then run as a step of that job, exactly as inside an allocation.
"""

from __future__ import annotations

import atexit
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ddpnb.core.spec import LaunchError
from ddpnb.engines.slurm import allocation
from ddpnb.engines.slurm.options import SUBMIT_OPTIONS, SlurmOptions

KEEP_JOB = 10.0  # seconds a job waits, once its run ended, for the next launch that asks for the same
MIN_LEFT = 120.0  # seconds a kept job must still have before its time limit to be given to the next launch
POLL = 1.0  # seconds between two looks at the job's queue state
RELEASE_WAIT = 10.0  # seconds salloc gets to give the job back once its `cat` ended
# salloc's own lines (src/salloc): "salloc: Pending job allocation 12", "salloc: Granted job allocation 12"
JOB_ID = re.compile(r"job allocation (\d+)")
GRANTED = "Granted job allocation"
KEEPER = str(Path(__file__).with_name("keeper.py"))


@dataclass(frozen=True)
class JobRequest:
    """What the run asks Slurm for: its ranks as tasks (one GPU each on GPU runs), and the job options given."""

    name: str
    tasks: int
    gpus: bool
    options: SlurmOptions

    def key(self) -> tuple[object, ...]:
        """What a later launch must ask for to take this job: everything but the run's name."""
        return self.tasks, self.gpus, self.options

    def salloc(self, salloc: str) -> list[str]:
        return [salloc, *self._job_options(), "cat"]

    def sbatch(self, sbatch: str, script: str, output: str) -> list[str]:
        """A batch job asking for the same, running `script` (one shell line), its output appended to `output`;
        never requeued (its script must run once: a detached run's supervisor)."""
        return [
            sbatch,
            "--parsable",
            "--no-requeue",
            f"--output={output}",
            "--open-mode=append",
            *self._job_options(),
            "--wrap",
            script,
        ]

    def _job_options(self) -> list[str]:
        options = self.options
        named = {name: getattr(options, name) for name in SUBMIT_OPTIONS if name != "job_args"}
        return [
            f"--job-name={self.name}",
            f"--ntasks={self.tasks}",
            *([f"--nodes={options.nodes}"] if options.nodes else []),
            *(["--gpus-per-task=1"] if self.gpus else []),
            *(f"--{key}={value}" for key, value in named.items() if value),
            *shlex.split(options.job_args),
        ]


def keep_seconds() -> float:
    """How long an ended run's job is kept for the next launch: KEEP_JOB, or DDPNB_SLURM_KEEP_JOB (0: never)."""
    try:
        return max(0.0, float(os.environ.get("DDPNB_SLURM_KEEP_JOB", KEEP_JOB)))
    except ValueError:
        return KEEP_JOB


_kept: dict[tuple[object, ...], OwnJob] = {}  # a granted job between two runs, by what it was asked for
_kept_lock = threading.Lock()


def take_kept(request: JobRequest) -> OwnJob | None:
    """The job an ended run left for a launch asking for the same, if it still runs; it is this launch's now."""
    with _kept_lock:
        job = _kept.pop(request.key(), None)
    if job is None:
        return None
    job.unpark()
    if job.running():
        return job
    job.release()
    return None


def release_kept() -> None:
    """Give back every kept job at once (the kernel's end)."""
    with _kept_lock:
        jobs = list(_kept.values())
        _kept.clear()
    for job in jobs:
        job.release()


atexit.register(release_kept)  # also when the kernel dies outright: `cat` then reads the end of its input


def salloc_path() -> str:
    return allocation.command(
        "salloc",
        "--engine slurm outside an allocation asks Slurm for a job with `salloc`, "
        "and there is none on this kernel's PATH: load Slurm's module (e.g. `module load "
        "slurm`), or start Jupyter inside an allocation.",
    )


class OwnJob:
    """One salloc'd job: `ask` for it, `granted_within` until it runs (its queue state from `state`), `release` to
    give it back."""

    def __init__(self, request: JobRequest) -> None:
        self.request = request
        self.job = ""
        self.granted = False
        self._salloc: subprocess.Popen[str] | None = None
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # salloc's stderr; None: it closed
        self._said: list[str] = []
        self._expiry: threading.Timer | None = None  # while kept for the next launch: when it goes back

    @property
    def what(self) -> str:
        return f"slurm job {self.job}"

    def ask(self) -> None:
        """Ask for the job, and wait for salloc's first word: the job's ID (it waits in the queue, or runs at
        once). LaunchError, quoting Slurm, where it is refused. An interrupt meanwhile raises here: the caller's
        `release` cancels the job."""
        # salloc under its keeper, which ends it once this pipe closes: a job waiting in the queue goes with a
        # kernel that dies, too (`keeper.py`)
        self._salloc = subprocess.Popen(
            [sys.executable, "-I", KEEPER, *self.request.salloc(salloc_path())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )  # the kernel's interrupt is ddpnb's
        threading.Thread(target=self._read, name="ddpnb-salloc", daemon=True).start()
        while not self.job and not self.granted_within(POLL):
            continue

    def granted_within(self, seconds: float) -> bool:
        """Whether the job runs, reading what salloc says for at most `seconds`; LaunchError, quoting Slurm, where
        salloc ended without it (refused, or cancelled in the queue)."""
        assert self._salloc is not None
        deadline = time.monotonic() + seconds
        while not self.granted:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if self._salloc.poll() is not None and self._lines.empty():
                    raise LaunchError(self._refusal()) from None
                return False
            if line is None:
                raise LaunchError(self._refusal())
            self._said.append(line)
            found = JOB_ID.search(line)
            self.job = self.job or (found.group(1) if found else "")
            self.granted = GRANTED in line
        return True

    def park(self) -> None:
        """The run is over: keep the job keep_seconds() for a launch asking for the same, then give it back (at
        once where it never ran, or nothing is kept)."""
        seconds = keep_seconds()
        if not self.granted or seconds <= 0 or not self.running():
            self.release()
            return
        with _kept_lock:
            replaced = _kept.pop(self.request.key(), None)
            _kept[self.request.key()] = self
            self._expiry = threading.Timer(seconds, self._expire)
            self._expiry.daemon = True
            self._expiry.start()
        if replaced is not None:
            replaced.release()

    def unpark(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def running(self) -> bool:
        """Its salloc still holds it, Slurm says it runs, and for MIN_LEFT more at least (a job about to reach its
        --time would end the next run it were given to)."""
        if self._salloc is None or self._salloc.poll() is not None or self.state() != "running":
            return False
        left = self._time_left()
        return left is None or left >= MIN_LEFT

    def _time_left(self) -> float | None:
        """Seconds before the job reaches its time limit, as squeue says it (None: no limit, or not known)."""
        try:
            done = subprocess.run(
                ["squeue", "-h", "-j", self.job, "-o", "%L"],
                capture_output=True,
                text=True,
                timeout=allocation.SCONTROL_WAIT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        found = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", done.stdout.strip())  # [D-][H:]M:S
        if found is None:  # UNLIMITED, NOT_SET, or nothing
            return None
        days, hours, minutes, seconds = (int(part or 0) for part in found.groups())
        return ((days * 24 + hours) * 60 + minutes) * 60 + seconds

    def _expire(self) -> None:
        with _kept_lock:
            if _kept.get(self.request.key()) is not self:
                return  # taken by a launch meanwhile
            del _kept[self.request.key()]
        self.release()

    def release(self) -> None:
        """Give the job back: `cat` ends and salloc relinquishes the allocation; a job still in the queue is
        cancelled; `scancel` in any case, for a salloc that did not."""
        salloc = self._salloc
        if salloc is None:
            return
        self._salloc = None
        if not self.granted:  # nothing runs `cat` yet: salloc itself cancels the job it waits for on SIGTERM
            if self.job:
                allocation.scancel(self.job)
            salloc.terminate()
        if salloc.stdin is not None:
            try:
                salloc.stdin.close()
            except OSError:  # salloc is gone already
                pass
        try:
            salloc.wait(RELEASE_WAIT)
        except subprocess.TimeoutExpired:
            salloc.kill()
            salloc.wait()
        if self.job:
            allocation.scancel(self.job)

    def _read(self) -> None:
        salloc = self._salloc
        assert salloc is not None and salloc.stderr is not None
        for line in salloc.stderr:
            self._lines.put(line.strip())
        self._lines.put(None)

    def state(self) -> str:
        """'pending (Priority)', 'configuring', ... as squeue says it; '' before the job has an ID."""
        if not self.job:
            return ""
        try:
            done = subprocess.run(
                ["squeue", "-h", "-j", self.job, "-o", "%T|%r"],
                capture_output=True,
                text=True,
                timeout=allocation.SCONTROL_WAIT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):  # squeue is slow or missing: salloc still says the grant
            return ""
        state, _, reason = done.stdout.strip().partition("|")
        if not state:
            return ""
        return f"{state.lower()} ({reason})" if reason and reason != "None" else state.lower()

    def _refusal(self) -> str:
        said = [line.removeprefix("salloc: ") for line in self._said if "error" in line.lower()] or self._said
        request = " ".join(shlex.quote(arg) for arg in self.request.salloc("salloc")[1:-1])
        return (
            f"Slurm refused the job for this run (salloc {request}): {'; '.join(said[-3:]) or 'no reason given'}."
            " Check --partition, --account, --qos, --time and --constraint against `sinfo` and your "
            "cluster's documentation; nothing was started."
        )
