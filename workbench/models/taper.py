"""MLP width schedules over the physical layers with an exact total budget (SPEC §1, tapered widths)."""

from __future__ import annotations

import math


def _raw_widths(n_layers: int, mean: float, schedule: str, start: float, end: float) -> list[float]:
    if schedule == "uniform" or n_layers == 1:
        return [float(mean)] * n_layers
    d_start, d_end = start * mean, end * mean
    w = [d_end + (d_start - d_end) * (1 + math.cos(math.pi * l / (n_layers - 1))) / 2
         for l in range(n_layers)]
    if schedule == "cosine":
        return w
    if schedule == "reverse":
        return w[::-1]
    raise ValueError(f"taper schedule={schedule!r} is invalid: must be one of uniform, cosine, reverse")


def mlp_widths(n_layers: int, mean: int, schedule: str = "uniform", multiple: int = 1,
               start: float = 1.5, end: float = 0.5) -> list[int]:
    """Return per-layer MLP widths: monotone, multiples of `multiple`, summing to n_layers * mean exactly.

    Widths follow d_ff(l) = d_end + (d_start - d_end) (1 + cos(pi l / (L-1))) / 2 (reverse: mirrored),
    are rounded to the nearest multiple, then the sum is repaired one `multiple` at a time on the layer
    whose rounding error points that way most, never breaking monotonicity (the project's choice).
    """
    if n_layers < 1:
        raise ValueError(f"n_layers={n_layers} is invalid: must be >= 1")
    if mean % multiple:
        raise ValueError(f"mean={mean} is invalid: must be a multiple of multiple={multiple}")
    if abs(start + end - 2.0) > 1e-12:
        raise ValueError(f"start={start}, end={end} are invalid: start + end must equal 2 for an exact budget")
    raw = _raw_widths(n_layers, mean, schedule, start, end)
    out = [max(multiple, multiple * round(w / multiple)) for w in raw]
    decreasing = raw[0] >= raw[-1]
    excess = sum(out) - n_layers * mean  # a multiple of `multiple`

    def ok(i: int, new: int) -> bool:
        # the change keeps the sequence monotone in its direction and every width >= multiple
        if new < multiple:
            return False
        left = out[i - 1] if i > 0 else None
        right = out[i + 1] if i < n_layers - 1 else None
        if decreasing:
            return (left is None or left >= new) and (right is None or new >= right)
        return (left is None or left <= new) and (right is None or new <= right)

    while excess != 0:
        step = -multiple if excess > 0 else multiple
        # prefer the layer rounded furthest in the direction we must move back
        order = sorted(range(n_layers), key=lambda i: (raw[i] - out[i]) * (1 if step > 0 else -1),
                       reverse=True)
        for i in order:
            if ok(i, out[i] + step):
                out[i] += step
                excess += step
                break
        else:  # cannot happen for a monotone sequence (an end layer can always move), kept as a guard
            raise RuntimeError(f"cannot repair taper budget for widths {out}")
    return out
