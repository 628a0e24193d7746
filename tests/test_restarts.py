"""Restarts and checkpoints (issue 18): `max_restarts`, `ddpnb.save_checkpoint` / `load_checkpoint` on DCP, and
`resume`, with real ranks on CPU over gloo.

Training here is deterministic: the model starts from one seed, and step `s` of rank `r` trains on a batch drawn
from seed `10 * s + r`, whatever attempt runs it. A run that restarts from a checkpoint therefore ends with the
same weights, bit for bit, as one that never failed. Checkpoints are saved after every 10th step, as the number
of steps done: a run that fails at step 25 continues from step 20.

Worker functions live at module level; this module is pickled by value (as a notebook's functions are).
"""

from __future__ import annotations

import html
import os
import re
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

import ddpnb
from ddpnb.views.html import error_html, header_html, plots_html, summary_html
from tests.conftest import private_runs_dir
from tests.test_faults import assert_nothing_left, orphans_come_to_this_process, wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])
assert orphans_come_to_this_process  # its autouse fixture applies here too: what a run leaves behind is seen

STEPS, EVERY = 40, 10


@pytest.fixture(scope="module", autouse=True)
def runs_dir(tmp_path_factory):
    """A private runs directory, so `resume='last'` sees only this module's runs."""
    with private_runs_dir(tmp_path_factory) as path:
        yield path


