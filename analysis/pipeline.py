"""Store → fits → ``fits`` rows → figures → report: what ``python -m analysis fit|plot|report`` and the sweep
runner call.

Series: every arch is fitted on ``val_loss``; a routed arch whose runs also carry ``val_loss_causal`` gets a
second series named ``<arch>:causal`` fitted on that loss (its ``fits`` rows use that name as ``arch``).
N is the view's ``n`` (non-embedding parameters), D its ``d`` (tokens trained), C the sweep's ``budget``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from analysis.claims import check
from analysis.errors import AnalysisError
from analysis.forecast import forecast
from analysis.isoflop import fit_isoflop
from analysis.optimal import compute_optimal
from analysis.parametric import fit_parametric
from analysis.records import Forecast, IsoflopFit, ParametricFit, ParametricFrontier, plain
from analysis.store import (
    fit_rows,
    held,
    load_claim_runs,
    load_curves,
    load_points,
    load_times,
    resolve_sweep,
    session,
    sweep_summary,
)
from mixdepth.results import Writer, add_fits

MIN_PARAMETRIC_POINTS = 6
# A spawned process spends 2-3 s importing before it fits, which a few series do not win back (2-core VM, idle: 2
# series of 6 runs took 5.1 s in 2 processes vs 3.0 s here; the 59-run H200 sweep's 7 series 8.0-8.2 s vs 12.2-12.3 s).
# Only series with enough runs for Approach 3's fit (most of the time) count.
MIN_SERIES = 4


@dataclass(frozen=True)
class ArchFits:
    """Both approaches for one series (an arch, or ``<arch>:causal``).

    Attributes:
        arch: series name, written as ``arch`` in the ``fits`` table.
        loss_col: the store column fitted.
        n_points: usable points.
        isoflop: Approach 2, or None when no budget had 3 points.
        parametric: Approach 3, or None with too few points.
        optimal: Approach 3's compute-optimal frontier (``analysis.optimal``), or None when the parametric fit
            is missing or not identified.
        forecasts: the largest ``holdout`` budgets predicted from the others (``analysis.forecast``).
        notes: one line per thing skipped and why.
    """

    arch: str
    loss_col: str
    n_points: int
    isoflop: IsoflopFit | None
    parametric: ParametricFit | None
    optimal: ParametricFrontier | None = None
    forecasts: tuple[Forecast, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {k: plain(getattr(self, k)) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class SweepFits:
    """Every series of one sweep."""

    sweep_id: str | None
    archs: tuple[ArchFits, ...]

    def get(self, arch: str) -> ArchFits | None:
        return next((a for a in self.archs if a.arch == arch), None)

    def to_dict(self) -> dict[str, Any]:
        return {"sweep_id": self.sweep_id, "archs": [a.to_dict() for a in self.archs]}


def series_points(points: pd.DataFrame, *, causal: bool = True) -> pd.DataFrame:
    """Long frame of fit series: the rows of ``points`` with ``arch`` set to the series name and ``loss``.

    Args:
        points: ``isoflop_points`` rows.
        causal: add ``<arch>:causal`` series from ``val_loss_causal`` where present.
    """
    parts = [points.assign(loss=points["val_loss"])]
    if causal and "val_loss_causal" in points:
        c = points[points["val_loss_causal"].notna()]
        if not c.empty:
            parts.append(c.assign(arch=c["arch"] + ":causal", loss=c["val_loss_causal"]))
    return pd.concat(parts, ignore_index=True)


def _fit_series(arch: str, pts: pd.DataFrame, loss_col: str, holdout: int) -> ArchFits:
    notes: list[str] = []
    usable = pts.dropna(subset=["n", "d", "budget", "loss"])
    usable = usable[(usable["n"] > 0) & (usable["d"] > 0) & (usable["loss"] > 0)]
    if len(usable) < len(pts):
        notes.append(f"{len(pts) - len(usable)} runs without N, D or loss left out")
    n, d, c, loss = (usable[k].to_numpy(float) for k in ("n", "d", "budget", "loss"))
    iso = par = opt = None
    casts: tuple[Forecast, ...] = ()
    try:
        iso = fit_isoflop(n, c, loss, d)
        notes.extend(iso.skipped)
    except AnalysisError as e:
        notes.append(f"isoFLOP fit skipped: {e}")
    if len(usable) < MIN_PARAMETRIC_POINTS:
        notes.append(f"parametric fit skipped: {len(usable)} points, need {MIN_PARAMETRIC_POINTS}")
    else:
        try:
            par = fit_parametric(n, d, loss)
            if not par.identified:
                notes.append(f"parametric fit not identified: {par.why}")
            else:
                opt = compute_optimal(par, n, d, c)
                if opt.why:
                    notes.append(f"Approach 3 frontier: {opt.why}")
        except AnalysisError as e:
            notes.append(f"parametric fit skipped: {e}" if par is None else f"Approach 3 frontier skipped: {e}")
    if holdout:
        try:
            casts = forecast(n, c, loss, d, holdout=holdout)
        except AnalysisError as e:
            notes.append(f"forecast skipped: {e}")
    return ArchFits(arch, loss_col, len(usable), iso, par, opt, casts, tuple(notes))


def fit_points(
    points: pd.DataFrame,
    sweep_id: str | None = None,
    *,
    holdout: int = 1,
    causal: bool = True,
    processes: int | None = 1,
) -> SweepFits:
    """Fit Approaches 2 and 3 for every series of a sweep's points, and forecast its largest budgets.

    Args:
        points: ``isoflop_points`` rows of one sweep.
        sweep_id: recorded on the result.
        holdout: largest budgets each series forecasts from the others (0: no forecast).
        causal: also fit ``<arch>:causal`` series.
        processes: fit the series in this many spawned processes (None: one per core this process may use) when
            at least ``MIN_SERIES`` have runs enough for Approach 3, else here; the fits are single-threaded,
            deterministic and independent, so the result is the same. Spawning runs the caller's main module
            again, so a script that asks for processes needs ``if __name__ == "__main__"`` (the command lines
            have it).
    """
    long = series_points(points, causal=causal)
    jobs = [
        (a, long[long["arch"] == a], "val_loss_causal" if a.endswith(":causal") else "val_loss", holdout)
        for a in sorted(long["arch"].unique())
    ]  # fmt: skip
    workers = min(len(jobs), processes or len(os.sched_getaffinity(0)))
    if workers < 2 or sum(len(job[1]) >= MIN_PARAMETRIC_POINTS for job in jobs) < MIN_SERIES:
        return SweepFits(sweep_id, tuple(_fit_series(*job) for job in jobs))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:  # torch's threads
        return SweepFits(sweep_id, tuple(pool.map(_fit_series, *zip(*jobs, strict=True))))


def store_fits(con: duckdb.DuckDBPyConnection, fits: SweepFits) -> int:
    """Write (replace) the sweep's rows in ``fits``; returns the number of rows written."""
    rows = [r for a in fits.archs for r in fit_rows(fits.sweep_id, a.arch, a.isoflop, a.parametric, a.forecasts)]
    add_fits(con, fits.sweep_id, rows)
    return len(rows)


