"""The token cache: a corpus tokenized once, split into train and validation, memory-mapped afterwards.

Under the cache folder, ``tokens/<key>.bin`` + ``<key>.json`` hold one flat uint16 (uint32 for
vocabularies above 65536) token array keyed by corpus hash + tokenizer fingerprint + validation fraction;
the train part comes first, the validation part last. The array is written to a temporary name and
renamed into place; the JSON is written last and marks the entry complete.

Train/validation split (``tokenize_corpus``): every document is followed by the end-of-text token and
goes wholly to one side, chosen by a hash of its index (``val`` when the hash maps below
``val_fraction``). When that does not give a validation share within [f/2, 2f] of the tokens (too few
documents, e.g. a single file), the split falls back to the last ``val_fraction`` of the token stream
(one document may then straddle the cut). ``TokenData.split`` says which was used. Either way train and
validation are disjoint slices of the same array.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Protocol

import numpy as np

from .files import atomic_write_bytes, cache_root, content_key, read_json_or_none
from .tokenizers import Tokenizer

_TOKEN_FORMAT = 1      # bump when the token-cache layout changes


# a structural type rather than an import of corpus.Corpus: corpus.py imports this module
class CorpusLike(Protocol):
    """What the token cache reads of a corpus (a `workbench.data.corpus.Corpus` has all of it)."""

    name: str

    @property
    def content_hash(self) -> str:
        """Return the hash of the documents in order (half of the cache key)."""

    @property
    def n_bytes(self) -> int:
        """Return the documents' total UTF-8 size (for the progress bar)."""

    def documents(self) -> Iterator[str]:
        """Return an iterator over the documents in their fixed order."""

    def provenance(self) -> dict[str, str | int | float]:
        """Return the flat provenance dict stored with the tokens."""


@dataclass(frozen=True, eq=False)
class TokenData:
    """Tokenized corpus: disjoint read-only ``train`` and ``val`` arrays (memmaps) plus their provenance."""

    train: np.ndarray
    val: np.ndarray
    eos_id: int
    vocab_size: int
    split: str                       # "document" or "tail"
    path: Path
    meta: dict = field(repr=False)

    def provenance(self) -> dict[str, str | int | float]:
        """Return a flat dict (str/number values): corpus provenance, tokenizer fingerprint, split sizes."""
        keys = ("corpus", "corpus_hash", "corpus_n_documents", "corpus_n_bytes", "tokenizer_fingerprint",
                "vocab_size", "split", "val_fraction", "n_train_tokens", "n_val_tokens")
        out = {k: self.meta[k] for k in keys}
        out.update({k: v for k, v in self.meta.items() if k.startswith("corpus_") and k not in out})
        return out


