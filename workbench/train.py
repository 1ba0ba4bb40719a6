"""Trainer: full or truncated BPTT through the loops, Muon + AdamW, atomic checkpoints, exact resume, DDP.

Truncation (`backward_loops=k < r`): the first r-k loops run under `torch.no_grad` (no graph, so
memory really falls) and the state entering loop r-k+1 is detached. The prelude still receives
gradient through h0 wherever an initial-state or stable injection feeds h0 into the last k loops;
without injection, a truncated run trains the prelude not at all (its output reaches the loss only
through the detached state).

Loop counts are fixed, uniform in [loop_min, loop_max], or Huginn's Poisson-lognormal
(tau ~ N(log mean - sigma^2/2, sigma), r = 1 + Poisson(e^tau)), drawn from a generator seeded by
(seed, step), so a resumed run replays the same loop counts. With sampled r, k = min(k, r).

A checkpoint is a folder `ckpt-STEP/` holding `model.safetensors`, `optim.safetensors` and
`state.json` (step, sampler position, RNG state, configs, metrics so far); `latest.json` names the
newest complete one and is replaced atomically only after the folder is complete, so a run killed
mid-write resumes from the previous checkpoint.

Nothing is lost and nothing bad is saved: checkpoints come by time (`checkpoint_seconds`, 300 s by
default) as well as by steps, and SIGINT / SIGTERM save one after the current step before acting as
the signal would, so a default run resumes. A non-finite loss or gradient norm (before the update)
or a non-finite parameter or optimiser state (checked before every save) raises `Diverged` naming
the step; the last finite checkpoint stays and latest.json records the failure. A resumed run must
keep its seed, data and the settings in RESUME_FIELDS. A loss at chance level (ln V) for
CHANCE_STEPS steps past warmup is logged (logger "workbench.train") and kept in the metrics' attrs.

Fast where it pays: `bf16="auto"` trains under bf16 autocast where the device does bf16 fast (a CPU
whose flags show AMX-BF16 or AVX512-BF16, a CUDA device with bf16; `models.precision`) and in fp32
elsewhere; weights, optimiser states, the loss and the cross-entropy's softmax stay fp32, so
checkpoints are fp32 and resume bit-exactly. `compile="auto"` compiles each Block (never the loop)
when the run is long enough to repay the first compile (`compile_pays`); steps that compiled are
timed apart. What "auto" chose is recorded in the metrics' attrs, and `out_dir/progress.json` says
live where the run is (`workbench run` shows it).

Data-parallel under torchrun (`torchrun --nproc_per_node N -m workbench.cli train ...`, or a script
that builds a Trainer): the Trainer joins the process group from the environment (`init_distributed`:
NCCL on cuda:LOCAL_RANK, else gloo on the CPU), every rank draws the same global batch and trains on
its slice (batch_size is per rank), DDP averages the gradients, so clipping, Muon and AdamW see the
same gradient and step identically on every rank. Parameters a step leaves without gradient (truncation
without injection, a sampled r below the history window, frozen retrofit weights) are allowed. Rank 0
alone writes checkpoints, metrics and progress; on resume every rank loads the checkpoint rank 0 found.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr
from .config import LoopConfig, check_bool, check_choice, check_float, check_int, fail, from_fields
from .io import holds_run, load_tensors, mark_failed, provenance, read_json, save_netcdf, write_progress
from .models.looped import LoopLM
from .models.precision import autocast, check_precision, precision_name, use_bf16
from .optim import Muon

SCHEDULES = ("cosine", "wsd", "constant")
LOOP_SAMPLERS = ("fixed", "uniform", "poisson_lognormal")
_MUON_SUFFIXES = (".attn.qkv.weight", ".attn.o.weight", ".mlp.gate_up.weight", ".mlp.down.weight")
# TrainConfig fields that decide the trajectory: a resumed run must keep them (the budget, evaluation,
# checkpointing, device and display may change)
RESUME_FIELDS = ("seed", "batch_size", "seq_len", "loop_sampler", "loops", "loop_min", "loop_max", "loop_sigma",
                 "backward_loops", "lr", "min_lr_ratio", "warmup", "schedule", "decay_frac", "weight_decay",
                 "grad_clip", "muon", "loop1_distill")
METRICS = ("loss", "lr", "grad_norm", "tokens_per_s", "loops", "backward_loops", "step_s", "compiled")
PROGRESS_EVERY_S = 1.0  # progress.json is rewritten at most this often (workbench run reads it live)
CHANCE_STEPS = 50  # past warmup, this many steps in a row ...
CHANCE_FRACTION = 0.95  # ... with the loss above this share of ln(vocab_size) get a warning


class Diverged(FloatingPointError):
    """Training produced a non-finite loss, gradient or parameter; `step` is the 1-based step that did it."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


log = logging.getLogger("workbench.train")  # warnings about a run (chance-level loss) go here and to its metrics


