"""Seeds as the unit of replication: t intervals over per-seed means, Holm's correction, verdicts.

A comparison between two training settings is replicated over seeds: each seed trains both arms (sharing a
tokenizer, so losses share units), each seed gives one number (for example the mean over held-out windows of
the paired per-window difference), and the interval is a Student t interval over those per-seed numbers. With
three seeds a percentile bootstrap over seeds cannot reach its nominal coverage (it can only ever draw 10
distinct resamples); the t interval does when the per-seed numbers are roughly normal, which a mean over many
windows is (`tests/test_stats.py` checks its coverage on planted data).

A section that makes m comparisons corrects for them: `holm` adjusts the p-values, and `simultaneous`
widens each interval to level 1 - alpha / m (Bonferroni), so every interval printed beside a verdict holds
jointly. `verdict` reads "replicates" only from such a corrected interval excluding zero in the paper's
direction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import check_float, fail

ALPHA = 0.05


@dataclass(frozen=True)
class SeedInterval:
    """A mean over seeds with its t interval, the test of mean = 0 and how many seeds it rests on."""

    mean: float
    low: float
    high: float
    p: float  # two-sided, one-sample t test of mean = 0
    n: int  # seeds
    level: float

    def excludes_zero(self) -> bool:
        """Return True if the interval lies strictly on one side of zero."""
        return bool(self.low > 0 or self.high < 0)


def _seed_values(values: Any, name: str) -> np.ndarray:
    """Return per-seed values as a finite 1-D float array (at least 2 of them), or raise naming `name`."""
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size < 2:
        fail(name, list(v), "must hold at least 2 per-seed values (an interval over seeds needs 2 or more; "
             "train 3 seeds per arm)")
    if not np.all(np.isfinite(v)):
        fail(name, list(v), "must be finite numbers (a run diverged or a value is missing)")
    return v


def seed_interval(values: Any, level: float = 1 - ALPHA) -> SeedInterval:
    """Return the mean of per-seed `values` with its two-sided Student t interval at `level` and p of mean = 0."""
    from scipy import stats

    check_float("level", level, 0, 1, lo_open=True, hi_open=True, allowed="must be a number with 0 < level < 1")
    v = _seed_values(values, "values")
    n, mean = v.size, float(v.mean())
    se = float(v.std(ddof=1)) / np.sqrt(n)
    if se == 0:  # every seed gave the same number: the interval is that point (a difference of a run with itself)
        return SeedInterval(mean, mean, mean, 1.0 if mean == 0 else 0.0, n, level)
    q = float(stats.t.ppf(0.5 + level / 2, n - 1))
    p = float(2 * stats.t.sf(abs(mean) / se, n - 1))
    return SeedInterval(mean, mean - q * se, mean + q * se, p, n, level)


def paired_seed_interval(a: Any, b: Any, level: float = 1 - ALPHA) -> SeedInterval:
    """Return the seed interval of mean(a - b): per seed (rows) the mean over windows (columns) of the paired difference.

    `a` and `b` are [seeds, windows] arrays in the same order (seed i of `a` read the same windows as seed i
    of `b`); the windows are averaged within a seed, so the interval's spread is the seeds'.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or a.shape != b.shape:
        fail("a, b", f"shapes {a.shape} and {b.shape}", "must be equal [seeds, windows] arrays")
    return seed_interval((a - b).mean(axis=1), level)


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Return Holm's step-down adjusted p-values (same order); reject where adjusted p < alpha, family-wise."""
    p = np.asarray(pvalues, dtype=np.float64)
    if p.ndim != 1 or not np.all((p >= 0) & (p <= 1)):
        fail("pvalues", list(np.ravel(p)), "must be a list of numbers in [0, 1]")
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out


def simultaneous(values: Any, m: int, alpha: float = ALPHA) -> SeedInterval:
    """Return the seed interval at level 1 - alpha / m: with m such intervals all hold at once with prob. >= 1 - alpha."""
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        fail("m", m, "must be an integer >= 1 (the number of comparisons in the family)")
    return seed_interval(values, 1 - alpha / m)


def verdict(corrected: SeedInterval, direction: int) -> str:
    """Return "replicates", "opposite" or "inconclusive" for a corrected interval and the paper's sign (+1 or -1)."""
    if direction not in (1, -1):
        fail("direction", direction, "must be +1 (the paper's effect is positive) or -1 (negative)")
    if corrected.n < 3:
        return "inconclusive"  # the standard: at least 3 seeds per arm before a verdict
    if corrected.excludes_zero():
        return "replicates" if np.sign(corrected.mean) == direction else "opposite"
    return "inconclusive"


def equivalence_verdict(corrected: SeedInterval, margin: float) -> str:
    """Return "replicates", "opposite" or "inconclusive" for a paper's claim of no difference beyond `margin`.

    "replicates" when the corrected interval lies within [-margin, margin] (two one-sided tests, each at least as
    strict as its level), "opposite" when it lies wholly outside that band (a difference larger than the paper
    allows), else "inconclusive"; fewer than 3 seeds are always "inconclusive".
    """
    check_float("margin", margin, 0, lo_open=True, allowed="must be a number > 0 (the paper's largest change)")
    if corrected.n < 3:
        return "inconclusive"
    if -margin <= corrected.low and corrected.high <= margin:
        return "replicates"
    if corrected.low > margin or corrected.high < -margin:
        return "opposite"
    return "inconclusive"


def correct_family(rows: list[dict], m: int | None = None) -> None:
    """Return None after giving each row of one family its Holm p (`p_holm`), Bonferroni interval (`corrected`),
    `verdict` and family size `m`.

    A row holds its per-seed `values`, their `ci` (`seed_interval`) and the paper's `sign` (+1, -1; 0 for a
    claim of no difference, which gets the plain interval and the verdict "no direction"). `m` is the family's
    size fixed before the runs (default: its directed rows); rows not yet measurable count as p = 1 in Holm.
    """
    directed = [r for r in rows if r["sign"]]
    m = len(directed) if m is None else m
    if m < len(directed):
        fail("m", m, f"must be at least the family's {len(directed)} directed rows")
    for r, p_adj in zip(directed, holm([r["ci"].p for r in directed] + [1.0] * (m - len(directed)))):
        c = simultaneous(r["values"], m)
        r.update(p_holm=float(p_adj), corrected=c, verdict=verdict(c, r["sign"]), m=m)
    for r in rows:
        if not r["sign"]:
            r.update(p_holm=float("nan"), corrected=r["ci"], verdict="no direction", m=m)


def claim_variables(rows: list[dict], dim: str = "comparison") -> dict:
    """Return the xarray data variables {name: (dim, values)} of corrected claim rows (`correct_family`'s):
    difference, low, high, p, p_holm, seeds, low_corrected, high_corrected, verdict, family_size."""
    return {"difference": (dim, [r["ci"].mean for r in rows]), "low": (dim, [r["ci"].low for r in rows]),
            "high": (dim, [r["ci"].high for r in rows]), "p": (dim, [r["ci"].p for r in rows]),
            "p_holm": (dim, [r["p_holm"] for r in rows]), "seeds": (dim, [r["ci"].n for r in rows]),
            "low_corrected": (dim, [r["corrected"].low for r in rows]),
            "high_corrected": (dim, [r["corrected"].high for r in rows]),
            "verdict": (dim, [r["verdict"] for r in rows]), "family_size": (dim, [r["m"] for r in rows])}
