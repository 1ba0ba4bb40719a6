"""Transformer pieces: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, pre-norm Block.

Conventions follow Hugging Face's Llama (rotate-half rotary, RMSNorm computed in float32) so a
pretrained Llama maps onto these modules by copying weights, with Q/K/V and gate/up fused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

# A branch modulation: (gate g, shift s). g multiplies the branch output (a scalar or [d]); s, if not
# None, scales the normalised input as (1 + s). None means "no modulation" and costs nothing.
Mod = tuple[torch.Tensor, torch.Tensor | None] | None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in float32 like Llama."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return x / rms(x) * weight in x's dtype."""
        if x.dtype == torch.float32:  # one fused kernel, same numbers
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding tables (rotate-half convention), built in float32 once per device.

    The tables are not buffers, so casting the model to bf16 does not round them (HF keeps them in
    float32 too); they are cast to the activation dtype only where they are applied.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _build(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        freqs = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().float().to(device), emb.sin().float().to(device)

    def forward(self, seq_len: int, dtype: torch.dtype, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (cos, sin) of shape [seq_len, head_dim] for positions 0..seq_len-1."""
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.max_seq_len}")
        device = torch.device(device if device is not None else "cpu")
        if device not in self._tables:
            self._tables[device] = self._build(device)
        cos, sin = self._tables[device]
        return cos[:seq_len].to(dtype), sin[:seq_len].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return x [B, H, T, hd] rotated by the position tables (rotate-half form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Adapter(nn.Module):
    """A low-rank adapter on a [d_out, d_in] weight: the update B A (rank r), applied unmerged as (x A^T) B^T.

    B starts at zero, so an adapter starts as no change.

    Unmerged, a frozen base weight needs no weight gradient: backward costs O(r (d_in + d_out)) per
    token for the update instead of a full d_out x d_in weight gradient.
    """

    def __init__(self, d_in: int, d_out: int, rank: int):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, d_in) / d_in ** 0.5)  # unit-norm-ish rows
        self.B = nn.Parameter(torch.zeros(d_out, rank))

    def down(self, x: torch.Tensor) -> torch.Tensor:
        """Return x A^T [..., r], shared by every row slice of the update."""
        return F.linear(x, self.A)

    def delta(self) -> torch.Tensor:
        """Return the dense update B A [d_out, d_in] (for merging into the base weight)."""
        return self.B @ self.A


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Return x in autocast's dtype when autocast is on for its device (else x itself).

    The projections read x through several row slices of one fused weight; autocast would cast x
    once per slice (x is not a leaf, so its cast is not cached), three times for Q, K, V.
    """
    dev = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        if x.dtype != dtype:
            return x.to(dtype)
    return x


MATH_ATTENTION_MAX = 2 ** 24  # score elements (B x H x T x T) up to which compiled CPU attention is explicit


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Return causal softmax(q k^T / sqrt(hd)) v for [B, H, T, hd] inputs, computed the way that is fastest there.

    Three ways, one result (measured 2026-11-30 on 2 AVX512-BF16 cores, forward + backward):
    - compiled, on a CPU, scores up to MATH_ATTENTION_MAX elements: explicit bf16 matmuls and an fp32
      softmax, which inductor fuses (23 ms against the flash kernel's 28 at [8, 4, 256, 64]);
    - eager under CPU autocast: SDPA in fp32 (bf16 SDPA's CPU backward is 2x slower at small head dims:
      22 against 10 ms at [16, 4, 128, 32]); the projections around it stay bf16;
    - elsewhere (fp32, CUDA): SDPA as it is.
    """
    B, H, T, hd = q.shape
    cpu = q.device.type == "cpu"
    if cpu and torch.compiler.is_compiling() and B * H * T * T <= MATH_ATTENTION_MAX:
        s = (q @ k.transpose(-1, -2)).float() * hd ** -0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return torch.softmax(s, -1).to(v.dtype) @ v
    if cpu and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _linear(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, ad: Adapter | None,
            z: torch.Tensor | None, i: int | None = None, j: int | None = None) -> torch.Tensor:
    """Return x W[i:j]^T + b[i:j] (+ z B[i:j]^T with z = x A^T when an adapter is present)."""
    y = F.linear(x, W[i:j], None if b is None else b[i:j])
    return y if ad is None else y + F.linear(z, ad.B[i:j])


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads through F.scaled_dot_product_attention."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, bias: bool = False, adapter_rank: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.o = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)  # Llama's attention_bias: q, k, v and o
        self.qkv_adapter = Adapter(d_model, self.qkv.out_features, adapter_rank) if adapter_rank else None
        self.o_adapter = Adapter(self.o.in_features, d_model, adapter_rank) if adapter_rank else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv=None,
                adapt: bool = True) -> torch.Tensor:
        """Return the attention output [B, T, d] for input x [B, T, d].

        `kv` is this occurrence's key/value cache entry (models.kv_cache.KVEntry): it stores the new keys
        and values and attends over every cached position; rope then holds the new positions' tables.
        `adapt=False` leaves the adapters out: exactly the plain layer's computation.
        """
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        # Three matmuls on row slices of the fused weight rather than one matmul split afterwards: the
        # split's backward concatenates the activation gradients, a copy per layer occurrence per step.
        x = autocast_input(x)
        W, b, ad = self.qkv.weight, self.qkv.bias, self.qkv_adapter if adapt else None
        z = None if ad is None else ad.down(x)
        q, k, v = (rearrange(_linear(x, W, b, ad, z, i, j), "b t (heads hd) -> b heads t hd", hd=hd)
                   for i, j in ((0, H * hd), (H * hd, (H + KV) * hd), ((H + KV) * hd, (H + 2 * KV) * hd)))
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is None and KV != H:
            # repeat rather than enable_gqa: the CPU flash kernel does not take enable_gqa
            k = repeat(k, "b kv t hd -> b (kv group) t hd", group=H // KV)  # each key/value head serves a group
            v = repeat(v, "b kv t hd -> b (kv group) t hd", group=H // KV)
        if kv is not None:  # cached generation: the entry stores k, v and attends over every cached position
            y = kv.attend(q, k, v)
        else:
            y = causal_attention(q, k, v)
        y = rearrange(y, "b heads t hd -> b t (heads hd)")
        if self.o_adapter is None or not adapt:
            return self.o(y)
        return _linear(y, self.o.weight, self.o.bias, self.o_adapter, self.o_adapter.down(y))


class SwiGLU(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, d_model: int, d_ff: int, adapter_rank: int = 0):
        super().__init__()
        self.d_ff = d_ff
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)
        self.gate_up_adapter = Adapter(d_model, 2 * d_ff, adapter_rank) if adapter_rank else None
        self.down_adapter = Adapter(d_ff, d_model, adapter_rank) if adapter_rank else None

    def forward(self, x: torch.Tensor, adapt: bool = True) -> torch.Tensor:
        """Return the MLP output [B, T, d] (`adapt=False`: without the adapters, as the plain layer)."""
        x = autocast_input(x)
        W, f = self.gate_up.weight, self.d_ff
        if self.gate_up_adapter is None or not adapt:
            return self.down(F.silu(F.linear(x, W[:f])) * F.linear(x, W[f:]))  # row slices: see Attention
        ad, dad = self.gate_up_adapter, self.down_adapter
        z = ad.down(x)
        u = F.silu(_linear(x, W, None, ad, z, None, f)) * _linear(x, W, None, ad, z, f, None)
        return _linear(u, self.down.weight, None, dad, dad.down(u))


class Block(nn.Module):
    """Pre-norm transformer block (optionally sandwich-normed): u += Branch(Norm(u)) for attn, MLP.

    With `adapter_rank` > 0 every linear (qkv, o, gate_up, down) carries a low-rank update that starts at zero;
    `adapt=False` runs the block without them (a retrofit's loop 1, which must stay the base model).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, eps: float = 1e-6,
                 sandwich: bool = False, attn_bias: bool = False, adapter_rank: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(d_model, eps)
        self.attn = Attention(d_model, n_heads, n_kv_heads, bias=attn_bias, adapter_rank=adapter_rank)
        self.mlp_norm = RMSNorm(d_model, eps)
        self.mlp = SwiGLU(d_model, d_ff, adapter_rank=adapter_rank)
        self.attn_post = RMSNorm(d_model, eps) if sandwich else None
        self.mlp_post = RMSNorm(d_model, eps) if sandwich else None

    @staticmethod
    def _branch(x, norm, fn, post, mod: Mod):
        h = norm(x)
        if mod is not None and mod[1] is not None:
            h = h * (1 + mod[1])
        y = fn(h)
        if post is not None:
            y = post(y)
        if mod is not None:
            y = y * mod[0]
        return y

    def delta(self, x: torch.Tensor, rope, attn_mod: Mod = None, mlp_mod: Mod = None, kv=None,
              adapt: bool = True) -> torch.Tensor:
        """Return Block(x) - x: the block's total residual update (what hyper-connections route)."""
        u = self._branch(x, self.attn_norm, lambda h: self.attn(h, rope, kv, adapt), self.attn_post, attn_mod)
        return u + self._branch(x + u, self.mlp_norm, lambda h: self.mlp(h, adapt), self.mlp_post, mlp_mod)

    def forward(self, x: torch.Tensor, rope, attn_mod: Mod = None, mlp_mod: Mod = None, kv=None,
                adapt: bool = True) -> torch.Tensor:
        """Return the block output for x [B, T, d]; mods gate/shift each branch (timestep conditioning).

        `kv` is this occurrence's key/value cache entry during cached generation (see Attention).
        """
        x = x + self._branch(x, self.attn_norm, lambda h: self.attn(h, rope, kv, adapt), self.attn_post, attn_mod)
        return x + self._branch(x, self.mlp_norm, lambda h: self.mlp(h, adapt), self.mlp_post, mlp_mod)


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of (x @ W^T) against targets, chunk by chunk, gradients computed on the way."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk):
        n = (targets != -100).sum().clamp(min=1)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        gx, gw = torch.empty_like(x), torch.zeros_like(weight)
        dev = x.device.type
        # under autocast the softmax gradient feeds bf16 matmuls, like any linear's backward would
        low = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        for s in range(0, x.shape[0], chunk):
            xs, ts = x[s:s + chunk], targets[s:s + chunk]
            logits = (xs @ weight.T).float()  # the softmax and the loss in fp32 whatever the matmul's dtype
            keep = (ts != -100).unsqueeze(1)
            t = ts.clamp(min=0).unsqueeze(1)
            # log-sum-exp by hand, in place: one exp over the [chunk, V] block instead of logsumexp's
            # temporary and a second exp for the softmax (3x faster; 2026-11-30, [1024, 8192] fp32)
            m = logits.amax(-1, keepdim=True)
            target = logits.gather(1, t)
            e = logits.sub_(m).exp_()
            z = e.sum(-1, keepdim=True)
            loss += ((m + z.log() - target) * keep).sum()
            # d loss / d logits = softmax - onehot, on kept rows; reuse the logits buffer
            p = e.div_(z).scatter_add_(1, t, -keep.float()).mul_(keep).to(low)
            gx[s:s + chunk] = p @ weight
            if low == gw.dtype:
                gw.addmm_(p.T, xs)
            else:  # in-place addmm_ escapes autocast (it would run in fp32): a bf16 product, summed in fp32
                gw += p.T @ xs
        ctx.save_for_backward(gx / n, gw / n)
        return loss / n

    @staticmethod
    def backward(ctx, grad):
        gx, gw = ctx.saved_tensors
        return gx * grad, gw * grad, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int = 1024) -> torch.Tensor:
    """Return mean cross-entropy of x @ weight.T against targets (-100 ignored) without [N, V] logits.

    The gradients are formed chunk by chunk during the forward pass, so training never holds the
    full logits or their gradient; without a graph only the loss is computed.
    """
    x, targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x, weight, targets, chunk)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[0], chunk):
        logits = (x[s:s + chunk] @ weight.T).float()
        total += F.cross_entropy(logits, targets[s:s + chunk], ignore_index=-100, reduction="sum")
    return total / (targets != -100).sum().clamp(min=1)
