"""Test helpers shared by the kernel tests and tuners: NaN-poisoned allocations, and a kernel's output
compared against its naive reference. Imports torch only: tests/conftest.py imports it before it decides
TRITON_INTERPRET, which must precede every Triton import."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

# What library code allocates uninitialised memory with (torch.empty_strided: seq.like).
_ALLOCATORS = ((torch, "empty"), (torch, "empty_like"), (torch, "empty_strided"), (torch.Tensor, "new_empty"))


def _poisoned(alloc: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(alloc)
    def poisoned(*args, **kwargs) -> torch.Tensor:
        out = alloc(*args, **kwargs)
        if out.is_floating_point() or out.is_complex():
            with torch.no_grad():  # a leaf created with requires_grad=True
                out.fill_(float("nan"))
        return out

    return poisoned


@contextlib.contextmanager
def poison_empty() -> Iterator[None]:
    """Within the block, every uninitialised floating-point allocation (``torch.empty``, ``empty_like``,
    ``empty_strided``, ``Tensor.new_empty``) starts as NaN, so an output element a kernel leaves unwritten
    shows up as NaN instead of passing as whatever the memory held (FLA's conftest does the same)."""
    saved = [(owner, name, getattr(owner, name), name in vars(owner)) for owner, name in _ALLOCATORS]
    try:
        for owner, name, alloc, _ in saved:
            setattr(owner, name, _poisoned(alloc))
        yield
    finally:
        for owner, name, alloc, own in saved:
            if own:
                setattr(owner, name, alloc)
            else:  # inherited (Tensor.new_empty comes from the C base class): uncover it again
                delattr(owner, name)


def assert_close(name: str, ref: torch.Tensor, tri: torch.Tensor, ratio: float) -> None:
    """FLA-style relative RMS error check; NaN anywhere (an unwritten poisoned element) fails."""
    assert ref.shape == tri.shape and ref.dtype == tri.dtype, f"{name}: {ref.shape}/{ref.dtype} vs {tri.shape}"
    assert not tri.isnan().any(), f"{name}: NaN in output (unwritten element?)"
    if ref.numel() == 0:
        return
    diff = (ref.double() - tri.double()).pow(2).mean().sqrt()
    base = ref.double().pow(2).mean().sqrt().clamp_min(1e-12)
    assert diff / base <= ratio, f"{name}: rel err {float(diff / base):.3g} > {ratio}"
