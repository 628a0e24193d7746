"""What a new user saw go wrong in the views (issue 20's items 4-6 and 10, issue 17's error-panel file names), pinned
through real kernels and real ranks: the root cause of a failure stands out from its knock-ons, a traceback is shown
once in full, a segfault names the crash frame and keeps the rank's own last line, and rank colours never read as
states. The untrusted-notebook look (item 4) is checked in a real browser, in tests/test_browser.py."""

from __future__ import annotations

import ast
import base64
import colorsys
import ctypes
import json
import queue
import re
import time

import nbformat
import pytest
from nbclient import NotebookClient

from ddpnb.views import html as render
from tests.conftest import Kernel, dashboards

KNOCK_ON_CELL = """%%ddp -n 3
def peers_fail(rank):
    import os, signal, time, torch, torch.distributed as dist
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ranks 0 and 1 fail in the collective: knock-on failures
    here = os.environ["TEST_HANDSHAKE_DIR"]
    if rank == 2:
        while len([name for name in os.listdir(here) if name.startswith("at-all-reduce")]) < 2:
            time.sleep(0.01)  # until ranks 0 and 1 are at their all_reduce
        raise ValueError("bad batch on rank 2")
    open(os.path.join(here, f"at-all-reduce.{rank}"), "w").close()
    dist.all_reduce(torch.ones(1))
"""

SEGFAULT_CELL = """%%ddp -n 2
def crash(rank):
    import ctypes, time
    print("about to crash", flush=True)
    if rank == 1:
        ctypes.string_at(0)  # SIGSEGV: faulthandler's report follows on stderr
    time.sleep(60)  # until rank 1's crash stops the run
"""

RECORDS_CELL = """import json, ddpnb
crashed = ddpnb.last_run()
print("<<" + json.dumps({"last_line": crashed.ranks[1].last_line, "summary": crashed.failures[0].summary}) + ">>")
"""


def _dashboards(nb: nbformat.NotebookNode) -> dict[str, str]:
    """Each ddpnb dashboard's HTML by the function it runs."""
    return {name: html for html in dashboards(nb) for name in ("peers_fail", "crash") if f"{name} · local" in html}


def _row(html: str, rank: int) -> str:
    return re.search(rf'<tr data-rank="{rank}" .*?</tr>', html).group(0)


def _summary(cell: nbformat.NotebookNode) -> str:
    return next(out["data"]["text/html"] for out in cell.outputs if out.get("output_type") == "display_data")


def _error(cell: nbformat.NotebookNode) -> str:
    return "\n".join(next(out for out in cell.outputs if out.get("output_type") == "error")["traceback"])


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> nbformat.NotebookNode:
    """A notebook of failing runs executed through a real kernel with the dashboard, widget state stored."""
    path = tmp_path_factory.mktemp("first-hour")
    cells = ["%load_ext ddpnb", KNOCK_ON_CELL, SEGFAULT_CELL, RECORDS_CELL]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell) for cell in cells])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DDPNB_VIEW", "widget")
        env.setenv("DDPNB_RUNS_DIR", str(path / "runs"))
        env.setenv("TEST_HANDSHAKE_DIR", str(path))  # the ranks inherit the kernel's environment
        NotebookClient(
            nb, timeout=240, store_widget_state=True, allow_errors=True, resources={"metadata": {"path": str(path)}}
        ).execute()
    return nb


@pytest.mark.slow
def test_root_cause_stands_out_and_knock_on_ranks_read_as_consequences(executed):
    live = _dashboards(executed)["peers_fail"]
    summary = _summary(executed.cells[1])
    for html in (live, summary):  # the widget's rank table, and the static summary that replaces it
        root = _row(html, 2)
        assert 'data-role="root_cause"' in root and ">failed first\u00a0· exit\u00a01<" in root
        assert "color:#d32f2f;font-weight:700" in root
        for rank in (0, 1):
            knock_on = _row(html, rank)
            assert 'data-role="knock_on"' in knock_on and ">stopped: peer failed\u00a0· exit\u00a01<" in knock_on
            assert "color:#f57c00" in knock_on and "#d32f2f" not in knock_on


