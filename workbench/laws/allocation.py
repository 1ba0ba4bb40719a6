"""Compute-optimal allocation: how to spend a FLOP budget under a fitted law.

``chinchilla_optimal`` uses the closed form for ``C = 6 N D`` (Hoffmann et al. eq. 4):
``N_opt = G (C/6)^(beta/(alpha+beta))``, ``D_opt = (C/6)^(alpha/(alpha+beta)) / G``,
``G = (alpha A / (beta B))^(1/(alpha+beta))``. ``optimal_allocation`` takes a fitted phi or truncation law
and a model shape (N_once, N_rec): for each loop count r on a grid it spends the budget as
``D = C / (6 N_once + 2 N_rec r + 4 N_rec k)`` tokens (SPEC section 2; k = r unless given; attention and
head FLOPs left out) and returns the r (and D) with the lowest predicted loss. The default grid is
r = 1..32; loop counts or token budgets outside the fitted runs are extrapolations of the law.
``optimal_setting`` searches (size, r, k) together: every k in 1..r (truncation law) and, with the size
free, the shape scaled continuously to its closed-form optimum per (r, k) (optionally bounded); it reports
the best setting, the best full-BPTT (k = r) one, and whether full BPTT wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import xarray as xr

from ..config import check_bool, check_float, check_int
from ..models.flops import flops_per_token  # the one formula (SPEC §2), shared with LoopLM
from .fit import LawFit
from .objective import _Law
from .table import _Data


def _positive(v: Any, name: str, where: str) -> np.ndarray:
    """Return `v` as a float64 array, or raise ValueError naming it unless every entry is finite and > 0."""
    a = np.asarray(v, dtype=np.float64)
    if not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"{where}: {name}={v!r} is invalid: must be finite and > 0")
    return a


def _require_loop_law(fit: Any, where: str) -> None:
    """Return None when `fit` is a phi or truncation LawFit (the laws that price loops), else raise ValueError."""
    if not isinstance(fit, LawFit) or fit.law not in ("phi", "truncation"):
        raise ValueError(f"{where}: fit must be a LawFit from fit_phi or fit_truncation, got "
                         f"{getattr(fit, 'law', type(fit).__name__)!r}; use chinchilla_optimal for a Chinchilla fit")


def chinchilla_optimal(fit: LawFit, flops: Any) -> dict[str, Any]:
    """Return {"n", "tokens", "loss"}: the compute-optimal N and D for C = 6 N D under a Chinchilla fit.

    Closed form (Hoffmann et al. eq. 4): N_opt = G (C/6)^(beta/(alpha+beta)), D_opt = (C/6)^(alpha/(alpha+beta)) / G,
    G = (alpha A / (beta B))^(1/(alpha+beta)). `flops` may be a number or an array (outputs follow its shape).
    """
    where = "chinchilla_optimal"
    if not isinstance(fit, LawFit) or fit.law != "chinchilla":
        raise ValueError(f"{where}: fit must be a LawFit from fit_chinchilla, got "
                         f"{getattr(fit, 'law', type(fit).__name__)!r}")
    c = _positive(flops, "flops", where)
    p = fit.params
    al, be = p["alpha"], p["beta"]
    if al <= 0 or be <= 0:
        raise ValueError(f"{where}: the fit has alpha={al:.4g}, beta={be:.4g}; a compute-optimal split needs both > 0")
    g = (al * p["A"] / (be * p["B"])) ** (1.0 / (al + be))
    n_opt = g * (c / 6.0) ** (be / (al + be))
    d_opt = (c / 6.0) ** (al / (al + be)) / g
    loss = p["E"] + p["A"] * n_opt ** -al + p["B"] * d_opt ** -be
    if np.ndim(c) == 0:
        return {"n": float(n_opt), "tokens": float(d_opt), "loss": float(loss)}
    return {"n": n_opt, "tokens": d_opt, "loss": loss}


@dataclass
class Allocation:
    """A compute-optimal loop count and token budget, with the predicted loss over the whole loop grid."""

    loops: Any
    backward_loops: Any
    tokens: Any
    loss: Any
    flops_per_token: Any
    grid: xr.Dataset


def optimal_allocation(fit: LawFit, flops: Any, n_once: float, n_rec: float,
                       loops_grid: Sequence[float] = tuple(range(1, 33)),
                       backward_loops: int | Callable[[int], int] | None = None) -> Allocation:
    """Return the Allocation (loops r, tokens D, loss) minimising predicted loss at FLOP budget C for a model shape.

    For each r in `loops_grid`: k = r (or `backward_loops`: an int, capped at r, or a function r -> k),
    D = C / (6 N_once + 2 N_rec r + 4 N_rec k), and the fit's predicted loss at (N_once, N_rec, r, k, D).
    `fit` is a phi or truncation LawFit (for a phi fit, k only changes the FLOPs). `flops` may be a number
    or a 1-D array; `.grid` holds loss, tokens and flops_per_token over (flops, loops).
    """
    where = "optimal_allocation"
    _require_loop_law(fit, where)
    c = _positive(flops, "flops", where)
    scalar = np.ndim(c) == 0
    c = np.atleast_1d(c).reshape(-1)
    n_once = check_float(f"{where}: n_once", n_once, 0)
    _positive(n_rec, "n_rec", where)
    r = np.asarray(list(loops_grid), dtype=np.float64)
    if r.size == 0 or r.ndim != 1 or not np.all(np.isfinite(r)) or np.any(r < 1):
        raise ValueError(f"{where}: loops_grid={list(loops_grid)!r} is invalid: must be a non-empty list of "
                         "loop counts >= 1")
    if backward_loops is None:
        k = r.copy()
    elif callable(backward_loops):
        k = np.array([float(backward_loops(int(v) if float(v).is_integer() else v)) for v in r])
    else:
        k = np.minimum(check_float(f"{where}: backward_loops", backward_loops, 1,
                                   allowed="must be None, a number >= 1, or a function of the loop count"), r)
    if np.any(k < 1) or np.any(k > r):
        i = int(np.flatnonzero((k < 1) | (k > r))[0])
        raise ValueError(f"{where}: backward_loops gives k={k[i]!r} at loops={r[i]!r}; must be in 1..loops")
    fpt = flops_per_token(n_once, n_rec, r, k)                  # (R,)
    tokens = c[:, None] / fpt[None, :]                            # (C, R)
    table = {
        "n_once": np.full(tokens.size, float(n_once)), "n_rec": np.full(tokens.size, float(n_rec)),
        "loops": np.broadcast_to(r, tokens.shape).reshape(-1),
        "backward_loops": np.broadcast_to(k, tokens.shape).reshape(-1), "tokens": tokens.reshape(-1),
    }
    loss = fit.predict(table).reshape(tokens.shape)
    best = np.argmin(loss, axis=1)
    rows = np.arange(c.size)
    grid = xr.Dataset({"loss": (("flops", "loops"), loss), "tokens": (("flops", "loops"), tokens),
                       "flops_per_token": ("loops", fpt), "backward_loops": ("loops", k)},
                      coords={"flops": c, "loops": r})
    out = dict(loops=r[best], backward_loops=k[best], tokens=tokens[rows, best], loss=loss[rows, best],
               flops_per_token=fpt[best])
    if scalar:
        out = {key: float(v[0]) for key, v in out.items()}
    return Allocation(grid=grid, **out)


@dataclass
class LoopSetting:
    """A compute-optimal looped setting (size, loops r, backward loops k, tokens D) per FLOP budget, the best
    full-BPTT (k = r) setting beside it, and the predicted loss over every (r, k) searched."""

    n_once: Any
    n_rec: Any
    loops: Any
    backward_loops: Any
    tokens: Any
    loss: Any
    flops_per_token: Any
    full_bptt: dict[str, Any]    # the best setting with k = r: n_once, n_rec, loops, backward_loops, tokens, loss, ...
    full_bptt_wins: Any          # True where that setting's loss is no worse than the best searched setting's
    free_size: bool
    grid: xr.Dataset

    def to_dataset(self) -> xr.Dataset:
        """Return the optima over `flops` as an xarray.Dataset: best setting, best full-BPTT setting, which wins."""
        keys = ("n_once", "n_rec", "loops", "backward_loops", "tokens", "loss", "flops_per_token")
        flops = self.grid["flops"].values
        data = {k: ("flops", np.atleast_1d(getattr(self, k)).astype(np.float64)) for k in keys}
        data["n"] = ("flops", data["n_once"][1] + data["n_rec"][1])
        for k in keys:
            data[f"full_{k}"] = ("flops", np.atleast_1d(self.full_bptt[k]).astype(np.float64))
        data["full_n"] = ("flops", data["full_n_once"][1] + data["full_n_rec"][1])
        data["full_bptt_wins"] = ("flops", np.atleast_1d(self.full_bptt_wins).astype(bool))
        return xr.Dataset(data, coords={"flops": flops},
                          attrs={"free_size": int(self.free_size), "search": self.grid.attrs.get("search", "")})


def _integer_grid(values: Any, name: str, where: str) -> np.ndarray:
    """Return the sorted distinct integer loop counts >= 1 of `values` (float64), or raise ValueError naming `name`."""
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{where}: {name}={values!r} is invalid: must be a non-empty list of integer loop counts >= 1")
    try:
        a = np.asarray(list(values), dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name}={values!r} is invalid: must be a non-empty list of integer loop "
                         "counts >= 1") from None
    if a.size == 0 or a.ndim != 1 or not np.all(np.isfinite(a)) or np.any(a < 1) or np.any(a != np.round(a)):
        raise ValueError(f"{where}: {name}={list(values)!r} is invalid: must be a non-empty list of integer loop "
                         "counts >= 1")
    return np.unique(a)


def _loop_pairs(fit: LawFit, r: np.ndarray, backward_loops: Any, where: str) -> tuple[np.ndarray, str]:
    """Return the (r, k) pairs to search, shape (P, 2), and a one-line description of the search."""
    if backward_loops is None:
        if fit.law == "phi":   # the phi law has no k: searching k would price a forward-only loop as a trained one
            return np.stack([r, r], axis=1), "k = r (phi law)"
        return np.array([(rv, kv) for rv in r for kv in range(1, int(rv) + 1)], dtype=np.float64), "every k in 1..r"
    if callable(backward_loops):
        k = np.array([float(backward_loops(int(rv))) for rv in r])
        bad = ~np.isfinite(k) | (k < 1) | (k > r) | (k != np.round(k))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{where}: backward_loops gives k={k[i]:g} at loops={int(r[i])}; must be an integer in "
                             "1..loops")
        return np.stack([r, k], axis=1), "k = backward_loops(r)"
    if isinstance(backward_loops, (int, np.integer)) and not isinstance(backward_loops, bool):
        kv = check_int(f"{where}: backward_loops", backward_loops, 1,
                       allowed="must be None, an integer >= 1, a list of them, or a function of the loop count")
        return np.stack([r, np.minimum(float(kv), r)], axis=1), f"k = min({kv}, r)"
    if isinstance(backward_loops, (str, bytes, float, bool)):
        raise ValueError(f"{where}: backward_loops={backward_loops!r} is invalid: must be None, an integer >= 1, a "
                         "list of them, or a function of the loop count")
    ks = _integer_grid(backward_loops, "backward_loops", where)
    if ks[-1] > r[-1]:
        raise ValueError(f"{where}: backward_loops has k={int(ks[-1])} but the largest loop count in loops_grid is "
                         f"{int(r[-1])}; k must be <= loops (only loops that ran get gradient)")
    return np.array([(rv, kv) for rv in r for kv in ks if kv <= rv], dtype=np.float64), "k in backward_loops, k <= r"


def _effective_size(fit: LawFit, n_once: float, n_rec: float, r: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Return N_eff(r, k) of the fit's law for one shape (the law's own size term, via _Law.log_size)."""
    m = r.size
    data = _Data(law=fit.law, runs=np.arange(m), tokens=np.ones(m), loss=None, n_once=np.full(m, n_once),
                 n_rec=np.full(m, n_rec), loops=r, backward_loops=k if fit.law == "truncation" else None)
    lw = _Law(data, fit.fixed.get("phi"))
    th = np.array([[fit.params[nm] for nm in lw.names]])
    return np.exp(lw.log_size(th)[0][0] + lw.c_n)


