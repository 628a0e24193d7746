"""The stall doctor, kernel side: when a run stops making progress, and where each rank is then.

Progress is anything a rank sends but its stacks and GPU memory samples: an output line, a metric, a progress
tick, a session's answer. The run stamps each rank's latest with its reader's clock (`Run.message`); the
threshold and the analysis cost nothing until it passes.
"""

from __future__ import annotations

import ast
import dataclasses
import linecache
import time

from ddpnb.core.cellnames import cell_names
from ddpnb.core.groups import grouped
from ddpnb.core.record import Diagnosis, RankRecord, RankState, RankWhere
from ddpnb.core.stacks import COLLECTIVES, STORE_WAITS, frames_of, is_library

FLOOR = 60.0  # seconds without progress before an adaptive threshold can call a run stalled
FACTOR = 10.0  # ... and at least this many times the longest quiet spell the run went through and recovered from
WAITS = COLLECTIVES | STORE_WAITS
_STORE_CALLS = frozenset({"get", "wait", "compare_set", "multi_get"})  # a store's blocking calls (C++, no frame)


class StallWatch:
    """When the run counts as stalled: no rank's activity for `threshold()` seconds.

    `fixed` is --stall's seconds (None: adaptive). Adaptive: FACTOR times the longest quiet spell the run has had
    so far, and never under FLOOR. A training loop's pauses recur (evaluation, a checkpoint, an epoch's end):
    once the run has come through one, the same pause never alarms again, while a hang is still caught within
    FACTOR of it; before any, the floor covers start-up quiet (a dataset's download) on most runs.
    """

    def __init__(self, world_size: int, fixed: float | None) -> None:
        self.fixed = fixed
        now = time.monotonic()
        self.active = [now] * world_size  # each rank's latest activity (monotonic), stored by the run
        self.latest = now  # the run's latest activity, as of the last `update`
        self.longest = 0.0  # the longest quiet spell so far, in seconds

    @property
    def enabled(self) -> bool:
        return self.fixed != 0

    def threshold(self) -> float:
        return self.fixed if self.fixed is not None else max(FLOOR, FACTOR * self.longest)

    def update(self, now: float) -> float:
        """Take in the activity stamped since the last call; return the seconds since the run's latest."""
        latest = max(self.active)
        if latest > self.latest:
            self.longest = max(self.longest, latest - self.latest)
            self.latest = latest
        return now - self.latest

    def idle(self, now: float) -> None:
        """Time that is nobody's progress to make (a session between commands): it starts no stall."""
        self.active[:] = [now] * len(self.active)  # in place: the run stores into this list
        self.latest = now


def locate(record: RankRecord, stack: str, quiet: float, returned: bool) -> RankWhere:
    """Where one rank is, from its stack: the collective it waits in, or the call its own line makes."""
    if returned or record.state not in (RankState.STARTING, RankState.RUNNING):
        ended = "returned" if returned and record.state is RankState.RUNNING else record.state.value
        return RankWhere(record.rank, quiet, ended=ended)
    frames = frames_of(stack)
    users = [frame for frame in frames if not is_library(frame[0])]
    if not users:  # no line of the user's: before its function (ddpnb's setup, the group's rendezvous)
        return RankWhere(record.rank, quiet, starting=record.state is RankState.STARTING)
    file, line, _ = users[-1]
    at = cell_names(f'File "{file}", line {line}')
    waits = [name for _, _, name in frames if name in WAITS]
    innermost = users[-1] == frames[-1]  # nothing in Python below the user's line: a call into C/C++
    call = call_on(linecache.getline(file, line))
    if not waits and innermost and call:  # blocked in C++ straight from the user's line: Work.wait(), store.get()
        method = call.rpartition(".")[2]
        if method in WAITS or (method in _STORE_CALLS and "store" in call.lower()):
            waits = [call]
    if waits:
        return RankWhere(record.rank, quiet, waits_in=waits[-1], at=at)
    if not call and not innermost:  # a line ast cannot read alone: name the library function it called
        call = frames[frames.index(users[-1]) + 1][2]
    return RankWhere(record.rank, quiet, call=call, at=at)


def call_on(source: str) -> str:
    """The first call a line of source makes, as written: 'time.sleep' for `    time.sleep(30)`; "" if none
    (or the line is part of a statement that spans lines)."""
    try:
        tree = ast.parse(source.strip())
    except SyntaxError:
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            try:
                return ast.unparse(node.func)
            except Exception:  # noqa: BLE001 - an expression ast cannot write back: say nothing rather than fail
                return ""
    return ""


def diagnose(
    ranks: list[RankRecord],
    stacks: dict[int, str],
    active: list[float],
    returned: set[int],
    flight: list[str] | None = None,
) -> Diagnosis:
    """Every rank's place and quiet time, from the stacks just collected."""
    now = time.monotonic()
    located = [
        locate(record, stacks.get(record.rank, ""), now - active[record.rank], record.rank in returned)
        for record in ranks
    ]
    if grouped(len(ranks)):  # many ranks: those whose node answered nothing are said as such, together
        located = [
            dataclasses.replace(where, unreported=True)
            if where.rank not in stacks and not where.ended and record.state is RankState.RUNNING
            else where
            for where, record in zip(located, ranks)
        ]
    return Diagnosis(taken=time.time(), ranks=located, stacks=dict(stacks), flight=flight or [])
