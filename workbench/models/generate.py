"""Generation from a looped model: a key/value cache per block occurrence, sampling, adaptive exit per token.

`generate(model, tokens, max_new_tokens, loops=r | exit=rule, ...)` (also `LoopLM.generate`) returns
the prompt followed by the new tokens. A new token costs one pass of its own: `LoopLM.run(..., kv=cache)`
runs the one loop pass on the new tokens only, and every block occurrence of that pass (`prelude.i`,
`core.t.j`, `coda.i`, the names of `LoopLM.place_names`) keeps its keys and values in its own
`KVEntry`, so loop t of a new token attends to loop t of the tokens before it. The prompt is one pass
(prefill) at the full loop count; then one pass per new token.

Batched prompts of different lengths are left-padded: a padded position is never attended to, and
each row's rotary positions count its own tokens only, so a row of a batch equals its prompt alone.
With timestep conditioning the horizon T is the loop count used (r, or r_max under an exit rule).

Adaptive exit per token (`ExitRule`): after loop t >= min_loops a token exits when its criterion is
strictly below the threshold, else at r_max = `loops`:
- "kl": KL(p_t || p_{t-1}) between successive loops' next-token distributions (p_0 reads out the
  prelude output), as the halting probe measures it (Huginn's rule; Huginn writes the other direction);
- "state": the relative state change |h_t - h_{t-1}| / max(|h_{t-1}|, eps) (Huginn's latent rule);
- "gate": the learned gate's probability of still looping, prod_{j<=t} (1 - lambda_j) = 1 - CDF(t)
  (Ouro exits when the CDF reaches a quantile q: threshold = 1 - q).
Threshold 0 never exits early (every criterion is >= 0): fixed r_max. An infinite threshold exits at
loop `min_loops`. Under an exit rule every token the model reads exits by it, the prompt's too, so the
prompt is read token by token (a token's exit changes what later tokens attend to, and a parallel pass
cannot know it in advance); with fixed loops the prompt is one pass. (Huginn instead reads the prompt
at r_max; then threshold infinity would not reduce to r = 1.)

Skipped loops (Huginn's choice, tested): a token that exits after loop e leaves, in the entries of
every later loop t > e, a copy of its loop-e keys and values, so a following token's loop t attends
to the last loop the earlier token computed. Rows of a batch exit independently; rows that exited keep
their state while the others go on, and the pass stops as soon as every row has exited.

`ExitGate` is Ouro's exit head: lambda_t = sigmoid(w . rms(h_t) + b) on the loop state, with the exit
distribution `exit_distribution` (p_t = lambda_t prod_{j<t} (1 - lambda_j), the rest at r_max) and
`gate_objective` (expected loss over exit steps minus beta times the distribution's entropy). Its
training loop on a frozen model is `workbench.experiments.generate.train_exit_gate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import check_float, check_int, fail
from .kv_cache import KVCache, KVEntry  # noqa: F401 (KVEntry: public here too)

RULES = ("kl", "state", "gate")
DEFAULT_THRESHOLD = {"kl": 1e-3, "state": 1e-2, "gate": 0.5}  # used when ExitRule gets none
EPS = 1e-12


# ---- exit rules and the learned gate ---------------------------------------------------------------------------
class ExitGate(nn.Module):
    """Ouro's exit head: lambda_t = sigmoid(w . rms(h_t) + b), the probability of exiting after loop t.

    w and b start at zero (lambda = 1/2 at every loop). It reads the loop state as the coda does (the
    mean of the streams under hyper-connections).
    """

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.d_model = check_int("d_model", d_model, 1)
        self.eps = eps
        self.proj = nn.Linear(d_model, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        """Return lambda [...] in (0, 1) for states [..., d_model]."""
        x = F.rms_norm(state.float(), (state.shape[-1],), eps=self.eps)
        return torch.sigmoid(self.proj(x).squeeze(-1))


def exit_distribution(lam: torch.Tensor) -> torch.Tensor:
    """Return p [..., R]: p_t = lambda_t prod_{j<t} (1 - lambda_j) for t < R, p_R the rest (sums to 1).

    lam [..., R] holds the gate's lambda after loops 1..R (lambda_R is not used: loop R always exits).
    """
    survive = torch.cumprod(1 - lam, dim=-1)  # prod_{j<=t} (1 - lambda_j)
    before = torch.cat([torch.ones_like(lam[..., :1]), survive[..., :-1]], dim=-1)
    return torch.cat([(before * lam)[..., :-1], before[..., -1:]], dim=-1)


def gate_objective(lam: torch.Tensor, losses: torch.Tensor, beta: float = 0.05) -> torch.Tensor:
    """Return mean over tokens of sum_t p_t L_t - beta H(p): Ouro's expected loss with an entropy bonus.

    lam, losses [N, R]: the gate's lambda and the token's next-token loss after loops 1..R.
    """
    p = exit_distribution(lam)
    entropy = -(p * p.clamp_min(EPS).log()).sum(-1)
    return ((p * losses).sum(-1) - beta * entropy).mean()


@dataclass(frozen=True)
class ExitRule:
    """When a token stops looping: after loop t >= min_loops once `rule`'s criterion < threshold.

    rule: "kl", "state" or "gate" (see the module docstring); threshold >= 0 (inf allowed; default
    DEFAULT_THRESHOLD[rule]); gate: the trained ExitGate, needed by rule="gate".
    """

    rule: str
    threshold: float | None = None
    min_loops: int = 1
    gate: ExitGate | None = None

    def __post_init__(self):
        if self.rule not in RULES:
            fail("rule", self.rule, f"must be one of {', '.join(RULES)}")
        thr = DEFAULT_THRESHOLD[self.rule] if self.threshold is None else self.threshold
        object.__setattr__(self, "threshold", check_float("threshold", thr, 0, finite=False))
        check_int("min_loops", self.min_loops, 1)
        if self.rule == "gate" and not isinstance(self.gate, ExitGate):
            fail("gate", self.gate, "rule='gate' needs the trained ExitGate (gate=...)")
        if self.rule != "gate" and self.gate is not None:
            fail("gate", self.gate, f"is only used by rule='gate', not rule={self.rule!r}")


def as_exit_rule(exit) -> ExitRule | None:
    """Return exit as an ExitRule (None stays None; a rule name gets its default threshold), else fail."""
    if exit is None or isinstance(exit, ExitRule):
        return exit
    if isinstance(exit, str):
        if exit not in RULES:
            fail("exit", exit, f"must be an ExitRule or one of the rules {', '.join(RULES)}")
        return ExitRule(exit)
    fail("exit", exit, "must be None (fixed loops), an ExitRule or a rule name (kl, state, gate)")


class _Halt:
    """The `halt` callback of one decode pass: freezes rows that exited and says when all have."""

    def __init__(self, model, kv: KVCache, rule: ExitRule, max_loops: int, done: torch.Tensor):
        self.model, self.kv, self.rule, self.max_loops = model, kv, rule, max_loops
        self.done = done.clone()  # rows already finished (stopped) count as exited, at loop 0
        self.exit = torch.full(done.shape, max_loops, dtype=torch.long, device=done.device).masked_fill(done, 0)
        self.logits = None  # the readout at the last loop run (kl): each row's readout at its exit loop
        self.prev = None
        self.survive = torch.ones(done.shape, device=done.device) if rule.rule == "gate" else None
        self.start_at = 1 if rule.rule != "kl" else max(rule.min_loops - 1, 0)  # kl needs p_{t-1}

    def _logp(self, h: torch.Tensor) -> torch.Tensor:
        self.logits = self.model.readout(self.model.reduce(h), kv=self.kv)[:, -1].float()
        return F.log_softmax(self.logits, dim=-1)

    def __call__(self, t: int, h_prev: torch.Tensor, h: torch.Tensor):
        done, rule = self.done, self.rule
        if bool(done.any()):  # exited rows keep the state of their exit loop
            h = torch.where(done.view(-1, *([1] * (h.dim() - 1))), h_prev, h)
        crit = None
        if rule.rule == "kl":
            if t == 1 and self.start_at == 0:
                self.prev = self._logp(h_prev)
            if t >= self.start_at or t == self.max_loops:
                lp = self._logp(h)
                if self.prev is not None:
                    crit = (lp.exp() * (lp - self.prev)).sum(-1)
                self.prev = lp
        elif rule.rule == "state":
            a, b = self.model.reduce(h_prev)[:, -1].float(), self.model.reduce(h)[:, -1].float()
            crit = (b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(EPS)
        else:
            lam = rule.gate(self.model.reduce(h)[:, -1])
            self.survive = torch.where(done, self.survive, self.survive * (1 - lam))
            crit = self.survive
        if t >= self.max_loops:
            new = ~done
        elif t >= rule.min_loops and crit is not None:
            new = ~done & (crit < rule.threshold)
        else:
            new = torch.zeros_like(done)
        self.exit = torch.where(new, t, self.exit)
        self.done = done | new
        return h, bool(self.done.all())


# ---- generation ----------------------------------------------------------------------------------------------
@dataclass
class Generation:
    """What `generate(..., details=True)` returns.

    tokens [B, T + n]: the (left-padded) prompts followed by the new tokens (`pad_id` after a stop);
    keep [B, T + n]: True at real tokens (prompt tokens and new tokens up to and including a stop);
    loops [B, n]: core loops each new token's prediction used (0 after a stop); prompt_len: T.
    """

    tokens: torch.Tensor
    keep: torch.Tensor
    loops: torch.Tensor
    prompt_len: int

    @property
    def new_tokens(self) -> torch.Tensor:
        """Return the generated tokens [B, n]."""
        return self.tokens[:, self.prompt_len:]

    @property
    def mean_loops(self) -> float:
        """Return the mean loops per generated token (over tokens before a stop)."""
        used = self.loops[self.loops > 0]
        return float(used.float().mean()) if used.numel() else float("nan")


def _prompts(model, tokens, mask, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (tokens [B, T], keep [B, T]) from a tensor (+ left-padding mask) or a list of prompts."""
    V = model.cfg.vocab_size
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dim() != 2 or tokens.numel() == 0:
            fail("tokens", tuple(tokens.shape), "must be a non-empty [batch, seq] tensor or a list of prompts")
        x = tokens
        if mask is None:
            keep = torch.ones(x.shape, dtype=torch.bool)
        else:
            keep = torch.as_tensor(mask)
            if keep.shape != x.shape:
                fail("mask", tuple(keep.shape), f"must have the tokens' shape {tuple(x.shape)}")
            keep = keep.bool().cpu()
            # left padding: once a row's tokens begin, they run to the end
            if bool((keep[:, :-1] & ~keep[:, 1:]).any()):
                fail("mask", "a padded position after a token", "must be left padding (False before a row's "
                     "tokens, True from its first token to the end)")
            if not bool(keep[:, -1].all()):
                fail("mask", "a row without tokens", "must keep at least one token in every row")
    else:
        if mask is not None:
            fail("mask", "given with a list of prompts", "is only for a padded tensor (lists are padded here)")
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not tokens:
            fail("tokens", type(tokens).__name__, "must be a [batch, seq] tensor or a non-empty list of prompts")
        rows = [torch.as_tensor(p).flatten() for p in tokens]
        if any(r.numel() == 0 for r in rows):
            fail("tokens", "an empty prompt", "every prompt needs at least one token")
        T = max(r.numel() for r in rows)
        x = torch.full((len(rows), T), pad_id, dtype=torch.long)
        keep = torch.zeros(len(rows), T, dtype=torch.bool)
        for b, r in enumerate(rows):
            x[b, T - r.numel():] = r
            keep[b, T - r.numel():] = True
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.dtype.is_complex:
        fail("tokens", f"dtype {x.dtype}", "token ids must be integers")
    real = x[keep.to(x.device)]
    lo, hi = int(real.min()), int(real.max())
    if lo < 0 or hi >= V:
        fail("tokens", f"holding id {lo if lo < 0 else hi}", f"ids must be in 0..{V - 1} (vocab_size={V})")
    return x.to(device=device, dtype=torch.long), keep.to(device)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Return next tokens [B] from logits [B, V]: argmax at temperature 0, else top-k / top-p sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        srt, idx = logits.sort(dim=-1, descending=True)
        probs = srt.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_stop(stop, V: int) -> list[int]:
    if stop is None:
        return []
    items = [stop] if not isinstance(stop, (list, tuple, set, frozenset)) else list(stop)
    for s in items:
        check_int("stop", s, 0, V - 1, allowed=f"must be a token id in 0..{V - 1} or a list of them")
    return [int(s) for s in items]


