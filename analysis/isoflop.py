"""Approach 2 (Hoffmann et al. 2022): isoFLOP parabolas, their vertices, and power laws of the vertices.

For each budget C the points (ln N, loss) get a robust parabola (``scipy.optimize.least_squares`` with a
soft-L1 loss); its vertex is (N*(C), L*(C)). Budgets whose vertex is a minimum lying inside the sampled
N range then give ``N*(C) = k C^a``, ``D*(C) = k C^b`` and ``L*(C) = k C^c`` by least squares in log-log.

D at the vertex: every point carries its own token count D (the caller passes it; it defaults to
C / (6 N) per point). D*(C) is the piecewise-linear interpolation in (ln N, ln D) of the budget's sampled
pairs at ln N*, extrapolated along the end segments. With D = C / (6 N) this is exactly C / (6 N*); with a
lab's exact FLOPs (D = C / (3 * flops_per_token(N))) it follows the real per-architecture token count
without needing the FLOP formula here.

Intervals: t intervals of each power law from the scatter of the vertices about it (``records.PowerLaw``).
One budget's vertex has its own intervals only when its runs leave residuals to estimate noise from
(``vertex_intervals``: at least ``MIN_VERTEX_POINTS`` runs, so dof = runs - 3 >= 2).
A percentile bootstrap over runs cannot be used: with three sizes per budget every resample that still has
three distinct sizes is the data itself, and the interval collapses onto the estimate. The vertices' scatter
holds their measurement noise and the parabola's misfit alike; with two budgets there is none to estimate and
the intervals are "not identified".
"""

from __future__ import annotations

import numpy as np
from scipy import stats
from scipy.optimize import least_squares
from threadpoolctl import threadpool_limits

from analysis.errors import AnalysisError
from analysis.records import CI, LEVEL, IsoflopFit, ParabolaFit, PowerLaw

MIN_VERTEX_POINTS = 5  # runs of one budget before its vertex gets intervals: 2 residual dof


def _as_1d(name: str, v: np.ndarray | list[float], size: int | None = None) -> np.ndarray:
    a = np.asarray(v, dtype=float).reshape(-1)
    if size is not None and a.size != size:
        raise AnalysisError(f"{name} has {a.size} values, expected {size}")
    if not np.all(np.isfinite(a)):
        raise AnalysisError(f"{name} has non-finite values")
    return a


def interp_loglog(u: np.ndarray, v: np.ndarray, u0: np.ndarray | float) -> np.ndarray:
    """ln-space value at u0 (any shape) of the piecewise-linear curve through (u, v), extrapolated on the end
    segments; repeated u (seed replicates of a size) are averaged to one point."""
    uu, inv = np.unique(u, return_inverse=True)
    vv = np.bincount(inv, weights=v) / np.bincount(inv)
    u0 = np.asarray(u0, dtype=float)
    if uu.size == 1:
        return np.full_like(u0, vv[0])
    out = np.interp(u0, uu, vv)
    out = np.where(u0 < uu[0], vv[0] + (u0 - uu[0]) * (vv[1] - vv[0]) / (uu[1] - uu[0]), out)
    return np.where(u0 > uu[-1], vv[-1] + (u0 - uu[-1]) * (vv[-1] - vv[-2]) / (uu[-1] - uu[-2]), out)


