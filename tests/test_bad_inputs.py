"""A table of bad inputs, one parametrized test per surface: each bad value must get an error that names
the field (or file) and the value, before any work is done.

Surfaces: LoopConfig, TrainConfig, `workbench train` (flags and config files), pipeline parameters, the
model's forward, and a run folder's files. The number of cases is recorded in the README's reliability
section (`BAD_INPUTS` below counts them).
"""

import json
import shutil
import textwrap

import pytest
import torch

from workbench import LoopConfig, LoopLM
from workbench.train import TrainConfig

from helpers import cfg as tiny_cfg

INF, NAN = float("inf"), float("nan")

# (field, bad value): LoopConfig(**{field: value}) must fail naming both
LOOP_CONFIG = [
    ("tie_embeddings", "false"), ("sandwich_norm", "yes"), ("hyper_dynamic", 2), ("attn_bias", 1),
    ("d_ff", True), ("d_ff", 0), ("rope_theta", INF), ("init_std", INF), ("norm_eps", NAN), ("norm_eps", 0.0),
    ("taper_start", "1.5"), ("vocab_size", 0), ("vocab_size", 4096.0), ("d_model", "256"), ("n_heads", 3),
    ("n_kv_heads", True), ("n_kv_heads", 3), ("loops", 0), ("loops", -1), ("prelude", -1), ("core", 0),
    ("max_seq_len", 0), ("inject", "Dense"), ("inject", None), ("history", -1), ("history_op", 1),
    ("timestep", "adaLN"), ("hyper", 0), ("taper", "linear"), ("taper_multiple", 0), ("adapter_rank", -1),
]

# (field in the message, keyword arguments): TrainConfig(steps=1, **kw) must fail naming field and value
TRAIN_CONFIG = [
    ("lr", {"lr": "0.01"}), ("lr", {"lr": INF}), ("lr", {"lr": 0.0}), ("lr", {"lr": NAN}),
    ("eval_loops[0]", {"eval_loops": [0, 2]}), ("eval_loops[0]", {"eval_loops": ["a"]}),
    ("eval_loops[1]", {"eval_loops": [1, 2.5]}), ("eval_loops", {"eval_loops": 4}), ("eval_loops", {"eval_loops": []}),
    ("steps", {"steps": 0}), ("steps", {"steps": -5}), ("steps", {"steps": 2.0}), ("steps", {"steps": True}),
    ("flops", {"steps": None, "flops": -1.0}), ("flops", {"steps": None, "flops": INF}),
    ("tokens", {"steps": None, "tokens": 0}), ("chinchilla", {"chinchilla": "yes"}),
    ("muon", {"muon": "no"}), ("compile", {"compile": 1}), ("progress", {"progress": "false"}), ("bf16", {"bf16": 1}),
    ("grad_clip", {"grad_clip": NAN}), ("grad_clip", {"grad_clip": -1.0}), ("weight_decay", {"weight_decay": -0.1}),
    ("min_lr_ratio", {"min_lr_ratio": 2.0}), ("decay_frac", {"decay_frac": 0.0}), ("loop_sigma", {"loop_sigma": 0}),
    ("warmup", {"warmup": -1}), ("batch_size", {"batch_size": 0}), ("seq_len", {"seq_len": "128"}),
    ("seed", {"seed": -1}), ("checkpoint_every", {"checkpoint_every": -1}),
    ("checkpoint_seconds", {"checkpoint_seconds": INF}), ("keep_checkpoints", {"keep_checkpoints": 0}),
    ("device", {"device": "gpu"}), ("device", {"device": 0}), ("schedule", {"schedule": "linear"}),
    ("loop_sampler", {"loop_sampler": "poisson"}), ("loop_max", {"loop_min": 3, "loop_max": 2}),
    ("backward_loops", {"loops": 2, "backward_loops": 3}), ("loop1_distill", {"loop1_distill": -0.5}),
    ("loop1_distill", {"loop1_distill": INF}),
]


@pytest.mark.parametrize("field, value", LOOP_CONFIG, ids=[f"{f}={v!r}" for f, v in LOOP_CONFIG])
def test_loop_config_names_the_field_and_value(field, value):
    with pytest.raises(ValueError) as e:
        tiny_cfg(**{field: value})
    assert f"LoopConfig.{field}={value!r}" in str(e.value), str(e.value)
    assert "invalid" in str(e.value)


