"""DuckDB store for sweeps, runs, curves and fits (torch-free).

One process writes a database file at a time: it holds a ``Writer`` (an ``flock`` on ``<db>.lock`` beside it)
for as long as it writes, a second writer gets a one-line ``StoreError``, and the DuckDB file itself is open
only for each short write (``Writer.session``), so readers (``sweeps status``, ``analysis query``) can open it
between writes; a reader or writer that finds DuckDB's own file lock held waits it out for ``LOCK_WAIT_S``.
Every run is written in one transaction (its row and its curve together), so an interrupted or failed write
leaves no partial rows.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import io
import json
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_args, get_type_hints

import duckdb

SCHEMA_VERSION = 2  # 2: a run that blew up (``blew_up``) is diverged; a version 1 store's runs are judged on opening
BLOW_UP = 2.0  # a training objective above this many times the first step's (the model at initialisation) blew up
LOCK_WAIT_S = 10.0  # how long an open waits out another process's DuckDB file lock

# Column types: each record field's annotation names its DuckDB type (NULL allowed where it says `| None`).
Key = Annotated[str, "VARCHAR PRIMARY KEY"]
Varchar = Annotated[str, "VARCHAR"]
Integer = Annotated[int, "INTEGER"]
BigInt = Annotated[int, "BIGINT"]
Double = Annotated[float, "DOUBLE"]
Json = Annotated[Any, "JSON"]  # dicts and lists, stored as sorted-key JSON text


@dataclass(frozen=True)
class RunMetrics:
    """What one training run measured (``train.fit`` returns it); stored in ``runs`` in this field order."""

    status: Varchar  # ok | diverged (a loss not finite, or the training objective blew up: then every loss NULL)
    val_loss: Double | None  # held-out mean token loss (nats)
    val_loss_causal: Double | None  # routed archs: loss under causal routing; NULL otherwise
    train_loss: Double | None  # mean training objective over the last logged steps (MoD, MoDE: LM + aux losses)
    wall_s: Double  # training (fit) seconds, over every process the run trained in; compilation included
    tokens_per_s: Double  # steady state: the ThroughputMonitor's window of the last steps (else tokens / wall_s)
    mfu: Double | None  # model FLOPs utilisation against peak_flops; NULL when no peak is known
    peak_flops: Double | None  # the peak FLOP/s MFU assumed
    device: Varchar
    precision: Varchar
    versions: Json
    corpus: Varchar
    corpus_fingerprint: Varchar
    routing_stats: Json | None  # routed archs: capacity, predictor accuracy/precision/recall, expert load
    setup_s: Double | None = None  # seconds before training: corpus, model, trainer (the last process it ran in)
    eval_s: Double | None = None  # seconds after training: final checkpoint and the held-out evaluation
    peak_memory_gib: Double | None = None  # most GPU memory for tensors in training, any rank (last process); CPU: NULL
    corpus_tokens: BigInt | None = None  # tokens in the corpus's training split; tokens / corpus_tokens: passes
    train_lm_loss: Double | None = None  # the LM loss (no aux losses) over train_loss's steps; NULL where one lacks it


@dataclass(frozen=True)
class RunRecord:
    """One row of ``runs``: the planned run and, in place of ``metrics``, what training measured.

    Field order is the table's column order; ``RUN_COLUMNS`` is derived from it (plus ``created_at``, which
    the store stamps).
    """

    run_id: Key
    sweep_id: Varchar
    arch: Varchar
    budget: Double  # target training FLOPs C of the isoFLOP grid point
    d_model: Integer
    n_layers: Integer
    n_heads: Integer
    n_kv_heads: Integer
    d_ff: Integer
    seq_len: Integer
    vocab_size: Integer
    params_total: BigInt
    params_nonembed: BigInt
    params_active: BigInt  # parameters touched per token (experts at their routing)
    flops_per_token: Double  # exact forward FLOPs per token (DESIGN section 5)
    flops_6nd: Double  # 6 * params_nonembed * tokens, for comparison only
    train_flops: Double  # flops.train_flops(flops_per_token, tokens): the FLOPs trained
    tokens: BigInt
    steps: Integer
    batch_size: Integer
    lr: Double
    seed: Integer
    metrics: RunMetrics  # columns status .. routing_stats
    config: Json

    def row(self) -> dict[str, Any]:
        """Column name -> value, in column order (``metrics`` flattened in place)."""
        return _flatten(self)


def _flatten(record: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        out.update(_flatten(value) if dataclasses.is_dataclass(value) else {f.name: value})
    return out


def _columns(cls: type) -> dict[str, str]:
    """Column name -> DuckDB type of a record class, nested records flattened in place."""
    hints = get_type_hints(cls, include_extras=True)
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(_columns(hint))
            continue
        annotated = next(a for a in (hint, *get_args(hint)) if hasattr(a, "__metadata__"))  # X or X | None
        out[f.name] = annotated.__metadata__[0]
    return out


# Column name -> DuckDB type, in the table's column order: the record's fields, then the store's timestamp.
RUN_COLUMNS: dict[str, str] = {**_columns(RunRecord), "created_at": "TIMESTAMP"}

# The columns of ``sweeps`` after its first five (sweep_id, name, preset, config, created_at), added to older stores:
# where the sweep came from, for its report (NULL for sweeps recorded before they existed).
SWEEP_PROVENANCE: dict[str, str] = {
    "planned": "INTEGER",  # runs its plan holds (grid points with their seeds; sizes added to bracket come on top)
    "version": "VARCHAR",  # the mixdepth version that last ran it
    "commit": "VARCHAR",  # the git commit of that code's source tree; NULL outside a git checkout
    "command": "VARCHAR",  # the command line that last ran it (storage passwords hidden)
}
USAGE_PROVENANCE: dict[str, str] = {  # each command's own: a sweep resumed by later commands may run other code
    "commit": "VARCHAR",
    "command": "VARCHAR",
}
CURVE_BASE: dict[str, str] = {  # ``curves``' columns since the first store
    "run_id": "VARCHAR",
    "step": "INTEGER",
    "tokens": "BIGINT",
    "flops": "DOUBLE",
    "train_loss": "DOUBLE",
    "lr": "DOUBLE",
}
CURVE_EXTRA: dict[str, str] = {  # its later columns, added to older stores
    "lm_loss": "DOUBLE",  # the LM loss in train_loss (the objective) at that step; NULL for points logged before
}
CURVE_COLUMNS = (*CURVE_BASE, *CURVE_EXTRA)

DDL = f"""
CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR);
CREATE TABLE IF NOT EXISTS sweeps (
    sweep_id VARCHAR PRIMARY KEY, name VARCHAR, preset VARCHAR, config JSON, created_at TIMESTAMP,
    {", ".join(f"{k} {v}" for k, v in SWEEP_PROVENANCE.items())}
);
CREATE TABLE IF NOT EXISTS runs ({", ".join(f"{k} {v}" for k, v in RUN_COLUMNS.items())});
CREATE TABLE IF NOT EXISTS curves ({", ".join(f"{k} {v}" for k, v in {**CURVE_BASE, **CURVE_EXTRA}.items())});
CREATE TABLE IF NOT EXISTS fits (
    fit_id VARCHAR, sweep_id VARCHAR, arch VARCHAR, method VARCHAR, budget DOUBLE,
    params JSON, ci JSON, n_points INTEGER, objective DOUBLE, created_at TIMESTAMP
);
CREATE TABLE IF NOT EXISTS sweep_usage (
    sweep_id VARCHAR, started_at TIMESTAMP, wall_s DOUBLE, gpus INTEGER, peak_flops DOUBLE, train_flops DOUBLE,
    runs INTEGER, utilisation DOUBLE, parts JSON, {", ".join(f"{k} {v}" for k, v in USAGE_PROVENANCE.items())}
);
CREATE TABLE IF NOT EXISTS alone_rates (
    sweep_id VARCHAR, shape VARCHAR, arch VARCHAR, d_model INTEGER, n_layers INTEGER, steps INTEGER,
    tokens_per_s DOUBLE, mfu DOUBLE, peak_flops DOUBLE, device VARCHAR, versions JSON, measured_at TIMESTAMP
);
CREATE OR REPLACE VIEW isoflop_points AS
    SELECT sweep_id, arch, budget, run_id, params_nonembed AS n, params_total, params_active, tokens AS d,
           flops_per_token, train_flops, val_loss, val_loss_causal, seed
    FROM runs WHERE status = 'ok' AND val_loss IS NOT NULL;
