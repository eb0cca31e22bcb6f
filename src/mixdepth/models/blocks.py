"""Shared transformer blocks: RMSNorm, RoPE, the reference attention, GQA attention, SwiGLU MLP, pre/post-norm block.

Plain PyTorch, no Lightning. Attention takes explicit token positions so that routed families (MoD) can
run a block on a gathered subset of tokens with their ORIGINAL RoPE positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mixdepth.models.decoding import KVCache

if TYPE_CHECKING:
    from mixdepth.models.dense import DenseConfig


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
        """x: [B, T, H, hd], the projections' layout; pos: None (0..T-1) or [B, T] original positions.

        Rotating before the heads move to dim 1 keeps q, k, their gradients and the attention's output (which
        SDPA lays out as q) in the projections' layout: no transposing copy on either side of the attention."""
        T = x.shape[1]
        if pos is None:
            cos, sin = self.cos[:T, None], self.sin[:T, None]  # [T, 1, hd/2]
        else:
            cos, sin = self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2)  # [B, T, 1, hd/2]
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


def load_separate_projections(parts: tuple[str, ...], fused: str):
    """A ``load_state_dict`` pre-hook: a checkpoint written before the Linear ``fused`` held the row blocks ``parts``
    (before 2026-12-06, e9a56ec) stores them as separate weights; they are concatenated in that order."""

    def hook(module, state_dict, prefix, *_):
        keys = [f"{prefix}{part}.weight" for part in parts]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}{fused}.weight"] = torch.cat([state_dict.pop(k) for k in keys])

    return hook


