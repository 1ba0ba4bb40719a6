"""Generation speed (issue 17): cached LoopLM.generate against recomputing the sequence, and against HF generate.

One process, interleaved rounds (A B C A B C ...), medians. The LoopLM is 1+2x4+1 (d_model 512, 8
heads, 4 kv heads, vocab 8192) at r = 4, so its effective depth is 10; the Hugging Face model is a
`LlamaForCausalLM` with those 10 layers (the loop unrolled: prelude, core x 4, coda copied in order,
through `workbench.models.hf.to_hf`), so both compute the same function and their greedy tokens must
agree (checked before timing). Batch 1, a 32-token prompt, 256 new tokens, greedy, fp32.

    python benchmarks/bench_generate.py            # ~10 minutes on 2 idle CPU cores (uncached dominates)
    python benchmarks/bench_generate.py --quick    # 64 new tokens, one round
    python benchmarks/bench_generate.py --device cuda

Contenders:
  cached    LoopLM.generate(prompt, 256, loops=4): a key/value cache per block occurrence
  hf        LlamaForCausalLM.generate(prompt, max_new_tokens=256, do_sample=False) (its DynamicCache, sdpa)
  uncached  every new token reruns the looped pass on the whole sequence (head on the last position only)
Also timed, without targets: generate under the KL and state exit rules with r_max = 8 (on this untrained
model the exits say nothing about quality: the mean loops and accuracy for trained models come from
the generate notebook, see docs/benchmarks.md).

Targets (PASS/FAIL):
  1  t_cached / t_hf <= 1.2          within 1.2x of Hugging Face at fixed r
  2  t_uncached / t_cached >= 10     cached at least 10x faster than recomputing, for 256 new tokens
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_model import cpu_model, interleaved, med  # noqa: E402
from workbench.config import LoopConfig  # noqa: E402
from workbench.models import LoopLM  # noqa: E402
from workbench.models.generate import ExitRule  # noqa: E402
from workbench.models.hf import to_hf  # noqa: E402

R = 4


def unrolled_llama(model: LoopLM, device):
    """Return a LlamaForCausalLM whose layers are the model's block occurrences at r = R, in order."""
    c = model.cfg
    occ = [*model.prelude, *[b for _ in range(R) for b in model.core], *model.coda]
    flat = LoopLM(c.replace(prelude=len(occ) - 1, core=1, coda=0, loops=1), seed=0)
    for dst, src in zip([*flat.prelude, *flat.core], occ):
        dst.load_state_dict(src.state_dict())
    flat.embed.load_state_dict(model.embed.state_dict())
    flat.norm.load_state_dict(model.norm.state_dict())
    hf = to_hf(flat).to(device)
    hf.generation_config.eos_token_id = None  # never stop early: both sides make every token
    hf.generation_config.pad_token_id = 0
    return hf


def main() -> None:
    import datetime
    import os
    import platform

    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--new", type=int, default=256, help="new tokens per generation")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds of cached and hf")
    ap.add_argument("--uncached-repeats", type=int, default=1, help="timed rounds of uncached (minutes each)")
    args = ap.parse_args()
    n, reps, ureps = (64, 1, 1) if args.quick else (args.new, args.repeats, args.uncached_repeats)
    dev = torch.device(args.device)
    cfg = LoopConfig(vocab_size=8192, d_model=512, n_heads=8, n_kv_heads=4, prelude=1, core=2, coda=1, loops=R,
                     max_seq_len=512)
    model = LoopLM(cfg, seed=0).to(dev).eval()
    hf = unrolled_llama(model, dev)
    x = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).to(dev)
    ones = torch.ones_like(x)

    def cached(k=n):
        return model.generate(x, k, loops=R)

    def hf_generate(k=n):
        with torch.no_grad():
            return hf.generate(x, attention_mask=ones, max_new_tokens=k, do_sample=False)

    @torch.no_grad()
    def uncached(k=n):
        y = x
        for _ in range(k):
            p = model.run(y, R, coda=True)
            y = torch.cat([y, F.linear(p.features[:, -1], model.head_weight).argmax(-1, keepdim=True)], 1)
        return y

    print("# bench_generate (issue 17)")
    print(f"date          : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"python        : {platform.python_version()}   torch {torch.__version__}   "
          f"transformers {transformers.__version__}")
    print(f"cpu           : {cpu_model()}  ({os.cpu_count()} logical cores), torch threads {torch.get_num_threads()}")
    print(f"device        : {dev}   rounds: cached and hf {reps}, uncached {ureps} (after the first round), "
          f"after 1 warmup (32 tokens)")
    print(f"model         : LoopLM {cfg.notation} at r={R} (effective depth {cfg.prelude + R * cfg.core + cfg.coda}), "
          f"d_model 512, 8 heads / 4 kv, vocab 8192, fp32; HF Llama: the same 10 layers unrolled")
    print(f"task          : batch 1, prompt 32 tokens, {n} new tokens, greedy")
    a, b, c = cached(48), hf_generate(48), uncached(48)
    agree = bool(torch.equal(a, b) and torch.equal(a, c))
    print(f"greedy tokens : cached == hf == uncached for 48 new tokens: {agree}")
    if not agree:
        raise SystemExit("the three decoders disagree: fix that before timing them")
    fns = {"cached": cached, "hf": hf_generate, "uncached": uncached}
    for f in fns.values():
        f(32)  # warmup
    # cached and hf alternate every round; uncached (minutes per run) joins the first ureps rounds
    times = {k: [] for k in fns}
    for i in range(reps):
        some = {k: f for k, f in fns.items() if k != "uncached" or i < ureps}
        for k, v in interleaved(some, dev, warmup=0, repeats=1).items():
            times[k] += v
    t = {k: med(v) for k, v in times.items()}
    exits = {"kl 1e-3": ExitRule("kl", 1e-3), "state 0.05": ExitRule("state", 0.05)}
    exit_t, exit_loops = {}, {}
    for name, rule in exits.items():
        g = model.generate(x, n, loops=8, exit=rule, details=True)
        exit_loops[name] = g.mean_loops
        exit_t[name] = med(interleaved({name: lambda rule=rule: model.generate(x, n, loops=8, exit=rule)}, dev,
                                       warmup=0, repeats=1)[name])
    print()
    print(f"{'contender':<34}{'median s':>10}{'tokens/s':>10}{'ms/token':>10}")
    for k in fns:
        print(f"{k:<34}{t[k]:>10.2f}{n / t[k]:>10.1f}{1e3 * t[k] / n:>10.2f}")
    for k in exits:
        label = f"exit {k} (r<=8, mean {exit_loops[k]:.2f} loops)"
        print(f"{label:<34}{exit_t[k]:>10.2f}{n / exit_t[k]:>10.1f}{1e3 * exit_t[k] / n:>10.2f}")
    r1, r2 = t["cached"] / t["hf"], t["uncached"] / t["cached"]
    print()
    print(f"{'target':<40}{'value':>9}{'target':>10}  result")
    print(f"{'1 t_cached / t_hf (fixed r=4)':<40}{r1:>8.3f}x{'<= 1.2':>10}  {'PASS' if r1 <= 1.2 else 'FAIL'}")
    label = f"2 t_uncached / t_cached ({n} new)"
    print(f"{label:<40}{r2:>8.2f}x{'>= 10':>10}  {'PASS' if r2 >= 10 else 'FAIL'}")
    print(f"rounds (s): " + "; ".join(f"{k} " + ", ".join(f"{v:.2f}" for v in times[k]) for k in fns))


if __name__ == "__main__":
    main()
