"""Inkling2Loop (transformers) through the probes' Loopable: logits against the transformers model itself at
every loop count, the structured carried state against the model's own layer outputs, the probes on it (lost
gradient against truncated backward passes, interaction against a single skip), the explorer's slider, and bad
input named."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ink = pytest.importorskip("transformers.models.inkling2_loop", reason="needs transformers with Inkling2Loop")

from workbench import probes  # noqa: E402
from workbench.probes.inkling import InklingState  # noqa: E402
from workbench.probes.protocol import Loopable  # noqa: E402

TINY = dict(vocab_size=256, unpadded_vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
            sliding_window_size=16, d_rel=8, rel_extent=32, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_layers_per_attn_res_block=2, loop_layer_index_start=2, loop_layer_index_end=4,
            loop_num_passes=3, loop_gate_rank=8, max_position_embeddings=128, eos_token_id=None,
            # init 5x the default: the loops then move the logits by whole units, not 1e-4
            initializer_range=0.1)
# a core of four layers (two attention-residual blocks, so the messages read a block of the previous pass)
# holding a full-attention loop layer, beside the sliding-window ones of TINY
WIDE = dict(TINY, num_hidden_layers=8, loop_layer_index_end=6,
            layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid_sliding", "hybrid",
                         "hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Run this module on one thread: its matrices are tiny, and two threads only contend (6x slower here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def build(seed=0, **kw):
    """Return a random Inkling2LoopForCausalLM in eval mode, with its zero-initialised queries and taps made random.

    At init the attention-residual and message queries are zero (uniform mixing), which would let a wrong
    choice of sources go unseen.
    """
    torch.manual_seed(seed)
    model = ink.Inkling2LoopForCausalLM(ink.Inkling2LoopTextConfig(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


@pytest.fixture(scope="module")
def tiny():
    """Return the random tiny model of the issue's config (core: layers 2 and 3)."""
    return build(**TINY)


@pytest.fixture(scope="module")
def wide():
    """Return the random model with a four-layer core holding a full-attention layer."""
    return build(seed=3, **WIDE)


def ids_(seed=0, B=2, T=24):
    """Return seeded tokens [B, T]; T > sliding_window_size, so the window masks something."""
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def targets_for(x):
    """Return the next tokens of x, -100 at the last position."""
    y = x.roll(-1, 1)
    y[:, -1] = -100
    return y


def at_loops(model, ids, r, **kw):
    """Return the transformers model's output with config.loop_num_passes = r (the slow, obvious reference)."""
    old = model.config.loop_num_passes
    model.config.loop_num_passes = r
    try:
        with torch.no_grad():
            return model(ids, use_cache=False, **kw)
    finally:
        model.config.loop_num_passes = old


# ---- equivalence with the transformers model --------------------------------------------------------
@pytest.mark.parametrize("which", ["tiny", "wide"])
def test_logits_after_r_loops_equal_the_model_at_r_passes(which, request):
    model = request.getfixturevalue(which)
    lp = probes.from_transformers(model)
    ids = ids_(1)
    with torch.no_grad():
        _, carried = lp.run(ids, 5)
        got = [lp.readout(carried[r]) for r in range(1, 6)]
    for r in range(1, 6):
        ref = at_loops(model, ids, r).logits
        torch.testing.assert_close(got[r - 1], ref, atol=1e-5, rtol=0)
    # the loops matter: a Loopable that ignored them could not pass the check above
    assert (got[0] - got[1]).abs().max() > 0.1
    # with the cache its forward makes by default, the model gives the same logits
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, got[model.config.loop_num_passes - 1], atol=1e-5, rtol=0)


