"""Reading sweep points from the DuckDB store and turning fit records into ``fits`` rows.

analysis never creates a database: a missing file is an error even for commands that write fits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from analysis.errors import AnalysisError
from analysis.published import is_published, load
from analysis.records import Forecast, IsoflopFit, ParametricFit
from mixdepth.results import SHAPE_KEY, USAGE_COLUMNS, StoreError, Writer, connect, store_files, writer

if TYPE_CHECKING:  # pandas is only needed once points are loaded (duckdb's .df() imports it)
    import pandas as pd

POINT_COLUMNS = (
    "sweep_id", "arch", "budget", "run_id", "n", "params_total", "params_active", "d",
    "flops_per_token", "train_flops", "val_loss", "val_loss_causal",
)  # fmt: skip
OPTIONAL_POINT_COLUMNS = ("seed",)  # stores made before a column existed lack it: read as unknown (NULL)
PROVENANCE_COLUMNS = ("planned", "version", "commit", "command")  # of ``sweeps``; NULL or absent: unknown


def open_db(path: str | os.PathLike) -> duckdb.DuckDBPyConnection:
    """Open an existing store read-only; StoreError with one line on failure."""
    return connect(_existing(path), read_only=True)


def _existing(path: str | os.PathLike) -> Path:
    """The database file at ``path``; for a published sweep's folder (``analysis.published``), its rows loaded."""
    p = Path(path)
    if not p.exists():
        raise StoreError(f"database {p} does not exist")
    if is_published(p):
        return load(p)
    if not p.is_file():
        raise StoreError(f"database {p} is not a file")
    return p


@contextmanager
def held(db: str | os.PathLike | Writer, *, write: bool) -> Iterator[str | os.PathLike | Writer]:
    """What ``session`` opens for the block: the caller's ``Writer`` (the sweep runner's) as it is, else the path
    when only reading, or when ``write`` a ``Writer`` of the existing store held for the block."""
    if write and not isinstance(db, Writer):
        if Path(db).is_dir():
            raise StoreError(f"{db} is a published sweep (read-only): fits are not stored there; drop --store")
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


def _columns_of(con: duckdb.DuckDBPyConnection, relation: str) -> set[str]:
    rows = con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = 'main' AND table_name = ?",
        [relation],
    )
    return {r[0] for r in rows.fetchall()}


def _optional(con: duckdb.DuckDBPyConnection, relation: str, names: tuple[str, ...]) -> str:
    """Select list of ``names``: the column where ``relation`` has it, else a NULL of that name."""
    have = _columns_of(con, relation)
    return ", ".join(f'"{n}"' if n in have else f'NULL AS "{n}"' for n in names)  # quoted: "commit" is a keyword


def load_points(con: duckdb.DuckDBPyConnection, sweep_id: str | None) -> pd.DataFrame:
    """Rows of the ``isoflop_points`` view for one sweep, ordered by arch, budget, N (``seed`` NULL where the
    store predates it)."""
    cols = ", ".join(POINT_COLUMNS) + ", " + _optional(con, "isoflop_points", OPTIONAL_POINT_COLUMNS)
    return con.execute(
        f"SELECT {cols} FROM isoflop_points WHERE sweep_id IS NOT DISTINCT FROM ? ORDER BY arch, budget, n",
        [sweep_id],
    ).df()


