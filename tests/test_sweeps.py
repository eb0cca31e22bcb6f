"""End to end: python -m sweeps isoflop on a tiny grid, resume, dry run."""

import duckdb
import pytest

TINY = [
    "sweep.name=tiny",
    "sweep.budgets=[1e9,3e9]",
    "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}, {d_model: 24, n_layers: 1, n_heads: 2},"
    " {d_model: 32, n_layers: 2, n_heads: 2}]",
    "sweep.min_steps=4",
    "sweep.max_extra=0",  # the grid alone (tests/test_bracket.py adds sizes)
    "data.seq_len=32",
    "data.max_bytes=300000",
    "data.val_tokens=2048",
    "train.batch_size=4",
    "train.log_every=5",
    "train.progress=false",
]
N_RUNS = 14  # dense: 3 shapes x 2 budgets; mod, moda, mode, mode_integrated: the 2-layer shape x 2 budgets


def test_dry_run_prints_plan_and_writes_nothing(cli, tmp_path):
    r = cli("sweeps", "isoflop", "--dry-run", "--db", str(tmp_path / "r.db"), *TINY)
    assert r.returncode == 0, r.stderr
    assert "FLOPs/token" in r.stdout and "steps" in r.stdout
    assert len([ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("dense")]) == 6
    assert not (tmp_path / "r.db").exists()


@pytest.fixture(scope="module")
def swept(tmp_path_factory, cli_env):
    import subprocess
    import sys

    d = tmp_path_factory.mktemp("sweep")
    cmd = [sys.executable, "-m", "sweeps", "isoflop", "--db", str(d / "r.db"), *TINY]
    # as a user's CPU run: no Triton interpreter (conftest sets it for the kernel tests), routed ops on torch
    env = {k: v for k, v in cli_env.items() if k != "TRITON_INTERPRET"}
    # first under another label and heartbeat: display and scheduling keys are not the sweep's identity, so the
    # rerun below (TINY's name and the default heartbeat) resumes the same sweep and retrains nothing
    first = subprocess.run(
        [*cmd, "sweep.name=draft", "sweep.heartbeat_interval=5"],
        cwd=d,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    con = duckdb.connect(str(d / "r.db"), read_only=True)
    created = con.execute("SELECT created_at FROM sweeps").fetchall()
    con.close()
    # a process killed inside the journal's lock leaves Optuna's lock behind: a symlink to the journal
    (d / "r.db.optuna.log.lock").symlink_to(d / "r.db.optuna.log")
    second = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=900, env=env)
    return d, first, second, created


def test_sweep_writes_one_row_per_run_with_exact_flops(swept):
    d, first, _, _ = swept
    assert first.returncode == 0, first.stderr[-2000:]
    con = duckdb.connect(str(d / "r.db"), read_only=True)
    rows = con.execute(
        "SELECT arch, budget, params_nonembed, flops_per_token, tokens, steps, batch_size, seq_len, train_flops,"
        " flops_6nd, val_loss, status, corpus_fingerprint, device, versions FROM runs"
    ).fetchall()
    # the default preset's five families: dense on all 3 shapes, the routed ones on the 2-layer shape only
    arch_runs = dict(con.execute("SELECT arch, count(*) FROM runs GROUP BY arch").fetchall())
    assert arch_runs == {"dense": 6, "mod": 2, "moda": 2, "mode": 2, "mode_integrated": 2}
    assert len(rows) == N_RUNS
    for _arch, budget, n, fpt, tokens, steps, bs, T, train_flops, f6, val, status, fp, device, versions in rows:
        assert status == "ok" and 0 < val < 6
        assert tokens == steps * bs * T
        assert train_flops == pytest.approx(3 * fpt * tokens)
        assert abs(train_flops - budget) <= 3 * fpt * bs * T / 2 + 1  # within half a step of the budget
        assert f6 == pytest.approx(6 * n * tokens)
        assert len(fp) >= 8 and device.startswith("cpu") and "torch" in versions
    routed = con.execute(
        "SELECT arch, val_loss_causal, routing_stats FROM runs WHERE arch IN ('mod', 'mode', 'mode_integrated')"
    ).fetchall()
    for arch, causal, stats in routed:
        # integrated MoDE has no MoD router: no causal-routing loss (it would repeat val_loss)
        assert stats is not None and (causal is None) == (arch == "mode_integrated"), arch
    from mixdepth.config import DataConfig
    from mixdepth.data import load_corpus

    split = load_corpus(DataConfig(seq_len=32, max_bytes=300000, val_tokens=2048)).train.numel()
    assert con.execute("SELECT DISTINCT corpus_tokens FROM runs").fetchall() == [(split,)]  # its training split
    assert con.execute("SELECT count(*) FROM curves").fetchone()[0] > N_RUNS
    assert con.execute("SELECT count(DISTINCT budget) FROM frontier").fetchone()[0] == 2
    assert con.execute("SELECT count(*) FROM fits").fetchone()[0] > 0


