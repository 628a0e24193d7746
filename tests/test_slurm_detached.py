"""Detached runs on Slurm (issue 42, acceptance 3), against the real two-node Slurm of `tests/slurm_cluster.py`.

From a login node (no SLURM_JOB_ID), `--detach` runs the supervisor as a batch job of its own; the kernel that
launched it is SIGKILLed, the job goes on and finishes, and a fresh kernel attaches and collects the result. The
supervisor's own death (SIGKILL, or its job cancelled) ends every rank within 10 s and the run is listed orphaned.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import pytest

import ddpnb
from ddpnb.detached import files
from ddpnb.engines.slurm import detach
from tests.conftest import Kernel, private_runs_dir, wait_gone
from tests.test_detached import _kill_kernel, _steps_logged
from tests.test_faults import Cell
from tests.test_slurm import ddpnb_jobs, ranks_left

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 150
CELL_TIMEOUT = 300

TRAIN = f"""
import json, os
import ddpnb

def train(rank, world_size):
    import time
    import torch
    import torch.distributed as dist
    import ddpnb

    torch.manual_seed(0)
    weights = torch.zeros(4)
    for step in range({STEPS}):
        grad = torch.randn(4) * (rank + 1)
        dist.all_reduce(grad)
        weights -= 0.01 * grad
        ddpnb.log(step=step, loss=float(weights.norm()))
        print(f"rank {{rank}} step {{step}}", flush=True)
        time.sleep(0.05)
    return {{"rank": rank, "weights": weights, "node": os.environ["SLURMD_NODENAME"]}}
"""


@pytest.fixture
def login_node(cluster, monkeypatch, tmp_path_factory):
    """This process and the kernels it starts as on a login node: the cluster's commands reach Slurm, no
    SLURM_JOB_ID, a runs directory of the test's own (on /tmp, which the cluster's nodes, this host, share)."""
    for name in [name for name in os.environ if name.startswith("SLURM_JOB")]:
        monkeypatch.delenv(name)
    for name, value in {**cluster.env, "DDPNB_SLURM_KEEP_JOB": "0"}.items():
        monkeypatch.setenv(name, value)
    with private_runs_dir(tmp_path_factory) as runs:
        yield runs
    assert ddpnb_jobs(cluster, within=20) == []
    assert ranks_left() == []


def test_a_detached_slurm_training_outlives_its_kernels_sigkill_and_a_new_kernel_collects_its_result(
    cluster, login_node, capfd
):
    """The job is held in the queue first: the launch says so with the job's state, and starts when it runs;
    meanwhile the run is listed as queued, and an attach waits for it, saying so."""
    first = Kernel(env={"DDPNB_VIEW": "none"})
    cell = Cell(
        first,
        TRAIN + "handle = ddpnb.launch(train, engine='slurm', nprocs=2, nodes=2, job_args='--hold', detach=True)\n"
        "print('NAME', handle.name)",
    )
    said = cell.read_until(lambda out: "pending (JobHeldUser)" in out.stderr, timeout=60)
    run_dir = next(login_node.iterdir())
    job = (run_dir / detach.JOB).read_text()
    assert f"waits in the queue: slurm job {job} pending (JobHeldUser)" in said.stderr, said.text
    assert [(run.name, run.state) for run in ddpnb.runs()] == [(run_dir.name, "queued")]
    assert f"slurm job {job} pending (JobHeldUser)" in ddpnb.runs()[0].progress
    with ThreadPoolExecutor(1) as pool:
        attaching = pool.submit(ddpnb.attach, run_dir.name)
        deadline, err = time.monotonic() + 30, ""
        while f"{run_dir.name} waits in the queue: slurm job {job} pending" not in (
            err := err + capfd.readouterr().err
        ):
            assert time.monotonic() < deadline and not attaching.done(), (err, attaching.done() and attaching.result())
            time.sleep(0.1)
        assert not attaching.done()
        cluster.run("scontrol", "release", job)
        launched = cell.finish(timeout=CELL_TIMEOUT)
        assert launched.error is None, launched.text
        assert f"NAME {run_dir.name}" in launched.stdout
        early = attaching.result(timeout=60)  # once the job runs and its supervisor started the ranks
        assert early.name == run_dir.name and early.record.world_size == 2
        early.leave()
    supervisor = files.marker(run_dir)["pid"]
    deadline = time.monotonic() + 120
    while _steps_logged(run_dir) < 30:
        assert time.monotonic() < deadline, "the run never reached step 30"
        time.sleep(0.1)
    _kill_kernel(first)
    assert _steps_logged(run_dir) < STEPS  # cut mid-way from its kernel
    assert [line.split()[0] for line in ddpnb_jobs(cluster)] == [job]  # the job stays, running
    time.sleep(1)
    assert "RUNNING" in ddpnb_jobs(cluster)[0]
    second = Kernel(env={"DDPNB_VIEW": "none"})
    try:
        attached = second.execute(
            TRAIN
            + """
