"""sweep.workers=2 with real processes: a worker killed mid-run (kill -9) costs that run one attempt, retried or left
out for a rerun, with the results of an uninterrupted sweep either way; a killed sweep leaves no process behind."""

import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pytest

from mixdepth import results
from mixdepth.results import journal_path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ARGS = [  # 4 runs of 2-3 s of training, two budgets close together: whichever two train when a kill lands (after
    # the first or the second finished run), each has a second or more left however loaded the machine (budgets 4x
    # apart, the queue's longest-first order had 0.1 s runs in flight at the second, whose worker could be idle)
    "sweep.name=pool",
    "sweep.archs=[dense]",
    "sweep.budgets=[4e9,4.5e9]",
    "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}, {d_model: 24, n_layers: 1, n_heads: 2}]",
    "sweep.min_steps=4",
    "sweep.max_extra=0",  # the grid alone (tests/test_bracket.py adds sizes)
    "sweep.workers=2",
    "train.batch_size=4",
    "train.threads=1",
    "train.progress=false",
    "train.accelerator=cpu",
    "data.max_bytes=200000",
    "data.val_tokens=2048",
    "data.seq_len=32",
]


def _procs() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, session id, state) of every process on the machine."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:  # ended meanwhile
                continue
            state, ppid, _, sid = stat[stat.rindex(")") + 2 :].split()[:4]
            out[int(name)] = (int(ppid), int(sid), state)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class Sweep:
    """``python -m sweeps isoflop`` in a session of its own; ``action(self)`` runs from the reader thread as soon as
    the ``at``-th finished run's line is printed (both workers are training then: 4 runs, 2 workers)."""

    def __init__(self, d, name: str, env, *extra: str, at: int = 0, action=None):
        self.db = d / f"{name}.db"
        self.err = (d / f"{name}.err").open("w+")
        cmd = [sys.executable, "-m", "sweeps", "isoflop", "--db", str(self.db), *ARGS, *extra]
        self.proc = subprocess.Popen(
            cmd, cwd=d, env=env, stdout=subprocess.PIPE, stderr=self.err, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self.acted = threading.Event()
        self.error: BaseException | None = None
        self.seen: list[str] = []  # _kill_the_sweep: its session before the kill, and what still ran 5 s after
        self.left: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(at, action), daemon=True)
        self._reader.start()

    def _read(self, at: int, action) -> None:
        finished = 0
        for line in self.proc.stdout:
            self.lines.append(line)
            finished += "val_loss=" in line
            if action and finished == at and not self.acted.is_set():
                try:
                    action(self)
                except BaseException as e:  # reported by result(), not lost in this thread
                    self.error = e
                self.acted.set()

    def workers(self) -> list[int]:
        return [p for p, (ppid, _, _) in _procs().items() if ppid == self.proc.pid and "spawn_main" in _cmdline(p)]

    def result(self, timeout: float = 300) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        assert self.error is None, self.error
        self.err.seek(0)
        return rc, "".join(self.lines), self.err.read()


def _kill_a_worker(s: Sweep) -> None:
    os.kill(s.workers()[0], signal.SIGKILL)


