"""Models for the loop explorer: the newest quickstart run, a run folder, or a tiny model trained here.

The explorer (`workbench.viz.explorer`) only draws; finding or training the model it shows happens
here, so the viz room never trains or loads runs.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import check_int
from ..data.corpus import ByteTokenizer
from ..io import find_run, find_runs, open_run
from ..models.looped import LoopLM
from .runs import demo_trainer


def tiny_model(steps: int = 120, seed: int = 0, progress: bool = True) -> tuple[LoopLM, ByteTokenizer]:
    """Return (model, ByteTokenizer) after training the `workbench demo` model (byte-level 1+2x4+1, d=128).

    About 0.4 s a step on two CPU cores, so the default 120 steps take under a minute; it already
    predicts common bytes of Python source and shows the loop-count behaviour the explorer is for.
    """
    trainer = demo_trainer(check_int("steps", steps, 1), seed, progress)  # the same model `workbench demo` trains
    return trainer.model.eval(), ByteTokenizer()


def find_quickstart_checkpoint(runs_dir: str | os.PathLike = "runs") -> Path | None:
    """Return the run folder of the newest finished quickstart train run under runs_dir that holds a model, or None.

    The quickstart pipeline records each run in `<runs_dir>/quickstart/train/<key>/run.json`
    ({"status": "done", "finished": ISO time}); "newest" is by that finish time. A run whose folder
    holds no checkpoint `io.open_run` can find is skipped, and so is an unreadable record.
    """
    for d in reversed(find_runs("quickstart", "train", runs_dir)):
        try:
            find_run(d)
        except FileNotFoundError:
            continue
        return d
    return None


def open_model(checkpoint: str = "", runs_dir: str | os.PathLike = "runs", train_steps: int = 120,
               seed: int = 0, progress: bool = True, device=None) -> tuple[LoopLM, object, str]:
    """Return (model, tokenizer, where it came from): the run or checkpoint given, else the newest
    quickstart run under runs_dir (or ../runs_dir), else a tiny byte-level model trained for train_steps."""
    if checkpoint:
        model, tok = open_run(checkpoint, device=device)
        return model, tok, f"run {checkpoint}"
    runs = Path(runs_dir)
    # a notebook opened from notebooks/ runs there, while pipelines write runs/ at the repository root
    for where in [runs] if runs.is_absolute() else [runs, Path("..") / runs]:
        found = find_quickstart_checkpoint(where)
        if found is not None:
            model, tok = open_run(found, device=device)
            return model, tok, f"quickstart run {found}"
    model, tok = tiny_model(train_steps, seed, progress=progress)
    if device is not None:
        model = model.to(device)
    return model, tok, f"tiny byte-level model trained here for {train_steps} steps (no quickstart run in {runs_dir})"
