"""The remote layer's node host, driven over a real socket pair with the real wire, without Slurm: what a host
answers depends only on what the kernel sent it, however close together the kernel's controls come."""

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
