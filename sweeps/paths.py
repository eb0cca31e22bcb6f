"""Where a sweep keeps its state. Only the CLI (sweeps/__main__.py) decides these paths; the rest takes them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SweepPaths:
    db: Path  # the DuckDB store: the record of every run (one writing process at a time)
    journal: Path  # the Optuna journal: the work queue and the resume state
    reports: Path  # report folders, one per sweep id
    checkpoints: Path  # checkpoint folders of runs, one per run_id (unless train.ckpt_dir says elsewhere)
    logs: Path  # train.logger's files: <sweep_id>/<run_id>/ of each run (mlflow: <sweep_id>/mlruns)
