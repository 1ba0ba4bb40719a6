"""The one loop pass (issue 12): what the named places cost, against the code before them, in one process.

The LoopLM before issue 12 (`workbench/models/looped.py` at commit f2f4f5c, read with `git show` and
imported beside today's) and today's share one set of weights; their training steps (forward +
backward from the chunked loss) and traces are timed round-robin (A B A B ...), so background load
hits both alike. Also printed: what asking for a cache or a reading hook costs (not a target).

    python benchmarks/bench_loop_pass.py            # ~2 minutes on 2 CPU cores
    python benchmarks/bench_loop_pass.py --quick

Target: the pass without hooks or cache is within 2% of the previous code's train step (ratio >= 0.98).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_model import cpu_model, interleaved, med  # noqa: E402
from workbench.config import LoopConfig  # noqa: E402
from workbench.models import LoopLM  # noqa: E402

BEFORE = "f2f4f5cc379859809a5ebd48522663ff749c0e90"  # main before the one-pass change


def previous_looped():
    """Return the module workbench.models.looped as it was at BEFORE (relative imports from today's package)."""
    src = subprocess.run(["git", "show", f"{BEFORE}:workbench/models/looped.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "looped_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("workbench.models._looped_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    warm, reps = (1, 5) if args.quick else (2, 15)
    torch.manual_seed(0)
    cfg = LoopConfig(vocab_size=8192, d_model=256, n_heads=4, n_kv_heads=2, prelude=2, core=2, coda=2, loops=4,
                     inject="channel", max_seq_len=256)
    new = LoopLM(cfg, seed=0)
    old = previous_looped().LoopLM(cfg, seed=0)
    old.load_state_dict(new.state_dict())
    x = torch.randint(0, cfg.vocab_size, (8, 257))
    inp, tgt = x[:, :-1], x[:, 1:]
    with torch.no_grad():
        a, b = old(inp, loops=4).logits, new(inp, loops=4).logits
    assert torch.equal(a, b), "the two passes disagree"

    def step(model, **kw):
        def fn():
            model.zero_grad(set_to_none=True)
            model(inp, loops=4, targets=tgt, return_logits=False, **kw).loss.backward()
        return fn

    def trace(model, **kw):
        def fn():
            with torch.no_grad():
                model.trace(inp, loops=16, **kw)
        return fn

    print("# bench_loop_pass (issue 12)")
    print(f"cpu: {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"2+2x4+2, d=256, vocab 8192, batch 8 x seq 256; median of {reps} interleaved rounds")
    t = interleaved({"before": step(old), "now": step(new)}, torch.device("cpu"), warm, reps)
    ratio = med(t["before"]) / med(t["now"])
    print(f"train step  before {med(t['before']):.3f} s   now {med(t['now']):.3f} s   before/now {ratio:.3f}  "
          f"target >= 0.98: {'PASS' if ratio >= 0.98 else 'FAIL'}")
    t = interleaved({"before": trace(old), "now": trace(new)}, torch.device("cpu"), warm, reps)
    print(f"trace(16)   before {med(t['before']):.3f} s   now {med(t['now']):.3f} s   before/now "
          f"{med(t['before']) / med(t['now']):.3f}")
    seen = []
    t = interleaved({"plain": step(new), "cache core.*": step(new, cache=["core.*"]),
                     "reading hook core.*": step(new, hooks={"core.*": lambda n, i, o: seen.append(n)})},
                    torch.device("cpu"), warm, reps)
    base = med(t["plain"])
    for name, ts in t.items():
        print(f"train step with {name:<20s} {med(ts):.3f} s  ({med(ts) / base:.3f}x plain)")


if __name__ == "__main__":
    main()
