"""Muon with Newton-Schulz in the fast dtype (workbench/optim.py) against a float64 reference and torch's Muon."""

import json

import pytest
import torch

from workbench.io import _load_optim_state, _optim_state
from workbench.optim import Muon, newton_schulz, resolve_ns_dtype

COEFFS = (3.4445, -4.7750, 2.0315)
SHAPES = [(96, 32), (32, 96), (64, 64)]  # tall, wide, square


def reference_ns(G, steps=5, coefficients=COEFFS, eps=1e-7):
    """Return G orthogonalised by the quintic X <- aX + (bA + cA^2)X, A = XX^T, in float64, written plainly."""
    a, b, c = coefficients
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / max(X.norm().item(), eps)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_newton_schulz_matches_a_float64_reference(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz(G, dtype=torch.float32)
    ref = reference_ns(G)
    assert ours.dtype == torch.float32 and ours.shape == G.shape
    # measured: max |fp32 - fp64| 4e-7..8.5e-7 over seeds 0-4 and shapes up to 1024x256 (entries up to 0.44,
    # fp32 rounding amplified by the quintic's slope ~3.4 per step); 5e-6 leaves 6x for other BLAS kernels
    # and thread counts, while a wrong coefficient or one step fewer is off by >1e-2
    assert (ours.double() - ref).abs().max().item() < 5e-6
    assert (reference_ns(G, steps=4) - ref).abs().max().item() > 1e-2  # the tolerance can tell steps apart
    # float64 in, float64 out: only the reference's different operation order separates them
    assert torch.allclose(newton_schulz(G.double(), dtype=torch.float64), ref, rtol=0, atol=1e-12)


def test_newton_schulz_leaves_its_input_alone_and_rejects_non_matrices():
    G = torch.randn(8, 4)
    before = G.clone()
    newton_schulz(G, dtype=torch.float32)  # G.to(fp32) is G itself: the normalisation must not write into it
    assert torch.equal(G, before)
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.randn(2, 3, 4))


def params(seed=0):
    """Return fresh 2-D parameters of tall, wide and square shapes."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in SHAPES]


def grads(steps, seed=1):
    """Return per-step lists of gradients for `params()` (fixed, so both optimisers see the same ones)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g) for s in SHAPES] for _ in range(steps)]


def run(opt, ps, gs):
    """Return the per-step parameter updates (after - before) of `opt` fed the gradients `gs`."""
    deltas = []
    for step in gs:
        before = [p.detach().clone() for p in ps]
        for p, g in zip(ps, step):
            p.grad = g.clone()
        opt.step()
        deltas.append([p.detach() - b for p, b in zip(ps, before)])
    return deltas


KW = [dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),  # the trainer's settings
      dict(lr=0.02, weight_decay=0.0, nesterov=False),  # plain momentum, "original" lr scaling
      dict(lr=1e-3, momentum=0.9, adjust_lr_fn="original", ns_steps=3)]


def side_by_side(ns_dtype: torch.dtype, kw: dict):
    """Return (our updates, torch's updates, our params, torch's params) after 4 steps on the same gradients."""
    a, b = params(), params()
    return run(Muon(a, ns_dtype=ns_dtype, **kw), a, grads(4)), run(torch.optim.Muon(b, **kw), b, grads(4)), a, b


@pytest.mark.parametrize("kw", KW)
def test_bf16_muon_is_torchs_muon_bit_for_bit(kw):
    ours, torchs, a, b = side_by_side(torch.bfloat16, kw)
    for step_ours, step_torch in zip(ours, torchs):
        for x, y in zip(step_ours, step_torch):
            assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kw", KW)
def test_fp32_muon_points_where_torchs_muon_points(kw):
    ours, torchs, _, _ = side_by_side(torch.float32, kw)
    for step_ours, step_torch in zip(ours, torchs):
        for x, y in zip(step_ours, step_torch):
            assert not torch.equal(x, y)  # really a different dtype
            assert torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0).item() > 0.99


def test_auto_picks_bf16_only_where_the_device_does_it_fast():
    slow, fast = "flags\t\t: fpu sse avx2 fma", "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16"
    assert resolve_ns_dtype("auto", "cpu", cpuinfo=slow) == torch.float32
    assert resolve_ns_dtype("auto", "cpu", cpuinfo=fast) == torch.bfloat16
    assert resolve_ns_dtype("auto", "cpu", cpuinfo="flags : avx512_bf16") == torch.bfloat16
    assert resolve_ns_dtype(torch.float64, "cpu", cpuinfo=fast) == torch.float64  # explicit wins
    assert resolve_ns_dtype(torch.bfloat16, "cpu", cpuinfo=slow) == torch.bfloat16


def test_auto_muon_uses_the_resolved_dtype_on_this_host():
    from workbench.models.precision import fast_bf16

    want = torch.bfloat16 if fast_bf16("cpu") else torch.float32
    a, b = params(), params()
    got = run(Muon(a, lr=0.02), a, grads(2))
    exp = run(Muon(b, lr=0.02, ns_dtype=want), b, grads(2))
    assert all(torch.equal(x, y) for s, t in zip(got, exp) for x, y in zip(s, t))


@pytest.mark.parametrize("bad", ["fp32", "bf16", None, 32, torch.float16, torch.int8, torch.tensor(1.0)])
def test_a_bad_ns_dtype_fails_naming_the_field(bad):
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon(params(), ns_dtype=bad)
    with pytest.raises(ValueError, match="ns_dtype"):
        resolve_ns_dtype(bad, "cpu")


@pytest.mark.parametrize("direction", ["torch->ours", "ours->torch"])
def test_a_checkpointed_state_moves_between_torchs_muon_and_ours(direction):
    """Through the trainer's checkpoint path (io._optim_state: tensors + JSON metadata), both ways."""
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    make_ours = lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw)  # noqa: E731
    make_torch = lambda ps: torch.optim.Muon(ps, **kw)  # noqa: E731
    first, second = (make_torch, make_ours) if direction == "torch->ours" else (make_ours, make_torch)
    gs = grads(5)
    a = params()
    opt_a = first(a)
    run(opt_a, a, gs[:3])
    tensors, meta = _optim_state([opt_a])
    tensors = {k: v.clone() for k, v in tensors.items()}  # as read back from optim.safetensors: not opt_a's buffers
    meta = json.loads(json.dumps(meta))  # what state.json holds
    assert sorted({k.rsplit(".", 1)[1] for k in tensors}) == ["momentum_buffer"]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = second(b)
    _load_optim_state([opt_b], tensors, meta)
    assert json.dumps(opt_b.state_dict()["param_groups"]) == json.dumps(opt_a.state_dict()["param_groups"])
    run(opt_a, a, gs[3:])
    run(opt_b, b, gs[3:])
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # resumed in the other optimiser: the same bits


def test_ns_dtype_survives_a_deepcopy():
    import copy

    opt = copy.deepcopy(Muon(params(), ns_dtype=torch.float64))
    assert opt.ns_dtype == torch.float64
