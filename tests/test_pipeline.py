"""The pipeline runner: validation before running, keys and skipping, failure isolation, concurrency, Dask.

These tests use a tiny notebook (no torch) so the mechanics are tested in seconds; the shipped
notebooks and pipelines run in test_notebooks.py.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest

from workbench import pipeline
from workbench.cli import main as cli
from workbench.io import RunDir
from workbench.locking import RunLock

PARAMS = textwrap.dedent("""\
    x: int = 1  # a number the run writes out
    scale: float = 1.0  # multiplies x
    fail: bool = False  # raise inside the notebook
    log: str = ""  # file each execution appends a line to (counts executions)
    inputs: list = []  # folders of upstream runs
    upstream: str = ""  # folder of one upstream run
    out_dir: str = "."  # the run folder""")
BODY = textwrap.dedent("""\
    import json, os, time
    from pathlib import Path
    if log:
        with open(log, "a") as f:
            f.write(f"{x} {os.getppid()}\\n")  # the kernel's parent: whoever launched it
    if fail:
        raise RuntimeError(f"asked to fail at x={x}")
    total = x * scale + sum(json.loads((Path(d) / "out.json").read_text())["value"] for d in inputs)
    if upstream:
        total += json.loads((Path(upstream) / "out.json").read_text())["value"]
    Path(out_dir, "out.json").write_text(json.dumps({"value": total}))
    print("value", total)""")


def write_notebook(path: Path, body: str = BODY, params: str = PARAMS) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell(params)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell, nbformat.v4.new_code_cell(body)]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def write_spec(tmp: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp / "pipelines" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


@pytest.fixture
def project(tmp_path):
    write_notebook(tmp_path / "notebooks" / "tiny.ipynb")
    return tmp_path


SPEC = """\
name: demo
steps:
  - name: a
    notebook: tiny
    params: {log: LOG}
    grid: {x: [1, 2, 3]}
  - name: b
    notebook: tiny
    each: {a: upstream}
    params: {scale: 10.0, log: LOG}
  - name: total
    notebook: tiny
    gather: {b: inputs}
    params: {x: 0, log: LOG}
profiles:
  small:
    a: {grid: {x: [5]}}
"""


def spec(project, text=SPEC, name="spec.yaml"):
    return write_spec(project, text.replace("LOG", str(project / "log.txt")), name)


def _stopped_output(runner: subprocess.Popen) -> tuple:
    """Return a runner's output after killing it and what it started: a runner waiting on its kernel never ends."""
    import psutil

    try:
        for p in psutil.Process(runner.pid).children(recursive=True):
            p.kill()
    except psutil.NoSuchProcess:
        pass
    runner.kill()
    return runner.communicate(timeout=60)


# A notebook whose kernel saves on SIGINT or SIGTERM as a training does: 4 s (a training finishes its step
# first), then saved.txt in its working folder; a second signal meanwhile stops it unsaved. After SIGTERM it
# exits; after SIGINT the cell ends with KeyboardInterrupt. listening.txt says the handlers are installed.
SAVES_ON_SIGNAL = textwrap.dedent("""\
    import json, os, signal, time
    saving = []
    def _save(signum, frame):
        if saving:
            os._exit(1)  # asked twice: stop now, unsaved
        saving.append(signum)
        time.sleep(4)
        open("saved.txt", "w").write("saved")
        if signum == signal.SIGTERM:
            os._exit(143)
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, _save)
    signal.signal(signal.SIGTERM, _save)
    open("listening.txt", "w").write("")
    time.sleep(600)""")


def _project_whose_kernels_save(project: Path) -> tuple[Path, list]:
    """Return (spec, runs) of a one-step pipeline of three runs whose kernels save on a signal (SAVES_ON_SIGNAL)."""
    write_notebook(project / "notebooks" / "waits.ipynb", BODY.replace("import json, os, time", SAVES_ON_SIGNAL))
    s = spec(project, "name: one\nsteps:\n  - {name: a, notebook: waits, grid: {x: [1, 2, 3]}}\n")
    return s, pipeline.expand(pipeline.load_spec(s), project / "runs")


def executions(project) -> int:
    p = project / "log.txt"
    return len(p.read_text().splitlines()) if p.exists() else 0


def value(run_dir) -> float:
    return json.loads((Path(run_dir) / "out.json").read_text())["value"]


@pytest.mark.slow
def test_run_chains_steps_and_rerun_skips_everything(project):
    s = spec(project)
    runs = project / "runs"
    result = pipeline.run(s, runs_dir=runs, log=None)
    assert result.ok and len(result.records) == 7
    assert executions(project) == 7
    # total = sum over x of (x*1 [a] ... b = 0*10 + a's value): b's value is x (from a) + its own x (1) * 10
    total = pipeline.find_runs("demo", "total", runs)
    assert len(total) == 1
    assert value(total[0]) == sum(x + 10.0 for x in (1, 2, 3))
    rec = json.loads((total[0] / "run.json").read_text())
    assert rec["status"] == "done" and len(rec["upstream"]) == 3
    assert (total[0] / "notebook.ipynb").exists()
    assert (total[0] / "kernel.log").exists()  # the kernel's stderr stays with its run

    again = pipeline.run(s, runs_dir=runs, log=None)
    assert again.ok and again.count("done", skipped=True) == 7
    assert executions(project) == 7  # nothing executed


@pytest.mark.slow
def test_changed_parameter_or_notebook_reruns_only_what_changed(project):
    s = spec(project)
    runs = project / "runs"
    pipeline.run(s, runs_dir=runs, log=None)
    # one grid value changes: its a-run, the b-run fed by it and the gather step rerun (3); 2+2 stay
    s.write_text(s.read_text().replace("grid: {x: [1, 2, 3]}", "grid: {x: [1, 2, 4]}"))
    r = pipeline.run(s, runs_dir=runs, log=None)
    assert r.count("done", skipped=False) == 3 and r.count("done", skipped=True) == 4
    assert executions(project) == 10
    assert value(pipeline.find_runs("demo", "total", runs)[-1]) == sum(x + 10.0 for x in (1, 2, 4))
    # editing the notebook's code reruns every run of every step that uses it
    write_notebook(project / "notebooks" / "tiny.ipynb", BODY + "\nprint('edited')")
    r = pipeline.run(s, runs_dir=runs, log=None)
    assert r.count("done", skipped=False) == 7
    # outputs of the notebook do not enter the key: re-saving an executed copy changes nothing
    nb = nbformat.read(project / "notebooks" / "tiny.ipynb", as_version=4)
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="noise")]
    nbformat.write(nb, project / "notebooks" / "tiny.ipynb")
    assert pipeline.run(s, runs_dir=runs, log=None).count("done", skipped=True) == 7


