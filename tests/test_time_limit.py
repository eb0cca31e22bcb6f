"""``--time-limit``: a run starts only when the sweep's finished runs predict that it ends in time (the longest of
those first), one still training at the limit is stopped there and queued again, and the command ends with the rest
queued, exit code 75; a rerun resumes. The scheduling is checked on a simulated clock with runs of known length, the
command end to end on the CPU."""

import shutil
from pathlib import Path

import duckdb
import optuna
import pytest
from optuna.trial import TrialState

from mixdepth.results import RunMetrics, journal_path
from mixdepth.train import RunResult
from sweeps import queue
from sweeps.deadline import MARGIN, STOPPED_S, TIME_LIMIT, Deadline, estimator, parse, predictor
from sweeps.journal import storage as journal_storage

SMALL = [  # 4 runs of one thread each: 2 shapes x 2 budgets
    "sweep.name=limited",
    "sweep.archs=[dense]",
    "sweep.budgets=[1e9,2e9]",
    "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}, {d_model: 24, n_layers: 1, n_heads: 2}]",
    "sweep.min_steps=4",
    "sweep.max_extra=0",
    "data.seq_len=32",
    "data.max_bytes=200000",
    "data.val_tokens=2048",
    "train.batch_size=4",
    "train.threads=1",
    "train.progress=false",
    "train.accelerator=cpu",
]


def row(arch="dense", d=192, layers=3, steps=100, flops=1e15, **metrics) -> dict:
    base = {"sweep_id": "s", "arch": arch, "d_model": d, "n_layers": layers, "batch_size": 32, "seq_len": 1024}
    return {**base, "steps": steps, "train_flops": flops, **metrics}


def done(wall, setup=2.0, evaluate=1.0, status="ok", **kw) -> dict:
    return row(**kw, status=status, wall_s=wall, setup_s=setup, eval_s=evaluate)


def queued(r: dict, **attrs) -> dict:
    """A queued trial's user attributes for the run of row ``r``."""
    return {"run": {"row": r}, **attrs}


def test_a_shape_trained_before_is_predicted_from_its_run_with_the_most_steps():
    seconds = predictor([done(100.0, steps=1000), done(60.0, steps=500, setup=5.0), done(99.0, steps=1000)])
    # 100 s / 1000 steps (the slower of the two longest; the 500-step run's compilation weighs twice as much)
    assert seconds(row(steps=300)) == pytest.approx(5.0 + 1.0 + 300 * 0.1)  # the shape's longest set-up + eval


def test_another_shape_takes_the_rate_of_its_arch_at_the_nearest_width_at_or_below_its_own():
    finished = [
        done(100.0, d=256, layers=4, flops=1e15),  # 1e13 FLOP/s
        done(200.0, d=256, layers=4, flops=4e15, steps=400),  # 2e13 FLOP/s: d 256's run of the most FLOPs
        done(50.0, d=192, layers=3, flops=1e15),  # 2e13 FLOP/s
        done(250.0, d=128, layers=2, flops=1e15),  # 4e12 FLOP/s: the narrowest, not the nearest, for wider runs
        done(10.0, arch="mod", d=192, layers=3, flops=1e15, setup=9.0),  # another arch's: not used but its set-up
    ]
    seconds = predictor(finished)
    wide = row(d=768, layers=12, flops=4e15)
    assert seconds(wide) == pytest.approx(10.0 + 4e15 / 2e13)  # the longest set-up + evaluation of any run
    between = row(d=224, layers=3, flops=1e15)
    assert seconds(between) == pytest.approx(10.0 + 1e15 / 2e13)  # d 192's
    narrow = row(d=96, layers=2, flops=1e15)  # none at or below: the lowest rate scaled down, 4e12 x 96/128
    assert seconds(narrow) == pytest.approx(10.0 + 1e15 / (4e12 * 96 / 128))
    unseen_arch = row(arch="moda", d=192, layers=3, flops=1e15)  # of every arch at d 192: the slower of equal FLOPs
    assert seconds(unseen_arch) == pytest.approx(10.0 + 1e15 / 2e13)


def test_diverged_runs_and_an_empty_sweep_predict_nothing():
    assert predictor([])(row()) is None
    assert predictor([done(5.0, status="diverged")])(row()) is None


