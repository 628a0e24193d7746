"""Mutation check: break the product's guarantees one at a time and see which tests notice.

Each mutant below is plain data: the file it edits (relative to the repository root), the exact snippets it
replaces, and the tests that must fail with it applied. The script applies one mutant, runs its tests with the
repository first on PYTHONPATH, restores the file (always, Ctrl-C included) and prints a table. Not part of CI.

    python scripts/mutants.py                   # every mutant, its tests once
    python scripts/mutants.py --repeat 3        # three runs each: a kill must not depend on a race
    python scripts/mutants.py no-sigkill-escalation first-failure-by-time-only
    python scripts/mutants.py --list

It refuses to edit a product file with uncommitted changes. When the product code moves, re-target the snippets.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FAULTS = "tests/test_faults.py::"
MAGIC = "tests/test_magic.py::"
CHILD_PATHS = "test_what_a_rank_started_is_gone_after_the_run_however_it_ended"
STALL = "tests/test_stall.py::"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    edits: tuple[tuple[str, str], ...]  # (exact old snippet, new snippet); each old snippet occurs once
    tests: tuple[str, ...]  # pytest node ids that must kill it


MUTANTS = [
    Mutant(
        "no-sigkill-escalation", "ddpnb/engines/local/engine.py",
        (("                self._signal(rank, signal.SIGKILL)\n", "                pass\n"),),
        (FAULTS + "test_rank_ignoring_sigterm_is_killed_after_the_grace_period",),
    ),
    Mutant(
        "kill-the-rank-not-its-group", "ddpnb/engines/local/engine.py",
        (("        os.killpg(pid, sig)\n    except (ProcessLookupError, PermissionError):  # the group is gone",
          "        os.kill(pid, sig)\n    except (ProcessLookupError, PermissionError):  # the group is gone"),
         ("            os.killpg(pid, sig)\n            return\n", "            os.kill(pid, sig)\n            return\n")),
        (FAULTS + CHILD_PATHS + "[succeeds]", FAULTS + CHILD_PATHS + "[stopped]"),
    ),
    Mutant(
        "exited-ranks-group-left-running", "ddpnb/engines/local/engine.py",
        (("        os.killpg(pid, sig)\n    except (ProcessLookupError, PermissionError):  # the group is gone",
          "        return\n    except (ProcessLookupError, PermissionError):  # the group is gone"),),
        (FAULTS + CHILD_PATHS + "[succeeds]", FAULTS + CHILD_PATHS + "[raises]"),
    ),
    Mutant(
        "authkey-in-every-ranks-environment", "ddpnb/engines/local/rank.py",
        (("    os.environ.update(_torchrun_env(rank, spec))\n",
          ("    os.environ.update(_torchrun_env(rank, spec))\n"
           "    os.environ['DDPNB_KEY'] = bytes(__import__('multiprocessing').current_process().authkey).hex()\n")),),
        (FAULTS + "test_no_secret_reaches_a_ranks_environment_and_env_values_reach_every_rank",),
    ),
    Mutant(
        "spec-args-in-every-ranks-environment", "ddpnb/engines/local/rank.py",
        (("    os.environ.update(_torchrun_env(rank, spec))\n",
          "    os.environ.update(_torchrun_env(rank, spec))\n    os.environ['DDPNB_ARGS'] = repr(spec.args)\n"),),
        (FAULTS + "test_no_secret_reaches_a_ranks_environment_and_env_values_reach_every_rank",),
    ),
    Mutant(
        "first-failure-by-time-only", "ddpnb/core/failures.py",
        (("min(failures, key=lambda f: (f.knock_on, f.time))", "min(failures, key=lambda f: f.time)"),),
        (FAULTS + "test_root_cause_is_on_top_even_when_a_knock_on_failure_came_first",),
    ),
    Mutant(
        "is-knock-on-always-false", "ddpnb/core/failures.py",
        (("    if exc_type in _KNOCK_ON_TYPES:\n        return True\n", "    return False\n"),),
        (FAULTS + "test_collective_errors_of_gloo_and_nccl_are_knock_on_failures",
         FAULTS + "test_what_gloo_raises_when_a_peer_is_killed_is_a_knock_on_failure"),
    ),
    Mutant(
        "own-error-read-after-the-stop-is-a-consequence", "ddpnb/core/attempt.py",
        (('or message.time >= self._stopping.get(rank, float("inf"))', "or rank in self._stopping"),),
        (FAULTS + "test_the_same_error_on_every_rank_is_listed_as_also_failed_not_as_a_consequence",),
    ),
    Mutant(
        "stopped-rank-log-has-no-ending", "ddpnb/core/ranklogs.py",
        (("            if rank.state is RankState.FINISHED:\n                continue\n",
          "            if rank.state in (RankState.FINISHED, RankState.STOPPED):\n                continue\n"),),
        (FAULTS + "test_rank_ignoring_sigterm_is_killed_after_the_grace_period",),
    ),
    Mutant(
        "hardware-samples-count-as-progress", "ddpnb/core/attempt.py",
        (("            record.hardware.append(message)\n",
          "            record.hardware.append(message)\n            self.watchdog.stamp(rank)\n"),),
        (STALL + "test_rank_sleeping_before_all_reduce_is_named_and_the_others_wait_in_it_then_the_run_succeeds",),
    ),
    Mutant(
        "a-stops-consequence-heads-the-report", "ddpnb/core/failures.py",
        (("    return None if first is not None and first.knock_on and ended_by_ddpnb else first\n",
          "    return first\n"),),
        (FAULTS + "test_a_timeout_whose_only_failures_are_its_consequences_says_timed_out_first",),
    ),
    Mutant(
        "function-also-called-in-the-kernel", "ddpnb/_magic.py",
        (("        result = run.result()\n", "        fn()\n        result = run.result()\n"),),
        (MAGIC + "test_the_cells_function_runs_once_on_each_rank_and_never_in_the_kernel",),
    ),
]

ROOT = Path(__file__).resolve().parent.parent


def _dirty(path: str) -> bool:
    status = subprocess.run(["git", "status", "--porcelain", "--", path], cwd=ROOT, capture_output=True, text=True,
                            check=True)
    return bool(status.stdout.strip())


def _mutated(mutant: Mutant, original: str) -> str:
    text = original
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"{mutant.name}: its snippet occurs {count} times in {mutant.path} (re-target it):\n{old}")
        text = text.replace(old, new)
    return text


def _run_tests(mutant: Mutant) -> tuple[bool, list[str], str]:
    """(killed, the tests that failed, pytest's last line)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *mutant.tests],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    failed = re.findall(r"^FAILED (\S+?)(?: - |$)", done.stdout, re.MULTILINE)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode not in (0, 1):  # interrupted, a usage error, no tests collected: not a kill
        return False, [], f"pytest exited with {done.returncode}: {last}"
    return done.returncode == 1, failed, last


def check(mutant: Mutant, repeat: int) -> tuple[int, set[str], str]:
    """Apply `mutant`, run its tests `repeat` times, restore the file; how many runs killed it, and by which tests."""
    path = ROOT / mutant.path
    if _dirty(mutant.path):
        raise SystemExit(f"{mutant.path} has uncommitted changes: commit or stash them before a mutation check")
    original = path.read_text()
    mutated = _mutated(mutant, original)
    kills, killers, last = 0, set(), ""
    try:
        path.write_text(mutated)
        for _ in range(repeat):
            killed, failed, last = _run_tests(mutant)
            kills += killed
            killers.update(test.removeprefix("tests/") for test in failed)
    finally:
        path.write_text(original)
    return kills, killers, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to check (default: all)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each mutant's tests (default 1)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, and exit")
    options = parser.parse_args()
    chosen = [m for m in MUTANTS if not options.names or m.name in options.names]
    unknown = set(options.names) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"no such mutant: {', '.join(sorted(unknown))} (see --list)")
    if options.list:
        for mutant in chosen:
            print(f"{mutant.name}  ({mutant.path})\n  " + "\n  ".join(mutant.tests))
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM restores the file too
    survivors = []
    print(f"{'mutant':<48} {'result':<16} killed by")
    for mutant in chosen:
        kills, killers, last = check(mutant, options.repeat)
        result = f"killed {kills}/{options.repeat}" if kills == options.repeat else \
            f"SURVIVED {options.repeat - kills}/{options.repeat}"
        if kills < options.repeat:
            survivors.append(mutant.name)
        print(f"{mutant.name:<48} {result:<16} {', '.join(sorted(killers)) or last}", flush=True)
    print(f"\nsurvivors: {', '.join(survivors) or 'none'}")
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()
