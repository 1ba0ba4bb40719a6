"""Corpora: a named, hashed collection of documents (``Corpus``), built from a text source, ready to tokenize.

``load_corpus(name) -> Corpus`` for ``stdlib`` (default), ``shakespeare``, ``path:DIR_OR_FILE`` and
``hf:NAME``. What each source reads is described in ``workbench.data.sources``; the tokenizers live in
``workbench.data.tokenizers``, the token cache and the train/validation split in ``workbench.data.tokens``.
This module re-exports their public names, so ``from workbench.data.corpus import ...`` reaches all of them.

A corpus's content hash, byte and document counts are cached under ``default_cache_dir()``
(``$WORKBENCH_CACHE`` or ``~/.cache/looped-workbench``) in ``corpus-hashes/<key>.json``. For file sources
the key is a hash of (source, relative path, size, mtime_ns) of every file, so a warm load only stats the
files instead of re-reading and re-hashing them; a signature is not stored while any file is younger than
two seconds (the "racy" case, as git does), so an edit that keeps size and mtime is still seen. For
``hf:`` the key is the dataset's own fingerprint (``Dataset._fingerprint``) plus split and field.
"""

from __future__ import annotations

import hashlib
# importlib.util and subprocess are reached through this module by tests that patch
# importlib.util.find_spec (tokenizers.py) and subprocess.run (sources.py); keep both names here.
import importlib.util  # noqa: F401
import json
import subprocess  # noqa: F401
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np

from .files import atomic_write_bytes, cache_root, content_key, default_cache_dir, read_json_or_none
from .sources import SOURCES, fetch_shakespeare, open_source, read_text, safe_extract, stdlib_bytes, stdlib_files
from .tokenizers import (EOS, PRETRAINED, SPECIAL_TOKENS, ByteTokenizer, Tokenizer, check_bpe_vocab_size,
                         find_smollm2_gguf, pretrained_tokenizer, train_bpe)
from .tokens import TokenData, tokenize_corpus

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["EOS", "SPECIAL_TOKENS", "SOURCES", "PRETRAINED", "default_cache_dir", "stdlib_files", "stdlib_bytes",
           "safe_extract", "fetch_shakespeare", "Corpus", "load_corpus", "Tokenizer", "ByteTokenizer",
           "train_tokenizer", "find_smollm2_gguf", "pretrained_tokenizer", "TokenData", "tokenize_corpus",
           "BatchSampler"]

_RACY_S = 2.0          # files younger than this are not trusted to a stat signature


# ----------------------------------------------------------------------------- Corpus

