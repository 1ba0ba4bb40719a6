"""Looped model family: layers, conditioning, hyper-connections, tapers, LoopLM."""

from .looped import LoopLM, LoopOutput, LoopTrace, lm_loss
from .taper import mlp_widths

__all__ = ["LoopLM", "LoopOutput", "LoopTrace", "lm_loss", "mlp_widths"]
