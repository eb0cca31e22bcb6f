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


@pytest.fixture
def poison_empty():
    """NaN-fills every uninitialised floating-point allocation during the test (torch.empty, empty_like,
    empty_strided, Tensor.new_empty): an output element a kernel leaves unwritten fails the comparison."""
    with _poison_empty():
        yield


@pytest.fixture
def cli(tmp_path):
    """Run ``python -m <module> args...`` from a foreign directory; returns CompletedProcess.

    The subprocess sees no GPU: these tests run the CPU presets (``sweep.workers=2``, fp32), whose exact
    behaviour they check, and on a one-GPU machine ``train.accelerator=auto`` would otherwise pick the GPU and
    stop at "sweep.workers=2 needs one GPU each" before the behaviour under test."""
    import subprocess

    def run(module: str, *args: str, timeout: float = 600):
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""},
        )

    return run
