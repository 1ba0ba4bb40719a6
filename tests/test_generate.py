"""Cached generation against recomputing the whole sequence per token, adaptive exit, the exit gate."""

import math

import pytest
import torch

from helpers import V, cfg, perturb, tokens
from test_model import VARIANTS, vid
from workbench import LoopLM
from workbench.models.generate import (ExitGate, ExitRule, KVCache, decode_step, exit_distribution,
                                       gate_objective, sample, teacher_forced)


def model_for(variant, seed=0):
    return perturb(LoopLM(cfg(**variant), seed=seed), scale=0.2, seed=seed + 1).eval()


def retrofitted():
    pytest.importorskip("transformers")
    from workbench.models.hf import random_llama
    from workbench.models.retrofit import retrofit

    base = random_llama(vocab_size=V, d_model=32, layers=4, n_heads=4, n_kv_heads=2, d_ff=64, std=0.2, seed=3)
    return perturb(retrofit(base, 1, 2, 1, budget="adapter", loops=3, adapter_rank=4), scale=0.05).eval()


def slow_greedy(model, x, n, loops, horizon=None):
    """Greedy decoding without a cache: every new token reruns the whole sequence."""
    y = x.clone()
    with torch.no_grad():
        for _ in range(n):
            nxt = model(y, loops=loops, horizon=horizon).logits[:, -1].argmax(-1, keepdim=True)
            y = torch.cat([y, nxt], dim=1)
    return y


MODELS = [pytest.param(lambda v=v: model_for(v), id=vid(v)) for v in VARIANTS]
MODELS.append(pytest.param(retrofitted, id="retrofit"))


@pytest.mark.parametrize("make", MODELS)
def test_cached_equals_uncached(make):
    """Logits of every cached step (prompt in two chunks, then one token at a time) match a full pass."""
    model = make()
    r = 3
    x = tokens(seed=5, B=2, T=14)
    with torch.no_grad():
        full = model(x, loops=r).logits
        kv = KVCache(2, 14)
        got = []
        for a, b in ((0, 5), (5, 8), *((i, i + 1) for i in range(8, 14))):  # chunks: causal mask with an offset
            logits, used = decode_step(model, kv, x[:, a:b], torch.ones(2, b - a, dtype=torch.bool), r, None)
            got.append(logits)
            assert used.tolist() == [r, r]
        ends = [4, 7, *range(8, 14)]
        torch.testing.assert_close(torch.stack(got, 1), full[:, ends].float(), atol=1e-5, rtol=1e-5)
    prompt = x[:1, :6]
    out = model.generate(prompt, 10, loops=r)
    assert torch.equal(out, slow_greedy(model, prompt, 10, r))
    assert out.shape == (1, 16) and torch.equal(out[:, :6], prompt)


def test_greedy_outputs_are_not_trivial():
    """The equality tests above mean something only if the tiny models do not repeat one token."""
    out = model_for({}).generate(tokens(seed=5, B=1, T=6), 10, loops=3)
    assert len(set(out[0, 6:].tolist())) >= 3


EXIT_VARIANTS = [{}, {"hyper": 2}, {"timestep": "adaln"}, {"history": 2, "history_op": "dense"},
                 {"prelude": 0, "coda": 0, "inject": "channel"}]


@pytest.mark.parametrize("variant", EXIT_VARIANTS, ids=vid)
@pytest.mark.parametrize("rule", ["kl", "state", "gate"])
def test_threshold_zero_is_fixed_rmax_and_infinity_is_one_loop(variant, rule):
    model = model_for(variant)
    R = 4
    gate = perturb(ExitGate(model.cfg.d_model), scale=1.0) if rule == "gate" else None
    x = tokens(seed=2, B=2, T=8)
    zero, inf = ExitRule(rule, 0.0, gate=gate), ExitRule(rule, math.inf, gate=gate)
    lz, nz = teacher_forced(model, x, R, zero)
    li, ni = teacher_forced(model, x, R, inf)
    assert (nz == R).all() and (ni == 1).all()
    torch.testing.assert_close(lz, model(x, loops=R).logits, atol=1e-5, rtol=1e-5)
    # timestep conditioning: an exit rule runs with horizon r_max, so r = 1 is compared at that horizon
    T1 = R if model.horizon_dependent else None
    torch.testing.assert_close(li, model(x, loops=1, horizon=T1).logits, atol=1e-5, rtol=1e-5)
    p = x[:1, :5]
    assert torch.equal(model.generate(p, 6, loops=R, exit=zero), model.generate(p, 6, loops=R))
    assert torch.equal(model.generate(p, 6, loops=R, exit=inf), model.generate(p, 6, loops=1, horizon=T1))


def test_an_exit_rule_uses_fewer_loops_between_the_extremes():
    model = model_for({})
    g = model.generate(tokens(seed=3, B=1, T=6), 12, loops=6, exit=ExitRule("state", 0.3), details=True)
    assert 1 < g.mean_loops < 6 and g.loops.min() >= 1 and g.loops.max() <= 6


