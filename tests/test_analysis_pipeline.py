"""Store → fits table → figures → report, on synthetic sweeps with a known surface."""

import colorsys
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread

from analysis import AnalysisError
from analysis.pipeline import OUTPUT_NAMES, run_all
from analysis.plots import ARCH_COLORS, normalize_to_dense, palette, plot_mod_normalized, series_color
from analysis.report import redact
from analysis.synthetic import TRUTH, fake_runs
from mixdepth.results import add_run, add_sweep, connect, writer

PNG = b"\x89PNG"


def curve(row, points=5):
    """A training curve ending at the run's tokens, falling to its train loss."""
    steps = np.arange(1, points + 1)
    return [
        {"step": int(k), "tokens": int(row["tokens"] * k / points), "flops": float(row["train_flops"] * k / points),
         "train_loss": float(row["train_loss"] + 0.5 * (points - k) / points), "lr": 1e-3}
        for k in steps
    ]  # fmt: skip


def make_store(path, rows, sweep_id="s1", config=None, provenance=None):
    """A store holding ``rows`` with their curves; ``provenance`` fills the sweeps table's provenance columns
    (planned, version, commit, command), added where the store's schema predates them."""
    con = connect(path)
    add_sweep(con, sweep_id, "synthetic", "test", config or {"budgets": [1e15, 1e16, 1e17]})
    for key, value in (provenance or {}).items():
        kind = "INTEGER" if key == "planned" else "VARCHAR"
        con.execute(f"ALTER TABLE sweeps ADD COLUMN IF NOT EXISTS {key} {kind}")
        con.execute(f"UPDATE sweeps SET {key} = ? WHERE sweep_id = ?", [value, sweep_id])
    for r in rows:
        add_run(con, r, curve(r) if r.get("status") == "ok" else [])
    con.close()


def test_run_all_writes_fits_plots_and_report(tmp_path):
    db = tmp_path / "results.db"
    rows = fake_runs("s1", "dense", sizes_per_budget=5)  # 3 budgets x 5 sizes
    rows += fake_runs("s1", "mod", budgets=(1e16,), sizes_per_budget=2, flops_scale=0.6, causal_offset=0.02)
    rows += [dict(rows[0], run_id="failed", status="diverged", val_loss=None)]
    make_store(db, rows)
    paths = run_all(db, "s1", tmp_path / "out")

    pngs = ("isoflop_plot", "frontier_plot", "forecast_plot", "mod_plot", "curves_plot", "residuals_plot")
    assert set(paths) == {"fits_json", "report", *pngs}
    for key in pngs:
        assert paths[key].suffix == ".png" and paths[key].read_bytes()[:4] == PNG
    assert {p.name for p in (tmp_path / "out").iterdir()} <= set(OUTPUT_NAMES)  # the CLI guards each of them

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
                   "mod: parametric fit skipped", "diverged: 1", "planned count unknown", "## Provenance",
                   "mixdepth version: not recorded", "command line: not recorded", "![curves_plot](curves.png)",
                   "![residuals_plot](residuals.png)", "## Approach 3: compute-optimal frontier",
                   "## Seed noise and comparison to dense", "## The papers' claims at this scale",
                   "at equal training FLOPs (MoD Fig. 4) | 1e+16 | mod (N"):  # fmt: skip
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


def has_color(png, rgb, tol=1.5 / 255):
    """Some pixel of the PNG is ``rgb`` (floats in [0, 1]) to within 8-bit rounding."""
    img = imread(png)[..., :3]
    return bool(np.any(np.all(np.abs(img - np.asarray(rgb)) < tol, axis=-1)))


def test_series_colors_depend_on_the_name_only():
    assert palette(["dense", "mod"])["mod"] == palette(["mod", "moda", "zeta"])["mod"] == series_color("mod")
    models = {p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "model").glob("*.yaml")}
    assert set(ARCH_COLORS) == models  # every arch a sweep can name has a fixed colour, each its own
    assert series_color("mod") == ARCH_COLORS["mod"] and len(set(ARCH_COLORS.values())) == len(ARCH_COLORS)
    for arch in (*ARCH_COLORS, "zeta"):
        h, lum, _ = colorsys.rgb_to_hls(*series_color(arch))
        hc, lum_c, _ = colorsys.rgb_to_hls(*series_color(f"{arch}:causal"))
        assert hc == pytest.approx(h, abs=1e-9) and lum_c > lum  # the same hue, lighter
    assert series_color("zeta") not in ARCH_COLORS.values()  # an arch outside the registry: a colour of its own