def tokenize_corpus(corpus: CorpusLike, tokenizer: Tokenizer, cache_dir=None, progress: bool = True,
                    val_fraction: float = 0.05) -> TokenData:
    """Return the corpus tokenized (documents joined by eos) and split, from the on-disk cache when present.

    The cache key is corpus hash + tokenizer fingerprint + val_fraction; a warm call reads one small JSON
    file and memory-maps the token file, without touching the tokenizer or the text.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} is invalid: must be in (0, 1)")
    root = cache_root(cache_dir) / "tokens"
    key = content_key(_TOKEN_FORMAT, corpus.content_hash, tokenizer.fingerprint, float(val_fraction))[:32]
    bin_path, meta_path = root / f"{key}.bin", root / f"{key}.json"
    meta = read_json_or_none(meta_path)
    if (meta is not None and meta.get("format") == _TOKEN_FORMAT and bin_path.exists()
            and bin_path.stat().st_size == meta["n_tokens"] * np.dtype(meta["dtype"]).itemsize):
        return _open_tokens(bin_path, meta)

    root.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    fd, tmp_all = tempfile.mkstemp(dir=root, prefix=f".{key}.all.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            lens = _write_documents(f, corpus, tokenizer, dtype, progress)
        n = int(lens.sum())
        if n < 2:
            raise ValueError(f"corpus {corpus.name!r} gives {n} token(s): too few to split into train and validation")
        split, n_val = _place_split(Path(tmp_all), lens, dtype, val_fraction, bin_path)
    finally:
        if os.path.exists(tmp_all):  # the tail split renamed it into place; otherwise it is scratch
            os.unlink(tmp_all)
    meta = {"format": _TOKEN_FORMAT, "key": key, "dtype": dtype.name, "n_tokens": n, "n_train_tokens": n - n_val,
            "n_val_tokens": n_val, "split": split, "val_fraction": float(val_fraction), "eos_id": tokenizer.eos_id,
            "vocab_size": tokenizer.vocab_size, "tokenizer_fingerprint": tokenizer.fingerprint,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **corpus.provenance()}
    atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
    return _open_tokens(bin_path, meta)


def _write_documents(f: BinaryIO, corpus: CorpusLike, tokenizer: Tokenizer, dtype: np.dtype,
                     progress: bool) -> np.ndarray:
    """Return the token count of each document (eos included) after writing them, each eos-terminated, to f."""
    from tqdm.auto import tqdm

    eos = tokenizer.eos_id
    lengths: list[int] = []
    with tqdm(total=corpus.n_bytes, unit="B", unit_scale=True, disable=not progress,
              desc=f"tokenize {corpus.name}") as bar:
        for batch in _batched_docs(corpus.documents()):
            for ids in tokenizer.encode_batch(batch):
                arr = np.empty(len(ids) + 1, dtype=dtype)
                arr[:-1] = ids
                arr[-1] = eos
                f.write(arr.tobytes())
                lengths.append(len(arr))
            bar.update(sum(len(d.encode("utf-8")) for d in batch))
    return np.asarray(lengths, dtype=np.int64)


def _place_split(tmp_all: Path, lens: np.ndarray, dtype: np.dtype, val_fraction: float,
                 bin_path: Path) -> tuple[str, int]:
    """Return (split, n_val) after moving the token stream in tmp_all to bin_path, train part first.

    Whole documents go to validation when their hashes give a share within [f/2, 2f] of the tokens;
    otherwise the last val_fraction of the stream is validation and the file is renamed as it is.
    """
    n = int(lens.sum())
    in_val = np.fromiter((_unit_hash(i) < val_fraction for i in range(len(lens))), dtype=bool, count=len(lens))
    n_val = int(lens[in_val].sum())
    if len(lens) >= 2 and 0 < n_val < n and 0.5 * val_fraction * n <= n_val <= 2.0 * val_fraction * n:
        _reorder_documents(tmp_all, lens, in_val, dtype, bin_path)
        return "document", n_val
    os.replace(tmp_all, bin_path)
    return "tail", min(n - 1, max(1, round(n * val_fraction)))


def _reorder_documents(tmp_all: Path, lens: np.ndarray, in_val: np.ndarray, dtype: np.dtype,
                       bin_path: Path) -> None:
    """Write the documents of tmp_all to bin_path, train documents first and validation documents last."""
    src = np.memmap(tmp_all, dtype=dtype, mode="r", shape=(int(lens.sum()),))
    offsets = np.concatenate([[0], np.cumsum(lens)])
    fd, tmp_out = tempfile.mkstemp(dir=bin_path.parent, prefix=f".{bin_path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for side in (False, True):
                for i in np.flatnonzero(in_val == side):
                    f.write(src[offsets[i]:offsets[i + 1]].tobytes())
            f.flush()
            os.fsync(f.fileno())
        del src  # close the map before the caller unlinks its file
        os.replace(tmp_out, bin_path)
    finally:
        if os.path.exists(tmp_out):
            os.unlink(tmp_out)


def _unit_hash(i: int) -> float:
    """Return a fixed pseudo-random number in [0, 1) for document index i (which side it goes to)."""
    return int.from_bytes(hashlib.sha256(f"val:{i}".encode()).digest()[:8], "little") / 2.0 ** 64


def _batched_docs(docs: Iterable[str], max_docs: int = 256, max_chars: int = 1 << 22) -> Iterator[list[str]]:
    """Yield lists of documents, each list at most max_docs long or just past max_chars characters."""
    batch, n = [], 0
    for d in docs:
        batch.append(d)
        n += len(d)
        if len(batch) >= max_docs or n >= max_chars:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def _open_tokens(bin_path: Path, meta: dict) -> TokenData:
    """Return the TokenData of a complete cache entry, memory-mapped read-only."""
    arr = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["n_tokens"],))
    n_train = meta["n_train_tokens"]
    return TokenData(train=arr[:n_train], val=arr[n_train:], eos_id=meta["eos_id"], vocab_size=meta["vocab_size"],
                     split=meta["split"], path=bin_path, meta=meta)
