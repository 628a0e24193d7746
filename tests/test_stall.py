"""The stall doctor, stacks on demand and the NCCL flight recorder's summary (issue 17, item 1).

Real ranks (gloo, CPU) that stop making progress: one rank sleeps before a collective its peers entered. The
flight recorder itself needs NCCL; its dumps are read here from files of the shape torch writes, checked with
torch's own reader.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import time
from pathlib import Path

import pytest

import ddpnb
from ddpnb.core import flight
from ddpnb.core.record import Outcome, RankRecord, RankState
from ddpnb.core.report import diagnosis_summary, where_phrase
from ddpnb.core.spec import LaunchError
from ddpnb.core.stall import FACTOR, FLOOR, StallWatch, call_on, locate
from ddpnb.core.watchdog import Alarm, Watchdog
from ddpnb.node import forkserver

HERE = Path(__file__).resolve()


def _line_of(text: str, fn) -> int:
    """The line number of `text` in `fn`'s source file."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def sleeps_on_rank_1_until(flag: str):
    def train(rank):
        import torch
        import torch.distributed as dist

        print(f"rank {rank} ready", flush=True)
        deadline = time.monotonic() + 120
        while rank == 1 and not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)  # rank 1's sleep
        dist.all_reduce(torch.ones(1))  # the others wait here
        return rank

    return train


