"""Static plotly figures built from result Datasets (nothing here computes), and `show` for notebooks.

Pipeline notebooks draw `go.Figure`s, never `FigureWidget`s (a saved widget embeds ~5 MB of plotly.js
in every saved notebook). `show` displays a figure as plotly's JSON mimetype (JupyterLab renders it)
plus an HTML div (`plot_html`) that draws it with the page's plotly.js, or says in the page that
plotly.js is missing: the pipeline report loads plotly.js once per pipeline, so the HTML of every run
stays small and opens offline.

Readability rules every builder keeps (tests/test_figures.py checks them): one quantity per axis or
panel (two quantities whose sizes differ by more than 10x never share a linear axis), axis titles
with units, integer ticks on loop, lag and step axes, and a fitted or predicted curve labelled with
what it was fitted on. Each trace's `meta` names the quantity it draws.
"""

from __future__ import annotations

import html
import json
import math
import os
import uuid
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..io import RunDir, atomic_write_bytes

# legends sit under the plot: above it they collide with the title once the names are long
_LAYOUT = dict(template="plotly_white", height=430, margin=dict(l=75, r=25, t=50, b=110),
               legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0, font=dict(size=11)),
               title=dict(font=dict(size=15), x=0.01, xanchor="left", y=0.98, yanchor="top"))

# axis titles (with units) of the quantities the probes and evals write, by variable name
QUANTITY = {
    "loss": "loss (nats/token)",
    "loss_fit": "loss (nats/token)",
    "train_loss": "loss (nats/token)",
    "accuracy": "accuracy (fraction)",
    "group_accuracy": "accuracy (fraction)",
    "task_accuracy": "accuracy (fraction)",
    "knowledge_accuracy": "accuracy (fraction)",
    "angular_distance": "angular distance a(x(t−1), x(t)) (π rad)",
    "relative_update": "relative update |x(t)−x(t−1)| / |x(t−1)| (fraction)",
    "state_variance": "V(x(t)) / V(x(K)) (ratio)",
    "kl_prev": "KL(p_t ‖ p_t−1) (nats)",
    "interaction_by_lag": "mean C (fraction of the update |u_j|)",
    "lost": "lost(k) = |g − G_k| / |g| (fraction)",
    "one_minus_cos": "1 − cos(g, G_k) (fraction)",
    "adjoint_norm": "|∂L/∂h_t| (log scale)",
    "lost_half": "lost(⌈r/2⌉) = |g − G_k| / |g| at k = ⌈r/2⌉ (fraction)",
}
INTEGER_DIMS = ("loop", "lag", "k", "depth", "layer", "step", "eval_step", "state", "r")  # counted things

PLOTLY_MISSING = ("This plot needs plotly.js, which did not load. The pipeline writes plotly.min.js beside its "
                  "report.html: open this page from its pipeline folder (copy the whole folder), or rerun the "
                  "notebook in Jupyter.")


def _fig(title: str, x: str, y: str, **layout) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title_text=title, xaxis_title=x, yaxis_title=y, **{**_LAYOUT, **layout})
    if layout.get("showlegend") is False and "margin" not in layout:
        fig.update_layout(margin_b=60)  # no legend to make room for
    return fig


def integer_ticks(values, max_ticks: int = 12) -> dict:
    """Return x/y-axis settings that put ticks on whole numbers only (1, 2, 5 x 10^n apart) for these values."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    span = float(v.max() - v.min()) if v.size else 1.0
    step = 1
    for mult in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000):
        step = mult
        if span / mult <= max_ticks:
            break
    else:
        step = int(10 ** math.ceil(math.log10(max(span / max_ticks, 1))))
    return dict(tickmode="linear", tick0=0 if step > 1 else float(v.min()) if v.size else 0, dtick=step,
                tickformat="d")


def _is_integer_coord(x) -> bool:
    a = np.asarray(x)
    if a.size == 0 or a.dtype.kind not in "iuf":
        return False
    a = a.astype(float)
    return bool(np.all(np.isfinite(a)) and np.all(a == np.round(a)))


def save(fig: go.Figure, name: str, out_dir: str | os.PathLike) -> Path:
    """Return the path of `figures/<name>.json` under out_dir after writing the figure's JSON there."""
    return atomic_write_bytes(RunDir(out_dir).figures / f"{name}.json", fig.to_json().encode())


