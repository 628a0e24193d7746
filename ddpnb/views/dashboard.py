"""The live dashboard: an ipywidgets projection of a run's record, redrawn when the run's reader has news (output
at most five times a second, ten on Ray; a rank's turn at once) and once a second anyway.

The supervisor thread keeps the record; this view only reads it. Its own thread redraws (so background
runs, where nobody calls `wait()`, stay live) and sends a widget update only for a part that changed. Each part
is drawn by `views.html`, whose static summary replaces the widget when the run ends. The log panel holds the
last `LOG_LINES` lines per view; every line is in the rank's log. Its all-ranks view folds the same line from
several ranks into one (`views.fold`); each rank's view is as printed.
"""

from __future__ import annotations

import html
import threading
import time
from collections import deque
from typing import Any

from ddpnb.core import groups
from ddpnb.core.output import split_at_restarts
from ddpnb.core.record import OutputLine
from ddpnb.core.report import restart_line
from ddpnb.core.run import TICK, Run
from ddpnb.core.words import ranks_text
from ddpnb.views.console import PromptConsole
from ddpnb.views.fold import FoldedLine, Folder
from ddpnb.views.html import (
    MANY_RANKS,
    MAX_LINE_CHARS,
    RestartMark,
    any_line_html,
    error_html,
    header_html,
    log_html,
    log_location,
    log_note,
    metrics_signature,
    plots_html,
    ranks_html,
    section_html,
    stacks_html,
    stall_html,
    stall_stacks_html,
    summary_html,
    total_lines,
)
from ddpnb.views.text import summary_text

LOG_LINES = 200  # lines the log panel keeps for each of its views (all ranks, each rank)
RANK_LINES = 64 * LOG_LINES  # lines the per-rank views keep in all: fewer a rank past 64 ranks ...
MIN_RANK_LINES = 20  # ... but never fewer than this (its log file has every line)
MANY_REDRAW = 1.0  # seconds between two redraws from `groups.GROUP_FROM` ranks up (below: at the reader's news)
PLOT_INTERVAL = 1.0  # seconds between two redraws of the plots (the costliest part) while the run goes on

# the live widget's extras, which need the page's CSS (theme variables, the log scrolled to its end); the static
# summary does without them
STYLE = """<style>
.ddpnb{font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:var(--jp-ui-font-size1,13px);
  line-height:1.4;max-width:1100px}
.ddpnb .widget-html-content{line-height:1.4}
.ddpnb code,.ddpnb pre,.ddpnb .ddpnb-mono{font-family:var(--jp-code-font-family,monospace)!important}
.ddpnb table.ddpnb-ranks{width:100%;table-layout:auto;border:none}
.ddpnb .ddpnb-ranks tbody tr,.ddpnb .ddpnb-ranks tbody tr:nth-child(odd),
.ddpnb .ddpnb-ranks tbody tr:nth-child(even){background:transparent}
.ddpnb .ddpnb-ranks td.ddpnb-last{width:99%}
.ddpnb svg .ddpnb-axis{stroke:var(--jp-border-color1,#bdbdbd);stroke-opacity:1}
.ddpnb svg .ddpnb-grid{stroke:var(--jp-border-color2,#eeeeee);stroke-opacity:1}
.ddpnb svg text{fill:var(--jp-ui-font-color2,#616161);font-family:var(--jp-ui-font-family,sans-serif)}
.ddpnb-log{max-height:220px;overflow-y:auto;display:flex;flex-direction:column-reverse}
.ddpnb .ddpnb-ranks.ddpnb-compact th{position:sticky;top:0;background:var(--jp-layout-color1,#fff)}
.ddpnb .widget-toggle-buttons .widget-toggle-button{font-size:var(--jp-ui-font-size0,12px)}
</style>"""


