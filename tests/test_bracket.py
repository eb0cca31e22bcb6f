"""Bracketed optima: a sweep adds sizes on the side where an (arch, budget)'s isoFLOP vertex falls outside its sampled
sizes (Optuna proposes them), stops once the vertex is inside or at sweep.max_extra, and resumes after a kill to the
uninterrupted sweep's runs and losses, training no size twice."""

import math
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import optuna
import pytest

from mixdepth.config import Shape, load_config
from mixdepth.results import journal_path
from sweeps import bracket, queue
from sweeps.plan import plan, sweep_id

CONF = Path(__file__).resolve().parents[1] / "conf"

TINY = [  # one arch, one budget, three one-layer widths; one thread, no progress bars
    "sweep.name=bracket",
    "sweep.archs=[dense]",
    "sweep.min_steps=4",
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


def ladder(*widths: int, layers: int = 1) -> str:
    return "sweep.ladder=[" + ", ".join(f"{{d_model: {d}, n_layers: {layers}, n_heads: 2}}" for d in widths) + "]"


def sized(n: int, loss: float | None, d: int = 16) -> bracket.Sized:
    return bracket.Sized(f"r{n}", Shape(d, 1, 2, 2), n, 10**9 // (6 * n), loss)


def curve(ns: list[int], n_opt: float) -> list[bracket.Sized]:
    """Runs on an exact isoFLOP parabola in ln N with its vertex at ``n_opt``."""
    return [sized(n, 2.0 + 0.1 * math.log(n / n_opt) ** 2) for n in ns]


NS = [8_000, 16_000, 32_000]


@pytest.mark.parametrize(
    "runs,where",
    [
        (curve(NS, 2_000), bracket.SMALLER),  # vertex below the smallest size
        (curve(NS, 200_000), bracket.LARGER),  # above the largest
        (curve(NS, 16_000), bracket.INSIDE),
        ([sized(n, 3.0 - 0.1 * math.log(n / 8_000) ** 2) for n in NS], bracket.LARGER),  # no minimum: toward larger
        ([sized(n, 3.0 - 0.1 * math.log(n / 32_000) ** 2) for n in NS], bracket.SMALLER),  # ... toward smaller
        ([sized(8_000, 2.5), sized(16_000, 2.6)], bracket.SMALLER),  # two sizes: the lower end
        ([sized(8_000, 2.6), sized(16_000, 2.5), sized(32_000, None)], bracket.LARGER),  # a diverged run is no point
        ([sized(8_000, 2.6), sized(8_000, 2.5)], None),  # one size (two seeds): no side
        ([sized(8_000, None), sized(16_000, 2.5)], None),
    ],
)
def test_side_is_where_the_vertex_or_the_falling_loss_lies(runs, where):
    assert bracket.side(runs, 1e9)[0] == where


def test_candidates_extend_the_edge_shape_on_its_side():
    lab = load_config(CONF, "isoflop", TINY[1:] + ["sweep.budgets=[1e9]", ladder(16, 24)])
    sid = sweep_id(lab, "isoflop")
    smaller = bracket.candidates(lab, sid, "dense", 1e9, Shape(16, 1, 2, 2), bracket.SMALLER)
    assert [t.shape for t in smaller] == [Shape(12, 1, 2, 2), Shape(8, 1, 2, 2)]  # d_model steps of 2 heads * 2
    larger = bracket.candidates(lab, sid, "dense", 1e9, Shape(24, 1, 2, 2), bracket.LARGER)
    assert [t.shape.d_model for t in larger] == list(range(28, 49, 4))
    assert all(t.steps >= lab.sweep.min_steps and t.seed == lab.train.seed for t in smaller + larger)
    # sweep.min_steps bounds the larger side: at 4 steps more only the widths that still train that long are left
    tight = load_config(CONF, "isoflop", TINY[1:] + ["sweep.budgets=[1e9]", ladder(16, 24), "sweep.min_steps=60"])
    kept = bracket.candidates(tight, sweep_id(tight, "isoflop"), "dense", 1e9, Shape(24, 1, 2, 2), bracket.LARGER)
    assert 0 < len(kept) < len(larger) and all(t.steps >= 60 for t in kept)
    # a routed family: one layer is the dense model, never a candidate; two layers are
    routed = load_config(CONF, "isoflop", TINY[1:] + ["sweep.archs=[mod]", "sweep.budgets=[1e9]", ladder(16, layers=2)])
    rid = sweep_id(routed, "isoflop")
    assert bracket.candidates(routed, rid, "mod", 1e9, Shape(16, 1, 2, 2), bracket.SMALLER) == []
    two = bracket.candidates(routed, rid, "mod", 1e9, Shape(16, 2, 2, 2), bracket.LARGER)
    assert [t.shape.d_model for t in two] == [20, 24, 28, 32] and {t.shape.n_layers for t in two} == {2}


def test_optuna_proposes_a_new_size_beyond_the_edge_deterministically():
    lab = load_config(CONF, "isoflop", TINY[1:] + ["sweep.budgets=[1e9]", ladder(16, 24, 32)])
    sid = sweep_id(lab, "isoflop")
    grid, _ = plan(lab, sid)
    runs = [
        bracket.Sized(t.run_id, t.shape, t.params["nonembed"], t.tokens, loss)
        for t, loss in zip(grid, [2.0, 2.1, 2.3], strict=True)
    ]
    picks = {bracket.propose(lab, sid, "dense", 1e9, runs, bracket.SMALLER, set(), k)[0].run_id for k in (0, 0)}
    assert len(picks) == 1  # seeded: the same history and count propose the same size
    trial, asked = bracket.propose(lab, sid, "dense", 1e9, runs, bracket.SMALLER, set(), 0)
    cands = bracket.candidates(lab, sid, "dense", 1e9, Shape(16, 1, 2, 2), bracket.SMALLER)
    assert trial.run_id in {t.run_id for t in cands} and trial.params["nonembed"] < runs[0].n
    n = sorted(t.params["nonembed"] for t in cands)
    assert n[0] <= asked <= n[-1]  # Optuna's proposal lies on the outside side; the nearest candidate trains
    assert trial.params["nonembed"] == min(n, key=lambda x: abs(math.log(x / asked)))
    # a taken size is not proposed again; none left: None
    assert bracket.propose(lab, sid, "dense", 1e9, runs, bracket.SMALLER, {trial.run_id}, 0)[0].run_id != trial.run_id
    taken = {t.run_id for t in cands}
    assert bracket.propose(lab, sid, "dense", 1e9, runs, bracket.SMALLER, taken, 0) is None


def test_proposals_reach_no_further_than_the_first_size_past_the_vertex():
    lab = load_config(CONF, "isoflop", TINY[1:] + ["sweep.budgets=[1e9]", ladder(16, 24, 32)])
    sid = sweep_id(lab, "isoflop")
    grid, _ = plan(lab, sid)
    cands = bracket.candidates(lab, sid, "dense", 1e9, Shape(32, 1, 2, 2), bracket.LARGER)
    n = [t.params["nonembed"] for t in cands]
    n_opt = math.sqrt(n[0] * n[1])  # the vertex lies between the first two larger candidates
    runs = curve([t.params["nonembed"] for t in grid], n_opt)
    runs = [bracket.Sized(t.run_id, t.shape, r.n, t.tokens, r.loss) for t, r in zip(grid, runs, strict=True)]
    where, _, vertex = bracket.side(runs, 1e9)
    assert where == bracket.LARGER and vertex == pytest.approx(n_opt, rel=1e-6)
    capped = {bracket.propose(lab, sid, "dense", 1e9, runs, where, set(), k, vertex)[0].run_id for k in range(8)}
    assert capped <= {cands[0].run_id, cands[1].run_id}
    free = {bracket.propose(lab, sid, "dense", 1e9, runs, where, set(), k)[0].run_id for k in range(8)}
    assert free - {cands[0].run_id, cands[1].run_id}  # without the vertex TPE reaches wider sizes
    # taken sizes move the reach on to the first untaken one past the vertex
    taken = {cands[0].run_id, cands[1].run_id}
    assert bracket.propose(lab, sid, "dense", 1e9, runs, where, taken, 0, vertex)[0].run_id == cands[2].run_id


# --- whole sweeps: real training, a kill -9 and a SIGTERM on the way ---

TOO_LARGE = [*TINY, "sweep.budgets=[5e8]", ladder(16, 24, 32), "sweep.max_extra=2"]  # the loss falls toward d=16
TOO_SMALL = [  # at 1e10 FLOPs and 16 sequences a step the larger of two tiny widths trains better
    *(o for o in TINY if not o.startswith("train.batch_size")),
    "train.batch_size=16",
    "sweep.budgets=[1e10]",
    ladder(8, 12),
    "sweep.max_extra=1",
]


def _start(db: Path, args: list[str], env) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sweeps", "isoflop", "--db", str(db), *args]
    return subprocess.Popen(cmd, cwd=db.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _until(p: subprocess.Popen, needle: str, sig: int) -> str:
    """Read the sweep's output until a line holds ``needle``, then send it ``sig``; its whole output."""
    out = []
    for line in p.stdout:
        out.append(line)
        if needle in line:
            p.send_signal(sig)
            break
    rest, err = p.communicate(timeout=300)
    return "".join(out) + rest + err


def _study(db: Path) -> optuna.Study:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal_path(db))))
    return optuna.load_study(study_name=None, storage=storage)


