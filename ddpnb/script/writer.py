"""`ddpnb.export`: the script (and its data files, its sbatch file, its torchrun command line) for one function.

The script is the function's definitions (`sources.collect`) and a `main()` that sets each rank up as a %%ddp
run's rank is set up: its place in the run from torchrun's variables or srun's, its device (one GPU per rank where
the cell asked for GPUs and the machine has them, else the CPU), the default process group, ready when the
function starts, and ddpnb's calls in the function pointed at the script's run directory (`runtime`). Ranks start
with fresh random state, as ddpnb's do: a function that seeds itself trains the same in both.

Slurm: the sbatch file runs the script under `srun`, one task per rank (not torchrun per node): srun already
starts, places and labels every rank, and the script reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID itself.
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpnb._options import LaunchOptions
from ddpnb.core.journal.entries import version as ddpnb_version
from ddpnb.core.spec import DEFAULT_CPU_RANKS, CallStyle, LaunchError
from ddpnb.rank.main import call_arguments
from ddpnb.script.sources import Collected, ExportError, Kind, collect

SCRIPT_NAMES = ("main", "ARGS", "_notebook_data", "_first_node", "_free_port")  # the script's own top-level names
SLURM_PORTS = (20000, 20000)  # srun's ranks meet on port 20000 + job id % 20000: the same on every rank


@dataclass(frozen=True)
class Exported:
    """What `export` wrote: the script, its data files, its sbatch file; and how to run it."""

    script: Path
    torchrun: str  # the command line that runs it on this machine with the cell's ranks
    sbatch: Path | None = None
    data: tuple[Path, ...] = ()

    def __str__(self) -> str:
        lines = [f"[ddpnb] wrote {self.script}: run it with\n    {self.torchrun}"]
        if self.sbatch is not None:
            lines.append(f"    sbatch {shlex.quote(str(self.sbatch))}   (Slurm: one srun task per rank)")
        if self.data:
            lines.append(f"    it loads {len(self.data)} value(s) the notebook had from {self.data[0].parent}")
        return "\n".join(lines)


def export(
    fn: Any,
    path: str | os.PathLike[str],
    /,
    *,
    name: str | None = None,
    sbatch: bool = False,
    torchrun: bool = False,
    data: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Exported:
    """Write `fn`, and every notebook definition it uses, as a standalone script at `path` that torchrun or srun
    runs with the ranks a %%ddp run would have: `ddpnb.export(train, "train.py", nprocs=2)`.

    The options are `ddpnb.run`'s (`gpus`, `nprocs`, `backend`, `env`, `args`, `timeout`, and Slurm's `nodes`,
    `time`, `partition`, `account`, `qos`, `constraint`); those that shape the script are used, the others (the
    view, restarts, ...) are about a notebook run and have no effect on it. `sbatch=True` also writes PATH's
    .sbatch file; `torchrun=True` prints the torchrun command line. A value of the notebook without source (a
    tensor, a model) is refused with the line that uses it; with `data=DIR` it is saved in DIR and the script
    loads it at start. See docs/export.md.
    """
    return write(fn, path, LaunchOptions.of(options), name=name, sbatch=sbatch, torchrun=torchrun, data=data)


def write(
    fn: Any,
    path: str | os.PathLike[str],
    launch: LaunchOptions,
    *,
    name: str | None = None,
    sbatch: bool = False,
    torchrun: bool = False,
    data: str | os.PathLike[str] | None = None,
) -> Exported:
    """`export` with the options already read: a %%ddp cell's own (`%ddp_export`, `--export`)."""
    if not callable(fn):
        raise ExportError(f"{type(fn).__name__} is not a function: pass the function the ranks should run.")
    name = name or getattr(fn, "__name__", None) or "train"
    if not name.isidentifier() or name == "<lambda>":
        raise ExportError(f"the function needs a name in the script: pass name='train' (it is {name!r}).")
    script = Path(path).expanduser()
    if script.suffix != ".py":
        raise ExportError(f"the script's path must end in .py, not {str(path)!r}: e.g. {script.stem or 'train'}.py")
    world_size, gpus = _ranks(launch)
    args = tuple(launch.args)
    found = collect(fn, name, args, data=data is not None)
    clash = [d.name for d in found.definitions if d.name in SCRIPT_NAMES and d.name != "ARGS"]
    if clash:
        raise ExportError(
            f"the notebook's `{clash[0]}` has the name the script gives its own code: rename it in the "
            "notebook, then export again."
        )
    call = _call(fn, name, args, CallStyle(launch.call_style))
    data_dir = Path(data).expanduser() if data is not None else None
    saved = _save_data(found, data_dir) if data_dir is not None else ()
    command = f"torchrun --standalone --nproc_per_node {world_size} {shlex.quote(str(script))}"
    script.parent.mkdir(parents=True, exist_ok=True)
    sbatch_path = script.with_suffix(".sbatch") if sbatch else None
    script.write_text(_script_text(found, name, call, script, world_size, gpus, launch, data_dir, sbatch_path, command))
    if sbatch_path is not None:
        sbatch_path.write_text(_sbatch_text(script, name, world_size, gpus, launch))
    exported = Exported(script, command, sbatch_path, saved)
    if torchrun:
        print(command)
    return exported