def plot_html(figure, div_id: str | None = None, height: int | None = None) -> str:
    """Return an HTML div and script that draw a figure (go.Figure, dict or JSON) with the page's plotly.js.

    Where plotly.js is missing the div shows `PLOTLY_MISSING` instead of staying silently blank.
    """
    if isinstance(figure, go.Figure):
        spec = figure.to_plotly_json()
        text = figure.to_json()
    else:
        spec = json.loads(figure) if isinstance(figure, (str, bytes)) else figure
        text = json.dumps(spec)
    h = height or (spec.get("layout") or {}).get("height") or 400
    div_id = div_id or f"wb-plot-{uuid.uuid4().hex[:12]}"
    # "</" inside a <script> would end it early; JSON allows the escaped form
    text = text.replace("</", "<\\/")
    missing = json.dumps(f'<p class="wb-plotly-missing" style="color:#b00020;border:1px solid #b00020;'
                         f'padding:8px">{html.escape(PLOTLY_MISSING)}</p>')
    return (f'<div id="{div_id}" class="wb-plot" style="height:{int(h)}px;width:100%"></div>\n'
            f'<script>(function () {{ var el = document.getElementById("{div_id}"); if (!el) return;\n'
            f'  if (typeof window.Plotly === "undefined") {{ el.style.height = "auto"; el.innerHTML = {missing}; return; }}\n'
            f'  var f = {text};\n'
            f'  window.Plotly.newPlot(el, f.data, f.layout, {{responsive: true, displaylogo: false}}); }})();</script>')


def show(fig: go.Figure, name: str | None = None, out_dir: str | os.PathLike | None = None) -> None:
    """Return None after displaying the figure (and saving it as `figures/<name>.json` under out_dir when given).

    Returns nothing so that a `show(...)` ending a cell leaves no `Out[n]:` echo in the notebook.
    """
    from IPython.display import display

    display({"application/vnd.plotly.v1+json": fig.to_plotly_json(), "text/html": plot_html(fig)}, raw=True)
    if name is not None and out_dir is not None:
        save(fig, name, out_dir)


def mark_horizon(fig: go.Figure, K: int | float | None, label: str = "K (training loops)") -> go.Figure:
    """Return the figure with a dashed vertical line at the training loop count K on every panel."""
    if K is None or not K > 0:
        return fig
    fig.add_vline(x=K, line_dash="dash", line_color="gray", row="all", col="all")
    # the label once, inside the top (or only) panel, beside the line
    fig.add_annotation(x=K, y=1, xref="x", yref="y domain", text=label, showarrow=False, xanchor="left",
                       yanchor="top", font=dict(size=11, color="gray"))
    return fig


def _line(x, y, name: str, quantity: str, **kw) -> go.Scatter:
    kw.setdefault("mode", "lines+markers")
    return go.Scatter(x=np.asarray(x), y=np.asarray(y, dtype=float), name=name, meta=quantity, **kw)


def loss_by_loop(ds, var: str = "loss", K: int | None = None, by: str | None = None,
                 title: str = "Loss across loop counts", y_title: str | None = None) -> go.Figure:
    """Return a line per value of `by` (or one line) of ds[var] against ds.loop, with K marked."""
    quantity = y_title or QUANTITY.get(var) or ds[var].attrs.get("long_name", var)
    fig = _fig(title, "loops r", quantity)
    da = ds[var]
    groups = [(None, da)] if by is None else [(v, da.sel({by: v})) for v in da[by].values]
    for label, sub in groups:
        extra = [d for d in sub.dims if d != "loop"]
        if extra:  # average anything else (e.g. depth) so one line per group remains
            sub = sub.mean(extra)
        fig.add_trace(_line(sub.loop.values, sub.values, var if label is None else f"{by}={label}", quantity))
    fig.update_xaxes(**integer_ticks(ds.loop.values))
    # a group's name shows even when it is the only one; without groups there is no legend to make room for
    fig.update_layout(showlegend=by is not None, margin_b=110 if by is not None else 60)
    if quantity.startswith("accuracy") or "accuracy (fraction)" in quantity:
        fig.update_yaxes(range=[-0.02, 1.02])  # a fraction: the whole 0..1, so flat zeros read as zero
    return mark_horizon(fig, K if K is not None else ds.attrs.get("training_loops"))


