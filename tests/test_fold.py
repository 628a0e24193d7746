"""Folded output, many ranks, and metrics out (issue 17: acceptance 3, 4 and 6, and `metrics_frame`).

The folding rule is pinned on its own (`views.fold.Folder`, pure); then through a real kernel, where the text view
is what a notebook runner sees, and against the rank's log files. The many-ranks plot is read from the static
summary a real 8-rank run leaves in its cell; TensorBoard's event files are read back with TensorBoard's own reader.
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ddpnb
from ddpnb.core.record import OutputLine, RankRecord, RankState, RunRecord
from ddpnb.core.spec import Stream
from ddpnb.views import html as render
from ddpnb.views.fold import FOLD_WINDOW, Folder, rank_ranges
from tests.conftest import Kernel


def _line(seq: int, rank: int, text: str, stream: Stream = Stream.STDOUT) -> OutputLine:
    return OutputLine(seq, rank, stream, text)


def _shown(folded) -> list[str]:
    return [f"{line.tag} {line.text}" for line in folded]


# --- the folding rule, on its own ------------------------------------------------------------------------------


@pytest.mark.fast
def test_rank_ranges_are_compressed():
    assert rank_ranges([0, 1, 2, 5]) == "0-2,5"
    assert rank_ranges([3, 1, 2, 0]) == "0-3"
    assert rank_ranges([0, 1]) == "0,1"
    assert rank_ranges([0, 2, 3, 4, 7, 8]) == "0,2-4,7,8"
    assert rank_ranges([6]) == "6"


@pytest.mark.fast
def test_a_line_every_rank_printed_shows_once_at_once():
    folder = Folder(4)
    ready = folder.add([_line(i + 1, rank, "epoch 1 done") for i, rank in enumerate([2, 0, 3, 1])], now=0.0)
    assert _shown(ready) == ["[ranks 0-3] epoch 1 done"]  # no wait: every rank has printed it
    assert folder.waiting == 0


@pytest.mark.fast
def test_a_torch_warning_every_rank_printed_folds_without_its_rank_prefix_and_time():
    """torch's C++ warnings carry `[rankN]:` and a time to the nanosecond: one warning from two ranks is one line."""
    warning = "reducer.cpp:1400] Warning: find_unused_parameters=True was specified in DDP constructor"
    folder = Folder(2)
    ready = folder.add(
        [
            _line(1, 0, f"[rank0]:[W1201 19:22:41.862542944 {warning}"),
            _line(2, 1, f"[rank1]:[W1201 19:22:41.863001112 {warning}"),
        ],
        now=0.0,
    )
    assert _shown(ready) == [f"[ranks 0,1] [W1201 19:22:41.862542944 {warning}"]
    # another rank's prefix is the line's own text (a rank printing a peer's log), kept as printed
    alone = Folder(2)
    alone.add([_line(4, 0, "[rank1]:x")], now=0.0)
    assert _shown(alone.flush()) == ["[rank 0] [rank1]:x"]


@pytest.mark.fast
def test_a_line_some_ranks_print_waits_only_for_the_window():
    folder = Folder(4)
    assert folder.add([_line(1, 0, "loss 0.3"), _line(2, 2, "loss 0.3")], now=10.0) == []
    assert folder.ready(10.0 + FOLD_WINDOW / 2) == []
    assert _shown(folder.ready(10.0 + FOLD_WINDOW)) == ["[ranks 0,2] loss 0.3"]


@pytest.mark.fast
def test_folded_lines_keep_the_order_of_their_first_printing():
    folder = Folder(3)
    lines = [_line(1, 0, "a"), _line(2, 0, "b"), _line(3, 1, "a"), _line(4, 1, "b"), _line(5, 2, "b"), _line(6, 2, "a")]
    assert _shown(folder.add(lines, now=0.0)) == ["[ranks 0-2] a", "[ranks 0-2] b"]
    # a line not everyone printed holds back the complete ones behind it, so the order stays
    folder.add([_line(7, 0, "only rank 0"), _line(8, 0, "c"), _line(9, 1, "c"), _line(10, 2, "c")], now=1.0)
    assert folder.ready(1.1) == []
    assert _shown(folder.ready(1.0 + FOLD_WINDOW)) == ["[rank 0] only rank 0", "[ranks 0-2] c"]


