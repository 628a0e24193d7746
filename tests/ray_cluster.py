"""A real two-node Ray cluster on this machine, started with `ray start`, for the tests that need a cluster of
their own (not the local instance ddpnb starts in a kernel): a head (`ray start --head`, with Ray Client's server)
and a second node joined to it, 2 CPUs each, on loopback, in a temp directory of their own (so `ray.init()`
elsewhere on the machine never finds it).

`two_node_cluster(log_dir, env)` starts it and stops it; tests/conftest.py holds one for the session (`local_ray`),
which each module that uses it tidies first (`Cluster.tidy`): what an earlier module's runs left goes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.apart import start_apart

CPUS_PER_NODE = 2

# run in a process of its own, so that the test process never joins the cluster: ddpnb's detached supervisors
# (namespace "ddpnb") killed, every placement group removed, then every CPU free and both nodes alive again
TIDY = """
import sys, time
import ray
from ray.util import placement_group_table, remove_placement_group
from ray.util.placement_group import PlacementGroup

ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
for actor in ray.util.list_named_actors(all_namespaces=True):
    if actor["namespace"] == "ddpnb":
        ray.kill(ray.get_actor(actor["name"], namespace="ddpnb"))
for group_id, group in placement_group_table().items():
    if group["state"] != "REMOVED":
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
deadline = time.monotonic() + float(sys.argv[2])
while True:
    free, cpus = ray.available_resources().get("CPU", 0), ray.cluster_resources().get("CPU", 0)
    nodes = len([node for node in ray.nodes() if node["Alive"]])
    if free == cpus == 2 * float(sys.argv[3]) and nodes == 2 or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(f"{free:g} of {cpus:g} CPUs free on {nodes} node(s)")
"""


@dataclass
class Cluster:
    address: str  # the head's GCS address, 127.0.0.1:PORT
    client_address: str  # Ray Client's: ray://127.0.0.1:PORT
    node_pids: list[int]  # the `ray start --block` processes: everything the nodes run is below them
    env: dict[str, str]  # the environment the nodes were started in

    @property
    def node_runs(self) -> Path:
        """The nodes' runs directory (DDPNB_RUNS_DIR), where the supervisors they run keep their runs."""
        return Path(self.env["DDPNB_RUNS_DIR"])

    def tidy(self, within: float = 60.0) -> None:
        """Back to how it started, after a module whose runs may have left something (a detached run's supervisor,
        a placement group): those end, and it waits `within` seconds for every CPU to be free, else says what is
        left."""
        done = subprocess.run(
            [sys.executable, "-c", TIDY, self.address, str(within), str(CPUS_PER_NODE)],
            capture_output=True,
            text=True,
            check=False,  # its exit status is read below, with what it said
            timeout=within + 120,
            env={**self.env, "DDPNB_RUNS_DIR": ""},
        )
        said = done.stdout.strip().splitlines()[-1:] or [done.stderr]
        expected = f"{2 * CPUS_PER_NODE} of {2 * CPUS_PER_NODE} CPUs free on 2 node(s)"
        if done.returncode != 0 or said != [expected]:
            raise RuntimeError(f"the session's Ray cluster is not back after {within:g} s: {said[0]}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def two_node_cluster(log_dir: Path, env: dict[str, str], within: float = 600) -> Iterator[Cluster]:
    """The cluster, its nodes started in `env` (authentication, DDPNB_RUNS_DIR...), their logs in `log_dir`; stops
    both nodes and everything they started.

    Both run with --block: stopping them is signalling the processes they started, by PID, never `ray stop` (which
    would stop every Ray on the machine).
    """
    temp_dir = tempfile.mkdtemp(prefix="ddpnb-ray-", dir="/tmp")  # short: Ray's unix sockets live under it
    address = f"127.0.0.1:{free_port()}"
    client = free_port()
    common = [
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={CPUS_PER_NODE}",
        "--num-gpus=0",
        f"--object-store-memory={100 * 2**20}",
        "--disable-usage-stats",
        "--include-log-monitor=false",
    ]
    head = [
        "--head",
        f"--port={address.split(':')[1]}",
        f"--ray-client-server-port={client}",
        "--include-dashboard=false",
        f"--temp-dir={temp_dir}",
    ]
    env = {**os.environ, **env, "RAY_ADDRESS": "", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    nodes: list[psutil.Process] = []
    try:
        for name, flags in (("head", head), ("node2", [f"--address={address}"])):
            start_node(nodes, [*common, *flags], log_dir / name, env=env)
        deadline = time.monotonic() + within
        while not _listening(client):  # Ray Client's server comes up after the head says it runs
            assert time.monotonic() < deadline, "the head never listened for Ray Client"
            time.sleep(0.2)
        yield Cluster(address, f"ray://127.0.0.1:{client}", [node.pid for node in nodes], env)
    finally:
        stop_nodes(nodes)
        shutil.rmtree(temp_dir, ignore_errors=True)


def start_node(
    nodes: list[psutil.Process],
    flags: list[str],
    log_stem: Path,
    env: dict[str, str],
    attempts: int = 3,
    within: float = 300,
) -> None:
    """`ray start FLAGS`, until it says the node runs. Ray gives a node's processes 30 s to come up, which a
    busy 2-core machine can overrun (the node then exits): such a start is tried again.

    Started apart from the test session (`tests.apart`)."""
    for attempt in range(attempts):
        log_path = log_stem.with_suffix(f".{attempt}.log")
        command = [
            *(sys.executable, "-m", "ray.scripts.scripts", "start", *flags),
            f"--dashboard-agent-listen-port={free_port()}",
        ]
        node = psutil.Process(start_apart(command, log_path, env, timeout=30))
        deadline = time.monotonic() + within
        while running(node) and time.monotonic() < deadline:
            if b"Ray runtime started." in log_path.read_bytes():
                nodes.append(node)
                return
            time.sleep(0.5)
        stop_nodes([node])
    raise RuntimeError(f"`ray start` failed {attempts} times:\n{log_path.read_text(errors='replace')}")


def stop_nodes(nodes: list[psutil.Process]) -> None:
    """SIGTERM each node's processes (what `ray stop` sends), SIGKILL what is left after 20 s; check none remain."""
    started = []
    for node in nodes:
        try:
            started += node.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
    for process in [*started, *nodes]:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            continue
    deadline = time.monotonic() + 20
    while (left := [process for process in [*started, *nodes] if running(process)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    deadline = time.monotonic() + 10
    while (left := [process.pid for process in [*started, *nodes] if running(process)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"still running 10 s after the Ray nodes were killed: {left}"


def running(process: psutil.Process) -> bool:
    """Whether `process` still runs (a zombie, or another process under its PID since, does not)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
