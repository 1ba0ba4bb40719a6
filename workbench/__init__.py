"""The looped-LM workbench: looped models, trainers, probes and scaling laws."""

from importlib.metadata import PackageNotFoundError, version

from .config import LoopConfig

try:
    __version__ = version("looped-workbench")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

__all__ = ["LoopConfig", "LoopLM", "LoopTrace", "__version__"]


def __getattr__(name: str):
    """Return LoopLM / LoopTrace, imported on first use so torch-free tools (the pipeline runner) start fast."""
    if name in ("LoopLM", "LoopTrace"):
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