def optimal_setting(fit: LawFit, flops: Any, n_once: float, n_rec: float, *, free_size: bool = True,
                    loops_grid: Sequence[int] = tuple(range(1, 33)),
                    backward_loops: int | Sequence[int] | Callable[[int], int] | None = None,
                    size_range: tuple[float, float] | None = None) -> LoopSetting:
    """Return the LoopSetting (size, loops r, backward loops k, tokens D, loss) minimising predicted loss at budget C.

    Size: with `free_size` the model is the shape (`n_once`, `n_rec`) scaled by a continuous factor s
    (every layer widened alike, so N_once : N_rec stays fixed, as when one sets a width), and s is
    optimised exactly: FLOPs per token are linear in N (`flops_per_token`, attention and head left out,
    as in `optimal_allocation`), so D = C / (s F(r, k)) and for each (r, k) the law is Chinchilla's in
    s, with the closed-form optimum s* = (alpha A N_eff^-alpha (C / F)^beta / (beta B))^(1/(alpha+beta)),
    F and N_eff taken at s = 1. The loss is convex in log s, so `size_range` = (N_min, N_max), bounds on
    N_once + N_rec (e.g. the sizes the fit saw), clips s* to the constrained optimum. Unbounded, the
    loss at s* falls as N_eff / F rises, so the best (r, k) maximises N_eff(r, k) / F(r, k) and is the
    same at every budget (with k = r and phi < 1 that is r = 1: a loop costs r but is worth r^phi).
    A continuous size, not a list of widths, so the answer does not depend on which widths were
    listed; with `free_size=False` the size is fixed at (`n_once`, `n_rec`): the best (r, k) there.
    Loops: every integer r in `loops_grid`; k is searched over every integer in 1..r when
    `backward_loops` is None (for a phi fit, k = r: that law cannot value truncation), or is an integer
    (min(k, r)), a list of k (pairs with k > r skipped) or a function r -> k in 1..r. The best setting
    is the lowest predicted loss over (r, k) (ties: smallest r, then k); `full_bptt` is the best with
    k = r over the same r, and `full_bptt_wins` says whether it is at least as good. `flops` may be a
    number or a 1-D array; `.grid` holds loss, tokens and the size n = N_once + N_rec over (flops,
    loops, backward_loops), NaN off the evaluated pairs (the searched ones, marked `searched`, and
    k = r). Sizes, loops and budgets outside the fitted runs are extrapolations of the law.
    """
    where = "optimal_setting"
    _require_loop_law(fit, where)
    c = _positive(flops, "flops", where)
    if c.size == 0 or c.ndim > 1:
        raise ValueError(f"{where}: flops={flops!r} is invalid: must be a number or a non-empty 1-D array of them")
    scalar = c.ndim == 0
    c = np.atleast_1d(c)
    n_once = check_float(f"{where}: n_once", n_once, 0)
    n_rec = check_float(f"{where}: n_rec", n_rec, 0, lo_open=True)
    free_size = check_bool(f"{where}: free_size", free_size)
    r = _integer_grid(loops_grid, "loops_grid", where)
    searched, search = _loop_pairs(fit, r, backward_loops, where)
    log_s_range = _log_scale_range(size_range, free_size, n_once + n_rec, where)
    al, be = fit.params["alpha"], fit.params["beta"]
    if free_size and (al <= 0 or be <= 0):
        raise ValueError(f"{where}: the fit has alpha={al:.4g}, beta={be:.4g}; a compute-optimal size needs both > 0 "
                         "(use free_size=False)")
    # every searched pair plus the full-BPTT pairs (r, r), evaluated once
    pairs = np.unique(np.concatenate([searched, np.stack([r, r], axis=1)]), axis=0)   # sorted by r, then k
    ev = _evaluate_pairs(fit, c, n_once, n_rec, pairs, free_size, log_s_range)
    is_searched = (pairs[:, None, :] == searched[None, :, :]).all(axis=2).any(axis=1)
    best, best_loss = ev.pick(is_searched)
    full_best, full_loss = ev.pick(ev.r == ev.k)
    wins = full_loss <= best_loss + 1e-12 * np.abs(best_loss)
    grid = _setting_grid(ev, r, is_searched, n_once + n_rec, search, free_size)
    if scalar:
        best = {key: float(v[0]) for key, v in best.items()}
        full_best = {key: float(v[0]) for key, v in full_best.items()}
        wins = bool(wins[0])
    return LoopSetting(full_bptt=full_best, full_bptt_wins=wins, free_size=free_size, grid=grid, **best)


