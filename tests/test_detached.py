"""Detached runs (issue 42) on the local engine, with real parts: a real Jupyter kernel SIGKILLed mid-training and a
fresh one attaching, the supervisor SIGKILLed, and strangers at its door."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import cloudpickle
import pytest

import ddpnb
from ddpnb.core.journal.replay import Replay
from ddpnb.detached import files
from tests.conftest import Kernel, private_runs_dir, wait_gone

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 300

TRAIN = f"""
import json
import ddpnb

def train(rank, world_size):
    import time
    import torch
    import torch.distributed as dist
    import ddpnb

    total = torch.zeros(1)
    for step in range({STEPS}):
        one = torch.ones(1)
        dist.all_reduce(one)
        total += one
        ddpnb.log(step=step, loss=1.0 / (step + 1))
        print(f"rank {{rank}} step {{step}}", flush=True)
        time.sleep(0.02)
    return {{"rank": rank, "total": total.item(), "weights": torch.arange(4.0) * total}}
"""


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


def test_a_detached_training_outlives_its_kernels_sigkill_and_a_fresh_kernel_attaches(tmp_path_factory):
    with private_runs_dir(tmp_path_factory) as runs:
        first = Kernel(env={"DDPNB_VIEW": "none"})
        launched = first.execute(TRAIN + "handle = ddpnb.launch(train, nprocs=2, detach=True)\nprint(handle.name)")
        assert launched.error is None, launched.error
        run_dir = runs / launched.stdout.strip().splitlines()[-1]
        supervisor = files.marker(run_dir)["pid"]
        deadline = time.monotonic() + 60
        while _steps_logged(run_dir) < 100:  # near step 100: the kernel dies
            assert time.monotonic() < deadline, "the run never reached step 100"
            time.sleep(0.05)
        _kill_kernel(first)
        assert _steps_logged(run_dir) < STEPS  # the run was cut mid-way from its kernel, not after
        second = Kernel(env={"DDPNB_VIEW": "none"})
        try:
            attached = second.execute(
                TRAIN
                + """
import torch
handle = ddpnb.attach("last")
value = handle.result()
record = handle.record
lines, lost, _ = handle.lines_since(0)
plain = ddpnb.run(train, nprocs=2)
print(json.dumps({
    "name": handle.name, "outcome": record.outcome.value,
    "steps": [[p.step for p in record.metrics("loss", rank)] for rank in range(2)],
    "lines": [[line.text for line in lines if line.rank == rank] for rank in range(2)], "lost": lost,
    "same": value["total"] == plain["total"] and value["rank"] == plain["rank"]
            and torch.equal(value["weights"], plain["weights"]),
    "ranks": [rank.pid for rank in record.ranks],
    "states": [str(run.state) for run in ddpnb.runs()],
}))""",
                timeout=180,
            )
            assert attached.error is None, attached.error
            seen = json.loads(attached.stdout.strip().splitlines()[-1])
        finally:
            second.shutdown()
        assert seen["name"] == run_dir.name and seen["outcome"] == "succeeded"
        assert seen["steps"] == [list(range(STEPS))] * 2  # every step exactly once, on each rank
        assert seen["lines"] == [[f"rank {rank} step {step}" for step in range(STEPS)] for rank in range(2)]
        assert seen["lost"] == 0 and seen["same"] is True
        assert seen["states"] == ["succeeded"]
        # nothing of the run is left: the supervisor, its forkserver and its ranks
        assert wait_gone([supervisor, *seen["ranks"]], within=10) == []
        assert (run_dir / files.RESULT).exists() and files.ended(run_dir)["outcome"] == "succeeded"


def sleeps(rank, world_size):
    import time

    import ddpnb

    for step in range(10_000):
        ddpnb.log(step=step, beat=1.0)
        time.sleep(0.05)


def _detached(function=sleeps):
    handle = ddpnb.launch(function, nprocs=2, view="none", detach=True)
    deadline = time.monotonic() + 30
    while not all(rank.pid for rank in handle.record.ranks):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return handle


def test_the_supervisors_sigkill_ends_every_rank_within_10_s_and_runs_says_orphaned(tmp_path_factory):
    with private_runs_dir(tmp_path_factory):
        handle = _detached()
        ranks = [rank.pid for rank in handle.record.ranks]
        supervisor = files.marker(handle.run_dir)["pid"]
        os.kill(supervisor, signal.SIGKILL)
        assert wait_gone([supervisor], within=5) == []
        assert wait_gone(ranks, within=10) == []
        assert [(run.name, run.state) for run in ddpnb.runs()] == [(handle.name, "orphaned")]
        assert handle.wait(10) is handle.record and handle.orphaned and "orphaned" in handle.status
        with pytest.raises(RuntimeError, match="supervisor is gone"):
            handle.result()


def test_the_door_refuses_a_stranger_and_logs_it_and_the_secret_holder_stops_the_run(tmp_path_factory):
    with private_runs_dir(tmp_path_factory):
        handle = _detached()
        run_dir = handle.run_dir
        secret = (run_dir / files.SECRET).read_bytes()
        assert (run_dir / files.SECRET).stat().st_mode & 0o777 == 0o600
        supervisor = files.marker(run_dir)["pid"]
        for what in ("environ", "cmdline"):  # never in an environment or a command line
            assert secret not in Path(f"/proc/{supervisor}/{what}").read_bytes()
        where = json.loads((run_dir / files.DOOR).read_text())
        with pytest.raises(AuthenticationError):
            Client((where["host"], where["port"]), authkey=b"not the secret")
        with socket.create_connection((where["host"], where["port"])) as stranger:  # no challenge answered
            stranger.sendall(b"\0\0\0\x05hello")
        deadline = time.monotonic() + 10
        while (run_dir / files.LOG).read_text().count("refused a connection") < 2:
            assert time.monotonic() < deadline, (run_dir / files.LOG).read_text()
            time.sleep(0.05)
        assert "running" in files.ask(run_dir, "status")  # the run goes on for its holders
        stacks = handle.stacks()
        assert sorted(stacks) == [0, 1] and all("sleeps" in stack for stack in stacks.values())
        handle.stop()
        record = handle.wait(30)
        assert record.outcome is ddpnb.Outcome.STOPPED and handle.done
        assert wait_gone([supervisor], within=10) == []


def test_attach_to_what_is_not_there_lists_the_runs_there_are(tmp_path_factory):
    with private_runs_dir(tmp_path_factory):
        with pytest.raises(LookupError, match="there is no detached run"):
            ddpnb.attach("last")
        handle = _detached(quick)
        assert handle.result() == 0
        with pytest.raises(LookupError, match=f"The detached runs there are: {handle.name} \\(succeeded\\)"):
            ddpnb.attach("no-such-run")
        again = ddpnb.attach(handle.name)
        assert again.result() == 0 and again.record.outcome is ddpnb.Outcome.SUCCEEDED


def test_detach_refuses_what_it_cannot_do_saying_why():
    with pytest.raises(ddpnb.LaunchError, match="debug"):
        ddpnb.launch(quick, detach=True, debug=True)


def quick(rank, world_size):
    return rank
