"""What a notebook function uses, as source a script can hold: found from its globals and closures, transitively.

Each name the function (or a definition it needs) looks up becomes one definition, written once, after the ones
it needs: a module as the import statement the notebook used (same alias), a function or class as its source
from the notebook's cell, a plain constant as a literal, a library object as `from module import name`. What has
no source (a tensor or model built in earlier cells, an open file) is refused with the line that uses it, or,
with a data directory, saved there and loaded by the script at start.

Which names a definition needs is read from its own compiled source (the global lookups of every code object in
it), so a local variable that happens to share a notebook global's name never drags that global in.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import dis
import enum
import functools
import inspect
import linecache
import math
import pathlib
import sys
import textwrap
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GLOBAL_OPS = {"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_FROM_DICT_OR_GLOBALS"}
MAX_LITERAL = 5000  # characters: a constant longer than this as a literal is data, not code to read


class ExportError(ValueError):
    """The function cannot be written as a script as it is; the message says what uses what, and what to do."""


class Kind(enum.Enum):
    IMPORT = "import"
    CODE = "code"  # a definition's source, or a constant's assignment
    DATA = "data"  # a value saved next to the script and loaded at start


@dataclass
class Definition:
    name: str
    kind: Kind
    text: str = ""  # the source lines, as the script holds them (IMPORT, CODE)
    value: Any = None  # DATA: what is saved


@dataclass(frozen=True)
class Use:
    """Where a name is used: 'train' at 'Cell In[5], line 7', whose line is `x = x @ weights`."""

    by: str
    where: str = ""
    line: str = ""

    def said(self) -> str:
        return f"{self.by} uses it" + (f" at {self.where}: `{self.line}`" if self.where else "")


@dataclass
class Collected:
    definitions: list[Definition] = field(default_factory=list)  # dependency order: each after what it needs

    @property
    def imports(self) -> list[Definition]:
        return [d for d in self.definitions if d.kind is Kind.IMPORT]

    @property
    def code(self) -> list[Definition]:
        return [d for d in self.definitions if d.kind is not Kind.IMPORT]

    @property
    def data(self) -> list[Definition]:
        return [d for d in self.definitions if d.kind is Kind.DATA]


class Cells:
    """The source files a kernel compiled its cells as (IPython keeps their lines in linecache), in the order they
    ran; outside IPython, none. A function defined in a real file reads its lines from that file."""

    def __init__(self) -> None:
        shell = _shell()
        numbers: Mapping[str, int] = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}
        self.order = sorted(numbers, key=numbers.__getitem__)  # oldest first
        self.numbers = dict(numbers)
        self._trees: dict[str, ast.Module | None] = {}

    def name(self, filename: str) -> str:
        number = self.numbers.get(filename)
        return f"Cell In[{number}]" if number is not None else filename

    def tree(self, filename: str) -> ast.Module | None:
        if filename not in self._trees:
            try:
                self._trees[filename] = ast.parse("".join(linecache.getlines(filename)))
            except (SyntaxError, ValueError):
                self._trees[filename] = None
        return self._trees[filename]

    def lines(self, filename: str) -> list[str]:
        return linecache.getlines(filename)

    def binding(self, name: str, kinds: tuple[type, ...]) -> tuple[str, ast.stmt] | None:
        """The latest top-level statement of a cell that binds `name` and is one of `kinds`."""
        for filename in reversed(self.order):
            tree = self.tree(filename)
            for node in reversed(tree.body if tree is not None else []):
                if isinstance(node, kinds) and name in _bound_by(node):
                    return filename, node
        return None


def _shell() -> Any:
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def _shells(name: str, scope: Mapping[str, Any]) -> bool:
    """Whether `name` in `scope` is a builtin that IPython put there in its own version (`open`, which warns about
    the kernel's standard streams): the script's builtin is that name there."""
    shell = _shell()
    hidden = getattr(shell, "user_ns_hidden", {})
    return hasattr(builtins, name) and name in hidden and hidden[name] is scope.get(name)


def _bound_by(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {alias.asname or alias.name.partition(".")[0] for alias in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {target.id for target in targets if isinstance(target, ast.Name)}


def collect(fn: Any, name: str, args: tuple[Any, ...] = (), data: bool = False) -> Collected:
    """Every definition `fn`, called `name` in the script, needs; with `args`, also `ARGS`, the extra arguments
    it is called with. `data`: values without source become DATA definitions instead of an ExportError."""
    collector = _Collector(Cells(), data)
    collector.need(name, fn, Use(by="the export"), scope=getattr(inspect.unwrap(fn), "__globals__", {}))
    if args:
        collector.need("ARGS", args, Use(by=f"the call of {name} (its args)"), scope={})
    return Collected(list(collector.definitions.values()))


class _Collector:
    def __init__(self, cells: Cells, data: bool) -> None:
        self.cells = cells
        self.data = data
        self.definitions: dict[str, Definition] = {}  # in the order they are complete: what they need comes first
        self.values: dict[str, Any] = {}

    def need(self, name: str, value: Any, use: Use, scope: Mapping[str, Any]) -> None:
        if name in self.values:
            if self.values[name] is value or _same_constant(self.values[name], value):
                return
            raise ExportError(
                f"two different values are both called `{name}` in what the script needs ({_kind(self.values[name])} "
                f"and {_kind(value)}; {use.said()}): a script has one `{name}`. Rename one of them in the notebook."
            )
        self.values[name] = value
        self.definitions[name] = self._define(name, value, use, scope)

    # -- one name's definition -------------------------------------------------------------------------------

    def _define(self, name: str, value: Any, use: Use, scope: Mapping[str, Any]) -> Definition:
        if inspect.ismodule(value):
            return Definition(name, Kind.IMPORT, self._import(name, value))
        if _from_source(value):
            return self._source_definition(name, value, use, scope)
        if isinstance(value, functools.partial):
            return self._partial(name, value, use, scope)
        imported = self._imported_object(name, value)
        if imported is not None:
            return Definition(name, Kind.IMPORT, imported)
        try:
            text = self._literal(value, name)
        except _NotLiteral:
            pass
        else:
            if len(text) <= MAX_LITERAL:
                return Definition(name, Kind.CODE, f"{name} = {text}\n")
        return self._data(name, value, use)

    def _import(self, name: str, module: types.ModuleType) -> str:
        found = self._cell_import(name, module)
        if found is not None:
            return found
        return _import_statement(ast.alias(module.__name__, None if module.__name__ == name else name))

    def _cell_import(self, name: str, value: Any) -> str | None:
        """The notebook's own import of `name` (its alias kept), if it still gives `value`."""
        found = self.cells.binding(name, (ast.Import, ast.ImportFrom))
        if found is None:
            return None
        node = found[1]
        for alias in node.names:
            if (alias.asname or alias.name.partition(".")[0]) != name:
                continue
            if isinstance(node, ast.Import):
                module = sys.modules.get(alias.name if alias.asname else name)
                if module is value:
                    return _import_statement(alias)
            elif node.level == 0 and node.module and getattr(sys.modules.get(node.module), alias.name, None) is value:
                return ast.unparse(ast.ImportFrom(module=node.module, names=[alias], level=0)) + "\n"
        return None

    def _imported_object(self, name: str, value: Any) -> str | None:
        """`from module import qualname as name` for a library's function, class or other named object that
        importing finds again (the notebook's own import line when it has one)."""
        found = self._cell_import(name, value)
        if found is not None:
            return found
        module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if not isinstance(module, str) or not isinstance(qualname, str) or "." in qualname or "<" in qualname:
            return None
        if module == "__main__" or getattr(sys.modules.get(module), qualname, None) is not value:
            return None
        if isinstance(value, type) and module == "builtins":
            return None if name == qualname else f"{name} = {qualname}\n"
        return f"from {module} import {qualname}" + (f" as {name}" if name != qualname else "") + "\n"

    # -- functions and classes from the notebook's cells ----------------------------------------------------------

    def _source_definition(self, name: str, value: Any, use: Use, scope: Mapping[str, Any]) -> Definition:
        if isinstance(value, type):
            filename, node = self._class_statement(value, use)
            if node.name != name:  # the class under another name too
                self.need(node.name, value, use, scope)
                return Definition(name, Kind.CODE, f"{name} = {node.name}\n")
            return self._statement(name, filename, node, _class_scope(value, scope))
        code = value.__code__
        filename = code.co_filename
        statement = self._enclosing(filename, code.co_firstlineno, code.co_name)
        if statement is not None and statement[1] and not statement[0].decorator_list:
            node = statement[0]  # a top-level def, no decorators: its source is exactly this function
            if node.name != name:
                self.need(node.name, value, use, value.__globals__)
                return Definition(name, Kind.CODE, f"{name} = {node.name}\n")
            return self._statement(name, filename, node, value.__globals__)
        # a decorated function, a closure a factory made, a lambda: the statement of the cell that bound the name,
        # run again, makes it again
        bound = (
            self.cells.binding(name, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign))
            if scope.get(name) is value
            else None
        )
        if bound is not None:
            return self._statement(name, bound[0], bound[1], value.__globals__)
        if statement is not None and value.__name__ != "<lambda>":  # a closure: its def, its cells as names
            node = statement[0]
            if node.name != name:
                self.need(node.name, value, use, scope)
                return Definition(name, Kind.CODE, f"{name} = {node.name}\n")
            closure = {
                var: cell.cell_contents for var, cell in zip(code.co_freevars, value.__closure__ or ()) if _filled(cell)
            }
            node = _undecorated(node)
            return self._statement(name, filename, node, {**value.__globals__, **closure})
        raise ExportError(
            f"`{name}` ({_kind(value)}) has no source the script can hold: it is not defined by a `def` or "
            f"assignment at the top of a notebook cell ({use.said()}). Define it at the top of a cell, or build it "
            "inside the function."
        )

    def _class_statement(self, cls: type, use: Use) -> tuple[str, ast.ClassDef]:
        if "<locals>" in cls.__qualname__:
            raise ExportError(
                f"class `{cls.__qualname__}` is defined inside a function ({use.said()}): the script can hold "
                "classes defined at the top of a notebook cell. Move its definition there."
            )
        for member in vars(cls).values():
            function = getattr(member, "__func__", getattr(member, "fget", member))
            code = getattr(function, "__code__", None)
            if code is not None:
                found = self._enclosing(code.co_filename, code.co_firstlineno, cls.__name__, classes=True)
                if found is not None and found[1]:
                    return code.co_filename, found[0]  # type: ignore[return-value]
        bound = self.cells.binding(cls.__name__, (ast.ClassDef,))
        if bound is None:
            raise ExportError(
                f"the source of class `{cls.__name__}` was not found in the notebook's cells ({use.said()}): "
                "run the cell that defines it again, then export."
            )
        return bound[0], bound[1]  # type: ignore[return-value]

    def _enclosing(
        self, filename: str, line: int, name: str, classes: bool = False
    ) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, bool] | None:
        """The innermost def (or class) called `name` whose lines hold `line`, and whether it is at the top."""
        tree = self.cells.tree(filename)
        if tree is None:
            return None
        kinds = (ast.ClassDef,) if classes else (ast.FunctionDef, ast.AsyncFunctionDef)
        found = None
        for node in ast.walk(tree):
            if isinstance(node, kinds) and node.name == name:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                inside = first <= line <= (node.end_lineno or node.lineno)
                if inside and (found is None or node.lineno > found.lineno):
                    found = node
        return (found, found in tree.body) if found is not None else None

    def _statement(self, name: str, filename: str, node: ast.stmt, scope: Mapping[str, Any]) -> Definition:
        """A statement's source, dedented, and a definition of every notebook name it looks up."""
        lines = self.cells.lines(filename)
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        text = textwrap.dedent("".join(lines[first - 1 : node.end_lineno]))
        if (
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and node.decorator_list
            and getattr(node, "_ddpnb_undecorated", False)
        ):
            text = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
            first = node.lineno
        code = compile("\n" * (first - 1) + text, filename, "exec")
        bound = _bound_by(node)
        for looked_up, line in _global_names(code):
            if looked_up in bound or looked_up not in scope or looked_up.startswith("__") or _shells(looked_up, scope):
                continue  # a builtin, a name the statement itself binds, a module's own (`__name__`)
            where = self.cells.name(filename)
            source = lines[line - 1].strip() if 0 < line <= len(lines) else ""
            self.need(looked_up, scope[looked_up], Use(name, f"{where}, line {line}", source), scope)
        return Definition(name, Kind.CODE, text if text.endswith("\n") else text + "\n")

    # -- values --------------------------------------------------------------------------------------------------

    def _partial(self, name: str, value: functools.partial, use: Use, scope: Mapping[str, Any]) -> Definition:
        try:
            arguments = [self._literal(arg, name) for arg in value.args]
            arguments += [f"{key}={self._literal(arg, name)}" for key, arg in value.keywords.items()]
        except _NotLiteral:
            bound = self.cells.binding(name, (ast.Assign, ast.AnnAssign)) if scope.get(name) is value else None
            if bound is None:
                return self._data(name, value, use)
            return self._statement(name, bound[0], bound[1], scope)
        inner = getattr(value.func, "__name__", "") or f"{name}_function"
        self.need(inner, value.func, Use(name), getattr(value.func, "__globals__", scope))
        self.need("functools", functools, Use(name), {})
        return Definition(name, Kind.CODE, f"{name} = functools.partial({', '.join([inner, *arguments])})\n")

    def _literal(self, value: Any, name: str) -> str:
        """`value` as Python source that makes an equal value; _NotLiteral where there is none."""
        if value is None or isinstance(value, bool | int | str | bytes):
            return repr(value)
        if isinstance(value, float):
            return repr(value) if math.isfinite(value) else f'float("{value}")'
        if isinstance(value, complex):
            return repr(value) if math.isfinite(abs(value)) else f'complex("{value}")'
        if isinstance(value, enum.Enum):
            self._need_type(type(value), name)
            return f"{type(value).__name__}.{value.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            self._need_type(type(value), name)
            fields = [
                f"{f.name}={self._literal(getattr(value, f.name), name)}" for f in dataclasses.fields(value) if f.init
            ]
            return f"{type(value).__name__}({', '.join(fields)})"
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            self._need_type(type(value), name)
            return f"{type(value).__name__}({', '.join(self._literal(item, name) for item in value)})"
        if type(value) in (list, tuple, set, frozenset):
            items = [self._literal(item, name) for item in value]
            if isinstance(value, set | frozenset):
                items.sort()
                inner = "{" + ", ".join(items) + "}" if items else "set()"
                return inner if isinstance(value, set) else f"frozenset({inner if items else ''})"
            if isinstance(value, tuple):
                return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
            return "[" + ", ".join(items) + "]"
        if type(value) is dict:
            return (
                "{" + ", ".join(f"{self._literal(k, name)}: {self._literal(v, name)}" for k, v in value.items()) + "}"
            )
        if isinstance(value, pathlib.PurePath):
            self._need_type(type(value), name)
            return f"{type(value).__name__}({str(value)!r})"
        if isinstance(value, range):
            return repr(value)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.dtype | torch.device):
            self.need("torch", torch, Use(name), {})
            return str(value) if isinstance(value, torch.dtype) else f"torch.device({str(value)!r})"
        raise _NotLiteral

    def _need_type(self, cls: type, name: str) -> None:
        self.need(cls.__name__, cls, Use(name), vars(sys.modules.get(cls.__module__, types.ModuleType("?"))))

    def _data(self, name: str, value: Any, use: Use) -> Definition:
        if self.data:
            return Definition(name, Kind.DATA, value=value)
        raise ExportError(
            f"`{name}` is {_kind(value)} from the notebook, with no source to write into a script: {use.said()}. "
            f"Create it inside the function; or save it (torch.save({name}, PATH)) and load it in the function "
            f"(torch.load(PATH)); or export with a data directory (`%ddp_export PATH --data DIR`, "
            f"`ddpnb.export(fn, PATH, data=DIR)`), which saves it there and has the script load it at start."
        )


