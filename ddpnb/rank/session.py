"""A session's rank: it keeps one namespace and answers the kernel's commands until told to stop.

The kernel runs `serve` as the ranks' function (`ddpnb.session`), so a session's ranks start, join their
process group and fail exactly as a `%%ddp` run's do; between commands they wait for the next one.
"""

from __future__ import annotations

import ast
import signal
import sys
import threading
from typing import Any

from ddpnb.core import messages as msg
from ddpnb.core.pickling import dumps, unpicklable_path
from ddpnb.core.stacks import user_traceback
from ddpnb.rank import cells, debug
from ddpnb.rank import context as ctx


def serve(rank: int, world_size: int) -> None:
    """Answer commands until the kernel says stop (or closes its end)."""
    import cloudpickle

    context = ctx.current()
    assert context is not None
    if threading.current_thread() is threading.main_thread():  # Ray Train runs it in a thread of its own
        # the kernel's interrupt (SIGINT) raises KeyboardInterrupt in the command that is running
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # the rank's own `__main__`, as a notebook's cells run in the kernel's: what they define is found by name
    # there, by the processes a rank starts too (DataLoader workers, Pool)
    namespace = vars(sys.modules["__main__"])
    namespace.update(rank=rank, world_size=world_size)
    while True:
        try:
            body = context.link.receive()  # the engine's link puts the command's big data in place first
            if body is None:
                return
            command: msg.Command = cloudpickle.loads(body)
        except KeyboardInterrupt:  # meant for a command that had just ended: nothing to stop
            continue
        if command.kind is msg.CommandKind.STOP:
            return
        reply = _answer(rank, command, namespace)
        context.link.flush()  # the cell's output first: the kernel shows it before the cell's value
        context.send(reply)


_last_error: BaseException | None = None  # the latest command's error on this rank: what DEBUG opens


def _answer(rank: int, command: msg.Command, namespace: dict[str, Any]) -> msg.Reply:
    global _last_error
    try:
        value = _run(command, namespace)
        if value is None:
            return msg.Reply(rank=rank, command=command.number)
        try:
            payload = dumps(value)
        except Exception as exc:  # noqa: BLE001 - cloudpickle raises TypeError, PicklingError, ...
            raise TypeError(
                f"the value cannot be sent to the notebook: {unpicklable_path(value, 'value')} cannot be "
                f"pickled ({type(exc).__name__}: {exc}); keep it on the ranks (assign it to a name) "
                "and pull what can travel"
            ) from None
        return msg.Reply(rank=rank, command=command.number, payload=payload)
    except BaseException as exc:  # noqa: BLE001 - the user's error (KeyboardInterrupt, SystemExit too) is the answer
        if command.kind is not msg.CommandKind.DEBUG:
            _last_error = exc
        return msg.Reply(
            rank=rank,
            command=command.number,
            exc_type=type(exc).__qualname__,
            message=str(exc),
            traceback=user_traceback(exc),
        )


def _run(command: msg.Command, namespace: dict[str, Any]) -> Any:
    kind = command.kind
    if kind is msg.CommandKind.EXECUTE:
        return _execute(command, namespace)
    if kind is msg.CommandKind.PUSH:
        namespace.update(command.values)
        return None
    if kind is msg.CommandKind.PULL:
        missing = [name for name in command.names if name not in namespace]
        if missing:
            raise NameError(f"name {missing[0]!r} is not defined on this rank")
        values = tuple(namespace[name] for name in command.names)
        return values[0] if len(values) == 1 else values
    if kind is msg.CommandKind.DEBUG:
        context = ctx.current()
        if _last_error is None or context is None:
            raise RuntimeError("no command has failed on this rank yet: nothing to debug")
        debug.post_mortem(context, _last_error)
        return None
    assert kind is msg.CommandKind.CALL and command.call is not None
    fn, args, kwargs = command.call
    return fn(*args, **kwargs)


def _execute(command: msg.Command, namespace: dict[str, Any]) -> Any:
    """The cell's statements, then its last expression's value, as IPython runs a cell."""
    filename = command.filename or "<session cell>"
    cells.register({filename: command.lines}, {filename: command.cell_name} if command.cell_name else {})
    tree = ast.parse(command.code, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - the user's own cell
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
