"""Pipelines: YAML specs of parameterized notebooks over grids, run by papermill, cached by key.

A spec (``pipelines/<name>.yaml``)::

    name: quickstart                  # default: the file name
    description: one line
    steps:
      - name: train                   # unique; names the step's folder
        notebook: train               # notebooks/train.ipynb (a name), or a path ending .ipynb (relative to the spec)
        params: {steps: 300}          # fixed parameters
        grid: {seed: [0, 1]}          # every combination is one run
        cases: [{core: 4, loops: 2}, {core: 2, loops: 4}]   # parameter sets tied together (times the grid)
      - name: sweep
        notebook: loop_sweep
        each: {train: checkpoint}     # one run per run of `train`; its run folder goes in parameter `checkpoint`
      - name: fit
        notebook: fit_laws
        gather: {train: runs}         # one run; the list of `train`'s run folders goes in parameter `runs`
    profiles:
      smoke:                          # `--profile smoke`: per-step overrides (params merged; grid keys and cases replaced)
        train: {params: {steps: 5}, grid: {seed: [0]}}

Every parameter is checked against the notebook's declared ones (`papermill.inspect_notebook`) before
anything runs: unknown names, wrong types, non-finite floats and list elements of the wrong type
(`list[int]`) are rejected, and a notebook may name a library check in its metadata
(`"workbench": {"check": "workbench.experiments:check_train_notebook"}`) that every run's
parameters go through, so ranges and config fields fail before any run starts. Each run's key hashes its parameters, the
notebook's code (cells, not outputs), the workbench version, a digest of the `workbench` package's
source (`library_digest`) and the keys of the runs it consumes, so a re-run skips what completed and
reruns only what changed, including after an edit to the library. `status` lists completed runs made
by older library code as "stale". A run executes in
``runs/<pipeline>/<step>/.<key>.partial/`` (the notebook's working directory, `out_dir="."`), under a
per-run file lock, and is renamed to ``runs/<pipeline>/<step>/<key>/`` with a ``run.json`` record
when it ends, done or failed; a failed or interrupted run restarts in its old folder (a training
notebook resumes from its checkpoint). Runs of one step go in parallel through an executor (local
processes, or Dask: a scheduler's cluster or a LocalCluster of this machine, each run's torch
threads its worker's share of the cores); a failed run is recorded with its error and output
notebook and the others go on (on Dask too when a worker dies mid-run). ``report`` writes
``runs/<pipeline>/report.html``: every run's status, parameters, headline numbers (from its
results.nc) and figures drawn inline, with links to its data and to its notebook rendered as HTML
(nbconvert; code collapsed under the results).
plotly.js is written once beside the report and every link is relative, so the pipeline folder
opens offline wherever it is copied.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import functools
import hashlib
import html
import itertools
import json
import math
import os
import re
import shutil
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .io import atomic_write_bytes, find_runs, read_record  # noqa: F401 (find_runs: public here too)
from .io import PROGRESS, read_progress

LIBRARY = Path(__file__).resolve().parent  # the `workbench` package whose source enters every run key
REPO = LIBRARY.parent
PIPELINES_DIR = REPO / "pipelines"
NOTEBOOKS_DIR = REPO / "notebooks"
SPEC_KEYS = {"name", "description", "steps", "profiles"}
STEP_KEYS = {"name", "notebook", "params", "grid", "cases", "each", "gather", "description"}
PROFILE_KEYS = {"params", "grid", "cases"}
RESERVED = ("out_dir",)  # set by the runner: the run's working directory
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
                                       "list": (list, tuple), "dict": (dict,)}


class PipelineError(ValueError):
    """A spec or its parameters are invalid; the message lists every problem found."""


@dataclass(frozen=True)
class Step:
    """One notebook of a pipeline with its fixed parameters, grid, cases and inputs from earlier steps."""

    name: str
    notebook: Path
    params: dict
    grid: dict
    cases: list
    each: dict  # {upstream step: parameter}: one run per upstream run
    gather: dict  # {upstream step: parameter}: the list of upstream runs

    @property
    def needs(self) -> list[str]:
        """Return the names of the steps whose runs this step consumes."""
        return list(self.each) + list(self.gather)


@dataclass
class Pipeline:
    """A validated spec: its name, file, steps in order, and the profile applied (if any)."""

    name: str
    path: Path
    description: str
    steps: list[Step]
    profile: str | None = None
    profiles: tuple[str, ...] = ()


@dataclass
class RunJob:
    """One notebook execution: where it runs, with which parameters, and the runs it consumes."""

    pipeline: str
    step: str
    key: str
    dir: Path
    notebook: Path
    params: dict
    upstream: list[str] = field(default_factory=list)  # keys of consumed runs
    threads: int = 0  # torch threads in the kernel (0: leave the default)
    library: str = ""  # library_digest() the key was made with; recorded in run.json


# ---- spec loading ----------------------------------------------------------------------------------
def resolve_spec(spec: str | os.PathLike) -> Path:
    """Return the path of a spec given as a file path or a pipeline name under pipelines/."""
    p = Path(spec)
    if p.is_file():
        return p.resolve()
    named = PIPELINES_DIR / f"{spec}.yaml"
    if named.is_file():
        return named
    known = sorted(q.stem for q in PIPELINES_DIR.glob("*.yaml")) if PIPELINES_DIR.is_dir() else []
    raise PipelineError(f"spec={str(spec)!r} is not a file nor a pipeline name; known pipelines: "
                        f"{', '.join(known) or 'none'}")


def _notebook_path(value: Any, spec_path: Path, where: str, problems: list[str]) -> Path:
    if not isinstance(value, str) or not value:
        problems.append(f"{where}: notebook={value!r} is invalid: must be a notebook name or a path ending .ipynb")
        return Path()
    if value.endswith(".ipynb"):
        p = (spec_path.parent / value).resolve()
    else:
        p = (spec_path.parent.parent / "notebooks" / f"{value}.ipynb")
        if not p.is_file():
            p = NOTEBOOKS_DIR / f"{value}.ipynb"
    if not p.is_file():
        problems.append(f"{where}: notebook={value!r} not found (looked for {p})")
    return p


def _mapping(value: Any, where: str, name: str, problems: list[str]) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        problems.append(f"{where}: {name}={value!r} is invalid: must be a mapping of names")
        return {}
    return dict(value)


def _check_grid(grid: dict, where: str, problems: list[str]) -> None:
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            problems.append(f"{where}: grid.{k}={v!r} is invalid: must be a non-empty list of values")


def _check_cases(cases: Any, where: str, problems: list[str]) -> list:
    if cases is None:
        return []
    if not isinstance(cases, list) or not all(isinstance(c, dict) for c in cases) or not cases:
        problems.append(f"{where}: cases={cases!r} is invalid: must be a non-empty list of parameter mappings")
        return []
    return [dict(c) for c in cases]


def load_spec(spec: str | os.PathLike, profile: str | None = None) -> Pipeline:
    """Return the Pipeline a YAML spec describes, with `profile`'s overrides applied (PipelineError if invalid)."""
    import yaml

    path = resolve_spec(spec)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise PipelineError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise PipelineError(f"{path}: a spec must be a mapping with keys {sorted(SPEC_KEYS)}")
    problems: list[str] = []
    for k in raw:
        if k not in SPEC_KEYS:
            problems.append(f"{path.name}: unknown key {k!r}; allowed: {', '.join(sorted(SPEC_KEYS))}")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        problems.append(f"{path.name}: name={name!r} is invalid: must be a non-empty folder name")
    profiles = _mapping(raw.get("profiles"), path.name, "profiles", problems)
    if profile is not None and profile not in profiles:
        raise PipelineError(f"profile={profile!r} is not defined in {path.name}; profiles: "
                            f"{', '.join(profiles) or 'none'}")
    overrides = _mapping(profiles.get(profile), f"profiles.{profile}", "profile", problems) if profile else {}
    raw_steps = raw.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise PipelineError(f"{path.name}: steps={raw_steps!r} is invalid: must be a non-empty list")
    steps: list[Step] = []
    seen: set[str] = set()
    for i, s in enumerate(raw_steps):
        where = f"{path.name} step {i + 1}"
        if not isinstance(s, dict):
            problems.append(f"{where}: must be a mapping with keys {sorted(STEP_KEYS)}")
            continue
        sname = s.get("name")
        if not isinstance(sname, str) or not sname or "/" in sname or sname.startswith("."):
            problems.append(f"{where}: name={sname!r} is invalid: must be a non-empty folder name")
            continue
        where = f"step {sname!r}"
        if sname in seen:
            problems.append(f"{where}: the name is used twice")
        for k in s:
            if k not in STEP_KEYS:
                problems.append(f"{where}: unknown key {k!r}; allowed: {', '.join(sorted(STEP_KEYS))}")
        nb = _notebook_path(s.get("notebook"), path, where, problems)
        params = _mapping(s.get("params"), where, "params", problems)
        grid = _mapping(s.get("grid"), where, "grid", problems)
        cases = _check_cases(s.get("cases"), where, problems)
        each = _mapping(s.get("each"), where, "each", problems)
        gather = _mapping(s.get("gather"), where, "gather", problems)
        over = _mapping(overrides.get(sname), f"profiles.{profile}.{sname}", "override", problems)
        for k in over:
            if k not in PROFILE_KEYS:
                problems.append(f"profiles.{profile}.{sname}: unknown key {k!r}; allowed: "
                                f"{', '.join(sorted(PROFILE_KEYS))}")
        params.update(_mapping(over.get("params"), f"profiles.{profile}.{sname}", "params", problems))
        grid.update(_mapping(over.get("grid"), f"profiles.{profile}.{sname}", "grid", problems))
        if "cases" in over:
            cases = _check_cases(over["cases"], f"profiles.{profile}.{sname}", problems)
        _check_grid(grid, where, problems)
        if len(each) > 1:
            problems.append(f"{where}: each={each!r} is invalid: name one upstream step")
        for kind, m in (("each", each), ("gather", gather)):
            for up, param in m.items():
                if up not in seen:
                    problems.append(f"{where}: {kind} names step {up!r}, which is not an earlier step")
                if not isinstance(param, str):
                    problems.append(f"{where}: {kind}.{up}={param!r} is invalid: must be a parameter name")
        seen.add(sname)
        steps.append(Step(sname, nb, params, grid, cases, each, gather))
    for k in overrides:
        if k not in seen:
            problems.append(f"profiles.{profile}: names step {k!r}, which the spec does not have")
    if problems:
        raise PipelineError("invalid pipeline spec:\n  - " + "\n  - ".join(problems))
    return Pipeline(name, path, str(raw.get("description", "")), steps, profile, tuple(profiles))


