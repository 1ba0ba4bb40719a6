"""Files: provenance for results, atomic writes, netCDF, safetensors checkpoints and the run folder.

Every training run (`workbench train --out DIR`, `experiments.train_run`, the train notebook, a
pipeline's train step) writes ONE layout, and `open_run` / `load_model` read it:

    <run>/
      config.json          {"model": LoopConfig fields, "train": TrainConfig fields,
                            "data": {corpus, tasks, task_ratio, task_depths, seed, vocab_size}}
      tokenizer.json       the run's tokenizer (tokenizers JSON, `data.corpus.Tokenizer`)
      latest.json          the manifest: {"checkpoint": "ckpt-00000400", "step": 400, "files": {...}},
                           the newest complete checkpoint and digests of the config.json and
                           tokenizer.json it was trained with; {"failed": {"step", "error"}} when the
                           run stopped on divergence ("checkpoint" is then its last finite one, or null)
      ckpt-00000400/       model.safetensors, optim.safetensors, state.json (step, model and train
                           config, sampler position, RNG state, metrics so far)
      metrics.nc           per-step training metrics (the Trainer's)
      results.nc           summary Dataset (train_run and the train notebook: loss per loop, ...)

A pipeline's run folder is the same folder, plus the runner's run.json, notebook.ipynb and figures/.
A checkpoint is written to a temporary folder and renamed into place; latest.json is replaced only
after that, so a run killed mid-write resumes from the previous checkpoint. Never pickle.

The files form one consistent set: each checkpoint's state.json and latest.json record the sha256 of
tokenizer.json and of config.json's "model" and "data" (not "train": a resumed run may extend its
budget), and `find_run` refuses a folder whose files no longer match them, naming the file, so a
half-overwritten folder (new tokenizer, old checkpoint) cannot load. `clear_run` removes a run's files
pointer first, so an interrupted overwrite never leaves an old checkpoint looking complete.

Also opened (written by older code): `<run>/model/` holding the checkpoints, tokenizer.json and
experiment.json (train_run before the layout was unified), and a bare Trainer out_dir (checkpoints
and latest.json only; the tokenizer is given, or bytes for a 256-id model).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import strict_json
# one atomic write for the whole package; it lives in data/ because io reads tokenizers from data (not back)
from .data.files import atomic_write_bytes  # noqa: E402,F401 (public here too)

if TYPE_CHECKING:  # annotations only: io sits below models at run time
    from .models.looped import LoopLM


class RunDir:
    """A run folder and the name of every file in it: the one place a run file's name is spelled.

    `RunDir(path).results` is `path/results.nc`; the library, the notebooks and the tests reach run
    files through these attributes, so renaming one is one edit (tests/test_rooms.py checks that no
    other module spells them).
    """

    CONFIG = "config.json"          # model, train and data settings
    TOKENIZER = "tokenizer.json"    # the run's tokenizer
    LATEST = "latest.json"          # the newest complete checkpoint (the manifest)
    METRICS = "metrics.nc"          # per-step training metrics
    RESULTS = "results.nc"          # the run's summary Dataset
    PROGRESS = "progress.json"      # live progress, rewritten while training
    RECORD = "run.json"             # a pipeline run's record (status, params, timings)
    NOTEBOOK = "notebook.ipynb"     # a pipeline run's executed notebook
    NOTEBOOK_HTML = "notebook.html"  # ... rendered
    FIGURES = "figures"             # plotly figure JSON (and PNG) folder
    LM_EVAL_TASKS = "lm_eval_tasks"  # an lm-eval step's local task YAMLs and their JSONL documents
    KERNEL_LOG = "kernel.log"       # a pipeline run's kernel stderr
    EXPERIMENT = "experiment.json"  # older layout: data settings beside model/
    MODEL_DIR = "model"             # older layout: checkpoints and tokenizer in <run>/model/
    CKPT_PREFIX = "ckpt-"           # checkpoint folders: ckpt-00000400
    CKPT_MODEL = "model.safetensors"   # in a checkpoint folder: the weights
    CKPT_OPTIM = "optim.safetensors"   # ... the optimiser state
    CKPT_STATE = "state.json"          # ... step, configs, sampler position, RNG, manifest

    __slots__ = ("path",)

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    def __eq__(self, other) -> bool:
        return isinstance(other, RunDir) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def name(self) -> str:
        """Return the folder's name (a pipeline run's key)."""
        return self.path.name

    config = property(lambda self: self.path / RunDir.CONFIG, doc="Return the path of config.json.")
    tokenizer = property(lambda self: self.path / RunDir.TOKENIZER, doc="Return the path of tokenizer.json.")
    latest = property(lambda self: self.path / RunDir.LATEST, doc="Return the path of latest.json.")
    metrics = property(lambda self: self.path / RunDir.METRICS, doc="Return the path of metrics.nc.")
    results = property(lambda self: self.path / RunDir.RESULTS, doc="Return the path of results.nc.")
    progress = property(lambda self: self.path / RunDir.PROGRESS, doc="Return the path of progress.json.")
    record = property(lambda self: self.path / RunDir.RECORD, doc="Return the path of run.json.")
    notebook = property(lambda self: self.path / RunDir.NOTEBOOK, doc="Return the path of notebook.ipynb.")
    notebook_html = property(lambda self: self.path / RunDir.NOTEBOOK_HTML, doc="Return the path of notebook.html.")
    figures = property(lambda self: self.path / RunDir.FIGURES, doc="Return the path of the figures/ folder.")
    lm_eval_tasks = property(lambda self: self.path / RunDir.LM_EVAL_TASKS,
                             doc="Return the path of an lm-eval step's lm_eval_tasks/ folder.")
    kernel_log = property(lambda self: self.path / RunDir.KERNEL_LOG, doc="Return the path of kernel.log.")
    experiment = property(lambda self: self.path / RunDir.EXPERIMENT, doc="Return the older layout's experiment.json.")
    model_dir = property(lambda self: self.path / RunDir.MODEL_DIR, doc="Return the older layout's model/ folder.")

    @property
    def partial(self) -> Path:
        """Return the folder a pipeline run executes in before it is renamed into place (.<name>.partial beside it)."""
        return self.path.with_name(f".{self.path.name}.partial")

    @staticmethod
    def final_of(path: str | os.PathLike) -> Path:
        """Return the run folder a working folder (.<name>.partial) becomes; any other folder is its own."""
        p = Path(path)
        return p.with_name(p.name[1:-len(".partial")]) if p.name.startswith(".") and p.name.endswith(".partial") \
            else p

    @property
    def attempt(self) -> Path:
        """Return the file naming the Dask attempt executing the run (.<name>.attempt beside it)."""
        return self.path.with_name(f".{self.path.name}.attempt")

    @property
    def lock(self) -> Path:
        """Return the lock file held while the run executes (.<name>.lock beside the folder)."""
        return self.path.parent / f".{self.path.name}.lock"

    def checkpoint(self, step: int) -> Path:
        """Return the path of the checkpoint folder of a step (ckpt-00000400)."""
        return self.path / f"{RunDir.CKPT_PREFIX}{int(step):08d}"

    def checkpoint_tmp(self, step: int) -> Path:
        """Return the temporary folder a step's checkpoint is written to before it is renamed into place."""
        return self.path / f".{RunDir.CKPT_PREFIX}{int(step):08d}.tmp-{os.getpid()}"

    def checkpoints(self) -> list[Path]:
        """Return the checkpoint folders present, oldest first (complete or not: latest.json says which is)."""
        return sorted(p for p in self.path.glob(RunDir.CKPT_PREFIX + "*") if p.is_dir())

    def checkpoint_tmps(self) -> list[Path]:
        """Return leftover temporary checkpoint folders (a run killed mid-write)."""
        return sorted(self.path.glob(f".{RunDir.CKPT_PREFIX}*.tmp-*"))

    @staticmethod
    def is_checkpoint_name(name: str) -> bool:
        """Return True if a folder name is a checkpoint's (ckpt-*)."""
        return name.startswith(RunDir.CKPT_PREFIX)


