"""What a newcomer reads is what happens (issue 45): the README's Install section names what the two commands do to
the machine before them, a headless notebook's default view is what the README says, a failed cell shows its rank
table once, a session is not `last_run()`, the quickstart gives one duration, and the collective hint under a
timeout comes only where it fits. Kernel behaviour through one notebook executed by nbclient, as a newcomer's
executor would run it, with the default view."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from packaging.requirements import Requirement

from ddpnb.core import hints
from ddpnb.core.record import AttemptRecord, Diagnosis, Outcome, RankWhere, RunRecord
from tests import slurm_cluster

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
ANSI = re.compile(r"\x1b\[[0-9;]*m")

CELLS = {
    "load": "%load_ext ddpnb",
    "default view": '%%ddp -n 2\ndef hello(rank):\n    print(f"hello from {rank}", flush=True)\n    return rank\n',
    "text view": '%%ddp -n 2 --view text\ndef hello_text(rank):\n    print(f"hi from {rank}", flush=True)\n'
    "    return rank\n",
    "fails": "%%ddp -n 2\ndef fails(rank):\n    import time\n    if rank == 1:\n"
    '        raise ValueError("bad batch")\n    time.sleep(60)  # until rank 1\'s failure stops the run\n',
    "fails, text view": "%%ddp -n 2 --view text\ndef fails_text(rank):\n    import time\n    if rank == 1:\n"
    '        raise ValueError("bad batch")\n    time.sleep(60)\n',
    # no collective anywhere: rank 1 returns, rank 0 sleeps until the timeout
    "times out": "%%ddp -n 2 --timeout 8\ndef one_sleeps(rank):\n    import time\n    if rank == 0:\n"
    "        time.sleep(120)\n    return rank\n",
    "session": "%ddp_start -n 2",
    "ranks": "%%ranks\nx = rank\n",
    "runs": "print(json.dumps([repr(run) for run in ddpnb.runs()]))",
    "stop": "%ddp_stop",
    "last": "print(json.dumps([ddpnb.last_run().function, ddpnb.current_session().run.record.function]))",
}


@pytest.fixture(scope="module")
def cells(tmp_path_factory: pytest.TempPathFactory) -> dict[str, nbformat.NotebookNode]:
    """The notebook executed once, headless, with the default view, as a newcomer's nbclient runs it; by name."""
    path = tmp_path_factory.mktemp("newcomer")
    sources = [*CELLS.values()]
    sources[0] += "\nimport json"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    with pytest.MonkeyPatch.context() as env:
        env.delenv("DDPNB_VIEW", raising=False)  # the default: what a newcomer gets
        env.setenv("DDPNB_RUNS_DIR", str(path / "runs"))
        NotebookClient(
            nb, timeout=240, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(path)}}
        ).execute()
    return dict(zip(CELLS, nb.cells))


def _streams(cell: nbformat.NotebookNode) -> str:
    return "".join(out.text for out in cell.outputs if out.output_type == "stream")


def _summary(cell: nbformat.NotebookNode) -> dict[str, str]:
    [summary] = [out.data for out in cell.outputs if out.output_type == "display_data"]
    return summary


def _error(cell: nbformat.NotebookNode) -> str:
    [error] = [out for out in cell.outputs if out.output_type == "error"]
    return ANSI.sub("", "\n".join(error.traceback))


# --- 1 and 2: the Install section, read top to bottom ---------------------------------------------------------


def _before_first(command: str) -> str:
    """The README up to the first line that runs `command`: what a reader has read before it."""
    found = re.search(rf"^{re.escape(command)}(?=\s)", README, re.MULTILINE)
    assert found, f"the README never runs {command!r}"
    return README[: found.start()]


def test_the_readme_names_what_the_test_command_installs_and_starts_before_the_command():
    script = (ROOT / "scripts" / "test.sh").read_text()
    installed = {
        word
        for line in script.splitlines()
        if "apt-get install" in line
        for word in shlex.split(line.split("apt-get install", 1)[1].split(">")[0])
        if not word.startswith("-")
    }
    assert installed == {"chromium", *slurm_cluster.PACKAGES}  # what the script and the Slurm tests install
    read = _before_first("bash scripts/test.sh")
    for package in installed:
        assert f"`{package}`" in read, f"the README names {package} only after the command that installs it"
    assert "with `apt-get`, as root" in read
    assert "start a two-node Slurm on this machine" in read and "stop it when they end" in read
    assert "Ray instances they start" in read


def test_the_readme_says_how_to_get_a_cpu_only_torch_before_the_install_command_and_that_it_is_kept():
    read = _before_first("pip install -e .")
    assert "`pip install torch --index-url https://download.pytorch.org/whl/cpu`" in read
    assert "the CUDA build" in read and "it runs on CPU too" in read
    # "and `pip install -e .` keeps it": PyTorch's CPU builds carry a local version that meets ddpnb's requirement
    [torch] = [Requirement(d) for d in importlib.metadata.requires("ddpnb") if Requirement(d).name == "torch"]
    assert torch.specifier.contains("2.5.1+cpu") and torch.specifier.contains("2.9.0+cpu")


