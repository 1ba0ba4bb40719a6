"""The gradient truncated BPTT throws away, for every k from one backward pass (SPEC §3)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xarray as xr
from torch import nn
# torch's pytree utilities (what torch.func flattens with): a carried state may be a tuple, NamedTuple or dict
from torch.utils._pytree import tree_leaves, tree_map

from ..models.looped import LoopLM, lm_loss
from ._common import EPS, attrs, check_horizon, check_int, check_model, check_targets, check_tokens, training_loops
from .protocol import as_loopable

PARAMS = ("core", "blocks")


class _Call(nn.Module):
    """Holds the loop's shared module so that torch.func.functional_call can swap its weights around a closure."""

    def __init__(self, shared: nn.Module):
        super().__init__()
        self.m = shared

    def forward(self, fn):
        return fn()


def _alias(x):
    """Return x (a tensor or a structure of them) with every tensor a new leaf alias that requires grad."""
    return tree_map(lambda a: a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a, x)


def _unique(xs: list) -> list:
    """Return xs without repeats (by identity), first occurrences kept in order."""
    seen, out = set(), []
    for x in xs:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def _norm(grads: list) -> float:
    """Return the norm of the concatenated gradients (None counts as zero)."""
    norms = [0.0 if g is None else float(g.double().norm()) for g in grads]
    return norms[0] if len(norms) == 1 else float(np.sqrt(sum(n * n for n in norms)))


@dataclass
class LoopGradients:
    """Per-loop gradient contributions of one backward pass through `loops` loops.

    `per_loop[name]` is [r, *shape]: row t-1 is g_t, the gradient the loop-shared weight `name` gets
    from its use in loop t (names as in `Loopable.core`; for a LoopLM "core.*", "inject.*",
    "history.*", "timestep.*", "hyper.*"). `once[group][k-1][name]` is the gradient of a weight used
    outside the loop (group "prelude", "embedding", ...) under truncation to the last k loops
    (k = r is full BPTT). `adjoint_norm[t]` is |dL/dh_t| over the whole carried state, t = 0..r.
    """

    loops: int
    loss: float
    per_loop: dict[str, torch.Tensor]
    once: dict[str, list[dict[str, torch.Tensor]]]
    adjoint_norm: np.ndarray

    def truncated(self, k: int) -> dict[str, torch.Tensor]:
        """Return G_k = sum_{t > r-k} g_t for every loop-shared weight (k = r gives the full gradient g)."""
        k = check_int("k", k, 1, self.loops, allowed=f"must be an integer in 1..loops={self.loops}")
        return {n: g[self.loops - k:].sum(0) for n, g in self.per_loop.items()}

    def full(self) -> dict[str, torch.Tensor]:
        """Return the full-BPTT gradient g = sum_t g_t of every loop-shared weight."""
        return self.truncated(self.loops)


