"""The re-entry recipe in phases, each a pipeline step that resumes (issue 30).

The retrofit paper's recipe (loop t computes step t of the iterated task) in four phases, so that a
laptop can run it in sittings of at most about 90 minutes, one after another:
- `install`: per-loop supervision with a curriculum over depth (stage m trains depths first..m);
- `anneal`: from install's weights, grading on each example's final answer only; then the depth sweep
  within and beyond the supervised depth, greedy answers with their wall time, and `loop1_check`;
- `scratchpad`: the same base, budget and examples trained to write the steps as tokens (the baseline);
- `inverse`: from anneal's weights, the inverse rule (x - c) trained alike: what it does to the
  installed rule and to loop 1 (the paper's interference boundary).

Each phase trains through `train_retrofit` with a Trainer folder per stage inside its run folder, so an
interrupted phase resumes from its last checkpoint; a checkpoint keeps only the trainable tensors (the
bridge and adapters, a few MB under the adapter budget) and the frozen base's hash. A phase's setup
(`config.json`) must equal its upstream phase's, field by field. `recipe_run` runs the four in one call
and merges them into the one Dataset the retrofit findings read.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xarray as xr

from ..config import check_choice, check_float, check_int, fail
from ..data.tasks import iterated_examples, scratchpad_examples
from ..io import RunDir, atomic_write_bytes, latest_checkpoint, load_tensors, load_weights, provenance, read_json
from ..io import save_netcdf, save_results
from ..models.hf import missing_model_files
from ..models.retrofit import BUDGETS, retrofit
from .retrofit import (BASE_PATH, _base_and_tokenizer, answer_sweep, check_base, depth_sweep, first_depth, loop1_check,
                       task_examples, train_retrofit)

PHASES = ("install", "anneal", "scratchpad", "inverse")
UPSTREAM = {"anneal": "install", "inverse": "anneal"}  # the phase whose trained weights a phase starts from
LOOP1_VARS = ("loss_diff", "loss_diff_lo", "loss_diff_hi", "knowledge_diff", "non_inferior")


def recipe_setup(base: str = "tiny", prelude: int = 1, core: int = 2, coda: int = 1, budget: str = "adapter",
                 loops: int = 4, adapter_rank: int = 32, steps: int = 800, anneal_steps: int = 200,
                 inverse_steps: int = 0, batch_size: int = 32, lr: float = 3e-3, loop1_distill: float = 0.0,
                 n_train: int = 700, eval_depths: Sequence[int] | None = None, n_eval: int = 40, n_answers: int = 20,
                 rule: str = "add", modulus: int = 10, seed: int = 0) -> dict:
    """Return the recipe's settings, checked, with eval_depths resolved (default 1..ceil(1.5 K) + 1)."""
    check_base(base)
    check_choice("budget", budget, BUDGETS)
    K = check_int("loops", loops, 2)
    for name, value, low in (("prelude", prelude, 0), ("core", core, 1), ("coda", coda, 0), ("steps", steps, 1),
                             ("anneal_steps", anneal_steps, 0), ("inverse_steps", inverse_steps, 0),
                             ("batch_size", batch_size, 1), ("n_train", n_train, 1), ("n_eval", n_eval, 1),
                             ("n_answers", n_answers, 0), ("seed", seed, 0), ("adapter_rank", adapter_rank, 0)):
        check_int(name, value, low)
    check_float("lr", lr, 0, lo_open=True)
    check_float("loop1_distill", loop1_distill, 0)
    check_choice("rule", rule, ("add", "mul", "sub"))
    depths = sorted({check_int("eval_depths", d, 1) for d in (eval_depths or range(1, math.ceil(1.5 * K) + 2))})
    return dict(base=base, prelude=prelude, core=core, coda=coda, budget=budget, loops=K, adapter_rank=adapter_rank,
                steps=steps, anneal_steps=anneal_steps, inverse_steps=inverse_steps, batch_size=batch_size, lr=lr,
                loop1_distill=loop1_distill, n_train=n_train, eval_depths=depths, n_eval=n_eval, n_answers=n_answers,
                rule=rule, modulus=check_int("modulus", modulus, 3, 10**6), seed=seed)


@functools.lru_cache(maxsize=1)
def _base(base: str, layers: int, seed: int):
    """Return (base model, tokenizer), loaded once per process (SmolLM2's GGUF takes tens of seconds)."""
    return _base_and_tokenizer(base, layers, seed)


