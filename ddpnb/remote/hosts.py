"""The kernel's account of one attempt's hosts, whatever carries the calls to them (a TCP connection each:
`connections.py`; Ray actor calls: the Ray engine's warm launch).

It keeps what every host-based engine would otherwise keep a copy of: which ranks each host forks; each rank's end
reported once, however many ways it is learnt (the host's relay, the host lost, the step gone); a lost host's ranks
failed, saying why; calls made before the hosts could take them kept, and every call numbered, in the order they
were made; stacks requests numbered, so that a late answer to an earlier one is dropped.
"""

from __future__ import annotations

import itertools
import signal
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ddpnb.core.words import describe_exit
from ddpnb.node.relay import Event, replay

if TYPE_CHECKING:
    from ddpnb.core.engine import RunEvents

Key = TypeVar("Key", bound=Hashable)  # what names a host: its place among the run's hosts, its node's id


class Hosts(Generic[Key]):
    """One attempt's hosts, by key, and their ranks, as the kernel accounts for them."""

    def __init__(self, world_size: int) -> None:
        self.events: RunEvents | None = None  # the attempt's, from the engine's `start`
        self.world_size = world_size
        self.ranks: dict[Key, list[int]] = {}  # host -> the ranks it forks
        self.ended: set[int] = set()  # ranks whose end the run was told
        self._lock = threading.Lock()  # `_open`, `_early`, `_numbers`
        self._open = False  # the hosts take calls: made at once from now on
        self._early: list[Callable[[], None]] = []  # calls made before, in order
        self._numbers = itertools.count()  # every call, in the order made (a threaded host may take two in either)
        self._stack_request = 0  # the latest stacks request's number: answers to an earlier one are late
        self._stacks: dict[int, str] = {}
        self.stack_answers = 0  # hosts that answered the latest request

    def place(self, host: Key, ranks: list[int]) -> None:
        self.ranks[host] = ranks

    def left(self, host: Key | None = None) -> list[int]:
        """The ranks of `host` (None: of every host) whose end the run was not told yet."""
        ranks = self.ranks[host] if host is not None else range(self.world_size)
        return [rank for rank in ranks if rank not in self.ended]

    def all_ended(self) -> bool:
        return len(self.ended) == self.world_size

    # --- ends -------------------------------------------------------------------------------------------------------
    def end(self, rank: int, code: int | None, *, stopped: bool, cause: str = "") -> None:
        """The rank's end, told once: the first way it is learnt wins."""
        if rank in self.ended:
            return
        assert self.events is not None
        self.ended.add(rank)
        self.events.exited(rank, code, stopped=stopped, cause=cause)

    def lose(self, ranks: Iterable[int], cause: str, *, stopped: bool = False, code: int | None = None) -> None:
        """Ranks no host will report (their host lost with its node, or never come): failed with `cause`, or, for a
        run being stopped, ended as stopped (code -SIGKILL unless given)."""
        for rank in list(ranks):
            self.end(
                rank,
                code if code is not None else -signal.SIGKILL if stopped else 1,
                stopped=stopped,
                cause="" if stopped else cause,
            )

    def replay(
        self,
        host: Key,
        name: str,
        batch: list[Event],
        where: str = "",
        placed: Callable[[int, int | None], None] | None = None,
    ) -> None:
        """A host's relayed batch, into the run's events, in order (`node.relay.replay`): ranks placed on node
        `name`; a rank killed by a signal it was not stopped with is said to have died `where` (its node)."""

        def exited(rank: int, code: int | None, stopped: bool) -> None:
            self.end(
                rank,
                code,
                stopped=stopped,
                cause=f"{describe_exit(code)} (on {where})" if where and code and code < 0 and not stopped else "",
            )

        assert self.events is not None
        replay(batch, self.events, name, exited, placed)

    # --- calls to the hosts -------------------------------------------------------------------------------------------
    def in_order(self, call: Callable[[int], Any]) -> None:
        """`call(number)` now, numbered as called, or, before the hosts take calls (`open`), once they do."""
        with self._lock:
            number = next(self._numbers)
            if not self._open:
                self._early.append(lambda: call(number))
                return
        call(number)

    def open(self) -> None:
        """The hosts take calls: those made before go first, in order; a call made meanwhile waits for them."""
        with self._lock:
            for call in self._early:
                call()
            self._early, self._open = [], True

    # --- stacks -----------------------------------------------------------------------------------------------------
    def ask_stacks(self) -> int:
        """A new stacks request's number; answers to earlier ones are dropped from now on."""
        self._stacks, self.stack_answers = {}, 0
        self._stack_request += 1
        return self._stack_request

    def answered(self, number: int, stacks: dict[int, str]) -> None:
        if number == self._stack_request:  # not a late answer to an earlier request
            self._stacks.update(stacks)
            self.stack_answers += 1

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        return {rank: self._stacks[rank] for rank in ranks if rank in self._stacks}
