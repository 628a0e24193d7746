"""`--profile` (issue 30): torch.profiler over chosen steps on every rank, one merged trace on one time base, and
each rank's step time broken down, with real ranks on gloo; the breakdown's rules on hand-made events."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import ddpnb
from ddpnb.core.profile import PARTS, STEP_SPAN, breakdown, merge, profile_steps
from ddpnb.core.spec import LaunchError
from ddpnb.views.html import summary_html
from ddpnb.views.profile import bars_svg, profile_html, profile_text


def ddp_with_a_slow_forward(rank: int, world_size: int, steps: int) -> str:
    """A DDP loop in which rank 1's forward does twice the work (its model runs its layers twice)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ddpnb

    class Net(torch.nn.Module):
        def __init__(self, repeats: int) -> None:
            super().__init__()
            self.repeats = repeats
            # much compute on few parameters: the all_reduce of the gradients is small, so it ends on both ranks
            # together unless a thread waits for a CPU
            self.net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum(self.net(x) for _ in range(self.repeats))

    torch.manual_seed(0)
    model = DistributedDataParallel(Net(2 if rank == 1 else 1))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.001)
    batch = torch.randn(4096, 256)  # steps long enough that load from elsewhere averages out
    for step in range(steps):
        optimiser.zero_grad()
        model(batch).square().mean().backward()
        optimiser.step()
        ddpnb.log(step=step)
    return "trained"


def _trace(path: Path) -> dict:
    with gzip.open(path, "rb") as file:
        return json.load(file)


def _all_reduce_ends_apart(events: list[dict], pid_of: dict[int, int]) -> float:
    """Milliseconds between the ends of the same all_reduce (the k-th of each rank) on ranks 0 and 1: the median
    over the profiled steps' all_reduces. A clock offset moves every pair alike; on a loaded machine one rank's
    gloo thread waiting for a CPU moves one pair."""
    ends: dict[int, list[float]] = defaultdict(list)
    for event in sorted((e for e in events if e.get("name") == "gloo:all_reduce"), key=lambda e: e["ts"]):
        ends[event["pid"]].append(event["ts"] + event["dur"])
    pairs = list(zip(ends[pid_of[0]], ends[pid_of[1]]))
    assert len(pairs) >= 3 and len(ends[pid_of[0]]) == len(ends[pid_of[1]]), dict(ends)
    return statistics.median(abs(a - b) / 1000 for a, b in pairs)


def test_profiled_steps_merge_into_one_aligned_trace_that_names_the_rank_waited_for(tmp_path):
    assert ddpnb.run(ddp_with_a_slow_forward, nprocs=2, args=(9,), profile="5-7", view="none", timeout=120) == "trained"
    profile = ddpnb.last_run().profile
    assert profile is not None and profile.trace is not None, profile
    assert profile.trace.parent == ddpnb.last_run().run_dir / "profile"
    assert sorted(p.name for p in profile.trace.parent.iterdir()) == [
        "rank0.pt.trace.json.gz",
        "rank1.pt.trace.json.gz",
        "trace.json.gz",
    ]

    events = _trace(profile.trace)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == [f"rank 0 ({os.uname().nodename}, cpu)", f"rank 1 ({os.uname().nodename}, cpu)"]
    pid_of = {int(name.split()[1]): pid for pid, name in names.items()}
    assert {e["pid"] for e in events} == set(names)  # every event in a rank's process
    for rank, pid in pid_of.items():
        steps = sorted(e["name"] for e in events if e["pid"] == pid and e["name"].startswith(STEP_SPAN))
        assert steps == [f"{STEP_SPAN}5", f"{STEP_SPAN}6", f"{STEP_SPAN}7"], (rank, steps)

    # the same all_reduce ends at the same moment on both ranks, on the merged time base
    apart = _all_reduce_ends_apart(events, pid_of)
    assert apart <= 5
    # ... and so it does when rank 1's clock reads 37 ms ahead on another machine (its own trace, shifted, merged
    # again): the offset measured at the start undoes the shift to well within a millisecond
    shifted = tmp_path / "rank1.pt.trace.json.gz"
    ahead = _trace(profile.rank_traces[1])
    ahead["baseTimeNanoseconds"] += 37_000_000
    shifted.write_bytes(gzip.compress(json.dumps(ahead).encode()))
    merge(
        {0: profile.rank_traces[0], 1: shifted},
        {0: "rank 0", 1: "rank 1"},
        tmp_path / "trace.json.gz",
        {0: "here", 1: "elsewhere"},
    )
    again = _trace(tmp_path / "trace.json.gz")
    offset = next(r["offset_us"] for r in again["ddpnb"]["ranks"] if r["rank"] == 1)
    assert abs(offset - 37_000) < 1000, offset
    assert _all_reduce_ends_apart(again["traceEvents"], {0: 1, 1: 2}) == pytest.approx(apart, abs=1)

    # the breakdown: rank 0 waited for rank 1, and each rank's parts add up to its step
    waiters, slow, shares = profile.waited()
    assert (waiters, slow) == ([0], 1), profile.ranks
    rank0, rank1 = profile.ranks
    assert rank0.share("waiting") > rank1.share("waiting"), profile.ranks
    for rank in profile.ranks:
        assert rank.spans == 3
        assert sum(getattr(rank, part) for part in PARTS) == pytest.approx(rank.step, rel=0.05), rank
        assert rank.top_ops and rank.top_ops[0][1] > 0
    text = profile_text(profile)
    assert text.startswith(
        f"[ddpnb] profile of steps 5-7: rank 0 waited {round(shares[0] * 100)}% of the step for rank 1"
    ), text
    assert str(profile.trace) in text
    assert 'data-rank="0" data-part="waiting"' in bars_svg(profile)
    page = profile_html(profile)  # in the static summary: what JupyterLab's sanitiser keeps (no <svg>, <style>)
    assert "rank 0 waited" in page and 'class="ddpnb-profile-bars"' in page
    assert "<svg" not in page and "<style" not in page and "var(" not in page
    assert page in summary_html(ddpnb.last_run(), [])


