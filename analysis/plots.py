"""Figures (PNG): isoFLOP curves, compute-optimal frontiers, and the MoD paper's Fig. 4-style comparison.

Figures are built on ``matplotlib.figure.Figure`` objects (Agg canvas) rather than pyplot, so nothing here
changes the process-wide backend or keeps figures alive, and plotting works headless and from threads.
Seaborn styles are applied through context managers for the same reason.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from analysis.errors import AnalysisError
from analysis.records import Forecast, IsoflopFit, PowerLaw

DPI = 130


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


def plot_isoflop(
    points: pd.DataFrame,
    fits: Mapping[str, IsoflopFit | None],
    out: str | os.PathLike,
    *,
    loss_col: str = "val_loss",
    n_col: str = "n",
) -> Path:
    """IsoFLOP curves: loss against N (log x) per budget, points and fitted parabola, one panel per arch.

    Args:
        points: rows with columns arch, budget, ``n_col`` and ``loss_col``.
        fits: Approach 2 fit per arch (None or missing: points only).
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
    palette = dict(zip(budgets, sns.color_palette("viridis", max(1, len(budgets))), strict=False))
    fig, axes = _figure(len(archs))
    for ax, arch in zip(axes, archs, strict=True):
        pts = points[points["arch"] == arch]
        fit = fits.get(arch)
        parabolas = {p.budget: p for p in fit.parabolas} if fit is not None else {}
        for b in budgets:
            sel = pts[pts["budget"].astype(float) == b]
            if sel.empty:
                continue
            color = palette[b]
            ax.scatter(sel[n_col], sel[loss_col], color=color, s=22, zorder=3, label=_budget_label(b))
            p = parabolas.get(b)
            if p is None:
                continue
            grid = np.exp(np.linspace(np.log(p.n_min) - 0.3, np.log(p.n_max) + 0.3, 100))
            ax.plot(grid, p.predict(grid), color=color, lw=1.3, zorder=2)
            if np.isfinite(p.n_opt) and np.isfinite(p.loss_opt) and p.curvature > 0:
                face = color if p.vertex_inside else "none"
                ax.scatter([p.n_opt], [p.loss_opt], marker="*", s=160, facecolor=face, edgecolor=color, zorder=4)
        ax.set_xscale("log")
        ax.set_title(f"{arch}: isoFLOP curves")
        ax.set_xlabel("parameters N (non-embedding)")
        ax.set_ylabel("validation loss (nats)")
    handles, labels = axes[0].get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    for ax in axes[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    order = sorted(seen, key=lambda s: float(s.split("=")[1].split()[0]))
    fig.legend([seen[k] for k in order], order, loc="outside right upper", title="budget (★ = vertex)")
    return _save(fig, out)


def plot_frontier(fits: Mapping[str, IsoflopFit | None], out: str | os.PathLike) -> Path:
    """Compute-optimal frontiers N*(C), D*(C), L*(C), log-log, one line per arch with its exponent.

    Args:
        fits: Approach 2 fit per arch; None entries are skipped.
        out: PNG path.

    Returns:
        The PNG path. Filled markers are the vertices used by the power law, hollow ones were left out; the
        shaded band is the law's 90% interval.
    """
    panels = (
        ("n_opt", "optimal parameters N*", "N*"),
        ("d_opt", "optimal training tokens D*", "D*"),
        ("loss_opt", "loss at the optimum L* (nats)", "L*"),
    )
    fig, axes = _figure(3, panel_w=4.6)
    colors = sns.color_palette("tab10")
    valid = [(a, f) for a, f in sorted(fits.items()) if f is not None]
    for ax, (attr, ylabel, sym) in zip(axes, panels, strict=True):
        drawn = False  # a log axis with no positive data cannot be drawn (e.g. one budget, no vertex)
        for i, (arch, fit) in enumerate(valid):
            color = colors[i % len(colors)]
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
        if drawn:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel("training compute C (FLOPs)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{sym}(C)")
        if valid:
            ax.legend(fontsize="small")
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
    colors = sns.color_palette("tab10")
    shown = [(a, fc) for a, fc in sorted(casts.items()) if fc]
    for i, (arch, fc) in enumerate(shown):
        color = colors[i % len(colors)]
        fit = fits.get(arch)
        vert = [(p.budget, p.loss_opt) for p in (fit.parabolas if fit else ()) if p.vertex_inside]
        if vert:
            ax.plot(*zip(*vert), "o-", color=color, ms=4, lw=0.8, label=f"{arch}: measured L*")
        for f in fc:
            if f.loss_pred is None:
                continue
            x = f.budget * (0.93 if f.method == "isoflop" else 1.07)  # side by side at the held-out budget
            yerr = None if f.loss_lo is None else [[f.loss_pred - f.loss_lo], [f.loss_hi - f.loss_pred]]
            marker = "s" if f.method == "isoflop" else "D"
            ax.errorbar([x], [f.loss_pred], yerr=yerr, fmt=marker, color=color, mfc="none", capsize=3)
    ax.set_xscale("log")
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
    df["parameters (M)"] = df[params_col] / 1e6
    fig, (ax,) = _figure(1, panel_w=6.5, panel_h=4.8)
    sns.scatterplot(
        data=df, x="flops_norm", y="loss_norm", hue="arch", style="budget C (FLOPs)", size="parameters (M)",
        sizes=(30, 400), alpha=0.75, edgecolor="black", linewidth=0.4, ax=ax,
    )  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel(f"FLOPs per forward pass / best {dense_arch} of the budget")
    ax.set_ylabel(f"validation loss / best {dense_arch} of the budget")
    ax.set_title(f"Normalised to the isoFLOP-optimal {dense_arch} run (bubble = parameters)")
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1), fontsize="small", title=None)
    return _save(fig, out)
