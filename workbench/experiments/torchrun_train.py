"""`python -m workbench.experiments.torchrun_train ARGS.json`: train_run(**ARGS) in each torchrun process.

What `train_run(..., nproc=N)` starts under `torchrun --nproc_per_node N`; every process calls
train_run alike (rank 0 writes the run folder) and leaves the process group before exiting.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Return 0 after train_run with the keyword arguments in the JSON file named by the one argument."""
    import torch.distributed as dist

    from .runs import train_run

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m workbench.experiments.torchrun_train ARGS.json (train_run's keywords)")
    kwargs = json.loads(Path(args[0]).read_text())
    try:
        train_run(**kwargs)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
