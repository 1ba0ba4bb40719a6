"""LoopLM: Coda . Core^r . Prelude, where one pass to r_max gives the states for every r <= r_max."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LoopConfig, check_int
from .conditioning import (HistoryInjection, InitialInjection, ReentryBridge, TimestepConditioning,
                           timestep_features)
from .flops import flops_per_token
from .generate import generate
from .hyper import HyperConnection
from .layers import Block, RMSNorm, Rotary, linear_cross_entropy
from .taper import mlp_widths


@dataclass
class LoopOutput:
    """What a forward pass returns: logits [B, T, V], the mean loss if targets were given, the final state.

    `cache` holds the named activations asked for with `cache=[patterns]` (empty otherwise).
    """

    logits: torch.Tensor | None
    loss: torch.Tensor | None
    state: torch.Tensor
    cache: dict = field(default_factory=dict)


Hook = Callable[[str, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


class Places:
    """The named places of one pass: which outputs to keep (glob patterns) and which hooks see them.

    A place is a block occurrence, `prelude.{i}`, `core.{t}.{j}` (t the 1-based loop, j the 0-based
    layer in the core), `coda.{i}`, or a loop state, `state.{t}` (`state.0` is h0). A hook is called
    as `fn(name, x_in, x_out)`: x_in is what the occurrence read (for a hyper-connected core layer the
    layer's own input A_m^T H), x_out its output; it returns None to only read, or a tensor of x_out's
    shape that replaces the output (returning x_in skips the occurrence). At `state.{t}` x_in and x_out
    are the carried states before and after loop t (n streams under hyper-connections) and the cache
    keeps their mean, as `LoopTrace.states` does. Hooks apply in the order given; the cache keeps
    what the hooks left. Cached tensors keep their graph when the pass has one.
    """

    def __init__(self, cache: str | Sequence[str] | None = None, hooks: Mapping[str, Hook] | None = None):
        patterns = [cache] if isinstance(cache, str) else list(cache or ())
        for p in patterns:
            if not isinstance(p, str):
                raise ValueError(f"cache={cache!r} is invalid: must be glob patterns of place names (str)")
        if hooks is not None and not isinstance(hooks, Mapping):
            raise ValueError(f"hooks={hooks!r} is invalid: must map glob patterns to callables")
        for p, fn in (hooks or {}).items():
            if not isinstance(p, str) or not callable(fn):
                raise ValueError(f"hooks entry {p!r}: {fn!r} is invalid: must map a glob pattern (str) to a callable")
        self.patterns = patterns
        self.hooks = list((hooks or {}).items())
        self.cache: dict[str, torch.Tensor] = {}
        self._memo: dict[str, tuple[bool, tuple[Hook, ...]]] = {}

    def check(self, names: Sequence[str]) -> None:
        """Return None when every cache and hook pattern names at least one of the pass's places; else ValueError.

        A pattern with a typo, or naming a loop beyond the pass, would otherwise keep or hook nothing silently.
        """
        for kind, pats in (("cache", self.patterns), ("hooks", [p for p, _ in self.hooks])):
            for p in pats:
                if not any(fnmatchcase(n, p) for n in names):
                    shown = ", ".join(names if len(names) <= 12 else [*names[:6], "...", *names[-5:]])
                    raise ValueError(f"{kind} pattern {p!r} names no place of this pass; its places are: {shown} "
                                     "(glob patterns, e.g. 'core.*.0' or 'state.*')")

    def _lookup(self, name: str) -> tuple[bool, tuple[tuple[str, Hook], ...]]:
        hit = self._memo.get(name)
        if hit is None:  # glob matching once per name, not once per call
            hit = (any(fnmatchcase(name, p) for p in self.patterns),
                   tuple((p, fn) for p, fn in self.hooks if fnmatchcase(name, p)))
            self._memo[name] = hit
        return hit

    def __call__(self, name: str, x_in: torch.Tensor, x_out: torch.Tensor,
                 keep: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Return the output at place `name` after its hooks, caching it when asked for."""
        want, fns = self._lookup(name)
        for pattern, fn in fns:
            y = fn(name, x_in, x_out)
            if y is not None:
                if not isinstance(y, torch.Tensor) or y.shape != x_out.shape or y.dtype != x_out.dtype:
                    got = (f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__)
                    raise ValueError(f"hook {pattern!r} at {name} returned {got}: must return None or a tensor of "
                                     f"the output's shape {tuple(x_out.shape)} and dtype {x_out.dtype}")
                x_out = y
        if want:
            self.cache[name] = x_out if keep is None else keep(x_out)
        return x_out


@dataclass
class LoopContext:
    """What every loop of one pass shares: h0 as injections see it, rotary tables, timestep terms, places."""

    h0: torch.Tensor
    rope: tuple
    gates: torch.Tensor | None = None
    mods: list | None = None
    places: Places | None = None
    kv: object = None  # the key/value cache during cached generation (models.kv_cache.KVCache)


@dataclass
class LoopStart:
    """Where a pass may start instead of at the tokens: h0 and the carried states 0..S of an earlier pass."""

    h0: torch.Tensor
    carried: list

    def repeat(self, m: int) -> "LoopStart":
        """Return this start with every tensor repeated m times along the batch."""
        def rep(x):
            return None if x is None else x.repeat(m, *([1] * (x.dim() - 1)))
        return LoopStart(rep(self.h0), [rep(c) for c in self.carried])


@dataclass
class LoopPass:
    """One pass through prelude and loops: h0, the carried states (None where not kept), the coda features.

    `carried[t]` is the state after loop t as the loop carries it (n streams under hyper-connections);
    without `keep_states` only those the history window still needs are kept.
    """

    model: "LoopLM"
    h0: torch.Tensor
    carried: list
    horizon: int
    places: Places | None
    features: torch.Tensor | None = None

    @property
    def state(self) -> torch.Tensor:
        """Return the final state [B, T, d] (the mean of the streams under hyper-connections)."""
        return self.model.reduce(self.carried[-1])

    @property
    def states(self) -> list[torch.Tensor]:
        """Return the states 0..r [B, T, d] (needs keep_states)."""
        if any(c is None for c in self.carried):
            raise ValueError("this pass did not keep its states: run it with keep_states=True")
        return [self.model.reduce(c) for c in self.carried]

    @property
    def cache(self) -> dict[str, torch.Tensor]:
        """Return the named activations kept by this pass."""
        return {} if self.places is None else self.places.cache

    def start(self, loop: int) -> LoopStart:
        """Return a LoopStart after `loop` loops of this pass (needs the states it kept)."""
        if any(c is None for c in self.carried[:loop + 1]):
            raise ValueError("this pass did not keep its states: run it with keep_states=True")
        return LoopStart(self.h0, self.carried[:loop + 1])


class LoopTrace:
    """Every loop state of one pass: `states[t]` is the state after loop t (`states[0]` is h0).

    `cache` holds the named activations asked for with `trace(..., cache=[patterns])`; the coda's
    places (and hooks) act each time `logits(r)` or `features(r)` reads a state out.
    """

    def __init__(self, model: "LoopLM", states: torch.Tensor, horizon: int, places: Places | None = None):
        self.model = model
        self.states = states  # [r_max + 1, B, T, d]
        self.horizon = horizon  # T used by timestep conditioning (equals r_max unless given)
        self.places = places

    @property
    def cache(self) -> dict[str, torch.Tensor]:
        """Return the named activations kept by this trace."""
        return {} if self.places is None else self.places.cache

    @property
    def max_loops(self) -> int:
        """Return r_max, the number of loops this trace ran."""
        return self.states.shape[0] - 1

    def _check(self, r: int) -> None:
        if not isinstance(r, int) or not 1 <= r <= self.max_loops:
            raise ValueError(f"loops={r!r} is invalid: this trace holds loops 1..{self.max_loops}")

    def features(self, r: int) -> torch.Tensor:
        """Return the final-normed coda output [B, T, d] for the state after loop r."""
        self._check(r)
        return self.model.features(self.states[r], self.places)

    def logits(self, r: int) -> torch.Tensor:
        """Return the logits [B, T, V] of coda + head applied to the state after loop r."""
        return F.linear(self.features(r), self.model.head_weight)

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
        # True once a caller (the Trainer) has checked every token id of its data where the data was made:
        # then a forward on an accelerator skips the per-call range check, which costs a host-device sync
        self.ids_checked_upstream = False
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
            # a retrofit (SPEC §5) keeps loop 1 the base model: the bridge and the block's adapters act from
            # loop 2 on (0-based loop 1), so no training can change the one-loop path (without adapters the
            # flag stays True: a compiled Block then needs no second graph for loop 1)
            self._inject_from = 1 if cfg.inject == "bridge" else 0
            self._adapt_from = 1 if cfg.inject == "bridge" and cfg.adapter_rank else 0
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

        Attention adds 4 * seq_len * d per layer occurrence forward (the full T x T score and value
        products, as Hoffmann et al. count them), twice that backward, when `seq_len` is given;
        `include_head` adds 6 d V for the LM head.
        """
        r, k = self._loops_and_k(loops, backward_loops)
        pc, c = self.param_counts(), self.cfg
        return float(flops_per_token(pc["once"], pc["rec"], r, k, seq_len=seq_len, d_model=c.d_model,
                                     layers_once=c.prelude + c.coda, layers_rec=c.core,
                                     head_params=c.d_model * c.vocab_size if include_head else 0))

    # ---- the pass ------------------------------------------------------------------------------
    def _loops_and_k(self, loops, backward_loops) -> tuple[int, int]:
        r = check_int("loops", self.cfg.loops if loops is None else loops, 1)
        k = check_int("backward_loops", r if backward_loops is None else backward_loops, 1, r,
                      allowed=f"must be an integer in 1..loops={r}")
        return r, k

    def _rope(self, like: torch.Tensor, kv=None):
        if kv is not None:  # cached generation: the tables at the new tokens' own positions
            return kv.rope(self.rotary, like)
        return self.rotary(like.shape[1], like.dtype, like.device)

    def block_patterns(self) -> tuple[str, ...]:
        """Return the glob patterns of every block occurrence of a pass, one per part the model has."""
        return tuple(f"{part}.*" for part in ("prelude", "core", "coda") if getattr(self.cfg, part))

    def place_names(self, loops: int) -> list[str]:
        """Return the names of every block occurrence of a pass with `loops` loops, in call order."""
        c = self.cfg
        return ([f"prelude.{i}" for i in range(c.prelude)]
                + [f"core.{t}.{j}" for t in range(1, loops + 1) for j in range(c.core)]
                + [f"coda.{i}" for i in range(c.coda)])

    def _check_tokens(self, tokens: torch.Tensor, name: str = "tokens", ignore: int | None = None) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.numel() == 0:
            raise ValueError(f"{name} must be a non-empty [batch, seq] tensor of token ids, got "
                             f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"{name} dtype={tokens.dtype} is invalid: token ids must be an integer tensor (torch.long)")
        if torch.compiler.is_compiling():
            return  # a data-dependent check would break the compiled graph; eager calls checked the ids
        if self.ids_checked_upstream and tokens.device.type != "cpu":
            return  # the caller checked its whole token stream once; on an accelerator this check is a sync
        # one reduction and one sync: an id outside the vocabulary otherwise fails deep inside an embedding
        ids = tokens if ignore is None else tokens[tokens != ignore]
        if ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(ids))
            V = self.cfg.vocab_size
            if lo < 0 or hi >= V:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{name} holds token id {bad}, outside the vocabulary: ids must be in 0..{V - 1} "
                                 f"(vocab_size={V})" + (f"; {ignore} marks ignored positions" if ignore is not None else ""))

    def embed_prelude(self, tokens: torch.Tensor, places: Places | None = None, kv=None) -> torch.Tensor:
        """Return h0 [B, T, d]: the prelude's output for tokens [B, T] (the new tokens of a `kv` cache)."""
        self._check_tokens(tokens)
        x = self.embed(tokens)
        rope = self._rope(x, kv)
        for i, blk in enumerate(self.prelude):
            e = None if kv is None else kv.at(f"prelude.{i}")
            x = blk(x, rope, kv=e) if places is None else places(f"prelude.{i}", x, blk(x, rope, kv=e))
        return x

    @property
    def head_weight(self) -> torch.Tensor:
        """Return the LM head's weight [V, d] (the embedding when tied)."""
        return self.head.weight if self.head is not None else self.embed.weight

    def features(self, state: torch.Tensor, places: Places | None = None, kv=None) -> torch.Tensor:
        """Return the final-normed coda output [B, T, d] for a loop state: what the LM head reads.

        With a `kv` cache the coda writes its keys and values at the new positions (a later readout of
        the same positions overwrites them; the cache keeps the last).
        """
        rope = self._rope(state, kv)
        x = state
        for i, blk in enumerate(self.coda):
            e = None if kv is None else kv.at(f"coda.{i}")
            x = blk(x, rope, kv=e) if places is None else places(f"coda.{i}", x, blk(x, rope, kv=e))
        return self.norm(x)

    def readout(self, state: torch.Tensor, places: Places | None = None, kv=None) -> torch.Tensor:
        """Return logits [B, T, V]: coda, final norm and head applied to a loop state [B, T, d]."""
        return F.linear(self.features(state, places, kv), self.head_weight)

    def context(self, h0: torch.Tensor, horizon: int, places: Places | None = None, kv=None) -> LoopContext:
        """Return the LoopContext every loop of a `horizon`-loop pass from h0 [B, T, d] shares."""
        _, gates, mods = self.loop_conditioning(horizon, h0)
        return LoopContext(self.initial_state(h0)[1], self._rope(h0, kv), gates, mods, places, kv)

    def window(self, carried: Sequence[torch.Tensor], t: int) -> tuple[torch.Tensor, ...]:
        """Return the history window entering 0-based loop t: (h_{t-1}, ..., h_{t-m}), m = min(w, max(t-1, 0)).

        h0 is never in the window (SPEC §1); `carried[i]` is the state after loop i.
        """
        if self.history is None:
            return ()
        return tuple(carried[t - j] for j in range(1, min(self.cfg.history, max(t - 1, 0)) + 1))

    def step(self, h: torch.Tensor, t: int, ctx: LoopContext, past: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """Return the carried state after 0-based loop t from state h (past: `window(carried, t)`)."""
        x = h
        if self.history is not None and past:
            x = self.history(x, past)
        if self.inject is not None and t >= self._inject_from:
            x = self.inject(x, ctx.h0)
        rope, places, kv = ctx.rope, ctx.places, ctx.kv
        adapt = t >= self._adapt_from  # False only on a retrofit's loop 1 (see __init__)
        layer_mods = ctx.mods[t] if ctx.mods is not None else None
        for j, blk in enumerate(self.core):
            am, mm = layer_mods[j] if layer_mods is not None else (None, None)
            e = None if kv is None else kv.at(f"core.{t + 1}.{j}")
            if places is None:  # the hot path: no names, no hooks
                if self.hyper is None:
                    x = blk(x, rope, am, mm, e, adapt)
                else:
                    x = self.hyper[j](x, lambda u, blk=blk, am=am, mm=mm, e=e: blk.delta(u, rope, am, mm, e, adapt))
                continue
            name = f"core.{t + 1}.{j}"
            if self.hyper is None:
                x = places(name, x, blk(x, rope, am, mm, e, adapt))
            else:
                x = self.hyper[j](x, lambda u, blk=blk, am=am, mm=mm, name=name, e=e:
                                  _hooked_delta(places, name, u, blk.delta(u, rope, am, mm, e, adapt)))
        if ctx.gates is not None:
            x = h + ctx.gates[t] * (x - h)
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

    def run(self, tokens: torch.Tensor | None = None, loops: int | None = None, *, horizon: int | None = None,
            backward_loops: int | None = None, keep_states: bool = False, cache=None, hooks=None,
            coda: bool = False, start: LoopStart | None = None, kv=None, halt=None) -> LoopPass:
        """Return the LoopPass of prelude, `loops` core passes and (with `coda`) the coda: THE loop.

        Every consumer (forward, trace, per-loop losses, probes, decoders) goes through here.
        `cache` (glob patterns) and `hooks` ({pattern: fn}) name places to keep or hook (see Places).
        `kv` (a models.kv_cache.KVCache opened for these tokens) makes `tokens` the new tokens of a
        cached sequence: every block occurrence (prelude.i, core.t.j, coda.i) stores its keys and values
        in its own entry and attends over the cached positions. `halt(t, h_prev, h) -> (h, stop)` is
        called after loop t (adaptive exit): it may replace the state (freeze exited rows) and ends the
        loop early when `stop` is true. `start` resumes an earlier pass after S loops instead of starting
        from tokens. Under truncation (backward_loops=k < loops) the first r-k loops run without a graph
        and the state entering loop r-k+1 (and the history window) is detached; h0 keeps its graph, so
        the prelude still gets gradient wherever an injection feeds h0 into the last k loops.
        """
        r, k = self._loops_and_k(loops, backward_loops)
        T = r if horizon is None else horizon
        if self.timestep is not None and (isinstance(T, bool) or not isinstance(T, int) or T < r):
            raise ValueError(f"horizon={T!r} is invalid: must be an integer >= loops={r}")
        places = Places(cache, hooks) if cache or hooks else None
        if places is not None:
            places.check(self.place_names(r) + [f"state.{t}" for t in range(r + 1)])
        if kv is not None and start is not None:
            raise ValueError("start and kv cannot be combined: a cached pass starts from its new tokens")
        if start is None:
            h0 = self.embed_prelude(tokens, places, kv)
            h = self.initial_state(h0)[0]
            carried = [h if places is None else places("state.0", h, h, self.reduce)]
        else:
            if not isinstance(start, LoopStart) or not 1 <= len(start.carried) <= r + 1:
                raise ValueError(f"start={start!r} is invalid: must be a LoopStart holding 1..{r + 1} states")
            h0, carried = start.h0, list(start.carried)
        ctx = self.context(h0, T, places, kv)
        w = self.cfg.history
        for t in range(len(carried) - 1, r):
            if t == r - k and r > k:
                for i in (t, *range(max(t - w, 1), t)):
                    carried[i] = carried[i].detach()
            with torch.no_grad() if t < r - k else nullcontext():
                h = self.step(carried[t], t, ctx, self.window(carried, t))
            stop = False
            if halt is not None:
                h, stop = halt(t + 1, carried[t], h)
            if places is not None:
                h = places(f"state.{t + 1}", carried[t], h, self.reduce)
            carried.append(h)
            if not keep_states and t - w >= 0:
                carried[t - w] = None  # no later loop reads it: let it go
            if stop:
                break
        out = LoopPass(self, h0, carried, T, places)
        if coda:
            out.features = self.features(out.state, places, kv)
        return out

    def forward(self, tokens: torch.Tensor, loops: int | None = None, targets: torch.Tensor | None = None,
                *, labels: torch.Tensor | None = None, label_weights: torch.Tensor | None = None,
                horizon: int | None = None, backward_loops: int | None = None, return_logits: bool = True,
                cache=None, hooks=None) -> LoopOutput:
        """Return LoopOutput(logits, loss, state, cache) after `loops` core passes (default: the training K).

        `horizon` is the T seen by timestep conditioning (default: loops); `backward_loops` truncates
        backprop to the last k loops. With targets and `return_logits=False` (what a trainer wants) the
        loss comes from a chunked head + cross-entropy that never materialises the logits; `.logits`
        is then None. With `labels` [B, loops, T] (per-loop supervision) the loss is `per_loop_loss`'s
        and loops = labels.shape[1]; `label_weights` is None, [loops] or [B, loops].
        """
        if labels is not None:
            if targets is not None:
                raise ValueError("give targets (next-token loss) or labels (per-loop supervision), not both")
            r = self._check_labels(tokens, labels, loops)
            p = self.run(tokens, r, horizon=horizon, backward_loops=backward_loops, keep_states=True,
                         cache=cache, hooks=hooks)
            return LoopOutput(None, self._per_loop_loss(p, labels, label_weights), p.state, p.cache)
        p = self.run(tokens, loops, horizon=horizon, backward_loops=backward_loops, cache=cache, hooks=hooks,
                     coda=True)
        if targets is not None:
            self._check_tokens(targets, "targets", ignore=-100)
            if targets.shape != tokens.shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} is invalid: must equal the tokens' shape "
                                 f"{tuple(tokens.shape)} (the next token at every position)")
        if targets is not None and not return_logits:
            loss = linear_cross_entropy(p.features, self.head_weight, targets)
            return LoopOutput(None, loss, p.state, p.cache)
        logits = F.linear(p.features, self.head_weight)
        loss = lm_loss(logits, targets) if targets is not None else None
        return LoopOutput(logits, loss, p.state, p.cache)

    def trace(self, tokens: torch.Tensor, loops: int | None = None, *, horizon: int | None = None,
              cache=None, hooks=None) -> LoopTrace:
        """Return a LoopTrace holding the states after every loop 0..loops from ONE pass.

        For a model with timestep conditioning, every state is that of a run with T = horizon
        (default: loops), i.e. `trace.logits(r)` equals `forward(loops=r, horizon=loops)`.
        `cache` and `hooks` name places to keep or hook (see Places); `trace.cache[name]` reads them.
        """
        p = self.run(tokens, loops, horizon=horizon, keep_states=True, cache=cache, hooks=hooks)
        return LoopTrace(self, torch.stack(p.states), p.horizon, p.places)

    def generate(self, tokens, max_new_tokens: int, loops: int | None = None, exit=None, **kw):
        """Return the prompts followed by up to max_new_tokens new tokens, decoded with a key/value cache.

        `loops=r` fixes the loop count; `exit=ExitRule(...)` (or "kl", "state") exits per token, with
        loops as r_max. Keywords: temperature, top_k, top_p, seed, stop, mask, horizon, pad_id, details
        (see workbench.models.generate.generate).
        """
        return generate(self, tokens, max_new_tokens, loops, exit, **kw)

    # ---- per-loop supervision --------------------------------------------------------------------
    def _check_labels(self, tokens: torch.Tensor, labels: torch.Tensor, loops: int | None) -> int:
        if (not isinstance(labels, torch.Tensor) or labels.dim() != 3 or labels.shape[0] != tokens.shape[0]
                or labels.shape[2] != tokens.shape[1]):
            raise ValueError(f"labels shape {tuple(getattr(labels, 'shape', ()))} is invalid: must be "
                             f"[batch, loops, seq] = [{tokens.shape[0]}, loops, {tokens.shape[1]}]")
        r = labels.shape[1]
        if labels.numel():  # ids outside the vocabulary are named here, not by cross-entropy
            self._check_tokens(labels.reshape(labels.shape[0], -1), "labels", ignore=-100)
        if loops is not None and loops != r:
            raise ValueError(f"loops={loops!r} is invalid with labels for {r} loops: leave it None or give {r}")
        return r

    def _per_loop_loss(self, p: LoopPass, labels: torch.Tensor, weights) -> torch.Tensor:
        B, r = labels.shape[:2]
        w = torch.ones(r) if weights is None else torch.as_tensor(weights, dtype=torch.float32).cpu()
        if w.shape not in ((r,), (B, r)):
            raise ValueError(f"weights shape {tuple(w.shape)} is invalid: must be [{r}] (one per loop) or "
                             f"[{B}, {r}] (one per example and loop)")
        pairs = w.dim() == 2
        states = p.states
        # where the labels are, read back once: a boolean index on the device would wait for it at every loop
        keep_all = (labels != -100).cpu()
        total, norm = labels.new_zeros((), dtype=torch.float32), 0.0
        for t in range(1, r + 1):
            keep = keep_all[:, t - 1]
            wt = w[:, t - 1] * keep.any(1) if pairs else w[t - 1]
            if not (wt != 0).any() or not keep.any():
                continue
            # the same positions, in the same order, as indexing by the mask
            rows, cols = (i.to(labels.device) for i in keep.nonzero(as_tuple=True))
            lab = labels[:, t - 1][rows, cols]
            # the head only at labelled positions: answers are a few tokens, the vocabulary may be 50k wide
            logits = F.linear(self.features(states[t], p.places)[rows, cols], self.head_weight)
            if not pairs:
                total = total + wt * lm_loss(logits[None], lab[None])
                norm += float(wt)
                continue
            ce = F.cross_entropy(logits.float(), lab, reduction="none")
            per_pair = torch.zeros(B, device=ce.device).index_add(0, rows, ce)
            count = torch.zeros(B, device=ce.device).index_add(0, rows, torch.ones_like(ce)).clamp(min=1)
            total = total + (wt.to(ce.device) * per_pair / count).sum()
            norm += float(wt.sum())
        if norm == 0:
            raise ValueError("labels carry no label at any loop with non-zero weight")
        return total / norm


def _hooked_delta(places: Places, name: str, u: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Return a hyper-connected layer's update after the hooks at `name` saw its output u + delta."""
    out = u + delta
    y = places(name, u, out)
    return delta if y is out else y - u
