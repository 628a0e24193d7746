"""The kernel's names for its notebook cells: a file IPython compiled a cell as, said as IPython says it
(`Cell In[7]`), in tracebacks and for the ranks. Outside IPython nothing is renamed."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable


def cell_names(traceback: str) -> str:
    """`File "/tmp/ipykernel_7/2718.py", line 5` as IPython names its own cells: `Cell In[7], line 5`."""

    def cell(match: re.Match[str]) -> str:
        name = cell_name(match.group(1))
        return f"{name}, line {match.group(2)}" if name else match.group(0)

    return re.sub(r'File "([^"]+)", line (\d+)', cell, traceback)


def pdb_cell_names(text: str) -> str:
    """pdb's `> /tmp/ipykernel_7/2718.py(5)train()` as IPython names its own cells: `> Cell In[7], line 5, in
    train()`."""

    def cell(match: re.Match[str]) -> str:
        name = cell_name(match.group(2))
        return f"{match.group(1)}{name}, line {match.group(3)}, in {match.group(4)}" if name else match.group(0)

    return re.sub(r"^(> |  )?(\S+)\((\d+)\)(\S+\(\))$", cell, text, flags=re.MULTILINE)


def pdb_where(text: str) -> str:
    """Where pdb's latest `> file(line)function()` line says it stopped: 'Cell In[7], line 5, in train', or the
    file's name and line; '' where pdb said no such line."""
    found = re.findall(r"^> (\S+)\((\d+)\)(\S+)\(\)$", text, flags=re.MULTILINE)
    if not found:
        return ""
    filename, line, function = found[-1]
    return f"{cell_name(filename) or filename}, line {line}, in {function}"


def cell_name(filename: str) -> str:
    """'Cell In[7]' for the file IPython compiled cell 7 as, in this kernel; '' for any other file (or outside
    IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    name_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    named = name_of(filename) if name_of is not None else None
    return " ".join(named) if named else ""


def cell_names_of(filenames: Iterable[str]) -> dict[str, str]:
    """{filename: 'Cell In[7]'} for those of `filenames` that are this kernel's cells: what ranks name them by."""
    return {filename: name for filename in filenames if (name := cell_name(filename))}
