"""The notebook glue: train_run's results agree with the model and trainer, runs reopen, law tables."""

import numpy as np
import pytest
import torch
import xarray as xr

from workbench.experiments import law_table, load_run, sweep_table, train_run
from workbench.evals import loop_sweep

MODEL = dict(d_model=16, n_heads=2, n_kv_heads=1, prelude=1, core=1, coda=1, loops=2, max_seq_len=64)
# fp32: results are compared with references (the bf16 path is tested in test_fast_path)
TRAIN = dict(steps=3, batch_size=4, seq_len=32, checkpoint_every=2, bf16="off")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    run, ds = train_run(out, MODEL, TRAIN, vocab_size=300, eval_loops=[1, 3])
    return out, run, ds


def test_results_agree_with_the_model(trained):
    out, run, ds = trained
    assert list(ds.loop.values) == [1, 2, 3]  # K = 2 is always evaluated: final_loss is read there
    assert float(ds.final_loss) == float(ds.loss.sel(loop=2))
    pc = run.model.param_counts()
    assert (float(ds.n_once), float(ds.n_rec)) == (pc["once"], pc["rec"])
    assert float(ds.tokens) == 3 * 4 * 32 and ds.sizes["step"] == 3
    on_disk = xr.load_dataset(out / "results.nc", engine="h5netcdf")
    assert np.array_equal(on_disk.loss.values, ds.loss.values)
    # the sweep in results is what loop_sweep gives on the trainer's validation batches, rebuilt here:
    # eval_batches batches of min(batch_size, 8) windows of the run's validation split, seeded seed + 1
    from workbench.data.corpus import BatchSampler
    from workbench.train import TrainConfig

    tc = TrainConfig.from_json(ds.attrs["train_config"])
    sampler = BatchSampler(np.asarray(run.data().val), min(tc.batch_size, 8), tc.seq_len, seed=tc.seed + 1)
    val = torch.cat([next(sampler) for _ in range(tc.eval_batches)])
    sweep = loop_sweep(run.model, val, [1, 2, 3], progress=False)
    assert sweep.loss.values.tolist() == ds.loss.values.tolist()
    assert sweep.accuracy.values.tolist() == ds.accuracy.values.tolist()
    with torch.no_grad():  # and loop_sweep's loss is the plain cross-entropy of the model's logits
        for r in (1, 2, 3):
            logits = run.model(val[:, :-1], loops=r).logits
            ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), val[:, 1:].flatten())
            assert float(ds.loss.sel(loop=r)) == pytest.approx(float(ref), rel=1e-5), r


def test_load_run_reopens_the_same_model_and_held_out_data(trained):
    out, run, _ = trained
    again = load_run(out)
    for (k, a), (_, b) in zip(run.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a.cpu(), b.cpu()), k
    batch = again.val_tokens(2, 16)
    assert batch.shape == (2, 17)
    val = torch.as_tensor(np.asarray(again.data().val).astype(np.int64))
    first = batch[0]
    windows = val.unfold(0, 17, 1)
    assert (windows == first).all(1).any()  # the batch is a window of the validation split
    ds = loop_sweep(again.model, batch, [1, 2], progress=False)
    assert np.isfinite(ds.loss.values).all()
    with pytest.raises(FileNotFoundError, match="not a run or checkpoint folder"):
        load_run(out / "latest.json")
    with pytest.raises(FileNotFoundError, match="path='' is invalid"):
        load_run("")


