"""Reading sweep points from the DuckDB store and turning fit records into ``fits`` rows.

analysis never creates a database: a missing file is an error even for commands that write fits.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from analysis.errors import AnalysisError
from analysis.records import Forecast, IsoflopFit, ParametricFit
from mixdepth.results import StoreError, Writer, connect, store_files, writer

if TYPE_CHECKING:  # pandas is only needed once points are loaded (duckdb's .df() imports it)
    import pandas as pd

POINT_COLUMNS = (
    "sweep_id", "arch", "budget", "run_id", "n", "params_total", "params_active", "d",
    "flops_per_token", "train_flops", "val_loss", "val_loss_causal",
)  # fmt: skip


def open_db(path: str | os.PathLike) -> duckdb.DuckDBPyConnection:
    """Open an existing store read-only; StoreError with one line on failure."""
    return connect(_existing(path), read_only=True)


def _existing(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise StoreError(f"database {p} does not exist")
    if not p.is_file():
        raise StoreError(f"database {p} is not a file")
    return p


@contextmanager
def held(db: str | os.PathLike | Writer, *, write: bool) -> Iterator[str | os.PathLike | Writer]:
    """What ``session`` opens for the block: the caller's ``Writer`` (the sweep runner's) as it is, else the path
    when only reading, or when ``write`` a ``Writer`` of the existing store held for the block."""
    if write and not isinstance(db, Writer):
        with writer(_existing(db)) as w:
            yield w
    else:
        yield db


@contextmanager
def session(db: str | os.PathLike | Writer) -> Iterator[duckdb.DuckDBPyConnection]:
    """A connection for one short piece of work, closed at the end: a read-write session of a ``Writer``, or the
    store at a path opened read-only."""
    if isinstance(db, Writer):
        with db.session() as con:
            yield con
        return
    con = open_db(db)
    try:
        yield con
    finally:
        con.close()


def refuse_store_files(db: str | os.PathLike, outputs: list[Path]) -> None:
    """Raise before a command writes any of ``outputs`` that is the store ``db``: the database, its WAL or its
    Optuna journal (by path, through links, or the same file under another name)."""
    protected = [Path(p) for p in store_files(Path(db))]
    for out in outputs:
        for p in protected:
            same = out.exists() and p.exists() and os.path.samefile(out, p)
            if same or out.resolve() == p.resolve():
                raise AnalysisError(f"refusing to write {out}: it is {p}, a file of the store {db}")


def resolve_sweep(con: duckdb.DuckDBPyConnection, sweep_id: str | None) -> str | None:
    """The sweep to analyse: ``sweep_id`` checked against the runs, or the one with the newest run.

    Raises:
        AnalysisError: the sweep has no usable runs, or the store has none at all.
    """
    rows = con.execute(
        "SELECT p.sweep_id, max(r.created_at) AS t FROM isoflop_points p JOIN runs r USING (run_id)"
        " GROUP BY p.sweep_id ORDER BY t DESC NULLS LAST, p.sweep_id"
    ).fetchall()
    known = [r[0] for r in rows]
    if not known:
        raise AnalysisError("the store has no finished runs with a validation loss (status 'ok')")
    if sweep_id is None:
        return known[0]
    if sweep_id not in known:
        shown = ", ".join(str(k) for k in known[:10]) + (" ..." if len(known) > 10 else "")
        raise AnalysisError(f"sweep {sweep_id!r} has no finished runs (sweeps with runs: {shown})")
    return sweep_id


def load_points(con: duckdb.DuckDBPyConnection, sweep_id: str | None) -> pd.DataFrame:
    """Rows of the ``isoflop_points`` view for one sweep, ordered by arch, budget, N."""
    cols = ", ".join(POINT_COLUMNS)
    return con.execute(
        f"SELECT {cols} FROM isoflop_points WHERE sweep_id IS NOT DISTINCT FROM ? ORDER BY arch, budget, n",
        [sweep_id],
    ).df()


def sweep_summary(con: duckdb.DuckDBPyConnection, sweep_id: str | None) -> dict[str, Any]:
    """Sweep row (name, preset, created_at) and run counts by status, for the report."""
    row = con.execute(
        "SELECT name, preset, created_at FROM sweeps WHERE sweep_id IS NOT DISTINCT FROM ?", [sweep_id]
    ).fetchone()
    counts = con.execute(
        "SELECT coalesce(status, 'unknown'), count(*) FROM runs WHERE sweep_id IS NOT DISTINCT FROM ?"
        " GROUP BY 1 ORDER BY 1",
        [sweep_id],
    ).fetchall()
    devices = [r[0] for r in con.execute(
        "SELECT DISTINCT device FROM runs WHERE sweep_id IS NOT DISTINCT FROM ? AND device IS NOT NULL"
        " ORDER BY 1", [sweep_id]).fetchall()]  # fmt: skip
    return {
        "sweep_id": sweep_id,
        "name": row[0] if row else None,
        "preset": row[1] if row else None,
        "created_at": str(row[2]) if row and row[2] is not None else None,
        "runs_by_status": {s: int(c) for s, c in counts},
        "devices": devices,
    }


def _fit_id(sweep_id: str | None, arch: str, method: str, budget: float | None = None) -> str:
    tail = "" if budget is None else f"/{budget:.6g}"
    return f"{sweep_id}/{arch}/{method}{tail}"


def fit_rows(
    sweep_id: str | None,
    arch: str,
    isoflop: IsoflopFit | None,
    parametric: ParametricFit | None,
    forecasts: tuple[Forecast, ...] = (),
) -> list[dict[str, Any]]:
    """Rows for ``mixdepth.results.add_fits``: 'parabola' per budget, 'isoflop' power laws, 'parametric', and
    'forecast:isoflop' / 'forecast:parametric' per held-out budget (``params`` the ``Forecast``, ``ci`` its
    intervals).

    The 'isoflop' row is written even when no power law could be fitted (its laws are then null and
    ``params.skipped`` says why), so a refit replaces an older row instead of leaving it stale. A parametric
    fit that is not identified has ``params.identified`` false, ``params.why`` and an empty ``ci``.
    """
    rows: list[dict[str, Any]] = []
    if isoflop is not None:
        for p in isoflop.parabolas:
            rows.append({
                "fit_id": _fit_id(sweep_id, arch, "parabola", p.budget), "sweep_id": sweep_id, "arch": arch,
                "method": "parabola", "budget": p.budget, "params": p.to_dict(), "ci": {},
                "n_points": p.n_points, "objective": None,
            })  # fmt: skip
        d = isoflop.to_dict()
        ci = {}
        for name in ("n_opt", "d_opt", "loss_opt"):
            law = d[name]
            if law is not None and law["ci_exponent"] is not None:
                ci[f"{name}.exponent"] = law["ci_exponent"]
                ci[f"{name}.k"] = law["ci_k"]
        rows.append({
            "fit_id": _fit_id(sweep_id, arch, "isoflop"), "sweep_id": sweep_id, "arch": arch, "method": "isoflop",
            "budget": None, "params": {k: v for k, v in d.items() if k != "parabolas"}, "ci": ci,
            "n_points": sum(p.n_points for p in isoflop.parabolas), "objective": None,
        })  # fmt: skip
    if parametric is not None:
        d = parametric.to_dict()
        rows.append({
            "fit_id": _fit_id(sweep_id, arch, "parametric"), "sweep_id": sweep_id, "arch": arch,
            "method": "parametric", "budget": None, "params": {k: v for k, v in d.items() if k != "ci"},
            "ci": d["ci"], "n_points": parametric.n_points, "objective": parametric.objective,
        })  # fmt: skip
    for f in forecasts:
        d = f.to_dict()
        ci = {k: [d[f"{k}_lo"], d[f"{k}_hi"]] for k in ("loss", "n", "d") if d[f"{k}_lo"] is not None}
        rows.append({
            "fit_id": _fit_id(sweep_id, arch, f"forecast:{f.method}", f.budget), "sweep_id": sweep_id,
            "arch": arch, "method": f"forecast:{f.method}", "budget": f.budget, "params": d, "ci": ci,
            "n_points": None, "objective": None,
        })  # fmt: skip
    return rows