def _wait_for(predicate, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.timeout(180)
def test_rank_sleeping_before_all_reduce_is_named_and_the_others_wait_in_it_then_the_run_succeeds(tmp_path):
    flag = str(tmp_path / "wake")
    train = sleeps_on_rank_1_until(flag)
    run = ddpnb.launch(train, nprocs=3, stall=3, view="none")
    try:
        assert _wait_for(lambda: sum(r.lines for r in run.record.ranks) >= 3, 120), run.status  # all started
        # the cap only keeps a stall that is never marked from hanging the test
        assert _wait_for(lambda: run.record.stalled, 120), f"never marked stalled: {run.status}"
        stall = run.record.stall
        sleep_line = _line_of("rank 1's sleep", train)
        reduce_line = _line_of("the others wait here", train)
        summary = diagnosis_summary(stall.diagnosis)
        assert summary == (
            f'rank 1 is in time.sleep (File "{HERE}", line {sleep_line}); '
            f'ranks 0, 2 wait in all_reduce (File "{HERE}", line {reduce_line})'
        ), summary
        assert stall.threshold == 3 and run.outcome is Outcome.RUNNING  # marked, not stopped
        assert run.status.endswith(f", stalled: {summary}")
        quiet = {where.rank: where.quiet for where in stall.diagnosis.ranks}
        # never marked before every rank was quiet for the run's threshold (a bound the product keeps, not a timing)
        assert set(quiet) == {0, 1, 2} and all(seconds >= stall.threshold for seconds in quiet.values()), quiet

        stacks = run.stacks()
        assert set(stacks) == {0, 1, 2}
        assert all("in train" in text for text in stacks.values()), stacks
        assert "all_reduce" in stacks[0] and "all_reduce" in stacks[2] and "all_reduce" not in stacks[1]
        assert all(not r.stack for r in run.record.ranks)  # on-demand stacks are not a timeout's report
    finally:
        Path(flag).touch()
    record = run.wait(120)
    assert record.outcome is Outcome.SUCCEEDED, run.status
    assert run.result() == 0
    assert not record.stalled and record.stall.resumed is not None  # left the stalled state by itself


STALL_CELL = """%%ddp -n 3 --stall 3
def train(rank):
    import time
    import torch
    import torch.distributed as dist
    if rank == 1:
        time.sleep(15)
    dist.all_reduce(torch.ones(1))
    print(f"rank {rank} done")
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stalled_cell_says_so_in_the_text_view_with_cell_lines_then_resumes(kernel):
    kernel.execute("import ddpnb; ddpnb.run(lambda: None, nprocs=1, view='none')", timeout=180)  # warm
    executed = kernel.execute(STALL_CELL, timeout=180)
    assert executed.error is None, executed.error
    out = executed.stdout
    cell = f"Cell In[{executed.count}]"
    stalled = [line for line in out.splitlines() if line.startswith("[ddpnb] stalled:")]
    assert len(stalled) == 1, out
    assert stalled[0].endswith(
        f"rank 1 is in time.sleep ({cell}, line 7); ranks 0, 2 wait in all_reduce ({cell}, line 8)"
    ), out
    for rank in range(3):
        assert re.search(rf"\[ddpnb\]   rank {rank}: .*, \d+\.\d s since its last activity", out), out
    assert "ipykernel_" not in out
    # under it, each rank's stack as the stall doctor took it: the cell's lines and their source, nothing of ddpnb's
    # nor torch's logging wrappers; ranks 0 and 2 wait in the same place, shown once
    stacks = out[out.index("each rank's stack:") : out.index("[ddpnb] progress resumed")]
    rank_1 = stacks[stacks.index("[ddpnb] --- rank 1 ---") :]
    assert f"[ddpnb]     {cell}, line 7, in train\n[ddpnb]       time.sleep(15)\n" in rank_1, stacks
    assert "[ddpnb] --- ranks 0, 2 ---" in stacks and "dist.all_reduce(torch.ones(1))" in stacks, stacks
    assert "c10d_logger" not in stacks and "ddpnb/" not in stacks and "Thread 0x" not in stacks, stacks
    assert out.index("[ddpnb] stalled:") < out.index("[ddpnb] progress resumed") < out.index("run succeeded"), out
    # the stall line says how long no rank had made progress: at least --stall's 3 s, or it was marked too early
    quiet = float(re.search(r"no rank has made progress for (\d+\.\d) s", stalled[0]).group(1))
    assert quiet >= 3, stalled[0]


def hangs_on_rank_1(rank):
    import torch
    import torch.distributed as dist

    print(f"rank {rank} at step 1", flush=True)
    if rank == 1:
        time.sleep(600)  # never joins
    dist.all_reduce(torch.ones(1))


@pytest.mark.timeout(120)
def test_timeout_report_starts_with_where_each_rank_is():
    with pytest.raises(ddpnb.WorkerError) as caught:
        ddpnb.run(hangs_on_rank_1, nprocs=2, timeout=4, stall=0, view="none")
    lines = str(caught.value).splitlines()
    assert lines[0] == "ddpnb: run timed out: stopped after the 4 s timeout (--timeout)"
    sleep_line, reduce_line = _line_of("never joins", hangs_on_rank_1), _line_of("all_reduce(torch", hangs_on_rank_1)
    assert lines[1] == (
        f'where each rank was: rank 1 is in time.sleep (File "{HERE}", line {sleep_line}); '
        f'rank 0 waits in all_reduce (File "{HERE}", line {reduce_line})'
    ), lines[:4]
    assert lines[2].startswith("  rank 0: waits in all_reduce") and lines[3].startswith("  rank 1: is in time.sleep")
    assert lines.index("where each rank was when the run was stopped:") > 3  # the stacks follow
    assert caught.value.record.stall is None  # --stall 0: never marked stalled


@pytest.mark.parametrize("value", [-1, "abc", float("nan"), True, float("inf")])
def test_bad_stall_values_are_refused_before_anything_starts(value):
    with pytest.raises(LaunchError, match="stall takes a number of seconds"):
        ddpnb.launch(lambda: None, nprocs=1, stall=value, view="none")


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["-1", "abc"])
def test_bad_stall_flags_are_usage_errors(kernel, flag):
    kernel.execute("ran = False")
    executed = kernel.execute(f"%%ddp -n 2 --stall {flag}\nran = True\ndef train(rank):\n    pass\n")
    assert executed.error is None  # IPython prints a UsageError instead of raising into the cell
    assert "UsageError: stall takes a number of seconds" in executed.stderr and repr(flag) in executed.stderr
    assert kernel.execute("print(ran)").stdout.strip() == "False"  # refused before the cell ran
    executed = kernel.execute(f"%ddp_start -n 2 --stall {flag}")
    assert "UsageError: stall takes a number of seconds" in executed.stderr, executed.text


@pytest.mark.timeout(180)
def test_dashboard_shows_the_stall_and_its_stacks_button_shows_every_ranks_stack(tmp_path):
    pytest.importorskip("ipywidgets")
    from ddpnb.views.dashboard import Dashboard

    flag = str(tmp_path / "wake")
    run = ddpnb.launch(sleeps_on_rank_1_until(flag), nprocs=2, stall=2, view="none")
    try:
        dashboard = Dashboard(run, foreground=False)
        assert _wait_for(lambda: 'data-stall="ongoing"' in dashboard.stall.value, 120), run.status
        assert 'data-state="stalled"' in dashboard.header.value
        assert (
            "rank 1 is in time.sleep" in dashboard.stall.value and "rank 0 waits in all_reduce" in dashboard.stall.value
        )
        assert dashboard.stacks.layout.display == "none"
        dashboard.stacks_button.click()
        assert _wait_for(lambda: dashboard.stacks.layout.display is None, 30)
        shown = dashboard.stacks.value
        assert 'data-rank="0"' in shown and 'data-rank="1"' in shown and "in train" in shown, shown
        assert not dashboard.stacks_button.disabled
    finally:
        Path(flag).touch()
    assert run.wait(120).outcome is Outcome.SUCCEEDED
    dashboard.finish()
    assert 'data-stall="resumed"' in dashboard.stall.value and "then progress resumed" in dashboard.stall.value


def _banner_seconds(banner: str) -> float:
    return float(re.search(r"no rank has made progress for (\d+(?:\.\d)?) s", banner).group(1))


@pytest.mark.timeout(180)
def test_a_foreground_dashboard_shows_the_stall_doctors_stacks_under_a_banner_that_counts_on(tmp_path):
    """A foreground cell can press no button and has no handle: the stacks come under the banner, taken again
    while the run stays stalled; its seconds count on; the ranks read 'stalled'."""
    pytest.importorskip("ipywidgets")
    from ddpnb.views.dashboard import Dashboard

    flag = str(tmp_path / "wake")
    train = sleeps_on_rank_1_until(flag)
    run = ddpnb.launch(train, nprocs=3, stall=2, view="none")
    try:
        dashboard = Dashboard(run, foreground=True)
        assert _wait_for(lambda: "ddpnb-stall-stack" in dashboard.stall_stacks.value, 120), run.status
        stacks = dashboard.stall_stacks.value
        assert 'data-ranks="1"' in stacks and 'data-ranks="0,2"' in stacks, stacks  # the same stack once
        rank_1 = stacks[stacks.index('data-ranks="1"') :]
        assert "time.sleep(0.1)  # rank 1&#x27;s sleep" in rank_1 and "in train" in rank_1, stacks
        assert "dist.all_reduce(torch.ones(1))" in stacks
        assert "c10d_logger" not in stacks and str(Path(ddpnb.__file__).parent) not in stacks, stacks
        assert "interrupt the kernel" in dashboard.stall.value and "run.stacks()" not in dashboard.stall.value
        assert dashboard.ranks.value.count('data-state="stalled"') == 3, dashboard.ranks.value
        assert ">stalled<" in dashboard.ranks.value

        first = _banner_seconds(dashboard.stall.value)
        assert _wait_for(lambda: _banner_seconds(dashboard.stall.value) > first + 1, 30), dashboard.stall.value
        looked = run.record.stall.diagnosis
        assert _wait_for(lambda: run.record.stall.diagnosis is not looked, 60)  # taken again, stall still on
        assert run.record.stalled and run.record.stall.diagnosis.taken > looked.taken
        assert _wait_for(lambda: 'data-ranks="1"' in dashboard.stall_stacks.value, 10)
    finally:
        Path(flag).touch()
    assert run.wait(120).outcome is Outcome.SUCCEEDED
    dashboard.finish()
    assert dashboard.stall_stacks.value == "" and 'data-stall="resumed"' in dashboard.stall.value


# --- the threshold and where a rank is, from stacks --------------------------------------------------------------


@pytest.mark.fast
def test_adaptive_threshold_is_the_floor_until_a_long_quiet_spell_raises_it():
    watch = StallWatch(2, None)
    assert watch.enabled and watch.threshold() == FLOOR
    start = watch.latest
    watch.active[0] = start + 1.0  # busy: short gaps
    watch.update(start + 1.0)
    assert watch.threshold() == FLOOR
    watch.active[1] = start + 1.0 + 20.0  # a 20 s evaluation, then progress again
    assert watch.update(start + 21.0) == 0.0
    assert watch.threshold() == FACTOR * 20.0
    assert StallWatch(2, 5.0).threshold() == 5.0 and not StallWatch(2, 0.0).enabled


@pytest.mark.fast
def test_the_wait_for_the_last_rank_to_be_placed_is_no_stall_of_the_ranks_but_counts_for_the_timeout():
    """On a cluster each node forks its ranks once it imported torch: the quiet until the last is placed is the
    launch's. The stall clock starts again then; the timeout's does not."""
    ranks = [RankRecord(rank) for rank in range(2)]
    watch = Watchdog(2, timeout=20.0, stall=3.0)
    start = watch.started
    assert watch.check(start + 5.0, ranks, None, set()) is Alarm.STALL  # without a placement: a stall
    watch = Watchdog(2, timeout=20.0, stall=3.0)
    watch.all_placed(start + 5.0)
    assert watch.check(start + 7.0, ranks, None, set()) is None
    assert watch.check(start + 8.5, ranks, None, set()) is Alarm.STALL  # 3.5 s after the last was placed
    assert watch.check(start + 21.0, ranks, None, set()) is Alarm.TIMEOUT  # counted from the start


def test_a_process_forked_from_the_forkserver_survives_a_stack_request_before_its_faulthandler_is_set():
    """SIGUSR1 asks a rank for its stacks, and its default action ends the process: the forkserver ignores it, so
    a rank asked while it still starts (no faulthandler yet) is not killed."""
    sleeper = forkserver.context().Process(target=time.sleep, args=(30,))
    sleeper.start()
    try:
        os.kill(sleeper.pid, signal.SIGUSR1)
        sleeper.join(1.0)
        assert sleeper.exitcode is None, f"the stack request ended it: exit code {sleeper.exitcode}"
    finally:
        sleeper.kill()
        sleeper.join()


def test_a_wait_in_cpp_called_from_the_users_line_counts_as_a_wait(tmp_path):
    source = tmp_path / "loop.py"
    source.write_text("def step(work, store):\n    work.wait()\n    store.get('ready')\n    total = sum(x)\n")
    running = RankRecord(rank=0, state=RankState.RUNNING)

    def stack(line: int) -> str:
        return f'Thread 0x1 (most recent call first):\n  File "{source}", line {line} in step\n'

    assert locate(running, stack(2), 1.0, False).waits_in == "work.wait"
    assert locate(running, stack(3), 1.0, False).waits_in == "store.get"
    outside = locate(running, stack(4), 1.0, False)
    assert (outside.waits_in, outside.call, outside.at) == ("", "sum", f'File "{source}", line 4')
    assert where_phrase(locate(running, "", 2.0, True)) == "has returned"
    # no line of the user's on a rank's stack: before it said it started, it is starting; after, it is elsewhere
    assert where_phrase(locate(RankRecord(rank=1), "", 2.0, False)) == "is still starting"
    assert where_phrase(locate(running, "", 2.0, False)) == "is not in your code"
    assert call_on("    if rank == 1: time.sleep(30)\n") == "time.sleep" and call_on("    return (a,\n") == ""


# --- the flight recorder (NCCL): its dumps, read and summarised ---------------------------------------------------


def _entry(record_id: int, seq: int, name: str, state: str, pg=("0", "default_pg")) -> dict:
    """One entry as torch's FlightRecorder writes it (torch/csrc/distributed/c10d/FlightRecorder.cpp)."""
    return {
        "record_id": record_id,
        "pg_id": 0,
        "process_group": pg,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{name}",
        "time_created_ns": 1_700_000_000_000_000_000 + record_id,
        "duration_ms": 0.5 if state == "completed" else None,
        "input_sizes": [[1024]],
        "input_dtypes": ["Float"],
        "output_sizes": [[1024]],
        "output_dtypes": ["Float"],
        "state": state,
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
        "retired": state == "completed",
        "timeout_ms": 600000,
        "is_p2p": False,
        "frames": [{"name": "train", "filename": "train.py", "line": 12}],
    }


def _dump(entries: list[dict]) -> dict:
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": entries[-1]["collective_seq_id"],
                "last_started_collective": -1,
                "last_completed_collective": -1,
            }
        },
        "entries": entries,
    }


