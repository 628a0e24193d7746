"""The bench's many-ranks launch probe (bench/run.py's section 15): from the launch call to every one of N real CPU
ranks past its process group's barrier, with ddpnb and with what a user runs instead; prints one `@@LAUNCH {json}`.

    python bench/_launch_many.py ddpnb RANKS LATER [--slurm NODES]  # plays the kernel (--slurm: inside an allocation)
    python bench/_launch_many.py mp-spawn RANKS
    srun ... python bench/_launch_many.py srun-rank OUT              # one task of a plain srun step

Every launcher's ranks run the same trivial work: the gloo group up (ddpnb's before the function; the others'
`init_process_group`), a barrier, then each rank's clock after it gathered on rank 0, whose latest is the moment
every rank was past the barrier (the Slurm nodes are this machine: one clock). `ready`: seconds from the call to
that moment; `done`: to the call's return. The ddpnb probe imports torch before the clock starts, as a notebook
that ran `import torch` has; its first launch starts the forkserver (local) or the nodes' hosts (slurm).

Only the standard library at module level: mp.spawn's children re-import this file as `__mp_main__`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

MARKER = "@@LAUNCH "


def past_barrier() -> float:
    """The barrier, then the latest of every rank's clock after it (on rank 0; the others' value is unused)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    mine = torch.tensor([time.time()], dtype=torch.float64)
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return max(float(clock) for clock in every)


def ddpnb_rank() -> float:
    return past_barrier()


def launch_ddpnb(ranks: int, later: int, nodes: int | None) -> list[dict[str, float]]:
    import torch  # noqa: F401 - the notebook imported torch

    import ddpnb

    options = {"engine": "slurm", "nodes": nodes, "srun_args": "--overcommit"} if nodes else {"oversubscribe": True}
    times = []
    for _ in range(1 + later):
        started = time.time()
        ready = ddpnb.run(ddpnb_rank, nprocs=ranks, view="none", **options)
        times.append({"ready": ready - started, "done": time.time() - started})
    return times


def _spawned(rank: int, ranks: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    ready = past_barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(ready))


def launch_mp_spawn(ranks: int) -> list[dict[str, float]]:
    import torch.multiprocessing as mp

    fd, out = tempfile.mkstemp(prefix="ddpnb-bench-", suffix=".json")
    os.close(fd)
    with socket.socket() as sock:  # the rendezvous takes a port number: the nearest thing is one nothing holds now
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    started = time.time()
    mp.spawn(_spawned, args=(ranks, out), nprocs=ranks, join=True)
    done = time.time() - started
    ready = json.loads(Path(out).read_text()) - started
    os.unlink(out)
    return [{"ready": ready, "done": done}]


def srun_rank(out: str) -> None:
    """One task of a plain srun step, as a batch script's: RANK and WORLD_SIZE from Slurm's variables, the
    rendezvous (MASTER_ADDR/PORT) set by whoever ran srun."""
    _spawned(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), out)


def main() -> None:
    what = sys.argv[1]
    if what == "srun-rank":
        srun_rank(sys.argv[2])
        return
    ranks = int(sys.argv[2])
    if what == "ddpnb":
        nodes = int(sys.argv[5]) if sys.argv[4:5] == ["--slurm"] else None
        times = launch_ddpnb(ranks, int(sys.argv[3]), nodes)
    elif what == "mp-spawn":
        times = launch_mp_spawn(ranks)
    else:
        sys.exit(__doc__)
    print(MARKER + json.dumps(times), flush=True)


if __name__ == "__main__":
    main()