def test_a_run_fits_when_its_margin_of_prediction_is_within_the_time_left_longest_first():
    now = [1000.0]
    limit = Deadline(start=900.0, limit=400.0, clock=lambda: now[0])  # 300 s left
    key = limit.order([done(97.0, steps=1000)])  # 0.097 s a step, 3 s outside them
    assert key(queued(row(steps=1000))) == -100.0
    assert key(queued(row(steps=int((300 / MARGIN - 3) / 0.097)))) is not None
    assert key(queued(row(steps=int((300 / MARGIN - 3) / 0.097) + 1))) is None
    assert limit.order([])(queued(row())) == float("-inf")  # nothing finished: unpredicted, starts first
    now[0] = 1300.0
    assert limit.order([])(queued(row())) is None  # past the limit nothing starts


def test_a_run_a_time_limit_stopped_is_predicted_at_least_as_long_as_it_trained():
    times = estimator([done(97.0, steps=1000)])  # 0.097 s a step, 3 s outside them
    assert times(queued(row(steps=1000), **{STOPPED_S: 250.0})) == (250.0, None)  # unfinished after 250 s
    assert times(queued(row(steps=1000), **{STOPPED_S: 50.0}))[0] == pytest.approx(100.0)  # the longer prediction
    assert estimator([])(queued(row(), **{STOPPED_S: 50.0})) == (50.0, None)  # nothing finished: still not shorter


def test_a_run_that_checkpoints_starts_after_those_that_fit_when_its_next_checkpoint_does():
    """300 s left; 0.097 s a step and 3 s outside them. A 4,000-step run (391 s) does not fit: keeping no
    checkpoints it waits, checkpointing every 500 steps (51.5 s to the first) it starts after every run that fits,
    the shortest first; resumed at step 1,000 it is predicted for the 3,000 steps left (294 s: still over with the
    margin), at step 2,000 for 2,000 (197 s: it fits). With 50 s left its next checkpoint does not fit either."""
    now = [100.0]
    limit = Deadline(start=0.0, limit=400.0, clock=lambda: now[0])
    finished = [done(97.0, steps=1000)]
    long = queued(row(steps=4000))
    assert limit.order(finished)(long) is None
    assert limit.order(finished, lambda attrs: (500, 0))(long) == pytest.approx(391.0)
    assert limit.order(finished, lambda attrs: (500, 1000))(long) == pytest.approx(294.0)
    assert limit.order(finished, lambda attrs: (500, 2000))(long) == pytest.approx(-197.0)
    assert estimator(finished, lambda attrs: (500, 2000))(long) == (pytest.approx(197.0), pytest.approx(51.5))
    assert limit.order(finished, lambda attrs: (5000, 0))(long) is None  # its first checkpoint is past its end
    now[0] = 350.0
    assert limit.order(finished, lambda attrs: (500, 0))(long) is None
    line = limit.held([long], finished, lambda attrs: (500, 0))
    assert line.startswith("time limit: 1 run still queued, none predicted to end or reach its next checkpoint")
    assert line.endswith("rerun the same command to resume"), line


def test_the_stop_line_says_whether_a_rerun_can_start_the_queued_runs():
    """A rerun of the same command starts a queued run only if it fits a whole command: where even the shortest is
    predicted longer (a lone run of a shape never seen, priced at the sweep's slowest rate), the line says so instead
    of sending the user round the same loop."""
    limit = Deadline(start=0.0, limit=400.0, clock=lambda: 390.0)  # 10 s left
    finished = [done(97.0, steps=1000)]  # 0.097 s a step, 3 s outside them
    fits_next_time = row(steps=1000)  # 100 s
    never = row(steps=4000)  # 391 s: x MARGIN over 400
    line = limit.held([queued(fits_next_time), queued(never)], finished)
    assert line.startswith("time limit: 2 runs still queued, none predicted to end within the 10 s left of 400 s")
    assert line.endswith("; rerun the same command to resume"), line
    line = limit.held([queued(never)], finished)
    assert line.endswith(
        f"; the shortest is predicted at 391 s (x {MARGIN:g} margin), more than a whole command of 400 s: rerun with a"
        " longer --time-limit or without one, or with train.ckpt_every=1000 (each run's next checkpoint then predicted"
        " within half a command) to train such runs across commands"
    ), line
    assert limit.held([queued(never)], finished, lambda attrs: (5000, 0)).endswith("--time-limit or without one")


