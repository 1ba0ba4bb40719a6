"""Model speed benchmarks (issue 2): looped vs unrolled vs HF Llama training step, FLOP/s, trace reuse.

Everything runs in one process. Each comparison is interleaved (A B C A B C ...): a few warmup rounds
are discarded, then the median over the timed rounds is reported, so background load hits every
contender alike. Run from the repository root:

    python benchmarks/bench_model.py            # default run (under ~4 minutes on 2 CPU cores)
    python benchmarks/bench_model.py --quick    # fewer repeats
    python benchmarks/bench_model.py --device cuda

Targets checked (PASS/FAIL):
  1a  t_unrolled / t_looped >= 0.97   training step, 1+2x4+1 LoopLM vs the same depth as 10 distinct layers
  1b  t_hf / t_looped > 1             training step, vs transformers.LlamaForCausalLM (10 layers, sdpa)
  2   model FLOP/s of the looped step >= 50% of a fp32 matmul measured in the same run
  3   t(16 separate forwards, loops=1..16) / t(one trace(loops=16) + 16 readouts) >= 8

Also printed, without targets: achieved FLOP/s of all three training steps, the FLOP-ideal ratio for
target 3 (what a perfectly efficient implementation would reach), and the host minor page faults per
call (fresh allocator pages, a large and otherwise invisible CPU cost).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

try:
    import resource
except ImportError:  # not on Windows
    resource = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench.config import LoopConfig  # noqa: E402
from workbench.models import LoopLM  # noqa: E402

D_MODEL, N_HEADS, VOCAB, SEQ, BATCH = 256, 4, 4096, 256, 8
TRACE_LOOPS = 16


# ---- timing -------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int,
                repeats: int, faults: dict[str, list[int]] | None = None) -> dict[str, list[float]]:
    """Return {name: [seconds per timed round]} running the fns round-robin (A B C A B C ...).

    If `faults` is given, the host minor page faults of each timed call are appended to it too
    (a diagnostic: fresh pages from the allocator cost a kernel fault and a zeroing each).
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            _sync(device)
            f0 = _minflt()
            t0 = time.perf_counter()
            fn()
            _sync(device)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt)
                if faults is not None:
                    faults.setdefault(name, []).append(_minflt() - f0)
    return times


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# ---- machine description --------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def header(device: torch.device, args: argparse.Namespace) -> None:
    import transformers

    print("# bench_model (issue 2)")
    print(f"date          : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"python        : {platform.python_version()}")
    print(f"torch         : {torch.__version__}   transformers: {transformers.__version__}")
    print(f"cpu           : {cpu_model()}  ({os.cpu_count()} logical cores)")
    print(f"torch threads : {torch.get_num_threads()} (default, not changed)")
    if device.type == "cuda":
        print(f"gpu           : {torch.cuda.get_device_name(device)}  "
              f"(tf32 matmul={torch.backends.cuda.matmul.allow_tf32})")
    print(f"device        : {device}   mode: {'quick' if args.quick else 'default'}  "
          f"warmup={args.warmup} repeats={args.repeats} trace_repeats={args.trace_repeats}")
    print(f"shape         : batch={BATCH} seq={SEQ} d_model={D_MODEL} n_heads={N_HEADS} vocab={VOCAB} fp32")
    print()


# ---- models -----------------------------------------------------------------------------------------
def loop_config(**alloc) -> LoopConfig:
    return LoopConfig(vocab_size=VOCAB, d_model=D_MODEL, n_heads=N_HEADS, n_kv_heads=N_HEADS,
                      max_seq_len=1024, **alloc)


def hf_llama(cfg: LoopConfig, layers: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ff_mean,
                         num_hidden_layers=layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_seq_len,
                         rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                         tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
                         attention_dropout=0.0, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_cfg).to(device).train()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def fwd_flops_per_token(model: LoopLM, r_prelude: int, r_core: int, r_readout: int, seq: int) -> float:
    """Forward FLOPs/token for r_prelude prelude runs, r_core core passes and r_readout coda+head runs.

    Same accounting as LoopLM.flops_per_token (2 per weight, Kaplan's causal attention 2*seq*d per
    layer), split by part so the ideal trace-vs-separate ratio can be stated.
    """
    cfg = model.cfg
    att = 2 * seq * cfg.d_model

    def part(mods, layers):
        return 2 * sum(p.numel() for p in mods.parameters()) + att * layers

    pre = part(model.prelude, cfg.prelude)
    core = part(model.core, cfg.core)
    read = part(model.coda, cfg.coda) + 2 * cfg.d_model * cfg.vocab_size
    return r_prelude * pre + r_core * core + r_readout * read


# ---- benchmark ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, noisier numbers)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds for section 1 (default 21, quick 5)")
    ap.add_argument("--trace-repeats", type=int, default=None,
                    help="timed rounds for section 3 (default 9, quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="discarded rounds (default 2, quick 1)")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (5 if args.quick else 21)
    args.trace_repeats = args.trace_repeats or (3 if args.quick else 9)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    device = torch.device(args.device)
    header(device, args)

    # models: looped 1+2x4+1, unrolled 9+1x1+0 (10 distinct layers), HF Llama with 10 layers
    looped_cfg = loop_config(prelude=1, core=2, coda=1, loops=4)
    unrolled_cfg = loop_config(prelude=9, core=1, coda=0, loops=1)
    depth = looped_cfg.effective_depth()
    assert unrolled_cfg.effective_depth() == depth == unrolled_cfg.physical_layers == 10
    assert unrolled_cfg.ff_mean == looped_cfg.ff_mean
    looped = LoopLM(looped_cfg).to(device).train()
    unrolled = LoopLM(unrolled_cfg).to(device).train()
    hf = hf_llama(looped_cfg, depth, device)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    ntok = BATCH * SEQ

    def train_step(model: LoopLM, loops: int) -> Callable[[], None]:
        def fn() -> None:
            model.zero_grad(set_to_none=True)
            # the training path: chunked head + cross-entropy, no [B, T, V] logits kept
            model(x, loops=loops, targets=y, return_logits=False).loss.backward()
        return fn

    def hf_step() -> None:
        hf.zero_grad(set_to_none=True)
        # labels=x: HF shifts internally (pads the last position with -100), so the loss is the same
        # next-token objective over the same [B, T, V] logits
        hf(input_ids=x, labels=x, use_cache=False).loss.backward()

    # fp32 peak reference: square matmul, same threads, measured inside the same rounds
    n = 8192 if device.type == "cuda" else 1024
    mm_reps = 20 if device.type == "cuda" else 10
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    c = torch.empty(n, n, device=device)

    def matmul() -> None:
        for _ in range(mm_reps):
            torch.mm(a, b, out=c)

    print(f"params        : looped {n_params(looped):,}  unrolled {n_params(unrolled):,}  "
          f"hf-llama {n_params(hf):,}  (ff_mean={looped_cfg.ff_mean}, tied embeddings)")
    print(f"allocation    : looped {looped_cfg.notation} (depth {depth})   unrolled "
          f"{unrolled_cfg.notation} (depth {unrolled_cfg.effective_depth()})   hf-llama {depth} layers sdpa")
    print(f"matmul ref    : fp32 {n}x{n} @ {n}x{n}, {mm_reps} per sample, 2n^3 FLOPs each")
    print()

    faults: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    t1 = interleaved({"looped": train_step(looped, looped_cfg.loops),
                      "unrolled": train_step(unrolled, 1),
                      "hf": hf_step,
                      "matmul": matmul}, device, args.warmup, args.repeats, faults)
    sec1_wall = time.perf_counter() - t0
    t_loop, t_unr, t_hf = med(t1["looped"]), med(t1["unrolled"]), med(t1["hf"])
    t_mm = med(t1["matmul"]) / mm_reps
    peak = 2 * n ** 3 / t_mm
    fpt = looped.flops_per_token(loops=looped_cfg.loops, backward_loops=looped_cfg.loops, seq_len=SEQ,
                                 include_head=True)
    fpt_unr = unrolled.flops_per_token(loops=1, backward_loops=1, seq_len=SEQ, include_head=True)
    achieved = fpt * ntok / t_loop

    # section 3: one trace to 16 loops + 16 readouts vs 16 separate forwards, no grad
    looped.eval()

    def trace_all() -> None:
        with torch.no_grad():
            tr = looped.trace(x, loops=TRACE_LOOPS)
            for r in range(1, TRACE_LOOPS + 1):
                tr.logits(r)

    def separate_all() -> None:
        with torch.no_grad():
            for r in range(1, TRACE_LOOPS + 1):
                looped(x, loops=r).logits

    t0 = time.perf_counter()
    t3 = interleaved({"trace": trace_all, "separate": separate_all}, device, 1, args.trace_repeats, faults)
    sec3_wall = time.perf_counter() - t0
    t_tr, t_sep = med(t3["trace"]), med(t3["separate"])
    R = TRACE_LOOPS
    ideal = (fwd_flops_per_token(looped, R, R * (R + 1) // 2, R, SEQ)
             / fwd_flops_per_token(looped, 1, R, R, SEQ))

    # ---- report ----
    def spread(xs: list[float]) -> str:
        return f"{1e3 * min(xs):9.1f} {1e3 * max(xs):9.1f}"

    print(f"## absolute times (median of {args.repeats} / {args.trace_repeats} interleaved rounds, "
          f"after {args.warmup} / 1 warmup)")
    print(f"{'benchmark':58s} {'median ms':>10s} {'min ms':>9s} {'max ms':>9s} {'pagefaults':>10s}")
    rows = [
        ("1  train step looped 1+2x4+1 (fwd+bwd)", "looped", t1),
        ("1  train step unrolled 10 layers (fwd+bwd)", "unrolled", t1),
        ("1  train step HF LlamaForCausalLM 10 layers sdpa (fwd+bwd)", "hf", t1),
        (f"2  fp32 matmul {n}^3 (x{mm_reps})", "matmul", t1),
        (f"3  trace(loops={R}) + {R} readouts, no_grad", "trace", t3),
        (f"3  {R} separate forwards loops=1..{R}, no_grad", "separate", t3),
    ]
    for name, key, tt in rows:
        xs = tt[key]
        print(f"{name:58s} {1e3 * med(xs):10.1f} {spread(xs)} {int(med(faults[key])):10d}")
    print("(pagefaults: median host minor page faults per call, a diagnostic, no target)")
    print()
    print(f"model FLOPs/token (train, looped, head+attn) : {fpt / 1e6:.2f} M  (unrolled: {fpt_unr / 1e6:.2f} M)")
    print(f"tokens/step                                  : {ntok}")
    print(f"achieved model FLOP/s  looped / unrolled / hf: {achieved / 1e9:.1f} / "
          f"{fpt_unr * ntok / t_unr / 1e9:.1f} / {fpt_unr * ntok / t_hf / 1e9:.1f} GFLOP/s")
    print(f"fp32 matmul {n}^3                           : {peak / 1e9:.1f} GFLOP/s")
    print(f"trace ideal FLOP ratio (separate / trace)    : {ideal:.2f}x  "
          f"(core passes {R * (R + 1) // 2} vs {R}; preludes {R} vs 1; readouts {R} vs {R})")
    print(f"tokens/s looped training                     : {ntok / t_loop:,.0f}")
    print(f"section wall time                            : {sec1_wall:.0f} s + {sec3_wall:.0f} s")
    print()

    results = [
        ("1a t_unrolled / t_looped (train step)", t_unr / t_loop, ">= 0.97", t_unr / t_loop >= 0.97, "x"),
        ("1b t_hf / t_looped (train step)", t_hf / t_loop, "> 1", t_hf / t_loop > 1.0, "x"),
        ("2  looped model FLOP/s / fp32 matmul FLOP/s", achieved / peak, ">= 50%", achieved / peak >= 0.5, "%"),
        (f"3  t_separate / t_trace ({R} loops)", t_sep / t_tr, ">= 8", t_sep / t_tr >= 8.0, "x"),
    ]
    print("## targets")
    print(f"{'metric':46s} {'value':>9s} {'target':>8s}  result")
    for name, val, target, ok, unit in results:
        v = f"{100 * val:8.1f}%" if unit == "%" else f"{val:8.3f}x"
        print(f"{name:46s} {v:>9s} {target:>8s}  {'PASS' if ok else 'FAIL'}")
    passed = sum(ok for *_, ok, _ in results)
    print(f"\n{passed}/{len(results)} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
