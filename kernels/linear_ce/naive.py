"""Readable PyTorch reference for the fused linear + cross-entropy (the ground truth for the Triton op).

``loss = reduce_i(lse(x_i W^T) - (x_i W^T)[t_i])`` over the rows i whose target is not ``ignore_index``:
the mean (over those rows) or the sum. The logits are materialised in full (``[N, V]``), which is what the
op avoids.

Math runs in ``promote(x.dtype, float32)`` (fp32 for fp16/bf16/fp32, float64 for float64 so ``gradcheck`` sees
an exact reference). On fp32 inputs it is exactly ``F.cross_entropy(F.linear(x, W).float(), t)``, the models'
loss before the op. Autograd provides every gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy_naive"]


def linear_cross_entropy_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of the logits ``x @ weight.T`` against ``targets``.

    Args:
        x: ``[N, D]`` hidden states.
        weight: ``[V, D]`` output projection (the LM head).
        targets: ``[N]`` int64 classes in ``[0, V)``, or ``ignore_index`` (no loss, no gradient).
        ignore_index: the target value of rows left out.
        reduction: ``mean`` over the rows not ignored (NaN when there are none, as ``F.cross_entropy``) or
            ``sum``.

    Returns:
        The scalar loss, fp32 (float64 for float64 inputs).
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    logits = x.to(acc) @ weight.to(acc).T  # [N, V]
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)
