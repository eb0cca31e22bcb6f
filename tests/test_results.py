"""The store's run record: the runs table is RunRecord (columns, order, types), rows round-trip, writes are atomic."""

import dataclasses
import json

import pytest

from mixdepth import results

# The runs table of SCHEMA_VERSION 1 as existing databases hold it: (column, DuckDB type, key).
SCHEMA_V1 = [
    ("run_id", "VARCHAR", "PRI"),
    *((c, "VARCHAR", None) for c in ("sweep_id", "arch")),
    ("budget", "DOUBLE", None),
    *((c, "INTEGER", None) for c in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "seq_len", "vocab_size")),
    *((c, "BIGINT", None) for c in ("params_total", "params_nonembed", "params_active")),
    *((c, "DOUBLE", None) for c in ("flops_per_token", "flops_6nd", "train_flops")),
    ("tokens", "BIGINT", None),
    ("steps", "INTEGER", None),
    ("batch_size", "INTEGER", None),
    ("lr", "DOUBLE", None),
    ("seed", "INTEGER", None),
    ("status", "VARCHAR", None),
    *((c, "DOUBLE", None) for c in ("val_loss", "val_loss_causal", "train_loss", "wall_s", "tokens_per_s", "mfu")),
    ("peak_flops", "DOUBLE", None),
    *((c, "VARCHAR", None) for c in ("device", "precision")),
    ("versions", "JSON", None),
    *((c, "VARCHAR", None) for c in ("corpus", "corpus_fingerprint")),
    ("routing_stats", "JSON", None),
    *((c, "DOUBLE", None) for c in ("setup_s", "eval_s", "peak_memory_gib")),
    ("corpus_tokens", "BIGINT", None),
    ("train_lm_loss", "DOUBLE", None),
    ("config", "JSON", None),
    ("created_at", "TIMESTAMP", None),
]


def record(run_id: str = "r1", **metrics) -> results.RunRecord:
    m = results.RunMetrics(
        status="ok",
        val_loss=2.5,
        val_loss_causal=2.75,
        train_loss=2.4,
        wall_s=1.5,
        tokens_per_s=1000.0,
        mfu=None,
        peak_flops=None,
        device="cpu:x86_64x2",
        precision="32-true",
        versions={"torch": "2.13.0"},
        corpus="stdlib:python3.11.7",
        corpus_fingerprint="0123456789abcdef",
        routing_stats={"capacity": 0.125},
    )
    return results.RunRecord(
        run_id=run_id,
        sweep_id="s1",
        arch="mod",
        budget=1e11,
        d_model=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        d_ff=96,
        seq_len=128,
        vocab_size=256,
        params_total=30_000,
        params_nonembed=20_000,
        params_active=30_000,
        flops_per_token=4e4,
        flops_6nd=7.2e9,
        train_flops=7.2e9,
        tokens=60_000,
        steps=30,
        batch_size=16,
        lr=3e-3,
        seed=0,
        metrics=dataclasses.replace(m, **metrics),
        config={"model": {"arch": "mod"}},
    )


def test_runs_table_is_the_record(tmp_path):
    con = results.connect(tmp_path / "r.db")
    described = [(r[0], r[1], r[3]) for r in con.execute("DESCRIBE runs").fetchall()]
    from_record = [(c, t.split()[0], "PRI" if "PRIMARY KEY" in t else None) for c, t in results.RUN_COLUMNS.items()]
    assert described == from_record == SCHEMA_V1
    assert list(record().row()) == list(results.RUN_COLUMNS)[:-1]  # all but created_at, which the store stamps
    metric_cols = [f.name for f in dataclasses.fields(results.RunMetrics)]
    assert list(results.RUN_COLUMNS)[22:41] == metric_cols  # the measured columns sit where the record puts them


def test_record_round_trips_and_replaces(tmp_path):
    con = results.connect(tmp_path / "r.db")
    curve = [{"step": s, "tokens": 16 * s, "flops": 1e6 * s, "train_loss": 3.0 / s, "lr": 1e-3} for s in (1, 2)]
    results.add_run(con, record(), curve)
    results.add_run(con, record(val_loss=2.25), curve)  # same run_id: replaces row and curve
    cur = con.execute("SELECT * FROM runs")
    (row,) = cur.fetchall()
    stored = dict(zip([d[0] for d in cur.description], row, strict=True))
    assert stored.pop("created_at") is not None
    for col, sql in results.RUN_COLUMNS.items():
        if sql == "JSON":
            stored[col] = json.loads(stored[col])
    assert stored == record(val_loss=2.25).row()
    assert con.execute("SELECT count(*) FROM curves WHERE run_id = 'r1'").fetchone()[0] == 2


