"""ddpnb from plain Python: `run`, `spawn`, `launch`, the run record, logging and the run directory."""

from __future__ import annotations

import gc
import os
import re
import stat
import subprocess
import sys
import textwrap
import time
import weakref

import pytest

import ddpnb
from tests.conftest import left_in_groups, wait_gone, written_result_files
from tests.test_faults import wait_for

SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    import ddpnb

    def train(rank, world_size):
        t = torch.ones(1) * rank
        dist.all_reduce(t)
        ddpnb.log(step=0, total=t.item())
        print(f"rank {rank} sees {t.item()}")
        return {"total": t.item(), "world": world_size}

    if __name__ == "__main__":
        print("RESULT", ddpnb.run(train, nprocs=3))
""")


def test_run_works_from_a_plain_python_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    assert "RESULT {'total': 3.0, 'world': 3}" in done.stdout
    for rank in range(3):
        assert f"[rank {rank}] rank {rank} sees 3.0" in done.stdout


UNGUARDED_SCRIPT = textwrap.dedent("""
    import sys
    import ddpnb

    print("top-level code ran", flush=True)
    SCALE = 10

    def train(rank):
        return [rank * SCALE, sys.modules["__main__"].train is train]  # the rank's __main__ holds what it uses

    print("RESULT", ddpnb.run(train, nprocs=2))
""")


def test_ranks_never_run_the_launching_scripts_top_level_code(tmp_path):
    """cloudpickle sends what the script defines by value: ranks skip multiprocessing's re-run of the main
    module, so a script needs no `if __name__ == "__main__":` guard, and its imports cost nothing per launch. The
    rank's own `__main__` still holds the script's names the function uses (docs/behaviour.md)."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    assert "RESULT [0, True]" in done.stdout
    assert done.stdout.count("top-level code ran") == 1, done.stdout


def test_a_deleted_working_directory_is_a_clear_error(tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(ddpnb.LaunchError, match=r"working directory no longer exists .* change to one that exists"):
        ddpnb.run(_signature_probe_none, nprocs=1)


def _signature_probe_none():
    return "none"


def _signature_probe_rank(rank):
    return f"rank {rank}"


def _signature_probe_both(rank, world_size):
    return f"{rank}/{world_size}"


@pytest.mark.parametrize(
    "fn, expected",
    [
        (_signature_probe_none, "none"),
        (_signature_probe_rank, "rank 0"),
        (_signature_probe_both, "0/2"),
    ],
)
def test_function_signatures_fn_fn_rank_fn_rank_world_size(fn, expected):
    assert ddpnb.run(fn, nprocs=2) == expected


def _environment():
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "EXTRA",
        "TORCH_DIST_INIT_BARRIER",
    )
    import torch.distributed as dist

    return {key: os.environ.get(key) for key in keys} | {
        "initialized": dist.is_initialized(),
        "backend": dist.get_backend(),
    }


def test_ranks_get_torchrun_environment_and_a_ready_process_group():
    env = ddpnb.run(_environment, nprocs=2, env={"EXTRA": "yes"})
    assert env["RANK"] == env["LOCAL_RANK"] == "0"
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] != "29500" and int(env["MASTER_PORT"]) > 0
    assert env["EXTRA"] == "yes"
    assert env["TORCH_DIST_INIT_BARRIER"] == "1"  # see the next test
    assert env["initialized"] and env["backend"] == "gloo"


def test_quick_ranks_never_break_a_slower_ranks_connect():
    """A rank whose group is up may return, take its group down and exit while a peer is still connecting gloo's
    full mesh; without init's barrier that peer failed ("connectFullMesh ... Connection closed by peer") in 5
    runs of 20 with 16 ranks. A race: this catches its return nearly always (10 runs), never falsely. The
    function is a lambda so that it travels by value: ranks that import this test module are slower and
    race less."""
    for _ in range(10):
        assert ddpnb.run(lambda rank: rank, nprocs=16, view="none") == 0


def _rank_zero_returns_first(rank, world_size, release):
    import time

    import torch
    import torch.distributed as dist

    if rank == 0:
        return {"done": "rank 0 done", "tensor": torch.zeros(1)}  # written into the kernel's result file
    deadline = time.monotonic() + 120  # only keeps a broken test from hanging
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the test saw rank 0's value: the store rank 0 hosts must still be there
    group = dist.new_group([1], backend="gloo", use_local_synchronization=True)  # rank 1 alone
    dist.distributed_c10d._get_default_store().set(f"late/{rank}", "still here")
    return dist.get_world_size(group)


def test_rank_zero_stays_until_every_rank_is_done_with_its_store(tmp_path):
    for attempt in range(2):  # rank 0 exits (without the fix) a few milliseconds after its value: two chances
        release, before = tmp_path / f"release{attempt}", written_result_files()
        handle = ddpnb.launch(_rank_zero_returns_first, nprocs=3, args=(str(release),), view="none")
        wait_for(lambda before=before: written_result_files() - before, "rank 0 to return its value")
        release.touch()
        assert handle.result()["done"] == "rank 0 done"
    record = handle.record
    assert all(rank.exitcode == 0 for rank in record.ranks)
    assert record.ranks[0].log_path.read_text() == ""  # waiting for the others printed nothing (c10d warns
    # into the rank's stderr when a store wait times out)