def test_the_checkpoint_interval_it_suggests_checkpoints_every_run_within_half_a_command():
    """``Deadline.interval``: the largest 1-2-5 interval whose first checkpoint every queued run reaches within half
    the limit, x MARGIN, from the runs' affine predictions (3 s outside the steps, 0.097 s a step: up to 1,687 steps
    in a 400 s limit)."""
    finished = [done(97.0, steps=1000)]
    limit = Deadline(start=0.0, limit=400.0)
    assert limit.interval([queued(row(steps=4000))], finished) == 1000
    assert Deadline(0.0, 900.0).interval([queued(row(steps=4000))], finished) == 2000  # up to 3,835 steps in 900 s
    # a narrower shape of 8x the FLOPs, priced at half the finished run's FLOP rate (scaled down with width): 1,552 s
    # over its steps, 0.388 s a step, at most 421 steps within 200 s / 1.2: the slowest run decides
    slower = row(d=96, steps=4000, flops=8e15)
    assert limit.interval([queued(row(steps=4000)), queued(slower)], finished) == 200
    assert limit.interval([queued(row(steps=4000))], []) is None  # nothing finished: nothing to price it by
    assert Deadline(0.0, 5.0).interval([queued(row(steps=4000))], finished) is None  # 3 s + one step x 1.2 > 2.5 s


@pytest.mark.parametrize("text,seconds", [("540", 540.0), ("9m", 540.0), ("1.5h", 5400.0), ("30s", 30.0)])
def test_time_limit_values(text, seconds):
    assert parse(text) == seconds


@pytest.mark.parametrize("text", ["0", "-3m", "abc", "9x", "inf", "nan", "m", ""])
def test_bad_time_limit_values(text):
    from mixdepth.config import ConfigError

    with pytest.raises(ConfigError, match="--time-limit"):
        parse(text)


@pytest.fixture(scope="module")
def payloads() -> list[dict]:
    """The SMALL sweep's 4 queued runs, as the sweep queues them."""
    from mixdepth.config import load_config
    from sweeps.plan import plan, sweep_id
    from sweeps.runner import payload

    lab = load_config(Path(__file__).resolve().parents[1] / "conf", "isoflop", SMALL)
    sid = sweep_id(lab, "isoflop")
    return [payload(lab, sid, t) for t in plan(lab, sid)[0]]


class Simulated:
    """One slot whose runs take ``seconds(row)`` on the clock ``now``: ``Drain``'s pool without training."""

    def __init__(self, seconds, rows: dict[str, dict], fails: set[str] = frozenset()):
        self.now, self.seconds, self.rows, self.fails = 0.0, seconds, rows, set(fails)  # fails: runs that fail once
        self.job, self.started, self.log, self.stopped = None, 0.0, [], []  # (run_id, start, end) of each run

    free = property(lambda self: int(self.job is None))

    def submit(self, key, run) -> None:
        self.job, self.started = key, self.now

    def wait(self, timeout=None):
        r = self.rows[self.job]
        end = self.started + self.seconds(r)
        if timeout is not None and self.now + timeout < end:  # still training when the wait ends
            self.now += timeout
            return None
        rid, self.job, self.now = self.job, None, end
        if rid in self.fails:
            self.fails.discard(rid)
            return rid, None, "worker died (signal 9)"
        self.log.append((rid, self.started, end))
        m = RunMetrics("ok", 1.0, None, 1.0, end - self.started - 3.0, 1.0, None, None, "sim", "32", {}, "c", "f",
                       None, 2.0, 1.0)  # fmt: skip
        return rid, RunResult(m), None

    def stop(self) -> list[tuple[str, float]]:
        self.stopped.append((self.job, self.now - self.started))
        self.job = None
        return self.stopped[-1:]


