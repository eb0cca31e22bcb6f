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
LEVEL = 0.9  # coverage of every interval the analysis states


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
        level: coverage of the vertex intervals.
        ci_n_opt: ``level`` interval of n_opt (``isoflop.vertex_intervals``), or None when not identified.
        ci_d_opt: the same for d_opt.
        ci_loss_opt: the same for loss_opt.
        why: why the vertex has no intervals ("" when it has).
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
    level: float = LEVEL
    ci_n_opt: CI | None = None
    ci_d_opt: CI | None = None
    ci_loss_opt: CI | None = None
    why: str = ""

    def predict(self, n: np.ndarray | float) -> np.ndarray:
        """Loss of the fitted parabola at parameter counts ``n`` (any shape)."""
        u = np.log(np.asarray(n, dtype=float))
        c2, c1, c0 = self.coef
        return (c2 * u + c1) * u + c0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class PowerLaw:
    """``y = k * C**exponent`` fitted by least squares in log10-log10, with t intervals from its residual scatter.

    The scatter of the points about the line is the noise estimate: it holds the measurement noise of each point
    and the misfit of the law alike, and it is what the data say; with two points there is none (``why``).

    Attributes:
        k: coefficient (units of y).
        exponent: power of C.
        n_points: budgets used.
        level: the intervals' coverage.
        ci_k: ``level`` interval of k, or None when not identified.
        ci_exponent: the same for the exponent.
        s: residual standard deviation of log10 y (dof = n_points - 2), or None.
        x_mean: mean log10 C of the points.
        sxx: sum of squared deviations of log10 C from ``x_mean``.
        why: why there are no intervals ("" when there are).
    """

    k: float
    exponent: float
    n_points: int
    level: float = LEVEL
    ci_k: CI | None = None
    ci_exponent: CI | None = None
    s: float | None = None
    x_mean: float = 0.0
    sxx: float = 0.0
    why: str = ""

    def __call__(self, c: np.ndarray | float) -> np.ndarray:
        return self.k * np.asarray(c, dtype=float) ** self.exponent

    def interval(self, c: np.ndarray | float, *, predict: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """``level`` band of the law at budgets ``c`` (``predict``: of one new point measured there, such as a
        held-out budget's vertex), or None when not identified."""
        if self.s is None:
            return None
        from scipy import stats

        x = np.log10(np.asarray(c, dtype=float))
        se = self.s * np.sqrt(float(predict) + 1.0 / self.n_points + (x - self.x_mean) ** 2 / self.sxx)
        t = stats.t.ppf(0.5 + self.level / 2, self.n_points - 2)
        mid = np.log10(self(c))
        return 10.0 ** (mid - t * se), 10.0 ** (mid + t * se)

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
    """

    parabolas: tuple[ParabolaFit, ...]
    n_opt: PowerLaw | None
    d_opt: PowerLaw | None
    loss_opt: PowerLaw | None
    budgets_used: tuple[float, ...]
    skipped: tuple[str, ...] = ()

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
        identified: the data pin the five parameters down; when False, ``why`` says what failed and no number
            of the fit is a result.
        why: why the fit is not identified ("" when it is).
        level: the intervals' coverage.
        ci: ``level`` Wald t intervals keyed like the parameters ("E", ..., "a"); empty when not identified.
        cov: [5, 5] covariance of theta = (ln E, ln A, ln B, alpha, beta); None when not identified.
        s: residual standard deviation of ln L (dof = n_points - 5), or None.
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
    identified: bool = False
    why: str = ""
    level: float = LEVEL
    ci: dict[str, CI] = field(default_factory=dict)
    cov: tuple[tuple[float, ...], ...] | None = None
    s: float | None = None

    @property
    def a(self) -> float:
        """Predicted exponent of N*(C) ∝ C**a, a = beta / (alpha + beta)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Predicted exponent of D*(C) ∝ C**b, b = alpha / (alpha + beta)."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def theta(self) -> np.ndarray:
        """[5] (ln E, ln A, ln B, alpha, beta): the fitted coordinates ``cov`` refers to."""
        return np.array([np.log(self.E), np.log(self.A), np.log(self.B), self.alpha, self.beta])

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


@dataclass(frozen=True)
class Forecast:
    """A fitted law's prediction of a budget it did not see, beside what was measured there.

    The measured optimum is the held-out budget's own isoFLOP parabola vertex (``obs`` is None when that vertex
    is not a minimum inside its sizes); the intervals are ``level`` prediction intervals of that measured value,
    so they hold the measurement's noise as well as the law's uncertainty. None: not identified (``why``).

    Attributes:
        budget: the held-out budget C.
        method: "isoflop" (Approach 2's power laws) or "parametric" (Approach 3's surface).
        fit_budgets: budgets the law was fitted on.
        level: the intervals' coverage.
        loss_pred, loss_lo, loss_hi, loss_obs: optimum loss L* (nats).
        n_pred, n_lo, n_hi, n_obs: optimal size N*.
        d_pred, d_lo, d_hi, d_obs: optimal tokens D*.
        why: why the prediction or its intervals are missing ("" when they are there).
    """

    budget: float
    method: str
    fit_budgets: tuple[float, ...]
    level: float = LEVEL
    loss_pred: float | None = None
    loss_lo: float | None = None
    loss_hi: float | None = None
    loss_obs: float | None = None
    n_pred: float | None = None
    n_lo: float | None = None
    n_hi: float | None = None
    n_obs: float | None = None
    d_pred: float | None = None
    d_lo: float | None = None
    d_hi: float | None = None
    d_obs: float | None = None
    why: str = ""

    @property
    def inside(self) -> bool | None:
        """The measured L* lies within the loss interval (None: nothing to compare)."""
        if None in (self.loss_obs, self.loss_lo, self.loss_hi):
            return None
        return bool(self.loss_lo <= self.loss_obs <= self.loss_hi)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["inside"] = self.inside
        return out


@dataclass(frozen=True)
class ParametricFrontier:
    """Approach 3's compute-optimal frontier: its surface minimised over N along the runs' own budget constraint
    (``analysis.optimal`` says how).

    Attributes:
        fit: the identified surface (left out of ``to_dict``: it is the series' parametric fit).
        log_k: intercept of ln(C / (N D)) = log_k + slope * ln N over the series' runs.
        slope: its slope (0 when tokens are C / (k N) exactly, as with D = C / (6 N)).
        n_exponent: N*(C) ∝ C**n_exponent, beta / (alpha + (1 + slope) beta).
        d_exponent: D*(C) ∝ C**d_exponent, alpha / (alpha + (1 + slope) beta).
        ci_n_exponent: ``level`` interval of n_exponent (delta method on the fit's covariance).
        ci_d_exponent: the same for d_exponent.
        budgets: the budgets tabulated below (the series' own), ascending.
        n_opt, d_opt, loss_opt: N*, D*, L* of the surface at each budget.
        n_ci, d_ci, loss_ci: their ``level`` intervals per budget (parameter draws), empty when not identified.
        level: the intervals' coverage.
        why: why the per-budget intervals are missing ("" when they are there).
    """

    fit: ParametricFit
    log_k: float
    slope: float
    n_exponent: float
    d_exponent: float
    ci_n_exponent: CI
    ci_d_exponent: CI
    budgets: tuple[float, ...]
    n_opt: tuple[float, ...]
    d_opt: tuple[float, ...]
    loss_opt: tuple[float, ...]
    n_ci: tuple[CI, ...] = ()
    d_ci: tuple[CI, ...] = ()
    loss_ci: tuple[CI, ...] = ()
    level: float = LEVEL
    why: str = ""

    def at(self, c: np.ndarray | float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(N*, D*, L*) of the surface at budgets ``c`` (any shape): the closed form of ``analysis.optimal``."""
        f, g = self.fit, 1.0 + self.slope
        log_c = np.log(np.asarray(c, dtype=float))
        log_n = (np.log(f.alpha * f.A / (g * f.beta * f.B)) + f.beta * (log_c - self.log_k)) / (f.alpha + g * f.beta)
        n = np.exp(log_n)
        loss = f.E + f.A * n**-f.alpha * (1.0 + f.alpha / (g * f.beta))
        return n, np.exp(log_c - self.log_k - g * log_n), loss

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "fit"}