# Files run_all may write into its output folder.
OUTPUT_NAMES = (
    "fits.json", "isoflop.png", "frontier.png", "forecast.png", "mod_normalized.png", "curves.png",
    "residuals.png", "time_frontier.png", "report.md",
)  # fmt: skip


def _figures(
    long: pd.DataFrame, curves: pd.DataFrame, times: pd.DataFrame, fits: SweepFits, out: Path, notes: list[str]
) -> dict[str, Path]:
    from analysis import plots  # matplotlib only when figures are wanted

    iso = {a.arch: a.isoflop for a in fits.archs}
    paths = {
        "isoflop_plot": plots.plot_isoflop(long, iso, out / "isoflop.png", loss_col="loss"),
        "frontier_plot": plots.plot_frontier(iso, out / "frontier.png", {a.arch: a.optimal for a in fits.archs}),
    }
    if any(a.forecasts for a in fits.archs):
        casts = {a.arch: a.forecasts for a in fits.archs}
        paths["forecast_plot"] = plots.plot_forecast(iso, casts, out / "forecast.png")
    if "dense" in set(long["arch"]) and long["arch"].nunique() > 1:
        try:
            paths["mod_plot"] = plots.plot_mod_normalized(long, out / "mod_normalized.png", loss_col="loss")
        except AnalysisError as e:
            notes.append(f"normalised plot skipped: {e}")
    else:
        notes.append("normalised plot skipped: needs dense runs and at least one other arch")
    try:
        paths["curves_plot"] = plots.plot_curves(curves, out / "curves.png")
    except AnalysisError as e:
        notes.append(f"training-curves plot skipped: {e}")
    par = {a.arch: a.parametric for a in fits.archs}
    paths["residuals_plot"] = plots.plot_residuals(long, iso, par, out / "residuals.png")
    if not times.empty:
        paths["time_plot"] = plots.plot_time_frontier(times, out / "time_frontier.png")
    return paths


