"""Interactive sessions (`%ddp_start`, `%%ranks`, `ddpnb.session`): ranks that keep their state across cells and
fail the way runs do. Every test drives a real Jupyter kernel or real rank processes; CPU ranks over gloo."""

from __future__ import annotations

import os
import re
import signal
import textwrap
import threading

import pytest
import torch

import ddpnb
from tests.conftest import PACKAGE_DIR, Kernel, left_in_groups, wait_gone
from tests.test_faults import Cell

# a cell that fails or hangs gets GRACE (5 s) for the other ranks, STACK_WAIT (3 s) for their stacks, then the
# stop: the bound is that behaviour, with room for a busy 2-core machine
ENDS_WITHIN = 60


@pytest.fixture(scope="module")
def session_kernel():
    kernel = Kernel(env={"DDPNB_VIEW": "text"})
    kernel.execute("%load_ext ddpnb\nimport os, signal, time")
    started = kernel.execute("%ddp_start -n 2", timeout=300)
    assert started.error is None and "[ddpnb] session of 2 ranks" in started.stdout, started.text
    yield kernel
    kernel.execute("%ddp_stop", timeout=60)
    kernel.shutdown()


def pids_of(kernel: Kernel) -> list[int]:
    shown = kernel.execute("print(*ddpnb._session.current_session().pids)").stdout.split()
    return [int(pid) for pid in shown]


def test_state_survives_across_cells_and_values_come_back_per_rank(session_kernel):
    defined = session_kernel.execute(
        textwrap.dedent("""\
        %%ranks
        import torch, torch.distributed as dist
        model = torch.nn.Linear(2, 1)
        t = torch.ones(1) * (rank + 1)
        world_size
    """)
    )
    assert defined.error is None, defined.text
    assert defined.results == ["[rank 0] 2\n[rank 1] 2"]
    reduced = session_kernel.execute(
        textwrap.dedent("""\
        %%ranks -o sums
        dist.all_reduce(t)
        print("reduced on", rank, "to", t.item())
        (t.item(), model.weight.shape[1])
    """)
    )
    assert reduced.error is None, reduced.text
    assert "[rank 0] reduced on 0 to 3.0" in reduced.stdout and "[rank 1] reduced on 1 to 3.0" in reduced.stdout
    bound = session_kernel.execute("print(sums, sums.ranks)")
    assert bound.stdout.strip() == "[(3.0, 2), (3.0, 2)] [0, 1]"


def test_some_ranks_only_and_the_line_form(session_kernel):
    only_one = session_kernel.execute("%%ranks 1\nprint('only here')\nrank")
    assert only_one.error is None and only_one.results == ["[rank 1] 1"], only_one.text
    assert "[rank 1] only here" in only_one.stdout and "[rank 0]" not in only_one.stdout
    line = session_kernel.execute("x = %ranks rank * 10\nprint(x == [0, 10])")
    assert line.stdout.strip() == "True", line.text


def test_an_error_on_one_rank_shows_its_traceback_and_keeps_every_namespace(session_kernel):
    session_kernel.execute("%%ranks\nkept = rank + 100")
    failed = session_kernel.execute(
        textwrap.dedent("""\
        %%ranks
        kept = kept + 1
        if rank == 1:
            raise ValueError("bad shard on purpose")
        'fine'
    """)
    )
    assert failed.error is not None and failed.error["ename"] == "SessionError", failed.text
    shown = "\n".join(failed.error["traceback"])
    assert "failed on rank 1 of 2: ValueError: bad shard on purpose" in shown
    assert re.search(r"Cell In\[\d+\], line 4", shown) and 'raise ValueError("bad shard on purpose")' in shown
    assert PACKAGE_DIR not in shown and "--- rank 0 ---" not in shown
    after = session_kernel.execute("%ranks kept")
    assert after.results == ["[rank 0] 101\n[rank 1] 102"], after.text  # as the failed cell left them