def test_the_merged_trace_loads_in_perfettos_trace_processor(tmp_path):
    """Where perfetto's Python package and its trace processor binary are here (it downloads the binary on first
    use, so offline machines need $PERFETTO_TRACE_PROCESSOR pointing at one)."""
    processor = pytest.importorskip("perfetto.trace_processor")
    binary = os.environ.get("PERFETTO_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")
    if not binary:
        pytest.skip("no trace_processor_shell here (set PERFETTO_TRACE_PROCESSOR to one)")
    ddpnb.run(ddp_with_a_slow_forward, nprocs=2, args=(9,), profile="5-7", view="none", timeout=120)
    trace = ddpnb.last_run().profile.trace
    plain = tmp_path / "trace.json"
    plain.write_bytes(gzip.decompress(trace.read_bytes()))
    loaded = processor.TraceProcessor(trace=str(plain), config=processor.TraceProcessorConfig(bin_path=binary))
    try:
        rows = loaded.query("select name from process where name like 'rank %' order by name").as_pandas_dataframe()
        steps = loaded.query(f"select count(*) as n from slice where name like '{STEP_SPAN}%'").as_pandas_dataframe()
    finally:
        loaded.close()
    assert [name.split(" (")[0] for name in rows["name"]] == ["rank 0", "rank 1"]
    assert int(steps["n"][0]) == 6


def trains_and_reports_what_was_loaded(rank: int) -> dict:
    import torch
    import torch.distributed as dist

    import ddpnb

    enabled = False
    for step in range(6):
        dist.all_reduce(torch.ones(4))
        ddpnb.log(step=step)
        enabled = enabled or torch._C._autograd._profiler_enabled()
    return {"imported": "ddpnb.rank.profile" in sys.modules, "enabled": enabled}


def test_without_profile_the_ranks_neither_import_nor_start_the_profiler():
    seen = ddpnb.run(trains_and_reports_what_was_loaded, nprocs=2, view="none", timeout=60)
    assert seen == {"imported": False, "enabled": False}
    record = ddpnb.last_run()
    assert record.profile is None and not (record.run_dir / "profile").exists()


def profiles_a_region(rank: int) -> None:
    import torch
    import torch.distributed as dist

    import ddpnb

    dist.all_reduce(torch.ones(4))
    with ddpnb.profile():
        for _ in range(3):
            dist.all_reduce(torch.ones(1000))
    with ddpnb.profile():  # a second region: said once, not profiled
        dist.all_reduce(torch.ones(4))


def test_a_profile_region_is_one_span_on_every_rank(capfd):
    ddpnb.run(profiles_a_region, nprocs=2, view="text", timeout=60)
    profile = ddpnb.last_run().profile
    assert profile.steps == "the ddpnb.profile() region" and [r.spans for r in profile.ranks] == [1, 1]
    events = _trace(profile.trace)["traceEvents"]
    assert sum(e.get("name") == "ddpnb.profile" for e in events) == 2
    out = capfd.readouterr()
    assert "[ddpnb] profile of the ddpnb.profile() region:" in out.out
    assert "a run profiles once per attempt" in out.err


