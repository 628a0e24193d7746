"""A run's record drawn as HTML: pure functions of the record, one per part of the dashboard (header, ranks,
plots, stall, error, stacks, log), and the static summary that replaces the live widget when the run ends, so a
saved notebook reads well without a kernel.

Plots are SVG written here (no plotting library): a few kilobytes per redraw, no rasterising in the kernel while
ranks train on the same CPUs, crisp at any zoom, and the same markup works in the static summary.
"""

from __future__ import annotations

import base64
import html
import itertools
import math
import re
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from ddpnb.core import checkpoints, groups
from ddpnb.core.cellnames import cell_names
from ddpnb.core.failures import FailureRole
from ddpnb.core.record import Outcome, OutputLine, RankRecord, RankState, RunRecord
from ddpnb.core.report import (
    attempt_line,
    diagnosis_lines,
    diagnosis_summary,
    exit_words,
    grouped_stacks,
    hardware_text,
    locals_lines,
    log_files,
    named,
    stall_headline,
    state_words,
    straggler_text,
)
from ddpnb.core.series import NO_STEP, Series
from ddpnb.core.spec import Stream
from ddpnb.core.words import describe_exit, format_duration, ranks_text, size_text
from ddpnb.views.fold import FoldedLine, rank_ranges
from ddpnb.views.profile import profile_html

MAX_LINE_CHARS = 500  # longer lines are cut in the panel (the log file has them whole)
MAX_POINTS = 400  # points drawn per series; longer series are thinned for drawing (the record keeps all)
BAND_POINTS = 100  # from `groups.GROUP_FROM` ranks up, points of each rank the band and median are drawn from
OUTLIERS = 3  # ranks a plot of many ranks names as off the others, at most ...
OUTLIER_SPREAD = 5.0  # ... where their latest value is this many median deviations off the median
PLOT_SIZE = (400, 160)  # one metric's plot, in pixels
MANY_RANKS = 8  # from this many ranks up, plots show rank 0, the median and the min-max band; rows are compact
SUMMARY_LOG_LINES = 30
MEDIAN_COLOUR = "#7f7f7f"  # the many-ranks plots' median line: grey, no rank's colour

# the ranks' colours (lines, swatches, log tags): none is a colour the states use (the failure red, the warning
# orange, the success green, the running blue, the starting grey), so a rank never reads as a state
RANK_COLOURS = ("#1f77b4", "#9467bd", "#17becf", "#e377c2", "#bcbd22", "#393b79", "#637939", "#7b4173")

# Colours and styles are inline, as literal values: JupyterLab's sanitiser (an untrusted notebook: opened from
# GitHub, nbviewer or a colleague) drops <style> blocks, <svg> and any inline value it cannot check (`var(...)`).
# Text colours are inherited and tints are translucent, so the same markup reads on light and dark themes.
_GREY, _BLUE, _GREEN, _RED, _ORANGE = "#757575", "#1976d2", "#388e3c", "#d32f2f", "#f57c00"
STATE_COLOURS = (_GREY, _BLUE, _GREEN, _RED, _ORANGE)
_RANK_COLOURS = {
    RankState.STARTING: _GREY,
    RankState.RUNNING: _BLUE,
    RankState.FINISHED: _GREEN,
    RankState.FAILED: _RED,
    RankState.STOPPED: _ORANGE,
}
_ROLE_COLOURS = {FailureRole.ROOT_CAUSE: _RED, FailureRole.OWN: _RED, FailureRole.KNOCK_ON: _ORANGE}
_RUN_COLOURS = {
    Outcome.RUNNING: _BLUE,
    Outcome.SUCCEEDED: _GREEN,
    Outcome.FAILED: _RED,
    Outcome.TIMED_OUT: _ORANGE,
    Outcome.INTERRUPTED: _ORANGE,
    Outcome.STOPPED: _ORANGE,
}
_MONO = "font-family:monospace;font-size:12px"
_MUTED = "opacity:0.7;font-size:12px"
# table cells wrap between words (never inside one) so a table fits its cell's width; the short columns (rank,
# PID, time) keep one line
_CELL = "text-align:left;padding:3px 8px;vertical-align:middle;overflow-wrap:normal;word-break:normal"
_ONE_LINE = "white-space:nowrap"
_WRAP = "white-space:pre-wrap;overflow-wrap:anywhere;word-break:normal"  # text with long unbroken runs (paths, identifiers, stacks)
_RULE = "rgba(128,128,128,0.3)"  # table rules and borders: grey on either theme
_HEAD = f"{_CELL};font-weight:600;font-size:12px;border-bottom:1px solid {_RULE}"


def overall_state(record: RunRecord) -> str:
    """The run's state in the words the rank rows use: 'running', 'at a breakpoint', 'stalled', 'finished', ..."""
    if record.outcome is Outcome.RUNNING and any(r.breakpoint_at for r in record.ranks):
        return "at a breakpoint"
    if record.outcome is Outcome.RUNNING and record.queued is not None and record.queued.ongoing:
        return "queued"
    if record.stalled:
        return "stalled"
    return "finished" if record.outcome is Outcome.SUCCEEDED else record.outcome.value


def rank_state(rank: RankRecord, role: FailureRole | None = None, stalled: bool = False) -> str:
    """'running', 'at a breakpoint: Cell In[5], line 7, in train', 'stalled', 'finished', 'failed first · exit 1',
    'stopped: peer failed · exit 1', 'failed · SIGSEGV', 'stopped · SIGTERM': a failed rank as its `role` in the
    run's failure (root cause, own error, knock-on); a running rank of a `stalled` run as stalled."""
    if rank.breakpoint_at and rank.state is RankState.RUNNING:
        return f"at a breakpoint: {rank.breakpoint_at}"
    state = role.value if rank.state is RankState.FAILED and role is not None else rank.state.value
    if stalled and rank.state is RankState.RUNNING:
        return "stalled"
    code = rank.exitcode
    if rank.state in (RankState.FAILED, RankState.STOPPED) and code not in (None, 0):
        if code < 0:
            state += " · " + describe_exit(code).removeprefix("killed by ")
        else:
            state += f" · exit {code}"
    return state


