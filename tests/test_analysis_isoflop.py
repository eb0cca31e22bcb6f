"""Approach 2: robust isoFLOP parabolas, vertices, power laws and their t intervals."""

import numpy as np
import pytest

from analysis import AnalysisError, fit_isoflop, fit_parabola, fit_power_law
from analysis.tabular import bin_budgets

TRUE = {"E": 1.7, "A": 400.0, "B": 1800.0, "alpha": 0.34, "beta": 0.28}


def surface(n, d):
    return TRUE["E"] + TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / d ** TRUE["beta"]


def n_opt_true(c):
    """Closed-form compute-optimal N of the surface under D = C / (6 N)."""
    al, be = TRUE["alpha"], TRUE["beta"]
    g = (al * TRUE["A"] / (be * TRUE["B"])) ** (1 / (al + be))
    return g * (c / 6) ** (be / (al + be))


def isoflop_grid(budgets=(1e18, 1e19, 1e20, 1e21), per=9, noise=0.002, seed=0):
    rng = np.random.default_rng(seed)
    n, c = [], []
    for b in budgets:
        centre = n_opt_true(b)
        for m in np.geomspace(centre / 12, centre * 12, per):
            n.append(m)
            c.append(b)
    n, c = np.array(n), np.array(c)
    d = c / (6 * n)
    return n, c, d, surface(n, d) * np.exp(rng.normal(0, noise, n.size))


def test_parabola_exact_vertex_and_flags():
    n = np.exp(np.linspace(10, 14, 7))
    u = np.log(n)
    loss = 0.05 * (u - 12.5) ** 2 + 3.0
    p = fit_parabola(n, loss, 1e15)
    assert p.n_opt == pytest.approx(np.exp(12.5), rel=1e-6)
    assert p.loss_opt == pytest.approx(3.0, abs=1e-9)
    assert p.curvature == pytest.approx(0.05, rel=1e-6)
    assert p.vertex_inside and p.n_points == 7
    assert p.d_opt == pytest.approx(1e15 / (6 * np.exp(12.5)), rel=1e-6)  # default D = C / (6 N)
    np.testing.assert_allclose(p.predict(n), loss, atol=1e-9)
    # vertex beyond the sampled range
    out = fit_parabola(n, 0.05 * (u - 16.0) ** 2 + 3.0, 1e15)
    assert not out.vertex_inside and out.curvature > 0
    # concave: no minimum
    assert not fit_parabola(n, -0.05 * (u - 12.0) ** 2 + 3.0, 1e15).vertex_inside
    assert fit_parabola(n, loss, 1e15).to_dict()["coef"] == pytest.approx(list(p.coef))


def test_parabola_is_robust_to_one_outlier():
    n = np.exp(np.linspace(10, 14, 9))
    u = np.log(n)
    loss = 0.05 * (u - 12.0) ** 2 + 3.0
    loss[1] += 0.5  # one diverged run
    p = fit_parabola(n, loss, 1e15)
    assert np.log(p.n_opt) == pytest.approx(12.0, abs=0.1)
    ols = fit_parabola(n, loss, 1e15, robust_loss="linear")
    assert abs(np.log(ols.n_opt) - 12.0) > abs(np.log(p.n_opt) - 12.0)


def test_d_opt_follows_given_tokens():
    # tokens from an exact per-arch FLOP formula: D = C / (3 * fpt), fpt = 2N + 1e6 (attention term)
    n = np.geomspace(1e6, 1e8, 7)
    c = 1e17
    d = c / (3 * (2 * n + 1e6))
    u = np.log(n)
    p = fit_parabola(n, 0.04 * (u - np.log(1e7)) ** 2 + 3.0, c, d)
    assert p.n_opt == pytest.approx(1e7, rel=1e-6)
    assert p.d_opt == pytest.approx(c / (3 * (2e7 + 1e6)), rel=0.01)


def test_synthetic_surface_recovers_exponent():
    n, c, d, loss = isoflop_grid()
    fit = fit_isoflop(n, c, loss, d)
    assert len(fit.parabolas) == 4
    assert all(p.vertex_inside for p in fit.parabolas)
    a_true = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
    assert fit.n_opt.exponent == pytest.approx(a_true, abs=0.03)
    assert fit.d_opt.exponent == pytest.approx(1 - a_true, abs=0.03)
    assert fit.loss_opt.exponent < 0
    lo, hi = fit.n_opt.ci_exponent
    assert lo < fit.n_opt.exponent < hi and hi - lo < 0.2
    for p in fit.parabolas:
        assert p.n_opt == pytest.approx(n_opt_true(p.budget), rel=0.25)
    assert fit.to_dict()["n_opt"]["ci_exponent"] == [lo, hi]


