"""The engine contract: every engine (local, Ray, Slurm, and the scripted fake) keeps the protocol's promises
(`core/engine.py`), seen the way users see them, through `ddpnb.launch`, `run.stacks()`, `run.stop()`,
`run.wait()` and the record: every rank starts and rank 0's value comes back; each rank's events come in order;
a stop ends every rank as stopped, and a rank that ignores it is stopped harder; the stacks name the user's line;
a rank killed from outside is reported exited with the others stopped; and nothing of a run outlives it.

The real engines run the functions below; the fake plays the same story from a script, so one test holds both to
one promise. Ray runs on a local instance started in this process for the module's tests, Slurm on the session's
two-node cluster of tests/slurm_cluster.py (conftest's `cluster`); each is skipped, saying why, where it is not
installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import pytest

import ddpnb
from ddpnb import engines
from ddpnb.core.record import Outcome, RankState
from tests import fake_engine, slurm_cluster
from tests.conftest import RAY_TRAIN_POLL, left_in_groups, wait_gone
from tests.fake_engine import Exit, Gate, Print, Script, raises, returned, started

STARTED_WAIT = 240.0  # seconds for every rank to say it is up (a cap: Ray's first launch on a busy 2-core machine)
HAVE_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.train") is not None


# --- what the real engines' ranks run ---------------------------------------------------------------------------
# sent by value, as a notebook's functions are: a Ray or Slurm rank cannot import this test module
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def returns(rank, world_size):
    print(f"rank {rank} of {world_size} here", flush=True)
    ddpnb.log(step=1, value=rank)
    return {"rank": rank, "world_size": world_size}


def sleeps(rank):
    print(f"rank {rank} up", flush=True)
    time.sleep(300)  # where every rank is


def fails_on_rank_1(rank):
    print(f"rank {rank} up", flush=True)
    if rank == 1:
        raise ValueError("rank 1 fails")
    time.sleep(300)


def ignores_sigterm_on_rank_0(rank):
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"rank {rank} up", flush=True)
    time.sleep(300)


def trains_and_fails_once(rank, world_size, ray_train=False):
    """40 steps of DDP, a checkpoint every 10; rank 1 is SIGKILLed at step $FAIL_AT of attempt 0 (never where it is
    unset). `ray_train`: also return the checkpoint Ray Train restarted the workers with."""
    import os
    import signal

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    reported = None
    if ray_train and ddpnb.attempt():
        import ray.train

        reported = ray.train.get_checkpoint()
    start = ddpnb.load_checkpoint({"model": model, "opt": opt})
    print(f"attempt {ddpnb.attempt()} starts from step {start}", flush=True)
    for step in range(start or 0, 40):
        if rank == 1 and ddpnb.attempt() == 0 and step == int(os.environ.get("FAIL_AT", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 10 == 0:
            ddpnb.save_checkpoint({"model": model, "opt": opt}, step=step + 1)
    return {
        "start": start,
        "attempt": ddpnb.attempt(),
        "state": model.module.state_dict(),
        "ray_checkpoint": reported and os.path.basename(reported.path),
    }


# --- each engine, set up once for the module ----------------------------------------------------------------------
@dataclass
class Contract:
    """One engine under the contract: how to launch on it, kill a rank from outside, and see what is left."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)  # the engine's own (Slurm: both nodes)
    nothing_left: Callable[[list[int]], list[str]] = lambda pids: []
    runs: list[Any] = field(default_factory=list)

    @property
    def fake(self) -> bool:
        return self.name == "fake"

    def launch(self, fn: Callable[..., Any], script: Script, nprocs: int = 2) -> Any:
        """`fn` on the real engines; on the fake, `script` plays what `fn` does."""
        options = {"script": script} if self.fake else dict(self.options)
        run = ddpnb.launch(fn, engine=self.name, nprocs=nprocs, view="none", **options)
        self.runs.append(run)
        return run

    def kill(self, run: Any, rank: int, gate: threading.Event) -> None:
        """SIGKILL the rank's process from outside (the fake's script kills it once `gate` is set)."""
        if self.fake:
            gate.set()
        else:
            os.kill(run.record.ranks[rank].pid, signal.SIGKILL)

    def left(self, run: Any) -> list[str]:
        """What of `run` still runs: its ranks' processes (and their groups), and what the engine keeps for it."""
        if self.fake:
            return [repr(engine) for engine in fake_engine.open_engines()]
        pids = [r.pid for r in run.record.ranks if r.pid]
        return [str(pid) for pid in wait_gone(pids, within=30)] + self.nothing_left(pids)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for key, value in values.items():
            patch.setenv(key, value)
        yield


