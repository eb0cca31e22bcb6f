"""Run an isoFLOP sweep: Optuna holds the work queue, DuckDB the record, analysis the fits and figures."""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import optuna
from optuna.trial import TrialState

from mixdepth import results, usage
from mixdepth.config import ConfigError, LabConfig, TrainConfig
from mixdepth.data import load_corpus
from mixdepth.launch import check_devices, resolve_device
from mixdepth.train import RunConfig, peak_flops
from sweeps import bracket, cost, mps, provenance, queue
from sweeps.collect import collect_study
from sweeps.deadline import TIME_LIMIT, Deadline
from sweeps.journal import repair
from sweeps.paths import SweepPaths
from sweeps.plan import Trial, plan, sweep_id, table
from sweeps.pool import Pool
from sweeps.progress import Progress
from sweeps.worker import Drain, checkpointed, slot_gpus


def plan_row(sid: str, trial: Trial, lab: LabConfig) -> dict:
    """The stored row of a planned run without what training measures (``RunMetrics``, added once it ran)."""
    m = trial.model
    return {
        "run_id": trial.run_id,
        "sweep_id": sid,
        "arch": trial.arch,
        "budget": trial.budget,
        "d_model": m.d_model,
        "n_layers": m.n_layers,
        "n_heads": m.n_heads,
        "n_kv_heads": m.n_kv_heads,
        "d_ff": m.d_ff,
        "seq_len": m.seq_len,
        "vocab_size": m.vocab_size,
        "params_total": trial.params["total"],
        "params_nonembed": trial.params["nonembed"],
        "params_active": trial.params["active"],
        "flops_per_token": trial.flops_per_token,
        "flops_6nd": 6 * trial.params["nonembed"] * trial.tokens,
        "train_flops": trial.train_flops,
        "tokens": trial.tokens,
        "steps": trial.steps,
        "batch_size": lab.train.batch_size,
        "lr": lab.train.lr,
        "seed": trial.seed,
        "config": {"model": asdict(m), "data": asdict(lab.data), "train": asdict(run_train(lab, trial))},
    }


def run_train(lab: LabConfig, trial: Trial) -> TrainConfig:
    """The train section a run trains with: the sweep's, with the run's seed (initialisation and data order)."""
    return replace(lab.train, seed=trial.seed)


def payload(lab: LabConfig, sid: str, trial: Trial, extra: int | None = None) -> dict:
    """What the queue carries of a run (``queue.encode_run``); ``extra``: the number of a size added to bracket an
    optimum at its (arch, budget)."""
    run = RunConfig(model=trial.model, data=lab.data, train=run_train(lab, trial), steps=trial.steps)
    p = queue.encode_run(run, plan_row(sid, trial, lab))
    return p if extra is None else {**p, "extra": extra}


def public_config(lab: LabConfig) -> dict:
    """The merged sections as stored and shown: the storage URL without its password."""
    d = lab.sections()
    d["sweep"]["storage"] = queue.redact(d["sweep"]["storage"])
    return d


def _storage(lab: LabConfig, paths: SweepPaths) -> optuna.storages.BaseStorage:
    """``sweep.storage``, or the journal beside the database: that one is the database's alone, so the caller
    holds the database's write lock, a damaged journal is repaired or replaced (one line on stderr) and a lock
    file still there is a killed process's."""
    # ERROR: a failed trial is this runner's exception to report; Optuna's warning would repeat it with a traceback
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    s = lab.sweep
    if not s.storage:
        Path(f"{paths.journal}.lock").unlink(missing_ok=True)  # Optuna would wait 30 s for it
        if note := repair(paths.journal):  # a torn append (disk full, kill) would make every later read fail
            print(note, file=sys.stderr, flush=True)
    return queue.open_storage(
        s.storage or str(paths.journal),
        create=True,
        heartbeat_interval=s.heartbeat_interval,
        grace_period=s.grace_period,
        retries=s.retries,
    )


def _study(lab: LabConfig, storage, meta: dict) -> optuna.Study:
    """The sweep's study, created or loaded. In the journal, running trials are a killed sweep's (this process
    holds the database), so they are failed; queued ones keep their place (``queue.restart``). In an RDB shared by
    hosts only runs whose heartbeat stopped are failed (and queued again), by the drain loop."""
    study = optuna.create_study(
        study_name=meta["sweep_id"],
        storage=storage,
        direction="minimize",
        load_if_exists=True,
        sampler=optuna.samplers.RandomSampler(seed=0),
    )
    if not lab.sweep.storage:
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    return study