def test_every_figure_draws_each_series_in_its_colour(tmp_path):
    # dense and mode only: a colour taken by position among the archs shown would give mode the second colour
    db = tmp_path / "results.db"
    rows = fake_runs("s1", "dense", sizes_per_budget=5)
    rows += fake_runs("s1", "mode", sizes_per_budget=5, flops_scale=0.6, causal_offset=0.02, seed=1)
    make_store(db, rows)
    paths = run_all(db, "s1", tmp_path / "out", store=False)
    series = ("dense", "mode", "mode:causal")
    for key in ("isoflop_plot", "frontier_plot", "forecast_plot", "residuals_plot"):
        for s in series:
            assert has_color(paths[key], series_color(s)), (key, s)
    assert has_color(paths["curves_plot"], series_color("mode")) and has_color(
        paths["curves_plot"], ARCH_COLORS["dense"]
    )
    for s in series:  # bubbles drawn at alpha 0.75 over the white axes
        assert has_color(paths["mod_plot"], 0.75 * np.array(series_color(s)) + 0.25), s
    assert not has_color(paths["frontier_plot"], ARCH_COLORS["mod"])  # mod's colour: no series here is mod's


ESTIMATE_SECTIONS = (
    "## Approach 2: isoFLOP parabolas", "## Approach 2: power laws", "## Approach 3: parametric fit",
    "## Approach 3: compute-optimal frontier",
)  # fmt: skip
EXACT_COLUMNS = {"series", "budget C (FLOPs)", "runs", "points", "budgets", "law", "vertex inside", "intervals",
                 "objective (statistic)", "constraint (exact)"}  # fmt: skip


def estimate_cells(text):
    """(section, column, cell) of every table cell of the estimate sections outside EXACT_COLUMNS."""
    out, section, header = [], None, None
    for line in text.splitlines():
        if line.startswith("## "):
            section, header = next((s for s in ESTIMATE_SECTIONS if line.startswith(s)), None), None
        elif section and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = cells
                continue
            out += [(section, h, c) for h, c in zip(header, cells, strict=True) if h not in EXACT_COLUMNS]
        elif not line.startswith("|"):
            header = None
    return out


def test_report_of_a_partial_sweep_states_provenance_and_an_interval_for_every_estimate(tmp_path):
    db = tmp_path / "results.db"
    rows = fake_runs("s1", "dense", sizes_per_budget=5)
    rows += fake_runs("s1", "moda", budgets=(1e15, 1e16), sizes_per_budget=3)  # vertices without intervals
    rows += [dict(rows[0], run_id="div", status="diverged", val_loss=None)]
    config = {"model": {"arch": "dense"}, "sweep": {"storage": "postgresql://bob:***@db:5432/opt"},
              "note": "postgresql://bob:leaked@db/x"}  # fmt: skip
    provenance = {"planned": 30, "version": "0.4.0", "commit": "0123abc",
                  "command": "python -m sweeps isoflop sweep.storage=postgresql://bob:s3cret@db:5432/opt"}  # fmt: skip
    make_store(db, rows, config=config, provenance=provenance)
    paths = run_all(db, "s1", tmp_path / "out", store=False)
    text = paths["report"].read_text()
    for needle in ("**22 runs finished; 30 planned**", "diverged: 1", "ok: 21", "**Partial sweep**: at least 8 planned",
                   "mixdepth version: 0.4.0", "git commit: 0123abc",
                   "command line: `python -m sweeps isoflop sweep.storage=postgresql://bob:***@db:5432/opt`",
                   "<details><summary>resolved config", '"arch": "dense"', "postgresql://bob:***@db/x",
                   "not identified: 3 runs: the parabola passes through them"):  # fmt: skip
        assert needle in text, needle
    assert "s3cret" not in text and "leaked" not in text
    cells = estimate_cells(text)
    assert {s for s, _, _ in cells} == set(ESTIMATE_SECTIONS)
    for section, column, cell in cells:
        if cell in ("", "–") or cell.startswith("not identified"):
            continue
        assert cell.endswith("]") or "(not identified" in cell, (section, column, cell)
    assert any(c.endswith("]") for s, h, c in cells if s == ESTIMATE_SECTIONS[0] and h == "N* [90%]")  # 5 runs


def test_redact_hides_url_passwords_only():
    assert redact("a postgresql+psycopg://u:p%40ss@h:5/db b") == "a postgresql+psycopg://u:***@h:5/db b"
    assert redact("sqlite:///x.db and mysql://u@h/db") == "sqlite:///x.db and mysql://u@h/db"


