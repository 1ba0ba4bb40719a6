"""lm-evaluation-harness as a pipeline step: the field's scores at several loop counts, beside the workbench's own.

`lm_eval_run(out_dir, checkpoint, ...)` opens a trained run and scores it with lm-eval
(`models.hf_eval.lm_eval_sweep`: one `simple_evaluate` per loop count, the same weights at each r).
Without `tasks` it scores the run's own held-out documents, written as local lm-eval tasks
(`write_local_tasks`): held-out corpus windows as text (`wb_text`: bits per byte) and,
when the run trained with synthetic tasks, each task and depth as multiple choice (`wb_<task>_d<depth>`,
tagged knowledge or reasoning, past the trained depths too). On those same documents and loop counts
it also runs the workbench's own evaluation (`loss_wb`: nats per token of the windows;
`exact_match_wb`: teacher-forced exact match of each answer), so results.nc holds the two side by side.
With `tasks` (lm-eval names, or names of YAML files under `include_path`) it scores those instead, a
user's benchmarks where they have them; `task_group` says "" for such a task.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xarray as xr

from ..config import check_int, fail
from ..io import RunDir, provenance, save_results


def write_local_tasks(folder: str | os.PathLike, *, texts: Sequence[str] = (), examples: Sequence = (),
                      prefix: str = "wb") -> dict[str, dict]:
    """Return {task name: its family, depth and group} after writing lm-eval tasks over local JSONL files into folder.

    `texts` become one task `<prefix>_text` (rolling log-likelihood of each document: bits per byte,
    byte and word perplexity). `examples` (`data.tasks` Examples) become one multiple-choice task per
    task and depth, `<prefix>_<task>_d<depth>`: the prompt, and as choices every answer the task's
    examples give (at any depth), scored by accuracy (`acc`, and `acc_norm` by length). Answers begin
    with a space, so nothing is put between prompt and choice. Pass `folder` as `include_path`.
    """
    from ..data.examples import Example

    if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", prefix):
        fail("prefix", prefix, "must be a name of letters, digits and underscores, starting with a letter")
    texts, examples = list(texts), list(examples)
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
    if bad:
        fail(f"texts[{bad[0]}]", texts[bad[0]], "must be a non-empty string")
    bad = [i for i, e in enumerate(examples) if not isinstance(e, Example)]
    if bad:
        fail(f"examples[{bad[0]}]", examples[bad[0]], "must be a workbench.data.tasks Example")
    if not texts and not examples:
        fail("texts", texts, "and examples are both empty: there is no document to write a task over")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tasks: dict[str, dict] = {}

    def write(name: str, docs: list[dict], body: str, **facts) -> None:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
        # json.dumps quotes each path as YAML reads it; the datasets cache stays in this folder
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
            f"    test: {json.dumps(str(data.resolve()))}\n  cache_dir: {json.dumps(str((folder / 'cache').resolve()))}\n"
            + body, encoding="utf-8")
        tasks[name] = facts

    if texts:
        write(f"{prefix}_text", [{"text": t} for t in texts],
              'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
              "metric_list:\n  - metric: bits_per_byte\n  - metric: byte_perplexity\n  - metric: word_perplexity\n",
              family="text", depth=0, group="text")
    answers: dict[str, list[str]] = {}
    for e in examples:
        answers.setdefault(e.task, [])
        if e.answer not in answers[e.task]:
            answers[e.task].append(e.answer)
    for task in sorted(answers):
        choices = sorted(answers[task])
        for depth in sorted({int(e.depth) for e in examples if e.task == task}):
            docs = [{"prompt": e.prompt, "choices": choices, "label": choices.index(e.answer)}
                    for e in examples if e.task == task and int(e.depth) == depth]
            group = next(e.group for e in examples if e.task == task)
            write(f"{prefix}_{task}_d{depth}", docs,
                  'output_type: multiple_choice\ndoc_to_text: "{{prompt}}"\ndoc_to_choice: "{{choices}}"\n'
                  'doc_to_target: "{{label}}"\ntarget_delimiter: ""\n'
                  "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
                  family=task, depth=depth, group=group)
    return tasks


def _loops(loops: Sequence[int], K: int, evaluated: Sequence[int]) -> list[int]:
    """Return the loop counts to score: those given, else the run's own evaluation's (else 1, K, 2K)."""
    if isinstance(loops, (str, bytes)) or not isinstance(loops, Sequence):
        fail("loops", loops, "must be a list of loop counts (integers >= 1), or [] for the run's own")
    rs = [check_int(f"loops[{i}]", r, 1) for i, r in enumerate(loops)] or [int(r) for r in evaluated] or [1, K, 2 * K]
    if len(set(rs)) != len(rs):
        fail("loops", list(loops), "must not repeat a loop count")
    return sorted(rs)


def _own_scores(run, windows, examples, tasks: dict[str, dict], rs: list[int]) -> xr.Dataset:
    """Return the workbench's own evaluation of the documents lm-eval scores: window loss, answer exact match."""
    from ..evals import sweep_examples, sweep_tokens

    names = list(tasks)
    out = xr.Dataset(coords={"loop": rs, "task": names})
    if windows is not None:
        own = sweep_tokens(run.model, [windows], rs, progress=False)
        out["loss_wb"] = ("loop", own.loss.values, {"long_name": "workbench loss on the same windows",
                                                    "units": "nats/token"})
    match = np.full((len(rs), len(names)), np.nan)
    if examples:
        own = sweep_examples(run.model, examples, run.tokenizer, rs, progress=False)
        for j, name in enumerate(names):
            fam, depth = tasks[name]["family"], tasks[name]["depth"]
            if fam in own.task.values and depth in own.depth.values:
                match[:, j] = own.accuracy.sel(task=fam, depth=depth).values
    out["exact_match_wb"] = (("loop", "task"), match,
                             {"long_name": "workbench teacher-forced exact match of the answer (same questions)",
                              "units": "1"})
    return out