def _local() -> Iterator[Contract]:
    yield Contract("local", nothing_left=lambda pids: left_in_groups(pids))  # a local rank leads its own group


def _fake() -> Iterator[Contract]:
    yield Contract("fake")


def _ray() -> Iterator[Contract]:
    if not HAVE_RAY:
        pytest.skip("ray[train] is not installed (pip install -e '.[ray]'): the Ray engine's contract cannot run")
    import ray

    def cpus_held(pids: list[int]) -> list[str]:  # a run's placement group must go with it
        deadline = time.monotonic() + 60
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        free = ray.available_resources().get("CPU", 0)
        return [] if free >= 2 else [f"Ray's CPUs still held: {free} of 2 free"]

    with _environ({"RAY_ADDRESS": "local", "RAY_USAGE_STATS_ENABLED": "0", **RAY_TRAIN_POLL}):
        try:
            yield Contract("ray", nothing_left=cpus_held)
        finally:
            ray.shutdown()


def _slurm(cluster: slurm_cluster.Cluster) -> Iterator[Contract]:
    from tests.test_slurm import ranks_left, steps_left

    with _environ({**cluster.env, "SLURM_JOB_ID": cluster.job}):
        yield Contract("slurm", options={"nodes": 2}, nothing_left=lambda pids: ranks_left() + steps_left(cluster))


SETUPS = {"local": _local, "ray": _ray, "slurm": _slurm, "fake": _fake}
ENGINES = [
    pytest.param("local"),
    pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow]),
    pytest.param("slurm", marks=pytest.mark.slow),
    pytest.param("fake", marks=pytest.mark.fast),
]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request) -> Iterator[Contract]:
    if request.param == "slurm":  # the session's cluster (conftest.py), asked for only where Slurm's case runs
        yield from _slurm(request.getfixturevalue("cluster"))
    else:
        yield from SETUPS[request.param]()


# bench/loadgen.py's simulated ranks run no function (only what ranks send, for the kernel's load): the promises
# here are about running one
NO_FUNCTION = {"sim"}


@pytest.mark.fast
def test_every_registered_engine_is_held_to_the_contract():
    assert set(engines.names()) - NO_FUNCTION == set(SETUPS), "a new engine: add it to this file's ENGINES"


# --- an observer of the events an engine reports (it changes nothing) ------------------------------------------
class Recorder:
    """Forwards every event to the attempt, keeping (kind, rank, detail) in order."""

    def __init__(self, events: Any, log: list[tuple[str, int, Any]]) -> None:
        self._events, self._log = events, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._events, name)

    def placed(self, rank: int, pid: int | None, node: str = "") -> None:
        self._log.append(("placed", rank, pid))
        self._events.placed(rank, pid, node)

    def message(self, rank: int, message: Any) -> None:
        self._log.append(("message", rank, type(message).__name__))
        self._events.message(rank, message)

    def output(self, rank: int, stream: Any, data: bytes) -> None:
        self._log.append(("output", rank, data))
        self._events.output(rank, stream, data)

    def exited(self, rank: int, exitcode: int | None, **how: Any) -> None:
        self._log.append(("exited", rank, exitcode))
        self._events.exited(rank, exitcode, **how)


@pytest.fixture
def events(engine, monkeypatch) -> list[tuple[str, int, Any]]:
    """Every event the engine reports during the test, in order."""
    log: list[tuple[str, int, Any]] = []
    engine_type = engines.find(engine.name)
    create = engine_type.create

    def recorded(self, spec, options):
        made = create(self, spec, options)
        start = made.start
        made.start = lambda events, how: start(Recorder(events, log), how)
        return made

    monkeypatch.setattr(engine_type, "create", recorded)
    return log


def wait_until_up(run: Any) -> None:
    """Every rank has printed its "up" line (a handshake: the function is where the test wants it)."""
    deadline = time.monotonic() + STARTED_WAIT
    while not all(r.last_line == f"rank {r.rank} up" for r in run.record.ranks):
        assert not run.done and time.monotonic() < deadline, run.status
        time.sleep(0.1)


