"""The `workbench` command."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import LoopConfig, LoopLM, __version__
from .data.corpus import stdlib_bytes


def demo(steps: int = 200, seed: int = 0, max_loops: int = 8, progress: bool = True) -> dict[int, float]:
    """Return validation loss per loop count after training a tiny byte-level looped LM on the stdlib."""
    from tqdm.auto import tqdm

    data = torch.frombuffer(bytearray(stdlib_bytes(2_000_000)), dtype=torch.uint8).long()
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    cfg = LoopConfig(vocab_size=256, d_model=128, n_heads=4, n_kv_heads=2, prelude=1, core=2, coda=1,
                     loops=4, max_seq_len=128, inject="channel")
    model = LoopLM(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    B, T = 16, 128

    def batch(src):
        idx = torch.randint(0, len(src) - T - 1, (B,), generator=gen)
        chunk = torch.stack([src[i:i + T + 1] for i in idx.tolist()])
        return chunk[:, :-1], chunk[:, 1:]

    print(f"workbench {__version__}: training {cfg.notation} (byte-level, d={cfg.d_model}) "
          f"on {len(train) / 1e6:.1f} MB of standard-library source for {steps} steps")
    t0 = time.perf_counter()
    bar = tqdm(range(steps), disable=not progress, desc="train")
    for step in bar:
        lr = 3e-3 * min(1.0, (step + 1) / 20)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train)
        loss = model(x, targets=y, return_logits=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    print(f"trained in {time.perf_counter() - t0:.1f} s; final train loss {loss.item():.3f}")
    model.eval()
    x, y = batch(val)
    with torch.no_grad():
        trace = model.trace(x, loops=max_loops)
        losses = {r: trace.loss(r, y).item() for r in range(1, max_loops + 1)}
    print(f"validation loss per loop count (trained at K={cfg.loops}; one trace pass):")
    for r, v in losses.items():
        mark = "  <- K" if r == cfg.loops else ""
        print(f"  r={r:2d}  loss={v:.3f}  bits/byte={v / 0.6931:.3f}{mark}")
    return losses


def main(argv: list[str] | None = None) -> int:
    """Run the `workbench` command line and return its exit status."""
    parser = argparse.ArgumentParser(prog="workbench", description="Looped-LM workbench")
    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="train a tiny looped LM on the standard library and print per-loop losses")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batches")
    p.add_argument("--max-loops", type=int, default=8, help="evaluate r = 1..max-loops")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        if args.steps < 1:
            parser.error(f"--steps={args.steps} is invalid: must be >= 1")
        if args.max_loops < 1:
            parser.error(f"--max-loops={args.max_loops} is invalid: must be >= 1")
        demo(args.steps, args.seed, args.max_loops, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
