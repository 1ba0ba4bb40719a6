"""Adaptive exit measured against fixed loop counts, and the learned exit gate's training loop.

`train_exit_gate(model, batch, loops)` trains an Ouro-style `ExitGate` on a frozen model: one trace
gives every token's state and next-token loss after each loop 1..R, then the gate alone is fitted to
`gate_objective` (expected loss over its exit distribution minus beta times the distribution's
entropy) by Adam. `exit_sweep(model, ...)` measures loss, next-token accuracy and task accuracy
(knowledge and reasoning groups) against the mean loops used per token, for fixed r and for exit
rules over thresholds, every token read as generation reads it (`models.generate.teacher_forced`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr

from ..config import check_float, check_int, fail
from ..io import provenance
from ..models.generate import RULES, ExitGate, ExitRule, gate_objective, teacher_forced
from ..models.looped import LoopLM


def _batch(model: LoopLM, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (inputs, targets) of packed windows [N, T+1] on the model's device."""
    batch = torch.as_tensor(batch)
    if batch.dim() != 2 or batch.shape[1] < 2:
        fail("batch", tuple(batch.shape), "must be token windows [N, T+1] with T >= 1")
    batch = batch.to(model.embed.weight.device)
    return batch[:, :-1], batch[:, 1:]


@torch.no_grad()
def loop_losses(model: LoopLM, batch, loops: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (states [N, R, d], next-token losses [N, R]) of every token after loops 1..R, from one trace.

    N counts tokens (windows x positions); a timestep-conditioned model runs with horizon R, as
    generation under an exit rule does.
    """
    x, y = _batch(model, batch)
    R = check_int("loops", loops, 1)
    was_training = model.training
    model.eval()
    try:
        tr = model.trace(x, loops=R)
        states = tr.states[1:].float()  # [R, B, T, d]
        losses = torch.stack([F.cross_entropy(tr.logits(t).flatten(0, 1).float(), y.flatten(), reduction="none")
                              for t in range(1, R + 1)])
    finally:
        model.train(was_training)
    d = states.shape[-1]
    return states.permute(1, 2, 0, 3).reshape(-1, R, d), losses.view(R, -1).T.contiguous()


def train_exit_gate(model: LoopLM, batch, loops: int, steps: int = 200, lr: float = 0.05, beta: float = 0.05,
                    seed: int = 0) -> tuple[ExitGate, xr.Dataset]:
    """Return (the trained ExitGate, a Dataset of its `objective` per `step`) for a frozen model.

    The gate reads the state after each loop 1..`loops` of packed windows `batch` [N, T+1]; full-batch
    Adam on `gate_objective(lambda, losses, beta)`; the model's weights are never changed (no gradient
    reaches them: the states are computed once, without a graph).
    """
    steps = check_int("steps", steps, 1)
    lr = check_float("lr", lr, 0, lo_open=True)
    beta = check_float("beta", beta, 0)
    states, losses = loop_losses(model, batch, loops)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(check_int("seed", seed))
        gate = ExitGate(model.cfg.d_model).to(states.device)
    opt = torch.optim.Adam(gate.parameters(), lr=lr)
    history = []
    for _ in range(steps + 1):
        obj = gate_objective(gate(states), losses, beta)
        history.append(float(obj.detach()))
        if len(history) > steps:
            break
        opt.zero_grad(set_to_none=True)
        obj.backward()
        opt.step()
    gate.eval()
    ds = xr.Dataset({"objective": ("step", np.array(history), {"long_name": "sum_t p_t L_t - beta H(p)",
                                                                "units": "nats"})},
                    coords={"step": np.arange(len(history))},
                    attrs=provenance(model.cfg, seed, loops=int(loops), beta=beta, lr=lr, tokens=int(losses.shape[0])))
    return gate, ds


def _examples_batch(examples, tokenizer, max_len: int):
    """Return (x [N, T] right-padded, real [N, T], answer spans [(start, ids)]) for teacher-forced scoring."""
    seqs, spans = [], []
    for ex in examples:
        p, a = tokenizer.encode(ex.prompt), tokenizer.encode(ex.answer)
        if not p or not a:
            fail("examples", f"{ex.prompt!r} -> {ex.answer!r}", "every prompt and answer must encode to tokens")
        if len(p) + len(a) - 1 > max_len:
            fail("examples", f"an example of {len(p) + len(a)} tokens", f"exceeds max_seq_len={max_len}")
        seqs.append(p + a)
        spans.append((len(p) - 1, a))
    T = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    real = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        x[b, :len(s) - 1] = torch.tensor(s[:-1])
        real[b, :len(s) - 1] = True
    return x, real, spans


def _score_tasks(model, examples, tokenizer, loops, rule, batch_size):
    """Return (loss per example, hit per example, tokens read, loops used) teacher-forced under one setting."""
    losses, hits, n_tok, n_loops = [], [], 0, 0
    dev = model.embed.weight.device
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        x, real, spans = _examples_batch(chunk, tokenizer, model.cfg.max_seq_len)
        # right padding: a causal model's earlier positions never see it, and padded positions are not scored
        logits, used = teacher_forced(model, x.to(dev), loops, rule)
        real = real.to(dev)
        n_tok += int(real.sum())
        n_loops += int(used[real].sum())
        for b, (s0, ans) in enumerate(spans):
            lg = logits[b, s0:s0 + len(ans)].cpu()
            tgt = torch.tensor(ans)
            losses.append(F.cross_entropy(lg, tgt).item())
            hits.append(float(bool((lg.argmax(-1) == tgt).all())))
    return np.array(losses), np.array(hits), n_tok, n_loops


def _check_thresholds(name: str, values) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        fail(name, values, "must be a list of thresholds >= 0")
    return [check_float(name, v, 0, finite=False) for v in values]


@torch.no_grad()
def exit_sweep(model: LoopLM, batch, loops: Sequence[int], rules: Mapping[str, Sequence[float]],
               max_loops: int, gate: ExitGate | None = None, examples: Sequence[Any] = (), tokenizer=None,
               batch_size: int = 16, progress: bool = False) -> xr.Dataset:
    """Return a Dataset (dim `point`) of loss and accuracy against mean loops per token, one curve per rule.

    Points: fixed r for every r in `loops` (rule "fixed", setting r), and each rule in `rules`
    ({"kl": [thresholds], "state": [...], "gate": [...]}; "gate" needs `gate`) at each threshold
    (setting = threshold) with r_max = `max_loops`. Every token of `batch` ([N, T+1] windows) is read
    as generation reads it. Variables: `mean_loops`, `loss`, `accuracy` (next token) on the windows;
    with task `examples` (and `tokenizer`), `task_loss`, `task_mean_loops` and `group_accuracy`
    (dims point, group: knowledge / reasoning; teacher-forced exact match of the whole answer).
    """
    from tqdm.auto import tqdm

    rs = sorted({check_int("loops", r, 1) for r in loops})
    R = check_int("max_loops", max_loops, 1)
    if not isinstance(rules, Mapping):
        fail("rules", rules, "must map rule names (kl, state, gate) to lists of thresholds")
    settings: list[tuple[str, float, ExitRule | None, int]] = [("fixed", float(r), None, r) for r in rs]
    for name, thresholds in rules.items():
        if name not in RULES:
            fail("rules", name, f"names an unknown rule: must be one of {', '.join(RULES)}")
        if name == "gate" and gate is None:
            fail("gate", None, "rules has 'gate' thresholds: pass the trained ExitGate (train_exit_gate)")
        for thr in _check_thresholds(f"rules[{name!r}]", thresholds):
            settings.append((name, thr, ExitRule(name, thr, gate=gate if name == "gate" else None), R))
    if examples and tokenizer is None:
        fail("tokenizer", None, "task examples need the model's tokenizer")
    x, y = _batch(model, batch)
    groups = sorted({ex.group for ex in examples})
    out = {k: [] for k in ("mean_loops", "loss", "accuracy", "task_loss", "task_mean_loops")}
    g_acc = []
    for name, thr, rule, r in tqdm(settings, desc="exit sweep", disable=not progress):
        logits, used = teacher_forced(model, x, r, rule)
        out["mean_loops"].append(float(used.float().mean()))
        out["loss"].append(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
        out["accuracy"].append(float((logits.argmax(-1) == y).float().mean()))
        if examples:
            losses, hits, n_tok, n_loops = _score_tasks(model, list(examples), tokenizer, r, rule, batch_size)
            out["task_loss"].append(float(losses.mean()))
            out["task_mean_loops"].append(n_loops / n_tok)
            g_acc.append([float(hits[[ex.group == g for ex in examples]].mean()) for g in groups])
    data = {"mean_loops": ("point", out["mean_loops"], {"long_name": "mean loops per token"}),
            "loss": ("point", out["loss"], {"units": "nats"}),
            "accuracy": ("point", out["accuracy"], {"long_name": "next-token accuracy"})}
    coords = {"point": np.arange(len(settings)), "rule": ("point", [s[0] for s in settings]),
              "setting": ("point", [s[1] for s in settings], {"long_name": "r (fixed) or threshold (rules)"})}
    if examples:
        data.update({"task_loss": ("point", out["task_loss"], {"units": "nats"}),
                     "task_mean_loops": ("point", out["task_mean_loops"], {"long_name": "mean loops per token"}),
                     "group_accuracy": (("point", "group"), np.array(g_acc))})
        coords["group"] = groups
    return xr.Dataset(data, coords=coords, attrs=provenance(
        model.cfg, max_loops=R, training_loops=model.cfg.loops, windows=int(x.shape[0]), window_tokens=int(x.shape[1]),
        examples=len(examples), rules=",".join(["fixed", *rules])))


def fewest_loops_reaching(ds: xr.Dataset, K: int, var: str = "accuracy"):
    """Return a DataFrame: per rule (and group), the fewest mean loops per token whose `var` reaches fixed r = K's.

    "Reaches" is >= for accuracies and <= for losses. Columns: rule, group (for group_accuracy), target
    (the value at fixed r = K), mean_loops, value and setting (r or threshold) of that point; NaN where
    no point of the rule reaches the target.
    """
    import pandas as pd

    if var not in ds:
        fail("var", var, f"must be a variable of the sweep: {', '.join(map(str, ds.data_vars))}")
    fixed = np.flatnonzero((ds.rule.values == "fixed") & (ds.setting.values == float(K)))
    if fixed.size == 0:
        fail("K", K, "must be one of the sweep's fixed loop counts")
    higher = "accuracy" in var
    x_var = "task_mean_loops" if var.startswith("task") or var == "group_accuracy" else "mean_loops"
    groups = list(ds.group.values) if "group" in ds[var].dims else [None]
    rows = []
    for rule in dict.fromkeys(str(r) for r in ds.rule.values):
        idx = np.flatnonzero(ds.rule.values == rule)
        for g in groups:
            da = ds[var] if g is None else ds[var].sel(group=g)
            target = float(da.values[fixed[0]])
            vals = da.values[idx]
            ok = vals >= target - 1e-12 if higher else vals <= target + 1e-12
            row = {"rule": rule, **({"group": g} if g is not None else {}), "target": target,
                   "mean_loops": np.nan, "value": np.nan, "setting": np.nan}
            if ok.any():
                best = idx[ok][np.argmin(ds[x_var].values[idx][ok])]
                row.update(mean_loops=float(ds[x_var].values[best]), value=float(da.values[best]),
                           setting=float(ds.setting.values[best]))
            rows.append(row)
    return pd.DataFrame(rows)

