"""The run, its attempts, the restart policy, the watchdog and what the views read, on the scripted fake engine
(tests/fake_engine.py): the kernel side's logic, told as stories of ranks, in milliseconds and without a process.
What needs real ranks (signals, pipes, the process group, stacks of real frames) stays with the engines' tests."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

import ddpnb
from ddpnb.core.record import Outcome, RankState
from ddpnb.core.spec import Stream
from ddpnb.views import html as render
from tests.fake_engine import (
    Exit,
    Gate,
    Print,
    Queue,
    Script,
    Send,
    every_rank_finishes,
    failed,
    finishes,
    metric,
    open_engines,
    raises,
    returned,
    started,
)
from tests.test_faults import wait_for

pytestmark = pytest.mark.fast


def nothing(*args):
    """What the fake's ranks "run": the script says what they do."""


def launch(script: Script | list[Script], nprocs: int = 2, **options):
    return ddpnb.launch(nothing, engine="fake", nprocs=nprocs, script=script, **{"view": "none", **options})


# --- the run record (from test_core.py) ---------------------------------------------------------------------------
def test_run_record_keeps_exit_codes_durations_metrics_and_logs():
    logged = [metric(rank, step, loss=1.0 / (step + 1), rank_value=rank) for step in range(5) for rank in range(2)]
    story = Script(
        [started(0), started(1), *logged, returned(0, "ok"), returned(1), Exit(0, 0, after=0.01), Exit(1, 0)]
    )
    assert launch(story).result() == "ok"
    record = ddpnb.last_run()
    assert record.outcome is ddpnb.Outcome.SUCCEEDED
    assert record.exit_codes == {0: 0, 1: 0}
    assert all(r.state is ddpnb.RankState.FINISHED and r.duration > 0 for r in record.ranks)
    assert [(p.step, p.value) for p in record.metrics("loss", rank=1)] == [(s, 1.0 / (s + 1)) for s in range(5)]
    last = record.metrics("rank_value", rank=1)[-1]
    assert (last.step, last.value) == (4, 1.0) and record.started <= last.time <= record.ended
    assert all(r.log_path.exists() for r in record.ranks)
    assert open_engines() == []  # each attempt's engine closed


def test_views_are_fed_at_most_five_times_a_second_however_output_floods():
    """A view redraws when the run's reader has news; lines are news at most once every 0.2 s (ranks starting,
    returning or exiting at once), also when one rank floods after another returned."""
    flood = [Print(0, str(i), after=0.002) for i in range(1500)]  # 3 s of a line every 2 ms, the other rank gone
    handle = launch(Script([started(0), *finishes(1), *flood, returned(0), Exit(0, 0)]))
    fed, at = [], []
    handle.subscribe(lambda: (fed.append(handle.record.ranks[0].lines), at.append(time.monotonic())))
    handle.wait()
    assert handle.record.ranks[0].lines == 1500 and fed[-1] == 1500  # the last call saw every line
    # feeds closer together than 0.2 s: only the events' (2 starts, 2 returns, 2 exits and the end), never one
    # per line (a loaded machine only spaces the feeds further apart)
    hurried = [(lines, round(b - a, 3)) for lines, a, b in zip(fed[1:], at, at[1:]) if b - a < 0.19]
    assert len(hurried) <= 12, hurried
    assert len(set(fed)) >= 3  # and it was fed while the lines came, not only at the end


def test_a_run_waiting_in_the_queue_says_so_with_no_clock_running_then_runs():
    story = Script(
        [
            Queue("fake job 7", "pending (Priority)"),
            Queue("fake job 7", "pending (Resources)", after=0.2),
            Queue("fake job 7", "", after=0.2),
            *finishes(0, "ran"),
            *finishes(1),
        ]
    )
    handle = launch(story, timeout=0.3)  # the queue's 0.4 s is not the run's: no timeout
    states = []
    handle.subscribe(lambda: states.append(handle.record.queued and handle.record.queued.state))
    assert handle.result() == "ran"
    queued = handle.record.queued
    assert queued.what == "fake job 7" and not queued.ongoing and queued.until >= queued.since
    assert "pending (Priority)" in states or "pending (Resources)" in states, states


