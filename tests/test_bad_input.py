"""Bad input: one clear line on stderr, a non-zero exit, and an existing results.db left byte-for-byte unchanged."""

import hashlib
import math
import subprocess
import sys
import time

import duckdb
import pytest
import torch

from mixdepth import results

SMALL = ["data.max_bytes=200000", "data.val_tokens=2048", "data.seq_len=32"]


@pytest.fixture
def db(tmp_path):
    """A store holding one finished run."""
    path = tmp_path / "results.db"
    con = results.connect(path)
    results.add_run(con, {"run_id": "r1", "arch": "dense", "budget": 1e12, "val_loss": 2.5, "status": "ok"}, [])
    con.close()
    return path


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_clean_failure(r, needle: str, code: int | None = None):
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and (code is None or r.returncode == code), (r.returncode, r.stderr)
    assert len(lines) == 1, r.stderr
    assert needle in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "override,needle,code",
    [
        ("sweep.nosuchkey=1", "sweep.nosuchkey", 2),
        ("train.lr=abc", "train.lr", 2),
        ("sweep.budgets=[0]", "positive", 2),
        ("sweep.budgets=[-3e12]", "positive", 2),
        ("sweep.budgets=[1e6]", "below the smallest", 2),
        ("data.corpus=/no/such/corpus.txt", "/no/such/corpus.txt", 1),
    ],
)
def test_bad_config_leaves_db_unchanged(cli, db, override, needle, code):
    before = digest(db)
    r = cli("sweeps", "isoflop", "--db", str(db), override, *SMALL)
    assert_clean_failure(r, needle, code)
    assert digest(db) == before


def test_empty_corpus(cli, db, tmp_path):
    (tmp_path / "empty").mkdir()
    before = digest(db)
    r = cli("sweeps", "isoflop", "--db", str(db), f"data.corpus={tmp_path / 'empty'}", *SMALL)
    assert_clean_failure(r, "empty", 1)
    assert digest(db) == before


