"""Ctrl-C and SIGTERM during training stop an in-process sweep (``sweep.workers=1``, every GPU preset) like the
pool: exit 130, one line on stderr, no partial rows, and a rerun resumes to the uninterrupted sweep's results."""

import signal
import subprocess
import sys
import time

import pytest

from mixdepth import results

# Two runs in-process: the queue takes the narrower (d 32, more tokens) first, then d 48, which trains long enough
# after its start line for a signal sent half a second in to land inside training.
GRID = [
    "sweep.archs=[dense]",
    "sweep.budgets=[3e10]",
    "sweep.ladder=[{d_model: 48, n_layers: 2, n_heads: 2}, {d_model: 32, n_layers: 2, n_heads: 2}]",
    "sweep.workers=1",
    "sweep.max_extra=0",  # the grid alone (tests/test_bracket.py adds sizes)
    "train.progress=false",
    "data.max_bytes=200000",
    "data.val_tokens=2048",
    "data.seq_len=32",
]


def start(db, until: str, env, stderr=subprocess.PIPE, extra=(), group=False) -> subprocess.Popen:
    """The sweep of GRID (and ``extra``) into ``db`` as a subprocess (``group``: leading a process group of its own,
    its workers' too), returned once it has printed a line starting ``until``."""
    p = subprocess.Popen(
        [sys.executable, "-m", "sweeps", "isoflop", "--db", str(db), *GRID, *extra],
        cwd=db.parent,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        start_new_session=group,
    )
    for line in p.stdout:
        if line.startswith(until):
            break
    return p


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cli_env, val_losses):
    db = tmp_path_factory.mktemp("whole") / "results.db"
    r = subprocess.run(
        [sys.executable, "-m", "sweeps", "isoflop", "--db", str(db), *GRID],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return val_losses(db)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_in_training_exits_130_and_resumes(tmp_path, cli, cli_env, uninterrupted, val_losses, sig):
    db = tmp_path / "results.db"
    p = start(db, "[2/2]", cli_env)
    time.sleep(0.5)  # into the second run, which on an idle machine ends a few seconds after its start line
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err)
    assert err.strip().splitlines() == [
        "interrupted: finished runs are in the database; rerun the same command to resume"
    ], err

    con = results.connect(db, read_only=True)
    try:
        rows = con.execute("SELECT run_id, d_model FROM runs").fetchall()
        curves = {r[0] for r in con.execute("SELECT DISTINCT run_id FROM curves").fetchall()}
        used = con.execute("SELECT runs, parts->>'interrupted' FROM sweep_usage").fetchall()
        (lost,) = con.execute("SELECT (parts->>'runs interrupted unfinished')::DOUBLE FROM sweep_usage").fetchone()
    finally:
        con.close()
    assert [d for _, d in rows] == [32] and curves == {rows[0][0]}  # the first run whole, nothing of the second
    assert used == [(1, "true")]  # the stopped command's device time is kept, marked
    assert 0.4 < lost < 60, lost  # the second run's time until the signal (sent 0.5 s after its start line): lost

    r = cli("sweeps", "isoflop", "--db", str(db), *GRID)
    assert r.returncode == 0, r.stderr
    assert "2 runs planned, 1 already in" in r.stdout
    assert val_losses(db) == uninterrupted


def test_a_command_interrupted_in_its_first_run_keeps_its_device_time(tmp_path, cli_env):
    """Ctrl-C before any run finished: no run row, but the command's usage row, with the run's time until then as
    lost (runs interrupted unfinished), not idle."""
    db = tmp_path / "results.db"
    p = start(db, "[1/2]", cli_env)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err)
    con = results.connect(db, read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
        (row,) = con.execute(
            "SELECT runs, parts->>'stopped', (parts->>'runs interrupted unfinished')::DOUBLE,"
            " (parts->>'idle or between runs')::DOUBLE FROM sweep_usage"
        ).fetchall()
    finally:
        con.close()
    assert row[:2] == (0, "interrupted") and 0.4 < row[2] < 60 and row[3] < row[2], row


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_a_worker_in_training_is_its_death_without_a_traceback(tmp_path, cli_env):
    """``timeout`` and ``scancel`` signal every process of the command; a worker that gets SIGTERM in the
    trainer's fit dies of it quietly (no traceback of its own), here before the sweep does: each run's attempt fails
    as the worker's death, and the retry trains it."""
    import os
    from pathlib import Path

    extra = ["sweep.workers=2", "train.threads=1", "sweep.budgets=[3e11]"]  # two runs of about 30 s at once
    p = start(tmp_path / "results.db", "[2/2]", cli_env, extra=extra)
    time.sleep(8.0)  # both workers are in the trainer's fit
    workers = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat, cmd = (proc / "stat").read_text(), (proc / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == p.pid and b"spawn_main" in cmd:
            workers.append(int(proc.name))
    assert len(workers) == 2, workers
    for w in workers:
        os.kill(w, signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert out.count("failed: worker died (signal 15); queued again") == 2, out


def test_kill_9_then_rerun_resumes_and_counts_only_started_attempts(
    tmp_path, cli, cli_env, uninterrupted, val_losses, status_row
):
    """A sweep killed outright leaves its run in flight RUNNING and the rest of the queue WAITING; the rerun fails
    the running trial, trains the queued one where it waits and what the store lacks, and ``status`` counts one
    failed attempt: queued trials never started."""
    db = tmp_path / "results.db"
    p = start(db, "[1/2]", cli_env, stderr=subprocess.DEVNULL)  # trial 1 is RUNNING from here, trial 2 WAITING
    p.kill()
    p.wait(timeout=30)

    r = cli("sweeps", "isoflop", "--db", str(db), *GRID)
    assert r.returncode == 0, r.stderr
    assert "2 runs planned, 0 already in" in r.stdout
    assert val_losses(db) == uninterrupted
    row = status_row(cli("sweeps", "status", "--db", str(db)).stdout, "isoflop-cpu")
    assert [row[k] for k in ("planned", "ok", "diverged", "failed attempts")] == ["2", "2", "0", "1"]


def test_a_command_killed_outright_keeps_its_device_time_up_to_its_last_run(tmp_path, cli, cli_env):
    """SIGKILL leaves no handler to run: the usage row written as the first run ended stays, marked interrupted,
    and the rerun adds its own, so the sweep's utilisation pools both commands' wall-clock."""
    db = tmp_path / "results.db"
    p = start(db, "[2/2]", cli_env, stderr=subprocess.DEVNULL)  # the first run is stored by now
    p.kill()
    p.wait(timeout=30)
    con = results.connect(db, read_only=True)
    try:
        (killed,) = con.execute("SELECT runs, wall_s, parts->>'interrupted' FROM sweep_usage").fetchall()
    finally:
        con.close()
    assert killed[0] == 1 and killed[1] > 0 and killed[2] == "true"

    r = cli("sweeps", "isoflop", "--db", str(db), *GRID)
    assert r.returncode == 0, r.stderr
    con = results.connect(db, read_only=True)
    try:
        rows = con.execute("SELECT runs, parts->>'interrupted' FROM sweep_usage ORDER BY started_at").fetchall()
        ((_, wall, commands),) = results.sweep_utilisation(con).values()
    finally:
        con.close()
    assert rows == [(1, "true"), (1, "false")]
    assert commands == 2 and wall > killed[1]
