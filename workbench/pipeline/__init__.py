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
                                      # (with its grid or cases: the combinations agreeing with that run)
      - name: fit
        notebook: fit_laws
        gather: {train: runs}         # one run; the list of `train`'s run folders goes in parameter `runs`
    profiles:
      smoke:                          # `--profile smoke`: per-step overrides (params merged; grid keys and cases replaced)
        train: {params: {steps: 5}, grid: {seed: [0]}}

The package, one concept per module:

- `spec`: the schema and profiles (`load_spec`); every parameter is checked against the notebook's
  declared ones (`declared_parameters`, read as `papermill.inspect_notebook` reads them) before anything
  runs: unknown names, wrong types, non-finite floats and list elements of the wrong type (`list[int]`)
  are rejected, and a notebook may name a library check in its metadata
  (`"workbench": {"check": "workbench.experiments:check_train_notebook"}`) that every run's parameters
  go through, so ranges and config fields fail before any run starts (`validate`).
- `keys`: a run's key hashes its parameters, the notebook's code (cells, not outputs), the workbench
  version, a digest of the `workbench` package's source (`library_digest`) and the keys of the runs it
  consumes, so a re-run skips what completed and reruns only what changed, including after an edit to
  the library. `status` lists completed runs made by older library code as "stale".
- `execute`: a run executes in ``runs/<pipeline>/<step>/.<key>.partial/`` (the notebook's working
  directory, `out_dir="."`), under a per-run file lock, and is renamed to ``runs/<pipeline>/<step>/<key>/``
  with a run.json record when it ends, done or failed; a failed or interrupted run restarts in its old
  folder (a training notebook resumes from its checkpoint). Runs of one step go in parallel through an
  executor (local processes, or Dask); a failed run is recorded with its error and output notebook and
  the others go on (on Dask too when a worker dies mid-run).
- `progress`: what `workbench run` shows while runs execute (`LiveProgress`).
- `report`: ``runs/<pipeline>/report.html`` (a Jinja2 template fed plain data): every run's status,
  parameters, the headline numbers its results.nc names (`io.save_results(..., headline=...)`) and
  figures drawn inline, with links to its data and to its notebook rendered as HTML.
- `runner`: `run` (level by level, completed runs skipped), `status` and `clean`.
"""

from ..io import find_runs  # noqa: F401 (public here too: where a pipeline's runs are looked for)
from .execute import (KERNEL_START_TIMEOUT, THREAD_VARS, DaskExecutor, LocalExecutor, execute_run,  # noqa: F401
                      machine_cores, make_executor, record_failed, work_dir)
from .keys import LIBRARY, _source_digest, expand, library_digest, notebook_hash, run_key  # noqa: F401
from .progress import LiveProgress, progress_text  # noqa: F401
from .report import Headline, accuracy_table, headlines, notebook_html, report  # noqa: F401
from .runner import Result, clean, run, status  # noqa: F401
from .spec import (NOTEBOOKS_DIR, PIPELINES_DIR, REPO, RESERVED, PipelineError, Pipeline, RunJob, Step,  # noqa: F401
                   _declared_check, declared_parameters, load_spec, notebook_defaults, resolve_spec, validate)
