#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs the test extras (and Debian's Chromium for the browser
# test; Debian's slurm-wlm and munge for the slurm engine's tests, which start a two-node Slurm on this machine),
# checks the architecture's import contracts (pyproject.toml), then runs pytest.
# Usage: bash scripts/test.sh [pytest args]   (with args: one pytest with them; without: the whole suite, below)
# The order is random (pytest-randomly, modules shuffled and the tests within each, a module's shared fixtures
# still shared), its seed printed: DDPNB_TEST_SEED=N repeats an order, `-p no:randomly` runs the files' order.
# Python's `random` is not reseeded for each test (--randomly-dont-reset-seed): only the order changes.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test,ray]"
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "scripts/test.sh: could not install chromium; the browser test will say so" >&2
fi
if ! command -v slurmctld >/dev/null 2>&1 && ! [ -x /usr/sbin/slurmctld ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) \
        || echo "scripts/test.sh: could not install slurm-wlm and munge; the slurm tests will say so" >&2
fi
lint-imports --no-cache
order=()
if [[ " $* " != *" no:randomly "* ]]; then
    seed="${DDPNB_TEST_SEED:-$(( (RANDOM << 15) | RANDOM ))}"
    echo "scripts/test.sh: tests in random order, seed $seed (again: DDPNB_TEST_SEED=$seed bash scripts/test.sh)"
    order=(--randomly-seed="$seed" --randomly-dont-reset-seed)
fi
if [ $# -gt 0 ]; then
    exec python -m pytest -q -ra "${order[@]}" "$@"
fi
# The whole suite: the tests that need a Ray instance (`-m ray`: Ray Train's launches, ~17 min alone on 2 cores,
# mostly processes starting) run in a pytest of their own beside the others, whose ranks and kernels mostly wait
# on handshakes, grace periods and timeouts. They share nothing: each module starts its own kernel, Ray instance or
# Slurm, every Ray kernel sets RAY_ADDRESS=local, and the Ray half keeps its runs in a directory of its own (so
# neither half's retention or run counts see the other's runs). The Ray half's output follows the other's.
ray_log=$(mktemp)
ray_runs=$(mktemp -d)
trap 'rm -rf "$ray_log" "$ray_runs"' EXIT
DDPNB_RUNS_DIR="$ray_runs" python -m pytest -q -ra "${order[@]}" -p no:cacheprovider -m ray >"$ray_log" 2>&1 &
ray_pid=$!
rest=0
python -m pytest -q -ra "${order[@]}" -m "not ray" || rest=$?
ray=0
wait "$ray_pid" || ray=$?
echo "--- the tests that need Ray (pytest -m ray), run beside the others ---"
cat "$ray_log"
[ "$ray" -eq 5 ] && ray=0  # none collected: ray is not installed, and its tests say so by skipping
exit $(( rest || ray ))