def _model(setup: dict, loops: int | None = None, bridge: bool = True):
    """Return (looped model, base, tokenizer) as the setup builds it (the scratchpad: loops=1, no bridge)."""
    llama, tok = _base(setup["base"], setup["prelude"] + setup["core"] + setup["coda"], setup["seed"])
    model = retrofit(llama, setup["prelude"], setup["core"], setup["coda"], budget=setup["budget"],
                     loops=loops or setup["loops"], adapter_rank=setup["adapter_rank"], bridge=bridge,
                     seed=setup["seed"])
    return model, llama, tok


def _stages(setup: dict, model) -> tuple[int, list[int]]:
    """Return (first trainable depth, curriculum stages m = max(2, first)..K)."""
    first = first_depth(model)
    return first, list(range(max(2, first), setup["loops"] + 1))


def _warmup(setup: dict) -> int:
    """Return the warm-up steps of each training call (a tenth of the steps, 1 to 10)."""
    return min(10, max(1, setup["steps"] // 10))


def _curriculum(model, tok, setup: dict, total: int, rule: str, folder: Path) -> list[np.ndarray]:
    """Return each stage's training losses after training `total` steps over the curriculum (stage m: first..m).

    Each stage trains in `folder/stage-m` (resumable); an even share of the steps goes to each stage.
    """
    first, stages = _stages(setup, model)
    losses = []
    for i, m in enumerate(stages):
        n = total // len(stages) + (1 if i < total % len(stages) else 0)
        if n:
            ex = task_examples(setup["n_train"], list(range(first, m + 1)), setup["seed"] + i, rule,
                               setup["modulus"])
            losses.append(_train(model, tok, ex, n, setup, folder / f"stage-{m}").loss.values)
    return losses


def _train(model, tok, examples, steps: int, setup: dict, folder: Path, **kw) -> xr.Dataset:
    """Return train_retrofit's metrics, trained in `folder` (resumed from its last checkpoint when it has one)."""
    kw.setdefault("warmup", _warmup(setup))
    return train_retrofit(model, tok, examples, steps, batch_size=setup["batch_size"], lr=setup["lr"],
                          seed=setup["seed"], progress=False, loop1_distill=setup["loop1_distill"], out_dir=folder,
                          resume=True, save_frozen=False, **kw)


def _final_examples(setup: dict, model):
    """Return the examples annealing and the scratchpad train on: depths first..K of the installed rule."""
    first, _ = _stages(setup, model)
    return iterated_examples(setup["n_train"], list(range(first, setup["loops"] + 1)), setup["seed"], setup["rule"],
                             setup["modulus"])


def _sweep(setup: dict) -> dict:
    """Return depth_sweep's keyword arguments for this setup (every loop up to the deepest evaluated depth)."""
    return dict(n=setup["n_eval"], seed=setup["seed"] + 1, loops=list(range(1, max(setup["eval_depths"]) + 1)),
                supervised_depth=setup["loops"], rule=setup["rule"], modulus=setup["modulus"])


def _trained_folders(run: Path) -> list[Path]:
    """Return a phase's Trainer folders in the order they trained (stages by depth, then anneal)."""
    stages = sorted(run.glob("stage-*"), key=lambda p: int(p.name.split("-")[1]))
    return stages + [p for p in (run / "anneal",) if p.is_dir()]


def load_phase_weights(model, upstream: str | Path) -> None:
    """Return None after loading the weights a phase ended with: its last Trainer folder's last checkpoint, or,
    when it trained nothing (anneal_steps 0), the weights its own upstream phase ended with."""
    folders = _trained_folders(Path(upstream))
    ckpt = latest_checkpoint(folders[-1]) if folders else None
    if ckpt is None:
        before = read_json(RunDir(upstream).config, "recipe config").get("checkpoint") if RunDir(
            upstream).config.exists() else ""
        if before:
            return load_phase_weights(model, before)
        fail("checkpoint", str(upstream), "holds no trained phase (no stage-* or anneal/ folder with a checkpoint)")
    state = read_json(ckpt / RunDir.CKPT_STATE, "checkpoint state")
    load_weights(model, load_tensors(ckpt / RunDir.CKPT_MODEL, state=state), state, ckpt)


def _check_upstream(phase: str, checkpoint, setup: dict) -> Path | None:
    """Return the upstream phase's run folder after checking it is that phase, finished, with this setup."""
    want = UPSTREAM.get(phase)
    if want is None:
        return None
    if not checkpoint:
        fail("checkpoint", checkpoint, f"phase {phase!r} starts from a finished {want!r} phase: give its run folder")
    run = RunDir(checkpoint)
    if not run.config.exists() or not run.results.exists():
        fail("checkpoint", str(checkpoint), f"must be the run folder of a finished {want!r} phase (config.json and "
             "results.nc)")
    saved = read_json(run.config, "recipe config")
    if saved.get("phase") != want:
        fail("checkpoint", str(checkpoint),
             f"holds phase {saved.get('phase')!r}; phase {phase!r} starts from {want!r}")
    diff = {k: (saved["setup"].get(k), v) for k, v in setup.items() if saved["setup"].get(k) != v}
    if diff:
        raise ValueError(f"checkpoint={str(checkpoint)!r} was made with other recipe settings; differing (there, "
                         f"here): {diff}")
    return run.path


def _recipe_phase_parameters() -> tuple[str, ...]:
    """Return the parameter names recipe_phase takes: its own and recipe_setup's (for `passed`)."""
    import inspect

    return ("out_dir", "phase", "checkpoint", "progress", *inspect.signature(recipe_setup).parameters)


def recipe_phase(out_dir, phase: str, checkpoint: str = "", progress: bool = False, **settings) -> xr.Dataset:
    """Return one phase's results Dataset (also `out_dir/results.nc`); settings as `recipe_setup` takes them.

    `checkpoint` is the upstream phase's run folder (anneal: install's; inverse: anneal's), checked to
    hold that phase made with the same settings. Interrupted, a phase resumes from its last checkpoint.
    """
    check_choice("phase", phase, PHASES)
    setup = recipe_setup(**settings)
    upstream = _check_upstream(phase, checkpoint, setup)
    out = RunDir(out_dir).path
    out.mkdir(parents=True, exist_ok=True)
    record = {"phase": phase, "setup": setup, "checkpoint": "" if upstream is None else str(upstream)}
    atomic_write_bytes(RunDir(out).config, json.dumps(record).encode())
    t0 = time.perf_counter()
    ds = {"install": _install, "anneal": _anneal, "scratchpad": _scratchpad, "inverse": _inverse}[phase](
        setup, out, upstream)
    flat = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in setup.items() if k != "seed"}
    attrs = provenance(None, setup["seed"], phase=phase, **flat, phase_s=round(time.perf_counter() - t0, 2))
    ds.attrs.update({k: v for k, v in attrs.items() if k != "config_json"})  # the sweeps' attrs hold the model's
    save_results(ds, out, _headline(ds))
    return ds


# a phase's headline numbers: (variable, over depths within or beyond K, long name); the report shows them first
HEADLINES = (("step_accuracy", "diagonal", "teacher-forced accuracy at loop = depth"),
             ("answer_accuracy", "answers", "greedy answer accuracy"),
             ("inverse_step_accuracy", "inverse", "inverse rule's accuracy at loop = depth, after training"))


def _headline(ds: xr.Dataset) -> list[str]:
    """Return the names of the scalar headline variables added to ds: each accuracy's mean within and beyond K."""
    names = []
    for var, short, long in HEADLINES:
        if var not in ds:
            continue
        acc = ds[var]
        acc = acc.sel(inverse_phase="after") if "inverse_phase" in acc.dims else acc
        acc = acc.isel(approach=0) if "approach" in acc.dims else acc
        for side, beyond in (("within", 0), ("beyond", 1)):
            depths = ds.depth.values[ds.beyond_horizon.values == beyond]
            if len(depths):
                name = f"{short}_{side}"
                ds[name] = acc.sel(depth=depths).mean()
                ds[name].attrs.update(long_name=f"{long}, mean over depths {side} K", units="fraction")
                names.append(name)
    return names


recipe_phase.notebook_parameters = _recipe_phase_parameters  # read by experiments.passed


def check_recipe_notebook(params: dict) -> None:
    """Return None when the retrofit_recipe notebook's parameters make a valid phase; else raise ValueError naming one.

    The pipeline calls it (the notebook's metadata names it) for every run before anything runs: the
    settings, the phase, and a `path:` base's folder (its config.json and tokenizer.json) are checked
    without loading a model.
    """
    p = {k: v for k, v in params.items() if k not in ("out_dir", "checkpoint", "progress")}
    check_choice("phase", p.pop("phase", "install"), PHASES)
    setup = recipe_setup(**p)
    if setup["base"].startswith(BASE_PATH):
        missing = missing_model_files(setup["base"][len(BASE_PATH):])
        if missing:
            fail("base", setup["base"], f"must name a local model folder (save_pretrained's layout with its "
                 f"tokenizer); it lacks {', '.join(missing)}, and nothing is downloaded")


def _install(setup: dict, out: Path, upstream: None) -> xr.Dataset:
    """Return phase 1: per-loop curriculum losses and the diagonal after it (step_accuracy, phase per_loop)."""
    model, _, tok = _model(setup)
    losses = _curriculum(model, tok, setup, setup["steps"], setup["rule"], out)
    ds = depth_sweep(model, tok, setup["eval_depths"], **_sweep(setup))
    first, stages = _stages(setup, model)
    ds["train_loss"] = ("step", np.concatenate(losses))
    ds.attrs.update(first_depth=first, curriculum=",".join(map(str, stages)))
    return ds


def _anneal(setup: dict, out: Path, upstream: Path) -> xr.Dataset:
    """Return phase 2: final-answer-only grading from install's weights, then the diagonal, answers and loop 1."""
    model, llama, tok = _model(setup)
    load_phase_weights(model, upstream)
    losses = []
    if setup["anneal_steps"]:
        losses.append(_train(model, tok, _final_examples(setup, model), setup["anneal_steps"], setup, out / "anneal",
                             warmup=1, per_loop=False).loss.values)
    ds = depth_sweep(model, tok, setup["eval_depths"], **_sweep(setup))
    answers = answer_sweep(model, tok, setup["eval_depths"], n=setup["n_answers"], seed=setup["seed"] + 1,
                           supervised_depth=setup["loops"], rule=setup["rule"], modulus=setup["modulus"])
    for name in ("accuracy", "seconds_per_answer", "tokens_per_answer"):
        ds[f"answer_{name}" if name == "accuracy" else name] = answers[name]
    ds["train_loss"] = ("step", np.concatenate(losses) if losses else np.zeros(0))
    check = loop1_check(model, llama, tok, seed=setup["seed"])
    for name in LOOP1_VARS:
        ds[f"loop1_{name}"] = check[name]
    acc = ds.step_accuracy
    below = [int(d) for d in acc.depth.values if d >= 2 and not acc.sel(depth=d) >= 0.7]
    ds.attrs.update(extrapolation_depth=below[0] if below else 0, loop1_verdict=check.attrs["verdict"],
                    first_depth=_stages(setup, model)[0])
    return ds


def _scratchpad(setup: dict, out: Path, upstream: None) -> xr.Dataset:
    """Return the baseline: the same base and budget trained (steps + anneal_steps) to write the steps out."""
    looped, _, tok = _model(setup)
    examples = scratchpad_examples(_final_examples(setup, looped))
    del looped
    scratch, _, _ = _model(setup, loops=1, bridge=False)
    metrics = _train(scratch, tok, examples, setup["steps"] + setup["anneal_steps"], setup, out / "scratchpad")
    ds = answer_sweep(scratch, tok, setup["eval_depths"], n=setup["n_answers"], seed=setup["seed"] + 1,
                      approach="scratchpad", supervised_depth=setup["loops"], rule=setup["rule"],
                      modulus=setup["modulus"])
    ds = ds.rename({"accuracy": "answer_accuracy"})
    ds["scratchpad_train_loss"] = ("step", metrics.loss.values)
    return ds


def _inverse(setup: dict, out: Path, upstream: Path) -> xr.Dataset:
    """Return the interference phase: the inverse rule trained from anneal's weights, both rules and loop 1 after."""
    model, llama, tok = _model(setup)
    load_phase_weights(model, upstream)
    inverse = dict(_sweep(setup), rule="sub")
    before = depth_sweep(model, tok, setup["eval_depths"], **inverse).step_accuracy
    losses = _curriculum(model, tok, setup, setup["inverse_steps"], "sub", out) if setup["inverse_steps"] else []
    after = depth_sweep(model, tok, setup["eval_depths"], **inverse).step_accuracy
    forward = depth_sweep(model, tok, setup["eval_depths"], **_sweep(setup)).step_accuracy
    ds = xr.Dataset({"step_accuracy": forward})
    ds["inverse_step_accuracy"] = xr.concat([before, after], "inverse_phase").assign_coords(
        inverse_phase=["before", "after"])
    ds["train_loss"] = ("step", np.concatenate(losses) if losses else np.zeros(0))
    again = loop1_check(model, llama, tok, seed=setup["seed"])
    for name in LOOP1_VARS:
        ds[f"loop1_after_inverse_{name}"] = again[name]
    return ds


def recipe_results(install: xr.Dataset, anneal: xr.Dataset, scratchpad: xr.Dataset,
                   inverse: xr.Dataset | None = None) -> xr.Dataset:
    """Return the phases' results as one Dataset: step_accuracy over phase (per_loop, final_only[, after_inverse]),
    answers over approach (looped, scratchpad), the whole training curve, loop 1 before and after the inverse."""
    ds = anneal.drop_vars(["step_accuracy", "answer_accuracy", "seconds_per_answer", "tokens_per_answer",
                           "train_loss", "approach"])
    phases = [install.step_accuracy, anneal.step_accuracy] + ([inverse.step_accuracy] if inverse is not None else [])
    names = ["per_loop", "final_only"] + (["after_inverse"] if inverse is not None else [])
    ds["step_accuracy"] = xr.concat(phases, dim="phase").assign_coords(phase=names)
    answers = xr.concat([anneal[["answer_accuracy", "seconds_per_answer", "tokens_per_answer"]],
                         scratchpad[["answer_accuracy", "seconds_per_answer", "tokens_per_answer"]]], "approach")
    ds = ds.assign(answers)
    curves = [install.train_loss.values, anneal.train_loss.values] + (
        [inverse.train_loss.values] if inverse is not None else [])
    ds["train_loss"] = ("step", np.concatenate(curves))
    if inverse is not None:
        ds["inverse_step_accuracy"] = inverse.inverse_step_accuracy
        for name in LOOP1_VARS:
            ds[f"loop1_after_inverse_{name}"] = inverse[f"loop1_after_inverse_{name}"]
    keep = {k: v for k, v in anneal.attrs.items() if k not in ("phase", "phase_s")}
    ds.attrs = {**keep, "first_depth": install.attrs["first_depth"], "curriculum": install.attrs["curriculum"],
                "train_s": round(sum(float(d.attrs.get("phase_s", 0)) for d in (install, anneal)), 2)}
    return ds


def recipe_run(out_dir, progress: bool = False, **settings) -> xr.Dataset:
    """Return the whole re-entry recipe's results (loop t computes step t), also written to `out_dir/results.nc`.

    The four phases in one call, each in its own folder under out_dir (install/, anneal/, scratchpad/,
    inverse/ when inverse_steps > 0; a re-run resumes them), merged by `recipe_results`. Phase 1,
    per-loop supervision with a curriculum over depth: `steps` steps split evenly over stages
    m = 2..loops, stage m training on depths first..m (first = 2 under the adapter budget, whose loop 1
    is the frozen base, else 1). Phase 2, `anneal_steps` steps graded on each example's final answer
    only. Teacher-forced `step_accuracy` (loop = depth) after each phase (dim `phase`: per_loop,
    final_only) on `eval_depths` (default 1..ceil(1.5 loops) + 1, beyond the supervised depth); greedy
    `answer_accuracy` and `seconds_per_answer` after phase 2 against a scratchpad baseline trained with
    the same budget, examples and total steps; `loop1_check` against the base. attrs["extrapolation_depth"]
    is the first depth >= 2 whose final diagonal accuracy is below 0.7 (0 when none is). `inverse_steps`
    > 0 adds the interference phase: the inverse rule (x - c) trained alike from the annealed model, the
    forward diagonal measured again (phase `after_inverse`), `inverse_step_accuracy` (dim inverse_phase:
    before, after) and loop 1 after it (`loop1_after_inverse_*`).
    """
    setup = recipe_setup(**settings)
    out = Path(out_dir)
    done = {}
    for phase in PHASES:
        if phase == "inverse" and not setup["inverse_steps"]:
            continue
        up = UPSTREAM.get(phase)
        done[phase] = recipe_phase(out / phase, phase, checkpoint=str(out / up) if up else "", progress=progress,
                                   **settings)
    ds = recipe_results(done["install"], done["anneal"], done["scratchpad"], done.get("inverse"))
    save_netcdf(ds, RunDir(out).results)
    return ds
