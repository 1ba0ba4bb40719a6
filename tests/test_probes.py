"""Probes against slow, obvious re-implementations of SPEC §3: Python loops over occurrences, one
forward per skipped occurrence, one truncated backward per k."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import D, V, cfg, perturb, tokens
from workbench import LoopLM, probes
from workbench.models.conditioning import timestep_features

EPS = 1e-12


def targets_for(x):
    y = x.roll(-1, dims=1)
    y[0, :3] = -100  # some ignored positions
    return y


VARIANTS = [
    {},
    {"inject": "scalar", "history": 2, "history_op": "channel"},
    {"hyper": 2, "hyper_dynamic": True, "inject": "dense"},
    {"timestep": "adaln"},
    {"timestep": "loop_gate", "inject": "channel"},
]


def vid(v):
    return ",".join(f"{k}={x}" for k, x in v.items()) or "plain"


def model_for(variant, seed=0):
    return perturb(LoopLM(cfg(**variant), seed=seed))


# ---- slow references ----------------------------------------------------------------------------
def ref_pass(model, x, r, T=None, skip=None):
    """Run the model one block occurrence at a time; occurrence `skip` gets output := input.

    Returns (occurrences [(input, output, update)], measured states 0..r, carried states 0..r).
    """
    c = model.cfg
    T = r if T is None else T
    rope = model.rotary(x.shape[1], torch.float32)
    occ = []

    def plain(blk, u, mods=(None, None)):
        out = blk(u, rope, *mods)
        if len(occ) == skip:
            out = u
        occ.append((u, out, out - u))
        return out

    def hyper_update(blk, mods):
        def fn(v):
            d = blk.delta(v, rope, *mods)
            if len(occ) == skip:
                d = torch.zeros_like(d)
            occ.append((v, v + d, d))
            return d
        return fn

    h = model.embed(x)
    for blk in model.prelude:
        h = plain(blk, h)
    h0 = h
    n = c.hyper
    h0e = h0.unsqueeze(-2) if n > 1 else h0
    hs = [h0e.expand(*h0.shape[:-1], n, D) if n > 1 else h0]
    psi = timestep_features(T)
    for t in range(r):
        h = hs[t]
        u = h
        if c.history:
            past = [hs[t - j] for j in range(1, min(c.history, max(t - 1, 0)) + 1)]
            u = model.history(u, past)
        if model.inject is not None:
            u = model.inject(u, h0e)
        for i, blk in enumerate(model.core):
            mods = (None, None)
            if c.timestep in ("branch_gate", "adaln"):
                mods = model.timestep.block_mods(psi)[t][i]
            if n > 1:
                u = model.hyper[i](u, hyper_update(blk, mods))
            else:
                u = plain(blk, u, mods)
        if c.timestep == "loop_gate":
            u = h + model.timestep.loop_gates(psi)[t] * (u - h)
        hs.append(u)
    states = [s.mean(-2) if n > 1 else s for s in hs]
    y = states[r]
    for blk in model.coda:
        y = plain(blk, y)
    return occ, states, hs


def ref_angle(u, v):
    cos = (u * v).sum(-1) / torch.clamp((u.norm(dim=-1) * v.norm(dim=-1)), min=EPS)
    return float((torch.arccos(cos.clamp(-1, 1)) / math.pi).mean())


def ref_rel(u, v):
    return float(((v - u).norm(dim=-1) / u.norm(dim=-1).clamp(min=EPS)).mean())


def close(a, b, atol=1e-5, rtol=1e-4):
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), atol=atol, rtol=rtol)


# ---- the protocol ---------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_loopable_adapter_reproduces_the_trace(variant):
    model = model_for(variant)
    x = tokens()
    with torch.no_grad():
        lp = probes.as_loopable(model, horizon=4)
        h0, carried = lp.run(x, 4)
        tr = model.trace(x, loops=4)
        for t in range(5):
            torch.testing.assert_close(lp.state(carried[t]), tr.states[t], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lp.coda(lp.state(carried[4])), tr.logits(4), atol=1e-6, rtol=1e-5)


# ---- geometry -------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_geometry_equals_slow_reference(variant):
    model = model_for(variant)
    x = tokens()
    r = 4
    ds = probes.geometry(model, x, loops=r)
    with torch.no_grad():
        occ, states, _ = ref_pass(model, x, r)
        K = model.cfg.loops
        ref = ref_pass(model, x, K)[1][K] if model.horizon_dependent else states[K]
    v_ref = float(ref.var(-1, unbiased=False).mean())
    for t in range(1, r + 1):
        close(ds.angular_distance.sel(loop=t), ref_angle(states[t - 1], states[t]))
        close(ds.relative_update.sel(loop=t), ref_rel(states[t - 1], states[t]))
        close(ds.state_variance.sel(loop=t), float(states[t].var(-1, unbiased=False).mean()) / v_ref)
        close(ds.state_norm.sel(loop=t), float(states[t].norm(dim=-1).mean()))
    assert ds.sizes["occurrence"] == len(occ) == 1 + r * 2 + 1
    assert list(ds.occurrence.values[:3]) == ["prelude.0", "core.1.0", "core.1.1"]
    assert ds.occurrence.values[-1] == "coda.0"
    for j, (u, v, _) in enumerate(occ):
        close(ds.block_angular_distance.isel(occurrence=j), ref_angle(u, v))
        close(ds.block_relative_update.isel(occurrence=j), ref_rel(u, v))
    for key in ("config_json", "git_commit", "workbench_version", "seed", "created"):
        assert isinstance(ds.attrs[key], (str, int, float))


def test_geometry_under_unrolled_reference_state_comes_from_the_training_horizon():
    model = model_for({}, seed=2)  # K = 3
    x = tokens(3)
    ds = probes.geometry(model, x, loops=2)
    with torch.no_grad():
        st = model.trace(x, loops=3).states
    v_K = float(st[3].var(-1, unbiased=False).mean())
    close(ds.state_variance.values, [float(st[t].var(-1, unbiased=False).mean()) / v_K for t in (1, 2)])
    assert ds.sizes["occurrence"] == 1 + 2 * 2 + 1


# ---- interaction ----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_interaction_equals_one_forward_per_skip(variant):
    model = model_for(variant)
    x = tokens(1)
    r = 3
    ds = probes.interaction(model, x, loops=r, chunk=3)  # several chunks
    want = skip_matrix(model, x, r)
    n = want.shape[0]
    close(ds.interaction.values, want, atol=1e-4, rtol=1e-3)
    assert np.isnan(ds.interaction.values[np.tril_indices(n)]).all()
    # aggregation by loop lag over core pairs, and the terminal-to-core ratio
    names = list(ds.source.values)
    loop_of = {nm: int(nm.split(".")[1]) for nm in names if nm.startswith("core.")}
    for lag in range(r):
        vals = [want[names.index(a), names.index(b)] for a in loop_of for b in loop_of
                if loop_of[b] - loop_of[a] == lag and not np.isnan(want[names.index(a), names.index(b)])]
        close(ds.interaction_by_lag.sel(lag=lag), np.mean(vals), atol=1e-4, rtol=1e-3)
    close(ds.terminal_to_core, ref_terminal_to_core(want, names, r), atol=1e-4, rtol=1e-3)
    assert ds.attrs["terminal_to_core"] == float(ds.terminal_to_core)


def skip_matrix(model, x, r):
    """Return C(i -> j) from one plain reference pass and one more per skipped occurrence (slow, obvious)."""
    with torch.no_grad():
        base, _, _ = ref_pass(model, x, r)
        n = len(base)
        want = np.full((n, n), np.nan)
        for i in range(n):
            skipped, _, _ = ref_pass(model, x, r, skip=i)
            for j in range(i + 1, n):
                num = (skipped[j][2] - base[j][2]).norm(dim=-1).mean()
                want[i, j] = float(num / base[j][2].norm(dim=-1).mean())
    return want


def ref_terminal_to_core(C, names, r):
    """SPEC §3 by pairs: terminal = coda blocks, else the last loop; sources = core outside it."""
    coda = [j for j, nm in enumerate(names) if nm.startswith("coda.")]
    core = {j: int(nm.split(".")[1]) for j, nm in enumerate(names) if nm.startswith("core.")}
    terminal = coda or [j for j, t in core.items() if t == r]
    inner = [j for j in core if j not in terminal]
    num = [C[i, j] for i in inner for j in terminal if j > i]
    den = [C[i, j] for i in inner for j in inner if j > i]
    return np.mean(num) / np.mean(den)


@pytest.mark.parametrize("split", [(2, 0), (1, 1), (0, 2)], ids=["2+2x4+0", "1+2x4+1", "0+2x4+2"])
def test_terminal_to_core_is_finite_for_every_allocation_and_matches_one_forward_per_skip(split):
    prelude, coda = split
    model = perturb(LoopLM(cfg(prelude=prelude, coda=coda, core=2, loops=4), seed=3))
    x = tokens(4)
    ds = probes.interaction(model, x, loops=4)
    want = skip_matrix(model, x, 4)
    names = list(ds.source.values)
    assert (names[-1].startswith("coda.")) == (coda > 0)
    ratio = float(ds.terminal_to_core)
    assert np.isfinite(ratio) and ratio > 0
    close(ratio, ref_terminal_to_core(want, names, 4), atol=1e-4, rtol=1e-3)


def test_interaction_is_the_same_in_one_chunk_or_many():
    model = model_for({"history": 2})
    x = tokens(2)
    a = probes.interaction(model, x, loops=3, chunk=1).interaction.values
    b = probes.interaction(model, x, loops=3).interaction.values
    close(a, b, atol=1e-5, rtol=1e-4)


# ---- lost gradient ----------------------------------------------------------------------------------
def concat(ts):
    return torch.cat([t.reshape(-1).double() for t in ts])


@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_truncated_gradient_equals_one_truncated_backward_per_k(variant):
    model = model_for(variant)
    x = tokens(4)
    y = targets_for(x)
    r = 4
    lg = probes.loop_gradients(model, x, y, loops=r)
    ds = probes.lost_gradient(model, x, y, loops=r)
    params = dict(model.named_parameters())
    rec_names = sorted(lg.per_loop)
    assert all(n in params for n in rec_names)
    assert {n.split(".")[0] for n in rec_names} == {m for m in ("core", "inject", "history", "timestep", "hyper")
                                                    if getattr(model, m) is not None}
    refs = {}
    for k in range(1, r + 1):
        out = model(x, loops=r, targets=y, backward_loops=k)
        g = torch.autograd.grad(out.loss, list(params.values()), allow_unused=True)
        refs[k] = {n: torch.zeros_like(p) if gi is None else gi for (n, p), gi in zip(params.items(), g)}
        got = lg.truncated(k)
        for n in rec_names:
            torch.testing.assert_close(got[n], refs[k][n], atol=2e-6, rtol=1e-4, msg=f"k={k} {n}")
        for n, gk in lg.once["prelude"][k - 1].items():
            torch.testing.assert_close(gk, refs[k]["prelude." + n], atol=2e-6, rtol=1e-4, msg=f"k={k} prelude.{n}")
        torch.testing.assert_close(lg.once["embedding"][k - 1]["weight"], refs[k]["embed.weight"],
                                   atol=2e-6, rtol=1e-4)
    # the reported metrics, from the reference gradients
    g = concat(refs[r][n] for n in rec_names)
    for k in range(1, r + 1):
        Gk = concat(refs[k][n] for n in rec_names)
        close(ds.lost.sel(k=k), float((g - Gk).norm() / g.norm()), atol=1e-4)
        close(ds.cos.sel(k=k), float(g @ Gk / (g.norm() * Gk.norm())), atol=1e-4)
        close(ds.projected.sel(k=k), float(1 - g @ Gk / (g @ g)), atol=1e-4)
        pn = [n for n in params if n.startswith("prelude.")]
        gp, Gp = concat(refs[r][n] for n in pn), concat(refs[k][n] for n in pn)
        close(ds.lost_prelude.sel(k=k), float((gp - Gp).norm() / gp.norm()), atol=1e-4)
    assert float(ds.lost.sel(k=r)) == 0.0 and float(ds.lost_prelude.sel(k=r)) == 0.0
    close(ds.cos.sel(k=r), 1.0)
    if len({n.split(".")[0] for n in rec_names}) > 1:  # params="blocks": the core blocks alone
        blocks = probes.lost_gradient(model, x, y, loops=r, params="blocks")
        cn = [n for n in rec_names if n.startswith("core.")]
        g, G1 = concat(refs[r][n] for n in cn), concat(refs[1][n] for n in cn)
        close(blocks.lost.sel(k=1), float((g - G1).norm() / g.norm()), atol=1e-4)
    assert all(p.grad is None for p in model.parameters())  # the probe leaves .grad alone


@pytest.mark.parametrize("variant", [{}, {"inject": "scalar", "history": 2}], ids=vid)
def test_adjoint_norms_and_rho_equal_retain_grad_reference(variant):
    model = model_for(variant)
    x = tokens(5)
    y = targets_for(x)
    r = 5
    ds = probes.lost_gradient(model, x, y, loops=r)
    h0 = model.embed_prelude(x)
    ctx = model.context(h0, r)
    hs = [h0]
    h0.retain_grad()
    for t in range(r):
        past = [hs[t - j] for j in range(1, min(model.cfg.history, max(t - 1, 0)) + 1)]
        hs.append(model.step(hs[t], t, ctx, past))
        hs[-1].retain_grad()
    loss = F.cross_entropy(model.readout(hs[-1]).flatten(0, 1), y.flatten(), ignore_index=-100)
    loss.backward()
    # h0 is both the initial state and the injected input: its total adjoint mixes the two, so t = 0
    # is compared only for the plain model, where h0 is the initial state alone
    a = np.array([float(h.grad.norm()) for h in hs])
    lo = 0 if model.inject is None else 1
    close(ds.adjoint_norm.values[lo:], a[lo:], atol=1e-7, rtol=1e-4)
    a = ds.adjoint_norm.values
    xs = np.array([r - t for t in range(r)], dtype=float)
    ys = np.log(a[:r]) - np.log(a[r])
    log_rho = np.linalg.lstsq(xs[:, None], ys, rcond=None)[0][0]
    close(ds.attrs["rho"], math.exp(log_rho), rtol=1e-6)
    close(ds.rho_k.values, math.exp(log_rho) ** np.arange(1, r + 1), rtol=1e-6)


# ---- lens and halting --------------------------------------------------------------------------------
def per_loop_logits(model, x, r):
    T = r if model.horizon_dependent else None
    with torch.no_grad():
        return [None] + [model(x, loops=t, horizon=T).logits for t in range(1, r + 1)]


@pytest.mark.parametrize("variant", [{}, {"timestep": "adaln"}], ids=vid)
def test_lens_equals_separate_forwards(variant):
    model = model_for(variant)
    x = tokens(6)
    y = targets_for(x)
    r = 4
    ds = probes.lens(model, x, y, loops=r)
    logits = per_loop_logits(model, x, r)
    keep = (y != -100).flatten()
    log_pr = F.log_softmax(logits[r], -1).flatten(0, 1)[keep]
    for t in range(1, r + 1):
        lg = logits[t].flatten(0, 1)[keep]
        yt = y.flatten()[keep]
        logp = F.log_softmax(lg, -1)
        close(ds.loss.sel(loop=t), float(F.cross_entropy(lg, yt)))
        close(ds.accuracy.sel(loop=t), float((lg.argmax(-1) == yt).float().mean()))
        close(ds.entropy.sel(loop=t), float(-(logp.exp() * logp).sum(-1).mean()))
        close(ds.kl_final.sel(loop=t), float(F.kl_div(logp, log_pr, log_target=True, reduction="none").sum(-1).mean()),
              atol=1e-6)
    assert float(ds.kl_final.sel(loop=r)) == 0.0
    # a precomputed trace gives the same numbers
    tr = model.trace(x, loops=r) if model.horizon_dependent else model.trace(x, loops=6)
    close(probes.lens(model, x, y, loops=r, trace=tr).loss.values, ds.loss.values)


@pytest.mark.parametrize("criterion", ["kl", "state"])
def test_halting_equals_per_token_reference(criterion):
    model = model_for({"inject": "scalar"}, seed=3)
    x = tokens(7)
    y = targets_for(x)
    r = 5
    logits = per_loop_logits(model, x, r)
    with torch.no_grad():
        states = model.trace(x, loops=r).states
        logits[0] = model.readout(states[0])
    lp = [F.log_softmax(lg, -1) for lg in logits]
    B, L = x.shape
    crit = np.zeros((r + 1, B, L))
    for t in range(1, r + 1):
        for b in range(B):
            for i in range(L):
                if criterion == "kl":
                    p, q = lp[t][b, i], lp[t - 1][b, i]
                    crit[t, b, i] = max(float((p.exp() * (p - q)).sum()), 0.0)
                else:
                    u, v = states[t - 1][b, i], states[t][b, i]
                    crit[t, b, i] = float((v - u).norm() / max(float(u.norm()), EPS))
    vals = np.sort(crit[1:].ravel())
    gap = np.argmax(np.diff(vals[len(vals) // 4: 3 * len(vals) // 4])) + len(vals) // 4
    thr = float((vals[gap] + vals[gap + 1]) / 2)  # a threshold far from every criterion value
    ds = probes.halting(model, x, y, loops=r, threshold=thr, criterion=criterion)
    exit_ref = np.full((B, L), r)
    loss_ref, correct_ref = [], []
    for b in range(B):
        for i in range(L):
            for t in range(1, r + 1):
                if crit[t, b, i] < thr:
                    exit_ref[b, i] = t
                    break
            if y[b, i] != -100:
                e = exit_ref[b, i]
                loss_ref.append(-float(lp[e][b, i, y[b, i]]))
                correct_ref.append(float(logits[e][b, i].argmax() == y[b, i]))
    assert (ds.exit_loop.values == exit_ref).all()
    assert 1 < exit_ref.mean() < r  # the threshold really splits the tokens
    close(ds.mean_exit_loop, exit_ref.mean())
    close(ds.compute_saved, 1 - exit_ref.mean() / r)
    close(ds.loss_adaptive, np.mean(loss_ref))
    close(ds.accuracy_adaptive, np.mean(correct_ref))


@pytest.mark.parametrize("variant", [{}, {"hyper": 2}], ids=vid)
def test_halting_with_threshold_zero_is_fixed_r(variant):
    model = model_for(variant)
    x = tokens(8)
    y = targets_for(x)
    r = 4
    for criterion in ("kl", "state"):
        ds = probes.halting(model, x, y, loops=r, threshold=[0.0, 0.5], criterion=criterion)
        zero = ds.sel(threshold=0.0)
        assert (zero.exit_loop.values == r).all()
        assert float(zero.compute_saved) == 0.0
        assert float(zero.loss_adaptive) == float(zero.loss_fixed)
        assert float(zero.accuracy_adaptive) == float(zero.accuracy_fixed)
        assert float(zero.loss_paid) == 0.0
    with torch.no_grad():
        ref = model(x, loops=r, targets=y).loss
    close(ds.loss_fixed, float(ref))


# ---- a plain nn.Module loop through the protocol ---------------------------------------------------
def plain_loop(seed=0):
    torch.manual_seed(seed)
    emb, cell, head = nn.Embedding(V, D), nn.Sequential(nn.Linear(2 * D, D), nn.Tanh()), nn.Linear(D, V)

    def step(h, h0, t):
        return h + 0.5 * cell(torch.cat([h, h0], dim=-1))

    return probes.Loopable(prelude=emb, step=step, coda=head, training_loops=3, core=cell,
                           once={"embedding": emb}, vocab_size=V), emb, cell, head


def test_protocol_on_a_plain_module_loop():
    lp, emb, cell, head = plain_loop()
    x = tokens(9)
    y = targets_for(x)
    r = 4
    with torch.no_grad():
        h0 = emb(x)
        hs = [h0]
        for t in range(r):
            hs.append(hs[-1] + 0.5 * cell(torch.cat([hs[-1], h0], -1)))
    geo = probes.geometry(lp, x, loops=r)
    assert "block_angular_distance" not in geo
    v_ref = float(hs[3].var(-1, unbiased=False).mean())
    for t in range(1, r + 1):
        close(geo.angular_distance.sel(loop=t), ref_angle(hs[t - 1], hs[t]))
        close(geo.relative_update.sel(loop=t), ref_rel(hs[t - 1], hs[t]))
        close(geo.state_variance.sel(loop=t), float(hs[t].var(-1, unbiased=False).mean()) / v_ref)
    le = probes.lens(lp, x, y, loops=r)
    keep = y != -100
    for t in range(1, r + 1):
        with torch.no_grad():
            close(le.loss.sel(loop=t), float(F.cross_entropy(head(hs[t])[keep], y[keep])))
    ha = probes.halting(lp, x, y, loops=r, threshold=0.0)
    assert (ha.exit_loop.values == r).all() and float(ha.loss_paid) == 0.0
    # lost gradient: one truncated backward per k with an explicit detach of the state entering loop r-k+1
    lg = probes.loop_gradients(lp, x, y, loops=r)
    ds = probes.lost_gradient(lp, x, y, loops=r)
    for k in range(1, r + 1):
        h0 = emb(x)
        h = h0
        for t in range(r):
            if t == r - k and k < r:  # as run_loops: k = r is full BPTT, h0 keeps its graph
                h = h.detach()
            h = h + 0.5 * cell(torch.cat([h, h0], -1))
        loss = F.cross_entropy(head(h)[keep], y[keep])
        names = [n for n, _ in cell.named_parameters()]
        ref = torch.autograd.grad(loss, [*cell.parameters(), emb.weight])
        got = lg.truncated(k)
        for n, gr in zip(names, ref):
            torch.testing.assert_close(got[n], gr, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(lg.once["embedding"][k - 1]["weight"], ref[-1], atol=1e-6, rtol=1e-4)
    assert float(ds.lost.sel(k=r)) == 0.0 and float(ds.lost.sel(k=1)) > 0.0
    assert "lost_embedding" in ds


# ---- bad input -------------------------------------------------------------------------------------
def test_bad_input_gets_a_clear_error():
    model = model_for({})
    x = tokens()
    y = targets_for(x)
    with pytest.raises(ValueError, match="tokens"):
        probes.geometry(model, x.float(), loops=2)
    with pytest.raises(ValueError, match="tokens"):
        probes.lens(model, x[0], y[0], loops=2)
    with pytest.raises(ValueError, match="tokens"):
        probes.geometry(model, x + V, loops=2)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="loops"):
            probes.geometry(model, x, loops=bad)
    with pytest.raises(ValueError, match="targets"):
        probes.lens(model, x, y[:, :5], loops=2)
    with pytest.raises(ValueError, match="targets"):
        probes.lost_gradient(model, x, y.float(), loops=2)
    with pytest.raises(ValueError, match="loops=5"):
        probes.lens(model, x, y, loops=5, trace=model.trace(x, loops=3))
    with pytest.raises(ValueError, match="criterion"):
        probes.halting(model, x, y, loops=2, criterion="entropy")
    with pytest.raises(ValueError, match="threshold"):
        probes.halting(model, x, y, loops=2, threshold=-0.1)
    with pytest.raises(ValueError, match="params"):
        probes.lost_gradient(model, x, y, loops=2, params="head")
    with pytest.raises(ValueError, match="chunk"):
        probes.interaction(model, x, loops=2, chunk=0)
    with pytest.raises(ValueError, match="horizon"):
        probes.lens(model_for({"timestep": "adaln"}), x, y, loops=4, horizon=2)
    lp = plain_loop()[0]
    with pytest.raises(TypeError, match="LoopLM"):
        probes.interaction(lp, x, loops=2)
    with pytest.raises(TypeError, match="LoopLM or a Loopable"):
        probes.geometry(nn.Linear(2, 2), x, loops=2)
