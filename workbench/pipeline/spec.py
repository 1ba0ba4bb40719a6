"""Pipeline specs: the YAML schema, profiles, and the check of every run's parameters against its notebook.

`load_spec` reads and validates a spec into a `Pipeline` of `Step`s (a profile's overrides applied),
which `keys.expand` turns into `RunJob`s;
`declared_parameters` reads what a notebook declares (as papermill does, without importing it) and
`validate` rejects unknown names, wrong types and what a notebook's own library check refuses, before
anything runs.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import check_limit
from ..io import read_record

REPO = Path(__file__).resolve().parents[2]  # the checkout: pipelines/ and notebooks/ beside the package
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
def check_runs_dir(runs_dir: str | os.PathLike) -> Path:
    """Return the runs folder as a Path; PipelineError when the path names something other than a folder."""
    p = Path(runs_dir)
    if p.exists() and not p.is_dir():
        raise PipelineError(f"runs_dir={str(runs_dir)!r} is invalid: it is a file; give a folder (made if missing)")
    return p


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
    """Return the notebook a step names (beside the spec's project first, then the shipped ones); notes problems."""
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
    """Return a copy of a mapping of names (empty for None); notes a problem for anything else."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        problems.append(f"{where}: {name}={value!r} is invalid: must be a mapping of names")
        return {}
    return dict(value)


def _check_grid(grid: dict, where: str, problems: list[str]) -> None:
    """Note a problem for every grid entry that is not a non-empty list."""
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            problems.append(f"{where}: grid.{k}={v!r} is invalid: must be a non-empty list of values")


def _check_cases(cases: Any, where: str, problems: list[str]) -> list:
    """Return the cases as a list of dicts ([] for none); notes a problem for anything else."""
    if cases is None:
        return []
    if not isinstance(cases, list) or not all(isinstance(c, dict) for c in cases) or not cases:
        problems.append(f"{where}: cases={cases!r} is invalid: must be a non-empty list of parameter mappings")
        return []
    return [dict(c) for c in cases]


def _folder_name_ok(name: Any) -> bool:
    """Return True when a pipeline or step name can name a folder (non-empty, no slash, not hidden)."""
    return isinstance(name, str) and bool(name) and "/" not in name and not name.startswith(".")


def _strict_yaml(text: str) -> Any:
    """Return the parsed YAML text; yaml.YAMLError naming a mapping key given twice (PyYAML keeps the last)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"the key {key!r} is given twice (the first would be silently dropped)", key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=Loader)


def load_spec(spec: str | os.PathLike, profile: str | None = None) -> Pipeline:
    """Return the Pipeline a YAML spec describes, with `profile`'s overrides applied (PipelineError if invalid)."""
    import yaml

    path = resolve_spec(spec)
    try:
        raw = _strict_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise PipelineError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise PipelineError(f"{path}: a spec must be a mapping with keys {sorted(SPEC_KEYS)}")
    problems: list[str] = []
    for k in raw:
        if k not in SPEC_KEYS:
            problems.append(f"{path.name}: unknown key {k!r}; allowed: {', '.join(sorted(SPEC_KEYS))}")
    name = raw.get("name", path.stem)
    if not _folder_name_ok(name):
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
        step = _load_step(s, i, path, profile, overrides, seen, problems)
        if step is not None:
            seen.add(step.name)
            steps.append(step)
    for k in overrides:
        if k not in seen:
            problems.append(f"profiles.{profile}: names step {k!r}, which the spec does not have")
    if problems:
        raise PipelineError("invalid pipeline spec:\n  - " + "\n  - ".join(problems))
    return Pipeline(name, path, str(raw.get("description", "")), steps, profile, tuple(profiles))


def _load_step(s: Any, i: int, path: Path, profile: str | None, overrides: dict, seen: set[str],
               problems: list[str]) -> Step | None:
    """Return the Step of the spec's i-th entry, its profile's override merged (None if unnamed); notes problems."""
    where = f"{path.name} step {i + 1}"
    if not isinstance(s, dict):
        problems.append(f"{where}: must be a mapping with keys {sorted(STEP_KEYS)}")
        return None
    sname = s.get("name")
    if not _folder_name_ok(sname):
        problems.append(f"{where}: name={sname!r} is invalid: must be a non-empty folder name")
        return None
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
    over_at = f"profiles.{profile}.{sname}"
    over = _mapping(overrides.get(sname), over_at, "override", problems)
    for k in over:
        if k not in PROFILE_KEYS:
            problems.append(f"{over_at}: unknown key {k!r}; allowed: {', '.join(sorted(PROFILE_KEYS))}")
    params.update(_mapping(over.get("params"), over_at, "params", problems))
    over_grid = _mapping(over.get("grid"), over_at, "grid", problems)
    grid.update(over_grid)
    if "cases" in over:
        cases = _check_cases(over["cases"], over_at, problems)
    for k in [k for k, v in over_grid.items() if v is None]:
        del grid[k]  # a profile drops one of the step's grid axes with `name: null`
    _check_grid(grid, where, problems)
    both = sorted({k for c in cases for k in c} & grid.keys())
    if both:  # one would silently win over the other
        problems.append(f"{where}: {', '.join(both)} named in both cases and grid (after the profile's overrides); "
                        "give each parameter in one of them (a profile drops a grid axis with `name: null`)")
    if len(each) > 1:
        problems.append(f"{where}: each={each!r} is invalid: name one upstream step")
    for kind, m in (("each", each), ("gather", gather)):
        for up, param in m.items():
            if up not in seen:
                problems.append(f"{where}: {kind} names step {up!r}, which is not an earlier step")
            if not isinstance(param, str):
                problems.append(f"{where}: {kind}.{up}={param!r} is invalid: must be a parameter name")
    return Step(sname, nb, params, grid, cases, each, gather)


