"""The live dashboard: an ipywidgets projection of a run's record, redrawn when the run's reader has news (output
at most five times a second, ten on Ray; a rank's turn at once) and once a second anyway.

The supervisor thread keeps the record; this view only reads it. Its own thread redraws (so background
runs, where nobody calls `wait()`, stay live) and sends a widget update only for a part that changed. Each part
is an HTML string built by a pure function of the record, so the same functions draw the static summary that
replaces the widget when the run ends: a saved notebook then reads well without a kernel.

Plots are SVG written here (no plotting library): a few kilobytes per redraw, no rasterising in the kernel while
ranks train on the same CPUs, crisp at any zoom, themed by JupyterLab's CSS variables, and the same markup works
in the static summary. The log panel holds the last `LOG_LINES` lines per view; every line is in the rank's log.
Its all-ranks view folds the same line from several ranks into one (`views.fold`); each rank's view is as printed.
"""

from __future__ import annotations

import html
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from ddpnb.core import checkpoints
from ddpnb.core.record import (
    Outcome,
    OutputLine,
    RankRecord,
    RankState,
    RunRecord,
    describe_exit,
    format_duration,
    hardware_text,
    size_text,
)
from ddpnb.core.run import TICK, Run
from ddpnb.core.spec import Stream
from ddpnb.views.fold import FoldedLine, Folder, rank_ranges

LOG_LINES = 200  # lines the log panel keeps for each of its views (all ranks, each rank)
MAX_LINE_CHARS = 500  # longer lines are cut in the panel (the log file has them whole)
MAX_POINTS = 400  # points drawn per series; longer series are thinned for drawing (the record keeps all)
PLOT_SIZE = (400, 160)  # one metric's plot, in pixels
PLOT_INTERVAL = 1.0  # seconds between two redraws of the plots (the costliest part) while the run goes on
MANY_RANKS = 8  # from this many ranks up, plots show rank 0, the median and the min-max band; rows are compact
SUMMARY_LOG_LINES = 30

RANK_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")

_GREY, _BLUE = "var(--jp-ui-font-color2, #757575)", "var(--jp-brand-color1, #1976d2)"
_GREEN, _RED = "var(--jp-success-color1, #388e3c)", "var(--jp-error-color1, #d32f2f)"
_ORANGE = "var(--jp-warn-color1, #f57c00)"
_RANK_COLOURS = {RankState.STARTING: _GREY, RankState.RUNNING: _BLUE, RankState.FINISHED: _GREEN,
                 RankState.FAILED: _RED, RankState.STOPPED: _ORANGE}
_RUN_COLOURS = {Outcome.RUNNING: _BLUE, Outcome.SUCCEEDED: _GREEN, Outcome.FAILED: _RED,
                Outcome.TIMED_OUT: _ORANGE, Outcome.INTERRUPTED: _ORANGE, Outcome.STOPPED: _ORANGE}

