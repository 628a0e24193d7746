"""What an exported script calls in each rank, so that ddpnb's calls in the function work outside a notebook run:
`ddpnb.log` writes to `metrics.jsonl` in the script's run directory (one line per call, tagged by rank),
`ddpnb.device()` is the rank's device, and `ddpnb.save_checkpoint` / `load_checkpoint` use `checkpoints/` there."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from ddpnb.core.messages import Message
from ddpnb.core.spec import CallStyle, WorkerSpec
from ddpnb.rank import context as ctx

METRICS = "metrics.jsonl"


class JsonlLink:
    """A rank's metrics as JSON lines appended to one file every rank shares: each line one `write` to a file
    opened for appending, so lines from several ranks never interleave (on a local file system; over NFS, run
    directories per rank are safer: `--run-dir`). The kernel's other messages have no reader here."""

    def __init__(self, path: Path, rank: int) -> None:
        self.rank = rank
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.lock = threading.Lock()

    def send(self, message: Message) -> None:
        del message  # progress and timing messages: a script has no dashboard to show them

    def send_metric(self, step: int | None, values: dict[str, float]) -> None:
        line = json.dumps({"rank": self.rank, "step": step, "time": round(time.time(), 3), **values}) + "\n"
        with self.lock:
            os.write(self.fd, line.encode())

    def receive(self) -> bytes | None:
        return None

    def flush(self) -> None:
        return None


def enter_rank(
    run_dir: str | os.PathLike[str], *, rank: int, world_size: int, device: str, keep_checkpoints: int = 3
) -> None:
    """This process is rank `rank` of a script's run: ddpnb's calls in the function act as they do in a %%ddp run,
    writing into `run_dir`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    context = ctx.RankContext(rank=rank, link=JsonlLink(run_dir / METRICS, rank), device=device, suggests_preload=False)
    context.spec = WorkerSpec(
        fn_payload=b"",
        args=(),
        call_style=CallStyle.AUTO,
        world_size=world_size,
        backend="",
        use_gpus=device != "cpu",
        environ={},
        run_dir=str(run_dir),
        checkpoint_dir=str(run_dir / "checkpoints"),
        keep_checkpoints=keep_checkpoints,
    )
    ctx.enter(context)