def _log_scale_range(size_range: Any, free_size: bool, n0: float, where: str) -> tuple[float, float]:
    """Return the bounds on log s (the size scale) that `size_range` = (N_min, N_max) sets; (-inf, inf) when None."""
    if size_range is None:
        return -np.inf, np.inf
    if not free_size:
        raise ValueError(f"{where}: size_range={size_range!r} is invalid with free_size=False: the size is fixed")
    try:
        lo, hi = (float(v) for v in size_range)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: size_range={size_range!r} is invalid: must be (N_min, N_max)") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
        raise ValueError(f"{where}: size_range={size_range!r} is invalid: must be (N_min, N_max) with "
                         "0 < N_min <= N_max, finite (bounds on N_once + N_rec)")
    return math.log(lo / n0), math.log(hi / n0)


@dataclass
class _PairLosses:
    """Predicted loss of every (r, k) pair at every budget, with the size scale and tokens that give it."""

    flops: np.ndarray     # (C,) budgets
    r: np.ndarray         # (P,) loop counts
    k: np.ndarray         # (P,) backward loops
    n_once: float         # the shape at s = 1
    n_rec: float
    fpt1: np.ndarray      # (P,) FLOPs per token at s = 1
    scale: np.ndarray     # (C, P) size scale s
    tokens: np.ndarray    # (C, P)
    loss: np.ndarray      # (C, P)

    def pick(self, mask: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Return (the best setting per budget among the pairs in `mask`, its loss); ties: smallest r, then k."""
        masked = np.where(mask[None, :], self.loss, np.inf)
        j = np.argmin(masked, axis=1)                                    # first minimum: smallest r, then k
        rows = np.arange(self.flops.size)
        s = self.scale[rows, j]
        return dict(n_once=s * self.n_once, n_rec=s * self.n_rec, loops=self.r[j], backward_loops=self.k[j],
                    tokens=self.tokens[rows, j], loss=self.loss[rows, j],
                    flops_per_token=s * self.fpt1[j]), self.loss[rows, j]


def _evaluate_pairs(fit: LawFit, c: np.ndarray, n_once: float, n_rec: float, pairs: np.ndarray, free_size: bool,
                    log_s_range: tuple[float, float]) -> _PairLosses:
    """Return the predicted loss at each budget in `c` and (r, k) in `pairs`, the size at its optimum when free.

    With the size free, s* is the closed form of `optimal_setting`'s docstring, clipped to `log_s_range`.
    """
    p = fit.params
    al, be = p["alpha"], p["beta"]
    pr, pk = pairs[:, 0], pairs[:, 1]
    fpt1 = flops_per_token(n_once, n_rec, pr, pk)                       # (P,) at s = 1
    if free_size:
        log_m = np.log(_effective_size(fit, n_once, n_rec, pr, pk))
        log_s = (math.log(al / be) + p["a"] - p["b"] - al * log_m[None, :]
                 + be * (np.log(c)[:, None] - np.log(fpt1)[None, :])) / (al + be)
        scale = np.exp(np.clip(log_s, *log_s_range))                    # (C, P)
    else:
        scale = np.ones((c.size, pr.size))
    tokens = c[:, None] / (scale * fpt1[None, :])
    shape = tokens.shape
    loss = fit.predict({"n_once": (scale * n_once).reshape(-1), "n_rec": (scale * n_rec).reshape(-1),
                        "loops": np.broadcast_to(pr, shape).reshape(-1),
                        "backward_loops": np.broadcast_to(pk, shape).reshape(-1),
                        "tokens": tokens.reshape(-1)}).reshape(shape)
    return _PairLosses(flops=c, r=pr, k=pk, n_once=n_once, n_rec=n_rec, fpt1=fpt1, scale=scale, tokens=tokens,
                       loss=loss)


def _setting_grid(ev: _PairLosses, r: np.ndarray, is_searched: np.ndarray, n0: float, search: str,
                  free_size: bool) -> xr.Dataset:
    """Return loss, tokens and size n over (flops, loops, backward_loops), NaN off the evaluated pairs."""
    c = ev.flops.size
    ks = np.unique(ev.k)
    ir, ik = np.searchsorted(r, ev.r), np.searchsorted(ks, ev.k)
    cube = {name: np.full((c, r.size, ks.size), np.nan) for name in ("loss", "tokens", "n")}
    for name, v in (("loss", ev.loss), ("tokens", ev.tokens), ("n", ev.scale * n0)):
        cube[name][:, ir, ik] = v
    on = np.zeros((r.size, ks.size), dtype=bool)
    on[ir, ik] = is_searched
    grid = xr.Dataset({name: (("flops", "loops", "backward_loops"), v) for name, v in cube.items()},
                      coords={"flops": ev.flops, "loops": r, "backward_loops": ks},
                      attrs={"search": search, "free_size": int(free_size)})
    grid["searched"] = (("loops", "backward_loops"), on)
    return grid
