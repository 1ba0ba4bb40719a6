"""Static plotly figures built from result Datasets (nothing here computes), and `show` for notebooks.

Pipeline notebooks draw `go.Figure`s, never `FigureWidget`s (a saved widget embeds ~5 MB of plotly.js
in every notebook). `show` displays a figure as plotly's JSON mimetype (JupyterLab renders it) plus an
HTML div that calls `Plotly.newPlot` without embedding plotly.js: the pipeline report loads plotly.js
once per pipeline, so the HTML of every run stays small and opens offline.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import plotly.graph_objects as go

from ..io import atomic_write_bytes

_LAYOUT = dict(template="plotly_white", height=380, margin=dict(l=60, r=20, t=50, b=50))


def _fig(title: str, x: str, y: str, **layout) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, **{**_LAYOUT, **layout})
    return fig


def show(fig: go.Figure, name: str | None = None, out_dir: str | os.PathLike | None = None) -> Path | None:
    """Return the path of `figures/<name>.json` under out_dir (None if not saved) after displaying the figure."""
    from IPython.display import display

    bundle = {"application/vnd.plotly.v1+json": fig.to_plotly_json(),
              "text/html": fig.to_html(full_html=False, include_plotlyjs=False)}
    display(bundle, raw=True)
    if name is None or out_dir is None:
        return None
    return atomic_write_bytes(Path(out_dir) / "figures" / f"{name}.json", fig.to_json().encode())


def mark_horizon(fig: go.Figure, K: int | float | None, label: str = "K (training loops)") -> go.Figure:
    """Return the figure with a dashed vertical line at the training loop count K."""
    if K is not None and K > 0:
        fig.add_vline(x=K, line_dash="dash", line_color="gray", annotation_text=label)
    return fig


def loss_by_loop(ds, var: str = "loss", K: int | None = None, by: str | None = None,
                 title: str = "Loss across loop counts") -> go.Figure:
    """Return a line per value of `by` (or one line) of ds[var] against ds.loop, with K marked."""
    fig = _fig(title, "loops r", var)
    da = ds[var]
    groups = [(None, da)] if by is None else [(v, da.sel({by: v})) for v in da[by].values]
    for label, sub in groups:
        extra = [d for d in sub.dims if d != "loop"]
        if extra:  # average anything else (e.g. depth) so one line per group remains
            sub = sub.mean(extra)
        fig.add_trace(go.Scatter(x=sub.loop.values, y=sub.values, mode="lines+markers",
                                 name=var if label is None else f"{by}={label}"))
    return mark_horizon(fig, K)


def training_curve(metrics, title: str = "Training loss") -> go.Figure:
    """Return training loss per step (and evaluation loss at K when the metrics carry it)."""
    fig = _fig(title, "step", "loss (nats/token)")
    fig.add_trace(go.Scatter(x=metrics.step.values, y=metrics.loss.values, mode="lines", name="train"))
    if "eval_loss" in metrics:
        ev = metrics.eval_loss
        for r in ev.loop.values:
            fig.add_trace(go.Scatter(x=ev.eval_step.values, y=ev.sel(loop=r).values, mode="lines+markers",
                                     name=f"val r={int(r)}"))
    return fig


def geometry_curves(ds, K: int | None = None, title: str = "How much each loop moves the state") -> go.Figure:
    """Return angular distance, relative update and normalised variance per loop from a geometry Dataset."""
    fig = _fig(title, "loop t", "value")
    for var in ("angular_distance", "relative_update", "state_variance"):
        fig.add_trace(go.Scatter(x=ds.loop.values, y=ds[var].values, mode="lines+markers",
                                 name=ds[var].attrs.get("long_name", var)))
    return mark_horizon(fig, K if K is not None else ds.attrs.get("training_loops"))


def interaction_heatmap(ds, title: str = "Computational interaction C(source -> target)") -> go.Figure:
    """Return the interaction matrix of an interaction Dataset as a heatmap over block occurrences."""
    fig = _fig(title, "target occurrence", "source occurrence", height=520)
    fig.add_trace(go.Heatmap(z=ds.interaction.values, x=list(ds.target.values), y=list(ds.source.values),
                             colorscale="Viridis", colorbar=dict(title="C")))
    fig.update_yaxes(autorange="reversed")
    return fig


def lost_gradient_curves(ds, title: str = "Gradient thrown away by truncation") -> go.Figure:
    """Return lost(k), 1 - cos(g, G_k) and the geometric prediction rho^k against k."""
    fig = _fig(title, "backward loops k", "fraction")
    fig.add_trace(go.Scatter(x=ds.k.values, y=ds.lost.values, mode="lines+markers", name="|g - G_k| / |g|"))
    fig.add_trace(go.Scatter(x=ds.k.values, y=1 - ds.cos.values, mode="lines+markers", name="1 - cos(g, G_k)"))
    fig.add_trace(go.Scatter(x=ds.k.values, y=ds.rho_k.values, mode="lines", line_dash="dot",
                             name=f"rho^k (rho = {ds.attrs.get('rho', float('nan')):.3f})"))
    return fig


def fit_against_data(observed, predicted, labels=None, title: str = "Law fit: data against prediction") -> go.Figure:
    """Return observed loss against the fitted law's prediction, one point per run, with the y = x line."""
    observed, predicted = np.asarray(observed, float), np.asarray(predicted, float)
    fig = _fig(title, "fitted loss", "observed loss")
    lo, hi = float(np.nanmin([observed.min(), predicted.min()])), float(np.nanmax([observed.max(), predicted.max()]))
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line_dash="dash", line_color="gray", name="y = x"))
    fig.add_trace(go.Scatter(x=predicted, y=observed, mode="markers", name="runs",
                             text=None if labels is None else [str(s) for s in labels]))
    return fig


def curves(x, ys: dict, title: str, x_title: str, y_title: str, mode: str = "lines+markers") -> go.Figure:
    """Return one line per entry of ys (name -> values) against x."""
    fig = _fig(title, x_title, y_title)
    for name, y in ys.items():
        fig.add_trace(go.Scatter(x=np.asarray(x), y=np.asarray(y), mode=mode, name=str(name)))
    return fig


def bars(names, values, title: str, y_title: str) -> go.Figure:
    """Return a bar chart of values by name."""
    fig = _fig(title, "", y_title)
    fig.add_trace(go.Bar(x=[str(n) for n in names], y=np.asarray(values)))
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
    fig = _fig(title, "PC 1", "PC 2", height=480)
    for i in positions:
        path = proj[:, i, :2]
        fig.add_trace(go.Scatter(x=path[:, 0], y=path[:, 1], mode="lines+markers", name=repr(labels[i]),
                                 text=[f"loop {t}" for t in range(len(path))],
                                 marker=dict(size=np.where(np.arange(len(path)) == 0, 11, 6))))
        if K is not None and K < len(path):
            fig.add_trace(go.Scatter(x=[path[K, 0]], y=[path[K, 1]], mode="markers", showlegend=False,
                                     marker=dict(symbol="star", size=14, color="black"),
                                     hovertext=f"{labels[i]!r} at loop K={K}"))
    return fig
