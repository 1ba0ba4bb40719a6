"""Nothing lost, nothing silently accepted: divergence, overwrite refusal, signals and resume, refused resumes.

Each test drives the real entry points (`workbench train` through `cli.main`, the Trainer, the pipeline
runner) on tiny models and a small text corpus.
"""

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

from workbench import LoopConfig
from workbench.cli import main
from workbench.locking import RunLock
from workbench.io import RunDir, latest_checkpoint, load_tensors, open_run
from workbench.train import CHANCE_STEPS, Diverged, Trainer, TrainConfig

CFG = LoopConfig(vocab_size=256, d_model=32, n_heads=4, n_kv_heads=2, prelude=1, core=1, coda=1, loops=2,
                 max_seq_len=64)
TINY = {"d_model": 16, "n_heads": 2, "prelude": 0, "core": 1, "coda": 1, "loops": 2, "max_seq_len": 128}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small folder of text (about 60k tokens) and a tiny model config file."""
    root = tmp_path_factory.mktemp("reliability")
    src = root / "text"
    src.mkdir()
    rng = random.Random(0)
    words = ["loop", "state", "core", "prelude", "coda", "refines", "the", "a", "token", "depth"]
    for i in range(20):
        (src / f"{i}.txt").write_text(" ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(600)))
    model = root / "model.json"
    model.write_text(json.dumps(TINY))
    return src, model


def cli_args(out, corpus, *extra):
    src, model = corpus
    return ["train", "--out", str(out), "--corpus", f"path:{src}", "--vocab-size", "300", "--config", str(model),
            "--no-progress", *map(str, extra)]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Return every file under folder (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def all_finite(ckpt: Path) -> bool:
    """Return True when every tensor of a checkpoint's model and optimiser files is finite."""
    tensors = {**load_tensors(ckpt / "model.safetensors"), **load_tensors(ckpt / "optim.safetensors")}
    return all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())


def byte_data(n=30000, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.uint16)


# ---- divergence -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checkpoint_every", [1, 0])
def test_divergence_at_step_n_keeps_only_finite_checkpoints_and_names_n(tmp_path, checkpoint_every):
    """An update that makes a weight infinite at step 3: stopped, step 3 named, nothing non-finite saved.

    With checkpoint_every=1 the check before saving step 3 catches it; with no checkpoint due, the
    next step's loss does, and the step whose update did it (3) is still the one named.
    """
    tc = TrainConfig(steps=6, batch_size=4, seq_len=32, checkpoint_every=checkpoint_every, checkpoint_seconds=0,
                     keep_checkpoints=10, progress=False)
    trainer = Trainer(CFG, tc, byte_data(), out_dir=tmp_path)
    opt = trainer.opts[-1]
    real = opt.step

    def poisoned_step(*a, **kw):
        out = real(*a, **kw)
        if trainer.step == 2:  # the update of step 3 (1-based): two steps were done before it
            with torch.no_grad():
                trainer.model.norm.weight[0] = float("inf")
        return out

    opt.step = poisoned_step
    with pytest.raises(Diverged, match=r"diverged at step 3 of 6: after its update, parameter norm.weight") as e:
        trainer.run()
    assert e.value.step == 3
    names = sorted(p.name for p in tmp_path.glob("ckpt-*"))
    assert names == (["ckpt-00000001", "ckpt-00000002"] if checkpoint_every else [])
    assert all(all_finite(tmp_path / n) for n in names)
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["failed"]["step"] == 3 and "step 3" in latest["failed"]["error"]
    assert latest["checkpoint"] == (names[-1] if names else None)
    if names:
        assert f"{tmp_path / names[-1]} (step 2)" in str(e.value)
        open_run(tmp_path)  # the last finite checkpoint still opens
    else:
        with pytest.raises(FileNotFoundError, match="training failed at step 3 before the first"):
            open_run(tmp_path)
    ds = xr.load_dataset(tmp_path / "metrics.nc", engine="h5netcdf")
    assert ds.sizes["step"] == 3 and "step 3" in ds.attrs["failed"]  # the metrics up to the failure


