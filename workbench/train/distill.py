"""The retrofit's loop-1 distillation: hold the one-loop path to the frozen base while the block trains.

TrainConfig.loop1_distill > 0 adds loop1_distill x KL(reference || model) on the loop-1 next-token
distributions to the loss; the reference is `frozen_copy` of the model as the Trainer received it.
"""

from __future__ import annotations

import copy

import torch

from ..models.looped import LoopLM


def frozen_copy(model: LoopLM) -> LoopLM:
    """Return a copy of the model in eval mode with every parameter frozen, sharing the already frozen ones."""
    shared = {id(p): p for p in model.parameters() if not p.requires_grad}  # deepcopy returns memo hits as they are
    ref = copy.deepcopy(model, shared)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()


def loop1_kl(model: LoopLM, reference: LoopLM, tokens: torch.Tensor, state1: torch.Tensor) -> torch.Tensor:
    """Return mean KL(reference || model) over positions of the next-token distributions at loop 1.

    `state1` is the model's state after loop 1 for `tokens` as the coda reads it (the `state.1` place of
    the training pass, its graph kept); the reference runs one loop without a graph. The softmaxes are
    fp32. This is TrainConfig.loop1_distill's term: it holds a retrofit's one-loop path to the frozen
    base when the block itself trains (the full budget).
    """
    log_softmax = torch.nn.functional.log_softmax
    with torch.no_grad():
        ref = log_softmax(reference.readout(reference.run(tokens, 1).state).float(), -1)
    logp = log_softmax(model.readout(state1).float(), -1)
    return (ref.exp() * (ref - logp)).sum(-1).mean()
