"""The report: runs/<pipeline>/report.html, and each run's executed notebook rendered as notebook.html.

The page (templates/report.html.j2, with report.css and report.js) is fed plain data built here: every
run's status, parameters, the headline numbers its results.nc names (`headlines`), its accuracy by
group and loop (`accuracy_table`) and its figures drawn inline, with links to its data and to its
notebook rendered as HTML (nbconvert; code collapsed under the results). plotly.js is written once
beside the report and every link is relative, so the pipeline folder opens offline wherever it is copied.
"""

from __future__ import annotations

import functools
import hashlib
import html
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..io import HEADLINE_ATTR, RunDir, atomic_write_bytes, headline_of, read_record
from .execute import now
from .keys import expand, library_digest
from .spec import Pipeline, RunJob, load_spec

TEMPLATES = Path(__file__).resolve().parent / "templates"
PLOTLY_JS = "plotly.min.js"  # beside report.html; each run's notebook.html reaches it as ../../plotly.min.js
_SUMMARIES = ".report-summaries.json"  # in runs/<pipeline>/: each run's headline numbers, by results.nc's sha256


# ---- a run's numbers ------------------------------------------------------------------------------------------
@dataclass
class Headline:
    """One number of a run's summary: a stable key, what it is, its value and how the report prints it."""

    key: str
    label: str
    value: float
    text: str


def _headline(name: str, da) -> Headline | None:
    """Return the Headline of one scalar variable (None when it is not a finite number).

    Label: its long_name; text: the value (whole for an integer variable, else 3 decimals), its units
    unless dimensionless ("1"), and its interval when attrs `low` and `high` give one (`interval`: "95%").
    """
    import numpy as np

    if da.size != 1 or not (np.issubdtype(da.dtype, np.number) or da.dtype == bool):
        return None
    value = float(da.values.reshape(()))
    if not np.isfinite(value):
        return None
    units = str(da.attrs.get("units", "")).strip()
    text = (f"{value:.0f}" if np.issubdtype(da.dtype, np.integer) else f"{value:.3f}") + \
        (f" {units}" if units not in ("", "1") else "")
    lo, hi = da.attrs.get("low"), da.attrs.get("high")
    if lo is not None and hi is not None and np.isfinite([float(lo), float(hi)]).all():
        text += f" ({da.attrs.get('interval', '95%')} interval {float(lo):.3f} to {float(hi):.3f})"
    return Headline(name, str(da.attrs.get("long_name", name)), value, text)


def headlines(ds) -> list[Headline]:
    """Return the headline numbers a results Dataset names (`io.headline_of`, in order), labelled by long_name.

    A Dataset that names none (no "headline" attr: written before `io.save_results`, or by code not yet
    converted to it, such as a train run's) and has `loss` over `loop` shows what `evals.loss_headline`
    makes of it: the best loop count r, the loss there and at K.
    """
    if HEADLINE_ATTR not in ds.attrs and "loss" in ds and ds["loss"].dims == ("loop",):
        from ..evals import loss_headline  # imports torch: only for such files, and only when not cached

        ds = loss_headline(ds["loss"], ds.attrs.get("training_loops"))
        names = [str(v) for v in ds.data_vars]
    else:
        names = headline_of(ds)
    return [h for h in (_headline(n, ds[n]) for n in names) if h is not None]


def accuracy_table(ds, max_loops: int = 8) -> tuple[list[str], list[int], list[list[float]]] | None:
    """Return (groups, loops, accuracy[group][loop]) of a run's `group_accuracy`, or None without one.

    Every loop when there are at most max_loops, else loop 1, K, the best loop per mean accuracy and the last.
    """
    import numpy as np

    if "group_accuracy" not in ds or set(ds.group_accuracy.dims) != {"loop", "group"}:
        return None
    acc = ds.group_accuracy.transpose("group", "loop")
    loops = [int(x) for x in acc.loop.values]
    if len(loops) > max_loops:
        K = ds.attrs.get("training_loops")
        mean = np.nan_to_num(acc.mean("group").values, nan=-1)
        keep = {loops[0], loops[-1], loops[int(mean.argmax())]} | ({int(K)} if K is not None and int(K) in loops else set())
        loops = sorted(keep)
    return ([str(g) for g in acc.group.values], loops,
            [[float(acc.sel(group=g, loop=r)) for r in loops] for g in acc.group.values])