def test_skipped_loops_reuse_the_last_computed_loops_cache():
    """Huginn's choice: a token exiting after loop e leaves loop e's keys/values in every later loop's entry."""
    model = model_for({})
    R, x = 5, tokens(seed=4, B=1, T=6)
    kv = KVCache(1, 8)
    decode_step(model, kv, x, torch.ones(1, 6, dtype=torch.bool), R, None)  # prompt: every loop computed
    rule = ExitRule("gate", 0.6, gate=ExitGate(model.cfg.d_model))  # lambda = 1/2: survival 1/2 after loop 1
    _, used = decode_step(model, kv, tokens(seed=9, B=1, T=1), torch.ones(1, 1, dtype=torch.bool), R, rule)
    assert used.tolist() == [1]
    for j in range(model.cfg.core):
        first = kv.at(f"core.1.{j}")
        for t in range(2, R + 1):
            e = kv.at(f"core.{t}.{j}")
            assert e.filled == 7
            assert torch.equal(e.k[:, :, 6], first.k[:, :, 6]) and torch.equal(e.v[:, :, 6], first.v[:, :, 6])
            assert not torch.equal(e.k[:, :, 5], first.k[:, :, 5])  # the prompt computed its own loops
    # the next token attends to those copies: reading it with fixed loops R equals reading it through a cache
    # whose last position is a loop-1 token (what a slow reference with the copies written by hand gives)
    nxt = tokens(seed=10, B=1, T=1)
    logits, _ = decode_step(model, kv, nxt, torch.ones(1, 1, dtype=torch.bool), R, None)
    ref = KVCache(1, 8)
    decode_step(model, ref, x, torch.ones(1, 6, dtype=torch.bool), R, None)
    ref.open(torch.ones(1, 1, dtype=torch.bool))
    model.features(model.run(tokens(seed=9, B=1, T=1), 1, kv=ref).state, kv=ref)
    for t in range(2, R + 1):
        for j in range(model.cfg.core):
            e, src = ref.at(f"core.{t}.{j}"), ref.at(f"core.1.{j}")
            e.k[:, :, 6], e.v[:, :, 6], e.filled = src.k[:, :, 6], src.v[:, :, 6], 7
    ref.commit()
    want, _ = decode_step(model, ref, nxt, torch.ones(1, 1, dtype=torch.bool), R, None)
    torch.testing.assert_close(logits, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("exit", [None, ExitRule("kl", 0.05)], ids=["fixed", "kl"])
def test_left_padded_batch_equals_one_prompt_at_a_time(exit):
    model = model_for({"inject": "channel", "hyper": 2})
    prompts = [tokens(seed=s, B=1, T=n)[0] for s, n in ((1, 3), (2, 7), (3, 5))]
    batch = model.generate(prompts, 8, loops=4, exit=exit, details=True)
    assert batch.tokens.shape == (3, 7 + 8)
    for b, p in enumerate(prompts):
        one = model.generate(p[None], 8, loops=4, exit=exit, details=True)
        assert torch.equal(batch.tokens[b, 7 - len(p):], one.tokens[0])
        assert torch.equal(batch.loops[b], one.loops[0])
        assert not batch.keep[b, :7 - len(p)].any() and batch.keep[b, 7 - len(p):].all()
    # the same batch given as a padded tensor and its mask
    again = model.generate(batch.tokens[:, :7], 8, loops=4, exit=exit, mask=batch.keep[:, :7])
    assert torch.equal(again, batch.tokens)


def test_sampling_is_seeded_and_filters():
    model = model_for({})
    x = tokens(seed=6, B=2, T=5)
    greedy = model.generate(x, 8, loops=2)
    a = model.generate(x, 8, loops=2, temperature=1.0, seed=1)
    assert torch.equal(a, model.generate(x, 8, loops=2, temperature=1.0, seed=1))
    assert not torch.equal(a, model.generate(x, 8, loops=2, temperature=1.0, seed=2))
    assert torch.equal(model.generate(x, 8, loops=2, temperature=1.0, top_k=1, seed=3), greedy)
    assert torch.equal(model.generate(x, 8, loops=2, temperature=1.0, top_p=1e-6, seed=3), greedy)
    # top-p keeps the smallest head of the distribution holding p, top-k the k largest
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen = {int(sample(logits, 1.0, top_p=0.7, generator=g)) for _ in range(200)}
    assert seen == {0, 1}
    seen = {int(sample(logits, 1.0, top_k=3, generator=g)) for _ in range(300)}
    assert seen == {0, 1, 2}


def test_stop_ends_a_row_and_pads_after_it():
    model = model_for({})
    x = tokens(seed=5, B=1, T=6)
    free = model.generate(x, 10, loops=3)
    stop = int(free[0, 8])  # the third new token
    g = model.generate(x, 10, loops=3, stop=stop, pad_id=0, details=True)
    first = (free[0, 6:] == stop).nonzero()[0].item()
    assert g.tokens.shape[1] == 16 and torch.equal(g.tokens[0, :7 + first], free[0, :7 + first])
    assert (g.tokens[0, 7 + first:] == 0).all() and not g.keep[0, 7 + first:].any()
    assert (g.loops[0, first + 1:] == 0).all() and (g.loops[0, :first + 1] == 3).all()


def test_exit_distribution_sums_to_one_and_matches_a_loop():
    lam = torch.rand(5, 7, generator=torch.Generator().manual_seed(0))
    p = exit_distribution(lam)
    torch.testing.assert_close(p.sum(-1), torch.ones(5))
    for n in range(5):
        alive = 1.0
        for t in range(7):
            want = alive * (lam[n, t] if t < 6 else 1.0)
            assert abs(float(p[n, t]) - float(want)) < 1e-6
            alive *= 1 - float(lam[n, t])
    losses = torch.rand(5, 7)
    ent = -(p * p.log()).sum(-1)
    torch.testing.assert_close(gate_objective(lam, losses, 0.1), ((p * losses).sum(-1) - 0.1 * ent).mean())


def test_gate_training_lowers_its_objective_and_drives_generation():
    from workbench.experiments.generate import train_exit_gate

    model = model_for({"inject": "channel"})
    before = [p.detach().clone() for p in model.parameters()]
    batch = tokens(seed=7, B=4, T=17)
    gate, hist = train_exit_gate(model, batch, loops=5, steps=40, lr=0.1, beta=0.01)
    obj = hist.objective.values
    assert obj[-1] < obj[0] - 1e-3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the model stays frozen
    g = model.generate(tokens(seed=8, B=1, T=4), 6, loops=5, exit=ExitRule("gate", 0.5, gate=gate), details=True)
    assert g.loops.min() >= 1 and g.loops.max() <= 5


def test_exit_sweep_fixed_points_match_full_passes():
    from workbench.experiments.generate import exit_sweep

    model = model_for({})
    batch = tokens(seed=11, B=2, T=9)
    ds = exit_sweep(model, batch, loops=[1, 3], rules={"kl": [0.0, math.inf]}, max_loops=3)
    assert list(ds.rule.values) == ["fixed", "fixed", "kl", "kl"]
    x, y = batch[:, :-1], batch[:, 1:]
    for r, i in ((1, 0), (3, 1)):
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(x, loops=r).logits.flatten(0, 1), y.flatten())
        assert abs(float(ds.loss[i]) - float(loss)) < 1e-5 and float(ds.mean_loops[i]) == r
    assert abs(float(ds.loss[2] - ds.loss[1])) < 1e-5 and float(ds.mean_loops[2]) == 3  # threshold 0: r_max
    assert abs(float(ds.loss[3] - ds.loss[0])) < 1e-5 and float(ds.mean_loops[3]) == 1  # infinity: one loop


