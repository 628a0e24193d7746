"""Detached runs on Ray (issue 42, acceptance 4), with real parts: a real Jupyter kernel launches a detached 2-rank
training on a local Ray instance and is SIGKILLed; the run finishes; a fresh kernel attaches by name and gets the
result; nothing of the run is left in the cluster. And the supervisor actor killed: its ranks end, the run is
listed as orphaned.

The Ray instance is local and outlives the kernels that launch and attach: ddpnb starts it in a kernel of its own
(as tests/test_ray.py's), which stays up for the module. A detached run's kernel and supervisor share the run
directory (docs/detached.md, "On Ray"): here, this machine's.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from ddpnb.core.journal.replay import Replay
from ddpnb.detached import files
from tests.conftest import Kernel, private_runs_dir, training_cell, wait_gone
from tests.test_ray import CELL_TIMEOUT, HAVE_RAY, RAY_TEST_TIMEOUT

# every kernel here: no view, Ray quiet and without token authentication (the kernels join the holder's instance)
KERNEL_ENV = {"DDPNB_VIEW": "none", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
STEPS = 60
pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.timeout(RAY_TEST_TIMEOUT),
    pytest.mark.skipif(not HAVE_RAY, reason="ray[train] is not installed (pip install -e '.[ray]')"),
]

TRAIN = training_cell(STEPS, pause=0.1)

SLEEPS = """
import ddpnb

def sleeps(rank, world_size):
    import time
    import ddpnb

    for step in range(10_000):
        ddpnb.log(step=step, beat=1.0)
        time.sleep(0.05)
"""

LEFT_OF_RUN = """
import ray
from ray.util import placement_group_table
from ddpnb.engines.ray import detach

def left_of_run(name):
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if name in a["name"]]
    groups = [g["name"] for g in placement_group_table().values() if name in g["name"] and g["state"] != "REMOVED"]
    return {"actors": actors, "groups": groups, "alive": detach.RayHome(None).alive(name)}
"""


@dataclass
class RayCluster:
    address: str  # the local instance's GCS address
    runs: Path  # the runs directory of every kernel here
    holder: Kernel  # the kernel that started the instance (Ray's processes are its children)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    with private_runs_dir(tmp_path_factory) as runs:
        holder = Kernel(env=KERNEL_ENV)
        try:
            started = holder.execute(
                "import ray\nfrom ddpnb.engines.ray import cluster\n"
                "print(cluster.connect('local', cpus=4, gpus=0))\nprint(ray.get_runtime_context().gcs_address)",
                timeout=CELL_TIMEOUT,
            )
            assert started.error is None, started.error
            yield RayCluster(started.stdout.split()[-1], runs, holder)
            holder.execute("ray.shutdown()", timeout=CELL_TIMEOUT)
        finally:
            holder.shutdown()


def _kernel(address: str) -> Kernel:
    kernel = Kernel(env=KERNEL_ENV)
    kernel.execute("%load_ext ddpnb")
    kernel.execute(f"import ray\nray.init(address={address!r}, log_to_driver=False)" + LEFT_OF_RUN)
    return kernel


def _steps_logged(run_dir: Path) -> int:
    try:
        record = Replay.read(run_dir).record
    except Exception:  # noqa: BLE001 - not written yet
        return 0
    return 0 if record is None else len(record.metrics("loss", 0))


def _kill_kernel(kernel: Kernel) -> None:
    os.kill(kernel.pid, signal.SIGKILL)
    kernel.client.stop_channels()
    try:
        kernel.manager.shutdown_kernel(now=True)
    except Exception:  # noqa: BLE001 - it is dead already: only the manager's files are left to clean
        kernel.manager.cleanup_resources()


def _ray_processes_of_run(root: int, titles: tuple[str, ...], within: float) -> list[str]:
    """Ray's processes under `root` titled one of `titles` ('ray::Supervisor', ...) still alive after `within` s."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for process in psutil.Process(root).children(recursive=True):
            try:
                title = " ".join(process.cmdline())
                if process.status() != psutil.STATUS_ZOMBIE and title.startswith(titles):
                    left.append(f"{process.pid} {title}")
            except psutil.NoSuchProcess:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _json(kernel: Kernel, code: str) -> dict:
    done = kernel.execute(code, timeout=CELL_TIMEOUT)
    assert done.error is None, "\n".join(done.error["traceback"]) + done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def stopped_through_a_handle(address: str) -> str:
    """A cell: a detached 2-rank run on Ray, listed, its stacks taken and then stopped through a second handle (as
    a later kernel's: commands go through the supervisor); what it saw, as JSON."""
    return (
        SLEEPS
        + f"""
import json, time
launched = ddpnb.launch(sleeps, nprocs=2, engine="ray", address={address!r}, detach=True)
while not all(rank.pid for rank in launched.record.ranks):
    time.sleep(0.02)
handle = ddpnb.attach(launched.name)  # another handle, as a later kernel's
states = [run.state for run in ddpnb.runs() if getattr(run, "name", None) == handle.name]
deadline = time.monotonic() + 30
while True:  # a rank forked may not have reached the function yet (a loaded box): until both are in it
    stacks = handle.stacks()
    if all("sleeps" in stack for stack in stacks.values()) and len(stacks) == 2 or time.monotonic() > deadline:
        break
    time.sleep(0.2)
handle.stop()
record = handle.wait(60)
deadline = time.monotonic() + 30
while left_of_run(handle.name)["alive"] and time.monotonic() < deadline:
    time.sleep(0.1)
print(json.dumps({{"states": states, "stacks": {{rank: "sleeps" in stack for rank, stack in stacks.items()}},
                  "outcome": record.outcome.value, "ranks": [rank.pid for rank in record.ranks],
                  "left": left_of_run(handle.name)}}))"""
    )


