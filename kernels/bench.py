"""Kernel benchmarks: ``python -m kernels.bench <op> [op options] [--csv PATH] [--md]``.

Each op registers one entry in ``BENCHES``: ``add_args(parser)`` adds its options, ``run(args)`` times its
peers side by side in this process (medians of ``triton.testing.do_bench``) and returns
``(rows, markdown)``: rows (dicts, one per measurement) go to the CSV, the markdown table to stdout with
``--md``. Entries are imported lazily, so one op's missing dependency does not break the others.

Adding an op: write ``kernels/<op>/bench.py`` and add one line to ``BENCHES``.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchEntry:
    """Where an op's benchmark lives: ``module`` must define ``add_args(parser)`` and ``run(args)``."""

    module: str
    help: str = ""

    def load(self):
        return importlib.import_module(self.module)


def _route_gather_scatter_adapter():
    """Adapter for kernels/route_gather_scatter/bench.py (function-style entry)."""
    from kernels.route_gather_scatter.bench import bench_route_gather_scatter

    class _M:
        @staticmethod
        def add_args(p):
            p.add_argument("--T", type=int, nargs="+", default=[2048])
            p.add_argument("--B", type=int, default=8)
            p.add_argument("--D", type=int, default=1024)
            p.add_argument("--K", type=int, default=256)

        @staticmethod
        def run(args):
            rows = [r for T in args.T for r in bench_route_gather_scatter(B=args.B, T=T, D=args.D, K=args.K)]
            return rows, markdown_table(rows)

    return _M


BENCHES: dict[str, BenchEntry | Callable[[], object]] = {
    "moda_attn": BenchEntry("kernels.moda_attn.bench", "MoDA attention fwd+bwd vs SDPA flash/cuDNN, Flex"),
    "route_gather_scatter": _route_gather_scatter_adapter,
    "grouped_mlp": BenchEntry("kernels.grouped_mlp.bench", "grouped expert SwiGLU fwd+bwd vs torch loop, dense"),
    "linear_ce": BenchEntry("kernels.linear_ce.bench", "fused linear + cross-entropy fwd+bwd vs torch, compile, Liger"),
}


def _load(name: str):
    entry = BENCHES[name]
    return entry.load() if isinstance(entry, BenchEntry) else entry()


def markdown_table(rows: list[dict[str, object]]) -> str:
    """Plain markdown table of all row keys (in first-seen order)."""
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))

    def cell(x):
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(rows: list[dict[str, object]], path: str) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="op", required=True, metavar="op")
    mods = {}
    for name in BENCHES:
        p = sub.add_parser(name)
        p.add_argument("--csv", default=None, help="write all rows to this CSV file")
        p.add_argument("--md", action="store_true", help="print the markdown table")
        op = argv[0] if argv else None
        if name == op:  # import only the op asked for
            mods[name] = _load(name)
            mods[name].add_args(p)
    args = parser.parse_args(argv)
    rows, md = mods[args.op].run(args)
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {len(rows)} rows to {args.csv}")
    if args.md:
        print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
