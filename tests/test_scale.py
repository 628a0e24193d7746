"""Many ranks through the real kernel side: simulated nodes (bench/loadgen.py) that speak the remote layer's wire to
a real `Run`, its attempt, record and views; only the training is simulated."""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path

import pytest

import ddpnb
from ddpnb.core import report
from ddpnb.core.groups import GROUP_FROM
from ddpnb.core.record import Outcome, RankRecord, RankState, RunRecord

pytestmark = pytest.mark.fast

SIM = {"engine": "sim", "timeout": 60}


def train() -> None:
    """Never called: the simulated nodes play the ranks."""


def test_every_simulated_ranks_metrics_and_lines_arrive() -> None:
    run = ddpnb.launch(
        train, nprocs=32, view="none", ranks_per_node=8, steps=10, steps_per_second=10, lines_per_second=4, **SIM
    )
    assert run.result() == 10
    record = run.record
    assert record.outcome is Outcome.SUCCEEDED
    assert {rank.node for rank in record.ranks} == {f"sim{node}" for node in range(4)}
    for rank in record.ranks:
        assert [point.step for point in rank.metrics["loss"]] == list(range(1, 11)), rank.rank
        assert rank.lines >= 3, rank.rank
        assert rank.state is RankState.FINISHED


def test_many_ranks_read_at_a_glance_one_stalled_one_failed(capsys: pytest.CaptureFixture[str]) -> None:
    """From GROUP_FROM ranks up: the stall report says each place once (the stalled rank first, one stack each),
    the report and its table a row per state with the failed rank first, and all of it fits a screen."""
    ranks = 64  # two nodes' worth past GROUP_FROM: the report's words below are 64 ranks'
    run = ddpnb.launch(
        train,
        nprocs=ranks,
        view="text",
        ranks_per_node=8,
        steps=1000,
        steps_per_second=10,
        stall_rank=17,
        stall_at=1.5,
        fail_rank=40,
        fail_at=4.5,
        stall=1.5,
        **SIM,
    )
    with pytest.raises(ddpnb.WorkerError) as raised:
        run.result()
    shown = capsys.readouterr().out
    stall = shown[shown.index("[ddpnb] stalled") : shown.index("[ddpnb] run failed")].splitlines()
    assert stall[0].endswith(
        'rank 17 is in time.sleep (File "/tmp/ddpnb-loadgen-train.py", line 9); ranks 0-16,18-63 wait in all_reduce '
        '(File "/tmp/ddpnb-loadgen-train.py", line 10)'
    ), stall[0]
    assert [line for line in stall if line.startswith("[ddpnb] --- ")] == [
        "[ddpnb] --- ranks 0-16,18-63 ---",
        "[ddpnb] --- rank 17 ---",
    ]
    assert [re.sub(r"[\d.–]+ s since", "N s since", line) for line in stall[1:3]] == [  # a line per place
        '[ddpnb]   rank 17 is in time.sleep (File "/tmp/ddpnb-loadgen-train.py", line 9), N s since its last activity',
        (
            '[ddpnb]   ranks 0-16,18-63 wait in all_reduce (File "/tmp/ddpnb-loadgen-train.py", line 10), N s since their '
            "last activity"
        ),
    ]
    assert len(stall) <= 20, "\n".join(stall)
    report = raised.value.report().splitlines()
    assert report[0] == "ddpnb: rank 40 of 64 failed first: RuntimeError: simulated failure"
    table = report[report.index("64 ranks: 1 failed first, 63 stopped") :]
    assert table[2].startswith("failed first  rank 40 ") and table[3].startswith("stopped       ranks 0-39,41-63 ")
    assert len(report) <= 40, "\n".join(report)


def test_a_line_all_ranks_but_a_few_printed_is_tagged_so() -> None:
    from ddpnb.core.record import OutputLine
    from ddpnb.core.spec import Stream
    from ddpnb.views.fold import Folder

    folder = Folder(1024)
    lines = [OutputLine(rank, rank, Stream.STDOUT, "epoch 1") for rank in range(1024) if rank not in (17, 300)]
    (folded,) = folder.add(lines, 0.0) + folder.flush()
    assert folded.tag == "[ranks 0-1023 but 17, 300]"
    fewer = Folder(GROUP_FROM - 1)  # below the threshold, as always: ranges
    (folded,) = fewer.add([line for line in lines if line.rank < GROUP_FROM - 1], 0.0) + fewer.flush()
    assert folded.tag == f"[ranks 0-16,18-{GROUP_FROM - 2}]"


