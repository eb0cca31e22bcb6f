"""Shared transformer blocks: RMSNorm, RoPE, GQA attention, SwiGLU MLP, pre/post-norm block.

Plain PyTorch, no Lightning. Attention takes explicit token positions so that routed families (MoD) can
run a block on a gathered subset of tokens with their ORIGINAL RoPE positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for bf16 stability
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding (half-split layout) with a cos/sin table for positions < max_len."""

    def __init__(self, head_dim: int, max_len: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [L, hd/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        """x: [B, H, T, hd]; pos: None (0..T-1) or [B, T] original positions."""
        T = x.shape[2]
        if pos is None:
            cos, sin = self.cos[:T], self.sin[:T]  # [T, hd/2]
        else:
            cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # [B, 1, T, hd/2]
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


def naive_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference causal GQA attention with explicit matmuls (fp32 softmax).

    q: [B, Hq, T, hd]; k, v: [B, Hk, T, hd] -> [B, Hq, T, hd]. Visible to FLOP counters, unlike SDPA on CPU.
    """
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    T = q.shape[2]
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [B, Hq, T, T]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
    return probs @ v


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GQA attention with an explicit boolean mask (fp32 softmax): decoding over ragged KV caches.

    q: [B, Hq, Tq, hd]; k, v: [B, Hk, Tk, hd]; mask: [B, Tq, Tk] True where a key is visible -> [B, Hq, Tq, hd].
    A query row with no visible key reads key 0 instead of producing NaN; callers discard such rows.
    """
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    mask = mask | ~mask.any(-1, keepdim=True)  # empty rows: finite garbage, never NaN
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [B, Hq, Tq, Tk]
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1).to(v.dtype)
    return probs @ v


class KVCache:
    """One layer's KV cache with a length per sequence (a routed layer holds a different count per sequence).

    Rows ``[0, len[b])`` of sequence b are the keys/values of the tokens this layer processed, in position
    order, RoPE already applied at their true positions.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.len = torch.zeros(batch, dtype=torch.long, device=device)  # [B]

    def write_prefix(self, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> None:
        """k, v: [B, Hk, L, hd] of which the first n[b] rows are real (prefill); n: [B]."""
        L = k.shape[2]
        self.k[:, :, :L], self.v[:, :, :L] = k, v
        self.len = n.to(torch.long).clone()

    def append(self, k: torch.Tensor, v: torch.Tensor, take: torch.Tensor | None) -> None:
        """k, v: [B, Hk, 1, hd]; take: [B] bool (None = all), the sequences whose token this layer processes."""
        b = torch.arange(k.shape[0], device=k.device) if take is None else take.nonzero().squeeze(1)  # [b']
        slot = self.len[b]  # [b'] next free row per sequence
        # cast: under autocast k/v arrive in bf16 while the cache keeps the parameter dtype
        self.k[b, :, slot], self.v[b, :, slot] = k[b, :, 0].to(self.k.dtype), v[b, :, 0].to(self.v.dtype)
        self.len = self.len + (1 if take is None else take.long())

    def visible(self) -> torch.Tensor:
        """[B, 1, Lc] key mask over the filled prefix (Lc = longest length)."""
        Lc = int(self.len.max())
        return (torch.arange(Lc, device=self.len.device)[None] < self.len[:, None])[:, None]


class Attention(nn.Module):
    """Causal grouped-query attention; query head h reads KV head h // (n_heads // n_kv_heads).

    ``impl='sdpa'`` uses the fused PyTorch kernels; ``'naive'`` the explicit reference above.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, qk_norm: bool, impl: str = "sdpa"):
        super().__init__()
        self.impl = impl
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.wq = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else None

    def qkv(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor | None):
        """x: [B, T, D] -> q [B, Hq, T, hd], k and v [B, Hk, T, hd], RoPE applied at ``pos``."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q, pos), rope(k, pos), v

    def forward(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, D] with tokens in increasing position order -> [B, T, D]."""
        B, T, D = x.shape
        q, k, v = self.qkv(x, rope, pos)
        if self.impl == "naive":
            y = naive_causal_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))

    def forward_kv(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor | None = None):
        """forward() that also returns the post-RoPE k, v [B, Hk, T, hd] (prefill of a KV cache)."""
        B, T, D = x.shape
        q, k, v = self.qkv(x, rope, pos)
        if self.impl == "naive":
            y = naive_causal_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, D)), k, v

    def decode(
        self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor, cache: KVCache, take: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One new token per sequence. x: [B, 1, D]; pos: [B, 1] true positions; take: [B] bool, whose
        token this layer processes (its k/v enter the cache); rows not taken return garbage -> [B, 1, D]."""
        B, _, D = x.shape
        q, k, v = self.qkv(x, rope, pos)
        cache.append(k, v, take)
        mask = cache.visible()  # [B, 1, Lc]
        Lc = mask.shape[-1]
        y = masked_attention(q, cache.k[:, :, :Lc], cache.v[:, :, :Lc], mask)  # [B, Hq, 1, hd]
        return self.wo(y.transpose(1, 2).reshape(B, 1, D))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Attention + MLP with ``norm='pre'`` (x + f(N(x))) or ``'post'`` (N(x + f(x)))."""

    def __init__(
        self, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, qk_norm: bool, norm: str, attn_impl: str
    ):
        super().__init__()
        self.pre = norm == "pre"
        self.attn = Attention(d_model, n_heads, n_kv_heads, qk_norm, attn_impl)
        self.mlp = SwiGLU(d_model, d_ff)
        self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)

    def forward(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]."""
        if self.pre:
            x = x + self.attn(self.norm1(x), rope, pos)
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x, rope, pos))
        return self.norm2(x + self.mlp(x))

    def delta_with(self, x: torch.Tensor, attn_fn) -> torch.Tensor:
        """The block's update WITHOUT the residual, f = block(x) - x, with attention supplied by ``attn_fn``
        (cached decode, KV capture, gathered tokens). x: [B, T, D] -> f [B, T, D].

        Pre-norm: f = a + mlp(N2(x + a)) with a = attn(N1(x)); f = 0 exactly when both branches output 0.
        Post-norm: f = N2(h + mlp(h)) - x with h = N1(x + attn(x)), i.e. x + f is the post-norm block.
        """
        if self.pre:
            a = attn_fn(self.norm1(x))
            return a + self.mlp(self.norm2(x + a))
        h = self.norm1(x + attn_fn(x))
        return self.norm2(h + self.mlp(h)) - x

    def forward_with(self, x: torch.Tensor, attn_fn) -> torch.Tensor:
        """forward() with attention supplied by ``attn_fn`` (KV-cache prefill or decode); same arithmetic."""
        if self.pre:
            x = x + attn_fn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + attn_fn(x))
        return self.norm2(x + self.mlp(x))


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator=None) -> torch.Tensor:
    """Next tokens for generation: logits [B, V] -> ids [B, 1]; temperature <= 0 is greedy, top_k filters."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)
