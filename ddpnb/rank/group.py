"""The rank's process group, ready when the function starts, and the run's store, left in order once it returned.

Code written for mp.spawn/torchrun that calls init_process_group itself keeps working: a call that matches the
ready group is a no-op; one that asks for another backend replaces it, rendezvousing on this run's store (never
on a port the user code hard-codes).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

from ddpnb.rank import context as ctx

LEAVE_WAIT = 0.05  # seconds rank 0 waits for the other ranks to finish before it takes down its process group
_real_init: Any = None


def patch_init_process_group() -> None:
    global _real_init
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _real_init = c10d.init_process_group
    dist.init_process_group = c10d.init_process_group = _init_from_user_code


def _init_from_user_code(backend: str | None = None, init_method: str | None = None, **kwargs: Any) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        if backend is None or backend.lower() == dist.get_backend().lower() or not _usable(backend):
            return
        dist.destroy_process_group()
    kwargs.pop("store", None)
    kwargs.pop("rank", None)
    kwargs.pop("world_size", None)
    new_group(backend if backend and _usable(backend) else None, **kwargs)


def _usable(backend: str) -> bool:
    """NCCL asked for on a CPU rank (a GPU notebook dry-run on a laptop) keeps the gloo group instead."""
    return not (backend.lower() == "nccl" and ctx.device() == "cpu")


def new_group(backend: str | None, **kwargs: Any) -> None:
    """The default process group, on this run's store under a key prefix of its own."""
    import torch.distributed as dist

    context = ctx.current()
    assert context is not None and _real_init is not None
    context.store_uses += 1
    _real_init(
        backend=backend or ("nccl" if context.device != "cpu" else "gloo"),
        store=dist.PrefixStore(f"ddpnb/{context.store_uses}", context.store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        **kwargs,
    )


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_store(context: ctx.RankContext) -> None:
    """Rank 0 hosts the run's TCPStore, so it exits only once every rank's function has returned: a rank still
    running needs the store. The others say they are done and exit, their process group with them (exiting
    closes its sockets; `destroy_process_group` would cost each rank time on the launch path).

    Ranks usually finish together; if one is still going after LEAVE_WAIT, rank 0 first takes down its process
    group, so that a rank waiting in a collective rank 0 will never join fails now rather than after the
    backend's timeout (gloo; an NCCL peer still waits for NCCL's). Best effort: the rank's function has returned,
    so nothing here is the user's failure. Every engine whose rank 0 hosts the store calls it after the function.
    """
    store, rank = context.store, context.rank
    if store is None:
        return
    try:
        if rank:
            store.set(f"ddpnb/done/{rank}", b"")
            return
        others = [f"ddpnb/done/{r}" for r in range(1, int(os.environ["WORLD_SIZE"]))]
        deadline = time.monotonic() + LEAVE_WAIT
        # `check`, not `wait` with a timeout: a wait that times out prints c10d warnings into the rank's output
        while not store.check(others):
            if time.monotonic() > deadline:
                destroy_process_group()
                store.wait(others, datetime.timedelta(days=365))
                return
            time.sleep(0.005)
    except Exception:  # noqa: BLE001 - a store gone with a failed rank: the kernel reports that rank
        return