def test_a_rank_failing_before_a_collective_breaks_the_session_and_restart_gives_fresh_ranks(session_kernel):
    before = pids_of(session_kernel)
    stuck = session_kernel.execute(
        textwrap.dedent("""\
        %%ranks
        import torch, torch.distributed as dist
        if rank == 1:
            raise RuntimeError("rank 1 gives up")
        dist.all_reduce(torch.ones(1))
    """),
        timeout=ENDS_WITHIN,
    )  # the cell ends: execute raises TimeoutError if it has not by then
    assert stuck.error is not None and stuck.error["ename"] == "SessionBroken", stuck.text
    shown = "\n".join(stuck.error["traceback"])
    assert re.search(r"rank 0 is stuck in all_reduce, at Cell In\[\d+\], line 5", shown), shown
    assert "RuntimeError: rank 1 gives up" in shown and "%ddp_restart" in shown
    # the root cause first, then the rank it left stuck
    assert shown.index("rank 1 of 2 failed first: RuntimeError: rank 1 gives up") < shown.index("did not come back")
    assert wait_gone(before, within=15) == []
    refused = session_kernel.execute("%ranks 1 + 1")
    assert refused.error is not None and "this session is stopped (rank 0 stuck)" in "\n".join(
        refused.error["traceback"]
    )

    restarted = session_kernel.execute("%ddp_restart", timeout=120)
    assert restarted.error is None, restarted.text
    after = pids_of(session_kernel)
    assert len(after) == 2 and not set(after) & set(before)
    fresh = session_kernel.execute("%ranks 'kept' in globals(), 'model' in globals()")
    assert fresh.results == ["[rank 0] (False, False)\n[rank 1] (False, False)"], fresh.text
    works = session_kernel.execute(
        "%%ranks\nimport torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert works.results == ["[rank 0] 2.0\n[rank 1] 2.0"], works.text


def test_interrupting_a_cell_raises_keyboard_interrupt_in_the_ranks_and_keeps_their_state(session_kernel):
    session_kernel.execute("%%ranks\nstate = [rank]")
    cell = Cell(session_kernel, "%%ranks\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)")
    # both ranks are asleep: their lines, folded into one when they came together
    cell.read_until(lambda seen: "[ranks 0,1] sleeping" in seen.stdout or seen.stdout.count("sleeping") == 2)
    session_kernel.manager.interrupt_kernel()
    result = cell.finish(timeout=ENDS_WITHIN)
    assert result.error is not None and result.error["ename"] == "SessionError", result.text
    shown = "\n".join(result.error["traceback"])
    assert "interrupted on ranks 0, 1 of 2" in shown and "KeyboardInterrupt" in shown
    # both ranks were at the same line: one traceback, for both
    assert "--- ranks 0, 1 ---" in shown and "--- rank 0 ---" not in shown, shown
    kept = session_kernel.execute("%ranks state")
    assert kept.results == ["[rank 0] [0]\n[rank 1] [1]"], kept.text


def test_a_cell_timeout_interrupts_the_ranks_and_keeps_the_session(session_kernel):
    timed = session_kernel.execute(
        "%%ranks --timeout 1\nimport time\nslept = 'started'\ntime.sleep(600)", timeout=ENDS_WITHIN
    )
    assert timed.error is not None and timed.error["ename"] == "SessionError", timed.text
    assert "interrupted on ranks 0, 1 of 2" in "\n".join(timed.error["traceback"])
    assert session_kernel.execute("%ranks slept").results == ["[rank 0] 'started'\n[rank 1] 'started'"]


def test_a_syntax_error_in_a_ranks_cell_is_shown_as_python_shows_it_and_reaches_no_rank(session_kernel):
    """Checked in the kernel before anything is sent: Python's own SyntaxError, pointing at the cell's line, once
    (not once per rank, through ddpnb's frames); no statement of the cell ran on any rank."""
    failed = session_kernel.execute("%%ranks\nbefore_the_error = 1\nif rank == 0\n    pass\n")
    assert failed.error is not None and failed.error["ename"] == "SyntaxError", failed.text
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(failed.error["traceback"]))  # IPython 9 colours every part
    assert re.search(r"Cell In\[\d+\], line 3", shown), shown  # the cell's line 3, counting %%ranks
    assert "if rank == 0" in shown and "expected ':'" in shown, shown
    assert "ast.py" not in shown and "--- rank" not in shown and "ddpnb" not in shown, shown
    assert session_kernel.execute("%ranks 'before_the_error' in globals()").results == [
        "[rank 0] False\n[rank 1] False"
    ]