def loop_gradients(model, tokens: torch.Tensor, targets: torch.Tensor, loops: int | None = None, *,
                   horizon: int | None = None) -> LoopGradients:
    """Return the LoopGradients of one forward and one backward pass of the mean next-token loss at r loops.

    Each loop runs with its own leaf copies of the shared weights (aliasing the same storage, swapped
    in by torch.func.functional_call), so the one backward leaves each loop's contribution g_t in its
    own copy. Detaching the state entering loop r-k+1 leaves the adjoints of the last k loops
    unchanged, so the truncated gradient is exactly G_k = sum_{t > r-k} g_t. Likewise each loop gets
    its own leaf alias of h0, so the one backward splits dL/dh0 into the part through the initial
    state and the part each loop's injection of h0 carries; the truncated gradient of the weights
    before the loop is then one vector-Jacobian product through the prelude per loop that uses h0
    (plus one for the initial state), summed over the last k loops, plus their direct use after the
    loop (a tied head). No `.grad` of the model is touched.
    """
    check_model(model)
    tokens = check_tokens(tokens, model)
    targets = check_targets(targets, tokens, model)
    r = check_int("loops", training_loops(model) if loops is None else loops, 1)
    T = check_horizon(model, r, horizon) if isinstance(model, LoopLM) else None
    lp = as_loopable(model, horizon=T)
    if lp.core is None:
        raise ValueError("lost_gradient needs Loopable.core: the module holding the weights step reuses every loop")
    shared = {n: p for n, p in lp.core.named_parameters() if p.requires_grad}
    once = {g: {n: p for n, p in m.named_parameters() if p.requires_grad} for g, m in lp.once.items()}
    call = _Call(lp.core)
    with torch.enable_grad():
        h0 = lp.prelude(tokens)
        h0_init = _alias(h0)
        h = lp.initial(h0_init)
        states, h0_loops, leaves = [h], [], []
        for t in range(r):
            h0_t = _alias(h0)
            w_t = {n: p.detach().requires_grad_() for n, p in shared.items()}
            h = torch.func.functional_call(call, {"m." + n: w for n, w in w_t.items()},
                                           (lambda h=h, h0_t=h0_t, t=t: lp.step(h, h0_t, t),))
            states.append(h)
            h0_loops.append(h0_t)
            leaves.append(w_t)
        loss = lm_loss(lp.readout(h), targets)
        names = list(shared)
        once_flat = [(g, n, p) for g, ps in once.items() for n, p in ps.items()]
        # a carried state may be a structure of tensors: its adjoint is the gradient of every tensor in it
        state_leaves = [tree_leaves(s) for s in states]
        uniq = _unique([x for ls in state_leaves for x in ls])
        h0_init_leaves = tree_leaves(h0_init)
        h0_loop_leaves = [tree_leaves(x) for x in h0_loops]
        inputs = ([w[n] for w in leaves for n in names] + uniq + h0_init_leaves
                  + [x for ls in h0_loop_leaves for x in ls] + [p for _, _, p in once_flat])
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        per_loop = {}
        flat = grads[:r * len(names)]
        for i, n in enumerate(names):
            gs = [flat[t * len(names) + i] for t in range(r)]
            per_loop[n] = torch.stack([torch.zeros_like(shared[n]) if g is None else g for g in gs])
        pos = r * len(names)
        g_states = dict(zip(map(id, uniq), grads[pos:pos + len(uniq)]))
        pos += len(uniq)
        adj = np.array([_norm([g_states[id(x)] for x in ls]) for ls in state_leaves])
        n0 = len(h0_init_leaves)
        c_init = list(grads[pos:pos + n0])
        pos += n0
        c_loops = [list(grads[pos + t * n0:pos + (t + 1) * n0]) for t in range(r)]
        direct = grads[pos + r * n0:]
        # weights used before the loop: VJPs through the prelude's graph, one per cotangent that exists
        once_params = [p for _, _, p in once_flat]
        h0_leaves = tree_leaves(h0)

        def vjp(c):
            pairs = [(x, g) for x, g in zip(h0_leaves, c) if g is not None and x.requires_grad]
            if not pairs or not once_params:
                return None
            gs = torch.autograd.grad([x for x, _ in pairs], once_params, grad_outputs=[g for _, g in pairs],
                                     retain_graph=True, allow_unused=True)
            return [torch.zeros_like(p) if g is None else g for g, p in zip(gs, once_params)]

        base = [torch.zeros_like(p) if g is None else g for g, p in zip(direct, once_params)]
        per_k, acc = [], base
        for k in range(1, r + 1):  # truncation to the last k loops adds loop r-k+1's use of h0
            add = vjp(c_loops[r - k])
            acc = [a + b for a, b in zip(acc, add)] if add is not None else acc
            if k == r:
                add = vjp(c_init)
                acc = [a + b for a, b in zip(acc, add)] if add is not None else acc
            per_k.append(acc)
    once_out = {g: [{n: per_k[k][i] for i, (gg, n, _) in enumerate(once_flat) if gg == g} for k in range(r)]
                for g in once}
    return LoopGradients(loops=r, loss=float(loss.detach()), per_loop=per_loop, once=once_out, adjoint_norm=adj)


def _metrics(diff_sq, dot, norm_sq, g_sq):
    """Return (lost, cos, projected) from |g - G|^2, <g, G>, |G|^2, |g|^2 (float64 arrays over k)."""
    lost = np.sqrt(np.maximum(diff_sq, 0.0)) / max(np.sqrt(g_sq), EPS)
    cos = dot / np.maximum(np.sqrt(norm_sq * g_sq), EPS)
    proj = 1.0 - dot / max(g_sq, EPS)
    return lost, cos, proj


def _shared_metrics(per_loop: dict[str, torch.Tensor], names: list[str], r: int):
    """Return ((lost, cos, projected) over k, |g_t| over t, |g|) for the loop-shared weights `names`.

    Works in the gradients' dtype per tensor (the sums of squares and products are accumulated in
    float64 across tensors): G_k is the cumulative sum of the last k loops' g_t, and g - G_k the
    cumulative sum of the first r - k, so lost(r) is exactly 0 and no difference cancels.
    """
    diff_sq, dot, norm_sq, loop_sq = np.zeros(r), np.zeros(r), np.zeros(r), np.zeros(r)
    for n in names:
        x = per_loop[n].reshape(r, -1)
        G = x.flip(0).cumsum(0)  # G[k-1] = sum of the last k loops' g_t; G[r-1] = g
        dot += (G @ G[-1]).double().cpu().numpy()
        norm_sq += torch.linalg.vector_norm(G, dim=1).double().cpu().numpy() ** 2
        del G
        if r > 1:  # |g - G_k|^2 = |sum of the first r-k loops' g_t|^2 for k = 1..r-1
            head = x[:r - 1].cumsum(0)
            diff_sq[:r - 1] += torch.linalg.vector_norm(head, dim=1).double().cpu().numpy()[::-1] ** 2
        loop_sq += torch.linalg.vector_norm(x, dim=1).double().cpu().numpy() ** 2
    g_sq = float(dot[-1])  # <g, G_r> with G_r = g: projected(r) is exactly 0
    return _metrics(diff_sq, dot, norm_sq, g_sq), np.sqrt(loop_sq), np.sqrt(g_sq)


