"""A projected L-BFGS in numpy that runs many independent bound-constrained problems as one batch.

The laws fit from thousands of starts (4,500 for Chinchilla, 18,000 for the phi law). Calling
``scipy.optimize.minimize`` once per start costs ~20 ms, i.e. minutes; here one objective evaluation
advances every start at once. Each problem keeps its own curvature pairs (two-loop recursion) and its own
backtracking (Armijo) line search along the projected path, with an expansion step where the first trial
is accepted but the slope is still steep. Bounds are handled by projection: variables at a bound whose
gradient points outward are held fixed for the step. tests/test_lbfgs.py checks it against scipy's
L-BFGS-B on random bounded quadratics and on planted laws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

Objective = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]

_ARMIJO = 1e-4        # sufficient-decrease constant of the line search
_WOLFE = 0.9          # an accepted step whose slope is still below 0.9 x the first one is grown
_BACKTRACKS = 30      # trials per line search before a problem is declared finished
_EXPANSIONS = 12      # growth steps (x4 each) after a full step that was still steep


@dataclass
class _Batch:
    """The problems still running: their batch indices, iterates, curvature history and finished flags."""

    ids: np.ndarray       # (S,) indices into the caller's batch
    x: np.ndarray         # (S, P)
    f: np.ndarray         # (S,)
    g: np.ndarray         # (S, P)
    s_hist: np.ndarray    # (m, S, P) steps
    y_hist: np.ndarray    # (m, S, P) gradient changes
    rho: np.ndarray       # (m, S) 1 / s'y; 0 marks an empty or rejected slot
    gamma: np.ndarray     # (S,) initial inverse-Hessian scale; 0: no curvature pair yet
    dead: np.ndarray      # (S,) finished; dropped from the arrays once they are a quarter of them
    slot: int = 0         # next history slot to overwrite (a ring of m)

    def drop_dead(self) -> None:
        """Return None after removing finished problems from every array (their results are already out)."""
        keep = ~self.dead
        self.ids, self.x, self.f, self.g, self.dead = (self.ids[keep], self.x[keep], self.f[keep], self.g[keep],
                                                       self.dead[keep])
        self.s_hist, self.y_hist = self.s_hist[:, keep], self.y_hist[:, keep]
        self.rho, self.gamma = self.rho[:, keep], self.gamma[keep]


def lbfgs_batch(fg: Objective, x0: np.ndarray, lower: np.ndarray, upper: np.ndarray, m: int = 10,
                maxiter: int = 1000, gtol: float = 1e-7, ftol: float = 1e-12) -> tuple[np.ndarray, np.ndarray]:
    """Return (x (S, P), f (S,)): projected L-BFGS run on S independent problems at once.

    `fg(x, rows)` gives objective values and gradients for the rows (indices into the batch) of x.
    Each problem keeps its own curvature pairs and its own backtracking (Armijo) line search along the
    projected path; a problem stops when its projected gradient is below gtol, its relative decrease
    below ftol, or its line search fails. Finished problems leave the batch, so the cost follows the
    problems still running. Starts whose objective is not finite end at once with f = inf.
    """
    x_out = np.clip(np.array(x0, dtype=np.float64), lower, upper)
    S, P = x_out.shape
    with np.errstate(all="ignore"):
        f_out, g = fg(x_out, np.arange(S))
    f_out = np.where(np.isfinite(f_out) & np.isfinite(g).all(1), f_out, np.inf)
    ids = np.flatnonzero(np.isfinite(f_out))
    b = _Batch(ids=ids, x=x_out[ids].copy(), f=f_out[ids].copy(), g=g[ids], s_hist=np.zeros((m, ids.size, P)),
               y_hist=np.zeros((m, ids.size, P)), rho=np.zeros((m, ids.size)), gamma=np.zeros(ids.size),
               dead=np.zeros(ids.size, dtype=bool))
    with np.errstate(all="ignore"):
        for _ in range(maxiter):
            if b.ids.size == 0:
                break
            if _iterate(fg, b, lower, upper, gtol, ftol, x_out, f_out):
                break
    live = ~b.dead
    x_out[b.ids[live]], f_out[b.ids[live]] = b.x[live], b.f[live]
    return x_out, f_out


def _iterate(fg: Objective, b: _Batch, lower: np.ndarray, upper: np.ndarray, gtol: float, ftol: float,
             x_out: np.ndarray, f_out: np.ndarray) -> bool:
    """Return whether every problem has finished, after one L-BFGS step of every running problem.

    Problems that finish on this step write their end point into x_out, f_out.
    """
    fixed = ((b.x <= lower) & (b.g > 0)) | ((b.x >= upper) & (b.g < 0))   # at a bound, pushed outward
    pg = np.where(fixed, 0.0, b.g)
    done = b.dead | (np.abs(pg).max(1) <= gtol)
    d, slope = _direction(b, pg, fixed, done)
    x_new, f_new, g_new, t, pending = _backtrack(fg, b, d, slope, done, lower, upper)
    _expand(fg, b, d, slope, ~done & ~pending & (t == 1.0), t, x_new, f_new, g_new, lower, upper)
    done |= pending | ~(slope < 0)      # the line search failed, or there was no descent direction
    _remember(b, x_new - b.x, g_new - b.g, done)
    done |= b.f - f_new <= ftol * np.maximum(np.maximum(np.abs(b.f), np.abs(f_new)), 1.0)
    b.x, b.f, b.g = x_new, f_new, g_new
    new = done & ~b.dead
    if new.any():
        x_out[b.ids[new]], f_out[b.ids[new]] = b.x[new], b.f[new]
        b.dead |= new
    if b.dead.all():
        return True
    if b.dead.sum() > 0.25 * b.dead.size:
        b.drop_dead()
    return False


def _direction(b: _Batch, pg: np.ndarray, fixed: np.ndarray, done: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (d (S, P), slope g'd (S,)): the L-BFGS search direction of every problem (two-loop recursion).

    Where that is not a descent direction the problem's history is forgotten and it takes the
    normalised steepest-descent step instead.
    """
    m = b.rho.shape[0]
    q = pg.copy()
    order = [(b.slot - 1 - j) % m for j in range(m)]    # newest pair first
    alph = np.empty((m, b.ids.size))
    for j in order:
        a = b.rho[j] * np.einsum("sp,sp->s", b.s_hist[j], q)
        alph[j] = a
        q -= a[:, None] * b.y_hist[j]
    pgn = np.linalg.norm(pg, axis=1)
    q *= np.where(b.gamma > 0, b.gamma, 1.0 / np.maximum(pgn, 1e-300))[:, None]
    for j in reversed(order):
        beta = b.rho[j] * np.einsum("sp,sp->s", b.y_hist[j], q)
        q += (alph[j] - beta)[:, None] * b.s_hist[j]
    d = np.where(fixed, 0.0, -q)
    slope = np.einsum("sp,sp->s", b.g, d)
    bad = ~(slope < 0) & ~done
    if bad.any():
        b.rho[:, bad] = 0.0
        b.gamma[bad] = 0.0
        d[bad] = -pg[bad] / np.maximum(pgn[bad], 1e-300)[:, None]
        slope[bad] = np.einsum("sp,sp->s", b.g[bad], d[bad])
    return d, slope


