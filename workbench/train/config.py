"""TrainConfig: how to train (budget, batch, loop sampling, backprop depth, optimiser, schedule, checkpoints).

Every field is checked at construction, types first, naming the field, the value and what is allowed.
RESUME_FIELDS are the fields that decide a run's trajectory: a resumed run must keep them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from ..config import LoopConfig, check_bool, check_choice, check_float, check_int, fail, from_fields, strict_json
from ..models.precision import check_precision

SCHEDULES = ("cosine", "wsd", "constant")
LOOP_SAMPLERS = ("fixed", "uniform", "poisson_lognormal")
# TrainConfig fields that decide the trajectory: a resumed run must keep them (the budget, evaluation,
# checkpointing, device and display may change)
RESUME_FIELDS = ("seed", "batch_size", "seq_len", "loop_sampler", "loops", "loop_min", "loop_max", "loop_sigma",
                 "backward_loops", "lr", "min_lr_ratio", "warmup", "schedule", "decay_frac", "weight_decay",
                 "grad_clip", "muon", "loop1_distill")
METRICS = ("loss", "lr", "grad_norm", "tokens_per_s", "loops", "backward_loops", "step_s", "compiled")
PROGRESS_EVERY_S = 1.0  # progress.json is rewritten at most this often (workbench run reads it live)
CHANCE_STEPS = 50  # past warmup, this many steps in a row ...
CHANCE_FRACTION = 0.95  # ... with the loss above this share of ln(vocab_size) get a warning


@dataclass(frozen=True)
class TrainConfig:
    """How to train: budget, batch, loop sampling, backprop depth, optimiser, schedule, checkpoints."""

    steps: int | None = None  # one of steps / tokens / flops / chinchilla sets the budget
    tokens: int | None = None
    flops: float | None = None
    chinchilla: bool = False  # 20 tokens per non-embedding parameter
    batch_size: int = 16
    seq_len: int = 128
    loop_sampler: str = "fixed"
    loops: int | None = None  # fixed r (default: the model's K)
    loop_min: int = 1
    loop_max: int | None = None
    loop_sigma: float = 0.5
    backward_loops: int | None = None  # k (default: full BPTT)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 10
    schedule: str = "cosine"
    decay_frac: float = 0.2  # share of steps in the final decay of warmup-stable-decay
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    muon: bool = True
    eval_every: int = 0
    eval_loops: tuple[int, ...] | None = None  # default: below, at and beyond K
    eval_batches: int = 4
    checkpoint_every: int = 0  # also checkpoint every this many steps (0: by time only)
    checkpoint_seconds: float = 300.0  # checkpoint when this long has passed since the last one (0: off)
    keep_checkpoints: int = 1
    save_frozen: bool = True  # False: checkpoints keep only what trains (a retrofit over a base it rebuilds)
    seed: int = 0
    device: str | None = None
    bf16: str = "auto"  # auto: bf16 autocast where the device does bf16 fast (models.precision); on; off
    compile: str = "auto"  # auto: compile the blocks when the run is long enough to repay a first compile of
    # about a minute (training FLOPs >= COMPILE_AUTO_FLOPS) and, on a CPU, only for bf16 training (compile_pays); on; off
    progress: bool = True
    loop1_distill: float = 0.0  # weight of KL(frozen reference || model) on loop-1 next-token distributions (0: off)

    def __post_init__(self) -> None:
        # every field is checked here, types first (bools are bools, numbers finite), before any training
        self._check_types()
        self._check_ranges()
        self._check_together()

    def _check_types(self) -> None:
        """Return None after checking the integer, boolean, precision and device fields (else fail naming one)."""
        for name in ("batch_size", "seq_len", "loop_min", "eval_batches", "keep_checkpoints"):
            check_int(_f(name), getattr(self, name), 1)
        for name in ("steps", "tokens", "loops", "loop_max", "backward_loops"):
            if getattr(self, name) is not None:
                check_int(_f(name), getattr(self, name), 1, allowed="must be None or an integer >= 1")
        for name in ("warmup", "eval_every", "checkpoint_every", "seed"):
            check_int(_f(name), getattr(self, name), 0)
        for name in ("chinchilla", "muon", "progress", "save_frozen"):
            check_bool(_f(name), getattr(self, name))
        for name in ("bf16", "compile"):  # True / False / None (configs written before "auto") mean on / off / auto
            object.__setattr__(self, name, check_precision(_f(name), getattr(self, name)))
        if self.device is not None:
            if not isinstance(self.device, str):
                fail(_f("device"), self.device, "must be None or a torch device name such as 'cpu' or 'cuda:0'")
            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                fail(_f("device"), self.device, "must be None or a torch device name such as 'cpu' or 'cuda:0'")

    def _check_ranges(self) -> None:
        """Return None after checking the choices, the real-valued fields and eval_loops (else fail naming one)."""
        check_choice(_f("schedule"), self.schedule, SCHEDULES)
        check_choice(_f("loop_sampler"), self.loop_sampler, LOOP_SAMPLERS)
        if self.flops is not None:
            check_float(_f("flops"), self.flops, 0, lo_open=True, allowed="must be None or a finite number > 0")
        check_float(_f("lr"), self.lr, 0, lo_open=True)
        check_float(_f("min_lr_ratio"), self.min_lr_ratio, 0, 1)
        check_float(_f("decay_frac"), self.decay_frac, 0, 1, lo_open=True)
        check_float(_f("loop_sigma"), self.loop_sigma, 0, lo_open=True)
        check_float(_f("weight_decay"), self.weight_decay, 0)
        check_float(_f("loop1_distill"), self.loop1_distill, 0,
                    allowed="must be a finite number >= 0 (the weight of the loop-1 distillation term; 0: off)")
        check_float(_f("grad_clip"), self.grad_clip, 0, allowed="must be a finite number >= 0 (0: no clipping)")
        check_float(_f("checkpoint_seconds"), self.checkpoint_seconds, 0,
                    allowed="must be a finite number >= 0 (0: no checkpoints by time)")
        if self.eval_loops is not None:
            if isinstance(self.eval_loops, (str, bytes)) or not isinstance(self.eval_loops, (list, tuple)) \
                    or not self.eval_loops:
                fail(_f("eval_loops"), self.eval_loops, "must be None or a non-empty list of integers >= 1")
            for i, r in enumerate(self.eval_loops):
                check_int(_f(f"eval_loops[{i}]"), r, 1, allowed="must be an integer >= 1 (a loop count)")
            object.__setattr__(self, "eval_loops", tuple(int(r) for r in self.eval_loops))  # JSON gives a list

    def _check_together(self) -> None:
        """Return None after checking the fields that constrain each other: one budget, loop_max, k <= r."""
        budgets = {"steps": self.steps, "tokens": self.tokens, "flops": self.flops,
                   "chinchilla": self.chinchilla or None}
        if sum(v is not None for v in budgets.values()) != 1:
            raise ValueError("TrainConfig needs exactly one budget: steps, tokens, flops or chinchilla=True "
                             f"(got steps={self.steps}, tokens={self.tokens}, flops={self.flops}, "
                             f"chinchilla={self.chinchilla})")
        if self.loop_max is not None and self.loop_max < self.loop_min:
            fail(_f("loop_max"), self.loop_max, f"must be >= loop_min={self.loop_min}")
        if self.loop_sampler == "fixed" and self.loops is not None and self.backward_loops is not None \
                and self.backward_loops > self.loops:
            fail(_f("backward_loops"), self.backward_loops, f"must be <= loops={self.loops} (k <= r)")

    def to_json(self) -> str:
        """Return the config as a JSON string."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """Return the config described by a dict, rejecting a non-mapping and unknown keys by name."""
        return from_fields(cls, data)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        """Return the config encoded by `to_json`."""
        return cls.from_dict(strict_json(text))


def _f(name: str) -> str:
    """Return the name a TrainConfig field has in error messages."""
    return f"TrainConfig.{name}"


def max_train_loops(tc: TrainConfig, K: int) -> int | None:
    """Return the most loops one training step can run under tc's sampler (None: the sampler has no bound)."""
    if tc.loop_sampler == "fixed":
        return tc.loops or K
    if tc.loop_sampler == "uniform":
        return tc.loop_max or 2 * K
    return tc.loop_max