def _extras(study: optuna.Study, lab: LabConfig, sid: str) -> dict[str, dict]:
    """run_id -> payload (this command's) of every size added earlier to bracket an optimum, whatever its state."""
    out = {}
    for t in queue.trials(study):
        held = t.user_attrs["run"]
        if "extra" in held and (rid := queue.run_id(t)) not in out:
            trial = bracket.rebuild(lab, sid, held)
            if trial.run_id == rid:  # else a run of code that planned differently: not this sweep's any more
                out[rid] = payload(lab, sid, trial, held["extra"])
    return out


def _describe(study: optuna.Study, meta: dict, runs: dict[str, dict]) -> None:
    """(Re)write the study's description: the sweep, with the run ids it holds (planned, then added)."""
    meta["run_ids"] = list(runs)
    study.set_user_attr(queue.SWEEP_ATTR, meta)
    study.set_user_attr("run_ids", meta["run_ids"])


def run_isoflop(
    lab: LabConfig,
    preset: str,
    paths: SweepPaths,
    dry_run: bool = False,
    enqueue_only: bool = False,
    command: str = "",
    time_limit: float | None = None,
) -> int:
    """Plan the sweep, then (unless ``dry_run``) queue what the store lacks, train it, add sizes where an optimum is
    not bracketed (``sweeps.bracket``) and train those, store it all, fit and report.

    Args:
        lab: the resolved config (``load_config``).
        preset: the preset name, part of the sweep id.
        paths: the store, the Optuna journal, the checkpoints and the report folder, decided by the CLI.
        dry_run: print the plan and return.
        enqueue_only: queue the runs in ``sweep.storage`` for ``python -m sweeps worker`` and return; the
            database is not opened (``python -m sweeps collect`` fills it). Sizes to bracket optima are added only
            by a run without it on the same storage (it collects, adds them and trains them).
        command: the command line as it may be stored (``provenance.command``).
        time_limit: seconds from the command's start within which its runs must end (``sweeps.deadline``): runs
            predicted to outlast it stay queued, and the command ends without a report, exit code ``TIME_LIMIT``.
    """
    sid = sweep_id(lab, preset)
    trials, notes = plan(lab, sid)
    extra = lab.sweep.max_extra
    if dry_run:
        print(f"sweep {sid}: {len(trials)} runs, {sum(t.train_flops for t in trials):.3g} training FLOPs")
        print(table(trials))
        for n in notes:
            print("note:", n)
        if extra:
            print(
                f"then up to sweep.max_extra={extra} sizes per (arch, budget) may be added to bracket its optimum,"
                " where its isoFLOP vertex falls outside the sampled sizes"
            )
        if paths.db.is_file():
            for line in cost.lines(trials, lab.train.batch_size, paths.db):
                print(line)
        return 0
    meta = {
        "sweep_id": sid,
        "name": lab.sweep.name,
        "preset": preset,
        "config": public_config(lab),
        "run_ids": [t.run_id for t in trials],
        "provenance": {
            "planned": len(trials),
            "version": provenance.version(),
            "commit": provenance.commit(),
            "command": command,
        },
    }
    runs = {t.run_id: payload(lab, sid, t) for t in trials}
    if enqueue_only:  # the workers' hosts check their devices
        if not lab.sweep.storage:
            raise ConfigError("--enqueue-only queues runs for workers on other hosts: set sweep.storage to a URL")
        study = _study(lab, _storage(lab, paths), meta)
        runs |= _extras(study, lab, sid)
        _describe(study, meta, runs)
        k = queue.enqueue(study, list(runs.values()))
        where = queue.redact(lab.sweep.storage)
        print(f"sweep {sid}: {len(trials)} runs planned, {k} queued in {where}")
        print(f"train them on any host: python -m sweeps worker --storage {where} --sweep {sid}")
        if extra:
            print(
                f"sizes that bracket optima (up to sweep.max_extra={extra} per arch and budget) are added only by"
                " python -m sweeps isoflop on this storage without --enqueue-only: run it, with these settings, once"
                " the workers are done (it collects their runs, then adds and trains the sizes)"
            )
        return 0
    check_devices(lab.train)  # more devices than this host has, a launcher's other world size: before any write
    gpus = slot_gpus(lab.train, lab.sweep.workers, lab.sweep.workers_per_gpu)
    load_corpus(lab.data)  # fail on a bad corpus before the database is touched; fills the cache workers read
    storage = _storage(lab, paths) if lab.sweep.storage else None  # a bad URL fails before the database is made
    with (
        mps.serve(lab.sweep.mps, gpus) as how,
        results.writer(paths.db) as store,  # the one writer of this db
        _workers(lab, gpus) as pool,
    ):
        if how == "started":
            print(
                f"NVIDIA MPS started for the {len(gpus)} workers: runs that share a GPU run at once"
                " (sweep.mps=never: time-sliced)"
            )
        study = _study(lab, storage or _storage(lab, paths), meta)
        sharing = "mps" if how in ("started", "running") else how
        return _run(lab, paths, store, study, meta, runs, gpus, sharing, pool, time_limit)