@torch.no_grad()
def generate(model, tokens, max_new_tokens: int, loops: int | None = None, exit=None, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop=None, mask: torch.Tensor | None = None, horizon: int | None = None, pad_id: int = 0,
             details: bool = False):
    """Return the prompts followed by up to max_new_tokens new tokens [B, T + n] (a Generation with details).

    tokens: a [B, T] tensor (with `mask` [B, T], False at left padding), a 1-D tensor or a list of
    prompts of any lengths (left-padded here with pad_id). loops: r, the fixed loop count (default the
    training K), or r_max with `exit` (an ExitRule or a rule name). temperature 0 is greedy; otherwise
    top_k / top_p (in (0, 1]) filter and a torch.Generator seeded with `seed` samples. stop: a token id or
    ids ending a row (kept in the output; pad_id after it); generation ends when every row stopped.
    horizon: T of timestep conditioning (default: loops).
    """
    # looped.py imports this module (LoopLM.generate), so the model is recognised by what a pass needs
    # rather than by class: importing LoopLM here would close an import circle
    if not (isinstance(model, nn.Module) and callable(getattr(model, "run", None))
            and hasattr(model, "cfg") and hasattr(model, "place_names")):
        fail("model", type(model).__name__, "must be a LoopLM")
    cfg = model.cfg
    n_new = check_int("max_new_tokens", max_new_tokens, 0)
    r = check_int("loops", cfg.loops if loops is None else loops, 1)
    rule = as_exit_rule(exit)
    if rule is not None and rule.min_loops > r:
        fail("min_loops", rule.min_loops, f"must be <= loops={r} (the most loops a token may use)")
    if rule is not None and rule.gate is not None and rule.gate.d_model != cfg.d_model:
        fail("gate", f"ExitGate(d_model={rule.gate.d_model})", f"must read states of d_model={cfg.d_model}")
    temperature = check_float("temperature", temperature, 0)
    if top_k is not None:
        check_int("top_k", top_k, 1)
    if top_p is not None:
        check_float("top_p", top_p, 0, 1, lo_open=True)
    check_int("seed", seed)
    stops = _check_stop(stop, cfg.vocab_size)
    check_int("pad_id", pad_id, 0, cfg.vocab_size - 1)
    if horizon is not None:
        if model.horizon_dependent:
            check_int("horizon", horizon, r, allowed=f"must be an integer >= loops={r}")
        else:
            fail("horizon", horizon, "only a timestep-conditioned model has a horizon (leave it None)")
    dev = model.embed.weight.device
    x, keep = _prompts(model, tokens, mask, pad_id, dev)
    B, T = x.shape
    longest = int(keep.sum(1).max())
    if longest > cfg.max_seq_len:
        fail("tokens", f"a prompt of {longest} tokens", f"is longer than the context max_seq_len={cfg.max_seq_len}")
    if longest + n_new > cfg.max_seq_len:
        fail("max_new_tokens", n_new, f"a prompt of {longest} tokens + {n_new} new ones exceeds the context "
             f"max_seq_len={cfg.max_seq_len}")

    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    stop_ids = torch.tensor(stops, device=dev, dtype=torch.long)
    out = torch.full((B, T + n_new), pad_id, dtype=torch.long, device=dev)
    out[:, :T] = x
    out_keep = torch.zeros(B, T + n_new, dtype=torch.bool, device=dev)
    out_keep[:, :T] = keep
    used = torch.zeros(B, n_new, dtype=torch.long, device=dev)
    was_training = model.training
    model.eval()
    try:
        kv = KVCache(B, max(T + n_new - 1, T), dev)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        if n_new == 0:
            pass
        elif rule is None:  # the prompt in one pass
            logits, used_now = decode_step(model, kv, x, keep, r, None, horizon)
        else:  # every token the model reads exits by the rule: the prompt token by token (padding exits at once)
            for i in range(T):
                logits, used_now = decode_step(model, kv, x[:, i:i + 1], keep[:, i:i + 1], r, rule, horizon,
                                               ~keep[:, i])
        for i in range(n_new):
            nxt = sample(logits, temperature, top_k, top_p, gen)
            nxt = torch.where(finished, pad_id, nxt)
            out[:, T + i] = nxt
            out_keep[:, T + i] = ~finished
            used[:, i] = torch.where(finished, 0, used_now)
            if stops:
                finished = finished | torch.isin(nxt, stop_ids)
            if i == n_new - 1 or bool(finished.all()):
                break
            logits, used_now = decode_step(model, kv, nxt[:, None], torch.ones(B, 1, dtype=torch.bool, device=dev),
                                           r, rule, horizon, finished)
    finally:
        model.train(was_training)
    if details:
        return Generation(out, out_keep, used, T)
    return out