def data_fingerprint(tokens) -> str | None:
    """Return a cheap fingerprint of a token array (length and 65,536 evenly spaced values), or None for other data."""
    import hashlib

    if not (isinstance(tokens, np.ndarray) or torch.is_tensor(tokens)):
        return None
    arr = np.asarray(tokens).reshape(-1)
    idx = np.linspace(0, max(len(arr) - 1, 0), num=min(len(arr), 65536)).astype(np.int64)
    sample = np.ascontiguousarray(arr[idx].astype(np.int64))  # hashing all of a large shard would take seconds
    return f"{len(arr)}:{hashlib.sha256(sample.tobytes()).hexdigest()[:16]}"


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
    seed: int = 0
    device: str | None = None
    bf16: str = "auto"  # auto: bf16 autocast where the device does bf16 fast (models.precision); on; off
    compile: str = "auto"  # auto: compile the blocks when the run is long enough to repay a first compile of
    # about a minute (training FLOPs >= COMPILE_AUTO_FLOPS) and, on a CPU, only for bf16 training (compile_pays); on; off
    progress: bool = True
    loop1_distill: float = 0.0  # weight of KL(frozen reference || model) on loop-1 next-token distributions (0: off)

    def __post_init__(self) -> None:
        # every field is checked here, types first (bools are bools, numbers finite), before any training
        def f(name: str) -> str:
            return f"TrainConfig.{name}"

        for name in ("batch_size", "seq_len", "loop_min", "eval_batches", "keep_checkpoints"):
            check_int(f(name), getattr(self, name), 1)
        for name in ("steps", "tokens", "loops", "loop_max", "backward_loops"):
            if getattr(self, name) is not None:
                check_int(f(name), getattr(self, name), 1, allowed="must be None or an integer >= 1")
        for name in ("warmup", "eval_every", "checkpoint_every", "seed"):
            check_int(f(name), getattr(self, name), 0)
        for name in ("chinchilla", "muon", "progress"):
            check_bool(f(name), getattr(self, name))
        for name in ("bf16", "compile"):  # True / False / None (configs written before "auto") mean on / off / auto
            object.__setattr__(self, name, check_precision(f(name), getattr(self, name)))
        if self.device is not None:
            if not isinstance(self.device, str):
                fail(f("device"), self.device, "must be None or a torch device name such as 'cpu' or 'cuda:0'")
            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                fail(f("device"), self.device, "must be None or a torch device name such as 'cpu' or 'cuda:0'")
        check_choice(f("schedule"), self.schedule, SCHEDULES)
        check_choice(f("loop_sampler"), self.loop_sampler, LOOP_SAMPLERS)
        if self.flops is not None:
            check_float(f("flops"), self.flops, 0, lo_open=True, allowed="must be None or a finite number > 0")
        check_float(f("lr"), self.lr, 0, lo_open=True)
        check_float(f("min_lr_ratio"), self.min_lr_ratio, 0, 1)
        check_float(f("decay_frac"), self.decay_frac, 0, 1, lo_open=True)
        check_float(f("loop_sigma"), self.loop_sigma, 0, lo_open=True)
        check_float(f("weight_decay"), self.weight_decay, 0)
        check_float(f("loop1_distill"), self.loop1_distill, 0,
                    allowed="must be a finite number >= 0 (the weight of the loop-1 distillation term; 0: off)")
        check_float(f("grad_clip"), self.grad_clip, 0, allowed="must be a finite number >= 0 (0: no clipping)")
        check_float(f("checkpoint_seconds"), self.checkpoint_seconds, 0,
                    allowed="must be a finite number >= 0 (0: no checkpoints by time)")
        if self.eval_loops is not None:
            if isinstance(self.eval_loops, (str, bytes)) or not isinstance(self.eval_loops, (list, tuple)) \
                    or not self.eval_loops:
                fail(f("eval_loops"), self.eval_loops, "must be None or a non-empty list of integers >= 1")
            for i, r in enumerate(self.eval_loops):
                check_int(f(f"eval_loops[{i}]"), r, 1, allowed="must be an integer >= 1 (a loop count)")
            object.__setattr__(self, "eval_loops", tuple(int(r) for r in self.eval_loops))  # JSON gives a list
        budgets = {"steps": self.steps, "tokens": self.tokens, "flops": self.flops,
                   "chinchilla": self.chinchilla or None}
        if sum(v is not None for v in budgets.values()) != 1:
            raise ValueError("TrainConfig needs exactly one budget: steps, tokens, flops or chinchilla=True "
                             f"(got steps={self.steps}, tokens={self.tokens}, flops={self.flops}, "
                             f"chinchilla={self.chinchilla})")
        if self.loop_max is not None and self.loop_max < self.loop_min:
            fail(f("loop_max"), self.loop_max, f"must be >= loop_min={self.loop_min}")
        if self.loop_sampler == "fixed" and self.loops is not None and self.backward_loops is not None \
                and self.backward_loops > self.loops:
            fail(f("backward_loops"), self.backward_loops, f"must be <= loops={self.loops} (k <= r)")

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
        return cls.from_dict(json.loads(text))


def check_fit(cfg: LoopConfig, tc: TrainConfig) -> None:
    """Return None if the train config fits the model (sequence length, loop counts); else fail naming the field."""
    if tc.seq_len > cfg.max_seq_len:
        fail("TrainConfig.seq_len", tc.seq_len, f"must be <= LoopConfig.max_seq_len={cfg.max_seq_len} (rotary "
             "positions are built up to it)")
    r = tc.loops or cfg.loops
    if tc.loop_sampler == "fixed" and tc.backward_loops is not None and tc.backward_loops > r:
        fail("TrainConfig.backward_loops", tc.backward_loops, f"must be <= loops={r} (k <= r)")


