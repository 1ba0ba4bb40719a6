"""LoopLM as a transformers model: save/load round trip at r = 1, K, 2K, generate as the workbench's, export, lm-eval.

The reference for every logit is LoopLM's own forward; for every generated token the workbench's
`models.generate.generate` at temperature 0.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
hf_looped = pytest.importorskip("workbench.models.hf_looped")  # needs transformers >= 5.24 (the `hf` extra)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from workbench import LoopConfig, LoopLM  # noqa: E402
from workbench.cli import main  # noqa: E402
from workbench.models.generate import generate  # noqa: E402
from workbench.models.hf_looped import LoopLMConfig, LoopLMForCausalLM  # noqa: E402

K, V = 3, 300
CONFIGS = {
    "plain": dict(inject="channel"),
    # untied head, timestep conditioning (horizon-dependent), hyper-connections and a history window
    "extras": dict(inject="scalar", tie_embeddings=False, timestep="adaln", hyper=2, history=1, n_kv_heads=2),
}
TRAIN = dict(steps=2, batch_size=2, seq_len=32, bf16="off", compile="off", eval_batches=1)


def noisy_looplm(kind="plain", seed=0):
    """A small fp32 LoopLM whose every weight (zero-initialised conditioning too) is moved, so each one matters."""
    cfg = LoopConfig(vocab_size=V, d_model=32, n_heads=4, prelude=1, core=2, coda=1, loops=K, max_seq_len=64,
                     **CONFIGS[kind])
    model = LoopLM(cfg, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.15 * torch.randn(p.shape, generator=g))
    return model


def ids(batch=2, length=9, seed=1):
    return torch.randint(1, V, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(CONFIGS))
@torch.no_grad()
def test_round_trip_gives_looplm_logits_at_1_K_2K(kind, tmp_path):
    model = noisy_looplm(kind)
    LoopLMForCausalLM.from_looplm(model).save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors"} <= {p.name for p in tmp_path.iterdir()}
    assert not list(tmp_path.glob("*.bin")) and not list(tmp_path.glob("*.pt")), "no pickle"
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "workbench_looplm" and saved["loops"] == K
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(back, LoopLMForCausalLM) and back.config.looped == model.cfg
    assert back.looplm.embed.weight.dtype == torch.float32 and not back.training
    x = ids()
    for r in (1, K, 2 * K):
        want = model(x, loops=r).logits
        torch.testing.assert_close(back(x, loops=r).logits, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(back(x).logits, model(x, loops=K).logits, rtol=0, atol=1e-6)  # config.loops = K
    assert (model(x, loops=1).logits - model(x, loops=2 * K).logits).abs().max() > 1e-2  # the loop count matters


@torch.no_grad()
def test_loop_count_is_a_config_field(tmp_path):
    model = noisy_looplm()
    LoopLMForCausalLM.from_looplm(model, loops=5).save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = ids()
    assert back.config.loops == 5 and back.config.loop_config["loops"] == K
    torch.testing.assert_close(back(x).logits, model(x, loops=5).logits, rtol=0, atol=1e-6)
    assert AutoModelForCausalLM.from_pretrained(tmp_path, loops=2).config.loops == 2  # from_pretrained's override
    with back.looping(1):
        torch.testing.assert_close(back(x).logits, model(x, loops=1).logits, rtol=0, atol=1e-6)
    assert back.config.loops == 5
    out = back(x, labels=x)
    want = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    torch.testing.assert_close(out.loss, want)
    states = back(x, loops=4, output_hidden_states=True).hidden_states
    assert len(states) == 5 and torch.equal(states[4], model.trace(x, loops=4).states[4])


@pytest.mark.parametrize("kind", list(CONFIGS))
@torch.no_grad()
def test_greedy_generate_equals_the_workbench_generate(kind):
    model = noisy_looplm(kind, seed=2)
    hf = LoopLMForCausalLM.from_looplm(model)
    x = ids(1, 6, seed=3)
    new = []
    for r in (1, K, 2 * K):
        want = generate(model, x, 12, loops=r, temperature=0.0)
        cached = hf.generate(x, max_new_tokens=12, do_sample=False, loops=r)
        plain = hf.generate(x, max_new_tokens=12, do_sample=False, loops=r, use_cache=False)
        assert torch.equal(cached, want) and torch.equal(plain, want), r
        new.append(want[0, 6:].tolist())
    assert any(len(set(n)) > 2 for n in new), "the reference must not be one repeated token"
    # left-padded batches: each row as its prompt alone
    prompts = [ids(1, n, seed=n)[0] for n in (3, 7, 5)]
    want = generate(model, prompts, 8, loops=K)
    padded, mask = torch.zeros(3, 7, dtype=torch.long), torch.zeros(3, 7, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, 7 - len(p):], mask[i, 7 - len(p):] = p, 1
    for cache in (True, False):
        got = hf.generate(padded, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          use_cache=cache)
        assert torch.equal(got[:, 7:], want[:, 7:]), cache
    # beam search reorders the loop cache: the same beams as without a cache
    beams = dict(max_new_tokens=6, num_beams=3, do_sample=False, loops=K)
    assert torch.equal(hf.generate(x, **beams), hf.generate(x, use_cache=False, **beams))


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A tiny run trained 2 steps with a 300-id tokenizer on the stdlib corpus (shared: the tokenizer takes ~10 s)."""
    from workbench.experiments import train_run

    out = tmp_path_factory.mktemp("run")
    model = dict(d_model=32, n_heads=2, n_kv_heads=1, prelude=1, core=1, coda=1, loops=2, max_seq_len=64)
    train_run(out, model, TRAIN, vocab_size=V, eval_loops=[1, 2])
    return out