BAD = [
    (dict(max_new_tokens=-1), "max_new_tokens=-1"),
    (dict(tokens=torch.zeros(1, 70, dtype=torch.long)), "longer than the context max_seq_len=64"),
    (dict(max_new_tokens=60), "max_new_tokens=60"),
    (dict(exit="sometimes"), "exit='sometimes'"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_k=0), "top_k=0"),
    (dict(loops=0), "loops=0"),
    (dict(stop=V), f"stop={V}"),
    (dict(horizon=5), "horizon=5"),
    (dict(tokens=torch.full((1, 4), V)), f"id {V}"),
    (dict(tokens=torch.ones(2, 4, dtype=torch.long), mask=torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])), "left padding"),
    (dict(tokens=[[1, 2], []]), "empty prompt"),
    (dict(tokens=torch.ones(1, 4)), "dtype"),
]


@pytest.mark.parametrize("kw,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_named(kw, message):
    model = model_for({})
    args = dict(tokens=tokens(B=1, T=6), max_new_tokens=4)
    args.update(kw)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        model.generate(args.pop("tokens"), args.pop("max_new_tokens"), **args)


@pytest.mark.parametrize("kw,message", [(dict(rule="sometimes"), "rule='sometimes'"),
                                        (dict(rule="kl", threshold=-1.0), "threshold=-1.0"),
                                        (dict(rule="kl", threshold=float("nan")), "threshold=nan"),
                                        (dict(rule="gate"), "gate=None"),
                                        (dict(rule="kl", min_loops=0), "min_loops=0")])
def test_bad_exit_rule_is_named(kw, message):
    with pytest.raises(ValueError, match=message):
        ExitRule(**kw)


def test_explorer_generate_view_shows_loops_per_token():
    pytest.importorskip("ipywidgets")
    from workbench.data.corpus import ByteTokenizer
    from workbench.viz.explorer import LoopExplorer, loops_html

    model = perturb(LoopLM(cfg(vocab_size=257)), scale=0.2).eval()
    ex = LoopExplorer(model, ByteTokenizer(), text="def f(x):", max_loops=4)
    traces = ex.traces
    ex.set_loop(2)
    ex.generate(new_tokens=5)
    page = ex.generated.value
    assert ex.traces == traces  # generating is not a trace: the slider's cache stays
    assert "r = 2" in page and page.count('title="2 loops"') == 5  # the fixed run: every token at the slider's r
    assert page.count("<span") == 10 and "KL exit" in page
    assert "rgba(31,119,180,0.10)" in loops_html([("a", 1)], 4) and "0.90" in loops_html([("a", 4)], 4)