def vertex_intervals(
    X: np.ndarray, q: np.ndarray, loss: np.ndarray, mu: float, sd: float, level: float
) -> tuple[CI, CI, str]:
    """``level`` intervals of a parabola's vertex, (ln N*, L*) from its residual scatter, or the reason there are none.

    The coefficients' covariance is s^2 (X'X)^-1 with s^2 the residuals' mean square (dof = P - 3), so it holds
    the runs' noise and the parabola's misfit alike; ln N* = mu + sd * (-q1 / (2 q2)) and L* = q0 - q1^2 / (4 q2)
    get t intervals by the delta method. That linearisation holds only while the curvature is well away from 0:
    a curvature whose own interval reaches 0 leaves the vertex not identified. The interval is the parabola's
    vertex's: a lopsided loss curve shifts that vertex from the curve's minimum, and no residual shows it.

    Args:
        X: [P, 3] design (z^2, z, 1) in standardised z = (ln N - mu) / sd.
        q: [3] fitted (q2, q1, q0) in z.
        loss: [P] losses.
        mu: mean of ln N.
        sd: standard deviation of ln N.
        level: coverage.

    Returns:
        (ln N* interval, L* interval, why): the intervals are (nan, nan) when ``why`` is not empty.
    """
    none = (float("nan"), float("nan"))
    p, dof = X.shape[0], X.shape[0] - 3
    if p < MIN_VERTEX_POINTS:
        why = "3 runs: the parabola passes through them, no residual" if p == 3 else f"{p} runs: {dof} residual dof"
        return none, none, f"{why} (needs {MIN_VERTEX_POINTS} runs)"
    r = X @ q - loss
    s2 = float(r @ r) / dof
    cov = s2 * np.linalg.inv(X.T @ X)  # [3, 3]
    t = float(stats.t.ppf(0.5 + level / 2, dof))
    q2, q1, q0 = (float(v) for v in q)
    if not q2 - t * np.sqrt(cov[0, 0]) > 0:
        return none, none, "the curvature's interval reaches 0"
    g_u = sd * np.array([q1 / (2 * q2 * q2), -1 / (2 * q2), 0.0])  # d ln N* / d q
    g_l = np.array([q1 * q1 / (4 * q2 * q2), -q1 / (2 * q2), 1.0])  # d L* / d q
    u, l_star = mu - sd * q1 / (2 * q2), q0 - q1 * q1 / (4 * q2)
    hu, hl = t * float(np.sqrt(g_u @ cov @ g_u)), t * float(np.sqrt(g_l @ cov @ g_l))
    return (u - hu, u + hu), (l_star - hl, l_star + hl), ""


def fit_parabola(
    n: np.ndarray,
    loss: np.ndarray,
    budget: float,
    d: np.ndarray | None = None,
    *,
    f_scale: float | None = None,
    robust_loss: str = "soft_l1",
    level: float = LEVEL,
) -> ParabolaFit:
    """Fit ``loss = c2 (ln N)^2 + c1 ln N + c0`` robustly for one budget.

    Args:
        n: [P] parameter counts (> 0).
        loss: [P] losses (nats).
        budget: training FLOPs C of these points.
        d: [P] tokens per point; None means C / (6 N).
        f_scale: residual scale (nats) where the robust loss turns linear; None estimates it as
            1.4826 * MAD of the ordinary least-squares residuals, floored at 1e-4.
        robust_loss: a ``least_squares`` loss: "soft_l1", "huber", "cauchy", "arctan" or "linear".
        level: coverage of the vertex intervals (``vertex_intervals``; only for a vertex inside the sizes).

    Returns:
        The parabola and its vertex.

    Raises:
        AnalysisError: fewer than 3 distinct N, or bad values.
    """
    n = _as_1d("n", n)
    loss = _as_1d("loss", loss, n.size)
    if np.any(n <= 0):
        raise AnalysisError("parameter counts must be positive")
    d = budget / (6.0 * n) if d is None else _as_1d("d", d, n.size)
    if np.any(d <= 0):
        raise AnalysisError("token counts must be positive")
    u = np.log(n)
    if np.unique(u).size < 3:
        raise AnalysisError(f"budget {budget:.3g}: a parabola needs at least 3 distinct N, got {np.unique(u).size}")
    # Centre and scale ln N so the three coefficients are of similar size (conditioning).
    mu, s = float(u.mean()), float(u.std())
    z = (u - mu) / s
    X = np.stack([z * z, z, np.ones_like(z)], axis=1)  # [P, 3]
    q0, *_ = np.linalg.lstsq(X, loss, rcond=None)
    if f_scale is None:
        f_scale = max(1.4826 * float(np.median(np.abs(X @ q0 - loss))), 1e-4)
    if robust_loss == "linear" or n.size == 3:
        q = q0  # three points: the parabola interpolates them, robustness changes nothing
    else:
        res = least_squares(
            lambda p: X @ p - loss, q0, jac=lambda p: X, loss=robust_loss, f_scale=f_scale, method="trf"
        )
        q = res.x
    q2, q1, q0c = (float(x) for x in q)
    c2 = q2 / s**2
    c1 = q1 / s - 2.0 * q2 * mu / s**2
    c0 = q2 * mu**2 / s**2 - q1 * mu / s + q0c
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        z_star = -q1 / (2.0 * q2) if q2 != 0 else np.nan
        u_star = mu + s * z_star
        n_opt = float(np.exp(u_star))
        loss_opt = float(q0c - q1 * q1 / (4.0 * q2)) if q2 != 0 else np.nan
        d_opt = float(np.exp(interp_loglog(u, np.log(d), u_star))) if np.isfinite(u_star) else np.nan
    inside = bool(q2 > 0 and u.min() <= u_star <= u.max())
    ci: dict = {}
    why = "the vertex is not a minimum inside the sampled sizes"
    if inside:
        ci_u, ci_l, why = vertex_intervals(X, np.asarray(q, dtype=float), loss, mu, s, level)
        if not why:
            ends = sorted(float(np.exp(interp_loglog(u, np.log(d), v))) for v in ci_u)
            ci = {"ci_n_opt": (float(np.exp(ci_u[0])), float(np.exp(ci_u[1]))), "ci_d_opt": tuple(ends),
                  "ci_loss_opt": (float(ci_l[0]), float(ci_l[1]))}  # fmt: skip
    return ParabolaFit(
        budget=float(budget),
        coef=(c2, c1, c0),
        n_opt=n_opt,
        d_opt=d_opt,
        loss_opt=loss_opt,
        curvature=c2,
        vertex_inside=inside,
        n_points=int(n.size),
        n_min=float(n.min()),
        n_max=float(n.max()),
        level=level,
        **ci,
        why=why,
    )


def fit_power_law(c: np.ndarray, y: np.ndarray, level: float = LEVEL) -> PowerLaw:
    """Fit ``y = k * C**exponent`` by least squares in log10-log10, with ``level`` t intervals (``PowerLaw``).

    Args:
        c: [K] budgets (> 0), at least 2 distinct.
        y: [K] values (> 0).
        level: coverage of the intervals.

    Raises:
        AnalysisError: fewer than 2 distinct budgets or non-positive values.
    """
    c = _as_1d("c", c)
    y = _as_1d("y", y, c.size)
    if np.unique(c).size < 2:
        raise AnalysisError("a power law needs at least 2 distinct budgets")
    if np.any(c <= 0) or np.any(y <= 0):
        raise AnalysisError("power-law values must be positive")
    x, v = np.log10(c), np.log10(y)
    slope, intercept = np.polyfit(x, v, 1)
    k, e = float(10.0**intercept), float(slope)
    x_mean, sxx, dof = float(x.mean()), float(((x - x.mean()) ** 2).sum()), c.size - 2
    if dof < 1:
        return PowerLaw(k, e, c.size, level, x_mean=x_mean, sxx=sxx, why="2 budgets: no scatter to estimate noise")
    s = float(np.sqrt(((v - (intercept + slope * x)) ** 2).sum() / dof))
    if not s > 1e-12 * max(1.0, float(np.abs(v).max())):  # roundoff: a zero-width interval would be false
        return PowerLaw(k, e, c.size, level, x_mean=x_mean, sxx=sxx, why="the points lie exactly on the line")
    t = float(stats.t.ppf(0.5 + level / 2, dof))
    half_e, half_k = t * s / np.sqrt(sxx), t * s * np.sqrt(1 / c.size + x_mean**2 / sxx)
    ci_k = (float(k * 10.0**-half_k), float(k * 10.0**half_k))
    return PowerLaw(k, e, c.size, level, ci_k, (float(e - half_e), float(e + half_e)), s, x_mean, sxx)