STYLE = """<style>
.ddpnb{font-family:var(--jp-ui-font-family,system-ui,-apple-system,'Segoe UI',sans-serif);
  font-size:var(--jp-ui-font-size1,13px);color:var(--jp-ui-font-color1,#212121);line-height:1.4;max-width:1100px}
.ddpnb .widget-html-content{line-height:1.4}
.ddpnb code,.ddpnb pre,.ddpnb .ddpnb-mono{font-family:var(--jp-code-font-family,SFMono-Regular,Menlo,Consolas,monospace);
  font-size:var(--jp-code-font-size,12px)}
.ddpnb-head{display:flex;align-items:center;gap:10px;flex-wrap:wrap;padding:2px 0}
.ddpnb-title{font-weight:600;font-size:var(--jp-ui-font-size2,14px)}
.ddpnb-meta{color:var(--jp-ui-font-color2,#616161)}
.ddpnb-pill{display:inline-flex;align-items:center;gap:5px;padding:1px 9px;border-radius:10px;font-weight:600;
  border:1px solid currentColor;font-size:var(--jp-ui-font-size0,12px)}
.ddpnb-dot{width:7px;height:7px;border-radius:50%;background:currentColor;display:inline-block}
.ddpnb table.ddpnb-ranks{border-collapse:collapse;width:100%;margin:4px 0 6px;table-layout:auto;font-size:inherit;
  border:none}
.ddpnb .ddpnb-ranks th,.ddpnb .ddpnb-ranks td{text-align:left;line-height:1.4;max-width:none;border:none;
  vertical-align:middle;white-space:nowrap}
.ddpnb .ddpnb-ranks th{font-weight:600;color:var(--jp-ui-font-color2,#616161);font-size:var(--jp-ui-font-size0,12px);
  border-bottom:1px solid var(--jp-border-color1,#bdbdbd);padding:3px 8px}
.ddpnb .ddpnb-ranks td{padding:3px 8px;border-bottom:1px solid var(--jp-border-color2,#e0e0e0)}
.ddpnb .ddpnb-ranks tbody tr,.ddpnb .ddpnb-ranks tbody tr:nth-child(odd),
.ddpnb .ddpnb-ranks tbody tr:nth-child(even){background:transparent}
.ddpnb .ddpnb-ranks td.ddpnb-last{width:99%}
.ddpnb-ranks-scroll{max-height:400px;overflow-y:auto}
.ddpnb .ddpnb-ranks.ddpnb-compact th{position:sticky;top:0;background:var(--jp-layout-color1,#fff);padding:1px 6px}
.ddpnb .ddpnb-ranks.ddpnb-compact td{padding:0 6px;line-height:1.3}
.ddpnb-compact .ddpnb-bar{height:6px;width:80px}
.ddpnb .ddpnb-last div{white-space:nowrap;overflow:hidden;text-overflow:ellipsis;max-width:300px;
  color:var(--jp-ui-font-color2,#616161)}
.ddpnb-swatch{display:inline-block;width:9px;height:9px;border-radius:2px;margin-right:6px}
.ddpnb-bar{display:inline-block;width:110px;height:8px;border-radius:4px;vertical-align:middle;overflow:hidden;
  background:var(--jp-layout-color3,#e0e0e0);margin-right:6px}
.ddpnb-bar>div{height:100%;background:var(--jp-brand-color1,#1976d2)}
.ddpnb-bar.ddpnb-failed>div{background:var(--jp-error-color1,#d32f2f)}
.ddpnb-bar.ddpnb-done>div{background:var(--jp-success-color1,#388e3c)}
.ddpnb-progress{font-size:var(--jp-ui-font-size0,12px);color:var(--jp-ui-font-color2,#616161)}
.ddpnb-plots{display:flex;flex-wrap:wrap;gap:4px 14px;margin:2px 0 4px}
.ddpnb-plot-title{font-size:var(--jp-ui-font-size0,12px);font-weight:600;margin:0 0 0 40px}
.ddpnb-plot-title span{font-weight:400;color:var(--jp-ui-font-color2,#616161)}
.ddpnb svg .ddpnb-axis{stroke:var(--jp-border-color1,#bdbdbd)}
.ddpnb svg .ddpnb-grid{stroke:var(--jp-border-color2,#eeeeee)}
.ddpnb svg text{fill:var(--jp-ui-font-color2,#616161);font-family:var(--jp-ui-font-family,sans-serif)}
.ddpnb-legend{font-size:var(--jp-ui-font-size0,12px);color:var(--jp-ui-font-color2,#616161);margin:2px 0}
.ddpnb-legend span{margin-right:12px}
.ddpnb-muted{color:var(--jp-ui-font-color2,#616161);font-size:var(--jp-ui-font-size0,12px)}
.ddpnb-log{max-height:220px;overflow-y:auto;display:flex;flex-direction:column-reverse;
  background:var(--jp-layout-color2,#f5f5f5);border:1px solid var(--jp-border-color2,#e0e0e0);border-radius:3px;
  padding:4px 8px;margin:2px 0}
.ddpnb-line{white-space:pre-wrap;word-break:break-all;line-height:1.35}
.ddpnb-line.ddpnb-stderr{background:var(--jp-rendermime-error-background,#fdd)}
.ddpnb-tag{font-weight:600;margin-right:6px}
.ddpnb-error{border-left:3px solid var(--jp-error-color1,#d32f2f);background:var(--jp-error-color3,#ffebee);
  padding:4px 10px;margin:4px 0}
.ddpnb-error pre{margin:4px 0;white-space:pre-wrap;max-height:320px;overflow:auto;
  color:var(--jp-content-font-color1,#212121)}
.ddpnb-error-title{font-weight:600;color:var(--jp-error-color1,#d32f2f)}
.ddpnb-stall{border-left:3px solid var(--jp-warn-color1,#f57c00);background:var(--jp-warn-color3,#fff3e0);
  padding:4px 10px;margin:4px 0}
.ddpnb-stall-title{font-weight:600;color:var(--jp-warn-color1,#f57c00)}
.ddpnb-stacks pre{margin:2px 0 6px;white-space:pre;max-height:320px;overflow:auto}
.ddpnb-section{font-weight:600;font-size:var(--jp-ui-font-size0,12px);color:var(--jp-ui-font-color2,#616161);
  text-transform:uppercase;letter-spacing:.04em;margin:6px 0 2px}
.ddpnb .widget-toggle-buttons .widget-toggle-button{font-size:var(--jp-ui-font-size0,12px)}
</style>"""


# --- pure renderers: record -> HTML ------------------------------------------------------------------------------

def overall_state(record: RunRecord) -> str:
    """The run's state in the words the rank rows use: 'running', 'stalled', 'finished', 'failed', ..."""
    if record.stalled:
        return "stalled"
    return "finished" if record.outcome is Outcome.SUCCEEDED else record.outcome.value


