"""Muon's optimiser step: torch.optim.Muon (Newton-Schulz always in bf16) against workbench.optim.Muon
(ns_dtype="auto": bf16 where the device does bf16 fast, fp32 elsewhere). One process, interleaved rounds
(A B A B ...), medians. Run from the repository root:

    python benchmarks/bench_muon.py [--threads 1] [--repeats 7]   # ~2 min on a 2-core AVX2-only CPU

Where bf16 is emulated the gap depends on the vector units: a bf16 matmul was ~3.8x slower than fp32 on the
CPU the issue was measured on, ~40x on an AVX2-only AMD EPYC (no AVX512 at all), so read the ratio with
the printed CPU and flags.

Parameters: the Muon group (param_groups' hidden matrices) of the 2+2x4+2 LoopLM, d_model 256, 4 heads,
vocab 8192 (as bench_fast.py and bench_loop_pass.py), with fixed random gradients; the step is
`opt.step()` alone (no forward, no backward).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import cpu_model, interleaved, med  # noqa: E402

from workbench.config import LoopConfig  # noqa: E402
from workbench.models import LoopLM  # noqa: E402
from workbench.models.precision import BF16_CPU_FLAGS, cpu_flags  # noqa: E402
from workbench.optim import Muon, resolve_ns_dtype  # noqa: E402
from workbench.train import param_groups  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Return 0 after printing both optimisers' step times and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds (after one warmup round)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 keeps threads from spinning against other jobs' load")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    flags = sorted(cpu_flags() & set(BF16_CPU_FLAGS))
    print("# bench_muon")
    print(f"date          : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"cpu           : {cpu_model()}  ({os.cpu_count()} logical cores; bf16 flags: "
          f"{', '.join(flags) or 'neither amx_bf16 nor avx512_bf16'}; load average {os.getloadavg()[0]:.1f})")
    print(f"torch         : {torch.__version__}   threads: {torch.get_num_threads()}"
          f"{' (--threads)' if args.threads else ' (default)'}   device: {device}   "
          f"ns_dtype auto -> {str(resolve_ns_dtype('auto', device)).removeprefix('torch.')}")

    cfg = LoopConfig(vocab_size=8192, d_model=256, n_heads=4, n_kv_heads=2, prelude=2, core=2, coda=2, loops=4,
                     max_seq_len=256)
    model = LoopLM(cfg).to(device)
    hidden = [p for _, p in param_groups(model)[0]]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g).to(device) for p in hidden]
    print(f"parameters    : {cfg.notation} d=256 vocab 8192: {len(hidden)} Muon matrices, "
          f"{sum(p.numel() for p in hidden):,} weights; shapes {sorted({tuple(p.shape) for p in hidden})}")

    def stepper(make):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in hidden]
        for p, gr in zip(ps, grads):
            p.grad = gr
        opt = make(ps)
        return opt.step

    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")  # the trainer's settings
    fns = {"torch.optim.Muon (bf16 NS)": stepper(lambda ps: torch.optim.Muon(ps, **kw)),
           "workbench Muon (auto)": stepper(lambda ps: Muon(ps, **kw))}
    times = interleaved(fns, device, warmup=1, repeats=args.repeats)
    (a, ta), (b, tb) = ((k, med(v)) for k, v in times.items())
    print(f"step (median of {args.repeats} interleaved rounds):")
    print(f"  {a:<28}: {ta * 1e3:8.1f} ms")
    print(f"  {b:<28}: {tb * 1e3:8.1f} ms")
    print(f"  ratio torch / ours           : {ta / tb:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