def _drain(payloads, seconds, limit: float | None, on_stop=None, study=None, fails: set[str] = frozenset(), **drain):
    """Drain ``study`` (default: a new one with the payloads queued) on the simulated clock (``Drain`` keys
    ``drain``); every run trains."""
    from sweeps.worker import Drain

    if study is None:
        study = optuna.create_study()
        queue.enqueue(study, payloads)
    pool = Simulated(seconds, {p["row"]["run_id"]: p["row"] for p in payloads}, fails)
    deadline = None if limit is None else Deadline(start=0.0, limit=limit, clock=lambda: pool.now)
    assert Drain(studies=[study], pool=pool, deadline=deadline, on_stop=on_stop, **drain).run() == {}
    assert pool.now <= (limit or float("inf")), pool.now  # the command ends within its limit
    return study, pool


@pytest.mark.parametrize("limit,started", [(100.0, [0, 1, 2]), (85.0, [0, 2]), (60.0, [0])])
def test_runs_start_only_when_they_end_in_time_and_the_rest_stay_queued(payloads, limit, started):
    """The queue's 4 runs (327, 188, 164, 94 steps) take 10 s + 0.1 s a step; with no limit all train in queue
    order. With one, the first starts unpredicted (42.7 s); the next when predicted to end in time: the 188-step run
    (another shape: 51 s with the margin, from the first run's FLOP rate) fits in the 57 s left of 100 but not in
    the 42 s left of 85, where the 164-step one (27.5 s, from its shape's seconds per step) starts in its place.
    Every run ends within the limit; the others stay queued for a later command."""
    seconds = lambda r: 10.0 + 0.1 * r["steps"]  # noqa: E731
    order = [queue.run_id(t) for t in _queued(payloads)]
    assert [r for r, _, _ in _drain(payloads, seconds, None)[1].log] == order
    study, pool = _drain(payloads, seconds, limit)
    assert [r for r, _, _ in pool.log] == [order[i] for i in started] and pool.stopped == []
    assert all(end <= limit for _, _, end in pool.log), pool.log
    left = [queue.run_id(t) for t in queue.trials(study, TrialState.WAITING)]
    assert left == [r for i, r in enumerate(order) if i not in started]


def test_a_run_still_training_at_the_limit_is_stopped_and_queued_again_predicted_no_shorter(payloads):
    """As above with 100 s, but the 188-step run (42.7 s predicted, 51.3 s with the margin, 57.3 s left) trains
    three times slower than the first run's rate says (66.4 s): at 100 s it is stopped after 57.3 s, its time
    reported as lost, and queued again with that time, no failed attempt; the command ends at its limit. The next
    command predicts it at 57.3 s, not the 42.7 s its FLOPs say."""
    order = [queue.run_id(t) for t in _queued(payloads)]
    slow = order[1]
    seconds = lambda r: 10.0 + 0.1 * r["steps"] * (3 if r["run_id"] == slow else 1)  # noqa: E731
    lost = []
    study, pool = _drain(payloads, seconds, 100.0, on_stop=lambda s, why, kept: lost.append((s, why, kept)))
    assert [r for r, _, _ in pool.log] == order[:1] and pool.now == pytest.approx(100.0)
    assert pool.stopped == [(slow, pytest.approx(57.3))] and lost == [(pytest.approx(57.3), "time limit", 0.0)]
    again = queue.trials(study, TrialState.WAITING)
    assert sorted(queue.run_id(t) for t in again) == sorted(order[1:])
    attrs = next(t.user_attrs for t in again if queue.run_id(t) == slow)
    assert attrs[STOPPED_S] == pytest.approx(57.3)
    failed = queue.trials(study, TrialState.FAIL)
    assert [queue.run_id(t) for t in failed] == [slow] and not any(map(queue.attempt_failed, failed))
    first = queue.finished_rows([study])
    assert predictor(first)(attrs["run"]["row"]) == pytest.approx(42.7, abs=0.1)
    assert estimator(first)(attrs) == (pytest.approx(57.3), None)


