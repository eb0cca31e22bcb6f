"""The papers' claims checked against one sweep: each reproduced, refuted or not resolved at its scale, with the
seed noise beside every difference.

A comparison of two archs at a budget takes seed-mean held-out losses and each arch's own seed spread
(``analysis.noise``), either of each arch's best size (equal training FLOPs: the isoFLOP-optimal grid points as the
sweep sampled them) or at one shape both trained, the baseline's best of those (equal FLOPs and equal shape: "equal
parameters" up to the variant's own few). Either way ``noise.best_difference`` gives the interval, which holds the
luck of a lowest mean picked from several noisy ones. Every verdict comes from a 90% interval: the claim is
reproduced when the interval lies on its side, refuted when it lies on the other, and not resolved when it reaches
across or no seed spread was measured. Each verdict then points the wrong way with probability at most about 5%
(about 10% for a verdict at all when nothing differs), so of many rows a few may do so by chance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from scipy import stats

from analysis.noise import arch_spreads, best_difference, best_points, seed_means, seed_spread
from analysis.records import LEVEL

if TYPE_CHECKING:
    from analysis.pipeline import SweepFits

SHAPE = ["d_model", "n_layers"]
PREDICTOR_ACCURACY = 0.97  # MoD Fig. 6: the causal predictor's accuracy
SMALL_CHANGE = 0.01  # "a small loss change": causal routing's loss at most 1% above top-k's


@dataclass(frozen=True)
class Comparison:
    """A paper's claim that ``arch`` reaches a lower loss than ``than``; ``match``: "best" sizes or one "shape"."""

    claim: str
    arch: str
    than: str
    match: str


COMPARISONS = (
    Comparison("MoD beats the isoFLOP-optimal dense model at equal training FLOPs (MoD Fig. 4)", "mod", "dense",
               "best"),
    Comparison("learned routing beats random routing at equal capacity (MoD Fig. 3)", "mod", "mod_random", "shape"),
    Comparison("MoDA (attention depth K/V) lowers loss at equal parameters (MoDA Table 3)", "moda_attn", "dense",
               "shape"),
    Comparison("FFN depth K/V lowers MoDA's loss further (MoDA Table 3)", "moda", "moda_attn", "shape"),
    Comparison("staged MoDE beats MoD at equal training FLOPs (MoD Sec. 4.3)", "mode", "mod", "best"),
    Comparison("integrated MoDE beats MoD at equal training FLOPs (MoD Sec. 4.3)", "mode_integrated", "mod", "best"),
)  # fmt: skip
PREDICTOR_CLAIM = "the causal predictor reaches > 97% accuracy with a small loss change (< 1%) from top-k (MoD Fig. 6)"
FORECAST_CLAIM = "the largest budget's optimal loss is forecast from the smaller budgets"


@dataclass(frozen=True)
class ClaimRow:
    """One claim at one budget (or one forecast).

    Attributes:
        claim: the paper's statement and where it is made.
        budget: the budget C it was checked at.
        compared: what was compared (archs, shapes, seeds; diverged runs left out).
        measured: the measured values, as text (a forecast: predicted with its interval, and measured).
        diff, lo, hi: the difference (arch minus baseline; causal minus top-k) and its 90% interval (None where
            there is none; a forecast's interval is in ``measured``).
        sd: the seed spreads the interval came from, the arch's and the baseline's (None: not measured).
        sd_source: where that spread was measured: "measured" at this budget, or "from C = ..." (borrowed).
        verdict: "reproduced", "refuted" or "not resolved", with why after a colon where it is not plain.
    """

    claim: str
    budget: float | None
    compared: str
    measured: str
    diff: float | None
    lo: float | None
    hi: float | None
    sd: tuple[float, ...] | None
    verdict: str
    sd_source: str | None = None


def _row(claim: str, b: float | None, compared: str, measured: str, d: dict[str, Any], verdict: str) -> ClaimRow:
    return ClaimRow(claim, b, compared, measured, d["diff"], d["lo"], d["hi"], d["sd"], verdict, d["source"])


def _unresolved(claim: str, b: float | None, compared: str, why: str) -> ClaimRow:
    return ClaimRow(claim, b, compared, "–", None, None, None, None, f"not resolved: {why}")


def _shape(r: pd.Series | dict[str, Any], seeds: int | None = None) -> str:
    n = int(r["seeds"] if seeds is None else seeds)
    shape = "" if pd.isna(r["d_model"]) else f"d {int(r['d_model'])} x {int(r['n_layers'])} "  # NULL: not recorded
    return f"{shape}(N {r['n']:.3g}, {n} seed{'s' if n > 1 else ''})"


