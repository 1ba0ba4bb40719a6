"""LoopConfig: the one description of a looped model's architecture, validated at construction.

Also the library's argument checks (`fail`, `check_int`, `check_float`, `check_bool`, `check_choice`):
they live here, in the lowest room, so every module (models included) raises the same message,
"<field>=<value!r> is invalid: <what is allowed>".
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

INJECT = ("none", "scalar", "channel", "dense", "stable", "bridge")
HISTORY_OPS = ("scalar", "channel", "dense")
TIMESTEP = ("none", "loop_gate", "branch_gate", "adaln")
TAPER = ("uniform", "cosine", "reverse")


# ---- argument checks, shared by the whole library ------------------------------------------------------
def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    """Return the object of a JSON mapping's pairs; ValueError naming a key given twice (json keeps the last)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r} (given twice; only one value can hold)")
        out[k] = v
    return out


def strict_json(text: str) -> Any:
    """Return the parsed JSON text; ValueError for invalid JSON or an object with a key given twice."""
    return json.loads(text, object_pairs_hook=_no_duplicates)


def from_fields(cls, data: Any):
    """Return cls(**data) for a config dataclass, rejecting a non-mapping and unknown keys by name."""
    if not isinstance(data, dict):
        fail(cls.__name__, data, f"must be a mapping of {cls.__name__} fields (a JSON object)")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; known fields: {sorted(known)}")
    return cls(**data)


def fail(field: str, value: Any, allowed: str) -> NoReturn:
    """Raise ValueError "<field>=<value!r> is invalid: <allowed>"; never returns."""
    raise ValueError(f"{field}={value!r} is invalid: {allowed}")


def check_int(field: str, value: Any, lo: int | None = None, hi: int | None = None, *,
              allowed: str | None = None) -> int:
    """Return value as an int if it is an integer (not a bool; numpy integers count) in [lo, hi], else fail."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        ok = False
    if not ok:
        if allowed is None:
            allowed = ("must be an integer" + (f" in {lo}..{hi}" if lo is not None and hi is not None else
                                               f" >= {lo}" if lo is not None else
                                               f" <= {hi}" if hi is not None else ""))
        fail(field, value, allowed)
    return int(value)


def check_float(field: str, value: Any, lo: float | None = None, hi: float | None = None, *,
                finite: bool = True, lo_open: bool = False, hi_open: bool = False,
                allowed: str | None = None) -> float:
    """Return value as a float if it is a real number (not a bool, never NaN; finite unless finite=False)
    within the bounds (inclusive unless lo_open / hi_open), else fail."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        v = float(value)
        ok = not math.isnan(v) and (math.isfinite(v) or not finite)
        if ok and lo is not None:
            ok = v > lo if lo_open else v >= lo
        if ok and hi is not None:
            ok = v < hi if hi_open else v <= hi
    if not ok:
        if allowed is None:
            what = "must be a finite number" if finite else "must be a number"
            if lo is not None and hi is not None:
                what += f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            elif lo is not None:
                what += f" {'>' if lo_open else '>='} {lo}"
            elif hi is not None:
                what += f" {'<' if hi_open else '<='} {hi}"
            allowed = what
        fail(field, value, allowed)
    return float(value)


def check_bool(field: str, value: Any) -> bool:
    """Return value if it is a bool (not 0 / 1 or any other truthy thing), else fail."""
    if not isinstance(value, bool):
        fail(field, value, "must be True or False")
    return value


def check_choice(field: str, value: Any, choices: Iterable[Any]) -> Any:
    """Return value if it is one of choices, else fail listing them."""
    choices = tuple(choices)
    if not any(isinstance(value, bool) == isinstance(c, bool) and value == c for c in choices):  # True != 1 here
        fail(field, value, f"must be one of {', '.join(map(str, choices))}")
    return value


