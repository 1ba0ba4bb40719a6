"""Hyper-connections (Zhu et al. 2024) around each core layer, tied across loops like the core itself.

State H is [..., n, d] (n copies of h0 at the start; the streams are averaged before the coda,
see LoopLM.reduce). A layer reads h_in = A_m^T H and writes H' = B^T Layer(h_in) + A_r^T H, where
Layer(h_in) is the layer's residual update (its output minus its input), so n = 1 with A_m = A_r = B = 1
is exactly the plain residual stream. Written here rather than taken from the PyPI `hyper-connections`
package: its API wraps one branch at a time and changes between minor releases, while the loop needs
the block-level form of SPEC §1 with parameters shared across loops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class HyperConnection(nn.Module):
    """One layer's static (and optionally dynamic) hyper-connection with expansion n."""

    def __init__(self, n: int, d: int, layer_index: int, dynamic: bool = False, eps: float = 1e-6):
        super().__init__()
        self.n, self.dynamic, self.eps = n, dynamic, eps
        a_m = torch.zeros(n)
        a_m[layer_index % n] = 1.0
        self.A_m = nn.Parameter(a_m)
        self.A_r = nn.Parameter(torch.eye(n))
        self.B = nn.Parameter(torch.ones(n))
        if dynamic:
            # tanh(norm(H) W) terms: W zero-initialised, scaled by learned 0.01 factors
            self.norm_weight = nn.Parameter(torch.ones(d))
            self.W_m = nn.Parameter(torch.zeros(d))
            self.W_r = nn.Parameter(torch.zeros(d, n))
            self.W_b = nn.Parameter(torch.zeros(d))
            self.s_alpha = nn.Parameter(torch.full((), 0.01))
            self.s_beta = nn.Parameter(torch.full((), 0.01))

    def weights(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (A_m [..., n], A_r [..., n, n], B [..., n]) for state H [..., n, d]."""
        if not self.dynamic:
            return self.A_m, self.A_r, self.B
        Hn = F.rms_norm(H, (H.shape[-1],), self.norm_weight, self.eps)
        a_m = self.A_m + self.s_alpha * torch.tanh(Hn @ self.W_m)
        a_r = self.A_r + self.s_alpha * torch.tanh(Hn @ self.W_r)
        b = self.B + self.s_beta * torch.tanh(Hn @ self.W_b)
        return a_m, a_r, b

    def forward(self, H: torch.Tensor, update: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Return H' = B^T update(A_m^T H) + A_r^T H for state H [..., n, d]."""
        a_m, a_r, b = self.weights(H)
        h_in = torch.einsum("...n,...nd->...d", a_m.expand(H.shape[:-1]), H)
        y = update(h_in)
        return b.unsqueeze(-1) * y.unsqueeze(-2) + torch.einsum("...nm,...nd->...md",
                                                                a_r.expand(*H.shape[:-1], self.n), H)