def test_run_folder_layout_and_older_layouts_open(trained, tmp_path):
    """train_run writes config.json + tokenizer + checkpoints + metrics in the run folder; the layouts
    written before (train_run's model/ subfolder with experiment.json, a bare Trainer out_dir) still open."""
    import json
    import shutil

    from workbench.io import open_run, read_run_config

    out, run, _ = trained
    assert {"config.json", "tokenizer.json", "latest.json", "metrics.nc", "results.nc"} <= {p.name for p in out.iterdir()}
    conf = read_run_config(out)
    assert conf["data"] == run.experiment and conf["model"] == json.loads(run.model.cfg.to_json())
    ids = torch.tensor([run.tokenizer.encode("def f(x): return x")])
    with torch.no_grad():
        ref = run.model.cpu()(ids, loops=2).logits
    # train_run before the layout was unified: <run>/model/{ckpt-*, latest.json, tokenizer.json, experiment.json}
    old = tmp_path / "old"
    shutil.copytree(out, old / "model", ignore=shutil.ignore_patterns("results.nc", "config.json"))
    (old / "model" / "experiment.json").write_text(json.dumps(conf["data"]))
    # a bare Trainer out_dir: checkpoints only, tokenizer passed in
    bare = tmp_path / "bare"
    shutil.copytree(out, bare, ignore=shutil.ignore_patterns("*.nc", "config.json", "tokenizer.json"))
    for path in (old, old / "model", next((old / "model").glob("ckpt-*"))):
        again = load_run(path, device="cpu")
        assert again.experiment == run.experiment
        model, tok = open_run(path)
        assert tok.fingerprint == run.tokenizer.fingerprint
        with torch.no_grad():
            torch.testing.assert_close(model(ids, loops=2).logits, ref, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="is not byte-level"):
        open_run(bare)
    model, _ = open_run(bare, tokenizer=run.tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, loops=2).logits, ref, rtol=0, atol=0)
    assert read_run_config(bare)["data"] == {}


def counting_steps(monkeypatch) -> list:
    """Patch Trainer.train_step to record the step each call starts at; return that (growing) list."""
    from workbench.train import Trainer

    real, calls = Trainer.train_step, []

    def step(self):
        calls.append(self.step)
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", step)
    return calls


def test_rerun_resumes_from_the_checkpoint(trained, tmp_path, monkeypatch):
    """A rerun with a larger budget trains only the missing steps and ends bit-identical to a straight run.

    (warmup 10 > 5 steps: the learning rate does not depend on the total, so a straight 5-step run is
    the reference; a rerun that retrained from scratch would match it too, hence the step count.)
    """
    import shutil

    out, _, first = trained
    _, straight = train_run(tmp_path / "straight", MODEL, {**TRAIN, "steps": 5}, vocab_size=300, eval_loops=[1, 3])
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    calls = counting_steps(monkeypatch)
    _, longer = train_run(copy, MODEL, {**TRAIN, "steps": 5}, vocab_size=300, eval_loops=[1, 3])
    assert calls == [3, 4]  # only the two missing steps ran, from the checkpoint's step
    assert longer.sizes["step"] == 5
    assert np.array_equal(longer.train_loss.values[:3], first.train_loss.values)  # not retrained
    assert longer.train_loss.values.tolist() == straight.train_loss.values.tolist()
    assert longer.loss.values.tolist() == straight.loss.values.tolist()
    for name in ("model.safetensors", "optim.safetensors"):  # weights and optimiser state, byte for byte
        resumed, reference = ((d / "ckpt-00000005" / name).read_bytes() for d in (copy, tmp_path / "straight"))
        assert resumed == reference, name


def test_law_table_and_sweep_table(trained, tmp_path):
    out, _, ds = trained
    _, other = train_run(tmp_path / "b", {**MODEL, "loops": 3}, {**TRAIN, "backward_loops": 1},
                         vocab_size=300, eval_loops=[1, 3])
    table = law_table([out, tmp_path / "b"])
    assert list(table.loops) == [2.0, 3.0] and list(table.backward_loops) == [2.0, 1.0]
    assert list(table.truncated) == [False, True]
    assert table.loss.iloc[1] == float(other.final_loss)
    stacked = sweep_table([out, tmp_path / "b"])
    assert stacked.dims == ("run", "loop") and stacked.sizes["run"] == 2
    with pytest.raises(FileNotFoundError, match="results.nc is missing"):
        law_table([tmp_path])
