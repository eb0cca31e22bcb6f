"""Seed noise: how far a run's loss moves with its seed alone, and which differences between archs exceed it.

A grid point trained with several seeds (``sweep.seeds``) gives the spread of its loss. Per budget the spread is
the pooled standard deviation over every (arch, size) with two or more seeds (dof = sum of seeds - 1), with a
``LEVEL`` chi-square interval; a budget without replicates borrows the spread pooled over all budgets (and
says so). An arch's best loss at a budget is the lowest seed-mean loss over its sizes. A difference of two such
means gets a ``LEVEL`` t interval from that spread, sd * sqrt(1/n_a + 1/n_b) with the spread's dof (n = seeds
averaged on each side); it is "within noise" when the interval holds 0. The interval holds seed noise only: a
best-of-sizes loss also sits above the arch's true isoFLOP minimum by however far its nearest grid size is from
it (for both sides alike on a shared ladder), and the lowest of several noisy means is biased low when sizes come
close (by at most about the sd of one mean).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from analysis.records import LEVEL


def _pooled(groups: pd.core.groupby.DataFrameGroupBy) -> tuple[float, int] | None:
    """(pooled sd, dof) over groups of two or more losses, or None."""
    ss, dof = 0.0, 0
    for _, g in groups:
        if len(g) >= 2:
            ss += float(((g - g.mean()) ** 2).sum())
            dof += len(g) - 1
    return (float(np.sqrt(ss / dof)), dof) if dof else None


def seed_spread(points: pd.DataFrame, level: float = LEVEL) -> list[dict[str, Any]]:
    """Per budget: the seed-to-seed standard deviation of the loss, its interval and where it comes from.

    Args:
        points: series points with ``arch``, ``budget``, ``n``, ``loss`` and ``seed`` (no ``seed`` column: no
            replicates).
        level: coverage of the interval.

    Returns:
        One row per budget: budget, sd, lo, hi, dof, source ("measured" at this budget, "pooled" over all
        budgets, or None with sd None when no grid point has two seeds anywhere).
    """
    has_seeds = "seed" in points and points["seed"].notna().any()
    key = ["arch", "budget", "n"]
    every = _pooled(points.groupby(key)["loss"]) if has_seeds else None
    rows = []
    for b, g in points.groupby("budget", sort=True):
        here = _pooled(g.groupby(key)["loss"]) if has_seeds else None
        sd_dof, source = (here, "measured") if here else (every, "pooled") if every else (None, None)
        row = {"budget": float(b), "sd": None, "lo": None, "hi": None, "dof": None, "source": source}
        if sd_dof:
            sd, dof = sd_dof
            lo_q, hi_q = stats.chi2.ppf([(1 + level) / 2, (1 - level) / 2], dof)
            row.update(sd=sd, lo=sd * np.sqrt(dof / lo_q), hi=sd * np.sqrt(dof / hi_q), dof=dof)
        rows.append(row)
    return rows


def seed_means(points: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    """Per ``key`` group: the mean loss over its seeds (``loss``) and how many there were (``seeds``)."""
    return points.groupby(key, sort=True, dropna=False)["loss"].agg(loss="mean", seeds="count").reset_index()


def best_points(points: pd.DataFrame, key: tuple[str, ...] = ("n",)) -> pd.DataFrame:
    """Per (arch, budget): the size (``key`` columns) with the lowest seed-mean loss, that loss and its seeds."""
    means = seed_means(points, ["arch", "budget", *key])
    return means.loc[means.groupby(["arch", "budget"])["loss"].idxmin()].reset_index(drop=True)


def difference(
    a: tuple[float, int], b: tuple[float, int], spread: dict[str, Any] | None, level: float = LEVEL
) -> dict[str, Any]:
    """Seed-mean loss ``a`` minus ``b`` (each (loss, seeds)) with its ``level`` interval from a ``seed_spread`` row.

    Returns:
        diff, lo, hi (None without a spread), sd (the spread used) and verdict: "lower" or "higher" when the
        interval excludes 0, "within noise" when it holds 0, "noise not measured" without a spread.
    """
    diff = float(a[0] - b[0])
    out = {"diff": diff, "lo": None, "hi": None, "sd": None, "verdict": "noise not measured"}
    if spread is None or spread["sd"] is None:
        return out
    half = stats.t.ppf((1 + level) / 2, spread["dof"]) * spread["sd"] * np.sqrt(1 / a[1] + 1 / b[1])
    lo, hi = diff - half, diff + half
    verdict = "lower" if hi < 0 else "higher" if lo > 0 else "within noise"
    return {**out, "lo": float(lo), "hi": float(hi), "sd": spread["sd"], "verdict": verdict}


def compare_to_dense(points: pd.DataFrame, spread: list[dict[str, Any]], dense: str = "dense") -> list[dict[str, Any]]:
    """Per budget and arch other than ``dense``: its best loss minus dense's with its interval (``difference``).

    Returns:
        Rows of budget, arch, best, dense_best and ``difference``'s diff, lo, hi, sd and verdict.
    """
    at = {r["budget"]: r for r in spread}
    best = best_points(points).set_index(["arch", "budget"])
    rows = []
    for (arch, b), v in best.iterrows():
        if arch == dense or (dense, b) not in best.index:
            continue
        d = best.loc[(dense, b)]
        diff = difference((v["loss"], v["seeds"]), (d["loss"], d["seeds"]), at.get(float(b)))
        rows.append(
            {"budget": float(b), "arch": arch, "best": float(v["loss"]), "dense_best": float(d["loss"]), **diff}
        )
    return sorted(rows, key=lambda r: (r["budget"], r["arch"]))


def noise_tables(points: pd.DataFrame) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(``seed_spread``, ``compare_to_dense``) of a sweep's val_loss series (no ``:causal`` series)."""
    plain = points[~points["arch"].str.endswith(":causal")]
    spread = seed_spread(plain)
    return spread, compare_to_dense(plain, spread)
