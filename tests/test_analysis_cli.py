"""``python -m analysis``: fit-csv on the Chinchilla data, query, export, and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from analysis.__main__ import main
from analysis.synthetic import fake_runs
from mixdepth.results import add_run, connect

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
CHINCHILLA = FIXTURES / "chinchilla_svg_extracted_data.csv"
CSV_ARGS = ["--n-col", "Model Size", "--c-col", "Training FLOP", "--loss-col", "loss", "--drop-highest-loss", "5"]


def need_chinchilla():
    if not CHINCHILLA.is_file():
        pytest.skip(f"fixture folder {FIXTURES} (../shared/fixtures) absent: no Chinchilla CSV")


def assert_one_line_error(res, code=None):
    assert res.returncode != 0 if code is None else res.returncode == code, res
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""


@pytest.fixture
def small_db(tmp_path):
    db = tmp_path / "results.db"
    con = connect(db)
    for row in fake_runs("s1", "dense", budgets=(1e15,), sizes_per_budget=3):
        add_run(con, row, [{"step": 1, "tokens": 10, "flops": 1.0, "train_loss": 5.0, "lr": 1e-3}])
    con.close()
    return db


def test_fit_csv_parametric_json(cli):
    need_chinchilla()
    res = cli("analysis", "fit-csv", str(CHINCHILLA), *CSV_ARGS, "--method", "parametric", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["n_points"] == 240
    assert out["E"] == pytest.approx(1.8172, abs=0.005)
    assert out["alpha"] == pytest.approx(0.3473, abs=0.003)
    assert out["beta"] == pytest.approx(0.3672, abs=0.003)
    assert out["objective"] == pytest.approx(1.01827e-3, rel=1e-3)
    assert {"A", "B", "a"} <= set(out)


def test_fit_csv_isoflop_json(cli):
    need_chinchilla()
    res = cli("analysis", "fit-csv", str(CHINCHILLA), *CSV_ARGS, "--method", "isoflop", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["method"] == "isoflop" and out["c_bin_width"] == 0.1
    assert len(out["parabolas"]) > 10 and all("vertex_inside" in p for p in out["parabolas"])
    assert 0.4 < out["n_opt"]["exponent"] < 0.6  # Chinchilla's Approach 2 found 0.49
    lo, hi = out["n_opt"]["ci_exponent"]
    assert lo < out["n_opt"]["exponent"] < hi and out["n_opt"]["level"] == 0.9


def test_fit_csv_forecast_json(cli):
    """``--holdout 1``: the largest Chinchilla budget with three sizes, predicted by both approaches from the rest."""
    need_chinchilla()
    res = cli("analysis", "fit-csv", str(CHINCHILLA), *CSV_ARGS, "--holdout", "1", "--json")
    assert res.returncode == 0, res.stderr
    casts = json.loads(res.stdout)["forecast"]
    assert [f["method"] for f in casts] == ["isoflop", "parametric"]
    keys = ("budget", "method", "loss_pred", "loss_lo", "loss_hi", "loss_obs", "n_pred", "n_obs")
    for f in casts:
        assert set(keys) <= set(f) and f["budget"] == casts[0]["budget"] > max(f["fit_budgets"])
        assert f["loss_lo"] < f["loss_pred"] < f["loss_hi"] and 2.0 < f["loss_obs"] < 2.5, f
        assert f["n_obs"] > 1e9 and f["inside"] == (f["loss_lo"] <= f["loss_obs"] <= f["loss_hi"])


def run_main(capsys, *args):
    """The CLI in-process (same code path as ``python -m analysis``), as (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "args, code",
    [
        (["fit-csv", "/nonexistent/points.csv", *CSV_ARGS], 1),
        (["fit-csv", "{csv}", "--n-col", "Model Size", "--c-col", "Training FLOP", "--loss-col", "nope"], 1),
        (["fit-csv", "{csv}", *CSV_ARGS, "--method", "approach9"], 2),
        (["fit-csv", "{csv}", "--n-col", "N"], 2),
        (["fit-csv", "{csv}", "--n-col", "Model Size", "--c-col", "Training FLOP", "--loss-col", "loss"], 1),
        (["query", "--db", "{missing}", "SELECT 1"], 1),
        (["fit", "--db", "{missing}"], 1),
        (["report", "--db", "{missing}", "--out", "{tmp}/rep"], 1),
        (["export", "--db", "{missing}", "runs", "{tmp}/x.parquet"], 1),
        (["bogus"], 2),
        ([], 2),
    ],
)
def test_usage_and_input_errors(capsys, tmp_path, args, code):
    csv = tmp_path / "p.csv"
    csv.write_text("Model Size,Training FLOP,loss\n1e6,1e15,3.0\n")  # one point: too few for any fit
    missing = tmp_path / "missing.db"
    args = [a.format(csv=csv, missing=missing, tmp=tmp_path) for a in args]
    rc, out, err = run_main(capsys, *args)
    assert rc == code and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not missing.exists()  # an analysis command never creates a database


