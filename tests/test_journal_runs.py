"""The journal of real runs (issue 42): 2 ranks over gloo, replayed (and followed live) into the owner's record."""

from __future__ import annotations

import sys
import threading

import cloudpickle
import pytest

import ddpnb
from ddpnb.core.journal import JOURNAL_VAR
from ddpnb.core.journal.replay import Replay, replay
from tests.test_faults import orphans_come_to_this_process
from tests.test_journal import differences

cloudpickle.register_pickle_by_value(sys.modules[__name__])
assert orphans_come_to_this_process  # its autouse fixture applies here too

STEPS = 300


def train(rank, world_size, fail_at=None):
    """STEPS steps, each an all_reduce, a ddpnb.log and a print (and a line on stderr every 50th); with `fail_at`,
    rank 1 raises at that step in the first attempt."""
    import sys

    import torch
    import torch.distributed as dist

    import ddpnb

    total = torch.zeros(1)
    for step in range(STEPS):
        one = torch.ones(1)
        dist.all_reduce(one)
        total += one
        ddpnb.log(step=step, loss=1.0 / (step + 1), total=total.item())
        print(f"rank {rank} step {step}")
        if step % 50 == 0:
            print(f"rank {rank} passes step {step}", file=sys.stderr)
        if fail_at is not None and rank == 1 and step == fail_at and ddpnb.attempt() == 0:
            raise ValueError(f"bad batch at step {step}")
    return {"rank": rank, "total": total.item()}


def _follow(path) -> tuple[Replay, threading.Thread]:
    """A viewer that follows the run's journal live from its start, in a thread of its own."""
    follower = Replay()
    thread = threading.Thread(target=follower.follow, args=(path,), daemon=True)
    thread.start()
    return follower, thread


def _assert_replays_the_owners_record(handle, follower: Replay, thread: threading.Thread) -> Replay:
    thread.join(30)
    assert not thread.is_alive() and follower.done and follower.torn is None
    replayed = Replay.read(handle.record.run_dir)
    assert replayed.done and replayed.torn is None
    for viewer in (replayed, follower):
        assert differences(handle.record, viewer.record) == []
        assert viewer.lines_since(0) == handle.lines_since(0)
    assert differences(handle.record, replay(handle.record.run_dir)) == []
    return replayed


def test_a_real_run_replays_every_step_and_line_and_a_live_follower_sees_the_same(monkeypatch):
    monkeypatch.setenv(JOURNAL_VAR, "1")
    handle = ddpnb.launch(train, nprocs=2, view="none")
    follower, thread = _follow(handle.record.run_dir)
    result = handle.result()
    assert result == {"rank": 0, "total": 2.0 * STEPS}
    replayed = _assert_replays_the_owners_record(handle, follower, thread)
    record = replayed.record
    for rank in (0, 1):
        assert [p.step for p in record.metrics("loss", rank)] == list(range(STEPS))  # each step exactly once
        lines, _, _ = replayed.lines_since(0)
        assert [line.text for line in lines if line.rank == rank and line.text.startswith(f"rank {rank} step")] == [
            f"rank {rank} step {s}" for s in range(STEPS)
        ]
    assert record.outcome is ddpnb.Outcome.SUCCEEDED


def test_a_real_run_with_a_failure_and_a_restart_replays_both_attempts(monkeypatch):
    monkeypatch.setenv(JOURNAL_VAR, "1")
    handle = ddpnb.launch(train, args=(100,), nprocs=2, view="none", max_restarts=1)
    follower, thread = _follow(handle.record.run_dir)
    assert handle.result()["total"] == 2.0 * STEPS
    replayed = _assert_replays_the_owners_record(handle, follower, thread)
    record = replayed.record
    assert record.attempt == 1 and len(record.attempts) == 1
    failure = record.attempts[0].first_failure
    assert failure.rank == 1 and "bad batch at step 100" in failure.summary
    assert [p.step for p in record.metrics("loss", 1, attempt=0)] == list(range(101))
    assert [p.step for p in record.metrics("loss", 1, attempt=1)] == list(range(STEPS))


@pytest.mark.parametrize("keep", [10])
def test_a_viewer_keeps_as_many_lines_as_it_is_told(monkeypatch, keep):
    monkeypatch.setenv(JOURNAL_VAR, "1")
    handle = ddpnb.launch(train, nprocs=2, view="none")
    handle.result()
    replayed = Replay.read(handle.record.run_dir, keep_lines=keep)
    lines, lost, count = replayed.lines_since(0)
    assert len(lines) == keep and count == handle.lines_since(0)[2] and lost == count - keep