def _waits_for(rank, path):
    while not os.path.exists(path):
        time.sleep(0.01)
    return f"rank {rank} released"


def test_result_with_a_timeout_raises_timeout_error_as_a_futures_does_and_the_run_goes_on(tmp_path):
    release = tmp_path / "release"
    handle = ddpnb.launch(_waits_for, nprocs=2, args=(str(release),), view="none")
    try:
        with pytest.raises(
            TimeoutError,
            match=r"^the run has not ended within 0.2 s, and goes on: .result\(\) again "
            r"waits for it, .stop\(\) ends it.$",
        ):
            handle.result(timeout=0.2)  # the ranks wait for a file no one has made yet: it cannot have ended
        with pytest.raises(ValueError, match="timeout is a number of seconds to wait, 0 or more, not '1'"):
            handle.result(timeout="1")
        assert not handle.done and handle.record.outcome is ddpnb.Outcome.RUNNING
    finally:
        release.touch()
    assert handle.result(timeout=120) == "rank 0 released"


def _spawn_target(rank, scale, out_dir):
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(str(rank * scale))


def test_spawn_is_a_drop_in_for_mp_spawn(tmp_path):
    assert ddpnb.spawn(_spawn_target, args=(10, str(tmp_path)), nprocs=2, join=True) is None
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0", "10"]
    handle = ddpnb.spawn(_spawn_target, args=(5, str(tmp_path)), nprocs=2, join=False)
    while not handle.join(timeout=30):
        pass
    assert (tmp_path / "rank1").read_text() == "5"


def _logs_metrics(rank):
    for step in range(5):
        ddpnb.log(step=step, loss=1.0 / (step + 1), rank_value=rank)
    return "ok"


def _collector_counts():
    import gc

    return gc.get_freeze_count(), len(gc.get_objects())


def test_ranks_garbage_collector_skips_what_the_forkserver_imported():
    """A rank starts with torch's objects from the forkserver: frozen, a full collection never walks them (it
    took ~110 ms, and copied every page it touched out of memory shared with the forkserver)."""
    frozen, collected = ddpnb.run(_collector_counts, nprocs=2, view="none")
    assert frozen > 100_000 and frozen > 5 * collected, (frozen, collected)


def test_a_metric_is_written_as_its_message_would_be():
    from ddpnb.core import messages as msg

    metric = msg.Metric(rank=1, step=3, time=12.5, values={"loss": 0.25})
    assert msg.encode_metric(1, 3, 12.5, {"loss": 0.25}) == msg.encode(metric)
    assert msg.decode(msg.encode_metric(1, 3, 12.5, {"loss": 0.25})) == metric


def _logs_a_loss(rank):
    ddpnb.log(step=0, loss=0.5)
    return "logged"


def test_log_outside_a_worker_is_a_no_op():
    """The same function runs as a plain script: there, ddpnb.log neither fails nor reaches any run."""
    assert ddpnb.run(_logs_a_loss, nprocs=1, view="none") == "logged"
    record = ddpnb.last_run()
    before = record.metrics("loss")
    assert [p.value for p in before] == [0.5]
    assert _logs_a_loss(0) == "logged"  # called here, outside any worker
    ddpnb.log(step=1, loss=float("nan"), other=2.0)
    assert ddpnb.last_run() is record and record.metrics("loss") == before and not record.metrics("other")


def _prints(rank):
    print("é" * 5000)  # multi-byte characters across pipe reads
    return rank


def test_run_directory_is_private_and_logs_are_complete():
    ddpnb.run(_prints, nprocs=2)
    record = ddpnb.last_run()
    assert stat.S_IMODE(record.run_dir.stat().st_mode) == 0o700
    for rank in record.ranks:
        assert stat.S_IMODE(rank.log_path.stat().st_mode) == 0o600
        assert rank.log_path.read_text(encoding="utf-8") == "é" * 5000 + "\n"
        assert rank.last_line == "é" * 5000


def _returns_pid():
    return os.getpid()


def _starts_a_child(rank):
    child = subprocess.Popen(["sleep", "600"])  # left running: ddpnb ends it with the rank's group
    return child.pid


def test_no_worker_outlives_its_run():
    child = ddpnb.run(_starts_a_child, nprocs=2)
    assert wait_gone([child], within=5) == []
    assert left_in_groups([r.pid for r in ddpnb.last_run().ranks]) == []


def test_impossible_requests_fail_before_starting():
    with pytest.raises(ddpnb.LaunchError, match="more GPUs than this machine has"):
        ddpnb.run(_returns_pid, gpus=64)
    with pytest.raises(ddpnb.LaunchError, match="positive integer"):
        ddpnb.run(_returns_pid, nprocs=0)
    with pytest.raises(ddpnb.LaunchError, match="nccl backend needs GPUs"):
        ddpnb.run(_returns_pid, nprocs=2, backend="nccl")


