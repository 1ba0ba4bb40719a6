"""lm-evaluation-harness on a looped model at several loop counts: one Dataset with dims (loop, task).

`lm_eval_sweep(model, tokenizer, tasks, loops=[1, 2, 4, 8])` wraps a LoopLM (or takes a
`LoopLMForCausalLM`) in lm-eval's `HFLM` once and calls `lm_eval.simple_evaluate` once per loop count
with the model's `config.loops` set to it (`LoopLMForCausalLM.looping`), so every task is scored by
the same weights at each r. Tasks are lm-eval task names, or tasks defined in YAML files under
`include_path` (a local task: a YAML naming `dataset_path: json` and local `data_files`). Each metric
becomes one variable over (loop, task) (`acc`, `acc_norm`, `bits_per_byte`, ...), its standard error
`<metric>_stderr` beside it; a metric a task does not report is NaN there. The pipeline step
`experiments.lm_eval.lm_eval_run` (notebook `lm_eval`) writes a run's held-out text and task questions
as local lm-eval tasks (`experiments.lm_eval.write_local_tasks`), scores them with this sweep and writes
the scores to results.nc beside the workbench's own evaluation of the same documents.

Needs the `eval` extra (`pip install 'looped-workbench[eval]'`: lm-eval and transformers >= 5.24).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import io
import logging
import math
import os
import sys
import tempfile
from collections.abc import Sequence

import numpy as np
import xarray as xr

from ..config import check_bool, check_int, fail
from .hf_looped import as_hf, check_loops, hf_tokenizer


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ImportError(f"lm_eval_sweep needs lm-eval ({e}): pip install 'looped-workbench[eval]'") from None
    return lm_eval, HFLM, TaskManager


@contextlib.contextmanager
def _quiet():
    """Hold back lm-eval's and datasets' warnings and progress bars (hundreds of lines in a notebook); errors still show."""
    import datasets

    loggers = [logging.getLogger(n) for n in ("lm_eval", "datasets")]
    levels = [g.level for g in loggers]
    bars = datasets.is_progress_bar_enabled()
    for g in loggers:
        g.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    # lm-eval's request bars are tqdm bars on sys.stderr, and it runs `git describe` in the working folder,
    # whose "fatal: not a git repository" reaches file descriptor 2 directly: both are held in a file whose
    # end is shown if the sweep fails
    held = io.TextIOWrapper(tempfile.TemporaryFile(), errors="replace", write_through=True)
    saved = os.dup(2)
    sys.stderr.flush()
    os.dup2(held.fileno(), 2)
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        os.dup2(saved, 2)
        held.seek(0)
        sys.stderr.write(held.read()[-4000:])
        raise
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        held.close()
        for g, level in zip(loggers, levels):
            g.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _number(value) -> float:
    """Return a metric value as a float (NaN for lm-eval's "N/A" and anything else that is not a number)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return math.nan
    return v


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def scores(results: dict) -> dict[str, dict[str, float]]:
    """Return {task: {variable: value}} from a `simple_evaluate` result ("acc,none" -> acc; other filters suffixed).

    A metric under a filter other than "none" is named `<metric>_<filter>`; its standard error
    `<metric>_stderr[_<filter>]`; `n_samples` is the number of documents the task scored.
    """
    out: dict[str, dict[str, float]] = {}
    counts = results.get("n-samples", {}) or {}
    for task, row in (results.get("results") or {}).items():
        vals = {}
        for key, value in row.items():
            if "," not in key:  # "alias", "name", ...: labels, not scores
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}_{filt}"
            vals[name] = _number(value)
        n = counts.get(task, {})
        if isinstance(n, dict) and "effective" in n:
            vals["n_samples"] = float(n["effective"])
        out[task] = vals
    return out


