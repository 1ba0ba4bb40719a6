"""Shared pieces of the probes: input checks, provenance, block-occurrence names, per-token metrics."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..config import check_int  # noqa: F401 (the probes' one integer check)
from ..io import provenance
from ..models.looped import LoopLM
from .protocol import Loopable, as_loopable

EPS = 1e-12  # SPEC §3


# ---- input checks -------------------------------------------------------------------------------
def check_model(model) -> None:
    """Raise TypeError unless model is a LoopLM or a Loopable."""
    if not isinstance(model, (LoopLM, Loopable)):
        raise TypeError(f"model must be a LoopLM or a Loopable, got {type(model).__name__}")


def training_loops(model) -> int:
    """Return K, the loop count the model was trained at."""
    return model.cfg.loops if isinstance(model, LoopLM) else int(model.training_loops)


def vocab_size(model) -> int | None:
    """Return the vocabulary size when known (for token range checks), else None."""
    return model.cfg.vocab_size if isinstance(model, LoopLM) else model.vocab_size


def device_of(model) -> torch.device | None:
    """Return the device of the model's weights (None for a Loopable holding none: its tokens are used as given)."""
    return model.embed.weight.device if isinstance(model, LoopLM) else model.device()


def check_tokens(tokens, model, name: str = "tokens") -> torch.Tensor:
    """Return tokens (on the model's device), raising ValueError unless an integer [batch, seq] tensor in range."""
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of token ids [batch, seq], got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.dim() != 2 or tokens.numel() == 0:
        raise ValueError(f"{name} must be a non-empty [batch, seq] tensor, got shape {tuple(tokens.shape)}")
    V = vocab_size(model)
    if V is not None and (int(tokens.min()) < 0 or int(tokens.max()) >= V):
        raise ValueError(f"{name} must lie in 0..{V - 1} (vocab_size={V}), "
                         f"got values in {int(tokens.min())}..{int(tokens.max())}")
    dev = device_of(model)
    return tokens.long().to(dev) if dev is not None else tokens.long()


def check_targets(targets, tokens: torch.Tensor, model, name: str = "targets") -> torch.Tensor:
    """Return targets like tokens, raising ValueError unless integer ids (or -100) of the tokens' shape."""
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor [batch, seq], got {type(targets).__name__}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(tokens.shape):
        raise ValueError(f"{name} must have the shape of tokens {tuple(tokens.shape)}, got {tuple(targets.shape)}")
    V = vocab_size(model)
    kept = targets[targets != -100]
    if kept.numel() and (int(kept.min()) < 0 or (V is not None and int(kept.max()) >= V)):
        raise ValueError(f"{name} must be token ids in 0..{'' if V is None else V - 1} or -100 (ignored)")
    return targets.long().to(tokens.device)


def check_horizon(model, loops: int, horizon) -> int:
    """Return the horizon T for timestep conditioning (default: loops), which must be >= loops."""
    if horizon is None:
        return loops
    return check_int("horizon", horizon, loops)


def attrs(model, probe: str, **extra) -> dict[str, str | int | float]:
    """Return the flat provenance attrs of a probe result."""
    cfg = model.cfg if isinstance(model, LoopLM) else model.config
    if not hasattr(cfg, "to_json") and hasattr(cfg, "to_json_string"):  # a transformers config: its full JSON
        cfg = cfg.to_json_string(use_diff=False)
    seed = getattr(model, "seed", None)
    return provenance(cfg, seed, probe=probe, **extra)


# ---- one pass -----------------------------------------------------------------------------------
def trace_states(model, tokens: torch.Tensor, loops: int, horizon: int | None = None
                 ) -> tuple[torch.Tensor, Callable[[int], torch.Tensor]]:
    """Return (states [loops+1, B, T, d], read) from one pass; read(t) is the logits of the state after loop t.

    A Loopable's measured states are its `reduce`d carried states; read(t) reads out the carried
    state itself, so a coda that reads more than the measured state (`coda_reads="carried"`) gets it.
    """
    if isinstance(model, LoopLM):
        tr = model.trace(tokens, loops=loops, horizon=horizon)
        return tr.states, lambda t: model.readout(tr.states[t])
    lp = as_loopable(model)
    _, carried = lp.run(tokens, loops)
    return torch.stack([lp.state(h) for h in carried]), lambda t: lp.readout(carried[t])


# ---- per-token metrics ----------------------------------------------------------------------------
def angular_distance(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Return arccos(clip(u.v / max(|u||v|, eps), -1, 1)) / pi per token (over the last dim)."""
    u, v = u.float(), v.float()
    cos = (u * v).sum(-1) / (u.norm(dim=-1) * v.norm(dim=-1)).clamp_min(EPS)
    return torch.arccos(cos.clamp(-1.0, 1.0)) / torch.pi


def relative_update(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """Return |h_out - h_in| / max(|h_in|, eps) per token."""
    h_in, h_out = h_in.float(), h_out.float()
    return (h_out - h_in).norm(dim=-1) / h_in.norm(dim=-1).clamp_min(EPS)


def token_stats(logits: torch.Tensor, targets: torch.Tensor | None = None):
    """Return (log-probs [B, T, V] float32, loss [B, T], correct [B, T]) (loss/correct None without targets)."""
    lp = F.log_softmax(logits.float(), dim=-1)
    if targets is None:
        return lp, None, None
    t = targets.clamp_min(0)
    loss = -lp.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    correct = (logits.argmax(-1) == targets).float()
    return lp, loss, correct


def kl(lp_p: torch.Tensor, lp_q: torch.Tensor) -> torch.Tensor:
    """Return KL(p || q) per token from log-probabilities, clamped at 0 against rounding."""
    return (lp_p.exp() * (lp_p - lp_q)).sum(-1).clamp_min(0.0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Return the mean of x over the True entries of mask (NaN when none)."""
    n = int(mask.sum())
    return float((x * mask).sum() / n) if n else float("nan")


# ---- block occurrences -------------------------------------------------------------------------------
def has_places(model) -> bool:
    """Return True when the model names its block occurrences (a LoopLM, or a Loopable with `places`)."""
    return isinstance(model, LoopLM) or (isinstance(model, Loopable) and model.places is not None)


def occurrences(model, loops: int) -> list[tuple[str, str, int, int]]:
    """Return (name, stage, loop, layer) for every block occurrence in call order.

    Names come from `LoopLM.place_names` or `Loopable.places`; `loop` is 0 for the prelude and
    loops + 1 for the coda.
    """
    out = []
    names = model.place_names(loops) if isinstance(model, LoopLM) else model.places(loops)
    for name in names:
        parts = name.split(".")
        if parts[0] == "core":
            out.append((name, "core", int(parts[1]), int(parts[2])))
        else:
            out.append((name, parts[0], 0 if parts[0] == "prelude" else loops + 1, int(parts[1])))
    return out
