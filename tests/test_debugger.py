"""A debugger in the cell (issue 29): `breakpoint()` on a rank asks the front end through the kernel's stdin
channel, as `input()` does in a cell; without a front end that takes input it is skipped with a note. Through a
real kernel and real ranks: jupyter_client answers the `input_request`s as JupyterLab's input box would."""

from __future__ import annotations

import re

import pytest

from tests.conftest import Kernel, wait_gone

pytestmark = pytest.mark.timeout(300)

BREAKPOINT_CELL = """%%ddp -n 2 --timeout 5 -o total
def train(rank, world_size):
    import torch, torch.distributed as dist
    value = torch.ones(1) * (rank + 1)
    if rank == 1:
        {stop}
    dist.all_reduce(value)
    return value.item()
"""


@pytest.fixture(scope="module")
def kernel():
    kernel = Kernel(env={"DDPNB_VIEW": "text"})  # the ranks' lines as the cell's own output
    kernel.execute("%load_ext ddpnb\nimport time, ddpnb")
    yield kernel
    kernel.shutdown()


def answers(*lines: str, wait_first: float = 0.0):
    """The front end's answers, in turn; the first after `wait_first` seconds (a user reading the prompt)."""
    import time

    queue = list(lines)

    def answer(prompt: str) -> str:
        if wait_first and len(queue) == len(lines):
            time.sleep(wait_first)
        return queue.pop(0) if queue else "c"

    return answer


@pytest.mark.parametrize("stop", ["breakpoint()", "dist.breakpoint(rank=1)"])
def test_a_breakpoint_on_rank_1_prompts_in_the_cell_and_neither_times_out_nor_stalls(kernel, stop):
    """Issue 29, acceptance 1 and 2: the prompt names rank 1; `p rank` answers 1; 8 s at the prompt outlast
    `--timeout 5`, yet after `c` the run succeeds, never marked stalled, and rank 0's result arrives."""
    cell = BREAKPOINT_CELL.format(stop=stop)
    if stop.startswith("dist."):  # torch's own: rank 1 stops, every rank meets at a barrier after it
        cell = cell.replace(f"    if rank == 1:\n        {stop}\n", f"    {stop}\n")
    run = kernel.execute(cell, timeout=120, answer=answers("p rank", "c", wait_first=8))
    assert run.error is None, run.text + str(run.error)
    assert run.prompts[:2] == ["(rank 1) (Pdb) ", "(rank 1) (Pdb) "], run.prompts
    assert re.search(r"^> Cell In\[\d+\], line \d+, in train\(\)$", run.stdout, re.MULTILINE), run.stdout
    assert re.search(r"^1$", run.stdout, re.MULTILINE), run.stdout  # `p rank`'s answer, shown before the next prompt
    after = kernel.execute("print(total, ddpnb.last_run().outcome.value, ddpnb.last_run().stall)")
    assert after.stdout.split() == ["3.0", "succeeded", "None"], after.text


def test_without_a_front_end_that_takes_input_a_breakpoint_is_skipped_with_a_note(kernel):
    """Issue 29, acceptance 6: as under nbclient (no stdin), the cell finishes, with a note naming the rank and
    its cell line."""
    run = kernel.execute(BREAKPOINT_CELL.format(stop="breakpoint()"), timeout=120)
    assert run.error is None, run.text
    assert re.search(
        r"\[rank 1\] \[ddpnb\] breakpoint\(\) on rank 1 at Cell In\[\d+\], line 6 skipped: this front "
        r"end takes no input",
        run.stderr,
    ), run.stderr
    assert kernel.execute("print(total)").stdout.strip() == "3.0"


def test_an_interrupt_at_a_prompt_ends_the_run_and_leaves_nothing(kernel):
    """Issue 29, acceptance 7: Ctrl-C (the kernel's interrupt) while the front end shows rank 1's prompt: the cell
    ends as any interrupted run does, with every rank gone."""
    interrupted = []

    def interrupt(prompt: str) -> str:
        kernel.manager.interrupt_kernel()
        interrupted.append(prompt)
        return ""  # never read: the interrupt ended the input

    run = kernel.execute(BREAKPOINT_CELL.format(stop="breakpoint()"), timeout=60, answer=interrupt)
    assert interrupted == ["(rank 1) (Pdb) "]
    assert run.error is not None and run.error["ename"] == "RunInterrupted", run.text
    pids = [int(pid) for pid in kernel.execute("print(*[r.pid for r in ddpnb.last_run().ranks])").stdout.split()]
    assert len(pids) == 2 and wait_gone(pids, within=10) == []