# ---- pieces a trainer is made of (each usable on its own) -------------------------------------------
def param_groups(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """Return (muon, adamw) lists of (name, parameter): Muon gets exactly the 2-D hidden matrices.

    Hidden matrices are the blocks' attention and MLP weights, the dense injection, re-entry bridge and
    history lag matrices; embeddings, head, norms, biases, gates, scalars, hyper-connection mixers and
    low-rank adapter factors go to AdamW. Frozen parameters (requires_grad=False) go to neither.
    """
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden = (name.endswith(_MUON_SUFFIXES) or name in ("inject.weight", "inject.B", "inject.W_p", "inject.W_s")
                  or (name.startswith("history.lags.") and p.ndim == 2))
        (muon if hidden and p.ndim == 2 else adamw).append((name, p))
    return muon, adamw


def make_optimizers(model: torch.nn.Module, tc: TrainConfig) -> list[torch.optim.Optimizer]:
    """Return [Muon, AdamW] (or [AdamW] with muon=False); Muon scales its update to AdamW's RMS so one lr fits both."""
    muon, adamw = param_groups(model)
    opts = []
    if tc.muon and muon:
        opts.append(Muon([p for _, p in muon], lr=tc.lr, weight_decay=tc.weight_decay,
                         adjust_lr_fn="match_rms_adamw"))
    else:
        adamw = muon + adamw
    opts.append(torch.optim.AdamW([p for _, p in adamw], lr=tc.lr, weight_decay=tc.weight_decay,
                                  betas=(0.9, 0.95)))
    return opts


def lr_at(step: int, total: int, tc: TrainConfig) -> float:
    """Return the learning rate at 0-based `step` of `total`: linear warmup, then cosine / WSD / constant."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    lo = tc.lr * tc.min_lr_ratio
    if tc.schedule == "constant":
        return tc.lr
    if tc.schedule == "cosine":
        span = max(1, total - tc.warmup)
        progress = min(1.0, (step - tc.warmup) / span)
        return lo + (tc.lr - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = total - max(1, round(tc.decay_frac * total))
    if step < decay_start:
        return tc.lr
    return tc.lr + (lo - tc.lr) * (step - decay_start + 1) / (total - decay_start)


def sample_loops(step: int, tc: TrainConfig, K: int) -> tuple[int, int]:
    """Return (r, k) for a step: r from the loop sampler seeded by (seed, step), k = min(backward_loops, r)."""
    rng = np.random.default_rng([tc.seed, step, 7])
    if tc.loop_sampler == "fixed":
        r = tc.loops or K
    elif tc.loop_sampler == "uniform":
        r = int(rng.integers(tc.loop_min, (tc.loop_max or 2 * K) + 1))
    else:
        tau = rng.normal(math.log(tc.loops or K) - tc.loop_sigma ** 2 / 2, tc.loop_sigma)
        r = 1 + int(rng.poisson(math.exp(tau)))
        if tc.loop_max is not None:
            r = min(r, tc.loop_max)
    k = r if tc.backward_loops is None else min(tc.backward_loops, r)
    return r, k


def frozen_copy(model: LoopLM) -> LoopLM:
    """Return a copy of the model in eval mode with every parameter frozen, sharing the already frozen ones."""
    import copy

    shared = {id(p): p for p in model.parameters() if not p.requires_grad}  # deepcopy returns memo hits as they are
    ref = copy.deepcopy(model, shared)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()


def loop1_kl(model: LoopLM, reference: LoopLM, tokens: torch.Tensor, state1: torch.Tensor) -> torch.Tensor:
    """Return mean KL(reference || model) over positions of the next-token distributions at loop 1.

    `state1` is the model's state after loop 1 for `tokens` as the coda reads it (the `state.1` place of
    the training pass, its graph kept); the reference runs one loop without a graph. The softmaxes are
    fp32. This is TrainConfig.loop1_distill's term: it holds a retrofit's one-loop path to the frozen
    base when the block itself trains (the full budget).
    """
    log_softmax = torch.nn.functional.log_softmax
    with torch.no_grad():
        ref = log_softmax(reference.readout(reference.run(tokens, 1).state).float(), -1)
    logp = log_softmax(model.readout(state1).float(), -1)
    return (ref.exp() * (ref - logp)).sum(-1).mean()


def per_loop_loss(model: LoopLM, tokens: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
                  backward_loops: int | None = None) -> torch.Tensor:
    """Return the per-loop supervised loss: `model(tokens, labels=labels, label_weights=weights).loss`.

    labels is [B, loops, T] (-100 where a loop carries no label). With `weights` None or [loops] the
    loss averages the per-loop mean cross-entropies over the loops that carry a label, weighted by
    `weights` (set weights to one-hot on the last loop for final-answer-only grading). With `weights`
    [B, loops] every (example, loop) pair that carries a label counts once, with its own weight: the
    loss is the weighted mean of the pairs' mean cross-entropies (what mixed-depth batches need, whose
    final loop differs per example). A Trainer calls the (DDP-wrapped) model the same way.
    """
    return model(tokens, labels=labels, label_weights=weights, backward_loops=backward_loops).loss


# ---- compilation: each Block compiled, the loop left eager ---------------------------------------------------
# compile="auto" compiles when a run's training FLOPs (FLOPs per token x tokens, head and attention
# included) reach COMPILE_AUTO_FLOPS for the device type, where the first compile repays itself at
# least twice over. Measured on 2 AVX512-BF16 cores (2026-11-30, docs/benchmarks.md): a cold first
# compile of the blocks takes 40-80 s (seconds when inductor's on-disk cache already holds them), and
# the compiled bf16 step is 13-15% faster than the eager one (2+2x4+2 d=256: 1.96 against 2.25 s on
# one thread; the quickstart's 1+2x4+1 d=128: 0.31 against 0.37 s). 1.5e14 FLOPs are ~900 steps of
# the d=256 model, ~30 minutes of eager training, from which compiling saves ~4 minutes. On CUDA (an
# H200, 2026-11-30) the compile took 5-15 s and made the step 1.39x faster for a 113M model (repaid
# after 1.3e16 FLOPs, ~240 steps) and 1.4x for the launch-bound d=256 model (after 1.5e14 FLOPs), so
# the threshold sits between the two. On a CPU without AMX / AVX512-BF16 (fp32 training) the compiled
# step ran at 0.98x of eager (2026-12-01, docs/benchmarks.md): no gain to repay the compile, so "auto"
# compiles on a CPU only where the run trains in bf16 autocast on a CPU that does bf16 fast.
COMPILE_AUTO_FLOPS = {"cpu": 1.5e14, "cuda": 5e15}
_COMPILED: dict[str, Any] = {}  # torch.compile of Block.forward / Block.delta, made once per process


def training_flops(model: LoopLM, tc: TrainConfig, steps: int, world: int = 1) -> float:
    """Return the FLOPs of training `steps` steps (mean sampled loop count; head and attention included)."""
    K = model.cfg.loops
    draws = [sample_loops(s, tc, K) for s in range(min(steps, 1000))]  # the sampler's mean r and k
    r = max(1, round(float(np.mean([d[0] for d in draws]))))
    k = max(1, min(r, round(float(np.mean([d[1] for d in draws])))))
    fpt = model.flops_per_token(r, k, seq_len=tc.seq_len, include_head=True)
    return float(fpt) * steps * tc.batch_size * tc.seq_len * world


def compile_pays(model: LoopLM, tc: TrainConfig, steps: int, device: torch.device | str,
                 world: int = 1, cpuinfo=None) -> tuple[bool, str]:
    """Return (compile?, why) for tc.compile on `device`: "on" and "off" as given; "auto" compiles when the
    run's training FLOPs reach COMPILE_AUTO_FLOPS[device type] and (on a CPU) the run trains in bf16 on a CPU
    with AMX / AVX512-BF16 and a C++ compiler is there for inductor's kernels (`cpuinfo` simulates a CPU)."""
    import shutil

    if tc.compile != "auto":
        return tc.compile == "on", f"compile={tc.compile}"
    device = torch.device(device)
    limit = COMPILE_AUTO_FLOPS.get(device.type)
    if limit is None:
        return False, f"compile=auto: not measured on {device.type}, so off"
    if device.type == "cpu" and not use_bf16(tc.bf16, device, cpuinfo):
        return False, ("compile=auto: fp32 training on this CPU (no AMX / AVX512-BF16 in use), where compiling "
                       "measured no gain (0.98x of eager), so off")
    flops = training_flops(model, tc, steps, world)
    if flops < limit:
        return False, (f"compile=auto: {flops:.2g} training FLOPs < {limit:.2g}, too short to repay a first "
                       "compile of about a minute")
    if device.type == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++")):
        return False, "compile=auto: no C++ compiler (g++, c++, clang++ or $CXX) for inductor's CPU kernels"
    return True, f"compile=auto: {flops:.2g} training FLOPs >= {limit:.2g}"


def _compiled_fns() -> dict[str, Any]:
    from .models.layers import Block

    if not _COMPILED:
        # compiled as plain functions of (block, ...): one cache for every Block, so all the blocks of a
        # model (and of every model of the same shapes) share one compiled graph
        _COMPILED["forward"] = torch.compile(Block.forward)
        _COMPILED["delta"] = torch.compile(Block.delta)
    return _COMPILED


@contextlib.contextmanager
def compiled_blocks(model: torch.nn.Module):
    """Within: every Block of `model` runs torch.compile'd (forward, and delta for hyper-connections).

    Only the blocks are compiled; the loop over them stays in Python, so a new loop count, a truncated
    backward (a no-grad forward: compiled once more), timestep modulations and hyper-connection
    routing reuse the compiled blocks instead of recompiling. Outside the context the blocks run
    eagerly again (evaluation, probes), and state_dict keys never change.
    """
    import functools

    from .models.layers import Block

    fns = _compiled_fns()
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for b in blocks:
        b.forward = functools.partial(fns["forward"], b)
        b.delta = functools.partial(fns["delta"], b)
    try:
        yield
    finally:
        for b in blocks:
            del b.forward, b.delta


