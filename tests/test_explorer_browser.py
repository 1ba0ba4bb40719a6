"""The explorer in a real browser: JupyterLab 4 + headless Chromium run explorer.ipynb, the slider moves
by keyboard, and the page's plot and predictions change.

The server runs on 127.0.0.1 with a token, a free port (no retries), fresh config, settings and
workspaces in a temp dir, and a temp copy of the notebook as its root (with a 5-step tiny model, so
the run takes seconds). A warm-up notebook runs first (first page load, kernel start, imports);
a run-all the kernel swallows is retried. Only the processes this test started are stopped, by PID.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"{CHROMIUM} is absent (Debian's chromium; `.ci/run` installs it)")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
FIRST_RENDER_MS = 180_000  # first kernel start, torch import and training, on two shared cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(base: str, token: str, path: str, method: str = "GET"):
    req = urllib.request.Request(f"{base}{path}", method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


def stop(proc: subprocess.Popen, base: str, token: str) -> None:
    """Stop the server and the kernels it started, each by PID (kernels run in their own sessions)."""
    import psutil

    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    try:
        api(base, token, "/api/shutdown", "POST")  # shuts kernels down cleanly too
        proc.wait(timeout=15)
    except Exception:
        pass
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for k in kids:
        try:
            k.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture
def lab(tmp_path):
    """Yield (base url, token, root dir) of a fresh JupyterLab serving a copy of explorer.ipynb."""
    root, cfg = tmp_path / "root", tmp_path / "jupyter"
    root.mkdir()
    nb = json.loads((ROOT / "notebooks" / "explorer.ipynb").read_text())
    params = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    src = "".join(params["source"])
    assert "train_steps: int = 120" in src and "max_loops: int = 16" in src
    params["source"] = src.replace("train_steps: int = 120", "train_steps: int = 5")
    (root / "explorer.ipynb").write_text(json.dumps(nb))
    warm = {"cells": [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                       "source": "import workbench.viz.explorer, plotly, ipywidgets, anywidget\n'warm'"}],
            "metadata": nb["metadata"], "nbformat": 4, "nbformat_minor": 5}
    (root / "warmup.ipynb").write_text(json.dumps(warm))
    # user settings: render every cell (no windowing, so below-the-fold widgets exist and measure) and
    # no news prompt over the page
    settings = cfg / "settings" / "@jupyterlab"
    for plugin, values in {"notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
                           "apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"}}.items():
        (settings / plugin).parent.mkdir(parents=True, exist_ok=True)
        (settings / plugin).write_text(json.dumps(values))
    port, token = free_port(), os.urandom(16).hex()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(cfg / "config"), "JUPYTER_RUNTIME_DIR": str(cfg / "runtime"),
           "JUPYTER_DATA_DIR": str(cfg / "data"), "IPYTHONDIR": str(cfg / "ipython"),
           "JUPYTER_PLATFORM_DIRS": "1", "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", "--ServerApp.open_browser=False",
         f"--ServerApp.root_dir={root}", f"--LabApp.workspaces_dir={cfg / 'workspaces'}",
         f"--LabApp.user_settings_dir={cfg / 'settings'}", "--LabApp.expose_app_in_browser=True",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly"]  # nothing may reach out to the network
        + (["--allow-root"] if os.geteuid() == 0 else []),
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:  # warm the server: API first, then the lab page itself (templates, static files)
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited: {(tmp_path / 'server.log').read_text()[-3000:]}")
            try:
                api(base, token, "/api/status")
                urllib.request.urlopen(f"{base}/lab?token={token}", timeout=30).read()
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail(f"jupyter lab did not answer in 60 s: {(tmp_path / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, token, root
    finally:
        stop(proc, base, token)
        log.close()


KERNEL_STATUS = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return k ? k.status : null; }"""
FIRST_PROMPT = """() => { const p = document.querySelector(
  '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt');
  return p ? p.textContent : null; }"""


def open_and_run(page, path: str, log: list) -> None:
    """Open a notebook in the running lab and run all its cells, retrying a run the kernel swallows."""
    page.evaluate("p => window.jupyterapp.commands.execute('docmanager:open', {path: p})", path)
    page.wait_for_function(f"() => document.title.includes({json.dumps(path)})", timeout=60_000)
    for attempt in range(3):
        deadline = time.time() + 120
        while page.evaluate(KERNEL_STATUS) != "idle":  # a kernel still starting drops the request
            if page.locator(".jp-Dialog .jp-mod-accept").count():  # e.g. "select kernel": take the default
                page.locator(".jp-Dialog .jp-mod-accept").first.click()
            if time.time() > deadline:
                break
            page.wait_for_timeout(500)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        try:  # the parameters / import cell finishes in moments once the kernel really runs it
            page.wait_for_function(f"() => /\\[[0-9]+\\]/.test(({FIRST_PROMPT})() || '')", timeout=60_000)
            return
        except Exception:
            log.append(f"run-all of {path} swallowed (attempt {attempt + 1}, kernel "
                       f"{page.evaluate(KERNEL_STATUS)}, prompt {page.evaluate(FIRST_PROMPT)!r})")
    pytest.fail(f"run-all of {path} never executed: {log}")


