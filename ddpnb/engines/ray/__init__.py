"""The ray engine: a run on a Ray cluster through Ray Train's `TorchTrainer`, seen exactly like a local run.

    kernel (engine.py, cluster.py)           Ray cluster
    RayEngine, in the run's thread ───────►  run actor (actor.py; 0 CPUs, owned by the kernel: it dies with it)
      drains the channel ten times a           hosts TorchTrainer.fit() and the ranks' channel to the kernel
      second                                   │ owns Ray Train's controller, which owns the workers
                                               ▼
                                             rank × N (rank.py, on Ray Train workers): fds 1/2 → pipes → channel
                                             (and on to Ray's own log), then `rank.main.run_function`: the same
                                             call, result and failure code as a local rank

Ranks report through ddpnb's own channel (the run actor), never through Ray's driver log forwarding, which
loses the rank, drops repeated lines and prints into whichever cell is running. Modules here import Ray only
inside functions: they are imported for `--engine ray` alone, and on the workers.
"""

from __future__ import annotations

import importlib.metadata
import platform

RAY_REQUIREMENT = "ray[train]>=2.44,<3"  # tested: 2.44.1 (Train v1), 2.60.0 (v2)


def version_warning(kernel: dict[str, str]) -> str:
    """The line a node prints where its versions differ from the kernel's; "" where they match."""
    here = versions()
    differ = [f"{name} {here.get(name)} here, {version} in the kernel" for name, version in kernel.items()
              if here.get(name) != version]
    if not differ:
        return ""
    return (f"[ddpnb] this node's versions differ from the kernel's: {'; '.join(differ)}. Functions and results "
            "travel pickled between them: install the same versions on both.")


def versions() -> dict[str, str]:
    """What must match between the kernel and the cluster's nodes."""
    found = {"python": ".".join(platform.python_version_tuple()[:2])}
    for package in ("ddpnb", "torch", "ray", "cloudpickle"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found
