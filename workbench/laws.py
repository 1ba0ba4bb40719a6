"""Scaling-law fits for looped LMs: Chinchilla Approach 3, recurrence equivalence (phi), truncation, test time.

Formulas (SPEC section 4)
-------------------------
- Chinchilla (Hoffmann et al. 2022, Approach 3; Besiroglu et al. 2024):
  ``L = E + A / N^alpha + B / D^beta``, fitted in the log-sum-exp form
  ``log L_hat = LSE(a - alpha log N, b - beta log D, e)`` with ``E = exp(e)``, ``A = exp(a)``, ``B = exp(b)``.
- Recurrence equivalence: ``L = E + A (N_once + r^phi N_rec)^(-alpha) + B D^(-beta)``, phi in [0, 1.5].
- Truncated BPTT (chosen in SPEC): ``N_eff(r, k) = N_once + (k^phi + psi (r^phi - k^phi)) N_rec``, psi in [0, 1]
  (the worth of a forward-only loop relative to one that gets gradient); phi fitted or fixed.
- Test-time loops (Parcae): ``L(T) = L_inf + Z exp(-z T)`` per model.

Objective and search
--------------------
The LSE laws minimise ``sum_i Huber_delta(log L_hat_i - log L_i)`` with delta = 1e-3 (quadratic below
delta, linear above), by L-BFGS-B with analytic gradients, from the full start grid of the paper:
alpha, beta in {0, 0.5, ..., 2}; e in {-1, -0.5, ..., 1}; a, b in {0, 5, ..., 25} (4,500 starts), times
phi in {0, 0.5, 1, 1.5} for the phi law (18,000 starts); the truncation law adds the single value
psi = 0.5 (the middle of its bounded range; psi enters N_eff linearly) to the phi law's grid, or to the
Chinchilla grid when phi is fixed. The best end point is kept. Choices made here, so that a grid this
size costs seconds, not minutes:

- Every start of the grid is optimised, all at once, by a vectorised projected L-BFGS written in numpy
  (``_lbfgs_batch``: one objective evaluation advances every start; each start keeps its own curvature
  pairs and line search; up to 200 iterations). Calling scipy once per start costs ~20 ms, i.e. minutes
  for 18,000 starts. The best 3 distinct end points are then polished with
  ``scipy.optimize.minimize(method="L-BFGS-B", jac=True)`` and the best polished point is the estimate.
  The polish never makes a point worse, so the result is at least as good as the best grid end point.
  The objective is evaluated in cache-sized blocks of starts.
- Internally the intercepts are centred, ``a' = a - alpha c_N`` and ``b' = b - beta c_D`` (c = mean log N,
  mean log D over the runs): the same objective, a linear change of variables that removes most of the
  a-alpha and b-beta coupling, so L-BFGS converges in far fewer steps. Estimates are reported in the
  paper's (a, b) parametrisation.
- The optimiser minimises the objective divided by delta (same minimiser, O(1) scale, so the
  tolerances mean something); ``LawFit.loss`` reports the Huber sum itself, as in the papers.
- Bootstrap: resample runs with replacement ``bootstrap`` times (implemented as integer weights, which is
  the same objective as the resampled table), refit each resample from a small grid -- the estimate plus
  up to 3 other distinct end points of the full-grid search whose objective is within 3x the best's --
  all resamples at once with the same batched L-BFGS (up to 300 iterations), keep each resample's best,
  and report percentile 95% intervals (2.5th and 97.5th percentiles). Refitting each resample from the
  full grid would cost 1,000 times the fit; from the estimate's neighbourhood a resample's optimum is
  found in a few dozen steps. Resamples whose fits end non-finite are dropped and counted (n_failed).
- scipy's L-BFGS-B runs with BLAS held to one thread (threadpoolctl): its per-iteration LAPACK calls
  are tiny, and waking a thread pool for them was ~10x slower.
- ``starts=`` (rows of paper parameters) replaces the grid, e.g. to study the search or to refit cheaply.
- Test-time law: least squares on L itself (scipy ``least_squares``, trust-region reflective, analytic
  Jacobian) with bounds L_inf >= 0, Z >= 0, 1e-6 <= z <= 50, from z in {0.03, 0.1, 0.3, 1, 3} with L_inf
  and Z solved linearly for each z; the best is kept. Intervals: Wald (estimate +- 1.96 SE) by default,
  percentile bootstrap over points when ``bootstrap > 0``.
- Every fit reports log-residuals ``log L_hat - log L`` and returns a ``LawFit``; ``LawFit.from_params``
  wraps published parameters for ``predict`` and the allocation functions.
- Tables are a pandas DataFrame or a mapping of equal-length arrays. Chinchilla takes ``n`` or
  ``n_once`` + ``n_rec`` (summed); the phi law takes ``n_once, n_rec, loops, tokens, loss``; the
  truncation law adds ``backward_loops``. ``loops`` may be fractional (mean of a sampled loop count).

Compute-optimal allocation
--------------------------
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

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import xarray as xr
from scipy.optimize import least_squares, minimize
from threadpoolctl import threadpool_limits

from .config import check_bool, check_float, check_int
from .models.flops import flops_per_token  # the one formula (SPEC §2), shared with LoopLM

__all__ = [
    "HUBER_DELTA", "LawFit", "Allocation", "fit_chinchilla", "fit_phi", "fit_truncation", "fit_test_time",
    "chinchilla_optimal", "optimal_allocation", "optimal_setting", "LoopSetting", "huber_objective", "start_grid",
    "flops_per_token",
]

HUBER_DELTA = 1e-3
_ALPHA_GRID = (0.0, 0.5, 1.0, 1.5, 2.0)
_E_GRID = (-1.0, -0.5, 0.0, 0.5, 1.0)
_AB_GRID = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
_PHI_GRID = (0.0, 0.5, 1.0, 1.5)
_PSI_GRID = (0.5,)
_PHI_BOUNDS = (0.0, 1.5)
_PSI_BOUNDS = (0.0, 1.0)
_N_POLISH = 3         # best distinct grid end points polished with scipy L-BFGS-B
_N_DISTINCT = 8       # distinct end points kept (polished or not) as candidates for the bootstrap starts
_GRID_MAXITER = 200   # L-BFGS iterations per grid start (the best end points are then polished by scipy)
_BOOT_MAXITER = 300   # L-BFGS iterations per bootstrap start
_BOOT_STARTS = 4      # bootstrap starts: the estimate + up to 3 other distinct end points (within 3x its objective)
_CHUNK = 32768        # parameter rows x runs evaluated per block (cache-sized temporaries)
_DISTINCT = 0.05       # end points whose parameters all differ by less than this are the same optimum

_FORMULAS = {
    "chinchilla": "L = E + A*N^(-alpha) + B*D^(-beta); log L = LSE(a - alpha log N, b - beta log D, e)",
    "phi": "L = E + A*(N_once + r^phi*N_rec)^(-alpha) + B*D^(-beta)",
    "truncation": "L = E + A*N_eff^(-alpha) + B*D^(-beta); N_eff = N_once + (k^phi + psi*(r^phi - k^phi))*N_rec",
    "test_time": "L(T) = L_inf + Z*exp(-z*T)",
}
_COLUMNS = {
    "chinchilla": ("n", "tokens", "loss"),
    "phi": ("n_once", "n_rec", "loops", "tokens", "loss"),
    "truncation": ("n_once", "n_rec", "loops", "backward_loops", "tokens", "loss"),
}


# ---------------------------------------------------------------------------------------------------------
# input tables
# ---------------------------------------------------------------------------------------------------------
def _columns(table: Any, where: str) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Return ({column: 1-D array}, run labels or None) from a DataFrame or a mapping of arrays."""
    if isinstance(table, pd.DataFrame):
        return {str(c): table[c].to_numpy() for c in table.columns}, np.asarray(table.index)
    if isinstance(table, Mapping):
        return {str(c): np.asarray(v).reshape(-1) if np.ndim(v) == 0 else np.asarray(v)
                for c, v in table.items()}, None
    raise ValueError(f"{where}: table must be a pandas DataFrame or a mapping of equal-length arrays, "
                     f"got {type(table).__name__}")


