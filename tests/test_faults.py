"""Faults: a damaged Optuna journal is repaired or replaced with one line; a disk that fills, a folder that turns
read-only or a journal made immutable mid-sweep, and a disk that fills at a run's checkpoint, end with one line
naming the file and the fault and exit 1; a rerun once the fault is fixed resumes to the results of an
uninterrupted sweep. The faults are real (tmpfs mounts, remounts, chattr): these tests need root."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest

from mixdepth import results
from sweeps.journal import damage

FAULT = [  # 2 runs of one arch at one budget, one thread each (no isoFLOP fit: 3 points needed)
    "sweep.name=fault",
    "sweep.archs=[dense]",
    "sweep.budgets=[5e8]",
    "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}, {d_model: 32, n_layers: 1, n_heads: 2}]",
    "sweep.min_steps=4",
    "sweep.max_extra=0",  # the grid alone (tests/test_bracket.py adds sizes)
    "data.max_bytes=200000",
    "data.val_tokens=2048",
    "data.seq_len=32",
    "train.batch_size=4",
    "train.log_every=5",
    "train.progress=false",
    "train.threads=1",
    "train.accelerator=cpu",
]


def sweep(db: Path, *extra: str) -> int:
    from sweeps.__main__ import main

    return main(["isoflop", "--db", str(db), *FAULT, *extra])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, val_losses) -> Path:
    """An uninterrupted sweep's store (checkpointed: no WAL), shared by every case."""
    db = tmp_path_factory.mktemp("reference") / "r.db"
    assert sweep(db, "sweep.workers=1") == 0
    assert len(val_losses(db)) == 2 and not Path(f"{db}.wal").exists()
    return db


def copy_store(reference: Path, folder: Path) -> Path:
    for f in results.store_files(reference):
        if f.exists():
            shutil.copy2(f, folder / f.name)
    return folder / reference.name


def _torn(j: bytes) -> bytes:
    return j + j.splitlines(keepends=True)[-1][:25]  # half a record: an append cut short


def _middle(j: bytes) -> bytes:
    lines = j.splitlines(keepends=True)
    return b"".join([*lines[:2], lines[2][:-9] + b"\n", *lines[3:]])


DAMAGE = {  # kind -> (damage, what the line says was done)
    "torn last line": (_torn, "the last line is torn (25 bytes); dropped it"),
    "garbage last line": (
        lambda j: j + b"}{not json\n",
        "the last line is not an Optuna record (11 bytes); dropped it",
    ),
    "NUL bytes": (lambda j: j + b"\0" * 4096, "NUL bytes"),
    "broken middle line": (_middle, "line 3 of"),
    "empty file": (lambda j: b"", "is empty"),
}