def task_accuracy(ds, K: int | None = None, beyond: bool = False) -> go.Figure:
    """Return group accuracy per loop count (at the trained depths, or past them) with each group's chance dotted beside it."""
    from plotly.colors import qualitative

    var = "group_accuracy_beyond" if beyond else "group_accuracy"
    title = ("Task accuracy per loop count, past the deepest trained depth" if beyond
             else "Task accuracy per loop count, at the trained depths")
    quantity = QUANTITY["group_accuracy"]
    fig = loss_by_loop(ds, var, K=K, by="group", title=title, y_title=quantity)
    chance, loops, palette = var.replace("accuracy", "chance"), ds.loop.values, qualitative.Plotly
    kept, chances = [], []
    for i, (g, trace) in enumerate(zip(ds.group.values, fig.data)):
        if not np.isfinite(np.asarray(trace.y, dtype=float)).any():
            continue  # a group with no examples here (knowledge has no depth past its training)
        trace.line.color = palette[i % len(palette)]  # the group's accuracy and its chance line share a colour
        kept.append(trace)
        c = float(ds[chance].sel(group=g)) if chance in ds else float("nan")
        if np.isfinite(c):
            chances.append(_line([loops.min(), loops.max()], [c, c], f"chance, group={g} ({c:.3f})", quantity,
                                 mode="lines", line=dict(color=trace.line.color, dash="dot")))
    fig.data = kept
    for trace in chances:
        fig.add_trace(trace)
    return fig


def lm_eval_accuracy(ds, K: int | None = None,
                     title: str = "lm-eval multiple-choice accuracy per loop count, with the workbench's exact match"
                     ) -> go.Figure:
    """Return lm-eval's `acc` per task against loop count (solid), the workbench's `exact_match_wb` dotted in its colour.

    `ds` is an `experiments.lm_eval.lm_eval_run` Dataset; tasks without an accuracy (text) are left out.
    """
    from plotly.colors import qualitative

    quantity = "accuracy (fraction of questions)"
    fig = _fig(title, "loops r", quantity, margin_b=110)
    palette, loops = qualitative.Plotly, ds.loop.values
    shown = [t for t in ds.task.values if "acc" in ds and np.isfinite(ds.acc.sel(task=t).values).any()]
    for i, t in enumerate(shown):
        color = palette[i % len(palette)]
        fig.add_trace(_line(loops, ds.acc.sel(task=t).values, f"{t} (lm-eval)", quantity, line=dict(color=color)))
        if "exact_match_wb" in ds and np.isfinite(ds.exact_match_wb.sel(task=t).values).any():
            fig.add_trace(_line(loops, ds.exact_match_wb.sel(task=t).values, f"{t} (workbench exact match)",
                                quantity, line=dict(color=color, dash="dot")))
    fig.update_xaxes(**integer_ticks(loops))
    fig.update_yaxes(range=[-0.02, 1.02])
    return mark_horizon(fig, K if K is not None else ds.attrs.get("training_loops"))


def loss_with_fit(ds, K: int | None = None, title: str = "Validation loss per loop count, with the test-time law"
                  ) -> go.Figure:
    """Return measured loss per loop count and the fitted L(T) (`loss_fit`): solid where it was fitted, dotted past it.

    The fitted range is `test_time_fit_upto` (loops 1..n) when the Dataset records it, else read from
    `loss_fit`'s long name; the legend names it.
    """
    fig = loss_by_loop(ds, "loss", K=K, title=title)
    fig.data[0].name = "measured"
    fig.update_layout(showlegend=True, margin_b=110)
    if "loss_fit" not in ds:
        return fig
    upto = int(ds["test_time_fit_upto"]) if "test_time_fit_upto" in ds else None
    if upto is None:
        tail = str(ds.loss_fit.attrs.get("long_name", "")).rsplit("..", 1)
        upto = int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else int(ds.loop.max())
    loops, fit = ds.loop.values, ds.loss_fit.values
    inside = loops <= upto
    q = QUANTITY["loss"]
    fig.add_trace(_line(loops[inside], fit[inside], f"L(T) = L∞ + Z·e^(−zT), fitted on loops 1..{upto}", q,
                        mode="lines", line=dict(color="#d62728")))
    if (~inside).any():
        edge = max(int(inside.sum()) - 1, 0)  # start the dotted part where the solid one ends
        fig.add_trace(_line(loops[edge:], fit[edge:], f"L(T) extrapolated past loop {upto}", q,
                            mode="lines", line=dict(color="#d62728", dash="dot", width=1.5)))
    return fig


