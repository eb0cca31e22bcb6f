"""End to end: python -m sweeps isoflop on a tiny grid, resume, dry run."""

import duckdb
import pytest

TINY = [
    "sweep.name=tiny",
    "sweep.budgets=[1e9,3e9]",
    "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}, {d_model: 24, n_layers: 1, n_heads: 2},"
    " {d_model: 32, n_layers: 2, n_heads: 2}]",
    "sweep.min_steps=4",
    "sweep.bootstrap=10",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "data.val_tokens=2048",
    "train.batch_size=4",
    "train.log_every=5",
    "train.progress=false",
]


def test_dry_run_prints_plan_and_writes_nothing(cli, tmp_path):
    r = cli("sweeps", "isoflop", "--dry-run", "--db", str(tmp_path / "r.db"), *TINY)
    assert r.returncode == 0, r.stderr
    assert "FLOPs/token" in r.stdout and "steps" in r.stdout
    assert len([ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("dense")]) == 6
    assert not (tmp_path / "r.db").exists()


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    import os
    import subprocess
    import sys

    d = tmp_path_factory.mktemp("sweep")
    cmd = [sys.executable, "-m", "sweeps", "isoflop", "--db", str(d / "r.db"), *TINY]
    first = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    second = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    return d, first, second


def test_sweep_writes_one_row_per_run_with_exact_flops(swept):
    d, first, _ = swept
    assert first.returncode == 0, first.stderr[-2000:]
    con = duckdb.connect(str(d / "r.db"), read_only=True)
    rows = con.execute(
        "SELECT arch, budget, params_nonembed, flops_per_token, tokens, steps, batch_size, seq_len, train_flops,"
        " flops_6nd, val_loss, status, corpus_fingerprint, device, versions FROM runs"
    ).fetchall()
    assert len(rows) == 6
    for _arch, budget, n, fpt, tokens, steps, bs, T, train_flops, f6, val, status, fp, device, versions in rows:
        assert status == "ok" and 0 < val < 6
        assert tokens == steps * bs * T
        assert train_flops == pytest.approx(3 * fpt * tokens)
        assert abs(train_flops - budget) <= 3 * fpt * bs * T / 2 + 1  # within half a step of the budget
        assert f6 == pytest.approx(6 * n * tokens)
        assert len(fp) >= 8 and device.startswith("cpu") and "torch" in versions
    assert con.execute("SELECT count(*) FROM curves").fetchone()[0] > 6
    assert con.execute("SELECT count(DISTINCT budget) FROM frontier").fetchone()[0] == 2
    assert con.execute("SELECT count(*) FROM fits").fetchone()[0] > 0


def test_sweep_prints_report_paths_that_exist(swept):
    from pathlib import Path

    _, first, _ = swept
    paths = [ln.split(": ", 1)[1] for ln in first.stdout.splitlines() if ln.split(":")[0] in ("report", "isoflop_plot")]
    assert paths and all(Path(p).exists() for p in paths)


def test_rerun_skips_finished_runs(swept):
    d, _, second = swept
    assert second.returncode == 0, second.stderr[-2000:]
    assert "6 already in" in second.stdout and "0 to run" in second.stdout
    con = duckdb.connect(str(d / "r.db"), read_only=True)
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 6


def test_display_settings_do_not_change_the_sweep():
    from pathlib import Path

    from mixdepth.config import load_config
    from sweeps.plan import plan, sweep_id

    conf = Path(__file__).resolve().parents[1] / "conf"
    a, b = load_config(conf, "isoflop", ["train.progress=true"]), load_config(conf, "isoflop", ["train.progress=false"])
    assert sweep_id(a, "isoflop") == sweep_id(b, "isoflop")
    c = load_config(conf, "isoflop", ["train.lr=1e-3"])
    assert sweep_id(c, "isoflop") != sweep_id(a, "isoflop")
    ids = [t.run_id for t in plan(a, conf, sweep_id(a, "isoflop"))[0]]
    assert len(set(ids)) == len(ids)


def test_status_lists_the_sweep(swept, cli):
    d, _, _ = swept
    r = cli("sweeps", "status", "--db", str(d / "r.db"))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("tiny-"))
    planned, ok, diverged, failed = line.split()[4:8]  # after sweep, preset, date, time
    assert (planned, ok, diverged, failed) == ("6", "6", "0", "0")
    missing = cli("sweeps", "status", "--db", str(d / "nope.db"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr
