"""python -m sweeps alone: every shape of a sweep timed alone, stored once, resumed, and used by the time view."""

import re
import shutil
import subprocess
import sys

import duckdb
import pytest

from analysis.store import load_times, resolve_sweep, time_basis
from mixdepth.results import SHAPE_KEY, connect
from tests.test_sweeps import SMALL  # 4 runs of 2 shapes (d 16 and d 24 at 2 budgets), one thread each


@pytest.fixture(scope="module")
def timed(tmp_path_factory, cli_env):
    """The SMALL sweep, then ``sweeps alone`` on it twice (the second finds nothing left)."""
    d = tmp_path_factory.mktemp("alone")
    env = {k: v for k, v in cli_env.items() if k != "TRITON_INTERPRET"}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "sweeps", *args], cwd=d, capture_output=True, text=True,
                              timeout=600, env=env)  # fmt: skip

    swept = run("isoflop", "--db", str(d / "r.db"), *SMALL)
    assert swept.returncode == 0, swept.stderr[-2000:]
    shutil.copy(d / "r.db", d / "before.db")
    first = run("alone", "--db", str(d / "r.db"), "--steps", "20")
    second = run("alone", "--db", str(d / "r.db"), "--steps", "20")
    return d, run, first, second


def _rates(db):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(
            "SELECT arch, d_model, n_layers, steps, tokens_per_s, device, measured_at FROM alone_rates ORDER BY d_model"
        ).fetchall()
    finally:
        con.close()


def test_each_shape_is_timed_once(timed):
    d, _, first, second = timed
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].endswith(": 2 shapes to time alone, 20 steps each"), lines
    assert lines[1].startswith("[1/2] dense d_model=16 layers=1: ") and lines[1].endswith(" tokens/s alone")
    rates = _rates(d / "r.db")
    assert [(a, dm, nl, s) for a, dm, nl, s, *_ in rates] == [("dense", 16, 1, 20), ("dense", 24, 1, 20)]
    assert all(r[4] > 0 and r[5].startswith("cpu:") for r in rates)
    assert second.returncode == 0 and second.stdout.splitlines() == [
        first.stdout.splitlines()[0].replace("2 shapes", "0 shapes")
    ]
    assert _rates(d / "r.db") == rates  # nothing measured again


def test_the_time_view_prices_each_run_at_its_shapes_rate_alone(timed):
    d, *_ = timed
    con = duckdb.connect(str(d / "r.db"), read_only=True)
    times = load_times(con, resolve_sweep(con, None))
    want = con.execute(
        f"SELECT r.tokens / a.tokens_per_s FROM runs r JOIN alone_rates a ON a.shape = {SHAPE_KEY}"
        " ORDER BY r.arch, r.budget, r.params_nonembed"
    ).fetchall()
    con.close()
    assert len(times) == 4 and list(times["alone_s"]) == pytest.approx([w for (w,) in want])
    assert time_basis(times)[0] == "alone_s"
    con = duckdb.connect(str(d / "before.db"), read_only=True)
    before = load_times(con, resolve_sweep(con, None))
    con.close()
    assert before["alone_s"].isna().all() and time_basis(before)[0] == "steady_s"


def test_a_store_without_the_table_reads_as_unmeasured(tmp_path):
    con = connect(tmp_path / "old.db")
    con.execute("DROP TABLE alone_rates")  # a store written before the table existed, opened read-only
    assert load_times(con, None).columns.tolist()[-1] == "alone_s"
    con.close()


def test_bad_input_is_one_line_and_writes_nothing(timed):
    d, run, *_ = timed
    for args, code, err in (
        (["--steps", "5"], 2, "error: --steps must be at least 20, got 5"),
        (["--sweep", "nope"], 1, "error: sweep 'nope' has no finished runs (sweeps with runs: "),
    ):
        r = run("alone", "--db", str(d / "before.db"), *args)
        assert r.returncode == code and r.stderr.startswith(err) and len(r.stderr.splitlines()) == 1, r.stderr
    r = run("alone", "--db", str(d / "missing.db"))
    assert r.returncode == 1 and r.stderr == f"error: database {d / 'missing.db'} does not exist\n"
    assert not (d / "missing.db").exists()
    gpu = d / "gpu.db"
    shutil.copy(d / "before.db", gpu)
    con = duckdb.connect(str(gpu))
    con.execute("UPDATE runs SET device = 'NVIDIA H200'")
    con.close()
    r = run("alone", "--db", str(gpu))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "the sweep's runs trained on NVIDIA H200; this process runs on cpu:" in r.stderr
    con = duckdb.connect(str(gpu))
    con.execute("""UPDATE runs SET config = json_merge_patch(config, '{"train": {"accelerator": "gpu"}}')""")
    con.close()
    r = run("alone", "--db", str(gpu))
    assert r.returncode == 2 and r.stderr == "error: train.accelerator=gpu, but no GPU is visible; use auto or cpu\n"
    assert _rates(gpu) == [] and r.stdout == ""


def test_a_dry_run_prices_its_plan_at_the_stored_alone_rates(timed):
    """The same plan against the database its shapes were timed in: every run counted, its steps one after another
    at those rates and their share of a (given) peak as the report's time view has them; a size never timed is named
    and left out; a database without rates adds nothing."""
    d, run, *_ = timed
    priced = d / "priced.db"
    shutil.copy(d / "r.db", priced)
    con = duckdb.connect(str(priced))
    seconds, flops = con.execute(
        "SELECT sum(r.tokens / a.tokens_per_s), sum(r.train_flops) FROM runs r"
        f" JOIN alone_rates a ON a.shape = {SHAPE_KEY}"
    ).fetchone()
    peak = 4 * flops / seconds  # a CPU has no known peak; one at which the runs would use 25% of it
    con.execute("UPDATE alone_rates SET peak_flops = ?", [peak])
    con.close()
    r = run("isoflop", "--dry-run", "--db", str(priced), *SMALL)
    assert r.returncode == 0, r.stderr
    line = r.stdout.splitlines()[-1]
    head = "cost at the rates its shapes trained alone on cpu:"
    assert line.startswith(head) and "(priced.db, `python -m sweeps alone`): 4 of its 4 runs" in line, line
    at = re.escape(f"({peak:.4g} FLOP/s)")
    minutes, share = re.search(rf"take ([\d.]+) device-minutes and use ([\d.]+)% of its peak {at}", line).groups()
    assert float(minutes) == pytest.approx(seconds / 60, abs=0.051) and share == "25.0"

    ladder = SMALL[-2].replace("]", ", {d_model: 32, n_layers: 2, n_heads: 2}]")
    r = run("isoflop", "--dry-run", "--db", str(priced), *SMALL[:-2], ladder, SMALL[-1])
    *_, line, untimed = r.stdout.splitlines()
    assert r.returncode == 0 and " 4 of its 6 runs" in line, r.stdout
    assert untimed == "not timed alone there, not counted: dense d_model=32 layers=2"

    r = run("isoflop", "--dry-run", "--db", str(d / "before.db"), *SMALL)
    assert r.returncode == 0 and "cost at the rates" not in r.stdout and "not timed alone" not in r.stdout
