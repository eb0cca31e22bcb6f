"""Approach 2 (Hoffmann et al. 2022): isoFLOP parabolas, their vertices, and power laws of the vertices.

For each budget C the points (ln N, loss) get a robust parabola (``scipy.optimize.least_squares`` with a
soft-L1 loss); its vertex is (N*(C), L*(C)). Budgets whose vertex is a minimum lying inside the sampled
N range then give ``N*(C) = k C^a``, ``D*(C) = k C^b`` and ``L*(C) = k C^c`` by least squares in log-log.

D at the vertex: every point carries its own token count D (the caller passes it; it defaults to
C / (6 N) per point). D*(C) is the piecewise-linear interpolation in (ln N, ln D) of the budget's sampled
pairs at ln N*, extrapolated along the end segments. With D = C / (6 N) this is exactly C / (6 N*); with a
lab's exact FLOPs (D = C / (3 * flops_per_token(N))) it follows the real per-architecture token count
without needing the FLOP formula here.

Confidence intervals: a bootstrap that resamples the points of each budget with replacement, refits every
parabola and every power law, and takes the 2.5 / 97.5 percentiles. A resampled budget with fewer than 3
distinct N, or whose vertex falls outside, drops out of that resample; a resample with fewer than 2 inside
budgets gives no power law and is not counted in ``n_boot_ok``.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import least_squares
from threadpoolctl import threadpool_limits

from analysis.errors import AnalysisError
from analysis.records import IsoflopFit, ParabolaFit, PowerLaw


def _as_1d(name: str, v: np.ndarray | list[float], size: int | None = None) -> np.ndarray:
    a = np.asarray(v, dtype=float).reshape(-1)
    if size is not None and a.size != size:
        raise AnalysisError(f"{name} has {a.size} values, expected {size}")
    if not np.all(np.isfinite(a)):
        raise AnalysisError(f"{name} has non-finite values")
    return a


def _interp_loglog(u: np.ndarray, v: np.ndarray, u0: float) -> float:
    """ln-space value at u0 of the piecewise-linear curve through (u, v), extrapolated on the end segments."""
    uu, inv = np.unique(u, return_inverse=True)
    vv = np.bincount(inv, weights=v) / np.bincount(inv)
    if uu.size == 1:
        return float(vv[0])
    if u0 < uu[0]:
        return float(vv[0] + (u0 - uu[0]) * (vv[1] - vv[0]) / (uu[1] - uu[0]))
    if u0 > uu[-1]:
        return float(vv[-1] + (u0 - uu[-1]) * (vv[-1] - vv[-2]) / (uu[-1] - uu[-2]))
    return float(np.interp(u0, uu, vv))


def fit_parabola(
    n: np.ndarray,
    loss: np.ndarray,
    budget: float,
    d: np.ndarray | None = None,
    *,
    f_scale: float | None = None,
    robust_loss: str = "soft_l1",
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
        d_opt = float(np.exp(_interp_loglog(u, np.log(d), u_star))) if np.isfinite(u_star) else np.nan
    inside = bool(q2 > 0 and u.min() <= u_star <= u.max())
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
    )


def _loglog_line(c: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(log10 k, exponent) of y = k C^exponent by least squares in log10-log10."""
    slope, intercept = np.polyfit(np.log10(c), np.log10(y), 1)
    return float(intercept), float(slope)


def fit_power_law(c: np.ndarray, y: np.ndarray) -> PowerLaw:
    """Fit ``y = k * C**exponent`` by least squares in log-log (no CI; see ``fit_isoflop``).

    Args:
        c: [K] budgets (> 0), at least 2 distinct.
        y: [K] values (> 0).

    Raises:
        AnalysisError: fewer than 2 distinct budgets or non-positive values.
    """
    c = _as_1d("c", c)
    y = _as_1d("y", y, c.size)
    if np.unique(c).size < 2:
        raise AnalysisError("a power law needs at least 2 distinct budgets")
    if np.any(c <= 0) or np.any(y <= 0):
        raise AnalysisError("power-law values must be positive")
    logk, e = _loglog_line(c, y)
    return PowerLaw(k=float(10.0**logk), exponent=e, n_points=int(c.size))


def _vertex_laws(fits: list[ParabolaFit]) -> np.ndarray | None:
    """[3, 2] rows (log10 k, exponent) for N*, D*, L* over inside vertices, or None (< 2 inside budgets)."""
    inside = [f for f in fits if f.vertex_inside and f.loss_opt > 0]
    if len({f.budget for f in inside}) < 2:
        return None
    c = np.array([f.budget for f in inside])
    cols = ([f.n_opt for f in inside], [f.d_opt for f in inside], [f.loss_opt for f in inside])
    return np.array([_loglog_line(c, np.asarray(v)) for v in cols])