@pytest.mark.slow
def test_a_foreground_failure_shows_its_traceback_once_in_full_in_the_cell_error(executed):
    error = _error(executed.cells[1])
    assert 'raise ValueError("bad batch on rank 2")' in error  # in full, in the cell's error
    for html in (_dashboards(executed)["peers_fail"], _summary(executed.cells[1])):
        panel = html[html.index('class="ddpnb-error"') :]
        assert "rank 2 failed first: ValueError: bad batch on rank 2" in panel
        assert re.search(
            r"at Cell In\[\d+\], line \d+, in peers_fail; the full traceback is in the cell's error below", panel
        )  # where, as the text view names cells (issue 17), and no second traceback
        assert "raise ValueError" not in panel


@pytest.mark.slow
def test_gloo_messages_of_knock_on_ranks_read_the_same_whole_in_the_dashboard_and_the_text(executed):
    error = _error(executed.cells[1])
    consequences = re.findall(r"^  rank [01]: (RuntimeError: .*)$", error, re.MULTILINE)
    assert len(consequences) == 2
    panel = _summary(executed.cells[1])
    for message in consequences:
        assert message.endswith("GLHF! 🏖️")  # gloo's sign-off: not cut in the text
        assert message.replace("'", "&#x27;") in panel  # ... and the same, whole, in the dashboard


@pytest.mark.slow
def test_a_segfault_keeps_the_ranks_own_last_line_and_names_the_crash_frame(executed):
    shown = json.loads(re.search(r"<<(.*)>>", executed.cells[3].outputs[0]["text"]).group(1))
    assert shown["last_line"] == "about to crash"  # not the report's `Extension modules: ...`
    frame = r"killed by SIGSEGV in crash \(Cell In\[\d+\], line \d+\)"
    assert re.fullmatch(frame, shown["summary"])
    error = _error(executed.cells[2])
    assert re.search(rf"^ddpnb: rank 1 of 2 failed first: {frame}$", error, re.MULTILINE)
    assert "Fatal Python error: Segmentation fault" in error and re.search(r"Cell In\[\d+\], line \d+ in crash", error)
    assert "_watch_kernel" not in error and "ddpnb/" not in error  # the user's thread and frames only
    assert "threading.py" not in error  # nor ddpnb's hardware thread, whose own frames went
    for html in (_dashboards(executed)["crash"], _summary(executed.cells[2])):
        assert re.search(frame, html)  # the error panel names the crash frame
        row = _row(html, 1)
        assert "about to crash" in row and "Extension modules" not in row
        # the report shows once, in the error: the output log has its first line, pointing there
        assert "Current thread" not in html and "Fatal Python error: Segmentation fault (where: in the error" in html


BACKGROUND_CELL = """%%ddp -n 2 --background -o job
def fails_later(rank):
    import os, time
    while rank == 1 and not os.path.exists(os.environ["TEST_RELEASE"]):
        time.sleep(0.01)  # until the cell has ended: the test says so
    if rank == 1:
        raise ValueError("bad batch in the background")
    time.sleep(60)  # until rank 1's failure stops the run
"""


@pytest.mark.slow
def test_a_background_failure_shows_its_full_traceback_in_the_dashboard_with_cells_named(tmp_path):
    """A background run has no cell error to scroll to until `job.result()`: the summary its dashboard leaves in
    the cell (what the front end shows once the run ended, its widgets closed) keeps the traceback, with the cell
    named as the text view names it (`Cell In[3], line 6`), not ipykernel's temporary file."""
    release = tmp_path / "release"
    kernel = Kernel(env={"DDPNB_VIEW": "widget", "DDPNB_RUNS_DIR": str(tmp_path), "TEST_RELEASE": str(release)})
    try:
        kernel.execute("%load_ext ddpnb")
        assert kernel.execute(BACKGROUND_CELL, timeout=180).error is None
        release.touch()
        panel = ""  # the summary replaces the widget from the dashboard's own thread: read as the front end does
        deadline = time.monotonic() + 120
        while not panel and time.monotonic() < deadline:
            try:
                msg = kernel.client.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["msg_type"] == "update_display_data":
                panel = msg["content"]["data"]["text/html"]
    finally:
        kernel.shutdown()
    assert "data-ddpnb-summary" in panel and "bad batch in the background" in panel, panel[:300]
    assert "Traceback (most recent call last)" in panel and "raise ValueError(&quot;bad batch" in panel
    assert re.search(r"Cell In\[\d+\], line \d+, in fails_later", panel)
    assert "ipykernel_" not in panel


