"""LoopConfig: the one description of a looped model's architecture, validated at construction."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

INJECT = ("none", "scalar", "channel", "dense", "stable", "bridge")
HISTORY_OPS = ("scalar", "channel", "dense")
TIMESTEP = ("none", "loop_gate", "branch_gate", "adaln")
TAPER = ("uniform", "cosine", "reverse")


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"LoopConfig.{field}={value!r} is invalid: {allowed}")


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
    inject: str = "none"  # "bridge": the retrofit re-entry bridge, skipped on loop 1 (SPEC §5)
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
        for name in ("vocab_size", "d_model", "n_heads", "core", "loops", "max_seq_len", "hyper",
                     "taper_multiple"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(name, v, "must be an integer >= 1")
        for name in ("prelude", "coda", "history", "adapter_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                _fail(name, v, "must be an integer >= 0")
        if self.adapter_rank > self.d_model:
            _fail("adapter_rank", self.adapter_rank, f"must be <= d_model={self.d_model} (a low-rank update)")
        if self.d_model % self.n_heads:
            _fail("n_heads", self.n_heads, f"must divide d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            _fail("n_heads", self.n_heads,
                  f"head size d_model/n_heads={self.d_model // self.n_heads} must be even for rotary")
        kv = self.kv_heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or self.n_heads % kv:
            _fail("n_kv_heads", self.n_kv_heads, f"must be an integer >= 1 dividing n_heads={self.n_heads}")
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or self.d_ff < 1):
            _fail("d_ff", self.d_ff, "must be None or an integer >= 1")
        for name, allowed in (("inject", INJECT), ("history_op", HISTORY_OPS),
                              ("timestep", TIMESTEP), ("taper", TAPER)):
            if getattr(self, name) not in allowed:
                _fail(name, getattr(self, name), f"must be one of {', '.join(allowed)}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                _fail(name, v, "must be a number > 0")
        if not 0 < self.taper_end <= self.taper_start:
            _fail("taper_end", self.taper_end, f"must be > 0 and <= taper_start={self.taper_start}")
        if abs(self.taper_start + self.taper_end - 2.0) > 1e-12:
            _fail("taper_start", self.taper_start,
                  f"taper_start + taper_end must equal 2 so the budget is exact (taper_end={self.taper_end})")
        if self.ff_mean % self.taper_multiple:
            _fail("taper_multiple", self.taper_multiple, f"must divide the mean MLP width {self.ff_mean}")
        if self.taper != "uniform":
            # the narrowest layer must keep at least one rounding unit
            if self.taper_end * self.ff_mean < self.taper_multiple:
                _fail("taper_end", self.taper_end,
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
        """Return the config described by a dict, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"LoopConfig has no field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "LoopConfig":
        """Return the config encoded in a JSON string from `to_json`."""
        return cls.from_dict(json.loads(text))