def test_debug_opens_a_post_mortem_at_the_raising_line_and_leaving_it_ends_the_run_failed(kernel):
    """Issue 29, acceptance 3: with --debug, rank 1 raises: a post-mortem prompt at the raising line; `p` of a
    local shows its value; `q` ends the run, failed, with the usual report; no rank is left."""
    run = kernel.execute(
        """%%ddp -n 2 --debug
def train(rank, world_size):
    import torch, torch.distributed as dist
    batch = torch.ones(3) * 7
    if rank == 1:
        raise ValueError("bad batch")
    dist.all_reduce(batch)
""",
        timeout=120,
        answer=answers("p batch", "q"),
    )
    assert run.prompts == ["(rank 1) (Pdb) ", "(rank 1) (Pdb) "], run.prompts
    assert re.search(r"^> Cell In\[\d+\], line 6, in train\(\)$", run.stdout, re.MULTILINE), run.stdout
    assert "tensor([7., 7., 7.])" in run.stdout
    assert run.error is not None and run.error["ename"] == "WorkerError", run.text
    assert "rank 1 of 2 failed first: ValueError: bad batch" in "\n".join(run.error["traceback"])
    pids = [int(pid) for pid in kernel.execute("print(*[r.pid for r in ddpnb.last_run().ranks])").stdout.split()]
    assert len(pids) == 2 and wait_gone(pids, within=10) == []


@pytest.mark.parametrize("after_peer", ["knock-on", "own-error"])
def test_debug_asks_only_the_rank_that_failed_first(kernel, after_peer):
    """--debug's post-mortem is the first failure's. Rank 0 ignores SIGTERM, so it outlives the stop long enough to
    see rank 1 go: gloo's peer error there (a knock-on) opens no post-mortem and reaches the report as rank 0's
    own failure; an error of its own raised then opens one on the rank, but a run being stopped asks nobody."""
    raise_after = "raise" if after_peer == "knock-on" else 'raise ValueError("rank 0 after its peer")'
    run = kernel.execute(
        f"""%%ddp -n 2 --debug
def train(rank, world_size):
    import signal, torch, torch.distributed as dist
    batch = torch.ones(3) * 7
    if rank == 1:
        raise ValueError("bad batch")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        dist.all_reduce(batch)
    except RuntimeError:
        {raise_after}
""",
        timeout=120,
        answer=answers("q"),
    )
    assert run.prompts == ["(rank 1) (Pdb) "], run.prompts
    assert run.error is not None and run.error["ename"] == "WorkerError", run.text
    assert "rank 1 of 2 failed first: ValueError: bad batch" in "\n".join(run.error["traceback"])
    ranks = kernel.execute(
        "r = ddpnb.last_run()\nprint(*[r.pid for r in r.ranks])\nprint(*[f.rank for f in r.failures if f.knock_on])"
    )
    pids, knocked_on = ranks.stdout.splitlines()
    if after_peer == "knock-on":  # rank 0 reported its peer error at once, instead of waiting at a prompt
        assert knocked_on == "0", ranks.text
    assert wait_gone([int(pid) for pid in pids.split()], within=10) == []


def test_debug_of_an_error_about_a_ddpnb_call_opens_at_the_users_line(kernel):
    """ddpnb.log's error about its arguments ends its traceback on the user's line, and --debug's post-mortem
    opens there too, with the user's locals: ddpnb's frame below it is the user's to reach with `down` only."""
    run = kernel.execute(
        """%%ddp -n 1 --debug
def train(rank):
    import ddpnb
    losses = [1.5, 2.5]
    ddpnb.log(loss=losses)
""",
        timeout=120,
        answer=answers("p losses", "q"),
    )
    assert run.prompts == ["(rank 0) (Pdb) ", "(rank 0) (Pdb) "], run.prompts
    assert re.search(r"^> Cell In\[\d+\], line 5, in train\(\)$", run.stdout, re.MULTILINE), run.stdout
    assert "[1.5, 2.5]" in run.stdout, run.stdout
    assert "[ddpnb] train on 1 rank, backend gloo" in run.stdout, run.stdout  # one GPU's run reads right
    assert run.error is not None and "ddpnb.log: loss must be a number" in "\n".join(run.error["traceback"])