def history_reach(loops: int) -> int:
    """Return the most history lags an r-loop pass uses: loop t (0-based) sees min(w, t - 1) past states (SPEC §1)."""
    return max(loops - 2, 0)


def check_history_trains(cfg: LoopConfig, tc: TrainConfig) -> None:
    """Return None if every history lag of a model trained from scratch under tc can receive a gradient; else fail.

    Loop t (0-based) sees m_t = min(w, t - 1) past states (SPEC §1), so an r-loop step reaches lags 1..r-2
    at most. Lags past that stay at their zero init: at K = 4, w = 4 trains the same model as w = 2, bit for
    bit (docs/findings.md, dense history windows), and a comparison of the two measures nothing.
    """
    r = max_train_loops(tc, cfg.loops)
    if cfg.history and r is not None and cfg.history > history_reach(r):
        reach = f"<= {history_reach(r)}" if history_reach(r) else "0"
        fail("LoopConfig.history", cfg.history,
             f"must be {reach} when training runs at most {r} loops: loop t sees min(w, t - 1) past states, "
             f"so lags above {history_reach(r)} would never get a gradient and stay zero; lower history or train "
             f"with more loops (loops >= {cfg.history + 2})")


def check_fit(cfg: LoopConfig, tc: TrainConfig) -> None:
    """Return None if the train config fits the model (sequence length, loop counts); else fail naming the field."""
    if tc.seq_len > cfg.max_seq_len:
        fail("TrainConfig.seq_len", tc.seq_len, f"must be <= LoopConfig.max_seq_len={cfg.max_seq_len} (rotary "
             "positions are built up to it)")
    r = tc.loops or cfg.loops
    if tc.loop_sampler == "fixed" and tc.backward_loops is not None and tc.backward_loops > r:
        fail("TrainConfig.backward_loops", tc.backward_loops, f"must be <= loops={r} (k <= r)")
