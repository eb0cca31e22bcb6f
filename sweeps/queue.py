"""A sweep's work queue in an Optuna storage: the journal file beside the database (one host, the default) or an
RDB such as PostgreSQL (many hosts, with Optuna's heartbeat).

Each queued trial carries its whole run (``run``: the RunConfig, ``row``: the runs row it will become, and for a
size added to bracket an optimum ``extra``: its number at that arch and budget), so a worker anywhere trains it
without the config folder or the database; a finished trial carries its ``result`` (metrics and curve), which
whoever holds the database collects, and its val_loss as the trial's value. Beside them each trial shows what it is
as flat user attributes (``ATTRS``: arch, budget, params, tokens, d_model, n_layers, seed, extra), which
optuna-dashboard lists. The study's ``mixdepth`` attribute describes the sweep (id, name, preset, config with the
storage password hidden, run_ids planned and added, provenance, heartbeat settings).
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import optuna
from optuna.trial import TrialState

from mixdepth.config import DataConfig, TrainConfig
from mixdepth.results import RunMetrics
from sweeps.deadline import STOPPED_S
from sweeps.journal import storage as journal_storage

# Optuna has marked its heartbeat API (heartbeat_interval, grace_period, the retry callback, fail_stale_trials)
# experimental since 2.8: it is the API that retries a dead host's runs, so its warnings say nothing to a user
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

SWEEP_ATTR = "mixdepth"  # the study attribute that marks a mixdepth sweep and describes it
# a queued trial's attribute: the step up to which the commands that trained its run so far counted its training
# FLOPs (their finished share, and what a stop kept in checkpoints, ``mixdepth.usage``). A later command counts
# only the steps past it: a run whose checkpoint was lost since (another machine, a cleaned folder) trains those
# again, but each step counts once over a sweep's commands.
COUNTED = "counted_step"


class StorageError(RuntimeError):
    """A storage problem with a one-line message meant for the user (never with a password in it)."""


def is_url(where: str) -> bool:
    return "://" in where


def redact(where: str) -> str:
    """``where`` as it may be shown or stored: an RDB URL without its password."""
    if not is_url(where):
        return where
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(where).render_as_string(hide_password=True)
    except ArgumentError:
        return where.split("://", 1)[0] + "://***"


def _driver_url(url: str) -> str:
    """postgresql:// and postgres:// mean psycopg 3 here (SQLAlchemy's default, psycopg2, is not a dependency)."""
    scheme, rest = url.split("://", 1)
    return f"postgresql+psycopg://{rest}" if scheme in ("postgresql", "postgres") else url


def _rdb_error(url: str, e: BaseException) -> StorageError:
    e = e.__cause__ or e if isinstance(e, optuna.exceptions.StorageInternalError) else e  # Optuna wraps the driver's
    text = str(getattr(e, "orig", None) or e).strip().splitlines()
    why = text[0] if text else type(e).__name__
    if (password := _password(url)) and password in why:  # a driver may echo its connection string
        why = why.replace(password, "***")
    return StorageError(f"cannot open storage {redact(url)}: {why}")


def _password(url: str) -> str | None:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).password
    except Exception:
        return None


def storage_fault(e: BaseException, where: str) -> str | None:
    """The one line for an RDB storage that failed while a command ran (server gone, connection lost), or None
    when ``e`` is no storage fault."""
    import sqlalchemy.exc

    if isinstance(e, (sqlalchemy.exc.OperationalError, optuna.exceptions.StorageInternalError)):
        return str(_rdb_error(where, e)).replace("cannot open storage", "storage", 1)
    return None