def training_curve(metrics, title: str = "Training loss") -> go.Figure:
    """Return training loss per step (`train_loss` or `loss` over `step`) and evaluation loss per loop count if present."""
    q = QUANTITY["loss"]
    fig = _fig(title, "step", q)
    train = metrics["train_loss"] if "train_loss" in metrics else metrics["loss"]
    fig.add_trace(_line(train.step.values, train.values, "training batches", q, mode="lines"))
    if "eval_loss" in metrics:
        ev = metrics.eval_loss
        dim = "eval_loop" if "eval_loop" in ev.dims else "loop"
        for r in ev[dim].values:
            fig.add_trace(_line(ev.eval_step.values, ev.sel({dim: r}).values, f"validation, r={int(r)}", q))
    fig.update_xaxes(**integer_ticks(train.step.values))
    return fig


def geometry_curves(ds, K: int | None = None, title: str = "How much each loop moves the state") -> go.Figure:
    """Return one panel per quantity (angular distance, relative update, normalised variance) against the loop."""
    names = [v for v in ("angular_distance", "relative_update", "state_variance") if v in ds]
    short = {"angular_distance": "angle (π rad)", "relative_update": "rel. update (fraction)",
             "state_variance": "V(x(t)) / V(x(K))"}
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        subplot_titles=[QUANTITY[v] for v in names])
    for i, v in enumerate(names):
        fig.add_trace(_line(ds.loop.values, ds[v].values, short[v], QUANTITY[v]), row=i + 1, col=1)
        fig.update_yaxes(title_text=short[v], row=i + 1, col=1)
    fig.update_xaxes(title_text="loop t", row=len(names), col=1)
    fig.update_xaxes(**integer_ticks(ds.loop.values))
    fig.update_annotations(font_size=12)
    fig.update_layout(**{**_LAYOUT, "title_text": title, "height": 170 * len(names) + 80, "showlegend": False,
                         "margin": dict(l=75, r=25, t=60, b=55)})
    return mark_horizon(fig, K if K is not None else ds.attrs.get("training_loops"))


def interaction_heatmap(ds, title: str = "Computational interaction C(source → target)") -> go.Figure:
    """Return the interaction matrix as a heatmap whose colours span the core sources' values; others print their value.

    A prelude source moves every later update far more than a core one does; on one colour scale it
    would paint every core cell the same dark colour, so the scale ends at the largest value from a
    core source and a cell above it shows in the top colour with its number written in.
    """
    z = np.asarray(ds.interaction.values, dtype=float)
    stage = np.asarray(ds["source_stage"].values) if "source_stage" in ds.coords else None
    core = z[stage == "core"] if stage is not None and (stage == "core").any() else z
    finite = core[np.isfinite(core)]
    zmax = float(finite.max()) if finite.size else None
    over = zmax is not None and bool(np.nanmax(z) > zmax * 1.0001)
    # a source that never acts on a later block (the last occurrence) or a target nothing precedes is empty
    rows, cols = np.isfinite(z).any(1), np.isfinite(z).any(0)
    z = z[rows][:, cols]
    if over:
        title = (f"{title}<br><sup>colour scale ends at the largest value from a core source ({zmax:.2f}); "
                 f"brighter cells print their own value</sup>")
    fig = _fig(title, "target block occurrence (stage.loop.layer)", "source block occurrence (skipped)", height=560,
               margin=dict(l=110, r=25, t=80, b=90))
    fig.update_layout(title_y=0.955)  # room above for the second line
    text = np.where(np.isfinite(z), np.char.mod("%.2f", np.nan_to_num(z)), "")
    fig.add_trace(go.Heatmap(z=z, x=[str(s) for s in ds.target.values[cols]],
                             y=[str(s) for s in ds.source.values[rows]],
                             zmin=0, zmax=zmax, colorscale="Viridis", text=text, texttemplate="%{text}",
                             textfont=dict(size=10), meta="C (fraction of the update |u_j|)",
                             hovertemplate="skip %{y} → %{x}: C = %{z:.3f}<extra></extra>",
                             colorbar=dict(title=dict(text="C<br>(fraction)", side="top"), thickness=14)))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category", tickangle=-30)
    return fig


