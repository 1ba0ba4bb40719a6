"""Compilation: each Block compiled, the loop left eager; whether compiling repays itself (compile="auto").

compile="auto" compiles when a run's training FLOPs (FLOPs per token x tokens, head and attention
included) reach COMPILE_AUTO_FLOPS for the device type, where the first compile repays itself at
least twice over. Measured on 2 AVX512-BF16 cores (2026-11-30, docs/benchmarks.md): a cold first
compile of the blocks takes 40-80 s (seconds when inductor's on-disk cache already holds them), and
the compiled bf16 step is 13-15% faster than the eager one (2+2x4+2 d=256: 1.96 against 2.25 s on
one thread; the quickstart's 1+2x4+1 d=128: 0.31 against 0.37 s). 1.5e14 FLOPs are ~900 steps of
the d=256 model, ~30 minutes of eager training, from which compiling saves ~4 minutes. On CUDA (an
H200, 2026-11-30) the compile took 5-15 s and made the step 1.39x faster for a 113M model (repaid
after 1.3e16 FLOPs, ~240 steps) and 1.4x for the launch-bound d=256 model (after 1.5e14 FLOPs), so
the threshold sits between the two. On a CPU without AMX / AVX512-BF16 (fp32 training) the compiled
step ran at 0.98x of eager (2026-12-01, docs/benchmarks.md): no gain to repay the compile, so "auto"
compiles on a CPU only where the run trains in bf16 autocast on a CPU that does bf16 fast.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
from typing import Any

import torch

from ..models.layers import Block
from ..models.looped import LoopLM
from ..models.precision import use_bf16
from .config import TrainConfig
from .loops import training_flops

COMPILE_AUTO_FLOPS = {"cpu": 1.5e14, "cuda": 5e15}
_COMPILED: dict[str, Any] = {}  # torch.compile of Block.forward / Block.delta, made once per process


def compile_pays(model: LoopLM, tc: TrainConfig, steps: int, device: torch.device | str,
                 world: int = 1, cpuinfo=None) -> tuple[bool, str]:
    """Return (compile?, why) for tc.compile on `device`: "on" and "off" as given; "auto" compiles when the
    run's training FLOPs reach COMPILE_AUTO_FLOPS[device type] and (on a CPU) the run trains in bf16 on a CPU
    with AMX / AVX512-BF16 and a C++ compiler is there for inductor's kernels (`cpuinfo` simulates a CPU)."""
    if tc.compile != "auto":
        return tc.compile == "on", f"compile={tc.compile}"
    device = torch.device(device)
    limit = COMPILE_AUTO_FLOPS.get(device.type)
    if limit is None:
        return False, f"compile=auto: not measured on {device.type}, so off"
    if device.type == "cpu" and not use_bf16(tc.bf16, device, cpuinfo):
        return False, ("compile=auto: fp32 training on this CPU (no AMX / AVX512-BF16 in use), where compiling "
                       "measured no gain (0.98x of eager), so off")
    flops = training_flops(model, tc, steps, world)
    if flops < limit:
        return False, (f"compile=auto: {flops:.2g} training FLOPs < {limit:.2g}, too short to repay a first "
                       "compile of about a minute")
    if device.type == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++")):
        return False, "compile=auto: no C++ compiler (g++, c++, clang++ or $CXX) for inductor's CPU kernels"
    return True, f"compile=auto: {flops:.2g} training FLOPs >= {limit:.2g}"


def _compiled_fns() -> dict[str, Any]:
    """Return the process's compiled Block.forward and Block.delta, compiling them on first use."""
    if not _COMPILED:
        # compiled as plain functions of (block, ...): one cache for every Block, so all the blocks of a
        # model (and of every model of the same shapes) share one compiled graph
        _COMPILED["forward"] = torch.compile(Block.forward)
        _COMPILED["delta"] = torch.compile(Block.delta)
    return _COMPILED


@contextlib.contextmanager
def compiled_blocks(model: torch.nn.Module):
    """Return a context within which every Block of `model` runs torch.compile'd (forward, and delta).

    Only the blocks are compiled; the loop over them stays in Python, so a new loop count, a truncated
    backward (a no-grad forward: compiled once more), timestep modulations and hyper-connection
    routing reuse the compiled blocks instead of recompiling. Outside the context the blocks run
    eagerly again (evaluation, probes), and state_dict keys never change.
    """
    fns = _compiled_fns()
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for b in blocks:
        b.forward = functools.partial(fns["forward"], b)
        b.delta = functools.partial(fns["delta"], b)
    try:
        yield
    finally:
        for b in blocks:
            del b.forward, b.delta


def compile_count() -> int:
    """Return how many graphs torch.compile has built in this process (0 when dynamo was never used)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
