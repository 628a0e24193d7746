"""The straggler radar (the rank the others wait for at their collectives; each rank's own compute per step, waits
in collectives left out) and the hardware columns (CPU, resident memory, GPU through NVML), with real ranks on
gloo."""

from __future__ import annotations

import itertools
import re
import time

import pytest

import ddpnb
from ddpnb.core import messages as msg
from ddpnb.core.record import RankRecord, RankState
from ddpnb.core.report import straggler_text, summary_table
from ddpnb.core.stragglers import FLOOR, Arrivals, flag_stragglers, lateness
from ddpnb.rank import radar
from ddpnb.views import html as render


def ddp_loop_with_a_slow_rank(rank: int, steps: int, slow: int, how: str = "compute") -> None:
    """A DDP training loop in which rank `slow` takes twice the others' time per step: `compute`, a second forward
    and backward (accumulated without a sync, as gradient accumulation does); `sleep`, a forward that waits 40 ms
    where the others' wait 20 ms (slow I/O, a sleeping device sync). Every rank keeps DDP's pace."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddpnb

    torch.manual_seed(0)
    width = 1536 if how == "compute" else 64  # compute: about 17 ms of CPU a forward and backward
    model = DistributedDataParallel(
        torch.nn.Sequential(
            torch.nn.Linear(256, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )
    )
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
    batch, target = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for step in range(steps):
        optimiser.zero_grad()
        if how == "sleep":
            time.sleep(0.04 if rank == slow else 0.02)
        elif rank == slow:
            with model.no_sync():
                torch.nn.functional.cross_entropy(model(batch), target).backward()
        loss = torch.nn.functional.cross_entropy(model(batch), target)
        loss.backward()
        optimiser.step()
        ddpnb.log(step=step, loss=loss.item())


@pytest.mark.parametrize("how, steps", [("compute", 150), ("sleep", 250)])
def test_the_rank_the_others_wait_for_is_the_only_straggler(how, steps):
    """4 ranks on this 2-core box, rank 3 at twice the others' step time, spent computing or asleep (where its
    compute per step is no larger than the others': the old measure missed it): rank 3 is flagged, live and at the
    end, and no other rank."""
    run = ddpnb.launch(ddp_loop_with_a_slow_rank, nprocs=4, args=(steps, 3, how), view="none", timeout=150)
    record = run.record
    live = ""
    deadline = time.monotonic() + 140
    while not run.done and time.monotonic() < deadline and not live:
        if straggler_text(record.ranks[3]) and record.ranks[3].state is RankState.RUNNING:
            live = render.ranks_html(record)  # the dashboard's row while the run goes on
        time.sleep(0.05)
    run.result()
    late = {r.rank: [round(s * 1000, 1) for s in r.late] for r in record.ranks}
    assert 'data-rank="3" data-state="running" data-straggler=' in live, f"not flagged live; ms late: {late}"
    flagged = {r.rank: straggler_text(r) for r in record.ranks if straggler_text(r)}
    assert list(flagged) == [3], f"expected only rank 3 flagged; flagged {flagged}; ms late per step: {late}"
    assert re.fullmatch(r"others wait \d+ ms a step for it", flagged[3]), flagged
    assert all(r.compute_per_step is not None for r in record.ranks), "a rank reported no compute"
    table = summary_table(record)
    assert "compute/step" in table and "others wait" in table.splitlines()[4], table
    rows = render.ranks_html(record)
    assert rows.count("data-straggler=") == 1 and 'data-rank="3" data-state="finished" data-straggler=' in rows


def quick_steps(rank: int, steps: int) -> None:
    """Steps of well under a millisecond, rank 3's a little slower: a difference no one should be told about."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddpnb

    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    for step in range(steps):
        time.sleep(0.0004 if rank == 3 else 0.0002)
        model(torch.ones(2, 4)).sum().backward()
        ddpnb.log(step=step)


def test_sub_millisecond_differences_flag_nobody():
    ddpnb.run(quick_steps, nprocs=4, args=(800,), view="none", timeout=120)
    record = ddpnb.last_run()
    assert all(len(r.late) >= 3 for r in record.ranks), "too few steps were compared to test anything"
    assert not any(straggler_text(r) for r in record.ranks), [list(r.late) for r in record.ranks]


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
    per_step = {
        r.rank: sum(t.compute for t in r.step_times) / sum(t.steps for t in r.step_times) for r in (worker, waiter)
    }
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
        f"rank 1's 200 MB not seen: {max(s.rss for s in holding)} vs {max(s.rss for s in quiet)} bytes"
    )
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