def interaction_by_lag(ds, title: str = "Interaction between core occurrences by loop lag") -> go.Figure:
    """Return mean C over core pairs against their loop lag (integer ticks)."""
    q = QUANTITY["interaction_by_lag"]
    fig = _fig(title, "lag (loops between source and target)", q, showlegend=False)
    fig.add_trace(_line(ds.lag.values, ds.interaction_by_lag.values, "mean C", q))
    fig.update_xaxes(**integer_ticks(ds.lag.values))
    fig.update_yaxes(rangemode="tozero")
    return fig


def lost_gradient_curves(ds, title: str = "Gradient thrown away by truncation") -> go.Figure:
    """Return lost(k) (with rho^k where rho < 1, its geometric-decay prediction) and 1 - cos(g, G_k), one panel each.

    rho^k predicts a fraction of |g| only when the adjoint shrinks (rho < 1); otherwise it exceeds 1
    and means nothing on this axis, so the legend gives rho and the curve is left out.
    """
    rho = float(ds.attrs.get("rho", float("nan")))
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.14,
                        subplot_titles=["lost(k) = |g − G_k| / |g|", "1 − cos(g, G_k)"])
    q_lost, q_cos = QUANTITY["lost"], QUANTITY["one_minus_cos"]
    fig.add_trace(_line(ds.k.values, ds.lost.values, "lost(k), measured", q_lost), row=1, col=1)
    if "rho_k" in ds and np.isfinite(rho) and rho < 1:
        fig.add_trace(_line(ds.k.values, ds.rho_k.values, f"ρ^k, geometric decay (ρ = {rho:.3f})", q_lost,
                            mode="lines", line=dict(dash="dot")), row=1, col=1)
    else:  # an invisible point keeps the legend entry that says why there is no prediction
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=dict(dash="dot", color="gray"), meta=q_lost,
                                 name=f"no ρ^k prediction: ρ = {rho:.3f} ≥ 1 (the adjoint does not shrink)"),
                      row=1, col=1)
    fig.add_trace(_line(ds.k.values, 1 - ds.cos.values, "1 − cos(g, G_k)", q_cos), row=1, col=2)
    for col, q in ((1, "fraction of |g|"), (2, "1 − cos (fraction)")):
        fig.update_yaxes(title_text=q, rangemode="tozero", row=1, col=col)
        fig.update_xaxes(title_text="backward loops k", row=1, col=col, **integer_ticks(ds.k.values))
    fig.update_annotations(font_size=12)
    fig.update_layout(**{**_LAYOUT, "title_text": title, "height": 440, "margin": dict(l=75, r=25, t=70, b=120)})
    return fig


def adjoint_norms(ds, title: str = "Adjoint norm across loops") -> go.Figure:
    """Return |dL/dh_t| against the loop t on a log axis (geometric decay draws a straight line)."""
    q = QUANTITY["adjoint_norm"]
    fig = _fig(title, "loop t (0 = prelude output h0)", q, showlegend=False)
    fig.add_trace(_line(ds.loop.values, ds.adjoint_norm.values, "|∂L/∂h_t|", q))
    fig.update_yaxes(type="log")
    fig.update_xaxes(**integer_ticks(ds.loop.values))
    return fig


