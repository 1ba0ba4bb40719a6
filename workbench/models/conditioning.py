"""How a loop sees where it is: initial-state, history-state and stable injection; timestep conditioning.

Every module here starts as the identity on the loop state (the stable Parcae form excepted, which
starts damped by design), so an untrained conditioned model equals the plain one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Mod, RMSNorm

STABLE_INIT_DECAY = math.sqrt(1 / 5)  # Parcae's default `ssm_decay`: each channel's decay exp(dt A) at init


class InitialInjection(nn.Module):
    """T(h, h0): mix the prelude output h0 back into the loop state before every core pass."""

    def __init__(self, kind: str, d: int):
        super().__init__()
        self.kind = kind
        if kind == "scalar":  # h + alpha h0
            self.alpha = nn.Parameter(torch.zeros(()))
        elif kind == "channel":  # a*h + b*h0
            self.a = nn.Parameter(torch.ones(d))
            self.b = nn.Parameter(torch.zeros(d))
        elif kind == "dense":  # [W_h W_0] [h; h0], one matmul over the concatenation
            self.weight = nn.Parameter(torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1))
        elif kind == "stable":
            # Parcae's diagonal injection (SPEC §1): A = -exp(A_log) and step dt = softplus(dt) per channel,
            # zero-order hold decay exp(dt A) in (0, 1) for any parameters, so the carry cannot blow up;
            # h0 enters through a full d x d matrix B. Init as Parcae's ParcaeInit: A_log = 0 (A = -1),
            # dt = softplus^-1(-log(sqrt(1/5))) so every channel starts with decay sqrt(1/5) ~ 0.447, B = I.
            self.A_log = nn.Parameter(torch.zeros(d))
            step = -math.log(STABLE_INIT_DECAY)
            self.dt = nn.Parameter(torch.full((d,), step + math.log(-math.expm1(-step))))  # inverse softplus
            self.B = nn.Parameter(torch.eye(d))
        else:
            raise ValueError(f"inject={kind!r} is invalid: must be one of scalar, channel, dense, stable")

    def discretized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (decay, step) of the stable form, each [d]: decay = exp(step * A) in (0, 1), step = softplus(dt)."""
        step = F.softplus(self.dt)
        return torch.exp(-step * torch.exp(self.A_log)), step

    def forward(self, h: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        """Return T(h, h0), same shape as h."""
        if self.kind == "scalar":
            return h + self.alpha * h0
        if self.kind == "channel":
            return self.a * h + self.b * h0
        if self.kind == "dense":
            return torch.cat([h, h0.expand_as(h)], dim=-1) @ self.weight.T
        decay, step = self.discretized()
        return decay * h + step * F.linear(h0, self.B)


class ReentryBridge(nn.Module):
    """x = s + g (W_p Norm(e) + W_s s + b - s): how loops >= 2 re-enter a retrofitted block (SPEC §5).

    `e` is the prelude output and `s` the loop state. It starts as the identity (W_p = 0, W_s = I,
    b = 0, g = 1); the gate g is one scalar (*chosen here*) that scales the whole re-entry update.
    The model skips it on loop 1, so a retrofitted model at loops=1 is the base model.
    """

    kind = "bridge"

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.norm = RMSNorm(d, eps)
        self.W_p = nn.Parameter(torch.zeros(d, d))
        self.W_s = nn.Parameter(torch.eye(d))
        self.b = nn.Parameter(torch.zeros(d))
        self.g = nn.Parameter(torch.ones(()))

    def forward(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Return the bridged state, same shape as s."""
        u = F.linear(self.norm(e), self.W_p) + F.linear(s, self.W_s, self.b)
        return s + self.g * (u - s)


class HistoryInjection(nn.Module):
    """h + sum_j B_j (h_{t-j} - h): lag operators B_1..B_w shared across loops, zero-initialised."""

    def __init__(self, window: int, op: str, d: int):
        super().__init__()
        self.op = op
        shape = {"scalar": (window,), "channel": (window, d), "dense": (window, d, d)}
        if op not in shape:
            raise ValueError(f"history_op={op!r} is invalid: must be one of scalar, channel, dense")
        # one tensor per lag, so a dense B_j is a plain 2-D matrix (what Muon takes)
        self.lags = nn.ParameterList(nn.Parameter(torch.zeros(shape[op][1:])) for _ in range(window))

    def forward(self, h: torch.Tensor, past: Sequence[torch.Tensor]) -> torch.Tensor:
        """Return h + sum_{j=1..len(past)} B_j (past[j-1] - h); past[0] is h_{t-1}, most recent first."""
        out = h
        for j, hp in enumerate(past):
            diff = hp - h
            if self.op == "dense":
                out = out + diff @ self.lags[j].T
            else:
                out = out + self.lags[j] * diff
        return out


def timestep_features(horizon: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Return psi(t, dt) for loops l = 0..horizon-1 as [horizon, 8], with t = l/T and dt = 1/T.

    The loop index l is 0-based so that every feature but dt and dt^2 vanishes at the first loop,
    as an ODE step from t to t + dt (the project's choice; the source writes t = l/T).
    """
    T = float(horizon)
    t = torch.arange(horizon, dtype=torch.float64) / T
    dt = torch.full_like(t, 1.0 / T)
    feats = torch.stack([t, dt, t * t, dt * dt, t * dt, torch.sin(math.pi * t),
                         torch.cos(math.pi * t) - 1, torch.sin(2 * math.pi * t)], dim=-1)
    return feats.to(device=device, dtype=dtype)


class TimestepConditioning(nn.Module):
    """Loop gating (8 params), branch gating (8 per layer and branch) or AdaLN (2d x 8 per layer and branch)."""

    def __init__(self, kind: str, n_layers: int, d: int):
        super().__init__()
        self.kind = kind
        if kind == "loop_gate":
            self.q = nn.Parameter(torch.zeros(8))
        elif kind == "branch_gate":
            self.q = nn.Parameter(torch.zeros(n_layers, 2, 8))
        elif kind == "adaln":
            self.W = nn.Parameter(torch.zeros(n_layers, 2, 2 * d, 8))
        else:
            raise ValueError(f"timestep={kind!r} is invalid: must be one of loop_gate, branch_gate, adaln")
        self.n_layers, self.d = n_layers, d

    def loop_gates(self, psi: torch.Tensor) -> torch.Tensor:
        """Return g = 1 + q.psi for every loop, [T] (loop gating)."""
        return 1 + psi @ self.q

    def block_mods(self, psi: torch.Tensor) -> list[list[tuple[Mod, Mod]]]:
        """Return, per loop and core layer, the (attention, MLP) branch modulations."""
        if self.kind == "branch_gate":
            g = 1 + torch.einsum("lbf,tf->tlb", self.q, psi)  # [T, layers, 2]
            return [[((g[t, i, 0], None), (g[t, i, 1], None)) for i in range(self.n_layers)]
                    for t in range(psi.shape[0])]
        gs = torch.einsum("lbef,tf->tlbe", self.W, psi)  # [T, layers, 2, 2d] = [g - 1; s]
        return [[((1 + gs[t, i, 0, :self.d], gs[t, i, 0, self.d:]),
                  (1 + gs[t, i, 1, :self.d], gs[t, i, 1, self.d:])) for i in range(self.n_layers)]
                for t in range(psi.shape[0])]
