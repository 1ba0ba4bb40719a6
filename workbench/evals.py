"""Loop sweeps: loss and accuracy at many loop counts (below, at and beyond K) from one trace pass.

`loop_sweep(model, data, loops=[...])` takes either token batches (language modelling: next-token
loss and accuracy per loop) or task examples (`workbench.data.tasks.Example`: teacher-forced answer
loss and exact-match accuracy per loop, task and depth, grouped into knowledge and reasoning).
A model whose loop t does not depend on the total loop count runs ONE `trace` to max(loops); a
timestep-conditioned model (`model.horizon_dependent`) runs one pass per r, since its state after
loop r differs between runs of different lengths.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr

from .config import check_int, fail
from .io import provenance
from .models.looped import LoopLM
from .models.precision import autocast, precision_name, use_bf16


def _check_loops(loops: Sequence[int]) -> list[int]:
    """Return the distinct loop counts in increasing order, or raise naming the whole list."""
    allowed = "must be a non-empty list of integers >= 1"
    if isinstance(loops, (str, bytes)) or not isinstance(loops, Iterable):
        fail("loops", loops, allowed)
    items = list(loops)
    try:
        rs = sorted({check_int("loops", r, 1) for r in items})
    except ValueError:
        rs = []
    if not rs:
        fail("loops", items, allowed)
    return rs


def _logits_per_loop(model: LoopLM, tokens: torch.Tensor, loops: list[int]):
    """Yield (r, logits) for every r in loops, from one trace when the model allows it."""
    if model.horizon_dependent:
        for r in loops:
            yield r, model(tokens, loops=r).logits
    else:
        trace = model.trace(tokens, loops=max(loops))
        for r in loops:
            yield r, trace.logits(r)


def _device(model: LoopLM, device) -> torch.device:
    return torch.device(device) if device is not None else next(model.parameters()).device


@torch.no_grad()
def sweep_tokens(model: LoopLM, batches: Iterable[torch.Tensor], loops: Sequence[int], device=None,
                 progress: bool = True, per_sequence: bool = False) -> xr.Dataset:
    """Return a Dataset (dim `loop`) of next-token `loss` and `accuracy` over packed [B, T+1] batches.

    With `per_sequence`, also `sequence_loss` (dims `loop`, `sequence`): each row's mean loss, in the
    order the rows came, so two models swept over the same rows can be compared row by row.
    """
    from tqdm.auto import tqdm

    rs = _check_loops(loops)
    dev = _device(model, device)
    loss_sum, hit_sum, n_tok = defaultdict(float), defaultdict(float), 0
    rows = defaultdict(list)  # per_sequence: loop -> each row's mean loss
    for batch in tqdm(batches, desc="loop sweep", disable=not progress):
        batch = torch.as_tensor(batch).to(dev)
        if batch.dim() != 2 or batch.shape[1] < 2:
            raise ValueError(f"batch shape {tuple(batch.shape)} is invalid: must be [B, T+1] with T >= 1")
        x, y = batch[:, :-1], batch[:, 1:]
        for r, logits in _logits_per_loop(model, x, rs):
            tok_loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")
            loss_sum[r] += tok_loss.sum().item()
            if per_sequence:
                rows[r].extend(tok_loss.view(y.shape).mean(1).tolist())
            hit_sum[r] += (logits.argmax(-1) == y).sum().item()
        n_tok += y.numel()
    if n_tok == 0:
        raise ValueError("data is empty: no batches to evaluate")
    ds = xr.Dataset(
        {"loss": ("loop", [loss_sum[r] / n_tok for r in rs]),
         "accuracy": ("loop", [hit_sum[r] / n_tok for r in rs])},
        coords={"loop": rs}, attrs=provenance(model.cfg, tokens=n_tok, training_loops=model.cfg.loops))
    if per_sequence:
        ds["sequence_loss"] = (("loop", "sequence"), np.array([rows[r] for r in rs]))
    return ds


@torch.no_grad()
def sweep_examples(model: LoopLM, examples: Sequence[Any], tokenizer, loops: Sequence[int],
                   batch_size: int = 16, device=None, progress: bool = True) -> xr.Dataset:
    """Return a Dataset (dims `loop`, `task`, `depth`) of answer `loss`, exact-match `accuracy` and `count`.

    Each example is scored teacher-forced: the answer counts as right at loop r when the argmax at
    every answer position equals the answer token. `group` (knowledge or reasoning) labels each task,
    and `group_accuracy` (dims `loop`, `group`) averages over examples.
    """
    from tqdm.auto import tqdm

    rs = _check_loops(loops)
    batch_size = check_int("batch_size", batch_size, 1)
    if not examples:
        raise ValueError("examples is empty: nothing to evaluate")
    dev = _device(model, device)
    encoded = []
    for ex in examples:
        p, a = tokenizer.encode(ex.prompt), tokenizer.encode(ex.answer)
        if not p or not a:
            raise ValueError(f"example {ex.prompt!r} -> {ex.answer!r} encodes to an empty prompt or answer")
        if len(p) + len(a) - 1 > model.cfg.max_seq_len:
            raise ValueError(f"example of {len(p) + len(a)} tokens exceeds max_seq_len={model.cfg.max_seq_len}")
        encoded.append((p, a))
    tasks = sorted({ex.task for ex in examples})
    depths = sorted({int(ex.depth) for ex in examples})
    groups = {ex.task: ex.group for ex in examples}
    ti, di = {t: i for i, t in enumerate(tasks)}, {d: i for i, d in enumerate(depths)}
    loss = np.zeros((len(rs), len(tasks), len(depths)))
    hits = np.zeros_like(loss)
    count = np.zeros((len(tasks), len(depths)))
    for start in tqdm(range(0, len(examples), batch_size), desc="loop sweep", disable=not progress):
        chunk = list(range(start, min(start + batch_size, len(examples))))
        seqs = [encoded[i][0] + encoded[i][1] for i in chunk]
        T = max(len(s) for s in seqs) - 1
        # right padding never changes earlier positions of a causal model
        x = torch.zeros(len(chunk), T, dtype=torch.long)
        for b, s in enumerate(seqs):
            x[b, :len(s) - 1] = torch.tensor(s[:-1])
        spans = [(len(encoded[i][0]) - 1, encoded[i][1]) for i in chunk]
        for r, logits in _logits_per_loop(model, x.to(dev), rs):
            logits = logits.float().cpu()
            for b, (i, (s0, ans)) in enumerate(zip(chunk, spans)):
                lg = logits[b, s0:s0 + len(ans)]
                tgt = torch.tensor(ans)
                ex = examples[i]
                k = (rs.index(r), ti[ex.task], di[int(ex.depth)])
                loss[k] += F.cross_entropy(lg, tgt).item()
                hits[k] += float(bool((lg.argmax(-1) == tgt).all()))
        for i in chunk:
            count[ti[examples[i].task], di[int(examples[i].depth)]] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_loss, acc = loss / count, hits / count  # NaN where a (task, depth) cell has no examples
    group_names = sorted(set(groups.values()))
    g_acc = np.array([[hits[j, [ti[t] for t in tasks if groups[t] == g]].sum()
                       / count[[ti[t] for t in tasks if groups[t] == g]].sum() for g in group_names]
                      for j in range(len(rs))])
    return xr.Dataset(
        {"loss": (("loop", "task", "depth"), mean_loss),
         "accuracy": (("loop", "task", "depth"), acc),
         "count": (("task", "depth"), count),
         "group_accuracy": (("loop", "group"), g_acc)},
        coords={"loop": rs, "task": tasks, "depth": depths, "group": group_names,
                "task_group": ("task", [groups[t] for t in tasks])},
        attrs=provenance(model.cfg, examples=len(examples), training_loops=model.cfg.loops))


def loop_sweep(model: LoopLM, data: Any, loops: Sequence[int], tokenizer=None, bf16: str | bool = "off",
               **kw: Any) -> xr.Dataset:
    """Return a loop-sweep Dataset with `loss` and `accuracy` for token batches or task examples.

    `data` is a LongTensor [N, T+1] (rows are sequences), an iterable of such batches, or a list of
    task examples (then `tokenizer` is required). `bf16` ("off", "on" or "auto", models.precision)
    runs the passes under bf16 autocast (a run is evaluated as it was trained); the cross-entropy is
    computed in fp32 either way, and attrs["precision"] says which was used. "off" (fp32) is the
    default, so a sweep compared against a reference is exact.
    """
    bf16 = use_bf16(bf16, _device(model, kw.get("device")))
    was_training = model.training
    model.eval()
    try:
        with autocast(_device(model, kw.get("device")), bf16):
            if isinstance(data, (list, tuple)) and data and hasattr(data[0], "prompt"):
                if tokenizer is None:
                    raise ValueError("tokenizer=None is invalid for task examples: pass the model's tokenizer")
                ds = sweep_examples(model, data, tokenizer, loops, **kw)
            else:
                if isinstance(data, torch.Tensor):
                    if data.dim() != 2:
                        raise ValueError(f"data of shape {tuple(data.shape)} is invalid: must be [N, T+1]")
                    bs = kw.pop("batch_size", 8)
                    data = data.split(bs)
                ds = sweep_tokens(model, data, loops, **kw)
        ds.attrs["precision"] = precision_name(bf16)
        return ds
    finally:
        model.train(was_training)


# ---- headline scalars: the numbers a run's report shows first -------------------------------------------------
# Each helper returns scalar variables (long_name and units attrs) to add to a results Dataset and name as
# its headline: `head = loss_headline(ds.loss, K); io.save_results(ds.assign(head.data_vars), out_dir,
# headline=list(head))`. The pipeline report prints them as they are, so what a run headlines is decided
# here, where its numbers are made.
def _scalar(value: float, long_name: str, units: str = "1", **attrs: Any) -> xr.DataArray:
    """Return a 0-d DataArray of value with long_name and units ("1": dimensionless) attrs."""
    return xr.DataArray(value, attrs={"long_name": long_name, "units": units, **attrs})


def loss_headline(loss: xr.DataArray, K: int | None = None, units: str = "nats/token") -> xr.Dataset:
    """Return scalars best_r, loss_at_best and (when K was measured) loss_at_K of a `loss` over `loop`.

    best_r is the measured loop count with the lowest loss (an int); an all-NaN loss gives an empty Dataset.
    """
    if loss.dims != ("loop",):
        raise ValueError(f"loss dims {loss.dims} are invalid: must be ('loop',)")
    values, loops = np.asarray(loss.values, dtype=float), [int(r) for r in loss.loop.values]
    if not np.isfinite(values).any():
        return xr.Dataset()
    i = int(np.nanargmin(values))
    out = {"best_r": _scalar(np.int64(loops[i]), "best loop count r (of those measured)"),
           "loss_at_best": _scalar(values[i], f"loss at r = {loops[i]}", units)}
    if K is not None and int(K) in loops:
        out["loss_at_K"] = _scalar(values[loops.index(int(K))], f"loss at K = {int(K)}", units)
    return xr.Dataset(out)


TEST_TIME_UNITS = {"L_inf": "nats/token", "Z": "nats/token", "z": "per loop"}  # of L(T) = L_inf + Z exp(-z T)


def loss_fit_headline(params: dict[str, float], fit_upto: int) -> xr.Dataset:
    """Return scalars test_time_fit_upto and test_time_<name> per parameter of a fitted test-time law L(T)."""
    out = {"test_time_fit_upto": _scalar(np.int64(fit_upto),
                                         "test-time law L(T) = L∞ + Z·e^(−zT) fitted on loops 1 to")}
    for name, value in params.items():
        label = {"L_inf": "L∞"}.get(name, name)
        out[f"test_time_{name}"] = _scalar(float(value), f"test-time law {label}", TEST_TIME_UNITS.get(name, "1"))
    return xr.Dataset(out)


def geometry_headline(ds: xr.Dataset) -> xr.Dataset:
    """Return scalars terminal_to_core (when present) and angle_first, angle_last of a geometry Dataset.

    The angles are `angular_distance` at the first and the last loop measured, in units of π rad.
    """
    out = {}
    if "terminal_to_core" in ds and ds.terminal_to_core.ndim == 0:
        out["terminal_to_core"] = _scalar(float(ds.terminal_to_core), "terminal-to-core response ratio")
    angle = ds.get("angular_distance")
    if angle is not None and angle.dims == ("loop",) and angle.size:
        for key, j in (("angle_first", 0), ("angle_last", -1)):  # units of π rad, written for a reader here
            out[key] = _scalar(float(angle.values[j]), f"angular distance at loop {int(angle.loop.values[j])}",
                               "π rad")
    return xr.Dataset(out)


def lost_gradient_headline(ds: xr.Dataset) -> xr.Dataset:
    """Return scalars lost_1, rho and loops of a lost-gradient Dataset over `k` (empty for another layout)."""
    if "lost" not in ds or ds.lost.dims != ("k",):
        return xr.Dataset()
    return xr.Dataset({
        "lost_1": _scalar(float(ds.lost.sel(k=1)), "lost(1): share of |g| truncation to k = 1 throws away"),
        "rho": _scalar(float(ds.attrs["rho"]), "ρ: backward shrink of the adjoint per loop"),
        "loops": _scalar(np.int64(ds.attrs["loops"]), "loops r")})


def law_headline(fit: xr.Dataset, params: Sequence[str] | None = None) -> xr.Dataset:
    """Return one scalar per fitted law parameter and group, `<param>_<group>`, with its interval in attrs low, high.

    `fit` has `estimate`, `low` and `high` over `param` (and `group`), as a fit_laws results Dataset;
    `params` default: φ alone when it was fitted, else every parameter. Names keep letters, digits and
    underscores of the group label; long_name reads "φ (group)".
    """
    names = [str(p) for p in fit.param.values]
    chosen = list(params) if params is not None else (["phi"] if "phi" in names else names)
    groups = [str(g) for g in fit.group.values] if "group" in fit.dims else [None]
    out = {}
    for p in chosen:
        for g in groups:
            sel = {"param": p, **({"group": g} if g is not None else {})}
            est, lo, hi = (float(fit[v].sel(sel)) for v in ("estimate", "low", "high"))
            label = {"phi": "φ"}.get(p, p) + (f" ({g})" if g is not None else "")
            key = p if g is None else f"{p}_{re.sub(r'[^0-9A-Za-z_]+', '_', g).strip('_')}"
            out[key] = _scalar(est, label, low=lo, high=hi, interval="95%")
    return xr.Dataset(out)
