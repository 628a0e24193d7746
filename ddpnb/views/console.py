"""The dashboard's debugger console, for a run whose cell has returned (`--background`): a rank's pdb prompt, an
input line for its commands, and what pdb answered. The foreground cell asks in the front end's input box instead
(`Run.answer_prompts`, `views.frontend`); either answers through `Run.answer`, whichever comes first."""

from __future__ import annotations

import html
import threading
import warnings
from collections import deque

from ddpnb.core import messages as msg
from ddpnb.core.cellnames import pdb_cell_names
from ddpnb.core.run import Run
from ddpnb.views.html import _MONO, _MUTED, section_html

TRANSCRIPT_LINES = 300  # lines of the pdb session the console keeps


class PromptConsole:
    """Shown while some rank waits at a prompt (one rank at a time, the one that came first), and after that the
    session so far; `update` from the dashboard's redraw, `submit` when the input line is sent (Enter)."""

    def __init__(self, run: Run) -> None:
        import ipywidgets as widgets

        self.run: Run | None = run
        self._lock = threading.Lock()  # the dashboard's thread draws, the kernel's takes the input
        self._asking: msg.Prompt | None = None
        self._transcript: deque[str] = deque(maxlen=TRANSCRIPT_LINES)
        self.title = widgets.HTML()
        self.transcript = widgets.HTML()
        self.input = widgets.Text(
            placeholder="a pdb command, then Enter (c: continue)", layout=widgets.Layout(width="min(100%, 640px)")
        )
        self.input.add_class("ddpnb-console-input")
        with warnings.catch_warnings():
            # Enter alone sends: the suggested replacement (continuous_update=False) also sends a half-typed
            # command when the field loses focus
            warnings.simplefilter("ignore", DeprecationWarning)
            self.input.on_submit(lambda text: self.submit(text.value))
        self.widget = widgets.VBox(
            [self.title, self.transcript, self.input], layout=widgets.Layout(display="none", margin="4px 0")
        )
        self.widget.add_class("ddpnb-console")

    def update(self) -> None:
        run = self.run
        if run is None:
            return
        waiting = run.attempt.broker.waiting
        with self._lock:
            prompt = next(iter(waiting.values()), None)  # the rank that came first
            if prompt is self._asking:
                return
            self._asking = prompt
            if prompt is not None:
                said, _, ask = prompt.text.rpartition("\n")
                self._transcript.extend(pdb_cell_names(said).splitlines())
                others = len(waiting) - 1
                self.title.value = (
                    f'{section_html("debugger")} <span style="{_MUTED}">rank {prompt.rank} '
                    f"waits at {html.escape(ask.strip())}"
                    + (f"; {others} more rank{'s' if others > 1 else ''} after it" if others else "")
                    + "</span>"
                )
                self.input.placeholder = f"(rank {prompt.rank}) {ask.strip()} a command, then Enter (c: continue)"
                self.input.disabled = False
                self.widget.layout.display = None
            else:
                self.title.value = f'{section_html("debugger")} <span style="{_MUTED}">no rank waits at a prompt</span>'
                self.input.disabled = True
            self.transcript.value = (
                f'<pre class="ddpnb-console-transcript" style="{_MONO};margin:2px 0;'
                f'max-height:240px;overflow:auto;white-space:pre-wrap">'
                f"{html.escape(chr(10).join(self._transcript))}</pre>"
            )

    def submit(self, line: str) -> None:
        """The input line (Enter), sent to the prompt it was typed at, if that still waits."""
        run = self.run
        if run is None:
            return
        with self._lock:
            prompt = self._asking
            self.input.value = ""
            if prompt is None:
                return
            if run.answer(prompt, line):
                self._transcript.append(f"(rank {prompt.rank}) (Pdb) {line}")
                self.input.disabled = True  # until the rank's next prompt
            else:
                self._transcript.append(
                    f"(rank {prompt.rank}) {line!r} not sent: no longer waits at that prompt: "
                    f"{run.not_waiting(prompt.rank)}"
                )
        self.update()

    def close(self) -> None:
        self.run = None