def test_flight_recorder_dumps_say_each_ranks_last_collective_and_who_is_behind(tmp_path):
    completed = [_entry(i, i + 1, "all_reduce", "completed") for i in range(11)]
    dumps = {
        0: _dump([*completed, _entry(11, 12, "all_reduce", "started")]),
        1: _dump(completed),  # never issued #12: the one holding the others
        2: _dump([*completed, _entry(11, 12, "all_reduce", "started")]),
    }
    for rank, dump in dumps.items():
        (tmp_path / f"{flight.STEM}{rank}").write_bytes(pickle.dumps(dump))

    from torch.distributed.flight_recorder.components.loader import read_dump

    assert read_dump(flight.STEM, str(tmp_path / f"{flight.STEM}1"))["entries"] == completed  # torch reads ours too
    read = flight.collect(tmp_path, [0, 1, 2], since=0.0, wait=0)
    assert read == dumps
    assert flight.summarise(read, [0, 1, 2]) == [
        (
            "NCCL flight recorder, group 0 (default_pg): rank 0 #12 all_reduce (started); rank 1 #11 all_reduce "
            "(completed); rank 2 #12 all_reduce (started); behind: rank 1 (#11 of #12)"
        )
    ]
    assert flight.summarise({0: dumps[0]}, [0, 1]) == [
        (
            "NCCL flight recorder, group 0 (default_pg): rank 0 #12 all_reduce (started); no rank is behind; "
            "no entry from rank 1"
        )
    ]
    assert flight.collect(tmp_path, [0], since=time.time() + 60, wait=0) == {}  # an old dump is not this stall's


