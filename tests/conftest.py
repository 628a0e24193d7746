"""Shared test helpers: a real Jupyter kernel driven through jupyter_client, and process checks."""

from __future__ import annotations

import importlib.util
import os
import queue
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

import ddpnb
from tests import ray_cluster, slurm_cluster

# the fake engine (tests/fake_engine.py) is registered for the tests only, as another package's engine is: through
# the `ddpnb.engines` entry point group, from a distribution's metadata in tests/engines/
TEST_ENGINES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines")
sys.path.insert(0, TEST_ENGINES)

# ddpnb's own source files: a traceback or stack shown to users must not name any of them
PACKAGE_DIR = os.path.dirname(os.path.abspath(ddpnb.__file__))

# Ray Train's controller looks at its workers every 2 s (its default): a rank's failure, or the end of a fit, waits
# for the next look. The restart tests' Ray looks every 0.5 s (a Ray instance ddpnb starts takes the kernel's env)
RAY_TRAIN_POLL = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


@dataclass
class Execution:
    stdout: str = ""
    stderr: str = ""
    results: list[str] = field(default_factory=list)
    error: dict | None = None
    outputs: list[dict] = field(default_factory=list)
    count: int | None = None  # the cell's N in In[N]
    prompts: list[str] = field(default_factory=list)  # what the cell asked the front end (`input_request`)

    @property
    def text(self) -> str:
        return self.stdout + self.stderr + "".join(self.results)


class Kernel:
    """A real ipykernel; `execute(code)` runs a cell and collects its outputs."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.manager, self.client = start_new_kernel(kernel_name="python3", env={**os.environ, **(env or {})})

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def execute(
        self, code: str, timeout: float = 120, cell_id: str | None = None, answer: Callable[[str], str] | None = None
    ) -> Execution:
        """`cell_id`: the cell's ID in the request's metadata, as JupyterLab sends it (jupyter_client does not).
        `answer`: the front end takes input, as JupyterLab's does: each prompt the cell asks on the stdin channel
        (`input_request`) is answered with `answer(prompt)`, and kept in `Execution.prompts`; without it the
        request allows no input, as nbclient's does."""
        if cell_id is None:
            msg_id = self.client.execute(code, allow_stdin=answer is not None)
        else:
            request = self.client.session.msg(
                "execute_request",
                {
                    "code": code,
                    "silent": False,
                    "store_history": True,
                    "user_expressions": {},
                    "allow_stdin": False,
                    "stop_on_error": True,
                },
                metadata={"cellId": cell_id},
            )
            self.client.shell_channel.send(request)
            msg_id = request["header"]["msg_id"]
        result = Execution()
        deadline = time.monotonic() + timeout
        while True:
            if answer is not None:
                try:
                    request = self.client.get_stdin_msg(timeout=0.05)
                except queue.Empty:
                    request = None
                if request is not None and request["msg_type"] == "input_request":
                    result.prompts.append(request["content"]["prompt"])
                    self.client.input(answer(request["content"]["prompt"]))
            try:
                msg = self.client.get_iopub_msg(
                    timeout=0.05 if answer is not None else max(0.1, deadline - time.monotonic())
                )
            except queue.Empty:
                if time.monotonic() < deadline:
                    continue
                raise TimeoutError(f"cell did not finish in {timeout} s:\n{code}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    result.stdout += content["text"]
                else:
                    result.stderr += content["text"]
            elif kind in ("execute_result", "display_data"):
                result.results.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                result.error = content
            elif kind == "execute_input":
                result.count = content["execution_count"]
            elif kind == "status" and content["execution_state"] == "idle":
                break
            result.outputs.append(msg)
        return result

    def shutdown(self) -> None:
        """Stop the kernel and wait until what it started (its forkserver, their resource trackers) is gone too, so
        that no later test finds them (a subreaper test process inherits them when the kernel dies first)."""
        try:
            tree = [child.pid for child in psutil.Process(self.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)
        left = wait_gone(tree, within=10)
        assert not left, f"still running 10 s after the kernel stopped: {[_describe(pid) for pid in left]}"


# a rank's function for a kernel cell: a child in a session of its own and a double-forked daemon, their PIDs
# written to `where`; then it returns, raises (rank 1, once every rank wrote) or sleeps, as `how` says
STARTS_CHILDREN = """
def starts_children(rank, world_size, how, where):
    import os, subprocess, time
    own_session = subprocess.Popen(["sleep", "600"], start_new_session=True)
    reader, writer = os.pipe()
    if os.fork() == 0:  # a double-forked daemon: fork, setsid, fork, and its parent exits at once
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.execvp("sleep", ["sleep", "600"])
        os.write(writer, str(daemon).encode())
        os._exit(0)
    daemon = int(os.read(reader, 32))
    with open(f"{where}/rank{rank}.partial", "w") as out:
        out.write(f"{own_session.pid} {daemon}")
    os.rename(f"{where}/rank{rank}.partial", f"{where}/rank{rank}")
    if how == "raises" and rank == 1:
        while len([name for name in os.listdir(where) if not name.endswith("partial")]) < world_size:
            time.sleep(0.02)
        raise ValueError("failed with children running")
    if how != "succeeds":
        time.sleep(600)
    return rank

def children_started(where):
    return [int(pid) for name in sorted(os.listdir(where)) if not name.endswith("partial")
            for pid in open(os.path.join(where, name)).read().split()]
"""


@contextmanager
def private_runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """DDPNB_RUNS_DIR set to a fresh directory (kernels started meanwhile inherit it), then put back."""
    path = tmp_path_factory.mktemp("ddpnb-runs")
    previous = os.environ.get("DDPNB_RUNS_DIR")
    os.environ["DDPNB_RUNS_DIR"] = str(path)
    try:
        yield path
    finally:
        if previous is None:
            del os.environ["DDPNB_RUNS_DIR"]
        else:
            os.environ["DDPNB_RUNS_DIR"] = previous


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(env={"DDPNB_VIEW": "text"})
    k.execute("%load_ext ddpnb")
    yield k
    k.shutdown()


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[slurm_cluster.Cluster]:
    """The two-node Slurm of tests/slurm_cluster.py, started once for the session by the first module that asks
    (pytest-randomly shuffles them) and stopped by PID at its end, holding one allocation (`salloc -N 2 -n 4`,
    `cluster.job`) that kernels run inside; the tests skip, saying why, where Slurm cannot be installed."""
    why = slurm_cluster.install()
    if why:
        pytest.skip(f"no local Slurm for the Slurm tests: {why}")
    directory = Path(tempfile.mkdtemp(prefix="ddpnb-slurm-"))
    started = slurm_cluster.start(directory)
    try:
        started.job = started.allocate(nodes=2, tasks=4)
        yield started
    finally:
        if started.job:
            started.run("scancel", started.job, check=False)
        started.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(local_slurm: slurm_cluster.Cluster) -> slurm_cluster.Cluster:
    """The session's Slurm as each module finds it at its start: whatever an earlier module's tests left (a job,
    a step, a node down) is cleared first, so no module's failure becomes another's."""
    local_slurm.tidy()
    return local_slurm


@pytest.fixture(scope="session")
def local_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ray_cluster.Cluster]:
    """The two-node `ray start` cluster of tests/ray_cluster.py, with Ray Client's server, started once for the
    session by the first module that asks (pytest-randomly shuffles them) and stopped at its end. Its nodes keep
    their run directories apart from every kernel's (DDPNB_RUNS_DIR of their own: what a Ray Client kernel never
    sees) and take no token (RAY_AUTH_MODE=disabled, as the kernels that join it)."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        pytest.skip("ray[train] is not installed (pip install -e '.[ray]')")
    node_runs = tmp_path_factory.mktemp("node-runs")
    node_runs.chmod(0o700)
    env = {
        "DDPNB_RUNS_DIR": str(node_runs),
        "DDPNB_VIEW": "none",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    with ray_cluster.two_node_cluster(tmp_path_factory.mktemp("ray-logs"), env) as started:
        yield started


@pytest.fixture(scope="module")
def ray_start_cluster(local_ray: ray_cluster.Cluster) -> ray_cluster.Cluster:
    """The session's `ray start` cluster as each module finds it at its start: what an earlier module's runs left
    (a detached run's supervisor, a placement group) is cleared first, so no module's leftovers become another's."""
    local_ray.tidy()
    return local_ray


def wait_gone(pids: list[int], within: float = 5.0) -> list[int]:
    """PIDs still alive after `within` seconds (zombies count as gone)."""
    deadline = time.monotonic() + within
    while True:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def left_in_groups(groups: list[int], within: float = 5.0) -> list[str]:
    """What still runs, `within` seconds on, in the process groups `groups`, found from outside by scanning every
    process (a local rank leads its own group: whatever it started and did not move out is in it). A rank's own
    PID proves nothing once its run returned: a run ends only once every rank has exited."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) in groups and process.status() != psutil.STATUS_ZOMBIE:
                    left.append(_describe(process.pid))
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def written_result_files() -> set[int]:
    """This process's fds of ranks' result files (anonymous memory files, `ddpnb-result`) that rank 0 has written
    its return value (one holding tensors) into: a new one is how a test knows that rank 0's function of a run it
    started has returned, to release another rank only then."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "ddpnb-result" in os.readlink(f"/proc/self/fd/{fd}") and os.fstat(int(fd)).st_size > 0:
                found.add(int(fd))
        except OSError:  # the listing's own fd, or one closed meanwhile
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(pid: int) -> str:
    try:
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())}"
    except psutil.NoSuchProcess:
        return str(pid)


WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def dashboards(nb: Any) -> list[str]:
    """For each ddpnb dashboard in an executed notebook's stored widget state (what a front end gets), in creation
    order, all its HTML joined."""
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]

    def html_below(model_id: str) -> list[str]:
        model = state[model_id]["state"]
        found = [model["value"]] if state[model_id]["model_name"] == "HTMLModel" else []
        for child in model.get("children", []):
            found += html_below(child.removeprefix("IPY_MODEL_"))
        return found

    return [
        "\n".join(html_below(model_id))
        for model_id, model in state.items()
        if "ddpnb" in model["state"].get("_dom_classes", [])
    ]


def training_cell(steps: int, pause: float) -> str:
    """A detached-run test's cell: `train`, a 2-rank all_reduce per step that logs its step and loss and prints a
    line, `pause` seconds a step, returning rank 0's total and a tensor (the result compared with a plain run's)."""
    return f"""
import json
import ddpnb

def train(rank, world_size):
    import time
    import torch
    import torch.distributed as dist
    import ddpnb

    total = torch.zeros(1)
    for step in range({steps}):
        one = torch.ones(1)
        dist.all_reduce(one)
        total += one
        ddpnb.log(step=step, loss=1.0 / (step + 1))
        print(f"rank {{rank}} step {{step}}", flush=True)
        time.sleep({pause})
    return {{"rank": rank, "total": total.item(), "weights": torch.arange(4.0) * total}}
"""