def test_a_series_keeps_every_point_in_bounded_memory() -> None:
    """1,024 ranks logging two values at 5 steps a second: the record keeps every point, its memory bounded (the
    points past the latest CHUNK go to an unlinked file), and reads them back as the points logged."""
    import pickle
    import tracemalloc

    from ddpnb.core.record import Point
    from ddpnb.core.series import CHUNK, SAMPLE, Series, Spill

    logged = [Point(step if step % 7 else None, 1000.0 + step, 1.0 / (step + 1)) for step in range(20_000)]
    tracemalloc.start()
    series = Series(Spill())
    before = tracemalloc.get_traced_memory()[0]
    for point in logged:
        series.add(*point)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < (CHUNK + 2 * SAMPLE) * 24 + 4096, grown  # 20,000 points as tuples: 3 MB
    assert len(series) == len(logged) and list(series) == logged and series == logged
    assert series[0] == logged[0] and series[-1] == logged[-1] and series[12_345] == logged[12_345]
    assert series[100:110] == logged[100:110] and series[::999] == logged[::999] and series[-3:] == logged[-3:]
    assert pickle.loads(pickle.dumps(series)) == logged
    drawn = series.sample(400)
    assert len(drawn) <= 401 and drawn[-1] == logged[-1] and drawn[0] == logged[0]
    times = [row[1] for row in drawn]
    assert times == sorted(set(times)) and all(logged[int(at - 1000.0)] == row for at, row in zip(times, drawn))


def test_past_its_share_of_the_spill_file_a_series_thins_its_oldest_points_and_the_file_stays_bounded() -> None:
    """The spill file's bound (`series.DISK`, shared by an attempt's series): every point kept until a series' share
    is full; then the latest points stay whole, the older ones thin by halves (oldest most), every kept point is one
    logged, in order; the file stops growing; `since(n)` follows the series by logged index while `len` shrinks."""
    from ddpnb.core.record import Point
    from ddpnb.core.series import CHUNK, CHUNK_BYTES, LEAST_CHUNKS, Series, Spill

    spill = Spill(disk=2 * 20 * CHUNK_BYTES)  # two series: 20 chunks each
    loss, lr = Series(spill), Series(spill)
    assert spill.share() == 20 and Spill(disk=0).share() == LEAST_CHUNKS
    logged = [Point(step if step % 7 else None, 1000.0 + step, 1.0 / (step + 1)) for step in range(200_000)]
    followed: list[tuple[int, Point]] = []
    for at, point in enumerate(logged):
        loss.add(*point)
        lr.add(point.step, point.time, 0.1)
        if at == 20 * CHUNK - 1:
            assert list(loss) == logged[: at + 1] and not loss.thinned  # a full share: every point still
            full = spill.size()
        if at % 5_000 == 0:
            followed += loss.since(followed[-1][0] + 1 if followed else 0)
    followed += loss.since(followed[-1][0] + 1)
    assert spill.size() <= full + 2 * CHUNK_BYTES  # one chunk a series between its write and its merge
    kept = list(loss)
    indices = [int(point.time - 1000.0) for point in kept]
    assert all(logged[index] == point for index, point in zip(indices, kept))
    assert indices == sorted(set(indices)) and indices[0] == 0 and kept[-1] == logged[-1]
    assert indices[-5 * CHUNK :] == list(range(len(logged) - 5 * CHUNK, len(logged)))  # a quarter of the share whole
    gaps = [b - a for a, b in itertools.pairwise(indices)]
    assert gaps == sorted(gaps, reverse=True) and gaps[0] >= 64  # thinner the older, by halves
    assert loss.thinned and len(loss) < loss.logged == len(logged) and "of 200,000 logged" in repr(loss)
    assert [index for index, _ in followed] == sorted({index for index, _ in followed})  # each point once, in order
    assert all(logged[index] == point for index, point in followed) and followed[-1][1] == logged[-1]
    assert loss.sample(400)[-1] == logged[-1] and loss[3] == kept[3] and loss[-1] == logged[-1]


