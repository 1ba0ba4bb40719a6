"""Computational interaction between block occurrences: how skipping one moves every later update (SPEC §3)."""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from ..models.looped import LoopLM
from ._common import attrs, check_horizon, check_int, check_tokens, has_places, occurrences, training_loops
from .protocol import Loopable


def interaction(model, tokens: torch.Tensor, loops: int | None = None, *, horizon: int | None = None,
                chunk: int | None = None) -> xr.Dataset:
    """Return a Dataset of C(i -> j) over (`source`, `target`), its mean by loop `lag`, and the terminal-to-core ratio.

    C(i -> j) = mean_tokens |u_j(-i) - u_j| / mean_tokens |u_j|, where u_j = h_j_out - h_j_in is
    the update of block occurrence j and (-i) means occurrence i is skipped (a hook at its place
    returns its input, so a hyper-connected layer's update is 0). NaN where j <= i.
    `interaction_by_lag` is the mean of C over pairs of core occurrences whose loops differ by `lag`
    (lag 0: later layers of the same loop). `terminal_to_core` (variable and attr) is, for
    every allocation, the mean C from core sources to the terminal stage (the coda blocks, or the last
    loop's blocks for a coda-free model) over the mean C from the same sources to the core blocks after
    them outside the terminal stage (SPEC §3); NaN only when no such pair exists (a single loop without
    a coda). `update_norm` is mean_tokens |u_j| over `target`.

    Needs named block occurrences: a LoopLM, or a Loopable with `places` (as `from_transformers`
    gives; for Inkling2Loop an occurrence is a decoder layer and u_j its hidden output minus input).
    Cost for a LoopLM: one plain pass that keeps its states, then, for each stage (prelude, each
    loop, coda), one pass of that stage's skip variants stacked along the batch (at most `chunk`
    variants per pass, default enough for ~32k token rows), started from the plain pass's state
    entering that stage, so nothing before it is recomputed. A Loopable runs each chunk of variants
    from the tokens (its carried state need not stack along the batch).
    """
    if not has_places(model):
        what = "a Loopable without places" if isinstance(model, Loopable) else type(model).__name__
        raise TypeError(f"interaction needs named block occurrences (a LoopLM, or a Loopable with places), got {what}")
    tokens = check_tokens(tokens, model)
    r = check_int("loops", training_loops(model) if loops is None else loops, 1)
    looplm = isinstance(model, LoopLM)
    T = check_horizon(model, r, horizon) if looplm else r
    B, L = tokens.shape
    chunk = check_int("chunk", max(1, 32768 // (B * L)) if chunk is None else chunk, 1)
    occ = occurrences(model, r)
    names = [o[0] for o in occ]
    C, den = _interaction_matrix(model, tokens, occ, r, T, chunk)
    stage, oloop = np.array([o[1] for o in occ]), np.array([o[2] for o in occ])
    lags = np.arange(r)
    by_lag, ratio = _by_lag_and_ratio(C, stage, oloop, r)
    layer = np.array([o[3] for o in occ])
    coords = {"source": names, "target": names,
              "source_stage": ("source", stage), "source_loop": ("source", oloop), "source_layer": ("source", layer),
              "target_stage": ("target", stage), "target_loop": ("target", oloop), "target_layer": ("target", layer),
              "lag": lags}
    return xr.Dataset(
        {"interaction": (("source", "target"), C, {"long_name": "C(source -> target)"}),
         "interaction_by_lag": ("lag", np.array(by_lag), {"long_name": "mean C over core pairs at this loop lag"}),
         "update_norm": ("target", den.cpu().double().numpy(), {"long_name": "mean_tokens |u_j|"}),
         "terminal_to_core": ((), ratio, {"long_name": "mean C(core -> terminal stage) / mean C(core -> later core outside it)"})},
        coords=coords,
        attrs=attrs(model, "interaction", loops=r, horizon=T, terminal_to_core=ratio, chunk=chunk))


def _interaction_matrix(model, tokens: torch.Tensor, occ: list, r: int, T: int, chunk: int):
    """Return (C as a [n, n] float64 array, NaN where target <= source; mean_tokens |u_j| as a tensor) over occ."""
    looplm = isinstance(model, LoopLM)
    B = tokens.shape[0]
    index = {o[0]: j for j, o in enumerate(occ)}
    n = len(occ)
    blocks = model.block_patterns() if looplm else ()  # the parts it has: a pattern naming no place is refused

    def run_loopable(tok, hook):
        _, carried = model.run(tok, r, hook=hook)
        model.readout(carried[-1], hook=hook)

    with torch.no_grad():
        # ---- the plain pass: every update u_j and every loop state --------------------------------
        base_u: dict[int, torch.Tensor] = {}

        def keep(name, x_in, x_out):
            base_u[index[name]] = x_out - x_in

        if looplm:
            base = model.run(tokens, r, horizon=T, keep_states=True, hooks=dict.fromkeys(blocks, keep), coda=True)
        else:
            run_loopable(tokens, keep)
        den = torch.stack([base_u[j].float().norm(dim=-1).mean() for j in range(n)])
        num = torch.full((n, n), float("nan"), dtype=torch.float32, device=den.device)

        # ---- the skip variants of each stage, stacked along the batch, from the state entering it --
        def stage(j: int) -> int:  # 0 prelude, t for loop t, r + 1 coda
            kind, t = occ[j][1], occ[j][2]
            return 0 if kind == "prelude" or not looplm else t

        sources = list(range(n - 1))  # skipping the last occurrence changes nothing later
        for S in sorted({stage(j) for j in sources}):
            in_stage = [j for j in sources if stage(j) == S]
            for c0 in range(0, len(in_stage), chunk):
                group = in_stage[c0:c0 + chunk]
                m = len(group)
                srcs = torch.as_tensor(group, device=num.device)
                rows = {j: torch.arange(m * B, device=den.device) // B == i for i, j in enumerate(group)}

                def act(name, x_in, x_out):
                    j = index[name]
                    d = (x_out - x_in).reshape(m, B, *x_out.shape[1:])
                    diff = (d - base_u[j]).float().norm(dim=-1).mean(dim=tuple(range(1, d.dim() - 1)))
                    later = srcs < j
                    num[srcs[later], j] = diff[later]
                    if j in rows:  # skip the occurrence in its own variant's rows: output := input
                        return torch.where(rows[j].view(-1, *([1] * (x_out.dim() - 1))), x_in, x_out)
                    return None

                hooks = dict.fromkeys(blocks, act)
                if not looplm:
                    run_loopable(tokens.repeat(m, 1), act)
                elif S == 0:
                    model.run(tokens.repeat(m, 1), r, horizon=T, hooks=hooks, coda=True)
                else:
                    model.run(None, r, horizon=T, hooks=hooks, coda=True, start=base.start(S - 1).repeat(m))
        return (num / den.clamp_min(1e-12).unsqueeze(0)).cpu().double().numpy(), den


def _by_lag_and_ratio(C: np.ndarray, stage: np.ndarray, oloop: np.ndarray, r: int) -> tuple[list[float], float]:
    """Return (mean C over core pairs at each loop lag 0..r-1, the terminal-to-core ratio of SPEC §3)."""
    core = stage == "core"
    by_lag = []
    for lag in range(r):
        sel = core[:, None] & core[None, :] & ((oloop[None, :] - oloop[:, None]) == lag)
        vals = C[sel]
        vals = vals[~np.isnan(vals)]
        by_lag.append(vals.mean() if vals.size else np.nan)

    def block_mean(rows, cols):
        vals = C[np.ix_(rows, cols)]
        vals = vals[~np.isnan(vals)]
        return float(vals.mean()) if vals.size else float("nan")

    # SPEC §3: the terminal stage is the coda, or the last loop when there is none; sources are the core
    # occurrences outside it; the reference is their response in the core blocks after them outside it.
    terminal = (stage == "coda") if (stage == "coda").any() else (core & (oloop == r))
    inner = np.flatnonzero(core & ~terminal)
    # C is NaN where target <= source, so block_mean over (inner, inner) keeps only the later targets
    return by_lag, block_mean(inner, np.flatnonzero(terminal)) / block_mean(inner, inner)
