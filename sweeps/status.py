"""``python -m sweeps status`` (each sweep of a database and its storage: planned, finished, queued, running with
the host that holds each run, failed attempts) and ``python -m sweeps collect`` (finished runs into a database)."""

from __future__ import annotations

import sys

from mixdepth import results
from sweeps import queue
from sweeps.collect import collect_study, selected
from sweeps.journal import damage
from sweeps.paths import SweepPaths


def _storage(paths: SweepPaths, where: str | None):
    """The storage to read: the URL given, else the journal beside the database; None for an absent journal or
    a damaged one, which is left as it is (the next sweep run repairs it) with one warning line on stderr."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if where is not None:
        return queue.open_storage(where, create=False)
    if not paths.journal.exists():
        return None
    if d := damage(paths.journal):
        print(f"warning: journal {paths.journal}: {d.why}; the next sweep run repairs it", file=sys.stderr)
        return None
    return queue.open_storage(str(paths.journal), create=False)


def _db_rows(paths: SweepPaths, required: bool) -> dict[str, tuple]:
    """sweep_id -> (name, preset, created, ok, diverged, best, GPU utilisation) from the database."""
    if not required and not paths.db.exists():
        return {}
    con = results.connect(paths.db, read_only=True)
    try:
        used = results.sweep_utilisation(con)
        rows = con.execute(
            "SELECT s.sweep_id, s.name, s.preset, strftime(s.created_at, '%Y-%m-%d %H:%M'),"
            " count(r.run_id) FILTER (WHERE r.status = 'ok'), count(r.run_id) FILTER (WHERE r.status = 'diverged'),"
            " min(r.val_loss) FROM sweeps s LEFT JOIN runs r USING (sweep_id) GROUP BY ALL ORDER BY 4"
        ).fetchall()
    finally:
        con.close()
    return {r[0]: (*r[1:], _utilisation(used.get(r[0]))) for r in rows}


def _utilisation(used: tuple | None) -> str:
    """The GPU utilisation column: over every command of the sweep that trained; '-' for none, 'n/a' on CPU."""
    if used is None:
        return "-"
    share, wall, commands = used
    return "n/a" if share is None else f"{share:.1%} ({commands} cmd, {wall:.0f} s)"


def _fixed_width(head: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head)] + [fmt.format(*r) for r in body]


def status_table(paths: SweepPaths, where: str | None = None) -> str:
    """Fixed-width tables: the sweeps (finished runs from the database; planned, queued, running and failed
    attempts from the storage), then each running run with the host that holds it."""
    db = _db_rows(paths, required=where is None)
    counts: dict[str, queue.Counts] = {}
    with queue.closing(_storage(paths, where)) as storage:
        metas = queue.sweeps_in(storage) if storage is not None else {}
        for name, meta in metas.items():
            counts[name] = queue.counts(queue.load(storage, name), meta)
    ids = list(db) + [sid for sid in metas if sid not in db]
    if not ids:
        return f"no sweeps in {queue.redact(where) if where else paths.db}"
    body, running = [], []
    for sid in ids:
        name, preset, created, ok, diverged, best, util = db.get(sid) or (
            metas[sid]["name"],
            metas[sid]["preset"],
            "-",
            0,
            0,
            None,
            "-",
        )
        c = counts.get(sid)
        queued = ("?",) * 5 if c is None else map(str, (c.planned, c.finished, c.queued, len(c.running), c.failed))
        planned, finished, *rest = queued
        body.append(
            (sid, name, preset, created, planned, str(ok), str(diverged), finished, *rest)
            + ("-" if best is None else f"{best:.4f}", util)
        )
        running += [(sid, rid, host, since) for rid, host, since in (c.running if c else [])]
    head = (
        "sweep",
        "name",
        "preset",
        "created",
        "planned",
        "ok",
        "diverged",
        "finished",
        "queued",
        "running",
        "failed attempts",
        "best val_loss",
        "GPU utilisation",
    )
    lines = _fixed_width(head, body)
    if running:
        lines += ["", *_fixed_width(("running sweep", "run_id", "host", "started"), running)]
    return "\n".join(lines)


def collect(where: str, paths: SweepPaths, sweep: str | None) -> None:
    """Store the finished runs of the storage's sweeps (or of ``sweep``) that the database lacks."""
    if not queue.is_url(where):
        raise queue.StorageError(f"--storage {where} is not a database URL")
    with queue.closing(_storage(paths, where)) as storage:
        chosen = selected(storage, where, sweep)  # before the database is opened: a wrong sweep writes nothing
        with results.writer(paths.db) as store:
            for name, meta in chosen.items():
                with store.session() as con:
                    added = collect_study(con, queue.load(storage, name), meta)
                print(f"sweep {name}: {added} runs added to {paths.db}")