def _equal_lengths(cols: dict[str, np.ndarray], names: Sequence[str], where: str) -> int:
    """Return the common length of the named columns (present ones), or raise ValueError naming the odd one."""
    length, first = None, None
    for name in names:
        if name not in cols:
            continue
        v = cols[name]
        if v.ndim != 1:
            raise ValueError(f"{where}: column {name!r} must be 1-D, got shape {v.shape}")
        if length is None:
            length, first = len(v), name
        elif len(v) != length:
            raise ValueError(f"{where}: column {name!r} has length {len(v)} but column {first!r} has length "
                             f"{length}; all columns must have equal length")
    return 0 if length is None else length


def _numeric(cols: dict[str, np.ndarray], name: str, where: str, needed: Sequence[str]) -> np.ndarray:
    """Return column `name` as finite float64, or raise ValueError naming it."""
    if name not in cols:
        raise ValueError(f"{where}: missing column {name!r}; the table has columns {sorted(cols)}, "
                         f"and this law needs {list(needed)}")
    v = cols[name]
    try:
        v = v.astype(np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: column {name!r} must be numeric, got dtype {cols[name].dtype}") from None
    bad = ~np.isfinite(v)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{where}: column {name!r} has non-finite value {v[i]!r} at row {i}; must be finite")
    return v


def _check(v: np.ndarray, name: str, where: str, ok: np.ndarray, allowed: str) -> None:
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise ValueError(f"{where}: column {name!r} has value {v[i]!r} at row {i}; {allowed}")


@dataclass
class _Data:
    """Validated run table for an LSE law (arrays of length n)."""

    law: str
    runs: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray | None
    n: np.ndarray | None = None          # chinchilla
    n_once: np.ndarray | None = None
    n_rec: np.ndarray | None = None
    loops: np.ndarray | None = None
    backward_loops: np.ndarray | None = None

    def columns(self) -> dict[str, np.ndarray]:
        names = ("n", "n_once", "n_rec", "loops", "backward_loops", "tokens", "loss")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


def _read_table(table: Any, law: str, where: str, need_loss: bool = True) -> _Data:
    """Return the validated columns a law needs (ValueError naming the column, the value and what is allowed)."""
    cols, runs = _columns(table, where)
    needed = list(_COLUMNS[law]) if need_loss else [c for c in _COLUMNS[law] if c != "loss"]
    if law == "chinchilla" and "n" not in cols and ("n_once" in cols or "n_rec" in cols):
        needed = ["n_once", "n_rec"] + needed[1:]
    n_rows = _equal_lengths(cols, needed, where)
    if n_rows == 0 and all(c in cols for c in needed):
        raise ValueError(f"{where}: the table has no rows; this law needs columns {needed}")
    if runs is None:
        runs = np.arange(n_rows)
    num = {c: _numeric(cols, c, where, needed) for c in needed}
    tokens = num["tokens"]
    _check(tokens, "tokens", where, tokens > 0, "tokens must be > 0")
    loss = None
    if need_loss:
        loss = num["loss"]
        _check(loss, "loss", where, loss > 0, "losses must be > 0 (the fit is in log loss)")
    d = _Data(law=law, runs=runs, tokens=tokens, loss=loss)
    if law == "chinchilla":
        if "n" in num:
            d.n = num["n"]
            _check(d.n, "n", where, d.n > 0, "parameter counts must be > 0")
            return d
    d.n_once, d.n_rec = num["n_once"], num["n_rec"]
    _check(d.n_once, "n_once", where, d.n_once >= 0, "n_once must be >= 0")
    _check(d.n_rec, "n_rec", where, d.n_rec >= 0, "n_rec must be >= 0")
    total = d.n_once + d.n_rec
    _check(total, "n_once + n_rec", where, total > 0, "n_once + n_rec must be > 0")
    if law == "chinchilla":
        d.n = total
        return d
    d.loops = num["loops"]
    _check(d.loops, "loops", where, d.loops >= 1, "loops must be >= 1")
    if law == "truncation":
        k = d.backward_loops = num["backward_loops"]
        _check(k, "backward_loops", where, k >= 1, "backward_loops must be >= 1")
        _check(k, "backward_loops", where, k <= d.loops, "backward_loops must be <= loops (of the same row)")
    return d


# ---------------------------------------------------------------------------------------------------------
# the LSE laws: parametrisation, objective, gradient
# ---------------------------------------------------------------------------------------------------------
class _Law:
    """Numeric form of one LSE law on one table. Internal vector: [a', b', e, alpha, beta, (phi), (psi)]."""

    def __init__(self, data: _Data, fixed_phi: float | None = None, delta: float = HUBER_DELTA):
        self.kind = data.law
        self.data = data
        self.delta = delta
        self.fixed_phi = fixed_phi
        names = ["a", "b", "e", "alpha", "beta"]
        if self.kind == "phi" or (self.kind == "truncation" and fixed_phi is None):
            names.append("phi")
        if self.kind == "truncation":
            names.append("psi")
        self.names = tuple(names)
        self.lower = np.full(len(names), -np.inf)
        self.upper = np.full(len(names), np.inf)
        for nm, (lo, hi) in (("phi", _PHI_BOUNDS), ("psi", _PSI_BOUNDS)):
            if nm in names:
                self.lower[names.index(nm)], self.upper[names.index(nm)] = lo, hi
        self.log_d = np.log(data.tokens)
        self.c_d = float(self.log_d.mean())
        self.log_dc = self.log_d - self.c_d
        if self.kind == "chinchilla":
            self.log_n = np.log(data.n)
            self.c_n = float(self.log_n.mean())
        else:
            self.log_r = np.log(data.loops)
            self.log_k = None if data.backward_loops is None else np.log(data.backward_loops)
            self.c_n = float(np.log(data.n_once + data.n_rec).mean())
            # N scaled by exp(c_n) so X ~ 1; log X - c_n is the centred log of the effective size
            self.n_once_s = data.n_once / math.exp(self.c_n)
            self.n_rec_s = data.n_rec / math.exp(self.c_n)
        self.log_loss = None if data.loss is None else np.log(data.loss)

    # -- parametrisation ---------------------------------------------------------------------------------
    def to_internal(self, theta: np.ndarray) -> np.ndarray:
        """Paper parameters [a, b, e, alpha, beta, ...] -> centred internal ones (rows are parameter vectors)."""
        t = np.array(theta, dtype=np.float64, copy=True)
        t[..., 0] -= t[..., 3] * self.c_n
        t[..., 1] -= t[..., 4] * self.c_d
        return t

    def to_paper(self, theta: np.ndarray) -> np.ndarray:
        t = np.array(theta, dtype=np.float64, copy=True)
        t[..., 0] += t[..., 3] * self.c_n
        t[..., 1] += t[..., 4] * self.c_d
        return t

    def _phi_psi(self, th: np.ndarray):
        i = 5
        if "phi" in self.names:
            phi = th[:, i:i + 1]
            i += 1
        else:
            phi = np.full((th.shape[0], 1), self.fixed_phi)
        psi = th[:, i:i + 1] if "psi" in self.names else None
        return phi, psi

    def log_size(self, th: np.ndarray, grad: bool = False):
        """Centred log effective size (S, n), and its derivatives w.r.t. phi and psi when grad is set."""
        if self.kind == "chinchilla":
            return (self.log_n - self.c_n)[None, :], None, None
        phi, psi = self._phi_psi(th)
        rp = np.exp(phi * self.log_r)
        if self.kind == "phi":
            mult = rp
        else:
            kp = np.exp(phi * self.log_k)
            mult = kp + psi * (rp - kp)
        x = self.n_once_s + mult * self.n_rec_s
        lx = np.log(x)
        if not grad:
            return lx, None, None
        if self.kind == "phi":
            d_phi = rp * self.log_r * self.n_rec_s / x
            d_psi = None
        else:
            d_phi = (kp * self.log_k + psi * (rp * self.log_r - kp * self.log_k)) * self.n_rec_s / x
            d_psi = (rp - kp) * self.n_rec_s / x
        return lx, d_phi, d_psi

    def log_pred(self, th: np.ndarray) -> np.ndarray:
        """Return log L_hat (S, n) = LSE(a' - alpha log X_c, b' - beta log D_c, e) for internal parameter rows."""
        th = np.atleast_2d(th)
        lx = self.log_size(th)[0]
        u1 = th[:, 0:1] - th[:, 3:4] * lx
        u2 = th[:, 1:2] - th[:, 4:5] * self.log_dc
        u3 = np.broadcast_to(th[:, 2:3], u1.shape)
        m = np.maximum(np.maximum(u1, u2), u3)
        return m + np.log(np.exp(u1 - m) + np.exp(u2 - m) + np.exp(u3 - m))

    def objective(self, th: np.ndarray, weights: np.ndarray | None = None):
        """Return (f (S,), grad (S, P)): Huber sum / delta over runs, for internal parameter rows (vectorised)."""
        th = np.atleast_2d(th)
        rows = max(16, _CHUNK // max(len(self.log_dc), 1))
        if th.shape[0] <= rows:
            return self._objective(th, weights)
        # blocks that keep the (rows, runs) temporaries in cache: several times faster than one big block
        f = np.empty(th.shape[0])
        g = np.empty((th.shape[0], len(self.names)))
        for i in range(0, th.shape[0], rows):
            f[i:i + rows], g[i:i + rows] = self._objective(th[i:i + rows],
                                                           None if weights is None else weights[i:i + rows])
        return f, g

    def _objective(self, th: np.ndarray, weights: np.ndarray | None):
        lx, d_phi, d_psi = self.log_size(th, grad=True)
        u1 = th[:, 0:1] - th[:, 3:4] * lx
        u2 = th[:, 1:2] - th[:, 4:5] * self.log_dc
        m = np.maximum(np.maximum(u1, u2), th[:, 2:3])
        u1 -= m
        u2 -= m
        u3 = th[:, 2:3] - m
        np.exp(u1, out=u1)
        np.exp(u2, out=u2)
        np.exp(u3, out=u3)
        s = u1 + u2 + u3
        res = np.log(s)
        res += m
        res -= self.log_loss
        dl = self.delta
        ab = np.abs(res)
        c = np.minimum(ab, dl)
        h = c * (ab - 0.5 * c)     # delta * Huber(res): r^2/2 within delta, delta (|r| - delta/2) beyond
        dr = np.clip(res, -dl, dl)  # delta * Huber'(res)
        if weights is not None:
            h *= weights
            dr *= weights
        f = h.sum(1) / dl
        dr /= s * dl                       # the softmax weights' denominator folded in
        u1 *= dr                           # now d f / d u_j per run
        u2 *= dr
        u3 *= dr
        g = np.empty((th.shape[0], len(self.names)))
        g[:, 0] = u1.sum(1)
        g[:, 1] = u2.sum(1)
        g[:, 2] = u3.sum(1)
        g[:, 3] = -np.einsum("sn,n->s", u1, lx[0]) if lx.shape[0] == 1 else -np.einsum("sn,sn->s", u1, lx)
        g[:, 4] = -np.einsum("sn,n->s", u2, self.log_dc)
        i = 5
        if "phi" in self.names:
            g[:, i] = -th[:, 3] * np.einsum("sn,sn->s", u1, d_phi)
            i += 1
        if "psi" in self.names:
            g[:, i] = -th[:, 3] * np.einsum("sn,sn->s", u1, d_psi)
        return f, g

    def grid(self) -> np.ndarray:
        """The paper's start grid in paper parameters (rows), with phi / psi grids where they are free."""
        axes = [_AB_GRID, _AB_GRID, _E_GRID, _ALPHA_GRID, _ALPHA_GRID]
        if "phi" in self.names:
            axes.append(_PHI_GRID)
        if "psi" in self.names:
            axes.append(_PSI_GRID)
        return np.array(list(itertools.product(*axes)), dtype=np.float64)


def start_grid(law: str = "chinchilla", fixed_phi: float | None = None) -> np.ndarray:
    """Return the full start grid (rows of paper parameters, columns as in the law's parameter order)."""
    if law not in _COLUMNS:
        raise ValueError(f"law={law!r} is invalid: must be one of {sorted(_COLUMNS)}")
    dummy = _Data(law=law, runs=np.arange(1), tokens=np.ones(1), loss=np.ones(1), n=np.ones(1),
                  n_once=np.ones(1), n_rec=np.ones(1), loops=np.ones(1), backward_loops=np.ones(1))
    return _Law(dummy, fixed_phi if law == "truncation" else None).grid()


def huber_objective(theta: Sequence[float], table: Any, law: str = "chinchilla", fixed_phi: float | None = None,
                    delta: float = HUBER_DELTA) -> tuple[float, np.ndarray]:
    """Return (sum of Huber(log L_hat - log L), its gradient) at paper parameters theta for a run table."""
    if law not in _COLUMNS:
        raise ValueError(f"law={law!r} is invalid: must be one of {sorted(_COLUMNS)}")
    data = _read_table(table, law, f"huber_objective(law={law!r})")
    lw = _Law(data, fixed_phi, delta)
    th = np.asarray(theta, dtype=np.float64)
    if th.shape != (len(lw.names),):
        raise ValueError(f"theta has shape {th.shape}; law {law!r} takes {len(lw.names)} parameters {lw.names}")
    f, g = lw.objective(lw.to_internal(th)[None])
    # chain rule back to paper parameters: a' = a - alpha c_n, b' = b - beta c_d
    g = g[0].copy()
    g[3] -= g[0] * lw.c_n
    g[4] -= g[1] * lw.c_d
    return float(f[0] * delta), g * delta


# ---------------------------------------------------------------------------------------------------------
# optimisers
# ---------------------------------------------------------------------------------------------------------
def _lbfgs_batch(fg: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]], x0: np.ndarray,
                 lower: np.ndarray, upper: np.ndarray, m: int = 10, maxiter: int = 1000, gtol: float = 1e-7,
                 ftol: float = 1e-12) -> tuple[np.ndarray, np.ndarray]:
    """Return (x (S, P), f (S,)): projected L-BFGS run on S independent problems at once.

    `fg(x, rows)` gives objective values and gradients for the rows (indices into the batch) of x.
    Each problem keeps its own curvature pairs and its own backtracking (Armijo) line search along the
    projected path; a problem stops when its projected gradient is below gtol, its relative decrease
    below ftol, or its line search fails. Finished problems leave the batch, so the cost follows the
    problems still running.
    """
    x_out = np.clip(np.array(x0, dtype=np.float64), lower, upper)
    S, P = x_out.shape
    with np.errstate(all="ignore"):
        f_out, g = fg(x_out, np.arange(S))
    f_out = np.where(np.isfinite(f_out) & np.isfinite(g).all(1), f_out, np.inf)
    ids = np.flatnonzero(np.isfinite(f_out))
    x, f, g = x_out[ids].copy(), f_out[ids].copy(), g[ids]
    s_hist = np.zeros((m, ids.size, P))
    y_hist = np.zeros((m, ids.size, P))
    rho = np.zeros((m, ids.size))        # 0 marks an empty or rejected slot
    gamma = np.zeros(ids.size)           # 0: no curvature pair yet
    dead = np.zeros(ids.size, dtype=bool)  # finished; dropped from the arrays once they are a quarter of them
    slot = 0
    with np.errstate(all="ignore"):
        for _ in range(maxiter):
            if ids.size == 0:
                break
            fixed = ((x <= lower) & (g > 0)) | ((x >= upper) & (g < 0))
            pg = np.where(fixed, 0.0, g)
            done = dead | (np.abs(pg).max(1) <= gtol)
            # two-loop recursion, every problem at once
            q = pg.copy()
            order = [(slot - 1 - j) % m for j in range(m)]
            alph = np.empty((m, ids.size))
            for j in order:
                a = rho[j] * np.einsum("sp,sp->s", s_hist[j], q)
                alph[j] = a
                q -= a[:, None] * y_hist[j]
            pgn = np.linalg.norm(pg, axis=1)
            q *= np.where(gamma > 0, gamma, 1.0 / np.maximum(pgn, 1e-300))[:, None]
            for j in reversed(order):
                b = rho[j] * np.einsum("sp,sp->s", y_hist[j], q)
                q += (alph[j] - b)[:, None] * s_hist[j]
            d = np.where(fixed, 0.0, -q)
            slope = np.einsum("sp,sp->s", g, d)
            bad = ~(slope < 0) & ~done
            if bad.any():   # not a descent direction: forget those problems' history, take steepest descent
                rho[:, bad] = 0.0
                gamma[bad] = 0.0
                d[bad] = -pg[bad] / np.maximum(pgn[bad], 1e-300)[:, None]
                slope[bad] = np.einsum("sp,sp->s", g[bad], d[bad])
            # backtracking line search along the projected path
            t = np.ones(ids.size)
            x_new, f_new, g_new = x.copy(), f.copy(), g.copy()
            pending = ~done & (slope < 0)
            for ls in range(30):
                pi = np.flatnonzero(pending)
                if pi.size == 0:
                    break
                xt = np.clip(x[pi] + t[pi, None] * d[pi], lower, upper)
                ft, gt = fg(xt, ids[pi])
                ok = np.isfinite(ft) & np.isfinite(gt).all(1) & \
                    (ft <= f[pi] + 1e-4 * np.einsum("sp,sp->s", g[pi], xt - x[pi]))
                acc = pi[ok]
                x_new[acc], f_new[acc], g_new[acc] = xt[ok], ft[ok], gt[ok]
                pending[acc] = False
                # next trial: minimiser of the quadratic through f(0), f'(0), f(t), kept in [0.1 t, 0.5 t]
                rej = pi[~ok]
                tr, sl = t[rej], slope[rej]
                curv = np.where(np.isfinite(ft[~ok]), ft[~ok] - f[rej] - sl * tr, np.inf)
                t_q = -sl * tr * tr / (2.0 * np.maximum(curv, 1e-300))
                t[rej] = np.clip(np.nan_to_num(t_q, nan=0.1 * tr, posinf=0.5 * tr), 0.1 * tr, 0.5 * tr)
            # expansion: where the first trial was accepted but the slope there is still steep (the weak
            # Wolfe curvature condition fails, e.g. on the linear arms of the Huber loss), try longer steps
            grow = ~done & ~pending & (t == 1.0) & (np.einsum("sp,sp->s", g_new, d) < 0.9 * slope)
            for _ex in range(12):
                pi = np.flatnonzero(grow)
                if pi.size == 0:
                    break
                t[pi] *= 4.0
                xt = np.clip(x[pi] + t[pi, None] * d[pi], lower, upper)
                ft, gt = fg(xt, ids[pi])
                ok = np.isfinite(ft) & np.isfinite(gt).all(1) & (ft < f_new[pi]) & \
                    (ft <= f[pi] + 1e-4 * np.einsum("sp,sp->s", g[pi], xt - x[pi]))
                acc = pi[ok]
                x_new[acc], f_new[acc], g_new[acc] = xt[ok], ft[ok], gt[ok]
                grow[pi[~ok]] = False
                grow[acc] = np.einsum("sp,sp->s", gt[ok], d[acc]) < 0.9 * slope[acc]
            done |= pending | ~(slope < 0)
            # curvature pairs (kept only when s'y > 0, so the inverse Hessian stays positive definite)
            sv = x_new - x
            yv = g_new - g
            sy = np.einsum("sp,sp->s", sv, yv)
            yy = np.einsum("sp,sp->s", yv, yv)
            good = ~done & np.isfinite(sy) & np.isfinite(yy) & (yy > 0) & \
                (sy > 1e-10 * np.sqrt(yy * np.einsum("sp,sp->s", sv, sv)))
            rho[slot] = np.where(good, 1.0 / np.where(good, sy, 1.0), 0.0)
            s_hist[slot] = sv
            y_hist[slot] = yv
            gamma = np.where(good, sy / np.where(good, yy, 1.0), gamma)
            slot = (slot + 1) % m
            done |= f - f_new <= ftol * np.maximum(np.maximum(np.abs(f), np.abs(f_new)), 1.0)
            x, f, g = x_new, f_new, g_new
            new = done & ~dead
            if new.any():
                x_out[ids[new]], f_out[ids[new]] = x[new], f[new]
                dead |= new
            if dead.all():
                break
            if dead.sum() > 0.25 * dead.size:
                keep = ~dead
                ids, x, f, g, dead = ids[keep], x[keep], f[keep], g[keep], dead[keep]
                s_hist, y_hist, rho, gamma = s_hist[:, keep], y_hist[:, keep], rho[:, keep], gamma[keep]
    live = ~dead
    x_out[ids[live]], f_out[ids[live]] = x[live], f[live]
    return x_out, f_out


