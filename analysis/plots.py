"""Figures (PNG): isoFLOP curves, compute-optimal frontiers, forecasts, training curves, residuals, and the MoD
paper's Fig. 4-style comparison.

Colour means arch in every figure: ``series_color`` is the one mapping (an ``<arch>:causal`` series a lighter tint
of its arch's colour); within a figure budgets are told apart by marker (``budget_markers``) and by shade.

Figures are built on ``matplotlib.figure.Figure`` objects (Agg canvas) rather than pyplot, so nothing here
changes the process-wide backend or keeps figures alive, and plotting works headless and from threads.
Seaborn styles are applied through context managers for the same reason.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullFormatter

from analysis.errors import AnalysisError
from analysis.records import Forecast, IsoflopFit, ParametricFit, ParametricFrontier, PowerLaw
from analysis.store import time_basis

DPI = 130
Color = tuple[float, float, float]
_TAB10 = sns.color_palette("tab10")
# The archs of conf/model/, each a fixed colour of its own (tab10; its grey is left for reference lines).
ARCH_COLORS: dict[str, Color] = {
    "dense": _TAB10[0], "mod": _TAB10[1], "moda": _TAB10[2], "mode": _TAB10[3], "moda_post": _TAB10[4],
    "mod_random": _TAB10[5], "mode_integrated": _TAB10[6], "moda_attn": _TAB10[8], "dense_post": _TAB10[9],
}  # fmt: skip
_OTHER_COLORS: tuple[Color, ...] = tuple(sns.color_palette("husl", 12))  # any other arch: by a hash of its name
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
CAUSAL_TINT = 0.45  # an ``<arch>:causal`` series: its arch's colour this far toward white
CURVE_LABELS = {"lm_loss": "training LM loss (nats)", "train_loss": "training objective (nats)"}  # plot_curves' y


def _log_x(ax) -> None:
    """A log x axis labelled at its decades only (matplotlib labels minor ticks on spans under a decade, and they
    overlap)."""
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())


def _toward_white(color: Color, amount: float) -> Color:
    return tuple(float(v + (1.0 - v) * amount) for v in color)


def series_color(series: str) -> Color:
    """The colour of a fit series (an arch, or ``<arch>:causal``) in every figure.

    The archs of conf/model/ have fixed colours (``ARCH_COLORS``); any other arch takes a colour of another palette
    by a hash of its name (it may resemble a fixed one). So a series' colour depends on its name only, never on
    which other series a figure shows.
    ``<arch>:causal`` is its arch's colour tinted toward white (``CAUSAL_TINT``).
    """
    arch, _, variant = series.partition(":")
    base = ARCH_COLORS.get(arch) or _OTHER_COLORS[zlib.crc32(arch.encode()) % len(_OTHER_COLORS)]
    return _toward_white(base, CAUSAL_TINT) if variant else base


def palette(series: Iterable[str]) -> dict[str, Color]:
    """``series_color`` of each name, as a seaborn ``palette``."""
    return {s: series_color(s) for s in series}


def budget_markers(budgets: Iterable[float]) -> dict[float, str]:
    """Marker of each budget of a sweep (by rank: smallest budget first), the same in every figure of the sweep."""
    return {b: MARKERS[i % len(MARKERS)] for i, b in enumerate(sorted({float(b) for b in budgets}))}


def _shades(color: Color, values: Sequence[float]) -> dict[float, Color]:
    """``color`` lighter for smaller values (budgets, sizes), the largest in the colour itself."""
    k = len(values) - 1
    return {v: _toward_white(color, 0.5 * (1 - i / k)) if k else color for i, v in enumerate(sorted(values))}


def _figure(n_panels: int, panel_w: float = 5.0, panel_h: float = 4.0, max_cols: int = 3):
    cols = max(1, min(n_panels, max_cols))
    rows = max(1, math.ceil(n_panels / cols))
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.9):
        fig = Figure(figsize=(panel_w * cols + 1.8, panel_h * rows), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def _save(fig: Figure, out: str | os.PathLike) -> Path:
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=DPI)
    return p


def _budget_label(c: float) -> str:
    return f"C = {c:.2g} FLOPs"


def _fmt_ci(law: PowerLaw) -> str:
    if law.ci_exponent is None:
        return f"{law.exponent:.3f} (interval not identified)"
    lo, hi = law.ci_exponent
    return f"{law.exponent:.3f} [{lo:.3f}, {hi:.3f}]"


def _budget_legend(fig: Figure, markers: Mapping[float, str], title: str) -> None:
    """Figure legend of the budgets' markers (grey: colour is the arch's)."""
    handles = [
        Line2D([], [], ls="none", marker=m, color="0.35", label=_budget_label(b)) for b, m in sorted(markers.items())
    ]
    fig.legend(handles=handles, loc="outside right upper", title=title, fontsize="small")


def plot_isoflop(
    points: pd.DataFrame,
    fits: Mapping[str, IsoflopFit | None],
    out: str | os.PathLike,
    *,
    loss_col: str = "val_loss",
    n_col: str = "n",
) -> Path:
    """IsoFLOP curves: loss against N (log x) per budget, points and fitted parabola, one panel per series.

    Colour is the series' (``series_color``), a lighter shade for a smaller budget; the marker is the budget's.

    Args:
        points: rows with columns arch, budget, ``n_col`` and ``loss_col``.
        fits: Approach 2 fit per series (None or missing: points only).
        out: PNG path.
        loss_col: loss column (nats).
        n_col: parameter-count column.

    Returns:
        The PNG path. Vertices inside the sampled range are filled stars; outside ones hollow.
    """
    archs = sorted(set(points["arch"]) | {a for a, f in fits.items() if f is not None})
    if not archs:
        raise AnalysisError("nothing to plot: no points")
    budgets = sorted(set(points["budget"].astype(float)))
    markers = budget_markers(budgets)
    fig, axes = _figure(len(archs))
    for ax, arch in zip(axes, archs, strict=True):
        pts = points[points["arch"] == arch]
        fit = fits.get(arch)
        parabolas = {p.budget: p for p in fit.parabolas} if fit is not None else {}
        shades = _shades(series_color(arch), budgets)
        for b in budgets:
            sel = pts[pts["budget"].astype(float) == b]
            if sel.empty:
                continue
            color = shades[b]
            ax.scatter(sel[n_col], sel[loss_col], color=color, marker=markers[b], s=24, zorder=3)
            p = parabolas.get(b)
            if p is None:
                continue
            grid = np.exp(np.linspace(np.log(p.n_min) - 0.3, np.log(p.n_max) + 0.3, 100))
            ax.plot(grid, p.predict(grid), color=color, lw=1.3, zorder=2)
            if np.isfinite(p.n_opt) and np.isfinite(p.loss_opt) and p.curvature > 0:
                face = color if p.vertex_inside else "none"
                ax.scatter([p.n_opt], [p.loss_opt], marker="*", s=160, facecolor=face, edgecolor=color, zorder=4)
        _log_x(ax)
        ax.set_title(f"{arch}: isoFLOP curves", color=series_color(arch))
        ax.set_xlabel("parameters N (non-embedding)")
        ax.set_ylabel("validation loss (nats)")
    _budget_legend(fig, markers, "budget (★ = vertex)")
    return _save(fig, out)


def _fmt_exp(value: float, ci: tuple[float, float] | None) -> str:
    return f"{value:.3f} (interval not identified)" if ci is None else f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def plot_frontier(
    fits: Mapping[str, IsoflopFit | None],
    out: str | os.PathLike,
    optimal: Mapping[str, ParametricFrontier | None] | None = None,
) -> Path:
    """Compute-optimal frontiers N*(C), D*(C), L*(C), log-log: per series Approach 2's power law with its 90% band
    (solid) and, where its parametric fit is identified, Approach 3's frontier (dashed), each with its exponent.

    Args:
        fits: Approach 2 fit per series; None entries are skipped.
        out: PNG path.
        optimal: Approach 3 frontier per series (``analysis.optimal``); None or missing: not drawn.

    Returns:
        The PNG path. Filled markers are the vertices used by the power law, hollow ones were left out; the
        shaded band is the law's 90% interval.
    """
    panels = (
        ("n_opt", "optimal parameters N*", "N*"),
        ("d_opt", "optimal training tokens D*", "D*"),
        ("loss_opt", "loss at the optimum L* (nats)", "L*"),
    )
    optimal = {a: f for a, f in (optimal or {}).items() if f is not None}
    fig, axes = _figure(3, panel_w=4.8)
    valid = [(a, f) for a, f in sorted(fits.items()) if f is not None]
    for ax, (attr, ylabel, sym) in zip(axes, panels, strict=True):
        drawn = False  # a log axis with no positive data cannot be drawn (e.g. one budget, no vertex)
        for arch, fit in valid:
            color = series_color(arch)
            for p in fit.parabolas:
                v = getattr(p, attr)
                if p.curvature <= 0 or not np.isfinite(v) or v <= 0:
                    continue
                face = color if p.vertex_inside else "none"
                ax.scatter([p.budget], [v], s=30, facecolor=face, edgecolor=color, zorder=3)
                drawn = True
            law: PowerLaw | None = getattr(fit, attr)
            if law is None:
                ax.plot([], [], color=color, label=f"{arch}: no power law")
                continue
            cs = np.array(fit.budgets_used)
            grid = np.geomspace(cs.min() / 1.5, cs.max() * 1.5, 50)
            ax.plot(grid, law(grid), color=color, lw=1.5, label=f"{arch}: {sym} ∝ C^{_fmt_ci(law)}")
            if (band := law.interval(grid)) is not None:  # the law's 90% band (none when not identified)
                ax.fill_between(grid, *band, color=color, alpha=0.15, lw=0)
            drawn = True
        for arch, fr in sorted(optimal.items()):
            grid = np.geomspace(min(fr.budgets) / 1.5, max(fr.budgets) * 1.5, 50)
            y = dict(zip(("n_opt", "d_opt", "loss_opt"), fr.at(grid), strict=True))[attr]
            exp = {"n_opt": (fr.n_exponent, fr.ci_n_exponent), "d_opt": (fr.d_exponent, fr.ci_d_exponent)}.get(attr)
            label = f"{arch} Approach 3" + (f": ∝ C^{_fmt_exp(*exp)}" if exp else "")
            ax.plot(grid, y, color=series_color(arch), lw=1.5, ls="--", label=label)
            drawn = True
        if drawn:
            _log_x(ax)
            ax.set_yscale("log")
        ax.set_xlabel("training compute C (FLOPs)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{sym}(C) (solid: Approach 2, dashed: Approach 3)", fontsize="medium")
        if valid or optimal:
            ax.legend(fontsize="x-small")
        else:
            ax.text(0.5, 0.5, "no isoFLOP fit", transform=ax.transAxes, ha="center")
    return _save(fig, out)


def plot_forecast(
    fits: Mapping[str, IsoflopFit | None], casts: Mapping[str, tuple[Forecast, ...]], out: str | os.PathLike
) -> Path:
    """Held-out budgets: each series' measured vertex losses against C, and at each held-out budget the two
    approaches' predictions with their 90% prediction intervals (square: Approach 2, diamond: Approach 3).

    Args:
        fits: Approach 2 fit per series (its parabola vertices are the measured L*).
        casts: forecasts per series; series without any are left out.
        out: PNG path.
    """
    fig, (ax,) = _figure(1, panel_w=6.0)
    shown = [(a, fc) for a, fc in sorted(casts.items()) if fc]
    for arch, fc in shown:
        color = series_color(arch)
        fit = fits.get(arch)
        vert = [(p.budget, p.loss_opt) for p in (fit.parabolas if fit else ()) if p.vertex_inside]
        if vert:
            ax.plot(*zip(*vert, strict=True), "o-", color=color, ms=4, lw=0.8, label=f"{arch}: measured L*")
        for f in fc:
            if f.loss_pred is None:
                continue
            x = f.budget * (0.93 if f.method == "isoflop" else 1.07)  # side by side at the held-out budget
            yerr = None if f.loss_lo is None else [[f.loss_pred - f.loss_lo], [f.loss_hi - f.loss_pred]]
            marker = "s" if f.method == "isoflop" else "D"
            ax.errorbar([x], [f.loss_pred], yerr=yerr, fmt=marker, color=color, mfc="none", capsize=3)
    _log_x(ax)
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("loss at the optimum L* (nats)")
    ax.set_title("forecast of held-out budgets (□ Approach 2, ◇ Approach 3, 90%)")
    if shown:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no forecast", transform=ax.transAxes, ha="center")
    return _save(fig, out)


def normalize_to_dense(
    points: pd.DataFrame,
    *,
    dense_arch: str = "dense",
    loss_col: str = "val_loss",
    flops_col: str = "flops_per_token",
) -> pd.DataFrame:
    """Divide each run's loss and FLOPs per token by those of the best dense run of the same budget.

    FLOPs per forward pass are FLOPs per token times the sequence length; at one sequence length the ratio
    is the same, so ``flops_per_token`` is used directly.

    Args:
        points: rows with columns arch, budget, ``loss_col``, ``flops_col``.
        dense_arch: the baseline arch.
        loss_col: loss column.
        flops_col: forward FLOPs per token column.

    Returns:
        The rows of budgets that have a dense run, with ``loss_norm`` and ``flops_norm`` added
        (the best dense run of each budget sits at (1, 1)).

    Raises:
        AnalysisError: no budget has a dense run.
    """
    df = points.dropna(subset=[loss_col, flops_col]).copy()
    dense = df[df["arch"] == dense_arch]
    if dense.empty:
        raise AnalysisError(f"no {dense_arch!r} runs to normalise against")
    best = dense.loc[dense.groupby("budget")[loss_col].idxmin(), ["budget", loss_col, flops_col]]
    best = best.rename(columns={loss_col: "_loss_ref", flops_col: "_flops_ref"})
    df = df.merge(best, on="budget", how="inner")
    df["loss_norm"] = df[loss_col] / df["_loss_ref"]
    df["flops_norm"] = df[flops_col] / df["_flops_ref"]
    return df.drop(columns=["_loss_ref", "_flops_ref"])


def plot_mod_normalized(
    points: pd.DataFrame,
    out: str | os.PathLike,
    *,
    dense_arch: str = "dense",
    loss_col: str = "val_loss",
    flops_col: str = "flops_per_token",
    params_col: str = "params_total",
) -> Path:
    """The MoD paper's Fig. 4 style: normalised loss against normalised FLOPs per forward pass.

    Each run is placed relative to the best dense run of its budget (``normalize_to_dense``); colour is
    the arch, marker the budget, bubble area the parameter count. Points left of x = 1 and below y = 1 are
    both cheaper per step and better than the isoFLOP-optimal dense baseline.

    Args:
        points: rows with arch, budget, ``loss_col``, ``flops_col`` and ``params_col``.
        out: PNG path.
        dense_arch: the baseline arch.
        loss_col: loss column.
        flops_col: forward FLOPs per token column.
        params_col: parameter column for the bubble size.

    Returns:
        The PNG path.
    """
    df = normalize_to_dense(points, dense_arch=dense_arch, loss_col=loss_col, flops_col=flops_col)
    df["budget C (FLOPs)"] = df["budget"].map(lambda c: f"{c:.2g}")
    markers = {f"{b:.2g}": m for b, m in budget_markers(points["budget"]).items()}
    df["parameters (M)"] = df[params_col] / 1e6
    fig, (ax,) = _figure(1, panel_w=6.5, panel_h=4.8)
    sns.scatterplot(
        data=df, x="flops_norm", y="loss_norm", hue="arch", style="budget C (FLOPs)", size="parameters (M)",
        sizes=(30, 400), alpha=0.75, edgecolor="black", linewidth=0.4, ax=ax, palette=palette(df["arch"].unique()),
        markers=markers,
    )  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    _log_x(ax)
    ax.set_xlabel(f"FLOPs per forward pass / best {dense_arch} of the budget")
    ax.set_ylabel(f"validation loss / best {dense_arch} of the budget")
    ax.set_title(f"Normalised to the isoFLOP-optimal {dense_arch} run (bubble = parameters)")
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1), fontsize="small", title=None)
    return _save(fig, out)


def plot_curves(curves: pd.DataFrame, out: str | os.PathLike, *, x_col: str = "tokens") -> Path:
    """Training curves: the training LM loss against tokens seen (log x), one panel per budget, one line per run.

    The LM loss is the plain mean next-token cross-entropy, comparable across families. Where a plotted point lacks
    it (a store, or a resumed run's checkpoint, from before curves recorded it) every line shows the training
    objective instead, as the axis says: the LM loss plus, in MoD and MoDE, their router, predictor and MoE aux
    losses, so their curves then sit above their LM loss by those (MoD's predictor BCE starts near ln 2 and falls as
    the predictor learns).

    Colour is the arch's (``series_color``), a lighter shade for a smaller model; a diverged run is dotted.

    Args:
        curves: ``store.load_curves`` rows (run_id, arch, budget, n, status, ``x_col``, train_loss, and lm_loss
            where known).
        out: PNG path.
        x_col: x column ("tokens" or "flops").

    Raises:
        AnalysisError: no curve point has a finite loss.
    """
    df = curves.dropna(subset=[x_col, "train_loss"])
    df = df[(df[x_col] > 0) & np.isfinite(df["train_loss"])]
    if df.empty:
        raise AnalysisError("no training curve with a finite loss")
    loss_col = "lm_loss" if "lm_loss" in df and df["lm_loss"].notna().all() else "train_loss"
    budgets = sorted(set(df["budget"].astype(float)))
    fig, axes = _figure(len(budgets), panel_w=4.6, panel_h=3.6)
    for ax, b in zip(axes, budgets, strict=True):
        here = df[df["budget"].astype(float) == b]
        for arch, runs in here.groupby("arch", sort=True):
            sizes = sorted(set(runs["n"].astype(float)))
            shades = _shades(series_color(arch), sizes)
            for (n, _), r in runs.groupby(["n", "run_id"], sort=True):
                ls = ":" if r["status"].iloc[0] == "diverged" else "-"
                ax.plot(
                    r[x_col], r[loss_col], color=shades[float(n)], lw=1.2, ls=ls, marker="." if len(r) == 1 else None
                )
        _log_x(ax)
        ax.set_title(_budget_label(b))
        ax.set_xlabel("tokens seen" if x_col == "tokens" else "training FLOPs")
        ax.set_ylabel(CURVE_LABELS[loss_col])
    handles = [Line2D([], [], color=series_color(a), label=a) for a in sorted(set(df["arch"]))]
    fig.legend(handles=handles, loc="outside right upper", title="arch (lighter: smaller N)", fontsize="small")
    return _save(fig, out)


def plot_time_frontier(times: pd.DataFrame, out: str | os.PathLike) -> Path:
    """Held-out loss against each run's steady training time (log x; ``store.time_basis``), every run a point, per
    arch the lower envelope (the best loss reached by that time): the FLOP-matched frontier's time-matched twin.

    Args:
        times: ``store.load_times`` rows (arch, budget, val_loss, steady_s, alone_s).
        out: PNG path.
    """
    col, what = time_basis(times)
    markers = budget_markers(sorted(set(times["budget"].astype(float))))
    fig, axes = _figure(1, panel_w=6.4, panel_h=4.4)
    ax = axes[0]
    for arch, runs in times.groupby("arch", sort=True):
        color = series_color(arch)
        for b, here in runs.groupby("budget"):
            ax.scatter(here[col], here["val_loss"], color=color, marker=markers[float(b)], s=22)
        order = runs.sort_values(col)
        ax.step(order[col], order["val_loss"].cummin(), where="post", color=color, lw=1.3, label=arch)
    _log_x(ax)
    ax.set_xlabel(f"training time (s, tokens {what})")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title("time-matched: best loss by training time")
    ax.legend(fontsize="small")
    _budget_legend(fig, markers, "budget")
    return _save(fig, out)


def plot_residuals(
    points: pd.DataFrame,
    isoflop: Mapping[str, IsoflopFit | None],
    parametric: Mapping[str, ParametricFit | None],
    out: str | os.PathLike,
    *,
    loss_col: str = "loss",
) -> Path:
    """Residuals (measured minus fitted loss, nats) of every run against N: per series, left its budget's
    isoFLOP parabola, right the Approach 3 surface (when identified). Marker is the budget, colour the series.

    A budget with three sizes has zero residuals by construction: its parabola passes through them.

    Args:
        points: series points (``pipeline.series_points``: arch is the series) with budget, n, d, ``loss_col``.
        isoflop: Approach 2 fit per series.
        parametric: Approach 3 fit per series.
        out: PNG path.
        loss_col: the fitted loss column.

    Raises:
        AnalysisError: no points.
    """
    series = sorted(set(points["arch"]))
    if not series:
        raise AnalysisError("nothing to plot: no points")
    budgets = sorted(set(points["budget"].astype(float)))
    markers = budget_markers(budgets)
    fig, axes = _figure(2 * len(series), panel_w=4.4, panel_h=3.0, max_cols=2)
    for i, arch in enumerate(series):
        pts = points[points["arch"] == arch]
        shades = _shades(series_color(arch), budgets)
        iso, par = isoflop.get(arch), parametric.get(arch)
        parabolas = {p.budget: p for p in iso.parabolas} if iso is not None else {}
        ax_iso, ax_par = axes[2 * i], axes[2 * i + 1]
        for b in budgets:
            sel = pts[pts["budget"].astype(float) == b]
            if sel.empty:
                continue
            n, loss = sel["n"].to_numpy(float), sel[loss_col].to_numpy(float)
            style = {"color": shades[b], "marker": markers[b], "s": 24, "zorder": 3}
            if (p := parabolas.get(b)) is not None:  # three sizes: it passes through them, residuals are 0
                ax_iso.scatter(n, loss - p.predict(n) if p.n_points > 3 else np.zeros_like(n), **style)
            if par is not None and par.identified:
                ax_par.scatter(n, loss - par.predict(n, sel["d"].to_numpy(float)), **style)
        panels = [(ax_iso, f"{arch}: loss − its budget's parabola", None)]
        if par is not None and par.identified:
            panels.append((ax_par, f"{arch}: loss − Approach 3 surface", None))
        else:
            panels.append((ax_par, f"{arch}: Approach 3", "no fit" if par is None else f"not identified: {par.why}"))
        if not parabolas:
            panels[0] = (ax_iso, f"{arch}: isoFLOP parabolas", "no budget with 3 sizes")
        for ax, title, empty in panels:
            ax.set_title(title, color=series_color(arch), fontsize="medium")
            if empty is not None:
                ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", wrap=True, fontsize="small")
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            ax.axhline(0.0, color="0.5", lw=0.8)
            _log_x(ax)
            ax.set_xlabel("parameters N (non-embedding)")
            ax.set_ylabel("residual (nats)")
    _budget_legend(fig, markers, "budget")
    return _save(fig, out)
