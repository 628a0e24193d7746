"""The pre-warmed process every rank is forked from: multiprocessing's forkserver, torch imported once.

It is a fresh process (never a fork of the kernel), started once per kernel (in the background on `%load_ext
ddpnb`), that imports torch but never touches CUDA; each run forks new, clean ranks from it in milliseconds.
`preload` restarts it with more modules and checks it before any rank is forked from it. `lock` orders all of
it: a run holds it while its ranks are forked (`LocalEngine.start`), so the forkserver never changes under them.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ddpnb import _compat
from ddpnb.node import orphans
from ddpnb.node.rank import PROCESS_PREFIX

# the shield first (the kernel's interrupt must not kill the forkserver mid-import); tqdm is optional (a failed
# preload import is skipped): preloaded, the rank's progress hook costs nothing
PRELOAD = [
    "ddpnb.node.shield",
    "torch",
    "torch.distributed",
    "torch.nn",
    "torch.utils.data",
    "cloudpickle",
    "tqdm",
    "ddpnb.node.rank",
]
# held while the forkserver starts, restarts, or has ranks forked from it, or its adopted orphans are ended
# (reentrant: a start that fails ends its ranks, and their orphans, while it holds it)
lock = threading.RLock()
_preloaded: list[str] = []  # what `preload` added to PRELOAD, in the order asked
# children of the forkserver that leave its session yet are no rank's orphans (detached runs' supervisors, each
# with what lets go of it before a `preload`, or None): the orphan sweep spares them
_spared: dict[int, Callable[[], None] | None] = {}


class PreloadError(ValueError):
    """A module `ddpnb.preload` cannot import into the forkserver, or must not: ranks import it as before."""


def context() -> multiprocessing.context.BaseContext:
    """The forkserver's context, the forkserver started if it is not running: one `import torch`, once per kernel."""
    with lock:
        return context_held()


def context_held() -> multiprocessing.context.BaseContext:
    """`context()` for a caller that holds `lock`."""
    _keep_main_module_out_of_ranks()
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD + _preloaded)
    forkserver = multiprocessing.get_context("forkserver")
    multiprocessing.forkserver.ensure_running()
    return forkserver


