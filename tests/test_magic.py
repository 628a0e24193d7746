"""`%%ddp` through a real Jupyter kernel: the core acceptance of issue 2."""

from __future__ import annotations

import re

import nbformat
import pytest
import torch
from nbclient import NotebookClient

from tests.conftest import PACKAGE_DIR, wait_gone

TRAIN_CELL = """%%ddp -n 2 -o trained
def train(rank, world_size):
    import sys
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            ddpnb.log(step=step, loss=loss.item())
    print(f"epoch done on rank {rank}")
    print(f"stderr line from rank {rank}", file=sys.stderr)
    os.write(1, f"fd-level write from rank {rank}\\n".encode())
    state = model.module.state_dict()
    flat = torch.cat([p.flatten() for p in state.values()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered), "ranks diverged"
    return {"state": state, "ranks_agree": True}
"""


def test_notebook_trains_ddp_on_two_cpu_ranks(tmp_path, monkeypatch):
    cells = [
        "%load_ext ddpnb",
        "import os\nimport torch\nimport ddpnb",
        TRAIN_CELL,
        "print(sorted(trained['state']), trained['ranks_agree'])",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    monkeypatch.setenv("DDPNB_VIEW", "text")  # for the notebook's kernel only: later tests choose their own
    NotebookClient(nb, timeout=180, resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[2].outputs
    stdout = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    for rank in (0, 1):
        assert f"[rank {rank}] epoch done on rank {rank}" in stdout
        assert f"[rank {rank}] fd-level write from rank {rank}" in stdout
        assert f"[rank {rank}] stderr line from rank {rank}" in stderr
    assert "logs in" in stdout
    result = [o for o in outputs if o.output_type == "execute_result"]
    assert not result  # -o trained names the value: the cell shows none, as `trained = train()` would
    assert nb.cells[3].outputs[0]["text"].strip() == "['bias', 'weight'] True"


def test_seed_style_code_runs_unmodified(kernel):
    kernel.execute("import torch, torch.distributed as dist")
    run = kernel.execute("""%%ddp -n 2
def setup(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

def demo_basic(rank, world_size):
    setup(rank, world_size)
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    cleanup()
    return t.item()
""")
    assert run.error is None, run.error
    assert run.results == ["3.0"]


def test_closure_notebook_class_and_global_reach_the_workers(kernel):
    kernel.execute("""
import torch
class Scaler(torch.nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor
    def forward(self, x):
        return x * self.factor
OFFSET = 100
""")
    run = kernel.execute("""
def make(factor):
    def scaled(rank):
        return Scaler(factor)(torch.tensor(float(rank))).item() + OFFSET
    return scaled
job = make(7)
""")
    assert run.error is None
    run = kernel.execute("%ddp -n 2 --fn job")
    assert run.error is None, run.error
    assert run.results == ["100.0"]
    run = kernel.execute("%%ddp -n 2 -o lam\nf = lambda: OFFSET + 1\ndef g():\n    return f()\n")
    assert run.error is None and kernel.execute("lam").results == ["101"]


def test_cell_definitions_stay_in_the_kernel(kernel):
    run = kernel.execute("%%ddp -n 2\nimport os\ndef where(rank):\n    return os.getpid()\n")
    assert run.error is None
    worker_pid = int(run.results[0])
    pids = kernel.execute("print(os.getpid(), where.__name__)").stdout.split()
    assert int(pids[0]) != worker_pid and pids[1] == "where"


def test_the_cells_function_runs_once_on_each_rank_and_never_in_the_kernel(kernel, tmp_path):
    calls = tmp_path / "calls"  # every call of the function appends the PID of the process it ran in
    run = kernel.execute(
        f"%%ddp -n 2\nimport os\ndef record_pid():\n    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n    return os.getpid()\n"
    )
    assert run.error is None, run.error
    pids = [int(pid) for pid in calls.read_text().split()]
    assert kernel.pid not in pids
    assert len(set(pids)) == len(pids) == 2 and int(run.results[0]) in pids


def test_failing_rank_raises_worker_error_with_user_traceback(kernel):
    run = kernel.execute("""%%ddp -n 2
def fails(rank, world_size):
    import torch.distributed as dist
    if rank == 1:
        raise ValueError("bad batch on purpose")
    dist.barrier()
""")
    assert run.error is not None and run.error["ename"] == "WorkerError"
    shown = "\n".join(run.error["traceback"])
    assert "rank 1 of 2 failed first: ValueError: bad batch on purpose" in shown
    assert 'raise ValueError("bad batch on purpose")' in shown  # the user's own line, from the cell
    assert f"Cell In[{run.count}], line 5, in fails" in shown  # named as IPython names its cells
    assert PACKAGE_DIR not in shown
    pids = [int(p) for p in kernel.execute("print(*[r.pid for r in ddpnb.last_run().ranks])").stdout.split()]
    assert wait_gone(pids) == []
    after = kernel.execute("1 + 1")
    assert after.error is None and after.results == ["2"]


@pytest.mark.parametrize(
    "line, expected",
    [
        ("--bogus", "unrecognized arguments: --bogus"),
        ("--nprocs 0", "--nprocs must be at least 1"),
        ("--gpus 64", "asks for more GPUs than this machine has"),
        ("--timeout -1", "--timeout must be a positive number"),
        ("--env NOEQUALS", "--env takes KEY=VALUE"),
        ("--timeout nan", "--timeout must be a positive number"),
        ("-o 1bad", "-o/--out takes a variable name"),
        ("--address auto", "address is for the ray engine"),
        ("--fn OFFSET_VALUE", "OFFSET_VALUE is not a function (its type is int)"),
        ("--max-restarts -1", "max_restarts must be a whole number of 0 or more"),
        ("--keep-checkpoints 0", "keep_checkpoints must be a whole number of 1 or more"),
        ("--resume /no/such/run", "--resume /no/such/run: no such directory. Pass 'last', a run directory"),
    ],
)
def test_bad_flags_raise_usage_error_with_hint(kernel, line, expected):
    kernel.execute("OFFSET_VALUE = 3\nran = False")
    run = kernel.execute(f"%%ddp {line}\nran = True\ndef f():\n    return 1\n")
    assert run.error is None  # IPython prints a UsageError instead of raising into the cell
    assert "UsageError" in run.stderr and expected in run.stderr
    # refused before the cell ran; --fn names another function, so the cell's definitions are made first
    assert kernel.execute("print(ran)").stdout.strip() == str(line.startswith("--fn"))


def test_the_function_is_the_one_nothing_else_in_the_cell_uses(kernel):
    """A helper defined after `train`, or a factory that builds it, is not what the ranks run."""
    kernel.execute("import torch")  # the second cell builds a model: this test must not rely on an earlier one's
    run = kernel.execute(
        "%%ddp -n 2\ndef train(rank):\n    return helper(rank + 10)\ndef helper(x):\n    return x * 2\n"
    )
    assert run.error is None and run.results == ["20"]
    assert "[ddpnb] train on 2 ranks" in run.stdout  # the header names the function it ran
    run = kernel.execute(
        "%%ddp -n 2\ndef make_train(offset):\n    def train(rank):\n        return rank + offset\n"
        "    return train\ntrain_fn = make_train(5)\nmodel = torch.nn.Linear(2, 2)\n"
    )
    assert run.error is None and run.results == ["5"]


def test_two_unrelated_functions_ask_which_one(kernel):
    run = kernel.execute("%%ddp -n 2\ndef train(rank):\n    return 1\ndef evaluate(rank):\n    return 2\n")
    assert "UsageError" in run.stderr and "defines `train` and `evaluate`" in run.stderr
    assert "--fn evaluate" in run.stderr
    assert kernel.execute("%ddp -n 2 --fn evaluate").results == ["2"]  # the cell's definitions are in place


@pytest.mark.parametrize(
    "cell, expected",
    [
        ("async def train(rank):\n    return rank", "train is an async function"),
        ("def train(rank):\n    yield rank", "train is a generator function"),
        (
            "def train(*, rank, world_size):\n    return rank",
            "train(*, rank, world_size) cannot be called as each rank",
        ),
        ("def train(rank, world_size, lr):\n    return rank", "missing a required argument: 'lr'"),
    ],
)
def test_a_function_the_ranks_cannot_call_is_refused_before_launch(kernel, cell, expected):
    run = kernel.execute(f"%%ddp -n 2\n{cell}\n")
    assert "UsageError" in run.stderr and expected in run.stderr, run.text
    assert "[ddpnb]" not in run.stdout  # nothing started


def test_ipython_syntax_in_the_cell_and_errors_in_its_own_code(kernel):
    run = kernel.execute("%%ddp -n 2\nfiles = !echo hello\ndef train(rank):\n    return files[0]\n")
    assert run.error is None and run.results == ["'hello'"]
    run = kernel.execute("%%ddp -n 2\nimport no_such_module_here\ndef train(rank):\n    return 1\n")
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(run.error["traceback"]))  # IPython 9 colours every part
    assert run.error["ename"] == "ModuleNotFoundError" and f"In[{run.count}], line 2" in shown
    assert "_magic.py" not in shown
    run = kernel.execute("%%ddp -n 2\ndef train(rank):\n    return rank +\n")
    assert run.error["ename"] == "SyntaxError" and "return rank +" in "\n".join(run.error["traceback"])


def test_cell_without_function_is_a_usage_error(kernel):
    run = kernel.execute("%%ddp -n 2\nx = 1\n")
    assert "defines no function" in run.stderr


@pytest.mark.parametrize("magic, kind", [("ddp", "cell"), ("ddp_start", "line"), ("ranks", "cell")])
def test_help_documents_every_flag(kernel, magic, kind):
    """Every flag the magic's own parser takes (not a list kept by hand) is in the help `%%ddp?` shows."""
    found = f"get_ipython().find_{kind}_magic({magic!r})"
    run = kernel.execute(
        f"from ddpnb._compat import parser_options\nmagic = {found}\n"
        "print(*parser_options(magic.parser))\n"
        "print('@@HELP@@', magic.__doc__)"
    )
    flags, _, help_text = run.stdout.partition("@@HELP@@")
    assert flags.split(), run.text
    missing = [flag for flag in flags.split() if flag.startswith("--") and flag not in help_text]
    assert not missing, f"%{magic}? does not document {missing}"


def test_gpu_notebook_dry_runs_on_cpu_with_fallback_variable(kernel):
    kernel.execute("import os, ddpnb\nos.environ['DDPNB_CPU_FALLBACK'] = '1'")  # its own imports: it stands alone
    run = kernel.execute("%%ddp --gpus 2\ndef f(rank):\n    return ddpnb.device()\n")
    kernel.execute("del os.environ['DDPNB_CPU_FALLBACK']")
    assert run.results == ["'cpu'"]
    assert "running --gpus 2 as 2 CPU ranks over gloo" in run.stdout.splitlines()[0]  # the run's header


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="without a usable GPU nothing can initialise CUDA, so the check holds whatever ddpnb does",
)
def test_kernel_never_initialises_cuda(kernel):
    run = kernel.execute("print(torch.cuda.is_initialized())")
    assert run.stdout.strip() == "False"