# ---- attention ------------------------------------------------------------------------------------------
def causal_mask(n_q: int, n_k: int, device) -> torch.Tensor:
    """[n_q, n_k] bool visibility of the last n_q of n_k causal positions: query i sees keys 0..n_k - n_q + i."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    kd: torch.Tensor | None = None,
    vd: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference GQA attention with explicit matmuls: the ``naive`` path and decoding.

    One softmax, in fp32, over the keys a query sees and, optionally, its own position's depth slots (MoDA).
    The matmuls run in the inputs' precision (autocast's under autocast), the logits and the softmax in fp32.
    Visible to FLOP counters, unlike SDPA on CPU. Query head h reads KV head h // (Hq // Hk).

    Args:
        q: queries ``[B, Hq, Tq, hd]``.
        k, v: keys and values ``[B, Hk, Tk, hd]``.
        visible: ``[Tq, Tk]`` or ``[B, Tq, Tk]`` bool, True where query i sees key j. A row with no visible key
            reads key 0 instead of producing NaN (ragged decoding caches); callers discard such rows.
        kd, vd: depth slots ``[B, Hk, Tq, S, hd]`` of each query's own position, or None.

    Returns:
        ``[B, Hq, Tq, hd]`` in q's dtype.
    """
    G = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # [B, Hq, Tk, hd]
    visible = visible | ~visible.any(-1, keepdim=True)  # empty rows: finite garbage, never NaN
    if visible.dim() == 3:
        visible = visible[:, None]  # [B, 1, Tq, Tk]
    logits = (q @ k.transpose(-1, -2)).float() * scale  # [B, Hq, Tq, Tk]
    logits = logits.masked_fill(~visible, float("-inf"))
    if kd is not None:
        kd, vd = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)  # [B, Hq, Tq, S, hd]
        logits = torch.cat([logits, torch.einsum("bhtd,bhtsd->bhts", q, kd).float() * scale], -1)
    p = logits.softmax(-1)  # one shared denominator
    o = p[..., : k.shape[2]].to(v.dtype) @ v  # [B, Hq, Tq, hd]; the whole of p without depth slots
    if kd is not None:
        o = o + torch.einsum("bhts,bhtsd->bhtd", p[..., k.shape[2] :].to(vd.dtype), vd)
    return o.to(q.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention; query head h reads KV head h // (n_heads // n_kv_heads).

    ``attn_impl='sdpa'`` uses the fused PyTorch kernels; ``'naive'`` the reference above.
    """

    def __init__(self, c: DenseConfig):
        super().__init__()
        self.impl = c.attn_impl
        self.n_heads, self.n_kv_heads = c.n_heads, c.n_kv_heads
        self.head_dim = c.d_model // c.n_heads
        # q, k, v rows of one projection: one matmul reads x (and one writes its gradient) instead of three
        self.wqkv = nn.Linear(c.d_model, (c.n_heads + 2 * c.n_kv_heads) * self.head_dim, bias=False)
        self.register_load_state_dict_pre_hook(load_separate_projections(("wq", "wk", "wv"), "wqkv"))
        self.wo = nn.Linear(c.n_heads * self.head_dim, c.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if c.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if c.qk_norm else None

    def qkv(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor | None):
        """x: [B, T, D] -> q [B, Hq, T, hd], k and v [B, Hk, T, hd] (views of [B, T, H, hd] tensors), RoPE
        applied at ``pos``."""
        B, T, _ = x.shape
        heads = (self.n_heads, self.n_kv_heads, self.n_kv_heads)
        q, k, v = self.wqkv(x).view(B, T, sum(heads), self.head_dim).split(heads, dim=2)  # [B, T, H, hd] views
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q, pos).transpose(1, 2), rope(k, pos).transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, D] with tokens in increasing position order -> [B, T, D]."""
        return self.forward_kv(x, rope, pos)[0]

    def forward_kv(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor | None = None):
        """forward() that also returns the post-RoPE k, v [B, Hk, T, hd] (prefill of a KV cache)."""
        B, T, D = x.shape
        q, k, v = self.qkv(x, rope, pos)
        if self.impl == "naive":
            y = reference_attention(q, k, v, causal_mask(T, T, x.device))
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
        y = reference_attention(q, cache.k[:, :, :Lc], cache.v[:, :, :Lc], mask)  # [B, Hq, 1, hd]
        return self.wo(y.transpose(1, 2).reshape(B, 1, D))


class SwiGLU(nn.Module):
    """``w2(silu(x W1^T) * x W3^T)``, W1 (gate) and W3 (up) as the two halves of one projection ``w13``."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w13 = nn.Linear(d_model, 2 * d_ff, bias=False)  # gate rows, then up rows: one matmul
        self.register_load_state_dict_pre_hook(load_separate_projections(("w1", "w3"), "w13"))
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)  # [..., d_ff] views
        return self.w2(F.silu(gate) * up)


# ---- residual placement and the block ---------------------------------------------------------------------
def branch_input(x: torch.Tensor, norm: nn.Module, pre_norm: bool) -> torch.Tensor:
    """What a residual branch f reads: N(x) with ``norm='pre'`` (x + f(N(x))), x with ``'post'`` (N(x + f(x)))."""
    return norm(x) if pre_norm else x


def add_branch(x: torch.Tensor, y: torch.Tensor, norm: nn.Module, pre_norm: bool) -> torch.Tensor:
    """The residual stream after a branch whose output is y: x + y (pre-norm) or N(x + y) (post-norm), in x's dtype
    (a wider y, or the norm's fp32 weight, would otherwise widen a 16-bit stream: model.residual='autocast')."""
    return (x + y if pre_norm else norm(x + y)).to(x.dtype)


class Block(nn.Module):
    """Attention + MLP with ``norm='pre'`` (x + f(N(x))) or ``'post'`` (N(x + f(x))), built from a family config.

    The MLP may be replaced by one that returns ``(y, statistics)`` (MoDE's MoE): ``forward_with`` and
    ``delta_with`` return those statistics beside their output (None for the SwiGLU).
    """

    def __init__(self, c: DenseConfig):
        super().__init__()
        self.pre_norm = c.norm == "pre"
        self.attn = Attention(c)
        self.mlp = SwiGLU(c.d_model, c.d_ff)
        self.norm1, self.norm2 = RMSNorm(c.d_model), RMSNorm(c.d_model)

    def forward(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]."""
        return self.forward_with(x, lambda u: self.attn(u, rope, pos))[0]

    def forward_with(self, x: torch.Tensor, attn_fn):
        """forward() with attention supplied by ``attn_fn`` (KV-cache prefill or decode): x [B, T, D] ->
        (y [B, T, D], the MLP's statistics or None)."""
        x = add_branch(x, attn_fn(branch_input(x, self.norm1, self.pre_norm)), self.norm1, self.pre_norm)
        m, stats = self._mlp(branch_input(x, self.norm2, self.pre_norm))
        return add_branch(x, m, self.norm2, self.pre_norm), stats

    def delta_with(self, x: torch.Tensor, attn_fn):
        """The block's update WITHOUT the residual, f = block(x) - x, with attention supplied by ``attn_fn``
        (cached decode, KV capture, gathered tokens). x: [B, T, D] -> (f [B, T, D], the MLP's statistics or None).

        Pre-norm: f = a + mlp(N2(x + a)) with a = attn(N1(x)) (the sum of the branches, never x + f - x), so
        f = 0 exactly when both branches output 0. Post-norm has no such form: f = block(x) - x.
        """
        if not self.pre_norm:
            y, stats = self.forward_with(x, attn_fn)
            return y - x, stats
        a = attn_fn(self.norm1(x))
        m, stats = self._mlp(self.norm2(x + a))
        return a + m, stats

    def _mlp(self, h: torch.Tensor):
        """The MLP on its input h [B, T, D] -> (out [B, T, D], its statistics: a MoE's, or None)."""
        out = self.mlp(h)
        return out if isinstance(out, tuple) else (out, None)