def test_step_clock_reports_on_steps_every_rank_shares_and_restarts_on_a_new_count(monkeypatch):
    """The clock's readings (the monotonic and wall clocks, the thread's busy time, the step's collectives) are
    stand-ins here, so each report's content is known exactly."""
    now, busy = [100.0], [7.0]
    clock_type = type(
        "Clock", (), {"monotonic": staticmethod(lambda: now[0]), "time_ns": staticmethod(lambda: int(now[0] * 1e9))}
    )
    monkeypatch.setattr(radar, "time", clock_type)
    monkeypatch.setattr(radar, "thread_busy", lambda: busy[0])
    asked: list[int] = []
    clock = radar.StepClock(arrivals=lambda since: (asked.append(since), (("0", len(asked), since + 1),))[1])
    reports = []

    def tick(step: int, later: float, computed: float) -> None:
        now[0] += later
        busy[0] += computed
        if (report := clock.tick(0, step)) is not None:
            reports.append(report)

    tick(0, 0.0, 0.0)  # the first call starts the clock
    for step in range(1, 17):  # steps of 1/8 s, 1/16 s of them busy (exact in binary)
        tick(step, 0.125, 0.0625)
    # the first report once half the interval went by, then every 4 steps (half a second), on multiples of 4
    assert [(r.step, r.steps, r.wall, r.compute) for r in reports] == [
        (2, 2, 0.25, 0.125),
        (4, 2, 0.25, 0.125),
        (8, 4, 0.5, 0.25),
        (12, 4, 0.5, 0.25),
        (16, 4, 0.5, 0.25),
    ]
    # each report carries the collectives issued since the step before it was logged
    assert [r.arrivals[0][2] - 1 for r in reports] == [int((100 + 0.125 * (r.step - 1)) * 1e9) for r in reports]
    tick(0, radar.STEP_REPORT_INTERVAL, 0.1)
    assert len(reports) == 5  # counted from 0 again (a new epoch): a fresh start, not a negative count
    for step in range(1, 35, 2):  # odd steps never fall on a multiple of 4: reports come anyway, unaligned
        tick(step, 0.25, 0.0)
    assert [r.step for r in reports[5:]] and all(r.step % 2 for r in reports[5:])


def test_lateness_is_against_the_median_of_the_others_at_the_worst_collective_of_the_step():
    ms = 1_000_000
    reports = {
        0: (("0", 7, 100 * ms), ("0", 8, 110 * ms)),
        1: (("0", 7, 101 * ms), ("0", 8, 111 * ms), ("1", 1, 500 * ms)),  # a subgroup's: left out
        2: (("0", 7, 99 * ms), ("0", 8, 112 * ms)),
        3: (("0", 7, 130 * ms), ("0", 8, 125 * ms)),
    }
    late = lateness(reports)
    assert {rank: round(seconds * 1000, 3) for rank, seconds in late.items()} == {0: 0.0, 1: 1.0, 2: 1.0, 3: 30.0}
    assert lateness({0: (("0", 1, 5),), 1: (("0", 2, 5),)}) == {}  # no collective in common: no verdict
    assert lateness({0: (("0", 1, 5),)}) == {}  # one rank: nobody to come after


def test_a_single_rank_run_with_steps_and_collectives_is_judged_by_nobody():
    # the notebooks' one-GPU path: one rank under DDP, logging steps (the kernel once failed on its reports)
    ddpnb.run(ddp_loop_with_a_slow_rank, nprocs=1, args=(40, 0, "sleep"), view="none", timeout=120)
    record = ddpnb.last_run()
    assert record.outcome.value == "succeeded" and record.ranks[0].holds_others is None
    records = [RankRecord(rank=0)]
    Arrivals().add(records, msg.StepTimes(rank=0, steps=4, wall=0.5, compute=0.1, step=4, arrivals=(("0", 1, 5),)))
    assert not records[0].late


def test_a_rank_is_flagged_only_over_the_floor_and_a_tenth_of_the_step():
    def ranks(step: float, late_of_3: float) -> list[RankRecord]:
        records = [RankRecord(rank=number) for number in range(4)]
        for record in records:
            record.add_step_times(msg.StepTimes(rank=record.rank, steps=10, wall=10 * step, compute=1.0))
            record.late.extend([late_of_3 if record.rank == 3 else 0.0] * 5)
        return records

    flagged = ranks(0.040, 0.020)
    flag_stragglers(flagged)
    assert [straggler_text(r) for r in flagged] == ["", "", "", "others wait 20 ms a step for it"]
    under_floor = ranks(0.010, 0.9 * FLOOR)  # 45% of the step, but under 5 ms
    flag_stragglers(under_floor)
    assert not any(straggler_text(r) for r in under_floor)
    small_share = ranks(1.0, 0.050)  # 50 ms, but 5% of the step
    flag_stragglers(small_share)
    assert not any(straggler_text(r) for r in small_share)
    alone = ranks(0.040, 0.020)[3:]
    flag_stragglers(alone)
    assert alone[0].holds_others is None  # nobody to wait for it


def test_a_step_is_judged_once_every_rank_reported_it():
    records = [RankRecord(rank=number) for number in range(2)]
    arrivals = Arrivals()

    def report(rank: int, step: int, ns: int) -> None:
        arrivals.add(
            records, msg.StepTimes(rank=rank, steps=4, wall=0.5, compute=0.1, step=step, arrivals=(("0", step, ns),))
        )

    report(0, 4, 0)
    assert not records[0].late  # rank 1's report of step 4 is still on its way
    report(1, 8, 0)  # rank 1 skipped step 4 (its pace said so): step 4 waits, step 8 has begun
    report(0, 8, 0)  # step 8 is judged; step 4, which rank 1 will never report, is dropped
    assert list(records[0].late) == [0.0] and list(records[1].late) == [0.0] and not arrivals.pending
    report(1, 12, 7_000_000)
    report(0, 12, 0)
    assert [round(late, 3) for late in records[1].late] == [0.0, 0.007]