def assert_stopped_and_left(seen: dict) -> None:
    """What `stopped_through_a_handle` saw: listed as running, both ranks' stacks in the function, stopped, and
    nothing of the run left in the cluster."""
    assert seen["states"] == ["running"]
    assert seen["stacks"] == {"0": True, "1": True}
    assert seen["outcome"] == "stopped"
    assert wait_gone(seen["ranks"], within=10) == []
    assert seen["left"] == {"actors": [], "groups": [], "alive": False}


def test_a_detached_ray_training_outlives_its_kernels_sigkill_and_a_fresh_kernel_attaches_by_name(ray_cluster):
    address, runs, ray_root = ray_cluster.address, ray_cluster.runs, ray_cluster.holder.pid
    first = _kernel(address)
    launched = first.execute(
        f"%%ddp --engine ray -n 2 --detach --address {address} -o handle\n"
        + TRAIN.split("import ddpnb\n", 1)[1].strip()
        + "\n",
        timeout=CELL_TIMEOUT,
    )
    assert launched.error is None, "\n".join(launched.error["traceback"]) + launched.stdout + launched.stderr
    name = first.execute("print(handle.name)").stdout.strip()
    run_dir = runs / name
    supervisor = files.marker(run_dir)["pid"]
    deadline = time.monotonic() + CELL_TIMEOUT
    while _steps_logged(run_dir) < 10:
        assert time.monotonic() < deadline, "the run never reached step 10"
        time.sleep(0.05)
    _kill_kernel(first)
    assert _steps_logged(run_dir) < STEPS  # the run was cut from its kernel mid-way, not after

    second = _kernel(address)
    try:
        seen = _json(
            second,
            TRAIN
            + f"""
handle = ddpnb.attach({name!r})
value = handle.result()
record = handle.record
lines, lost, _ = handle.lines_since(0)
print(json.dumps({{
    "outcome": record.outcome.value,
    "steps": [[p.step for p in record.metrics("loss", rank)] for rank in range(2)],
    "lines": [[line.text for line in lines if line.rank == rank] for rank in range(2)], "lost": lost,
    "ranks": [rank.pid for rank in record.ranks],
    "states": [(run.name, run.state) for run in ddpnb.runs()],
}}))""",
        )
        assert seen["outcome"] == "succeeded"
        assert seen["steps"] == [list(range(STEPS))] * 2  # every step exactly once, on each rank
        for rank, lines in enumerate(seen["lines"]):  # each rank's every line, once, in order, after its node's
            assert lines[0].startswith("[ddpnb] on Ray node ")
            assert lines[1:] == [f"rank {rank} step {step}" for step in range(STEPS)]
        # the module's other tests' runs share the runs directory: this one's state is what counts here
        assert seen["lost"] == 0 and [state for state in seen["states"] if state[0] == name] == [[name, "succeeded"]]
        # nothing of the run is left: the supervisor actor, its hosts and ranks, the placement group
        assert wait_gone([supervisor, *seen["ranks"]], within=10) == []
        assert _ray_processes_of_run(ray_root, ("ray::Supervisor", "ray::Host"), within=10) == []
        left = _json(second, f"print(json.dumps(left_of_run({name!r})))")
        assert left == {"actors": [], "groups": [], "alive": False}
        same = _json(
            second,
            "import torch\nplain = ddpnb.run(train, nprocs=2, engine='ray')\n"
            "print(json.dumps({'same': value['total'] == plain['total'] == 2 * "
            f"{STEPS} and value['rank'] == plain['rank'] and torch.equal(value['weights'], plain['weights'])}}))",
        )
        assert same == {"same": True}  # rank 0's result equals that of the same training without --detach
    finally:
        second.shutdown()