def _kill_the_sweep(s: Sweep) -> None:
    """kill -9 the sweep once both workers train; s.left: what of its session still runs 5 s later."""
    time.sleep(0.5)  # the worker that finished the run has its next one
    s.seen = [_cmdline(p) for p, (_, sid, _) in _procs().items() if sid == s.proc.pid]
    assert len(s.workers()) == 2, s.seen
    os.kill(s.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while True:
        s.left = [_cmdline(p) for p, (_, sid, state) in _procs().items() if sid == s.proc.pid and state != "Z"]
        if not s.left or time.monotonic() > deadline:
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, cli_env):
    """Four sweeps of ARGS at once: uninterrupted (sweep.workers=1: workers only schedule, and the results of the
    in-process path are the pool's), a worker killed with a retry left, one killed without, and the sweep killed."""
    d = tmp_path_factory.mktemp("workers")
    out = {
        "ref": Sweep(d, "ref", cli_env, "sweep.workers=1"),
        "retried": Sweep(d, "retried", cli_env, at=1, action=_kill_a_worker),  # run 4 still queued
        "left": Sweep(d, "left", cli_env, "sweep.retries=0", at=2, action=_kill_a_worker),  # nothing queued
        "orphaned": Sweep(d, "orphaned", cli_env, at=1, action=_kill_the_sweep),
    }
    yield out
    for s in out.values():  # nothing left running, whatever failed (each sweep is its own process group)
        try:
            os.killpg(s.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        s.proc.wait()


def _trials(db) -> list[tuple[str, str]]:
    """(run_id, state) of every started trial in the sweep's Optuna journal."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal_path(db))))
    study = optuna.load_study(study_name=None, storage=storage)  # the one study of this store
    return sorted((t.user_attrs["run"]["row"]["run_id"], t.state.name) for t in study.trials if t.datetime_start)


@pytest.fixture(scope="module")
def reference(sweeps, val_losses):
    rc, out, err = sweeps["ref"].result()
    assert rc == 0, err[-2000:]
    losses = val_losses(sweeps["ref"].db)
    assert len(losses) == 4 and all(v is not None for v in losses.values())
    return losses


def _failed_attempts(out: str) -> list[str]:
    return [ln.strip() for ln in out.splitlines() if "failed: worker died (signal 9)" in ln]


def test_a_killed_worker_costs_one_attempt_and_its_run_is_retried(sweeps, reference, val_losses):
    s = sweeps["retried"]
    rc, out, err = s.result()
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    (line,) = _failed_attempts(out)
    assert "attempt 1 of 2 failed" in line and line.endswith("queued again"), line
    assert "(attempt 2 of 2)" in out
    assert val_losses(s.db) == reference  # bit-identical: every run stored once, the retried one as if never killed
    (retried,) = [rid for rid, state in _trials(s.db) if state == "FAIL"]
    assert sorted(_trials(s.db)) == sorted([(rid, "COMPLETE") for rid in reference] + [(retried, "FAIL")])
    con = results.connect(s.db, read_only=True)
    try:
        (lost,) = con.execute("SELECT (parts->>'failed attempts')::DOUBLE FROM sweep_usage").fetchone()
    finally:
        con.close()
    assert lost > 0  # the killed attempt's time is its own part of the usage, not idle


def test_a_run_left_out_after_its_last_attempt_is_trained_by_the_rerun(sweeps, reference, cli, val_losses):
    s = sweeps["left"]
    rc, out, err = s.result()
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    (line,) = _failed_attempts(out)
    assert "attempt 1 of 1 failed" in line and line.endswith("left out"), line
    stored = val_losses(s.db)
    (lost,) = set(reference) - set(stored)
    assert lines[0] == (
        f"error: 1 run failed after 1 attempt (run_id {lost}): worker died (signal 9);"
        " rerun the same command to retry it"
    )
    assert stored == {k: v for k, v in reference.items() if k != lost}
    assert "report: " in out  # the finished runs were fitted and reported all the same

    again = cli("sweeps", "isoflop", "--db", str(s.db), *ARGS, "sweep.retries=0")
    assert again.returncode == 0 and again.stderr == "", again.stderr[-2000:]
    assert "4 runs planned, 3 already in" in again.stdout and "1 to run" in again.stdout
    assert again.stdout.count("val_loss=") == 1
    assert val_losses(s.db) == reference
    assert (lost, "FAIL") in _trials(s.db) and (lost, "COMPLETE") in _trials(s.db)


def test_killing_the_sweep_leaves_no_process_behind(sweeps):
    """kill -9 of the sweep process: its workers and the multiprocessing resource tracker end with it (a zombie,
    state Z, has ended: only its exit status waits to be collected)."""
    s = sweeps["orphaned"]
    assert s.acted.wait(300), "".join(s.lines)
    assert s.proc.wait(10) == -signal.SIGKILL and s.error is None, s.error
    assert sum("resource_tracker" in c for c in s.seen) == 1 and len(s.seen) == 4, s.seen  # sweep, 2 workers, tracker
    assert s.left == [], s.left


def test_runs_are_queued_longest_first_and_ties_keep_their_order():
    """Workers take the run of most training FLOPs per unit of width first and end on the least (``queue.cost``)."""
    from sweeps import queue

    def run(rid: str, flops: float, d: int) -> dict:
        row = {"run_id": rid, "arch": "dense", "budget": flops, "params_nonembed": 1, "tokens": 1, "d_model": d}
        return {"run": {}, "row": {**row, "n_layers": 1, "seed": 0, "train_flops": flops}}

    study = optuna.create_study()
    plan = [run("small-wide", 1e15, 768), run("small-narrow", 1e15, 192), run("big-narrow", 4e15, 192)]
    plan += [run("tie-a", 1e15, 384), run("tie-b", 2e15, 768)]  # the same cost: the plan's order
    assert queue.enqueue(study, plan) == 5
    taken = []
    while (t := queue.pop(study)) is not None:
        taken.append(queue.run_id(t))
    assert taken == ["big-narrow", "small-narrow", "tie-a", "tie-b", "small-wide"]


class SharedGpu:
    """Two slots on one GPU, ``Drain``'s pool without training: a run takes ``seconds[run_id]`` on the clock ``now``;
    ``big`` runs out of memory (after 1 s) when it starts beside another run."""

    def __init__(self, seconds: dict[str, float], big: str):
        self.now, self.seconds, self.big = 0.0, seconds, big
        self.jobs: dict[str, tuple[float, float, bool]] = {}  # run_id -> (start, end, out of memory)
        self.log: list[tuple[str, float, float, bool]] = []  # run_id, start, end, out of memory

    free = property(lambda self: 2 - len(self.jobs))

    def submit(self, key, run) -> None:
        oom = key == self.big and bool(self.jobs)
        self.jobs[key] = (self.now, self.now + (1.0 if oom else self.seconds[key]), oom)

    def wait(self, timeout=None):
        from mixdepth.results import RunMetrics
        from mixdepth.train import RunResult

        rid = min(self.jobs, key=lambda k: self.jobs[k][1])
        start, self.now, oom = self.jobs.pop(rid)
        self.log.append((rid, start, self.now, oom))
        if oom:
            return rid, None, "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
        metrics = RunMetrics("ok", 1.0, None, 1.0, 1.0, 1.0, None, None, "sim", "bf16", {}, "c", "f", None)
        return rid, RunResult(metrics), None


def test_a_run_out_of_memory_beside_others_is_retried_alone():
    """Slots sharing a GPU: a run that ran out of memory beside another is queued to train alone; it starts once
    nothing else trains on the host (here after the rest, two at a time) and nothing starts beside it. Where slots
    do not share a GPU, the same failure is an ordinary retry."""
    from sweeps import queue
    from sweeps.worker import Drain

    def run(rid: str, flops: float) -> dict:
        row = {"run_id": rid, "arch": "dense", "budget": flops, "params_nonembed": 1, "tokens": 1, "d_model": 64}
        return {"run": {}, "row": {**row, "n_layers": 1, "seed": 0, "train_flops": flops, "steps": 1}}

    seconds = {"a": 10.0, "big": 30.0, "b": 8.0, "c": 6.0, "d": 4.0}  # queued longest first: a, big, b, c, d
    plan = [run(r, 10.0 - i) for i, r in enumerate(seconds)]
    study = optuna.create_study()
    queue.enqueue(study, plan)
    pool = SharedGpu(seconds, "big")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(queue, "decode_run", lambda payload, *a: type("Run", (), {"ckpt_dir": None})())
        assert Drain(studies=[study], slots=2, gpus=["0", "0"], pool=pool).run() == {}
    (*_, oom), *rest = [x for x in pool.log if x[0] == "big"]
    assert oom and len(rest) == 1 and not rest[0][3]  # out of memory beside "a", then trained
    _, alone_start, alone_end, _ = rest[0]
    for rid, start, end, _ in pool.log:  # nothing overlaps the run trained alone
        assert rid == "big" or end <= alone_start or start >= alone_end, (rid, start, end)
    done = {queue.run_id(t) for t in queue.trials(study, optuna.trial.TrialState.COMPLETE)}
    assert done == set(seconds)
    again = [t for t in queue.trials(study, optuna.trial.TrialState.COMPLETE) if t.user_attrs.get("alone")]
    assert [queue.run_id(t) for t in again] == ["big"]

    study = optuna.create_study()  # one slot per GPU: the failure is retried as any other, not alone
    queue.enqueue(study, plan)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(queue, "decode_run", lambda payload, *a: type("Run", (), {"ckpt_dir": None})())
        Drain(studies=[study], slots=2, gpus=["0", "1"], pool=SharedGpu(seconds, "big")).run()
    assert not any(t.user_attrs.get("alone") for t in study.trials)


def test_a_started_pool_spawns_its_workers_at_once_and_a_drain_leaves_them_to_their_owner():
    """``Pool.start`` (the sweep, under its MPS): every worker exists before any run; a drain given the pool trains
    with it and leaves it running, for the next drain (the sizes added to bracket optima); leaving it ends them."""
    from sweeps.pool import Pool
    from sweeps.worker import Drain

    with Pool(2, []).start() as pool:
        workers = [s.process for s in pool._slots]
        assert len({w.pid for w in workers}) == 2 and all(w.is_alive() for w in workers)
        assert Drain(studies=[optuna.create_study()], slots=2, pool=pool).run() == {}  # nothing queued
        assert [s.process for s in pool._slots] == workers and all(w.is_alive() for w in workers)
    assert all(w.exitcode is not None for w in workers)


def test_a_stop_kills_every_training_worker_even_one_the_first_kill_made_fail():
    """Under MPS, killing one worker at the time limit faulted the others' kernels (an H100: "illegal memory
    access"), and the fault's reply reached the pool before the stop came to them: each read as a failed attempt.
    Which workers train is read before any dies: here killing "a" makes "b" reply, and both are stopped; "c",
    whose reply waited before the stop, is left for ``wait``."""
    from sweeps.pool import Pool

    class Conn:
        def __init__(self, ready=False):
            self.ready = ready

        def poll(self):
            return self.ready

        def close(self):
            pass

    class Proc:
        def __init__(self, on_kill=lambda: None):
            self.on_kill, self.exitcode = on_kill, None

        def kill(self):
            self.on_kill()
            self.exitcode = -9

        def join(self, timeout=None):
            pass

    pool = Pool(3, [])
    a, b, c = pool._slots
    b.conn, b.process = Conn(), Proc()
    a.conn, a.process = Conn(), Proc(on_kill=lambda: setattr(b.conn, "ready", True))
    c.conn, c.process = Conn(ready=True), Proc()
    a.key, b.key, c.key = "a", "b", "c"
    assert [key for key, _ in pool.stop()] == ["a", "b"]
    assert a.key is b.key is None and c.key == "c" and c.process.exitcode is None


def test_a_worker_compiles_each_run_afresh_past_dynamo_recompile_limit(monkeypatch):
    """A worker lives across runs of many shapes; dynamo keeps 8 compiled variants of a function and runs later
    shapes eagerly. Each run starts from a reset compiler, so the tenth shape of the same block still compiles."""
    import torch

    import mixdepth.train
    from sweeps.pool import fit_fresh

    compiled = []

    def backend(gm, example_inputs):
        compiled.append(example_inputs[0].shape[-1])
        return gm.forward

    def block(x):
        return torch.nn.functional.silu(x) * 2

    def fake_fit(width):  # what a run does to the same block code: compile it at this run's width
        return torch.compile(block, backend=backend, dynamic=False)(torch.ones(2, width))

    monkeypatch.setattr(mixdepth.train, "fit", fake_fit)
    limit = torch._dynamo.config.recompile_limit
    widths = list(range(8, 8 + 2 * limit + 2))
    for w in widths:
        assert torch.equal(fit_fresh(w), torch.nn.functional.silu(torch.ones(2, w)) * 2)
    assert compiled == widths
    torch._dynamo.reset()