def train(rank, world_size, fail_at=None, how="", fsdp=False, signal_dir="", asynchronous=False):
    """40 deterministic steps; in attempt 0 rank 1 fails at step `fail_at` (`how`: sigkill, raise, hang, or
    every: raises in every attempt, or save: killed inside the save of that step). `asynchronous`: DCP's
    async_save."""
    import signal as signals
    import time

    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    start = ddpnb.load_checkpoint({"model": model, "opt": opt})
    attempt = ddpnb.attempt()
    print(f"attempt {attempt} starts from step {start}", flush=True)
    failing = rank == 1 and (attempt == 0 or how == "every")
    if failing and how == "save":
        from torch.distributed.checkpoint import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):  # this rank's shard is on disk; the metadata never will be
            written = write_data(self, plan, planner)
            if f"step-{fail_at:09d}" in str(self.path):  # that step's save, wherever it is written (in a thread
                # if asynchronous)
                os.kill(os.getpid(), signals.SIGKILL)
            return written

        FileSystemWriter.write_data = write_then_die
    for step in range(start or 0, STEPS):
        if failing and step == fail_at:
            if asynchronous and how != "save":  # the save before was written in a thread: let it finish first
                from ddpnb.rank import context

                done = Path(context.current().spec.checkpoint_dir, f"step-{fail_at // EVERY * EVERY:09d}")
                deadline = time.monotonic() + 60
                while not done.is_dir() and time.monotonic() < deadline:
                    time.sleep(0.01)
            if how == "sigkill":
                os.kill(os.getpid(), signals.SIGKILL)
            if how in ("raise", "every"):
                raise ValueError(f"bad batch at step {step} in attempt {attempt}")
            if how == "hang":
                Path(signal_dir, "at-step").write_text(str(step))
                time.sleep(600)
        generator = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(8, 4, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ddpnb.log(step=step, loss=loss.item())
        if (step + 1) % EVERY == 0:
            ddpnb.save_checkpoint({"model": model, "opt": opt}, step=step + 1, asynchronous=asynchronous)
    state = model.state_dict()
    if fsdp:  # every rank takes part in gathering the shards; rank 0's full copy is returned
        state = {name: tensor.full_tensor() for name, tensor in state.items()}
    dist.barrier()
    return {"start": start, "attempt": attempt, "state": {name: t.detach().clone() for name, t in state.items()}}


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    return ddpnb.run(train, nprocs=2, view="none")


@pytest.fixture(scope="module")
def uninterrupted_fsdp() -> dict:
    return ddpnb.run(train, nprocs=2, view="none", args=(None, "", True))


def assert_same_weights(result: dict, expected: dict) -> None:
    assert result["state"].keys() == expected["state"].keys()
    for name, tensor in expected["state"].items():
        assert torch.equal(result["state"][name], tensor), name


def starts(record: ddpnb.RunRecord, attempt: int) -> str:
    log = record.run_dir / f"rank0.attempt{attempt}.log"
    return next(line for line in log.read_text().splitlines() if "starts from step" in line)


# --- 1, 2: a rank fails in attempt 0; attempt 1 continues from the last complete checkpoint ------------------------


@pytest.mark.parametrize("how", ["sigkill", "raise"])
def test_a_failed_rank_restarts_the_group_from_the_last_checkpoint(how, uninterrupted, capsys):
    result = ddpnb.run(train, nprocs=2, max_restarts=1, args=(25, how), view="text")
    record = ddpnb.last_run()

    assert uninterrupted["start"] is None and uninterrupted["attempt"] == 0
    assert result["attempt"] == 1 and result["start"] == 20
    assert_same_weights(result, uninterrupted)
    assert record.outcome is ddpnb.Outcome.SUCCEEDED and record.attempt == 1
    (first,) = record.attempts
    cause = "killed by SIGKILL" if how == "sigkill" else "ValueError: bad batch at step 25 in attempt 0"
    assert first.first_failure.rank == 1 and first.first_failure.summary == cause
    assert starts(record, 0) == "attempt 0 starts from step None"
    assert starts(record, 1) == "attempt 1 starts from step 20"
    for rank in (0, 1):  # each attempt's own logs; attempt 0's ends with how the rank ended
        assert f"\n[ddpnb] rank {rank} " in (record.run_dir / f"rank{rank}.attempt0.log").read_text()
    assert f"\n[ddpnb] rank 1 failed: {cause}" in (record.run_dir / "rank1.attempt0.log").read_text()
    assert [point.step for point in record.metrics("loss", attempt=1)] == list(range(20, STEPS))
    shown = capsys.readouterr().out
    restart_line = next(line for line in shown.splitlines() if line.startswith("[ddpnb] attempt 0 failed"))
    assert cause in restart_line and "restart 1 of 1" in restart_line
    assert (
        shown.index("attempt 0 starts from step None")
        < shown.index(restart_line)
        < shown.index("attempt 1 starts from step 20")
    )
    assert sorted(p.name for p in (record.run_dir / "checkpoints").iterdir()) == [
        "step-000000020",
        "step-000000030",
        "step-000000040",
    ]  # the newest 3 complete ones
    assert_nothing_left(record, [r.pid for a in record.attempts for r in a.ranks])
    # the dashboard: the attempt in its header, the earlier attempt's failure, its lines and the restart marker
    assert "attempt 1 (restarts: 1 of 1)" in header_html(record)
    assert f'data-attempt="0">attempt 0 (restarted): rank 1 failed first: {html.escape(cause)}' in error_html(record)
    plot = plots_html(record)
    assert 'class="ddpnb-restart" data-attempt="1"' in plot and 'data-rank="0" data-attempt="0"' in plot


def test_an_fsdp2_model_and_its_optimizer_restart_from_the_last_checkpoint(uninterrupted_fsdp):
    result = ddpnb.run(train, nprocs=2, max_restarts=1, args=(25, "sigkill", True), view="none")

    assert result["attempt"] == 1 and result["start"] == 20
    assert_same_weights(result, uninterrupted_fsdp)
    # the checkpoint holds each rank's shard, not a gathered copy
    checkpoint = ddpnb.last_run().run_dir / "checkpoints" / "step-000000040"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(checkpoint))


# --- 3: every attempt fails ----------------------------------------------------------------------------------------


def test_a_rank_failing_in_every_attempt_names_every_attempts_first_failure():
    with pytest.raises(ddpnb.WorkerError) as info:
        ddpnb.run(train, nprocs=2, max_restarts=1, args=(5, "every"), view="none")
    error = info.value
    record = error.record
    report = str(error)

    assert record.outcome is ddpnb.Outcome.FAILED and record.attempt == 1 and len(record.attempts) == 1
    assert report.splitlines()[0] == (
        "ddpnb: rank 1 of 2 failed first (attempt 1): ValueError: bad batch at step 5 in attempt 1"
    )
    assert "  attempt 0: rank 1 failed first: ValueError: bad batch at step 5 in attempt 0" in report
    assert "the last (--max-restarts 1)" in report
    assert error.args[0] == (
        "attempt 1: rank 1 failed first: ValueError: bad batch at step 5 in attempt 1; "
        "attempt 0: rank 1 failed first: ValueError: bad batch at step 5 in attempt 0"
    )
    assert_nothing_left(record, [r.pid for a in record.attempts for r in a.ranks] + [r.pid for r in record.ranks])


