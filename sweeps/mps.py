"""NVIDIA MPS for sweeps whose runs share a GPU (``sweep.workers_per_gpu > 1``).

Each run trains in its own worker process, and a GPU runs one process's context at a time (time-slicing): small
runs side by side then fill only the gaps of each other's streams. Under MPS (Multi-Process Service) their kernels
run on the GPU at once. ``serve`` starts a private MPS control daemon for the sweep's workers (its own pipe and log
folders, passed to the workers through the environment) and stops it when the sweep ends; a daemon that already
serves this user (``CUDA_MPS_PIPE_DIRECTORY`` set, or the default pipe present) is used as it is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mixdepth.config import ConfigError
from mixdepth.launch import environ_kept

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE = "/tmp/nvidia-mps"  # where a daemon started without CUDA_MPS_PIPE_DIRECTORY listens
ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
CLIENT = "import torch; torch.ones(1, device='cuda').add_(1); torch.cuda.synchronize()"
CLIENT_TIMEOUT_S = 120
QUIT_TIMEOUT_S = 15  # quit waits for the daemon's clients; a sweep's end (or its Ctrl-C) waits no longer than this


def client_error(env: dict[str, str]) -> str | None:
    """Whether a CUDA process starts under the daemon that ``env`` names: None, else why not (one line)."""
    try:
        r = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True,
                           timeout=CLIENT_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"a CUDA process did not start under it within {CLIENT_TIMEOUT_S} s"
    lines = r.stderr.strip().splitlines()
    return None if r.returncode == 0 else (lines[-1] if lines else f"a CUDA process exited with {r.returncode}")


def _quit(control: str, env: dict[str, str], root: str) -> None:
    """Stop the daemon; one that has not quit within ``QUIT_TIMEOUT_S`` is left with its folders and a note (the
    sweep ends as it would have: an interrupt stays an interrupt)."""
    try:
        subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=QUIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"note: the sweep's MPS daemon did not quit within {QUIT_TIMEOUT_S} s; it is left running"
              f" ({ENV[0]}={env[ENV[0]]})", file=sys.stderr)  # fmt: skip
        return
    shutil.rmtree(root, ignore_errors=True)


def _start(control: str, check: Callable[[dict], str | None]) -> tuple[dict[str, str], str, str | None]:
    """A control daemon with private pipe and log folders: (its environment, their root, None), or why it does not
    serve (then it is stopped again)."""
    root = tempfile.mkdtemp(prefix="mixdepth-mps-")
    env = {**os.environ, ENV[0]: os.path.join(root, "pipe"), ENV[1]: os.path.join(root, "log")}
    for k in ENV:
        os.makedirs(env[k])
    started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True)
    said = started.stderr.strip().splitlines() or [f"{CONTROL} -d exited with {started.returncode}"]
    why = said[-1] if started.returncode else check(env)
    if why:
        _quit(control, env, root)
    return env, root, why


@contextmanager
def serve(mode: str, gpus: list[str], check: Callable[[dict], str | None] = client_error) -> Iterator[str]:
    """MPS for the sweep's training slots (``gpus``: each slot's CUDA_VISIBLE_DEVICES) while inside.

    Yields how the slots that share a GPU run: "started" (a daemon of this sweep), "running" (one that was already
    there), or "time-sliced" (``mode`` never; auto without a working MPS; no GPU shared: "unshared").

    Raises:
        ConfigError: ``mode`` is "always" and MPS is not there or does not start (before any worker starts).
    """
    shared = len(set(gpus)) < len(gpus)
    if mode == "never" or not shared:
        yield "time-sliced" if shared else "unshared"
        return
    if os.environ.get(ENV[0]) or os.path.exists(os.path.join(DEFAULT_PIPE, "control")):
        yield "running"
        return
    control = shutil.which(CONTROL)
    env, root, why = _start(control, check) if control else ({}, "", f"{CONTROL} is not on PATH")
    if why:
        if mode == "always":
            raise ConfigError(
                f"sweep.mps=always: NVIDIA MPS is not available here ({why}); use sweep.mps=auto or never"
            )
        print(f"note: runs sharing a GPU are time-sliced, without MPS ({why})")
        yield "time-sliced"
        return
    with environ_kept(ENV):
        os.environ.update({k: env[k] for k in ENV})  # the workers, spawned later, inherit it
        try:
            yield "started"
        finally:
            _quit(control, env, root)
