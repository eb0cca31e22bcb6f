"""How a run's processes start: ``cluster()`` describes the launch this process belongs to, ``check_devices`` checks
a train config against this host before anything is written, ``launch`` runs a function on every rank of a run.

A run spans ``train.devices * train.num_nodes`` ranks. Started by an external launcher (``torchrun``, ``srun``, LSF,
MPI: Lightning's cluster environments, detected in Lightning's order), this process is one rank and ``launch`` just
calls the function; every rank calls ``train.fit``. Otherwise, for more than one device, ``launch`` starts
``train.devices`` local processes (``python -m mixdepth.launch``) with the variables Lightning's
``LightningEnvironment`` reads (``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so Lightning
takes them as externally launched and never re-runs ``sys.argv`` (its default launcher for ``strategy=ddp`` does,
which inside a sweep's spawned pool worker would start the sweep again), and hands rank 0's value back. Many
nodes need an external launcher.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.fabric.plugins.environments import (
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from mixdepth.config import FSDP_CPU, ConfigError, TrainConfig, check_graph_step, check_rules, micro_batch

R = TypeVar("R")

# SLURMEnvironment.detect() advises prepending srun whenever srun is on PATH: a host with SLURM's tools runs
# one-host sweeps and their own ranks without it, and that advice would be a second line after a one-line error.
warnings.filterwarnings("ignore", message=".*`srun` command is available on your system but is not used.*")

# Lightning's _AcceleratorConnector tries these in this order before falling back to LightningEnvironment.
EXTERNAL = {
    TorchElasticEnvironment: "torchrun",
    SLURMEnvironment: "slurm",
    LSFEnvironment: "lsf",
    MPIEnvironment: "mpi",
}


@dataclass(frozen=True)
class Cluster:
    """The launch this process is part of.

    Attributes:
        global_rank: this process's rank among all ranks of a run (0: the one that reports).
        world_size: ranks started by the launcher (1 when nothing launched us).
        local_rank: rank on this node (selects the GPU).
        node_rank: this node's rank.
        main_address: rank 0's host, where the process group meets.
        main_port: the port it meets on (0: none chosen yet).
        external: a launcher started this process (torchrun, srun, ``launch``'s own ranks); then every rank must
            call ``train.fit`` for the same run, in the same order.
        launcher: ``torchrun``, ``slurm``, ``lsf``, ``mpi``, ``local`` (ranks given by ``LOCAL_RANK``/``RANK``/
            ``WORLD_SIZE``, as ``launch`` starts them) or ``none``.
    """

    global_rank: int
    world_size: int
    local_rank: int
    node_rank: int
    main_address: str
    main_port: int
    external: bool
    launcher: str


def cluster() -> Cluster:
    """The launch this process is part of, read from the cluster environment Lightning's Trainer would pick."""
    for env_type, name in EXTERNAL.items():
        if env_type.detect():
            env = env_type()
            return Cluster(
                env.global_rank(), env.world_size(), env.local_rank(), env.node_rank(), env.main_address,
                env.main_port, True, name,
            )  # fmt: skip
    env = LightningEnvironment()
    if "LOCAL_RANK" not in os.environ:
        return Cluster(0, 1, 0, 0, env.main_address, int(os.environ.get("MASTER_PORT", 0)), False, "none")
    local = env.local_rank()
    rank, world = int(os.environ.get("RANK", local)), int(os.environ.get("WORLD_SIZE", 1))
    return Cluster(rank, world, local, env.node_rank(), env.main_address, env.main_port, True, "local")


def resolve_device(t: TrainConfig) -> tuple[str, str]:
    """(accelerator, precision) with ``auto`` resolved: bf16-mixed on a GPU, fp32 on the CPU."""
    accelerator = t.accelerator if t.accelerator != "auto" else ("gpu" if torch.cuda.is_available() else "cpu")
    precision = t.precision if t.precision != "auto" else ("bf16-mixed" if accelerator == "gpu" else "32-true")
    return accelerator, precision


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask: taskset and cgroup cpusets count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# The package each train.logger needs beyond Lightning (tensorboard: either writer Lightning's logger takes); the
# extra of the same name installs it.
LOGGER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",)}


def check_devices(t: TrainConfig) -> None:
    """Check a train config against this host and its launch; call before opening any store.

    Devices present: GPUs are ``torch.cuda.device_count()`` (per node); on the CPU each rank needs a core of its
    own (``cpu_cores()``), else the ranks only slice the same cores finer. The package ``train.logger`` needs must
    be installed here.

    Raises:
        ConfigError: one line naming the key: a RULES violation (e.g. an unknown strategy), a batch that does not
            split over the ranks, more devices than present, FSDP on the CPU, ``train.graph_step`` where it cannot
            capture (``config.check_graph_step``), a launcher that started another number of ranks than
            ``devices * num_nodes``, ``num_nodes > 1`` with no launcher, or a logger whose package is missing.
    """
    check_rules("train", t)
    micro_batch(t)
    if (need := LOGGER_PACKAGES.get(t.logger)) and not any(importlib.util.find_spec(p) for p in need):
        raise ConfigError(f"train.logger={t.logger} needs the {need[0]} package: pip install 'mixdepth[{t.logger}]'")
    if t.accelerator == "gpu" and not torch.cuda.is_available():
        raise ConfigError("train.accelerator=gpu, but no GPU is visible; use auto or cpu")
    accelerator, _ = resolve_device(t)
    if accelerator == "gpu":
        present, what = torch.cuda.device_count(), "GPUs visible"
    else:
        present, what = cpu_cores(), "CPU cores (one process per core at least)"
    if t.devices > present:
        raise ConfigError(f"train.devices={t.devices} but this host has {present} {what}")
    if t.strategy == "fsdp" and accelerator == "cpu":
        raise ConfigError(FSDP_CPU)
    check_graph_step(t, accelerator)
    world, c = t.devices * t.num_nodes, cluster()
    if c.external and c.world_size != world:
        raise ConfigError(
            f"train.devices * train.num_nodes = {t.devices} * {t.num_nodes} but {c.launcher} started "
            f"{c.world_size} processes; start one per device (torchrun --nproc-per-node, srun --ntasks-per-node)"
        )
    if not c.external and t.num_nodes > 1:
        raise ConfigError(f"train.num_nodes={t.num_nodes} needs a launcher on every node (srun or torchrun)")


def launch(fn: Callable[..., R], t: TrainConfig, *args: Any) -> R:
    """``fn(*args)`` on every rank of a run of ``t``; returns rank 0's value (this process's, when launched externally).

    Without an external launcher and with ``t.devices > 1``, starts ``t.devices`` local processes (see the module
    docstring) that die with this one; ``OMP_NUM_THREADS`` is the cores shared out between them unless set. An
    exception in a rank ends the others and is raised here (one that cannot be pickled as a RuntimeError with its
    first line).
    """
    if t.devices * t.num_nodes == 1:
        with environ_kept(LAUNCH_VARS):
            return fn(*args)
    if cluster().external:
        value = fn(*args)
        atexit.unregister(destroy_group)  # once per process, however many runs it trains
        atexit.register(destroy_group)  # after a run that ended well: every rank is through its collectives
        return value
    with tempfile.TemporaryDirectory(prefix="mixdepth-ranks-") as tmp:
        folder = Path(tmp)
        (folder / "job.pkl").write_bytes(pickle.dumps((fn, args)))
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(find_free_network_port()),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(t.devices),
            "PYTHONPATH": os.pathsep.join([p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]),
        }
        env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_cores() // t.devices)))
        cmd = [sys.executable, "-m", "mixdepth.launch", str(folder), str(os.getpid())]
        procs = [subprocess.Popen(cmd, env={**env, "LOCAL_RANK": str(r), "RANK": str(r)}) for r in range(t.devices)]
        try:
            codes = _wait(procs)
        finally:
            for p in procs:  # a rank left waiting in a collective for a failed one never ends by itself
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return _outcome(folder, codes)


