"""Reading a run's results.nc for the findings readers, cached by the file's identity.

The readers load the same few hundred committed runs once per comparison, and h5netcdf opens each of a
file's ~40 variables separately (about 0.15 s a file), which was most of their time. A cached read is
keyed on (path, inode, size, modification time), so a rewritten file (`io.save_netcdf` replaces it
atomically: a new inode) is read again, and each caller gets a copy of its own.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import xarray as xr

from ..io import RunDir


def load_results(run_dir: str | os.PathLike) -> xr.Dataset:
    """Return run_dir/results.nc as an in-memory Dataset of the caller's own (changing it changes no other copy)."""
    path = Path(RunDir(run_dir).results).resolve()
    st = path.stat()  # FileNotFoundError names the path, as xarray's own open would
    return _load(str(path), st.st_ino, st.st_size, st.st_mtime_ns).copy(deep=True)


@functools.lru_cache(maxsize=512)  # results files are small (~0.2 MB): a few hundred fit easily
def _load(path: str, inode: int, size: int, mtime_ns: int) -> xr.Dataset:
    """Return the Dataset at path loaded into memory (the arguments after path only key the cache)."""
    return xr.load_dataset(path, engine="h5netcdf")
