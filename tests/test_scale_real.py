"""Many real ranks on this box: 64 CPU processes of the local engine in one DDP run, read through the grouped views
(`core.groups`), every line in every rank's log."""

from __future__ import annotations

import re

import pytest

import ddpnb
from ddpnb.core.groups import GROUP_FROM

pytestmark = pytest.mark.slow


def fails_on_rank_40(rank: int) -> None:
    import torch
    import torch.distributed as dist

    print("ready", flush=True)
    dist.all_reduce(torch.ones(1))
    if rank == 40:
        raise RuntimeError("rank 40 gives up")
    dist.all_reduce(torch.ones(1))  # the others wait here for rank 40, until ddpnb stops them


@pytest.mark.timeout(240)
def test_sixty_four_real_ranks_read_grouped_and_every_line_is_logged(capsys: pytest.CaptureFixture[str]) -> None:
    ranks = 64
    assert ranks >= GROUP_FROM  # the grouped views
    run = ddpnb.launch(fails_on_rank_40, nprocs=ranks, oversubscribe=True, view="text", timeout=180)
    with pytest.raises(ddpnb.WorkerError) as raised:
        run.result()
    shown = capsys.readouterr().out
    ready = [line for line in shown.splitlines() if line.endswith("] ready")]
    assert 1 <= len(ready) <= 5, shown[-3000:]  # folded: a line for the ranks that printed it together, not 64
    report = raised.value.report().splitlines()
    assert report[0] == f"ddpnb: rank 40 of {ranks} failed first: RuntimeError: rank 40 gives up", report[0]
    first_row = next(line for line in report if line.startswith("failed first"))
    assert re.match(r"failed first +rank 40 ", first_row), first_row
    assert not any(line.startswith("rank 1 ") for line in report)  # a row per state, none per rank
    assert len(report) <= 40, "\n".join(report)
    for rank in run.record.ranks:  # nothing lost in the logs
        assert rank.log_path.read_text().startswith("ready\n"), rank.rank