def test_diverged_cli_run_exits_non_zero_and_saves_nothing_non_finite(tmp_path, corpus, capsys, monkeypatch):
    """The issue's repro: lr 1e30 without clipping. It used to save NaN weights and exit 0."""
    monkeypatch.setenv("WORKBENCH_BEYOND_LIMITS", "1")  # lr past its limit (10), on purpose
    tc = tmp_path / "tc.json"
    tc.write_text(json.dumps({"batch_size": 4, "seq_len": 32, "eval_batches": 1, "lr": 1e30, "muon": False,
                              "grad_clip": 0, "checkpoint_every": 1, "keep_checkpoints": 10}))
    assert main(cli_args(tmp_path / "dv", corpus, "--train-config", tc, "--steps", 4)) == 1
    err = capsys.readouterr().err
    assert "training diverged at step 2 of 4" in err and len(err.strip().splitlines()) == 1
    ckpts = sorted((tmp_path / "dv").glob("ckpt-*"))
    assert [p.name for p in ckpts] == ["ckpt-00000001"] and all(all_finite(p) for p in ckpts)
    assert json.loads((tmp_path / "dv" / "latest.json").read_text())["failed"]["step"] == 2
    assert not (tmp_path / "dv" / "results.nc").exists()  # the run is not complete


@pytest.mark.slow
def test_a_diverged_pipeline_step_fails_and_blocks_its_dependants(tmp_path, monkeypatch):
    from workbench import pipeline

    monkeypatch.setenv("WORKBENCH_BEYOND_LIMITS", "1")  # lr past its limit (10), on purpose; kernels inherit it

    spec = tmp_path / "div.yaml"
    spec.write_text(textwrap.dedent("""\
        name: div
        steps:
          - name: train
            notebook: train
            params: {steps: 3, d_model: 16, n_heads: 2, n_kv_heads: 1, loops: 2, vocab_size: 300, seq_len: 16,
                     batch_size: 2, eval_loops: [1, 2], lr: 1.0e+30, corpus: "path:TEXT"}
          - name: sweep
            notebook: loop_sweep
            each: {train: checkpoint}
            params: {max_loops: 2, n_sequences: 2, seq_len: 16, n_task_examples: 2}
        """).replace("TEXT", str(tmp_path / "text.txt")))
    (tmp_path / "text.txt").write_text("the loop refines the state; the core is tied. " * 400)
    result = pipeline.run(spec, runs_dir=tmp_path / "runs", report_html=False, log=None)
    assert not result.ok
    (train,), (sweep,) = ([r for r in result.records if r["step"] == s] for s in ("train", "sweep"))
    assert train["status"] == "failed" and "Diverged: training diverged at step" in train["error"]
    assert sweep["status"] == "blocked" and not (tmp_path / "runs" / "div" / "sweep").exists()
    folder, = pipeline.find_runs("div", "train", tmp_path / "runs", state="failed")
    assert "failed" in json.loads((folder / "latest.json").read_text())


def test_loss_at_chance_level_is_warned_in_the_log_and_the_metrics(caplog):
    from workbench.data.corpus import stdlib_bytes

    text = np.frombuffer(stdlib_bytes(200_000), dtype=np.uint8).astype(np.uint16)
    steps = 2 + CHANCE_STEPS + 5
    warned = {}
    for lr in (1e-9, 1e-2):  # far too low never leaves ln V; a sane lr learns and stays quiet
        caplog.clear()
        tc = TrainConfig(steps=steps, batch_size=4, seq_len=32, lr=lr, warmup=2, progress=False)
        with caplog.at_level(logging.WARNING, logger="workbench.train"):
            ds = Trainer(CFG, tc, text).run()
        warned[lr] = ds.attrs["warnings"]
        assert ("loss at chance level" in caplog.text) == ("loss at chance level" in ds.attrs["warnings"])
    assert "loss at chance level" in warned[1e-9] and "ln(vocab_size=256)" in warned[1e-9]
    assert warned[1e-2] == ""


