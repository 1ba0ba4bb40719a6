"""Precision: whether a device runs bf16 fast, and the autocast context that uses it.

One rule for training, evaluation and the explorer (`bf16="auto"`): bf16 autocast where the device
has fast bf16 arithmetic (a CUDA device that supports bf16; a CPU whose flags, read from
/proc/cpuinfo, show AMX-BF16 or AVX512-BF16), fp32 elsewhere. The flags are read, never assumed:
the reader is an argument, so a test can simulate a CPU with or without them. Under autocast only
the matmuls (and what autocast lists) run in bf16; parameters, optimiser states, the loss and the
cross-entropy's softmax stay fp32.

`WORKBENCH_BF16=off` in the environment makes "auto" resolve to fp32 on this host, for every run a
process starts (a pipeline's notebook kernels inherit it): runs on an AMX machine that must stay
comparable with fp32 runs made on a CPU without bf16 units (the precision moves losses; issue 27).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from ..config import fail

PRECISIONS = ("auto", "on", "off")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # either gives native bf16 dot products on x86
ENV_BF16 = "WORKBENCH_BF16"


def host_allows_bf16() -> bool:
    """Return False when the environment's WORKBENCH_BF16 is "off" (auto means fp32 here), True when unset or "auto"."""
    value = os.environ.get(ENV_BF16, "auto")
    if value not in ("auto", "off"):
        fail(ENV_BF16, value, "must be auto or off (off: precision 'auto' never picks bf16 on this host)")
    return value == "auto"


def read_cpuinfo() -> str:
    """Return the text of /proc/cpuinfo ("" where there is none, e.g. macOS or Windows)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: Callable[[], str] | str | None = None) -> frozenset[str]:
    """Return the CPU feature flags named on the first `flags` line of cpuinfo (default: /proc/cpuinfo)."""
    text = cpuinfo() if callable(cpuinfo) else (read_cpuinfo() if cpuinfo is None else cpuinfo)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 says flags, ARM says Features
            return frozenset(value.split())
    return frozenset()


@functools.lru_cache(maxsize=None)
def _host_cpu_fast() -> bool:
    return bool(cpu_flags() & set(BF16_CPU_FLAGS))


def fast_bf16(device: torch.device | str, cpuinfo: Callable[[], str] | str | None = None) -> bool:
    """Return True when `device` does bf16 arithmetic fast: CUDA with bf16 support, or a CPU with AMX/AVX512-BF16.

    `cpuinfo` (a string or a function returning one) replaces /proc/cpuinfo, so a test can simulate
    a CPU; without it the host's flags are read once per process.
    """
    device = torch.device(device)
    if cpuinfo is None and not host_allows_bf16():
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False  # mps, xpu, ...: not measured here, so not assumed
    if cpuinfo is None:
        return _host_cpu_fast()
    return bool(cpu_flags(cpuinfo) & set(BF16_CPU_FLAGS))


def check_precision(field: str, value) -> str:
    """Return "auto", "on" or "off" for a precision setting (True/False/None accepted as on/off/auto), else fail."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in PRECISIONS:
        fail(field, value, "must be one of auto, on, off (or True / False)")
    return value


def use_bf16(setting, device: torch.device | str, cpuinfo: Callable[[], str] | str | None = None) -> bool:
    """Return whether bf16 autocast is used for `setting` ("auto", "on", "off", or a bool) on `device`."""
    setting = check_precision("bf16", setting)
    if setting == "auto":
        return fast_bf16(device, cpuinfo)
    return setting == "on"


def autocast(device: torch.device | str, enabled: bool):
    """Return a bf16 autocast context for `device` when enabled, else a context that does nothing."""
    device = torch.device(device)
    if not enabled:
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def precision_name(enabled: bool) -> str:
    """Return the name recorded in provenance: "bf16-autocast" or "fp32"."""
    return "bf16-autocast" if enabled else "fp32"