# --- 4: a save cut short is never loaded -----------------------------------------------------------------------------


def test_only_a_step_directory_holding_its_metadata_is_a_complete_checkpoint(tmp_path):
    """The layers of "complete" (`core.checkpoints.latest`): the name is exactly `step-N` (a `.partial` one, being
    written or left by a rank that died, never counts, even once DCP's metadata is in it), and DCP's `.metadata`
    is in it (written last, by rank 0, once every rank's shards are)."""
    from ddpnb.core import checkpoints

    def checkpoint(name: str, metadata: bool) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"shard")
        if metadata:
            (tmp_path / name / ".metadata").write_bytes(b"metadata")

    checkpoint("step-000000010", metadata=True)
    checkpoint("step-000000020", metadata=False)
    checkpoint("step-000000030.attempt0.partial", metadata=True)
    checkpoint("step-000000040.attempt1.partial", metadata=False)
    (tmp_path / "step-000000050").write_text("a file, not a checkpoint")

    assert checkpoints.latest(tmp_path) == (10, tmp_path / "step-000000010")
    assert checkpoints.resume_source(tmp_path) == (tmp_path, 10)
    (tmp_path / "step-000000010" / ".metadata").unlink()
    assert checkpoints.latest(tmp_path) is None
    with pytest.raises(ddpnb.LaunchError, match="holds no complete checkpoint"):
        checkpoints.resume_source(tmp_path)


def test_a_rank_killed_inside_a_save_leaves_only_a_partial_directory_for_that_step():
    """Write, then mark complete: a save that dies half-way leaves its files under a `.partial` name only, never
    under the step's own (where a later listing, or a reader not checking `.metadata`, would take it whole)."""
    with pytest.raises(ddpnb.WorkerError) as info:
        ddpnb.run(train, nprocs=2, args=(20, "save"), view="none")
    record = info.value.record
    assert record.first_failure.rank == 1 and record.first_failure.summary == "killed by SIGKILL"
    left = sorted(os.listdir(record.run_dir / "checkpoints"))
    assert left == ["step-000000010", "step-000000020.attempt0.partial"], left
    assert "__1_0.distcp" in os.listdir(record.run_dir / "checkpoints" / left[1])  # the kill came after its write


def test_a_rank_killed_inside_save_checkpoint_restarts_from_the_previous_complete_one(uninterrupted):
    result = ddpnb.run(train, nprocs=2, max_restarts=1, args=(20, "save"), view="none")
    record = ddpnb.last_run()

    assert record.attempts[0].first_failure.summary == "killed by SIGKILL"
    assert result["attempt"] == 1 and result["start"] == 10  # step 20's save never completed
    assert_same_weights(result, uninterrupted)
    left = sorted(os.listdir(record.run_dir / "checkpoints"))
    assert not any(name.endswith(".partial") for name in left), left  # the next complete save removed it


# --- 5: stop(), then resume ------------------------------------------------------------------------------------------


def test_a_stopped_run_never_restarts_and_resume_last_continues_from_its_checkpoint(uninterrupted, tmp_path):
    handle = ddpnb.launch(train, nprocs=2, max_restarts=3, args=(25, "hang", False, str(tmp_path)), view="none")
    wait_for(lambda: (tmp_path / "at-step").exists(), "rank 1 to reach step 25")
    handle.stop()
    stopped = handle.wait()
    assert stopped.outcome is ddpnb.Outcome.STOPPED and stopped.attempts == []  # stop() never restarts
    assert 'data-resume="20"' in summary_html(stopped, [])  # the dashboard's summary offers to continue

    result = ddpnb.run(train, nprocs=2, resume="last", view="none")
    assert result["attempt"] == 0 and result["start"] == 20
    assert_same_weights(result, uninterrupted)
    assert ddpnb.last_run().resumed_from == stopped.run_dir / "checkpoints"


