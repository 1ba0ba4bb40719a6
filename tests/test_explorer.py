"""The loop explorer: cached numbers against slow per-loop forwards, widgets driven from Python, bad input."""

import json

import numpy as np
import pytest
import torch

from helpers import V, cfg, perturb, tokens
from workbench import LoopLM
from workbench.probes import geometry, lens
from workbench.probes._common import angular_distance, relative_update
from workbench.train import save_checkpoint

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget", reason="plotly's FigureWidget needs anywidget")
from workbench.viz.explorer import (ByteTokenizer, LoopExplorer, compute_view, find_quickstart_checkpoint,  # noqa: E402
                                    load_checkpoint, tiny_model, token_label)


class CharTokenizer:
    """Characters a..z plus space etc. mapped into the tiny helper vocabulary (97 ids)."""

    vocab_size = V

    def encode(self, text):
        return [ord(c) % V for c in text]

    def decode(self, ids):
        return "".join(chr(int(i) + 32) for i in ids)


def model_(seed=0, **kw):
    return perturb(LoopLM(cfg(**kw), seed=seed), scale=0.05, seed=seed + 1).eval()


def probs(model, ids, r, **kw):
    """Softmax of a separate forward with r loops (the slow obvious way)."""
    with torch.no_grad():
        if r == 0:
            return torch.softmax(model.readout(model.embed_prelude(ids)), -1)
        return torch.softmax(model(ids, loops=r, **kw).logits, -1)


