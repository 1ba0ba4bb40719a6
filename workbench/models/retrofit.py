"""Retrofit a pretrained dense LM into a looped one (SPEC §5): prelude [0, a), tied block [a, b), coda [b, n).

The conversion only. `retrofit` turns a Hugging Face `LlamaForCausalLM` or `Qwen2ForCausalLM` (a model
object, or a local directory / GGUF file read by `workbench.models.hf.load_base`; `random_llama`,
`random_qwen2` for tests) into a `LoopLM` through `from_hf`; its config says `inject="bridge"` (the
re-entry bridge) and `adapter_rank` (a low-rank `Adapter` on every block linear), so a retrofitted model
is an ordinary LoopLM: its checkpoints round-trip through `workbench.io.save_checkpoint` / `load_model`.

Loop 1 is the base model: the bridge and the adapters act on loops >= 2 only (`LoopLM.step` skips them
on loop 1 of a model with inject="bridge"), so under the adapter budget no training can change the
one-loop path. Under the full budget the block itself trains and loop 1 moves with it; the Trainer's
`TrainConfig.loop1_distill` holds it toward the frozen base, and `experiments.retrofit.loop1_check`
measures it.

Budgets (`set_budget`): "adapter" trains the bridge and the block's adapters over frozen base weights;
"full" trains the bridge and the whole block. Prelude, coda, embeddings and final norm stay frozen in
both. `merge_adapters` folds the adapters into the block weights (a plain LoopLM again; only for a
model without the bridge, such as the scratchpad baseline, whose adapters act on loop 1 too).

Training, evaluation and the end-to-end run (`train_retrofit`, `depth_sweep`, `answer_sweep`,
`knowledge_sweep`, `retrofit_run`, `load_smollm2`) are in `workbench.experiments.retrofit`; the task
data (`iterated_examples`, `scratchpad_examples`, `knowledge_battery`) in `workbench.data.tasks`.
"""

from __future__ import annotations

import copy
import os

import torch

from ..config import check_choice, check_int, fail
from .hf import from_hf, load_base
from .looped import LoopLM

BUDGETS = ("adapter", "full")
SMOLLM2_SPLIT = (10, 10, 10)  # SmolLM2-135M has 30 layers; the middle third loops (*chosen here*)


def retrofit(base, prelude: int, core: int, coda: int, budget: str = "adapter", loops: int = 4,
             adapter_rank: int = 16, bridge: bool = True, seed: int = 0) -> LoopLM:
    """Return a LoopLM of the base's layers split prelude/core/coda, with the re-entry bridge and `budget` applied.

    `base` is a `LlamaForCausalLM` / `Qwen2ForCausalLM`, or the path of a local directory written by
    `save_pretrained` or of a GGUF file (`models.hf.load_base`, float32). At loops=1 its logits equal
    the base's; with the bridge they stay equal through training (bridge and adapters skip loop 1).
    `loops` is the training loop count K; `adapter_rank` is used by budget="adapter" only;
    `bridge=False` leaves the bridge out and lets the adapters act on loop 1 (the scratchpad baseline
    at loops=1); `seed` draws the adapters' A factors.
    """
    check_choice("budget", budget, BUDGETS)
    if budget == "adapter":
        check_int("adapter_rank", adapter_rank, 1)
    if isinstance(base, (str, os.PathLike)):
        base = load_base(base)
    model = from_hf(base, prelude, core, coda, loops=check_int("loops", loops, 1), seed=seed,
                    inject="bridge" if bridge else "none",
                    adapter_rank=adapter_rank if budget == "adapter" else 0)
    set_budget(model, budget)
    return model


def _part(name: str) -> str:
    if name.startswith("inject."):
        return "bridge"
    if "_adapter." in name:
        return "adapter"
    if name.startswith("core."):
        return "block"
    return "base"  # embeddings, head, prelude, coda, final norm


def set_budget(model: LoopLM, budget: str) -> dict[str, int]:
    """Return `budget_report(model)` after freezing all but the budget's parameters (requires_grad).

    "adapter": the bridge and the adapters (needs cfg.adapter_rank > 0); "full": the bridge and the
    whole block (base block weights and any adapters).
    """
    check_choice("budget", budget, BUDGETS)
    if budget == "adapter" and model.cfg.adapter_rank == 0:
        fail("budget", budget, "needs a model with cfg.adapter_rank > 0 (adapters to train)")
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
    """Return a copy of the model with every adapter merged into its base weight (adapter_rank=0).

    Only for a model without the bridge: a bridged model's adapters act on loops >= 2 only, which merged
    weights cannot express (they would change loop 1), so it raises ValueError.
    """
    if model.cfg.adapter_rank == 0:
        return copy.deepcopy(model)
    if model.cfg.inject == "bridge":
        fail("model", "inject='bridge'", "merge_adapters needs a model without the bridge (retrofit(..., "
             "bridge=False)): a bridged retrofit's adapters act on loops >= 2 only, and merged into the block "
             "weights they would change loop 1, the base model")
    merged = LoopLM(model.cfg.replace(adapter_rank=0), seed=model.seed)
    full = model.state_dict()
    state = {k: v for k, v in full.items() if "_adapter." not in k}
    for key in full:
        if key.endswith("_adapter.A"):  # <linear>_adapter.{A,B} updates <linear>.weight by B A
            lin = key[:-len("_adapter.A")]
            w = state[f"{lin}.weight"]
            state[f"{lin}.weight"] = w + (full[f"{lin}_adapter.B"] @ full[key]).to(w.dtype)
    merged.load_state_dict(state)
    ref = model.embed.weight
    return merged.to(device=ref.device, dtype=ref.dtype)