def test_carried_state_is_what_the_model_carries(wide):
    model, lp = wide, probes.from_transformers(wide)
    ids = ids_(2, B=1, T=20)
    cfg = model.config
    p, s = cfg.loop_layer_index_start, cfg.loop_layer_index_end - cfg.loop_layer_index_start
    K = 3
    hidden = at_loops(model, ids, K, output_hidden_states=True).hidden_states  # embeddings, then each layer call
    with torch.no_grad():
        h0, carried = lp.run(ids, K)
    assert isinstance(h0, InklingState) and carried[0] is h0  # state 0 is the prelude's output
    for t in range(K + 1):
        assert isinstance(carried[t], InklingState)
        torch.testing.assert_close(lp.state(carried[t]), hidden[p + t * s], atol=1e-6, rtol=0)
        # block states: the prelude's, then those the pass added (one per block boundary in the core)
        assert carried[t].blocks.shape[-2] == h0.blocks.shape[-2] + (s // cfg.n_layers_per_attn_res_block) * (t > 0)
        torch.testing.assert_close(carried[t].blocks[..., :h0.blocks.shape[-2], :], h0.blocks)
    assert lp.training_loops == cfg.loop_num_passes and lp.coda_reads == "carried"
    assert lp.places(2) == ["prelude.0", "prelude.1", "core.1.0", "core.1.1", "core.1.2", "core.1.3",
                            "core.2.0", "core.2.1", "core.2.2", "core.2.3", "coda.0", "coda.1"]


def test_lens_reads_out_each_loop_as_the_model_at_that_many_passes(tiny):
    lp = probes.from_transformers(tiny)
    x = ids_(3)
    y = targets_for(x)
    le = probes.lens(lp, x, y, loops=4)
    keep = y != -100
    for t in range(1, 5):
        ref = at_loops(tiny, x, t).logits
        assert float(le.loss.sel(loop=t)) == pytest.approx(float(F.cross_entropy(ref[keep], y[keep])), rel=1e-5)
        assert float(le.accuracy.sel(loop=t)) == pytest.approx(float((ref.argmax(-1) == y)[keep].float().mean()))


# ---- the probes on it -----------------------------------------------------------------------------------
def test_every_probe_runs_finite_and_shaped(tiny):
    lp = probes.from_transformers(tiny)
    x = ids_(4, B=2, T=18)
    y = targets_for(x)
    r = 4
    geo = probes.geometry(lp, x, loops=r)
    assert dict(geo.sizes) == {"loop": r, "occurrence": 2 + 2 * r + 2}
    assert list(geo.occurrence.values[:3]) == ["prelude.0", "prelude.1", "core.1.0"]
    for v in geo.data_vars.values():
        assert np.isfinite(v.values).all()
    le = probes.lens(lp, x, y, loops=r)
    assert dict(le.sizes) == {"loop": r} and all(np.isfinite(v.values).all() for v in le.data_vars.values())
    ha = probes.halting(lp, x, y, loops=r, threshold=[0.0, 0.05])
    assert ha.exit_loop.shape == (2, 2, 18) and (ha.exit_loop.sel(threshold=0.0).values == r).all()
    assert float(ha.loss_fixed) == pytest.approx(float(le.loss.sel(loop=r)), rel=1e-6)
    lg = probes.lost_gradient(lp, x, y, loops=r)
    assert dict(lg.sizes) == {"k": r, "loop": r + 1}
    assert float(lg.lost.sel(k=r)) == 0.0 and float(lg.lost.sel(k=1)) > 0.0
    assert np.isfinite(lg.adjoint_norm.values).all() and (lg.adjoint_norm.values > 0).all()
    assert np.isfinite(lg.attrs["rho"]) and {"lost_prelude", "lost_embedding"} <= set(lg.data_vars)
    it = probes.interaction(lp, x, loops=3)
    n = 2 + 2 * 3 + 2
    assert it.interaction.shape == (n, n) and it.sizes["lag"] == 3
    C = it.interaction.values
    assert np.isnan(C[np.tril_indices(n)]).all() and np.isfinite(C[np.triu_indices(n, 1)]).all()
    assert np.isfinite(float(it.terminal_to_core))
    view = probes.loop_view(lp, x[0], 5, top_k=4)
    assert dict(view.sizes) == {"loop": 5, "token": 18, "rank": 4, "state": 6, "component": 3}
    for name in ("loss", "kl_prev", "angular_distance", "top_p", "pca", "explained_variance"):
        assert np.isfinite(view[name].values).all(), name
    assert view.attrs["training_loops"] == 3


def test_loop_view_and_geometry_measure_the_hidden_state(tiny):
    lp = probes.from_transformers(tiny)
    x = ids_(5, B=1, T=16)
    with torch.no_grad():
        _, carried = lp.run(x, 4)
    hs = [c.hidden for c in carried]
    geo = probes.geometry(lp, x, loops=4)
    view = probes.loop_view(lp, x[0], 4)
    for t in range(1, 5):
        a = torch.arccos(F.cosine_similarity(hs[t - 1], hs[t], dim=-1).clamp(-1, 1)) / torch.pi
        assert float(geo.angular_distance.sel(loop=t)) == pytest.approx(float(a.mean()), rel=1e-4)
        assert float(view.angular_distance.sel(loop=t)) == pytest.approx(float(a.mean()), rel=1e-4)
        p = torch.softmax(at_loops(tiny, x, t).logits[0], -1)
        np.testing.assert_allclose(view.top_p.sel(loop=t).values[:, 0], p.max(-1).values.numpy(), rtol=1e-5)


def test_lost_gradient_equals_truncated_backward_passes(tiny):
    lp = probes.from_transformers(tiny)
    x = ids_(6, B=1, T=12)
    y = targets_for(x)
    r = 3
    lg = probes.loop_gradients(lp, x, y, loops=r)
    core = dict(lp.core.named_parameters())
    emb = lp.once["embedding"].weight
    keep = y != -100
    for k in range(1, r + 1):
        h0 = lp.prelude(x)
        h = h0
        for t in range(r):
            if t == r - k and k < r:  # the state entering loop r-k+1 (hidden and blocks) is cut
                h = InklingState(h.hidden.detach(), h.blocks.detach())
            h = lp.step(h, h0, t)
        loss = F.cross_entropy(lp.readout(h)[keep], y[keep])
        ref = torch.autograd.grad(loss, [*core.values(), emb], allow_unused=True)
        got = lg.truncated(k)
        for (name, p), g in zip(core.items(), ref[:-1]):
            torch.testing.assert_close(got[name], torch.zeros_like(p) if g is None else g, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(lg.once["embedding"][k - 1]["weight"], ref[-1], atol=1e-6, rtol=1e-4)
    # the message gates act from loop 2 on: loop 1 gives them no gradient, later loops do
    gate = lg.per_loop["core.0.q_message_gate.down_proj.weight"]
    assert float(gate[0].abs().max()) == 0.0 and float(gate[1:].abs().max()) > 0.0


def test_interaction_equals_one_skip_by_hand(tiny):
    lp = probes.from_transformers(tiny)
    x = ids_(7, B=2, T=10)
    r = 2
    it = probes.interaction(lp, x, loops=r, chunk=3)  # chunks smaller than the sources: several variant passes

    def delta(skip):
        """Return every occurrence's update u_j with occurrence `skip` (or none) skipped."""
        out = {}

        def hook(name, x_in, x_out):
            out[name] = x_out - x_in
            return x_in if name == skip else None

        with torch.no_grad():
            _, carried = lp.run(x, r, hook=hook)
            lp.readout(carried[-1], hook=hook)
        return out

    base = delta(None)
    for src, tgt in (("prelude.1", "core.2.1"), ("core.1.0", "coda.1"), ("core.1.1", "core.2.0")):
        moved = delta(src)
        c = float((moved[tgt] - base[tgt]).float().norm(dim=-1).mean() / base[tgt].float().norm(dim=-1).mean())
        assert float(it.interaction.sel(source=src, target=tgt)) == pytest.approx(c, rel=1e-4)


# ---- the explorer ---------------------------------------------------------------------------------------
class Bytes:
    """Bytes as token ids (the tiny model's vocabulary is 256)."""

    vocab_size = 256

    def encode(self, text):
        """Return the UTF-8 bytes of text."""
        return list(text.encode())

    def decode(self, ids):
        """Return the bytes decoded, undecodable ones replaced."""
        return bytes(int(i) for i in ids).decode(errors="replace")


def LoopExplorer(*args, **kw):
    """Return the explorer widget (skipped without ipywidgets and anywidget)."""
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget", reason="plotly's FigureWidget needs anywidget")
    from workbench.viz.explorer import LoopExplorer

    return LoopExplorer(*args, **kw)


def figure_data(ex):
    """Return the loop-dependent data of the four figures."""
    f = ex.figures
    return (tuple(f["predictions"].data[0].x), tuple(f["curves"].data[2].y), tuple(f["trajectory"].data[0].x),
            tuple(f["trajectory"].data[3].x), f["heatmap"].layout.shapes[0].x0)


def test_explorer_slider_moves_its_figures(tiny):
    ex = LoopExplorer(tiny, tokenizer=Bytes(), text="def f(x): return x", device="cpu")  # the transformers model
    assert ex.message == "" and isinstance(ex.model, Loopable) and ex.traces == 1
    K = tiny.config.loop_num_passes
    assert ex.slider.max == 4 * K and ex.view.sizes["loop"] == 4 * K
    assert "Inkling2LoopForCausalLM 2+2x3+2" in ex.source.value and ex.gen_button.disabled
    v, i = ex.view, ex.token
    before = figure_data(ex)
    for r in (5, 12, 1):
        ex.slider.value = r  # what a person dragging the slider does
        assert ex.loop == r and f"loop <b>{r}</b>" in ex.position.value
        np.testing.assert_allclose(ex.figures["predictions"].data[0].x, v.top_p.sel(loop=r, token=i))
        np.testing.assert_allclose(ex.figures["trajectory"].data[0].x, v.pca.sel(state=r, component=1))
        assert ex.figures["heatmap"].layout.shapes[0].x0 == r
        assert figure_data(ex) != before
        before = figure_data(ex)
    assert ex.traces == 1  # no slider move ran the model
    # the Loopable itself opens too, and shows the same view
    lp = probes.from_transformers(tiny)
    ex2 = LoopExplorer(lp, tokenizer=Bytes(), text="def f(x): return x", max_loops=5, device="cpu")
    np.testing.assert_allclose(ex2.view.top_p.values, v.top_p.sel(loop=slice(1, 5)).values, rtol=1e-6)
    ex2.gen_button.click()  # a Loopable has no generation: a message, no traceback
    assert "generate needs a LoopLM" in ex2.message


# ---- bad input ------------------------------------------------------------------------------------------
def test_bad_input_is_named(tiny):
    import transformers

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, architectures=["LlamaForCausalLM"]))
    with pytest.raises(ValueError, match="LlamaForCausalLM") as e:
        probes.from_transformers(llama)
    assert "Inkling2LoopForCausalLM" in str(e.value)  # and what it knows
    with pytest.raises(ValueError, match="does not know object"):
        probes.from_transformers(object())
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"loops={bad!r}"):
            probes.from_transformers(tiny, loops=bad)
    lp = probes.from_transformers(tiny, loops=2)
    assert lp.training_loops == 2 and probes.lens(lp, ids_(), targets_for(ids_()), loops=None).sizes["loop"] == 2
    x = ids_(8, B=1, T=8)
    for probe in (probes.geometry, probes.interaction):
        with pytest.raises(ValueError, match="loops=0"):
            probe(lp, x, loops=0)
    with pytest.raises(ValueError, match="loops=0"):
        probes.lens(lp, x, targets_for(x), loops=0)
    with pytest.raises(ValueError, match="loops=0"):
        probes.loop_view(lp, x[0], 0)
    with pytest.raises(ValueError, match="loops=-1"):
        lp.run(x, -1)
    with pytest.raises(ValueError, match="vocab_size"):
        probes.geometry(lp, x + 256, loops=2)
    with pytest.raises(ValueError, match="coda_reads"):
        Loopable(prelude=lp.prelude, step=lp.step, coda=lp.coda, training_loops=2, coda_reads="hidden")
    with pytest.raises(ValueError, match="from_transformers does not know LlamaForCausalLM"):  # said where given
        LoopExplorer(llama, tokenizer=Bytes(), text="abc", device="cpu")
