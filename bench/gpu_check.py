"""The GPU check (issue 5, goal 5); run through bench/gpu_check.sh, which prepares the environment.

One rank over NCCL (the H200 box has one GPU), the same training function three ways, in one run:
  plain   a plain script under torchrun (`--nproc_per_node 1`)
  run     `ddpnb.run(train, gpus=1)` from a Python process
  kernel  `%%ddp --gpus 1` in a real Jupyter kernel, driven by nbclient
on ResNet-18 (batch 512, 32 px) and ResNet-50 (batch 256, 224 px), bf16 autocast, channels_last, synthetic data;
throughput ratios to the plain script. Then launch latency there: a 1-rank NCCL launch through ddpnb against
its bound (CUDA context + NCCL init + one all_reduce in a process that has imported torch), and 2 CPU ranks
against the floor of 2 concurrent `import torch`.

Last, `ddpnb.preload` there: torchvision must pass its check (and a launch of a function using it get faster), a
module that initialises CUDA when imported must be refused, and a GPU run must work after both.

`--dry-run` does all of it on CPU with tiny models, gloo and `-n 1`, to check the plumbing without a GPU.
Only the standard library at module level: torchrun's worker imports this file.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
MARKER = "@@GPU "

# The training function, as source: the plain script and ddpnb.run exec it, the kernel gets it in a %%ddp cell,
# so all three run the very same code. `ddpnb.log` does nothing outside a ddpnb worker.
TRAIN_SOURCE = """
def train(rank, world_size, config):
    import os
    import time

    import torch
    import torch.distributed as dist
    import torchvision
    from torch.nn.parallel import DistributedDataParallel

    import ddpnb

    cuda = config["device"] == "cuda"
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # dry run: the same in every mode (ddpnb, torchrun and torch choose differently)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    barrier = {"device_ids": [device.index]} if cuda else {}
    throughput = {}
    for spec in config["models"]:
        torch.manual_seed(0)
        model = getattr(torchvision.models, spec["name"])(num_classes=1000)
        model = model.to(device, memory_format=torch.channels_last)
        ddp_model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        images = torch.randn(spec["batch"], 3, spec["size"], spec["size"], device=device)
        images = images.contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (spec["batch"],), device=device)

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(ddp_model(images), labels)
            loss.backward()
            optimizer.step()
            return loss

        for _ in range(spec["warmup"]):
            step()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(**barrier)
        started = time.perf_counter()
        for i in range(spec["steps"]):
            loss = step()
            if i % config["log_every"] == 0:
                ddpnb.log(step=i, loss=loss.item())
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        throughput[spec["name"]] = spec["steps"] * spec["batch"] * world_size / elapsed
        del ddp_model, model, optimizer, images, labels
        if cuda:
            torch.cuda.empty_cache()
    return throughput
"""

GPU_CONFIG = {
    "device": "cuda",
    "log_every": 20,
    "models": [
        {"name": "resnet18", "batch": 512, "size": 32, "warmup": 30, "steps": 400},
        {"name": "resnet50", "batch": 256, "size": 224, "warmup": 20, "steps": 100},
    ],
}
DRY_CONFIG = {
    "device": "cpu",
    "log_every": 1,
    "models": [
        {"name": "resnet18", "batch": 8, "size": 32, "warmup": 1, "steps": 3},
        {"name": "resnet50", "batch": 2, "size": 64, "warmup": 1, "steps": 2},
    ],
}
REFERENCE = {"resnet18": 45_600, "resnet50": 4_600}  # img/s, a plain script on the H200 box (issue 5)


def emit(data: Any) -> None:
    sys.stdout.flush()
    print(MARKER + json.dumps(data), flush=True)


def parse(output: str) -> Any:
    for line in reversed(output.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    raise RuntimeError(f"no result in the output:\n{output[-3000:]}")


def train_function() -> Any:
    """`train`, defined the way a notebook defines it (in `__main__`), so ddpnb sends it by value."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(TRAIN_SOURCE, "<train>", "exec"), namespace)  # noqa: S102 - our own source, above
    return namespace["train"]


