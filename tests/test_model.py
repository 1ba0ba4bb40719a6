"""LoopLM against slow, obvious re-implementations of SPEC §1, written here as plain Python loops."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import D, V, cfg, perturb, tokens
from workbench import LoopLM
from workbench.models.hyper import HyperConnection
from workbench.models.taper import mlp_widths


# ---- slow reference ----------------------------------------------------------------------------
def ref_psi(l, T):
    t, dt = l / T, 1 / T
    return torch.tensor([t, dt, t * t, dt * dt, t * dt, math.sin(math.pi * t),
                         math.cos(math.pi * t) - 1, math.sin(2 * math.pi * t)])


def ref_block(blk, u, rope, mods=None):
    """A pre-norm block written out branch by branch: u += g * Branch((1 + s) * Norm(u))."""
    for i, (norm, fn, post) in enumerate(((blk.attn_norm, lambda h: blk.attn(h, rope), blk.attn_post),
                                          (blk.mlp_norm, blk.mlp, blk.mlp_post))):
        g, s = (1.0, 0.0) if mods is None else mods[i]
        y = fn(norm(u) * (1 + s))
        if post is not None:
            y = post(y)
        u = u + g * y
    return u


def ref_hyper(hc, H, delta_fn):
    """Hyper-connection with explicit sums over rows: h_in = sum_n A_m[n] H_n; H'_m = B_m y + sum_n A_r[n,m] H_n."""
    n = H.shape[-2]
    a_m, a_r, b = hc.A_m, hc.A_r, hc.B
    if hc.dynamic:
        Hn = H * torch.rsqrt(H.pow(2).mean(-1, keepdim=True) + hc.eps) * hc.norm_weight
        a_m = a_m + hc.s_alpha * torch.tanh(Hn @ hc.W_m)
        a_r = a_r + hc.s_alpha * torch.tanh(Hn @ hc.W_r)
        b = b + hc.s_beta * torch.tanh(Hn @ hc.W_b)
    else:
        a_m, a_r, b = (x.expand(*H.shape[:-2], *x.shape) for x in (a_m, a_r, b))
    h_in = sum(a_m[..., i, None] * H[..., i, :] for i in range(n))
    y = delta_fn(h_in)
    rows = [b[..., m, None] * y + sum(a_r[..., i, m, None] * H[..., i, :] for i in range(n)) for m in range(n)]
    return torch.stack(rows, dim=-2)


def ref_inject(model, h, h0):
    inj = model.inject
    if inj is None:
        return h
    if inj.kind == "scalar":
        return h + inj.alpha * h0
    if inj.kind == "channel":
        return inj.a * h + inj.b * h0
    if inj.kind == "dense":
        d = h.shape[-1]
        return h @ inj.weight[:, :d].T + h0 @ inj.weight[:, d:].T
    A = -torch.exp(inj.A_log)
    dt = F.softplus(inj.dt)
    return torch.exp(dt * A) * h + dt * (h0 @ inj.B.T)


def ref_states(model, x, r, T=None):
    """All states h_0..h_r by the SPEC's formulas, one loop at a time, every state kept in a list."""
    c = model.cfg
    T = r if T is None else T
    h0 = model.embed_prelude(x)
    rope = model.rotary(x.shape[1], h0.dtype)
    n = c.hyper
    h0e = h0.unsqueeze(-2) if n > 1 else h0
    hs = [h0e.expand(*h0.shape[:-1], n, D) if n > 1 else h0]
    for t in range(r):  # computing h_{t+1} from h_t
        h = hs[t]
        x_in = h
        if c.history:
            m_t = min(c.history, max(t - 1, 0))
            for j in range(1, m_t + 1):
                Bj = model.history.lags[j - 1]
                diff = hs[t - j] - h
                x_in = x_in + (diff @ Bj.T if c.history_op == "dense" else Bj * diff)
        x_in = ref_inject(model, x_in, h0e)
        psi = ref_psi(t, T)
        u = x_in
        for i, blk in enumerate(model.core):
            mods = None
            if c.timestep == "branch_gate":
                q = model.timestep.q
                mods = [(1 + q[i, b] @ psi, 0.0) for b in range(2)]
            elif c.timestep == "adaln":
                W = model.timestep.W
                mods = [(1 + (W[i, b] @ psi)[:D], (W[i, b] @ psi)[D:]) for b in range(2)]
            if model.hyper is None:
                u = ref_block(blk, u, rope, mods)
            else:
                u = ref_hyper(model.hyper[i], u, lambda v: ref_block(blk, v, rope, mods) - v)
        if c.timestep == "loop_gate":
            g = 1 + model.timestep.q @ psi
            u = h + g * (u - h)
        hs.append(u)
    return [s.mean(-2) if n > 1 else s for s in hs]


