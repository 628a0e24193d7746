"""Connecting this kernel to a Ray cluster (kernel side): the one it has, the one Ray would find, or a local one."""

from __future__ import annotations

import logging
import os
import re
import sys

from ddpnb import _compat
from ddpnb.core import live
from ddpnb.core.spec import LaunchError, local_gpu_count, no_gpus_message

LOCAL = "local"  # `_connection` when this kernel runs the local Ray instance ddpnb started
LOCAL_START_ATTEMPTS = 2  # Ray gives a raylet 30 s to start, which a busy machine can overrun
CLIENT_TRIES = 3  # Ray Client's per-client server, forked under gRPC threads, now and then dies at once

_connection: str | None = None  # how ddpnb connected this kernel to Ray: LOCAL, an address, or None (not ddpnb)
_local_resources: dict[str, int] = {}
NO_LASTING_CLUSTER = (
    "detach (--detach) on Ray needs a cluster that outlives this kernel: the local Ray instance ddpnb starts in "
    "the kernel stops with it, and the run with it. Start one (`ray start --head`) and pass --address (or let "
    "ddpnb find it), or leave out detach."
)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def connect_for_run(address: str | None, world_size: int, use_gpus: bool) -> None:
    """`connect` for a run's ranks, saying where they go, and warning where the cluster is too small for them."""
    import ray

    cpus, gpus = world_size, world_size if use_gpus else 0
    print(connect(address, cpus=cpus, gpus=gpus))
    total = ray.cluster_resources()
    if total.get("CPU", 0) < cpus or total.get("GPU", 0) < gpus:
        print(
            f"[ddpnb] the Ray cluster has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs in all; "
            f"this run needs {cpus} CPUs and {gpus} GPUs. It waits until the cluster has room (an autoscaler "
            "may add nodes); --timeout bounds the wait.",
            file=sys.stderr,
        )


def connect(address: str | None, cpus: int, gpus: int) -> str:
    """Connect this kernel to Ray by the rule the README documents; returns a line saying where runs go.

    Without `address`: the connection this kernel already has (`ray.init` by the user, or an earlier run), else
    where Ray itself would connect ($RAY_ADDRESS, or a cluster started with `ray start` on this machine), else a
    local Ray instance with the CPUs and GPUs this run needs ('local' asks for that instance in any case). That
    instance stays for later runs of this kernel, is restarted bigger between runs when a run needs more, and
    stops with the kernel. ddpnb never stops a cluster it connected to; an `address` other than the current
    cluster's disconnects from it first.
    """
    global _connection
    import ray

    if _compat.ray_in_worker():  # a detached run's supervisor: its runs go to the cluster it lives in
        return _describe("Ray (the cluster this supervisor runs in)")
    _compat.ray_route_raylet_lines(_say_raylet_lines)
    wants_local = address == LOCAL  # `--address local`: the local instance, even where a cluster is running
    address = None if wants_local else address
    if ray.is_initialized():
        if wants_local:
            same = _connection == LOCAL
        else:
            same = address is None or address == _connection or _is_current(address)
        if same:
            if _connection == LOCAL and not _local_fits(cpus, gpus):
                _restart_local(cpus, gpus)
                return _describe("restarted the local Ray instance ddpnb started, with more room")
            return _describe("Ray" + (" (local instance started by ddpnb)" if _connection == LOCAL else ""))
        ray.shutdown()
        _connection = None
    found = None if wants_local else address or _discover()
    if found is None:
        _start_local(cpus, gpus)
        return _describe("started a local Ray instance for this kernel")
    try:
        for attempt in range(CLIENT_TRIES):
            try:
                ray.init(address=found, log_to_driver=False, logging_level=logging.WARNING)
                break
            except ConnectionAbortedError as exc:  # Ray Client's own server for this client died as it started
                if "Initialization failure from server" not in str(exc) or attempt == CLIENT_TRIES - 1:
                    raise
                ray.shutdown()
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError, ...
        where = "" if address else " (from $RAY_ADDRESS or a `ray start` on this machine; pass --address to choose)"
        raise LaunchError(f"cannot connect to the Ray cluster at {found}{where}: {type(exc).__name__}: {exc}") from None
    _connection = address or found
    return _describe("connected to Ray")


def connect_lasting(address: str | None) -> str:
    """`connect` for a detached run's supervisor: to a cluster that outlives this kernel, never to the local
    instance ddpnb starts in it, which stops with the kernel (and its actors with it)."""
    import ray

    if address == LOCAL or (address is None and not ray.is_initialized() and _discover() is None):
        raise LaunchError(NO_LASTING_CLUSTER)
    line = connect(address, cpus=0, gpus=0)
    if _connection == LOCAL:
        raise LaunchError(NO_LASTING_CLUSTER)
    return line


def _say_raylet_lines(lines: list[str]) -> None:
    """The raylet's messages (a worker died: a rank killed, or out of memory) arrive in whichever cell is running,
    between the ranks' lines: without Ray's colour codes, on stderr, and labelled as Ray's, not a rank's."""
    for line in lines:
        sys.stderr.write(f"[ray] raylet: {ANSI.sub('', line)}\n")
    sys.stderr.flush()


def _is_current(address: str) -> bool:
    """Whether `address` names the cluster this kernel is connected to (as Ray resolves it)."""
    import ray

    try:
        return _compat.canonical_ray_address(address) == ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - a private helper, or a client connection without a GCS address: not provable
        return False


def _discover() -> str | None:
    """The cluster `ray.init()` would join: $RAY_ADDRESS, else the latest `ray start` on this machine."""
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return None if env == LOCAL else env
    try:
        return _compat.canonical_ray_address(None)
    except Exception:  # noqa: BLE001 - Ray's own discovery is best effort: without it a local instance starts
        return None


def _local_fits(cpus: int, gpus: int) -> bool:
    return cpus <= _local_resources.get("CPU", 0) and gpus <= _local_resources.get("GPU", 0)


def _start_local(cpus: int, gpus: int) -> None:
    global _connection
    import ray

    if gpus and gpus > local_gpu_count():
        raise LaunchError(no_gpus_message(gpus, local_gpu_count()))
    for attempt in range(LOCAL_START_ATTEMPTS):
        try:
            # no dashboard (ddpnb has its own), no log forwarding (ranks report through ddpnb's channel)
            ray.init(
                num_cpus=cpus,
                num_gpus=gpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            break
        except Exception as exc:  # noqa: BLE001 - Ray gives its raylet 30 s to start; a busy machine needs longer
            ray.shutdown()
            if attempt + 1 == LOCAL_START_ATTEMPTS:
                raise LaunchError(f"could not start a local Ray instance: {type(exc).__name__}: {exc}") from None
    _connection = LOCAL
    _local_resources.clear()
    _local_resources.update(CPU=cpus, GPU=gpus)


def _restart_local(cpus: int, gpus: int) -> None:
    import ray

    if live.runs("ray"):
        raise LaunchError(
            f"the local Ray instance has {_local_resources.get('CPU', 0)} CPUs and "
            f"{_local_resources.get('GPU', 0)} GPUs, and a run is still using it: wait for that run "
            "(or stop it) before starting a bigger one."
        )
    wanted = (max(cpus, _local_resources.get("CPU", 0)), max(gpus, _local_resources.get("GPU", 0)))
    ray.shutdown()
    _start_local(*wanted)


def _describe(what: str) -> str:
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    total = ray.cluster_resources()
    return f"[ddpnb] {what}: {len(nodes)} node(s), {total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs"
