"""A daemon started apart from the test session: by a shell that exits at once, so it is no child of pytest (a
cluster kept for the whole session is not among the processes a test counts as its own: test_faults' stray
processes) and in a session of its own."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def start_apart(command: Sequence[str], output: Path, env: Mapping[str, str], timeout: float) -> int:
    """Start `command` with its output in `output`; its PID."""
    started = subprocess.run(
        ["sh", "-c", '"$@" </dev/null >"$0" 2>&1 & echo $!', str(output), *command],
        capture_output=True,
        text=True,
        env=env,
        start_new_session=True,
        timeout=timeout,
        check=True,
    )
    return int(started.stdout)