def test_resume_with_no_checkpoint_to_continue_from_says_what_to_do(tmp_path):
    with pytest.raises(ddpnb.LaunchError, match="holds no complete checkpoint.*Run without --resume"):
        ddpnb.run(train, nprocs=2, resume=tmp_path, view="none")
    with pytest.raises(ddpnb.LaunchError, match="max_restarts must be a whole number of 0 or more"):
        ddpnb.run(train, nprocs=2, max_restarts=-1, view="none")


def test_checkpoints_go_under_checkpoint_dir_one_directory_per_run(tmp_path):
    ddpnb.run(train, nprocs=2, checkpoint_dir=tmp_path, keep_checkpoints=1, view="none")
    record = ddpnb.last_run()
    assert os.listdir(tmp_path / record.run_dir.name) == ["step-000000040"]
    assert record.checkpoint_dir == tmp_path / record.run_dir.name
    resumed = ddpnb.run(train, nprocs=2, resume=record.run_dir, view="none")  # the run directory points there
    assert resumed["start"] == STEPS


# --- asynchronous saves (DCP's async_save) ---------------------------------------------------------------------------


def test_asynchronous_saves_restart_from_the_last_checkpoint_with_the_same_weights(uninterrupted):
    result = ddpnb.run(train, nprocs=2, max_restarts=1, args=(25, "sigkill", False, "", True), view="none")
    record = ddpnb.last_run()

    assert result["attempt"] == 1 and result["start"] == 20
    assert_same_weights(result, uninterrupted)  # the save copied the state before training changed it
    # the end of the function waited for the last save (step 40) and marked it complete
    assert sorted(os.listdir(record.run_dir / "checkpoints")) == ["step-000000020", "step-000000030", "step-000000040"]


def test_a_rank_killed_while_an_asynchronous_save_is_written_never_leaves_it_complete(uninterrupted):
    result = ddpnb.run(train, nprocs=2, max_restarts=1, args=(20, "save", False, "", True), view="none")
    record = ddpnb.last_run()

    assert record.attempts[0].first_failure.summary == "killed by SIGKILL"
    assert result["attempt"] == 1 and result["start"] == 10  # step 20's save was never marked complete
    assert_same_weights(result, uninterrupted)


# --- the directory a run resumes from is held against retention -------------------------------------------------------


def test_the_run_directory_a_run_resumes_from_is_kept_by_retention_while_the_run_lives(tmp_path):
    from ddpnb.core import rundir

    ddpnb.run(train, nprocs=2, keep_checkpoints=1, view="none")
    source = ddpnb.last_run().run_dir
    release = tmp_path / "release"

    def resumes(rank):
        import time

        loaded = ddpnb.load_checkpoint({})
        while not release.exists():
            time.sleep(0.1)
        return loaded

    handle = ddpnb.launch(resumes, nprocs=1, resume=source, view="none")
    try:
        wait_for(lambda: handle.record.ranks[0].state is ddpnb.RankState.RUNNING, "the resuming rank to start")
        assert rundir.in_use(source)
        for _ in range(rundir.KEEP_RUNS + 1):  # that many newer runs, then their retention
            rundir.new_run_dir()
        rundir.prune()
        assert (source / "checkpoints" / "step-000000040").is_dir(), "retention deleted the directory being resumed"
    finally:  # a failed assert must not leave the rank waiting (the test process would wait for it at exit)
        release.touch()
    assert handle.result() == STEPS
    assert not rundir.in_use(source)  # let go with the run: the next retention may delete it
    rundir.prune()
    assert not source.exists()


# --- one owner of restarts: the budget, the attempt count and the ranks' own markers agree ---------------------------