def lost_gradient_finetune(ds, title: str = "Gradient lost by truncating to k = ⌈r/2⌉, over a fine-tune"
                           ) -> go.Figure:
    """Return lost(⌈r/2⌉) against the fine-tune step, one line per loop count r: the batch mean ± standard error.

    Reads `experiments.finetune_lost_gradient`'s Dataset (`lost_half` over step, loops, batch); step 0
    is the trained model. The title names the fine-tune's backprop depth when the attrs record it.
    """
    q = QUANTITY["lost_half"]
    k_ft = ds.attrs.get("finetune_backward_loops")
    if k_ft is not None and int(ds.attrs.get("finetune_steps", 0)) > 0:
        title += f" ({'full BPTT' if int(k_ft) == 0 else f'truncated to k = {int(k_ft)}'})"
    fig = _fig(title, "fine-tune step (optimiser steps; 0 = the trained model)", q)
    n = ds.sizes["batch"]
    for r in ds.loops.values:
        y = ds.lost_half.sel(loops=r)
        mean = y.mean("batch").values
        se = (y.std("batch", ddof=1).values / math.sqrt(n)) if n > 1 else None
        over = f" (mean ± s.e. over {n} batches)" if n > 1 else ""
        fig.add_trace(_line(ds.step.values, mean, f"r = {int(r)}, k = {math.ceil(int(r) / 2)}{over}", q,
                            error_y=None if se is None else dict(type="data", array=se, visible=True)))
    fig.update_yaxes(rangemode="tozero")
    fig.update_xaxes(**integer_ticks(ds.step.values))
    return fig


def fit_against_data(observed, predicted, labels=None, title: str = "Law fit: data against prediction") -> go.Figure:
    """Return observed loss against the fitted law's prediction, one point per run, with the y = x line."""
    observed, predicted = np.asarray(observed, float), np.asarray(predicted, float)
    q = QUANTITY["loss"]
    fig = _fig(title, "fitted loss (nats/token)", "observed loss (nats/token)")
    lo, hi = float(np.nanmin([observed.min(), predicted.min()])), float(np.nanmax([observed.max(), predicted.max()]))
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line_dash="dash", line_color="gray", name="y = x",
                             meta=q))
    fig.add_trace(go.Scatter(x=predicted, y=observed, mode="markers", name="runs", meta=q,
                             text=None if labels is None else [str(s) for s in labels]))
    return fig


def curves(x, ys: dict, title: str, x_title: str, y_title: str, mode: str = "lines+markers") -> go.Figure:
    """Return one line per entry of ys (name -> values, all one quantity) against x; integer x gets integer ticks."""
    if not isinstance(y_title, str) or not y_title.strip():
        raise ValueError(f"y_title={y_title!r} is invalid: name the quantity and its unit, e.g. 'loss (nats/token)'")
    fig = _fig(title, x_title, y_title, showlegend=len(ys) > 1)
    for name, y in ys.items():
        fig.add_trace(_line(x, y, str(name), y_title, mode=mode))
    if _is_integer_coord(x):
        fig.update_xaxes(**integer_ticks(x))
    return fig


def bars(names, values, title: str, y_title: str, low=None, high=None) -> go.Figure:
    """Return a bar chart of values by name, with error bars from low to high when given."""
    fig = _fig(title, "", y_title, showlegend=False)
    values = np.asarray(values, dtype=float)
    err = None
    if low is not None and high is not None:
        err = dict(type="data", symmetric=False, array=np.asarray(high, float) - values,
                   arrayminus=values - np.asarray(low, float))
    fig.add_trace(go.Bar(x=[str(n) for n in names], y=values, error_y=err, meta=y_title))
    return fig