@pytest.fixture(scope="module")
def exported(run_folder, tmp_path_factory):
    """`workbench export RUN DIR` of the tiny run: (DIR, run folder)."""
    out = tmp_path_factory.mktemp("export") / "model"
    assert main(["export", str(run_folder), str(out)]) == 0
    return out, run_folder


@torch.no_grad()
def test_export_opens_with_auto_classes(exported, capsys):
    out, run = exported
    from workbench.io import open_run

    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    looplm, wtok = open_run(run)
    assert model.config.loops == looplm.cfg.loops == 2
    text = "def f(x):\n    return x + 1  # <|endoftext|> stays text\n"
    assert tok(text)["input_ids"] == wtok.encode(text) and tok.decode(wtok.encode(text)) == text
    assert tok.eos_token_id == wtok.eos_id == model.config.eos_token_id
    x = torch.tensor([wtok.encode(text)])
    for r in (1, 2, 4):
        torch.testing.assert_close(model(x, loops=r).logits, looplm(x, loops=r).logits, rtol=0, atol=1e-6)
    got = model.generate(x[:, :8], max_new_tokens=6, do_sample=False, loops=3)
    assert torch.equal(got, generate(looplm, x[:, :8], 6, loops=3, stop=wtok.eos_id)[:, :got.shape[1]])


