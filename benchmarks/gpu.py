"""MFU of a ~125M-parameter looped model's training step in bf16 with torch.compile (issue 4).

    python benchmarks/gpu.py                      # CUDA: 4+4x4+4 at d=768 (113M with embeddings)
    python benchmarks/gpu.py --device cpu --tiny  # the same script on a laptop, tiny model, no compile

MFU = model FLOPs per second (LoopLM.flops_per_token with attention and head) / the device's peak dense
bf16 FLOP/s (H200 SXM: 989 TFLOP/s; `--peak` to override). On CPU the peak is a fp32 matmul measured
in the same run. Target on an H200: >= 45 %.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import LoopConfig, LoopLM  # noqa: E402
from workbench.train import TrainConfig, compiled_blocks, make_optimizers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a small model (for CPU smoke runs)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--peak", type=float, default=None, help="peak FLOP/s of the device")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if args.tiny:
        cfg = LoopConfig(vocab_size=4096, d_model=128, n_heads=4, prelude=1, core=2, coda=1, loops=4, max_seq_len=512)
        B, T, steps = args.batch or 4, args.seq or 128, args.steps or 6
    else:
        cfg = LoopConfig(vocab_size=49152, d_model=768, n_heads=12, n_kv_heads=4, prelude=4, core=4, coda=4,
                         loops=4, max_seq_len=2048, d_ff=2048)
        B, T, steps = args.batch or 16, args.seq or 2048, args.steps or 20
    compile_ = cuda and not args.no_compile
    model = LoopLM(cfg).to(dev)
    # the Trainer's compile: each Block compiled, the loop eager (compiling the whole unrolled model took
    # over two minutes on an H200 before its first step)
    blocks = (lambda: compiled_blocks(model)) if compile_ else contextlib.nullcontext
    opts = make_optimizers(model, TrainConfig(steps=1))
    x = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
    y = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def step() -> None:
        with autocast, blocks():
            loss = model(x, targets=y, return_logits=False).loss
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

    times = []
    for i in range(steps + 2):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:  # compile and allocator warmup
            times.append(time.perf_counter() - t0)
        else:
            print(f"warmup step {i}: {time.perf_counter() - t0:.1f} s", flush=True)
    dt = statistics.median(times)
    fpt = model.flops_per_token(cfg.loops, cfg.loops, seq_len=T, include_head=True)
    achieved = fpt * B * T / dt
    if args.peak:
        peak, what = args.peak, "given"
    elif cuda:
        peak, what = 989e12, "H200 dense bf16"
    else:
        a = torch.randn(1024, 1024)
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        peak, what = 2 * 1024 ** 3 * 20 / (time.perf_counter() - t0), "fp32 1024^3 matmul, measured"
    pc = model.param_counts()
    print(f"model {cfg.notation} d={cfg.d_model}: {sum(pc.values()) / 1e6:.1f}M params "
          f"(once {pc['once'] / 1e6:.1f}M, rec {pc['rec'] / 1e6:.1f}M, embed {pc['embed'] / 1e6:.1f}M)")
    print(f"device {dev} ({torch.cuda.get_device_name(dev) if cuda else 'cpu'}), bf16={cuda}, compile={compile_}, "
          f"batch {B} x {T}, median of {len(times)} steps: {dt * 1e3:.1f} ms, {B * T / dt:,.0f} tokens/s")
    print(f"achieved {achieved / 1e12:.3f} TFLOP/s; peak {peak / 1e12:.3f} TFLOP/s ({what}); "
          f"MFU {100 * achieved / peak:.1f}%" + (f"  target >= 45%: {'PASS' if achieved / peak >= 0.45 else 'FAIL'}"
                                                 if cuda else ""))


if __name__ == "__main__":
    main()
