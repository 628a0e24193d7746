"""The notebook's cells on a rank: their source in linecache (so tracebacks show their lines) and their names
(so warnings say `Cell In[7], line 4`, as tracebacks do once the kernel names them)."""

from __future__ import annotations

import linecache
import warnings
from collections.abc import Mapping, Sequence

_names: dict[str, str] = {}  # the file IPython compiled a cell as -> 'Cell In[7]'
_plain_format = warnings.formatwarning


def register(sources: Mapping[str, Sequence[str]], names: Mapping[str, str]) -> None:
    """Cells' lines, by the file IPython compiled each as, and their names ('Cell In[7]')."""
    linecache.cache.update({name: (len("".join(lines)), None, list(lines), name) for name, lines in sources.items()})
    _names.update(names)
    if warnings.formatwarning is _plain_format:  # not over a format the user's code set
        warnings.formatwarning = _format


def location(filename: str, line: int) -> str:
    """`Cell In[7], line 4` for a notebook cell's line, `File "x.py", line 4` for any other file's."""
    name = _names.get(filename)
    return f"{name}, line {line}" if name else f'File "{filename}", line {line}'


def _format(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """Python's own format, the cell's name in place of its file: 'Cell In[7], line 4: UserWarning: ...'."""
    text = _plain_format(message, category, filename, lineno, line)
    name = _names.get(filename)
    return text.replace(f"{filename}:{lineno}:", f"{name}, line {lineno}:", 1) if name else text