def _fails_in_every_attempt(rank: int, marks: str) -> None:
    """Each rank leaves a marker named after the attempt it runs in (`ddpnb.attempt()`); rank 1 then fails, once
    rank 0's marker is there (a handshake: rank 0 is never stopped before it wrote it)."""
    import time

    Path(marks, f"attempt{ddpnb.attempt()}-rank{rank}").touch()
    if rank == 1:
        deadline = time.monotonic() + 120
        while not Path(marks, f"attempt{ddpnb.attempt()}-rank0").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError(f"fails in attempt {ddpnb.attempt()}")


def test_exhausted_restarts_make_exactly_the_budgeted_attempts_and_the_record_says_so(tmp_path, capsys):
    """`max_restarts=2` with a rank that always fails: three attempts ran (the ranks' own markers), the record
    keeps the first two and ends on the third, the logs are one per attempt, and the run says so."""
    with pytest.raises(ddpnb.WorkerError) as failure:
        ddpnb.run(_fails_in_every_attempt, nprocs=2, max_restarts=2, args=(str(tmp_path),), view="text")
    record = ddpnb.last_run()
    marks = sorted(path.name for path in tmp_path.iterdir())
    assert marks == [f"attempt{a}-rank{r}" for a in range(3) for r in range(2)]
    assert (record.max_restarts, record.attempt, [a.number for a in record.attempts]) == (2, 2, [0, 1])
    assert [a.first_failure.summary for a in record.attempts] == [
        "RuntimeError: fails in attempt 0",
        "RuntimeError: fails in attempt 1",
    ]
    assert record.first_failure.summary == "RuntimeError: fails in attempt 2"
    assert record.outcome is ddpnb.Outcome.FAILED and "fails in attempt 2" in str(failure.value)
    assert sorted(p.name for p in record.run_dir.glob("rank*.log")) == [
        f"rank{r}.attempt{a}.log" for r in range(2) for a in range(3)
    ]
    said = capsys.readouterr().out
    assert "(restart 1 of 2)" in said and "(restart 2 of 2)" in said and "restart 3" not in said
    assert f"full per-rank logs: {record.run_dir}/rank{{0..1}}.attempt{{0..2}}.log" in str(failure.value)


def _fails_in_attempt_0(rank: int) -> None:
    print(f"attempt {ddpnb.attempt()} rank {rank}", flush=True)
    if ddpnb.attempt() == 0 and rank == 1:
        raise RuntimeError("fails in attempt 0")


def test_a_restarted_runs_text_names_every_attempts_logs(capsys):
    ddpnb.run(_fails_in_attempt_0, nprocs=2, max_restarts=1, view="text")
    record = ddpnb.last_run()
    said = capsys.readouterr().out
    assert "(restart 1 of 1); logs: rank{N}.attempt0.log (attempt 0), then rank{N}.attempt1.log" in said, said
    assert f"every attempt's logs: {record.run_dir}/rank{{0..1}}.attempt{{0..1}}.log" in said, said
    for attempt in range(2):  # the files named are the ones that hold each attempt's output
        for rank in range(2):
            log = record.run_dir / f"rank{rank}.attempt{attempt}.log"
            assert f"attempt {attempt} rank {rank}" in log.read_text(), log


# --- the views through a restart (issue 28, acceptance 4) ---------------------------------------------------------


def logs_then_restarts(rank: int, flag: str) -> None:
    """Attempt 0: ten steps, then rank 1 fails. Attempt 1 waits for `flag` before it logs steps 10 to 19: until
    then the plot holds only the earlier attempt's points."""
    import time

    attempt = ddpnb.attempt()
    while attempt == 1 and not os.path.exists(flag):
        time.sleep(0.05)
    for step in range(10 * attempt, 10 * attempt + 10):
        ddpnb.log(step=step, loss=1.0 / (step + 1) + 0.1 * rank)
        print(f"attempt {attempt} step {step}", flush=True)
    if attempt == 0 and rank == 1:
        raise ValueError("rank 1 fails in attempt 0")


