"""``python -m sweeps isoflop [--preset NAME] [--db PATH] [--conf DIR] [--dry-run] [key=value ...]`` and
``status [--db PATH]``.

The one place that knows paths: the config folder (read once by ``load_config``), the DuckDB store, the Optuna
journal beside it and the report folders; everything below takes them as arguments.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from sweeps.paths import SweepPaths

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _paths(db: Path) -> SweepPaths:
    """The store and, beside it, the Optuna journal and the report folders (the one place they are named)."""
    from mixdepth.results import journal_path

    db = db.expanduser().absolute()
    return SweepPaths(db=db, journal=journal_path(db), reports=db.parent / f"{db.stem}_report")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (a scheduler's stop) cleans up like Ctrl-C: workers killed, no partial rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sweeps", description="Scaling-law sweeps for the MoD family.")
    sub = p.add_subparsers(dest="cmd", required=True)
    iso = sub.add_parser("isoflop", help="run an isoFLOP grid: budgets x size ladder x archs")
    iso.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. train.lr=1e-3)")
    iso.add_argument("--preset", default="isoflop", help="conf/sweep/<preset>.yaml (default: isoflop, CPU)")
    iso.add_argument("--db", type=Path, default=Path("results.db"), help="DuckDB file (default: results.db)")
    iso.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    iso.add_argument("--conf", type=Path, default=CONF_DIR, help="config folder (default: this checkout's conf/)")
    st = sub.add_parser("status", help="list the sweeps of a database: planned, finished, failed")
    st.add_argument("--db", type=Path, default=Path("results.db"), help="DuckDB file (default: results.db)")
    args = p.parse_args(argv)

    from mixdepth.results import StoreError, io_fault

    if args.cmd == "status":  # torch-free: reads the store and the Optuna journal only
        from sweeps.status import status_table

        try:
            print(status_table(_paths(args.db)))
            return 0
        except StoreError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except Exception as e:
            if (fault := io_fault(e)) is None:
                raise
            print(f"error: {fault}", file=sys.stderr)
            return 1

    from mixdepth.config import ConfigError, DataError

    try:
        from mixdepth.config import load_config
        from sweeps.runner import run_isoflop

        lab = load_config(args.conf, args.preset, args.overrides)
        signal.signal(signal.SIGTERM, _interrupt)
        return run_isoflop(lab, args.preset, _paths(args.db), dry_run=args.dry_run)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (DataError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished runs are in the database; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as e:  # a write the sweep makes failed: the journal, the database, the report, ...
        if (fault := io_fault(e)) is None:
            raise  # a bug: keep its traceback
        print(f"error: {fault}; finished runs are in the database, rerun once that is fixed", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