def _pill(state: str, colour: str) -> str:
    return (
        f'<span class="ddpnb-pill" data-state="{html.escape(state)}" style="display:inline-block;'
        f"padding:0 9px;border-radius:10px;font-weight:600;font-size:12px;border:1px solid {colour};"
        f'color:{colour};margin-right:10px"><span style="display:inline-block;width:7px;height:7px;'
        f'border-radius:50%;background-color:{colour};margin-right:5px;vertical-align:middle"></span>'
        f"{html.escape(state)}</span>"
    )


def _devices(record: RunRecord) -> str:
    devices = [r.device for r in record.ranks]
    kinds = sorted({d.split(":")[0] for d in devices})
    if kinds == ["cpu"]:
        return "cpu"
    if len(devices) <= 4:
        return ", ".join(devices)
    return f"{len(devices)} × {'/'.join(kinds)}"


def header_html(record: RunRecord) -> str:
    attempt = (
        [f"attempt {record.attempt} (restarts: {record.attempt} of {record.max_restarts})"]
        if record.max_restarts
        else []
    )
    note = [record.launch_note] if record.launch_note else []  # how the request was read (a CPU fallback)
    queued = [record.queued.words()] if record.queued is not None else []  # its job's turn in the queue
    meta = " · ".join(
        [
            record.function,
            record.engine,
            record.backend,
            ranks_text(record.world_size),
            _devices(record),
            *note,
            *queued,
            *attempt,
            format_duration(record.duration),
        ]
    )
    colour = _ORANGE if record.stalled else _RUN_COLOURS[record.outcome]
    # spaces between the parts, not only margins: copied, or shown without styles, the words stay apart
    return (
        f'<div class="ddpnb-head" style="padding:2px 0">'
        f'<span class="ddpnb-title" style="font-weight:600;font-size:14px;margin-right:10px">ddpnb</span> '
        f"{_pill(overall_state(record), colour)} "
        f'<span class="ddpnb-meta" style="opacity:0.75">{html.escape(meta)}</span></div>'
    )


def _progress_html(rank: RankRecord, compact: bool = False) -> str:
    bars = rank.active_progress[-1:] if compact else rank.active_progress[-2:]  # compact: the innermost bar
    if not bars:
        return f'<span class="ddpnb-muted" style="{_MUTED}">–</span>'
    parts = []
    for bar in bars:
        label = html.escape(f"{bar.desc} " if bar.desc else "") + html.escape(bar.text)
        data = f'data-bar="{bar.bar}" data-n="{bar.n:g}" data-total="{"" if bar.total is None else f"{bar.total:g}"}"'
        if bar.total:
            share = max(0.0, min(1.0, bar.n / bar.total))
            kind, fill = (
                (" ddpnb-failed", _RED)
                if rank.state is RankState.FAILED
                else (" ddpnb-done", _GREEN)
                if share >= 1
                else ("", _BLUE)
            )
            parts.append(
                f'<div class="ddpnb-progress" {data} style="{_MUTED}"><span class="ddpnb-bar{kind}" '
                f'style="display:inline-block;width:110px;height:8px;border-radius:4px;overflow:hidden;'
                f'vertical-align:middle;margin-right:6px;background-color:rgba(128,128,128,0.25)">'
                f'<span style="display:block;height:100%;width:{share * 100:.1f}%;background-color:{fill}">'
                f"</span></span>{label}</div>"
            )
        else:
            parts.append(f'<div class="ddpnb-progress" {data} style="{_MUTED}">{label}</div>')
    return "".join(parts)


def _gpu_memory_html(rank: RankRecord) -> str:
    if rank.gpu_memory is None:
        return _td("–", _MUTED, ' class="ddpnb-muted"')
    reserved, peak = rank.gpu_memory
    return _td(size_text(reserved), attrs=f' title="held by PyTorch now; peak {size_text(peak)}"')


LAST_CELL = ' class="ddpnb-last"'


def _td(content: str, style: str = "", attrs: str = "") -> str:
    return (
        f'<td{attrs} style="{_CELL};border-bottom:1px solid rgba(128,128,128,0.15)'
        f'{";" + style if style else ""}">{content}</td>'
    )


def _radar_html(record: RunRecord) -> tuple[str, list[str]]:
    """The straggler radar's and the hardware sampler's columns: header cells, then each rank's cells; a column
    only where some rank has data for it."""
    hardware = [hardware_text(r) for r in record.ranks]
    computes = [r.compute_per_step for r in record.ranks]
    columns: list[tuple[str, list[str]]] = []
    if any(c is not None for c in computes):
        head = (
            f'<th style="{_HEAD}" title="the rank\'s own busy time per step, its waits in collectives left '
            'out">compute/step</th>'
        )
        columns.append((head, [_compute_html(r) for r in record.ranks]))
    for index, name in enumerate(("CPU", "memory", "GPU")):
        if any(h[index] for h in hardware):
            columns.append(
                (
                    f'<th style="{_HEAD}">{name}</th>',
                    [_td(html.escape(_unbroken(h[index])) or "–", _MONO) for h in hardware],
                )
            )
    return "".join(head for head, _ in columns), [
        "".join(cells[i] for _, cells in columns) for i in range(len(record.ranks))
    ]


