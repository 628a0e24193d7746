"""One measurement per process: `python bench/_probes.py NAME [options]` prints one `@@BENCH {json}` line.

Each probe runs in a fresh interpreter so that nothing (a warm forkserver, threads, a process group) carries
over from another launcher. The process plays the notebook kernel: it has imported torch before the clock
starts, as a notebook that ran `import torch` has.

Only the standard library at module level: mp.spawn's children re-import this file as `__mp_main__`, so
whatever it imports at the top their ranks pay for on every launch (ddpnb's ranks never re-run it).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workloads

MARKER = "@@BENCH "


def emit(data: dict[str, Any]) -> None:
    sys.stdout.flush()
    print(MARKER + json.dumps(data), flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _result_file() -> str:
    """A fresh file for rank 0 to write its value to (the launchers that return nothing)."""
    fd, path = tempfile.mkstemp(prefix="ddpnb-bench-", suffix=".json")
    os.close(fd)
    return path


def by_value() -> None:
    """Send the workloads to ddpnb's workers by value, the way a notebook's functions travel."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(_workloads)


# --- launch latency -------------------------------------------------------------------------------------------
SHELL_CELL = """\
def trivial_cell(rank, world_size):
    import torch
    import torch.distributed as dist
    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()
"""


def probe_ddpnb(args: argparse.Namespace) -> None:
    import torch  # the notebook imported torch; ddpnb's forkserver imports it again, once

    import ddpnb

    by_value()
    started = time.perf_counter()
    first = ddpnb.run(_workloads.trivial, nprocs=2)
    cold = time.perf_counter() - started
    pids = {first["pid"]}
    warm = []
    for _ in range(args.warm):
        started = time.perf_counter()
        value = ddpnb.run(_workloads.trivial, nprocs=2)
        warm.append(time.perf_counter() - started)
        pids.add(value["pid"])
    after_matmul = None
    if args.matmul:
        # the kernel has done multi-threaded torch work, the workers do some too: fork-based launchers hang here
        torch.set_num_threads(max(2, torch.get_num_threads()))
        a = torch.randn(1500, 1500)
        (a @ a).sum().item()
        started = time.perf_counter()
        ddpnb.run(_workloads.trivial_after_matmul, nprocs=2)
        after_matmul = time.perf_counter() - started
    shell_warm = []
    if args.shell_warm:
        from IPython.core.interactiveshell import InteractiveShell

        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "ddpnb")
        for _ in range(args.shell_warm):
            started = time.perf_counter()
            result = shell.run_cell_magic("ddp", "-n 2", SHELL_CELL)
            shell_warm.append(time.perf_counter() - started)
            assert result == 2.0, result
    library, preload, preloaded = [], None, []
    if args.torchvision:  # a cell using a library the forkserver has not imported, before and after ddpnb.preload
        for _ in range(args.torchvision):
            started = time.perf_counter()
            ddpnb.run(_workloads.trivial_with_torchvision, nprocs=2)
            library.append(time.perf_counter() - started)
        started = time.perf_counter()
        ddpnb.preload("torchvision")
        preload = time.perf_counter() - started
        for _ in range(args.torchvision):
            started = time.perf_counter()
            ddpnb.run(_workloads.trivial_with_torchvision, nprocs=2)
            preloaded.append(time.perf_counter() - started)
    emit(
        {
            "cold": cold,
            "warm": warm,
            "shell_warm": shell_warm,
            "after_matmul": after_matmul,
            "sum": first["sum"],
            "distinct_rank0_pids": len(pids),
            "runs": 1 + args.warm,
            "library": library,
            "preload": preload,
            "preloaded": preloaded,
        }
    )


def _spawn_target(rank: int, world_size: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world_size))
    value = _workloads.trivial()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(value))


