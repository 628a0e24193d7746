"""JupyterLab on 127.0.0.1 and Debian's Chromium driven by Playwright: shared by tests/test_browser.py and the bench's
browser probe (bench/_browser_scale.py).

No browser is downloaded: Playwright drives /usr/bin/chromium (`apt-get install chromium`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat

CHROMIUM = os.environ.get("DDPNB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = ".jp-NotebookPanel:visible .jp-Notebook"
IDLE = ".jp-NotebookPanel:visible .jp-Notebook-ExecutionIndicator[data-status='idle']"


def missing() -> str | None:
    """What is missing to drive JupyterLab in Chromium, as an instruction; None when nothing is."""
    if not (os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"Debian's chromium is not at {CHROMIUM} (apt-get install -y chromium)"
    for module in ("jupyterlab", "playwright"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install jupyterlab playwright)"
    return None


@contextlib.contextmanager
def serve(root: Path) -> Iterator[tuple[str, str]]:
    """A JupyterLab server over `root` on 127.0.0.1 (a port the server binds as 0), with a token: (url, token);
    stopped afterwards. Its kernels import this checkout (PYTHONPATH) and draw the dashboard (no DDPNB_VIEW)."""
    runtime, settings = root / ".runtime", root / ".settings"
    notification = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True)
    notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    token = secrets.token_hex(16)
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(runtime),
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(root / ".workspaces"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("DDPNB_VIEW", None)  # auto: the dashboard, as a user gets it
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            "--port=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.port_retries=0",
            "--LabApp.extension_manager=readonly",
            "--LabApp.news_url=",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(root / "server.log", "wb"),  # noqa: SIM115
    )
    try:
        yield _server_url(runtime, server, root / "server.log"), token
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)


def _server_url(runtime: Path, server: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for info in runtime.glob("jpserver-*.json"):
            data = json.loads(info.read_text() or "{}")
            if data.get("port"):
                return f"http://127.0.0.1:{data['port']}"
        if server.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"JupyterLab did not start:\n{log.read_text()[-3000:]}")


def write_notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, path)


def open_notebook(page, lab: tuple[str, str, Path], name: str, cells: list[str]):
    """Write `cells` as `name` under the server's root, open it alone in `page`, wait for its kernel; its cells."""
    url, token, root = lab
    write_notebook(root / name, cells)
    workspace = Path(name).stem  # a fresh workspace per notebook: only this notebook opens
    page.goto(f"{url}/lab/workspaces/{workspace}/tree/{name}?reset&token={token}")
    page.wait_for_selector(f"{NOTEBOOK} .jp-Cell")
    page.wait_for_selector(IDLE, timeout=120_000)
    accept_kernel_dialog(page)
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # the notebook gets the whole width
    cells_in_page = page.locator(f"{NOTEBOOK} .jp-Cell")
    cells_in_page.nth(len(cells) - 1).wait_for()
    return cells_in_page


def accept_kernel_dialog(page) -> None:
    """JupyterLab sometimes asks which kernel to start even though the notebook names one (a race between its
    session restore and the notebook opening); accept its preselected choice, as a user would."""
    accept = page.locator(".jp-Dialog .jp-mod-accept")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if accept.count() and accept.first.is_visible():
            accept.first.click()
            page.wait_for_selector(".jp-Dialog", state="detached")
            page.wait_for_selector(IDLE, timeout=120_000)
            return
        page.wait_for_timeout(100)


def run_cell(page, cell, finished: bool = True) -> None:
    """Select the cell, run it (Ctrl+Enter), and wait until it ran (`finished`) or at least started."""
    prompt = cell.locator(".jp-InputPrompt")
    before = prompt.inner_text()
    for _ in range(3):  # a key press can be lost while the notebook is still settling after it opened
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Escape")  # command mode: the cell is selected, not edited
        page.keyboard.press("Control+Enter")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and prompt.inner_text() == before:
            page.wait_for_timeout(100)
        if prompt.inner_text() != before:
            break
    else:
        raise AssertionError("the cell did not start running")
    if finished:
        page.wait_for_function("el => /\\[\\d+\\]/.test(el.innerText)", arg=prompt.element_handle(), timeout=120_000)
