"""The LSE laws in numbers: parametrisation, the Huber objective and its gradient, the paper's start grid.

- Chinchilla (Hoffmann et al. 2022, Approach 3; Besiroglu et al. 2024):
  ``L = E + A / N^alpha + B / D^beta``, fitted in the log-sum-exp form
  ``log L_hat = LSE(a - alpha log N, b - beta log D, e)`` with ``E = exp(e)``, ``A = exp(a)``, ``B = exp(b)``.
- Recurrence equivalence: ``L = E + A (N_once + r^phi N_rec)^(-alpha) + B D^(-beta)``, phi in [0, 1.5].
- Truncated BPTT (chosen in SPEC): ``N_eff(r, k) = N_once + (k^phi + psi (r^phi - k^phi)) N_rec``, psi in [0, 1]
  (the worth of a forward-only loop relative to one that gets gradient); phi fitted or fixed.

The objective is ``sum_i Huber_delta(log L_hat_i - log L_i)`` with delta = 1e-3 (quadratic below delta,
linear above). The start grid is the paper's: alpha, beta in {0, 0.5, ..., 2}; e in {-1, -0.5, ..., 1};
a, b in {0, 5, ..., 25} (4,500 starts), times phi in {0, 0.5, 1, 1.5} for the phi law (18,000 starts); the
truncation law adds the single value psi = 0.5 (the middle of its bounded range; psi enters N_eff
linearly) to the phi law's grid, or to the Chinchilla grid when phi is fixed.

Internally the intercepts are centred, ``a' = a - alpha c_N`` and ``b' = b - beta c_D`` (c = mean log N,
mean log D over the runs): the same objective, a linear change of variables that removes most of the
a-alpha and b-beta coupling, so L-BFGS converges in far fewer steps. The objective is divided by delta
(same minimiser, O(1) scale, so the optimisers' tolerances mean something). The objective is evaluated
in cache-sized blocks of parameter rows.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import numpy as np

from .table import _COLUMNS, _Data, _read_table

HUBER_DELTA = 1e-3
_ALPHA_GRID = (0.0, 0.5, 1.0, 1.5, 2.0)
_E_GRID = (-1.0, -0.5, 0.0, 0.5, 1.0)
_AB_GRID = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
_PHI_GRID = (0.0, 0.5, 1.0, 1.5)
_PSI_GRID = (0.5,)
_PHI_BOUNDS = (0.0, 1.5)
_PSI_BOUNDS = (0.0, 1.0)
_CHUNK = 32768        # parameter rows x runs evaluated per block (cache-sized temporaries)


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
        """Return centred internal parameters from the paper's [a, b, e, alpha, beta, ...] (rows are vectors)."""
        t = np.array(theta, dtype=np.float64, copy=True)
        t[..., 0] -= t[..., 3] * self.c_n
        t[..., 1] -= t[..., 4] * self.c_d
        return t

    def to_paper(self, theta: np.ndarray) -> np.ndarray:
        """Return the paper's [a, b, e, alpha, beta, ...] from centred internal parameters (rows are vectors)."""
        t = np.array(theta, dtype=np.float64, copy=True)
        t[..., 0] += t[..., 3] * self.c_n
        t[..., 1] += t[..., 4] * self.c_d
        return t

    def _phi_psi(self, th: np.ndarray):
        """Return (phi (S, 1), psi (S, 1) or None) of internal parameter rows; a fixed phi fills its column."""
        i = 5
        if "phi" in self.names:
            phi = th[:, i:i + 1]
            i += 1
        else:
            phi = np.full((th.shape[0], 1), self.fixed_phi)
        psi = th[:, i:i + 1] if "psi" in self.names else None
        return phi, psi

    def log_size(self, th: np.ndarray, grad: bool = False):
        """Return (centred log effective size (S, n), d/d phi, d/d psi); the derivatives only when grad is set."""
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
        """Return (f (S,), grad (S, P)) for one block of rows; in-place numpy, as this is the fits' hot loop."""
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
        """Return the paper's start grid in paper parameters (rows), with phi / psi grids where they are free."""
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