class Corpus:
    """A named, ordered collection of text documents with a content hash for provenance.

    ``documents()`` iterates the texts in a fixed order. ``content_hash`` is the sha256 over the
    documents in order (each as an 8-byte little-endian UTF-8 length followed by its UTF-8 bytes),
    computed once per object and cached on disk under a cheap key (see the module docstring).
    """

    def __init__(self, name: str, documents: Callable[[], Iterator[str]], *, files: list[Path] | None = None,
                 root: Path | None = None, fingerprint: str | None = None, cache_dir=None,
                 options: dict[str, str | int | float] | None = None):
        self.name = name
        self.files = files
        self.root = root
        self.options = dict(options or {})
        self._documents = documents
        self._fingerprint = fingerprint
        self._cache_dir = cache_root(cache_dir)
        self._summary: dict | None = None

    def __repr__(self) -> str:
        return f"Corpus({self.name!r})"

    def documents(self) -> Iterator[str]:
        """Return an iterator over the documents, in the corpus's fixed order."""
        return self._documents()

    def _stat_key(self) -> tuple[str | None, bool]:
        """Return (cache key or None, racy) for the content summary."""
        if self.files is not None:
            now, racy, sig = time.time(), False, []
            for p in self.files:
                st = p.stat()
                racy |= st.st_mtime > now - _RACY_S
                sig.append((str(p.relative_to(self.root)) if self.root else str(p), st.st_size, st.st_mtime_ns))
            return content_key("files", self.name, self.options, sig), racy
        if self._fingerprint is not None:
            return content_key("fingerprint", self.name, self.options, self._fingerprint), False
        return None, False

    def _scan(self) -> dict:
        """Return the summary by reading and hashing every document."""
        h, n_docs, n_bytes = hashlib.sha256(), 0, 0
        for doc in self.documents():
            data = doc.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
            n_docs += 1
            n_bytes += len(data)
        return {"content_hash": h.hexdigest(), "n_documents": n_docs, "n_bytes": n_bytes}

    def summary(self) -> dict:
        """Return {"content_hash", "n_documents", "n_bytes"}, computed once (cached on disk when possible)."""
        if self._summary is None:
            key, racy = self._stat_key()
            path = self._cache_dir / "corpus-hashes" / f"{key}.json" if key else None
            cached = read_json_or_none(path) if path is not None and not racy else None
            if cached is not None and {"content_hash", "n_documents", "n_bytes"} <= cached.keys():
                self._summary = {k: cached[k] for k in ("content_hash", "n_documents", "n_bytes")}
            else:
                self._summary = self._scan()
                if path is not None and not racy:
                    try:
                        atomic_write_bytes(path, json.dumps({"source": self.name, **self._summary}).encode())
                    except OSError:  # a read-only cache only costs speed
                        pass
        return self._summary

    @property
    def content_hash(self) -> str:
        """Return the sha256 hex digest over the documents in order."""
        return self.summary()["content_hash"]

    @property
    def n_bytes(self) -> int:
        """Return the total UTF-8 size of the documents in bytes."""
        return self.summary()["n_bytes"]

    @property
    def n_documents(self) -> int:
        """Return the number of documents."""
        return self.summary()["n_documents"]

    def provenance(self) -> dict[str, str | int | float]:
        """Return a flat dict (str/number values) naming the source, its content hash and its size."""
        s = self.summary()
        out: dict[str, str | int | float] = {"corpus": self.name, "corpus_hash": s["content_hash"],
                                             "corpus_n_documents": s["n_documents"], "corpus_n_bytes": s["n_bytes"]}
        out.update({f"corpus_{k}": v for k, v in self.options.items()})
        return out


def load_corpus(name: str = "stdlib", cache_dir=None, **kw) -> Corpus:
    """Return the named text source as a Corpus: stdlib, shakespeare, path:DIR_OR_FILE or hf:NAME."""
    src = open_source(name, cache_dir, **kw)
    if src.files is None:
        return Corpus(src.name, src.documents, fingerprint=src.fingerprint, cache_dir=cache_dir, options=src.options)
    files = src.files

    def documents() -> Iterator[str]:
        """Yield each file's text in order (read when iterated, not now)."""
        for p in files:
            yield read_text(p)

    corpus = Corpus(src.name, documents, files=files, root=src.root, cache_dir=cache_dir, options=src.options)
    corpus.summary()  # validate every file now (cheap when the stat signature is cached)
    if corpus.n_bytes == 0:
        raise ValueError(f"corpus {src.name!r} is empty: its {len(files)} file(s) hold no text")
    return corpus


def train_tokenizer(corpus: Corpus | Iterable[str], vocab_size: int, seed: int = 0,
                    max_train_bytes: int | None = None, progress: bool = False) -> Tokenizer:
    """Return a byte-level BPE Tokenizer with vocab_size ids trained on the corpus (or iterable of str).

    Id 0 is ``<|endoftext|>``, ids 1..256 the bytes, merges after. The vocabulary can come out smaller
    than asked when the text has too few distinct pairs (``Tokenizer.vocab_size`` is the real size).
    ``max_train_bytes`` trains on a seeded random subset of the documents of about that size (``seed``
    picks it); training on the same text gives the same tokenizer.
    """
    check_bpe_vocab_size(vocab_size)
    if max_train_bytes is not None and max_train_bytes < 1:
        raise ValueError(f"max_train_bytes={max_train_bytes} is invalid: must be >= 1 or None")
    docs: Iterable[str] = corpus.documents() if isinstance(corpus, Corpus) else corpus
    total = corpus.n_documents if isinstance(corpus, Corpus) else None
    if max_train_bytes is not None and isinstance(corpus, Corpus) and corpus.n_bytes > max_train_bytes:
        docs, total = _sampled_documents(docs, max_train_bytes / corpus.n_bytes, max_train_bytes, seed), None
    if progress:
        from tqdm.auto import tqdm
        docs = tqdm(docs, total=total, unit="doc", desc="train tokenizer")
    return train_bpe(docs, vocab_size, total)


