"""Detached runs on Ray through Ray Client (`ray://`, issue 42): the kernel does not see the supervisor's run
directory, so the supervisor actor keeps it on its node and serves it (docs/detached.md, "On Ray"). Real parts: a
Ray cluster started with `ray start --head --ray-client-server-port` (the session's: tests/conftest.py `local_ray`),
whose nodes keep their run directories apart from the kernels' (another DDPNB_RUNS_DIR), real Jupyter kernels
connected with `ray://`, a 2-rank training.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddpnb.core.journal.replay import Replay
from tests.conftest import Kernel, private_runs_dir, training_cell, wait_gone
from tests.test_ray import CELL_TIMEOUT, HAVE_RAY, RAY_TEST_TIMEOUT
from tests.test_ray_detached import (
    KERNEL_ENV,
    LEFT_OF_RUN,
    _json,
    _kill_kernel,
    assert_stopped_and_left,
    stopped_through_a_handle,
)

STEPS = 60
TRAIN = training_cell(STEPS, pause=0.1)
pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.timeout(RAY_TEST_TIMEOUT),
    pytest.mark.skipif(not HAVE_RAY, reason="ray[train] is not installed (pip install -e '.[ray]')"),
]


@dataclass
class ClientCluster:
    address: str  # ray://127.0.0.1:PORT
    runs: Path  # the kernels' runs directory
    node_runs: Path  # the cluster node's: where served runs live


@pytest.fixture(scope="module")
def client_cluster(ray_start_cluster, tmp_path_factory) -> Iterator[ClientCluster]:
    with private_runs_dir(tmp_path_factory) as runs:
        yield ClientCluster(ray_start_cluster.client_address, runs, ray_start_cluster.node_runs)


def _kernel(address: str, connect: bool) -> Kernel:
    kernel = Kernel(env=KERNEL_ENV)
    kernel.execute("%load_ext ddpnb")
    connected = kernel.execute(
        ("import ray\n" + (f"ray.init(address={address!r})\n" if connect else "")) + LEFT_OF_RUN, timeout=CELL_TIMEOUT
    )
    assert connected.error is None, connected.error
    return kernel


def _steps_in(kernel: Kernel) -> int:
    done = kernel.execute("print(len(handle.record.metrics('loss', 0)))", timeout=CELL_TIMEOUT)
    assert done.error is None, done.error
    return int(done.stdout.split()[-1])


def test_a_detached_training_launched_through_ray_client_outlives_its_kernel_and_a_fresh_client_attaches(
    client_cluster,
):
    address, runs, node_runs = client_cluster.address, client_cluster.runs, client_cluster.node_runs
    first = _kernel(address, connect=False)
    launched = first.execute(
        f"%%ddp --engine ray -n 2 --detach --address {address} -o handle\n"
        + TRAIN.split("import ddpnb\n", 1)[1].strip()
        + "\n",
        timeout=CELL_TIMEOUT,
    )
    assert launched.error is None, "\n".join(launched.error["traceback"]) + launched.stdout + launched.stderr
    name = first.execute("print(handle.name)").stdout.strip()
    # the kernel keeps nothing: the run lives on the actor's node, in a runs directory the kernel does not look in
    assert list(runs.iterdir()) == [] and (node_runs / name / "journal").is_file()
    deadline = time.monotonic() + CELL_TIMEOUT
    while _steps_in(first) < 10:  # the launching kernel follows it live, from the journal the actor serves
        assert time.monotonic() < deadline, "the launching kernel never saw step 10"
        time.sleep(0.2)
    _kill_kernel(first)
    assert len(Replay.read(node_runs / name).record.metrics("loss", 0)) < STEPS  # cut from its kernel mid-way

    second = _kernel(address, connect=True)
    try:
        seen = _json(
            second,
            TRAIN
            + f"""
import time, torch
listed = [(run.name, run.state) for run in ddpnb.runs()]
handle = ddpnb.attach({name!r})
value = handle.result()
record = handle.record
lines, lost, _ = handle.lines_since(0)
deadline = time.monotonic() + 30
while left_of_run({name!r})["alive"] and time.monotonic() < deadline:  # collected: the actor leaves
    time.sleep(0.1)
plain = ddpnb.run(train, nprocs=2)  # the same training without --detach (on this kernel's machine)
print(json.dumps({{
    "listed": listed, "outcome": record.outcome.value,
    "steps": [[p.step for p in record.metrics("loss", rank)] for rank in range(2)],
    "lines": [[line.text for line in lines if line.rank == rank] for rank in range(2)], "lost": lost,
    "ranks": [rank.pid for rank in record.ranks], "left": left_of_run({name!r}),
    "same": value["total"] == plain["total"] == 2 * {STEPS} and value["rank"] == plain["rank"]
    and torch.equal(value["weights"], plain["weights"]),
}}))""",
        )
        assert [entry for entry in seen["listed"] if entry[0] == name] in ([[name, "running"]], [[name, "succeeded"]])
        assert seen["outcome"] == "succeeded"
        assert seen["steps"] == [list(range(STEPS))] * 2  # every step exactly once, replayed from step 0, then live
        for rank, lines in enumerate(seen["lines"]):
            assert lines[0].startswith("[ddpnb] on Ray node ")
            assert lines[1:] == [f"rank {rank} step {step}" for step in range(STEPS)]
        assert seen["lost"] == 0 and seen["same"] is True
        assert wait_gone(seen["ranks"], within=10) == []
        assert seen["left"] == {"actors": [], "groups": [], "alive": False}  # the actor left once collected
        assert (node_runs / name / "result.pickle").is_file()  # the run directory stays on its node
    finally:
        second.shutdown()


def test_a_run_served_through_ray_client_is_listed_answers_stacks_and_stops_then_its_actor_leaves(client_cluster):
    address = client_cluster.address
    kernel = _kernel(address, connect=False)
    try:
        seen = _json(
            kernel,
            stopped_through_a_handle(address),
        )
        assert_stopped_and_left(seen)
    finally:
        kernel.shutdown()
