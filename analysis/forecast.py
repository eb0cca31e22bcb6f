"""Forecast check: fit on every budget but the largest K, predict the held-out budgets' optimum, compare.

What is measured at a held-out budget is its own isoFLOP parabola vertex (L*, N*, D*), as Approach 2 measures
every budget. Each method's intervals are ``level`` prediction intervals of that measured value: they hold the
fitted law's uncertainty and the noise of the measurement.

- Approach 2 ("isoflop"): the power laws N*(C) and D*(C) of the fitted budgets' vertices, with t prediction
  intervals from their scatter (``PowerLaw.interval(predict=True)``). L* is extrapolated by a law that may
  bend, ln L* quadratic in ln C (``bent_law``), not by the straight power law: losses level off toward the
  irreducible loss, and a straight line in log-log undershoots beyond the fitted budgets by more than its
  scatter shows (on synthetic sweeps its 90% intervals held the measured L* in 70% of replicates). Three
  coefficients: the interval needs four fitted budgets.
- Approach 3 ("parametric"): the surface fitted to the other budgets' runs, evaluated at the held-out budget's
  sizes and tokens; the prediction is the vertex of the parabola through those predicted losses, what that
  budget's runs would measure if the law held. Intervals: ``draws`` parameter vectors from the fit's
  multivariate t (its covariance, dof = P - 5), each with the runs' noise added (the fit's residual scale,
  log-normal), each measured by the same parabola; the percentiles of those vertices, among the draws whose
  parabola has a minimum (the comparison is made only where a vertex was measured; fewer than half such
  draws: not identified).
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from analysis.errors import AnalysisError
from analysis.isoflop import _as_1d, fit_isoflop, fit_parabola, interp_loglog
from analysis.parametric import fit_parametric
from analysis.records import LEVEL, Forecast, ParabolaFit, ParametricFit


def _vertices(u: np.ndarray, log_d: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least-squares parabola vertices of many loss vectors over one budget's sizes.

    Args:
        u: [P] ln N of the budget's runs.
        log_d: [P] ln D of those runs.
        loss: [S, P] losses.

    Returns:
        [S] L*, N*, D* (NaN where the parabola has no minimum, inf where N* overflows); D* interpolated in
        (ln N, ln D) like ``isoflop.fit_parabola``.
    """
    mu, sd = u.mean(), u.std()
    z = (u - mu) / sd
    X = np.stack([z * z, z, np.ones_like(z)], axis=1)  # [P, 3]
    q = np.linalg.lstsq(X, loss.T, rcond=None)[0]  # [3, S]
    with np.errstate(divide="ignore", invalid="ignore"):
        q2 = np.where(q[0] > 0, q[0], np.nan)
        z_star = -q[1] / (2 * q2)
        l_star = q[2] - q[1] ** 2 / (4 * q2)
    u_star = mu + sd * z_star
    ld = interp_loglog(u, log_d, u_star)
    with np.errstate(over="ignore"):  # a vertex far outside overflows: left out like one without a minimum
        return l_star, np.exp(u_star), np.exp(ld)


def bent_law(c: np.ndarray, y: np.ndarray, c_new: float, level: float) -> tuple[float, float, float] | None:
    """Fit ``ln y = q2 (ln C)^2 + q1 ln C + q0`` by least squares; (prediction, lo, hi) of one new measurement at
    ``c_new`` (t prediction interval, dof = K - 3), or None with fewer than 4 budgets."""
    if c.size < 4:
        return None
    mid_x = np.log(c).mean()  # centred: (ln C)^2 of raw FLOPs would make X'X ill-conditioned
    x, v = np.log(c) - mid_x, np.log(y)
    X = np.stack([x * x, x, np.ones_like(x)], axis=1)  # [K, 3]
    q = np.linalg.lstsq(X, v, rcond=None)[0]
    dof = c.size - 3
    s2 = float(((v - X @ q) ** 2).sum()) / dof
    x0 = np.log(c_new) - mid_x
    g = np.array([x0 * x0, x0, 1.0])
    se = np.sqrt(s2 * (1.0 + g @ np.linalg.solve(X.T @ X, g)))
    t = float(stats.t.ppf(0.5 + level / 2, dof))
    mid = float(g @ q)
    return float(np.exp(mid)), float(np.exp(mid - t * se)), float(np.exp(mid + t * se))


def _observed(pf: ParabolaFit) -> dict[str, float | None]:
    if not pf.vertex_inside:
        return {"loss_obs": None, "n_obs": None, "d_obs": None}
    return {"loss_obs": pf.loss_opt, "n_obs": pf.n_opt, "d_obs": pf.d_opt}


def _isoflop(n, c, loss, d, budget: float, fit_budgets: tuple[float, ...], obs: dict, level: float) -> Forecast:
    base = {"budget": budget, "method": "isoflop", "fit_budgets": fit_budgets, "level": level, **obs}
    try:
        iso = fit_isoflop(n, c, loss, d, level=level)
    except AnalysisError as e:
        return Forecast(**base, why=f"no isoFLOP fit: {e}")
    if iso.n_opt is None:
        return Forecast(**base, why="fewer than 2 fitted budgets with an inside vertex")
    out, why = {}, []
    for key, law in (("n", iso.n_opt), ("d", iso.d_opt)):
        out[f"{key}_pred"] = float(law(budget))
        band = law.interval(budget, predict=True)
        if band is not None:
            out[f"{key}_lo"], out[f"{key}_hi"] = float(band[0]), float(band[1])
    if iso.n_opt.why:
        why.append(f"N*, D* intervals not identified: {iso.n_opt.why}")
    inside = [p for p in iso.parabolas if p.budget in iso.budgets_used]
    bent = bent_law(np.array([p.budget for p in inside]), np.array([p.loss_opt for p in inside]), budget, level)
    if bent is None:
        why.append(f"L* not identified: its bent law needs 4 budgets with an inside vertex, got {len(inside)}")
    else:
        out["loss_pred"], out["loss_lo"], out["loss_hi"] = bent
    return Forecast(**base, **out, why="; ".join(why))