# ---- expansion into runs ------------------------------------------------------------------------------
def notebook_hash(path: Path) -> str:
    """Return the sha256 of a notebook's cells (type and source; outputs and metadata excluded)."""
    nb = json.loads(Path(path).read_text())
    cells = [[c.get("cell_type"), "".join(c.get("source", ""))] for c in nb.get("cells", [])]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _source_digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        rel = f.relative_to(root).as_posix()
        if "__pycache__" in rel.split("/"):
            continue
        # path and content both count: a moved module changes imports as surely as an edited one
        h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def library_digest(root: str | os.PathLike | None = None) -> str:
    """Return the sha256 over every .py file of the package at `root` (default: `workbench`), by relative path.

    Computed once per process and root: an edit made while a pipeline runs does not split its keys.
    """
    return _source_digest(Path(root).resolve() if root is not None else LIBRARY)


def run_key(nb_hash: str, params: dict, upstream: Iterable[str] = (), library: str | None = None) -> str:
    """Return a run's key: sha256 of notebook hash, parameters, workbench version, library digest and consumed runs' keys."""
    from . import __version__

    blob = json.dumps({"notebook": nb_hash, "params": params, "version": __version__,
                       "library": library_digest() if library is None else library,
                       "upstream": list(upstream)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _combos(step: Step) -> list[dict]:
    names = list(step.grid)
    grid = [dict(zip(names, vals)) for vals in itertools.product(*(step.grid[n] for n in names))]
    return [{**case, **g} for case in (step.cases or [{}]) for g in grid]


def expand(pipe: Pipeline, runs_dir: str | os.PathLike = "runs") -> list[RunJob]:
    """Return every run of the pipeline, in step order, with keys and folders under runs_dir."""
    root = Path(runs_dir).resolve() / pipe.name
    by_step: dict[str, list[RunJob]] = {}
    out: list[RunJob] = []
    hashes: dict[Path, str] = {}
    lib = library_digest()
    for step in pipe.steps:
        nbh = hashes.setdefault(step.notebook, notebook_hash(step.notebook))
        sources = [[]]
        if step.each:
            (up, _), = step.each.items()
            sources = [[u] for u in by_step[up]]
        gathered: dict[str, list[RunJob]] = {}
        for up, param in step.gather.items():  # several steps may feed one parameter: their runs in order
            gathered.setdefault(param, []).extend(by_step[up])
        jobs = []
        for src in sources:
            for combo in _combos(step):
                params = {**step.params, **combo}
                keyed = dict(params)  # upstream folders enter the key as the upstream runs' keys
                upstream: list[str] = []
                for u in src:
                    param = step.each[u.step]
                    params[param], keyed[param] = str(u.dir), f"run:{u.key}"
                    upstream.append(u.key)
                for param, ups in gathered.items():
                    params[param] = [str(u.dir) for u in ups]
                    keyed[param] = [f"run:{u.key}" for u in ups]
                    upstream += [u.key for u in ups]
                key = run_key(nbh, keyed, upstream, lib)[:16]
                jobs.append(RunJob(pipe.name, step.name, key, root / step.name / key, step.notebook, params,
                                   upstream, library=lib))
        by_step[step.name] = jobs
        out += jobs
    return out


# ---- validation ------------------------------------------------------------------------------------------
# papermill's PythonTranslator.PARAMETER_PATTERN (papermill 2.x), so a parameter line parses the same in both
_PARAMETER_LINE = re.compile(
    r"^(?P<target>\w[\w_]*)\s*(:\s*[\"']?(?P<annotation>\w[\w_\[\],\s]*)[\"']?\s*)?=\s*(?P<value>.*?)"
    r"(\s*#\s*(type:\s*(?P<type_comment>[^\s]*)\s*)?(?P<help>.*))?$")
_PYTHON_KERNELS = ("python3", "python")  # kernels papermill inspects with its PythonTranslator


def declared_parameters(notebook: str | os.PathLike) -> dict[str, dict]:
    """Return the notebook's declared parameters {name: {name, inferred_type_name, default, help}}, as papermill's.

    A Python notebook's parameters cell is parsed here, line by line as `papermill.inspect_notebook` does
    (tests/test_pipeline.py checks they agree on every notebook): importing papermill costs seconds (its
    notebook schema validator), more than a re-run of a finished pipeline may take. Other notebooks go
    to papermill itself.
    """
    nb = json.loads(Path(notebook).read_text())
    meta = nb.get("metadata") or {}
    kernel = (meta.get("kernelspec") or {}).get("name")
    language = (meta.get("language_info") or {}).get("name") or (meta.get("kernelspec") or {}).get("language")
    if nb.get("nbformat") != 4 or kernel not in _PYTHON_KERNELS or language != "python":
        import papermill

        return papermill.inspect_notebook(str(notebook))
    for cell in nb.get("cells", []):
        if "parameters" in ((cell.get("metadata") or {}).get("tags") or []):
            source = cell.get("source", "")
            return {p["name"]: p for p in _parse_parameters(source if isinstance(source, str) else "".join(source))}
    return {}


def _parse_parameters(source: str) -> list[dict]:
    """Return the parameters a Python parameters cell declares, parsed as papermill's PythonTranslator.inspect does."""
    def flatten(lines: list[str]) -> str:  # a multi-line value: comments dropped except on its last line
        return "".join((ln[:ln.index("#")] if "#" in ln else ln).strip() for ln in lines[:-1]) + \
            (lines[-1].strip() if lines else "")

    groups, acc = [], []
    for line in source.splitlines():
        if not line.strip() or line.strip().startswith("#"):
            continue
        n = line.count("=")
        if n:
            groups.append(flatten(acc))
            acc = []
            if n > 1:  # papermill skips (and warns about) a line with two '=': so does the runner
                continue
        acc.append(line)
    groups.append(flatten(acc))
    params = []
    for definition in groups:
        m = _PARAMETER_LINE.match(definition) if definition else None
        if m is None or m["target"] is None:
            continue
        params.append({"name": m["target"].strip(),
                       "inferred_type_name": str(m["annotation"] or m["type_comment"] or None).strip(),
                       "default": str(m["value"]).strip(), "help": str(m["help"] or "").strip()})
    return params


def _type_ok(value: Any, type_name: str) -> bool:
    """Return True if value fits a declared type: bools only for bool, floats finite, list[T] elements of type T."""
    base, _, inner = type_name.partition("[")
    allowed = _TYPES.get(base.strip())
    if allowed is None:  # unannotated ("None") or a type we do not check
        return True
    if isinstance(value, bool) and bool not in allowed:
        return False
    if not isinstance(value, allowed):
        return False
    if isinstance(value, float) and not math.isfinite(value):  # YAML's .nan and .inf are floats too
        return False
    if inner and base.strip() == "list":  # list[int], list[str], ...: every element (nested brackets unchecked)
        return all(_type_ok(v, inner.rstrip("]").strip()) for v in value)
    return True


def _declared_check(notebook: Path) -> Callable[[dict], None] | None:
    """Return the parameter check a notebook names in its metadata (workbench.check = "workbench.mod:fn"), or None.

    The check takes the run's parameters (declared defaults filled in) and raises ValueError naming the
    bad one: what types cannot say (ranges, list elements, fields of the configs a notebook builds).
    """
    import importlib

    meta = json.loads(Path(notebook).read_text()).get("metadata", {}).get("workbench", {})
    target = meta.get("check") if isinstance(meta, dict) else None
    if not target:
        return None
    module, _, name = str(target).partition(":")
    if not module.startswith("workbench.") or not name:  # only the library's own checks are imported
        raise PipelineError(f"{notebook.name}: metadata workbench.check={target!r} is invalid: must be "
                            "'workbench.<module>:<function>'")
    return getattr(importlib.import_module(module), name)


def _defaults(decl: dict) -> dict:
    """Return the declared parameters' default values (those that are plain literals)."""
    import ast

    out = {}
    for name, d in decl.items():
        try:
            out[name] = ast.literal_eval(d.get("default", ""))
        except (ValueError, SyntaxError):
            pass
    return out


def _done(rec: dict | None) -> bool:
    """Return True when a run record (read_record's, None for none) says the run finished successfully."""
    return rec is not None and rec.get("status") == "done"


def validate(pipe: Pipeline, jobs: list[RunJob]) -> None:
    """Raise PipelineError listing every unknown parameter name, wrong type and failed check; return None when all pass.

    Names and types are checked for every job; a notebook's library check only for jobs that will run:
    a run already done under the same key had these exact parameters, notebook and library, so the check
    passed then, and importing it (the library, torch) would cost a finished pipeline's re-run seconds.
    """
    problems: list[str] = []
    declared = {}
    for step in pipe.steps:
        declared[step.name] = decl = declared_parameters(step.notebook)
        if not decl:
            problems.append(f"step {step.name!r}: {step.notebook.name} has no cell tagged 'parameters'")
            continue
        for r in RESERVED:
            if r not in decl:
                problems.append(f"step {step.name!r}: {step.notebook.name} must declare parameter {r!r} "
                                "(the runner sets it to the run's folder)")
    seen = set()
    mistyped = set()  # runs with a wrong name or type: their notebook's own check would only repeat it
    for job in jobs:
        decl = declared.get(job.step) or {}
        if not decl:
            continue
        for name, value in job.params.items():
            if (job.step, name) in seen or (job.step, name, repr(value)) in seen:
                mistyped.add(job.key)
                continue
            if name in RESERVED:
                problems.append(f"step {job.step!r}: parameter {name!r} is set by the runner; remove it")
                seen.add((job.step, name))
            elif name not in decl:
                problems.append(f"step {job.step!r}: unknown parameter {name!r} = {value!r}; "
                                f"{job.notebook.name} declares: {', '.join(sorted(decl))}")
                seen.add((job.step, name))
            elif not _type_ok(value, decl[name]["inferred_type_name"]):
                tname = decl[name]["inferred_type_name"]
                base = tname.split("[")[0]
                what = (f"has type {type(value).__name__}" if not (isinstance(value, _TYPES.get(base, object))
                                                                    and not (isinstance(value, bool) and base != "bool"))
                        else "is not finite" if isinstance(value, float)
                        else "has an element of another type")
                problems.append(f"step {job.step!r}: parameter {name}={value!r} {what}; "
                                f"{job.notebook.name} declares {name}: {tname}"
                                + (f"  # {decl[name]['help']}" if decl[name].get("help") else ""))
                seen.add((job.step, name, repr(value)))  # each bad value once, however many runs share it
            else:
                continue
            mistyped.add(job.key)
    to_run = [job for job in jobs if job.key not in mistyped and not _done(read_record(job.dir))]
    checks = {step.name: _declared_check(step.notebook) for step in pipe.steps
              if declared.get(step.name) and any(job.step == step.name for job in to_run)}
    for job in to_run:
        check = checks.get(job.step)
        if check is None:
            continue
        try:
            check({**_defaults(declared[job.step]), **job.params})
        except (ValueError, TypeError) as e:
            msg = f"step {job.step!r}: {e}"
            if msg not in problems:  # a grid repeats the same bad value in many runs
                problems.append(msg)
    if problems:
        raise PipelineError(f"pipeline {pipe.name!r}: nothing was run:\n  - " + "\n  - ".join(problems))


# ---- executing one run ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another runner executing the same run makes us wait, then skip
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _kernel_manager_class():
    """Return a kernel manager that sends the kernel's stderr to kernel.log in its working directory."""
    from jupyter_client.manager import AsyncKernelManager

    class RunKernelManager(AsyncKernelManager):
        # the kernel's own log lines (and any C-level crash message) stay with the run, not on the terminal
        async def _async_launch_kernel(self, kernel_cmd, **kw):
            with open(Path(kw.get("cwd") or ".") / "kernel.log", "ab") as log:
                kw["stderr"] = log
                return await super()._async_launch_kernel(kernel_cmd, **kw)

    return RunKernelManager


@contextlib.contextmanager
def _claimed(job: RunJob) -> Iterator[tuple[Path, Path, dict | None]]:
    """Yield (final folder, working folder, the skipped record if the run is already done, else None) under its lock."""
    final = Path(job.dir)
    with _locked(final.parent / f".{final.name}.lock"):
        rec = read_record(final)
        done = {**rec, "skipped": True} if _done(rec) else None
        yield final, final.parent / f".{final.name}.partial", done


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# papermill's default is 60 s; a kernel starting beside runs that hold every core of a 2-core machine
# has taken longer than that (a fresh-clone CI run failed an allocation smoke sweep so), and a run that
# fails only to start is lost work
KERNEL_START_TIMEOUT = 300


def execute_run(job: RunJob) -> dict:
    """Return the run's record after executing its notebook (or the existing record if it already completed).

    Never raises for a failing notebook: the error and the output notebook are recorded instead.
    """
    from unittest import mock  # here, not at the top: it imports asyncio, which a re-run that executes nothing skips

    import papermill
    from papermill.exceptions import PapermillExecutionError

    with _claimed(job) as (final, work, done):
        if done is not None:
            return done
        if final.exists():  # a failed attempt: restart in its folder so checkpoints are reused
            if work.exists():
                shutil.rmtree(work)
            os.replace(final, work)
            (work / "run.json").unlink(missing_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        (work / PROGRESS).unlink(missing_ok=True)  # an earlier attempt's: live progress must show this one
        # the kernel inherits the thread count (parallel runs share the cores); patch.dict puts the caller's
        # environment back after a run executed in this process (one job at a time)
        threads = {var: str(job.threads) for var in THREAD_VARS} if job.threads else {}
        started, t0 = _now(), time.perf_counter()
        error = None
        with mock.patch.dict(os.environ, threads):
            try:
                papermill.execute_notebook(str(job.notebook), str(work / "notebook.ipynb"),
                                           parameters={**job.params, "out_dir": "."}, cwd=str(work),
                                           kernel_name="python3", progress_bar=False, log_output=False,
                                           start_timeout=KERNEL_START_TIMEOUT,
                                           kernel_manager_class=_kernel_manager_class())
            except PapermillExecutionError as e:
                error = f"{e.ename}: {e.evalue} (cell {e.exec_count})"
            except Exception as e:  # kernel died, notebook unreadable, ...: still a recorded failure
                error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        return _close_run(work, final, _record(job, error, started, time.perf_counter() - t0))


def _record(job: RunJob, error: str | None, started: str, seconds: float) -> dict:
    """Return the run.json record of a run that ended (done when error is None, else failed)."""
    from . import __version__
    from .io import git_commit

    return {"pipeline": job.pipeline, "step": job.step, "key": job.key,
            "status": "failed" if error else "done", "error": error,
            "notebook": str(job.notebook), "params": job.params, "upstream": job.upstream,
            "started": started, "finished": _now(), "seconds": round(seconds, 3),
            "workbench_version": __version__, "library": job.library or library_digest(),
            "git_commit": git_commit()}


def _close_run(work: Path, final: Path, record: dict) -> dict:
    """Return the record after writing it into the run's working folder and renaming that into place."""
    atomic_write_bytes(work / "run.json", json.dumps(record, indent=1, default=str).encode())
    os.replace(work, final)
    return record


def record_failed(job: RunJob, error: str) -> dict:
    """Return the failed record written for a run that ended without recording itself (whatever ran it died).

    Takes the run's lock (a dead process holds none), keeps what the run left (checkpoints, a partial
    notebook) and renames its working folder into place with run.json saying why, so `status` shows it
    failed and the next `workbench run` restarts it there. A run that completed meanwhile is left alone.
    """
    with _claimed(job) as (final, work, done):
        if done is not None:
            return done
        if final.exists():
            if work.exists():  # an older failed attempt beside the newer partial one: the newer one stays
                shutil.rmtree(final)
            else:
                os.replace(final, work)
        work.mkdir(parents=True, exist_ok=True)
        (work / "run.json").unlink(missing_ok=True)
        return _close_run(work, final, _record(job, error, _now(), 0.0))


# ---- executors -------------------------------------------------------------------------------------------
def _check_threads(threads: object, default: str) -> int:
    """Return `threads` once it is an integer >= 0 (0: `default`, which the error message names)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise PipelineError(f"threads={threads!r} is invalid: must be an integer >= 1, or 0 ({default})")
    return threads


class LocalExecutor:
    """Runs jobs in local processes (`jobs` at once; in this process when jobs == 1 or a step has one run).

    Each run's kernel gets `threads` torch threads; with 0, the machine's cores over the runs executing
    at once (so a step's lone run gets them all, which oversubscribes cores other work is using).
    """

    def __init__(self, jobs: int = 1, threads: int = 0):
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise PipelineError(f"jobs={jobs!r} is invalid: must be an integer >= 1")
        self.jobs = jobs
        self.threads = _check_threads(threads, "the machine's cores over the runs executing at once")

    def map(self, fn: Callable[[RunJob], dict], items: list[RunJob]) -> Iterator[dict]:
        """Return an iterator over fn(item) results in completion order."""
        alone = self.jobs == 1 or len(items) <= 1  # executed here, one at a time, with the caller's threads
        for it in items:
            it.threads = self.threads or (0 if alone else max(1, machine_cores() // min(self.jobs, len(items))))
        if alone:
            yield from map(fn, items)
            return
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(min(self.jobs, len(items)), mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(fn, it) for it in items]
            for f in as_completed(futures):
                yield f.result()

    def close(self) -> None:
        """Return None; nothing to release."""


def machine_cores() -> int:
    """Return the CPU cores this process may use (its affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity masks here (macOS)
        return max(1, os.cpu_count() or 1)


def _dask_execute(job: RunJob, shares: dict[str, int], attempt: str, threads: int = 0) -> dict:
    """Return execute_run(job) on a Dask worker, its kernel given this worker's share of the host's cores.

    `shares` maps hosts to torch threads per run, so a worker the nanny restarted (a new address)
    still gets its host's share; a worker on a host that joined later takes that host's cores over its
    own task slots; `threads` > 0 overrides it. A run that this same attempt
    already started on a worker that then died (the scheduler hands its task to another worker) is
    recorded failed, not rerun: what killed the worker (memory, a crash) would likely kill the next too.
    """
    from distributed import get_worker

    worker = get_worker()
    share = shares.get(worker.host) or max(1, machine_cores() // max(1, worker.state.nthreads))
    job.threads = threads or share
    final = Path(job.dir)
    marker = final.parent / f".{final.name}.attempt"
    if marker.is_file() and marker.read_text() == attempt:
        return record_failed(job, "WorkerDied: the Dask worker executing this run died before it ended "
                                  "(killed, out of memory or lost); `workbench run` again restarts it")
    atomic_write_bytes(marker, attempt.encode())
    try:
        return execute_run(job)
    finally:
        marker.unlink(missing_ok=True)


class DaskExecutor:
    """Runs jobs on a Dask `distributed` cluster (workers must share the runs folder's file system).

    With a scheduler address it connects to that cluster; without one it starts a LocalCluster sized to
    this machine: `jobs` workers when jobs > 1, else one per core, each running one run at a time.
    Every run's kernel gets torch threads from its worker's share of the host's cores (the host's
    cores over the task slots of all workers on that host; `threads` > 0 fixes it). Without it a
    kernel would take what its worker's environment says: 1 under a Dask nanny, which sets
    OMP_NUM_THREADS=1 in its workers (a 32-core host with 2 workers would run 2 threads), all the cores
    without one (2 workers on 2 cores would run 4 threads). A worker that dies mid-run leaves that run failed
    (`record_failed`) and the others go on.
    """

    def __init__(self, scheduler: str | None = None, jobs: int = 1, threads: int = 0):
        try:
            from distributed import Client, LocalCluster
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise PipelineError("executor='dask' needs dask.distributed: pip install 'looped-workbench[cluster]'") from e
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise PipelineError(f"jobs={jobs!r} is invalid: must be an integer >= 1")
        _check_threads(threads, "each worker's share of its host's cores")
        if scheduler is not None and (not isinstance(scheduler, str) or not scheduler.strip()):
            raise PipelineError(f"scheduler={scheduler!r} is invalid: must be a Dask scheduler address such as "
                                "tcp://127.0.0.1:8786, or None to start a local cluster")
        self.cluster = None
        if scheduler is None:
            n = jobs if jobs > 1 else machine_cores()
            self.cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None)
            scheduler = self.cluster.scheduler_address
        self.client = Client(scheduler, timeout="30s")
        self.threads = threads
        self.shares = self._shares()

    def _shares(self) -> dict[str, int]:
        """Return {host: torch threads per run}: the host's cores over the task slots of its workers."""
        if self.cluster is not None:
            self.client.wait_for_workers(len(self.cluster.workers), timeout="60s")
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        cores = self.client.run(machine_cores)  # each worker's own view of its host
        slots: dict[str, int] = {}
        for w in workers.values():
            slots[w["host"]] = slots.get(w["host"], 0) + int(w["nthreads"])
        return {w["host"]: max(1, cores.get(addr, 1) // max(1, slots[w["host"]])) for addr, w in workers.items()}

    def map(self, fn: Callable[[RunJob], dict], items: list[RunJob]) -> Iterator[dict]:
        """Return an iterator over the runs' records in completion order (a run whose worker died: failed)."""
        import uuid

        from distributed import as_completed

        attempt = uuid.uuid4().hex  # tells a task the scheduler retried after its worker died from a new one
        futures = {}
        for it in items:
            task = (_dask_execute, it, self.shares, attempt, self.threads) if fn is execute_run else (fn, it)
            futures[self.client.submit(*task, pure=False, key=f"{it.step}-{it.key}-{time.time_ns()}")] = it
        for f in as_completed(futures):
            try:
                yield f.result()
            except Exception as e:  # the scheduler gave up on it (a worker died too often, lost data)
                yield record_failed(futures[f], f"{type(e).__name__}: {e} (on the Dask cluster)")

    def close(self) -> None:
        """Return None after closing the client connection (and the local cluster this executor started)."""
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()


def make_executor(kind: str = "local", jobs: int = 1, scheduler: str | None = None, threads: int = 0):
    """Return an executor: "local" (processes, `jobs` at once) or "dask" (a scheduler address, or a LocalCluster
    sized to this machine when None); `threads` is the torch threads per run (0: the cores over the runs at once
    locally, each worker's share on Dask)."""
    if kind == "local":
        return LocalExecutor(jobs, threads)
    if kind == "dask":
        return DaskExecutor(scheduler or None, jobs, threads)
    raise PipelineError(f"executor={kind!r} is invalid: must be 'local' or 'dask'")


# ---- live progress --------------------------------------------------------------------------------------
def _held(lock: Path) -> bool:
    """Return True when some runner holds the run's lock file, i.e. the run is executing now."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a new open file: conflicts even with this process's lock
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def progress_text(job: RunJob, progress: dict | None, elapsed: float) -> str:
    """Return one line saying what a running run is doing: its pipeline step, key and time so far, and from its
    progress.json (the Trainer writes one) the training step of the total, tokens/s, time left and loss."""
    head = f"[{job.step}] {job.key} {_clock(elapsed)}"
    p = progress or {}
    phase = p.get("phase")
    if phase is None or not isinstance(p.get("total"), int):
        return f"{head} running"
    step, total = p.get("step", 0), p["total"]
    how = f"{p.get('precision', '?')}, compile {p.get('compile', '?')}"
    if phase == "compiling":
        return f"{head} compiling the blocks, then {total} steps ({how})"
    parts = [f"{head} step {step}/{total}"]
    if phase in ("evaluating", "done", "failed"):
        parts.append(phase)
    if p.get("tokens_per_s"):
        parts.append(f"{p['tokens_per_s']:,.0f} tok/s")
    if p.get("eta_s") is not None and phase == "training":
        parts.append(f"ETA {_clock(p['eta_s'])}")
    if p.get("loss") is not None:
        parts.append(f"loss {p['loss']:.3f}")
    return " · ".join(parts) + f" ({how})"


class LiveProgress:
    """What `workbench run` shows while runs execute: which run, its training step of the total, tokens/s
    and time left (read from the run's progress.json, which the Trainer rewrites every second).

    On a terminal one status line is redrawn every `every` seconds (default 0.5); elsewhere (a log, a
    pipe) plain lines: one when a run is first seen executing or changes phase, then one per running
    run every `every` seconds (default 5). A run is executing while its lock is held, so this works
    for runs in this process, in worker processes and on Dask workers sharing the file system.
    """

    def __init__(self, stream=None, every: float | None = None):
        import sys
        import threading

        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every if every is not None else (0.5 if self.tty else 5.0)
        self.jobs: dict[str, RunJob] = {}
        self._seen: dict[str, tuple[float, str | None]] = {}  # key -> (first seen, last phase printed)
        self._printed = 0.0
        self._status = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="workbench-progress", daemon=True)

    def start(self) -> "LiveProgress":
        """Return self after starting the watcher thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watcher thread and clear the status line."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            self._clear()
            self._status = ""

    def watch(self, jobs: Iterable[RunJob]) -> None:
        """Add runs that may execute from now on."""
        with self._lock:
            self.jobs.update((j.key, j) for j in jobs)

    def finished(self, key: str) -> None:
        """Stop watching a run (its end line is printed by the caller through `say`)."""
        with self._lock:
            self.jobs.pop(key, None)
            self._seen.pop(key, None)

    def say(self, text: str) -> None:
        """Print a line of the pipeline's own output, below (and never through) the status line."""
        with self._lock:
            self._clear()
            print(text, file=self.stream, flush=True)
            self._draw()

    def _clear(self) -> None:
        if self.tty and self._status:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def _draw(self) -> None:
        if self.tty and self._status:
            width = shutil.get_terminal_size((120, 24)).columns - 1
            self.stream.write("\r" + self._status[:width] + "\x1b[K")
            self.stream.flush()

    def _loop(self) -> None:
        while not self._stop.wait(min(0.5, self.every)):
            try:
                self.tick()
            except Exception:  # showing progress must never break a pipeline
                pass

    def tick(self) -> None:
        """Look at the watched runs once and print or redraw what they are doing."""
        now = time.monotonic()
        with self._lock:
            jobs = list(self.jobs.values())
        lines = []
        fresh = False
        for job in jobs:
            if not _held(job.dir.parent / f".{job.dir.name}.lock") or (job.dir / "run.json").exists():
                continue
            first, phase_shown = self._seen.get(job.key, (now, None))
            work = job.dir.parent / f".{job.dir.name}.partial"
            prog = read_progress(work)  # execute_run removed any left by an earlier attempt
            phase = (prog or {}).get("phase", "running")
            fresh |= phase != phase_shown
            self._seen[job.key] = (first, phase)
            lines.append(progress_text(job, prog, now - first))
        with self._lock:
            if self.tty:
                self._status = " | ".join(lines)
                if self._status:
                    self._draw()
                else:
                    self._clear()
            elif lines and (fresh or now - self._printed >= self.every):
                self._printed = now
                for line in lines:
                    print(line, file=self.stream, flush=True)


# ---- the pipeline ------------------------------------------------------------------------------------------
@dataclass
class Result:
    """What a pipeline run did: one record per run (status done, failed or blocked) and the report path."""

    pipeline: str
    records: list[dict]
    report: Path | None = None

    @property
    def ok(self) -> bool:
        """Return True when every run is done."""
        return all(r["status"] == "done" for r in self.records)

    def count(self, status: str, skipped: bool | None = None) -> int:
        """Return how many runs have this status (and, if given, were or were not skipped)."""
        return sum(r["status"] == status and (skipped is None or bool(r.get("skipped")) == skipped)
                   for r in self.records)

    def summary(self) -> str:
        """Return a human-readable summary, one line per failed or blocked run."""
        lines = [f"pipeline {self.pipeline}: {len(self.records)} runs: {self.count('done', False)} ran, "
                 f"{self.count('done', True)} already complete, {self.count('failed')} failed, "
                 f"{self.count('blocked')} blocked"]
        for r in self.records:
            if r["status"] in ("failed", "blocked"):
                lines.append(f"  {r['status']}: {r['step']}/{r['key']}: {r.get('error')}")
        if self.report is not None:
            lines.append(f"report: {self.report}")
        return "\n".join(lines)


def _levels(pipe: Pipeline) -> list[list[str]]:
    level: dict[str, int] = {}
    for s in pipe.steps:
        level[s.name] = 1 + max((level[u] for u in s.needs), default=-1)
    return [[s.name for s in pipe.steps if level[s.name] == lv] for lv in range(max(level.values()) + 1)]


def run(spec: str | os.PathLike, profile: str | None = None, jobs: int = 1, executor: str = "local",
        scheduler: str | None = None, runs_dir: str | os.PathLike = "runs", report_html: bool = True,
        log: Callable[[str], None] | None = print, progress: bool = False, threads: int = 0) -> Result:
    """Return the Result of running every run of a pipeline not yet complete (validated before anything runs).

    With `progress`, what executes is shown live on stdout (LiveProgress: a status line on a terminal,
    plain lines elsewhere), and `log` lines print below it. `executor="dask"` runs on the cluster at
    `scheduler`, or on a LocalCluster of this machine when None; `threads` fixes the torch threads of every
    run (0: locally the cores over the runs executing at once, on Dask each worker's share of its host's cores).
    """
    pipe = load_spec(spec, profile)
    jobs_list = expand(pipe, runs_dir)
    validate(pipe, jobs_list)
    ex = make_executor(executor, jobs, scheduler, threads)
    live = LiveProgress() if progress else None
    say = log or (lambda s: None)
    if live is not None and log is not None:
        say = live.say
    records: dict[str, dict] = {}
    steps = {s.name: s for s in pipe.steps}
    try:
        if live is not None:
            live.start()
        for names in _levels(pipe):
            todo: list[RunJob] = []
            for job in (j for j in jobs_list if j.step in names):
                rec = read_record(job.dir)
                if _done(rec):
                    records[job.key] = {**rec, "skipped": True}
                    continue
                bad = [k for k in job.upstream if records.get(k, {}).get("status") != "done"]
                if bad and steps[job.step].each:
                    records[job.key] = {"pipeline": pipe.name, "step": job.step, "key": job.key, "status": "blocked",
                                        "error": f"upstream run(s) {', '.join(bad)} did not complete",
                                        "params": job.params}
                    continue
                if bad:  # a gather step runs on the upstream runs that completed
                    job = _drop_upstream(pipe, job, set(bad))
                todo.append(job)
            if live is not None:
                live.watch(todo)
            dirs = {j.key: j.dir for j in todo}
            for rec in ex.map(execute_run, todo):
                records[rec["key"]] = rec
                if live is not None:
                    live.finished(rec["key"])
                mark = "skipped (complete)" if rec.get("skipped") else rec["status"]
                say(f"[{rec['step']}] {rec['key']} {mark} in {rec.get('seconds', 0):.1f} s"
                    + _trained(dirs.get(rec["key"])) + (f": {rec['error'].splitlines()[0]}" if rec.get("error") else ""))
    finally:
        if live is not None:
            live.stop()
        ex.close()
    result = Result(pipe.name, [records[k] for k in records])
    if report_html:
        result.report = report(pipe, runs_dir=runs_dir)
    say(result.summary())
    return result


def _trained(run_dir: Path | None) -> str:
    """Return " (N steps at T tok/s, precision, compile on/off)" for a run folder with a progress.json, else ""."""
    p = read_progress(run_dir) if run_dir is not None else None
    if p is None or not isinstance(p.get("total"), int):
        return ""
    rate = f" at {p['tokens_per_s']:,.0f} tok/s" if p.get("tokens_per_s") else ""
    return f" ({p.get('step')} steps{rate}, {p.get('precision', '?')}, compile {p.get('compile', '?')})"


def _drop_upstream(pipe: Pipeline, job: RunJob, bad: set[str]) -> RunJob:
    step = next(s for s in pipe.steps if s.name == job.step)
    params = dict(job.params)
    keyed = dict(job.params)
    upstream = [k for k in job.upstream if k not in bad]
    for param in set(step.gather.values()):
        dirs = [d for d in params[param] if Path(d).name not in bad]
        params[param] = dirs
        keyed[param] = [f"run:{Path(d).name}" for d in dirs]
    lib = job.library or library_digest()
    key = run_key(notebook_hash(job.notebook), keyed, upstream, lib)[:16]
    return RunJob(job.pipeline, job.step, key, job.dir.parent / key, job.notebook, params, upstream, library=lib)


def status(spec: str | os.PathLike, profile: str | None = None, runs_dir: str | os.PathLike = "runs") -> list[dict]:
    """Return one row per run of the spec (state done, failed, partial or pending), then one per stale run.

    A stale run is a completed folder of one of the spec's steps whose key the current code no longer
    produces and whose recorded library digest differs from the current one (or is absent: made before
    digests were recorded): its results came from older library code. Each row has step, key, state,
    seconds, error and dir.
    """
    pipe = load_spec(spec, profile)
    rows = []
    jobs = expand(pipe, runs_dir)
    for job in jobs:
        rec = read_record(job.dir)
        partial = job.dir.parent / f".{job.dir.name}.partial"
        state = rec["status"] if rec else ("partial" if partial.exists() else "pending")
        rows.append({"step": job.step, "key": job.key, "state": state, "seconds": (rec or {}).get("seconds"),
                     "error": (rec or {}).get("error"), "dir": str(job.dir)})
    current = {j.dir for j in jobs}
    lib = library_digest()
    root = Path(runs_dir).resolve() / pipe.name
    for step in pipe.steps:
        for d in sorted((root / step.name).glob("*")):
            rec = read_record(d) if d.is_dir() and d not in current else None
            if rec is None or rec.get("status") != "done" or rec.get("library") == lib:
                continue  # not a finished run, a current one, or one made by this code for other parameters
            rows.append({"step": step.name, "key": d.name, "state": "stale", "seconds": rec.get("seconds"),
                         "error": None, "dir": str(d)})
    return rows


def clean(spec: str | os.PathLike, runs_dir: str | os.PathLike = "runs", failed_only: bool = False) -> list[Path]:
    """Return the folders removed: all of the pipeline's runs, or only failed and partial ones."""
    pipe = load_spec(spec)
    root = Path(runs_dir).resolve() / pipe.name
    removed: list[Path] = []
    if not root.exists():
        return removed
    if not failed_only:
        shutil.rmtree(root)
        return [root]
    for d in sorted(root.glob("*/*")) + sorted(root.glob("*/.*.partial")):
        if d.is_dir() and (d.name.endswith(".partial") or (read_record(d) or {}).get("status") == "failed"):
            shutil.rmtree(d)
            removed.append(d)
    return removed


# ---- the report ----------------------------------------------------------------------------------------------
# The executed notebook as a report: inputs collapsed under "code" (results read first), no In/Out prompts,
# nothing fetched from the network (no require.js, MathJax or Mermaid from a CDN), plotly.js from the
# pipeline folder, and a visible message where it did not load.
_EXPORT_VERSION = 4  # bump to rewrite older notebook.html files
_EXPORT_MARK = f'<meta name="workbench-export" content="{_EXPORT_VERSION}">'
_STAMP_WITHIN = 1024  # bytes of notebook.html searched for its stamp (it follows the doctype)
_NOTEBOOK_TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}
<script src="{{ resources.wb_plotly }}"></script>
{%- endblock html_head_js -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{% block extra_css %}
{{ resources.wb_mark }}
<style>
details.wb-code > summary { cursor: pointer; color: #666; font-size: 12px; padding: 2px 0 2px 4px;
  font-family: var(--jp-ui-font-family, sans-serif); }
details.wb-code { margin: 2px 0 4px 0; }
.wb-plotly-missing { color: #b00020; border: 1px solid #b00020; padding: 8px; margin: 8px auto; max-width: 1100px;
  font-family: var(--jp-ui-font-family, sans-serif); font-size: 14px; }
main { max-width: 1100px; margin: 0 auto; }
</style>
{% endblock extra_css %}
{%- block body_header -%}
{{ super() }}
<div id="wb-plotly-banner" class="wb-plotly-missing" hidden>{{ resources.wb_missing }}</div>
<script>if (typeof window.Plotly === "undefined") document.getElementById("wb-plotly-banner").hidden = false;</script>
{%- endblock body_header -%}
{% block input_group -%}
{%- set tags = cell.metadata.get('tags', []) -%}
<details class="wb-code"><summary>{{ 'parameters (defaults)' if 'parameters' in tags else
  ('parameters of this run' if 'injected-parameters' in tags else 'code') }}</summary>
{{ super() }}
</details>
{%- endblock input_group %}
"""


def _html_stamp(nb_bytes: bytes, plotly_rel: str) -> str:
    """Return the comment notebook.html carries: the export version, plotly's path and the executed notebook's sha256."""
    digest = hashlib.sha256(nb_bytes).hexdigest()
    return f"<!-- workbench-export {_EXPORT_VERSION} plotly={html.escape(plotly_rel)} notebook-sha256={digest} -->"


def _notebook_html(run_dir: Path, plotly_rel: str) -> Path | None:
    """Return the path of run_dir/notebook.html after (re)writing it from the executed notebook (None without one).

    Rendered only when the HTML's stamp (`_html_stamp`: what it was rendered from) differs: nbconvert takes
    about a second per notebook, and a finished run's notebook does not change. The stamp is a comment we
    write ourselves, since nbconvert re-serialises the page's own tags (a <meta> mark never matched), and a
    content hash, not an mtime, so a copied pipeline folder is not re-rendered.
    """
    nb_path, out = run_dir / "notebook.ipynb", run_dir / "notebook.html"
    if not nb_path.exists():
        return None
    stamp = _html_stamp(nb_path.read_bytes(), plotly_rel)
    if out.exists():
        with open(out, "rb") as f:
            if stamp.encode() in f.read(_STAMP_WITHIN):
                return out
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    from .viz.figures import PLOTLY_MISSING

    exporter = HTMLExporter(template_name="lab", template_file="workbench_notebook.html.j2",
                            extra_loaders=[jinja2.DictLoader({"workbench_notebook.html.j2": _NOTEBOOK_TEMPLATE})],
                            exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(
        nbformat.read(nb_path, as_version=4),
        resources={"wb_plotly": plotly_rel, "wb_mark": _EXPORT_MARK,
                   "wb_missing": html.escape(f"{PLOTLY_MISSING} (looked for {plotly_rel})")})
    # after the doctype: a comment before it would put browsers in quirks mode
    head, _, rest = body.partition("\n")
    body = f"{head}\n{stamp}\n{rest}" if head.lstrip().lower().startswith("<!doctype") else f"{stamp}\n{body}"
    atomic_write_bytes(out, body.encode())
    return out


@dataclass
class Headline:
    """One number of a run's summary: a stable key, what it is, its value and how the report prints it."""

    key: str
    label: str
    value: float
    text: str


def _num(ds, name: str, **sel) -> float | None:
    if name not in ds:
        return None
    da = ds[name]
    try:
        da = da.sel(sel) if sel else da
    except (KeyError, ValueError):
        return None
    return float(da) if da.size == 1 else None


def headlines(ds) -> list[Headline]:
    """Return the headline numbers of one run's results Dataset, each read from one of its variables or attrs.

    Best loop count r and the loss there and at K (`loss` over `loop`); the test-time fit L∞, Z, z
    and the loops it was fitted on; lost(1) and ρ (lost-gradient runs); the terminal-to-core ratio
    and the angle at the first and last loop (geometry runs); every fitted law parameter with its
    interval (φ first). Accuracy by group and loop is `accuracy_table`.
    """
    import numpy as np

    out: list[Headline] = []

    def add(key, label, value, fmt="{:.3f}", unit="", after=""):
        if value is not None and np.isfinite(value):
            out.append(Headline(key, label, float(value), fmt.format(value) + unit + after))

    K = ds.attrs.get("training_loops")
    loss = ds.get("loss")
    if loss is not None and loss.dims == ("loop",) and np.isfinite(loss.values).any():
        i = int(np.nanargmin(loss.values))
        best = int(loss.loop.values[i])
        add("best_r", "best loop count r (of those measured)", best, "{:.0f}")
        add("loss_at_best", f"loss at r = {best}", float(loss.values[i]), unit=" nats/token")
        if K is not None:
            add("loss_at_K", f"loss at K = {int(K)}", _num(ds, "loss", loop=int(K)), unit=" nats/token")
    if "test_time_L_inf" in ds:
        add("fit_upto", "test-time law L(T) = L∞ + Z·e^(−zT) fitted on loops 1 to", _num(ds, "test_time_fit_upto"),
            "{:.0f}")
        add("fit_L_inf", "test-time law L∞", _num(ds, "test_time_L_inf"), unit=" nats/token")
        add("fit_Z", "test-time law Z", _num(ds, "test_time_Z"), unit=" nats/token")
        add("fit_z", "test-time law z", _num(ds, "test_time_z"), unit=" per loop")
    if "lost" in ds and ds.lost.dims == ("k",):
        add("lost_1", "lost(1): share of |g| truncation to k = 1 throws away", _num(ds, "lost", k=1))
        add("rho", "ρ: backward shrink of the adjoint per loop", ds.attrs.get("rho"))
        add("loops", "loops r", ds.attrs.get("loops"), "{:.0f}")
    if "terminal_to_core" in ds:
        add("terminal_to_core", "terminal-to-core response ratio", _num(ds, "terminal_to_core"))
    angle = ds.get("angular_distance")
    if angle is not None and angle.dims == ("loop",) and "lost" not in ds and "test_time_L_inf" not in ds:
        first, last = int(angle.loop.values[0]), int(angle.loop.values[-1])
        add("angle_first", f"angular distance at loop {first}", float(angle.values[0]), unit=" π rad")
        add("angle_last", f"angular distance at loop {last}", float(angle.values[-1]), unit=" π rad")
    if "estimate" in ds and "param" in ds.dims:
        params = ["phi"] if "phi" in ds.param.values else [str(p) for p in ds.param.values]
        groups = [str(g) for g in ds.group.values] if "group" in ds.dims else [None]
        for p in params:
            for g in groups:
                sel = {"param": p, **({"group": g} if g is not None else {})}
                est, lo, hi = (_num(ds, v, **sel) for v in ("estimate", "low", "high"))
                name = {"phi": "φ"}.get(p, p) + (f" ({g})" if g is not None else "")
                known = lo is not None and hi is not None and bool(np.isfinite([lo, hi]).all())
                add(f"{p}[{g}]" if g is not None else p, name, est,
                    after=f" (95% interval {lo:.3f} to {hi:.3f})" if known else "")
    return out


def accuracy_table(ds, max_loops: int = 8) -> tuple[list[str], list[int], list[list[float]]] | None:
    """Return (groups, loops, accuracy[group][loop]) of a run's `group_accuracy`, or None without one.

    Every loop when there are at most max_loops, else loop 1, K, the best loop per mean accuracy and the last.
    """
    import numpy as np

    if "group_accuracy" not in ds or set(ds.group_accuracy.dims) != {"loop", "group"}:
        return None
    acc = ds.group_accuracy.transpose("group", "loop")
    loops = [int(x) for x in acc.loop.values]
    if len(loops) > max_loops:
        K = ds.attrs.get("training_loops")
        mean = np.nan_to_num(acc.mean("group").values, nan=-1)
        keep = {loops[0], loops[-1], loops[int(mean.argmax())]} | ({int(K)} if K is not None and int(K) in loops else set())
        loops = sorted(keep)
    return ([str(g) for g in acc.group.values], loops,
            [[float(acc.sel(group=g, loop=r)) for r in loops] for g in acc.group.values])


_REPORT_CSS = """
body { font-family: system-ui, sans-serif; margin: 0 auto; padding: 1.5em 2em; max-width: 1400px; color: #222; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 2px solid #ddd; }
.meta { color: #666; font-size: 13px; } nav a { margin-right: 1em; }
article.run { border: 1px solid #ddd; border-radius: 6px; padding: 0.6em 1em 1em; margin: 1em 0; }
article.run.failed { border-color: #c33; background: #fff6f6; } article.run.blocked, article.run.pending { background: #f6f6f6; }
.run header { display: flex; flex-wrap: wrap; gap: 0.4em 1.2em; align-items: baseline; }
.run header .key { font-family: monospace; font-size: 14px; } .run header span { font-weight: 600; }
.run header .done { color: #2a7a2a; } .run header .failed { color: #b00020; }
.params { font-size: 12px; color: #555; font-family: monospace; word-break: break-word; }
table.summary { border-collapse: collapse; margin: 0.6em 0; font-size: 14px; }
table.summary td, table.summary th { border: 1px solid #e3e3e3; padding: 3px 10px; text-align: left; }
table.summary td.wb-num, table.summary td.num { text-align: right; font-variant-numeric: tabular-nums; }
.figs { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 12px; }
figure.wb-figure { margin: 0; border: 1px solid #eee; border-radius: 4px; padding: 4px; min-width: 0; }
figure.wb-figure figcaption { font-size: 12px; color: #666; padding: 2px 6px; }
.links { font-size: 13px; margin-top: 0.6em; } .links a { margin-right: 1.2em; }
pre.err { white-space: pre-wrap; color: #900; font-size: 12px; }
.wb-plotly-missing { color: #b00020; border: 1px solid #b00020; padding: 8px; }
"""

# draws every figure of the page in turn (one per frame, so a long report stays responsive); the shared
# plotly templates are stored once and put back into each layout
_REPORT_JS = """
(function () {
  var banner = document.getElementById("wb-plotly-banner");
  var plots = Array.prototype.slice.call(document.querySelectorAll("div.wb-plot[data-figure]"));
  if (typeof window.Plotly === "undefined") {
    banner.hidden = false;
    plots.forEach(function (el) { el.style.height = "auto"; el.innerHTML = banner.innerHTML; });
    return;
  }
  var templates = JSON.parse(document.getElementById("wb-templates").textContent);
  function next() {
    var el = plots.shift(); if (!el) { document.body.setAttribute("data-plots-drawn", "1"); return; }
    var f = JSON.parse(document.getElementById(el.getAttribute("data-figure")).textContent);
    if (f.layout && typeof f.layout.template === "string") f.layout.template = templates[f.layout.template];
    window.Plotly.newPlot(el, f.data, f.layout, {responsive: true, displaylogo: false})
      .then(function () { el.setAttribute("data-drawn", "1"); window.requestAnimationFrame(next); },
            function (e) { el.textContent = "this figure could not be drawn: " + e; window.requestAnimationFrame(next); });
  }
  next();
})();
"""


def _figure_files(run_dir: Path) -> list[Path]:
    """Return the run's figures/*.json in the order the notebook wrote them (then by name)."""
    files = list((run_dir / "figures").glob("*.json"))
    return sorted(files, key=lambda f: (f.stat().st_mtime, f.name))


_SUMMARIES = ".report-summaries.json"  # in runs/<pipeline>/: each run's headline numbers, by results.nc's sha256


def _results_summary(results: Path, cache: dict) -> tuple[list[Headline], Any]:
    """Return (headlines, accuracy_table) of a results.nc, from `cache` when it holds them for this file and library.

    Reading them takes xarray, pandas and h5netcdf (seconds to import) while a finished run's results do
    not change: the entry is keyed by the file's sha256 and the library digest (which covers `headlines`).
    Raises what reading the file raises; an unreadable file is not cached.
    """
    digest = hashlib.sha256(results.read_bytes()).hexdigest()
    name = f"{results.parent.parent.name}/{results.parent.name}"
    hit = cache.get(name)
    if isinstance(hit, dict) and hit.get("sha256") == digest and hit.get("library") == library_digest():
        return [Headline(*h) for h in hit["headlines"]], hit["table"]
    import xarray as xr

    with xr.open_dataset(results, engine="h5netcdf") as ds:
        heads, table = headlines(ds.load()), accuracy_table(ds)
    cache[name] = {"sha256": digest, "library": library_digest(),
                   "headlines": [[h.key, h.label, h.value, h.text] for h in heads], "table": table}
    return heads, table


def _run_article(job: RunJob, rec: dict | None, root: Path, templates: dict, data_blocks: list,
                 summaries: dict | None = None) -> str:
    """Return the HTML of one run: state, parameters, headline numbers, its figures inline and links to its data."""
    esc = html.escape
    state = rec["status"] if rec else "pending"
    rel = f"{job.step}/{job.key}"
    shown = {k: (f"run {Path(v).name}" if isinstance(v, str) and Path(v).parent.parent == root else
                 f"{len(v)} runs" if isinstance(v, list) and v and str(v[0]).startswith(str(root)) else v)
             for k, v in job.params.items()}
    params = ", ".join(f"{esc(str(k))}={esc(json.dumps(v, default=str))}" for k, v in shown.items())
    secs = f"{rec['seconds']:.1f} s" if rec and rec.get("seconds") is not None else ""
    parts = [f'<article class="run {state}" id="run-{esc(job.step)}-{job.key}" data-run="{esc(rel)}">',
             f'<header><span class="key">{esc(job.step)} · {job.key}</span><span class="{state}">{state}</span>'
             f"<span>{secs}</span></header>", f'<div class="params">{params}</div>']
    if rec and rec.get("error"):
        parts.append(f'<pre class="err">{esc(rec["error"])}</pre>')
    results = job.dir / "results.nc"
    if rec and results.exists():
        try:
            heads, table = _results_summary(results, {} if summaries is None else summaries)
        except Exception as e:  # an unreadable file is shown, not fatal to the report
            heads, table = [], None
            parts.append(f'<pre class="err">results.nc could not be read: {esc(str(e))}</pre>')
        if heads:
            rows = "".join(f'<tr><th>{esc(h.label)}</th><td class="wb-num" data-key="{esc(h.key)}" '
                           f'data-value="{h.value!r}">{esc(h.text)}</td></tr>' for h in heads)
            parts.append(f'<table class="summary headlines">{rows}</table>')
        if table:
            groups, loops, acc = table
            head = "".join(f"<th>r = {r}</th>" for r in loops)
            body = "".join(f"<tr><th>{esc(g)}</th>" + "".join(
                f'<td class="wb-num" data-key="accuracy[{esc(g)}][{r}]" data-value="{a!r}">{a:.3f}</td>'
                for r, a in zip(loops, row)) + "</tr>" for g, row in zip(groups, acc))
            parts.append(f'<table class="summary accuracy"><tr><th>accuracy (fraction) by group</th>{head}</tr>'
                         f"{body}</table>")
    figs = _figure_files(job.dir) if rec else []
    if figs:
        parts.append('<div class="figs">')
        for f in figs:
            spec = json.loads(f.read_text())
            layout = spec.setdefault("layout", {})
            t = layout.get("template")
            if isinstance(t, dict):  # a plotly template is ~7 kB: store each distinct one once per page
                key = hashlib.sha256(json.dumps(t, sort_keys=True).encode()).hexdigest()[:12]
                templates.setdefault(key, t)
                layout["template"] = key
            layout.pop("width", None)  # the page's grid sets the width
            data_id = f"fig-{len(data_blocks)}"
            data_blocks.append(f'<script type="application/json" id="{data_id}">'
                               f'{json.dumps(spec).replace("</", "<" + chr(92) + "/")}</script>')
            height = int(layout.get("height") or 400)
            parts.append(f'<figure class="wb-figure"><div class="wb-plot" data-figure="{data_id}" '
                         f'style="height:{height}px;width:100%"></div><figcaption>{esc(f.stem)} · '
                         f'<a href="{rel}/figures/{esc(f.name)}" download>figure data (plotly JSON)</a>'
                         f"</figcaption></figure>")
        parts.append("</div>")
    links = []
    if rec and (job.dir / "notebook.html").exists():
        links.append(f'<a href="{rel}/notebook.html">executed notebook (code and output)</a>')
    if rec and results.exists():
        links.append(f'<a href="{rel}/results.nc" download>results data (netCDF: xarray.open_dataset)</a>')
    if rec and (job.dir / "metrics.nc").exists():
        links.append(f'<a href="{rel}/metrics.nc" download>training metrics (netCDF)</a>')
    if rec:
        links.append(f'<a href="{rel}/run.json">run record (JSON)</a>')
    if links:
        parts.append(f'<div class="links">{"".join(links)}</div>')
    parts.append("</article>")
    return "\n".join(parts)


def report(spec: str | os.PathLike | Pipeline, profile: str | None = None,
           runs_dir: str | os.PathLike = "runs") -> Path:
    """Return the path of runs/<pipeline>/report.html after (re)writing it and each run's notebook.html.

    The page shows every run's state, parameters and headline numbers (`headlines`, `accuracy_table`)
    and draws every figure it wrote, from JSON embedded in the page with the plotly.min.js written
    beside it; links are relative, so the pipeline folder opens offline wherever it is copied.
    """
    from plotly.offline import get_plotlyjs

    from .viz.figures import PLOTLY_MISSING

    pipe = spec if isinstance(spec, Pipeline) else load_spec(spec, profile)
    root = Path(runs_dir).resolve() / pipe.name
    root.mkdir(parents=True, exist_ok=True)
    plotly_js, js = root / "plotly.min.js", get_plotlyjs().encode()
    if not plotly_js.exists() or plotly_js.stat().st_size != len(js) or plotly_js.read_bytes() != js:
        atomic_write_bytes(plotly_js, js)
    esc = html.escape
    templates: dict = {}
    data_blocks: list[str] = []
    sections, counts = [], {}
    jobs = expand(pipe, runs_dir)
    cache_path = root / _SUMMARIES
    try:
        summaries = json.loads(cache_path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: every summary is read again
        summaries = {}
    cached = json.dumps(summaries, sort_keys=True)
    for step in pipe.steps:
        articles = []
        for job in (j for j in jobs if j.step == step.name):
            rec = read_record(job.dir)
            counts[rec["status"] if rec else "pending"] = counts.get(rec["status"] if rec else "pending", 0) + 1
            if rec:
                _notebook_html(job.dir, "../../plotly.min.js")
            articles.append(_run_article(job, rec, root, templates, data_blocks, summaries))
        sections.append(f'<section id="step-{esc(step.name)}"><h2>{esc(step.name)} '
                        f'<span class="meta">notebook {esc(step.notebook.name)} · {len(articles)} '
                        f'run{"s" * (len(articles) != 1)}</span></h2>\n' + "\n".join(articles) + "</section>")
    if json.dumps(summaries, sort_keys=True) != cached:
        atomic_write_bytes(cache_path, json.dumps(summaries, sort_keys=True).encode())
    nav = " ".join(f'<a href="#step-{esc(s.name)}">{esc(s.name)}</a>' for s in pipe.steps)
    tally = ", ".join(f"{n} {s}" for s, n in counts.items())
    templates_json = json.dumps(templates).replace("</", "<" + chr(92) + "/")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(pipe.name)} pipeline</title>
<script src="plotly.min.js"></script>
<style>{_REPORT_CSS}</style></head><body>
<h1>Pipeline <code>{esc(pipe.name)}</code>{f" (profile {esc(pipe.profile)})" if pipe.profile else ""}</h1>
<p>{esc(pipe.description)}</p>
<p class="meta">{tally} · spec <code>{esc(str(pipe.path))}</code> · written {_now()}</p>
<div id="wb-plotly-banner" class="wb-plotly-missing" hidden>{esc(PLOTLY_MISSING)}</div>
<nav>steps: {nav}</nav>
{chr(10).join(sections)}
<script type="application/json" id="wb-templates">{templates_json}</script>
{chr(10).join(data_blocks)}
<script>{_REPORT_JS}</script>
</body></html>
"""
    return atomic_write_bytes(root / "report.html", page.encode())