CREATE OR REPLACE VIEW frontier AS
    SELECT * EXCLUDE (rk) FROM (
        SELECT *, row_number() OVER (PARTITION BY sweep_id, arch, budget ORDER BY val_loss) AS rk
        FROM isoflop_points)
    WHERE rk = 1;
"""


def blew_up(curve: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a training curve (its points' ``train_loss``, the first at step 1: the model at initialisation)
    rose above ``BLOW_UP`` times its first loss: a run that blew up, however it ended (routed families at a too
    high learning rate reach 1e2-1e6 and end near the unigram loss), far above any batch's noise (the published
    reference study's 110 healthy runs reach at most 1.03 times their first, during warm-up)."""
    losses = [p["train_loss"] for p in curve]
    return bool(losses) and max(losses) > BLOW_UP * losses[0]


def _diverge_blown_up(con: duckdb.DuckDBPyConnection) -> None:
    """A version 1 store judged only non-finite losses: its ok runs whose stored curve ``blew_up`` become diverged
    (losses and statistics NULL, curves kept)."""
    points: dict[str, list[dict]] = {}
    for run_id, loss in con.execute(
        "SELECT c.run_id, c.train_loss FROM curves c JOIN runs r USING (run_id) WHERE r.status = 'ok'"
        " ORDER BY c.run_id, c.step"
    ).fetchall():
        points.setdefault(run_id, []).append({"train_loss": loss})
    for run_id in (r for r, curve in points.items() if blew_up(curve)):
        con.execute(
            "UPDATE runs SET status = 'diverged', val_loss = NULL, val_loss_causal = NULL, train_loss = NULL,"
            " routing_stats = NULL WHERE run_id = ?",
            [run_id],
        )


