"""``python -m sweeps.bench --storage URL``: what the storage costs a sweep, on a real Optuna RDB.

Two figures, each on a fresh study of synthetic runs shaped like real ones (a full row, a 100-point curve):
the overhead per run of the queue (enqueue, take, heartbeat, hand the result over, tell), median over
``--runs``; and the wall time of collecting ``--collect`` finished runs into an empty DuckDB file.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import optuna

from mixdepth import results
from mixdepth.config import DataConfig, TrainConfig
from mixdepth.models import MODELS
from mixdepth.train import RunConfig
from sweeps import queue
from sweeps.collect import collect_study


def _payload(i: int) -> dict:
    model = MODELS["dense"][0](d_model=64, n_layers=2, n_heads=2, n_kv_heads=2)
    run = RunConfig(model=model, data=DataConfig(), train=TrainConfig(), steps=1000)
    row = {"run_id": f"bench-{i}", "sweep_id": "bench", "arch": "dense", "budget": 1e12, "steps": 1000}
    row |= {"d_model": 64, "n_layers": 2, "params_nonembed": 100_000, "tokens": 2_048_000, "train_flops": 1.2e12}
    row["config"] = {"model": asdict(model), "data": asdict(run.data), "train": asdict(run.train)}
    return queue.encode_run(run, row)


def _result(i: int) -> tuple[results.RunMetrics, list[dict]]:
    metrics = results.RunMetrics(
        status="ok",
        val_loss=3.0 + i * 1e-4,
        val_loss_causal=None,
        train_loss=3.1,
        wall_s=10.0,
        tokens_per_s=1e5,
        mfu=None,
        peak_flops=None,
        device="cpu",
        precision="32-true",
        versions={"torch": "x"},
        corpus="stdlib",
        corpus_fingerprint="f" * 16,
        routing_stats=None,
    )
    curve = [
        {"step": s, "tokens": s * 2048, "flops": s * 1e9, "train_loss": 5.0 - s * 1e-3, "lr": 1e-3}
        for s in range(10, 1010, 10)
    ]
    return metrics, curve


def _study(storage, name: str) -> optuna.Study:
    meta = {"sweep_id": name, "name": name, "preset": "bench", "config": {}, "run_ids": []}
    study = optuna.create_study(study_name=name, storage=storage)
    study.set_user_attr(queue.SWEEP_ATTR, meta)
    return study


def per_run_overhead(storage, n: int) -> tuple[float, list[float]]:
    """Seconds per run to enqueue ``n`` runs (one call, as a sweep does), and each run's seconds to take it,
    beat once, hand its result over and tell, with the others still queued."""
    study = _study(storage, f"bench-queue-{uuid.uuid4().hex[:8]}")
    start = time.perf_counter()
    queue.enqueue(study, [_payload(i) for i in range(n)])
    enqueue_s = (time.perf_counter() - start) / n
    out = []
    for i in range(n):
        start = time.perf_counter()
        trial = queue.pop(study)
        storage.record_heartbeat(trial._trial_id)
        queue.finish(trial, *_result(i))
        out.append(time.perf_counter() - start)
    return enqueue_s, out


def collect_time(storage, n: int) -> float:
    """Seconds to collect ``n`` finished runs into an empty database."""
    name = f"bench-collect-{uuid.uuid4().hex[:8]}"
    study = _study(storage, name)
    metrics, curve = _result(0)
    for i in range(n):
        p = _payload(i)
        study.add_trial(
            optuna.trial.create_trial(
                value=3.0, user_attrs={"run": p, "result": {"metrics": asdict(metrics), "curve": curve}}
            )
        )
    with tempfile.TemporaryDirectory() as tmp:
        con = results.connect(Path(tmp) / "bench.db")
        start = time.perf_counter()
        added = collect_study(con, study, study.user_attrs[queue.SWEEP_ATTR])
        took = time.perf_counter() - start
        con.close()
    assert added == n, f"collected {added} of {n} runs"
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sweeps.bench", description=__doc__.splitlines()[0])
    p.add_argument("--storage", required=True, help="an Optuna RDB URL, e.g. postgresql+psycopg://u@127.0.0.1/db")
    p.add_argument("--runs", type=int, default=50, help="runs for the per-run overhead (default 50)")
    p.add_argument("--collect", type=int, default=1000, help="finished runs to collect (default 1000)")
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = queue.open_storage(args.storage, create=True, heartbeat_interval=60, grace_period=180)
    enqueue_s, times = per_run_overhead(storage, args.runs)
    print(f"storage {queue.redact(args.storage)}, {args.runs} runs queued: enqueue {enqueue_s:.3f} s per run")
    print(f"take + heartbeat + result + tell per run: median {statistics.median(times):.3f} s, max {max(times):.3f} s")
    print(f"collect {args.collect} finished runs into a new DuckDB file: {collect_time(storage, args.collect):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
