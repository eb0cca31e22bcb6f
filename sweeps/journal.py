"""The Optuna journal file (a sweep's work queue): check it, repair it, open it.

The database is the record and the journal only the queue, so a damaged journal is never fatal: a torn or broken
last line (an append cut short by a full disk or a kill) is dropped, anything else (a broken line before the end,
NUL bytes a filesystem left after a crash) moves the file aside and a new queue starts. Either way the runner
rebuilds the queue from the database (stale trials failed, missing runs enqueued).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock


@dataclass(frozen=True)
class Damage:
    """What is wrong with a journal file.

    Attributes:
        keep: bytes of the valid prefix to keep (the file is cut there), or None: the file cannot be trusted.
        why: what is wrong, for the one line the user reads.
    """

    keep: int | None
    why: str


def _valid(line: bytes) -> bool:
    try:
        log = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return False
    return isinstance(log, dict) and type(log.get("op_code")) is int and isinstance(log.get("worker_id"), str)


def damage(path: Path) -> Damage | None:
    """How the journal at ``path`` is damaged, or None when Optuna can read and append to it as it is (or it is
    absent)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if not data:
        return Damage(0, "it is empty")
    if b"\0" in data:
        return Damage(None, "it holds NUL bytes (the filesystem lost data)")
    lines = data.split(b"\n")
    torn = lines.pop()  # the bytes after the last newline: b"" in a healthy file
    bad = [i for i, line in enumerate(lines) if not _valid(line)]
    if not bad and not torn:
        return None
    if not bad:
        return Damage(len(data) - len(torn), f"the last line is torn ({len(torn)} bytes)")
    if bad == [len(lines) - 1] and not torn:
        n = len(lines[-1]) + 1
        return Damage(len(data) - n, f"the last line is not an Optuna record ({n} bytes)")
    return Damage(None, f"line {bad[0] + 1} of {len(lines) + bool(torn)} is not an Optuna record")


def _aside(path: Path) -> Path:
    """A free name beside ``path`` for the damaged file, stamped with the time it was moved."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    candidates = (path.with_name(f"{path.name}.damaged-{stamp}{f'-{i}' if i else ''}") for i in range(1000))
    return next(p for p in candidates if not p.exists())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def repair(path: Path) -> str | None:
    """Make the journal at ``path`` readable and appendable again; returns the line that says what was done, or
    None when it was fine. The caller holds the store's write lock (the journal is that store's alone).

    A valid prefix is kept by an atomic rewrite (a temporary file in the same folder, fsync, rename over the
    journal, under Optuna's journal lock); a file that cannot be trusted is renamed aside (kept for inspection,
    no part of the store) and Optuna starts an empty one.
    """
    d = damage(path)
    if d is None:
        return None
    rebuilt = "the queue is rebuilt from the database"
    if d.keep == 0 and path.stat().st_size == 0:
        return f"journal {path}: {d.why}; {rebuilt}"
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        if d.keep is None:
            aside = _aside(path)
            os.replace(path, aside)
            _fsync_dir(path.parent)
            return f"journal {path}: {d.why}; moved it to {aside.name}, {rebuilt}"
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                with path.open("rb") as src:
                    f.write(src.read(d.keep))
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, path.stat().st_mode & 0o7777)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
    finally:
        lock.release()
    return f"journal {path}: {d.why}; dropped it, {rebuilt}"


def storage(path: Path) -> optuna.storages.JournalStorage:
    """The Optuna storage over the journal at ``path`` (created when absent)."""
    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
