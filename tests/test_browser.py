"""The dashboard in a real browser: JupyterLab on 127.0.0.1, Debian's Chromium driven by Playwright.

No browser is downloaded: Playwright drives /usr/bin/chromium (`apt-get install chromium`). The test is skipped,
saying why, only where that Chromium, JupyterLab or Playwright is missing; CI installs all three.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from tests import jupyterlab
from tests.jupyterlab import CHROMIUM, CHROMIUM_ARGS, IDLE, NOTEBOOK
from tests.jupyterlab import accept_kernel_dialog as _accept_kernel_dialog
from tests.jupyterlab import open_notebook as _open
from tests.jupyterlab import run_cell as _run_cell

REPO = Path(__file__).resolve().parents[1]
# the README's pictures: rewritten only when asked (DDPNB_UPDATE_SCREENSHOTS=1), else kept beside the notebooks
UPDATE_SCREENSHOTS = os.environ.get("DDPNB_UPDATE_SCREENSHOTS") == "1"

pytestmark = pytest.mark.slow

TRAIN_CELL = """%%ddp -n 2
def train(rank, world_size):
    import os, time, torch, ddpnb
    from tqdm.auto import tqdm
    torch.manual_seed(rank)
    x, w = torch.randn(512, 16), torch.linspace(-1, 1, 16)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    for step in tqdm(range(80), desc="train"):
        while step == 40 and not os.path.exists("dashboard-go"):  # mid-run until the test has looked
            time.sleep(0.1)
        started = time.perf_counter()
        batch = x[torch.randint(0, 512, (64,))]
        loss = (model(batch).squeeze(1) - batch @ w).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.08)
        ddpnb.log(step=step, loss=loss.item(), samples_per_s=64 / (time.perf_counter() - started))
        if step % 4 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