def _unbroken(text: str) -> str:
    """A number and its unit, and a rank state's parts, kept on one line: '301.0\u00a0MiB', 'stopped\u00a0·
    SIGTERM' (a narrow table wraps between them, not inside)."""
    return (
        re.sub(r"(\d) (%|B|KiB|MiB|GiB|W|ms)\b", "\\1\u00a0\\2", text)
        .replace(" · ", "\u00a0· ")
        .replace("exit ", "exit\u00a0")
    )


def _compute_html(rank: RankRecord) -> str:
    compute = rank.compute_per_step
    if compute is None:
        return _td("–", _MUTED)
    straggler = straggler_text(rank)
    flag = (
        f' <span class="ddpnb-straggler" style="color:{_ORANGE};font-weight:600">{straggler}</span>'
        if straggler
        else ""
    )
    return _td(f"{compute * 1000:.1f} ms{flag}", _MONO)


def ranks_html(record: RunRecord) -> str:
    """One row per rank; from MANY_RANKS up, compact rows (one progress bar each) in a box that scrolls; from
    `groups.GROUP_FROM` up, a row per state and the ranks that stand out (`grouped_ranks_html`)."""
    if groups.grouped(record.world_size):
        return grouped_ranks_html(record)
    gpus = any(r.device.startswith("cuda") or r.gpu_memory is not None for r in record.ranks)
    compact = record.world_size >= MANY_RANKS  # compact rows (one progress bar each) in a box that scrolls
    pad = "padding:0 6px;line-height:1.3" if compact else ""
    head = f'style="{_HEAD}"'
    radar_head, radar_cells = _radar_html(record)
    names = ["rank", "state", "device", "PID", *(["GPU memory"] if gpus else [])]
    table = (
        '<div class="ddpnb-ranks-scroll" style="max-height:400px;overflow-y:auto">'
        # table-layout: JupyterLab's own stylesheet fixes it for the summary a finished run leaves
        '<table class="ddpnb-ranks ddpnb-compact" style="border-collapse:collapse;margin:4px 0 6px;width:100%;'
        'table-layout:auto">'
        if compact
        else '<table class="ddpnb-ranks" style="border-collapse:collapse;margin:4px 0 6px;width:100%;'
        'table-layout:auto">'
    )
    rows = [
        f"{table}<thead><tr>"
        + "".join(f"<th {head}>{name}</th>" for name in names)
        + radar_head
        + "".join(f"<th {head}>{name}</th>" for name in ("progress", "time", "latest output"))
        + "</tr></thead><tbody>"
    ]
    for rank, radar in zip(record.ranks, radar_cells):
        role = record.failure_role(rank.rank) if rank.state is RankState.FAILED else None
        stalled = record.stalled and rank.state is RankState.RUNNING
        colour = _ROLE_COLOURS[role] if role is not None else _ORANGE if stalled else _RANK_COLOURS[rank.state]
        weight = {FailureRole.ROOT_CAUSE: "700", FailureRole.KNOCK_ON: "400"}.get(role, "600")  # consequences recede
        role_attr = f' data-role="{role.name.lower()}"' if role is not None else ""
        straggler = f' data-straggler="{straggler_text(rank)}"' if rank.holds_others is not None else ""
        last = rank.last_text[:MAX_LINE_CHARS]  # not a progress bar's line: the progress column has the bar
        swatch = (
            f'<span class="ddpnb-swatch" style="display:inline-block;width:9px;height:9px;border-radius:2px;'
            f'margin-right:6px;background-color:{_rank_colour(rank.rank)}"></span>{rank.rank}'
        )
        latest = (
            f'<div class="ddpnb-mono" title="{html.escape(last)}" style="{_MONO};white-space:nowrap;'
            f'overflow:hidden;text-overflow:ellipsis;opacity:0.75">{html.escape(last[:160])}</div>'
        )
        rows.append(
            f'<tr data-rank="{rank.rank}" data-state="{"stalled" if stalled else rank.state.value}"{role_attr}'
            f"{straggler}>{_td(swatch, f'{_ONE_LINE};{pad}')}"
            f"{_td(html.escape(_unbroken(rank_state(rank, role, stalled))), f'color:{colour};font-weight:{weight};{pad}')}"
            f"{_td(html.escape(rank.device), pad)}{_td(str(rank.pid or '–'), f'{_MONO};{_ONE_LINE};{pad}')}"
            f"{_gpu_memory_html(rank) if gpus else ''}{radar}{_td(_progress_html(rank, compact), pad)}"
            f"{_td(format_duration(rank.duration), f'{_ONE_LINE};{pad}')}"
            # the rest of the table's width, however little: its text is cut there (the title has it whole)
            f"{_td(latest, f'width:99%;max-width:0;{pad}', attrs=LAST_CELL)}</tr>"
        )
    rows.append("</tbody></table></div>" if compact else "</tbody></table>")
    return "".join(rows)


