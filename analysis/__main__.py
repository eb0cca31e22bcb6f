"""``python -m analysis <command>``: fit CSV data or a sweep store, query it, export it, plot and report.

Commands:
    fit-csv PATH --n-col C --c-col C --loss-col C [--d-col C] [--method parametric|isoflop] [--holdout K] [--json]
    query --db PATH "SQL"
    export --db PATH TABLE OUT.parquet
    publish --db PATH [--sweep ID] --out DIR   one sweep's rows as Parquet + README.md (provenance); any --db takes DIR
    fit --db PATH [--sweep ID] [--holdout K]   fits a sweep and writes the ``fits`` table
    forecast --db PATH [--sweep ID] [--holdout K]   predicts the largest K budgets from the others (read-only)
    plot --db PATH [--sweep ID] --out DIR  figures only (read-only)
    report --db PATH [--sweep ID] --out DIR [--store]   figures + report.md (read-only unless --store)

Errors print one line ``error: ...`` on stderr: exit 2 for usage errors, 1 for everything else.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import duckdb

from analysis.errors import AnalysisError
from mixdepth.results import StoreError


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {self.prog}: {message} (see --help)\n")
        raise SystemExit(2)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _forecast_table(casts) -> str:
    from analysis.query import format_table

    head = ["budget", "method", "loss_pred", "loss_lo", "loss_hi", "loss_obs", "n_pred", "n_lo", "n_hi", "n_obs", "why"]
    return format_table(head, [[getattr(f, k) for k in head] for f in casts])


def _cmd_fit_csv(args: argparse.Namespace) -> int:
    from analysis.forecast import forecast
    from analysis.isoflop import fit_isoflop
    from analysis.parametric import fit_parametric
    from analysis.query import format_table
    from analysis.tabular import bin_budgets, read_points_csv

    pts = read_points_csv(args.path, args.n_col, args.c_col, args.loss_col, args.d_col, args.drop_highest_loss)
    n, c, d, loss = (pts[k].to_numpy() for k in ("n", "c", "d", "loss"))
    if args.method == "parametric":
        fit = fit_parametric(n, d, loss, n_starts=args.n_starts or None)
        out = {"method": "parametric", **fit.to_dict()}
        text = format_table(
            ["E", "A", "B", "alpha", "beta", "a", "objective", "n_points"],
            [[fit.E, fit.A, fit.B, fit.alpha, fit.beta, fit.a, fit.objective, fit.n_points]],
        )
        if fit.ci:
            ci = [[k, lo, hi] for k, (lo, hi) in fit.ci.items()]
            text += "\n\n" + format_table(["param", "lo_90%", "hi_90%"], ci)
        if not fit.identified:
            text = f"not identified: {fit.why}\n(numbers below are no result)\n" + text
    else:
        fit = fit_isoflop(n, bin_budgets(c, args.c_bin_width), loss, d)
        out = {"method": "isoflop", "c_bin_width": args.c_bin_width, "n_points": len(pts), **fit.to_dict()}
        rows = [
            [p.budget, p.n_points, p.n_opt, p.d_opt, p.loss_opt, p.curvature, p.vertex_inside] for p in fit.parabolas
        ]
        text = format_table(["budget", "points", "N_opt", "D_opt", "L_opt", "curvature", "inside"], rows)
        laws = [
            [name, law.k, law.exponent, *(law.ci_exponent or (None, None)), law.why or None]
            for name, law in (("N*", fit.n_opt), ("D*", fit.d_opt), ("L*", fit.loss_opt))
            if law is not None
        ]
        text += "\n\n" + format_table(["law", "k", "exponent", "exp_lo_90%", "exp_hi_90%", "not identified"], laws)
    if args.holdout:
        casts = forecast(n, bin_budgets(c, args.c_bin_width), loss, d, holdout=args.holdout)
        out["forecast"] = [f.to_dict() for f in casts]
        text += "\n\nforecast of the largest budget(s) from the others (90% prediction intervals)\n"
        text += _forecast_table(casts)
    print(json.dumps(out, indent=2) if args.json else text)
    return 0


def _cmd_query(args: argparse.Namespace) -> int:
    from analysis.query import run_query
    from analysis.store import open_db

    con = open_db(args.db)
    try:
        if not args.allow_files:  # the statement sees the store and nothing else: no file read, written or attached
            con.execute("SET enable_external_access = false")
        print(run_query(con, args.sql))
    finally:
        con.close()
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from analysis.query import export_parquet
    from analysis.store import open_db, refuse_store_files

    refuse_store_files(args.db, [Path(args.out)])
    con = open_db(args.db)
    try:
        n = export_parquet(con, args.table, args.out)
    finally:
        con.close()
    print(f"wrote {n} rows of {args.table} to {args.out}")
    return 0


def _cmd_publish(args: argparse.Namespace) -> int:
    from analysis.published import publish
    from analysis.store import open_db, refuse_store_files, resolve_sweep

    refuse_store_files(args.db, [Path(args.out)])
    con = open_db(args.db)
    try:
        sid = resolve_sweep(con, args.sweep)
        if sid is None:
            raise AnalysisError(f"database {args.db} holds no finished sweep to publish")
        counts = publish(con, sid, Path(args.out))
    finally:
        con.close()
    print(f"published sweep {sid} to {args.out}: " + ", ".join(f"{n} {t}" for t, n in counts.items()))
    return 0


def _summary(fits) -> str:
    from analysis.query import format_table

    rows = []
    for a in fits.archs:
        law = a.isoflop.n_opt if a.isoflop else None
        ci = law.ci_exponent if law and law.ci_exponent else (None, None)
        par = a.parametric
        rows.append([
            a.arch, a.n_points, len(a.isoflop.budgets_used) if a.isoflop else 0,
            law.exponent if law else None, *ci, par.a if par else None, par.E if par else None, len(a.notes),
        ])  # fmt: skip
    head = ["series", "runs", "budgets_inside", "N*_exponent", "ci_2.5%", "ci_97.5%", "param_a", "param_E", "notes"]
    return f"sweep {fits.sweep_id}\n" + format_table(head, rows)


def _cmd_fit(args: argparse.Namespace) -> int:
    from analysis.pipeline import fit_points, store_fits
    from analysis.store import held, load_points, resolve_sweep, session

    with held(args.db, write=True) as store, session(store) as con:
        sid = resolve_sweep(con, args.sweep)
        fits = fit_points(load_points(con, sid), sid, holdout=args.holdout, processes=None)
        n_rows = store_fits(con, fits)
    print(json.dumps(fits.to_dict(), indent=2) if args.json else _summary(fits) + f"\nwrote {n_rows} fits rows")
    return 0


def _cmd_forecast(args: argparse.Namespace) -> int:
    from analysis.pipeline import fit_points
    from analysis.store import load_points, resolve_sweep, session

    with session(args.db) as con:
        sid = resolve_sweep(con, args.sweep)
        points = load_points(con, sid)
    fits = fit_points(points, sid, holdout=args.holdout, processes=None)
    if args.json:
        print(json.dumps({a.arch: [f.to_dict() for f in a.forecasts] for a in fits.archs}, indent=2))
        return 0
    for a in fits.archs:
        skipped = [n for n in a.notes if n.startswith("forecast skipped")]
        print(f"{a.arch}: " + ("; ".join(skipped) if skipped else "\n" + _forecast_table(a.forecasts)))
    return 0


def _cmd_outputs(args: argparse.Namespace) -> int:
    from analysis.pipeline import OUTPUT_NAMES, run_all
    from analysis.store import refuse_store_files

    refuse_store_files(args.db, [Path(args.out), *(Path(args.out) / name for name in OUTPUT_NAMES)])
    is_report = args.command == "report"
    paths = run_all(
        args.db,
        args.sweep,
        args.out,
        holdout=args.holdout,
        store=is_report and args.store,
        report=is_report,
        processes=None,
    )
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def count(text: str) -> int:
    """argparse type of resample, start and row counts and seeds: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def decades(text: str) -> float:
    """argparse type of --c-bin-width: a finite number >= 0."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m analysis", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    f = sub.add_parser("fit-csv", help="fit scaling laws to a CSV of (N, C, loss[, D]) points")
    f.add_argument("path", help="CSV file with a header row")
    f.add_argument("--n-col", required=True, help="column of parameter counts N")
    f.add_argument("--c-col", required=True, help="column of training FLOPs C")
    f.add_argument("--loss-col", required=True, help="column of losses (nats)")
    f.add_argument("--d-col", help="column of training tokens D (default: D = C / (6 N))")
    f.add_argument("--drop-highest-loss", type=count, default=0, metavar="K", help="drop the K highest losses")
    f.add_argument("--method", choices=("parametric", "isoflop"), default="parametric")
    f.add_argument(
        "--holdout", type=count, default=0, metavar="K", help="forecast the largest K budgets from the others (0: none)"
    )
    f.add_argument(
        "--c-bin-width", type=decades, default=0.1, metavar="DECADES",
        help="isoflop: points whose log10 C round to the same multiple of this share a budget (0: exact C)",
    )  # fmt: skip
    f.add_argument(
        "--n-starts", type=count, default=32, help="parametric: L-BFGS-B runs from this many best grid starts (0: all)"
    )
    f.add_argument("--json", action="store_true", help="print JSON instead of a table")
    f.set_defaults(func=_cmd_fit_csv)

    q = sub.add_parser("query", help="run SQL on a store (read-only) and print a table")
    q.add_argument("--db", required=True, help="DuckDB store")
    q.add_argument("sql", help="one SQL statement")
    q.add_argument(
        "--allow-files", action="store_true", help="let the SQL read and write files (read_csv, COPY ... TO, ATTACH)"
    )
    q.set_defaults(func=_cmd_query)

    e = sub.add_parser("export", help="write a table or view to Parquet")
    e.add_argument("--db", required=True, help="DuckDB store")
    e.add_argument("table", help="table or view name")
    e.add_argument("out", help="output .parquet path")
    e.set_defaults(func=_cmd_export)

    pub = sub.add_parser("publish", help="write one sweep's rows as Parquet files and a README (machine, commit)")
    pub.add_argument("--db", required=True, help="DuckDB store")
    pub.add_argument("--sweep", help="sweep id (default: the sweep with the newest finished run)")
    pub.add_argument("--out", required=True, help="output folder (created); --db of any command takes it")
    pub.set_defaults(func=_cmd_publish)

    for name, help_ in (
        ("fit", "fit a sweep (isoFLOP parabolas, power laws, parametric, forecast) and write the fits table"),
        ("forecast", "predict a sweep's largest budgets from the others and compare (read-only)"),
        ("plot", "write the figures of a sweep (read-only)"),
        ("report", "write figures and report.md of a sweep (read-only unless --store)"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--db", required=True, help="DuckDB store")
        s.add_argument("--sweep", help="sweep id (default: the sweep with the newest finished run)")
        s.add_argument(
            "--holdout", type=count, default=1, metavar="K",
            help="forecast the largest K budgets from the others (0: none)",
        )  # fmt: skip
        if name in ("fit", "forecast"):
            s.add_argument("--json", action="store_true", help="print JSON instead of a table")
            s.set_defaults(func=_cmd_fit if name == "fit" else _cmd_forecast)
        else:
            s.add_argument("--out", required=True, help="output folder (created)")
            s.set_defaults(func=_cmd_outputs)
        if name == "report":
            s.add_argument("--store", action="store_true", help="also write the fits table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # overflow in rejected starts; results carry notes
            return args.func(args)
    except (AnalysisError, StoreError) as e:
        sys.stderr.write(f"error: {_one_line(e)}\n")
    except duckdb.Error as e:
        sys.stderr.write(f"error: {_one_line(e)}\n")
    except OSError as e:
        sys.stderr.write(f"error: {_one_line(e)}\n")
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI promises one line, never a traceback
        sys.stderr.write(f"error: internal error ({type(e).__name__}): {_one_line(e)}\n")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
