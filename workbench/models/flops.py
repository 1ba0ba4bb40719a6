"""Training FLOPs per token of a looped LM: the one formula `LoopLM`, the laws and the budgets share (SPEC §2).

A weight costs 2 FLOPs per token forward and 4 backward. The once-run layers (prelude, coda) always
run both ways; the core runs forward `r` times and backward only through the last `k` loops under
truncated BPTT:

    6 N_once + 2 N_rec r + 4 N_rec k

Optional terms, each counted the same way (forward 2, backward 4, core occurrences r and k times):
- attention scores and weighted values, both full T x T products as Hoffmann et al. 2022 (appendix F)
  count them: `4 seq_len d_model` per token and layer occurrence forward (twice Kaplan et al. 2020's
  causal count), i.e. `a = 2 seq_len d_model` counted like a parameter: `6 a L_once + (2 r + 4 k) a L_core`
  (what torch's FlopCounterMode counts under the math attention kernel, tests/test_model.py);
- the LM head: `6 d_model V` (its parameters are excluded from N_once and N_rec by default, SPEC §1).
Every argument may be a number or a numpy array; arrays broadcast (e.g. a grid of loop counts).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import fail


def _array(name: str, value: Any, lo: float, allowed: str) -> np.ndarray:
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        fail(name, value, allowed)
    if np.asarray(value).dtype == bool or not np.all(np.isfinite(a)) or np.any(a < lo):
        fail(name, value, allowed)
    return a


def flops_per_token(n_once: Any, n_rec: Any, loops: Any, backward_loops: Any = None, *,
                    seq_len: Any = None, d_model: Any = None, layers_once: Any = 0, layers_rec: Any = 0,
                    head_params: Any = 0) -> np.ndarray | np.float64:
    """Return training FLOPs per token, 6 N_once + 2 N_rec r + 4 N_rec k (+ attention, + head), broadcast over arrays.

    `backward_loops` k defaults to r (full BPTT) and must lie in [1, r]; r may be fractional (the mean of
    a sampled loop count). Attention is added when `seq_len` is given (then `d_model` is required), over
    `layers_once` prelude + coda layers and `layers_rec` core layers; `head_params` (d_model * V) adds 6 per
    parameter. A numpy float64 when every input is a number, else an array of the broadcast shape.
    """
    n_once = _array("n_once", n_once, 0, "must be a finite count >= 0 (or an array of them)")
    n_rec = _array("n_rec", n_rec, 0, "must be a finite count >= 0 (or an array of them)")
    r = _array("loops", loops, 1, "must be a finite loop count >= 1 (or an array of them)")
    k = r if backward_loops is None else _array("backward_loops", backward_loops, 1,
                                                "must be None or a finite loop count >= 1 (or an array of them)")
    if np.any(k > r):
        fail("backward_loops", backward_loops, f"must be <= loops={loops!r} (only loops that ran get gradient)")
    total = 6.0 * n_once + 2.0 * n_rec * r + 4.0 * n_rec * k
    if seq_len is not None:
        if d_model is None:
            fail("d_model", d_model, "must be given with seq_len (the attention term is 2 seq_len d_model)")
        a = 2.0 * _array("seq_len", seq_len, 1, "must be a finite length >= 1") \
            * _array("d_model", d_model, 1, "must be a finite width >= 1")
        total = (total + 6.0 * a * _array("layers_once", layers_once, 0, "must be a layer count >= 0")
                 + (2.0 * r + 4.0 * k) * a * _array("layers_rec", layers_rec, 0, "must be a layer count >= 0"))
    total = total + 6.0 * _array("head_params", head_params, 0, "must be a parameter count >= 0")
    return total[()] if isinstance(total, np.ndarray) and total.ndim == 0 else total
