"""The rank's side of `--profile` and `ddpnb.profile()`: torch.profiler over the chosen steps, clock exchanges
with rank 0 marked in the trace (so the kernel can put the ranks' clocks on one base), and the trace sent to the
kernel as a message (`core.profile` merges them).

Imported only when a run profiles (`WorkerSpec.profile`, or a `ddpnb.profile()` region is entered): a run without
either pays one `is None` test per `ddpnb.log`.

A rank profiles once per attempt: the steps of --profile, or the first region.
"""

from __future__ import annotations

import contextlib
import datetime
import gzip
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from ddpnb.core import messages as msg
from ddpnb.core.profile import END_MARK, EXCHANGES, REGION_SPAN, START_MARK, STEP_SPAN, steps_words
from ddpnb.rank import context as ctx

MEET_WAIT = 60.0  # seconds a rank waits at a mark for the others, then profiles without the mark
_windows = 0  # windows opened in this process (one attempt's rank): the first profiles, later ones say why not


class Window:
    """torch.profiler from `open` to `close`, on every rank at the same marks; `close` sends the trace."""

    def __init__(self, context: ctx.RankContext, steps: tuple[int, int] | None) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        # Kineto's own lines ("profiler_start", a CUDA build's "gpuGetDeviceCount failed" on a CPU machine) would
        # land in the cell between the ranks' output; KINETO_LOG_LEVEL=4 brings its errors back
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU]
        if context.device.startswith("cuda") and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.context = context
        self.steps = steps
        self.profiler = profile(activities=activities)
        self.span: Any = None
        self.notes: list[str] = []

    def open(self) -> None:
        self.profiler.start()
        self._mark(START_MARK)

    def begin_span(self, name: str) -> None:
        from torch.profiler import record_function

        self.span = record_function(name)
        self.span.__enter__()

    def end_span(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None

    def close(self, mark: bool = True) -> None:
        """Stop profiling (after the end mark, where every rank makes one) and send the trace."""
        self.end_span()
        if mark:
            self._mark(END_MARK)
        self.profiler.stop()
        with tempfile.TemporaryDirectory(prefix="ddpnb-profile-") as where:
            path = os.path.join(where, "trace.json")
            self.profiler.export_chrome_trace(path)
            with open(path, "rb") as file:
                trace = gzip.compress(file.read(), compresslevel=3)
        send(self.context, trace, self.steps, "; ".join(self.notes))

    def _mark(self, name: str) -> None:
        """Every rank meets the others on the run's store, then times EXCHANGES round trips with rank 0, each end
        marked in its trace (`core.profile` turns them into clock offsets)."""
        spec = self.context.spec
        if spec is None or spec.world_size == 1:
            return
        if not meet(self.context, f"ddpnb/profile/{name}/ready"):
            self.notes.append(
                f"the other ranks did not reach the {'first' if name == START_MARK else 'last'} "
                f"profiled step within {MEET_WAIT:g} s of this one: its clock is not aligned "
                "(call ddpnb.log(step=...) on every rank)"
            )
            return
        for exchange in range(EXCHANGES):
            if not self._exchange(name, f"ddpnb/profile/{name}/{exchange}", spec.world_size):
                self.notes.append("the clock exchange with rank 0 did not complete: its clock may not be aligned")
                return

    def _exchange(self, name: str, key: str, world: int) -> bool:
        from torch.profiler import record_function

        store, rank = self.context.store, self.context.rank
        wait = datetime.timedelta(seconds=MEET_WAIT)
        try:
            if rank == 0:
                store.wait([f"{key}/ping/{other}" for other in range(1, world)], wait)
                with record_function(f"{name}/serve"):
                    pass
                store.set(f"{key}/pong", b"")
            else:
                with record_function(f"{name}/ping"):
                    pass
                store.set(f"{key}/ping/{rank}", b"")
                store.wait([f"{key}/pong"], wait)
                with record_function(f"{name}/pong"):
                    pass
        except RuntimeError:  # torch's DistStoreError: a timeout, or the store gone with rank 0
            return False
        return True


def meet(context: ctx.RankContext, key: str, wait: float = MEET_WAIT) -> bool:
    """Every rank sets its key on the run's store and waits for the others'. False where the others did not come
    within `wait` seconds, or the rank has no store."""
    spec = context.spec
    world = spec.world_size if spec is not None else 1
    store = context.store
    if world == 1:
        return True
    if store is None:
        return False
    keys = [f"{key}/{rank}" for rank in range(world)]
    store.set(keys[context.rank], b"")
    try:
        store.wait(keys, datetime.timedelta(seconds=wait))
    except RuntimeError:  # torch's DistStoreError: a timeout, or the store gone with rank 0
        return False
    return True


def send(context: ctx.RankContext, trace: bytes, steps: tuple[int, int] | None, note: str = "") -> None:
    context.send(
        msg.Profiled(
            rank=context.rank, host=socket.gethostname(), device=context.device, trace=trace, steps=steps, note=note
        )
    )


def _claim(context: ctx.RankContext, what: str) -> bool:
    """Whether this window may profile: the first of the attempt may; later ones say once why not."""
    global _windows
    _windows += 1
    if _windows == 2 and context.rank == 0:
        print(
            f"[ddpnb] {what} is not profiled: a run profiles once per attempt (--profile's steps or the first "
            "ddpnb.profile() region), and this one has already.",
            file=sys.stderr,
        )
    return _windows == 1


class StepWindow:
    """--profile FIRST-LAST, driven by `ddpnb.log(step=...)` (`RankContext.send_metric`): profiling starts at the
    call that logs step FIRST-1 (the end of that step) and stops at the one that logs LAST; each step between two
    calls is one span, `ProfilerStep#N`."""

    def __init__(self, context: ctx.RankContext, first: int, last: int) -> None:
        self.context = context
        self.first, self.last = first, last
        self.window: Window | None = None
        self.thread: int | None = None
        self.done = False
        self.latest: int | None = None  # the latest step logged

    def at_step(self, step: int) -> None:
        if self.done:
            return
        self.latest = step
        if self.window is None:
            if step >= self.last:
                self.done = True
                send(
                    self.context,
                    b"",
                    (self.first, self.last),
                    f"no ddpnb.log(step=...) came between step {self.first - 1} and {self.last} (the first step "
                    f"logged after them was {step}): nothing was profiled",
                )
            elif step >= self.first - 1:
                self.done = not _claim(self.context, steps_words((self.first, self.last)))
                if not self.done:
                    self.thread = threading.get_ident()
                    self.window = Window(self.context, (self.first, self.last))
                    self.window.open()
                    self.window.begin_span(f"{STEP_SPAN}{step + 1}")
            return
        if threading.get_ident() != self.thread:  # another thread's logging: the steps are the training thread's
            return
        self.window.end_span()
        if step >= self.last:
            self.done = True
            self.window.close()
        else:
            self.window.begin_span(f"{STEP_SPAN}{step + 1}")

    def finish(self) -> None:
        """The function returned: a window still open sends what it has; one never opened says why."""
        if self.done:
            return
        self.done = True
        if self.window is not None:
            self.window.notes.append(f"the function returned after step {self.latest}, before step {self.last}")
            self.window.close(mark=False)
        elif _windows == 0:
            logged = "no step" if self.latest is None else f"the last step logged was {self.latest}"
            send(
                self.context,
                b"",
                (self.first, self.last),
                f"nothing was profiled: {logged} (--profile counts the steps given to ddpnb.log(step=...))",
            )


@contextlib.contextmanager
def region(context: ctx.RankContext) -> Iterator[None]:
    """`with ddpnb.profile():` on every rank: the region profiled as one span, marked on every rank at its start
    and end."""
    if not _claim(context, "this ddpnb.profile() region"):
        yield
        return
    window = Window(context, None)
    window.open()
    window.begin_span(REGION_SPAN)
    try:
        yield
    except BaseException:
        window.notes.append("the region raised")
        window.close(mark=False)  # the others may never come to the end mark
        raise
    window.close()
