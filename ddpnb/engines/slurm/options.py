"""The slurm engine's own options (`ddpnb.run(..., engine="slurm", nodes=2)`, `%%ddp --nodes 2`), checked once."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from ddpnb.core.spec import LaunchError

SUBMIT_OPTIONS = ("partition", "time", "account", "qos", "constraint", "job_args")  # for a job ddpnb asks for


@dataclass(frozen=True)
class SlurmOptions:
    """`nodes`: how many nodes the ranks spread over (inside an allocation, default: as many as it holds, at most
    one per rank; outside, Slurm's choice); `srun_args`: more srun options for the step, as one string
    (`"--cpus-per-task=4"`). Outside an allocation, the job ddpnb asks for: `partition`, `time`, `account`, `qos`,
    `constraint` (salloc's options of those names) and `job_args`, more salloc options as one string."""

    nodes: int | None = None
    srun_args: str = ""
    partition: str = ""
    time: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    job_args: str = ""

    def __post_init__(self) -> None:
        if self.nodes is not None:
            try:
                nodes = int(self.nodes)
            except (TypeError, ValueError):
                nodes = 0
            if nodes < 1 or isinstance(self.nodes, bool):
                raise LaunchError(f"nodes takes a positive whole number of nodes, not {self.nodes!r}.")
            object.__setattr__(self, "nodes", nodes)
        for name in ("srun_args", "job_args"):
            try:
                shlex.split(getattr(self, name) or "")
            except ValueError as exc:
                raise LaunchError(
                    f"{name} must be options as a shell would split them ({exc}): {getattr(self, name)!r}."
                ) from None
        for name in SUBMIT_OPTIONS[:-1]:
            value = getattr(self, name)
            if not isinstance(value, str) or any(c.isspace() for c in value):
                raise LaunchError(f"{name} takes one word, as salloc --{name} does, not {value!r}.")

    @property
    def submits(self) -> list[str]:
        """The job options given: they only mean something outside an allocation."""
        return [name for name in SUBMIT_OPTIONS if getattr(self, name)]
