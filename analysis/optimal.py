"""Approach 3's compute-optimal frontier N*(C), D*(C), L*(C): the fitted surface minimised along the budget.

Tokens are not C / (6 N) in this lab: a run of budget C trains D = C / (3 * flops_per_token) tokens, and the FLOPs
per token hold attention, routers and the head besides 2 N. The constraint is therefore taken from the runs
themselves: ln(C / (N D)) = log_k + slope * ln N by least squares over the series' runs, that is
D(N, C) = C / (exp(log_k) N**g) with g = 1 + slope (g = 1 and exp(log_k) = 6 for D = C / (6 N)). Along it

    L(N) = E + A N**-alpha + B (exp(log_k) / C)**beta N**(g beta)

has its minimum where alpha A N**-alpha = g beta B (exp(log_k) / C)**beta N**(g beta), in closed form:

    ln N* = (ln(alpha A / (g beta B)) + beta (ln C - log_k)) / (alpha + g beta)
    L*    = E + A (N*)**-alpha (1 + alpha / (g beta))

so N* ∝ C**(beta / (alpha + g beta)) and D* ∝ C**(alpha / (alpha + g beta)): Chinchilla's a = beta / (alpha + beta)
and b = alpha / (alpha + beta) when g = 1.

Intervals: the exponents' by the delta method on the fit's covariance of (alpha, beta) (t, dof = P - 5); N*, D*,
L* per budget from ``draws`` parameter vectors of the fit's multivariate t, their percentiles (a draw with
alpha or beta <= 0 has no minimum: counted as missing, and more than (1 - level) / 2 of them missing leaves the
per-budget intervals not identified). The constraint's (log_k, slope) come from the FLOP formula, not from a
noisy measurement, and are taken as exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy import stats

from analysis.errors import AnalysisError
from analysis.isoflop import _as_1d
from analysis.records import LEVEL, ParametricFit, ParametricFrontier


def token_relation(n: np.ndarray, d: np.ndarray, c: np.ndarray) -> tuple[float, float]:
    """(log_k, slope) of ln(C / (N D)) = log_k + slope * ln N by least squares over runs.

    Args:
        n: [P] parameter counts.
        d: [P] tokens trained.
        c: [P] budget of each run.

    Raises:
        AnalysisError: fewer than 2 distinct N, or non-positive values.
    """
    n, d, c = _as_1d("n", n), _as_1d("d", d), _as_1d("c", c)
    if not (n.size == d.size == c.size):
        raise AnalysisError(f"n, d and c differ in length ({n.size}, {d.size}, {c.size})")
    if np.any(n <= 0) or np.any(d <= 0) or np.any(c <= 0):
        raise AnalysisError("n, d and c must be positive")
    u = np.log(n)
    if np.unique(u).size < 2:
        raise AnalysisError("the budget constraint needs runs of at least 2 distinct sizes")
    slope, log_k = np.polyfit(u, np.log(c / (n * d)), 1)
    return float(log_k), float(slope)


def _exponent_ci(fit: ParametricFit, g: float, level: float) -> tuple[tuple[float, float], tuple[float, float]]:
    al, be = fit.alpha, fit.beta
    s = al + g * be
    cov = np.array(fit.cov)[3:, 3:]  # (alpha, beta)
    t = float(stats.t.ppf(0.5 + level / 2, fit.n_points - 5))
    out = []
    for value, grad in ((be / s, np.array([-be, al]) / s**2), (al / s, np.array([g * be, -g * al]) / s**2)):
        half = t * float(np.sqrt(grad @ cov @ grad))
        out.append((float(value - half), float(value + half)))
    return out[0], out[1]


def compute_optimal(
    fit: ParametricFit,
    n: np.ndarray,
    d: np.ndarray,
    c: np.ndarray,
    *,
    level: float = LEVEL,
    draws: int = 4000,
    seed: int = 0,
) -> ParametricFrontier:
    """The compute-optimal frontier of an identified Approach 3 fit along its runs' budget constraint.

    Args:
        fit: the series' parametric fit.
        n: [P] the series' parameter counts (those the fit saw).
        d: [P] their tokens.
        c: [P] their budgets; the frontier is tabulated at the distinct values.
        level: coverage of the intervals.
        draws: parameter draws of the per-budget intervals.
        seed: seed of those draws.

    Returns:
        The frontier (module docstring).

    Raises:
        AnalysisError: the fit is not identified, the constraint has D growing with N (g <= 0), or bad values.
    """
    if not fit.identified:
        raise AnalysisError(f"the parametric fit is not identified: {fit.why}")
    log_k, slope = token_relation(n, d, c)
    g = 1.0 + slope
    if g <= 0:
        raise AnalysisError(f"the runs' tokens grow with N at fixed C (ln(C/(N D)) slope {slope:.3g}): no optimum")
    ci_n, ci_d = _exponent_ci(fit, g, level)
    budgets = np.unique(_as_1d("c", c))
    base = ParametricFrontier(
        fit=fit, log_k=log_k, slope=slope, n_exponent=fit.beta / (fit.alpha + g * fit.beta),
        d_exponent=fit.alpha / (fit.alpha + g * fit.beta), ci_n_exponent=ci_n, ci_d_exponent=ci_d,
        budgets=tuple(float(b) for b in budgets), n_opt=(), d_opt=(), loss_opt=(), level=level,
    )  # fmt: skip
    n_opt, d_opt, loss_opt = base.at(budgets)
    rng = np.random.default_rng(seed)
    dof = fit.n_points - 5
    scale = np.sqrt(dof / rng.chisquare(dof, size=draws))  # [S] multivariate t: one chi-square per draw
    theta = fit.theta + scale[:, None] * rng.multivariate_normal(np.zeros(5), np.array(fit.cov), size=draws)
    e, a, b, al, be = theta.T[:, :, None]  # each [S, 1]
    ok = (al > 0) & (be > 0)  # [S, 1]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        log_c = np.log(budgets)[None, :]  # [1, K]
        log_n = (np.log(al / (g * be)) + a - b + be * (log_c - log_k)) / (al + g * be)  # [S, K]
        sims = {
            "n": np.exp(log_n),
            "d": np.exp(log_c - log_k - g * log_n),
            "loss": np.exp(e) + np.exp(a - al * log_n) * (1.0 + al / (g * be)),
        }
    missing = float(np.mean(~ok))
    out: dict = {k: tuple(float(x) for x in v) for k, v in (("n_opt", n_opt), ("d_opt", d_opt), ("loss_opt", loss_opt))}
    if missing > (1 - level) / 2:
        why = f"per-budget intervals not identified: {missing:.0%} of parameter draws have no minimum"
        return dataclasses.replace(base, **out, why=why)
    q = 100 * np.array([(1 - level) / 2, (1 + level) / 2])
    for key, v in sims.items():
        v = np.where(ok & np.isfinite(v), v, np.nan)  # a draw without a minimum: missing
        lo, hi = np.nanpercentile(v, q, axis=0)  # [K] each
        out[f"{key}_ci"] = tuple((float(x), float(y)) for x, y in zip(lo, hi, strict=True))
    return dataclasses.replace(base, **out)
