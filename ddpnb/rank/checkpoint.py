"""`ddpnb.save_checkpoint` and `ddpnb.load_checkpoint`, inside a rank: torch.distributed.checkpoint (DCP).

A checkpoint is one directory per step, `step-000000020`, written by every rank (DCP: each rank its own shards,
rank 0 the metadata) under a name of its own, `step-000000020.attempt0.partial`, and renamed by rank 0 once DCP
has returned (every rank's shards and the metadata are written). A save killed half-way therefore leaves only a
`.partial` directory, which is never loaded and is deleted by the next complete save: write, then mark complete.

Models and optimizers go through DCP's `get_state_dict`/`set_state_dict`, so a DDP model, an FSDP2
(`fully_shard`) model with its sharded optimizer, and a plain module all take the same two calls; other objects
with `state_dict`/`load_state_dict` (LR schedulers, GradScaler) are saved whole, and plain values (an epoch
number, a tensor) are put back into the dict.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from ddpnb.core.checkpoints import COMPLETE, PARTIAL_SUFFIX, latest, step_dir
from ddpnb.rank import context as ctx


def save_checkpoint(state: Mapping[str, Any], step: int) -> None:
    """Save `state` ({"model": model, "opt": opt, ...}) as the checkpoint of `step`. A collective: every rank
    calls it with its own objects. The last `keep_checkpoints` complete checkpoints are kept."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    spec = _spec("save_checkpoint")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(f"ddpnb.save_checkpoint: step must be an int of 0 or more, not {step!r}.")
    root = Path(spec.checkpoint_dir)
    final = root / step_dir(step)
    partial = root / f"{step_dir(step)}.attempt{spec.attempt}{PARTIAL_SUFFIX}"
    first = dist.get_rank() == 0
    if first:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # this attempt saved this step before: start it afresh
    dist.barrier()  # no rank writes into `partial` before it is empty
    dcp.save(_state_dict(state), checkpoint_id=str(partial))
    # dcp.save returns once rank 0 wrote the metadata, which it does after every rank's shards are written
    if first:
        if final.exists():  # the same step saved again (a later attempt): the new one replaces it
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(root)
        _prune(root, spec.keep_checkpoints)
    dist.barrier()  # every rank returns with the checkpoint complete: a load right after finds it


def load_checkpoint(state: MutableMapping[str, Any]) -> int | None:
    """Load the latest complete checkpoint into `state`'s objects, in place, and return its step; None if there
    is none (a first attempt). Looks in this run's checkpoints, then in those of the run it resumes (--resume).
    A collective: every rank calls it, and rank 0 picks the checkpoint for all of them."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    spec = _spec("load_checkpoint")
    chosen: list[Any] = [None]
    if dist.get_rank() == 0:
        found = latest(spec.checkpoint_dir) or (latest(spec.resume_dir) if spec.resume_dir else None)
        chosen = [None if found is None else (found[0], str(found[1]))]
    dist.broadcast_object_list(chosen, src=0)  # every rank loads the same step, even if its view of the disk lags
    if chosen[0] is None:
        return None
    step, path = chosen[0]
    loaded = _state_dict(state)
    dcp.load(loaded, checkpoint_id=path)
    _apply(state, loaded)
    return step


def _spec(name: str) -> Any:
    context = ctx.current()
    if context is None or context.spec is None or not context.spec.checkpoint_dir:
        raise RuntimeError(f"ddpnb.{name} works inside a ddpnb rank (a %%ddp cell's function, or ddpnb.run's): its "
                           "checkpoints belong to the run. Outside one, call torch.distributed.checkpoint directly.")
    return context.spec


def _state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """What DCP saves for each entry: models and optimizers through DCP's own state-dict functions (sharded for
    FSDP2, unwrapped for DDP), other stateful objects through `state_dict()`, plain values as they are."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not isinstance(state, Mapping):
        raise TypeError("ddpnb checkpoints take a dict of what to save, e.g. {'model': model, 'opt': opt}, not "
                        f"{type(state).__name__}.")
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            out[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            out[key] = get_optimizer_state_dict(_model_of(value, state, key), value)
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


def _apply(state: MutableMapping[str, Any], loaded: dict[str, Any]) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for key, value in list(state.items()):
        if isinstance(value, torch.nn.Module):
            set_model_state_dict(value, loaded[key])
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_model_of(value, state, key), value, loaded[key])
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            value.load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]


def _model_of(optimizer: Any, state: Mapping[str, Any], key: str) -> Any:
    """The model in `state` whose parameters `optimizer` trains: DCP names an optimizer's state by them."""
    import torch

    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for value in state.values():
        if isinstance(value, torch.nn.Module) and any(id(p) in params for p in value.parameters()):
            return value
    raise ValueError(f"ddpnb checkpoints: the optimizer {key!r} trains no model in the same dict; put its model "
                     f"next to it, e.g. {{'model': model, {key!r}: {key}}}.")


def _prune(root: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints; delete older ones and the leftovers of saves that died."""
    complete = sorted((int(m.group(1)), name) for name in os.listdir(root) if (m := COMPLETE.fullmatch(name)))
    stale = [name for _, name in complete[:-keep]] if keep > 0 else []
    stale += [name for name in os.listdir(root) if name.endswith(PARTIAL_SUFFIX)]
    for name in stale:
        shutil.rmtree(root / name, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    """Make the rename durable: a machine that loses power keeps either the old name or the new one."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
