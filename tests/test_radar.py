"""The straggler radar (each rank's own compute per step, waits in collectives left out) and the hardware columns
(CPU, resident memory, GPU through NVML), with real ranks on gloo."""

from __future__ import annotations

import itertools
import time

import pytest

import ddpnb
from ddpnb.core import messages as msg
from ddpnb.core.record import RankRecord, RankState
from ddpnb.core.report import straggler_text, summary_table
from ddpnb.core.stragglers import flag_stragglers
from ddpnb.rank import radar
from ddpnb.views import html as render


def ddp_loop_with_a_slow_rank(rank: int, steps: int, slow: int) -> dict[str, float]:
    """A DDP training loop in which rank `slow` does a second forward and backward per step (accumulated without a
    sync, as gradient accumulation does): twice the others' compute, while every rank keeps DDP's pace."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ddpnb

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                                        torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                                        torch.nn.Linear(512, 10)))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
    batch, target = torch.randn(64, 256), torch.randint(0, 10, (64,))
    began = time.monotonic()
    for step in range(steps):
        optimiser.zero_grad()
        if rank == slow:
            with model.no_sync():
                torch.nn.functional.cross_entropy(model(batch), target).backward()
        loss = torch.nn.functional.cross_entropy(model(batch), target)
        loss.backward()
        optimiser.step()
        ddpnb.log(step=step, loss=loss.item())
    dist.barrier()
    return {"seconds": time.monotonic() - began}


def test_rank_with_twice_the_compute_is_the_only_straggler():
    run = ddpnb.launch(ddp_loop_with_a_slow_rank, nprocs=4, args=(400, 3), view="none", timeout=120)
    record = run.record
    live = ""
    deadline = time.monotonic() + 100
    while not run.done and time.monotonic() < deadline and not live:
        if straggler_text(record.ranks[3]) and record.ranks[3].state is RankState.RUNNING:
            live = render.ranks_html(record)  # the dashboard's row while the run goes on
        time.sleep(0.05)
    run.result()
    computes = {r.rank: r.compute_per_step for r in record.ranks}
    assert 'data-rank="3" data-state="running" data-straggler=' in live, f"not flagged live: {computes}"
    assert all(c is not None for c in computes.values()), f"a rank reported no compute: {computes}"
    flagged = {r.rank: straggler_text(r) for r in record.ranks if straggler_text(r)}
    assert list(flagged) == [3], f"expected only rank 3 flagged; flagged {flagged}, compute per step {computes}"
    assert flagged[3].endswith("% slower compute")
    table = summary_table(record)
    assert "compute/step" in table and "slower compute" in table.splitlines()[4], table
    rows = render.ranks_html(record)
    assert rows.count("data-straggler=") == 1 and 'data-rank="3" data-state="finished" data-straggler=' in rows


def waits_while_rank_0_computes(rank: int, where: str) -> None:
    """Rank 0 computes for 0.1 s of CPU time each step before its collective; rank 1 waits for it, in
    `dist.all_reduce` or in DDP's reducer (inside `backward()`, in C++), which must not count as rank 1's
    compute."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ddpnb

    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    for step in range(12):
        if rank == 0:
            spent = time.thread_time() + 0.1  # CPU time: as much on a loaded machine as on an idle one
            while time.thread_time() < spent:
                pass
        if where == "all_reduce":
            dist.all_reduce(torch.ones(4))
        else:
            model(torch.ones(2, 8)).sum().backward()
        ddpnb.log(step=step)


@pytest.mark.parametrize("where", ["all_reduce", "ddp"])
def test_time_waiting_in_a_collective_is_not_compute(where):
    ddpnb.run(waits_while_rank_0_computes, nprocs=2, args=(where,), view="none", timeout=120)
    record = ddpnb.last_run()
    worker, waiter = record.ranks
    assert worker.step_times and waiter.step_times, "a rank reported no step times"
    # per step, rank 1 waits about as long as rank 0 computes: counted as compute, it would be as much
    per_step = {r.rank: sum(t.compute for t in r.step_times) / sum(t.steps for t in r.step_times)
                for r in (worker, waiter)}
    assert per_step[1] < 0.5 * per_step[0], f"rank 1's wait was counted as compute: {per_step}"
    assert straggler_text(record.ranks[1]) == ""


