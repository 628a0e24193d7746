"""Rank side: notebook CUDA tensors arrive as CPU copies (every engine sends them so) and move onto this rank's
own device once it is set up."""

from __future__ import annotations

from typing import Any

_device: str | None = None  # this rank's device, once set up
_pending: list[Any] = []  # tensors from notebook CUDA tensors, waiting for the rank's device


def set_device(device: str) -> None:
    """The rank's device is set up: tensors that were CUDA tensors in the notebook move onto it (CPU ranks keep
    them on the CPU)."""
    global _device
    _device = device
    while _pending:
        _move(_pending.pop())


def from_cuda(tensor: Any) -> Any:
    """A notebook CUDA tensor, sent as a CPU copy: on each GPU rank's own device (never every rank on cuda:0),
    on the CPU on CPU ranks. Moved in place (`.data`), so it stays the same object, Parameter or not."""
    if _device is None:  # unpickled before the rank's device is set up (CUDA must not start before that)
        _pending.append(tensor)
    else:
        _move(tensor)
    return tensor


def _move(tensor: Any) -> None:
    if _device is not None and _device.startswith("cuda"):
        tensor.data = tensor.data.to(_device)
