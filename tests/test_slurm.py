"""The slurm engine (issue 27) inside an allocation, against a real two-node Slurm on this machine.

The session's Debian slurm-wlm (munged, slurmctld, slurmd n1 and n2: `tests/slurm_cluster.py`, conftest's `cluster`)
holds one allocation, `salloc --no-shell -N 2 -n 4`; the module gives a real Jupyter kernel what a kernel started inside
`salloc` has: SLURM_JOB_ID (and SLURM_CONF, this cluster's). The kernel's `%%ddp --engine slurm` cells then run
their ranks as srun steps over both nodes. The tests skip, saying why, only where the packages cannot be installed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from ddpnb.engines.slurm import allocation
from tests import slurm_cluster
from tests.conftest import PACKAGE_DIR, STARTS_CHILDREN, Kernel, wait_gone
from tests.test_faults import Cell
from tests.test_notebooks import run_notebook

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HOST_MODULE = "ddpnb.engines.slurm.host"
FORKSERVER = "multiprocessing.forkserver"
CELL_TIMEOUT = 300
KEEP_JOB_HERE = 4  # seconds: shorter than the default's 10, longer than a session's %ddp_restart on a loaded box


@pytest.fixture(scope="module")
def slurm_kernel(cluster):
    # a job ddpnb asked for is kept KEEP_JOB_HERE s for the next launch (10 s by default), then given back: the
    # tests outside an allocation wait for that give-back
    env = {"DDPNB_VIEW": "text", "DDPNB_SLURM_KEEP_JOB": str(KEEP_JOB_HERE)}
    kernel = Kernel(env={**env, **cluster.env, "SLURM_JOB_ID": cluster.job})
    kernel.execute("%load_ext ddpnb\nimport ddpnb, os, time")
    yield kernel
    kernel.shutdown()


def ranks_left(within: float = 10.0) -> list[str]:
    """The slurm engine's processes still alive on this machine (both nodes are this host) after `within` seconds:
    a node's host, its forkserver and the ranks forked from it (which carry the step's SLURM_STEP_ID; the
    kernel's own forkserver, for the local engine, does not)."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for process in psutil.process_iter(["cmdline", "status"]):
            cmdline = " ".join(process.info["cmdline"] or [])
            try:
                ours = HOST_MODULE in cmdline or (FORKSERVER in cmdline and "SLURM_STEP_ID" in process.environ())
            except psutil.Error:
                continue
            if ours and process.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(f"{process.pid} {cmdline}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def steps_left(cluster, within: float = 10.0) -> list[str]:
    deadline = time.monotonic() + within
    while (steps := cluster.steps(cluster.job)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return steps


def test_a_function_runs_on_both_nodes_with_tagged_output_and_rank_0s_value(slurm_kernel, cluster):
    run = slurm_kernel.execute(
        """%%ddp --engine slurm -n 4 --nodes 2 -o where
def where(rank):
    import ctypes, sys
    print(f"rank {rank} on {os.environ['SLURMD_NODENAME']}")
    print(f"stderr of rank {rank}", file=sys.stderr)
    ctypes.CDLL(None).puts(f"C-level line of rank {rank}".encode())  # C's stdio, not Python's
    ctypes.CDLL(None).fflush(None)
    return rank, os.environ["SLURMD_NODENAME"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]
""",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is None, "\n".join(run.error["traceback"]) + run.stdout + run.stderr
    nodes = slurm_kernel.execute("print(*[r.node for r in ddpnb.last_run().ranks]); print(where)").stdout.split("\n")
    placed = nodes[0].split()
    assert sorted(set(placed)) == ["n1", "n2"]  # ranks on both nodes
    for rank, node in enumerate(placed):
        assert f"[rank {rank}] rank {rank} on {node}" in run.stdout  # the rank's line, tagged with its rank
        assert f"[rank {rank}] C-level line of rank {rank}" in run.stdout
        assert f"[rank {rank}] stderr of rank {rank}" in run.stderr
    assert nodes[1] == f"(0, '{placed[0]}', '0', '4')"  # rank 0's value, torchrun's environment
    assert "run succeeded" in run.stdout
    assert ranks_left() == [] and steps_left(cluster) == []


TRAIN = """%%ddp --engine {engine} -n 4 -o trained_{engine}
def train(rank, world_size):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")  # torchrun-style code: the group is ready, the call is kept
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)
    for step in range(10):
        x = torch.randn(32, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad(); loss.backward(); opt.step()
        ddpnb.log(step=step, loss=loss.item())
    return model.module.state_dict()
"""


def test_ddp_training_on_slurm_ends_with_the_local_engines_weights(slurm_kernel):
    for engine in ("slurm", "local"):
        run = slurm_kernel.execute(TRAIN.format(engine=engine), timeout=CELL_TIMEOUT)
        assert run.error is None, "\n".join(run.error["traceback"]) + run.stdout + run.stderr
    check = slurm_kernel.execute(
        "import torch\n"
        "print(all(torch.equal(trained_slurm[k], trained_local[k]) for k in trained_local), "
        "sorted(trained_slurm), trained_slurm['weight'].device)\n"
        "print(ddpnb.last_run().engine, [len(ddpnb.last_run().metrics('loss', r)) for r in range(4)])"
    )
    assert check.error is None, check.error
    assert check.stdout.splitlines()[0] == "True ['bias', 'weight'] cpu"


def test_the_slurm_tutorial_trains_on_both_nodes_and_its_weights_come_back(cluster, tmp_path, monkeypatch):
    """notebooks/07_slurm.ipynb top to bottom in a kernel inside the allocation: `-n 4 --nodes 2`, ranks on both
    nodes, the same weights on every rank (the notebook asserts it), rank 0's on the CPU in the notebook."""
    for name, value in {**cluster.env, "SLURM_JOB_ID": cluster.job, "DDPNB_VIEW": "text"}.items():
        monkeypatch.setenv(name, value)
    nb = run_notebook(Path(__file__).parent.parent / "notebooks" / "07_slurm.ipynb", tmp_path, monkeypatch)
    shown = ["".join(out.get("text", "") for out in cell.get("outputs", [])) for cell in nb.cells]
    assert any("[rank 3] rank 3/4 on node n2" in text for text in shown), shown
    assert any("final loss" in text and "the same weights on every rank" in text for text in shown), shown
    assert shown[-2].splitlines() == [
        "{'weight': device(type='cpu'), 'bias': device(type='cpu')}",
        "nodes: ['n1', 'n2']",
    ], shown[-2]
    assert ranks_left() == [] and steps_left(cluster) == []


def test_a_rank_killed_on_node_2_is_named_and_every_rank_and_the_step_are_gone(slurm_kernel, cluster):
    run = slurm_kernel.execute(
        """%%ddp --engine slurm -n 4 --nodes 2
def dies(rank):
    import signal, torch.distributed as dist
    dist.barrier()
    if rank == 3:
        print("rank 3 goes", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # the others would wait; ddpnb stops them
""",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is not None and run.error["ename"] == "WorkerError", run.stdout + run.stderr
    shown = "\n".join(run.error["traceback"])
    node = slurm_kernel.execute("print(ddpnb.last_run().ranks[3].node)").stdout.strip()
    assert node == "n2"
    assert "rank 3 of 4 failed first: killed by SIGKILL (on Slurm node n2)" in shown
    assert PACKAGE_DIR not in shown
    assert ranks_left() == [] and steps_left(cluster) == []
    states = slurm_kernel.execute("print(*[r.state.value for r in ddpnb.last_run().ranks])").stdout.split()
    assert states == ["stopped", "stopped", "stopped", "failed"]


def test_a_connection_without_the_runs_secret_is_refused_and_the_run_goes_on(slurm_kernel, cluster, tmp_path):
    """Strangers at the door: each is refused and logged, a silent one holds no host up, and the ranks end only once
    the two that spoke were logged (an event, not a run length: a loaded machine stretches every step). The silent
    one is still being checked when the run ends: its check ends with the run, logged before the result is back."""
    release = tmp_path / "release"
    out = slurm_kernel.execute(
        f"""
import psutil, socket
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

def listening():
    return {{c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}}

def refused(run):
    path = os.path.join(run.record.run_dir, "channel.log")
    return open(path).read() if os.path.exists(path) else ""

before = listening()
def waits(rank, release):
    while not os.path.exists(release):  # both nodes are this host: the file is the test's word to end
        time.sleep(0.05)
    return "done"

run = ddpnb.launch(waits, engine="slurm", nprocs=2, nodes=2, view="none", args=({str(release)!r},))
doors = listening() - before
silent = [socket.create_connection(tuple(door)) for door in doors]  # in before the hosts, then says nothing
guesses = []
for door in doors:
    try:
        Client(tuple(door), authkey=b"not the secret")
        guesses.append("let in")
    except (AuthenticationError, EOFError, ConnectionError) as exc:
        guesses.append("refused")
    with socket.create_connection(tuple(door)) as stranger:  # says nothing sensible, then hangs up
        stranger.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
deadline = time.monotonic() + 120
while refused(run).count("refused a connection from") < 2 and time.monotonic() < deadline:
    time.sleep(0.05)  # the two that spoke were checked and logged: now the ranks may end
open({str(release)!r}, "w").close()
print(len(doors), guesses, run.result(), run.outcome.value)
log = refused(run)
print(log.count("refused a connection from"), log.count("the run ended before it proved the secret"))
print(len(listening() - before))
for stranger in silent:
    stranger.close()
""",
        timeout=CELL_TIMEOUT,
    )
    assert out.error is None, out.error
    lines = out.stdout.splitlines()
    assert lines[0] == "1 ['refused'] done succeeded", out.stdout + out.stderr
    assert lines[1] == "3 1", out.stdout  # all three logged; the silent one's check ended with the run, logged
    assert lines[2] == "0"  # the listener closed with the run


def test_more_ranks_than_the_allocation_holds_is_refused_quoting_slurm(slurm_kernel):
    before = ranks_left(within=0)
    run = slurm_kernel.execute("%%ddp --engine slurm -n 6\ndef f():\n    return 1\n", timeout=CELL_TIMEOUT)
    assert "UsageError: 6 ranks need 6 CPUs" in run.stderr and "NumCPUs=4" in run.stderr, run.stdout + run.stderr
    run = slurm_kernel.execute("%%ddp --engine slurm -n 2 --nodes 3\ndef f():\n    return 1\n")
    assert "--nodes 3 asks for more nodes than this allocation has" in run.stderr, run.stdout + run.stderr
    assert "NumNodes=2" in run.stderr and before == []


# a Slurm command whose first run finds the controller stopped for as long as it runs: its messages time out, as
# under load
FINDS_SLURM_STALLED = """#!/bin/sh
if mkdir {marker} 2>/dev/null; then
    kill -STOP {controller}
    {command} "$@"
    code=$?
    kill -CONT {controller}
    exit $code
fi
exec {command} "$@"
"""


def test_a_step_slurms_messaging_failed_to_create_is_started_again_saying_so(tmp_path, monkeypatch, capsys):
    """Issue 40: on a loaded cluster Slurm's messages time out (MessageTimeout, 2 s on this one). A `scontrol` that
    finds the controller stalled (SIGSTOP) is asked again, saying so. The run's first srun finds it stalled while it
    runs and fails before the step exists; the engine says so in the run's output, starts the step again, and the
    run succeeds."""
    directory = Path(tempfile.mkdtemp(prefix="ddpnb-slurm-stalled-"))
    stalled = slurm_cluster.start(directory, {"MessageTimeout": "2"})
    controller = stalled.pids["slurmctld"]
    try:
        job = stalled.allocate(nodes=2, tasks=2)
        wrappers = tmp_path / "bin"
        wrappers.mkdir()
        for name in ("scontrol", "srun"):
            wrapper = wrappers / name
            wrapper.write_text(
                FINDS_SLURM_STALLED.format(
                    marker=tmp_path / f"{name}-stalled",
                    controller=controller,
                    command=shutil.which(name, path=stalled.env["PATH"]),
                )
            )
            wrapper.chmod(0o755)
        monkeypatch.setenv("SLURM_CONF", stalled.env["SLURM_CONF"])
        monkeypatch.setenv("PATH", f"{wrappers}:{stalled.env['PATH']}")
        assert f"JobId={job} " in allocation.scontrol("show", "job", job)
        said = capsys.readouterr().err
        assert (
            f"[ddpnb] `scontrol show job {job}` failed (slurm_load_jobs error: Socket timed out on send/recv "
            "operation): trying again in 1 s (1 of 3)" in said
        ), said
        code = (
            "import ddpnb, os\n"
            "def where(rank):\n    return os.environ['SLURMD_NODENAME']\n"
            "print('value', ddpnb.run(where, engine='slurm', nprocs=2, nodes=2, view='text'))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env={**os.environ, "SLURM_JOB_ID": job},
        )
        said = done.stdout + done.stderr
        assert (tmp_path / "srun-stalled").exists()  # the first srun did find the controller stalled
        # srun's own words come with rank 0's output, and so does ddpnb's line about them
        retried = [line for line in said.splitlines() if line.startswith("[rank 0] [ddpnb] srun could not start")]
        assert len(retried) == 1, said
        assert f"(Unable to confirm allocation for job {job}: Socket timed out on send/recv operation)" in retried[0]
        assert "trying again in 1 s (1 of 3)" in retried[0]
        assert done.returncode == 0 and "value n1" in done.stdout, said
        assert ranks_left() == []
    finally:
        os.kill(controller, signal.SIGCONT)  # whatever happened, the controller goes on (and can be stopped)
        stalled.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_without_srun_the_engine_says_what_to_do(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_JOB")}
    code = (
        "import ddpnb\n"
        "try:\n    ddpnb.run(print, engine='slurm', nprocs=2, view='none')\n"
        "except ddpnb.LaunchError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PATH": str(tmp_path)},
        check=False,
    )
    assert "needs Slurm's `srun` on this kernel's PATH" in done.stdout, done.stdout + done.stderr


# --- outside an allocation: the kernel on a login node asks for a job of its own (salloc) ---------------------------
@contextmanager
def on_a_login_node(kernel):
    """The module's kernel as on a login node: SLURM_JOB_ID unset (the cluster's commands still reach Slurm)."""
    kernel.execute("_kernels_job = os.environ.pop('SLURM_JOB_ID')")
    try:
        yield
    finally:
        kernel.execute("os.environ['SLURM_JOB_ID'] = _kernels_job")


def ddpnb_jobs(cluster, within: float = 0.0) -> list[str]:
    """Jobs ddpnb asked for (named ddpnb-<run>) still in the queue after `within` seconds: 'ID STATE REASON'."""
    deadline = time.monotonic() + within
    while True:
        jobs = [
            line
            for line in cluster.run("squeue", "-h", "-o", "%i %j %T %r").splitlines()
            if " ddpnb-" in line and line.split()[0] != cluster.job
        ]  # not the module's own allocation
        if not jobs or time.monotonic() > deadline:
            return [f"{job.split()[0]} {' '.join(job.split()[2:])}" for job in jobs]
        time.sleep(0.1)


def held_job(cluster, timeout: float = 60.0) -> str:
    """The ID of the ddpnb job that waits, held (`--job-args --hold`), in the queue."""
    deadline = time.monotonic() + timeout  # only keeps a broken run from hanging the test
    while (
        not (held := [job.split()[0] for job in ddpnb_jobs(cluster) if "PENDING" in job])
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert held, "no held ddpnb job in the queue"
    return held[0]


def test_outside_an_allocation_a_run_asks_for_its_own_job_says_its_queue_state_and_gives_it_back(slurm_kernel, cluster):
    with on_a_login_node(slurm_kernel):
        cell = Cell(
            slurm_kernel,
            """%%ddp --engine slurm -n 2 --nodes 2 --partition debug --time 5 --job-args '--hold' -o placed
def where(rank, world_size):
    import torch.distributed as dist
    placed = [None] * world_size
    dist.all_gather_object(placed, (os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_ID"]))
    return placed
""",
        )
        job = held_job(cluster)  # held in the queue until released: a job that waits for its turn
        seen = cell.read_until(lambda out: f"slurm job {job} pending (JobHeldUser)" in out.stdout, timeout=60)
        assert "interrupt or stop the run to cancel it" in seen.stdout
        cluster.run("scontrol", "release", job)
        result = cell.finish(timeout=CELL_TIMEOUT)
    assert result.error is None, "\n".join(result.error["traceback"]) + result.text
    assert re.search(rf"\[ddpnb\] slurm job {job} queued [\d.]+ s\n", result.stdout), result.stdout
    placed = slurm_kernel.execute("print(placed)").stdout.strip()
    assert placed == f"[('n1', '{job}'), ('n2', '{job}')]"  # ranks on both nodes of the job asked for
    assert ddpnb_jobs(cluster, within=30) == []  # given back once nothing took it (KEEP_JOB_HERE)
    assert ranks_left() == [] and steps_left(cluster) == []


def test_outside_an_allocation_a_background_run_queues_with_no_clock_running_and_stop_cancels_its_job(
    slurm_kernel, cluster
):
    """`launch` returns while the job waits: the run reads *queued*, with the job's state, and its timeout waits
    for the ranks; released, it runs. A second run is stopped while it waits: its job is cancelled."""
    with on_a_login_node(slurm_kernel):
        launched = slurm_kernel.execute(
            """
from ddpnb.views.html import header_html, overall_state
def where(rank):
    return os.environ["SLURM_JOB_ID"]
run = ddpnb.launch(where, engine="slurm", nprocs=2, nodes=2, job_args="--hold", timeout=10, view="none")
print(run.done)
""",
            timeout=CELL_TIMEOUT,
        )
        assert launched.error is None and launched.stdout == "False\n", launched.text
        job = held_job(cluster)
        for _ in range(100):  # the engine says the state it polls
            queued = slurm_kernel.execute("print(overall_state(run.record), '|', header_html(run.record))").stdout
            if "JobHeldUser" in queued:
                break
            time.sleep(0.2)
        assert queued.startswith("queued |") and f"slurm job {job} pending (JobHeldUser), " in queued, queued
        time.sleep(11)  # past the run's 10 s timeout: a job in the queue is no time of the ranks'
        assert slurm_kernel.execute("print(run.done)").stdout == "False\n"
        cluster.run("scontrol", "release", job)
        ran = slurm_kernel.execute(
            "print(run.result(), run.record.outcome.value, run.record.queued.words())", timeout=CELL_TIMEOUT
        )
        assert ran.error is None, ran.text
        assert re.fullmatch(rf"{job} succeeded slurm job {job} queued [\d.]+ s\n", ran.stdout), ran.stdout
        stopped = slurm_kernel.execute(
            """
run = ddpnb.launch(where, engine="slurm", nprocs=2, job_args="--hold", view="none")
""",
            timeout=CELL_TIMEOUT,
        )
        assert stopped.error is None, stopped.text
        job = held_job(cluster)
        stopped = slurm_kernel.execute(
            "run.stop(); print(run.record.outcome.value, "
            "[r.state.value for r in run.record.ranks], overall_state(run.record))",
            timeout=CELL_TIMEOUT,
        )
    assert stopped.stdout == "stopped ['stopped', 'stopped'] stopped\n", stopped.text
    assert ddpnb_jobs(cluster, within=20) == []  # cancelled; the first given back once nothing took it
    assert ranks_left() == [] and steps_left(cluster) == []


WHERE_AND_WHO = "%%ranks\nimport os\nprint(os.environ['SLURM_JOB_ID'], os.getpid())"


def test_outside_an_allocation_a_session_waits_for_its_job_saying_so_and_its_first_command_follows(
    slurm_kernel, cluster
):
    """`%ddp_start` while the job is held in the queue: the cell says the job's state, the session's first command
    (sent at once) waits for the step, and the session works once the job runs."""
    with on_a_login_node(slurm_kernel):
        try:
            cell = Cell(slurm_kernel, "%ddp_start --engine slurm -n 2 --nodes 2 --job-args '--hold'")
            job = held_job(cluster)
            cell.read_until(lambda out: f"slurm job {job} pending (JobHeldUser)" in out.stdout, timeout=60)
            cluster.run("scontrol", "release", job)
            started = cell.finish(timeout=CELL_TIMEOUT)
            assert started.error is None, started.text
            assert "(interrupt to cancel it)" in started.stdout, started.stdout
            ran = slurm_kernel.execute(WHERE_AND_WHO, timeout=60)
        finally:
            slurm_kernel.execute("%ddp_stop", timeout=60)
    # ranks on two nodes: their lines come in the order each reached the kernel
    assert sorted(re.findall(r"\[rank (\d)\] (\d+) \d+", ran.stdout)) == [("0", job), ("1", job)], ran.text
    assert ddpnb_jobs(cluster, within=30) == []  # given back once nothing took it (KEEP_JOB_HERE)
    assert ranks_left() == [] and steps_left(cluster) == []


def test_outside_an_allocation_a_sessions_restart_keeps_its_job_and_its_end_gives_it_back(slurm_kernel, cluster):
    """`%ddp_restart` on a login node: the fresh ranks run in the job the session had (no second turn in the
    queue); `%ddp_stop` gives it back once no launch took it."""
    with on_a_login_node(slurm_kernel):
        try:
            started = slurm_kernel.execute(
                "%ddp_start --engine slurm -n 2 --nodes 2 --partition debug --time 5", timeout=CELL_TIMEOUT
            )
            assert started.error is None, started.text
            job = slurm_kernel.execute(WHERE_AND_WHO, timeout=60)
            restarted = slurm_kernel.execute("%ddp_restart", timeout=CELL_TIMEOUT)
            assert restarted.error is None, restarted.text
            again = slurm_kernel.execute(WHERE_AND_WHO, timeout=60)
        finally:
            slurm_kernel.execute("%ddp_stop", timeout=60)
    before, after = (re.findall(r"\[rank (\d)\] (\d+) (\d+)", cell.stdout) for cell in (job, again))
    assert len(before) == 2 and len(after) == 2, (job.stdout, again.stdout)
    jobs = {found[1] for found in before + after}
    assert len(jobs) == 1 and cluster.job not in jobs, (before, after)  # one job of its own, both times
    assert not {found[2] for found in before} & {found[2] for found in after}  # fresh ranks in it
    assert "kept from the run before, runs this one too" in restarted.stdout, restarted.text
    assert ddpnb_jobs(cluster, within=30) == []  # given back once nothing took it (KEEP_JOB_HERE)
    assert ranks_left() == [] and steps_left(cluster) == []


def test_an_interrupt_while_the_job_waits_in_the_queue_cancels_it_and_starts_nothing(slurm_kernel, cluster):
    with on_a_login_node(slurm_kernel):
        cell = Cell(slurm_kernel, "%%ddp --engine slurm -n 2 --job-args '--hold'\ndef f():\n    return 1\n")
        job = held_job(cluster)
        cell.read_until(lambda out: f"slurm job {job} pending" in out.stdout, timeout=60)
        slurm_kernel.manager.interrupt_kernel()
        result = cell.finish(timeout=60)
    assert result.error is not None and result.error["ename"] == "RunInterrupted", result.text
    assert (
        f"interrupted while slurm job {job} waited in the queue (pending (JobHeldUser)); it was cancelled, and "
        "no rank started" in "\n".join(result.error["traceback"])
    ), result.error["traceback"]
    assert ddpnb_jobs(cluster, within=10) == []  # cancelled, not left waiting for a turn nobody wants
    assert ranks_left(within=0) == []


def test_a_job_slurm_refuses_is_a_clear_error_quoting_it_and_inside_an_allocation_job_options_are_refused(
    slurm_kernel, cluster
):
    with on_a_login_node(slurm_kernel):
        run = slurm_kernel.execute(
            "%%ddp --engine slurm -n 2 --partition nope\ndef f():\n    return 1\n", timeout=CELL_TIMEOUT
        )
    assert "UsageError: Slurm refused the job for this run (salloc" in run.stderr, run.text
    assert "--partition=nope" in run.stderr and "invalid partition specified: nope" in run.stderr, run.stderr
    assert ddpnb_jobs(cluster) == [] and ranks_left(within=0) == []
    run = slurm_kernel.execute("%%ddp --engine slurm -n 2 --partition debug\ndef f():\n    return 1\n")
    assert (
        f"--partition: options of a job ddpnb asks for outside an allocation, and this kernel runs inside Slurm "
        f"job {cluster.job}" in run.stderr
    ), run.stderr


@pytest.mark.parametrize("when", ["running", "in the queue"])
def test_a_job_asked_for_by_a_kernel_that_dies_goes_back_with_it(cluster, when):
    """The job's `salloc` runs `cat` on ddpnb's pipe, under a keeper that reads it too: a kernel killed outright
    closes it, and the job ends, or is cancelled while it waits (held) in the queue."""
    held = when == "in the queue"
    code = (
        "import os, signal\n"
        "from ddpnb.engines.slurm.options import SlurmOptions\n"
        "from ddpnb.engines.slurm.submit import JobRequest, OwnJob\n"
        f"options = SlurmOptions(job_args={'--hold' if held else ''!r})\n"
        "request = JobRequest(name='ddpnb-orphan', tasks=1, gpus=False, options=options)\n"
        "job = OwnJob(request)\n"
        "job.ask()\n"
        f"while not {held} and not job.granted_within(1):\n"
        "    pass\n"
        "print('JOB', job.job, job.granted, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_JOB")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, **cluster.env},
        check=False,
    )
    assert done.returncode == -9 and re.search(rf"JOB \d+ {not held}\n", done.stdout), done.stdout + done.stderr
    assert ddpnb_jobs(cluster, within=10) == []


def test_a_rank_that_raises_on_node_2_shows_its_own_traceback_and_the_cell_ends(slurm_kernel, cluster):
    run = slurm_kernel.execute(
        """%%ddp --engine slurm -n 4 --nodes 2
def fails(rank):
    import torch.distributed as dist
    if rank == 2:
        raise ValueError(f"bad batch on {os.environ['SLURMD_NODENAME']}")
    dist.barrier()
""",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is not None and run.error["ename"] == "WorkerError", run.stdout + run.stderr
    shown = "\n".join(run.error["traceback"])
    assert "rank 2 of 4 failed first: ValueError: bad batch on n2" in shown
    assert 'raise ValueError(f"bad batch on' in shown and PACKAGE_DIR not in shown  # the cell's own line
    assert ranks_left() == [] and steps_left(cluster) == []


def test_a_session_on_slurm_keeps_state_across_cells_and_a_failing_cell_keeps_it(slurm_kernel, cluster):
    started = slurm_kernel.execute("%ddp_start --engine slurm -n 2 --nodes 2", timeout=CELL_TIMEOUT)
    assert started.error is None and "session of 2 ranks (slurm, gloo" in started.stdout, started.text
    try:
        pids = slurm_kernel.execute("print(*ddpnb._session.current_session().pids)").stdout.split()
        defined = slurm_kernel.execute(
            "%%ranks\nimport os, torch, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\n"
            "print('defined on', rank, os.environ['SLURMD_NODENAME'])\nrank",
            timeout=CELL_TIMEOUT,
        )
        assert defined.error is None and defined.results == ["[rank 0] 0\n[rank 1] 1"], defined.text
        # each rank's line, printed before its answer and shown before the cell's value, on its own node
        assert "[rank 0] defined on 0 n1" in defined.stdout and "[rank 1] defined on 1 n2" in defined.stdout
        reduced = slurm_kernel.execute("%%ranks\ndist.all_reduce(t)\nt.item()", timeout=CELL_TIMEOUT)
        assert reduced.results == ["[rank 0] 3.0\n[rank 1] 3.0"], reduced.text
        failed = slurm_kernel.execute(
            "%%ranks\nt += 1\nif rank == 1:\n    raise ValueError('bad on purpose')\n'fine'", timeout=CELL_TIMEOUT
        )
        assert failed.error is not None and failed.error["ename"] == "SessionError", failed.text
        shown = "\n".join(failed.error["traceback"])
        assert "failed on rank 1 of 2: ValueError: bad on purpose" in shown, shown
        assert re.search(r"Cell In\[\d+\], line 4", shown) and PACKAGE_DIR not in shown
        kept = slurm_kernel.execute("%ranks t.item()", timeout=CELL_TIMEOUT)
        assert kept.results == ["[rank 0] 4.0\n[rank 1] 4.0"], kept.text  # as the failed cell left them
        pushed = slurm_kernel.execute(
            "s = ddpnb._session.current_session()\ns.push(v=5)\nprint(s.pull('v'), s.pull('t'), *s.pids)",
            timeout=CELL_TIMEOUT,
        )
        assert pushed.stdout.split() == ["[5,", "5]", "[tensor([4.]),", "tensor([4.])]", *pids], pushed.text
    finally:
        stopped = slurm_kernel.execute("%ddp_stop", timeout=CELL_TIMEOUT)
    assert stopped.error is None, stopped.text
    assert ranks_left() == [] and steps_left(cluster) == []


def test_interrupting_a_session_cell_on_slurm_raises_keyboard_interrupt_in_the_ranks_and_keeps_them(
    slurm_kernel, cluster
):
    started = slurm_kernel.execute("%ddp_start --engine slurm -n 2 --nodes 2", timeout=CELL_TIMEOUT)
    assert started.error is None, started.text
    try:
        slurm_kernel.execute("%%ranks\nstate = [rank]", timeout=CELL_TIMEOUT)
        cell = Cell(slurm_kernel, "%%ranks\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)")
        cell.read_until(
            lambda seen: "[ranks 0,1] sleeping" in seen.stdout or seen.stdout.count("sleeping") == 2,
            timeout=CELL_TIMEOUT,
        )
        slurm_kernel.manager.interrupt_kernel()
        result = cell.finish(timeout=60)
        assert result.error is not None and result.error["ename"] == "SessionError", result.text
        shown = "\n".join(result.error["traceback"])
        assert "interrupted on ranks 0, 1 of 2" in shown and "KeyboardInterrupt" in shown, shown
        kept = slurm_kernel.execute("%ranks state", timeout=CELL_TIMEOUT)
        assert kept.results == ["[rank 0] [0]\n[rank 1] [1]"], kept.text
    finally:
        stopped = slurm_kernel.execute("%ddp_stop", timeout=CELL_TIMEOUT)
    assert stopped.error is None, stopped.text
    assert ranks_left() == [] and steps_left(cluster) == []


RESTARTED = """%%ddp --engine slurm -n 2 --nodes 2 --max-restarts 1 -o restarted
def flaky(rank):
    import signal, torch.distributed as dist
    dist.barrier()
    print(f"attempt {ddpnb.attempt()} in step {os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}", flush=True)
    if rank == 1 and ddpnb.attempt() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # attempt 0: rank 0 waits here for a rank that is gone; ddpnb stops it
    return ddpnb.attempt()
"""


def test_max_restarts_on_slurm_runs_a_new_step_for_attempt_1_with_its_own_logs(slurm_kernel, cluster):
    run = slurm_kernel.execute(RESTARTED, timeout=CELL_TIMEOUT)
    assert run.error is None, "\n".join(run.error["traceback"]) + run.stdout + run.stderr
    assert "(restart 1 of 1)" in run.text
    check = slurm_kernel.execute(
        "r = ddpnb.last_run()\n"
        "print(restarted, r.attempt, [a.number for a in r.attempts], r.attempts[0].first_failure.summary)\n"
        "print(*sorted(p.name for p in r.run_dir.glob('rank*.log')))\n"
        "for a in range(2):\n"
        "    print(*sorted({line.split(' in step ')[1].strip() for rank in range(2)\n"
        "                   for line in (r.run_dir / f'rank{rank}.attempt{a}.log').read_text().splitlines()\n"
        "                   if ' in step ' in line}))"
    )
    assert check.error is None, check.error
    lines = check.stdout.splitlines()
    assert lines[0] == "1 1 [0] killed by SIGKILL (on Slurm node n2)", check.stdout
    assert lines[1].split() == [f"rank{r}.attempt{a}.log" for r in range(2) for a in range(2)]
    first_step, second_step = lines[2], lines[3]  # each attempt's ranks share one step, and a new one is made
    assert first_step.startswith(f"{cluster.job}.") and second_step.startswith(f"{cluster.job}.")
    assert " " not in first_step and " " not in second_step and first_step != second_step
    assert ranks_left() == [] and steps_left(cluster) == []


def test_a_timeout_on_slurm_shows_each_ranks_stack_and_ends_every_rank(slurm_kernel, cluster):
    # the timeout counts from the step's start, and a Slurm rank imports torch itself (no forkserver): seconds
    # on a busy machine, so it leaves room for that before the hang it is meant to catch
    run = slurm_kernel.execute(
        """%%ddp --engine slurm -n 2 --nodes 2 --timeout 30
def hangs_on_rank_1(rank):
    import torch, torch.distributed as dist
    print(f"rank {rank} at step 1", flush=True)
    if rank == 1:
        time.sleep(600)  # never joins the collective
    dist.all_reduce(torch.ones(1))
""",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is not None, run.stdout + run.stderr
    shown = "\n".join(run.error["traceback"])
    assert "run timed out: stopped after the 30 s timeout (--timeout)" in shown, shown
    stacks = dict(re.findall(r"--- rank (\d) (\(.*?)(?=\n--- rank |\n\nrank  state)", shown, re.DOTALL))
    assert set(stacks) == {"0", "1"}, shown
    for rank, stack in stacks.items():
        assert stack.startswith(f"(running, last line: 'rank {rank} at step 1') ---"), stack
        assert "in hangs_on_rank_1" in stack
    assert "in all_reduce" in stacks["0"] and "in all_reduce" not in stacks["1"]
    assert "_serve_kernel" not in shown and PACKAGE_DIR not in shown
    assert ranks_left() == [] and steps_left(cluster) == []


def test_a_kernel_interrupt_during_a_slurm_run_ends_every_rank_and_its_children_and_the_step(slurm_kernel, cluster):
    cell = Cell(
        slurm_kernel,
        """%%ddp --engine slurm -n 2 --nodes 2
import subprocess
def spins(rank):
    child = subprocess.Popen(["sleep", "600"])
    print(f"CHILD {child.pid}", flush=True)
    for step in range(100_000):
        print(f"step {step}", flush=True)
        time.sleep(0.05)
""",
    )
    seen = cell.read_until(lambda out: out.text.count("CHILD") == 2 and "step 3" in out.text, timeout=CELL_TIMEOUT)
    children = [int(pid) for pid in re.findall(r"CHILD (\d+)", seen.text)]
    slurm_kernel.manager.interrupt_kernel()
    result = cell.finish(timeout=60)
    assert result.error is not None, result.text
    shown = "\n".join(result.error["traceback"])
    assert shown.startswith("KeyboardInterrupt: ddpnb: run interrupted after") and "every rank was stopped" in shown
    assert ranks_left() == [] and steps_left(cluster) == []
    assert wait_gone(children, within=10) == []
    assert slurm_kernel.execute("print(6 * 7)").stdout.strip() == "42"


def test_notebook_data_reaches_each_node_once_and_every_rank_maps_its_nodes_copy(slurm_kernel, cluster):
    """A closure over 64 MB, and a session push of 32 MB: each node's host receives the bytes once into a memory
    file, and the node's ranks map that one file (the same inode on a node, another on the other node); every rank
    reads the notebook's values, and a rank's write stays its own."""
    out = slurm_kernel.execute(
        """
import torch
big = torch.arange(16 << 20, dtype=torch.float32)  # 64 MB
def reads(rank, world_size):
    import torch.distributed as dist
    files = sorted({line.split()[4] for line in open("/proc/self/maps") if "ddpnb-slurm-data" in line})
    total = float(big.sum())
    big[0] = 1e9  # this rank's page only
    seen = [None] * world_size
    dist.all_gather_object(seen, (os.environ["SLURMD_NODENAME"], files, total, float(big[1])))
    return seen
seen = ddpnb.run(reads, engine="slurm", nprocs=4, nodes=2, view="none")
print(seen)
print(float(big.sum()), float(big[0]))
""",
        timeout=CELL_TIMEOUT,
    )
    assert out.error is None, out.text
    seen = eval(out.stdout.splitlines()[0])  # our own cell's repr of plain values
    expected = float(sum(range(16 << 20)))
    assert [node for node, *_ in seen] == ["n1", "n1", "n2", "n2"], seen
    assert all(abs(total - expected) / expected < 1e-6 and second == 1.0 for _, _, total, second in seen), seen
    inodes = [files for _, files, *_ in seen]
    assert all(len(files) == 1 for files in inodes), inodes  # mapped from a memory file, not unpickled
    assert inodes[0] == inodes[1] and inodes[2] == inodes[3] and inodes[0] != inodes[2], inodes
    kernel_total, first = map(float, out.stdout.splitlines()[1].split())
    assert abs(kernel_total - expected) / expected < 1e-6 and first == 0.0  # the notebook's tensor is untouched
    started = slurm_kernel.execute("%ddp_start --engine slurm -n 2 --nodes 2", timeout=CELL_TIMEOUT)
    assert started.error is None, started.text
    try:
        files = "sorted({line.split()[4] for line in open('/proc/self/maps') if 'ddpnb-slurm-data' in line})"
        pushed = slurm_kernel.execute(
            "s = ddpnb._session.current_session()\n"
            "ones = torch.ones(8 << 20)\n"
            "s.push(pushed=ones)\n"
            "print(s.execute('float(pushed.sum())'))\n"
            f"print(s.execute({files!r}))\n"
            "s.push(pushed=ones)\n"  # unchanged: its hosts hold it, nothing is sent
            f"print(s.execute({files!r}))\n"
            "ones[0] = 5\n"  # changed: sent again
            "s.push(pushed=ones)\n"
            "print(s.execute('float(pushed[0])'))",
            timeout=CELL_TIMEOUT,
        )
        assert pushed.error is None, pushed.text
        total, first, again, changed = pushed.stdout.splitlines()
        assert total == f"[{float(8 << 20)}, {float(8 << 20)}]", pushed.text
        assert first == again, pushed.text  # the same memory file on each node: the push was not sent again
        assert changed == "[5.0, 5.0]", pushed.text
    finally:
        slurm_kernel.execute("%ddp_stop", timeout=CELL_TIMEOUT)
    assert ranks_left() == [] and steps_left(cluster) == []


def host_on(node: str) -> int:
    """The PID of the slurm engine's host on `node` (both nodes are this machine: told apart by SLURMD_NODENAME)."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            if (
                HOST_MODULE in " ".join(process.info["cmdline"] or [])
                and process.environ().get("SLURMD_NODENAME") == node
            ):
                return process.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no slurm host on {node}")


def test_a_node_lost_mid_run_is_named_as_the_root_cause_and_nothing_is_left(slurm_kernel, cluster):
    """Node n2's host killed outright, as when the node dies: its ranks go with it (their lifeline), the first
    failure names the node, the ranks on n1 are stopped, and nothing of the run is left on either node."""
    cell = Cell(
        slurm_kernel,
        """%%ddp --engine slurm -n 4 --nodes 2
def waits(rank):
    import torch.distributed as dist
    dist.barrier()
    print(f"rank {rank} up", flush=True)
    time.sleep(300)
""",
    )
    cell.read_until(lambda out: out.text.count(" up") == 4, timeout=CELL_TIMEOUT)
    os.kill(host_on("n2"), 9)
    result = cell.finish(timeout=CELL_TIMEOUT)
    assert result.error is not None and result.error["ename"] == "WorkerError", result.text
    shown = "\n".join(result.error["traceback"])
    assert re.search(r"rank [23] of 4 failed first: its Slurm node n2 was lost", shown), shown
    states = slurm_kernel.execute("print(*[r.state.value for r in ddpnb.last_run().ranks])").stdout.split()
    assert states[:2] == ["stopped", "stopped"] and "failed" in states[2:], states
    assert ranks_left() == [] and steps_left(cluster) == []


STALLS = """%%ddp --engine slurm -n 3 --nodes 2 --stall 3
def computes_then_stalls(rank, world_size):
    import torch, torch.distributed as dist
    for step in range(20):
        spent = time.thread_time() + (0.2 if rank == 2 else 0.05)  # CPU time: rank 2 computes 4x as long
        while time.thread_time() < spent:
            pass
        dist.all_reduce(torch.ones(4))
        ddpnb.log(step=step)
    if rank == 1:
        time.sleep(7)
    dist.all_reduce(torch.ones(1))
"""


def test_the_stall_doctor_the_straggler_radar_and_hardware_columns_work_on_slurm(slurm_kernel, cluster):
    """The views read what every engine's ranks send: on Slurm too, a stall names the rank that holds the others
    (its line in the cell) and where they wait; the rank with four times the compute, which the others wait for at
    each all_reduce, is the one straggler; each
    rank's CPU and memory are sampled."""
    run = slurm_kernel.execute(STALLS, timeout=CELL_TIMEOUT)
    assert run.error is None, "\n".join(run.error["traceback"]) + run.text
    cell = f"Cell In[{run.count}]"
    stalled = [line for line in run.stdout.splitlines() if line.startswith("[ddpnb] stalled:")]
    # (on this 2-core box the ranks' start may be a quiet spell of its own: "ranks 0, 1, 2 are not in your code")
    assert stalled and stalled[-1].endswith(
        f"rank 1 is in time.sleep ({cell}, line 11); ranks 0, 2 wait in all_reduce ({cell}, line 12)"
    ), run.stdout
    assert all(re.search(r"(is|are) (still starting|not in your code)$", line) for line in stalled[:-1]), run.stdout
    assert "[ddpnb] progress resumed" in run.stdout
    check = slurm_kernel.execute(
        "from ddpnb.core.report import straggler_text\n"
        "r = ddpnb.last_run()\n"
        "print([bool(straggler_text(rank)) for rank in r.ranks], [bool(rank.hardware) for rank in r.ranks],\n"
        "      [rank.node for rank in r.ranks])"
    )
    assert check.error is None, check.error
    assert check.stdout.strip() == "[False, False, True] [True, True, True] ['n1', 'n1', 'n2']", check.stdout
    assert ranks_left() == [] and steps_left(cluster) == []


def test_a_breakpoint_on_a_rank_on_node_2_prompts_in_the_cell_and_the_run_goes_on(slurm_kernel, cluster):
    """The debugger in the cell (issue 29) on Slurm: rank 3, on n2, stops at `breakpoint()`; the prompt comes to
    the cell through the kernel's stdin channel, its answers go back through the node's host; after `c` the run
    succeeds."""
    from tests.test_debugger import answers

    run = slurm_kernel.execute(
        """%%ddp --engine slurm -n 4 --nodes 2 -o total
def train(rank, world_size):
    import torch, torch.distributed as dist
    value = torch.ones(1) * (rank + 1)
    if rank == 3:
        breakpoint()
    dist.all_reduce(value)
    return value.item()
""",
        timeout=CELL_TIMEOUT,
        answer=answers("p rank, __import__('os').environ['SLURMD_NODENAME']", "c"),
    )
    assert run.error is None, run.text + str(run.error)
    assert run.prompts[:2] == ["(rank 3) (Pdb) ", "(rank 3) (Pdb) "], run.prompts
    assert "(3, 'n2')" in run.stdout, run.stdout
    assert slurm_kernel.execute("print(total)").stdout.strip() == "10.0"
    assert ranks_left() == [] and steps_left(cluster) == []


def test_a_run_stopped_at_any_moment_of_its_start_ends_with_nothing_left(slurm_kernel, cluster):
    """Stopped while srun starts the hosts, while they connect, while they take their setup, or once the ranks
    run: every time the run ends within its stop's own wait, and no host, rank or step is left. (A host that had
    said hello but got no setup once waited for it forever, and the run with it.)"""
    out = slurm_kernel.execute(
        """
def sleeps(rank):
    time.sleep(300)

ended = []
for delay in (0.0, 0.3, 0.8, 1.5, 3.0, 6.0):
    run = ddpnb.launch(sleeps, engine="slurm", nprocs=4, nodes=2, view="none")
    time.sleep(delay)
    run.stop()
    ended.append((run.done, run.outcome.value))
print(ended)
""",
        timeout=CELL_TIMEOUT,
    )
    assert out.error is None, out.text
    assert out.stdout.strip() == str([(True, "stopped")] * 6), out.text
    assert ranks_left() == [] and steps_left(cluster) == []


def test_a_run_stopped_while_node_0s_host_is_late_ends_with_nothing_left(slurm_kernel, cluster, tmp_path):
    """Node 0's host starts 4 s late (a task prolog sleeps there), so node 1's host has said hello and waits for a
    setup that needs node 0 (rank 0's store): a stop then hangs it up and ends the step, and the run ends."""
    prolog = tmp_path / "late-node-0.sh"
    prolog.write_text('#!/bin/sh\n[ "$SLURM_NODEID" = "0" ] && sleep 4\nexit 0\n')
    prolog.chmod(0o755)
    out = slurm_kernel.execute(
        f"""
def sleeps(rank):
    time.sleep(300)

run = ddpnb.launch(sleeps, engine="slurm", nprocs=4, nodes=2, view="none", srun_args="--task-prolog={prolog}")
import psutil
def hosts_up():
    return [p for p in psutil.process_iter(["cmdline"]) if "ddpnb.engines.slurm.host" in " ".join(p.info["cmdline"] or [])]
deadline = time.monotonic() + 60
while len(hosts_up()) < 1 and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1.0)  # node 1's host has connected; node 0's still sleeps in its prolog
run.stop()
print(run.done, run.outcome.value)
""",
        timeout=CELL_TIMEOUT,
    )
    assert out.error is None, out.text
    assert out.stdout.strip() == "True stopped", out.text
    assert ranks_left() == [] and steps_left(cluster) == []


def test_profile_merges_every_nodes_ranks_into_one_trace(slurm_kernel, cluster):
    """--profile on Slurm (issue 30): each rank's trace travels back on its node's connection (no shared run
    directory needed); the merged trace holds the four ranks of both nodes, each with the steps asked for."""
    run = slurm_kernel.execute(
        "%%ddp --engine slurm -n 4 --nodes 2 --profile 2-3\n"
        "def profiled(rank):\n"
        "    import torch, torch.distributed as dist\n"
        "    for step in range(5):\n"
        "        dist.all_reduce(torch.ones(1000))\n"
        "        ddpnb.log(step=step)\n",
        timeout=CELL_TIMEOUT,
    )
    assert run.error is None and "[ddpnb] profile of steps 2-3:" in run.stdout, run.text
    found = slurm_kernel.execute(
        "import gzip, json\nprofile = ddpnb.last_run().profile\n"
        "events = json.load(gzip.open(profile.trace))['traceEvents']\n"
        "print(sorted(e['args']['name'].split(' (')[0] for e in events "
        "if e['name'] == 'process_name'), [r.spans for r in profile.ranks],\n"
        "      [rank.node for rank in ddpnb.last_run().ranks])"
    )
    assert found.stdout.strip() == ("['rank 0', 'rank 1', 'rank 2', 'rank 3'] [2, 2, 2, 2] ['n1', 'n1', 'n2', 'n2']"), (
        found.text
    )
    assert ranks_left() == [] and steps_left(cluster) == []


@pytest.mark.parametrize("how", ["succeeds", "raises", "stopped"])
def test_what_a_rank_started_in_a_session_of_its_own_is_gone_after_the_run_on_both_nodes(
    slurm_kernel, cluster, tmp_path, how
):
    where = tmp_path / "children"
    where.mkdir()
    out = slurm_kernel.execute(
        STARTS_CHILDREN
        + f"""
run = ddpnb.launch(starts_children, engine="slurm", nprocs=4, nodes=2, view="none", args=({how!r}, {str(where)!r}))
if {how!r} == "stopped":
    deadline = time.monotonic() + 120
    while len(children_started({str(where)!r})) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    run.stop()
run.wait()
print(run.outcome.value, [rank.node for rank in ddpnb.last_run().ranks])
""",
        timeout=CELL_TIMEOUT,
    )
    assert out.error is None, out.text
    assert out.stdout.split()[0] == {"succeeds": "succeeded", "raises": "failed", "stopped": "stopped"}[how], out.text
    assert "'n1'" in out.stdout and "'n2'" in out.stdout  # ranks on both nodes
    children = [int(pid) for path in where.iterdir() for pid in path.read_text().split()]
    assert len(children) == 8
    assert wait_gone(children, within=10) == [], "what a rank started outlived the run"
    assert ranks_left() == [] and steps_left(cluster) == []


MANY_STEPS = 6
MANY = f"""%%ddp --engine slurm -n 32 --nodes 2 --srun-args=--overcommit
def many(rank, world_size):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    print(f"rank {{rank}} of {{world_size}} on {{os.environ['SLURMD_NODENAME']}}", flush=True)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range({MANY_STEPS}):
        if rank == 17:
            time.sleep(0.4)  # the slow rank: the others wait for it in DDP's all_reduce
        loss = model(torch.ones(8, 4)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        ddpnb.log(step=step, loss=loss.item())
        print(f"step {{step}} done", flush=True)
"""


def tagged_ranks(tag: str) -> list[int]:
    """'[ranks 0-16,18-31]' -> [0, ..., 16, 18, ..., 31]; '[rank 17]' -> [17]; '[ranks 0-31 but 17]' -> every
    rank of 0-31 but 17."""
    listed, _, but = tag.strip("[]").split(" ", 1)[1].partition(" but ")
    ranks = []
    for part in listed.split(","):
        low, _, high = part.partition("-")
        ranks += range(int(low), int(high or low) + 1)
    left_out = {int(rank) for rank in but.split(", ")} if but else set()
    return [rank for rank in ranks if rank not in left_out]


@pytest.mark.timeout(300)
def test_thirty_two_ranks_on_two_nodes_read_grouped_and_every_line_is_logged(slurm_kernel, cluster):
    """Issue 44: 32 real ranks, 16 on each node (the allocation holds 4 CPUs: `--overcommit`), a short DDP run with
    one slow rank. The text view folds each line the ranks print together into a few lines tagged with their ranges;
    every rank's log holds every line it printed, in order, and its metrics every step; the cell's table is grouped
    (32 ranks is `groups.GROUP_FROM`), naming the slow rank the others wait for; nothing is left on either node."""
    run = slurm_kernel.execute(MANY, timeout=CELL_TIMEOUT)
    assert run.error is None, "\n".join(run.error["traceback"]) + run.text
    assert "run succeeded" in run.stdout, run.stdout[-3000:]
    tagged = [re.match(r"(\[ranks? [\d,\- but]+\]) (.*)$", line) for line in run.stdout.splitlines()]
    shown = [(tagged_ranks(match.group(1)), match.group(2)) for match in tagged if match]
    for step in range(MANY_STEPS):
        folded = [ranks for ranks, text in shown if text == f"step {step} done"]
        # a line for the ranks that printed it together (a loaded box may split them), not 32
        assert 1 <= len(folded) <= 8, run.stdout[-3000:]
        assert sorted(rank for ranks in folded for rank in ranks) == list(range(32)), folded  # each rank once
    own = {ranks[0]: text for ranks, text in shown if text.startswith("rank ")}
    assert own == {rank: f"rank {rank} of 32 on {'n1' if rank < 16 else 'n2'}" for rank in range(32)}, own
    check = slurm_kernel.execute(
        f"r, steps = ddpnb.last_run(), list(range({MANY_STEPS}))\n"
        "print(*[rank.log_path for rank in r.ranks])\n"
        "print(*[[point.step for point in r.metrics('loss', rank)] == steps for rank in range(32)])\n"
    )
    assert check.error is None, check.text
    logs, metrics = check.stdout.splitlines()
    for rank, path in enumerate(logs.split()):  # nothing lost in the logs, nothing out of order
        lines = Path(path).read_text().splitlines()
        printed = [f"rank {rank} of 32 on {'n1' if rank < 16 else 'n2'}"] + [
            f"step {s} done" for s in range(MANY_STEPS)
        ]
        assert lines[: len(printed)] == printed, (rank, lines)
    assert metrics.split() == ["True"] * 32, metrics
    table = run.stdout[run.stdout.index("32 ranks: 32 finished") :].splitlines()  # the cell's own, grouped
    assert re.match(r"finished +ranks 0-31 +exited with code 0 ", table[2]), table
    assert any(line.startswith("others wait for: rank 17 (") for line in table), table
    assert ranks_left() == [] and steps_left(cluster) == []
