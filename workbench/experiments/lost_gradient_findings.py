"""The lost gradient's first claim (seeds/003) measured on `lost_gradient --profile deep`: seeds, pairs, a margin.

The paper: "on a trained model this lost gradient is set near the output: once the loop count is well above k,
it barely changes with the loop count (within about 0.03 from 32 to 64 loops on the three models we tested)".
The deep profile trains the laptop model three times (one data seed, so every run reads the same validation
batches) and measures lost(k) = |g - G_k| / |g| at r = 4 (K) to 64 on 4 batches, no fine-tune.

Comparisons, fixed before the runs ended (commit of this module): for k = 1, 2 and 4 (each well below 32),
per seed the mean over the 4 batches of lost(k) at r = 64 minus lost(k) at r = 32, paired per batch; a 95%
Student t interval over seeds and a Bonferroni interval at 1 - 0.05/3. The paper's claim is one of no change
larger than 0.03, so the verdict is an equivalence one (`stats.equivalence_verdict`): "replicates" when the
corrected interval lies within [-0.03, 0.03], "opposite" when it lies wholly outside it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xarray as xr

from ..io import RunDir, find_runs, read_json
from ..stats import equivalence_verdict, seed_interval, simultaneous
from .run_results import load_results

KS = (1, 2, 4)  # the truncation depths compared, all well below 32
PAIR = (32, 64)  # the paper's loop counts
MARGIN = 0.03  # "within about 0.03 from 32 to 64 loops"


def _deep_runs(runs_dir, pipeline: str) -> dict[int, xr.Dataset]:
    """Return {training seed: the lost gradient at step 0 [loops, batch, k]} of the done no-fine-tune runs."""
    seeds = {}
    for d in find_runs(pipeline, "train", runs_dir):
        p = read_json(RunDir(d).record, "run record").get("params") or {}
        seeds[d.name] = (int(p.get("seed", 0)), int(p.get("data_seed", -1)))
    out, data_seeds = {}, set()
    for d in find_runs(pipeline, "lost_gradient", runs_dir):
        p = read_json(RunDir(d).record, "run record").get("params") or {}
        if int(p.get("finetune_steps", 0)):
            continue  # a fine-tune's runs answer another claim
        train = Path(str(p.get("checkpoint", ""))).name
        if train not in seeds:
            continue
        seed, data_seed = seeds[train]
        if seed in out:
            raise ValueError(f"two lost_gradient runs under {runs_dir} measure training seed {seed}: keep one")
        data_seeds.add(data_seed)
        out[seed] = load_results(d)[["lost", "rho"]].isel(step=0)
    if not out:
        raise FileNotFoundError(f"no finished {pipeline}/lost_gradient runs without a fine-tune under {runs_dir}")
    if len(data_seeds) > 1:
        raise ValueError(f"the runs under {runs_dir} have data seeds {sorted(data_seeds)}: their validation batches "
                         "differ, so their values are not comparable seed to seed (train with one data_seed)")
    return out


def loop_count_claims(runs_dir: str | os.PathLike, pipeline: str = "lost_gradient") -> xr.Dataset:
    """Return one row per k in KS: lost(k) at r = 64 minus at r = 32, paired per batch, t interval over seeds,
    Bonferroni interval over the family and the equivalence verdict at MARGIN; plus lost and rho per (seed, r)."""
    runs = _deep_runs(runs_dir, pipeline)
    seeds = sorted(runs)
    loops = [int(r) for r in runs[seeds[0]].loops.values]
    missing = [r for r in PAIR if r not in loops]
    if missing:
        raise ValueError(f"the runs were not measured at loop counts {missing} (loop_counts {loops}): "
                         f"run `workbench run {pipeline} --profile deep`")
    per_seed = np.array([[float((runs[s].lost.sel(loops=PAIR[1], k=k) - runs[s].lost.sel(loops=PAIR[0], k=k))
                                .mean("batch")) for s in seeds] for k in KS])
    m = len(KS)
    rows = []
    for vals in per_seed:
        ci, corrected = seed_interval(vals), simultaneous(vals, m)
        rows.append((ci, corrected, equivalence_verdict(corrected, MARGIN)))
    dim = "comparison"
    lost = np.array([[[float(runs[s].lost.sel(loops=r, k=k).mean("batch")) for k in KS] for r in loops] for s in seeds])
    rho = np.array([[float(runs[s].rho.sel(loops=r).mean("batch")) for r in loops] for s in seeds])
    ds = xr.Dataset(
        {"difference": (dim, [c.mean for c, _, _ in rows]), "low": (dim, [c.low for c, _, _ in rows]),
         "high": (dim, [c.high for c, _, _ in rows]), "low_corrected": (dim, [c.low for _, c, _ in rows]),
         "high_corrected": (dim, [c.high for _, c, _ in rows]), "verdict": (dim, [v for _, _, v in rows]),
         "per_seed": ((dim, "seed"), per_seed),
         "lost": (("seed", "loops", "k"), lost, {"long_name": "|g - G_k| / |g|, mean over batches"}),
         "rho": (("seed", "loops"), rho, {"long_name": "backward shrink rho, mean over batches"})},
        coords={dim: list(KS), "k": list(KS), "seed": seeds, "loops": loops})
    ds.attrs = {"interval": "95% Student t over per-seed means of per-batch differences lost(k, r=64) - lost(k, r=32)",
                "correction": f"Bonferroni intervals at 1 - 0.05/{m}; equivalence margin {MARGIN}",
                "comparisons": m, "margin": MARGIN}
    return ds


def loop_count_rows(claims: xr.Dataset) -> list[str]:
    """Return docs/findings.md's rows: k, lost(k) at r = 64 minus 32 per seed, mean [95% t], corrected, verdict."""
    out = []
    for i in range(claims.sizes["comparison"]):
        s = claims.isel(comparison=i)
        seeds = " / ".join(f"{float(v):+.4f}" for v in s.per_seed.values)
        out.append(f"| {int(s.comparison)} | {seeds} | {float(s.difference):+.4f} [{float(s.low):+.4f}, "
                   f"{float(s.high):+.4f}] | [{float(s.low_corrected):+.4f}, {float(s.high_corrected):+.4f}] "
                   f"(m = {int(claims.attrs['comparisons'])}) | {s.verdict.item()} |")
    return out


def loop_count_table(claims: xr.Dataset) -> list[str]:
    """Return docs/findings.md's rows: r, then lost(k) for each k and rho, each the seed mean [95% t over seeds]."""
    def cell(v):
        c = seed_interval(v)
        return f"{c.mean:.3f} [{c.low:.3f}, {c.high:.3f}]"

    out = []
    for r in claims.loops.values:
        lost = [cell(claims.lost.sel(loops=r, k=k).values) for k in claims.k.values]
        out.append(f"| {int(r)} | " + " | ".join(lost) + f" | {cell(claims.rho.sel(loops=r).values)} |")
    return out
