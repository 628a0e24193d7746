"""The rank's process group, ready when the function starts, and the run's store, left in order once it returned.

Code written for mp.spawn/torchrun that calls init_process_group itself keeps working: a call that matches the
ready group is a no-op; one that asks for another backend replaces it; one that asks for another group (another
world size or rank: the trainers of an RPC example, two of four ranks) gets exactly that group, and ddpnb's
features that need the run's own group (checkpoints, the straggler radar) are off on that rank, which it says.
Every group rendezvouses on this run's store (never on a port the user code hard-codes, which another run or
notebook on the machine may hold), under a key prefix of its own: ranks that ask for the same init_method and
world size meet there.
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
    import sys

    import torch.distributed as dist

    rank, world_size = _asked(init_method, kwargs)
    runs = (rank, world_size) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    if dist.is_initialized():
        same_backend = backend is None or backend.lower() == dist.get_backend().lower() or not _usable(backend)
        if runs and own_group() is None and same_backend:
            return
        dist.destroy_process_group()
    if not runs:
        print(
            f"ddpnb: rank {os.environ['RANK']} called init_process_group for a group of its own (world size "
            f"{world_size}, rank {rank}; the run's is world size {os.environ['WORLD_SIZE']}): it gets that group. "
            "ddpnb.save_checkpoint and the straggler radar need the run's group, and are off on this rank.",
            file=sys.stderr,
            flush=True,
        )
    kwargs.pop("rank", None)
    kwargs.pop("world_size", None)
    store = kwargs.pop("store", None) if not runs else None  # the run's group is always on the run's store
    # ranks asking for the same group meet under the same prefix
    new_group(
        backend,
        rank=rank,
        world_size=world_size,
        store=store,
        prefix=None if runs else f"ddpnb/own/{world_size}/{init_method or 'env://'}",
        **kwargs,
    )


def _asked(init_method: str | None, kwargs: dict[str, Any]) -> tuple[int, int]:
    """The rank and world size a call asks for: its arguments, else its init_method's query (`?rank=0`), else the
    environment, as torch reads them."""
    from urllib.parse import parse_qs, urlparse

    query = {key: values[-1] for key, values in parse_qs(urlparse(init_method or "").query).items()}
    rank, world_size = kwargs.get("rank", -1), kwargs.get("world_size", -1)
    rank = rank if rank is not None and rank >= 0 else int(query.get("rank", os.environ["RANK"]))
    world_size = (
        world_size
        if world_size is not None and world_size >= 0
        else int(query.get("world_size", os.environ["WORLD_SIZE"]))
    )
    return rank, world_size


def own_group() -> str | None:
    """The default group, where the user's code asked for another than the run's: "world size 2, rank 0"."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if (rank, world_size) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])):
        return None
    return f"world size {world_size}, rank {rank}"


def _usable(backend: str) -> bool:
    """NCCL asked for on a CPU rank (a GPU notebook dry-run on a laptop) keeps the gloo group instead."""
    return not (backend.lower() == "nccl" and ctx.device() == "cpu")


def new_group(
    backend: str | None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    prefix: str | None = None,
    store: Any = None,
    **kwargs: Any,
) -> None:
    """The default process group: the run's (the environment's rank and world size), or the one the user's code
    asked for; on `store`, or this run's store under a key prefix of its own."""
    import torch.distributed as dist

    context = ctx.current()
    assert context is not None and _real_init is not None
    if store is None:
        if prefix is None:
            context.store_uses += 1
            prefix = f"ddpnb/{context.store_uses}"
        store = dist.PrefixStore(prefix, context.store)
    _real_init(
        backend=backend if backend and _usable(backend) else ("nccl" if context.device != "cpu" else "gloo"),
        store=store,
        rank=int(os.environ["RANK"]) if rank is None else rank,
        world_size=int(os.environ["WORLD_SIZE"]) if world_size is None else world_size,
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