# Lightning's DDP and FSDP strategies set these in os.environ even for one process; left there, the next run in this
# process would take itself for a rank that a launcher started.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE")


@contextmanager
def environ_kept(keys: tuple[str, ...]) -> Iterator[None]:
    """Restore the environment variables ``keys`` as they were on entry (set, changed or removed inside)."""
    before = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def destroy_group() -> None:
    """Destroy the default process group, if any, once a rank's runs ended well (a failed rank leaves it: its peers
    may still wait in a collective). Left to the C++ destructors at exit, a gloo group can abort a process whose
    work is done ("terminate called without an active exception", SIGABRT: seen under torchrun and under this
    module's own ranks)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _wait(procs: list[subprocess.Popen]) -> list[int | None]:
    """Exit codes once every rank ended well or one failed (None: still running then)."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
            return codes
        time.sleep(0.05)


def _outcome(folder: Path, codes: list[int | None]) -> Any:
    """Rank 0's value once it wrote one: its ``fit`` returned, so every rank got through the run's collectives, and a
    rank that dies after that (an abort in a process group's teardown) changes nothing. Else the first failed rank's
    exception, or that a rank died."""
    said = {r: pickle.loads(p.read_bytes()) for r in range(len(codes)) if (p := folder / f"rank{r}.pkl").exists()}
    if 0 in said and said[0][0] == "ok":
        return said[0][1]
    for rank, code in enumerate(codes):  # the first failed rank that said why, else the first that failed
        if code not in (None, 0) and rank in said:
            raise said[rank][1]
    if any(c not in (None, 0) for c in codes):
        rank, code = next((r, c) for r, c in enumerate(codes) if c not in (None, 0))
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        raise RuntimeError(f"rank {rank} of {len(codes)} died ({how})")
    raise RuntimeError("rank 0 ended without a result")


def die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` exits (Linux), and exit now if it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _rank_main(folder: Path, parent: int) -> int:
    """One rank started by ``launch``: run the job; rank 0 writes the value, a failing rank its exception."""
    die_with(parent)
    rank = int(os.environ["RANK"])
    fn, args = pickle.loads((folder / "job.pkl").read_bytes())
    try:
        out, code = ("ok", fn(*args)), 0
    except BaseException as e:  # KeyboardInterrupt too: the caller raises it as fit would
        out, code = ("error", e), 1
    if rank == 0 or code:
        try:
            data = pickle.dumps(out)
        except Exception:
            text = str(out[1]).strip()
            why = text.splitlines()[0] if text else type(out[1]).__name__
            data = pickle.dumps(("error", RuntimeError(f"rank {rank}: {why}")))
        (folder / f"rank{rank}.pkl").write_bytes(data)
    if not code:
        destroy_group()
    return code


if __name__ == "__main__":
    sys.exit(_rank_main(Path(sys.argv[1]), int(sys.argv[2])))
