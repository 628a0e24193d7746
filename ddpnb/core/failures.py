"""Which failure is the run's: a rank's failure as data, the rule that tells a knock-on error from a cause, the
root cause of an attempt, and the role each failed rank played in it.

In DDP, when one rank dies the others fail in their next collective moments later (aborts, resets, timeouts),
often before the kernel even notices the death: the failure the user needs to see is the first that is not such
a consequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpnb.core.words import Named


@dataclass
class Failure:
    """One rank's failure: when, its summary line, its traceback, and whether it is a knock-on of another's."""

    rank: int
    time: float
    summary: str  # one line: "ValueError: bad batch" or "killed by SIGSEGV"
    traceback: str = ""  # the worker's own traceback, when it raised
    knock_on: bool = False  # a collective error caused by another rank's failure (see `is_knock_on`)
    frames: tuple[FrameLocals, ...] = ()  # the user's frames where it raised, each with its locals' reprs


@dataclass(frozen=True)
class FrameLocals:
    """One of the user's frames where a rank raised, with bounded reprs of its local variables (kept after the
    process is gone): `Cell In[5], line 7, in train` and `{"step": "3", "batch": "tensor(shape=(8, 4), ...)"}`."""

    file: str
    line: int
    function: str
    values: tuple[tuple[str, str], ...]  # (name, repr), in the frame's order, at most LOCALS_SHOWN


# What a collective says when a peer died or stopped answering: such a failure is a consequence, not the cause.
_KNOCK_ON_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
_KNOCK_ON_TEXT = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote worker",
    "remote process",
    "communicator was aborted",
    "ncclremoteerror",
    "watchdog caught collective operation timeout",
    "timed out",
    "socket timeout",
    "failed to recv",
    "recvvalue failed",
    "connection refused",
)


def is_knock_on(exc_type: str, message: str) -> bool:
    """True for the errors a rank gets because *another* rank died or hung (collective aborts, resets, timeouts).

    When one rank dies, the others fail in their next collective moments later, often before the kernel even
    notices the death; these errors are ranked after the root cause, whatever their time.
    """
    if exc_type in _KNOCK_ON_TYPES:
        return True
    text = message.lower()
    return exc_type == "RuntimeError" and any(pattern in text for pattern in _KNOCK_ON_TEXT)  # gloo raises these


@dataclass(frozen=True)
class KnownCause:
    """An error that reads as a bug of the user's code but comes from how ddpnb runs a rank: recognised by its
    summary and the line that raised it, with what it means here and what to do."""

    summary: str  # the error's type and message, as a failure's summary reads
    call: str  # found in the source line that raised it, as the traceback shows that line
    meaning: str


KNOWN_CAUSES = (
    KnownCause(
        "PermissionError: [Errno 1] Operation not permitted",
        "setsid(",
        "each rank already leads its own session and process group (ddpnb stops a run by its ranks' process "
        "groups), and a process group's leader cannot start a new session: drop the os.setsid() call.",
    ),
)


def known_cause(summary: str, traceback: str) -> str:
    """What a rank's error ('PermissionError: [Errno 1] ...') means under ddpnb (`KNOWN_CAUSES`), by its raising
    line (the source lines after the traceback's last `File` line); '' for any other error."""
    frames = traceback.rstrip().split('\n  File "')
    raising = frames[-1].splitlines()[1:] if len(frames) > 1 else []
    return next(
        (
            cause.meaning
            for cause in KNOWN_CAUSES
            if cause.summary == summary and any(cause.call in line for line in raising)
        ),
        "",
    )


def root_cause(failures: list[Failure], ended_by_ddpnb: bool) -> Failure | None:
    """The earliest failure that is not a knock-on of another rank's (else the earliest); None where ddpnb ended
    the run (`ended_by_ddpnb`: a timeout, an interrupt, a stop) and every failure is a consequence of that: the
    stop is the cause."""
    first = min(failures, key=lambda f: (f.knock_on, f.time)) if failures else None
    return None if first is not None and first.knock_on and ended_by_ddpnb else first


class FailureRole(Named):
    """How a failed rank's failure relates to the run's: what the views call it."""

    ROOT_CAUSE = "failed first"
    OWN = "failed"  # an error of its own, after the root cause (the same bug on another rank)
    KNOCK_ON = "stopped: peer failed"  # a collective's abort because another rank died (see `is_knock_on`)


def role(failure: Failure, cause: Failure | None) -> FailureRole:
    """The role of `failure` in an attempt whose root cause is `cause`."""
    if failure is cause:
        return FailureRole.ROOT_CAUSE
    return FailureRole.KNOCK_ON if failure.knock_on else FailureRole.OWN