def test_a_line_typed_at_a_prompt_the_run_ended_meanwhile_is_not_sent_and_that_is_said(kernel, tmp_path):
    """Rank 1 waits at its breakpoint; while the input box shows its prompt, rank 0 fails and the run stops rank 1.
    The line typed then reaches no rank, and the cell says why before the run's usual report."""

    def answer_once_rank_1_is_gone(prompt: str) -> str:
        (tmp_path / "asked").touch()  # rank 0 fails now
        pid = int((tmp_path / "rank1.pid").read_text())
        assert wait_gone([pid], within=60) == [], "rank 1 was not stopped"
        return "p rank"

    run = kernel.execute(
        f'''%%ddp -n 2
def train(rank, world_size):
    import os, pathlib, time
    if rank == 1:
        pathlib.Path("{tmp_path}/rank1.pid").write_text(str(os.getpid()))
        breakpoint()
    while not pathlib.Path("{tmp_path}/asked").exists():
        time.sleep(0.05)
    raise ValueError("rank 0 fails while rank 1 is at its prompt")
''',
        timeout=120,
        answer=answer_once_rank_1_is_gone,
    )
    assert run.prompts == ["(rank 1) (Pdb) "], run.prompts
    assert (
        "[ddpnb] 'p rank' was not sent: rank 1 no longer waits at that prompt: the run is ending (rank 0 "
        "raised ValueError)" in run.stdout
    ), run.stdout
    assert (
        run.error is not None
        and "rank 0 of 2 failed first: ValueError: rank 0 fails while rank 1 is at its prompt"
        in "\n".join(run.error["traceback"])
    ), run.text


def test_debug_without_a_front_end_that_takes_input_says_so_and_the_run_fails_as_usual(kernel):
    run = kernel.execute(
        """%%ddp -n 2 --debug
def train(rank):
    raise ValueError("bad batch")
""",
        timeout=120,
    )
    assert "[ddpnb] --debug needs a front end that takes input" in run.stderr, run.stderr
    assert run.error is not None and run.error["ename"] == "WorkerError", run.text


def test_a_session_rank_debugs_its_last_error_and_a_breakpoint_in_a_cell_then_the_session_goes_on(kernel):
    """Issue 29, acceptance 4: a `%%ranks` cell fails on rank 0; `%ddp_debug 0` opens post-mortem there, its
    namespace intact; a breakpoint() in a later cell prompts too; the session still works afterwards."""
    started = kernel.execute("%ddp_start -n 2", timeout=120, answer=answers())
    assert started.error is None, started.text
    try:
        failed = kernel.execute(
            '%%ranks\nsecret = 41 + rank\nif rank == 0:\n    raise ValueError("boom")\n', timeout=60, answer=answers()
        )
        assert failed.error is not None and "boom" in "\n".join(failed.error["traceback"]), failed.text
        debugged = kernel.execute("%ddp_debug 0", timeout=60, answer=answers("p secret", "q"))
        assert debugged.error is None, debugged.text
        assert debugged.prompts == ["(rank 0) (Pdb) ", "(rank 0) (Pdb) "], debugged.prompts
        assert re.search(r"^> Cell In\[\d+\], line 4, in <module>\(\)$", debugged.stdout, re.MULTILINE), debugged.stdout
        assert re.search(r"^41$", debugged.stdout, re.MULTILINE), debugged.stdout
        stepped = kernel.execute("%%ranks 1\nx = 5\nbreakpoint()\nx + 1\n", timeout=60, answer=answers("p x", "c"))
        assert stepped.error is None, stepped.text
        assert stepped.prompts[:1] == ["(rank 1) (Pdb) "] and re.search(r"^5$", stepped.stdout, re.MULTILINE)
        assert "6" in "".join(stepped.results), stepped.text
        after = kernel.execute("%ranks secret", timeout=60)
        assert after.error is None and "41" in "".join(after.results) and "42" in "".join(after.results), after.text
    finally:
        kernel.execute("%ddp_stop", timeout=60)