def test_add_run_is_atomic_and_checks_columns(tmp_path):
    con = results.connect(tmp_path / "r.db")
    results.add_run(con, record(), [])
    with pytest.raises(KeyError):  # a curve point without lr fails after the row was inserted
        results.add_run(con, record("r2"), [{"step": 1, "tokens": 1, "flops": 1.0, "train_loss": 1.0}])
    assert con.execute("SELECT list(run_id) FROM runs").fetchone()[0] == ["r1"]
    assert con.execute("SELECT count(*) FROM curves").fetchone()[0] == 0
    for bad in ({"run_id": "r3", "val_los": 1.0}, {"run_id": "r3", "created_at": None}):
        with pytest.raises(results.StoreError, match="unknown run columns"):
            results.add_run(con, bad, [])
    results.add_run(con, {"run_id": "r4", "arch": "dense", "status": "ok"}, [])  # partial rows: the rest NULL
    assert con.execute("SELECT arch, val_loss FROM runs WHERE run_id = 'r4'").fetchone() == ("dense", None)


def test_a_metric_added_later_reaches_an_older_database(tmp_path):
    """A RunMetrics field added after a database was made: connect gives its runs table the column (NULL for the
    rows stored before) and new runs store it; nothing else changes."""
    path = tmp_path / "r.db"
    con = results.connect(path)
    results.add_run(con, record("old"), [])
    con.execute("ALTER TABLE runs DROP COLUMN mfu")  # the database as made before mfu was a metric
    con.close()
    con = results.connect(path)
    assert "mfu" in [r[0] for r in con.execute("DESCRIBE runs").fetchall()]
    results.add_run(con, record("new", mfu=0.41), [])
    rows = con.execute("SELECT run_id, mfu, val_loss FROM runs ORDER BY run_id").fetchall()
    assert rows == [("new", 0.41, 2.5), ("old", None, 2.5)]


def test_an_older_database_gains_the_lm_loss_columns(tmp_path):
    """A store made before curves recorded the LM loss beside the objective: connect gives ``curves`` its lm_loss and
    ``runs`` its train_lm_loss (NULL for what was stored before), after the columns they had; new runs store both,
    and a curve point without lm_loss (restored from an older checkpoint) stores NULL."""
    path = tmp_path / "r.db"
    con = results.connect(path)
    results.add_run(con, record("old"), _curve(3.0, 2.0))
    con.execute("ALTER TABLE curves DROP COLUMN lm_loss")  # the tables as made before the LM loss was recorded
    con.execute("ALTER TABLE runs DROP COLUMN train_lm_loss")
    con.close()
    con = results.connect(path)
    assert [r[0] for r in con.execute("DESCRIBE curves").fetchall()] == [*results.CURVE_COLUMNS]
    assert [r[0] for r in con.execute("DESCRIBE runs").fetchall()][-2:] == ["created_at", "train_lm_loss"]
    curve = [{**p, "lm_loss": v - 0.5} for p, v in zip(_curve(3.0, 2.0), (3.0, 2.0), strict=True)]
    results.add_run(con, record("new", train_lm_loss=1.5), [_curve(4.0)[0], *curve[1:]])
    assert con.execute("SELECT run_id, train_loss, train_lm_loss FROM runs ORDER BY 1").fetchall() == [
        ("new", 2.4, 1.5),
        ("old", 2.4, None),
    ]
    assert con.execute("SELECT run_id, step, train_loss, lm_loss FROM curves ORDER BY 1, 2").fetchall() == [
        ("new", 1, 4.0, None),
        ("new", 2, 2.0, 1.5),
        ("old", 1, 3.0, None),
        ("old", 2, 2.0, None),
    ]