# --- 3: the default view under nbclient ---------------------------------------------------------------------------


def test_a_headless_notebook_keeps_the_summary_by_default_and_rank_lines_with_view_text(cells):
    default = cells["default view"]
    assert "[rank " not in _streams(default)  # no [rank N] lines by default, as the README says
    summary = _summary(default)
    assert "data-ddpnb-summary" in summary["text/html"] and "hello from 1" in summary["text/html"]
    assert re.search(r"^rank  state .*\n +0  finished ", summary["text/plain"], re.MULTILINE), summary["text/plain"]
    text = _streams(cells["text view"])
    assert "[rank 0] hi from 0\n" in text and "[rank 1] hi from 1\n" in text  # --view text: the lines
    assert "nbclient" in README and "set `DDPNB_VIEW=text` (or `--view text`)\nthere for the lines" in README


# --- 4: a failed cell's table and logs, once ------------------------------------------------------------------------


def test_a_failed_cell_shows_the_rank_table_and_the_logs_once(cells):
    failed = cells["fails"]
    summary, error = _summary(failed), _error(failed)
    assert "rank  state" in summary["text/plain"] and "full per-rank logs: " in summary["text/plain"]
    assert 'class="ddpnb-ranks"' in summary["text/html"] and "rank{0..1}.log" in summary["text/html"]
    assert 'raise ValueError("bad batch")' in error  # the traceback: in the error only
    assert "rank  state" not in error and "full per-rank logs" not in error and "rank{0..1}.log" not in error
    assert "every rank's state and its full log: in the summary above" in error
    text_view = cells["fails, text view"]  # no summary table: the error has it, once
    shown = _streams(text_view) + _error(text_view)
    assert shown.count("rank  state") == 1 and shown.count("full per-rank logs: ") == 1, shown


# --- 5: a session is not last_run() -------------------------------------------------------------------------------


def test_last_run_after_a_session_is_the_latest_ddp_run_and_the_session_is_named_as_one(cells):
    assert json.loads(_streams(cells["last"])) == ["one_sleeps", "session"]
    [listed] = json.loads(_streams(cells["runs"]))
    assert listed.startswith("<ddpnb run of session on 2 ranks (gloo): running")
    assert "serve" not in _streams(cells["session"]) + listed
    assert "`ddpnb.last_run()` stays the latest `%%ddp` (or `run`, `launch`) run" in README


# --- 6: one duration for the quickstart's run ----------------------------------------------------------------------


@pytest.mark.slow
def test_the_quickstart_says_how_long_its_run_took_once(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ddpnb.quickstart"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DDPNB_RUNS_DIR": str(tmp_path)},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    durations = re.findall(r"^.*\bin \d+(?:\.\d)? (?:s|min)\b.*$", done.stdout, re.MULTILINE)
    assert len(durations) == 1 and durations[0].startswith("[ddpnb] run succeeded in "), done.stdout
    assert done.stdout.splitlines()[-1].startswith("rank 0 returned {'accuracy': ")
    assert re.search(r"`\[ddpnb\] run succeeded in \d+(\.\d)? s` line", README)


# --- 7: the collective hint, only where a rank waited in one --------------------------------------------------------


def test_a_timeout_without_a_collective_gives_no_collective_hint(cells):
    error = _error(cells["times out"])
    assert re.search(
        r"^where each rank was: rank 0 is in time\.sleep \(Cell In\[\d+\], line 5\); rank 1 has "
        r"(finished|returned)$",
        error,
        re.MULTILINE,
    ), error
    assert error.rstrip().endswith("The stacks above show where each rank was when the timeout stopped the run.")
    assert "collective" not in error


def _timed_out(*ranks: RankWhere) -> str:
    record = RunRecord(
        run_dir=Path("/tmp/x"),
        world_size=len(ranks),
        backend="gloo",
        outcome=Outcome.TIMED_OUT,
        current=AttemptRecord(0, [], at_timeout=Diagnosis(taken=0.0, ranks=list(ranks))),
    )
    return hints.hint(record)


def test_the_collective_hint_comes_where_a_rank_waited_in_one_while_another_was_elsewhere_or_had_ended():
    waits = RankWhere(rank=0, quiet=5.0, waits_in="all_reduce", at="Cell In[4], line 7")
    fits = "a collective waits until every rank reaches it"
    assert fits in _timed_out(waits, RankWhere(rank=1, quiet=5.0, call="time.sleep", at="Cell In[4], line 6"))
    assert fits in _timed_out(waits, RankWhere(rank=1, quiet=5.0, ended="returned"))
    both_wait = _timed_out(waits, RankWhere(rank=1, quiet=5.0, waits_in="broadcast", at="Cell In[4], line 8"))
    assert "collective" not in both_wait  # every rank reached one: "a rank that never does" would be untrue
    assert "collective" not in _timed_out(
        RankWhere(rank=0, quiet=5.0, call="time.sleep"), RankWhere(rank=1, quiet=5.0, ended="finished")
    )