@pytest.mark.fast
def test_a_rank_repeating_a_line_is_two_lines_not_one():
    folder = Folder(2)
    lines = [_line(1, 0, "step"), _line(2, 0, "step"), _line(3, 1, "step"), _line(4, 1, "step")]
    assert _shown(folder.add(lines, now=0.0)) == ["[ranks 0,1] step", "[ranks 0,1] step"]


@pytest.mark.fast
def test_a_copy_after_the_window_shows_on_its_own():
    folder = Folder(2)
    folder.add([_line(1, 0, "done")], now=0.0)
    assert _shown(folder.ready(FOLD_WINDOW)) == ["[rank 0] done"]
    assert folder.add([_line(2, 1, "done")], now=FOLD_WINDOW + 1) == []
    assert _shown(folder.flush()) == ["[rank 1] done"]


@pytest.mark.fast
def test_stdout_and_stderr_fold_apart():
    folder = Folder(2)
    ready = folder.add([_line(1, 0, "x"), _line(2, 1, "x", Stream.STDERR)], now=0.0)
    assert ready == []
    released = folder.flush()
    assert [(line.ranks, line.stream) for line in released] == [([0], Stream.STDOUT), ([1], Stream.STDERR)]


@pytest.mark.fast
def test_folding_off_passes_every_line_as_printed():
    folder = Folder(4, enabled=False)
    ready = folder.add([_line(i + 1, rank, "same") for i, rank in enumerate(range(4))], now=0.0)
    assert _shown(ready) == [f"[rank {rank}] same" for rank in range(4)]


# --- the dashboard's parts, from a record ----------------------------------------------------------------------


def _record(world_size: int) -> RunRecord:
    record = RunRecord(run_dir=Path("/tmp/ddpnb-run"), world_size=world_size, backend="gloo", function="train")
    record.current.ranks = [RankRecord(rank=r, state=RankState.RUNNING) for r in range(world_size)]
    return record


@pytest.mark.fast
def test_a_folded_line_in_the_log_panel_names_every_rank():
    html = render.line_html(0, Stream.STDOUT, "epoch 1 done", ranks=[0, 1, 2, 5])
    assert "[ranks 0-2,5]" in html and "epoch 1 done" in html
    assert "[rank 3]" in render.line_html(3, Stream.STDOUT, "mine")


@pytest.mark.fast
def test_the_static_summary_shows_folded_lines_and_counts_every_copy():
    record = _record(4)
    for rank in record.ranks:
        rank.lines = 2
    folder = Folder(4)
    lines = folder.add([_line(rank + 1, rank, "epoch 1 done") for rank in range(4)], now=0.0)
    lines += folder.add([_line(5, 2, "rank 2 only")], now=0.0) + folder.flush()
    html = render.summary_html(record, lines)
    assert '[ranks 0-3]</span><span class="ddpnb-text">epoch 1 done' in html
    assert '[rank 2]</span><span class="ddpnb-text">rank 2 only' in html
    assert "last 5 of 8 lines" in html  # the folded line stands for four printed lines


@pytest.mark.fast
@pytest.mark.parametrize("world_size, band", [(7, False), (8, True), (32, True)])
def test_from_eight_ranks_the_plot_is_rank_zero_the_median_and_the_band(world_size, band):
    record = _record(world_size)
    for rank in record.ranks:
        rank.metrics["loss"] = [(step, 0.0, 1.0 / (step + 1) + rank.rank) for step in range(10)]
    svg = render.plots_html(record)
    rank_lines = re.findall(r'<polyline data-rank="(\d+)"', svg)
    if band:
        assert rank_lines == ["0"]
        assert svg.count('<polygon class="ddpnb-band"') == 1 and svg.count('class="ddpnb-median"') == 1
    else:
        assert rank_lines == [str(r) for r in range(world_size)] and "<polygon" not in svg


@pytest.mark.fast
def test_the_rank_table_is_compact_from_eight_ranks():
    record = _record(16)  # below `groups.GROUP_FROM`: a row a rank, compact
    table = render.ranks_html(record)
    assert 'class="ddpnb-ranks ddpnb-compact"' in table and 'class="ddpnb-ranks-scroll"' in table
    assert len(re.findall(r'<tr data-rank="\d+"', table)) == 16
    assert "ddpnb-compact" not in render.ranks_html(_record(7))