def _damage_journal(db: Path, kind: str) -> tuple[Path, bytes]:
    journal = results.journal_path(db)
    bad = DAMAGE[kind][0](journal.read_bytes())
    journal.write_bytes(bad)
    return journal, bad


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_journal_is_rebuilt_from_the_database(reference, tmp_path, capsys, val_losses, kind, status_row):
    """status shows "?" and one warning and leaves the journal as it is; the sweep repairs it (a torn or broken
    last line dropped) or moves it aside (a broken line before the end, NUL bytes), says so in one line, exit 0,
    and its results are the uninterrupted sweep's."""
    from sweeps.__main__ import main

    db = copy_store(reference, tmp_path)
    journal, bad = _damage_journal(db, kind)
    assert main(["status", "--db", str(db)]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(f"warning: journal {journal}: ") and "Traceback" not in err, err
    assert status_row(out, "fault")["planned"] == "?"
    assert journal.read_bytes() == bad  # status only reads

    assert sweep(db, "sweep.workers=1") == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(f"journal {journal}: "), err
    assert DAMAGE[kind][1] in err and "the queue is rebuilt from the database" in err
    assert "0 to run" in out and val_losses(db) == val_losses(reference)
    assert damage(journal) is None
    aside = sorted(tmp_path.glob(f"{journal.name}.damaged-*"))
    if "moved it to" in err:  # kept for inspection, byte for byte
        assert [p.read_bytes() for p in aside] == [bad] and aside[0].name in err
    else:
        assert not aside


@pytest.mark.parametrize("kind", ["torn last line", "broken middle line"])
def test_damaged_journal_and_a_run_missing_from_the_database(reference, tmp_path, capsys, val_losses, kind):
    """The database is the record: the rerun trains exactly the run it lacks, whatever the journal said."""
    db = copy_store(reference, tmp_path)
    con = duckdb.connect(str(db))
    gone = con.execute("SELECT run_id FROM runs ORDER BY d_model DESC LIMIT 1").fetchone()[0]
    con.execute("DELETE FROM curves WHERE run_id = ?", [gone])
    con.execute("DELETE FROM runs WHERE run_id = ?", [gone])
    con.close()
    journal, _ = _damage_journal(db, kind)
    assert sweep(db, "sweep.workers=1") == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(f"journal {journal}: "), err
    assert "1 to run" in out and out.count("val_loss=") == 1 and "[1/1]" in out
    assert val_losses(db) == val_losses(reference)


# --- faults mid-sweep: real processes, real filesystems ---


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def _fill(folder: Path, leave: int = 0) -> Path:
    """Fill the filesystem of ``folder`` (a filler file written until ENOSPC), then free ``leave`` bytes."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\xff" * 65536)
    except OSError:
        pass
    try:
        while True:
            os.write(fd, b"\xff" * 512)
    except OSError:
        pass
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    os.close(fd)
    return filler


class Case:
    """One fault: where the store lives, what triggers the fault (a line of the sweep's output), how it is made
    and undone, and the file and errno text the one line must name."""

    def __init__(self, name: str, folder: Path, workers: int, trigger: str, fault_text: str):
        self.name, self.folder, self.workers, self.trigger, self.fault_text = name, folder, workers, trigger, fault_text
        self.db = folder / "r.db"
        self.journal = results.journal_path(self.db)
        self.filler: Path | None = None

    def inject(self, pid: int) -> None:
        """Make the fault while the sweep is stopped: it stops itself right after printing the trigger's line
        (``_STOPPING``), so however far this process lags behind its output, the fault comes before its next write."""
        while _state(pid) != "T":
            time.sleep(0.01)
        try:
            if self.name == "disk full":
                self.filler = _fill(self.folder)
            elif self.name == "read-only":  # a read-only mount over the folder: open files stay writable, as a
                # remount of the folder's own mount would refuse ("busy") while DuckDB holds its files open
                assert _sh("mount", "--bind", str(self.folder), str(self.folder)).returncode == 0
                assert _sh("mount", "-o", "remount,bind,ro", str(self.folder)).returncode == 0
            elif self.name == "immutable journal":
                assert _sh("chattr", "+i", str(self.journal)).returncode == 0
            else:  # full at a run's checkpoint: its row and curve fit in the WAL, the database's new blocks do not
                self.filler = _fill(self.folder, leave=64 * 1024)
        finally:
            os.kill(pid, signal.SIGCONT)

    def undo(self) -> None:
        if self.filler is not None:
            self.filler.unlink()
            self.filler = None
        if self.name == "read-only":
            assert _sh("umount", str(self.folder)).returncode == 0
        if self.name == "immutable journal":
            _sh("chattr", "-i", str(self.journal))


def _state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# ``python -m sweeps`` whose first line holding argv[1] (which it drops) is followed by SIGSTOP to itself
_STOPPING = """
import os, runpy, signal, sys
from sweeps.progress import Progress

trigger, line = sys.argv.pop(1), Progress.line

def stopping(self, text):
    global trigger
    line(self, text)
    if trigger is not None and trigger in text:
        trigger = None
        os.kill(os.getpid(), signal.SIGSTOP)

Progress.line = stopping
runpy.run_module("sweeps", run_name="__main__", alter_sys=True)
"""


def _run_case(case: Case, env: dict, cwd: Path) -> tuple[int, str, str]:
    args = ["isoflop", "--db", str(case.db), *FAULT, f"sweep.workers={case.workers}"]
    p = subprocess.Popen(
        [sys.executable, "-c", _STOPPING, case.trigger, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(300, p.kill)
    watchdog.start()
    out = []
    try:
        for line in p.stdout:
            out.append(line)
            if case.trigger in line:
                case.inject(p.pid)
                break
        rest, err = p.communicate()
    finally:
        watchdog.cancel()
    return p.returncode, "".join(out) + rest, err


CASES = [  # name, sweep.workers, the output line at which the fault is made, the errno text the line names
    ("disk full", 2, "val_loss=", "No space left on device"),
    ("read-only", 1, "val_loss=", "Read-only file system"),
    ("immutable journal", 1, "val_loss=", "Operation not permitted"),
    ("full at the checkpoint", 1, "[2/2]", "No space left on device"),  # the second run's (each write checkpoints)
]


class _Skip(Exception):
    pass


def _mount_tmpfs(folder: Path, size: str = "24m") -> None:
    folder.mkdir()
    r = _sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder))
    if r.returncode:
        raise _Skip(f"cannot mount a tmpfs ({r.stderr.strip()}): the fault tests need root")


def _chattr_folder(tmpfs: Path, fallback: Path) -> Path:
    """A folder whose filesystem takes ``chattr +i``: the tmpfs, else (an older kernel's tmpfs) tmp_path's."""
    for folder in (tmpfs, fallback):
        probe = folder / "probe"
        probe.touch()
        ok = _sh("chattr", "+i", str(probe)).returncode == 0
        _sh("chattr", "-i", str(probe))
        probe.unlink()
        if ok:
            return folder
    raise _Skip("neither tmpfs nor tmp_path's filesystem takes chattr +i")


@pytest.fixture(scope="module", autouse=True)
def faults(request, tmp_path_factory, cli_env):
    """Every fault case's sweep, started at once side by side (separate tmpfs mounts) in the background while the
    journal tests run (when a fault test is selected); name -> a function that waits for it and returns
    (case, rc, stdout, stderr)."""
    if not any(
        getattr(i, "originalname", "") == "test_fault_is_one_line_and_a_rerun_resumes" for i in request.session.items
    ):
        yield None
        return
    root = tmp_path_factory.mktemp("faults")
    mounts: list[Path] = []
    cases: list[Case] = []
    done: dict = {}
    threads: dict[str, threading.Thread] = {}
    (root / "ext").mkdir()
    (root / "reports").mkdir()
    skip = None if os.geteuid() == 0 else "the fault tests mount tmpfs and use chattr: they need root"
    try:
        for name, workers, trigger, fault_text in [] if skip else CASES:
            folder = root / name.replace(" ", "_")
            _mount_tmpfs(folder)
            mounts.append(folder)
            if name == "immutable journal":
                folder = _chattr_folder(folder, root / "ext")
            if name == "full at the checkpoint":  # reports go off the tmpfs: the checkpoint is the write that fails
                (folder / "r_report").symlink_to(root / "reports")
            cases.append(Case(name, folder, workers, trigger, fault_text))
    except _Skip as e:
        skip = str(e)
    for c in [] if skip else cases:
        threads[c.name] = threading.Thread(target=lambda c=c: done.update({c.name: (c, *_run_case(c, cli_env, root))}))
        threads[c.name].start()

    def result(name: str):
        if skip:
            pytest.skip(skip)
        threads[name].join()
        return done[name]

    try:
        yield result
    finally:
        for t in threads.values():
            t.join()
        for c in cases:
            if c.name == "immutable journal":
                _sh("chattr", "-i", str(c.journal))
        for m in mounts:
            while _sh("mountpoint", "-q", str(m)).returncode == 0:
                assert _sh("umount", str(m)).returncode == 0


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_fault_is_one_line_and_a_rerun_resumes(faults, reference, capsys, val_losses, name):
    case, rc, out, err = faults(name)
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, (rc, err[-3000:])
    line = lines[0]
    assert line.startswith("error: ") and case.fault_text in line, line
    named = [f for f in results.store_files(case.db) if f"{f}:" in line or f"{f} (" in line]
    if name == "disk full":  # whichever write first needs a new page of the full tmpfs: the store's files, or the
        # report when the sweep got past its last store write before it was paused (seen on a 16-core machine)
        assert named or line.startswith(f"error: {case.folder}/"), line
    else:
        assert named, line  # the database, its WAL or its journal
    if name in ("read-only", "immutable journal"):
        assert named == [case.journal], line  # DuckDB writes through files it holds open; the journal is reopened
    if name == "full at the checkpoint":
        assert "checkpoint" in line and "safe in its write-ahead log" in line, line
    case.undo()
    assert sweep(case.db, "sweep.workers=1") == 0
    rerun = capsys.readouterr()
    again = rerun.err.strip().splitlines()
    assert all(ln.startswith(f"journal {case.journal}: ") for ln in again) and len(again) <= 1, again
    assert name != "full at the checkpoint" or "0 to run" in rerun.out, rerun.out  # the WAL's run, replayed
    assert val_losses(case.db) == val_losses(reference)


def test_report_write_fault_is_one_line(reference, tmp_path, capsys, val_losses):
    """A report the sweep cannot write (its folder's disk is full: the write fails on the open file, whose error
    names no file) is one line naming it, exit 1; the rerun writes it."""
    db = copy_store(reference, tmp_path)
    reports = tmp_path / f"{db.stem}_report"
    try:
        _mount_tmpfs(reports, size="1m")
    except _Skip as e:
        pytest.skip(str(e))
    try:
        filler = _fill(reports)
        assert sweep(db, "sweep.workers=1") == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {reports}/") and "No space left on device" in err[0], err
        assert "fits.json: " in err[0]  # the first file run_all writes
        filler.unlink()
        assert sweep(db, "sweep.workers=1") == 0 and (next(reports.iterdir()) / "report.md").exists()
        assert val_losses(db) == val_losses(reference)
    finally:
        _sh("umount", str(reports))