RUN_CONFIG = RunDir.CONFIG
TOKENIZER = RunDir.TOKENIZER
LATEST = RunDir.LATEST
# what clear_run removes (latest first)
RUN_FILES = (RunDir.LATEST, RunDir.CONFIG, RunDir.TOKENIZER, RunDir.METRICS, RunDir.RESULTS)


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


def save_netcdf(ds, path: str | os.PathLike) -> Path:
    """Return the path after writing an xarray Dataset as netCDF (engine h5netcdf) atomically."""
    return atomic_write_bytes(path, bytes(ds.to_netcdf(engine="h5netcdf")))


HEADLINE_ATTR = "headline"  # results.nc attribute: the variables a report shows first, comma-separated, in order


def save_results(ds, run_dir: str | os.PathLike, headline: tuple[str, ...] | list[str] = ()) -> Path:
    """Return the path of run_dir/results.nc after writing the Dataset there, naming its headline variables.

    `headline` lists scalar variables of `ds` (each with long_name and units attrs) that a report
    shows for this run, in order; the runner reads them from the file, so what a run headlines is
    decided where its numbers are made. Raises ValueError naming a headline that is not a variable.
    """
    missing = [h for h in headline if h not in ds.variables]
    if missing:
        raise ValueError(f"headline={list(headline)!r} names {missing!r}, which are not variables of the results "
                         f"(allowed: {sorted(map(str, ds.data_vars))})")
    ds = ds.copy()
    ds.attrs[HEADLINE_ATTR] = ",".join(headline)
    return save_netcdf(ds, RunDir(run_dir).results)


