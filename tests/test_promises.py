"""README promises the other files leave untested, each pinned by a real run (issue 19).

`ddpnb.spawn`'s join semantics, every rank's environment and CPU threads, what comes back from rank 0, user code
asking for NCCL on CPU ranks, the 10,000- and 500-character line cuts, the runs directory's checks, and a kernel
that keeps its variables after a failed run.

Worker functions live at module level; this module is pickled by value (as a notebook's functions are), so the
ranks never import it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import cloudpickle
import psutil
import pytest

import ddpnb
from ddpnb.core.run import Run
from tests.conftest import Kernel

cloudpickle.register_pickle_by_value(sys.modules[__name__])

USABLE_CORES = len(os.sched_getaffinity(0))
# the bound on a run that only waits for the test's go-ahead: the behaviour is "returns", not "returns quickly";
# minutes, because a busy 2-core machine starts ranks slowly
JOIN_TIMEOUT = 300


@pytest.fixture(autouse=True)
def private_runs_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPNB_RUNS_DIR", str(tmp_path / "runs"))


# --- ddpnb.spawn: the drop-in's join semantics -------------------------------------------------------------------


def fails_on_rank_one(rank, message):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError(message)
    dist.all_reduce(torch.ones(1))


def test_spawn_with_join_raises_worker_error_naming_the_failing_rank():
    with pytest.raises(ddpnb.WorkerError) as failure:
        ddpnb.spawn(fails_on_rank_one, args=("bad shard on rank 1",), nprocs=2, join=True)
    shown = str(failure.value)
    assert "rank 1 of 2 failed first: ValueError: bad shard on rank 1" in shown
    assert "raise ValueError(message)" in shown  # the rank's own traceback, with the function's line


def waits_for(rank, go_file):
    import time

    while not os.path.exists(go_file):
        time.sleep(0.05)
    return rank


def test_spawn_without_join_returns_the_run_whose_join_is_false_until_every_rank_ended(tmp_path):
    go = tmp_path / "go"
    handle = ddpnb.spawn(waits_for, args=(str(go),), nprocs=2, join=False)
    assert isinstance(handle, Run)
    assert handle.join(timeout=0.5) is False  # the ranks wait for `go`, which does not exist yet
    assert not handle.done
    go.touch()
    assert handle.join(timeout=JOIN_TIMEOUT) is True
    assert [r.exitcode for r in handle.record.ranks] == [0, 0]


def test_join_of_a_spawned_run_that_failed_raises_worker_error():
    handle = ddpnb.spawn(fails_on_rank_one, args=("join sees this",), nprocs=2, join=False)
    with pytest.raises(ddpnb.WorkerError, match="rank 1 of 2 failed first: ValueError: join sees this"):
        handle.join(timeout=JOIN_TIMEOUT)


# --- every rank's environment ------------------------------------------------------------------------------------

ENV_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DDPNB_WORKER",
    "TORCH_DIST_INIT_BARRIER",
    "GLOO_SOCKET_IFNAME",
    "DDPNB_TEST_EXTRA",
)


def every_ranks_environment():
    """Each rank's view, read inside the rank and gathered to rank 0 (which alone returns)."""
    import torch
    import torch.distributed as dist

    mine = {key: os.environ.get(key) for key in ENV_KEYS} | {"threads": torch.get_num_threads()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def test_every_rank_gets_its_own_torchrun_variables_group_rank_and_loopback_for_gloo():
    ranks = ddpnb.run(every_ranks_environment, nprocs=3, env={"DDPNB_TEST_EXTRA": "yes"}, view="none")
    port = ranks[0]["MASTER_PORT"]
    assert port != "29500" and int(port) > 0
    for rank, env in enumerate(ranks):
        assert {key: env[key] for key in ENV_KEYS} == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "DDPNB_WORKER": "1",
            "TORCH_DIST_INIT_BARRIER": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "DDPNB_TEST_EXTRA": "yes",
        }, f"rank {rank}"