def test_checkpoints_come_by_time_as_well_as_by_steps(tmp_path):
    tc = TrainConfig(steps=4, batch_size=4, seq_len=32, checkpoint_seconds=1e-9, keep_checkpoints=10, progress=False)
    Trainer(CFG, tc, byte_data(), out_dir=tmp_path / "t").run()
    assert sorted(p.name for p in (tmp_path / "t").glob("ckpt-*")) == [f"ckpt-0000000{i}" for i in (1, 2, 3, 4)]
    tc = TrainConfig(steps=4, batch_size=4, seq_len=32, checkpoint_seconds=0, progress=False)
    Trainer(CFG, tc, byte_data(), out_dir=tmp_path / "off").run()
    assert [p.name for p in (tmp_path / "off").glob("ckpt-*")] == ["ckpt-00000004"]
    assert TrainConfig(steps=1).checkpoint_seconds > 0  # on by default, so a killed default run can resume


# ---- a run folder is never overwritten silently --------------------------------------------------------------------
def test_train_out_on_an_existing_run_is_refused_and_the_run_stays_byte_for_byte(tmp_path, corpus, capsys):
    from workbench.experiments import train_run

    run = tmp_path / "run"
    tc = tmp_path / "tc.json"
    tc.write_text(json.dumps({"batch_size": 4, "seq_len": 32, "eval_batches": 1}))
    assert main(cli_args(run, corpus, "--train-config", tc, "--steps", 2)) == 0
    before = snapshot(run)
    assert {"config.json", "tokenizer.json", "latest.json", "ckpt-00000002/model.safetensors"} <= set(before)
    for extra in ([], ["--steps", 3], ["--vocab-size", 400, "--seed", 1]):
        assert main(cli_args(run, corpus, "--train-config", tc, *extra)) == 2
        assert "--out=" in capsys.readouterr().err
        assert snapshot(run) == before
    with pytest.raises(FileExistsError, match="already holds a run"):
        train_run(run, TINY, {"steps": 2, "batch_size": 4, "seq_len": 32}, corpus=f"path:{corpus[0]}",
                  vocab_size=300, resume=False)
    with pytest.raises(FileExistsError, match="already holds a run"):
        Trainer(CFG, TrainConfig(steps=2, batch_size=4, seq_len=32), byte_data(), out_dir=run)
    assert snapshot(run) == before
    # --overwrite replaces it: a new tokenizer, and no checkpoint of the old run left behind
    assert main(cli_args(run, corpus, "--train-config", tc, "--steps", 3, "--vocab-size", 400, "--overwrite")) == 0
    after = snapshot(run)
    assert after["tokenizer.json"] != before["tokenizer.json"]
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-00000003"]


