"""Run tables for the laws: a pandas DataFrame or a mapping of equal-length arrays, validated per law.

Chinchilla takes ``n`` or ``n_once`` + ``n_rec`` (summed); the phi law takes ``n_once, n_rec, loops, tokens,
loss``; the truncation law adds ``backward_loops``. ``loops`` may be fractional (mean of a sampled loop
count). Every check raises ValueError naming the column, the value, the row and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

_COLUMNS = {
    "chinchilla": ("n", "tokens", "loss"),
    "phi": ("n_once", "n_rec", "loops", "tokens", "loss"),
    "truncation": ("n_once", "n_rec", "loops", "backward_loops", "tokens", "loss"),
}


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
    """Return None when `ok` holds on every row, else raise ValueError naming the first row where it fails."""
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
        """Return the columns the table holds, by name (the inputs a LawFit records)."""
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