def _network_interface() -> str | None:
    """An interface other than loopback with an IPv4 address, for gloo to be pointed at instead of `lo`."""
    for name, addresses in psutil.net_if_addrs().items():
        if name not in ("lo", "lo0") and any(a.family == socket.AF_INET for a in addresses):
            return name
    return None


@pytest.mark.parametrize("where", ["env", "kernel environment"])
def test_gloo_interface_and_init_barrier_set_by_the_user_win(where, monkeypatch):
    interface = _network_interface()
    if interface is None:
        pytest.skip("this machine has no network interface besides loopback to point gloo at")
    mine = {"GLOO_SOCKET_IFNAME": interface, "TORCH_DIST_INIT_BARRIER": "0"}
    if where == "env":
        ranks = ddpnb.run(every_ranks_environment, nprocs=2, env=mine, view="none")
    else:
        for key, value in mine.items():
            monkeypatch.setenv(key, value)
        ranks = ddpnb.run(every_ranks_environment, nprocs=2, view="none")
    assert [(env["GLOO_SOCKET_IFNAME"], env["TORCH_DIST_INIT_BARRIER"]) for env in ranks] == [(interface, "0")] * 2


# --- CPU threads ---------------------------------------------------------------------------------------------------


def every_ranks_threads():
    import torch
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, torch.get_num_threads())
    return gathered


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_cpu_ranks_split_the_usable_cores_between_them(ranks):
    assert ddpnb.run(every_ranks_threads, nprocs=ranks, view="none") == [max(1, USABLE_CORES // ranks)] * ranks


def test_the_split_counts_only_the_cores_taskset_allows(tmp_path):
    """A process pinned to one core (taskset, a container's cpuset) gives its ranks that one core, not the
    machine's: the script pins itself, then launches one rank."""
    if USABLE_CORES < 2:
        pytest.skip("this process may use one core only: pinning to one would change nothing")
    script = tmp_path / "pinned.py"
    script.write_text(
        textwrap.dedent("""
        import os
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        import ddpnb

        def threads():
            import torch
            return torch.get_num_threads()

        print("THREADS", ddpnb.run(threads, nprocs=1, view="none"))
    """)
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert done.returncode == 0, done.stderr
    assert "THREADS 1" in done.stdout.splitlines()


@pytest.mark.parametrize("where", ["env", "kernel environment"])
def test_omp_num_threads_set_by_the_user_wins_over_the_split(where, monkeypatch):
    """Set after the forkserver started (the kernel's `os.environ`, or `--env`): the split would give one rank
    every usable core, the user asked for one more than that."""
    wanted = str(USABLE_CORES + 1)
    ddpnb.run(every_ranks_threads, nprocs=1, view="none")  # the forkserver is up before the variable is set
    if where == "env":
        threads = ddpnb.run(every_ranks_threads, nprocs=2, env={"OMP_NUM_THREADS": wanted}, view="none")
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", wanted)
        threads = ddpnb.run(every_ranks_threads, nprocs=2, view="none")
    assert threads == [int(wanted)] * 2


# --- what the function gets and gives back --------------------------------------------------------------------------


def returns_a_parameter():
    import torch

    return {
        "weight": torch.nn.Parameter(torch.arange(3.0)),
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
    }


def test_a_returned_parameter_arrives_as_a_parameter_keeping_requires_grad():
    import torch

    value = ddpnb.run(returns_a_parameter, nprocs=2, view="none")
    assert type(value["weight"]) is torch.nn.Parameter and value["weight"].requires_grad
    assert type(value["frozen"]) is torch.nn.Parameter and not value["frozen"].requires_grad
    assert value["weight"].tolist() == [0.0, 1.0, 2.0]


def asks_for_nccl(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl", rank=rank, world_size=world_size)  # written for GPUs, run on a CPU rank
    total = torch.ones(1) * (rank + 1)
    dist.all_reduce(total)
    return dist.get_backend(), total.item()


def test_init_process_group_nccl_on_a_cpu_rank_keeps_the_gloo_group():
    assert ddpnb.run(asks_for_nccl, nprocs=2, view="none") == ("gloo", 3.0)


# --- line cuts -----------------------------------------------------------------------------------------------------

LONG_LINE = "x" * 25_000 + "END"


def prints_a_long_line(rank):
    print(LONG_LINE)
    print("after the long line")


def test_a_line_over_10000_characters_is_cut_in_the_record_and_text_view_and_whole_in_the_log(capsys):
    ddpnb.run(prints_a_long_line, nprocs=1, view="text")
    shown = capsys.readouterr().out
    cut = "x" * 10_000 + f" [... {len(LONG_LINE) - 10_000} more characters in the log]"
    run = ddpnb.launch(prints_a_long_line, nprocs=1, view="none")
    run.wait()
    assert [line.text for line in run.lines_since(0)[0]] == [cut, "after the long line"]
    record = ddpnb.last_run()
    assert f"[rank 0] {cut}\n[rank 0] after the long line\n" in shown
    assert LONG_LINE not in shown
    assert record.ranks[0].log_path.read_text() == LONG_LINE + "\nafter the long line\n"


WIDE_CELL = """%%ddp -n 1
def wide(rank):
    print("y" * 3000)
    print("the next line")
"""


def test_a_long_line_is_cut_to_500_characters_in_the_dashboard():
    """Every HTML the dashboard sends (live widgets, then the summary left in the cell) shows the 3,000-character
    line as its first 500 characters."""
    kernel = Kernel(env={"DDPNB_VIEW": "widget"})
    try:
        kernel.execute("%load_ext ddpnb")
        run = kernel.execute(WIDE_CELL, timeout=240)
        assert run.error is None, run.error
        sent = json.dumps([msg["content"] for msg in run.outputs])
        runs = [len(found) for found in re.findall(r"y{400,}", sent)]
        assert runs and set(runs) == {500}, runs
        assert "the next line" in sent
        log = kernel.execute("print(open(ddpnb.last_run().ranks[0].log_path).read().splitlines()[0] == 'y' * 3000)")
        assert log.stdout.strip() == "True"
    finally:
        kernel.shutdown()


# --- the runs directory --------------------------------------------------------------------------------------------


def test_a_runs_directory_open_to_others_is_made_private(tmp_path, monkeypatch):
    runs = tmp_path / "open"
    runs.mkdir()
    runs.chmod(0o777)
    monkeypatch.setenv("DDPNB_RUNS_DIR", str(runs))
    ddpnb.run(waits_for, nprocs=1, args=(str(runs),), view="none")  # the directory exists: returns at once
    assert stat.S_IMODE(runs.stat().st_mode) == 0o700
    assert ddpnb.last_run().run_dir.parent == runs


def test_a_runs_directory_owned_by_another_user_is_refused_and_nothing_starts(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user (uid 65534) needs root")
    runs = tmp_path / "theirs"
    runs.mkdir(mode=0o700)
    os.chown(runs, 65534, 65534)
    monkeypatch.setenv("DDPNB_RUNS_DIR", str(runs))
    with pytest.raises(PermissionError, match="is not a directory owned by you; set DDPNB_RUNS_DIR"):
        ddpnb.run(waits_for, nprocs=1, args=(str(runs),), view="none")
    assert list(runs.iterdir()) == []


# --- the kernel after a failed run -----------------------------------------------------------------------------------


def test_kernel_keeps_its_variables_after_a_failed_run_and_the_next_cell_runs(kernel):
    assert kernel.execute("kept = {'epochs': 3}").error is None
    failed = kernel.execute("""%%ddp -n 2
defined_by_the_failing_cell = "still here"
def fails(rank):
    raise RuntimeError(f"rank {rank} fails on purpose")
""")
    assert failed.error is not None and failed.error["ename"] == "WorkerError"
    after = kernel.execute("print(kept, defined_by_the_failing_cell)")
    assert after.stdout.strip() == "{'epochs': 3} still here"
    again = kernel.execute("%%ddp -n 2\ndef works(rank):\n    return kept['epochs'] + rank\n")
    assert again.error is None and again.results == ["3"]
