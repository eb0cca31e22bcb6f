"""The two layouts of routed indices over flat rows ``x [N, D]``, resolved inside the kernels.

``idx [K]`` rows of ``x``, or ``idx [B, K]`` positions in B sequences of ``T = N // B`` rows (entry ``(b, j)``
is row ``b * T + idx[b, j]``; a position outside ``[0, T)`` is invalid, so it cannot reach another sequence).
No index tensor is built on the host side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["flat_rows", "layout"]


def layout(idx: torch.Tensor, n: int) -> tuple[int, int]:
    """``(entries per sequence, sequence length)``: ``[B, K]`` positions in B sequences of n // B rows, or
    ``[K]`` rows of one sequence of n."""
    if idx.dim() == 2:
        return max(idx.shape[1], 1), n // max(idx.shape[0], 1)
    return max(idx.shape[0], 1), n


@triton.jit
def flat_rows(idx_ptr, j, n_idx, k_seq, seq_len):
    """Flat rows of entries j (scalar or block) and whether each is real (invalid rows come back as 0)."""
    pos = tl.load(idx_ptr + j, mask=j < n_idx, other=-1).to(tl.int64)
    valid = (pos >= 0) & (pos < seq_len)
    return (j // k_seq) * seq_len + tl.where(valid, pos, 0), valid