def _ranks(launch: LaunchOptions) -> tuple[int, bool]:
    """The cell's world size and whether it asked for GPUs; the script decides at run time whether it has them."""
    if launch.gpus is None:
        return launch.nprocs or DEFAULT_CPU_RANKS, False
    if launch.gpus == "all":
        from ddpnb.core.spec import local_gpu_count

        return local_gpu_count() or launch.nprocs or DEFAULT_CPU_RANKS, True
    try:
        return int(launch.gpus), True
    except (TypeError, ValueError):
        raise LaunchError(f"gpus takes a number of GPUs or 'all', not {launch.gpus!r}.") from None


def _call(fn: Any, name: str, args: tuple[Any, ...], style: CallStyle) -> str:
    """`train(rank, world_size)`, `train()`, `worker(rank, *ARGS)`: the call each rank makes, as ddpnb makes it."""
    import inspect

    stand_ins = tuple("*ARGS" for _ in args)
    try:
        inspect.signature(fn)
        called = call_arguments(fn, "rank", "world_size", stand_ins, style)
    except (TypeError, ValueError):  # no signature to read: as ddpnb would call it without one
        called = ("rank", "world_size", *stand_ins)
    leading = [str(word) for word in called[: len(called) - len(args)]]
    return f"{name}({', '.join([*leading, *(['*ARGS'] if args else [])])})"


def _save_data(found: Collected, directory: Path) -> tuple[Path, ...]:
    """Each DATA value into `directory/NAME.pt`, with torch.save (tensors as tensors, CUDA ones from the CPU) and
    cloudpickle for the rest (notebook classes by value)."""
    import torch

    from ddpnb.core import pickling

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for definition in found.data:
        target = directory / f"{definition.name}.pt"
        try:
            torch.save(definition.value, target, pickle_module=pickling)
        except Exception as exc:  # noqa: BLE001 - cloudpickle raises TypeError, PicklingError, ...
            where = pickling.unpicklable_path(definition.value, definition.name)
            raise ExportError(
                f"`{definition.name}` cannot be saved for the script: {where} cannot be pickled "
                f"({type(exc).__name__}: {exc}). Build it inside the function."
            ) from None
        written.append(target)
    return tuple(written)


def _data_location(data_dir: Path, script: Path) -> str:
    """How the script finds its data directory: next to itself when it is there, else the absolute path."""
    try:
        relative = data_dir.resolve().relative_to(script.resolve().parent)
    except ValueError:
        return repr(str(data_dir.resolve()))
    return f"os.path.join(os.path.dirname(os.path.abspath(__file__)), {str(relative)!r})"