def rank_state(rank: RankRecord) -> str:
    """'running', 'finished', 'failed · exit 1', 'failed · SIGSEGV', 'stopped · SIGTERM'."""
    state = rank.state.value
    code = rank.exitcode
    if rank.state in (RankState.FAILED, RankState.STOPPED) and code not in (None, 0):
        if code < 0:
            state += " · " + describe_exit(code).removeprefix("killed by ")
        else:
            state += f" · exit {code}"
    return state


def _pill(state: str, colour: str) -> str:
    return (f'<span class="ddpnb-pill" data-state="{html.escape(state)}" style="color:{colour}">'
            f'<span class="ddpnb-dot"></span>{html.escape(state)}</span>')


def _devices(record: RunRecord) -> str:
    devices = [r.device for r in record.ranks]
    kinds = sorted({d.split(":")[0] for d in devices})
    if kinds == ["cpu"]:
        return "cpu"
    if len(devices) <= 4:
        return ", ".join(devices)
    return f"{len(devices)} × {'/'.join(kinds)}"


def header_html(record: RunRecord) -> str:
    attempt = [f"attempt {record.attempt} (restarts: {record.attempt} of {record.max_restarts})"] \
        if record.max_restarts else []
    note = [record.launch_note] if record.launch_note else []  # how the request was read (a CPU fallback)
    meta = " · ".join([record.function, record.engine, record.backend, f"{record.world_size} ranks",
                       _devices(record), *note, *attempt, format_duration(record.duration)])
    colour = _ORANGE if record.stalled else _RUN_COLOURS[record.outcome]
    return (f'<div class="ddpnb-head"><span class="ddpnb-title">ddpnb</span>{_pill(overall_state(record), colour)}'
            f'<span class="ddpnb-meta">{html.escape(meta)}</span></div>')


def _progress_html(rank: RankRecord, compact: bool = False) -> str:
    bars = rank.active_progress[-1:] if compact else rank.active_progress[-2:]  # compact: the innermost bar
    if not bars:
        return '<span class="ddpnb-muted">–</span>'
    parts = []
    for bar in bars:
        label = html.escape(f"{bar.desc} " if bar.desc else "") + html.escape(bar.text)
        data = f'data-bar="{bar.bar}" data-n="{bar.n:g}" data-total="{"" if bar.total is None else f"{bar.total:g}"}"'
        if bar.total:
            share = max(0.0, min(1.0, bar.n / bar.total))
            kind = " ddpnb-failed" if rank.state is RankState.FAILED else (" ddpnb-done" if share >= 1 else "")
            parts.append(f'<div class="ddpnb-progress" {data}><span class="ddpnb-bar{kind}">'
                         f'<div style="width:{share * 100:.1f}%"></div></span>{label}</div>')
        else:
            parts.append(f'<div class="ddpnb-progress" {data}>{label}</div>')
    return "".join(parts)


_bytes = size_text


def _gpu_memory_html(rank: RankRecord) -> str:
    if rank.gpu_memory is None:
        return '<td class="ddpnb-muted">–</td>'
    reserved, peak = rank.gpu_memory
    return f'<td title="held by PyTorch now; peak {_bytes(peak)}">{_bytes(reserved)}</td>'


def _radar_html(record: RunRecord) -> tuple[str, list[str]]:
    """The straggler radar's and the hardware sampler's columns: header cells, then each rank's cells; a column
    only where some rank has data for it."""
    hardware = [hardware_text(r) for r in record.ranks]
    computes = [r.compute_per_step for r in record.ranks]
    columns: list[tuple[str, list[str]]] = []
    if any(c is not None for c in computes):
        head = '<th title="the rank\'s own busy time per step, its waits in collectives left out">compute/step</th>'
        columns.append((head, [_compute_html(r) for r in record.ranks]))
    for index, name in enumerate(("CPU", "memory", "GPU")):
        if any(h[index] for h in hardware):
            columns.append((f"<th>{name}</th>", [f'<td class="ddpnb-mono">{html.escape(h[index]) or "–"}</td>'
                                                 for h in hardware]))
    return "".join(head for head, _ in columns), ["".join(cells[i] for _, cells in columns)
                                                  for i in range(len(record.ranks))]


def _compute_html(rank: RankRecord) -> str:
    compute = rank.compute_per_step
    if compute is None:
        return '<td class="ddpnb-muted">–</td>'
    flag = (f' <span class="ddpnb-straggler" style="color:{_ORANGE};font-weight:600">{rank.straggler}</span>'
            if rank.straggler else "")
    return f'<td class="ddpnb-mono">{compute * 1000:.1f} ms{flag}</td>'


