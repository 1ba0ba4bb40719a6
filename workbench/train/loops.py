"""Loop counts per step and what they cost: the loop sampler, the step budget, training FLOPs, per-loop loss.

Loop counts are fixed, uniform in [loop_min, loop_max], or Huginn's Poisson-lognormal
(tau ~ N(log mean - sigma^2/2, sigma), r = 1 + Poisson(e^tau)), drawn from a generator seeded by
(seed, step), so a resumed run replays the same loop counts (and every DDP rank draws the same).
With sampled r, k = min(backward_loops, r).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..models.looped import LoopLM
from .config import TrainConfig


def sample_loops(step: int, tc: TrainConfig, K: int) -> tuple[int, int]:
    """Return (r, k) for a step: r from the loop sampler seeded by (seed, step), k = min(backward_loops, r)."""
    rng = np.random.default_rng([tc.seed, step, 7])
    if tc.loop_sampler == "fixed":
        r = tc.loops or K
    elif tc.loop_sampler == "uniform":
        r = int(rng.integers(tc.loop_min, (tc.loop_max or 2 * K) + 1))
    else:
        tau = rng.normal(math.log(tc.loops or K) - tc.loop_sigma ** 2 / 2, tc.loop_sigma)
        r = 1 + int(rng.poisson(math.exp(tau)))
        if tc.loop_max is not None:
            r = min(r, tc.loop_max)
    k = r if tc.backward_loops is None else min(tc.backward_loops, r)
    return r, k


def budget_steps(model: LoopLM, tc: TrainConfig, world: int = 1) -> int:
    """Return the number of steps the budget (steps, tokens, flops or chinchilla) buys at `world` processes."""
    K = model.cfg.loops
    tokens_per_step = tc.batch_size * tc.seq_len * world
    if tc.steps is not None:
        return tc.steps
    if tc.tokens is not None:
        tokens = tc.tokens
    elif tc.flops is not None:
        r = tc.loops or K
        if tc.loop_sampler != "fixed":  # the sampler's mean loop count, estimated from its first 1000 draws
            r = float(np.mean([sample_loops(s, tc, K)[0] for s in range(1000)]))
        k = r if tc.backward_loops is None else min(tc.backward_loops, r)
        fpt = model.flops_per_token(max(1, round(r)), max(1, min(round(k), round(r))), seq_len=tc.seq_len)
        tokens = tc.flops / fpt
    else:
        pc = model.param_counts()
        tokens = 20 * (pc["once"] + pc["rec"])
    steps = int(tokens // tokens_per_step)
    if steps < 1:
        raise ValueError(f"the budget gives {tokens:.3g} tokens, fewer than one step of {tokens_per_step} "
                         f"(batch_size x seq_len x world): zero steps to train")
    return steps


def training_flops(model: LoopLM, tc: TrainConfig, steps: int, world: int = 1) -> float:
    """Return the FLOPs of training `steps` steps (mean sampled loop count; head and attention included)."""
    K = model.cfg.loops
    draws = [sample_loops(s, tc, K) for s in range(min(steps, 1000))]  # the sampler's mean r and k
    r = max(1, round(float(np.mean([d[0] for d in draws]))))
    k = max(1, min(r, round(float(np.mean([d[1] for d in draws])))))
    fpt = model.flops_per_token(r, k, seq_len=tc.seq_len, include_head=True)
    return float(fpt) * steps * tc.batch_size * tc.seq_len * world


def per_loop_loss(model: LoopLM, tokens: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
                  backward_loops: int | None = None) -> torch.Tensor:
    """Return the per-loop supervised loss: `model(tokens, labels=labels, label_weights=weights).loss`.

    labels is [B, loops, T] (-100 where a loop carries no label). With `weights` None or [loops] the
    loss averages the per-loop mean cross-entropies over the loops that carry a label, weighted by
    `weights` (set weights to one-hot on the last loop for final-answer-only grading). With `weights`
    [B, loops] every (example, loop) pair that carries a label counts once, with its own weight: the
    loss is the weighted mean of the pairs' mean cross-entropies (what mixed-depth batches need, whose
    final loop differs per example). A Trainer calls the (DDP-wrapped) model the same way.
    """
    return model(tokens, labels=labels, label_weights=weights, backward_loops=backward_loops).loss
