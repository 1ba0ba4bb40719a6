"""Figures a person can read, and the report's numbers: every figure builder, fed the Datasets the probes
and evals return for a tiny model (and Datasets with the scales that made the old figures unreadable),
keeps one quantity per linear axis (no two whose sizes differ by more than 10x), titles every axis
with a unit, and ticks loop / lag / step axes at whole numbers only. The report's accuracy table is
checked here; its headline numbers, which each results file names, in tests/test_pipeline.py.
"""

import json

import numpy as np
import plotly.graph_objects as go
import pytest
import torch
import xarray as xr

from helpers import cfg, perturb, tokens
from workbench import LoopLM
from workbench.evals import loop_sweep
from workbench.laws import fit_test_time
from workbench.pipeline import accuracy_table
from workbench.probes import geometry, interaction, lost_gradient, loop_view
from workbench.viz import figures

COUNTED = ("loop", "lag", "backward loops", "step", "depth", "layer")  # axes whose ticks must be whole numbers


# ---- the checks ---------------------------------------------------------------------------------------------
def _axis_name(ref: str, letter: str) -> str:
    """'y3' -> 'yaxis3', 'y' -> 'yaxis'."""
    return f"{letter}axis{ref[1:]}"


def _values(v) -> np.ndarray:
    if v is None:
        return np.array([], dtype=float)
    a = np.asarray(v, dtype=object).ravel()
    return np.array([x for x in a if x is not None], dtype=float)


def mixed_scales(fig: go.Figure) -> list[str]:
    """Return one line per pair of quantities on one linear y axis whose largest |values| differ by more than 10x.

    A trace's quantity is its `meta` (the builders set it); traces of one quantity (groups, fits of
    the same variable) may differ as much as they like.
    """
    by_axis: dict[str, list] = {}
    for t in fig.data:
        if t.type not in ("scatter", "bar"):
            continue
        y = _values(t.y)
        y = y[np.isfinite(y)]
        if y.size == 0:
            continue
        by_axis.setdefault(t.yaxis or "y", []).append((t.meta or t.name, float(np.abs(y).max())))
    problems = []
    for ref, traces in by_axis.items():
        axis = fig.layout[_axis_name(ref, "y")]
        if axis.type == "log":
            continue
        for qa, ma in traces:
            for qb, mb in traces:
                if qa != qb and mb > 0 and ma / mb > 10:
                    problems.append(f"{ref}: {qa!r} (up to {ma:.3g}) and {qb!r} (up to {mb:.3g}) share a linear axis")
    return problems


def unreadable_axes(fig: go.Figure) -> list[str]:
    """Return one line per used axis without a title, and per counted axis (loops, lags, steps) with fractional ticks."""
    problems = []
    used = set()
    for t in fig.data:
        if t.type in ("scatter", "bar", "heatmap"):
            used.add(_axis_name(t.xaxis or "x", "x"))
            used.add(_axis_name(t.yaxis or "y", "y"))
    for name in sorted(used):
        axis = fig.layout[name]
        title = axis.title.text or ""
        if not title.strip() and axis.matches:  # a shared axis: the panel at the bottom carries its title
            axis = fig.layout[_axis_name(axis.matches, name[0])]
            title = axis.title.text or ""
        if name.startswith("y") or fig.data[0].type != "bar":  # a bar chart's x axis names its bars
            if not title.strip():
                problems.append(f"{name} has no title")
        if any(word in title for word in COUNTED) and axis.type != "category":
            whole = axis.tickformat == "d" and axis.dtick is not None and float(axis.dtick) == int(float(axis.dtick)) \
                and float(axis.dtick) >= 1
            if not whole:
                problems.append(f"{name} ({title!r}) counts things but may tick at fractions "
                                f"(tickformat={axis.tickformat!r}, dtick={axis.dtick!r})")
    return problems