def _headline(ds: xr.Dataset, K: int) -> xr.Dataset:
    """Return the numbers a report shows first: text bits per byte and each task group's accuracy, at K."""
    head = xr.Dataset()
    if K not in ds.loop.values:
        return head
    at = ds.sel(loop=K)
    if "bits_per_byte" in ds and (ds.task_group == "text").any():
        head["text_bpb_at_K"] = ((), float(at.bits_per_byte.where(ds.task_group == "text").mean()),
                                 {"long_name": f"lm-eval bits per byte of the held-out text at r = K = {K}",
                                  "units": "bits/byte"})
    for g in ("knowledge", "reasoning"):
        mine = (ds.task_group == g) & ds.task_trained
        if "acc" in ds and mine.any():
            head[f"acc_{g}_at_K"] = ((), float(at.acc.where(mine).mean()),
                                     {"long_name": f"lm-eval multiple-choice accuracy, {g} questions at the trained "
                                                   f"depths (mean over tasks and depths) at r = K = {K}", "units": "1"})
    return head


def lm_eval_run(out_dir: str | os.PathLike, checkpoint: str | os.PathLike, *, tasks: Sequence[str] = (),
                include_path: str = "", loops: Sequence[int] = (), limit: int = 0, num_fewshot: int = 0,
                n_texts: int = 16, seq_len: int = 128, n_task_examples: int = 16, batch_size: int = 8,
                bootstrap_iters: int = 100, seed: int = 0) -> xr.Dataset:
    """Return (and write to out_dir/results.nc) lm-eval's scores of a run over (loop, task), beside its own.

    checkpoint: a run folder or a checkpoint in one. tasks: lm-eval task names ([]: the run's own
    held-out text and task questions, written as local tasks under out_dir/lm_eval_tasks/).
    include_path: a folder of a user's task YAMLs. loops: loop counts ([]: those of the run's own
    evaluation). limit: documents per task (0: all). n_texts windows of seq_len tokens and
    n_task_examples questions per task and depth make the local tasks. Bad input is refused before
    the model is loaded.
    """
    from ..models.hf_eval import lm_eval_sweep
    from .runs import _trained_depths, load_run

    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence) \
            or not all(isinstance(t, str) and t for t in tasks):
        fail("tasks", tasks, "must be a list of lm-eval task names ([]: the run's own held-out documents)")
    if not isinstance(include_path, str) or (include_path and not os.path.isdir(include_path)):
        fail("include_path", include_path, "must be a folder of lm-eval task YAML files, or '' for none")
    if include_path and not tasks:
        fail("tasks", list(tasks), "must name the tasks to score under include_path")
    limit, num_fewshot = check_int("limit", limit, 0), check_int("num_fewshot", num_fewshot, 0)
    n_texts, seq_len = check_int("n_texts", n_texts, 0), check_int("seq_len", seq_len, 2)
    n_task_examples = check_int("n_task_examples", n_task_examples, 0)
    check_int("batch_size", batch_size, 1), check_int("bootstrap_iters", bootstrap_iters, 0)
    seed = check_int("seed", seed, 0)
    if not isinstance(loops, Sequence) or isinstance(loops, (str, bytes)):
        fail("loops", loops, "must be a list of loop counts (integers >= 1), or [] for the run's own")
    for i, r in enumerate(loops):
        check_int(f"loops[{i}]", r, 1)
    run = load_run(checkpoint)
    K = int(run.model.cfg.loops)
    # the loop counts the run's own evaluation used (its folder, or the run around a checkpoint given)
    own = next((RunDir(p).results for p in (Path(run.path), Path(run.path).parent) if RunDir(p).results.exists()),
               None)
    evaluated = xr.load_dataset(own, engine="h5netcdf").loop.values.tolist() if own is not None else []
    rs = _loops(list(loops), K, evaluated)
    windows = examples = None
    if tasks:
        names, facts = list(tasks), {t: {"family": t, "depth": 0, "group": ""} for t in tasks}
        where = include_path or None
    else:
        if n_texts == 0 and (n_task_examples == 0 or not run.experiment.get("tasks")):
            fail("n_texts", n_texts, "is 0 and the run has no task questions to score: nothing to evaluate")
        # a window and the end-of-text token lm-eval puts before it fit the context: one rolling window per text
        windows = run.val_tokens(n_texts, min(seq_len, run.model.cfg.max_seq_len - 2), seed=seed) if n_texts else None
        # the text lm-eval scores is what the windows decode to; the model's own loss below reads the windows
        texts = [run.tokenizer.decode(w.tolist()) for w in windows] if windows is not None else []
        examples = run.task_examples(n_task_examples) if n_task_examples and run.experiment.get("tasks") else []
        where = RunDir(out_dir).lm_eval_tasks
        facts = write_local_tasks(where, texts=[t for t in texts if t.strip()], examples=examples)
        names = list(facts)
        # local documents only: the datasets library need not look for the Hub (set before lm-eval imports it)
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scores = lm_eval_sweep(run.model, run.tokenizer, names, rs, include_path=where, limit=limit or None,
                           num_fewshot=num_fewshot or None, batch_size=batch_size, bootstrap_iters=bootstrap_iters,
                           seed=seed, include_defaults=None if tasks else False)
    # a standard error lm-eval did not compute (bootstrap_iters=0) is "N/A" everywhere: not a result to keep
    scores = scores.reindex(task=names).drop_vars([v for v in scores.data_vars if scores[v].isnull().all()])
    depths = run.experiment.get("task_depths") or None
    ds = scores.assign_coords(
        task_group=("task", [facts[t]["group"] for t in names]),
        task_family=("task", [facts[t]["family"] for t in names]),
        task_depth=("task", [int(facts[t]["depth"]) for t in names]),
        # a question at a depth the run trained at (False past them, and for text and a user's tasks)
        task_trained=("task", [facts[t]["group"] in ("knowledge", "reasoning")
                               and int(facts[t]["depth"]) in _trained_depths(facts[t]["family"], depths)
                               for t in names]))
    if not tasks:
        ds = ds.merge(_own_scores(run, windows, examples, facts, rs))
    head = _headline(ds, K)
    ds = ds.assign(head.data_vars)
    ds.attrs = {**provenance(run.model.cfg, seed, checkpoint=str(checkpoint), training_loops=K),
                **{k: v for k, v in scores.attrs.items() if k in ("tasks", "limit", "num_fewshot", "lm_eval_version")}}
    save_results(ds, out_dir, headline=list(head))
    return ds


def summary(ds: xr.Dataset) -> str:
    """Return a few lines saying what was scored and, per task, lm-eval's score at each loop count."""
    K = int(ds.attrs.get("training_loops", 0))
    lines = [f"lm-eval {ds.attrs.get('lm_eval_version', '?')} at loops {[int(r) for r in ds.loop.values]} "
             f"(trained at K={K}); {ds.sizes['task']} tasks"]
    for t in ds.task.values:
        row = ds.sel(task=t)
        for var, unit in (("bits_per_byte", "bits/byte"), ("acc", "accuracy")):
            if var in ds and np.isfinite(row[var].values).any():
                vals = ", ".join(f"{v:.3f}" for v in row[var].values)
                own = ""
                if var == "acc" and "exact_match_wb" in ds and np.isfinite(row.exact_match_wb.values).any():
                    own = "; workbench exact match " + ", ".join(f"{v:.3f}" for v in row.exact_match_wb.values)
                lines.append(f"  {t}: {unit} {vals}{own}")
    if "loss_wb" in ds:
        lines.append("  workbench loss on the same windows (nats/token): "
                     + ", ".join(f"{v:.3f}" for v in ds.loss_wb.values))
    return "\n".join(lines)
