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
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpnb.core.checkpoints import COMPLETE, PARTIAL_SUFFIX, latest, step_dir
from ddpnb.core.stacks import the_callers
from ddpnb.rank import context as ctx


@dataclass
class _SaveInFlight:
    """An asynchronous save on its way: DCP writes in a thread; rank 0 marks it complete as soon as every rank's
    files are written (`_mark_complete`), and `finish` waits for that."""

    future: Any
    step: int
    final: Path
    completed: threading.Event


_pending: _SaveInFlight | None = None
_async_group: Any = None  # a process group of its own for DCP's writing thread: never the training's collectives
_shared_root: Path | None = None  # the checkpoint directory every rank was seen to share (`_check_shared`)


def save_checkpoint(state: Mapping[str, Any], step: int, asynchronous: bool = False) -> None:
    """Save `state` ({"model": model, "opt": opt, ...}) as the checkpoint of `step`. A collective: every rank
    calls it with its own objects. The last `keep_checkpoints` complete checkpoints are kept.

    `asynchronous=True`: DCP's `async_save`; the call returns once `state` is copied to CPU memory, and the files
    are written meanwhile, in a thread. It is marked complete once every rank's files are written, so a rank that
    dies before never leaves a checkpoint that counts; the next save (or load), and the end of the function,
    wait for it."""
    global _async_group, _pending
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    spec = _spec("save_checkpoint")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise the_callers(TypeError(f"ddpnb.save_checkpoint: step must be an int of 0 or more, not {step!r}."))
    finish()  # the save before this one, if it was asynchronous
    root = Path(spec.checkpoint_dir)
    final = root / step_dir(step)
    partial = root / f"{step_dir(step)}.attempt{spec.attempt}{PARTIAL_SUFFIX}"
    token = root / f".shared-by-every-rank.{Path(spec.run_dir).name}.attempt{spec.attempt}"
    if dist.get_rank() == 0:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # this attempt saved this step before: start it afresh
        if _shared_root != root:
            token.touch()
    dist.barrier()  # no rank writes into `partial` before it is empty
    _check_shared(root, token)
    if asynchronous:
        if _async_group is None:
            _async_group = dist.new_group(backend="gloo")
        future = dcp.async_save(_state_dict(state), checkpoint_id=str(partial), process_group=_async_group)
        future = getattr(future, "upload_completion", future)  # a response holding futures, in some versions
        completed = threading.Event()
        if dist.get_rank() == 0:
            future.add_done_callback(
                lambda done: _mark_complete(done, partial, final, spec.keep_checkpoints, completed)
            )
        else:
            completed.set()
        _pending = _SaveInFlight(future, step, final, completed)
        return
    dcp.save(_state_dict(state), checkpoint_id=str(partial))
    if dist.get_rank() == 0:
        _rename(partial, final, spec.keep_checkpoints)
    _announce(step, final)


def _check_shared(root: Path, token: Path) -> None:
    """Once per attempt, at the first save: every rank sees the file rank 0 just wrote in the checkpoint directory.
    A directory each node has its own of (a node's /tmp, where the run directory is by default) would leave each
    node's shards where no other node reads them: a checkpoint that cannot be loaded. Raises on every rank."""
    global _shared_root
    if _shared_root == root:
        return
    import socket

    import torch.distributed as dist

    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (token.exists(), socket.gethostname()))
    if dist.get_rank() == 0:
        token.unlink(missing_ok=True)
    blind = [(rank, host) for rank, (found, host) in enumerate(seen) if not found]
    if blind:
        hosts = sorted({host for _, host in blind})
        raise the_callers(
            RuntimeError(
                f"ddpnb.save_checkpoint: the checkpoint directory {root} is not shared by every rank: rank"
                f"{'s' if len(blind) > 1 else ''} {', '.join(str(rank) for rank, _ in blind)} (on "
                f"{', '.join(hosts)}) cannot see what rank 0 wrote there, so a checkpoint would be split between the "
                "nodes and could not be loaded. Pass --checkpoint-dir (checkpoint_dir=) a directory on a filesystem "
                "every node shares (your home or scratch directory); nothing was saved."
            )
        )
    _shared_root = root


