"""Seeds as the unit of replication (issue 27): the seed-level t interval covers as it says, Holm as defined,
truncation pairs scored per held-out window and summarised over seeds."""

import json

import numpy as np
import pytest
import torch
import xarray as xr
from scipy import stats as sps

from workbench.stats import holm, paired_seed_interval, seed_interval, simultaneous, verdict


def test_a_95_percent_seed_interval_covers_a_planted_effect_about_95_times_in_100():
    # 200 simulated experiments: 3 seeds, each a mean over 32 windows of (effect + seed offset + window noise);
    # the seed offset is what a window-level interval leaves out
    rng = np.random.default_rng(7)
    effect, hits, window_hits = 0.05, 0, 0
    for _ in range(200):
        seed_off = rng.normal(0, 0.05, 3)
        windows = effect + seed_off[:, None] + rng.normal(0, 0.2, (3, 32))
        ci = seed_interval(windows.mean(1))
        hits += ci.low <= effect <= ci.high
        pooled = windows.ravel()  # the old way: an interval over one pool of windows, seeds ignored
        half = 1.96 * pooled.std(ddof=1) / np.sqrt(pooled.size)
        window_hits += pooled.mean() - half <= effect <= pooled.mean() + half
    assert 0.90 <= hits / 200 <= 0.99, hits
    assert window_hits / 200 < 0.85, window_hits  # why seeds: the window interval misses the seed spread


def test_seed_interval_is_the_student_t_interval_and_test():
    v = [0.12, 0.07, 0.15]
    ci = seed_interval(v)
    ref = sps.ttest_1samp(v, 0.0)
    lo, hi = ref.confidence_interval(0.95)
    assert (ci.mean, ci.low, ci.high, ci.p, ci.n) == pytest.approx((np.mean(v), lo, hi, ref.pvalue, 3))
    wide = simultaneous(v, 4)  # four comparisons: each at 98.75%
    assert wide.low == pytest.approx(ref.confidence_interval(1 - 0.05 / 4).low)
    assert wide.low < ci.low and wide.high > ci.high
    same = seed_interval([0.0, 0.0, 0.0])  # a run compared with itself
    assert (same.low, same.high, same.p) == (0.0, 0.0, 1.0)


def test_paired_seed_interval_averages_windows_within_each_seed():
    rng = np.random.default_rng(0)
    a = rng.normal(3.0, 0.3, (3, 16))
    b = a - np.array([[0.10], [0.05], [0.08]]) + rng.normal(0, 0.01, (3, 16))
    ci = paired_seed_interval(a, b)
    assert ci.mean == pytest.approx(np.mean([(a[i] - b[i]).mean() for i in range(3)]))
    assert ci.n == 3 and ci.low > 0
    with pytest.raises(ValueError, match="a, b"):
        paired_seed_interval(a, b[:, :8])
    with pytest.raises(ValueError, match="at least 2"):
        seed_interval([0.1])
    with pytest.raises(ValueError, match="finite"):
        seed_interval([0.1, float("nan"), 0.2])


def holm_by_hand(p):
    """Holm's step-down procedure written out: sort, multiply the i-th smallest by (m - i), keep monotone."""
    m, order = len(p), sorted(range(len(p)), key=lambda i: p[i])
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def test_holm_matches_the_procedure_written_out():
    rng = np.random.default_rng(1)
    for m in (1, 2, 5, 20):
        p = list(rng.uniform(0, 0.2, m))
        assert holm(p) == pytest.approx(holm_by_hand(p))
    assert list(holm([0.01, 0.04, 0.03])) == pytest.approx([0.03, 0.06, 0.06])
    with pytest.raises(ValueError, match="pvalues"):
        holm([0.1, 1.5])


def test_verdict_needs_three_seeds_and_the_papers_direction():
    assert verdict(seed_interval([0.1, 0.12, 0.11]), +1) == "replicates"
    assert verdict(seed_interval([0.1, 0.12, 0.11]), -1) == "opposite"
    assert verdict(seed_interval([0.1, -0.12, 0.11]), +1) == "inconclusive"
    assert verdict(seed_interval([0.1, 0.12]), +1) == "inconclusive"  # two seeds: below the standard
    with pytest.raises(ValueError, match="direction"):
        verdict(seed_interval([0.1, 0.12, 0.11]), 0)


def plant_run(root, key, params, window_loss):
    """Write a finished truncation/train run folder holding only what truncation_pairs reads."""
    d = root / "truncation" / "train" / key
    d.mkdir(parents=True)
    r = params["loops"]
    wl = np.stack([np.asarray(window_loss) + 0.5 * (lp != r) for lp in (1, 2, 4, 8)])  # other loops: worse
    xr.Dataset({"window_loss": (("loop", "window"), wl), "tokens": ((), 1000.0), "train_loss": ("step", [1.0] * 5)},
               coords={"loop": [1, 2, 4, 8], "step": np.arange(1, 6)}).to_netcdf(d / "results.nc", engine="h5netcdf")
    (d / "run.json").write_text(json.dumps({"status": "done", "finished": key, "params": params}))