def test_a_run_stopped_at_the_limit_keeps_the_flops_up_to_its_newest_checkpoint(payloads, tmp_path):
    """As above, the 188-step run checkpointing every 50 steps: it started from its step-50 checkpoint and wrote
    step 150 before the stop, so the stop keeps 100 of its 188 steps' FLOPs (the next command resumes there), and
    it is queued again without the stopped seconds (it resumes: not priced by the stop)."""
    order = [queue.run_id(t) for t in _queued(payloads)]
    slow = order[1]
    seconds = lambda r: 10.0 + 0.1 * r["steps"] * (3 if r["run_id"] == slow else 1)  # noqa: E731
    (tmp_path / slow).mkdir()
    (tmp_path / slow / "step=50.ckpt").write_bytes(b"")
    real_stop = Simulated.stop

    def stop(pool):  # the run wrote its step-150 checkpoint before the limit (the older one pruned)
        (tmp_path / slow / "step=50.ckpt").unlink()
        (tmp_path / slow / "step=150.ckpt").write_bytes(b"")
        return real_stop(pool)

    lost = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Simulated, "stop", stop)
        study, pool = _drain(
            payloads, seconds, 100.0, lambda s, why, kept: lost.append((s, why, kept)),
            ckpt_root=tmp_path, train={"ckpt_every": 50},
        )  # fmt: skip
    flops = next(p["row"]["train_flops"] for p in payloads if p["row"]["run_id"] == slow)
    assert pool.stopped == [(slow, pytest.approx(57.3))]
    assert lost == [(pytest.approx(57.3), "time limit", pytest.approx(flops * 100 / 188))]
    again = next(t for t in queue.trials(study, TrialState.WAITING) if queue.run_id(t) == slow)
    assert STOPPED_S not in again.user_attrs and again.user_attrs[queue.COUNTED] == 150


def test_a_run_whose_counted_checkpoint_was_lost_counts_from_where_the_last_command_counted(payloads, tmp_path):
    """The 188-step run alone, in 40 s commands: the first stops it after it wrote step 150 and counts its FLOPs
    up to there; that checkpoint is lost before the next (another machine), which stops it again after it wrote
    step 100 and counts nothing more (those steps were counted); with that one lost too, a command without a limit
    trains it from step 0 and is told to count from step 150: no step counts twice over the commands."""
    slow = [queue.run_id(t) for t in _queued(payloads)][1]
    seconds = lambda r: 10.0 + 0.1 * r["steps"] * 3  # noqa: E731
    study = optuna.create_study()
    queue.enqueue(study, [p for p in payloads if p["row"]["run_id"] == slow])
    flops = next(p["row"]["train_flops"] for p in payloads if p["row"]["run_id"] == slow)
    real_stop, writes, lost, done = Simulated.stop, [150, 100], [], []

    def stop(pool):  # the run wrote a checkpoint before the limit
        (tmp_path / slow).mkdir(exist_ok=True)
        (tmp_path / slow / f"step={writes.pop(0)}.ckpt").write_bytes(b"")
        return real_stop(pool)

    drain = dict(ckpt_root=tmp_path, train={"ckpt_every": 50})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Simulated, "stop", stop)
        for _ in writes[:]:
            _drain(payloads, seconds, 40.0, lambda s, why, kept: lost.append(kept), study=study, **drain)
            shutil.rmtree(tmp_path / slow)  # lost before the next command
    assert lost == [pytest.approx(flops * 150 / 188), 0.0]
    (queued,) = queue.trials(study, TrialState.WAITING)
    assert queued.user_attrs[queue.COUNTED] == 150
    _drain(payloads, seconds, None, study=study, on_done=lambda st, row, res, counted: done.append(counted), **drain)
    assert done == [150]


def test_a_run_stopped_at_the_limit_has_spent_no_attempt(payloads, capsys):
    """The 188-step run stopped at the limit as above, then in the next command (no limit) its process dies once:
    that is its first failed attempt of two, and it is queued again and trains; the stop counted as an attempt
    would leave it out after this one failure."""
    order = [queue.run_id(t) for t in _queued(payloads)]
    slow = order[1]
    seconds = lambda r: 10.0 + 0.1 * r["steps"] * (3 if r["run_id"] == slow else 1)  # noqa: E731
    study, _ = _drain(payloads, seconds, 100.0)
    capsys.readouterr()
    _, pool = _drain(payloads, seconds, None, study=study, fails={slow})
    out = capsys.readouterr().out
    assert "attempt 1 of 2 failed: worker died (signal 9); queued again" in out and "(attempt 2 of 2)" in out, out
    assert slow in [r for r, _, _ in pool.log]
    assert [queue.run_id(t) for t in queue.trials(study, TrialState.FAIL) if queue.attempt_failed(t)] == [slow]


