"""Hugging Face interop: a Llama- or Qwen2-family causal LM <-> `LoopLM` (fused QKV and gate/up, same rotary).

At loops=1 the LoopLM built by `from_hf` runs layers prelude -> core -> coda once, i.e. exactly the
base's layers 0..n-1, so its logits equal the base's (SPEC §5). Families (`FAMILIES`):
`LlamaForCausalLM` and `Qwen2ForCausalLM` (Qwen2 is a Llama with q/k/v biases; attention biases are
read from the weights, so no flag is needed). `to_hf` writes a `LlamaForCausalLM` either way. Bases to
convert: `load_base` reads one offline from a local directory written by `save_pretrained` or from a
GGUF file (`load_gguf`; SmolLM2's: `experiments.retrofit.load_smollm2`, which also gives its
tokenizer), `random_llama` / `random_qwen2` draw tiny seeded ones for fast runs. A LoopLM with loop
extras, or at r > 1, is a transformers model through `models.hf_looped` instead (its own model_type).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..config import LoopConfig, check_float, check_int
from .looped import LoopLM

_LOOP_DEFAULTS = {"inject": "none", "history": 0, "timestep": "none", "hyper": 1,
                  "sandwich_norm": False, "taper": "uniform", "adapter_rank": 0}
_NORMS = (("attn_norm.weight", "input_layernorm.weight"), ("mlp_norm.weight", "post_attention_layernorm.weight"))
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # model_type -> the class converted


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Hugging Face interop needs transformers: "
                          "pip install 'looped-workbench[retrofit]'") from e
    return transformers


def _rope_theta(hf_cfg) -> float:
    """Return rope_theta from a transformers 5 `rope_parameters` dict or a 4.x `rope_theta`/`rope_scaling`."""
    params = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_cfg, "rope_scaling", None) or {})
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported: LoopLM implements only the default rotary "
                         "embedding (no rope scaling)")
    theta = params.get("rope_theta", getattr(hf_cfg, "rope_theta", None))
    return 10000.0 if theta is None else float(theta)


def _layer_names(cfg: LoopConfig) -> list[str]:
    p, s, c = cfg.prelude, cfg.core, cfg.coda
    return [f"prelude.{i}" for i in range(p)] + [f"core.{i}" for i in range(s)] + [f"coda.{i}" for i in range(c)]


def check_family(model) -> str:
    """Return the model_type ("llama" or "qwen2") of a supported causal LM; ValueError naming any other."""
    cls = type(model).__name__
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if FAMILIES.get(kind) != cls:
        raise ValueError(f"base={cls} (model_type={kind!r}) is not supported: the bases that convert are "
                         f"{', '.join(f'{c} (model_type {k!r})' for k, c in FAMILIES.items())}")
    sliding = [t for t in (getattr(model.config, "layer_types", None) or []) if t != "full_attention"]
    if sliding or getattr(model.config, "use_sliding_window", False):
        raise ValueError(f"{cls} with use_sliding_window=True (layer types {sorted(set(sliding))}) is not supported: "
                         "LoopLM's attention is full causal attention")
    return kind


def from_hf(llama, prelude: int, core: int, coda: int, loops: int = 1, seed: int = 0, **overrides: Any) -> LoopLM:
    """Return a LoopLM whose layers are the base's (prelude, core, coda in order), in the base's dtype/device.

    `llama` is a `LlamaForCausalLM` or `Qwen2ForCausalLM` (`FAMILIES`). Attention biases are read from
    its weights: where q/k/v (Qwen2) or q/k/v/o (Llama's attention_bias) biases exist, the LoopLM gets
    attn_bias=True and the biases the base lacks (Qwen2's o_proj) are zeros, which change nothing.
    Loop extras named in `overrides` (injection, adapters, ...) keep their identity initialisation, drawn
    with `seed` where random (adapter A factors).
    """
    _transformers()
    kind = check_family(llama)
    hf = llama.config
    n = hf.num_hidden_layers
    for name, v in (("prelude", prelude), ("core", core), ("coda", coda)):
        check_int(name, v, 1 if name == "core" else 0)
    if prelude + core + coda != n:
        raise ValueError(f"prelude + core + coda = {prelude} + {core} + {coda} = {prelude + core + coda} "
                         f"must equal the base's layer count num_hidden_layers={n} ({FAMILIES[kind]}): the "
                         "split must cover every layer once")
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported: LoopLM's SwiGLU has no biases")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.hidden_act!r} is not supported: LoopLM's MLP is SwiGLU (silu)")
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is not None and head_dim != hf.hidden_size // hf.num_attention_heads:
        raise ValueError(f"head_dim={head_dim} is not supported: LoopLM needs head_dim = hidden_size / "
                         f"num_attention_heads = {hf.hidden_size // hf.num_attention_heads}")
    src = {k: v.detach() for k, v in llama.state_dict().items()}
    biased = any(k.startswith("model.layers.") and ".self_attn." in k and k.endswith("_proj.bias") for k in src)
    fields = dict(vocab_size=hf.vocab_size, d_model=hf.hidden_size, n_heads=hf.num_attention_heads,
                  n_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                  d_ff=hf.intermediate_size, prelude=prelude, core=core, coda=coda, loops=loops,
                  max_seq_len=hf.max_position_embeddings, rope_theta=_rope_theta(hf), norm_eps=hf.rms_norm_eps,
                  tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), attn_bias=biased)
    fields.update(overrides)
    model = LoopLM(LoopConfig(**fields), seed=seed)
    new = {"embed.weight": src["model.embed_tokens.weight"], "norm.weight": src["model.norm.weight"]}
    if model.head is not None:
        new["head.weight"] = src["lm_head.weight"]
    for i, name in enumerate(_layer_names(model.cfg)):
        pre = f"model.layers.{i}."
        for ours, theirs in _NORMS:
            new[f"{name}.{ours}"] = src[pre + theirs]
        new[f"{name}.attn.qkv.weight"] = torch.cat([src[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        new[f"{name}.attn.o.weight"] = src[pre + "self_attn.o_proj.weight"]
        if any(pre + f"self_attn.{x}_proj.bias" in src for x in "qkv"):  # a missing one is zero (no bias)
            new[f"{name}.attn.qkv.bias"] = torch.cat([
                src.get(pre + f"self_attn.{x}_proj.bias", src[pre + f"self_attn.{x}_proj.weight"].new_zeros(
                    len(src[pre + f"self_attn.{x}_proj.weight"])))
                for x in "qkv"])
        if pre + "self_attn.o_proj.bias" in src:
            new[f"{name}.attn.o.bias"] = src[pre + "self_attn.o_proj.bias"]
        new[f"{name}.mlp.gate_up.weight"] = torch.cat([src[pre + "mlp.gate_proj.weight"],
                                                       src[pre + "mlp.up_proj.weight"]])
        new[f"{name}.mlp.down.weight"] = src[pre + "mlp.down_proj.weight"]
    state = model.state_dict()  # loop extras (injection, gates, ...) keep their identity initialisation
    for key, value in new.items():
        if key not in state:
            raise ValueError(f"the base has weight {key!r} (shape {tuple(value.shape)}) that this LoopLM lacks")
        if state[key].shape != value.shape:
            raise ValueError(f"{key}: LoopLM shape {tuple(state[key].shape)} != the base's shape "
                             f"{tuple(value.shape)} (did an override change the architecture?)")
        state[key] = value.to(device="cpu", dtype=state[key].dtype)
    model.load_state_dict(state)
    ref = src["model.embed_tokens.weight"]
    return model.to(device=ref.device, dtype=ref.dtype)


def to_hf(model: LoopLM):
    """Return a LlamaForCausalLM with layers prelude + core + coda in order (the LoopLM at loops=1; any r: hf_looped)."""
    transformers = _transformers()
    cfg = model.cfg
    extras = [f"{k}={getattr(cfg, k)!r}" for k, v in _LOOP_DEFAULTS.items() if getattr(cfg, k) != v]
    if extras:
        raise ValueError(f"to_hf needs a plain LoopLM, but the config has {', '.join(extras)}; a "
                         f"LlamaForCausalLM has no loop extras, sandwich norms or per-layer MLP widths "
                         f"(needs {', '.join(f'{k}={v!r}' for k, v in _LOOP_DEFAULTS.items())}); "
                         "workbench.models.hf_looped exports any LoopLM at any loop count instead")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ff_mean,
        num_hidden_layers=cfg.physical_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len,
        rope_theta=float(cfg.rope_theta), rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=cfg.attn_bias, mlp_bias=False, hidden_act="silu")
    llama = transformers.LlamaForCausalLM(hf_cfg)
    src = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    H, KV, hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    new = {"model.embed_tokens.weight": src["embed.weight"], "model.norm.weight": src["norm.weight"],
           "lm_head.weight": src["embed.weight"] if model.head is None else src["head.weight"]}
    for i, name in enumerate(_layer_names(cfg)):
        pre = f"model.layers.{i}."
        for ours, theirs in _NORMS:
            new[pre + theirs] = src[f"{name}.{ours}"]
        for part in ("weight", "bias"):
            if f"{name}.attn.qkv.{part}" in src:
                q, k, v = src[f"{name}.attn.qkv.{part}"].split([H * hd, KV * hd, KV * hd])
                new.update({pre + f"self_attn.{x}_proj.{part}": t for x, t in zip("qkv", (q, k, v))})
        new[pre + "self_attn.o_proj.weight"] = src[f"{name}.attn.o.weight"]
        if cfg.attn_bias:
            new[pre + "self_attn.o_proj.bias"] = src[f"{name}.attn.o.bias"]
        gate, up = src[f"{name}.mlp.gate_up.weight"].chunk(2)
        new.update({pre + "mlp.gate_proj.weight": gate, pre + "mlp.up_proj.weight": up,
                    pre + "mlp.down_proj.weight": src[f"{name}.mlp.down.weight"]})
    state = llama.state_dict()
    if cfg.tie_embeddings and "lm_head.weight" not in state:
        del new["lm_head.weight"]
    llama.load_state_dict({k: v.to(state[k].dtype) for k, v in new.items()}, strict=True)
    ref = model.embed.weight
    return llama.to(device=ref.device, dtype=ref.dtype).eval()


# ---- bases: a GGUF file, or a tiny random Llama ----------------------------------------------------------
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


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = False):
    """Return the LlamaForCausalLM stored in a GGUF file (in eval mode), read offline.

    Quantized weights are de-quantized by transformers, which needs `gguf` (and `accelerate` for the
    loader). `progress=False` silences transformers' de-quantization bar.
    """
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"load_gguf needs {', '.join(missing)}: pip install {' '.join(missing)} "
                          "(or pip install 'looped-workbench[retrofit]')")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path={str(path)!r} is not a GGUF file")
    from transformers import LlamaForCausalLM

    with _quiet_transformers(not progress):
        llama = LlamaForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                                 dtype=dtype)
    return llama.eval()


def missing_model_files(path: str | os.PathLike) -> list[str]:
    """Return what a local Hugging Face model folder lacks of config.json and tokenizer.json ([] when whole)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return [f"the folder itself ({folder})"]
    return [name for name in ("config.json", "tokenizer.json") if not (folder / name).is_file()]


def load_base(path: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = False):
    """Return the causal LM (eval mode) stored at a local path, read offline: a directory or a GGUF file.

    A directory is one written by `save_pretrained` (config.json and weights) of a family in FAMILIES;
    a `.gguf` file goes through `load_gguf`. Errors name the path and what it lacks.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r} is invalid: must be a str or os.PathLike naming a local model")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"path={str(path)!r} does not exist: give a local directory written by "
                                "save_pretrained (config.json and weights) or a .gguf file")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"path={str(path)!r} holds no model: a file must be a .gguf; otherwise give the "
                             "directory written by save_pretrained")
        return load_gguf(p, dtype=dtype, progress=progress)
    if not (p / "config.json").is_file():
        raise ValueError(f"path={str(path)!r} holds no model: no config.json (give a directory written by "
                         "save_pretrained, or a .gguf file)")
    transformers = _transformers()
    import json

    try:
        kind = json.loads((p / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"path={str(path)!r} holds no model: its config.json is unreadable ({e})") from None
    if kind not in FAMILIES:
        raise ValueError(f"path={str(path)!r} holds model_type={kind!r}, which is not supported: the bases that "
                         f"convert are {', '.join(f'{c} (model_type {k!r})' for k, c in FAMILIES.items())}")
    cls = getattr(transformers, FAMILIES[kind])
    try:
        with _quiet_transformers(not progress):
            model = cls.from_pretrained(str(p), local_files_only=True, dtype=dtype)
    except OSError as e:  # config.json without weights
        raise ValueError(f"path={str(path)!r} holds no model weights that {FAMILIES[kind]} can read: {e}") from None
    return model.eval()


def _random_hf(family: str, vocab_size: int, d_model: int, layers: int, n_heads: int, n_kv_heads: int, d_ff: int,
               std: float, seed: int, rms_norm_eps: float):
    """Return a seeded random model of `family` ("Llama" or "Qwen2"; tied embeddings, rope_theta 10000), arguments checked."""
    transformers = _transformers()
    for name, v in (("vocab_size", vocab_size), ("d_model", d_model), ("layers", layers), ("n_heads", n_heads),
                    ("n_kv_heads", n_kv_heads), ("d_ff", d_ff)):
        check_int(name, v, 1)
    check_float("std", std, 0, lo_open=True)
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_ff, num_hidden_layers=layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=rms_norm_eps, tie_word_embeddings=True, initializer_range=std)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, f"{family}ForCausalLM")(cfg)
        with torch.no_grad():  # HF initialises biases at zero (Qwen2's q/k/v): draw them, so a lost bias shows
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0.0, std)
    return model.eval()


def random_llama(vocab_size: int = 128, d_model: int = 64, layers: int = 4, n_heads: int = 4,
                 n_kv_heads: int = 2, d_ff: int = 128, std: float = 0.02, seed: int = 0):
    """Return a seeded random LlamaForCausalLM (tied embeddings, rope_theta 10000) for fast retrofit runs."""
    return _random_hf("Llama", vocab_size, d_model, layers, n_heads, n_kv_heads, d_ff, std, seed, 1e-5)


def random_qwen2(vocab_size: int = 128, d_model: int = 64, layers: int = 4, n_heads: int = 4,
                 n_kv_heads: int = 2, d_ff: int = 128, std: float = 0.02, seed: int = 0):
    """Return a seeded random Qwen2ForCausalLM (tied embeddings, rope_theta 10000, q/k/v biases drawn with `std`)."""
    return _random_hf("Qwen2", vocab_size, d_model, layers, n_heads, n_kv_heads, d_ff, std, seed, 1e-6)