def _sampled_documents(docs: Iterable[str], keep: float, max_bytes: int, seed: int) -> Iterator[str]:
    """Yield each document with probability keep (seeded), stopping once about max_bytes have been yielded."""
    rng = np.random.default_rng(seed)
    budget = max_bytes
    for d in docs:
        if rng.random() < keep:
            yield d
            budget -= len(d.encode("utf-8"))
            if budget <= 0:
                return


# ----------------------------------------------------------------------------- batches

class BatchSampler:
    """Seeded packed batches ``[B, T+1]`` (torch.long) of contiguous token windows; resumable mid-epoch.

    The split is cut into ``len(tokens) // (T+1)`` non-overlapping windows (window w covers tokens
    ``w*(T+1) .. w*(T+1)+T``). Epoch e visits them in the order of a permutation seeded by (seed, e),
    ``batch_size`` at a time, so no two batches of an epoch share a token; with ``drop_last`` (default)
    the last ``n_windows % batch_size`` windows of each epoch's order are skipped, so every batch has the
    same shape. Iteration is endless: epochs follow one another.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, drop_last: bool = True):
        import torch  # noqa: F401  (fail early if missing; batches are torch tensors)

        if hasattr(tokens, "numpy") and not isinstance(tokens, np.ndarray):
            tokens = tokens.numpy()
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D numpy array, got {type(tokens).__name__} "
                             f"with shape {getattr(tokens, 'shape', None)}")
        for fname, v in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{fname}={v!r} is invalid: must be an int >= 1")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed={seed!r} is invalid: must be an int >= 0")
        self.window = int(seq_len) + 1
        if self.window > len(tokens):
            raise ValueError(f"seq_len={seq_len} is too long: a window of seq_len+1={self.window} tokens does not "
                             f"fit in the {len(tokens)} tokens given")
        self.tokens = tokens
        self.batch_size, self.seq_len, self.seed, self.drop_last = int(batch_size), int(seq_len), int(seed), drop_last
        self.n_windows = len(tokens) // self.window
        if drop_last and self.n_windows < self.batch_size:
            raise ValueError(f"batch_size={batch_size} is too large: only {self.n_windows} windows of seq_len+1="
                             f"{self.window} tokens fit in {len(tokens)} tokens")
        self.batches_per_epoch = (self.n_windows // self.batch_size if drop_last
                                  else -(-self.n_windows // self.batch_size))
        self.epoch, self.position = 0, 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> "BatchSampler":
        return self

    def window_order(self, epoch: int) -> np.ndarray:
        """Return the permutation of window indices that epoch visits."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return self._order_cache[1]

    def __next__(self) -> "torch.Tensor":
        import torch

        idx = self.window_order(self.epoch)[self.position * self.batch_size:(self.position + 1) * self.batch_size]
        starts = idx.astype(np.int64) * self.window
        batch = self.tokens[starts[:, None] + np.arange(self.window)]
        self.position += 1
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return torch.from_numpy(batch.astype(np.int64))

    def state_dict(self) -> dict[str, int]:
        """Return the sampler position as a small JSON-able dict."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "batch_size": self.batch_size,
                "seq_len": self.seq_len, "n_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position saved by state_dict (the data and shape must match); returns None."""
        for k in ("batch_size", "seq_len", "n_tokens"):
            if k in state and state[k] != self.state_dict()[k]:
                raise ValueError(f"state {k}={state[k]} does not match this sampler's {k}={self.state_dict()[k]}")
        for k in ("seed", "epoch", "position"):
            if k not in state:
                raise ValueError(f"state is missing {k!r}")
        if not 0 <= int(state["position"]) < self.batches_per_epoch or int(state["epoch"]) < 0:
            raise ValueError(f"state position={state['position']} epoch={state['epoch']} is out of range "
                             f"(batches_per_epoch={self.batches_per_epoch})")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        self._order_cache = None
