#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs the test extras (and Debian's Chromium for the browser
# test; Debian's slurm-wlm and munge for the slurm engine's tests, which start a two-node Slurm on this machine),
# checks the architecture's import contracts and ruff's lint and format (pyproject.toml), then runs pytest.
# Usage: bash scripts/test.sh [pytest args]   (`-m ray` / `-m "not ray"`: the tests that need Ray, or the others)
#        bash scripts/test.sh --fast [pytest args]: the fast tier, for the inner loop: the core, policy, views and
#        engine contract tests on the scripted fake engine (`-m fast`), in well under 90 s; it installs nothing
#        and needs no Ray, Slurm or browser (docs/testing.md).
# The order is random (pytest-randomly, modules shuffled and the tests within each, a module's shared fixtures
# still shared), its seed printed: DDPNB_TEST_SEED=N repeats an order, `-p no:randomly` runs the files' order.
# Python's `random` is not reseeded for each test (--randomly-dont-reset-seed): only the order changes.
set -euo pipefail
cd "$(dirname "$0")/.."
checks() {
    lint-imports --no-cache
    ruff check --quiet . && ruff format --check --quiet . || {
        echo "scripts/test.sh: ruff found the above: 'ruff check --fix .' and 'ruff format .' fix most" >&2; exit 1; }
}
if [[ "${1:-}" == "--fast" ]]; then
    shift
    checks
    exec python -m pytest -q -ra -m fast -p no:randomly --durations=5 "$@"
fi
python -m pip install -q -e ".[test,ray]"
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "scripts/test.sh: could not install chromium; the browser test will say so" >&2
fi
if ! command -v slurmctld >/dev/null 2>&1 && ! [ -x /usr/sbin/slurmctld ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) \
        || echo "scripts/test.sh: could not install slurm-wlm and munge; the slurm tests will say so" >&2
fi
checks
order=()
if [[ " $* " != *" no:randomly "* ]]; then
    seed="${DDPNB_TEST_SEED:-$(( (RANDOM << 15) | RANDOM ))}"
    echo "scripts/test.sh: tests in random order, seed $seed (again: DDPNB_TEST_SEED=$seed bash scripts/test.sh)"
    order=(--randomly-seed="$seed" --randomly-dont-reset-seed)
fi
exec python -m pytest -q -ra --durations=15 "${order[@]}" "$@"