def sh(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {done.returncode}:\n{(done.stderr or done.stdout)[-3000:]}")
    return done.stdout


def me(*args: str) -> list[str]:
    return [sys.executable, str(HERE), *args]


# --- the three ways to train ------------------------------------------------------------------------------------
def cmd_plain_train(args: argparse.Namespace) -> None:
    """Inside torchrun: one rank runs `train` as a plain script would."""
    config = json.loads(args.config)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    value = train_function()(rank, world_size, config)
    import torch.distributed as dist

    dist.destroy_process_group()
    if rank == 0:
        emit(value)


def cmd_run_train(args: argparse.Namespace) -> None:
    """From Python: ddpnb.run(train, gpus=1)."""
    import ddpnb

    config = json.loads(args.config)
    placement = {"gpus": 1} if config["device"] == "cuda" else {"nprocs": 1}
    emit(ddpnb.run(train_function(), args=(config,), **placement))


def plain(config: dict[str, Any], timeout: float) -> dict[str, float]:
    out = sh(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            str(HERE),
            "plain-train",
            "--config",
            json.dumps(config),
        ],
        timeout,
    )
    return parse(out)


def through_run(config: dict[str, Any], timeout: float) -> dict[str, float]:
    return parse(sh(me("run-train", "--config", json.dumps(config)), timeout))


def through_kernel(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """`%%ddp --gpus 1` in a real ipykernel, executed by nbclient; returns the throughput and the kernel's CUDA state."""
    import nbformat
    from nbclient import NotebookClient

    flags = "--gpus 1" if config["device"] == "cuda" else "-n 1"
    cell = (
        f"%%ddp {flags} -o throughput\n{TRAIN_SOURCE}\nCONFIG = {config!r}\n\n\n"
        "def notebook_train(rank, world_size):\n    return train(rank, world_size, CONFIG)\n"
    )
    report = (
        "import json, sys\n"
        "torch = sys.modules.get('torch')\n"
        "cuda_in_kernel = bool(torch is not None and torch.cuda.is_initialized())\n"
        f"print({MARKER!r} + json.dumps({{'throughput': throughput, 'kernel_cuda_initialised': cuda_in_kernel}}))\n"
    )
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("%load_ext ddpnb"),
            nbformat.v4.new_code_cell(cell),
            nbformat.v4.new_code_cell(report),
        ]
    )
    client = NotebookClient(
        notebook, timeout=int(timeout), kernel_name="python3", resources={"metadata": {"path": str(HERE.parent.parent)}}
    )
    client.execute()
    text = "".join(
        output.get("text", "") for output in notebook.cells[2].outputs if output.get("output_type") == "stream"
    )
    return parse(text)


MODES = ("plain", "run", "kernel")


def bench_training(config: dict[str, Any], repeats: int, timeout: float) -> dict[str, Any]:
    """`repeats` rounds of the three modes, the order rotated each round (3 rounds: each mode once in each
    place), so that a GPU warming up or clocking down over the rounds does not favour one mode. A mode that
    fails is reported and not tried again; the others go on."""
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    errors: dict[str, str] = {}
    kernel_cuda = []
    for r in range(repeats):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            if mode in errors:
                continue
            log(f"training, round {r + 1}/{repeats}: {mode}")
            started = time.monotonic()
            try:
                if mode == "plain":
                    runs[mode].append(plain(config, timeout))
                elif mode == "run":
                    runs[mode].append(through_run(config, timeout))
                else:
                    result = through_kernel(config, timeout)
                    runs[mode].append(result["throughput"])
                    kernel_cuda.append(result["kernel_cuda_initialised"])
            except Exception as exc:  # noqa: BLE001 - reported in the table; the other modes still run
                errors[mode] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
                log(f"  {mode} failed: {errors[mode]}")
                continue
            log(f"  {runs[mode][-1]} ({time.monotonic() - started:.0f} s)")
    summary = {}
    for spec in config["models"]:
        name = spec["name"]
        done = [mode for mode in MODES if runs[mode]]
        medians = {mode: statistics.median(run[name] for run in runs[mode]) for mode in done}
        spread = {mode: (min(run[name] for run in runs[mode]), max(run[name] for run in runs[mode])) for mode in done}
        ratios = {
            f"ratio_{mode}": medians[mode] / medians["plain"] if "plain" in medians and mode in medians else None
            for mode in ("run", "kernel")
        }
        summary[name] = {"img_per_s": medians, "spread": spread, **ratios}
    return {
        "raw": runs,
        "errors": errors,
        "summary": summary,
        "kernel_cuda_initialised": any(kernel_cuda) if kernel_cuda else None,
    }


# --- launch latency ---------------------------------------------------------------------------------------------
def cmd_bound(args: argparse.Namespace) -> None:
    """In a process that has imported torch: CUDA context + NCCL init + one all_reduce, the floor of a GPU launch."""
    import torch
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cuda = not args.dry_run
    started = time.perf_counter()
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    value = torch.ones(1, device="cuda" if cuda else "cpu")
    dist.all_reduce(value)
    value.item()
    elapsed = time.perf_counter() - started
    dist.destroy_process_group()
    emit({"seconds": elapsed})


