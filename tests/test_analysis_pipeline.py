"""Store → fits table → figures → report, on synthetic sweeps with a known surface."""

import json

import numpy as np
import pandas as pd
import pytest

from analysis import AnalysisError
from analysis.pipeline import run_all
from analysis.plots import normalize_to_dense, plot_mod_normalized
from analysis.synthetic import TRUTH, fake_runs
from mixdepth.results import add_run, add_sweep, connect, writer


def make_store(path, rows, sweep_id="s1"):
    con = connect(path)
    add_sweep(con, sweep_id, "synthetic", "test", {"budgets": [1e15, 1e16, 1e17]})
    for r in rows:
        add_run(con, r, [])
    con.close()


def test_run_all_writes_fits_plots_and_report(tmp_path):
    db = tmp_path / "results.db"
    rows = fake_runs("s1", "dense", sizes_per_budget=5)  # 3 budgets x 5 sizes
    rows += fake_runs("s1", "mod", budgets=(1e16,), sizes_per_budget=2, flops_scale=0.6, causal_offset=0.02)
    rows += [dict(rows[0], run_id="failed", status="diverged", val_loss=None)]
    make_store(db, rows)
    paths = run_all(db, "s1", tmp_path / "out")

    assert {"fits_json", "isoflop_plot", "frontier_plot", "mod_plot", "report"} <= set(paths)
    for key in ("isoflop_plot", "frontier_plot", "mod_plot"):
        assert paths[key].suffix == ".png" and paths[key].read_bytes()[:4] == b"\x89PNG"

    con = connect(db, read_only=True)
    fits = con.execute("SELECT arch, method, budget, params, ci, n_points FROM fits ORDER BY arch, method, budget").df()
    con.close()
    dense = fits[fits["arch"] == "dense"]
    assert sorted(dense["method"]) == [
        "forecast:isoflop", "forecast:parametric", "isoflop", "parabola", "parabola", "parabola", "parametric"
    ]  # fmt: skip
    casts = dense[dense["method"].str.startswith("forecast:")]
    assert list(casts["budget"]) == [1e17, 1e17]  # the largest budget, predicted from the other two
    assert set(fits["arch"]) == {"dense"}  # mod (2 runs) and mod:causal are too small for any fit
    iso = dense[dense["method"] == "isoflop"].iloc[0]
    params, ci = json.loads(iso["params"]), json.loads(iso["ci"])
    a_true = TRUTH["beta"] / (TRUTH["alpha"] + TRUTH["beta"])
    assert params["n_opt"]["exponent"] == pytest.approx(a_true, abs=0.05)
    assert len(ci["n_opt.exponent"]) == 2 and iso["n_points"] == 15
    parab = dense[dense["method"] == "parabola"]
    assert all(json.loads(p)["vertex_inside"] for p in parab["params"])
    par = json.loads(dense[dense["method"] == "parametric"].iloc[0]["params"])
    assert par["n_points"] == 15 and par["E"] > 0

    text = paths["report"].read_text()
    for needle in ("# Scaling-law report: sweep s1", "## Runs per budget", "vertex inside", "N*(C)",
                   "## Approach 3", "![isoflop_plot](isoflop.png)", "mod: isoFLOP fit skipped",
                   "mod: parametric fit skipped", "diverged: 1"):  # fmt: skip
        assert needle in text, needle
    assert json.loads(paths["fits_json"].read_text())["sweep_id"] == "s1"

    # a refit replaces the sweep's rows: without a forecast, none of the old forecast rows is left
    run_all(db, None, tmp_path / "out2", holdout=0, plots=False)
    con = connect(db, read_only=True)
    assert con.execute("SELECT count(*) FROM fits").fetchall()[0][0] == len(fits) - 2
    con.close()


def test_run_all_unknown_sweep_and_empty_store(tmp_path):
    db = tmp_path / "results.db"
    make_store(db, fake_runs("s1", "dense", budgets=(1e15,), sizes_per_budget=3))
    with pytest.raises(AnalysisError, match="sweep 'nope'"):
        run_all(db, "nope", tmp_path / "out", store=False)
    empty = tmp_path / "empty.db"
    connect(empty).close()
    with pytest.raises(AnalysisError, match="no finished runs"):
        run_all(empty, None, tmp_path / "out", store=False)


def test_run_all_with_one_budget_uses_the_callers_writer(tmp_path):
    db = tmp_path / "results.db"
    make_store(db, fake_runs("s1", "dense", budgets=(1e15,), sizes_per_budget=4))
    with writer(db) as w:  # the sweep runner's own Writer
        paths = run_all(w, "s1", tmp_path / "out")
    con = connect(db, read_only=True)
    methods = sorted(r[0] for r in con.execute("SELECT method FROM fits").fetchall())
    con.close()
    assert methods == ["isoflop", "parabola"]  # 4 runs: parabola, no power law, no parametric fit
    text = paths["report"].read_text()
    assert "fewer than 2 budgets" in text and "parametric fit skipped" in text
    assert "mod_plot" not in paths


def test_normalize_to_dense_and_mod_plot(tmp_path):
    pts = pd.DataFrame({
        "arch": ["dense", "dense", "mod", "mod", "dense", "mod", "mod"],
        "budget": [1e15, 1e15, 1e15, 1e15, 1e16, 1e16, 1e17],
        "val_loss": [3.0, 2.8, 2.7, 2.9, 2.5, 2.4, 2.0],
        "flops_per_token": [2e6, 4e6, 2.4e6, 1.2e6, 8e6, 4e6, 1e7],
        "params_total": [1e6, 2e6, 2e6, 1e6, 4e6, 4e6, 8e6],
    })  # fmt: skip
    norm = normalize_to_dense(pts)
    assert len(norm) == 6  # the 1e17 budget has no dense run
    best = norm[(norm["arch"] == "dense") & (norm["budget"] == 1e15) & (norm["val_loss"] == 2.8)].iloc[0]
    assert best["loss_norm"] == 1.0 and best["flops_norm"] == 1.0
    m = norm[(norm["arch"] == "mod") & (norm["val_loss"] == 2.7)].iloc[0]
    assert m["loss_norm"] == pytest.approx(2.7 / 2.8) and m["flops_norm"] == pytest.approx(0.6)
    assert np.all(norm[norm["budget"] == 1e16]["flops_norm"].to_numpy() == [1.0, 0.5])
    out = plot_mod_normalized(pts, tmp_path / "fig" / "mod.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(AnalysisError, match="no 'dense' runs"):
        normalize_to_dense(pts[pts["arch"] == "mod"])


def test_run_all_draws_a_frontier_with_no_vertex_at_all(tmp_path):
    # one budget whose losses are concave in ln N: no minimum, nothing positive for the log-log panels
    db = tmp_path / "results.db"
    rows = fake_runs("s1", "dense", budgets=(1e15,), sizes_per_budget=3)
    rows = [dict(r, val_loss=loss) for r, loss in zip(rows, (2.0, 2.5, 2.7), strict=True)]
    make_store(db, rows)
    paths = run_all(db, "s1", tmp_path / "out")
    assert paths["frontier_plot"].read_bytes()[:4] == b"\x89PNG"