def _parametric(
    fit: ParametricFit, n_h, d_h, budget: float, fit_budgets, obs: dict, level: float, draws: int, seed: int
) -> Forecast:
    base = {"budget": budget, "method": "parametric", "fit_budgets": fit_budgets, "level": level, **obs}
    if not fit.identified:
        return Forecast(**base, why=f"the parametric fit is not identified: {fit.why}")
    u, log_d = np.log(n_h), np.log(d_h)
    rng = np.random.default_rng(seed)
    dof = fit.n_points - 5
    scale = np.sqrt(dof / rng.chisquare(dof, size=draws))  # [S] multivariate t: one chi-square per draw
    theta = fit.theta + scale[:, None] * rng.multivariate_normal(np.zeros(5), np.array(fit.cov), size=draws)
    e, a, b, al, be = theta.T[:, :, None]  # each [S, 1]
    with np.errstate(over="ignore", invalid="ignore"):
        surface = np.exp(e) + np.exp(a - al * u) + np.exp(b - be * log_d)  # [S, P]
        noisy = surface * np.exp(scale[:, None] * fit.s * rng.standard_normal(surface.shape))
    point = _vertices(u, log_d, fit.predict(n_h, d_h)[None, :])
    sims = _vertices(u, log_d, noisy)
    ok = np.isfinite(sims).all(axis=0)  # draws whose parabola has a minimum: a vertex was measured, as here
    out = {
        f"{k}_pred": float(v[0]) if np.isfinite(v[0]) else None for k, v in zip(("loss", "n", "d"), point, strict=True)
    }
    if out["loss_pred"] is None:
        return Forecast(**base, why="the law's losses at this budget's sizes have no minimum")
    if ok.mean() < 0.5:
        return Forecast(**base, **out, why=f"intervals not identified: {1 - ok.mean():.0%} of draws have no minimum")
    q = 100 * np.array([(1 - level) / 2, (1 + level) / 2])
    for k, v in zip(("loss", "n", "d"), sims, strict=True):
        lo, hi = np.percentile(v[ok], q)
        out[f"{k}_lo"], out[f"{k}_hi"] = float(lo), float(hi)
    return Forecast(**base, **out)


def forecast(
    n: np.ndarray,
    c: np.ndarray,
    loss: np.ndarray,
    d: np.ndarray | None = None,
    *,
    holdout: int = 1,
    level: float = LEVEL,
    draws: int = 4000,
    seed: int = 0,
) -> tuple[Forecast, ...]:
    """Predict the largest ``holdout`` budgets from the others, by both approaches (module docstring).

    Args:
        n: [P] parameter counts.
        c: [P] budget of each point (binned: equal values form one budget).
        loss: [P] losses (nats).
        d: [P] tokens; None means C / (6 N).
        holdout: how many of the largest budgets to hold out (>= 1).
        level: coverage of the prediction intervals.
        draws: parameter draws of the parametric intervals.
        seed: seed of those draws.

    Returns:
        Per held-out budget (ascending), the isoflop forecast then the parametric one. The held-out budgets are
        the largest ``holdout`` that have 3 distinct sizes (a vertex to measure); the laws are fitted on the
        points of smaller budgets only.

    Raises:
        AnalysisError: bad values, ``holdout`` < 1, or fewer than ``holdout`` + 2 budgets with 3 distinct sizes.
    """
    n = _as_1d("n", n)
    c = _as_1d("c", c, n.size)
    loss = _as_1d("loss", loss, n.size)
    d = c / (6.0 * n) if d is None else _as_1d("d", d, n.size)
    if holdout < 1:
        raise AnalysisError(f"holdout must be at least 1, got {holdout}")
    budgets = np.array([b for b in np.unique(c) if np.unique(n[c == b]).size >= 3])  # those with a vertex
    if budgets.size < holdout + 2:
        raise AnalysisError(
            f"a forecast of {holdout} budget(s) needs {holdout + 2} budgets with 3 distinct sizes, got {budgets.size}"
        )
    held = budgets[-holdout:]
    train = c < held[0]
    fit_budgets = tuple(float(b) for b in np.unique(c[train]))
    try:
        par = fit_parametric(n[train], d[train], loss[train], level=level)
    except AnalysisError as e:
        par = None
        why_par = f"no parametric fit: {e}"
    out = []
    for k, b in enumerate(held):
        i = c == b
        obs = _observed(fit_parabola(n[i], loss[i], float(b), d[i]))
        out.append(_isoflop(n[train], c[train], loss[train], d[train], float(b), fit_budgets, obs, level))
        if par is None:
            base = {"budget": float(b), "method": "parametric", "fit_budgets": fit_budgets, "level": level}
            out.append(Forecast(**base, **obs, why=why_par))
        else:
            out.append(_parametric(par, n[i], d[i], float(b), fit_budgets, obs, level, draws, seed + k))
    return tuple(out)