def _queued(payloads) -> list:
    study = optuna.create_study()
    queue.enqueue(study, payloads)
    return queue.trials(study, TrialState.WAITING)


def test_a_time_limited_sweep_leaves_no_row_and_its_rerun_trains_every_run(cli, tmp_path, status_row):
    """1 s is over before the first run could start: exit 75, the 4 runs queued, no row; the rerun with an hour
    trains them all (every one predicted to fit) and reports, exit 0."""
    db = tmp_path / "r.db"
    r = cli("sweeps", "isoflop", "--db", str(db), "--time-limit", "1", *SMALL)
    assert r.returncode == TIME_LIMIT, r.stderr[-2000:]
    assert "time limit: 4 runs still queued" in r.stdout and "rerun the same command" in r.stdout, r.stdout
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    con.close()
    row = status_row(cli("sweeps", "status", "--db", str(db)).stdout, "limited")
    assert [row[k] for k in ("planned", "queued", "running", "failed attempts")] == ["4", "4", "0", "0"]
    assert journal_path(db).exists()
    r = cli("sweeps", "isoflop", "--db", str(db), "--time-limit", "1h", *SMALL)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "4 to run" in r.stdout and "time limit" not in r.stdout and "report:" in r.stdout, r.stdout
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*), count(DISTINCT run_id) FROM runs WHERE status = 'ok'").fetchone() == (4, 4)
    con.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sweep_stops_runs_still_training_at_its_limit_and_ends_there(cli, tmp_path, status_row, workers):
    """With nothing finished the first runs start unpredicted; at 1e12 FLOPs they train for minutes, so the 30 s
    limit stops them (in their worker processes: a sweep of one worker trains in one under a time limit) and the
    command ends there: exit 75, no row, every run queued again and no failed attempt, the lost time in its usage;
    the checkpoint each wrote is kept for the next command to resume from."""
    import json
    import time

    db = tmp_path / "r.db"
    start = time.monotonic()
    extra = ["sweep.budgets=[1e12,2e12]", f"sweep.workers={workers}", "train.ckpt_every=200"]
    r = cli("sweeps", "isoflop", "--db", str(db), "--time-limit", "30", *SMALL, *extra)
    took = time.monotonic() - start
    assert r.returncode == TIME_LIMIT, r.stderr[-2000:]
    assert r.stdout.count("still training at the time limit after") == workers, r.stdout
    assert "time limit: 4 runs still queued" in r.stdout, r.stdout
    assert took < 30 + 20, (took, r.stdout)  # the limit, the Python start before it is counted, the exit
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    parts, credited = con.execute("SELECT parts, train_flops FROM sweep_usage").fetchone()
    con.close()
    parts = json.loads(parts)
    assert parts["stopped"] == "time limit" and 0 < parts["runs stopped at the time limit"] < 30, parts
    row = status_row(cli("sweeps", "status", "--db", str(db)).stdout, "limited")
    assert [row[k] for k in ("planned", "queued", "running", "failed attempts")] == ["4", "4", "0", "0"]
    kept = {p.parent.name for p in (tmp_path / "r_checkpoints").glob("*/step=*.ckpt")}
    assert len(kept) == workers, sorted((tmp_path / "r_checkpoints").rglob("*"))
    with queue.closing(journal_storage(journal_path(db))) as st:
        (name,) = queue.sweeps_in(st)
        again = queue.waiting([queue.load(st, name)])
    assert {a["run"]["row"]["run_id"] for a in again} >= kept  # resumed from their checkpoints: not priced by the stop
    assert len(again) == 4 and not any(STOPPED_S in a for a in again), again
    rows = {a["run"]["row"]["run_id"]: a["run"]["row"] for a in again}
    saved = {p.parent.name: int(p.stem.split("=")[1]) for p in (tmp_path / "r_checkpoints").glob("*/step=*.ckpt")}
    # the usage counts the steps the checkpoints keep, which the next command does not train again
    assert credited == pytest.approx(sum(rows[r]["train_flops"] * k / rows[r]["steps"] for r, k in saved.items()))
    assert credited > 0


