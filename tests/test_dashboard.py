"""The live dashboard and background runs, through real kernels (issue 3).

Widget state is read the way a front end gets it: nbclient with `store_widget_state=True`, or the comm messages
a kernel publishes. The plain-text view is checked in terminal IPython (`ipython -c`).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from ddpnb.core.record import Outcome, OutputLine, RankRecord, RankState, RunRecord
from ddpnb.core.spec import Stream
from ddpnb.views import html as _html
from ddpnb.views.text import summary_text
from tests.conftest import Kernel, dashboards, wait_gone

pytestmark = pytest.mark.slow


TRAIN_CELL = """%%ddp -n 2
def train(rank, world_size):
    import ddpnb
    for step in range(25):
        ddpnb.log(step=step, loss=1.0 / (step + 1) + rank)
        print(f"step {step} on rank {rank}")
    return "trained"
"""

TQDM_CELL = """%%ddp -n 2
def bars(rank):
    from tqdm.auto import tqdm
    total = 0
    for i in tqdm(range(20000), desc="batches", mininterval=0, miniters=1):
        total += i
    return total
"""

FAILING_CELL = """%%ddp -n 2
def broken(rank):
    import time
    if rank == 1:
        raise ValueError("bad batch on rank 1")
    while True:  # until rank 1's failure stops the run
        time.sleep(0.1)
