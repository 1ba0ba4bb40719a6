"""Conditioning learnability probe: does a plain loop learn recall and iterated addition (issue 20)?

Trains one run of the conditioning setup with train_run and prints group accuracy per loop (trained depths)
and iterated accuracy per depth and loop (depths 5-8 are past the trained 1-4). Run from the repository root:

    python benchmarks/conditioning_probe.py A '{}'                       # the baseline, d_model 128
    python benchmarks/conditioning_probe.py W '{"d_model": 256, "n_heads": 8, "n_kv_heads": 4}'

On an H200 each took about 200 s (docs/findings/conditioning_probe_h200.txt); on 2 CPU cores ~17 minutes.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench.experiments.runs import train_notebook_args, train_run  # noqa: E402
from workbench.pipeline.spec import notebook_defaults  # noqa: E402

name, over = sys.argv[1], json.loads(sys.argv[2])
params = dict(notebook_defaults("train"),  # the train notebook's defaults, as the probe ran (lr 0.01, d = 128)
              tasks=["recall", "iterated"], task_ratio=0.7, vocab_size=1024, steps=4000, seq_len=128, batch_size=16,
              eval_loops=[1, 2, 4, 8], inject="none",
              task_options={"recall": {"n_entities": 20}, "iterated": {"rule": "add"}})
params.update(over)
kw = train_notebook_args(**params)
t0 = time.time()
run, ds = train_run(f"runs/conditioning_probe/{name}", **kw, resume=False, overwrite=True)
print(name, over, f"wall {time.time()-t0:.0f}s final_loss {float(ds.final_loss):.3f}", flush=True)
print(name, "group_accuracy (trained depths)\n", ds.group_accuracy.to_pandas().round(3), flush=True)
print(name, "iterated by depth\n", ds.task_accuracy.sel(task="iterated").to_pandas().round(2), flush=True)