def test_the_checks_catch_the_old_figures():
    """The two checks fail on the figures the issue showed: a ratio and an angle on one 'value' axis."""
    old = go.Figure([go.Scatter(x=[1, 2, 3], y=[0.8, 1.0, 6.5], name="V(x(t))/V(x(K))"),
                     go.Scatter(x=[1, 2, 3], y=[0.05, 0.04, 0.03], name="angular distance")])
    old.update_layout(yaxis_title="value", xaxis_title="loop t")
    assert mixed_scales(old) and unreadable_axes(old)
    old.update_yaxes(type="log")
    assert not mixed_scales(old)  # a log axis may hold both
    same = go.Figure([go.Scatter(x=[1, 2], y=[0.9, 0.8], meta="accuracy"), go.Scatter(x=[1, 2], y=[0.01, 0], meta="accuracy")])
    assert not mixed_scales(same)  # groups of one quantity are not mixed scales
    untitled = go.Figure([go.Scatter(x=[1, 2], y=[1, 2])])
    assert unreadable_axes(untitled) == ["xaxis has no title", "yaxis has no title"]


# ---- the Datasets -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return perturb(LoopLM(cfg(), seed=0), scale=0.05, seed=1).eval()


@pytest.fixture(scope="module")
def datasets(model):
    """The Datasets the notebooks draw, from the real probes and evals on a tiny model (plus hard cases)."""
    ids = tokens(seed=3, B=2, T=12)
    K = model.cfg.loops
    out = {"geometry": geometry(model, ids, 2 * K), "interaction": interaction(model, ids, K),
           "lost": lost_gradient(model, ids[:, :-1], ids[:, 1:], K),
           "view": loop_view(model, ids[0], 2 * K)}
    sweep = loop_sweep(model, ids, list(range(1, 9)), progress=False)
    fit = fit_test_time(sweep.loop.values[:4], sweep.loss.values[:4])
    sweep["loss_fit"] = ("loop", fit.predict({"loops": sweep.loop.values}))
    sweep["test_time_fit_upto"] = ((), 4)
    for k, v in fit.params.items():
        sweep[f"test_time_{k}"] = ((), float(v))
    sweep.attrs["training_loops"] = K
    out["sweep"] = sweep
    # the scales of the screenshots: variance ratio up to 6.5 beside angles of 0.05, a prelude
    # row of 1.3 over core values of 0.1, rho = 1.4 (rho^k past 1.9)
    hard = out["geometry"].copy()
    hard["state_variance"] = ("loop", np.linspace(0.5, 6.5, hard.sizes["loop"]))
    hard["angular_distance"] = ("loop", np.linspace(0.05, 0.01, hard.sizes["loop"]))
    out["geometry_hard"] = hard
    inter = out["interaction"].copy()
    z = inter.interaction.values.copy()
    pre = inter.source_stage.values == "prelude"
    z[~pre] = 0.05 + 0.25 * z[~pre] / np.nanmax(z[~pre])  # core sources 0.05..0.3, as a trained model shows
    z[pre] = np.where(np.isnan(z[pre]), np.nan, 1.3)
    inter["interaction"] = (inter.interaction.dims, z)
    out["interaction_hard"] = inter
    lost = out["lost"].copy()
    lost.attrs["rho"] = 1.4
    lost["rho_k"] = ("k", 1.4 ** lost.k.values.astype(float))
    out["lost_hard"] = lost
    # finetune_lost_gradient's layout: lost(ceil(r/2)) per fine-tune step, loop count and batch
    rng = np.random.default_rng(0)
    half = 0.3 + 0.1 * np.arange(3)[None, :, None] + 0.02 * rng.standard_normal((4, 3, 3))
    out["lost_finetune"] = xr.Dataset({"lost_half": (("step", "loops", "batch"), half)},
                                      coords={"step": [0, 10, 20, 30], "loops": [2, 4, 8], "batch": [0, 1, 2]},
                                      attrs={"finetune_steps": 30, "finetune_backward_loops": 2})
    steps = np.arange(1, 301)
    # an exit sweep (experiments.generate.exit_sweep's layout): fixed r and a KL threshold rule
    rules = ["fixed"] * 4 + ["kl"] * 3
    out["exits"] = xr.Dataset({"mean_loops": ("point", [1, 2, 4, 8, 2.5, 3.1, 5.0]),
                               "loss": ("point", [4.0, 3.6, 3.4, 3.45, 3.55, 3.45, 3.41]),
                               "task_mean_loops": ("point", [1, 2, 4, 8, 2.2, 3.0, 4.8]),
                               "group_accuracy": (("point", "group"), np.tile([[0.9, 0.02]], (7, 1)))},
                              coords={"rule": ("point", rules), "setting": ("point", [1, 2, 4, 8, 0.1, 0.01, 0.001]),
                                      "group": ["knowledge", "reasoning"]})
    # task accuracy as the loop sweep reports it (experiments.task_results): reasoning trained at depths 1-4
    from workbench.experiments import task_results
    count = np.zeros((2, 9))
    count[0, 1:], count[1, 0] = 8, 8
    acc = np.where(count > 0, np.linspace(0.05, 1, 6 * 2 * 9).reshape(6, 2, 9), np.nan)
    ts = xr.Dataset({"accuracy": (("loop", "task", "depth"), acc), "count": (("task", "depth"), count)},
                    coords={"loop": [1, 2, 3, 4, 5, 6], "task": ["iterated", "recall"], "depth": np.arange(9),
                            "task_group": ("task", ["reasoning", "knowledge"])})
    out["tasks"] = task_results(ts, ["iterated", "recall"], None, {"iterated": {"rule": "add"}})
    # an lm-eval step's layout (experiments.lm_eval.lm_eval_run): a text task, two multiple-choice tasks
    acc = np.array([[np.nan, 0.2, 0.9], [np.nan, 0.4, 0.95], [np.nan, 0.3, 0.9]])
    out["lm_eval"] = xr.Dataset({"acc": (("loop", "task"), acc), "exact_match_wb": (("loop", "task"), acc - 0.1),
                                 "bits_per_byte": (("loop", "task"), [[2.1, np.nan, np.nan], [1.9, np.nan, np.nan],
                                                                      [2.0, np.nan, np.nan]])},
                                coords={"loop": [1, 2, 4], "task": ["wb_text", "wb_iterated_d1", "wb_recall_d0"]},
                                attrs={"training_loops": 2})
    out["train"] = xr.Dataset({"train_loss": ("step", 6 - np.log(steps)),
                               "eval_loss": (("eval_step", "eval_loop"), [[5.0, 4.5], [4.0, 3.5]])},
                              coords={"step": steps, "eval_step": [150, 300], "eval_loop": [1, 3]})
    return out


