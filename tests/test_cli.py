from pathlib import Path
from types import SimpleNamespace

import pytest

from workbench.cli import demo, main


def test_demo_learns_and_reports_every_loop_count(capsys, monkeypatch, demo_trained):
    import numpy as np
    import workbench.experiments

    from helpers import DEMO_STEPS, byte_unigram_entropy
    from workbench.data.corpus import stdlib_bytes

    def trained(steps, seed, progress):  # the session's demo model (conftest): trained once, shared
        assert (steps, seed) == (DEMO_STEPS, 0)
        return demo_trained

    monkeypatch.setattr(workbench.experiments, "demo_trainer", trained)
    losses = demo(steps=DEMO_STEPS, seed=0, max_loops=5, progress=False)
    assert sorted(losses) == [1, 2, 3, 4, 5]
    # below what any model blind to context can reach: the byte unigram entropy of the validation text
    # (3.09 nats; 25 steps reach about 2.6 at K = 4), and looping to K helps
    data = np.frombuffer(stdlib_bytes(2_000_000), dtype=np.uint8)
    assert losses[4] < byte_unigram_entropy(data[int(0.95 * len(data)):]) - 0.3, losses
    assert losses[4] < losses[1], losses
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
    from workbench.io import latest_checkpoint
    from workbench.train import Trainer

    assert main(args + ["--steps", "2"]) == 0
    assert latest_checkpoint(tmp_path / "run").name == "ckpt-00000002"
    real, calls = Trainer.train_step, []

    def step(self):  # records the step each training step starts at
        calls.append(self.step)
        return real(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "train_step", step)
        assert main(args + ["--steps", "4", "--resume"]) == 0
    # the reference: the same command run straight to 4 steps (warmup 10 > 4 steps, so the learning
    # rate does not depend on the total and 2 + 2 steps must equal 4 bit for bit)
    straight = [a if a != str(tmp_path / "run") else str(tmp_path / "straight") for a in args]
    assert main(straight + ["--steps", "4"]) == 0
    return SimpleNamespace(run=tmp_path / "run", src=src, resumed_steps=calls, straight=tmp_path / "straight")


def test_train_command_writes_a_resumable_run(cli_run):
    """--resume trains only the missing steps and ends bit-identical to an uninterrupted run."""
    import xarray as xr

    from workbench.io import load_model

    run, straight = cli_run.run, cli_run.straight
    assert cli_run.resumed_steps == [2, 3]  # not 4 steps retrained from scratch, which would also match
    for name in ("model.safetensors", "optim.safetensors"):
        assert (run / "ckpt-00000004" / name).read_bytes() == (straight / "ckpt-00000004" / name).read_bytes(), name
    a, b = (xr.load_dataset(d / "metrics.nc", engine="h5netcdf") for d in (straight, run))
    for var in ("loss", "lr", "grad_norm", "loops"):
        assert a[var].values.tolist() == b[var].values.tolist(), var
    assert b.sizes["step"] == 4 and load_model(run).cfg.vocab_size <= 300


def test_train_command_writes_the_one_run_layout(cli_run):
    """config.json, tokenizer.json, latest.json + ckpt-*, metrics.nc and results.nc, all in --out."""
    import json

    from workbench.data.corpus import Tokenizer

    run, src = cli_run.run, cli_run.src
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
    from workbench.io import find_run, load_model, open_run

    run = cli_run.run
    again = load_run(run, device="cpu")
    model, tok = open_run(run)
    ckpt_model, ckpt_tok = open_run(run / "ckpt-00000004")
    assert find_run(run / "ckpt-00000004") == (run, run / "ckpt-00000004")
    assert tok.fingerprint == again.tokenizer.fingerprint == ckpt_tok.fingerprint
    ids = torch.tensor([tok.encode("the loop12 refines state7")])
    with torch.no_grad():
        ref = again.model(ids, loops=3).logits
        for other in (model, ckpt_model, load_model(run), load_model(run / "ckpt-00000004")):
            torch.testing.assert_close(other(ids, loops=3).logits, ref, rtol=0, atol=0)
    # the run knows its corpus, so the sweep notebooks get held-out text
    assert again.val_tokens(2, 16).shape == (2, 17)


def test_a_cli_run_opens_in_the_explorer(cli_run):
    """The explorer, given the run folder, shows the run's model with its tokenizer: the same logits."""
    pytest.importorskip("ipywidgets")
    import torch

    from workbench.experiments import load_run
    from workbench.viz.explorer import LoopExplorer

    again = load_run(cli_run.run, device="cpu")
    ex = LoopExplorer(str(cli_run.run), text="the loop12 refines state7", max_loops=3, device="cpu")
    assert ex.message == "" and ex.tokenizer.fingerprint == again.tokenizer.fingerprint
    ids = torch.tensor([again.tokenizer.encode("the loop12 refines state7")])
    assert list(ex.view.token_id.values) == ids[0].tolist()
    with torch.no_grad():
        for r in (1, 3):
            torch.testing.assert_close(ex.model(ids, loops=r).logits, again.model(ids, loops=r).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_loop_sweep_notebook_runs_on_a_cli_run(cli_run, tmp_path):
    import nbformat
    import numpy as np
    import papermill
    import xarray as xr

    from workbench.pipeline.execute import socket_kernel_manager_class

    run = cli_run.run
    root = Path(__file__).resolve().parent.parent
    papermill.execute_notebook(str(root / "notebooks" / "loop_sweep.ipynb"), str(tmp_path / "out.ipynb"),
                               parameters={"checkpoint": str(run), "max_loops": 4, "n_sequences": 2,
                                           "seq_len": 16}, cwd=str(tmp_path), kernel_name="python3",
                               progress_bar=False, kernel_manager_class=socket_kernel_manager_class())
    nb = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert not [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    ds = xr.load_dataset(tmp_path / "results.nc", engine="h5netcdf")
    assert list(ds.loop.values) == [1, 2, 3, 4] and np.isfinite(ds.loss.values).all()
    # the notebook (its own kernel) saw the run's model and held-out windows: loop_sweep here agrees
    from workbench.evals import loop_sweep
    from workbench.experiments import load_run

    again = load_run(run, device="cpu")
    here = loop_sweep(again.model, again.val_tokens(2, 16, seed=0), [1, 2, 3, 4], progress=False)
    np.testing.assert_allclose(ds.loss.values, here.loss.values, rtol=1e-5)
    np.testing.assert_array_equal(ds.accuracy.values, here.accuracy.values)