def probe_mp_spawn(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    times = []
    for _ in range(args.repeat):
        out = _result_file()
        os.environ["MASTER_PORT"] = str(free_port())
        started = time.perf_counter()
        mp.spawn(_spawn_target, args=(2, out), nprocs=2, join=True)
        value = json.loads(Path(out).read_text())
        times.append(time.perf_counter() - started)
        os.unlink(out)
    emit({"times": times, "sum": value["sum"]})


def _accelerate_target(out: str, matmul: bool) -> None:
    import torch.distributed as dist

    value = _workloads.trivial_after_matmul() if matmul else _workloads.trivial()
    dist.destroy_process_group()
    if os.environ["RANK"] == "0":
        Path(out).write_text(json.dumps(value))


def probe_accelerate(args: argparse.Namespace) -> None:
    import torch
    from accelerate import notebook_launcher

    if args.matmul:
        # what a notebook has usually done before it launches: some multi-threaded torch work (the ranks then
        # do a matmul too, as any training step does)
        torch.set_num_threads(max(2, torch.get_num_threads()))
        a = torch.randn(1500, 1500)
        (a @ a).sum().item()
    times = []
    for _ in range(args.repeat):
        out = _result_file()
        started = time.perf_counter()
        notebook_launcher(_accelerate_target, args=(out, args.matmul), num_processes=2, use_port=str(free_port()))
        value = json.loads(Path(out).read_text())
        times.append(time.perf_counter() - started)
        os.unlink(out)
    emit({"times": times, "sum": value["sum"]})


NBD_CELL = """\
import torch
import torch.distributed as dist
value = torch.ones(1)
dist.all_reduce(value)
print(value.item())
"""
NBD_CELLS = {"allreduce": NBD_CELL, "trivial": "x = 1\n"}  # the launch table's cell; the session table's


def _nbd_ready(magic: Any) -> bool:
    """Whether every nbdistributed worker answers a status request within 0.25 s."""
    try:
        magic._comm_manager.send_to_all("get_status", {}, timeout=0.25)
    except TimeoutError:
        return False
    return True


def probe_nbdistributed(args: argparse.Namespace) -> None:
    import torch  # noqa: F401
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdistributed")
    magic = shell.magics_manager.registry["DistributedMagic"]
    started = time.perf_counter()
    shell.run_line_magic("dist_init", "-n 2")
    init = time.perf_counter() - started
    # %dist_init returns after a fixed 2 s sleep; a cell sent before the workers have connected is dropped and
    # times out after 30 s. Wait for them as an informed user would, polling their status.
    ready_at_return = _nbd_ready(magic)
    while not _nbd_ready(magic):
        pass
    cell = NBD_CELLS[args.cell]
    shell.run_cell_magic("distributed", "", cell)
    cold = time.perf_counter() - started
    warm = []
    for _ in range(args.warm):
        started = time.perf_counter()
        shell.run_cell_magic("distributed", "", cell)
        warm.append(time.perf_counter() - started)
    _nbd_shutdown(magic)
    emit({"cold": cold, "init": init, "ready_at_return": ready_at_return, "warm": warm})


def _nbd_shutdown(magic: Any) -> None:
    """End this probe's nbdistributed workers without `%dist_shutdown`: that one runs `pkill -f worker.py`,
    `pkill -9 -f "python.*worker"` and `pkill -9 -f "torch.*distributed"`, which end any matching process of
    anyone on the machine. Its workers are children in the probe's process group: bench/run.py kills the group
    after the probe whatever happens here."""
    comm, processes = magic._comm_manager, magic._process_manager
    if comm is not None:
        with contextlib.suppress(TimeoutError):  # a worker that does not answer is killed below
            comm.send_to_all("shutdown", {}, timeout=2.0)
        comm.shutdown()
    for process in processes.processes if processes is not None else []:
        process.kill()
        process.wait()


# --- sessions ------------------------------------------------------------------------------------------------
def _interleaved(variants: dict[str, Any], warmup: int, count: int) -> dict[str, list[float]]:
    """`warmup` untimed calls of each variant, then `count` timed calls of each, one of each in turn in an order
    that rotates, so no variant always follows the same one. Seconds per call."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for index in range(count):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            started = clock()
            variants[name]()
            times[name].append(clock() - started)
    return times


def probe_session(args: argparse.Namespace) -> None:
    """A ddpnb session on 2 CPU ranks: trivial cells through the API and the magic, then restarts against later
    launches of a trivial function, all in this one kernel."""
    import torch  # noqa: F401
    from IPython.core.interactiveshell import InteractiveShell

    import ddpnb
    from ddpnb import _session

    by_value()
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddpnb")
    started = time.perf_counter()
    shell.run_line_magic("ddp_start", "-n 2")  # the kernel's first: it starts the forkserver (imports torch)
    start = time.perf_counter() - started
    session = _session.current_session()
    assert session is not None
    try:
        assert session.execute("rank") == [0, 1]
        assert shell.run_cell_magic("ranks", "", "rank * 10") == [0, 10]
        cells = _interleaved(
            {
                "execute": lambda: session.execute("x = 1"),
                "execute_value": lambda: session.execute("rank"),
                "magic_value": lambda: shell.run_cell_magic("ranks", "", "rank"),
            },
            args.warmup,
            args.cells,
        )
        ddpnb.run(_workloads.trivial, nprocs=2)  # a later launch is what restarts are compared with
        restart, launch, stop, start_again, first_cell = [], [], [], [], []
        pids = [tuple(session.pids)]
        clock = time.perf_counter
        for index in range(args.restarts):

            def timed_restart() -> None:
                began = clock()
                shell.run_line_magic("ddp_restart", "")
                restart.append(clock() - began)
                pids.append(tuple(session.pids))
                began = clock()
                assert session.execute("rank") == [0, 1]
                first_cell.append(clock() - began)

            def timed_launch() -> None:
                began = clock()
                ddpnb.run(_workloads.trivial, nprocs=2)
                launch.append(clock() - began)

            for step in (timed_restart, timed_launch) if index % 2 == 0 else (timed_launch, timed_restart):
                step()
            # the two halves of a restart, timed apart: stopping the ranks, then starting fresh ones
            began = clock()
            session.stop()
            stop.append(clock() - began)
            began = clock()
            session.restart()  # from stopped: only the start
            start_again.append(clock() - began)
            pids.append(tuple(session.pids))
        every_pid = [pid for ranks in pids for pid in ranks]
        fresh = len(set(every_pid)) == len(every_pid)
    finally:
        session.stop()
    emit(
        {
            "start": start,
            **cells,
            "restart": restart,
            "launch": launch,
            "stop": stop,
            "start_again": start_again,
            "first_cell_after_restart": first_cell,
            "fresh_pids": fresh,
        }
    )


def _outlived(pids: list[int], wait: float = 10.0) -> None:
    """Wait for this probe's ipyparallel processes to exit after the cluster stopped (each engine's nanny takes a
    few seconds to notice); SIGKILL any that are still there after `wait` seconds."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=wait)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def probe_ipyparallel(args: argparse.Namespace) -> None:
    """ipyparallel's DirectView on 2 engines on this machine: `execute` alone, and followed by a `pull`.

    Its controller and engines start in sessions of their own (outside this probe's process group): their PIDs
    go to `--pids-file` as soon as they are known, so bench/run.py can end them if this probe does not."""
    import ipyparallel
    import torch  # noqa: F401

    pids_file = Path(args.pids_file)
    started = time.perf_counter()
    cluster = ipyparallel.Cluster(n=2, profile_dir=args.profile_dir, log_level=40)
    try:
        client = cluster.start_and_connect_sync()
        pids = [cluster.controller.pid] if cluster.controller is not None else []
        for engines in cluster.engines.values():
            pids += [launcher.pid for launcher in engines.launchers.values()]
        pids_file.write_text(json.dumps(pids))
        client.wait_for_engines(2, timeout=120)
        import psutil

        for pid in list(pids):  # each engine's nanny: a child in a session of its own too
            with contextlib.suppress(psutil.NoSuchProcess):
                pids += [child.pid for child in psutil.Process(pid).children(recursive=True)]
        pids_file.write_text(json.dumps(pids))
        view = client[:]
        view.execute("import torch", block=True)  # the engines hold torch, as the other rows' ranks do
        start = time.perf_counter() - started
        assert view.apply_sync(lambda: 1) == [1, 1]

        def execute_pull() -> None:
            view.execute("x = 1", block=True)
            assert view.pull("x", block=True) == [1, 1]

        cells = _interleaved(
            {"execute": lambda: view.execute("x = 1", block=True), "execute_pull": execute_pull},
            args.warmup,
            args.cells,
        )
        client.close()
    finally:
        cluster.stop_cluster_sync()
    _outlived(json.loads(pids_file.read_text() or "[]"))
    pids_file.write_text("[]")  # stopped: nothing left for bench/run.py to end
    emit({"start": start, **cells})