def test_profile_overrides_grid(project):
    s = spec(project)
    jobs = pipeline.expand(pipeline.load_spec(s, "small"), project / "runs")
    assert [j.params["x"] for j in jobs if j.step == "a"] == [5]
    with pytest.raises(pipeline.PipelineError, match="profile='huge' is not defined.*small"):
        pipeline.load_spec(s, "huge")


def test_a_profile_drops_a_grid_axis_with_null_and_cases_may_not_name_a_grid_parameter(project):
    text = SPEC + "  cased:\n    a: {grid: {x: null}, cases: [{x: 7}, {x: 8, scale: 2.0}]}\n"
    jobs = pipeline.expand(pipeline.load_spec(spec(project, text), "cased"), project / "runs")
    assert [(j.params["x"], j.params.get("scale")) for j in jobs if j.step == "a"] == [(7, None), (8, 2.0)]
    # without the null, x would come from both the grid and the cases: refused, naming it, before anything runs
    for bad in (text.replace("{x: null}", "{x: [1]}"), SPEC.replace("grid: {x: [1, 2, 3]}", "grid: {x: [1, 2, 3]}\n"
                                                                    "    cases: [{x: 4}]")):
        with pytest.raises(pipeline.PipelineError, match="step 'a': x named in both cases and grid"):
            pipeline.load_spec(spec(project, bad), "cased" if "cased" in bad else None)


@pytest.mark.parametrize("change, message", [
    ("params: {sclae: 10.0, log: LOG}", "unknown parameter 'sclae'"),
    ("params: {scale: ten, log: LOG}", "scale='ten' has type str; tiny.ipynb declares scale: float"),
    ("params: {scale: 10.0, log: LOG, x: true}", "x=True has type bool; tiny.ipynb declares x: int"),
    ("params: {scale: 10.0, log: LOG, out_dir: elsewhere}", "'out_dir' is set by the runner"),
])
def test_bad_parameters_are_rejected_before_anything_runs(project, change, message):
    s = spec(project, SPEC.replace("params: {scale: 10.0, log: LOG}", change))
    with pytest.raises(pipeline.PipelineError, match=message):
        pipeline.run(s, runs_dir=project / "runs", log=None)
    assert executions(project) == 0 and not (project / "runs").exists()
    assert cli(["run", str(s), "--runs", str(project / "runs")]) == 2


@pytest.mark.parametrize("text, message", [
    ("name: x\nsteps:\n  - {name: a, notebook: tiny, colour: red}\n", "unknown key 'colour'"),
    ("name: x\nsteps:\n  - {name: a, notebook: nope}\n", "notebook='nope' not found"),
    ("name: x\nsteps:\n  - {name: a, notebook: tiny, each: {b: upstream}}\n  - {name: b, notebook: tiny}\n",
     "each names step 'b', which is not an earlier step"),
    ("name: x\nsteps:\n  - {name: a, notebook: tiny, grid: {x: []}}\n", "grid.x=\\[\\] is invalid"),
    ("name: x\nsteps: []\n", "steps=\\[\\] is invalid"),
    ("name: x\nsteps:\n  - {name: a, notebook: tiny}\nprofiles: {s: {zz: {params: {x: 1}}}}\n", None),
])
def test_malformed_specs_name_the_problem(project, text, message):
    s = write_spec(project, text)
    if message is None:  # a profile naming a step the spec lacks
        with pytest.raises(pipeline.PipelineError, match="names step 'zz'"):
            pipeline.load_spec(s, "s")
        return
    with pytest.raises(pipeline.PipelineError, match=message):
        pipeline.load_spec(s)


@pytest.mark.slow
def test_failed_run_is_recorded_others_go_on_and_exit_is_nonzero(project, capsys):
    text = SPEC.replace("grid: {x: [1, 2, 3]}", "grid: {x: [1, 2, 3]}\n    cases: [{fail: false}, {fail: true}]")
    s = spec(project, text)
    runs = project / "runs"
    assert cli(["run", str(s), "--runs", str(runs), "--jobs", "2"]) == 1
    out = capsys.readouterr().out
    assert "3 failed" in out and "RuntimeError: asked to fail" in out, out
    rows = pipeline.status(s, runs_dir=runs)
    a = [r for r in rows if r["step"] == "a"]
    assert sorted(r["state"] for r in a) == ["done"] * 3 + ["failed"] * 3
    failed = [r for r in a if r["state"] == "failed"]
    for r in failed:  # the error and the output notebook are kept
        assert "asked to fail" in r["error"]
        nb = nbformat.read(Path(r["dir"]) / "notebook.ipynb", as_version=4)
        assert any(o.get("ename") == "RuntimeError" for c in nb.cells for o in c.get("outputs", []))
    b = [r for r in rows if r["step"] == "b"]
    assert sorted(r["state"] for r in b) == ["done"] * 3 + ["pending"] * 3  # blocked runs never started
    # the gather step ran on the runs that completed
    total = pipeline.find_runs("demo", "total", runs)
    assert len(total) == 1 and value(total[0]) == sum(x + 10.0 for x in (1, 2, 3))
    report = (runs / "demo" / "report.html").read_text()
    assert report.count('class="failed"') == 3 and "asked to fail" in report
    # `clean --failed` removes exactly the failed runs
    assert cli(["clean", str(s), "--runs", str(runs), "--failed"]) == 0
    assert all(not Path(r["dir"]).exists() for r in failed)
    assert len(pipeline.find_runs("demo", "a", runs)) == 3


