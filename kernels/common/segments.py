"""Repeated-index reduction without atomics: a CSR view of flat indices and a segmented sum over it.

``build_segments`` stably sorts the indices and finds each row's segment with ``searchsorted`` (no host sync).
``_segment_kernel`` computes ``out[n] = base[n] + sum_{j: idx[j] == n} w[j] * src[j]`` for EVERY row n: each
output row is written exactly once, in one pass, with fp32 accumulation in index order, so repeated indices
need no atomics and results are deterministic (the summation order of ``index_add``). Pointer arithmetic only
(Triton 3.6 and 3.9); row offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import launch

__all__ = ["build_segments", "segment_sum"]


@triton.jit
def _segment_kernel(
    base_ptr,
    src_ptr,
    w_ptr,
    order_ptr,
    seg_ptr,
    out_ptr,
    D,
    stride_base,
    stride_src,
    stride_out,
    HAS_BASE: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    if HAS_BASE:
        acc = tl.load(base_ptr + n * stride_base + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    start = tl.load(seg_ptr + n).to(tl.int32)
    end = tl.load(seg_ptr + n + 1).to(tl.int32)
    for s in range(start, end):
        j = tl.load(order_ptr + s).to(tl.int64)
        v = tl.load(src_ptr + j * stride_src + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + j).to(tl.float32)
        acc += v
    tl.store(out_ptr + n * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def build_segments(idx: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR view of flat indices, with no host sync.

    Args:
        idx: ``[K]`` int64 row indices (any order, repeats allowed; values outside ``[0, n_rows)`` end up
            in no segment, i.e. they are ignored).
        n_rows: N, the number of rows of the target.

    Returns:
        ``order [K]`` (stable argsort of ``idx``) and ``seg [N + 1]`` with the contributions to row n at
        ``order[seg[n]:seg[n + 1]]``, in their original order.
    """
    sorted_idx, order = torch.sort(idx, stable=True)
    rows = torch.arange(n_rows + 1, device=idx.device, dtype=sorted_idx.dtype)
    return order, torch.searchsorted(sorted_idx, rows)


def segment_sum(
    base: torch.Tensor | None,
    src: torch.Tensor,
    w: torch.Tensor | None,
    order: torch.Tensor,
    seg: torch.Tensor,
    out_dtype: torch.dtype,
    block_d: int | None = None,
) -> torch.Tensor:
    """``out[n] = base[n] + sum_{s in seg n} w[order[s]] * src[order[s]]`` for every row n, in one pass.

    Args:
        base: ``[N, D]`` added to every row, or None (zero).
        src: ``[K, D]`` contributions, unit column stride.
        w: ``[K]`` per-contribution weights, or None (one).
        order: ``[K]`` from ``build_segments``.
        seg: ``[N + 1]`` from ``build_segments``.
        out_dtype: dtype of the result; accumulation is fp32 and rounded once.
        block_d: columns per program (power of two); default ``launch.block_d``.

    Returns:
        ``[N, D]`` contiguous, every element written.
    """
    n, d = seg.shape[0] - 1, src.shape[1]
    out = torch.empty((n, d), dtype=out_dtype, device=src.device)
    if n and d:
        bd = launch.block_d(d, block_d)
        grid = (n, triton.cdiv(d, bd))
        _segment_kernel[grid](
            base if base is not None else out,  # dummy pointer, never read when HAS_BASE is False
            src,
            w if w is not None else src,
            order,
            seg,
            out,
            d,
            base.stride(0) if base is not None else 0,
            src.stride(0),
            out.stride(0),
            HAS_BASE=base is not None,
            HAS_W=w is not None,
            BLOCK_D=bd,
        )
    return out