"""


# --- helpers -----------------------------------------------------------------------------------------------------


def _execute(cells: list[str], path: Path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell) for cell in cells])
    NotebookClient(
        nb, timeout=240, store_widget_state=True, allow_errors=True, resources={"metadata": {"path": str(path)}}
    ).execute()
    return nb


def _summary(cell: nbformat.NotebookNode) -> dict:
    """The static summary a finished run leaves in its cell."""
    shown = [out for out in cell.outputs if out.get("output_type") == "display_data"]
    assert len(shown) == 1, cell.outputs
    return shown[0]["data"]


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> nbformat.NotebookNode:
    """One notebook run through a real kernel with widget state stored, as a front end would save it."""
    path = tmp_path_factory.mktemp("dashboard")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("DDPNB_VIEW", raising=False)  # auto: a Jupyter kernel gets the dashboard
        env.setenv("DDPNB_RUNS_DIR", str(path / "runs"))
        nb = _execute(
            ["%load_ext ddpnb", TRAIN_CELL, TQDM_CELL, "import ddpnb\nrecord = ddpnb.last_run()", FAILING_CELL], path
        )
    nbformat.write(nb, path / "executed.ipynb")
    return nb


# --- through nbclient, widget state stored ----------------------------------------------------------------------


def test_widget_state_has_both_rank_rows_the_metric_series_and_finished(executed):
    train = dashboards(executed)[0]
    assert re.search(r'class="ddpnb-pill" data-state="finished"', train)
    for rank in (0, 1):
        assert f'<tr data-rank="{rank}" data-state="finished">' in train
        assert re.search(rf'<polyline data-rank="{rank}" data-points="25" ', train)
    points = re.search(r'<polyline data-rank="0" data-points="25" [^>]* points="([^"]+)"', train).group(1)
    assert len(points.split()) == 25
    assert '[rank 1]</span><span class="ddpnb-text">step 24 on rank 1' in train
    assert not [out for out in executed.cells[1].outputs if out.get("output_type") == "stream"]


def test_finished_run_leaves_a_static_summary_instead_of_the_widget(executed):
    summary = _summary(executed.cells[1])
    assert "application/vnd.jupyter.widget-view+json" not in summary
    html = summary["text/html"]
    assert "data-ddpnb-summary" in html and 'data-state="finished"' in html
    plots = [base64.b64decode(data).decode() for data in re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', html)]
    assert len(plots) == 1 and plots[0].count("<polyline") == 2  # the final plots, as images (untrusted: see docs)
    assert "step 24 on rank 0" in html
    assert "run succeeded" in summary["text/plain"] and "finished" in summary["text/plain"]
    result = [out for out in executed.cells[1].outputs if out.get("output_type") == "execute_result"]
    assert result[0]["data"]["text/plain"] == "'trained'"


def test_tqdm_in_a_worker_becomes_a_progress_bar_not_thousands_of_lines(executed):
    bars = dashboards(executed)[1]
    for rank in (0, 1):
        row = re.search(rf'<tr data-rank="{rank}" .*?</tr>', bars).group(0)
        assert re.search(r'data-n="20000" data-total="20000"', row), row
        assert "batches" in row and "20000/20000" in row
    shown_lines = bars.count('class="ddpnb-line')
    assert shown_lines <= 4, f"{shown_lines} lines reached the log panel"  # one final bar line per rank
    logs = _summary(executed.cells[2])["text/plain"].rsplit("full per-rank logs: ", 1)[1].strip()
    assert logs.endswith("/rank{0..1}.log"), logs
    assert "20000/20000" in (Path(logs).parent / "rank0.log").read_text(errors="replace")


def test_first_failure_traceback_shows_in_the_error_panel(executed):
    failing = dashboards(executed)[2]
    assert 'data-state="failed"' in failing
    assert "rank 1 failed first: ValueError: bad batch on rank 1" in failing
    # a foreground run: the traceback is shown once, in the cell's error; the panel says where it was raised
    assert "Cell In[" in failing and "the full traceback is in the cell's error below" in failing
    assert "raise ValueError(&quot;bad batch on rank 1&quot;)" not in failing
    summary = _summary(executed.cells[4])
    assert "bad batch on rank 1" in summary["text/html"]
    assert "WorkerError" not in summary["text/html"]
    errors = [out for out in executed.cells[4].outputs if out.get("output_type") == "error"]
    assert errors and "bad batch on rank 1" in "\n".join(errors[0]["traceback"])


# --- a real kernel driven through jupyter_client ------------------------------------------------------------------


@pytest.fixture(scope="module")
def widget_kernel(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("background")
    kernel = Kernel(env={"DDPNB_VIEW": "widget", "DDPNB_RUNS_DIR": str(path / "runs")})
    kernel.execute("%load_ext ddpnb\nimport ddpnb, os, time, psutil")
    kernel.execute("ddpnb.run(lambda: None, nprocs=1, view='none')", timeout=180)  # the forkserver is warm
    yield kernel
    kernel.shutdown()


def _value(kernel: Kernel, expression: str, timeout: float = 120) -> object:
    done = kernel.execute(f"print('<<' + __import__('json').dumps({expression}) + '>>')", timeout=timeout)
    assert done.error is None, done.error
    return json.loads(re.search(r"<<(.*)>>", done.stdout, re.DOTALL).group(1))


def _ran(kernel: Kernel, code: str, timeout: float = 120) -> None:
    """Run a cell that must succeed. `timeout` is only how long a stuck cell may take to fail the test: how fast
    cells run is measured in bench/, never asserted."""
    done = kernel.execute(code, timeout=timeout)
    assert done.error is None, done.error


FLOOD_CELL = """%%ddp -n 2 --background -o flood
def flood(rank):
    import os, sys, time
    write = sys.stdout.write
    burst = 0
    while burst < 200 or not os.path.exists(STOP_FILE):  # 200k lines a rank at least, then until the test says
        for i in range(burst * 1000, burst * 1000 + 1000):
            write(f"rank {rank} line {i:07d} of a flood that the dashboard must survive\\n")
        burst += 1
        time.sleep(0.015)
    print(f"flooded {burst * 1000} lines")