def ranks_html(record: RunRecord) -> str:
    """One row per rank; from MANY_RANKS up, compact rows (one progress bar each) in a box that scrolls."""
    gpus = any(r.device.startswith("cuda") or r.gpu_memory is not None for r in record.ranks)
    compact = record.world_size >= MANY_RANKS
    table = '<div class="ddpnb-ranks-scroll"><table class="ddpnb-ranks ddpnb-compact">' if compact else \
        '<table class="ddpnb-ranks">'
    radar_head, radar_cells = _radar_html(record)
    rows = [(f'{table}<thead><tr><th>rank</th><th>state</th><th>device</th><th>PID</th>'
             f'{"<th>GPU memory</th>" if gpus else ""}{radar_head}'
             '<th>progress</th><th>time</th><th>latest output</th></tr></thead><tbody>')]
    for rank, radar in zip(record.ranks, radar_cells):
        state = rank_state(rank)
        colour = _RANK_COLOURS[rank.state]
        last = rank.last_text[:MAX_LINE_CHARS]  # not a progress bar's line: the progress column has the bar
        straggler = f' data-straggler="{rank.straggler}"' if rank.straggler else ""
        rows.append(
            f'<tr data-rank="{rank.rank}" data-state="{rank.state.value}"{straggler}>'
            f'<td><span class="ddpnb-swatch" style="background:{_rank_colour(rank.rank)}"></span>{rank.rank}</td>'
            f'<td style="color:{colour};font-weight:600">{html.escape(state)}</td>'
            f'<td>{html.escape(rank.device)}</td><td class="ddpnb-mono">{rank.pid or "–"}</td>'
            f'{_gpu_memory_html(rank) if gpus else ""}{radar}<td>{_progress_html(rank, compact)}</td>'
            f'<td>{format_duration(rank.duration)}</td>'
            f'<td class="ddpnb-last"><div class="ddpnb-mono" title="{html.escape(last)}">{html.escape(last[:160])}'
            f'</div></td></tr>')
    rows.append("</tbody></table></div>" if compact else "</tbody></table>")
    return "".join(rows)


def _rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def metric_names(record: RunRecord) -> list[str]:
    names: dict[str, None] = {}
    for rank in record.ranks:
        for name in list(rank.metrics):
            names.setdefault(name, None)
    return list(names)


def metrics_signature(record: RunRecord) -> tuple[int, ...]:
    """Changes whenever a point is logged: redraw plots only then."""
    return (len(record.attempts), *(len(series) for rank in record.ranks for series in list(rank.metrics.values())))


def plots_html(record: RunRecord) -> str:
    names = metric_names(record)
    if not names:
        return ('<div class="ddpnb-muted">No metrics yet: send them from the ranks with '
                '<code>ddpnb.log(step=i, loss=loss.item())</code>.</div>')
    many = record.world_size >= MANY_RANKS
    shown = [0] if many else [r.rank for r in record.ranks]
    legend = "".join(f'<span><span class="ddpnb-swatch" style="background:{_rank_colour(r)}"></span>rank {r}</span>'
                     for r in shown)
    if many:
        legend += ('<span><span class="ddpnb-swatch" style="background:#1f77b4;opacity:.25"></span>'
                   'min–max of all ranks</span>'
                   '<span><span class="ddpnb-swatch" style="background:#7f7f7f"></span>median</span>')
    plots = [_plot(record, name, shown, many) for name in names]
    return f'<div class="ddpnb-legend">{legend}</div><div class="ddpnb-plots">{"".join(plots)}</div>'


