"""Triton kernel for routed gather and distinct scatter-add over flat rows (``x [N, D]``).

Indices come in either layout of ``kernels.common.rows`` (``idx [K]`` rows, or ``idx [B, K]`` positions per
sequence), resolved inside the kernel. ``_rows_kernel`` (a block of entries per program, memory-bound):
gather ``out[j] = src[row j]``, or, for DISTINCT rows, scatter ``out[row j] += w[j] * src[j]`` in place, with
no atomics, sort or segments. It is the gather forward, and the distinct fast path's scatter-add forward
(out = a clone of x) and gather backward (out = zeros). The general scatter-add (repeated rows) and gather
backward are ``kernels.common.segments``; the scatter-add backward is ``kernels.common.scatter_backward``.

Invalid indices are never written and read as 0, so an unchecked bad index cannot corrupt memory (range
checks with a host sync live in ``op.py``). Pointer arithmetic only (no ``tl.make_block_ptr``) so the code
runs on Triton 3.6 and 3.9; row offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import launch
from kernels.common.rows import flat_rows, layout

__all__ = ["gather_rows", "scatter_rows"]

ROWS_TILE = 4096  # power of two: _rows_kernel takes BLOCK_R = ROWS_TILE // BLOCK_D entries (4 at D = 1024)


@triton.jit
def _rows_kernel(
    src_ptr,
    w_ptr,
    idx_ptr,
    out_ptr,
    n_idx,
    k_seq,
    seq_len,
    D,
    stride_src,
    stride_out,
    SCATTER: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols[None, :] < D
    row, valid = flat_rows(idx_ptr, j, n_idx, k_seq, seq_len)
    if SCATTER:  # out[row j] += w[j] * src[j]; rows distinct, so no two programs touch one row
        v = tl.load(src_ptr + j[:, None] * stride_src + cols[None, :], mask=(j < n_idx)[:, None] & cmask, other=0.0)
        v = v.to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + j, mask=j < n_idx, other=0.0).to(tl.float32)[:, None]
        optr = out_ptr + row[:, None] * stride_out + cols[None, :]
        omask = valid[:, None] & cmask
        v = tl.load(optr, mask=omask, other=0.0).to(tl.float32) + v  # fp32 sum, rounded once
    else:  # out[j] = src[row j]
        v = tl.load(src_ptr + row[:, None] * stride_src + cols[None, :], mask=valid[:, None] & cmask, other=0.0)
        optr = out_ptr + j[:, None] * stride_out + cols[None, :]
        omask = (j < n_idx)[:, None] & cmask
    tl.store(optr, v.to(out_ptr.dtype.element_ty), mask=omask)


def _launch_rows(src, w, idx, out, n_rows: int, scatter: bool, block_d: int | None) -> None:
    k, d = idx.numel(), src.shape[1]
    if k and d:
        bd = launch.block_d(d, block_d)
        br = max(1, ROWS_TILE // bd)
        k_seq, seq_len = layout(idx, n_rows)
        grid = (triton.cdiv(k, br), triton.cdiv(d, bd))
        _rows_kernel[grid](
            src,
            w if w is not None else src,  # dummy pointer, never read when HAS_W is False
            idx,
            out,
            k,
            k_seq,
            seq_len,
            d,
            src.stride(0),
            out.stride(0),
            SCATTER=scatter,
            HAS_W=w is not None,
            BLOCK_R=br,
            BLOCK_D=bd,
        )


def gather_rows(src: torch.Tensor, idx: torch.Tensor, block_d: int | None = None) -> torch.Tensor:
    """``out[j] = src[row j]`` (repeats allowed).

    Args:
        src: ``[N, D]`` with unit column stride.
        idx: contiguous ``[K]`` rows, or ``[B, K]`` positions (see ``kernels.common.rows``); int64 or int32;
            invalid rows read as 0.
        block_d: columns per program (power of two); default ``kernels.common.launch.block_d``.

    Returns:
        ``[B * K, D]`` contiguous, dtype of ``src``.
    """
    out = torch.empty((idx.numel(), src.shape[1]), dtype=src.dtype, device=src.device)
    _launch_rows(src, None, idx, out, src.shape[0], False, block_d)
    return out


def scatter_rows(
    out: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, w: torch.Tensor, block_d: int | None = None
) -> torch.Tensor:
    """In place ``out[row j] += w[j] * src[j]`` (fp32 sum, rounded once) for DISTINCT rows: no atomics.

    A repeated row is a race (one contribution wins); memory stays safe. Invalid rows are skipped.

    Args:
        out: ``[N, D]`` with unit column stride, updated in place.
        idx: contiguous ``[K]`` rows, or ``[B, K]`` positions (see ``kernels.common.rows``); int64 or int32.
        src: ``[B * K, D]`` contributions.
        w: ``[B * K]`` per-contribution weights.
        block_d: columns per program; see ``gather_rows``.

    Returns:
        ``out``.
    """
    _launch_rows(src, w, idx, out, out.shape[0], True, block_d)
    return out