def test_sweeps_carry_their_provenance_also_in_an_older_database(tmp_path):
    """sweeps gains planned, version, commit and command (NULL for sweeps recorded before); a rerun updates them and
    keeps created_at; isoflop_points ends with each run's seed after the columns it always had."""
    path = tmp_path / "r.db"
    con = results.connect(path)
    con.execute("DROP TABLE sweeps")
    con.execute(  # the table as databases made before provenance hold it
        "CREATE TABLE sweeps (sweep_id VARCHAR PRIMARY KEY, name VARCHAR, preset VARCHAR, config JSON,"
        " created_at TIMESTAMP)"
    )
    con.execute("INSERT INTO sweeps VALUES ('old', 'o', 'isoflop', '{}', now())")
    con.close()
    con = results.connect(path)
    cols = [r[0] for r in con.execute("DESCRIBE sweeps").fetchall()]
    assert cols == ["sweep_id", "name", "preset", "config", "created_at", "planned", "version", "commit", "command"]
    prov = {"planned": 60, "version": "0.1.0", "commit": "ab" * 20, "command": "python -m sweeps isoflop"}
    results.add_sweep(con, "new", "n", "isoflop", {"a": 1}, prov)
    created = con.execute("SELECT created_at FROM sweeps WHERE sweep_id = 'new'").fetchone()
    results.add_sweep(con, "new", "n2", "isoflop", {"a": 1}, {**prov, "planned": 61})
    rows = con.execute("SELECT sweep_id, name, planned, version, commit, command FROM sweeps ORDER BY 1").fetchall()
    assert rows == [("new", "n2", 61, "0.1.0", "ab" * 20, "python -m sweeps isoflop"), ("old", "o", *[None] * 4)]
    assert con.execute("SELECT created_at FROM sweeps WHERE sweep_id = 'new'").fetchone() == created
    with pytest.raises(results.StoreError, match="unknown sweep columns"):
        results.add_sweep(con, "x", "x", "isoflop", {}, {"planed": 1})
    view = [r[0] for r in con.execute("DESCRIBE isoflop_points").fetchall()]
    assert view[-1] == "seed" and view[:-1] == [
        "sweep_id", "arch", "budget", "run_id", "n", "params_total", "params_active", "d", "flops_per_token",
        "train_flops", "val_loss", "val_loss_causal",
    ]  # fmt: skip


def _curve(*losses: float) -> list[dict]:
    return [
        {"step": s, "tokens": 16 * s, "flops": 1e6 * s, "train_loss": v, "lr": 1e-3} for s, v in enumerate(losses, 1)
    ]


@pytest.mark.parametrize(
    "losses, blown",
    [
        ((5.5, 3.0, 2.1), False),
        ((5.5, 5.6, 4.0), False),  # a bump during warm-up: noise, not a blow-up
        ((5.5, 3.0, 11.1, 2.9), True),  # above twice the first, though it fell back
        ((6.4, 113.3, 1.7e6, 3.1), True),
        ((), False),
    ],
)
def test_blew_up_is_a_loss_above_twice_the_first(losses, blown):
    assert results.blew_up(_curve(*losses)) is blown


def test_a_schema_1_store_has_its_blown_up_runs_judged_on_opening(tmp_path):
    """A store written before the blow-up rule: the first write-open turns its ok runs whose stored curve blew up
    into diverged ones with NULL losses and statistics (their curves kept), leaves the rest as they were, and does
    it once (a schema 2 store is not judged again)."""
    path = tmp_path / "r.db"
    con = results.connect(path)
    results.add_run(con, record("healthy"), _curve(5.5, 3.0, 2.4))
    results.add_run(con, record("blown"), _curve(5.5, 4000.0, 2.9))
    results.add_run(con, record("nan", status="diverged", val_loss=None), _curve(5.5, 9.0))
    con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    con.close()
    con = results.connect(path)
    cols = "run_id, status, val_loss, val_loss_causal, train_loss, routing_stats"
    assert con.execute(f"SELECT {cols} FROM runs ORDER BY 1").fetchall() == [
        ("blown", "diverged", None, None, None, None),
        ("healthy", "ok", 2.5, 2.75, 2.4, '{"capacity": 0.125}'),
        ("nan", "diverged", None, 2.75, 2.4, '{"capacity": 0.125}'),
    ]
    assert con.execute("SELECT count(*) FROM curves WHERE run_id = 'blown'").fetchone()[0] == 3
    assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "2"
    results.add_run(con, record("later"), _curve(5.5, 4000.0))  # as a schema 2 store: judged when trained
    con.close()
    con = results.connect(path)
    assert con.execute("SELECT status FROM runs WHERE run_id = 'later'").fetchone()[0] == "ok"
