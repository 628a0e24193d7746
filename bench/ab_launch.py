"""Warm launch latency of two trees side by side: `python bench/ab_launch.py OLD_TREE NEW_TREE [--ranks 2,8,32]`.

Each tree's `ddpnb/` is imported in a fresh process (the tree first on PYTHONPATH) that plays the kernel: it warms
the forkserver with one run, then times `ddpnb.run` of a trivial function (`fn(rank)` returns the rank: no
collective) REPS times for each rank count. Processes for the two trees alternate, so load from elsewhere on the
machine hits both alike; the table shows medians. For a change on the launch path (issue 40: the orphan sweep
after every rank's exit, the rank's own `__main__`); figures only, nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPS = 5
ROUNDS = 3
PROBE = """
import json, sys, time
import ddpnb
def f(rank):
    return rank
ddpnb.run(f, nprocs=2, view="none")
out = {}
for n in map(int, sys.argv[1].split(",")):
    ddpnb.run(f, nprocs=n, view="none")
    times = []
    for _ in range(int(sys.argv[2])):
        began = time.perf_counter()
        ddpnb.run(f, nprocs=n, view="none")
        times.append(time.perf_counter() - began)
    out[n] = times
print("@@AB " + json.dumps(out))
"""


def probe(tree: str, ranks: str) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, ranks, str(REPS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        check=True,
        timeout=900,
    )
    line = next(line for line in done.stdout.splitlines() if line.startswith("@@AB "))
    return json.loads(line[5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--ranks", default="2,8,16")  # more than 16 on 2 cores asks for oversubscribe=True
    args = parser.parse_args()
    samples: dict[str, dict[str, list[float]]] = {args.old: {}, args.new: {}}
    for round_ in range(ROUNDS):
        for tree in (args.old, args.new) if round_ % 2 == 0 else (args.new, args.old):
            for ranks, times in probe(tree, args.ranks).items():
                samples[tree].setdefault(ranks, []).extend(times)
    print(f"| ranks | old (median of {REPS * ROUNDS}) | new | new / old |")
    print("|---|---|---|---|")
    for ranks in args.ranks.split(","):
        old, new = (statistics.median(samples[tree][ranks]) for tree in (args.old, args.new))
        print(f"| {ranks} | {old * 1000:.0f} ms | {new * 1000:.0f} ms | {new / old:.2f} |")


if __name__ == "__main__":
    main()
