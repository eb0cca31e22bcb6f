"""Seed noise: how far a run's loss moves with its seed alone, and which differences between archs exceed it.

A grid point trained with several seeds (``sweep.seeds``) gives the spread of its loss. Per budget the spread is
the pooled standard deviation over the (arch, size) points with two or more seeds (dof = sum of seeds - 1), with a
``LEVEL`` chi-square interval; a budget without replicates borrows the spread pooled over the budgets that have
them and names them (``source``): that assumes the seed noise does not change with the budget. A comparison of two
archs takes each arch's own spread (``arch_spreads``): an arch noisier than the others widens its own comparisons
and does not narrow theirs.

Two differences, each with a ``LEVEL`` interval that holds the seed noise of whatever it was chosen from:

- ``difference``: the seed means of two given grid points: Welch's t interval, sqrt(sd_a^2/n_a + sd_b^2/n_b) with
  the Welch-Satterthwaite dof (n = seeds averaged on each side).
- ``best_difference``: the lowest of arch A's seed means at a budget minus the lowest of B's, as an estimate of the
  difference of their truly lowest grid points. The lowest of several noisy means is low by luck, more so the more
  sizes come close. Its estimation error lies between (the lowest of A's sizes' errors) - (the error of B's truly
  best size) and (the error of A's truly best size) - (the lowest of B's), whatever the true losses; the interval
  takes the outer ``LEVEL`` quantiles of these two bounds (Monte Carlo, each arch's sd drawn from its chi-square
  as in Welch's problem), so it holds the true difference with probability about ``LEVEL`` or more however close
  the sizes are. With one size on each side it is ``difference``'s interval; with one on A's side and B's every
  size, it is the interval of A minus B at the shape B's lowest mean picked (whose own error the pick biases).

Both hold seed noise only: a best grid point also sits above the arch's isoFLOP minimum by however far its nearest
size is from it (on a shared ladder, for both sides alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from analysis.records import LEVEL

DRAWS = 100_000  # Monte Carlo draws of best_difference's bounds: quantiles within ~0.5% of their width
Spread = dict[str, Any] | None  # a seed_spread row


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
        One row per budget: budget, sd, lo, hi, dof, source ("measured" at this budget; "from C = ..." when pooled
        over the budgets that have replicates; None with sd None when no grid point has two seeds anywhere).
    """
    has_seeds = "seed" in points and points["seed"].notna().any()
    key = ["arch", "budget", "n"]
    every = _pooled(points.groupby(key, dropna=False)["loss"]) if has_seeds else None
    replicated = points[points.duplicated(key, keep=False)] if has_seeds else points.iloc[:0]
    borrowed = "from C = " + ", ".join(f"{b:.3g}" for b in sorted(set(replicated["budget"])))
    rows = []
    for b, g in points.groupby("budget", sort=True):
        here = _pooled(g.groupby(key, dropna=False)["loss"]) if has_seeds else None
        sd_dof, source = (here, "measured") if here else (every, borrowed) if every else (None, None)
        row = {"budget": float(b), "sd": None, "lo": None, "hi": None, "dof": None, "source": source}
        if sd_dof:
            sd, dof = sd_dof
            lo_q, hi_q = stats.chi2.ppf([(1 + level) / 2, (1 - level) / 2], dof)
            row.update(sd=sd, lo=sd * np.sqrt(dof / lo_q), hi=sd * np.sqrt(dof / hi_q), dof=dof)
        rows.append(row)
    return rows


def arch_spreads(points: pd.DataFrame) -> dict[str, dict[float, dict[str, Any]]]:
    """Each arch's own ``seed_spread``, by arch and budget: what a comparison of archs uses."""
    return {a: {r["budget"]: r for r in seed_spread(g)} for a, g in points.groupby("arch")}


