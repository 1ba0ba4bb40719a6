"""LoopLM as a transformers model at any loop count: config, causal-LM wrapper, tokenizer, export.

Importing this module registers `LoopLMConfig` (model_type "workbench_looplm") with `AutoConfig` and
`LoopLMForCausalLM` with `AutoModelForCausalLM`, so an exported folder opens without
`trust_remote_code`:

    import workbench.models.hf_looped  # noqa: F401  (registers the classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder)      # config.loops: the loop count in use
    logits = model(ids, loops=8).logits                       # any r >= 1 per call
    out = model.generate(ids, max_new_tokens=20, loops=8)     # cached: one pass per new token

`LoopLMForCausalLM` holds the workbench's own `LoopLM` (`.looplm`) and runs it through `LoopLM.run`,
the one loop; nothing here re-drives the blocks. `generate` uses the workbench's key/value cache
(`models.kv_cache.KVCache`, one entry per block occurrence), wrapped as `LoopCache`, so a new token
costs one loop pass and greedy decoding gives the tokens of `workbench.models.generate.generate` at
temperature 0. An `attention_mask` with padding (left padding in batched generation, right padding
anywhere) is honoured: padded keys are never attended to and each row counts its own positions.

`export(model, tokenizer, folder)` writes the Hub layout (model.safetensors, config.json,
generation_config.json and a `PreTrainedTokenizerFast` built from the run's tokenizer.json);
`workbench export RUN DIR` does it for a run folder. Needs transformers >= 5.24
(`pip install 'looped-workbench[hf]'`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    import transformers
    from packaging.version import Version
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("workbench.models.hf_looped needs transformers >= 5.24: "
                      "pip install 'looped-workbench[hf]'") from e

MIN_TRANSFORMERS = "5.24"
if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:  # pragma: no cover
    # 5.24's generate passes the cache as `cache=` (older releases: past_key_values) and builds configs as dataclasses
    raise ImportError(f"workbench.models.hf_looped needs transformers >= {MIN_TRANSFORMERS}, found "
                      f"{transformers.__version__}: pip install 'looped-workbench[hf]'")

from transformers import (AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig,  # noqa: E402
                          PreTrainedModel, PreTrainedTokenizerFast)
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from ..config import LoopConfig, check_bool, check_int, fail  # noqa: E402
from .kv_cache import KVCache  # noqa: E402
from .looped import LoopLM, lm_loss  # noqa: E402

MODEL_TYPE = "workbench_looplm"
WEIGHTS = "model.safetensors"


def check_loops(value: Any, name: str = "loops") -> int:
    """Return the loop count as an int if it is an integer >= 1, else ValueError naming it and its value."""
    return check_int(name, value, 1, allowed="must be an integer >= 1 (the number of passes through the core)")


class LoopLMConfig(PreTrainedConfig):
    """A LoopLM's transformers config: `loop_config` (the LoopConfig fields) and `loops`, the loop count in use.

    `loops` (default: the training loop count K, `loop_config["loops"]`) is what a forward pass or
    `generate` runs unless it is given `loops=`. The standard attributes transformers and lm-eval read
    (vocab_size, hidden_size, num_attention_heads, num_key_value_heads, max_position_embeddings,
    tie_word_embeddings) mirror the LoopConfig and are recomputed from it on load.
    """

    model_type = MODEL_TYPE

    loop_config: dict | None = None
    loops: int | None = None
    init_seed: int = 0
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        cfg = LoopConfig.from_dict(dict(self.loop_config)) if self.loop_config is not None else LoopConfig()
        self.loop_config = cfg.to_dict()
        self.loops = cfg.loops if self.loops is None else check_loops(self.loops, "LoopLMConfig.loops")
        check_int("LoopLMConfig.init_seed", self.init_seed)
        super().__post_init__(**kwargs)
        # mirrors, set after the saved values (which come back as kwargs): the LoopConfig decides them
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.d_model
        self.num_attention_heads = cfg.n_heads
        self.num_key_value_heads = cfg.kv_heads
        self.max_position_embeddings = cfg.max_seq_len
        self.tie_word_embeddings = cfg.tie_embeddings

    @property
    def looped(self) -> LoopConfig:
        """Return the LoopConfig this config holds."""
        return LoopConfig.from_dict(dict(self.loop_config))


class LoopCache:
    """The key/value cache of one sequence batch decoded by `LoopLMForCausalLM`: a workbench KVCache and its loop count.

    Every block occurrence of the loop pass (prelude.i, core.t.j, coda.i) keeps its own keys and
    values, so the loop count (and horizon) must stay the same for the whole sequence.
    """

    is_compileable = False
    is_croppable = False
    is_linear = (False,)

    def __init__(self, batch: int, capacity: int, device, loops: int):
        self.kv = KVCache(batch, capacity, device)
        self.loops = loops

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Return the number of positions cached (padding included)."""
        return self.kv.length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Return None after keeping, for each row, the cached row beam_idx names (beam search)."""
        # KVCache has no row selection of its own; its per-row state is the entries, keep, pos and seen
        kv, idx = self.kv, beam_idx.to(self.kv.device)
        for e in kv.entries.values():
            if e.k is not None:
                e.k, e.v = e.k.index_select(0, idx.to(e.k.device)), e.v.index_select(0, idx.to(e.v.device))
        kv.keep, kv.pos, kv.seen = kv.keep[idx], kv.pos[idx], kv.seen[idx]
        kv.batch = int(idx.numel())


class LoopLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A workbench LoopLM (`.looplm`) as a transformers causal LM: forward, generate, save_pretrained at any loop count.

    `LoopLMForCausalLM.from_looplm(looplm, tokenizer=...)` wraps a LoopLM without copying its weights;
    `from_pretrained(folder)` opens an exported folder. `forward(input_ids, loops=r)` runs r loops
    (default `config.loops`); `looping(r)` sets that default for a block (what lm-eval sweeps use).
    """

    config_class = LoopLMConfig
    base_model_prefix = "looplm"
    main_input_name = "input_ids"
    _tied_weights_keys: dict = {}  # a tied LoopLM has one embedding matrix and no head to tie

    def __init__(self, config: LoopLMConfig, looplm: LoopLM | None = None):
        super().__init__(config)
        check_loops(config.loops, "config.loops")  # from_pretrained(..., loops=r) sets it past LoopLMConfig's check
        if looplm is None:
            looplm = LoopLM(config.looped, seed=config.init_seed)
        elif not isinstance(looplm, LoopLM):
            fail("looplm", type(looplm).__name__, "must be a workbench LoopLM")
        elif looplm.cfg != config.looped:
            fail("looplm", looplm.cfg.notation, f"has another LoopConfig than config.loop_config ({config.looped})")
        self.looplm = looplm
        self.tokenizer = None  # a PreTrainedTokenizerFast attached by from_looplm; save_pretrained writes it too
        self.post_init()

    # ---- construction and files -------------------------------------------------------------------
    @classmethod
    def from_looplm(cls, looplm: LoopLM, tokenizer=None, loops: int | None = None) -> "LoopLMForCausalLM":
        """Return a wrapper sharing looplm's modules (no copy), with `tokenizer` attached and `loops` as config.loops.

        `tokenizer` is a workbench Tokenizer or a PreTrainedTokenizerFast (`hf_tokenizer`); its
        end-of-text id becomes the eos and pad id of the config, so `generate` stops there.
        """
        if not isinstance(looplm, LoopLM):
            fail("looplm", type(looplm).__name__, "must be a workbench LoopLM")
        cfg = looplm.cfg
        tok = None if tokenizer is None else hf_tokenizer(tokenizer, cfg.max_seq_len)
        if tok is not None and len(tok) > cfg.vocab_size:
            fail("tokenizer", f"a tokenizer of {len(tok)} ids", f"has more ids than the model (vocab_size="
                 f"{cfg.vocab_size}): it is not this model's tokenizer")
        eos = None if tok is None else tok.eos_token_id
        config = LoopLMConfig(loop_config=cfg.to_dict(), loops=cfg.loops if loops is None else check_loops(loops),
                              init_seed=int(getattr(looplm, "seed", 0)), eos_token_id=eos, pad_token_id=eos,
                              dtype=looplm.embed.weight.dtype)
        model = cls(config, looplm=looplm)
        model.tokenizer = tok
        return model.train(looplm.training)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Return the model saved in an exported folder; ValueError naming the folder when it is not one."""
        check_export_folder(pretrained_model_name_or_path)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Return None after writing config.json and model.safetensors (and the attached tokenizer's files)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(save_directory)

    def _init_weights(self, module):
        # LoopLM draws its own weights from its seed when it is built; from_pretrained overwrites them all
        pass

    def get_input_embeddings(self):
        """Return the token embedding (nn.Embedding)."""
        return self.looplm.embed

    def get_output_embeddings(self):
        """Return the LM head (nn.Linear), or None when it is the embedding (tied)."""
        return self.looplm.head

    # ---- the loop count -----------------------------------------------------------------------------
    @contextmanager
    def looping(self, loops: int):
        """Yield this model with config.loops = loops inside the block (the old count comes back after it)."""
        r, old = check_loops(loops), self.config.loops
        self.config.loops = r
        try:
            yield self
        finally:
            self.config.loops = old

    # ---- forward -------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: LoopCache | None = None, labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                loops: int | None = None, logits_to_keep: int = 0, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        """Return CausalLMOutputWithPast(loss, logits, cache, hidden_states) after `loops` loops (default config.loops).

        attention_mask [B, cached + T] (1 = token, 0 = padding) covers the cached positions and the new
        ones; positions are counted per row over its tokens (position_ids are not accepted). With
        `use_cache=True` (what generate passes) or a `cache`, the new tokens run on top of the cache and
        the returned cache holds them. `labels` are shifted here (HF's convention; -100 is ignored).
        `logits_to_keep=n` computes the last n positions' logits only (0: all). With
        `output_hidden_states`, hidden_states are the loop states 0..r of the new tokens (0 is h0).
        """
        if kwargs.get("position_ids") is not None:
            raise ValueError("position_ids are not supported: LoopLM counts each row's positions over its tokens, "
                             "as attention_mask marks them")
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("inputs_embeds are not supported: give input_ids")
        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in ("position_ids", "inputs_embeds",
                                                                                     "output_attentions"))
        if unknown:
            raise TypeError(f"LoopLMForCausalLM.forward got unexpected arguments {unknown}")
        if input_ids is None:
            raise ValueError("input_ids are required: a [batch, seq] tensor of token ids")
        r = check_loops(self.config.loops if loops is None else loops)
        check_int("logits_to_keep", logits_to_keep, 0)
        states = bool(output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states)
        net = self.looplm
        B, T = input_ids.shape
        past = 0 if cache is None else cache.kv.length
        keep = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] != past + T:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} is invalid: must be "
                                 f"[batch, cached + new] = [{B}, {past + T}]")
            keep = attention_mask[:, past:].to(device=input_ids.device, dtype=torch.bool)
        cached = cache is not None or bool(use_cache)
        if cached or (keep is not None and not bool(keep.all())):
            if keep is None:
                keep = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
            if cache is None:
                cache = LoopCache(B, T, input_ids.device, r)
            elif cache.loops != r:
                fail("loops", r, f"must stay {cache.loops} for a cached sequence: its cache holds the keys and values "
                     f"of {cache.loops} loops (start a new sequence to change the loop count)")
            kv = cache.kv
            kv.open(keep)
            p = net.run(input_ids, r, kv=kv, keep_states=states)
            feats = net.features(p.state, kv=kv)
            kv.commit()
            if not cached:
                cache = None  # padding without a cache: the KVCache only served as the masked attention
        else:
            p = net.run(input_ids, r, keep_states=states, coda=True)
            feats = p.features
        if logits_to_keep:
            feats = feats[:, -logits_to_keep:]
        logits = F.linear(feats, net.head_weight)
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} is invalid: must equal input_ids' shape "
                                 f"{tuple(input_ids.shape)}")
            if logits_to_keep:
                raise ValueError("labels need the logits of every position: leave logits_to_keep at 0")
            loss = lm_loss(logits[:, :-1], labels[:, 1:].to(logits.device))
        hidden = tuple(p.states) if states else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache, hidden_states=hidden)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate must not make a DynamicCache: the first cached forward makes a LoopCache, returned as `cache`
        return False


def check_export_folder(path) -> Path | None:
    """Return the folder as a Path if it holds an exported LoopLM (None for a Hub name); else ValueError naming it."""
    if not isinstance(path, (str, os.PathLike)):
        fail("path", path, "must be a str or os.PathLike naming a folder written by save_pretrained / export")
    p = Path(path).expanduser()
    if not p.exists():
        if isinstance(path, str) and path.count("/") == 1 and not path.startswith((".", "/", "~")):
            return None  # a Hub name (owner/name): transformers resolves it
        raise ValueError(f"path={str(path)!r} does not exist: give a folder written by "
                         "LoopLMForCausalLM.save_pretrained or `workbench export RUN DIR`")
    if not p.is_dir():
        raise ValueError(f"path={str(path)!r} is a file, not an exported model: give the folder written by "
                         "`workbench export RUN DIR`")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ValueError(f"path={str(path)!r} is not an exported LoopLM: it has no config.json (export a run with "
                         "`workbench export RUN DIR`)")
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"path={str(path)!r} is not an exported LoopLM: its config.json is unreadable ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"path={str(path)!r} is not an exported LoopLM: its config.json is not a JSON object")
    kind = data.get("model_type")
    if kind != MODEL_TYPE:
        hint = (" It is a workbench run folder: export it first with `workbench export RUN DIR`."
                if {"model", "train"} <= set(data) else "")
        raise ValueError(f"path={str(path)!r} is not an exported LoopLM: config.json has model_type={kind!r}, "
                         f"not {MODEL_TYPE!r}.{hint}")
    if not any((p / f).is_file() for f in (WEIGHTS, WEIGHTS + ".index.json")):
        raise ValueError(f"path={str(path)!r} is not a complete exported LoopLM: it has config.json but no {WEIGHTS}")
    return p


def hf_tokenizer(tokenizer, max_seq_len: int | None = None) -> PreTrainedTokenizerFast:
    """Return a PreTrainedTokenizerFast of a workbench Tokenizer (its tokenizer.json), or the HF tokenizer given.

    The end-of-text token is the eos and the pad token (batches pad on the left, as decoder-only
    generation wants); `max_seq_len` becomes model_max_length. As the workbench tokenizer does, it
    encodes special tokens written in text as plain text and cleans up no spaces on decode, so ids
    and text are the workbench tokenizer's.
    """
    if isinstance(tokenizer, PreTrainedTokenizerFast):
        return tokenizer
    if not (hasattr(tokenizer, "to_json") and hasattr(tokenizer, "eos_token")):
        fail("tokenizer", type(tokenizer).__name__, "must be a workbench Tokenizer (a run's tokenizer.json) or a "
             "PreTrainedTokenizerFast; a byte-level model without tokenizer.json has no Hub tokenizer here")
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(tokenizer.to_json())  # a copy: transformers sets padding and truncation on its backend
    kw = {} if max_seq_len is None else {"model_max_length": check_int("max_seq_len", max_seq_len, 1)}
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tokenizer.eos_token,
                                  pad_token=tokenizer.eos_token, clean_up_tokenization_spaces=False,
                                   split_special_tokens=True, padding_side="left", **kw)


def as_hf(model, tokenizer=None) -> LoopLMForCausalLM:
    """Return model as a LoopLMForCausalLM: a LoopLM is wrapped (shared weights), a wrapper is returned unchanged."""
    if isinstance(model, LoopLMForCausalLM):
        return model
    if isinstance(model, LoopLM):
        return LoopLMForCausalLM.from_looplm(model, tokenizer=tokenizer)
    fail("model", type(model).__name__, "must be a workbench LoopLM or a LoopLMForCausalLM")


def export(model, tokenizer, out_dir: str | os.PathLike, loops: int | None = None, overwrite: bool = False) -> Path:
    """Return the folder after writing model (LoopLM or wrapper) and tokenizer there in the Hub layout.

    Files: config.json (loop_config, and loops: `loops`, else the wrapper's config.loops or the
    LoopLM's training K), model.safetensors, generation_config.json and the tokenizer's files. The
    folder is written under a temporary name beside it and renamed into place; an existing non-empty
    folder is refused unless it holds an earlier export and `overwrite` is set.
    """
    check_bool("overwrite", overwrite)
    out = check_export_target(out_dir, overwrite)
    if tokenizer is None:
        fail("tokenizer", None, "is needed: the export holds the tokenizer files beside the weights")
    hf = as_hf(model, tokenizer)
    r = hf.config.loops if loops is None else check_loops(loops)
    tok = hf_tokenizer(tokenizer, hf.config.max_position_embeddings)
    if hf.config.eos_token_id is None:  # a wrapper made without a tokenizer learns its end-of-text id here
        for c in (hf.config, hf.generation_config):
            c.eos_token_id = c.pad_token_id = tok.eos_token_id
    elif tok.eos_token_id != hf.config.eos_token_id:
        fail("tokenizer", f"eos id {tok.eos_token_id}", f"differs from the model config's eos_token_id="
             f"{hf.config.eos_token_id}: it is not the tokenizer this model was wrapped with")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with hf.looping(r):
            PreTrainedModel.save_pretrained(hf, tmp)  # the wrapper's own save also writes an attached tokenizer
        tok.save_pretrained(tmp)
        old = None
        if out.exists():  # an empty folder or, with overwrite, an earlier export: moved aside until the new one is in
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            if old is not None:
                old.rename(out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_export_target(out_dir, overwrite: bool = False) -> Path:
    """Return out_dir as a Path if an export may write there (absent, empty, an earlier export with overwrite).

    Anything else raises ValueError naming DIR: a file, a non-empty folder without overwrite, and with
    overwrite a folder that is not an exported LoopLM (an export never deletes other files).
    """
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir).strip():
        fail("DIR", out_dir, "must name a folder to write the exported model to")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        fail("DIR", str(out_dir), "is a file: give a folder (absent or empty)")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            fail("DIR", str(out_dir), "exists and is not empty: give an absent or empty folder, or --overwrite "
                 "(overwrite=True) to replace the model exported there; nothing was written")
        try:
            check_export_folder(out)
        except ValueError:  # overwrite replaces an earlier export, never a folder of other files
            fail("DIR", str(out_dir), "holds files that are not an exported LoopLM: --overwrite (overwrite=True) only "
                 "replaces an earlier export; give another folder, or empty this one yourself; nothing was written")
    return out


def _register() -> None:
    """Register the config and model with transformers' Auto classes (idempotent)."""
    AutoConfig.register(MODEL_TYPE, LoopLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(LoopLMConfig, LoopLMForCausalLM, exist_ok=True)


_register()