def headline_of(ds) -> list[str]:
    """Return the headline variable names a results Dataset names in its attrs ([] when it names none)."""
    raw = ds.attrs.get(HEADLINE_ATTR, "")
    return [h for h in str(raw).split(",") if h and h in ds.variables]


# ---- checkpoints ---------------------------------------------------------------------------------------
def _optim_state(opts) -> tuple[dict, list]:
    """Return (tensors, meta): optimiser states split into safetensors tensors and JSON metadata."""
    import torch

    tensors, meta = {}, []
    for i, opt in enumerate(opts):
        sd = opt.state_dict()
        state_meta = {}
        for pid, st in sd["state"].items():
            entry = {}
            for key, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"{i}.{pid}.{key}"] = v.detach().cpu().contiguous()
                    entry[key] = "tensor"
                else:
                    entry[key] = v
            state_meta[str(pid)] = entry
        meta.append({"state": state_meta, "param_groups": sd["param_groups"]})
    return tensors, meta


def _load_optim_state(opts, tensors, meta) -> None:
    """Load optimiser states written by `_optim_state` back into opts (same order)."""
    for i, (opt, m) in enumerate(zip(opts, meta)):
        state = {}
        for pid, entry in m["state"].items():
            state[int(pid)] = {k: (tensors[f"{i}.{pid}.{k}"] if v == "tensor" else v) for k, v in entry.items()}
        opt.load_state_dict({"state": state, "param_groups": m["param_groups"]})


