"""The ray engine (issue 7): `%%ddp --engine ray` through a real kernel, on a local Ray instance and on a two-node
Ray cluster on this machine, CPU only.

Ray is an optional extra: the tests that need it are skipped, saying so, where `ray[train]` is not installed.
Starting Ray, and a node's host (which imports torch once), costs seconds, and a run that may restart (on Ray
Train: new workers, each importing torch) tens of seconds, so the tests share one local instance, started by
ddpnb itself in the module's kernel, and keep restarting runs few.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import PACKAGE_DIR, RAY_TRAIN_POLL, STARTS_CHILDREN, Execution, Kernel, wait_gone
from tests.ray_cluster import free_port, running, start_node, stop_nodes

HAVE_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.train") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray[train] is not installed (pip install -e '.[ray]')")
RAY_TEST_TIMEOUT = 900  # seconds; a Ray run takes ~30 s on an idle 2-core machine, minutes on a busy one
CELL_TIMEOUT = 600
# every kernel here: text view, Ray quiet; RAY_ADDRESS=local keeps a `ray start` elsewhere on the machine out
KERNEL_ENV = {"DDPNB_VIEW": "text", "RAY_ADDRESS": "local", "RAY_USAGE_STATS_ENABLED": "0", **RAY_TRAIN_POLL}
pytestmark = pytest.mark.ray

TRAIN_CELL = """%%ddp --engine ray -n 2 {flags} -o trained
def train(rank, world_size):
    import sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # seed-style: Ray Train made the group
    torch.manual_seed(rank)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        x = torch.randn(16, 4)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad(); loss.backward(); opt.step()
        ddpnb.log(step=step, loss=loss.item())
    print(f"trained on rank {{rank}}")
    print("the same line on every rank")
    print(f"stderr line from rank {{rank}}", file=sys.stderr)
    os.write(1, f"fd-level write from rank {{rank}}\\n".encode())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    dist.destroy_process_group()
    return {{"state": model.module.state_dict(), "ranks_agree": all(torch.equal(g, flat) for g in gathered)}}
"""

NODE_LINE = re.compile(r"\[rank (\d+)\] \[ddpnb\] on Ray node ([0-9a-f]+) ")
RUN_ACTORS = ("RunActor", "TrainController", "RayTrainWorker", "PlacementGroupCleaner")  # Ray process titles
FORKSERVER = "from multiprocessing.forkserver import main"  # a forked rank's command line is its forkserver's


def run_actors_left(root_pids: list[int], within: float = 30) -> list[str]:
    """The processes of a run still alive under `root_pids` (a kernel that started Ray, or `ray start` nodes)
    after `within` seconds: ranks forked by a node's host (children of a forkserver), and on Ray Train ddpnb's run
    actor, Ray Train's controller, workers and placement group cleaner."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for root in root_pids:
            try:
                processes = psutil.Process(root).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for process in processes:
                try:
                    title = " ".join(process.cmdline())
                    parent = process.parent()
                    forked = FORKSERVER in title and parent is not None and FORKSERVER in " ".join(parent.cmdline())
                    ours = forked or any(name in title for name in RUN_ACTORS)
                    if process.status() != psutil.STATUS_ZOMBIE and ours:
                        left.append(f"{process.pid} {title}")
                except psutil.NoSuchProcess:
                    continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def check_training_run(kernel: Kernel, flags: str = "") -> dict[int, str]:
    """Run TRAIN_CELL; check output, metrics and result as the issue asks; return each rank's node (ID prefix)."""
    run = kernel.execute(TRAIN_CELL.format(flags=flags), timeout=CELL_TIMEOUT)
    assert run.error is None, "\n".join(run.error["traceback"]) + run.stdout + run.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] trained on rank {rank}" in run.stdout
        assert f"[rank {rank}] fd-level write from rank {rank}" in run.stdout
        assert f"[rank {rank}] stderr line from rank {rank}" in run.stderr
        # Ray would have deduplicated it; ddpnb shows every rank's copy, folded into one line when they came together
        assert (
            f"[rank {rank}] the same line on every rank" in run.stdout
            or "[ranks 0,1] the same line on every rank" in run.stdout
        )
    assert "run succeeded" in run.stdout
    check = kernel.execute(
        "record = ddpnb.last_run()\n"
        "print(record.engine, [len(record.metrics('loss', rank)) for rank in (0, 1)], record.outcome.value)\n"
        "print(sorted(trained['state']), trained['ranks_agree'], type(trained['state']['weight']).__name__,\n"
        "      trained['state']['weight'].device)"
    )
    assert check.error is None, check.error
    assert check.stdout.splitlines() == ["ray [5, 5] succeeded", "['bias', 'weight'] True Tensor cpu"]
    return {int(rank): node for rank, node in NODE_LINE.findall(run.stdout)}