def grouped_ranks_html(record: RunRecord) -> str:
    """A row per state, failed first: its ranks (ranges, or everyone but the few), their count, median time and
    compute per step, and their most common latest line; then the stragglers and the slowest and fastest ranks by
    name. Its size does not grow with the ranks (a row per rank was 2.8 MB at 1,024)."""
    head = f'style="{_HEAD}"'
    rows = [
        '<table class="ddpnb-ranks ddpnb-grouped" style="border-collapse:collapse;margin:4px 0 6px;width:100%;'
        'table-layout:auto"><thead><tr>'
        + "".join(f"<th {head}>{name}</th>" for name in ("state", "ranks", "count", "time", "compute/step"))
        + f"<th {head}>latest output (most ranks')</th></tr></thead><tbody>"
    ]
    for group in groups.state_groups(record, lambda r: state_words(record, r), exit_words):
        members = [record.ranks[rank] for rank in group.ranks]
        role = next((role for role in FailureRole if role.value == group.state), None)
        state_colours = {state.value: colour for state, colour in _RANK_COLOURS.items()}
        colour = _ROLE_COLOURS[role] if role else _ORANGE if group.state == "stalled" else state_colours[group.state]
        durations = [r.duration for r in members if r.duration is not None]
        computes = [r.compute_per_step for r in members if r.compute_per_step is not None]
        last = groups.most_common(r.last_text for r in members)[:MAX_LINE_CHARS]
        state = group.state + (f" ({group.exit})" if group.exit and group.state != "running" else "")
        latest = f'<div class="ddpnb-mono" style="{_MONO};opacity:0.75">{html.escape(last)}</div>'
        rows.append(
            f'<tr data-state="{html.escape(group.state)}" data-ranks="{groups.ranges(group.ranks)}">'
            f"{_td(html.escape(state), f'color:{colour};font-weight:600;{_ONE_LINE}')}"
            f"{_td(html.escape(groups.ranks_words(group.ranks, record.world_size)), _MONO)}"
            f"{_td(f'{len(members):,}', _ONE_LINE)}"
            f"{_td(format_duration(statistics.median(durations)) if durations else '–', _ONE_LINE)}"
            f"{_td(f'{statistics.median(computes) * 1000:.1f} ms' if computes else '–', _ONE_LINE)}"
            f"{_td(latest)}</tr>"
        )
    rows.append("</tbody></table>")
    rows += [
        f'<div class="ddpnb-exceptions" style="{_MUTED}">{html.escape(line)}</div>'
        for line in groups.exceptions(record, straggler_text)
    ]
    return "".join(rows)


def _rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def metric_names(record: RunRecord) -> list[str]:
    """Every metric any rank logged in any attempt: an earlier attempt's stay plotted while a restart begins."""
    names: dict[str, None] = {}
    for ranks in [*(attempt.ranks for attempt in record.attempts), record.ranks]:
        for rank in ranks:
            for name in list(rank.metrics):
                names.setdefault(name, None)
    return list(names)


def metrics_signature(record: RunRecord) -> tuple[int, ...]:
    """Changes whenever a point is logged: redraw plots only then."""
    return (len(record.attempts), *(series.logged for rank in record.ranks for series in list(rank.metrics.values())))


def plots_html(record: RunRecord, images: bool = False) -> str:
    """One plot per metric: inline SVG (the live widget, themed by the page's CSS), or with `images` each SVG as
    an <img> of itself (the static summary: JupyterLab's sanitiser drops <svg> from an untrusted notebook's HTML,
    and does not show an untrusted `image/svg+xml` output at all, but keeps an image's data URI)."""
    names = metric_names(record)
    if not names:
        return (
            f'<div class="ddpnb-muted" style="{_MUTED}">No metrics yet: send them from the ranks with '
            "<code>ddpnb.log(step=i, loss=loss.item())</code>.</div>"
        )
    many = record.world_size >= MANY_RANKS
    shown = [0] if many else [r.rank for r in record.ranks]
    legend = "".join(f'<span style="margin-right:12px">{_swatch(_rank_colour(r))}rank {r}</span> ' for r in shown)
    if many:
        legend += (
            f'<span style="margin-right:12px">{_swatch(_rank_colour(0), "opacity:0.25")}min–max of all ranks'
            f'</span><span style="margin-right:12px">{_swatch(MEDIAN_COLOUR)}median</span>'
        )
    plots = [_plot(record, name, shown, many, images) for name in names]
    return (
        f'<div class="ddpnb-legend" style="{_MUTED};margin:2px 0">{legend}</div>'
        f'<div class="ddpnb-plots" style="margin:2px 0 4px">{"".join(plots)}</div>'
    )