def built(d) -> dict[str, go.Figure]:
    """Every builder's figure for the test Datasets."""
    K = 3
    sizes = xr.Dataset({"effective_depth": ("loop", [4, 6, 10, 18, 34]), "params_looped": ("loop", [5e4] * 5),
                        "params_dense": ("loop", [5e4, 7e4, 1.1e5, 1.9e5, 3.5e5])}, coords={"loop": [1, 2, 4, 8, 16]})
    return {
        "loss_by_loop": figures.loss_by_loop(d["sweep"], "loss", K=K),
        "accuracy_by_loop": figures.loss_by_loop(d["sweep"], "accuracy", K=K),
        "loss_with_fit": figures.loss_with_fit(d["sweep"], K=K),
        "training_curve": figures.training_curve(d["train"]),
        "geometry": figures.geometry_curves(d["geometry"], K=K),
        "geometry_hard": figures.geometry_curves(d["geometry_hard"], K=K),
        "tour_movement": figures.geometry_curves(d["view"], K=K),
        "interaction": figures.interaction_heatmap(d["interaction"]),
        "interaction_hard": figures.interaction_heatmap(d["interaction_hard"]),
        "interaction_by_lag": figures.interaction_by_lag(d["interaction"]),
        "lost_gradient": figures.lost_gradient_curves(d["lost"]),
        "lost_gradient_hard": figures.lost_gradient_curves(d["lost_hard"]),
        "adjoint_norms": figures.adjoint_norms(d["lost"]),
        "lost_gradient_finetune": figures.lost_gradient_finetune(d["lost_finetune"]),
        "fit_against_data": figures.fit_against_data([3.1, 3.4, 3.9], [3.0, 3.5, 3.8], ["a", "b", "c"]),
        "bars": figures.bars(["full", "truncated"], [0.46, 0.38], "phi", "φ (no unit)", low=[0.4, 0.3], high=[0.5, 0.45]),
        "curves": figures.curves([0, 1, 2, 3], {"uniform": [341] * 4, "cosine": [512, 400, 280, 170]},
                                 "MLP widths", "physical layer", "MLP width d_ff (hidden units)"),
        "depth_and_parameters": figures.depth_and_parameters(sizes),
        "trajectory": figures.trajectory(d["view"], [0, 3, 5]),
        "exit_loss": figures.exit_curves(d["exits"], "loss"),
        "exit_accuracy": figures.exit_curves(d["exits"], "group_accuracy"),
        "task_accuracy": figures.task_accuracy(d["tasks"], K=K),
        "task_accuracy_beyond": figures.task_accuracy(d["tasks"], K=K, beyond=True),
        "lm_eval_accuracy": figures.lm_eval_accuracy(d["lm_eval"]),
    }


