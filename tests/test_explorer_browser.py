"""What a person sees, in a real browser (headless Chromium): the explorer in JupyterLab 4 (the slider
moves by keyboard and the page's plot and predictions change), and a smoke pipeline's report and
executed notebook opened offline from a folder they were moved to. Each test asserts what one would
read (figure count, axis titles, plot areas with marks in them, no HTML entities shown literally, the
summary numbers of the runs' results.nc) and leaves screenshots under its temporary folder
(explorer_loop1.png, explorer_loop5.png, report.png, notebook.png, notebook_without_plotly.png).

The server runs on 127.0.0.1 with a token, a free port (no retries), fresh config, settings and
workspaces in a temp dir, and a temp copy of the notebook as its root (with a 5-step tiny model, so
the run takes seconds). A warm-up notebook runs first (first page load, kernel start, imports);
a run-all the kernel swallows is retried. The page loads plotly's widget module slowly for the first two
figures (SLOW_MODULE), as a loaded machine does, and every plot must still be drawn. Only the processes this test started are stopped, by PID.
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

from workbench.viz.explorer import DEFAULT_TEXT

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                 reason=f"{CHROMIUM} is absent (Debian's chromium; `.ci/run` installs it)")]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
FIRST_RENDER_MS = 180_000  # first kernel start, torch import and training, on two shared cores
# anywidget imports a widget's module (plotly's: 5 MB) afresh for every model and gives it 2 s; a model whose
# load takes longer drops every message from the kernel for good, and its views stay as the widget was opened:
# blank (CI runs on loaded machines). This makes the first two loads of plotly's module take 3 s more, as on a
# loaded laptop; workbench.viz.figure_sync must replace those figures.
SLOW_MODULE = """(() => {
  const Original = window.Blob;
  window.__wbSlowedLoads = 0;
  function Blob(parts, options) {
    if (options && options.type === 'text/javascript' && parts && parts.length === 1 && typeof parts[0] === 'string'
        && parts[0].includes('FigureModel') && window.__wbSlowedLoads < 2) {
      window.__wbSlowedLoads += 1;
      parts = ['await new Promise(r => setTimeout(r, 3000));\\n' + parts[0]];
    }
    return new Original(parts, options);
  }
  Blob.prototype = Original.prototype;
  window.Blob = Blob;
})();"""


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


# what a person sees of every plotly plot on the page: drawn marks (lines, points, heatmap images, bars)
# and axis titles; `sel` narrows it to the plots under one element
PLOTS_SEEN = """sel => Array.from(document.querySelectorAll(
    sel ? sel + '.js-plotly-plot, ' + sel + ' .js-plotly-plot' : '.js-plotly-plot')).map(gd => {
  const marks = Array.from(gd.querySelectorAll(
      '.scatterlayer path.js-line, .scatterlayer path.point, .heatmaplayer image, .barlayer path'))
    .filter(m => (m.getAttribute('d') || m.getAttribute('href') || m.getAttribute('xlink:href') || '').length > 10);
  const titles = Array.from(gd.querySelectorAll('.infolayer g[class^="g-"][class$="title"]:not(.g-gtitle) text'))
    .map(t => t.textContent.trim()).filter(Boolean);
  const box = gd.getBoundingClientRect();
  return {marks: marks.length, titles: titles, width: box.width, height: box.height,
          title: (gd.querySelector('.gtitle') || {textContent: ''}).textContent,
          traces: (gd.data || []).length}; })"""


def assert_readable(plots: list, where: str) -> None:
    """Every plot is drawn (marks inside a non-empty area) and has axis titles."""
    assert plots, f"{where}: no plot on the page"
    for p in plots:
        assert p["width"] > 100 and p["height"] > 100, (where, p)
        assert p["marks"] > 0, f"{where}: plot {p['title']!r} is blank: {p}"
        assert p["titles"], f"{where}: plot {p['title']!r} has no axis title"


TRAJECTORY = """() => { const el = document.querySelector('.wb-explorer-trajectory');
  const gd = el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot');
  return {colorbars: Array.from(gd.querySelectorAll('.colorbar'))
            .map(c => (c.querySelector('.cbtitle') || {textContent: ''}).textContent),
          k_colour: gd._fullData[2].marker.color}; }"""


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
                                                   headless=True, args=ARGS, viewport={"width": 1500, "height": 1700})
        page = ctx.new_page()
        page.add_init_script(SLOW_MODULE)
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
            # the first two figures' module loads were slowed past anywidget's limit (SLOW_MODULE), and yet
            # every plot is drawn with its traces
            assert page.evaluate("() => window.__wbSlowedLoads") == 2
            for name in ("predictions", "curves", "heatmap", "trajectory"):  # every plot drawn, with its traces
                page.wait_for_function(f"() => {{ const r = ({PLOT})('.wb-explorer-{name}');"
                                       "return r && r.data !== '[]'; }", timeout=60_000)
            page.wait_for_function(f"() => {{ const r = ({PLOT})('.wb-explorer-predictions');"
                                   "return r && r.text.includes('at loop'); }", timeout=60_000)
            assert "Error displaying widget" not in page.inner_text("body")
            assert page.locator(".wb-explorer .wb-explorer-trajectory").count() == 1
            pos0 = page.inner_text(".wb-explorer-position")
            pred0, curves0 = page.evaluate(PLOT, ".wb-explorer-predictions"), page.evaluate(PLOT, ".wb-explorer-curves")
            heat0 = page.evaluate(PLOT, ".wb-explorer-heatmap")
            assert "loop 1 of 16" in pos0, pos0
            # the slider marks K, the model box says which model is shown, and every 2-D plot reads
            k_mark = page.evaluate("() => getComputedStyle(document.querySelector("
                                   "'.wb-explorer-slider .noUi-target'), '::before').content")
            assert "K=4" in k_mark, k_mark
            assert "tiny byte-level model" in page.get_attribute(".wb-explorer .widget-text input", "placeholder")
            assert "true next" in pred0["text"]  # the default token's next token is known
            for name in ("predictions", "curves", "heatmap"):
                assert_readable(page.evaluate(PLOTS_SEEN, f".wb-explorer-{name}"), name)
            assert "&quot;" not in page.inner_text(".wb-explorer") and "&amp;" not in page.inner_text(".wb-explorer")
            # the trajectory: one colour key (the loop), and the K diamond keeps its colour
            traj = page.evaluate(TRAJECTORY)
            assert traj["colorbars"] == ["loop"] and traj["k_colour"] == "#2ca02c", traj
            page.locator(".wb-explorer").screenshot(path=str(tmp_path / "explorer_loop1.png"))

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
            for name in ("predictions", "curves", "heatmap"):
                assert_readable(page.evaluate(PLOTS_SEEN, f".wb-explorer-{name}"), name)
            page.locator(".wb-explorer").screenshot(path=str(tmp_path / "explorer_loop5.png"))  # for a person
            # the token before the prompt's first quote: its subtitle shows the quote, not &quot;
            text = DEFAULT_TEXT
            i = text.index('"') - 1
            page.locator(".wb-explorer .widget-dropdown select").select_option(label=f"{i}: ␣")
            page.wait_for_function(f"() => ({PLOT})('.wb-explorer-predictions').text.includes('(position {i})')",
                                   timeout=60_000)
            title = page.evaluate(PLOT, ".wb-explorer-predictions")["text"]
            assert 'true next ":' in title and "&quot;" not in title, title
        except Exception:
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            print(page.evaluate(OUTLINE))
            for name in ("predictions", "curves", "heatmap"):  # what each plot showed, title included
                print(name, str(page.evaluate(PLOT, f".wb-explorer-{name}"))[:600])
            print("\n".join(log[-40:]))
            print((tmp_path / "server.log").read_text()[-4000:])
            raise
        finally:
            ctx.close()
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)


# ---- the pipeline report and an executed notebook ----------------------------------------------------------
DRAWN = "() => document.body.getAttribute('data-plots-drawn') === '1'"
NUMBERS = """() => Array.from(document.querySelectorAll('article[data-run]')).map(a => ({
  run: a.getAttribute('data-run'),
  numbers: Array.from(a.querySelectorAll('.wb-num')).map(n => [n.getAttribute('data-key'),
                                                              Number(n.getAttribute('data-value')), n.textContent]),
  plots: a.querySelectorAll('.js-plotly-plot').length}))"""


def expected_numbers(results) -> dict:
    """The report's headline numbers of a run, read from its results.nc here the obvious way.

    Keyed by the variables a run's results.nc names as its headline (io.save_results); a train run,
    which names none yet, shows the loss numbers the report falls back to (evals.loss_headline's names).
    """
    import numpy as np
    import xarray as xr

    ds = xr.load_dataset(results, engine="h5netcdf")
    out = {}
    if "loss" in ds and ds.loss.dims == ("loop",):
        loops, loss = list(ds.loop.values), ds.loss.values
        best = min(range(len(loss)), key=lambda j: loss[j])
        out["best_r"], out["loss_at_best"] = loops[best], loss[best]
        out["loss_at_K"] = loss[loops.index(int(ds.attrs["training_loops"]))]
    if "test_time_L_inf" in ds:
        for n in ("L_inf", "Z", "z"):
            out[f"test_time_{n}"] = float(ds[f"test_time_{n}"])
        out["test_time_fit_upto"] = int(ds.test_time_fit_upto)
    if "lost" in ds:
        out["lost_1"] = float(ds.lost.sel(k=1))
        out["rho"] = float(ds.attrs["rho"])
        out["loops"] = int(ds.attrs["loops"])
    if "terminal_to_core" in ds and np.isfinite(float(ds.terminal_to_core)):
        out["terminal_to_core"] = float(ds.terminal_to_core)
    if "angular_distance" in ds and ds.angular_distance.dims == ("loop",):
        out["angle_first"], out["angle_last"] = (float(ds.angular_distance.values[j]) for j in (0, -1))
    return out


def open_offline(p, tmp_path, log: list):
    """Return a Chromium context that refuses every request leaving the machine (and notes each one)."""
    ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
                                               args=ARGS, viewport={"width": 1300, "height": 1000})

    def route(r):
        if r.request.url.startswith("file:"):
            r.continue_()
        else:
            log.append(f"blocked {r.request.url}")
            r.abort()

    ctx.route("**/*", route)
    return ctx


@pytest.fixture
def moved_quickstart(smoke_quickstart, tmp_path):
    """Yield a copy of the session's smoke quickstart folder, elsewhere, while the original is hidden.

    The report and notebooks must not lean on where they were made: while this test reads the copy, the
    folder they were made in does not exist under its name (renamed back afterwards, for other readers).
    """
    runs, result = smoke_quickstart
    assert result.ok, result.summary()
    moved = tmp_path / "elsewhere" / "copy of quickstart"
    shutil.copytree(runs / "quickstart", moved)
    hidden = runs.with_name(runs.name + ".hidden")
    os.replace(runs, hidden)
    try:
        yield moved
    finally:
        os.replace(hidden, runs)


def test_report_and_notebook_read_offline_wherever_the_folder_goes(moved_quickstart, tmp_path):
    import nbformat
    from playwright.sync_api import sync_playwright

    moved = moved_quickstart
    runs = {f"{d.parent.name}/{d.name}": d for d in moved.glob("*/*") if (d / "run.json").exists()}
    n_figures = {k: len(list((d / "figures").glob("*.json"))) for k, d in runs.items()}
    assert len(runs) == 4 and all(n_figures.values())
    log: list[str] = []
    with sync_playwright() as p:
        ctx = open_offline(p, tmp_path, log)
        page = ctx.new_page()
        page.on("pageerror", lambda e: log.append(f"pageerror: {e}"[:300]))
        try:
            page.goto((moved / "report.html").as_uri())
            page.wait_for_function(DRAWN, timeout=60_000)
            seen = page.evaluate(NUMBERS)
            # one drawn plot per figure each run wrote, every one readable
            assert {a["run"]: a["plots"] for a in seen} == n_figures
            plots = page.evaluate(PLOTS_SEEN, "")
            assert len(plots) == sum(n_figures.values())
            assert_readable(plots, "report")
            body = page.inner_text("body")
            assert "&quot;" not in body and "did not load" not in body
            # the headline numbers are the runs' results.nc numbers, printed as they are
            for a in seen:
                want = expected_numbers(runs[a["run"]] / "results.nc")
                got = {k: (v, text) for k, v, text in a["numbers"]}
                assert set(want) <= set(got), (a["run"], sorted(want), sorted(got))
                for k, v in want.items():
                    assert got[k][0] == pytest.approx(float(v), rel=1e-12), (a["run"], k)
                    whole = k in ("best_r", "test_time_fit_upto", "loops")
                    text = f"{float(v):.0f}" if whole else f"{float(v):.3f}"
                    assert got[k][1].startswith(text), (a["run"], k, got[k][1])
            # the test-time fit says what it was fitted on, in the legend of its plot
            legends = page.evaluate("() => Array.from(document.querySelectorAll('.legendtext')).map(t => t.textContent)")
            assert any("fitted on loops 1..4" in t for t in legends), legends
            # links are named as data and stay inside the folder
            hrefs = page.evaluate("() => Array.from(document.querySelectorAll('a')).map(a => [a.textContent, "
                                  "a.getAttribute('href')])")
            assert any(t.startswith("results data (netCDF") for t, _ in hrefs)
            assert all(not h.startswith(("/", "http")) for _, h in hrefs if h and not h.startswith("#")), hrefs
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)

            # an executed notebook reads as a report: results first, code collapsed, no echoes
            key = next(k for k in runs if k.startswith("loop_sweep/"))
            page.goto((runs[key] / "notebook.html").as_uri())
            page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= "
                                   f"{n_figures[key]}", timeout=60_000)
            nb = nbformat.read(runs[key] / "notebook.ipynb", as_version=4)
            closed = page.evaluate("() => Array.from(document.querySelectorAll('details.wb-code')).filter("
                                   "d => !d.open).length")
            assert closed == sum(c.cell_type == "code" for c in nb.cells)
            text = page.inner_text("body")
            assert "Out[" not in text and "PosixPath" not in text and "import " not in text  # no code in sight
            assert_readable(page.evaluate(PLOTS_SEEN, ""), "notebook")
            page.screenshot(path=str(tmp_path / "notebook.png"), full_page=True)

            # the same page copied out alone: its plots say plotly.js is missing instead of staying blank
            alone = tmp_path / "alone"
            alone.mkdir()
            shutil.copy(runs[key] / "notebook.html", alone / "notebook.html")
            page.goto((alone / "notebook.html").as_uri())
            page.wait_for_selector("#wb-plotly-banner:not([hidden])", timeout=30_000)
            assert page.locator(".wb-plot .wb-plotly-missing").count() == n_figures[key]
            page.screenshot(path=str(tmp_path / "notebook_without_plotly.png"))
            assert not [m for m in log if m.startswith("blocked")], log  # nothing asked for the network
        except Exception:
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            print("\n".join(log[-40:]))
            raise
        finally:
            ctx.close()
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)
