"""Engines plug in (issue 25): one found through the `ddpnb.engines` entry point group, with options and a magic
flag of its own, runs real ranks without a line of core, the API or the magic knowing its name; and the options
every launch takes are checked once, with errors that say what to do."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ddpnb

REPO = Path(__file__).resolve().parents[1]

TOY_ENGINE = '''
from dataclasses import dataclass
from typing import Any, ClassVar

from ddpnb.core.engine import Flag
from ddpnb.engines.local.engine import LocalEngine, LocalType


@dataclass(frozen=True)
class GreetingOptions:
    greeting: str = "hello"


class GreetingType(LocalType):
    """The local engine's ranks, each greeted through its environment: a third-party engine in a few lines."""

    name: ClassVar[str] = "greeting"
    Options: ClassVar[type] = GreetingOptions
    flags: ClassVar[list[Flag]] = [Flag("--greeting", help="what every rank finds in $GREETING")]

    def create(self, spec: Any, options: GreetingOptions) -> LocalEngine:
        spec.environ = {**spec.environ, "GREETING": options.greeting}
        return LocalEngine(spec)
'''


def test_an_engine_registered_by_another_package_runs_with_its_own_option_and_flag(tmp_path):
    site = tmp_path / "site"
    (site / "greeting_engine").mkdir(parents=True)
    (site / "greeting_engine" / "__init__.py").write_text(TOY_ENGINE)
    info = site / "greeting_engine-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: greeting-engine\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ddpnb.engines]\ngreeting = greeting_engine:GreetingType\n")
    code = textwrap.dedent("""
        import os, ddpnb, ddpnb._magic
        def hello(rank):
            return os.environ["GREETING"] + f" {rank}"
        print(ddpnb.run(hello, engine="greeting", greeting="bonjour", nprocs=2, view="none"))
        actions = {a.dest: a for a in ddpnb._magic.DDPMagics.ddp.parser._actions}
        print("--greeting" in actions["greeting"].option_strings, "greeting" in actions["engine"].choices)
        try:
            ddpnb.run(hello, greeting="bonjour", nprocs=2, view="none")
        except ddpnb.LaunchError as exc:
            print(exc)
    """)
    env = {"PYTHONPATH": f"{site}:{REPO}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False
    )
    assert out.returncode == 0, out.stderr
    ran, magic, refused = out.stdout.splitlines()
    assert ran == "bonjour 0"  # rank 0's value: its environment came from the engine's own option
    assert magic == "True True"  # %%ddp offers the engine and its flag, from the engine alone
    assert refused == "greeting is for the greeting engine: add engine='greeting' (--engine greeting)."


def test_an_unknown_option_is_refused_before_anything_starts_naming_the_close_one():
    before = ddpnb.last_run()
    with pytest.raises(ddpnb.LaunchError, match=r"there is no option 'nproc' \(did you mean nprocs\?\)"):
        ddpnb.run(print, nproc=2)
    with pytest.raises(ddpnb.LaunchError, match="^placement is for the ray engine: add engine='ray'"):
        ddpnb.launch(print, nprocs=2, placement="spread")
    with pytest.raises(ddpnb.LaunchError, match="^nodes and partition are for the slurm engine: add engine='slurm'"):
        ddpnb.launch(print, nprocs=2, nodes=2, partition="debug")  # what was given, not all eight of its options
    assert ddpnb.last_run() is before  # nothing started


def test_a_session_refuses_the_options_only_a_run_takes_and_says_which_it_takes():
    with pytest.raises(ddpnb.LaunchError, match=r"timeout is not an option here; this takes .*nprocs"):
        ddpnb.session(nprocs=2, timeout=10)


def test_launch_options_are_checked_once_into_a_launch_with_the_engine_and_its_plan():
    launch = ddpnb.LaunchOptions(nprocs=3, stall=0, view="none").check()
    assert (launch.plan.world_size, launch.plan.backend, launch.stall, launch.engine.name) == (3, "gloo", 0.0, "local")
    with pytest.raises(ddpnb.LaunchError, match="max_restarts must be a whole number of 0 or more"):
        ddpnb.LaunchOptions(max_restarts=-1).check()


def test_a_nodes_relay_holds_its_reader_back_once_the_kernel_falls_behind():
    """A Ray or Slurm node's relay of its ranks' events: past `hold_bytes` not yet taken by the kernel, its reader
    waits at the end of its read pass (so the ranks' pipes fill and their writes wait, as on the local engine)
    until the kernel takes them; a host that closes lets it go at once."""
    import threading

    from ddpnb.core.spec import Stream
    from ddpnb.node.relay import Relay

    relay = Relay(hold_bytes=1000)
    passes: list[int] = []

    def read_passes() -> None:  # as `ForkedRanks.serve` does: events, then the end of the pass
        for number in range(10):
            relay.output(0, Stream.STDOUT, b"x" * 600)
            relay.tick()
            passes.append(number)
        relay.finish()

    reader = threading.Thread(target=read_passes, daemon=True)
    reader.start()
    reader.join(0.5)  # unheld, the ten passes take microseconds
    assert reader.is_alive() and passes == [0], passes  # 1200 bytes wait after the second pass
    batch, done = relay.take(0)
    assert [event[3] for event in batch] == [b"x" * 600] * 2 and not done
    reader.join(0.5)
    assert reader.is_alive() and passes == [0, 1, 2], passes
    relay.abandon()  # the host closes: nothing waits for the kernel now
    reader.join(10)
    assert not reader.is_alive() and passes == list(range(10))
    batch, done = relay.take(0)
    assert len(batch) == 8 and done