def test_a_half_overwritten_run_folder_does_not_load(tmp_path, corpus):
    """An old checkpoint beside another run's tokenizer (an overwrite killed midway, or a copy) is refused."""
    tc = tmp_path / "tc.json"
    tc.write_text(json.dumps({"batch_size": 4, "seq_len": 32, "eval_batches": 1}))
    for name, vocab in (("a", 300), ("b", 400)):
        src, model = corpus
        assert main(["train", "--out", str(tmp_path / name), "--corpus", f"path:{src}", "--vocab-size", str(vocab),
                     "--config", str(model), "--train-config", str(tc), "--steps", "1", "--no-progress"]) == 0
    (tmp_path / "a" / "tokenizer.json").write_bytes((tmp_path / "b" / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=r"tokenizer.json is not the tokenizer.json that ckpt-00000001 was trained"):
        open_run(tmp_path / "a")
    with pytest.raises(ValueError, match="tokenizer.json is not"):
        open_run(tmp_path / "a" / "ckpt-00000001")


# ---- resume by default: signals save, then resume is bit-identical ----------------------------------------------
SIGNALLER = textwrap.dedent("""
    import os, signal, sys
    import workbench.train as T
    sig, at = getattr(signal, sys.argv[1]), int(sys.argv[2])
    # as in a foreground terminal: a test run started in the background (`cmd &`, nohup) inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    real = T.Trainer.train_step
    def step(self):
        loss = real(self)
        if self.step == at:
            os.kill(os.getpid(), sig)  # a real signal, delivered mid-run
        return loss
    T.Trainer.train_step = step
    from workbench.cli import main
    sys.exit(main(sys.argv[3:]))
""")


def fresh_env() -> dict:
    """Return the environment of the byte-compared runs: one thread each (1 against 2 threads differs in the last bits)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """An uninterrupted default-settings run of 6 steps (only the step count is given)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    # a fresh process, like the signalled and resumed runs it is compared with byte for byte: this process's
    # global torch state (set by earlier tests) must not decide the last bits (a CI run on a CPU without AMX
    # saw Muon's momentum differ when the straight run shared the test process)
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", *cli_args(out, corpus, "--steps", 6)],
                          capture_output=True, text=True, timeout=300, env=fresh_env())
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", -signal.SIGTERM)])
def test_a_signal_saves_and_resume_ends_bit_identical(sig, code, corpus, straight, tmp_path):
    script = tmp_path / "signaller.py"
    script.write_text(SIGNALLER)
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), sig, "3", *cli_args(run, corpus, "--steps", 6)],
                          capture_output=True, text=True, timeout=300, env=fresh_env())
    assert proc.returncode == code, proc.stderr
    assert f"{sig} at step 3 of 6: checkpoint" in proc.stderr
    assert latest_checkpoint(run).name == "ckpt-00000003"
    resumed = subprocess.run([sys.executable, "-m", "workbench.cli", *cli_args(run, corpus, "--steps", 6, "--resume")],
                             capture_output=True, text=True, timeout=300, env=fresh_env())
    assert resumed.returncode == 0, resumed.stderr
    for name in ("model.safetensors", "optim.safetensors"):
        assert (run / "ckpt-00000006" / name).read_bytes() == (straight / "ckpt-00000006" / name).read_bytes(), name
    a, b = (xr.load_dataset(d / "metrics.nc", engine="h5netcdf") for d in (straight, run))
    for var in ("loss", "lr", "grad_norm", "loops"):
        assert a[var].values.tolist() == b[var].values.tolist(), var


# ---- a signal at any phase saves: a training step (above), a checkpoint write, the final evaluation ----------------
PHASER = textwrap.dedent("""
    import os, signal, sys
    import workbench.train.checkpoint as C
    import workbench.train.trainer as T
    sig, phase = getattr(signal, sys.argv[1]), sys.argv[2]
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground terminal
    if phase == "evaluation":  # the final evaluation (the only one: no eval_every)
        real = T.Trainer.evaluate
        def evaluate(self):
            os.kill(os.getpid(), sig)
            return real(self)
        T.Trainer.evaluate = evaluate
    else:  # the final checkpoint's write
        real = C.save_checkpoint
        def save(*a, **kw):
            os.kill(os.getpid(), sig)
            return real(*a, **kw)
        C.save_checkpoint = save
    from workbench.cli import main
    sys.exit(main(sys.argv[3:]))
""")


@pytest.mark.parametrize("sig, code, phase", [("SIGTERM", -signal.SIGTERM, "evaluation"),
                                              ("SIGINT", 130, "evaluation"), ("SIGTERM", -signal.SIGTERM, "checkpoint")])