def finish() -> None:
    """Wait for an asynchronous save still being written and marked complete (a collective: every rank calls it, at
    the next save or load and after the function returns)."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        pending.future.result()  # raises if a rank's writing failed: the checkpoint then never counts
        pending.completed.wait()
        _announce(pending.step, pending.final)


def _mark_complete(done: Any, partial: Path, final: Path, keep: int, completed: threading.Event) -> None:
    """Rank 0, in DCP's writing thread: the asynchronous save is written (or failed: then it never counts)."""
    try:
        if done.exception() is None:
            _rename(partial, final, keep)
    finally:
        completed.set()


def _rename(partial: Path, final: Path, keep: int) -> None:
    """Rank 0 marks a written checkpoint complete: DCP's save ends once rank 0 wrote the metadata, which it does
    after every rank's shards are written."""
    if final.exists():  # the same step saved again (a later attempt): the new one replaces it
        shutil.rmtree(final)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    _prune(final.parent, keep)


def _announce(step: int, final: Path) -> None:
    import torch.distributed as dist

    dist.barrier()  # every rank returns with the checkpoint complete: a load right after finds it
    hooks = ctx.current().checkpoints  # type: ignore[union-attr]
    if hooks is not None:  # the engine registers it too (Ray Train: every rank reports)
        hooks.saved(step, final)


def load_checkpoint(state: MutableMapping[str, Any]) -> int | None:
    """Load the latest complete checkpoint into `state`'s objects, in place, and return its step; None if there
    is none (a first attempt). Looks in this run's checkpoints, then in those of the run it resumes (--resume).
    A collective: every rank calls it, and rank 0 picks the checkpoint for all of them."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    spec = _spec("load_checkpoint")
    finish()  # an asynchronous save still being written is the latest
    chosen: list[Any] = [None]
    if dist.get_rank() == 0:
        # the engine's latest and ddpnb's own are both complete; the engine's may lag (Ray Train registers a
        # reported checkpoint once its controller has collected every worker's report)
        own = [found for found in (_engine_latest(), latest(spec.checkpoint_dir)) if found is not None]
        found = max(own) if own else (latest(spec.resume_dir) if spec.resume_dir else None)
        chosen = [None if found is None else (found[0], str(found[1]))]
    dist.broadcast_object_list(chosen, src=0)  # every rank loads the same step, even if its view of the disk lags
    if chosen[0] is None:
        return None
    step, path = chosen[0]
    loaded = _state_dict(state)
    dcp.load(loaded, checkpoint_id=path)
    _apply(state, loaded)
    return step


def _engine_latest() -> tuple[int, Path] | None:
    """The engine's latest complete checkpoint (Ray Train's, after it restarted the workers), if it has one."""
    hooks = ctx.current().checkpoints  # type: ignore[union-attr]
    path = hooks.latest() if hooks is not None else None
    match = COMPLETE.fullmatch(path.name) if path is not None else None
    return (int(match.group(1)), path) if match and (path / ".metadata").is_file() else None


def _spec(name: str) -> Any:
    context = ctx.current()
    if context is None or context.spec is None or not context.spec.checkpoint_dir:
        raise RuntimeError(
            f"ddpnb.{name} works inside a ddpnb rank (a %%ddp cell's function, or ddpnb.run's): its "
            "checkpoints belong to the run. Outside one, call torch.distributed.checkpoint directly."
        )
    from ddpnb.rank import group

    own = group.own_group()
    if own is not None:
        raise the_callers(
            RuntimeError(
                f"ddpnb.{name} needs the run's own process group, and this rank's code replaced it with "
                f"init_process_group ({own}): call torch.distributed.checkpoint directly, or leave the "
                "process group ddpnb makes."
            )
        )
    return context.spec


def _state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """What DCP saves for each entry: models and optimizers through DCP's own state-dict functions (sharded for
    FSDP2, unwrapped for DDP), other stateful objects through `state_dict()`, plain values as they are."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not isinstance(state, Mapping):
        raise the_callers(
            TypeError(
                "ddpnb checkpoints take a dict of what to save, e.g. {'model': model, 'opt': "
                f"opt}}, not {type(state).__name__}."
            )
        )
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
    raise the_callers(
        ValueError(
            f"ddpnb checkpoints: the optimizer {key!r} trains no model in the same dict; put "
            f"its model next to it, e.g. {{'model': model, {key!r}: {key}}}."
        )
    )


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
