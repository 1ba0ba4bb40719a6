"""Experiment glue the notebooks call: train one config end to end, reopen a run, build law tables.

`train_run` writes the one run-folder layout of `workbench.io` (config.json, tokenizer.json,
checkpoints, metrics.nc), the layout `workbench train --out` writes too (it calls `train_run`), plus
`results.nc`: loss/accuracy per loop, training curve, N_once, N_rec, tokens, ...

`load_run(path)` reopens a run folder, a checkpoint folder in one, or an older layout (`io.open_run`);
`Run.val_tokens` rebuilds validation batches of the same corpus and tokenizer (config.json's "data"),
so probes downstream see held-out text.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch
import xarray as xr

from ..config import LoopConfig, check_bool, check_float, check_int, fail
from ..io import (RUN_CONFIG, TOKENIZER, RunDir, clear_run, holds_run, provenance, read_json,
                  refuse_foreign_files, save_results, write_run_config)
from ..locking import RunLock
from .run_results import load_results

TASK_DEPTHS = {"deduction": (1, 2, 3), "kinship": (2, 3, 4), "iterated": (1, 2, 3, 4), "recall": (0,)}


def _trained_depths(name: str, depths: Sequence[int] | None) -> list[int]:
    """Return the depths task `name` is trained at: `depths` (one list for every task), else TASK_DEPTHS."""
    return [0] if name == "recall" else list(depths or TASK_DEPTHS.get(name, (1,)))


def _eval_depths(name: str, depths: Sequence[int] | None) -> list[int]:
    """Return the trained depths of a reasoning task and the depths past them, up to twice the deepest."""
    from ..data.tasks import REASONING, depth_range, task_group

    trained = _trained_depths(name, depths)
    if task_group(name) != REASONING:
        return trained
    top, hi = max(trained), depth_range(name)[1]
    return sorted(set(trained) | {d for d in range(top + 1, 2 * top + 1) if hi is None or d <= hi})


def _task_examples(tasks: Sequence[str], depths: Sequence[int] | None, n: int, seed: int,
                   beyond: bool = False, options: dict | None = None, world_seed: int | None = None) -> list:
    """Return n examples per task and depth; recall asks about the world of `world_seed` (default `seed`)."""
    from ..data.tasks import make_task

    out = []
    for name in tasks:
        # recall's seed is its world (which countries, which facts): held-out recall questions must ask
        # about the facts the model was trained on, so they take the training seed, not the held-out one
        s = world_seed if name == "recall" and world_seed is not None else seed
        for d in (_eval_depths(name, depths) if beyond else _trained_depths(name, depths)):
            out.extend(make_task(name, n, d, seed=s, **(options or {}).get(name, {})))
    return out


def check_task_options(task_options: Any, tasks: Sequence[str]) -> dict:
    """Return task_options ({task: {option: value}}) after checking each task is trained and each option valid."""
    from ..data.tasks import depth_range, make_task, task_options as options_of

    if task_options is None:
        return {}
    if not isinstance(task_options, dict):
        fail("task_options", task_options, "must be a mapping {task name: {option: value}}")
    for name, opts in task_options.items():
        if name not in tasks:
            fail(f"task_options[{name!r}]", opts, f"names a task that is not trained; tasks are {list(tasks)}")
        if not isinstance(opts, dict):
            fail(f"task_options[{name!r}]", opts, f"must be a mapping of options of {name!r}: {options_of(name)}")
        try:  # one example at the lowest depth: the generator's own checks name the option and what it allows
            make_task(name, 1, depth_range(name)[0], **opts)
        except ValueError as e:
            raise ValueError(f"task_options[{name!r}]: {e}") from None
    return task_options


def task_results(ts: xr.Dataset, tasks: Sequence[str], depths: Sequence[int] | None,
                 options: dict | None = None) -> xr.Dataset:
    """Return per-loop task accuracy with its count, majority-class chance, trained-depth mask, and group means.

    `ts` is `loop_sweep` over task examples. `group_accuracy` averages the examples at the depths a task
    was trained at; `group_accuracy_beyond` those past them (NaN for a group with none); `task_chance` is
    `data.tasks.chance_rate` for every (task, depth) cell, to read beside every accuracy, and
    `group_chance` / `group_chance_beyond` the same examples' chance per group.
    """
    from ..data.tasks import chance_rate

    trained = xr.DataArray([[int(d) in _trained_depths(t, depths) for d in ts.depth.values] for t in ts.task.values],
                           dims=("task", "depth"), coords={"task": ts.task, "depth": ts.depth})
    chance = xr.DataArray([[chance_rate(t, int(d), **(options or {}).get(t, {})) if c > 0 else np.nan for d, c in zip(ts.depth.values, row)]
                           for t, row in zip(ts.task.values, ts["count"].values)],
                          dims=("task", "depth"), coords={"task": ts.task, "depth": ts.depth})
    out = xr.Dataset({"task_accuracy": ts.accuracy, "task_count": ts["count"],
                      "task_chance": chance.assign_attrs(long_name="majority-class chance (share of the most "
                                                                   "common answer)"),
                      "task_trained": trained.assign_attrs(long_name="depth seen in training")})
    return out.merge(group_pool(ts.accuracy, ts["count"], chance, ts.task_group, trained))


def group_pool(accuracy: xr.DataArray, count: xr.DataArray, chance: xr.DataArray, task_group: xr.DataArray,
               trained: xr.DataArray) -> xr.Dataset:
    """Return per task group the examples at the trained depths pooled (and, `*_beyond`, those past them).

    From per-cell (task, depth) `accuracy` (over loop), `count`, `chance` and the `trained` mask:
    `group_accuracy` (loop, group), `group_count` and the count-weighted `group_chance` (group); NaN for
    a group with no such examples. `task_results` and the findings summaries both pool through this.
    """
    hits = (accuracy * count).fillna(0)
    groups = sorted(set(task_group.values.tolist()))
    out = xr.Dataset(coords={"group": groups})
    for suffix, mask in (("", trained), ("_beyond", ~trained)):
        vals, chances, ns = [], [], []
        for g in groups:
            sel = (task_group == g) & mask
            n = float(count.where(sel).sum())
            total = hits.where(sel).sum(("task", "depth"))
            vals.append(total / n if n else xr.full_like(total, np.nan))  # a group with no such examples
            chances.append(float((chance.fillna(0) * count.where(sel, 0)).sum()) / n if n else np.nan)
            ns.append(n)
        out[f"group_accuracy{suffix}"] = xr.concat(vals, dim="group").assign_coords(group=groups).transpose("loop", "group")
        # the chance the same examples give, to draw and quote beside the group's accuracy
        out[f"group_chance{suffix}"] = ("group", chances,
                                        {"long_name": "majority-class chance of the same examples (count-weighted)"})
        out[f"group_count{suffix}"] = ("group", ns, {"long_name": "examples pooled"})
    return out


def mixed_corpus(corpus: str = "stdlib", tasks: Sequence[str] = (), task_ratio: float = 0.2,
                 task_depths: Sequence[int] | None = None, n_per_depth: int = 2000, seed: int = 0,
                 task_options: dict | None = None):
    """Return a Corpus: the named text source, with synthetic task texts mixed in when `tasks` is non-empty.

    `task_ratio` is the share of the stream's characters that are task text: the examples (cycled,
    joined by newlines) are cut into documents of the corpus's median document length and inserted at
    seeded positions. With "recall" among the tasks, the facts it queries (`recall_facts`) are added as
    training text, so recall measures knowledge stored in the weights.
    """
    from ..data.corpus import Corpus, load_corpus
    from ..data.tasks import mix_texts, recall_facts

    base = load_corpus(corpus)
    if not tasks:
        return base
    examples = _task_examples(tasks, task_depths, n_per_depth, seed, options=task_options)
    texts = [ex.text for ex in examples]
    if "recall" in tasks:
        texts += recall_facts((task_options or {}).get("recall", {}).get("n_entities", 100), seed=seed) * 5
    random.Random(seed).shuffle(texts)  # depths and tasks interleaved, not in blocks
    # "chars-v2": task_ratio once counted items (a 50-byte example against an 8 kB source file), which put
    # 0.1% task text into the stream at task_ratio 0.3; the key changes so no cache of that mix is reused
    key = hashlib.sha256(json.dumps([base.content_hash, sorted(tasks), task_ratio, list(task_depths or []),
                                     n_per_depth, seed, "chars-v2", task_options or {}],
                                    sort_keys=True).encode()).hexdigest()

    def documents():
        docs = list(base.documents())
        size = int(np.median([len(d) for d in docs])) if docs else 4096
        want = task_ratio / (1.0 - task_ratio) * sum(len(d) for d in docs)  # task characters
        task_docs, cur, cur_len, n, i = [], [], 0, 0, 0
        while n < want:
            t = texts[i % len(texts)]
            cur.append(t)
            cur_len, n, i = cur_len + len(t) + 1, n + len(t) + 1, i + 1
            if cur_len >= size or n >= want:
                task_docs.append("\n".join(cur))
                cur, cur_len = [], 0
        share = len(task_docs) / (len(task_docs) + len(docs))  # mix_texts counts items
        return iter(mix_texts(docs, task_docs, share, seed=seed)) if task_docs else iter(docs)

    return Corpus(f"{corpus}+{'+'.join(tasks)}", documents, fingerprint=key,
                  options={"tasks": ",".join(tasks), "task_ratio": task_ratio, "seed": seed})


@dataclass
class Run:
    """A trained model reopened from its run folder: model, tokenizer, how its data was made (config.json's "data")."""

    model: Any
    tokenizer: Any
    experiment: dict
    path: Path
    _data: Any = field(default=None, repr=False)

    def data(self):
        """Return the TokenData (train/val token arrays) of the run's corpus and tokenizer (cached on disk)."""
        if self._data is None:
            from ..data.corpus import tokenize_corpus

            e = self.experiment
            if "corpus" not in e:
                raise ValueError(f"the run at {self.path} does not record its corpus (no \"data\" in config.json, "
                                 "no experiment.json): retrain it with `workbench train` or train_run to get "
                                 "validation text")
            corpus = mixed_corpus(e["corpus"], e.get("tasks", []), e.get("task_ratio", 0.2),
                                  e.get("task_depths") or None, seed=_data_seed(e),
                                  task_options=e.get("task_options") or None)
            self._data = tokenize_corpus(corpus, self.tokenizer, progress=False)
        return self._data

    def val_tokens(self, n: int = 8, seq_len: int = 128, seed: int = 0) -> torch.Tensor:
        """Return n held-out validation windows [n, seq_len + 1] (LongTensor) of the run's corpus."""
        from ..data.corpus import BatchSampler

        seq_len = min(seq_len, self.model.cfg.max_seq_len)
        return next(BatchSampler(np.asarray(self.data().val), n, seq_len, seed=seed))

    def task_examples(self, n: int = 64, seed: int = 1_000_003, beyond: bool = True) -> list:
        """Return n held-out task examples per task and depth (a seed the training mix never used).

        Recall questions ask about the facts the run trained on (its world is the run's data seed).
        With `beyond` (default) reasoning tasks are also drawn past their deepest trained depth, up to
        twice it, so accuracy can be read beyond the training depth.
        """
        e = self.experiment
        return _task_examples(e.get("tasks", []), e.get("task_depths") or None, n, seed,
                              beyond=check_bool("beyond", beyond), options=e.get("task_options") or None,
                              world_seed=_data_seed(e))


def _data_seed(experiment: dict) -> int:
    """Return the seed of a run's text, tokenizer and task world (`data_seed`; runs before it had only `seed`)."""
    d = experiment.get("data_seed")
    return int(experiment.get("seed", 0) if d is None else d)


def load_run(path: str | os.PathLike, device=None) -> Run:
    """Return the Run saved at `path`: a run folder, a checkpoint folder in one, or an older layout (io.open_run).

    The model is in eval mode on `device` (default CUDA when present, else CPU).
    """
    from ..io import find_run, open_run, read_run_config

    run_dir, _ = find_run(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = open_run(path, device=device)
    return Run(model, tok, read_run_config(path)["data"], run_dir)


def _int_list(field: str, value: Any, lo: int, allow_none: bool = True) -> list[int] | None:
    """Return value as a list of integers >= lo (None stays None when allowed), else fail naming the element."""
    if value is None and allow_none:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        fail(field, value, f"must be {'None or ' if allow_none else ''}a list of integers >= {lo}")
    return [check_int(f"{field}[{i}]", v, lo) for i, v in enumerate(value)]


def check_train_run(model: dict, train: dict, corpus: str = "stdlib", vocab_size: int = 2048,
                    tasks: Sequence[str] = (), task_ratio: float = 0.2, task_depths: Sequence[int] | None = None,
                    eval_loops: Sequence[int] | None = None, seed: int = 0, progress: bool = False,
                    resume: bool = True, overwrite: bool = False, task_options: dict | None = None,
                    data_seed: int | None = None):
    """Return (LoopConfig, TrainConfig) that train_run's arguments describe, checking every one before any work.

    The LoopConfig's vocab_size is the one asked for (the tokenizer's real size replaces it later).
    Raises ValueError naming the argument or config field, its value and what is allowed.
    """
    from ..data.corpus import SOURCES, SPECIAL_TOKENS
    from ..data.sources import check_source_name
    from ..data.tasks import TASKS
    from ..train import TrainConfig, check_fit, check_history_trains

    if not isinstance(model, dict):
        fail("model", model, "must be a mapping of LoopConfig fields")
    if not isinstance(train, dict):
        fail("train", train, "must be a mapping of TrainConfig fields")
    try:
        check_source_name(corpus)
    except ValueError:
        fail("corpus", corpus, f"must be one of {', '.join(SOURCES)} (a [:BYTES] cap on a file source)")
    check_int("vocab_size", vocab_size, 256 + len(SPECIAL_TOKENS),
              allowed=f"must be an integer >= {256 + len(SPECIAL_TOKENS)} (256 bytes + the end-of-text id)")
    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, (list, tuple)):
        fail("tasks", tasks, f"must be a list of task names from {', '.join(TASKS)}")
    for i, name in enumerate(tasks):
        if name not in TASKS:
            fail(f"tasks[{i}]", name, f"must be one of {', '.join(TASKS)}")
    check_float("task_ratio", task_ratio, 0, 1, hi_open=True,
                allowed="must be a number with 0 <= task_ratio < 1 (the share of the text's characters)")
    _int_list("task_depths", task_depths, 0)
    check_task_options(task_options, tasks)
    if eval_loops is not None and not _int_list("eval_loops", eval_loops, 1):
        fail("eval_loops", eval_loops, "must be None or a non-empty list of integers >= 1")
    check_int("seed", seed, 0)
    if data_seed is not None:
        check_int("data_seed", data_seed, 0, allowed="must be None (the same as seed) or an integer >= 0")
    for name, v in (("progress", progress), ("resume", resume), ("overwrite", overwrite)):
        check_bool(name, v)
    if resume and overwrite:
        fail("overwrite", overwrite, "must be False with resume=True: continue the run or replace it, not both")
    cfg = LoopConfig.from_dict({"vocab_size": vocab_size, **model})
    # periodic checkpoints: a killed pipeline run resumes from the last one instead of starting over
    tc = TrainConfig.from_dict({"seed": seed, "progress": progress, "checkpoint_every": 100, **train})
    check_fit(cfg, tc)
    check_history_trains(cfg, tc)  # a run starts from scratch: a lag its loops never reach is a wasted arm
    return cfg, tc


def _resume_conflicts(out: Path, cfg: LoopConfig, tc, experiment: dict) -> None:
    """Raise ValueError naming every field in which the run at `out` (its config.json) differs from this one."""
    from ..train import RESUME_FIELDS

    conf = read_json(out / RUN_CONFIG, "run config")
    if not isinstance(conf, dict):
        fail(str(out / RUN_CONFIG), conf, "must be a JSON object with model, train and data")
    diff = {}
    now_model = cfg.to_dict()
    for k, v in (conf.get("model") or {}).items():
        if k != "vocab_size" and k in now_model and now_model[k] != v:  # the tokenizer fixes vocab_size
            diff[f"model.{k}"] = (v, now_model[k])
    now_train = json.loads(tc.to_json())
    for k in RESUME_FIELDS:
        if k in (conf.get("train") or {}) and conf["train"][k] != now_train[k]:
            diff[f"train.{k}"] = (conf["train"][k], now_train[k])
    for k, v in experiment.items():
        if k in (conf.get("data") or {}) and conf["data"][k] != v:
            diff[f"data.{k}"] = (conf["data"][k], v)
    if diff:
        shown = "; ".join(f"{k}: {a!r} then, {b!r} now" for k, a, b in ((k, *ab) for k, ab in diff.items()))
        raise ValueError(f"cannot resume the run at {out}: it was made with other settings ({shown}); keep them, "
                         "or start a new run (another folder, or overwrite=True / --overwrite)")


def _train_run_processes(nproc: int, kwargs: dict) -> tuple[Run, xr.Dataset]:
    """Return train_run's (Run, results) after running it under `torchrun --nproc_per_node nproc` on this machine.

    The processes split this process's torch threads; their output is kept and its end shown when they fail.
    """
    import subprocess
    import sys
    import tempfile

    threads = max(1, torch.get_num_threads() // nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as tmp:
        args = Path(tmp) / "train_run.json"
        args.write_text(json.dumps(kwargs))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={nproc}", "-m", "workbench.experiments.torchrun_train", str(args)],
                              env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"train_run on nproc={nproc} processes (torchrun) failed with exit status "
                           f"{proc.returncode}; the end of its output:\n{tail}")
    out = Path(kwargs["out_dir"])
    return load_run(out), xr.load_dataset(RunDir(out).results, engine="h5netcdf")


def train_run(out_dir: str | os.PathLike, model: dict, train: dict, corpus: str = "stdlib", vocab_size: int = 2048,
              tasks: Sequence[str] = (), task_ratio: float = 0.2, task_depths: Sequence[int] | None = None,
              eval_loops: Sequence[int] | None = None, seed: int = 0, progress: bool = False,
              resume: bool = True, overwrite: bool = False, nproc: int = 1,
              task_options: dict | None = None, data_seed: int | None = None) -> tuple[Run, xr.Dataset]:
    """Return (Run, results Dataset) after training LoopConfig(**model) with TrainConfig(**train) on a corpus.

    `out_dir` becomes a run folder (layout in `workbench.io`). Every argument is checked first
    (`check_train_run`), before anything is read or written. With `resume=True` (default) training
    continues from its latest checkpoint when one exists (an interrupted pipeline run picks up where it
    stopped) and the saved tokenizer is reused; a run made with another model, data or trajectory
    setting (seed, lr, ...) is refused naming the fields. With `resume=False` a folder that already
    holds a run is refused unless `overwrite=True`, which removes the old run first. Results:
    validation loss and accuracy per loop (below, at and beyond K), the training curve, the parameter
    split N_once / N_rec, tokens seen, and per-loop task accuracy when tasks are mixed in. The same
    data is written to `out_dir/results.nc`, with `window_loss` (each held-out window's loss per loop
    count, the unit a paired comparison between two runs of one data seed resamples).

    `seed` draws the weights and the batch order; `data_seed` (default: `seed`) the text mix, the
    tokenizer's sample and the recall world. Runs that share a data seed share a tokenizer, so their
    losses are in the same units and seeds can replicate one comparison.

    Under torchrun (`torchrun --nproc_per_node N ...`) every process calls it alike: they join the
    process group (`train.init_distributed`) and train data-parallel; rank 0 alone writes the folder
    (tokenizer, config, checkpoints, metrics, results) and the other ranks read the tokenizer it wrote.
    `nproc` > 1 (outside torchrun) starts that itself: `nproc` processes on this machine, each with its
    share of this process's torch threads (what a pipeline's training run with an `nproc` parameter does).
    """
    from ..data.corpus import tokenize_corpus
    from ..evals import loop_sweep, loss_headline
    from ..train import Trainer, init_distributed

    cfg, tc = check_train_run(model, train, corpus, vocab_size, tasks, task_ratio, task_depths, eval_loops, seed,
                              progress, resume, overwrite, task_options, data_seed)
    check_int("nproc", nproc, 1)
    data_seed = seed if data_seed is None else data_seed
    if nproc > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return _train_run_processes(nproc, dict(out_dir=str(out_dir), model=model, train=train, corpus=corpus,
                                                vocab_size=vocab_size, tasks=list(tasks), task_ratio=task_ratio,
                                                task_depths=task_depths, eval_loops=eval_loops, seed=seed,
                                                progress=progress, resume=resume, overwrite=overwrite,
                                                task_options=task_options, data_seed=data_seed))
    rank, world, _ = init_distributed()  # (0, 1, None) alone

    def barrier() -> None:
        if world > 1:
            torch.distributed.barrier()

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        fail("out_dir", str(out_dir), "must be a folder (it is a file)")
    # one writer per run folder: another training, an --overwrite or a pipeline run there is refused, naming it
    with RunLock(out, f"training (train_run, {world} process{'es' if world > 1 else ''})") if rank == 0 \
            else contextlib.nullcontext():
        experiment = {"corpus": corpus, "tasks": list(tasks), "task_ratio": task_ratio,
                      "task_depths": list(task_depths or []), "seed": seed, "data_seed": data_seed,
                      **({"task_options": task_options} if task_options else {})}
        _prepare_folder(out, cfg, tc, {**experiment, "vocab_request": vocab_size}, resume, overwrite, rank, barrier)
        text = mixed_corpus(corpus, tasks, task_ratio, task_depths, seed=data_seed, task_options=task_options)
        tok = _tokenizer(out, text, vocab_size, data_seed, resume, rank, barrier)
        data = tokenize_corpus(text, tok, progress=progress and rank == 0)
        experiment = {**experiment, "vocab_size": tok.vocab_size, "vocab_request": vocab_size}

        cfg = cfg.replace(vocab_size=tok.vocab_size) if "vocab_size" not in model else cfg
        if rank == 0:
            write_run_config(out, cfg, tc, experiment)
        t0 = time.perf_counter()
        trainer = Trainer(cfg, tc, data.train, data.val, out_dir=out, resume=resume)
        metrics = trainer.run()
        wall = time.perf_counter() - t0
        net = trainer.model.eval()
        K = cfg.loops
        loops = sorted(set(eval_loops or [1, max(1, K // 2), K, 2 * K, 4 * K]) | {K})  # K: final_loss is read there
        run = Run(net, tok, experiment, out, data)
        ds = _results(run, trainer, metrics, loops, wall)
        if tasks:
            ts = loop_sweep(net, run.task_examples(), loops, tokenizer=tok, progress=False, bf16=trainer.bf16)
            ds.update(task_results(ts, tasks, task_depths, task_options))
        ds.attrs = provenance(cfg, seed, train_config=tc.to_json(), corpus=corpus, tasks=",".join(tasks),
                              training_loops=K, notation=cfg.notation, tokenizer=tok.fingerprint,
                              **{f"model_{k}": v for k, v in model.items() if isinstance(v, (int, float, str))},
                              **trainer.speed_attrs())  # precision, compile and why: what "auto" chose here
        head = loss_headline(ds["loss"], K)  # the report shows the best loop count and the loss there and at K
        ds = ds.assign(head.data_vars)
        if rank == 0:
            save_results(ds, out, headline=list(head))
        return run, ds


def _prepare_folder(out: Path, cfg: LoopConfig, tc, experiment: dict, resume: bool, overwrite: bool, rank: int,
                    barrier: Callable[[], None]) -> None:
    """Return None once the run folder may be written: a run there resumed (same settings) or replaced, or a new one.

    Refuses a held run without resume / overwrite, a resumed run with other settings (naming them) and
    someone's own files; rank 0 alone changes the folder, after every rank has checked it as it was.
    """
    if holds_run(out):
        if resume and (out / RUN_CONFIG).is_file():
            _resume_conflicts(out, cfg, tc, experiment)
        elif not resume and not overwrite:
            raise FileExistsError(f"out_dir={str(out)!r} already holds a run (config.json, tokenizer.json or "
                                  "checkpoints): resume it (resume=True, `workbench train --resume`) or replace it "
                                  "(overwrite=True, `--overwrite`); nothing was changed")
        elif overwrite and rank == 0:
            clear_run(out)  # latest.json goes first: an interrupted overwrite never looks like the old run
    elif rank == 0:
        refuse_foreign_files(out, overwrite)  # someone's metrics.nc / results.nc: never overwritten unasked
    barrier()  # rank 0 changes the folder only after every rank has checked it as it was
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)


def _tokenizer(out: Path, text: str, vocab_size: int, data_seed: int, resume: bool, rank: int,
               barrier: Callable[[], None]):
    """Return the run's tokenizer: the one saved in the folder when resuming, else one trained by rank 0 and saved."""
    from ..data.corpus import Tokenizer, train_tokenizer

    tok_path = out / TOKENIZER
    tok = None
    if rank == 0 and not (resume and tok_path.exists()):
        tok = train_tokenizer(text, vocab_size=vocab_size, max_train_bytes=2_000_000, seed=data_seed)
        tok.save(tok_path)
    barrier()  # the tokenizer rank 0 kept or made is on disk: the other ranks read that one
    if tok is None:
        try:
            tok = Tokenizer.load(tok_path)
        except Exception as e:  # the tokenizers library raises its own exception types
            raise ValueError(f"cannot read the tokenizer at {tok_path} (truncated or corrupt?): {e}") from None
    return tok


def _results(run: Run, trainer, metrics: xr.Dataset, loops: list[int], wall: float) -> xr.Dataset:
    """Return a trained run's results: validation loss per loop (each window's too), the curve and its sizes."""
    from ..evals import loop_sweep

    net, tc, K = run.model, trainer.tc, run.model.cfg.loops
    val = torch.cat(trainer.val_batches)
    sweep = loop_sweep(net, val, loops, progress=False, bf16=trainer.bf16, per_sequence=True)  # as it was trained
    r_train = float(np.mean(metrics.loops.values))
    k_train = float(np.mean(metrics.backward_loops.values))
    pc = net.param_counts()
    steps = int(metrics.sizes["step"])
    ds = xr.Dataset(
        {"loss": sweep["loss"].assign_attrs(long_name="validation loss (nats/token)"),
         "accuracy": sweep["accuracy"].assign_attrs(long_name="validation next-token accuracy"),
         "train_loss": ("step", metrics.loss.values, {"long_name": "training loss"}),
         "lr": ("step", metrics.lr.values),
         "window_loss": sweep["sequence_loss"].rename(sequence="window").assign_attrs(
             long_name="validation loss of each held-out window (nats/token)")},
        coords={"step": metrics.step.values})
    if "eval_loss" in metrics:
        # its own loop dim: the Trainer's eval loop counts differ from the final sweep's
        ds["eval_loss"] = metrics.eval_loss.rename(loop="eval_loop")
    tokens_seen = steps * tc.batch_size * tc.seq_len * trainer.world  # batch_size is per process
    scalars = {"n_once": pc["once"], "n_rec": pc["rec"], "n_embed": pc["embed"], "tokens": tokens_seen,
               "train_loops": r_train, "backward_loops": k_train, "final_loss": float(sweep["loss"].sel(loop=K)),
               "flops_per_token": net.flops_per_token(loops=round(r_train), backward_loops=max(1, round(k_train))),
               "wall_s": wall, "compile_s": float(metrics.compile_s.sum())}
    for k, v in scalars.items():
        ds[k] = ((), float(v))
    return ds


# train_run's own arguments among the train notebook's parameters; every other parameter names a LoopConfig or
# TrainConfig field (LoopConfig first: `loops` is K), found from the dataclasses' fields, so a field gains a
# notebook parameter by one line in the notebook's parameters cell and reaches no mapping here
RUN_PARAMETERS = ("corpus", "vocab_size", "tasks", "task_ratio", "task_depths", "task_options", "eval_loops", "seed",
                  "data_seed", "nproc")


def passed(fn: Callable, namespace: dict) -> dict:
    """Return the entries of namespace (a notebook's globals) that fn takes as keyword arguments.

    A notebook passes its parameters on with `fn(**passed(fn, globals()))`, so each is declared once, in
    its parameters cell, instead of again in the call.
    """
    import inspect

    if hasattr(fn, "notebook_parameters"):  # fn(**params) names what it takes itself
        names = fn.notebook_parameters()
    else:
        sig = inspect.signature(fn).parameters
        names = [n for n, p in sig.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return {n: namespace[n] for n in names if n in namespace}


def _train_notebook_parameters() -> tuple[str, ...]:
    """Return every parameter name train_notebook_args takes (run arguments, then LoopConfig and TrainConfig fields)."""
    import dataclasses

    from ..train import TrainConfig

    fields = [f.name for cls in (LoopConfig, TrainConfig) for f in dataclasses.fields(cls)]
    extra = ("model_overrides", "train_overrides", "out_dir")
    return tuple(dict.fromkeys([*RUN_PARAMETERS, *fields, *extra]))


def train_notebook_args(**params) -> dict:
    """Return train_run's keyword arguments (model, train, corpus, ...) from the train notebook's parameters.

    One mapping for the notebook and the pipeline's check, read off the config dataclasses: a parameter
    named like a LoopConfig field goes to the model, one named like a TrainConfig field to training, the
    rest (`RUN_PARAMETERS`) to train_run; `model_overrides` and `train_overrides` reach any other field.
    A parameter not given keeps its default there (LoopConfig, TrainConfig, train_run): the notebook's
    parameters cell holds the notebook's own defaults. Given, these are mapped: flops > 0 replaces steps
    (0 keeps steps; below 0 is an error), backward_loops 0 is full BPTT, max_seq_len is max(seq_len, 512),
    warmup a tenth of the steps up to 20, data_seed -1 is seed. `batch_size` is the global batch: with
    nproc > 1 processes each trains batch_size / nproc rows, so nproc changes how a run trains, not what.
    Raises ValueError naming a parameter whose name, type or range is wrong.
    """
    import dataclasses

    from ..train import TrainConfig

    known = _train_notebook_parameters()
    for name in params:
        if name not in known:
            fail(name, params[name], "is not a parameter of the train notebook (a LoopConfig or TrainConfig field, "
                 f"or one of {', '.join(RUN_PARAMETERS)}, model_overrides, train_overrides)")
    params = dict(params)
    params.pop("out_dir", None)
    model_fields = {f.name for f in dataclasses.fields(LoopConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = {}
    for name, owner in (("model_overrides", "LoopConfig"), ("train_overrides", "TrainConfig")):
        given = params.pop(name, None)
        given = {} if given is None else given
        if not isinstance(given, dict):
            fail(name, given, f"must be a mapping of {owner} fields")
        overrides[name] = given
    nproc = check_int("nproc", params.get("nproc", 1), 1)
    for name in ("seq_len", "steps", "batch_size"):
        if name in params:
            check_int(name, params[name], 1)
    if "backward_loops" in params:
        check_int("backward_loops", params["backward_loops"], 0, allowed="must be an integer >= 0 (0: full BPTT)")
        params["backward_loops"] = params["backward_loops"] or None
    if "steps" in params:
        params.setdefault("warmup", min(20, params["steps"] // 10))
    if "flops" in params:
        check_float("flops", params["flops"], 0, allowed="must be a finite number >= 0 (0: the budget is steps)")
        if params["flops"] > 0:
            params.pop("steps", None)
        else:
            params.pop("flops")
    if "data_seed" in params:
        check_int("data_seed", params["data_seed"], -1, allowed="must be an integer >= 0, or -1 (the same as seed)")
        params["data_seed"] = None if params["data_seed"] == -1 else params["data_seed"]
    if "batch_size" in params:
        if params["batch_size"] % nproc:
            fail("batch_size", params["batch_size"], f"must be a multiple of nproc={nproc} (each process trains "
                 "batch_size / nproc rows)")
        params["batch_size"] //= nproc
    if "seq_len" in params:
        params.setdefault("max_seq_len", max(params["seq_len"], 512))
    run = {n: params.pop(n) for n in RUN_PARAMETERS if n in params}
    # vocab_size and seed are run arguments (the tokenizer sets the model's vocabulary, train_run the trainer's seed)
    model = {n: v for n, v in params.items() if n in model_fields}
    train = {n: v for n, v in params.items() if n in train_fields and n not in model_fields}
    for key in ("task_depths", "task_options"):  # empty in the notebook: each task's default
        if key in run:
            run[key] = run[key] or None
    if run.get("task_depths") is not None:
        run["task_depths"] = list(run["task_depths"])
    return dict(model={**model, **overrides["model_overrides"]}, train={**train, **overrides["train_overrides"]},
                **run)


train_notebook_args.notebook_parameters = _train_notebook_parameters  # noqa: E305 (read by `passed`)


def check_train_notebook(params: dict) -> None:
    """Return None if the train notebook's parameters make a valid run; else raise ValueError naming the bad one.

    The pipeline calls it (the notebook's metadata names it) for every run before anything runs.
    """
    args = train_notebook_args(**params)
    args.pop("nproc")  # train_run checks it; check_train_run describes one process's run
    check_train_run(**args)


def demo_trainer(steps: int = 200, seed: int = 0, progress: bool = True):
    """Return the Trainer of the demo model (byte-level 1+2x4+1, d=128, 2 MB of stdlib source) after training.

    One recipe for `workbench demo` and the explorer's tiny model, so both show the same model. Token
    ids are raw UTF-8 bytes (256 ids, no end-of-text id); 5% of the bytes are held out for validation.
    """
    from ..data.corpus import stdlib_bytes
    from ..train import Trainer, TrainConfig

    data = np.frombuffer(stdlib_bytes(2_000_000), dtype=np.uint8).astype(np.uint16)
    split = int(0.95 * len(data))
    cfg = LoopConfig(vocab_size=256, d_model=128, n_heads=4, n_kv_heads=2, prelude=1, core=2, coda=1,
                     loops=4, max_seq_len=128, inject="channel")
    tc = TrainConfig(steps=steps, batch_size=16, seq_len=128, lr=1e-2, warmup=min(20, steps), seed=seed,
                     progress=progress)
    trainer = Trainer(cfg, tc, data[:split], data[split:])
    trainer.run()
    return trainer


def law_table(run_dirs: Sequence[str | os.PathLike]) -> pd.DataFrame:
    """Return one row per training run (n_once, n_rec, loops, backward_loops, truncated, tokens, loss, config).

    `loss` is the run's validation loss at its training loop count K (`final_loss` of results.nc);
    `loops` and `backward_loops` are the mean r and k the run trained with. Config fields (d_model,
    hyper, inject, ...) come from the run's config so the table can be grouped by them.
    """
    rows = []
    for d in run_dirs:
        path = RunDir(d).results
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: is {d} a finished training run?")
        with xr.open_dataset(path, engine="h5netcdf") as ds:
            cfg = json.loads(ds.attrs["config_json"])
            # config fields first, so the measured loops (mean r when sampled) replace the config's K
            row = {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, bool))}
            row.update(run=Path(d).name, n_once=float(ds.n_once), n_rec=float(ds.n_rec),
                       loops=float(ds.train_loops), backward_loops=float(ds.backward_loops),
                       tokens=float(ds.tokens), loss=float(ds.final_loss))
            row["truncated"] = bool(row["backward_loops"] < row["loops"])
            rows.append(row)
    if not rows:
        raise ValueError("run_dirs is empty: a law needs at least one finished training run")
    return pd.DataFrame(rows)


def sweep_table(run_dirs: Sequence[str | os.PathLike], var: str = "loss") -> xr.DataArray:
    """Return ds[var] of every run's results.nc stacked along a new dim `run` (coords: run folder names)."""
    arrays = []
    for d in run_dirs:
        arrays.append(load_results(d)[var])
    return xr.concat(arrays, dim="run", join="outer").assign_coords(run=[Path(d).name for d in run_dirs])
