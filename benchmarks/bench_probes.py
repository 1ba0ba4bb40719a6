"""Probe speed benchmarks (issue 5): one-pass probes against the obvious per-k / per-skip loops.

Everything runs in one process, interleaved (A B A B ...): warmup rounds are discarded, then the
median over the timed rounds is reported, so background load hits both contenders alike. The fast
and the slow way are also checked to give the same numbers. Run from the repository root:

    python benchmarks/bench_probes.py            # default run (about a minute on 2 idle CPU cores)
    python benchmarks/bench_probes.py --quick    # fewer repeats
    python benchmarks/bench_probes.py --device cuda

Targets checked (PASS/FAIL), on a 1+2x4+1 LoopLM (d_model 256), batch 4 x seq 128, r = 8:
  1  t(8 truncated backward passes, k = 1..8) / t(lost_gradient, every k from one backward) >= 4
  2  t(one forward per skipped block occurrence) / t(interaction, batched skips) >= 3

The slow contenders are written as a user would: for (1) `model(x, loops=8, backward_loops=k,
targets=y)` and `torch.autograd.grad` per k, then the same metrics; for (2) a plain pass plus one
pass per skipped occurrence through prelude, loops and coda (no LM head, which C does not need),
with forward hooks that skip occurrence i and record every update.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench import probes  # noqa: E402
from workbench.config import LoopConfig  # noqa: E402
from workbench.models import LoopLM  # noqa: E402

from bench_model import cpu_model, interleaved  # noqa: E402  (same folder: one timing loop for all benchmarks)

D_MODEL, N_HEADS, VOCAB, SEQ, BATCH, LOOPS = 256, 4, 4096, 128, 4, 8


# ---- the slow contenders ----------------------------------------------------------------------------
def lost_per_k(model: LoopLM, x: torch.Tensor, y: torch.Tensor, r: int) -> np.ndarray:
    """Return lost(k), k = 1..r, from r separate truncated backward passes."""
    params = [p for n, p in model.named_parameters() if n.startswith("core.")]
    grads = []
    for k in range(1, r + 1):
        loss = model(x, loops=r, backward_loops=k, targets=y).loss
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]).double())
    g = grads[-1]
    return np.array([float((g - G).norm() / g.norm()) for G in grads])


def interaction_per_skip(model: LoopLM, x: torch.Tensor, r: int) -> np.ndarray:
    """Return C [n, n] from a plain pass and one pass per skipped occurrence (forward hooks)."""
    blocks = [*model.prelude, *model.core, *model.coda]
    n = model.cfg.prelude + r * model.cfg.core + model.cfg.coda
    state = {"j": 0, "skip": None, "u": []}

    def hook(module, args, out):
        j = state["j"]
        state["j"] += 1
        if j == state["skip"]:
            out = args[0]
        state["u"].append(out - args[0])
        return out

    def run(skip):
        state.update(j=0, skip=skip, u=[])
        handles = [b.register_forward_hook(hook) for b in blocks]
        try:
            with torch.no_grad():
                model.run(x, r, coda=True)  # prelude, loops, coda; no head
        finally:
            for h in handles:
                h.remove()
        return state["u"]

    base = run(None)
    den = [float(u.norm(dim=-1).mean()) for u in base]
    C = np.full((n, n), np.nan)
    for i in range(n - 1):
        us = run(i)
        for j in range(i + 1, n):
            C[i, j] = float((us[j] - base[j]).norm(dim=-1).mean()) / den[j]
    return C


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, noisier numbers)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7, quick 2)")
    ap.add_argument("--warmup", type=int, default=1, help="discarded rounds (default 1)")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 7)
    warmup = args.warmup
    device = torch.device(args.device)

    print("# bench_probes (issue 5)")
    print(f"date          : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"python        : {platform.python_version()}   torch: {torch.__version__}")
    print(f"cpu           : {cpu_model()}  ({os.cpu_count()} logical cores)")
    print(f"torch threads : {torch.get_num_threads()} (default, not changed)")
    if device.type == "cuda":
        print(f"gpu           : {torch.cuda.get_device_name(device)}")
    cfg = LoopConfig(vocab_size=VOCAB, d_model=D_MODEL, n_heads=N_HEADS, prelude=1, core=2, coda=1, loops=4,
                     max_seq_len=1024)
    print(f"model         : {cfg.notation}  d_model={D_MODEL} n_heads={N_HEADS} vocab={VOCAB} fp32")
    print(f"batch         : {BATCH} x {SEQ}   loops r={LOOPS}   warmup={warmup} repeats={repeats} (interleaved)")
    print()

    model = LoopLM(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # off the init, so the loop does something
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(device) * 0.02)
    tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(device)
    x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

    # the same numbers both ways
    fast_lost = probes.lost_gradient(model, x, y, loops=LOOPS, params="blocks").lost.values
    slow_lost = lost_per_k(model, x, y, LOOPS)
    fast_C = probes.interaction(model, x, loops=LOOPS).interaction.values
    slow_C = interaction_per_skip(model, x, LOOPS)
    err_lost = float(np.max(np.abs(fast_lost - slow_lost)))
    err_C = float(np.nanmax(np.abs(fast_C - slow_C)))
    print(f"agreement     : max |lost_fast - lost_slow| = {err_lost:.2e}   max |C_fast - C_slow| = {err_C:.2e}")
    print()

    ok = True
    rows = []
    t = interleaved({"fast": lambda: probes.lost_gradient(model, x, y, loops=LOOPS),
                     "slow": lambda: lost_per_k(model, x, y, LOOPS)}, device, warmup, repeats)
    rows.append(("1", "lost_gradient, all k at r=8", t, 4.0))
    t = interleaved({"fast": lambda: probes.interaction(model, x, loops=LOOPS),
                     "slow": lambda: interaction_per_skip(model, x, LOOPS)}, device, warmup, repeats)
    rows.append(("2", "interaction at r=8 (17 skips)", t, 3.0))
    print(f"{'':2} {'probe':32} {'fast s':>8} {'slow s':>8} {'ratio':>7} {'target':>7}")
    for key, name, t, target in rows:
        f, s = statistics.median(t["fast"]), statistics.median(t["slow"])
        ratio = s / f
        passed = ratio >= target
        ok &= passed
        print(f"{key:2} {name:32} {f:8.3f} {s:8.3f} {ratio:7.2f} {'>=' + str(target):>7}  "
              f"{'PASS' if passed else 'FAIL'}")
    ok &= err_lost < 1e-4 and err_C < 1e-3
    # what a perfectly efficient implementation of each side would reach for target 2, counting block
    # evaluations: the slow side runs n passes of n blocks; the fast side one plain pass, then each
    # skip variant from the start of the stage (prelude, loop, coda) holding its skipped occurrence
    p, s_, c = cfg.prelude, cfg.core, cfg.coda
    n = p + LOOPS * s_ + c
    start = [0] * p + [p + (j // s_) * s_ for j in range(LOOPS * s_)] + [p + LOOPS * s_] * c
    fast_blocks = n + sum(n - start[i] for i in range(n - 1))
    print(f"\ntarget 2, ideal ratio in block evaluations: {n * n} / {fast_blocks} = {n * n / fast_blocks:.2f} "
          f"(exact skips cannot do better than about n^2 / (n^2 / 2 + n); more comes only from batching)")
    print()
    print("overall       :", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
