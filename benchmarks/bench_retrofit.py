"""Retrofit benchmarks (issues 8, 14): SmolLM2-135M load time and memory, adapter training tokens/s on CPU
with the adapters skipping loop 1 (issue 14) side by side with acting on every loop (before), loop-1
logits against the base after that training, per-answer latency of the looped model against the
scratchpad baseline, and what `loop1_distill` holds of loop 1 under the full budget and costs the later
loops (tiny base). Run from the repository root:

    python benchmarks/bench_retrofit.py [--steps 4] [--rounds 2] [--threads 1] [--tiny-steps 150]
                                        [--distill-steps 150] [--skip-smollm2] [--recipe-out DIR]

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
from workbench.experiments import recipe as rr  # noqa: E402
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


TEXT = ("The Eiffel Tower was completed in 1889 for the World's Fair in Paris. At first many artists disliked "
        "it, but it soon became the most recognisable symbol of the city and of France itself.")


def distill_comparison(steps: int, weights=(0.0, 1.0, 5.0, 20.0)) -> None:
    """Print what TrainConfig.loop1_distill holds of loop 1 and what it costs the later loops (tiny base).

    Full-budget retrofits of one tiny random Llama trained alike (per-loop supervision on depths 1..3)
    with distillation weights `weights`, and an adapter-budget one whose loop 1 cannot move: loop 1's
    mean KL(base || retrofit) on held-out text (Python source, bytes; the base is random, so its loss
    there says little and KL is the measure of moving), loop1_check's loss difference, and
    teacher-forced accuracy at loop = depth (step 1 on loop 1 is what distillation resists).
    """
    from workbench.data.corpus import ByteTokenizer
    from workbench.models.hf import from_hf, random_llama
    from workbench.train import loop1_kl

    tok = ByteTokenizer(128)
    llama = random_llama(layers=4, std=0.2, seed=0)
    reference = from_hf(llama, 1, 2, 1).eval()
    heldout = torch.tensor(tok.encode(rx.heldout_text())[:32 * 129]).view(32, 129)[:, :-1]
    train = iterated_examples(700, [1, 2, 3], seed=0)
    print()
    print(f"loop1_distill on a tiny random Llama (1+2x3+1, d=64, byte tokens), {steps} steps (batch 32, lr 1e-2, "
          "depths 1..3, per-loop supervision):")
    print("  budget   loop1_distill   loop-1 KL to base   loop-1 loss diff [95% CI] (nats/token)   "
          "acc at loop = depth 1 / 2 / 3 / 4 (beyond K)   train s")
    runs = [("full", w) for w in weights] + [("adapter", 0.0)]
    for budget, w in runs:
        model = rf.retrofit(llama, 1, 2, 1, budget=budget, loops=3, adapter_rank=8)
        t0 = time.perf_counter()
        rx.train_retrofit(model, tok, train, steps, batch_size=32, lr=1e-2, loop1_distill=w, progress=False)
        train_s = time.perf_counter() - t0
        with torch.no_grad():
            kl = float(loop1_kl(model, reference, heldout, model.run(heldout, 1).state))
        check = rx.loop1_check(model, llama, tok)
        acc = rx.depth_sweep(model, tok, [1, 2, 3, 4], n=40, seed=1).step_accuracy.values
        lo, hi = check.loss_diff_lo.item(), check.loss_diff_hi.item()
        print(f"  {budget:7s}  {w:13.1f}   {kl:17.4f}   {check.loss_diff.item():+8.4f} [{lo:+.4f}, {hi:+.4f}]"
              f"           {' / '.join(f'{a:.2f}' for a in acc):36s}   {train_s:6.0f}")


def recipe_section(out_dir: str) -> None:
    """Print the re-entry recipe run (experiments.recipe.recipe_run, tiny base, defaults) and keep its results.nc.

    The diagonal accuracy (loop = depth) per depth after per-loop supervision and after annealing to
    final-answer-only grading, the extrapolation depth where it falls below 0.7, greedy answers and
    seconds per answer against the scratchpad baseline (same budget, examples and steps).
    """
    t0 = time.perf_counter()
    ds = rr.recipe_run(out_dir)
    wall = time.perf_counter() - t0
    a = ds.attrs
    print()
    print(f"re-entry recipe (recipe_run defaults): tiny random Llama {a['budget']} budget rank {a['adapter_rank']}, "
          f"K={a['supervised_depth']}, curriculum depths {a['first_depth']}..m for m in {a['curriculum']}, "
          f"{a['steps']} per-loop steps then {a['anneal_steps']} final-answer-only, lr {a['lr']}, batch "
          f"{a['batch_size']}; {wall:.0f} s; results in {out_dir}/results.nc")
    print("  depth  beyond K   diagonal acc: per-loop  final-only   greedy: looped  scratchpad   ms: looped"
          "  scratchpad")
    for d in ds.depth.values:
        acc, ans = ds.step_accuracy.sel(depth=d), ds.answer_accuracy.sel(depth=d)
        sec = ds.seconds_per_answer.sel(depth=d)
        beyond = "yes" if d > a["supervised_depth"] else "no "
        print(f"  {d:5d}  {beyond:>8}   {float(acc.sel(phase='per_loop')):21.2f}"
              f"  {float(acc.sel(phase='final_only')):10.2f}   {float(ans.sel(approach='looped')):14.2f}"
              f"  {float(ans.sel(approach='scratchpad')):10.2f}   {1e3 * float(sec.sel(approach='looped')):10.1f}"
              f"  {1e3 * float(sec.sel(approach='scratchpad')):10.1f}")
    print(f"  extrapolation: diagonal accuracy first below 0.7 at depth {a['extrapolation_depth']} (0: never); "
          f"{a['loop1_verdict']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4, help="adapter training steps timed per round (after 1 warmup step)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two adapter contenders")
    ap.add_argument("--distill-steps", type=int, default=150,
                    help="training steps of the tiny full-budget loop1_distill comparison (0: skip it)")
    ap.add_argument("--skip-smollm2", action="store_true", help="only the tiny-model sections")
    ap.add_argument("--recipe-out", default="",
                    help="run the re-entry recipe (recipe_run, about 5 minutes) and write its results.nc there")
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

    print("# bench_retrofit (issues 8, 14)")
    print(f"date          : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"python        : {platform.python_version()}   torch: {torch.__version__}   "
          f"transformers: {transformers.__version__}")
    print(f"cpu           : {cpu_model()}  ({os.cpu_count()} logical cores)   load average: "
          f"{os.getloadavg()[0]:.1f}")
    print(f"torch threads : {torch.get_num_threads()}{' (--threads)' if args.threads else ' (default, not changed)'}")

    if args.skip_smollm2:
        if args.distill_steps:
            distill_comparison(args.distill_steps)
        if args.recipe_out:
            recipe_section(args.recipe_out)
        return

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

    # ---- adapter training tokens/s: adapters skipping loop 1 (issue 14) against acting on every loop ---------
    # `_adapt_from = 0` restores the computation before issue 14 (the adapters on loop 1 too), so the two
    # are timed side by side in one process, in alternating rounds (load from other jobs hits both alike)
    train = iterated_examples(64, list(range(1, K + 1)), seed=0)
    probe = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        want = base(probe).logits
        untrained = model(probe, loops=1).logits  # the retrofit before training: loop 1 must stay exactly this
    every = rf.retrofit(base, p, s, c, budget="adapter", loops=K, adapter_rank=16)
    every._adapt_from = 0
    contenders = {"loop 1 skipped (now)": model, "every loop (before)": every}
    tps: dict[str, list[float]] = {k: [] for k in contenders}
    bf16 = None
    for rnd in range(args.rounds):
        for name, m in contenders.items():
            ds = rx.train_retrofit(m, tok, train, steps=args.steps + 1, batch_size=args.batch, lr=1e-3, warmup=1,
                                   seed=rnd, progress=False)
            tps[name] += list(ds.tokens_per_s.values[1:])
            bf16 = ds.attrs["precision"]
    print(f"adapter train : median tokens/s over {args.rounds} rounds x {args.steps} steps after 1 warmup each "
          f"(batch {args.batch}, padded prompt+answer tokens, mixed depths 1..{K}, per-loop supervision, r={K}, "
          f"full BPTT, {bf16}, Muon + AdamW on the trainable parameters only), alternating:")
    with torch.no_grad():
        for name, m in contenders.items():
            one = m.eval()(probe, loops=1).logits
            moved, kept = (one - want).abs().max().item(), (one - untrained).abs().max().item()
            print(f"  {name:22s}: {statistics.median(tps[name]):7.1f} tokens/s   loops=1 logits after training: "
                  f"max |diff| to the HF base {moved:.2e}, to the untrained retrofit {kept:.2e} "
                  f"({len(probe[0])} tokens)")
    a, b = (statistics.median(v) for v in tps.values())
    print(f"  ratio now/before      : {a / b:.2f}")
    del every

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

    if args.distill_steps:
        distill_comparison(args.distill_steps)
    if args.recipe_out:
        recipe_section(args.recipe_out)


if __name__ == "__main__":
    main()
