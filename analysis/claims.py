"""The papers' claims checked against one sweep: each reproduced, refuted or not resolved at its scale, with the
seed noise beside every difference.

A comparison of two archs at a budget takes seed-mean held-out losses (``analysis.noise``): either each arch's
best size (equal training FLOPs: the isoFLOP-optimal models as the sweep sampled them) or one shape for both, of
the shapes both trained the one best for the baseline (equal FLOPs and equal shape: "equal parameters" up to the
variant's own few). The
difference gets the 90% t interval of ``noise.difference``: the claim is reproduced when the interval lies on its
side of 0, refuted when it lies on the other, and not resolved when it holds 0 or no seed spread was measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from analysis.noise import best_points, difference, seed_means, seed_spread

if TYPE_CHECKING:
    from analysis.pipeline import SweepFits

SHAPE = ["d_model", "n_layers"]
PREDICTOR_ACCURACY = 0.97  # MoD Fig. 6: the causal predictor's accuracy


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
PREDICTOR_CLAIM = "the causal predictor reaches > 97% accuracy with a small loss change from top-k (MoD Fig. 6)"
FORECAST_CLAIM = "the largest budget's optimal loss is forecast from the smaller budgets"


@dataclass(frozen=True)
class ClaimRow:
    """One claim at one budget (or one forecast).

    Attributes:
        claim: the paper's statement and where it is made.
        budget: the budget C it was checked at.
        compared: what was compared (archs, shapes, seeds).
        measured: the measured values, as text.
        diff, lo, hi: the difference (arch minus baseline; causal minus top-k; forecast: measured minus predicted)
            and its 90% interval (None where there is none).
        sd: the seed spread the interval came from (None: not measured).
        verdict: "reproduced", "refuted" or "not resolved", with why after a colon where it is not plain.
    """

    claim: str
    budget: float | None
    compared: str
    measured: str
    diff: float | None
    lo: float | None
    hi: float | None
    sd: float | None
    verdict: str


def _shape(r: pd.Series | dict[str, Any], seeds: int | None = None) -> str:
    n = int(r["seeds"] if seeds is None else seeds)
    shape = "" if pd.isna(r["d_model"]) else f"d {int(r['d_model'])} x {int(r['n_layers'])} "  # NULL: not recorded
    return f"{shape}(N {r['n']:.3g}, {n} seed{'s' if n > 1 else ''})"


def _verdict(d: dict[str, Any]) -> str:
    return {"lower": "reproduced", "higher": "refuted", "within noise": "not resolved: within noise",
            "noise not measured": "not resolved: seed noise not measured"}[d["verdict"]]  # fmt: skip


def _compare(runs: pd.DataFrame, spread: dict[float, dict[str, Any]], c: Comparison) -> list[ClaimRow]:
    best = best_points(runs, ("n", *SHAPE)).set_index(["arch", "budget"])
    means = seed_means(runs, ["arch", "budget", "n", *SHAPE]).set_index(["arch", "budget", *SHAPE])
    if missing := [a for a in (c.arch, c.than) if a not in set(runs["arch"])]:
        return [ClaimRow(c.claim, None, f"{c.arch} vs {c.than}", "–", None, None, None, None,
                         f"not resolved: the sweep has no {' and no '.join(missing)} runs")]  # fmt: skip
    rows = []
    for b in sorted({b for a, b in best.index if a in (c.arch, c.than)}):
        if (c.arch, b) not in best.index or (c.than, b) not in best.index:
            missing = c.arch if (c.arch, b) not in best.index else c.than
            rows.append(ClaimRow(c.claim, b, f"{c.arch} vs {c.than}", "–", None, None, None, None,
                                 f"not resolved: no {missing} runs at this budget"))  # fmt: skip
            continue
        if c.match == "best":
            mine, base = best.loc[(c.arch, b)], best.loc[(c.than, b)]
        else:  # the shape both trained at b where the baseline's loss is lowest
            pair = [means.xs((a, b), level=["arch", "budget"]) for a in (c.arch, c.than)]
            shared = pair[1].loc[pair[1].index.intersection(pair[0].index)]
            if shared.empty:
                rows.append(ClaimRow(c.claim, b, f"{c.arch} vs {c.than}", "–", None, None, None, None,
                                     "not resolved: no shape trained by both at this budget"))  # fmt: skip
                continue
            shape = shared["loss"].idxmin()
            mine, base = (pd.Series({**x.loc[shape], **dict(zip(SHAPE, shape, strict=True))}) for x in pair)
        d = difference((mine["loss"], mine["seeds"]), (base["loss"], base["seeds"]), spread.get(b))
        compared = f"{c.arch} {_shape(mine)} vs {c.than} {_shape(base)}"
        measured = f"{mine['loss']:.4g} vs {base['loss']:.4g}"
        rows.append(ClaimRow(c.claim, b, compared, measured, d["diff"], d["lo"], d["hi"], d["sd"], _verdict(d)))
    return rows


def _predictor(runs: pd.DataFrame, spread: dict[float, dict[str, Any]], arch: str = "mod") -> list[ClaimRow]:
    """At each budget MoD's best size: its predictor's accuracy and its causal loss minus its top-k loss. The change
    is small when it is within seed noise (its interval from the seed spread holds 0, as if the two were losses of
    independent runs: a paired change is less noisy, so this errs towards calling it small)."""
    mod = runs[(runs["arch"] == arch) & runs["loss_causal"].notna() & runs["predictor_accuracy"].notna()]
    if mod.empty:
        why = f"the sweep has no {arch} runs" if arch not in set(runs["arch"]) else "no run recorded the predictor"
        return [ClaimRow(PREDICTOR_CLAIM, None, arch, "–", None, None, None, None, f"not resolved: {why}")]
    rows = []
    for _, best in best_points(mod, ("n", *SHAPE)).iterrows():
        b = best["budget"]
        g = mod[(mod["budget"] == b) & (mod[["n", *SHAPE]] == best[["n", *SHAPE]]).all(axis=1)]
        acc, n = g["predictor_accuracy"], len(g)
        causal, topk = g["loss_causal"].mean(), g["loss"].mean()
        d = difference((causal, n), (topk, n), spread.get(b))
        acc_text = f"accuracy {acc.mean():.2%}" + (f" (min {acc.min():.2%})" if n > 1 else "")
        if acc.min() <= PREDICTOR_ACCURACY:
            verdict = f"refuted: accuracy {acc.min():.2%} <= 97%"
        elif d["verdict"] in ("within noise", "lower"):
            verdict = "reproduced"
        elif d["verdict"] == "higher":
            verdict = "refuted: the causal loss is higher beyond seed noise"
        else:
            verdict = "not resolved: accuracy > 97%, seed noise not measured for the loss change"
        compared = f"{arch} {_shape(g.iloc[0], n)}"
        rows.append(ClaimRow(PREDICTOR_CLAIM, b, compared, f"{acc_text}; causal {causal:.4g} vs top-k {topk:.4g}",
                             d["diff"], d["lo"], d["hi"], d["sd"], verdict))  # fmt: skip
    return rows


def _forecasts(fits: SweepFits, runs: pd.DataFrame) -> list[ClaimRow]:
    """Each plain series' forecast of its held-out budget's L*: reproduced when the measured vertex lies in the 90%
    prediction interval (which holds the measurement's noise) and that interval lies below the series' best loss
    at the largest fitted budget (else it does not even say that the loss falls: not resolved)."""
    best = best_points(runs).set_index(["arch", "budget"])["loss"]
    rows = []
    for a in fits.archs:
        if a.arch.endswith(":causal"):
            continue
        for f in a.forecasts:
            compared = f"{a.arch}, {f.method} fitted on C = {', '.join(f'{b:.3g}' for b in f.fit_budgets)}"
            if f.loss_pred is None or f.loss_lo is None or f.loss_obs is None:
                why = f.why or ("no measured vertex" if f.loss_obs is None else "no interval")
                rows.append(ClaimRow(FORECAST_CLAIM, f.budget, compared, "–", None, None, None, None,
                                     f"not resolved: {why}"))  # fmt: skip
                continue
            measured = f"predicted {f.loss_pred:.4g} [{f.loss_lo:.4g}, {f.loss_hi:.4g}], measured {f.loss_obs:.4g}"
            last = best.get((a.arch, max(f.fit_budgets)))
            if not f.loss_lo <= f.loss_obs <= f.loss_hi:
                verdict = "refuted: measured outside the interval"
            elif last is not None and f.loss_hi >= last:
                at = f"C = {max(f.fit_budgets):.3g} ({last:.4g})"
                verdict = f"not resolved: the interval reaches the best loss at {at}"
            else:
                verdict = "reproduced"
            rows.append(ClaimRow(FORECAST_CLAIM, f.budget, compared, measured, f.loss_obs - f.loss_pred,
                                 f.loss_lo - f.loss_pred, f.loss_hi - f.loss_pred, None, verdict))  # fmt: skip
    return rows


def check(runs: pd.DataFrame, fits: SweepFits | None = None) -> list[ClaimRow]:
    """Every claim the sweep's archs bear on.

    Args:
        runs: ``store.load_claim_runs`` rows (arch, budget, d_model, n_layers, n, seed, loss, loss_causal,
            predictor_accuracy).
        fits: the sweep's fits, for the forecast rows.

    Returns:
        Rows in claim order, by budget; a claim about an arch the sweep did not train: one row saying so.
    """
    spread = {r["budget"]: r for r in seed_spread(runs)}
    rows = [row for c in COMPARISONS for row in _compare(runs, spread, c)] + _predictor(runs, spread)
    return rows + (_forecasts(fits, runs) if fits is not None else [])
