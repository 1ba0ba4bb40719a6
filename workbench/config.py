"""LoopConfig: the one description of a looped model's architecture, validated at construction.

Also the library's argument checks (`fail`, `check_int`, `check_float`, `check_bool`, `check_choice`):
they live here, in the lowest room, so every module (models included) raises the same message,
"<field>=<value!r> is invalid: <what is allowed>".

Limits: every size and count has an upper bound, the same on every machine (`LIMITS`, by kind;
`PARAMETERS` names the parameters of each kind). The checks apply them by the parameter's name, so
`check_int("max_loops", 100000, 1)` is refused, naming the limit, before any work. The bounds sit far past
anything trained on a laptop or one GPU and low enough that a slip of three zeros is caught; a researcher
who means more says so with `WORKBENCH_BEYOND_LIMITS=1` in the environment (pipeline kernels and
subprocesses inherit it) or inside `with beyond_limits():`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import numbers
import os
import re
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


# ---- limits: upper bounds on sizes and counts, the same on every machine --------------------------------------
BEYOND_LIMITS_ENV = "WORKBENCH_BEYOND_LIMITS"
# kind -> (upper bound, what a parameter of that kind counts)
LIMITS: dict[str, tuple[float, str]] = {
    "loops": (4096, "a loop count or depth (K, r, k, a swept or evaluated loop count, a history window, a task depth)"),
    "layers": (1024, "layers in a prelude, core or coda"),
    "width": (65536, "a hidden width (d_model, d_ff, an adapter rank)"),
    "heads": (1024, "attention heads"),
    "vocab": (1 << 20, "tokens in a vocabulary"),
    "tokens_per_sequence": (1 << 20, "tokens in a sequence (context, window, generated tokens)"),
    "streams": (64, "hyper-connection streams"),
    "batch": (1 << 16, "sequences in a batch"),
    "count": (1 << 24, "examples, sequences, windows, entities or resamples evaluated"),
    "steps": (1 << 31, "optimiser steps, or an interval in steps"),
    "tokens": (10 ** 15, "training tokens"),
    "flops": (1e27, "training FLOPs"),
    "rate": (10.0, "a learning rate or a loss weight"),
    "processes": (1024, "processes training one run"),
    "seconds": (1e7, "a time in seconds (about 116 days)"),
    "scale": (1e6, "a clip, margin, spread, temperature or weight with no natural bound"),
    "parameters": (1e13, "model parameters"),
    "bytes": (1 << 40, "bytes of text read"),
    "base": (1e12, "a rotary base (rope_theta)"),
}
# parameter name (the last part of a checked field: "TrainConfig.eval_loops[2]" is eval_loops) -> kind
PARAMETERS: dict[str, str] = {
    **dict.fromkeys(("loops", "max_loops", "min_loops", "backward_loops", "loop", "horizon", "loop_min", "loop_max",
                     "eval_loops", "history", "finetune_backward_loops", "k", "interaction_loops", "loop_counts", "depth", "eval_depths",
                     "supervised_depth", "task_depths", "max_up", "max_down"), "loops"),
    **dict.fromkeys(("prelude", "core", "coda", "prelude + core + coda"), "layers"),
    **dict.fromkeys(("d_model", "d_ff", "adapter_rank", "taper_multiple"), "width"),
    **dict.fromkeys(("n_heads", "n_kv_heads"), "heads"),
    **dict.fromkeys(("vocab_size", "top_k"), "vocab"),
    **dict.fromkeys(("seq_len", "max_seq_len", "capacity", "max_new_tokens", "new_tokens", "logits_to_keep"),
                    "tokens_per_sequence"),
    "hyper": "streams",
    **dict.fromkeys(("batch_size", "batch", "eval_batches", "chunk"), "batch"),
    **dict.fromkeys(("n", "n_sequences", "n_task_examples", "n_texts", "n_windows", "n_batches", "n_boot",
                     "bootstrap", "bootstrap_iters", "n_entities", "limit", "num_fewshot", "keep_checkpoints",
                     "distractor_rules", "distractor_facts", "n_train", "n_eval", "n_answers"), "count"),
    **dict.fromkeys(("steps", "warmup", "eval_every", "checkpoint_every", "finetune_steps", "anneal_steps",
                     "inverse_steps", "measure_every", "every", "anneal", "train_steps", "gate_steps"), "steps"),
    "tokens": "tokens",
    "flops": "flops",
    **dict.fromkeys(("lr", "finetune_lr", "weight_decay", "loop1_distill"), "rate"),
    "nproc": "processes",
    "checkpoint_seconds": "seconds",
    **dict.fromkeys(("grad_clip", "margin", "beta", "gate_beta", "std", "temperature", "loop_sigma"), "scale"),
    **dict.fromkeys(("n_once", "n_rec"), "parameters"),
    "n_bytes": "bytes",
    "rope_theta": "base",
}
_BEYOND = contextvars.ContextVar("beyond_limits", default=False)


@contextlib.contextmanager
def beyond_limits():
    """Return a context in which the limits of LIMITS are off (an explicit choice to go past them)."""
    token = _BEYOND.set(True)
    try:
        yield
    finally:
        _BEYOND.reset(token)


def parameter_name(field: str) -> str:
    """Return the parameter a checked field names: "TrainConfig.eval_loops[2]" -> eval_loops, "--max-loops" -> max_loops."""
    name = re.sub(r"\[\d+\]$", "", field.rsplit(": ", 1)[-1]).removeprefix("--").replace("-", "_")
    return name if name in PARAMETERS else name.rsplit(".", 1)[-1]


def limit_of(field: str) -> tuple[float, str] | None:
    """Return (upper bound, what it counts) for a checked field by its parameter name, or None (no limit, or off)."""
    if _BEYOND.get() or os.environ.get(BEYOND_LIMITS_ENV, "") == "1":
        return None
    kind = PARAMETERS.get(parameter_name(field))
    return LIMITS[kind] if kind else None


def check_limit(field: str, value: float, lo: float | None = None, lo_open: bool = False) -> float:
    """Return value if it is within the limit of field's kind (LIMITS; none for other names), else fail naming it.

    `lo` only words the message ("must be in [lo, limit]"); the lower bound is the caller's to check.
    """
    got = limit_of(field)
    if got is None or not value > got[0]:
        return value
    bound, what = got
    shown = int(bound) if float(bound).is_integer() and bound < 1e18 else bound
    where = f"<= {shown}" if lo is None else f"in {'(' if lo_open else '['}{lo}, {shown}]"
    fail(field, value, f"must be {where}: past the workbench's limit on {what}, the same on every "
                       f"machine (set {BEYOND_LIMITS_ENV}=1, or use config.beyond_limits(), to go past it)")


def check_int(field: str, value: Any, lo: int | None = None, hi: int | None = None, *,
              allowed: str | None = None) -> int:
    """Return value as an int if it is an integer (not a bool; numpy integers count) in [lo, hi] and within
    the limit of its kind (LIMITS), else fail."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        ok = False
    if not ok:
        if allowed is None:
            allowed = ("must be an integer" + (f" in {lo}..{hi}" if lo is not None and hi is not None else
                                               f" >= {lo}" if lo is not None else
                                               f" <= {hi}" if hi is not None else ""))
        fail(field, value, allowed)
    check_limit(field, int(value), lo)
    return int(value)


def check_float(field: str, value: Any, lo: float | None = None, hi: float | None = None, *,
                finite: bool = True, lo_open: bool = False, hi_open: bool = False,
                allowed: str | None = None) -> float:
    """Return value as a float if it is a real number (not a bool, never NaN; finite unless finite=False)
    within the bounds (inclusive unless lo_open / hi_open) and the limit of its kind (LIMITS), else fail."""
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
    check_limit(field, float(value), lo, lo_open)
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
        check_float(f("rope_theta"), self.rope_theta, 0, lo_open=True)
        for name in ("norm_eps", "init_std"):  # an epsilon or a weight scale past 1 is a slip, not a choice
            check_float(f(name), getattr(self, name), 0, 1, lo_open=True)
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