def _script_text(
    found: Collected,
    name: str,
    call: str,
    script: Path,
    world_size: int,
    gpus: bool,
    launch: LaunchOptions,
    data_dir: Path | None,
    sbatch: Path | None,
    command: str,
) -> str:
    uses_ddpnb = any("ddpnb" in d.text for d in found.imports)
    own_group = _calls_init_process_group(found)
    imports = sorted_imports([d.text for d in found.imports])
    parts: list[str] = []
    for definition in found.code:
        if definition.kind is Kind.DATA:
            parts.append(f"{definition.name} = _notebook_data({definition.name!r})\n")
        else:
            parts.append(definition.text)
    cell = _cell_line(world_size, gpus, launch)
    how = [f"    {command}"]
    if sbatch is not None:
        how.append(f"    sbatch {shlex.quote(str(sbatch))}    # Slurm: srun starts one task per rank")
    header = (
        f'"""{name}, exported from a notebook by ddpnb {ddpnb_version()} (`%ddp_export`) on '
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, from a `{cell}` cell.\n\nRun it with the cell's {world_size} "
        f"ranks:\n\n" + "\n".join(how) + "\n\n"
        "Each rank reads its place from torchrun's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, or under\n"
        "srun from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID. "
        + ("ddpnb.log's metrics go to RUN_DIR/metrics.jsonl (a line per call,\ntagged by rank), " if uses_ddpnb else "")
        + f"rank 0's return value to RUN_DIR/result.pt; RUN_DIR is runs/{name}-<job> next\n"
        "to this script, or --run-dir DIR.\n\nThe definitions below are the notebook's own, in the order they need "
        'each other.\n"""\n'
    )
    blocks = ([_data_loader(data_dir, script)] if found.data else []) + parts
    # after the imports, one blank line before a constant and two before a def or class, as isort leaves them
    opens_with_def = _is_def(blocks[0]) if blocks else True
    text = header + "\n" + imports + ("\n\n" if opens_with_def else "\n") if imports else header + "\n"
    for before, block in zip([None, *blocks], blocks):
        if before is not None:  # two blank lines around a def or class, none between plain assignments
            text += "\n\n" if _is_def(before) or _is_def(block) else ""
        text += block
    text += "\n\n"
    text += _main_text(name, call, world_size, gpus, launch, uses_ddpnb, own_group)
    return text


def _is_def(block: str) -> bool:
    return block.lstrip().startswith(("def ", "class ", "@", "async def "))


def sorted_imports(statements: list[str]) -> str:
    """The import statements as isort (and ruff's I001) orders them: the standard library, then the rest, each
    group's `import x` lines before its `from x import y` lines (those of one module joined), by module name."""
    import ast

    groups: dict[bool, tuple[set[str], dict[str, set[str]]]] = {True: (set(), {}), False: (set(), {})}
    for statement in statements:
        node = ast.parse(statement).body[0]
        module = node.names[0].name if isinstance(node, ast.Import) else node.module or ""  # type: ignore[union-attr]
        plain, froms = groups[module.partition(".")[0] in sys.stdlib_module_names]
        if isinstance(node, ast.Import):
            plain.add(statement.strip())
        else:
            froms.setdefault(module, set()).update(ast.unparse(alias) for alias in node.names)  # type: ignore[union-attr]
    blocks = []
    for standard in (True, False):
        plain, froms = groups[standard]
        lines = sorted(plain, key=lambda line: line.split()[1].lower())
        lines += [
            f"from {module} import {', '.join(sorted(names, key=_name_order))}"
            for module, names in sorted(froms.items(), key=lambda item: item[0].lower())
        ]
        if lines:
            blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def _name_order(name: str) -> tuple[int, str]:
    """isort's order of imported names: CONSTANTS, then Classes, then functions and modules."""
    word = name.split(" as ")[0]
    kind = 0 if word.isupper() and len(word) > 1 else 1 if word[:1].isupper() else 2
    return kind, word.lower()


def _cell_line(world_size: int, gpus: bool, launch: LaunchOptions) -> str:
    words = ["%%ddp", f"--gpus {launch.gpus}" if gpus else f"-n {world_size}"]
    if launch.backend:
        words.append(f"--backend {launch.backend}")
    words += [f"--env {shlex.quote(f'{k}={v}')}" for k, v in dict(launch.env).items()]
    return " ".join(words)


