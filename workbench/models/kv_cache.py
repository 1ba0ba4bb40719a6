"""The key/value cache of cached generation: one entry per block occurrence (prelude.i, core.t.j, coda.i).

`LoopLM.run(..., kv=cache)` makes its tokens the new tokens of a step: every block reads its own
entry's keys and values for the positions before and appends the new ones; `commit` closes the step.
Its own module so that the model (looped.py) and the decoding loop (generate.py) both import it and
neither imports the other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import check_int, fail

# ---- the key/value cache --------------------------------------------------------------------------------------
class KVEntry:
    """One block occurrence's keys and values [B, kv_heads, capacity, head_dim], filled position by position."""

    __slots__ = ("cache", "name", "k", "v", "filled")

    def __init__(self, cache: "KVCache", name: str):
        self.cache, self.name = cache, name
        self.k = self.v = None
        self.filled = 0  # positions 0..filled-1 hold keys and values

    def _alloc(self, like: torch.Tensor) -> None:
        B, KV, _, hd = like.shape
        self.k = like.new_zeros(B, KV, self.cache.capacity, hd)
        self.v = torch.zeros_like(self.k)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Return attention [B, H, T, hd] of the new queries over every cached position, after storing k, v."""
        c = self.cache
        L, T = c.length, c.step
        if self.k is None:
            self._alloc(k)
        if self.filled not in (L, L + T):  # a later readout of the same step may write again: the last wins
            raise RuntimeError(f"cache entry {self.name} holds {self.filled} positions but the cache holds {L}: "
                               "every occurrence must see every token (was the loop count changed mid-sequence?)")
        self.k[:, :, L:L + T] = k
        self.v[:, :, L:L + T] = v
        self.filled = L + T
        K, V = self.k[:, :, :L + T], self.v[:, :, :L + T]
        B, H, _, hd = q.shape
        KV = K.shape[1]
        if KV != H:
            if T == 1:  # one query per head: group the query heads of each kv head instead of copying K, V
                y = F.scaled_dot_product_attention(q.reshape(B, KV, H // KV, hd), K, V, attn_mask=c.mask)
                return y.reshape(B, H, 1, hd)
            K, V = K.repeat_interleave(H // KV, dim=1), V.repeat_interleave(H // KV, dim=1)
        return F.scaled_dot_product_attention(q, K, V, attn_mask=c.mask, is_causal=c.causal)


class KVCache:
    """Keys and values of every block occurrence of a sequence batch, by place name, and the padding mask.

    Use: `open(keep)` for the next T tokens ([B, T] bool, False = left padding), `model.run(new_tokens,
    loops, kv=cache)` (and any readouts), then `commit()`. Entries are made on first use; `reuse` fills
    the entries of loops a row skipped (adaptive exit).
    """

    def __init__(self, batch: int, capacity: int, device=None):
        self.batch = check_int("batch", batch, 1)
        self.capacity = check_int("capacity", capacity, 1)
        self.device = torch.device(device if device is not None else "cpu")
        self.entries: dict[str, KVEntry] = {}
        self.length = 0  # committed positions
        self.step = 0  # positions of the open step (0: none open)
        self.keep = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self.pos = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)
        self.seen = torch.zeros(batch, dtype=torch.long, device=self.device)  # real tokens committed per row
        self.mask: torch.Tensor | None = None
        self.causal = False
        self._rope: tuple | None = None

    def at(self, name: str) -> KVEntry:
        """Return the entry of place `name` (made empty on first use)."""
        e = self.entries.get(name)
        if e is None:
            if self.step == 0:
                raise RuntimeError("no step is open: call KVCache.open(keep) before a cached pass")
            e = self.entries[name] = KVEntry(self, name)
        return e

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity)

        def pad(x):
            return torch.cat([x, x.new_zeros(*x.shape[:-2], cap - x.shape[-2], x.shape[-1])], dim=-2)
        for e in self.entries.values():
            if e.k is not None:
                e.k, e.v = pad(e.k), pad(e.v)
        self.keep = torch.cat([self.keep, self.keep.new_zeros(self.batch, cap - self.capacity)], 1)
        self.pos = torch.cat([self.pos, self.pos.new_zeros(self.batch, cap - self.capacity)], 1)
        self.capacity = cap

    def open(self, keep: torch.Tensor) -> None:
        """Open a step of T new positions; keep [B, T] is True for real tokens, False for left padding."""
        if self.step:
            raise RuntimeError("a step is already open: commit() it first")
        if keep.dim() != 2 or keep.shape[0] != self.batch or keep.shape[1] == 0:
            fail("keep", tuple(keep.shape), f"must be [batch={self.batch}, T >= 1] booleans")
        keep = keep.to(self.device, torch.bool)
        L, T = self.length, keep.shape[1]
        if L + T > self.capacity:
            self._grow(L + T)
        self.keep[:, L:L + T] = keep
        # each row counts its own tokens: a left-padded row gets the positions it would have alone
        self.pos[:, L:L + T] = (self.seen[:, None] + keep.long().cumsum(1) - 1).clamp(min=0)
        allk = self.keep[:, :L + T]
        self.mask, self.causal = None, False
        if bool(allk.all()):
            if T > 1 and L == 0:
                self.causal = True
            elif T > 1:
                self.mask = self._causal(L, T)[None, None]
        else:
            # a real query never attends to padding; a padding query attends to itself only (no empty row)
            qi = torch.arange(L, L + T, device=self.device)[:, None]
            ki = torch.arange(L + T, device=self.device)[None, :]
            self.mask = ((self._causal(L, T)[None] & allk[:, None, :]) | (ki == qi)[None])[:, None]
        self.step = T
        self._rope = None

    def _causal(self, L: int, T: int) -> torch.Tensor:
        qi = torch.arange(L, L + T, device=self.device)[:, None]
        return torch.arange(L + T, device=self.device)[None, :] <= qi

    def rope(self, rotary, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return rotary (cos, sin) [B, 1, T, head_dim] at the open step's positions (each row's own)."""
        if self._rope is None or self._rope[0].dtype != like.dtype:
            p = self.pos[:, self.length:self.length + self.step]
            top = int(p.max())
            if top >= rotary.max_seq_len:
                raise ValueError(f"position {top} is outside the context: max_seq_len={rotary.max_seq_len}")
            cos, sin = rotary(rotary.max_seq_len, like.dtype, like.device)
            self._rope = (cos[p].unsqueeze(1), sin[p].unsqueeze(1))
        return self._rope

    def reuse(self, exit_loops: torch.Tensor, max_loops: int, core: int) -> None:
        """Fill, for each row, the entries of loops after its exit loop with its exit loop's keys and values.

        Huginn's choice: core.t.j of a row that exited after loop e < t becomes a copy of core.e.j at the
        open positions, so later tokens attend to the last loop it computed. exit_loops is [B].
        """
        L, T = self.length, self.step
        for t in range(2, max_loops + 1):
            rows = exit_loops < t
            if not bool(rows.any()):
                continue
            every = bool(rows.all())
            sel = rows.view(-1, 1, 1, 1)
            for j in range(core):
                prev, cur = self.at(f"core.{t - 1}.{j}"), self.at(f"core.{t}.{j}")
                if cur.k is None:
                    cur._alloc(prev.k)
                for a, b in ((cur.k, prev.k), (cur.v, prev.v)):
                    src = b[:, :, L:L + T]
                    a[:, :, L:L + T] = src if every else torch.where(sel, src, a[:, :, L:L + T])
                cur.filled = L + T

    def commit(self) -> None:
        """Close the open step: its positions become part of the cached sequence."""
        if not self.step:
            raise RuntimeError("no step is open")
        self.seen += self.keep[:, self.length:self.length + self.step].sum(1)
        self.length += self.step
        self.step = 0
        self.mask, self.causal, self._rope = None, False, None
