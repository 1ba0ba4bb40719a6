"""Loop explorer benchmarks (issue 7): a slider move, and the one trace a new prompt costs.

Run from the repository root:

    python benchmarks/bench_explorer.py                      # quickstart-sized model, random weights
    python benchmarks/bench_explorer.py --checkpoint runs/quickstart/train/<key>/model
    python benchmarks/bench_explorer.py --quick
    python benchmarks/bench_explorer.py --threads 1           # on a machine shared with other work

Measured, in Python (no browser; the widget comms have no kernel on the other end):
  1  slider change -> figure data updated: `explorer.slider.value = r` returns after set_loop has
     re-sliced the cache into all four FigureWidgets inside batch_update(); checked against the cache.
     Target: median < 50 ms for the quickstart model on CPU (1+2x4+1, d=128, vocab 4096), 256 tokens, 32 loops.
  2  the first trace of a 256-token prompt at 32 loops: the probe `loop_view` (one model.trace + the
     per-loop readouts, top-k, KL, PCA, into a Dataset), cold and warm, and `set_text` (that plus
     redrawing every figure).
For scale, the cost a slider move would have if it recomputed: one forward at r = 32 loops.
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench.config import LoopConfig  # noqa: E402
from workbench.models import LoopLM  # noqa: E402
from workbench.io import open_run  # noqa: E402
from workbench.probes import loop_view  # noqa: E402
from workbench.viz.explorer import LoopExplorer  # noqa: E402

from bench_model import cpu_model, interleaved  # noqa: E402  (same folder: one timing loop for all benchmarks)

SEQ, LOOPS, TARGET_MS = 256, 32, 50.0


class IdTokenizer:
    """Token ids shown as themselves: the benchmark needs labels, not text."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """Return the ids written in text, space-separated."""
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        """Return the ids as labels t<id>."""
        return " ".join(f"t{int(i)}" for i in ids)


def quickstart_model() -> LoopLM:
    """Return a LoopLM of the quickstart's shape (the timings do not depend on the weights)."""
    cfg = LoopConfig(vocab_size=4096, d_model=128, n_heads=4, n_kv_heads=2, prelude=1, core=2, coda=1, loops=4,
                     max_seq_len=256, inject="channel")
    return LoopLM(cfg, seed=0).eval()


