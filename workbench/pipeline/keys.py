"""Run keys: the hash that names a run's folder, and the runs (`RunJob`s) a pipeline expands into.

A run's key hashes its parameters, the notebook's code (cells, not outputs), the workbench version, a
digest of the `workbench` package's source (`library_digest`) and the keys of the runs it consumes, so
a re-run skips what completed and reruns only what changed, including after an edit to the library.
`expand` turns a Pipeline into its runs, in step order, each with its key and folder.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
from collections.abc import Iterable
from pathlib import Path

from .spec import Pipeline, RunJob, Step

LIBRARY = Path(__file__).resolve().parent.parent  # the `workbench` package whose source enters every run key


def notebook_hash(path: Path) -> str:
    """Return the sha256 of a notebook's cells (type and source; outputs and metadata excluded)."""
    nb = json.loads(Path(path).read_text())
    cells = [[c.get("cell_type"), "".join(c.get("source", ""))] for c in nb.get("cells", [])]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _source_digest(root: Path) -> str:
    """Return the sha256 over the relative path and content of every .py file under root (cached per root)."""
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
    from .. import __version__

    blob = json.dumps({"notebook": nb_hash, "params": params, "version": __version__,
                       "library": library_digest() if library is None else library,
                       "upstream": list(upstream)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _combos(step: Step) -> list[dict]:
    """Return the step's parameter sets: every case times every grid combination."""
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
                # `each` pairs an upstream run with the combinations that agree with it on the parameters both
                # vary or set (a seed grid on both steps gives seed s after seed s, not every pairing)
                if any(k in u.params and u.params[k] != v for u in src for k, v in combo.items()):
                    continue
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


def drop_upstream(pipe: Pipeline, job: RunJob, bad: set[str]) -> RunJob:
    """Return a gather step's run re-keyed without the upstream runs in `bad` (those that did not complete)."""
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
