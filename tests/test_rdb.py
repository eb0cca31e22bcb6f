"""Sweeps across hosts on a real PostgreSQL server: ``isoflop --enqueue-only``, ``worker`` processes, ``collect``.

Every grid point is trained once and stored once whatever the number of workers and collects; a worker killed with
kill -9 mid-run loses nothing: after the heartbeat grace another worker trains the run again from its checkpoint,
to the losses of an uninterrupted run; the storage password appears nowhere.
"""

import os
import signal
import subprocess
import sys
import time

import duckdb
import optuna
import pytest
import sqlalchemy

from sweeps import queue

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ARGS = [
    "sweep.archs=[dense]",
    "sweep.budgets=[4e8]",
    "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}, {d_model: 24, n_layers: 1, n_heads: 2},"
    " {d_model: 32, n_layers: 1, n_heads: 2}]",
    "sweep.min_steps=4",
    "sweep.max_extra=0",  # the grid alone: sizes to bracket optima are the local sweep's (tests/test_bracket.py)
    "sweep.workers=1",
    "train.batch_size=4",
    "train.threads=1",
    "train.progress=false",
    "train.accelerator=cpu",
    "data.max_bytes=200000",
    "data.val_tokens=2048",
    "data.seq_len=32",
]
BEAT = ["sweep.heartbeat_interval=1", "sweep.grace_period=3"]


def _worker(tmp_path, url: str, env, name: str, *extra: str) -> subprocess.Popen:
    out = (tmp_path / f"{name}.log").open("w")
    cmd = [sys.executable, "-m", "sweeps", "worker", "--storage", url, "--workers", "1", *extra]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _study(url: str) -> optuna.Study:
    storage = queue.open_storage(url, create=False)
    (name,) = queue.sweeps_in(storage)
    return queue.load(storage, name)