@dataclass(frozen=True)
class LoopConfig:
    """Architecture of a `p + s x K + c` looped LM; every field is validated in `__post_init__`."""

    vocab_size: int = 4096
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    d_ff: int | None = None  # mean SwiGLU width; None: 8/3 * d_model rounded up to a multiple of 64
    prelude: int = 1
    core: int = 2
    coda: int = 1
    loops: int = 4  # K, the training loop count; any r >= 1 may be used at call time
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    sandwich_norm: bool = False
    attn_bias: bool = False
    init_std: float = 0.02
    inject: str = "none"  # "bridge": the retrofit re-entry bridge; it and the adapters skip loop 1 (SPEC §5)
    history: int = 0  # window w of history-state injection; 0 is off
    history_op: str = "scalar"
    timestep: str = "none"
    hyper: int = 1  # hyper-connection expansion n; 1 is off
    hyper_dynamic: bool = False
    taper: str = "uniform"
    taper_multiple: int = 1
    taper_start: float = 1.5  # d_start / mean width
    taper_end: float = 0.5  # d_end / mean width
    adapter_rank: int = 0  # rank of low-rank updates on every core linear (retrofit adapters); 0 is off

    def __post_init__(self) -> None:
        def f(name: str) -> str:
            return f"LoopConfig.{name}"

        for name in ("vocab_size", "d_model", "n_heads", "core", "loops", "max_seq_len", "hyper",
                     "taper_multiple"):
            check_int(f(name), getattr(self, name), 1)
        for name in ("prelude", "coda", "history", "adapter_rank"):
            check_int(f(name), getattr(self, name), 0)
        for name in ("tie_embeddings", "sandwich_norm", "attn_bias", "hyper_dynamic"):
            check_bool(f(name), getattr(self, name))
        if self.adapter_rank > self.d_model:
            fail(f("adapter_rank"), self.adapter_rank, f"must be <= d_model={self.d_model} (a low-rank update)")
        if self.d_model % self.n_heads:
            fail(f("n_heads"), self.n_heads, f"must divide d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            fail(f("n_heads"), self.n_heads,
                 f"head size d_model/n_heads={self.d_model // self.n_heads} must be even for rotary")
        if self.n_kv_heads is not None:
            check_int(f("n_kv_heads"), self.n_kv_heads, 1,
                      allowed=f"must be None or an integer >= 1 dividing n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            fail(f("n_kv_heads"), self.n_kv_heads, f"must be None or an integer >= 1 dividing n_heads={self.n_heads}")
        if self.d_ff is not None:
            check_int(f("d_ff"), self.d_ff, 1, allowed="must be None or an integer >= 1")
        for name, allowed in (("inject", INJECT), ("history_op", HISTORY_OPS),
                              ("timestep", TIMESTEP), ("taper", TAPER)):
            check_choice(f(name), getattr(self, name), allowed)
        for name in ("rope_theta", "norm_eps", "init_std"):
            check_float(f(name), getattr(self, name), 0, lo_open=True)
        check_float(f("taper_start"), self.taper_start, 0, lo_open=True)
        check_float(f("taper_end"), self.taper_end, 0, self.taper_start, lo_open=True,
                    allowed=f"must be > 0 and <= taper_start={self.taper_start}")
        if abs(self.taper_start + self.taper_end - 2.0) > 1e-12:
            fail(f("taper_start"), self.taper_start,
                 f"taper_start + taper_end must equal 2 so the budget is exact (taper_end={self.taper_end})")
        if self.ff_mean % self.taper_multiple:
            fail(f("taper_multiple"), self.taper_multiple, f"must divide the mean MLP width {self.ff_mean}")
        if self.taper != "uniform":
            # the narrowest layer must keep at least one rounding unit
            if self.taper_end * self.ff_mean < self.taper_multiple:
                fail(f("taper_end"), self.taper_end,
                     f"taper_end * d_ff must be >= taper_multiple={self.taper_multiple}")

    @property
    def kv_heads(self) -> int:
        """Return the number of key/value heads (n_heads when n_kv_heads is None)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Return the size of one attention head."""
        return self.d_model // self.n_heads

    @property
    def ff_mean(self) -> int:
        """Return the mean MLP width (d_ff, or 8/3 d_model rounded up to a multiple of 64)."""
        if self.d_ff is not None:
            return self.d_ff
        return -(-(8 * self.d_model) // (3 * 64)) * 64

    @property
    def physical_layers(self) -> int:
        """Return the number of distinct layers p + s + c."""
        return self.prelude + self.core + self.coda

    def effective_depth(self, loops: int | None = None) -> int:
        """Return L(r) = p + r*s + c for r = loops (default: the training loop count K)."""
        r = self.loops if loops is None else loops
        return self.prelude + r * self.core + self.coda

    @property
    def notation(self) -> str:
        """Return the allocation written as `p+sxK+c`, e.g. `2+2x9+0`."""
        return f"{self.prelude}+{self.core}x{self.loops}+{self.coda}"

    def replace(self, **changes: Any) -> "LoopConfig":
        """Return a copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a plain dict."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Return the config as a JSON string (keys sorted, so equal configs give equal strings)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LoopConfig":
        """Return the config described by a dict, rejecting a non-mapping and unknown keys by name."""
        return from_fields(cls, data)

    @classmethod
    def from_json(cls, text: str) -> "LoopConfig":
        """Return the config encoded in a JSON string from `to_json`."""
        return cls.from_dict(strict_json(text))