class _NotLiteral(Exception):
    """The value has no literal form (a tensor, a model, a file)."""


def _import_statement(alias: ast.alias) -> str:
    """`import torch`, `import numpy as np`; `import torch.nn as nn` as `from torch import nn`, as linters ask."""
    parent, _, last = alias.name.rpartition(".")
    if parent and alias.asname == last:
        return f"from {parent} import {last}\n"
    return ast.unparse(ast.Import(names=[alias])) + "\n"


def _from_source(value: Any) -> bool:
    """A function or class only the notebook (or a script's `__main__`) defines: importing cannot find it."""
    if isinstance(value, types.FunctionType):
        return value.__module__ == "__main__" or value.__module__ is None
    return isinstance(value, type) and value.__module__ == "__main__"


def _class_scope(cls: type, scope: Mapping[str, Any]) -> Mapping[str, Any]:
    for member in vars(cls).values():
        function = getattr(member, "__func__", getattr(member, "fget", member))
        if isinstance(function, types.FunctionType):
            return function.__globals__
    main = sys.modules.get("__main__")
    return {**vars(main), **scope} if main is not None else scope


def _undecorated(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> ast.stmt:
    """A nested def whose decorators are the enclosing function's business: its source from the `def` line."""
    if node.decorator_list:
        node._ddpnb_undecorated = True  # type: ignore[attr-defined]
    return node


def _global_names(code: types.CodeType) -> list[tuple[str, int]]:
    """Every global lookup in `code` and the code nested in it, with its line, first use first."""
    found: dict[str, int] = {}
    for instruction in dis.get_instructions(code):
        if instruction.opname in GLOBAL_OPS and instruction.argval not in found:
            position = instruction.positions
            found[instruction.argval] = position.lineno if position and position.lineno else 0
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            for name, line in _global_names(const):
                found.setdefault(name, line)
    return list(found.items())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises ValueError
    except ValueError:
        return False
    return True


def _same_constant(one: Any, other: Any) -> bool:
    try:
        return type(one) is type(other) and isinstance(one, int | float | str | bytes | bool) and one == other
    except Exception:  # noqa: BLE001 - a comparison that raises is not the same value
        return False


def _kind(value: Any) -> str:
    """'a torch.Tensor of shape (3, 3)', 'a function', 'an int'."""
    kind = type(value)
    name = (
        kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"
    )
    if isinstance(value, types.FunctionType):
        return "a lambda" if value.__name__ == "<lambda>" else f"function {value.__qualname__}"
    shape = getattr(value, "shape", None)
    if not isinstance(value, type) and shape is not None:
        try:
            name = f"{name} of shape {tuple(shape)}"
        except TypeError:
            pass
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name}"