import torch
handle = ddpnb.attach("last")
value = handle.result()
record = handle.record
plain = ddpnb.run(train, engine="slurm", nprocs=2, nodes=2)
print(json.dumps({
    "name": handle.name, "outcome": record.outcome.value,
    "steps": [[p.step for p in record.metrics("loss", rank)] for rank in range(2)],
    "nodes": sorted(rank.node for rank in record.ranks),
    "same": value["rank"] == plain["rank"] and torch.equal(value["weights"], plain["weights"]),
    "ranks": [rank.pid for rank in record.ranks],
    "states": [str(run.state) for run in ddpnb.runs()],
}))""",
            timeout=CELL_TIMEOUT,
        )
        assert attached.error is None, attached.text
        seen = json.loads(attached.stdout.strip().splitlines()[-1])
    finally:
        second.shutdown()
    assert seen["name"] == run_dir.name and seen["outcome"] == "succeeded"
    assert seen["steps"] == [list(range(STEPS))] * 2 and seen["nodes"] == ["n1", "n2"]
    assert seen["same"] is True and seen["states"] == ["succeeded"]
    assert wait_gone([supervisor, *seen["ranks"]], within=10) == []
    assert files.ended(run_dir)["outcome"] == "succeeded" and not files.supervised(run_dir)


def sleeps(rank, world_size):
    import time

    import ddpnb

    for step in range(10_000):
        ddpnb.log(step=step, beat=1.0)
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["sigkill", "scancel"])
def test_the_supervisors_end_ends_every_rank_within_10_s_and_runs_says_orphaned(cluster, login_node, how):
    handle = ddpnb.launch(sleeps, engine="slurm", nprocs=2, nodes=2, view="none", detach=True)
    deadline = time.monotonic() + 60
    while not all(rank.pid for rank in handle.record.ranks):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ranks = [rank.pid for rank in handle.record.ranks]
    assert sorted(rank.node for rank in handle.record.ranks) == ["n1", "n2"]
    supervisor = files.marker(handle.run_dir)["pid"]
    assert files.supervised(handle.run_dir) and "running" in ddpnb.runs()[0].progress
    if how == "sigkill":
        os.kill(supervisor, signal.SIGKILL)
    else:
        cluster.run("scancel", (handle.run_dir / detach.JOB).read_text())
    assert wait_gone([supervisor, *ranks], within=10) == []
    assert ranks_left(within=10) == []  # the nodes' hosts and srun too
    assert ddpnb_jobs(cluster, within=10) == []
    assert [(run.name, run.state) for run in ddpnb.runs()] == [(handle.name, "orphaned")]
    assert handle.wait(10) is handle.record and handle.orphaned


def test_a_stop_whose_door_cannot_be_reached_cancels_the_batch_job(cluster, login_node):
    """A kernel that cannot reach the supervisor's door (here: its file names a port nobody listens on, as from a
    machine the batch host's address does not route to) stops the run with `scancel` of its job instead."""
    handle = ddpnb.launch(sleeps, engine="slurm", nprocs=2, nodes=2, view="none", detach=True)
    deadline = time.monotonic() + 60
    while not all(rank.pid for rank in handle.record.ranks):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ranks, supervisor = [rank.pid for rank in handle.record.ranks], files.marker(handle.run_dir)["pid"]
    door = json.loads((handle.run_dir / files.DOOR).read_text())
    with socket.socket() as closed:
        closed.bind((door["host"], 0))
        door["port"] = closed.getsockname()[1]  # bound, never listening: a connection there is refused
        (handle.run_dir / files.DOOR).write_text(json.dumps(door))
        handle.stop()
    assert wait_gone([supervisor, *ranks], within=10) == []
    assert ddpnb_jobs(cluster, within=10) == []


def test_inside_an_allocation_the_supervisor_is_a_process_of_the_kernels_node_and_no_job_is_asked_for(
    cluster, login_node
):
    job = cluster.allocate(nodes=2, tasks=2, name="ddpnb-tests")
    kernel = Kernel(env={"DDPNB_VIEW": "none", "SLURM_JOB_ID": job})
    try:
        ran = kernel.execute(
            TRAIN
            + """
handle = ddpnb.launch(train, engine="slurm", nprocs=2, nodes=2, detach=True)
value = handle.result()
print(json.dumps({"name": handle.name, "rank": value["rank"],
                  "nodes": sorted(rank.node for rank in handle.record.ranks),
                  "ranks": [rank.pid for rank in handle.record.ranks]}))""",
            timeout=CELL_TIMEOUT,
        )
        assert ran.error is None, ran.text
        seen = json.loads(ran.stdout.strip().splitlines()[-1])
    finally:
        kernel.shutdown()
        cluster.run("scancel", job)
    run_dir = login_node / seen["name"]
    assert seen["rank"] == 0 and seen["nodes"] == ["n1", "n2"]
    assert not (run_dir / detach.JOB).exists()  # no batch job: a process of this node
    assert files.ended(run_dir)["outcome"] == "succeeded"
    assert wait_gone([files.marker(run_dir)["pid"], *seen["ranks"]], within=10) == []