def load_times(con: duckdb.DuckDBPyConnection, sweep_id: str | None) -> pd.DataFrame:
    """Each finished run's loss and time: arch, budget, n, val_loss, train_flops, wall_s (its fit, compilation
    included), steady_s (tokens at its steady-state rate, beside whatever shared its device) and alone_s (tokens at
    its shape's rate alone, ``python -m sweeps alone``; NULL where not measured); ordered by arch, budget, n."""
    alone = "alone_rates" in {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    join = f" LEFT JOIN alone_rates a ON a.sweep_id = r.sweep_id AND a.shape = {SHAPE_KEY}" if alone else ""
    return con.execute(
        "SELECT r.arch, r.budget, r.params_nonembed AS n, r.val_loss, r.train_flops, r.wall_s,"
        f" r.tokens / r.tokens_per_s AS steady_s, {'r.tokens / a.tokens_per_s' if alone else 'NULL'} AS alone_s"
        f" FROM runs r{join} WHERE r.sweep_id IS NOT DISTINCT FROM ? AND r.status = 'ok' AND r.val_loss IS NOT NULL"
        " AND r.tokens_per_s > 0 ORDER BY r.arch, r.budget, n",
        [sweep_id],
    ).df()


def time_basis(times: pd.DataFrame) -> tuple[str, str]:
    """(column, what it is) of ``load_times`` rows the time-matched view uses: each run at its shape's rate alone
    when every run has one, else at its own steady rate."""
    if len(times) and times["alone_s"].notna().all():
        return "alone_s", "at each shape's steady rate alone"
    return "steady_s", "at each run's steady rate"


def load_claim_runs(con: duckdb.DuckDBPyConnection, sweep_id: str | None) -> pd.DataFrame:
    """Each finished run's shape, seed and losses for ``analysis.claims``: arch, budget, d_model, n_layers, n, seed,
    loss (held-out, top-k routing), loss_causal and predictor_accuracy (routed archs; else NULL). A diverged run
    is there with NULL losses (the claims count what they left out)."""
    return con.execute(
        "SELECT arch, budget, d_model, n_layers, params_nonembed AS n, seed, val_loss AS loss,"
        " val_loss_causal AS loss_causal, CAST(json_extract(routing_stats, '$.predictor_accuracy') AS DOUBLE)"
        " AS predictor_accuracy FROM runs WHERE sweep_id IS NOT DISTINCT FROM ?"
        " AND (status = 'ok' AND val_loss IS NOT NULL OR status = 'diverged') ORDER BY arch, budget, n, seed",
        [sweep_id],
    ).df()


def load_curves(con: duckdb.DuckDBPyConnection, sweep_id: str | None) -> pd.DataFrame:
    """Training curves of a sweep's runs (every status), with the run's arch, budget, N and status.

    Returns:
        Columns run_id, arch, budget, n, status, step, tokens, flops, train_loss (the objective), lm_loss (the LM
        loss in it; NULL where the store or the point predates it), lr; ordered by arch, budget, N, run, step.
        Empty when no run of the sweep logged a curve.
    """
    return con.execute(
        "SELECT c.run_id, r.arch, r.budget, r.params_nonembed AS n, r.status, c.step, c.tokens, c.flops,"
        f" c.train_loss, {_optional(con, 'curves', ('lm_loss',))}, c.lr FROM curves c JOIN runs r USING (run_id)"
        " WHERE r.sweep_id IS NOT DISTINCT FROM ? ORDER BY r.arch, r.budget, n, c.run_id, c.step",
        [sweep_id],
    ).df()


def sweep_summary(con: duckdb.DuckDBPyConnection, sweep_id: str | None) -> dict[str, Any]:
    """What the report's header and provenance say about a sweep.

    Returns:
        sweep_id, name, preset, created_at; config (the resolved config as stored, a dict, or None); the
        provenance columns planned, version, commit, command (None where the store lacks the column or the
        sweep has no value: unknown); runs_by_status (status -> runs in the database); finished (runs with a
        status); devices; software (the distinct ``versions`` of the runs, each a dict); usage (``sweep_usage``
        rows); passes (how often runs went over their corpus, ``_passes``); corpora ((corpus, fingerprint, runs)
        of its finished runs, most runs first: more than one means their losses were measured on different text).
    """
    prov = _optional(con, "sweeps", PROVENANCE_COLUMNS)
    row = con.execute(
        f"SELECT name, preset, created_at, config, {prov} FROM sweeps WHERE sweep_id IS NOT DISTINCT FROM ?",
        [sweep_id],
    ).fetchone()
    counts = con.execute(
        "SELECT coalesce(status, 'unknown'), count(*) FROM runs WHERE sweep_id IS NOT DISTINCT FROM ?"
        " GROUP BY 1 ORDER BY 1",
        [sweep_id],
    ).fetchall()
    devices = [r[0] for r in con.execute(
        "SELECT DISTINCT device FROM runs WHERE sweep_id IS NOT DISTINCT FROM ? AND device IS NOT NULL"
        " ORDER BY 1", [sweep_id]).fetchall()]  # fmt: skip
    software = [json.loads(r[0]) for r in con.execute(
        "SELECT DISTINCT CAST(versions AS VARCHAR) FROM runs WHERE sweep_id IS NOT DISTINCT FROM ?"
        " AND versions IS NOT NULL ORDER BY 1", [sweep_id]).fetchall()]  # fmt: skip
    corpora = con.execute(
        "SELECT corpus, corpus_fingerprint, count(*) FROM runs WHERE sweep_id IS NOT DISTINCT FROM ?"
        " AND status IS NOT NULL AND corpus_fingerprint IS NOT NULL GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2",
        [sweep_id],
    ).fetchall()
    by_status = {s: int(c) for s, c in counts}
    name, preset, created, config, *provenance = row if row else (None,) * (4 + len(PROVENANCE_COLUMNS))
    return {
        "sweep_id": sweep_id,
        "name": name,
        "preset": preset,
        "created_at": str(created) if created is not None else None,
        "config": json.loads(config) if isinstance(config, str) else config,
        **dict(zip(PROVENANCE_COLUMNS, provenance, strict=True)),
        "runs_by_status": by_status,
        "finished": sum(c for s, c in by_status.items() if s != "unknown"),
        "devices": devices,
        "software": software,
        "usage": _usage(con, sweep_id),
        "passes": _passes(con, sweep_id),
        "corpora": [(name, fp, int(n)) for name, fp, n in corpora],
    }


def _passes(con: duckdb.DuckDBPyConnection, sweep_id: str | None) -> dict[str, Any]:
    """How often the sweep's runs went over their corpus's training split: runs (with a status), recorded (those
    whose split's size is known: stored, or inferred from a run of the store with the same corpus fingerprint,
    which identifies the tokens and the split; 0 where the store predates the column), inferred (of those), least
    and most passes, runs of more than one, the split's fewest and most tokens."""
    keys = ("runs", "recorded", "inferred", "least", "most", "repeated", "fewest_tokens", "most_tokens")
    if "corpus_tokens" not in _columns_of(con, "runs"):
        return dict.fromkeys(keys) | {"recorded": 0, "inferred": 0}
    row = con.execute(
        "WITH sizes AS (SELECT corpus_fingerprint AS fp, max(corpus_tokens) AS n FROM runs"
        " WHERE corpus_tokens IS NOT NULL GROUP BY 1)"
        " SELECT count(*), count(p), count(*) FILTER (inferred), min(p), max(p), count(*) FILTER (p > 1), min(n),"
        " max(n) FROM (SELECT r.tokens / coalesce(r.corpus_tokens, s.n) AS p, coalesce(r.corpus_tokens, s.n) AS n,"
        " r.corpus_tokens IS NULL AND s.n IS NOT NULL AS inferred FROM runs r LEFT JOIN sizes s"
        " ON s.fp = r.corpus_fingerprint WHERE r.sweep_id IS NOT DISTINCT FROM ? AND r.status IS NOT NULL)",
        [sweep_id],
    ).fetchone()
    return dict(zip(keys, row, strict=True))


def _usage(con: duckdb.DuckDBPyConnection, sweep_id: str | None) -> list[dict[str, Any]]:
    """The sweep's ``sweep_usage`` rows (one per command that trained), oldest first; [] for older stores."""
    if "sweep_id" not in _columns_of(con, "sweep_usage"):
        return []
    rows = con.execute(  # a store older than a column reads it as NULL
        f"SELECT {_optional(con, 'sweep_usage', USAGE_COLUMNS)} FROM sweep_usage"
        " WHERE sweep_id IS NOT DISTINCT FROM ? ORDER BY started_at",
        [sweep_id],
    ).fetchall()
    out = [dict(zip(USAGE_COLUMNS, r, strict=True)) for r in rows]
    for row in out:
        row["parts"] = json.loads(row["parts"]) if isinstance(row["parts"], str) else row["parts"]
    return out


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
