import math
from pathlib import Path

import pytest

from workbench.cli import demo, main


def test_demo_learns_and_reports_every_loop_count(capsys):
    losses = demo(steps=25, seed=0, max_loops=5, progress=False)
    assert sorted(losses) == [1, 2, 3, 4, 5]
    # 25 steps on the stdlib take a byte-level model well below the uniform loss ln 256 = 5.55
    assert losses[4] < math.log(256) - 2
    out = capsys.readouterr().out
    assert "r= 4" in out and "<- K" in out


def test_demo_rejects_bad_step_count(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "0"])
    assert "--steps=0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """A run folder written by `workbench train --out` (2 steps, then resumed to 4), with its arguments."""
    import json
    import random

    tmp_path = tmp_path_factory.mktemp("cli")
    src = tmp_path / "text"
    src.mkdir()
    rng = random.Random(0)
    words = ["loop", "state", "core", "prelude", "coda", "refines", "the", "a", "token", "depth"]
    for i in range(20):
        (src / f"{i}.txt").write_text(" ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(600)))
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps({"d_model": 32, "n_heads": 2, "prelude": 0, "core": 1, "coda": 1, "loops": 2,
                               "max_seq_len": 64}))
    tcfg = tmp_path / "train.json"
    tcfg.write_text(json.dumps({"batch_size": 4, "seq_len": 32, "checkpoint_every": 2, "eval_every": 2}))
    args = ["train", "--out", str(tmp_path / "run"), "--corpus", f"path:{src}", "--vocab-size", "300",
            "--config", str(cfg), "--train-config", str(tcfg), "--no-progress"]
    from workbench.train import latest_checkpoint

    assert main(args + ["--steps", "2"]) == 0
    assert latest_checkpoint(tmp_path / "run").name == "ckpt-00000002"
    assert main(args + ["--steps", "4", "--resume"]) == 0
    return tmp_path / "run", src


def test_train_command_writes_a_resumable_run(cli_run):
    import xarray as xr

    from workbench.train import load_model

    run, _ = cli_run
    ds = xr.open_dataset(run / "metrics.nc", engine="h5netcdf")
    assert ds.sizes["step"] == 4 and ds.loss.isel(step=-1) < ds.loss.isel(step=0)
    assert load_model(run).cfg.vocab_size <= 300


def test_train_command_writes_the_one_run_layout(cli_run):
    """config.json, tokenizer.json, latest.json + ckpt-*, metrics.nc and results.nc, all in --out."""
    import json

    from workbench.data.corpus import Tokenizer

    run, src = cli_run
    names = {p.name for p in run.iterdir()}
    assert {"config.json", "tokenizer.json", "latest.json", "ckpt-00000004", "metrics.nc", "results.nc"} <= names
    conf = json.loads((run / "config.json").read_text())
    assert conf["data"]["corpus"] == f"path:{src}" and conf["data"]["tasks"] == []
    assert conf["model"]["d_model"] == 32 and conf["train"]["steps"] == 4
    assert conf["data"]["vocab_size"] == Tokenizer.load(run / "tokenizer.json").vocab_size == conf["model"]["vocab_size"]


def test_a_cli_run_opens_with_load_run_and_open_run(cli_run):
    """load_run, open_run on the run folder and open_run on its checkpoint folder give the same model."""
    import torch

    from workbench.experiments import load_run
    from workbench.io import find_run, open_run

    run, _ = cli_run
    again = load_run(run, device="cpu")
    model, tok = open_run(run)
    ckpt_model, ckpt_tok = open_run(run / "ckpt-00000004")
    assert find_run(run / "ckpt-00000004") == (run, run / "ckpt-00000004")
    assert tok.fingerprint == again.tokenizer.fingerprint == ckpt_tok.fingerprint
    ids = torch.tensor([tok.encode("the loop12 refines state7")])
    with torch.no_grad():
        ref = again.model(ids, loops=3).logits
        torch.testing.assert_close(model(ids, loops=3).logits, ref, rtol=0, atol=0)
        torch.testing.assert_close(ckpt_model(ids, loops=3).logits, ref, rtol=0, atol=0)
    # the run knows its corpus, so the sweep notebooks get held-out text
    assert again.val_tokens(2, 16).shape == (2, 17)


def test_loop_sweep_notebook_runs_on_a_cli_run(cli_run, tmp_path):
    import nbformat
    import numpy as np
    import papermill
    import xarray as xr

    run, _ = cli_run
    root = Path(__file__).resolve().parent.parent
    papermill.execute_notebook(str(root / "notebooks" / "loop_sweep.ipynb"), str(tmp_path / "out.ipynb"),
                               parameters={"checkpoint": str(run), "max_loops": 4, "n_sequences": 2,
                                           "seq_len": 16}, cwd=str(tmp_path), kernel_name="python3",
                               progress_bar=False)
    nb = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert not [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    ds = xr.load_dataset(tmp_path / "results.nc", engine="h5netcdf")
    assert list(ds.loop.values) == [1, 2, 3, 4] and np.isfinite(ds.loss.values).all()