def _once_metrics(per_k: list[dict[str, torch.Tensor]], r: int):
    """Return ((lost, cos, projected) over k, |g|) for a weight group used outside the loop."""
    full = per_k[-1]
    diff_sq, dot, norm_sq = np.zeros(r), np.zeros(r), np.zeros(r)
    for k in range(r):
        for n, g in full.items():
            G = per_k[k][n]
            dot[k] += float(torch.dot(g.reshape(-1), G.reshape(-1)))
            norm_sq[k] += float(torch.linalg.vector_norm(G)) ** 2
            if k < r - 1 and G is not g:
                diff_sq[k] += float(torch.linalg.vector_norm(g - G)) ** 2
    g_sq = float(dot[-1])
    return _metrics(diff_sq, dot, norm_sq, g_sq), np.sqrt(g_sq)


def lost_gradient(model, tokens: torch.Tensor, targets: torch.Tensor, loops: int | None = None, *,
                  params: str = "core", horizon: int | None = None) -> xr.Dataset:
    """Return a Dataset of lost(k), cos(g, G_k), projected loss over `k`, adjoint norms over `loop`, and rho.

    From one forward and one backward (see `loop_gradients`): over dim `k` (1..r), `lost`
    = |g - G_k| / |g|, `cos` = cos(g, G_k) and `projected` = 1 - <g, G_k> / |g|^2 for the loop-shared
    weights chosen by `params` ("core": every weight the loop reuses, i.e. N_rec: core blocks and any
    injection / history / timestep / hyper-connection weights; "blocks": the core blocks only, LoopLM
    only); the same three for each weight group used outside the loop (`lost_prelude`,
    `lost_embedding`, ...: for a LoopLM the prelude blocks and the embedding, which includes the tied
    head), whose truncated gradient is computed exactly as described in `loop_gradients`.
    `rho_k` = rho^k over `k`, the lost(k) a geometric adjoint decay predicts. Over dim `loop`
    (0..r): `adjoint_norm` a_t = |dL/dh_t| (whole carried state; for hyper-connections all n
    streams) and `loop_grad_norm` |g_t| (NaN at 0). Attr `rho` is the backward shrink fitted by least
    squares to log a_t - log a_r = (r - t) log rho over t = 0..r-1 (the line through the last
    adjoint); `loss` is the mean next-token loss.
    """
    if params not in PARAMS:
        raise ValueError(f"params={params!r} is invalid: must be one of {', '.join(PARAMS)}")
    if params == "blocks" and not isinstance(model, LoopLM):
        raise ValueError("params='blocks' needs a LoopLM; use params='core' for a Loopable")
    lg = loop_gradients(model, tokens, targets, loops, horizon=horizon)
    r = lg.loops
    names = [n for n in lg.per_loop if params == "core" or n.startswith("core.")]
    with torch.no_grad():
        (lost, cos, proj), loop_norm, g_norm = _shared_metrics(lg.per_loop, names, r)
        a = lg.adjoint_norm
        la = np.log(np.maximum(a, EPS))
        x = r - np.arange(r)  # t = 0..r-1
        y = la[:r] - la[r]
        log_rho = float((x * y).sum() / (x * x).sum()) if np.all(a > 0) else float("nan")
        rho = float(np.exp(log_rho))
        ks = np.arange(1, r + 1)
        data = {
            "lost": ("k", lost, {"long_name": "|g - G_k| / |g|"}),
            "cos": ("k", cos, {"long_name": "cos(g, G_k)"}),
            "projected": ("k", proj, {"long_name": "1 - <g, G_k> / |g|^2"}),
            "rho_k": ("k", rho ** ks.astype(float), {"long_name": "rho^k, geometric-decay prediction of lost(k)"}),
            "adjoint_norm": ("loop", a, {"long_name": "|dL/dh_t|"}),
            "loop_grad_norm": ("loop", np.concatenate([[np.nan], loop_norm]), {"long_name": "|g_t|"}),
        }
        extra = {}
        for group, per_k in lg.once.items():
            if not any(per_k[-1]):
                continue
            (gl, gc, gp), gn = _once_metrics(per_k, r)
            data[f"lost_{group}"] = ("k", gl, {"long_name": f"|g - G_k| / |g| for the {group} weights"})
            data[f"cos_{group}"] = ("k", gc, {"long_name": f"cos(g, G_k) for the {group} weights"})
            data[f"projected_{group}"] = ("k", gp, {"long_name": f"1 - <g, G_k> / |g|^2 for the {group} weights"})
            extra[f"grad_norm_{group}"] = gn
    T = horizon if horizon is not None else r
    return xr.Dataset(data, coords={"k": ks, "loop": np.arange(r + 1)},
                      attrs=attrs(model, "lost_gradient", loops=r, horizon=T, params=params, rho=rho,
                                  loss=lg.loss, grad_norm=g_norm, **extra))
