"""experiments.finetune_lost_gradient: the lost gradient of a trained run across loop counts and over a
short fine-tune agrees with probes.lost_gradient called directly, on the trained model and on a model
fine-tuned by a plain optimiser loop; the run is left untouched; bad input is refused before any work."""

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from workbench.data.corpus import BatchSampler
from workbench.experiments import finetune_lost_gradient, train_run
from workbench.probes import lost_gradient

MODEL = dict(d_model=16, n_heads=2, n_kv_heads=1, prelude=1, core=1, coda=1, loops=2, max_seq_len=64)
# fp32 and AdamW alone: the reference below is a plain AdamW loop, compared to float precision
TRAIN = dict(steps=3, batch_size=4, seq_len=32, bf16="off", muon=False, weight_decay=0.01)
LOOPS = [1, 2, 3]
ARGS = dict(loops=LOOPS, steps=4, every=3, backward_loops=1, lr=2e-3, warmup=2, n_batches=2, n_sequences=2,
            seq_len=16, seed=5)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    run, _ = train_run(out, MODEL, TRAIN, vocab_size=300, eval_loops=[1, 2])
    return run


@pytest.fixture(scope="module")
def measured(run):
    before = {n: p.detach().clone() for n, p in run.model.state_dict().items()}
    ds = finetune_lost_gradient(run, **ARGS)
    return ds, before


def _batches(run):
    """The validation batches the function is documented to draw: n_batches x n_sequences windows with `seed`."""
    w = run.val_tokens(ARGS["n_batches"] * ARGS["n_sequences"], ARGS["seq_len"], seed=ARGS["seed"])
    n = ARGS["n_sequences"]
    return [w[b * n:(b + 1) * n] for b in range(ARGS["n_batches"])]


def _check_row(ds, step, model, batches):
    """Assert the rows at `step` equal lost_gradient on `model` for every r and batch, NaN where k > r."""
    for r in LOOPS:
        for b, batch in enumerate(batches):
            ref = lost_gradient(model, batch[:, :-1], batch[:, 1:], r)
            row = ds.sel(step=step, loops=r, batch=b)
            for v in ("lost", "cos", "projected"):
                np.testing.assert_allclose(row[v].values[:r], ref[v].values, rtol=1e-5, atol=1e-7, err_msg=v)
                assert np.isnan(row[v].values[r:]).all(), v
            np.testing.assert_allclose(row.adjoint_norm.values[:r + 1], ref.adjoint_norm.values, rtol=1e-5)
            np.testing.assert_allclose(float(row.rho), ref.attrs["rho"], rtol=1e-5)
            np.testing.assert_allclose(float(row.loss), ref.attrs["loss"], rtol=1e-6)
            np.testing.assert_allclose(float(row.lost_half), float(ref.lost.sel(k=math.ceil(r / 2))), rtol=1e-5)


def test_layout_and_step_zero_is_the_trained_model(run, measured):
    ds, _ = measured
    assert list(ds.step.values) == [0, 3, 4]  # every 3 steps, and the last
    assert list(ds.loops.values) == LOOPS and list(ds.k.values) == [1, 2, 3] and ds.sizes["batch"] == 2
    assert np.isnan(ds.train_loss.values[0]) and np.isfinite(ds.train_loss.values[1:]).all()
    _check_row(ds, 0, run.model, _batches(run))


