"""The Slurm allocation a run's ranks use, as `scontrol` describes it, and the address its nodes reach the kernel at."""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from ddpnb.core.spec import LaunchError

SCONTROL_WAIT = 30.0  # seconds a `scontrol` call may take (a busy controller answers slowly)
INSIDE_HINT = (
    "--engine slurm runs the ranks as a job step of the allocation this kernel runs in (SLURM_JOB_ID), "
    "or, outside one, of a job it asks for itself (salloc, with --partition, --time, ...)."
)
# Slurm's messaging failing, as its commands say it (slurm_strerror): a busy or briefly stalled controller, not an
# answer; a command that failed so is tried again, RETRIES times at most, BACKOFF seconds apart, then twice that
TRANSIENT = (
    "Socket timed out on send/recv operation",
    "Unable to contact slurm controller",
    "Zero Bytes were transmitted or received",
    "Communication connection failure",
)
RETRIES = 3
BACKOFF = 1.0
log = logging.getLogger(__name__)


def srun_path() -> str:
    return command(
        "srun",
        "--engine slurm needs Slurm's `srun` on this kernel's PATH, and there is none: run the "
        "kernel on a node of a Slurm cluster (load its module, e.g. `module load slurm`), or "
        "install Slurm's client commands (Debian/Ubuntu: apt-get install slurm-client).",
    )


def command(name: str, missing: str) -> str:
    """The path of Slurm's command `name`; LaunchError(`missing`) where it is not on PATH."""
    path = shutil.which(name)
    if path is None:
        raise LaunchError(missing)
    return path


@dataclass(frozen=True)
class Allocation:
    job: str
    nodes: tuple[str, ...]
    cpus: int
    state: str
    fields: dict[str, str]  # every field scontrol gave, for messages that quote it

    def quote(self, *names: str) -> str:
        return " ".join(f"{name}={self.fields.get(name, '?')}" for name in names)


def inside() -> str:
    """The job this kernel runs in ($SLURM_JOB_ID), or '' outside any allocation (a login node)."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID") or ""


def current() -> Allocation:
    """The job this kernel runs in (`inside()`); LaunchError where it is not running."""
    return describe(inside(), "(this kernel's SLURM_JOB_ID) ")


def describe(job: str, whose: str = "") -> Allocation:
    """A running job's nodes and CPUs, as scontrol says them; LaunchError where it is not running."""
    fields = _parse(scontrol("show", "job", job))
    state = fields.get("JobState", "")
    if state != "RUNNING":
        raise LaunchError(
            f"Slurm job {job} {whose}is {state or 'gone'}, not running: its ranks cannot start in it. {INSIDE_HINT}"
        )
    nodes = tuple(scontrol("show", "hostnames", fields.get("NodeList", "")).split())
    return Allocation(job=job, nodes=nodes, cpus=int(fields.get("NumCPUs", "0") or 0), state=state, fields=fields)


def node_address(node: str) -> str:
    fields = _parse(scontrol("show", "node", node))
    return fields.get("NodeAddr") or node


def reachable_address(node: str) -> str:
    """This host's address on the interface that routes to `node`: where the kernel listens for the ranks (a
    connected UDP socket sends nothing; it only asks the kernel's routing table)."""
    try:
        target = socket.getaddrinfo(node_address(node), 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            return probe.getsockname()[0]
    except OSError:  # no route known, or the node's name does not resolve here: this host's own name then
        return socket.gethostbyname(socket.gethostname())


def transient(text: str) -> bool:
    """Whether Slurm's words say its messaging failed (worth another try), not that it refused."""
    return any(words in text for words in TRANSIENT)


def scontrol(*args: str) -> str:
    """`scontrol -o ARGS`'s answer, tried again where Slurm's messaging failed (saying so on stderr: the cell's
    output); LaunchError, quoting Slurm, where it failed otherwise or every time."""
    for retry in range(RETRIES + 1):
        try:
            done = subprocess.run(
                ["scontrol", "-o", *args], capture_output=True, text=True, timeout=SCONTROL_WAIT, check=False
            )
        except FileNotFoundError:
            raise LaunchError("--engine slurm needs Slurm's `scontrol` on PATH, next to `srun`.") from None
        except subprocess.TimeoutExpired:
            raise LaunchError(
                f"`scontrol {' '.join(args)}` did not answer in {SCONTROL_WAIT:g} s: is the Slurm "
                "controller reachable from here?"
            ) from None
        said = done.stderr.strip() or done.stdout.strip()
        if not done.returncode:
            return done.stdout
        if retry == RETRIES or not transient(said):
            break
        pause = BACKOFF * 2**retry
        print(
            f"[ddpnb] `scontrol {' '.join(args)}` failed ({said}): trying again in {pause:g} s ({retry + 1} of "
            f"{RETRIES})",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(pause)
    raise LaunchError(f"`scontrol {' '.join(args)}` failed: {said}")


def scancel(*args: str) -> None:
    """`scancel --quiet ARGS`; a failure is logged: what else ends the ranks or the job (their lifelines, srun's
    and salloc's ends) still does."""
    try:
        subprocess.run(["scancel", "--quiet", *args], capture_output=True, timeout=SCONTROL_WAIT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("ddpnb: scancel %s failed: %s", " ".join(args), exc)


def _parse(text: str) -> dict[str, str]:
    """`scontrol -o show ...`: one line of Key=Value words (values without spaces, but for a few we do not read)."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def spread(job: Allocation, world_size: int, asked: int | None, srun_args: str) -> list[int]:
    """Ranks per node of the step on `job` (`asked` nodes, or all it holds, at most one per rank), in blocks as
    srun's own default distribution: the first nodes take one more. LaunchError where the job cannot hold the run,
    quoting Slurm."""
    held = f"Slurm job {job.job} holds {job.quote('NumNodes', 'NumCPUs', 'NodeList')}"
    if asked is not None and asked > len(job.nodes):
        raise LaunchError(
            f"--nodes {asked} asks for more nodes than this allocation has: {held}. Use "
            f"--nodes {len(job.nodes)} or fewer, or allocate more (salloc -N {asked} ...)."
        )
    nodes = asked or min(len(job.nodes), world_size)
    if nodes > world_size:
        raise LaunchError(
            f"--nodes {nodes} needs at least one rank per node, and this run has "
            f"{world_size}: use -n {nodes} or more, or fewer nodes."
        )
    overcommit = any(arg in ("-O", "--overcommit") for arg in shlex.split(srun_args))
    if world_size > job.cpus and not overcommit:
        raise LaunchError(
            f"{world_size} ranks need {world_size} CPUs, one per rank, and {held}: "
            f"use -n {job.cpus} or fewer, or an allocation with more tasks (salloc -n "
            f"{world_size} ...), or --srun-args --overcommit to share CPUs."
        )
    each, extra = divmod(world_size, nodes)
    return [each + (index < extra) for index in range(nodes)]