def _band_columns(logged: dict[int, Sequence[Any]]) -> tuple[list[int], Iterator[tuple[float, ...]]] | None:
    """The steps every rank's sample holds and, step by step, all ranks' values, ending with their latest: the band
    and median of a thousand ranks read in columns (zip, sorted), not point by point (80 ms a redraw at 1,024
    ranks). None unless every rank samples the same steps (the common case: ranks log the same steps at one pace)."""
    sampled = [points.sample_columns() for points in logged.values() if isinstance(points, Series) and len(points)]
    if len(sampled) < len(logged) or len({every for _, _, every in sampled}) > 1:
        return None
    kept = min(len(steps) for steps, _, _ in sampled)
    stride = max(1, -(-kept // BAND_POINTS))
    steps = sampled[0][0][:kept:stride]
    if NO_STEP in steps or any(other[:kept:stride] != steps for other, _, _ in sampled):
        return None
    columns = zip(*(values[:kept:stride] for _, values, _ in sampled))
    latest = [points[-1] for points in logged.values()]
    if len({point.step for point in latest}) == 1 and latest[0].step is not None and latest[0].step > steps[-1]:
        return [*steps, latest[0].step], itertools.chain(columns, [tuple(point.value for point in latest)])
    return list(steps), columns


def _swatch(colour: str, style: str = "") -> str:
    return (
        f'<span class="ddpnb-swatch" style="display:inline-block;width:9px;height:9px;border-radius:2px;'
        f'margin-right:6px;background-color:{colour}{";" + style if style else ""}"></span>'
    )


def _plot(record: RunRecord, name: str, shown: Sequence[int], band: bool, image: bool = False) -> str:
    width, height = PLOT_SIZE
    # the record's own lists, which the supervisor appends to: measured and sampled, never copied whole, so a
    # redraw costs the same after a million points as after a hundred
    logged = {r.rank: r.metrics.get(name, []) for r in record.ranks}
    counts = {rank: len(points) for rank, points in logged.items()}
    many = groups.grouped(record.world_size)  # the band of a thousand ranks: fewer points of each rank's
    columns = _band_columns(logged) if many and band else None
    series = {
        rank: thin(points, BAND_POINTS if many and rank not in shown else MAX_POINTS)
        for rank, points in logged.items()
        if columns is None or rank in shown
    }
    before = [{rank: thin(a.ranks[rank].metrics.get(name, []), MAX_POINTS) for rank in shown} for a in record.attempts]
    by_step = all(
        step is not None for attempt in [series, *before] for points in attempt.values() for step, _, _ in points
    )

    def xy(points: list[tuple[int | None, float, float]]) -> list[tuple[float, float]]:
        return [
            (float(step) if by_step else t - record.started, value) for step, t, value in points if math.isfinite(value)
        ]

    lines = {rank: xy(series[rank]) for rank in shown}
    # earlier attempts: their lines, fainter, and a marker where each later attempt's first point is
    earlier = [{rank: xy(points) for rank, points in attempt.items()} for attempt in before]
    restarts = []
    for ranks in [*(a.ranks for a in record.attempts[1:]), record.ranks][: len(record.attempts)]:
        first = next((xy(r.metrics[name][:1]) for r in ranks if r.rank in shown and r.metrics.get(name)), [])
        restarts.extend(x for x, _ in first[:1])
    band_points: list[tuple[float, float, float]] = []
    median: list[tuple[float, float]] = []
    if band and by_step and columns is not None:
        for x, ys in zip(*columns):
            finite = sorted(y for y in ys if math.isfinite(y)) if not all(map(math.isfinite, ys)) else sorted(ys)
            if finite:
                band_points.append((float(x), finite[0], finite[-1]))
                median.append((float(x), statistics.median(finite)))
    elif band and by_step:
        spread: dict[float, list[float]] = {}
        for points in series.values():
            for x, y in xy(points):
                spread.setdefault(x, []).append(y)
        band_points = [(x, min(ys), max(ys)) for x, ys in sorted(spread.items())]
        median = [(x, statistics.median(ys)) for x, ys in sorted(spread.items())]
    drawn_lines = [*lines.values(), *(points for attempt in earlier for points in attempt.values())]
    all_x = [x for points in drawn_lines for x, _ in points] + [x for x, _, _ in band_points]
    all_y = [y for points in drawn_lines for _, y in points] + [y for _, lo, hi in band_points for y in (lo, hi)]
    latest = series[shown[0]] or next((a[shown[0]] for a in reversed(before) if a[shown[0]]), [])
    value = f"rank {shown[0]}: {latest[-1][2]:.4g}" if len(latest) else ""
    off = outliers(logged) if many else []
    title = (
        f'<div class="ddpnb-plot-title" style="font-size:12px;font-weight:600;margin:0 0 0 40px">'
        f'{html.escape(name)} <span style="font-weight:400;opacity:0.7">{value}</span>'
        + (
            f'<span class="ddpnb-outliers" style="font-weight:400;opacity:0.7">; off the others: '
            f"{', '.join(f'rank {rank} {latest:.4g}' for rank, latest in off)}</span>"
            if off
            else ""
        )
        + "</div>"
    )
    box = (
        f'<div class="ddpnb-plot" data-metric="{html.escape(name)}" style="display:inline-block;'
        f'vertical-align:top;margin:0 14px 4px 0">{title}'
    )
    if not all_x:
        return f"{box}</div>"
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

    svg = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-size="10" font-family="sans-serif">'
        )
    ]
    for y in y_ticks:
        svg.append(
            f'<line class="ddpnb-grid" x1="{left}" x2="{width - right}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
            f'stroke="#808080" stroke-opacity="0.2"/><text x="{left - 5}" y="{sy(y) + 3.5:.1f}" text-anchor="end" fill="#808080">'
            f"{_tick_label(y)}</text>"
        )
    for x in x_ticks:
        if x_lo <= x <= x_hi and sx(x) < width - right - 30:  # the right end carries the axis' unit
            svg.append(
                f'<text x="{sx(x):.1f}" y="{height - 8}" text-anchor="middle" fill="#808080">{_tick_label(x)}</text>'
            )
    svg.append(
        f'<line class="ddpnb-axis" x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" '
        f'stroke="#808080" stroke-opacity="0.6"/><line class="ddpnb-axis" x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}" '
        f'stroke="#808080" stroke-opacity="0.6"/>'
    )
    svg.append(
        f'<text x="{width - right}" y="{height - 8}" text-anchor="end" fill="#808080">'
        f"{'step' if by_step else 's'}</text>"
    )
    if band_points:
        thinned = thin(band_points, MAX_POINTS)
        outline = [(sx(x), sy(hi)) for x, _, hi in thinned] + [(sx(x), sy(lo)) for x, lo, _ in reversed(thinned)]
        svg.append(
            f'<polygon class="ddpnb-band" fill="{_rank_colour(0)}" fill-opacity="0.18" stroke="none" '
            f'points="{_points(outline)}"><title>min–max of all ranks</title></polygon>'
        )
        svg.append(
            f'<polyline class="ddpnb-median" fill="none" stroke="{MEDIAN_COLOUR}" stroke-width="1.2" '
            f'stroke-dasharray="4,2" points="{_points((sx(x), sy(y)) for x, y in thin(median, MAX_POINTS))}">'
            "<title>median of all ranks</title></polyline>"
        )
    for number, attempt in enumerate(earlier):
        for rank, points in attempt.items():
            if len(points) > 1:
                svg.append(
                    f'<polyline data-rank="{rank}" data-attempt="{number}" fill="none" '
                    f'stroke="{_rank_colour(rank)}" stroke-opacity="0.35" stroke-width="1.2" '
                    f'points="{_points((sx(x), sy(y)) for x, y in thin(points, MAX_POINTS))}"/>'
                )
    for number, x in enumerate(restarts, 1):
        svg.append(
            f'<line class="ddpnb-restart" data-attempt="{number}" x1="{sx(x):.1f}" x2="{sx(x):.1f}" '
            f'y1="{top}" y2="{top + plot_h}" stroke="{_ORANGE}" stroke-dasharray="3,3">'
            f"<title>attempt {number} starts here</title></line>"
            f'<text x="{sx(x) + 3:.1f}" y="{top + 9}" fill="{_ORANGE}">restart {number}</text>'
        )
    for rank, points in lines.items():
        if not points:
            continue
        colour = _rank_colour(rank)
        drawn = thin(points, MAX_POINTS)
        attrs = f'data-rank="{rank}" data-points="{counts[rank]}"'
        if len(drawn) == 1:
            ((x, y),) = drawn
            svg.append(f'<circle {attrs} cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>')
        else:
            svg.append(
                f'<polyline {attrs} fill="none" stroke="{colour}" stroke-width="1.6" '
                f'stroke-linejoin="round" points="{_points((sx(x), sy(y)) for x, y in drawn)}"/>'
            )
    svg.append("</svg>")
    drawn_svg = "".join(svg)
    if image:
        data = base64.b64encode(drawn_svg.encode()).decode()
        drawn_svg = (
            f'<img class="ddpnb-plot-image" src="data:image/svg+xml;base64,{data}" width="{width}" '
            f'height="{height}" alt="{html.escape(name)}: {html.escape(value)}">'
        )
    return f"{box}{drawn_svg}</div>"