def _distinct_best(x: np.ndarray, f: np.ndarray, k: int) -> np.ndarray:
    """Return indices of up to k end points with the lowest f whose parameters differ by > _DISTINCT."""
    order = np.argsort(np.where(np.isfinite(f), f, np.inf))
    keep: list[int] = []
    for i in order:
        if not np.isfinite(f[i]):
            break
        if all(np.abs(x[i] - x[j]).max() > _DISTINCT for j in keep):
            keep.append(int(i))
            if len(keep) == k:
                break
    return np.array(keep, dtype=int)


def _polish(lw: _Law, x0: np.ndarray) -> tuple[np.ndarray, float]:
    """Return (x, f) after scipy L-BFGS-B (analytic gradient) from internal start x0; never worse than x0."""
    def fun(t):
        f, g = lw.objective(t[None])
        return float(f[0]), g[0]

    bounds = [(None if not np.isfinite(lo) else lo, None if not np.isfinite(hi) else hi)
              for lo, hi in zip(lw.lower, lw.upper)]
    f0 = fun(x0)[0]
    # scipy's L-BFGS-B makes tiny LAPACK calls each iteration; waking a BLAS thread pool for them costs
    # more than the work (about 10x slower per iteration on a loaded 2-core machine)
    with threadpool_limits(limits=1, user_api="blas"):
        res = minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=bounds,
                       options={"maxiter": 500, "ftol": 1e-12, "gtol": 1e-8, "maxcor": 10})
    if np.isfinite(res.fun) and res.fun <= f0:
        return np.asarray(res.x, dtype=np.float64), float(res.fun)
    return x0, f0


