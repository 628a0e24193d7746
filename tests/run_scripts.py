"""Several exported scripts in one torchrun: `torchrun --standalone --nproc_per_node N tests/run_scripts.py SCRIPT...`.

Each rank runs each script in turn as `python SCRIPT --run-dir DIR/run` would (DIR the script's directory: `__main__`,
DIR first on sys.path and the working directory), so one launch pays torch's import once for them all.
A script's output goes to `<script>.rank<R>.log` beside it, and `<script>.rank<R>.done` marks its end; the first
script that raises ends this rank (torchrun then ends the others), so whoever launched this knows which failed.
Each script's process group meets on a port of its own, which rank 0 chooses and tells the others through
torchrun's store: a group made again on the store the last one used would find that one's keys.
A script ends its process with atexit's handlers and `os._exit` (no interpreter teardown, which torch's gloo threads
can abort); here those calls end only the script, and this process ends the same way once every script has run."""

from __future__ import annotations

import atexit
import os
import runpy
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

run_exitfuncs = atexit._run_exitfuncs


def main(scripts: list[Path]) -> None:
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # each script's rank 0 holds its group's own store
    failed = False
    for number, script in enumerate(scripts):
        if rank == 0:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                store.set(f"port-{number}", str(probe.getsockname()[1]))
        os.environ["MASTER_PORT"] = store.get(f"port-{number}").decode()
        with open(script.with_suffix(f".rank{rank}.log"), "w") as log:
            failed = _run(script, log)
        if failed:
            break
        script.with_suffix(f".rank{rank}.done").touch()
    run_exitfuncs()  # the scripts' atexit handlers, once: each script's own call would run torch's too
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(1 if failed else 0)  # as each script ends: the groups' gloo threads outlive them


class _Exited(Exception):
    """A script's `os._exit(code)`: the end of that script, not of this process and the scripts after it."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _exited(code: int) -> None:
    raise _Exited(code)


def _run(script: Path, log) -> bool:
    """Whether `script`, run as its own `__main__` with its output in `log`, raised."""
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
    sys.argv, sys.path[0] = [str(script), "--run-dir", str(script.parent / "run")], str(script.parent)
    os.chdir(script.parent)
    real_exit, os._exit = os._exit, _exited
    atexit._run_exitfuncs = lambda: None
    try:
        runpy.run_path(str(script), run_name="__main__")
        return False
    except _Exited as exited:
        return exited.code != 0
    except BaseException:  # noqa: BLE001 - its traceback is the script's outcome, for the test to show
        traceback.print_exc()
        return True
    finally:
        os._exit, atexit._run_exitfuncs = real_exit, run_exitfuncs
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)


if __name__ == "__main__":
    main([Path(arg).resolve() for arg in sys.argv[1:]])