def test_sweep_prints_report_paths_that_exist(swept):
    from pathlib import Path

    d, first, _, _ = swept
    paths = [ln.split(": ", 1)[1] for ln in first.stdout.splitlines() if ln.split(":")[0] in ("report", "isoflop_plot")]
    assert paths and all(Path(p).exists() for p in paths)
    con = duckdb.connect(str(d / "r.db"), read_only=True)
    split, least, most = con.execute("SELECT any_value(corpus_tokens), min(tokens), max(tokens) FROM runs").fetchone()
    passes = f"{least / split:.3g}-{most / split:.3g}"
    line = f"- passes over the corpus's training split ({split:,} tokens): {passes} per run;"
    report = next(ln.split(": ", 1)[1] for ln in first.stdout.splitlines() if ln.startswith("report: "))
    assert line in Path(report).read_text()


def test_rerun_skips_finished_runs(swept):
    d, _, second, created = swept
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"{N_RUNS} already in" in second.stdout and "0 to run" in second.stdout
    con = duckdb.connect(str(d / "r.db"), read_only=True)
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == N_RUNS
    # the rerun keeps the sweep's start, and took over the stale journal lock at once (Optuna waits 30 s, warning)
    assert con.execute("SELECT created_at FROM sweeps").fetchall() == created
    assert con.execute("SELECT name FROM sweeps").fetchall() == [("tiny",)]  # the label is the latest run's
    assert "lock file" not in second.stderr and not (d / "r.db.optuna.log.lock").is_symlink()


@pytest.mark.parametrize(
    "setting",
    [
        "train.progress=false",
        "sweep.workers=1",
        "sweep.retries=0",
        "sweep.name=another",
        "sweep.grace_period=99",
        "sweep.max_extra=5",
    ],
)
def test_display_fit_and_scheduling_settings_do_not_change_the_sweep(setting):
    """Only result-defining keys define a sweep: changing its label, heartbeat, workers, retries, progress bars or
    how many sizes it may add to bracket optima resumes the same sweep id and run ids (nothing retrained); a training
    key makes another sweep."""
    from pathlib import Path

    from mixdepth.config import load_config
    from sweeps.plan import plan, sweep_id

    conf = Path(__file__).resolve().parents[1] / "conf"
    a, b = load_config(conf, "isoflop"), load_config(conf, "isoflop", [setting])
    assert sweep_id(a, "isoflop") == sweep_id(b, "isoflop")
    ids = [t.run_id for t in plan(a, sweep_id(a, "isoflop"))[0]]
    assert ids == [t.run_id for t in plan(b, sweep_id(b, "isoflop"))[0]] and len(set(ids)) == len(ids)
    c = load_config(conf, "isoflop", ["train.lr=1e-3"])
    assert sweep_id(c, "isoflop") != sweep_id(a, "isoflop")