# ---------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------
@dataclass
class LawFit:
    """A fitted law: estimates, 95% intervals, log-residuals, objective value, and the inputs it was fit to."""

    law: str
    params: dict[str, float]
    intervals: dict[str, tuple[float, float]]
    residuals: np.ndarray
    loss: float
    inputs: dict[str, np.ndarray]
    runs: np.ndarray
    bootstrap: int = 0
    seed: int | None = None
    samples: np.ndarray | None = None            # (bootstrap, params) in the order of `sample_names`
    sample_names: tuple[str, ...] = ()
    fixed: dict[str, float] = field(default_factory=dict)
    interval_method: str = "bootstrap percentile 95%"
    n_starts: int = 0
    n_failed: int = 0

    @classmethod
    def from_params(cls, law: str, **params: float) -> "LawFit":
        """Return a LawFit holding given parameters (no data), e.g. a published law, to predict or allocate with.

        LSE laws take alpha, beta and E, A, B (or e, a, b), plus phi (phi law; fixed for truncation) and
        psi (truncation); the test-time law takes L_inf, Z, z.
        """
        if law not in _FORMULAS:
            raise ValueError(f"law={law!r} is invalid: must be one of {sorted(_FORMULAS)}")
        p = {k: float(v) for k, v in params.items()}
        if law == "test_time":
            need = ["L_inf", "Z", "z"]
        else:
            for big, small in (("E", "e"), ("A", "a"), ("B", "b")):
                if big in p and small not in p:
                    if p[big] <= 0:
                        raise ValueError(f"from_params: {big}={p[big]!r} is invalid: must be > 0")
                    p[small] = math.log(p[big])
                elif small in p:
                    p[big] = math.exp(p[small])
            need = ["a", "b", "e", "alpha", "beta"] + (["phi"] if law != "chinchilla" else []) + \
                (["psi"] if law == "truncation" else [])
        missing = [k for k in need if k not in p]
        if missing:
            raise ValueError(f"from_params: law {law!r} needs parameters {missing}; got {sorted(params)}")
        fixed = {"phi": p["phi"]} if law == "truncation" else {}
        return cls(law=law, params=p, intervals={k: (math.nan, math.nan) for k in p}, residuals=np.zeros(0),
                   loss=math.nan, inputs={}, runs=np.zeros(0, dtype=int), fixed=fixed,
                   interval_method="none (given parameters)")

    @property
    def formula(self) -> str:
        """Return the law's formula as a string."""
        return _FORMULAS[self.law]

    def predict(self, table: Any) -> np.ndarray:
        """Return predicted losses for a table (same columns as the fit, `loss` not needed; or loops for test_time)."""
        if self.law == "test_time":
            if isinstance(table, (pd.DataFrame, Mapping)):
                cols, _ = _columns(table, "predict")
                loops = _numeric(cols, "loops", "predict", ["loops"])
            else:
                loops = np.asarray(table, dtype=np.float64).reshape(-1)
            p = self.params
            return p["L_inf"] + p["Z"] * np.exp(-p["z"] * loops)
        data = _read_table(table, self.law, f"predict({self.law})", need_loss=False)
        lw = _Law(data, self.fixed.get("phi"))
        th = np.array([[self.params[n] for n in lw.names]])
        return np.exp(lw.log_pred(lw.to_internal(th))[0])

    def to_dataset(self) -> xr.Dataset:
        """Return an xarray.Dataset: estimate, low, high over `param`; residual and inputs over `run`; provenance."""
        from .io import provenance

        names = list(self.params)
        ds = xr.Dataset(
            {
                "estimate": ("param", np.array([self.params[n] for n in names], dtype=np.float64)),
                "low": ("param", np.array([self.intervals[n][0] for n in names], dtype=np.float64)),
                "high": ("param", np.array([self.intervals[n][1] for n in names], dtype=np.float64)),
                "residual": ("run", np.asarray(self.residuals, dtype=np.float64)),
            },
            coords={"param": names, "run": _run_coord(self.runs, len(self.residuals))},
        )
        for k, v in self.inputs.items():
            ds[k] = ("run", np.asarray(v, dtype=np.float64))
        ds["estimate"].attrs["long_name"] = "point estimate"
        ds["low"].attrs["long_name"] = f"lower end, {self.interval_method}"
        ds["high"].attrs["long_name"] = f"upper end, {self.interval_method}"
        ds["residual"].attrs["long_name"] = "log L_hat - log L"
        if self.samples is not None:
            ds["samples"] = (("sample", "sample_param"), np.asarray(self.samples, dtype=np.float64))
            ds = ds.assign_coords(sample_param=list(self.sample_names))
        extra: dict[str, Any] = {
            "law": self.law, "formula": self.formula, "objective": self.objective_name,
            "loss": float(self.loss), "n_runs": int(len(self.residuals)), "bootstrap": int(self.bootstrap),
            "bootstrap_failed": int(self.n_failed), "n_starts": int(self.n_starts),
            "interval_method": self.interval_method,
        }
        for k, v in self.fixed.items():
            extra[f"fixed_{k}"] = float(v)
        return ds.assign_attrs(provenance(seed=self.seed, **extra))

    def identified(self, max_width: float = 1.0, min_bootstrap: int = 20) -> tuple[bool, str]:
        """Return (identified, why): whether the runs pin the law down, read from its bootstrap intervals.

        A law is identified here when it was bootstrapped (`min_bootstrap` resamples or more), every fitted
        exponent (alpha, beta, phi, psi) has a finite 95% interval no wider than `max_width`, and the
        irreducible loss E is not collapsed to zero (then A and alpha trade off freely). An allocation
        read from an unidentified law carries no information, so the fit notebook prints none.
        """
        if self.law == "test_time":
            return True, "the test-time law is fitted per run, not from a design"
        if self.bootstrap < min_bootstrap:
            return False, f"bootstrap={self.bootstrap} < {min_bootstrap}: no intervals to judge identification by"
        wide = []
        for name in ("alpha", "beta", "phi", "psi"):
            if name in self.params and name not in self.fixed:
                lo, hi = self.intervals[name]
                if not (math.isfinite(lo) and math.isfinite(hi)) or hi - lo > max_width:
                    wide.append(f"{name} in [{lo:.3g}, {hi:.3g}]")
        if wide:
            return False, "intervals too wide for the design to identify the law: " + "; ".join(wide)
        if self.params.get("E", 1.0) < 1e-6:
            return False, f"E = {self.params['E']:.2g}: the irreducible loss collapsed to zero"
        return True, "every fitted exponent's 95% interval is finite and narrower than " + f"{max_width:g}"

    @property
    def objective_name(self) -> str:
        """Return a description of the objective minimised."""
        if self.law == "test_time":
            return "least squares on L"
        return f"sum of Huber(delta={HUBER_DELTA:g}) on log L_hat - log L"

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v:.4g} [{self.intervals[k][0]:.4g}, {self.intervals[k][1]:.4g}]"
                         for k, v in self.params.items() if k not in ("a", "b", "e"))
        return f"LawFit({self.law}: {body}; loss={self.loss:.3g}, runs={len(self.residuals)})"