@threadpool_limits.wrap(limits=1, user_api="blas")  # tiny BLAS calls: a busy thread pool is 50x slower
def fit_isoflop(
    n: np.ndarray,
    c: np.ndarray,
    loss: np.ndarray,
    d: np.ndarray | None = None,
    *,
    n_boot: int = 200,
    seed: int = 0,
    min_points: int = 3,
    f_scale: float | None = None,
) -> IsoflopFit:
    """Approach 2 over points grouped by budget (the distinct values of ``c``).

    Args:
        n: [P] parameter counts.
        c: [P] budget of each point; points with equal ``c`` form one isoFLOP curve (bin continuous
            budgets first, e.g. with ``analysis.tabular.bin_budgets``).
        loss: [P] losses (nats).
        d: [P] tokens per point; None means C / (6 N). D*(C) is interpolated from these (module docstring).
        n_boot: bootstrap resamples for the power-law CIs (0 disables).
        seed: bootstrap seed.
        min_points: fewest points a budget needs for its parabola (at least 3).
        f_scale: robust residual scale passed to ``fit_parabola`` (None estimates it per budget).

    Returns:
        Parabolas for every budget with enough points, power laws over the inside vertices (None when
        fewer than 2 budgets have their vertex inside), CIs when ``n_boot`` > 0, and notes on what was skipped.

    Raises:
        AnalysisError: bad values or no budget with enough points.
    """
    n = _as_1d("n", n)
    c = _as_1d("c", c, n.size)
    loss = _as_1d("loss", loss, n.size)
    d = c / (6.0 * n) if d is None else _as_1d("d", d, n.size)
    min_points = max(3, int(min_points))
    groups: list[tuple[float, np.ndarray]] = []
    skipped: list[str] = []
    fits: list[ParabolaFit] = []
    for b in np.unique(c):
        idx = np.flatnonzero(c == b)
        n_distinct = np.unique(n[idx]).size
        if idx.size < min_points or n_distinct < 3:
            skipped.append(f"budget {b:.3g}: {idx.size} points ({n_distinct} distinct N), need {min_points}")
            continue
        groups.append((float(b), idx))
        fits.append(fit_parabola(n[idx], loss[idx], b, d[idx], f_scale=f_scale))
    if not fits:
        raise AnalysisError(f"no budget has at least {min_points} points with 3 distinct N")
    for f in fits:
        if not f.vertex_inside:
            why = "curvature <= 0" if f.curvature <= 0 else "vertex outside the sampled N range"
            skipped.append(f"budget {f.budget:.3g}: {why}, left out of the power laws")
    laws = _vertex_laws(fits)
    if laws is None:
        skipped.append("fewer than 2 budgets with an inside vertex: no power laws")

    boot: list[np.ndarray] = []
    rng = np.random.default_rng(seed)
    for _ in range(max(0, int(n_boot)) if laws is not None else 0):
        rfits = []
        for b, idx in groups:
            j = rng.choice(idx, size=idx.size, replace=True)
            if np.unique(n[j]).size < 3:
                continue
            rfits.append(fit_parabola(n[j], loss[j], b, d[j], f_scale=f_scale))
        r = _vertex_laws(rfits)
        if r is not None:
            boot.append(r)
    samples = np.array(boot)  # [B, 3, 2]

    def law(i: int) -> PowerLaw | None:
        if laws is None:
            return None
        ci_k = ci_e = None
        if len(boot) >= 2:
            lo, hi = np.percentile(samples[:, i, :], [2.5, 97.5], axis=0)
            ci_k, ci_e = (float(10.0 ** lo[0]), float(10.0 ** hi[0])), (float(lo[1]), float(hi[1]))
        used = sum(f.vertex_inside and f.loss_opt > 0 for f in fits)
        return PowerLaw(float(10.0 ** laws[i, 0]), float(laws[i, 1]), used, ci_k, ci_e)

    return IsoflopFit(
        parabolas=tuple(fits),
        n_opt=law(0),
        d_opt=law(1),
        loss_opt=law(2),
        budgets_used=tuple(f.budget for f in fits if f.vertex_inside and f.loss_opt > 0),
        skipped=tuple(skipped),
        n_boot=max(0, int(n_boot)),
        n_boot_ok=len(boot),
        seed=int(seed),
    )
