"""Train the queued runs of one or more sweeps until none is left: the loop of ``python -m sweeps isoflop`` (one
host, each result stored in its database as it arrives) and of ``python -m sweeps worker`` (any host, results
through the storage only; it never opens a database).

A run whose fit raises or whose training process dies fails that attempt and is queued again, at most ``retries``
times; one that ran out of memory beside other runs on its GPU is queued to train alone: it starts when nothing else
trains on the host, and nothing else starts while it does. On an RDB storage a run whose host stopped beating
(killed, preempted, network gone) is failed after the grace period by whichever worker looks next, and Optuna's
retry callback queues it again.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

from mixdepth.checkpoints import saved_step
from mixdepth.config import ConfigError, TrainConfig
from mixdepth.launch import check_devices, cluster, resolve_device
from sweeps import queue
from sweeps.deadline import TIME_LIMIT, Deadline
from sweeps.pool import Inline, Pool, Ranks, follow
from sweeps.progress import Progress

IDLE_POLL_S = 2.0  # how often an idle worker looks for runs other hosts may hand back


def header(row: dict[str, Any]) -> str:
    """What a run is, in the line printed when it starts."""
    return (
        f"{row['arch']} C={row['budget']:.2e} d_model={row['d_model']} layers={row['n_layers']}"
        f" params={row['params_nonembed']:,} tokens={row['tokens']:,} steps={row['steps']}"
    )


class _Heartbeat(threading.Thread):
    """Records a heartbeat of every running trial each interval, while training holds the main thread."""

    def __init__(self, interval: int, running: dict):
        super().__init__(daemon=True)
        self.interval, self.running = interval, running
        self.stopped = threading.Event()

    def run(self) -> None:
        warned = False
        while not self.stopped.wait(self.interval):
            for study, trial, _ in list(self.running.values()):
                try:
                    study._storage.record_heartbeat(trial._trial_id)
                except Exception as e:  # a storage hiccup: the next beat may pass; past the grace the run is retried
                    if not warned:
                        print(f"warning: heartbeat failed ({str(e).splitlines()[0]})", file=sys.stderr, flush=True)
                        warned = True


@dataclass
class Drain:
    """One host's share of the work.

    Attributes:
        studies: the sweeps to train (their queued trials, oldest sweep first).
        slots: runs trained at once (one per GPU, or CPU processes); 1 with ``inline`` trains in this process.
        gpus: CUDA_VISIBLE_DEVICES of each slot ([] for none).
        train: this host's ``train`` keys over the queued ones (hardware, threads, progress, checkpoints).
        ckpt_root: where runs that checkpoint keep ``<run_id>/``; None: nowhere.
        log_root: where runs with a ``train.logger`` write ``<sweep_id>/<run_id>/``; None: ./lightning_logs.
        retries: attempts after the first for a run whose fit raised or whose process died.
        on_done: called with (study, row, RunResult, step) once the storage holds a finished run (the local sweep
            stores it in its database), ``step`` the one up to which earlier commands counted its training FLOPs
            or it resumed from (``queue.COUNTED``); then the run's checkpoints are dropped (or its last one kept).
        on_stop: called with the seconds a run trained, why it ended unfinished ("time limit"; "interrupted":
            Ctrl-C, SIGTERM, a fault; "failed": an attempt that failed) and the training FLOPs its newest checkpoint
            keeps of them.
        inline: train in this process (one slot): exceptions propagate as they would without a queue.
        ranks: (TCP store, number of other ranks) of a launch with several ranks (srun, torchrun) when this is its
            rank 0: each run is trained in this process together with the other ranks (``pool.Ranks``).
        progress: the bar the lines of runs starting and ending are printed above; its total is set to what is
            left as runs start and end, so one bar can span several drains (the caller closes it). Default: lines only.
        pool: worker processes the caller holds across drains (started early, kept warm between them); None: the
            drain's own, by ``slots``, ``inline`` and ``ranks``.
        deadline: the command's time limit: only runs predicted to end within it start (``sweeps.deadline``), runs
            of worker processes still training at it are stopped and queued again, and the drain ends once none of
            the queued ones would end in time and none trains here. None: no limit.
    """

    studies: list[optuna.Study]
    slots: int = 1
    gpus: list[str] = field(default_factory=list)
    train: dict[str, Any] = field(default_factory=dict)
    ckpt_root: Path | None = None
    log_root: Path | None = None
    retries: int = 1
    on_done: Callable[[optuna.Study, dict, Any, int], None] | None = None
    on_stop: Callable[[float, str, float], None] | None = None
    inline: bool = False
    ranks: tuple[Any, int] | None = None
    progress: Progress = field(default_factory=lambda: Progress(shown=False))
    pool: Pool | None = None
    deadline: Deadline | None = None

    def run(self) -> dict[str, str]:
        """Train until no run of the studies is queued or running anywhere (with a ``deadline``: until none of the
        queued ones would end in time and none trains here); returns the runs given up on here: run_id -> why their
        last attempt failed."""
        n = sum(len(queue.trials(s, TrialState.WAITING)) for s in self.studies)
        running: dict[str, tuple[optuna.Study, optuna.Trial, Any]] = {}  # run_id -> study, trial, RunConfig
        index: dict[str, int] = {}
        # run_id -> when it was handed to the pool, the step this command counts its FLOPs from (its checkpoint's
        # or, if more, the one earlier commands counted up to)
        since: dict[str, tuple[float, int]] = {}
        failed: dict[str, str] = {}
        beat = None
        if beats := [b for s in self.studies if (b := queue.heartbeat(s._storage))]:
            beat = _Heartbeat(min(beats), running)
            beat.start()
        self.progress.left(*self._left(running))
        try:
            pool = self.pool or (
                Ranks(*self.ranks) if self.ranks else Inline() if self.inline else Pool(self.slots, self.gpus)
            )
            if isinstance(pool, Pool) and hasattr(signal, "SIGUSR1"):
                # SLURM's --signal=USR1 reaches every process of the step: the training processes save and requeue
                # (Lightning), this one must survive it (the default kills). A Python handler, not SIG_IGN: the
                # spawned processes start with the default, where Lightning installs its own.
                signal.signal(signal.SIGUSR1, lambda signum, frame: None)
            with nullcontext(pool) if self.pool else pool:  # the caller's pool is the caller's to end
                try:
                    while True:
                        while pool.free and not self._alone(running) and (got := self._next(not running)):
                            study, trial = got
                            rid = queue.run_id(trial)
                            running[rid] = (study, trial, None)  # from here a stop ends it as interrupted (below)
                            i = index.setdefault(rid, len(index) + 1)
                            k = self._attempt(study, rid)
                            note = f" (attempt {k} of {self.retries + 1})" if k > 1 else ""
                            self.progress.line(f"[{i}/{max(n, i)}] {header(trial.user_attrs['run']['row'])}{note}")
                            run = queue.decode_run(trial.user_attrs["run"], self.train, self.ckpt_root, self.log_root)
                            running[rid] = (study, trial, run)
                            since[rid] = time.monotonic(), max(resumes_at(run), trial.user_attrs.get(queue.COUNTED, 0))
                            pool.submit(rid, run)
                        self.progress.left(*self._left(running))
                        if not running:
                            if self.deadline is not None and self._queued():  # none would end in time
                                return failed
                            if not self._others_running():
                                return failed
                            time.sleep(IDLE_POLL_S)
                            continue
                        ended = pool.wait(self._wait_s(beat is not None))
                        if ended is not None:
                            self._ended(*ended, running, index, n, failed, since)
                        elif self.deadline is not None and self.deadline.left() <= 0:
                            self._stop(pool, running, index, n, since)
                except BaseException:  # Ctrl-C, SIGTERM, a store error: unfinished runs leave no row, queued again
                    for rid, (study, trial, run) in running.items():
                        counted = 0
                        if rid in since:
                            counted = self._cut(
                                trial, run, time.monotonic() - since[rid][0], "interrupted", since[rid][1]
                            )
                        queue.interrupted(study, trial, counted=counted)
                    raise
        finally:
            if beat:
                beat.stopped.set()

    def _wait_s(self, beating: bool) -> float | None:
        """How long to wait for a run to end: until the next heartbeat, or the time limit, whichever comes first."""
        waits = ([IDLE_POLL_S] if beating else []) + ([max(0.0, self.deadline.left())] if self.deadline else [])
        return min(waits, default=None)

    def _stop(self, pool: Pool, running: dict, index: dict, n: int, since: dict) -> None:
        """The time limit has passed with runs still training here: stop them and queue each again, predicted at
        least as long as it trained unless it resumes from a checkpoint (``sweeps.deadline``)."""
        for rid, seconds in pool.stop():
            study, trial, run = running.pop(rid)
            counted = self._cut(trial, run, seconds, "time limit", since[rid][1])
            queue.interrupted(study, trial, stopped_s=None if run.ckpt_dir else seconds, counted=counted)
            i = index[rid]
            line = f"still training at the time limit after {seconds:.0f}s: stopped, queued again"
            self.progress.line(f"    [{i}/{max(n, i)}] {line}")

    def _cut(self, trial: optuna.Trial, run: Any, seconds: float, why: str, step: int) -> int:
        """Tell ``on_stop`` of a run stopped unfinished after ``seconds``, with the FLOPs its checkpoints kept of
        them: from ``step``, counted when it started here (``queue.COUNTED``), to its newest checkpoint (none before
        its RunConfig ``run`` was); returns the step its FLOPs are now counted up to."""
        newest = resumes_at(run) if run is not None else 0
        if self.on_stop is not None:
            row = trial.user_attrs["run"]["row"]
            self.on_stop(seconds, why, row["train_flops"] * max(0, newest - step) / row["steps"])
        return max(step, newest)

    def _next(self, alone: bool) -> tuple[optuna.Study, optuna.Trial] | None:
        """A queued run to start here; ``alone``: nothing trains here, so one queued to train alone may start."""
        order = None
        if self.deadline is not None:  # predicted from every finished run of the studies, this drain's included
            order = self.deadline.order(queue.finished_rows(self.studies), checkpointed(self.train, self.ckpt_root))
        for study in self.studies:
            optuna.storages.fail_stale_trials(study)  # RDB: runs of dead hosts, queued again by the retry callback
            if (trial := queue.pop(study, order, alone)) is not None:
                return study, trial
        return None

    @staticmethod
    def _alone(running: dict) -> bool:
        """Whether a run that must train alone trains here."""
        return any(trial.user_attrs.get("alone") for _, trial, _ in running.values())

    def _shared(self) -> bool:
        """Whether slots of this host share a GPU (``sweep.workers_per_gpu``)."""
        return len(set(self.gpus)) < len(self.gpus)

    def _queued(self) -> bool:
        return any(queue.trials(s, TrialState.WAITING) for s in self.studies)

    def _left(self, running: dict) -> tuple[float, int]:
        """Training FLOPs and number of the runs left: running here, or queued for any host."""
        rows = [attrs["run"]["row"] for attrs in queue.waiting(self.studies)]
        rows += [trial.user_attrs["run"]["row"] for _, trial, _ in running.values()]
        return sum(r["train_flops"] for r in rows), len(rows)

    def _others_running(self) -> bool:
        """Whether another host still trains a run of the studies (it may die, and the run come back)."""
        return any(queue.trials(s, TrialState.RUNNING) for s in self.studies)

    @staticmethod
    def _attempt(study: optuna.Study, rid: str) -> int:
        """This attempt's number: 1 + the run's failed ones (a run stopped by a time limit or Ctrl-C has not failed)."""
        return 1 + sum(queue.run_id(t) == rid and queue.attempt_failed(t) for t in queue.trials(study, TrialState.FAIL))

    def _ended(
        self, rid: str, res: Any, why: str | None, running: dict, index: dict, n: int, failed: dict, since: dict
    ) -> None:
        study, trial, run = running.pop(rid)
        i = index[rid]
        if why is None:
            queue.finish(trial, res.metrics, res.curve)
            row = {**trial.user_attrs["run"]["row"]}
            if self.on_done is not None:
                self.on_done(study, row, res, since[rid][1])
            self.progress.finished(row["train_flops"])
            m = res.metrics
            loss = "diverged (no loss to fit)" if m.val_loss is None else f"{m.val_loss:.4f}"
            self.progress.line(f"    [{i}/{max(n, i)}] val_loss={loss} ({m.wall_s:.1f}s, {m.tokens_per_s:,.0f} tok/s)")
            if run.ckpt_dir is not None:  # stored: its checkpoints are no longer needed (or its last one is kept)
                from mixdepth.checkpoints import finish_checkpoints

                finish_checkpoints(Path(run.ckpt_dir), run.train.keep_ckpt)
            return
        k = self._attempt(study, rid)
        queue.fail(trial)
        counted = self._cut(trial, run, time.monotonic() - since[rid][0], "failed", since[rid][1])
        again = k <= self.retries
        alone = again and self._shared() and "out of memory" in why.lower() and not trial.user_attrs.get("alone")
        then = "queued again to train alone" if alone else "queued again" if again else "left out"
        self.progress.line(f"    [{i}/{max(n, i)}] attempt {k} of {self.retries + 1} failed: {why}; {then}")
        if again:
            queue.requeue(study, trial, alone, counted=counted)
        else:
            failed[rid] = why


def slot_gpus(train: TrainConfig, workers: int, per_gpu: int = 1) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each training slot: ``train.devices`` GPUs each when more than one run trains at
    once on GPUs, else none; ``per_gpu`` consecutive slots share their GPUs (small runs side by side). Called after
    ``launch.check_devices`` and before the store or the storage is opened (a dry run, which trains nothing, plans
    GPU presets on any machine)."""
    if workers == 1 or resolve_device(train)[0] != "gpu":
        return []
    n, per = torch.cuda.device_count(), train.devices
    groups = -(-workers // per_gpu)
    if groups * per > n:
        if per_gpu > 1:
            need = f"at sweep.workers_per_gpu={per_gpu} needs {groups * per} GPUs"
        else:
            need = f"needs {'one GPU' if per == 1 else f'{per} GPUs'} each"
        raise ConfigError(f"sweep.workers={workers} {need}, but {n} are visible")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(n)]
    return [",".join(ids[(i // per_gpu) * per : (i // per_gpu + 1) * per]) for i in range(workers)]


def resumes_at(run: Any) -> int:
    """The step of the checkpoint a RunConfig ``run`` would resume from (0: none, or it keeps none)."""
    return saved_step(Path(run.ckpt_dir)) if run.ckpt_dir else 0


def checkpointed(train: dict[str, Any], ckpt_root: Path | None) -> Callable[[dict], tuple[int, int]]:
    """``saved(attrs)`` of ``sweeps.deadline`` on a host with these ``train`` keys and checkpoint root (``Drain``):
    a queued run's checkpoint interval in steps (0: it keeps none here) and the step it would resume from."""

    def saved(attrs: dict) -> tuple[int, int]:
        run = queue.decode_run(attrs["run"], train, ckpt_root)
        return (run.train.ckpt_every if run.ckpt_dir else 0), resumes_at(run)

    return saved


# A worker's own train keys, over a queued run's: where and how it trains, never what.
HOST_KEYS = (
    "accelerator",
    "threads",
    "progress",
    "logger",
    "compile_mode",
    "compile_scope",
    "graph_step",
    "devices",
    "num_nodes",
    "strategy",
    "ckpt_dir",
    "keep_ckpt",
)


def serve(where: str, sweep: str | None, workers: int, overrides: list[str], time_limit: float | None = None) -> int:
    """``python -m sweeps worker``: train the queued runs of the storage's sweeps (or of ``sweep``) until none
    is left anywhere, ``workers`` at once (0: one per visible GPU, else one); results go through the storage.
    With ``time_limit`` (seconds from the command's start) only runs predicted to end within it start
    (``sweeps.deadline``); the worker ends when none of the queued ones would, exit code ``TIME_LIMIT``.

    Raises:
        ConfigError: a bad override or more workers than GPUs; StorageError: the storage or the sweep.
    """
    from mixdepth.config import train_overrides
    from mixdepth.usage import process_start
    from sweeps.collect import selected

    deadline = Deadline(process_start(), time_limit) if time_limit else None

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    host = train_overrides(overrides, HOST_KEYS)
    if not queue.is_url(where):
        raise queue.StorageError(f"--storage {where} is not a database URL (workers share an RDB, e.g. PostgreSQL)")
    with queue.closing(queue.open_storage(where, create=False)) as found:
        chosen = selected(found, where, sweep)
    studies = []
    for name, meta in chosen.items():
        s = meta["config"]["sweep"]
        storage = queue.open_storage(
            where,
            create=False,
            heartbeat_interval=s["heartbeat_interval"],
            grace_period=s["grace_period"],
            retries=s["retries"],
        )
        studies.append(queue.load(storage, name))
    for meta in chosen.values():  # this host trains every chosen sweep's runs: their devices, their logger's package
        check_devices(TrainConfig(**{**meta["config"]["train"], **host}))
    train = TrainConfig(**{**next(iter(chosen.values()))["config"]["train"], **host})
    if (c := cluster()).external and c.world_size > 1:  # one run over every rank of this launch
        from datetime import timedelta

        from torch.distributed import TCPStore

        # the port beside the one the run's process group meets on; runs may wait long for each other
        store = TCPStore(c.main_address, c.main_port + 1, c.world_size, c.global_rank == 0, timedelta(days=7))
        if c.global_rank != 0:
            follow(store)
            return 0
        workers, ranks = 1, (store, c.world_size - 1)
    else:
        ranks = None
    if workers == 0 and ranks is None:
        gpu = train.accelerator != "cpu" and torch.cuda.is_available()
        workers = max(1, torch.cuda.device_count() // train.devices) if gpu else 1
    gpus = slot_gpus(train, workers)
    if workers > 1:
        host = {"threads": train.threads or max(1, (os.cpu_count() or 1) // workers), "progress": False, **host}
    n_queued = sum(len(queue.trials(s, TrialState.WAITING)) for s in studies)
    me = f"{socket.gethostname()}:{os.getpid()}"
    print(f"worker {me}: {len(studies)} sweep(s), {n_queued} runs queued, {workers} at once", flush=True)
    retries = max(m["config"]["sweep"]["retries"] for m in chosen.values())
    start = time.perf_counter()
    with Progress() as bar:
        if bar.shown:  # the worker's bar replaces Lightning's per-run one: both would draw on this terminal
            host = {"progress": False, **host}
        ckpt_root = Path("checkpoints").absolute()
        failed = Drain(
            studies=studies,
            slots=workers,
            gpus=gpus,
            train=host,
            ckpt_root=ckpt_root,
            log_root=Path("logs").absolute(),
            retries=retries,
            ranks=ranks,
            progress=bar,
            deadline=deadline,
        ).run()
    waiting = queue.waiting(studies) if deadline else []
    held = len(waiting)
    if held:
        line = deadline.held(waiting, queue.finished_rows(studies), checkpointed(host, ckpt_root))
        print(f"{line}; done in {time.perf_counter() - start:.0f}s")
    else:
        print(f"no runs left: done in {time.perf_counter() - start:.0f}s")
    if failed:
        print(f"error: {len(failed)} run(s) failed on this worker: {next(iter(failed.values()))}", file=sys.stderr)
        return 1
    return TIME_LIMIT if held else 0
