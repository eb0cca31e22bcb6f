"""Watching a sweep: while ``python -m sweeps isoflop`` runs, ``sweeps status`` and ``analysis query`` on its
database answer (the sweep holds the right to write by a lock of its own and opens DuckDB only for each short
write), and a second sweep on the same database is still refused with one line, writing nothing."""

import signal
import subprocess
import sys
import threading
import time

import duckdb
import optuna
import pytest

from mixdepth import results

WATCH = [  # 4 runs, in-process, one thread
    "sweep.name=watch",
    "sweep.archs=[dense]",
    "sweep.budgets=[1e9,2e9]",
    "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}, {d_model: 24, n_layers: 1, n_heads: 2}]",
    "sweep.min_steps=4",
    "sweep.max_extra=0",  # the grid alone (tests/test_bracket.py adds sizes)
    "sweep.workers=1",
    "data.seq_len=32",
    "data.max_bytes=200000",
    "data.val_tokens=2048",
    "train.batch_size=4",
    "train.log_every=5",
    "train.progress=false",
    "train.threads=1",
    "train.accelerator=cpu",
]


def _readers(cli, db) -> None:
    """status and query answer, exit 0, while the sweep may be writing."""
    st = cli("sweeps", "status", "--db", str(db), timeout=120)
    assert st.returncode == 0 and "watch" in st.stdout, st.stderr
    q = cli("analysis", "query", "--db", str(db), "SELECT count(*) FROM runs", timeout=120)
    assert q.returncode == 0 and "(1 row)" in q.stdout, q.stderr


def test_status_and_query_answer_while_a_sweep_runs(cli, cli_env, tmp_path):
    db = tmp_path / "results.db"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "sweeps", "isoflop", "--db", str(db), *WATCH],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env,
    )
    lines: list[str] = []
    stored = threading.Event()

    def drain():
        for line in sweep.stdout:
            lines.append(line)
            if "val_loss=" in line and not stored.is_set():
                sweep.send_signal(signal.SIGSTOP)  # paused between writes: it holds its lock, not the database
                stored.set()

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        assert stored.wait(300), "".join(lines)
        other = subprocess.Popen(  # the same grid under another sweep id, started while the first is paused
            [sys.executable, "-m", "sweeps", "isoflop", "--db", str(db), *WATCH, "train.lr=2e-3"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env,
        )
        _readers(cli, db)
        _, other_err = other.communicate(timeout=300)
        err = other_err.strip().splitlines()
        assert other.returncode == 1 and len(err) == 1, other_err
        assert "in use by another process" in err[0] and "Traceback" not in other_err
        sweep.send_signal(signal.SIGCONT)
        rounds = 0
        while sweep.poll() is None and rounds < 2:
            _readers(cli, db)
            rounds += sweep.poll() is None  # this round began and ended while the sweep ran
        sweep.wait(timeout=300)
    finally:
        sweep.kill()
        reader.join()
    sweep_err = sweep.stderr.read()  # a few warning lines: the pipe never filled
    assert sweep.returncode == 0, sweep_err[-2000:]
    assert rounds >= 1 and sum("val_loss=" in ln for ln in lines) == 4, "".join(lines)
    sid = next(ln.split()[1].rstrip(":") for ln in lines if ln.startswith("sweep "))
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT sweep_id FROM sweeps").fetchall() == [(sid,)]  # nothing of the refused sweep
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (4,)
    finally:
        con.close()
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(db) + ".optuna.log"))
    assert [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)] == [sid]
    assert not results.lock_path(db).exists()


def _hold(db, seconds: float) -> subprocess.Popen:
    """A process holding ``db`` open read-write (DuckDB's file lock) for ``seconds``; returns once it holds it."""
    code = f"import duckdb,time; c=duckdb.connect({str(db)!r}); print('held', flush=True); time.sleep({seconds})"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.fixture
def store(tmp_path):
    db = tmp_path / "results.db"
    results.connect(db).close()
    return db


@pytest.mark.parametrize("read_only", [True, False])
def test_an_open_waits_out_a_short_hold(store, read_only):
    holder = _hold(store, 1.5)
    try:
        start = time.monotonic()
        results.connect(store, read_only=read_only).close()
        assert 0.5 < time.monotonic() - start < results.LOCK_WAIT_S
    finally:
        holder.kill()
        holder.wait()


def test_an_open_gives_up_on_a_long_hold_with_one_line(store, monkeypatch):
    monkeypatch.setattr(results, "LOCK_WAIT_S", 0.5)
    holder = _hold(store, 60)
    try:
        with pytest.raises(results.StoreError, match="^database .* is in use by another process"):
            results.connect(store, read_only=True)
    finally:
        holder.kill()
        holder.wait()


def test_one_writer_at_a_time_and_readers_between_its_writes(store):
    """The writer's lock excludes a second writer (another process) but not readers; it is gone after."""
    second = [sys.executable, "-c", f"from mixdepth import results\nwith results.writer({str(store)!r}): pass"]
    with results.writer(store) as w:
        with w.session() as con:
            results.add_run(con, {"run_id": "r1", "arch": "dense", "status": "ok"}, [])
        con = results.connect(store, read_only=True)
        assert con.execute("SELECT run_id FROM runs").fetchall() == [("r1",)]
        con.close()
        r = subprocess.run(second, capture_output=True, text=True)
        assert r.returncode == 1 and "in use by another process" in r.stderr.strip().splitlines()[-1], r.stderr
        assert results.lock_path(store).exists()
    assert not results.lock_path(store).exists()
    assert subprocess.run(second).returncode == 0