def run_all(
    db: str | os.PathLike | Writer,
    sweep_id: str | None = None,
    out_dir: str | os.PathLike = "analysis_out",
    *,
    holdout: int = 1,
    store: bool = True,
    plots: bool = True,
    report: bool = True,
    before_report: Callable[[], None] | None = None,
    processes: int | None = 1,
) -> dict[str, Path]:
    """Fit a sweep, write its ``fits`` rows, figures, ``fits.json`` and ``report.md``.

    Args:
        db: store path (opened read-write when ``store``, else read-only) or the ``Writer`` the caller holds
            (the sweep runner's: one process writes a store at a time).
        sweep_id: the sweep; None takes the sweep with the newest finished run.
        out_dir: folder for the outputs (created).
        holdout: largest budgets each series forecasts from the others (0: no forecast).
        store: write the ``fits`` rows.
        plots: write the PNGs.
        report: write ``report.md``.
        before_report: called once the fits and figures are done, before the report reads the store's summary
            (the sweep runner records its utilisation up to the report there).
        processes: ``fit_points``'s.

    Returns:
        Paths written, keyed "fits_json", "isoflop_plot", "frontier_plot", "forecast_plot" (when a series has a
        forecast), "mod_plot" (when there are dense runs and another arch), "curves_plot" (when runs logged
        training curves), "residuals_plot" and "report".

    Raises:
        AnalysisError: the sweep is unknown or has no finished runs.
        mixdepth.results.StoreError: the database cannot be opened.
    """
    with held(db, write=store) as db:  # the store is open only to read and to write, not while fitting
        with session(db) as con:
            sid = resolve_sweep(con, sweep_id)
            points = load_points(con, sid)
            curves = load_curves(con, sid) if plots else None
            times = load_times(con, sid)
            claim_runs = load_claim_runs(con, sid)
        fits = fit_points(points, sid, holdout=holdout, processes=processes)
        if store:
            with session(db) as con:
                store_fits(con, fits)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths: dict[str, Path] = {"fits_json": out / "fits.json"}
        paths["fits_json"].write_text(json.dumps(fits.to_dict(), indent=2) + "\n")
        notes: list[str] = []
        long = series_points(points)
        if plots:
            paths.update(_figures(long, curves, times, fits, out, notes))
        if report:
            from analysis.report import write_report

            if before_report is not None:
                before_report()
            with session(db) as con:
                summary = sweep_summary(con, sid)
            claims = check(claim_runs, fits)
            paths["report"] = write_report(out / "report.md", fits, long, summary, paths, notes, times, claims)
    return paths