def compile_count() -> int:
    """Return how many graphs torch.compile has built in this process (0 when dynamo was never used)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---- checkpoints: they live in io.py (one home for files); re-exported so train.save_checkpoint etc. still work
from .io import _load_optim_state, _optim_state, latest_checkpoint, load_model, save_checkpoint  # noqa: E402,F401


# ---- data-parallel processes (torchrun) ------------------------------------------------------------------
def init_distributed() -> tuple[int, int, torch.device | None]:
    """Return (rank, world size, device) after joining the process group torchrun describes in the environment.

    Under `torchrun --nproc_per_node N` (WORLD_SIZE > 1 in the environment) this initialises the
    default process group once: NCCL with one CUDA device per process (cuda:LOCAL_RANK) when CUDA is
    present, else gloo on the CPU. Alone (no WORLD_SIZE, or 1) it does nothing and returns (0, 1, None).
    A group that is already initialised is used as it is (its device: cuda:LOCAL_RANK for NCCL).
    """
    import torch.distributed as dist

    env_world = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(env_world)
    except ValueError:
        fail("WORLD_SIZE", env_world, "must be an integer >= 1 (set by torchrun)")
    if world < 1:
        fail("WORLD_SIZE", env_world, "must be an integer >= 1 (set by torchrun)")
    initialised = dist.is_available() and dist.is_initialized()
    if world == 1 and not initialised:
        return 0, 1, None
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world} asks for {world} processes, but this torch build has no "
                           "torch.distributed")
    local = os.environ.get("LOCAL_RANK", "0")
    try:
        local_rank = int(local)
    except ValueError:
        fail("LOCAL_RANK", local, "must be an integer >= 0 (set by torchrun)")
    cuda = torch.cuda.is_available()
    if cuda and not 0 <= local_rank < torch.cuda.device_count():
        fail("LOCAL_RANK", local_rank, f"must name one of this machine's {torch.cuda.device_count()} CUDA "
             "devices: start at most that many processes per node (--nproc_per_node)")
    if not initialised:
        if cuda:
            torch.cuda.set_device(local_rank)  # before the group: NCCL binds each process to its own device
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda and dist.get_backend() == "nccl" else None
    return dist.get_rank(), dist.get_world_size(), device


def _all_gather_json(obj: Any) -> list[Any]:
    """Return every rank's JSON-encodable `obj` (rank order), exchanged as bytes in tensors (no pickle)."""
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = torch.tensor(list(json.dumps(obj, sort_keys=True, default=str).encode()), dtype=torch.uint8, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev))
    longest = int(max(s.item() for s in sizes))
    bufs = [torch.zeros(longest, dtype=torch.uint8, device=dev) for _ in sizes]
    dist.all_gather(bufs, torch.cat([data, data.new_zeros(longest - data.numel())]))
    return [json.loads(bytes(b[:int(n.item())].tolist()).decode()) for b, n in zip(bufs, sizes)]


def _check_same_on_every_rank(what: dict[str, Any]) -> None:
    """Return None when every rank holds the same values (all_gather); else raise naming the rank and the fields.

    The ranks must draw the same loop counts and batches each step (shared seed and sampler), or
    their gradients would average steps of different models.
    """
    import torch.distributed as dist

    mine = json.loads(json.dumps(what, sort_keys=True, default=str))  # compared as the other ranks' arrive
    for rank, theirs in enumerate(_all_gather_json(what)):
        diff = {k: (mine[k], theirs.get(k)) for k in mine if theirs.get(k) != mine[k]}
        if diff:
            raise ValueError(f"rank {dist.get_rank()} and rank {rank} differ in {diff} (this rank, that rank): "
                             "every rank of a data-parallel run needs the same TrainConfig trajectory fields "
                             "(seed, loop sampler, ...) and the same training data at the same position")