# ---- the parameters a notebook declares ----------------------------------------------------------------
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
    out = {}
    for name, d in decl.items():
        try:
            out[name] = ast.literal_eval(d.get("default", ""))
        except (ValueError, SyntaxError):
            pass
    return out


def notebook_defaults(notebook: str | os.PathLike) -> dict:
    """Return {parameter: default} of a notebook's parameters cell; a bare name is a notebook of `notebooks/`.

    The notebook's own defaults (the train notebook's are laptop-sized, not LoopConfig's or TrainConfig's),
    for a script or test that calls the library as the notebook would.
    """
    path = Path(notebook)
    if path.suffix != ".ipynb" and not path.exists():
        path = NOTEBOOKS_DIR / f"{notebook}.ipynb"
    return _defaults(declared_parameters(path))


def _done(rec: dict | None) -> bool:
    """Return True when a run record (read_record's, None for none) says the run finished successfully."""
    return rec is not None and rec.get("status") == "done"


# ---- validation ------------------------------------------------------------------------------------------
def validate(pipe: Pipeline, jobs: list[RunJob]) -> None:
    """Raise PipelineError listing every unknown parameter name, wrong type and failed check; return None when all pass.

    Names and types are checked for every job; a notebook's library check only for jobs that will run:
    a run already done under the same key had these exact parameters, notebook and library, so the check
    passed then, and importing it (the library, torch) would cost a finished pipeline's re-run seconds.
    """
    problems: list[str] = []
    declared = _declared_per_step(pipe, problems)
    mistyped = _check_names_and_types(jobs, declared, problems)  # runs whose own check would only repeat it
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


def _declared_per_step(pipe: Pipeline, problems: list[str]) -> dict[str, dict]:
    """Return {step: its notebook's declared parameters}; notes steps without a parameters cell or out_dir."""
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
    return declared


def _check_names_and_types(jobs: list[RunJob], declared: dict[str, dict], problems: list[str]) -> set[str]:
    """Return the keys of runs with an unknown, reserved or mistyped parameter; notes each problem once."""
    seen = set()
    mistyped = set()
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
                problems.append(_type_problem(job, name, value, decl[name]))
                seen.add((job.step, name, repr(value)))  # each bad value once, however many runs share it
            elif (problem := _limit_problem(job, name, value) or _range_problem(job, name, value, decl[name])) \
                    is not None:
                problems.append(problem)
                seen.add((job.step, name, repr(value)))
            else:
                continue
            mistyped.add(job.key)
    return mistyped


# a numeric parameter's range, declared once at the end of its help in the notebook's parameters cell:
# [lo..], [lo..hi], (lo..] (lo itself excluded), [..] (any finite number); for a list, each element's
_RANGE = re.compile(r"\s([\[(])(-?\d[\d.e+-]*)?\.\.(-?\d[\d.e+-]*)?\]$")


def declared_range(help_text: str) -> tuple[float | None, bool, float | None] | None:
    """Return (lo, lo excluded, hi) of a parameter's help ending in a range marker such as [1..], else None."""
    m = _RANGE.search(help_text or "")
    if m is None:
        return None
    return (None if m[2] is None else float(m[2]), m[1] == "(", None if m[3] is None else float(m[3]))


def in_range(value: float, rng: tuple[float | None, bool, float | None]) -> bool:
    """Return True if value lies in a declared range (lo, lo excluded, hi) as declared_range gives it."""
    lo, lo_open, hi = rng
    return (lo is None or value > lo or (value == lo and not lo_open)) and (hi is None or value <= hi)


def _numbers(name: str, value: Any) -> list[tuple[str, float]]:
    """Return (name, number) for a numeric parameter value, or (name[i], element) for each numeric list element."""
    items = [(f"{name}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(name, value)]
    return [(n, v) for n, v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _range_problem(job: RunJob, name: str, value: Any, decl: dict) -> str | None:
    """Return the message for a number (or list element) outside the range its notebook declares, else None."""
    rng = declared_range(decl.get("help", ""))
    bad = [(n, v) for n, v in _numbers(name, value) if rng is not None and not in_range(v, rng)]
    if not bad:
        return None
    shown, v = bad[0]
    return (f"step {job.step!r}: parameter {shown}={v!r} is out of the range {job.notebook.name} declares: "
            f"{name}: {decl['inferred_type_name']} = {decl['default']}  # {decl['help']}")


def _limit_problem(job: RunJob, name: str, value: Any) -> str | None:
    """Return the message for a number (or list element) past the limit of its kind (config.LIMITS), else None.

    Every notebook's numeric parameters meet the library's limits here, before any run starts; a
    notebook's own check (or its library call) adds the lower bounds and what depends on other values.
    """
    for shown, v in _numbers(name, value):
        try:
            check_limit(shown, v)
        except ValueError as e:
            return f"step {job.step!r}: parameter {e}"
    return None


def _type_problem(job: RunJob, name: str, value: Any, decl: dict) -> str:
    """Return the message for a parameter whose value does not fit its declared type."""
    tname = decl["inferred_type_name"]
    base = tname.split("[")[0]
    what = (f"has type {type(value).__name__}" if not (isinstance(value, _TYPES.get(base, object))
                                                        and not (isinstance(value, bool) and base != "bool"))
            else "is not finite" if isinstance(value, float)
            else "has an element of another type")
    return (f"step {job.step!r}: parameter {name}={value!r} {what}; {job.notebook.name} declares {name}: {tname}"
            + (f"  # {decl['help']}" if decl.get("help") else ""))