def save_checkpoint(out_dir: str | os.PathLike, model: LoopLM, opts, state: dict, keep: int = 1,
                    trainable_only: bool = False) -> Path:
    """Return the folder of a new complete checkpoint, written then published atomically via latest.json.

    `trainable_only` leaves frozen parameters out (their count and hash recorded; see `load_weights`)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    step = int(state["step"])
    final = RunDir(out).checkpoint(step)
    tmp = RunDir(out).checkpoint_tmp(step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # frozen parameters (a retrofit's base under the adapter budget) are the base's, rebuilt from it on resume
    frozen = frozen_parameters(model) if trainable_only else {}
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k not in frozen}
    if frozen:
        state = {**state, FROZEN_KEY: {"count": len(frozen), "hash": tensors_hash(frozen.items())}}
    save_file(weights, str(tmp / RunDir.CKPT_MODEL))
    tensors, meta = _optim_state(opts)
    save_file(tensors, str(tmp / RunDir.CKPT_OPTIM))
    files = run_manifest(out)  # the config and tokenizer this checkpoint belongs to
    # each weights file's hash: loading checks it, so a damaged file is named instead of trained on
    hashes = {name: file_hash(tmp / name) for name in (RunDir.CKPT_MODEL, RunDir.CKPT_OPTIM)}
    (tmp / RunDir.CKPT_STATE).write_text(json.dumps({**state, "optim": meta, "manifest": files,
                                                     HASH_KEY: hashes}))
    for f in tmp.iterdir():  # make the bytes durable before the folder becomes visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write_bytes(out / LATEST, json.dumps({"checkpoint": final.name, "step": step, "files": files}).encode())
    old = [p for p in RunDir(out).checkpoints() if p != final]
    for p in old[:max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def frozen_parameters(model) -> dict:
    """Return {state_dict name: tensor} of the model's parameters that do not train (tied names included)."""
    return {n: p for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def tensors_hash(named) -> str:
    """Return the xxh3-128 hex digest of (name, tensor) pairs: names, dtypes, shapes and bytes, in order."""
    import torch  # here: io is imported by processes that never touch a tensor (a re-run's report)
    import xxhash

    h = xxhash.xxh3_128()
    for name, t in named:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


def load_weights(model, tensors: dict, state: dict, path: str | os.PathLike) -> None:
    """Return None after loading a checkpoint's tensors into the model; one that left frozen parameters out
    (`state[FROZEN_KEY]`) only into a model whose frozen parameters hash the same (the same base)."""
    saved = state.get(FROZEN_KEY)
    if not saved:
        model.load_state_dict(tensors)
        return
    frozen = frozen_parameters(model)
    if len(frozen) != saved["count"] or tensors_hash(frozen.items()) != saved["hash"]:
        raise ValueError(f"checkpoint {path} was trained over other frozen parameters ({saved['count']} recorded, "
                         f"{len(frozen)} frozen here, or their values differ): load it into the model it was "
                         "trained from (the same base, budget and split)")
    result = model.load_state_dict(tensors, strict=False)
    if set(result.missing_keys) != set(frozen) or result.unexpected_keys:
        lost = sorted(set(result.missing_keys) - set(frozen))[:5]
        raise ValueError(f"checkpoint {path} lacks trainable tensors {lost} or has others {result.unexpected_keys[:5]}")


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Return the parsed JSON of a file; ValueError naming the file when it is truncated or not JSON."""
    path = Path(path)
    try:
        return strict_json(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a valid {what} (truncated or corrupt?): {e}") from None


HASH_KEY = "xxh3_128"  # state.json's record of each weights file's hash
FROZEN_KEY = "frozen"  # state.json's record of the parameters a checkpoint leaves out (count, hash)


def file_hash(path: str | os.PathLike) -> str:
    """Return the xxh3-128 hex digest of a file's bytes (read in 8 MiB chunks).

    A checksum against damage (flipped or lost bytes), not against tampering: xxh3 reads about 13 GB/s on
    one core where sha256 reads 1.4, so checking a 513 MiB checkpoint costs 0.04 s, not 0.4.
    """
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def load_tensors(path: str | os.PathLike, device: str = "cpu", state: dict | None = None) -> dict:
    """Return the tensors of a safetensors file after checking them; ValueError naming the file otherwise.

    Checked: the file reads as safetensors (not truncated), its hash is the one the checkpoint's state.json
    recorded when it was written (`state`; a checkpoint from before hashes were recorded is let through with
    a warning), and every floating tensor is finite (the first that is not is named). A damaged checkpoint
    is refused here, instead of loading and then looking like a divergence.
    """
    import warnings

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete")
    if state is not None:
        want = (state.get(HASH_KEY) or {}).get(path.name)
        if want is None:
            warnings.warn(f"{path} was written before checkpoints recorded a hash: checked for finite values only",
                          stacklevel=2)
        elif file_hash(path) != want:
            raise ValueError(f"{path} is damaged: its hash differs from the one recorded when it was written "
                             f"(in {RunDir.CKPT_STATE} beside it); restore it, or resume from another checkpoint")
    try:
        tensors = load_file(str(path), device=device)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as safetensors (truncated or corrupt?): {e}") from None
    import torch

    for name, t in tensors.items():
        # min and max in one pass: NaN propagates into both, an infinity is one of them (28x faster than
        # isfinite(t).all(), which writes a mask as large as the tensor)
        if t.is_floating_point() and t.numel() and not all(bool(torch.isfinite(m)) for m in torch.aminmax(t)):
            raise ValueError(f"{path} is damaged: tensor {name!r} holds NaN or infinite values (a checkpoint is "
                             "written only when every value is finite)")
    return tensors


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_manifest(run_dir: str | os.PathLike) -> dict[str, str]:
    """Return {file: sha256} of the run folder's tokenizer.json and config.json ("model" and "data" only) present now.

    config.json's "train" part is left out: resuming may extend the budget without changing the run.
    """
    run = Path(run_dir)
    files = {}
    if (run / TOKENIZER).is_file():
        files[TOKENIZER] = _digest((run / TOKENIZER).read_bytes())
    if (run / RUN_CONFIG).is_file():
        conf = read_json(run / RUN_CONFIG, "run config")
        part = {k: conf.get(k) for k in ("model", "data")} if isinstance(conf, dict) else conf
        files[RUN_CONFIG] = _digest(json.dumps(part, sort_keys=True).encode())
    return files


def check_manifest(run_dir: str | os.PathLike, ckpt: str | os.PathLike) -> None:
    """Return None if the run folder's config.json and tokenizer.json are those the checkpoint was written with.

    Raises ValueError naming the file that differs (the folder was partly overwritten). Files absent
    now, and checkpoints written before manifests existed, are not checked.
    """
    state = read_json(Path(ckpt) / RunDir.CKPT_STATE, "checkpoint state")
    recorded = state.get("manifest") or {}
    now = run_manifest(run_dir)
    for name, digest in recorded.items():
        if name in now and now[name] != digest:
            raise ValueError(f"{Path(run_dir) / name} is not the {name} that {Path(ckpt).name} was trained with "
                             f"(sha256 {digest[:12]} then, {now[name][:12]} now): the run folder was partly "
                             "overwritten, so its checkpoint and files do not belong together; retrain it "
                             "(`workbench train --overwrite`) or restore the file")


def read_manifest(run_dir: str | os.PathLike) -> dict | None:
    """Return the run folder's latest.json (checkpoint, step, files, failed) checked for shape, or None if absent.

    Raises ValueError naming the file when it is truncated, not a JSON object, or names a checkpoint
    that is not a `ckpt-*` folder directly inside the run folder.
    """
    pointer = Path(run_dir) / LATEST
    if not pointer.is_file():
        return None
    m = read_json(pointer, "checkpoint pointer")
    if not isinstance(m, dict) or "checkpoint" not in m:
        raise ValueError(f"{pointer} is invalid: must be a JSON object with a \"checkpoint\" entry, got {m!r:.200}")
    name = m["checkpoint"]
    if name is not None and (not isinstance(name, str) or not RunDir.is_checkpoint_name(name) or "/" in name
                             or "\\" in name or name in (".", "..")):
        raise ValueError(f"{pointer} names checkpoint={name!r}, which is invalid: must be a ckpt-* folder "
                         "directly inside the run folder (a pointer outside it is never followed)")
    return m


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """Return the newest complete checkpoint folder under out_dir, or None when there is none yet.

    Raises FileNotFoundError when latest.json names a checkpoint that is missing or incomplete, and
    ValueError when latest.json is unreadable or points outside the run folder.
    """
    m = read_manifest(out_dir)
    if m is None or m["checkpoint"] is None:
        return None
    path = Path(out_dir) / m["checkpoint"]
    if not (path / RunDir.CKPT_STATE).is_file():
        raise FileNotFoundError(f"{Path(out_dir) / LATEST} names checkpoint {m['checkpoint']!r}, but {path} is "
                                "missing or incomplete (no state.json)")
    return path


def mark_failed(out_dir: str | os.PathLike, step: int, error: str) -> Path:
    """Return latest.json's path after recording in it that the run failed at `step` (its checkpoint is kept)."""
    m = read_manifest(out_dir) or {"checkpoint": None, "step": 0, "files": run_manifest(out_dir)}
    m["failed"] = {"step": int(step), "error": str(error)}
    return atomic_write_bytes(Path(out_dir) / LATEST, json.dumps(m).encode())


def holds_run(path: str | os.PathLike) -> bool:
    """Return True if the folder holds (part of) a run: any of latest.json, config.json, tokenizer.json, ckpt-*."""
    p = Path(path)
    return p.is_dir() and (any((p / f).exists() for f in (LATEST, RUN_CONFIG, TOKENIZER))
                           or bool(RunDir(p).checkpoints()))


def refuse_foreign_files(path: str | os.PathLike, overwrite: bool) -> None:
    """Return None when a new run may write into the folder; FileExistsError naming foreign files otherwise.

    Foreign: files of the names a run writes (metrics.nc, results.nc) in a folder that holds no run of its
    own (no config.json, tokenizer.json or checkpoint: `holds_run`), i.e. someone's files; a new run must not
    overwrite them unasked. With `overwrite` they are removed (the caller asked to replace what is there).
    """
    p = Path(path)
    if not p.is_dir() or holds_run(p):
        return
    names = [name for name in (RunDir.METRICS, RunDir.RESULTS) if (p / name).exists()]
    if names and not overwrite:
        raise FileExistsError(f"out_dir={str(path)!r} holds {', '.join(names)} that no run of this folder wrote "
                              f"(no {RunDir.CONFIG}, {RunDir.TOKENIZER} or checkpoint beside them): a run would "
                              "overwrite them; choose another folder, or pass overwrite=True (`--overwrite`) to "
                              "replace them; nothing was changed")
    for name in names:
        (p / name).unlink()


def clear_run(run_dir: str | os.PathLike, checkpoints_only: bool = False) -> None:
    """Remove a run folder's run files (latest.json first, then checkpoints, configs, metrics); others stay.

    With `checkpoints_only` (a Trainer replacing its own run) config.json and tokenizer.json stay.
    """
    run = Path(run_dir)
    for name in RUN_FILES:  # the pointer goes first: from then on nothing here looks complete
        if not (checkpoints_only and name in (RUN_CONFIG, TOKENIZER)):
            (run / name).unlink(missing_ok=True)
    for p in RunDir(run).checkpoints() + RunDir(run).checkpoint_tmps():
        shutil.rmtree(p, ignore_errors=True)


# ---- run folders ---------------------------------------------------------------------------------------
def find_run(path: str | os.PathLike) -> tuple[Path, Path]:
    """Return (run folder, checkpoint folder) for a run folder, a checkpoint folder in one, or an older layout.

    Raises FileNotFoundError naming the path when it holds no checkpoint.
    """
    if not str(path).strip():
        raise FileNotFoundError("path='' is invalid: give a run folder (e.g. a pipeline's "
                                "runs/<pipeline>/train/<key> or `workbench train --out` DIR) or a checkpoint in one")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"path={str(path)!r} does not exist: give a run folder or a checkpoint folder")
    if p.is_dir() and (p / RunDir.CKPT_STATE).is_file():
        check_manifest(p.parent, p)
        return p.parent, p
    for run in (p, RunDir(p).model_dir):  # model/: train_run's layout before the run folder was unified
        if run.is_dir() and (run / LATEST).is_file():
            ckpt = latest_checkpoint(run)
            if ckpt is None:
                failed = (read_manifest(run) or {}).get("failed") or {}
                raise FileNotFoundError(f"{run} has no checkpoint: training failed at step {failed.get('step')} "
                                        f"before the first one ({str(failed.get('error', ''))[:300]})")
            check_manifest(run, ckpt)
            return run, ckpt
    raise FileNotFoundError(f"path={str(path)!r} is not a run or checkpoint folder: expected latest.json (a run "
                            "folder) or state.json and model.safetensors (a checkpoint folder)")


