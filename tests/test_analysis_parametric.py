"""Approach 3 (parametric L = E + A/N^alpha + B/D^beta): Chinchilla reference refit and synthetic truth."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import AnalysisError, fit_parametric
from analysis.parametric import default_grid, grid_objectives, objective

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
CHINCHILLA = FIXTURES / "chinchilla_svg_extracted_data.csv"


def chinchilla_points():
    if not CHINCHILLA.is_file():
        pytest.skip(f"fixture folder {FIXTURES} (../shared/fixtures) absent: no Chinchilla CSV")
    df = pd.read_csv(CHINCHILLA)
    df = df.drop(df["loss"].nlargest(5).index)
    n, c, loss = (df[k].to_numpy(float) for k in ("Model Size", "Training FLOP", "loss"))
    return n, c / (6 * n), loss


def surface(n, d, E=1.7, A=400.0, B=1800.0, alpha=0.34, beta=0.28):
    return E + A / n**alpha + B / d**beta


def test_chinchilla_matches_epoch_refit():
    n, d, loss = chinchilla_points()
    assert n.size == 240
    fit = fit_parametric(n, d, loss)
    assert fit.E == pytest.approx(1.8172, abs=0.005)
    assert fit.alpha == pytest.approx(0.3473, abs=0.003)
    assert fit.beta == pytest.approx(0.3672, abs=0.003)
    assert fit.A == pytest.approx(477.8, rel=0.02)
    assert fit.B == pytest.approx(2143.4, rel=0.02)
    assert fit.objective == pytest.approx(1.01827e-3, rel=1e-4)  # summed Huber, as Epoch report it
    assert fit.a == pytest.approx(fit.beta / (fit.alpha + fit.beta))
    assert fit.n_grid == 4500 and fit.n_points == 240


def test_objective_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    n = np.exp(rng.uniform(15, 22, 50))
    d = np.exp(rng.uniform(18, 25, 50))
    logl = np.log(surface(n, d) * np.exp(rng.normal(0, 0.01, 50)))
    x, y = np.log(n), np.log(d)
    theta = np.array([0.5, 6.0, 7.5, 0.35, 0.3])
    f, g = objective(theta, x, y, logl, 1e-3)
    eps = 1e-6
    num = [(objective(theta + eps * e, x, y, logl, 1e-3)[0] - objective(theta - eps * e, x, y, logl, 1e-3)[0])
           / (2 * eps) for e in np.eye(5)]  # fmt: skip
    np.testing.assert_allclose(g, num, rtol=1e-4, atol=1e-9)
    # the vectorised grid evaluation agrees with the scalar objective
    grid = default_grid()[::500]
    np.testing.assert_allclose(
        grid_objectives(grid, x, y, logl, 1e-3), [objective(t, x, y, logl, 1e-3)[0] for t in grid], rtol=1e-10
    )


def synthetic_grid(noise=0.003, seed=1):
    rng = np.random.default_rng(seed)
    n_list, d_list = [], []
    for c in (1e18, 3e18, 1e19, 3e19, 1e20):
        for n in np.geomspace(2e6, 2e9, 9):
            n_list.append(n)
            d_list.append(c / (6 * n))
    n, d = np.array(n_list), np.array(d_list)
    return n, d, surface(n, d) * np.exp(rng.normal(0, noise, n.size))


def test_synthetic_recovery_with_intervals():
    n, d, loss = synthetic_grid()
    fit = fit_parametric(n, d, loss)
    assert fit.E == pytest.approx(1.7, abs=0.05)
    assert fit.alpha == pytest.approx(0.34, abs=0.03)
    assert fit.beta == pytest.approx(0.28, abs=0.03)
    assert fit.a == pytest.approx(0.28 / 0.62, abs=0.02)
    assert fit.identified and fit.why == ""
    assert set(fit.ci) == {"E", "A", "B", "alpha", "beta", "a"}
    for k in fit.ci:
        lo, hi = fit.ci[k]
        assert lo < getattr(fit, k) < hi
    d2 = fit.to_dict()
    assert d2["a"] == pytest.approx(fit.a) and isinstance(d2["ci"]["E"], list)


def test_unidentified_fits_are_flagged_without_numbers():
    """Six points for five parameters, or a surface whose N term is flat: flagged, no interval shown."""
    n, d, loss = synthetic_grid()
    few = fit_parametric(n[:6], d[:6], loss[:6])
    assert not few.identified and "6 points" in few.why and few.ci == {} and few.cov is None
    flat = fit_parametric(n, d, 2.0 + 1800 / d**0.28)  # no parameter term: A or alpha runs to a bound
    assert not flat.identified and flat.why and flat.ci == {}


def test_noise_free_surface_is_recovered_exactly():
    n, d, _ = synthetic_grid()
    fit = fit_parametric(n, d, surface(n, d), n_starts=8)
    assert fit.E == pytest.approx(1.7, rel=1e-3)
    assert fit.alpha == pytest.approx(0.34, rel=1e-3)
    assert fit.beta == pytest.approx(0.28, rel=1e-3)
    assert fit.objective < 1e-10


def test_bad_input():
    with pytest.raises(AnalysisError, match="at least 6 points"):
        fit_parametric([1e6, 2e6], [1e9, 2e9], [3.0, 2.9])
    with pytest.raises(AnalysisError, match="positive"):
        fit_parametric(np.full(8, 1e6), np.full(8, 1e9), np.r_[np.full(7, 3.0), -1.0])
    with pytest.raises(AnalysisError, match="differ in length"):
        fit_parametric(np.ones(8), np.ones(7), np.ones(8))
