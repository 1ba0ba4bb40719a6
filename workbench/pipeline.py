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
processes, or a Dask `distributed` scheduler); a failed run is recorded with its error and output
notebook and the others go on. ``report`` writes ``runs/<pipeline>/report.html``: every run's
status, parameters and links to its notebook rendered as HTML (nbconvert) with plotly.js loaded
once per pipeline, so it opens offline.
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
import shutil
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .io import atomic_write_bytes, find_runs, read_record  # noqa: F401 (find_runs: public here too)

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
def declared_parameters(notebook: str | os.PathLike) -> dict[str, dict]:
    """Return the notebook's declared parameters {name: {inferred_type_name, default, help}} (papermill)."""
    import papermill

    return papermill.inspect_notebook(str(notebook))


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


def validate(pipe: Pipeline, jobs: list[RunJob]) -> None:
    """Raise PipelineError listing every unknown parameter name and wrong type; return None when all are valid."""
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
    checks = {step.name: _declared_check(step.notebook) for step in pipe.steps if declared.get(step.name)}
    for job in jobs:
        check = checks.get(job.step)
        if check is None or job.key in mistyped:
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


def execute_run(job: RunJob) -> dict:
    """Return the run's record after executing its notebook (or the existing record if it already completed).

    Never raises for a failing notebook: the error and the output notebook are recorded instead.
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError

    from . import __version__
    from .io import git_commit

    final = Path(job.dir)
    with _locked(final.parent / f".{final.name}.lock"):
        rec = read_record(final)
        if rec is not None and rec.get("status") == "done":
            return {**rec, "skipped": True}
        work = final.parent / f".{final.name}.partial"
        if final.exists():  # a failed attempt: restart in its folder so checkpoints are reused
            if work.exists():
                shutil.rmtree(work)
            os.replace(final, work)
            (work / "run.json").unlink(missing_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        if job.threads:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                os.environ[var] = str(job.threads)  # the kernel inherits it: parallel runs share the cores
        started, t0 = _now(), time.perf_counter()
        error = None
        try:
            papermill.execute_notebook(str(job.notebook), str(work / "notebook.ipynb"),
                                       parameters={**job.params, "out_dir": "."}, cwd=str(work),
                                       kernel_name="python3", progress_bar=False, log_output=False,
                                       kernel_manager_class=_kernel_manager_class())
        except PapermillExecutionError as e:
            error = f"{e.ename}: {e.evalue} (cell {e.exec_count})"
        except Exception as e:  # kernel died, notebook unreadable, ...: still a recorded failure
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        record = {"pipeline": job.pipeline, "step": job.step, "key": job.key,
                  "status": "failed" if error else "done", "error": error,
                  "notebook": str(job.notebook), "params": job.params, "upstream": job.upstream,
                  "started": started, "finished": _now(), "seconds": round(time.perf_counter() - t0, 3),
                  "workbench_version": __version__, "library": job.library or library_digest(),
                  "git_commit": git_commit()}
        atomic_write_bytes(work / "run.json", json.dumps(record, indent=1, default=str).encode())
        os.replace(work, final)
    return record


# ---- executors -------------------------------------------------------------------------------------------
class LocalExecutor:
    """Runs jobs in local processes (`jobs` at once; in this process when jobs == 1)."""

    def __init__(self, jobs: int = 1):
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise PipelineError(f"jobs={jobs!r} is invalid: must be an integer >= 1")
        self.jobs = jobs

    def map(self, fn: Callable[[RunJob], dict], items: list[RunJob]) -> Iterator[dict]:
        """Return an iterator over fn(item) results in completion order."""
        if self.jobs == 1 or len(items) <= 1:
            yield from map(fn, items)
            return
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        threads = max(1, (os.cpu_count() or 1) // min(self.jobs, len(items)))
        for it in items:
            it.threads = threads
        with ProcessPoolExecutor(min(self.jobs, len(items)), mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(fn, it) for it in items]
            for f in as_completed(futures):
                yield f.result()

    def close(self) -> None:
        """Return None; nothing to release."""


class DaskExecutor:
    """Runs jobs on a Dask `distributed` scheduler (workers must share the runs folder's file system)."""

    def __init__(self, scheduler: str):
        try:
            from distributed import Client
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise PipelineError("executor='dask' needs dask.distributed: pip install 'looped-workbench[cluster]'") from e
        if not scheduler:
            raise PipelineError("executor='dask' needs --scheduler ADDRESS (e.g. tcp://127.0.0.1:8786)")
        self.client = Client(scheduler, timeout="30s")

    def map(self, fn: Callable[[RunJob], dict], items: list[RunJob]) -> Iterator[dict]:
        """Return an iterator over fn(item) results in completion order."""
        from distributed import as_completed

        futures = [self.client.submit(fn, it, pure=False, key=f"{it.step}-{it.key}-{time.time_ns()}")
                   for it in items]
        for f in as_completed(futures):
            yield f.result()

    def close(self) -> None:
        """Return None after closing the client connection."""
        self.client.close()


def make_executor(kind: str = "local", jobs: int = 1, scheduler: str | None = None):
    """Return an executor: "local" (processes, `jobs` at once) or "dask" (a distributed scheduler address)."""
    if kind == "local":
        return LocalExecutor(jobs)
    if kind == "dask":
        return DaskExecutor(scheduler or "")
    raise PipelineError(f"executor={kind!r} is invalid: must be 'local' or 'dask'")


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
        log: Callable[[str], None] | None = print) -> Result:
    """Return the Result of running every run of a pipeline not yet complete (validated before anything runs)."""
    pipe = load_spec(spec, profile)
    jobs_list = expand(pipe, runs_dir)
    validate(pipe, jobs_list)
    ex = make_executor(executor, jobs, scheduler)
    say = log or (lambda s: None)
    records: dict[str, dict] = {}
    steps = {s.name: s for s in pipe.steps}
    try:
        for names in _levels(pipe):
            todo: list[RunJob] = []
            for job in (j for j in jobs_list if j.step in names):
                rec = read_record(job.dir)
                if rec is not None and rec.get("status") == "done":
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
            for rec in ex.map(execute_run, todo):
                records[rec["key"]] = rec
                mark = "skipped (complete)" if rec.get("skipped") else rec["status"]
                say(f"[{rec['step']}] {rec['key']} {mark} in {rec.get('seconds', 0):.1f} s"
                    + (f": {rec['error'].splitlines()[0]}" if rec.get("error") else ""))
    finally:
        ex.close()
    result = Result(pipe.name, [records[k] for k in records])
    if report_html:
        result.report = report(pipe, runs_dir=runs_dir)
    say(result.summary())
    return result


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
def _notebook_html(run_dir: Path, plotly_rel: str) -> Path | None:
    nb_path, out = run_dir / "notebook.ipynb", run_dir / "notebook.html"
    if not nb_path.exists():
        return None
    if out.exists() and out.stat().st_mtime >= nb_path.stat().st_mtime:
        return out
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nbformat.read(nb_path, as_version=4))
    # plotly.js first in <head>, before require.js (if any) can claim it as an AMD module
    body = body.replace("<head>", f'<head>\n<script src="{plotly_rel}"></script>', 1)
    atomic_write_bytes(out, body.encode())
    return out


