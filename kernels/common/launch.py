"""Launch parameters shared by the ops' kernels."""

from __future__ import annotations

import torch
import triton

__all__ = ["MAX_BLOCK_D", "block_d", "dot_precision"]

MAX_BLOCK_D = 1024


def block_d(d: int, block: int | None) -> int:
    """Columns per program of a row kernel: ``block`` if given, else ``min(next_pow2(d), MAX_BLOCK_D)``."""
    return block if block is not None else min(triton.next_power_of_2(d), MAX_BLOCK_D)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``: fp32 inputs get exact fp32 products (the reference path, tests),
    16-bit inputs use the tensor cores anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"