class StoreError(RuntimeError):
    """A store problem with a one-line message meant for the user."""


def journal_path(db: Path) -> Path:
    """The Optuna journal (a sweep's work queue) that lives beside the database ``db``."""
    return Path(f"{db}.optuna.log")


def store_files(db: Path) -> tuple[Path, ...]:
    """The files that make up a store: the database, its write-ahead log and the Optuna journal beside it.

    A damaged journal the sweep moved aside (``<journal>.damaged-<time>``) is no part of it: nothing reads it,
    it is kept for inspection only, so it is not protected like these.
    """
    return db, Path(f"{db}.wal"), journal_path(db)


# How DuckDB names the file of an IO error: ... file "<path>": <the C library's errno text>
_DUCKDB_FILE_FAULT = re.compile(r'file "(?P<path>[^"]+)": (?P<why>[^\n"]+?)\s*$', re.MULTILINE)


def io_fault(e: BaseException) -> str | None:
    """``"<file>: <fault>"`` for a filesystem fault (disk full, read-only, immutable file, ...) behind ``e``, or
    None when its chain (``__cause__``, ``__context__``) holds none; the earliest fault wins: later errors are
    its consequences (a ROLLBACK after a failed COMMIT, Optuna's "Should not reach." after a failed write)."""
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for exc in reversed(chain):
        if isinstance(exc, OSError) and exc.errno is not None and (name := exc.filename or _open_file(exc)):
            return f"{name}: {os.strerror(exc.errno)}"
        if isinstance(exc, duckdb.Error) and (m := _DUCKDB_FILE_FAULT.search(str(exc))):
            return f"{m['path']}: {m['why']}"
    return None


