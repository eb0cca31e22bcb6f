"""A sweep published as files: its rows of ``sweeps``, ``runs``, ``curves``, ``sweep_usage`` and ``alone_rates`` as
Parquet, and a README.md with the machine, versions, commit and command, in one folder (``python -m analysis
publish``).

Every command that reads a store (report, plot, forecast, query) also takes such a folder as ``--db``: it is loaded
into a temporary database with the store's schema, so the fits and figures come out as from the original.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import duckdb

from mixdepth.results import StoreError, connect
from mixdepth.usage import STOPPED

TABLES = {  # table -> the rows of one sweep
    "sweeps": "SELECT * FROM sweeps WHERE sweep_id = ?",
    "runs": "SELECT * FROM runs WHERE sweep_id = ? ORDER BY arch, budget, params_nonembed, seed",
    "curves": "SELECT c.* FROM curves c JOIN runs r USING (run_id) WHERE r.sweep_id = ? ORDER BY run_id, step",
    "sweep_usage": "SELECT * FROM sweep_usage WHERE sweep_id = ? ORDER BY started_at",
    "alone_rates": "SELECT * FROM alone_rates WHERE sweep_id = ? ORDER BY arch, d_model, n_layers, shape",
}
OPTIONAL = {"alone_rates"}  # folders published before the table existed lack its file
_loaded: dict[Path, Path] = {}  # published folder -> its temporary database, for this process


def is_published(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and all((p / f"{t}.parquet").is_file() for t in TABLES if t not in OPTIONAL)


def publish(con: duckdb.DuckDBPyConnection, sweep_id: str, out: Path) -> dict[str, int]:
    """Write ``sweep_id``'s rows to ``out`` (created) and its README.md; returns the rows written per table."""
    out.mkdir(parents=True, exist_ok=True)
    present = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    counts = {}
    for table, sql in TABLES.items():
        if table in OPTIONAL and table not in present:  # a store written before the table existed, opened to read
            continue
        path = str(out / f"{table}.parquet")
        con.sql(sql, params=[sweep_id]).write_parquet(path)
        counts[table] = con.execute("SELECT count(*) FROM read_parquet(?)", [path]).fetchall()[0][0]  # its metadata
    (out / "README.md").write_text(_readme(con, sweep_id, counts, out))
    return counts


def _commands(con: duckdb.DuckDBPyConnection, out: Path) -> list[str]:
    """A table of the sweep's commands that trained (its ``sweep_usage`` rows as written to ``out``) where there
    are several: a sweep resumed by later commands may have run other code in each."""
    cur = con.execute("SELECT * FROM read_parquet(?) ORDER BY started_at", [str(out / "sweep_usage.parquet")])
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    if len(rows) < 2:
        return []
    lines = ["Its commands that trained (the line above names the latest's):", "",
             "| started (UTC) | runs | wall s | commit | command | ended |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        commit, command = r.get("commit") or "not recorded", r.get("command")
        ended = STOPPED.get(json.loads(r["parts"] or "{}").get("stopped"), "with its report")
        lines.append(f"| {r['started_at']:%Y-%m-%d %H:%M} | {r['runs']} | {r['wall_s']:.0f} | {commit} |"
                     f" {f'`{command}`' if command else 'not recorded'} | {ended} |")  # fmt: skip
    if any(line.endswith(f"| {STOPPED['interrupted']} |") for line in lines):
        lines += ["", "A command interrupted before its report counts its wall-clock up to its stop, or, killed"
                  " outright (a job's end, a device's limit), up to its last finished run."]  # fmt: skip
    return [*lines, ""]


def _readme(con: duckdb.DuckDBPyConnection, sweep_id: str, counts: dict[str, int], out: Path) -> str:
    name, preset, version, commit, command, created = con.execute(
        "SELECT name, preset, version, commit, command, created_at FROM sweeps WHERE sweep_id = ?", [sweep_id]
    ).fetchall()[0]
    machines = con.execute(
        "SELECT device, precision, versions, count(*), min(corpus), min(corpus_fingerprint) FROM runs"
        " WHERE sweep_id = ? GROUP BY ALL ORDER BY 4 DESC",
        [sweep_id],
    ).fetchall()
    lines = [
        f"# Sweep {sweep_id}",
        "",
        f"Preset `{preset}` (name {name}), begun {created:%Y-%m-%d %H:%M} UTC; mixdepth"
        f" {version or 'version not recorded'}, commit {commit or 'unknown'}.",
        "",
        f"Command: `{command or 'unknown'}`",
        "",
        "Where its runs trained:",
        "",
        "| device | precision | versions | runs | corpus | corpus fingerprint |",
        "|---|---|---|---|---|---|",
    ]
    for device, precision, versions, n, corpus, fingerprint in machines:
        v = ", ".join(f"{k} {x}" for k, x in json.loads(versions or "{}").items())
        lines.append(f"| {device} | {precision} | {v} | {n} | {corpus} | {fingerprint} |")
    lines += ["", *(_commands(con, out) if "sweep_usage" in counts else [])]
    lines += [
        "Files: " + ", ".join(f"`{t}.parquet` ({n} rows)" for t, n in counts.items()) + ".",
        "",
        "Fit, forecast, plot or report them without the GPU (the folder stands for the database):",
        "",
        "```bash",
        f"python -m analysis report --db {{this folder}} --sweep {sweep_id} --out report",
        "```",
        "",
    ]
    return "\n".join(lines)


def load(folder: Path) -> Path:
    """A temporary read-only-use database with the store's schema holding ``folder``'s rows (made once per
    process, removed at its exit)."""
    folder = folder.resolve()
    if folder in _loaded:
        return _loaded[folder]
    tmp = Path(tempfile.mkdtemp(prefix="mixdepth-published-"))
    atexit.register(shutil.rmtree, tmp, True)
    db = tmp / "published.db"
    con = connect(db)
    try:
        for table in TABLES:
            path = str(folder / f"{table}.parquet")
            if table in OPTIONAL and not Path(path).is_file():
                continue
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM read_parquet(?)", [path])
    except duckdb.Error as e:
        raise StoreError(f"published folder {folder}: {str(e).strip().splitlines()[0]}") from None
    finally:
        con.close()
    _loaded[folder] = db
    return db
