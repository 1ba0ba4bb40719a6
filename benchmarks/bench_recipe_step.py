"""Seconds per training step of the retrofit recipe on SmolLM2-135M: what sizes the laptop profile's phases.

Per-loop supervision of the iterated task under the adapter budget (rank 16), fp32, for a few splits and
batch sizes; each is trained for 2 and then 6 more steps, and the difference of the two timings over 4 is
the per-step time (set-up and the first steps' allocations excluded). Run from the repository root:

    python benchmarks/bench_recipe_step.py [threads]

Results in docs/benchmarks.md ("The recipe in phases ...").
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from workbench.experiments.retrofit import load_smollm2, task_examples, train_retrofit  # noqa: E402
from workbench.models.precision import cpu_flags  # noqa: E402
from workbench.models.retrofit import retrofit  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
print(f"threads {torch.get_num_threads()}, CPU flags {sorted(cpu_flags()) or 'none'}", flush=True)
t = time.time()
llama, tok = load_smollm2()
print(f"load {time.time() - t:.1f} s", flush=True)
for split, K, bs in (((10, 10, 10), 4, 8), ((13, 4, 13), 6, 8), ((10, 10, 10), 4, 16)):
    model = retrofit(llama, *split, budget="adapter", loops=K, adapter_rank=16, seed=0)
    ex = task_examples(200, list(range(2, K + 1)), 0)
    took = []
    for steps in (2, 6):
        t = time.time()
        train_retrofit(model, tok, ex, steps, batch_size=bs, progress=False, warmup=1, bf16="off", compile="off")
        took.append(time.time() - t)
    print(f"{'+'.join(map(str, split))} K={K} batch {bs}: {(took[1] - took[0]) / 4:.1f} s a step", flush=True)