def _hue(colour: str) -> tuple[float, float]:
    r, g, b = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    hue, _, saturation = colorsys.rgb_to_hls(r, g, b)
    return hue * 360, saturation


def test_no_rank_colour_is_a_state_colour_nor_near_the_failure_red_or_the_warning_orange():
    states = {colour.lower() for colour in render.STATE_COLOURS}
    assert not states & {colour.lower() for colour in render.RANK_COLOURS}
    for alarm in (render._RED, render._ORANGE):
        alarm_hue, _ = _hue(alarm)
        for colour in render.RANK_COLOURS:
            hue, saturation = _hue(colour)
            distance = min(abs(hue - alarm_hue), 360 - abs(hue - alarm_hue))
            assert distance > 30 or saturation < 0.2, f"{colour} reads like {alarm}"


def test_static_summary_has_no_style_block_no_svg_and_only_sanitiser_safe_inline_values(tmp_path):
    """What JupyterLab's sanitiser strips from an untrusted notebook's HTML must not carry the summary's look: no
    <style>, no <svg> (the plots are images), no `var(...)` in inline styles."""
    from ddpnb.core.record import AttemptRecord, Outcome, RankRecord, RankState, RunRecord

    record = RunRecord(
        run_dir=tmp_path,
        world_size=2,
        backend="gloo",
        function="train",
        current=AttemptRecord(0, [RankRecord(rank=r, state=RankState.FINISHED) for r in range(2)]),
        outcome=Outcome.SUCCEEDED,
    )
    for rank in record.ranks:
        rank.metrics["loss"] = [(step, 0.0, 1.0 / (step + 1)) for step in range(10)]
    html = render.summary_html(record, [])
    assert "<style" not in html and "<svg" not in html and "var(" not in html
    images = re.findall(
        r'<img class="ddpnb-plot-image" src="data:image/svg\+xml;base64,([^"]+)" width="400" '
        r'height="160"',
        html,
    )
    assert len(images) == 1 and base64.b64decode(images[0]).decode().count("<polyline") == 2
    header = re.sub(r"<[^>]+>", "", render.header_html(record))  # the header's text, markup gone
    assert header.startswith("ddpnb finished train · local")


def test_faulthandler_report_is_told_apart_from_the_ranks_own_stderr():
    from ddpnb.core.stacks import CrashDump

    crash = CrashDump()
    report = [
        "Fatal Python error: Segmentation fault",
        "",
        "Current thread 0x00007f (most recent call first):",
        f'  File "{ctypes.__file__}", line 519 in string_at',
        '  File "/home/me/train.py", line 6 in crash',
        "",
        "Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)",
    ]
    assert crash.own_lines(["warming up", *report[:3]]) == ["warming up"]
    assert crash.own_lines(report[3:]) == []
    assert crash.complete and crash.crash_frame() == ("/home/me/train.py", 6, "crash")
    assert CrashDump().own_lines(["Fatal Python error: x", "my own line"]) == ["my own line"]  # a report cut short