"""

BACKGROUND_CELL = """%%ddp -n 2 --background -o job
def slow(rank):
    import os, time
    import ddpnb
    step = 0
    while not os.path.exists("background-go"):  # until the test has seen it run beside another cell
        ddpnb.log(step=step, value=step * (rank + 1))
        print(f"tick {step}")
        step += 1
        time.sleep(0.1)
    return "background done"
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A JupyterLab server on 127.0.0.1 (a port the server binds as 0), with a token; stopped afterwards."""
    why = jupyterlab.missing()
    if why:
        pytest.skip(f"{why}; CI installs it")
    root = tmp_path_factory.mktemp("lab")
    with jupyterlab.serve(root) as (url, token):
        yield url, token, root


@pytest.fixture()
def page(lab: tuple[str, str, Path], request: pytest.FixtureRequest) -> Iterator:
    """A Chromium page; when the test fails, a screenshot of it lands beside the notebooks."""
    failed_before = request.session.testsfailed
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1180, "height": 1500}, device_scale_factor=2)
        page = context.new_page()
        page.set_default_timeout(60_000)
        try:
            yield page
        finally:
            if request.session.testsfailed > failed_before:  # what the browser showed, for the CI log's reader
                shot = lab[2] / f"{request.node.name}.png"
                page.screenshot(path=str(shot))
                print(f"\nwhat the browser showed: {shot}")
            context.close()
            browser.close()


def _screenshot(lab: tuple[str, str, Path], name: str) -> Path:
    return (REPO / "docs" if UPDATE_SCREENSHOTS else lab[2]) / name


def test_dashboard_in_jupyterlab_shows_ranks_plots_logs_then_the_finished_summary(lab, page):
    cells = _open(page, lab, "dashboard.ipynb", ["%load_ext ddpnb", TRAIN_CELL])
    _run_cell(page, cells.nth(0))
    _run_cell(page, cells.nth(1), finished=False)
    output = cells.nth(1).locator(".jp-OutputArea")

    # mid-run: the live widget, both rank rows, a plot with lines, log text, tqdm as a bar
    live = output.locator(".ddpnb .ddpnb-pill[data-state='running']")
    live.wait_for(timeout=120_000)
    for rank in (0, 1):
        output.locator(f"table.ddpnb-ranks tr[data-rank='{rank}']").wait_for()
    output.locator(".ddpnb-plot[data-metric='loss'] svg polyline[data-rank='1']").wait_for()
    output.locator(".ddpnb-line", has_text="step").first.wait_for()
    output.locator(".ddpnb-progress[data-total='80'] .ddpnb-bar").first.wait_for()
    assert live.is_visible()  # the ranks wait at step 40 for dashboard-go
    bar = output.locator(".ddpnb .widget-hbox:has(.widget-toggle-buttons)")  # "output" and the log's rank picker
    assert bar.evaluate("el => getComputedStyle(el).columnGap") == "10px"
    page.wait_for_timeout(1500)
    cells.nth(1).screenshot(path=str(_screenshot(lab, "dashboard-live.png")))
    (lab[2] / "dashboard-go").touch()

    # the end: the widget is replaced by the static summary, which says finished
    summary = output.locator("[data-ddpnb-summary] .ddpnb-pill[data-state='finished']")
    summary.wait_for(timeout=120_000)
    assert output.locator("[data-ddpnb-summary] tr[data-state='finished']").count() == 2
    assert output.locator("[data-ddpnb-summary] .ddpnb-plot img.ddpnb-plot-image").count() == 2  # loss, samples/s
    assert output.locator(".jp-OutputArea-output", has_text="Error displaying widget").count() == 0
    page.wait_for_selector(IDLE)
    cells.nth(0).locator(".jp-InputArea-editor").click()  # another cell active: no toolbar over this one
    page.keyboard.press("Escape")
    page.mouse.move(0, 0)
    cells.nth(1).screenshot(path=str(_screenshot(lab, "dashboard.png")))


def test_background_run_keeps_its_dashboard_while_another_cell_runs(lab, page):
    cells = _open(
        page, lab, "background.ipynb", ["%load_ext ddpnb", BACKGROUND_CELL, "print(40 + 2)", "print(job.result())"]
    )
    _run_cell(page, cells.nth(0))
    _run_cell(page, cells.nth(1))  # returns at once
    background = cells.nth(1).locator(".jp-OutputArea")
    background.locator(".ddpnb .ddpnb-pill[data-state='running']").wait_for(timeout=120_000)

    _run_cell(page, cells.nth(2))
    cells.nth(2).locator(".jp-OutputArea-output", has_text="42").wait_for()
    assert background.locator(".ddpnb .ddpnb-pill[data-state='running']").is_visible()  # until background-go
    background.locator(".ddpnb-line", has_text="tick").first.wait_for()
    (lab[2] / "background-go").touch()

    _run_cell(page, cells.nth(3), finished=False)
    cells.nth(3).locator(".jp-OutputArea-output", has_text="background done").wait_for(timeout=120_000)
    background.locator("[data-ddpnb-summary] .ddpnb-pill[data-state='finished']").wait_for(timeout=30_000)


BREAKPOINT_CELL = """%%ddp -n 2
def train(rank, world_size):
    import torch, torch.distributed as dist
    total = torch.ones(1) * (rank + 1)
    if rank == 1:
        breakpoint()
    dist.all_reduce(total)
    return total.item()
