"""Inkling2Loop through the probes' Loopable (issue 31): the explorer's slider on it, and the Loopable's overhead.

Run from the repository root:

    python benchmarks/bench_inkling.py
    python benchmarks/bench_inkling.py --quick
    python benchmarks/bench_inkling.py --threads 1           # on a machine shared with other work

Measured side by side in one process, on the tiny random Inkling2LoopForCausalLM of tests/test_inkling.py
(hidden 64, 6 layers: 2 prelude, 2 core, 2 coda; fp32, CPU):
  1  slider change -> figure data updated: `explorer.slider.value = r` on a `LoopExplorer` opened on the
     transformers model (wrapped by `probes.from_transformers`), max_loops = 4 K = 12; checked against the
     cached view after each move. Target: median < 50 ms.
  2  the Loopable's overhead: one `Loopable.run` to r loops plus the readout of loop r, against the
     transformers forward with `config.loop_num_passes = r` (use_cache=False, the same work), interleaved
     rounds, at r = 1, 3 and 6; the ratios of medians and of minima (1.00 = no overhead; on a loaded
     machine the minima are the steadier of the two).
The CPU's bf16 matrix flags (amx_bf16, avx512_bf16) are printed; both paths run fp32 here.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench_model import cpu_model, interleaved  # noqa: E402  (same folder: one timing loop for all benchmarks)

TINY = dict(vocab_size=256, unpadded_vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
            sliding_window_size=16, d_rel=8, rel_extent=32, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_layers_per_attn_res_block=2, loop_layer_index_start=2, loop_layer_index_end=4,
            loop_num_passes=3, loop_gate_rank=8, max_position_embeddings=128, eos_token_id=None)
TARGET_MS = 50.0


class Bytes:
    """Bytes as token ids (the tiny model's vocabulary is 256)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of text."""
        return list(text.encode())

    def decode(self, ids) -> str:
        """Return the bytes decoded, undecodable ones replaced."""
        return bytes(int(i) for i in ids).decode(errors="replace")


def cpu_flags() -> str:
    """Return the CPU's bf16 matrix flags as `grep -o -E 'amx_bf16|avx512_bf16' /proc/cpuinfo | sort -u` prints them."""
    out = subprocess.run("grep -o -E 'amx_bf16|avx512_bf16' /proc/cpuinfo | sort -u", shell=True,
                         capture_output=True, text=True).stdout.split()
    return " ".join(out) or "neither amx_bf16 nor avx512_bf16"


def pct(xs: list[float], q: float) -> float:
    """Return the q-th percentile of xs."""
    return float(np.percentile(np.array(xs), q))


def main(argv: list[str] | None = None) -> int:
    """Return 0 when the slider's median is under the target, 1 otherwise, after printing every number."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice, not changed)")
    ap.add_argument("--seq", type=int, default=64, help="prompt length in tokens (at most 128)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    from transformers.models.inkling2_loop import Inkling2LoopForCausalLM, Inkling2LoopTextConfig

    from workbench import probes
    from workbench.viz.explorer import LoopExplorer

    moves, repeats = (48, 5) if args.quick else (240, 15)
    torch.manual_seed(0)
    model = Inkling2LoopForCausalLM(Inkling2LoopTextConfig(**TINY)).eval()
    lp = probes.from_transformers(model)
    K = model.config.loop_num_passes
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(32, 127, (1, args.seq), generator=g)  # printable bytes, so the prompt is text
    text = Bytes().decode(ids[0].tolist())

    print("# bench_inkling (issue 31)")
    print(f"date          : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"python        : {platform.python_version()}   torch: {torch.__version__}   "
          f"transformers: {transformers.__version__}")
    print(f"cpu           : {cpu_model()}  ({os.cpu_count()} logical cores)   load: {os.getloadavg()[0]:.1f}")
    print(f"cpu bf16 flags: {cpu_flags()}")
    how = "set by --threads" if args.threads else "default, not changed"
    print(f"torch threads : {torch.get_num_threads()} ({how})")
    print(f"model         : {lp.name}  hidden={model.config.hidden_size} vocab={lp.vocab_size} fp32, random weights")
    print(f"prompt        : {args.seq} tokens   max_loops={4 * K}   device=cpu")
    print()

    # 2: the Loopable against the model's own forward, the same r, interleaved rounds
    def forward_at(r: int):
        def run():
            model.config.loop_num_passes = r
            with torch.inference_mode():
                model(ids, use_cache=False)
        return run

    def loopable_at(r: int):
        def run():
            with torch.inference_mode():
                _, carried = lp.run(ids, r)
                lp.readout(carried[r])
        return run

    rows = []
    for r in (1, 3, 6):
        t = interleaved({"hf": forward_at(r), "loopable": loopable_at(r)}, torch.device("cpu"), warmup=2,
                        repeats=repeats)
        rows.append((r, t["hf"], t["loopable"]))
    model.config.loop_num_passes = K

    # 1: slider moves on the explorer opened on the transformers model, data checked after each move
    t0 = time.perf_counter()
    ex = LoopExplorer(model, Bytes(), text=text, device="cpu")
    opened = time.perf_counter() - t0
    assert ex.message == "" and ex.view.sizes["loop"] == 4 * K, ex.message
    R = ex.max_loops
    rng = np.random.default_rng(0)
    slider, n_traces = [], ex.traces
    for r in (int(x) for x in rng.integers(1, R + 1, moves)):
        if r == ex.loop:
            r = r % R + 1
        t0 = time.perf_counter()
        ex.slider.value = r
        slider.append(time.perf_counter() - t0)
        assert float(ex.figures["predictions"].data[0].x[0]) == float(ex.view.top_p.values[r - 1, ex.token, 0])
    assert ex.traces == n_traces, "a slider move ran the model"

    ms = [1e3 * s for s in slider]
    ok = statistics.median(ms) < TARGET_MS
    print(f"{'':2} {'what':52} {'median':>9} {'p95':>9} {'max':>9}")
    print(f"1  {'slider change -> figures updated (' + str(moves) + ' moves)':52} {statistics.median(ms):7.1f}ms "
          f"{pct(ms, 95):7.1f}ms {max(ms):7.1f}ms   target < {TARGET_MS:.0f} ms: {'PASS' if ok else 'FAIL'}")
    print(f"   {'opening the explorer (wrap + one loop_view to 12 + figures)':52} {1e3 * opened:7.0f}ms")
    print(f"2  {'r':>3} {'transformers forward':>26} {'Loopable run + readout':>26} {'ratio':>14}")
    print(f"   {'':>3} {'median':>13} {'min':>12} {'median':>13} {'min':>12} {'median':>7} {'min':>6}")
    for r, hf, mine in rows:
        (a, b), (c, d) = (statistics.median(hf), min(hf)), (statistics.median(mine), min(mine))
        print(f"   {r:>3} {1e3 * a:11.1f}ms {1e3 * b:10.1f}ms {1e3 * c:11.1f}ms {1e3 * d:10.1f}ms "
              f"{c / a:7.2f} {d / b:6.2f}")
    print()
    print("overall       :", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
