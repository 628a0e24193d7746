"""Every tutorial notebook runs top to bottom through a real kernel, shrunk with DDPNB_QUICK=1 (the Slurm one in
tests/test_slurm.py, inside its two-node Slurm)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ALL_NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
NEEDS_SLURM = [p for p in ALL_NOTEBOOKS if "--engine slurm" in p.read_text()]  # run by tests/test_slurm.py
NOTEBOOKS = [p for p in ALL_NOTEBOOKS if p not in NEEDS_SLURM]
# what each cell tagged raises-exception must raise, by a name only that cell uses (the function it defines, or a
# session cell's variable): (exception type, in its text)
EXPECTED_ERRORS = {
    "bad_index": ("SessionError", "IndexError: index 100 is out of bounds"),
    "gives up before the all_reduce": ("SessionBroken", "rank 0 is stuck in all_reduce"),
    "rank_raises": ("WorkerError", "KeyError: 'label'"),
    "rank_hangs": ("WorkerError", "timed out"),
    "uses_a_lock": ("UsageError", "cannot send `uses_a_lock` to the worker processes"),
    "rank_segfaults": ("WorkerError", "SIGSEGV"),
}


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _raised(cell) -> tuple[str, str] | None:
    """(exception type, its text) of the cell's error: an error output, or a magic's UsageError on stderr."""
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            return out.ename, ANSI.sub("", out.evalue + "\n" + "\n".join(out.traceback))
        if out.output_type == "stream" and out.name == "stderr" and "UsageError" in out.text:
            return "UsageError", ANSI.sub("", out.text)
    return None


WARNING = re.compile(r"\b\w*Warning\b")  # FutureWarning, UserWarning, "Warning:" ...


def _around(found: re.Match) -> str:
    return "..." + found.string[max(0, found.start() - 80) : found.end() + 80] + "..."


def _shown_text(cell) -> str:
    """What a cell shows as text: its streams, and each display's plain text and HTML (the summary's log lines)."""
    shown = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            shown.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            shown.extend(out.data.get(kind, "") for kind in ("text/plain", "text/html"))
    return "\n".join(shown)


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=[pytest.mark.ray] if "--engine ray" in p.read_text() else []) for p in NOTEBOOKS],
    ids=[p.stem for p in NOTEBOOKS],
)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    # its runs apart: a detached one (08) would be listed by every later ddpnb.runs() of this user
    monkeypatch.setenv("DDPNB_RUNS_DIR", str(tmp_path / "runs"))
    run_notebook(path, tmp_path, monkeypatch)


def run_notebook(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> nbformat.NotebookNode:
    """Execute the notebook in a fresh kernel (it inherits this environment), shrunk; no warnings, and each cell
    tagged raises-exception raises what EXPECTED_ERRORS says. Returns the executed notebook."""
    monkeypatch.setenv("DDPNB_QUICK", "1")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()  # raises on any unexpected error
    warned = [
        f"cell {number}: {_around(found)}"
        for number, cell in enumerate(nb.cells)
        if (found := WARNING.search(_shown_text(cell)))
    ]
    assert not warned, f"{path.name} prints warnings (teach the API the supported torch wants):\n" + "\n".join(warned)
    for cell in nb.cells:
        if "raises-exception" not in cell.get("metadata", {}).get("tags", []):
            continue
        expected = next((error for name, error in EXPECTED_ERRORS.items() if name in cell.source), None)
        assert expected, f"{path.name}: say in EXPECTED_ERRORS what this cell must raise:\n{cell.source}"
        raised = _raised(cell)
        assert raised, f"{path.name}: a cell tagged raises-exception did not raise:\n{cell.source}"
        assert raised[0] == expected[0] and expected[1] in raised[1], (
            f"{path.name}: expected {expected[0]} saying {expected[1]!r}, got {raised[0]}:\n{raised[1][-2000:]}"
        )
    return nb


ON_ALL_GPUS = [p for p in NOTEBOOKS if "%%ddp --gpus all" in p.read_text()]


@pytest.mark.slow
@pytest.mark.parametrize("path", ON_ALL_GPUS, ids=[p.stem for p in ON_ALL_GPUS])
def test_notebook_runs_on_a_machine_with_one_gpu(path, tmp_path, monkeypatch):
    """`--gpus all` is one rank on a one-GPU machine (the H200 box), two CPU ranks here: the same notebook with
    `--gpus all` as one rank, so code that assumes a rank 1 fails here rather than there."""
    monkeypatch.setenv("DDPNB_QUICK", "1")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.source = cell.source.replace("%%ddp --gpus all", "%%ddp -n 1")
    nb.cells.append(nbformat.v4.new_code_cell("print('ranks in the last run:', ddpnb.last_run().world_size)"))
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()  # raises on any unexpected error
    assert nb.cells[-1].outputs[0].text == "ranks in the last run: 1\n"


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=[p.stem for p in ALL_NOTEBOOKS])
def test_committed_notebook_is_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "clear the outputs"
    text = json.dumps(nb)
    assert not re.search(r"/(home|root|Users|work|tmp)/", text), "no machine-specific absolute paths"