def test_truncation_pairs_pair_full_bptt_with_truncated_runs_of_more_loops_per_window(tmp_path):
    from workbench.experiments.findings import truncation_pair_rows, truncation_pairs

    rng = np.random.default_rng(3)
    gaps = {(4, 1): [0.10, 0.06, 0.08], (4, 2): [0.01, -0.02, 0.02], (8, 4): [0.20, 0.18, 0.22]}
    planted = {}
    for s in range(3):
        base = rng.normal(3.0, 0.2, 12)  # the seed's 12 windows, shared by all its runs
        for r, k in [(2, 2), (4, 4), (4, 1), (4, 2), (8, 4)]:
            noise = rng.normal(0, 0.01, 12)
            wl = base + noise + (gaps[(r, k)][s] if k < r else 0.0)
            planted[(r, k, s)] = wl
            plant_run(tmp_path, f"{s}{r}{k}", {"d_model": 64, "flops": 1e12, "loops": r,
                                                "backward_loops": k, "seed": s, "data_seed": 0}, wl)
    pairs = truncation_pairs(tmp_path)
    got = {(int(p.full_loops), int(p.trunc_loops), int(p.trunc_backward)): p for p in
           (pairs.isel(pair=i) for i in range(pairs.sizes["pair"]))}
    # full r = 2 against every truncated run (all have r' = 4 or 8 > 2); full r = 4 only against r' = 8
    assert sorted(got) == [(2, 4, 1), (2, 4, 2), (2, 8, 4), (4, 8, 4)]
    per_seed = [float((planted[(4, 1, s)] - planted[(2, 2, s)]).mean()) for s in range(3)]
    ref = sps.ttest_1samp(per_seed, 0.0)
    p = got[(2, 4, 1)]
    assert float(p.difference) == pytest.approx(np.mean(per_seed))
    assert (float(p.low), float(p.high)) == pytest.approx(tuple(ref.confidence_interval(0.95)))
    assert list(p.per_seed.values) == pytest.approx(per_seed)
    assert pairs.attrs["comparisons_all"] == 4 and pairs.attrs["comparisons_primary"] == 2
    # Holm within each family, Bonferroni-wide intervals beside it
    assert float(got[(4, 8, 4)].p_holm_primary) == pytest.approx(holm([float(got[(2, 4, 1)].p),
                                                                        float(got[(4, 8, 4)].p)])[1])
    assert float(got[(2, 4, 2)].low_all) < float(got[(2, 4, 2)].low)
    assert np.isnan(float(got[(2, 4, 2)].low_primary))  # not a primary pair
    assert str(got[(4, 8, 4)].verdict_primary.values) == "replicates"  # 0.20 +- 0.02 over 3 seeds
    assert str(got[(2, 4, 2)].verdict_all.values) == "inconclusive"
    assert len(truncation_pair_rows(pairs)) == 4 and len(truncation_pair_rows(pairs, "primary")) == 2
    assert pairs.run_loss.sel(cell="d64 1e+12", setting="r2 k2", seed=1) == pytest.approx(planted[(2, 2, 1)].mean())


def test_truncation_pairs_refuse_runs_that_did_not_read_the_same_windows(tmp_path):
    from workbench.experiments.findings import truncation_pairs

    for s in range(2):
        plant_run(tmp_path, f"f{s}", {"d_model": 64, "flops": 1e12, "loops": 2, "backward_loops": 2, "seed": s,
                                      "data_seed": 0}, np.ones(8))
        plant_run(tmp_path, f"t{s}", {"d_model": 64, "flops": 1e12, "loops": 4, "backward_loops": 1, "seed": s,
                                      "data_seed": 0 if s == 0 else 1}, np.ones(8))
    with pytest.raises(ValueError, match="same held-out"):
        truncation_pairs(tmp_path)


def test_sweep_keeps_each_sequences_loss_as_the_model_gives_it_alone():
    from workbench.evals import loop_sweep
    from workbench.config import LoopConfig
    from workbench.models import LoopLM

    torch.manual_seed(0)
    m = LoopLM(LoopConfig(vocab_size=64, d_model=16, n_heads=2, n_kv_heads=1, core=1, loops=2), seed=0)
    data = torch.randint(0, 64, (5, 9))
    ds = loop_sweep(m, data, [1, 3], per_sequence=True, batch_size=2, progress=False)
    with torch.no_grad():
        for r in (1, 3):
            alone = [float(m(data[i:i + 1, :-1], loops=r, targets=data[i:i + 1, 1:]).loss) for i in range(5)]
            assert ds.sequence_loss.sel(loop=r).values == pytest.approx(alone, abs=1e-5)
    assert ds.sequence_loss.mean("sequence").values == pytest.approx(ds.loss.values, abs=1e-6)
    assert "sequence_loss" not in loop_sweep(m, data, [1], progress=False)


def test_runs_of_one_data_seed_share_a_tokenizer_and_differ_in_weights(tmp_path):
    from workbench.experiments.runs import load_run, train_notebook_args, train_run

    (tmp_path / "text").mkdir()  # a small corpus: the tokenizer trains in a moment
    (tmp_path / "text" / "a.py").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(600)))
    results = []
    for seed in (0, 1):
        args = train_notebook_args(corpus=f"path:{tmp_path / 'text'}", d_model=16, n_heads=2, n_kv_heads=1, core=1,
                                   loops=2, vocab_size=300, seq_len=16, batch_size=2, steps=2, eval_loops=[1, 2],
                                   seed=seed, data_seed=5, tasks=["iterated"], task_ratio=0.3)
        results.append(train_run(tmp_path / str(seed), resume=False, **args))
    (run0, ds0), (run1, ds1) = results
    assert ds0.attrs["tokenizer"] == ds1.attrs["tokenizer"]  # one unit: losses of the two seeds compare
    assert not torch.equal(run0.model.embed.weight, run1.model.embed.weight)  # but two trainings
    assert load_run(tmp_path / "1").experiment["data_seed"] == 5
    assert ds0.window_loss.dims == ("loop", "window") and ds0.window_loss.sel(loop=2).mean() == pytest.approx(
        float(ds0.loss.sel(loop=2)), abs=1e-5)
    # the default (data_seed = seed) is what runs before data_seed did: the text, so the tokenizer, follow the seed
    args = train_notebook_args(corpus=f"path:{tmp_path / 'text'}", d_model=16, n_heads=2, n_kv_heads=1, core=1,
                               loops=2, vocab_size=300, seq_len=16, batch_size=2, steps=2, eval_loops=[1, 2],
                               seed=1, tasks=["iterated"], task_ratio=0.3)
    _, own = train_run(tmp_path / "own", resume=False, **args)
    assert own.attrs["tokenizer"] != ds0.attrs["tokenizer"]
    with pytest.raises(ValueError, match="data_seed"):
        train_notebook_args(data_seed=-2)


