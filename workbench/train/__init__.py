"""Training: `Trainer` (the step loop) and the parts it is made of, each usable on its own.

    config.py        TrainConfig, check_fit, check_history_trains, RESUME_FIELDS and the trainer's constants
    trainer.py       Trainer: set-up, then per step sample r and k, batch, forward, backward, check, update, log
    loops.py         sample_loops (fixed, uniform, Poisson-lognormal), the step budget, training FLOPs, per_loop_loss
    optimizers.py    param_groups, make_optimizers (Muon + AdamW), lr_at (warmup, cosine / WSD / constant)
    checkpoint.py    Checkpointer (save, resume and its checks, keep-N, signals, divergence), Diverged
    distributed.py   init_distributed and the rank helpers (torchrun / DDP)
    compile.py       compile_pays, compiled_blocks, compile_count
    distill.py       the retrofit's loop-1 distillation: frozen_copy, loop1_kl

Task-example batches (`ExampleBatches`) live in workbench.data.batches (re-exported here for the code
that imported them from the trainer); checkpoint files are read and written by workbench.io.
"""

from ..data.batches import ExampleBatches
from .checkpoint import Checkpointer, Diverged, data_fingerprint, nonfinite
from .compile import COMPILE_AUTO_FLOPS, compile_count, compile_pays, compiled_blocks
from .config import (CHANCE_FRACTION, CHANCE_STEPS, LOOP_SAMPLERS, METRICS, PROGRESS_EVERY_S, RESUME_FIELDS,
                     SCHEDULES, TrainConfig, check_fit, check_history_trains, max_train_loops)
from .distill import frozen_copy, loop1_kl
from .distributed import init_distributed
from .loops import budget_steps, per_loop_loss, sample_loops, training_flops
from .optimizers import lr_at, make_optimizers, param_groups
from .trainer import Trainer

__all__ = ["CHANCE_FRACTION", "CHANCE_STEPS", "COMPILE_AUTO_FLOPS", "Checkpointer", "Diverged", "ExampleBatches",
           "LOOP_SAMPLERS", "METRICS", "PROGRESS_EVERY_S", "RESUME_FIELDS", "SCHEDULES", "TrainConfig", "Trainer",
           "budget_steps", "check_fit", "check_history_trains", "compile_count", "compile_pays", "compiled_blocks",
           "data_fingerprint", "frozen_copy", "init_distributed", "loop1_kl", "lr_at", "make_optimizers",
           "max_train_loops", "nonfinite", "param_groups", "per_loop_loss", "sample_loops", "training_flops"]