def test_run_stacks_read_like_a_traceback_naming_the_cell_with_its_source(tmp_path):
    """Issue 28: `run.stacks()` for a function defined in a plain cell, on every rank: oldest call first, the cell
    named as IPython names it (`Cell In[N], line K`) with its source line, the collective a rank waits in; no
    ipykernel temp path, no ddpnb thread, no torch logging wrapper (`c10d_logger`)."""
    kernel = Kernel(env={"DDPNB_RUNS_DIR": str(tmp_path)})
    go = tmp_path / "go"
    try:
        kernel.execute("import os, time, torch, torch.distributed as dist\nimport ddpnb")
        kernel.execute(f"""def waits(rank):
    print("up", flush=True)
    while rank == 1 and not os.path.exists({str(go)!r}):
        time.sleep(0.05)
    dist.all_reduce(torch.ones(1))
""")
        shown = kernel.execute(
            "run = ddpnb.launch(waits, nprocs=2, view='none')\n"
            "while not all(r.last_line == 'up' for r in run.record.ranks): time.sleep(0.1)\n"
            "stacks = run.stacks()\n"
            f"open({str(go)!r}, 'w').close()\n"
            "print(run.wait().outcome.value)\n"
            "print(repr(stacks[0]))\nprint(repr(stacks[1]))",
            timeout=120,
        )
        assert shown.error is None, shown.text
        outcome, *texts = shown.stdout.strip().splitlines()[-3:]
        stacks = [ast.literal_eval(text) for text in texts]
    finally:
        kernel.shutdown()
    assert outcome == "succeeded"
    for stack in stacks:
        assert stack.startswith("Stack (most recent call last):\n"), stack
        assert re.search(r"^  Cell In\[\d+\], line \d+, in waits$", stack, re.MULTILINE), stack
        assert "ipykernel" not in stack and "c10d_logger" not in stack and "ddpnb" not in stack, stack
        assert "other thread" in stack  # ddpnb's sampling thread, left out and counted
    assert "\n    time.sleep(0.05)\n" in stacks[1] and "all_reduce" not in stacks[1]
    waiting = stacks[0].splitlines()
    cell = next(i for i, line in enumerate(waiting) if line.startswith("  Cell In["))
    assert waiting[cell + 1] == "    dist.all_reduce(torch.ones(1))"
    assert waiting[cell + 2].endswith(", in all_reduce"), stacks[0]  # the collective, after the cell's frame


def test_the_first_failures_locals_are_kept_in_the_record_and_shown_under_its_traceback(tmp_path):
    """Issue 29, item 5: without any debugger, the failing rank's frames keep their locals as bounded reprs: in
    `record.first_failure.frames` after the process is gone, and in the text view under the traceback (a tensor by
    its shape, dtype and first values, an int as itself, a long string cut)."""
    kernel = Kernel(env={"DDPNB_RUNS_DIR": str(tmp_path), "DDPNB_VIEW": "text"})
    try:
        kernel.execute("%load_ext ddpnb\nimport ddpnb")
        failed = kernel.execute(
            """%%ddp -n 2
def train(rank):
    import torch
    batch = torch.arange(32.0).reshape(8, 4)
    step = 3
    note = "x" * 1000
    if rank == 1:
        raise ValueError("bad batch")
""",
            timeout=120,
        )
        frames = kernel.execute(
            "first = ddpnb.last_run().first_failure\nprint(repr([(f.function, dict(f.values)) for f in first.frames]))"
        )
    finally:
        kernel.shutdown()
    assert failed.error is not None and failed.error["ename"] == "WorkerError", failed.text
    kept = ast.literal_eval(frames.stdout.strip())
    assert [name for name, _ in kept] == ["train"], kept
    values = kept[0][1]
    assert values["step"] == "3" and values["rank"] == "1"
    assert values["batch"] == ("tensor(shape=(8, 4), dtype=torch.float32, device=cpu, values=[0.0, 1.0, 2.0, 3.0]...)")
    assert len(values["note"]) <= 200 and values["note"].startswith("'xxx")
    assert "torch" not in values  # a module: the code names it
    report = "\n".join(failed.error["traceback"])
    assert re.search(r"--- rank 1 locals where it raised ---\nCell In\[\d+\], line \d+, in train:\n", report), report
    assert "    step = 3\n" in report
