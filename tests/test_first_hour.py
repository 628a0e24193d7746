"""What a new user hits in their first hour (issue 20): re-running a background cell, a cell's value, a user's Stop,
a SyntaxError in a %%ddp cell, the CPU-fallback note, and the small things (usage, flags, durations, metrics,
words). Through a real Jupyter kernel and real ranks where the behaviour is the kernel's; CPU ranks over gloo."""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest

from ddpnb._magic import DDPMagics, SessionMagics, did_you_mean, state_dict_summary
from ddpnb.core.record import AttemptRecord, Outcome, Point, RankRecord, RankState, RunRecord
from ddpnb.core.report import summary_table
from ddpnb.core.words import format_duration
from ddpnb.views.html import header_html, ranks_html
from tests.conftest import Kernel, wait_gone

LONG_CELL = """%%ddp -n 2 --background {out}
def long_run(rank):
    import time
    for _ in range(1200):
        time.sleep(0.1)
    return rank
"""
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _value(kernel, expression: str, timeout: float = 60):
    run = kernel.execute(f"print(repr({expression}))", timeout=timeout)
    assert run.error is None, run.error
    return ast.literal_eval(run.stdout.strip().splitlines()[-1])


def _wait_running(kernel, handle: str) -> list[int]:
    """The handle's rank PIDs once every rank runs its function."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if _value(kernel, f"all(r.state.value == 'running' for r in {handle}.record.ranks)"):
            return _value(kernel, f"[r.pid for r in {handle}.record.ranks]")
        time.sleep(0.2)
    raise AssertionError(f"{handle}'s ranks never all ran")


def _stop_all(kernel) -> None:
    kernel.execute("for _run in ddpnb.runs():\n    _run.stop()")
    assert _value(kernel, "ddpnb.runs()") == []


def _traceback(run) -> str:
    return ANSI.sub("", "\n".join(run.error["traceback"])) if run.error else ""


# --- 1. running a cell again stops the run it started ----------------------------------------------------------


def test_running_a_background_cell_again_stops_its_earlier_run(kernel):
    first = kernel.execute(LONG_CELL.format(out="-o job"), cell_id="cell-1")
    assert first.error is None, first.error
    kernel.execute("first = job")
    first_pids = _wait_running(kernel, "first")
    edited = LONG_CELL.format(out="-o job").replace("range(1200)", "range(1300)")  # the same cell, edited
    again = kernel.execute(edited, cell_id="cell-1", timeout=60)
    assert again.error is None, again.error
    assert re.search(r"\[ddpnb\] stopped the earlier run of this cell \(started \d+(\.\d)? s ago\)\n", again.stdout)
    assert _value(kernel, "[first.done, str(first.outcome), first.record.note]") == [
        True,
        "stopped",
        "stopped because its cell was run again",
    ]
    assert wait_gone(first_pids, within=10) == []
    assert _value(kernel, "[run is job for run in ddpnb.runs()]") == [True]  # only the new run is live
    _stop_all(kernel)


def test_running_the_cell_again_stops_its_earlier_run_even_when_the_new_one_cannot_start(kernel):
    assert kernel.execute(LONG_CELL.format(out="-o job"), cell_id="cell-broken").error is None
    broken = kernel.execute("%%ddp -n 2 --background -o job\ndef long_run(rank:\n    pass\n", cell_id="cell-broken")
    assert broken.error["ename"] == "SyntaxError"
    assert "[ddpnb] stopped the earlier run of this cell" in broken.stdout
    assert _value(kernel, "[str(job.outcome), ddpnb.runs()]") == ["stopped", []]


def test_another_cell_with_the_same_text_keeps_its_own_run(kernel):
    assert kernel.execute(LONG_CELL.format(out="-o one"), cell_id="cell-a").error is None
    other = kernel.execute(LONG_CELL.format(out="-o one"), cell_id="cell-b")
    assert other.error is None and "stopped the earlier run" not in other.stdout
    assert _value(kernel, "len(ddpnb.runs())") == 2
    _stop_all(kernel)


def test_without_a_cell_id_the_same_cell_text_is_the_same_cell(kernel):
    assert kernel.execute(LONG_CELL.format(out="-o job")).error is None
    _wait_running(kernel, "job")
    again = kernel.execute(LONG_CELL.format(out="-o job"), timeout=60)
    assert "[ddpnb] stopped the earlier run of this cell" in again.stdout
    assert _value(kernel, "len(ddpnb.runs())") == 1
    _stop_all(kernel)


def test_runs_lists_live_runs_each_stoppable_with_a_current_repr(kernel):
    assert kernel.execute(LONG_CELL.format(out="-o job"), cell_id="cell-runs").error is None
    listed = _value(kernel, "[repr(run) for run in ddpnb.runs()]")
    assert len(listed) == 1 and listed[0].startswith("<ddpnb run of long_run on 2 ranks (gloo): ")
    kernel.execute("ddpnb.runs()[0].stop()")
    assert _value(kernel, "ddpnb.runs()") == []
    assert _value(kernel, "repr(job)").startswith("<ddpnb run of long_run on 2 ranks (gloo): stopped after ")


# --- 2. a background cell's value -----------------------------------------------------------------------------


def test_background_cell_with_o_shows_no_value(kernel):
    launched = kernel.execute(LONG_CELL.format(out="-o job"), cell_id="cell-value")
    assert launched.error is None and launched.results == []  # no frozen "running after 0.0 s" under the run
    assert _value(kernel, "type(job).__name__") == "Run"
    _stop_all(kernel)


def test_background_cell_without_o_says_where_its_handle_is(kernel):
    launched = kernel.execute(LONG_CELL.format(out=""), cell_id="cell-no-o")
    assert launched.error is None and launched.results == []
    where = re.search(r"\[ddpnb\] its handle is (Out\[\d+\]) \(add -o NAME to name it\)", launched.stdout)
    assert where, launched.stdout
    assert where.group(1) == f"Out[{launched.count}]"
    assert _value(kernel, f"{where.group(1)} is ddpnb.runs()[0]")
    kernel.execute(f"{where.group(1)}.stop()")
    assert _value(kernel, f"str({where.group(1)}.outcome)") == "stopped"


# --- 3. a user's Stop -------------------------------------------------------------------------------------------


def test_result_after_stop_says_stopped_by_the_user_when_and_no_value(kernel):
    assert kernel.execute(LONG_CELL.format(out="-o job"), cell_id="cell-stop").error is None
    _wait_running(kernel, "job")
    kernel.execute("job.stop()")
    result = kernel.execute("job.result()")
    assert result.error is not None and result.error["ename"] == "WorkerError"
    shown = _traceback(result)
    assert re.search(
        r"ddpnb: run stopped by the user at \d\d:\d\d:\d\d, \d+(\.\d)? s after it started; it has no "
        r"value",
        shown,
    ), shown
    assert "Fix the error" not in shown and "failed" not in shown.split("\n")[0]
    assert "Run the cell again to start afresh" in shown


@pytest.fixture(scope="module")
def widget_kernel(tmp_path_factory: pytest.TempPathFactory):
    kernel = Kernel(
        env={
            "DDPNB_VIEW": "widget",
            "DDPNB_CPU_FALLBACK": "1",
            "DDPNB_RUNS_DIR": str(tmp_path_factory.mktemp("first-hour") / "runs"),
        }
    )
    kernel.execute("%load_ext ddpnb")
    yield kernel
    kernel.shutdown()


def test_stop_button_then_result_says_stopped_by_the_user_and_the_header_has_the_fallback_note(widget_kernel):
    launched = widget_kernel.execute(LONG_CELL.format(out="-o clicked").replace("-n 2", "--gpus 2"), timeout=90)
    assert launched.error is None and "GPU(s) here" not in launched.stderr
    opened = [msg["content"] for msg in launched.outputs if msg["msg_type"] == "comm_open"]
    states = [
        msg["content"]["data"].get("state", {})
        for msg in launched.outputs
        if msg["msg_type"] in ("comm_open", "comm_msg")
    ]
    headers = [state["value"] for state in states if str(state.get("value")).startswith('<div class="ddpnb-head"')]
    assert headers and "GPU(s) here: running --gpus 2 as 2 CPU ranks over gloo" in headers[0]  # item 8, live
    stop = [c["comm_id"] for c in opened if c["data"]["state"].get("description") == "Stop"]
    _wait_running(widget_kernel, "clicked")
    client = widget_kernel.client
    client.shell_channel.send(
        client.session.msg(
            "comm_msg", {"comm_id": stop[0], "data": {"method": "custom", "content": {"event": "click"}}}
        )
    )
    deadline = time.monotonic() + 120
    while not _value(widget_kernel, "clicked.done") and time.monotonic() < deadline:
        time.sleep(0.3)
    shown = _traceback(widget_kernel.execute("clicked.result()"))
    assert "ddpnb: run stopped by the user at " in shown and "it has no value" in shown, shown
    assert "Fix the error" not in shown


# --- 7. a SyntaxError in a %%ddp cell -----------------------------------------------------------------------------


def test_syntax_error_in_a_ddp_cell_shows_as_a_plain_cells_does(kernel):
    plain = kernel.execute("# where the %%ddp line is\ndef train(rank:\n    return rank\n")
    magic = kernel.execute("%%ddp -n 2\ndef train(rank:\n    return rank\n")
    assert magic.error is not None and magic.error["ename"] == "SyntaxError"
    shown, expected = _traceback(magic), _traceback(plain)
    assert re.sub(r"In\[\d+\]", "In[N]", shown) == re.sub(r"In\[\d+\]", "In[N]", expected), shown
    assert f"Cell In[{magic.count}], line 2" in shown and "def train(rank:" in shown
    assert "ddpnb" not in shown and "run_cell_magic" not in shown
    assert _value(kernel, "ddpnb.runs()") == []  # nothing started
    assert kernel.execute("1 + 1").results == ["2"]


# --- 8. the CPU-fallback note ------------------------------------------------------------------------------------


def test_cpu_fallback_note_is_in_the_run_header_not_on_stderr(kernel):
    kernel.execute("import os\nos.environ['DDPNB_CPU_FALLBACK'] = '1'")
    try:
        run = kernel.execute("%%ddp --gpus 2\ndef where(rank):\n    return ddpnb.device()\n")
    finally:
        kernel.execute("del os.environ['DDPNB_CPU_FALLBACK']")
    assert run.error is None and run.results == ["'cpu'"]
    assert "GPU(s) here" not in run.stderr
    header = run.stdout.splitlines()[0]
    assert header.startswith("[ddpnb] where on 2 ranks, backend gloo, devices cpu; 0 GPU(s) here")
    assert "GPU(s) here: running --gpus 2 as 2 CPU ranks over gloo (DDPNB_CPU_FALLBACK is set)" in header
    dashboard = _value(kernel, "__import__('ddpnb.views.html').views.html.header_html(ddpnb.last_run())")
    assert "GPU(s) here: running --gpus 2 as 2 CPU ranks over gloo" in dashboard


# --- 9. a cell's value: -o, and a state dict ---------------------------------------------------------------------


def test_o_binds_the_value_and_the_cell_shows_none(kernel):
    run = kernel.execute(
        "%%ddp -n 2 -o weights\ndef train(rank):\n    import torch\n    return torch.nn.Linear(4, 3).state_dict()\n"
    )
    assert run.error is None and run.results == []
    assert "tensor(" not in run.text
    assert _value(kernel, "sorted(weights)") == ["bias", "weight"]


def test_state_dict_value_shows_one_line_and_stays_the_real_dict(kernel):
    run = kernel.execute(
        "%%ddp -n 2\ndef train(rank):\n    import torch\n    return torch.nn.Linear(4, 3).state_dict()\n"
    )
    assert run.error is None and "tensor(" not in run.text
    assert run.results == [f"state dict: 2 tensors, 15 parameters (float32), 60 B (the dict is Out[{run.count}])"]
    assert _value(kernel, f"[type(Out[{run.count}]).__name__, sorted(_), _ is Out[{run.count}]]") == [
        "OrderedDict",
        ["bias", "weight"],
        True,
    ]


def test_state_dict_summary_counts_tensors_parameters_and_bytes():
    import torch

    state = {"a": torch.zeros(1000, 1000), "b": torch.zeros(10, dtype=torch.float16)}
    assert state_dict_summary(state) == "state dict: 2 tensors, 1.0 M parameters (float16, float32), 3.8 MiB"
    assert state_dict_summary({"a": torch.zeros(2), "step": 3}) is None  # not only tensors: shown as it is
    assert state_dict_summary({}) is None and state_dict_summary([torch.zeros(2)]) is None


# --- small -----------------------------------------------------------------------------------------------------


def test_help_shows_usage_as_the_magic_is_typed_without_rst_markup():
    for magic, usage in (
        (DDPMagics.ddp, "usage: %%ddp [--gpus N|all]"),
        (SessionMagics.ddp_start, "usage: %ddp_start [--gpus N|all]"),
        (SessionMagics.ranks, "usage: %%ranks [-o NAME]"),
    ):
        assert magic.__doc__.startswith(usage), magic.__doc__[:80]
        assert "::" not in magic.__doc__


def test_unknown_flag_suggests_the_close_one():
    parser = DDPMagics.ddp.parser
    assert did_you_mean(parser, "-n 2 --timout 5") == " (did you mean --timeout?)"
    assert did_you_mean(parser, "--max-restars=2") == " (did you mean --max-restarts?)"
    assert did_you_mean(parser, "--time 5 --zzzz") == ""  # a prefix argparse takes; nothing close


def test_unknown_flag_in_a_cell_is_a_usage_error_with_the_suggestion(kernel):
    run = kernel.execute("%%ddp -n 2 --timout 5\ndef f():\n    return 1\n")
    assert run.stderr.startswith(
        "UsageError: unrecognized arguments: --timout 5 (did you mean --timeout?). See %%ddp? for every flag"
    ), run.stderr  # IPython shows a UsageError as one line


def test_durations_read_the_same_in_the_dashboard_and_the_text():
    assert [format_duration(s) for s in (0.04, 3.25, 12.4, 65, 3725)] == [
        "0.0 s",
        "3.2 s",
        "12 s",
        "1 min 05 s",
        "1 h 02 min",
    ]
    record = RunRecord(
        run_dir=Path("/tmp/x"),
        world_size=1,
        backend="gloo",
        function="f",
        started=100.0,
        ended=100.1,
        current=AttemptRecord(0, [RankRecord(rank=0, started=100.0, ended=100.1, state=RankState.FINISHED)]),
    )
    assert "0.1 s" in header_html(record) and "0.1 s" in ranks_html(record)
    assert "0.1 s" in summary_table(record) and "0.1s" not in summary_table(record)


def test_metrics_points_have_named_fields():
    rank = RankRecord(rank=0)
    rank.metrics["loss"] = [Point(0, 10.0, 0.5), Point(1, 11.0, 0.25)]
    record = RunRecord(run_dir=Path("/tmp/x"), world_size=1, backend="gloo", current=AttemptRecord(0, [rank]))
    last = record.metrics("loss")[-1]
    assert (last.step, last.time, last.value) == (1, 11.0, 0.25)
    assert repr(last) == "Point(step=1, time=11.0, value=0.25)"


def test_a_record_of_a_long_run_prints_as_one_short_line_and_its_ranks_too():
    ranks = [RankRecord(rank=r, pid=100 + r, state=RankState.FINISHED, exitcode=0) for r in range(4)]
    for rank in ranks:
        rank.metrics["loss"] = [Point(step, 10.0 + step, 1.0 / (step + 1)) for step in range(5000)]
    record = RunRecord(
        run_dir=Path("/tmp/ddpnb-runs/run-1"),
        world_size=4,
        backend="gloo",
        function="train",
        started=100.0,
        ended=112.5,
        outcome=Outcome.SUCCEEDED,
        current=AttemptRecord(0, ranks),
    )
    assert repr(record) == (
        "<RunRecord train on local: succeeded, 4 ranks (gloo), attempt 0, 12.5 s, /tmp/ddpnb-runs/run-1>"
    )
    assert repr(ranks[3]) == "<RankRecord rank 3 finished exit=0 pid=103 device=cpu lines=0 metrics (loss: 5000)>"
    shown = record._repr_html_()  # a notebook's display: the line, and a short row per rank
    assert shown.startswith("<div class='ddpnb-record'><code>&lt;RunRecord train on local: succeeded")
    assert shown.count("<tr><td>") == 4 and "<td>3</td><td></td><td>finished</td><td>0</td><td>0</td>" in shown
    assert len(shown) < 1000
    assert len(ranks[3]._repr_html_()) < 300 and "&lt;RankRecord rank 3 finished" in ranks[3]._repr_html_()
    attempt = AttemptRecord(
        number=0, ranks=ranks, failures=[], outcome=Outcome.FAILED, note="", started=100.0, ended=101.0, last_line=0
    )
    assert repr(attempt) == "<Attempt 0 failed, 4 ranks>"
    assert attempt._repr_html_().count("<tr><td>") == 4 and len(attempt._repr_html_()) < 1000


def test_outcomes_and_states_print_as_words():
    assert str(Outcome.SUCCEEDED) == "succeeded" and f"{Outcome.TIMED_OUT}" == "timed out"
    assert str(RankState.FAILED) == "failed" and f"{RankState.STOPPED}" == "stopped"


TUTORIALS = Path(__file__).parent.parent / "notebooks"


@pytest.mark.slow
def test_quickstart_tutorial_ends_cleanly_without_a_tensor_dump_or_stderr_banner(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("DDPNB_QUICK", "1")
    nb = nbformat.read(TUTORIALS / "01_quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
            assert "tensor(" not in text, f"a tensor dump under:\n{cell.source}\n{text[:500]}"
            assert not (out.get("name") == "stderr" and "GPU(s) here" in text), cell.source
