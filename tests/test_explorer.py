"""The loop view probe against slow per-loop forwards, numpy's SVD and hand-computed KL; the explorer
widget driven from Python (a slider move re-slices the Dataset and never runs the model); bad input;
finding and training the explorer's model (workbench.experiments.explorer)."""

import json

import numpy as np
import pytest
import torch

from helpers import V, cfg, perturb, tokens
from workbench import LoopLM
from workbench.io import save_checkpoint, save_netcdf
from workbench.probes import geometry, lens, loop_view
from workbench.probes._common import angular_distance, relative_update
from workbench.viz.explorer import ExplorerInputError


class CharTokenizer:
    """Characters a..z plus space etc. mapped into the tiny helper vocabulary (97 ids)."""

    vocab_size = V

    def encode(self, text):
        return [ord(c) % V for c in text]

    def decode(self, ids):
        return "".join(chr(int(i) + 32) for i in ids)


def model_(seed=0, **kw):
    return perturb(LoopLM(cfg(**kw), seed=seed), scale=0.05, seed=seed + 1).eval()


def forward(model, ids, r, **kw):
    """(probabilities, state) of a separate pass with r loops (r = 0: h0 read out): the slow obvious way."""
    with torch.no_grad():
        if r == 0:
            h0 = model.trace(ids, loops=1, **kw).states[0]
            return torch.softmax(model.readout(h0), -1), h0
        out = model(ids, loops=r, **kw)
        return torch.softmax(out.logits, -1), out.state