def test_errors_from_a_real_process_are_one_line(cli, tmp_path):
    for args, code in ((["fit-csv", str(tmp_path / "none.csv"), *CSV_ARGS], 1), (["fit-csv", "x", "--method", "?"], 2)):
        assert_one_line_error(cli("analysis", *args), code)


def test_query_prints_table_and_bad_sql_fails(cli, small_db):
    before = small_db.read_bytes()
    res = cli(
        "analysis", "query", "--db", str(small_db), "SELECT arch, budget, count(*) AS runs FROM runs GROUP BY ALL"
    )
    assert res.returncode == 0, res.stderr
    header, rule, row, footer = res.stdout.splitlines()
    assert header.split() == ["arch", "budget", "runs"] and set(rule) <= {"-", " "}
    assert row.split() == ["dense", "1e+15", "3"] and footer == "(1 row)"
    assert_one_line_error(cli("analysis", "query", "--db", str(small_db), "SELEC * FROM runs"), 1)
    assert_one_line_error(cli("analysis", "query", "--db", str(small_db), "DELETE FROM runs"), 1)  # read-only
    assert small_db.read_bytes() == before


def test_export_parquet_round_trip(cli, small_db, tmp_path):
    out = tmp_path / "points.parquet"
    res = cli("analysis", "export", "--db", str(small_db), "isoflop_points", str(out))
    assert res.returncode == 0, res.stderr
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}')").fetchall()[0][0] == 3
    bad = cli("analysis", "export", "--db", str(small_db), "runs; DROP TABLE runs", str(tmp_path / "y.parquet"))
    assert_one_line_error(bad, 1)
    assert "no table or view" in bad.stderr and not (tmp_path / "y.parquet").exists()


def test_corrupt_db_is_reported_and_left_untouched(cli, capsys, tmp_path):
    db = tmp_path / "corrupt.db"
    db.write_bytes(b"this is not a duckdb file\x00\x01\x02" * 300)
    before, mtime = db.read_bytes(), db.stat().st_mtime_ns
    for args in (["query", "--db", str(db), "SELECT 1"], ["fit", "--db", str(db)]):
        assert_one_line_error(cli("analysis", *args), 1)
    for args in (["report", "--db", str(db), "--out", str(tmp_path / "rep")], ["export", "--db", str(db), "runs",
                 str(tmp_path / "r.parquet")], ["plot", "--db", str(db), "--out", str(tmp_path / "rep")]):  # fmt: skip
        rc, out, err = run_main(capsys, *args)
        assert rc == 1 and out == "" and len(err.splitlines()) == 1 and "not a valid DuckDB" in err
    assert db.read_bytes() == before and db.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.db"]  # no WAL, no report folder


def test_fit_plot_report_commands(capsys, tmp_path):
    db = tmp_path / "results.db"
    con = connect(db)
    for row in fake_runs("s1", "dense", sizes_per_budget=4) + fake_runs("s2", "dense", budgets=(1e15,)):
        add_run(con, row, [])
    con.close()
    rc, out, err = run_main(capsys, "fit", "--db", str(db), "--sweep", "s1", "--holdout", "0")
    assert rc == 0, err
    assert "sweep s1" in out and "wrote 5 fits rows" in out  # 3 parabolas + isoflop + parametric
    rc, out, err = run_main(capsys, "plot", "--db", str(db), "--sweep", "s1", "--out", str(tmp_path / "fig"))
    assert rc == 0, err
    assert (tmp_path / "fig" / "isoflop.png").is_file() and not (tmp_path / "fig" / "report.md").exists()
    before = db.read_bytes()
    rc, out, err = run_main(capsys, "report", "--db", str(db), "--out", str(tmp_path / "rep"))
    assert rc == 0, err
    assert db.read_bytes() == before  # report is read-only without --store
    assert "sweep s2" in (tmp_path / "rep" / "report.md").read_text()  # default: the newest sweep
    rc, out, err = run_main(capsys, "forecast", "--db", str(db), "--sweep", "s1", "--json")
    assert rc == 0, err
    (dense,) = json.loads(out)["dense"][:1]  # the largest budget from the two others, Approach 2 first
    assert dense["budget"] == 1e17 and dense["method"] == "isoflop" and dense["loss_obs"] > 0
    assert dense["n_lo"] is None and "not identified" in dense["why"]  # two fitted budgets: no scatter
    assert db.read_bytes() == before  # forecast is read-only
    rc, out, err = run_main(capsys, "forecast", "--db", str(db), "--sweep", "s2")
    assert rc == 0 and "forecast skipped" in out  # one budget: nothing to hold out
    rc, _, err = run_main(capsys, "fit", "--db", str(db), "--sweep", "nope")
    assert rc == 1 and err.startswith("error: sweep 'nope' has no finished runs")


def test_analysis_never_imports_torch(tmp_path):
    mods = "analysis.pipeline, analysis.plots, analysis.report, analysis.optimal, analysis.query, analysis.__main__"
    code = f"import sys, {mods}; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning')))"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