@pytest.mark.parametrize("field, kw", TRAIN_CONFIG, ids=[f"{f}:{kw}" for f, kw in TRAIN_CONFIG])
def test_train_config_names_the_field_and_value(field, kw):
    with pytest.raises(ValueError) as e:
        TrainConfig(**{"steps": 1, **kw})
    name, _, index = field.partition("[")
    value = kw[name][int(index.rstrip("]"))] if index else kw[name]  # eval_loops[1] names the element
    assert f"TrainConfig.{field}={value!r}" in str(e.value), str(e.value)


# ---- workbench train: flags and config files -------------------------------------------------------------------
TINY_MODEL = {"d_model": 16, "n_heads": 2, "prelude": 0, "core": 1, "coda": 1, "loops": 2, "max_seq_len": 64}

# (what the one-line error must contain, extra argv, model config, train config); `{dir}` is the temp folder
CLI = [
    ("--steps=0", ["--steps", "0"], None, None),
    ("--steps=-3", ["--steps", "-3"], None, None),
    ("--seed=-1", ["--seed", "-1"], None, None),
    ("vocab_size=10", ["--vocab-size", "10"], None, None),
    ("corpus='stdlb'", ["--corpus", "stdlb"], None, None),
    ("corpus='stdlib[:0]'", ["--corpus", "stdlib[:0]"], None, None),
    ("--config='{dir}/missing.json'", ["--config", "{dir}/missing.json"], None, None),
    ("--train-config='{dir}/train.json'", [], None, "[1, 2]"),  # a JSON list, not an object
    ("--train-config='{dir}/train.json'", [], None, '{"lr": 0.01,'),  # truncated JSON
    ("--config='{dir}/model.json'", [], '{"d_model": 16', None),
    ("TrainConfig.eval_loops[0]=0", [], None, {"eval_loops": [0, 2]}),
    ("TrainConfig.eval_loops[0]='a'", [], None, {"eval_loops": ["a"]}),
    ("TrainConfig.lr='0.01'", [], None, {"lr": "0.01"}),
    ("TrainConfig.steps=0", [], None, {"steps": 0}),
    ("TrainConfig.flops=-1.0", [], None, {"flops": -1.0}),
    ("TrainConfig has no field(s) ['lerning_rate']", [], None, {"lerning_rate": 0.1}),
    ("LoopConfig.tie_embeddings='false'", [], {"tie_embeddings": "false"}, None),
    ("LoopConfig.sandwich_norm='yes'", [], {"sandwich_norm": "yes"}, None),
    ("LoopConfig.hyper_dynamic=2", [], {"hyper_dynamic": 2}, None),
    ("LoopConfig.d_ff=True", [], {"d_ff": True}, None),
    ("LoopConfig.rope_theta=inf", [], {"rope_theta": INF}, None),
    ("LoopConfig.init_std=inf", [], {"init_std": INF}, None),
    ("LoopConfig.taper_start='1.5'", [], {"taper_start": "1.5"}, None),
    ("LoopConfig has no field(s) ['dmodel']", [], {"dmodel": 16}, None),
    ("--overwrite=True", ["--resume", "--overwrite"], None, None),
    ("TrainConfig.seq_len=128 is invalid: must be <= LoopConfig.max_seq_len=64", [], None, {"seq_len": 128}),
    ("TrainConfig.backward_loops=3 is invalid: must be <= loops=2", [], None, {"backward_loops": 3}),
]


def _write(path, content):
    if content is None:
        return None
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


