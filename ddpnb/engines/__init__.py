"""The engines a run can use, found by name: ddpnb's own (`_BUILT_IN`), and any package's through the `ddpnb.engines`
entry point group (`[project.entry-points."ddpnb.engines"] NAME = "package.module:EngineTypeClass"`).

An engine type (`core.engine.EngineType`) brings its name, capabilities, options dataclass, magic flags and checks;
its module is imported only when it is looked up, and imports its platform (Ray, Slurm's CLI) only when used.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
from typing import Any

from ddpnb.core.engine import EngineType, Flag
from ddpnb.core.spec import LaunchError

GROUP = "ddpnb.engines"
DEFAULT = "local"
# ddpnb's own engines, listed here only (not as entry points too), so that a checkout used without installing it
# has them; another package's engine comes through the entry point group
_BUILT_IN = {
    "local": "ddpnb.engines.local.engine:LocalType",
    "ray": "ddpnb.engines.ray.engine:RayType",
    "slurm": "ddpnb.engines.slurm.engine:SlurmType",
}


@functools.cache
def _table() -> dict[str, str]:
    found = dict(_BUILT_IN)
    for entry in importlib.metadata.entry_points(group=GROUP):
        found[entry.name] = entry.value
    return found


def names() -> list[str]:
    return list(_table())


@functools.cache
def find(name: str) -> type[EngineType]:
    """The engine type registered as `name`; LaunchError naming the choices."""
    target = _table().get(str(name))
    if target is None:
        raise LaunchError(f"engine must be one of {', '.join(names())}, not {name!r}.")
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def engine_type(name: str) -> EngineType:
    """An instance, ready to check and create runs (LaunchError where its platform is missing here)."""
    return find(name)()


def option_names(name: str) -> list[str]:
    return [field.name for field in dataclasses.fields(find(name).Options)]


def options(name: str, given: dict[str, Any]) -> Any:
    """The engine's options from `given` (names its `Options` dataclass has; None means the default). An option of
    another engine, or of none, is a LaunchError saying which engine takes it."""
    mine = set(option_names(name))
    for key in given:
        if key in mine:
            continue
        owner = next((other for other in names() if other != name and key in _safe_option_names(other)), None)
        if owner is None:
            raise LaunchError(
                f"there is no option {key!r}: see help(ddpnb.LaunchOptions), and the engine's own "
                f"options in help(ddpnb.engines.find({name!r}).Options)."
            )
        theirs = " and ".join(other for other in given if other in _safe_option_names(owner))  # what was given
        raise LaunchError(
            f"{theirs} {'are' if ' and ' in theirs else 'is'} for the {owner} engine: add "
            f"engine={owner!r} (--engine {owner})."
        )
    return find(name).Options(**{key: value for key, value in given.items() if value is not None})


def _safe_option_names(name: str) -> list[str]:
    try:
        return option_names(name)
    except ImportError:  # an engine whose module cannot be imported here takes nothing we can name
        return []


def flags() -> list[tuple[str, list[Flag]]]:
    """Every engine's magic flags, by engine name, for `%%ddp` and `%ddp_start`."""
    found = []
    for name in names():
        try:
            found.append((name, list(find(name).flags)))
        except ImportError:  # a registered engine that cannot be imported here: its flags are not offered
            continue
    return found