def test_the_dashboard_keeps_every_attempts_curves_marks_the_restart_and_its_summary_names_every_log(tmp_path):
    pytest.importorskip("ipywidgets")
    from ddpnb.views.dashboard import Dashboard

    flag = tmp_path / "go"
    run = ddpnb.launch(logs_then_restarts, nprocs=2, max_restarts=1, args=(str(flag),), view="none")
    try:
        dashboard = Dashboard(run, foreground=False)
        wait_for(
            lambda: run.record.attempt == 1 and "ddpnb-restart-mark" in dashboard.log.value,
            "the restart, marked in the dashboard's log",
        )
        # right after the restart: attempt 1 has logged nothing, and attempt 0's curves stay, faded
        wait_for(lambda: 'data-attempt="0"' in dashboard.plots.value, "the earlier attempt's curves")
        plot = dashboard.plots.value
        assert "No metrics yet" not in plot
        assert 'data-rank="0" data-attempt="0"' in plot and 'data-rank="1" data-attempt="0"' in plot, plot
        log = dashboard.log.value
        mark = log[log.index("ddpnb-restart-mark") :]
        assert "attempt 0 failed: rank 1 failed first: ValueError: rank 1 fails in attempt 0" in mark
        assert "restart 1 of 1" in mark and "rank{N}.attempt1.log" in mark
        assert log.index("attempt 0 step 9") < log.index("ddpnb-restart-mark")
        dashboard.log_picker.value = 1  # each rank's own log marks it too
        assert "ddpnb-restart-mark" in dashboard.log.value
        dashboard.log_picker.value = -1
    finally:
        flag.touch()
    record = run.wait(120)
    assert record.outcome is ddpnb.Outcome.SUCCEEDED, run.status
    dashboard.finish()
    # throughout: both attempts' curves, the current one's drawn over the earlier one's and the restart's line
    plot = plots_html(record)
    assert 'data-rank="1" data-attempt="0"' in plot and 'data-rank="1" data-points="10"' in plot
    assert 'class="ddpnb-restart" data-attempt="1"' in plot
    summary = summary_html(record, [line for line, _ in dashboard._all])
    total = sum(r.lines for ranks in [record.attempts[0].ranks, record.ranks] for r in ranks)
    assert total == 40 and re.search(
        r"[^\d,]40 lines(, shown in \d+ \(the same line from several ranks once\))? · "
        r"also in",
        summary,
    ), summary  # every attempt's, each shown
    assert f"{html.escape(str(record.run_dir))}/rank{{0..1}}.attempt{{0..1}}.log" in summary
    assert "ddpnb-restart-mark" in summary


def _saves_where_rank_1_sees_another_directory(rank: int, directory: str) -> None:
    """Rank 1 gets a directory of its own at the checkpoint directory's path, as a rank on another node does where
    the directory is that node's own (its /tmp): a private mount namespace with a fresh tmpfs mounted there."""
    import ctypes

    import torch

    if rank == 1:
        libc = ctypes.CDLL(None, use_errno=True)
        ms_rec, ms_private, clone_newns = 0x4000, 0x40000, 0x20000
        if (
            libc.unshare(clone_newns)
            or libc.mount(b"none", b"/", None, ms_rec | ms_private, None)
            or libc.mount(b"tmpfs", directory.encode(), b"tmpfs", 0, None)
        ):
            raise OSError(ctypes.get_errno(), "no private mount for rank 1")
    ddpnb.save_checkpoint({"weights": torch.ones(4)}, step=1)


@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount for one rank needs root (CAP_SYS_ADMIN)")
def test_a_checkpoint_directory_a_rank_does_not_share_is_refused_at_the_first_save(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    with pytest.raises(ddpnb.WorkerError) as failure:
        ddpnb.run(
            _saves_where_rank_1_sees_another_directory,
            nprocs=2,
            args=(str(directory),),
            checkpoint_dir=str(directory),
            view="none",
            timeout=120,
        )
    message = str(failure.value)
    assert "the checkpoint directory" in message and "is not shared by every rank: rank 1 (on " in message, message
    assert "Pass --checkpoint-dir (checkpoint_dir=) a directory on a filesystem every node shares" in message
    assert [p.name for p in directory.rglob("*") if "step" in p.name] == [], "something was saved"
    traceback = failure.value.record.first_failure.traceback
    assert traceback.splitlines()[-2].strip().startswith("ddpnb.save_checkpoint(")  # raised on the user's line
