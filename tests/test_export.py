"""`%ddp_export` / `ddpnb.export` (issue 43): a real kernel defines and runs the training, exports it, and torchrun
(or the two-node Slurm, through the sbatch file) runs the script to the cell's own result."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import Kernel

pytestmark = pytest.mark.slow

SETUP = """\
import functools
import os
import pathlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ddpnb

SEED = 7
STEPS = 4
CONFIG = {"hidden": 8, "lr": 0.05}
"""

# a Dataset, a model with a base class, and a training function a factory makes: its hyperparameter in a closure
TRAINING = """\
class Squares(Dataset):
    def __init__(self, n):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.x[i].pow(2).sum(0, keepdim=True)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.layer = nn.Linear(width, width)


class Regressor(Block):
    def __init__(self):
        super().__init__(CONFIG["hidden"])
        self.inp, self.out = nn.Linear(4, CONFIG["hidden"]), nn.Linear(CONFIG["hidden"], 1)

    def forward(self, x):
        return self.out(torch.relu(self.layer(torch.relu(self.inp(x)))))


def make_train(lr):
    def train(rank, world_size):
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(SEED)
        data = Squares(64)
        loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=True))
        model = DistributedDataParallel(Regressor())
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for step, (x, y) in zip(range(STEPS), loader):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ddpnb.log(step=step, loss=loss.item())
        print(f"final loss {loss.item()}")
        return {"loss": loss.item(), "state": model.module.state_dict()}

    return train
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory):
    k = Kernel(env={"DDPNB_VIEW": "text", "DDPNB_RUNS_DIR": str(tmp_path_factory.mktemp("export") / "runs")})
    for cell in ("%load_ext ddpnb", SETUP, TRAINING):
        done = k.execute(cell)
        assert done.error is None, done.error
    yield k
    k.shutdown()


def run_cell(kernel: Kernel, code: str, timeout: float = 180) -> str:
    done = kernel.execute(code, timeout=timeout)
    assert done.error is None, f"{done.error}\n{done.text}"
    return done.text


