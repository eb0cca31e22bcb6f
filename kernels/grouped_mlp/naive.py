"""Readable PyTorch reference for the grouped expert SwiGLU MLP (the ground truth for the Triton op).

``out[t] = sum_{a: token_idx[a] == t, 0 <= expert_idx[a] < E} weight[a] * y_{expert_idx[a]}(x[t])`` with the
SwiGLU expert ``y_e(v) = (silu(v @ w1[e]) * (v @ w3[e])) @ w2[e]``. Assignments whose expert index is -1 or
``>= E`` are no-op experts: skipped (no FLOPs, no contribution, zero gradient for their weight). Tokens
without a real assignment get 0.

Math runs in ``promote(x.dtype, float32)`` (fp32 for fp16/bf16/fp32, float64 for float64 so ``gradcheck``
sees an exact reference); the result is rounded once to ``x.dtype``. Autograd provides every gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_swiglu_naive"]


def grouped_swiglu_naive(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    token_idx: torch.Tensor,
    expert_idx: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """Loop over experts: ``index_select`` the expert's tokens, SwiGLU, router-weighted ``index_add``.

    Args:
        x: ``[N, D]`` tokens.
        w1, w3: ``[E, D, F]`` gate and up projections.
        w2: ``[E, F, D]`` down projection.
        token_idx: ``[M]`` int64 token of each assignment in ``[0, N)`` (repeats allowed).
        expert_idx: ``[M]`` int64 expert of each assignment; -1 or ``>= E`` means a no-op expert.
        weight: ``[M]`` router weight of each assignment (fp32).

    Returns:
        ``out [N, D]`` in ``x.dtype``.
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    n_exp = w1.shape[0]
    out = torch.zeros(x.shape, dtype=acc, device=x.device)  # [N, D]
    for e in range(n_exp):
        sel = (expert_idx == e).nonzero().squeeze(1)  # [M_e] assignments of expert e
        if sel.numel() == 0:
            continue
        rows = token_idx.index_select(0, sel)  # [M_e]
        xe = x.index_select(0, rows).to(acc)  # [M_e, D]
        h = F.silu(xe @ w1[e].to(acc)) * (xe @ w3[e].to(acc))  # [M_e, F]
        ye = h @ w2[e].to(acc)  # [M_e, D]
        out = out.index_add(0, rows, weight.index_select(0, sel).to(acc)[:, None] * ye)
    return out.to(x.dtype)
