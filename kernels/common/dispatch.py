"""The one rule by which every op runs its Triton kernels or its naive reference: ``use_triton``."""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["HAS_TRITON", "INTERPRET", "use_triton"]

HAS_TRITON: bool = importlib.util.find_spec("triton") is not None
# Triton picks interpreter vs compiler when a @triton.jit decorator runs, i.e. when an op imports its kernels,
# which it does together with this module: both see the same environment.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "") == "1"


def use_triton(op: str, *tensors: torch.Tensor | None, supported: bool = True) -> bool:
    """Whether ``op`` runs its Triton kernels on these inputs (True) or its naive reference (False).

    Triton runs where it can: on CUDA tensors, and on any tensor under the interpreter (``TRITON_INTERPRET=1``
    when the kernels were imported, except in code torch.compile traces). A plain CPU (or no Triton installed) gets
    the reference, and so do inputs the kernels do not support (``supported=False``: the op's own shape rule, e.g. a
    head dim).

    Args:
        op: the public op's name, for the error message.
        tensors: the op's inputs, the first one deciding the device; None entries (optional inputs) are skipped.
        supported: whether the kernels support these shapes.

    Raises:
        TypeError: a bfloat16 input under the interpreter, whose bf16 dots are wrong (Triton 3.9: rel-L2 ~1e9).
    """
    if not (HAS_TRITON and supported and (tensors[0].is_cuda or INTERPRET)):
        return False
    if not tensors[0].is_cuda and torch.compiler.is_compiling():  # the interpreter is numpy code dynamo cannot trace
        return False
    if INTERPRET and any(t is not None and t.dtype == torch.bfloat16 for t in tensors):
        raise TypeError(
            f"{op}: torch.bfloat16 inputs are not supported under the Triton interpreter (TRITON_INTERPRET=1 "
            "computes bf16 dots wrongly); use float32 or float16, or a GPU"
        )
    return True
