"""Execute the tutorial notebooks that use GPUs (`--gpus`) through a real kernel on the GPU box, where
`--gpus all` means its one GPU.

Run by `bench/gpu_check.sh` after the benchmarks; DDPNB_QUICK=1 keeps it to a few minutes. The other notebooks
run CPU ranks only, as they do in the test suite on the CPU box, and are skipped here to save the device's time.
Exit status 1 if any notebook fails.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def main() -> int:
    os.environ.setdefault("DDPNB_QUICK", "1")
    os.environ.setdefault("DDPNB_VIEW", "text")
    failed = 0
    for path in NOTEBOOKS:
        if "--gpus" not in path.read_text():
            print(f"tutorial {path.name}: skipped (CPU ranks only: the test suite runs it)")
            continue
        nb = nbformat.read(path, as_version=4)
        started = time.perf_counter()
        try:
            NotebookClient(
                nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
            ).execute()
        except Exception as exc:  # noqa: BLE001 - report every notebook, then fail at the end
            failed += 1
            print(f"tutorial {path.name}: FAILED after {time.perf_counter() - started:.0f} s: {exc}"[:4000])
            continue
        text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
        device = "cuda" if "cuda:0" in text else "cpu"
        print(f"tutorial {path.name}: ok in {time.perf_counter() - started:.0f} s (ranks on {device})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
