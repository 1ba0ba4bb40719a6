"""The loop view of one prompt: what the model predicts and where its state goes at every loop, from one trace.

`loop_view(model, tokens, loops)` runs ONE `model.trace(tokens, loops)` and returns a Dataset over
loops 1..r and the prompt's positions: the top-k next tokens and their probabilities, the logit-lens
loss (where the next token is known), KL to the previous loop, the angular distance and relative
update between consecutive states, and the states 0..r projected on their top principal components
(fitted on every loop and position at once). The loop explorer slices it on every slider move, the
tour plots it; both run the model only here.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from ..models.looped import LoopLM
from ._common import (angular_distance, attrs, check_horizon, check_int, check_model, check_targets, check_tokens,
                      kl, masked_mean, relative_update, token_stats, training_loops, vocab_size)

# floats of logits reduced at once (1 MB in fp32): cache-sized chunks (one loop of 256 tokens x 4096 ids)
# made the view twice as fast as 128 MB ones on CPU, and keep memory flat at any vocabulary
_LOGIT_BUDGET = 2 ** 18


def _prompt(value, name: str) -> torch.Tensor:
    """Return value ([seq] ids as a list, array or tensor, or a [1, seq] tensor) as a [1, seq] tensor."""
    if not isinstance(value, torch.Tensor):
        arr = np.asarray(value)
        if arr.dtype == object or arr.dtype.kind not in "iu":
            raise ValueError(f"{name} must be integer token ids ([seq] or [1, seq]), got {arr.dtype} values")
        value = torch.as_tensor(arr.astype(np.int64))
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() != 2 or value.shape[0] != 1:
        raise ValueError(f"{name} must be one prompt, of shape [seq] or [1, seq], got shape {tuple(value.shape)}")
    return value


def pca_path(states: torch.Tensor, dims: int) -> tuple[torch.Tensor, np.ndarray]:
    """Return (coordinates [S, T, dims], explained variance shares [dims]) of states [S, T, d] on their top PCs.

    One PCA over all S x T points (centred on their mean). A component's sign is fixed so that its
    largest-magnitude loading is positive: the same states always draw the same picture. With fewer
    points or features than dims, the missing components are zero.
    """
    X = states.reshape(-1, states.shape[-1]).double()
    Xc = X - X.mean(0)
    # eigenvectors of the d x d scatter matrix: the same axes as an SVD of the (S T) x d data, ~10x faster;
    # on one thread, because a matrix this small gains nothing from more and LAPACK's threads spin for
    # up to a second on a loaded machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        var, vecs = torch.linalg.eigh((Xc.T @ Xc).cpu())
    finally:
        torch.set_num_threads(threads)
    var, vecs = var.to(Xc.device), vecs.to(Xc.device)
    var, vecs = var.flip(0).clamp_min(0), vecs.flip(1)  # eigh sorts ascending
    k = min(dims, Xc.shape[0], Xc.shape[1])
    V = vecs[:, :k].T
    signs = torch.sign(V.gather(1, V.abs().argmax(1, keepdim=True)))
    V = V * torch.where(signs == 0, 1.0, signs)
    P = Xc @ V.T
    share = (var[:k] / var.sum().clamp_min(1e-300)).cpu().numpy()
    if k < dims:
        P = torch.cat([P, P.new_zeros(P.shape[0], dims - k)], 1)
        share = np.concatenate([share, np.zeros(dims - k)])
    return P.reshape(*states.shape[:2], dims), share


def loop_view(model, tokens, loops: int | None = None, *, targets=None, top_k: int = 10, dims: int = 3,
              horizon: int | None = None) -> xr.Dataset:
    """Return the Dataset of one prompt seen at every loop 1..loops, from ONE `model.trace` (or `Loopable.run`).

    `tokens` is one prompt: [seq] ids (list, array or tensor) or a [1, seq] tensor. `targets`
    (same shape; -100 = none) are the tokens each position should predict, by default the prompt's
    next tokens (the last position has none). `loops` defaults to the training K; a horizon-dependent
    model (timestep conditioning) is traced with T = `horizon` (default `loops`), so every loop is a
    loop of one T-loop run. Dims `loop` (1..r), `token` (position 0..seq-1), `rank` (1..top_k),
    `state` (0..r, 0 = h0) and `component` (1..dims); coords `token_id` and `target_id` on `token`.
    `model` is a LoopLM or a Loopable (its measured states are the `reduce`d carried states, each
    loop read out from its carried state; it has no horizon).

    Per loop and position (`token_*`) and their means over positions (nats where a loss):
    - `loss`: logit-lens next-token cross-entropy of the state after loop t read out by coda + head,
      NaN per position without a target, mean over those with one;
    - `kl_prev`: KL(p_t || p_{t-1}); loop 1 compares with h0 read out the same way;
    - `angular_distance` a(x(t-1), x(t)) and `relative_update` |x(t) - x(t-1)| / max(|x(t-1)|, eps);
    - `top_id`, `top_p` [loop, token, rank]: the top-k next tokens, most probable first;
    - `target_p`, `target_rank` [loop, token]: the target's probability and rank (1 = top; NaN / 0 without one);
    - `pca` [state, token, component]: states 0..r on the top principal components of all of them,
      `explained_variance` [component]: the share of variance each explains.
    """
    check_model(model)
    looplm = isinstance(model, LoopLM)
    ids = check_tokens(_prompt(tokens, "tokens"), model)
    R = check_int("loops", training_loops(model) if loops is None else loops, 1)
    T_h = check_horizon(model, R, horizon) if looplm else R
    top_k = check_int("top_k", top_k, 1)
    dims = check_int("dims", dims, 2, 3)
    if targets is None:
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]
    else:
        targets = check_targets(_prompt(targets, "targets"), ids, model)
    T = ids.shape[1]
    mask = targets != -100
    with torch.inference_mode():
        states, read = _states_and_readout(model, ids, R, T_h)
        V = vocab_size(model) or int(read(0, 1).shape[-1])
        k = min(top_k, V)
        cat = _per_loop_readout(read, targets, R, T, V, k)
        data = _view_variables(states, cat, mask, R, dims)
    coords = {"loop": np.arange(1, R + 1), "token": np.arange(T), "rank": np.arange(1, k + 1),
              "state": np.arange(R + 1), "component": np.arange(1, dims + 1),
              "token_id": ("token", _numpy(ids[0])), "target_id": ("token", _numpy(targets[0]))}
    return xr.Dataset(data, coords=coords,
                      attrs=attrs(model, "loop_view", loops=R, horizon=T_h, training_loops=training_loops(model),
                                  top_k=k, tokens_counted=int(mask.sum()),
                                  kl_direction="KL(loop t || loop t-1); loop 1 against h0 read out"))


def _numpy(x: torch.Tensor) -> np.ndarray:
    """Return a tensor as a NumPy array on the CPU."""
    return x.cpu().numpy()


def _states_and_readout(model, ids: torch.Tensor, R: int, T_h: int):
    """Return (states 0..R as [R+1, T, d], read(lo, hi): the logits of states lo..hi-1 read out)."""
    if isinstance(model, LoopLM):
        states = model.trace(ids, loops=R, horizon=T_h).states[:, 0]  # [R+1, T, d]: the prompt is one row

        def read(lo: int, hi: int) -> torch.Tensor:
            # loops ride in the batch dim: the coda attends within a row, so rows stay independent
            return model.readout(states[lo:hi])
        return states, read
    _, carried = model.run(ids, R)
    states = torch.stack([model.state(h)[0] for h in carried])

    def read_each(lo: int, hi: int) -> torch.Tensor:
        # a carried state need not stack along the batch, so each loop is read out alone
        return torch.cat([model.readout(carried[t]) for t in range(lo, hi)])
    return states, read_each


def _per_loop_readout(read, targets: torch.Tensor, R: int, T: int, V: int, k: int) -> dict[str, torch.Tensor]:
    """Return per loop 1..R and position: loss, KL to the previous loop, top-k, the target's probability and rank.

    States are read out in chunks of loops (a [chunk, T, V] log-probability tensor at a time, within
    _LOGIT_BUDGET); state 0 (h0) is read only as loop 1's previous distribution.
    """
    chunk = max(1, _LOGIT_BUDGET // max(1, T * V))  # loops per readout
    tgt_all = targets.clamp_min(0)
    lp_prev = None
    rows = {n: [] for n in ("loss", "kl", "top_p", "top_i", "tp", "rank")}
    for lo in range(0, R + 1, chunk):
        hi = min(R + 1, lo + chunk)
        lp, _, _ = token_stats(read(lo, hi))  # without targets: no argmax we'd not use
        lt_all = lp.gather(-1, tgt_all.expand(hi - lo, T).unsqueeze(-1))  # log p of the target, [n, T, 1]
        prev = lp[:-1] if lp_prev is None else torch.cat([lp_prev, lp[:-1]])
        cur = lp if lp_prev is not None else lp[1:]  # state 0 has no previous loop
        rows["kl"].append(kl(cur, prev))
        first = 1 if lo == 0 else 0  # loop 0 (h0) only serves as loop 1's previous
        rows["loss"].append(-lt_all[first:].squeeze(-1))
        p, i = lp[first:].topk(k, dim=-1)
        rows["top_p"].append(p.exp())
        rows["top_i"].append(i)
        lt = lt_all[first:]
        rows["tp"].append(lt.squeeze(-1).exp())
        rows["rank"].append((lp[first:] > lt).sum(-1) + 1)
        lp_prev = lp[-1:]
    return {n: torch.cat(v) for n, v in rows.items()}


def _view_variables(states: torch.Tensor, cat: dict, mask: torch.Tensor, R: int, dims: int) -> dict:
    """Return loop_view's data variables: per-loop means and per-position values, top-k, target, PCA path."""
    out = _numpy
    T = states.shape[1]
    tok_angle = angular_distance(states[:-1], states[1:])  # [R, T]
    tok_update = relative_update(states[:-1], states[1:])
    m = mask.expand(R, T)
    proj, explained = pca_path(states, dims)
    tok_loss = cat["loss"].masked_fill(~m, float("nan"))
    loss = np.array([masked_mean(cat["loss"][t], mask[0]) for t in range(R)])
    return {
        "loss": ("loop", loss, {"long_name": "logit-lens next-token loss, mean over positions with a target",
                                "units": "nats"}),
        "token_loss": (("loop", "token"), out(tok_loss), {"long_name": "logit-lens next-token loss",
                                                          "units": "nats"}),
        "kl_prev": ("loop", out(cat["kl"].double().mean(-1)), {"long_name": "KL(p_t || p_t-1)", "units": "nats"}),
        "token_kl_prev": (("loop", "token"), out(cat["kl"]), {"long_name": "KL(p_t || p_t-1)", "units": "nats"}),
        "angular_distance": ("loop", out(tok_angle.double().mean(-1)),
                             {"long_name": "angular distance a(x(t-1), x(t))", "units": "pi rad"}),
        "token_angular_distance": (("loop", "token"), out(tok_angle),
                                   {"long_name": "angular distance a(x(t-1), x(t))", "units": "pi rad"}),
        "relative_update": ("loop", out(tok_update.double().mean(-1)),
                            {"long_name": "|x(t) - x(t-1)| / |x(t-1)|"}),
        "token_relative_update": (("loop", "token"), out(tok_update), {"long_name": "|x(t) - x(t-1)| / |x(t-1)|"}),
        "top_id": (("loop", "token", "rank"), out(cat["top_i"]), {"long_name": "top-k next-token ids"}),
        "top_p": (("loop", "token", "rank"), out(cat["top_p"].float()), {"long_name": "top-k probabilities"}),
        "target_p": (("loop", "token"), out(cat["tp"].masked_fill(~m, float("nan"))),
                     {"long_name": "probability of the target token"}),
        "target_rank": (("loop", "token"), out(cat["rank"].masked_fill(~m, 0)),
                        {"long_name": "rank of the target token (1 = top, 0 = no target)"}),
        "pca": (("state", "token", "component"), out(proj.float()),
                {"long_name": "state after loop t on the top principal components of states 0..r"}),
        "explained_variance": ("component", explained, {"long_name": "share of variance per component"}),
    }
