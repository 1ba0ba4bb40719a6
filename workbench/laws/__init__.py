"""Scaling-law fits for looped LMs: Chinchilla Approach 3, recurrence equivalence (phi), truncation, test time.

Formulas (SPEC section 4)
-------------------------
- Chinchilla (Hoffmann et al. 2022, Approach 3; Besiroglu et al. 2024): ``L = E + A / N^alpha + B / D^beta``.
- Recurrence equivalence: ``L = E + A (N_once + r^phi N_rec)^(-alpha) + B D^(-beta)``, phi in [0, 1.5].
- Truncated BPTT: ``N_eff(r, k) = N_once + (k^phi + psi (r^phi - k^phi)) N_rec``, psi in [0, 1].
- Test-time loops (Parcae): ``L(T) = L_inf + Z exp(-z T)`` per model.

One concept per module
----------------------
- ``table``: run tables (a DataFrame or a mapping of equal-length arrays), validated per law.
- ``objective``: the LSE laws in numbers: parametrisation, Huber objective and gradient, the start grid.
- ``_lbfgs``: the batched projected L-BFGS that runs every start of the grid at once.
- ``fit``: ``LawFit`` and the LSE fits: grid search, scipy polish, bootstrap intervals, ``identified``.
- ``test_time``: the test-time law and its fit.
- ``allocation``: compute-optimal allocation under a fitted law.

Each module's docstring states its choices; the names below are the public face.
"""

from ..models.flops import flops_per_token  # the one formula (SPEC §2), shared with LoopLM
from .allocation import Allocation, LoopSetting, chinchilla_optimal, optimal_allocation, optimal_setting
from .fit import LawFit, fit_chinchilla, fit_phi, fit_truncation
from .objective import HUBER_DELTA, huber_objective, start_grid
from .test_time import fit_test_time

__all__ = [
    "HUBER_DELTA", "LawFit", "Allocation", "fit_chinchilla", "fit_phi", "fit_truncation", "fit_test_time",
    "chinchilla_optimal", "optimal_allocation", "optimal_setting", "LoopSetting", "huber_objective", "start_grid",
    "flops_per_token",
]