"""


def test_a_rank_printing_200k_lines_leaves_the_kernel_responsive_and_memory_bounded(widget_kernel, tmp_path):
    stop_file = tmp_path / "flood-stop"
    _ran(widget_kernel, FLOOD_CELL.replace("STOP_FILE", repr(str(stop_file))))
    widget_chars = []  # the live widgets' largest value, while the ranks flood (a finished run's are closed)
    try:
        for _ in range(3):  # unrelated cells run to the end while the ranks flood the kernel with output
            _ran(widget_kernel, "1 + 1")
            assert _value(widget_kernel, "flood.done") is False
            widget_chars.append(
                _value(
                    widget_kernel,
                    "max((len(w.value) for w in list(__import__('ipywidgets')"
                    ".Widget.widgets.values()) if isinstance(getattr(w, 'value', "
                    "None), str)), default=0)",
                )
            )
            time.sleep(0.2)
    finally:
        stop_file.touch()
    assert 0 < max(widget_chars) < 200_000, widget_chars
    assert _value(widget_kernel, "flood.wait().outcome.value", timeout=600) == "succeeded"
    written = _value(widget_kernel, "[int(open(r.log_path).readlines()[-1].split()[1]) for r in flood.record.ranks]")
    assert min(written) >= 200_000
    counts = _value(widget_kernel, "[sum(1 for _ in open(r.log_path, 'rb')) for r in flood.record.ranks]")
    assert counts == [n + 1 for n in written]  # every line is in the rank's log file
    assert _value(widget_kernel, "[r.lines for r in flood.record.ranks]") == counts
    sizes = _value(
        widget_kernel,
        """{
        "recent": len(flood.lines_since(0)[0]), "kept": __import__('ddpnb.core.output').core.output.KEEP_LINES,
        "newest": flood.lines_since(0)[0][-1].text,
    }""",
    )
    assert sizes["recent"] == sizes["kept"] == 2000, sizes  # of 400k lines and more, the newest 2,000 stay
    assert sizes["newest"].startswith("flooded "), sizes


BACKGROUND_CELL = """%%ddp -n 2 --background -o job
def forever(rank):
    import subprocess, time
    child = subprocess.Popen(["sleep", "600"])
    print(f"child {child.pid}", flush=True)
    while True:
        print("still training", flush=True)
        time.sleep(0.2)