@pytest.mark.slow
def test_a_kernel_stuck_at_exit_after_its_last_cell_costs_seconds_not_a_minute(project):
    """ipykernel 7.4 sometimes deadlocks in its exit after the shutdown reply; jupyter_client then waited half of
    shutdown_wait_time (60 s here) before SIGTERM. A run whose cells are all done has its kernel stopped at once."""
    stuck = BODY + "\nimport atexit\natexit.register(time.sleep, 120)  # an exit that never ends by itself"
    write_notebook(project / "notebooks" / "stuck.ipynb", stuck)
    s = spec(project, "name: one\nsteps:\n  - {name: a, notebook: stuck, params: {x: 5}}\n")
    t0 = time.monotonic()
    result = pipeline.run(s, runs_dir=project / "runs", log=None, report_html=False)
    took = time.monotonic() - t0
    assert result.ok and value(pipeline.find_runs("one", "a", project / "runs")[0]) == 5
    assert took < 30, took  # a kernel start, not 60 s or 120 s


def test_interrupted_run_restarts_in_its_folder(project):
    s = spec(project, "name: one\nsteps:\n  - {name: a, notebook: tiny, params: {x: 7}}\n")
    job, = pipeline.expand(pipeline.load_spec(s), project / "runs")
    partial = job.dir.parent / f".{job.dir.name}.partial"
    partial.mkdir(parents=True)
    (partial / "checkpoint.bin").write_bytes(b"progress so far")  # what a killed run leaves behind
    assert pipeline.status(s, runs_dir=project / "runs")[0]["state"] == "partial"
    assert pipeline.run(s, runs_dir=project / "runs", log=None).ok
    assert (job.dir / "checkpoint.bin").read_bytes() == b"progress so far" and not partial.exists()
    assert value(job.dir) == 7


@pytest.mark.slow
def test_report_links_every_run_and_renders_notebooks(project):
    s = spec(project)
    runs = project / "runs"
    pipeline.run(s, runs_dir=runs, log=None)
    html = (runs / "demo" / "report.html").read_text()
    for job in pipeline.expand(pipeline.load_spec(s), runs):
        assert job.key in html
        page = job.dir / "notebook.html"
        assert page.exists() and '<script src="../../plotly.min.js">' in page.read_text()
    assert (runs / "demo" / "plotly.min.js").stat().st_size > 1_000_000


def test_each_pairs_an_upstream_run_with_the_combinations_that_agree_with_it(project):
    """A grid on both steps (the recipe's seeds): b's x = 2 follows a's x = 2 only, and a value a never had runs
    after none; a parameter b alone varies still multiplies."""
    text = SPEC.replace("    params: {scale: 10.0, log: LOG}", "    params: {scale: 10.0, log: LOG}\n"
                        "    grid: {x: [2, 3, 4], fail: [false, true]}")
    pipe = pipeline.load_spec(spec(project, text))
    jobs = {j.key: j for j in pipeline.expand(pipe, project / "runs")}
    b = [j for j in jobs.values() if j.step == "b"]
    assert sorted((j.params["x"], j.params["fail"]) for j in b) == [(2, False), (2, True), (3, False), (3, True)]
    for j in b:
        up, = j.upstream
        assert jobs[up].params["x"] == j.params["x"]


@pytest.mark.parametrize("text, key", [
    (SPEC.replace("params: {log: LOG}", "params: {log: LOG, x: 1, x: 2}"), "'x'"),
    (SPEC.replace("  small:", "  small:\n    a: {grid: {x: [6]}}\n  small:"), "'small'"),
])
def test_a_key_given_twice_in_a_spec_is_refused_naming_it(project, text, key):
    with pytest.raises(pipeline.PipelineError, match=f"the key {key} is given twice"):
        pipeline.load_spec(spec(project, text))


