"""What a rank starts: notebook classes and functions reach its processes by name (DataLoader workers under every
start method, `multiprocessing.Pool`, `ProcessPoolExecutor`, torch RPC between ranks), and code that makes a
process group of its own gets exactly that group (docs/behaviour.md, "Processes a rank starts")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

import ddpnb
from tests.conftest import Kernel

NOTEBOOK_DATASET = """
import torch
from torch.utils.data import DataLoader, Dataset

SCALE = 3.0

class Squares(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([float(i * i) * SCALE])

def cube(x):
    return x ** 3
"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(env={"DDPNB_VIEW": "text"})
    k.execute("%load_ext ddpnb")
    k.execute(NOTEBOOK_DATASET)
    yield k
    k.shutdown()


def test_a_notebook_dataset_and_function_reach_dataloader_workers_and_a_pool_in_a_ddp_cell(kernel):
    expected = kernel.execute("sum(float(Squares()[i]) for i in range(8)), [cube(x) for x in range(4)]")
    assert expected.error is None, expected.error
    ran = kernel.execute(
        textwrap.dedent("""
        %%ddp -n 2 -o found
        def train(rank, world_size):
            import multiprocessing
            loader = DataLoader(Squares(), batch_size=2, num_workers=2)  # the start method a script has
            with multiprocessing.Pool(2) as pool:
                return sum(float(batch.sum()) for batch in loader), pool.map(cube, range(4))
    """),
        timeout=180,
    )
    assert ran.error is None, ran.text
    assert repr(eval(kernel.execute("found").results[0])) == expected.results[0]


@pytest.mark.slow
def test_every_start_method_a_rank_can_pick_finds_the_notebooks_definitions(kernel):
    ran = kernel.execute(
        textwrap.dedent("""
        %%ddp -n 2 -o found
        def train(rank, world_size):
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            found = {"default": multiprocessing.get_start_method()}
            for method in ("fork", "spawn", "forkserver"):
                loader = DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context=method)
                with multiprocessing.get_context(method).Pool(1) as pool:
                    found[method] = (sum(float(batch.sum()) for batch in loader), pool.map(cube, [2]))
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as executor:
                found["executor"] = list(executor.map(cube, [3]))
            return found
    """),
        timeout=300,
    )
    assert ran.error is None, ran.text
    found = eval(kernel.execute("found").results[0])
    assert found.pop("default") == multiprocessing_default()
    assert found.pop("executor") == [27]
    assert found == {method: (420.0, [8]) for method in ("fork", "spawn", "forkserver")}
    assert "RuntimeWarning" not in ran.text  # the children's main module runs once, cleanly


def multiprocessing_default() -> str:
    """What a fresh `python train.py` starts children with here."""
    return subprocess.run(
        [sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_a_class_defined_in_a_session_cell_reaches_a_spawned_dataloader_worker(kernel):
    started = kernel.execute("%ddp_start -n 2", timeout=300)
    assert started.error is None, started.text
    try:
        kernel.execute(
            textwrap.dedent("""
            %%ranks
            import torch
            from torch.utils.data import DataLoader, Dataset

            class Ones(Dataset):
                def __len__(self):
                    return 4

                def __getitem__(self, i):
                    return torch.ones(1) * (rank + 1)
        """)
        )
        summed = kernel.execute(
            "%%ranks -o sums\nsum(float(b.sum()) for b in DataLoader(Ones(), batch_size=2, "
            "num_workers=1, multiprocessing_context='spawn'))",
            timeout=180,
        )
        assert summed.error is None, summed.text
        assert eval(kernel.execute("list(sums)").results[0]) == [4.0, 8.0]
    finally:
        kernel.execute("%ddp_stop")


# --- a process group of the code's own --------------------------------------------------------------------------

# The shape of pytorch/examples' distributed/rpc/ddp_rpc (two trainers with a DDP group of their own, a parameter
# server, a master driving them over RPC), on CPU and cut to a few steps: as a script under mp.spawn, and the same
# function under ddpnb.spawn.
HYBRID = """
import random
import sys

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef, TensorPipeRpcBackendOptions
from torch.nn.parallel import DistributedDataParallel

class Hybrid(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table
        self.fc = DistributedDataParallel(torch.nn.Linear(4, 2))

    def forward(self, indices, offsets):
        return self.fc(self.table.forward(indices, offsets))

def trainer_steps(table, steps):
    model = Hybrid(table)
    params = model.table.remote_parameters() + [RRef(p) for p in model.fc.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    for _ in range(steps):
        with dist_autograd.context() as context_id:
            indices = torch.randint(0, 10, (6,))
            loss = model(indices, torch.tensor([0, 3])).sum()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
    return (dist.get_rank(), dist.get_world_size(), steps)

def worker(rank, world_size, port):
    options = TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=options)
        table = RemoteModule("ps", torch.nn.EmbeddingBag, args=(10, 4), kwargs={"mode": "sum"})
        futures = [rpc.rpc_async(f"trainer{t}", trainer_steps, args=(table, 3)) for t in (0, 1)]
        print("TRAINED", sorted(future.wait() for future in futures), flush=True)
    elif rank <= 1:
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port + 1}")
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
    rpc.shutdown()
"""
HYBRID_MAIN = """
if __name__ == "__main__":
    launcher, port = sys.argv[1], int(sys.argv[2])
    if launcher == "ddpnb":
        import ddpnb
        ddpnb.spawn(worker, args=(4, port), nprocs=4, view="text")
    else:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(4, port), nprocs=4)
"""


def _free_ports() -> int:
    """A port whose next one is free too (RPC's rendezvous, then the trainers' group under mp.spawn)."""
    import socket

    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["mp.spawn", "ddpnb"])
def test_trainers_that_make_a_group_of_their_own_train_as_under_mp_spawn(tmp_path, launcher):
    """Ranks 0-1 of 4 call init_process_group(world_size=2): they get that group, as under mp.spawn; never a hang
    (the script's own timeout fails the test where it would)."""
    script = tmp_path / "hybrid.py"
    script.write_text(HYBRID + HYBRID_MAIN)
    done = subprocess.run(
        [sys.executable, str(script), launcher, str(_free_ports())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "TRAINED [(0, 2, 3), (1, 2, 3)]" in output
    if launcher == "ddpnb":
        assert output.count("a group of its own (world size 2") == 2  # said once by each trainer


def test_trainers_that_make_a_group_of_their_own_train_in_a_notebook(kernel):
    defined = kernel.execute(HYBRID)
    assert defined.error is None, defined.text
    ran = kernel.execute(f"ddpnb.spawn(worker, args=(4, {_free_ports()}), nprocs=4)", timeout=120)
    assert ran.error is None, ran.text
    assert "TRAINED [(0, 2, 3), (1, 2, 3)]" in ran.text


def saves_a_checkpoint_in_a_group_of_its_own(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank % 2, world_size=2, init_method=f"tcp://127.0.0.1:1?g={rank // 2}")
    ddpnb.save_checkpoint({"step": 0}, step=0)


def test_a_checkpoint_in_a_group_of_the_codes_own_is_refused_saying_why():
    with pytest.raises(ddpnb.WorkerError) as failed:
        ddpnb.run(saves_a_checkpoint_in_a_group_of_its_own, nprocs=4, view="none")
    assert "needs the run's own process group" in str(failed.value)
    assert "world size 2" in str(failed.value)


def a_daemon_outlives_a_peer_that_ended(rank, world_size, handshake):
    import os
    import time
    from pathlib import Path

    if rank == 1:
        return None  # ends first: what it leaves is ended, and nothing of rank 0's
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(600)
        os._exit(0)
    deadline = time.monotonic() + 60
    while not Path(handshake).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    # the daemon is this rank's child (the rank is a subreaper), still running
    return sum(1 for child in os.listdir("/proc") if child.isdigit() and _parent(child) == os.getpid())


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        return int(fields[1]) if fields[0] != b"Z" else -1
    except OSError:
        return -1


def test_a_ranks_daemon_runs_on_while_the_rank_does_even_after_another_rank_ended(tmp_path):
    handshake = tmp_path / "rank 1 ended"
    run = ddpnb.launch(a_daemon_outlives_a_peer_that_ended, nprocs=2, args=(str(handshake),), view="none")
    deadline = time.monotonic() + 60
    while run.record.ranks[1].exitcode is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # what rank 1's end ends, it has ended by now
    handshake.touch()
    assert run.result(timeout=60) == 1
