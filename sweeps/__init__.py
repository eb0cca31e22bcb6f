"""Sweep runner: plan -> Optuna work queue -> train.fit -> DuckDB -> fits, plots, report."""
