"""Findings: a pipeline's finished runs reduced to the numbers a paper's claim is checked against, with 95% intervals.

`allocation_summary(runs_dir)` reads the allocation pipeline's trained models and measures, per model,
the terminal-to-core response ratio (SPEC §3) and the validation loss at its training loop count, each
on `n` held-out sequences separately, so the 95% interval is a percentile bootstrap over sequences.
`taper_summary` does the same for the width schedules, paired with uniform per window; `phi_rows` reads
a phi fit; `wilson` is the interval of an accuracy. `collect(...)` copies a pipeline's compact results
(each done run's results.nc, run.json and figure JSON) under a folder such as docs/findings/<pipeline>/;
`markdown_rows`, `taper_rows` and `phi_rows` format the numbers docs/findings.md quotes, so a test can
check the document against the committed data.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from ..config import check_int
from ..io import RunDir, find_runs
from ..stats import holm, seed_interval, simultaneous, verdict
from .run_results import load_results


def bootstrap_ci(values: Any, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Return (mean, low, high): the mean of `values` and its 95% percentile-bootstrap interval."""
    # by hand, not scipy.stats.bootstrap: that returns NaN for a constant sample, which a model's paired
    # difference with itself (the reference row of every table) is
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, (check_int("n_boot", n_boot, 1), v.size))].mean(axis=1)
    return float(v.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def wilson(hits: int, n: int) -> tuple[float, float]:
    """Return the 95% Wilson score interval (low, high) of a proportion of `hits` out of `n`."""
    from scipy.stats import binomtest

    ci = binomtest(check_int("hits", hits, 0, n), check_int("n", n, 1)).proportion_ci(0.95, method="wilson")
    return float(ci.low), float(ci.high)


def _windows(run_dir: Path, n: int, seq_len: int, seed: int):
    """Return (run, windows [n, seq_len + 1], next-token loss of each window at the training loop count)."""
    from .runs import load_run

    run = load_run(run_dir, device="cpu")
    x, K = run.val_tokens(n, seq_len, seed=seed), run.model.cfg.loops
    with torch.no_grad():
        losses = [float(run.model(x[i:i + 1, :-1], loops=K, targets=x[i:i + 1, 1:]).loss) for i in range(n)]
    return run, x, losses


def allocation_summary(runs_dir: str | os.PathLike, n: int = 16, seq_len: int = 64, seed: int = 0) -> xr.Dataset:
    """Return per trained model (dim `model`): terminal-to-core ratio and loss at K with 95% bootstrap intervals.

    Every done run of the allocation pipeline's `train` step is reopened; `n` validation windows of
    `seq_len` tokens are probed one at a time (`probes.interaction` at the training loop count), and
    the ratio and the next-token loss of each window are the samples the intervals resample.
    `loss_vs_nonlooped` is the paired per-window difference to the non-looped run (loops 1) when both
    read the same windows (NaN otherwise).
    """
    from ..probes import interaction

    n = check_int("n", n, 2)
    rows = []
    for d in find_runs("allocation", "train", runs_dir):
        run, x, losses = _windows(d, n, seq_len, seed)
        m, K = run.model, run.model.cfg.loops
        ratios = [float(interaction(m, x[i:i + 1, :-1], loops=K).terminal_to_core) for i in range(n)]
        cfg = m.cfg
        rows.append({"model": cfg.notation, "prelude": cfg.prelude, "core": cfg.core, "coda": cfg.coda, "loops": K,
                     "depth": cfg.prelude + cfg.core * K + cfg.coda, "run": d.name, "x": x, "losses": losses,
                     "ttc": bootstrap_ci(ratios, seed=seed), "loss": bootstrap_ci(losses, seed=seed)})
    if not rows:
        raise FileNotFoundError(f"no finished allocation/train runs under {runs_dir}")
    rows.sort(key=lambda r: (r["coda"] == 0, r["core"] * r["loops"] != 12, r["core"], r["prelude"]))
    # paired with the non-looped model on the same windows (same corpus, seed and tokenizer): the
    # sequences' own difficulty cancels, which the unpaired intervals above cannot remove
    base = next((r for r in rows if r["loops"] == 1), None)
    for r in rows:
        paired = base is not None and torch.equal(r["x"], base["x"])
        r["dloss"] = (bootstrap_ci(np.subtract(r["losses"], base["losses"]), seed=seed) if paired
                      else (float("nan"),) * 3)
    data = {}
    for key, name, long in (("ttc", "terminal_to_core", "terminal-to-core response ratio (SPEC §3)"),
                            ("loss", "loss_at_K", "validation loss at the training loop count (nats/token)"),
                            ("dloss", "loss_vs_nonlooped", "loss at K minus the non-looped model's on the same "
                                                          "sequences (nats/token)")):
        data[name] = ("model", [r[key][0] for r in rows], {"long_name": long})
        data[f"{name}_low"] = ("model", [r[key][1] for r in rows], {"long_name": f"{long}, 95% interval low"})
        data[f"{name}_high"] = ("model", [r[key][2] for r in rows], {"long_name": f"{long}, 95% interval high"})
    coords = {"model": [r["model"] for r in rows]}
    for k in ("prelude", "core", "coda", "loops", "depth", "run"):
        coords[k] = ("model", [r[k] for r in rows])
    return xr.Dataset(data, coords=coords, attrs={"sequences": n, "seq_len": seq_len, "seed": seed,
                                                   "interval": "95% percentile bootstrap over sequences"})


def collect(pipeline: str, runs_dir: str | os.PathLike, dest: str | os.PathLike,
            figures: bool | tuple[str, ...] = True) -> list[Path]:
    """Return the folders written: each done run's results.nc, run.json and figures/*.json copied to dest/<step>/<key>/.

    `figures`: True copies every run's figure JSON, False none, a tuple of step names only those steps'
    (a 100-run sweep's training figures are megabytes; its fit's are what a reader opens).
    """
    src, out, written = Path(runs_dir) / pipeline, Path(dest), []
    for step in sorted(p.name for p in src.iterdir() if p.is_dir()) if src.is_dir() else []:
        with_figures = figures is True or (not isinstance(figures, bool) and step in figures)
        for d in find_runs(pipeline, step, runs_dir):
            target = out / step / d.name
            src_run, dst_run = RunDir(d), RunDir(target)
            figs = sorted(src_run.figures.glob("*.json")) if with_figures else []
            (dst_run.figures if figs else target).mkdir(parents=True, exist_ok=True)
            for f in [src_run.results, src_run.record, *figs]:
                if f.exists():
                    shutil.copy2(f, target / f.relative_to(d))
            written.append(target)
    return written


def fmt(value: float, low: float, high: float, digits: int = 2) -> str:
    """Return `value [low, high]` rounded to `digits` decimals (how docs/findings.md quotes a number)."""
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def markdown_rows(summary: xr.Dataset) -> list[str]:
    """Return docs/findings.md's table rows for an allocation summary: one per model, numbers as `fmt` writes them."""
    rows = []
    for i in range(summary.sizes["model"]):
        s = summary.isel(model=i)
        kind = "no coda" if int(s.coda) == 0 else ("non-looped" if int(s.loops) == 1 else "coda")
        rows.append(f"| {str(s.model.values)} | {kind} | {int(s.depth)} | "
                    f"{fmt(float(s.terminal_to_core), float(s.terminal_to_core_low), float(s.terminal_to_core_high))} | "
                    f"{fmt(float(s.loss_at_K), float(s.loss_at_K_low), float(s.loss_at_K_high), 3)} | "
                    f"{fmt(float(s.loss_vs_nonlooped), float(s.loss_vs_nonlooped_low), float(s.loss_vs_nonlooped_high), 3)} |")
    return rows


# SPEC §4: the recurrence-equivalence exponent the papers report per variant
PAPER_PHI = {"hyper=1,truncated=False": ("full BPTT", 0.46),
             "hyper=1,truncated=True": ("truncated to the last ceil(r/2) loops", 0.38),
             "hyper=2,truncated=False": ("hyper-connections (n = 2)", 0.65)}


def phi_rows(fit: xr.Dataset) -> list[str]:
    """Return docs/findings.md's row starts for a phi fit's results.nc: `| φ, variant | paper | ours [95% interval] |`."""
    rows = []
    for g in fit.group.values:
        label, paper = PAPER_PHI.get(str(g), (str(g), float("nan")))
        e = fit.sel(group=g, param="phi")
        rows.append(f"| φ, {label} | {paper:.2f} | {fmt(float(e.estimate), float(e.low), float(e.high))} |")
    return rows


def taper_summary(runs_dir: str | os.PathLike, n: int = 16, seq_len: int = 64, seed: int = 0) -> xr.Dataset:
    """Return per MLP width schedule (dim `taper`): loss at K and its paired difference to uniform, 95% intervals.

    Every done run of the taper pipeline's `train` step is reopened and scored on `n` validation
    windows of `seq_len` tokens; runs of one seed share the tokenizer and so the windows, which makes
    the difference to the uniform run of the same seed a paired one. `loss_*` and `vs_uniform_*` bootstrap
    the windows pooled over seeds (no seed variance: a description of the pooled runs, not a claim's interval), `vs_uniform_seed*`
    is the 95% t interval over the seeds' mean paired differences (stats.seed_interval: seeds are the unit
    of replication; NaN with fewer than 2 seeds), and `vs_uniform_per_seed` each seed's mean difference.
    """
    n = check_int("n", n, 2)
    per: dict[tuple[str, int], tuple[torch.Tensor, list[float]]] = {}
    for d in find_runs("taper", "train", runs_dir):
        run, x, losses = _windows(d, n, seq_len, seed)
        per[(run.model.cfg.taper, int(run.experiment.get("seed", 0)))] = (x, losses)
    if not per:
        raise FileNotFoundError(f"no finished taper/train runs under {runs_dir}")
    tapers = sorted({t for t, _ in per}, key=lambda t: (t != "uniform", t))
    data: dict[str, list[float]] = {k: [] for k in ("loss", "loss_low", "loss_high", "vs_uniform", "vs_uniform_low",
                                                    "vs_uniform_high", "seeds", "vs_uniform_seed", "vs_uniform_seed_low",
                                                    "vs_uniform_seed_high")}
    all_seeds = sorted({s_ for _, s_ in per})
    per_seed = np.full((len(tapers), len(all_seeds)), np.nan)
    for ti, t in enumerate(tapers):
        seeds = sorted(s_ for tt, s_ in per if tt == t)
        mean, lo, hi = bootstrap_ci([v for s_ in seeds for v in per[(t, s_)][1]], seed=seed)
        diffs = [a - b for s_ in seeds if ("uniform", s_) in per and torch.equal(per[(t, s_)][0], per[("uniform", s_)][0])
                 for a, b in zip(per[(t, s_)][1], per[("uniform", s_)][1])]
        dm, dlo, dhi = bootstrap_ci(diffs, seed=seed)
        for s_ in seeds:
            if ("uniform", s_) in per and torch.equal(per[(t, s_)][0], per[("uniform", s_)][0]):
                per_seed[ti, all_seeds.index(s_)] = float(np.mean(np.subtract(per[(t, s_)][1], per[("uniform", s_)][1])))
        v = per_seed[ti][np.isfinite(per_seed[ti])]
        sm = seed_interval(v) if v.size >= 2 else None
        seed_ci = (sm.mean, sm.low, sm.high) if sm else (float("nan"),) * 3
        for k, val in zip(data, (mean, lo, hi, dm, dlo, dhi, len(seeds), *seed_ci)):
            data[k].append(val)
    out = xr.Dataset({k: ("taper", v) for k, v in data.items()}, coords={"taper": tapers, "seed": all_seeds},
                     attrs={"sequences": n, "seq_len": seq_len, "seed": seed,
                            "interval": "95% percentile bootstrap over windows pooled over seeds; vs_uniform paired "
                                        "per window within a seed; vs_uniform_seed: 95% t interval over seeds"})
    out["vs_uniform_per_seed"] = (("taper", "seed"), per_seed)
    return out


def taper_rows(summary: xr.Dataset) -> list[str]:
    """Return docs/findings.md's table rows for a taper summary: schedule, seeds, loss at K, difference to uniform."""
    return [f"| {t} | {int(s.seeds)} | {fmt(float(s.loss), float(s.loss_low), float(s.loss_high), 3)} | "
            f"{fmt(float(s.vs_uniform), float(s.vs_uniform_low), float(s.vs_uniform_high), 3)} |"
            for t, s in ((str(t), summary.sel(taper=t)) for t in summary.taper.values)]



# The taper family, fixed before the `seeds` profile's runs ended: seeds/000's two directions (a cosine taper
# "improves perplexity over a uniform-width baseline, while the reverse allocation hurts"), each the per-seed
# mean over held-out windows of the paired loss difference to uniform at K; Holm over 2.
TAPER_COMPARISONS = (("cosine", -1), ("reverse", +1))


def taper_claims(summary: xr.Dataset) -> xr.Dataset:
    """Return the taper family's rows (dim `comparison`: cosine, reverse, each minus uniform): per-seed values,
    their t interval over seeds, the Bonferroni interval over the family, Holm p and the verdict."""
    from ..stats import claim_variables, correct_family

    rows = []
    for taper, sign in TAPER_COMPARISONS:
        if taper not in summary.taper.values:
            raise ValueError(f"taper_claims: the summary has no {taper!r} runs (it has {list(summary.taper.values)}); "
                             "the family compares cosine and reverse with uniform")
        v = summary.vs_uniform_per_seed.sel(taper=taper).values
        v = v[np.isfinite(v)]
        rows.append({"values": v, "ci": seed_interval(v), "sign": sign})
    correct_family(rows, len(TAPER_COMPARISONS))
    names = [t for t, _ in TAPER_COMPARISONS]
    per_seed = summary.vs_uniform_per_seed.sel(taper=names).rename(taper="comparison")
    return xr.Dataset({**claim_variables(rows), "per_seed": per_seed.drop_vars("comparison"),
                       "direction": ("comparison", [s for _, s in TAPER_COMPARISONS])},
                      coords={"comparison": names, "seed": summary.seed.values},
                      attrs={"statistic": "loss at K minus uniform's, nats/token, mean over held-out windows paired "
                                          "within a seed", "family": "taper", "family_size": len(TAPER_COMPARISONS),
                             "interval": "95% t over seeds; corrected: Bonferroni over the family"})


def taper_claim_rows(claims: xr.Dataset) -> list[str]:
    """Return docs/findings.md's rows of the taper family: comparison, per-seed values, mean [95% t], the
    Bonferroni interval, Holm p and the verdict."""
    out = []
    for c in claims.comparison.values:
        s = claims.sel(comparison=c)
        seeds = " / ".join(f"{float(v):+.4f}" for v in s.per_seed.values if np.isfinite(v))
        out.append(f"| {c} - uniform | {seeds} | {float(s.difference):+.4f} [{float(s.low):+.4f}, "
                   f"{float(s.high):+.4f}] | [{float(s.low_corrected):+.4f}, {float(s.high_corrected):+.4f}] "
                   f"(m = {int(s.family_size)}) | {float(s.p_holm):.3f} | {s.verdict.item()} |")
    return out


def variant_name(cfg: dict) -> str:
    """Return the recurrence-effectiveness paper's name of a model's loop conditioning: plain, I, H(w=2), LG, I+H(w=2)+LG, ..."""
    parts = []
    if cfg.get("inject", "none") != "none":
        parts.append("I" if cfg["inject"] == "channel" else f"I({cfg['inject']})")
    if cfg.get("history", 0):
        parts.append(f"H(w={cfg['history']})")
    if cfg.get("timestep", "none") != "none":
        parts.append({"loop_gate": "LG"}.get(cfg["timestep"], cfg["timestep"]))
    return "+".join(parts) or "plain"


def conditioning_summary(runs_dir: str | os.PathLike) -> xr.Dataset:
    """Return per conditioning variant, loop count and task group: exact-match accuracy, its Wilson 95% interval, n and chance.

    Reads every done `sweep` run of the conditioning pipeline (loop_sweep's task results). Over dims
    (`variant`, `loop`, `group`), `accuracy`/`low`/`high`/`n`/`chance` pool the examples at the depths
    each task was trained at; the `*_beyond` variables the examples past them (reasoning only; NaN for
    knowledge). `chance` is the count-weighted majority-class rate of the same examples. `loss` is the
    validation loss per loop count. The intervals are per variant; examples are the same for every
    variant of one seed, but per-example outcomes are not kept, so comparisons between variants are
    unpaired.
    """
    import json

    from .runs import group_pool

    per = {}
    for d in find_runs("conditioning", "sweep", runs_dir):
        ds = load_results(d)
        cfg = json.loads(ds.attrs["config_json"])
        per[variant_name(cfg)] = (ds, cfg)
    if not per:
        raise FileNotFoundError(f"no finished conditioning/sweep runs under {runs_dir}")
    order = ["plain", "I", "H(w=1)", "H(w=2)", "H(w=4)", "LG", "H(w=2)+LG", "I+H(w=2)", "I+LG", "I+H(w=2)+LG"]
    variants = sorted(per, key=lambda v: (order.index(v) if v in order else len(order), v))
    loops = sorted(set.intersection(*(set(ds.loop.values.tolist()) for ds, _ in per.values())))
    groups = ["knowledge", "reasoning"]
    shape = (len(variants), len(loops), len(groups))
    out = {f"{v}{s}": np.full(shape, np.nan) for v in ("accuracy", "low", "high", "n", "chance") for s in ("", "_beyond")}
    loss = np.full(shape[:2], np.nan)
    for vi, v in enumerate(variants):
        ds, _ = per[v]
        loss[vi] = ds.loss.sel(loop=loops).values
        pooled = group_pool(ds.task_accuracy, ds.task_count, ds.task_chance, ds.task_group, ds.task_trained)
        for gi, g in enumerate(groups):
            for suffix in ("", "_beyond"):
                p = pooled.sel(group=g)
                n = int(p[f"group_count{suffix}"])
                if n == 0:
                    continue
                out[f"n{suffix}"][vi, :, gi] = n
                out[f"chance{suffix}"][vi, :, gi] = float(p[f"group_chance{suffix}"])
                for li, loop in enumerate(loops):
                    # accuracy x count is a whole number of examples (rounded against float error)
                    hits = int(round(float(p[f"group_accuracy{suffix}"].sel(loop=loop)) * n))
                    out[f"accuracy{suffix}"][vi, li, gi] = hits / n
                    out[f"low{suffix}"][vi, li, gi], out[f"high{suffix}"][vi, li, gi] = wilson(hits, n)
    K = {int(per[v][1]["loops"]) for v in variants}
    data = {k: (("variant", "loop", "group"), a) for k, a in out.items()}
    data["loss"] = (("variant", "loop"), loss, {"long_name": "validation loss (nats/token)"})
    return xr.Dataset(data, coords={"variant": variants, "loop": loops, "group": groups},
                      attrs={"training_loops": ",".join(map(str, sorted(K))),
                             "interval": "95% Wilson score interval over examples",
                             "chance": "count-weighted majority-class rate of the same examples"})


def conditioning_rows(summary: xr.Dataset, loops: tuple[int, ...]) -> list[str]:
    """Return docs/findings.md's table rows for a conditioning summary: one per variant and loop count in `loops`.

    Columns: variant, r, knowledge, reasoning at the trained depths, reasoning past them (accuracy
    [Wilson 95%]), loss at r (nats/token).
    """
    rows = []
    for v in summary.variant.values:
        for r in loops:
            s = summary.sel(variant=v, loop=r)
            cells = [fmt(float(s[f"accuracy{x}"].sel(group=g)), float(s[f"low{x}"].sel(group=g)),
                         float(s[f"high{x}"].sel(group=g)))
                     for g, x in (("knowledge", ""), ("reasoning", ""), ("reasoning", "_beyond"))]
            rows.append(f"| {v} | {r} | " + " | ".join(cells) + f" | {float(s.loss):.3f} |")
    return rows


def truncation_summary(runs_dir: str | os.PathLike, n: int = 16, seq_len: int = 64, seed: int = 0) -> xr.Dataset:
    """Return per truncation training run (dim `run`): loss at its loop count and its paired difference to full BPTT, 95% intervals.

    Every done run of the truncation pipeline's `train` step is reopened and scored on `n` validation
    windows of `seq_len` tokens at its training loop count r. `vs_full` is the per-window difference to
    the run of the same width, FLOP budget and r trained with full BPTT (k = r), when both read the same
    windows (one seed and vocabulary share the tokenizer); NaN otherwise.
    """
    from ..io import read_run_config

    n = check_int("n", n, 2)
    rows = []
    for d in find_runs("truncation", "train", runs_dir):
        run, x, losses = _windows(d, n, seq_len, seed)
        tc = read_run_config(d).get("train") or {}
        r = run.model.cfg.loops
        with xr.open_dataset(RunDir(d).metrics, engine="h5netcdf") as m:  # a FLOP budget sets the steps at start
            steps = int(m.step.max())
        rows.append({"run": d.name, "d_model": run.model.cfg.d_model, "flops": float(tc.get("flops") or np.nan),
                     "loops": r, "backward_loops": int(tc.get("backward_loops") or r), "steps": steps,
                     "x": x, "losses": losses})
    if not rows:
        raise FileNotFoundError(f"no finished truncation/train runs under {runs_dir}")
    rows.sort(key=lambda q: (q["d_model"], q["flops"], q["loops"], -q["backward_loops"]))
    data: dict[str, list[float]] = {k: [] for k in ("loss", "loss_low", "loss_high", "vs_full", "vs_full_low",
                                                    "vs_full_high")}
    for q in rows:
        full = next((f for f in rows if (f["d_model"], f["flops"], f["loops"]) == (q["d_model"], q["flops"], q["loops"])
                     and f["backward_loops"] == f["loops"]), None)
        paired = full is not None and torch.equal(q["x"], full["x"])
        diff = (bootstrap_ci(np.subtract(q["losses"], full["losses"]), seed=seed) if paired else (float("nan"),) * 3)
        for k, v in zip(data, (*bootstrap_ci(q["losses"], seed=seed), *diff)):
            data[k].append(v)
    coords = {"run": [q["run"] for q in rows], **{k: ("run", [q[k] for q in rows])
                                                 for k in ("d_model", "flops", "loops", "backward_loops", "steps")}}
    return xr.Dataset({k: ("run", v) for k, v in data.items()}, coords=coords,
                      attrs={"sequences": n, "seq_len": seq_len, "seed": seed,
                             "interval": "95% percentile bootstrap over windows; vs_full paired per window"})


def truncation_rows(summary: xr.Dataset) -> list[str]:
    """Return docs/findings.md's table rows for a truncation summary: width, FLOPs, r, k, steps, loss, difference to full BPTT."""
    return [f"| {int(s.d_model)} | {float(s.flops):.0e} | {int(s.loops)} | {int(s.backward_loops)} | {int(s.steps)} | "
            f"{fmt(float(s.loss), float(s.loss_low), float(s.loss_high), 3)} | "
            f"{fmt(float(s.vs_full), float(s.vs_full_low), float(s.vs_full_high), 3)} |"
            for s in (summary.isel(run=i) for i in range(summary.sizes["run"]))]


def alloc_rows(fit: xr.Dataset, group: str | None = None) -> list[str]:
    """Return docs/findings.md's rows for the allocation a fitted law implies (a fit_laws results.nc's `alloc_*`).

    One row per size mode (fixed: the largest run's shape; free: size searched too) and budget: the
    best (N, r, k), its predicted loss, the best full-BPTT setting's, and whether full BPTT wins.
    """
    fit = fit.sel(group=group if group is not None else fit.group.values[0])
    rows = []
    for size in fit["size"].values:
        for b in fit.budget.values:
            a = fit.sel(size=size, budget=b)
            rows.append(f"| {size} | {float(b):.1e} | {float(a.alloc_n) / 1e6:.2f} M | {int(a.alloc_loops)} | "
                        f"{int(a.alloc_backward_loops)} | {float(a.alloc_loss):.3f} | "
                        f"{int(a.alloc_full_loops)} | {float(a.alloc_full_loss):.3f} | "
                        f"{'yes' if bool(a.alloc_full_bptt_wins) else 'no'} |")
    return rows


def lost_gradient_summary(runs_dir: str | os.PathLike) -> xr.Dataset:
    """Return per fine-tune (dim `finetune`: its backprop depth k, 0 = full) and loop count r: lost(ceil(r/2)) before and after, and the change, 95% intervals.

    Reads every done run of the lost_gradient pipeline's `lost_gradient` step (a fine-tune measured by
    `finetune_lost_gradient`). `before` is lost at SPEC's truncation point k = ceil(r/2) on the trained
    model, `after` on the fine-tuned one, `change` their difference paired per validation batch; `rho`
    likewise for the fitted backward shrink. Intervals are percentile bootstraps over the batches.
    """
    rows = {}
    for d in find_runs("lost_gradient", "lost_gradient", runs_dir):
        ds = load_results(d)
        if "lost_half" in ds and ds.sizes["step"] > 1:
            rows[int(ds.attrs["finetune_backward_loops"])] = ds
    if not rows:
        raise FileNotFoundError(f"no finished lost_gradient fine-tune runs under {runs_dir}")
    ks = sorted(rows)
    loops = sorted(set.intersection(*(set(ds.loops.values.tolist()) for ds in rows.values())))
    names = [f"{v}{s}" for v in ("before", "after", "change", "rho_before", "rho_after") for s in ("", "_low", "_high")]
    out = {n: np.full((len(ks), len(loops)), np.nan) for n in names}
    for i, k in enumerate(ks):
        ds = rows[k]
        for j, r in enumerate(loops):
            first, last = ds.isel(step=0).sel(loops=r), ds.isel(step=-1).sel(loops=r)
            for name, values in (("before", first.lost_half), ("after", last.lost_half),
                                 ("change", last.lost_half - first.lost_half), ("rho_before", first.rho),
                                 ("rho_after", last.rho)):
                out[name][i, j], out[f"{name}_low"][i, j], out[f"{name}_high"][i, j] = bootstrap_ci(values.values)
    any_ds = rows[ks[0]]
    return xr.Dataset({n: (("finetune", "loops"), a) for n, a in out.items()},
                      coords={"finetune": ks, "loops": loops},
                      attrs={"finetune_steps": int(any_ds.step.values[-1]), "finetune_lr": float(any_ds.attrs["finetune_lr"]),
                             "batches": any_ds.sizes["batch"], "interval": "95% percentile bootstrap over batches"})


def lost_gradient_rows(summary: xr.Dataset) -> list[str]:
    """Return docs/findings.md's rows for a lost-gradient summary: fine-tune depth, r, lost(ceil(r/2)) before, after, change, rho before and after."""
    rows = []
    for k in summary.finetune.values:
        for r in summary.loops.values:
            s = summary.sel(finetune=k, loops=r)
            q = {v: fmt(float(s[v]), float(s[f"{v}_low"]), float(s[f"{v}_high"]), 3)
                 for v in ("before", "after", "change", "rho_before", "rho_after")}
            rows.append(f"| {'full BPTT' if int(k) == 0 else f'k = {int(k)}'} | {int(r)} | {q['before']} | {q['after']} | "
                        f"{q['change']} | {q['rho_before']} | {q['rho_after']} |")
    return rows


# the paper's own examples of "full BPTT through fewer loops" against "truncated settings of the same compute"
# (issue 27): full r = 2 against r = 4, k = 1 and full r = 4 against r = 8, k = 4, as (full r, truncated r, k)
PRIMARY_PAIRS = ((2, 4, 1), (4, 8, 4))


def _window_losses(d: Path) -> dict:
    """Return a truncation run's setting (run.json params) and its held-out windows' losses at its training loop count."""
    from ..io import read_json

    p = read_json(RunDir(d).record, "run record").get("params") or {}
    ds = load_results(d)
    if "window_loss" not in ds:
        raise ValueError(f"{RunDir(d).results} has no window_loss (runs before issue 27 kept only the mean): "
                         "rerun the pipeline (`workbench run truncation --profile matched`) to pair per window")
    r = int(p.get("loops", 4))
    losses = ds.window_loss.sel(loop=r).values.astype(np.float64)
    steps, tokens = int(ds.sizes["step"]), float(ds.tokens)
    k = int(p.get("backward_loops") or 0) or r
    return {"run": d.name, "d_model": int(p.get("d_model", 128)), "flops": float(p.get("flops") or 0.0),
            "loops": r, "backward_loops": k, "seed": int(p.get("seed", 0)),
            "data_seed": int(p.get("data_seed", -1)), "steps": steps, "tokens": tokens, "losses": losses}


def truncation_pairs(runs_dir: str | os.PathLike, pipeline: str = "truncation",
                     primary: tuple[tuple[int, int, int], ...] = PRIMARY_PAIRS) -> xr.Dataset:
    """Return every full-BPTT run paired with each truncated run of equal compute and more loops (dim `pair`), over seeds.

    Within a (width, FLOP budget) cell every run spends the same training FLOPs. A pair is full BPTT at r
    (k = r) against a truncated run (k < r') with r' > r, the paper's comparison (seeds/003). Per seed both
    runs read the same held-out windows (one data seed, one seed for the windows), so `difference` is the mean over
    seeds of the per-seed mean of the per-window difference truncated - full, at each run's own training
    loop count: positive means full BPTT through fewer loops has the lower loss, the paper's direction.
    `low`/`high` is the 95% t interval over seeds; `p` its t test; each family (the `primary` pairs, the
    paper's own examples, and `all` pairs) is corrected on its own: `p_holm_*` (Holm) and
    `low_*`/`high_*` (level 1 - 0.05/m, Bonferroni), and `verdict_*` reads from the corrected interval.
    """
    runs = [_window_losses(d) for d in find_runs(pipeline, "train", runs_dir)]
    if not runs:
        raise FileNotFoundError(f"no finished {pipeline}/train runs under {runs_dir}")
    by = {(q["d_model"], q["flops"], q["loops"], q["backward_loops"], q["seed"]): q for q in runs}
    seeds = sorted({q["seed"] for q in runs})
    cells = sorted({(q["d_model"], q["flops"]) for q in runs})
    settings = sorted({(q["loops"], q["backward_loops"]) for q in runs})
    full = [r for r, k in settings if k == r]
    trunc = [(r, k) for r, k in settings if k < r]
    rows = []
    for d_model, flops in cells:
        for rf in full:
            for rt, kt in trunc:
                if rt <= rf:
                    continue
                per_seed = []
                for s in seeds:
                    a, b = by.get((d_model, flops, rt, kt, s)), by.get((d_model, flops, rf, rf, s))
                    if a is None or b is None:
                        continue
                    if a["losses"].shape != b["losses"].shape or a["data_seed"] != b["data_seed"]:
                        raise ValueError(f"runs {a['run']} and {b['run']} (seed {s}) did not read the same held-out "
                                         "windows (other window count or data seed): they cannot be paired")
                    per_seed.append(float((a["losses"] - b["losses"]).mean()))
                if len(per_seed) < 2:
                    continue
                rows.append({"d_model": d_model, "flops": flops, "full_loops": rf, "trunc_loops": rt,
                             "trunc_backward": kt, "primary": (rf, rt, kt) in primary,
                             "per_seed": per_seed + [np.nan] * (len(seeds) - len(per_seed)),
                             "ci": seed_interval(per_seed)})
    if not rows:
        raise ValueError(f"no full-BPTT run under {runs_dir} has a truncated run of more loops in its cell with "
                         "2 or more seeds: nothing to pair")
    data: dict[str, Any] = {k: [getattr(q["ci"], a) for q in rows]
                            for k, a in (("difference", "mean"), ("low", "low"), ("high", "high"), ("p", "p"), ("seeds", "n"))}
    for fam, members in (("all", [True] * len(rows)), ("primary", [q["primary"] for q in rows])):
        idx = [i for i, m in enumerate(members) if m]
        adj = holm([rows[i]["ci"].p for i in idx]) if idx else []
        for key in ("p_holm", "low", "high"):
            data[f"{key}_{fam}"] = [np.nan] * len(rows)
        data[f"verdict_{fam}"] = [""] * len(rows)
        for j, i in enumerate(idx):
            vals = [v for v in rows[i]["per_seed"] if np.isfinite(v)]
            c = simultaneous(vals, len(idx))
            data[f"p_holm_{fam}"][i] = float(adj[j])
            data[f"low_{fam}"][i], data[f"high_{fam}"][i] = c.low, c.high
            data[f"verdict_{fam}"][i] = verdict(c, +1)
    ds = xr.Dataset({k: ("pair", v) for k, v in data.items()},
                    coords={k: ("pair", [q[k] for q in rows])
                            for k in ("d_model", "flops", "full_loops", "trunc_loops", "trunc_backward", "primary")})
    ds["per_seed"] = (("pair", "seed"), np.array([q["per_seed"] for q in rows]))
    ds = ds.assign_coords(seed=seeds)
    loss = np.full((len(cells), len(settings), len(seeds)), np.nan)
    for q in runs:
        loss[cells.index((q["d_model"], q["flops"])), settings.index((q["loops"], q["backward_loops"])),
             seeds.index(q["seed"])] = q["losses"].mean()
    ds["run_loss"] = (("cell", "setting", "seed"), loss,
                      {"long_name": "mean held-out window loss at the run's training loop count (nats/token)"})
    ds = ds.assign_coords(cell=[f"d{d} {f:.0e}" for d, f in cells], setting=[f"r{r} k{k}" for r, k in settings])
    ds.attrs = {"interval": "95% Student t over per-seed means of per-window paired differences (truncated - full)",
                "families": "primary: the paper's example pairs " + ", ".join(f"full r={a} vs r={b} k={c}"
                                                                         for a, b, c in primary)
                            + " in every cell; all: every pair",
                "comparisons_primary": int(sum(q["primary"] for q in rows)), "comparisons_all": len(rows),
                "correction": "Holm p-values; Bonferroni intervals at 1 - 0.05/m within each family"}
    return ds


def truncation_pair_rows(pairs: xr.Dataset, family: str = "all") -> list[str]:
    """Return docs/findings.md's rows for truncation pairs: cell, full r, truncated (r, k), difference, 95% and corrected intervals, verdict."""
    if family not in ("all", "primary"):
        raise ValueError(f"family={family!r} is invalid: must be all or primary")
    out = []
    for i in range(pairs.sizes["pair"]):
        s = pairs.isel(pair=i)
        if family == "primary" and not bool(s.primary):
            continue
        out.append(f"| {int(s.d_model)} | {float(s.flops):.0e} | {int(s.full_loops)} | {int(s.trunc_loops)}, "
                   f"{int(s.trunc_backward)} | {fmt(float(s.difference), float(s.low), float(s.high), 3)} | "
                   f"[{float(s[f'low_{family}']):.3f}, {float(s[f'high_{family}']):.3f}] | "
                   f"{float(s[f'p_holm_{family}']):.3f} | {str(s[f'verdict_{family}'].values)} |")
    return out


def phi_ladder(runs_dir: str | os.PathLike, pipeline: str = "phi_ladder") -> xr.Dataset:
    """Return phi per looped model read off each seed's non-looped depth ladder (dims `cell`, `loops`, `seed`), with t intervals over seeds.

    In each (width, steps) cell and seed, the non-looped runs (loops 1) give the loss at their training
    loop count against unique parameters N = N_once + N_rec; a line in log N fitted to them (`slope`,
    nats per e-fold of N; negative when more unique layers help) turns a looped model's loss into its
    equivalent size N_eq, and phi = log((N_eq - N_once) / N_rec) / log r (seeds/000's law term
    N_once + r^phi N_rec). phi is NaN where N_eq <= N_once (the looped model is worse than its own
    unique layers alone). `identified` is True where the slope's 95% t interval over seeds lies below
    zero: otherwise the ladder shows no capacity effect and phi is not identifiable in that cell.
    `phi_low`/`phi_high` are 95% t intervals over the seeds' phi values.
    """
    from ..io import read_json

    runs = []
    for d in find_runs(pipeline, "train", runs_dir):
        p = read_json(RunDir(d).record, "run record").get("params") or {}
        ds = load_results(d)
        runs.append({"d_model": int(p.get("d_model", 128)), "steps": int(p.get("steps", 300)),
                     "seed": int(p.get("seed", 0)), "loops": int(p.get("loops", 4)),
                     "core": int(p.get("core", 2)), "loss": float(ds.final_loss),
                     "n_once": float(ds.n_once), "n_rec": float(ds.n_rec)})
    if not runs:
        raise FileNotFoundError(f"no finished {pipeline}/train runs under {runs_dir}")
    cells = sorted({(q["d_model"], q["steps"]) for q in runs})
    seeds = sorted({q["seed"] for q in runs})
    looped = sorted({q["loops"] for q in runs if q["loops"] > 1})
    phi = np.full((len(cells), len(looped), len(seeds)), np.nan)
    n_eq = np.full_like(phi, np.nan)
    slope = np.full((len(cells), len(seeds)), np.nan)
    for ci, (d_model, steps) in enumerate(cells):
        for si, s in enumerate(seeds):
            mine = [q for q in runs if (q["d_model"], q["steps"], q["seed"]) == (d_model, steps, s)]
            ladder = sorted((q for q in mine if q["loops"] == 1), key=lambda q: q["core"])
            if len(ladder) < 2:
                continue
            logn = np.log([q["n_once"] + q["n_rec"] for q in ladder])
            b, a = np.polyfit(logn, [q["loss"] for q in ladder], 1)
            slope[ci, si] = b
            for q in mine:
                if q["loops"] > 1 and b < 0:
                    li = looped.index(q["loops"])
                    n_eq[ci, li, si] = np.exp((q["loss"] - a) / b)
                    ratio = (n_eq[ci, li, si] - q["n_once"]) / q["n_rec"]
                    phi[ci, li, si] = np.log(ratio) / np.log(q["loops"]) if ratio > 0 else np.nan
    out = xr.Dataset({"phi": (("cell", "loops", "seed"), phi), "n_eq": (("cell", "loops", "seed"), n_eq),
                      "slope": (("cell", "seed"), slope)},
                     coords={"cell": [f"d{d} {s} steps" for d, s in cells], "loops": looped, "seed": seeds,
                             "d_model": ("cell", [d for d, _ in cells]), "steps": ("cell", [s for _, s in cells])})
    for name, arr, dims in (("slope", slope, ("cell",)), ("phi", phi, ("cell", "loops"))):
        stats = np.full(arr.shape[:-1] + (3,), np.nan)
        for idx in np.ndindex(*arr.shape[:-1]):
            v = arr[idx][np.isfinite(arr[idx])]
            if v.size >= 2:
                c = seed_interval(v)
                stats[idx] = (c.mean, c.low, c.high)
        for j, suffix in enumerate(("mean", "low", "high")):
            out[f"{name}_{suffix}"] = (dims, stats[..., j])
    out["identified"] = ("cell", out.slope_high.values < 0)
    # one family, fixed by the design before its runs: phi < 1 (a loop worth less than a distinct block, the
    # paper's direction) at every looped r of every cell, Holm over all of them; a cell whose ladder shows no
    # capacity effect, or an r with under 3 finite seeds, stays in the family as p = 1 (no verdict there)
    from ..stats import correct_family
    rows = []
    for ci in range(len(cells)):
        for li in range(len(looped)):
            v = phi[ci, li][np.isfinite(phi[ci, li])]
            if out.identified.values[ci] and v.size >= 3:
                rows.append({"at": (ci, li), "values": 1 - v, "ci": seed_interval(1 - v), "sign": 1})
    correct_family(rows, len(cells) * len(looped))
    p_holm = np.full((len(cells), len(looped)), 1.0)
    verdicts = np.full((len(cells), len(looped)), "not identified", dtype=object)
    # phi is undefined (NaN) in a seed whose looped model scores below its own unique layers alone
    # (N_eq <= N_once, phi -> -inf): with under 3 finite seeds there is no t interval, so no verdict
    verdicts[out.identified.values[:, None] & (np.isfinite(phi).sum(-1) < 3)] = "no verdict: φ undefined in a seed"
    for r in rows:
        p_holm[r["at"]], verdicts[r["at"]] = r["p_holm"], r["verdict"]
    out["p_holm"] = (("cell", "loops"), p_holm, {"long_name": "Holm-adjusted p of phi < 1 over every (cell, r)"})
    out["verdict"] = (("cell", "loops"), verdicts.astype(str))
    out.attrs = {"interval": "95% Student t over seeds (phi per seed from that seed's ladder)",
                 "ladder_fit": "loss = a + slope * ln(N_once + N_rec) over the non-looped runs of a cell and seed",
                 "comparisons": len(cells) * len(looped),
                 "family": "phi < 1 at each looped r of each cell (1 - phi > 0 over seeds), Holm over all of them"}
    return out


def phi_ladder_rows(summary: xr.Dataset) -> list[str]:
    """Return docs/findings.md's rows for a phi_ladder summary: cell, ladder slope, and phi per loop count with the
    verdict on phi < 1 after Holm over the summary's family (or why none)."""
    out = []
    for c in summary.cell.values:
        s = summary.sel(cell=c)
        slope = fmt(float(s.slope_mean), float(s.slope_low), float(s.slope_high), 3)
        if bool(s.identified):
            phis = "; ".join(f"r = {int(r)}: {fmt(float(s.phi_mean.sel(loops=r)), float(s.phi_low.sel(loops=r)), float(s.phi_high.sel(loops=r)))}"
                             + (f", φ < 1 {s.verdict.sel(loops=r).item()}" if "verdict" in s else "")
                             for r in s.loops.values)
        else:
            phis = "not identifiable: the ladder's slope interval holds 0 (no capacity effect in this cell)"
        out.append(f"| {c} | {slope} | {phis} |")
    return out
