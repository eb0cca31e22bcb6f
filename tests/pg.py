"""A throwaway PostgreSQL server for the tests (the ``postgres`` fixture) and the storage benchmark.

``Postgres.start()`` initialises a cluster in a fresh temporary folder, runs it on a free port bound to 127.0.0.1
with password (SCRAM) authentication, and ``stop()`` removes it. PostgreSQL refuses to run as root, so as root the
server runs as ``nobody`` (through ``runuser``), which owns the folder. ``python3 -m tests.pg`` (repository root)
starts one and prints the per-trial storage overhead.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

USER = "mixdepth"  # the role the tests connect as: a password, may create databases, not a superuser


def find_bin() -> Path | None:
    """The newest installed PostgreSQL's bin folder in Debian's layout, else the one of ``initdb`` on PATH, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: _version(Path(p).parents[1].name))
    initdb = found[-1] if found else shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def unavailable() -> str | None:
    """Why a test server cannot run here, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    if find_bin() is None:
        return "PostgreSQL is not installed (/usr/lib/postgresql/*/bin/initdb); .ci/run installs it"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root, and no runuser to start PostgreSQL as an unprivileged user"
    return None


def _version(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in name.split(".") if x.isdigit())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    """One PostgreSQL cluster, its superuser ``postgres`` and the role ``USER``, each with a random password.

    Attributes:
        port: the TCP port on 127.0.0.1.
        password: ``USER``'s password.
    """

    def __init__(self) -> None:
        self._bin = find_bin()
        self._root = Path(tempfile.mkdtemp(prefix="mixdepth-pg-"))
        self._as = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        self._super_password = secrets.token_hex(12)
        self.password = secrets.token_hex(12)
        self.port = 0
        self._n = 0

    def _run(self, *cmd: str) -> None:
        r = subprocess.run([*self._as, *cmd], capture_output=True, text=True, cwd=self._root)
        if r.returncode:
            log = self._root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}\n{tail}")

    def start(self) -> Postgres:
        """initdb, then start the server (a new port each try: another process may take a free port first)."""
        data, pwfile = self._root / "data", self._root / "pwfile"
        pwfile.write_text(self._super_password + "\n")
        if self._as:
            shutil.chown(self._root, "nobody")
            shutil.chown(pwfile, "nobody")
        initdb = [str(self._bin / "initdb"), "-D", str(data), "-U", "postgres", f"--pwfile={pwfile}"]
        self._run(*initdb, "--auth=scram-sha-256", "--encoding=UTF8", "--locale=C", "--no-sync")
        pwfile.unlink()
        for attempt in range(3):
            self.port = _free_port()
            opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self._root}"
            try:
                self._run(str(self._bin / "pg_ctl"), "-D", str(data), "-l", str(self._root / "server.log"),
                          "-o", opts, "-w", "-t", "60", "start")  # fmt: skip
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        self._sql(f"CREATE ROLE {USER} LOGIN CREATEDB PASSWORD '{self.password}'")
        return self

    def _sql(self, statement: str) -> None:
        import psycopg

        dsn = f"host=127.0.0.1 port={self.port} user=postgres password={self._super_password} dbname=postgres"
        with psycopg.connect(dsn, autocommit=True) as con:
            con.execute(statement)

    def url(self, db: str, password: str | None = None) -> str:
        """The SQLAlchemy URL of database ``db`` as ``USER`` (with ``password`` in place of the right one)."""
        return f"postgresql+psycopg://{USER}:{password or self.password}@127.0.0.1:{self.port}/{db}"

    def new_db(self) -> str:
        """A fresh, empty database owned by ``USER`` (tests never share Optuna studies); its URL."""
        self._n += 1
        name = f"test_{self._n}"
        self._sql(f"CREATE DATABASE {name} OWNER {USER}")
        return self.url(name)

    def connections(self, url: str, wait: float = 5.0) -> int:
        """How many connections are open to the database of ``url`` (one of ``new_db``'s), once none is left or
        ``wait`` seconds have passed (a server ends a closed connection's backend a moment after the client hangs
        up)."""
        import psycopg

        dsn = f"host=127.0.0.1 port={self.port} user=postgres password={self._super_password} dbname=postgres"
        db = url.rsplit("/", 1)[1]
        deadline = time.monotonic() + wait
        with psycopg.connect(dsn, autocommit=True) as con:
            while True:
                (n,) = con.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (db,)).fetchone()
                if n == 0 or time.monotonic() > deadline:
                    return n
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server at once (its data is thrown away) and remove the folder."""
        try:
            if (self._root / "data" / "postmaster.pid").exists():
                self._run(str(self._bin / "pg_ctl"), "-D", str(self._root / "data"), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self._root, ignore_errors=True)


def storage_overhead(url: str, n: int = 50, result_bytes: int = 20_000) -> dict[str, float]:
    """Median seconds of one trial's storage traffic on ``url`` (a fresh Optuna study with heartbeats): ask, one
    heartbeat, set_user_attr of a ``result_bytes`` JSON result, tell; also each step's median.

    Returns:
        {"trial": ..., "ask": ..., "heartbeat": ..., "set_user_attr": ..., "tell": ...} in seconds.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(url, heartbeat_interval=10, grace_period=30)
    study = optuna.create_study(study_name=f"overhead-{secrets.token_hex(4)}", storage=storage)
    result = {"curve": [{"step": i, "train_loss": 3.0 + i / 1e3} for i in range(result_bytes // 40)]}
    for i in range(n):
        study.enqueue_trial({"x": float(i)})
    steps: dict[str, list[float]] = {k: [] for k in ("trial", "ask", "heartbeat", "set_user_attr", "tell")}
    for _ in range(n):
        t0 = time.perf_counter()
        trial = study.ask()
        t1 = time.perf_counter()
        storage.record_heartbeat(trial._trial_id)
        t2 = time.perf_counter()
        trial.set_user_attr("result", result)
        t3 = time.perf_counter()
        study.tell(trial, trial.suggest_float("x", 0, 1e9))
        t4 = time.perf_counter()
        for k, dt in zip(steps, (t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            steps[k].append(dt)
    storage.remove_session()
    storage.engine.dispose()
    return {k: statistics.median(v) for k, v in steps.items()}


if __name__ == "__main__":
    if why := unavailable():
        sys.exit(f"error: {why}")
    pg = Postgres()
    try:
        figures = storage_overhead(pg.start().new_db())
        print(" ".join(f"{k}={v * 1e3:.1f}ms" for k, v in figures.items()))
    finally:
        pg.stop()
