"""LoopLM: Coda . Core^r . Prelude, where one pass to r_max gives the states for every r <= r_max."""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LoopConfig
from .conditioning import (HistoryInjection, InitialInjection, ReentryBridge, TimestepConditioning,
                           timestep_features)
from .hyper import HyperConnection
from .layers import Block, RMSNorm, Rotary, linear_cross_entropy
from .taper import mlp_widths


@dataclass
class LoopOutput:
    """What a forward pass returns: logits [B, T, V], the mean loss if targets were given, the final state."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None
    state: torch.Tensor


class LoopTrace:
    """Every loop state of one pass: `states[t]` is the state after loop t (`states[0]` is h0)."""

    def __init__(self, model: "LoopLM", states: torch.Tensor, horizon: int):
        self.model = model
        self.states = states  # [r_max + 1, B, T, d]
        self.horizon = horizon  # T used by timestep conditioning (equals r_max unless given)

    @property
    def max_loops(self) -> int:
        """Return r_max, the number of loops this trace ran."""
        return self.states.shape[0] - 1

    def _check(self, r: int) -> None:
        if not isinstance(r, int) or not 1 <= r <= self.max_loops:
            raise ValueError(f"loops={r!r} is invalid: this trace holds loops 1..{self.max_loops}")

    def logits(self, r: int) -> torch.Tensor:
        """Return the logits [B, T, V] of coda + head applied to the state after loop r."""
        self._check(r)
        return self.model.readout(self.states[r])

    def loss(self, r: int, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean next-token cross-entropy at loop r (targets -100 are ignored)."""
        return lm_loss(self.logits(r), targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Return mean cross-entropy of logits [B, T, V] against targets [B, T]; -100 is ignored."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


class LoopLM(nn.Module):
    """A looped language model: p prelude blocks, a weight-tied core of s blocks run r times, c coda blocks."""

    def __init__(self, cfg: LoopConfig, seed: int = 0):
        super().__init__()
        if not isinstance(cfg, LoopConfig):
            raise TypeError(f"cfg must be a LoopConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.seed = seed  # the init seed, recorded in provenance
        d, p, s = cfg.d_model, cfg.prelude, cfg.core
        widths = mlp_widths(cfg.physical_layers, cfg.ff_mean, cfg.taper, cfg.taper_multiple,
                            cfg.taper_start, cfg.taper_end)
        # build and initialise under a private RNG so the seed alone decides the weights
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)

            def block(width: int, rank: int = 0) -> Block:
                return Block(d, cfg.n_heads, cfg.kv_heads, width, cfg.norm_eps, cfg.sandwich_norm,
                             cfg.attn_bias, rank)

            self.embed = nn.Embedding(cfg.vocab_size, d)
            self.prelude = nn.ModuleList(block(w) for w in widths[:p])
            self.core = nn.ModuleList(block(w, cfg.adapter_rank) for w in widths[p:p + s])
            self.coda = nn.ModuleList(block(w) for w in widths[p + s:])
            self.norm = RMSNorm(d, cfg.norm_eps)
            self.head = None if cfg.tie_embeddings else nn.Linear(d, cfg.vocab_size, bias=False)
            self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            self.inject = (None if cfg.inject == "none" else ReentryBridge(d, cfg.norm_eps)
                           if cfg.inject == "bridge" else InitialInjection(cfg.inject, d))
            self._inject_from = 1 if cfg.inject == "bridge" else 0  # the bridge skips loop 1 (0-based loop 0)
            self.history = HistoryInjection(cfg.history, cfg.history_op, d) if cfg.history else None
            self.timestep = TimestepConditioning(cfg.timestep, s, d) if cfg.timestep != "none" else None
            self.hyper = (nn.ModuleList(HyperConnection(cfg.hyper, d, k, cfg.hyper_dynamic, cfg.norm_eps)
                                        for k in range(s)) if cfg.hyper > 1 else None)
            self._init_weights()

    # ---- construction -------------------------------------------------------------------------
    def _init_weights(self) -> None:
        std = self.cfg.init_std
        # residual outputs shrink with the depth the model is trained at (GPT-2 style)
        out_std = std / (2 * self.cfg.effective_depth()) ** 0.5
        for blk in [*self.prelude, *self.core, *self.coda]:
            for lin in (blk.attn.qkv, blk.mlp.gate_up):
                nn.init.normal_(lin.weight, 0.0, std)
            for lin in (blk.attn.o, blk.mlp.down):
                nn.init.normal_(lin.weight, 0.0, out_std)
            for lin in (blk.attn.qkv, blk.attn.o):
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
        nn.init.normal_(self.embed.weight, 0.0, std)
        if self.head is not None:
            nn.init.normal_(self.head.weight, 0.0, std)

    # ---- introspection ------------------------------------------------------------------------
    @property
    def horizon_dependent(self) -> bool:
        """Return True when loop t depends on the total loop count T (timestep conditioning)."""
        return self.timestep is not None

    def _rec_modules(self) -> list[nn.Module]:
        return [m for m in (self.core, self.inject, self.history, self.timestep, self.hyper) if m is not None]

    def param_counts(self) -> dict[str, int]:
        """Return {"once": prelude + coda + final norm, "rec": core + loop extras, "embed": embedding + head}."""
        def count(mods):
            return sum(p.numel() for m in mods for p in m.parameters())
        embed = [self.embed] + ([self.head] if self.head is not None else [])
        return {"once": count([self.prelude, self.coda, self.norm]), "rec": count(self._rec_modules()),
                "embed": count(embed)}

    def flops_per_token(self, loops: int | None = None, backward_loops: int | None = None,
                        seq_len: int | None = None, include_head: bool = False) -> float:
        """Return training FLOPs per token: 6 N_once + 2 N_rec r + 4 N_rec k (+ attention, + head).

        Attention adds 2 * seq_len * d per layer occurrence forward (Kaplan et al.'s causal count),
        doubled for backward, when `seq_len` is given; `include_head` adds 6 d V for the LM head.
        """
        r, k = self._loops_and_k(loops, backward_loops)
        pc = self.param_counts()
        total = 6 * pc["once"] + 2 * pc["rec"] * r + 4 * pc["rec"] * k
        if seq_len is not None:
            a = 2 * seq_len * self.cfg.d_model
            total += 6 * a * (self.cfg.prelude + self.cfg.coda) + (2 * r + 4 * k) * a * self.cfg.core
        if include_head:
            total += 6 * self.cfg.d_model * self.cfg.vocab_size
        return float(total)

    # ---- the pass ------------------------------------------------------------------------------
    def _loops_and_k(self, loops, backward_loops) -> tuple[int, int]:
        r = self.cfg.loops if loops is None else loops
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"loops={r!r} is invalid: must be an integer >= 1")
        k = r if backward_loops is None else backward_loops
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= r:
            raise ValueError(f"backward_loops={k!r} is invalid: must be an integer in 1..loops={r}")
        return r, k

    def _rope(self, like: torch.Tensor):
        return self.rotary(like.shape[1], like.dtype, like.device)

    def embed_prelude(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return h0 [B, T, d]: the prelude's output for tokens [B, T]."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        x = self.embed(tokens)
        rope = self._rope(x)
        for blk in self.prelude:
            x = blk(x, rope)
        return x

    @property
    def head_weight(self) -> torch.Tensor:
        """Return the LM head's weight [V, d] (the embedding when tied)."""
        return self.head.weight if self.head is not None else self.embed.weight

    def features(self, state: torch.Tensor) -> torch.Tensor:
        """Return the final-normed coda output [B, T, d] for a loop state: what the LM head reads."""
        rope = self._rope(state)
        x = state
        for blk in self.coda:
            x = blk(x, rope)
        return self.norm(x)

    def readout(self, state: torch.Tensor) -> torch.Tensor:
        """Return logits [B, T, V]: coda, final norm and head applied to a loop state [B, T, d]."""
        return F.linear(self.features(state), self.head_weight)

    def step(self, h: torch.Tensor, h0: torch.Tensor, loop: int, rope, past=(), psi=None,
             gates=None, mods=None) -> torch.Tensor:
        """Return the state after one core pass from state h (loop is 0-based; past = h_{t-1}, h_{t-2}, ...)."""
        x = h
        if self.history is not None and past:
            x = self.history(x, past)
        if self.inject is not None and loop >= self._inject_from:
            x = self.inject(x, h0)
        layer_mods = mods[loop] if mods is not None else None
        for j, blk in enumerate(self.core):
            am, mm = layer_mods[j] if layer_mods is not None else (None, None)
            if self.hyper is None:
                x = blk(x, rope, am, mm)
            else:
                x = self.hyper[j](x, lambda u, blk=blk, am=am, mm=mm: blk.delta(u, rope, am, mm))
        if gates is not None:
            x = h + gates[loop] * (x - h)
        return x

    def reduce(self, h: torch.Tensor) -> torch.Tensor:
        """Return the state the coda reads: h itself, or the mean of the hyper-connection streams."""
        # SPEC §1 (after Zhu et al.) sums the streams; there a final norm follows and the scale does not
        # matter, but here coda blocks follow, and the mean keeps the residual scale, makes state 0 equal
        # h0 and makes an untrained hyper-connected model equal the plain one (the streams start equal).
        return h if self.hyper is None else h.mean(-2)

    def initial_state(self, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (loop state 0, h0 as injections see it): n copies of h0 under hyper-connections."""
        if self.hyper is None:
            return h0, h0
        h0e = h0.unsqueeze(-2)
        return h0e.expand(*h0.shape[:-1], self.cfg.hyper, h0.shape[-1]), h0e

    def loop_conditioning(self, horizon: int, like: torch.Tensor):
        """Return (psi, loop gates, block mods) for a run of `horizon` loops (all None without timesteps)."""
        if self.timestep is None:
            return None, None, None
        psi = timestep_features(horizon, like.device, like.dtype)
        if self.timestep.kind == "loop_gate":
            return psi, self.timestep.loop_gates(psi), None
        return psi, None, self.timestep.block_mods(psi)

    def run_loops(self, h0: torch.Tensor, loops: int, horizon: int | None = None,
                  backward_loops: int | None = None, keep_states: bool = False):
        """Return (final state, list of states 0..r or None) for `loops` core passes from h0 [B, T, d].

        Under truncation (backward_loops=k < loops) the first r-k loops run without a graph and the
        state entering loop r-k+1 is detached; h0 itself keeps its graph, so the prelude still gets
        gradient wherever an injection feeds h0 into the last k loops.
        """
        r, k = self._loops_and_k(loops, backward_loops)
        T = r if horizon is None else horizon
        if self.timestep is not None and T < r:
            raise ValueError(f"horizon={T} is invalid: must be >= loops={r}")
        rope = self._rope(h0)
        psi, gates, mods = self.loop_conditioning(T, h0)
        h, h0 = self.initial_state(h0)
        past: deque = deque(maxlen=self.cfg.history)
        states = [self.reduce(h)] if keep_states else None
        for i in range(r):
            frozen = i < r - k
            if i == r - k and r > k:
                h = h.detach()
                past = deque((p.detach() for p in past), maxlen=self.cfg.history)
            with torch.no_grad() if frozen else nullcontext():
                h_new = self.step(h, h0, i, rope, past, psi, gates, mods)
            if self.history is not None and i >= 1:  # h0 is not in the window
                past.appendleft(h)
            h = h_new
            if keep_states:
                states.append(self.reduce(h))
        return self.reduce(h), states

    def forward(self, tokens: torch.Tensor, loops: int | None = None, targets: torch.Tensor | None = None,
                *, horizon: int | None = None, backward_loops: int | None = None,
                return_logits: bool = True) -> LoopOutput:
        """Return LoopOutput(logits, loss, state) after `loops` core passes (default: the training K).

        `horizon` is the T seen by timestep conditioning (default: loops); `backward_loops` truncates
        backprop to the last k loops. With targets and `return_logits=False` (what a trainer wants) the
        loss comes from a chunked head + cross-entropy that never materialises the logits; `.logits`
        is then None.
        """
        h0 = self.embed_prelude(tokens)
        state, _ = self.run_loops(h0, loops if loops is not None else self.cfg.loops, horizon, backward_loops)
        if targets is not None and not return_logits:
            loss = linear_cross_entropy(self.features(state), self.head_weight, targets)
            return LoopOutput(None, loss, state)
        logits = self.readout(state)
        loss = lm_loss(logits, targets) if targets is not None else None
        return LoopOutput(logits, loss, state)

    def trace(self, tokens: torch.Tensor, loops: int | None = None, *, horizon: int | None = None) -> LoopTrace:
        """Return a LoopTrace holding the states after every loop 0..loops from ONE pass.

        For a model with timestep conditioning, every state is that of a run with T = horizon
        (default: loops), i.e. `trace.logits(r)` equals `forward(loops=r, horizon=loops)`.
        """
        r = loops if loops is not None else self.cfg.loops
        h0 = self.embed_prelude(tokens)
        _, states = self.run_loops(h0, r, horizon, keep_states=True)
        return LoopTrace(self, torch.stack(states), horizon if horizon is not None else r)
