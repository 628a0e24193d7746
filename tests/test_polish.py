"""First-hour polish (the ux task): line numbers as JupyterLab numbers a cell's lines (the `%%ddp` line is line 1),
launch notes in the run's header, warnings naming the cell, one byte format. Through a real Jupyter kernel and real
CPU ranks over gloo."""

from __future__ import annotations

import ast
import re
import time

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _value(kernel, expression: str, timeout: float = 60):
    run = kernel.execute(f"print(repr({expression}))", timeout=timeout)
    assert run.error is None, run.error
    return ast.literal_eval(run.stdout.strip().splitlines()[-1])


def _traceback(run) -> str:
    return ANSI.sub("", "\n".join(run.error["traceback"])) if run.error else ""


# --- 1. line numbers match JupyterLab's ---------------------------------------------------------------------------

RAISES_ON_LINE_4 = """%%ddp -n 2
def fails(rank):
    ready = True
    raise ValueError(f"line four, ready={ready}")
"""


def test_a_ranks_traceback_names_the_line_jupyterlab_shows(kernel):
    run = kernel.execute(RAISES_ON_LINE_4)
    shown = _traceback(run)
    assert run.error is not None and run.error["ename"] == "WorkerError", run.text
    assert f"Cell In[{run.count}], line 4, in fails" in shown, shown
    # the source under it is that line: the one that raised
    after = shown.split(f"Cell In[{run.count}], line 4, in fails", 1)[1].splitlines()
    assert 'raise ValueError(f"line four, ready={ready}")' in after[1], shown


def test_leading_blank_lines_of_the_cell_still_count(kernel):
    run = kernel.execute("%%ddp -n 2\n\n\ndef fails(rank):\n    raise ValueError('on line five')\n")
    shown = _traceback(run)
    assert f"Cell In[{run.count}], line 5, in fails" in shown and "raise ValueError('on line five')" in shown, shown


def test_a_cells_syntax_error_names_the_line_jupyterlab_shows(kernel):
    run = kernel.execute("%%ddp -n 2\nimport os\n\ndef train(rank:\n    return rank\n")
    shown = _traceback(run)
    assert run.error is not None and run.error["ename"] == "SyntaxError", run.text
    assert f"Cell In[{run.count}], line 4" in shown and "def train(rank:" in shown, shown


def test_an_error_in_the_cells_own_code_names_the_line_jupyterlab_shows(kernel):
    run = kernel.execute("%%ddp -n 2\nx = 1\nimport no_such_module_here\ndef train(rank):\n    return 1\n")
    shown = _traceback(run)
    assert run.error["ename"] == "ModuleNotFoundError" and f"Cell In[{run.count}], line 3" in shown, shown


SLEEPS_ON_LINE_5 = """%%ddp -n 2 --background -o sleeper --stall 2
def sleeper(rank):
    import time
    while True:
        time.sleep(0.5)
"""


def test_stacks_and_the_stall_summary_name_the_line_jupyterlab_shows(kernel):
    run = kernel.execute(SLEEPS_ON_LINE_5, timeout=180)
    assert run.error is None, run.error
    cell = f"Cell In[{run.count}], line 5"
    try:
        deadline = time.monotonic() + 120
        while not _value(kernel, "sleeper.record.stalled") and time.monotonic() < deadline:
            time.sleep(0.5)
        summary = _value(kernel, "ddpnb.core.report.diagnosis_summary(sleeper.record.stall.diagnosis)")
        assert summary == f"ranks 0, 1 are in time.sleep ({cell})", summary
        stacks = _value(kernel, "sleeper.stacks(wait=30)")
        for rank in (0, 1):
            shown = _value(kernel, f"ddpnb.core.cellnames.cell_names({stacks[rank]!r})")
            assert f"  {cell}, in sleeper\n    time.sleep(0.5)\n" in shown, shown  # as a traceback reads
    finally:
        kernel.execute("sleeper.stop()")


