"""The retrofit paper's recipe claims (seeds/000, second part) read from `retrofit_recipe` runs, over seeds.

The comparisons were fixed in docs/findings.md before any run: per seed one number each, a Student t interval
over the seeds, Holm over the family of six and Bonferroni-wide intervals, a verdict in the paper's direction
(`workbench.stats`). Each seed's anneal, scratchpad and inverse runs are read (each phase after its own
seed's upstream, as the laptop profile pairs them):
- installed: mean teacher-forced diagonal accuracy (loop = depth) at the supervised depths after annealing,
  minus chance (0.10 for residues mod 10): "computes one task step per loop and persists when only final
  answers are graded";
- extrapolation: the deepest depth through which the diagonal stays at or above 0.7, over K, minus 1 (past
  the supervised depth at all; the paper's multiple, 1.5, is printed beside it);
- overall and beyond: greedy answer accuracy, looped minus scratchpad, over every trained-and-beyond depth
  and beyond K only ("won overall ... retained 53% versus 2.5% beyond depth 10");
- speed: the scratchpad's seconds per answer over the looped model's, minus 1 ("answered 7.6 times faster");
- interference: the installed rule's diagonal at the supervised depths after training the inverse rule,
  minus before it (the paper: no continuation kept the installed mechanism, so negative). "Before" is the
  anneal the inverse continued from (its record's upstream key), wherever under the pipeline's folder that
  anneal lies: a seed's chain made again (a `rerun/` folder) keeps its inverse paired with its own anneal.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from ..io import RunDir, find_runs, read_json
from ..stats import claim_variables, correct_family, seed_interval
from .run_results import load_results

CHANCE = 0.10  # ten residues: the most common answer's share of uniformly drawn examples
HOLD = 0.7  # the paper's extrapolation threshold: accuracy held at or above 70%
# (comparison, the paper's sign, what the per-seed number is): fixed before the runs
COMPARISONS = (("installed", +1, "mean diagonal accuracy at depths first..K after annealing - 0.10"),
               ("extrapolation", +1, "deepest depth held at >= 0.7, over K, - 1"),
               ("overall", +1, "greedy accuracy, looped - scratchpad, depths first..max"),
               ("beyond", +1, "greedy accuracy, looped - scratchpad, depths past K"),
               ("speed", +1, "scratchpad seconds per answer / looped - 1"),
               ("interference", -1, "installed rule's diagonal at first..K after the inverse - before"))


def _run_dirs(runs_dir, pipeline: str, step: str) -> dict[int, Path]:
    """Return {seed: folder} of a step's finished runs (one per seed; a second is an error)."""
    out: dict[int, Path] = {}
    for d in find_runs(pipeline, step, runs_dir):
        seed = int((read_json(RunDir(d).record, "run record").get("params") or {}).get("seed", 0))
        if seed in out:
            raise ValueError(f"{pipeline}/{step} has two finished runs of seed {seed} under {runs_dir}: keep one "
                             "recipe per runs folder")
        out[seed] = d
    return out


def _by_seed(runs_dir, pipeline: str, step: str) -> dict[int, xr.Dataset]:
    """Return {seed: results Dataset} of a step's finished runs (one per seed; a second is an error)."""
    return {s: load_results(d) for s, d in _run_dirs(runs_dir, pipeline, step).items()}


def _upstream_anneals(runs_dir, pipeline: str, inverse: dict[int, Path]) -> dict[int, xr.Dataset]:
    """Return {seed: results of the anneal run each inverse run continued from}, for inverses that name one."""
    out = {}
    for seed, d in inverse.items():
        upstream = read_json(RunDir(d).record, "run record").get("upstream") or []
        hits = [a for key in upstream for a in (Path(runs_dir) / pipeline).glob(f"**/anneal/{key}")]
        if upstream and not hits:
            raise ValueError(f"{d} continued from anneal {upstream[0]}, which is not under {Path(runs_dir) / pipeline}:"
                             " keep a seed's whole chain in one runs folder")
        if hits:
            out[seed] = load_results(hits[0])
    return out


def held_multiple(step_accuracy: xr.DataArray, K: int, first: int) -> float:
    """Return the deepest depth d >= first with accuracy >= 0.7 at every depth first..d, over K (0 when none)."""
    held = 0
    for d in sorted(int(x) for x in step_accuracy.depth.values if x >= first):
        if not float(step_accuracy.sel(depth=d)) >= HOLD:
            break
        held = d
    return held / K


def _values(anneal: xr.Dataset, scratch: xr.Dataset | None, inverse: xr.Dataset | None,
            before: xr.Dataset | None = None) -> dict[str, float]:
    """Return one seed's number for each comparison its runs allow (`before`: the inverse's own anneal, if not `anneal`)."""
    K, first = int(anneal.attrs["loops"]), int(anneal.attrs["first_depth"])
    depths = anneal.depth.values
    within = depths[(depths >= first) & (depths <= K)]
    diag = anneal.step_accuracy
    out = {"installed": float(diag.sel(depth=within).mean()) - CHANCE,
           "extrapolation": held_multiple(diag, K, first) - 1}
    if scratch is not None:
        looped = anneal.answer_accuracy.sel(approach="looped")
        pad = scratch.answer_accuracy.sel(approach="scratchpad")
        past = depths[depths > K]
        out["overall"] = float((looped - pad).sel(depth=depths[depths >= first]).mean())
        if len(past):
            out["beyond"] = float((looped - pad).sel(depth=past).mean())
        t_loop = float(anneal.seconds_per_answer.sel(approach="looped", depth=within).mean())
        t_pad = float(scratch.seconds_per_answer.sel(approach="scratchpad", depth=within).mean())
        out["speed"] = t_pad / t_loop - 1
    if inverse is not None:
        start = (before if before is not None else anneal).step_accuracy
        out["interference"] = float(inverse.step_accuracy.sel(depth=within).mean() - start.sel(depth=within).mean())
    return out


