"""Every shipped notebook runs under papermill (through its pipelines' smoke profiles or on its own),
and what it leaves behind is checked: results.nc with the declared dims and finite values, figures,
the executed notebook and the pipeline report."""

import ast
import json
import os
import re
from pathlib import Path

import nbformat
import numpy as np
import papermill
import pytest
import xarray as xr
import yaml

from workbench import pipeline
from workbench.pipeline.execute import socket_kernel_manager_class

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PIPELINES = sorted(p.stem for p in (ROOT / "pipelines").glob("*.yaml"))
# dims each notebook's results.nc must have, and variables that must be finite everywhere
DECLARED = {
    "train": ({"loop", "step"}, ["loss", "accuracy", "train_loss", "final_loss", "n_once", "n_rec", "tokens"]),
    "loop_sweep": ({"loop"}, ["loss", "loss_fit"]),
    "geometry": ({"loop", "source", "target", "lag"}, ["angular_distance", "relative_update", "state_variance"]),
    "lost_gradient": ({"k", "loop"}, ["lost", "cos", "adjoint_norm"]),
    # the same notebook across loop counts and a fine-tune: lost is NaN where k > r, by design
    "lost_gradient_finetune": ({"step", "loops", "batch", "k", "loop"}, ["lost_half", "rho", "loss", "grad_norm"]),
    "fit_laws": ({"group", "param", "run"}, ["observed"]),  # smoke fits of untrained models may diverge
    "taper": ({"schedule", "layer"}, ["d_ff"]),
    "tour": ({"loop"}, ["loss", "angular_distance", "relative_update"]),
    "retrofit": ({"loop", "depth"}, []),
    "generate": ({"point", "step"}, ["mean_loops", "loss", "accuracy", "gate_objective"]),
    "lm_eval": ({"loop", "task"}, ["loss_wb"]),  # a metric is NaN for tasks that do not report it
    # the recipe's phases, one notebook (retrofit_recipe: its default phase is install)
    "retrofit_recipe": ({"loop", "depth", "step"}, ["step_accuracy", "train_loss"]),
    "recipe_anneal": ({"loop", "depth", "approach"}, ["step_accuracy", "answer_accuracy", "seconds_per_answer",
                                                      "loop1_loss_diff"]),
    "recipe_scratchpad": ({"approach", "depth", "step"}, ["answer_accuracy", "seconds_per_answer"]),
    "recipe_inverse": ({"depth", "inverse_phase"}, ["step_accuracy", "inverse_step_accuracy",
                                                    "loop1_after_inverse_loss_diff"]),
}
# (pipeline, step) whose results have another layout than their notebook's default one
STEP_DECLARED = {("lost_gradient", "lost_gradient"): "lost_gradient_finetune",
                 **{("retrofit_recipe", p): f"recipe_{p}" for p in ("anneal", "scratchpad", "inverse")}}
# notebooks no pipeline runs: their smoke parameters
STANDALONE = {
    "tour": {"steps": 3, "d_model": 16, "loops": 2, "max_loops": 4},
    "explorer": {"train_steps": 3, "max_loops": 4},
}
PARAM_LINE = re.compile(r"^(\w+): (\w+)(\[\w+\])? = (.+?)  # (.+)$")  # list[int]: the runner checks elements


