"""Training curves record the LM loss beside the training objective (train.fit through LitLM), the store keeps both,
and the curves plot shows the LM loss where every point has it, the objective otherwise (older stores, the
published reference study)."""

from dataclasses import asdict
from pathlib import Path

import duckdb
import pytest

from analysis import plots
from analysis.published import load
from analysis.store import load_curves
from mixdepth import results
from mixdepth.config import DataConfig, TrainConfig
from mixdepth.models import MODELS
from mixdepth.train import RunConfig, fit

LM, OBJECTIVE = "training LM loss (nats)", "training objective (nats)"


@pytest.fixture(scope="module")
def runs() -> dict:
    """arch -> RunResult of a tiny CPU run (dense, and MoD with its learned router: router and predictor BCE)."""
    data = DataConfig(seq_len=32, max_bytes=200_000, val_tokens=2048)
    train = TrainConfig(batch_size=8, progress=False, logger="none", log_every=2, accelerator="cpu")
    out = {}
    for arch in ("dense", "mod"):
        model = MODELS[arch][0](d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, seq_len=32, vocab_size=256)
        out[arch] = fit(RunConfig(model, data, train, 6))
    return out


@pytest.fixture
def ylabels(monkeypatch) -> list[set[str]]:
    """The y labels of each figure saved during the test, one set per figure (every panel's)."""
    seen = []
    save = plots._save

    def capture(fig, out):
        seen.append({ax.get_ylabel() for ax in fig.axes})
        return save(fig, out)

    monkeypatch.setattr(plots, "_save", capture)
    return seen


def test_every_curve_point_holds_the_lm_loss_beside_the_objective(runs):
    """Dense trains the LM loss itself: both columns are one value. MoD's objective adds the router's and the
    predictor's BCE (positive) to its LM loss: the LM loss lies below it at every point, and the run's
    train_lm_loss below its train_loss."""
    for arch, res in runs.items():
        assert [p["step"] for p in res.curve] == [1, 2, 4, 6], arch
        assert all(0 < p["lm_loss"] < 10 for p in res.curve), res.curve
    dense, mod = runs["dense"], runs["mod"]
    assert [p["lm_loss"] for p in dense.curve] == [p["train_loss"] for p in dense.curve]
    assert dense.metrics.train_lm_loss == dense.metrics.train_loss
    assert all(p["lm_loss"] < p["train_loss"] - 1e-3 for p in mod.curve), mod.curve
    assert mod.metrics.train_lm_loss < mod.metrics.train_loss - 1e-3
    assert mod.metrics.train_lm_loss == mod.curve[-1]["lm_loss"]  # over train_loss's last 10% of points: one of 4


def test_the_curves_plot_shows_the_lm_loss_where_every_point_has_it(runs, tmp_path, ylabels):
    db = tmp_path / "r.db"
    con = results.connect(db)
    for arch, res in runs.items():
        row = {"run_id": arch, "sweep_id": "s", "arch": arch, "budget": 1e9, "params_nonembed": 1000}
        results.add_run(con, {**row, **asdict(res.metrics)}, res.curve)
    stored = con.execute("SELECT run_id, train_loss, train_lm_loss FROM runs ORDER BY 1").fetchall()
    assert stored == [(a, runs[a].metrics.train_loss, runs[a].metrics.train_lm_loss) for a in ("dense", "mod")]
    curves = load_curves(con, "s")
    assert curves["lm_loss"].tolist() == [p["lm_loss"] for a in ("dense", "mod") for p in runs[a].curve]
    plots.plot_curves(curves, tmp_path / "all.png")
    con.execute("UPDATE curves SET lm_loss = NULL WHERE run_id = 'mod' AND step = 1")  # a resumed run's old point
    plots.plot_curves(load_curves(con, "s"), tmp_path / "some.png")
    # a store from before the column, opened read-only (not migrated): no lm_loss column at all
    con.execute("ALTER TABLE curves DROP COLUMN lm_loss")
    con.close()
    con = duckdb.connect(str(db), read_only=True)
    older = load_curves(con, "s")
    con.close()
    assert older["lm_loss"].isna().all() and older["train_loss"].notna().all()
    plots.plot_curves(older, tmp_path / "older.png")
    assert ylabels == [{LM}, {OBJECTIVE}, {OBJECTIVE}]


def test_the_published_reference_study_plots_its_objective(tmp_path, ylabels):
    """The published folder has no lm_loss column: it loads, and its curves plot the objective, labelled so."""
    folder = Path(__file__).resolve().parents[1] / "docs" / "results" / "reference_h200"
    con = duckdb.connect(str(load(folder)), read_only=True)
    ((sid,),) = con.execute("SELECT sweep_id FROM sweeps").fetchall()
    curves = load_curves(con, sid)
    con.close()
    assert len(curves) and curves["lm_loss"].isna().all()
    plots.plot_curves(curves, tmp_path / "curves.png")
    assert ylabels == [{OBJECTIVE}]