def test_task_accuracy_draws_each_groups_chance_in_its_colour(datasets):
    ds = datasets["tasks"]
    fig = figures.task_accuracy(ds, K=3)
    lines = {t.name: t for t in fig.data}
    for g in ("knowledge", "reasoning"):
        acc, = [t for t in fig.data if t.name == f"group={g}"]
        chance, = [t for t in fig.data if t.name.startswith(f"chance, group={g} ")]
        assert list(chance.y) == [float(ds.group_chance.sel(group=g))] * 2 and chance.line.dash == "dot"
        assert chance.line.color == acc.line.color
    beyond = figures.task_accuracy(ds, K=3, beyond=True)  # knowledge has no depth past its training: no lines
    assert [t.name for t in beyond.data] == [
        "group=reasoning", f"chance, group=reasoning ({float(ds.group_chance_beyond.sel(group='reasoning')):.3f})"]
    assert beyond.layout.yaxis.title.text == "accuracy (fraction)" and tuple(beyond.layout.yaxis.range) == (-0.02, 1.02)
    assert len(lines) == 4


def test_every_builder_is_checked(datasets):
    """A new builder in workbench.viz.figures joins `built` (and so the checks below) or this fails."""
    import inspect

    helpers = {"show", "save", "plot_html", "mark_horizon", "integer_ticks"}
    builders = {n for n, f in inspect.getmembers(figures, inspect.isfunction)
                if f.__module__ == figures.__name__ and not n.startswith("_") and n not in helpers}
    source = inspect.getsource(built)
    used = {n for n in builders if f"figures.{n}(" in source}
    assert builders == used, f"builders not checked: {sorted(builders - used)}"


def test_every_builder_keeps_one_scale_per_axis_titles_and_whole_ticks(datasets):
    figs = built(datasets)
    problems = {name: mixed_scales(f) + unreadable_axes(f) for name, f in figs.items()}
    assert not {k: v for k, v in problems.items() if v}, problems
    # each one survives the JSON round trip the report and notebooks use
    for name, f in figs.items():
        assert go.Figure(json.loads(f.to_json())).data, name


def test_lost_gradient_finetune_draws_one_line_per_r_with_its_batch_interval(datasets):
    ds = datasets["lost_finetune"]
    fig = figures.lost_gradient_finetune(ds)
    assert [t.name.split(",")[0] for t in fig.data] == ["r = 2", "r = 4", "r = 8"]
    assert "truncated to k = 2" in fig.layout.title.text
    for t, r in zip(fig.data, [2, 4, 8]):
        y = ds.lost_half.sel(loops=r).values
        np.testing.assert_allclose(t.y, y.mean(1))
        np.testing.assert_allclose(t.error_y.array, y.std(1, ddof=1) / np.sqrt(3))


def test_geometry_panels_and_the_interaction_colour_scale(datasets):
    fig = figures.geometry_curves(datasets["geometry_hard"], K=3)
    # three quantities, three panels (y axes), each titled with its unit
    assert len({t.yaxis for t in fig.data}) == 3
    assert [fig.layout[f"yaxis{i if i > 1 else ''}"].title.text for i in (1, 2, 3)] == \
        ["angle (π rad)", "rel. update (fraction)", "V(x(t)) / V(x(K))"]
    heat = figures.interaction_heatmap(datasets["interaction_hard"])
    d = datasets["interaction_hard"]
    core = d.interaction.values[d.source_stage.values == "core"]
    assert heat.data[0].zmax == pytest.approx(np.nanmax(core))  # the prelude's 1.3 does not set the scale
    assert heat.data[0].zmax < 1.3 and "1.30" in np.asarray(heat.data[0].text).ravel()  # its cells say their value


