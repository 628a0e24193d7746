"""The engines a run can use, by kind. Each engine package has a kernel-side `engine` module with an
`EngineType` (checks before a run) and an `Engine` (one run's ranks); adding one means adding it here."""

from __future__ import annotations

import importlib

from ddpnb.core.engine import EngineType
from ddpnb.core.spec import EngineKind, LaunchError

_TYPES = {  # imported when first used: `import ddpnb` never imports Ray
    EngineKind.LOCAL: ("ddpnb.engines.local.engine", "LocalType"),
    EngineKind.RAY: ("ddpnb.engines.ray.engine", "RayType"),
}


def kind_of(name: str | EngineKind) -> EngineKind:
    try:
        return EngineKind(name)
    except ValueError:
        names = ", ".join(kind.value for kind in EngineKind)
        raise LaunchError(f"engine must be one of {names}, not {name!r}.") from None


def engine_type(kind: EngineKind) -> EngineType:
    module, name = _TYPES[kind]
    return getattr(importlib.import_module(module), name)()
