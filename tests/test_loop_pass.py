"""The one loop pass: named places (cache and hooks) against plain Python loops over the blocks, per-loop
supervision through the model's forward (what DDP wraps; tests/test_ddp.py), and resuming a pass part-way."""

import pytest
import torch

from helpers import cfg, perturb, tokens
from test_model import VARIANTS, ref_block, ref_hyper, ref_inject, ref_psi, vid
from workbench import LoopLM, probes


# ---- slow reference: every named place, one block at a time ---------------------------------------
def ref_places(model, x, r):
    """Return {place name: tensor} by a plain Python loop over the blocks (SPEC §1's formulas)."""
    c = model.cfg
    out = {}
    rope = model.rotary(x.shape[1], torch.float32)
    u = model.embed(x)
    for i, blk in enumerate(model.prelude):
        u = ref_block(blk, u, rope)
        out[f"prelude.{i}"] = u
    h0 = u
    n = c.hyper
    h0e = h0.unsqueeze(-2) if n > 1 else h0
    hs = [h0e.expand(*h0.shape[:-1], n, h0.shape[-1]) if n > 1 else h0]
    out["state.0"] = h0
    for t in range(r):
        h = hs[t]
        x_in = h
        for j in range(1, min(c.history, max(t - 1, 0)) + 1):
            Bj, diff = model.history.lags[j - 1], hs[t - j] - h
            x_in = x_in + (diff @ Bj.T if c.history_op == "dense" else Bj * diff)
        x_in = ref_inject(model, x_in, h0e)
        psi = ref_psi(t, r)
        u = x_in
        for j, blk in enumerate(model.core):
            mods = None
            if c.timestep == "branch_gate":
                mods = [(1 + model.timestep.q[j, b] @ psi, 0.0) for b in range(2)]
            elif c.timestep == "adaln":
                W = model.timestep.W
                mods = [(1 + (W[j, b] @ psi)[:c.d_model], (W[j, b] @ psi)[c.d_model:]) for b in range(2)]
            name = f"core.{t + 1}.{j}"
            if model.hyper is None:
                u = ref_block(blk, u, rope, mods)
                out[name] = u
            else:
                def delta(v, blk=blk, mods=mods, name=name):
                    y = ref_block(blk, v, rope, mods)
                    out[name] = y
                    return y - v
                u = ref_hyper(model.hyper[j], u, delta)
        if c.timestep == "loop_gate":
            u = h + (1 + model.timestep.q @ psi) * (u - h)
        hs.append(u)
        out[f"state.{t + 1}"] = u.mean(-2) if n > 1 else u
    u = out[f"state.{r}"]
    for i, blk in enumerate(model.coda):
        u = ref_block(blk, u, rope)
        out[f"coda.{i}"] = u
    return out


@pytest.mark.parametrize("variant", VARIANTS, ids=vid)
def test_named_cache_equals_a_plain_python_loop_over_the_blocks(variant):
    model = perturb(LoopLM(cfg(**variant)))
    x = tokens()
    r = 4
    with torch.no_grad():
        want = ref_places(model, x, r)
        tr = model.trace(x, loops=r, cache=["*"])
        tr.logits(r)  # the coda's places act when a state is read out
        assert set(tr.cache) == set(want), sorted(set(tr.cache) ^ set(want))
        for name, w in want.items():
            torch.testing.assert_close(tr.cache[name], w, atol=2e-5, rtol=1e-4, msg=name)
        # every block occurrence, in call order, as place_names lists them
        assert [n for n in tr.cache if not n.startswith("state")] == model.place_names(r)
        out = model(x, loops=r, cache="core.2.*")
        assert sorted(out.cache) == [f"core.2.{j}" for j in range(model.cfg.core)]
        torch.testing.assert_close(out.cache["core.2.0"], want["core.2.0"], atol=2e-5, rtol=1e-4)


def test_taper_cache_holds_each_width():
    model = perturb(LoopLM(cfg(taper="cosine", d_ff=64, taper_multiple=8)))
    with torch.no_grad():
        want = ref_places(model, tokens(), 3)
        got = model.trace(tokens(), 3, cache=["core.*"]).cache
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4)
    widths = {blk.mlp.down.in_features for blk in model.core}
    assert len(widths) == model.cfg.core  # the core layers really have different MLP widths


@pytest.mark.parametrize("variant", [{}, {"hyper": 2, "hyper_dynamic": True}, {"history": 2, "inject": "dense"},
                                     {"timestep": "adaln"}], ids=vid)
