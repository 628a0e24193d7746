"""The dashboard of N simulated ranks (bench/loadgen.py) in a real JupyterLab page in Debian's Chromium (Playwright,
as tests/test_browser.py drives it): how long from the kernel's redraw to the browser having painted it. Prints one
JSON line.

    python bench/_browser_scale.py RANKS SECONDS [--raw FILE]

From `groups.GROUP_FROM` (32) ranks up, where the dashboard redraws once a second (below, at each of the reader's
announcements, too close together to tell apart here). The kernel (a real ipykernel under JupyterLab) runs the simulated ranks' run with its dashboard; once they train,
the page listens to the kernel's iopub messages for SECONDS. Each widget update (a `comm_msg`) carries the time the
kernel made it (its header's `date`); the page notes when it came, and, with a MutationObserver on the cell's
output, when the DOM next changed and the frame after that change was painted (requestAnimationFrame, then a
message: the task after the paint). The kernel's redraw builds every part, then sends its widgets' updates
together, once a second, so the updates group into redraws by the gaps between them. Measured per
redraw: from its first update's send to the paint after its last update's DOM change ("update", the goal's figure),
the kernel's part (first to last send), and its bytes; over the window, Chromium's own script, layout and style
time (CDP `Performance.getMetrics`) per redraw.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent)]

from tests import jupyterlab  # the path above first

GAP = 0.3  # seconds between two updates that start another redraw (a redraw's updates come within its render)
EARLY = 0.02  # seconds a DOM change may come before its update is noted (see `redraws`)

LAUNCH_CELL = """\
import sys
sys.path[:0] = [{repo!r}, {engines!r}]
import ddpnb
from ddpnb.views.dashboard import Dashboard

def train():
    \"\"\"Never called: the simulated nodes play the ranks.\"\"\"

run = ddpnb.launch(
    train, engine="sim", nprocs={ranks}, view="none", timeout={timeout}, ranks_per_node=8, start_at={start_at},
    steps={steps},
)
Dashboard(run, foreground=False)
"""

LISTEN = """() => {
    const now = () => performance.timeOrigin + performance.now();
    const probe = (window.__ddpnbProbe = {updates: [], paints: []});
    const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
    kernel.iopubMessage.connect((_, msg) => {
        if (msg.header.msg_type !== "comm_msg" || msg.content.data.method !== "update") return;
        probe.updates.push([Date.parse(msg.header.date), now(), JSON.stringify(msg.content).length]);
    });
    const output = document.querySelector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell .jp-OutputArea");
    new MutationObserver(() => {
        const changed = now();
        requestAnimationFrame(() => {
            const channel = new MessageChannel();
            channel.port1.onmessage = () => probe.paints.push([changed, now()]);
            channel.port2.postMessage(0);
        });
    }).observe(output, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def redraws(updates: list[list[float]], paints: list[list[float]]) -> list[dict[str, float]]:
    """The updates grouped into redraws; for each, the last paint after a DOM change made between its first update's
    arrival and the next redraw's. Not matched update by update: JupyterLab applies a comm message before it
    announces it on `iopubMessage`, now and then, so a change can come a moment before its update is noted; redraws
    are a second apart, and the page applies each long before the next comes (see the transport figures)."""
    groups: list[list[list[float]]] = []
    for update in sorted(updates):
        if groups and update[0] - groups[-1][-1][0] <= GAP * 1000:
            groups[-1].append(update)
        else:
            groups.append([update])
    found = []
    for group, after in zip(groups, [*groups[1:], None]):
        opens = min(update[1] for update in group) - EARLY * 1000
        closes = min(update[1] for update in after) - EARLY * 1000 if after else math.inf
        drawn = [paint for changed, paint in paints if opens <= changed < closes]
        if not drawn or after is None:  # the last: its window runs past the listening
            continue
        first, last = group[0][0], group[-1][0]
        found.append(
            {
                "update_ms": max(drawn) - first,
                "kernel_ms": last - first,
                "browser_ms": max(drawn) - last,
                "bytes": sum(update[2] for update in group),
            }
        )
    return found


def main() -> None:
    ranks, seconds = int(sys.argv[1]), float(sys.argv[2])
    why = jupyterlab.missing()
    if why:
        raise SystemExit(f"not measured: {why}")
    start_at = 5 + ranks / 40  # as bench/_scale.py: every node's host has come
    cell = LAUNCH_CELL.format(
        repo=str(BENCH.parent),
        engines=str(BENCH / "engines"),
        ranks=ranks,
        timeout=seconds + start_at + 300,
        start_at=start_at,
        steps=int((seconds + start_at + 120) * 5),
    )
    from playwright.sync_api import sync_playwright

    with (
        tempfile.TemporaryDirectory(prefix="ddpnb-browser-scale-") as temp,
        jupyterlab.serve(Path(temp)) as lab,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(
            executable_path=jupyterlab.CHROMIUM, headless=True, args=jupyterlab.CHROMIUM_ARGS
        )
        page = browser.new_context(viewport={"width": 1180, "height": 1500}).new_page()
        page.set_default_timeout(120_000)
        cells = jupyterlab.open_notebook(page, (*lab, Path(temp)), "scale.ipynb", [cell, "run.stop()"])
        jupyterlab.run_cell(page, cells.nth(0))
        output = cells.nth(0).locator(".jp-OutputArea")
        output.locator(".ddpnb .ddpnb-pill[data-state='running']").wait_for(timeout=300_000)
        time.sleep(start_at + 10)  # the ranks train, their plots and logs fill
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")
        before = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        page.evaluate(LISTEN)
        time.sleep(seconds)
        probe = page.evaluate("() => window.__ddpnbProbe")
        after = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        dom_nodes = page.evaluate("() => document.querySelectorAll('.jp-OutputArea .ddpnb *').length")
        jupyterlab.run_cell(page, cells.nth(1))
        browser.close()
    if "--raw" in sys.argv:
        Path(sys.argv[sys.argv.index("--raw") + 1]).write_text(json.dumps(probe))
    found = redraws(probe["updates"], probe["paints"])
    transport = [came - sent for sent, came, _ in probe["updates"]]  # the kernel's send to the page's receipt
    updates = [row["update_ms"] for row in found]
    spent = {name: after[name] - before[name] for name in ("ScriptDuration", "LayoutDuration", "RecalcStyleDuration")}
    print(
        "@@BROWSER "
        + json.dumps(
            {
                "ranks": ranks,
                "seconds": seconds,
                "redraws": len(found),
                "update_p50_ms": round(statistics.median(updates), 1) if updates else None,
                "update_p95_ms": round(percentile(updates, 0.95), 1) if updates else None,
                "kernel_p50_ms": round(statistics.median(row["kernel_ms"] for row in found), 1) if found else None,
                "browser_p50_ms": round(statistics.median(row["browser_ms"] for row in found), 1) if found else None,
                "browser_p95_ms": round(percentile([row["browser_ms"] for row in found], 0.95), 1) if found else None,
                "bytes_p50": statistics.median(row["bytes"] for row in found) if found else None,
                "transport_p50_ms": round(statistics.median(transport), 1) if transport else None,
                "transport_p95_ms": round(percentile(transport, 0.95), 1) if transport else None,
                "chromium_ms_per_redraw": {
                    name: round(value * 1000 / max(1, len(found)), 1) for name, value in spent.items()
                },
                "dom_nodes": dom_nodes,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