def test_a_second_start_is_refused_while_a_session_runs(session_kernel):
    again = session_kernel.execute("%ddp_start -n 2")
    assert again.stderr.startswith("UsageError: a session of 2 ranks is already running"), again.text
    assert session_kernel.execute("%ranks rank").results == ["[rank 0] 0\n[rank 1] 1"]  # the first one goes on


def test_killing_the_kernel_takes_every_session_rank_with_it():
    doomed = Kernel(env={"DDPNB_VIEW": "text"})
    try:
        doomed.execute("%load_ext ddpnb")
        assert doomed.execute("%ddp_start -n 2", timeout=300).error is None
        pids = pids_of(doomed)
        os.kill(doomed.pid, signal.SIGKILL)
        assert wait_gone(pids, within=15) == []
    finally:
        doomed.client.stop_channels()
        doomed.manager.cleanup_resources()


def _double(x):
    return {"rank": int(os.environ["RANK"]), "twice": x * 2}


def test_push_pull_and_call_from_python():
    with ddpnb.session(nprocs=2) as session:
        session.push(config={"lr": 0.1, "layers": [1, 2]}, weights=torch.arange(4.0))
        pulled = session.pull("config", "weights")
        assert pulled.ranks == [0, 1]
        for config, weights in pulled:
            assert config == {"lr": 0.1, "layers": [1, 2]} and torch.equal(weights, torch.arange(4.0))
        assert session.call(_double, 21) == [{"rank": 0, "twice": 42}, {"rank": 1, "twice": 42}]
        assert session.pull("weights", ranks=[1]).by_rank().keys() == {1}
        with pytest.raises(ddpnb.SessionError, match="name 'missing' is not defined"):
            session.pull("missing")
        # bad input: refused here, before anything is sent, saying what to pass; the session goes on
        refused = [
            (lambda: session.execute(5), TypeError, "code must be a string of Python, not int"),
            (
                lambda: session.execute("rank", ranks="0,1"),
                ValueError,
                r"ranks takes rank numbers, e.g. ranks=\[0, 2\] .* not .0,1.\.$",
            ),
            (lambda: session.execute("rank", ranks=[True]), ValueError, "ranks takes rank numbers"),
            (lambda: session.execute("rank", timeout="3"), ValueError, "timeout must be a positive number of seconds"),
            (lambda: session.execute("rank", timeout=-1), ValueError, "timeout must be a positive number of seconds"),
            (lambda: session.execute("x = (", ranks=[0]), SyntaxError, r"'\(' was never closed"),
            (lambda: session.push(**{"1x": 3}), ValueError, "push binds Python names, and '1x' is not one"),
            (
                lambda: session.push(lock=threading.Lock()),
                ddpnb.NotPicklableError,
                r"cannot send the pushed values to the worker processes: push -> \['lock'\] -> _thread.lock cannot",
            ),
            (
                lambda: session.call(_double, threading.Lock()),
                ddpnb.NotPicklableError,
                r"cannot send the call to the worker processes: args -> \[0\] -> _thread.lock cannot be pickled",
            ),
            (lambda: session.call(5), TypeError, "call runs a function on the ranks, and int is not one"),
        ]
        for call, kind, said in refused:
            with pytest.raises(kind, match=said):
                call()
        assert session.execute("rank", ranks=1) == [1]  # one rank, as a number
        assert session.pull("config")[0] == {"lr": 0.1, "layers": [1, 2]}  # nothing of it reached a rank
        pids = session.pids
    assert left_in_groups(pids, within=15) == []
    assert session.run.record.outcome is ddpnb.Outcome.SUCCEEDED  # the ranks left when asked