def _results_summary(results: Path, cache: dict) -> tuple[list[Headline], Any]:
    """Return (headlines, accuracy_table) of a results.nc, from `cache` when it holds them for this file and library.

    Reading them takes xarray, pandas and h5netcdf (seconds to import) while a finished run's results do
    not change: the entry is keyed by the file's sha256 and the library digest (which covers `headlines`).
    Raises what reading the file raises; an unreadable file is not cached.
    """
    digest = hashlib.sha256(results.read_bytes()).hexdigest()
    name = f"{results.parent.parent.name}/{results.parent.name}"
    hit = cache.get(name)
    if isinstance(hit, dict) and hit.get("sha256") == digest and hit.get("library") == library_digest():
        return [Headline(*h) for h in hit["headlines"]], hit["table"]
    import xarray as xr

    with xr.open_dataset(results, engine="h5netcdf") as ds:
        heads, table = headlines(ds.load()), accuracy_table(ds)
    cache[name] = {"sha256": digest, "library": library_digest(),
                   "headlines": [[h.key, h.label, h.value, h.text] for h in heads], "table": table}
    return heads, table


# ---- the page's data ------------------------------------------------------------------------------------------
class _Figures:
    """The figures of a page: each figure's spec once, and each distinct plotly template once."""

    def __init__(self):
        self.specs: list[dict] = []  # {"id", "spec"}, in page order
        self.templates: dict[str, dict] = {}

    def add(self, path: Path, href: str) -> dict:
        """Return the view of one figure JSON file (its id, height, name and link) after storing its spec."""
        spec = json.loads(path.read_text())
        layout = spec.setdefault("layout", {})
        t = layout.get("template")
        if isinstance(t, dict):  # a plotly template is ~7 kB: store each distinct one once per page
            key = hashlib.sha256(json.dumps(t, sort_keys=True).encode()).hexdigest()[:12]
            self.templates.setdefault(key, t)
            layout["template"] = key
        layout.pop("width", None)  # the page's grid sets the width
        fig_id = f"fig-{len(self.specs)}"
        self.specs.append({"id": fig_id, "spec": spec})
        return {"id": fig_id, "height": int(layout.get("height") or 400), "name": path.stem, "href": href}


def _figure_files(run_dir: Path) -> list[Path]:
    """Return the run's figures/*.json in the order the notebook wrote them (then by name)."""
    files = list(RunDir(run_dir).figures.glob("*.json"))
    return sorted(files, key=lambda f: (f.stat().st_mtime, f.name))


def _shown_params(job: RunJob, root: Path) -> list[tuple[str, str]]:
    """Return (name, JSON value) of a run's parameters, an upstream run folder shown as its key."""
    def shown(v: Any) -> Any:
        if isinstance(v, str) and Path(v).parent.parent == root:
            return f"run {Path(v).name}"
        if isinstance(v, list) and v and str(v[0]).startswith(str(root)):
            return f"{len(v)} runs"
        return v

    return [(str(k), json.dumps(shown(v), default=str)) for k, v in job.params.items()]


def _numbers(run: RunDir, summaries: dict, errors: list[str]) -> tuple[list[dict], dict | None]:
    """Return the views of a run's headline numbers and accuracy table (none without a readable results.nc)."""
    if not run.results.exists():
        return [], None
    try:
        heads, table = _results_summary(run.results, summaries)
    except Exception as e:  # an unreadable file is shown, not fatal to the report
        errors.append(f"{RunDir.RESULTS} could not be read: {e}")
        return [], None
    rows = [{"key": h.key, "label": h.label, "value": repr(h.value), "text": h.text} for h in heads]
    if not table:
        return rows, None
    groups, loops, acc = table
    return rows, {"loops": loops, "rows": [
        {"group": g, "cells": [{"key": f"accuracy[{g}][{r}]", "value": repr(a), "text": f"{a:.3f}"}
                               for r, a in zip(loops, row)]} for g, row in zip(groups, acc)]}


