"""Public routed gather / scatter-add ops (MoD routed blocks, MoDE experts) with autograd.

Two forms, chosen by ``x.dim()``:

- batched: ``x [B, T, D]``, ``idx [B, K]`` positions per sequence (MoD: distinct). They address rows
  ``idx[b, j] + b * T`` of ``x.reshape(B * T, D)``; an index outside ``[0, T)`` is never written and reads
  as 0, so it cannot leak into another sequence.
- flat: ``x [N, D]``, ``idx [K]`` rows (MoDE / token-choice experts: repeats allowed and accumulated).

``distinct=True`` (keyword) is the fast path for indices that never repeat a row (MoD's per-sequence top-k,
and its causal-rule lists: distinct, sorted or not; sorted only helps locality). It skips the sort + CSR build:
scatter-add is ``y = x.clone()`` plus one kernel adding ``w[j] * f[j]`` into rows ``idx[j]`` (no atomics: a
row gets at most one update); gather's backward reads each row's slot from the inverse map ``slot[row] = j``
(``dx = [g; 0][slot]``). Under ``torch.compile`` the distinct scatter-add is written the same way,
``y = where(selected, x + [w f; 0][slot], x)``: plain indexing that inductor fuses into the kernels around
it (the residual add before, the next norm after), where an opaque kernel needs its own full copy of ``x``
(and, for a kernel that mutates its input, a zeroed ``dx`` plus a copy of it). The promise is not verified
on the hot path (that needs a host sync); ``check`` verifies it along with the range, and the naive
reference always does. Broken, the op stays memory-safe but a repeated row keeps one contribution of its
several (race), in y and in dx. Results equal the general path's: same fp32 sums, rounded once.

Design choices:

- ``route_scatter_add`` is out-of-place and single-pass: one kernel writes every row of ``y`` exactly once
  (``x`` copied, routed rows summed in fp32 and rounded once). No in-place variant: the residual ``x`` is
  normally saved for backward by the norm and router that read it, so overwriting it would break autograd.
- Repeated indices are reduced through a sorted segmented reduction (stable sort + CSR), not atomics: no
  extra fp32 buffer, deterministic, same summation order as ``index_add``. Gather's backward uses it too.
  Gather's forward and scatter's backward need no segments and are shared by both paths.
- Range (and distinct) checks need a host sync on CUDA: by default they run on CPU tensors only
  (``check=None``); pass ``check=True`` to force them. Unchecked kernels stay memory-safe (see ``kernel.py``).
- Triton or reference by ``kernels.common.dispatch.use_triton``: the kernels on CUDA tensors or under the
  interpreter (bfloat16 refused there), ``naive.py`` on a plain CPU, so the laptop path works.
"""

from __future__ import annotations

import torch

from kernels.common.dispatch import HAS_TRITON, use_triton
from kernels.route_gather_scatter import naive

if HAS_TRITON:
    from kernels.common.scatter_backward import scatter_add_backward
    from kernels.common.segments import build_segments, segment_sum
    from kernels.route_gather_scatter.kernel import gather_rows, scatter_rows

__all__ = ["route_gather", "route_scatter_add"]


def _validate(x: torch.Tensor, idx: torch.Tensor, check: bool | None, distinct: bool) -> None:
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point, got {x.dtype}")
    if idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"idx must be int64 (or int32), got {idx.dtype}")
    if x.dim() == 3:
        if idx.dim() != 2 or idx.shape[0] != x.shape[0]:
            raise ValueError(f"batched x {tuple(x.shape)} needs idx [B, K], got {tuple(idx.shape)}")
    elif x.dim() != 2 or idx.dim() != 1:
        raise ValueError(f"expected x [B, T, D] + idx [B, K] or x [N, D] + idx [K], got {x.shape}, {idx.shape}")
    if idx.device != x.device:
        raise ValueError(f"idx on {idx.device}, x on {x.device}")
    if check or (check is None and not idx.is_cuda and not torch.compiler.is_compiling()):  # compiled: no host sync
        n = x.shape[-2]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"route index out of range [0, {n}): min {int(idx.min())}, max {int(idx.max())}")
        if distinct:
            naive.check_distinct(idx)


