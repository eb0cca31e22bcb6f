"""Gradients of a routed scatter-add ``y[row j] += w[j] * f[j]`` with respect to f and w.

``_scatter_bwd_kernel`` (one program per entry j): ``df[j] = w[j] * dy[row j]`` and
``dw[j] = <f[j], dy[row j]>`` (fp32 dot). It needs no segments, so repeated and distinct rows share it. Rows
resolve through ``rows.flat_rows`` (either index layout); an invalid entry reads nothing (df 0, dw 0), so an
unchecked bad index cannot corrupt memory. Pointer arithmetic only (Triton 3.6 and 3.9); int64 row offsets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import launch
from kernels.common.rows import flat_rows, layout

__all__ = ["scatter_add_backward"]


@triton.jit
def _scatter_bwd_kernel(
    dy_ptr,
    idx_ptr,
    f_ptr,
    w_ptr,
    df_ptr,
    dw_ptr,
    n_idx,
    k_seq,
    seq_len,
    D,
    stride_dy,
    stride_f,
    stride_df,
    HAS_DF: tl.constexpr,
    HAS_DW: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    row, valid = flat_rows(idx_ptr, j, n_idx, k_seq, seq_len)
    # invalid row: load nothing (dw = 0 whatever f holds there, e.g. rows never written); one comparison
    # instead of `cmask & valid` (the 3.9 interpreter turns bool & scalar-bool into int32)
    d_valid = tl.where(valid, D, 0)
    wj = tl.load(w_ptr + j).to(tl.float32)
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        g = tl.load(dy_ptr + row * stride_dy + cols, mask=cols < d_valid, other=0.0).to(tl.float32)
        if HAS_DF:
            tl.store(df_ptr + j * stride_df + cols, (wj * g).to(df_ptr.dtype.element_ty), mask=cmask)
        if HAS_DW:
            fv = tl.load(f_ptr + j * stride_f + cols, mask=cols < d_valid, other=0.0).to(tl.float32)
            dot += fv * g
    if HAS_DW:
        tl.store(dw_ptr + j, tl.sum(dot, axis=0).to(dw_ptr.dtype.element_ty))


def scatter_add_backward(
    dy: torch.Tensor,
    idx: torch.Tensor,
    f: torch.Tensor,
    w: torch.Tensor,
    need_df: bool = True,
    need_dw: bool = True,
    block_d: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``y[row j] += w[j] * f[j]`` with respect to f and w (repeats allowed, no segments).

    Args:
        dy: ``[N, D]`` upstream gradient, unit column stride.
        idx: contiguous ``[K]`` rows, or ``[B, K]`` positions (see ``rows``); int64 or int32.
        f: ``[B * K, D]`` routed block output.
        w: ``[B * K]`` router weights.
        need_df: compute ``df [B * K, D] = w[:, None] * dy[rows]`` (dtype of f).
        need_dw: compute ``dw [B * K] = sum_d f * dy[rows]`` (fp32 dot, dtype of w; 0 for invalid entries,
            whose f is not read).
        block_d: columns per loop step (power of two); default ``launch.block_d``.

    Returns:
        ``(df, dw)``, each None when not requested, every element written.
    """
    n, d = dy.shape
    k = idx.numel()
    k_seq, seq_len = layout(idx, n)
    df = torch.empty((k, d), dtype=f.dtype, device=f.device) if need_df else None
    dw = torch.empty((k,), dtype=w.dtype, device=w.device) if need_dw else None
    if k and (need_df or need_dw):
        if d == 0:
            if dw is not None:
                dw.zero_()
            return df, dw
        _scatter_bwd_kernel[(k,)](
            dy,
            idx,
            f,
            w,
            df if df is not None else f,
            dw if dw is not None else w,
            k,
            k_seq,
            seq_len,
            d,
            dy.stride(0),
            f.stride(0),
            df.stride(0) if df is not None else 0,
            HAS_DF=need_df,
            HAS_DW=need_dw,
            BLOCK_D=launch.block_d(d, block_d),
        )
    return df, dw
