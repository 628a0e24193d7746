"""Many ranks through the real kernel side: simulated nodes (bench/loadgen.py) that speak the remote layer's wire to
a real `Run`, its attempt, record and views; only the training is simulated."""

from __future__ import annotations

import pytest

import ddpnb
from ddpnb.core.record import Outcome, RankState

pytestmark = pytest.mark.fast

SIM = {"engine": "sim", "timeout": 60}


def train() -> None:
    """Never called: the simulated nodes play the ranks."""


def test_every_simulated_ranks_metrics_and_lines_arrive() -> None:
    run = ddpnb.launch(
        train, nprocs=32, view="none", ranks_per_node=8, steps=10, steps_per_second=10, lines_per_second=4, **SIM
    )
    assert run.result() == 10
    record = run.record
    assert record.outcome is Outcome.SUCCEEDED
    assert {rank.node for rank in record.ranks} == {f"sim{node}" for node in range(4)}
    for rank in record.ranks:
        assert [point.step for point in rank.metrics["loss"]] == list(range(1, 11)), rank.rank
        assert rank.lines >= 3, rank.rank
        assert rank.state is RankState.FINISHED