@pytest.mark.parametrize(
    "summary, needles",
    [
        ({"finished": 5}, ["**5 runs finished; planned count unknown**", "git commit: not recorded",
                           "resolved config: not recorded"]),
        ({"finished": 7, "planned": 5, "version": "0.4.0"}, ["**7 runs finished; 5 planned** (sizes added",
                                                             "git commit: none (not run from a git checkout)"]),
        ({"finished": 5, "planned": 5, "runs_by_status": {"ok": 4, "diverged": 1, "unknown": 2}},
         ["**5 runs finished; 5 planned**", "ok: 4, diverged: 1;", "2 runs recorded without a status"]),
        ({"finished": 5, "passes": {"runs": 5, "recorded": 0, "least": None, "most": None, "repeated": 0,
                                    "fewest_tokens": None, "most_tokens": None}},
         ["- passes over the corpus: not recorded (the runs predate it)"]),
        ({"finished": 5, "passes": {"runs": 5, "recorded": 3, "inferred": 0, "least": 0.25, "most": 19.5,
                                    "repeated": 2, "fewest_tokens": 9_000_000, "most_tokens": 9_000_000}},
         ["- passes over the corpus's training split (9,000,000 tokens): 0.25-19.5 per run of the 3 runs whose"
          " split is known; **2 runs went over it more than once**: their held-out losses also measure memorising"]),
        ({"finished": 5, "passes": {"runs": 5, "recorded": 5, "inferred": 2, "least": 0.5, "most": 3.0,
                                    "repeated": 4, "fewest_tokens": 1000, "most_tokens": 1000}},
         ["(1,000 tokens): 0.5-3 per run (2 sized by another run of the same corpus fingerprint); **4 runs"]),
        ({"finished": 2, "passes": {"runs": 2, "recorded": 2, "least": 0.01, "most": 0.5, "repeated": 0,
                                    "fewest_tokens": 100, "most_tokens": 200}},
         ["(100-200 tokens): 0.01-0.5 per run; no run trained on more tokens than it holds"]),
        ({"finished": 2}, ["- corpus: not recorded"]),
        ({"finished": 2, "corpora": [("stdlib:python3.12.3", "aa11", 2)]},
         ["- corpus: stdlib:python3.12.3 (aa11, 2 runs)\n"]),
        ({"finished": 3, "corpora": [("site-packages:python3.12.3", "bb22", 2), ("site-packages:python3.12.3", "cc33",
                                                                                 1)]},
         ["- **runs trained on 2 corpora**: site-packages:python3.12.3 (bb22, 2 runs); site-packages:python3.12.3"
          " (cc33, 1 run): their losses were measured on different text, and the fits and curves mix them"]),
    ],
)  # fmt: skip
def test_report_header_says_how_complete_the_sweep_is(summary, needles):
    from analysis.pipeline import SweepFits
    from analysis.report import build_report

    text = build_report(SweepFits("s1", ()), pd.DataFrame(), {"sweep_id": "s1", **summary}, {})
    for needle in needles:
        assert needle in text, needle
    assert ("Partial sweep" in text) == (summary.get("planned", 0) > summary["finished"])


def test_passes_size_a_run_without_its_split_by_a_run_of_the_same_corpus(tmp_path):
    """A run stored before ``corpus_tokens`` existed takes the split's size of a run of the same corpus fingerprint
    (which identifies tokens and split); a run of another corpus stays unsized."""
    from analysis.store import sweep_summary

    con = connect(tmp_path / "r.db")
    base = {"sweep_id": "s1", "arch": "dense", "status": "ok"}
    for run_id, fp, tokens, split in (("new", "a", 3000, 1000), ("old", "a", 500, None), ("other", "b", 9000, None)):
        add_run(con, {**base, "run_id": run_id, "corpus_fingerprint": fp, "tokens": tokens, "corpus_tokens": split}, [])
    p = sweep_summary(con, "s1")["passes"]
    assert (p["runs"], p["recorded"], p["inferred"], p["least"], p["most"], p["repeated"]) == (3, 2, 1, 0.5, 3.0, 1)


def test_the_summary_counts_the_finished_runs_of_each_corpus(tmp_path):
    """Corpora by fingerprint, most runs first, over the sweep's finished runs only (a queued row has no status)."""
    from analysis.store import sweep_summary

    con = connect(tmp_path / "r.db")
    rows = (("a", "x", "ok"), ("b", "x", "diverged"), ("c", "y", "ok"), ("d", "y", None), ("e", "y", None))
    for run_id, fp, status in rows:
        add_run(con, {"sweep_id": "s1", "arch": "dense", "run_id": run_id, "status": status, "corpus": f"c-{fp}",
                      "corpus_fingerprint": fp}, [])  # fmt: skip
    add_run(con, {"sweep_id": "s2", "arch": "dense", "run_id": "f", "status": "ok", "corpus": "c-z",
                  "corpus_fingerprint": "z"}, [])  # fmt: skip
    assert sweep_summary(con, "s1")["corpora"] == [("c-x", "x", 2), ("c-y", "y", 1)]


def test_series_fitted_in_processes_equal_those_fitted_here():
    """fit_points(processes=2) spawns two processes for four series (the fits are independent and deterministic):
    the same result, forecasts and notes included, as fitting them one after another in this process."""
    from analysis.pipeline import fit_points, series_points

    rows = fake_runs("s1", "dense", sizes_per_budget=4) + fake_runs("s1", "mod", sizes_per_budget=4, flops_scale=0.6)
    rows += fake_runs("s1", "moda", sizes_per_budget=4, flops_scale=1.1)
    rows += fake_runs("s1", "mode", sizes_per_budget=4, flops_scale=0.7, causal_offset=0.01)
    points = pd.DataFrame(rows).rename(columns={"params_nonembed": "n", "tokens": "d"})
    assert len(series_points(points)["arch"].unique()) == 5
    here, spawned = (fit_points(points, "s1", processes=k) for k in (1, 2))
    assert json.dumps(spawned.to_dict()) == json.dumps(here.to_dict())
    assert [a.arch for a in spawned.archs] == ["dense", "mod", "moda", "mode", "mode:causal"]
    assert spawned.get("dense").parametric is not None