def _data_loader(data_dir: Path | None, script: Path) -> str:
    assert data_dir is not None
    return (
        "def _notebook_data(name):\n"
        '    """A value the notebook had and no source makes, saved by `%ddp_export --data` next to this script."""\n'
        "    import os\n\n    import torch\n\n"
        f'    return torch.load(os.path.join({_data_location(data_dir, script)}, name + ".pt"), weights_only=False)\n'
    )


def _calls_init_process_group(found: Collected) -> bool:
    """Whether the function (or what it uses) makes its process group itself, as code written for mp.spawn does."""
    import types

    def names(code: types.CodeType) -> set[str]:
        return set(code.co_names).union(*(names(c) for c in code.co_consts if isinstance(c, types.CodeType)))

    for definition in found.code:
        if definition.kind is Kind.CODE:
            try:
                if "init_process_group" in names(compile(definition.text, "<export>", "exec")):
                    return True
            except SyntaxError:
                continue
    return False


def _main_text(
    name: str, call: str, world_size: int, gpus: bool, launch: LaunchOptions, uses_ddpnb: bool, own_group: bool
) -> str:
    env = dict(launch.env)
    backend = repr(launch.backend) if launch.backend else '"nccl" if device != "cpu" else "gloo"'
    lines = [
        "def main():",
        f'    """One rank of the run: its place, its device, the process group, then {call}."""',
        "    import argparse",
        "    import os",
        "    import sys",
        "",
        "    import torch",
        "    import torch.distributed as dist",
        "",
        "    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])",
        '    parser.add_argument("--run-dir", help="where metrics.jsonl, checkpoints/ and result.pt go "',
        f'                        "(default: runs/{name}-<job> next to this script)")',
        "    options = parser.parse_args()",
    ]
    if env:
        lines += [f"    os.environ.update({env!r})  # the cell's --env"]
    lines += [
        "",
        "    # the rank's place: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; srun sets",
        "    # SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID, and its ranks meet on the job's first node",
        '    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:',
        '        os.environ["RANK"] = os.environ["SLURM_PROCID"]',
        '        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]',
        '        os.environ["LOCAL_RANK"] = os.environ["SLURM_LOCALID"]',
        '        os.environ.setdefault("MASTER_ADDR", _first_node(os.environ["SLURM_JOB_NODELIST"]))',
        (
            f'        os.environ.setdefault("MASTER_PORT", str({SLURM_PORTS[0]} + int(os.environ["SLURM_JOB_ID"]) '
            f"% {SLURM_PORTS[1]}))"
        ),
        '    if "RANK" not in os.environ:  # python script.py: a run of one rank',
        '        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")',
        '        os.environ["MASTER_PORT"] = str(_free_port())  # a port nobody holds: no other rank needs to know it',
        '    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])',
        f"    if rank == 0 and world_size != {world_size}:",
        f'        print(f"[{name}] the notebook ran {world_size} ranks; this run has {{world_size}}", file=sys.stderr)',
        "",
    ]
    needs_device = uses_ddpnb or not own_group  # for the process group's backend, or ddpnb.device()
    if gpus:
        lines += [
            "    # one GPU per rank, as the cell asked (--gpus); CPU ranks over gloo where this machine has none",
            '    local_rank = int(os.environ.get("LOCAL_RANK", "0"))',
            "    if torch.cuda.is_available():",
            "        torch.cuda.set_device(local_rank)",
        ]
        if needs_device:
            lines += ['    device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"']
    elif needs_device:
        lines += ['    device = "cpu"  # the cell ran CPU ranks over gloo']
    lines += [
        "    # random state: fresh in every rank, as in ddpnb's ranks (a function that seeds itself trains the same)"
    ]
    if own_group:
        lines += [
            f"    # {name} calls init_process_group itself (as code written for mp.spawn does): the group is its own"
        ]
    else:
        lines += [
            f"    # the process group, ready when {name} starts (env://: MASTER_ADDR and MASTER_PORT)",
            "    # (its init returns once every rank's connections are up, so no rank leaves while a peer connects)",
            '    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")',
            f"    dist.init_process_group({backend}, rank=rank, world_size=world_size)",
        ]
    lines += [
        '    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "local")',
        "    here = os.path.dirname(os.path.abspath(__file__))",
        f'    run_dir = options.run_dir or os.path.join(here, "runs", f"{name}-{{job}}")',
        "    os.makedirs(run_dir, exist_ok=True)",
    ]
    if uses_ddpnb:
        lines += [
            "    from ddpnb.script.runtime import enter_rank",
            "",
            "    # ddpnb.log to run_dir/metrics.jsonl, ddpnb.device(), ddpnb.save_checkpoint into run_dir/checkpoints",
            (
                "    enter_rank(run_dir, rank=rank, world_size=world_size, device=device, "
                f"keep_checkpoints={launch.keep_checkpoints})"
            ),
        ]
    lines += [
        "    try:",
        f"        result = {call}",
        "        if rank == 0 and result is not None:",
        '            torch.save(result, os.path.join(run_dir, "result.pt"))',
        f"            print(f\"[{name}] rank 0's result: {{os.path.join(run_dir, 'result.pt')}}\")",
        "        if dist.is_initialized():  # every rank is done before any takes the group down",
        "            dist.barrier()",
        "    finally:",
        "        if dist.is_initialized():",
        "            dist.destroy_process_group()",
        "",
        "",
        "def _free_port():",
        '    """A port of this machine nobody listens on now (bound as port 0, then let go)."""',
        "    import socket",
        "",
        "    with socket.socket() as probe:",
        '        probe.bind(("127.0.0.1", 0))',
        "        return probe.getsockname()[1]",
        "",
        "",
        "def _first_node(nodelist):",
        '    """The first host of a Slurm node list (`n[1-2]` -> `n1`), as `scontrol show hostnames` expands it."""',
        "    import subprocess",
        "",
        '    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=False, capture_output=True, text=True)',
        "    return hosts.stdout.split()[0] if hosts.returncode == 0 and hosts.stdout.split() else nodelist",
        "",
        "",
        'if __name__ == "__main__":',
        "    import atexit",
        "    import os",
        "    import sys",
        "",
        "    main()",
        "    # atexit's handlers (a tracker's finish), then no interpreter teardown: torch's gloo threads outlive",
        "    # destroy_process_group and can abort it",
        "    atexit._run_exitfuncs()",
        "    sys.stdout.flush()",
        "    sys.stderr.flush()",
        "    os._exit(0)",
        "",
    ]
    return "\n".join(lines)


