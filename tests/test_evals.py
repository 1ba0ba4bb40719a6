"""loop_sweep against per-r separate evaluations, one example and one r at a time."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from workbench import LoopConfig, LoopLM
from workbench.evals import loop_sweep


class CharTokenizer:
    """One token per byte: enough to exercise prompts and answers of different lengths."""

    def encode(self, s):
        return list(s.encode())


@dataclass(frozen=True)
class Ex:
    prompt: str
    answer: str
    depth: int
    task: str
    group: str


def model_for(**kw):
    cfg = LoopConfig(vocab_size=256, d_model=32, n_heads=4, n_kv_heads=2, prelude=1, core=1, coda=1, loops=3,
                     max_seq_len=64, **kw)
    model = LoopLM(cfg, seed=0)
    with torch.no_grad():  # off the init so loops differ visibly
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    return model


@pytest.mark.parametrize("kw", [{}, {"timestep": "adaln"}], ids=["plain", "horizon-dependent"])
def test_token_sweep_equals_separate_evaluations(kw):
    model = model_for(**kw)
    data = torch.randint(0, 256, (5, 17), generator=torch.Generator().manual_seed(0))
    loops = [1, 2, 3, 5, 8]
    ds = loop_sweep(model, data, loops, batch_size=2, progress=False)
    assert list(ds.loop.values) == loops
    for r in loops:
        with torch.no_grad():
            logits = model(data[:, :-1], loops=r).logits
        y = data[:, 1:]
        ref_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
        ref_acc = (logits.argmax(-1) == y).float().mean().item()
        assert ds.loss.sel(loop=r).item() == pytest.approx(ref_loss, rel=1e-5)
        assert ds.accuracy.sel(loop=r).item() == pytest.approx(ref_acc, abs=1e-9)
    assert len(set(np.round(ds.loss.values, 5))) == len(loops)
    for k in ("config_json", "git_commit", "workbench_version", "seed", "created"):
        assert k in ds.attrs


def test_example_sweep_equals_one_example_at_a_time():
    model = model_for()
    tok = CharTokenizer()
    exs = [Ex("a=1;b=", " 2", 1, "iter", "reasoning"), Ex("cap Zorb is", " Plim", 0, "recall", "knowledge"),
           Ex("x+3+3=", " 9", 2, "iter", "reasoning"), Ex("q", " r", 1, "iter", "reasoning")]
    # make one answer right at some loop: teach nothing, but use the model's own argmax as the answer
    with torch.no_grad():
        ids = torch.tensor([tok.encode("zz")])
        guess = model(ids, loops=2).logits[0, -1].argmax().item()
    exs.append(Ex("zz", chr(guess) if guess < 128 else "?", 1, "iter", "reasoning"))
    loops = [1, 2, 4]
    ds = loop_sweep(model, exs, loops, tokenizer=tok, batch_size=3, progress=False)
    for r in loops:
        per = {}
        for ex in exs:
            p, a = tok.encode(ex.prompt), tok.encode(ex.answer)
            with torch.no_grad():
                lg = model(torch.tensor([p + a[:-1]]), loops=r).logits[0, len(p) - 1:]
            right = bool((lg.argmax(-1) == torch.tensor(a)).all())
            per.setdefault((ex.task, ex.depth), []).append((F.cross_entropy(lg, torch.tensor(a)).item(), right))
        for (task, depth), vals in per.items():
            cell = ds.sel(loop=r, task=task, depth=depth)
            assert cell.loss.item() == pytest.approx(np.mean([v[0] for v in vals]), rel=1e-5)
            assert cell.accuracy.item() == pytest.approx(np.mean([v[1] for v in vals]))
            assert ds["count"].sel(task=task, depth=depth).item() == len(vals)
    assert ds.accuracy.sel(loop=2, task="iter", depth=1).item() > 0  # the planted answer is found
    assert dict(zip(ds.task.values, ds.task_group.values)) == {"iter": "reasoning", "recall": "knowledge"}
    assert np.isnan(ds.accuracy.sel(loop=1, task="recall", depth=2).item())  # empty cell


def test_bad_input_is_named():
    model = model_for()
    with pytest.raises(ValueError, match="loops="):
        loop_sweep(model, torch.zeros(2, 5, dtype=torch.long), [0, 2], progress=False)
    with pytest.raises(ValueError, match="tokenizer"):
        loop_sweep(model, [Ex("a", " b", 0, "t", "reasoning")], [1], progress=False)
    with pytest.raises(ValueError, match="max_seq_len"):
        loop_sweep(model, [Ex("a" * 80, " b", 0, "t", "reasoning")], [1], tokenizer=CharTokenizer(), progress=False)


def test_sweep_over_generated_tasks_with_a_trained_tokenizer():
    from workbench.data.corpus import train_tokenizer
    from workbench.data.tasks import make_task, recall_facts

    exs = (make_task("iterated", 6, depth=2, seed=0) + make_task("iterated", 4, depth=5, seed=0)
           + make_task("deduction", 4, depth=1, seed=0) + make_task("recall", 5, depth=0, seed=0))
    tok = train_tokenizer(recall_facts(20, seed=0) + [e.text for e in exs], vocab_size=300)
    model = LoopLM(LoopConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4, prelude=1, core=1, coda=1,
                              loops=2, max_seq_len=512), seed=0)
    ds = loop_sweep(model, exs, [1, 3], tokenizer=tok, progress=False)
    assert set(ds.task.values) == {"iterated", "deduction", "recall"}
    assert ds["count"].sel(task="iterated", depth=5).item() == 4
    assert ds["count"].sum().item() == len(exs)
    assert set(ds.group.values) == {"knowledge", "reasoning"}
    assert ds.task_group.sel(task="recall").item() == "knowledge"
    assert ds.accuracy.dims == ("loop", "task", "depth")
