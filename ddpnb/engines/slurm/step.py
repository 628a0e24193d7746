"""One attempt's srun job step, seen from the kernel: srun started with the hosts' invitation on its stdin, its pipes
read into lines (a host's own, srun's account of a host's end, srun's own news), started again where Slurm's
messaging failed to create the step, and cancelled or ended with the attempt. The hosts' connections and the ranks
they report are the engine's (`engine.py`, over `ddpnb.remote`)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ddpnb.core.engine import RunEvents
from ddpnb.core.spec import Stream, WorkerSpec
from ddpnb.engines.slurm import allocation
from ddpnb.remote.connections import HostConnections

SRUN_WAIT = 5.0  # seconds srun gets to exit once the hosts were told to end, before the step is cancelled
# what srun runs on each node: `-c` rather than `-m`, whose runpy frames would head every stack a rank sends (a
# stack is shown from the first frame that is not ddpnb's or a library's; "<string>" starts local ranks too)
HOST_MAIN = "from ddpnb.engines.slurm.host import main; main()"
# srun's account of a task's end (src/srun: `_task_finish`): "srun: error: n2: task 1: Killed",
# "srun: error: n1: tasks 0-1: Exited with exit code 5"
TASK_END = re.compile(rb"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+?)\s*$")
# srun's words for a step Slurm never created (src/srun: `existing_allocation`, `launch_common_create_job_step`):
# nothing of it ran anywhere
NO_STEP = re.compile(r"Unable to (confirm allocation|create step) for job")
LABEL = re.compile(rb"^ *(\d+): ")  # --label: every line a host wrote, "1: ..." (padded to the widest task)
# what srun and slurmstepd say when ddpnb cancels a step: not news once the run is being stopped
STOP_NOISE = (
    b"forcing job termination",
    b"Job step aborted",
    b"Force Terminated",
    b"CANCELLED AT",
    b"Terminating StepId",
    b"Waiting up to",
)


def command(job: allocation.Allocation, counts: list[int], spec: WorkerSpec, srun_args: str) -> list[str]:
    """srun's command for a step of one task per node of `job`, `counts` ranks on each: the node's host."""
    return [
        allocation.srun_path(),
        f"--jobid={job.job}",
        f"--nodes={len(counts)}",
        f"--ntasks={len(counts)}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={max(counts)}",
        "--overlap",
        "--kill-on-bad-exit=0",
        "--label",
        f"--job-name=ddpnb-{Path(spec.run_dir).name}",
        *([f"--gpus-per-node={max(counts)}", "--gpu-bind=none"] if spec.use_gpus else []),
        *shlex.split(srun_args),
        sys.executable,
        "-c",
        HOST_MAIN,
    ]


class SrunStep:
    """The srun process of one attempt's step and what it says, from its start to its end."""

    def __init__(
        self,
        command: list[str],
        invitation: bytes,
        events: RunEvents,
        conns: HostConnections,
        quiet: Callable[[], bool],
    ) -> None:
        self._command = command
        self._invitation = invitation  # given to srun on its stdin (it gives it to every host)
        self._events: RunEvents | None = events
        self._conns = conns  # whose reader reads srun's pipes, and whose links name the step's hosts
        self._quiet = quiet  # whether the run is being stopped or the engine closed: stop noise is not news
        self._pending_lines: dict[int, bytes] = {}  # srun's stdout/stderr fd -> its unfinished line
        self._streams: dict[int, Stream] = {}
        self.said: list[str] = []  # srun's own lines (not a host's), for a step that never started
        self.task_ended: dict[int, tuple[str, float]] = {}  # node index -> srun's account of its host's end, and when
        self.done_at: float | None = None  # when srun ended, its pipes read to their end
        self._said_from = 0  # where the current srun's lines begin in `said`
        self._retries = 0  # srun started again: a step Slurm's messaging failed to create (`_retry`)
        self._retry_at: float | None = None  # when the next try starts
        self._cancelled = False  # the step was cancelled (`cancel`, once)
        self.process = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        """srun, given the invitation on its stdin; its pipes read by the engine's reader."""
        # its own session: the kernel's interrupt (sent to the kernel's process group) must not reach srun,
        # which would cancel the step at once; ddpnb stops it in its own order
        srun = subprocess.Popen(
            self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        assert srun.stdin is not None
        try:
            srun.stdin.write(self._invitation)
            srun.stdin.close()
        except BrokenPipeError:  # srun failed at once: the reader reads why
            pass
        self._said_from = len(self.said)
        for pipe, stream in ((srun.stdout, Stream.STDOUT), (srun.stderr, Stream.STDERR)):
            assert pipe is not None
            self._streams[pipe.fileno()] = stream
            self._pending_lines[pipe.fileno()] = b""
            self._conns.watch(pipe.fileno(), self._read)
        return srun

    def running(self) -> bool:
        return self.process.poll() is None

    def tried_again(self, now: float) -> bool:
        """Note srun's end once its pipes are read to their end; whether its step is tried again (now or after a
        pause: True meanwhile)."""
        if self.done_at is None and self.process.poll() is not None and not self._pending_lines:
            self.done_at = now
        return self.done_at is not None and self._retry(now)

    # --- srun's lines ---------------------------------------------------------------------------------------------
    def _read(self, fd: int) -> None:
        data = os.read(fd, 1 << 16)
        if not data:
            self._conns.selector.unregister(fd)
            rest = self._pending_lines.pop(fd)
            if rest:
                self._line(fd, rest)
            return
        lines = (self._pending_lines[fd] + data).split(b"\n")
        self._pending_lines[fd] = lines.pop()
        for line in lines:
            self._line(fd, line + b"\n")

    def _line(self, fd: int, line: bytes) -> None:
        """A line from srun: a host's own (labelled with its node's place in the step), or srun's (a host's end,
        an error). Ranks' output never comes this way: it travels with their events."""
        assert self._events is not None
        quiet, links = self._quiet(), self._conns.links
        labelled = LABEL.match(line)
        if labelled and int(labelled.group(1)) < len(links):
            if not (quiet and any(noise in line for noise in STOP_NOISE)):
                self._events.output(links[int(labelled.group(1))].ranks[0], self._streams[fd], line[labelled.end() :])
            return
        ended = TASK_END.match(line)
        if ended:
            for index in _task_ids(ended.group("tasks").decode()):
                if index < len(links):
                    self.task_ended.setdefault(index, (line.decode(errors="replace").strip(), time.monotonic()))
            return
        if quiet and any(noise in line for noise in STOP_NOISE):
            return
        self.said.append(line.decode(errors="replace").rstrip())
        self._events.output(0, Stream.STDERR, line)  # srun's own news: shown with rank 0's output

    # --- trying again, cancelling, ending -------------------------------------------------------------------------
    def _retry(self, now: float) -> bool:
        """srun ended: whether its step is tried again (now or after a pause: True meanwhile). Only a step Slurm
        never created, for its messaging failing under load (`allocation.transient`), and so that no host, and no
        rank, of it can exist; a few times, further apart each time, said in the run's output."""
        assert self._events is not None
        if self._quiet() or self._conns.arrived():
            return False
        if self._retry_at is None:
            failed = next(
                (line for line in self.said[self._said_from :] if NO_STEP.search(line) and allocation.transient(line)),
                None,
            )
            if failed is None or self._retries >= allocation.RETRIES:
                return False
            self._retries += 1
            pause = allocation.BACKOFF * 2 ** (self._retries - 1)
            self._retry_at = now + pause
            self._events.output(
                0,
                Stream.STDERR,
                (
                    f"[ddpnb] srun could not start the step ({failed.removeprefix('srun: error: ')}): Slurm's "
                    f"messaging failed before any rank started; trying again in {pause:g} s ({self._retries} of "
                    f"{allocation.RETRIES})\n"
                ).encode(),
            )
            return True
        if now < self._retry_at:
            return True
        self._retry_at = None
        self._close_pipes()
        self.process, self.done_at = self._start(), None
        return True

    def cancel(self) -> None:
        """The step cancelled (`scancel`, once), where a host said which it is; srun told to end."""
        if self._cancelled:
            return
        self._cancelled = True
        step = next(
            (
                link.hello.step
                for link in self._conns.links
                if link.hello is not None and not link.hello.step.endswith(".")
            ),
            "",
        )
        if step:
            allocation.scancel(step)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def close(self) -> None:
        """srun gone once the hosts were told to end: SRUN_WAIT for it, then the step cancelled, then srun killed."""
        srun = self.process
        if srun.poll() is None:
            try:
                srun.wait(SRUN_WAIT)
            except subprocess.TimeoutExpired:
                self.cancel()
                try:
                    srun.wait(SRUN_WAIT)
                except subprocess.TimeoutExpired:
                    srun.kill()
                    srun.wait()
        self._close_pipes()
        self._events = None  # the run and its value go with the caller's last reference, not at the next gc

    def _close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


def _task_ids(text: str) -> list[int]:
    """srun's task list: '3', '0-1', '0,2-3'."""
    ids: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids
