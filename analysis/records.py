"""Typed, frozen fit records shared by the fitters, the store writer, the plots and the report.

Every record has ``to_dict()`` returning plain JSON-ready Python (tuples become lists, non-finite floats
become ``None``), so it can go to ``json.dumps`` or into the store's JSON columns unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CI = tuple[float, float]


def plain(v: Any) -> Any:
    """JSON-ready copy of ``v``: records via ``to_dict``, tuples as lists, numpy scalars as Python, NaN as None."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return v.to_dict()
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    return v


@dataclass(frozen=True)
class ParabolaFit:
    """Robust parabola of loss against ln N for one isoFLOP budget (Approach 2, one budget).

    The curve is ``loss = c2 * u**2 + c1 * u + c0`` with ``u = ln N``.

    Attributes:
        budget: training FLOPs C of the budget.
        coef: (c2, c1, c0) in ln N.
        n_opt: parameters at the vertex, exp(-c1 / (2 c2)).
        d_opt: tokens at the vertex (see ``isoflop.fit_isoflop`` for how it is derived).
        loss_opt: loss at the vertex (nats).
        curvature: c2; the vertex is a minimum only when it is positive.
        vertex_inside: curvature > 0 and ln n_opt within [min ln N, max ln N] of the sampled points.
        n_points: points the parabola was fitted to.
        n_min: smallest sampled N of the budget.
        n_max: largest sampled N of the budget.
    """

    budget: float
    coef: tuple[float, float, float]
    n_opt: float
    d_opt: float
    loss_opt: float
    curvature: float
    vertex_inside: bool
    n_points: int
    n_min: float
    n_max: float

    def predict(self, n: np.ndarray | float) -> np.ndarray:
        """Loss of the fitted parabola at parameter counts ``n`` (any shape)."""
        u = np.log(np.asarray(n, dtype=float))
        c2, c1, c0 = self.coef
        return (c2 * u + c1) * u + c0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class PowerLaw:
    """``y = k * C**exponent`` fitted by least squares in log-log.

    Attributes:
        k: coefficient (units of y).
        exponent: power of C.
        n_points: budgets used.
        ci_k: bootstrap (2.5, 97.5) percentile interval of k, or None without a bootstrap.
        ci_exponent: the same for the exponent.
    """

    k: float
    exponent: float
    n_points: int
    ci_k: CI | None = None
    ci_exponent: CI | None = None

    def __call__(self, c: np.ndarray | float) -> np.ndarray:
        return self.k * np.asarray(c, dtype=float) ** self.exponent

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class IsoflopFit:
    """Approach 2: one parabola per budget, then power laws of the vertices against C.

    Attributes:
        parabolas: one per budget with enough points, sorted by budget.
        n_opt: N*(C) power law over the budgets whose vertex is inside, or None (fewer than 2 such budgets).
        d_opt: D*(C) power law, or None.
        loss_opt: L*(C) power law, or None.
        budgets_used: budgets that entered the power laws.
        skipped: one-line notes on budgets left out and why.
        n_boot: bootstrap resamples asked for.
        n_boot_ok: resamples that gave power laws (the CIs are percentiles over these).
        seed: bootstrap seed.
    """

    parabolas: tuple[ParabolaFit, ...]
    n_opt: PowerLaw | None
    d_opt: PowerLaw | None
    loss_opt: PowerLaw | None
    budgets_used: tuple[float, ...]
    skipped: tuple[str, ...] = ()
    n_boot: int = 0
    n_boot_ok: int = 0
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class ParametricFit:
    """Approach 3: ``L(N, D) = E + A / N**alpha + B / D**beta``.

    Attributes:
        E: irreducible loss (nats).
        A: parameter-term coefficient.
        B: data-term coefficient.
        alpha: parameter exponent.
        beta: data exponent.
        objective: Huber(delta) of (log L_pred - log L), SUMMED over points, at the optimum.
        n_points: points fitted.
        delta: Huber delta.
        n_starts: L-BFGS-B starts actually run (after pruning the grid).
        n_grid: size of the start grid that was evaluated.
        ci: bootstrap (2.5, 97.5) percentile intervals keyed like the parameters ("E", ..., "a").
        n_boot: bootstrap resamples asked for.
        n_boot_ok: resamples whose refit converged.
        seed: bootstrap seed.
    """

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float
    n_points: int
    delta: float = 1e-3
    n_starts: int = 0
    n_grid: int = 0
    ci: dict[str, CI] = field(default_factory=dict)
    n_boot: int = 0
    n_boot_ok: int = 0
    seed: int = 0

    @property
    def a(self) -> float:
        """Predicted exponent of N*(C) ∝ C**a, a = beta / (alpha + beta)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Predicted exponent of D*(C) ∝ C**b, b = alpha / (alpha + beta)."""
        return self.alpha / (self.alpha + self.beta)

    def predict(self, n: np.ndarray | float, d: np.ndarray | float) -> np.ndarray:
        """Loss predicted at parameter counts ``n`` and token counts ``d`` (broadcast together)."""
        n = np.asarray(n, dtype=float)
        d = np.asarray(d, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["a"] = plain(self.a)
        out["b"] = plain(self.b)
        return out
