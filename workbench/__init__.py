"""The looped-LM workbench: looped models, trainers, probes and scaling laws."""

from importlib.metadata import PackageNotFoundError, version

from .config import LoopConfig
from .models import LoopLM, LoopTrace

try:
    __version__ = version("looped-workbench")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

__all__ = ["LoopConfig", "LoopLM", "LoopTrace", "__version__"]