def _verdict(d: dict[str, Any]) -> str:
    return {"lower": "reproduced", "higher": "refuted", "within noise": "not resolved: within noise",
            "noise not measured": "not resolved: seed noise not measured"}[d["verdict"]]  # fmt: skip


def _diverged(failed: pd.DataFrame, archs: tuple[str, ...], b: float) -> str:
    """The note that k runs of ``archs`` at budget ``b`` diverged and are left out (a size whose runs all diverged
    has no mean), or ""."""
    k = int((failed["arch"].isin(archs) & (failed["budget"] == b)).sum())
    return f"; {k} diverged run{'s' if k > 1 else ''} left out" if k else ""


def _compare(runs: pd.DataFrame, failed: pd.DataFrame, c: Comparison) -> list[ClaimRow]:
    if missing := [a for a in (c.arch, c.than) if a not in set(runs["arch"])]:
        return [
            _unresolved(c.claim, None, f"{c.arch} vs {c.than}", f"the sweep has no {' and no '.join(missing)} runs")
        ]
    means = seed_means(runs, ["arch", "budget", "n", *SHAPE])
    spreads = arch_spreads(runs)
    rows = []
    for b in sorted(set(means.loc[means["arch"].isin([c.arch, c.than]), "budget"])):
        mine, base = (means[(means["arch"] == a) & (means["budget"] == b)] for a in (c.arch, c.than))
        names = f"{c.arch} vs {c.than}"
        if mine.empty or base.empty:
            rows.append(_unresolved(c.claim, b, names, f"no {c.arch if mine.empty else c.than} runs at this budget"))
            continue
        if c.match == "shape":  # the baseline's best of the shapes both trained, and the arch at that shape
            if any(p[SHAPE].isna().any(axis=None) for p in (mine, base)):
                rows.append(_unresolved(c.claim, b, names, "shapes not recorded"))
                continue
            base = base.merge(mine[SHAPE], on=SHAPE)
            if base.empty:
                rows.append(_unresolved(c.claim, b, names, "no shape trained by both at this budget"))
                continue
            mine = mine.merge(base.loc[[base["loss"].idxmin()], SHAPE], on=SHAPE)
        sizes = [list(zip(p["loss"], p["seeds"], strict=True)) for p in (mine, base)]
        d = best_difference(*sizes, spreads[c.arch].get(b), spreads[c.than].get(b))
        mine, base = (p.loc[p["loss"].idxmin()] for p in (mine, base))
        compared = f"{c.arch} {_shape(mine)} vs {c.than} {_shape(base)}" + _diverged(failed, (c.arch, c.than), b)
        rows.append(_row(c.claim, b, compared, f"{mine['loss']:.4g} vs {base['loss']:.4g}", d, _verdict(d)))
    return rows


def _mean_interval(values: pd.Series, spread: dict[str, Any] | None) -> tuple[float, float] | None:
    """The ``LEVEL`` t interval of the mean of ``values`` (one per seed) from a ``seed_spread`` row."""
    if spread is None or spread["sd"] is None:
        return None
    half = stats.t.ppf((1 + LEVEL) / 2, spread["dof"]) * spread["sd"] / np.sqrt(len(values))
    return float(values.mean() - half), float(values.mean() + half)