# --- the restart policy (from test_restarts.py) ---------------------------------------------------------------------
def fails_while_rank_0_ignores_the_stop() -> list[Script]:
    """Attempt 0: rank 0 ignores the stop (the attempt's teardown then lasts until the engine stops harder), and
    rank 1 raises. A later attempt succeeds: a restart shows as success."""
    # rank 1 fails once the caller waits for the run (a cell's wait: what the interrupt reaches)
    attempt_0 = Script(
        [started(0), started(1), failed(1, "ValueError", "rank 1 fails", after=1.0), Exit(1, 1)],
        ignores_stop={0},
        stop_after=3.0,
    )
    return [attempt_0, every_rank_finishes(2, "restarted")]


def _wait_for_the_failure(handle) -> None:
    wait_for(lambda: handle.record.failures, "rank 1's failure to be recorded")
    assert not handle.done  # rank 0 still ignores its stop: the failed attempt's teardown is under way


def test_stop_during_a_failed_attempts_teardown_never_restarts():
    handle = launch(fails_while_rank_0_ignores_the_stop(), max_restarts=2)
    _wait_for_the_failure(handle)
    handle.stop()
    record = handle.wait()
    assert record.attempts == [] and record.attempt == 0, [a.note for a in record.attempts]
    assert record.outcome in (ddpnb.Outcome.STOPPED, ddpnb.Outcome.FAILED), record.outcome
    with pytest.raises(ddpnb.WorkerError):
        handle.result()
    assert open_engines() == []


def test_an_interrupt_during_a_failed_attempts_teardown_never_restarts():
    """Ctrl-C (SIGINT, as the kernel's interrupt sends it) while the cell waits for the run's end."""
    handle = launch(fails_while_rank_0_ignores_the_stop(), max_restarts=2)

    def interrupt_once_failed() -> None:
        _wait_for_the_failure(handle)
        os.kill(os.getpid(), signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_failed)
    interrupter.start()
    try:
        with pytest.raises(ddpnb.RunInterrupted):
            handle.wait()
    finally:
        interrupter.join()
    record = handle.wait()
    assert record.attempts == [] and record.attempt == 0, [a.note for a in record.attempts]
    assert record.outcome is not ddpnb.Outcome.SUCCEEDED
    assert open_engines() == []


def test_exhausted_restarts_make_exactly_the_budgeted_attempts_and_the_record_says_so(capsys):
    """`max_restarts=2` with a rank that always fails: three attempts ran (each rank's own line), the record keeps
    the first two and ends on the third, the logs are one per attempt, and the run says so."""
    attempts = [
        Script(
            [
                started(0),
                Print(0, f"attempt {a} rank 0"),
                Print(1, f"attempt {a} rank 1"),
                *raises(1, "RuntimeError", f"fails in attempt {a}"),
            ]
        )
        for a in range(4)
    ]
    with pytest.raises(ddpnb.WorkerError) as failure:
        ddpnb.run(nothing, engine="fake", nprocs=2, max_restarts=2, script=attempts, view="text")
    record = ddpnb.last_run()
    said = capsys.readouterr().out
    assert [f"attempt {a} rank {r}" in said for a in range(4) for r in range(2)] == [True] * 6 + [False] * 2
    assert (record.max_restarts, record.attempt, [a.number for a in record.attempts]) == (2, 2, [0, 1])
    assert [a.first_failure.summary for a in record.attempts] == [
        "RuntimeError: fails in attempt 0",
        "RuntimeError: fails in attempt 1",
    ]
    assert record.first_failure.summary == "RuntimeError: fails in attempt 2"
    assert record.outcome is ddpnb.Outcome.FAILED and "fails in attempt 2" in str(failure.value)
    assert sorted(p.name for p in record.run_dir.glob("rank*.log")) == [
        f"rank{r}.attempt{a}.log" for r in range(2) for a in range(3)
    ]
    assert "(restart 1 of 2)" in said and "(restart 2 of 2)" in said and "restart 3" not in said


