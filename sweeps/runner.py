"""Run an isoFLOP sweep: Optuna holds the work queue, DuckDB the record, analysis the fits and figures."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import optuna
import torch

from mixdepth import results
from mixdepth.config import ConfigError, LabConfig
from mixdepth.data import load_corpus
from mixdepth.train import RunConfig, RunResult, fit, resolve_device
from sweeps.journal import repair
from sweeps.journal import storage as journal_storage
from sweeps.paths import SweepPaths
from sweeps.plan import Trial, plan, sweep_id, table
from sweeps.pool import Pool


def run_record(sid: str, trial: Trial, lab: LabConfig, metrics: results.RunMetrics) -> results.RunRecord:
    """The stored row of a finished trial: what the plan fixed and what training measured."""
    m = trial.model
    return results.RunRecord(
        run_id=trial.run_id,
        sweep_id=sid,
        arch=trial.arch,
        budget=trial.budget,
        d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        d_ff=m.d_ff,
        seq_len=m.seq_len,
        vocab_size=m.vocab_size,
        params_total=trial.params["total"],
        params_nonembed=trial.params["nonembed"],
        params_active=trial.params["active"],
        flops_per_token=trial.flops_per_token,
        flops_6nd=6 * trial.params["nonembed"] * trial.tokens,
        train_flops=trial.train_flops,
        tokens=trial.tokens,
        steps=trial.steps,
        batch_size=lab.train.batch_size,
        lr=lab.train.lr,
        seed=lab.train.seed,
        metrics=metrics,
        config={"model": asdict(m), "data": asdict(lab.data), "train": asdict(lab.train)},
    )


def _queue(journal: Path, sid: str, todo: list[Trial], all_ids: list[str]) -> optuna.Study:
    """The Optuna study in ``journal``, rebuilt from the database's view: a damaged journal is repaired or
    replaced (one line on stderr), stale RUNNING/WAITING trials of a killed process are failed, and the runs the
    database lacks (``todo``) are enqueued."""
    # ERROR: a failed trial is this runner's exception to report (catch=()); Optuna's warning would repeat it
    # with a traceback
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    # The caller holds the store's write lock and the journal is that store's alone: a journal lock file
    # (Optuna's "<journal>.lock") still there is a killed process's, which Optuna would wait 30 s out.
    Path(f"{journal}.lock").unlink(missing_ok=True)
    if note := repair(journal):  # a torn append (disk full, kill) would make every later read fail
        print(note, file=sys.stderr, flush=True)
    storage = journal_storage(journal)
    study = optuna.create_study(
        study_name=sid,
        storage=storage,
        direction="minimize",
        load_if_exists=True,
        sampler=optuna.samplers.RandomSampler(seed=0),
    )
    for t in study.get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)
    ):
        storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
    for t in todo:
        study.enqueue_trial({"run_id": t.run_id})
    study.set_user_attr("run_ids", all_ids)
    return study


def run_isoflop(lab: LabConfig, preset: str, paths: SweepPaths, dry_run: bool = False) -> int:
    """Plan the sweep, then (unless ``dry_run``) train what the store lacks, store it, fit and report.

    Args:
        lab: the resolved config (``load_config``).
        preset: the preset name, part of the sweep id.
        paths: the store, the Optuna journal and the report folder, decided by the CLI.
        dry_run: print the plan and return.
    """
    sid = sweep_id(lab, preset)
    trials, notes = plan(lab, sid)
    if dry_run:
        print(f"sweep {sid}: {len(trials)} runs, {sum(t.train_flops for t in trials):.3g} training FLOPs")
        print(table(trials))
        for n in notes:
            print("note:", n)
        return 0
    gpus = _worker_gpus(lab)
    load_corpus(lab.data)  # fail on a bad corpus before the database is touched; fills the cache workers read
    with results.writer(paths.db) as store:  # held for the whole sweep: the one writer of this database
        return _run(lab, paths, store, sid, preset, trials, gpus)


def _worker_gpus(lab: LabConfig) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each pool worker: one GPU each when workers > 1 train on GPUs, else none. Checked
    before the store is opened (a dry run, which trains nothing, plans GPU presets on any machine)."""
    if lab.train.accelerator == "gpu" and not torch.cuda.is_available():
        raise ConfigError("train.accelerator=gpu, but no GPU is visible; use auto or cpu")
    if lab.sweep.workers == 1 or resolve_device(lab.train)[0] != "gpu":
        return []
    n = torch.cuda.device_count()
    if lab.sweep.workers > n:
        raise ConfigError(f"sweep.workers={lab.sweep.workers} needs one GPU each, but {n} are visible")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (visible.split(",") if visible else [str(i) for i in range(n)])[: lab.sweep.workers]


def _header(i: int, n: int, t: Trial) -> str:
    return (
        f"[{i}/{n}] {t.arch} C={t.budget:.2e} d_model={t.shape.d_model}"
        f" layers={t.shape.n_layers} params={t.params['nonembed']:,} tokens={t.tokens:,} steps={t.steps}"
    )


def _record(store: results.Writer, sid: str, lab: LabConfig, t: Trial, res: RunResult, tag: str = "") -> float:
    """Store a finished run (row and curve in one transaction) and print its result line."""
    m = res.metrics
    with store.session() as con:
        results.add_run(con, run_record(sid, t, lab, m), res.curve)
    loss = "diverged (loss not finite)" if m.val_loss is None else f"{m.val_loss:.4f}"
    print(f"    {tag}val_loss={loss} ({m.wall_s:.1f}s, {m.tokens_per_s:,.0f} tok/s)", flush=True)
    return math.inf if m.val_loss is None else m.val_loss  # Optuna needs a number; the store holds NULL


