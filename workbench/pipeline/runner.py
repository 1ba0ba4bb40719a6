"""Orchestration: run a pipeline level by level (validated first, completed runs skipped), its status, clean-up."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..io import RunDir, read_record
from ..locking import RunBusyError, RunLock
from .execute import execute_run, make_executor, work_dir
from .keys import drop_upstream, expand, library_digest
from .progress import LiveProgress, trained_text
from .report import report
from .spec import Pipeline, PipelineError, RunJob, _done, check_runs_dir, load_spec, validate


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
    """Return the step names grouped by level: a step comes one level after the deepest step it consumes."""
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
    check_runs_dir(runs_dir)
    jobs_list = expand(pipe, runs_dir)
    validate(pipe, jobs_list)
    ex = make_executor(executor, jobs, scheduler, threads)
    live = LiveProgress() if progress else None
    say = log or (lambda s: None)
    if live is not None and log is not None:
        say = live.say
    records: dict[str, dict] = {}
    try:
        if live is not None:
            live.start()
        for names in _levels(pipe):
            todo = _ready(pipe, [j for j in jobs_list if j.step in names], records)
            if live is not None:
                live.watch(todo)
            dirs = {j.key: j.dir for j in todo}
            for rec in ex.map(execute_run, todo):
                records[rec["key"]] = rec
                if live is not None:
                    live.finished(rec["key"])
                mark = "skipped (complete)" if rec.get("skipped") else rec["status"]
                say(f"[{rec['step']}] {rec['key']} {mark} in {rec.get('seconds', 0):.1f} s"
                    + trained_text(dirs.get(rec["key"]))
                    + (f": {rec['error'].splitlines()[0]}" if rec.get("error") else ""))
    finally:
        if live is not None:
            live.stop()
        ex.close()
    result = Result(pipe.name, [records[k] for k in records])
    if report_html:
        result.report = report(pipe, runs_dir=runs_dir)
    say(result.summary())
    return result


def _ready(pipe: Pipeline, level: list[RunJob], records: dict[str, dict]) -> list[RunJob]:
    """Return the runs of one level to execute; records the ones already done (skipped) and the blocked ones.

    An `each` run whose upstream run did not complete is blocked; a `gather` run goes on with the
    upstream runs that completed (re-keyed without the others).
    """
    steps = {s.name: s for s in pipe.steps}
    todo: list[RunJob] = []
    for job in level:
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
            job = drop_upstream(pipe, job, set(bad))
        todo.append(job)
    return todo


def status(spec: str | os.PathLike, profile: str | None = None, runs_dir: str | os.PathLike = "runs") -> list[dict]:
    """Return one row per run of the spec (state done, failed, partial or pending), then one per stale run.

    A stale run is a completed folder of one of the spec's steps whose key the current code no longer
    produces and whose recorded library digest differs from the current one (or is absent: made before
    digests were recorded): its results came from older library code. Each row has step, key, state,
    seconds, error and dir.
    """
    pipe = load_spec(spec, profile)
    rows = []
    jobs = expand(pipe, check_runs_dir(runs_dir))
    for job in jobs:
        rec = read_record(job.dir)
        state = rec["status"] if rec else ("partial" if work_dir(job.dir).exists() else "pending")
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
    """Return the folders removed: all of the pipeline's runs, or only failed and partial ones.

    Refused (PipelineError, nothing removed) while any run of the pipeline is executing: clean holds every
    run's writer lock (`io.RunLock`) while it deletes, so no run starts in a folder being removed either.
    """
    pipe = load_spec(spec)
    root = check_runs_dir(runs_dir).resolve() / pipe.name
    removed: list[Path] = []
    if not root.exists():
        return removed
    folders = sorted(d for d in root.glob("*/*") if d.is_dir())  # runs and .<key>.partial working folders
    with contextlib.ExitStack() as held:
        busy = []
        for d in folders:
            # a working folder is written by its runner (the lock of the run it becomes) and by a training in it
            final = RunDir.final_of(d)
            for target in {final, d}:
                try:
                    held.enter_context(RunLock(target, "workbench clean"))
                except RunBusyError:
                    busy.append(d)
        if busy:
            raise PipelineError(f"{pipe.name}: {len(set(busy))} run(s) are executing now ("
                                + ", ".join(sorted({f'{d.parent.name}/{d.name}' for d in busy}))
                                + "); nothing was removed: wait for them to end, or stop them first")
        if not failed_only:
            shutil.rmtree(root)
            return [root]
        partial = set(root.glob(f"*/{work_dir(Path('*')).name}"))  # every step's working folders: .<key>.partial
        for d in folders:
            if d in partial or (read_record(d) or {}).get("status") == "failed":
                shutil.rmtree(d)
                removed.append(d)
    return removed
    if not failed_only:
        shutil.rmtree(root)
        return [root]
    partial = set(root.glob(f"*/{work_dir(Path('*')).name}"))  # every step's working folders: .<key>.partial
    for d in sorted(root.glob("*/*")) + sorted(partial):
        if d.is_dir() and (d in partial or (read_record(d) or {}).get("status") == "failed"):
            shutil.rmtree(d)
            removed.append(d)
    return removed
