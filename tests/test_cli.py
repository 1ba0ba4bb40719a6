import math

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


def test_train_command_writes_a_resumable_run(tmp_path):
    import json

    import xarray as xr

    from workbench.train import latest_checkpoint, load_model

    src = tmp_path / "text"
    src.mkdir()
    import random

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
    assert main(args + ["--steps", "2"]) == 0
    assert latest_checkpoint(tmp_path / "run").name == "ckpt-00000002"
    assert main(args + ["--steps", "4", "--resume"]) == 0
    ds = xr.open_dataset(tmp_path / "run" / "metrics.nc", engine="h5netcdf")
    assert ds.sizes["step"] == 4 and ds.loss.isel(step=-1) < ds.loss.isel(step=0)
    assert load_model(tmp_path / "run").cfg.vocab_size <= 300