def holds_memory_for(rank: int, seconds: float, megabytes: int) -> None:
    import torch

    held = torch.ones(megabytes * 2**20 // 4) if rank == 1 else None  # touched, so resident
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(range(20_000))  # busy, so the CPU column has something to show
        time.sleep(0.001)
    del held


def test_cpu_and_resident_memory_per_rank_are_recorded_and_shown():
    ddpnb.run(holds_memory_for, nprocs=2, args=(3.5, 200), view="none", timeout=60)
    record = ddpnb.last_run()
    quiet, holding = (list(r.hardware) for r in record.ranks)
    assert quiet and holding, "no hardware samples arrived"
    assert max(s.rss for s in holding) - max(s.rss for s in quiet) > 180 * 2**20, (
        f"rank 1's 200 MB not seen: {max(s.rss for s in holding)} vs {max(s.rss for s in quiet)} bytes")
    assert all(0 < s.cpu < 400 for s in holding[1:]), [s.cpu for s in holding]
    assert all(s.gpu_util is None for s in holding), "a CPU rank reported GPU use"
    table = summary_table(record)
    header, _, row1 = table.splitlines()[:3]
    assert "cpu" in header and "rss" in header and "MiB" in row1, table
    rows = render.ranks_html(record)
    assert ">CPU</th>" in rows and ">memory</th>" in rows and "MiB" in rows


def test_hardware_is_sampled_at_most_once_a_second(tmp_path):
    release = tmp_path / "release"

    def waits_for_release():
        deadline = time.monotonic() + 180  # only keeps a broken test from hanging
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    run = ddpnb.launch(waits_for_release, nprocs=2, view="none")
    deadline = time.monotonic() + 120  # only keeps a rank that never samples from hanging the test
    while not all(len(r.hardware) >= 3 for r in run.record.ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    release.touch()
    run.result()
    for rank in run.record.ranks:
        samples = list(rank.hardware)
        assert len(samples) >= 3, f"rank {rank.rank}: {len(samples)} samples"
        # the samples' own clock, read in the rank: never closer than the interval (load only makes gaps longer)
        gaps = [b.time - a.time for a, b in itertools.pairwise(samples)]
        assert min(gaps) >= 0.95 * radar.HARDWARE_INTERVAL, f"rank {rank.rank} sampled too often: {gaps}"


def test_gpu_sampling_without_nvml_or_a_gpu_reads_nothing():
    # a CPU rank asks NVML nothing; a GPU rank without nvidia-ml-py (or without a driver) goes on without GPU columns
    assert radar.Gpu("cpu").read() is None
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert radar.Gpu("cuda:0").read() is None
    else:
        pytest.skip("nvidia-ml-py is installed: the no-NVML path is not reachable here")


def test_step_clock_reports_at_most_twice_a_second_and_restarts_on_a_new_count(monkeypatch):
    """The clock's two readings (the monotonic clock and the thread's busy time) are stand-ins here, so each
    report's content is known exactly."""
    now, busy = [100.0], [7.0]
    monkeypatch.setattr(radar, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    monkeypatch.setattr(radar, "thread_busy", lambda: busy[0])
    clock = radar.StepClock()
    reports = []

    def tick(step: int, later: float, computed: float) -> None:
        now[0] += later
        busy[0] += computed
        if (report := clock.tick(0, step)) is not None:
            reports.append(report)

    tick(0, 0.0, 0.0)  # the first call starts the clock
    for step in range(1, 9):  # eight steps of 1/8 s, 1/16 s of them busy (exact in binary): a report each 0.5 s
        tick(step, 0.125, 0.0625)
    assert [(r.steps, r.wall, r.compute) for r in reports] == [(4, 0.5, 0.25), (4, 0.5, 0.25)]
    tick(0, radar.STEP_REPORT_INTERVAL, 0.1)
    assert len(reports) == 2  # counted from 0 again (a new epoch): a fresh start, not a negative count
    tick(3, radar.STEP_REPORT_INTERVAL, 0.25)
    assert (reports[-1].steps, reports[-1].compute) == (3, 0.25)


def test_flag_needs_the_ratio_over_the_median_of_the_others():
    def rank(number: int, per_step: float) -> RankRecord:
        record = RankRecord(rank=number)
        record.step_times.append(msg.StepTimes(rank=number, steps=10, wall=1.0, compute=10 * per_step))
        return record

    ranks = [rank(0, 0.010), rank(1, 0.011), rank(2, 0.0124), rank(3, 0.0138)]
    flag_stragglers(ranks)
    assert [straggler_text(r) for r in ranks] == ["", "", "", "25% slower compute"]
    ranks[3] = rank(3, 0.0137)  # just under 1.25 times the median of the others (0.011)
    flag_stragglers(ranks)
    assert not any(straggler_text(r) for r in ranks)
    alone = [rank(0, 0.05)]
    flag_stragglers(alone)
    assert alone[0].slower_by is None  # nobody to compare with
