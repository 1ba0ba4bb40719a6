"""Pipeline runner costs, measured side by side in one process.

1. Re-running a completed 12-run pipeline (target < 3 s): the `workbench run` command in a fresh
   interpreter (what a person types), and `pipeline.run` in this process, against the first run.
2. Overhead per notebook run: the `geometry` and `lost_gradient` notebooks run by the pipeline
   runner (papermill: kernel start, imports, the work, saving the notebook and its HTML) against
   calling the same library functions directly in this process on the same checkpoint.

Usage: python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workbench import pipeline  # noqa: E402


def tiny_project(tmp: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell('x: int = 1  # a number\nout_dir: str = "."  # the run folder')
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell, nbformat.v4.new_code_cell('open(out_dir + "/out.txt", "w").write(str(x * x))')]
    (tmp / "notebooks").mkdir(parents=True)
    nbformat.write(nb, tmp / "notebooks" / "square.ipynb")
    spec = tmp / "pipelines" / "twelve.yaml"
    spec.parent.mkdir()
    spec.write_text(textwrap.dedent("""\
        name: twelve
        steps:
          - {name: small, notebook: square, grid: {x: [1, 2, 3, 4, 5, 6]}}
          - {name: large, notebook: square, grid: {x: [7, 8, 9, 10, 11, 12]}}
        """))
    return spec


def bench_rerun() -> None:
    with tempfile.TemporaryDirectory() as d:
        spec = tiny_project(Path(d))
        runs = Path(d) / "runs"
        t0 = time.perf_counter()
        first = pipeline.run(spec, jobs=2, runs_dir=runs, log=None)
        t_first = time.perf_counter() - t0
        assert first.ok and len(first.records) == 12
        t0 = time.perf_counter()
        again = pipeline.run(spec, runs_dir=runs, log=None)
        t_inproc = time.perf_counter() - t0
        assert again.count("done", skipped=True) == 12
        cmd = [str(Path(sys.executable).parent / "workbench"), "run", str(spec), "--runs", str(runs)]
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            times.append(time.perf_counter() - t0)
        assert "12 already complete" in out, out
        print("1. re-run of a completed 12-run pipeline (target < 3 s)")
        print(f"   first run (2 jobs):                   {t_first:7.2f} s")
        print(f"   re-run, pipeline.run in process:      {t_inproc:7.3f} s")
        print(f"   re-run, `workbench run` command:      {min(times):7.3f} s (best of 3; "
              f"{', '.join(f'{t:.2f}' for t in times)})")


def bench_overhead() -> None:
    import torch

    from workbench.experiments import load_run, train_run
    from workbench.io import save_netcdf
    from workbench.probes import geometry, interaction, lost_gradient

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        train_run(d / "ckpt", dict(d_model=64, n_heads=4, n_kv_heads=2, prelude=1, core=2, coda=1, loops=4,
                                   max_seq_len=512), dict(steps=20, batch_size=8, seq_len=128), vocab_size=2048)
        spec = d / "probe.yaml"
        spec.write_text(textwrap.dedent(f"""\
            name: probe
            steps:
              - {{name: geometry, notebook: {ROOT}/notebooks/geometry.ipynb, params: {{checkpoint: {d / 'ckpt'}}}}}
              - {{name: lost_gradient, notebook: {ROOT}/notebooks/lost_gradient.ipynb,
                  params: {{checkpoint: {d / 'ckpt'}}}}}
            """))
        t0 = time.perf_counter()
        res = pipeline.run(spec, runs_dir=d / "runs", log=None)
        t_pipe = time.perf_counter() - t0
        assert res.ok, res.summary()
        work = {r["step"]: r["seconds"] for r in res.records}

        def direct():
            run = load_run(d / "ckpt")
            K = run.model.cfg.loops
            tokens = run.val_tokens(8, 128)[:, :-1]
            save_netcdf(geometry(run.model, tokens, 2 * K), d / "g.nc")
            save_netcdf(interaction(run.model, tokens, K), d / "i.nc")
            batch = run.val_tokens(8, 128)
            save_netcdf(lost_gradient(run.model, batch[:, :-1], batch[:, 1:], K), d / "l.nc")

        direct()  # warm: imports and caches, as a notebook kernel would not be
        t0 = time.perf_counter()
        direct()
        t_direct = time.perf_counter() - t0
        print("2. overhead per notebook run (geometry + lost_gradient on a 1+2x4+1 d=64 checkpoint)")
        print(f"   pipeline runner, 2 runs:              {t_pipe:7.2f} s (notebook execution "
              f"{work['geometry']:.2f} + {work['lost_gradient']:.2f} s; the rest: validation, report HTML)")
        print(f"   same library calls in process (warm): {t_direct:7.2f} s")
        print(f"   overhead per notebook run:            {(sum(work.values()) - t_direct) / 2:7.2f} s "
              f"(kernel start, imports, saving the notebook); torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    import os

    print(f"bench_pipeline: {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    bench_rerun()
    bench_overhead()
