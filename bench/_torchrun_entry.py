"""The plain-script side of the comparisons: `torchrun --nproc_per_node 2 bench/_torchrun_entry.py WORKLOAD OUT`,
or `srun -n 2 ...` with MASTER_ADDR and MASTER_PORT set (RANK and WORLD_SIZE then come from Slurm's variables,
as a batch script's own lines would set them).

Rank 0 writes the workload's return value to OUT as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workloads


def main() -> None:
    import torch.distributed as dist

    workload, out, *rest = sys.argv[1:]
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # started by srun, not torchrun
        os.environ["RANK"], os.environ["WORLD_SIZE"] = os.environ["SLURM_PROCID"], os.environ["SLURM_NTASKS"]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if workload == "trivial":
        value = _workloads.trivial()
    elif workload == "train":
        value = _workloads.train(rank, world_size, steps=int(rest[0]), report=False)
    else:
        raise SystemExit(f"unknown workload {workload!r}")
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(value))


if __name__ == "__main__":
    main()
