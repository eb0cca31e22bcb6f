"""Seed noise: how far a run's loss moves with its seed alone, and which differences between archs exceed it.

A grid point trained with several seeds (``sweep.seeds``) gives the spread of its loss. Per budget the spread is
the pooled standard deviation over every (arch, size) with two or more seeds (dof = sum of seeds - 1), with a
``LEVEL`` chi-square interval; a budget without replicates borrows the spread pooled over all budgets (and
says so). An arch's best loss at a budget is the lowest seed-mean loss over its sizes; a difference to dense's
is "within noise" when it is at most twice the spread.
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


def compare_to_dense(points: pd.DataFrame, spread: list[dict[str, Any]], dense: str = "dense") -> list[dict[str, Any]]:
    """Per budget and arch other than ``dense``: its best loss minus dense's, the spread, and the verdict.

    Returns:
        Rows of budget, arch, best, dense_best, diff, sd, verdict ("within noise", "lower", "higher", or
        "noise not measured" when the budget has no spread).
    """
    sd_at = {r["budget"]: r["sd"] for r in spread}
    best = points.groupby(["arch", "budget", "n"])["loss"].mean().groupby(["arch", "budget"]).min()
    rows = []
    for (arch, b), v in best.items():
        if arch == dense or (dense, b) not in best:
            continue
        diff, sd = float(v - best[(dense, b)]), sd_at.get(float(b))
        if sd is None:
            verdict = "noise not measured"
        elif abs(diff) <= 2 * sd:
            verdict = "within noise"
        else:
            verdict = "lower" if diff < 0 else "higher"
        rows.append({
            "budget": float(b), "arch": arch, "best": float(v), "dense_best": float(best[(dense, b)]),
            "diff": diff, "sd": sd, "verdict": verdict,
        })  # fmt: skip
    return sorted(rows, key=lambda r: (r["budget"], r["arch"]))


def noise_tables(points: pd.DataFrame) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(``seed_spread``, ``compare_to_dense``) of a sweep's val_loss series (no ``:causal`` series)."""
    plain = points[~points["arch"].str.endswith(":causal")]
    spread = seed_spread(plain)
    return spread, compare_to_dense(plain, spread)
