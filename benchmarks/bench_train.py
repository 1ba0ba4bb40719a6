"""Trainer benchmarks (issue 4): tokens/s and model FLOP/s against a matmul, and activation memory of
full against truncated BPTT at r = 8. One process; run from the repository root:

    python benchmarks/bench_train.py [--steps 12]

Memory is counted two ways: the bytes autograd saves for backward (summed over distinct storages,
via saved_tensors_hooks: exactly what truncation removes) and, on CUDA, torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import LoopConfig, LoopLM  # noqa: E402
from workbench.train import Trainer, TrainConfig  # noqa: E402


def saved_bytes(model: LoopLM, x, y, r: int, k: int) -> int:
    """Return the bytes autograd keeps for backward in one training forward (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, loops=r, targets=y, backward_loops=k, return_logits=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(v for ptr, v in seen.items() if ptr not in params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    print("# bench_train (issue 4)")
    print(f"date   : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"torch  : {torch.__version__}  device={dev}  threads={torch.get_num_threads()}")

    cfg = LoopConfig(vocab_size=4096, d_model=256, n_heads=4, prelude=1, core=2, coda=1, loops=4)
    data = np.random.default_rng(0).integers(0, 4096, 400_000).astype(np.uint16)
    # fp32 eager: issue 4's target is the fp32 step against the fp32 matmul (bench_fast.py times the fast path)
    tc = TrainConfig(steps=args.steps, batch_size=8, seq_len=256, progress=False, device=str(dev), bf16="off",
                     compile="off")
    trainer = Trainer(cfg, tc, data)
    n = 1024
    a = torch.randn(n, n, device=dev)
    mm = []
    for _ in range(args.steps):
        t = time.perf_counter()
        for _ in range(10):
            a @ a
        if dev.type == "cuda":
            torch.cuda.synchronize()
        mm.append((time.perf_counter() - t) / 10)
        trainer.train_step()
    tok_s = statistics.median(trainer.metrics["tokens_per_s"][2:])
    fpt = trainer.model.flops_per_token(4, 4, seq_len=256, include_head=True)
    peak = 2 * n ** 3 / statistics.median(mm)
    print(f"trainer step ({cfg.notation}, d=256, batch 8x256, Muon+AdamW): {tok_s:,.0f} tokens/s, "
          f"{tok_s * fpt / 1e9:.1f} GFLOP/s = {100 * tok_s * fpt / peak:.1f}% of a fp32 1024^3 matmul "
          f"({peak / 1e9:.1f} GFLOP/s)  target >= 50%: {'PASS' if tok_s * fpt / peak >= 0.5 else 'FAIL'}")

    model = LoopLM(cfg).to(dev)
    x = torch.randint(0, 4096, (8, 256), device=dev)
    y = torch.randint(0, 4096, (8, 256), device=dev)
    full = saved_bytes(model, x, y, 8, 8)
    print("activation memory saved for backward at r = 8 (batch 8 x 256):")
    for k in (8, 4, 2, 1):
        b = saved_bytes(model, x, y, 8, k)
        extra = ""
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            model(x, loops=8, targets=y, backward_loops=k, return_logits=False).loss.backward()
            extra = f"   cuda peak {torch.cuda.max_memory_allocated() / 2**20:8.1f} MiB"
        print(f"  k = {k}: {b / 2**20:8.1f} MiB  ({b / full:.2f} of full BPTT){extra}")


if __name__ == "__main__":
    main()