def test_flight_recorder_is_asked_through_each_ranks_pipe(tmp_path):
    env = flight.environment(tmp_path)
    # only the names the installed torch reads (2.14 here): it warns on every rank about the older NCCL ones
    assert env["TORCH_FR_BUFFER_SIZE"] == str(flight.ENTRIES) and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / flight.STEM)
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env
    pipe = tmp_path / f"{flight.STEM}0.pipe"  # what torch's monitor thread creates and reads
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    try:
        flight.request(tmp_path, [0, 1])  # rank 1 has no pipe: skipped
        assert os.read(reader, 16) == b"1"
    finally:
        os.close(reader)
    flight.request(tmp_path, [0])  # nobody reads the pipe now: refused at once, not blocking


SESSION_CELL = """%%ranks
import time, torch, torch.distributed as dist
if rank == 1:
    time.sleep(8)
dist.all_reduce(torch.ones(1))
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_session_command_that_stalls_says_where_each_rank_is_and_idle_time_is_no_stall(kernel):
    started = kernel.execute("%ddp_start -n 2 --stall 2", timeout=180)
    assert "session of 2 ranks" in started.stdout, started.text
    try:
        time.sleep(4)  # a session between commands makes no progress, and is not stalled
        assert kernel.execute("print(ddpnb._session.current_session().run.record.stall)").stdout.strip() == "None"
        executed = kernel.execute(SESSION_CELL, timeout=120)
        assert executed.error is None, executed.error
        cell = f"Cell In[{executed.count}]"
        assert (
            f"rank 1 is in time.sleep ({cell}, line 4); rank 0 waits in all_reduce ({cell}, line 5)" in executed.stdout
        ), executed.text
    finally:
        kernel.execute("%ddp_stop")


def _gpus() -> int:
    from ddpnb.core.spec import local_gpu_count

    return local_gpu_count()


def nccl_rank_1_falls_behind(rank):
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1, device=ddpnb.device())
    dist.all_reduce(tensor)  # collective #1, on every rank
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(30)  # never issues #2 while the stall is looked at
    dist.all_reduce(tensor)
    torch.cuda.synchronize()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(_gpus() < 2, reason="the NCCL flight recorder needs an NCCL run: 2 GPUs")
def test_nccl_stall_reads_every_ranks_flight_recorder_and_names_who_is_behind():
    run = ddpnb.launch(nccl_rank_1_falls_behind, gpus=2, stall=5, view="none")
    assert _wait_for(lambda: run.record.stalled, 120), run.status
    recorded = run.record.stall.diagnosis.flight
    assert len(recorded) == 1 and recorded[0].endswith("behind: rank 1 (#1 of #2)"), recorded
    assert "rank 0 #2 all_reduce" in recorded[0]
    assert all((run.record.run_dir / f"{flight.STEM}{rank}").exists() for rank in (0, 1))
    assert run.wait(120).outcome is Outcome.SUCCEEDED
