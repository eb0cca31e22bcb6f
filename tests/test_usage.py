"""Sweep utilisation (mixdepth.usage): the arithmetic of its parts, and what a sweep stores, prints and reports."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from types import SimpleNamespace

import duckdb
import pytest

from mixdepth import results, usage

CONF = Path(__file__).resolve().parents[1] / "conf"


def _metrics(wall, tokens_per_s, setup=1.0, evaluation=2.0, mfu=0.4, peak=1e15):
    return SimpleNamespace(
        wall_s=wall, tokens_per_s=tokens_per_s, setup_s=setup, eval_s=evaluation, mfu=mfu, peak_flops=peak
    )


def test_parts_sum_to_the_device_time_and_utilisation_is_flops_over_it():
    u = usage.Usage("s", slots=2, gpus=1, sharing="mps", started=100.0)
    u.training, u.trained = 110.0, 150.0  # 10 s start-up, 40 s of training on two slots sharing one GPU
    u.add(
        _metrics(wall=30.0, tokens_per_s=1e4), tokens=200_000, train_flops=6e15, steps=100
    )  # 20 s steady, 10 s warm-up
    u.add(_metrics(wall=20.0, tokens_per_s=1e4, mfu=0.2), tokens=100_000, train_flops=2e15, steps=50)
    row = u.row(now=160.0)  # 10 s of analysis
    p = row["parts"]
    assert row["wall_s"] == 60.0 and row["runs"] == 2 and row["train_flops"] == 8e15
    assert row["utilisation"] == pytest.approx(8e15 / (60.0 * 1 * 1e15))
    # two slots on one GPU: each slot-second is half a GPU-second
    assert p["start-up"] == 10.0 and p["analysis"] == 10.0
    assert p["training steps"] == pytest.approx((20 + 10) / 2)
    assert p["compilation and first steps"] == pytest.approx((10 + 10) / 2)
    assert p["run set-up"] == pytest.approx(1.0) and p["evaluation"] == pytest.approx(2.0)
    assert p["idle or between runs"] == pytest.approx((2 * 40 - (30 + 20 + 2 + 4)) / 2)
    assert sum(p[k] for k in usage.PARTS) == pytest.approx(60.0)
    assert p["runs_mfu"] == pytest.approx((0.4 * 6 + 0.2 * 2) / 8)
    head, parts = usage.lines(row)
    assert head == (
        "sweep utilisation 13.3%: 8e+15 training FLOPs over 60 s x 1 GPU x 1e+15 FLOP/s peak"
        " (runs sharing a GPU under MPS)"
    )
    assert p["sharing"] == "mps"
    assert usage.lines({**row, "parts": {**p, "sharing": "unshared"}})[0].endswith("FLOP/s peak")
    assert "start-up 16.7%" in parts and "training steps 25.0% (the runs' MFU 35.0%, FLOP-weighted)" in parts


def test_a_resumed_run_counts_only_what_this_command_trained():
    u = usage.Usage("s", slots=1, gpus=2, started=0.0)
    u.training, u.trained = 0.0, 10.0
    u.add(_metrics(wall=8.0, tokens_per_s=1e5), tokens=1_000_000, train_flops=4e15, steps=400, resumed=300)
    row = u.row(now=10.0)
    assert row["train_flops"] == 1e15 and row["utilisation"] == pytest.approx(1e15 / (10 * 2 * 1e15))
    assert row["parts"]["training steps"] == pytest.approx(2.0 * 2)  # 250k tokens at 1e5/s, on both GPUs
    assert usage.AGAIN not in usage.lines(row)[1]


def test_steps_an_earlier_command_counted_and_a_lost_checkpoint_makes_train_again_count_once():
    """An earlier command counted a 400-step run's FLOPs up to step 300 (its checkpoint there), which was lost
    since: the run resumes at step 100 of an older one and trains 300 steps here, but only the last 100 count; the
    200 steps' time is its own part, not training steps (nor idle)."""
    u = usage.Usage("s", slots=1, gpus=1, started=0.0)
    u.training, u.trained = 0.0, 14.0
    u.add(
        _metrics(wall=12.0, tokens_per_s=1e5), tokens=1_000_000, train_flops=4e15, steps=400, resumed=100, counted=300
    )
    row = u.row(now=15.0)
    p = row["parts"]
    assert row["train_flops"] == pytest.approx(1e15) and row["utilisation"] == pytest.approx(1e15 / (15 * 1e15))
    assert p[usage.AGAIN] == pytest.approx(5.0) and p["training steps"] == pytest.approx(2.5)  # 500k, 250k tokens
    assert p["compilation and first steps"] == pytest.approx(12.0 * 0.75 - 7.5)
    assert p["idle or between runs"] == pytest.approx(14.0 - 9.0 - 1.0 - 2.0)
    assert sum(p[k] for k in usage.PARTS) == pytest.approx(15.0)
    assert p["runs_mfu"] == pytest.approx(0.4)
    assert f"{usage.AGAIN} 33.3%" in usage.lines(row)[1], usage.lines(row)


def test_cpu_has_no_utilisation_but_says_where_time_went():
    u = usage.Usage("s", slots=1, gpus=0, started=0.0)
    u.training, u.trained = 1.0, 9.0
    u.add(_metrics(wall=6.0, tokens_per_s=1e3, setup=0.5, evaluation=0.5, mfu=None, peak=None), 3000, 1e9, 10)
    row = u.row(now=10.0)
    assert row["utilisation"] is None and row["peak_flops"] is None and row["parts"]["runs_mfu"] is None
    assert sum(row["parts"][k] for k in usage.PARTS) == pytest.approx(10.0)
    assert usage.lines(row)[0] == "sweep wall-clock 10 s (no GPU peak known: utilisation not measured)"


