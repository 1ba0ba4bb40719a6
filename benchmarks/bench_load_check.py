"""What checking a checkpoint on load costs (issue 29): the xxh3-128 hash of the weights file and the finiteness of
every tensor, against loading the same file unchecked, side by side in one process.

The checkpoint has SmolLM2-135M's shapes (d = 576, 30 layers, vocabulary 49,152, SwiGLU width 1,536: what a
full-budget retrofit of it saves), written by `io.save_checkpoint` with its model weights and AdamW state.

Usage: python benchmarks/bench_load_check.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from safetensors.torch import load_file  # noqa: E402

from workbench import LoopConfig  # noqa: E402
from workbench.io import RunDir, file_hash, load_model, load_tensors, read_json, save_checkpoint  # noqa: E402
from workbench.models.looped import LoopLM  # noqa: E402


def best_of(fn, n: int = 5) -> float:
    """Return the fastest of n timed calls (seconds)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    """Print load seconds unchecked and checked, and the check's share, for the model and optimiser files."""
    # 30 distinct layers as SmolLM2 has (4 + 22 x r + 4), untied head: what a full-budget retrofit saves
    cfg = LoopConfig(vocab_size=49152, d_model=576, n_heads=9, n_kv_heads=3, prelude=4, core=22, coda=4, loops=2,
                     d_ff=1536, max_seq_len=2048)
    model = LoopLM(cfg)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():  # one step, so the optimiser state exists (exp_avg, exp_avg_sq)
        p.grad = torch.zeros_like(p)
    opt.step()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_checkpoint(tmp, model, [opt], {"step": 1, "model_config": cfg.to_json()})
        state = read_json(ckpt / RunDir.CKPT_STATE)
        print(f"torch threads {torch.get_num_threads()}; parameters {sum(p.numel() for p in model.parameters()):,}")
        path = ckpt / RunDir.CKPT_MODEL
        # what opening a run does with the weights: read them into the model (load_file alone maps the file)
        plain = best_of(lambda: model.load_state_dict(load_file(str(path))))
        checked = best_of(lambda: model.load_state_dict(load_tensors(path, state=state)))
        sha = best_of(lambda: file_hash(path))
        print(f"{path.name}: {path.stat().st_size / 2**20:,.0f} MiB; read into the model in {plain:.3f} s unchecked, "
              f"{checked:.3f} s checked (+{checked - plain:.3f} s, {100 * (checked - plain) / checked:.0f}% of the "
              f"checked load; the hash alone {sha:.3f} s)")
        opened = best_of(lambda: load_model(ckpt), n=3)
        print(f"load_model (build the model, read and check its weights): {opened:.3f} s, of which the check "
              f"{checked - plain:.3f} s ({100 * (checked - plain) / opened:.0f}%)")
        path = ckpt / RunDir.CKPT_OPTIM
        plain = best_of(lambda: [t.clone() for t in load_file(str(path)).values()])
        checked = best_of(lambda: [t.clone() for t in load_tensors(path, state=state).values()])
        print(f"{path.name}: {path.stat().st_size / 2**20:,.0f} MiB; read in {plain:.3f} s unchecked, {checked:.3f} s "
              f"checked (+{checked - plain:.3f} s)")

if __name__ == "__main__":
    main()
