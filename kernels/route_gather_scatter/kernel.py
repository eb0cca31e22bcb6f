"""Triton kernels for routed gather / scatter-add over flat rows (``x [N, D]``).

Indices come in two layouts, resolved inside the kernels (no index tensor is built on the host side):
``idx [K]`` rows of ``x``, or ``idx [B, K]`` positions in B sequences of ``T = N // B`` rows (entry ``(b, j)``
is row ``b * T + idx[b, j]``; a position outside ``[0, T)`` is invalid, so it cannot reach another sequence).

Three kernels, all memory-bound:

- ``_rows_kernel`` (a block of entries per program): gather ``out[j] = src[row j]``, or, for DISTINCT rows,
  scatter ``out[row j] += w[j] * src[j]`` in place, with no atomics, sort or segments. It is the gather
  forward, and the distinct fast path's scatter-add forward (out = a clone of x) and gather backward
  (out = zeros).
- ``_segment_kernel``: ``out[n] = base[n] + sum_{j: idx[j] == n} w[j] * src[j]`` for EVERY row n, through a
  CSR view of flat ``idx`` (stable sort + ``searchsorted``). It is the general scatter-add forward (base = x)
  and gather backward (no base, no weights). Each output row is written exactly once, in one pass, with fp32
  accumulation in a fixed order: repeated indices need no atomics and results are deterministic.
- ``_scatter_bwd_kernel``: ``df[j] = w[j] * dy[row j]`` and ``dw[j] = <f[j], dy[row j]>`` (fp32 dot); no
  segments, so both paths share it.

Invalid indices are never written and read as 0, so an unchecked bad index cannot corrupt memory (range
checks with a host sync live in ``op.py``). Pointer arithmetic only (no ``tl.make_block_ptr``) so the code
runs on Triton 3.6 and 3.9; row offsets are int64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = [
    "INTERPRET",
    "POISON_EMPTY",
    "build_segments",
    "gather_rows",
    "scatter_add_backward",
    "scatter_rows",
    "segment_sum",
]

# Tests set this (or MIXDEPTH_POISON_EMPTY=1) so outputs start as NaN and unwritten elements fail.
POISON_EMPTY: bool = os.environ.get("MIXDEPTH_POISON_EMPTY", "") == "1"
MAX_BLOCK_D = 1024
ROWS_TILE = 4096  # power of two: _rows_kernel takes BLOCK_R = ROWS_TILE // BLOCK_D entries (4 at D = 1024)
# Triton picks interpreter vs compiler when the @triton.jit decorators below run, i.e. at this import.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "") == "1"


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON_EMPTY and dtype.is_floating_point:
        out.fill_(float("nan"))
    return out


def _block_d(d: int, block_d: int | None) -> int:
    return block_d if block_d is not None else min(triton.next_power_of_2(d), MAX_BLOCK_D)


def _layout(idx: torch.Tensor, n: int) -> tuple[int, int]:
    """``(entries per sequence, sequence length)``: ``[B, K]`` positions in B sequences of n // B rows, or
    ``[K]`` rows of one sequence of n."""
    if idx.dim() == 2:
        return max(idx.shape[1], 1), n // max(idx.shape[0], 1)
    return max(idx.shape[0], 1), n


@triton.jit
def _rows(idx_ptr, j, n_idx, k_seq, seq_len):
    """Flat rows of entries j (scalar or block) and whether each is real (invalid rows come back as 0)."""
    pos = tl.load(idx_ptr + j, mask=j < n_idx, other=-1).to(tl.int64)
    valid = (pos >= 0) & (pos < seq_len)
    return (j // k_seq) * seq_len + tl.where(valid, pos, 0), valid


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
    row, valid = _rows(idx_ptr, j, n_idx, k_seq, seq_len)
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
    row, valid = _rows(idx_ptr, j, n_idx, k_seq, seq_len)
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


def _launch_rows(src, w, idx, out, n_rows: int, scatter: bool, block_d: int | None) -> None:
    k, d = idx.numel(), src.shape[1]
    if k and d:
        bd = _block_d(d, block_d)
        br = max(1, ROWS_TILE // bd)
        k_seq, seq_len = _layout(idx, n_rows)
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
        idx: contiguous ``[K]`` rows, or ``[B, K]`` positions (see the module docstring); int64 or int32;
            invalid rows read as 0.
        block_d: columns per program (power of two); default ``min(next_pow2(D), 1024)``.

    Returns:
        ``[B * K, D]`` contiguous, dtype of ``src``.
    """
    out = _empty((idx.numel(), src.shape[1]), src.dtype, src.device)
    _launch_rows(src, None, idx, out, src.shape[0], False, block_d)
    return out


def scatter_rows(
    out: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, w: torch.Tensor, block_d: int | None = None
) -> torch.Tensor:
    """In place ``out[row j] += w[j] * src[j]`` (fp32 sum, rounded once) for DISTINCT rows: no atomics.

    A repeated row is a race (one contribution wins); memory stays safe. Invalid rows are skipped.

    Args:
        out: ``[N, D]`` with unit column stride, updated in place.
        idx: contiguous ``[K]`` rows, or ``[B, K]`` positions (see the module docstring); int64 or int32.
        src: ``[B * K, D]`` contributions.
        w: ``[B * K]`` per-contribution weights.
        block_d: columns per program; see ``gather_rows``.

    Returns:
        ``out``.
    """
    _launch_rows(src, w, idx, out, out.shape[0], True, block_d)
    return out


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
        src: ``[K, D]`` contributions.
        w: ``[K]`` per-contribution weights, or None (one).
        order: ``[K]`` from ``build_segments``.
        seg: ``[N + 1]`` from ``build_segments``.
        out_dtype: dtype of the result; accumulation is fp32 and rounded once.
        block_d: columns per program; see ``gather_rows``.

    Returns:
        ``[N, D]`` contiguous.
    """
    n, d = seg.shape[0] - 1, src.shape[1]
    out = _empty((n, d), out_dtype, src.device)
    if n and d:
        bd = _block_d(d, block_d)
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
        dy: ``[N, D]`` upstream gradient.
        idx: contiguous ``[K]`` rows, or ``[B, K]`` positions (see the module docstring); int64 or int32.
        f: ``[B * K, D]`` routed block output.
        w: ``[B * K]`` router weights.
        need_df: compute ``df [B * K, D] = w[:, None] * dy[rows]`` (dtype of f).
        need_dw: compute ``dw [B * K] = sum_d f * dy[rows]`` (fp32 dot, dtype of w; 0 for invalid entries,
            whose f is not read).
        block_d: columns per loop step; see ``gather_rows``.

    Returns:
        ``(df, dw)``, each None when not requested.
    """
    n, d = dy.shape
    k = idx.numel()
    k_seq, seq_len = _layout(idx, n)
    df = _empty((k, d), f.dtype, f.device) if need_df else None
    dw = _empty((k,), w.dtype, w.device) if need_dw else None
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
            BLOCK_D=_block_d(d, block_d),
        )
    return df, dw
