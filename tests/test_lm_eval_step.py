"""The lm-eval pipeline step: a trained run scored by lm-evaluation-harness at several loop counts, beside its own.

The smoke profile of pipelines/lm_eval.yaml runs once (train 2 steps, then the lm_eval notebook); its
multiple-choice accuracies are then recomputed by hand from the run's model (the sum of the choice's
token log-probabilities after the prompt, argmax over the choices, as lm-eval scores multiple choice),
and its bits per byte from the document log-likelihood after the end-of-text token.
"""

import json
import math

import numpy as np
import pytest
import torch
import xarray as xr

from workbench import pipeline
from workbench.io import RunDir

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(runs folder, result) of the lm_eval pipeline's smoke profile."""
    runs = tmp_path_factory.mktemp("lm_eval_runs")
    return runs, pipeline.run("lm_eval", profile="smoke", jobs=2, runs_dir=runs, log=None)


def step_dirs(runs):
    """Return (train run folder, lm_eval run folder) of the smoke pipeline."""
    (train,), (step,) = pipeline.find_runs("lm_eval", "train", runs), pipeline.find_runs("lm_eval", "lm_eval", runs)
    return train, step


def docs(folder, task):
    """Return the JSONL documents of one local task the step wrote."""
    return [json.loads(line) for line in (RunDir(folder).lm_eval_tasks / f"{task}.jsonl").read_text().splitlines()]


def test_the_step_scores_every_task_and_depth_beside_the_workbench(smoke):
    from test_notebooks import check_smoke

    runs, result = smoke
    check_smoke("lm_eval", runs, result)
    train, step = step_dirs(runs)
    # the training in the kernel locked its working folder; that lock file went with it (the runs' own stay)
    assert not list(runs.rglob(".*.partial.lock")) and RunDir(train).lock.exists()
    ds = xr.load_dataset(RunDir(step).results, engine="h5netcdf")
    own = xr.load_dataset(RunDir(train).results, engine="h5netcdf")
    # the loop counts of the run's own evaluation, every task and depth it trained at and past them
    assert list(ds.loop.values) == list(own.loop.values) == [1, 2, 4]
    assert list(ds.task.values) == ["wb_text"] + [f"wb_iterated_d{d}" for d in range(1, 9)] + ["wb_recall_d0"]
    assert list(ds.task_trained.values) == [False] + [True] * 4 + [False] * 4 + [True]
    assert list(ds.task_group.values) == ["text"] + ["reasoning"] * 8 + ["knowledge"]
    mc = ds.task_group != "text"
    assert np.isfinite(ds.acc.where(mc, drop=True)).all() and np.isnan(ds.acc.sel(task="wb_text")).all()
    assert np.isfinite(ds.exact_match_wb.where(mc, drop=True)).all()
    assert np.isfinite(ds.bits_per_byte.sel(task="wb_text")).all() and np.isfinite(ds.loss_wb).all()
    assert ds.attrs["headline"] == "text_bpb_at_K,acc_knowledge_at_K,acc_reasoning_at_K"
    trained = ds.acc.sel(loop=2).where((ds.task_group == "reasoning") & ds.task_trained)
    assert float(ds.acc_reasoning_at_K) == pytest.approx(float(trained.mean()))
    assert (step / "figures" / "lm_eval_accuracy.json").exists()


def test_multiple_choice_and_bits_per_byte_equal_a_hand_computation(smoke):
    from workbench.experiments import load_run
    from workbench.models.hf_looped import hf_tokenizer

    runs, _ = smoke
    train, step = step_dirs(runs)
    ds = xr.load_dataset(RunDir(step).results, engine="h5netcdf")
    run = load_run(train, device="cpu")
    tok = run.tokenizer

    def logp(ids: list[int], start: int, r: int) -> float:
        """Sum of log p(ids[i] | ids[:i]) for i >= start at r loops."""
        with torch.no_grad():
            lp = torch.log_softmax(run.model(torch.tensor([ids[:-1]]), loops=r).logits.double()[0], -1)
        return float(sum(lp[i - 1, ids[i]] for i in range(start, len(ids))))

    checked = 0
    for task in ("wb_iterated_d1", "wb_iterated_d6", "wb_recall_d0"):
        for j, r in enumerate(ds.loop.values):
            hits = []
            for d in docs(step, task):
                ctx = tok.encode(d["prompt"])
                # lm-eval encodes prompt + choice whole and takes the tokens after the prompt's as the choice
                scores = [logp(tok.encode(d["prompt"] + c), len(ctx), int(r)) for c in d["choices"]]
                hits.append(int(np.argmax(scores)) == d["label"])
            assert float(ds.acc.sel(task=task).values[j]) == pytest.approx(np.mean(hits)), (task, r)
            checked += 1
    assert checked == 9
    # bits per byte: each document after the end-of-text token, over its UTF-8 bytes, in bits
    eos = hf_tokenizer(tok, run.model.cfg.max_seq_len).eos_token_id
    texts = [d["text"] for d in docs(step, "wb_text")]
    assert all(len(tok.encode(t)) + 1 <= run.model.cfg.max_seq_len for t in texts)  # one window each: no rolling
    for j, r in enumerate(ds.loop.values):
        nll = -sum(logp([eos] + tok.encode(t), 1, int(r)) for t in texts)
        want = nll / sum(len(t.encode("utf-8")) for t in texts) / math.log(2)
        assert float(ds.bits_per_byte.sel(task="wb_text").values[j]) == pytest.approx(want, rel=1e-4)


def test_bad_input_is_named_before_the_model_loads(tmp_path):
    from workbench.experiments.lm_eval import lm_eval_run

    for kwargs, match in [({"tasks": "hellaswag"}, "tasks='hellaswag'"),
                          ({"include_path": str(tmp_path / "no_such")}, "include_path="),
                          ({"tasks": ["x"], "loops": [2, 0]}, r"loops\[1\]=0"),
                          ({"include_path": str(tmp_path)}, "must name the tasks"),
                          ({"limit": -1}, "limit=-1")]:
        with pytest.raises(ValueError, match=match):
            lm_eval_run(tmp_path / "out", tmp_path / "no_run", **kwargs)
    assert not (tmp_path / "out").exists()