"""


def test_background_run_returns_at_once_and_stop_ends_every_rank(widget_kernel):
    _ran(widget_kernel, BACKGROUND_CELL)  # the ranks never end on their own: the cell returned with them running
    _ran(widget_kernel, "x = 40 + 2")  # another cell runs while the ranks train
    assert _value(widget_kernel, "x") == 42
    assert _value(widget_kernel, "job.done") is False
    assert _value(widget_kernel, "job.status").startswith("running")
    deadline = time.monotonic() + 60
    children: list[int] = []
    while len(children) < 2 and time.monotonic() < deadline:
        time.sleep(0.3)
        children = _value(
            widget_kernel, "[int(t.split()[1]) for _, _, _, t in job.lines_since(0)[0] if t.startswith('child ')]"
        )
    ranks = _value(widget_kernel, "[r.pid for r in job.record.ranks]")
    assert len(children) == 2, "the ranks did not start their children"
    _ran(widget_kernel, "job.stop()")
    assert _value(widget_kernel, "[job.done, job.outcome.value]") == [True, "stopped"]
    assert wait_gone(ranks + children) == []


def test_stop_button_click_from_the_front_end_stops_a_background_run(widget_kernel):
    launched = widget_kernel.execute(BACKGROUND_CELL.replace("-o job", "-o clicked"), timeout=60)
    opened = {
        msg["content"]["comm_id"]: msg["content"]["data"]["state"]
        for msg in launched.outputs
        if msg["msg_type"] == "comm_open"
    }
    stop = [comm for comm, state in opened.items() if state.get("description") == "Stop"]
    assert len(stop) == 1 and opened[stop[0]]["disabled"] is False
    client = widget_kernel.client
    client.shell_channel.send(
        client.session.msg(
            "comm_msg", {"comm_id": stop[0], "data": {"method": "custom", "content": {"event": "click"}}}
        )
    )
    deadline = time.monotonic() + 120  # only how long a click that stops nothing takes to fail the test
    while not _value(widget_kernel, "clicked.done") and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _value(widget_kernel, "[clicked.outcome.value, clicked.record.note]") == ["stopped", "stopped by the user"]


TWO_RUNS = """first = ddpnb.launch(lambda rank: print("first", rank) or "one", nprocs=2)
second = ddpnb.launch(lambda rank: print("second", rank) or "two", nprocs=2)
"""


def test_two_background_runs_keep_their_own_dashboards_and_results(widget_kernel):
    launched = widget_kernel.execute(TWO_RUNS, timeout=60)
    assert launched.error is None, launched.error
    displays = [
        msg["content"]["transient"]["display_id"] for msg in launched.outputs if msg["msg_type"] == "display_data"
    ]
    assert len(set(displays)) == 2
    # each dashboard's own thread replaces its widget by its summary, the first maybe while the cell still runs
    summaries = {
        msg["content"]["transient"]["display_id"]: msg["content"]["data"]["text/plain"]
        for msg in launched.outputs
        if msg["msg_type"] == "update_display_data"
    }
    deadline = time.monotonic() + 120
    while len(summaries) < 2 and time.monotonic() < deadline:
        try:
            msg = widget_kernel.client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["msg_type"] == "update_display_data":
            summaries[msg["content"]["transient"]["display_id"]] = msg["content"]["data"]["text/plain"]
    assert set(summaries) == set(displays)
    finished = widget_kernel.execute("print(first.result(), second.result())", timeout=120)
    assert finished.stdout.strip() == "one two"
    run_dirs = [_value(widget_kernel, f"str({name}.record.run_dir)") for name in ("first", "second")]
    for display, run_dir in zip(displays, run_dirs):
        assert run_dir in summaries[display] and "succeeded" in summaries[display]


def test_background_run_result_returns_rank_zeros_value(widget_kernel):
    widget_kernel.execute("%%ddp -n 2 --background -o quick\ndef quick(rank):\n    return f'value of rank {rank}'")
    assert _value(widget_kernel, "quick.result()") == "value of rank 0"


LEAVERS = {  # a run of each way a run ends, the last two in the background
    "succeeded": "%%ddp -n 2\ndef fine(rank):\n    import ddpnb\n    ddpnb.log(step=0, loss=1.0)\n    return rank",
    "failed": "%%ddp -n 2\ndef broken(rank):\n    raise ValueError('bad batch')",
    "restarted": "%%ddp -n 2 --max-restarts 1\ndef flaky(rank):\n    import ddpnb\n"
    "    if ddpnb.attempt() == 0 and rank == 1:\n        raise ValueError('flaky')",
    "stopped": "%%ddp -n 2 --background -o stopped_run\ndef forever(rank):\n    import time\n"
    "    while True:\n        time.sleep(0.1)",
    "never waited for": "%%ddp -n 2 --background -o unwaited\ndef quick(rank):\n    return rank",
}
LIVE_WIDGETS = "sorted(__import__('ipywidgets').widgets.widget._instances)"


def test_a_finished_runs_widgets_are_all_closed_and_its_summary_stays_whatever_ended_it(widget_kernel):
    """The dashboard's ~45 widgets (plots, tables, buttons, boxes, their layouts and styles) are closed when its
    run ends: ipywidgets keeps every one, and the front end its model, until then. The summary stays in the cell."""
    _ran(widget_kernel, "import ddpnb\n[run.stop() for run in ddpnb.runs()]")  # an earlier test's runs, if any
    before = set(_value(widget_kernel, LIVE_WIDGETS))
    ended = {}
    for how, cell in LEAVERS.items():
        ended[how] = widget_kernel.execute(cell, timeout=120)
        opened = [msg for msg in ended[how].outputs if msg["msg_type"] == "comm_open"]
        assert len(opened) > 40, f"the {how} run showed no dashboard"
    assert ended["failed"].error is not None and ended["succeeded"].error is ended["restarted"].error is None
    assert _value(widget_kernel, "stopped_run.done") is False
    _ran(widget_kernel, "stopped_run.stop()")
    deadline = time.monotonic() + 60  # each dashboard closes its widgets in its own thread, a TICK at most after
    while (left := set(_value(widget_kernel, LIVE_WIDGETS)) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    kinds = _value(
        widget_kernel,
        f"[type(w).__name__ for i, w in __import__('ipywidgets').widgets.widget"
        f"._instances.items() if i in {sorted(left)!r}]",
    )
    assert not left, f"{len(left)} widgets of finished runs left: {kinds}"
    assert _value(widget_kernel, "[stopped_run.outcome.value, unwaited.done]") == ["stopped", True]
    for how in ("succeeded", "failed", "restarted"):  # what a saved notebook shows in the cell: the summary
        shown = [msg["content"]["data"] for msg in ended[how].outputs if msg["msg_type"] == "update_display_data"]
        assert shown and "data-ddpnb-summary" in shown[-1]["text/html"], how


# --- terminal IPython: the plain-text view ----------------------------------------------------------------------

STILL_RUNNING_CELL = """%%ddp -n 2 --background -o job
def waits(rank):
    import os, time
    print("started", flush=True)
    while not os.path.exists("saved"):  # until the notebook was saved
        time.sleep(0.1)
