"""Typed messages a worker sends to the kernel over its private channel.

Raw stdout/stderr bytes travel on separate pipes; these carry structure only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Started:
    rank: int
    pid: int
    device: str


@dataclass(frozen=True)
class Metric:
    rank: int
    step: int | None
    time: float
    values: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Returned:
    """The function returned. Only rank 0 carries its (cloudpickled) value."""

    rank: int
    payload: bytes | None


@dataclass(frozen=True)
class Failed:
    """The function raised. `traceback` is the worker's own, with ddpnb's frames removed."""

    rank: int
    time: float
    exc_type: str
    message: str
    traceback: str


Message = Started | Metric | Returned | Failed
