"""Seed noise: the pooled seed-to-seed spread per budget and the verdicts of differences to dense."""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis.noise import compare_to_dense, noise_tables, seed_spread

SIGMA = 0.01


def _points(seeds_at=(1e15, 1e16), n_seeds=4, offsets=None, seed=0):
    """Three sizes per (arch, budget) on a parabola in ln N; ``n_seeds`` seeds at ``seeds_at``, else one."""
    offsets = offsets or {"dense": 0.0, "mod": -0.1, "moda": 0.003}
    rng = np.random.default_rng(seed)
    rows = []
    for arch, off in offsets.items():
        for b in (1e15, 1e16, 1e17):
            for n in (1e5, 3e5, 1e6):
                true = 3.0 + 0.05 * np.log(n / 3e5) ** 2 - 0.1 * np.log10(b) + off
                for s in range(n_seeds if b in seeds_at else 1):
                    rows.append({"arch": arch, "budget": b, "n": n, "seed": s, "loss": true + rng.normal(0, SIGMA)})
    return pd.DataFrame(rows)


def test_spread_is_measured_where_seeds_repeat_and_pooled_elsewhere():
    spread = {r["budget"]: r for r in seed_spread(_points())}
    for b in (1e15, 1e16):
        r = spread[b]
        assert r["source"] == "measured" and r["dof"] == 27  # 9 (arch, size) points x (4 seeds - 1)
        assert r["lo"] < r["sd"] < r["hi"] and r["sd"] == pytest.approx(SIGMA, rel=0.35)  # 27 dof: sd within ~25%
    assert spread[1e17]["source"] == "pooled" and spread[1e17]["dof"] == 54


def test_spread_interval_covers_sigma_across_replicates():
    """The 90% chi-square interval of the pooled spread holds the true sigma in at least 80% of 100 replicates."""
    hits = sum(
        (r := seed_spread(_points(seed=k))[0])["lo"] <= SIGMA <= r["hi"] for k in range(100)
    )  # fmt: skip
    assert hits >= 80, hits


def test_differences_to_dense_get_a_verdict():
    spread, rows = noise_tables(_points())
    by = {(r["arch"], r["budget"]): r for r in rows}
    assert all(by[("mod", b)]["verdict"] == "lower" for b in (1e15, 1e16, 1e17))  # 0.1 nats: ten sigmas
    r = by[("mod", 1e15)]
    assert r["diff"] == pytest.approx(-0.1, abs=4 * SIGMA) and r["sd"] == spread[0]["sd"]
    # the half-width is t(dof) * sd * sqrt(1/seeds + 1/seeds): 4-seed means at 1e15, single runs at 1e17
    assert r["hi"] - r["diff"] == pytest.approx(stats.t.ppf(0.95, 27) * r["sd"] * np.sqrt(2 / 4))
    r = by[("mod", 1e17)]
    assert r["hi"] - r["diff"] == pytest.approx(stats.t.ppf(0.95, 54) * r["sd"] * np.sqrt(2))


def test_difference_interval_covers_the_true_difference():
    """MoDA is 0.003 nats above dense: its 90% interval holds that in at least 80% of 100 replicates at a budget
    of 4-seed means (measured spread) and at one of single runs (spread pooled from the other budgets)."""
    hits = {1e15: 0, 1e17: 0}
    for k in range(100):
        for r in noise_tables(_points(seed=k))[1]:
            if r["arch"] == "moda" and r["budget"] in hits:
                hits[r["budget"]] += r["lo"] <= 0.003 <= r["hi"]
    assert min(hits.values()) >= 80, hits


def test_without_replicates_noise_is_not_measured():
    pts = _points(seeds_at=())
    assert all(r["sd"] is None and r["source"] is None for r in seed_spread(pts))
    assert {r["verdict"] for r in compare_to_dense(pts, seed_spread(pts))} == {"noise not measured"}
    assert all(r["sd"] is None for r in seed_spread(pts.drop(columns="seed")))
