"""The ray engine: a run on a Ray cluster, seen exactly like a local run.

    kernel (engine.py, cluster.py)           Ray cluster
    WarmEngine (warm.py): a placement  ───►  host × node (host.py; 0 CPUs, owned by the kernel: it dies with it)
      group, then one long poll per            keeps a warm forkserver; forks the node's ranks from it as the
      host for its ranks' news                 local engine does (node/forked.py), relays their pipes' news
                                               ▼
                                             rank × N (node/rank.py): the local engine's rank code
    TrainEngine (train.py; a run that  ───►  run actor (actor.py) hosts TorchTrainer.fit() and the ranks'
      may restart): drains the channel         channel; rank × N (rank.py, on Ray Train workers)

Both end in `rank.main.run_function`: the same call, result and failure code as a local rank. Ranks report
through ddpnb's own channel, never through Ray's driver log forwarding, which loses the rank, drops repeated lines
and prints into whichever cell is running. Modules here import Ray only inside functions: they are imported for
`--engine ray` alone, and on the cluster.
"""

from __future__ import annotations

import importlib.metadata
import platform

RAY_REQUIREMENT = "ray[train]>=2.44,<3"  # tested: 2.44.1 (Train v1), 2.60.0 (v2)


def version_warning(kernel: dict[str, str]) -> str:
    """The line a node prints where its versions differ from the kernel's; "" where they match."""
    here = versions()
    differ = [
        f"{name} {here.get(name)} here, {version} in the kernel"
        for name, version in kernel.items()
        if here.get(name) != version
    ]
    if not differ:
        return ""
    return (
        f"[ddpnb] this node's versions differ from the kernel's: {'; '.join(differ)}. Functions and results "
        "travel pickled between them: install the same versions on both."
    )


def versions() -> dict[str, str]:
    """What must match between the kernel and the cluster's nodes."""
    found = {"python": ".".join(platform.python_version_tuple()[:2])}
    for package in ("ddpnb", "torch", "ray", "cloudpickle"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found