def _open_file(e: BaseException) -> str | None:
    """The name of the file a failed write was writing: an error from writing an open file (not opening one)
    carries no file name, but the innermost frame that raised it still holds the file object."""
    tb = e.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for v in frame.f_locals.values():
            if isinstance(v, io.IOBase) and isinstance(getattr(v, "name", None), str):
                return v.name
    return None


def checkpoint(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """Write the WAL into the database file now (DuckDB would at close, and say nothing when that fails)."""
    try:
        con.execute("CHECKPOINT")
    except duckdb.Error as e:
        fault = io_fault(e) or _first_line(e)
        raise StoreError(
            f"cannot checkpoint database {path} ({fault}); every stored run is safe in its write-ahead log"
            f" {path}.wal, which the next command to open it replays once the fault is fixed"
        ) from None


@contextmanager
def _transaction(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """BEGIN ... COMMIT, rolled back on any error; a COMMIT that failed (disk full) has ended the transaction."""
    con.execute("BEGIN")
    try:
        yield
        con.execute("COMMIT")
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except duckdb.TransactionException:  # "no transaction is active": the failed COMMIT ended it
            pass
        raise


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def connect(path: str | os.PathLike, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open (and on write, create and migrate) the store, raising StoreError with one line on failure.

    A file another process has open read-write (or, for a write, open at all) is waited for up to
    ``LOCK_WAIT_S``: its holder's writes and reads are short. A process that writes for longer than one
    connection holds a ``Writer`` instead.
    """
    p = Path(path)
    if read_only and not p.exists():
        raise StoreError(f"database {p} does not exist")
    if not read_only:
        _check_writable(p)
    con = _open(p, read_only)
    if not read_only:
        try:
            stored = _check_store(con, p)
        except StoreError:
            con.close()
            raise
        try:
            con.execute("BEGIN")
            con.execute(DDL)
            _add_missing_columns(con)
            if stored == 1:
                _diverge_blown_up(con)
            con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
            con.execute("COMMIT")
        except duckdb.Error as e:
            con.close()
            if fault := io_fault(e):
                raise StoreError(f"cannot write database {p}: {fault}") from None
            raise StoreError(f"database {p} has an incompatible schema: {_first_line(e)}") from None
    return con


def _in_use(p: Path) -> StoreError:
    return StoreError(f"database {p} is in use by another process (one writer at a time)")


def _check_writable(p: Path) -> None:
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise StoreError(f"cannot create database {p}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise StoreError(f"cannot write database {p}: permission denied")


def _open(p: Path, read_only: bool) -> duckdb.DuckDBPyConnection:
    """``duckdb.connect``, waiting out a held file lock for up to LOCK_WAIT_S; one-line StoreError on failure."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            return duckdb.connect(str(p), read_only=read_only)
        except duckdb.IOException as e:
            msg = str(e)
            if "lock" in msg.lower():
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise _in_use(p) from None
            if "not a valid DuckDB database" in msg or "Corrupt" in msg or "invalid" in msg.lower():
                raise StoreError(f"database {p} is not a valid DuckDB file (corrupt or another format)") from None
            raise StoreError(f"cannot open database {p}: {_first_line(e)}") from None
        except duckdb.Error as e:
            raise StoreError(f"cannot open database {p}: {_first_line(e)}") from None


class Writer:
    """The right to write one store, held from ``writer(db)`` to the end of its ``with`` block.

    Attributes:
        db: the database file.
    """

    def __init__(self, db: Path) -> None:
        self.db = db

    @contextmanager
    def session(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-write connection for one short piece of work, checkpointed (nothing left only in the WAL) and
        closed at the end; on an error it is closed without a checkpoint, and the error goes on."""
        con = _open(self.db, read_only=False)
        try:
            yield con
            checkpoint(con, self.db)
        finally:
            con.close()


def lock_path(db: Path) -> Path:
    """The lock file a ``Writer`` of ``db`` holds; it exists only while one does."""
    return Path(f"{db}.lock")


@contextmanager
def writer(db: str | os.PathLike) -> Iterator[Writer]:
    """Hold the right to write the store ``db`` (created and migrated here, as ``connect`` does) until the block
    ends; StoreError with one line when another process holds it, or the store cannot be written.

    The lock is an ``flock`` on ``<db>.lock``, not DuckDB's own file lock, so the database is free for readers
    between the writer's sessions; the kernel drops it when the process dies, however it dies.
    """
    p = Path(db)
    _check_writable(p)
    fd = _lock(p)
    try:
        con = connect(p)  # refuse a foreign or newer store, and migrate, before the caller's first write
        try:
            checkpoint(con, p)
        finally:
            con.close()
        yield Writer(p)
    finally:
        try:
            lock_path(p).unlink()  # while still held: a process that opened the old file fails or retries (_lock)
        except OSError:  # a folder that turned read-only: a lock file left behind is free once closed
            pass
        os.close(fd)


def _lock(p: Path) -> int:
    """The open, ``flock``-ed lock file of ``p``: StoreError when another process holds it. A file its holder
    unlinked after we opened it is no lock any more: open the one now at the path instead."""
    path = lock_path(p)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StoreError(f"cannot write database {p}: {path}: {os.strerror(e.errno)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise _in_use(p) from None
            raise StoreError(f"cannot lock database {p}: {path}: {os.strerror(e.errno)}") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _check_store(con: duckdb.DuckDBPyConnection, p: Path) -> int | None:
    """Before anything is written: an empty file becomes a store (None); a file with tables must be a mixdepth
    store (a ``meta`` table with an integer ``schema_version``) of a schema this code knows (no newer one): its
    version."""
    tables = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()]
    if not tables:
        return None
    version = None
    if "meta" in tables:
        row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        version = int(row[0]) if row and str(row[0]).isdigit() else None
    if version is None:
        shown = ", ".join(tables[:5]) + (" ..." if len(tables) > 5 else "")
        raise StoreError(f"database {p} is not a mixdepth store (it holds {shown}); give another --db")
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"database {p} has schema version {version}, newer than this mixdepth's {SCHEMA_VERSION}; upgrade mixdepth"
        )
    return version


def _add_missing_columns(con: duckdb.DuckDBPyConnection) -> None:
    """Give an existing ``runs`` table the record's columns it lacks (a metric added to ``RunMetrics`` after the
    database was made), ``sweeps`` and ``sweep_usage`` their provenance columns and ``curves`` its later ones, at the
    end of the table, NULL for the rows stored before; writes name their columns."""
    have = {r[0] for r in con.execute("SELECT name FROM pragma_table_info('runs')").fetchall()}
    for name, sql_type in RUN_COLUMNS.items():
        if name not in have:
            con.execute(f"ALTER TABLE runs ADD COLUMN {name} {sql_type}")
    for name, sql_type in SWEEP_PROVENANCE.items():
        con.execute(f"ALTER TABLE sweeps ADD COLUMN IF NOT EXISTS {name} {sql_type}")
    for name, sql_type in USAGE_PROVENANCE.items():
        con.execute(f"ALTER TABLE sweep_usage ADD COLUMN IF NOT EXISTS {name} {sql_type}")
    for name, sql_type in CURVE_EXTRA.items():
        con.execute(f"ALTER TABLE curves ADD COLUMN IF NOT EXISTS {name} {sql_type}")


def _json(v: Any) -> Any:
    return json.dumps(v, sort_keys=True, default=str) if isinstance(v, (dict, list)) else v


def add_sweep(
    con: duckdb.DuckDBPyConnection,
    sweep_id: str,
    name: str,
    preset: str,
    config: Mapping,
    provenance: Mapping[str, Any] | None = None,
) -> None:
    """Record a sweep; a rerun of it updates the row and keeps its ``created_at`` (when the sweep began).

    Args:
        provenance: ``SWEEP_PROVENANCE`` columns (planned, version, commit, command); those not given are NULL.
    """
    prov = dict(provenance or {})
    if unknown := set(prov) - set(SWEEP_PROVENANCE):
        raise StoreError(f"unknown sweep columns: {sorted(unknown)}")
    cols = ["sweep_id", "name", "preset", "config", *SWEEP_PROVENANCE]
    updated = ", ".join(f"{c} = excluded.{c}" for c in cols[1:])
    con.execute(
        f"INSERT INTO sweeps ({', '.join(cols)}, created_at) VALUES ({', '.join('?' * len(cols))}, now())"
        f" ON CONFLICT (sweep_id) DO UPDATE SET {updated}",
        [sweep_id, name, preset, _json(dict(config)), *(prov.get(c) for c in SWEEP_PROVENANCE)],
    )


def finished_run_ids(con: duckdb.DuckDBPyConnection) -> set[str]:
    return {r[0] for r in con.execute("SELECT run_id FROM runs WHERE status IS NOT NULL").fetchall()}


def add_run(
    con: duckdb.DuckDBPyConnection, run: RunRecord | Mapping[str, Any], curve: Iterable[Mapping[str, Any]]
) -> None:
    """Insert one run and its curve atomically, replacing any earlier row and curve of its run_id.

    Args:
        con: a writable connection.
        run: the record, or a mapping of some RUN_COLUMNS (others NULL; synthetic sweeps, collected runs, tests).
        curve: points with step, tokens, flops, train_loss and lr, and lm_loss where they have it (a point of a
            checkpoint saved before curves held it does not: NULL).
    """
    add_runs(con, [(run, curve)])


def add_runs(
    con: duckdb.DuckDBPyConnection,
    runs: Iterable[tuple[RunRecord | Mapping[str, Any], Iterable[Mapping[str, Any]]]],
) -> None:
    """``add_run`` for many (run, curve) pairs in one transaction: all of them are stored, or none."""
    rows = [r.row() if isinstance(r, RunRecord) else dict(r) for r, _ in runs]
    curves = [list(c) for _, c in runs]
    for row in rows:
        unknown = set(row) - set(RUN_COLUMNS) | ({"created_at"} & set(row))  # the store stamps created_at
        if unknown:
            raise StoreError(f"unknown run columns: {sorted(unknown)}")
    if not rows:
        return
    import pandas as pd  # DuckDB reads data frames in bulk (its executemany inserts row by row)

    runs_df = pd.DataFrame([{c: _json(row.get(c)) for c in RUN_COLUMNS if c != "created_at"} for row in rows])
    given = [c for c in RUN_COLUMNS if any(c in row for row in rows)]  # columns no row names stay NULL
    curves_df = pd.DataFrame(
        [
            (row["run_id"], p["step"], p["tokens"], p["flops"], p["train_loss"], p["lr"], p.get("lm_loss"))
            for row, curve in zip(rows, curves, strict=True)
            for p in curve
        ],
        columns=list(CURVE_COLUMNS),
    )
    with _transaction(con):  # BEGIN first: it ends a caller's unfinished result, which register refuses
        con.register("runs_df", runs_df)
        con.register("curves_df", curves_df)
        try:
            con.execute("DELETE FROM curves WHERE run_id IN (SELECT run_id FROM runs_df)")
            con.execute("DELETE FROM runs WHERE run_id IN (SELECT run_id FROM runs_df)")
            cols = ", ".join(given)
            con.execute(f"INSERT INTO runs ({cols}, created_at) SELECT {cols}, now() FROM runs_df")
            if len(curves_df):
                con.execute("INSERT INTO curves BY NAME SELECT * FROM curves_df")
        finally:  # a failed write leaves no view behind on the caller's connection
            con.unregister("runs_df")
            con.unregister("curves_df")


USAGE_COLUMNS = (
    "sweep_id", "started_at", "wall_s", "gpus", "peak_flops", "train_flops", "runs", "utilisation", "parts",
    *USAGE_PROVENANCE,
)  # fmt: skip


def put_usage(con: duckdb.DuckDBPyConnection, row: Mapping[str, Any]) -> None:
    """Record one sweep command's use of its devices (``sweeps.usage``): one row per command that trained, keyed by
    its sweep and start; a later row of the same command replaces the earlier (a sweep writes one as each run
    ends, so a command killed outright keeps its device time up to its last finished run)."""
    if unknown := set(row) - set(USAGE_COLUMNS):
        raise StoreError(f"unknown sweep_usage columns: {sorted(unknown)}")
    con.execute(
        "DELETE FROM sweep_usage WHERE sweep_id IS NOT DISTINCT FROM ? AND started_at IS NOT DISTINCT FROM ?",
        [row.get("sweep_id"), row.get("started_at")],
    )
    con.execute(
        f"INSERT INTO sweep_usage ({', '.join(USAGE_COLUMNS)}) VALUES ({', '.join('?' * len(USAGE_COLUMNS))})",
        [_json(row.get(c)) for c in USAGE_COLUMNS],
    )


# A run's shape for ``alone_rates``: its model config (runs of one shape differ in seed, budget and steps only).
SHAPE_KEY = "md5(CAST(json_extract(config, '$.model') AS VARCHAR))"
ALONE_COLUMNS = (
    "sweep_id", "shape", "arch", "d_model", "n_layers", "steps", "tokens_per_s", "mfu", "peak_flops", "device",
    "versions",
)  # fmt: skip


def put_alone_rate(con: duckdb.DuckDBPyConnection, row: Mapping[str, Any]) -> None:
    """Record the steady rate of one shape of a sweep trained alone on its device (``sweeps.alone``), replacing an
    earlier one of the same shape."""
    if unknown := set(row) - set(ALONE_COLUMNS):
        raise StoreError(f"unknown alone_rates columns: {sorted(unknown)}")
    con.execute("DELETE FROM alone_rates WHERE sweep_id = ? AND shape = ?", [row["sweep_id"], row["shape"]])
    con.execute(
        f"INSERT INTO alone_rates ({', '.join(ALONE_COLUMNS)}, measured_at)"
        f" VALUES ({', '.join('?' * len(ALONE_COLUMNS))}, now())",
        [_json(row.get(c)) for c in ALONE_COLUMNS],
    )


def sweep_utilisation(con: duckdb.DuckDBPyConnection) -> dict[str, tuple[float | None, float, int]]:
    """sweep_id -> (utilisation over all its commands, wall seconds, commands): the training FLOPs of the commands
    over their wall-clock x GPUs x per-GPU peak; utilisation None where a command had no known peak (CPU). Empty for
    a store made before ``sweep_usage`` existed."""
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if "sweep_usage" not in tables:
        return {}
    rows = con.execute(
        "SELECT sweep_id, CASE WHEN count(*) = count(utilisation)"
        " THEN sum(train_flops) / sum(wall_s * gpus * peak_flops) END, sum(wall_s), count(*)"
        " FROM sweep_usage GROUP BY sweep_id"
    ).fetchall()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def add_fits(con: duckdb.DuckDBPyConnection, sweep_id: str | None, rows: Iterable[Mapping[str, Any]]) -> None:
    """Replace every fit of sweep ``sweep_id`` with ``rows``, atomically (a refit that no longer yields a row,
    such as a forecast, leaves no stale one)."""
    rows = list(rows)
    with _transaction(con):
        con.execute("DELETE FROM fits WHERE sweep_id IS NOT DISTINCT FROM ?", [sweep_id])
        for r in rows:
            con.execute(
                "INSERT INTO fits VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, now())",
                [
                    r["fit_id"],
                    r.get("sweep_id"),
                    r["arch"],
                    r["method"],
                    r.get("budget"),
                    _json(r["params"]),
                    _json(r.get("ci", {})),
                    r["n_points"],
                    r.get("objective"),
                ],
            )
