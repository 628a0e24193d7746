"""A real two-node Slurm on this machine, for the Slurm engine's tests: Debian's slurm-wlm and munge.

`start(directory)` writes a munge key and a slurm.conf into `directory`, starts a private munged (its own socket,
so a system munged is never touched), slurmctld and two slurmds (`n1`, `n2`: both this host, each on its own
port), waits until `sinfo` shows both nodes idle, and returns a `Cluster` whose `stop()` ends the four daemons
by PID. Clients reach it through `Cluster.env` (SLURM_CONF). From a shell:

    python -m tests.slurm_cluster start DIR    # prints the environment to use, e.g. eval "$(... start DIR)"
    python -m tests.slurm_cluster stop DIR

Each node declares CPUS_PER_NODE CPUs whatever the machine has (`SlurmdParameters=config_overrides`), so a 2-core
box still runs 4 ranks on 2 nodes; proctrack/linuxproc and task/none need no cgroups (a container has none).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.apart import start_apart

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
CPUS_PER_NODE = 2
NODES = ("n1", "n2")
START_WAIT = 30.0  # seconds the daemons get to show both nodes idle
UP = ("idle", "mix", "alloc")  # sinfo's short states of a node that takes work ("down*", "drain" do not)


def missing() -> list[str]:
    """The daemons and commands this needs that are not installed here."""
    return [
        name
        for name in (*DAEMONS, "srun", "salloc", "sinfo", "scontrol", "scancel", "squeue")
        if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None
    ]


def install() -> str:
    """Install the packages (root, apt): '' on success, else why not."""
    if not missing():
        return ""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{' and '.join(PACKAGES)} are not installed, and this is not root with apt-get to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            return f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}"
    return "" if not missing() else f"still missing after installing {' '.join(PACKAGES)}: {', '.join(missing())}"


def _free_port() -> int:
    # a daemon takes a port number from its config file, not a bound socket: the nearest thing is one the kernel
    # just handed out and nothing holds
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Cluster:
    directory: Path
    pids: dict[str, int] = field(default_factory=dict)
    job: str = ""  # the allocation kernels run in, as inside `salloc` (the session fixture's: tests/conftest.py)

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a client (salloc, srun, the kernel) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf), "PATH": f"{os.environ.get('PATH', '')}:/usr/sbin"}

    def run(self, *command: str, check: bool = True) -> str:
        done = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, **self.env}, timeout=60, check=False
        )
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def allocate(self, nodes: int = 2, tasks: int = 4, name: str = "ddpnb-tests") -> str:
        """A job holding `nodes` nodes for `tasks` tasks, with no shell (`salloc --no-shell -N 2 -n 4`): the
        allocation a kernel started inside `salloc` runs in."""
        out = subprocess.run(
            ["salloc", "--no-shell", f"--nodes={nodes}", f"--ntasks={tasks}", f"--job-name={name}", "--immediate=20"],
            capture_output=True,
            text=True,
            env={**os.environ, **self.env},
            timeout=60,
            check=False,
        )
        for word in (out.stdout + out.stderr).split():
            if word.isdigit():
                return word  # "salloc: Granted job allocation 3"
        raise RuntimeError(f"salloc gave no job: {out.stdout}{out.stderr}")

    def steps(self, job: str) -> list[str]:
        """The job's steps still running, as `squeue --steps` lists them."""
        return [
            line for line in self.run("squeue", "--steps", "-h", "-j", job, "-o", "%i %j").splitlines() if line.strip()
        ]

    def tidy(self, within: float = 30.0) -> None:
        """Back to how the session fixture started it, after tests that may have left it otherwise (a failed test's
        job or step, a node down): every job but `job` and every step of `job` cancelled, any node down or drained
        resumed, and `job` allocated again if it is gone; it waits `within` seconds for that, else says what is
        left."""
        jobs = [line.split() for line in self.run("squeue", "-h", "-o", "%i %T").splitlines() if line.strip()]
        if others := [job for job, _ in jobs if job != self.job]:
            self.run("scancel", *others, check=False)
        if steps := [line.split()[0] for line in self.steps(self.job)]:
            self.run("scancel", *steps, check=False)
        if any(state not in UP for state in self.nodes().values()):
            self.run("scontrol", "update", f"NodeName={','.join(NODES)}", "State=RESUME", check=False)
        if (self.job, "RUNNING") not in [tuple(job) for job in jobs]:
            self.job = self.allocate()
        deadline = time.monotonic() + within
        while True:
            jobs = self.run("squeue", "-h", "-o", "%i").split()
            left = [job for job in jobs if job != self.job] + self.steps(self.job)
            nodes = self.nodes()
            if not left and all(state in UP for state in nodes.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local Slurm is not back after {within:g} s: jobs {left}, nodes {nodes}")
            time.sleep(0.2)

    def nodes(self) -> dict[str, str]:
        """Each node's state as `sinfo -N` says it (idle, mix, alloc, down*, drain...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).split()
        return dict(zip(out[::2], out[1::2]))

    def stop(self) -> None:
        """SIGTERM to each daemon, then SIGKILL to whichever has not gone within 5 s; by PID, never by name."""
        for pid in self.pids.values():
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for pid in self.pids.values():
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                _signal(pid, signal.SIGKILL)
        (self.directory / "pids").unlink(missing_ok=True)
        self.pids = {}


def start(directory: Path, settings: dict[str, str] | None = None) -> Cluster:
    """The cluster, its slurm.conf holding `settings` too (e.g. {"MessageTimeout": "2"}), each a line after ours
    (a name ours sets already is refused rather than written twice)."""
    settings = settings or {}
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)  # munged refuses a socket directory others may write to
    cluster = Cluster(directory)
    key = directory / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = directory / "munge.socket"
    ports = {"ctld": _free_port(), **{node: _free_port() for node in NODES}}
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[node]} "
        f"CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN"
        for node in NODES
    )
    conf = f"""\
ClusterName=ddpnb
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports["ctld"]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool-%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=5
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
    again = {line.partition("=")[0] for line in conf.splitlines()} & set(settings)
    if again:
        raise ValueError(f"{', '.join(sorted(again))}: set by this module's slurm.conf already")
    cluster.conf.write_text(conf + "".join(f"{name}={value}\n" for name, value in settings.items()))
    (directory / "state").mkdir(exist_ok=True)
    env = {**os.environ, **cluster.env}

    def daemon(name: str, *command: str) -> None:
        cluster.pids[name] = start_apart(command, directory / f"{name}.out", env, timeout=10)

    try:
        daemon(
            "munged",
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={socket_path}",
            f"--pid-file={directory}/munged.pid",
            f"--log-file={directory}/munged.log",
            f"--seed-file={directory}/munged.seed",
        )
        _wait_for(lambda: socket_path.exists(), "munged's socket", directory)
        daemon("slurmctld", "slurmctld", "-D", "-i", "-f", str(cluster.conf))
        for node in NODES:
            daemon(f"slurmd-{node}", "slurmd", "-D", "-N", node, "-f", str(cluster.conf))
        (directory / "pids").write_text("\n".join(f"{name} {pid}" for name, pid in cluster.pids.items()))
        _wait_for(lambda: _idle(cluster), "both nodes idle in sinfo", directory)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _idle(cluster: Cluster) -> bool:
    states = cluster.nodes()
    return all(states.get(node) == "idle" for node in NODES)


def _wait_for(ready, what: str, directory: Path) -> None:
    deadline = time.monotonic() + START_WAIT
    while not ready():
        if time.monotonic() > deadline:
            logs = "".join(
                f"\n--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                for p in sorted(directory.glob("*.out")) + sorted(directory.glob("*.log"))
            )
            raise RuntimeError(f"the local Slurm did not come up: no {what} after {START_WAIT:g} s{logs}")
        time.sleep(0.1)


def stop(directory: Path) -> None:
    """Stop the daemons a `start(directory)` left running (their PIDs are in `directory/pids`)."""
    pids_file = Path(directory) / "pids"
    if pids_file.exists():
        pairs = [line.split() for line in pids_file.read_text().splitlines() if line.strip()]
        Cluster(Path(directory), {name: int(pid) for name, pid in pairs}).stop()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    action, where = sys.argv[1], Path(sys.argv[2])
    if action == "start":
        why = install()
        if why:
            sys.exit(why)
        started = start(where)
        print("\n".join(f"export {name}={value}" for name, value in started.env.items()))
    elif action == "stop":
        stop(where)
    else:
        sys.exit("usage: python -m tests.slurm_cluster start|stop DIR")
