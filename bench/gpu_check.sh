#!/usr/bin/env bash
# ddpnb's GPU check (issue 5, goal 5), for the one-H200 box: ResNet-18 (batch 512, 32 px) and ResNet-50
# (batch 256, 224 px), bf16 autocast, channels_last, synthetic data, 1-rank NCCL DDP, as a plain torchrun script
# vs ddpnb.run(gpus=1) vs %%ddp --gpus 1 in a real kernel (nbclient), with ratios; then launch latency there;
# then ddpnb.preload there; then the tutorials that use GPUs through a real kernel (bench/gpu_tutorials.py).
# Each step runs even if one before it failed. About 7 minutes on the H200 box (an estimate: it has never run
# there). Results go to stdout and, when $OUT is set, to $OUT/gpu_check.{md,json,log}, rewritten after each step.
#
#   bash bench/gpu_check.sh             on the GPU box
#   bash bench/gpu_check.sh --dry-run   anywhere: the same steps on CPU with tiny models, to check the plumbing
#
# The GPU box has torch and torchvision but no Jupyter stack: stage it first, here, with
# `bash /work/shared/gpu-env/stage.sh` (it fills the git-ignored .gpu-env/), and carry `.gpu-env` to the box;
# this script sources .gpu-env/setup.sh when it is there.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -f .gpu-env/setup.sh ]]; then
    # shellcheck disable=SC1091
    source .gpu-env/setup.sh
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's ddpnb, in the workers and the kernel too
export PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
"$python" -c "import torch, torchvision, nbclient, ipykernel" || {
    echo "gpu_check: needs torch, torchvision, nbclient and ipykernel (source .gpu-env/setup.sh on the GPU box)" >&2
    exit 2
}
status=0
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    "$python" bench/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log" || status=1
else
    "$python" bench/gpu_check.py "$@" || status=1
fi
# the tutorials that use GPUs, executed through a real kernel on this machine's GPU, even after a failure above;
# skipped with --dry-run (the test suite runs every notebook on CPU ranks)
if [[ " $* " != *" --dry-run "* ]]; then
    "$python" bench/gpu_tutorials.py 2>&1 | tee ${OUT:+"$OUT/gpu_tutorials.log"} || status=1
fi
exit "$status"