def test_status_lists_the_sweep(swept, cli, status_row):
    d, _, _, _ = swept
    r = cli("sweeps", "status", "--db", str(d / "r.db"))
    assert r.returncode == 0, r.stderr
    row = status_row(r.stdout, "tiny")
    cols = ("planned", "ok", "diverged", "finished", "queued", "running", "failed attempts")  # finished: the journal's
    assert [row[k] for k in cols] == [str(N_RUNS), str(N_RUNS), "0", str(N_RUNS), "0", "0", "0"]
    missing = cli("sweeps", "status", "--db", str(d / "nope.db"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr


SMALL = [  # 4 runs, one thread per process (a one-budget sweep cannot draw its frontier plot)
    *(o for o in TINY if not o.startswith(("sweep.budgets", "sweep.ladder"))),
    "sweep.archs=[dense]",
    "sweep.budgets=[1e9,2e9]",
    "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}, {d_model: 24, n_layers: 1, n_heads: 2}]",
    "train.threads=1",
]


@pytest.fixture(scope="module")
def pooled(tmp_path_factory, cli_env):
    """The SMALL sweep with sweep.workers=2 and with the in-process path, run side by side (separate DBs)."""
    import subprocess
    import sys

    d = tmp_path_factory.mktemp("pool")
    procs = {
        w: subprocess.Popen(
            [sys.executable, "-m", "sweeps", "isoflop", "--db", str(d / f"w{w}.db"), *SMALL, f"sweep.workers={w}"],
            cwd=d,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env,
        )
        for w in (1, 2)
    }
    outs = {w: p.communicate(timeout=600) for w, p in procs.items()}
    for w, p in procs.items():
        assert p.returncode == 0, outs[w][1][-2000:]
    return d, outs


def test_workers_train_every_run_once_as_in_process(pooled, cli, status_row):
    d, outs = pooled
    cols = "arch, budget, d_model, n_layers, steps, tokens, train_flops, flops_per_token, status, val_loss"
    rows = {}
    for w in (1, 2):
        con = duckdb.connect(str(d / f"w{w}.db"), read_only=True)
        assert con.execute("SELECT count(*) = count(DISTINCT run_id) FROM runs").fetchone()[0]
        rows[w] = con.execute(f"SELECT {cols} FROM runs ORDER BY arch, budget, d_model, n_layers").fetchall()
        con.close()
    assert len(rows[2]) == len(rows[1]) == 4 and "4 runs planned" in outs[2][0]
    for a, b in zip(rows[1], rows[2], strict=True):
        assert a[:-1] == b[:-1] and a[-1] == pytest.approx(b[-1], abs=1e-5)
    assert all(f"[{i}/4] val_loss=" in outs[2][0] for i in (1, 2, 3, 4))
    row = status_row(cli("sweeps", "status", "--db", str(d / "w2.db")).stdout, "tiny")
    assert [row[k] for k in ("planned", "ok", "diverged", "failed attempts")] == ["4", "4", "0", "0"]


def test_workers_zero_is_one_line_error(cli, tmp_path):
    r = cli("sweeps", "isoflop", "--db", str(tmp_path / "r.db"), *SMALL, "sweep.workers=0")
    assert r.returncode == 2 and r.stderr.strip() == "error: sweep.workers must be at least 1, got 0"
    assert not (tmp_path / "r.db").exists()


def test_workers_on_gpus_need_one_gpu_each(monkeypatch):
    from pathlib import Path

    import torch

    from mixdepth.config import ConfigError, load_config
    from sweeps.worker import slot_gpus

    conf = Path(__file__).resolve().parents[1] / "conf"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    _gpus = lambda lab: slot_gpus(lab.train, lab.sweep.workers)  # noqa: E731
    assert _gpus(load_config(conf, "isoflop", ["sweep.workers=2"])) == ["3", "5"]
    assert _gpus(load_config(conf, "isoflop", ["sweep.workers=1"])) == []
    assert _gpus(load_config(conf, "isoflop", ["sweep.workers=2", "train.accelerator=cpu"])) == []
    with pytest.raises(ConfigError, match="sweep.workers=3 needs one GPU each, but 2 are visible"):
        _gpus(load_config(conf, "isoflop", ["sweep.workers=3"]))
    # a run on two GPUs: each slot gets its pair
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert _gpus(load_config(conf, "isoflop", ["sweep.workers=2", "train.devices=2"])) == ["0,1", "2,3"]
    with pytest.raises(ConfigError, match="sweep.workers=3 needs 2 GPUs each, but 4 are visible"):
        _gpus(load_config(conf, "isoflop", ["sweep.workers=3", "train.devices=2"]))


def test_seeds_repeat_the_grid_at_the_seed_budgets():
    """sweep.seeds repeats each grid point of sweep.seed_budgets (all budgets when empty) with train.seed + k: a run
    id of its own, everything else the same."""
    from pathlib import Path

    from mixdepth.config import load_config
    from sweeps.plan import plan, sweep_id

    conf = Path(__file__).resolve().parents[1] / "conf"
    budgets = "sweep.budgets=[1e11,2e11,4e11]"
    lab = load_config(conf, "isoflop", [budgets, "sweep.seeds=3", "sweep.seed_budgets=[2e11]", "train.seed=5"])
    trials = plan(lab, sweep_id(lab, "isoflop"))[0]
    assert len({t.run_id for t in trials}) == len(trials)
    at = {b: [t for t in trials if t.budget == b] for b in lab.sweep.budgets}
    one = len(at[1e11])
    assert {t.seed for t in at[1e11] + at[4e11]} == {5} and len(at[2e11]) == 3 * one
    same = lambda t: (t.arch, t.shape, t.steps, t.tokens)  # noqa: E731
    for seed in (6, 7):
        assert [same(t) for t in at[2e11] if t.seed == seed] == [same(t) for t in at[2e11] if t.seed == 5]
    every = load_config(conf, "isoflop", [budgets, "sweep.seeds=2"])
    assert len(plan(every, sweep_id(every, "isoflop"))[0]) == 2 * (len(trials) - 2 * one)


def test_seeds_train_other_initialisations_and_data_orders(cli, tmp_path):
    """Seed k trains with train.seed + k, stored in runs.seed and isoflop_points.seed, to another loss."""
    args = [*(o for o in SMALL if not o.startswith(("sweep.budgets", "sweep.ladder"))), "sweep.budgets=[1e9]"]
    r = cli(
        "sweeps",
        "isoflop",
        "--db",
        str(tmp_path / "r.db"),
        *args,
        "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}]",
        "sweep.seeds=2",
        "train.seed=3",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    con = duckdb.connect(str(tmp_path / "r.db"), read_only=True)
    rows = con.execute("SELECT run_id, seed, val_loss, config->'$.train.seed' FROM runs ORDER BY seed").fetchall()
    points = con.execute("SELECT seed FROM isoflop_points ORDER BY seed").fetchall()
    con.close()
    assert [(s, int(c)) for _, s, _, c in rows] == [(3, 3), (4, 4)] and points == [(3,), (4,)]
    assert rows[0][0] != rows[1][0] and rows[0][2] != rows[1][2]


def test_the_stored_command_line_hides_storage_passwords():
    from sweeps.provenance import command

    line = command(
        ["isoflop", "sweep.storage=postgresql://me:s3cret@db/x", "--storage", "postgresql://me:s3cret@db/x", "a b"]
    )
    assert "s3cret" not in line and line == (  # quoted for a shell
        "python -m sweeps isoflop 'sweep.storage=postgresql://me:***@db/x' --storage 'postgresql://me:***@db/x' 'a b'"
    )


def test_the_stored_commit_says_when_the_tree_differs_from_it(tmp_path, monkeypatch):
    """A checkout whose tracked files were changed after its commit ran other code: ``-dirty`` says so."""
    import subprocess

    from sweeps import provenance

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = git("rev-parse", "HEAD").strip()
    monkeypatch.setattr(provenance, "SOURCE", tmp_path)
    (tmp_path / "notes.txt").write_text("untracked\n")  # an untracked file changes no code that ran
    assert provenance.commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert provenance.commit() == head + "-dirty"
    monkeypatch.setattr(provenance, "SOURCE", tmp_path / "nowhere")
    assert provenance.commit() is None


ONE = [  # one run of a few seconds (a one-budget sweep is fitted without its frontier plot)
    *(o for o in SMALL if not o.startswith(("sweep.budgets", "sweep.ladder"))),
    "sweep.budgets=[1e9]",
    "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}]",
]


def test_csv_logger_writes_the_curve_and_the_validation_of_each_run(cli, tmp_path):
    """train.logger=csv: Lightning's CSVLogger of each run under <db>_logs/<sweep_id>/<run_id>/version_0, holding
    the points of the run's curves rows (train loss and lr at the same steps) and its final val_loss."""
    import csv

    r = cli("sweeps", "isoflop", "--db", str(tmp_path / "r.db"), *ONE, "train.logger=csv")
    assert r.returncode == 0, r.stderr[-2000:]
    con = duckdb.connect(str(tmp_path / "r.db"), read_only=True)
    ((sid, rid, val, steps),) = con.execute("SELECT sweep_id, run_id, val_loss, steps FROM runs").fetchall()
    curve = con.execute("SELECT step, train_loss, lr FROM curves WHERE run_id = ? ORDER BY step", [rid]).fetchall()
    con.close()
    rows = list(csv.DictReader(open(tmp_path / "r_logs" / sid / rid / "version_0" / "metrics.csv")))
    logged = [(int(x["step"]), float(x["train_loss"]), float(x["lr"])) for x in rows if x["train_loss"]]
    assert len(curve) > 2 and logged == [pytest.approx(p) for p in curve]
    (last,) = [x for x in rows if x["val_loss"]]
    assert int(last["step"]) == steps and float(last["val_loss"]) == pytest.approx(val)


def _on_a_terminal(cmd: list[str], cwd, env, timeout: float = 600) -> str:
    """What ``cmd`` writes to stdout when that is a terminal (a pseudo-terminal of 120 columns)."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import termios
    import time

    ours, theirs = pty.openpty()
    fcntl.ioctl(theirs, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=theirs, stderr=subprocess.PIPE)
    os.close(theirs)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([ours], [], [], 1.0)[0]:
                try:
                    chunk = os.read(ours, 65536)
                except OSError:  # EIO: the process closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
    finally:
        os.close(ours)
        if p.poll() is None:
            p.kill()
        err = p.communicate()[1].decode()
    assert p.returncode == 0, err[-2000:]
    return out.decode()


@pytest.mark.parametrize("workers", [1, 2])
def test_one_progress_bar_over_the_sweep_on_a_terminal(workers, tmp_path, cli_env):
    """On a terminal the sweep draws one bar weighted by training FLOPs, with elapsed time and ETA, the runs' lines
    above it; Lightning's per-run bar (train.progress=true) gives way to it, in this process or the workers'."""
    import re
    import sys

    args = [*(o for o in SMALL if o != "train.progress=false"), "sweep.budgets=[1e9]", "train.progress=true"]
    cmd = [sys.executable, "-m", "sweeps", "isoflop", "--db", str(tmp_path / "r.db"), *args, f"sweep.workers={workers}"]
    out = _on_a_terminal(cmd, tmp_path, cli_env)
    con = duckdb.connect(str(tmp_path / "r.db"), read_only=True)
    total = con.execute("SELECT sum(train_flops) FROM runs").fetchone()[0]
    con.close()
    bars = re.findall(r"sweep +(\d+)%\|[^|]*\| ([\d.]+)(\w?)/([\d.]+)(\w?) training FLOPs \[(\d\d:\d\d)<([^,\]]+)", out)
    assert bars, out[-3000:]
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    assert float(bars[-1][3]) * scale[bars[-1][4]] == pytest.approx(total, rel=0.01)
    assert bars[-1][0] == "100" and bars[-1][6] == "00:00" and "2 of 2 runs" in out
    assert {b[0] for b in bars} >= {"0", "100"} and any(re.fullmatch(r"\d\d:\d\d", b[6]) for b in bars)  # an ETA
    assert all(re.search(rf"\[{i}/2\] val_loss=\d\.\d+ \(\d+\.\ds, ", out) for i in (1, 2))
    assert "Epoch 0" not in out  # Lightning's bar is off under the sweep's


def test_no_progress_bar_when_stdout_is_not_a_terminal(pooled):
    _, outs = pooled
    for out, _ in outs.values():
        assert "training FLOPs" not in out and "\r" not in out and "[4/4] val_loss=" in out


def test_the_bar_grows_with_the_runs_added_after_the_plan(capsys):
    """Each drain sets the total to what this process trained plus what is left: sizes added to bracket an optimum
    (a second drain) grow it, a queued run another host took shrinks it."""
    from sweeps.progress import Progress

    def shown() -> str:  # the bar as last drawn
        return capsys.readouterr().out.split("\r")[-1]

    with Progress(shown=True) as bar:
        bar.left(3e9, 2)  # the plan: two runs
        bar.finished(1e9)
        bar.left(2e9, 1)
        bar.finished(2e9)
        bar.left(0, 0)
        assert "100%|" in (s := shown()) and "3.00G/3.00G training FLOPs" in s and "2 of 2 runs" in s
        bar.left(4e9, 2)  # two sizes added to bracket an optimum
        assert " 43%|" in (s := shown()) and "3.00G/7.00G training FLOPs" in s and "2 of 4 runs" in s
        bar.finished(1e9)
        bar.left(0, 0)  # the other one was trained by another host
        assert "100%|" in (s := shown()) and "4.00G/4.00G training FLOPs" in s and "3 of 3 runs" in s
