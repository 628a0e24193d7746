"""The notebook's definitions, findable by name in a rank and in every process a rank starts.

Plain pickle (DataLoader workers, `multiprocessing.Pool`, `ProcessPoolExecutor`, torch RPC) sends a class or a
function as its module and name, `__main__.MyDataset`, and the receiving process looks the name up in its own
`__main__`. A script's processes find it there because each re-runs the script; a rank's function came by value
(cloudpickle), so its `__main__` is the forkserver's, and would not. Two things make it so:

- `fresh_main()`, then `adopt(fn)`: the rank's `__main__` is a module of its own, as a script's is, holding the
  notebook names the function uses (the very objects it uses, as pickle checks; a session's cells run in it),
  and multiprocessing's start method is the platform's default again, as in a fresh script (fork on Linux before
  Python 3.14: the start method inherited from the forkserver would make every DataLoader start a new Python
  that imports torch).
- A process the rank starts with spawn or forkserver is told to run this module as its `__main__` (the
  preparation data multiprocessing sends every new process, `init_main_from_name`: `childmain`): it rebuilds the rank's
  notebook classes and functions from a memory file the rank writes the first time such a process starts.
"""

from __future__ import annotations

import builtins
import multiprocessing
import os
import sys
import types
from typing import Any

CHILD_MAIN = "ddpnb.rank.childmain"  # the module a child runs as its `__main__`, which nothing else imports
NOTEBOOK_MAIN = "DDPNB_NOTEBOOK_MAIN"  # names the rank's file of definitions, /proc/<rank>/fd/<n>, in its children
_file: str | None = None  # this rank's, once written


def fresh_main() -> None:
    """This rank's `__main__`: a new module, as a script's would be (the forkserver's holds its start-up code), and
    the start method a fresh `python train.py` has, its children's `__main__` holding the notebook's names."""
    from ddpnb import _compat

    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    multiprocessing.set_start_method(None, force=True)  # type: ignore[arg-type]  # None: the platform's default
    _compat.wrap_preparation_data(_with_notebook_main)


def adopt(fn: Any) -> None:
    """Put the notebook definitions `fn` uses into this rank's `__main__`, where pickle looks for them."""
    main = sys.modules["__main__"]
    names = getattr(fn, "__globals__", {})
    if names.get("__name__") == "__main__":  # a notebook's (or a script's) function, rebuilt by cloudpickle
        for name, value in names.items():
            if not name.startswith("__"):
                setattr(main, name, value)
    if getattr(fn, "__module__", None) == "__main__" and "<" not in getattr(fn, "__qualname__", "<"):
        setattr(main, fn.__qualname__, fn)


def _with_notebook_main(original: Any) -> Any:
    def preparation_data(name: str) -> dict[str, Any]:
        data = original(name)
        if "init_main_from_name" not in data and "init_main_from_path" not in data:
            os.environ[NOTEBOOK_MAIN] = _written()  # before the child (or the forkserver it comes from) starts
            data["init_main_from_name"] = CHILD_MAIN
        return data

    return preparation_data


def _definitions() -> dict[str, Any]:
    """What plain pickle may look up by name in `__main__`: its classes and functions defined in the notebook."""
    main = sys.modules["__main__"]
    return {
        name: value
        for name, value in vars(main).items()
        if isinstance(value, (type, types.FunctionType))
        and getattr(value, "__module__", None) == "__main__"
        and getattr(value, "__qualname__", None) == name
    }


def _written() -> str:
    """The file of this rank's definitions, written once: each picklable one on its own, so that one that is not
    (a class holding a lock) costs only itself; a child that needs it fails as it would in a script."""
    global _file
    if _file is None:
        import cloudpickle

        parts = []
        for name, value in _definitions().items():
            try:
                parts.append(cloudpickle.dumps((name, value)))
            except Exception:  # noqa: BLE001, S112 - cloudpickle raises TypeError, PicklingError, ...
                continue
        fd = os.memfd_create("ddpnb-notebook-main", 0)  # no name on disk; gone with the rank
        with open(fd, "wb", closefd=False) as out:
            cloudpickle.dump(parts, out)
        _file = f"/proc/{os.getpid()}/fd/{fd}"
    return _file


def rebuild(namespace: dict[str, Any]) -> None:
    """In a process the rank started: the rank's definitions, into this module's namespace, its `__main__`."""
    import cloudpickle

    path = os.environ.get(NOTEBOOK_MAIN)
    if not path:
        return
    try:
        with open(path, "rb") as source:
            parts = cloudpickle.load(source)
    except OSError:  # the rank is gone: nothing will use what this process computes
        return
    for part in parts:
        try:
            name, value = cloudpickle.loads(part)
        except Exception:  # noqa: BLE001, S112 - a module only the rank could import, say: the others still come
            continue
        namespace[name] = value