def _points(points: Iterable[tuple[float, float]]) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in points)


def outliers(logged: dict[int, Sequence[Any]]) -> list[tuple[int, float]]:
    """The ranks whose latest value lies furthest off the others' (over OUTLIER_SPREAD median deviations off their
    median), the furthest OUTLIERS of them, with that value: what a plot of many ranks names under its band."""
    latest = {rank: points[-1][2] for rank, points in logged.items() if len(points)}
    finite = [value for value in latest.values() if math.isfinite(value)]
    if len(finite) < 3:
        return []
    middle = statistics.median(finite)
    spread = statistics.median(abs(value - middle) for value in finite)
    off = {
        rank: abs(value - middle) if math.isfinite(value) else math.inf
        for rank, value in latest.items()
        if not math.isfinite(value) or abs(value - middle) > max(OUTLIER_SPREAD * spread, 1e-9 * abs(middle))
    }
    return [(rank, latest[rank]) for rank in sorted(off, key=lambda rank: (-off[rank], rank))[:OUTLIERS]]


def thin(points: Sequence[Any], limit: int) -> Sequence[Any]:
    """At most about `limit` evenly spaced points, always keeping the last one (a record's series: from the sample
    it keeps in memory)."""
    if isinstance(points, Series):
        return points.sample(limit)
    if len(points) <= limit:
        return list(points)
    stride = math.ceil(len(points) / limit)
    kept = list(points[::stride])
    if (len(points) - 1) % stride:
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


def line_html(rank: int, stream: Stream, text: str, ranks: Sequence[int] = (), world_size: int = 0) -> str:
    """One log line; `ranks`: every rank that printed it, when folded (`[ranks 0-3]`, in a neutral colour; of a
    run of many ranks, `[ranks 0-1023 but 17]`)."""
    if len(ranks) > 1:
        said = groups.ranks_words(ranks, world_size) if groups.grouped(world_size) else rank_ranges(ranks)
        tag, colour = f"[ranks {said}]", _GREY
    else:
        tag, colour = f"[rank {rank}]", _rank_colour(rank)
    tint = ";background-color:rgba(211,47,47,0.1)" if stream is Stream.STDERR else ""
    return (
        f'<div class="ddpnb-line ddpnb-{stream}" style="{_WRAP};'
        f'line-height:1.35{tint}"><span class="ddpnb-tag" style="font-weight:600;margin-right:6px;{_ONE_LINE};'
        f'color:{colour}">{tag}</span><span class="ddpnb-text">{html.escape(text)}</span></div>'
    )


def total_lines(record: RunRecord, rank: int | None = None) -> int:
    """Lines the ranks printed in every attempt of the run (one rank's, given `rank`): what the log files hold."""
    attempts = [*(attempt.ranks for attempt in record.attempts), record.ranks]
    return sum(r.lines for ranks in attempts for r in ranks if rank is None or r.rank == rank)


class RestartMark(NamedTuple):
    """Where the run restarted, among the output lines (`core.report.restart_line`): no rank printed it."""

    text: str


LogEntry = OutputLine | FoldedLine | RestartMark


def printed_count(lines: Iterable[LogEntry]) -> int:
    """How many printed lines these are: a folded line is one per rank that printed it; a restart's mark none."""
    return sum(
        len(line.ranks) if isinstance(line, FoldedLine) else 0 if isinstance(line, RestartMark) else 1 for line in lines
    )


def log_note(lines: Sequence[LogEntry], total: int, where: str) -> str:
    """The log panel's heading: how many lines it shows of how many the ranks printed (`total`, in every attempt),
    and how many rows they take once folded; `where`: the logs that hold every line."""
    printed = printed_count(lines)
    rows = sum(not isinstance(line, RestartMark) for line in lines)
    folded = f", shown in {rows} (the same line from several ranks once)" if rows < printed else ""
    if not total:
        return f"no output · logs in {where}"
    if total > printed:
        return f"last {printed:,} of {total:,} lines{folded} · every line is in {where}"
    return f"{total:,} lines{folded} · also in {where}"


def any_line_html(line: LogEntry) -> str:
    """`line_html` of a line as the run gave it or as `views.fold` folded it; a restart's mark across the log."""
    if isinstance(line, RestartMark):
        return (
            f'<div class="ddpnb-restart-mark" style="white-space:pre-wrap;line-height:1.35;color:{_ORANGE};'
            f'font-weight:600;border-top:1px dashed {_ORANGE};margin:2px 0">{html.escape(line.text)}</div>'
        )
    if isinstance(line, FoldedLine):
        return line_html(line.rank, line.stream, line.text, line.ranks, line.world_size)
    return line_html(line.rank, line.stream, line.text)