# --- training overhead ----------------------------------------------------------------------------------------
def probe_train_ddpnb(args: argparse.Namespace) -> None:
    import ddpnb

    by_value()
    ddpnb.run(_workloads.trivial, nprocs=2)  # warm
    value, kernel_cpu = _with_kernel_cpu(
        lambda: ddpnb.run(_workloads.train, nprocs=2, args=(args.steps, not args.quiet)), args.quiet
    )
    record = ddpnb.last_run()
    journal = Path(record.run_dir) / "journal"  # written where DDPNB_JOURNAL=1 asks for it
    emit(
        {
            **value,
            "kernel_cpu_per_step": kernel_cpu,
            "journal_bytes": journal.stat().st_size if journal.exists() else 0,
            "lines": sum(r.lines for r in record.ranks),
            "metrics": sum(len(r.metrics.get("loss", [])) for r in record.ranks),
        }
    )


def _with_kernel_cpu(call: Any, quiet: bool = False, interval: float = 0.5) -> tuple[Any, float | None]:
    """`call()` (a foreground ddpnb.run of a training workload), and this process's CPU time per step rank 0
    reported while the steps ran: sampled every `interval` against the count of rank 0's `loss` metrics, so the
    run's start and end (launch, not training) are left out. These samples' own wake-ups are charged too.
    A `quiet` run reports nothing to count steps by: its kernel CPU is not measured (None)."""
    if quiet:
        return call(), None
    import resource

    import ddpnb

    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval):
            record = ddpnb.last_run()
            if record is None:
                continue
            usage = resource.getrusage(resource.RUSAGE_SELF)
            samples.append((usage.ru_utime + usage.ru_stime, len(record.ranks[0].metrics.get("loss", []))))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        value = call()
    finally:
        stop.set()
        sampler.join()
    final = len(ddpnb.last_run().ranks[0].metrics["loss"])
    # samples of this run while its steps were going: after the first step was seen, before the last
    steady = [(cpu, n) for cpu, n in samples if 0 < n < final]
    if len(steady) < 2 or steady[-1][1] == steady[0][1]:
        raise RuntimeError("the run was too short to sample the kernel's CPU while it trained: give it more steps")
    (cpu_a, n_a), (cpu_b, n_b) = steady[0], steady[-1]
    return value, (cpu_b - cpu_a) / (n_b - n_a)


