"""Geometry of the hidden state across loops and across block occurrences (SPEC §3)."""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from ..models.looped import LoopLM
from ._common import (angular_distance, attrs, check_horizon, check_int, check_model, check_tokens,
                      has_places, occurrences, relative_update, trace_states, training_loops)


def _variance(h: torch.Tensor) -> float:
    return float(h.float().var(dim=-1, unbiased=False).mean())


def geometry(model, tokens: torch.Tensor, loops: int | None = None, *, horizon: int | None = None) -> xr.Dataset:
    """Return a Dataset of per-loop and per-block-occurrence angle, relative update, variance and norm.

    Over dim `loop` (1..r): `angular_distance` a(x(t-1), x(t)), `relative_update`
    |x(t) - x(t-1)| / max(|x(t-1)|, eps), `state_variance` V(x(t)) / V(x(K)) and `state_norm` |x(t)|,
    each a mean over tokens (all batch rows and positions); K is the training loop count. Over dim
    `occurrence` ("prelude.i", "core.{loop}.{layer}", "coda.i"), for a model that names them (a LoopLM,
    or a Loopable with `places`): `block_angular_distance` and `block_relative_update` between each
    block's input and output.

    One trace gives everything. It runs to max(r, K) loops so that x(K) is at hand when r < K, and
    the block occurrences beyond loop r are not reported. A horizon-dependent model (timestep
    conditioning) is traced to r with T = `horizon` (default r), and its reference V(x(K)) comes from
    a second pass at its training setting (r = T = K). Block-level metrics come from a reading hook
    at every named block occurrence of the one pass, so they are exact for every LoopLM variant; a
    hyper-connected layer's input is A_m^T H, its output Block(A_m^T H). A Loopable with `places` gets
    them from the same reading hook (for Inkling2Loop a layer's hidden input and output); any other
    `Loopable` gets the loop-level variables only.
    """
    check_model(model)
    tokens = check_tokens(tokens, model)
    K = training_loops(model)
    r = check_int("loops", K if loops is None else loops, 1)
    dependent = isinstance(model, LoopLM) and model.horizon_dependent
    T = check_horizon(model, r, horizon) if dependent else None
    R = r if dependent else max(r, K)
    block: dict[int, tuple[float, float]] = {}
    occ = occurrences(model, r) if has_places(model) else []
    index = {name: j for j, name in enumerate(o[0] for o in occ)}

    def record(name, x_in, x_out):
        j = index.get(name)  # None for core occurrences beyond loop r
        if j is not None:
            block[j] = (float(angular_distance(x_in, x_out).mean()),
                        float(relative_update(x_in, x_out).mean()))

    with torch.no_grad():
        if isinstance(model, LoopLM):
            tr = model.trace(tokens, R, horizon=T, hooks=dict.fromkeys(model.block_patterns(), record))
            states = tr.states
            tr.features(r)  # the coda's occurrences read the state after loop r
            if dependent:
                ref = states[K] if r == K and T == K else trace_states(model, tokens, K, K)[0][K]
            else:
                ref = states[K]
        elif occ:  # a Loopable that names its block occurrences: the same reading hook
            _, carried = model.run(tokens, R, hook=record)
            model.readout(carried[r], hook=record)  # the coda's occurrences read the state after loop r
            states = torch.stack([model.state(h) for h in carried])
            ref = states[K]
        else:
            states, _ = trace_states(model, tokens, R)
            ref = states[K]
        v_ref = _variance(ref)
        ts = range(1, r + 1)
        angle = [float(angular_distance(states[t - 1], states[t]).mean()) for t in ts]
        rel = [float(relative_update(states[t - 1], states[t]).mean()) for t in ts]
        var = [_variance(states[t]) / max(v_ref, 1e-12) for t in ts]
        norm = [float(states[t].float().norm(dim=-1).mean()) for t in ts]
        v0, n0 = _variance(states[0]), float(states[0].float().norm(dim=-1).mean())
    coords = {"loop": np.arange(1, r + 1)}
    data = {
        "angular_distance": ("loop", np.array(angle), {"long_name": "angular distance a(x(t-1), x(t))",
                                                       "units": "pi rad"}),
        "relative_update": ("loop", np.array(rel), {"long_name": "|x(t) - x(t-1)| / |x(t-1)|"}),
        "state_variance": ("loop", np.array(var), {"long_name": "V(x(t)) / V(x(K))"}),
        "state_norm": ("loop", np.array(norm), {"long_name": "|x(t)|, mean over tokens"}),
    }
    if occ:
        names = [o[0] for o in occ]
        coords.update(occurrence=names, stage=("occurrence", [o[1] for o in occ]),
                      occurrence_loop=("occurrence", np.array([o[2] for o in occ])),
                      layer=("occurrence", np.array([o[3] for o in occ])))
        data["block_angular_distance"] = ("occurrence", np.array([block[j][0] for j in range(len(occ))]),
                                          {"long_name": "angular distance between block input and output",
                                           "units": "pi rad"})
        data["block_relative_update"] = ("occurrence", np.array([block[j][1] for j in range(len(occ))]),
                                         {"long_name": "|block output - input| / |input|"})
    return xr.Dataset(data, coords=coords,
                      attrs=attrs(model, "geometry", loops=r, training_loops=K,
                                  horizon=T if T is not None else -1, variance_reference=v_ref,
                                  state_variance_0=v0 / max(v_ref, 1e-12), state_norm_0=n0))
