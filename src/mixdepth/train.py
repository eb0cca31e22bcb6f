"""``fit(run) -> RunResult``: one training run with Lightning, measured into the store's ``RunMetrics``.

No database connection and no Optuna here: the caller (sweeps/runner.py) stores what ``fit`` returns. A run on
several devices or nodes is started by mixdepth.launch; every rank returns the same RunResult (rank 0's figures).
"""

from __future__ import annotations

import logging
import math
import platform
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.strategies import FSDPStrategy, Strategy
from torch.distributed.fsdp import MixedPrecision

from mixdepth.checkpoints import FINAL, checkpoint_callback, drop_hpc_checkpoints, resume_path
from mixdepth.config import DataConfig, TrainConfig, micro_batch
from mixdepth.flops import train_flops
from mixdepth.launch import check_devices, launch, resolve_device
from mixdepth.lit import LitLM, LMDataModule
from mixdepth.models import MODELS
from mixdepth.results import RunMetrics, blew_up
from mixdepth.throughput import PeakMemory, PeakThroughputMonitor, cadence

# Dense bf16 peak FLOP/s of chips Lightning does not name correctly ("NVIDIA H200" is not in its table).
PEAK_FLOPS = {"H200": 989.5e12, "H100": 989.5e12}


@dataclass(frozen=True)
class RunConfig:
    model: Any  # a family config from mixdepth.models.MODELS
    data: DataConfig
    train: TrainConfig
    steps: int
    ckpt_dir: str | None = None  # this run's checkpoint folder (keyed by its run_id); None: no checkpoints
    log_dir: str | None = None  # train.logger's folder of this run (<logs>/<sweep_id>/<run_id>); None: lightning_logs


@dataclass(frozen=True)
class RunResult:
    metrics: RunMetrics  # what the store keeps of the run (one row of ``runs`` with the plan)
    curve: list[dict] = field(default_factory=list)  # step, tokens, flops, train_loss, lm_loss, lr: every log_every
    resumed_step: int = 0  # the step the run resumed at from its checkpoint (0: trained from the start)


def device_name(accelerator: str, world: int = 1) -> str:
    """The chip (CPU: architecture and threads per rank), and the rank count when there are several."""
    cpu = f"cpu:{platform.machine()}x{torch.get_num_threads()}"
    name = torch.cuda.get_device_name(0) if accelerator == "gpu" else cpu
    return f"{name} ({world} ranks)" if world > 1 else name


def peak_flops(train: TrainConfig, accelerator: str, precision: str) -> float | None:
    """The peak MFU is measured against: the config's, our table's, then Lightning's; None if unknown."""
    if train.peak_flops > 0:
        return train.peak_flops
    if accelerator != "gpu":
        return None
    name = torch.cuda.get_device_name(0)
    for chip, peak in PEAK_FLOPS.items():
        if chip in name and "bf16" in precision:
            return peak
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32
    flops = get_available_flops(torch.device("cuda", 0), dtype)
    return float(flops) if flops else None


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "lightning": L.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out


def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for msg in ("does not have many workers", "no `val_dataloader`", "LeafSpec", "sync_dist", "FLOPs not found"):
        warnings.filterwarnings("ignore", message=f".*{msg}.*")
    # a resumed run's sampler is resumable (ShardedBatchSampler's start step), which Lightning cannot see
    warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")


def run_logger(t: TrainConfig, log_dir: str | None) -> Logger | bool:
    """Lightning's logger of ``t.logger`` for the run whose folder is ``log_dir`` (``<logs>/<sweep_id>/<run_id>``,
    the parent and folder names naming the sweep and the run; None: ./lightning_logs), or False (``none``).

    csv and tensorboard write ``version_<k>/`` in the folder, one for each attempt of the run; wandb runs offline
    (``wandb sync`` uploads later) in project ``<sweep_id>``; mlflow keeps the sweep's runs in the store
    ``file:<logs>/<sweep_id>/mlruns``, experiment ``<sweep_id>``. Nothing needs a network.
    """
    if t.logger == "none":
        return False
    folder = Path(log_dir or "lightning_logs").absolute()
    folder.mkdir(parents=True, exist_ok=True)
    sweep, run = folder.parent.name, folder.name
    if t.logger == "csv":
        return CSVLogger(folder, name="")
    if t.logger == "tensorboard":
        return TensorBoardLogger(folder, name="")
    if t.logger == "wandb":
        return WandbLogger(name=run, save_dir=folder, project=sweep, offline=True)
    return MLFlowLogger(experiment_name=sweep, run_name=run, tracking_uri=f"file:{folder.parent / 'mlruns'}")


