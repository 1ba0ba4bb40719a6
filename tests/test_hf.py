"""Hugging Face interop: from_hf equals the Llama at loops=1, loops a slow by-hand reference, to_hf round-trips."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from workbench import LoopConfig, LoopLM  # noqa: E402
from workbench.models.hf import from_hf, to_hf  # noqa: E402

V, D, N, HEADS, FF, T = 300, 64, 4, 4, 96, 12
SPLITS = [(1, 2, 1), (0, 2, 2), (2, 2, 0), (0, 4, 0), (1, 1, 2)]


def tiny_llama(kv_heads=2, tied=False, seed=0, **extra):
    """A seeded random Llama; norm gains and biases are randomised too so a mis-mapped one shows."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=N,
                                   num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                                   max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=tied, **extra)
    llama = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in llama.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)  # larger than HF's 0.02 so every layer moves the logits visibly
    return llama


def assert_same_state(x, y):
    a, b = x.state_dict(), y.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def tokens(seed=1):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def by_hand(llama, ids, p, s, c, loops):
    """Slow reference: apply the HF decoder layers by hand, prelude once, core `loops` times, coda once."""
    m = llama.model
    h = m.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    rope = m.rotary_emb(h, pos)
    mask = torch.full((ids.shape[1],) * 2, float("-inf")).triu(1)[None, None]  # additive causal mask
    order = list(range(p)) + list(range(p, p + s)) * loops + list(range(p + s, p + s + c))
    for i in order:
        h = m.layers[i](h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
    return llama.lm_head(m.norm(h))


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@torch.no_grad()
def test_loops1_equals_llama(kv_heads, tied):
    llama = tiny_llama(kv_heads, tied)
    ids = tokens()
    want = llama(ids).logits
    for p, s, c in SPLITS:
        model = from_hf(llama, p, s, c).eval()
        assert (model.head is None) == tied and model.cfg.kv_heads == kv_heads
        assert model.cfg.rope_theta == 5000.0 and model.cfg.norm_eps == 1e-5
        got = model(ids, loops=1).logits
        assert (got - want).abs().max() < 1e-4, (p, s, c)


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@torch.no_grad()
def test_loops_matter_and_match_by_hand(kv_heads):
    llama = tiny_llama(kv_heads, tied=False, seed=3)
    ids = tokens()
    want1 = llama(ids).logits
    assert (by_hand(llama, ids, 1, 2, 1, 1) - want1).abs().max() < 1e-4  # the reference itself is right
    for p, s, c in [(1, 2, 1), (0, 3, 1), (2, 2, 0)]:
        model = from_hf(llama, p, s, c, loops=2).eval()
        got = model(ids).logits  # default loops is the config's K = 2
        assert (got - model(ids, loops=2).logits).abs().max() == 0
        assert (got - want1).abs().max() > 1e-2, "loops=2 must differ from the 1-pass Llama"
        for r in (2, 3):
            ref = by_hand(llama, ids, p, s, c, r)
            assert (model(ids, loops=r).logits - ref).abs().max() < 1e-4, (p, s, c, r)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@torch.no_grad()
def test_round_trip_state_dict(tied):
    llama = tiny_llama(2, tied)
    back = to_hf(from_hf(llama, 1, 2, 1))
    assert_same_state(llama, back)
    assert back.config.tie_word_embeddings == tied
    ids = tokens()
    assert torch.equal(back(ids).logits, llama(ids).logits)


def test_round_trip_keeps_dtype():
    llama = tiny_llama(2).to(torch.bfloat16)
    model = from_hf(llama, 1, 2, 1)
    assert model.embed.weight.dtype == torch.bfloat16
    back = to_hf(model)
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    assert_same_state(llama, back)


@torch.no_grad()
def test_overrides_keep_loop_extras_at_identity():
    llama = tiny_llama(2)
    ids = tokens()
    model = from_hf(llama, 1, 2, 1, inject="scalar").eval()
    assert model.cfg.inject == "scalar" and model.inject is not None
    assert (model(ids, loops=1).logits - llama(ids).logits).abs().max() < 1e-4
    with pytest.raises(ValueError, match="inject='scalar'"):
        to_hf(model)


def test_to_hf_rejects_what_llama_cannot_hold():
    base = dict(vocab_size=V, d_model=D, n_heads=HEADS, d_ff=FF, prelude=1, core=2, coda=1)
    for extra, word in [({"inject": "scalar"}, "inject"), ({"taper": "cosine"}, "taper"),
                        ({"sandwich_norm": True}, "sandwich_norm"), ({"history": 2}, "history"),
                        ({"timestep": "loop_gate"}, "timestep"), ({"hyper": 2}, "hyper")]:
        with pytest.raises(ValueError, match=word):
            to_hf(LoopLM(LoopConfig(**base, **extra)))
    to_hf(LoopLM(LoopConfig(**base)))  # the plain one converts


def test_from_hf_rejects_bad_split_and_unsupported_configs():
    llama = tiny_llama(2)
    with pytest.raises(ValueError, match=r"num_hidden_layers=4"):
        from_hf(llama, 1, 2, 2)
    with pytest.raises(ValueError, match="mlp_bias"):
        from_hf(tiny_llama(2, mlp_bias=True), 1, 2, 1)
    with pytest.raises(ValueError, match="head_dim"):
        from_hf(tiny_llama(2, head_dim=8), 1, 2, 1)
    with pytest.raises(ValueError, match="linear"):
        from_hf(tiny_llama(2, rope_scaling={"rope_type": "linear", "factor": 2.0}), 1, 2, 1)


@torch.no_grad()
def test_attention_bias():
    """Llama's attention_bias (q, k, v and o biases, all random and non-zero) maps exactly and round-trips."""
    llama = tiny_llama(2, attention_bias=True)
    ids = tokens()
    model = from_hf(llama, 1, 2, 1).eval()
    assert model.cfg.attn_bias
    for i, name in enumerate(["prelude.0", "core.0", "core.1", "coda.0"]):
        hf_bias = llama.model.layers[i].self_attn.o_proj.bias
        assert hf_bias.abs().min() > 0 and torch.equal(model.state_dict()[f"{name}.attn.o.bias"], hf_bias), name
    assert (model(ids, loops=1).logits - llama(ids).logits).abs().max() < 1e-4
    assert_same_state(llama, to_hf(model))
    # the biases act: without the o bias the logits move by far more than the tolerance above
    for blk in (*model.prelude, *model.core, *model.coda):
        blk.attn.o.bias.zero_()
    assert (model(ids, loops=1).logits - llama(ids).logits).abs().max() > 1e-2