def _trials(url: str) -> list[tuple[str, str]]:
    """(run_id, state) of every trial of the one sweep in the storage."""
    return sorted((queue.run_id(t), t.state.name) for t in queue.trials(_study(url)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cli_env, val_losses):
    """The sweep of ARGS on one host (the journal beside its database): what every distributed run must equal."""
    db = tmp_path_factory.mktemp("reference") / "ref.db"
    cmd = [sys.executable, "-m", "sweeps", "isoflop", "--db", str(db), *ARGS]
    r = subprocess.run(cmd, cwd=db.parent, capture_output=True, text=True, timeout=600, env=cli_env)
    assert r.returncode == 0, r.stderr[-2000:]
    losses = val_losses(db)
    assert len(losses) == 3 and all(v is not None for v in losses.values())
    return losses


def test_three_workers_train_every_run_once(tmp_path, postgres, cli, cli_env, reference, val_losses, capsys):
    url = postgres.new_db()
    queued = cli("sweeps", "isoflop", "--enqueue-only", f"sweep.storage={url}", *ARGS)
    assert queued.returncode == 0, queued.stderr[-2000:]
    assert "3 runs planned, 3 queued" in queued.stdout
    again = cli("sweeps", "isoflop", "--enqueue-only", f"sweep.storage={url}", *ARGS)  # queued once, however often
    assert again.returncode == 0 and "3 runs planned, 0 queued" in again.stdout, again.stderr[-2000:]

    from sweeps.__main__ import main

    workers = [_worker(tmp_path, url, cli_env, f"w{i}") for i in range(3)]
    seen_running = False
    # status reads the storage meanwhile; in this process, not a new one per poll: a run can be over before a fresh
    # interpreter has imported its way to the first read on a loaded machine
    while not seen_running and any(w.poll() is None for w in workers):
        assert main(["status", "--storage", url, "--db", str(tmp_path / "none.db")]) == 0
        out = capsys.readouterr().out
        seen_running = "running sweep" in out and f"{os.uname().nodename}:" in out
    for w in workers:
        w.wait(300)
    logs = [(tmp_path / f"w{i}.log").read_text() for i in range(3)]
    codes = [w.returncode for w in workers]
    assert codes == [0, 0, 0], "\n".join(
        f"--- w{i}: exit {c}\n{log[-3000:]}" for i, (c, log) in enumerate(zip(codes, logs, strict=True))
    )
    assert seen_running, "status never showed a running run with its host"
    st = cli("sweeps", "status", "--storage", url, "--db", str(tmp_path / "none.db"))  # the CLI, once all finished
    assert st.returncode == 0, st.stderr[-2000:]
    assert sum(log.count("val_loss=") for log in logs) == 3, logs  # each run trained by exactly one worker
    assert _trials(url) == sorted((rid, "COMPLETE") for rid in reference)

    db = tmp_path / "results.db"
    first = cli("sweeps", "collect", "--storage", url, "--db", str(db))
    second = cli("sweeps", "collect", "--storage", url, "--db", str(db))
    assert first.returncode == 0 and "3 runs added" in first.stdout, first.stderr[-2000:]
    assert second.returncode == 0 and "0 runs added" in second.stdout, second.stderr[-2000:]
    assert val_losses(db) == reference  # bit-identical to one host's sweep, one row per grid point
    report = cli("analysis", "report", "--db", str(db), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr[-2000:]

    secret = postgres.password
    outputs = [queued.stdout, queued.stderr, first.stdout, out, st.stdout, report.stdout, *logs]
    assert not [o for o in outputs if secret in o]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert db in files and not [p for p in files if secret.encode() in p.read_bytes()]


def test_status_and_collect_hand_their_connections_back(tmp_path, postgres, cli):
    """``status`` polled in one process (a notebook, a test's loop) held dozens of connections until the garbage
    collector ran, and a server refuses connections past ``max_connections``: every call gives its own back."""
    url = postgres.new_db()
    assert cli("sweeps", "isoflop", "--enqueue-only", f"sweep.storage={url}", *ARGS).returncode == 0
    from sweeps.__main__ import main

    for _ in range(3):
        assert main(["status", "--storage", url, "--db", str(tmp_path / "none.db")]) == 0
        assert postgres.connections(url) == 0
    assert main(["collect", "--storage", url, "--db", str(tmp_path / "r.db")]) == 0
    assert postgres.connections(url) == 0


def test_a_worker_s_time_limit_leaves_runs_queued_for_the_next(tmp_path, postgres, cli, reference, val_losses):
    """``worker --time-limit``: 1 s is over before a run could start (exit 75, every run still queued, none
    failed); a worker with an hour trains them all, to one host's losses."""
    url = postgres.new_db()
    assert cli("sweeps", "isoflop", "--enqueue-only", f"sweep.storage={url}", *ARGS).returncode == 0
    short = cli("sweeps", "worker", "--storage", url, "--time-limit", "1")
    assert short.returncode == 75, short.stdout[-2000:] + short.stderr[-2000:]
    assert "time limit: 3 runs still queued" in short.stdout
    assert _trials(url) == sorted((rid, "WAITING") for rid in reference)
    long = cli("sweeps", "worker", "--storage", url, "--time-limit", "1h")
    assert long.returncode == 0 and "no runs left" in long.stdout, long.stdout[-2000:] + long.stderr[-2000:]
    assert _trials(url) == sorted((rid, "COMPLETE") for rid in reference)
    db = tmp_path / "results.db"
    assert cli("sweeps", "collect", "--storage", url, "--db", str(db)).returncode == 0
    assert val_losses(db) == reference


def test_a_killed_worker_s_run_is_retried_from_its_checkpoint(tmp_path, postgres, cli, cli_env, reference, val_losses):
    """kill -9 of a worker mid-run: its training process dies with it; after the grace period the other worker
    fails the stale trial, Optuna's retry callback queues the run again, and it resumes from its checkpoint."""
    url = postgres.new_db()
    ckpt = tmp_path / "ckpt"
    extra = [f"sweep.storage={url}", *BEAT, "train.ckpt_every=5", f"train.ckpt_dir={ckpt}"]
    assert cli("sweeps", "isoflop", "--enqueue-only", *ARGS, *extra).returncode == 0
    first = _worker(tmp_path, url, cli_env, "first")
    deadline = time.monotonic() + 300
    while not list(ckpt.glob("*/*.ckpt")):  # a checkpoint of its first run is on disk: kill it mid-run
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.05)
    (killed,) = {p.parent.name for p in ckpt.glob("*/*.ckpt")}
    session = [p for p in _session(first.pid)]
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    time.sleep(1)
    assert not [p for p in session if _alive(p)], "the killed worker's training process outlived it"

    second = _worker(tmp_path, url, cli_env, "second")
    assert second.wait(300) == 0, (tmp_path / "second.log").read_text()
    log = (tmp_path / "second.log").read_text()
    assert log.count("val_loss=") == 3, log
    trials = _trials(url)
    assert trials == sorted([(rid, "COMPLETE") for rid in reference] + [(killed, "FAIL")])
    assert not (ckpt / killed).exists()  # stored through the storage: its checkpoints are dropped

    db = tmp_path / "results.db"
    assert cli("sweeps", "collect", "--storage", url, "--db", str(db)).returncode == 0
    assert val_losses(db) == reference  # the resumed run ends as if never killed


def _session(sid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = open(f"/proc/{name}/stat").read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[3]) == sid:
                out.append(int(name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.parametrize(
    "case",
    ["unreachable host", "wrong password", "unknown scheme", "sweep not in storage", "devices", "strategy", "ckpt"],
)
def test_bad_input_writes_nothing(case, tmp_path, postgres, cli):
    """One line naming the problem, a non-zero exit, no database made and nothing in the storage."""
    url = postgres.new_db()
    db = tmp_path / "results.db"
    port = str(postgres.port)
    wrong = {
        "unreachable host": url.replace(f":{port}/", ":1/"),
        "wrong password": url.replace(postgres.password, "not-the-password"),
        "unknown scheme": "foo" + url[url.index("://") :],
    }
    if case in wrong:
        runs = [
            cli("sweeps", "isoflop", "--db", str(db), f"sweep.storage={wrong[case]}", *ARGS),
            cli("sweeps", "worker", "--storage", wrong[case]),
            cli("sweeps", "collect", "--storage", wrong[case], "--db", str(db)),
        ]
    elif case == "sweep not in storage":
        assert cli("sweeps", "isoflop", "--enqueue-only", f"sweep.storage={url}", *ARGS).returncode == 0
        runs = [
            cli("sweeps", "worker", "--storage", url, "--sweep", "isoflop-00000000"),
            cli("sweeps", "collect", "--storage", url, "--db", str(db), "--sweep", "isoflop-00000000"),
        ]
    else:
        bad = {"devices": "train.devices=4096", "strategy": "train.strategy=horovod", "ckpt": "train.ckpt_every=0"}
        runs = [cli("sweeps", "isoflop", "--db", str(db), f"sweep.storage={url}", *ARGS, bad[case])]
    before = _trials(url) if case == "sweep not in storage" else None
    for r in runs:
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
        assert postgres.password not in r.stderr + r.stdout
    what = {
        "unreachable host": "Connection refused",
        "wrong password": "password authentication failed",
        "unknown scheme": "unknown storage URL scheme 'foo'",
        "sweep not in storage": "sweep isoflop-00000000 is not in storage",
        "devices": "train.devices",
        "strategy": "train.strategy",
        "ckpt": "train.ckpt_every",
    }[case]
    assert all(what in r.stderr for r in runs), [r.stderr for r in runs]
    assert not db.exists()
    if before is not None:
        assert _trials(url) == before
    else:  # not even Optuna's tables
        engine = sqlalchemy.create_engine(url)
        assert sqlalchemy.inspect(engine).get_table_names() == []
        engine.dispose()


# README's recipes on a real SLURM cluster (tests/slurm.py: two slurmd nodes on this host) and PostgreSQL.


def test_sbatch_job_array_of_workers(tmp_path, postgres, slurm, cli, reference, val_losses):
    url = postgres.new_db()
    assert cli("sweeps", "isoflop", "--enqueue-only", f"sweep.storage={url}", *ARGS).returncode == 0
    worker = f"{sys.executable} -m sweeps worker --storage {url}"
    job = slurm.sbatch("--array=0-1", "-J", "workers", "-o", "worker-%a.out", "--wrap", worker, cwd=tmp_path)
    states = slurm.wait_jobs(job, timeout=600)
    logs = [p.read_text() for p in sorted(tmp_path.glob("worker-*.out"))]
    assert set(states.values()) == {"COMPLETED"}, logs
    assert sum(log.count("val_loss=") for log in logs) == 3, logs
    db = tmp_path / "results.db"
    assert cli("sweeps", "collect", "--storage", url, "--db", str(db)).returncode == 0
    assert val_losses(db) == reference


# Two ranks differ from one process only in fp32 summation order (the gradient all-reduce adds two half-batch
# means, tests/test_ddp.py): a few units of roundoff (u = 6e-8) per step, carried into the weights by Adam's
# normalised update and adding up at most linearly over these runs' <= 65 steps: 65 x 3u = 1.2e-5. A real fault
# (ranks drawing the same windows, an unreduced loss) moves losses by 1e-2 or more.
REL = 5e-5


def test_one_run_across_two_nodes(tmp_path, postgres, slurm, cli, reference, val_losses):
    """``srun -N 2 python -m sweeps worker ... train.num_nodes=2``: rank 0 takes each run from the storage and both
    nodes train it together (DDP over gloo), to the one-process losses."""
    url = postgres.new_db()
    assert cli("sweeps", "isoflop", "--enqueue-only", f"sweep.storage={url}", *ARGS).returncode == 0
    cmd = ["srun", "-J", "multinode", "-N", "2", "--ntasks-per-node", "1"]
    out = slurm.run(
        [*cmd, sys.executable, "-m", "sweeps", "worker", "--storage", url, "train.num_nodes=2"], timeout=600
    )
    assert out.stdout.count("val_loss=") == 3, out.stdout + out.stderr  # printed by rank 0 only
    db = tmp_path / "results.db"
    assert cli("sweeps", "collect", "--storage", url, "--db", str(db)).returncode == 0
    got = val_losses(db)
    assert got.keys() == reference.keys()
    assert all(got[k] == pytest.approx(v, rel=REL) for k, v in reference.items()), (got, reference)
    with duckdb.connect(str(db), read_only=True) as con:  # every run was trained on both ranks
        devices = [r[0] for r in con.execute("SELECT device FROM runs").fetchall()]
    assert len(devices) == 3 and all(d.endswith("(2 ranks)") for d in devices), devices


def test_torchrun_worker_trains_each_run_on_every_rank(tmp_path, postgres, cli, cli_env, reference, val_losses):
    """README's single-node recipe ``torchrun --nproc-per-node N -m sweeps worker ... train.devices=N``: rank 0 takes
    each run from the storage and both ranks train it together, to the one-process losses."""
    url = postgres.new_db()
    assert cli("sweeps", "isoflop", "--enqueue-only", f"sweep.storage={url}", *ARGS).returncode == 0
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = [*run, "-m", "sweeps", "worker", "--storage", url, "train.devices=2"]
    out = subprocess.run(cmd, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("val_loss=") == 3, out.stdout + out.stderr  # printed by rank 0 only
    db = tmp_path / "results.db"
    assert cli("sweeps", "collect", "--storage", url, "--db", str(db)).returncode == 0
    got = val_losses(db)
    assert got.keys() == reference.keys()
    assert all(got[k] == pytest.approx(v, rel=REL) for k, v in reference.items()), (got, reference)
    with duckdb.connect(str(db), read_only=True) as con:
        devices = [r[0] for r in con.execute("SELECT device FROM runs").fetchall()]
    assert len(devices) == 3 and all(d.endswith("(2 ranks)") for d in devices), devices