# --- streaming ------------------------------------------------------------------------------------------------
def _busy_view(seconds: float) -> Any:
    """A badly behaved view: each redraw burns `seconds` of Python CPU time while holding the GIL."""

    def redraw() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    return redraw


def probe_stream(args: argparse.Namespace) -> None:
    import ddpnb

    by_value()
    ddpnb.run(_workloads.trivial, nprocs=2)  # start the forkserver first: this measures streaming, not start-up
    sys.stdout.flush()
    launched = time.time()
    # "none": no view at all; "text" and "widget": ddpnb's own views; "slow": a bad view that hogs the GIL
    view = args.view if args.view in ("text", "widget") else "none"
    run = ddpnb.launch(_workloads.stream, nprocs=args.ranks, args=(args.lines, args.rate), view=view)
    if args.view == "slow":
        run.subscribe(_busy_view(0.05))
    value = run.result()
    returned = time.time()
    record = run.record
    per_rank_record = [r.lines for r in record.ranks]
    per_rank_file, missing = [], []
    for rank in range(args.ranks):
        seen = bytearray(args.lines)
        count = 0
        prefix = f"rank {rank} line "
        with open(record.ranks[rank].log_path, encoding="utf-8", errors="replace") as log:
            for line in log:
                if line.startswith(prefix):
                    count += 1
                    seen[int(line[len(prefix) :])] = 1
        per_rank_file.append(count)
        missing.append(args.lines - sum(seen))
    ended = record.ended or returned
    printing_ended = max(r["ended"] for r in value["ranks"])
    total = args.ranks * args.lines
    emit(
        {
            "lines": total,
            "launched": launched,
            "started": value["started"],
            "ended": ended,
            "kernel_lines_per_s": total / (ended - value["started"]),
            "worker_lines_per_s": total / (printing_ended - value["started"]),
            "record_lines": per_rank_record,
            "file_lines": per_rank_file,
            "missing_indices": missing,
            "worst_stall_s": max(r["worst_stall_s"] for r in value["ranks"]),
            "stalls_over_5ms": sum(r["stalls_over_5ms"] for r in value["ranks"]),
            "blocked_writes": sum(r["blocked_writes"] for r in value["ranks"]),
            "worst_blocked_s": max(r["worst_blocked_s"] for r in value["ranks"]),
        }
    )


# --- large results --------------------------------------------------------------------------------------------
class PeakRss:
    """Samples this process's resident memory every few milliseconds; `peak` is the highest seen."""

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self.process = psutil.Process()
        self.interval = interval
        self.peak = self.process.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.wait(self.interval):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return max(self.peak, self.process.memory_info().rss)


def _queue_target(rank: int, nbytes: int, results: Any, taken: Any) -> None:
    """torch.multiprocessing.spawn's way back for a value: a queue. torch's reductions move the tensors to shared
    memory and send file descriptors; rank 0 must stay alive until the kernel has taken them."""
    state = _workloads.big_result(rank, 2, nbytes)
    if rank == 0:
        results.put(state)
        taken.wait(300)


def probe_result(args: argparse.Namespace) -> None:
    import gc
    import resource

    import torch

    import ddpnb

    by_value()
    ddpnb.run(_workloads.trivial, nprocs=2)  # warm: this measures the transfer, not start-up
    gc.collect()
    baseline = PeakRss().close()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sampler = PeakRss()
    if args.via == "mp-queue":
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        results, taken = context.SimpleQueue(), context.Event()
        workers = mp.spawn(_queue_target, args=(args.bytes, results, taken), nprocs=2, join=False)
        state = results.get()
        arrived = time.time()
        taken.set()
        workers.join()
    else:
        state = ddpnb.run(_workloads.big_result, nprocs=2, args=(args.bytes,), view="none")
        arrived = time.time()
    returned_at = state.pop("_returned_at")
    checksum = sum(float(t.sum()) for t in state.values())  # touch every page, so the RSS shows all of it
    peak = sampler.close()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    emit(
        {
            "bytes": nbytes,
            "seconds": arrived - returned_at,
            "gb_per_s": nbytes / 1e9 / (arrived - returned_at),
            "baseline_rss": baseline,
            "peak_rss": peak,
            "peak_over_size": (peak - baseline) / nbytes,
            "maxrss_over_size": (maxrss - baseline) / nbytes if maxrss > maxrss_before else None,
            "checksum": checksum,
            "torch": torch.__version__,
        }
    )


