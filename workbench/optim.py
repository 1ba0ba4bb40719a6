"""Muon whose Newton-Schulz orthogonalisation runs in the dtype the device does fast.

`torch.optim.Muon` always orthogonalises in bf16. On a CPU without AMX-BF16 / AVX512-BF16 a bf16 matmul
is emulated: 3.8x slower than fp32 where this was first measured (Muon took 0.62 s of a 2.06 s step on a
2+2x4+2 d=256 model, AdamW 0.01 s), ~40x on an AVX2-only CPU (benchmarks/bench_muon.py). `Muon` here
is torch's step, line for line, with the orthogonalisation in `ns_dtype`: "auto" picks bf16 where
`models.precision.fast_bf16` says the parameter's device does bf16 fast (CUDA, AMX / AVX512-BF16 CPUs:
there the result is torch's, bit for bit) and fp32 elsewhere.
Optimiser state (`momentum_buffer`) and param_groups are torch's exactly, so a checkpoint written with
either optimiser loads into the other.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .config import fail
from .models.precision import fast_bf16

NS_DTYPES = ("auto", torch.bfloat16, torch.float32, torch.float64)


def check_ns_dtype(value) -> str | torch.dtype:
    """Return `value` if it is "auto", torch.bfloat16, torch.float32 or torch.float64, else fail naming ns_dtype."""
    # type first: `value in NS_DTYPES` on a tensor or array would compare elementwise, not answer
    if not ((isinstance(value, str) and value == "auto") or (isinstance(value, torch.dtype) and value in NS_DTYPES)):
        fail("ns_dtype", value, "must be 'auto', torch.bfloat16, torch.float32 or torch.float64")
    return value


def resolve_ns_dtype(ns_dtype, device: torch.device | str,
                     cpuinfo: Callable[[], str] | str | None = None) -> torch.dtype:
    """Return the dtype Newton-Schulz runs in on `device`: ns_dtype itself, or for "auto" bf16 where the
    device does bf16 fast and fp32 elsewhere (`cpuinfo` simulates a CPU, as in `fast_bf16`)."""
    ns_dtype = check_ns_dtype(ns_dtype)
    if ns_dtype != "auto":
        return ns_dtype
    return torch.bfloat16 if fast_bf16(device, cpuinfo) else torch.float32


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients=(3.4445, -4.7750, 2.0315), eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Return the 2-D G approximately orthogonalised (U S' V^T, S' near 1, not equal to it) by `steps` quintic
    Newton-Schulz iterations computed in `dtype`, cast back to G's dtype.

    The same operations, in the same order, as torch.optim._muon._zeropower_via_newtonschulz, so with
    dtype=bf16 (the default, torch's choice) the result equals torch's bit for bit.
    """
    if G.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(G.shape)}")
    a, b, c = coefficients
    tall = G.size(0) > G.size(1)
    X = G.to(dtype).T if tall else G.to(dtype)  # iterate on the short side: the Gram matrix is the small one
    X = X / X.norm().clamp(min=eps)  # out of place: G.to(dtype) may be G itself (the momentum buffer)
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return (X.T if tall else X).to(G.dtype)


def _adjust_lr(lr, adjust_lr_fn: str | None, shape: torch.Size):
    # torch.optim._muon._adjust_lr, rewritten rather than imported: _muon is a private module whose helpers
    # may move or change between releases, and this is five lines. The products keep torch's grouping
    # (lr * (0.2 * sqrt)), so the float result, and a resumed run, is bit-identical to torch's.
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, A / B))
    return lr * (0.2 * math.sqrt(max(A, B))) if adjust_lr_fn == "match_rms_adamw" else lr * 1.0


class Muon(torch.optim.Muon):
    """torch.optim.Muon with Newton-Schulz in `ns_dtype` ("auto", torch.bfloat16, torch.float32 or torch.float64).

    The other arguments are torch's, with torch's defaults and checks.
    """

    def __init__(self, params, *args, ns_dtype="auto", **kwargs) -> None:
        super().__init__(params, *args, **kwargs)
        # an attribute, not a param_group key: param_groups go into the checkpoint's JSON (a dtype is not
        # JSON), and load_state_dict replaces the groups with the saved ones, so a key torch's groups lack
        # would vanish when a torch checkpoint is loaded
        self.ns_dtype = check_ns_dtype(ns_dtype)

    def __getstate__(self) -> dict:
        """Return the pickled state: torch's (defaults, state, param_groups) plus ns_dtype."""
        return {**super().__getstate__(), "ns_dtype": self.ns_dtype}  # else deepcopy / pickle drop it

    @torch.no_grad()
    def step(self, closure=None):
        """Return the closure's loss (None without one) after one Muon step on every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dtypes: dict[torch.device, torch.dtype] = {}  # resolved once per device and step, not per matrix
        for group in self.param_groups:
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            lr = lr.squeeze() if torch.is_tensor(lr) else lr  # torch's _to_scalar
            for p in group["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p) or p.grad.is_sparse:
                    raise RuntimeError("Muon does not support complex parameters or sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                if p.device not in dtypes:
                    dtypes[p.device] = resolve_ns_dtype(self.ns_dtype, p.device)
                update = newton_schulz(update, group["ns_steps"], group["ns_coefficients"], group["eps"],
                                       dtypes[p.device])
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
