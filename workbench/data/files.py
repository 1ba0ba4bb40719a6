"""The data room's file helpers: the cache folder, content keys, lenient JSON reads and atomic writes.

They live here, not in `workbench.io`, because `io` reads tokenizers from `data` (`io.load_tokenizer`):
`data` importing `io` back made the two modules an import circle.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """Return the cache directory: $WORKBENCH_CACHE if set, else ~/.cache/looped-workbench."""
    env = os.environ.get("WORKBENCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "looped-workbench"


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """Return cache_dir as a Path (user folder expanded), or default_cache_dir() when it is None."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def content_key(*parts: Any) -> str:
    """Return the sha256 hex digest of the parts serialized as sorted-key JSON (a stable cache key)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def read_json_or_none(path: Path) -> dict | None:
    """Return the JSON stored at path, or None when it is missing or unreadable (a cache miss, not an error)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Return the path after writing data to it atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; caches are meant to be shared like any file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """Return the process umask."""
    mask = os.umask(0)  # the only way to read the umask is to set it; put it straight back
    os.umask(mask)
    return mask
