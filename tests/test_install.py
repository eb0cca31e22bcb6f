"""The built wheel, installed into a fresh virtual environment, runs a sweep from an empty folder: the presets and
every module it needs are inside the distribution (no editable install, no source tree on the path)."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ONE_RUN = [  # one dense run of a few seconds on the embedded corpus
    "sweep.name=wheel",
    "sweep.archs=[dense]",
    "sweep.budgets=[1e9]",
    "sweep.ladder=[{d_model: 16, n_layers: 1, n_heads: 2}]",
    "sweep.min_steps=4",
    "sweep.max_extra=0",
    "sweep.workers=1",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "data.val_tokens=2048",
    "train.batch_size=4",
    "train.progress=false",
]


def run(cmd: list, cwd: Path, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv holding this CPU torch and the wheel with its dependencies, the wheel, environment)."""
    tmp = tmp_path_factory.mktemp("install")
    # pip and the venv read nothing of this checkout or of the test environment (PYTHONPATH, an active venv)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET")}
    venv = tmp / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:  # e.g. Debian's python3 without python3-venv (no ensurepip)
        why = f"cannot make a virtual environment: {made.stderr.strip().splitlines()[-1:]}"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI runs the wheel test", pytrace=False)
        pytest.skip(why)
    # built from a copy: setuptools builds in the source folder (build/, *.egg-info), and a checkout's stale build/
    # would ship modules the tree no longer has
    skip = shutil.ignore_patterns(
        ".git",
        ".venv",
        "build",
        "*.egg-info",
        "__pycache__",
        ".*_cache",
        "*.db*",
        "*_report",
        "*_logs",
        "*_checkpoints",
        "lightning_logs",
    )
    shutil.copytree(ROOT, tmp / "src", symlinks=True, ignore=skip)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp / "dist", tmp / "src"], tmp, env)
    (wheel,) = (tmp / "dist").glob("mixdepth-*.whl")
    python = venv / "bin" / "python"
    # this torch first (the CPU build here: a bare requirement could pull a multi-GB CUDA one), then the wheel
    run([python, "-m", "pip", "install", "-q", f"torch=={torch.__version__}"], tmp, env)
    run([python, "-m", "pip", "install", "-q", wheel], tmp, env)
    return python, wheel, env


def test_the_wheel_holds_the_presets(installed):
    _, wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {f"sweeps/conf/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert presets and presets <= names
    for package in ("mixdepth", "mixdepth/models", "mixdepth/data", "sweeps", "analysis", "kernels"):
        assert f"{package}/__init__.py" in names, package


def test_the_installed_wheel_runs_a_sweep_from_an_empty_folder(installed, tmp_path):
    python, _, env = installed
    where = run([python, "-c", "import mixdepth, sweeps, analysis, kernels; print(sweeps.__file__)"], tmp_path, env)
    assert Path(where.stdout.strip()).is_relative_to(python.parent.parent)  # the venv's copy, not this checkout
    dry = run([python, "-m", "sweeps", "isoflop", "--dry-run", *ONE_RUN], tmp_path, env)
    assert "1 runs" in dry.stdout and not list(tmp_path.iterdir())
    r = run([python, "-m", "sweeps", "isoflop", "--db", "r.db", *ONE_RUN], tmp_path, env)
    assert "[1/1] val_loss=" in r.stdout and "trained 1 runs" in r.stdout
    assert (tmp_path / "r.db").is_file() and any((tmp_path / "r_report").glob("*/report.md"))