def _links(run: RunDir, rel: Path) -> list[dict]:
    """Return the links of a finished run: its notebook, results, training metrics and record (those present)."""
    rel_run = RunDir(rel)
    out = []
    if run.notebook_html.exists():
        out.append({"href": rel_run.notebook_html.as_posix(), "text": "executed notebook (code and output)",
                    "download": False})
    if run.results.exists():
        out.append({"href": rel_run.results.as_posix(), "text": "results data (netCDF: xarray.open_dataset)",
                    "download": True})
    if run.metrics.exists():
        out.append({"href": rel_run.metrics.as_posix(), "text": "training metrics (netCDF)", "download": True})
    out.append({"href": rel_run.record.as_posix(), "text": "run record (JSON)", "download": False})
    return out


def _run_view(job: RunJob, rec: dict | None, root: Path, figures: _Figures, summaries: dict) -> dict:
    """Return the data of one run's article: state, parameters, numbers, figures and links."""
    rel = Path(job.step) / job.key
    view = {"state": rec["status"] if rec else "pending", "step": job.step, "key": job.key, "rel": rel.as_posix(),
            "params": _shown_params(job, root), "errors": [], "headlines": [], "accuracy": None,
            "figures": [], "links": [],
            "seconds": f"{rec['seconds']:.1f} s" if rec and rec.get("seconds") is not None else ""}
    if not rec:
        return view
    if rec.get("error"):
        view["errors"].append(rec["error"])
    run = RunDir(job.dir)
    view["headlines"], view["accuracy"] = _numbers(run, summaries, view["errors"])
    view["figures"] = [figures.add(f, (RunDir(rel).figures / f.name).as_posix()) for f in _figure_files(job.dir)]
    view["links"] = _links(run, rel)
    return view


# ---- the page ------------------------------------------------------------------------------------------------
def _script_json(value: Any):
    """Return value as JSON that is safe inside a <script> block (no "</" can close it), marked safe for Jinja."""
    from markupsafe import Markup

    return Markup(json.dumps(value).replace("</", "<" + chr(92) + "/"))


