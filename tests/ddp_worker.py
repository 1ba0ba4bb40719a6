"""Data-parallel training variants for tests/test_ddp.py: alone (the reference) or under torchrun (the ranks).

    python tests/ddp_worker.py OUT [--only NAME ...] [--kill-after STEP] [--resume]

Each variant trains a tiny model for a few steps into OUT/<name>/ (rank 0 writes the checkpoints and
metrics) and every rank also writes its final parameters to OUT/<name>/rank<R>.safetensors, so the
test can compare the ranks with each other and with one process. `--kill-after STEP` SIGKILLs every
rank right after the checkpoint of STEP is complete (a crash, not a signal the Trainer handles);
`--resume` continues the variants from their folders. Process start and the torch import take seconds,
so one invocation runs every variant.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from workbench import LoopConfig
from workbench.train import ExampleBatches, Trainer, TrainConfig, init_distributed

BATCH = 8  # the global batch: each of N ranks trains on BATCH // N rows


def tiny(**kw) -> LoopConfig:
    """Return a tiny 1+1x3+1 config (vocabulary 128) with the given fields changed."""
    base = dict(vocab_size=128, d_model=32, n_heads=4, n_kv_heads=2, prelude=1, core=1, coda=1, loops=3,
                max_seq_len=64)
    return LoopConfig(**{**base, **kw})


# name: (LoopConfig fields, TrainConfig fields); fp32, Muon off (its Newton-Schulz runs in bf16, which
# turns 1e-7 gradient rounding into ~1e-4 weight differences against one process) except "muon".
# Clipping (grad_clip=1.0) stays on everywhere.
VARIANTS: dict[str, tuple[dict, dict]] = {
    # the prelude reaches the loss only through the detached state: no gradient, every step
    "truncated_no_inject": (dict(inject="none"), dict(loops=3, backward_loops=1)),
    # r drawn per step (1..4): the same r on every rank, from the shared seed
    "depth_sampling": (dict(inject="channel"), dict(loop_sampler="uniform", loop_min=1, loop_max=4)),
    # lag 2 acts only from loop 4 on, lag 1 from loop 3: steps with r <= 3 leave lags without gradient
    "history_w2": (dict(history=2, history_op="channel"), dict(loop_sampler="uniform", loop_min=1, loop_max=4)),
    "hyper": (dict(hyper=2, hyper_dynamic=True, inject="channel"), dict()),
    "timestep": (dict(timestep="adaln"), dict(loop_sampler="poisson_lognormal", loop_max=5, backward_loops=2)),
    "per_loop": (dict(inject="channel"), dict()),  # ExampleBatches: every loop graded on its step
    # r = 1 skips the bridge: seed 1 draws r = 1, 2, 3 (the bridge untrained in step 1, then trained)
    "retrofit": (dict(), dict(loop_sampler="uniform", loop_min=1, loop_max=3, seed=1)),
    "muon": (dict(inject="channel"), dict(muon=True, lr=1e-2)),
    # the kill-and-resume run: 4 steps, a checkpoint every 2
    "resume": (dict(history=2, inject="channel"), dict(steps=4, checkpoint_every=2, loop_sampler="uniform",
                                                         loop_min=1, loop_max=4)),
}
DEFAULT = ("truncated_no_inject", "depth_sampling", "history_w2", "hyper", "timestep", "per_loop", "retrofit",
           "muon", "resume")


class Bytes:
    """A byte-level tokenizer for task examples."""

    def encode(self, s: str) -> list[int]:
        """Return the UTF-8 bytes of s."""
        return list(s.encode())


def train_config(name: str, world: int) -> TrainConfig:
    """Return the variant's TrainConfig for `world` processes (batch_size is per process)."""
    # lr 1e-3: AdamW steps a gradient entry that is ~0 (rounding-dominated) by up to lr whatever its size, so
    # at 1e-2 the fp32 rounding of half-batch means moved such entries by up to 1.7e-5 from one process
    fields = dict(steps=3, batch_size=BATCH // world, seq_len=16, lr=1e-3, warmup=0, muon=False, bf16="off",
                  compile="off", progress=False, checkpoint_seconds=0, seed=0)
    fields.update(VARIANTS[name][1])
    if name == "per_loop":
        fields["seq_len"] = 48
    return TrainConfig(**fields)


def make(name: str, world: int):
    """Return (cfg, tc, training data, model or None) of a variant; the data is the global batch's source."""
    tc = train_config(name, world)
    if name == "retrofit":  # a frozen-base adapter retrofit of a tiny random Llama (public API only)
        from workbench.models.hf import random_llama
        from workbench.models.retrofit import retrofit

        base = random_llama(vocab_size=128, d_model=32, layers=4, n_heads=4, n_kv_heads=2, d_ff=64, seed=0)
        model = retrofit(base, 1, 2, 1, budget="adapter", loops=2, adapter_rank=4, seed=0)
        data = np.random.default_rng(0).integers(0, 128, 20000).astype(np.uint16)
        return model.cfg, tc, data, model
    cfg = tiny(**VARIANTS[name][0])
    if name == "per_loop":
        from workbench.data.tasks import make_task

        exs = make_task("iterated", 64, depth=3, seed=0, rule="add")
        return cfg, tc, ExampleBatches(exs, Bytes(), BATCH, 3, seed=0), None
    return cfg, tc, np.random.default_rng(0).integers(0, 128, 20000).astype(np.uint16), None


def run_variant(name: str, out: Path, rank: int, world: int, resume: bool = False) -> dict:
    """Return {"steps_run": ...} after training a variant into out/name (and this rank's parameters saved)."""
    cfg, tc, data, model = make(name, world)
    folder = out / name
    trainer = Trainer(cfg, tc, data, out_dir=folder, model=model, resume=resume)
    start = trainer.step
    trainer.run()
    state = {k: v.detach().clone().contiguous() for k, v in trainer.model.state_dict().items()}
    save_file(state, str(folder / f"rank{rank}.safetensors"))
    return {"steps_run": trainer.step - start, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen variants (every rank alike) and return 0."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--only", nargs="*", default=list(DEFAULT))
    ap.add_argument("--kill-after", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    rank, world, _ = init_distributed()
    if args.kill_after:
        save = Trainer.save

        def save_then_die(self):
            path = save(self)
            if self.step == args.kill_after:
                if self.dist:
                    torch.distributed.barrier()  # rank 0's checkpoint is complete on every rank's side
                os.kill(os.getpid(), signal.SIGKILL)
            return path

        Trainer.save = save_then_die
    out = Path(args.out)
    done = {name: run_variant(name, out, rank, world, args.resume) for name in args.only}
    (out / f"done-rank{rank}.json").write_text(json.dumps(done))
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