VARIANTS = [
    {},
    {"inject": "scalar"}, {"inject": "channel"}, {"inject": "dense"}, {"inject": "stable"},
    {"history": 1}, {"history": 2, "history_op": "channel"}, {"history": 3, "history_op": "dense"},
    {"timestep": "loop_gate"}, {"timestep": "branch_gate"}, {"timestep": "adaln"},
    {"hyper": 2}, {"hyper": 3, "hyper_dynamic": True},
    {"sandwich_norm": True}, {"tie_embeddings": False},
    {"taper": "cosine", "d_ff": 64, "taper_multiple": 8},
    {"inject": "dense", "history": 2, "hyper": 2, "hyper_dynamic": True, "timestep": "adaln"},
    {"prelude": 0, "coda": 0, "inject": "channel"},
]


def vid(v):
    return ",".join(f"{k}={x}" for k, x in v.items()) or "plain"


@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_states_match_slow_reference(variant):
    model = perturb(LoopLM(cfg(**variant)))
    x = tokens()
    r = 5
    with torch.no_grad():
        got = model.trace(x, loops=r)
        want = ref_states(model, x, r)
        for t in range(r + 1):
            torch.testing.assert_close(got.states[t], want[t], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got.logits(r), model.readout(want[r]), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_trace_equals_separate_forwards(variant):
    model = perturb(LoopLM(cfg(**variant)))
    x = tokens(1)
    r_max = 6
    with torch.no_grad():
        tr = model.trace(x, loops=r_max)
        assert tr.states.shape == (r_max + 1, 2, 12, D)
        torch.testing.assert_close(tr.states[0], model.embed_prelude(x))
        for r in range(1, r_max + 1):
            # horizon-dependent (timestep) models see T = r_max inside the trace
            T = r_max if model.horizon_dependent else None
            out = model(x, loops=r, horizon=T)
            torch.testing.assert_close(tr.logits(r), out.logits, atol=1e-5, rtol=1e-5)


def test_timestep_models_depend_on_the_horizon():
    model = perturb(LoopLM(cfg(timestep="adaln")))
    x = tokens()
    with torch.no_grad():
        a = model(x, loops=3).logits
        b = model(x, loops=3, horizon=6).logits
    assert not torch.allclose(a, b, atol=1e-4)
    plain = perturb(LoopLM(cfg()))
    assert not plain.horizon_dependent


CONDITIONED = [
    {"inject": "scalar"}, {"inject": "channel"}, {"inject": "dense"},
    {"history": 2}, {"history": 2, "history_op": "channel"}, {"history": 3, "history_op": "dense"},
    {"timestep": "loop_gate"}, {"timestep": "branch_gate"}, {"timestep": "adaln"},
    {"inject": "dense", "history": 2, "timestep": "adaln"},
]


@pytest.mark.parametrize("variant", CONDITIONED, ids=vid)
def test_conditioning_at_init_equals_plain_model(variant):
    plain, cond = LoopLM(cfg(), seed=3), LoopLM(cfg(**variant), seed=3)
    shared = plain.state_dict()
    for k, v in cond.state_dict().items():
        if k in shared:
            assert torch.equal(v, shared[k]), k
    x = tokens()
    with torch.no_grad():
        for r in (1, 4, 7):
            torch.testing.assert_close(cond(x, loops=r).logits, plain(x, loops=r).logits, atol=1e-6, rtol=0)


def test_stable_injection_has_spectral_radius_below_one_for_any_parameters():
    model = LoopLM(cfg(inject="stable"))
    # seeded, and wide but not so wide that exp(-dt * exp(A_log)) rounds to exactly 1.0 in float32
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        with torch.no_grad():
            for p in model.inject.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 3)
            A_bar, _ = model.inject.discretized()
        assert A_bar.max() < 1 and A_bar.min() >= 0, trial