def test_predictions_and_fits_say_what_they_mean(datasets):
    hard = figures.lost_gradient_curves(datasets["lost_hard"])  # rho = 1.4: rho^k is no fraction of |g|
    assert not any("ρ^k, geometric" in (t.name or "") for t in hard.data)
    assert any("ρ = 1.400 ≥ 1" in (t.name or "") for t in hard.data)
    ok = datasets["lost"].copy()
    ok.attrs["rho"] = 0.5
    ok["rho_k"] = ("k", 0.5 ** ok.k.values.astype(float))
    drawn = [t for t in figures.lost_gradient_curves(ok).data if "ρ^k" in (t.name or "")]
    assert len(drawn) == 1 and np.all(np.asarray(drawn[0].y) <= 1)
    fit = figures.loss_with_fit(datasets["sweep"], K=3)
    names = [t.name for t in fit.data]
    assert "L(T) = L∞ + Z·e^(−zT), fitted on loops 1..4" in names and "L(T) extrapolated past loop 4" in names
    solid = next(t for t in fit.data if "fitted on" in t.name)
    assert list(solid.x) == [1, 2, 3, 4]  # drawn solid only where it was fitted


def test_integer_ticks():
    assert figures.integer_ticks([1, 4]) == dict(tickmode="linear", tick0=1.0, dtick=1, tickformat="d")
    assert figures.integer_ticks([1, 24])["dtick"] == 2 and figures.integer_ticks([0, 400])["dtick"] == 50
    with pytest.raises(ValueError, match="y_title"):
        figures.curves([1, 2], {"a": [1, 2]}, "t", "loops r", "")


def test_show_leaves_no_echo_and_plot_html_says_when_plotly_is_missing(tmp_path, monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append(obj))
    fig = figures.curves([1, 2], {"a": [1.0, 2.0]}, "t", "loops r", "loss (nats/token)")
    assert figures.show(fig, "a", tmp_path) is None
    assert json.loads((tmp_path / "figures" / "a.json").read_text())["data"]
    page = shown[0]["text/html"]
    assert "Plotly.newPlot" in page and "plotly.js, which did not load" in page and "typeof window.Plotly" in page
    assert "</script" not in figures.plot_html({"data": [{"name": "</script><b>"}], "layout": {}}).split("<script>")[1][:-9]


# ---- the report's accuracy table (its headline numbers: tests/test_pipeline.py) -------------------------
def test_accuracy_table_reads_group_accuracy():
    loops = np.arange(1, 13)
    acc = np.stack([np.linspace(0, 0.9, 12), np.full(12, 0.5)], 1)
    ds = xr.Dataset({"group_accuracy": (("loop", "group"), acc)}, coords={"loop": loops, "group": ["reason", "know"]},
                    attrs={"training_loops": 4})
    groups, shown, values = accuracy_table(ds)
    assert groups == ["reason", "know"] and shown == [1, 4, 12]  # first, K, best mean (12), last
    assert values[0] == [acc[0, 0], acc[3, 0], acc[11, 0]] and values[1] == [0.5, 0.5, 0.5]
    assert accuracy_table(ds.isel(loop=slice(0, 5)))[1] == [1, 2, 3, 4, 5]
    assert accuracy_table(xr.Dataset()) is None


def test_lm_eval_accuracy_pairs_each_task_with_the_workbench_exact_match(datasets):
    fig = figures.lm_eval_accuracy(datasets["lm_eval"])
    # the text task has no accuracy: two tasks, each solid (lm-eval) and dotted (workbench) in one colour
    assert [t.name for t in fig.data] == ["wb_iterated_d1 (lm-eval)", "wb_iterated_d1 (workbench exact match)",
                                          "wb_recall_d0 (lm-eval)", "wb_recall_d0 (workbench exact match)"]
    assert fig.data[0].line.color == fig.data[1].line.color != fig.data[2].line.color
    assert fig.data[1].line.dash == "dot" and fig.data[0].line.dash is None
    assert list(fig.data[2].y) == [0.9, 0.95, 0.9] and tuple(fig.layout.yaxis.range) == (-0.02, 1.02)
    assert any(s.x0 == 2 for s in fig.layout.shapes)  # K from the Dataset's training_loops
