"""Data and evaluation benchmarks (issue 3): tokenizing throughput, time to a first batch, loop_sweep reuse.

One process, printed as absolute times and ratios. Run from the repository root:

    python benchmarks/bench_data.py            # full stdlib corpus (a few minutes on 2 cores)
    python benchmarks/bench_data.py --quick    # first 3 MB of the stdlib

Targets: warm cache -> first batch < 1 s; loop_sweep over 16 loop counts >= 8x faster than 16
separate evaluations (also printed: the FLOP-ideal ratio, which bounds what any implementation reaches).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench import LoopConfig, LoopLM  # noqa: E402
from workbench.data.corpus import (BatchSampler, load_corpus, stdlib_bytes, tokenize_corpus,  # noqa: E402
                                   train_tokenizer)
from workbench.evals import loop_sweep  # noqa: E402


def first_batch(cache: str, name: str, tok, quick_bytes: int | None):
    corpus = load_corpus(name, cache_dir=cache) if quick_bytes is None else None
    if corpus is None:
        root = Path(cache) / "quick"
        if not root.exists():
            root.mkdir(parents=True)
            (root / "stdlib.py").write_bytes(stdlib_bytes(quick_bytes))
        corpus = load_corpus(f"path:{root}", cache_dir=cache)
    data = tokenize_corpus(corpus, tok, cache_dir=cache, progress=False)
    return corpus, data, next(BatchSampler(data.train, 8, 256, seed=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="use the first 3 MB of the stdlib")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    quick = 3_000_000 if args.quick else None
    print("# bench_data (issue 3)")
    print(f"date    : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"torch   : {torch.__version__}  threads={torch.get_num_threads()}  cores={os.cpu_count()}")
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        tok = train_tokenizer(load_corpus("stdlib", cache_dir=cache), vocab_size=4096, max_train_bytes=2_000_000)
        print(f"BPE training (vocab 4096, 2 MB sample): {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        corpus, data, batch = first_batch(cache, "stdlib", tok, quick)
        cold = time.perf_counter() - t0
        mb = corpus.n_bytes / 1e6
        print(f"corpus  : {corpus.name}  {mb:.1f} MB, {corpus.n_documents} documents -> "
              f"{len(data.train) + len(data.val):,} tokens ({mb * 1e6 / (len(data.train) + len(data.val)):.2f} B/token)")
        print(f"cold: load + tokenize + first batch  {cold:7.2f} s   ({mb / cold:.2f} MB/s tokenizing throughput)")
        warm = statistics.median(
            [(lambda t: (first_batch(cache, "stdlib", tok, quick), time.perf_counter() - t)[1])(time.perf_counter())
             for _ in range(args.repeats)])
        print(f"warm: load + cached tokens + first batch  {warm:7.3f} s   target < 1 s: {'PASS' if warm < 1 else 'FAIL'}")
        assert batch.shape == (8, 257)

    # loop_sweep over 16 loop counts vs 16 separate evaluations, same batches, interleaved
    cfg = LoopConfig(vocab_size=4096, d_model=256, n_heads=4, prelude=1, core=2, coda=1, loops=4)
    model = LoopLM(cfg).eval()
    data = torch.randint(0, 4096, (16, 257), generator=torch.Generator().manual_seed(0))
    loops = list(range(1, 17))

    def one_pass():
        return loop_sweep(model, data, loops, batch_size=8, progress=False)

    def separate():
        return [loop_sweep(model, data, [r], batch_size=8, progress=False) for r in loops]

    one_pass(), separate()
    ts = {"sweep": [], "separate": []}
    for i in range(3):
        for name, fn in ((("sweep", one_pass), ("separate", separate)) if i % 2 == 0
                         else (("separate", separate), ("sweep", one_pass))):
            t = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t)
    a, b = statistics.median(ts["sweep"]), statistics.median(ts["separate"])
    # cost in block-equivalents: prelude + r*s core blocks + coda + head (head ~ V/(12 d) blocks... measured below)
    pc = model.param_counts()
    per_block = pc["rec"] / cfg.core
    head = cfg.vocab_size * cfg.d_model
    readout = cfg.coda * per_block + head
    ideal = (16 * cfg.prelude * per_block + sum(loops) * pc["rec"] + 16 * readout) / (
        cfg.prelude * per_block + 16 * pc["rec"] + 16 * readout)
    print(f"loop_sweep 1..16 over 16x256 tokens ({cfg.notation}, d=256, V=4096): one trace {a:.2f} s, "
          f"16 separate {b:.2f} s, ratio {b / a:.2f}x  (parameter-FLOP ideal {ideal:.2f}x)  "
          f"target >= 8x: {'PASS' if b / a >= 8 else 'FAIL'}")


if __name__ == "__main__":
    main()