def test_a_signal_in_the_final_evaluation_or_checkpoint_write_saves_the_checkpoint_and_metrics(sig, code, phase,
                                                                                               corpus, tmp_path):
    script = tmp_path / "phaser.py"
    script.write_text(PHASER)
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), sig, phase, *cli_args(run, corpus, "--steps", 3)],
                          capture_output=True, text=True, timeout=300, env=fresh_env())
    assert proc.returncode == code, proc.stderr
    assert f"{sig} at step 3 of 3: checkpoint" in proc.stderr, proc.stderr
    assert latest_checkpoint(run).name == "ckpt-00000003" and all_finite(run / "ckpt-00000003")
    metrics = xr.load_dataset(RunDir(run).metrics, engine="h5netcdf")
    assert metrics.sizes["step"] == 3 and np.isfinite(metrics.loss.values).all()
    open_run(run)  # the folder is one consistent run


def test_a_second_training_on_a_folder_in_use_is_refused_naming_the_first_even_with_overwrite(corpus, tmp_path):
    run = tmp_path / "run"
    # the first training: long enough to be running while the second starts; stopped by SIGTERM at the end
    first = subprocess.Popen([sys.executable, "-m", "workbench.cli", *cli_args(run, corpus, "--steps", 100000)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=fresh_env())
    try:
        deadline = time.monotonic() + 240
        while not (RunLock.busy(run) and RunDir(run).config.exists()):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        config = RunDir(run).config.read_bytes()
        second = subprocess.run([sys.executable, "-m", "workbench.cli",
                                 *cli_args(run, corpus, "--steps", 6, "--overwrite", "--seed", 1)],
                                capture_output=True, text=True, timeout=300, env=fresh_env())
        assert second.returncode == 2, second.stderr
        assert "being written by another process" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr
        assert RunDir(run).config.read_bytes() == config  # nothing of the second run was written
    finally:  # SIGTERM: a test run started in the background (nohup, CI) may inherit SIGINT ignored
        first.send_signal(signal.SIGTERM)
        try:
            _, err = first.communicate(timeout=240)
        finally:
            first.kill()  # never leave a 100,000-step training behind a failed assertion
    assert first.returncode == -signal.SIGTERM, err
    model, _ = open_run(run)  # one run, whole: its own config, tokenizer and checkpoint
    assert json.loads(RunDir(run).config.read_text())["train"]["seed"] == 0


def test_resuming_from_damaged_weights_names_the_file_instead_of_diverging(tmp_path):
    tc = TrainConfig(steps=2, batch_size=4, seq_len=32, progress=False)
    Trainer(CFG, tc, byte_data(), out_dir=tmp_path).run()
    weights = latest_checkpoint(tmp_path) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) * 3 // 4] ^= 0xFF  # one flipped byte: still a readable safetensors file
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model.safetensors is damaged: its hash differs"):
        Trainer(CFG, TrainConfig(steps=4, batch_size=4, seq_len=32, progress=False), byte_data(), out_dir=tmp_path,
                resume=True)
    assert not RunLock.busy(tmp_path)  # the refused Trainer gave the folder's lock back


def test_resume_of_a_folder_without_a_run_is_refused_instead_of_starting_fresh(corpus, tmp_path, capsys):
    for out in (tmp_path / "typo", tmp_path):
        assert main(cli_args(out, corpus, "--steps", 2, "--resume")) == 2
        err = capsys.readouterr().err
        assert f"--out='{out}' is invalid: holds no run to resume" in err, err
    assert not (tmp_path / "typo").exists() and not RunDir(tmp_path).config.exists()


def test_a_json_key_given_twice_is_refused_naming_it(corpus, tmp_path, capsys):
    cfg = tmp_path / "model.json"
    cfg.write_text('{"d_model": 16, "n_heads": 2, "d_model": 32}')
    assert main(cli_args(tmp_path / "run", corpus, "--steps", 2, "--config", str(cfg))) == 2
    err = capsys.readouterr().err
    assert "--config=" in err and "duplicate key 'd_model'" in err, err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="duplicate key 'loops'"):
        LoopConfig.from_json('{"loops": 2, "loops": 3}')