def _workers(lab: LabConfig, gpus: list[str]):
    """The sweep's worker processes, spawned now (under the MPS just started: their imports overlap the sweep's
    set-up) and kept across its drains (no new processes for the sizes added to bracket optima); nothing when it
    trains in this process (``sweep.workers`` 1)."""
    return Pool(lab.sweep.workers, gpus).start() if lab.sweep.workers > 1 else nullcontext()


def n_gpus(train: TrainConfig, slots: list[str]) -> int:
    """The distinct GPUs a sweep's runs train on: its slots' (``slot_gpus``), else one run's devices; 0 on CPU."""
    if slots:
        return len({g for s in slots for g in s.split(",")})
    return train.devices * train.num_nodes if resolve_device(train)[0] == "gpu" else 0


def _gave_up(failed: dict[str, str], attempts: int) -> str:
    """The sweep's one error line for runs left out after their last attempt failed."""
    n, s = len(failed), (lambda k: "s" * (k > 1))
    return (
        f"error: {n} run{s(n)} failed after {attempts} attempt{s(attempts)} (run_id {', '.join(failed)}):"
        f" {next(iter(failed.values()))}; rerun the same command to retry {'them' if n > 1 else 'it'}"
    )


def _run(
    lab: LabConfig,
    paths: SweepPaths,
    store: results.Writer,
    study: optuna.Study,
    meta: dict,
    runs: dict[str, dict],
    gpus,
    sharing: str,
    pool: Pool | None,
    time_limit: float | None,
) -> int:
    sid = meta["sweep_id"]
    shared = bool(lab.sweep.storage)  # an RDB other hosts train from; the journal is this database's alone
    runs = {**runs, **_extras(study, lab, sid)}  # the plan, and the sizes added by an earlier run of the sweep
    planned = meta["provenance"]["planned"]
    with store.session() as con:
        results.add_sweep(con, sid, lab.sweep.name, meta["preset"], meta["config"], meta["provenance"])
        if shared:  # runs other hosts finished: the storage holds them, the database not yet
            collect_study(con, study, meta)
        done = results.finished_run_ids(con)
    _describe(study, meta, runs)
    queue.restart(study, runs, done)
    todo = [p for rid, p in runs.items() if rid not in done]
    added = f", {len(runs) - planned} added to bracket optima" if len(runs) > planned else ""
    print(
        f"sweep {sid}: {planned} runs planned{added}, {len(runs) - len(todo)} already in {paths.db}, {len(todo)} to run"
    )
    queue.enqueue(study, todo, skip_finished=shared)  # with the journal the database is the record: what it lacks runs

    used = usage.Usage(sid, lab.sweep.workers, n_gpus(lab.train, gpus), sharing=sharing,
                       commit=meta["provenance"]["commit"], command=meta["provenance"]["command"])  # fmt: skip
    deadline = Deadline(used.started, time_limit) if time_limit else None
    measured: list[dict] = []

    def record_usage(stopped: str | None = None) -> None:  # at the report (which then states it), or at a stop
        if used.runs or used.stopped:
            if used.gpus and used.peak is None:  # no run finished here to give its peak: the device's own
                used.peak = peak_flops(lab.train, *resolve_device(lab.train))
            measured.append(used.row(stopped=stopped))
            with store.session() as con:
                results.put_usage(con, measured[-1])

    queued = len(todo)

    def bracket_round(only: set[tuple[str, float]] | None = None, collect: bool = False) -> tuple[int, list[str]]:
        """Queue the sizes that bracket optima (of the ``only`` (arch, budget)s); the number queued and the lines of
        those still outside that get none. ``collect``: first store what other hosts finished."""
        nonlocal queued
        with store.session() as con:
            if shared and collect:
                collect_study(con, study, meta)  # what other hosts finished meanwhile
            by_key = bracket.stored(con, sid)
        new, left = bracket.next_sizes(lab, sid, by_key, runs, only) if lab.sweep.max_extra else ([], [])
        for trial, k, line in new:
            bar.line(line)
            runs[trial.run_id] = payload(lab, sid, trial, k)
        if new:
            _describe(study, meta, runs)
            queued += queue.enqueue(study, [runs[t.run_id] for t, _, _ in new], skip_finished=shared)
        return len(new), left

    def add(_study, row: dict, res, counted: int) -> None:
        with store.session() as con:
            results.add_run(con, {**row, **asdict(res.metrics)}, res.curve)
            used.add(res.metrics, row["tokens"], row["train_flops"], row["steps"], res.resumed_step, counted)
            results.put_usage(con, used.row(stopped="interrupted"))  # until the report: a killed command keeps its time
        bracket_round({(row["arch"], row["budget"])})  # its (arch, budget) may be complete: its sizes start now

    workers = lab.sweep.workers
    host = {}
    if workers > 1:  # progress bars of several processes would mix
        host = {"threads": lab.train.threads or max(1, (os.cpu_count() or 1) // workers), "progress": False}
    start = time.perf_counter()
    used.training = time.time()
    failed: dict[str, str] = {}
    try:
        with Progress() as bar:  # one bar over every drain: the runs added to bracket optima grow its total
            if bar.shown:  # the sweep's bar replaces Lightning's per-run one (two bars on one terminal overwrite)
                host["progress"] = False
            while True:  # train what is queued, adding sizes where a finished (arch, budget)'s optimum is outside;
                # then once more over every (arch, budget), with what other hosts finished, until none is added
                failed |= Drain(
                    studies=[study],
                    slots=workers,
                    gpus=gpus,
                    train=host,
                    ckpt_root=paths.checkpoints,
                    log_root=paths.logs,
                    retries=lab.sweep.retries,
                    on_done=add,
                    on_stop=used.cut,
                    inline=workers == 1 and deadline is None,  # a time limit stops runs: in a worker process
                    progress=bar,
                    pool=pool,
                    deadline=deadline,
                ).run()
                added, left = bracket_round(collect=True)
                if not added:
                    break
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the runs trained so far used the devices too; their share is kept
        used.trained = time.time()
        record_usage(stopped="interrupted")
        raise
    used.trained = time.time()
    waiting = queue.waiting([study]) if deadline else []  # none would have ended in time
    held = len(waiting)
    print(f"trained {queued - len(failed) - held} runs in {time.perf_counter() - start:.0f}s")
    gave_up = _gave_up(failed, lab.sweep.retries + 1) if failed else ""
    if held:
        record_usage(stopped="time limit")
        for row in measured:
            print("\n".join(usage.lines(row)))
        print(deadline.held(waiting, queue.finished_rows([study]), checkpointed(host, paths.checkpoints)))
        if gave_up:
            print(gave_up, file=sys.stderr)
        return 1 if gave_up else TIME_LIMIT
    for line in left:
        print(f"not bracketed: {line}")
    with store.session() as con:
        inside = bracket.inside(lab, bracket.stored(con, sid))
    print(
        "isoFLOP vertex inside the sampled sizes: "
        + ", ".join(f"{arch} at {n} of {len(lab.sweep.budgets)} budgets" for arch, n in inside.items())
    )
    with store.session() as con:
        n_div, n_ok = con.execute(
            "SELECT count(*) FILTER (WHERE status = 'diverged'), count(*) FILTER (WHERE status = 'ok')"
            " FROM runs WHERE sweep_id = ?",
            [sid],
        ).fetchone()
    if n_div:
        why = f"a loss not finite, or the training objective above {results.BLOW_UP:g} x its first"
        print(f"{n_div} of {n_div + n_ok} runs diverged ({why}): stored with NULL losses, not fitted")
    if not n_ok:
        print(
            gave_up or f"error: no run of sweep {sid} has a loss to fit (every run diverged); lower train.lr",
            file=sys.stderr,
        )
        return 1

    from analysis.pipeline import run_all

    written = run_all(store, sid, paths.reports / sid, before_report=record_usage, processes=None)
    for row in measured:
        print("\n".join(usage.lines(row)))
    print(f"results: {paths.db}")
    for name, p in written.items():
        print(f"{name}: {p}")
    if gave_up:
        print(gave_up, file=sys.stderr)
        return 1
    return 0