def test_a_lost_rank_is_the_first_failure_in_the_engines_words_and_a_restart_follows():
    lost = Script([started(0), started(1), Exit(1, None, cause="was lost with its node n2", after=0.05)])
    handle = launch([lost, every_rank_finishes(2, "again")], max_restarts=1)
    assert handle.result() == "again"
    (first,) = handle.record.attempts
    assert first.first_failure.rank == 1 and first.first_failure.summary == "was lost with its node n2"


def test_a_record_held_across_a_restart_reads_the_new_attempt_and_keeps_the_old_one_as_it_ended():
    """What a user or a view holds while attempt 0 runs: the run's record (`handle.record`) reads the attempt
    going on after the restart; attempt 0's own record (`record.current` then: its ranks, failures, its wait in
    the queue) is the one filed in `record.attempts`, kept as it ended, and nothing of attempt 1 writes into it."""
    go_on, again = threading.Event(), threading.Event()
    attempt_0 = Script(
        [
            Queue("fake job 7", "pending (Priority)"),
            Queue("fake job 7", ""),
            started(0),
            started(1),
            metric(0, 0, loss=1.0),
            Gate(go_on),
            *raises(1, "ValueError", "rank 1 fails"),
        ]
    )
    attempt_1 = Script(
        [
            started(0),
            started(1),
            metric(0, 0, loss=0.5),
            Gate(again),
            returned(0, "again"),
            returned(1),
            Exit(0, 0),
            Exit(1, 0),
        ]
    )
    handle = launch([attempt_0, attempt_1], max_restarts=1)
    record = handle.record
    wait_for(lambda: record.ranks[1].state is RankState.RUNNING, "attempt 0's ranks to start")
    first, ranks = record.current, record.ranks  # what a view holds while attempt 0 runs
    go_on.set()
    wait_for(lambda: record.attempt == 1 and record.ranks[1].state is RankState.RUNNING, "attempt 1 to start")
    # the run's record reads attempt 1 ...
    assert record.current is not first and record.ranks is not ranks and record.failures == []
    assert [r.state for r in record.ranks] == [RankState.RUNNING] * 2 and record.queued is None
    # ... and attempt 0's, held, is the one filed, as it ended
    assert record.attempts == [first] and first.ranks is ranks
    assert first.outcome is Outcome.FAILED and first.ended is not None and first.note == "rank 1 raised ValueError"
    assert [r.state for r in ranks] == [RankState.STOPPED, RankState.FAILED] and ranks[1].exitcode == 1
    assert [f.summary for f in first.failures] == ["ValueError: rank 1 fails"]
    assert first.queued.what == "fake job 7" and not first.queued.ongoing
    assert [p.value for p in record.metrics("loss", attempt=0)] == [1.0]
    again.set()
    assert handle.result() == "again"
    # attempt 1's end wrote nothing into attempt 0's
    assert [r.state for r in ranks] == [RankState.STOPPED, RankState.FAILED] and first.failures[0].rank == 1
    assert [r.state for r in record.ranks] == [RankState.FINISHED] * 2 and record.current.outcome is Outcome.SUCCEEDED
    assert [p.value for p in record.metrics("loss")] == [1.0, 0.5]
    assert open_engines() == []


# --- the watchdog (from test_stall.py) ------------------------------------------------------------------------------
def test_stall_zero_never_marks_the_run_stalled():
    """Rank 1 is quiet for 6 s (longer than the adaptive threshold's floor) before both return."""
    handle = launch(
        Script([started(0), started(1), returned(0, after=6.0), returned(1), Exit(0, 0), Exit(1, 0)]), stall=0
    )
    seen = False
    while not handle.done:
        seen = seen or handle.record.stall is not None
        time.sleep(0.1)
    assert handle.wait().outcome is Outcome.SUCCEEDED
    assert not seen and handle.record.stall is None