"""


def test_a_rank_at_a_breakpoint_reads_so_in_the_dashboard_until_it_continues(lab, page):
    """Issue 29: while rank 1 waits at its pdb prompt (JupyterLab's input box under the cell), its row and the
    run's state say it is at a breakpoint, and where; after `c` the run finishes."""
    cells = _open(page, lab, "breakpoint.ipynb", ["%load_ext ddpnb", BREAKPOINT_CELL])
    _run_cell(page, cells.nth(0))
    _run_cell(page, cells.nth(1), finished=False)
    output = cells.nth(1).locator(".jp-OutputArea")
    stdin = output.locator(".jp-Stdin-input")
    stdin.wait_for(timeout=120_000)
    assert "(rank 1) (Pdb)" in output.locator(".jp-Stdin").inner_text()
    output.locator(".ddpnb .ddpnb-pill[data-state='at a breakpoint']").wait_for(timeout=30_000)
    row = output.locator(".ddpnb tr[data-rank='1']").inner_text()
    # pdb stops before the statement after breakpoint(): the all_reduce, line 7
    assert re.search(r"at a breakpoint: Cell In\[\d+\], line 7, in train", row), row
    assert "at a breakpoint" not in output.locator(".ddpnb tr[data-rank='0']").inner_text()
    stdin.fill("c")
    stdin.press("Enter")
    output.locator("[data-ddpnb-summary] .ddpnb-pill[data-state='finished']").wait_for(timeout=60_000)
    assert "at a breakpoint" not in output.locator("[data-ddpnb-summary]").inner_text()


def _row_text(output, rank: int) -> str:
    return output.locator(f".ddpnb tr[data-rank='{rank}']").inner_text()


def test_a_background_runs_breakpoint_is_answered_in_its_dashboards_console(lab, page):
    """Issue 29: a `--background` run's cell has returned, so its rank's prompt shows in the dashboard's console:
    a command typed there reaches that rank alone, pdb's answer shows, `c` lets the run finish."""
    cell = BREAKPOINT_CELL.replace("%%ddp -n 2", "%%ddp -n 2 --background -o job")
    cells = _open(page, lab, "console.ipynb", ["%load_ext ddpnb", cell])
    _run_cell(page, cells.nth(0))
    _run_cell(page, cells.nth(1))  # returns at once
    output = cells.nth(1).locator(".jp-OutputArea")
    console = output.locator(".ddpnb-console")
    entry = console.locator(".ddpnb-console-input input")
    entry.wait_for(timeout=120_000)
    page.wait_for_function("el => !el.disabled", arg=entry.element_handle(), timeout=30_000)
    assert "rank 1 waits at (Pdb)" in console.inner_text()
    assert re.search(r"Cell In\[\d+\], line 7, in train", console.inner_text()), console.inner_text()
    assert output.locator(".jp-Stdin").count() == 0  # the cell returned: nothing asks in its input box
    entry.fill("p rank")
    entry.press("Enter")
    # pdb's answer to rank 1 alone: its rank
    console.locator(".ddpnb-console-transcript", has_text=re.compile(r"\(Pdb\) p rank\n1$", re.MULTILINE)).wait_for(
        timeout=30_000
    )
    assert re.search(r"at a breakpoint: Cell In\[\d+\], line 7, in train", _row_text(output, 1))
    page.wait_for_function("el => !el.disabled", arg=entry.element_handle(), timeout=30_000)
    entry.fill("c")
    entry.press("Enter")
    output.locator("[data-ddpnb-summary] .ddpnb-pill[data-state='finished']").wait_for(timeout=60_000)


SAVED_CELL = """%%ddp -n 2 --view widget
def train(rank, world_size):
    import ddpnb
    for step in range(20):
        ddpnb.log(step=step, loss=1.0 / (step + 1) + 0.1 * rank)
    print("trained")
"""


def test_a_saved_notebook_opened_untrusted_keeps_the_summarys_look_and_its_plots(lab, page, tmp_path):
    """A notebook saved with a run's summary, opened where nobody ran it (GitHub, nbviewer, a colleague's
    JupyterLab): JupyterLab sanitises its HTML. The header's words stay apart, ranks keep their colours, and the
    plot is drawn, as an image."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in ["%load_ext ddpnb", SAVED_CELL]])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DDPNB_RUNS_DIR", str(tmp_path / "runs"))
        NotebookClient(
            nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    url, token, root = lab
    nbformat.write(nb, root / "saved.ipynb")  # not signed: this server has never trusted it
    page.goto(f"{url}/lab/workspaces/saved/tree/saved.ipynb?reset&token={token}")
    output = page.locator(f"{NOTEBOOK} .jp-Cell").nth(1).locator(".jp-OutputArea-output")
    summary = output.locator(".ddpnb-head")
    summary.wait_for(timeout=120_000)
    _accept_kernel_dialog(page)

    # untrusted, so sanitised: the data-* attributes a trusted output keeps are gone (and so would a <style> be)
    assert output.locator(".ddpnb").count() == 1 and output.locator("[data-ddpnb-summary]").count() == 0
    assert re.match(r"ddpnb\s+finished\s+train\s+·\s+local", summary.inner_text())
    swatch = output.locator(".ddpnb-swatch").first.evaluate("el => getComputedStyle(el).backgroundColor")
    assert swatch == "rgb(31, 119, 180)"  # rank 0's colour
    state = output.locator("tr", has_text="finished").first.locator("td").nth(1)
    assert state.evaluate("el => getComputedStyle(el).color") == "rgb(56, 142, 60)"  # the success green
    plot = output.locator("img.ddpnb-plot-image")
    assert plot.count() == 1
    plot.evaluate("img => img.decode()")  # drawn, not a broken image
    size = plot.evaluate("img => [img.naturalWidth, img.naturalHeight, img.clientWidth, img.clientHeight]")
    assert size[0] > 0 and size[1] > 0 and size[2] > 0 and size[3] > 0, size
    text = output.inner_text()
    assert "00.20.40.6" not in text  # the plot's labels are not left as a run of text


STALL_CELL = """%%ddp -n 3 --stall 3
def stall(rank):
    import os, time
    import torch
    import torch.distributed as dist
    while rank == 1 and not os.path.exists("stall-go"):
        time.sleep(0.2)
    dist.all_reduce(torch.ones(1))
"""


def _stalled_for(banner) -> float:
    return float(re.search(r"no rank has made progress for (\d+(?:\.\d)?) s", banner.inner_text()).group(1))


def test_a_foreground_stall_shows_each_ranks_stack_under_a_banner_whose_seconds_count_on(lab, page):
    """Issue 28, acceptance 1: the cell waits, so no button serves; the stall doctor's stacks show under the banner,
    as tracebacks read (the cell's line and its source; no temp file, no ddpnb thread, no torch logging wrapper),
    the seconds count on, and the ranks read 'stalled'."""
    cells = _open(page, lab, "stall.ipynb", ["%load_ext ddpnb", STALL_CELL])
    _run_cell(page, cells.nth(0))
    _run_cell(page, cells.nth(1), finished=False)
    output = cells.nth(1).locator(".jp-OutputArea")
    banner = output.locator(".ddpnb .ddpnb-stall[data-stall='ongoing'] .ddpnb-stall-title")
    banner.wait_for(timeout=120_000)
    stacks = output.locator(".ddpnb .ddpnb-stall-stacks")
    stacks.wait_for()
    rank_1 = stacks.locator(".ddpnb-stall-stack[data-ranks='1'] + pre").inner_text()
    assert re.search(r"Cell In\[\d+\], line 7, in stall\n\s+time\.sleep\(0\.2\)", rank_1), rank_1
    shown = stacks.inner_text()
    assert "dist.all_reduce(torch.ones(1))" in shown and "ranks 0, 2" in shown, shown
    for absent in ("ipykernel_", "ddpnb/", "c10d_logger", "Thread 0x"):
        assert absent not in shown, (absent, shown)
    assert output.locator(".ddpnb table.ddpnb-ranks tr[data-state='stalled']").count() == 3
    assert output.locator(".ddpnb tr[data-rank='1'] td").nth(1).inner_text() == "stalled"
    first = _stalled_for(banner)
    page.wait_for_function(  # each redraw replaces the banner's element: look it up each time
        "([area, first]) => parseFloat(/progress for (\\d+(?:\\.\\d)?) s/.exec("
        "area.querySelector('.ddpnb-stall-title').innerText)[1]) > first + 1",
        arg=[output.element_handle(), first],
        timeout=30_000,
    )
    (lab[2] / "stall-go").touch()

    summary = output.locator("[data-ddpnb-summary] .ddpnb-pill[data-state='finished']")
    summary.wait_for(timeout=120_000)
    assert output.locator("[data-ddpnb-summary] [data-stall='resumed']").count() == 1
    assert output.locator(".ddpnb-stall-stacks").count() == 0


RESTART_CELL = """%%ddp -n 2 --max-restarts 1
def restarts(rank):
    import os, time, ddpnb
    attempt = ddpnb.attempt()
    while attempt == 1 and not os.path.exists("restart-go"):  # until the test has looked
        time.sleep(0.1)
    for step in range(10 * attempt, 10 * attempt + 10):
        ddpnb.log(step=step, loss=1.0 / (step + 1) + 0.1 * rank)
        print(f"attempt {attempt} step {step}")
    if attempt == 0 and rank == 0:
        open("rank0-logged", "w").close()
    if attempt == 0 and rank == 1:
        while not os.path.exists("rank0-logged"):  # rank 0's points are in its pipe: both curves can be drawn
            time.sleep(0.05)
        raise ValueError("rank 1 fails in attempt 0")
"""


def test_a_restarted_runs_plot_shows_both_attempts_throughout_and_its_log_marks_the_restart(lab, page):
    """Issue 28, acceptance 4: right after the restart (attempt 1 has logged nothing yet) the plot keeps attempt
    0's curves; once attempt 1 logs, both show; the log marks the restart; the summary draws both and names every
    attempt's logs."""
    import base64

    cells = _open(page, lab, "restarts.ipynb", ["%load_ext ddpnb", RESTART_CELL])
    _run_cell(page, cells.nth(0))
    _run_cell(page, cells.nth(1), finished=False)
    output = cells.nth(1).locator(".jp-OutputArea")
    output.locator(".ddpnb .ddpnb-restart-mark").wait_for(timeout=120_000)
    assert "attempt 1 (restarts: 1 of 1)" in output.locator(".ddpnb .ddpnb-head").inner_text()
    plot = output.locator(".ddpnb .ddpnb-plot[data-metric='loss'] svg")
    for rank in (0, 1):  # attempt 1 waits: only attempt 0's curves can be drawn, and they are
        plot.locator(f"polyline[data-rank='{rank}'][data-attempt='0']").wait_for()
    assert output.locator(".ddpnb", has_text="No metrics yet").count() == 0
    mark = output.locator(".ddpnb .ddpnb-restart-mark").inner_text()
    assert "attempt 0 failed: rank 1 failed first: ValueError: rank 1 fails in attempt 0" in mark, mark
    (lab[2] / "restart-go").touch()

    summary = output.locator("[data-ddpnb-summary]")
    summary.locator(".ddpnb-pill[data-state='finished']").wait_for(timeout=120_000)
    image = summary.locator(".ddpnb-plot[data-metric='loss'] img.ddpnb-plot-image").get_attribute("src")
    drawn = base64.b64decode(image.removeprefix("data:image/svg+xml;base64,")).decode()
    for rank in (0, 1):
        assert f'data-rank="{rank}" data-attempt="0"' in drawn and f'data-rank="{rank}" data-points="10"' in drawn
    assert 'class="ddpnb-restart" data-attempt="1"' in drawn
    text = summary.inner_text()
    assert re.search(r"rank\{0\.\.1\}\.attempt\{0\.\.1\}\.log", text), text
    assert "40 lines" in text and summary.locator(".ddpnb-restart-mark").count() == 1, text


WIDE_CELL = """%%ddp -n 4 --timeout 6
def wide(rank):
    import time
    print("a long line of words that the log wraps between its words " * 6, flush=True)
    print("one_long_identifier_without_any_space_" * 8, flush=True)
    held = []
    for step in range(4):  # memory that grows while it is sampled (every second): each rank's memory column says
        held.append(bytearray((rank + 1) * 10 * 2**20))  # its range, '331.2 MiB ▁▃▆█ 301.1 MiB–331.2 MiB', the widest
        time.sleep(1)  # text it has, whatever the load (an idle machine's samples all came after a single allocation)
    if rank == 2:
        raise RuntimeError("rank 2 stops while the others are still starting their work " * 3)
    time.sleep(60)
"""


def test_a_failed_four_rank_runs_summary_fits_the_output_area_and_wraps_between_words(lab, page):
    """Issue 28, layout: the summary of a 4-rank run that failed (long lines, a long error) scrolls nowhere
    sideways, and its tables and log wrap between words, not inside them."""
    cells = _open(page, lab, "wide.ipynb", ["%load_ext ddpnb", WIDE_CELL])
    _run_cell(page, cells.nth(0))
    _run_cell(page, cells.nth(1))
    output = cells.nth(1).locator(".jp-OutputArea")
    summary = output.locator("[data-ddpnb-summary]")
    summary.wait_for(timeout=120_000)
    shown = output.inner_text()
    # the error leaves the rank table and the logs to the summary above it (issue 45): one table, the summary's
    assert "every rank's state and its full log: in the summary above" in shown, shown
    assert not [line for line in shown.splitlines() if re.match(r" +\d  (stopped|failed) ", line)], shown
    page.set_viewport_size({"width": 900, "height": 1500})  # a narrow window: about 600 px for the output
    page.wait_for_timeout(500)
    widths = summary.evaluate("""el => {
        const wide = [el, ...el.querySelectorAll('*')].filter(e => e.scrollWidth > e.clientWidth + 1
            && getComputedStyle(e).overflowX !== 'hidden' && e.tagName !== 'IMG');
        const area = el.closest('.jp-OutputArea-output');
        return {area: [area.scrollWidth, area.clientWidth],
                wide: wide.map(e => e.tagName + '.' + e.className + ' ' + e.scrollWidth + '>' + e.clientWidth)};
    }""")
    assert widths["area"][0] <= widths["area"][1], widths
    assert widths["wide"] == [], widths
    styles = summary.evaluate(
        "el => [...el.querySelectorAll('*')].filter(e => getComputedStyle(e).wordBreak "
        "=== 'break-all').map(e => e.tagName + '.' + e.className)"
    )
    assert styles == []  # a line wraps between words; only a word wider than the line breaks


def paced(rank, world_size, gates):
    """A detached run's training: 30 steps of history before anyone attaches, 15 more once the viewer is there,
    then it holds until the test has seen them drawn."""
    import os
    import time

    import ddpnb

    for step in range(60):
        while step in (30, 45) and not os.path.exists(f"{gates}/{step}"):
            time.sleep(0.05)
        ddpnb.log(step=step, loss=1.0 / (step + 1) + 0.1 * rank)
        print(f"step {step}", flush=True)
        time.sleep(0.05)


def test_an_attached_runs_dashboard_shows_its_curves_from_step_0_then_updates_live(lab, page, tmp_path):
    """Issue 42, acceptance 5: a detached run launched elsewhere, attached from a notebook in JupyterLab: its
    dashboard draws the history (steps 0-29, logged before the attach), then the steps that come after, live."""
    import cloudpickle

    import ddpnb

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    gates = tmp_path / "gates"
    gates.mkdir()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DDPNB_RUNS_DIR", str(tmp_path / "runs"))
        handle = ddpnb.launch(paced, nprocs=2, args=(str(gates),), view="none", detach=True)
    try:
        deadline = time.monotonic() + 60
        while len(handle.record.metrics("loss", 1)) < 30:  # the history: every step before the gate
            assert time.monotonic() < deadline, handle.status
            time.sleep(0.05)
        cells = _open(
            page, lab, "attached.ipynb", [f"handle = __import__('ddpnb').attach({str(handle.run_dir)!r})\nhandle"]
        )
        _run_cell(page, cells.nth(0))
        output = cells.nth(0).locator(".jp-OutputArea")
        output.locator(".ddpnb .ddpnb-pill[data-state='running']").wait_for(timeout=60_000)
        plot = output.locator(".ddpnb .ddpnb-plot[data-metric='loss'] svg")
        for rank in (0, 1):  # the whole history at once, from step 0
            plot.locator(f"polyline[data-rank='{rank}'][data-points='30']").wait_for(timeout=30_000)
        labels = plot.locator("text").all_text_contents()
        assert "0" in labels and "step" in labels, labels  # the x axis starts at step 0
        assert output.locator(".ddpnb-line", has_text="step 29").count() >= 1
        (gates / "30").touch()
        for rank in (0, 1):  # live: the steps logged after the attach join the same curves
            plot.locator(f"polyline[data-rank='{rank}'][data-points='45']").wait_for(timeout=30_000)
        assert output.locator(".ddpnb .ddpnb-pill[data-state='running']").is_visible()  # held at step 45
        output.locator(".ddpnb-line", has_text="step 44").first.wait_for(timeout=10_000)
        (gates / "45").touch()
        summary = output.locator("[data-ddpnb-summary] .ddpnb-pill[data-state='finished']")
        summary.wait_for(timeout=60_000)
    finally:
        for gate in ("30", "45"):
            (gates / gate).touch()
        handle.wait(30)
    assert handle.record.outcome is ddpnb.Outcome.SUCCEEDED
