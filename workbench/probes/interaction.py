"""Computational interaction between block occurrences: how skipping one moves every later update (SPEC §3)."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import xarray as xr

from ..models.looped import LoopLM
from ._common import BlockHooks, attrs, check_horizon, check_int, check_tokens, occurrences


def _repeat(x: torch.Tensor, m: int) -> torch.Tensor:
    return x.repeat(m, *([1] * (x.dim() - 1)))


def interaction(model: LoopLM, tokens: torch.Tensor, loops: int | None = None, *, horizon: int | None = None,
                chunk: int | None = None) -> xr.Dataset:
    """Return a Dataset of C(i -> j) over (`source`, `target`), its mean by loop `lag`, and the terminal-to-core ratio.

    C(i -> j) = mean_tokens |u_j(-i) - u_j| / mean_tokens |u_j|, where u_j = h_j_out - h_j_in is
    the update of block occurrence j and (-i) means occurrence i is skipped (its output := its
    input; a hyper-connected layer's update := 0). NaN where j <= i. `interaction_by_lag` is the
    mean of C over pairs of core occurrences whose loops differ by `lag` (lag 0: later layers of the
    same loop). `terminal_to_core` (variable and attr) is the mean C from core sources to the coda
    blocks over the mean C from core sources to the blocks of the last core loop. `update_norm` is
    mean_tokens |u_j| over `target`.

    Needs a LoopLM (named block occurrences). Cost: one plain pass, then the skip variants run
    stacked along the batch (`chunk` variants per pass, default enough for ~32k token rows), each
    variant joining the stack at the start of the loop (or prelude / coda) that holds its skipped
    occurrence from the plain pass's state there, so nothing before that stage is recomputed.
    """
    if not isinstance(model, LoopLM):
        raise TypeError(f"interaction needs a LoopLM (named block occurrences), got {type(model).__name__}")
    tokens = check_tokens(tokens, model)
    cfg = model.cfg
    r = check_int(cfg.loops if loops is None else loops, "loops")
    T = check_horizon(model, r, horizon)
    B, L = tokens.shape
    chunk = check_int(max(1, 32768 // (B * L)) if chunk is None else chunk, "chunk")
    p, s = cfg.prelude, cfg.core
    occ = occurrences(model, r)
    n = len(occ)
    n_core_end = p + r * s

    def stage_of(j: int) -> int:  # 0 prelude, 1..r loops, r+1 coda
        return 0 if j < p else (1 + (j - p) // s if j < n_core_end else r + 1)

    def stage_start(S: int) -> int:
        return 0 if S == 0 else (p + (S - 1) * s if S <= r else n_core_end)

    with torch.no_grad():
        h0_probe = model.embed.weight
        rope = model.rotary(L, h0_probe.dtype, h0_probe.device)
        psi, gates, mods = model.loop_conditioning(T, h0_probe)

        def init(h0):
            return model.initial_state(h0)[0]

        def h0_arg(h0):
            return model.initial_state(h0)[1]

        def run_loop(i, h, h0, past):
            h_new = model.step(h, h0_arg(h0), i, rope, past, psi, gates, mods)
            if model.history is not None and i >= 1:
                past.appendleft(h)
            return h_new

        # ---- the plain pass: every update u_j and every loop state --------------------------------
        base_u: list[torch.Tensor | None] = [None] * n

        def keep(j, x_in, x_out, delta):
            base_u[j] = delta
            return None

        with BlockHooks(model, keep):
            h0 = model.embed_prelude(tokens)
            h = init(h0)
            carried = [h]
            past: deque = deque(maxlen=cfg.history)
            for i in range(r):
                h = run_loop(i, h, h0, past)
                carried.append(h)
            model.features(model.reduce(h))
        den = torch.stack([u.float().norm(dim=-1).mean() for u in base_u])
        num = torch.full((n, n), float("nan"), dtype=torch.float32, device=den.device)

        def base_past(i: int) -> list[torch.Tensor]:  # the window entering loop i (0-based): h_{i-1}, ..., h_1
            m = min(cfg.history, max(i - 1, 0))
            return [carried[i - j] for j in range(1, m + 1)]

        # ---- the skip variants, stacked along the batch ------------------------------------------
        sources = list(range(n - 1))  # skipping the last occurrence changes nothing later
        for c0 in range(0, len(sources), chunk):
            group = sources[c0:c0 + chunk]
            active: list[int] = []
            state = {}

            def act(j, x_in, x_out, delta):
                m = len(active)
                d = delta.reshape(m, B, *delta.shape[1:])
                diff = (d - base_u[j]).float().norm(dim=-1).mean(dim=tuple(range(1, d.dim() - 1)))
                srcs = torch.as_tensor(active, device=num.device)
                later = srcs < j
                num[srcs[later], j] = diff[later]
                if j in active:
                    mask = torch.zeros(m * B, dtype=torch.bool, device=delta.device)
                    k = active.index(j)
                    mask[k * B:(k + 1) * B] = True
                    return mask
                return None

            with BlockHooks(model, act) as hooks:
                for S in range(stage_of(group[0]), r + 2):
                    joining = [v for v in group if stage_of(v) == S]
                    m = len(joining)
                    if S == 0:
                        active += joining
                        hooks.j = 0
                        state["h0"] = model.embed_prelude(_repeat(tokens, m))
                        state["h"] = init(state["h0"])
                        state["past"] = deque(maxlen=cfg.history)
                        continue
                    if m:
                        h_b, past_b = carried[S - 1], (base_past(S - 1) if S <= r else [])
                        if not active:
                            state["h0"], state["h"] = _repeat(h0, m), _repeat(h_b, m)
                            state["past"] = deque((_repeat(x, m) for x in past_b), maxlen=cfg.history)
                        else:
                            state["h0"] = torch.cat([state["h0"], _repeat(h0, m)])
                            state["h"] = torch.cat([state["h"], _repeat(h_b, m)])
                            state["past"] = deque((torch.cat([a, _repeat(b, m)]) for a, b in
                                                   zip(state["past"], past_b)), maxlen=cfg.history)
                        active += joining
                    if not active:
                        continue
                    hooks.j = stage_start(S)
                    if S <= r:
                        state["h"] = run_loop(S - 1, state["h"], state["h0"], state["past"])
                    else:
                        model.features(model.reduce(state["h"]))
        C = (num / den.clamp_min(1e-12).unsqueeze(0)).cpu().double().numpy()

    stage = np.array([o[1] for o in occ])
    oloop = np.array([o[2] for o in occ])
    core = stage == "core"
    lags = np.arange(r)
    by_lag = []
    for lag in lags:
        sel = core[:, None] & core[None, :] & ((oloop[None, :] - oloop[:, None]) == lag)
        vals = C[sel]
        vals = vals[~np.isnan(vals)]
        by_lag.append(vals.mean() if vals.size else np.nan)

    def block_mean(rows, cols):
        vals = C[np.ix_(rows, cols)]
        vals = vals[~np.isnan(vals)]
        return float(vals.mean()) if vals.size else float("nan")

    core_idx = np.flatnonzero(core)
    coda_idx = np.flatnonzero(stage == "coda")
    last_idx = np.flatnonzero(core & (oloop == r))
    ratio = block_mean(core_idx, coda_idx) / block_mean(core_idx, last_idx) if coda_idx.size else float("nan")
    names = [o[0] for o in occ]
    layer = np.array([o[3] for o in occ])
    coords = {"source": names, "target": names,
              "source_stage": ("source", stage), "source_loop": ("source", oloop), "source_layer": ("source", layer),
              "target_stage": ("target", stage), "target_loop": ("target", oloop), "target_layer": ("target", layer),
              "lag": lags}
    return xr.Dataset(
        {"interaction": (("source", "target"), C, {"long_name": "C(source -> target)"}),
         "interaction_by_lag": ("lag", np.array(by_lag), {"long_name": "mean C over core pairs at this loop lag"}),
         "update_norm": ("target", den.cpu().double().numpy(), {"long_name": "mean_tokens |u_j|"}),
         "terminal_to_core": ((), ratio, {"long_name": "mean C(core -> coda) / mean C(core -> last core loop)"})},
        coords=coords,
        attrs=attrs(model, "interaction", loops=r, horizon=T, terminal_to_core=ratio, chunk=chunk))
