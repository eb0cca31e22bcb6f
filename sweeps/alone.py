"""``python -m sweeps alone``: each shape of a sweep's finished runs trained alone on this device for a few steps.

Runs that share a GPU (``sweep.workers_per_gpu > 1``) train at a rate set as much by what runs beside them as by
their own cost: the same shape ran 60% faster in one part of an H200 sweep than in another. The time-matched view
needs each run's own cost, so this command trains every shape (one per model config: runs of a shape differ in
seed, budget and steps only) alone, with the sweep's train settings, for ``steps`` steps, and stores its steady
tokens/s in ``alone_rates``; the report then prices each run at tokens / that rate. Shapes already measured are
skipped, so a stopped command resumes; the database's write lock is held throughout, as a sweep holds it.
"""

from __future__ import annotations

import json
from dataclasses import replace

from mixdepth import results
from mixdepth.config import ConfigError, DataConfig, TrainConfig
from mixdepth.launch import check_devices, resolve_device
from mixdepth.models import MODELS
from mixdepth.train import RunConfig, device_name
from sweeps.paths import SweepPaths
from sweeps.pool import fit_fresh

MIN_STEPS = 20  # the throughput window is the last half of the steps


def pending(con, sweep_id: str) -> list[tuple[str, str, dict]]:
    """(shape key, arch, stored config) of every shape of the sweep's finished runs without a rate yet."""
    rows = con.execute(
        f"SELECT {results.SHAPE_KEY} AS shape, min(arch), min(CAST(config AS VARCHAR)) FROM runs"
        " WHERE sweep_id = ? AND status = 'ok' AND config IS NOT NULL GROUP BY shape"
        " HAVING shape NOT IN (SELECT shape FROM alone_rates WHERE sweep_id = ?) ORDER BY 2, 3",
        [sweep_id, sweep_id],
    ).fetchall()
    return [(shape, arch, json.loads(config)) for shape, arch, config in rows]


def run_config(config: dict, steps: int) -> RunConfig:
    """The stored run's model, data and train settings for ``steps`` steps alone on one device: no progress bar,
    logger or checkpoints."""
    model = MODELS[config["model"]["arch"]][0](**config["model"])
    t = TrainConfig(**config["train"])
    t = replace(t, progress=False, logger="none", ckpt_every=None, keep_ckpt=False, devices=1, num_nodes=1,
                strategy="auto")  # fmt: skip
    return RunConfig(model, DataConfig(**config["data"]), t, steps)


def measure(paths: SweepPaths, sweep_id: str | None, steps: int) -> int:
    """Measure the sweep's (the newest one's when None) unmeasured shapes; returns how many were measured.

    Raises:
        ConfigError: ``steps`` below MIN_STEPS, the sweep's train settings need devices this host lacks, or its
            runs trained on another kind of device.
        mixdepth.results.StoreError: the database is missing, in use by another writer or unwritable, or the sweep
            has no finished runs.
    """
    from analysis.errors import AnalysisError
    from analysis.store import resolve_sweep

    if steps < MIN_STEPS:
        raise ConfigError(f"--steps must be at least {MIN_STEPS}, got {steps}")
    if not paths.db.is_file():
        raise results.StoreError(f"database {paths.db} does not exist")
    with results.writer(paths.db) as w:
        with w.session() as con:
            try:
                sid = resolve_sweep(con, sweep_id)
            except AnalysisError as e:
                raise results.StoreError(str(e)) from None
            todo = pending(con, sid)
            devices = sorted(d for (d,) in con.execute(
                "SELECT DISTINCT device FROM runs WHERE sweep_id = ? AND status = 'ok'", [sid]).fetchall())  # fmt: skip
        runs = [(shape, arch, run_config(config, steps)) for shape, arch, config in todo]
        if runs:  # one train section for the whole sweep: its devices are checked once, before any training
            check_devices(runs[0][2].train)
            here = device_name(resolve_device(runs[0][2].train)[0])
            if here.split(":")[0] not in {d.split(":")[0] for d in devices}:  # a CPU's name also says its threads
                raise ConfigError(f"the sweep's runs trained on {', '.join(devices)}; this process runs on {here}")
        print(f"sweep {sid}: {len(runs)} shape{'s' * (len(runs) != 1)} to time alone, {steps} steps each", flush=True)
        for k, (shape, arch, run) in enumerate(runs, 1):
            m = fit_fresh(run).metrics
            row = {
                "sweep_id": sid, "shape": shape, "arch": arch, "d_model": run.model.d_model,
                "n_layers": run.model.n_layers, "steps": steps, "tokens_per_s": m.tokens_per_s, "mfu": m.mfu,
                "peak_flops": m.peak_flops, "device": m.device, "versions": m.versions,
            }  # fmt: skip
            with w.session() as con:
                results.put_alone_rate(con, row)
            mfu = f", MFU {m.mfu:.1%}" if m.mfu is not None else ""
            print(f"[{k}/{len(runs)}] {arch} d_model={run.model.d_model} layers={run.model.n_layers}:"
                  f" {m.tokens_per_s:,.0f} tokens/s alone{mfu}", flush=True)  # fmt: skip
    return len(runs)