def test_a_gpu_command_whose_every_run_was_stopped_still_knows_its_peak(tmp_path, cli_env):
    """No run finished to give the peak, yet the command's device time counts: its row takes the device's peak
    (here the config's, with one GPU stood in for the CPU), so the sweep's utilisation stays a number (0%) rather
    than unknown for every command pooled with it."""
    import subprocess
    import sys

    from mixdepth import results

    db = tmp_path / "r.db"
    argv = ["isoflop", "--db", str(db), "--time-limit", "15", *SMALL]
    argv += ["sweep.budgets=[1e12]", "sweep.workers=2", "train.peak_flops=1e12"]
    code = "; ".join([
        "import sys",
        "from sweeps import runner",
        "runner.n_gpus = lambda train, slots: 1",
        "from sweeps.__main__ import main",
        "sys.exit(main(sys.argv[1:]))",
    ])  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, capture_output=True, text=True, env=cli_env)
    assert r.returncode == TIME_LIMIT and "still training at the time limit" in r.stdout, r.stderr[-2000:]
    con = results.connect(db, read_only=True)
    try:
        (row,) = con.execute("SELECT runs, peak_flops, utilisation, parts->>'stopped' FROM sweep_usage").fetchall()
        ((utilisation, _, commands),) = results.sweep_utilisation(con).values()
    finally:
        con.close()
    assert row == (0, 1e12, 0.0, "time limit") and (utilisation, commands) == (0.0, 1), (row, utilisation)


@pytest.mark.parametrize("extra", [["--time-limit", "0"], ["--time-limit", "5x"], ["--time-limit", "9", "--dry-run"]])
def test_a_bad_time_limit_is_one_line_and_writes_nothing(cli, tmp_path, extra):
    r = cli("sweeps", "isoflop", "--db", str(tmp_path / "r.db"), *extra, *SMALL)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "--time-limit" in err[0], r.stderr
    assert list(tmp_path.iterdir()) == []


def test_usage_says_a_command_stopped_at_its_time_limit():
    from mixdepth import usage

    used = usage.Usage("s", slots=1, gpus=1, started=0.0, training=1.0, trained=9.0, peak=1e12)
    used.add(RunMetrics("ok", 1.0, None, 1.0, 5.0, 1e6, 0.1, 1e12, "d", "bf16", {}, "c", "f", None), 1, 1e12, 1)
    stopped = usage.lines(used.row(now=10.0, stopped="time limit"))[0]
    assert stopped.endswith("(stopped at its time limit, before its report)"), stopped
    assert usage.lines(used.row(now=10.0, stopped="interrupted"))[0].endswith("(interrupted before its report)")
    assert "before its report" not in usage.lines(used.row(now=10.0))[0]
    cut, lost = usage.CUT["time limit"], usage.CUT["interrupted"]
    assert cut not in usage.lines(used.row(now=10.0))[1] and lost not in usage.lines(used.row(now=10.0))[1]
    used.cut(2.0)  # a run stopped after 2 s of its slot's 8: its time moves out of "idle or between runs"
    row = used.row(now=10.0, stopped="time limit")
    assert row["parts"][cut] == 2.0 and sum(row["parts"][k] for k in usage.PARTS) == pytest.approx(10.0)
    assert f"{cut} 20.0%" in usage.lines(row)[1] and lost not in usage.lines(row)[1], usage.lines(row)
    used.cut(1.0, "interrupted")  # Ctrl-C after another 1 s of a run: lost too, not idle
    row = used.row(now=10.0, stopped="interrupted")
    assert row["parts"][lost] == 1.0 and row["parts"]["idle or between runs"] == pytest.approx(8 - 5 - 2 - 1)
    assert sum(row["parts"][k] for k in usage.PARTS) == pytest.approx(10.0) and used.stopped == 2
    assert f"{lost} 10.0%" in usage.lines(row)[1], usage.lines(row)