def seed_means(points: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    """Per ``key`` group: the mean loss over its seeds (``loss``) and how many there were (``seeds``)."""
    return points.groupby(key, sort=True, dropna=False)["loss"].agg(loss="mean", seeds="count").reset_index()


def best_points(points: pd.DataFrame, key: tuple[str, ...] = ("n",)) -> pd.DataFrame:
    """Per (arch, budget): the size (``key`` columns) with the lowest seed-mean loss, that loss and its seeds."""
    means = seed_means(points, ["arch", "budget", *key])
    return means.loc[means.groupby(["arch", "budget"])["loss"].idxmin()].reset_index(drop=True)


def _measured(*spreads: Spread) -> bool:
    return all(s is not None and s["sd"] is not None for s in spreads)


def _result(diff: float, lo: float | None, hi: float | None, a: Spread, b: Spread) -> dict[str, Any]:
    """diff, lo, hi, sd (each side's spread), source (where they were measured) and verdict: "lower" or "higher"
    when the interval excludes 0, "within noise" when it holds it, "noise not measured" without both spreads."""
    if lo is None or hi is None:
        return {"diff": diff, "lo": None, "hi": None, "sd": None, "source": None, "verdict": "noise not measured"}
    sources = {a["source"], b["source"]}
    source = sources.pop() if len(sources) == 1 else f"{a['source']}; baseline {b['source']}"
    verdict = "lower" if hi < 0 else "higher" if lo > 0 else "within noise"
    return {"diff": diff, "lo": float(lo), "hi": float(hi), "sd": (a["sd"], b["sd"]), "source": source,
            "verdict": verdict}  # fmt: skip


def difference(a: tuple[float, int], b: tuple[float, int], spread_a: Spread, spread_b: Spread,
               level: float = LEVEL) -> dict[str, Any]:  # fmt: skip
    """Seed-mean loss ``a`` minus ``b`` (each (loss, seeds)) with Welch's ``level`` interval from each side's
    ``seed_spread`` row; returns ``_result``'s dict."""
    diff = float(a[0] - b[0])
    if not _measured(spread_a, spread_b):
        return _result(diff, None, None, spread_a, spread_b)
    va, vb = spread_a["sd"] ** 2 / a[1], spread_b["sd"] ** 2 / b[1]
    dof = (va + vb) ** 2 / (va**2 / spread_a["dof"] + vb**2 / spread_b["dof"]) if va + vb > 0 else 1.0
    half = stats.t.ppf((1 + level) / 2, dof) * np.sqrt(va + vb)
    return _result(diff, diff - half, diff + half, spread_a, spread_b)


def best_difference(a: Sequence[tuple[float, int]], b: Sequence[tuple[float, int]], spread_a: Spread,
                    spread_b: Spread, level: float = LEVEL) -> dict[str, Any]:  # fmt: skip
    """The lowest of ``a``'s seed means minus the lowest of ``b``'s (each a list of (loss, seeds), one per size),
    with the interval of the module docstring; returns ``_result``'s dict."""
    diff = float(min(x for x, _ in a) - min(x for x, _ in b))
    if not _measured(spread_a, spread_b):
        return _result(diff, None, None, spread_a, spread_b)
    rng = np.random.default_rng(0)

    def errors(sizes: Sequence[tuple[float, int]], spread: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """(the lowest of the sizes' seed-mean errors, the error of the size with the fewest seeds) per draw: the
        truly best size's error is one size's, and the fewest seeds make the widest (a safe bound)."""
        n = np.array([k for _, k in sizes], dtype=float)
        sd = spread["sd"] * np.sqrt(spread["dof"] / rng.chisquare(spread["dof"], DRAWS))  # sds the data allow
        err = rng.standard_normal((DRAWS, len(n))) * sd[:, None] / np.sqrt(n)
        return err.min(axis=1), err[:, n.argmin()]

    (low_a, one_a), (low_b, one_b) = errors(a, spread_a), errors(b, spread_b)
    q_low, q_high = np.quantile(low_a - one_b, (1 - level) / 2), np.quantile(one_a - low_b, (1 + level) / 2)
    return _result(diff, diff - q_high, diff - q_low, spread_a, spread_b)


def compare_to_dense(points: pd.DataFrame, dense: str = "dense") -> list[dict[str, Any]]:
    """Per budget and arch other than ``dense``: its best loss minus dense's (``best_difference``).

    Returns:
        Rows of budget, arch, best, dense_best and ``best_difference``'s diff, lo, hi, sd, source and verdict.
    """
    means = seed_means(points, ["arch", "budget", "n"])
    at = {(a, b): list(zip(g["loss"], g["seeds"], strict=True)) for (a, b), g in means.groupby(["arch", "budget"])}
    spreads = arch_spreads(points)
    rows = []
    for (arch, b), sizes in sorted(at.items()):
        if arch == dense or (dense, b) not in at:
            continue
        d = best_difference(sizes, at[(dense, b)], spreads[arch].get(b), spreads[dense].get(b))
        best, dense_best = min(x for x, _ in sizes), min(x for x, _ in at[(dense, b)])
        rows.append({"budget": float(b), "arch": arch, "best": float(best), "dense_best": float(dense_best), **d})
    return rows


def noise_tables(points: pd.DataFrame) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the seed spreads: per budget over every arch ("every arch") and each arch's own where measured, by budget;
    ``compare_to_dense``) of a sweep's val_loss series (no ``:causal``)."""
    plain = points[~points["arch"].str.endswith(":causal")]
    spreads = [{"arch": "every arch", **r} for r in seed_spread(plain)]
    spreads += [
        {"arch": a, **r} for a, by in arch_spreads(plain).items() for r in by.values() if r["source"] == "measured"
    ]
    return sorted(spreads, key=lambda r: (r["budget"], r["arch"] != "every arch")), compare_to_dense(plain)
