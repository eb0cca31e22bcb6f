"""Test helper shared by the kernel tests: compare a kernel's output against its naive reference."""

from __future__ import annotations

import torch


def assert_close(name: str, ref: torch.Tensor, tri: torch.Tensor, ratio: float) -> None:
    """FLA-style relative RMS error check; NaN anywhere (an unwritten poisoned element) fails."""
    assert ref.shape == tri.shape and ref.dtype == tri.dtype, f"{name}: {ref.shape}/{ref.dtype} vs {tri.shape}"
    assert not tri.isnan().any(), f"{name}: NaN in output (unwritten element?)"
    if ref.numel() == 0:
        return
    diff = (ref.double() - tri.double()).pow(2).mean().sqrt()
    base = ref.double().pow(2).mean().sqrt().clamp_min(1e-12)
    assert diff / base <= ratio, f"{name}: rel err {float(diff / base):.3g} > {ratio}"
