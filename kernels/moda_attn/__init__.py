"""MoDA attention: causal sequence attention and same-position depth slots under one softmax."""

from .naive import moda_attn_naive
from .op import moda_attn

__all__ = ["moda_attn", "moda_attn_naive"]