def _plot(record: RunRecord, name: str, shown: Sequence[int], band: bool) -> str:
    width, height = PLOT_SIZE
    # the record's own lists, which the supervisor appends to: measured and sampled, never copied whole, so a
    # redraw costs the same after a million points as after a hundred
    logged = {r.rank: r.metrics.get(name, []) for r in record.ranks}
    counts = {rank: len(points) for rank, points in logged.items()}
    series = {rank: thin(points, MAX_POINTS) for rank, points in logged.items()}
    by_step = all(step is not None for points in series.values() for step, _, _ in points)

    def xy(points: list[tuple[int | None, float, float]]) -> list[tuple[float, float]]:
        return [(float(step) if by_step else t - record.started, value) for step, t, value in points
                if math.isfinite(value)]

    lines = {rank: xy(series[rank]) for rank in shown}
    # earlier attempts: their lines, fainter, and a marker where each later attempt's first point is
    earlier = [{rank: xy(thin(a.ranks[rank].metrics.get(name, []), MAX_POINTS)) for rank in shown}
               for a in record.attempts]
    restarts = []
    for ranks in [*(a.ranks for a in record.attempts[1:]), record.ranks][:len(record.attempts)]:
        first = next((xy(r.metrics[name][:1]) for r in ranks if r.rank in shown and r.metrics.get(name)), [])
        restarts.extend(x for x, _ in first[:1])
    band_points: list[tuple[float, float, float]] = []
    median: list[tuple[float, float]] = []
    if band and by_step:
        spread: dict[float, list[float]] = {}
        for points in series.values():
            for x, y in xy(points):
                spread.setdefault(x, []).append(y)
        band_points = [(x, min(ys), max(ys)) for x, ys in sorted(spread.items())]
        median = [(x, statistics.median(ys)) for x, ys in sorted(spread.items())]
    drawn_lines = [*lines.values(), *(points for attempt in earlier for points in attempt.values())]
    all_x = [x for points in drawn_lines for x, _ in points] + [x for x, _, _ in band_points]
    all_y = [y for points in drawn_lines for _, y in points] + [y for _, lo, hi in band_points for y in (lo, hi)]
    latest = series[shown[0]]
    value = f"rank {shown[0]}: {latest[-1][2]:.4g}" if len(latest) else ""
    title = f'<div class="ddpnb-plot-title">{html.escape(name)} <span>{value}</span></div>'
    if not all_x:
        return f'<div class="ddpnb-plot" data-metric="{html.escape(name)}">{title}</div>'
    left, right, top, bottom = 44, 10, 6, 22
    x_lo, x_hi = min(all_x), max(all_x)
    y_lo, y_hi = min(all_y), max(all_y)
    if x_hi == x_lo:
        x_hi = x_lo + 1
    if y_hi == y_lo:
        pad = abs(y_lo) * 0.1 or 1.0
        y_lo, y_hi = y_lo - pad, y_hi + pad
    x_ticks, y_ticks = nice_ticks(x_lo, x_hi, 5), nice_ticks(y_lo, y_hi, 4)
    y_lo, y_hi = min(y_lo, y_ticks[0]), max(y_hi, y_ticks[-1])
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * plot_w

    def sy(y: float) -> float:
        return top + (1 - (y - y_lo) / (y_hi - y_lo)) * plot_h

    svg = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-size="10">')]
    for y in y_ticks:
        svg.append(f'<line class="ddpnb-grid" x1="{left}" x2="{width - right}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
                   f'stroke="#eeeeee"/><text x="{left - 5}" y="{sy(y) + 3.5:.1f}" text-anchor="end" fill="#616161">'
                   f'{_tick_label(y)}</text>')
    for x in x_ticks:
        if x_lo <= x <= x_hi and sx(x) < width - right - 30:  # the right end carries the axis' unit
            svg.append(f'<text x="{sx(x):.1f}" y="{height - 8}" text-anchor="middle" fill="#616161">'
                       f'{_tick_label(x)}</text>')
    svg.append(f'<line class="ddpnb-axis" x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" '
               f'stroke="#bdbdbd"/><line class="ddpnb-axis" x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}" '
               f'stroke="#bdbdbd"/>')
    svg.append(f'<text x="{width - right}" y="{height - 8}" text-anchor="end" fill="#616161">'
               f'{"step" if by_step else "s"}</text>')
    if band_points:
        thinned = thin(band_points, MAX_POINTS)
        outline = [(sx(x), sy(hi)) for x, _, hi in thinned] + [(sx(x), sy(lo)) for x, lo, _ in reversed(thinned)]
        svg.append(f'<polygon class="ddpnb-band" fill="{_rank_colour(0)}" fill-opacity="0.18" stroke="none" '
                   f'points="{_points(outline)}"><title>min–max of all ranks</title></polygon>')
        svg.append(f'<polyline class="ddpnb-median" fill="none" stroke="#7f7f7f" stroke-width="1.2" '
                   f'stroke-dasharray="4,2" points="{_points((sx(x), sy(y)) for x, y in thin(median, MAX_POINTS))}">'
                   '<title>median of all ranks</title></polyline>')
    for number, attempt in enumerate(earlier):
        for rank, points in attempt.items():
            if len(points) > 1:
                svg.append(f'<polyline data-rank="{rank}" data-attempt="{number}" fill="none" '
                           f'stroke="{_rank_colour(rank)}" stroke-opacity="0.35" stroke-width="1.2" '
                           f'points="{_points((sx(x), sy(y)) for x, y in thin(points, MAX_POINTS))}"/>')
    for number, x in enumerate(restarts, 1):
        svg.append(f'<line class="ddpnb-restart" data-attempt="{number}" x1="{sx(x):.1f}" x2="{sx(x):.1f}" '
                   f'y1="{top}" y2="{top + plot_h}" stroke="{_ORANGE}" stroke-dasharray="3,3">'
                   f'<title>attempt {number} starts here</title></line>'
                   f'<text x="{sx(x) + 3:.1f}" y="{top + 9}" fill="#f57c00">restart {number}</text>')
    for rank, points in lines.items():
        if not points:
            continue
        colour = _rank_colour(rank)
        drawn = thin(points, MAX_POINTS)
        attrs = f'data-rank="{rank}" data-points="{counts[rank]}"'
        if len(drawn) == 1:
            (x, y), = drawn
            svg.append(f'<circle {attrs} cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>')
        else:
            svg.append(f'<polyline {attrs} fill="none" stroke="{colour}" stroke-width="1.6" '
                       f'stroke-linejoin="round" points="{_points((sx(x), sy(y)) for x, y in drawn)}"/>')
    svg.append("</svg>")
    return f'<div class="ddpnb-plot" data-metric="{html.escape(name)}">{title}{"".join(svg)}</div>'