@functools.lru_cache(maxsize=1)
def _environment():
    """Return the Jinja environment of the templates folder: autoescape on, block tags trimmed, undefined names fail."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, trim_blocks=True,
                             lstrip_blocks=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["script_json"] = _script_json
    return env


def _write_plotly(root: Path) -> None:
    """Write plotly.min.js beside the report, unless the same file is there already."""
    from plotly.offline import get_plotlyjs

    path, js = root / PLOTLY_JS, get_plotlyjs().encode()
    if not path.exists() or path.stat().st_size != len(js) or path.read_bytes() != js:
        atomic_write_bytes(path, js)


def report(spec: str | os.PathLike | Pipeline, profile: str | None = None,
           runs_dir: str | os.PathLike = "runs") -> Path:
    """Return the path of runs/<pipeline>/report.html after (re)writing it and each run's notebook.html.

    The page shows every run's state, parameters and headline numbers (`headlines`, `accuracy_table`)
    and draws every figure it wrote, from JSON embedded in the page with the plotly.min.js written
    beside it; links are relative, so the pipeline folder opens offline wherever it is copied.
    """
    from ..viz.figures import PLOTLY_MISSING

    pipe = spec if isinstance(spec, Pipeline) else load_spec(spec, profile)
    root = Path(runs_dir).resolve() / pipe.name
    root.mkdir(parents=True, exist_ok=True)
    _write_plotly(root)
    cache_path = root / _SUMMARIES
    try:
        summaries = json.loads(cache_path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: every summary is read again
        summaries = {}
    cached = json.dumps(summaries, sort_keys=True)
    figures, counts, steps = _Figures(), {}, []
    jobs = expand(pipe, runs_dir)
    for step in pipe.steps:
        runs = []
        for job in (j for j in jobs if j.step == step.name):
            rec = read_record(job.dir)
            state = rec["status"] if rec else "pending"
            counts[state] = counts.get(state, 0) + 1
            if rec:
                notebook_html(job.dir, f"../../{PLOTLY_JS}")
            runs.append(_run_view(job, rec, root, figures, summaries))
        steps.append({"name": step.name, "notebook": step.notebook.name, "runs": runs})
    if json.dumps(summaries, sort_keys=True) != cached:
        atomic_write_bytes(cache_path, json.dumps(summaries, sort_keys=True).encode())
    page = _environment().get_template("report.html.j2").render(
        name=pipe.name, profile=pipe.profile, description=pipe.description, spec_path=str(pipe.path),
        tally=", ".join(f"{n} {s}" for s, n in counts.items()), written=now(), plotly_js=PLOTLY_JS,
        plotly_missing=PLOTLY_MISSING, steps=steps, figures=figures.specs, plotly_templates=figures.templates)
    return atomic_write_bytes(root / "report.html", page.encode())


# ---- a run's executed notebook as a page ----------------------------------------------------------------------
# The executed notebook as a report (templates/notebook.html.j2): inputs collapsed under "code" (results
# read first), no In/Out prompts, nothing fetched from the network (no require.js, MathJax or Mermaid
# from a CDN), plotly.js from the pipeline folder, and a visible message where it did not load.
_EXPORT_VERSION = 4  # bump to rewrite older notebook.html files (a change to notebook.html.j2 needs one)
_EXPORT_MARK = f'<meta name="workbench-export" content="{_EXPORT_VERSION}">'
_STAMP_WITHIN = 1024  # bytes of notebook.html searched for its stamp (it follows the doctype)


def _html_stamp(nb_bytes: bytes, plotly_rel: str) -> str:
    """Return the comment notebook.html carries: the export version, plotly's path and the executed notebook's sha256."""
    digest = hashlib.sha256(nb_bytes).hexdigest()
    return f"<!-- workbench-export {_EXPORT_VERSION} plotly={html.escape(plotly_rel)} notebook-sha256={digest} -->"


@functools.lru_cache(maxsize=1)
def _exporter():
    """Return the one HTMLExporter of this process for notebook.html (notebook.html.j2 over JupyterLab's template).

    One per process, not one per page: a new exporter compiles its ten Jinja templates again, a third of the
    time a page took (a pipeline renders every run's notebook in one go).
    """
    import jinja2
    from nbconvert import HTMLExporter

    name = "notebook.html.j2"
    return HTMLExporter(template_name="lab", template_file=f"workbench_{name}",
                        extra_loaders=[jinja2.DictLoader({f"workbench_{name}": (TEMPLATES / name).read_text()})],
                        exclude_input_prompt=True, exclude_output_prompt=True)


def notebook_html(run_dir: Path, plotly_rel: str) -> Path | None:
    """Return the path of run_dir/notebook.html after (re)writing it from the executed notebook (None without one).

    Rendered only when the HTML's stamp (`_html_stamp`: what it was rendered from) differs: nbconvert takes
    about a second per notebook, and a finished run's notebook does not change. The stamp is a comment we
    write ourselves, since nbconvert re-serialises the page's own tags (a <meta> mark never matched), and a
    content hash, not an mtime, so a copied pipeline folder is not re-rendered.
    """
    run = RunDir(run_dir)
    nb_path, out = run.notebook, run.notebook_html
    if not nb_path.exists():
        return None
    stamp = _html_stamp(nb_path.read_bytes(), plotly_rel)
    if out.exists():
        with open(out, "rb") as f:
            if stamp.encode() in f.read(_STAMP_WITHIN):
                return out
    import nbformat

    from ..viz.figures import PLOTLY_MISSING

    body, _ = _exporter().from_notebook_node(
        nbformat.read(nb_path, as_version=4),
        resources={"wb_plotly": plotly_rel, "wb_mark": _EXPORT_MARK,
                   "wb_missing": html.escape(f"{PLOTLY_MISSING} (looked for {plotly_rel})")})
    # after the doctype: a comment before it would put browsers in quirks mode
    head, _, rest = body.partition("\n")
    body = f"{head}\n{stamp}\n{rest}" if head.lstrip().lower().startswith("<!doctype") else f"{stamp}\n{body}"
    atomic_write_bytes(out, body.encode())
    return out
