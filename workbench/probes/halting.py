"""Adaptive exit at inference: stop a token's loop once its prediction (or state) stops moving."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from ..models.looped import LoopTrace
from ._common import (EPS, attrs, check_int, check_model, check_targets, check_tokens, kl, masked_mean,
                      token_stats, training_loops)
from .lens import states_for

CRITERIA = ("kl", "state")


def halting(model, tokens: torch.Tensor, targets: torch.Tensor, loops: int | None = None, *,
            threshold: float | Sequence[float] = 1e-3, criterion: str = "kl", min_loops: int = 1,
            horizon: int | None = None, trace: LoopTrace | None = None) -> xr.Dataset:
    """Return a Dataset of per-token exit loops and the compute saved and loss paid against fixed r_max.

    Each token exits at the first loop t >= `min_loops` where the criterion is strictly below
    `threshold`, else at r_max = `loops`. Criteria: "kl" is KL(p_t || p_{t-1}) between successive
    loops' next-token distributions (p_0 reads out h0), "state" the relative state change
    |x(t) - x(t-1)| / max(|x(t-1)|, eps). The token's prediction is then the readout at its exit loop.
    Threshold 0 never exits early (both criteria are >= 0), so it reproduces fixed r_max exactly.

    Variables: `exit_loop` (dims `batch`, `token`), `mean_exit_loop`, `compute_saved`
    (1 - mean core passes used / r_max; both over all tokens), `loss_adaptive`, `accuracy_adaptive`
    (over labelled tokens), `loss_paid` (= loss_adaptive - loss_fixed), with a `threshold` dim when a
    sequence of thresholds is given; `loss_fixed`, `accuracy_fixed` at r_max; `criterion_mean` over
    `loop`. This measures exits on one full trace: every token's state is computed at every loop, so
    later tokens attend to states an exited token would not have computed; a deployed early exit
    must copy those states forward, which this measurement does not simulate.
    """
    check_model(model)
    tokens = check_tokens(tokens, model)
    targets = check_targets(targets, tokens, model)
    r = check_int("loops", training_loops(model) if loops is None else loops, 1)
    m0 = check_int("min_loops", min_loops, 1, r, allowed=f"must be an integer in 1..loops={r}")
    if criterion not in CRITERIA:
        raise ValueError(f"criterion={criterion!r} is invalid: must be one of {', '.join(CRITERIA)}")
    scalar = np.ndim(threshold) == 0
    try:
        thr = np.atleast_1d(np.asarray(threshold, dtype=float))
    except (TypeError, ValueError):
        raise ValueError(f"threshold={threshold!r} is invalid: must be a number >= 0 or a sequence of them") from None
    if thr.ndim != 1 or thr.size == 0 or not np.all(np.isfinite(thr)) or np.any(thr < 0):
        raise ValueError(f"threshold={threshold!r} is invalid: must be a finite number >= 0 or a sequence of them")
    mask = targets != -100
    n = thr.size
    with torch.no_grad():
        states, read, T = states_for(model, tokens, r, horizon, trace)
        B, L = tokens.shape
        dev = states.device
        th = torch.as_tensor(thr, dtype=torch.float64, device=dev).view(n, 1, 1)
        exit_loop = torch.full((n, B, L), r, dtype=torch.long, device=dev)
        done = torch.zeros((n, B, L), dtype=torch.bool, device=dev)
        loss_at = torch.zeros((n, B, L), dtype=torch.float32, device=dev)
        correct_at = torch.zeros((n, B, L), dtype=torch.float32, device=dev)
        prev = token_stats(read(0))[0] if criterion == "kl" else None
        crit_mean = []
        for t in range(1, r + 1):
            lp, loss, correct = token_stats(read(t), targets)
            if criterion == "kl":
                crit = kl(lp, prev)
                prev = lp
            else:
                x0, x1 = states[t - 1].float(), states[t].float()
                crit = (x1 - x0).norm(dim=-1) / x0.norm(dim=-1).clamp_min(EPS)
            crit_mean.append(float(crit.mean()))
            stop = ~done & (crit.double().unsqueeze(0) < th) if t >= m0 else torch.zeros_like(done)
            if t == r:
                stop = ~done  # everyone left exits at r_max
            exit_loop = torch.where(stop, torch.full_like(exit_loop, t), exit_loop)
            loss_at = torch.where(stop, loss.unsqueeze(0).expand_as(loss_at), loss_at)
            correct_at = torch.where(stop, correct.unsqueeze(0).expand_as(correct_at), correct_at)
            done |= stop
        loss_fixed, acc_fixed = masked_mean(loss, mask), masked_mean(correct, mask)
        mean_exit = exit_loop.double().mean(dim=(1, 2)).cpu().numpy()
        loss_ad = np.array([masked_mean(loss_at[i], mask) for i in range(n)])
        acc_ad = np.array([masked_mean(correct_at[i], mask) for i in range(n)])
    ds = xr.Dataset(
        {"exit_loop": (("threshold", "batch", "token"), exit_loop.cpu().numpy(),
                       {"long_name": "loop at which the token exits"}),
         "mean_exit_loop": ("threshold", mean_exit),
         "compute_saved": ("threshold", 1.0 - mean_exit / r,
                           {"long_name": "1 - mean core passes used / r_max"}),
         "loss_adaptive": ("threshold", loss_ad, {"units": "nats"}),
         "accuracy_adaptive": ("threshold", acc_ad),
         "loss_paid": ("threshold", loss_ad - loss_fixed, {"long_name": "loss_adaptive - loss_fixed",
                                                           "units": "nats"}),
         "loss_fixed": ((), loss_fixed, {"units": "nats"}),
         "accuracy_fixed": ((), acc_fixed),
         "criterion_mean": ("loop", np.array(crit_mean), {"long_name": f"mean {criterion} criterion"})},
        coords={"threshold": thr, "batch": np.arange(B), "token": np.arange(L), "loop": np.arange(1, r + 1)},
        attrs=attrs(model, "halting", loops=r, horizon=T, criterion=criterion, min_loops=m0,
                    threshold=float(thr[0]) if scalar else ",".join(map(str, thr.tolist()))))
    if scalar:
        ds = ds.isel(threshold=0)
    return ds