def _points(points: Iterable[tuple[float, float]]) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in points)


def thin(points: Sequence[Any], limit: int) -> Sequence[Any]:
    """At most about `limit` evenly spaced points, always keeping the last one."""
    if len(points) <= limit:
        return list(points)
    stride = math.ceil(len(points) / limit)
    kept = list(points[::stride])
    if kept[-1] is not points[-1]:
        kept.append(points[-1])
    return kept


def nice_ticks(lo: float, hi: float, count: int) -> list[float]:
    """About `count` round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    raw = (hi - lo) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    tick = first
    while tick <= hi + step * 0.5 and len(ticks) < 50:
        ticks.append(round(tick, 12))
        tick += step
    if ticks[-1] < hi:
        ticks.append(round(tick, 12))
    return ticks


def _tick_label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.0e}"
    return f"{value:.4g}"


def line_html(rank: int, stream: Stream, text: str, ranks: Sequence[int] = ()) -> str:
    """One log line; `ranks`: every rank that printed it, when folded (`[ranks 0-3]`, in a neutral colour)."""
    if len(ranks) > 1:
        tag, colour = f"[ranks {rank_ranges(ranks)}]", _GREY
    else:
        tag, colour = f"[rank {rank}]", _rank_colour(rank)
    return (f'<div class="ddpnb-line ddpnb-{stream}"><span class="ddpnb-tag" style="color:{colour}">'
            f'{tag}</span><span class="ddpnb-text">{html.escape(text)}</span></div>')


def _printed(lines: Iterable[OutputLine | FoldedLine]) -> int:
    """How many printed lines these are: a folded line is one per rank that printed it."""
    return sum(len(line.ranks) if isinstance(line, FoldedLine) else 1 for line in lines)


def _any_line_html(line: OutputLine | FoldedLine) -> str:
    ranks = line.ranks if isinstance(line, FoldedLine) else ()
    return line_html(line.rank, line.stream, line.text, ranks)


def log_html(lines: Iterable[str], note: str) -> str:
    """The log panel from lines drawn by `line_html` (the live dashboard draws each line once, not each redraw)."""
    inner = "".join(lines) or '<div class="ddpnb-muted">no output yet</div>'
    return (f'<div class="ddpnb-muted">{note}</div>'
            f'<div class="ddpnb-log ddpnb-mono"><div>{inner}</div></div>')


def error_html(record: RunRecord) -> str:
    first = record.first_failure
    earlier = "".join(f'<div class="ddpnb-muted" data-attempt="{a.number}">attempt {a.number} (restarted): '
                      f'{html.escape(a.describe())}</div>' for a in record.attempts)
    if first is None:
        return f'<div class="ddpnb-error">{earlier}</div>' if earlier else ""
    parts = [(f'<div class="ddpnb-error"><div class="ddpnb-error-title">rank {first.rank} failed first: '
              f'{html.escape(first.summary)}</div>')]
    if first.traceback:
        parts.append(f"<pre>{html.escape(first.traceback.rstrip())}</pre>")
    others = [f for f in sorted(record.failures, key=lambda f: f.time) if f is not first]
    if others:
        parts.append('<div class="ddpnb-muted">then, as a consequence: '
                     + "; ".join(html.escape(f"rank {f.rank}: {f.summary}") for f in others) + "</div>")
    parts.append(f"{earlier}</div>")
    return "".join(parts)


def stall_html(record: RunRecord) -> str:
    """The stall banner: where each rank is while no rank makes progress; one line once progress resumed."""
    stall = record.stall
    if stall is None:
        return ""
    if not stall.ongoing:
        assert stall.resumed is not None
        return (f'<div class="ddpnb-muted" data-stall="resumed">stalled for {stall.resumed - stall.since:.0f} s '
                f'({html.escape(stall.diagnosis.summary())}), then progress resumed</div>')
    lines = "".join(f"<div>{html.escape(line)}</div>" for line in [*stall.diagnosis.rank_lines(),
                                                                    *stall.diagnosis.flight])
    tail = ("the run goes on; Stacks (or run.stacks()) shows every rank's stack" if record.outcome is Outcome.RUNNING
            else f"still stalled when the run ended ({record.outcome.value})")
    return (f'<div class="ddpnb-stall" data-stall="ongoing"><div class="ddpnb-stall-title">'
            f'{html.escape(stall.headline())}</div><div class="ddpnb-mono">{lines}</div>'
            f'<div class="ddpnb-muted">{html.escape(tail)}</div></div>')


def stacks_html(stacks: dict[int, str]) -> str:
    """Every rank's stack, as `Run.stacks()` gave them."""
    if not stacks:
        return '<div class="ddpnb-muted">no rank is running: no stacks</div>'
    return '<div class="ddpnb-stacks"><div class="ddpnb-section">stacks</div>' + "".join(
        f'<div data-rank="{rank}">rank {rank}</div><pre class="ddpnb-mono">'
        f'{html.escape(text.rstrip() or "(no stack came)")}</pre>' for rank, text in sorted(stacks.items())) + "</div>"


