"""One name, one thing: no two classes inside ddpnb share a name (issue 41), so a name in a traceback, a doc or a
review points at one class."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import ddpnb

pytestmark = pytest.mark.fast


def test_no_two_classes_in_ddpnb_share_a_name():
    where: dict[str, list[str]] = defaultdict(list)
    package = Path(ddpnb.__file__).parent
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(package.parent)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