def test_clean_while_a_run_executes_is_refused_and_removes_nothing(project):
    """`workbench clean` beside a running pipeline (real processes): refused naming the run; the run ends done."""
    gate = project / "gate"
    write_notebook(project / "notebooks" / "waits.ipynb",
                   BODY.replace("import json, os, time", "import json, os, time\n"
                                f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.05)"))
    s = spec(project, "name: one\nsteps:\n  - {name: a, notebook: waits, params: {x: 3}}\n")
    job, = pipeline.expand(pipeline.load_spec(s), project / "runs")
    runner = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", str(s), "--runs", str(project / "runs"),
                               "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (RunLock.busy(job.dir) and RunDir(job.dir).partial.exists()):
            assert runner.poll() is None and time.monotonic() < deadline, _stopped_output(runner)
            time.sleep(0.05)
        for failed_only in ([], ["--failed"]):
            clean = subprocess.run([sys.executable, "-m", "workbench.cli", "clean", str(s), "--runs",
                                    str(project / "runs"), *failed_only], capture_output=True, text=True, timeout=120)
            assert clean.returncode == 2, clean.stderr
            assert "executing now (a/." in clean.stderr and "nothing was removed" in clean.stderr, clean.stderr
            assert RunDir(job.dir).partial.exists()
    finally:
        gate.touch()
        out, _ = runner.communicate(timeout=120)
    assert runner.returncode == 0, out
    assert value(job.dir) == 3  # the run finished in its folder, whole
    assert cli(["clean", str(s), "--runs", str(project / "runs")]) == 0 and not job.dir.exists()


@pytest.mark.parametrize("jobs, executor", [(1, "local"), pytest.param(2, "local", marks=pytest.mark.slow),
                                            pytest.param(2, "dask", marks=pytest.mark.slow)])
def test_ctrl_c_of_workbench_run_says_one_line_and_what_will_resume(project, jobs, executor):
    """SIGINT to the runner's process group (a terminal's Ctrl-C) while runs execute: one line, exit 130.

    Each kernel saves as a training does (SAVES_ON_SIGNAL). Run by the runner itself, a kernel got SIGTERM 2.5 s
    after SIGINT
    (jupyter_client's shutdown); with --jobs 2 and a third run queued, the interrupted pool workers took the
    queued run and the runner waited 10 minutes for it; a local Dask cluster's workers died at once, their
    kernels with them, unsaved, and dask printed a traceback.
    """
    s, runs = _project_whose_kernels_save(project)
    runner = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", str(s), "--runs", str(project / "runs"),
                               "--quiet", "--jobs", str(jobs), "--executor", executor],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True,
                              # as in a terminal: a suite started in the background inherits SIGINT ignored
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 180
    while sum(RunLock.busy(j.dir) and (RunDir(j.dir).partial / "listening.txt").exists() for j in runs) < jobs:
        assert runner.poll() is None and time.monotonic() < deadline, _stopped_output(runner)
        time.sleep(0.05)
    os.killpg(runner.pid, signal.SIGINT)
    try:
        out, err = runner.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the runner did not stop within 2 minutes of Ctrl-C: {_stopped_output(runner)}")
    assert runner.returncode == 130, (out, err)
    assert "Traceback" not in out + err and len(err.strip().splitlines()) == 1, err
    assert "workbench run: interrupted; 0 of 3 runs complete, 3 will resume or start" in err, err
    # the interrupted runs saved in their folders; the queued one never started
    saved = sorted((RunDir(j.dir).partial / "saved.txt").exists() for j in runs)
    assert saved == [False] * (3 - jobs) + [True] * jobs
    assert sum(RunDir(j.dir).partial.exists() for j in runs) == jobs