def _pipe_sender(conn: Any, nbytes: int) -> None:
    conn.send_bytes(bytes(nbytes))
    conn.close()


def probe_result_steps(args: argparse.Namespace) -> None:
    """Each step of a result sent as a pickle through a pipe, timed alone on the same state dict; then the
    prototype's two steps."""
    import io
    import multiprocessing
    import pickle

    import cloudpickle
    import torch

    state = _workloads.big_result(0, 1, args.bytes)
    steps: dict[str, float] = {}
    clock = time.perf_counter

    started = clock()
    buffer = io.BytesIO()
    cloudpickle.CloudPickler(buffer, protocol=5).dump(state)
    payload = buffer.getvalue()
    steps["rank 0: cloudpickle the value"] = clock() - started

    started = clock()
    message = pickle.dumps(("Returned", payload), protocol=5)
    steps["rank 0: pickle the message holding it"] = clock() - started
    del buffer, payload

    receiver, sender = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_pipe_sender, args=(sender, len(message)))
    child.start()
    sender.close()
    started = clock()
    receiver.recv_bytes()
    steps["pipe: send_bytes → recv_bytes"] = clock() - started
    child.join()

    started = clock()
    unpacked = pickle.loads(message)
    steps["kernel: unpickle the message"] = clock() - started
    del message

    started = clock()
    pickle.loads(unpacked[1])
    steps["kernel: unpickle the value"] = clock() - started
    del unpacked

    from ddpnb.core import pickling as _pickling

    fd = os.memfd_create("ddpnb-bench-result")
    started = clock()
    _pickling.save(state, fd)
    steps["ddpnb, rank 0: torch.save into a memory file"] = clock() - started
    started = clock()
    mapped = _pickling.load(fd)
    steps["ddpnb, kernel: torch.load(mmap=True)"] = clock() - started
    os.close(fd)
    started = clock()
    sum(float(t.sum()) for t in mapped.values() if isinstance(t, torch.Tensor))
    steps["ddpnb, kernel: first read of every mapped page"] = clock() - started
    emit({"bytes": args.bytes, "steps": steps})


# --- notebook data into the ranks -------------------------------------------------------------------------------
def _pss() -> int:
    """This process's proportional set size in bytes (shared pages split between the processes mapping them)."""
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))


def _closing_over(data: Any) -> Any:
    """A notebook cell's function closing over `data`: the trivial workload, plus one read of the data."""

    def train(rank: int, world_size: int) -> dict[str, Any]:
        value = _workloads.trivial()
        return {**value, "first": float(data[0])}

    return train


def _ranks_pss(data: Any) -> Any:
    """Every rank reads every page of `data`, then all report their PSS at the same moment."""

    def train(rank: int, world_size: int) -> int:
        import torch.distributed as dist

        if data is not None:
            float(data.sum())
        dist.barrier()
        pss = _pss()
        dist.barrier()
        every: list[Any] = [None] * world_size
        dist.all_gather_object(every, pss)
        return sum(every)

    return train


def _spawn_data_target(rank: int, world_size: int, data: Any, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world_size))
    value = _workloads.trivial()
    first = float(data[0])
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({**value, "first": first}))


