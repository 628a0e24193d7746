"""`Broker`: what other threads ask of one attempt's ranks, passed to and from the reader thread.

Two kinds of asking: a rank's debugger prompt waits for an answer (from the waiting cell, the dashboard's console
or `Run.debug`, whichever comes first: an answer goes only to the prompt it was typed at), and a stack request
waits until the reader, the one thread that talks to the engine, has collected the stacks.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from ddpnb.core import messages as msg
from ddpnb.core.cellnames import pdb_where
from ddpnb.core.engine import Engine
from ddpnb.core.record import RankRecord, RankState
from ddpnb.core.stacks import readable

_RUNNING = (RankState.STARTING, RankState.RUNNING)


class Broker:
    """One attempt's prompts waiting for an answer and stack requests waiting for the reader. `ranks`: the
    attempt's rank records (each rank's `breakpoint_at` is kept here); `ending`: why every rank is being stopped,
    or None."""

    def __init__(self, ranks: list[RankRecord], ending: Callable[[], str | None]) -> None:
        self.engine: Engine | None = None  # the attempt's, once started
        self._ranks = ranks
        self._ending = ending
        # debugger prompts as they came, those still waiting only (under `_lock`)
        self._prompts: deque[msg.Prompt] = deque()
        # each rank's prompt that waits for an answer: its waiting is no stall, nor timed
        self.waiting: dict[int, msg.Prompt] = {}
        self._where: dict[int, str] = {}  # each rank's place at its latest prompt that said one
        self._lock = threading.Lock()
        self._stack_requests: list[tuple[list[int], dict[int, str], threading.Event]] = []

    # --- debugger prompts ---------------------------------------------------------------------------------------
    def prompted(self, rank: int, prompt: msg.Prompt) -> None:
        """The reader read `rank`'s prompt: it waits for an answer."""
        record = self._ranks[rank]
        with self._lock:
            self.waiting[rank] = prompt
            # a prompt after `p x` says no place: the rank is where its last one said
            record.breakpoint_at = pdb_where(prompt.text) or self._where.get(rank, "its debugger prompt")
            self._where[rank] = record.breakpoint_at
            # those answered meanwhile (the dashboard's console) go: the queue holds what still waits
            self._prompts = deque(p for p in self._prompts if self.waiting.get(p.rank) is p)
            self._prompts.append(prompt)

    def withdraw(self, ranks: list[int]) -> None:
        """`ranks` are asked nothing more (gone, or being stopped): their prompts go with them."""
        with self._lock:
            for rank in ranks:
                self.waiting.pop(rank, None)
                self._ranks[rank].breakpoint_at = ""

    def next_prompt(self) -> msg.Prompt | None:
        """The oldest prompt still waiting for an answer (one answered meanwhile elsewhere is passed over)."""
        with self._lock:
            while self._prompts:
                prompt = self._prompts.popleft()
                if self.waiting.get(prompt.rank) is prompt:
                    return prompt
            return None

    def answer(self, prompt: msg.Prompt, line: str) -> bool:
        """An answer to a rank's debugger `prompt` (from the waiting cell's thread, or the kernel's for the
        dashboard's console); False where that prompt no longer waits (another answer came first: a line typed for
        it must not reach the rank's next prompt)."""
        rank = prompt.rank
        with self._lock:
            if self.waiting.get(rank) is not prompt:
                return False
            del self.waiting[rank]
            self._ranks[rank].breakpoint_at = ""
        assert self.engine is not None  # a prompt came from a started engine
        self.engine.send([rank], line.encode())
        return True

    def not_waiting(self, rank: int) -> str:
        """Why `rank`'s prompt took no answer: words after "no longer waits at that prompt: "."""
        ending = self._ending()
        if ending is not None:
            return f"the run is ending ({ending})"
        if self._ranks[rank].state not in _RUNNING:
            return f"rank {rank} has ended"
        return "it was answered elsewhere first (the waiting cell, the dashboard's console or a .debug cell)"

    # --- stacks ---------------------------------------------------------------------------------------------------
    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each of `ranks`' stacks now, from the reader's thread."""
        assert self.engine is not None  # asked only while the engine runs
        return {rank: readable(stack) for rank, stack in self.engine.collect_stacks(ranks).items()}

    def request_stacks(self, ranks: list[int], wait: float, done: Callable[[], bool]) -> dict[int, str]:
        """Each of `ranks`' stacks now (from any thread but the reader's, which collects them at its next tick)."""
        taken: dict[int, str] = {}
        collected = threading.Event()
        self._stack_requests.append((list(ranks), taken, collected))
        deadline = time.monotonic() + wait
        while not collected.wait(0.1) and not done() and time.monotonic() < deadline:
            continue  # a run that ends meanwhile sends no stacks
        return {rank: taken.get(rank, "") for rank in ranks}

    def serve_stack_requests(self) -> None:
        """The reader's tick: collect the stacks other threads asked for."""
        while self._stack_requests:
            ranks, taken, collected = self._stack_requests.pop(0)
            taken.update(self.collect_stacks(ranks))
            collected.set()

    def release(self) -> None:
        """No stacks will come now: whoever waits for them goes on."""
        for _, _, collected in self._stack_requests:
            collected.set()
        self._stack_requests = []