def _log_location(record: RunRecord) -> str:
    attempt = f".attempt{record.attempt}" if record.max_restarts else ""
    return f"<code>{html.escape(str(record.run_dir))}/rank{{0..{record.world_size - 1}}}{attempt}.log</code>"


def resume_html(record: RunRecord) -> str:
    """A stopped or failed run with a complete checkpoint: how to continue from it."""
    if record.outcome in (Outcome.SUCCEEDED, Outcome.RUNNING) or record.checkpoint_dir is None:
        return ""
    found = checkpoints.latest(record.checkpoint_dir)
    if found is None:
        return ""
    return (f'<div class="ddpnb-muted" data-resume="{found[0]}">continue from its checkpoint of step {found[0]}: '
            f'<code>%%ddp --resume {html.escape(str(record.run_dir))}</code> (or <code>--resume last</code>)</div>')


def summary_html(record: RunRecord, lines: Sequence[OutputLine | FoldedLine]) -> str:
    """The static record of a finished run: what the cell keeps once the live dashboard is gone; `lines`: the
    latest lines, folded or not."""
    tail = lines[-SUMMARY_LOG_LINES:]
    total = sum(r.lines for r in record.ranks)
    note = (f"last {_printed(tail)} of {total:,} lines · every line is in {_log_location(record)}" if total
            else f"no output · logs in {_log_location(record)}")
    logs = (f'<details{" open" if tail else ""}><summary class="ddpnb-section" style="cursor:pointer">output'
            f'</summary>{log_html((_any_line_html(line) for line in tail), note)}</details>')
    hint = f'<div class="ddpnb-muted">{html.escape(record.hint)}</div>' if record.hint else ""
    return (f'{STYLE}<div class="ddpnb" data-ddpnb-summary="1">{header_html(record)}{ranks_html(record)}'
            f'{plots_html(record) if metric_names(record) else ""}{stall_html(record)}{error_html(record)}'
            f'{resume_html(record)}{logs}'
            f'{hint}</div>')


def summary_text(record: RunRecord) -> str:
    text = f"[ddpnb] run {record.outcome.value} in {format_duration(record.duration)}\n{record.summary_table()}"
    return f"{text}\nfull per-rank logs: {record.run_dir}" + (f"\n[ddpnb] {record.hint}" if record.hint else "")


# --- the live widget ---------------------------------------------------------------------------------------------

