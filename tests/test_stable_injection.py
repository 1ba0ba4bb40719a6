"""inject="stable": Parcae's diagonal injection h <- exp(dt A) h + dt (h0 B^T), against a per-channel transcription."""

import math

import pytest
import torch

from helpers import D, cfg, perturb, tokens
from workbench import LoopLM
from workbench.models.conditioning import STABLE_INIT_DECAY, InitialInjection
from workbench.train import param_groups


def slow_stable(A_log, dt, B, h, h0):
    """SPEC §1 one channel at a time in float64 Python: Δ = softplus(dt), A = -exp(A_log), decay = exp(Δ A)."""
    d = len(A_log)
    out = torch.empty(h.shape, dtype=torch.float64)
    decays = []
    for i in range(d):
        delta = math.log1p(math.exp(float(dt[i])))
        a = -math.exp(float(A_log[i]))
        decay = math.exp(delta * a)
        decays.append(decay)
        injected = sum(h0[..., j].double() * float(B[i, j]) for j in range(d))  # (h0 · Bᵀ)_i
        out[..., i] = decay * h[..., i].double() + delta * injected
    return out, decays


def randomised(d=8, seed=0, scale=1.0):
    inj = InitialInjection("stable", d)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in inj.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return inj


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stable_injection_matches_the_per_channel_formula(seed):
    d = 8
    inj = randomised(d, seed).double()
    g = torch.Generator().manual_seed(100 + seed)
    h = torch.randn(2, 3, d, generator=g, dtype=torch.float64)
    h0 = torch.randn(2, 3, d, generator=g, dtype=torch.float64)
    want, decays = slow_stable(inj.A_log.detach(), inj.dt.detach(), inj.B.detach(), h, h0)
    with torch.no_grad():
        got = inj(h, h0)
        decay, step = inj.discretized()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(decay, torch.tensor(decays, dtype=torch.float64), rtol=1e-12, atol=0)
    assert all(0 < x < 1 for x in decays)
    # B is a full matrix: its off-diagonal entries move each channel by the other channels of h0
    with torch.no_grad():
        inj.B.copy_(torch.diag(torch.diagonal(inj.B)))
        assert (inj(h, h0) - got).abs().min() > 1e-6
    assert step.shape == decay.shape == (d,) and (step > 0).all()


def test_stable_injection_broadcasts_h0_over_hyper_streams():
    d = 8
    inj = randomised(d, 3).double()
    g = torch.Generator().manual_seed(7)
    h = torch.randn(2, 3, 2, d, generator=g, dtype=torch.float64)  # n = 2 streams
    h0 = torch.randn(2, 3, 1, d, generator=g, dtype=torch.float64)
    want, _ = slow_stable(inj.A_log.detach(), inj.dt.detach(), inj.B.detach(), h, h0.expand_as(h))
    with torch.no_grad():
        torch.testing.assert_close(inj(h, h0), want, rtol=1e-12, atol=1e-12)


def test_stable_injection_init_is_parcaes():
    d = 16
    inj = InitialInjection("stable", d)
    assert torch.equal(inj.B.detach(), torch.eye(d))
    assert torch.equal(inj.A_log.detach(), torch.zeros(d))
    decay, step = inj.discretized()
    torch.testing.assert_close(decay.detach(), torch.full((d,), math.sqrt(0.2)), rtol=1e-6, atol=0)
    assert STABLE_INIT_DECAY == pytest.approx(0.4472136)
    torch.testing.assert_close(step.detach(), torch.full((d,), 0.5 * math.log(5)), rtol=1e-6, atol=0)
    h, h0 = torch.randn(3, d), torch.randn(3, d)
    torch.testing.assert_close(inj(h, h0), math.sqrt(0.2) * h + 0.5 * math.log(5) * h0, rtol=1e-5, atol=1e-6)


def test_each_channel_decay_stays_in_the_open_unit_interval():
    # wide random parameters, but not so wide that exp(-Δ exp(A_log)) rounds to 0 or 1 in float64
    for seed in range(20):
        inj = randomised(32, seed, scale=1.5).double()
        decay, step = inj.discretized()
        assert (decay > 0).all() and (decay < 1).all(), seed
        assert (step > 0).all(), seed


def test_stable_model_runs_and_b_goes_to_muon():
    model = perturb(LoopLM(cfg(inject="stable")))
    x = tokens()
    out = model(x, loops=3, targets=x)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.inject.parameters())
    muon, adamw = param_groups(model)
    assert "inject.B" in {n for n, _ in muon}  # an injection matrix (SPEC §2)
    assert {"inject.A_log", "inject.dt"} <= {n for n, _ in adamw}
    assert model.param_counts()["rec"] - LoopLM(cfg()).param_counts()["rec"] == D * D + 2 * D