def _keep_main_module_out_of_ranks() -> None:
    """A rank never re-runs the launching script's main module.

    Like any spawn or forkserver child, a rank would first re-run the script that called `ddpnb.run` (as
    `__mp_main__`), so that objects pickled by reference to `__main__` can be found. ddpnb pickles with
    cloudpickle, which sends whatever `__main__` defines by value, so the re-run would only cost time (a script
    importing torchvision at the top: 2.9 s per launch instead of 0.1 s here) and run unguarded top-level code
    once per rank (without an `if __name__ == "__main__":` guard: a recursive launch). multiprocessing sends the
    main module's name or path with each new process (`spawn.get_preparation_data`, called with the process's
    name); the wrapper leaves them out for ddpnb's processes and changes nothing for any other.
    """

    def wrap(original: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
        @functools.wraps(original)
        def preparation_data(name: str) -> dict[str, Any]:
            data = original(name)
            if name.startswith(PROCESS_PREFIX):
                data.pop("init_main_from_name", None)
                data.pop("init_main_from_path", None)
            return data

        return preparation_data

    _compat.wrap_preparation_data(wrap)


GPU_DRIVER_FILES = "/dev/nvidia"  # a process holding one of these open has initialised CUDA (or NVML)
IMPORT_WAIT = 600.0  # seconds the new forkserver may take to import torch and the preloaded modules
CHECK_WAIT = 60.0  # seconds `preload`'s check may take once the forkserver has imported everything


def preload(modules: dict[str, str | None], busy: Callable[[], bool]) -> list[str]:
    """Import `modules` (name -> the file this kernel imports it from, if known) once in the forkserver, so that
    ranks start with them instead of importing them at every launch (figures: bench/RESULTS.md). Restarts the
    forkserver (one `import torch` plus every preloaded module, now: calling it again for a module re-imports
    it, edits included) and checks the new one before any rank is forked from it: each
    module was imported, from the file the kernel would use; it runs no more threads than the forkserver it
    replaces (a rank forked from a process with threads can hang on a lock one of them held); the GPU driver is
    not open (a rank forked after CUDA's initialisation cannot use CUDA). If anything fails, nothing is added,
    with a PreloadError that says why. Returns every module preloaded so far."""
    with lock:
        if not modules:
            return list(_preloaded)
        if busy():  # a run's ranks were forked from the forkserver: killing it would lose their exit codes
            raise PreloadError(
                "ddpnb.preload restarts the process ranks are forked from: wait for the running run "
                "to end (or .stop() it), then call it again."
            )
        for let_go in [let_go for let_go in _spared.values() if let_go is not None]:
            let_go()
        server, kept = _compat.forkserver_pid(), spared()  # a detached run's supervisor is never waited for
        others = [pid for pid in orphans.children(server) if pid not in kept] if server else []
        if others:
            raise PreloadError(
                f"ddpnb.preload restarts multiprocessing's forkserver, and processes forked from it "
                f"are still running (PIDs {', '.join(map(str, others))}: a forkserver pool of yours?); "
                "stop them, then call it again."
            )
        baseline = max(1, len(threads(server))) if server else 1  # what ranks start from today is the yardstick
        before = list(_preloaded)
        _preloaded.extend(name for name in modules if name not in before and name not in PRELOAD)
        _stop()
        started = context_held()
        # an import that never ends must not hold the lock (and so every launch) forever
        deadline = threading.Timer(IMPORT_WAIT, _kill)
        deadline.start()
        try:
            trouble = _check(started, modules, baseline)
        except (OSError, EOFError):  # the forkserver died: an import raised something other than ImportError
            trouble = (
                f"the forkserver was still importing them after {IMPORT_WAIT:g} s"
                if deadline.finished.is_set()
                else "the forkserver died while importing them: an import raised an error (run "
                f"`import {next(iter(modules))}` in a cell to see it)"
            )
        except BaseException:  # interrupted: the next launch starts the forkserver it had before
            _preloaded[:] = before
            _stop()
            raise
        finally:
            deadline.cancel()
        if trouble:
            _preloaded[:] = before
            _stop()
            context_held()  # back to what it was, started now rather than at the next launch
            raise PreloadError(
                f"ddpnb.preload({', '.join(map(repr, modules))}): {trouble}. Nothing was added; "
                "ranks import these modules themselves, as before."
            )
        return list(_preloaded)


def spare(pid: int, let_go: Callable[[], None] | None = None) -> None:
    """Keep a child of the forkserver out of the orphan sweep (call it holding `lock`); `let_go` ends it before
    `preload` replaces the forkserver, for a child that must not outlive the modules it was forked with."""
    _spared[pid] = let_go


def spared() -> set[int]:
    """The spared children of the forkserver that are still its children (call it holding `lock`)."""
    server = _compat.forkserver_pid()
    alive = set(orphans.children(server)) if server else set()
    for pid in set(_spared) - alive:  # ended: its PID may be reused by a process that is an orphan
        del _spared[pid]
    return set(_spared)


def preloaded() -> list[str]:
    """What `preload` added so far, in the order asked."""
    return list(_preloaded)


def threads(pid: int) -> list[str]:
    """The names of a process's threads."""
    return [comm.strip() for comm in orphans.per_task(pid, "comm")]


def _stop() -> None:
    """End the forkserver (no run is using it), so that the next `ensure_running` starts one with the current
    preload list. Killed rather than asked: multiprocessing's own stop waits until every process that holds its
    "alive" pipe exits, which includes whatever a past rank left running."""
    if _compat.forkserver_pid() is not None:  # started
        _kill()
        _compat.forget_forkserver()  # restarting a dead forkserver is multiprocessing's own path


def shut_down() -> None:
    """The kernel is shutting down: end the forkserver and multiprocessing's resource tracker now. ipykernel ends
    the children in its process group with SIGTERM, retried with growing pauses, and the resource tracker ignores
    SIGTERM: left to that, a kernel that loaded ddpnb took 2.6 s to shut down instead of 0.5 s."""
    from multiprocessing import resource_tracker

    _stop()
    resource_tracker._resource_tracker._stop()  # closes its pipe: it exits at once, and is waited for


def _kill() -> None:
    pid = _compat.forkserver_pid()
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _check(started: multiprocessing.context.BaseContext, modules: dict[str, str | None], baseline: int) -> str:
    """What is wrong with the forkserver after it imported `modules`, as a process forked from it sees it; "" if
    nothing. Starting that process waits for the forkserver to finish importing (it forks after the imports)."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    packages = {name.partition(".")[0] for name in modules}
    probe = started.Process(
        target=report_state,
        args=(writer, [*modules, *packages], GPU_DRIVER_FILES),
        name=f"{PROCESS_PREFIX}preload-check",
        daemon=True,
    )
    probe.start()
    writer.close()
    try:
        if not reader.poll(CHECK_WAIT):
            return f"the check of the new forkserver did not answer within {CHECK_WAIT:g} s"
        found, running, cuda = reader.recv()
    finally:
        reader.close()
        probe.join(5)
        if probe.is_alive():
            probe.kill()
            probe.join()
    missing = [name for name in modules if name not in found]
    if missing:
        return (
            f"{', '.join(missing)} could not be imported there (ImportError): the forkserver is a fresh Python "
            "started in this kernel's working directory, with its PYTHONPATH, which does not see sys.path "
            "changes made in the kernel"
        )
    for name, origin in modules.items():  # origin: where the kernel finds the top-level package
        there = found.get(name.partition(".")[0])
        if origin and there and os.path.realpath(origin) != os.path.realpath(there):
            return (
                f"the forkserver imported {name} from {there}, but this kernel imports it from {origin} "
                "(a sys.path change in the kernel?): ranks would run the other copy"
            )
    if cuda:  # first: starting the driver starts threads too, and CUDA is the cause to name
        return (
            "importing them initialised CUDA (the GPU driver is open); CUDA does not work in a process forked "
            "after that"
        )
    if len(running) > baseline:
        return (
            f"importing them started {len(running) - baseline} thread(s) in the forkserver ({', '.join(running)}); "
            "ranks forked from a process with threads can hang on a lock one of them held"
        )
    return ""


def warm_up_in_background() -> None:
    threading.Thread(target=context, name="ddpnb-warm-up", daemon=True).start()


def report_state(report: Connection, modules: list[str], driver_files: str) -> None:
    """multiprocessing target for `_check`, forked from the new forkserver: the file each of `modules` was
    imported from (absent: not imported), the forkserver's threads, and whether it initialised CUDA: torch's own
    flag (it makes this fork a "bad fork"), or a GPU driver file it holds open (CUDA or NVML initialised by any
    library, not just loaded)."""
    server = os.getppid()  # the forkserver forks its children itself
    found = {name: getattr(sys.modules[name], "__file__", None) for name in modules if name in sys.modules}
    report.send((found, threads(server), _compat.in_bad_fork() or _holds_open(server, driver_files)))


def _holds_open(pid: int, prefix: str) -> bool:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # not ours to read (a hardened /proc): torch's own flag has to do
        return False
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith(prefix):
                return True
        except OSError:  # closed meanwhile
            continue
    return False
