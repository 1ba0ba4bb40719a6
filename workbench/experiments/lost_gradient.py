"""Lost gradient across loop counts on a trained run, and its change over a short fine-tune (issue 20).

`finetune_lost_gradient(run, ...)` measures `probes.lost_gradient` (SPEC §3: one forward and one
backward give lost(k), cos and projected for every k) on several independent validation batches at
each loop count r, first on the trained model (step 0) and then every `every` optimiser steps of a
fine-tune of a COPY of the run's model on the run's own training data and training config. The run's
model is never changed.

Fine-tune defaults, and why: the learning rate is the one the run ended training at (its peak lr times
`min_lr_ratio` after a cosine or warmup-stable-decay schedule, the peak for a constant one), held
constant after a short warmup. The fine-tune then continues the run where it stopped, so what changes
in the lost gradient comes from the fine-tune's backprop depth, not from re-warming a decayed model
to its peak rate (which would first knock its loss up). The warmup (a tenth of the steps, at most 10)
lets the fresh optimiser moments settle: the run's own optimiser state is not reloaded.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Sequence

import numpy as np
import torch
import xarray as xr

from ..config import check_bool, check_choice, check_float, check_int, fail
from ..io import provenance, read_run_config

FINETUNE_SEED_OFFSET = 1  # fine-tune batches use the run's seed + 1 + seed: not the run's first batches replayed


def _loop_counts(value: Any, field: str = "loops") -> list[int]:
    """Return the loop counts as a list of distinct integers >= 1, else fail naming the field or element."""
    from .runs import _int_list

    out = _int_list(field, value, 1, allow_none=False)
    if not out:
        fail(field, value, "must be a non-empty list of distinct integers >= 1 (loop counts r)")
    if len(set(out)) != len(out):
        fail(field, value, "must not repeat a loop count")
    return out


def finetune_config(run, steps: int, backward_loops: int = 0, lr: float | None = None,
                    warmup: int | None = None, seed: int = 0):
    """Return the TrainConfig of a fine-tune of `run`: its own training config with the fine-tune's budget and settings.

    `backward_loops` 0 is full BPTT, else the fine-tune backpropagates through the last k loops only;
    `lr` None is the lr the run ended training at (see the module docstring), held constant after
    `warmup` steps (None: a tenth of the steps, at most 10). No evaluation, no checkpoints, no bar.
    """
    from ..train import TrainConfig

    tc = TrainConfig.from_dict(read_run_config(run.path).get("train") or {"steps": 1})
    K = run.model.cfg.loops
    steps = check_int("steps", steps, 1)
    backward_loops = check_int("backward_loops", backward_loops, 0, K,
                               allowed=f"must be 0 (full BPTT) or an integer in 1..K={K} (truncated BPTT)")
    if lr is None:
        lr = tc.lr if tc.schedule == "constant" else tc.lr * tc.min_lr_ratio
    lr = check_float("lr", lr, 0, lo_open=True, allowed="must be None (the run's final lr) or a finite number > 0")
    if warmup is None:
        warmup = min(10, steps // 10)
    warmup = check_int("warmup", warmup, 0, steps, allowed=f"must be None or an integer in 0..steps={steps}")
    device = str(next(run.model.parameters()).device)
    return dataclasses.replace(tc, steps=steps, tokens=None, flops=None, chinchilla=False,
                               backward_loops=backward_loops or None, lr=lr, warmup=warmup, schedule="constant",
                               eval_every=0, checkpoint_every=0, checkpoint_seconds=0.0, progress=False,
                               device=device, seed=tc.seed + FINETUNE_SEED_OFFSET + check_int("seed", seed, 0))


def check_finetune_lost_gradient(loops: Sequence[int], steps: int, every: int, backward_loops: int, lr: float | None,
                                 warmup: int | None, n_batches: int, n_sequences: int, seq_len: int, seed: int,
                                 params: str, progress: bool) -> list[int]:
    """Return the loop counts as a list after checking every argument of finetune_lost_gradient but the run."""
    from ..probes.gradients import PARAMS

    rs = _loop_counts(loops)
    check_int("steps", steps, 0, allowed="must be an integer >= 0 (fine-tune steps; 0: the trained model only)")
    check_int("every", every, 1, allowed="must be an integer >= 1 (measure every this many fine-tune steps)")
    check_int("backward_loops", backward_loops, 0, allowed="must be an integer >= 0 (0: full BPTT, else k)")
    if lr is not None:
        check_float("lr", lr, 0, lo_open=True, allowed="must be None (the run's final lr) or a finite number > 0")
    if warmup is not None:
        check_int("warmup", warmup, 0, allowed="must be None or an integer >= 0")
    check_int("n_batches", n_batches, 1)
    check_int("n_sequences", n_sequences, 1)
    check_int("seq_len", seq_len, 2)
    check_int("seed", seed, 0)
    check_choice("params", params, PARAMS)
    check_bool("progress", progress)
    return rs


def finetune_lost_gradient(run, loops: Sequence[int] = (2, 4, 8), steps: int = 0, every: int = 10,
                           backward_loops: int = 0, lr: float | None = None, warmup: int | None = None,
                           n_batches: int = 4, n_sequences: int = 8, seq_len: int = 128, seed: int = 0,
                           params: str = "core", progress: bool = False) -> xr.Dataset:
    """Return a Dataset of the lost gradient per fine-tune step, loop count, validation batch and k.

    Dims: `step` (fine-tune steps measured: 0 = the trained model, then every `every` and the last),
    `loops` (r), `batch` (`n_batches` independent validation batches of `n_sequences` windows of
    `seq_len` tokens, drawn once with `seed`), `k` (1..max r; NaN where k > r) and `loop` (t = 0..max r;
    NaN past r). Variables: `lost`, `cos`, `projected` over (step, loops, batch, k), `lost_half` =
    lost at SPEC's truncation point k = ceil(r/2), `rho`, `loss` (validation loss at r) and
    `grad_norm` |g| over (step, loops, batch), `adjoint_norm` over (step, loops, batch, loop), and
    `train_loss` over step (the fine-tune's mean training loss since the previous measurement; NaN at
    step 0), plus `train_loss_curve` over `train_step` (every fine-tune step) when `steps` > 0. Each
    entry is `probes.lost_gradient` on that batch at that r. The fine-tune (`steps` > 0) trains a
    deep copy of `run.model` with `finetune_config` (the run's config, `backward_loops` 0 = full BPTT,
    else k; `lr` None = the run's final lr) through the library's Trainer; `run.model` is unchanged.
    Every argument is checked before any work.
    """
    from tqdm.auto import tqdm

    from ..probes import lost_gradient
    from ..train import Trainer

    rs = check_finetune_lost_gradient(loops, steps, every, backward_loops, lr, warmup, n_batches, n_sequences,
                                      seq_len, seed, params, progress)
    if not (hasattr(run, "model") and hasattr(run, "val_tokens") and hasattr(run, "path")):
        fail("run", type(run).__name__, "must be a Run (workbench.experiments.load_run)")
    tc = finetune_config(run, steps, backward_loops, lr, warmup, seed) if steps > 0 else None
    windows = run.val_tokens(n_batches * n_sequences, seq_len, seed=seed)
    if windows.shape[0] < n_batches * n_sequences:
        fail("n_batches", n_batches, f"needs n_batches x n_sequences = {n_batches * n_sequences} validation windows; "
                                     f"the run's validation split gives {windows.shape[0]}")
    device = next(run.model.parameters()).device
    batches = [windows[b * n_sequences:(b + 1) * n_sequences].to(device) for b in range(n_batches)]
    model = copy.deepcopy(run.model)  # the run stays as it was trained
    measured = sorted({0, *range(every, steps + 1, every), steps})
    R = max(rs)
    shape = (len(measured), len(rs), n_batches)
    out = {v: np.full(shape + (R,), np.nan) for v in ("lost", "cos", "projected")}
    out["adjoint_norm"] = np.full(shape + (R + 1,), np.nan)
    for v in ("lost_half", "rho", "loss", "grad_norm"):
        out[v] = np.full(shape, np.nan)
    train_loss = np.full(len(measured), np.nan)
    trainer = Trainer(model.cfg, tc, np.asarray(run.data().train), model=model) if tc is not None else None
    bar = tqdm(total=len(measured) * len(rs) * n_batches, desc="lost gradient", disable=not progress)
    for i, s in enumerate(measured):
        if trainer is not None and s > trainer.step:
            losses = [trainer.train_step() for _ in range(s - trainer.step)]
            train_loss[i] = float(np.mean(losses))
        for j, r in enumerate(rs):
            for b, batch in enumerate(batches):
                ds = lost_gradient(model, batch[:, :-1], batch[:, 1:], r, params=params)
                for v in ("lost", "cos", "projected"):
                    out[v][i, j, b, :r] = ds[v].values
                out["adjoint_norm"][i, j, b, :r + 1] = ds.adjoint_norm.values
                out["lost_half"][i, j, b] = float(ds.lost.sel(k=math.ceil(r / 2)))
                out["rho"][i, j, b] = ds.attrs["rho"]
                out["loss"][i, j, b] = ds.attrs["loss"]
                out["grad_norm"][i, j, b] = ds.attrs["grad_norm"]
                bar.update()
    bar.close()
    d4, d3 = ("step", "loops", "batch", "k"), ("step", "loops", "batch")
    data = {
        "lost": (d4, out["lost"], {"long_name": "|g - G_k| / |g|"}),
        "cos": (d4, out["cos"], {"long_name": "cos(g, G_k)"}),
        "projected": (d4, out["projected"], {"long_name": "1 - <g, G_k> / |g|^2"}),
        "lost_half": (d3, out["lost_half"], {"long_name": "|g - G_k| / |g| at k = ceil(r/2)"}),
        "rho": (d3, out["rho"], {"long_name": "backward shrink rho fitted to the adjoint norms"}),
        "loss": (d3, out["loss"], {"long_name": "validation loss at r (nats/token)"}),
        "grad_norm": (d3, out["grad_norm"], {"long_name": "|g|, full-BPTT gradient norm of the loop-shared weights"}),
        "adjoint_norm": (("step", "loops", "batch", "loop"), out["adjoint_norm"], {"long_name": "|dL/dh_t|"}),
        "train_loss": ("step", train_loss,
                       {"long_name": "fine-tune training loss (nats/token), mean since the previous measurement"}),
    }
    coords = {"step": measured, "loops": rs, "batch": np.arange(n_batches), "k": np.arange(1, R + 1),
              "loop": np.arange(R + 1)}
    if trainer is not None:
        data["train_loss_curve"] = ("train_step", np.asarray(trainer.metrics["loss"], float),
                                    {"long_name": "fine-tune training loss per step (nats/token)"})
        coords["train_step"] = np.arange(1, steps + 1)
    ft = dict(finetune_steps=steps, every=every, finetune_backward_loops=backward_loops,
              finetune_lr=tc.lr if tc else float("nan"), finetune_warmup=tc.warmup if tc else 0,
              finetune_seed=tc.seed if tc else -1, finetune_bf16=str(trainer.bf16) if trainer else "",
              finetune_train_loops=int(tc.loops or run.model.cfg.loops) if tc else run.model.cfg.loops)
    return xr.Dataset(data, coords=coords, attrs=provenance(
        run.model.cfg, seed, kind="finetune_lost_gradient", checkpoint=str(run.path),
        training_loops=run.model.cfg.loops, n_sequences=n_sequences, seq_len=int(batches[0].shape[1] - 1),
        params=params, **ft))


def check_lost_gradient_notebook(p: dict) -> None:
    """Return None when the lost_gradient notebook's parameters are valid, else raise ValueError naming the bad one."""
    check_int("loops", p.get("loops", 0), 0, allowed="must be 0 (the training loop count K) or an integer >= 1")
    if p.get("loop_counts"):
        _loop_counts(p["loop_counts"], "loop_counts")
    check_int("finetune_steps", p.get("finetune_steps", 0), 0)
    check_int("measure_every", p.get("measure_every", 10), 1)
    check_int("finetune_backward_loops", p.get("finetune_backward_loops", 0), 0,
              allowed="must be an integer >= 0 (0: full BPTT, else k)")
    check_float("finetune_lr", p.get("finetune_lr", 0.0), 0, allowed="must be 0 (the run's final lr) or a number > 0")
    for name, lo in (("n_batches", 1), ("n_sequences", 1), ("seq_len", 2), ("seed", 0)):
        check_int(name, p.get(name, lo), lo)
