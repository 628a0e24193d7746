"""The kernel's Slurm allocation, as `scontrol` describes it, and the address its nodes reach the kernel at."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass

from ddpnb.core.spec import LaunchError

SCONTROL_WAIT = 30.0  # seconds a `scontrol` call may take (a busy controller answers slowly)
INSIDE_HINT = ("--engine slurm runs the ranks as a job step inside the allocation this kernel runs in: start Jupyter "
               "inside one (`salloc -N 2 -n 4`, then `jupyter lab` in that shell; or an Open OnDemand Jupyter "
               "session), so that SLURM_JOB_ID is set. Submitting a job from a login node (sbatch) is not there yet.")


def srun_path() -> str:
    path = shutil.which("srun")
    if path is None:
        raise LaunchError("--engine slurm needs Slurm's `srun` on this kernel's PATH, and there is none: run the "
                          "kernel on a node of a Slurm cluster (load its module, e.g. `module load slurm`), or "
                          "install Slurm's client commands (Debian/Ubuntu: apt-get install slurm-client).")
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


def current() -> Allocation:
    """The job this kernel runs in ($SLURM_JOB_ID); LaunchError where there is none, or it is not running."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job:
        raise LaunchError(f"this kernel is not inside a Slurm allocation (SLURM_JOB_ID is not set). {INSIDE_HINT}")
    fields = _parse(scontrol("show", "job", job))
    state = fields.get("JobState", "")
    if state != "RUNNING":
        raise LaunchError(f"Slurm job {job} (this kernel's SLURM_JOB_ID) is {state or 'gone'}, not running: "
                          f"its ranks cannot start in it. {INSIDE_HINT}")
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


def scontrol(*args: str) -> str:
    try:
        done = subprocess.run(["scontrol", "-o", *args], capture_output=True, text=True, timeout=SCONTROL_WAIT,
                              check=False)
    except FileNotFoundError:
        raise LaunchError("--engine slurm needs Slurm's `scontrol` on PATH, next to `srun`.") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`scontrol {' '.join(args)}` did not answer in {SCONTROL_WAIT:g} s: is the Slurm "
                          "controller reachable from here?") from None
    if done.returncode:
        raise LaunchError(f"`scontrol {' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _parse(text: str) -> dict[str, str]:
    """`scontrol -o show ...`: one line of Key=Value words (values without spaces, but for a few we do not read)."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields
