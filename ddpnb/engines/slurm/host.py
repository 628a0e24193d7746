"""A Slurm node's host: the one task of the run's `srun` step on its node
(`python -c "from ddpnb.engines.slurm.host import main; main()"`), which is the remote layer's node host
(`ddpnb.remote.host`) placed by what Slurm says in the task's environment. Its process group holds whatever a rank
started even after that left the step's process tree (proctrack/linuxproc would not find it)."""

from __future__ import annotations

import os
import sys

from ddpnb.remote.host import Place, serve
from ddpnb.remote.wire import read_invitation


def main() -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # a pipe to slurmstepd: the host's own words reach the notebook
    address, secret = read_invitation(0)  # srun gives every task the line the kernel wrote
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # nothing forked here reads the rest of the step's input
    os.close(devnull)
    serve(
        address,
        secret,
        Place(
            node_index=int(os.environ.get("SLURM_NODEID", "0")),
            node=os.environ.get("SLURMD_NODENAME", ""),
            step=f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}",
            cpus=_cpus(),
            engine="slurm",
        ),
    )
    os._exit(0)


def _cpus() -> int:
    """The CPUs the step gave this task (0: those it may run on)."""
    try:
        return int(os.environ.get("SLURM_CPUS_PER_TASK", ""))
    except ValueError:
        return 0


if __name__ == "__main__":
    main()