def _vertex_laws(fits: list[ParabolaFit], level: float) -> tuple[PowerLaw, PowerLaw, PowerLaw] | None:
    """N*(C), D*(C), L*(C) over the inside vertices, or None (fewer than 2 inside budgets)."""
    inside = [f for f in fits if f.vertex_inside and f.loss_opt > 0]
    if len({f.budget for f in inside}) < 2:
        return None
    c = np.array([f.budget for f in inside])
    n, d, loss = (np.array(v) for v in zip(*((f.n_opt, f.d_opt, f.loss_opt) for f in inside), strict=True))
    return fit_power_law(c, n, level), fit_power_law(c, d, level), fit_power_law(c, loss, level)


@threadpool_limits.wrap(limits=1, user_api="blas")  # tiny BLAS calls: a busy thread pool is 50x slower
def fit_isoflop(
    n: np.ndarray,
    c: np.ndarray,
    loss: np.ndarray,
    d: np.ndarray | None = None,
    *,
    min_points: int = 3,
    f_scale: float | None = None,
    level: float = LEVEL,
) -> IsoflopFit:
    """Approach 2 over points grouped by budget (the distinct values of ``c``).

    Args:
        n: [P] parameter counts.
        c: [P] budget of each point; points with equal ``c`` form one isoFLOP curve (bin continuous
            budgets first, e.g. with ``analysis.tabular.bin_budgets``).
        loss: [P] losses (nats).
        d: [P] tokens per point; None means C / (6 N). D*(C) is interpolated from these (module docstring).
        min_points: fewest points a budget needs for its parabola (at least 3).
        f_scale: robust residual scale passed to ``fit_parabola`` (None estimates it per budget).
        level: coverage of the power laws' intervals.

    Returns:
        Parabolas for every budget with enough points, power laws over the inside vertices (None when
        fewer than 2 budgets have their vertex inside) with their intervals, and notes on what was skipped.

    Raises:
        AnalysisError: bad values or no budget with enough points.
    """
    n = _as_1d("n", n)
    c = _as_1d("c", c, n.size)
    loss = _as_1d("loss", loss, n.size)
    d = c / (6.0 * n) if d is None else _as_1d("d", d, n.size)
    min_points = max(3, int(min_points))
    skipped: list[str] = []
    fits: list[ParabolaFit] = []
    for b in np.unique(c):
        idx = np.flatnonzero(c == b)
        n_distinct = np.unique(n[idx]).size
        if idx.size < min_points or n_distinct < 3:
            skipped.append(f"budget {b:.3g}: {idx.size} points ({n_distinct} distinct N), need {min_points}")
            continue
        fits.append(fit_parabola(n[idx], loss[idx], b, d[idx], f_scale=f_scale, level=level))
    if not fits:
        raise AnalysisError(f"no budget has at least {min_points} points with 3 distinct N")
    for f in fits:
        if not f.vertex_inside:
            why = "curvature <= 0" if f.curvature <= 0 else "vertex outside the sampled N range"
            skipped.append(f"budget {f.budget:.3g}: {why}, left out of the power laws")
    laws = _vertex_laws(fits, level)
    if laws is None:
        skipped.append("fewer than 2 budgets with an inside vertex: no power laws")
    elif laws[0].why:
        skipped.append(f"power-law intervals not identified: {laws[0].why}")
    n_law, d_law, l_law = laws or (None, None, None)
    return IsoflopFit(
        parabolas=tuple(fits),
        n_opt=n_law,
        d_opt=d_law,
        loss_opt=l_law,
        budgets_used=tuple(f.budget for f in fits if f.vertex_inside and f.loss_opt > 0),
        skipped=tuple(skipped),
    )
