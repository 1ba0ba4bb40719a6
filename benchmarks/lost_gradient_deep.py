"""The lost gradient from 32 to 64 loops on a model trained at depth about 32 (seeds/003's first claim), one seed.

`lost_gradient --profile deep` measures the laptop model, trained at a fixed K = 4, far past its horizon. The
paper's models were trained at many loops; this script trains the same model with the loop count drawn per step
from a Poisson log-normal of mean 32 (as Huginn-style recurrent models are) and backpropagation through the last
8 loops, then measures lost(k) at r = 8, 16, 32, 64 on 4 validation batches with no fine-tune, exactly as the
lost_gradient notebook does (`finetune_lost_gradient`). It writes the pipeline's layout, so
`workbench.experiments.lost_gradient_findings.loop_count_claims(ROOT, pipeline="lost_gradient_sampled")` reads
three seeds of it. Sized for a GPU (about 2 minutes a seed on an H200, three seeds at once); on 2 CPU cores a
seed takes hours. Run from the repository root:

    python benchmarks/lost_gradient_deep.py ROOT SEED [STEPS]
"""

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench.experiments import finetune_lost_gradient  # noqa: E402
from workbench.experiments.runs import train_notebook_args, train_run  # noqa: E402
from workbench.io import save_results  # noqa: E402
from workbench.pipeline.spec import notebook_defaults  # noqa: E402

PIPELINE = "lost_gradient_sampled"
LOOP_COUNTS = [8, 16, 32, 64]

root, seed = Path(sys.argv[1]), int(sys.argv[2])
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 800
# the lost_gradient pipeline's train step (pipelines/lost_gradient.yaml), trained at depth ~32 with k = 8
params = dict(notebook_defaults("train"), d_model=128, prelude=1, core=2, coda=1, inject="channel", steps=steps,
              vocab_size=2048, seq_len=128, batch_size=16, bf16="auto", compile="off", loops=32,
              loop_sampler="poisson_lognormal", backward_loops=8, eval_loops=[8, 32, 64], data_seed=0, seed=seed)
lg_params = {"loop_counts": LOOP_COUNTS, "finetune_steps": 0, "n_batches": 4, "n_sequences": 8, "seq_len": 128}


def record(path: Path, p: dict, started: str, seconds: float) -> None:
    """Write the pipeline runner's run.json for a done run (what find_runs and the findings read)."""
    (path / "run.json").write_text(json.dumps({
        "pipeline": PIPELINE, "step": path.parent.name, "key": path.name, "status": "done", "error": None,
        "params": p, "started": started, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3)}, indent=1))


t0, started = time.time(), datetime.now(timezone.utc).isoformat(timespec="seconds")
train_dir = root / PIPELINE / "train" / f"seed{seed}"
run, ds = train_run(train_dir, **train_notebook_args(**params), resume=False, overwrite=True)
record(train_dir, params, started, time.time() - t0)
print(f"seed {seed}: trained in {time.time() - t0:.0f} s, final loss {float(ds.final_loss):.3f}, "
      f"precision {ds.attrs.get('precision')}", flush=True)

t1, started = time.time(), datetime.now(timezone.utc).isoformat(timespec="seconds")
lg = finetune_lost_gradient(run, LOOP_COUNTS, steps=0, n_batches=4, n_sequences=8, seq_len=128, seed=0)
lg_dir = root / PIPELINE / "lost_gradient" / f"seed{seed}"
lg_dir.mkdir(parents=True, exist_ok=True)
save_results(lg, lg_dir)
record(lg_dir, {**lg_params, "checkpoint": str(train_dir)}, started, time.time() - t1)
print(f"seed {seed}: lost gradient in {time.time() - t1:.0f} s; lost(k) at r = 32 / 64, mean over batches:",
      {k: [round(float(lg.lost.isel(step=0).sel(loops=r, k=k).mean("batch")), 4) for r in (32, 64)] for k in (1, 2, 4)},
      flush=True)