def load_model(path: str | os.PathLike, device=None) -> LoopLM:
    """Return the LoopLM of a checkpoint folder, or of a run folder's latest checkpoint (any layout `find_run` reads).

    Raises FileNotFoundError when there is no checkpoint and ValueError when its config cannot be built
    or its weights do not fit its config.
    """
    from .config import LoopConfig
    from .models.looped import LoopLM

    _, ckpt = find_run(path)
    state = read_json(ckpt / RunDir.CKPT_STATE, "checkpoint state")
    if state.get(FROZEN_KEY):
        raise ValueError(f"the checkpoint at {ckpt} keeps only trainable tensors (save_frozen=False): rebuild its "
                         "model from the base it trained over and load it with load_weights")
    try:
        cfg = LoopConfig.from_json(state["model_config"])
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"the checkpoint at {ckpt} has a model_config this workbench cannot build: {e}") from None
    model = LoopLM(cfg)
    # retrofit checkpoints written before adapters had one name stored <linear>_lora.{A,B}
    weights = {k.replace("_lora.", "_adapter."): v for k, v in load_tensors(ckpt / RunDir.CKPT_MODEL,
                                                                            state=state).items()}
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:  # load_state_dict: missing, unexpected or mis-shaped weights
        detail = " ".join(line.strip() for line in str(e).strip().splitlines()[:3])
        raise ValueError(f"the checkpoint at {ckpt} holds weights of another config than its state.json "
                         f"describes: {detail[:400]}") from None
    return model.to(device or "cpu")


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None):
    """Return the tokenizer of a run or checkpoint folder: its tokenizer.json, else bytes for a 256-id model.

    Looks in the checkpoint folder, then its run folder. Raises FileNotFoundError when there is no
    tokenizer.json and `vocab_size` is not 256, ValueError when the file cannot be read.
    """
    from .data.corpus import ByteTokenizer, Tokenizer

    run, ckpt = find_run(path)
    for candidate in (ckpt / TOKENIZER, run / TOKENIZER):
        if candidate.is_file():
            try:
                return Tokenizer.load(candidate)
            except Exception as e:  # the tokenizers library raises its own exception types besides ValueError
                raise ValueError(f"cannot read the tokenizer at {candidate}: {e}") from None
    if vocab_size == 256:
        return ByteTokenizer()
    raise FileNotFoundError(f"no {TOKENIZER} in {ckpt} or {run}, and the model's vocab_size={vocab_size} is not "
                            "byte-level (256): pass tokenizer=")