# --- no Ray needed ------------------------------------------------------------------------------------------------
def test_importing_ddpnb_never_imports_ray():
    code = "import sys, ddpnb, ddpnb._magic, ddpnb._api; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_engine_ray_without_ray_says_how_to_install(monkeypatch):
    from ddpnb import _api

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name.split(".")[0] == "ray" else real_find_spec(name, *args),
    )
    with pytest.raises(_api.LaunchError, match=re.escape("pip install -e '.[ray]'")):
        _api.LaunchOptions(nprocs=2, engine="ray").check()


def test_address_and_placement_need_the_ray_engine():
    import ddpnb

    with pytest.raises(ddpnb.LaunchError, match="engine='ray'"):
        ddpnb.launch(print, nprocs=2, placement="spread")
    with pytest.raises(ddpnb.LaunchError, match="engine must be one of local, ray.*not 'nosuch'"):
        ddpnb.launch(print, nprocs=2, engine="nosuch")


# --- a two-node cluster, started with `ray start` on this machine (the session's: conftest.py `local_ray`) -----
@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_spread_run_lands_ranks_on_two_nodes_of_a_cluster(ray_start_cluster):
    address, node_pids = ray_start_cluster.address, ray_start_cluster.node_pids
    kernel = Kernel(env={**KERNEL_ENV, **NO_AUTH})
    try:
        kernel.execute("%load_ext ddpnb")
        joined = kernel.execute(  # the second node may still be joining: wait for it, as a user would
            "import time, ray\n"
            f"ray.init(address={address!r}, log_to_driver=False)\n"
            "deadline = time.monotonic() + 300\n"
            "while len([n for n in ray.nodes() if n['Alive']]) < 2 and time.monotonic() < deadline:\n"
            "    time.sleep(0.5)\n"
            "print(*sorted(n['NodeID'] for n in ray.nodes() if n['Alive']))",
            timeout=CELL_TIMEOUT,
        )
        alive = joined.stdout.split()
        assert len(alive) == 2, joined.stdout + joined.stderr
        kernel.execute("import os\nimport torch\nimport ddpnb")
        nodes = check_training_run(kernel, flags=f"--address {address} --placement spread")
        assert sorted(nodes) == [0, 1]
        assert nodes[0] != nodes[1], f"both ranks on one node: {nodes}"
        assert all(any(node_id.startswith(prefix) for node_id in alive) for prefix in nodes.values())
        pids = [int(p) for p in kernel.execute("print(*[r.pid for r in ddpnb.last_run().ranks])").stdout.split()]
        assert wait_gone(pids, within=30) == []
        assert run_actors_left(node_pids) == []
        kernel.execute("ray.shutdown()")
    finally:
        kernel.shutdown()


# --- a cluster found without an address: $RAY_ADDRESS, or a `ray start --head` on this machine ---------------------
WHERE_CELL = """%%ddp --engine ray -n 1
def where():
    import ray
    return ray.get_runtime_context().gcs_address
"""
RAY_ADDRESS_FILE = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"  # where `ray start` says it runs
# Ray turns token authentication on by itself where ~/.ray/auth_token exists; these clusters take none
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