def log_html(lines: Iterable[str], note: str) -> str:
    """The log panel from lines drawn by `line_html` (the live dashboard draws each line once, not each redraw)."""
    inner = "".join(lines) or f'<div class="ddpnb-muted" style="{_MUTED}">no output yet</div>'
    return (
        f'<div class="ddpnb-muted" style="{_MUTED}">{note}</div>'
        f'<div class="ddpnb-log ddpnb-mono" style="{_MONO};border:1px solid {_RULE};border-radius:3px;'
        f'padding:4px 8px;margin:2px 0;background-color:rgba(128,128,128,0.06)"><div>{inner}</div></div>'
    )


def error_html(record: RunRecord, full_traceback: bool = True) -> str:
    """The first failure: the failing rank's traceback (cells named as IPython names them, `Cell In[3], line 7`),
    then what the other ranks did. With `full_traceback=False` (a foreground run: the cell's own error right below
    shows the traceback) only where it was raised, so the traceback is not shown twice."""
    first = record.first_failure
    muted = f'class="ddpnb-muted" style="{_MUTED}"'
    earlier = "".join(
        f'<div {muted} data-attempt="{a.number}">attempt {a.number} (restarted): {html.escape(attempt_line(a))}</div>'
        for a in record.attempts
    )
    box = (
        f'<div class="ddpnb-error" style="border-left:3px solid {_RED};background-color:rgba(211,47,47,0.08);'
        f'padding:4px 10px;margin:4px 0">'
    )
    if first is None:
        return f"{box}{earlier}</div>" if earlier else ""
    parts = [
        (
            f'{box}<div class="ddpnb-error-title" style="font-weight:600;color:{_RED}">rank {first.rank} failed '
            f"first: {html.escape(first.summary)}</div>"
        )
    ]
    traceback = cell_names(first.traceback).rstrip()
    if traceback and full_traceback:
        parts.append(
            f'<pre style="margin:4px 0;{_WRAP};max-height:320px;overflow-y:auto">{html.escape(traceback)}</pre>'
        )
    elif traceback:
        frames = [line.strip() for line in traceback.splitlines() if line.startswith(("  File ", "  Cell In["))]
        # a crash report lists the innermost frame first, and the summary already names it
        at = f"at {frames[-1]}; " if frames and "most recent call first" not in traceback else ""
        parts.append(
            f'<div {muted} data-traceback="below">{html.escape(at)}the full traceback is in the cell\'s '
            f"error below</div>"
        )
    values = locals_lines(first)
    if values:  # collapsed: the traceback says where; these say with what
        parts.append(
            f'<details class="ddpnb-locals"><summary {muted}>locals where rank {first.rank} raised</summary>'
            f'<pre style="margin:4px 0;{_WRAP};max-height:240px;overflow-y:auto">'
            f"{html.escape(chr(10).join(values))}</pre></details>"
        )
    others = [f for f in sorted(record.failures, key=lambda f: f.time) if f is not first]
    own = [f for f in others if not f.knock_on]  # as the text report splits them
    if own:
        parts.append(
            f"<div {muted}>also failed: "
            + "; ".join(
                html.escape(f"rank {f.rank}: " + ("the same error" if f.summary == first.summary else f.summary))
                for f in own
            )
            + "</div>"
        )
    if len(own) < len(others):
        parts.append(
            f"<div {muted}>then, as a consequence: "
            + "; ".join(html.escape(f"rank {f.rank}: {f.summary}") for f in others if f.knock_on)
            + "</div>"
        )
    parts.append(f"{earlier}</div>")
    return "".join(parts)


def stall_html(record: RunRecord, foreground: bool = False) -> str:
    """The stall banner: where each rank is while no rank makes progress, its seconds counted as of now, then the
    ranks' stacks as the stall doctor last took them (every few seconds while the stall goes on); one line once
    progress resumed. `foreground`: the cell waits for the run, so neither the Stacks button nor a handle serves."""
    stall = record.stall
    if stall is None:
        return ""
    if not stall.ongoing:
        assert stall.resumed is not None
        return (
            f'<div class="ddpnb-muted" style="{_MUTED}" data-stall="resumed">stalled for {format_duration(stall.resumed - stall.since)} '
            f"({html.escape(diagnosis_summary(stall.diagnosis))}), then progress resumed</div>"
        )
    going = record.outcome is Outcome.RUNNING
    now = time.time() if going else record.ended
    diagnosis = stall.diagnosis
    lines = "".join(f"<div>{html.escape(line)}</div>" for line in [*diagnosis_lines(diagnosis, now), *diagnosis.flight])
    taken = format_duration(max(0.0, (now or diagnosis.taken) - diagnosis.taken))
    if not going:
        tail = f"still stalled when the run ended ({record.outcome.value})"
    elif foreground:
        tail = (
            f"the run goes on; each rank's stack below was taken {taken} ago, and is taken again every few "
            "seconds while the run stays stalled; interrupt the kernel (■) to stop it"
        )
    else:
        tail = (
            f"the run goes on; each rank's stack below was taken {taken} ago, and is taken again every few "
            "seconds while the run stays stalled; Stop ends it"
        )
    return (
        f'<div class="ddpnb-stall" data-stall="ongoing" style="border-left:3px solid {_ORANGE};'
        f'background-color:rgba(245,124,0,0.1);padding:4px 10px;margin:4px 0 0">'
        f'<div class="ddpnb-stall-title" style="font-weight:600;color:{_ORANGE}">'
        f'{html.escape(stall_headline(stall, now))}</div><div class="ddpnb-mono" style="{_MONO}">{lines}</div>'
        f'<div class="ddpnb-muted" style="{_MUTED}">{html.escape(tail)}</div></div>'
    )