def test_killing_the_supervisor_actor_ends_its_ranks_within_10_s_and_runs_says_orphaned(ray_cluster):
    address, runs, ray_root = ray_cluster.address, ray_cluster.runs, ray_cluster.holder.pid
    kernel = _kernel(address)
    try:
        started = _json(
            kernel,
            SLEEPS
            + f"""
import json, time
handle = ddpnb.launch(sleeps, nprocs=2, engine="ray", address={address!r}, detach=True)
while not all(rank.pid for rank in handle.record.ranks):
    time.sleep(0.02)
print(json.dumps({{"name": handle.name, "ranks": [rank.pid for rank in handle.record.ranks],
                  "alive": detach.RayHome(None).alive(str(handle.run_dir))}}))""",
        )
        assert started["alive"] is True
        supervisor = files.marker(runs / started["name"])["pid"]
        kernel.execute("ray.kill(ray.get_actor(detach.actor_name(str(handle.run_dir)), namespace=detach.NAMESPACE))")
        killed = time.monotonic()
        assert wait_gone([supervisor], within=10) == []
        assert wait_gone(started["ranks"], within=10 - (time.monotonic() - killed)) == []  # within 10 s of the kill
        assert _ray_processes_of_run(ray_root, ("ray::Supervisor", "ray::Host"), within=10) == []
        after = _json(
            kernel,
            "print(json.dumps({'runs': [(run.name, run.state) for run in ddpnb.runs()], "
            "'left': left_of_run(handle.name), 'orphaned': handle.orphaned}))",
        )
        assert [started["name"], "orphaned"] in after["runs"] and after["orphaned"] is True
        assert after["left"] == {"actors": [], "groups": [], "alive": False}
    finally:
        kernel.shutdown()


def test_a_running_ray_run_is_listed_answers_stacks_and_stops_through_its_door_then_its_actor_leaves(ray_cluster):
    address, ray_root = ray_cluster.address, ray_cluster.holder.pid
    kernel = _kernel(address)
    try:
        seen = _json(
            kernel,
            stopped_through_a_handle(address),
        )
        assert_stopped_and_left(seen)
        assert _ray_processes_of_run(ray_root, ("ray::Supervisor", "ray::Host"), within=10) == []
    finally:
        kernel.shutdown()


def test_detach_on_the_ray_instance_that_ends_with_its_kernel_is_refused_saying_why(ray_cluster):
    runs_before = sorted(ray_cluster.runs.iterdir())
    refused = ray_cluster.holder.execute(
        """
import ddpnb
def quick(rank, world_size):
    return rank
for address in (None, "local"):  # the kernel's own local instance, by default and by name
    try:
        ddpnb.launch(quick, nprocs=2, engine="ray", address=address, detach=True)
    except ddpnb.LaunchError as exc:
        print(exc)
print(ray.util.list_named_actors(all_namespaces=True))
""",
        timeout=CELL_TIMEOUT,
    )
    assert refused.error is None, refused.error
    said = refused.stdout.splitlines()
    assert said[:2] == [said[0]] * 2 and "needs a cluster that outlives this kernel" in said[0], refused.stdout
    assert "ray start --head" in said[0] and "leave out detach" in said[0]
    assert "ddpnb-supervisor-" not in said[2]  # no actor was started
    # a refused launch leaves no run directory behind (the plan written for the supervisor included)
    assert sorted(ray_cluster.runs.iterdir()) == runs_before