def strategy(t: TrainConfig) -> str | Strategy:
    """Lightning's strategy for ``t.strategy``. FSDP trains the run DDP would: fp32 weights gathered and fp32
    gradients reduced, bf16 from autocast alone (Lightning's FSDP default under bf16-mixed gathers bf16 copies of the
    weights and reduces bf16 gradients: another experiment than the same run on one device or under DDP)."""
    if t.strategy != "fsdp":
        return t.strategy
    fp32 = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    return FSDPStrategy(mixed_precision=fp32)


def make_trainer(
    t: TrainConfig,
    steps: int,
    accelerator: str,
    precision: str,
    callbacks: list,
    root_dir: str | None = None,
    logger: Logger | bool = False,
) -> L.Trainer:
    """The Trainer every run uses (benchmarks time this same object): ``t.devices`` per node on ``t.num_nodes``.
    ``root_dir``: the run's checkpoint folder, where Lightning's SLURM auto-requeue (SIGUSR1) saves
    ``hpc_ckpt_K.ckpt`` and looks for one to resume from. ``logger``: ``run_logger``'s (the curve points and the
    validation metrics reach it through ``LitLM``, the throughput through Lightning's monitor)."""
    return L.Trainer(
        accelerator=accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy(t),  # auto: one device alone, DDP (gloo on CPU, nccl on GPU) for more; ddp; fsdp
        precision=precision,
        max_steps=steps,
        logger=logger,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),  # else Lightning adds its own
        enable_model_summary=False,
        enable_progress_bar=t.progress,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        log_every_n_steps=t.log_every,
        use_distributed_sampler=False,
        default_root_dir=root_dir,
    )


def _call(trainer: L.Trainer, trainer_fn, *args, **kwargs) -> None:
    """``trainer.fit``/``validate``, with Ctrl-C and SIGTERM kept as KeyboardInterrupt: Lightning turns them into
    ``sys.exit(1)`` (and leaves SIGINT ignored), which a sweep would end on with nothing said."""
    sigint = signal.getsignal(signal.SIGINT)
    try:
        trainer_fn(*args, **kwargs)
    except SystemExit:
        if not trainer.interrupted:
            raise
        signal.signal(signal.SIGINT, sigint)
        raise KeyboardInterrupt from None


def fit(run: RunConfig, cache_dir: Path | None = None, callbacks: Sequence[Callback] = ()) -> RunResult:
    """Train ``run.model`` for ``run.steps`` steps and evaluate on the fixed held-out set.

    On ``train.devices * train.num_nodes`` ranks each step sees ``train.batch_size`` sequences in all; without an
    external launcher the ranks are started here (mixdepth.launch) and the result comes back to this process.
    ``callbacks``: Lightning callbacks added to the run's own (benchmarks' profilers).

    Raises:
        ConfigError: the devices asked for are not there (``launch.check_devices``), before anything is trained.
    """
    _quiet()
    check_devices(run.train)
    return launch(_fit, run.train, run, cache_dir, tuple(callbacks))


