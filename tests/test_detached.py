"""Detached runs (issue 42) on the local engine, with real parts: a real Jupyter kernel SIGKILLed mid-training and a
fresh one attaching, the supervisor SIGKILLed, and strangers at its door."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import cloudpickle
import psutil
import pytest

import ddpnb
from ddpnb.core.journal.replay import Replay
from ddpnb.detached import files
from tests.conftest import Kernel, private_runs_dir, training_cell, wait_gone

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 300

TRAIN = training_cell(STEPS, pause=0.02)


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


@pytest.mark.skipif(os.geteuid() != 0, reason="making a run directory another user's takes root (os.chown)")
def test_a_second_users_attach_is_refused_saying_whose_run_it_is(tmp_path_factory):
    """The run directory of another user (made so as root, with os.chown: a second user's Python cannot run here,
    its installation being in root's 0700 home): attaching to it by name or path is refused, and this user's
    listing does not show it."""
    with private_runs_dir(tmp_path_factory):
        handle = _detached(quick)
        assert handle.result() == 0
        for path in (handle.run_dir, *handle.run_dir.iterdir()):
            os.chown(path, 65534, 65534)
        for which in (handle.name, str(handle.run_dir)):
            with pytest.raises(
                PermissionError, match=r"is user 'nobody' \(uid 65534\)'s run: only the user who launched"
            ):
                ddpnb.attach(which)
        assert ddpnb.runs() == []
        with pytest.raises(LookupError, match="there is no detached run"):
            ddpnb.attach("last")


def test_detach_refuses_what_it_cannot_do_saying_why():
    with pytest.raises(ddpnb.LaunchError, match="debug"):
        ddpnb.launch(quick, detach=True, debug=True)


def quick(rank, world_size):
    return rank


RESTARTED_STEPS = 150
COUNTS = """
def counts(rank, world_size, steps):
    import time
    import torch
    import torch.distributed as dist
    import ddpnb

    total = torch.zeros(1)
    for step in range(steps):
        one = torch.ones(1)
        dist.all_reduce(one)
        total += one
        ddpnb.log(step=step, loss=1.0 / (step + 1))
        print(f"rank {rank} step {step}", flush=True)
        time.sleep(0.05)
    return {"rank": rank, "total": total.item()}
"""


def test_a_detached_run_outlives_a_kernel_restart_and_its_result_is_collected_after_it_ended_unwatched(
    tmp_path_factory,
):
    with private_runs_dir(tmp_path_factory) as runs:
        kernel = Kernel(env={"DDPNB_VIEW": "none"})
        try:
            launched = kernel.execute(
                f"import ddpnb\n{COUNTS}\nhandle = ddpnb.launch(counts, nprocs=2, args=({RESTARTED_STEPS},), "
                "detach=True)\nprint(handle.name)"
            )
            assert launched.error is None, launched.error
            run_dir = runs / launched.stdout.strip().splitlines()[-1]
            supervisor = files.marker(run_dir)["pid"]
            before = kernel.pid
            while _steps_logged(run_dir) < 10:
                time.sleep(0.05)
            # Jupyter's "Restart kernel": a shutdown request with restart, the kernel's atexit handlers run
            kernel.manager.restart_kernel(now=False)
            kernel.client.wait_for_ready(timeout=60)
            assert kernel.pid != before and wait_gone([before], within=10) == []
            assert files.ended(run_dir) is None and files.supervised(run_dir), _steps_logged(run_dir)  # it goes on
            deadline = time.monotonic() + 60
            while files.ended(run_dir) is None:  # it ends with no kernel attached
                assert time.monotonic() < deadline, (run_dir / files.LOG).read_text()
                time.sleep(0.1)
            assert wait_gone([supervisor], within=10) == []
            collected = kernel.execute(
                """
import json, ddpnb
handle = ddpnb.attach("last")
value = handle.result()
lines, lost, _ = handle.lines_since(0)
print(json.dumps({"name": handle.name, "value": value, "lost": lost,
                  "lines": [[line.text for line in lines if line.rank == rank] for rank in range(2)],
                  "steps": [[p.step for p in handle.record.metrics("loss", rank)] for rank in range(2)]}))"""
            )
            assert collected.error is None, collected.error
            seen = json.loads(collected.stdout.strip().splitlines()[-1])
        finally:
            kernel.shutdown()
        assert seen == {
            "name": run_dir.name,
            "value": {"rank": 0, "total": 2.0 * RESTARTED_STEPS},
            "lost": 0,
            "lines": [[f"rank {rank} step {step}" for step in range(RESTARTED_STEPS)] for rank in range(2)],
            "steps": [list(range(RESTARTED_STEPS))] * 2,  # every step exactly once, on each rank
        }


@pytest.fixture(scope="module")
def viewers(tmp_path_factory):
    """Two kernels drawing dashboards (as JupyterLab's do), sharing one runs directory."""
    with private_runs_dir(tmp_path_factory):
        with ThreadPoolExecutor(2) as pool:
            kernels = list(pool.map(lambda _: Kernel(env={"DDPNB_VIEW": "widget"}), range(2)))
        try:
            for kernel in kernels:
                assert kernel.execute("import ddpnb, json, time\n" + SLEEPS).error is None
            yield kernels
        finally:
            for kernel in kernels:
                kernel.shutdown()


SLEEPS = """
def sleeps(rank, world_size):
    import time
    import ddpnb

    for step in range(10_000):
        ddpnb.log(step=step, beat=1.0)
        time.sleep(0.05)
"""
WIDGET = "application/vnd.jupyter.widget-view+json"


def _displayed_live(kernel: Kernel, cell: str, within: float = 2.0) -> tuple[dict, int]:
    """Run `cell`, which displays a run's handle: the dashboard it drew (its bundle), and how many updates its
    widgets got from the kernel in the `within` seconds after the cell returned."""
    shown = kernel.execute(cell)
    assert shown.error is None, shown.error
    bundles = [m["content"]["data"] for m in shown.outputs if m["msg_type"] == "display_data"]
    assert len(bundles) == 1 and WIDGET in bundles[0], shown.outputs
    widgets = {m["content"]["comm_id"] for m in shown.outputs if m["msg_type"] == "comm_open"}
    assert bundles[0][WIDGET]["model_id"] in widgets  # a dashboard of its own, not the launch's
    updates, deadline = 0, time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = kernel.client.get_iopub_msg(timeout=left)
        except queue.Empty:
            break
        content = message["content"]
        if message["msg_type"] == "comm_msg" and content["comm_id"] in widgets:
            updates += content["data"].get("method") == "update"
    return bundles[0], updates


@pytest.mark.parametrize("detach", [False, True], ids=["launched", "detached"])
def test_displaying_a_live_runs_handle_in_a_new_cell_draws_its_live_dashboard_again(viewers, detach):
    kernel, _ = viewers
    launched = kernel.execute(f"handle = ddpnb.launch(sleeps, nprocs=2, detach={detach})")
    assert launched.error is None, launched.error
    try:
        for _ in range(2):  # a browser reload loses the launch's cell output: each new cell draws one
            bundle, updates = _displayed_live(kernel, "handle")
            assert "still running when this notebook was saved" in bundle["text/plain"]
            assert updates >= 2  # live: its header's clock, the ranks' steps, the curves
    finally:
        stopped = kernel.execute("handle.stop(); print(handle.record.outcome.value)")
    assert stopped.error is None and stopped.stdout.split() == ["stopped"], (stopped.error, stopped.text)
    ended = kernel.execute("handle")
    assert ended.error is None
    if detach:  # an attached run's summary, its whole history (the kernel that attaches may be a new one)
        assert any(m["msg_type"] == "update_display_data" and "stopped" in str(m["content"]) for m in ended.outputs)
    else:  # its one-line status: the launch's cell holds its summary
        assert "stopped" in ended.results[0] and not any(m["msg_type"] == "comm_open" for m in ended.outputs)


def test_two_kernels_attached_at_once_both_see_new_steps_arrive_live(viewers):
    kernels = viewers
    handle = _detached()
    follow = f"""
attached = ddpnb.attach({handle.name!r})
before = len(attached.record.metrics("beat", 0))
time.sleep(1.5)
print(json.dumps([before, len(attached.record.metrics("beat", 0)), attached.done]))"""
    try:
        with ThreadPoolExecutor(2) as pool:  # both at once
            seen = list(pool.map(lambda kernel: kernel.execute(follow), kernels))
        assert [s.error for s in seen] == [None, None], seen
        counts = [json.loads(s.stdout.strip().splitlines()[-1]) for s in seen]
        assert all(after >= before + 10 and not done for before, after, done in counts), counts  # 20 steps/s
        with ThreadPoolExecutor(2) as pool:
            drawn = list(pool.map(lambda kernel: _displayed_live(kernel, "attached"), kernels))
        assert all(updates >= 2 for _, updates in drawn), drawn
    finally:
        handle.stop()
    ends = [kernel.execute("print(attached.wait(10).outcome.value, attached.done)") for kernel in kernels]
    assert [end.stdout.split() for end in ends] == [["stopped", "True"]] * 2


def _standbys(kernel: Kernel, supervisors: list[int]) -> list[int]:
    """Supervisors waiting for the kernel's next detached launch, seen from outside: children of the kernel's
    forkserver that left its session, other than the running `supervisors`."""
    found = []
    for server in psutil.Process(kernel.pid).children():
        try:
            session = os.getsid(server.pid)
            found += [
                child.pid
                for child in server.children()
                if child.pid not in supervisors and os.getsid(child.pid) != session and child.is_running()
            ]
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


def _one_standby(kernel: Kernel, supervisors: list[int]) -> int:
    deadline = time.monotonic() + 30
    while len(found := _standbys(kernel, supervisors)) != 1:
        assert time.monotonic() < deadline, found
        time.sleep(0.05)
    return found[0]


def test_the_next_detached_launch_goes_to_a_standby_that_ordinary_runs_spare_and_that_ends_with_its_kernel(
    tmp_path_factory,
):
    with private_runs_dir(tmp_path_factory) as runs:
        kernel = Kernel(env={"DDPNB_VIEW": "none"})
        try:
            launched = kernel.execute(
                f"import ddpnb\n{COUNTS}\nfirst = ddpnb.launch(counts, nprocs=2, args=(100,), detach=True)"
            )
            assert launched.error is None, launched.error
            first = files.marker(next(runs.iterdir()))["pid"]
            standby = _one_standby(kernel, [first])
            # an ordinary run's orphan sweep, while both live, ends neither: they left the forkserver's session
            beside = kernel.execute("print(ddpnb.run(counts, nprocs=2, args=(2,))['total'], first.result()['total'])")
            assert beside.error is None, beside.error
            assert beside.stdout.split()[-2:] == ["4.0", "200.0"]
            second = kernel.execute(
                "second = ddpnb.launch(counts, nprocs=2, args=(2,), detach=True)\nprint(second.name)"
            )
            assert second.error is None, second.error
            assert files.marker(runs / second.stdout.split()[-1])["pid"] == standby  # the run went to the standby
            assert wait_gone([first], within=10) == []
            standby = _one_standby(kernel, [standby])
            os.kill(standby, signal.SIGKILL)  # a standby gone meanwhile: the next launch forks a supervisor now
            assert wait_gone([standby], within=5) == []
            third = kernel.execute("print(ddpnb.launch(counts, nprocs=2, args=(3,), detach=True).result()['total'])")
            assert third.error is None, third.error
            assert third.stdout.split()[-1] == "6.0"
            standby = _one_standby(kernel, [])
            ready = [standby, *(child.pid for child in psutil.Process(standby).children())]  # and its forkserver
            assert len(ready) == 2
        finally:
            _kill_kernel(kernel)
        assert wait_gone(ready, within=10) == []  # it ends with the kernel that would have handed it a run
