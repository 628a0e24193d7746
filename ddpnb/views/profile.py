"""A run's profile (`record.profile`, `core.profile`) for the views: the rank the others waited for in words, a
table per rank for the text view, and one stacked bar per rank for the dashboard's summary (an image, so it
survives a saved notebook as the plots do)."""

from __future__ import annotations

import base64
import html

from ddpnb.core.profile import PARTS, WAITED_AT_LEAST, Profile, RankTime

PART_COLOURS = {
    "compute": "#4c78a8",
    "communication": "#72b7b2",
    "waiting": "#e45756",
    "data": "#54a24b",
    "other": "#bab0ac",
}
BAR_WIDTH, BAR_HEIGHT, LABEL_WIDTH = 420, 14, 150
_MUTED = "opacity:0.7;font-size:12px"
_CELL = "text-align:right;padding:2px 8px;white-space:nowrap"


def waited_words(profile: Profile) -> str:
    """'rank 0 waited 31% of the step for rank 1', 'ranks 0, 2, 3 waited 28-34% of the step for rank 1'."""
    found = profile.waited()
    if found is None:
        return f"no rank waited {WAITED_AT_LEAST:.0%} of its step or more for another"
    waiters, slow, shares = found
    who = f"rank {waiters[0]}" if len(waiters) == 1 else "ranks " + ", ".join(map(str, waiters))
    low, high = round(min(shares) * 100), round(max(shares) * 100)
    share = f"{low}%" if low == high else f"{low}-{high}%"
    return f"{who} waited {share} of the step for rank {slow}"


def headline(profile: Profile) -> str:
    if not profile.ranks:
        return f"profile of {profile.steps}: no trace to show"  # the notes say why
    return f"profile of {profile.steps}: {waited_words(profile)}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds >= 0.0001 else "0"


def _part(rank: RankTime, part: str) -> str:
    seconds = getattr(rank, part)
    return f"{_ms(seconds)} ({rank.share(part):.0%})" if seconds >= 0.0001 else "0"


def profile_text(profile: Profile) -> str:
    """The profile as plain lines: the headline, a row per rank, the top operators, where the trace is."""
    lines = [f"[ddpnb] {headline(profile)}"]
    if profile.ranks:
        cells = [["rank", "step", *PARTS]]
        cells += [[str(r.rank), _ms(r.step), *(_part(r, part) for part in PARTS)] for r in profile.ranks]
        widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
        lines += [
            "  "
            + "  ".join(
                cell.rjust(width) if i < 2 else cell.ljust(width) for i, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
            for row in cells
        ]
        lines.append("  per step, mean over the profiled steps; top operators by self time per step:")
        lines += [
            f"    rank {r.rank}: " + ", ".join(f"{name} {_ms(seconds)}" for name, seconds in r.top_ops)
            for r in profile.ranks
            if r.top_ops
        ]
    lines += [f"  note: {note}" for note in profile.notes]
    if profile.trace is not None:
        lines.append(f"  merged trace (Perfetto UI, chrome://tracing): {profile.trace}; each rank's beside it")
    return "\n".join(lines)


def bars_svg(profile: Profile) -> str:
    """One stacked bar per rank, as long as its step (the longest fills the width), split into its parts."""
    longest = max((r.step for r in profile.ranks), default=0.0) or 1.0
    width, height = LABEL_WIDTH + BAR_WIDTH + 70, (BAR_HEIGHT + 6) * len(profile.ranks) + 4
    svg = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="11">'
        )
    ]
    for row, rank in enumerate(profile.ranks):
        y = 2 + row * (BAR_HEIGHT + 6)
        svg.append(f'<text x="0" y="{y + BAR_HEIGHT - 3}" fill="#808080">{html.escape(rank.name)}</text>')
        x = float(LABEL_WIDTH)
        for part in PARTS:
            span = getattr(rank, part) / longest * BAR_WIDTH
            if span > 0.05:
                svg.append(
                    f'<rect data-rank="{rank.rank}" data-part="{part}" x="{x:.1f}" y="{y}" width="{span:.1f}" '
                    f'height="{BAR_HEIGHT}" fill="{PART_COLOURS[part]}"><title>{part}: {_part(rank, part)}'
                    f"</title></rect>"
                )
            x += span
        svg.append(f'<text x="{x + 6:.1f}" y="{y + BAR_HEIGHT - 3}" fill="#808080">{_ms(rank.step)}</text>')
    svg.append("</svg>")
    return "".join(svg)


def profile_html(profile: Profile) -> str:
    """The dashboard's summary part: the headline, the bars (an image of the SVG: JupyterLab's sanitiser keeps
    it in an untrusted notebook), a table per rank, the top operators and where the trace is."""
    parts = [
        (
            f'<div class="ddpnb-profile" style="margin:6px 0"><div style="font-weight:600;font-size:12px;'
            f'opacity:0.7;text-transform:uppercase;letter-spacing:0.04em">profile</div>'
            f"<div>{html.escape(headline(profile))}</div>"
        )
    ]
    if profile.ranks:
        svg = bars_svg(profile)
        data = base64.b64encode(svg.encode()).decode()
        legend = "".join(
            f'<span style="margin-right:12px"><span style="display:inline-block;width:9px;height:9px;'
            f'border-radius:2px;margin-right:5px;background-color:{PART_COLOURS[part]}"></span>{part}'
            f"</span>"
            for part in PARTS
        )
        parts.append(
            f'<div style="{_MUTED};margin:2px 0">{legend}</div>'
            f'<img class="ddpnb-profile-bars" alt="{html.escape(headline(profile))}" '
            f'src="data:image/svg+xml;base64,{data}"/>'
        )
        head = "".join(f'<th style="{_CELL}">{name}</th>' for name in ("rank", "step", *PARTS))
        rows = "".join(
            "<tr>"
            + "".join(
                f'<td style="{_CELL}">{html.escape(cell)}</td>'
                for cell in (str(r.rank), _ms(r.step), *(_part(r, p) for p in PARTS))
            )
            + "</tr>"
            for r in profile.ranks
        )
        tops = "".join(
            f"<li>rank {r.rank}: " + html.escape(", ".join(f"{name} {_ms(s)}" for name, s in r.top_ops)) + "</li>"
            for r in profile.ranks
            if r.top_ops
        )
        parts.append(
            f'<table style="border-collapse:collapse;font-size:12px">{head}{rows}</table>'
            f'<details style="{_MUTED}"><summary style="cursor:pointer">top operators by self time per '
            f'step</summary><ul style="margin:2px 0">{tops}</ul></details>'
        )
    parts += [f'<div style="{_MUTED}">note: {html.escape(note)}</div>' for note in profile.notes]
    if profile.trace is not None:
        parts.append(
            f'<div style="{_MUTED}">merged trace (open in <a href="https://ui.perfetto.dev" '
            f'target="_blank">Perfetto UI</a> or chrome://tracing): <code>{html.escape(str(profile.trace))}'
            f"</code>; each rank's beside it</div>"
        )
    return "".join(parts) + "</div>"