def _flat_index(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``[K_total]`` int64 rows of the ``[n, D]`` rows for ``build_segments``; invalid positions map to -1."""
    if idx.dim() == 1:
        return idx.to(torch.int64)
    t = n // max(idx.shape[0], 1)
    return torch.where((idx >= 0) & (idx < t), naive.flatten_index(idx, t).view(idx.shape), -1).reshape(-1)


def _slots(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of a distinct index list: ``[n]`` int64, ``slot[r] = j`` for the entry j that selects row r,
    ``K_total`` for unselected rows. Invalid entries (outside the sequence, or outside [0, n)) select nothing."""
    rows = _flat_index(idx, n)  # [K_total]
    k = rows.numel()
    rows = torch.where((rows >= 0) & (rows < n), rows, n)  # invalid entries land in a spare slot, dropped
    slot = torch.full((n + 1,), k, dtype=torch.int64, device=rows.device)
    slot[rows] = torch.arange(k, device=rows.device)
    return slot[:n]


def _pad_row(t: torch.Tensor) -> torch.Tensor:
    """``[K, D] -> [K + 1, D]``: a zero row at index K, what unselected rows read through ``_slots``."""
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


def _scatter_add_indexed(x: torch.Tensor, idx: torch.Tensor, f: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Distinct scatter-add in plain indexing (the compiled form): x [N, D], f [K, D], w [K] -> y [N, D]."""
    slot = _slots(idx, x.shape[0])
    upd = _pad_row(f.float() * w.float()[:, None])[slot]  # [N, D] fp32, zero on unselected rows
    return torch.where((slot < idx.numel())[:, None], (x.float() + upd).to(x.dtype), x)


class _RouteGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, idx: torch.Tensor, distinct: bool) -> torch.Tensor:  # x [N, D]
        ctx.save_for_backward(idx)
        ctx.n_rows, ctx.distinct = x.shape[0], distinct
        return gather_rows(x, idx)  # [B*K, D]

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # g [B*K, D]
        (idx,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        g = g.contiguous()
        if ctx.distinct:  # one pass writing every row; under compile fused into the sum of x's gradients
            dx = _pad_row(g)[_slots(idx, ctx.n_rows)]
        else:
            order, seg = build_segments(_flat_index(idx, ctx.n_rows), ctx.n_rows)
            dx = segment_sum(None, g, None, order, seg, g.dtype)
        return dx, None, None  # dx [N, D]


class _RouteScatterAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, idx: torch.Tensor, f: torch.Tensor, w: torch.Tensor, distinct: bool):
        ctx.save_for_backward(idx, f, w)
        if distinct and torch.compiler.is_compiling():  # plain indexing: inductor fuses it with its neighbours
            return _scatter_add_indexed(x, idx, f, w)
        if distinct:
            return scatter_rows(x.clone(), idx, f, w)  # [N, D]
        order, seg = build_segments(_flat_index(idx, x.shape[0]), x.shape[0])
        return segment_sum(x, f, w, order, seg, x.dtype)  # [N, D]

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # dy [N, D]
        idx, f, w = ctx.saved_tensors
        need_dx, _, need_df, need_dw, _ = ctx.needs_input_grad
        df, dw = scatter_add_backward(dy.contiguous(), idx, f, w, need_df, need_dw)
        return (dy if need_dx else None), None, df, dw, None


def route_gather(
    x: torch.Tensor, idx: torch.Tensor, *, check: bool | None = None, distinct: bool = False
) -> torch.Tensor:
    """Gathers the routed rows: ``xs[b, j] = x[b, idx[b, j]]`` (batched) or ``xs[j] = x[idx[j]]`` (flat).

    Args:
        x: ``[B, T, D]`` or ``[N, D]`` floating point.
        idx: ``[B, K]`` positions per sequence, or ``[K]`` flat rows (repeats allowed); int64 (or int32).
        check: range-check idx (ValueError); None checks eager CPU tensors only, True forces a host sync on CUDA.
        distinct: the caller promises no row repeats (per sequence when batched): fast backward, no sort or
            segments; see the module docstring for the contract.

    Returns:
        ``[B, K, D]`` or ``[K, D]``, dtype of x. Backward sums into the selected rows of dx (repeats add,
        fp32); unselected rows get 0.
    """
    _validate(x, idx, check, distinct)
    if not use_triton("route_gather", x):
        return naive.route_gather_naive(x, idx, distinct=distinct)
    d = x.shape[-1]
    xs = _RouteGather.apply(x.reshape(-1, d).contiguous(), idx.contiguous(), distinct)  # [B*K, D]
    return xs.view(*idx.shape, d)


def route_scatter_add(
    x: torch.Tensor,
    idx: torch.Tensor,
    f: torch.Tensor,
    w: torch.Tensor,
    *,
    check: bool | None = None,
    distinct: bool = False,
) -> torch.Tensor:
    """The routed residual update: ``y = x`` except ``y[idx[j]] = x[idx[j]] + sum w[j] * f[j]``.

    Backward: ``dx = dy`` (every row), ``df[j] = w[j] * dy[idx[j]]``, ``dw[j] = <f[j], dy[idx[j]]>`` (fp32).

    Args:
        x: ``[B, T, D]`` or ``[N, D]`` residual stream.
        idx: ``[B, K]`` positions per sequence, or ``[K]`` flat rows; repeated rows accumulate (fp32, in
            index order, deterministic).
        f: ``[B, K, D]`` or ``[K, D]`` block output WITHOUT the residual; dtype of x.
        w: ``[B, K]`` or ``[K]`` router weights, gate already applied; float32 or dtype of x.
        check: range-check idx (ValueError); see ``route_gather``.
        distinct: the caller promises no row repeats: no sort or segments, no atomics; see ``route_gather``.

    Returns:
        ``y``, a new tensor with the shape and dtype of x (out-of-place: one pass, or a copy plus the routed
        rows when distinct; unselected rows are bit-identical to x).
    """
    _validate(x, idx, check, distinct)
    d = x.shape[-1]
    if f.shape != (*idx.shape, d):
        raise ValueError(f"f must be {(*idx.shape, d)}, got {tuple(f.shape)}")
    if w.shape != idx.shape:
        raise ValueError(f"w must be {tuple(idx.shape)}, got {tuple(w.shape)}")
    if f.dtype != x.dtype:
        raise TypeError(f"f dtype {f.dtype} != x dtype {x.dtype}")
    if w.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"w must be float32 or {x.dtype}, got {w.dtype}")
    if f.device != x.device or w.device != x.device:
        raise ValueError("x, idx, f, w must be on one device")
    if not use_triton("route_scatter_add", x, f, w):
        return naive.route_scatter_add_naive(x, idx, f, w, distinct=distinct)
    y = _RouteScatterAdd.apply(
        x.reshape(-1, d).contiguous(),
        idx.contiguous(),
        f.reshape(-1, d).contiguous(),
        w.reshape(-1).contiguous(),
        distinct,
    )
    return y.view(x.shape)
