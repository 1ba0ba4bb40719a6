"""Trainer: the step loop. Full or truncated BPTT through the loops, Muon + AdamW, exact resume, DDP.

`Trainer.run()` sets up, then repeats `train_step()` (sample r and k, draw a batch, forward, backward,
clip, check, update, log) to the budget, evaluating and checkpointing on the way. The parts live
beside it: the loop sampler and budget (loops.py), optimisers and schedule (optimizers.py),
checkpoints, resume checks, signals and divergence (checkpoint.py), process groups (distributed.py),
compiled blocks (compile.py) and the retrofit's loop-1 distillation (distill.py).

Truncation (`backward_loops=k < r`): the first r-k loops run under `torch.no_grad` (no graph, so
memory really falls) and the state entering loop r-k+1 is detached. The prelude still receives
gradient through h0 wherever an initial-state or stable injection feeds h0 into the last k loops;
without injection, a truncated run trains the prelude not at all (its output reaches the loss only
through the detached state).

A non-finite loss or gradient norm (before the update) raises `Diverged` naming the step. A loss at
chance level (ln V) for CHANCE_STEPS steps past warmup is logged (logger "workbench.train") and kept in
the metrics' attrs.

Fast where it pays: `bf16="auto"` trains under bf16 autocast where the device does bf16 fast (a CPU
whose flags show AMX-BF16 or AVX512-BF16, a CUDA device with bf16; `models.precision`) and in fp32
elsewhere; weights, optimiser states, the loss and the cross-entropy's softmax stay fp32, so
checkpoints are fp32 and resume bit-exactly. `compile="auto"` compiles each Block (never the loop)
when the run is long enough to repay the first compile (`compile_pays`); steps that compiled are
timed apart. What "auto" chose is recorded in the metrics' attrs, and the run's progress file says
live where the run is (`workbench run` shows it). On CUDA a step waits for the device once: the loss,
gradient norm (and under DDP the ranks' mean loss and stop vote) come back in one transfer, checked
before the update; the update itself runs on while the next step's batch is drawn.

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
import logging
import math
import os
import signal
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from ..config import LoopConfig, check_bool, fail
from ..io import provenance, write_progress
from ..models.looped import LoopLM
from ..models.precision import autocast, precision_name, use_bf16
from .checkpoint import Checkpointer, Diverged, Interrupted, data_fingerprint, nonfinite
from .compile import compile_count, compile_pays, compiled_blocks
from .config import CHANCE_FRACTION, CHANCE_STEPS, METRICS, PROGRESS_EVERY_S, RESUME_FIELDS, TrainConfig, check_fit, \
    check_history_trains
from .distill import frozen_copy, loop1_kl
from .distributed import check_same_on_every_rank, init_distributed, is_distributed, pick_device, shard, sum_over_ranks
from .loops import budget_steps, sample_loops
from .optimizers import lr_at, make_optimizers, set_lr

log = logging.getLogger("workbench.train")  # warnings about a run (chance-level loss) go here and to its metrics


class Trainer:
    """Trains a LoopLM on token batches; `run()` returns the per-step metrics as an xarray Dataset."""

    def __init__(self, cfg: LoopConfig, tc: TrainConfig, train_data, val_data=None, out_dir=None,
                 resume: bool = False, model: LoopLM | None = None, overwrite: bool = False):
        check_bool("resume", resume)
        check_bool("overwrite", overwrite)
        if not isinstance(cfg, LoopConfig):
            fail("cfg", cfg, "must be a LoopConfig")
        if not isinstance(tc, TrainConfig):
            fail("tc", tc, "must be a TrainConfig")
        self.cfg, self.tc = cfg, tc
        self.out_dir = Path(out_dir) if out_dir is not None else None
        check_fit(cfg, tc)
        if model is None:  # a given model may have trained its far lags elsewhere (a fine-tune at fewer loops)
            check_history_trains(cfg, tc)
        # under torchrun the process group comes from the environment (a no-op alone, or when already made)
        self.rank, self.world, rank_device = init_distributed()
        self.dist = is_distributed()
        self.device = pick_device(tc.device, rank_device)
        self.model = (model if model is not None else LoopLM(cfg, seed=tc.seed)).to(self.device)
        if self.model.cfg != cfg:
            raise ValueError("model.cfg does not match cfg")
        # loop1_distill's reference: the model as given, before a resume loads a checkpoint (a retrofit's
        # base), frozen; its frozen parameters are shared with the model, only trainable ones are copied
        self.loop1_reference = frozen_copy(self.model) if tc.loop1_distill > 0 else None
        self.data_fingerprints = {"train": data_fingerprint(train_data), "val": data_fingerprint(val_data)}
        self.sampler, self.val_batches = self._samplers(train_data, val_data)
        self._ids_checked = self._check_ids_once(train_data)
        self.total_steps = budget_steps(self.model, tc, self.world)
        self.opts = make_optimizers(self.model, tc)
        # resolved once: what "auto" chose is recorded in the metrics' attrs, results and progress.json
        self.bf16 = use_bf16(tc.bf16, self.device)
        self.compiled, self.compile_reason = compile_pays(self.model, tc, self.total_steps, self.device, self.world)
        self._progress_at = -math.inf
        self._ranks_stop = False  # under DDP: whether any rank's signal was counted in the last step's vote
        self.step = 0
        self.metrics: dict[str, list] = {k: [] for k in METRICS}
        if self.loop1_reference is not None:
            self.metrics["loop1_kl"] = []  # the distillation term alone (loss includes it, weighted)
        self.evals: list[xr.Dataset] = []
        self.warnings: list[str] = []  # kept in checkpoints and the metrics' attrs
        self.failed: str | None = None
        self.checkpoints = Checkpointer(self.out_dir, tc, self.total_steps, self.rank, self.dist)
        try:  # the folder's writer lock is held from here until run() ends (or close())
            self.checkpoints.prepare(resume, overwrite)
            if resume:
                self._resume()
            self.train_model = self._for_ranks()  # compile acts on the blocks (compiled_blocks), never wraps the model
        except BaseException:
            self.checkpoints.close()
            raise

    # set-up -----------------------------------------------------------------------------------------------
    def _samplers(self, train_data, val_data) -> tuple[Any, list[torch.Tensor] | None]:
        """Return (training batch sampler, validation batches or None) for the data as given."""
        from ..data.corpus import BatchSampler

        tc = self.tc
        # the sampler draws the GLOBAL batch; each rank trains on its slice, so the run is the same at any world size
        if isinstance(train_data, np.ndarray) or torch.is_tensor(train_data):
            train_data = BatchSampler(np.asarray(train_data), tc.batch_size * self.world, tc.seq_len, seed=tc.seed)
        if val_data is None:
            return train_data, None
        vs = BatchSampler(np.asarray(val_data), min(tc.batch_size, 8), tc.seq_len, seed=tc.seed + 1)
        return train_data, [next(vs) for _ in range(tc.eval_batches)]

    def _check_ids_once(self, train_data) -> bool:
        """Return True after checking every token id of a token array once, on an accelerator; else False.

        On an accelerator the model's per-forward id check reads a device reduction back (a host-device
        sync per step); a token array checked here, on the host, where the data is given, makes it
        redundant for the whole run. Example samplers (dicts with labels) keep the per-forward check.
        """
        if self.device.type == "cpu" or not (isinstance(train_data, np.ndarray) or torch.is_tensor(train_data)):
            return False
        ids = torch.as_tensor(np.asarray(train_data).astype(np.int64, copy=False)).reshape(1, -1)
        self.model._check_tokens(ids, "train_data")
        return True

    def _for_ranks(self) -> torch.nn.Module:
        """Return the module a step calls: the model alone, or under DDP the model wrapped after the ranks agree."""
        if not self.dist:
            return self.model
        state = getattr(self.sampler, "state_dict", None)
        check_same_on_every_rank({**{k: getattr(self.tc, k) for k in RESUME_FIELDS},
                                  "model_config": self.cfg.to_json(), "step": self.step,
                                  "sampler": state() if state else None, "data": self.data_fingerprints})
        # find_unused_parameters: a step may leave parameters without gradient (truncation without
        # injection leaves the prelude out, a sampled r below the history window the far lags, r = 1
        # a retrofit's bridge). DDP then marks them ready and leaves their .grad None on every rank,
        # as one process would, instead of waiting for them and failing on the next step. Every rank
        # draws the same r (sample_loops is seeded by (seed, step), checked equal above), so
        # the same parameters go unused everywhere.
        return torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=True)

    # checkpoints (checkpoint.py does the work) -------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """Return what a checkpoint's state file holds beyond the weights and optimiser state."""
        return {"step": self.step, "model_config": self.cfg.to_json(), "train_config": self.tc.to_json(),
                "sampler": self.sampler.state_dict(), "metrics": self.metrics,
                "torch_rng": torch.get_rng_state().tolist(),
                "evals": [ds.to_dict() for ds in self.evals], "warnings": self.warnings,
                "data": self.data_fingerprints}

    def _resume(self) -> None:
        """Return None after loading the newest checkpoint and taking up its step, metrics, evals and warnings."""
        state = self.checkpoints.resume(self.cfg, self.data_fingerprints, self.model, self.opts, self.sampler,
                                        self.device)
        if state is None:
            return  # nothing yet: a fresh start
        self.step = int(state["step"])
        self.metrics = {k: list(v) for k, v in state["metrics"].items()}
        n = len(self.metrics["loss"])
        for k in METRICS:  # checkpoints written before step_s / compiled existed
            self.metrics.setdefault(k, [math.nan if k == "step_s" else 0.0] * n)
        self.evals = [xr.Dataset.from_dict(d) for d in state.get("evals", [])]
        self.warnings = list(state.get("warnings", []))

    def nonfinite(self) -> str | None:
        """Return the name of the first parameter or optimiser state that is not finite, or None when all are."""
        return nonfinite(self.model, self.opts)

    def save(self) -> Path | None:
        """Return the checkpoint folder written now (rank 0 only; None elsewhere or without out_dir).

        Raises Diverged, writing nothing, when a parameter or optimiser state is not finite.
        """
        if not self.checkpoints.writes:
            return None
        return self.checkpoints.save(self.model, self.opts, self._state())

    # the run ----------------------------------------------------------------------------------------------
    def run(self) -> xr.Dataset:
        """Return the metrics Dataset after training to the budget (checkpointing and evaluating on the way).

        Checkpoints come every `checkpoint_every` steps and whenever `checkpoint_seconds` have passed
        since the last one, and at the end. SIGINT or SIGTERM stops after the current step, saves a
        checkpoint and then acts as the signal would (KeyboardInterrupt, or termination): `resume=True`
        continues exactly there. A non-finite loss, gradient or parameter raises Diverged naming the
        step: no non-finite checkpoint is written, the last finite one stays, and latest.json and
        metrics.nc record the failure.
        """
        self.checkpoints.hold()  # again, when run() is called a second time
        try:
            models = [m for m in (self.model, self.loop1_reference) if m is not None]
            # the signals are caught through the final evaluation and save too: a signal there saves and
            # writes the metrics like one during a step (the evaluation is abandoned, not waited for)
            with self.checkpoints.catch_signals(), (_ids_checked(models) if self._ids_checked else nullcontext()):
                self._train_loop()
                if self.checkpoints.signal is None:
                    self._final_evaluation()
            if self.checkpoints.signal is not None:
                self._stop_on_signal()
            ds = self.metrics_dataset()
            self.checkpoints.write_metrics(ds)
            self._report_progress("done", force=True)
            return ds
        except Diverged as e:
            self.failed = str(e)  # before the metrics are written: their attrs carry it
            if self.checkpoints.writes:
                self.checkpoints.record_failure(e, self.metrics_dataset())
            self._report_progress("failed", force=True)
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Return None after giving back the run folder's writer lock (run() does this when it ends)."""
        self.checkpoints.close()

    def _final_evaluation(self) -> None:
        """Return None after evaluating at the last step (unless already done there) and saving the checkpoint."""
        try:
            if self.val_batches is not None and (not self.evals or int(self.evals[-1].step[0]) != self.step):
                self._report_progress("evaluating", force=True)
                with self.checkpoints.interruptible():
                    self.evals.append(self.evaluate())
        except Interrupted:
            pass  # the signal is kept: run() saves, writes the metrics and acts on it
        finally:  # a failing evaluation never costs the trained weights
            if self.checkpoints.signal is None:
                self.save()

    def _train_loop(self) -> None:
        """Return None after training to the budget, or after the step at which a signal asked to stop."""
        from tqdm.auto import tqdm

        bar = tqdm(total=self.total_steps, initial=self.step, desc="train",
                   disable=not self.tc.progress or self.rank != 0)
        self.model.train()
        self.checkpoints.reset_clock()
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
                if self.checkpoints.due(self.step) and self.step < self.total_steps:  # run() saves the last
                    self.save()
        finally:
            bar.close()

    # one step ---------------------------------------------------------------------------------------------
    def train_step(self) -> float:
        """Return the loss of one optimisation step (the step counter advances)."""
        r, k = sample_loops(self.step, self.tc, self.cfg.loops)
        lr = lr_at(self.step, self.total_steps, self.tc)
        set_lr(self.opts, lr)
        t0 = time.perf_counter()
        batch = next(self.sampler)
        if isinstance(batch, dict):  # per-loop supervision: the labels fix the loop count
            r = batch["labels"].shape[1]
            k = min(k, r)
        graphs = compile_count()
        loss, kl = self._forward(batch, r, k)
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
        # else no trainable parameter reaches this step's loss (an adapter retrofit at r = 1 is its frozen
        # base): every .grad stays None, the norm is 0 and the optimisers skip every parameter, on every rank
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                            self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf"))
        seen = self._read(loss, gn, kl)
        self._check_finite(seen, r, k)  # before the update: the weights in memory stay finite
        for opt in self.opts:
            opt.step()
        # no device synchronisation for the clock: the update's kernels finish while the next step's
        # batch is drawn and count in that step's time (the totals are the same)
        dt = time.perf_counter() - t0
        n_tok = (batch["tokens"].numel() if isinstance(batch, dict) else batch[:, :-1].numel())
        # each rank's loss is its shard's: log the whole batch's, as one process would
        value = seen["loss_sum"] / self.world if self.dist else seen["loss"]
        compiled = float(compile_count() != graphs)  # this step built a graph (forward and its backward)
        for key, v in (("loss", value), ("lr", lr), ("grad_norm", seen["grad_norm"]), ("tokens_per_s", n_tok / dt),
                       ("loops", r), ("backward_loops", k), ("step_s", dt), ("compiled", compiled)):
            self.metrics[key].append(v)
        if self.loop1_reference is not None:  # NaN for steps of a resumed run that trained without it
            self.metrics.setdefault("loop1_kl", [math.nan] * (len(self.metrics["loss"]) - 1)).append(seen["loop1_kl"])
        self.step += 1
        return value

    def _forward(self, batch, r: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (loss, loop-1 KL or None) of this rank's rows of a batch at r loops, k of them backpropagated."""
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
                return out.loss, None
            kl = loop1_kl(self.model, self.loop1_reference, x, out.cache["state.1"])
        return out.loss + self.tc.loop1_distill * kl, kl

    def _shard(self, x) -> torch.Tensor:
        """Return this rank's rows of a batch tensor, on the trainer's device (all rows when alone)."""
        return shard(x, self.rank, self.world, self.device)

    def _read(self, loss: torch.Tensor, gn: torch.Tensor, kl: torch.Tensor | None) -> dict[str, float]:
        """Return the step's loss, gradient norm, loop-1 KL and (DDP) summed loss and stop votes as floats.

        They come back from the device in one transfer: the step's one host-device synchronisation
        (separate .item() calls would each wait for the device).
        """
        parts = {"loss": loss.detach(), "grad_norm": gn.to(loss.device)}  # no gradient at all: a CPU zero
        if kl is not None:
            parts["loop1_kl"] = kl.detach()
        if self.dist:
            # the stop vote rides with the loss: the ranks agree on the step to stop after (any rank's
            # signal counts) without a collective of its own
            vote = torch.full((), float(self.checkpoints.signal is not None), device=loss.device)
            parts["loss_sum"], parts["stop_votes"] = sum_over_ranks(torch.stack([loss.detach().float(), vote]))
        values = dict(zip(parts, torch.stack([v.float() for v in parts.values()]).tolist()))
        if self.dist:
            self._ranks_stop = values["stop_votes"] > 0
        return values

    def _check_finite(self, seen: dict[str, float], r: int, k: int) -> None:
        """Return None when the step's loss and gradient norm are finite; else raise Diverged naming the step."""
        loss = seen["loss"]
        if not math.isfinite(loss):
            bad = self.nonfinite()  # weights the previous update broke: that step diverged, not this one
            if bad is not None and self.step > 0:
                raise self.checkpoints.diverged(self.step, f"after its update, {bad} is not finite (the next loss "
                                                           f"is {loss})")
            raise self.checkpoints.diverged(self.step + 1, f"the loss is {loss}", (r, k))
        if not math.isfinite(seen["grad_norm"]):
            raise self.checkpoints.diverged(self.step + 1, f"the gradient norm is {seen['grad_norm']} at loss "
                                                           f"{loss:.4g}", (r, k))

    # evaluation and metrics -------------------------------------------------------------------------------
    def evaluate(self) -> xr.Dataset:
        """Return a loop sweep of the validation batches at the eval loop counts (below, at and beyond K)."""
        from ..evals import loop_sweep

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

    def _report_progress(self, phase: str = "training", force: bool = False) -> None:
        """Rewrite the run's progress file (rank 0; at most every PROGRESS_EVERY_S unless forced): what `workbench run`
        shows while the run executes: phase, step of total, tokens/s and time left over the last non-compiling
        steps, latest loss, precision and compile."""
        if not self.checkpoints.writes:
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

    # signals ------------------------------------------------------------------------------------------------
    def _stop_requested(self) -> bool:
        """Return True when a signal asked this (or, under DDP, any) rank to stop; ranks agree on the step."""
        if not self.dist:
            return self.checkpoints.signal is not None
        if self._ranks_stop and self.checkpoints.signal is None:
            self.checkpoints.signal = signal.SIGTERM  # another rank's: stop here as it does
        return self._ranks_stop

    def _stop_on_signal(self) -> None:
        """Return never: save a checkpoint and the metrics, say where, then act as the signal would."""
        last = self.checkpoints.last_saved  # a signal during the final save: that checkpoint is this step's
        path = last[1] if last is not None and last[0] == self.step else self.save()
        if self.checkpoints.writes:
            self.checkpoints.write_metrics(self.metrics_dataset())
        self.checkpoints.act_on_signal(self.step, path)


@contextlib.contextmanager
def _ids_checked(models: list[LoopLM]):
    """Return a context within which the models skip their token-id check on an accelerator (restored after),
    so a model handed to the Trainer checks ids again when used on other data after training."""
    before = [m.ids_checked_upstream for m in models]
    for m in models:
        m.ids_checked_upstream = True
    try:
        yield
    finally:
        for m, b in zip(models, before):
            m.ids_checked_upstream = b