def test_a_thousand_ranks_band_is_read_in_columns_of_the_same_steps_and_ends_at_the_latest() -> None:
    """From GROUP_FROM ranks up the band and median come from every rank's sample read column by column: the steps
    all ranks sampled, each with every rank's value there, then the latest step; ranks at other steps fall back to
    the point-by-point band."""
    from ddpnb.core.series import Series, Spill
    from ddpnb.views import html

    spill = Spill()
    logged: dict[int, Series] = {rank: Series(spill) for rank in range(GROUP_FROM)}
    for step in range(1001):
        for rank, series in logged.items():
            series.add(step, 1000.0 + step, step + rank / 100)
    steps, columns = html._band_columns(logged)
    columns = list(columns)
    assert steps[0] == 0 and steps[-1] == 1000 and len(steps) <= html.BAND_POINTS + 1 and steps == sorted(steps)
    assert all(column == tuple(step + rank / 100 for rank in range(GROUP_FROM)) for step, column in zip(steps, columns))
    logged[5].add(1001, 2001.0, 0.0)  # one rank a step ahead: its latest is not the others'
    steps, _ = html._band_columns(logged)
    assert steps[-1] < 1000
    other = Series(spill)
    for step in range(0, 2002, 2):
        other.add(step, 1000.0 + step, 0.0)
    assert html._band_columns({**logged, 7: other}) is None  # other steps: the band point by point
    record = RunRecord(run_dir=Path("/tmp/run"), world_size=GROUP_FROM, backend="gloo")
    record.current.ranks = [RankRecord(rank=rank) for rank in range(GROUP_FROM)]
    for rank in record.ranks:
        rank.metrics["loss"] = logged[rank.rank]
    svg = html.plots_html(record)
    assert svg.count('<polygon class="ddpnb-band"') == 1 and svg.count('class="ddpnb-median"') == 1


def test_ranks_whose_node_answers_nothing_are_said_as_not_reported_and_one_ranks_stack_can_be_asked() -> None:
    """From GROUP_FROM ranks up: a node that answers no stacks request is one line, `ranks 8-15 have not reported
    for N s`; `run.stacks(ranks=[...])` asks those ranks only, and the Stacks panel shows one stack per place."""
    from ddpnb.views.html import stacks_html

    run = ddpnb.launch(
        train,
        nprocs=GROUP_FROM,
        view="none",
        ranks_per_node=8,
        steps=1000,
        steps_per_second=10,
        stall_rank=17,
        stall_at=1.0,
        mute_node=1,
        stall=1.5,
        **SIM,
    )
    try:
        with pytest.raises(ValueError, match=f"this run's ranks are 0 to {GROUP_FROM - 1}; got \\[{GROUP_FROM}\\]"):
            run.stacks(ranks=[GROUP_FROM])
        deadline = time.monotonic() + 40
        while not run.record.stalled and time.monotonic() < deadline:
            run.wait(timeout=0.5)
        assert run.record.stalled
        summary = report.diagnosis_summary(run.record.stall.diagnosis)
        assert re.search(r"ranks 8-15 have not reported for [\d.]+ s", summary), summary
        assert "rank 17 is in time.sleep" in summary, summary
        lines = report.diagnosis_lines(run.record.stall.diagnosis)
        assert len(lines) == 3 and any(re.fullmatch(r"ranks 8-15 have not reported for [\d.]+ s", x) for x in lines)
        one = run.stacks(wait=20, ranks=[17, 9])  # a mute node: each collection waits it out
        assert sorted(one) == [9, 17] and one[9] == "" and "line 9" in one[17], one  # rank 9's node is mute
        panel = stacks_html(run.stacks(wait=20), GROUP_FROM)
        assert panel.count("<pre") == 2 and "ranks 8-15: no stack" in panel and "run.stacks(ranks=[17])" in panel
    finally:
        run.stop()


def test_a_redraw_builds_every_part_before_it_sets_any_widget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page takes a redraw as one change: every part's HTML is built (the plots the costliest) before the first
    widget is set, so its updates leave the kernel together, not a build's time apart."""
    pytest.importorskip("ipywidgets")
    from ddpnb.views import dashboard

    events: list[str] = []
    plots_html = dashboard.plots_html

    def built_plots(record: RunRecord) -> str:
        value = plots_html(record)
        events.append("built plots")
        return value

    monkeypatch.setattr(dashboard, "plots_html", built_plots)
    run = ddpnb.launch(train, nprocs=GROUP_FROM, view="none", ranks_per_node=8, steps=30, steps_per_second=10, **SIM)
    shown = dashboard.Dashboard(run, foreground=False)
    for name in ("header", "ranks", "plots", "log"):
        getattr(shown, name).observe(lambda change, name=name: events.append(f"set {name}"), names="value")
    render = shown._render
    monkeypatch.setattr(shown, "_render", lambda *args: (events.append("redraw"), render(*args))[1])
    assert run.result() == 30
    shown.finish()
    watched = events[events.index("redraw") :]  # the first redraw, in __init__, came before the observers
    redraws = [list(group) for is_mark, group in itertools.groupby(watched, lambda e: e == "redraw") if not is_mark]
    plotted = [redraw for redraw in redraws if "built plots" in redraw]
    assert plotted, events
    for redraw in plotted:
        assert redraw[0] == "built plots" and redraw.count("built plots") == 1, redraw
        assert {"set header", "set plots"} <= set(redraw), redraw
