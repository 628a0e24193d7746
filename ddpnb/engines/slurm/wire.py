"""What the kernel and a Slurm rank say to each other over the run's TCP channel (both sides import this).

The step's stdin carries one line to every task (srun broadcasts it): the kernel's address and the run's secret,
so the secret is never in a rank's argv or environment, and nodes need no shared filesystem to learn it. A rank
then connects with `multiprocessing.connection.Client(authkey=secret)`: both sides prove the secret by HMAC
challenge before a byte of the run travels, and a connection that cannot is dropped. Frames are
multiprocessing's (`core.messages.header`): the rank's first is its `Hello`, then core messages (`msg.encode`);
the kernel's are `(Control, value)` pairs.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

# what a rank writes on its stdout and stderr just before it sends a session answer (`Link.flush`): the kernel
# delivers the answer once both marks came through srun, so the output printed before it is shown first
FLUSHED = b"\x1b]ddpnb;flushed\x07"


class Control(enum.Enum):
    SETUP = "setup"  # value: `Setup`; the first thing a rank receives
    STACKS = "stacks"  # send your training thread's stack (`msg.Stacks`)
    COMMAND = "command"  # value: a session command's bytes (`Link.receive`)
    INTERRUPT = "interrupt"  # KeyboardInterrupt in the session command that is running


@dataclass(frozen=True)
class Hello:
    """A rank's first frame: who and where it is. Rank 0 also says where its TCPStore listens."""

    rank: int
    node: str  # SLURMD_NODENAME
    host: str  # the address this rank reaches the kernel from (what its peers reach it at)
    pid: int
    step: str  # JOBID.STEPID, for scancel
    store_port: int = 0  # rank 0: its bound store socket's port


@dataclass(frozen=True)
class Setup:
    spec_payload: bytes
    master_addr: str
    master_port: int


def invitation(host: str, port: int, secret: bytes) -> bytes:
    return f"{host} {port} {secret.hex()}\n".encode()


def read_invitation(fd: int = 0) -> tuple[tuple[str, int], bytes]:
    """The kernel's address and the secret, from the line srun delivered on stdin."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 256)
        if not chunk:
            raise EOFError("the step's stdin ended before the kernel's invitation (was this started by ddpnb?)")
        line += chunk
    host, port, secret = line.decode().split()
    return (host, int(port)), bytes.fromhex(secret)