def test_budgets_with_too_few_points_are_skipped():
    n, c, d, loss = isoflop_grid(budgets=(1e18, 1e19, 1e20), per=5)
    keep = ~((c == 1e20) & (np.arange(c.size) % 5 > 1))  # leave the top budget 2 points
    fit = fit_isoflop(n[keep], c[keep], loss[keep])
    assert [p.budget for p in fit.parabolas] == [1e18, 1e19]
    assert any("1e+20" in s and "need 3" in s for s in fit.skipped)
    # two budgets: the law, but no scatter to give it an interval
    assert fit.n_opt is not None and fit.n_opt.ci_exponent is None and fit.n_opt.n_points == 2
    assert fit.n_opt.why and any("not identified" in s for s in fit.skipped)
    # one usable budget: parabola but no power law
    one = fit_isoflop(n[c == 1e18], c[c == 1e18], loss[c == 1e18])
    assert one.n_opt is None and len(one.parabolas) == 1
    with pytest.raises(AnalysisError, match="no budget"):
        fit_isoflop(n[:2], c[:2], loss[:2])


def test_power_law_and_binning():
    c = np.array([1e18, 1e19, 1e20])
    law = fit_power_law(c, 0.3 * c**0.5)
    assert law.exponent == pytest.approx(0.5) and law.k == pytest.approx(0.3)
    np.testing.assert_allclose(law(c), 0.3 * c**0.5)
    assert law.ci_exponent is None and "exactly" in law.why  # no scatter: no zero-width interval
    # the t interval by hand: 4 points, dof 2, slope se = s / sqrt(Sxx)
    c4 = np.array([1e18, 1e19, 1e20, 1e21])
    y = 0.3 * c4**0.5 * 10.0 ** np.array([0.01, -0.02, 0.015, -0.005])
    law = fit_power_law(c4, y, level=0.9)
    x, v = np.log10(c4), np.log10(y)
    slope, icpt = np.polyfit(x, v, 1)
    s = np.sqrt(((v - icpt - slope * x) ** 2).sum() / 2)
    half = 2.919986 * s / np.sqrt(((x - x.mean()) ** 2).sum())  # t(0.95, 2)
    assert law.ci_exponent == pytest.approx((slope - half, slope + half), rel=1e-6)
    with pytest.raises(AnalysisError):
        fit_power_law([1e18, 1e18], [1.0, 2.0])
    b = bin_budgets(np.array([1.0e19, 1.04e19, 0.97e19, 3e19]), 0.1)
    assert b[0] == b[1] == b[2] == pytest.approx((1.0e19 * 1.04e19 * 0.97e19) ** (1 / 3))
    assert b[3] == pytest.approx(3e19)
    np.testing.assert_array_equal(bin_budgets(np.array([1.0, 1.01]), 0), [1.0, 1.01])


def test_vertex_intervals_cover_a_parabolas_vertex():
    """On noisy points of an exact parabola the 90% vertex intervals hold the true N* and L* in 85-95% of 400
    replicates (binomial sd 1.5%)."""
    rng = np.random.default_rng(0)
    n = np.geomspace(1e6, 1e8, 6)
    truth = 0.05 * np.log(n / 1e7) ** 2 + 3.0  # vertex (1e7, 3.0)
    hits_n = hits_l = 0
    for _ in range(400):
        p = fit_parabola(n, truth + rng.normal(0, 0.01, n.size), 1e18)
        assert p.why == "" and p.ci_n_opt[0] < p.n_opt < p.ci_n_opt[1]
        hits_n += p.ci_n_opt[0] <= 1e7 <= p.ci_n_opt[1]
        hits_l += p.ci_loss_opt[0] <= 3.0 <= p.ci_loss_opt[1]
        lo, hi = p.ci_d_opt  # D* at N*'s interval ends: D = C / (6 N) falls with N
        assert lo == pytest.approx(1e18 / (6 * p.ci_n_opt[1])) and hi == pytest.approx(1e18 / (6 * p.ci_n_opt[0]))
    assert 0.85 <= hits_n / 400 <= 0.95 and 0.85 <= hits_l / 400 <= 0.95


@pytest.mark.parametrize(
    "n, loss, why",
    [
        ([1e6, 1e7, 1e8], [3.2, 3.0, 3.1], "3 runs: the parabola passes through them"),
        ([1e6, 3e6, 1e7, 1e8], [3.2, 3.1, 3.0, 3.1], "4 runs: 1 residual dof"),
        ([1e6, 2e6, 4e6, 8e6, 1.6e7], [3.0, 2.9, 3.05, 2.95, 3.02], "curvature's interval reaches 0"),
        ([1e6, 1e7, 1e8, 1e9, 1e10], [3.8, 3.4, 3.1, 2.9, 2.8], "not a minimum inside"),
    ],
)
def test_vertex_without_enough_residual_has_no_interval(n, loss, why):
    p = fit_parabola(np.array(n), np.array(loss), 1e18)
    assert why in p.why and p.ci_n_opt is p.ci_d_opt is p.ci_loss_opt is None