def plant_phi_run(root, key, params, loss, n_once, n_rec):
    """Write a finished phi_ladder/train run folder holding only what phi_ladder reads."""
    d = root / "phi_ladder" / "train" / key
    d.mkdir(parents=True)
    xr.Dataset({"final_loss": ((), loss), "n_once": ((), n_once), "n_rec": ((), n_rec)}).to_netcdf(
        d / "results.nc", engine="h5netcdf")
    (d / "run.json").write_text(json.dumps({"status": "done", "finished": key, "params": params}))


@pytest.mark.parametrize("slope,phi,below_one", [(-0.3, 0.5, "replicates"), (-0.3, 1.3, "opposite"),
                                                 (0.0, 0.5, "not identified")])
def test_phi_ladder_recovers_a_planted_phi_and_says_when_the_ladder_is_flat(tmp_path, slope, phi, below_one):
    from workbench.experiments.findings import phi_ladder, phi_ladder_rows

    rng = np.random.default_rng(4)
    a, once, layer = 8.0, 2000.0, 1000.0  # N_once: prelude + coda; each core layer 1000 parameters
    for s in range(3):
        off = rng.normal(0, 0.002)  # a seed's offset, shared by its runs
        for core, loops in [(1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (2, 4), (1, 8)]:
            n_eff = once + loops ** phi * core * layer
            loss = a + slope * np.log(n_eff) + off + rng.normal(0, 0.001)
            plant_phi_run(tmp_path, f"{s}{core}{loops}", {"d_model": 32, "steps": 100, "seed": s, "core": core,
                                                           "loops": loops}, loss, once, core * layer)
    out = phi_ladder(tmp_path)
    if slope < 0:
        assert bool(out.identified.item())
        assert out.phi_mean.sel(loops=[2, 4, 8]).values.ravel() == pytest.approx([phi] * 3, abs=0.05)
        if phi < 1:  # one fixed noise draw: at phi = 1.3 the r = 8 interval (95%) misses by 0.001, as 1 in 20 may
            assert (out.phi_low < phi).all() and (out.phi_high > phi).all()
        assert out.slope_mean.item() == pytest.approx(slope, abs=0.01)
        row = phi_ladder_rows(out)[0]
        assert row.startswith("| d32 100 steps | -0.30") and f"r = 4: {phi:.2f} [" in row
        assert f"φ < 1 {below_one}" in row
    else:
        assert not bool(out.identified.item())  # no capacity effect: phi cannot be read off the ladder
        assert "not identifiable" in phi_ladder_rows(out)[0]
    # phi < 1 at each r, one family over every (cell, r), Holm: the planted phi is far from 1 beside seed noise
    assert out.attrs["comparisons"] == 3 and (out.verdict == below_one).all()
    assert (out.p_holm < 0.05).all() if slope < 0 else (out.p_holm == 1).all()


def plant_conditioning_run(root, key, cfg, seed, knowledge, reasoning, loops=(1, 2, 4, 6, 8, 12)):
    """Write a finished conditioning/train run folder holding only the group accuracies conditioning_claims reads."""
    d = root / "conditioning" / "train" / key
    d.mkdir(parents=True)
    acc = np.stack([knowledge, reasoning], axis=1)
    xr.Dataset({"group_accuracy": (("loop", "group"), acc)},
               coords={"loop": list(loops), "group": ["knowledge", "reasoning"]},
               attrs={"config_json": json.dumps({"loops": 4, "prelude": 1, "coda": 1, "inject": "none",
                                                 "history": 0, "timestep": "none", **cfg})}).to_netcdf(
        d / "results.nc", engine="h5netcdf")
    (d / "run.json").write_text(json.dumps({"status": "done", "finished": key, "params": {"seed": seed}}))


def test_conditioning_claims_pair_each_arm_with_plain_per_seed_and_correct_within_each_family(tmp_path):
    from workbench.experiments.conditioning_findings import arm_of, conditioning_claim_rows, conditioning_claims

    rng = np.random.default_rng(1)
    base_k = np.array([0.3, 0.7, 0.9, 0.85, 0.8, 0.7])
    base_r = np.array([0.2, 0.5, 0.6, 0.62, 0.65, 0.6])
    arms = {"BaseLoop": ({"prelude": 0, "coda": 0}, base_k - [0, 0, 0, 0.1, 0.2, 0.3], base_r + [0, 0, 0, .04, .08, .1]),
            "plain": ({}, base_k, base_r),
            "H+LG": ({"history": 1, "history_op": "channel", "timestep": "loop_gate"}, base_k + 0.1, base_r + 0.1),
            "H(dense)": ({"history": 1, "history_op": "dense"}, base_k + 0.05, base_r + 0.05),
            "I(dense)": ({"inject": "dense"}, base_k - [0, 0, 0, 0.2, 0.4, 0.5], base_r - 0.05),
            "I(scalar)": ({"inject": "scalar"}, base_k, base_r)}
    for arm, (cfg, k, r) in arms.items():
        assert arm_of({"loops": 4, "prelude": 1, "coda": 1, "inject": "none", "history": 0, "timestep": "none",
                       **cfg}) == arm
        for s in range(3 if arm != "I(scalar)" else 2):
            noise = rng.normal(0, 0.005, 6)
            plant_conditioning_run(tmp_path, f"{arm}{s}", cfg, s, k + noise, r + noise)
    c = conditioning_claims(tmp_path)
    assert c.comparison.values.tolist() == ["first_reasoning", "first_knowledge", "hlg", "dense_history",
                                            "dense_injection", "scalar_injection", "reasoning_dense",
                                            "reasoning_scalar"]  # channel: no runs
    # "Reasoning was largely insensitive to all inject* variants": reasoning alone past K, a claim of no difference
    assert float(c.difference.sel(comparison="reasoning_dense")) == pytest.approx(-0.05, abs=0.01)
    assert float(c.difference.sel(comparison="reasoning_scalar")) == pytest.approx(0.0, abs=0.01)
    assert (c.verdict.sel(comparison=["reasoning_dense", "reasoning_scalar"]) == "no direction").all()
    assert float(c.difference.sel(comparison="first_knowledge")) == pytest.approx(-0.3, abs=0.02)
    assert float(c.difference.sel(comparison="hlg")) == pytest.approx(0.1, abs=0.01)
    assert c.verdict.sel(comparison=["first_reasoning", "first_knowledge", "hlg", "dense_history",
                                     "dense_injection"]).values.tolist() == ["replicates"] * 5
    assert c.verdict.sel(comparison="scalar_injection").item() == "no direction" and int(
        c.seeds.sel(comparison="scalar_injection")) == 2
    assert c.family_size.sel(comparison="hlg").item() == 4 and c.family_size.sel(comparison="dense_injection") == 1
    assert bool(np.isnan(c.per_seed.sel(comparison="scalar_injection", seed=2)))
    rows = conditioning_claim_rows(c)  # what findings.md quotes, one per comparison
    assert len(rows) == 8 and rows[1].startswith("| seeds | first_knowledge | BaseLoop: knowledge(2K) - knowledge(K) | ")
    assert rows[1].endswith('| "knowledge fell from 62.80 to 52.11" | replicates |')
    hlg = c.sel(comparison="hlg")
    assert (f"| {float(hlg.difference):+.3f} [{float(hlg.low):+.3f}, {float(hlg.high):+.3f}] |" in rows[2]
            and "H+LG - plain" in rows[2])
    assert rows[5].split(" | ")[3].endswith(" / -")  # scalar injection: no seed 2


def test_dense_history_windows_are_their_own_arms_and_family(tmp_path):
    from workbench.experiments.conditioning_findings import SAME_MODEL, arm_of, conditioning_claims

    base = {"loops": 4, "prelude": 1, "coda": 1, "inject": "none", "timestep": "none", "history_op": "dense"}
    assert [arm_of({**base, "history": w}) for w in (1, 2, 4)] == ["H(dense)", "H(dense,w=2)", "H(dense,w=4)"]
    assert arm_of({**base, "history": 2, "history_op": "channel", "timestep": "loop_gate"}) == "H(channel,w=2)+LG"
    rng = np.random.default_rng(2)
    k, r = np.array([0.3, 0.7, 0.9, 0.85, 0.8, 0.7, 0.6]), np.array([0.2, 0.5, 0.6, 0.62, 0.65, 0.6, 0.5])
    past = np.array([0, 0, 0, 0, 0, 1, 1])  # the last two loops are 2K and 3K; the windows lose only there
    # K = 6 reaches w = 4's lags (loop t sees min(w, t - 1) past states); K = 4 reaches lags 1-2 only
    for K, loops in ((6, (1, 2, 3, 4, 6, 12, 18)), (4, (1, 2, 3, 4, 6, 8, 12))):
        root = tmp_path / f"K{K}"
        for w, drop in ((1, 0.0), (2, 0.1), (4, 0.15)):
            for s in range(3):
                noise = rng.normal(0, 0.005, 7)
                plant_conditioning_run(root, f"w{w}s{s}", {"history": w, "history_op": "dense", "loops": K}, s,
                                       k - drop * past + noise, r - drop * past + noise, loops=loops)
        c = conditioning_claims(root)
        assert c.comparison.values.tolist() == ["window_2", "window_4"] and (c.family_size == 2).all()
        assert float(c.difference.sel(comparison="window_2")) == pytest.approx(-0.1, abs=0.02)
        assert float(c.difference.sel(comparison="window_4")) == pytest.approx(-0.05, abs=0.02)
        # at K = 4 the planted w = 4 drop is not believed: the two windows are one model there, whatever the data
        assert c.verdict.values.tolist() == ["replicates", "replicates" if K == 6 else SAME_MODEL]


def test_the_hlg_checkpoints_profile_trains_the_seeds_profiles_h_lg_runs_again(tmp_path):
    """Its three runs have exactly the parameters of the seeds profile's H+LG runs, seed for seed."""
    from workbench.experiments.conditioning_findings import arm_of
    from workbench.experiments.runs import train_notebook_args
    from workbench.pipeline.keys import expand
    from workbench.pipeline.spec import load_spec

    def params(profile):
        jobs = [j for j in expand(load_spec("conditioning", profile), tmp_path / profile) if j.step == "train"]
        return {j.params["seed"]: j.params for j in jobs
                if arm_of(train_notebook_args(**j.params)["model"]) == "H+LG"}, len(jobs)
    again, n = params("hlg_checkpoints")
    first, _ = params("seeds")
    assert n == 3 and sorted(again) == [0, 1, 2] and again == first


def profile_arms(profile: str, tmp_path) -> list[tuple[str, int]]:
    """Return the sorted (arm, seed) of a conditioning profile's train runs, arms named as the claims name them."""
    from workbench.experiments.conditioning_findings import arm_of
    from workbench.experiments.runs import train_notebook_args
    from workbench.pipeline.keys import expand
    from workbench.pipeline.spec import load_spec

    jobs = [j for j in expand(load_spec("conditioning", profile), tmp_path / profile) if j.step == "train"]
    return sorted((arm_of(train_notebook_args(**j.params)["model"]), j.params["seed"]) for j in jobs)


def test_h_lg_is_read_against_its_two_parts_and_the_loop_gate_against_plain(tmp_path):
    from workbench.experiments.conditioning_findings import conditioning_claims

    # the profile's runs are H+LG's two parts alone, three seeds each, named as the claims name them
    assert profile_arms("component_seeds", tmp_path) == sorted((a, sd) for a in ("H(channel)", "LG") for sd in (0, 1, 2))
    rng = np.random.default_rng(4)
    k, r = np.array([0.3, 0.7, 0.9, 0.85, 0.8, 0.7]), np.array([0.2, 0.5, 0.6, 0.62, 0.65, 0.6])
    at_2k = np.array([0, 0, 0, 0, 1, 0])  # r = 8: the one loop count the timestep comparison reads
    arms = {"plain": ({}, 0.0, 0.0), "H+LG": ({"history": 1, "history_op": "channel", "timestep": "loop_gate"}, 0.0, 0.0),
            "H(channel)": ({"history": 1, "history_op": "channel"}, 0.06, 0.0),
            "LG": ({"timestep": "loop_gate"}, 0.0, -0.1)}  # LG: level with H+LG except 0.1 above plain at 2K
    for arm, (cfg, drop, lift) in arms.items():
        for sd in range(3):
            noise = rng.normal(0, 0.004, 6)
            plant_conditioning_run(tmp_path, f"{arm}{sd}", cfg, sd, k - drop - lift * at_2k + noise,
                                   r - drop - lift * at_2k + noise)
    c = conditioning_claims(tmp_path)
    assert {"hlg_over_h", "hlg_over_lg", "lg"} <= set(c.comparison.values.tolist())
    assert (c.family_size.sel(comparison=["hlg_over_h", "hlg_over_lg"]) == 2).all()
    assert float(c.difference.sel(comparison="hlg_over_h")) == pytest.approx(0.06, abs=0.01)
    # the loop gate's lift sits at 2K only: a quarter of it in the K..3K mean, all of it at 2K
    assert float(c.difference.sel(comparison="hlg_over_lg")) == pytest.approx(-0.025, abs=0.01)
    assert float(c.difference.sel(comparison="lg")) == pytest.approx(0.1, abs=0.01)
    assert c.verdict.sel(comparison="hlg_over_h").item() == "replicates"
    assert c.verdict.sel(comparison="hlg_over_lg").item() == "opposite"
    assert c.verdict.sel(comparison="lg").item() == "no direction" and int(c.family_size.sel(comparison="lg")) == 0


def test_branch_gating_and_adaln_are_read_against_each_other_and_the_loop_gate_at_2k(tmp_path):
    from workbench.experiments.conditioning_findings import conditioning_claim_rows, conditioning_claims

    # the profile's runs are the two schemes alone, three seeds each, named as the paper names them
    assert profile_arms("gating_seeds", tmp_path) == sorted((a, sd) for a in ("BG", "AdaLN") for sd in (0, 1, 2))
    rng = np.random.default_rng(5)
    k, r = np.array([0.3, 0.7, 0.9, 0.85, 0.8, 0.7]), np.array([0.2, 0.5, 0.6, 0.62, 0.65, 0.6])
    at_2k = np.array([0, 0, 0, 0, 1, 0])  # r = 8: the one loop count the family reads
    # (knowledge, reasoning) shifts at 2K: BG ahead of AdaLN on reasoning, AdaLN ahead of BG on knowledge (as the
    # paper), and AdaLN level with LG on knowledge, 0.2 above plain in overall (every shift at 2K alone)
    arms = {"plain": ({}, 0.0, 0.0), "LG": ({"timestep": "loop_gate"}, 0.1, 0.0),
            "BG": ({"timestep": "branch_gate"}, 0.0, 0.4), "AdaLN": ({"timestep": "adaln"}, 0.1, 0.1)}
    for arm, (cfg, dk, dr) in arms.items():
        for sd in range(3):
            noise = rng.normal(0, 0.004, 6)
            plant_conditioning_run(tmp_path, f"{arm}{sd}", cfg, sd, k + dk * at_2k + noise, r + dr * at_2k + noise)
    c = conditioning_claims(tmp_path)
    gating = ["bg_over_adaln", "bg_reasoning_over_adaln", "adaln_knowledge_over_bg", "adaln_knowledge_over_lg",
              "lg_reasoning_over_adaln"]
    assert c.comparison.values.tolist() == ["lg", "bg"] + gating
    want = {"lg": 0.05, "bg": 0.2, "bg_over_adaln": 0.1, "bg_reasoning_over_adaln": 0.3,
            "adaln_knowledge_over_bg": 0.1, "adaln_knowledge_over_lg": 0.0, "lg_reasoning_over_adaln": -0.1}
    for name, d in want.items():
        assert float(c.difference.sel(comparison=name)) == pytest.approx(d, abs=0.01), name
    assert (c.family_size.sel(comparison=gating[:4]) == 4).all() and int(c.family_size.sel(comparison="bg")) == 0
    assert c.verdict.sel(comparison=gating).values.tolist() == ["replicates", "replicates", "replicates",
                                                                "inconclusive", "no direction"]
    assert c.verdict.sel(comparison="bg").item() == "no direction"
    row = conditioning_claim_rows(c)[c.comparison.values.tolist().index("adaln_knowledge_over_lg")]
    assert row.startswith("| gating | adaln_knowledge_over_lg | AdaLN - LG: knowledge at 2K | ")
    assert row.endswith('| "AdaLN better preserved Knowledge." | inconclusive |')


def test_the_combinations_are_named_as_the_paper_and_ranked_below_h_lg_per_seed(tmp_path):
    from workbench.experiments.conditioning_findings import arm_of, conditioning_claims

    # the profile's runs are the three combinations, three seeds each, named as the paper names them
    assert profile_arms("combination_seeds", tmp_path) == sorted((a, sd) for a in ("I+H", "I+LG", "I+H+LG") for sd in (0, 1, 2))
    base = {"loops": 4, "prelude": 1, "coda": 1, "inject": "none", "history": 0, "timestep": "none"}
    assert arm_of({**base, "inject": "scalar", "history": 2}) == "I(scalar)+H(scalar,w=2)"  # not the paper's I+H
    rng = np.random.default_rng(3)
    k, r = np.array([0.3, 0.7, 0.9, 0.85, 0.8, 0.7]), np.array([0.2, 0.5, 0.6, 0.62, 0.65, 0.6])
    arms = {"H+LG": ({"history": 1, "history_op": "channel", "timestep": "loop_gate"}, 0.0),
            "I+H": ({"inject": "channel", "history": 1, "history_op": "channel"}, 0.04),
            "I+LG": ({"inject": "channel", "timestep": "loop_gate"}, 0.08),
            "I+H+LG": ({"inject": "channel", "history": 1, "history_op": "channel", "timestep": "loop_gate"}, 0.0)}
    for arm, (cfg, drop) in arms.items():
        for sd in range(3):
            noise = rng.normal(0, 0.005, 6)
            plant_conditioning_run(tmp_path, f"{arm}{sd}", cfg, sd, k - drop + noise, r - drop + noise)
    inter = xr.Dataset({"cross_loop": ("run", [1.2] * 3 + [1.0] * 3 + [1.1] * 3)},
                       coords={"arm": ("run", ["H+LG"] * 3 + ["I+H"] * 3 + ["I+LG"] * 3),
                               "train_seed": ("run", [0, 1, 2] * 3)})
    c = conditioning_claims(tmp_path, interaction=inter)
    assert c.comparison.values.tolist() == ["hlg_over_ih", "hlg_over_ilg", "hlg_over_ihlg", "interaction_ih",
                                            "interaction_ilg"]
    assert float(c.difference.sel(comparison="hlg_over_ih")) == pytest.approx(0.04, abs=0.01)
    assert float(c.difference.sel(comparison="interaction_ih")) == pytest.approx(np.log(1.2), abs=1e-9)
    assert (c.family_size.sel(comparison=["hlg_over_ih", "hlg_over_ilg", "hlg_over_ihlg"]) == 3).all()
    assert (c.family_size.sel(comparison=["interaction_ih", "interaction_ilg"]) == 2).all()
    # H+LG above I+H and I+LG in every seed replicates; level with I+H+LG does not
    assert c.verdict.values.tolist()[:3] == ["replicates", "replicates", "inconclusive"]
    # initial-state conditioning lowers H+LG's interaction over lags 2..K-1 by 7.4% (the paper's D = 56) in every
    # seed, and raises it at lag 1 (which the family leaves out): the family reads lags 2-3 at K = 4 alone
    by_lag = {"H+LG": [1.0, 0.4, 0.2, 0.1], "I+H+LG": [1.0, 0.6, 0.2 * 0.926, 0.1 * 0.926]}
    wobble = np.exp(rng.normal(0, 0.002, 3))
    rows = [np.array(by_lag[a]) * (wobble[sd] if a == "I+H+LG" else 1.0) for a in by_lag for sd in range(3)]
    inter = xr.Dataset({"interaction_by_lag": (("run", "lag"), rows),
                        "cross_loop": ("run", [np.mean(x[1:]) for x in rows])},
                       coords={"arm": ("run", ["H+LG"] * 3 + ["I+H+LG"] * 3), "train_seed": ("run", [0, 1, 2] * 2),
                               "lag": [0, 1, 2, 3]})
    x = conditioning_claims(tmp_path, interaction=inter).sel(comparison="interaction_ihlg")
    assert x.family.item() == "initial_interaction" and int(x.family_size) == 1 and int(x.seeds) == 3
    assert float(x.difference) == pytest.approx(np.log(0.926), abs=0.005) and x.verdict.item() == "replicates"


def test_conditioning_reasoning_pools_the_trained_depths_with_those_past_them_by_count():
    from workbench.experiments.conditioning_findings import _pooled

    ds = xr.Dataset({"group_accuracy": (("loop", "group"), [[0.5, 1.0]]),
                     "group_accuracy_beyond": (("loop", "group"), [[np.nan, 0.25]]),
                     "group_count": ("group", [64.0, 384.0]), "group_count_beyond": ("group", [0.0, 128.0])},
                    coords={"loop": [4], "group": ["knowledge", "reasoning"]})
    acc = _pooled(ds)
    assert float(acc.sel(loop=4, group="reasoning")) == pytest.approx((384 * 1.0 + 128 * 0.25) / 512)
    assert float(acc.sel(loop=4, group="knowledge")) == 0.5 and float(ds.group_accuracy[0, 1]) == 1.0  # a copy


def plant_depth_run(root, key, cfg, seed, gain, loops=(1, 2, 4, 8, 12)):
    """Write a finished conditioning/train run whose iterated accuracy at depths 1-6 is 0.9 at r = 4 (K) and
    0.9 + gain[d - 1] at r = 8 and 12; depth 0 has no examples (NaN), as in the real runs."""
    d = root / "conditioning" / "train" / key
    d.mkdir(parents=True)
    acc = np.full((len(loops), 2, 7), np.nan)
    for i, r in enumerate(loops):
        acc[i, 0, 1:] = 0.9 + (np.asarray(gain) if r > 4 else 0.0)
        acc[i, 1, 0] = 1.0
    trained = np.zeros((2, 7), bool)
    trained[0, 1:4] = True
    xr.Dataset({"task_accuracy": (("loop", "task", "depth"), acc), "task_trained": (("task", "depth"), trained)},
               coords={"loop": list(loops), "task": ["iterated", "recall"], "depth": list(range(7))},
               attrs={"config_json": json.dumps({"loops": 4, "prelude": 1, "coda": 1, "inject": "none",
                                                 "history": 0, "timestep": "none", **cfg})}).to_netcdf(
        d / "results.nc", engine="h5netcdf")
    (d / "run.json").write_text(json.dumps({"status": "done", "finished": key, "params": {"seed": seed}}))


def test_depth_gains_give_each_seeds_slope_of_the_gain_past_K_on_depth_and_a_t_interval_over_seeds(tmp_path):
    from scipy import stats as st

    from workbench.experiments.conditioning_findings import depth_gain_rows, depth_gains

    depths = np.arange(1, 7)
    for s, b in enumerate((0.01, 0.02, 0.03)):  # BaseLoop: deeper instances gain more, by b per depth
        plant_depth_run(tmp_path, f"base{s}", {"prelude": 0, "coda": 0}, s, -0.05 + b * depths)
        plant_depth_run(tmp_path, f"plain{s}", {}, s, -0.04 * depths + 0.001 * s)  # deeper lose more
    g = depth_gains(tmp_path, times=(2, 3))
    assert g.depth.values.tolist() == [1, 2, 3, 4, 5, 6] and g.trained.values.tolist() == [True] * 3 + [False] * 3
    np.testing.assert_allclose(g.slope.sel(arm="BaseLoop", times=2).values, [0.01, 0.02, 0.03], atol=1e-12)
    half = float(st.t.ppf(0.975, 2)) * 0.01 / np.sqrt(3)  # sd of 0.01, 0.02, 0.03 is 0.01
    b = g.sel(arm="BaseLoop", times=2)
    assert (float(b.slope_mean), float(b.slope_low), float(b.slope_high)) == pytest.approx((0.02, 0.02 - half, 0.02 + half))
    assert b.verdict.item() == "inconclusive"  # the interval holds 0 at three seeds this spread
    assert float(g.slope_mean.sel(arm="plain", times=3)) == pytest.approx(-0.04)
    assert g.verdict.sel(arm="plain").values.tolist() == ["-", "-"]  # one comparison: the first arm at 2K
    rows = depth_gain_rows(g)
    assert rows[0].startswith("| BaseLoop | 4 to 8 | -0.03 / -0.01 / +0.01 / +0.03 / +0.05 / +0.07 | +0.0200 [")
    assert rows[0].endswith("| inconclusive |") and len(rows) == 4
    for s in range(3):  # every seed's slope steep and alike: the interval leaves 0, against the paper's "not more"
        plant_depth_run(tmp_path / "steep", f"base{s}", {"prelude": 0, "coda": 0}, s, 0.1 * depths + 0.001 * s ** 2)
        plant_depth_run(tmp_path / "steep", f"plain{s}", {}, s, 0 * depths)
    assert depth_gains(tmp_path / "steep").verdict.sel(arm="BaseLoop", times=2).item() == "opposite"
    plant_depth_run(tmp_path / "one", "base0", {"prelude": 0, "coda": 0}, 0, 0 * depths)
    with pytest.raises(ValueError, match="2 or more seeds of each arm"):
        depth_gains(tmp_path / "one")


def test_the_interaction_family_compares_log_cross_loop_response_per_seed(tmp_path):
    """Planted: channel-wise injection's cross-loop response 7x dense's in every seed (with a little noise): the
    family `interaction` gives log 7 with a t interval over seeds and "replicates"; half of it would still be up."""
    from workbench.experiments.conditioning_findings import conditioning_claim_rows, conditioning_claims

    rng = np.random.default_rng(3)
    for s in range(3):
        for arm, cfg in (("plain", {}), ("I(dense)", {"inject": "dense"})):
            plant_conditioning_run(tmp_path, f"{arm}{s}", cfg, s, np.full(6, 0.8), np.full(6, 0.5))
    dense = np.array([0.05, 0.06, 0.04])
    channel = 7 * dense * np.exp(rng.normal(0, 0.05, 3))
    inter = xr.Dataset({"cross_loop": ("run", np.r_[channel, dense])},
                       coords={"run": [f"r{i}" for i in range(6)], "arm": ("run", ["I(channel)"] * 3 + ["I(dense)"] * 3),
                               "train_seed": ("run", [0, 1, 2, 0, 1, 2])})
    c = conditioning_claims(tmp_path, interaction=inter)
    x = c.sel(comparison="cross_loop")
    assert x.family.item() == "interaction" and int(x.family_size) == 1 and int(x.seeds) == 3
    assert float(x.difference) == pytest.approx(np.log(7), abs=0.1) and x.verdict.item() == "replicates"
    assert np.allclose(x.per_seed.values, np.log(channel / dense))
    assert "cross_loop" not in conditioning_claims(tmp_path).comparison.values  # no interaction given: no row
    assert "interaction_ihlg" not in c.comparison.values  # neither arm probed
    row = [r for r in conditioning_claim_rows(c) if "| cross_loop |" in r][0]
    assert row.startswith("| interaction | cross_loop | I(channel) - I(dense): log of mean C at each loop lag") and row.endswith("| replicates |")


def test_interaction_by_run_reads_each_checkpoint_at_its_training_loop_count(tmp_path):
    """Two tiny trained runs: arm and seed from the run, the probe's by-lag means equal probes.interaction's on the
    same held-out windows, and cross_loop is their mean past lag 0."""
    from workbench.experiments import load_run, train_run
    from workbench.experiments.conditioning_findings import interaction_by_run
    from workbench.probes import interaction

    model = dict(d_model=16, n_heads=2, n_kv_heads=1, prelude=1, core=1, coda=1, loops=3, max_seq_len=64)
    for name, inject, seed in (("a", "channel", 0), ("b", "dense", 1)):
        train_run(tmp_path / name, {**model, "inject": inject}, dict(steps=2, batch_size=2, seq_len=32, bf16="off"),
                  vocab_size=300, eval_loops=[1], seed=seed, data_seed=0)
    ds = interaction_by_run([tmp_path / "a", tmp_path / "b"], n_sequences=2, seq_len=32)
    assert ds.arm.values.tolist() == ["I(channel)", "I(dense)"] and ds.train_seed.values.tolist() == [0, 1]
    assert sorted(ds.data_vars) == ["cross_loop", "interaction_by_lag"]  # the probe's numbers and nothing else
    run = load_run(tmp_path / "b", device="cpu")
    with torch.no_grad():
        ref = interaction(run.model, run.val_tokens(2, 32, seed=0)[:, :-1], 3)
    assert np.allclose(ds.interaction_by_lag.sel(run="b").values, ref.interaction_by_lag.values, equal_nan=True)
    assert float(ds.cross_loop.sel(run="b")) == pytest.approx(float(ref.interaction_by_lag[1:].mean()))


def test_under_geometry_claims_average_the_loops_below_k_and_pair_per_seed(tmp_path):
    """Planted geometry: a model whose loops below K move by a known extra amount reads as that difference."""
    from workbench.experiments import allocation_findings as af

    K, seeds = 4, (0, 1, 2)
    for arm, extra in (("0+2x4+2", 0.3), ("2+2x4+0", 0.0), ("1+2x4+1", 0.1)):
        pre, coda = int(arm[0]), int(arm[-1])
        for sd in seeds:
            key = f"{arm}-{sd}".replace("+", "p")
            t = tmp_path / "allocation" / "train" / key
            t.mkdir(parents=True)
            (t / "run.json").write_text(json.dumps({"status": "done", "finished": key,
                                                    "params": {"prelude": pre, "core": 2, "loops": K, "coda": coda,
                                                               "seed": sd}}))
            loops = np.arange(1, 13)
            xr.Dataset({"window_loss": (("loop", "window"), np.ones((4, 2)))},
                       coords={"loop": [1, 2, 4, 8], "window": [0, 1]},
                       attrs={"data_seed": 0}).to_netcdf(t / "results.nc", engine="h5netcdf")
            g = tmp_path / "allocation" / "geometry" / f"g{key}"
            g.mkdir(parents=True)
            (g / "run.json").write_text(json.dumps({"status": "done", "finished": key,
                                                    "params": {"checkpoint": str(t)}}))
            # below K the planted extra (plus a per-seed wobble that pairs away); past K all models agree
            base = 0.1 / loops + 0.01 * sd
            xr.Dataset({"angular_distance": ("loop", base + extra * (loops < K)),
                        "relative_update": ("loop", 2 * base + 2 * extra * (loops < K))},
                       coords={"loop": loops}).to_netcdf(g / "results.nc", engine="h5netcdf")
    c = af.under_geometry_claims(tmp_path)
    assert c.sizes["comparison"] == 4 and (c.family_size == 4).all()
    np.testing.assert_allclose(c.difference.values, [0.3, 0.6, 0.2, 0.4], atol=1e-9)
    np.testing.assert_allclose(c.per_seed.values, np.repeat([[0.3], [0.6], [0.2], [0.4]], 3, axis=1), atol=1e-9)
    assert (c.verdict == "opposite").all()  # the paper's sign is negative: the coda-only model should move less
    with pytest.raises(ValueError, match="first_loop=4 is invalid"):
        af.under_geometry_claims(tmp_path, first_loop=4)


def test_phi_ladder_gives_no_verdict_where_a_seed_has_no_phi(tmp_path):
    """A looped model worse than its own unique layers alone has no phi (N_eq <= N_once): with 2 finite seeds of 3
    that loop count gets no verdict, and it still counts in the family's Holm."""
    from workbench.experiments.findings import phi_ladder, phi_ladder_rows

    rng = np.random.default_rng(7)
    for s in range(3):
        for core, loops in [(1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (2, 4), (1, 8)]:
            loss = 8.0 - 0.3 * np.log(2000.0 + loops ** 0.5 * core * 1000.0) + rng.normal(0, 0.001)
            if s == 2 and loops == 8:
                loss = 8.0  # far above the ladder at N_once: below its unique layers
            plant_phi_run(tmp_path, f"{s}{core}{loops}", {"d_model": 32, "steps": 100, "seed": s, "core": core,
                                                           "loops": loops}, loss, 2000.0, core * 1000.0)
    out = phi_ladder(tmp_path)
    assert np.isnan(out.phi.sel(loops=8, seed=2)).all() and bool(out.identified.item())
    assert out.verdict.sel(loops=8).item() == "no verdict: φ undefined in a seed"
    assert out.p_holm.sel(loops=8).item() == 1.0 and out.attrs["comparisons"] == 3
    assert (out.verdict.sel(loops=[2, 4]) == "replicates").all()
    assert "r = 8: " in phi_ladder_rows(out)[0] and "φ < 1 no verdict: φ undefined in a seed" in phi_ladder_rows(out)[0]
