"""Law-fitting benchmark (issue 5): a full phi fit with 1,000 bootstrap resamples on 24 runs.

One process, printed as absolute times. Run from the repository root:

    python benchmarks/bench_laws.py
    python benchmarks/bench_laws.py --runs 48 --bootstrap 200 --seed 3

Target: under a minute on 2 cores for the full fit (the paper's 4,500-start grid times phi in
{0, 0.5, 1, 1.5} = 18,000 starts, then 1,000 resamples refitted). Also printed: the recovered phi and
its 95% interval against the planted value, and the time of the same fit without the bootstrap.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
import time
from pathlib import Path

import numpy as np
import scipy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench import laws  # noqa: E402

PLANTED = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28, "phi": 0.46}
TARGET_S = 60.0


def synthetic_runs(n_runs: int, seed: int, noise: float) -> dict[str, np.ndarray]:
    """A sweep over N_once x N_rec x r in {1, 2, 4, 8}, tokens log-uniform over 1.5 decades, lognormal noise."""
    rng = np.random.default_rng(seed)
    cfg = list(itertools.product([1e6, 4e6], [2e6, 8e6, 32e6], [1, 2, 4, 8]))
    rows = [cfg[i % len(cfg)] for i in range(n_runs)]
    n_once, n_rec, loops = (np.array(c, dtype=float) for c in zip(*rows))
    tokens = 10 ** rng.uniform(9, 10.5, n_runs)
    p = PLANTED
    loss = p["E"] + p["A"] * (n_once + loops ** p["phi"] * n_rec) ** -p["alpha"] + p["B"] * tokens ** -p["beta"]
    loss = loss * np.exp(rng.normal(0, noise, n_runs))
    return {"n_once": n_once, "n_rec": n_rec, "loops": loops, "tokens": tokens, "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=24)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.005, help="sd of multiplicative lognormal noise on the loss")
    args = ap.parse_args()
    print("# bench_laws (issue 5)")
    print(f"date    : {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"numpy   : {np.__version__}  scipy={scipy.__version__}  cores={os.cpu_count()}  "
          f"load={os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "")
    table = synthetic_runs(args.runs, args.seed, args.noise)
    print(f"data    : {args.runs} runs, noise sd {args.noise}, planted "
          + ", ".join(f"{k}={v:g}" for k, v in PLANTED.items()))

    t0 = time.perf_counter()
    point = laws.fit_phi(table, bootstrap=0, seed=args.seed)
    t_grid = time.perf_counter() - t0
    t0 = time.perf_counter()
    fit = laws.fit_phi(table, bootstrap=args.bootstrap, seed=args.seed)
    t_full = time.perf_counter() - t0

    lo, hi = fit.intervals["phi"]
    print(f"grid only ({fit.n_starts} starts, no bootstrap): {t_grid:.1f} s")
    print(f"full fit ({fit.n_starts} starts + {args.bootstrap} bootstrap resamples): {t_full:.1f} s  "
          f"target < {TARGET_S:.0f} s: {'PASS' if t_full < TARGET_S else 'FAIL'}")
    print(f"phi     : {fit.params['phi']:.4f}  95% CI [{lo:.4f}, {hi:.4f}]  planted {PLANTED['phi']}  "
          f"error {fit.params['phi'] - PLANTED['phi']:+.4f}  covered={'yes' if lo <= PLANTED['phi'] <= hi else 'no'}")
    for k in ("alpha", "beta", "E", "A", "B"):
        a, b = fit.intervals[k]
        print(f"{k:8s}: {fit.params[k]:.4g}  95% CI [{a:.4g}, {b:.4g}]  planted {PLANTED[k]:g}")
    print(f"objective (Huber sum): {fit.loss:.4g}  same estimate without bootstrap: "
          f"{'yes' if abs(point.params['phi'] - fit.params['phi']) < 1e-9 else 'no'}  "
          f"failed resamples: {fit.n_failed}")


if __name__ == "__main__":
    main()
