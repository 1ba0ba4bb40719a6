"""Looped model family: layers, conditioning, hyper-connections, tapers, LoopLM, the FLOPs formula.

The names below are imported on first use, so torch-free modules (`models.flops`, used by the laws)
load without torch.
"""

from importlib import import_module

_WHERE = {"LoopLM": ".looped", "LoopOutput": ".looped", "LoopTrace": ".looped", "lm_loss": ".looped",
          "mlp_widths": ".taper", "flops_per_token": ".flops", "ExitRule": ".generate", "ExitGate": ".generate",
          "KVCache": ".generate"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    """Return one of the package's public names, importing its module on first use."""
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
