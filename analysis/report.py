"""Markdown report of one sweep: summary, runs per budget, both approaches with CIs, figures, notes."""

from __future__ import annotations

import datetime as dt
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from analysis.records import PowerLaw

if TYPE_CHECKING:
    from analysis.pipeline import SweepFits


def _g(v: float | None, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{v:.{digits}g}"


def _ci(ci: tuple[float, float] | None, digits: int = 4) -> str:
    return "–" if ci is None else f"[{_g(ci[0], digits)}, {_g(ci[1], digits)}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
    return out + [""]


def _runs_table(points: pd.DataFrame) -> list[str]:
    rows = []
    for (arch, budget), g in points.groupby(["arch", "budget"], sort=True):
        best = g.loc[g["loss"].idxmin()]
        rows.append([
            arch, _g(budget, 3), len(g), f"{_g(g['n'].min(), 3)} – {_g(g['n'].max(), 3)}",
            _g(best["loss"]), _g(best["n"], 3), _g(best["d"], 3),
        ])  # fmt: skip
    return _table(["series", "budget C (FLOPs)", "runs", "N range", "best loss (nats)", "N at best", "D at best"], rows)


def _law_row(arch: str, name: str, law: PowerLaw | None, used: int) -> list[str]:
    if law is None:
        return [arch, name, "–", "–", "–", "–", str(used)]
    if law.ci_exponent is None:
        return [arch, name, _g(law.k), _g(law.exponent), f"not identified ({law.why})", "not identified", str(used)]
    return [arch, name, _g(law.k), _g(law.exponent), _ci(law.ci_exponent), _ci(law.ci_k), str(used)]


def _pm(pred: float | None, lo: float | None, hi: float | None) -> str:
    if pred is None:
        return "not identified"
    return f"{_g(pred)} [{_g(lo)}, {_g(hi)}]" if lo is not None else f"{_g(pred)} (interval not identified)"


def _forecast_lines(fits: SweepFits) -> list[str]:
    rows = []
    for a in fits.archs:
        for f in a.forecasts:
            held = {None: "–", True: "yes", False: "**no**"}[f.inside]
            rows.append([
                a.arch, _g(f.budget, 3), f.method, ", ".join(_g(b, 3) for b in f.fit_budgets),
                _pm(f.loss_pred, f.loss_lo, f.loss_hi), _g(f.loss_obs), held,
                _pm(f.n_pred, f.n_lo, f.n_hi), _g(f.n_obs, 3), f.why or "–",
            ])  # fmt: skip
    if not rows:
        return ["No forecast (a series needs the held-out budgets plus 2 more).", ""]
    head = ["series", "held-out C", "method", "fitted on C", "L* predicted [90%]", "L* measured", "inside",
            "N* predicted [90%]", "N* measured", "notes"]  # fmt: skip
    return _table(head, rows)


def build_report(
    fits: SweepFits,
    points: pd.DataFrame,
    summary: Mapping[str, Any],
    figures: Mapping[str, Path],
    notes: Sequence[str] = (),
    base: Path | None = None,
) -> str:
    """Markdown text of the report.

    Args:
        fits: the sweep's fits.
        points: series points (``pipeline.series_points``: arch is the series, ``loss`` the fitted loss).
        summary: ``store.sweep_summary`` output.
        figures: name -> PNG path; keys ending in "_plot" are embedded.
        notes: global notes (e.g. figures skipped).
        base: folder the report is written to; figure links are relative to it.
    """
    lines = [f"# Scaling-law report: sweep {summary.get('sweep_id')}", ""]
    status = ", ".join(f"{k}: {v}" for k, v in summary.get("runs_by_status", {}).items()) or "none"
    lines += [
        f"- name: {summary.get('name') or '–'}; preset: {summary.get('preset') or '–'};"
        f" created: {summary.get('created_at') or '–'}",
        f"- runs by status: {status}; devices: {', '.join(summary.get('devices') or []) or '–'}",
        f"- fitted series: {', '.join(a.arch for a in fits.archs) or 'none'}"
        " (N = non-embedding parameters, D = tokens trained, C = the sweep's budget, loss in nats)",
        f"- generated: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        "## Runs per budget",
        "",
    ]
    lines += _runs_table(points) if not points.empty else ["No finished runs.", ""]

    lines += ["## Approach 2: isoFLOP parabolas", ""]
    lines += [
        "Robust (soft-L1) parabola of loss against ln N per budget; ★ inside = the vertex is a minimum lying",
        "within the sampled N range (only those budgets enter the power laws). D* is interpolated in",
        "(ln N, ln D) between the budget's runs. One budget's vertex has no interval of its own (three sizes",
        "leave no residual to estimate noise from); the power laws' intervals below hold its noise.",
        "",
    ]
    rows = []
    for a in fits.archs:
        for p in a.isoflop.parabolas if a.isoflop else ():
            rows.append([
                a.arch, _g(p.budget, 3), p.n_points, _g(p.n_opt), _g(p.d_opt), _g(p.loss_opt),
                _g(p.curvature, 3), "yes" if p.vertex_inside else "**no**",
            ])  # fmt: skip
    head = ["series", "budget C (FLOPs)", "points", "N*", "D*", "L* (nats)", "curvature", "vertex inside"]
    lines += _table(head, rows) if rows else ["No budget had 3 runs.", ""]

    lines += ["## Approach 2: power laws", ""]
    lines += [
        "Least squares in log-log over the inside vertices; 90% t intervals from the vertices' scatter about the",
        "law (dof = budgets - 2): with 2 budgets there is no scatter and the intervals are not identified.",
        "",
    ]
    rows = []
    for a in fits.archs:
        iso = a.isoflop
        if iso is None:
            continue
        used = len(iso.budgets_used)
        rows.append(_law_row(a.arch, "N*(C)", iso.n_opt, used))
        rows.append(_law_row(a.arch, "D*(C)", iso.d_opt, used))
        rows.append(_law_row(a.arch, "L*(C)", iso.loss_opt, used))
    head = ["series", "law", "k", "exponent", "exponent 90% interval", "k 90% interval", "budgets"]
    lines += _table(head, rows) if rows else ["No power laws (fewer than 2 budgets with an inside vertex).", ""]

    lines += ["## Approach 3: parametric fit L = E + A/N^α + B/D^β", ""]
    lines += [
        "Huber (δ = 1e-3) on log-loss residuals, summed over runs; bounded L-BFGS-B from the best starts of a",
        "grid; 90% Wald t intervals in brackets (dof = runs - 5). a = β/(α+β) is the implied exponent of N*(C).",
        "A fit the data do not identify (fewer than 10 runs, a parameter on its bound, an interval wider than",
        "its estimate) shows no numbers.",
        "",
    ]
    rows = []
    for a in fits.archs:
        p = a.parametric
        if p is None:
            continue
        if not p.identified:
            rows.append([a.arch, f"not identified: {p.why}", "", "", "", "", "", "", p.n_points])
            continue
        cell = {k: f"{_g(getattr(p, k))} {_ci(p.ci.get(k), 3)}" for k in ("E", "A", "B", "alpha", "beta", "a")}
        rows.append([
            a.arch, cell["E"], cell["A"], cell["B"], cell["alpha"], cell["beta"], cell["a"], _g(p.objective),
            p.n_points,
        ])  # fmt: skip
    head = ["series", "E", "A", "B", "α", "β", "a", "objective", "points"]
    lines += _table(head, rows) if rows else ["No parametric fit (too few runs).", ""]

    lines += ["## Forecast of held-out budgets", ""]
    lines += [
        "Each law is fitted without the largest budget(s) and predicts their optimum; measured = the held-out",
        "budget's own parabola vertex. Intervals are 90% prediction intervals of that measurement",
        "(analysis/forecast.py says how each is made).",
        "",
    ]
    lines += _forecast_lines(fits)

    figs = [(k, v) for k, v in figures.items() if k.endswith("_plot")]
    if figs:
        lines += ["## Figures", ""]
        for name, path in figs:
            rel = os.path.relpath(path, base) if base is not None else str(path)
            lines += [f"![{name}]({rel})", ""]

    all_notes = [f"{a.arch}: {n}" for a in fits.archs for n in a.notes] + list(notes)
    if all_notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in all_notes] + [""]
    return "\n".join(lines)


def write_report(
    out: str | os.PathLike,
    fits: SweepFits,
    points: pd.DataFrame,
    summary: Mapping[str, Any],
    figures: Mapping[str, Path],
    notes: Sequence[str] = (),
) -> Path:
    """Write ``build_report`` to ``out`` (figure links relative to its folder) and return the path."""
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(build_report(fits, points, summary, figures, notes, base=p.parent))
    return p