def test_steps_the_run_never_reaches_are_said_not_silently_missing():
    ddpnb.run(trains_and_reports_what_was_loaded, nprocs=2, profile="50-52", view="none", timeout=60)
    profile = ddpnb.last_run().profile
    assert profile.trace is None and not profile.ranks
    assert "nothing was profiled: the last step logged was 5" in profile_text(profile), profile.notes
    assert profile_text(profile).startswith("[ddpnb] profile of steps 50-52: no trace to show")


def fails_once_after_the_profile(rank: int) -> None:
    import torch
    import torch.distributed as dist

    import ddpnb

    for step in range(5):
        dist.all_reduce(torch.ones(4))
        ddpnb.log(step=step)
    if ddpnb.attempt() == 0 and rank == 1:
        raise RuntimeError("first attempt fails")


def test_each_attempt_has_its_own_trace():
    ddpnb.run(fails_once_after_the_profile, nprocs=2, profile="2-3", max_restarts=1, view="none", timeout=60)
    record = ddpnb.last_run()
    assert record.attempt == 1 and record.profile.attempt == 1
    for attempt in (0, 1):
        folder = record.run_dir / "profile" / f"attempt{attempt}"
        assert (folder / "trace.json.gz").is_file(), sorted(record.run_dir.rglob("*"))
    assert record.profile.trace == record.run_dir / "profile" / "attempt1" / "trace.json.gz"


def test_profile_cell_says_where_the_step_time_went(kernel):
    result = kernel.execute(
        "%%ddp -n 2 --profile 2-3\n"
        "def train(rank):\n"
        "    import torch, torch.distributed as dist\n"
        "    for step in range(5):\n"
        "        dist.all_reduce(torch.ones(1000))\n"
        "        ddpnb.log(step=step)\n",
        timeout=120,
    )
    assert result.error is None, result.error
    assert "[ddpnb] profile of steps 2-3:" in result.stdout, result.text
    assert "merged trace (Perfetto UI, chrome://tracing):" in result.stdout
    assert "compute" in result.stdout and "waiting" in result.stdout


@pytest.mark.parametrize(
    "given, steps",
    [(True, (3, 5)), ("5-7", (5, 7)), ("4", (4, 4)), (6, (6, 6)), ((2, 9), (2, 9)), (None, None), (False, None)],
)
def test_profile_takes_a_range_of_steps(given, steps):
    assert profile_steps(given) == steps


@pytest.mark.parametrize("given", ["0-2", "7-5", "a-b", "5-", -1, 1.5])
def test_profile_refuses_steps_it_cannot_count(given):
    with pytest.raises(LaunchError, match="FIRST-LAST"):
        profile_steps(given)


def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "cat": cat}


def test_waiting_is_the_part_of_a_collective_before_the_last_rank_came():
    """Rank 0 computes 0-300 µs, rank 1 0-700; both all_reduce until 900. Rank 0 waited 400 µs for rank 1."""
    events = {
        0: [
            _x(f"{STEP_SPAN}1", 0, 1000, cat="user_annotation"),
            _x("aten::mm", 0, 300),
            _x("gloo:all_reduce", 300, 600, tid=2, cat="user_annotation"),
        ],
        1: [
            _x(f"{STEP_SPAN}1", 0, 1000, cat="user_annotation"),
            _x("aten::mm", 0, 700),
            _x("gloo:all_reduce", 700, 200, tid=2, cat="user_annotation"),
        ],
    }
    rank0, rank1 = breakdown(events, {0: "rank 0", 1: "rank 1"})
    assert rank0.waiting == pytest.approx(400e-6) and rank0.waited_for == {1: pytest.approx(400e-6)}
    assert rank0.communication == pytest.approx(200e-6) and rank0.compute == pytest.approx(300e-6)
    assert rank1.waiting == 0 and rank1.communication == pytest.approx(200e-6)
    for rank in (rank0, rank1):
        assert rank.other == pytest.approx(100e-6)
        assert sum(getattr(rank, part) for part in PARTS) == pytest.approx(rank.step)


def fails_before_the_profiled_steps(rank: int) -> None:
    import ddpnb

    ddpnb.log(step=0)
    raise ValueError("not even step 1")


def test_a_run_that_ends_before_its_profile_says_so():
    with pytest.raises(ddpnb.WorkerError):
        ddpnb.run(fails_before_the_profiled_steps, nprocs=2, profile="2-3", view="none", timeout=60)
    profile = ddpnb.last_run().profile
    assert profile.trace is None and "no rank sent a profile" in profile_text(profile)
