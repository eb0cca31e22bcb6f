"""What a planned sweep costs where its shapes were timed alone before (``python -m sweeps alone`` on an earlier
sweep's database): its runs' steps one after another at those rates, and the share of the device's peak their
training FLOPs would use there, the most any schedule of them reaches (start-up, compilation and evaluation come on
top). ``python -m sweeps isoflop --dry-run`` prints it when its ``--db`` holds such rates.

A shape is the run's model config and batch size; the rates are those of the device whose shapes were timed most
recently (the newest rate of each shape), measured with their own sweep's train settings.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from mixdepth import results
from sweeps.plan import Trial


def stored_rates(db: Path) -> tuple[str, float | None, dict[tuple[str, int], float]]:
    """(device, its peak FLOP/s or None, {shape: tokens/s alone}) of the device timed last in ``db``; ("", None, {})
    when no shape was timed alone there."""
    con = results.connect(db, read_only=True)
    try:
        tables = {t for (t,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if not {"runs", "alone_rates"} <= tables:  # another file, or a store older than ``sweeps alone``
            return "", None, {}
        rows = con.execute(
            "SELECT a.device, a.peak_flops, a.tokens_per_s, CAST(r.config AS VARCHAR) FROM alone_rates a JOIN"
            f" (SELECT sweep_id, {results.SHAPE_KEY} AS shape, any_value(config) AS config FROM runs"
            " WHERE config IS NOT NULL GROUP BY ALL) r USING (sweep_id, shape) ORDER BY a.measured_at"
        ).fetchall()
    finally:
        con.close()
    if not rows:
        return "", None, {}
    device, peak = rows[-1][0], rows[-1][1]
    rates = {}
    for dev, _, tokens_per_s, config in rows:
        if dev == device:
            c = json.loads(config)
            rates[shape(c["model"], c["train"]["batch_size"])] = tokens_per_s
    return device, peak, rates


def shape(model: dict, batch_size: int) -> tuple[str, int]:
    """A run's shape: its model config (as sorted JSON) and batch size."""
    return json.dumps(model, sort_keys=True), batch_size


def lines(trials: list[Trial], batch_size: int, db: Path) -> list[str]:
    """The dry run's lines on what ``trials`` (trained at ``batch_size``) cost at ``db``'s alone rates; none where it
    holds none (or is in use by a sweep)."""
    try:
        device, peak, rates = stored_rates(db)
    except results.StoreError as e:
        return [f"note: no cost at stored rates: {e}"]
    if not rates:
        return []
    keys = [shape(asdict(t.model), batch_size) for t in trials]
    timed = [(t, rates[k]) for t, k in zip(trials, keys, strict=True) if k in rates]
    untimed = sorted({(t.arch, t.model.d_model, t.model.n_layers) for t, k in zip(trials, keys, strict=True)
                      if k not in rates})  # fmt: skip
    seconds = sum(t.tokens / tokens_per_s for t, tokens_per_s in timed)
    flops = sum(t.train_flops for t, _ in timed)
    out = [
        f"cost at the rates its shapes trained alone on {device} ({db.name}, `python -m sweeps alone`): {len(timed)}"
        f" of its {len(trials)} runs, whose steps one after another take {seconds / 60:.1f} device-minutes"
    ]
    if timed and peak:
        out[0] += (
            f" and use {flops / (seconds * peak):.1%} of its peak ({peak:.4g} FLOP/s), the most a sweep of them"
            " reaches before start-up, compilation and evaluation"
        )
    if untimed:
        out.append(
            "not timed alone there, not counted: " + ", ".join(f"{a} d_model={d} layers={n}" for a, d, n in untimed)
        )
    return out
