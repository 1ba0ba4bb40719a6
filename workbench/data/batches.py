"""Batches of task examples for answer-only or per-loop supervision: what a Trainer draws for a retrofit."""

from __future__ import annotations

import numpy as np
import torch


class ExampleBatches:
    """Seeded batches of task examples for answer-only or per-loop supervision; resumable like BatchSampler.

    Each batch is a dict: `tokens` [B, T] (prompt + answer minus its last token, right-padded with 0),
    `labels` [B, loops, T] (-100 except at the answer positions) and `weights`. With
    `per_loop=True` loop t is graded on the example's state after step t (`Example.steps[t-1]`,
    for examples whose steps encode to as many tokens as the answer); otherwise, or with
    `final_only=True`, only the final loop carries the answer. Which loop is final:
    - `align="last"`: the last loop, graded on the answer whatever the example's depth; `weights` [loops];
    - `align="step"`: loop min(depth, loops), graded on the state after that step (the answer when
      depth <= loops); later loops carry no label, so examples of mixed depths teach one step per
      loop; `weights` [B, loops]. Examples need steps.
    `anneal=n` anneals per-loop grading toward final-answer-only grading: the weight of every loop
    before the final one falls linearly from 1 at the first batch to 0 at batch n (and stays 0).
    """

    def __init__(self, examples, tokenizer, batch_size: int, loops: int, seed: int = 0, per_loop: bool = True,
                 final_only: bool = False, anneal: int = 0, align: str = "last"):
        if not examples:
            raise ValueError("examples is empty: nothing to train on")
        if batch_size < 1 or loops < 1:
            raise ValueError(f"batch_size={batch_size}, loops={loops} are invalid: both must be >= 1")
        if not isinstance(anneal, int) or isinstance(anneal, bool) or anneal < 0:
            raise ValueError(f"anneal={anneal!r} is invalid: must be an integer >= 0 (batches; 0 is off)")
        if align not in ("last", "step"):
            raise ValueError(f"align={align!r} is invalid: must be one of last, step")
        self.batch_size, self.loops, self.seed, self.anneal, self.align = batch_size, loops, seed, anneal, align
        self.drawn = 0  # batches drawn so far: the annealing clock
        self.items = []
        for ex in examples:
            if align == "step" and not ex.steps:
                raise ValueError(f"align='step' needs examples with steps; {ex.prompt!r} has none")
            p, a = tokenizer.encode(ex.prompt), tokenizer.encode(ex.answer)
            per = [tokenizer.encode(ex.answer[:len(ex.answer) - len(ex.answer.lstrip())] + s) for s in ex.steps]
            self.items.append((p, a, per))
        self.per_loop, self.final_only = per_loop, final_only
        self.epoch = self.position = 0

    def __iter__(self) -> "ExampleBatches":
        return self

    def __next__(self) -> dict:
        n = len(self.items)
        self.drawn += 1
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        idx = [order[(self.position * self.batch_size + i) % n] for i in range(self.batch_size)]
        self.position += 1
        if self.position * self.batch_size >= n:
            self.epoch, self.position = self.epoch + 1, 0
        T = max(len(self.items[i][0]) + len(self.items[i][1]) - 1 for i in idx)
        tokens = torch.zeros(self.batch_size, T, dtype=torch.long)
        labels = torch.full((self.batch_size, self.loops, T), -100, dtype=torch.long)
        w_early = self.weights(self.drawn - 1)[0].item()
        weights = torch.zeros(self.batch_size, self.loops)
        for b, i in enumerate(idx):
            p, a, per = self.items[i]
            seq = p + a
            tokens[b, :len(seq) - 1] = torch.tensor(seq[:-1])
            at = slice(len(p) - 1, len(p) - 1 + len(a))
            final = self.loops if self.align == "last" else min(len(per), self.loops)
            target = a if self.align == "last" or final == len(per) else per[final - 1]
            if len(target) == len(a):
                labels[b, final - 1, at] = torch.tensor(target)
            weights[b, :final - 1], weights[b, final - 1] = w_early, 1.0
            if self.per_loop and not self.final_only:
                # loop t (1-based) is graded on the state after step t, up to the final loop
                for t in range(1, min(final, len(per) + 1)):
                    if len(per[t - 1]) == len(a):
                        labels[b, t - 1, at] = torch.tensor(per[t - 1])
        return {"tokens": tokens, "labels": labels,
                "weights": self.weights(self.drawn - 1) if self.align == "last" else weights}

    def weights(self, batch: int) -> torch.Tensor:
        """Return the per-loop weights [loops] of the 0-based `batch` under the annealing schedule (align="last")."""
        w = torch.ones(self.loops)
        if self.anneal:
            w[:-1] = max(0.0, 1.0 - batch / self.anneal)
        return w

    def state_dict(self) -> dict[str, int]:
        """Return the position to restore (epoch, position, batches drawn, seed)."""
        return {"epoch": self.epoch, "position": self.position, "drawn": self.drawn, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by `state_dict` (the seed must match)."""
        if state["seed"] != self.seed:
            raise ValueError(f"seed={state['seed']} in the saved state does not match this sampler's seed={self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.drawn = int(state.get("drawn", 0))  # states written before annealing existed lack it