def test_identity_hook_gives_the_interaction_probes_skipped_numbers(variant):
    model = perturb(LoopLM(cfg(**variant)))
    x = tokens()
    r = 3
    ds = probes.interaction(model, x, loops=r)
    names = model.place_names(r)
    blocks = ("prelude.*", "core.*", "coda.*")

    def updates(hooks):
        u = {}

        def rec(name, x_in, x_out):
            u[name] = x_out - x_in

        model(x, loops=r, hooks={**dict.fromkeys(blocks, rec), **hooks})
        return u

    with torch.no_grad():
        base = updates({})
        for src in ("core.1.1", "core.2.0", "prelude.0"):
            # the skip hook comes second so the recorder still sees the skipped block's own output
            skipped = updates({src: lambda name, x_in, x_out: x_in})
            for tgt in names[names.index(src) + 1:]:
                c = float((skipped[tgt] - base[tgt]).norm(dim=-1).mean() / base[tgt].norm(dim=-1).mean())
                assert ds.interaction.sel(source=src, target=tgt).item() == pytest.approx(c, rel=1e-4, abs=1e-7)
            assert float(ds.interaction.sel(source=src).max()) > 0  # the skip really moved later updates


def test_a_reading_hook_sees_what_the_cache_keeps_and_a_replacing_hook_patches():
    model = perturb(LoopLM(cfg(history=2, inject="channel")))
    x = tokens()
    seen = {}
    with torch.no_grad():
        tr = model.trace(x, 4, cache=["core.3.1", "state.2"],
                         hooks={"core.3.1": lambda n, i, o: seen.setdefault(n, o.clone()),
                                "state.2": lambda n, i, o: seen.setdefault(n, o.clone())})
        assert torch.equal(seen["core.3.1"], tr.cache["core.3.1"])
        assert torch.equal(seen["state.2"], tr.cache["state.2"])
        assert torch.equal(tr.cache["state.2"], tr.states[2])
        # replacing the state after the last loop with the state before it is running one loop fewer
        skip_last = model(x, loops=4, hooks={"state.4": lambda n, x_in, x_out: x_in})
        torch.testing.assert_close(skip_last.logits, model(x, loops=3).logits)
        with pytest.raises(ValueError, match=r"hook 'core\.1\.\*' at core.1.0 returned \(2, 1, 32\)"):
            model(x, loops=2, hooks={"core.1.*": lambda n, i, o: o[:, :1]})
        with pytest.raises(ValueError,
                           match=r"hook 'core\.\*' at core.1.0 returned .* torch.float64: .* dtype torch.float32"):
            model(x, loops=2, hooks={"core.*": lambda n, i, o: o.double()})
        # a pattern that names no place of the pass (a typo, a loop beyond it) is refused, listing the places
        for kw, bad in (("cache", "core.3.0"), ("hooks", "cor.*"), ("cache", "state.5")):
            arg = [bad] if kw == "cache" else {bad: lambda n, i, o: None}
            with pytest.raises(ValueError, match=rf"{kw} pattern '{bad}' names no place of this pass; its places "
                                                 r"are: prelude\.0, core\.1\.0, .*state\.2"):
                model(x, loops=2, **{kw: arg})
    with pytest.raises(ValueError, match="hooks"):
        model(x, loops=2, hooks={"core.*": "not callable"})


def test_a_pass_resumed_part_way_equals_the_whole_pass():
    model = perturb(LoopLM(cfg(history=3, history_op="dense", hyper=2)))
    x = tokens()
    with torch.no_grad():
        whole = model.run(x, 5, keep_states=True, coda=True)
        for s in (0, 2, 5):
            part = model.run(None, 5, start=whole.start(s), coda=True)
            torch.testing.assert_close(part.features, whole.features)
        two = model.run(None, 5, start=whole.start(3).repeat(2), coda=True)
        torch.testing.assert_close(two.features, whole.features.repeat(2, 1, 1))
        lean = model.run(x, 5)  # without keep_states only the window's states stay
        assert sum(c is not None for c in lean.carried) == 1 + model.cfg.history
        torch.testing.assert_close(lean.state, whole.state)


def test_per_loop_labels_through_forward_equal_separate_forwards():
    model = perturb(LoopLM(cfg(inject="channel")))
    x = tokens()
    labels = torch.randint(0, 97, (2, 3, x.shape[1]))
    labels[:, 1] = -100
    want = torch.stack([torch.nn.functional.cross_entropy(model(x, loops=t).logits.flatten(0, 1),
                                                          labels[:, t - 1].flatten()) for t in (1, 3)]).mean()
    torch.testing.assert_close(model(x, labels=labels).loss, want)
    with pytest.raises(ValueError, match="loops=2 is invalid with labels for 3 loops"):
        model(x, loops=2, labels=labels)
    with pytest.raises(ValueError, match="not both"):
        model(x, targets=x, labels=labels)
