"""Grouped expert SwiGLU MLP for MoE / MoDE layers (see ``op.py``)."""

from kernels.grouped_mlp.naive import grouped_swiglu_naive
from kernels.grouped_mlp.op import grouped_swiglu

__all__ = ["grouped_swiglu", "grouped_swiglu_naive"]