def _run_coord(runs: np.ndarray | None, n: int) -> np.ndarray:
    """Return the table's run labels (a DataFrame's index) when unique ints or strings, else 0..n-1."""
    if runs is not None and len(runs) == n and len(pd.unique(runs)) == n:
        arr = np.asarray(runs)
        if arr.dtype.kind in "iu":
            return arr
        if arr.dtype.kind in "UO" and all(isinstance(v, str) for v in arr):
            return arr.astype(str)
    return np.arange(n)


def _paper_params(lw: _Law, theta: np.ndarray) -> dict[str, float]:
    """Return named estimates (a, b, e, alpha, beta, E, A, B, phi, psi) from one paper-parameter vector."""
    p = {n: float(v) for n, v in zip(lw.names, theta)}
    with np.errstate(over="ignore"):
        p["E"], p["A"], p["B"] = (float(np.exp(p[k])) for k in ("e", "a", "b"))
    if lw.fixed_phi is not None:
        p["phi"] = float(lw.fixed_phi)
    return p


def _derived(lw: _Law, thetas: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Return samples with E, A, B appended (columns named), rows of paper parameters."""
    names = list(lw.names) + ["E", "A", "B"]
    with np.errstate(over="ignore"):
        extra = np.exp(thetas[:, [2, 0, 1]])
    return np.concatenate([thetas, extra], axis=1), names


# ---------------------------------------------------------------------------------------------------------
# the LSE fits
# ---------------------------------------------------------------------------------------------------------
def _fit_lse(data: _Data, where: str, bootstrap: int, seed: int, fixed_phi: float | None,
             starts: Any) -> LawFit:
    bootstrap = check_int(f"{where}: bootstrap", bootstrap, 0)
    seed = check_int(f"{where}: seed", seed)
    lw = _Law(data, fixed_phi)
    n, p = len(data.loss), len(lw.names)
    if n < p + 1:
        raise ValueError(f"{where}: too few runs to fit: got {n}, need at least {p + 1} "
                         f"({p} free parameters {list(lw.names)} + 1)")
    if starts is None:
        grid = lw.grid()
    else:
        grid = np.atleast_2d(np.asarray(starts, dtype=np.float64))
        if grid.ndim != 2 or grid.shape[1] != p:
            raise ValueError(f"{where}: starts has shape {np.shape(starts)}; must be (n_starts, {p}) with columns "
                             f"{list(lw.names)}")
    fg = lambda x, rows: lw.objective(x)  # noqa: E731
    x_end, f_end = _lbfgs_batch(fg, lw.to_internal(grid), lw.lower, lw.upper, maxiter=_GRID_MAXITER, ftol=1e-10)
    top = _distinct_best(x_end, f_end, _N_DISTINCT)
    if top.size == 0:
        raise ValueError(f"{where}: no start gave a finite objective; check the table's values")
    top = top[f_end[top] <= 3.0 * f_end[top[0]] + 1e-12]   # end points far worse than the best are dropped
    # the best few are polished by scipy; the rest stay as the batch left them (bootstrap starts only)
    polished = [_polish(lw, x_end[i]) for i in top[:_N_POLISH]] + [(x_end[i], f_end[i]) for i in top[_N_POLISH:]]
    fs = np.array([pf for _, pf in polished])
    xs = np.array([px for px, _ in polished])
    best = int(np.argmin(fs))
    x_hat, f_hat = xs[best], fs[best]
    theta_hat = lw.to_paper(x_hat)
    params = _paper_params(lw, theta_hat)
    residuals = lw.log_pred(x_hat[None])[0] - lw.log_loss

    samples, names, n_failed = None, list(lw.names) + ["E", "A", "B"], 0
    intervals: dict[str, tuple[float, float]]
    if bootstrap > 0:
        rng = np.random.default_rng(seed)
        weights = rng.multinomial(n, np.full(n, 1.0 / n), size=bootstrap).astype(np.float64)
        # small grid: the estimate, then the next-best distinct polished end points within 3x its objective
        keep = _distinct_best(xs, np.where(fs <= 3.0 * f_hat + 1e-12, fs, np.inf), _BOOT_STARTS)
        bstarts = xs[keep]                      # keep[0] is the estimate itself
        ns = len(bstarts)
        x0 = np.tile(bstarts, (bootstrap, 1))
        wrep = np.repeat(weights, ns, axis=0)
        fgb = lambda x, rows: lw.objective(x, wrep[rows])  # noqa: E731
        xb, fb = _lbfgs_batch(fgb, x0, lw.lower, lw.upper, maxiter=_BOOT_MAXITER, ftol=1e-10)
        fb = np.where(np.isfinite(fb), fb, np.inf).reshape(bootstrap, ns)
        pick = np.argmin(fb, axis=1)
        xb = xb.reshape(bootstrap, ns, p)[np.arange(bootstrap), pick]
        ok = np.isfinite(fb[np.arange(bootstrap), pick])
        n_failed = int((~ok).sum())
        samples, names = _derived(lw, lw.to_paper(xb[ok]))
        lo = hi = np.full(p, math.nan)
        if ok.any():
            lo, hi = np.percentile(samples[:, :p], [2.5, 97.5], axis=0)
        intervals = {nm: (float(lo[i]), float(hi[i])) for i, nm in enumerate(lw.names)}
        with np.errstate(over="ignore"):   # E, A, B: exp of the e, a, b percentiles (exp is monotone)
            for big, small in (("E", "e"), ("A", "a"), ("B", "b")):
                intervals[big] = (float(np.exp(intervals[small][0])), float(np.exp(intervals[small][1])))
    else:
        intervals = {nm: (math.nan, math.nan) for nm in names}
    if fixed_phi is not None:
        intervals["phi"] = (float(fixed_phi), float(fixed_phi))
    intervals = {k: intervals[k] for k in params}
    return LawFit(law=data.law, params=params, intervals=intervals, residuals=residuals,
                  loss=float(f_hat * lw.delta), inputs=data.columns(), runs=data.runs, bootstrap=bootstrap,
                  seed=seed, samples=samples, sample_names=tuple(names), n_failed=n_failed,
                  fixed={} if fixed_phi is None else {"phi": float(fixed_phi)}, n_starts=len(grid),
                  interval_method="bootstrap percentile 95%" if bootstrap > 0 else "none (bootstrap=0)")


def fit_chinchilla(table: Any, bootstrap: int = 1000, seed: int = 0, starts: Any = None) -> LawFit:
    """Return the Chinchilla Approach 3 fit of L = E + A/N^alpha + B/D^beta (columns n or n_once+n_rec, tokens, loss).

    `starts` (rows of [a, b, e, alpha, beta]) replaces the paper's start grid, e.g. to study the search.
    """
    data = _read_table(table, "chinchilla", "fit_chinchilla")
    return _fit_lse(data, "fit_chinchilla", bootstrap, seed, None, starts)


def fit_phi(table: Any, bootstrap: int = 1000, seed: int = 0, starts: Any = None) -> LawFit:
    """Return the recurrence-equivalence fit L = E + A (N_once + r^phi N_rec)^-alpha + B D^-beta, phi in [0, 1.5].

    Columns: n_once, n_rec, loops, tokens, loss. `starts`: rows of [a, b, e, alpha, beta, phi].
    """
    data = _read_table(table, "phi", "fit_phi")
    return _fit_lse(data, "fit_phi", bootstrap, seed, None, starts)


def fit_truncation(table: Any, bootstrap: int = 1000, seed: int = 0, phi: float | None = None,
                   starts: Any = None) -> LawFit:
    """Return the truncated-BPTT fit with N_eff = N_once + (k^phi + psi (r^phi - k^phi)) N_rec, psi in [0, 1].

    Columns: n_once, n_rec, loops, backward_loops, tokens, loss. `phi` fixes phi (e.g. from a full-BPTT
    `fit_phi`); otherwise it is fitted in [0, 1.5]. `starts`: rows of [a, b, e, alpha, beta, (phi), psi].
    """
    if phi is not None:
        phi = check_float("fit_truncation: phi", phi, *_PHI_BOUNDS,
                          allowed=f"must be None (fitted) or a number in [{_PHI_BOUNDS[0]}, {_PHI_BOUNDS[1]}]")
    data = _read_table(table, "truncation", "fit_truncation")
    return _fit_lse(data, "fit_truncation", bootstrap, seed, phi, starts)


# ---------------------------------------------------------------------------------------------------------
# test-time law
# ---------------------------------------------------------------------------------------------------------
_TT_Z_STARTS = (0.03, 0.1, 0.3, 1.0, 3.0)
_TT_Z_MAX = 50.0
_TT_Z_MIN = 1e-6


def _tt_fit_once(t: np.ndarray, y: np.ndarray, starts: Sequence[np.ndarray]) -> np.ndarray:
    """Return [L_inf, Z, z] minimising sum (L_hat - L)^2 from several starts (bounded trust-region LS)."""
    def resid(p):
        return p[0] + p[1] * np.exp(-p[2] * t) - y

    def jac(p):
        ex = np.exp(-p[2] * t)
        return np.stack([np.ones_like(t), ex, -p[1] * t * ex], axis=1)

    best, best_cost = None, np.inf
    for p0 in starts:
        r = least_squares(resid, p0, jac=jac, bounds=([0.0, 0.0, _TT_Z_MIN], [np.inf, np.inf, _TT_Z_MAX]),
                          method="trf", x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=2000)
        if r.cost < best_cost:
            best, best_cost = r.x, r.cost
    return best


def _tt_starts(t: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Starts: for each z on a grid, the (clipped) linear least-squares L_inf and Z given z."""
    out = []
    for z in _TT_Z_STARTS:
        a = np.stack([np.ones_like(t), np.exp(-z * t)], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        out.append(np.array([max(coef[0], 0.0), max(coef[1], 0.0), z]))
    return out


def fit_test_time(loops: Any, losses: Any = None, bootstrap: int = 0, seed: int = 0) -> LawFit:
    """Return the test-time fit L(T) = L_inf + Z exp(-z T) of one model's loss at inference loop counts T.

    `loops` and `losses` are equal-length arrays (or pass a table with columns loops, loss as `loops`).
    Least squares on L with bounds L_inf >= 0, Z >= 0, 1e-6 <= z <= 50, from a grid of z starts.
    Intervals: percentile bootstrap over points when bootstrap > 0, else Wald (estimate +- 1.96 SE from
    the Jacobian at the optimum).
    """
    where = "fit_test_time"
    bootstrap = check_int(f"{where}: bootstrap", bootstrap, 0)
    seed = check_int(f"{where}: seed", seed)
    if losses is None and isinstance(loops, (pd.DataFrame, Mapping)):
        cols, _ = _columns(loops, where)
        _equal_lengths(cols, ["loops", "loss"], where)
        t = _numeric(cols, "loops", where, ["loops", "loss"])
        y = _numeric(cols, "loss", where, ["loops", "loss"])
    else:
        if losses is None:
            raise ValueError(f"{where}: losses is missing; pass loops and losses, or a table with columns loops, loss")
        try:
            t = np.asarray(loops, dtype=np.float64).reshape(-1)
            y = np.asarray(losses, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: loops and losses must be numeric arrays") from None
        if t.shape != y.shape:
            raise ValueError(f"{where}: loops has length {t.size} but losses has length {y.size}; "
                             "they must have equal length")
        for nm, v in (("loops", t), ("loss", y)):
            _check(v, nm, where, np.isfinite(v), "must be finite")
    _check(t, "loops", where, t >= 1, "loops must be >= 1")
    _check(y, "loss", where, y > 0, "losses must be > 0")
    if t.size < 4:
        raise ValueError(f"{where}: too few points to fit: got {t.size}, need at least 4 (3 free parameters + 1)")
    if np.unique(t).size < 3:
        raise ValueError(f"{where}: loops has {np.unique(t).size} distinct values; need at least 3")
    p_hat = _tt_fit_once(t, y, _tt_starts(t, y))
    names = ["L_inf", "Z", "z"]
    params = dict(zip(names, map(float, p_hat)))
    pred = p_hat[0] + p_hat[1] * np.exp(-p_hat[2] * t)
    residuals = np.log(pred) - np.log(y)
    samples, n_failed = None, 0
    if bootstrap > 0:
        rng = np.random.default_rng(seed)
        draws = []
        for _ in range(bootstrap):
            i = rng.integers(0, t.size, t.size)
            if np.unique(t[i]).size < 3:
                n_failed += 1
                continue
            draws.append(_tt_fit_once(t[i], y[i], [p_hat]))
        samples = np.array(draws).reshape(-1, 3)
        lo, hi = np.percentile(samples, [2.5, 97.5], axis=0) if len(draws) else (np.full(3, math.nan),) * 2
        intervals = {nm: (float(lo[j]), float(hi[j])) for j, nm in enumerate(names)}
        method = "bootstrap percentile 95%"
    else:
        ex = np.exp(-p_hat[2] * t)
        jac = np.stack([np.ones_like(t), ex, -p_hat[1] * t * ex], axis=1)
        dof = max(t.size - 3, 1)
        s2 = float(((pred - y) ** 2).sum()) / dof
        cov = np.linalg.pinv(jac.T @ jac) * s2
        se = np.sqrt(np.maximum(np.diag(cov), 0.0))
        intervals = {nm: (float(p_hat[j] - 1.96 * se[j]), float(p_hat[j] + 1.96 * se[j]))
                     for j, nm in enumerate(names)}
        method = "Wald 95% (1.96 SE)"
    return LawFit(law="test_time", params=params, intervals=intervals, residuals=residuals,
                  loss=float(0.5 * ((pred - y) ** 2).sum()), inputs={"loops": t, "loss": y},
                  runs=np.arange(t.size), bootstrap=bootstrap, seed=seed, samples=samples,
                  sample_names=tuple(names), n_failed=n_failed, interval_method=method, n_starts=len(_TT_Z_STARTS))


# ---------------------------------------------------------------------------------------------------------
# compute-optimal allocation
# ---------------------------------------------------------------------------------------------------------
def _positive(v: Any, name: str, where: str) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64)
    if not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"{where}: {name}={v!r} is invalid: must be finite and > 0")
    return a


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
    if not isinstance(fit, LawFit) or fit.law not in ("phi", "truncation"):
        raise ValueError(f"{where}: fit must be a LawFit from fit_phi or fit_truncation, got "
                         f"{getattr(fit, 'law', type(fit).__name__)!r}; use chinchilla_optimal for a Chinchilla fit")
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
    if not isinstance(fit, LawFit) or fit.law not in ("phi", "truncation"):
        raise ValueError(f"{where}: fit must be a LawFit from fit_phi or fit_truncation, got "
                         f"{getattr(fit, 'law', type(fit).__name__)!r}; use chinchilla_optimal for a Chinchilla fit")
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
    n0 = n_once + n_rec
    log_s_lo, log_s_hi = -np.inf, np.inf
    if size_range is not None:
        if not free_size:
            raise ValueError(f"{where}: size_range={size_range!r} is invalid with free_size=False: the size is fixed")
        try:
            lo, hi = (float(v) for v in size_range)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: size_range={size_range!r} is invalid: must be (N_min, N_max)") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
            raise ValueError(f"{where}: size_range={size_range!r} is invalid: must be (N_min, N_max) with "
                             "0 < N_min <= N_max, finite (bounds on N_once + N_rec)")
        log_s_lo, log_s_hi = math.log(lo / n0), math.log(hi / n0)
    p = fit.params
    al, be = p["alpha"], p["beta"]
    if free_size and (al <= 0 or be <= 0):
        raise ValueError(f"{where}: the fit has alpha={al:.4g}, beta={be:.4g}; a compute-optimal size needs both > 0 "
                         "(use free_size=False)")

    # every searched pair plus the full-BPTT pairs (r, r), evaluated once
    full = np.stack([r, r], axis=1)
    pairs = np.unique(np.concatenate([searched, full]), axis=0)          # sorted by r, then k
    pr, pk = pairs[:, 0], pairs[:, 1]
    fpt1 = flops_per_token(n_once, n_rec, pr, pk)                       # (P,) at s = 1
    if free_size:
        log_m = np.log(_effective_size(fit, n_once, n_rec, pr, pk))
        log_s = (math.log(al / be) + p["a"] - p["b"] - al * log_m[None, :]
                 + be * (np.log(c)[:, None] - np.log(fpt1)[None, :])) / (al + be)
        scale = np.exp(np.clip(log_s, log_s_lo, log_s_hi))               # (C, P)
    else:
        scale = np.ones((c.size, pr.size))
    tokens = c[:, None] / (scale * fpt1[None, :])
    shape = tokens.shape
    loss = fit.predict({"n_once": (scale * n_once).reshape(-1), "n_rec": (scale * n_rec).reshape(-1),
                        "loops": np.broadcast_to(pr, shape).reshape(-1),
                        "backward_loops": np.broadcast_to(pk, shape).reshape(-1),
                        "tokens": tokens.reshape(-1)}).reshape(shape)

    def pick(mask: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        masked = np.where(mask[None, :], loss, np.inf)
        j = np.argmin(masked, axis=1)                                    # first minimum: smallest r, then k
        rows = np.arange(c.size)
        s = scale[rows, j]
        return dict(n_once=s * n_once, n_rec=s * n_rec, loops=pr[j], backward_loops=pk[j],
                    tokens=tokens[rows, j], loss=loss[rows, j], flops_per_token=s * fpt1[j]), loss[rows, j]

    is_searched = (pairs[:, None, :] == searched[None, :, :]).all(axis=2).any(axis=1)
    best, best_loss = pick(is_searched)
    full_best, full_loss = pick(pr == pk)
    wins = full_loss <= best_loss + 1e-12 * np.abs(best_loss)

    ks = np.unique(pk)
    ir, ik = np.searchsorted(r, pr), np.searchsorted(ks, pk)
    cube = {name: np.full((c.size, r.size, ks.size), np.nan) for name in ("loss", "tokens", "n")}
    for name, v in (("loss", loss), ("tokens", tokens), ("n", scale * n0)):
        cube[name][:, ir, ik] = v
    on = np.zeros((r.size, ks.size), dtype=bool)
    on[ir, ik] = is_searched
    grid = xr.Dataset({name: (("flops", "loops", "backward_loops"), v) for name, v in cube.items()},
                      coords={"flops": c, "loops": r, "backward_loops": ks},
                      attrs={"search": search, "free_size": int(free_size)})
    grid["searched"] = (("loops", "backward_loops"), on)
    if scalar:
        best = {key: float(v[0]) for key, v in best.items()}
        full_best = {key: float(v[0]) for key, v in full_best.items()}
        wins = bool(wins[0])
    return LoopSetting(full_bptt=full_best, full_bptt_wins=wins, free_size=free_size, grid=grid, **best)