def test_hyper_connections_at_init_carry_n_identical_streams():
    # static init: every stream receives every update (B = 1, A_r = I), so the n rows stay equal to the
    # plain residual stream and their mean is the plain model's state
    x = tokens()
    plain = LoopLM(cfg(), seed=5)
    for n, dyn in ((2, False), (3, True)):
        hc = LoopLM(cfg(hyper=n, hyper_dynamic=dyn), seed=5)
        with torch.no_grad():
            torch.testing.assert_close(hc.trace(x, 4).states, plain.trace(x, 4).states, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(hc(x, loops=4).logits, plain(x, loops=4).logits, atol=1e-5, rtol=1e-5)


def test_hyper_connection_with_one_stream_is_the_residual():
    hc = HyperConnection(1, D, 0)
    H = torch.randn(2, 5, 1, D)
    f = torch.nn.Linear(D, D)
    torch.testing.assert_close(hc(H, f), (H[..., 0, :] + f(H[..., 0, :])).unsqueeze(-2))


def test_truncated_backprop_equals_explicit_detach():
    model = perturb(LoopLM(cfg(inject="channel", history=2)))
    x = tokens()
    r, k = 5, 2
    out = model(x, loops=r, targets=x, backward_loops=k)
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    # reference: run every loop with a graph, detach the state entering loop r-k+1 (and the window)
    h0 = model.embed_prelude(x)
    ctx = model.context(h0, r)
    hs = [h0]
    for t in range(r):
        if t == r - k:
            hs = [h.detach() if i > 0 else h for i, h in enumerate(hs)]
            hs[t] = hs[t].detach()
        past = [hs[t - j] for j in range(1, min(2, max(t - 1, 0)) + 1)]
        hs.append(model.step(hs[t], t, ctx, past))
    loss = F.cross_entropy(model.readout(hs[-1]).flatten(0, 1), x.flatten())
    ref = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(out.loss, loss)
    for (name, _), g, gr in zip(model.named_parameters(), grads, ref):
        if gr is None:
            assert g is None or torch.count_nonzero(g) == 0, name
        else:
            torch.testing.assert_close(g, gr, atol=1e-6, rtol=1e-4, msg=name)
    # full BPTT gives a different core gradient (the test would fail if truncation did nothing)
    full = model(x, loops=r, targets=x)
    g_full = torch.autograd.grad(full.loss, model.core[0].attn.qkv.weight)[0]
    assert not torch.allclose(g_full, grads[[n for n, _ in model.named_parameters()].index("core.0.attn.qkv.weight")])


@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_gradients_reach_every_parameter(variant):
    model = LoopLM(cfg(**variant))
    x = tokens()
    # 5 loops: the largest history window here (w = 3) reaches its last lag at loop 5
    model(x, loops=5, targets=x).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient path to {missing}"
    # off the identity init (where s * tanh(0) blocks s's gradient) every parameter gets a real gradient
    model.zero_grad()
    perturb(model)
    model(x, loops=5, targets=x).loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not dead, f"zero gradient for {dead}"


@pytest.mark.parametrize("schedule", ["cosine", "reverse"])
@pytest.mark.parametrize("L,mean,m", [(2, 96, 1), (5, 256, 64), (12, 688, 16), (7, 100, 1), (30, 1536, 128)])
def test_taper_is_monotone_exact_and_rounded(schedule, L, mean, m):
    w = mlp_widths(L, mean, schedule, m)
    assert sum(w) == L * mean
    assert all(x % m == 0 and x >= m for x in w)
    steps = [b - a for a, b in zip(w, w[1:])]
    assert all(s <= 0 for s in steps) if schedule == "cosine" else all(s >= 0 for s in steps)
    assert w[0] != w[-1]
    # close to the formula (rounding moves each layer by at most a couple of units)
    raw = [0.5 * mean + mean * (1 + math.cos(math.pi * l / (L - 1))) / 2 for l in range(L)]
    if schedule == "reverse":
        raw = raw[::-1]
    assert max(abs(a - b) for a, b in zip(w, raw)) <= 2 * m


def test_reverse_taper_is_the_mirror():
    for L, mean, m in [(6, 256, 32), (9, 512, 1)]:
        assert mlp_widths(L, mean, "reverse", m) == mlp_widths(L, mean, "cosine", m)[::-1]


@pytest.mark.parametrize("schedule", ["cosine", "reverse"])
def test_tapered_model_has_the_uniform_mlp_budget(schedule):
    def mlp_params(model):
        return sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)
    uni = LoopLM(cfg(prelude=2, core=3, coda=2, d_ff=96))
    tap = LoopLM(cfg(prelude=2, core=3, coda=2, d_ff=96, taper=schedule, taper_multiple=16))
    assert mlp_params(tap) == mlp_params(uni)
    widths = [b.mlp.d_ff for b in [*tap.prelude, *tap.core, *tap.coda]]
    assert widths == mlp_widths(7, 96, schedule, 16) and len(set(widths)) > 1


def test_param_counts_partition_the_model():
    model = LoopLM(cfg(inject="dense", history=2, hyper=2, tie_embeddings=False))
    pc = model.param_counts()
    assert sum(pc.values()) == sum(p.numel() for p in model.parameters())
    core = sum(p.numel() for p in model.core.parameters())
    extras = 2 * D * D + 2 + sum(p.numel() for p in model.hyper.parameters())
    assert pc["rec"] == core + extras
    assert pc["embed"] == 2 * V * D