def _rows(db: Path) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        sql = "SELECT run_id, params_nonembed, seed, val_loss FROM runs ORDER BY params_nonembed"
        return con.execute(sql).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, cli_env):
    """TOO_LARGE uninterrupted, TOO_SMALL, and TOO_LARGE stopped twice: kill -9 while its first grid run trains (the
    others queued), then SIGTERM while its first added size trains, then run to the end; the first two and the
    first stop side by side."""
    d = tmp_path_factory.mktemp("bracket")
    env = {k: v for k, v in cli_env.items() if k != "TRITON_INTERPRET"}
    ref, small, cut = d / "ref" / "r.db", d / "small" / "r.db", d / "cut" / "r.db"
    for db in (ref, small, cut):
        db.parent.mkdir()
    procs = {"ref": _start(ref, TOO_LARGE, env), "small": _start(small, TOO_SMALL, env)}
    killed = _until(_start(cut, TOO_LARGE, env), "[1/3] dense", signal.SIGKILL)
    after_kill = [(t.number, t.state.name, t.datetime_start is not None) for t in _study(cut).trials]
    # the restart also moves its checkpoint root (a key outside the sweep's identity): queued runs take it over
    moved = [*TOO_LARGE, f"train.ckpt_dir={d / 'moved'}"]
    stopped = _until(_start(cut, moved, env), "[4/4] dense", signal.SIGTERM)  # the first added size's start
    after_stop = [(t.number, t.state.name, dict(t.user_attrs)) for t in _study(cut).trials]
    last = subprocess.run(
        [sys.executable, "-m", "sweeps", "isoflop", "--db", str(cut), *TOO_LARGE],
        cwd=d,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    outs = {k: p.communicate(timeout=600) for k, p in procs.items()}
    for k, p in procs.items():
        assert p.returncode == 0, outs[k][1][-3000:]
    return {
        "ref": (ref, outs["ref"][0]),
        "small": (small, outs["small"][0]),
        "cut": (cut, killed, after_kill, stopped, after_stop, last),
    }


def test_sizes_all_too_large_get_smaller_ones_up_to_max_extra(sweeps):
    db, out = sweeps["ref"]
    rows = _rows(db)
    grid_n = [n for _, n, _, _ in rows[-3:]]
    extras = rows[:-3]
    assert len(rows) == 5 and len(extras) == 2, rows  # sweep.max_extra=2 sizes added below the ladder
    assert all(n < min(grid_n) for _, n, _, _ in extras)
    assert out.count("bracket dense C=5.00e+08: ") == 2 and "size 2 of at most 2" in out
    assert "not bracketed: dense C=5.00e+08: " in out and "2 sizes added (sweep.max_extra=2)" in out, out


def test_sizes_all_too_small_get_a_larger_one(sweeps):
    db, out = sweeps["small"]
    rows = _rows(db)
    assert len(rows) == 3 and rows[-1][1] > 4_836, rows  # one size above d_model=12's N (sweep.max_extra=1)
    assert "bracket dense C=1.00e+10: 2 sizes, too few for a parabola; Optuna proposes" in out, out


def test_a_killed_and_a_stopped_sweep_resume_to_the_uninterrupted_one(sweeps, val_losses):
    ref, _ = sweeps["ref"]
    cut, killed, after_kill, stopped, after_stop, last = sweeps["cut"]
    assert "[1/3] dense" in killed and "val_loss=" not in killed
    # killed while run 1 trained: run 1 RUNNING, runs 2 and 3 queued (never started)
    assert [(s, started) for _, s, started in after_kill] == [("RUNNING", True), ("WAITING", False), ("WAITING", False)]
    assert "interrupted: finished runs are in the database" in stopped, stopped[-3000:]
    # the restart failed the killed run's trial (an attempt), trained the queued ones in place (no new trials for
    # them), then the first added size, stopped by SIGTERM: ended as interrupted and queued again
    states = [(n, s) for n, s, _ in after_stop]
    assert states[:3] == [(0, "FAIL"), (1, "COMPLETE"), (2, "COMPLETE")], states
    assert [s for _, s in states[3:]] == ["COMPLETE", "FAIL", "WAITING"], states
    (extra_fail,) = [a for n, s, a in after_stop if s == "FAIL" and n > 0]
    assert extra_fail["interrupted"] and extra_fail["extra"] == 1
    dirs = [a["run"]["run"]["train"]["ckpt_dir"] for _, _, a in after_stop]
    assert dirs[0] == "" and all(x.endswith("/moved") for x in dirs[1:]), dirs  # the queued ones were rewritten
    assert last.returncode == 0, last.stderr[-3000:]
    assert "3 runs planned, 1 added to bracket optima, 3 already in" in last.stdout and "1 to run" in last.stdout
    assert last.stdout.count("bracket dense C=5.00e+08: ") == 1 and "size 2 of at most 2" in last.stdout
    assert val_losses(cut) == val_losses(ref)  # the same runs, the same losses, each stored once
    study = _study(cut)
    done = [queue.run_id(t) for t in study.trials if t.state.name == "COMPLETE"]
    assert sorted(done) == sorted(val_losses(ref)), done  # no run trained to the end twice
    # failed attempts: only the killed run's (the queued ones never started, the stopped one was interrupted)
    fails = [t for t in study.trials if t.state.name == "FAIL" and not t.user_attrs.get("interrupted")]
    assert [t.number for t in fails] == [0] and fails[0].datetime_start is not None


def test_sizes_are_added_while_the_rest_of_the_grid_still_trains(tmp_path, cli_env):
    """An (arch, budget) whose runs have all finished gets its bracketing size at once, not after the whole grid: the
    larger budget's runs go first (longest first), and its added size starts before the smaller budget's first run,
    so the added runs fill the sweep's slots instead of forming a tail."""
    env = {k: v for k, v in cli_env.items() if k != "TRITON_INTERPRET"}
    db = tmp_path / "r.db"
    args = [*(o for o in TOO_LARGE if not o.startswith("sweep.budgets")), "sweep.budgets=[5e8,2e8]"]
    r = subprocess.run([sys.executable, "-m", "sweeps", "isoflop", "--db", str(db), *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    keys = ("bracket dense C=5.00e+08", "dense C=2.00e+08 ")
    at = {k: next(i for i, ln in enumerate(lines) if k in ln) for k in keys}
    started = [ln for ln in lines if ln.startswith("[") and " dense C=" in ln]
    assert [ln.split(" d_model")[0].split("] ")[1] for ln in started[:4]] == ["dense C=5.00e+08"] * 4, started
    assert at["bracket dense C=5.00e+08"] < at["dense C=2.00e+08 "], r.stdout
    added = lines[at["bracket dense C=5.00e+08"]].split("adding ")[1].split(" layers")[0]
    assert f"{added} " in started[3], (added, started)  # the added size, fourth, before any run of 2e8


def test_trials_show_what_they_are_and_the_sweep_its_provenance(sweeps):
    cut = sweeps["cut"][0]
    losses = {rid: (n, seed, loss) for rid, n, seed, loss in _rows(cut)}
    con = duckdb.connect(str(cut), read_only=True)
    dm = dict(con.execute("SELECT run_id, [d_model, n_layers, tokens] FROM runs").fetchall())
    prov = con.execute('SELECT planned, version, "commit", command FROM sweeps').fetchall()
    con.close()
    for t in _study(cut).trials:
        if t.state.name != "COMPLETE":
            continue
        rid, a = queue.run_id(t), t.user_attrs
        n, seed, loss = losses[rid]
        assert (a["arch"], a["budget"], a["params"], a["seed"]) == ("dense", 5e8, n, seed)
        assert [a["d_model"], a["n_layers"], a["tokens"]] == dm[rid]
        assert t.value == loss and ("extra" in a) == (rid not in _grid_ids())
    ((planned, version, commit, command),) = prov
    assert planned == 3 and version and command.startswith("python -m sweeps isoflop --db ")
    head = subprocess.run(["git", "-C", str(CONF), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(CONF), "diff", "--quiet", "HEAD", "--"]).returncode == 1
    assert commit == (head.stdout.strip() + "-dirty" * dirty if head.returncode == 0 else None)


def _grid_ids() -> set[str]:
    lab = load_config(CONF, "isoflop", TOO_LARGE)
    return {t.run_id for t in plan(lab, sweep_id(lab, "isoflop"))[0]}


def test_the_dry_run_says_sizes_may_be_added(cli, tmp_path):
    r = cli("sweeps", "isoflop", "--dry-run", "--db", str(tmp_path / "r.db"), *TOO_LARGE)
    assert r.returncode == 0 and len([ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("dense")]) == 3
    assert r.stdout.splitlines()[-1] == (
        "then up to sweep.max_extra=2 sizes per (arch, budget) may be added to bracket its optimum, where its"
        " isoFLOP vertex falls outside the sampled sizes"
    )
    off = cli("sweeps", "isoflop", "--dry-run", "--db", str(tmp_path / "r.db"), *TOO_LARGE, "sweep.max_extra=0")
    assert off.returncode == 0 and "may be added" not in off.stdout and not (tmp_path / "r.db").exists()