def pct(xs: list[float], q: float) -> float:
    """Return the q-th percentile of xs."""
    return float(np.percentile(np.array(xs), q))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="a checkpoint / run folder instead of the random quickstart-sized model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice, not changed)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    moves, traces = (64, 3) if args.quick else (320, 7)

    if args.checkpoint:
        model, tok = open_run(args.checkpoint, device=device)
        source = args.checkpoint
    else:
        model, tok = quickstart_model().to(device), None
        source = "random weights, quickstart shape"
    cfg = model.cfg
    tok = tok or IdTokenizer(cfg.vocab_size)
    seq = min(SEQ, cfg.max_seq_len)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(cfg.vocab_size, getattr(tok, "vocab_size", cfg.vocab_size)), (seq,), generator=g)
    text = " ".join(str(int(i)) for i in ids) if isinstance(tok, IdTokenizer) else tok.decode(ids.tolist())

    print("# bench_explorer (issue 7)")
    print(f"date          : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"python        : {platform.python_version()}   torch: {torch.__version__}")
    print(f"cpu           : {cpu_model()}  ({os.cpu_count()} logical cores)   load: {os.getloadavg()[0]:.1f}")
    how = "set by --threads" if args.threads else "default, not changed"
    print(f"torch threads : {torch.get_num_threads()} ({how})")
    if device.type == "cuda":
        print(f"gpu           : {torch.cuda.get_device_name(device)}")
    print(f"model         : {cfg.notation}  d_model={cfg.d_model} vocab={cfg.vocab_size} fp32  ({source})")
    print(f"prompt        : {seq} tokens   max_loops={LOOPS}   top_k=10   PCA dims=3   device={device}")
    print()

    # 2 first: the cold call is the one a person waits for after typing a prompt
    t0 = time.perf_counter()
    loop_view(model, ids, LOOPS)
    cold = time.perf_counter() - t0
    ex = LoopExplorer(model, tok, text=text, max_loops=LOOPS, device=device)
    assert ex.message == "" and ex.view.sizes["token"] == seq, ex.message
    x = ids[None].to(device)
    flip = iter(range(10 ** 6))

    def new_prompt():  # a new prompt each time (a prompt one token over the context is cut to its last 256)
        ex.set_text(text + (" 1" if next(flip) % 2 else " 2"))

    def no_grad(fn):
        def run():
            with torch.inference_mode():
                fn()
        return run

    # interleaved rounds (A B C D A B C D ...), so background load hits every contender alike
    t = interleaved({"view": lambda: loop_view(model, ids, LOOPS),
                     "trace": no_grad(lambda: model.trace(x, loops=LOOPS)),
                     "set_text": new_prompt,
                     "forward": no_grad(lambda: model(x, loops=LOOPS))}, device, warmup=1, repeats=traces)
    warm, trace_only, settext, recompute = t["view"], t["trace"], t["set_text"], t["forward"]

    # 1: slider moves, every loop visited in a scrambled order, data checked after each move
    rng = np.random.default_rng(0)
    order = [int(r) for r in rng.integers(1, LOOPS + 1, moves)]
    slider, n_traces = [], ex.traces
    for r in order:
        if r == ex.loop:
            r = r % LOOPS + 1
        t0 = time.perf_counter()
        ex.slider.value = r
        slider.append(time.perf_counter() - t0)
        assert ex.figures["curves"].data[2].y[0] == float(ex.view.loss.values[r - 1])
        assert float(ex.figures["predictions"].data[0].x[0]) == float(ex.view.top_p.values[r - 1, ex.token, 0])
    assert ex.traces == n_traces, "a slider move ran the model"
    token = []
    for i in rng.integers(0, seq, max(8, moves // 8)):
        t0 = time.perf_counter()
        ex.token_select.value = int(i)
        token.append(time.perf_counter() - t0)

    ms = [1e3 * s for s in slider]
    ok = statistics.median(ms) < TARGET_MS
    print(f"{'':2} {'what':46} {'median':>9} {'p95':>9} {'max':>9}")
    print(f"1  {'slider change -> figures updated (' + str(moves) + ' moves)':46} {statistics.median(ms):7.1f}ms "
          f"{pct(ms, 95):7.1f}ms {max(ms):7.1f}ms   target < {TARGET_MS:.0f} ms: {'PASS' if ok else 'FAIL'}")
    tm = [1e3 * s for s in token]
    print(f"   {'token selector change (' + str(len(token)) + ' moves)':46} {statistics.median(tm):7.1f}ms "
          f"{pct(tm, 95):7.1f}ms {max(tm):7.1f}ms")
    print(f"2  {'first trace, cold (loop_view, 1 call)':46} {1e3 * cold:7.0f}ms")
    print(f"   {'trace + reductions, warm (loop_view)':46} {1e3 * statistics.median(warm):7.0f}ms "
          f"{1e3 * pct(warm, 95):7.0f}ms {1e3 * max(warm):7.0f}ms")
    print(f"   {'  of which model.trace alone':46} {1e3 * statistics.median(trace_only):7.0f}ms")
    print(f"   {'new prompt in the widget (set_text: + redraw)':46} {1e3 * statistics.median(settext):7.0f}ms "
          f"{1e3 * pct(settext, 95):7.0f}ms {1e3 * max(settext):7.0f}ms")
    print(f"   {'for scale: one forward at r=32 (a recompute)':46} {1e3 * statistics.median(recompute):7.0f}ms")
    print()
    print("overall       :", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
