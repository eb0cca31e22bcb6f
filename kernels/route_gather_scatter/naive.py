"""Readable PyTorch reference for routed gather / scatter-add (the ground truth for the Triton op).

Both functions accept the batched form (``x [B, T, D]``, ``idx [B, K]``, per-sequence positions) or the
flat form (``x [N, D]``, ``idx [K]``, row indices into ``x``, repeats allowed). The batched form is reduced
to the flat one by adding the per-sequence offset ``b * T``; forgetting that offset is the classic MoD bug
(every sequence would read and write sequence 0).

``distinct=True`` (the op's fast-path contract: no row selected twice) changes no result here; the reference
verifies it (ValueError on a repeat), so a test or CPU run catches a caller that breaks it.

Accumulation is done in ``promote(x.dtype, float32)``: fp32 for fp16/bf16/fp32, float64 for float64 (so
``gradcheck`` sees an exact float64 reference). Autograd provides every gradient.
"""

from __future__ import annotations

import torch

__all__ = ["check_distinct", "flatten_index", "route_gather_naive", "route_scatter_add_naive"]


def flatten_index(idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Turns per-sequence positions into flat row indices of ``x.reshape(B * T, D)``.

    Args:
        idx: ``[B, K]`` integer positions in ``[0, seq_len)``.
        seq_len: T, the length of each sequence.

    Returns:
        ``[B * K]`` int64 flat indices ``idx[b, j] + b * T``.
    """
    offsets = torch.arange(idx.shape[0], device=idx.device, dtype=torch.int64)[:, None] * seq_len  # [B, 1]
    return (idx.to(torch.int64) + offsets).reshape(-1)


def _check_range(idx: torch.Tensor, n: int) -> None:
    if torch.compiler.is_compiling():  # a host sync would break the graph; eager calls check
        return
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"route index out of range [0, {n}): min {int(idx.min())}, max {int(idx.max())}")


def check_distinct(idx: torch.Tensor) -> None:
    """Raises ValueError when a row of ``idx`` (``[B, K]`` per sequence, or ``[K]``) repeats a value (host sync;
    eager calls only, as ``_check_range``)."""
    if torch.compiler.is_compiling():
        return
    s = idx.sort(dim=-1).values
    if s.shape[-1] > 1 and bool((s[..., 1:] == s[..., :-1]).any()):
        raise ValueError("route indices repeat but distinct=True was passed")


def _flat(x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(x2d [N, D], flat_idx [K_total])`` after a range check on the un-flattened indices."""
    if x.dim() == 3:
        if idx.dim() != 2 or idx.shape[0] != x.shape[0]:
            raise ValueError(f"batched x {tuple(x.shape)} needs idx [B, K], got {tuple(idx.shape)}")
        _check_range(idx, x.shape[1])
        return x.reshape(-1, x.shape[-1]), flatten_index(idx, x.shape[1])
    if x.dim() != 2 or idx.dim() != 1:
        raise ValueError(f"expected x [B, T, D] + idx [B, K] or x [N, D] + idx [K], got {x.shape}, {idx.shape}")
    _check_range(idx, x.shape[0])
    return x, idx.to(torch.int64)


def route_gather_naive(x: torch.Tensor, idx: torch.Tensor, *, distinct: bool = False) -> torch.Tensor:
    """Selected rows of ``x``.

    Args:
        x: ``[B, T, D]`` or ``[N, D]``.
        idx: ``[B, K]`` positions per sequence, or ``[K]`` flat rows (repeats allowed).
        distinct: promise no repeats (verified, see the module docstring); same result.

    Returns:
        ``[B, K, D]`` or ``[K, D]``: ``xs[b, j] = x[b, idx[b, j]]``. Backward sums gradients into the
        selected rows (repeats add up); unselected rows get 0.
    """
    x2, flat = _flat(x, idx)
    if distinct:
        check_distinct(idx)
    xs = x2.index_select(0, flat)  # [B*K, D]
    return xs.reshape(*idx.shape, x.shape[-1])


def route_scatter_add_naive(
    x: torch.Tensor, idx: torch.Tensor, f: torch.Tensor, w: torch.Tensor, *, distinct: bool = False
) -> torch.Tensor:
    """The routed residual update ``y = x``, then ``y[idx[j]] += w[j] * f[j]``.

    Args:
        x: ``[B, T, D]`` or ``[N, D]`` residual stream.
        idx: ``[B, K]`` positions per sequence, or ``[K]`` flat rows (repeats accumulate).
        f: ``[B, K, D]`` or ``[K, D]`` block output without the residual.
        w: ``[B, K]`` or ``[K]`` router weights (gate already applied).
        distinct: promise no repeats (verified, see the module docstring); same result.

    Returns:
        ``y`` with the shape and dtype of ``x``; the sum is formed in fp32 (float64 for float64) and rounded
        once.
    """
    x2, flat = _flat(x, idx)
    if distinct:
        check_distinct(idx)
    acc = torch.promote_types(x.dtype, torch.float32)
    upd = w.reshape(-1, 1).to(acc) * f.reshape(-1, x.shape[-1]).to(acc)  # [B*K, D]
    y = x2.to(acc).index_add(0, flat, upd)  # [N, D]
    return y.to(x.dtype).reshape(x.shape)