def test_a_folder_holding_someones_metrics_or_results_is_refused_unless_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    mine = {name: f"my own {name}".encode() for name in (RunDir.METRICS, RunDir.RESULTS)}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    assert main(cli_args(out, corpus, "--steps", 2)) == 2
    err = capsys.readouterr().err
    assert f"holds {RunDir.METRICS}, {RunDir.RESULTS} that no run of this folder wrote" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == mine  # nothing written, nothing changed
    tc = TrainConfig(steps=1, batch_size=4, seq_len=32, progress=False)
    with pytest.raises(FileExistsError, match=f"holds {RunDir.METRICS}"):  # the Trainer alone refuses too
        Trainer(CFG, tc, byte_data(), out_dir=out)
    assert main(cli_args(out, corpus, "--steps", 2, "--overwrite")) == 0  # asked: replaced by the run's own
    assert xr.load_dataset(RunDir(out).metrics, engine="h5netcdf").sizes["step"] == 2


# ---- resume refuses another seed, data or config ---------------------------------------------------------------------
@pytest.mark.parametrize("extra, named", [
    (["--seed", "1"], "train.seed: 0 then, 1 now"),
    (["--vocab-size", "400"], "data.vocab_request: 300 then, 400 now"),
    (["--corpus", "stdlib"], "data.corpus"),
    (["--config", "{other}"], "model.d_model: 16 then, 32 now"),
    (["--train-config", "{lr}"], "train.lr: 0.003 then, 0.01 now"),
])
def test_resume_with_another_seed_data_or_config_is_refused_naming_the_fields(extra, named, corpus, straight,
                                                                              tmp_path, capsys):
    (tmp_path / "other.json").write_text(json.dumps({**TINY, "d_model": 32}))
    (tmp_path / "lr.json").write_text(json.dumps({"lr": 0.01}))
    extra = [a.replace("{other}", str(tmp_path / "other.json")).replace("{lr}", str(tmp_path / "lr.json"))
             for a in extra]
    before = snapshot(straight)
    assert main(cli_args(straight, corpus, "--steps", 6, "--resume", *extra)) == 2  # a later flag wins
    err = capsys.readouterr().err
    assert "cannot resume" in err and named in err, err
    assert snapshot(straight) == before


def test_the_trainer_refuses_to_resume_on_other_data_or_seed(tmp_path):
    tc = TrainConfig(steps=2, batch_size=4, seq_len=32, progress=False)
    Trainer(CFG, tc, byte_data(), out_dir=tmp_path).run()
    with pytest.raises(ValueError, match="other train data"):
        Trainer(CFG, TrainConfig(steps=4, batch_size=4, seq_len=32), byte_data(seed=5), out_dir=tmp_path, resume=True)
    with pytest.raises(ValueError, match=r"Differing fields \(checkpoint, now\): \{'seed': \(0, 1\)\}"):
        Trainer(CFG, TrainConfig(steps=4, batch_size=4, seq_len=32, seed=1), byte_data(), out_dir=tmp_path,
                resume=True)


def test_the_trainer_replaces_its_run_only_when_asked(tmp_path):
    tc = TrainConfig(steps=2, batch_size=4, seq_len=32, progress=False, keep_checkpoints=5, checkpoint_every=1)
    Trainer(CFG, tc, byte_data(), out_dir=tmp_path).run()
    (tmp_path / "tokenizer.json").write_text("{}")  # written for the run by whoever made it: it stays
    with pytest.raises(FileExistsError, match="resume=True to continue it or overwrite=True"):
        Trainer(CFG, TrainConfig(steps=1, batch_size=4, seq_len=32), byte_data(), out_dir=tmp_path)
    Trainer(CFG, TrainConfig(steps=1, batch_size=4, seq_len=32, progress=False), byte_data(seed=1), out_dir=tmp_path,
            overwrite=True).run()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-00000001"]
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == 1
    assert (tmp_path / "tokenizer.json").read_text() == "{}"