class Dashboard:
    """Shows `run` as a live widget in the current cell; replaces it by a static summary when the run ends.

    `foreground`: the cell waits for the run, so the kernel cannot take a button click before it ends; the Stop
    button is then disabled and says to interrupt the kernel instead.
    """

    def __init__(self, run: Run, *, foreground: bool, fold: bool = True) -> None:
        import ipywidgets as widgets
        from IPython import get_ipython
        from IPython.display import display

        self.foreground = foreground  # its cell raises the run's error: the traceback is shown there, once
        self.run: Run | None = run  # dropped when the run ends: its value goes with the caller's last reference
        self.record = run.record
        self._lock = threading.RLock()  # one redraw at a time: its own thread, wait()'s thread, a click
        self._finished = False
        self._seen = 0  # sequence number of the last line taken from the record
        self._restarts_shown = 0  # earlier attempts whose restart is marked in the logs
        # a line cut for the panel (or a restart's mark), its HTML
        self._all: deque[tuple[FoldedLine | RestartMark, str]] = deque(maxlen=LOG_LINES)
        # as printed, drawn when picked; at most RANK_LINES in all (a thousand ranks' 200 lines each: 90 MB)
        kept = max(MIN_RANK_LINES, min(LOG_LINES, RANK_LINES // self.record.world_size))
        self._per_rank: list[deque[OutputLine | RestartMark]] = [
            deque(maxlen=kept) for _ in range(self.record.world_size)
        ]
        self._folder = Folder(self.record.world_size, enabled=fold)
        self._metrics_seen: tuple[int, ...] | None = None
        self._plotted = 0.0  # when the plots were last drawn
        self._lines_changed = True

        self.header = widgets.HTML(layout=widgets.Layout(flex="1 1 auto"))
        self.stop_button = widgets.Button(
            description="Stop",
            icon="stop",
            disabled=foreground,
            tooltip=(
                "Interrupt the kernel (■) to stop: this cell is waiting for the run"
                if foreground
                else "Stop every rank of this run"
            ),
            layout=widgets.Layout(width="auto", height="26px"),
        )
        self.stop_button.on_click(self._on_stop)
        self.stacks_button = widgets.Button(
            description="Stacks",
            icon="list",
            disabled=foreground,
            tooltip=(
                "Interrupt the kernel, or run with --background, to ask: this cell is waiting for the run"
                if foreground
                else "Show where every rank is now (its Python stack)"
            ),
            layout=widgets.Layout(width="auto", height="26px"),
        )
        self.stacks_button.on_click(self._on_stacks)
        self.stacks = widgets.HTML(layout=widgets.Layout(display="none"))
        self.stall = widgets.HTML()
        # a cell that waits asks in the front end's input box; one that returned, here
        self.console = None if foreground else PromptConsole(run)
        self.stall_stacks = widgets.HTML()  # redrawn only when the stall doctor takes the stacks again
        self._stall_seen: object = None  # the diagnosis whose stacks it shows
        self.ranks = widgets.HTML()
        self.plots = widgets.HTML()
        options = [("all ranks", -1)] + [(f"rank {r}", r) for r in range(self.record.world_size)]
        picker_type = widgets.ToggleButtons if self.record.world_size < MANY_RANKS else widgets.Dropdown
        self.log_picker = picker_type(options=options, value=-1, layout=widgets.Layout(width="auto"))
        if picker_type is widgets.ToggleButtons:
            self.log_picker.style.button_width = "auto"
        self.log_picker.observe(self._on_pick, names="value")
        self.log = widgets.HTML()
        self.error = widgets.HTML(layout=widgets.Layout(display="none"))
        log_bar = widgets.HBox(
            [widgets.HTML(section_html("output")), self.log_picker],
            # grid_gap: ipywidgets has no `gap`; CSS's `grid-gap` is its alias, for flex too
            layout=widgets.Layout(align_items="center", grid_gap="10px"),
        )
        self.widget = widgets.VBox(
            [
                widgets.HTML(STYLE),
                widgets.HBox(
                    [self.header, self.stacks_button, self.stop_button], layout=widgets.Layout(align_items="center")
                ),
                self.ranks,
                self.stall,
                self.stall_stacks,
                *([self.console.widget] if self.console else []),
                self.error,
                self.plots,
                log_bar,
                self.log,
                self.stacks,
            ],
            layout=widgets.Layout(padding="2px 4px"),
        )
        self.widget.add_class("ddpnb")
        self._render()
        bundle = self.widget._repr_mimebundle_()
        # what a saved notebook keeps of a run that had not ended (the summary takes the widget's place when it
        # ends), and what a page without the kernel's widgets shows of it: GitHub, nbviewer, nbconvert
        saved = (
            f"{self.record.function} on {ranks_text(self.record.world_size)}: still running when this notebook "
            "was saved (its live dashboard needs the kernel that ran it). Logs: "
        )
        bundle["text/plain"] = f"[ddpnb] {saved}{self.record.run_dir}"
        bundle["text/html"] = (
            f'<div class="ddpnb-saved-live" style="opacity:0.7;font-size:12px">ddpnb: '
            f"{html.escape(saved)}<code>{html.escape(str(self.record.run_dir))}</code></div>"
        )
        # outside IPython (a script forcing view="widget", a benchmark) the widget is drawn but shown nowhere
        self._display = display(bundle, raw=True, display_id=True) if get_ipython() is not None else None
        run.subscribe(self._on_wait, news=False)
        threading.Thread(target=self._loop, name="ddpnb-dashboard", daemon=True).start()

    # --- drawing ---------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        seen = 0
        try:
            while (run := self.run) is not None and not run.done:
                drawn = time.monotonic()
                self._render()
                seen = run.watch(seen, TICK)  # the reader's news, or a TICK for the clocks
                if groups.grouped(self.record.world_size):  # a thousand ranks' redraw is 70 ms: not 5 a second
                    time.sleep(max(0.0, MANY_REDRAW - (time.monotonic() - drawn)))
        finally:  # a redraw's bug still releases the widgets
            self.finish()

    def _on_wait(self) -> None:
        """Called by `Run.wait()`: a foreground cell ends only after its summary is in place."""
        run = self.run
        if run is None or run.done:
            self.finish()

    def finish(self) -> None:
        """Draw the final state, replace the widget by the static summary, then close every widget (once)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            run, self.run = self.run, None
            try:
                self._render(run)
                if self._display is not None:
                    self._display.update(
                        {
                            "text/html": summary_html(
                                self.record, [line for line, _ in self._all], full_traceback=not self.foreground
                            ),
                            "text/plain": summary_text(self.record),
                        },
                        raw=True,
                    )
                    if self.foreground and run is not None:  # its error, raised right below, leaves them out
                        run.summary_above = True
            finally:  # the summary shows now, which needs no widget: none stays in the kernel's registry
                if self.console is not None:
                    self.console.close()
                close_all(self.widget)
                if run is not None:
                    run.unsubscribe(self._on_wait)

    def _render(self, run: Run | None = None) -> None:
        """Draw the record; `run`: the one `finish` let go of, whose last lines are still to take.

        Every part is built before any widget is set: the page then takes a redraw as one change (its updates a few
        milliseconds apart), not as the parts built one after another (a thousand ranks' plots take tens of ms)."""
        with self._lock:
            record = self.record
            self._take_lines(run or self.run)
            values: list[tuple[Any, str]] = [
                (self.header, header_html(record)),
                (self.ranks, ranks_html(record)),
                (self.stall, stall_html(record, self.foreground)),
            ]
            shown = record.stall.diagnosis if record.stall is not None and record.stalled else None
            if shown is not self._stall_seen:
                self._stall_seen = shown
                values.append((self.stall_stacks, stall_stacks_html(record)))
            signature = metrics_signature(record)
            if signature != self._metrics_seen and (
                time.monotonic() - self._plotted >= PLOT_INTERVAL or self._finished
            ):  # the final state is drawn whole
                self._metrics_seen, self._plotted = signature, time.monotonic()
                values.append((self.plots, plots_html(record)))
            if self._lines_changed:
                self._lines_changed = False
                values.append((self.log, self._log_value()))
            failed = bool(record.failures or record.attempts)
            if failed:
                values.append((self.error, error_html(record, full_traceback=not self.foreground)))
            for widget, value in values:  # a widget sends only a value that changed
                widget.value = value
            if failed and self.error.layout.display == "none":
                self.error.layout.display = None
            if self.console is not None:
                self.console.update()

    def _take_lines(self, run: Run | None) -> None:
        if run is None:
            return
        done = run.done  # before reading: the lines read after it are the last ones
        new, _, self._seen = run.lines_since(self._seen)
        new = [line._replace(text=line.text[:MAX_LINE_CHARS]) for line in new]
        now = time.monotonic()
        # a restart's mark goes where it happened, as the text view's line
        for lines, attempt in split_at_restarts(new, self.record.attempts[self._restarts_shown :], self._seen):
            self._add(lines, self._folder.add(lines, now) + (self._folder.flush() if attempt or done else []))
            if attempt is not None:
                self._restarts_shown += 1
                mark = RestartMark(restart_line(attempt, self.record.max_restarts))
                self._all.append((mark, any_line_html(mark)))
                for shown in self._per_rank:
                    shown.append(mark)
                self._lines_changed = True

    def _add(self, new: list[OutputLine], folded: list[FoldedLine]) -> None:
        """Lines as printed, into each rank's log; as folded, into the all-ranks log."""
        for line in new:
            self._per_rank[line.rank].append(line)
        for line in folded:
            self._all.append((line, any_line_html(line)))
        if new or folded:
            self._lines_changed = True

    def _log_value(self) -> str:
        rank = self.log_picker.value
        record = self.record
        if rank == -1:
            return log_html(
                (html_line for _, html_line in self._all),
                log_note([line for line, _ in self._all], total_lines(record), log_location(record)),
            )
        lines = list(self._per_rank[rank])
        where = f"<code>{html.escape(str(record.ranks[rank].log_path))}</code>"
        return log_html(map(any_line_html, lines), log_note(lines, total_lines(record, rank), where))

    # --- controls ----------------------------------------------------------------------------------------------------
    def _on_pick(self, change: dict[str, Any]) -> None:
        with self._lock:
            self.log.value = self._log_value()

    def _on_stop(self, button: Any) -> None:
        button.disabled = True
        button.description = "Stopping…"
        run = self.run
        if run is not None:  # stop() waits for the ranks to exit; the kernel must not wait with it
            threading.Thread(target=run.stop, name="ddpnb-stop", daemon=True).start()

    def _on_stacks(self, button: Any) -> None:
        run = self.run
        if run is None:
            return
        button.disabled, button.description = True, "Collecting…"

        def show() -> None:  # stacks() waits for the ranks' dumps: not in the kernel's thread
            self.stacks.value = stacks_html(run.stacks(), run.record.world_size)
            self.stacks.layout.display = None
            button.description = "Stacks"
            button.disabled = self._finished

        threading.Thread(target=show, name="ddpnb-stacks", daemon=True).start()


def close_all(widget: Any) -> None:
    """Close `widget` and every widget it holds (children, layout, style): ipywidgets keeps each one alive in its
    registry, and the front end its model, until it is closed, whoever else lets go of it."""
    import ipywidgets as widgets

    for name in widget.keys:
        value = getattr(widget, name)
        for held in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(held, widgets.Widget):
                close_all(held)
    widget.close()