@contextmanager
def head_node(log_dir: Path) -> Iterator[tuple[str, psutil.Process]]:
    """`ray start --head` on loopback, in Ray's default temp directory, so that it writes the address file
    `ray.init()` (and ddpnb) discover it by. It runs until stopped (--block): by signalling what it started, not
    `ray stop`, which would stop every Ray on the machine; the address file goes with it."""
    address = f"127.0.0.1:{free_port()}"
    nodes: list[psutil.Process] = []
    try:
        start_node(
            nodes,
            [
                "--head",
                f"--port={address.split(':')[1]}",
                "--block",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=2",
                f"--object-store-memory={100 * 2**20}",
                "--disable-usage-stats",
                "--include-log-monitor=false",
                "--include-dashboard=false",
            ],
            log_dir / "head",
            env={**os.environ, **NO_AUTH, "RAY_ADDRESS": "", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
        )
        yield address, nodes[0]
    finally:
        stop_nodes(nodes)
        if RAY_ADDRESS_FILE.exists() and same_cluster(RAY_ADDRESS_FILE.read_text().strip(), address):
            RAY_ADDRESS_FILE.unlink()


def same_cluster(found: str, address: str) -> bool:
    """Ray names a loopback head by this machine's own IP: the (unique, just bound) port tells the cluster."""
    return found.rpartition(":")[2] == address.rpartition(":")[2]


def run_where(env: dict[str, str]) -> tuple[Execution, str]:
    """WHERE_CELL in a fresh kernel that never calls `ray.init` itself; the run's output and the cluster the kernel
    ended up connected to. The kernel is shut down afterwards (as a user's kernel would end)."""
    kernel = Kernel(env=env)
    try:
        kernel.execute("%load_ext ddpnb")
        run = kernel.execute(WHERE_CELL, timeout=CELL_TIMEOUT)
        assert run.error is None, "\n".join(run.error["traceback"]) + run.stdout + run.stderr
        connected = kernel.execute("import ray\nprint(ray.get_runtime_context().gcs_address)").stdout.strip()
        return run, connected
    finally:
        kernel.shutdown()


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_runs_find_the_cluster_through_ray_address_and_ray_start_and_never_stop_it(tmp_path):
    with head_node(tmp_path) as (address, head):
        through_env = {**KERNEL_ENV, **NO_AUTH, "RAY_ADDRESS": address}
        run, connected = run_where(through_env)
        assert "[ddpnb] connected to Ray: 1 node(s)" in run.stdout, run.stdout
        assert same_cluster(connected, address) and run.results == [repr(connected)]  # the rank ran there too
        assert running(head), "the kernel that connected to the cluster stopped it"

        through_ray_start = {key: value for key, value in {**KERNEL_ENV, **NO_AUTH}.items() if key != "RAY_ADDRESS"}
        assert same_cluster(RAY_ADDRESS_FILE.read_text().strip(), address)  # all the kernel has to find it by
        run, connected = run_where(through_ray_start)
        assert same_cluster(connected, address) and run.results == [repr(connected)]  # the first kernel left it up
        assert running(head), "the kernel that connected to the cluster stopped it"


# --- a local Ray instance, started by ddpnb in the kernel and shared by the tests below --------------------------
@pytest.fixture(scope="module")
def ray_kernel():
    if not HAVE_RAY:
        pytest.skip("ray[train] is not installed (pip install -e '.[ray]')")
    helpers = Path(tempfile.mkdtemp(prefix="ddpnb-test-modules-"))  # on the kernel's path, and so on Ray's workers'
    (helpers / f"{HOST_KILLER}.py").write_text(HOST_KILLER_SOURCE)
    kernel = Kernel(
        env={**KERNEL_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(helpers), os.environ.get("PYTHONPATH")]))}
    )
    kernel.execute("%load_ext ddpnb")
    kernel.execute("import os, time\nimport torch\nimport torch.distributed as dist\nimport ddpnb, ray")
    yield kernel
    ray_processes = [
        int(pid)
        for pid in kernel.execute(
            "import psutil\nprint(*[p.pid for p in psutil.Process().children(recursive=True)])"
        ).stdout.split()
    ]
    kernel.execute("import ray\nray.shutdown()", timeout=CELL_TIMEOUT)
    kernel.shutdown()
    shutil.rmtree(helpers)
    assert wait_gone(ray_processes, within=30) == []


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_notebook_trains_ddp_on_a_local_ray_instance(ray_kernel):
    check_training_run(ray_kernel)
    assert run_actors_left([ray_kernel.pid]) == []
    started = ray_kernel.execute("import ray\nprint(ray.is_initialized(), ray.cluster_resources().get('CPU'))")
    assert started.stdout.split() == ["True", "2.0"]  # ddpnb started it with what the run needed, and kept it


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_failing_rank_raises_worker_error_and_leaves_no_ray_worker(ray_kernel):
    run = ray_kernel.execute(
        """%%ddp --engine ray -n 2
def fails(rank, world_size):
    print(f"rank {rank} starts")
    if rank == 1:
        raise ValueError("bad batch on purpose")
    dist.barrier()
""",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is not None and run.error["ename"] == "WorkerError", run.stdout + run.stderr
    shown = "\n".join(run.error["traceback"])
    assert "rank 1 of 2 failed first: ValueError: bad batch on purpose" in shown
    assert 'raise ValueError("bad batch on purpose")' in shown  # the user's own line, from the cell
    assert PACKAGE_DIR not in shown
    assert "[rank 1] rank 1 starts" in run.stdout
    pids = [int(p) for p in ray_kernel.execute("print(*[r.pid for r in ddpnb.last_run().ranks])").stdout.split()]
    assert len(pids) == 2 and wait_gone(pids, within=30) == []
    assert run_actors_left([ray_kernel.pid]) == []


def cell_value(kernel: Kernel, cell: str, name: str) -> Any:
    """Run a `%%ddp ... -o name` cell; the value it stored, as the kernel prints it."""
    run = kernel.execute(cell, timeout=CELL_TIMEOUT)
    assert run.error is None, "\n".join(run.error["traceback"]) + run.stdout + run.stderr
    return ast.literal_eval(kernel.execute(f"print({name})").stdout.strip())


FRESH_CELL = """%%ddp --engine ray -n 2 -o seen
def marks(rank, world_size):
    import json
    fresh = not hasattr(json, "ddpnb_test_mark")  # a module-level variable an earlier run's rank set
    json.ddpnb_test_mark = rank
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (os.getpid(), fresh))
    return gathered
"""


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_each_later_ray_launch_gets_new_rank_processes_with_nothing_left_from_the_last(ray_kernel):
    """Issue 31: the warm hosts fork new ranks at every launch: new PIDs on every rank, and a module-level
    variable one run set is absent in the next."""
    seen = [cell_value(ray_kernel, FRESH_CELL, "seen") for _ in range(3)]
    assert all(fresh for ranks in seen for _, fresh in ranks), seen
    pids = [pid for ranks in seen for pid, _ in ranks]
    assert len(set(pids)) == len(pids) == 6, seen


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_a_module_preloaded_in_the_kernel_is_in_every_ray_rank_from_the_next_launch(ray_kernel):
    """`ddpnb.preload` applies to the hosts' forkservers too: a later Ray launch's ranks start with the module."""
    cell = """%%ddp --engine ray -n 2 -o had
def had_it(rank, world_size):
    import sys
    gathered = [None] * world_size
    dist.all_gather_object(gathered, "colorsys" in sys.modules)  # before anything here imports it
    return gathered
"""
    assert cell_value(ray_kernel, cell, "had") == [False, False]
    ray_kernel.execute("ddpnb.preload('colorsys')", timeout=CELL_TIMEOUT)
    assert cell_value(ray_kernel, cell, "had") == [True, True]


KILLED_CELL = """%%ddp --engine ray -n 2
def dies(rank):
    import signal
    if rank == 0:
        open(os.path.join(handshake, "rank 0 started"), "w").close()
    while rank == 1 and not os.path.exists(os.path.join(handshake, "rank 0 started")):
        time.sleep(0.01)
    if rank == 1:
        os.kill({victim}, signal.SIGKILL)
    time.sleep(60)  # until rank 1's act stops the run
"""
# the host that forked this rank: its forkserver's parent
HOST_PID = 'int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])'


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_a_killed_ray_rank_is_named_as_the_first_failure_and_nothing_is_left(ray_kernel):
    ray_kernel.execute("import tempfile\nhandshake = tempfile.mkdtemp()")
    run = ray_kernel.execute(KILLED_CELL.format(victim="os.getpid()"), timeout=CELL_TIMEOUT)
    assert run.error is not None and run.error["ename"] == "WorkerError", run.stdout + run.stderr
    shown = "\n".join(run.error["traceback"])
    assert "rank 1 of 2 failed first: killed by SIGKILL" in shown, shown
    pids = [int(p) for p in ray_kernel.execute("print(*[r.pid for r in ddpnb.last_run().ranks])").stdout.split()]
    assert len(pids) == 2 and wait_gone(pids, within=30) == []
    assert run_actors_left([ray_kernel.pid]) == []
    assert cpus_released(ray_kernel)


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
@pytest.mark.parametrize("how", ["succeeds", "raises"])
def test_what_a_ray_rank_started_in_a_session_of_its_own_is_gone_after_the_run(ray_kernel, tmp_path, how):
    where = tmp_path / "children"
    where.mkdir()
    out = ray_kernel.execute(
        STARTS_CHILDREN
        + f"""
run = ddpnb.launch(starts_children, engine="ray", nprocs=2, view="none", args=({how!r}, {str(where)!r}))
run.wait()
print("outcome:", run.outcome.value)
""",
        timeout=CELL_TIMEOUT,
    )
    assert out.error is None, out.text
    outcome = {"succeeds": "succeeded", "raises": "failed"}[how]
    assert f"outcome: {outcome}" in out.stdout, out.text
    children = [int(pid) for path in where.iterdir() for pid in path.read_text().split()]
    assert len(children) == 4
    assert wait_gone(children, within=10) == [], "what a rank started outlived the run"


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_a_lost_host_fails_its_ranks_with_rays_own_line_and_the_next_launch_gets_a_new_one(ray_kernel):
    """A node's host killed (as when its node is lost): its ranks go with it and fail, saying so; Ray's driver
    prints the raylet's "A worker died or was killed ..." into the running cell, coloured as `(raylet)`, which ddpnb
    shows as Ray's own line, on stderr, with no ANSI codes; the next launch starts a new host."""
    ray_kernel.execute("import tempfile\nhandshake = tempfile.mkdtemp()")
    died = ray_kernel.execute(KILLED_CELL.format(victim=HOST_PID), timeout=CELL_TIMEOUT)
    assert died.error is not None and died.error["ename"] == "WorkerError", died.text
    assert re.search(r"rank \d of 2 failed first: its Ray node \S+ was lost", "\n".join(died.error["traceback"]))
    pids = [int(p) for p in ray_kernel.execute("print(*[r.pid for r in ddpnb.last_run().ranks])").stdout.split()]
    assert len(pids) == 2 and wait_gone(pids, within=30) == []
    shown = died.stdout + died.stderr
    later_stderr = ""
    deadline = time.monotonic() + 60  # the raylet's line may come after the cell ended: it lands in a later one
    while "A worker died or was killed" not in shown and time.monotonic() < deadline:
        later = ray_kernel.execute("time.sleep(0.5)")
        shown, later_stderr = shown + later.stdout + later.stderr, later_stderr + later.stderr
    assert "\x1b[" not in shown
    assert "(raylet)" not in shown, shown
    ray_lines = [line for line in shown.splitlines() if "A worker died or was killed" in line]
    assert ray_lines and all(line.startswith("[ray] raylet: A worker died") for line in ray_lines), shown
    assert all(line in died.stderr + later_stderr for line in ray_lines)
    assert len(cell_value(ray_kernel, FRESH_CELL, "seen")) == 2
    assert run_actors_left([ray_kernel.pid]) == []


# a module that kills the Ray host whose new forkserver imports it (`ddpnb.preload`, during the host's `start`),
# once: after `ARMED` is made; where the kernel imports it, or its forkserver, it does nothing
HOST_KILLER = "ddpnb_test_host_killer"
HOST_KILLER_SOURCE = f"""import os, signal, tempfile
ARMED = os.path.join(tempfile.gettempdir(), "{HOST_KILLER}-armed")
with open(f"/proc/{{os.getppid()}}/cmdline", "rb") as cmdline:
    in_a_ray_host = b"ray::Host" in cmdline.read()
if in_a_ray_host and os.path.exists(ARMED):
    os.unlink(ARMED)
    os.kill(os.getppid(), signal.SIGKILL)
"""


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_a_host_lost_while_it_forks_the_ranks_fails_them_saying_so_and_the_next_launch_gets_a_new_one(ray_kernel):
    """The host dies inside its `start` call, before it answers (as when a rank kills it the moment it is forked,
    or the node is lost then): that node's ranks fail as lost with their node, as when the host dies later, not as
    a Ray failure of the whole run."""
    ray_kernel.execute(f"ddpnb.preload({HOST_KILLER!r})", timeout=CELL_TIMEOUT)
    armed = Path(tempfile.gettempdir()) / f"{HOST_KILLER}-armed"
    armed.touch()
    try:
        died = ray_kernel.execute(FRESH_CELL, timeout=CELL_TIMEOUT)
    finally:
        armed.unlink(missing_ok=True)
    assert died.error is not None and died.error["ename"] == "WorkerError", died.text
    shown = "\n".join(died.error["traceback"])
    assert re.search(r"rank 0 of 2 failed first: its Ray node \S+ was lost \(ActorDiedError\)", shown), shown
    assert "lost the Ray run" not in shown, shown
    assert len(cell_value(ray_kernel, FRESH_CELL, "seen")) == 2
    assert run_actors_left([ray_kernel.pid]) == []
    assert cpus_released(ray_kernel)


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_a_host_that_died_between_runs_is_replaced_at_the_next_launch(ray_kernel):
    assert len(cell_value(ray_kernel, FRESH_CELL, "seen")) == 2  # this node's host is up
    killed = ray_kernel.execute(
        "import psutil, signal\n"
        "hosts = [p for p in psutil.Process().children(recursive=True) if 'ray::Host' in ' '.join(p.cmdline())]\n"
        "for p in hosts: p.send_signal(signal.SIGKILL)\n"
        "print(len(psutil.wait_procs(hosts, timeout=30)[0]))"
    )
    assert killed.stdout.strip() == "1", killed.text
    assert len(cell_value(ray_kernel, FRESH_CELL, "seen")) == 2


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_rank_waiting_for_a_rank_that_returned_fails_on_ray_too(ray_kernel):
    """Ray Train's workers outlive their rank, so each rank takes its group down when its function returns: a
    peer left in a collective it never joins fails (gloo) instead of waiting for the group's timeout."""
    run = ray_kernel.execute(
        """%%ddp --engine ray -n 2 --timeout 300
def one_collective_too_many(rank, world_size):
    if rank == 1:
        dist.all_reduce(torch.ones(1))  # rank 0 has returned and will never join this one
    return rank
""",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is not None and run.error["ename"] == "WorkerError", run.stdout + run.stderr
    assert "rank 1 of 2 failed first" in "\n".join(run.error["traceback"])
    outcome = ray_kernel.execute("print(ddpnb.last_run().outcome.value)").stdout.strip()
    assert outcome == "failed"  # not "timed out": rank 0 let go of its group
    assert run_actors_left([ray_kernel.pid]) == []


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_timeout_stops_a_hung_ray_run_and_shows_where_each_rank_was(ray_kernel):
    # the timeout is set once both ranks run, so Ray's start-up time (seconds to minutes) cannot eat it up
    run = ray_kernel.execute(
        """
def hangs(rank):
    print(f"rank {rank} waits", flush=True)
    time.sleep(600)

handle = ddpnb.launch(hangs, engine="ray", nprocs=2, view="none")
deadline = time.monotonic() + 500
while not all(r.state.value == "running" for r in handle.record.ranks) and time.monotonic() < deadline:
    time.sleep(0.2)
handle.timeout = handle.record.duration + 2
record = handle.wait()
print(record.outcome.value)
print(all("in hangs" in r.stack for r in record.ranks))
print(*[r.pid for r in record.ranks])
""",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is None, run.error
    outcome, stacks, pids = run.stdout.splitlines()[-3:]
    assert (outcome, stacks) == ("timed out", "True"), run.stdout
    assert wait_gone([int(p) for p in pids.split()], within=30) == []
    assert cpus_released(ray_kernel)
    assert run_actors_left([ray_kernel.pid]) == []


def cpus_released(kernel: Kernel) -> bool:
    """Whether the local instance's 2 CPUs are free again: a stopped run must release its placement group, or
    every later run waits for CPUs forever."""
    return (
        kernel.execute(
            "deadline = time.monotonic() + 60\n"
            "while ray.available_resources().get('CPU', 0) < 2 and time.monotonic() < deadline:\n"
            "    time.sleep(0.5)\n"
            "print(ray.available_resources().get('CPU', 0))"
        ).stdout.strip()
        == "2.0"
    )


def execute_and_interrupt(kernel: Kernel, code: str, interrupt_after: list[str]) -> Execution:
    """Run a cell; send the kernel an interrupt (Ctrl-C, the notebook's stop button) once its output shows every
    string in `interrupt_after`."""
    msg_id = kernel.client.execute(code)
    result, interrupted = Execution(), False
    deadline = time.monotonic() + CELL_TIMEOUT
    while True:
        msg = kernel.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            setattr(result, content["name"], getattr(result, content["name"]) + content["text"])
            if not interrupted and all(text in result.stdout for text in interrupt_after):
                kernel.manager.interrupt_kernel()
                interrupted = True
        elif kind == "error":
            result.error = content
        elif kind == "status" and content["execution_state"] == "idle":
            return result


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_interrupt_stops_a_ray_run_like_a_local_one(ray_kernel):
    run = execute_and_interrupt(
        ray_kernel,
        """%%ddp --engine ray -n 2
def hangs(rank):
    print(f"rank {rank} waits", flush=True)
    time.sleep(600)
""",
        interrupt_after=["[rank 0] rank 0 waits", "[rank 1] rank 1 waits"],
    )
    assert run.error is not None and run.error["ename"] == "RunInterrupted", run.stdout + run.stderr
    after = ray_kernel.execute("record = ddpnb.last_run()\nprint(record.outcome.value, *[r.pid for r in record.ranks])")
    outcome, *pids = after.stdout.split()
    assert outcome == "interrupted"
    assert wait_gone([int(pid) for pid in pids], within=30) == []
    assert cpus_released(ray_kernel)
    assert run_actors_left([ray_kernel.pid]) == []


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_a_running_ray_run_keeps_its_run_directory_while_newer_local_runs_start(ray_kernel, tmp_path):
    """Retention deletes the directories of ended runs only; a Ray run holds its directory's lock like a local one
    (it did not: 49 newer runs deleted a running Ray run's logs)."""
    release = tmp_path / "release"
    run = ray_kernel.execute(
        f"""
def waits(rank):
    print(f"rank {{rank}} waits", flush=True)
    while not os.path.exists({str(release)!r}):
        time.sleep(0.2)
    return rank

handle = ddpnb.launch(waits, engine="ray", nprocs=2, view="none")
deadline = time.monotonic() + 500
while not all(r.state.value == "running" for r in handle.record.ranks) and time.monotonic() < deadline:
    time.sleep(0.2)
for _ in range(50):
    ddpnb.run(lambda: 0, nprocs=1, view="none")
print(handle.done, handle.record.run_dir.is_dir(), sorted(p.name for p in handle.record.run_dir.iterdir()))
""",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is None, run.stdout + run.stderr
    done, exists, files = run.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (done, exists) == ("False", "True"), run.stdout
    assert "rank0.log" in files and "rank1.log" in files
    release.touch()
    ended = ray_kernel.execute("print(handle.result(), handle.record.run_dir.is_dir())", timeout=CELL_TIMEOUT)
    assert ended.stdout.split() == ["0", "True"], ended.stdout + ended.stderr
    assert run_actors_left([ray_kernel.pid]) == []


@needs_ray
def test_gpus_all_is_refused_on_ray_with_what_to_pass_instead(ray_kernel):
    run = ray_kernel.execute("%%ddp --engine ray --gpus all\ndef train(rank):\n    return rank\n")
    assert "UsageError" in run.stderr and "--engine ray takes a number of GPUs (--gpus N), not 'all'" in run.stderr


ENV_AND_VERSIONS_CELL = """%%ddp --engine ray -n 2 --env DDPNB_TEST_FROM_ENV=travelled
def environment(rank, world_size):
    mine = {key: os.environ.get(key) for key in ("DDPNB_TEST_FROM_ENV", "DDPNB_TEST_KERNEL_ONLY", "DDPNB_WORKER")}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return gathered
"""


@pytest.fixture(scope="module")
def env_and_versions_run(ray_kernel, tmp_path_factory) -> Execution:
    """One Ray run for two promises: `--env` values reach every rank (what the kernel sets once the node runs does
    not), and a rank whose versions differ from the kernel's says so. The kernel's ddpnb version differs for real:
    a `ddpnb-0.0.0.dist-info` ahead on the kernel's path is what `importlib.metadata` finds there, not on the
    node."""
    fake = tmp_path_factory.mktemp("old-ddpnb")
    (fake / "ddpnb-0.0.0.dist-info").mkdir()
    (fake / "ddpnb-0.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: ddpnb\nVersion: 0.0.0\n")
    # Ray up first (as the run would connect): a local node started after the variable would inherit it
    ray_kernel.execute(
        "from ddpnb.engines.ray import cluster\nprint(cluster.connect(None, cpus=2, gpus=0))", timeout=CELL_TIMEOUT
    )
    ray_kernel.execute(f"import sys\nsys.path.insert(0, {str(fake)!r})\nos.environ['DDPNB_TEST_KERNEL_ONLY'] = 'x'")
    try:
        return ray_kernel.execute(ENV_AND_VERSIONS_CELL, timeout=CELL_TIMEOUT)
    finally:
        ray_kernel.execute(f"sys.path.remove({str(fake)!r})\ndel os.environ['DDPNB_TEST_KERNEL_ONLY']")


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_env_values_reach_every_ray_rank_but_the_kernels_environment_does_not(env_and_versions_run):
    run = env_and_versions_run
    assert run.error is None, "\n".join(run.error["traceback"]) + run.stdout + run.stderr
    mine = {"DDPNB_TEST_FROM_ENV": "travelled", "DDPNB_TEST_KERNEL_ONLY": None, "DDPNB_WORKER": "1"}
    assert len(run.results) == 1 and ast.literal_eval(run.results[0]) == [mine, mine]


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_a_rank_whose_versions_differ_from_the_kernels_prints_a_warning_line(env_and_versions_run):
    import importlib.metadata

    here = importlib.metadata.version("ddpnb")
    warning = (
        f"[ddpnb] this node's versions differ from the kernel's: ddpnb {here} here, 0.0.0 in the kernel. "
        "Functions and results travel pickled between them"
    )
    said = env_and_versions_run.stderr
    # every rank's line, folded into one where they came together
    assert f"[ranks 0,1] {warning}" in said or all(f"[rank {rank}] {warning}" in said for rank in (0, 1)), said


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_a_session_on_ray_keeps_state_across_cells_and_survives_an_error(ray_kernel):
    started = ray_kernel.execute("%ddp_start --engine ray -n 2", timeout=CELL_TIMEOUT)
    assert started.error is None and "session of 2 ranks (ray, gloo" in started.stdout, started.text
    try:
        defined = ray_kernel.execute(
            "%%ranks\nimport torch, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)"
            "\nprint('defined on', rank)\nrank",
            timeout=CELL_TIMEOUT,
        )
        assert defined.results == ["[rank 0] 0\n[rank 1] 1"], defined.text
        assert "[rank 0] defined on 0" in defined.stdout and "[rank 1] defined on 1" in defined.stdout
        reduced = ray_kernel.execute("%%ranks\ndist.all_reduce(t)\nt.item()", timeout=CELL_TIMEOUT)
        assert reduced.results == ["[rank 0] 3.0\n[rank 1] 3.0"], reduced.text
        failed = ray_kernel.execute(
            "%%ranks\nif rank == 1:\n    raise ValueError('bad on purpose')\n'fine'", timeout=CELL_TIMEOUT
        )
        assert failed.error is not None and failed.error["ename"] == "SessionError", failed.text
        assert re.search(r"Cell In\[\d+\], line 3", "\n".join(failed.error["traceback"]))
        pulled = ray_kernel.execute(
            "s = ddpnb._session.current_session()\ns.push(v=5)\nprint(s.pull('v'), s.pull('t'))", timeout=CELL_TIMEOUT
        )
        assert pulled.stdout.strip() == "[5, 5] [tensor([3.]), tensor([3.])]", pulled.text
    finally:
        stopped = ray_kernel.execute("%ddp_stop", timeout=CELL_TIMEOUT)
    assert stopped.error is None, stopped.text


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_exhausted_restarts_on_ray_make_exactly_the_budgeted_attempts_and_the_record_says_so(ray_kernel, tmp_path):
    """The run's policy owns restarts on Ray too: Ray Train is given its budget at start and restarts the workers
    within one fit (one connection), the ranks' own markers show exactly three attempts, and the record keeps two
    and ends on the third, failed, as a local run's does (`test_restarts`)."""
    run = ray_kernel.execute(
        f"""%%ddp --engine ray -n 2 --max-restarts 2
def fails_in_every_attempt(rank):
    import pathlib
    pathlib.Path({str(tmp_path)!r}, f"attempt{{ddpnb.attempt()}}-rank{{rank}}").touch()
    if rank == 1:
        deadline = time.monotonic() + 120
        while not pathlib.Path({str(tmp_path)!r}, f"attempt{{ddpnb.attempt()}}-rank0").exists() \\
                and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError(f"fails in attempt {{ddpnb.attempt()}}")
""",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is not None and run.error["ename"] == "WorkerError", run.text
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        f"attempt{a}-rank{r}" for a in range(3) for r in range(2)
    ]
    record = ray_kernel.execute(
        "record = ddpnb.last_run()\n"
        "print(record.max_restarts, record.attempt, [a.number for a in record.attempts], record.outcome.value)\n"
        "print([a.first_failure.summary for a in record.attempts], record.first_failure.summary)"
    )
    assert record.error is None, record.error
    numbers, failures = record.stdout.splitlines()
    assert numbers == "2 2 [0, 1] failed", record.stdout
    assert failures == (
        "['RuntimeError: fails in attempt 0', 'RuntimeError: fails in attempt 1'] RuntimeError: fails in attempt 2"
    ), record.stdout
    assert "(restart 1 of 2)" in run.stdout and "(restart 2 of 2)" in run.stdout and "restart 3" not in run.stdout
    assert run.stdout.count(" node(s), ") == 1, run.stdout  # Ray Train restarted them: one engine, one connection
    assert run_actors_left([ray_kernel.pid]) == []


def test_a_big_closure_tensor_reaches_every_ray_rank_through_the_object_store_once(ray_kernel):
    """Issue 16 on Ray: a 64 MB tensor the function closes over is put into Ray's object store once, not pickled
    into the function each rank receives; every rank reads the right values, and a rank's in-place write stays
    its own."""
    run = ray_kernel.execute(
        """
big = torch.arange(16 << 20, dtype=torch.float32)  # 64 MB
expected = big.double().sum().item()

def reads(rank, world_size):
    total = big.double().sum().item()  # exact: float32 sums differ with the thread count
    if rank == 1:
        big.add_(1)
    dist.barrier()
    seen = [None] * world_size
    dist.all_gather_object(seen, (total == expected, big[0].item()))
    return seen

handle = ddpnb.launch(reads, engine="ray", nprocs=2, view="none")
print(handle.result())
print(handle.record.data.written, handle.record.data.blocks, len(handle.spec.fn_payload) < 1_000_000, big[0].item())
""",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is None, "\n".join(run.error["traceback"]) + run.stdout + run.stderr
    seen, sent = run.stdout.strip().splitlines()[-2:]
    assert seen == "[(True, 0.0), (True, 1.0)]", run.stdout
    assert sent.split() == [str(64 << 20), "1", "True", "0.0"], run.stdout  # put once; the pickle stays small
    assert run_actors_left([ray_kernel.pid]) == []


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_a_breakpoint_on_a_ray_rank_prompts_in_the_cell_and_the_run_goes_on(ray_kernel):
    """The debugger in the cell (issue 29) on Ray: rank 1 stops at `breakpoint()` on a rank its node's host forked;
    the prompt comes to the cell through the kernel's stdin channel and the answers go back through the host."""
    from tests.test_debugger import answers

    run = ray_kernel.execute(
        """%%ddp --engine ray -n 2 -o total
def train(rank, world_size):
    value = torch.ones(1) * (rank + 1)
    if rank == 1:
        breakpoint()
    dist.all_reduce(value)
    return value.item()
""",
        timeout=CELL_TIMEOUT,
        answer=answers("p rank * 100", "c"),
    )
    assert run.error is None, run.text + str(run.error)
    assert run.prompts[:2] == ["(rank 1) (Pdb) ", "(rank 1) (Pdb) "], run.prompts
    assert re.search(r"^100$", run.stdout, re.MULTILINE), run.stdout
    assert ray_kernel.execute("print(total)").stdout.strip() == "3.0"


@needs_ray
@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT)
def test_profile_traces_come_back_from_ray_ranks(ray_kernel):
    """--profile on Ray: the traces travel back as messages through the run's channel (no shared run directory)."""
    run = ray_kernel.execute(
        "%%ddp --engine ray -n 2 --profile 2-3\n"
        "def profiled(rank):\n"
        "    for step in range(5):\n"
        "        dist.all_reduce(torch.ones(1000))\n"
        "        ddpnb.log(step=step)\n",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is None and "[ddpnb] profile of steps 2-3:" in run.stdout, run.text
    found = ray_kernel.execute(
        "import gzip, json\nprofile = ddpnb.last_run().profile\n"
        "events = json.load(gzip.open(profile.trace))['traceEvents']\n"
        "print(sorted(e['args']['name'].split(' (')[0] for e in events "
        "if e['name'] == 'process_name'), [r.spans for r in profile.ranks])"
    )
    assert found.stdout.strip() == "['rank 0', 'rank 1'] [2, 2]", found.text
