"""allocation_claims on planted runs: every question reads the effect planted in it, in the paper's direction or not."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr

from workbench.experiments.allocation_findings import (allocation_claim_rows, allocation_claims, arm_name,
                                                       horizon_claim_rows, horizon_claims, terminal_to_core_claims,
                                                       terminal_to_core_rows)
from workbench.io import RunDir, save_netcdf

LOOPS = [1, 2, 3, 4, 6, 8, 9, 12, 18]
ARMS = [dict(prelude=1, core=2, loops=6, coda=1), dict(prelude=1, core=3, loops=4, coda=1),
        dict(prelude=1, core=4, loops=3, coda=1), dict(prelude=1, core=6, loops=2, coda=1),
        dict(prelude=1, core=12, loops=1, coda=1), dict(prelude=0, core=2, loops=4, coda=2),
        dict(prelude=1, core=2, loops=4, coda=1), dict(prelude=2, core=2, loops=4, coda=0),
        dict(prelude=2, core=2, loops=4, coda=2)]


def planted_effect(arm: str, K: int, r: int) -> float:
    """Return the loss a planted arm adds at loop count r over its own loss at K (0 where nothing is planted)."""
    if r < K:  # under-unrolling: the prelude-only model decays 0.3 per missing loop share, the others 0.1
        return (K - r) / K * (0.3 if arm == "2+2x4+0" else 0.1)
    if arm == "1+2x6+1":  # the fewest-layer split drifts past K; 6x2 and the others stay flat
        return 0.2 * (r - K) / (2 * K)
    if arm == "0+2x4+2":  # planted against the paper: the coda-heavy model extrapolates better
        return -0.1 if r > K else 0.0
    return 0.0


def planted_ratio(arm: str) -> float:
    """Return the terminal-to-core ratio planted for an arm: 0.65 without a coda, 0.5 with one, and with a coda at
    depth 14 rising as the loop count falls (0.8 for the non-looped model; 2x6 planted equal to 2+2x4+0 less 0.15)."""
    if arm.endswith("+0"):
        return 0.65
    return {"1+12x1+1": 0.8, "1+6x2+1": 0.7, "2+2x4+2": 0.65}.get(arm, 0.5)


def write_run(root, step: str, key: str, params: dict, ds: xr.Dataset) -> None:
    """Write a done pipeline run folder (run.json and results.nc) as the runner leaves one."""
    rd = RunDir(root / "allocation" / step / key)
    rd.path.mkdir(parents=True)
    rd.record.write_text(json.dumps({"status": "done", "finished": key, "params": params}))
    save_netcdf(ds, rd.results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    rng = np.random.default_rng(0)
    windows = 16
    for s in range(3):
        difficulty = 4.0 + rng.normal(0, 0.5, windows)  # shared by every arm of a seed: pairing cancels it
        for i, a in enumerate(ARMS):
            name, K = arm_name(a), a["loops"]
            seed_shift = rng.normal(0, 0.02)  # seed-to-seed variation of each model
            level = 0.3 if name == "1+3x4+1" else 0.0  # ... and 1+3x4+1 unrolled to 2K beats the non-looped one
            loss = np.array([difficulty + seed_shift + planted_effect(name, K, r)
                             - (level if r == 2 * K else 0.0) + rng.normal(0, 0.01, windows) for r in LOOPS])
            key = f"s{s}a{i}"
            params = {**a, "seed": s, "data_seed": 0}
            write_run(root, "train", key, params,
                      xr.Dataset({"window_loss": (("loop", "window"), loss)}, coords={"loop": LOOPS}))
            t = np.arange(1, 19)
            geo = xr.Dataset({"angular_distance": ("loop", 0.5 / t), "relative_update": ("loop", 1.0 / t),
                              "state_variance": ("loop", t / K * (1 + rng.normal(0, 0.01))),
                              "terminal_to_core": planted_ratio(name) + rng.normal(0, 0.01)}, coords={"loop": t})
            write_run(root, "geometry", f"g{key}", {"checkpoint": str(root / "allocation" / "train" / key)}, geo)
    return root


@pytest.fixture(scope="module")
def claims(runs):
    return allocation_claims(runs)


def test_each_question_reads_its_planted_effect(claims):
    c = claims
    row = {(str(q), str(a), str(b), str(v)): i for i, (q, a, b, v) in
           enumerate(zip(c.question.values, c.a.values, c.b.values, c.quantity.values))}

    def get(*key):
        return c.isel(comparison=row[key])

    balance = get("balance", "1+2x6+1", "1+6x2+1", "drift")
    assert float(balance.difference) == pytest.approx(0.2, abs=0.03) and balance.verdict.item() == "replicates"
    coda = get("coda", "2+2x4+0", "0+2x4+2", "under")  # 0.3 vs 0.1 per missing share, averaged over r = 1, 2, 3
    assert float(coda.difference) == pytest.approx(0.2 * np.mean([3 / 4, 2 / 4, 1 / 4]), abs=0.02)
    assert coda.verdict.item() == "replicates" and int(coda.family_size) == 2
    same = get("coda", "1+2x4+1", "0+2x4+2", "under")  # nothing planted between these two
    assert same.verdict.item() == "inconclusive" and float(same.low) < 0 < float(same.high)
    assert get("prelude", "0+2x4+2", "2+2x4+0", "extrapolation").verdict.item() == "opposite"
    beyond = {str(a): c.isel(comparison=i) for i, (q, a) in enumerate(zip(c.question.values, c.a.values))
              if q == "beyond"}
    assert set(beyond) == {"1+2x6+1", "1+3x4+1", "1+4x3+1", "1+6x2+1"}  # the matched-depth looped splits
    assert beyond["1+3x4+1"].verdict.item() == "replicates" and float(beyond["1+3x4+1"].difference) < 0
    assert beyond["1+6x2+1"].verdict.item() == "inconclusive"
    # geometry: angle and update fall 0.5/t and 1/t from K to 3K, variance grows as t/K: replicates for each model
    geo = c.where(c.question == "geometry", drop=True)
    assert geo.sizes["comparison"] == 8 * 3 and set(geo.verdict.values) == {"replicates"}
    angle = get("geometry", "1+3x4+1", "", "angular_distance")
    assert float(angle.difference) == pytest.approx(0.5 / 12 - 0.5 / 4, rel=1e-6)
    assert float(get("geometry", "1+3x4+1", "", "state_variance").difference) == pytest.approx(2.0, rel=0.05)
    # Holm within each question, the corrected interval wider than the plain one
    assert (c.low_corrected <= c.low).all() and (c.p_holm >= c.p - 1e-12).all()
    assert c.attrs["comparisons"] == c.sizes["comparison"] == 1 + 2 + 1 + 4 + 24


def test_curves_peaks_and_rows(claims):
    c = claims
    assert c.loss.sizes == {"arm": 9, "loop": len(LOOPS), "seed": 3}
    assert int(c.peak_loop.sel(arm="1+3x4+1")) == 8  # its planted dip at 2K
    assert int(c.peak_loop.sel(arm="0+2x4+2")) > 4  # better past K, as planted
    rows = allocation_claim_rows(c)
    assert len(rows) == c.sizes["comparison"] and all(r.count("|") == 8 for r in rows)


def test_runs_that_read_other_windows_are_not_paired(runs, tmp_path):
    import shutil

    root = tmp_path / "r"
    shutil.copytree(runs, root)
    rd = RunDir(root / "allocation" / "train" / "s0a7")
    rec = json.loads(rd.record.read_text())
    rec["params"]["data_seed"] = 5
    rd.record.write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="same held-out windows"):
        allocation_claims(root)


def test_the_terminal_to_core_ratio_reads_the_coda_and_the_loop_planted_in_it(runs):
    t = terminal_to_core_claims(runs)
    assert t.ratio.sizes == {"arm": 9, "seed": 3}
    assert float(t.ratio_mean.sel(arm="2+2x4+0")) == pytest.approx(0.65, abs=0.02)
    assert (t.ratio_low <= t.ratio_mean).all() and (t.ratio_mean <= t.ratio_high).all()
    row = {(str(q), str(a)): t.isel(comparison=i) for i, (q, a) in enumerate(zip(t.question.values, t.a.values))}
    assert set(row) == {("coda", "2+2x4+2"), ("coda", "1+2x4+1"), ("coda", "0+2x4+2"), ("loop", "1+2x6+1"),
                        ("loop", "1+3x4+1"), ("loop", "1+4x3+1"), ("loop", "1+6x2+1")}
    moved = row["coda", "0+2x4+2"]  # 0.5 against 0.65: the paper's direction, corrected over the 3 coda rows
    assert float(moved.difference) == pytest.approx(-0.15, abs=0.02) and moved.verdict.item() == "replicates"
    assert int(moved.family_size) == 3 and float(moved.p_holm) >= float(moved.p)
    same = row["coda", "2+2x4+2"]  # planted equal to the coda-free model: no effect to find
    assert same.verdict.item() == "inconclusive" and float(same.low) < 0 < float(same.high)
    loop = row["loop", "1+2x6+1"]  # 0.5 against the non-looped 0.8: no paper direction, so no verdict
    assert loop.verdict.item() == "no direction" and float(loop.difference) == pytest.approx(-0.3, abs=0.02)
    assert t.attrs["comparisons"] == 3
    rows = terminal_to_core_rows(t)
    assert len(rows) == 9 + 7 and rows[-1].endswith("| no direction |") and "(m = 3)" in rows[9]


# the loss at K planted per arm: sharing costs 0.05 per halving of the distinct core layers (2x6 the most, 12x1
# nothing), and of the 2x4-core placements only the coda-only model differs (0.1 below the others)
HORIZON_LEVEL = {"1+2x6+1": 0.15, "1+3x4+1": 0.10, "1+4x3+1": 0.05, "1+6x2+1": 0.0, "1+12x1+1": -0.05,
                 "0+2x4+2": -0.1}


def test_the_horizon_comparisons_read_the_loss_at_k_planted_in_each_arm_paired_per_window(tmp_path):
    rng = np.random.default_rng(1)
    windows = 16
    for s in range(3):
        difficulty = 4.0 + rng.normal(0, 0.5, windows)  # shared by the arms of a seed: only pairing cancels it
        for i, a in enumerate(ARMS):
            name = arm_name(a)
            level = HORIZON_LEVEL.get(name, 0.0) + rng.normal(0, 0.005)  # seed-to-seed variation of each model
            loss = np.array([difficulty + level + 0.01 * abs(r - a["loops"]) + rng.normal(0, 0.01, windows)
                             for r in LOOPS])
            write_run(tmp_path, "train", f"s{s}a{i}", {**a, "seed": s, "data_seed": 0},
                      xr.Dataset({"window_loss": (("loop", "window"), loss)}, coords={"loop": LOOPS}))
    h = horizon_claims(tmp_path)
    row = {(str(q), str(a), str(b)): h.isel(comparison=i)
           for i, (q, a, b) in enumerate(zip(h.question.values, h.a.values, h.b.values))}
    for a, cost in (("1+2x6+1", 0.2), ("1+3x4+1", 0.15), ("1+4x3+1", 0.1), ("1+6x2+1", 0.05)):
        r = row["sharing", a, "1+12x1+1"]
        assert float(r.difference) == pytest.approx(cost, abs=0.02) and r.verdict.item() == "replicates", a
        assert int(r.family_size) == 4 and float(r.low_corrected) <= float(r.low) and float(r.p_holm) >= float(r.p)
    coda = row["placement", "0+2x4+2", "2+2x4+0"]  # no paper direction: the difference, and no verdict
    assert float(coda.difference) == pytest.approx(-0.1, abs=0.02) and coda.verdict.item() == "no direction"
    same = row["placement", "1+2x4+1", "2+2x4+0"]  # nothing planted between these
    assert float(same.low) < 0 < float(same.high)
    assert h.attrs["comparisons"] == 4 and h.sizes["comparison"] == 7 and h.sizes["seed"] == 3
    rows = horizon_claim_rows(h)
    assert len(rows) == 7 and rows[0].count("|") == 7 and "(m = 4), Holm p" in rows[0]
    assert rows[-1].endswith("| - | no direction |")