def decode_step(model, kv: KVCache, tokens: torch.Tensor, keep: torch.Tensor, loops: int, rule: ExitRule | None,
                horizon: int | None = None, finished: torch.Tensor | None = None):
    """Return (next-token logits [B, V] at the last position, loops used [B]) after one cached pass.

    Runs `tokens` [B, T] (keep [B, T]) through the model on top of the cache and commits them. With an
    exit rule (T must be 1) each row exits on its own, up to `loops`; rows in `finished` exit at once.
    """
    B, T = tokens.shape
    kv.open(keep)
    if rule is None:
        p = model.run(tokens, loops, horizon=horizon, kv=kv)
        # the coda at every new position (its keys and values); the head at the last one only
        logits = F.linear(model.features(p.state, kv=kv)[:, -1], model.head_weight)
        n = torch.full((B,), loops, dtype=torch.long, device=tokens.device)
    else:
        if T != 1:
            raise ValueError(f"an exit rule decodes one token per row at a time, got {T} tokens")
        done = torch.zeros(B, dtype=torch.bool, device=tokens.device) if finished is None else finished
        halt = _Halt(model, kv, rule, loops, done)
        p = model.run(tokens, loops, horizon=horizon, kv=kv, halt=halt)
        if rule.rule == "kl":  # read out at the last loop run, every row at its exit state: the final logits
            logits = halt.logits
        else:
            logits = F.linear(model.features(p.state, kv=kv)[:, -1], model.head_weight)
        kv.reuse(halt.exit, loops, model.cfg.core)
        n = halt.exit
    kv.commit()
    return logits.float(), n