def open_run(path: str | os.PathLike, device=None, tokenizer=None) -> tuple[LoopLM, Any]:
    """Return (model, tokenizer) of a run folder (its latest checkpoint) or of a checkpoint folder inside one.

    Opens every layout written so far (see the module docstring). `tokenizer` replaces the run's own.
    The model is in eval mode on `device` (default CPU). Raises FileNotFoundError (no checkpoint, or
    no tokenizer for a non-byte model) or ValueError (unbuildable config, weights that do not fit it,
    an unreadable tokenizer, or one with more ids than the model's vocabulary).
    """
    model = load_model(path, device=device).eval()
    if tokenizer is None:
        tokenizer = load_tokenizer(path, model.cfg.vocab_size)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model at {path} has vocab_size="
                         f"{model.cfg.vocab_size}: it is not this model's tokenizer")
    return model, tokenizer


def write_run_config(run_dir: str | os.PathLike, model: Any, train: Any, data: dict) -> Path:
    """Return the path of `<run>/config.json` after writing the model, train and data configs there atomically.

    `model` and `train` are a LoopConfig and a TrainConfig (or their dicts); `data` says how the run's
    text and tokenizer were made (corpus, tasks, task_ratio, task_depths, seed, vocab_size).
    """
    def as_dict(c):
        return json.loads(c.to_json()) if hasattr(c, "to_json") else dict(c)

    blob = {"model": as_dict(model), "train": as_dict(train), "data": dict(data)}
    return atomic_write_bytes(Path(run_dir) / RUN_CONFIG, json.dumps(blob, indent=1).encode())


