"""loop_count_claims on planted runs: the change of lost(k) from 32 to 64 loops, paired per batch, read against a margin."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr

from workbench.experiments.lost_gradient_findings import loop_count_claims, loop_count_rows, loop_count_table
from workbench.io import RunDir, save_netcdf
from workbench.stats import SeedInterval, equivalence_verdict

LOOPS = [4, 8, 16, 32, 64]
# lost(k) at 64 minus at 32 planted per k: inside the 0.03 margin, far outside it, and straddling it
CHANGE = {1: 0.005, 2: 0.12, 4: 0.03}


def write_run(root, step: str, key: str, params: dict, ds: xr.Dataset | None = None) -> None:
    """Write a done pipeline run folder (run.json, and results.nc when given) as the runner leaves one."""
    rd = RunDir(root / "lost_gradient" / step / key)
    rd.path.mkdir(parents=True)
    rd.record.write_text(json.dumps({"status": "done", "finished": key, "params": params}))
    if ds is not None:
        save_netcdf(ds, rd.results)


def plant(root, seeds=(0, 1, 2), data_seeds=(0, 0, 0), noise=0.004):
    rng = np.random.default_rng(3)
    batches, R = 4, max(LOOPS)
    for s, ds_ in zip(seeds, data_seeds):
        write_run(root, "train", f"t{s}", {"seed": s, "data_seed": ds_})
        hard = rng.normal(0, 0.05, batches)  # each batch's own level, shared across r: only pairing cancels it
        lost = np.full((1, len(LOOPS), batches, R), np.nan)
        for j, r in enumerate(LOOPS):
            for k in range(1, r + 1):
                change = CHANGE.get(k, 0.0) * (r == 64)
                lost[0, j, :, k - 1] = 0.9 - 0.01 * k + hard + change + rng.normal(0, noise, batches)
        rho = np.full((1, len(LOOPS), batches), 1.1 + 0.01 * s)
        write_run(root, "lost_gradient", f"l{s}", {"checkpoint": f"/elsewhere/train/t{s}", "finetune_steps": 0},
                  xr.Dataset({"lost": (("step", "loops", "batch", "k"), lost),
                              "rho": (("step", "loops", "batch"), rho)},
                             coords={"step": [0], "loops": LOOPS, "batch": np.arange(batches),
                                     "k": np.arange(1, R + 1)}))
    # a fine-tune's run of seed 0 answers another claim and must be left out
    write_run(root, "lost_gradient", "zfine", {"checkpoint": "/elsewhere/train/t0", "finetune_steps": 10},
              xr.Dataset({"lost": (("step", "loops", "batch", "k"), np.zeros((1, len(LOOPS), 4, R))),
                          "rho": (("step", "loops", "batch"), np.zeros((1, len(LOOPS), 4)))},
                         coords={"step": [0], "loops": LOOPS, "batch": np.arange(4), "k": np.arange(1, R + 1)}))


def test_the_change_from_32_to_64_loops_reads_the_planted_change_per_k_against_the_margin(tmp_path):
    plant(tmp_path)
    c = loop_count_claims(tmp_path)
    assert list(c.comparison.values) == [1, 2, 4] and c.sizes["seed"] == 3 and c.attrs["comparisons"] == 3
    for k, change in CHANGE.items():
        assert float(c.difference.sel(comparison=k)) == pytest.approx(change, abs=0.006), k
    assert [str(v) for v in c.verdict.values] == ["replicates", "opposite", "inconclusive"]
    assert float(c.low_corrected.sel(comparison=1)) < float(c.low.sel(comparison=1))  # Bonferroni is wider
    assert np.allclose(c.rho.sel(loops=32).values, [1.1, 1.11, 1.12])
    rows = loop_count_rows(c)
    assert len(rows) == 3 and rows[0].startswith("| 1 | ") and rows[1].endswith("| opposite |")
    table = loop_count_table(c)
    assert len(table) == len(LOOPS) and table[-1].startswith("| 64 | ") and table[0].count("[") == 4


def test_runs_that_read_other_validation_batches_are_refused(tmp_path):
    plant(tmp_path, data_seeds=(0, 0, 1))
    with pytest.raises(ValueError, match="data seeds"):
        loop_count_claims(tmp_path)


def test_the_equivalence_verdict_needs_the_interval_inside_the_margin_and_three_seeds():
    def iv(low, high, n=3):
        return SeedInterval((low + high) / 2, low, high, 0.5, n, 0.95)

    assert equivalence_verdict(iv(-0.02, 0.02), 0.03) == "replicates"
    assert equivalence_verdict(iv(0.01, 0.05), 0.03) == "inconclusive"
    assert equivalence_verdict(iv(0.04, 0.09), 0.03) == "opposite"
    assert equivalence_verdict(iv(-0.01, 0.01, n=2), 0.03) == "inconclusive"
    with pytest.raises(ValueError, match="margin"):
        equivalence_verdict(iv(-0.01, 0.01), 0)
