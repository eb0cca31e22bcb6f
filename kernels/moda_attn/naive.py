"""Readable PyTorch reference for MoDA attention (the ground truth for the Triton kernel).

MoDA (Mixture-of-Depths Attention, arXiv 2603.15619, shared/papers/000, 002): the query of head ``h`` at
position ``t`` attends, in ONE softmax, to

* the causal sequence keys/values of this layer, ``k[b, h // G, s]`` for ``s <= t``, and
* the ``S`` depth slots of the SAME position, ``kd[b, h // G, t, j]`` for ``j < S`` (earlier layers).

Both logit sets share the softmax denominator; two softmaxes added together would be a different operator.
"""

from __future__ import annotations

import math

import torch


def moda_attn_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kd: torch.Tensor | None = None,
    vd: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Joint sequence + depth attention, materialising the ``[B, Hq, T, T + S]`` logits.

    Args:
        q: queries ``[B, Hq, T, D]``.
        k: sequence keys ``[B, Hk, T, D]``; ``Hq = G * Hk``, query head ``h`` reads KV head ``h // G``.
        v: sequence values ``[B, Hk, T, D]``.
        kd: depth keys ``[B, Hk, T, S, D]`` (``S`` slots per position; ``S = 0`` or ``None``: plain causal).
        vd: depth values ``[B, Hk, T, S, D]``.
        scale: logit scale, default ``1 / sqrt(D)``.
        return_lse: also return the natural-log log-sum-exp of the joint logits, ``[B, Hq, T]`` (fp32).

    Returns:
        ``o`` ``[B, Hq, T, D]`` in ``q.dtype`` (computed in fp32, or fp64 for fp64 inputs);
        ``(o, lse)`` when ``return_lse``.
    """
    B, Hq, T, D = q.shape
    Hk = k.shape[1]
    if Hq % Hk:
        raise ValueError(f"Hq={Hq} is not a multiple of Hk={Hk}")
    G = Hq // Hk
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for gradcheck

    qf = q.to(acc)  # [B, Hq, T, D]
    kf = k.to(acc).repeat_interleave(G, dim=1)  # [B, Hq, T, D]
    vf = v.to(acc).repeat_interleave(G, dim=1)
    s_seq = (qf @ kf.transpose(-1, -2)) * scale  # [B, Hq, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s_seq = s_seq.masked_fill(~causal, float("-inf"))

    has_depth = kd is not None and kd.shape[3] > 0
    if has_depth:
        kdf = kd.to(acc).repeat_interleave(G, dim=1)  # [B, Hq, T, S, D]
        vdf = vd.to(acc).repeat_interleave(G, dim=1)
        s_dep = torch.einsum("bhtd,bhtsd->bhts", qf, kdf) * scale  # [B, Hq, T, S]
        logits = torch.cat([s_seq, s_dep], dim=-1)  # [B, Hq, T, T + S]
    else:
        logits = s_seq

    lse = torch.logsumexp(logits, dim=-1)  # [B, Hq, T]
    p = torch.softmax(logits, dim=-1)  # one shared denominator
    o = p[..., :T] @ vf  # [B, Hq, T, D]
    if has_depth:
        o = o + torch.einsum("bhts,bhtsd->bhtd", p[..., T:], vdf)
    o = o.to(q.dtype)
    if return_lse:
        return o, lse.float() if acc == torch.float32 else lse
    return o
