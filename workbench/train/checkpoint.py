"""A run's checkpoints: save, resume and its checks, keep-N, signals that save, divergence that saves nothing.

A checkpoint is a folder (`RunDir.checkpoint(step)`) holding the weights, the optimiser state and the
state file (step, sampler position, RNG state, configs, metrics so far); the run's pointer (RunDir.latest)
names the newest complete one and is replaced atomically only after the folder is complete
(`workbench.io.save_checkpoint`), so a run killed mid-write resumes from the previous checkpoint.

Nothing is lost and nothing bad is saved: checkpoints come by time (`checkpoint_seconds`, 300 s by
default) as well as by steps, and SIGINT / SIGTERM save one after the current step before acting as
the signal would, so a default run resumes. A non-finite parameter or optimiser state (checked before
every save) raises `Diverged` naming the step; the last finite checkpoint stays and the pointer records
the failure. A resumed run must keep its model config, seed, data and the settings in RESUME_FIELDS.
Rank 0 alone writes; on resume every rank loads the checkpoint rank 0 found.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import LoopConfig
from ..io import (RunDir, _load_optim_state, clear_run, holds_run, latest_checkpoint, load_tensors, load_weights,
                  mark_failed, read_json, read_manifest, refuse_foreign_files, save_checkpoint, save_netcdf)
from ..locking import RunLock
from .config import RESUME_FIELDS, TrainConfig
from .distributed import all_gather_json


class Diverged(FloatingPointError):
    """Training produced a non-finite loss, gradient or parameter; `step` is the 1-based step that did it."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class Interrupted(Exception):
    """A signal ended an interruptible phase (the final evaluation) early; the Trainer saves and then acts on it."""


def data_fingerprint(tokens) -> str | None:
    """Return a cheap fingerprint of a token array (length and 65,536 evenly spaced values), or None for other data."""
    if not (isinstance(tokens, np.ndarray) or torch.is_tensor(tokens)):
        return None
    arr = np.asarray(tokens).reshape(-1)
    idx = np.linspace(0, max(len(arr) - 1, 0), num=min(len(arr), 65536)).astype(np.int64)
    sample = np.ascontiguousarray(arr[idx].astype(np.int64))  # hashing all of a large shard would take seconds
    return f"{len(arr)}:{hashlib.sha256(sample.tobytes()).hexdigest()[:16]}"


