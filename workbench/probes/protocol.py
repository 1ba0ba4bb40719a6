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
does).

The carried state `h` may be a structure (a tuple, NamedTuple or dict of tensors) when a model
carries more than one [B, T, d] tensor between loops: `reduce(h)` then gives the [B, T, d] state the
probes measure, and `coda_reads="carried"` says that the coda reads the whole carried state (it gets
`h`, not `reduce(h)`). `from_transformers` builds such a Loopable for a looped transformers model
(Inkling2Loop: the hidden and attention-residual block states). `interaction` needs named block
occurrences: a LoopLM, or a Loopable with `places` whose prelude, step and coda take a `hook`
keyword (as `from_transformers` gives).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import check_int
from ..models.looped import LoopLM

CODA_READS = ("state", "carried")
# a hook at a named block occurrence: (name, input, output) -> replacement output, or None to keep it
Hook = Callable[[str, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@dataclass
class Loopable:
    """A looped model as three callables: prelude(tokens) -> h0, step(h, h0, t) -> h, coda(h) -> logits.

    Optional: `core`, the module holding the weights `step` reuses every loop (needed by
    `lost_gradient`); `once`, named modules whose weights are used outside the loop (their gradient
    under truncation is reported too); `init(h0)`, the carried state the loop starts from, and
    `reduce(h)`, the [B, T, d] state the probes measure (both default to the identity; a
    hyper-connected LoopLM carries n streams and reduces them to their mean); `coda_reads`, what the
    coda is given: "state" (default) `reduce(h)`, "carried" the whole carried state (a structured
    state its coda reads, e.g. Inkling2Loop's block states); `places(loops)`, the names of the block
    occurrences of a pass in call order ("prelude.i", "core.{loop}.{layer}", "coda.i"), when
    prelude, step and coda take a `hook` keyword called at each (as LoopLM's hooks: it may read or
    replace the occurrence's output); `config`, `seed` and `vocab_size` for provenance and input
    checks; `context`, the longest sequence the model takes; `name`, how the model is described.
    """

    prelude: Callable[[torch.Tensor], Any]
    step: Callable[[Any, Any, int], Any]
    coda: Callable[[Any], torch.Tensor]
    training_loops: int
    core: nn.Module | None = None
    once: Mapping[str, nn.Module] = field(default_factory=dict)
    init: Callable[[Any], Any] | None = None
    reduce: Callable[[Any], torch.Tensor] | None = None
    config: Any = None
    seed: int | None = None
    vocab_size: int | None = None
    coda_reads: str = "state"
    places: Callable[[int], list[str]] | None = None
    context: int | None = None
    name: str = ""

    def __post_init__(self):
        if self.coda_reads not in CODA_READS:
            raise ValueError(f"coda_reads={self.coda_reads!r} is invalid: must be one of {', '.join(CODA_READS)}")

    def initial(self, h0: Any) -> Any:
        """Return the carried state the loop starts from (init(h0), or h0 itself)."""
        return h0 if self.init is None else self.init(h0)

    def state(self, h: Any) -> torch.Tensor:
        """Return the measured [B, T, d] state for a carried state (reduce(h), or h itself)."""
        return h if self.reduce is None else self.reduce(h)

    def readout(self, h: Any, hook: Hook | None = None) -> torch.Tensor:
        """Return the logits of a carried state: coda(h) when the coda reads the carried state, else coda(reduce(h))."""
        x = h if self.coda_reads == "carried" else self.state(h)
        return self.coda(x) if hook is None else self.coda(x, hook=hook)

    def run(self, tokens: torch.Tensor, loops: int, hook: Hook | None = None) -> tuple[Any, list[Any]]:
        """Return (h0, carried states 0..loops) of one pass; states[t] is the state after loop t.

        `hook` (a Loopable with `places` only) is passed to the prelude and every step.
        """
        loops = check_int("loops", loops, 0)
        kw = {} if hook is None else {"hook": hook}
        h0 = self.prelude(tokens, **kw)
        h = self.initial(h0)
        states = [h]
        for t in range(loops):
            h = self.step(h, h0, t, **kw)
            states.append(h)
        return h0, states

    def device(self) -> torch.device | None:
        """Return the device of the wrapped weights (core, else a once module), or None when it holds none."""
        for m in (self.core, *self.once.values()):
            for p in ([] if m is None else m.parameters()):
                return p.device
        return None


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
                    seed=model.seed, vocab_size=cfg.vocab_size, context=cfg.max_seq_len, name=cfg.notation)


# transformers architectures with an adapter: class name -> (module of this package, builder name)
ADAPTERS = {"Inkling2LoopForCausalLM": ("inkling", "inkling2_loop")}


def from_transformers(model, loops: int | None = None) -> Loopable:
    """Return a Loopable of a loaded looped transformers model (one listed in `ADAPTERS`).

    `loops` is the training loop count K the probes default to (default: the model's own setting,
    e.g. Inkling2Loop's `loop_num_passes`); it must be an integer >= 1. The Loopable calls the
    model's own submodules in the order its forward does, so its logits after r loops are the
    model's at r loops. Raises ValueError naming the model's class and architecture when no adapter
    knows it.
    """
    import importlib

    name = type(model).__name__
    if name not in ADAPTERS:
        arch = getattr(getattr(model, "config", None), "architectures", None)
        raise ValueError(f"from_transformers does not know {name}"
                         f"{f' (architectures={arch})' if arch else ''}: it adapts "
                         f"{', '.join(sorted(ADAPTERS))}; wrap another looped model in a Loopable by hand")
    module, builder = ADAPTERS[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), builder)(model, loops)