def recipe_claims(runs_dir: str | os.PathLike, pipeline: str = "retrofit_recipe") -> xr.Dataset:
    """Return one row per comparison (dim `comparison`): seed mean, 95% t interval, Holm p over the family of six,
    the Bonferroni interval and the verdict in the paper's direction; `per_seed` [comparison, seed] beside them."""
    anneal = _by_seed(runs_dir, pipeline, "anneal")
    if not anneal:
        raise ValueError(f"no finished {pipeline}/anneal run under {runs_dir}: run `workbench run {pipeline} "
                         "--profile laptop --jobs 1` first")
    scratch, inverse_dirs = _by_seed(runs_dir, pipeline, "scratchpad"), _run_dirs(runs_dir, pipeline, "inverse")
    inverse = {s: load_results(d) for s, d in inverse_dirs.items()}
    before = _upstream_anneals(runs_dir, pipeline, inverse_dirs)
    seeds = sorted(anneal)
    per = {s: _values(anneal[s], scratch.get(s), inverse.get(s), before.get(s)) for s in seeds}
    rows = []
    for name, sign, what in COMPARISONS:
        values = [per[s][name] for s in seeds if name in per[s]]
        if len(values) >= 2:
            rows.append({"comparison": name, "sign": sign, "statistic": what, "values": values,
                         "ci": seed_interval(values)})
    if not rows:
        raise ValueError(f"the {pipeline} runs under {runs_dir} hold fewer than 2 seeds: an interval needs 2 or more")
    correct_family(rows, len(COMPARISONS))  # the family fixed before the runs, whether or not every row is read yet
    dim = "comparison"
    data: dict[str, Any] = {
        **claim_variables(rows, dim),
        "per_seed": ((dim, "seed"), [[per[s].get(r["comparison"], np.nan) for s in seeds] for r in rows])}
    coords = {dim: [r["comparison"] for r in rows], "sign": (dim, [r["sign"] for r in rows]),
              "statistic": (dim, [r["statistic"] for r in rows]), "seed": seeds}
    held = [held_multiple(anneal[s].step_accuracy, int(anneal[s].attrs["loops"]), int(anneal[s].attrs["first_depth"]))
            for s in seeds]
    ds = xr.Dataset(data, coords=coords)
    ds["held_multiple"] = ("seed", held, {"long_name": "deepest depth held at >= 0.7, over K (the paper: 1.5)"})
    m = len(COMPARISONS)
    ds.attrs = {"interval": "95% Student t over per-seed values", "family_size": m,
                "correction": f"Holm p-values and Bonferroni intervals at 1 - 0.05/{m} over the family"}
    return ds


PAPER = {"installed": "one step per loop, kept when only final answers are graded",
         "extrapolation": "held 70% through depth 18, roughly 1.5 x its supervised depth",
         "overall": "84% against 72%", "beyond": "53% against 2.5% beyond depth 10",
         "speed": "7.6 times faster", "interference": "no continuation kept the installed mechanism"}


def recipe_claim_rows(claims: xr.Dataset) -> list[str]:
    """Return docs/findings.md's rows: comparison, statistic, per-seed values, mean [95% t], Bonferroni interval,
    Holm p, the paper's number and the verdict."""
    out = []
    for i in range(claims.sizes["comparison"]):
        s = claims.isel(comparison=i)
        seeds = " / ".join(f"{float(v):+.3f}" for v in s.per_seed.values if np.isfinite(v))
        out.append(f"| {s.comparison.item()} | {s.statistic.item()} | {seeds} | {float(s.difference):+.3f} "
                   f"[{float(s.low):+.3f}, {float(s.high):+.3f}] | [{float(s.low_corrected):+.3f}, "
                   f"{float(s.high_corrected):+.3f}] (m = {int(s.family_size)}) | {float(s.p_holm):.3f} | "
                   f"{PAPER[s.comparison.item()]} | {s.verdict.item()} |")
    return out


def recipe_depth_rows(runs_dir: str | os.PathLike, pipeline: str = "retrofit_recipe") -> list[str]:
    """Return docs/findings.md's per-depth rows: per seed (0 / 1 / 2 ...) the annealed diagonal accuracy, the looped
    and scratchpad greedy answer accuracies, and the forward rule's diagonal after the inverse ("-" where not run)."""
    phases = {step: _by_seed(runs_dir, pipeline, step) for step in ("anneal", "scratchpad", "inverse")}
    seeds = sorted(phases["anneal"])
    if not seeds:
        raise ValueError(f"no finished {pipeline}/anneal run under {runs_dir}")
    K = int(phases["anneal"][seeds[0]].attrs["loops"])

    def cells(step: str, var, d: int) -> str:
        got = [phases[step].get(s) for s in seeds]
        return " / ".join("-" if ds is None else f"{float(var(ds).sel(depth=d)):.2f}" for ds in got)

    rows = []
    for d in (int(x) for x in phases["anneal"][seeds[0]].depth.values):
        rows.append(f"| {d}{' (K)' if d == K else ''} | {cells('anneal', lambda ds: ds.step_accuracy, d)} | "
                    f"{cells('anneal', lambda ds: ds.answer_accuracy.sel(approach='looped'), d)} | "
                    f"{cells('scratchpad', lambda ds: ds.answer_accuracy.sel(approach='scratchpad'), d)} | "
                    f"{cells('inverse', lambda ds: ds.step_accuracy, d)} |")
    return rows
