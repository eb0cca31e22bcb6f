"""Intervals that hold what they claim, on known-truth synthetic sweeps (L = E + A/N^alpha + B/D^beta with noise).

Over 60 noisy replicates with 3 and with 5 sizes per budget (5 budgets, half a decade apart), the stated 90%
intervals of alpha, beta and the N*(C) exponent (Approach 2 and Approach 3) cover the truth in at least 80% of
replicates and never have zero width, and the forecast of the held-out largest budget lands within its
prediction interval in at least 80% of them, for both approaches.
"""

import numpy as np
import pytest

from analysis.forecast import forecast
from analysis.isoflop import fit_isoflop
from analysis.parametric import fit_parametric
from analysis.synthetic import TRUTH, fake_runs

BUDGETS = (1e15, 3e15, 1e16, 3e16, 1e17)
REPLICATES = 60
A_TRUE = TRUTH["beta"] / (TRUTH["alpha"] + TRUTH["beta"])  # N*(C) ∝ C^a


def _arrays(rows):
    n, c, d, loss = (np.array([r[k] for r in rows], float) for k in ("params_nonembed", "budget", "tokens", "val_loss"))
    return n, c, d, loss


def _covers(ci, truth) -> bool:
    lo, hi = ci
    assert hi > lo, ci  # never zero width (nor inverted)
    return lo <= truth <= hi


@pytest.fixture(scope="module", params=[3, 5], ids=["3 sizes", "5 sizes"])
def replicates(request):
    """Per replicate: (Approach 2 fit, Approach 3 fit, forecasts) of one noisy synthetic sweep."""
    out = []
    for seed in range(REPLICATES):
        n, c, d, loss = _arrays(fake_runs(budgets=BUDGETS, sizes_per_budget=request.param, seed=seed))
        out.append((fit_isoflop(n, c, loss, d), fit_parametric(n, d, loss), forecast(n, c, loss, d, holdout=1)))
    return out


def test_parameter_intervals_cover_the_truth(replicates):
    hits = {"isoflop a": 0, "alpha": 0, "beta": 0, "parametric a": 0}
    for iso, par, _ in replicates:
        assert iso.n_opt.ci_exponent is not None and par.identified, (iso.n_opt.why, par.why)
        hits["isoflop a"] += _covers(iso.n_opt.ci_exponent, A_TRUE)
        hits["alpha"] += _covers(par.ci["alpha"], TRUTH["alpha"])
        hits["beta"] += _covers(par.ci["beta"], TRUTH["beta"])
        hits["parametric a"] += _covers(par.ci["a"], A_TRUE)
    assert all(h >= 0.8 * REPLICATES for h in hits.values()), hits


def test_held_out_budget_lands_within_its_forecast(replicates):
    hits = {"isoflop": 0, "parametric": 0}
    for _, _, casts in replicates:
        for f in casts:
            assert f.budget == BUDGETS[-1] and f.fit_budgets == BUDGETS[:-1]
            assert f.inside is not None, f.why  # every method predicts, with an interval, and the vertex is measured
            assert f.loss_hi > f.loss_lo and f.n_hi > f.n_lo
            hits[f.method] += f.inside
    assert all(h >= 0.8 * REPLICATES for h in hits.values()), hits


def test_three_sizes_per_budget_is_where_a_bootstrap_collapsed():
    """With three sizes a percentile bootstrap over runs can only resample the data itself (zero width); the
    scatter of the vertices gives an interval that holds the truth and is as wide as that scatter says."""
    n, c, d, loss = _arrays(fake_runs(budgets=BUDGETS, sizes_per_budget=3, seed=0))
    law = fit_isoflop(n, c, loss, d).n_opt
    lo, hi = law.ci_exponent
    assert lo < law.exponent < hi and hi - lo > 1e-3


def test_two_budgets_give_no_interval_and_no_forecast_interval():
    n, c, d, loss = _arrays(fake_runs(budgets=BUDGETS[:3], sizes_per_budget=5, seed=0))
    casts = forecast(n, c, loss, d, holdout=1)  # fitted on two budgets
    iso = next(f for f in casts if f.method == "isoflop")
    assert iso.n_pred is not None and iso.n_lo is None and iso.loss_lo is None and "not identified" in iso.why
    assert iso.inside is None


def test_seed_replicates_of_a_size_are_forecast():
    """Two seeds of every grid point (repeated sizes): both approaches predict, with intervals."""
    rows = [r for s in (1, 2) for r in fake_runs(budgets=BUDGETS, sizes_per_budget=3, seed=s)]
    n, c, d, loss = _arrays(rows)
    for f in forecast(n, c, loss, d, holdout=1):
        assert f.loss_lo < f.loss_pred < f.loss_hi and f.n_lo < f.n_pred < f.n_hi and f.inside is not None, f
