"""Scaling-law analysis for mixdepth sweeps: fitters, plots, report and SQL access to the store.

Torch-free by design: this package reads only the DuckDB store (``mixdepth.results``) or plain CSV files.

Entry points:
    ``python -m analysis <command>`` (see ``analysis.__main__``), and for the sweep runner
    ``analysis.pipeline.run_all(db, sweep_id, out_dir)``.

The names below are imported lazily so that ``python -m analysis query`` does not pay for scipy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AnalysisError": "analysis.errors",
    "IsoflopFit": "analysis.records",
    "ParabolaFit": "analysis.records",
    "ParametricFit": "analysis.records",
    "PowerLaw": "analysis.records",
    "fit_isoflop": "analysis.isoflop",
    "fit_parabola": "analysis.isoflop",
    "fit_power_law": "analysis.isoflop",
    "fit_parametric": "analysis.parametric",
    "run_all": "analysis.pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