def test_a_ranks_cells_traceback_names_the_line_jupyterlab_shows(kernel):
    started = kernel.execute("%ddp_start -n 2", timeout=180)
    assert started.error is None, started.text
    try:
        failed = kernel.execute("%%ranks\nkept = rank\nif rank == 1:\n    raise ValueError('line four')\n")
        shown = _traceback(failed)
        assert failed.error is not None and failed.error["ename"] == "SessionError", failed.text
        assert f"Cell In[{failed.count}], line 4" in shown and "raise ValueError('line four')" in shown, shown
        line_form = kernel.execute("%ranks 1 / (rank - rank)")
        assert f"Cell In[{line_form.count}], line 1" in _traceback(line_form), line_form.text
    finally:
        stopped = kernel.execute("%ddp_stop")
    assert stopped.stdout == "[ddpnb] session stopped: its 2 ranks have ended, and their namespaces with them\n", (
        stopped.text
    )


# --- 2. launch notes in the header, not on stderr -------------------------------------------------------------------


def test_the_data_note_is_in_the_text_views_header_not_on_stderr(kernel):
    kernel.execute("import torch\nbig = torch.zeros(32 * 2**20)")  # 128 MiB of float32
    try:
        run = kernel.execute("%%ddp -n 2\ndef size(rank):\n    return big.numel()\n", timeout=180)
        assert run.error is None and run.results == [str(32 * 2**20)], run.text
        header = run.stdout.splitlines()[0]
        assert header.startswith(
            "[ddpnb] size on 2 ranks, backend gloo, devices cpu; wrote 128.0 MiB of notebook "
            "data into shared memory for the ranks in "
        ), header
        assert header.endswith(f"; logs in {_value(kernel, 'str(ddpnb.last_run().run_dir)')}"), header
        assert "shared memory" not in run.stderr, run.stderr
        assert "wrote 128.0 MiB" in _value(kernel, "ddpnb.last_run().launch_note")
        dashboard = _value(kernel, "__import__('ddpnb.views.html').views.html.header_html(ddpnb.last_run())")
        assert "wrote 128.0 MiB of notebook data into shared memory" in dashboard, dashboard
    finally:
        kernel.execute("del big")


def test_the_resume_note_is_in_the_header_and_the_record_not_on_stderr(kernel):
    kernel.execute("import torch")  # the cells below use the notebook's torch, whichever test ran before
    saved = kernel.execute(
        "%%ddp -n 2\ndef save(rank):\n    ddpnb.save_checkpoint({'step': torch.tensor(7)}, step=7)\n", timeout=180
    )
    assert saved.error is None, saved.text
    source = _value(kernel, "str(ddpnb.last_run().run_dir)")
    run = kernel.execute(
        f"%%ddp -n 2 --resume {source}\ndef load(rank):\n"
        "    state = {{'step': torch.tensor(0)}}\n    ddpnb.load_checkpoint(state)\n"
        "    return int(state['step'])\n".replace("{{", "{").replace("}}", "}"),
        timeout=180,
    )
    assert run.error is None and run.results == ["7"], run.text
    note = f"resuming from {source}/checkpoints: its latest complete checkpoint is step 7"
    assert note in run.stdout.splitlines()[0], run.stdout
    assert "resuming" not in run.stderr, run.stderr
    assert note in _value(kernel, "ddpnb.last_run().launch_note")


# --- 3. warnings name the cell ---------------------------------------------------------------------------------------


def test_a_warning_in_the_function_names_the_cell_and_its_line(kernel):
    run = kernel.execute(
        "%%ddp -n 2\nimport warnings\ndef warns(rank):\n"
        "    warnings.warn(f'careful on rank {rank}')\n    return rank\n",
        timeout=180,
    )
    assert run.error is None and run.results == ["0"], run.text
    for rank in (0, 1):
        assert f"[rank {rank}] Cell In[{run.count}], line 4: UserWarning: careful on rank {rank}" in run.stderr, (
            run.text
        )
    assert "warnings.warn(f'careful on rank {rank}')" in run.stderr  # the source line under it, as Python shows it
    assert "ipykernel_" not in run.text, run.text