def report(spec: str | os.PathLike | Pipeline, profile: str | None = None,
           runs_dir: str | os.PathLike = "runs") -> Path:
    """Return the path of runs/<pipeline>/report.html after (re)writing it and each run's notebook.html."""
    pipe = spec if isinstance(spec, Pipeline) else load_spec(spec, profile)
    root = Path(runs_dir).resolve() / pipe.name
    root.mkdir(parents=True, exist_ok=True)
    plotly_js = root / "plotly.min.js"
    if not plotly_js.exists():
        from plotly.offline import get_plotlyjs

        atomic_write_bytes(plotly_js, get_plotlyjs().encode())
    esc = html.escape
    rows = []
    for job in expand(pipe, runs_dir):
        rec = read_record(job.dir)
        state = rec["status"] if rec else "pending"
        links = []
        if rec:
            nb_html = _notebook_html(job.dir, "../../plotly.min.js")
            if nb_html is not None:
                links.append(f'<a href="{job.step}/{job.key}/notebook.html">notebook</a>')
            if (job.dir / "results.nc").exists():
                links.append(f'<a href="{job.step}/{job.key}/results.nc">results.nc</a>')
            links += [f'<a href="{job.step}/{job.key}/figures/{f.name}">{esc(f.stem)}</a>'
                      for f in sorted((job.dir / "figures").glob("*.json"))]
        shown = {k: (f"run {Path(v).name}" if isinstance(v, str) and Path(v).parent.parent == root else
                     f"{len(v)} runs" if isinstance(v, list) and v and str(v[0]).startswith(str(root)) else v)
                 for k, v in job.params.items()}
        params = ", ".join(f"{esc(str(k))}={esc(json.dumps(v, default=str))}" for k, v in shown.items())
        err = f'<pre class="err">{esc(rec["error"])}</pre>' if rec and rec.get("error") else ""
        secs = f"{rec['seconds']:.1f}" if rec and rec.get("seconds") is not None else ""
        rows.append(f'<tr class="{state}"><td>{esc(job.step)}</td><td><code>{job.key}</code></td>'
                    f"<td>{state}</td><td>{secs}</td><td>{params}</td><td>{' · '.join(links)}{err}</td></tr>")
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{esc(pipe.name)} pipeline</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top;font-size:13px}}
tr.failed td{{background:#fdd}} tr.blocked td,tr.pending td{{background:#eee}} pre.err{{white-space:pre-wrap;color:#900}}
</style></head><body>
<h1>Pipeline <code>{esc(pipe.name)}</code>{f" (profile {esc(pipe.profile)})" if pipe.profile else ""}</h1>
<p>{esc(pipe.description)}</p><p>spec: <code>{esc(str(pipe.path))}</code>; written {_now()}</p>
<table><tr><th>step</th><th>run</th><th>status</th><th>seconds</th><th>parameters</th><th>outputs</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
    return atomic_write_bytes(root / "report.html", page.encode())
