"""The remote layer without a cluster: its node host driven over a real socket pair with the real wire (what a host
answers depends only on what the kernel sent it, however close together the kernel's controls come), and the
kernel's account of hosts (`Hosts`) that the Slurm and Ray engines share."""

from __future__ import annotations

import pickle
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection

import pytest

from ddpnb.node.rank import Seat
from ddpnb.remote.host import NodeHost, Place
from ddpnb.remote.hosts import Hosts
from ddpnb.remote.wire import Control, Report, Setup

pytestmark = pytest.mark.fast
ANSWER_WAIT = 10.0  # seconds the kernel's side waits for each answer (a request takes about forked.STACK_WAIT)
LATE_START = 0.3  # seconds each stacks thread waits before it runs: a loaded node, where the next control comes first


@pytest.fixture
def kernel():
    """The kernel's end of a socket pair whose other end a node host obeys, its two ranks not forked (a stacks
    request takes its full wait, and finds no stack)."""
    kernel_end, host_end = socket.socketpair()
    ours, conn = Connection(kernel_end.detach()), Connection(host_end.detach())
    setup = Setup(b"", [Seat(0, 0, 2, ""), Seat(1, 1, 2, "")], {}, commands=True)
    host = NodeHost(conn, setup, {}, Place(node_index=0, node="here"))

    def obey() -> None:
        try:
            host.obey()
        except EOFError:  # the kernel's end closed: the test is over
            pass

    obeying = threading.Thread(target=obey, daemon=True)
    obeying.start()
    yield ours
    ours.close()
    obeying.join(ANSWER_WAIT)
    host.close()
    conn.close()
    assert not obeying.is_alive()


def test_each_stacks_request_is_answered_under_its_own_number_when_the_next_comes_at_once(kernel):
    """The stacks thread of the first request must not read the second's number (a lambda over the loop's
    variables did: the kernel dropped both answers as late, or took rank 1's as rank 0's)."""

    def late(frame, event, arg):  # each thread started now: the stacks threads start after the next control came
        sys.settrace(None)  # once per thread, at its start
        if threading.current_thread().name.endswith("-stacks"):
            time.sleep(LATE_START)

    threading.settrace(late)
    try:
        for ranks, number in (([0], 1), ([1], 2)):
            kernel.send_bytes(pickle.dumps((Control.STACKS, (ranks, number))))
        answers = []
        for _ in range(2):
            assert kernel.poll(ANSWER_WAIT), f"no answer to the stacks request {len(answers) + 1} in {ANSWER_WAIT} s"
            answers.append(pickle.loads(kernel.recv_bytes()))
    finally:
        threading.settrace(None)
    assert sorted(answers, key=repr) == [(Report.STACKS, (1, {})), (Report.STACKS, (2, {}))]


class _Told:
    """The run's side of `RunEvents`, as far as `Hosts` tells it: each rank's end."""

    def __init__(self) -> None:
        self.exits: list[tuple[int, int | None, bool, str]] = []

    def exited(
        self, rank: int, exitcode: int | None, *, stopped: bool = False, cause: str = "", traceback: str = ""
    ) -> None:
        self.exits.append((rank, exitcode, stopped, cause))


def test_hosts_keep_early_calls_in_order_and_tell_each_ranks_end_once_the_first_way_it_is_learnt():
    told = _Told()
    hosts: Hosts[str] = Hosts(world_size=3)
    hosts.events = told  # type: ignore[assignment]
    hosts.place("a", [0, 1])
    hosts.place("b", [2])
    calls: list[tuple[str, int]] = []
    hosts.in_order(lambda number: calls.append(("first", number)))
    hosts.in_order(lambda number: calls.append(("second", number)))
    assert calls == []  # the hosts take no call yet
    hosts.open()
    hosts.in_order(lambda number: calls.append(("third", number)))
    assert calls == [("first", 0), ("second", 1), ("third", 2)]

    hosts.replay("a", "node-a", [("exited", 0, -9, False)], where="Slurm node node-a")
    hosts.lose(hosts.left("a"), "its node was lost")
    hosts.lose(hosts.left("a"), "said twice")  # nothing left of host a
    hosts.lose(hosts.left(), "", stopped=True)
    assert told.exits == [
        (0, -9, False, "killed by SIGKILL (on Slurm node node-a)"),
        (1, 1, False, "its node was lost"),
        (2, -9, True, ""),
    ]
    assert hosts.all_ended()


def test_a_late_answer_to_an_earlier_stacks_request_is_dropped():
    hosts: Hosts[int] = Hosts(world_size=2)
    first = hosts.ask_stacks()
    second = hosts.ask_stacks()
    hosts.answered(first, {0: "an old stack"})
    hosts.answered(second, {1: "rank 1's stack"})
    assert (hosts.stacks([0, 1]), hosts.stack_answers) == ({1: "rank 1's stack"}, 1)