def test_a_warning_from_a_file_keeps_pythons_own_format(kernel, tmp_path):
    module = tmp_path / "noisy_module_for_polish.py"
    module.write_text("import warnings\n\ndef noisy():\n    warnings.warn('from a file')\n")
    kernel.execute(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport noisy_module_for_polish")
    run = kernel.execute("%%ddp -n 1\ndef warns(rank):\n    noisy_module_for_polish.noisy()\n", timeout=180)
    assert run.error is None, run.text
    assert f"[rank 0] {module}:4: UserWarning: from a file" in run.stderr, run.text


def test_a_warning_in_a_ranks_cell_names_the_cell_and_its_line(kernel):
    started = kernel.execute("%ddp_start -n 2", timeout=180)
    assert started.error is None, started.text
    try:
        run = kernel.execute("%%ranks\nimport warnings\nx = 1\nwarnings.warn('in a session cell')\n")
        assert run.error is None, run.text
        assert f"Cell In[{run.count}], line 4: UserWarning: in a session cell" in run.stderr, run.text
        assert "ipykernel_" not in run.text, run.text
    finally:
        kernel.execute("%ddp_stop")


# --- 4. one byte format ----------------------------------------------------------------------------------------------


def test_every_byte_count_reads_in_binary_units_as_torch_and_nvidia_smi_print_memory():
    import torch

    from ddpnb._magic import state_dict_summary
    from ddpnb.core import data as shared
    from ddpnb.core.record import DataSent
    from ddpnb.core.words import size_text

    assert (
        state_dict_summary({"w": torch.zeros(2**18)}) == "state dict: 1 tensor, 262.1 k parameters (float32), 1.0 MiB"
    )
    note = shared.note(DataSent(written=3 * 2**30, reused=512 * 2**20, blocks=2, seconds=0.5))
    assert note.startswith("wrote 3.0 GiB of notebook data into shared memory") and ", 512.0 MiB reused" in note, note
    assert shared.note(DataSent(written=99 * 2**20, reused=0, blocks=1, seconds=0.1)) == ""  # under 100 MiB: quiet
    assert [size_text(n) for n in (60, 1536, 5 * 2**20, 2**31)] == ["60 B", "1.5 KiB", "5.0 MiB", "2.0 GiB"]


# --- 5. on-demand stacks are the caller's; a timeout's stay in the record ----------------------------------------------


def _sleeps_for_ever(rank):
    import time

    while True:
        time.sleep(0.2)


def test_on_demand_stacks_are_the_callers_and_a_timeouts_stay_in_the_record():
    import ddpnb
    from ddpnb.core.record import Outcome, RankState

    handle = ddpnb.launch(_sleeps_for_ever, nprocs=2, timeout=20, view="none")
    try:
        deadline = time.monotonic() + 120
        while not all(r.state is RankState.RUNNING for r in handle.record.ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        stacks = handle.stacks(wait=30)
        while not all("_sleeps_for_ever" in stacks.get(r, "") for r in (0, 1)) and time.monotonic() < deadline:
            stacks = handle.stacks(wait=30)  # RUNNING comes just before the function is entered: under load, ask again
        assert sorted(stacks) == [0, 1] and all("_sleeps_for_ever" in stacks[r] for r in (0, 1)), stacks
        assert [r.stack for r in handle.record.ranks] == ["", ""]  # asked for now: the caller's, not the record's
        record = handle.wait(120)
    finally:
        handle.stop()
    assert record.outcome is Outcome.TIMED_OUT, record.note
    assert all("_sleeps_for_ever" in r.stack and r.stalled_state is RankState.RUNNING for r in record.ranks)
    assert "_sleeps_for_ever" in str(ddpnb.WorkerError(record))  # the report shows where each rank was