def torchrun(script: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc_per_node 2 SCRIPT` (this Python's torchrun), on CPU over gloo."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            "--run-dir",
            str(run_dir),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=script.parent,
        check=False,
    )
    assert done.returncode == 0, f"--- the script:\n{script.read_text()}\n--- its output:\n{done.stdout}\n{done.stderr}"
    return done


def assert_same(mine: object, theirs: object) -> None:
    if isinstance(mine, dict):
        assert isinstance(theirs, dict) and mine.keys() == theirs.keys()
        for key in mine:
            assert_same(mine[key], theirs[key])
    elif isinstance(mine, torch.Tensor):
        torch.testing.assert_close(mine, theirs)
    elif isinstance(mine, float):
        assert mine == pytest.approx(theirs, rel=1e-5)
    else:
        assert mine == theirs


def ruff_findings(script: Path) -> str:
    """`ruff check` on the script in its own directory (no project's configuration: ruff's default rules)."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e .[test])")
    done = subprocess.run(
        [ruff, "check", "--no-cache", script.name], capture_output=True, text=True, cwd=script.parent, check=False
    )
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_cell_exported_with_export_flag_trains_the_same_under_torchrun(kernel, tmp_path):
    script = tmp_path / "job" / "train.py"
    run_cell(kernel, f'%%ddp -n 2 -o result --export "{script}"\ntrain = make_train(CONFIG["lr"])')
    run_cell(kernel, f"torch.save(result, {str(tmp_path / 'cell.pt')!r})")
    text = script.read_text()
    # readable: the notebook's definitions as source, each once, nothing pickled, nothing the function does not use
    for definition in (
        "class Squares(Dataset):",
        "class Block(nn.Module):",
        "class Regressor(Block):",
        "def make_train(lr):",
        'train = make_train(CONFIG["lr"])',
        "SEED = 7",
        "STEPS = 4",
        "CONFIG = {'hidden': 8, 'lr': 0.05}",
        "import ddpnb",
        "from torch import nn",
    ):
        assert text.count(definition) == 1, definition
    assert "pickle" not in text and "np." not in text and "import numpy" not in text
    assert text.index("class Block") < text.index("class Regressor") < text.index("def make_train")
    assert ruff_findings(script) == ""

    run_dir = tmp_path / "run"
    done = torchrun(script, run_dir)
    expected, got = torch.load(tmp_path / "cell.pt"), torch.load(run_dir / "result.pt")
    assert_same(expected, got)
    assert f"final loss {expected['loss']}" in done.stdout
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({m["rank"] for m in metrics}) == [0, 1]
    assert sorted(m["step"] for m in metrics if m["rank"] == 0) == list(range(4))
    last = max((m for m in metrics if m["rank"] == 0), key=lambda m: m["step"])
    assert last["loss"] == pytest.approx(expected["loss"], rel=1e-6)


LEAVES_A_THREAD = """\
def leaves_a_thread(rank, world_size):
    import atexit
    import threading

    threading.Thread(target=threading.Event().wait, name="never-ends").start()  # not a daemon: it keeps Python
    atexit.register(open, f"{AT_EXIT}.{rank}", "w")  # as a tracker registers its finish
    return rank + 1
"""


def test_exported_script_ends_when_the_function_returns_whatever_threads_it_left(kernel, tmp_path):
    """As a %%ddp rank does (it leaves by os._exit): without Python's teardown, which would wait for that thread
    forever, and which torch's gloo threads, outliving destroy_process_group, can abort (SIGABRT); the handlers the
    function registered with atexit run first, as at any script's end."""
    run_cell(kernel, f"AT_EXIT = {str(tmp_path / 'at-exit')!r}\n" + LEAVES_A_THREAD)
    assert run_cell(kernel, "print(ddpnb.run(leaves_a_thread, nprocs=2, view='none'))").strip() == "1"
    script = tmp_path / "leaves_a_thread.py"
    run_cell(kernel, f"ddpnb.export(leaves_a_thread, {str(script)!r}, nprocs=2)")
    said, code = torchrun_ended([str(script), "--run-dir", str(tmp_path / "run")], timeout=120)
    assert code == 0, f"--- the script:\n{script.read_text()}\n--- torchrun:\n{said}"
    assert torch.load(tmp_path / "run" / "result.pt") == 1
    assert (tmp_path / "at-exit.0").exists() and (tmp_path / "at-exit.1").exists()


# acceptance 5: each defined in the kernel, run there by ddpnb, exported with the same options and run by torchrun
VARIED = {
    "nested_helper": (
        """\
def nested_helper(rank, world_size):
    def square_sum(values):
        return sum(v * v for v in values)

    total = torch.tensor([float(square_sum(range(rank + 3)))])
    dist.all_reduce(total)
    return total.item()
""",
        {},
    ),
    "class_hierarchy": (
        """\
class Base(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.width = width

    def describe(self):
        return f"{type(self).__name__}({self.width})"


class Scaled(Base):
    def __init__(self, width, scale):
        super().__init__(width)
        self.scale = scale

    def forward(self, x):
        return x * self.scale


def class_hierarchy(rank, world_size):
    model = Scaled(4, 2.0)
    total = model(torch.ones(model.width))
    dist.all_reduce(total)
    return model.describe(), total.tolist()
""",
        {},
    ),
    "decorated": (
        """\
def doubled(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        return 2 * fn(*args)

    return wrapper


@doubled
def decorated(rank, world_size):
    return rank + world_size + 1
""",
        {},
    ),
    "partial": (
        """\
def scaled_sum(rank, world_size, factor, offset=0):
    total = torch.tensor([float(rank + offset)])
    dist.all_reduce(total)
    return factor * total.item()


partial = functools.partial(scaled_sum, factor=3, offset=1)
""",
        {},
    ),
    "module_alias": (
        """\
def module_alias(rank, world_size):
    x = torch.from_numpy(np.arange(4, dtype=np.float32))
    return F.relu(x - 1).sum().item() + rank
""",
        {},
    ),
    "constant_dict": (
        """\
SETTINGS = {"width": 3, "names": ["a", "b"], "scale": 0.5, "nested": {"on": True, "off": None}, "pair": (1, 2)}


def constant_dict(rank, world_size):
    return [SETTINGS["scale"] * SETTINGS["width"], SETTINGS["names"], SETTINGS["nested"], SETTINGS["pair"]]
""",
        {},
    ),
    "own_group": (
        """\
def own_group(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return total.item()
""",
        {},
    ),
    "spawn_style": (
        """\
def spawn_style(rank, base):
    total = torch.tensor([float(base + rank)])
    dist.all_reduce(total)
    return total.item()
""",
        {"args": (10,), "call_style": "spawn"},
    ),
    "checkpointed": (
        """\
def checkpointed(rank, world_size):
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.5)
    ddpnb.save_checkpoint({"model": model, "epoch": 3}, step=1)
    fresh = nn.Linear(2, 1)
    state = {"model": fresh, "epoch": 0}
    step = ddpnb.load_checkpoint(state)
    return step, state["epoch"], fresh.weight.sum().item()
""",
        {},
    ),
    "reads_file": (
        """\
NUMBERS = pathlib.Path({numbers!r})


def reads_file(rank, world_size):
    return sum(int(word) for word in NUMBERS.read_text().split()) + rank
""",
        {},
    ),
    "opens_file": (
        """\
NUMBERS_FILE = str({numbers!r})


def opens_file(rank, world_size):
    with open(NUMBERS_FILE) as numbers:  # the notebook's `open` is IPython's own; the script's, the builtin
        return sum(int(word) for word in numbers.read().split()) * 2 + rank
""",
        {},
    ),
}


def torchrun_all(scripts: list[Path], timeout: float = 300) -> tuple[str, int]:
    """tests/run_scripts.py's one torchrun of `scripts`, 2 ranks: what it said, and its exit status."""
    return torchrun_ended([str(Path(__file__).with_name("run_scripts.py")), *map(str, scripts)], timeout)


def torchrun_ended(args: list[str], timeout: float) -> tuple[str, int]:
    """`torchrun --standalone --nproc_per_node 2 ARGS...`, killed with its ranks after `timeout` seconds: what it
    said, and its exit status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as launch:
        try:
            return launch.communicate(timeout=timeout)[0], launch.returncode
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)  # torchrun and its ranks
            return f"{launch.communicate()[0]}\n(killed after {timeout:g} s)", -signal.SIGKILL


@pytest.fixture(scope="module")
def varied(kernel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each case of VARIED in a directory of its own: defined in the kernel and run there by ddpnb (its value in
    expected.pt), exported with the same options, and the scripts run by torchrun, all in one launch
    (tests/run_scripts.py: torch is imported once); a script that fails ends that launch, and the cases after it
    run in another. Each case's test then checks its own directory."""
    base = tmp_path_factory.mktemp("varied")
    scripts = []
    for case, (source, options) in VARIED.items():
        where = base / case
        where.mkdir()
        numbers = where / "numbers.txt"
        numbers.write_text("1 2 3\n4\n")
        defined = kernel.execute(source.replace("{numbers!r}", repr(str(numbers))), timeout=180)
        exported = kernel.execute(
            f"value = ddpnb.run({case}, nprocs=2, view='none', **{options!r})\n"
            f"torch.save(value, {str(where / 'expected.pt')!r})\n"
            f"ddpnb.export({case}, {str(where / f'{case}.py')!r}, nprocs=2, **{options!r})",
            timeout=180,
        )
        (where / "cells.txt").write_text(
            "".join(f"{done.error}\n{done.text}" for done in (defined, exported) if done.error is not None)
        )
        if (where / f"{case}.py").exists():
            scripts.append(where / f"{case}.py")
    while scripts:
        said, code = torchrun_all(scripts)
        done = [all(script.with_suffix(f".rank{r}.done").exists() for r in (0, 1)) for script in scripts]
        ran = len(list(itertools.takewhile(bool, done)))
        if code == 0 and ran == len(scripts):
            break
        failed = min(ran, len(scripts) - 1)  # (all ran, yet torchrun failed: as the last one ended)
        scripts[failed].with_suffix(".torchrun").write_text(f"exit status {code}\n{said}")
        scripts = scripts[failed + 1 :]
    return {case: base / case for case in VARIED}


@pytest.mark.parametrize("case", list(VARIED))
def test_varied_function_exported_runs_to_the_cells_result(varied, case):
    where = varied[case]
    cells = (where / "cells.txt").read_text()
    assert cells == "", cells  # the kernel's cells defined, ran and exported it
    script = where / f"{case}.py"
    assert ruff_findings(script) == ""
    outputs = "".join(f"\n--- {log.name}:\n{log.read_text()}" for log in sorted(where.glob("*.rank?.log")))
    torchrun = where / f"{case}.torchrun"
    assert not torchrun.exists(), (
        f"--- the script:\n{script.read_text()}\n--- torchrun:\n{torchrun.read_text()}{outputs}"
    )
    assert_same(torch.load(where / "expected.pt"), torch.load(where / "run" / "result.pt"))


def test_notebook_tensor_is_named_and_travels_with_data(kernel, tmp_path):
    run_cell(kernel, "WEIGHTS = torch.arange(6.0).reshape(2, 3)")
    run_cell(
        kernel, "def uses_weights(rank, world_size):\n    total = WEIGHTS.sum() * (rank + 1)\n    return total.item()\n"
    )
    run_cell(kernel, "expected_value = ddpnb.run(uses_weights, nprocs=2, view='none')\nprint(expected_value)")
    script = tmp_path / "uses_weights.py"
    refused = kernel.execute(f'%ddp_export "{script}" --fn uses_weights')
    said = refused.stderr + (refused.error or {}).get("evalue", "")
    assert "`WEIGHTS` is a torch.Tensor of shape (2, 3)" in said, said
    assert "uses_weights uses it at Cell In[" in said and "total = WEIGHTS.sum() * (rank + 1)" in said, said
    assert "torch.save(WEIGHTS, PATH)" in said and "--data DIR" in said, said
    assert not script.exists()

    data = tmp_path / "uses_weights_data"
    said = run_cell(kernel, f'%ddp_export "{script}" --fn uses_weights --data "{data}"')
    assert (data / "WEIGHTS.pt").exists() and str(script) in said
    text = script.read_text()
    assert 'WEIGHTS = _notebook_data("WEIGHTS")' in text or "WEIGHTS = _notebook_data('WEIGHTS')" in text
    assert ruff_findings(script) == ""
    run_dir = tmp_path / "run"
    torchrun(script, run_dir)
    assert torch.load(run_dir / "result.pt") == pytest.approx(15.0)


def test_export_before_any_cell_or_of_a_lambda_says_what_to_do(kernel, tmp_path):
    said = kernel.execute(f'ddpnb.export(lambda rank: rank, "{tmp_path / "x.py"}")')
    assert said.error is not None and "needs a name in the script: pass name='train'" in said.error["evalue"]
    said = kernel.execute(f'ddpnb.export(print, "{tmp_path / "x.txt"}")')
    assert said.error is not None and "must end in .py" in said.error["evalue"]


def test_sbatch_file_trains_the_same_on_two_slurm_nodes(kernel, tmp_path, cluster):
    script = tmp_path / "train.py"
    expected = run_cell(
        kernel,
        'train = make_train(CONFIG["lr"])\nresult = ddpnb.run(train, nprocs=2, view="none")\nprint(result["loss"])',
    ).strip()
    run_cell(kernel, f"ddpnb.export(train, {str(script)!r}, nprocs=2, sbatch=True, nodes=2, time='00:05:00')")
    sbatch = script.with_suffix(".sbatch")
    text = sbatch.read_text()
    assert "#SBATCH --ntasks=2" in text and "#SBATCH --nodes=2" in text and "#SBATCH --time=00:05:00" in text
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--wait", f"--chdir={tmp_path}", str(sbatch)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **cluster.env},
        check=False,
    )
    job = submitted.stdout.strip().split(";")[0]
    out = (tmp_path / f"train-{job}.out").read_text() if job else ""
    assert submitted.returncode == 0, f"{submitted.stdout}{submitted.stderr}{out}"
    assert f"0: final loss {expected}" in out and "1: final loss" in out, out
    metrics = [json.loads(line) for line in (tmp_path / "runs" / f"train-{job}" / "metrics.jsonl").open()]
    assert {m["rank"] for m in metrics} == {0, 1}
    assert_same(result_of(kernel, tmp_path), torch.load(tmp_path / "runs" / f"train-{job}" / "result.pt"))


def result_of(kernel: Kernel, tmp_path: Path) -> object:
    run_cell(kernel, f"torch.save(result, {str(tmp_path / 'cell.pt')!r})")
    return torch.load(tmp_path / "cell.pt")