def _predictor(runs: pd.DataFrame, failed: pd.DataFrame, arch: str = "mod") -> list[ClaimRow]:
    """At each budget MoD's best size (lowest top-k loss): its predictor's accuracy and its loss under causal
    routing minus under top-k, each run's own change (the same weights on the same held-out tokens), with their
    seed spreads (``seed_spread`` of the accuracy and of the change, measured where that point's seeds repeat).
    Reproduced when the accuracy's interval lies above 97% and the change's below 1% of the top-k loss; refuted
    when either lies on the other side; else not resolved."""
    mod = runs[(runs["arch"] == arch) & runs["loss_causal"].notna() & runs["predictor_accuracy"].notna()]
    if mod.empty:
        why = f"the sweep has no {arch} runs" if arch not in set(runs["arch"]) else "no run recorded the predictor"
        return [_unresolved(PREDICTOR_CLAIM, None, arch, why)]
    mod = mod.assign(change=mod["loss_causal"] - mod["loss"])
    spreads = {
        col: {r["budget"]: r for r in seed_spread(mod.assign(loss=mod[col]))}
        for col in ("change", "predictor_accuracy")
    }
    rows = []
    for _, best in best_points(mod, ("n", *SHAPE)).iterrows():
        b = best["budget"]
        g = mod[(mod["budget"] == b) & (mod["n"] == best["n"])]
        acc, topk, change = g["predictor_accuracy"], g["loss"].mean(), g["change"]
        acc_ci, change_ci = (
            _mean_interval(acc, spreads["predictor_accuracy"][b]),
            _mean_interval(change, spreads["change"][b]),
        )
        small = SMALL_CHANGE * topk
        if acc_ci and acc_ci[1] <= PREDICTOR_ACCURACY:
            verdict = f"refuted: accuracy {acc.mean():.2%} [{acc_ci[0]:.2%}, {acc_ci[1]:.2%}] <= 97%"
        elif change_ci and change_ci[0] > small:
            verdict = f"refuted: the causal loss is more than 1% ({small:.3g} nats) above top-k's"
        elif acc_ci and change_ci and acc_ci[0] > PREDICTOR_ACCURACY and change_ci[1] < small:
            verdict = "reproduced"
        elif not (acc_ci and change_ci):
            verdict = "not resolved: seed noise of the accuracy and the loss change not measured"
        else:
            verdict = f"not resolved: an interval reaches 97% accuracy or 1% ({small:.3g} nats) of loss change"
        acc_text = f"accuracy {acc.mean():.2%}" + (f" [{acc_ci[0]:.2%}, {acc_ci[1]:.2%}]" if acc_ci else "")
        measured = f"{acc_text}; causal {g['loss_causal'].mean():.4g} vs top-k {topk:.4g}"
        s = spreads["change"][b]
        d = {"diff": float(change.mean()), "lo": change_ci[0] if change_ci else None,
             "hi": change_ci[1] if change_ci else None, "sd": (s["sd"],) if change_ci else None,
             "source": s["source"]}  # fmt: skip
        compared = f"{arch} {_shape(g.iloc[0], len(g))}" + _diverged(failed, (arch,), b)
        rows.append(_row(PREDICTOR_CLAIM, b, compared, measured, d, verdict))
    return rows


def _forecasts(fits: SweepFits, runs: pd.DataFrame) -> list[ClaimRow]:
    """Each plain series' forecast of its held-out budget's L*: reproduced when the measured vertex lies in the 90%
    prediction interval (which holds the measurement's noise) and that interval lies below the series' best loss
    at the largest fitted budget (else it does not even say that the loss falls: not resolved)."""
    best = best_points(runs).set_index(["arch", "budget"])["loss"]
    none = {"diff": None, "lo": None, "hi": None, "sd": None, "source": None}
    rows = []
    for a in fits.archs:
        if a.arch.endswith(":causal"):
            continue
        for f in a.forecasts:
            compared = f"{a.arch}, {f.method} fitted on C = {', '.join(f'{b:.3g}' for b in f.fit_budgets)}"
            if f.loss_pred is None or f.loss_lo is None or f.loss_obs is None:
                why = f.why or ("no measured vertex" if f.loss_obs is None else "no interval")
                rows.append(_unresolved(FORECAST_CLAIM, f.budget, compared, why))
                continue
            measured = f"predicted {f.loss_pred:.4g} [{f.loss_lo:.4g}, {f.loss_hi:.4g}], measured {f.loss_obs:.4g}"
            at = max(f.fit_budgets)
            last = best.get((a.arch, at))
            if not f.loss_lo <= f.loss_obs <= f.loss_hi:
                verdict = "refuted: measured outside the interval"
            elif last is None:
                verdict = f"not resolved: no run at C = {at:.3g} to say whether the interval is below it"
            elif f.loss_hi >= last:
                verdict = f"not resolved: the interval reaches the best loss at C = {at:.3g} ({last:.4g})"
            else:
                verdict = "reproduced"
            rows.append(_row(FORECAST_CLAIM, f.budget, compared, measured, none, verdict))
    return rows


def check(runs: pd.DataFrame, fits: SweepFits | None = None) -> list[ClaimRow]:
    """Every claim the sweep's archs bear on.

    Args:
        runs: ``store.load_claim_runs`` rows (arch, budget, d_model, n_layers, n, seed, loss, loss_causal,
            predictor_accuracy; a diverged run with a NULL loss, which is left out and counted).
        fits: the sweep's fits, for the forecast rows.

    Returns:
        Rows in claim order, by budget; a claim about an arch the sweep did not train: one row saying so.
    """
    ok, failed = runs[runs["loss"].notna()], runs[runs["loss"].isna()]
    rows = [row for c in COMPARISONS for row in _compare(ok, failed, c)] + _predictor(ok, failed)
    return rows + (_forecasts(fits, ok) if fits is not None else [])