def open_storage(
    where: str, *, create: bool, heartbeat_interval: int = 60, grace_period: int = 180, retries: int = 1
) -> optuna.storages.BaseStorage:
    """The Optuna storage at ``where``: a journal file path, or an RDB URL (any SQLAlchemy URL Optuna accepts;
    ``postgresql://`` means psycopg 3) with heartbeats and stale runs queued again at most ``retries`` times.

    Args:
        where: a journal path or a URL.
        create: whether a sweep is being planned into it (make the journal or Optuna's tables); readers and
            workers never create anything, so a wrong URL or path writes nothing.

    Raises:
        StorageError: unknown scheme, missing driver, unreachable host, refused login, missing journal, ...
    """
    if not is_url(where):
        path = Path(where).expanduser()
        if not create and not path.exists():
            raise StorageError(f"storage {path} does not exist (give a journal file or a database URL)")
        return journal_storage(path)
    import sqlalchemy.exc

    url = _driver_url(where)
    engine = {"pool_pre_ping": True}  # a connection the server dropped is replaced, not an error mid-sweep
    if url.startswith("postgresql+psycopg://"):
        engine["connect_args"] = {"connect_timeout": 10}  # libpq waits forever for a silent host otherwise
    try:
        return optuna.storages.RDBStorage(
            url,
            engine_kwargs=engine,
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
            skip_table_creation=not create,
            # Optuna's RetryFailedTrialCallback, renamed in 4.9
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=retries),
        )
    except sqlalchemy.exc.NoSuchModuleError:
        raise StorageError(f"unknown storage URL scheme {where.split('://', 1)[0]!r} in {redact(where)}") from None
    except (sqlalchemy.exc.ArgumentError, ValueError) as e:
        raise StorageError(f"bad storage URL {redact(where)}: {str(e).splitlines()[0]}") from None
    except ImportError as e:
        raise StorageError(
            f"storage {redact(where)} needs {e.name or 'a driver'}: pip install 'mixdepth[postgres]'"
        ) from None
    except sqlalchemy.exc.ProgrammingError:  # skip_table_creation on a database without Optuna's tables
        raise StorageError(f"storage {redact(where)} holds no mixdepth sweeps (no Optuna tables)") from None
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
        raise _rdb_error(url, e) from None


S = TypeVar("S", bound="optuna.storages.BaseStorage | None")


@contextmanager
def closing(storage: S) -> Iterator[S]:
    """``storage`` for a with-block; at its end an RDB storage's pooled connections go back to the server rather than
    when the garbage collector gets to them: a process that opens storages again and again (``status`` polled in a
    loop) held dozens at once, and a server refuses connections past its ``max_connections``. Journals and None need
    nothing."""
    try:
        yield storage
    finally:
        if isinstance(storage, optuna.storages.RDBStorage):
            storage.engine.dispose()


def sweeps_in(storage: optuna.storages.BaseStorage) -> dict[str, dict]:
    """study name -> its ``mixdepth`` description, for every mixdepth sweep in the storage."""
    import sqlalchemy.exc

    try:
        studies = storage.get_all_studies()
    except sqlalchemy.exc.ProgrammingError:  # an empty database: Optuna's tables were never made
        return {}
    return {s.study_name: s.user_attrs[SWEEP_ATTR] for s in studies if SWEEP_ATTR in s.user_attrs}


def load(storage: optuna.storages.BaseStorage, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=storage)


def encode_run(run: Any, row: dict[str, Any]) -> dict[str, Any]:
    """What a queued trial carries: the RunConfig as plain data and the row it will become."""
    return {
        "run": {"model": asdict(run.model), "data": asdict(run.data), "train": asdict(run.train), "steps": run.steps},
        "row": row,
    }


def decode_run(payload: dict[str, Any], train: dict[str, Any], ckpt_root: Path | None, log_root: Path | None = None):
    """The RunConfig of a queued trial, with this worker's ``train`` keys (hardware, checkpoints, logger) over the
    queued ones; its checkpoint folder is ``<train.ckpt_dir or ckpt_root>/<run_id>`` when the run checkpoints, its
    logger's ``<log_root>/<sweep_id>/<run_id>`` when it logs."""
    from mixdepth.models import MODELS
    from mixdepth.train import RunConfig

    r, row = payload["run"], payload["row"]
    model = MODELS[r["model"]["arch"]][0](**r["model"])
    t = TrainConfig(**{**r["train"], **train})
    root = Path(t.ckpt_dir).expanduser().absolute() if t.ckpt_dir else ckpt_root
    ckpt = str(root / row["run_id"]) if root is not None and t.ckpt_every else None
    logs = str(log_root / row["sweep_id"] / row["run_id"]) if log_root is not None and t.logger != "none" else None
    return RunConfig(model, DataConfig(**r["data"]), t, r["steps"], ckpt_dir=ckpt, log_dir=logs)


def run_id(trial: optuna.trial.FrozenTrial | optuna.Trial) -> str:
    return trial.user_attrs["run"]["row"]["run_id"]


def heartbeat(storage: optuna.storages.BaseStorage) -> int | None:
    """Seconds between heartbeats when the storage keeps them (RDB), else None."""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return storage.get_heartbeat_interval() if is_heartbeat_enabled(storage) else None


