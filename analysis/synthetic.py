"""Synthetic sweeps with a known loss surface, for tests and for trying the analysis without training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

TRUTH = {"E": 1.7, "A": 400.0, "B": 1800.0, "alpha": 0.34, "beta": 0.28}


def surface_loss(n: np.ndarray, d: np.ndarray, truth: dict[str, float] = TRUTH) -> np.ndarray:
    """``E + A / N^alpha + B / D^beta`` at (n, d), broadcast together."""
    n = np.asarray(n, dtype=float)
    d = np.asarray(d, dtype=float)
    return truth["E"] + truth["A"] / n ** truth["alpha"] + truth["B"] / d ** truth["beta"]


def fake_runs(
    sweep_id: str = "synthetic",
    arch: str = "dense",
    budgets: Sequence[float] = (1e15, 1e16, 1e17),
    sizes_per_budget: int = 5,
    *,
    noise: float = 0.002,
    seed: int = 0,
    flops_scale: float = 1.0,
    causal_offset: float | None = None,
) -> list[dict[str, Any]]:
    """Run rows for ``mixdepth.results.add_run`` on the surface ``TRUTH``.

    Sizes span a factor 100 around the surface's compute-optimal N of each budget (with D = C / (6 N)), so
    every isoFLOP vertex is inside the sampled range.

    Args:
        sweep_id: sweep of the rows.
        arch: arch of the rows.
        budgets: training FLOPs C.
        sizes_per_budget: runs per budget.
        noise: multiplicative log-normal noise on the loss.
        seed: noise seed.
        flops_scale: forward FLOPs per token = flops_scale * 2 N (MoD-like archs spend less per token).
        causal_offset: when set, ``val_loss_causal`` = val_loss + this (a routed arch).

    Returns:
        One dict per run with the store's run columns.
    """
    t = TRUTH
    al, be = t["alpha"], t["beta"]
    g = (al * t["A"] / (be * t["B"])) ** (1 / (al + be))
    rng = np.random.default_rng(seed)
    rows = []
    for c in budgets:
        centre = g * (c / 6) ** (be / (al + be))
        for i, n in enumerate(np.geomspace(centre / 10, centre * 10, sizes_per_budget)):
            d = c / (6 * n)
            loss = float(surface_loss(n, d) * np.exp(rng.normal(0, noise)))
            rows.append({
                "run_id": f"{sweep_id}-{arch}-{c:.3g}-{i}", "sweep_id": sweep_id, "arch": arch, "budget": float(c),
                "params_nonembed": int(n), "params_total": int(n * 1.2), "params_active": int(n),
                "flops_per_token": 2.0 * n * flops_scale, "flops_6nd": 6.0 * n * d, "train_flops": float(c),
                "tokens": int(d), "steps": 100, "seed": 0, "status": "ok", "val_loss": loss,
                "val_loss_causal": None if causal_offset is None else loss + causal_offset,
                "train_loss": loss + 0.01, "device": "cpu",
            })  # fmt: skip
    return rows
