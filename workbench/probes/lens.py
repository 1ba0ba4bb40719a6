"""Logit lens over loops: the coda + head applied to the state after every loop (SPEC §3)."""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from ..models.looped import LoopLM, LoopTrace
from ._common import (attrs, check_horizon, check_int, check_model, check_targets, check_tokens, kl, masked_mean,
                      token_stats, trace_states, training_loops)


def states_for(model, tokens: torch.Tensor, loops: int, horizon, trace: LoopTrace | None):
    """Return (states, read, horizon) from the given trace (checked against loops) or one new pass.

    read(t) is the logits of the state after loop t (see `trace_states`).
    """
    if trace is not None:
        if not isinstance(model, LoopLM) or not isinstance(trace, LoopTrace):
            raise ValueError("trace must be a LoopTrace of the LoopLM being probed")
        if loops > trace.max_loops:
            raise ValueError(f"loops={loops} is invalid: the trace holds loops 1..{trace.max_loops}")
        if tuple(trace.states.shape[1:3]) != tuple(tokens.shape):
            raise ValueError(f"trace was taken on a batch of shape {tuple(trace.states.shape[1:3])}, "
                             f"tokens have shape {tuple(tokens.shape)}")
        return trace.states, lambda t: model.readout(trace.states[t]), trace.horizon
    T = check_horizon(model, loops, horizon) if isinstance(model, LoopLM) else None
    states, read = trace_states(model, tokens, loops, T)
    return states, read, (loops if T is None else T)


def lens(model, tokens: torch.Tensor, targets: torch.Tensor, loops: int | None = None, *,
         horizon: int | None = None, trace: LoopTrace | None = None) -> xr.Dataset:
    """Return a Dataset of per-loop next-token `loss`, `accuracy`, `entropy` and `kl_final` over dim `loop`.

    Loop t reads out the state after loop t (coda, final norm, head) from one trace; `kl_final` is
    KL(p_r || p_t) = sum p_r (log p_r - log p_t), the final loop's distribution as the reference.
    All four are means over the labelled tokens (targets != -100), in nats. A horizon-dependent
    model is traced with T = `horizon` (default r), so loop t is a loop of a T-loop run; a
    precomputed `trace` (LoopLM only) may be passed instead of a new pass.
    """
    check_model(model)
    tokens = check_tokens(tokens, model)
    targets = check_targets(targets, tokens, model)
    r = check_int("loops", training_loops(model) if loops is None else loops, 1)
    mask = targets != -100
    with torch.no_grad():
        _, read, T = states_for(model, tokens, r, horizon, trace)
        lp_r, _, _ = token_stats(read(r))
        rows = []
        for t in range(1, r + 1):
            lp, loss, correct = token_stats(read(t), targets)
            entropy = -(lp.exp() * lp).sum(-1)
            rows.append((masked_mean(loss, mask), masked_mean(correct, mask), masked_mean(entropy, mask),
                         masked_mean(kl(lp_r, lp), mask)))
    a = np.array(rows).reshape(r, 4)
    return xr.Dataset(
        {"loss": ("loop", a[:, 0], {"long_name": "next-token cross-entropy", "units": "nats"}),
         "accuracy": ("loop", a[:, 1], {"long_name": "next-token top-1 accuracy"}),
         "entropy": ("loop", a[:, 2], {"long_name": "entropy of the predicted distribution", "units": "nats"}),
         "kl_final": ("loop", a[:, 3], {"long_name": "KL(p_final || p_t)", "units": "nats"})},
        coords={"loop": np.arange(1, r + 1)},
        attrs=attrs(model, "lens", loops=r, horizon=T, tokens_counted=int(mask.sum()),
                    kl_direction="KL(final loop || loop t)"))