def _backtrack(fg: Objective, b: _Batch, d: np.ndarray, slope: np.ndarray, done: np.ndarray, lower: np.ndarray,
               upper: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (x, f, g, t, pending) after a backtracking Armijo line search along the projected path.

    Problems whose search accepted a step carry the new point; the others keep the old one and are
    `pending` (their search failed). `t` is each problem's last step length.
    """
    t = np.ones(b.ids.size)
    x_new, f_new, g_new = b.x.copy(), b.f.copy(), b.g.copy()
    pending = ~done & (slope < 0)
    for _ in range(_BACKTRACKS):
        pi = np.flatnonzero(pending)
        if pi.size == 0:
            break
        xt = np.clip(b.x[pi] + t[pi, None] * d[pi], lower, upper)
        ft, gt = fg(xt, b.ids[pi])
        ok = np.isfinite(ft) & np.isfinite(gt).all(1) & \
            (ft <= b.f[pi] + _ARMIJO * np.einsum("sp,sp->s", b.g[pi], xt - b.x[pi]))
        acc = pi[ok]
        x_new[acc], f_new[acc], g_new[acc] = xt[ok], ft[ok], gt[ok]
        pending[acc] = False
        # next trial: minimiser of the quadratic through f(0), f'(0), f(t), kept in [0.1 t, 0.5 t]
        rej = pi[~ok]
        tr, sl = t[rej], slope[rej]
        curv = np.where(np.isfinite(ft[~ok]), ft[~ok] - b.f[rej] - sl * tr, np.inf)
        t_q = -sl * tr * tr / (2.0 * np.maximum(curv, 1e-300))
        t[rej] = np.clip(np.nan_to_num(t_q, nan=0.1 * tr, posinf=0.5 * tr), 0.1 * tr, 0.5 * tr)
    return x_new, f_new, g_new, t, pending


def _expand(fg: Objective, b: _Batch, d: np.ndarray, slope: np.ndarray, full_step: np.ndarray, t: np.ndarray,
            x_new: np.ndarray, f_new: np.ndarray, g_new: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> None:
    """Return None after growing the accepted steps that were still steep, updating x_new, f_new, g_new, t.

    Where the first trial (t = 1) was accepted but the slope there is still steep (the weak Wolfe
    curvature condition fails, e.g. on the linear arms of the Huber loss), longer steps (x4) are tried
    while they keep lowering f.
    """
    grow = full_step & (np.einsum("sp,sp->s", g_new, d) < _WOLFE * slope)
    for _ in range(_EXPANSIONS):
        pi = np.flatnonzero(grow)
        if pi.size == 0:
            break
        t[pi] *= 4.0
        xt = np.clip(b.x[pi] + t[pi, None] * d[pi], lower, upper)
        ft, gt = fg(xt, b.ids[pi])
        ok = np.isfinite(ft) & np.isfinite(gt).all(1) & (ft < f_new[pi]) & \
            (ft <= b.f[pi] + _ARMIJO * np.einsum("sp,sp->s", b.g[pi], xt - b.x[pi]))
        acc = pi[ok]
        x_new[acc], f_new[acc], g_new[acc] = xt[ok], ft[ok], gt[ok]
        grow[pi[~ok]] = False
        grow[acc] = np.einsum("sp,sp->s", gt[ok], d[acc]) < _WOLFE * slope[acc]


def _remember(b: _Batch, sv: np.ndarray, yv: np.ndarray, done: np.ndarray) -> None:
    """Return None after storing this step's curvature pair (s, y) in the next history slot.

    A pair counts only when s'y > 0 (relative to |s||y|), so the inverse Hessian stays positive definite;
    others are stored with rho = 0, which the two-loop recursion skips.
    """
    sy = np.einsum("sp,sp->s", sv, yv)
    yy = np.einsum("sp,sp->s", yv, yv)
    good = ~done & np.isfinite(sy) & np.isfinite(yy) & (yy > 0) & \
        (sy > 1e-10 * np.sqrt(yy * np.einsum("sp,sp->s", sv, sv)))
    b.rho[b.slot] = np.where(good, 1.0 / np.where(good, sy, 1.0), 0.0)
    b.s_hist[b.slot] = sv
    b.y_hist[b.slot] = yv
    b.gamma = np.where(good, sy / np.where(good, yy, 1.0), b.gamma)
    b.slot = (b.slot + 1) % b.rho.shape[0]