def _param_lines(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    return [line for line in cells[0].source.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_parameters_are_typed_documented_and_parsed(path):
    """Each parameter reads `name: type = value  # help`, and papermill sees every one of them.

    papermill silently drops a line it cannot parse (an `=` inside the help comment is enough), and
    then the runner would reject the parameter as unknown."""
    declared = papermill.inspect_notebook(str(path))
    names = []
    for line in _param_lines(path):
        m = PARAM_LINE.match(line)
        assert m, f"{path.name}: parameter line {line!r} must read 'name: type = value  # help'"
        names.append(m.group(1))
        assert m.group(2) in ("int", "float", "str", "bool", "list", "dict"), line
        assert m.group(3) is None or (m.group(2) == "list" and m.group(3)[1:-1] in ("int", "float", "str", "bool")), line
    assert sorted(names) == sorted(declared), f"{path.name}: papermill parsed {sorted(declared)}"
    # every number declares its range once, here, and its default lies in it (the runner checks runs against it)
    from workbench.pipeline.spec import declared_parameters, declared_range, in_range

    for name, d in declared_parameters(path).items():
        if d["inferred_type_name"] not in ("int", "float", "list[int]", "list[float]") or name == "out_dir":
            continue
        rng = declared_range(d["help"])
        assert rng is not None, f"{path.name}: {name}'s help must end with its range ([1..], [0..1], (0..], [..])"
        default = ast.literal_eval(d["default"])
        for v in default if isinstance(default, list) else [default]:
            assert in_range(v, rng), (path.name, name, v, rng)
    if path.stem != "explorer":  # the explorer is interactive and writes nothing
        assert "out_dir" in declared


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_carry_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    assert nb.metadata["kernelspec"]["name"] == "python3"


def test_every_notebook_runs_in_a_pipeline_or_on_its_own():
    used = set(STANDALONE)
    for name in PIPELINES:
        used |= {s.notebook.stem for s in pipeline.load_spec(name).steps}
    assert {p.stem for p in NOTEBOOKS} <= used


@pytest.mark.parametrize("name", PIPELINES)
def test_every_profile_validates(name):
    profiles = yaml.safe_load(pipeline.resolve_spec(name).read_text()).get("profiles", {})
    assert "smoke" in profiles, f"pipeline {name} needs a smoke profile"
    for profile in [None, *profiles]:
        pipe = pipeline.load_spec(name, profile)
        try:
            pipeline.validate(pipe, pipeline.expand(pipe, "runs"))
        except pipeline.PipelineError as e:
            # a profile for a model the user downloads (retrofit_recipe's paper profiles: Qwen2.5-0.5B from a
            # local folder) validates where that folder is; elsewhere it is refused before anything runs, by name
            local = {s.params.get("base") for s in pipe.steps} - {None}
            problems = [ln for ln in str(e).splitlines() if ln.strip().startswith("- ")]
            assert local and all(b.startswith("path:") for b in local), e
            assert problems and all("must name a local model folder" in ln and "nothing is downloaded" in ln
                                    for ln in problems), e


def check_results(run_dir: Path, notebook: str) -> xr.Dataset:
    """Assert a run's outputs: results.nc with the declared dims, finite values, figures that parse."""
    path = run_dir / "results.nc"
    assert path.exists(), f"{run_dir} has no results.nc"
    ds = xr.load_dataset(path, engine="h5netcdf")
    dims, finite = DECLARED[notebook]
    assert dims <= set(ds.dims), f"{notebook}: dims {set(ds.dims)} lack {dims - set(ds.dims)}"
    for var in finite:
        assert np.isfinite(ds[var].values).all(), f"{notebook}: {var} is not finite: {ds[var].values}"
    for var in ds.data_vars:  # elsewhere NaN may be meaningful (no coda: no core->coda ratio), not all of it
        if np.issubdtype(ds[var].dtype, np.floating) and ds[var].ndim:
            assert np.isfinite(ds[var].values).any(), f"{notebook}: {var} has no finite value"
    for key in ("git_commit", "workbench_version", "created"):
        assert key in ds.attrs
    figs = list((run_dir / "figures").glob("*.json"))
    assert figs, f"{notebook}: no figures saved"
    for f in figs:
        fig = json.loads(f.read_text())
        assert fig["data"], f"{f} has no traces"
    check_no_echoes(run_dir / "notebook.ipynb" if (run_dir / "notebook.ipynb").exists() else None)
    return ds


def check_no_echoes(path) -> None:
    """Assert an executed notebook shows no stray `Out[n]:` echo of a path (what `show(...)` or a save used to leave)."""
    if path is None:
        return
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        for o in c.get("outputs", []):
            text = o.get("data", {}).get("text/plain", "") if o.get("output_type") == "execute_result" else ""
            assert "Path(" not in text, f"{path}: a cell echoes {text!r}:\n{c.source}"


@pytest.mark.slow
# quickstart runs through Dask (conftest.smoke_quickstart), lm_eval in tests/test_lm_eval_step.py (which reads it)
@pytest.mark.parametrize("name", [p for p in PIPELINES if p not in ("quickstart", "lm_eval")])
def test_smoke_pipeline(name, tmp_path):
    runs = tmp_path / "runs"
    result = pipeline.run(name, profile="smoke", jobs=2, runs_dir=runs, log=None)
    check_smoke(name, runs, result)


@pytest.mark.slow
def test_smoke_quickstart_through_dask(smoke_quickstart):
    """The front door's smoke profile, run once per session through the Dask executor on a local cluster
    (conftest.smoke_quickstart, which the browser test of the report reads too)."""
    runs, result = smoke_quickstart
    check_smoke("quickstart", runs, result)


def check_smoke(name: str, runs: Path, result) -> None:
    """Assert a smoke pipeline ran: every run's results, figures and report page, and the pipeline's own checks."""
    assert result.ok, result.summary()
    pipe = pipeline.load_spec(name, "smoke")
    notebooks = {s.name: s.notebook.stem for s in pipe.steps}
    for job in pipeline.expand(pipe, runs):
        check_results(job.dir, STEP_DECLARED.get((name, job.step), notebooks[job.step]))
        page = (job.dir / "notebook.html").read_text()
        # read as a report: every input collapsed under <details>, no In/Out prompts, nothing from a CDN
        nb = nbformat.read(job.dir / "notebook.ipynb", as_version=4)
        assert page.count('<details class="wb-code">') == sum(c.cell_type == "code" for c in nb.cells)
        assert not re.search(r"(Out|In)(&nbsp;|\s)?\[\d+\]", page), "a cell prompt is shown"
        assert "cdnjs" not in page and "cdn.jsdelivr" not in page
    assert result.report.exists()
    if name == "quickstart":
        check_quickstart(runs)
        # each kernel ran with its Dask worker's share of the cores (1 on 2 cores), as its trainer recorded
        train, = pipeline.find_runs("quickstart", "train", runs)
        threads = xr.load_dataset(train / "results.nc", engine="h5netcdf").attrs["threads"]
        assert int(threads) == max(1, len(os.sched_getaffinity(0)) // 2)
    if name == "conditioning":
        check_conditioning(pipe, runs)
    if name == "lost_gradient":
        check_lost_gradient(pipe, runs)
    if name == "allocation":  # SPEC §3: the terminal-to-core ratio is defined with and without a coda
        for job in pipeline.expand(pipe, runs):
            if job.step == "geometry":
                assert np.isfinite(float(xr.load_dataset(job.dir / "results.nc", engine="h5netcdf").terminal_to_core))


def check_lost_gradient(pipe, runs: Path) -> None:
    """Assert each fine-tune case measured every r at every step, NaN exactly where k > r, with its own k."""
    cases = set()
    for job in pipeline.expand(pipe, runs):
        if job.step != "lost_gradient":
            continue
        ds = xr.load_dataset(job.dir / "results.nc", engine="h5netcdf")
        assert list(ds.loops.values) == [1, 2, 4] and list(ds.step.values) == [0, 1, 2]
        lost = ds.lost.transpose("step", "loops", "batch", "k").values
        beyond = np.broadcast_to((ds.k > ds.loops).transpose("loops", "k").values[None, :, None, :], lost.shape)
        assert np.isnan(lost[beyond]).all() and np.isfinite(lost[~beyond]).all()  # k past r: no such truncation
        assert np.isfinite(ds.train_loss.values[1:]).all()
        cases.add(int(ds.attrs["finetune_backward_loops"]))
    assert cases == {0, 1}


def check_conditioning(pipe, runs: Path) -> None:
    """Assert the conditioning runs read task accuracy past the trained depth, with chance and the trained mask."""
    for job in pipeline.expand(pipe, runs):
        if job.step not in ("train", "sweep"):
            continue
        ds = xr.load_dataset(job.dir / "results.nc", engine="h5netcdf")
        it = ds.sel(task="iterated")
        assert it.task_trained.sel(depth=[1, 2, 3, 4]).all() and not it.task_trained.sel(depth=[5, 6, 7, 8]).any()
        assert (it.task_count.sel(depth=[5, 6, 7, 8]) > 0).all()  # examples past the trained depth, on by default
        assert "group_accuracy_beyond" in ds and np.isfinite(ds.group_accuracy_beyond.sel(group="reasoning")).all()
        assert np.isfinite(ds.task_chance.sel(task="iterated", depth=range(1, 9))).all()
        # chance of the tasks as trained (task_options: 20 countries, the add rule), in train and sweep alike
        from workbench.data.tasks import chance_rate
        opts = pipe.steps[0].params["task_options"]
        assert float(ds.task_chance.sel(task="recall", depth=0)) == chance_rate("recall", 0, **opts["recall"])
        assert float(it.task_chance.sel(depth=3)) == chance_rate("iterated", 3, **opts["iterated"])


def check_quickstart(runs: Path) -> None:
    """The smoke quickstart's numbers mean something, and its run opens in the explorer as the model it trained.

    Even 3 steps in, looping helps: validation loss at K = 2 is below loss at r = 1 (by 0.03-0.04
    nats for seeds 0-3, in fp32 and bf16), in the train step's results and in the loop sweep's.
    """
    import torch

    from workbench.experiments import find_quickstart_checkpoint, load_run, open_model
    from workbench.viz.explorer import LoopExplorer

    sweep, = pipeline.find_runs("quickstart", "loop_sweep", runs)
    train, = pipeline.find_runs("quickstart", "train", runs)
    ds = xr.load_dataset(sweep / "results.nc", engine="h5netcdf")
    assert list(ds.loop.values) == list(range(1, 5))  # max_loops of the smoke profile
    trained = xr.load_dataset(train / "results.nc", engine="h5netcdf")
    K = int(trained.attrs["training_loops"])
    assert K == int(ds.attrs["training_loops"]) == 2
    for what, res in (("train", trained), ("loop_sweep", ds)):
        assert float(res.loss.sel(loop=K)) < float(res.loss.sel(loop=1)), (what, res.loss.values)
    # the explorer finds the real run (newest finished quickstart train run) and shows its model
    assert find_quickstart_checkpoint(runs) == train
    model, tok, source = open_model(runs_dir=runs, device="cpu")
    assert str(train) in source
    run = load_run(train, device="cpu")
    ex = LoopExplorer(model, tok, text="def f(x):\n    return x", max_loops=4, device="cpu")
    assert ex.message == "" and ex.view.sizes["loop"] == 4
    ids = torch.tensor([run.tokenizer.encode("def f(x):\n    return x")])
    assert list(ex.view.token_id.values) == ids[0].tolist()
    with torch.no_grad():
        for r in (1, K, 4):
            torch.testing.assert_close(ex.model(ids, loops=r).logits, run.model(ids, loops=r).logits, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STANDALONE))
def test_standalone_notebook(name, tmp_path, monkeypatch):
    out = tmp_path / "out.ipynb"
    params = dict(STANDALONE[name])
    if name == "explorer":
        params["runs_dir"] = str(tmp_path / "no-runs")  # nothing there: the notebook trains a tiny model
    cwd, temp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    temp.mkdir()
    # the kernel's temporary folder: where the tour writes when no out_dir is given (never the cwd)
    monkeypatch.setenv("TMPDIR", str(temp))
    papermill.execute_notebook(str(ROOT / "notebooks" / f"{name}.ipynb"), str(out), parameters=params,
                               cwd=str(cwd), kernel_name="python3", progress_bar=False,
                               kernel_manager_class=socket_kernel_manager_class())
    nb = nbformat.read(out, as_version=4)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    check_no_echoes(out)
    assert not list(cwd.iterdir()), f"{name} wrote into its working folder: {list(cwd.iterdir())}"
    if name in DECLARED:
        made, = temp.glob("looped-tour-*")
        check_results(made, name)