def probe_data(args: argparse.Namespace) -> None:
    """One launcher sending a `--bytes` float32 tensor to 2 CPU ranks, in a fresh process playing the kernel."""
    import gc

    import torch

    data = torch.ones(args.bytes // 4)  # the notebook's data, resident before the clock starts
    clock = time.perf_counter
    if args.via == "mp-spawn":
        import torch.multiprocessing as mp

        out = _result_file()
        os.environ["MASTER_PORT"] = str(free_port())
        sampler = PeakRss()
        baseline = sampler.peak
        started = clock()
        mp.spawn(_spawn_data_target, args=(2, data, out), nprocs=2, join=True)
        seconds = clock() - started
        emit(
            {
                "first": seconds,
                "peak_over_data": (sampler.close() - baseline) / args.bytes,
                "value": json.loads(Path(out).read_text())["first"],
            }
        )
        os.unlink(out)
        return

    import ddpnb
    from ddpnb.node import shared

    if args.via == "pickle":  # ddpnb as it was before issue 16: every rank unpickles its own copy
        shared.MIN_BYTES = 1 << 62  # the local engine's threshold for what goes into memory files
    by_value()
    ddpnb.run(_workloads.trivial, nprocs=2, view="none")  # warm: the forkserver is up, as in a notebook's 2nd cell
    started = clock()
    copy = data.clone()
    clone = clock() - started
    del copy
    gc.collect()
    train = _closing_over(data)
    sampler = PeakRss()
    baseline = sampler.peak
    started = clock()
    ddpnb.run(train, nprocs=2, view="none")
    first = clock() - started
    peak = sampler.close() - baseline
    sent = ddpnb.last_run().data
    trivial, later = [], []
    for _ in range(args.repeat):  # alternating, so that load from elsewhere hits both alike
        for function, times in ((_workloads.trivial, trivial), (train, later)):
            started = clock()
            ddpnb.run(function, nprocs=2, view="none")
            times.append(clock() - started)
    reused = ddpnb.last_run().data.reused if sent else 0  # the last launch was `train` again
    held = sum(
        os.fstat(int(fd)).st_size
        for fd in os.listdir("/proc/self/fd")
        if "ddpnb-data" in _readlink(f"/proc/self/fd/{fd}")
    )
    pss_data = ddpnb.run(_ranks_pss(data), nprocs=2, view="none")
    pss_none = ddpnb.run(_ranks_pss(None), nprocs=2, view="none")
    emit(
        {
            "trivial": trivial,
            "clone": clone,
            "first": first,
            "later": later,
            "peak_over_data": peak / args.bytes,
            "shm_over_data": held / args.bytes,
            "ranks_pss_over_data": (pss_data - pss_none) / args.bytes,
            "written": sent.written if sent else 0,
            "reused_later": reused,
        }
    )


# --- checkpoints -----------------------------------------------------------------------------------------------
def probe_checkpoint(args: argparse.Namespace) -> None:
    """Synchronous and asynchronous `ddpnb.save_checkpoint` of a `--bytes` DDP model on 2 CPU ranks."""
    import ddpnb

    by_value()
    with tempfile.TemporaryDirectory(prefix="ddpnb-bench-ckpt-") as where:
        emit(
            ddpnb.run(
                _workloads.checkpoints,
                nprocs=2,
                view="none",
                checkpoint_dir=where,
                keep_checkpoints=2,
                args=(args.bytes, args.saves),
            )
        )


# --- profiling (issue 30) ------------------------------------------------------------------------------------
def probe_profile(args: argparse.Namespace) -> None:
    """The training workload on `--ranks` CPU ranks with --profile over 3 steps after its warm-up: the kernel's
    time to merge the traces and break the steps down, the files' sizes, and what opening and closing the
    profile cost rank 0's steps (from the times of its ddpnb.log calls)."""
    import gzip
    import statistics

    import ddpnb

    by_value()
    first = _workloads.TRAIN_WARMUP_STEPS + 1
    ddpnb.run(
        _workloads.train,
        nprocs=args.ranks,
        view="none",
        args=(args.steps, True),
        timeout=900,
        profile=f"{first}-{first + 2}",
    )
    record = ddpnb.last_run()
    profile = record.profile
    times = [point.time for point in record.metrics("loss", rank=0)]
    step = {s: later - earlier for s, (earlier, later) in enumerate(itertools.pairwise(times), start=1)}
    plain = statistics.median(seconds for s, seconds in step.items() if s < first - 1 or s > first + 3)
    with gzip.open(profile.trace, "rb") as file:
        events = len(json.load(file)["traceEvents"])
    emit(
        {
            "ranks": len(profile.ranks),
            "merge_seconds": profile.merge_seconds,
            "merged_bytes": profile.size,
            "rank_bytes": sum(path.stat().st_size for path in profile.rank_traces.values()),
            "events": events,
            "plain_step": plain,
            "profiled_step": statistics.median(step[s] for s in range(first, first + 3)),
            "open_cost": step[first] - plain,
            "close_cost": step[first + 3] - plain,
            "notes": profile.notes,
        }
    )


# --- the slurm engine (issue 27) ---------------------------------------------------------------------------------
def probe_slurm(args: argparse.Namespace) -> None:
    """A kernel inside a Slurm allocation (SLURM_JOB_ID set): `--engine slurm` launches of the trivial workload on
    2 ranks over 2 nodes, first and later, interleaved with the local engine's launches in the same process."""
    import torch  # noqa: F401 - the notebook imported torch

    import ddpnb

    by_value()

    def launch(engine: str) -> float:
        options: dict[str, Any] = {"engine": "slurm", "nodes": 2} if engine == "slurm" else {}
        started = time.perf_counter()
        value = ddpnb.run(_workloads.trivial, nprocs=2, view="none", **options)
        elapsed = time.perf_counter() - started
        assert value["sum"] == 2.0, value
        return elapsed

    first = {engine: launch(engine) for engine in ("slurm", "local")}
    later: dict[str, list[float]] = {"slurm": [], "local": []}
    for _ in range(args.warm):
        for engine, times in later.items():
            times.append(launch(engine))
    emit({"first": first, "later": later, **(_slurm_data(args.data_bytes) if args.data_bytes else {})})


def _slurm_data(nbytes: int) -> dict[str, Any]:
    """Notebook data on Slurm: 4 ranks on 2 nodes, a function closing over `nbytes` (first launch: written into the
    kernel's memory files and sent; later: unchanged, only sent), against the same function over a small tensor;
    and the floor: the same bytes sent once to each of 2 receiving processes over loopback TCP, in parallel, each
    receiving into a memory file, as a node's host does."""
    import torch

    import ddpnb

    def timed(value: Any) -> float:
        def reads(rank: int) -> float:
            return float(value[-1])

        started = time.perf_counter()
        assert ddpnb.run(reads, nprocs=4, engine="slurm", nodes=2, view="none") == 1.0
        return time.perf_counter() - started

    small = torch.ones(4)
    big = torch.ones(nbytes // 4, dtype=torch.float32)
    bare = [timed(small) for _ in range(2)]
    first = timed(big)
    later = [timed(big) for _ in range(2)]
    floor = [_send_to_two(memoryview(big.numpy()).cast("B")) for _ in range(2)]
    session = ddpnb.session(engine="slurm", nprocs=4, nodes=2)  # ranks up: no import beside the data
    try:
        pushes = []
        for value in (big, big):  # a new tensor, then the same one unchanged (reused in the kernel)
            started = time.perf_counter()
            session.push(pushed=value)
            pushes.append(time.perf_counter() - started)
            assert session.execute("float(pushed[-1])") == [1.0] * 4
    finally:
        session.stop()
    return {
        "data": {
            "bytes": big.nbytes,
            "bare": min(bare),
            "first": first,
            "later": min(later),
            "floor": min(floor),
            "push": pushes[0],
            "push_again": pushes[1],
        }
    }


def _send_to_two(data: memoryview) -> float:
    """Seconds to send `data` to two receivers (forked processes) at once, over loopback TCP."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    children = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # a receiver: into a memory file, as a host receives notebook data
            with socket.create_connection(("127.0.0.1", port)) as conn:
                fd = os.memfd_create("floor")
                os.ftruncate(fd, len(data))
                buffer, got = memoryview(bytearray(16 << 20)), 0  # as `wire.receive_data`: the fastest way here
                while got < len(data):
                    read = conn.recv_into(buffer[: min(len(buffer), len(data) - got)])
                    written = 0
                    while written < read:
                        written += os.pwrite(fd, buffer[written:read], got + written)
                    got += read
                conn.sendall(b"k")
            os._exit(0)
        children.append(pid)
    conns = [listener.accept()[0] for _ in children]
    started = time.perf_counter()
    senders = [threading.Thread(target=conn.sendall, args=(data,)) for conn in conns]
    for sender in senders:
        sender.start()
    for sender, conn in zip(senders, conns):
        sender.join()
        conn.recv(1)
    elapsed = time.perf_counter() - started
    for conn in conns:
        conn.close()
    listener.close()
    for pid in children:
        os.waitpid(pid, 0)
    return elapsed


def probe_ray(args: argparse.Namespace) -> None:
    """A kernel's launches and sessions on Ray (the local Ray instance ddpnb starts, or `--address`), 2 CPU ranks,
    interleaved with the local engine's in the same process: first and later launches of the trivial workload,
    a session's start and its round trip (`s.execute("x = x + 1")`)."""
    import torch  # noqa: F401 - the notebook imported torch

    import ddpnb

    by_value()
    ray_options: dict[str, Any] = {
        "engine": "ray",
        **({"address": args.address} if args.address else {}),
        **({"placement": args.placement} if args.placement else {}),
    }
    options = {"ray": ray_options, "local": {}}
    pids: list[int] = []

    def launch(engine: str) -> float:
        started = time.perf_counter()
        value = ddpnb.run(_workloads.trivial, nprocs=2, view="none", **options[engine])
        elapsed = time.perf_counter() - started
        assert value["sum"] == 2.0, value
        if engine == "ray":
            pids.append(value["pid"])
        return elapsed

    first = {engine: launch(engine) for engine in options}
    later: dict[str, list[float]] = {engine: [] for engine in options}
    for _ in range(args.warm):
        for engine, times in later.items():
            times.append(launch(engine))
    start: dict[str, list[float]] = {engine: [] for engine in options}
    round_trip: dict[str, list[float]] = {engine: [] for engine in options}
    for _ in range(args.sessions):
        for engine, chosen in options.items():
            began = time.perf_counter()
            session = ddpnb.session(nprocs=2, **chosen)
            try:
                start[engine].append(time.perf_counter() - began)
                session.execute("x = 0")
                for index in range(args.warmup + args.cells):
                    began = time.perf_counter()
                    session.execute("x = x + 1")
                    if index >= args.warmup:
                        round_trip[engine].append(time.perf_counter() - began)
            finally:
                session.stop()
    emit(
        {
            "first": first,
            "later": later,
            "session_start": start,
            "round_trip": round_trip,
            "fresh_pids": len(set(pids)) == len(pids),
        }
    )


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="probe", required=True)
    p = sub.add_parser("ddpnb")
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--shell-warm", type=int, default=0)
    p.add_argument("--matmul", action="store_true")
    p.add_argument(
        "--torchvision",
        type=int,
        default=0,
        help="runs of a function importing torchvision, before and after ddpnb.preload('torchvision')",
    )
    p = sub.add_parser("mp-spawn")
    p.add_argument("--repeat", type=int, default=1)
    p = sub.add_parser("accelerate")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--matmul", action="store_true")
    p = sub.add_parser("nbdistributed")
    p.add_argument("--warm", type=int, default=3)
    p.add_argument(
        "--cell",
        choices=sorted(NBD_CELLS),
        default="allreduce",
        help="allreduce: an all_reduce and a print (the launch table); trivial: x = 1",
    )
    p = sub.add_parser("session")
    p.add_argument("--cells", type=int, default=200, help="timed cells of each kind")
    p.add_argument("--warmup", type=int, default=20, help="untimed cells of each kind first")
    p.add_argument("--restarts", type=int, default=5, help="restarts, each paired with a later launch")
    p = sub.add_parser("ray")
    p.add_argument("--warm", type=int, default=5, help="later launches of each engine")
    p.add_argument("--data-bytes", type=int, default=0, help="also: notebook data of this size on 4 ranks")
    p.add_argument("--sessions", type=int, default=2, help="sessions of each engine")
    p.add_argument("--cells", type=int, default=20, help="timed round trips per session")
    p.add_argument("--warmup", type=int, default=5, help="untimed round trips first")
    p.add_argument("--address", default="", help="a Ray cluster's address (default: a local Ray instance)")
    p.add_argument("--placement", default="", help="pack or spread")
    p = sub.add_parser("ipyparallel")
    p.add_argument("--cells", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--pids-file", required=True, help="where the controller's and engines' PIDs go")
    p.add_argument("--profile-dir", required=True, help="an IPython profile directory of the probe's own")
    p = sub.add_parser("train-ddpnb")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--quiet", action="store_true", help="no ddpnb.log, no print: what the launcher alone costs")
    p = sub.add_parser("stream")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--lines", type=int, required=True)
    p.add_argument("--view", choices=["none", "text", "widget", "slow"], default="none")
    p.add_argument("--rate", type=float, default=0.0, help="lines/s per rank (0: as fast as print goes)")
    p = sub.add_parser("result")
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--via", choices=["ddpnb", "mp-queue"], default="ddpnb")
    p = sub.add_parser("data")
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--via", choices=["ddpnb", "pickle", "mp-spawn"], default="ddpnb")
    p.add_argument("--repeat", type=int, default=4)
    p = sub.add_parser("checkpoint")
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--saves", type=int, default=3)
    p = sub.add_parser("slurm")
    p.add_argument("--warm", type=int, default=5, help="later launches of each engine")
    p.add_argument("--data-bytes", type=int, default=0, help="also: notebook data of this size on 4 ranks")
    p = sub.add_parser("profile")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="steps after the warm-up (3 of them profiled)")
    p = sub.add_parser("result-steps")
    p.add_argument("--bytes", type=int, required=True)
    args = parser.parse_args()
    probe = {
        "ddpnb": probe_ddpnb,
        "mp-spawn": probe_mp_spawn,
        "accelerate": probe_accelerate,
        "nbdistributed": probe_nbdistributed,
        "session": probe_session,
        "ipyparallel": probe_ipyparallel,
        "train-ddpnb": probe_train_ddpnb,
        "stream": probe_stream,
        "result": probe_result,
        "result-steps": probe_result_steps,
        "data": probe_data,
        "checkpoint": probe_checkpoint,
        "slurm": probe_slurm,
        "ray": probe_ray,
        "profile": probe_profile,
    }[args.probe]
    probe(args)


if __name__ == "__main__":
    main()