def nonfinite(model: torch.nn.Module, opts: list[torch.optim.Optimizer]) -> str | None:
    """Return the name of the first parameter or optimiser state that is not finite, or None when all are."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            return f"parameter {name}"
    names = {id(p): n for n, p in model.named_parameters()}
    for opt in opts:
        for p, st in opt.state.items():
            for key, v in st.items():
                if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    return f"optimiser state {key} of {names.get(id(p), '?')}"
    return None


class Checkpointer:
    """One run folder's checkpoints: when to save, saving (rank 0), resuming with its checks, signals, failures."""

    def __init__(self, out_dir, tc: TrainConfig, total_steps: int, rank: int = 0, dist: bool = False):
        self.run = RunDir(out_dir) if out_dir is not None else None
        self.tc, self.total_steps, self.rank, self.dist = tc, total_steps, rank, dist
        self.signal: int | None = None  # the signal that asked this process to stop (catch_signals)
        self._interruptible = False  # inside `interruptible()`: a first signal raises Interrupted
        self.last_saved: tuple[int, Path] | None = None  # (step, folder) of the newest checkpoint written here
        # the one writer of the folder from `prepare` until `close` (rank 0): another training, an --overwrite,
        # a pipeline run or `workbench clean` there is refused meanwhile, naming this process
        self.lock = RunLock(self.run.path, "training (Trainer)") if self.writes else None
        self.saved_at = time.monotonic()  # the clock of checkpoint_seconds

    def hold(self) -> None:
        """Return None once this process holds the folder's writer lock (rank 0 with an out_dir; else nothing)."""
        if self.lock is not None:
            self.lock.acquire()

    def close(self) -> None:
        """Return None after giving back the folder's writer lock (taken by `prepare`)."""
        if self.lock is not None:
            self.lock.release()

    @property
    def writes(self) -> bool:
        """Return True in the process that writes the run folder (rank 0, with an out_dir)."""
        return self.run is not None and self.rank == 0

    # ---- before training ---------------------------------------------------------------------------------
    def prepare(self, resume: bool, overwrite: bool) -> None:
        """Return None once the folder is writable and holds no other run (refused, or cleared with overwrite)."""
        if not self.writes:
            return
        out = self.run.path
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"out_dir={str(out)!r} is not writable: {e}") from e
        self.hold()  # before anything in the folder is read or changed
        refuse_foreign_files(out, overwrite)  # someone's metrics.nc / results.nc: never overwritten unasked
        if not resume and holds_run(out) and self.run.latest.exists():
            if not overwrite:
                raise FileExistsError(f"out_dir={str(out)!r} already holds a run ({RunDir.LATEST}): pass "
                                      "resume=True to continue it or overwrite=True to replace it")
            clear_run(out, checkpoints_only=True)  # a tokenizer written for this run stays

    def resume(self, cfg: LoopConfig, fingerprints: dict, model: torch.nn.Module, opts: list, sampler,
               device: torch.device) -> dict[str, Any] | None:
        """Return the newest checkpoint's state after checking it belongs to this run and loading it into the
        model, optimisers, sampler and torch's RNG; None when there is none yet (a fresh start)."""
        if self.run is None:
            raise ValueError("resume=True needs an out_dir to resume from")
        path = latest_checkpoint(self.run.path) if self.rank == 0 else None
        if self.dist:  # every rank loads the checkpoint rank 0 found (the run folder is shared)
            path = all_gather_json(None if path is None else str(path))[0]
            path = None if path is None else Path(path)
        if path is None:
            return None
        state = read_json(path / RunDir.CKPT_STATE, "checkpoint state")
        self._check_resumable(path, state, cfg, fingerprints)
        load_weights(model, load_tensors(path / RunDir.CKPT_MODEL, device=str(device), state=state), state, path)
        _load_optim_state(opts, load_tensors(path / RunDir.CKPT_OPTIM, device=str(device), state=state),
                          state["optim"])
        sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        return state

    def _check_resumable(self, path: Path, state: dict, cfg: LoopConfig, fingerprints: dict) -> None:
        """Return None when the checkpoint was written for this model config, RESUME_FIELDS and data; else raise."""
        saved = LoopConfig.from_json(state["model_config"])
        if saved != cfg:
            diff = {k: (v, getattr(cfg, k)) for k, v in saved.to_dict().items() if getattr(cfg, k) != v}
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
            if fp is not None and fingerprints.get(part) not in (None, fp):
                raise ValueError(f"checkpoint {path} was trained on other {part} data (fingerprint {fp} then, "
                                 f"{fingerprints[part]} now: length and sampled token ids differ); a "
                                 "resumed run must see the same data")

    # ---- while training ----------------------------------------------------------------------------------
    def reset_clock(self) -> None:
        """Return None after restarting the checkpoint_seconds clock (training starts now)."""
        self.saved_at = time.monotonic()

    def due(self, step: int) -> bool:
        """Return True when a checkpoint is due after 1-based `step`: every checkpoint_every steps, or by time."""
        every = self.tc.checkpoint_every and step % self.tc.checkpoint_every == 0
        late = self.tc.checkpoint_seconds and time.monotonic() - self.saved_at >= self.tc.checkpoint_seconds
        return bool(every or late)

    def save(self, model: torch.nn.Module, opts: list, state: dict[str, Any]) -> Path | None:
        """Return the checkpoint folder written now for state["step"] (keeping keep_checkpoints); None off rank 0.

        Raises Diverged, writing nothing, when a parameter or optimiser state is not finite.
        """
        if not self.writes:
            return None
        bad = nonfinite(model, opts)
        if bad is not None:
            raise self.diverged(state["step"], f"after its update, {bad} is not finite")
        path = save_checkpoint(self.run.path, model, opts, state, self.tc.keep_checkpoints,
                               trainable_only=not self.tc.save_frozen)
        self.saved_at = time.monotonic()
        self.last_saved = (state["step"], path)
        return path

    def write_metrics(self, ds) -> None:
        """Return None after writing the run's metrics Dataset (rank 0, with an out_dir; elsewhere nothing)."""
        if self.writes:
            save_netcdf(ds, self.run.metrics)

    # ---- signals -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def catch_signals(self):
        """Return a context within which SIGINT / SIGTERM set `signal` (stop after this step); a second stops now."""
        self.signal = None
        if threading.current_thread() is not threading.main_thread():
            yield  # handlers can only be installed from the main thread
            return
        old = {}

        def handler(signum, frame):
            if self.signal is not None:  # asked twice: stop now; the last checkpoint stands
                signal.signal(signum, old[signum])
                signal.raise_signal(signum)
                return
            self.signal = signum
            if self._interruptible:  # the final evaluation: abandoned, so the save comes now, not minutes later
                self._interruptible = False
                raise Interrupted(signal.Signals(signum).name)

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

    @contextlib.contextmanager
    def interruptible(self):
        """Return a context that a first SIGINT / SIGTERM ends at once with Interrupted (the signal is kept)."""
        if self.signal is not None:
            raise Interrupted(signal.Signals(self.signal).name)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def act_on_signal(self, step: int, path: Path | None) -> None:
        """Return never: say where the checkpoint is, then act as the signal would (KeyboardInterrupt, or exit)."""
        sig = self.signal
        if self.rank == 0:
            where = f"checkpoint {path}" if path is not None else "nothing saved (no out_dir)"
            print(f"workbench: {signal.Signals(sig).name} at step {step} of {self.total_steps}: {where}; "
                  "resume=True (workbench train --resume) continues from it", file=sys.stderr, flush=True)
        signal.raise_signal(sig)  # the handlers are restored: the signal does what it would have done
        raise KeyboardInterrupt(f"training stopped by {signal.Signals(sig).name} at step {step}")

    # ---- divergence --------------------------------------------------------------------------------------
    def diverged(self, step: int, what: str, loops: tuple[int, int] | None = None) -> Diverged:
        """Return the Diverged error for 1-based `step`, naming what was not finite and the last finite checkpoint."""
        last = last_step = None
        if self.run is not None:
            try:
                last = latest_checkpoint(self.run.path)
                last_step = (read_manifest(self.run.path) or {}).get("step") if last is not None else None
            except (OSError, ValueError):
                last = None
        where = (f"the last finite checkpoint is {last} (step {last_step})" if last is not None
                 else "no checkpoint was written before it" if self.run is not None else "no out_dir to save to")
        at = f" (loops={loops[0]}, backward_loops={loops[1]})" if loops else ""
        return Diverged(f"training diverged at step {step} of {self.total_steps}: {what}{at}; nothing after it was "
                        f"saved, {where}; lower lr, raise warmup or clip gradients (grad_clip) and retrain", step)

    def record_failure(self, error: Diverged, ds) -> None:
        """Return None after marking the run failed at error.step in its pointer and writing the metrics up to it
        (rank 0, with an out_dir; elsewhere nothing)."""
        if self.writes:
            mark_failed(self.run.path, error.step, str(error))
            save_netcdf(ds, self.run.metrics)