@pytest.mark.parametrize("expect, argv, model, train", CLI, ids=[c[0] for c in CLI])
def test_cli_train_prints_one_line_naming_the_flag_or_field(expect, argv, model, train, tmp_path, capsys):
    from workbench.cli import main

    model_file = _write(tmp_path / "model.json", model if isinstance(model, str) else {**TINY_MODEL, **(model or {})})
    args = ["train", "--out", str(tmp_path / "run"), "--corpus", "stdlib", "--vocab-size", "300", "--no-progress",
            "--config", model_file]
    args += ["--train-config", _write(tmp_path / "train.json", train if isinstance(train, str) else
                                      {"batch_size": 2, "seq_len": 16, **(train or {})})]
    args += [a.replace("{dir}", str(tmp_path)) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err  # one line; the traceback needs --debug
    assert expect.replace("{dir}", str(tmp_path)) in err, err
    assert not (tmp_path / "run").exists()  # checked before anything was written


def test_cli_debug_shows_the_traceback(tmp_path):
    from workbench.cli import main

    with pytest.raises(ValueError, match="--steps=0"):
        main(["train", "--out", str(tmp_path / "run"), "--steps", "0", "--debug"])


# ---- pipeline parameters (the train notebook and its declared check) --------------------------------------------
PIPELINE = [
    ("flops=-1.0", {"flops": -1.0}),
    ("eval_loops[0]=0", {"eval_loops": [0, 2]}),
    ("eval_loops=['a']", {"eval_loops": ["a"]}),
    ("lr=nan", {"lr": NAN}),
    ("lr=inf", {"lr": INF}),
    ("lr='0.01'", {"lr": "0.01"}),
    ("steps=0", {"steps": 0}),
    ("backward_loops=-1", {"backward_loops": -1}),
    ("steps=True", {"steps": True}),
    ("tasks[0]='bogus'", {"tasks": ["bogus"]}),
    ("task_ratio=1.5", {"task_ratio": 1.5}),
    ("vocab_size=100", {"vocab_size": 100}),
    ("LoopConfig.tie_embeddings='false'", {"model_overrides": {"tie_embeddings": "false"}}),
    ("TrainConfig.schedule='linear'", {"train_overrides": {"schedule": "linear"}}),
    ("train_overrides=[1]", {"train_overrides": [1]}),
    ("LoopConfig.n_heads=3", {"n_heads": 3}),
    ("inject='Dense'", {"inject": "Dense"}),
    ("loop_sampler='poisson'", {"loop_sampler": "poisson"}),
    # loops: 2 reaches no history lag (loop t sees min(w, t - 1) past states): a w = 2 arm would train w = 0
    ("LoopConfig.history=2 is invalid: must be 0 when training runs at most 2 loops", {"model_overrides": {"history": 2}}),
    ("unknown parameter 'stepz'", {"stepz": 3}),
]


def refused_before_running(tmp_path, spec_text: str) -> str:
    """Return the error of a pipeline spec that must be refused before any run starts (and assert nothing ran)."""
    from workbench import pipeline

    spec = tmp_path / "bad.yaml"
    spec.write_text(textwrap.dedent(spec_text))
    with pytest.raises(pipeline.PipelineError) as e:
        pipeline.run(spec, runs_dir=tmp_path / "runs", report_html=False, log=None)
    assert "nothing was run" in str(e.value), str(e.value)
    assert not (tmp_path / "runs").exists()
    return str(e.value)


@pytest.mark.parametrize("expect, params", PIPELINE, ids=[p[0] for p in PIPELINE])
def test_pipeline_parameters_are_checked_before_anything_runs(expect, params, tmp_path):
    msg = refused_before_running(tmp_path, f"""\
        name: bad
        steps:
          - name: train
            notebook: train
            params: {json.dumps({"steps": 3, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "loops": 2,
                                 "vocab_size": 300, "seq_len": 32, "batch_size": 4, **params},
                                allow_nan=True).replace("NaN", ".nan").replace("Infinity", ".inf")}
        """)
    assert expect in msg, msg


# ---- every notebook's parameters: the range each declares in its parameters cell ([1..], [0..1], ...) -------------
NOTEBOOK_RANGES = [
    ("parameter n_sequences=0 is out of the range loop_sweep.ipynb declares", "loop_sweep", {"n_sequences": 0}),
    ("parameter seed=-1 is out of the range loop_sweep.ipynb declares", "loop_sweep", {"seed": -1}),
    ("parameter seq_len=0 is out of the range geometry.ipynb declares", "geometry", {"seq_len": 0}),
    ("parameter gate_thresholds[1]=1.5 is out of the range generate.ipynb declares", "generate",
     {"gate_thresholds": [0.5, 1.5]}),
    ("parameter batch_size=0 is out of the range lm_eval.ipynb declares", "lm_eval", {"batch_size": 0}),
    ("parameter measure_every=0 is out of the range lost_gradient.ipynb declares", "lost_gradient",
     {"measure_every": 0}),
]


@pytest.mark.parametrize("expect, notebook, params", NOTEBOOK_RANGES, ids=[r[0].split(" is ")[0] for r in NOTEBOOK_RANGES])
def test_every_notebooks_ranges_are_checked_before_anything_runs(expect, notebook, params, tmp_path):
    msg = refused_before_running(tmp_path, f"""\
        name: bad
        steps:
          - name: train
            notebook: train
            params: {{steps: 3, d_model: 32, n_heads: 2, n_kv_heads: 1, loops: 2, vocab_size: 300, seq_len: 32}}
          - name: probe
            notebook: {notebook}
            each: {{train: checkpoint}}
            params: {json.dumps(params)}
        """)
    assert f"step 'probe': {expect}" in msg, msg


# ---- the model's forward ------------------------------------------------------------------------------------------
V = 97
FORWARD = [
    ("tokens holds token id 97", dict(tokens=[[1, 97]])),
    ("tokens holds token id 200", dict(tokens=[[1, 200]])),
    ("tokens holds token id -1", dict(tokens=[[-1, 2]])),
    ("targets holds token id 500", dict(tokens=[[1, 2]], targets=[[1, 500]])),
    ("labels holds token id 500", dict(tokens=[[1, 2]], labels=torch.full((1, 2, 2), 500))),
    ("targets shape (1, 3) is invalid: must equal the tokens' shape (1, 2)", dict(tokens=[[1, 2]], targets=[[1, 2, 3]])),
    ("tokens dtype=torch.float32", dict(tokens=torch.tensor([[1.0, 2.0]]))),
    ("tokens must be a non-empty [batch, seq] tensor of token ids, got (0, 5)", dict(tokens=torch.zeros(0, 5, dtype=torch.long))),
    ("got (2, 0)", dict(tokens=torch.zeros(2, 0, dtype=torch.long))),
    ("got (3,)", dict(tokens=torch.tensor([1, 2, 3]))),
    ("loops=0", dict(tokens=[[1, 2]], loops=0)),
    ("loops='2'", dict(tokens=[[1, 2]], loops="2")),
    ("backward_loops=5", dict(tokens=[[1, 2]], loops=2, backward_loops=5)),
    ("sequence length 65 exceeds max_seq_len=64", dict(tokens=torch.ones(1, 65, dtype=torch.long))),
    # named places (issue 29): a pattern naming no place of the pass, a hook that breaks the pass
    ("cache pattern 'core.3.0' names no place of this pass; its places are: prelude.0, core.1.0",
     dict(tokens=[[1, 2]], loops=2, cache=["core.3.0"])),
    ("cache pattern 'state.5' names no place", dict(tokens=[[1, 2]], loops=2, cache=["state.5"])),
    ("hooks pattern 'cor.*' names no place", dict(tokens=[[1, 2]], loops=2, hooks={"cor.*": lambda n, i, o: None})),
    ("hook 'core.1.*' at core.1.0 returned (1, 1, 32) torch.float32: must return None or a tensor of the output's "
     "shape (1, 2, 32)", dict(tokens=[[1, 2]], loops=2, hooks={"core.1.*": lambda n, i, o: o[:, :1]})),
    ("hook 'core.*' at core.1.0 returned (1, 2, 32) torch.float64", dict(tokens=[[1, 2]], loops=2,
                                                                      hooks={"core.*": lambda n, i, o: o.double()})),
    ("hook 'coda.0' at coda.0 returned list", dict(tokens=[[1, 2]], loops=2, hooks={"coda.0": lambda n, i, o: [o]})),
    ("hooks entry 'core.*': 'not callable' is invalid", dict(tokens=[[1, 2]], hooks={"core.*": "not callable"})),
    ("hooks entry 3:", dict(tokens=[[1, 2]], hooks={3: lambda n, i, o: None})),
]


@pytest.mark.parametrize("expect, call", FORWARD, ids=[f[0] for f in FORWARD])
def test_model_forward_names_the_bad_value_and_the_allowed_range(expect, call):
    model = LoopLM(tiny_cfg(vocab_size=V), seed=0)
    kw = dict(call)
    tokens = kw.pop("tokens")
    tokens = tokens if torch.is_tensor(tokens) else torch.tensor(tokens)
    if "targets" in kw:
        kw["targets"] = torch.tensor(kw["targets"])
    with pytest.raises(ValueError) as e:
        model(tokens, **kw)
    assert expect in str(e.value), str(e.value)
    if "holds token id" in str(e.value):
        assert f"0..{V - 1}" in str(e.value) and f"vocab_size={V}" in str(e.value)


# ---- a run folder's files ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A tiny finished run folder written by train_run (2 steps)."""
    from workbench.experiments import train_run

    out = tmp_path_factory.mktemp("bad_inputs") / "run"
    src = out.parent / "text.txt"
    src.write_text("the loop refines the state; the core is tied. " * 400)
    train_run(out, TINY_MODEL, {"steps": 2, "batch_size": 2, "seq_len": 16, "eval_batches": 1}, corpus=f"path:{src}",
              vocab_size=300, eval_loops=[1, 2])
    return out


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _latest(text):
    def write(run):
        (run / "latest.json").write_text(text)
    return write


def _flip_a_byte(path):
    """Flip one byte in the tensor data (three quarters in): the file still reads as safetensors."""
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0xFF
    path.write_bytes(bytes(data))


def _nan_in_an_unhashed_checkpoint(run):
    """A checkpoint as older code wrote it (no hashes in state.json) whose weights hold a NaN."""
    from safetensors.torch import load_file, save_file

    ckpt = run / "ckpt-00000002"
    weights = load_file(str(ckpt / "model.safetensors"))
    name = sorted(weights)[-1]
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(ckpt / "model.safetensors"))
    state = json.loads((ckpt / "state.json").read_text())
    del state["xxh3_128"]
    (ckpt / "state.json").write_text(json.dumps(state))