# ---- the trainer -----------------------------------------------------------------------------------------
class Trainer:
    """Trains a LoopLM on token batches; `run()` returns the per-step metrics as an xarray Dataset."""

    def __init__(self, cfg: LoopConfig, tc: TrainConfig, train_data, val_data=None, out_dir=None,
                 resume: bool = False, model: LoopLM | None = None, overwrite: bool = False):
        from .data.corpus import BatchSampler

        check_bool("resume", resume)
        check_bool("overwrite", overwrite)
        if not isinstance(cfg, LoopConfig):
            fail("cfg", cfg, "must be a LoopConfig")
        if not isinstance(tc, TrainConfig):
            fail("tc", tc, "must be a TrainConfig")

        self.cfg, self.tc = cfg, tc
        self.out_dir = Path(out_dir) if out_dir is not None else None
        check_fit(cfg, tc)
        # under torchrun the process group comes from the environment (a no-op alone, or when already made)
        self.rank, self.world, rank_device = init_distributed()
        self.dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.device = torch.device(tc.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.dist and self.device.type == "cuda" and self.device.index is None:
            # one device per process: LOCAL_RANK's (torchrun), else the one the caller selected
            self.device = rank_device or torch.device("cuda", torch.cuda.current_device())
        if self.dist and torch.distributed.get_backend() == "nccl" and self.device.type != "cuda":
            fail("TrainConfig.device", tc.device, "must be a CUDA device (or None) in an NCCL process group")
        self.model = (model if model is not None else LoopLM(cfg, seed=tc.seed)).to(self.device)
        if self.model.cfg != cfg:
            raise ValueError("model.cfg does not match cfg")
        # loop1_distill's reference: the model as given, before a resume loads a checkpoint (a retrofit's
        # base), frozen; its frozen parameters are shared with the model, only trainable ones are copied
        self.loop1_reference = frozen_copy(self.model) if tc.loop1_distill > 0 else None
        # the sampler draws the GLOBAL batch; each rank trains on its slice, so the run is the same at any world size
        self.data_fingerprints = {"train": data_fingerprint(train_data), "val": data_fingerprint(val_data)}
        if isinstance(train_data, np.ndarray) or torch.is_tensor(train_data):
            train_data = BatchSampler(np.asarray(train_data), tc.batch_size * self.world, tc.seq_len, seed=tc.seed)
        self.sampler = train_data
        self.val_batches = None
        if val_data is not None:
            vs = BatchSampler(np.asarray(val_data), min(tc.batch_size, 8), tc.seq_len, seed=tc.seed + 1)
            self.val_batches = [next(vs) for _ in range(tc.eval_batches)]
        self.total_steps = self._budget_steps()
        self.opts = make_optimizers(self.model, tc)
        # resolved once: what "auto" chose is recorded in the metrics' attrs, results and progress.json
        self.bf16 = use_bf16(tc.bf16, self.device)
        self.compiled, self.compile_reason = compile_pays(self.model, tc, self.total_steps, self.device, self.world)
        self._progress_at = -math.inf
        self.step = 0
        self.metrics: dict[str, list] = {k: [] for k in METRICS}
        if self.loop1_reference is not None:
            self.metrics["loop1_kl"] = []  # the distillation term alone (loss includes it, weighted)
        self.evals: list[xr.Dataset] = []
        self.warnings: list[str] = []  # kept in checkpoints and the metrics' attrs
        self.failed: str | None = None
        self._signal: int | None = None
        if self.out_dir is not None and self.rank == 0:
            self._check_writable()
            if not resume and holds_run(self.out_dir) and (self.out_dir / "latest.json").exists():
                if not overwrite:
                    raise FileExistsError(f"out_dir={str(self.out_dir)!r} already holds a run (latest.json): pass "
                                          "resume=True to continue it or overwrite=True to replace it")
                from .io import clear_run
                clear_run(self.out_dir, checkpoints_only=True)  # a tokenizer written for this run stays
        if resume:
            self._resume()
        self.train_model = self.model  # compile acts on the blocks (compiled_blocks), never wraps the model
        if self.dist:
            state = getattr(self.sampler, "state_dict", None)
            _check_same_on_every_rank({**{k: getattr(tc, k) for k in RESUME_FIELDS}, "model_config": cfg.to_json(),
                                       "step": self.step, "sampler": state() if state else None,
                                       "data": self.data_fingerprints})
            # find_unused_parameters: a step may leave parameters without gradient (truncation without
            # injection leaves the prelude out, a sampled r below the history window the far lags, r = 1
            # a retrofit's bridge). DDP then marks them ready and leaves their .grad None on every rank,
            # as one process would, instead of waiting for them and failing on the next step. Every rank
            # draws the same r (sample_loops is seeded by (seed, step), checked equal above), so
            # the same parameters go unused everywhere.
            self.train_model = torch.nn.parallel.DistributedDataParallel(
                self.train_model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=True)

    # budget -------------------------------------------------------------------------------------------
    def _budget_steps(self) -> int:
        tc = self.tc
        tokens_per_step = tc.batch_size * tc.seq_len * self.world
        if tc.steps is not None:
            return tc.steps
        if tc.tokens is not None:
            tokens = tc.tokens
        elif tc.flops is not None:
            r = tc.loops or self.cfg.loops
            if tc.loop_sampler != "fixed":  # the sampler's mean loop count, estimated from its first 1000 draws
                r = float(np.mean([sample_loops(s, tc, self.cfg.loops)[0] for s in range(1000)]))
            k = r if tc.backward_loops is None else min(tc.backward_loops, r)
            fpt = self.model.flops_per_token(max(1, round(r)), max(1, min(round(k), round(r))), seq_len=tc.seq_len)
            tokens = tc.flops / fpt
        else:
            pc = self.model.param_counts()
            tokens = 20 * (pc["once"] + pc["rec"])
        steps = int(tokens // tokens_per_step)
        if steps < 1:
            raise ValueError(f"the budget gives {tokens:.3g} tokens, fewer than one step of {tokens_per_step} "
                             f"(batch_size x seq_len x world): zero steps to train")
        return steps

    def _check_writable(self) -> None:
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            probe = self.out_dir / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"out_dir={str(self.out_dir)!r} is not writable: {e}") from e

    # checkpoints ----------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"step": self.step, "model_config": self.cfg.to_json(), "train_config": self.tc.to_json(),
                "sampler": self.sampler.state_dict(), "metrics": self.metrics,
                "torch_rng": torch.get_rng_state().tolist(),
                "evals": [ds.to_dict() for ds in self.evals], "warnings": self.warnings,
                "data": self.data_fingerprints}

    def nonfinite(self) -> str | None:
        """Return the name of the first parameter or optimiser state that is not finite, or None when all are."""
        for name, p in self.model.named_parameters():
            if not bool(torch.isfinite(p).all()):
                return f"parameter {name}"
        names = {id(p): n for n, p in self.model.named_parameters()}
        for opt in self.opts:
            for p, st in opt.state.items():
                for key, v in st.items():
                    if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                        return f"optimiser state {key} of {names.get(id(p), '?')}"
        return None

    def save(self) -> Path | None:
        """Return the checkpoint folder written now (rank 0 only; None elsewhere or without out_dir).

        Raises Diverged, writing nothing, when a parameter or optimiser state is not finite.
        """
        if self.out_dir is None or self.rank != 0:
            return None
        bad = self.nonfinite()
        if bad is not None:
            raise self._diverged(self.step, f"after its update, {bad} is not finite")
        path = save_checkpoint(self.out_dir, self.model, self.opts, self._state(), self.tc.keep_checkpoints)
        self._saved_at = time.monotonic()
        return path

    def _diverged(self, step: int, what: str, loops: tuple[int, int] | None = None) -> Diverged:
        """Return the Diverged error for 1-based `step`, naming what was not finite and the last finite checkpoint."""
        try:
            last = latest_checkpoint(self.out_dir) if self.out_dir is not None else None
        except (OSError, ValueError):
            last = None
        where = (f"the last finite checkpoint is {last} (step {int(last.name.split('-')[1])})" if last is not None
                 else "no checkpoint was written before it" if self.out_dir is not None else "no out_dir to save to")
        at = f" (loops={loops[0]}, backward_loops={loops[1]})" if loops else ""
        return Diverged(f"training diverged at step {step} of {self.total_steps}: {what}{at}; nothing after it was "
                        f"saved, {where}; lower lr, raise warmup or clip gradients (grad_clip) and retrain", step)

    def _resume(self) -> None:
        if self.out_dir is None:
            raise ValueError("resume=True needs an out_dir to resume from")
        path = latest_checkpoint(self.out_dir) if self.rank == 0 else None
        if self.dist:  # every rank loads the checkpoint rank 0 found (the run folder is shared)
            path = _all_gather_json(None if path is None else str(path))[0]
            path = None if path is None else Path(path)
        if path is None:
            return  # nothing yet: a fresh start
        state = read_json(path / "state.json", "checkpoint state")
        saved = LoopConfig.from_json(state["model_config"])
        if saved != self.cfg:
            diff = {k: (v, getattr(self.cfg, k)) for k, v in saved.to_dict().items() if getattr(self.cfg, k) != v}
            raise ValueError(f"checkpoint {path} was written for another model config; differing fields "
                             f"(checkpoint, now): {diff}")
        if "train_config" in state:
            old = json.loads(state["train_config"])
            now = json.loads(self.tc.to_json())
            diff = {k: (old[k], now[k]) for k in RESUME_FIELDS if k in old and old[k] != now[k]}
            if diff:
                raise ValueError(f"checkpoint {path} was trained with other settings; a resumed run must keep them. "
                                 f"Differing fields (checkpoint, now): {diff}; start a new run (another out_dir, "
                                 "or overwrite) to change them")
        for part, fp in (state.get("data") or {}).items():
            if fp is not None and self.data_fingerprints.get(part) not in (None, fp):
                raise ValueError(f"checkpoint {path} was trained on other {part} data (fingerprint {fp} then, "
                                 f"{self.data_fingerprints[part]} now: length and sampled token ids differ); a "
                                 "resumed run must see the same data")
        self.model.load_state_dict(load_tensors(path / "model.safetensors", device=str(self.device)))
        _load_optim_state(self.opts, load_tensors(path / "optim.safetensors", device=str(self.device)),
                          state["optim"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        self.step = int(state["step"])
        self.metrics = {k: list(v) for k, v in state["metrics"].items()}
        n = len(self.metrics["loss"])
        for k in METRICS:  # checkpoints written before step_s / compiled existed
            self.metrics.setdefault(k, [math.nan if k == "step_s" else 0.0] * n)
        self.evals = [xr.Dataset.from_dict(d) for d in state.get("evals", [])]
        self.warnings = list(state.get("warnings", []))

    # one step ---------------------------------------------------------------------------------------------
    def _loss(self, batch, r: int, k: int) -> torch.Tensor:
        # autocast for the forward only (its backward follows the forward's dtypes); parameters, optimiser
        # states, the loss and the cross-entropy's softmax stay fp32 (models.precision)
        # loop1_distill reads the loop-1 state out of the same pass (a cached place), not a second pass
        keep = ["state.1"] if self.loop1_reference is not None else None
        with autocast(self.device, self.bf16), (compiled_blocks(self.model) if self.compiled else nullcontext()):
            if isinstance(batch, dict):  # per-loop supervision, through the wrapper so DDP syncs it
                w = batch.get("weights")
                x, labels = self._shard(batch["tokens"]), self._shard(batch["labels"])
                w = self._shard(w) if w is not None and torch.as_tensor(w).dim() == 2 else w
                out = self.train_model(x, labels=labels, label_weights=w, backward_loops=k, cache=keep)
            else:
                batch = self._shard(batch)
                x, y = batch[:, :-1], batch[:, 1:]
                out = self.train_model(x, loops=r, targets=y, backward_loops=k, return_logits=False, cache=keep)
            if keep is None:
                return out.loss
            kl = loop1_kl(self.model, self.loop1_reference, x, out.cache["state.1"])
        self._loop1_kl = float(kl.detach())
        return out.loss + self.tc.loop1_distill * kl

    def _shard(self, x):
        """Return this rank's rows of a batch tensor, on the trainer's device (all rows when alone)."""
        x = torch.as_tensor(x).to(self.device)
        if self.world > 1:
            b = x.shape[0] // self.world
            x = x[self.rank * b:(self.rank + 1) * b]
        return x

    def train_step(self) -> float:
        """Return the loss of one optimisation step (the step counter advances)."""
        r, k = sample_loops(self.step, self.tc, self.cfg.loops)
        lr = lr_at(self.step, self.total_steps, self.tc)
        for opt in self.opts:
            for g in opt.param_groups:
                g["lr"] = lr
        t0 = time.perf_counter()
        batch = next(self.sampler)
        if isinstance(batch, dict):  # per-loop supervision: the labels fix the loop count
            r = batch["labels"].shape[1]
            k = min(k, r)
        graphs = compile_count()
        loss = self._loss(batch, r, k)
        if not torch.isfinite(loss):
            bad = self.nonfinite()  # weights the previous update broke: that step diverged, not this one
            if bad is not None and self.step > 0:
                raise self._diverged(self.step, f"after its update, {bad} is not finite (the next loss is "
                                                f"{loss.item()})")
            raise self._diverged(self.step + 1, f"the loss is {loss.item()}", (r, k))
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
        # else no trainable parameter reaches this step's loss (an adapter retrofit at r = 1 is its frozen
        # base): every .grad stays None, the norm is 0 and the optimisers skip every parameter, on every rank
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                            self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf"))
        if not torch.isfinite(gn):  # stop before the update: the weights in memory stay finite
            raise self._diverged(self.step + 1, f"the gradient norm is {float(gn)} at loss {loss.item():.4g}", (r, k))
        for opt in self.opts:
            opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        n_tok = (batch["tokens"].numel() if isinstance(batch, dict) else batch[:, :-1].numel())
        value = float(loss.item())
        if self.world > 1:  # each rank's loss is its shard's: log the whole batch's, as one process would
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            value = float(mean.item()) / self.world
        compiled = float(compile_count() != graphs)  # this step built a graph (forward and its backward)
        for key, v in (("loss", value), ("lr", lr), ("grad_norm", float(gn)), ("tokens_per_s", n_tok / dt),
                       ("loops", r), ("backward_loops", k), ("step_s", dt), ("compiled", compiled)):
            self.metrics[key].append(v)
        if self.loop1_reference is not None:  # NaN for steps of a resumed run that trained without it
            self.metrics.setdefault("loop1_kl", [math.nan] * (len(self.metrics["loss"]) - 1)).append(self._loop1_kl)
        self.step += 1
        return value

    def evaluate(self) -> xr.Dataset:
        """Return a loop sweep of the validation batches at the eval loop counts (below, at and beyond K)."""
        from .evals import loop_sweep

        if self.val_batches is None:
            raise ValueError("evaluate() needs val_data")
        K = self.cfg.loops
        loops = list(self.tc.eval_loops or sorted({1, max(1, K // 2), K, 2 * K}))
        ds = loop_sweep(self.model, torch.cat(self.val_batches), loops, batch_size=8, progress=False, bf16=self.bf16)
        return ds.expand_dims(step=[self.step])

    def compile_seconds(self) -> np.ndarray:
        """Return per step the seconds spent compiling: a compiling step's time minus the median other step's (else 0)."""
        s = np.asarray(self.metrics["step_s"], dtype=float)
        c = np.asarray(self.metrics["compiled"], dtype=float) > 0
        normal = s[~c & np.isfinite(s)]
        base = float(np.median(normal)) if normal.size else 0.0
        return np.where(c & np.isfinite(s), np.maximum(s - base, 0.0), 0.0)

    def speed_attrs(self) -> dict[str, str | float]:
        """Return what the run's speed settings resolved to: precision, compile (on/off and why), compile seconds,
        device, torch threads per process and data-parallel processes (world)."""
        return {"precision": precision_name(self.bf16), "compile": "on" if self.compiled else "off",
                "compile_reason": self.compile_reason, "compile_s": float(self.compile_seconds().sum()),
                "device": str(self.device), "threads": torch.get_num_threads(), "world": self.world}

    def metrics_dataset(self) -> xr.Dataset:
        """Return the per-step metrics (dim `step`, 1-based) and evaluations (dims `eval_step`, `loop`)."""
        n = len(self.metrics["loss"])
        ds = xr.Dataset({k: ("step", np.asarray(v, dtype=float)) for k, v in self.metrics.items()},
                        coords={"step": np.arange(1, n + 1)})
        ds["compile_s"] = ("step", self.compile_seconds(), {"long_name": "seconds of the step spent compiling "
                                                            "(estimated: its time minus the median step's)"})
        # a compiling step's throughput counts its training time only
        run_s = ds.step_s - ds.compile_s
        ds["tokens_per_s"] = ds.tokens_per_s.where((ds.compile_s == 0) | (run_s <= 0),
                                                   ds.tokens_per_s * ds.step_s / run_s)
        if self.evals:
            ev = xr.concat(self.evals, dim="step").rename(step="eval_step")
            ds["eval_loss"] = ev["loss"]
            ds["eval_accuracy"] = ev["accuracy"]
        ds.attrs = provenance(self.cfg, self.tc.seed, train_config=self.tc.to_json(), total_steps=self.total_steps,
                              chance_loss=math.log(self.cfg.vocab_size), warnings="\n".join(self.warnings),
                              failed=self.failed or "")
        ds.attrs.update(self.speed_attrs())
        return ds

    def run(self) -> xr.Dataset:
        """Return the metrics Dataset after training to the budget (checkpointing and evaluating on the way).

        Checkpoints come every `checkpoint_every` steps and whenever `checkpoint_seconds` have passed
        since the last one, and at the end. SIGINT or SIGTERM stops after the current step, saves a
        checkpoint and then acts as the signal would (KeyboardInterrupt, or termination): `resume=True`
        continues exactly there. A non-finite loss, gradient or parameter raises Diverged naming the
        step: no non-finite checkpoint is written, the last finite one stays, and latest.json and
        metrics.nc record the failure.
        """
        try:
            with self._signals_save():
                self._train_loop()
            if self._signal is not None:
                self._stop_on_signal()
            try:
                if self.val_batches is not None and (not self.evals or int(self.evals[-1].step[0]) != self.step):
                    self._report_progress("evaluating", force=True)
                    self.evals.append(self.evaluate())
            finally:  # a failing evaluation never costs the trained weights
                self.save()
        except Diverged as e:
            self._record_failure(e)
            self._report_progress("failed", force=True)
            raise
        ds = self.metrics_dataset()
        if self.out_dir is not None and self.rank == 0:
            save_netcdf(ds, self.out_dir / "metrics.nc")
        self._report_progress("done", force=True)
        return ds

    def _report_progress(self, phase: str = "training", force: bool = False) -> None:
        """Rewrite out_dir/progress.json (rank 0; at most every PROGRESS_EVERY_S unless forced): what `workbench run`
        shows while the run executes: phase, step of total, tokens/s and time left over the last non-compiling
        steps, latest loss, precision and compile."""
        if self.out_dir is None or self.rank != 0:
            return
        now = time.monotonic()
        if not force and now - self._progress_at < PROGRESS_EVERY_S:
            return
        self._progress_at = now
        m = self.metrics
        recent = [(s, t) for s, t, c in zip(m["step_s"][-20:], m["tokens_per_s"][-20:], m["compiled"][-20:])
                  if not c and math.isfinite(s)]
        step_s = float(np.median([s for s, _ in recent])) if recent else None
        fields = {"phase": phase, "step": self.step, "total": self.total_steps,
                  "tokens_per_s": float(np.median([t for _, t in recent])) if recent else None,
                  "eta_s": step_s * (self.total_steps - self.step) if step_s is not None else None,
                  "loss": m["loss"][-1] if m["loss"] else None, "precision": precision_name(self.bf16),
                  "compile": "on" if self.compiled else "off", "pid": os.getpid()}
        try:
            write_progress(self.out_dir, fields)
        except OSError:
            pass  # progress is for a person watching; a full disk must not stop training here (save() will say)

    def _train_loop(self) -> None:
        from tqdm.auto import tqdm

        bar = tqdm(total=self.total_steps, initial=self.step, desc="train",
                   disable=not self.tc.progress or self.rank != 0)
        self.model.train()
        self._saved_at = time.monotonic()
        self._report_progress("compiling" if self.compiled else "training", force=True)
        try:
            while self.step < self.total_steps:
                loss = self.train_step()
                self._report_progress()
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", r=self.metrics["loops"][-1])
                self._watch_chance()
                if self.tc.eval_every and self.val_batches is not None and self.step % self.tc.eval_every == 0:
                    self._report_progress("evaluating", force=True)
                    self.evals.append(self.evaluate())
                if self._stop_requested():
                    return
                due = self.tc.checkpoint_every and self.step % self.tc.checkpoint_every == 0
                late = self.tc.checkpoint_seconds and time.monotonic() - self._saved_at >= self.tc.checkpoint_seconds
                if (due or late) and self.step < self.total_steps:  # the last step is saved by run()
                    self.save()
        finally:
            bar.close()

    def _watch_chance(self) -> None:
        """Warn (once; kept in the metrics' attrs) when the loss has sat at chance level for CHANCE_STEPS steps."""
        losses = self.metrics["loss"]
        if len(losses) < self.tc.warmup + CHANCE_STEPS or any(w.startswith("loss at chance") for w in self.warnings):
            return
        chance = math.log(self.cfg.vocab_size)
        recent = losses[-CHANCE_STEPS:]
        if min(recent) >= CHANCE_FRACTION * chance:
            msg = (f"loss at chance level: steps {len(losses) - CHANCE_STEPS + 1}..{len(losses)} all have loss >= "
                   f"{CHANCE_FRACTION:g} x ln(vocab_size={self.cfg.vocab_size}) = {CHANCE_FRACTION * chance:.3f} "
                   f"(latest {recent[-1]:.3f}): the model is not learning; lr={self.tc.lr:g} may be too high or too low")
            self.warnings.append(msg)
            if self.rank == 0:
                log.warning("workbench: %s", msg)

    # signals and failures -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _signals_save(self):
        """Within: SIGINT / SIGTERM ask the loop to stop after the current step (a second one stops at once)."""
        self._signal = None
        if threading.current_thread() is not threading.main_thread():
            yield  # handlers can only be installed from the main thread
            return
        old = {}

        def handler(signum, frame):
            if self._signal is not None:  # asked twice: stop now; the last checkpoint stands
                signal.signal(signum, old[signum])
                signal.raise_signal(signum)
                return
            self._signal = signum

        for sig in (signal.SIGINT, signal.SIGTERM):
            prev = signal.getsignal(sig)
            if prev is signal.SIG_IGN or prev is None:
                continue  # ignored (nohup, background job) or set outside Python: leave it alone
            old[sig] = prev
            signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, prev in old.items():
                signal.signal(sig, prev)

    def _stop_requested(self) -> bool:
        """Return True when a signal asked this (or, under DDP, any) rank to stop; ranks agree on the step."""
        stop = self._signal is not None
        if self.dist:
            flag = torch.tensor([float(stop)], device=self.device if self.device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            stop = bool(flag.item())
            if stop and self._signal is None:
                self._signal = signal.SIGTERM
        return stop

    def _stop_on_signal(self) -> None:
        """Save a checkpoint, say where, then act as the signal would (raise KeyboardInterrupt, or terminate)."""
        sig = self._signal
        path = self.save()
        if self.out_dir is not None and self.rank == 0:
            save_netcdf(self.metrics_dataset(), self.out_dir / "metrics.nc")
        if self.rank == 0:
            where = f"checkpoint {path}" if path is not None else "nothing saved (no out_dir)"
            print(f"workbench: {signal.Signals(sig).name} at step {self.step} of {self.total_steps}: {where}; "
                  "resume=True (workbench train --resume) continues from it", file=sys.stderr, flush=True)
        signal.raise_signal(sig)  # the handlers are restored: the signal does what it would have done
        raise KeyboardInterrupt(f"training stopped by {signal.Signals(sig).name} at step {self.step}")

    def _record_failure(self, e: Diverged) -> None:
        """Mark the run failed in latest.json and write metrics.nc up to the failure (rank 0, with out_dir)."""
        self.failed = str(e)
        if self.out_dir is None or self.rank != 0:
            return
        mark_failed(self.out_dir, e.step, str(e))
        save_netcdf(self.metrics_dataset(), self.out_dir / "metrics.nc")


class ExampleBatches:
    """Seeded batches of task examples for answer-only or per-loop supervision; resumable like BatchSampler.

    Each batch is a dict: `tokens` [B, T] (prompt + answer minus its last token, right-padded with 0),
    `labels` [B, loops, T] (-100 except at the answer positions) and `weights`. With
    `per_loop=True` loop t is graded on the example's state after step t (`Example.steps[t-1]`,
    for examples whose steps encode to as many tokens as the answer); otherwise, or with
    `final_only=True`, only the final loop carries the answer. Which loop is final:
    - `align="last"`: the last loop, graded on the answer whatever the example's depth; `weights` [loops];
    - `align="step"`: loop min(depth, loops), graded on the state after that step (the answer when
      depth <= loops); later loops carry no label, so examples of mixed depths teach one step per
      loop; `weights` [B, loops]. Examples need steps.
    `anneal=n` anneals per-loop grading toward final-answer-only grading: the weight of every loop
    before the final one falls linearly from 1 at the first batch to 0 at batch n (and stays 0).
    """

    def __init__(self, examples, tokenizer, batch_size: int, loops: int, seed: int = 0, per_loop: bool = True,
                 final_only: bool = False, anneal: int = 0, align: str = "last"):
        if not examples:
            raise ValueError("examples is empty: nothing to train on")
        if batch_size < 1 or loops < 1:
            raise ValueError(f"batch_size={batch_size}, loops={loops} are invalid: both must be >= 1")
        if not isinstance(anneal, int) or isinstance(anneal, bool) or anneal < 0:
            raise ValueError(f"anneal={anneal!r} is invalid: must be an integer >= 0 (batches; 0 is off)")
        if align not in ("last", "step"):
            raise ValueError(f"align={align!r} is invalid: must be one of last, step")
        self.batch_size, self.loops, self.seed, self.anneal, self.align = batch_size, loops, seed, anneal, align
        self.drawn = 0  # batches drawn so far: the annealing clock
        self.items = []
        for ex in examples:
            if align == "step" and not ex.steps:
                raise ValueError(f"align='step' needs examples with steps; {ex.prompt!r} has none")
            p, a = tokenizer.encode(ex.prompt), tokenizer.encode(ex.answer)
            per = [tokenizer.encode(ex.answer[:len(ex.answer) - len(ex.answer.lstrip())] + s) for s in ex.steps]
            self.items.append((p, a, per))
        self.per_loop, self.final_only = per_loop, final_only
        self.epoch = self.position = 0

    def __iter__(self) -> "ExampleBatches":
        return self

    def __next__(self) -> dict:
        n = len(self.items)
        self.drawn += 1
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        idx = [order[(self.position * self.batch_size + i) % n] for i in range(self.batch_size)]
        self.position += 1
        if self.position * self.batch_size >= n:
            self.epoch, self.position = self.epoch + 1, 0
        T = max(len(self.items[i][0]) + len(self.items[i][1]) - 1 for i in idx)
        tokens = torch.zeros(self.batch_size, T, dtype=torch.long)
        labels = torch.full((self.batch_size, self.loops, T), -100, dtype=torch.long)
        w_early = self.weights(self.drawn - 1)[0].item()
        weights = torch.zeros(self.batch_size, self.loops)
        for b, i in enumerate(idx):
            p, a, per = self.items[i]
            seq = p + a
            tokens[b, :len(seq) - 1] = torch.tensor(seq[:-1])
            at = slice(len(p) - 1, len(p) - 1 + len(a))
            final = self.loops if self.align == "last" else min(len(per), self.loops)
            target = a if self.align == "last" or final == len(per) else per[final - 1]
            if len(target) == len(a):
                labels[b, final - 1, at] = torch.tensor(target)
            weights[b, :final - 1], weights[b, final - 1] = w_early, 1.0
            if self.per_loop and not self.final_only:
                # loop t (1-based) is graded on the state after step t, up to the final loop
                for t in range(1, min(final, len(per) + 1)):
                    if len(per[t - 1]) == len(a):
                        labels[b, t - 1, at] = torch.tensor(per[t - 1])
        return {"tokens": tokens, "labels": labels,
                "weights": self.weights(self.drawn - 1) if self.align == "last" else weights}

    def weights(self, batch: int) -> torch.Tensor:
        """Return the per-loop weights [loops] of the 0-based `batch` under the annealing schedule (align="last")."""
        w = torch.ones(self.loops)
        if self.anneal:
            w[:-1] = max(0.0, 1.0 - batch / self.anneal)
        return w

    def state_dict(self) -> dict[str, int]:
        """Return the position to restore (epoch, position, batches drawn, seed)."""
        return {"epoch": self.epoch, "position": self.position, "drawn": self.drawn, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by `state_dict` (the seed must match)."""
        if state["seed"] != self.seed:
            raise ValueError(f"seed={state['seed']} in the saved state does not match this sampler's seed={self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.drawn = int(state.get("drawn", 0))  # states written before annealing existed lack it