def test_debug_in_the_kernel_after_a_failed_run_points_at_the_ranks_frames(kernel):
    """Issue 29: `%debug` right after a failed `%%ddp` cell would open pdb in ddpnb's frames in the kernel; it says
    how to reach the rank's frames instead, and asks nothing. After any other error it is IPython's own."""
    failed = kernel.execute(
        """%%ddp -n 2
def train(rank, world_size):
    batch = list(range(3))
    if rank == 1:
        raise ValueError("bad batch")
""",
        timeout=120,
    )
    assert failed.error is not None and failed.error["ename"] == "WorkerError", failed.text
    pointed = kernel.execute("%debug", answer=answers("q"))
    assert pointed.prompts == [], pointed.prompts  # no pdb opened in the kernel
    assert pointed.stdout.startswith(
        "[ddpnb] The error came from rank 1's process, which has ended; its locals "
        "where it raised are kept in `ddpnb.last_run().first_failure.frames`. To debug "
        "it on the rank, run the cell again with `%%ddp --debug`"
    ), pointed.stdout
    plain = kernel.execute("1 / 0")
    assert plain.error is not None and plain.error["ename"] == "ZeroDivisionError"
    own = kernel.execute("%debug", answer=answers("q"))
    assert own.prompts and "ipdb>" in own.prompts[0], own.prompts  # IPython's post-mortem of the kernel's error
    statement = kernel.execute("x = 42\n%debug print('{x}')", answer=answers("c"))
    assert "{x}" in statement.stdout, statement.text  # the statement as typed, as IPython's own %debug takes it
    kernel.execute("%ddp_start -n 2", timeout=120)
    try:
        ranks = kernel.execute("%%ranks\nraise KeyError(rank)", timeout=60)
        assert ranks.error is not None, ranks.text
        session = kernel.execute("%debug", answer=answers("q"))
        assert session.prompts == [] and session.stdout.startswith(
            "[ddpnb] The error came from the session's ranks, whose namespaces are intact: `%ddp_debug RANK`"
        ), session.stdout
    finally:
        kernel.execute("%ddp_stop", timeout=60)


def test_a_background_runs_breakpoint_is_answered_from_a_later_cell_with_debug(kernel):
    """Issue 29: the cell of a `--background` run has returned, so no input box waits for it; its rank waits at
    the prompt (the timeout's clock held) until `job.debug(1)` in a later cell answers it there."""
    started = kernel.execute(
        BREAKPOINT_CELL.format(stop="breakpoint()").replace(
            "%%ddp -n 2 --timeout 5 -o total", "%%ddp -n 2 --timeout 5 --background -o job"
        ),
        timeout=60,
        answer=answers(),
    )  # a front end that takes input, as JupyterLab is; this cell asks nothing
    assert started.error is None and started.prompts == [], started.text
    waited = kernel.execute(
        "import time\n"
        "deadline = time.monotonic() + 60  # only keeps a rank that never stops from hanging the test\n"
        "while not job.record.ranks[1].breakpoint_at and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "time.sleep(6)  # longer than --timeout 5: a rank at a prompt is not timed\n"
        "job.debug(0)\n"
        "print(job.record.ranks[1].breakpoint_at)"
    )
    assert waited.stdout.splitlines()[-2:] == [
        "[ddpnb] rank 0 is not at a debugger prompt; rank 1 is: .debug(1).",
        f"Cell In[{started.count}], line 7, in train",
    ], waited.stdout
    debugged = kernel.execute("job.debug(1)", timeout=60, answer=answers("p rank", "c"))
    assert debugged.prompts == ["(rank 1) (Pdb) ", "(rank 1) (Pdb) "], debugged.prompts
    assert re.search(r"^1$", debugged.stdout, re.MULTILINE), debugged.stdout
    assert kernel.execute("print(job.result())", timeout=60).stdout.strip().endswith("3.0")