class Dashboard:
    """Shows `run` as a live widget in the current cell; replaces it by a static summary when the run ends.

    `foreground`: the cell waits for the run, so the kernel cannot take a button click before it ends; the Stop
    button is then disabled and says to interrupt the kernel instead.
    """

    def __init__(self, run: Run, *, foreground: bool, fold: bool = True) -> None:
        import ipywidgets as widgets
        from IPython import get_ipython
        from IPython.display import display

        self.run: Run | None = run  # dropped when the run ends: a widget lives as long as the kernel, a result need not
        self.record = run.record
        self._lock = threading.RLock()  # one redraw at a time: its own thread, wait()'s thread, a click
        self._finished = False
        self._seen = 0  # sequence number of the last line taken from the record
        self._all: deque[tuple[FoldedLine, str]] = deque(maxlen=LOG_LINES)  # a line cut for the panel, its HTML
        self._per_rank = [deque(maxlen=LOG_LINES) for _ in range(self.record.world_size)]  # as printed
        self._folder = Folder(self.record.world_size, enabled=fold)
        self._metrics_seen: tuple[int, ...] | None = None
        self._plotted = 0.0  # when the plots were last drawn
        self._lines_changed = True

        self.header = widgets.HTML(layout=widgets.Layout(flex="1 1 auto"))
        self.stop_button = widgets.Button(
            description="Stop", icon="stop", disabled=foreground,
            tooltip=("Interrupt the kernel (■) to stop: this cell is waiting for the run" if foreground
                     else "Stop every rank of this run"),
            layout=widgets.Layout(width="auto", height="26px"))
        self.stop_button.on_click(self._on_stop)
        self.stacks_button = widgets.Button(
            description="Stacks", icon="list", disabled=foreground,
            tooltip=("Interrupt the kernel, or run with --background, to ask: this cell is waiting for the run"
                     if foreground else "Show where every rank is now (its Python stack)"),
            layout=widgets.Layout(width="auto", height="26px"))
        self.stacks_button.on_click(self._on_stacks)
        self.stacks = widgets.HTML(layout=widgets.Layout(display="none"))
        self.stall = widgets.HTML()
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
        log_bar = widgets.HBox([widgets.HTML('<div class="ddpnb-section">output</div>'), self.log_picker],
                               layout=widgets.Layout(align_items="center", gap="10px"))
        self.widget = widgets.VBox(
            [widgets.HTML(STYLE), widgets.HBox([self.header, self.stacks_button, self.stop_button],
                                               layout=widgets.Layout(align_items="center")),
             self.ranks, self.stall, self.error, self.plots, log_bar, self.log, self.stacks],
            layout=widgets.Layout(padding="2px 4px"))
        self.widget.add_class("ddpnb")
        self._render()
        bundle = self.widget._repr_mimebundle_()
        bundle["text/plain"] = (f"[ddpnb] live dashboard of a {self.record.world_size}-rank run (needs a widget "
                                f"front end); the summary replaces it when the run ends. Logs: {self.record.run_dir}")
        # outside IPython (a script forcing view="widget", a benchmark) the widget is drawn but shown nowhere
        self._display = display(bundle, raw=True, display_id=True) if get_ipython() is not None else None
        run.subscribe(self._on_wait, news=False)
        threading.Thread(target=self._loop, name="ddpnb-dashboard", daemon=True).start()

    # --- drawing ---------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        seen = 0
        while (run := self.run) is not None and not run.done:
            self._render()
            seen = run.watch(seen, TICK)  # the reader's news, or a TICK for the clocks
        self.finish()

    def _on_wait(self) -> None:
        """Called by `Run.wait()`: a foreground cell ends only after its summary is in place."""
        run = self.run
        if run is None or run.done:
            self.finish()

    def finish(self) -> None:
        """Draw the final state, then replace the widget by the static summary (once)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._render()
            for button in (self.stop_button, self.stacks_button):
                button.disabled = True
                button.layout.display = "none"
            if self._display is not None:
                self._display.update({"text/html": summary_html(self.record, [line for line, _ in self._all]),
                                      "text/plain": summary_text(self.record)}, raw=True)
            self.run = None

    def _render(self) -> None:
        with self._lock:
            record = self.record
            self._take_lines()
            self.header.value = header_html(record)
            self.ranks.value = ranks_html(record)
            self.stall.value = stall_html(record)
            signature = metrics_signature(record)
            if signature != self._metrics_seen and (time.monotonic() - self._plotted >= PLOT_INTERVAL
                                                    or self._finished):  # the final state is drawn whole
                self._metrics_seen, self._plotted = signature, time.monotonic()
                self.plots.value = plots_html(record)
            if self._lines_changed:
                self._lines_changed = False
                self.log.value = self._log_value()
            if (record.failures or record.attempts) and self.error.layout.display == "none":
                self.error.layout.display = None
            if record.failures or record.attempts:
                self.error.value = error_html(record)

    def _take_lines(self) -> None:
        run = self.run
        if run is None:
            return
        done = run.done  # before reading: the lines read after it are the last ones
        new, _, self._seen = run.lines_since(self._seen)
        new = [line._replace(text=line.text[:MAX_LINE_CHARS]) for line in new]
        for line in new:
            self._per_rank[line.rank].append((line, line_html(line.rank, line.stream, line.text)))
        folded = self._folder.add(new, time.monotonic()) + (self._folder.flush() if done else [])
        for line in folded:
            self._all.append((line, _any_line_html(line)))
        if new or folded:
            self._lines_changed = True

    def _log_value(self) -> str:
        rank = self.log_picker.value
        record = self.record
        if rank == -1:
            lines = self._all
            total = sum(r.lines for ranks in [*(a.ranks for a in record.attempts), record.ranks] for r in ranks)
            where = _log_location(record)
        else:
            lines = self._per_rank[rank]
            total = sum(ranks[rank].lines for ranks in [*(a.ranks for a in record.attempts), record.ranks])
            where = f"<code>{html.escape(str(record.ranks[rank].log_path))}</code>"
        shown = _printed(line for line, _ in lines)
        note = (f"last {shown} of {total:,} lines · every line is in {where}" if total > shown
                else f"{total:,} lines · also in {where}")
        return log_html((html_line for _, html_line in lines), note)

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
            self.stacks.value = stacks_html(run.stacks())
            self.stacks.layout.display = None
            button.description = "Stacks"
            button.disabled = self._finished

        threading.Thread(target=show, name="ddpnb-stacks", daemon=True).start()