def _gave_up(failed: dict[str, str], attempts: int) -> str:
    """The sweep's one error line for runs left out after their last attempt failed."""
    n, s = len(failed), (lambda k: "s" * (k > 1))
    return (
        f"error: {n} run{s(n)} failed after {attempts} attempt{s(attempts)} (run_id {', '.join(failed)}):"
        f" {next(iter(failed.values()))}; rerun the same command to retry {'them' if n > 1 else 'it'}"
    )


def _run(lab: LabConfig, paths: SweepPaths, store, sid: str, preset: str, trials: list[Trial], gpus: list[str]) -> int:
    with store.session() as con:
        results.add_sweep(con, sid, lab.sweep.name, preset, lab.sections())
        done = results.finished_run_ids(con)
    todo = [t for t in trials if t.run_id not in done]
    by_id = {t.run_id: t for t in trials}
    print(
        f"sweep {sid}: {len(trials)} runs planned, {len(trials) - len(todo)} already in {paths.db}, {len(todo)} to run"
    )
    study = _queue(paths.journal, sid, todo, list(by_id))
    counter = {"i": 0}

    def objective(trial: optuna.Trial) -> float:
        t = by_id[trial.suggest_categorical("run_id", list(by_id))]
        counter["i"] += 1
        print(_header(counter["i"], len(todo), t), flush=True)
        return _record(store, sid, lab, t, fit(RunConfig(model=t.model, data=lab.data, train=lab.train, steps=t.steps)))

    start = time.perf_counter()
    failed = {}
    if todo and lab.sweep.workers > 1:
        failed = _run_pool(lab, store, sid, study, by_id, len(todo), gpus)
    elif todo:
        study.optimize(objective, n_trials=len(todo), catch=())
    print(f"trained {len(todo) - len(failed)} runs in {time.perf_counter() - start:.0f}s")
    gave_up = _gave_up(failed, lab.sweep.retries + 1) if failed else ""

    with store.session() as con:
        n_div, n_ok = con.execute(
            "SELECT count(*) FILTER (WHERE status = 'diverged'), count(*) FILTER (WHERE status = 'ok')"
            " FROM runs WHERE sweep_id = ?",
            [sid],
        ).fetchone()
    if n_div:
        print(f"{n_div} of {n_div + n_ok} runs diverged (a loss not finite): stored with NULL losses, not fitted")
    if not n_ok:
        print(
            gave_up or f"error: no run of sweep {sid} has a finite loss, nothing to fit; lower train.lr",
            file=sys.stderr,
        )
        return 1

    from analysis.pipeline import run_all

    written = run_all(store, sid, paths.reports / sid, n_boot=lab.sweep.bootstrap)
    print(f"results: {paths.db}")
    for name, p in written.items():
        print(f"{name}: {p}")
    if gave_up:
        print(gave_up, file=sys.stderr)
        return 1
    return 0


def _run_pool(
    lab: LabConfig, store, sid: str, study: optuna.Study, by_id: dict[str, Trial], n: int, gpus: list[str]
) -> dict[str, str]:
    """Train the n queued runs in sweep.workers spawned processes; only this process writes the store and journal.

    A run whose worker dies or whose fit raises fails that attempt (a FAIL trial, no row) and is queued again, at
    most sweep.retries times. Returns the runs given up on: run_id -> why their last attempt failed.
    """
    workers = lab.sweep.workers
    threads = lab.train.threads or max(1, (os.cpu_count() or 1) // workers)
    train = replace(lab.train, threads=threads, progress=False)  # progress bars of several processes would mix
    attempts = lab.sweep.retries + 1
    index: dict[str, int] = {}  # run_id -> i of its "[i/n]"
    tries: dict[str, int] = {}
    running: dict[str, optuna.Trial] = {}
    failed: dict[str, str] = {}
    queued = n
    with Pool(workers, gpus) as pool:
        try:
            while queued or running:
                while queued and pool.free:
                    trial = study.ask()
                    queued -= 1
                    t = by_id[trial.suggest_categorical("run_id", list(by_id))]
                    i = index.setdefault(t.run_id, len(index) + 1)
                    k = tries[t.run_id] = tries.get(t.run_id, 0) + 1
                    print(_header(i, n, t) + (f" (attempt {k} of {attempts})" if k > 1 else ""), flush=True)
                    pool.submit(t.run_id, RunConfig(model=t.model, data=lab.data, train=train, steps=t.steps))
                    running[t.run_id] = trial
                rid, res, why = pool.wait()
                i, k = index[rid], tries[rid]
                if why is None:
                    value = _record(store, sid, lab, by_id[rid], res, f"[{i}/{n}] ")
                    study.tell(running.pop(rid), value)
                    continue
                study.tell(running.pop(rid), state=optuna.trial.TrialState.FAIL)
                again = k < attempts
                print(
                    f"    [{i}/{n}] attempt {k} of {attempts} failed: {why}; {'queued again' if again else 'left out'}",
                    flush=True,
                )
                if again:
                    study.enqueue_trial({"run_id": rid})  # a new trial of the same run, behind the queued ones
                    queued += 1
                else:
                    failed[rid] = why
        except BaseException:  # Ctrl-C (or a store error): unfinished runs leave no row and fail in the journal
            for trial in running.values():
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
    return failed
