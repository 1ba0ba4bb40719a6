"""The fast path (issue 13): bf16 autocast and compiled blocks against fp32 eager and Hugging Face's Llama.

One process, interleaved rounds (A B C ... A B C), medians; compile times are timed on their own
first call and never enter a step's time. Run from the repository root:

    python benchmarks/bench_fast.py            # about 6-8 minutes on 2 CPU cores (two compiles)
    python benchmarks/bench_fast.py --quick    # fewer rounds

Model: 2+2x4+2 LoopLM (12 effective layers), d_model 256, 4 heads, vocab 8192, batch 8 x seq 256; the
step is forward + backward from the loss (chunked head + cross-entropy for ours, `labels=` for HF),
no optimiser. HF: `transformers.LlamaForCausalLM`, 12 layers of the same widths, sdpa attention.

Targets checked (PASS/FAIL):
  1  HF's best step (bf16 autocast, eager or compiled) / ours "auto" (bf16 + compiled blocks) >= 1.3
  2  ours fp32 eager / ours bf16 compiled >= 2   (bf16 eager printed too)
  3  model FLOP/s of ours bf16 compiled >= 45% of a bf16 1024^3 matmul timed in the same rounds
     (and, no target, the fp32 eager step against the fp32 matmul)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import cpu_model, hf_llama, interleaved, med  # noqa: E402

from workbench.config import LoopConfig  # noqa: E402
from workbench.models import LoopLM  # noqa: E402
from workbench.models.precision import autocast, cpu_flags, fast_bf16  # noqa: E402
from workbench.train import compile_count, compiled_blocks  # noqa: E402

D_MODEL, N_HEADS, VOCAB, SEQ, BATCH = 256, 4, 8192, 256, 8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, noisier numbers)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 9, quick 3)")
    ap.add_argument("--no-hf-compile", action="store_true", help="skip compiling the HF model (saves ~2 min)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 keeps threads from spinning against other jobs' load")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 9)
    warmup = 1
    device = torch.device(args.device)
    import transformers

    flags = cpu_flags() & {"amx_bf16", "avx512_bf16", "amx_tile"}
    print("# bench_fast (issue 13)")
    print(f"date          : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"python        : {platform.python_version()}   torch: {torch.__version__}   "
          f"transformers: {transformers.__version__}")
    print(f"cpu           : {cpu_model()}  ({os.cpu_count()} logical cores; bf16 flags: "
          f"{', '.join(sorted(flags)) or 'none'}; load average {os.getloadavg()[0]:.1f})")
    print(f"torch threads : {torch.get_num_threads()}{' (--threads)' if args.threads else ' (default)'}   device: {device}   bf16 auto -> "
          f"{'bf16' if fast_bf16(device) else 'fp32'}   rounds: {warmup} warmup + {repeats} timed")

    cfg = LoopConfig(vocab_size=VOCAB, d_model=D_MODEL, n_heads=N_HEADS, n_kv_heads=N_HEADS, prelude=2, core=2,
                     coda=2, loops=4, max_seq_len=SEQ)
    depth = cfg.effective_depth()
    ours = LoopLM(cfg).to(device).train()
    hf = hf_llama(cfg, depth, device)
    print(f"shape         : {cfg.notation} (depth {depth}) d={D_MODEL} heads={N_HEADS} vocab={VOCAB} "
          f"batch={BATCH} seq={SEQ}; HF LlamaForCausalLM {depth} layers sdpa")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    ntok = BATCH * SEQ

    def ours_step(bf16: bool, compiled: bool):
        def fn():
            ours.zero_grad(set_to_none=True)
            with autocast(device, bf16), (compiled_blocks(ours) if compiled else contextlib.nullcontext()):
                loss = ours(x, loops=4, targets=y, return_logits=False).loss
            loss.backward()
        return fn

    hf_compiled = None if args.no_hf_compile else torch.compile(hf)

    def hf_step(model):
        def fn():
            hf.zero_grad(set_to_none=True)
            with autocast(device, True):
                loss = model(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
        return fn

    n = 8192 if device.type == "cuda" else 1024
    reps = 20 if device.type == "cuda" else 10
    mats = {dt: [torch.randn(n, n, device=device, dtype=dt) for _ in range(3)] for dt in (torch.float32, torch.bfloat16)}

    def matmul(dt):
        a, b, c = mats[dt]

        def fn():
            for _ in range(reps):
                torch.mm(a, b, out=c)
        return fn

    fns = {"ours fp32 eager": ours_step(False, False), "ours bf16 eager": ours_step(True, False),
           "ours bf16 compiled": ours_step(True, True), "hf bf16 eager": hf_step(hf)}
    if hf_compiled is not None:
        fns["hf bf16 compiled"] = hf_step(hf_compiled)
    fns["matmul fp32"], fns["matmul bf16"] = matmul(torch.float32), matmul(torch.bfloat16)

    # first calls of the compiled contenders: compile time, reported apart from the step times
    compile_s = {}
    for name in [k for k in fns if "compiled" in k]:
        g0, t0 = compile_count(), time.perf_counter()
        fns[name]()
        fns[name]()  # the second call may still build what the first deferred (backward, guards)
        compile_s[name] = (time.perf_counter() - t0, compile_count() - g0)
    for name, (sec, graphs) in compile_s.items():
        print(f"compile       : {name}: first two calls {sec:.1f} s ({graphs} graphs)")
    print()

    t0 = time.perf_counter()
    times = interleaved(fns, device, warmup, repeats)
    wall = time.perf_counter() - t0
    before = compile_count()
    t = {k: med(v) for k, v in times.items()}
    recompiled = compile_count() - before
    t_mm32, t_mm16 = t["matmul fp32"] / reps, t["matmul bf16"] / reps
    peak32, peak16 = 2 * n ** 3 / t_mm32, 2 * n ** 3 / t_mm16
    fpt = ours.flops_per_token(loops=4, backward_loops=4, seq_len=SEQ, include_head=True)

    print(f"## step times (median of {repeats} interleaved rounds after {warmup} warmup; {wall:.0f} s)")
    print(f"{'contender':26s} {'median ms':>10s} {'min ms':>9s} {'max ms':>9s} {'tokens/s':>9s} {'GFLOP/s':>8s}")
    for k, v in times.items():
        if k.startswith("matmul"):
            print(f"{k + f' {n}^3 (x{reps})':26s} {1e3 * med(v):10.1f} {1e3 * min(v):9.1f} {1e3 * max(v):9.1f} "
                  f"{'':>9s} {2 * n ** 3 * reps / med(v) / 1e9:8.1f}")
        else:
            print(f"{k:26s} {1e3 * med(v):10.1f} {1e3 * min(v):9.1f} {1e3 * max(v):9.1f} {ntok / med(v):9,.0f} "
                  f"{fpt * ntok / med(v) / 1e9:8.1f}")
    print(f"model FLOPs/token {fpt / 1e6:.1f} M (train: 6N + attention + head); recompiles during the rounds: "
          f"{recompiled}")
    print()

    best_hf = min((k for k in t if k.startswith("hf")), key=t.get)
    fast = t["ours bf16 compiled"]
    mfu16 = fpt * ntok / fast / peak16
    mfu32 = fpt * ntok / t["ours fp32 eager"] / peak32
    results = [
        (f"1  {best_hf} / ours bf16 compiled", t[best_hf] / fast, ">= 1.3", t[best_hf] / fast >= 1.3, "x"),
        ("2  ours fp32 eager / ours bf16 compiled", t["ours fp32 eager"] / fast, ">= 2", t["ours fp32 eager"] / fast >= 2, "x"),
        ("   ours fp32 eager / ours bf16 eager", t["ours fp32 eager"] / t["ours bf16 eager"], "", None, "x"),
        ("   hf bf16 eager / ours bf16 eager", t["hf bf16 eager"] / t["ours bf16 eager"], "", None, "x"),
        ("3  ours bf16 compiled FLOP/s / bf16 matmul", mfu16, ">= 45%", mfu16 >= 0.45, "%"),
        ("   ours fp32 eager FLOP/s / fp32 matmul", mfu32, "", None, "%"),
        ("   bf16 matmul / fp32 matmul", peak16 / peak32, "", None, "x"),
    ]
    print("## targets")
    print(f"{'metric':46s} {'value':>9s} {'target':>8s}  result")
    for name, val, target, ok, unit in results:
        v = f"{100 * val:8.1f}%" if unit == "%" else f"{val:8.3f}x"
        print(f"{name:46s} {v:>9s} {target:>8s}  {'' if ok is None else 'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
