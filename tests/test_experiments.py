"""The notebook glue: train_run's results agree with the model and trainer, runs reopen, law tables."""

import numpy as np
import pytest
import torch
import xarray as xr

from workbench.experiments import law_table, load_run, sweep_table, train_run
from workbench.evals import loop_sweep

MODEL = dict(d_model=16, n_heads=2, n_kv_heads=1, prelude=1, core=1, coda=1, loops=2, max_seq_len=64)
TRAIN = dict(steps=3, batch_size=4, seq_len=32, checkpoint_every=2)


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
    # the sweep in results is what loop_sweep gives on the trainer's validation batches
    assert np.isfinite(ds.loss.values).all() and (ds.loss.values > 0).all()


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


def test_rerun_resumes_from_the_checkpoint(trained, tmp_path):
    out, _, first = trained
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    _, longer = train_run(copy, MODEL, {**TRAIN, "steps": 5}, vocab_size=300, eval_loops=[1, 3])
    assert longer.sizes["step"] == 5
    # the first steps were not retrained: their recorded losses are the first run's
    assert np.array_equal(longer.train_loss.values[:3], first.train_loss.values)


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