def test_sweep_utilisation_pools_the_commands_of_a_sweep(tmp_path):
    con = results.connect(tmp_path / "u.db")
    for k, wall, flops in ((1, 100.0, 2e16), (2, 300.0, 1e17)):
        row = {"sweep_id": "a", "started_at": dt.datetime(2026, 1, k), "wall_s": wall, "gpus": 1, "peak_flops": 1e15,
               "train_flops": flops, "runs": 3}  # fmt: skip
        results.put_usage(con, {**row, "utilisation": flops / wall / 1e15, "parts": {}})
    results.put_usage(con, {"sweep_id": "b", "wall_s": 5.0, "gpus": 0, "train_flops": 1e9, "runs": 1, "parts": {}})
    got = results.sweep_utilisation(con)
    assert got["a"][0] == pytest.approx(1.2e17 / (400 * 1e15)) and got["a"][1:] == (400.0, 2)
    assert got["b"] == (None, 5.0, 1)
    with pytest.raises(results.StoreError, match="unknown sweep_usage columns"):
        results.put_usage(con, {"sweep_id": "a", "mfu": 0.5})
    con.close()


def test_the_report_sets_the_sweep_against_its_runs_alone_one_after_another():
    import pandas as pd

    from analysis.report import _usage_lines

    rows = [
        {"started_at": dt.datetime(2026, 12, 6), "runs": 2, "wall_s": w, "gpus": 1, "peak_flops": 1e15,
         "train_flops": f, "utilisation": f / (w * 1e15), "parts": {k: w / 7 for k in usage.PARTS},
         "commit": "abc", "command": "python -m sweeps isoflop"}
        for w, f in ((100.0, 6e15), (60.0, 2e15))
    ]  # fmt: skip
    times = pd.DataFrame({"train_flops": [4e15, 4e15], "alone_s": [50.0, 30.0]})
    text = "\n".join(_usage_lines({"usage": rows}, times))
    # 80 s of the runs' own steps in 160 device-seconds; 8e15 FLOPs over 80 s at a 1e15 peak: 10%
    assert "its 2 runs' steps one after another" in text and "80 s, 50% of its commands' 160 device-seconds" in text
    assert "its training FLOPs use 10.0% of the peak" in text and "over its 2 commands: sweep utilisation 5.0%" in text
    # a shape not timed alone, or a command without a GPU peak: no such line
    assert "one after another" not in "\n".join(_usage_lines({"usage": rows}, times.assign(alone_s=[50.0, None])))
    cpu = [{**r, "utilisation": None, "peak_flops": None} for r in rows]
    assert "one after another" not in "\n".join(_usage_lines({"usage": cpu}, times))


def test_a_sweep_stores_prints_and_reports_its_usage(cli, tmp_path, status_row):
    one = ["sweep.budgets=[5e10]", "sweep.archs=[dense]", "sweep.max_extra=0", "sweep.workers=1",
           "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}]", "train.progress=false"]  # fmt: skip
    out = cli("sweeps", "isoflop", "--db", "u.db", *one)
    assert out.returncode == 0, out.stderr
    assert "sweep wall-clock" in out.stdout and "where the time went: start-up" in out.stdout
    con = duckdb.connect(str(tmp_path / "u.db"), read_only=True)
    sid, *provenance = con.execute("SELECT sweep_id, commit, command FROM sweeps").fetchone()
    wall, runs, util, parts, *ran = con.execute(
        "SELECT wall_s, runs, utilisation, parts, commit, command FROM sweep_usage"
    ).fetchone()
    assert ran == provenance and ran[1].startswith("python -m sweeps isoflop --db u.db")  # the command's own
    setup, evaluation = con.execute("SELECT setup_s, eval_s FROM runs").fetchone()
    con.close()
    parts = json.loads(parts)
    assert runs == 1 and util is None and wall > 0 and setup > 0 and evaluation > 0
    assert sum(parts[k] for k in usage.PARTS) == pytest.approx(wall)
    report = (tmp_path / "u_report" / sid / "report.md").read_text()
    assert "## Device use" in report and "1 runs: sweep wall-clock" in report
    # a rerun trains nothing: no second row (it would dilute the sweep's utilisation with a report-only wall)
    assert cli("sweeps", "isoflop", "--db", "u.db", *one).returncode == 0
    status = cli("sweeps", "status", "--db", "u.db")
    assert status_row(status.stdout, "isoflop-cpu")["GPU utilisation"] == "n/a"
    con = duckdb.connect(str(tmp_path / "u.db"), read_only=True)
    assert con.execute("SELECT count(*) FROM sweep_usage").fetchone() == (1,)
    con.close()


def test_workers_share_a_gpu(monkeypatch):
    import torch

    from mixdepth.config import ConfigError, load_config
    from sweeps.worker import slot_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    lab = load_config(CONF, "isoflop", ["sweep.workers=4", "sweep.workers_per_gpu=2"])
    assert slot_gpus(lab.train, lab.sweep.workers, lab.sweep.workers_per_gpu) == ["3", "3", "5", "5"]
    lab = load_config(CONF, "isoflop", ["sweep.workers=5", "sweep.workers_per_gpu=2"])
    with pytest.raises(ConfigError, match="sweep.workers=5 at sweep.workers_per_gpu=2 needs 3 GPUs, but 2 are"):
        slot_gpus(lab.train, lab.sweep.workers, lab.sweep.workers_per_gpu)
    with pytest.raises(ConfigError, match="train.compile_mode must be one of default, reduce-overhead"):
        load_config(CONF, "isoflop", ["train.compile_mode=fast"])