def _trivial(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    # the backend says where the rank is: asking torch.cuda.is_available() would start the CUDA driver in CPU
    # ranks too, and time that as part of their launch
    value = torch.ones(1, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(value)
    return value.item()


def cmd_latency(args: argparse.Namespace) -> None:
    """ddpnb: the cold first run (starts the forkserver), then warm runs on 2 CPU ranks and on 1 GPU."""
    import ddpnb

    gpu = {"nprocs": 1} if args.dry_run else {"gpus": 1}
    started = time.perf_counter()
    ddpnb.run(_trivial, nprocs=2)
    cold = time.perf_counter() - started
    ddpnb.run(_trivial, **gpu)  # untimed: the first GPU launch also imports torch here, to count the GPUs
    timings: dict[str, list[float]] = {"cpu_warm": [], "gpu_warm": []}
    for _ in range(args.warm):
        for key, placement in (("cpu_warm", {"nprocs": 2}), ("gpu_warm", gpu)):
            started = time.perf_counter()
            ddpnb.run(_trivial, **placement)
            timings[key].append(time.perf_counter() - started)
    emit({"cold": cold, **timings})


def bench_latency(dry_run: bool, warm: int, repeats: int) -> dict[str, Any]:
    flag = ["--dry-run"] if dry_run else []
    floors, bounds, colds, cpu_warm, gpu_warm = [], [], [], [], []
    for r in range(repeats):
        log(f"launch latency, round {r + 1}/{repeats}")
        started = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", "import torch"]) for _ in range(2)]
        for proc in procs:
            proc.wait()
        floors.append(time.perf_counter() - started)
        bounds.append(parse(sh(me("bound", *flag), 300))["seconds"])
        data = parse(sh(me("latency", f"--warm={warm}", *flag), 300))
        colds.append(data["cold"])
        cpu_warm += data["cpu_warm"]
        gpu_warm += data["gpu_warm"]
    floor, bound = statistics.median(floors), statistics.median(bounds)
    return {
        "floor_2x_import_torch": floor,
        "cold_first_run": colds and statistics.median(colds),
        "cpu_warm": statistics.median(cpu_warm),
        "gpu_warm": statistics.median(gpu_warm),
        "gpu_bound": bound,
        "ratio_cold_to_floor": statistics.median(colds) / floor,
        "ratio_cpu_warm_to_floor": statistics.median(cpu_warm) / floor,
        "ratio_gpu_warm_to_bound": statistics.median(gpu_warm) / bound,
        "raw": {"floor": floors, "bound": bounds, "cold": colds, "cpu_warm": cpu_warm, "gpu_warm": gpu_warm},
    }


# --- preload ----------------------------------------------------------------------------------------------------
CUDA_AT_IMPORT = "import torch\ntorch.cuda.init()  # what ddpnb.preload must refuse: forked ranks could not use CUDA\n"


def _with_torchvision(rank: int, world_size: int) -> float:
    import torchvision  # noqa: F401 - the library the forkserver lacks until ddpnb.preload

    return _trivial(rank, world_size)


def _parameters_back(rank: int, world_size: int) -> dict[str, Any]:
    """A run after preload returns what a GPU rank's model holds: a Parameter and a tensor that requires grad,
    on the rank's device; in the kernel they must be on the CPU and of the same kinds as a CPU run returns."""
    import torch

    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    weight = torch.nn.Parameter(torch.ones(2, device=device))
    return {"sum": _trivial(rank, world_size), "weight": weight, "doubled": weight * 2}


def _describe(value: dict[str, Any]) -> dict[str, Any]:
    return {
        "sum": value["sum"],
        **{
            name: f"{type(value[name]).__name__} on {value[name].device}, requires_grad={value[name].requires_grad}"
            for name in ("weight", "doubled")
        },
    }


def cmd_preload(args: argparse.Namespace) -> None:
    """A launch that imports torchvision, before and after ddpnb.preload('torchvision'); then a module that
    initialises CUDA at import, which preload must refuse; then a GPU launch, which must still work."""
    import ddpnb

    modules = tempfile.mkdtemp(prefix="ddpnb-gpu-preload-")
    Path(modules, "ddpnb_cuda_at_import.py").write_text(CUDA_AT_IMPORT)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [modules, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, modules)
    gpu = {"nprocs": 1} if args.dry_run else {"gpus": 1}
    ddpnb.run(_trivial, **gpu)  # the forkserver is up
    before, after, took, error = [], [], None, ""
    for timings in (before, after):
        if timings is after:
            started = time.perf_counter()
            try:
                ddpnb.preload("torchvision")
            except ddpnb.PreloadError as exc:  # reported, not fatal: the rest still tells something
                error = str(exc)
            took = time.perf_counter() - started
        for _ in range(max(1, args.warm)):
            started = time.perf_counter()
            ddpnb.run(_with_torchvision, **gpu)
            timings.append(time.perf_counter() - started)
    try:
        ddpnb.preload("ddpnb_cuda_at_import")
        refused = ""
    except ddpnb.PreloadError as exc:
        refused = str(exc)
    value = _describe(ddpnb.run(_parameters_back, **gpu))
    emit(
        {
            "before": before,
            "after": after,
            "preload_seconds": took,
            "torchvision_error": error,
            "refused": refused,
            "run_after": value,
            "preloaded": ddpnb.preload(),
        }
    )


# --- report -----------------------------------------------------------------------------------------------------
def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


def device_name(dry_run: bool) -> str:
    if dry_run:
        return "CPU (dry run)"
    probe = "import torch; print(torch.cuda.get_device_name(0), torch.__version__, torch.cuda.nccl.version())"
    out = sh([sys.executable, "-c", probe], 120)
    return out.strip()


def report(results: dict[str, Any], dry_run: bool) -> str:
    """The tables, for whatever sections have finished; a section that failed says so and how."""
    lines = [results["header"], ""]
    training = results.get("training")
    if training is None:
        lines.append("Training: not run.")
    elif "error" in training:
        lines.append(f"Training: **failed**: {training['error']}")
    else:
        columns = [
            "model",
            "plain script img/s",
            "ddpnb.run img/s",
            "%%ddp (kernel) img/s",
            "run ÷ plain",
            "%%ddp ÷ plain",
            "goal",
            "reference plain",
        ]
        lines += ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
        for name, row in training["summary"].items():
            ips, spread = row["img_per_s"], row["spread"]
            cells = [
                f"{ips[mode]:,.0f} ({spread[mode][0]:,.0f}–{spread[mode][1]:,.0f})" if mode in ips else "failed"
                for mode in MODES
            ]
            ratios = [row["ratio_run"], row["ratio_kernel"]]
            met = "**missed**" if None in ratios or min(ratios) < 0.99 else "met"
            shown = " | ".join("—" if ratio is None else f"{ratio:.3f}" for ratio in ratios)
            lines.append(f"| {name} | {' | '.join(cells)} | {shown} | ≥ 0.99: {met} | {REFERENCE[name]:,} |")
        rounds = max(len(runs) for runs in training["raw"].values())
        lines += [
            "",
            f"img/s: median (min–max) of {rounds} rounds, the modes' order rotated each round.",
            "CUDA initialised in the kernel after %%ddp --gpus 1: "
            + {None: "not measured", True: "**True**", False: "False"}[training["kernel_cuda_initialised"]],
        ]
        lines += [f"**{mode} failed**: {error}" for mode, error in training["errors"].items()]
    latency = results.get("latency")
    lines.append("")
    if latency is None:
        lines.append("Launch latency: not run.")
    elif "error" in latency:
        lines.append(f"Launch latency: **failed**: {latency['error']}")
    else:
        rows = [
            ("floor: 2 concurrent `import torch`", latency["floor_2x_import_torch"], "1", ""),
            (
                "ddpnb first run, 2 CPU ranks (cold forkserver)",
                latency["cold_first_run"],
                f"{latency['ratio_cold_to_floor']:.3f} × floor",
                "≤ 1.1",
            ),
            (
                "ddpnb later runs, 2 CPU ranks gloo",
                latency["cpu_warm"],
                f"{latency['ratio_cpu_warm_to_floor']:.3f} × floor",
                "≤ 0.05",
            ),
            ("bound: CUDA context + NCCL init + all_reduce, 1 rank", latency["gpu_bound"], "1", ""),
            (
                "ddpnb later runs, 1 GPU rank NCCL",
                latency["gpu_warm"],
                f"{latency['ratio_gpu_warm_to_bound']:.3f} × bound",
                "≤ 1.2",
            ),
        ]
        lines += ["| launch | median | ratio | goal |", "|---|---|---|---|"]
        lines += [f"| {label} | {seconds:.3f} s | {ratio} | {goal} |" for label, seconds, ratio, goal in rows]
    lines += ["", preload_line(results["preload"], dry_run) if "preload" in results else "ddpnb.preload: not run."]
    if dry_run:
        lines += ["", "DRY RUN on CPU: the figures check the plumbing only."]
    return "\n".join(lines)


def preload_line(preload: dict[str, Any], dry_run: bool) -> str:
    if "error" in preload:
        return f"ddpnb.preload: **failed**: {preload['error']}"
    # on CPU the module's torch.cuda.init() raises, so it is refused for failing to import: only the GPU box
    # checks the refusal of a module that does initialise CUDA
    right = "died while importing them" if dry_run else "initialised CUDA"
    refused = "refused" if right in preload["refused"] else "**NOT refused as it should be**"
    back = preload["run_after"]
    kinds = (
        "as a CPU run returns them"
        if back["weight"] == "Parameter on cpu, requires_grad=True"
        and back["doubled"] == "Tensor on cpu, requires_grad=True"
        else "**not as a CPU run returns them**"
    )
    torchvision = (
        f"**refused**: {preload['torchvision_error']}"
        if preload["torchvision_error"]
        else f"took {preload['preload_seconds']:.1f} s"
    )
    return (
        f"ddpnb.preload, 1 {'CPU' if dry_run else 'GPU'} rank: a function importing torchvision launched in "
        f"{statistics.median(preload['before']):.3f} s; ddpnb.preload('torchvision') {torchvision}; then "
        f"{statistics.median(preload['after']):.3f} s. A module that initialises CUDA at import: {refused} "
        f"({preload['refused'] or 'no PreloadError'}). A run after both returned {preload['run_after']}: "
        f"{kinds}; preloaded: {preload['preloaded']}."
    )


def cmd_all(args: argparse.Namespace) -> None:
    """Each section in turn; one that fails is reported and the next still runs. The report is rewritten to
    $OUT after every section, so a run cut short (the device's time limit) keeps what it measured."""
    started = time.monotonic()
    os.environ.setdefault("DDPNB_VIEW", "text")  # the kernel has no widget front end here
    os.environ.setdefault("DDPNB_RUNS_DIR", tempfile.mkdtemp(prefix="ddpnb-gpu-check-"))
    config = DRY_CONFIG if args.dry_run else GPU_CONFIG
    flag = ["--dry-run"] if args.dry_run else []
    results: dict[str, Any] = {
        "header": (
            f"ddpnb GPU check{' (dry run)' if args.dry_run else ''}, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"{device_name(args.dry_run)}, Python {sys.version.split()[0]}"
        )
    }
    log(results["header"])
    sections = {
        "training": lambda: bench_training(config, args.repeats, timeout=600),
        "latency": lambda: bench_latency(args.dry_run, warm=args.warm, repeats=args.latency_repeats),
        "preload": lambda: parse(sh(me("preload", f"--warm={min(args.warm, 3)}", *flag), 300)),
    }
    failed = False
    for name, measure in sections.items():
        log(name)
        try:
            results[name] = measure()
        except Exception as exc:  # noqa: BLE001 - a section that fails is a result too; the others still run
            failed = True
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}
            log(f"{name} failed: {results[name]['error']}")
        text = report(results, args.dry_run) + f"\n\ntotal {time.monotonic() - started:.0f} s"
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_check.md").write_text(text + "\n")
            Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(text, flush=True)
    if failed or results["training"].get("errors"):
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    everything = sub.add_parser("all", help="the whole check (the default)")
    for p in (parser, everything):
        p.add_argument("--dry-run", action="store_true", help="CPU only, tiny models: checks the plumbing")
        p.add_argument("--repeats", type=int, default=3, help="training rounds (each: plain, run, kernel)")
        p.add_argument("--latency-repeats", type=int, default=3)
        p.add_argument("--warm", type=int, default=5, help="warm ddpnb launches per latency round")
    p = sub.add_parser("plain-train")
    p.add_argument("--config", required=True)
    p = sub.add_parser("run-train")
    p.add_argument("--config", required=True)
    p = sub.add_parser("bound")
    p.add_argument("--dry-run", action="store_true")
    for name in ("latency", "preload"):
        p = sub.add_parser(name)
        p.add_argument("--dry-run", action="store_true")
        p.add_argument("--warm", type=int, default=5)
    args = parser.parse_args()
    commands = {
        "plain-train": cmd_plain_train,
        "run-train": cmd_run_train,
        "bound": cmd_bound,
        "latency": cmd_latency,
        "preload": cmd_preload,
    }
    commands.get(args.command, cmd_all)(args)


if __name__ == "__main__":
    main()
