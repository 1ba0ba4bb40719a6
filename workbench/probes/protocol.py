"""The loop protocol the probes run through: `prelude(tokens) -> h0`, `step(h, h0, t) -> h`, `coda(h) -> logits`.

A `LoopLM` is probed directly (`as_loopable` adapts it, every variant included); any other looped
model can be probed by wrapping it in a `Loopable`. A plain `nn.Module` loop, for example::

    import torch
    from torch import nn
    from workbench import probes

    emb = nn.Embedding(100, 32)                              # prelude: tokens [B, T] -> h0 [B, T, 32]
    cell = nn.Sequential(nn.Linear(64, 32), nn.Tanh())       # the weight-tied step
    head = nn.Linear(32, 100)                                # coda: state -> logits [B, T, 100]
    loop = probes.Loopable(
        prelude=emb,
        step=lambda h, h0, t: h + cell(torch.cat([h, h0], dim=-1)),   # t is the 0-based loop index
        coda=head,
        training_loops=4,
        core=cell,                    # the weights `step` reuses every loop (lost_gradient's "core")
        once={"embedding": emb},      # weights used once, reported by lost_gradient under truncation
    )
    tokens = torch.randint(0, 100, (2, 12))
    probes.geometry(loop, tokens, loops=8)
    probes.lens(loop, tokens, tokens.roll(-1, 1), loops=8)
    probes.halting(loop, tokens, tokens.roll(-1, 1), loops=8, threshold=1e-3)
    probes.lost_gradient(loop, tokens, tokens.roll(-1, 1), loops=8)

The step sees only `(h, h0, t)`: it must depend on the loop index `t`, never on the total loop count
(a horizon-dependent model fixes its horizon when it is wrapped, as `as_loopable(model, horizon=T)`
does). `interaction` needs named block occurrences and so takes a `LoopLM` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..models.looped import LoopLM


@dataclass
class Loopable:
    """A looped model as three callables: prelude(tokens) -> h0, step(h, h0, t) -> h, coda(h) -> logits.

    Optional: `core`, the module holding the weights `step` reuses every loop (needed by
    `lost_gradient`); `once`, named modules whose weights are used outside the loop (their gradient
    under truncation is reported too); `init(h0)`, the carried state the loop starts from, and
    `reduce(h)`, the [B, T, d] state the probes measure (both default to the identity; a
    hyper-connected LoopLM carries n streams and reduces them to their mean); `config`, `seed` and
    `vocab_size` for provenance and input checks.
    """

    prelude: Callable[[torch.Tensor], torch.Tensor]
    step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    coda: Callable[[torch.Tensor], torch.Tensor]
    training_loops: int
    core: nn.Module | None = None
    once: Mapping[str, nn.Module] = field(default_factory=dict)
    init: Callable[[torch.Tensor], torch.Tensor] | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    config: Any = None
    seed: int | None = None
    vocab_size: int | None = None

    def initial(self, h0: torch.Tensor) -> torch.Tensor:
        """Return the carried state the loop starts from (init(h0), or h0 itself)."""
        return h0 if self.init is None else self.init(h0)

    def state(self, h: torch.Tensor) -> torch.Tensor:
        """Return the measured [B, T, d] state for a carried state (reduce(h), or h itself)."""
        return h if self.reduce is None else self.reduce(h)

    def run(self, tokens: torch.Tensor, loops: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Return (h0, carried states 0..loops) of one pass; states[t] is the state after loop t."""
        h0 = self.prelude(tokens)
        h = self.initial(h0)
        states = [h]
        for t in range(loops):
            h = self.step(h, h0, t)
            states.append(h)
        return h0, states


def as_loopable(model: LoopLM | Loopable, horizon: int | None = None) -> Loopable:
    """Return a Loopable whose one pass reproduces `model.run` exactly (a Loopable is returned as is).

    `horizon` is the T that timestep conditioning sees (default: the training loop count); the
    step raises if asked for a loop at or beyond it. The step is the model's own `LoopLM.step` with
    its history window (`LoopLM.window`) over the states this adapter has seen since loop 0, so
    passes must not be interleaved.
    """
    if isinstance(model, Loopable):
        return model
    if not isinstance(model, LoopLM):
        raise TypeError(f"model must be a LoopLM or a Loopable, got {type(model).__name__}")
    cfg = model.cfg
    T = cfg.loops if horizon is None else horizon
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"horizon={horizon!r} is invalid: must be an integer >= 1")
    seen: list[torch.Tensor] = []

    def step(h: torch.Tensor, h0: torch.Tensor, t: int) -> torch.Tensor:
        if model.timestep is not None and t >= T:
            raise ValueError(f"loop {t + 1} is beyond horizon={T} of this adapter; "
                             f"use as_loopable(model, horizon=...) with horizon >= loops")
        if t == 0:
            seen.clear()
        seen.append(h)
        # the context is built inside the step so that per-loop copies of the weights act (lost_gradient)
        return model.step(h, t, model.context(h0, T), model.window(seen, t))

    shared = nn.ModuleDict({name: m for name, m in (("core", model.core), ("inject", model.inject),
                                                      ("history", model.history), ("timestep", model.timestep),
                                                      ("hyper", model.hyper)) if m is not None})
    once: dict[str, nn.Module] = {"embedding": model.embed}
    if cfg.prelude:
        once = {"prelude": model.prelude, **once}
    return Loopable(prelude=model.embed_prelude, step=step, coda=model.readout, training_loops=cfg.loops,
                    core=shared, once=once, init=lambda h0: model.initial_state(h0)[0], reduce=model.reduce, config=cfg,
                    seed=model.seed, vocab_size=cfg.vocab_size)