# the FigureWidget's element is plotly's graph div itself (anywidget), or holds it
PLOT = """sel => { const el = document.querySelector(sel);
  const gd = el && (el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot'));
  if (!gd || !gd.data) return null;
  return {data: JSON.stringify(gd.data.map(t => [t.x, t.y])), svg: gd.querySelector('.main-svg') ?
          Array.from(gd.querySelectorAll('.scatterlayer .points path, .barlayer path'))
               .map(p => (p.getAttribute('transform') || '') + (p.getAttribute('d') || '')).join('|') : null,
          bars: Array.from(gd.querySelectorAll('.barlayer text, .ytick text')).map(t => t.textContent).join('|'),
          text: gd.textContent}; }"""


OUTLINE = """() => { const out = [];
  const walk = (e, d) => { if (d > 9 || out.length > 150) return;
    out.push(' '.repeat(d) + e.tagName.toLowerCase() + '.' + (e.getAttribute('class') || '').split(' ').join('.'));
    for (const c of e.children) if (c.tagName !== 'svg' && c.tagName !== 'SELECT') walk(c, d + 1); };
  const root = document.querySelector('.wb-explorer'); if (root) walk(root, 0); return out.join('\\n'); }"""


def test_explorer_runs_in_jupyterlab_and_the_slider_moves_the_plots(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    base, token, root = lab
    log: list[str] = []
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                   headless=True, args=ARGS, viewport={"width": 1500, "height": 1100})
        page = ctx.new_page()
        page.on("console", lambda m: log.append(f"console.{m.type}: {m.text}"[:300]) if m.type == "error" else None)
        page.on("pageerror", lambda e: log.append(f"pageerror: {e}"[:300]))
        try:
            page.goto(f"{base}/lab?token={token}", timeout=120_000)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started !== undefined",
                                   timeout=120_000)
            page.wait_for_selector(".jp-LabShell", timeout=120_000)
            # warm-up: kernel start and the explorer's imports, so the timed waits below are about the explorer
            open_and_run(page, "warmup.ipynb", log)
            page.wait_for_function("() => document.body.innerText.includes(\"'warm'\")", timeout=FIRST_RENDER_MS)
            for s in api(base, token, "/api/sessions"):  # free the two shared cores for the real run
                if s["path"].endswith("warmup.ipynb"):
                    api(base, token, f"/api/sessions/{s['id']}", "DELETE")

            open_and_run(page, "explorer.ipynb", log)
            for name in ("predictions", "curves", "heatmap"):
                page.wait_for_selector(f".wb-explorer .wb-explorer-{name} .main-svg",
                                       state="attached", timeout=FIRST_RENDER_MS)
            page.locator(".wb-explorer .widget-slider").first.scroll_into_view_if_needed()
            page.wait_for_function(f"() => {{ const r = ({PLOT})('.wb-explorer-predictions');"
                                   "return r && r.text.includes('at loop'); }", timeout=60_000)
            assert "Error displaying widget" not in page.inner_text("body")
            assert page.locator(".wb-explorer .wb-explorer-trajectory").count() == 1
            pos0 = page.inner_text(".wb-explorer-position")
            pred0, curves0 = page.evaluate(PLOT, ".wb-explorer-predictions"), page.evaluate(PLOT, ".wb-explorer-curves")
            heat0 = page.evaluate(PLOT, ".wb-explorer-heatmap")
            assert "loop 1 of 16" in pos0, pos0

            handle = page.locator(".wb-explorer .widget-slider .noUi-handle").first
            handle.focus()
            for _ in range(4):
                page.keyboard.press("ArrowRight")
            page.wait_for_function("() => document.querySelector('.wb-explorer-position').textContent"
                                   ".includes('loop 5 of 16')", timeout=60_000)
            page.wait_for_function(f"() => ({PLOT})('.wb-explorer-predictions').text.includes('at loop 5')",
                                   timeout=60_000)
            page.wait_for_function(f"() => ({PLOT})('.wb-explorer-curves').data !== {json.dumps(curves0['data'])}",
                                   timeout=60_000)
            pred1, curves1 = page.evaluate(PLOT, ".wb-explorer-predictions"), page.evaluate(PLOT, ".wb-explorer-curves")
            # the plot changed: the cursor markers sit at loop 5 and are drawn elsewhere in the SVG
            cursor = json.loads(curves1["data"])[2][0]
            assert cursor == [5], cursor
            assert curves1["svg"] != curves0["svg"]
            # the predictions changed: other probabilities (and bar geometry) at loop 5 than at loop 1
            assert pred1["data"] != pred0["data"] and pred1["svg"] != pred0["svg"]
            assert pred1["bars"] and pred1["bars"] != pred0["bars"], (pred0["bars"], pred1["bars"])  # what one reads
            assert "extrapolating 1 loop past K" in page.inner_text(".wb-explorer-position")
            # the slider only re-sliced: the heatmap (one trace's data) is untouched
            assert page.evaluate(PLOT, ".wb-explorer-heatmap")["data"] == heat0["data"]
            page.locator(".wb-explorer").screenshot(path=str(tmp_path / "explorer.png"))  # for a person to look at
        except Exception:
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            print(page.evaluate(OUTLINE))
            print("\n".join(log[-40:]))
            print((tmp_path / "server.log").read_text()[-4000:])
            raise
        finally:
            ctx.close()
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)