def continuation(model, tokenizer, prompt, max_new_tokens: int, **kw) -> tuple[str, list[tuple[str, int]]]:
    """Return (prompt text, [(piece, loops used)] per new token) of a greedy (or sampled) continuation.

    `prompt` is a string or token ids; keywords go to `LoopLM.generate` (loops, exit, temperature, ...).
    """
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    g = model.generate(torch.tensor([ids], device=model.embed.weight.device), max_new_tokens, details=True, **kw)
    new, used = g.new_tokens[0].tolist(), g.loops[0].tolist()
    keep = g.keep[0, g.prompt_len:].tolist()
    return tokenizer.decode(ids), [(tokenizer.decode([t]), n) for t, n, k in zip(new, used, keep) if k]


@torch.no_grad()
def teacher_forced(model, tokens: torch.Tensor, loops: int | None = None, exit=None, *,
                   horizon: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (logits [B, T, V], loops used [B, T]) of every position of tokens read one token at a time.

    What generation would compute if it were fed these tokens: with fixed loops that is one parallel
    pass (the cache changes nothing, tests/test_generate.py checks it); with an exit rule each position
    is a cached one-token pass that exits by the rule, up to `loops`.
    """
    r = check_int("loops", model.cfg.loops if loops is None else loops, 1)
    rule = as_exit_rule(exit)
    model._check_tokens(tokens)
    B, T = tokens.shape
    if T > model.cfg.max_seq_len:
        fail("tokens", f"a sequence of {T} tokens", f"is longer than the context max_seq_len={model.cfg.max_seq_len}")
    was_training = model.training
    model.eval()
    try:
        if rule is None:
            logits = model(tokens, loops=r, horizon=horizon).logits.float()
            return logits, torch.full((B, T), r, dtype=torch.long, device=tokens.device)
        kv = KVCache(B, T, tokens.device)
        keep = torch.ones(B, 1, dtype=torch.bool, device=tokens.device)
        out, used = [], []
        for i in range(T):
            lg, n = decode_step(model, kv, tokens[:, i:i + 1], keep, r, rule, horizon)
            out.append(lg)
            used.append(n)
        return torch.stack(out, 1), torch.stack(used, 1)
    finally:
        model.train(was_training)