def read_run_config(path: str | os.PathLike) -> dict:
    """Return {"model", "train", "data"} of the run holding `path` (any layout `find_run` reads).

    Older layouts: "data" comes from experiment.json, or is {} when the run never recorded it (a
    `workbench train` run from before config.json); "model" and "train" from the latest checkpoint.
    """
    run, ckpt = find_run(path)
    if (run / RUN_CONFIG).is_file():
        return read_json(run / RUN_CONFIG, "run config")
    state = read_json(ckpt / RunDir.CKPT_STATE, "checkpoint state")
    exp = RunDir(run).experiment
    return {"model": json.loads(state["model_config"]),
            "train": json.loads(state["train_config"]) if "train_config" in state else {},
            "data": read_json(exp, "experiment record") if exp.is_file() else {}}


# ---- pipeline run records: read by the pipeline and by whoever looks for its runs ----------------------
def read_record(run_dir: str | os.PathLike) -> dict | None:
    """Return the run.json record of a finished run folder, or None if there is none."""
    p = RunDir(run_dir).record
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def find_runs(pipeline: str, step: str, runs_dir: str | os.PathLike = "runs", state: str = "done") -> list[Path]:
    """Return the folders of a pipeline step's runs in the given state, oldest first (by finish time)."""
    recs = []
    for d in (Path(runs_dir) / pipeline / step).glob("*"):
        rec = read_record(d)
        if rec is not None and rec.get("status") == state:
            recs.append((rec.get("finished", ""), d))
    return [d for _, d in sorted(recs)]


# ---- live progress: written by the Trainer, read by `workbench run` while the run executes ----------------------
PROGRESS = RunDir.PROGRESS


def write_progress(run_dir: str | os.PathLike, fields: dict) -> Path:
    """Return the path of run_dir/progress.json after replacing it atomically with `fields` (plus "updated").

    No fsync: it is rewritten every second or so and only ever read live; a reader sees the old or the
    new file, never half of one.
    """
    path = Path(run_dir) / PROGRESS
    data = json.dumps({**fields, "updated": time.time()}, default=str).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{PROGRESS}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_progress(run_dir: str | os.PathLike) -> dict | None:
    """Return the fields of run_dir/progress.json (step, total, tokens_per_s, eta_s, phase, updated, ...), or None."""
    try:
        data = json.loads((Path(run_dir) / PROGRESS).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
