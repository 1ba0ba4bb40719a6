"""Tiny models, inputs and baselines shared by the tests."""

import torch

from workbench import LoopConfig

V, D = 97, 32


def cfg(**kw) -> LoopConfig:
    """Return a tiny 1+2x3+1 config with the given fields changed."""
    base = dict(vocab_size=V, d_model=D, n_heads=4, n_kv_heads=2, prelude=1, core=2, coda=1, loops=3,
                max_seq_len=64)
    base.update(kw)
    return LoopConfig(**base)


def tokens(seed=0, B=2, T=12):
    """Return seeded random tokens [B, T]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g)


def perturb(model, scale=0.05, seed=1):
    """Move every parameter off its (identity / zero) init so variant terms really act."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


DEMO_STEPS = 25  # steps of the session's shared demo model (conftest.demo_trained)


def byte_unigram_entropy(data) -> float:
    """Return the entropy (nats) of the byte frequencies of `data`: the loss of the best model blind to context."""
    import numpy as np

    counts = np.bincount(np.asarray(data, dtype=np.int64), minlength=256) / len(data)
    counts = counts[counts > 0]
    return float(-(counts * np.log(counts)).sum())