def _fit(run: RunConfig, cache_dir: Path | None, callbacks: tuple[Callback, ...] = ()) -> RunResult:
    """``fit`` on one rank."""
    _quiet()
    entered = time.perf_counter()
    t = run.train
    if t.threads > 0:
        torch.set_num_threads(t.threads)
    accelerator, precision = resolve_device(t)
    L.seed_everything(t.seed, verbose=False)

    world = t.devices * t.num_nodes
    dm = LMDataModule(run.data, batch_size=micro_batch(t), seed=t.seed, cache_dir=cache_dir)
    dm.setup("fit")
    corpus = dm.corpus
    model = MODELS[run.model.arch][1](run.model)
    if t.compile:
        model.compile(mode=None if t.compile_mode == "default" else t.compile_mode, scope=t.compile_scope)
    tokens_per_batch = t.batch_size * run.data.seq_len  # the optimizer step's, over all ranks
    fpt = run.model.flops_per_token()
    lit = LitLM(model, t, run.steps, flops_per_batch=train_flops(fpt, tokens_per_batch) / world)
    peak = peak_flops(t, accelerator, precision)
    every, window = cadence(run.steps, t.log_every)
    monitor, memory = PeakThroughputMonitor(peak, every=every, window_size=window), PeakMemory()
    ckpt_dir = Path(run.ckpt_dir) if run.ckpt_dir else None
    saver = [checkpoint_callback(ckpt_dir, t.ckpt_every)] if ckpt_dir and t.ckpt_every else []
    logger = run_logger(t, run.log_dir)
    if logger:
        logger.log_hyperparams({"model": asdict(run.model), "data": asdict(run.data), "train": asdict(t)})
    trainer = make_trainer(
        t, run.steps, accelerator, precision, [monitor, memory, *saver, *callbacks], run.ckpt_dir, logger
    )
    resume = resume_path(ckpt_dir) if ckpt_dir else None
    lit.started = time.perf_counter()
    setup = lit.started - entered  # corpus, model, compile wrapper, trainer (not the compilation: the first steps)
    _call(trainer, trainer.fit, lit, datamodule=dm, ckpt_path=resume)  # the datamodule: its loaders see the rank
    wall = lit.wall_s()
    evaluated = time.perf_counter()
    if ckpt_dir:
        drop_hpc_checkpoints(ckpt_dir)
    if ckpt_dir and t.keep_ckpt:
        trainer.save_checkpoint(ckpt_dir / FINAL)
    trainer.limit_val_batches = 1.0
    with torch.compiler.set_stance("force_eager"):  # a few batches: compiling the inference graph costs more
        _call(trainer, trainer.validate, lit, datamodule=dm, verbose=False)
    evaluated = time.perf_counter() - evaluated  # the final checkpoint and the held-out evaluation

    # The ThroughputMonitor measures on rank 0 only (per device, items = this rank's tokens); every rank returns
    # rank 0's figures. Its device/mfu is per-device FLOP/s (flops_per_batch is per device) over the per-device peak.
    tp, wall, setup, evaluated = trainer.strategy.broadcast(
        (monitor.summary() if trainer.is_global_zero else None, wall, setup, evaluated), src=0
    )
    peak_bytes = memory.bytes
    if peak_bytes is not None:  # the rank that held the most (FSDP's shards and DDP's buckets may differ)
        held = torch.tensor(float(peak_bytes), device=trainer.strategy.root_device)
        peak_bytes = trainer.strategy.reduce(held, reduce_op="max").item()
    tokens = run.steps * tokens_per_batch
    tail = lit.curve[-max(1, len(lit.curve) // 10) :]
    stats = dict(lit.val_metrics)  # what is left after the losses: routing statistics
    losses = {"val_loss": stats.pop("val_loss", float("nan"))}
    losses["train_loss"] = sum(p["train_loss"] for p in tail) / len(tail)
    if all("lm_loss" in p for p in tail):  # points restored from a checkpoint saved before curves held it lack it
        losses["train_lm_loss"] = sum(p["lm_loss"] for p in tail) / len(tail)
    if "val_loss_causal" in stats:
        losses["val_loss_causal"] = stats.pop("val_loss_causal")
    diverged = blew_up(lit.curve) or not all(math.isfinite(v) for v in losses.values())
    if diverged:  # a loss not finite or blown up is no result: losses and statistics NULL, never a number to fit
        losses, stats = dict.fromkeys(losses), {}
    tps = tp["device/items_per_sec"] * world if "device/items_per_sec" in tp else tokens / wall  # global tokens/s
    metrics = RunMetrics(
        status="diverged" if diverged else "ok",
        val_loss=losses["val_loss"],
        val_loss_causal=losses.get("val_loss_causal"),
        train_loss=losses["train_loss"],
        train_lm_loss=losses.get("train_lm_loss"),
        wall_s=wall,
        setup_s=setup,
        eval_s=evaluated,
        peak_memory_gib=None if peak_bytes is None else peak_bytes / 2**30,
        tokens_per_s=tps,
        mfu=tp.get("device/mfu"),
        peak_flops=peak,
        device=device_name(accelerator, world),
        precision=precision,
        versions=versions(),
        corpus=corpus.name,
        corpus_fingerprint=corpus.fingerprint,
        corpus_tokens=corpus.train.numel(),
        routing_stats={k: v if math.isfinite(v) else None for k, v in stats.items()} or None,  # JSON: no NaN
    )
    return RunResult(metrics, lit.curve, lit.resumed_step)