def test_view_equals_separate_forwards_per_loop():
    model = model_()
    ids = tokens(seed=3, B=1, T=10)
    R = 6
    v = compute_view(model, ids[0].numpy(), R, top_k=5)
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    for r in range(1, R + 1):
        with torch.no_grad():
            out = model(ids, loops=r, targets=targets)
            prev = model(ids, loops=r - 1).state if r > 1 else model.embed_prelude(ids)
        assert v.loss[r - 1] == pytest.approx(float(out.loss), rel=1e-5)
        p, q = probs(model, ids, r)[0], probs(model, ids, r - 1)[0]
        kl = (p * (p.log() - q.log())).sum(-1)
        np.testing.assert_allclose(v.token_kl_prev[r - 1], kl.numpy(), rtol=1e-4, atol=1e-6)
        assert v.kl_prev[r - 1] == pytest.approx(float(kl.mean()), rel=1e-4, abs=1e-7)
        top = p.topk(5, dim=-1)
        np.testing.assert_array_equal(v.top_ids[r - 1], top.indices.numpy())
        np.testing.assert_allclose(v.top_p[r - 1], top.values.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(v.token_angle[r - 1], angular_distance(prev, out.state)[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(v.token_update[r - 1], relative_update(prev, out.state)[0].numpy(), rtol=1e-5)
        tgt = ids[0, 1:]
        np.testing.assert_allclose(v.target_p[r - 1, :-1], p[:-1].gather(-1, tgt[:, None])[:, 0].numpy(), rtol=1e-5)
        ranks = (p[:-1] > p[:-1].gather(-1, tgt[:, None])).sum(-1) + 1
        np.testing.assert_array_equal(v.target_rank[r - 1, :-1], ranks.numpy())
        assert np.isnan(v.token_loss[r - 1, -1]) and np.isnan(v.target_p[r - 1, -1])
    # and the probes agree on the curves they share
    g = geometry(model, ids, loops=R)
    np.testing.assert_allclose(v.angle, g.angular_distance.values, rtol=1e-5)
    np.testing.assert_allclose(v.update, g.relative_update.values, rtol=1e-5)
    np.testing.assert_allclose(v.loss, lens(model, ids, targets, loops=R).loss.values, rtol=1e-5)


def test_readout_chunks_do_not_change_the_numbers(monkeypatch):
    import workbench.viz.explorer as E

    model, ids = model_(), tokens(seed=4, B=1, T=9)[0].numpy()
    whole = compute_view(model, ids, 7)
    for per_chunk in (1, 2, 3):  # loops per readout chunk
        monkeypatch.setattr(E, "_LOGIT_BUDGET", 9 * V * per_chunk)
        chunked = compute_view(model, ids, 7)
        for name in ("loss", "kl_prev", "token_kl_prev", "top_p", "target_p", "target_rank"):
            np.testing.assert_allclose(getattr(chunked, name), getattr(whole, name), rtol=1e-6, atol=1e-8)
        np.testing.assert_array_equal(chunked.top_ids, whole.top_ids)


def test_pca_is_fitted_on_all_loops_and_tokens():
    model, ids = model_(), tokens(seed=5, B=1, T=8)
    R = 5
    v = compute_view(model, ids[0].numpy(), R, dims=3)
    with torch.no_grad():
        X = model.trace(ids, loops=R).states[:, 0].reshape(-1, cfg().d_model).double().numpy()
    Xc = X - X.mean(0)
    _, S, Vt = np.linalg.svd(Xc, full_matrices=False)
    ref = Xc @ Vt[:3].T
    got = v.proj.reshape(-1, 3)
    # components are defined up to sign
    for k in range(3):
        sign = np.sign(ref[:, k] @ got[:, k])
        np.testing.assert_allclose(got[:, k], sign * ref[:, k], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(v.explained, (S[:3] ** 2) / (S ** 2).sum(), rtol=1e-6)
    assert v.proj.shape == (R + 1, 8, 3)
    assert compute_view(model, ids[0].numpy(), R, dims=2).proj.shape == (R + 1, 8, 2)


def test_horizon_dependent_model_shows_loops_of_one_run():
    model = model_(timestep="loop_gate")
    ids = tokens(seed=6, B=1, T=8)
    R = 5
    ex = LoopExplorer(model, CharTokenizer(), text="loop gates", max_loops=R, device="cpu")
    t = torch.as_tensor(ex.view.tokens)[None]
    tg = torch.cat([t[:, 1:], torch.full((1, 1), -100)], 1)
    with torch.no_grad():
        for r in (1, 3, 5):
            ref = float(model(t, loops=r, targets=tg, horizon=R).loss)
            assert ex.view.loss[r - 1] == pytest.approx(ref, rel=1e-5)
        assert ex.view.loss[1] != pytest.approx(float(model(t, loops=2, targets=tg).loss), rel=1e-6)
    assert "timestep" in ex.message and f"{R}-loop run" in ex.message
    del ids


def figure_state(ex):
    f = ex.figures
    return (tuple(f["predictions"].data[0].x), tuple(f["curves"].data[2].x), tuple(f["trajectory"].data[3].x),
            f["heatmap"].layout.shapes[0].x0)


def test_slider_reslices_the_cache_into_every_figure():
    model = model_()
    ex = LoopExplorer(model, CharTokenizer(), text="the loop explorer", max_loops=9, device="cpu")
    v, i = ex.view, ex.token
    assert ex.traces == 1 and set(ex.figures) == {"predictions", "curves", "trajectory", "heatmap"}
    assert i == len(v.tokens) - 1 and ex.slider.max == 9
    # the loop-independent data: full curves and the heatmap
    np.testing.assert_allclose(ex.figures["curves"].data[0].y, v.loss)
    np.testing.assert_allclose(ex.figures["curves"].data[3 * 3].y, v.kl_prev)
    np.testing.assert_allclose(ex.figures["heatmap"].data[0].z, np.log10(v.token_update.T), rtol=1e-6)
    assert [s.x0 for s in ex.figures["curves"].layout.shapes[:4]] == [model.cfg.loops] * 4
    before = figure_state(ex)
    for r in (4, 9, 2):
        ex.slider.value = r  # what a person dragging the slider does
        assert ex.loop == r
        f = ex.figures
        np.testing.assert_allclose(f["predictions"].data[0].x, v.top_p[r - 1, i])
        labels = [y.split(". ", 1)[1] for y in f["predictions"].data[0].y]
        assert labels == [token_label(ex.tokenizer, int(t)) for t in v.top_ids[r - 1, i]]
        for m, name in enumerate(("loss", "angle", "update", "kl_prev")):
            assert f["curves"].data[3 * m + 2].x == (r,)
            assert f["curves"].data[3 * m + 2].y == pytest.approx((getattr(v, name)[r - 1],))
            assert f["curves"].layout.shapes[4 + m].x0 == r
        np.testing.assert_allclose(f["trajectory"].data[0].x, v.proj[r, :, 0])
        np.testing.assert_allclose(f["trajectory"].data[0].z, v.proj[r, :, 2])
        np.testing.assert_allclose([f["trajectory"].data[3][a][0] for a in "xyz"], v.proj[r, i])
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


def test_token_selector_and_prompt():
    model = model_()
    ex = LoopExplorer(model, CharTokenizer(), text="abcdef", max_loops=5, device="cpu")
    ex.set_loop(3)
    ex.token_select.value = 2
    v = ex.view
    np.testing.assert_allclose(ex.figures["predictions"].data[0].x, v.top_p[2, 2])
    np.testing.assert_allclose(ex.figures["curves"].data[1].y, v.token_loss[:, 2], equal_nan=True)
    np.testing.assert_allclose(ex.figures["trajectory"].data[1].x, v.proj[:, 2, 0])
    assert ex.figures["heatmap"].layout.shapes[1].y0 == 2
    # the true next token is named and coloured
    assert "true next" in ex.figures["predictions"].layout.title.text
    assert ex.traces == 1
    ex.prompt.value = "zyxwvu tsr"
    assert ex.traces == 2 and ex.text == "zyxwvu tsr" and ex.loop == 3
    assert list(ex.view.tokens) == CharTokenizer().encode("zyxwvu tsr")
    assert len(ex.token_select.options) == 10 and ex.token == 9


def test_bad_input_shows_a_message_not_a_traceback(tmp_path):
    model = model_()
    ex = LoopExplorer(model, CharTokenizer(), text="fine text", max_loops=4, device="cpu")
    view = ex.view
    ex.prompt.value = ""
    assert "empty" in ex.message and ex.view is view and ex.traces == 1
    assert "wb-error" in ex.status.value
    long = "x" * (cfg().max_seq_len + 17)
    ex.prompt.value = long
    assert f"context is {cfg().max_seq_len}" in ex.message and len(ex.view.tokens) == cfg().max_seq_len
    # a path that is not there
    ex.path.value = str(tmp_path / "nope")
    ex.load_button.click()
    assert "no checkpoint" in ex.message and ex.model is model
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
    assert ex3.message == "" and len(ex3.view.tokens) == 3 and ex3.traces == 1
    # a bad checkpoint at construction: the widget shows the message, the figures stay empty
    ex2 = LoopExplorer(str(tmp_path / "missing"), device="cpu")
    assert "no checkpoint" in ex2.message and ex2.view is None
    assert ex2.figures["predictions"].data[0].x == ()


def test_checkpoints_from_quickstart_runs(tmp_path):
    from workbench.data.corpus import train_tokenizer

    runs = tmp_path / "runs"
    assert find_quickstart_checkpoint(runs) is None
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], vocab_size=300)
    models = {}
    for n, (key, status) in enumerate([("old", "done"), ("new", "done"), ("running", "running")]):
        run = runs / "quickstart" / "train" / key
        model = model_(seed=n, vocab_size=tok.vocab_size)
        save_checkpoint(run / "model", model, [], {"step": 1, "model_config": model.cfg.to_json()})
        tok.save(run / "model" / "tokenizer.json")
        (run / "run.json").write_text(json.dumps({"status": status, "finished": f"2026-11-0{n + 1}T00:00:00"}))
        models[key] = model
    (runs / "quickstart" / "train" / "broken").mkdir()
    (runs / "quickstart" / "train" / "broken" / "run.json").write_text("{not json")
    found = find_quickstart_checkpoint(runs)
    assert found == runs / "quickstart" / "train" / "new" / "model"
    model, t2 = load_checkpoint(found, device="cpu")
    assert t2.fingerprint == tok.fingerprint
    ids = torch.tensor([tok.encode("def f(x):")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, models["new"](ids).logits)
    ex = LoopExplorer(str(found.parent), text="def g(y):", max_loops=3, device="cpu")  # a run folder works too
    assert ex.message == "" and list(ex.view.tokens) == tok.encode("def g(y):")
    assert "".join(ex.view.labels).replace("␣", " ") == "def g(y):"
    assert "trained at K=" in ex.source.value
    # a 256-id checkpoint without tokenizer.json is read as bytes
    m = model_(vocab_size=256)
    ck = save_checkpoint(tmp_path / "bytes", m, [], {"step": 1, "model_config": m.cfg.to_json()})
    _, bt = load_checkpoint(ck, device="cpu")
    assert isinstance(bt, ByteTokenizer)


def test_tiny_model_trains_and_explores():
    model, tok = tiny_model(steps=1, seed=0, progress=False)
    assert model.cfg.vocab_size == 256 and tok.decode(tok.encode("é ok")) == "é ok"
    ex = LoopExplorer(model, tok, text="import os\n", max_loops=6)
    assert ex.view.max_loops == 6 and ex.view.labels[-1] == "\\n"
    ex.set_loop(6)
    assert "extrapolating 2 loops past K" in ex.position.value
