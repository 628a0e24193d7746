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

RAISES_ON_LINE_4 = '''%%ddp -n 2
def fails(rank):
    ready = True
    raise ValueError(f"line four, ready={ready}")
'''


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


SLEEPS_ON_LINE_5 = '''%%ddp -n 2 --background -o sleeper --stall 2
def sleeper(rank):
    import time
    while True:
        time.sleep(0.5)
'''


def test_stacks_and_the_stall_summary_name_the_line_jupyterlab_shows(kernel):
    run = kernel.execute(SLEEPS_ON_LINE_5, timeout=180)
    assert run.error is None, run.error
    cell = f"Cell In[{run.count}], line 5"
    try:
        deadline = time.monotonic() + 120
        while not _value(kernel, "sleeper.record.stalled") and time.monotonic() < deadline:
            time.sleep(0.5)
        summary = _value(kernel, "sleeper.record.stall.diagnosis.summary()")
        assert summary == f"ranks 0, 1 are in time.sleep ({cell})", summary
        stacks = _value(kernel, "sleeper.stacks(wait=30)")
        for rank in (0, 1):
            shown = _value(kernel, f"ddpnb.core.record.cell_names({stacks[rank]!r})")
            assert f"{cell} in sleeper" in shown, shown
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
        kernel.execute("%ddp_stop")