"""


def test_a_notebook_saved_mid_run_says_the_run_was_still_going_when_it_was_saved(tmp_path):
    """What nbclient saves of a cell whose run had not ended: the live widget's fallbacks say so, not the widget's
    promise that a summary will replace it (a saved notebook keeps them forever)."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("DDPNB_VIEW", raising=False)
        env.setenv("DDPNB_RUNS_DIR", str(tmp_path / "runs"))
        try:
            nb = _execute(
                [
                    "%load_ext ddpnb",
                    STILL_RUNNING_CELL,
                    "import time\nwhile not job.record.ranks[0].lines: time.sleep(0.1)",
                ],
                tmp_path,
            )
        finally:
            (tmp_path / "saved").touch()
    shown = [out["data"] for out in nb.cells[1].outputs if out.get("output_type") == "display_data"]
    assert len(shown) == 1 and "application/vnd.jupyter.widget-view+json" in shown[0], nb.cells[1].outputs
    for kind in ("text/plain", "text/html"):
        assert "waits on 2 ranks: still running when this notebook was saved" in shown[0][kind], shown[0][kind]
        assert "replaces" not in shown[0][kind]


def test_terminal_ipython_shows_rank_prefixed_lines_and_the_summary(tmp_path):
    cell = (
        "%%ddp -n 2\ndef hello(rank):\n    import ddpnb\n    ddpnb.log(step=0, loss=1.0)\n"
        "    print('hello from', rank)\n    return 7\n"
    )
    env = {**os.environ, "DDPNB_RUNS_DIR": str(tmp_path)}
    env.pop("DDPNB_VIEW", None)  # auto: text, since terminal IPython has no widgets
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--ext", "ddpnb", "--no-banner", "--colors=NoColor", "-c", cell],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[ddpnb] run succeeded" in out
    assert re.search(r"^\s+0\s+finished\s", out, re.MULTILINE) and re.search(r"^\s+1\s+finished\s", out, re.MULTILINE)
    assert re.search(r"^Out\[\d+\]: 7$", out, re.MULTILINE)  # IPython 8 numbers this cell 1, IPython 9 numbers it 0


# --- the renderers, without a kernel ----------------------------------------------------------------------------


def _record(world_size: int = 2) -> RunRecord:
    record = RunRecord(run_dir=Path("/tmp/run"), world_size=world_size, backend="gloo")
    record.current.ranks = [RankRecord(rank=r) for r in range(world_size)]
    return record


@pytest.mark.fast
def test_plots_thin_long_series_but_report_every_point():
    record = _record()
    for rank in record.ranks:
        rank.state = RankState.RUNNING
        rank.metrics["loss"] = [(step, 0.0, 1.0 / (step + 1)) for step in range(300_000)]
    svg = _html.plots_html(record)  # its cost is measured in bench/, not asserted here
    drawn = re.search(r'data-rank="1" data-points="300000" [^>]* points="([^"]+)"', svg).group(1)
    assert len(drawn.split()) <= _html.MAX_POINTS + 1


@pytest.mark.fast
def test_many_ranks_plot_rank_zero_and_the_spread():
    record = _record(world_size=16)
    for rank in record.ranks:
        rank.metrics["loss"] = [(step, 0.0, float(step + rank.rank)) for step in range(5)]
    svg = _html.plots_html(record)
    assert svg.count("<polyline data-rank=") == 1 and "<polygon" in svg and "min–max of all ranks" in svg


@pytest.mark.fast
def test_static_summary_escapes_what_the_ranks_print():
    record = _record()
    record.outcome = Outcome.SUCCEEDED
    record.ranks[0].last_line = record.ranks[0].last_text = "<script>alert(1)</script>"
    html = _html.summary_html(record, [OutputLine(1, 0, Stream.STDOUT, "<b>not bold</b>")])
    assert "<script>" not in html and "&lt;b&gt;not bold&lt;/b&gt;" in html


