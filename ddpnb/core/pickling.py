"""Sending the user's function to the workers, and saying exactly what stops it when it can't be sent."""

from __future__ import annotations

import inspect
import io
import linecache
import os
import sys
import types
from typing import TYPE_CHECKING, Any

import cloudpickle

from ddpnb import _compat

if TYPE_CHECKING:
    from ddpnb.core.data import Shipment

MAX_DEPTH = 6


class NotPicklableError(TypeError):
    """The function (or something it uses) cannot be sent to the worker processes."""


class HoldsTensors(Exception):
    """Raised by `dumps(..., tensors=False)` at the first tensor: the value is worth a `save` instead."""


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle for everything that crosses between kernel and ranks. It keeps each code object's real filename
    (cloudpickle >= 3.1 replaces it with '<dynamic-code>'), so a worker's traceback names the user's cell and,
    with its source shipped, shows its lines; and it moves every tensor to the CPU, however deeply nested, so a
    result never makes the kernel initialise CUDA. With a `Shipment` (notebook data on its way to local ranks),
    big CPU tensors and NumPy arrays go into shared memory instead (`core.data`: the engine's shipment), CUDA tensors via the CPU."""

    tensors = True  # False: raise HoldsTensors at the first tensor
    shared: Shipment | None = None  # notebook data for the ranks: big tensors and arrays go through shared memory

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            rebuild, args = _compat.code_reduce(obj)
            return rebuild, tuple(obj.co_filename if arg == "<dynamic-code>" else arg for arg in args)
        torch = sys.modules.get("torch")  # never imported here just to look: a kernel without torch stays so
        if torch is not None and isinstance(obj, torch.Tensor):
            if not self.tensors:
                raise HoldsTensors
            if self.shared is not None and (reduced := self.shared.reduce_tensor(obj)) is not None:
                return reduced
            if obj.device.type != "cpu":  # the CPU copy keeps what pickling a CPU tensor keeps: type, requires_grad
                copy = obj.detach().cpu()
                if isinstance(obj, torch.nn.Parameter):
                    return torch.nn.Parameter, (copy, obj.requires_grad)
                return _identity, (copy.requires_grad_(obj.requires_grad),)
        elif (
            self.shared is not None
            and (numpy := sys.modules.get("numpy")) is not None
            and isinstance(obj, numpy.ndarray)
            and (reduced := self.shared.reduce_array(obj)) is not None
        ):
            return reduced
        return super().reducer_override(obj)


Pickler = _Pickler  # what torch.save(pickle_module=...) subclasses


def _identity(value: Any) -> Any:
    return value


def dumps(obj: Any, tensors: bool = True, shared: Shipment | None = None) -> bytes:
    """`obj` pickled; with `shared`, its big CPU tensors and arrays are written there and only referred to."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol=5)
    pickler.tensors = tensors
    pickler.shared = shared
    pickler.dump(obj)
    return buffer.getvalue()


def save(obj: Any, fd: int) -> None:
    """torch.save with this module's pickler into the empty file `fd`: tensor bytes go to the file raw
    (mappable), everything else is cloudpickled. No CRC-32 of the tensor bytes: the file lives in this machine's
    memory for a moment, and checksumming halved the speed (bench/RESULTS.md)."""
    import torch

    options = torch.serialization
    crc32 = options.get_crc32_options() if hasattr(options, "get_crc32_options") else None  # torch >= 2.6
    if crc32 is not None:
        options.set_crc32_options(False)
    try:
        with os.fdopen(fd, "wb", closefd=False) as file:
            torch.save(obj, file, pickle_module=sys.modules[__name__], pickle_protocol=5)
    finally:
        if crc32 is not None:
            options.set_crc32_options(crc32)


def load(fd: int) -> Any:
    """What `save` wrote to `fd`, its tensors mapped from the file rather than read: the mapping stays valid
    after `fd` is closed, and the memory is freed with the last tensor (every tensor of the value maps the same
    file: keeping one keeps it all; writing to one copies the pages written, as with any private mapping)."""
    import torch

    return torch.load(f"/proc/self/fd/{fd}", mmap=True, weights_only=False, map_location="cpu")


def dump_function(fn: Any, shared: Shipment | None = None) -> bytes:
    try:
        return dumps(fn, shared=shared)
    except Exception as exc:  # noqa: BLE001 - cloudpickle raises TypeError, PicklingError, AttributeError, ...
        raise _not_picklable(f"`{_name(fn)}`", unpicklable_path(fn, _name(fn)), exc) from None


def dump_spec(spec: Any, shared: Shipment | None = None) -> bytes:
    """A run's `WorkerSpec`, pickled once in the kernel before any rank starts: its `args` may hold objects
    defined in the notebook, which only cloudpickle can send."""
    try:
        return dumps(spec, shared=shared)
    except Exception as exc:  # noqa: BLE001 - as above; the function itself was checked already
        raise _not_picklable("the run's arguments", unpicklable_path(tuple(spec.args), "args"), exc) from None


def dump_command(command: Any, shared: Shipment | None = None) -> bytes:
    """A session's command (`messages.Command`): a pushed value, or a call's function or arguments, that cannot
    travel is the caller's NotPicklableError, naming it, before anything is sent."""
    try:
        return dumps(command, shared=shared)
    except Exception as exc:  # as above
        if command.values:
            subject, where = "the pushed values", unpicklable_path(dict(command.values), "push")
        elif command.call is not None:
            fn, args, kwargs = command.call
            subject = "the call"
            where = next(
                (
                    unpicklable_path(part, label)
                    for part, label in ((fn, _name(fn)), (args, "args"), (kwargs, "kwargs"))
                    if not _picklable(part)
                ),
                unpicklable_path(command.call, "call"),
            )
        else:
            raise
        raise _not_picklable(
            subject,
            where,
            exc,
            "Create that object on the ranks instead (in a %%ranks cell, or "
            "inside the function), or send what it is built from (a path, a "
            "config).",
        ) from None


def _not_picklable(subject: str, where: str, exc: Exception, advice: str = "") -> NotPicklableError:
    return NotPicklableError(
        f"cannot send {subject} to the worker processes: {where} cannot be pickled ({type(exc).__name__}: {exc}).\n"
        + (
            advice
            or "Create that object inside the function (each rank then makes its own), or pass what it is "
            "built from instead (a path, a config)."
        )
    )


def unpicklable_path(obj: Any, label: str) -> str:
    """How the first object that cannot be pickled is reached from `obj`: "train -> closure 'loader' -> _thread.lock"."""
    path = _find_unpicklable(obj, label, depth=0, seen=set())
    return " -> ".join(path) if path else f"{label} ({_type_name(obj)})"


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__


def _picklable(obj: Any) -> bool:
    try:
        cloudpickle.dumps(obj)
    except Exception:  # noqa: BLE001 - any failure means "not picklable"; the caller reports which
        return False
    return True


def _children(obj: Any) -> list[tuple[str, Any]]:
    """What pickling `obj` by value also pickles, with a readable label for each."""
    if inspect.isfunction(obj):
        code = obj.__code__
        items = [
            (f"closure {name!r}", cell.cell_contents)
            for name, cell in zip(code.co_freevars, obj.__closure__ or ())
            if _cell_filled(cell)
        ]
        items += [
            (f"global {name!r}", obj.__globals__[name]) for name in _global_names(code) if name in obj.__globals__
        ]
        defaults, positional = obj.__defaults__ or (), code.co_varnames[: code.co_argcount]
        items += [
            (f"default of {name!r}", value)
            for name, value in zip(positional[len(positional) - len(defaults) :], defaults)
        ]
        items += [(f"default of {name!r}", value) for name, value in (obj.__kwdefaults__ or {}).items()]
        return items
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, list | tuple | set | frozenset):
        return [(f"[{i}]", value) for i, value in enumerate(obj)]
    if inspect.ismethod(obj):
        return [("__self__", obj.__self__), ("__func__", obj.__func__)]
    if hasattr(obj, "__dict__") and not inspect.ismodule(obj) and not inspect.isclass(obj):
        return [(f"attribute {key!r}", value) for key, value in vars(obj).items()]
    return []


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises ValueError
    except ValueError:
        return False
    return True


def _global_names(code: Any) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names += _global_names(const)
    return names


def _find_unpicklable(obj: Any, label: str, depth: int, seen: set[int]) -> list[str] | None:
    if id(obj) in seen or depth > MAX_DEPTH:
        return None
    seen.add(id(obj))
    for child_label, child in _children(obj):
        if not _picklable(child):
            deeper = _find_unpicklable(child, child_label, depth + 1, seen)
            return [label, *(deeper or [child_label, _type_name(child)])][: MAX_DEPTH + 2]
    return None


def _type_name(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


def notebook_sources() -> dict[str, list[str]]:
    """The source of cells run in this kernel (they exist only in linecache), so worker tracebacks show lines."""
    return {
        name: entry[2]
        for name, entry in list(linecache.cache.items())
        if len(entry) == 4 and entry[3] == name and not os.path.exists(name)
    }
