"""``python -m sweeps status``: each sweep in a database with planned, finished and failed runs."""

from __future__ import annotations

import sys
from pathlib import Path

from mixdepth import results
from sweeps.journal import damage
from sweeps.journal import storage as journal_storage
from sweeps.paths import SweepPaths


def _queue_counts(journal: Path) -> dict[str, tuple[int, int]]:
    """sweep_id -> (planned runs, failed attempts) from the Optuna journal; nothing (shown "?") from a damaged
    one, which is left as it is (the next sweep run repairs it) with one warning line on stderr. An attempt is a
    trial that started: queued trials that a killed sweep never began are failed on the next start, not tried."""
    if not journal.exists():
        return {}
    if d := damage(journal):
        print(f"warning: journal {journal}: {d.why}; the next sweep run repairs it", file=sys.stderr)
        return {}
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = journal_storage(journal)
    out = {}
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        fails = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
        failed = sum(t.datetime_start is not None for t in fails)
        out[summary.study_name] = (len(study.user_attrs.get("run_ids", [])), failed)
    return out


def status_table(paths: SweepPaths) -> str:
    """A fixed-width table of the database's sweeps, with planned runs and failed attempts from the journal."""
    con = results.connect(paths.db, read_only=True)
    try:
        rows = con.execute(
            "SELECT s.sweep_id, s.name, s.preset, strftime(s.created_at, '%Y-%m-%d %H:%M'),"
            " count(r.run_id) FILTER (WHERE r.status = 'ok'), count(r.run_id) FILTER (WHERE r.status = 'diverged'),"
            " min(r.val_loss) FROM sweeps s LEFT JOIN runs r USING (sweep_id) GROUP BY ALL ORDER BY 4"
        ).fetchall()
    finally:
        con.close()
    queue = _queue_counts(paths.journal)
    head = ("sweep", "name", "preset", "created", "planned", "ok", "diverged", "failed attempts", "best val_loss")
    body = []
    for sid, name, preset, created, ok, diverged, best in rows:
        planned, failed = queue.get(sid, (None, None))
        body.append(
            (
                sid,
                name,
                preset,
                created,
                "?" if planned is None else str(planned),
                str(ok),
                str(diverged),
                "?" if failed is None else str(failed),
                "-" if best is None else f"{best:.4f}",
            )
        )
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in body]) if body else "no sweeps in " + str(paths.db)