# ---- the probe ----------------------------------------------------------------------------------------
def test_view_equals_separate_forwards_per_loop():
    model = model_()
    ids = tokens(seed=3, B=1, T=10)
    R = 6
    ds = loop_view(model, ids[0], R, top_k=5)
    assert dict(ds.sizes) == {"loop": R, "token": 10, "rank": 5, "state": R + 1, "component": 3}
    assert list(ds.loop.values) == list(range(1, R + 1)) and list(ds.state.values) == list(range(R + 1))
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    np.testing.assert_array_equal(ds.token_id.values, ids[0].numpy())
    np.testing.assert_array_equal(ds.target_id.values, targets[0].numpy())
    for r in range(1, R + 1):
        p, state = forward(model, ids, r)
        q, prev = forward(model, ids, r - 1)
        p, q = p[0].double(), q[0].double()
        with torch.no_grad():
            loss = float(model(ids, loops=r, targets=targets).loss)
        assert float(ds.loss.sel(loop=r)) == pytest.approx(loss, rel=1e-5)
        tgt = ids[0, 1:]
        np.testing.assert_allclose(ds.token_loss.sel(loop=r).values[:-1], -p[:-1].gather(-1, tgt[:, None])[:, 0].log(),
                                   rtol=1e-4)
        kl = (p * (p.log() - q.log())).sum(-1)  # KL(p_t || p_t-1) by hand
        np.testing.assert_allclose(ds.token_kl_prev.sel(loop=r).values, kl.numpy(), rtol=1e-4, atol=1e-6)
        assert float(ds.kl_prev.sel(loop=r)) == pytest.approx(float(kl.mean()), rel=1e-4, abs=1e-7)
        top = p.topk(5, dim=-1)
        np.testing.assert_array_equal(ds.top_id.sel(loop=r).values, top.indices.numpy())
        np.testing.assert_allclose(ds.top_p.sel(loop=r).values, top.values.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(ds.token_angular_distance.sel(loop=r).values,
                                   angular_distance(prev, state)[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(ds.token_relative_update.sel(loop=r).values,
                                   relative_update(prev, state)[0].numpy(), rtol=1e-5)
        pt = p[:-1].gather(-1, tgt[:, None])
        np.testing.assert_allclose(ds.target_p.sel(loop=r).values[:-1], pt[:, 0].numpy(), rtol=1e-5)
        np.testing.assert_array_equal(ds.target_rank.sel(loop=r).values[:-1], ((p[:-1] > pt).sum(-1) + 1).numpy())
        assert np.isnan(ds.token_loss.sel(loop=r).values[-1]) and np.isnan(ds.target_p.sel(loop=r).values[-1])
        assert ds.target_rank.sel(loop=r).values[-1] == 0
    # the means are the per-token values' means, and the probes agree on the curves they share
    np.testing.assert_allclose(ds.loss, ds.token_loss.mean("token"), rtol=1e-5)
    np.testing.assert_allclose(ds.angular_distance, ds.token_angular_distance.mean("token"), rtol=1e-5)
    g = geometry(model, ids, loops=R)
    np.testing.assert_allclose(ds.angular_distance, g.angular_distance, rtol=1e-5)
    np.testing.assert_allclose(ds.relative_update, g.relative_update, rtol=1e-5)
    np.testing.assert_allclose(ds.loss, lens(model, ids, targets, loops=R).loss, rtol=1e-5)
    assert ds.attrs["probe"] == "loop_view" and ds.attrs["training_loops"] == 3 and ds.attrs["tokens_counted"] == 9
    assert "config_json" in ds.attrs and "git_commit" in ds.attrs


def test_given_targets_score_those_tokens():
    model = model_()
    ids = tokens(seed=7, B=1, T=8)
    targets = tokens(seed=8, B=1, T=8)
    targets[0, [1, 5]] = -100
    ds = loop_view(model, ids, 4, targets=targets, top_k=3)
    np.testing.assert_array_equal(ds.target_id.values, targets[0].numpy())
    for r in (1, 4):
        with torch.no_grad():
            ref = float(model(ids, loops=r, targets=targets).loss)
        assert float(ds.loss.sel(loop=r)) == pytest.approx(ref, rel=1e-5)
    assert np.isnan(ds.token_loss.values[:, [1, 5]]).all() and np.isfinite(ds.token_loss.values[:, [0, 7]]).all()
    assert ds.attrs["tokens_counted"] == 6
    # a list, an array and a [1, T] tensor are the same prompt
    a = loop_view(model, ids[0].tolist(), 3)
    b = loop_view(model, ids.numpy()[0], 3)
    np.testing.assert_array_equal(a.top_p.values, b.top_p.values)


def test_readout_chunks_do_not_change_the_numbers(monkeypatch):
    import workbench.probes.view as view

    model, ids = model_(), tokens(seed=4, B=1, T=9)
    whole = loop_view(model, ids, 7)
    for per_chunk in (1, 2, 3):  # loops per readout chunk
        monkeypatch.setattr(view, "_LOGIT_BUDGET", 9 * V * per_chunk)
        chunked = loop_view(model, ids, 7)
        for name in ("loss", "kl_prev", "token_kl_prev", "top_p", "target_p", "target_rank"):
            # KL sums float32 log-prob differences (|log p| ~ 10): a chunk's matmul blocking moves a
            # token's KL by up to ~1e-6; pairing the wrong loops would move it by ~1e-2
            np.testing.assert_allclose(chunked[name], whole[name], rtol=1e-5, atol=2e-6)
        np.testing.assert_array_equal(chunked.top_id, whole.top_id)


def test_pca_is_fitted_on_all_loops_and_tokens():
    model, ids = model_(), tokens(seed=5, B=1, T=8)
    R = 5
    ds = loop_view(model, ids, R, dims=3)
    with torch.no_grad():
        X = model.trace(ids, loops=R).states[:, 0].reshape(-1, cfg().d_model).double().numpy()
    Xc = X - X.mean(0)
    _, S, Vt = np.linalg.svd(Xc, full_matrices=False)
    ref = Xc @ Vt[:3].T
    got = ds.pca.values.reshape(-1, 3)
    # components are defined up to sign
    for k in range(3):
        sign = np.sign(ref[:, k] @ got[:, k])
        np.testing.assert_allclose(got[:, k], sign * ref[:, k], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ds.explained_variance, (S[:3] ** 2) / (S ** 2).sum(), rtol=1e-6)
    assert ds.pca.dims == ("state", "token", "component") and ds.pca.shape == (R + 1, 8, 3)
    assert loop_view(model, ids, R, dims=2).pca.shape == (R + 1, 8, 2)
    # one token and one loop: two points, so one component carries everything and the second is flat
    tiny = loop_view(model, ids[:, :1], 1, dims=3)
    np.testing.assert_allclose(tiny.explained_variance, [1, 0, 0], atol=1e-9)
    assert np.isnan(tiny.loss.values).all()


def test_horizon_dependent_model_shows_loops_of_one_run():
    model = model_(timestep="loop_gate")
    ids = tokens(seed=6, B=1, T=8)
    tg = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    ds = loop_view(model, ids, 5)
    with torch.no_grad():
        for r in (1, 3, 5):
            assert float(ds.loss.sel(loop=r)) == pytest.approx(float(model(ids, loops=r, targets=tg, horizon=5).loss),
                                                               rel=1e-5)
        assert float(ds.loss.sel(loop=2)) != pytest.approx(float(model(ids, loops=2, targets=tg).loss), rel=1e-6)
        wide = loop_view(model, ids, 3, horizon=7)
        assert float(wide.loss.sel(loop=3)) == pytest.approx(float(model(ids, loops=3, targets=tg, horizon=7).loss),
                                                             rel=1e-5)
    assert ds.attrs["horizon"] == 5 and wide.attrs["horizon"] == 7


def test_bad_probe_input_is_named():
    model, ids = model_(), tokens(seed=1, B=2, T=6)
    with pytest.raises(ValueError, match="one prompt"):
        loop_view(model, ids, 3)
    with pytest.raises(ValueError, match="integer token ids"):
        loop_view(model, [0.5, 1.5], 3)
    with pytest.raises(ValueError, match="vocab_size"):
        loop_view(model, [1, V], 3)
    with pytest.raises(ValueError, match="loops=0"):
        loop_view(model, ids[0], 0)
    with pytest.raises(ValueError, match="dims=4"):
        loop_view(model, ids[0], 2, dims=4)
    with pytest.raises(ValueError, match="targets must have the shape"):
        loop_view(model, ids[0], 2, targets=ids[0, :3])
    with pytest.raises(ValueError, match="horizon=2"):
        loop_view(model_(timestep="loop_gate"), ids[0], 3, horizon=2)
    with pytest.raises(TypeError, match="LoopLM"):
        loop_view(object(), ids[0], 2)
    assert loop_view(model, ids[0], 2, top_k=10 * V).sizes["rank"] == V  # top-k clipped to the vocabulary


def test_view_is_saved_as_netcdf(tmp_path):
    import xarray as xr

    ds = loop_view(model_(), tokens(seed=2, B=1, T=7)[0], 4)
    back = xr.load_dataset(save_netcdf(ds, tmp_path / "view.nc"), engine="h5netcdf")
    xr.testing.assert_identical(back, ds)


# ---- the widget ---------------------------------------------------------------------------------------
def LoopExplorer(*args, **kw):
    """The explorer widget (the widget tests skip, the probe tests still run, without ipywidgets)."""
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget", reason="plotly's FigureWidget needs anywidget")
    from workbench.viz.explorer import LoopExplorer

    return LoopExplorer(*args, **kw)


def token_label(tokenizer, token_id):
    from workbench.viz.explorer import token_label

    return token_label(tokenizer, token_id)


def shown_label(tokenizer, token_id):
    """The label as the predictions chart writes it: shortened and escaped for Plotly's text."""
    from workbench.viz.explorer import plotly_text, short_label

    return plotly_text(short_label(token_label(tokenizer, token_id)))


def test_explorer_shows_the_probe_and_names_a_horizon_dependent_model():
    model = model_(timestep="loop_gate")
    R = 5
    ex = LoopExplorer(model, CharTokenizer(), text="loop gates", max_loops=R, device="cpu")
    ref = loop_view(model, CharTokenizer().encode("loop gates"), R)
    for name in ("loss", "kl_prev", "top_p", "pca", "target_rank"):
        np.testing.assert_allclose(ex.view[name], ref[name], rtol=1e-6, equal_nan=True)
    assert "timestep" in ex.message and f"{R}-loop run" in ex.message


def figure_state(ex):
    f = ex.figures
    return (tuple(f["predictions"].data[0].x), tuple(f["curves"].data[2].x), tuple(f["trajectory"].data[3].x),
            f["heatmap"].layout.shapes[0].x0)


def test_slider_reslices_the_dataset_into_every_figure():
    model = model_()
    ex = LoopExplorer(model, CharTokenizer(), text="the loop explorer", max_loops=9, device="cpu")
    v, i = ex.view, ex.token
    assert ex.traces == 1 and set(ex.figures) == {"predictions", "curves", "trajectory", "heatmap"}
    # the default token is the last one whose next token is known, so the true next token shows at once
    assert i == v.sizes["token"] - 2 and v.target_id.values[i] >= 0 and ex.slider.max == 9
    assert "true next" in ex.figures["predictions"].layout.title.text
    # the loop-independent data: full curves and the heatmap
    np.testing.assert_allclose(ex.figures["curves"].data[0].y, v.loss)
    np.testing.assert_allclose(ex.figures["curves"].data[3 * 3].y, v.kl_prev)
    np.testing.assert_allclose(ex.figures["heatmap"].data[0].z, np.log10(v.token_relative_update.values.T), rtol=1e-6)
    assert [s.x0 for s in ex.figures["curves"].layout.shapes[:4]] == [model.cfg.loops] * 4
    before = figure_state(ex)
    for r in (4, 9, 2):
        ex.slider.value = r  # what a person dragging the slider does
        assert ex.loop == r
        f, at = ex.figures, v.sel(loop=r, token=i)
        np.testing.assert_allclose(f["predictions"].data[0].x, at.top_p)
        labels = [y.split(". ", 1)[1] for y in f["predictions"].data[0].y]
        assert labels == [shown_label(ex.tokenizer, int(t)) for t in at.top_id]
        for m, name in enumerate(("loss", "angular_distance", "relative_update", "kl_prev")):
            assert f["curves"].data[3 * m + 2].x == (r,)
            assert f["curves"].data[3 * m + 2].y == pytest.approx((float(v[name].sel(loop=r)),))
            assert f["curves"].layout.shapes[4 + m].x0 == r
        state = v.pca.sel(state=r)
        np.testing.assert_allclose(f["trajectory"].data[0].x, state.sel(component=1))
        np.testing.assert_allclose(f["trajectory"].data[0].z, state.sel(component=3))
        np.testing.assert_allclose([f["trajectory"].data[3][a][0] for a in "xyz"], state.sel(token=i))
        assert f["heatmap"].layout.shapes[0].x0 == r
        assert f"loop <b>{r}</b>" in ex.position.value
        assert figure_state(ex) != before
        before = figure_state(ex)
    assert "past K" in ex.position.value or "short of K" in ex.position.value
    ex.set_loop(model.cfg.loops)  # the programmatic entry moves the slider too
    assert ex.slider.value == model.cfg.loops and "at the training horizon" in ex.position.value
    assert ex.traces == 1  # no slider move ran the model
    with pytest.raises(ValueError, match="loop"):
        ex.set_loop(10)
    # a view drawn now (a browser that missed the draws' one-off messages) starts from what is on screen
    ex.set_loop(3)
    for name, f in ex.figures.items():
        assert f._widget_layout == f._layout_obj._props and len(f._widget_data) == len(f.data), name
    assert "at loop 3" in ex.figures["predictions"]._widget_layout["title"]["text"]
    np.testing.assert_allclose(ex.figures["predictions"]._widget_data[0]["x"], v.sel(loop=3, token=i).top_p)
    # the browser reports each view's draws with the trace edit id it reached (plotly's _js2py_traceDeltas)
    import asyncio

    sent, states = [], []
    for name, f in ex.figures.items():
        f._send_update_msg = lambda style, layout, idx, name=name: sent.append((name, style, layout, idx))
        # (a synced trait set here sends itself by key=name: not a resend)
        f.send_state = lambda key=None, name=name: isinstance(key, list) and states.append((name, tuple(key)))
    pred = ex.figures["predictions"]
    pred._last_trace_edit_id = latest = 7

    def report(fig, edit):
        fig._js2py_traceDeltas = {"trace_deltas": [], "trace_edit_id": edit}

    # a report of the latest edit sends nothing; one behind it (a lost message) gets the figure whole, state
    # and one Plotly.update of every trace and the layout, as on screen now
    report(pred, latest)
    assert sent == [] and states == []
    report(pred, latest - 2)
    assert [s[0] for s in sent] == ["predictions"] and states == [("predictions", ("_widget_data", "_widget_layout"))]
    name, style, layout, idx = sent[0]
    assert "at loop 3" in layout["title"]["text"] and idx == [0]
    np.testing.assert_allclose(style["x"][0], v.sel(loop=3, token=i).top_p)
    report(pred, latest)
    assert len(sent) == 1

    # in a kernel a stale report waits a second: an update still in flight whose report comes meanwhile
    # sends nothing; a view that stays behind gets the figure whole
    async def reports(*ids_then_waits):
        for edit, wait in ids_then_waits:
            report(pred, edit)
            await asyncio.sleep(wait)

    asyncio.run(reports((latest - 1, 0.3), (latest, 1.2)))
    assert len(sent) == 1
    asyncio.run(reports((latest - 1, 1.2)))
    assert [s[0] for s in sent] == ["predictions"] * 2

    # a view drawn from the state its widget was opened with (edit 0) belongs to a model that drops every
    # message (anywidget's 2 s module-load limit): the figure is replaced, in its panel, by a fresh widget
    # holding the same data and layout, and the explorer draws into the new one from then on
    box = ex.sync.panels["heatmap"]
    heat = ex.figures["heatmap"]
    heat._last_trace_edit_id = 3
    report(heat, 0)
    new = ex.figures["heatmap"]
    assert new is not heat and box.children == (new,) and heat.comm is None  # the old widget is closed
    import plotly.io as pio

    assert json.loads(pio.to_json(new)) == json.loads(pio.to_json(heat)) and len(new._widget_data) == len(heat.data)
    assert new._widget_layout == new._layout_obj._props
    report(heat, 0)  # the closed widget's last words change nothing
    assert ex.figures["heatmap"] is new
    for f in ex.figures.values():  # the real senders again
        vars(f).pop("_send_update_msg", None), vars(f).pop("send_state", None)
    ex.set_loop(5)
    assert new.layout.shapes[0].x0 == 5 and new._widget_layout["shapes"][0]["x0"] == 5
    # a browser that kills every new model too is not chased for ever
    for _ in range(5):
        fig = ex.figures["heatmap"]
        fig._last_trace_edit_id = 1
        report(fig, 0)
    assert ex.sync.replacements["heatmap"] == ex.sync.MAX_REPLACEMENTS


def test_slider_moves_never_trace(monkeypatch):
    model = model_()
    ex = LoopExplorer(model, CharTokenizer(), text="count the passes", max_loops=6, device="cpu")
    calls = []
    monkeypatch.setattr(model, "trace", lambda *a, **k: calls.append(a) or pytest.fail("a slider move traced"))
    for r in (6, 1, 3, 5):
        ex.slider.value = r
    ex.token_select.value = 2
    assert calls == [] and ex.traces == 1


def test_token_selector_and_prompt():
    model = model_()
    ex = LoopExplorer(model, CharTokenizer(), text="abcdef", max_loops=5, device="cpu")
    ex.set_loop(3)
    ex.token_select.value = 2
    v = ex.view
    np.testing.assert_allclose(ex.figures["predictions"].data[0].x, v.top_p.sel(loop=3, token=2))
    np.testing.assert_allclose(ex.figures["curves"].data[1].y, v.token_loss.sel(token=2), equal_nan=True)
    np.testing.assert_allclose(ex.figures["trajectory"].data[1].x, v.pca.sel(token=2, component=1))
    assert ex.figures["heatmap"].layout.shapes[1].y0 == 2
    # the true next token is named and coloured
    assert "true next" in ex.figures["predictions"].layout.title.text
    ex.token_select.value = 5
    assert "end of prompt" in ex.figures["predictions"].layout.title.text
    assert ex.traces == 1
    ex.prompt.value = "zyxwvu tsr"
    assert ex.traces == 2 and ex.text == "zyxwvu tsr" and ex.loop == 3
    assert list(ex.view.token_id.values) == CharTokenizer().encode("zyxwvu tsr")
    assert len(ex.token_select.options) == 10 and ex.token == 8 and len(ex.labels) == 10


class QuoteTokenizer(CharTokenizer):
    """Characters as themselves (ids = code points below 97 + 32), so a prompt can hold quotes and <, &."""

    def encode(self, text):
        return [ord(c) - 32 for c in text]


def test_titles_show_quotes_and_brackets_as_typed_and_name_the_model():
    from workbench.viz.explorer import plotly_text, short_label

    model = model_()
    text = 'say "hi" <b>&'
    ex = LoopExplorer(model, QuoteTokenizer(), text=text, max_loops=4, device="cpu", source="a test model")
    ex.set_token(text.index('"'))  # followed by h: the title names the quote it follows
    title = ex.figures["predictions"].layout.title.text
    assert '“"”' in title and "&quot;" not in title and "&#" not in title
    ex.set_token(text.index('"') - 1)  # followed by a quote: the subtitle shows the quote itself
    assert 'true next ":' in ex.figures["predictions"].layout.title.text
    ex.set_token(text.index("<") - 1)  # < would start a tag in Plotly's text: it is the entity Plotly decodes
    assert "true next &lt;:" in ex.figures["predictions"].layout.title.text
    assert plotly_text("a & <b> \"q\" 'x'") == "a &amp; &lt;b&gt; \"q\" 'x'"
    assert short_label("␣" * 12 + "x") == "␣×12x" and short_label("abcdefghijklmnopq", 8) == "abcdefg…"
    # the heatmap's rows are the prompt's tokens, the model box says which model is shown, the slider marks K
    h = ex.figures["heatmap"].layout.yaxis
    assert list(h.tickvals) == list(range(len(text))) and h.ticktext[4] == plotly_text(f"4: {ex.labels[4]}")
    assert "a test model" in ex.path.placeholder and "a test model" in ex.source.value
    assert f"K={model.cfg.loops}" in ex.k_mark.value and ex._uid in ex.k_mark.value
    assert ex.figures["trajectory"].data[1].marker.showscale  # the loop colour has its key


def test_trajectory_axes_hold_the_path_not_the_outliers():
    model = model_()
    ex = LoopExplorer(model, CharTokenizer(), text="a b c d e f g h i j", max_loops=6, device="cpu", dims=2)
    pca = ex.view.pca.values.copy()
    pca[3, 0] = [4e4, -4e4]  # one far state, as an attention-sink token makes
    ex.view["pca"] = (ex.view.pca.dims, pca)
    ex.set_token(5)
    (x0, x1), (y0, y1) = ex.figures["trajectory"].layout.xaxis.range, ex.figures["trajectory"].layout.yaxis.range
    path = pca[:, 5]
    assert x0 <= path[:, 0].min() and path[:, 0].max() <= x1 and y0 <= path[:, 1].min() and path[:, 1].max() <= y1
    assert x1 < 1e4 and y0 > -1e4  # the outlier does not set the scale
    ex.set_token(0)
    assert ex.figures["trajectory"].layout.xaxis.range[1] >= 4e4  # unless it is on the path shown


def test_a_run_folder_shows_in_the_model_box(tmp_path):
    model = model_()
    ck = save_checkpoint(tmp_path / "run", model, [], {"step": 1, "model_config": model.cfg.to_json()})
    ex = LoopExplorer(str(ck), CharTokenizer(), text="abc", max_loops=3, device="cpu")
    assert ex.path.value == str(ck) and str(ck) in ex.source.value


def test_bad_input_shows_a_message_not_a_traceback(tmp_path):
    model = model_()
    ex = LoopExplorer(model, CharTokenizer(), text="fine text", max_loops=4, device="cpu")
    view = ex.view
    ex.prompt.value = ""
    assert "empty" in ex.message and ex.view is view and ex.traces == 1
    assert "wb-error" in ex.status.value
    long = "x" * (cfg().max_seq_len + 17)
    ex.prompt.value = long
    assert f"context is {cfg().max_seq_len}" in ex.message and ex.view.sizes["token"] == cfg().max_seq_len
    # a path that is not there
    ex.path.value = str(tmp_path / "nope")
    ex.load_button.click()
    assert "does not exist" in ex.message and "nope" in ex.message and ex.model is model
    # a checkpoint whose weights are of another config than its state.json says
    ck = save_checkpoint(tmp_path / "run", model_(), [], {"step": 1, "model_config": cfg().to_json()})
    state = json.loads((ck / "state.json").read_text())
    state["model_config"] = cfg(d_model=48, n_heads=4).to_json()
    (ck / "state.json").write_text(json.dumps(state))
    ex.path.value = str(ck)
    ex.load_button.click()
    assert "another config" in ex.message and ex.model is model
    # a tokenizer with more ids than the model has
    class Big(CharTokenizer):
        vocab_size = V + 50
    ex._guard(lambda: ex.set_model(model_(), Big()))()
    assert "tokenizer has" in ex.message and ex.model is model
    # the widget still works afterwards
    ex.prompt.value = "fine again"
    assert ex.message == "" and ex.traces == 3
    # an empty prompt at construction: the model is there, the first prompt typed is traced
    ex3 = LoopExplorer(model, CharTokenizer(), text="", max_loops=4, device="cpu")
    assert "empty" in ex3.message and ex3.view is None and ex3.model is model
    ex3.prompt.value = "now"
    assert ex3.message == "" and ex3.view.sizes["token"] == 3 and ex3.traces == 1
    # a bad path at construction raises there, naming it (a widget without a model would only say so on screen)
    with pytest.raises(ExplorerInputError, match="does not exist") as e:
        LoopExplorer(str(tmp_path / "missing"), device="cpu")
    assert "missing" in str(e.value)


# ---- finding the model to show (workbench.experiments) ------------------------------------------------------
def test_quickstart_runs_open_in_the_explorer(tmp_path):
    from workbench.data.corpus import train_tokenizer
    from workbench.experiments import find_quickstart_checkpoint, open_model

    runs = tmp_path / "runs"
    assert find_quickstart_checkpoint(runs) is None
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], vocab_size=300)
    models = {}
    for n, (key, status) in enumerate([("old", "done"), ("new", "done"), ("running", "running"), ("empty", "done")]):
        run = runs / "quickstart" / "train" / key
        run.mkdir(parents=True)
        if key != "empty":  # a finished run without a checkpoint is skipped
            model = model_(seed=n, vocab_size=tok.vocab_size)
            where = run / "model" if key == "old" else run  # train_run's older layout, and the one run folder
            save_checkpoint(where, model, [], {"step": 1, "model_config": model.cfg.to_json()})
            tok.save(where / "tokenizer.json")
            models[key] = model
        (run / "run.json").write_text(json.dumps({"status": status, "finished": f"2026-11-0{n + 1}T00:00:00"}))
    (runs / "quickstart" / "train" / "broken").mkdir()
    (runs / "quickstart" / "train" / "broken" / "run.json").write_text("{not json")
    found = find_quickstart_checkpoint(runs)
    assert found == runs / "quickstart" / "train" / "new"
    model, t2, source = open_model(runs_dir=runs, device="cpu")
    assert t2.fingerprint == tok.fingerprint and str(found) in source
    ids = torch.tensor([tok.encode("def f(x):")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, models["new"](ids).logits)
    ex = LoopExplorer(str(runs / "quickstart" / "train" / "old"), text="def g(y):", max_loops=3, device="cpu")
    assert ex.message == "" and list(ex.view.token_id.values) == tok.encode("def g(y):")
    assert "".join(ex.labels).replace("␣", " ") == "def g(y):"
    assert "trained at K=" in ex.source.value
    with torch.no_grad():
        torch.testing.assert_close(ex.model(ids).logits, models["old"](ids).logits)
    # a 256-id checkpoint without tokenizer.json is read as bytes
    m = model_(vocab_size=256)
    save_checkpoint(tmp_path / "bytes", m, [], {"step": 1, "model_config": m.cfg.to_json()})
    ex.path.value = str(tmp_path / "bytes")
    ex.load_button.click()
    from workbench.data.corpus import ByteTokenizer

    assert ex.message == "" and isinstance(ex.tokenizer, ByteTokenizer) and ex.model.cfg.vocab_size == 256


def test_tiny_model_trains_and_explores(monkeypatch, demo_trained):
    """tiny_model gives the demo model (trained once per session, conftest) and the explorer shows it learned."""
    import numpy as np

    import workbench.experiments.explorer as E
    from helpers import DEMO_STEPS
    from workbench.data.corpus import stdlib_bytes
    from workbench.viz.explorer import DEFAULT_TEXT

    def trained(steps, seed, progress):
        assert (steps, seed) == (DEMO_STEPS, 0)
        return demo_trained

    monkeypatch.setattr(E, "demo_trainer", trained)
    model, tok = E.tiny_model(steps=DEMO_STEPS, seed=0, progress=False)
    assert model is demo_trained.model and not model.training
    assert model.cfg.vocab_size == 256 and tok.decode(tok.encode("é ok")) == "é ok"
    # learned: on the default prompt the loss at K is well below the best context-free model's, the
    # cross-entropy of the prompt under the training text's byte frequencies (3.38 nats; K gives ~2.86)
    data = np.frombuffer(stdlib_bytes(2_000_000), dtype=np.uint8)
    q = np.bincount(data[:int(0.95 * len(data))], minlength=256) + 1.0
    text = np.frombuffer(DEFAULT_TEXT.encode(), dtype=np.uint8)
    unigram = float(-np.log(q[text[1:]] / q.sum()).mean())
    seen = LoopExplorer(model, tok, max_loops=4)
    assert float(seen.view.loss.sel(loop=4)) < unigram - 0.25, (seen.view.loss.values, unigram)
    ex = LoopExplorer(model, tok, text="import os\n", max_loops=6)
    assert ex.view.sizes["loop"] == 6 and ex.labels[-1] == "\\n"
    ex.set_loop(6)
    assert "extrapolating 2 loops past K" in ex.position.value