@pytest.mark.fast
def test_static_summary_keeps_the_runs_hint():
    record = _record()
    record.outcome = Outcome.SUCCEEDED
    record.current.hint = (
        "rebuilding the function took rank 0 2.5 s, importing 'torchvision', ... ddpnb.preload('torchvision')"
    )
    assert "ddpnb.preload(&#x27;torchvision&#x27;)" in _html.summary_html(record, [])
    assert record.hint in summary_text(record)


@pytest.mark.fast
def test_a_restarted_runs_summary_counts_the_lines_of_every_attempt():
    """After a restart the summary's last lines may come from an earlier attempt: its count of lines is the run's
    (what the log files hold), never only the last attempt's ('last 16 of 10 lines')."""
    from ddpnb.core.record import AttemptRecord

    record = _record()
    record.outcome = Outcome.SUCCEEDED
    earlier = [RankRecord(rank.rank, lines=8) for rank in record.ranks]
    record.attempts = [AttemptRecord(0, earlier, [], Outcome.FAILED, "rank 1 failed", 0.0, 1.0, last_line=16)]
    for rank in record.ranks:
        rank.lines = 5
    lines = [OutputLine(n, n % 2, Stream.STDOUT, f"line {n}") for n in range(26)]
    html = _html.summary_html(record, lines)
    total = 8 * len(record.ranks) + 5 * len(record.ranks)
    assert f">{total:,} lines · also in" in html, re.findall(r"[^>]*lines · ", html)  # all shown: no 'last 26 of 26'
    earlier[0].lines += 10  # more than the summary keeps
    assert f"last 26 of {total + 10:,} lines · every line is in" in _html.summary_html(record, lines)


_HELD: list = []  # a module's: kept past the function's return, so no sample taken as the rank exits sees it freed


def grows_memory_on_rank_1(rank: int) -> None:
    import time

    import torch

    for _ in range(5):  # rank 1: 40 MiB more each 0.8 s, touched so resident; rank 0 holds what it has
        if rank == 1:
            _HELD.append(torch.ones(10 * 2**20))
        time.sleep(0.8)


def test_the_memory_column_says_its_scale_a_growing_rank_from_lowest_to_highest_a_steady_one_steady():
    import ddpnb
    from ddpnb.core.report import hardware_text

    ddpnb.run(grows_memory_on_rank_1, nprocs=2, view="none", timeout=60)
    record = ddpnb.last_run()
    growing = hardware_text(record.ranks[1])[1]
    steady = hardware_text(record.ranks[0], points=3)[1]  # its last samples: it starts up before
    assert re.fullmatch(r"\d+\.\d MiB steady", steady), [s.rss for s in record.ranks[0].hardware]
    match = re.fullmatch(r"(\d+\.\d) MiB ([▁▂▃▄▅▆▇█]+) (\d+\.\d) MiB–(\d+\.\d) MiB", growing)
    assert match, growing
    assert match.group(2)[0] == "▁" and match.group(2)[-1] == "█", growing  # from its lowest to its highest
    assert float(match.group(4)) - float(match.group(3)) > 100, growing  # the growth, in numbers
    assert growing in _html.ranks_html(record).replace("\u00a0", " ")  # a number and its unit kept on one line


@pytest.mark.fast
def test_gpu_runs_show_each_ranks_gpu_memory():
    record = _record()
    assert "GPU memory" not in _html.ranks_html(record)  # CPU ranks: no such column
    record.ranks[0].device, record.ranks[1].device = "cuda:0", "cuda:1"
    record.ranks[1].gpu_memory = (3 * 2**30, 5 * 2**30)
    rows = _html.ranks_html(record)
    assert ">GPU memory</th>" in rows and "3.0 GiB" in rows and "peak 5.0 GiB" in rows


@pytest.mark.fast
def test_nice_ticks_are_round_and_cover_the_range():
    assert _html.nice_ticks(0.0, 1.0, 4) == [0.0, 0.5, 1.0]
    ticks = _html.nice_ticks(3.7, 1234.5, 5)
    assert ticks == [0.0, 500.0, 1000.0, 1500.0]
