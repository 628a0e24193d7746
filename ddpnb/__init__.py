"""ddpnb: distributed PyTorch training from a Jupyter cell.

    %load_ext ddpnb

    %%ddp --gpus 4
    def train(rank, world_size):
        ...
        ddpnb.log(step=i, loss=loss.item())
        return model.state_dict()

Importing ddpnb imports neither torch nor ipywidgets; they load when a run starts.
"""

from __future__ import annotations

from typing import Any

from ddpnb._api import (
    LaunchError,
    LaunchOptions,
    attach,
    attempt,
    device,
    last_run,
    launch,
    log,
    profile,
    run,
    runs,
    spawn,
)
from ddpnb._session import PerRank, Session, SessionBroken, SessionError, current_session, session
from ddpnb.core.pickling import NotPicklableError
from ddpnb.core.record import Outcome, RankState, RunRecord
from ddpnb.core.report import RunInterrupted, WorkerError
from ddpnb.engines.local.preload import preload
from ddpnb.node.forkserver import PreloadError
from ddpnb.rank.checkpoint import load_checkpoint, save_checkpoint

__all__ = [
    "LaunchError",
    "LaunchOptions",
    "NotPicklableError",
    "Outcome",
    "PerRank",
    "PreloadError",
    "RankState",
    "RunInterrupted",
    "RunRecord",
    "Session",
    "SessionBroken",
    "SessionError",
    "WorkerError",
    "attach",
    "attempt",
    "current_session",
    "device",
    "export",
    "last_run",
    "launch",
    "load_checkpoint",
    "load_ipython_extension",
    "log",
    "preload",
    "profile",
    "run",
    "runs",
    "save_checkpoint",
    "session",
    "spawn",
]
__version__ = "0.1.0"


def export(fn: Any, path: Any, /, **options: Any) -> Any:
    """Write `fn`, with what it uses from the notebook, as a script torchrun or srun runs: see
    `ddpnb.script.writer.export` and docs/export.md. (`%ddp_export PATH` does it for the last %%ddp cell.)"""
    from ddpnb.script.writer import export as write_script

    return write_script(fn, path, **options)


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext ddpnb`: register `%%ddp` and the session magics (`%ddp_start`, `%%ranks`, ...), bind `ddpnb` in the notebook (cells call `ddpnb.log`) unless the
    name is taken, and start warming the worker forkserver in the background."""
    import sys

    from ddpnb.core.spec import check_platform

    check_platform()  # before anything Linux-only starts (the forkserver's warm-up)
    from ddpnb._magic import DDPMagics, SessionMagics, point_debug_at_the_ranks
    from ddpnb.core.live import stop_all
    from ddpnb.node import forkserver

    ipython.register_magics(DDPMagics, SessionMagics)
    point_debug_at_the_ranks(ipython)
    ipython.user_ns.setdefault("ddpnb", sys.modules[__name__])
    kernel = getattr(ipython, "kernel", None)
    if kernel is not None and callable(getattr(kernel, "do_shutdown", None)):
        _end_first_at_shutdown(kernel, stop_all, forkserver.shut_down)
    forkserver.warm_up_in_background()


def _end_first_at_shutdown(kernel: Any, *ends: Any) -> None:
    """Runs, sessions and the forkserver end as the kernel's shutdown begins (its `do_shutdown`), before ipykernel
    signals the processes it finds in its process group, which waits for the ones that ignore SIGTERM."""
    original = kernel.do_shutdown
    if getattr(original, "ddpnb_ends", False):  # `%load_ext` again (`%reload_ext`)
        return

    def do_shutdown(restart: bool) -> Any:
        for end in ends:
            try:
                end()
            except Exception:  # noqa: BLE001, S112 - the shutdown goes on: ipykernel's own signals end what is left
                continue
        return original(restart)

    do_shutdown.ddpnb_ends = True  # type: ignore[attr-defined]
    kernel.do_shutdown = do_shutdown
