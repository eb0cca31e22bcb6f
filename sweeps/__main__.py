"""``python -m sweeps isoflop [--preset NAME] [--db PATH] [--conf DIR] [--dry-run | --enqueue-only | --print-config |
--time-limit T] [key=value ...]``,
``worker --storage URL [--sweep ID] [--workers N] [--time-limit T] [train.key=value ...]``,
``collect --storage URL [--db PATH] [--sweep ID]``, ``alone [--db PATH] [--sweep ID] [--steps N]`` and
``status [--db PATH] [--storage URL]``.

The one place that knows paths: the config folder (read once by ``load_config``: ``--conf``, else the presets that
ship inside the package), the DuckDB store, the Optuna journal beside it, the report, checkpoint and logger folders;
everything below takes them as arguments.
"""

from __future__ import annotations

import argparse
import signal
import sys
from contextlib import nullcontext
from importlib import resources
from pathlib import Path

from sweeps.paths import SweepPaths


def _conf(given: Path | None):
    """The config folder as a path (a context manager): ``--conf``, else the presets shipped as package data
    (``sweeps/conf``: in a checkout a link to the top-level conf/; in a wheel, copies). A pip install unpacks them on
    disk, so ``as_file`` hands over their folder as it is."""
    return nullcontext(given) if given is not None else resources.as_file(resources.files("sweeps") / "conf")


def _paths(db: Path) -> SweepPaths:
    """The store and, beside it, the Optuna journal and the report folders (the one place they are named)."""
    from mixdepth.results import journal_path

    db = db.expanduser().absolute()
    return SweepPaths(
        db=db,
        journal=journal_path(db),
        reports=db.parent / f"{db.stem}_report",
        checkpoints=db.parent / f"{db.stem}_checkpoints",
        logs=db.parent / f"{db.stem}_logs",
    )


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (a scheduler's stop) cleans up like Ctrl-C: workers killed, no partial rows


LIMIT_HELP = (
    "start only runs predicted to end within this time from the command's start (seconds, or 9m, 1.5h); the rest"
    " stay queued for the next command (exit code 75)"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sweeps", description="Scaling-law sweeps for the MoD family.")
    sub = p.add_subparsers(dest="cmd", required=True)
    iso = sub.add_parser("isoflop", help="run an isoFLOP grid: budgets x size ladder x archs")
    iso.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. train.lr=1e-3)")
    iso.add_argument("--preset", default="isoflop", help="conf/sweep/<preset>.yaml (default: isoflop, CPU)")
    iso.add_argument("--db", type=Path, default=Path("results.db"), help="DuckDB file (default: results.db)")
    iso.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    iso.add_argument("--enqueue-only", action="store_true", help="queue the runs in sweep.storage for workers and exit")
    iso.add_argument("--print-config", action="store_true", help="print the merged, typed config as YAML and exit")
    iso.add_argument("--conf", type=Path, help="config folder (default: the presets installed with mixdepth)")
    iso.add_argument("--time-limit", help=LIMIT_HELP)
    st = sub.add_parser("status", help="list the sweeps of a database: planned, running, finished, failed")
    st.add_argument("--db", type=Path, default=Path("results.db"), help="DuckDB file (default: results.db)")
    st.add_argument("--storage", help="the sweeps' storage URL (default: the journal beside the database)")
    wk = sub.add_parser("worker", help="train the queued runs of a storage's sweeps until none are left")
    wk.add_argument("--storage", required=True, help="storage URL, e.g. postgresql+psycopg://user@host/db")
    wk.add_argument("--sweep", help="only this sweep id (default: every sweep in the storage)")
    wk.add_argument("--workers", type=int, default=0, help="runs at once (default: one per visible GPU, else 1)")
    wk.add_argument("overrides", nargs="*", help="this host's train keys, e.g. train.devices=2 train.ckpt_dir=/x")
    wk.add_argument("--time-limit", help=LIMIT_HELP)
    al = sub.add_parser("alone", help="time each shape of a sweep's runs alone on this device (time-matched view)")
    al.add_argument("--db", type=Path, default=Path("results.db"), help="DuckDB file (default: results.db)")
    al.add_argument("--sweep", help="sweep id (default: the one with the newest run)")
    al.add_argument("--steps", type=int, default=100, help="training steps per shape (default: 100)")
    co = sub.add_parser("collect", help="store the finished runs of a storage's sweeps in a database")
    co.add_argument("--storage", required=True, help="storage URL")
    co.add_argument("--db", type=Path, default=Path("results.db"), help="DuckDB file (default: results.db)")
    co.add_argument("--sweep", help="only this sweep id (default: every sweep in the storage)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)

    from mixdepth.results import StoreError, io_fault
    from sweeps.queue import StorageError, storage_fault

    def fault(e: Exception) -> str | None:  # a filesystem or storage fault behind e, as one line
        return io_fault(e) or storage_fault(e, getattr(args, "storage", None) or "")

    if args.cmd in ("status", "collect"):  # torch-free: the store and the Optuna storage only
        from sweeps.status import collect, status_table

        try:
            if args.cmd == "collect":
                collect(args.storage, _paths(args.db), args.sweep)
            else:
                print(status_table(_paths(args.db), args.storage))
            return 0
        except (StoreError, StorageError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except Exception as e:
            if (why := fault(e)) is None:
                raise
            print(f"error: {why}", file=sys.stderr)
            return 1

    from mixdepth.config import ConfigError, DataError

    try:
        signal.signal(signal.SIGTERM, _interrupt)
        limit = None
        if getattr(args, "time_limit", None) is not None:
            from sweeps.deadline import parse

            limit = parse(args.time_limit)
        if args.cmd == "alone":
            from sweeps.alone import measure

            measure(_paths(args.db), args.sweep, args.steps)
            return 0
        if args.cmd == "worker":
            from sweeps.worker import serve

            if args.workers < 0:
                raise ConfigError(f"--workers must be at least 0, got {args.workers}")
            return serve(args.storage, args.sweep, args.workers, args.overrides, limit)
        from mixdepth.config import load_config
        from sweeps.provenance import command
        from sweeps.runner import public_config, run_isoflop

        modes = ("dry-run", "enqueue-only", "print-config", "time-limit")
        modes = [f"--{m}" for m in modes if getattr(args, m.replace("-", "_")) not in (None, False)]
        if len(modes) > 1:
            raise ConfigError(f"{' and '.join(modes)} exclude each other")
        with _conf(args.conf) as conf:
            lab = load_config(conf, args.preset, args.overrides)
        if args.print_config:  # the sections as a preset would hold them; nothing is opened
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(public_config(lab)), end="")
            return 0
        return run_isoflop(
            lab,
            args.preset,
            _paths(args.db),
            dry_run=args.dry_run,
            enqueue_only=args.enqueue_only,
            command=command(argv),
            time_limit=limit,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (DataError, StoreError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.cmd == "worker":
            print("interrupted: finished runs are in the storage, unfinished ones queued again", file=sys.stderr)
        elif args.cmd == "alone":
            print("interrupted: the shapes timed so far are in the database; rerun to time the rest", file=sys.stderr)
        else:
            print("interrupted: finished runs are in the database; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as e:  # a write the sweep makes failed: the journal, the database, the storage, the report
        if (why := fault(e)) is None:
            raise  # a bug: keep its traceback
        kept = "the storage" if args.cmd == "worker" else "the database"
        print(f"error: {why}; finished runs are in {kept}, rerun once that is fixed", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
