"""Approach 3's compute-optimal frontier: the synthetic truth's exponents, the closed form against a brute-force
minimum along a non-Chinchilla budget constraint, and refusals."""

import numpy as np
import pytest

from analysis import AnalysisError
from analysis.optimal import compute_optimal, token_relation
from analysis.parametric import fit_parametric
from analysis.records import ParametricFit
from analysis.synthetic import TRUTH, fake_runs, surface_loss

A_TRUE = TRUTH["beta"] / (TRUTH["alpha"] + TRUTH["beta"])
B_TRUE = TRUTH["alpha"] / (TRUTH["alpha"] + TRUTH["beta"])
BUDGETS = (1e15, 1e16, 1e17, 1e18)


def fitted(noise, seed=0):
    rows = fake_runs(budgets=BUDGETS, sizes_per_budget=5, noise=noise, seed=seed)
    n, d, c, loss = (np.array([r[k] for r in rows], dtype=float) for k in ("params_nonembed", "tokens", "budget",
                                                                            "val_loss"))  # fmt: skip
    return fit_parametric(n, d, loss), n, d, c


@pytest.mark.parametrize("noise, tol", [(0.0, 1e-4), (0.002, 5e-3)])
def test_frontier_recovers_the_truths_exponents(noise, tol):
    fit, n, d, c = fitted(noise)
    fr = compute_optimal(fit, n, d, c)
    assert fr.slope == pytest.approx(0.0, abs=1e-4) and np.exp(fr.log_k) == pytest.approx(6.0, rel=1e-4)  # C = 6ND
    assert fr.n_exponent == pytest.approx(A_TRUE, abs=tol) and fr.d_exponent == pytest.approx(B_TRUE, abs=tol)
    lo, hi = fr.ci_n_exponent
    assert lo < fr.n_exponent < hi
    slope = np.polyfit(np.log(fr.budgets), np.log(fr.n_opt), 1)[0]  # the tabulated N*(C) follow the exponent
    assert slope == pytest.approx(fr.n_exponent, abs=1e-9)
    for (lo, hi), v in zip(fr.n_ci + fr.d_ci + fr.loss_ci, fr.n_opt + fr.d_opt + fr.loss_opt, strict=True):
        assert lo <= v <= hi


def test_closed_form_is_the_minimum_along_the_runs_constraint():
    # tokens D = C / (5 N^1.15): more FLOPs per token in bigger models than 6 N
    cov = tuple(tuple(1e-6 * (i == j) for j in range(5)) for i in range(5))
    fit = ParametricFit(**{k: TRUTH[k] for k in ("E", "A", "B", "alpha", "beta")}, objective=0.0, n_points=20,
                        identified=True, cov=cov)  # fmt: skip
    n = np.geomspace(1e5, 1e9, 12)
    c = np.repeat([1e17, 1e19], 6)
    d = c / (5.0 * n**1.15)
    log_k, slope = token_relation(n, d, c)
    assert np.exp(log_k) == pytest.approx(5.0) and slope == pytest.approx(0.15)
    fr = compute_optimal(fit, n, d, c, draws=200)
    g = 1.15
    assert fr.n_exponent == pytest.approx(TRUTH["beta"] / (TRUTH["alpha"] + g * TRUTH["beta"]))
    for budget in (1e16, 1e18, 1e21):
        grid = np.exp(np.linspace(np.log(1e3), np.log(1e13), 400_001))
        losses = surface_loss(grid, budget / (5.0 * grid**g))
        i = int(np.argmin(losses))
        n_opt, d_opt, loss_opt = fr.at(budget)
        assert n_opt == pytest.approx(grid[i], rel=1e-4)
        assert d_opt == pytest.approx(budget / (5.0 * n_opt**g), rel=1e-9)
        assert loss_opt == pytest.approx(losses[i], abs=1e-9)


def test_refusals():
    fit, n, d, c = fitted(0.002)
    with pytest.raises(AnalysisError, match="not identified"):
        compute_optimal(ParametricFit(1.0, 1.0, 1.0, 0.3, 0.3, 0.0, 5, why="too few"), n, d, c)
    with pytest.raises(AnalysisError, match="tokens grow with N"):
        compute_optimal(fit, n, c / 6.0 * n**0.5, c)  # D rising with N at a fixed C
    with pytest.raises(AnalysisError, match="2 distinct sizes"):
        token_relation(np.full(3, 1e6), np.full(3, 1e9), np.full(3, 1e16))
