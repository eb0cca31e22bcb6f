"""SQL against the store: an aligned text table of any query, and Parquet export of tables and views."""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb

from analysis.errors import AnalysisError


def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        return f"{v:.6g}"
    return str(v).replace("\n", "\\n")


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned plain-text table; nothing is truncated, numbers are right-aligned, floats show 6 digits.

    Args:
        columns: header names.
        rows: values per row (None prints as NULL).

    Returns:
        The table followed by a "(N rows)" line, no trailing newline.
    """
    cells = [[_cell(v) for v in r] for r in rows]
    numeric = [
        all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows if r[i] is not None)
        for i in range(len(columns))
    ]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(vals: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line(columns), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def run_query(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    """Run one SQL statement and return its result as ``format_table`` text ("OK" for no result set)."""
    cur = con.execute(sql)
    if cur.description is None:
        return "OK"
    columns = [d[0] for d in cur.description]
    return format_table(columns, cur.fetchall())


def relations(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Names of the tables and views of the main schema."""
    rows = con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' ORDER BY table_name"
    ).fetchall()
    return [r[0] for r in rows]


def export_parquet(con: duckdb.DuckDBPyConnection, table: str, out: str | os.PathLike) -> int:
    """Write a table or view to a Parquet file (atomically: temp file, then rename).

    Args:
        con: store connection (read-only is enough).
        table: a table or view name; checked against the catalog, never spliced in unchecked.
        out: destination path; its folder must exist.

    Returns:
        Rows written.

    Raises:
        AnalysisError: unknown table or missing destination folder.
    """
    names = relations(con)
    if table not in names:
        raise AnalysisError(f"no table or view {table!r} (have: {', '.join(names)})")
    dest = Path(out)
    if not dest.parent.is_dir():
        raise AnalysisError(f"output folder {dest.parent} does not exist")
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
    ident = '"' + table.replace('"', '""') + '"'
    literal = "'" + str(tmp).replace("'", "''") + "'"
    try:
        con.execute(f"COPY (SELECT * FROM {ident}) TO {literal} (FORMAT parquet)")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    (count,) = con.execute(f"SELECT count(*) FROM {ident}").fetchone()
    return int(count)