def _sbatch_text(script: Path, name: str, world_size: int, gpus: bool, launch: LaunchOptions) -> str:
    """One srun task per rank; the cell's nodes, GPUs, time and partition as #SBATCH lines."""
    engine = dict(launch.engine_options)
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --ntasks={world_size}"]
    if engine.get("nodes"):
        lines.append(f"#SBATCH --nodes={engine['nodes']}")
    if gpus:
        lines.append("#SBATCH --gpus-per-task=1")
    time = engine.get("time") or (_slurm_time(launch.timeout) if launch.timeout else "")
    if time:
        lines.append(f"#SBATCH --time={time}")
    for option in ("partition", "account", "qos", "constraint"):
        if engine.get(option):
            lines.append(f"#SBATCH --{option}={engine[option]}")
    lines.append(f"#SBATCH --output={name}-%j.out")
    srun_args = engine.get("srun_args") or ""
    lines += [
        "",
        f"# Written by ddpnb's %ddp_export for {script.name}: srun starts one task per rank ({world_size} in all), and",
        "# each reads its rank from SLURM_PROCID. This batch script runs on the job's first node, where srun places",
        "# rank 0: MASTER_ADDR is that node, and the port is the job's own. --label tags each line with its rank.",
        'export MASTER_ADDR="$(hostname)"',
        f"export MASTER_PORT=$(({SLURM_PORTS[0]} + SLURM_JOB_ID % {SLURM_PORTS[1]}))",
        (
            f"srun --label {srun_args + ' ' if srun_args else ''}{shlex.quote(sys.executable)} "
            f'{shlex.quote(str(script.resolve()))} "$@"'
        ),
        "",
    ]
    return "\n".join(lines)


def _slurm_time(seconds: float) -> str:
    """--timeout 90 -> '00:02:00' (whole minutes, rounded up, as Slurm counts them)."""
    minutes = -(-int(seconds) // 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"