def trials(study: optuna.Study, *states: TrialState) -> list[optuna.trial.FrozenTrial]:
    """The study's trials in ``states`` that carry a run (every trial a mixdepth sweep makes)."""
    return [t for t in study.get_trials(deepcopy=False, states=states or None) if "run" in t.user_attrs]


# The flat user attributes of a queued trial: name -> the runs column it shows (``extra`` is the payload's own).
ATTRS = {
    "arch": "arch",
    "budget": "budget",
    "params": "params_nonembed",
    "tokens": "tokens",
    "d_model": "d_model",
    "n_layers": "n_layers",
    "seed": "seed",
}


def attrs(payload: dict[str, Any]) -> dict[str, Any]:
    """The user attributes of a trial of ``payload``: the run itself and what it is, flat."""
    row = payload["row"]
    flat = {name: row[col] for name, col in ATTRS.items()}
    return {"run": payload, **flat, **({"extra": payload["extra"]} if "extra" in payload else {})}


def cost(payload: dict[str, Any]) -> float:
    """A run's estimated wall-clock, up to a constant: training FLOPs over model width. At equal FLOPs a narrow
    model trains longest, its small matmuls far below peak (H200, 32k tokens per step: d 192 at 8% MFU, 384 at
    21%, 768 at 38%, about proportional to width)."""
    return payload["row"]["train_flops"] / payload["row"]["d_model"]


def enqueue(study: optuna.Study, payloads: list[dict[str, Any]], skip_finished: bool = True) -> int:
    """Queue the runs whose run_id has no queued or running trial yet, nor (``skip_finished``) a finished one,
    longest first (``cost``; ties in the given order): workers then end on short runs instead of idling while
    the last long one trains. Returns how many were queued."""
    states = (TrialState.WAITING, TrialState.RUNNING) + ((TrialState.COMPLETE,) if skip_finished else ())
    have = {run_id(t) for t in trials(study, *states)}
    fresh = sorted((p for p in payloads if p["row"]["run_id"] not in have), key=cost, reverse=True)
    for p in fresh:
        study.enqueue_trial({}, user_attrs=attrs(p))
    return len(fresh)


def requeue(
    study: optuna.Study,
    trial: optuna.trial.FrozenTrial | optuna.Trial,
    alone: bool = False,
    stopped_s: float | None = None,
    counted: int = 0,
) -> None:
    """A new waiting trial of the same run, behind the queued ones; ``alone`` (or the trial's own flag): it
    trains with its host to itself (``pop``), e.g. after it ran out of memory beside other runs; ``stopped_s``:
    a time limit stopped it after that many seconds, unfinished (the longest such stop is kept: ``sweeps.deadline``
    predicts the run at least that long); ``counted``: the step up to which the commands that trained it so far
    counted its training FLOPs (``COUNTED``; the most of this and the trial's own is kept)."""
    alone = alone or trial.user_attrs.get("alone", False)
    stopped = max((s for s in (stopped_s, trial.user_attrs.get(STOPPED_S)) if s is not None), default=None)
    counted = max(counted, trial.user_attrs.get(COUNTED, 0))
    extra = ({"alone": True} if alone else {}) | ({STOPPED_S: stopped} if stopped is not None else {})
    extra |= {COUNTED: counted} if counted else {}
    study.enqueue_trial({}, user_attrs=attrs(trial.user_attrs["run"]) | extra)


def restart(study: optuna.Study, payloads: dict[str, dict[str, Any]], done: set[str]) -> None:
    """Tidy the queue of a sweep that starts again: a queued (never started) trial keeps its place with this
    command's ``payloads[run_id]`` (the same run; only keys outside the sweep's identity, such as train.devices,
    may differ), and one whose run ``done`` already holds is ended unstarted (FAIL without a start: no attempt)."""
    storage = study._storage
    for t in trials(study, TrialState.WAITING):
        rid = run_id(t)
        if rid in done:
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        elif rid in payloads and t.user_attrs["run"] != payloads[rid]:
            for key, value in attrs(payloads[rid]).items():
                storage.set_trial_user_attr(t._trial_id, key, value)