def counted_flops(model, loops, backward_loops, B=2, T=32, seed=0):
    """Return the FLOPs per token torch counts (FlopCounterMode) in one training forward + backward.

    The math SDPA kernel runs attention as plain matmuls, so the counter sees the full T x T score and
    value products (the CPU flash kernel is not in its registry and would count nothing).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randint(0, model.cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(seed))
    with FlopCounterMode(display=False) as fc, sdpa_kernel(SDPBackend.MATH):
        model(x[:, :-1], loops=loops, targets=x[:, 1:], backward_loops=backward_loops).loss.backward()
    return fc.get_total_flops() / (B * T)


def test_flops_per_token_agrees_with_what_torch_counts():
    """The one formula (models/flops.py) against FlopCounterMode over a real forward + backward, within 1%.

    What the counter does not see is the norm weights: the formula counts them like any parameter
    (6, 2r + 4k per weight) though they are not matmuls, 0.4% here. Dropping the attention term
    would be 11% off; the head term is checked through its slope in the vocabulary size.
    """
    model = LoopLM(cfg(inject="dense"))  # GQA (4 heads, 2 kv) and a dense injection (a matmul in N_rec)
    T = 32
    for r, k in [(3, 3), (4, 2), (2, 1)]:  # full BPTT and truncation: the first r - k loops run without grad
        measured = counted_flops(model, r, k, T=T)
        assert model.flops_per_token(r, k, seq_len=T, include_head=True) == pytest.approx(measured, rel=0.01), (r, k)
    # the head: 6 d V per token, the only term that moves with the vocabulary; include_head=False leaves it out
    wide = LoopLM(cfg(inject="dense", vocab_size=V + 64))
    head_per_id = (counted_flops(wide, 3, 3, T=T) - counted_flops(model, 3, 3, T=T)) / 64
    assert head_per_id == pytest.approx(6 * D, rel=1e-9)
    assert model.flops_per_token(3, 3, seq_len=T) == pytest.approx(counted_flops(model, 3, 3, T=T)
                                                                   - head_per_id * V, rel=0.01)
    assert model.flops_per_token(3, 3, seq_len=T, include_head=True) - model.flops_per_token(3, 3, seq_len=T) \
        == pytest.approx(head_per_id * V, rel=1e-9)


def test_seed_decides_the_weights_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = LoopLM(cfg(), seed=1), LoopLM(cfg(), seed=1), LoopLM(cfg(), seed=2)
    assert torch.equal(torch.rand(3), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["core.0.attn.qkv.weight"], sc["core.0.attn.qkv.weight"])


def test_loops_beyond_training_count_extrapolate():
    model = perturb(LoopLM(cfg(loops=3)))
    x = tokens()
    with torch.no_grad():
        assert model(x).logits.shape == (2, 12, V)
        far = model(x, loops=12).logits
        torch.testing.assert_close(far, model.readout(ref_states(model, x, 12)[12]), atol=2e-5, rtol=1e-4)
        assert not torch.allclose(far, model(x, loops=3).logits)


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_head_loss_equals_full_logits_loss(tied):
    from workbench.models.layers import linear_cross_entropy

    model = perturb(LoopLM(cfg(tie_embeddings=tied)))
    x = tokens(B=3, T=11)
    y = x.roll(-1, dims=1)
    y[0, :4] = -100  # ignored positions
    ref = model(x, targets=y)
    ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))
    out = model(x, targets=y, return_logits=False)
    assert out.logits is None
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    torch.testing.assert_close(out.loss, ref.loss)
    for (name, _), g, gr in zip(model.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, gr, atol=1e-7, rtol=1e-4, msg=name)
    # chunk boundaries that do not divide the token count, with and without a graph
    h = torch.randn(33, D, requires_grad=True)
    W = torch.randn(V, D, requires_grad=True)
    t = torch.randint(0, V, (33,))
    t[5] = -100
    full = F.cross_entropy(h @ W.T, t, ignore_index=-100)
    rh, rw = torch.autograd.grad(2 * full, (h, W))
    for chunk in (1, 7, 64):
        got = linear_cross_entropy(h, W, t, chunk=chunk)
        torch.testing.assert_close(got, full)
        gh, gw = torch.autograd.grad(2 * got, (h, W))
        torch.testing.assert_close(gh, rh)
        torch.testing.assert_close(gw, rw)
        with torch.no_grad():
            torch.testing.assert_close(linear_cross_entropy(h, W, t, chunk=chunk), full)
