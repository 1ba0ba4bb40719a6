"""Provenance for results, atomic writes (so an interrupted run never leaves half a file), netCDF."""

from __future__ import annotations

import datetime as _dt
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def git_commit(path: str | os.PathLike | None = None) -> str:
    """Return the git commit of the workbench source tree (or 'unknown' outside a git checkout)."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                             timeout=5, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(config: Any = None, seed: int | None = None, **extra: Any) -> dict[str, str | int | float]:
    """Return flat provenance attrs (config_json, git_commit, workbench_version, seed, created, extras).

    Values are strings or numbers only, because netCDF rejects dicts, None and bools.
    """
    from . import __version__

    attrs: dict[str, str | int | float] = {
        "config_json": config.to_json() if hasattr(config, "to_json") else ("" if config is None else str(config)),
        "git_commit": git_commit(),
        "workbench_version": __version__,
        "seed": -1 if seed is None else int(seed),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    for k, v in extra.items():
        attrs[k] = v if isinstance(v, (int, float, str)) and not isinstance(v, bool) else str(v)
    return attrs


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Return the path after writing data to it atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; results are meant to be shared like any file
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
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_netcdf(ds, path: str | os.PathLike) -> Path:
    """Return the path after writing an xarray Dataset as netCDF (engine h5netcdf) atomically."""
    return atomic_write_bytes(path, bytes(ds.to_netcdf(engine="h5netcdf")))