def test_settings_that_cannot_work_fail_before_starting(monkeypatch):
    before = ddpnb.last_run()
    monkeypatch.setenv("DDPNB_CPU_FALLBACK", "0")  # off, as 0 reads
    with pytest.raises(ddpnb.LaunchError, match="more GPUs than this machine has"):
        ddpnb.run(_returns_pid, gpus="all")
    monkeypatch.setenv("DDPNB_MAX_LINES", "lots")
    with pytest.raises(ddpnb.LaunchError, match="DDPNB_MAX_LINES must be a number of lines"):
        ddpnb.run(_returns_pid, nprocs=2, view="text")
    with pytest.raises(ddpnb.LaunchError, match="positive number of seconds"):
        ddpnb.run(_returns_pid, nprocs=2, timeout=float("nan"))
    with pytest.raises(ddpnb.LaunchError, match="^timeout must be a positive number of seconds, not '10'.$"):
        ddpnb.run(_returns_pid, nprocs=2, timeout="10")
    for args, shown in ((5, "5"), ("data.csv", "'data.csv'")):  # a lone argument, not a tuple of them
        with pytest.raises(
            ddpnb.LaunchError,
            match=re.escape(
                f"args must be a tuple of the function's extra arguments, not {shown}: for one, args=({shown},)."
            ),
        ):
            ddpnb.run(_returns_pid, nprocs=2, args=args)
    assert ddpnb.last_run() is before  # nothing started


async def _coroutine(rank):
    return rank


def test_functions_the_ranks_cannot_call_are_refused_before_starting():
    with pytest.raises(ddpnb.LaunchError, match="_coroutine is an async function"):
        ddpnb.run(_coroutine, nprocs=2)
    with pytest.raises(ddpnb.LaunchError, match="missing a required argument: 'verbose'"):
        ddpnb.run(lambda rank, world_size, verbose: rank, nprocs=2)
    with pytest.raises(ddpnb.LaunchError, match=r"too many positional arguments; ddpnb.spawn calls fn\(rank, \*args\)"):
        ddpnb.spawn(lambda: 0, nprocs=2)  # mp.spawn's convention: fn(rank, *args)
    with pytest.raises(ddpnb.LaunchError, match="not a function"):
        ddpnb.run(42, nprocs=2)


def _logs_a_vector(rank):
    import torch

    ddpnb.log(step=0, loss=torch.tensor([1.0, 2.0]))


def test_logging_something_that_is_not_a_number_names_it_raised_on_the_users_line():
    with pytest.raises(ddpnb.WorkerError) as failure:
        ddpnb.run(_logs_a_vector, nprocs=2)
    assert "ddpnb.log: loss must be a number or a one-element tensor, not Tensor of shape (2,)" in str(failure.value)
    traceback = failure.value.record.first_failure.traceback.splitlines()
    # as a built-in's error would: the innermost frame is the user's call, not ddpnb's own code below it
    assert traceback[-3:-1] == [
        (f'  File "{__file__}", line {_logs_a_vector.__code__.co_firstlineno + 3}, in _logs_a_vector'),
        "    ddpnb.log(step=0, loss=torch.tensor([1.0, 2.0]))",
    ], traceback
    assert "ddpnb" + os.sep not in "\n".join(traceback).replace(__file__, "")


def _saves_a_list(rank):
    ddpnb.save_checkpoint([1, 2], step=0)


def test_a_checkpoint_of_something_that_is_not_a_dict_is_refused_on_the_users_line():
    with pytest.raises(ddpnb.WorkerError) as failure:
        ddpnb.run(_saves_a_list, nprocs=2)
    assert "ddpnb checkpoints take a dict of what to save, e.g. {'model': model, 'opt': opt}, not list." in str(
        failure.value
    )
    assert failure.value.record.first_failure.traceback.splitlines()[-2] == "    ddpnb.save_checkpoint([1, 2], step=0)"


def _returns_tensors(rank):
    import torch

    return {"weight": torch.ones(4)}


def test_a_finished_run_goes_with_its_last_reference():
    """Its value (here mapped memory) is freed when the caller lets go, not at the next garbage collection:
    the text view and the run no longer hold each other once the run has ended."""
    ddpnb.run(_returns_tensors, nprocs=2, view="none")  # the first run in this process imports torch here
    gc.disable()
    try:
        run = ddpnb.launch(_returns_tensors, nprocs=2, view="text")
        assert run.result()["weight"].sum().item() == 4
        gone = weakref.ref(run)
        del run
        assert gone() is None
    finally:
        gc.enable()


def _defaulted(rank, world_size, lines, rate=0.0, verbose=False):
    return (rank, world_size, lines, rate, verbose)


def _optional_only(config=None):
    return config


def test_args_fill_parameters_after_rank_and_world_size_even_defaulted_ones():
    assert ddpnb.run(_defaulted, nprocs=2, args=(10, 0.5)) == (0, 2, 10, 0.5, False)
    assert ddpnb.run(_optional_only, nprocs=2) is None