@pytest.mark.slow
def test_sigterm_to_workbench_run_stops_every_process_it_started(project):
    """SIGTERM to the runner alone (kill PID, a scheduler's preemption): its workers and kernels stop too, one line, 143.

    A kernel runs in a session of its own: before, the runner died and its workers went on executing,
    even starting the queued runs.
    """
    import psutil

    # Sent SIGTERM beside its worker, a kernel was ended by ipykernel's parent poller within a second (os._exit
    # as the worker died) and its checkpoint was lost.
    s, jobs = _project_whose_kernels_save(project)
    runner = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", str(s), "--runs", str(project / "runs"),
                               "--quiet", "--jobs", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    deadline = time.monotonic() + 180
    # both kernels are executing their cells, their handlers installed (a fixed sleep was too short under load)
    while sum(RunLock.busy(j.dir) and (RunDir(j.dir).partial / "listening.txt").exists() for j in jobs) < 2:
        assert runner.poll() is None and time.monotonic() < deadline, _stopped_output(runner)
        time.sleep(0.05)
    started = psutil.Process(runner.pid).children(recursive=True)
    assert sum("ipykernel" in " ".join(p.cmdline()) for p in started) == 2
    runner.send_signal(signal.SIGTERM)
    out, err = runner.communicate(timeout=120)
    assert runner.returncode == 143, (out, err)
    assert "Traceback" not in out + err and len(err.strip().splitlines()) == 1, err
    assert "workbench run: terminated; 0 of 3 runs complete, 3 will resume or start" in err, err
    gone, alive = psutil.wait_procs(started, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    # the two runs cut short wait in their folders to restart; the queued third was never taken
    assert sorted(RunDir(j.dir).partial.exists() for j in jobs) == [False, True, True]
    assert not any(j.dir.exists() for j in jobs) and executions(project) == 0
    assert sorted((RunDir(j.dir).partial / "saved.txt").exists() for j in jobs) == [False, True, True]


@pytest.mark.parametrize("args, message", [
    (["--runs", "{file}"], "runs_dir='{file}' is invalid: it is a file"),
    (["--executor", "dask", "--scheduler", "not an address"], "scheduler='not an address': cannot connect"),
])
def test_a_bad_runs_folder_or_scheduler_is_one_line_before_anything_runs(project, capsys, args, message):
    import dask

    file = project / "a-file"
    file.write_text("")
    s = spec(project)
    args = [a.replace("{file}", str(file)) for a in args]
    before = dask.config.get("scheduler", None)
    assert cli(["run", str(s), *args]) == 2
    err = capsys.readouterr().err
    assert message.replace("{file}", str(file)) in err and len(err.strip().splitlines()) == 1, err
    assert executions(project) == 0
    # the failed client is not left as dask's scheduler for this process (a later test's xarray tried to reach it)
    assert dask.config.get("scheduler", None) == before


@pytest.mark.slow
def test_two_pipelines_at_once_do_not_clobber(project):
    """Two different pipelines and the same pipeline twice, all at once in separate processes."""
    s1 = spec(project, SPEC, "one.yaml")
    s2 = spec(project, SPEC.replace("name: demo", "name: other").replace("x: [1, 2, 3]", "x: [4, 5]"), "two.yaml")
    runs = project / "runs"
    cmd = [sys.executable, "-m", "workbench.cli", "run", "--runs", str(runs)]
    procs = [subprocess.Popen(cmd + [str(s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for s in (s1, s2, s1)]
    outs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    # demo's 7 runs executed once although two runners raced over them; other's 5 once
    assert executions(project) == 7 + 5
    assert value(pipeline.find_runs("demo", "total", runs)[0]) == sum(x + 10.0 for x in (1, 2, 3))
    assert value(pipeline.find_runs("other", "total", runs)[0]) == sum(x + 10.0 for x in (4, 5))
    assert not list(runs.glob("*/*/.*.partial"))


@pytest.mark.slow
def test_dask_executor_on_a_local_cluster(project):
    distributed = pytest.importorskip("distributed")
    s = spec(project)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        result = pipeline.run(s, runs_dir=project / "runs", executor="dask", scheduler=c.scheduler_address, log=None)
    assert result.ok and executions(project) == 7
    pids = {line.split()[1] for line in (project / "log.txt").read_text().splitlines()}
    assert str(os.getpid()) not in pids  # the Dask workers launched the kernels, not this process
    assert value(pipeline.find_runs("demo", "total", project / "runs")[0]) == sum(x + 10.0 for x in (1, 2, 3))


THREADS_BODY = textwrap.dedent("""\
    import json, os, signal, time
    from pathlib import Path
    import torch
    if fail:  # here: kill the Dask worker that launched this kernel, in the middle of the run
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)
    Path(out_dir, "out.json").write_text(json.dumps({"value": x, "threads": torch.get_num_threads()}))""")


@pytest.mark.slow
def test_dask_without_scheduler_splits_the_cores_and_a_dying_worker_fails_only_its_run(project):
    """No scheduler: a LocalCluster of --jobs 2 workers; each kernel's torch sees its worker's share of the cores
    (1 on 2 cores), and the run whose worker is SIGKILLed mid-run is recorded failed while the others finish."""
    pytest.importorskip("distributed")
    write_notebook(project / "notebooks" / "threads.ipynb", THREADS_BODY)
    s = spec(project, "name: threads\nsteps:\n  - name: a\n    notebook: threads\n"
                      "    cases: [{x: 1, fail: true}, {x: 2}, {x: 3}]\n")
    result = pipeline.run(s, runs_dir=project / "runs", executor="dask", jobs=2, log=None, report_html=False)
    assert not result.ok
    rows = {json.loads((Path(r["dir"]) / "run.json").read_text())["params"]["x"]: r
            for r in pipeline.status(s, runs_dir=project / "runs")}
    assert rows[1]["state"] == "failed" and "Dask worker executing this run died" in rows[1]["error"]
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    for x in (2, 3):
        assert rows[x]["state"] == "done", rows[x]
        assert json.loads((Path(rows[x]["dir"]) / "out.json").read_text()) == {"value": x, "threads": share}


@pytest.mark.slow
def test_local_threads_fix_every_kernels_torch_threads_and_leave_the_callers_environment(project, monkeypatch, capsys):
    """--threads 1: each kernel's torch runs 1 thread, whether runs execute in pool processes (--jobs 2) or,
    one at a time, in this process, whose own OMP_NUM_THREADS (all the cores here, what a lone run would
    otherwise inherit) is back afterwards. Bad values are refused before anything runs."""
    write_notebook(project / "notebooks" / "threads.ipynb", THREADS_BODY)
    n, cores = 1, str(pipeline.machine_cores())
    monkeypatch.setenv("OMP_NUM_THREADS", cores)
    for name, cases, jobs in (("pool", "[{x: 1}, {x: 2}, {x: 3}]", 2), ("alone", "[{x: 4}]", 1)):
        s = spec(project, f"name: {name}\nsteps:\n  - name: a\n    notebook: threads\n    params: {{fail: false}}\n"
                          f"    cases: {cases}\n", name=f"{name}.yaml")
        result = pipeline.run(s, runs_dir=project / "runs", jobs=jobs, threads=n, log=None, report_html=False)
        assert result.ok
        for row in pipeline.status(s, runs_dir=project / "runs"):
            assert json.loads((Path(row["dir"]) / "out.json").read_text())["threads"] == n, (name, row)
        assert os.environ["OMP_NUM_THREADS"] == cores
    for bad in (-1, True, 1.5):
        with pytest.raises(pipeline.PipelineError, match=f"threads={bad!r} is invalid: must be an integer >= 1, or 0"):
            pipeline.LocalExecutor(2, bad)
    from workbench.cli import main
    assert main(["run", str(spec(project)), "--runs", str(project / "fresh"), "--threads", "-1", "--quiet"]) == 2
    assert "threads=-1 is invalid" in capsys.readouterr().err and not (project / "fresh").exists()


# ---- the library's code in the key ----------------------------------------------------------------------
CHAIN = """\
name: chain
steps:
  - {name: a, notebook: tiny, params: {x: 7}}
  - {name: b, notebook: tiny, each: {a: upstream}}
  - {name: total, notebook: tiny, gather: {b: inputs}}
"""


@pytest.fixture
def library_copy(tmp_path, monkeypatch):
    """A copy of the workbench package's source that the runner digests instead of the real one."""
    import shutil

    copy = tmp_path / "lib" / "workbench"
    shutil.copytree(pipeline.LIBRARY, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    monkeypatch.setattr(pipeline.keys, "LIBRARY", copy)
    return copy


def edit(copy: Path, rel: str) -> None:
    """Append a comment to one file of the copy and forget the digest computed so far."""
    f = copy / rel
    f.write_text(f.read_text() + "\n# an edit\n")
    pipeline._source_digest.cache_clear()


def test_library_digest_reads_every_py_file_by_relative_path(tmp_path):
    a, b = tmp_path / "a" / "pkg", tmp_path / "b" / "pkg"
    for root in (a, b):
        (root / "sub").mkdir(parents=True)
        (root / "x.py").write_text("X = 1\n")
        (root / "sub" / "y.py").write_text("Y = 2\n")
        (root / "notes.txt").write_text("not code")
    assert pipeline.library_digest(a) == pipeline.library_digest(b)  # the location does not count
    (b / "notes.txt").write_text("still not code")
    pipeline._source_digest.cache_clear()
    assert pipeline.library_digest(a) == pipeline.library_digest(b)
    (b / "sub" / "y.py").write_text("Y = 3\n")
    assert pipeline.library_digest(a) == pipeline.library_digest(b)  # computed once per process...
    pipeline._source_digest.cache_clear()
    assert pipeline.library_digest(a) != pipeline.library_digest(b)  # ...and the content counts
    (b / "sub" / "y.py").write_text("Y = 2\n")
    (b / "sub" / "y.py").rename(b / "sub" / "z.py")  # same content under another name
    pipeline._source_digest.cache_clear()
    assert pipeline.library_digest(a) != pipeline.library_digest(b)


@pytest.mark.parametrize("rel", ["config.py", "models/conditioning.py", "pipeline/keys.py"])
def test_editing_the_library_changes_the_key_of_every_step(project, library_copy, rel):
    s = spec(project, CHAIN)
    pipe = pipeline.load_spec(s)
    before = pipeline.expand(pipe, project / "runs")
    real = Path(pipeline.__file__).parent.parent  # the workbench package (pipeline is a package in it)
    assert pipeline.library_digest() == pipeline.library_digest(real)  # a faithful copy
    edit(library_copy, rel)
    after = pipeline.expand(pipe, project / "runs")
    assert [j.step for j in before] == [j.step for j in after] == ["a", "b", "total"]
    for old, new in zip(before, after):
        assert old.key != new.key, old.step
        assert new.library == pipeline.library_digest() != old.library
    assert {j.key for j in pipeline.expand(pipe, project / "runs")} == {j.key for j in after}  # stable otherwise


@pytest.mark.slow
def test_status_marks_runs_of_older_library_code_stale(project, library_copy, capsys):
    s = spec(project, CHAIN)
    runs = project / "runs"
    assert pipeline.run(s, runs_dir=runs, log=None, report_html=False).ok
    old = {r["key"]: r for r in pipeline.status(s, runs_dir=runs)}
    assert [r["state"] for r in old.values()] == ["done"] * 3
    for r in old.values():
        assert json.loads((Path(r["dir"]) / "run.json").read_text())["library"] == pipeline.library_digest()
    assert cli(["status", str(s), "--runs", str(runs)]) == 0
    edit(library_copy, "evals.py")
    rows = pipeline.status(s, runs_dir=runs)
    assert sorted(r["state"] for r in rows) == ["pending"] * 3 + ["stale"] * 3
    assert {r["key"] for r in rows if r["state"] == "stale"} == set(old)
    assert {r["step"] for r in rows if r["state"] == "stale"} == {"a", "b", "total"}
    capsys.readouterr()
    assert cli(["status", str(s), "--runs", str(runs)]) == 1
    out = capsys.readouterr().out
    assert "3 pending, 3 stale" in out and out.count("stale") >= 4
    # running again executes every step with the new code; the old folders stay, still stale
    assert pipeline.run(s, runs_dir=runs, log=None, report_html=False).count("done", skipped=False) == 3
    rows = pipeline.status(s, runs_dir=runs)
    assert sorted(r["state"] for r in rows) == ["done"] * 3 + ["stale"] * 3
    assert cli(["status", str(s), "--runs", str(runs)]) == 0
    # a run made by this code for other parameters is not stale, only not part of this spec
    s.write_text(s.read_text().replace("x: 7", "x: 8"))
    assert [r["state"] for r in pipeline.status(s, runs_dir=runs)].count("stale") == 3


# ---- a re-run of a finished pipeline only reports -----------------------------------------------------------
ODD_PARAMS = textwrap.dedent("""\
    # a comment line, then lines papermill parses in its own ways
    a = 1
    b: int = 2  # help: with a colon
    c: "float" = 3.0
    d = {"k": 1,  # first key
         "j": 2}  # the mapping
    e: list[int] = [1, 2]  # numbers
    f = g = 3
    h = 'x'  # type: str  the help
    i: dict = dict(a=1)
    out_dir: str = "."  # the run folder""")


def _odd_notebooks(tmp: Path) -> list[Path]:
    """Return notebooks whose parameters cells exercise papermill's parsing: odd lines, none, another language."""
    odd = write_notebook(tmp / "odd.ipynb", params=ODD_PARAMS)
    none = write_notebook(tmp / "none.ipynb")
    nb = nbformat.read(none, as_version=4)
    nb.cells[0].metadata["tags"] = []
    nbformat.write(nb, none)
    r = write_notebook(tmp / "r.ipynb", params="x <- 1  # not Python")
    nb = nbformat.read(r, as_version=4)
    nb.metadata["kernelspec"] = {"name": "ir", "display_name": "R", "language": "R"}
    nbformat.write(nb, r)
    return [odd, none, r]


def test_declared_parameters_read_as_papermill_reads_them_without_importing_it(tmp_path):
    import papermill

    shipped = sorted((Path(pipeline.NOTEBOOKS_DIR)).glob("*.ipynb"))
    assert len(shipped) >= 5
    for path in shipped + _odd_notebooks(tmp_path) + [write_notebook(tmp_path / "tiny.ipynb")]:
        assert pipeline.declared_parameters(path) == papermill.inspect_notebook(str(path)), path.name
    assert set(pipeline.declared_parameters(tmp_path / "odd.ipynb")) == {"a", "b", "c", "d", "e", "h", "out_dir"}
    # a fresh interpreter reads a Python notebook's parameters without papermill (seconds of imports)
    code = ("import sys; from workbench import pipeline; "
            f"d = pipeline.declared_parameters({str(shipped[0])!r}); "
            "print(bool(d), 'papermill' in sys.modules, 'jsonschema' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "False"]


RESULTS_BODY = BODY + textwrap.dedent("""
    import xarray as xr
    from workbench.io import save_results
    ds = xr.Dataset({"loss": ("loop", [3.0, 2.0 - 0.1 * x, 2.5])}, coords={"loop": [1, 2, 3]})
    ds["best_r"] = ((), int(ds.loss.idxmin()), {"long_name": "best loop count r", "units": "1"})
    save_results(ds, out_dir, headline=["best_r"])""")
HEAVY = ("torch", "papermill", "nbconvert", "nbformat", "jsonschema", "xarray", "workbench.experiments")


@pytest.mark.slow
def test_rerun_of_a_finished_pipeline_checks_renders_and_reads_nothing_again(project, monkeypatch):
    """A re-run of a finished pipeline (in a fresh interpreter, as `workbench run`) reports without importing the
    notebooks' library checks (torch), papermill, nbconvert or xarray; unchanged notebook.html files stay as
    they are, and one whose notebook.ipynb changed is rendered again. Checks still run for runs that will run."""
    nb_path = write_notebook(project / "notebooks" / "tiny.ipynb", RESULTS_BODY)
    nb = nbformat.read(nb_path, as_version=4)
    nb.metadata["workbench"] = {"check": "workbench.experiments:check_train_notebook"}  # imports torch
    nbformat.write(nb, nb_path)
    s = spec(project, "name: fin\nsteps:\n  - {name: a, notebook: tiny, grid: {x: [1, 2]}}\n")
    runs = project / "runs"
    checked = []

    def check(params):  # stands in for the torch-importing check (which would reject these parameters)
        checked.append(params["x"])
        if params["x"] == 9:
            raise ValueError("x=9 is invalid: the check says no")

    monkeypatch.setattr(pipeline.spec, "_declared_check", lambda notebook: check)
    assert pipeline.run(s, runs_dir=runs, log=None).ok and sorted(checked) == [1, 2]
    pages = {j.key: j.dir / "notebook.html" for j in pipeline.expand(pipeline.load_spec(s), runs)}
    before = {k: (p.read_bytes(), p.stat().st_mtime_ns) for k, p in pages.items()}
    first_report = (runs / "fin" / "report.html").read_text()
    assert first_report.count('data-key="best_r"') == 2

    # the real runner in a fresh interpreter; the digest this process keyed with, so an edit of the library
    # made meanwhile (by someone else) does not turn the re-run into a run
    code = textwrap.dedent(f"""\
        import json, sys
        from workbench import pipeline
        pipeline.keys._source_digest = lambda root: {pipeline.library_digest()!r}
        from workbench.cli import main
        rc = main(["run", {str(s)!r}, "--runs", {str(runs)!r}, "--quiet"])
        print(json.dumps([rc, [m for m in {HEAVY!r} if m in sys.modules]]))""")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=project)
    assert out.returncode == 0, out.stderr
    assert "0 ran, 2 already complete" in out.stdout
    assert json.loads(out.stdout.splitlines()[-1]) == [0, []]
    assert {k: (p.read_bytes(), p.stat().st_mtime_ns) for k, p in pages.items()} == before
    strip = lambda t: t[:t.index(" · written")] + t[t.index("</p>", t.index(" · written")):]  # noqa: E731
    assert strip((runs / "fin" / "report.html").read_text()) == strip(first_report)  # cached numbers, same page

    # a changed executed notebook is rendered again; the other page stays
    changed, kept = sorted(pages)
    run_nb = nbformat.read(pages[changed].with_name("notebook.ipynb"), as_version=4)
    run_nb.cells.append(nbformat.v4.new_markdown_cell("an added note"))
    nbformat.write(run_nb, pages[changed].with_name("notebook.ipynb"))
    pipeline.report(s, runs_dir=runs)
    assert "an added note" in pages[changed].read_text()
    assert (pages[kept].read_bytes(), pages[kept].stat().st_mtime_ns) == before[kept]

    # checks skip only completed runs: a new value is checked (and rejected) before anything runs
    checked.clear()
    s.write_text(s.read_text().replace("x: [1, 2]", "x: [1, 2, 9]"))
    with pytest.raises(pipeline.PipelineError, match="x=9 is invalid: the check says no"):
        pipeline.run(s, runs_dir=runs, log=None)
    assert checked == [9] and len(pipeline.find_runs("fin", "a", runs)) == 2


# ---- the report's numbers: what a run's results.nc names as its headline -----------------------------------------
def _saved(ds, head, tmp_path, name):
    """Return the Dataset read back from results.nc after io.save_results named head's variables its headline."""
    import xarray as xr

    from workbench.io import save_results

    out = tmp_path / name
    save_results(ds.assign(head.data_vars), out, headline=list(head))
    return xr.load_dataset(out / "results.nc", engine="h5netcdf")


def test_headlines_are_the_numbers_each_results_file_names(tmp_path):
    import numpy as np
    import xarray as xr

    from workbench.evals import (geometry_headline, law_headline, loss_fit_headline, loss_headline,
                                 lost_gradient_headline)

    def by_key(ds):
        return {h.key: h.value for h in pipeline.headlines(ds)}

    # a loop sweep: the best r and the loss there and at K, then the test-time fit on loops 1..4
    loops = np.arange(1, 7)
    s = xr.Dataset({"loss": ("loop", [3.1, 2.6, 2.4, 2.45, np.nan, 2.7])}, coords={"loop": loops},
                   attrs={"training_loops": 3})
    head = xr.merge([loss_headline(s.loss, 3), loss_fit_headline({"L_inf": 2.3, "Z": 1.9, "z": 0.8}, 4)])
    s = _saved(s, head, tmp_path, "sweep")
    got = by_key(s)
    i = int(np.nanargmin(s.loss.values))
    assert got["best_r"] == s.loop.values[i] and got["loss_at_best"] == s.loss.values[i]
    assert got["loss_at_K"] == s.loss.values[list(s.loop.values).index(3)]
    assert got["test_time_L_inf"] == float(s.test_time_L_inf) and got["test_time_z"] == float(s.test_time_z)
    assert got["test_time_fit_upto"] == 4
    heads = pipeline.headlines(s)
    assert [h.key for h in heads][:3] == ["best_r", "loss_at_best", "loss_at_K"]  # in the order the file names
    assert any("fitted on loops 1 to" in h.label and h.text == "4" for h in heads)
    assert {h.key: h.text for h in heads}["loss_at_best"] == "2.400 nats/token"
    # lost gradient: lost(1), rho and r
    lost = xr.Dataset({"lost": ("k", [0.61, 0.3, 0.0])}, coords={"k": [1, 2, 3]}, attrs={"rho": 0.42, "loops": 3})
    lost = _saved(lost, lost_gradient_headline(lost), tmp_path, "lost")
    got = by_key(lost)
    assert got["lost_1"] == float(lost.lost.values[0]) and got["rho"] == lost.attrs["rho"]
    assert got["loops"] == lost.attrs["loops"]
    # geometry with interaction: the terminal-to-core ratio and the angle at the first and last loop
    g = xr.Dataset({"angular_distance": ("loop", [0.3, 0.2, 0.1], {"units": "pi rad"}),
                    "terminal_to_core": ((), 1.7)}, coords={"loop": [1, 2, 3]})
    g = _saved(g, geometry_headline(g), tmp_path, "geometry")
    got = by_key(g)
    assert got["terminal_to_core"] == float(g.terminal_to_core)
    assert got["angle_first"] == float(g.angular_distance.values[0])
    assert got["angle_last"] == float(g.angular_distance.values[-1])
    # a law fit: phi per group with its interval, in the text
    fit = xr.Dataset({"estimate": (("group", "param"), [[0.46, 2.0], [0.38, 2.1]]),
                      "low": (("group", "param"), [[0.40, 1.9], [0.30, 2.0]]),
                      "high": (("group", "param"), [[0.52, 2.1], [0.45, 2.2]])},
                     coords={"group": ["full", "truncated"], "param": ["phi", "E"]})
    heads = {h.key: h for h in pipeline.headlines(_saved(fit, law_headline(fit), tmp_path, "fit"))}
    assert set(heads) == {"phi_full", "phi_truncated"} and heads["phi_truncated"].value == 0.38
    assert "0.300 to 0.450" in heads["phi_truncated"].text and heads["phi_truncated"].label == "φ (truncated)"


def test_load_results_gives_each_caller_its_own_copy_and_rereads_a_rewritten_file(tmp_path):
    """The findings readers' cached read of results.nc: xarray's own load, one copy per caller, never stale."""
    import xarray as xr

    from workbench.experiments.run_results import load_results
    from workbench.io import save_results

    ds = xr.Dataset({"loss": ("loop", [3.0, 2.5])}, coords={"loop": [1, 2]}, attrs={"note": "a"})
    save_results(ds, tmp_path)
    a = load_results(tmp_path)
    xr.testing.assert_identical(a, xr.load_dataset(RunDir(tmp_path).results, engine="h5netcdf"))
    a.loss[0] = 99.0
    a.attrs["note"] = "changed"
    b = load_results(tmp_path)  # from the cache: the first caller's changes stayed its own
    assert float(b.loss[0]) == 3.0 and b.attrs["note"] == "a"
    save_results(ds.assign(loss=ds.loss * 2), tmp_path)  # the same size, written anew (atomically: a new file)
    assert float(load_results(tmp_path).loss[0]) == 6.0
    with pytest.raises(FileNotFoundError, match="results.nc"):
        load_results(tmp_path / "missing")


def test_a_results_file_naming_no_headline_shows_the_loss_numbers_if_it_has_them():
    """Older runs (and train runs until train_run names its headline): loss over loop gives evals.loss_headline's
    numbers; anything else shows none, and so does a file that names an empty headline."""
    import numpy as np
    import xarray as xr

    s = xr.Dataset({"loss": ("loop", [3.0, 2.2, 2.5])}, coords={"loop": [1, 2, 4]}, attrs={"training_loops": 4})
    assert {h.key: h.value for h in pipeline.headlines(s)} == {"best_r": 2, "loss_at_best": 2.2, "loss_at_K": 2.5}
    assert pipeline.headlines(s.assign_attrs(headline="")) == []
    assert pipeline.headlines(xr.Dataset({"x": ("k", np.ones(2))})) == []


def test_report_escapes_what_the_spec_and_runs_say(project):
    """The report is a template with autoescape: a description or parameter holding markup shows as text."""
    s = spec(project, 'name: esc\ndescription: "<b>bold</b> & co"\nsteps:\n'
                      '  - {name: a, notebook: tiny, params: {log: "</script><i>x"}}\n')
    page = pipeline.report(s, runs_dir=project / "runs").read_text()
    assert "<b>bold</b>" not in page and "&lt;b&gt;bold&lt;/b&gt; &amp; co" in page
    assert "<i>x" not in page and 'class="run pending"' in page
    assert page.startswith("<!DOCTYPE html>")