def test_a_rank_that_dies_ends_the_session_and_names_how():
    session = ddpnb.session(nprocs=2)
    try:
        with pytest.raises(ddpnb.SessionBroken) as broken:
            session.execute(
                "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                "import time\ntime.sleep(60)"
            )
        assert "rank 1 of 2 failed first: killed by SIGKILL" in str(broken.value)
        assert left_in_groups([pid for pid in session.pids if pid], within=15) == []
    finally:
        session.stop()


def test_a_pushed_big_tensor_reaches_every_rank_through_shared_memory_copy_on_write():
    big = torch.arange(16 << 20, dtype=torch.float32)  # 64 MB
    expected = big.double().sum().item()  # exact: float32 sums differ with the thread count
    with ddpnb.session(nprocs=2) as session:
        session.push(big=big)
        assert session.data.written == big.nbytes and session.data.blocks == 1  # one copy, in shared memory
        assert session.execute("big.double().sum().item()") == [expected, expected]
        session.execute("big.add_(1)", ranks=[1])  # in place, in rank 1 alone
        assert session.execute("big[:3].tolist()") == [[0.0, 1.0, 2.0], [1.0, 2.0, 3.0]]
        assert big[:3].tolist() == [0.0, 1.0, 2.0]  # the notebook's tensor is its own
        # the tensor arrived mapped from the kernel's memory file, not as a copy unpickled into the rank
        maps = session.execute("open('/proc/self/maps').read().count('ddpnb-data')")
        assert all(count >= 1 for count in maps), maps
        session.push(big=big)  # unchanged since: not written again
        assert session.data.written == 0 and session.data.reused == big.nbytes
        assert session.execute("big[:2].tolist()") == [[0.0, 1.0], [0.0, 1.0]]


def test_a_kernel_with_a_session_and_a_background_run_shuts_down_ending_them_first_and_leaving_nothing():
    """A JupyterLab restart: the kernel's shutdown request ends ddpnb's runs, its session, its forkserver and
    multiprocessing's resource tracker first (`ddpnb._end_first_at_shutdown`), so ipykernel finds no child of
    its own left to signal; nothing is left. (How long it takes is measured in bench/run.py, section 10.)"""
    import psutil

    kernel = Kernel()
    try:
        kernel.execute("%load_ext ddpnb")
        assert kernel.execute("%ddp_start -n 2", timeout=180).error is None
        kernel.execute(
            "import time\ndef sleeps(rank):\n    time.sleep(300)\n"
            "bg = ddpnb.launch(sleeps, nprocs=2, view='none')\n"
            "while len([r for r in bg.record.ranks if r.pid]) < 2:\n    time.sleep(0.05)",
            timeout=180,
        )
        children = psutil.Process(kernel.pid).children(recursive=True)
        names = " ".join(" ".join(child.cmdline()) for child in children)
        assert "multiprocessing.forkserver" in names and "multiprocessing.resource_tracker" in names, names
        process = kernel.manager.provisioner.process
        kernel.manager.shutdown_kernel(now=False)
        assert process.returncode == 0  # it exited by itself, not killed by jupyter_client
    finally:
        kernel.client.stop_channels()
    assert wait_gone([child.pid for child in children], within=10) == []


def test_a_script_that_ends_with_its_session_still_running_exits_and_takes_the_ranks_with_it(tmp_path):
    """Without `.stop()`: the session ends as the script does (multiprocessing's exit handler would otherwise wait
    for its ranks, which wait for commands, forever)."""
    import subprocess
    import sys

    script = tmp_path / "leaves_a_session.py"
    script.write_text(
        "import ddpnb\nsession = ddpnb.session(nprocs=2)\n"
        "print('PIDS', *[rank.pid for rank in session.run.record.ranks], flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    pids = [int(pid) for pid in done.stdout.split("PIDS", 1)[1].split()]
    assert len(pids) == 2 and wait_gone(pids, within=10) == []
