"""Finished runs from a storage into a database: ``python -m sweeps collect`` and the local sweep's own hand-over.

Idempotent by run_id: a run already in the database is left as it is, so any number of collects (and workers,
and retries) leave exactly one row per grid point.
"""

from __future__ import annotations

import optuna

from mixdepth import results
from sweeps import queue


def collect_study(con, study: optuna.Study, meta: dict) -> int:
    """Store the sweep row and every finished run of ``study`` the database lacks (one transaction for the runs);
    returns how many runs were added."""
    done = results.finished_run_ids(con)
    new = [pair for rid, pair in queue.finished(study).items() if rid not in done]
    results.add_sweep(con, meta["sweep_id"], meta["name"], meta["preset"], meta["config"], meta.get("provenance"))
    results.add_runs(con, new)
    return len(new)


def selected(storage: optuna.storages.BaseStorage, where: str, sweep: str | None) -> dict[str, dict]:
    """The sweeps of a storage to work on: the one named, or all of them.

    Raises:
        queue.StorageError: the sweep is not in the storage, or the storage holds none.
    """
    found = queue.sweeps_in(storage)
    if sweep is not None:
        if sweep not in found:
            held = ", ".join(found) or "no sweeps"
            raise queue.StorageError(f"sweep {sweep} is not in storage {queue.redact(where)} (it holds {held})")
        return {sweep: found[sweep]}
    if not found:
        raise queue.StorageError(f"storage {queue.redact(where)} holds no mixdepth sweeps")
    return found
