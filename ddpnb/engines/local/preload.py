"""`ddpnb.preload`: libraries imported once in the local engine's forkserver, before every rank is forked."""

from __future__ import annotations

import importlib.util

from ddpnb.core import live
from ddpnb.engines.local.engine import LocalOptions, LocalType
from ddpnb.node import forkserver
from ddpnb.node.forkserver import PreloadError
from ddpnb.rank import context as rank_context


def preload(*modules: str) -> list[str]:
    """Import `modules` once in the process ranks are forked from, so that every later launch starts with them:
    `ddpnb.preload("torchvision")` in a notebook's first cell. Ranks are still fresh processes; a module's import
    just happened before the fork instead of in every rank at every launch.

    Restarts that process (one `import torch` plus every preloaded module, now, in this call; calling it again
    re-imports a module you edited) and checks it: if a module cannot be imported there, is imported from another
    file than here, starts a thread or initialises CUDA when imported, nothing is added, with a `PreloadError`
    that says why. Returns every module preloaded so far; `ddpnb.preload()` only returns them.
    Do not preload a library that reads RANK or LOCAL_RANK when it is imported: it would read the kernel's.
    For the local engine only: Ray's workers import for themselves.
    """
    if rank_context.current() is not None:
        raise PreloadError("ddpnb.preload is for the notebook (it prepares the process ranks start from), not a rank.")
    LocalType().check(LocalOptions())  # ranks start in the kernel's working directory
    origins: dict[str, str | None] = {}  # where this kernel finds each module's top-level package
    for name in modules:
        if not isinstance(name, str) or not name or not all(part.isidentifier() for part in name.split(".")):
            raise PreloadError(f"ddpnb.preload takes module names such as 'torchvision', not {name!r}.")
        top = name.partition(".")[0]
        try:  # the top-level name only: finding a submodule would import its package here, in the kernel
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):  # ValueError: __main__, or a module without a spec
            found = None
        if found is None:
            raise PreloadError(f"ddpnb.preload: no module named {top!r} here; install it, or check the name.")
        origins[name] = found.origin if found.has_location else None
    return forkserver.preload(origins, busy=lambda: bool(live.runs(LocalType.name)))
