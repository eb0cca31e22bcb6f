import os
import sys
from pathlib import Path

import pytest
import torch

from kernels.testing import poison_empty as _poison_empty

# Triton decides at decoration time whether a kernel is interpreted, and model modules import kernels
# while test modules are collected: without a GPU, switch the interpreter on before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures"


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory):
    """Tokenised corpora are cached per session, away from the user's ~/.cache."""
    os.environ.setdefault("MIXDEPTH_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def val_losses():
    """``val_losses(db) -> {run_id: val_loss}`` of a store, checking that no run is stored twice: how the sweep
    tests compare a resumed or faulted sweep with an uninterrupted one."""
    import duckdb

    def read(db) -> dict[str, float]:
        con = duckdb.connect(str(db), read_only=True)
        try:
            rows = con.execute("SELECT run_id, val_loss FROM runs").fetchall()
        finally:
            con.close()
        assert len(rows) == len({r for r, _ in rows}), rows
        return dict(rows)

    return read


@pytest.fixture(scope="session")
def status_row():
    """``status_row(stdout, name) -> {column: value}``: the row of ``python -m sweeps status`` output whose name
    column is ``name`` (cells are apart by at least two spaces; a cell holds at most one)."""
    import re

    def row(stdout: str, name: str) -> dict[str, str]:
        lines = stdout.splitlines()
        head = re.split(r"\s{2,}", lines[0].strip())
        for line in lines[1:]:
            cells = dict(zip(head, re.split(r"\s{2,}", line.strip()), strict=False))
            if cells.get("name") == name:
                return cells
        raise AssertionError(f"no sweep named {name!r} in:\n{stdout}")

    return row


@pytest.fixture
def poison_empty():
    """NaN-fills every uninitialised floating-point allocation during the test (torch.empty, empty_like,
    empty_strided, Tensor.new_empty): an output element a kernel leaves unwritten fails the comparison."""
    with _poison_empty():
        yield


@pytest.fixture(scope="session")
def cli_env() -> dict[str, str]:
    """The environment of every ``python -m sweeps|analysis`` subprocess the tests start: unbuffered, and no GPU.

    These tests check the CPU presets' exact behaviour (``sweep.workers=2``, fp32); on a one-GPU machine
    ``train.accelerator=auto`` would pick the GPU and stop at "sweep.workers=2 needs one GPU each" first.
    """
    return {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture
def cli(tmp_path, cli_env):
    """Run ``python -m <module> args...`` from a foreign directory (environment ``cli_env``); CompletedProcess."""
    import subprocess

    def run(module: str, *args: str, timeout: float = 600):
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=cli_env,
        )

    return run


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL server for the session (``tests/pg.py``): ``postgres.new_db()`` is the URL of a fresh
    database for one test. Where it cannot run, the test fails in CI (``CI`` set) and is skipped elsewhere."""
    from tests.pg import Postgres, unavailable

    if why := unavailable():
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI runs the PostgreSQL tests", pytrace=False)
        pytest.skip(why)
    pg = Postgres()
    try:
        yield pg.start()
    finally:
        pg.stop()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real SLURM cluster of two nodes on this host (tests/slurm.py); skipped where SLURM is not installed,
    except in CI, which installs it."""
    from tests.slurm import missing, slurm_cluster

    if why := missing():
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