def stall_stacks_html(record: RunRecord) -> str:
    """Under the stall banner: each rank's stack as the stall doctor last took it (the same stack once for the
    ranks it is the same for), notebook cells named as IPython names them; '' unless the run is stalled now (a
    timeout's report has its own). Drawn on its own, so the live widget redraws it only when the stacks are taken
    again, not each time the seconds count."""
    stall = record.stall
    if stall is None or not record.stalled or not stall.diagnosis.stacks:
        return ""
    return (
        f'<div class="ddpnb-stall-stacks" style="border-left:3px solid {_ORANGE};padding:0 10px 4px;'
        f'margin:0 0 4px;background-color:rgba(245,124,0,0.05)">'
        + "".join(
            f'<div class="ddpnb-stall-stack" data-ranks="{",".join(map(str, ranks))}" style="{_MUTED}">'
            f'{html.escape(named(ranks))}</div><pre class="ddpnb-mono" style="{_MONO};margin:1px 0 4px;'
            f'{_WRAP};max-height:240px;overflow-y:auto">{html.escape(text)}'
            f"</pre>"
            for ranks, text in grouped_stacks(stall.diagnosis.stacks)
        )
        + "</div>"
    )


def stacks_html(stacks: dict[int, str], world_size: int = 0) -> str:
    """Every rank's stack, as `Run.stacks()` gave them; from `groups.GROUP_FROM` ranks up, one stack per place
    the ranks are at (`grouped_stacks`), the ranks that sent none named, and how to ask for one rank's."""
    if not stacks:
        return f'<div class="ddpnb-muted" style="{_MUTED}">no rank is running: no stacks</div>'
    if groups.grouped(max(world_size, len(stacks))):
        sent = {rank: text for rank, text in stacks.items() if text.strip()}
        silent = sorted(set(range(world_size)) - set(sent))
        return (
            f'<div class="ddpnb-stacks">{section_html("stacks")}'
            + "".join(
                f'<div data-ranks="{groups.ranges(ranks)}">{html.escape(groups.named(ranks, world_size))}</div>'
                f'<pre class="ddpnb-mono" style="{_MONO};margin:2px 0 6px;{_WRAP};max-height:320px;overflow-y:auto">'
                f"{html.escape(text)}</pre>"
                for ranks, text in grouped_stacks(sent)
            )
            + (
                f'<div style="{_MUTED}">{html.escape(groups.named(silent, world_size))}: no stack (not running, or '
                "not answering)</div>"
                if silent
                else ""
            )
            + f'<div style="{_MUTED}">one rank\'s whole stack: <code>run.stacks(ranks=[17])</code></div></div>'
        )
    return (
        f'<div class="ddpnb-stacks">{section_html("stacks")}'
        + "".join(
            f'<div data-rank="{rank}">rank {rank}</div><pre class="ddpnb-mono" style="{_MONO};margin:2px 0 6px;'
            f'{_WRAP};max-height:320px;overflow-y:auto">'
            f"{html.escape(text.rstrip() or '(no stack came)')}</pre>"
            for rank, text in sorted(stacks.items())
        )
        + "</div>"
    )


def log_location(record: RunRecord) -> str:
    """Where every rank's log of every attempt is (`report.log_files`)."""
    return f"<code>{html.escape(log_files(record))}</code>"


def resume_html(record: RunRecord) -> str:
    """A stopped or failed run with a complete checkpoint: how to continue from it."""
    if record.outcome in (Outcome.SUCCEEDED, Outcome.RUNNING) or record.checkpoint_dir is None:
        return ""
    found = checkpoints.latest(record.checkpoint_dir)
    if found is None:
        return ""
    return (
        f'<div class="ddpnb-muted" style="{_MUTED}" data-resume="{found[0]}">continue from its checkpoint of '
        f"step {found[0]}: <code>%%ddp --resume {html.escape(str(record.run_dir))}</code> (or "
        f"<code>--resume last</code>)</div>"
    )


def section_html(title: str) -> str:
    return (
        f'<span class="ddpnb-section" style="font-weight:600;font-size:12px;opacity:0.7;'
        f'text-transform:uppercase;letter-spacing:0.04em">{title}</span>'
    )


def summary_html(record: RunRecord, lines: Sequence[LogEntry], full_traceback: bool = True) -> str:
    """The static record of a finished run: what the cell keeps once the live dashboard is gone; `lines`: the
    latest lines, folded or not, and the restarts' marks. Styled inline only, with the plots as images: it reads
    the same in an untrusted notebook, whose HTML JupyterLab sanitises."""
    tail = lines[-SUMMARY_LOG_LINES:]
    # every attempt's lines: those shown may come from an earlier one
    note = log_note(tail, total_lines(record), log_location(record))
    logs = (
        f'<details{" open" if tail else ""} style="margin:6px 0 2px"><summary style="cursor:pointer">'
        f"{section_html('output')}</summary>"
        f"{log_html((any_line_html(line) for line in tail), note)}</details>"
    )
    hint = f'<div class="ddpnb-muted" style="{_MUTED}">{html.escape(record.hint)}</div>' if record.hint else ""
    return (
        f'<div class="ddpnb" data-ddpnb-summary="1" style="font-size:13px;line-height:1.4;max-width:1100px">'
        f"{header_html(record)}{ranks_html(record)}"
        f"{plots_html(record, images=True) if metric_names(record) else ''}"
        f"{profile_html(record.profile) if record.profile is not None else ''}{stall_html(record)}"
        f"{error_html(record, full_traceback)}{resume_html(record)}{logs}{hint}</div>"
    )