def test_last_step_equals_a_plain_adamw_fine_tune(run, measured):
    """The reference fine-tune: the documented recipe written out as a loop (AdamW as the run's config
    says, lr warmed up linearly then constant, gradient clipped at 1, the run's K loops with the last k
    getting gradient, batches drawn with the run's seed + 1 + seed)."""
    ds, _ = measured
    model = copy.deepcopy(run.model)
    opt = torch.optim.AdamW(model.parameters(), lr=ARGS["lr"], betas=(0.9, 0.95), weight_decay=TRAIN["weight_decay"])
    data = BatchSampler(np.asarray(run.data().train), TRAIN["batch_size"], TRAIN["seq_len"], seed=0 + 1 + ARGS["seed"])
    losses = []
    for s in range(ARGS["steps"]):
        for g in opt.param_groups:
            g["lr"] = ARGS["lr"] * min(1.0, (s + 1) / ARGS["warmup"])
        batch = next(data)
        loss = model(batch[:, :-1], loops=MODEL["loops"], targets=batch[:, 1:],
                     backward_loops=ARGS["backward_loops"]).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    np.testing.assert_allclose(ds.train_loss_curve.values, losses, rtol=1e-5)
    np.testing.assert_allclose(ds.train_loss.sel(step=4), losses[3], rtol=1e-5)  # the mean since step 3
    _check_row(ds, 4, model, _batches(run))
    # the fine-tune moved the model: the last row is not the first one
    assert not np.allclose(ds.lost.sel(step=4).values, ds.lost.sel(step=0).values, equal_nan=True)


def test_the_run_is_left_untouched(run, measured):
    _, before = measured
    for n, p in run.model.state_dict().items():
        assert torch.equal(p, before[n]), n


def test_default_lr_is_the_runs_final_one(run):
    ds = finetune_lost_gradient(run, loops=[2], steps=1, n_batches=1, n_sequences=2, seq_len=16)
    assert ds.attrs["finetune_lr"] == pytest.approx(3e-3 * 0.1)  # TrainConfig's lr x min_lr_ratio (cosine)
    assert ds.attrs["finetune_warmup"] == 0 and list(ds.step.values) == [0, 1]


@pytest.mark.parametrize("bad, field", [
    ({"loops": []}, "loops"), ({"loops": [2, 2]}, "loops"), ({"loops": [0]}, r"loops\[0\]"), ({"loops": "2"}, "loops"),
    ({"steps": -1}, "steps"), ({"every": 0}, "every"), ({"backward_loops": 3}, "backward_loops"),
    ({"backward_loops": -1}, "backward_loops"), ({"lr": 0.0}, "lr"), ({"lr": float("nan")}, "lr"),
    ({"warmup": 5}, "warmup"), ({"n_batches": 0}, "n_batches"), ({"seq_len": 1}, "seq_len"),
    ({"params": "head"}, "params"), ({"progress": 1}, "progress"), ({"seed": -1}, "seed"),
])
def test_bad_input_is_refused_before_any_work(run, bad, field):
    def work(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    lazy = SimpleNamespace(model=run.model, path=run.path, val_tokens=work, data=work)
    args = {**ARGS, **bad}
    with pytest.raises(ValueError, match=rf"^{field}="):
        finetune_lost_gradient(lazy, **args)


def test_a_run_that_is_not_a_run_is_refused():
    with pytest.raises(ValueError, match="^run="):
        finetune_lost_gradient(object(), loops=[2])


@pytest.mark.parametrize("bad, field", [
    ({"loop_counts": [2, 0]}, r"loop_counts\[1\]"), ({"loop_counts": [2, 2]}, "loop_counts"),
    ({"finetune_steps": -1}, "finetune_steps"), ({"measure_every": 0}, "measure_every"),
    ({"finetune_lr": -1.0}, "finetune_lr"), ({"finetune_backward_loops": -2}, "finetune_backward_loops"),
    ({"n_batches": 0}, "n_batches")])
def test_the_notebooks_parameter_check_names_the_bad_one(bad, field):
    """The pipeline runs the check the notebook names before any run (laptop and paper profiles included)."""
    from pathlib import Path

    from workbench import pipeline

    check = pipeline._declared_check(Path(__file__).resolve().parent.parent / "notebooks" / "lost_gradient.ipynb")
    check({"loop_counts": [2, 4, 8], "finetune_steps": 100})  # the pipeline's values pass
    with pytest.raises(ValueError, match=rf"^{field}="):
        check({"loop_counts": [2, 4, 8], "finetune_steps": 100, **bad})