def lm_eval_sweep(model, tokenizer, tasks: str | Sequence[str], loops: Sequence[int], *,
                  include_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                  limit: int | float | None = None, num_fewshot: int | None = None, batch_size: int = 1,
                  bootstrap_iters: int = 1000, seed: int = 0, device: str | None = None,
                  include_defaults: bool | None = None, quiet: bool = True,
                  **evaluate_kwargs) -> xr.Dataset:
    """Return an xarray Dataset of lm-eval scores with dims (loop, task): one `simple_evaluate` per loop count.

    model: a LoopLM or LoopLMForCausalLM; tokenizer: a workbench Tokenizer or a PreTrainedTokenizerFast.
    tasks: lm-eval task names, or those of YAML files under `include_path`; lm-eval's own tasks are
    indexed (about 30 s) without include_path, when a name is not found there, or with
    include_defaults=True (False: never). loops: loop counts r >= 1.
    limit, num_fewshot, bootstrap_iters (standard errors; 0 skips them) and seed (every lm-eval seed)
    go to `simple_evaluate`, as do `evaluate_kwargs`; batch_size to HFLM. The model runs where it is
    (`device` moves it first). `quiet` holds back lm-eval's warnings and progress bars. Attrs:
    config_json, lm_eval_version, workbench_version, tasks, created.
    """
    lm_eval, HFLM, TaskManager = _lm_eval()
    names = [tasks] if isinstance(tasks, str) else list(tasks) if isinstance(tasks, Sequence) else None
    if not names or not all(isinstance(t, str) and t for t in names):
        fail("tasks", tasks, "must be a task name or a non-empty list of task names")
    if isinstance(loops, (str, bytes)) or not isinstance(loops, Sequence) or not loops:
        fail("loops", loops, "must be a non-empty list of loop counts (integers >= 1)")
    rs = [check_loops(r, f"loops[{i}]") for i, r in enumerate(loops)]
    if len(set(rs)) != len(rs):
        fail("loops", list(loops), "must not repeat a loop count")
    check_int("batch_size", batch_size, 1)
    check_int("bootstrap_iters", bootstrap_iters, 0)
    check_int("seed", seed, 0)
    paths = None
    if include_path is not None:
        paths = [include_path] if isinstance(include_path, (str, os.PathLike)) else list(include_path)
        for p in paths:
            if not os.path.isdir(p):
                fail("include_path", str(p), "must be a folder of lm-eval task YAML files")
        paths = [os.fspath(p) for p in paths]
    hf = as_hf(model, tokenizer)
    if device is not None:
        hf = hf.to(device)
    tok = hf.tokenizer if hf.tokenizer is not None else hf_tokenizer(tokenizer, hf.config.max_position_embeddings)
    was_training = hf.training
    hf.eval()
    if include_defaults is not None:
        check_bool("include_defaults", include_defaults)
    check_bool("quiet", quiet)
    with _quiet() if quiet else contextlib.nullcontext():
        manager = TaskManager(include_path=paths, include_defaults=False) if paths else None
        # indexing lm-eval's own tasks takes ~30 s: only when a name is not among the local ones (or when asked)
        if manager is None or include_defaults or (include_defaults is None and not set(names) <= set(manager.all_tasks)):
            manager = TaskManager(include_path=paths)
        unknown = [t for t in names if t not in manager.all_tasks]
        if unknown:
            fail("tasks", unknown, "names tasks lm-eval does not know" + (f" (nor the YAML files under {paths})" if paths
                                                                          else " (give include_path for local task YAMLs)"))
        lm = HFLM(pretrained=hf, tokenizer=tok, backend="causal", batch_size=batch_size,
                  max_length=hf.config.max_position_embeddings)
        per_loop = []
        try:
            for r in rs:
                with hf.looping(r):
                    res = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                                  num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters,
                                                  random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                                  fewshot_random_seed=seed, log_samples=False, **evaluate_kwargs)
                per_loop.append(scores(res))
        finally:
            hf.train(was_training)
    task_names = sorted({t for s in per_loop for t in s})
    variables = sorted({v for s in per_loop for row in s.values() for v in row})
    data = {v: (("loop", "task"), np.array([[s.get(t, {}).get(v, np.nan) for t in task_names] for s in per_loop],
                                           dtype=float)) for v in variables}
    return xr.Dataset(data, coords={"loop": rs, "task": task_names}, attrs={
        "config_json": hf.config.looped.to_json(), "training_loops": hf.config.looped.loops,
        "tasks": ",".join(names), "limit": -1 if limit is None else float(limit),
        "num_fewshot": -1 if num_fewshot is None else int(num_fewshot), "seed": seed,
        "lm_eval_version": _version("lm-eval"), "workbench_version": _version("looped-workbench"),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})

