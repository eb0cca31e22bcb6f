"""Scaling-law points from a CSV file (external data such as Epoch AI's Chinchilla extraction)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.errors import AnalysisError


def bin_budgets(c: np.ndarray, width: float = 0.1) -> np.ndarray:
    """Label each point with the budget of its bin, for data whose FLOPs are continuous.

    Points whose log10 C round to the same multiple of ``width`` decades share a bin; the bin's budget is
    the geometric mean of its members' C (so a bin's label stays close to the points it holds).

    Args:
        c: [P] training FLOPs.
        width: bin width in decades; 0 or less keeps the exact values (one budget per distinct C).

    Returns:
        [P] budget label of each point.
    """
    c = np.asarray(c, dtype=float)
    if width <= 0:
        return c.copy()
    key = np.round(np.log10(c) / width).astype(np.int64)
    _, inv = np.unique(key, return_inverse=True)
    log_mean = np.bincount(inv, weights=np.log(c)) / np.bincount(inv)
    return np.exp(log_mean)[inv]


def read_points_csv(
    path: str | os.PathLike,
    n_col: str,
    c_col: str,
    loss_col: str,
    d_col: str | None = None,
    drop_highest_loss: int = 0,
) -> pd.DataFrame:
    """Read (N, C, D, loss) points from a CSV.

    Args:
        path: CSV file with a header row.
        n_col: column of parameter counts N.
        c_col: column of training FLOPs C.
        loss_col: column of losses (nats).
        d_col: column of training tokens D; None derives D = C / (6 N).
        drop_highest_loss: drop this many points with the highest loss first (Epoch AI drop 5 on Chinchilla).

    Returns:
        DataFrame with float columns n, c, d, loss, in file order less the dropped rows.

    Raises:
        AnalysisError: unreadable file, missing column, non-numeric or non-positive values.
    """
    p = Path(path)
    if not p.is_file():
        raise AnalysisError(f"CSV file {p} does not exist")
    try:
        df = pd.read_csv(p)
    except (OSError, ValueError, pd.errors.ParserError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AnalysisError(f"cannot read CSV {p}: {first}") from None
    cols = {"n": n_col, "c": c_col, "loss": loss_col} | ({"d": d_col} if d_col else {})
    for col in cols.values():
        if col not in df.columns:
            raise AnalysisError(f"column {col!r} not in {p} (columns: {', '.join(map(str, df.columns))})")
    out = pd.DataFrame({k: pd.to_numeric(df[v], errors="coerce") for k, v in cols.items()})
    for k, v in cols.items():
        bad = int((~np.isfinite(out[k]) | (out[k] <= 0)).sum())
        if bad:
            raise AnalysisError(f"column {v!r} of {p} has {bad} missing, non-numeric or non-positive values")
    if "d" not in out:
        out["d"] = out["c"] / (6.0 * out["n"])
    if drop_highest_loss < 0 or drop_highest_loss >= len(out):
        raise AnalysisError(f"--drop-highest-loss {drop_highest_loss} must be in [0, {len(out) - 1}]")
    if drop_highest_loss:
        out = out.drop(out["loss"].nlargest(drop_highest_loss).index)
    return out[["n", "c", "d", "loss"]].reset_index(drop=True)
