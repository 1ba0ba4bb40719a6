"""Inkling2Loop (transformers) as a `Loopable`: its own submodules, called in the order its forward calls them.

`Inkling2LoopForCausalLM` runs a prelude of decoder layers, a core of layers
(`loop_layer_index_start` to `loop_layer_index_end`) `loop_num_passes` times and a coda. Every
layer reads the hidden state and the attention-residual block states (the layer inputs stored at
block boundaries). Pass 1 continues from the prelude's states; each later pass restarts from them
and receives messages (`message_input`) read from the previous pass's hidden and block states, which
the loop layers mix in through their message gates; the coda reads the last pass's states.

So the carried state is `InklingState(hidden, blocks)`: the state after loop t is what pass t leaves,
the prelude's output is state 0, and the probes measure `hidden` ([B, T, d], the output of the last
core layer). Nothing is re-implemented: masks, relative distances and position ids are made by the
same transformers functions with the arguments the forward gives them (no padding mask, no cache),
and every layer, the message module, the final block attention, norm, head and softcap are the
model's own, so the logits after r loops are the model's with `config.loop_num_passes = r`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..config import check_int
from .protocol import Hook, Loopable

ARCHITECTURE = "Inkling2LoopForCausalLM"


class InklingState(NamedTuple):
    """What Inkling2Loop carries between passes: `hidden` [B, T, d] and the block states `blocks` [B, T, n, d]."""

    hidden: torch.Tensor
    blocks: torch.Tensor


class _Context(NamedTuple):
    """What the forward computes once per input and hands to every layer (masks, distances, positions)."""

    masks: dict
    distance: dict
    position_ids: torch.Tensor


class Inkling2LoopAdapter:
    """The prelude, step and coda of an `Inkling2LoopForCausalLM`, each a slice of its forward.

    Layer occurrences are named as a LoopLM's: `prelude.i`, `core.{loop}.{j}` (loop 1-based, j the
    layer's index in the core) and `coda.i`; a `hook(name, input, output)` passed to any of the three
    may read a layer's hidden input and output or replace the output (its block-state bookkeeping
    is untouched, as in the forward, which stores a layer's input, not its output).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.text = model.model
        cfg = self.text.config
        self.start, self.end = cfg.loop_layer_index_start, cfg.loop_layer_index_end
        layers = list(self.text.layers)
        self.prelude_layers = layers[:self.start]
        self.core_layers = layers[self.start:self.end]
        self.coda_layers = layers[self.end:]
        self._ctx_key = None
        self._ctx: _Context | None = None

    # ---- what the forward builds once per input -------------------------------------------------
    def context(self, embeds: torch.Tensor) -> _Context:
        """Return the masks, relative distances and position ids the forward builds for inputs like `embeds`.

        They depend on the batch size, length, dtype and device only, so the last one is kept.
        """
        key = (tuple(embeds.shape[:2]), embeds.dtype, embeds.device)
        if key != self._ctx_key:
            from transformers.masking_utils import (create_causal_mask, create_recurrent_attention_mask,
                                                    create_sliding_window_causal_mask)
            from transformers.models.inkling2_loop.modeling_inkling2_loop import get_relative_distance

            position_ids = torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)
            kw = dict(config=self.text.config, inputs_embeds=embeds, attention_mask=None, cache=None,
                      position_ids=position_ids)
            masks = {"full_attention": create_causal_mask(**kw),
                     "sliding_attention": create_sliding_window_causal_mask(**kw),
                     "linear_attention": create_recurrent_attention_mask(**kw)}
            distance = {"full_attention": get_relative_distance(embeds, None, is_sliding=False),
                        "sliding_attention": get_relative_distance(embeds, None, is_sliding=True)}
            self._ctx, self._ctx_key = _Context(masks, distance, position_ids), key
        return self._ctx

    def _layers(self, layers, prefix: str, hidden: torch.Tensor, blocks: torch.Tensor, hook: Hook | None,
                messages=None) -> InklingState:
        """Return the state after `layers`, each called as the forward calls it (messages: j -> messages or None)."""
        ctx = self.context(hidden)
        for j, layer in enumerate(layers):
            kind = layer.attention_type
            extra = () if messages is None else (messages(j),)
            new = layer(hidden, blocks, *extra, attention_mask=ctx.masks[kind], relative_distance=ctx.distance[kind],
                        conv_mask=ctx.masks["linear_attention"], cache=None, position_ids=ctx.position_ids)
            if hook is not None:
                out = hook(f"{prefix}.{j}", hidden, new)
                new = new if out is None else out
            if layer.is_block_boundary:
                blocks = torch.cat([blocks.to(hidden.device), hidden.unsqueeze(-2)], dim=-2)
            hidden = new
        return InklingState(hidden, blocks)

    # ---- the three callables ----------------------------------------------------------------------
    def prelude(self, tokens: torch.Tensor, hook: Hook | None = None) -> InklingState:
        """Return state 0: the embeddings run through the layers before the core."""
        embeds = self.text.embed_tokens(tokens)
        blocks = embeds.new_zeros(*embeds.shape[:-1], 0, embeds.shape[-1])
        return self._layers(self.prelude_layers, "prelude", embeds, blocks, hook)

    def step(self, h: InklingState, h0: InklingState, t: int, hook: Hook | None = None) -> InklingState:
        """Return the state after loop t + 1: one pass over the core (t is 0-based).

        Pass 1 continues from the carried state (state 0 is h0); a later pass restarts from h0 and
        gets messages from the previous pass's hidden state and the blocks it added after its first
        (that one is h0's hidden state again).
        """
        prefix = f"core.{t + 1}"
        if t == 0:
            return self._layers(self.core_layers, prefix, h.hidden, h.blocks, hook)
        previous = h.blocks[..., h0.blocks.shape[-2] + 1:, :]

        def messages(j: int) -> torch.Tensor:
            return self.text.message_input(previous, h.hidden, j)

        return self._layers(self.core_layers, prefix, h0.hidden, h0.blocks, hook, messages)

    def coda(self, h: InklingState, hook: Hook | None = None) -> torch.Tensor:
        """Return the logits of a carried state: coda layers, final block attention, norm, head and softcap."""
        dtype = h.hidden.dtype  # the embeddings' dtype, which every layer keeps and the forward casts back to
        hidden, blocks = self._layers(self.coda_layers, "coda", h.hidden, h.blocks, hook)
        hidden = self.text.final_input(blocks, hidden)[0]
        hidden = self.text.norm(hidden).to(dtype)
        return self.model.logit_softcap(self.model.lm_head(hidden).float())

    def places(self, loops: int) -> list[str]:
        """Return the layer occurrences of a pass with `loops` loops, in call order."""
        s = len(self.core_layers)
        return ([f"prelude.{i}" for i in range(len(self.prelude_layers))]
                + [f"core.{t}.{j}" for t in range(1, loops + 1) for j in range(s)]
                + [f"coda.{i}" for i in range(len(self.coda_layers))])