TRAINER_CELLS = [
    """
class Trainer:
    def __init__(self, model, rank, save_every, path):
        self.model = DDP(model)
        self.rank, self.save_every, self.path = rank, save_every, path
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train(self, epochs, batch_size):
        for epoch in range(epochs):
            x, y = torch.randn(batch_size, 4), torch.randn(batch_size, 1)
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.opt.zero_grad(); loss.backward(); self.opt.step()
            print(f"epoch {epoch} loss {loss.item():.3f}")
            if self.rank == 0 and epoch % self.save_every == 0:
                torch.save(self.model.module.state_dict(), self.path)
""",
    """
def main(rank, world_size, epochs, batch_size, path):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    init_process_group(backend="gloo", rank=rank, world_size=world_size)
    Trainer(torch.nn.Linear(4, 1), rank, 1, path).train(epochs, batch_size)
    destroy_process_group()
""",
]


def test_trainer_tutorial_runs_through_spawn_drop_in(kernel, tmp_path):
    kernel.execute(
        "import os\nimport torch\nimport torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.distributed import init_process_group, destroy_process_group"
    )
    for cell in TRAINER_CELLS:
        assert kernel.execute(cell).error is None
    checkpoint = tmp_path / "checkpoint.pt"
    run = kernel.execute(f"ddpnb.spawn(main, args=(2, 3, 8, {str(checkpoint)!r}), nprocs=2)")
    assert run.error is None, run.error
    assert "[rank 1] epoch 2 loss" in run.stdout
    assert checkpoint.exists()


def test_a_flags_quoted_value_arrives_without_its_quotes(kernel):
    """As a shell passes it: IPython's split keeps the quotes around a word, ddpnb takes them off."""
    from ddpnb._magic import DDPMagics, _parse

    parsed = _parse(DDPMagics.ddp, "--engine slurm --srun-args '--mem=8G -c 4' --env \"A=b c\"", "")
    assert (parsed.srun_args, parsed.env) == ("--mem=8G -c 4", ["A=b c"])
    ran = kernel.execute("%%ddp -n 1 --env 'MSG=a b' -o got\ndef f():\n    import os\n    return os.environ['MSG']")
    assert ran.error is None, ran.text
    assert kernel.execute("got").results == ["'a b'"]