def test_export_refuses_an_occupied_folder_and_overwrites_an_export(exported, tmp_path, capsys):
    out, run = exported
    before = (out / "model.safetensors").read_bytes()
    assert main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"DIR={str(out)!r}" in err and "exists and is not empty" in err and "--overwrite" in err
    assert (out / "model.safetensors").read_bytes() == before
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["export", str(run), str(other), "--overwrite"]) == 2
    assert "not an exported LoopLM" in capsys.readouterr().err and (other / "keep.txt").read_text() == "mine"
    assert main(["export", str(run), str(run), "--overwrite"]) == 2
    assert "holds a training run" in capsys.readouterr().err
    copy = tmp_path / "copy"
    assert main(["export", str(run), str(copy), "--loops", "5"]) == 0
    assert main(["export", str(run), str(copy), "--overwrite", "--loops", "3"]) == 0
    assert json.loads((copy / "config.json").read_text())["loops"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary folder left behind"


def test_bad_input_is_named(tmp_path, capsys, exported):
    out, run = exported
    model = noisy_looplm()
    hf = LoopLMForCausalLM.from_looplm(model)
    x = ids()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"loops={bad!r} is invalid"):
            hf(x, loops=bad)
    with pytest.raises(ValueError, match="loops=0 is invalid"):
        LoopLMForCausalLM.from_looplm(model, loops=0)
    with pytest.raises(ValueError, match="LoopLMConfig.loops=0 is invalid"):
        LoopLMConfig(loop_config=model.cfg.to_dict(), loops=0)
    with pytest.raises(ValueError, match="loops=0 is invalid"), hf.looping(0):
        pass
    cache = hf(x, loops=2, use_cache=True).cache  # a cached sequence keeps its loop count
    with pytest.raises(ValueError, match="loops=3 is invalid: must stay 2"):
        hf(x[:, :1], cache=cache, loops=3)
    assert main(["export", str(run), str(tmp_path / "e"), "--loops", "0"]) == 2
    assert "--loops=0 is invalid" in capsys.readouterr().err and not (tmp_path / "e").exists()
    # RUN that is not a run folder
    empty = tmp_path / "empty"
    empty.mkdir()
    for bad in (empty, tmp_path / "missing", out):
        assert main(["export", str(bad), str(tmp_path / "e")]) == 2
        assert f"RUN={str(bad)!r} is not a run folder" in capsys.readouterr().err
    # folders that are not an exported model
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps({"model_type": "workbench_looplm"}))
    cases = [(empty, "no config.json"), (run, "workbench run folder: export it first"),
             (tmp_path / "llama", "model_type='llama'"), (tmp_path / "bare", "no model.safetensors"),
             (tmp_path / "missing", "does not exist"), (out / "model.safetensors", "is a file")]
    for path, why in cases:
        with pytest.raises(ValueError, match="is not|does not exist|is a file") as e:
            LoopLMForCausalLM.from_pretrained(path)
        assert str(path) in str(e.value) and why in str(e.value), (path, str(e.value))


def test_export_of_objects_in_memory(exported, tmp_path):
    """export() takes a LoopLM or a wrapper with the workbench tokenizer; `loops` is written, the model keeps its own."""
    from workbench.io import open_run
    from workbench.models.hf_looped import export

    looplm, wtok = open_run(exported[1])
    hf = LoopLMForCausalLM.from_looplm(looplm)  # no tokenizer: the export gives it its end-of-text id
    export(hf, wtok, tmp_path / "a", loops=4)
    assert hf.config.loops == 2 and hf.config.eos_token_id == wtok.eos_id
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["loops"] == 4 and saved["eos_token_id"] == wtok.eos_id
    export(looplm, wtok, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["loops"] == 2
    from safetensors.torch import load_file

    mine, cli = load_file(tmp_path / "a" / "model.safetensors"), load_file(exported[0] / "model.safetensors")
    assert mine.keys() == cli.keys() and all(torch.equal(mine[k], cli[k]) for k in mine)
    assert AutoTokenizer.from_pretrained(tmp_path / "b")("x = 1")["input_ids"] == wtok.encode("x = 1")


def test_import_workbench_stays_light():
    code = ("import sys, workbench; from workbench import LoopLM; import workbench.models.generate; "
            "assert 'transformers' not in sys.modules and 'lm_eval' not in sys.modules, 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


LOCAL_TEXT = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n",
              "for i in range(10):\n    print(i * i)\n", "class A:\n    pass\n"]
LOCAL_CHOICE = [{"q": "x = 1 +", "choices": [" 1", " def", " import"], "a": 0},
                {"q": "import", "choices": [" os", " 7", " )"], "a": 0},
                {"q": "def f(", "choices": ["x):", " 12", "]]"], "a": 0}]


def local_tasks(folder):
    """Write two lm-eval tasks over local JSONL files (rolling loglikelihood and multiple choice) into folder."""
    (folder / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LOCAL_TEXT))
    (folder / "choice.jsonl").write_text("".join(json.dumps(d) + "\n" for d in LOCAL_CHOICE))
    common = "dataset_path: json\ntest_split: test\n"
    for name, data, body in [
        ("wb_text", "text.jsonl", 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                                  "metric_list:\n  - metric: bits_per_byte\n  - metric: word_perplexity\n"),
        ("wb_choice", "choice.jsonl", 'output_type: multiple_choice\ndoc_to_text: "{{q}}"\n'
                                      'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{a}}"\n'
                                      "metric_list:\n  - metric: acc\n")]:
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / data}\n"
            f"  cache_dir: {folder / 'cache'}\n{body}")


