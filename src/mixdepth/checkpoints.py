"""Checkpoints of one run in its own folder: the callback that writes them, the one a retried run resumes from, the
state of ours they carry (RNG streams, curve, wall time, model config), and what is left once the run is stored.

A run's folder (``RunConfig.ckpt_dir``, keyed by its run_id) holds Lightning checkpoints only: ``step=N.ckpt``
(``ModelCheckpoint``, the newest one kept), ``hpc_ckpt_K.ckpt`` (Lightning's SLURM auto-requeue on SIGUSR1: the
folder is the Trainer's ``default_root_dir``) and, with ``train.keep_ckpt``, ``final.ckpt``. ``load_model`` needs
no Lightning: the model's family config travels in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from mixdepth.models import MODELS

STATE = "mixdepth"  # our key in a Lightning checkpoint
FINAL = "final.ckpt"


def checkpoint_callback(ckpt_dir: Path, every: int) -> ModelCheckpoint:
    """A checkpoint every ``every`` optimizer steps into ``ckpt_dir``, the previous one removed once it is written."""
    return ModelCheckpoint(
        dirpath=ckpt_dir,
        filename="{step}",
        every_n_train_steps=every,
        save_top_k=1,  # with no monitored metric: the newest only
        enable_version_counter=False,
    )


def resume_path(ckpt_dir: Path) -> Path | None:
    """The checkpoint a run resumes from: the newest ``*.ckpt`` in its folder (None if there is none).

    Newest by modification time: a run only ever resumes from the newest file and writes later steps after it, so
    time order is step order across ``step=N``, ``hpc_ckpt_K`` and ``final``. Lightning writes each file whole
    (``_atomic_save``), so a process killed while saving leaves no partial ``.ckpt``. The older files are removed:
    nothing resumes from them, and every preemption under SLURM adds one ``hpc_ckpt``.
    """
    found = _oldest_first(ckpt_dir)
    for old in found[:-1]:
        old.unlink(missing_ok=True)  # every rank of a DDP run prunes the same files
    return found[-1] if found else None


def saved_step(ckpt_dir: Path) -> int:
    """The step of the checkpoint a run would resume from (``resume_path``, nothing pruned) when its name says it
    (``step=N``); 0 when there is none, its name does not (``hpc_ckpt_K``, ``final``), or the folder cannot be read
    (it is asked while a fault may be stopping the sweep)."""
    try:
        found = _oldest_first(ckpt_dir)
    except OSError:
        return 0
    named = re.fullmatch(r"step=(\d+)\.ckpt", found[-1].name) if found else None
    return int(named.group(1)) if named else 0


def _oldest_first(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("*.ckpt"), key=_mtime) if ckpt_dir.is_dir() else []


def _mtime(p: Path) -> int:
    try:
        return p.stat().st_mtime_ns
    except FileNotFoundError:  # pruned by another rank meanwhile: older than the newest, which no rank removes
        return 0


def drop_hpc_checkpoints(ckpt_dir: Path) -> None:
    """Remove the SLURM checkpoints once training is over: under SLURM, Lightning's ``validate`` (and any later
    ``fit``) given no ``ckpt_path`` loads the newest ``hpc_ckpt`` of ``default_root_dir``, the trained weights'
    past (found with a requeued run resumed from one)."""
    for p in ckpt_dir.glob("hpc_ckpt_*.ckpt"):
        p.unlink(missing_ok=True)


def rng_state() -> dict:
    """Every random stream a run draws from (torch, each visible GPU, numpy, python), as tensors and plain types:
    a checkpoint must load under ``torch.load(weights_only=True)``."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` saved (GPU streams on the devices this process sees)."""
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def model_spec(cfg) -> dict:
    """A family config as plain types: what ``load_model`` rebuilds the model from."""
    return {"arch": cfg.arch, "config": dataclasses.asdict(cfg)}


def load_model(ckpt_path: Path | str) -> nn.Module:
    """The model of a checkpoint, rebuilt from its stored family config and weights, on the CPU in eval mode.

    Raises:
        ValueError: the file is not a checkpoint written by ``train.fit``.
    """
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    if STATE not in ckpt:
        raise ValueError(f"{ckpt_path}: not a mixdepth checkpoint (no '{STATE}' entry)")
    spec = ckpt[STATE]["model"]
    config_cls, model_cls = MODELS[spec["arch"]]
    model = model_cls(config_cls(**spec["config"]))
    prefix = "model."  # LitLM holds the model as .model
    model.load_state_dict({k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)})
    return model.eval()


def finish_checkpoints(ckpt_dir: Path | str, keep: bool) -> None:
    """Once the run's row is stored: remove its folder, or with ``keep`` leave only ``final.ckpt`` in it.

    Raises:
        FileNotFoundError: ``keep`` and the folder has no ``final.ckpt`` (the run was trained without
            ``train.keep_ckpt``): nothing is removed.
    """
    ckpt_dir = Path(ckpt_dir)
    if not keep:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        return
    if not (ckpt_dir / FINAL).is_file():
        raise FileNotFoundError(f"{ckpt_dir / FINAL}: no final checkpoint to keep")
    for p in ckpt_dir.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        elif p.name != FINAL:
            p.unlink()
