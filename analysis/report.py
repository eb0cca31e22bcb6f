"""Markdown report of one sweep: how complete it is, where it came from, runs per budget, both approaches and the
Approach 3 frontier with their intervals, the forecast, seed noise, figures and notes.

Every estimate in the report carries its 90% interval in brackets, or says "not identified" and why. Measured
values (a run's loss, a budget's best run) are single measurements and are labelled so; settings (budgets, sizes,
counts) are exact.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from analysis.records import ParabolaFit, PowerLaw
from analysis.store import time_basis
from mixdepth import usage

if TYPE_CHECKING:
    from analysis.claims import ClaimRow
    from analysis.pipeline import SweepFits

_PASSWORD = re.compile(r"(\w[\w+.-]*://[^/:@\s]*:)[^@/\s]+@")  # scheme://user:PASSWORD@host


def redact(text: str) -> str:
    """``text`` with the password of every URL in it hidden (``scheme://user:***@host``)."""
    return _PASSWORD.sub(r"\1***@", text)


def _g(v: float | None, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{v:.{digits}g}"


def _ci(ci: Sequence[float] | None, digits: int = 4) -> str:
    return "–" if ci is None else f"[{_g(ci[0], digits)}, {_g(ci[1], digits)}]"


def _with_ci(v: float | None, ci: Sequence[float] | None, digits: int = 4) -> str:
    """ "v [lo, hi]", or "v (not identified)" when there is no interval."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{_g(v, digits)} {_ci(ci, digits)}" if ci is not None else f"{_g(v, digits)} (not identified)"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
    return out + [""]


def _header_lines(fits: SweepFits, summary: Mapping[str, Any]) -> list[str]:
    by_status = dict(summary.get("runs_by_status", {}))
    finished, planned = int(summary.get("finished", 0)), summary.get("planned")
    no_status = by_status.pop("unknown", 0)
    counts = ", ".join(f"{k}: {v}" for k, v in by_status.items()) or "none"
    if planned is None:
        done = f"**{finished} runs finished; planned count unknown** (the store does not record the plan)"
    else:  # the finished runs may hold sizes added to bracket an optimum: the store does not say which
        done = f"**{finished} runs finished; {planned} planned** (sizes added to bracket an optimum come on top)"
    lines = [
        f"- {done}",
        f"- runs by status: {counts}; failed attempts stay in the sweep's queue, not here (`python -m sweeps status`)",
    ]
    if no_status:
        lines.append(f"- {no_status} runs recorded without a status")
    if planned is not None and finished < planned:
        lines.append(
            f"- **Partial sweep**: at least {planned - finished} planned runs have not finished; every fit below uses"
            " only the runs that did"
        )
    lines += [
        f"- name: {summary.get('name') or '–'}; preset: {summary.get('preset') or '–'};"
        f" created: {summary.get('created_at') or '–'}; devices: {', '.join(summary.get('devices') or []) or '–'}",
        _corpora_line(summary.get("corpora")),
        _passes_line(summary.get("passes")),
        f"- fitted series: {', '.join(a.arch for a in fits.archs) or 'none'}"
        " (N = non-embedding parameters, D = tokens trained, C = the sweep's budget, loss in nats)",
        '- every estimate carries its 90% interval in brackets or says "not identified"; measured values are'
        " single measurements and say so",
        f"- generated: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
    ]
    return lines


def _corpora_line(corpora: list[tuple[str, str, int]] | None) -> str:
    """The text the runs trained on, by corpus fingerprint: a sweep resumed where ``data.corpus`` reads other text
    (site-packages on another machine, an edited folder) trains its later runs on other data under the same id."""
    if not corpora:
        return "- corpus: not recorded"
    each = "; ".join(f"{name} ({fp}, {n} run{'s' * (n > 1)})" for name, fp, n in corpora)
    if len(corpora) == 1:
        return f"- corpus: {each}"
    return (
        f"- **runs trained on {len(corpora)} corpora**: {each}: their losses were measured on different text, and the"
        " fits and curves mix them"
    )


def _passes_line(p: Mapping[str, Any] | None) -> str:
    """How often the runs went over their corpus's training split (tokens trained / tokens in it: windows are drawn
    at random, so the mean times a token was trained on): past one a held-out loss also measures how well a model
    memorised text it saw again, so such runs' losses are no single-pass scaling data."""
    if not p or not p["recorded"]:
        return "- passes over the corpus: not recorded (the runs predate it)"
    size = f"{p['fewest_tokens']:,}" + (f"-{p['most_tokens']:,}" if p["most_tokens"] != p["fewest_tokens"] else "")
    of = f" of the {p['recorded']} runs whose split is known" if p["recorded"] < p["runs"] else ""
    if p.get("inferred"):  # runs older than the column, sized by a run of the same corpus fingerprint
        of += f" ({p['inferred']} sized by another run of the same corpus fingerprint)"
    line = f"- passes over the corpus's training split ({size} tokens): {p['least']:.3g}-{p['most']:.3g} per run{of}"
    if not p["repeated"]:
        return f"{line}; no run trained on more tokens than it holds"
    return (
        f"{line}; **{p['repeated']} runs went over it more than once**: their held-out losses also measure"
        " memorising a repeated corpus (a larger one: `data.corpus=...`)"
    )


def _provenance_lines(summary: Mapping[str, Any]) -> list[str]:
    def known(key: str, missing: str = "not recorded") -> str:
        v = summary.get(key)
        return missing if v is None or v == "" else str(v)

    command = summary.get("command")
    no_commit = "none (not run from a git checkout)" if summary.get("version") else "not recorded"
    latest = " (its latest command's; each command's under Device use)" if len(summary.get("usage") or []) > 1 else ""
    lines = [
        "## Provenance",
        "",
        f"- mixdepth version: {known('version')}",
        f"- git commit: {known('commit', no_commit)}{latest}",
        f"- command line: {'not recorded' if not command else '`' + redact(str(command)) + '`'}{latest}",
    ]
    for sw in summary.get("software") or []:
        lines.append("- software of the runs: " + ", ".join(f"{k} {v}" for k, v in sorted(sw.items())))
    config = summary.get("config")
    if config:
        text = redact(json.dumps(config, indent=2, sort_keys=True, default=str))
        lines += [
            "",
            "<details><summary>resolved config (as the sweep stored it)</summary>",
            "",
            "```json",
            text,
            "```",
            "",
            "</details>",
        ]
    else:
        lines.append("- resolved config: not recorded")
    return lines + [""]


def _usage_lines(summary: Mapping[str, Any], times: pd.DataFrame | None = None) -> list[str]:
    """Each sweep command's utilisation of its GPUs (FLOPs trained over wall-clock x GPUs x peak, from the command's
    start to its report) and where its time went; with several commands, the sweep's over all of them; with every
    run's shape timed alone (``times``' alone_s), what its runs' own steps one after another would have taken."""
    rows = summary.get("usage") or []
    if not rows:
        return []
    lines = ["## Device use", ""]
    for row in rows:
        head, parts = usage.lines(row)
        lines += [f"- command started {row['started_at']:%Y-%m-%d %H:%M:%S} UTC, {row['runs']} runs: {head}",
                  f"  {parts.strip()}"]  # fmt: skip
        if len(rows) > 1:  # a sweep resumed by later commands may have run other code in each
            ran = f"`{redact(str(row['command']))}`" if row.get("command") else "command line not recorded"
            lines.append(f"  commit {row.get('commit') or 'not recorded'}: {ran}")
    if len(rows) > 1 and all(r["utilisation"] is not None for r in rows):
        total = sum(r["train_flops"] for r in rows) / sum(r["wall_s"] * r["gpus"] * r["peak_flops"] for r in rows)
        lines.append(f"- over its {len(rows)} commands: sweep utilisation {total:.1%}")
    return lines + _serial_lines(rows, times) + [""]


def _serial_lines(rows: Sequence[Mapping[str, Any]], times: pd.DataFrame | None) -> list[str]:
    """The sweep's device time against its runs' steps one after another, each at its shape's steady rate alone
    (``python -m sweeps alone``): where they match, the sweep hid its start-up, compilation and evaluation behind
    other runs' steps and sharing a GPU sped no run up, so only faster steps raise its utilisation."""
    if times is None or times.empty or times["alone_s"].isna().any() or any(r["utilisation"] is None for r in rows):
        return []
    alone, device_s = times["alone_s"].sum(), sum(r["wall_s"] * r["gpus"] for r in rows)
    peak = rows[0]["peak_flops"]
    return [
        f"- its {len(times)} runs' steps one after another, each shape at its steady rate alone on one device"
        f" (`python -m sweeps alone`): {alone:.0f} s, {alone / device_s:.0%} of its commands' {device_s:.0f}"
        f" device-seconds; at those rates its training FLOPs use {times['train_flops'].sum() / (alone * peak):.1%}"
        " of the peak (its runs' own speed: the utilisation of a sweep that lost no time between or around them)"
    ]


def _runs_table(points: pd.DataFrame) -> list[str]:
    rows = []
    for (arch, budget), g in points.groupby(["arch", "budget"], sort=True):
        best = g.loc[g["loss"].idxmin()]
        rows.append([
            arch, _g(budget, 3), len(g), f"{_g(g['n'].min(), 3)} – {_g(g['n'].max(), 3)}",
            _g(best["loss"]), _g(best["n"], 3), _g(best["d"], 3),
        ])  # fmt: skip
    head = ["series", "budget C (FLOPs)", "runs", "N range", "best loss (nats; one run, measured)", "N at best",
            "D at best"]  # fmt: skip
    return ["Single measurements: each loss is one run's (no interval; the seed noise section says how much a",
            "run moves with its seed).", "", *_table(head, rows)]  # fmt: skip


def _parabola_row(arch: str, p: ParabolaFit) -> list[Any]:
    if p.vertex_inside:
        inside = "yes"
    else:
        inside = "**no** (curvature <= 0)" if p.curvature <= 0 else "**no** (outside the sizes)"
    return [
        arch, _g(p.budget, 3), p.n_points, _with_ci(p.n_opt, p.ci_n_opt), _with_ci(p.d_opt, p.ci_d_opt),
        _with_ci(p.loss_opt, p.ci_loss_opt), inside, "90%" if not p.why else f"not identified: {p.why}",
    ]  # fmt: skip


def _law_row(arch: str, name: str, law: PowerLaw | None, used: int) -> list[str]:
    if law is None:
        return [arch, name, "not identified (fewer than 2 budgets with an inside vertex)", "not identified", str(used)]
    if law.ci_exponent is None:
        return [arch, name, f"{_g(law.k)} (not identified: {law.why})", f"{_g(law.exponent)} (not identified)",
                str(used)]  # fmt: skip
    return [arch, name, _with_ci(law.k, law.ci_k), _with_ci(law.exponent, law.ci_exponent), str(used)]


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
    head = ["series", "held-out C", "method", "fitted on C", "L* predicted [90%]", "L* measured (vertex)", "inside",
            "N* predicted [90%]", "N* measured (vertex)", "notes"]  # fmt: skip
    return _table(head, rows)


def _frontier_lines(fits: SweepFits) -> list[str]:
    shown = [(a.arch, a.optimal) for a in fits.archs if a.optimal is not None]
    lines = [
        "## Approach 3: compute-optimal frontier",
        "",
        "The fitted surface minimised over N along the runs' own budget constraint D = C / (k N^g), k and g from",
        "ln(C/(N D)) regressed on ln N over the series' runs (the lab's FLOP count; taken as exact, not estimated).",
        "Exponents: 90% delta-method intervals; N*, D*, L* per budget: 90% intervals from parameter draws",
        "(analysis/optimal.py). Only series whose parametric fit is identified have one.",
        "",
    ]
    if not shown:
        return lines + ["No series has an identified parametric fit.", ""]
    rows = [
        [arch, _with_ci(o.n_exponent, o.ci_n_exponent, 3), _with_ci(o.d_exponent, o.ci_d_exponent, 3),
         f"k = {math.exp(o.log_k):.4g}, g = {1 + o.slope:.4g}"]
        for arch, o in shown
    ]  # fmt: skip
    lines += _table(["series", "N* ∝ C^a: a [90%]", "D* ∝ C^b: b [90%]", "constraint (exact)"], rows)
    rows = []
    for arch, o in shown:
        for i, c in enumerate(o.budgets):
            cis = (o.n_ci, o.d_ci, o.loss_ci)
            n, d, loss = (_with_ci(v[i], ci[i] if ci else None) for v, ci in zip((o.n_opt, o.d_opt, o.loss_opt), cis,
                                                                                 strict=True))  # fmt: skip
            rows.append([arch, _g(c, 3), n, d, loss, o.why or "90%"])
    return lines + _table(["series", "budget C (FLOPs)", "N* [90%]", "D* [90%]", "L* [90%]", "intervals"], rows)


def _signed(r: Mapping[str, Any]) -> str:
    """A ``noise.difference`` as "+d [lo, hi]" (signed), or "+d (noise not measured)"."""
    if r["lo"] is None:
        return f"{r['diff']:+.3g} (noise not measured)"
    return f"{r['diff']:+.3g} [{r['lo']:+.3g}, {r['hi']:+.3g}]"


def _sd(sd: tuple[float, ...] | None, source: str | None) -> str:
    """Seed spreads (the arch's / the baseline's), with where they were borrowed from when not measured at the
    row's budget."""
    if sd is None:
        return "–"
    return " / ".join(_g(x, 3) for x in sd) + (f" ({source})" if source not in (None, "measured") else "")


def _noise_lines(points: pd.DataFrame) -> list[str]:
    """Seed noise and comparison to dense (``analysis.noise``)."""
    from analysis.noise import noise_tables

    spread, compare = noise_tables(points)
    lines = [
        "## Seed noise and comparison to dense",
        "",
        "Seed-to-seed standard deviation of a run's loss, pooled over the grid points trained with several seeds",
        "(90% chi-square interval), over every arch and each arch's own; a budget without replicates borrows the",
        "spread of the budgets that have them (source), assuming seed noise does not change with the budget. The",
        "comparisons use each arch's own spread (its rows below). An arch's best loss (lowest seed mean over",
        "its sizes; measured) minus dense's, with a 90% interval that also holds the luck of taking the lowest of",
        "several noisy means: within noise when it holds 0 (analysis/noise.py).",
        "",
    ]
    if not any(r["sd"] is not None for r in spread):
        lines += [
            "No grid point was trained with more than one seed: the noise floor is not measured (sweep.seeds).",
            "",
        ]
    else:
        rows = [
            [_g(r["budget"], 3), r["arch"], _with_ci(r["sd"], (r["lo"], r["hi"]) if r["sd"] is not None else None, 3),
             r["dof"] if r["dof"] is not None else "–", r["source"] or "not measured"]
            for r in spread
        ]  # fmt: skip
        lines += _table(["budget C (FLOPs)", "archs", "seed sd (nats) [90%]", "dof", "source"], rows)
    if compare:
        rows = [
            [_g(r["budget"], 3), r["arch"], _g(r["best"]), _g(r["dense_best"]), _signed(r), r["verdict"]]
            for r in compare
        ]  # fmt: skip
        head = ["budget C (FLOPs)", "arch", "best loss (measured)", "dense best (measured)", "difference [90%]",
                "verdict"]  # fmt: skip
        lines += _table(head, rows)
    return lines


def _time_lines(times: pd.DataFrame, summary: Mapping[str, Any]) -> list[str]:
    """Time-matched view: what each arch's training FLOPs cost in seconds, and its best loss with that time."""
    usage = summary.get("usage") or []
    shared = any((u.get("parts") or {}).get("sharing") in ("mps", "time-sliced") for u in usage)
    col, _ = time_basis(times)
    lines = [
        "## Time-matched view",
        "",
        "The same runs against time instead of FLOPs (figure `time_frontier`): an arch whose FLOPs run slower or",
        "faster than dense's (routing, depth attention, small matmuls) moves along this axis. Wall s = a run's whole",
        "fit (compilation included). Seconds per PFLOP: the median over the arch's runs of its time per 1e15",
        "training FLOPs.",
    ]
    if col == "alone_s":
        lines.append("Time = each run's tokens at its shape's steady rate trained alone on the device (`python -m"
                     " sweeps alone`), not at the rate it had beside other runs.")  # fmt: skip
    else:
        lines.append("Time = each run's tokens at its own steady-state rate (compilation and first steps excluded).")
        if shared:
            lines.append("**These runs shared a GPU** (sweep.workers_per_gpu): each one's rate depends on what ran"
                         " beside it, so differences between archs here are not their own; `python -m sweeps alone`"
                         " times every shape alone and the view then uses that.")  # fmt: skip
    lines.append("")
    per = times.assign(s_per_pflop=times[col] / (times["train_flops"] / 1e15))
    med = per.groupby("arch")["s_per_pflop"].median()
    rows = []
    for arch, runs in per.groupby("arch", sort=True):
        best = runs.loc[runs["val_loss"].idxmin()]
        vs = f"{med[arch] / med['dense']:.3f}" if "dense" in med else "-"
        rows.append([arch, len(runs), _g(med[arch]), vs, _g(best["val_loss"]), _g(best[col], 3),
                     _g(best["wall_s"], 3)])  # fmt: skip
    head = ["arch", "runs", "s per PFLOP", "vs dense", "best loss", "its time (s)", "its wall s"]
    return lines + _table(head, rows)


def _claims_lines(claims: Sequence[ClaimRow]) -> list[str]:
    """The papers' claims (``analysis.claims``), each with its measured difference, interval and seed spread."""
    lines = [
        "## The papers' claims at this scale",
        "",
        "Each claim checked at each budget (analysis/claims.py): seed-mean held-out losses of each arch's best size",
        "(equal training FLOPs) or at the baseline's best of the shapes both trained (equal parameters); each",
        "interval holds the luck of a lowest mean picked from several noisy ones. Seed sd: the arch's / the",
        "baseline's own, measured at the budget or borrowed from the budgets named. Reproduced: the 90% interval of",
        "the difference lies on the claim's side of 0; refuted: on the other side; not resolved: it holds 0, or the",
        "seed spread was not measured (sweep.seeds). The causal predictor: its accuracy's interval above 97% and the",
        "change of each run's loss from top-k to causal routing below 1% of the loss. A forecast is reproduced when",
        "the measured optimum lies in its 90% prediction interval and that interval lies below the best loss at the",
        "largest fitted budget. Each verdict points the wrong way with probability about 5% at most: of these",
        f"{len(claims)} rows, a few may do so by chance.",
        "",
    ]
    rows = [
        [c.claim, "–" if c.budget is None else _g(c.budget, 3), c.compared, c.measured,
         "–" if c.diff is None else _signed({"diff": c.diff, "lo": c.lo, "hi": c.hi}), _sd(c.sd, c.sd_source),
         c.verdict]
        for c in claims
    ]  # fmt: skip
    head = ["claim", "budget C", "compared", "measured (nats)", "difference [90%]", "seed sd", "verdict"]
    return lines + _table(head, rows)


def build_report(
    fits: SweepFits,
    points: pd.DataFrame,
    summary: Mapping[str, Any],
    figures: Mapping[str, Path],
    notes: Sequence[str] = (),
    base: Path | None = None,
    times: pd.DataFrame | None = None,
    claims: Sequence[ClaimRow] = (),
) -> str:
    """Markdown text of the report.

    Args:
        fits: the sweep's fits.
        points: series points (``pipeline.series_points``: arch is the series, ``loss`` the fitted loss).
        summary: ``store.sweep_summary`` output.
        figures: name -> PNG path; keys ending in "_plot" are embedded.
        notes: global notes (e.g. figures skipped).
        base: folder the report is written to; figure links are relative to it.
        times: ``store.load_times`` rows (each run's loss and seconds) for the time-matched view.
        claims: ``analysis.claims.check`` rows.
    """
    lines = [f"# Scaling-law report: sweep {summary.get('sweep_id')}", ""]
    lines += _header_lines(fits, summary)
    lines += _provenance_lines(summary)
    lines += _usage_lines(summary, times)
    lines += ["## Runs per budget", ""]
    lines += _runs_table(points) if not points.empty else ["No finished runs.", ""]

    lines += ["## Approach 2: isoFLOP parabolas", ""]
    lines += [
        "Robust (soft-L1) parabola of loss against ln N per budget; inside = the vertex is a minimum lying within",
        "the sampled N range (only those budgets enter the power laws). D* is interpolated in (ln N, ln D)",
        "between the budget's runs. A vertex's own 90% interval comes from its runs' scatter about the parabola",
        "(delta method, dof = runs - 3); with fewer than 5 runs there is too little residual and it is not",
        "identified (three runs leave none: the parabola passes through them). It is the interval of the",
        "parabola's vertex: it holds the runs' noise, not the shift of a parabola fitted to a lopsided loss curve",
        "(Approach 3's frontier has no such shift). The power laws' intervals below hold every vertex's noise.",
        "",
    ]
    rows = [_parabola_row(a.arch, p) for a in fits.archs for p in (a.isoflop.parabolas if a.isoflop else ())]
    head = ["series", "budget C (FLOPs)", "runs", "N* [90%]", "D* [90%]", "L* (nats) [90%]", "vertex inside",
            "intervals"]  # fmt: skip
    lines += _table(head, rows) if rows else ["No budget had 3 runs.", ""]

    lines += ["## Approach 2: power laws", ""]
    lines += [
        "Least squares in log-log over the inside vertices, y = k C^exponent; 90% t intervals from the vertices'",
        "scatter about the law (dof = budgets - 2): with 2 budgets there is no scatter and they are not identified.",
        "",
    ]
    rows = []
    for a in fits.archs:
        iso = a.isoflop
        if iso is None:
            continue
        used = len(iso.budgets_used)
        for name, law in (("N*(C)", iso.n_opt), ("D*(C)", iso.d_opt), ("L*(C)", iso.loss_opt)):
            rows.append(_law_row(a.arch, name, law, used))
    head = ["series", "law", "k [90%]", "exponent [90%]", "budgets"]
    lines += _table(head, rows) if rows else ["No power laws (fewer than 2 budgets with an inside vertex).", ""]

    lines += ["## Approach 3: parametric fit L = E + A/N^α + B/D^β", ""]
    lines += [
        "Huber (δ = 1e-3) on log-loss residuals, summed over runs; bounded L-BFGS-B from the best starts of a",
        "grid; 90% Wald t intervals in brackets (dof = runs - 5). a = β/(α+β) is N*(C)'s exponent when D = C/(6N).",
        "A fit the data do not identify (fewer than 10 runs, a parameter on its bound, an interval wider than",
        "its estimate) shows no numbers. The objective is the fit's statistic (summed Huber loss at the optimum),",
        "not an estimate.",
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
        cell = {k: _with_ci(getattr(p, k), p.ci.get(k), 3) for k in ("E", "A", "B", "alpha", "beta", "a")}
        rows.append([
            a.arch, cell["E"], cell["A"], cell["B"], cell["alpha"], cell["beta"], cell["a"], _g(p.objective),
            p.n_points,
        ])  # fmt: skip
    head = ["series", "E", "A", "B", "α", "β", "a", "objective (statistic)", "points"]
    lines += _table(head, rows) if rows else ["No parametric fit (too few runs).", ""]
    lines += _frontier_lines(fits)

    lines += ["## Forecast of held-out budgets", ""]
    lines += [
        "Each law is fitted without the largest budget(s) and predicts their optimum; measured = the held-out",
        "budget's own parabola vertex. Intervals are 90% prediction intervals of that measurement, so they hold",
        "its noise (analysis/forecast.py says how each is made).",
        "",
    ]
    lines += _forecast_lines(fits)
    if not points.empty:
        lines += _noise_lines(points)
    if claims:
        lines += _claims_lines(claims)
    if times is not None and not times.empty:
        lines += _time_lines(times, summary)

    figs = [(k, v) for k, v in figures.items() if k.endswith("_plot")]
    if figs:
        legend = "Colour is the arch in every figure (`:causal` a lighter tint of it); marker is the budget."
        lines += ["## Figures", "", legend, ""]
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
    times: pd.DataFrame | None = None,
    claims: Sequence[ClaimRow] = (),
) -> Path:
    """Write ``build_report`` to ``out`` (figure links relative to its folder) and return the path."""
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(build_report(fits, points, summary, figures, notes, base=p.parent, times=times, claims=claims))
    return p