def inkling2_loop(model: nn.Module, loops: int | None = None) -> Loopable:
    """Return the Loopable of an Inkling2LoopForCausalLM (training loop count `loops`, default loop_num_passes)."""
    from transformers import Inkling2LoopForCausalLM

    if not isinstance(model, Inkling2LoopForCausalLM):
        raise ValueError(f"inkling2_loop needs an {ARCHITECTURE}, got {type(model).__name__}")
    cfg = model.config
    K = check_int("loops", cfg.loop_num_passes if loops is None else loops, 1)
    a = Inkling2LoopAdapter(model)
    shared = nn.ModuleDict({"core": nn.ModuleList(a.core_layers), "message": a.text.message_input})
    once = {"prelude": nn.ModuleList(a.prelude_layers), "embedding": a.text.embed_tokens}
    p, s, c = len(a.prelude_layers), len(a.core_layers), len(a.coda_layers)
    return Loopable(prelude=a.prelude, step=a.step, coda=a.coda, training_loops=K, core=shared, once=once,
                    reduce=lambda h: h.hidden, coda_reads="carried", places=a.places, config=cfg,
                    vocab_size=min(cfg.vocab_size, cfg.unpadded_vocab_size), context=cfg.max_position_embeddings,
                    name=f"{ARCHITECTURE} {p}+{s}x{K}+{c}")