def test_a_timeout_stops_every_rank_and_keeps_where_each_was():
    stacks = {
        0: 'Stack (most recent call last):\n  File "train.py", line 3, in train\n    dist.all_reduce(t)',
        1: 'Stack (most recent call last):\n  File "train.py", line 2, in train\n    time.sleep(600)',
    }
    handle = launch(Script([started(0), started(1)], stacks=stacks), timeout=0.5, stall=0)
    record = handle.wait()
    assert record.outcome is Outcome.TIMED_OUT
    assert [r.state for r in record.ranks] == [RankState.STOPPED] * 2
    assert [r.stack for r in record.ranks] == [stacks[0], stacks[1]]  # the timeout's report shows these


# --- what the views read (from test_fold.py) -------------------------------------------------------------------------
def test_metrics_frame_has_every_ranks_points_in_long_format():
    pd = pytest.importorskip("pandas")
    story = [started(0), started(1)]
    for rank in range(2):
        story += [metric(rank, step, loss=1.0 / (step + 1) + rank, acc=0.1 * step) for step in range(4)]
        story += [metric(rank, None, lr=0.5)]  # no step
    launch(Script(story + [returned(0), returned(1), Exit(0, 0), Exit(1, 0)])).wait()
    frame = ddpnb.last_run().metrics_frame()
    assert list(frame.columns) == ["rank", "attempt", "step", "time", "name", "value"]
    assert len(frame) == 2 * (4 * 2 + 1)
    loss = frame[frame.name == "loss"].pivot_table(index="step", columns="rank", values="value")
    assert loss.loc[3, 1] == pytest.approx(1.25) and loss.loc[0, 0] == pytest.approx(1.0)
    lr = frame[frame.name == "lr"]
    assert lr.step.isna().all() and set(lr["rank"]) == {0, 1}
    assert (frame.attempt == 0).all() and (frame.time >= -1).all()
    assert str(frame.step.dtype) == "Int64" and pd.api.types.is_float_dtype(frame.value)


def test_latest_output_column_shows_the_last_line_that_is_not_the_progress_bar():
    """A rank prints a line, then a tqdm bar runs to its end: the bar's final state is still a line (logs, text
    view), the latest-output column shows the line before it, and the bar its progress column."""
    from ddpnb.core.messages import Progress

    story = []
    for rank in range(2):
        bar = "batches: 100%|##########| 50/50 [00:00<00:00, 9000.00it/s]"
        story += [
            started(rank),
            Print(rank, "before the bar"),
            Send(rank, Progress(rank, 1, "batches", 50, 50, "50/50 [00:00<00:00, 9000.00it/s]", closed=True)),
            Print(rank, bar, stream=Stream.STDERR),
            returned(rank),
            Exit(rank, 0),
        ]
    launch(Script(story)).wait()
    record = ddpnb.last_run()
    for rank in record.ranks:
        assert "50/50" in rank.last_line
        assert rank.last_text == "before the bar"
    row = re.search(r'<tr data-rank="0".*?</tr>', render.ranks_html(record)).group(0)
    latest = re.search(r'<td class="ddpnb-last"[^>]*>(.*?)</td>', row).group(1)
    assert "before the bar" in latest and "50/50" not in latest and "50/50" in row  # the bar: progress column


def test_a_failure_on_one_rank_shows_its_traceback_and_stops_the_rest():
    handle = launch(Script([started(0), started(1), failed(1, "ValueError", "bad batch", after=0.05), Exit(1, 1)]))
    with pytest.raises(ddpnb.WorkerError) as caught:
        handle.result()
    assert str(caught.value).startswith("ddpnb: rank 1 of 2 failed first: ValueError: bad batch")
    assert [r.state for r in handle.record.ranks] == [RankState.STOPPED, RankState.FAILED]