@pytest.mark.slow
def test_lm_eval_scores_an_export_at_several_loop_counts(exported, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    import xarray as xr

    from workbench.io import save_netcdf
    from workbench.models.hf_eval import lm_eval_sweep

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    out, _ = exported
    local_tasks(tmp_path)
    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    ds = lm_eval_sweep(model, tok, ["wb_text", "wb_choice"], loops=[1, 2, 4], include_path=tmp_path,
                       bootstrap_iters=0)
    assert ds.sizes == {"loop": 3, "task": 2} and list(ds.loop.values) == [1, 2, 4]
    bpb = ds.bits_per_byte.sel(task="wb_text").values
    acc = ds.acc.sel(task="wb_choice").values
    assert np.isfinite(bpb).all() and (bpb > 0).all() and ((acc >= 0) & (acc <= 1)).all()
    assert np.isnan(ds.acc.sel(task="wb_text")).all()  # a metric the task does not report
    assert len(set(bpb.round(6))) == 3, f"scores must change with the loop count: {bpb}"
    assert list(ds.n_samples.sel(task="wb_choice").values) == [3, 3, 3]
    assert model.config.loops == 2  # the sweep gives the loop count back
    # the reference: each document's log-likelihood after the end-of-text token at r loops, summed by hand
    # (every document fits one window), over its UTF-8 bytes, in bits
    with torch.no_grad():
        for i, r in enumerate((1, 2, 4)):
            nll = 0.0
            for text in LOCAL_TEXT:
                doc = torch.tensor([[tok.eos_token_id] + tok(text)["input_ids"]])
                logp = torch.log_softmax(model(doc, loops=r).logits[0, :-1].double(), -1)
                nll -= float(logp.gather(1, doc[0, 1:, None]).sum())
            want = nll / sum(len(t.encode("utf-8")) for t in LOCAL_TEXT) / np.log(2)
            assert abs(bpb[i] - want) < 1e-4 * want, (r, bpb[i], want)
    # a LoopLM and the workbench tokenizer (wrapped here) score as the exported pair does
    from workbench.io import open_run

    looplm, wtok = open_run(exported[1])
    one = lm_eval_sweep(looplm, wtok, "wb_text", loops=[4], include_path=tmp_path, bootstrap_iters=0)
    assert abs(float(one.bits_per_byte.sel(loop=4, task="wb_text")) - bpb[2]) < 1e-6
    with pytest.raises(ValueError, match=r"loops\[1\]=0 is invalid"):
        lm_eval_sweep(model, tok, "wb_text", loops=[2, 0], include_path=tmp_path)
    with pytest.raises(ValueError, match="no_such_task"):
        lm_eval_sweep(model, tok, ["wb_text", "no_such_task"], loops=[2], include_path=tmp_path,
                      include_defaults=False)
    save_netcdf(ds.assign_attrs(extra="x"), tmp_path / "results.nc")  # flat attrs: netCDF takes them
    assert xr.load_dataset(tmp_path / "results.nc", engine="h5netcdf").bits_per_byte.shape == (3, 2)
