"""Scale-out benchmarks (issue 18), side by side on this machine, in alternating rounds.

1. Data-parallel training: `torchrun --nproc_per_node 2` (gloo, half the cores per rank, half the
   batch each) against one process with all the cores and one process with one core, on the same
   global batch. Tokens/s of the whole batch, median over the steps after the first two. On a CPU no
   gain is expected: the two ranks split the cores one process already uses, and add an all-reduce
   per step; when other work loads the cores, one multi-threaded process suffers most (its OpenMP
   threads wait at every barrier for a descheduled sibling).
2. A Dask sweep (phi_sweep's smoke profile, 11 runs, a LocalCluster of 2 workers started by the
   executor): wall time with each run's torch threads set to its worker's share of the cores (the
   default) against every run taking all the cores (threads = cores: 2 workers x 2 threads on 2 cores).

Usage: python benchmarks/bench_ddp.py [--steps 12] [--rounds 2] [--skip-dask]
       (the script also serves as its own training worker: --worker OUT)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the model: the quickstart's 1+2x4+1 at d=128, a global batch of 16 x 128 tokens
MODEL = dict(vocab_size=2048, d_model=128, n_heads=4, n_kv_heads=2, prelude=1, core=2, coda=1, loops=4,
             inject="channel", max_seq_len=128)
BATCH, SEQ = 16, 128


def worker(out: str, steps: int) -> None:
    """Train MODEL for `steps` steps (data-parallel under torchrun) and write rank 0's tokens/s per step."""
    import numpy as np

    from workbench import LoopConfig
    from workbench.train import Trainer, TrainConfig, init_distributed

    rank, world, _ = init_distributed()
    data = np.random.default_rng(0).integers(0, MODEL["vocab_size"], 2_000_000).astype(np.uint16)
    tc = TrainConfig(steps=steps, batch_size=BATCH // world, seq_len=SEQ, lr=3e-3, warmup=2, progress=False,
                     compile="off", checkpoint_seconds=0)
    trainer = Trainer(LoopConfig(**MODEL), tc, data)
    ds = trainer.run()
    if rank == 0:
        import torch

        Path(out).write_text(json.dumps({"tokens_per_s": ds.tokens_per_s.values.tolist(), "world": world,
                                         "threads": torch.get_num_threads(), "precision": ds.attrs["precision"]}))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def train_once(nproc: int, threads: int, steps: int, tmp: Path) -> dict:
    """Return the worker's record after one run of `nproc` processes with `threads` torch threads each."""
    out = tmp / f"tok-{nproc}-{time.time_ns()}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    me = [str(Path(__file__).resolve()), "--worker", str(out), "--steps", str(steps)]
    cmd = ([sys.executable, *me] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *me])
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=900)
    rec = json.loads(out.read_text())
    rec["median"] = statistics.median(rec["tokens_per_s"][2:])  # the first steps warm the allocator up
    return rec


def sweep_once(threads: int, jobs: int, tmp: Path) -> float:
    """Return the wall seconds of phi_sweep's smoke profile on a fresh LocalCluster of `jobs` workers."""
    from workbench import pipeline

    runs = tmp / f"runs-{threads}-{time.time_ns()}"
    t0 = time.perf_counter()
    result = pipeline.run("phi_sweep", profile="smoke", executor="dask", jobs=jobs, threads=threads,
                          runs_dir=runs, log=None, report_html=False)
    wall = time.perf_counter() - t0
    if not result.ok:
        raise RuntimeError(result.summary())
    return wall


def load() -> str:
    """Return the 1-minute load average (other work sharing the cores)."""
    return f"{os.getloadavg()[0]:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-dask", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    from workbench.pipeline import machine_cores

    cores = machine_cores()
    print("# bench_ddp (issue 18)")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}; cores: {cores}; "
          f"load at start: {load()}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # (processes, threads each): one process on all the cores, one on one core, two ranks of one thread
        setups = [(1, cores), (1, 1), (2, max(1, cores // 2))]
        speed: dict = {s: [] for s in setups}
        for i in range(args.rounds):
            for nproc, threads in setups:
                rec = train_once(nproc, threads, args.steps, tmp)
                speed[nproc, threads].append(rec["median"])
                print(f"  round {i + 1}: {nproc} process(es) x {rec['threads']} thread(s), {rec['precision']}: "
                      f"{rec['median']:,.0f} tokens/s (load {load()})", flush=True)
        med = {s: statistics.median(v) for s, v in speed.items()}
        two = med[2, max(1, cores // 2)]
        print(f"1. DDP training, 1+2x4+1 d=128, global batch {BATCH}x{SEQ}, {args.steps} steps, tokens/s (median of "
              f"rounds): " + ", ".join(f"{n} x {t} thread(s) {v:,.0f}" for (n, t), v in med.items())
              + f"; two ranks against one process on all the cores {two / med[1, cores]:.2f}x, against one "
              f"process on one core {two / med[1, 1]:.2f}x")
        if args.skip_dask:
            return
        split, whole = [], []
        for i in range(args.rounds):
            for threads, acc in ((0, split), (cores, whole)):
                wall = sweep_once(threads, 2, tmp)
                acc.append(wall)
                what = "split (each worker's share)" if threads == 0 else f"not split ({threads} per run)"
                print(f"  round {i + 1}: threads {what}: {wall:.1f} s (load {load()})", flush=True)
        s, w = statistics.median(split), statistics.median(whole)
        print(f"2. Dask phi_sweep smoke (11 runs, LocalCluster of 2 workers): split {s:.1f} s, not split "
              f"{w:.1f} s: not split takes {w / s:.2f}x the time")


if __name__ == "__main__":
    main()
