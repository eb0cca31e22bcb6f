"""sweeps.mps: when a sweep starts NVIDIA MPS for workers that share a GPU, what it passes them, and that it stops it.

The control daemon here is a stand-in script on PATH that logs how it is called (this machine has no GPU); the
effect of MPS on a GPU sweep is measured on the H200 (BENCHMARKS.md, "GPU sweep utilisation")."""

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixdepth.config import ConfigError
from sweeps import mps

SHARED = ["0", "0", "0"]


def fake_control(tmp_path: Path, monkeypatch, code: int = 0, quit_s: float = 0) -> Path:
    """An ``nvidia-cuda-mps-control`` on PATH that appends its argv, stdin and MPS pipe folder to a log (and takes
    ``quit_s`` seconds to answer a quit)."""
    log = tmp_path / "calls.log"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / mps.CONTROL
    script.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(if [ -z "$1" ]; then cat; fi)" >> {log}\n'
        + (f"echo 'An instance of this daemon is already running' >&2; exit {code}\n" if code else "")
        + (f'if [ -z "$1" ]; then sleep {quit_s}; fi\n' if quit_s else "")
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE", str(tmp_path / "no-default-daemon"))
    return log


def test_started_for_the_workers_and_quit_at_the_end(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch)
    checked = []
    with mps.serve("auto", SHARED, check=lambda env: checked.append(env[mps.ENV[0]])) as how:
        assert how == "started"
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert checked == [pipe] and os.path.isdir(pipe) and os.path.isdir(os.environ["CUDA_MPS_LOG_DIRECTORY"])
        child = subprocess.run(  # a spawned worker inherits it
            [sys.executable, "-c", "import os; print(os.environ['CUDA_MPS_PIPE_DIRECTORY'])"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert child.stdout.strip() == pipe
        assert log.read_text().splitlines() == [f"args=-d pipe={pipe} stdin="]
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and "CUDA_MPS_LOG_DIRECTORY" not in os.environ
    assert log.read_text().splitlines()[1] == f"args= pipe={pipe} stdin=quit"
    assert not Path(pipe).parent.exists()  # its private folders are removed


def test_quit_also_when_the_sweep_is_stopped(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch)
    with pytest.raises(KeyboardInterrupt), mps.serve("always", SHARED, check=lambda env: None):
        raise KeyboardInterrupt
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["args=-d", "args="]
    assert log.read_text().endswith("stdin=quit\n")


def test_a_daemon_that_does_not_quit_keeps_no_one_waiting(tmp_path, monkeypatch, capsys):
    """A quit that hangs (its clients not gone) costs the sweep QUIT_TIMEOUT_S, not the interrupt: Ctrl-C stays
    Ctrl-C, and one line says the daemon is left running."""
    fake_control(tmp_path, monkeypatch, quit_s=30)
    monkeypatch.setattr(mps, "QUIT_TIMEOUT_S", 1)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt), mps.serve("auto", SHARED, check=lambda env: None):
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        raise KeyboardInterrupt
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert err == f"note: the sweep's MPS daemon did not quit within 1 s; it is left running ({mps.ENV[0]}={pipe})\n"
    assert os.path.isdir(pipe) and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


@pytest.mark.parametrize("gpus", [[], ["0"], ["0", "1"], ["0,1", "2,3"]])
def test_nothing_started_where_no_gpu_is_shared(tmp_path, monkeypatch, gpus):
    log = fake_control(tmp_path, monkeypatch)
    with mps.serve("always", gpus, check=lambda env: pytest.fail("no client check")) as how:
        assert how == "unshared"
    assert not log.exists()


def test_never_time_slices(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch)
    with mps.serve("never", ["0,1", "0,1"]) as how:
        assert how == "time-sliced" and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert not log.exists()


def test_a_daemon_already_serving_is_used_as_it_is(tmp_path, monkeypatch):
    log = fake_control(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "theirs"))
    with mps.serve("always", SHARED) as how:
        assert how == "running" and os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "theirs")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    (tmp_path / "no-default-daemon").mkdir()
    (tmp_path / "no-default-daemon" / "control").touch()  # a daemon on the default pipe
    with mps.serve("auto", SHARED) as how:
        assert how == "running"
    assert not log.exists()


def test_no_control_binary(tmp_path, monkeypatch, capsys):
    fake_control(tmp_path, monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with mps.serve("auto", SHARED) as how:
        assert how == "time-sliced"
    assert capsys.readouterr().out == (
        "note: runs sharing a GPU are time-sliced, without MPS (nvidia-cuda-mps-control is not on PATH)\n"
    )
    with pytest.raises(ConfigError, match=r"^sweep.mps=always: NVIDIA MPS is not available here \(nvidia-cuda-mps"):
        with mps.serve("always", SHARED):
            pytest.fail("entered without MPS")


def test_a_daemon_that_does_not_start_or_serve(tmp_path, monkeypatch, capsys):
    log = fake_control(tmp_path, monkeypatch, code=1)
    with mps.serve("auto", SHARED, check=lambda env: pytest.fail("no client check")) as how:
        assert how == "time-sliced" and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert "(An instance of this daemon is already running)" in capsys.readouterr().out
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["args=-d", "args="]  # quit all the same
    (tmp_path / "b").mkdir()
    log = fake_control(tmp_path / "b", monkeypatch)
    with pytest.raises(ConfigError, match=r"^sweep.mps=always: .*\(no CUDA device\); use sweep.mps=auto or never$"):
        with mps.serve("always", SHARED, check=lambda env: "no CUDA device"):
            pass
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["args=-d", "args="]  # stopped again


def test_the_client_check_runs_a_cuda_process(monkeypatch):
    """Without a GPU the real check names why a CUDA process could not start (one line)."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        assert mps.client_error(dict(os.environ)) is None
    else:
        why = mps.client_error(dict(os.environ))
        assert why and "\n" not in why