def test_unwritable_db_path(cli, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    r = cli("sweeps", "isoflop", "--db", str(blocker / "results.db"), *SMALL)
    assert_clean_failure(r, "cannot create database", 1)
    assert blocker.read_text() == "not a folder"


def test_corrupt_db(cli, tmp_path):
    bad = tmp_path / "results.db"
    bad.write_bytes(b"this is not a duckdb file" * 200)
    before = digest(bad)
    r = cli("sweeps", "isoflop", "--db", str(bad), *SMALL)
    assert_clean_failure(r, "not a valid DuckDB file", 1)
    assert digest(bad) == before


def test_db_held_by_another_process(cli, db):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import duckdb,time; c=duckdb.connect({str(db)!r}); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        time.sleep(0.2)
        before = digest(db)
        r = cli("sweeps", "isoflop", "--db", str(db), *SMALL)
        assert_clean_failure(r, "in use by another process", 1)
        assert digest(db) == before
    finally:
        holder.kill()
        holder.wait()


def test_bad_sql(cli, db):
    before = digest(db)
    r = cli("analysis", "query", "--db", str(db), "SELEC * FROM runs")
    assert_clean_failure(r, "error")
    assert digest(db) == before


def test_unknown_preset_and_unknown_command(cli):
    r = cli("sweeps", "isoflop", "--preset", "nope")
    assert_clean_failure(r, "unknown preset", 2)
    r = cli("sweeps", "nonsense")
    assert r.returncode == 2 and "invalid choice" in r.stderr


DIVERGING = [
    "sweep.name=nan",
    "sweep.archs=[dense,mod]",
    "sweep.budgets=[1e9]",
    "sweep.ladder=[{d_model: 32, n_layers: 2, n_heads: 2}]",
    "sweep.min_steps=4",
    "sweep.workers=1",
    "train.batch_size=4",
    "train.progress=false",
    "train.lr=1e3",  # every run's loss is NaN after one step
    *SMALL,
]


def test_diverged_runs_are_stored_as_diverged_never_as_a_loss(cli, tmp_path, status_row):
    """Runs whose loss goes NaN are stored status 'diverged' with NULL losses and statistics (the validation sums
    once dropped NaN and stored a perfect 0), every planned run is still trained, the views and the status table
    hold no loss for them, and a sweep with no finite loss ends with one line and exit 1 instead of a fit."""
    db = tmp_path / "results.db"
    r = cli("sweeps", "isoflop", "--db", str(db), *DIVERGING)
    assert_clean_failure(r, "no run of sweep", 1)
    assert "2 of 2 runs diverged" in r.stdout and r.stdout.count("val_loss=diverged") == 2
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT arch, status, val_loss, val_loss_causal, train_loss, routing_stats FROM runs").fetchall()
    assert sorted(rows) == [("dense", "diverged", None, None, None, None), ("mod", "diverged", None, None, None, None)]
    assert con.execute("SELECT count(*) FROM frontier").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM isoflop_points").fetchone()[0] == 0
    con.close()
    row = status_row(cli("sweeps", "status", "--db", str(db)).stdout, "nan")
    assert [row[k] for k in ("ok", "diverged", "failed attempts", "best val_loss")] == ["0", "2", "0", "-"]


@pytest.mark.parametrize("lr, status", [(0.3, "diverged"), (3e-3, "ok")])
def test_a_run_whose_loss_blows_up_is_diverged_though_it_stays_finite(lr, status):
    """MoD at a far too high learning rate: its training loss jumps to 1e2-1e4 and falls back, finite throughout,
    and its held-out loss is a number; a run that blew up is no point on a curve, so it is diverged like a NaN run
    (NULL losses), its curve kept. The same run at a sane rate stays ok."""
    from mixdepth.config import DataConfig, TrainConfig
    from mixdepth.models import MODELS
    from mixdepth.train import RunConfig, fit

    model = MODELS["mod"][0](d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, seq_len=32, vocab_size=256)
    train = TrainConfig(batch_size=8, lr=lr, progress=False, logger="none", log_every=1)
    res = fit(RunConfig(model, DataConfig(seq_len=32, max_bytes=200000, val_tokens=2048), train, 30))
    losses = [p["train_loss"] for p in res.curve]
    assert len(losses) == 30 and all(map(math.isfinite, losses)), losses
    assert res.metrics.status == status and results.blew_up(res.curve) == (status == "diverged"), losses
    m = res.metrics
    assert (m.val_loss is None and m.train_loss is None and m.routing_stats is None) == (status == "diverged")


@pytest.mark.parametrize("target", ["results.db", "results.db.wal", "results.db.optuna.log", "link.db"])
@pytest.mark.parametrize("command", ["export", "report", "plot"])
def test_no_command_writes_over_the_store(cli, db, target, command):
    """export's destination, and report/plot's folder and the files they write into it, may not be the database,
    its WAL or its Optuna journal (nor a link to one): one line, exit 1, all three byte-identical."""
    files = [db, db.parent / "results.db.wal", db.parent / "results.db.optuna.log"]
    for f in files[1:]:
        f.write_bytes(b"sidecar " + f.name.encode())
    (db.parent / "link.db").symlink_to(db)
    before = [digest(f) for f in files]
    out = str(db.parent / target)
    args = ["runs", out] if command == "export" else ["--out", out]
    r = cli("analysis", command, "--db", str(db), *args)
    assert_clean_failure(r, "refusing to write", 1)
    assert [digest(f) for f in files] == before


def test_report_folder_holding_the_store_is_refused(cli, db):
    """A report folder is fine beside the store, but not when a file it writes would be the store."""
    renamed = db.parent / "report.md"
    db.rename(renamed)
    before = digest(renamed)
    r = cli("analysis", "report", "--db", str(renamed), "--out", str(db.parent))
    assert_clean_failure(r, "refusing to write", 1)
    assert digest(renamed) == before


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.precision=bogus", "train.precision"),
        ("train.accelerator=tpu", "train.accelerator"),
        ("train.logger=neptune", "train.logger"),
        ("train.beta1=1.5", "train.beta1"),
        ("train.beta2=-0.1", "train.beta2"),
        ("train.seed=-1", "train.seed"),
        ("train.weight_decay=-0.1", "train.weight_decay"),
        ("train.warmup_frac=1.5", "train.warmup_frac"),
        ("train.warmup_steps=-1", "train.warmup_steps"),
        ("train.min_lr_ratio=2", "train.min_lr_ratio"),
        ("train.threads=-1", "train.threads"),
        ("train.grad_clip=-1", "train.grad_clip"),
        ("train.peak_flops=-1", "train.peak_flops"),
        ("train.lr=inf", "train.lr"),
        ("sweep.min_steps=0", "sweep.min_steps"),
        ("sweep.max_steps=-1", "sweep.max_steps"),
        ("sweep.retries=-1", "sweep.retries"),
        ("sweep.mps=off", "sweep.mps"),  # YAML reads off as false: the choices are auto, always, never
        ("sweep.archs=[]", "sweep.archs"),
        ("sweep.budgets=[inf]", "sweep.budgets"),
        ("sweep.budgets=[1e11,1e11]", "sweep.budgets"),
        ("sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}, {d_model: 16, n_layers: 1, n_heads: 2}]", "ladder"),
        ("data.val_fraction=1.0", "data.val_fraction"),
        ("data.tokenizer=words", "data.tokenizer"),
        ("data.seq_len=0", "data.seq_len"),
        ("sweep.name=/abs/path", "sweep.name"),  # names are names (labels in the store and reports), not paths
        ("sweep.name=../..", "sweep.name"),
        ("--preset=../sweep/isoflop", "preset"),  # the preset begins the sweep id, which names the report folder
        ("train.lr=${oc.env:MIXDEPTH_TEST_LR}", "train.lr"),  # set below: it would resolve, and be stored
    ],
)
def test_every_config_value_is_checked_at_load_time(db, override, key, capsys, monkeypatch):
    """Values that only the Trainer, the optimizer or the fit rejected (or that nothing rejected) stop at load
    time: exit 2, one line naming the key, and no sweeps row, queue entry or journal written."""
    from sweeps.__main__ import main

    monkeypatch.setenv("MIXDEPTH_TEST_LR", "1e-3")

    files = [db, db.parent / "results.db.wal", db.parent / "results.db.optuna.log"]
    before = [digest(f) if f.exists() else None for f in files]
    assert main(["isoflop", "--db", str(db), override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and err[0].startswith("error: "), err
    assert [digest(f) if f.exists() else None for f in files] == before


@pytest.mark.parametrize("override", ["train.accelerator=tpu", "train.precision=bf17", "train.logger=neptune"])
def test_print_config_checks_values_as_load_config_does(override, tmp_path, monkeypatch, capsys):
    """--print-config touches nothing but the config: a bad accelerator, precision or logger is its exit 2 too."""
    from sweeps.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main(["isoflop", "--print-config", override]) == 2
    cap = capsys.readouterr()
    key = override.split("=")[0]
    assert cap.out == "" and cap.err.startswith(f"error: {key} must be one of ") and cap.err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_a_logger_without_its_package_stops_before_anything_is_written(db, monkeypatch, capsys):
    """train.logger=tensorboard|wandb|mlflow without the package: one line naming the extra that installs it, exit 2,
    before the store, the journal or a run (the packages are optional; CI installs none of them)."""
    import importlib.util

    from mixdepth import launch
    from sweeps.__main__ import main

    absent = [k for k, need in launch.LOGGER_PACKAGES.items() if not any(importlib.util.find_spec(p) for p in need)]
    if not absent:  # every logger package is installed here: one of them is made to look missing
        monkeypatch.setitem(launch.LOGGER_PACKAGES, "wandb", ("mixdepth_no_such_package",))
        absent = ["wandb"]
    logger = absent[0]
    need = launch.LOGGER_PACKAGES[logger][0]
    files = [db, db.parent / "results.db.wal", db.parent / "results.db.optuna.log"]
    before = [digest(f) if f.exists() else None for f in files]
    assert main(["isoflop", "--db", str(db), f"train.logger={logger}", *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: train.logger={logger} needs the {need} package: pip install 'mixdepth[{logger}]'"]
    assert [digest(f) if f.exists() else None for f in files] == before
    assert not (db.parent / "results_logs").exists()


def test_a_worker_checks_the_logger_package_before_it_takes_a_run(cli, tmp_path):
    """The logger a queued sweep asks for, or a worker's own train.logger, must be installed on the worker's host:
    else one line and exit 2 with every run still queued (the planning host trains nothing, so it checks nothing)."""
    import importlib.util

    import optuna

    if importlib.util.find_spec("mlflow"):
        pytest.skip("needs a logger package that is missing, and mlflow is installed here")
    url = f"sqlite:///{tmp_path / 'queue.db'}"
    one = ["sweep.archs=[dense]", "sweep.budgets=[1e9]", "sweep.min_steps=4", *SMALL]
    r = cli("sweeps", "isoflop", "--enqueue-only", f"sweep.storage={url}", "train.logger=mlflow", *one)
    assert r.returncode == 0, r.stderr
    (name,) = optuna.get_all_study_names(url)
    before = [t.state for t in optuna.load_study(study_name=name, storage=url).trials]
    for extra in ([], ["train.logger=mlflow"]):
        r = cli("sweeps", "worker", "--storage", url, *extra)
        assert_clean_failure(r, "train.logger=mlflow needs the mlflow package: pip install 'mixdepth[mlflow]'", 2)
    after = [t.state for t in optuna.load_study(study_name=name, storage=url).trials]
    assert after == before and set(before) == {optuna.trial.TrialState.WAITING}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_gpu_accelerator_without_a_gpu(db, capsys):
    """Training on a GPU that is not there stops before the store is opened; planning (a dry run) works anywhere."""
    from sweeps.__main__ import main

    before = digest(db)
    assert main(["isoflop", "--db", str(db), "train.accelerator=gpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: train.accelerator=gpu, but no GPU is visible; use auto or cpu"]
    assert digest(db) == before
    assert main(["isoflop", "--preset", "isoflop_h200", "--db", str(db), "--dry-run"]) == 0
    assert "sweep isoflop_h200-" in capsys.readouterr().out and digest(db) == before


@pytest.mark.parametrize(
    "args",
    [
        ["fit-csv", "x.csv", "--n-col", "N", "--c-col", "C", "--loss-col", "L", "--holdout", "-5"],
        ["fit-csv", "x.csv", "--n-col", "N", "--c-col", "C", "--loss-col", "L", "--n-starts", "-4"],
        ["fit-csv", "x.csv", "--n-col", "N", "--c-col", "C", "--loss-col", "L", "--c-bin-width", "nan"],
        ["fit-csv", "x.csv", "--n-col", "N", "--c-col", "C", "--loss-col", "L", "--drop-highest-loss", "-1"],
        ["report", "--db", "x.db", "--out", "o", "--holdout", "-3"],
        ["forecast", "--db", "x.db", "--holdout", "-1"],
    ],
)
def test_analysis_counts_are_checked(args, capsys):
    from analysis.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "must be" in err[0], err


@pytest.mark.parametrize(
    "sql,made",
    [
        ("SELECT * FROM read_text('/etc/passwd')", None),
        ("SELECT * FROM read_csv('{dir}/secret.csv')", None),
        ("COPY (SELECT * FROM runs) TO '{dir}/out.csv'", "out.csv"),
        ("ATTACH '{dir}/other.db' AS other", "other.db"),
    ],
)
def test_query_reads_the_store_and_nothing_else(cli, db, sql, made):
    """User SQL runs with DuckDB's external access disabled: no file read, written or attached (one line, exit 1,
    nothing created, the store unchanged) unless --allow-files is given."""
    (db.parent / "secret.csv").write_text("a\n1\n")
    before = digest(db)
    r = cli("analysis", "query", "--db", str(db), sql.format(dir=db.parent))
    assert_clean_failure(r, "disabled by configuration", 1)
    assert digest(db) == before and (made is None or not (db.parent / made).exists())
    if made == "out.csv":
        r = cli("analysis", "query", "--db", str(db), "--allow-files", sql.format(dir=db.parent))
        assert r.returncode == 0 and (db.parent / made).read_text().startswith("run_id"), r.stderr


def _foreign(path):
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE measurements (t DOUBLE, v DOUBLE)")
    con.execute("INSERT INTO measurements VALUES (1, 2)")
    con.close()


def _newer(path):
    con = results.connect(path)
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [str(results.SCHEMA_VERSION + 1)])
    con.close()


@pytest.mark.parametrize("make,needle", [(_foreign, "not a mixdepth store"), (_newer, "newer than this mixdepth")])
@pytest.mark.parametrize("command", ["sweeps", "fit", "report"])
def test_writers_refuse_foreign_and_newer_stores(tmp_path, make, needle, command, capsys):
    """A DuckDB file that is not a mixdepth store, or one of a newer schema, is refused by every command that
    writes (one line, exit 1) and left byte-identical: no tables created, no schema version written over."""
    db = tmp_path / "other.db"
    make(db)
    before = digest(db)
    if command == "sweeps":
        from sweeps.__main__ import main

        rc = main(["isoflop", "--db", str(db), "sweep.archs=[dense]", "train.accelerator=cpu", *SMALL])
    else:
        from analysis.__main__ import main

        extra = ["--out", str(tmp_path / "out"), "--store"] if command == "report" else []
        rc = main([command, "--db", str(db), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and needle in err[0], err
    assert digest(db) == before
