"""Retrofit benchmarks (issue 8): SmolLM2-135M load time and memory, adapter training tokens/s on CPU,
and per-answer latency of the looped model against the scratchpad baseline. Run from the repository root:

    python benchmarks/bench_retrofit.py [--steps 4] [--threads 1] [--tiny-steps 150]

Latency is measured at equal accuracy by construction: both contenders produce a correct answer's
worth of tokens. The looped model runs loops = depth and decodes the answer's tokens greedily (no KV
cache: every token reruns the looped pass); the scratchpad model (same base, loops=1, Hugging Face
Llama with its KV cache) decodes exactly as many tokens as the reference scratchpad ' s1 s2 ... sd.'
holds. Weights do not change the time of a fixed number of tokens, so untrained adapters are used.
Examples run one at a time (batch 1), interleaved, and the median over examples is reported.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_model import cpu_model  # noqa: E402  (same folder)
from workbench.data.tasks import iterated_examples, scratchpad_examples  # noqa: E402
from workbench.experiments import retrofit as rx  # noqa: E402
from workbench.models import retrofit as rf  # noqa: E402
from workbench.models.hf import to_hf  # noqa: E402


def rss_mib() -> float:
    """Return this process's resident set size in MiB (Linux), or NaN."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4, help="adapter training steps timed (after 1 warmup step)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--depths", default="1,2,4,8", help="depths at which per-answer latency is measured")
    ap.add_argument("--examples", type=int, default=5, help="examples per depth for latency")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: leave torch's default). 1 by default: on a shared 2-core machine two "
                         "threads collapse (up to 7x slower) whenever another job runs")
    ap.add_argument("--tiny-steps", type=int, default=150,
                    help="training steps of the tiny trained comparison (0: skip it)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    print("# bench_retrofit (issue 8)")
    print(f"date          : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"python        : {platform.python_version()}   torch: {torch.__version__}   "
          f"transformers: {transformers.__version__}")
    print(f"cpu           : {cpu_model()}  ({os.cpu_count()} logical cores)   load average: "
          f"{os.getloadavg()[0]:.1f}")
    print(f"torch threads : {torch.get_num_threads()}{' (--threads)' if args.threads else ' (default, not changed)'}")

    # ---- load ----------------------------------------------------------------------------------------
    before = rss_mib()
    t0 = time.perf_counter()
    base, tok = rx.load_smollm2()
    load_s = time.perf_counter() - t0
    after = rss_mib()
    n_base = sum(p.numel() for p in base.parameters())
    print(f"base          : SmolLM2-135M-Instruct (GGUF Q4_1 -> fp32), {n_base / 1e6:.1f}M parameters, "
          f"{base.config.num_hidden_layers} layers, d={base.config.hidden_size}")
    print(f"load          : {load_s:.1f} s   RSS +{after - before:.0f} MiB (parameters: "
          f"{n_base * 4 / 2**20:.0f} MiB fp32)")

    p, s, c = rf.SMOLLM2_SPLIT
    K = 4
    t0 = time.perf_counter()
    model = rf.retrofit(base, p, s, c, budget="adapter", loops=K, adapter_rank=16)
    conv_s = time.perf_counter() - t0
    rep = rf.budget_report(model)
    print(f"retrofit      : split {p}+{s}x{K}+{c} (layers [0,{p}) / [{p},{p + s}) / [{p + s},{p + s + c})), "
          f"converted in {conv_s:.1f} s, RSS now {rss_mib():.0f} MiB")
    print(f"adapter budget: {rep['trainable']:,} trainable = bridge {rep['bridge']:,} + rank-16 adapters "
          f"{rep['adapter']:,}; frozen {rep['frozen']:,}")
    print(f"full budget   : {rep['bridge'] + rep['block']:,} trainable = bridge {rep['bridge']:,} + block "
          f"{rep['block']:,}")

    # ---- adapter training tokens/s ------------------------------------------------------------------------
    train = iterated_examples(64, list(range(1, K + 1)), seed=0)
    ds = rx.train_retrofit(model, tok, train, steps=args.steps + 1, batch_size=args.batch, lr=1e-3, warmup=1,
                           progress=False)
    tps = statistics.median(ds.tokens_per_s.values[1:])
    print(f"adapter train : {tps:,.0f} tokens/s, median of {args.steps} steps after 1 warmup (batch {args.batch}, "
          f"padded prompt+answer tokens, mixed depths 1..{K}, per-loop supervision, r={K}, full BPTT, "
          f"Muon + AdamW on the trainable parameters only)")

    # ---- per-answer latency -----------------------------------------------------------------------------------
    depths = [int(d) for d in args.depths.split(",")]
    looped = model.eval()
    scratch = rf.retrofit(base, p, s, c, budget="adapter", loops=1, bridge=False, adapter_rank=16).eval()
    llama = to_hf(rf.merge_adapters(scratch))
    del base
    print()
    print(f"per-answer latency, batch 1, median over {args.examples} examples per depth (add rule, mod 10):")
    print("  depth   looped (r = depth, answer tokens)     scratchpad (KV cache, 2d+1 tokens)     looped/scratch")
    times: dict[tuple[int, str], list[float]] = {(d, w): [] for d in depths for w in ("looped", "scratch")}
    n_tokens: dict[tuple[int, str], int] = {}
    examples = {d: iterated_examples(args.examples, d, seed=1) for d in depths}
    with torch.no_grad():
        # round robin over examples, depths and contenders, so a burst of load on a shared machine
        # spreads over every cell instead of spoiling one
        for i in range(args.examples):
            for d in depths:
                ex = examples[d][i]
                ids = tok.encode(ex.prompt)
                n_tokens[d, "looped"] = len(tok.encode(ex.answer))
                n_tokens[d, "scratch"] = len(tok.encode(scratchpad_examples([ex])[0].answer))
                for which in ("looped", "scratch"):
                    t0 = time.perf_counter()
                    if which == "looped":
                        rx._greedy_looped(looped, ids, d, n_tokens[d, which])
                    else:
                        rx._greedy_cached(llama, ids, n_tokens[d, which], set())
                    times[d, which].append(time.perf_counter() - t0)
    rows = []
    for d in depths:
        a, b = statistics.median(times[d, "looped"]), statistics.median(times[d, "scratch"])
        rows.append((d, a, b))
        print(f"  {d:5d}   {a * 1e3:8.1f} ms ({n_tokens[d, 'looped']} tokens, {p + d * s + c} layers each)"
              f"       {b * 1e3:8.1f} ms ({n_tokens[d, 'scratch']} tokens)                  {a / b:6.2f}")
    faster = [d for d, a, b in rows if a < b]
    print(f"looped faster than the scratchpad at depths: {faster or 'none'}")
    del looped, scratch, llama, model

    # ---- trained contenders, tiny base: accuracy within and beyond the horizon, and time per answer ----------
    if args.tiny_steps:
        import tempfile

        print()
        print(f"tiny random Llama (1+2x3+1, d=64, byte tokens), both trained {args.tiny_steps} steps (batch 32, "
              f"full budget, depths 1..3); greedy answers, 20 per depth:")
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            ds = rx.retrofit_run(tmp, base="tiny", prelude=1, core=2, coda=1, budget="full", loops=3,
                                 steps=args.tiny_steps, batch_size=32, lr=1e-2, n_train=700,
                                 eval_depths=[1, 2, 3, 4, 6], n_eval=20, n_answers=20)
            wall = time.perf_counter() - t0
        print("  depth  beyond K   looped acc   scratchpad acc   looped ms   scratchpad ms")
        for d in ds.depth.values:
            acc, sec = ds.answer_accuracy.sel(depth=d), ds.seconds_per_answer.sel(depth=d)
            print(f"  {d:5d}  {'yes' if d > 3 else 'no ':>8}   {float(acc.sel(approach='looped')):10.2f}   "
                  f"{float(acc.sel(approach='scratchpad')):14.2f}   {1e3 * float(sec.sel(approach='looped')):9.2f}"
                  f"   {1e3 * float(sec.sel(approach='scratchpad')):13.2f}")
        print(f"  (whole tiny experiment: {wall:.0f} s)")


if __name__ == "__main__":
    main()
