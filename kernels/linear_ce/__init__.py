"""Fused linear + cross-entropy for the LM head: chunked logits, gradients in the forward (see ``op.py``)."""

from kernels.linear_ce.naive import linear_cross_entropy_naive
from kernels.linear_ce.op import linear_cross_entropy

__all__ = ["linear_cross_entropy", "linear_cross_entropy_naive"]