def up(world_size: int, *more: Any) -> list[Any]:
    """The fake's ranks start and print their "up" line, as `sleeps` does."""
    return [step for rank in range(world_size) for step in (started(rank), Print(rank, f"rank {rank} up"))] + [*more]


# --- the promises -------------------------------------------------------------------------------------------------
def test_every_rank_starts_and_rank_0s_value_comes_back(engine):
    script = Script(
        [
            step
            for rank in range(2)
            for step in (
                started(rank),
                Print(rank, f"rank {rank} of 2 here"),
                returned(rank, {"rank": 0, "world_size": 2}),
                Exit(rank, 0),
            )
        ]
    )
    run = engine.launch(returns, script)
    assert run.result(timeout=STARTED_WAIT) == {"rank": 0, "world_size": 2}
    assert [r.state for r in run.record.ranks] == [RankState.FINISHED] * 2
    assert [r.exitcode for r in run.record.ranks] == [0, 0]
    assert all(r.started and r.ended and r.ended >= r.started for r in run.record.ranks), run.record.ranks
    assert engine.left(run) == []


def test_each_ranks_events_come_in_order_placed_then_messages_then_exited_and_its_output_complete(engine, events):
    """Placed first, once; every message before the exit, once; output from the placing on, and read to its end
    after the exit where it comes late (a pipe read to end-of-file once the process is gone, so the last lines are
    never lost): only output may follow the exit, and all of it is in before the run ends."""
    script = Script(
        [
            step
            for rank in range(2)
            for step in (started(rank), Print(rank, f"rank {rank} of 2 here"), returned(rank, {}), Exit(rank, 0))
        ]
    )
    run = engine.launch(returns, script)
    run.result(timeout=STARTED_WAIT)
    for rank in range(2):
        mine = [(kind, detail) for kind, who, detail in events if who == rank]
        kinds = [kind for kind, _ in mine]
        assert kinds[0] == "placed" and kinds.count("placed") == 1, mine
        assert kinds.count("exited") == 1, mine
        assert set(kinds[kinds.index("exited") + 1 :]) <= {"output"}, mine  # nothing but late output after the exit
        sent = [detail for kind, detail in mine if kind == "message"]
        assert sent[0] == "Started" and sent[-1] == "Returned", sent
        said = b"".join(detail for kind, detail in mine if kind == "output")
        assert f"rank {rank} of 2 here".encode() in said, mine
        assert ("output", b"") in mine, mine  # each stream read to its end
    assert engine.left(run) == []


def test_stop_ends_every_rank_as_stopped_within_the_stops_own_wait(engine):
    run = engine.launch(sleeps, Script(up(2)))
    wait_until_up(run)
    run.stop()
    assert run.done  # every rank ended within `stop()`'s own wait
    assert run.outcome is Outcome.STOPPED
    assert [r.state for r in run.record.ranks] == [RankState.STOPPED] * 2
    assert engine.left(run) == []


def test_a_rank_that_ignores_the_stop_is_stopped_harder(engine, events):
    run = engine.launch(ignores_sigterm_on_rank_0, Script(up(2), ignores_stop={0}, stop_after=0.5))
    wait_until_up(run)
    run.stop()
    assert run.done, run.status
    assert [r.state for r in run.record.ranks] == [RankState.STOPPED] * 2
    exits = {rank: code for kind, rank, code in events if kind == "exited"}
    assert exits[0] == -signal.SIGKILL, exits  # the escalation's kill, the only thing that ends rank 0
    assert engine.left(run) == []


def test_stacks_of_a_sleeping_run_name_the_users_function_on_every_rank(engine):
    stack = (
        'Stack (most recent call last):\n  File "tests/test_engine_contract.py", line 1, in sleeps\n'
        "    time.sleep(300)  # where every rank is"
    )
    run = engine.launch(sleeps, Script(up(2), stacks={0: stack, 1: stack}))
    wait_until_up(run)
    stacks = run.stacks()
    assert sorted(stacks) == [0, 1]
    assert all("in sleeps" in text and "where every rank is" in text for text in stacks.values()), stacks
    run.stop()
    assert run.done and engine.left(run) == []