def pop(
    study: optuna.Study, order: Callable[[dict], float | None] | None = None, alone: bool = True
) -> optuna.Trial | None:
    """Take a queued trial of ``study`` (RUNNING now, on this host), or None when none waits: the longest by ``cost``
    (a size added to bracket an optimum, or a run queued again, takes its place among the queued ones), or with
    ``order`` the first by ``order(user_attrs)`` of its trial among those whose key is not None; ties in queue
    order. ``alone=False`` (the host trains other runs): none of those queued to train alone (``requeue``).
    Race-free across processes and hosts: the storage moves a trial from WAITING to RUNNING for one caller only."""
    storage = study._storage
    waiting = [t for t in trials(study, TrialState.WAITING) if alone or not t.user_attrs.get("alone")]
    if order is None:
        waiting = sorted(waiting, key=lambda t: -cost(t.user_attrs["run"]))  # stable
    else:
        keyed = [(k, t) for t in waiting if (k := order(t.user_attrs)) is not None]
        waiting = [t for _, t in sorted(keyed, key=lambda kt: kt[0])]  # stable: ties in queue order
    for t in waiting:
        if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
            trial = optuna.Trial(study, t._trial_id)
            trial.set_user_attr("host", f"{socket.gethostname()}:{os.getpid()}")
            if heartbeat(storage):  # from now on the trial is stale once its heartbeats stop
                storage.record_heartbeat(t._trial_id)
            return trial
    return None


def finish(trial: optuna.Trial, metrics: RunMetrics, curve: list[dict]) -> None:
    """Hand a finished run over through the storage (its result, then COMPLETE): the trial now holds its row."""
    trial.set_user_attr("result", {"metrics": asdict(metrics), "curve": curve})
    value = float("inf") if metrics.val_loss is None else metrics.val_loss  # Optuna needs a number
    trial.study.tell(trial, value)


def fail(trial: optuna.Trial) -> None:
    trial.study.tell(trial, state=TrialState.FAIL)


def interrupted(study: optuna.Study, trial: optuna.Trial, stopped_s: float | None = None, counted: int = 0) -> None:
    """End a trial whose process was stopped (Ctrl-C, SIGTERM, a fault elsewhere; a time limit after ``stopped_s``
    seconds) and queue its run again (``requeue``); no failed attempt of the run. Quiet when the storage itself is
    what failed: the error that stopped us goes on."""
    try:
        trial.set_user_attr("interrupted", True)
        fail(trial)
        requeue(study, trial, stopped_s=stopped_s, counted=counted)
    except Exception:
        pass


def attempt_failed(t: optuna.trial.FrozenTrial) -> bool:
    """Whether a FAIL trial was an attempt of its run that failed (it started, and was not interrupted)."""
    return t.datetime_start is not None and not t.user_attrs.get("interrupted", False)


def finished(study: optuna.Study) -> dict[str, tuple[dict, list[dict]]]:
    """run_id -> (row, curve) of every finished run in the study: one per run_id whatever the number of
    attempts (a run that finished twice, e.g. after a worker was thought dead, keeps its first result)."""
    out: dict[str, tuple[dict, list[dict]]] = {}
    for t in sorted(trials(study, TrialState.COMPLETE), key=lambda t: t.number):
        rid = run_id(t)
        if rid in out or "result" not in t.user_attrs:
            continue
        res = t.user_attrs["result"]
        out[rid] = ({**t.user_attrs["run"]["row"], **res["metrics"]}, res["curve"])
    return out


def finished_rows(studies: Iterable[optuna.Study]) -> list[dict]:
    """The row, with its metrics, of every finished run of ``studies`` (what a time limit predicts from)."""
    return [row for s in studies for row, _ in finished(s).values()]


def waiting(studies: Iterable[optuna.Study]) -> list[dict]:
    """The user attributes of every queued trial of ``studies`` (its run's planned row is ``["run"]["row"]``)."""
    return [t.user_attrs for s in studies for t in trials(s, TrialState.WAITING)]


@dataclass(frozen=True)
class Counts:
    planned: int
    queued: int
    running: list[tuple[str, str, str]]  # (run_id, host:pid, when it started, in the storage's local time)
    finished: int
    failed: int  # attempts that started and failed


def counts(study: optuna.Study, meta: dict) -> Counts:
    all_trials = trials(study)
    by = lambda *s: [t for t in all_trials if t.state in s]  # noqa: E731
    running = [
        (run_id(t), t.user_attrs.get("host", "?"), t.datetime_start.strftime("%Y-%m-%d %H:%M:%S"))
        for t in by(TrialState.RUNNING)
    ]
    return Counts(
        planned=len(meta.get("run_ids", [])),
        queued=len(by(TrialState.WAITING)),
        running=running,
        finished=len({run_id(t) for t in by(TrialState.COMPLETE)}),
        failed=sum(attempt_failed(t) for t in by(TrialState.FAIL)),
    )
