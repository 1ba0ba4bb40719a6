"""The test-time law of one model: loss against inference loop count, ``L(T) = L_inf + Z exp(-z T)`` (Parcae).

Least squares on L itself (scipy ``least_squares``, trust-region reflective, analytic Jacobian) with
bounds L_inf >= 0, Z >= 0, 1e-6 <= z <= 50, from z in {0.03, 0.1, 0.3, 1, 3} with L_inf and Z solved
linearly for each z; the best is kept. Intervals: Wald (estimate +- 1.96 SE) by default, percentile
bootstrap over points when ``bootstrap > 0``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from ..config import check_int
from .fit import LawFit
from .table import _check, _columns, _equal_lengths, _numeric

_TT_Z_STARTS = (0.03, 0.1, 0.3, 1.0, 3.0)
_TT_Z_MAX = 50.0
_TT_Z_MIN = 1e-6
_TT_NAMES = ["L_inf", "Z", "z"]


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
    t, y = _tt_points(loops, losses, where)
    p_hat = _tt_fit_once(t, y, _tt_starts(t, y))
    params = dict(zip(_TT_NAMES, map(float, p_hat)))
    pred = p_hat[0] + p_hat[1] * np.exp(-p_hat[2] * t)
    residuals = np.log(pred) - np.log(y)
    samples, n_failed = None, 0
    if bootstrap > 0:
        samples, n_failed, intervals = _tt_bootstrap(t, y, p_hat, bootstrap, seed)
        method = "bootstrap percentile 95%"
    else:
        intervals = _tt_wald(t, y, p_hat, pred)
        method = "Wald 95% (1.96 SE)"
    return LawFit(law="test_time", params=params, intervals=intervals, residuals=residuals,
                  loss=float(0.5 * ((pred - y) ** 2).sum()), inputs={"loops": t, "loss": y},
                  runs=np.arange(t.size), bootstrap=bootstrap, seed=seed, samples=samples,
                  sample_names=tuple(_TT_NAMES), n_failed=n_failed, interval_method=method,
                  n_starts=len(_TT_Z_STARTS))


def _tt_points(loops: Any, losses: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Return (loops, losses) as validated float arrays, from two arrays or one table (ValueError naming the fault)."""
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
    return t, y


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
    """Return the starts: for each z on a grid, the (clipped) linear least-squares L_inf and Z given z."""
    out = []
    for z in _TT_Z_STARTS:
        a = np.stack([np.ones_like(t), np.exp(-z * t)], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        out.append(np.array([max(coef[0], 0.0), max(coef[1], 0.0), z]))
    return out


def _tt_bootstrap(t: np.ndarray, y: np.ndarray, p_hat: np.ndarray, bootstrap: int,
                  seed: int) -> tuple[np.ndarray, int, dict[str, tuple[float, float]]]:
    """Return (samples (B, 3), n_failed, percentile 95% intervals) from refits to points resampled with replacement.

    Each resample starts from the estimate; one with fewer than 3 distinct loop counts cannot pin three
    parameters, so it is skipped and counted as failed.
    """
    rng = np.random.default_rng(seed)
    draws, n_failed = [], 0
    for _ in range(bootstrap):
        i = rng.integers(0, t.size, t.size)
        if np.unique(t[i]).size < 3:
            n_failed += 1
            continue
        draws.append(_tt_fit_once(t[i], y[i], [p_hat]))
    samples = np.array(draws).reshape(-1, 3)
    lo, hi = np.percentile(samples, [2.5, 97.5], axis=0) if len(draws) else (np.full(3, math.nan),) * 2
    return samples, n_failed, {nm: (float(lo[j]), float(hi[j])) for j, nm in enumerate(_TT_NAMES)}


def _tt_wald(t: np.ndarray, y: np.ndarray, p_hat: np.ndarray, pred: np.ndarray) -> dict[str, tuple[float, float]]:
    """Return Wald 95% intervals (estimate +- 1.96 SE, covariance from the Jacobian at the optimum)."""
    ex = np.exp(-p_hat[2] * t)
    jac = np.stack([np.ones_like(t), ex, -p_hat[1] * t * ex], axis=1)
    dof = max(t.size - 3, 1)
    s2 = float(((pred - y) ** 2).sum()) / dof
    cov = np.linalg.pinv(jac.T @ jac) * s2
    se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    return {nm: (float(p_hat[j] - 1.96 * se[j]), float(p_hat[j] + 1.96 * se[j])) for j, nm in enumerate(_TT_NAMES)}