def test_metrics_frame_without_pandas_says_how_to_install_it():
    code = textwrap.dedent("""
        import sys
        sys.modules["pandas"] = None  # as where pandas is not installed: its import raises ImportError
        from pathlib import Path
        from ddpnb.core.record import RunRecord
        try:
            RunRecord(run_dir=Path("/tmp"), world_size=1, backend="gloo").metrics_frame()
        except ImportError as exc:
            print("ERROR:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert "ERROR:" in done.stdout and "pip install pandas" in done.stdout, done.stdout + done.stderr


def test_tensorboard_without_tensorboard_is_refused_before_anything_starts(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["tensorboard"] = None
        import ddpnb
        try:
            ddpnb.launch(print, nprocs=2, view="none", tensorboard={str(tmp_path / "tb")!r})
        except ddpnb.LaunchError as exc:
            print("ERROR:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert "ERROR:" in done.stdout and "pip install tensorboard" in done.stdout, done.stdout + done.stderr
    assert not (tmp_path / "tb").exists()


# --- real runs -------------------------------------------------------------------------------------------------


def _logged(rank):
    import ddpnb

    for step in range(4):
        ddpnb.log(step=step, loss=1.0 / (step + 1) + rank, acc=0.1 * step)
    ddpnb.log(lr=0.5)  # no step
    return rank


FOLD_CELL = """%%ddp -n 4 {flags}
def same_lines(rank):
    import torch.distributed as dist
    for epoch in range(2):
        dist.barrier()
        print(f"epoch {{epoch}} done", flush=True)
    print(f"rank {{rank}} has its own line", flush=True)
    return rank
"""


def _log_dir(text: str) -> Path:
    return Path(re.search(r"logs in (\S+)", text).group(1))


@pytest.mark.slow
def test_four_ranks_printing_the_same_line_show_it_once_and_each_log_keeps_its_own(kernel):
    run = kernel.execute(FOLD_CELL.format(flags=""), timeout=240)
    assert run.error is None, run.text
    assert run.stdout.count("[ranks 0-3] epoch 1 done\n") == 1, run.stdout
    assert run.stdout.count("[ranks 0-3] epoch 0 done\n") == 1, run.stdout
    assert not re.search(r"\[rank \d\] epoch", run.stdout), run.stdout
    for rank in range(4):
        assert run.stdout.count(f"[rank {rank}] rank {rank} has its own line\n") == 1, run.stdout
        log = (_log_dir(run.stdout) / f"rank{rank}.log").read_text()
        assert log.count("epoch 1 done\n") == 1 and log.count("epoch 0 done\n") == 1, log


@pytest.mark.slow
def test_no_fold_shows_every_ranks_copy(kernel):
    run = kernel.execute(FOLD_CELL.format(flags="--no-fold"), timeout=240)
    assert run.error is None, run.text
    for rank in range(4):
        assert run.stdout.count(f"[rank {rank}] epoch 1 done\n") == 1, run.stdout
    assert "[ranks" not in run.stdout


@pytest.mark.slow
def test_a_session_cell_printing_on_every_rank_shows_the_line_once(kernel):
    started = kernel.execute("%ddp_start -n 2", timeout=240)
    assert started.error is None, started.text
    try:
        run = kernel.execute('%%ranks\nprint("hello from the session")', timeout=120)
        assert run.error is None, run.text
        assert run.stdout.count("[ranks 0,1] hello from the session\n") == 1, run.stdout
    finally:
        kernel.execute("%ddp_stop", timeout=60)


TENSORBOARD_CELL = """%%ddp -n 3 --tensorboard {directory}
def logged(rank):
    import ddpnb
    for step in range(6):
        ddpnb.log(step=step, loss=1.0 / (step + 1) + rank)
    return rank
"""


@pytest.mark.slow
def test_tensorboard_flag_writes_every_ranks_points_that_tensorboard_reads_back(kernel, tmp_path):
    pytest.importorskip("tensorboard")
    run = kernel.execute(TENSORBOARD_CELL.format(directory=tmp_path / "tb"), timeout=240)
    assert run.error is None, run.text
    (run_dir,) = (tmp_path / "tb").iterdir()  # one run: DIR/<run name>
    assert sorted(path.name for path in run_dir.iterdir()) == ["rank0", "rank1", "rank2"]
    for rank in range(3):  # read by TensorBoard's own reader (EventAccumulator)
        points = _tensorboard_points(run_dir / f"rank{rank}", "loss")
        assert points == [(step, pytest.approx(1.0 / (step + 1) + rank)) for step in range(6)], points


MANY_CELL = """%%ddp -n 8
def many(rank):
    import ddpnb
    import torch.distributed as dist
    for step in range(5):
        ddpnb.log(step=step, loss=float(step + rank))
    dist.barrier()
    print("all logged", flush=True)
    return rank
"""


@pytest.mark.slow
def test_eight_ranks_logging_loss_plot_a_band_not_eight_lines():
    kernel = Kernel(env={"DDPNB_VIEW": "widget"})
    try:
        kernel.execute("%load_ext ddpnb")
        run = kernel.execute(MANY_CELL, timeout=300)
        assert run.error is None, run.text
        summaries = [
            msg["content"]["data"]["text/html"]
            for msg in run.outputs
            if msg["msg_type"] == "update_display_data"
            and "data-ddpnb-summary" in msg["content"]["data"].get("text/html", "")
        ]
        assert summaries, [msg["msg_type"] for msg in run.outputs]
        summary = summaries[-1]
        assert summary.count('<tr data-rank="') == 8 and 'data-state="finished"' in summary
        # the summary's plots are SVG images (untrusted notebooks keep those): one per metric
        (svg,) = [
            base64.b64decode(data).decode() for data in re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', summary)
        ]
        assert re.findall(r'<polyline data-rank="(\d+)"', svg) == ["0"]  # rank 0's line, not one per rank
        assert svg.count('<polygon class="ddpnb-band"') == 1 and svg.count('class="ddpnb-median"') == 1
        # the all-ranks log (the summary keeps its last lines): the eight copies folded into one
        assert summary.count('[ranks 0-7]</span><span class="ddpnb-text">all logged') == 1, summary
    finally:
        kernel.shutdown()


def test_numpy_is_a_dependency_and_the_metrics_extras_are_in_the_test_extra():
    """torch warns "Failed to initialize NumPy" at import where numpy is missing (twice in the quickstart: the
    kernel and the forkserver); torchvision, tensorboard and pandas need numpy anyway."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("numpy") for dep in project["dependencies"])
    extras = project["optional-dependencies"]
    assert extras["tensorboard"] == ["tensorboard>=2.14"] and any(dep.startswith("pandas") for dep in extras["pandas"])
    assert any("tensorboard" in dep and "pandas" in dep for dep in extras["test"] if dep.startswith("ddpnb["))


def _logs_then_waits(rank, marker):
    import os
    import time

    import ddpnb

    for step in range(3):
        ddpnb.log(step=step, loss=float(step))
    deadline = time.monotonic() + 120
    while not os.path.exists(marker) and time.monotonic() < deadline:  # until the test has read the points
        time.sleep(0.05)
    return rank


def _tensorboard_points(path: Path, name: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not path.exists():
        return []
    reader = EventAccumulator(str(path))
    reader.Reload()
    if name not in reader.Tags()["scalars"]:
        return []
    return [(event.step, event.value) for event in reader.Scalars(name)]


@pytest.mark.slow
def test_tensorboard_files_fill_while_the_run_goes(tmp_path):
    pytest.importorskip("tensorboard")
    import time

    marker = tmp_path / "read"
    run = ddpnb.launch(_logs_then_waits, nprocs=2, view="none", args=(str(marker),), tensorboard=tmp_path / "tb")
    try:
        files = tmp_path / "tb" / run.record.run_dir.name
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(
            len(_tensorboard_points(files / f"rank{rank}", "loss")) < 3 for rank in (0, 1)
        ):
            time.sleep(0.2)
        assert not run.done  # read back while the ranks still run
        for rank in (0, 1):
            assert _tensorboard_points(files / f"rank{rank}", "loss") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    finally:
        marker.touch()
        run.wait(60)
    assert run.outcome is ddpnb.Outcome.SUCCEEDED


def _fails_in_the_first_attempt(rank):
    import ddpnb

    attempt = ddpnb.attempt()
    for step in range(2):
        ddpnb.log(step=step, loss=float(attempt))
    if attempt == 0 and rank == 1:
        raise ValueError("fails once")
    return rank


@pytest.mark.slow
def test_tensorboard_writes_each_attempt_of_a_restarted_run_as_its_own_run(tmp_path):
    pytest.importorskip("tensorboard")
    ddpnb.run(_fails_in_the_first_attempt, nprocs=2, max_restarts=1, view="none", tensorboard=tmp_path)
    files = tmp_path / ddpnb.last_run().run_dir.name
    assert _tensorboard_points(files / "rank1.attempt0", "loss") == [(0, 0.0), (1, 0.0)]
    for rank in (0, 1):
        assert _tensorboard_points(files / f"rank{rank}.attempt1", "loss") == [(0, 1.0), (1, 1.0)]