FILES = [
    ("model.safetensors is damaged: its hash differs",
     lambda run: _flip_a_byte(run / "ckpt-00000002" / "model.safetensors")),
    ("holds NaN or infinite values", _nan_in_an_unhashed_checkpoint),
    ("model.safetensors", lambda run: _truncate(run / "ckpt-00000002" / "model.safetensors")),
    ("state.json", lambda run: _truncate(run / "ckpt-00000002" / "state.json")),
    ("latest.json", lambda run: _truncate(run / "latest.json")),
    ("latest.json", _latest('["ckpt-00000002"]')),
    ("checkpoint='../other/ckpt-00000002'", _latest('{"checkpoint": "../other/ckpt-00000002", "step": 2}')),
    ("checkpoint='/tmp'", _latest('{"checkpoint": "/tmp", "step": 2}')),
    ("ckpt-00000009", _latest('{"checkpoint": "ckpt-00000009", "step": 9}')),
    ("config.json", lambda run: _truncate(run / "config.json")),
    ("tokenizer.json", lambda run: _truncate(run / "tokenizer.json")),
    ("tokenizer.json", lambda run: (run / "tokenizer.json").write_text(  # another tokenizer's bytes
        (run / "tokenizer.json").read_text() + "\n")),
    ("config.json", lambda run: (run / "config.json").write_text(
        (run / "config.json").read_text().replace('"d_model": 16', '"d_model": 32'))),
]


@pytest.mark.parametrize("expect, damage", FILES, ids=[f"{f[0]}-{i}" for i, f in enumerate(FILES)])
def test_damaged_run_files_are_named(expect, damage, run_folder, tmp_path):
    from workbench.experiments import load_run
    from workbench.io import open_run

    run = tmp_path / "run"
    shutil.copytree(run_folder, run)
    open_run(run)  # intact, it opens
    damage(run)
    for opener in (open_run, load_run):
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            opener(run)
        assert expect in str(e.value), str(e.value)


# counted in the README's reliability section
BAD_INPUTS = {"LoopConfig": len(LOOP_CONFIG), "TrainConfig": len(TRAIN_CONFIG), "CLI train": len(CLI),
              "pipeline parameters": len(PIPELINE), "notebook ranges": len(NOTEBOOK_RANGES),
              "model forward": len(FORWARD), "run files": len(FILES)}


def test_the_count_is_recorded_in_the_readme():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    total = sum(BAD_INPUTS.values())
    assert f"{total} bad inputs" in readme, f"README's reliability section should say {total} bad inputs: {BAD_INPUTS}"
