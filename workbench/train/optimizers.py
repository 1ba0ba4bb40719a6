"""Optimisers and the learning-rate schedule: Muon for the hidden matrices, AdamW for the rest, one lr for both."""

from __future__ import annotations

import math

import torch

from ..optim import Muon
from .config import TrainConfig

_MUON_SUFFIXES = (".attn.qkv.weight", ".attn.o.weight", ".mlp.gate_up.weight", ".mlp.down.weight")


def param_groups(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """Return (muon, adamw) lists of (name, parameter): Muon gets exactly the 2-D hidden matrices.

    Hidden matrices are the blocks' attention and MLP weights, the dense injection, re-entry bridge and
    history lag matrices; embeddings, head, norms, biases, gates, scalars, hyper-connection mixers and
    low-rank adapter factors go to AdamW. Frozen parameters (requires_grad=False) go to neither.
    """
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden = (name.endswith(_MUON_SUFFIXES) or name in ("inject.weight", "inject.B", "inject.W_p", "inject.W_s")
                  or (name.startswith("history.lags.") and p.ndim == 2))
        (muon if hidden and p.ndim == 2 else adamw).append((name, p))
    return muon, adamw


def make_optimizers(model: torch.nn.Module, tc: TrainConfig) -> list[torch.optim.Optimizer]:
    """Return [Muon, AdamW] (or [AdamW] with muon=False); Muon scales its update to AdamW's RMS so one lr fits both."""
    muon, adamw = param_groups(model)
    opts = []
    if tc.muon and muon:
        opts.append(Muon([p for _, p in muon], lr=tc.lr, weight_decay=tc.weight_decay,
                         adjust_lr_fn="match_rms_adamw"))
    else:
        adamw = muon + adamw
    opts.append(torch.optim.AdamW([p for _, p in adamw], lr=tc.lr, weight_decay=tc.weight_decay,
                                  betas=(0.9, 0.95)))
    return opts


def lr_at(step: int, total: int, tc: TrainConfig) -> float:
    """Return the learning rate at 0-based `step` of `total`: linear warmup, then cosine / WSD / constant."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    lo = tc.lr * tc.min_lr_ratio
    if tc.schedule == "constant":
        return tc.lr
    if tc.schedule == "cosine":
        span = max(1, total - tc.warmup)
        progress = min(1.0, (step - tc.warmup) / span)
        return lo + (tc.lr - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = total - max(1, round(tc.decay_frac * total))
    if step < decay_start:
        return tc.lr
    return tc.lr + (lo - tc.lr) * (step - decay_start + 1) / (total - decay_start)


def set_lr(opts: list[torch.optim.Optimizer], lr: float) -> None:
    """Return None after setting every parameter group of every optimiser to `lr`."""
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = lr