def test_a_rank_killed_from_outside_is_reported_exited_and_the_others_are_stopped(engine):
    killed = threading.Event()
    run = engine.launch(sleeps, Script(up(2, Gate(killed), Exit(1, -signal.SIGKILL))))
    wait_until_up(run)
    engine.kill(run, 1, killed)
    run.wait(timeout=STARTED_WAIT)
    assert run.done and run.outcome is Outcome.FAILED
    assert [r.state for r in run.record.ranks] == [RankState.STOPPED, RankState.FAILED]
    first = run.record.first_failure
    assert first.rank == 1 and "killed by SIGKILL" in first.summary, first
    assert engine.left(run) == []


def test_a_failing_rank_stops_the_others_and_leaves_nothing(engine):
    script = Script([started(0), Print(0, "rank 0 up"), *raises(1, "ValueError", "rank 1 fails")])
    run = engine.launch(fails_on_rank_1, script)
    run.wait(timeout=STARTED_WAIT)
    assert run.outcome is Outcome.FAILED
    assert run.record.first_failure.rank == 1 and "ValueError: rank 1 fails" in run.record.first_failure.summary
    assert [r.state for r in run.record.ranks] == [RankState.STOPPED, RankState.FAILED]
    assert engine.left(run) == []


def test_a_rank_killed_mid_run_restarts_from_the_last_checkpoint_and_resume_continues_it(engine, capsys):
    """Issue 18's scenario on every engine with real ranks: rank 1 dies at step 25 of attempt 0; attempt 1 loads
    step 20 (on Ray through Ray Train's own restart within one fit, which reports the checkpoints and hands the
    latest to `ray.train.get_checkpoint()`; on Slurm in a new step, both nodes writing the checkpoint); the weights
    equal those of a run that never failed, bit for bit; each attempt has its own logs, the newest 3 checkpoints are
    kept; `resume=` that run, on the same engine, starts from step 40; and nothing is left."""
    if engine.fake:
        pytest.skip("checkpoints are written by torch.distributed.checkpoint on real ranks: the fake has none")
    ray_train = engine.name == "ray"
    restarted = ddpnb.run(
        trains_and_fails_once,
        engine=engine.name,
        nprocs=2,
        max_restarts=1,
        view="text",
        env={"FAIL_AT": "25"},
        args=(ray_train,),
        **engine.options,
    )
    record = ddpnb.last_run()
    shown = capsys.readouterr()
    assert "[ddpnb] attempt 0 failed: rank 1 failed first" in shown.out, shown.out
    assert re.search(r"^\[ranks? 0(,1)?\] attempt 1 starts from step 20$", shown.out, re.MULTILINE), shown.out
    assert (record.attempt, len(record.attempts), record.attempts[0].first_failure.rank, record.outcome) == (
        1,
        1,
        1,
        Outcome.SUCCEEDED,
    )
    if not ray_train:  # Ray Train's own words for it: its health check failed
        assert "killed by SIGKILL" in record.attempts[0].first_failure.summary, record.attempts[0].first_failure
    assert (restarted["attempt"], restarted["start"]) == (1, 20)
    assert sorted(p.name for p in record.run_dir.glob("rank*.log")) == [
        "rank0.attempt0.log",
        "rank0.attempt1.log",
        "rank1.attempt0.log",
        "rank1.attempt1.log",
    ]
    assert sorted(p.name for p in record.checkpoint_dir.iterdir() if p.name.startswith("step-")) == [
        "step-000000020",
        "step-000000030",
        "step-000000040",
    ]  # the newest 3 (keep_checkpoints)
    if ray_train:
        # Ray Train registered step 10 or 20 by the time rank 1 died (its controller collects reports as it polls)
        assert restarted["ray_checkpoint"] in ("step-000000010", "step-000000020"), restarted["ray_checkpoint"]
        assert "Reporting training result" not in shown.out + shown.err  # Ray Train's log line per report
        # it restarted the workers within one fit: ddpnb connected (started an engine) once, not per attempt
        assert shown.out.count(" node(s), ") == 1, shown.out
    pids = [r.pid for a in [*record.attempts, record.current] for r in a.ranks if r.pid]
    plain = ddpnb.run(trains_and_fails_once, engine="local", nprocs=2, view="none")
    assert plain["start"] is None
    assert all(torch_equal(restarted["state"][k], plain["state"][k]) for k in plain["state"])
    resumed = ddpnb.run(
        trains_and_fails_once, engine=engine.name, nprocs=2, resume=record.run_dir, view="none", **engine.options
    )
    assert resumed["start"] == 40
    assert [str(pid) for pid in wait_gone(pids, within=30)] + engine.nothing_left(pids) == []


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return torch.equal(a, b)