def depth_and_parameters(ds, title: str = "Depth grows with loops; parameters do not") -> go.Figure:
    """Return two panels over loop counts r: effective depth (layers), and parameters of the looped and the dense model.

    `ds` has `effective_depth` and `params_looped`, `params_dense` (counts) over dim `loop`.
    """
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.15,
                        subplot_titles=["effective depth p + s·r + c", "parameters (thousands)"])
    r = ds.loop.values
    fig.add_trace(_line(r, ds.effective_depth.values, "effective depth", "depth (layers)"), row=1, col=1)
    fig.add_trace(_line(r, ds.params_looped.values / 1e3, "looped model", "parameters (thousands)"), row=1, col=2)
    fig.add_trace(_line(r, ds.params_dense.values / 1e3, "dense model of that depth", "parameters (thousands)"),
                  row=1, col=2)
    fig.update_yaxes(title_text="depth (layers)", rangemode="tozero", row=1, col=1,
                     **integer_ticks(np.r_[0, ds.effective_depth.values]))
    fig.update_yaxes(title_text="parameters (thousands)", rangemode="tozero", row=1, col=2)
    for col in (1, 2):
        fig.update_xaxes(title_text="loops r", row=1, col=col, **integer_ticks(r))
    fig.update_annotations(font_size=12)
    fig.update_layout(**{**_LAYOUT, "title_text": title, "margin": dict(l=75, r=25, t=80, b=60)})
    return fig


def trajectory(view, positions, labels=None, K: int | None = None,
               title: str = "The hidden state across loops (PCA of all loops)") -> go.Figure:
    """Return 2-D paths of states 0..R (a `loop_view` Dataset's `pca`) for the chosen positions, loop K starred.

    `labels` name the positions (default: the Dataset's `label` coordinate, else the token ids); K
    defaults to the Dataset's `training_loops` attr.
    """
    proj = np.asarray(view["pca"].values)
    if labels is None:
        labels = [str(x) for x in (view["label"] if "label" in view.coords else view["token_id"]).values]
    K = int(view.attrs["training_loops"]) if K is None and "training_loops" in view.attrs else K
    share = [f"{100 * float(s):.0f}%" for s in view["explained_variance"].values[:2]] \
        if "explained_variance" in view else ["", ""]
    fig = _fig(title, f"PC 1 ({share[0]} of variance)", f"PC 2 ({share[1]} of variance)", height=480)
    for i in positions:
        path = proj[:, i, :2]
        fig.add_trace(go.Scatter(x=path[:, 0], y=path[:, 1], mode="lines+markers", name=repr(labels[i]),
                                 text=[f"loop {t}" for t in range(len(path))], meta="PC 2",
                                 marker=dict(size=np.where(np.arange(len(path)) == 0, 11, 6))))
        if K is not None and K < len(path):
            fig.add_trace(go.Scatter(x=[path[K, 0]], y=[path[K, 1]], mode="markers", showlegend=False, meta="PC 2",
                                     marker=dict(symbol="star", size=14, color="black"),
                                     hovertext=f"{labels[i]!r} at loop K={K}"))
    return fig


def exit_curves(ds, var: str = "loss", title: str | None = None) -> go.Figure:
    """Return ds[var] against mean core passes per token, one line per rule (fixed r, kl, state, gate).

    Reads an `experiments.generate.exit_sweep` Dataset (dim `point`, coords `rule`, `setting`); task
    variables (`task_loss`, `group_accuracy`) use `task_mean_loops`, and group_accuracy draws one line
    per rule and group. Each point's hover text gives its r or threshold.
    """
    quantity = QUANTITY.get(var) or ds[var].attrs.get("long_name", var)
    x_var = "task_mean_loops" if var.startswith("task") or var == "group_accuracy" else "mean_loops"
    default = f"{'Task ' if x_var == 'task_mean_loops' else ''}{var.replace('_', ' ')} against compute per token"
    fig = _fig(title or default, "mean core passes per token", quantity)
    rules = list(dict.fromkeys(str(r) for r in ds.rule.values))
    groups = list(ds.group.values) if "group" in ds[var].dims else [None]
    for rule in rules:
        sub = ds.isel(point=np.flatnonzero(ds.rule.values == rule))
        order = np.argsort(sub[x_var].values, kind="stable")
        what = "r" if rule == "fixed" else "threshold"
        hover = [f"{rule}, {what} {s:g}" for s in sub.setting.values[order]]
        for g in groups:
            y = (sub[var] if g is None else sub[var].sel(group=g)).values[order]
            name = rule if g is None else f"{rule} · {g}"
            fig.add_trace(_line(sub[x_var].values[order], y, name, quantity, hovertext=hover,
                                line=dict(dash="solid" if rule == "fixed" else "dot")))
    if "accuracy" in var:
        fig.update_yaxes(range=[-0.02, 1.02])
    return fig
