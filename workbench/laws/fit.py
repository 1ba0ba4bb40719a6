"""Fitting the LSE laws: the start-grid search, the scipy polish, the bootstrap, and the LawFit result.

Search: every start of the grid (``objective.start_grid``, 4,500 or 18,000 rows) is optimised, all at
once, by the batched projected L-BFGS (``_lbfgs.lbfgs_batch``, up to 200 iterations). The best 3 distinct
end points are then polished with ``scipy.optimize.minimize(method="L-BFGS-B", jac=True)`` and the best
polished point is the estimate. The polish never makes a point worse, so the result is at least as good
as the best grid end point. ``starts=`` (rows of paper parameters) replaces the grid, e.g. to study the
search or to refit cheaply. ``LawFit.loss`` reports the Huber sum itself (not divided by delta), as in
the papers.

Bootstrap: resample runs with replacement ``bootstrap`` times (implemented as integer weights, which is
the same objective as the resampled table), refit each resample from a small grid -- the estimate plus up
to 3 other distinct end points of the full-grid search whose objective is within 3x the best's -- all
resamples at once with the same batched L-BFGS (up to 300 iterations), keep each resample's best, and
report percentile 95% intervals (2.5th and 97.5th percentiles). Refitting each resample from the full grid
would cost 1,000 times the fit; from the estimate's neighbourhood a resample's optimum is found in a few
dozen steps. Resamples whose fits end non-finite are dropped and counted (n_failed).

scipy's L-BFGS-B runs with BLAS held to one thread (threadpoolctl): its per-iteration LAPACK calls are
tiny, and waking a thread pool for them was ~10x slower.

Every fit reports log-residuals ``log L_hat - log L`` and returns a ``LawFit``; ``LawFit.from_params``
wraps published parameters for ``predict`` and the allocation functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import pandas as pd
import xarray as xr
from scipy.optimize import minimize
from threadpoolctl import threadpool_limits

from ..config import check_float, check_int
from ._lbfgs import lbfgs_batch
from .objective import _PHI_BOUNDS, HUBER_DELTA, _Law
from .table import _columns, _Data, _numeric, _read_table

_N_POLISH = 3         # best distinct grid end points polished with scipy L-BFGS-B
_N_DISTINCT = 8       # distinct end points kept (polished or not) as candidates for the bootstrap starts
_GRID_MAXITER = 200   # L-BFGS iterations per grid start (the best end points are then polished by scipy)
_BOOT_MAXITER = 300   # L-BFGS iterations per bootstrap start
_BOOT_STARTS = 4      # bootstrap starts: the estimate + up to 3 other distinct end points (within 3x its objective)
_DISTINCT = 0.05       # end points whose parameters all differ by less than this are the same optimum

_FORMULAS = {
    "chinchilla": "L = E + A*N^(-alpha) + B*D^(-beta); log L = LSE(a - alpha log N, b - beta log D, e)",
    "phi": "L = E + A*(N_once + r^phi*N_rec)^(-alpha) + B*D^(-beta)",
    "truncation": "L = E + A*N_eff^(-alpha) + B*D^(-beta); N_eff = N_once + (k^phi + psi*(r^phi - k^phi))*N_rec",
    "test_time": "L(T) = L_inf + Z*exp(-z*T)",
}


# ---------------------------------------------------------------------------------------------------------
# the result
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
        from ..io import provenance

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
# the fits
# ---------------------------------------------------------------------------------------------------------
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


def _fit_lse(data: _Data, where: str, bootstrap: int, seed: int, fixed_phi: float | None,
             starts: Any) -> LawFit:
    """Return the LawFit of an LSE law on a validated table: grid search, polish, then bootstrap intervals."""
    bootstrap = check_int(f"{where}: bootstrap", bootstrap, 0)
    seed = check_int(f"{where}: seed", seed)
    lw = _Law(data, fixed_phi)
    n, p = len(data.loss), len(lw.names)
    if n < p + 1:
        raise ValueError(f"{where}: too few runs to fit: got {n}, need at least {p + 1} "
                         f"({p} free parameters {list(lw.names)} + 1)")
    grid = _start_rows(lw, starts, where)
    xs, fs = _search(lw, grid, where)
    best = int(np.argmin(fs))
    x_hat, f_hat = xs[best], fs[best]
    theta_hat = lw.to_paper(x_hat)
    params = _paper_params(lw, theta_hat)
    residuals = lw.log_pred(x_hat[None])[0] - lw.log_loss

    samples, names, n_failed = None, list(lw.names) + ["E", "A", "B"], 0
    intervals: dict[str, tuple[float, float]]
    if bootstrap > 0:
        samples, names, n_failed, intervals = _bootstrap(lw, xs, fs, f_hat, bootstrap, seed)
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


def _start_rows(lw: _Law, starts: Any, where: str) -> np.ndarray:
    """Return the starts in paper parameters: the law's full grid, or the caller's rows after a shape check."""
    if starts is None:
        return lw.grid()
    grid = np.atleast_2d(np.asarray(starts, dtype=np.float64))
    p = len(lw.names)
    if grid.ndim != 2 or grid.shape[1] != p:
        raise ValueError(f"{where}: starts has shape {np.shape(starts)}; must be (n_starts, {p}) with columns "
                         f"{list(lw.names)}")
    return grid


def _search(lw: _Law, grid: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Return (x (K, P) internal, f (K,)): the best distinct end points of the grid search, the best few polished."""
    fg = lambda x, rows: lw.objective(x)  # noqa: E731
    x_end, f_end = lbfgs_batch(fg, lw.to_internal(grid), lw.lower, lw.upper, maxiter=_GRID_MAXITER, ftol=1e-10)
    top = _distinct_best(x_end, f_end, _N_DISTINCT)
    if top.size == 0:
        raise ValueError(f"{where}: no start gave a finite objective; check the table's values")
    top = top[f_end[top] <= 3.0 * f_end[top[0]] + 1e-12]   # end points far worse than the best are dropped
    # the best few are polished by scipy; the rest stay as the batch left them (bootstrap starts only)
    polished = [_polish(lw, x_end[i]) for i in top[:_N_POLISH]] + [(x_end[i], f_end[i]) for i in top[_N_POLISH:]]
    fs = np.array([pf for _, pf in polished])
    xs = np.array([px for px, _ in polished])
    return xs, fs


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


def _bootstrap(lw: _Law, xs: np.ndarray, fs: np.ndarray, f_hat: float, bootstrap: int,
               seed: int) -> tuple[np.ndarray, list[str], int, dict[str, tuple[float, float]]]:
    """Return (samples, their column names, n_failed, percentile 95% intervals) from refitting resampled runs."""
    n, p = len(lw.log_loss), len(lw.names)
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(n, np.full(n, 1.0 / n), size=bootstrap).astype(np.float64)
    # small grid: the estimate, then the next-best distinct polished end points within 3x its objective
    keep = _distinct_best(xs, np.where(fs <= 3.0 * f_hat + 1e-12, fs, np.inf), _BOOT_STARTS)
    bstarts = xs[keep]                      # keep[0] is the estimate itself
    ns = len(bstarts)
    x0 = np.tile(bstarts, (bootstrap, 1))
    wrep = np.repeat(weights, ns, axis=0)
    fgb = lambda x, rows: lw.objective(x, wrep[rows])  # noqa: E731
    xb, fb = lbfgs_batch(fgb, x0, lw.lower, lw.upper, maxiter=_BOOT_MAXITER, ftol=1e-10)
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
    return samples, names, n_failed, intervals
