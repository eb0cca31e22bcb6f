"""The Lightning edge: ``LitLM`` (loss, torchmetrics, AdamW with warmup + cosine, analytic FLOPs per batch) and
``LMDataModule`` (the corpus's token windows as batches).

The model (models/*) and the data (data/*) know nothing of Lightning; this file and train.py are the only
places that do.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.data import BatchSampler, DataLoader

from mixdepth.checkpoints import STATE, model_spec, rng_state, set_rng_state
from mixdepth.config import CUDA_GRAPH_MODES, DataConfig, DataError, TrainConfig
from mixdepth.data import Corpus, ShardedBatchSampler, TokenWindows, as_batch, load_corpus
from mixdepth.graphs import StepGraph


def lr_lambda(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def warmup_steps(c: TrainConfig, total: int) -> int:
    """A run of ``total`` steps warms up over its share ``c.warmup_frac``, at least ``c.warmup_steps`` of them (at
    most half the run: the floor keeps the short runs of a sweep from starting at full rate) and at least one."""
    return max(1, round(c.warmup_frac * total), min(c.warmup_steps, total // 2))


class LitLM(L.LightningModule):
    """Wraps an LM exposing ``loss_terms(x, y)``; trains its objective and records a training curve (the objective
    and the LM loss) every ``log_every`` steps.

    With ``train.graph_step`` the step's forward, backward and clipping replay one CUDA graph (``StepGraph``) and
    the optimizer and schedule step here (Lightning's manual optimization); otherwise Lightning runs them.
    """

    def __init__(self, model: nn.Module, train: TrainConfig, max_steps: int, flops_per_batch: float):
        super().__init__()
        self.model, self.cfg, self.max_steps = model, train, max_steps
        # training FLOPs (flops.train_flops) of one rank's batch: ThroughputMonitor reads it as per device
        self.flops_per_batch = flops_per_batch
        self.val_sums = torchmetrics.MetricCollection({})  # filled lazily: one SumMetric per statistic
        self.curve: list[dict] = []
        self.val_metrics: dict[str, float] = {}
        self.started = time.perf_counter()  # when this process began training (train.fit sets it)
        self.wall_before = 0.0  # training seconds of the run's earlier processes (restored from its checkpoint)
        self.resumed_step = 0  # the optimizer step this process resumed at
        self._rng: dict | None = None  # the checkpoint's random streams, until training starts
        self._step_rng: tuple[int, dict] | None = None  # (global step, streams) as the current training step began
        self.step_graph = StepGraph(model, train.grad_clip) if train.graph_step else None
        self.automatic_optimization = self.step_graph is None

    def training_step(self, batch, batch_idx: int) -> torch.Tensor | None:
        x, y = batch  # [B, T], [B, T]
        step = self.global_step + 1
        if self.step_graph is not None:
            loss, lm_loss = self.step_graph.step(x, y)  # buffers of the graph: read below, not returned to Lightning
        else:
            graphs = self._begin_graph_step()
            loss, lm_loss = self.model.loss_terms(x, y)  # the objective and the LM loss in it, of one forward
            if graphs:  # the graph's output buffers are overwritten by the next replay; Lightning keeps the loss
                loss, lm_loss = loss.clone(), lm_loss.clone()
        if step % self.cfg.log_every == 0 or step == self.max_steps or step == 1:
            # the global batch's mean losses: ranks hold equal token counts, so the mean of their means; both in one
            # reduction and one device sync
            terms = torch.stack([loss.detach(), lm_loss.detach()]).float()  # [2]
            value, lm = self.trainer.strategy.reduce(terms, reduce_op="mean").tolist()
            world = self.trainer.world_size
            lr = self.lr_schedulers().get_last_lr()[0]
            self.curve.append(
                {
                    "step": step,
                    "tokens": step * x.numel() * world,
                    "flops": step * self.flops_per_batch * world,
                    "train_loss": value,
                    "lm_loss": lm,
                    "lr": lr,
                }
            )
            # a host tensor: Lightning reads its progress-bar values (.item()) after every later batch, and one on the
            # GPU would make that a device sync per step (the host could not queue a step ahead of the GPU)
            self.log("loss", torch.tensor(value), prog_bar=True, on_step=True, logger=False)
            self._to_loggers({"train_loss": value, "train_lm_loss": lm, "lr": lr}, step)
        if self.step_graph is not None:  # after the curve point: it reads this step's lr and step count
            self.optimizers().step()
            self.lr_schedulers().step()
            return None
        return loss

    def _begin_graph_step(self) -> bool:
        """Under CUDA graphs, tell torch a new iteration begins (the last one's graph outputs may be overwritten);
        whether the model runs as CUDA graphs."""
        graphs = self.cfg.compile and self.cfg.compile_mode in CUDA_GRAPH_MODES
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return graphs

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self._begin_graph_step()
        for name, value in self.model.eval_sums(x, y).items():
            if name not in self.val_sums:
                # nan_strategy='disable': a NaN statistic stays NaN (the default drops it, and a diverged run's mean
                # would read as a finite 0)
                self.val_sums.add_metrics({name: torchmetrics.SumMetric(nan_strategy="disable").to(self.device)})
            self.val_sums[name].update(value.detach().double())

    def on_validation_epoch_end(self) -> None:
        sums = {name: float(v) for name, v in self.val_sums.compute().items()}
        self.val_metrics = self.model.eval_summary(sums)
        loss = self.val_metrics["val_loss"]
        ppl = math.exp(min(loss, 50.0))
        self.log_dict({"val_loss": loss, "val_ppl": ppl}, prog_bar=True, logger=False)
        self._to_loggers({**self.val_metrics, "val_ppl": ppl}, self.global_step)
        self.val_sums.reset()

    def _to_loggers(self, metrics: dict[str, float], step: int) -> None:
        """``train.logger``'s points: the curve's (every ``log_every`` steps, the first and the last) and the final
        validation's, at the steps the store has them (``self.log`` would keep only Lightning's every n-th step)."""
        for logger in self.loggers:  # none without train.logger; Lightning's loggers write on global rank 0 only
            logger.log_metrics(metrics, step)

    def wall_s(self) -> float:
        """Seconds this run has trained, over every process it ran in."""
        return self.wall_before + time.perf_counter() - self.started

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # what Lightning does not keep, so that a resumed run is the uninterrupted one: the random streams (random
        # routing draws from torch's), the curve so far, the time trained so far; the model config for load_model
        checkpoint[STATE] = {
            "model": model_spec(self.model.cfg),
            "max_steps": self.max_steps,
            "curve": self.curve,
            "wall_s": self.wall_s(),
            "rng": self._resume_rng(),
        }

    def _resume_rng(self) -> dict:
        """The streams the step after this checkpoint's must start from. ``ModelCheckpoint`` saves between steps;
        SLURM's SIGUSR1 handler saves wherever the signal lands: inside a step whose optimizer update is not yet
        counted, a resumed run trains that step again, so it must draw what the step drew."""
        if self._step_rng is not None and self._step_rng[0] == self.global_step:
            return self._step_rng[1]
        return rng_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint[STATE]
        if (state["model"], state["max_steps"]) != (model_spec(self.model.cfg), self.max_steps):
            raise ValueError("the checkpoint to resume from is of another run (model config or steps differ)")
        self.resumed_step, self._rng = checkpoint["global_step"], state["rng"]
        # a save inside a step (SIGUSR1) may hold that step's point, which the resumed run records again
        self.curve = [p for p in state["curve"] if p["step"] <= self.resumed_step]
        self.wall_before = state["wall_s"]

    def on_train_start(self) -> None:
        # the streams are restored here, not on load: creating the DataLoader's iterator draws a seed from torch's
        # stream, once before step 1 in the uninterrupted run, and here after the load
        if self._rng is not None:
            set_rng_state(self._rng)
            self._rng = None

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self._step_rng = (self.global_step, rng_state())

    def on_before_optimizer_step(self, optimizer) -> None:
        # Clipping here rather than through Trainer(gradient_clip_val): Lightning refuses that with fused
        # AdamW under mixed precision, although bf16 has no grad scaler (grads are already unscaled here), and
        # refuses norm clipping under FSDP. There each rank holds a shard: only the root FSDP module's
        # clip_grad_norm_ takes the norm over all of them. A step graph has clipped already.
        if self.cfg.grad_clip > 0 and self.step_graph is None:
            wrapped = self.trainer.strategy.model
            if isinstance(wrapped, FullyShardedDataParallel):
                wrapped.clip_grad_norm_(self.cfg.grad_clip)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)

    def configure_optimizers(self):
        c = self.cfg
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2 and "embed" not in n]
        rest = [p for n, p in self.model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": c.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=c.lr,
            betas=(c.beta1, c.beta2),
            fused=self._fused(),
        )
        warmup = warmup_steps(c, self.max_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, self.max_steps, warmup, c.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _fused(self) -> bool | None:
        return True if next(self.model.parameters()).is_cuda else None


class LMDataModule(L.LightningDataModule):
    """Language-model batches ``(x, y)``, int64 ``[B, T]`` with ``y`` = ``x`` shifted by one token.

    Training draws random windows (see ``TokenWindows``), as many as the trainer's ``max_steps`` asks for;
    set ``val_check_interval`` in steps, since an epoch is ~2**31 samples. Validation walks the fixed val
    windows in order. Loading runs in the main process (``num_workers=0``): a batch is one numpy gather, in pinned
    memory on a GPU.
    """

    def __init__(
        self,
        cfg: DataConfig,
        batch_size: int,
        seed: int,
        cache_dir: Path | str | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size} must be >= 1")
        self.cfg = cfg
        self.batch_size = batch_size
        self.seed = seed
        self.cache_dir = cache_dir
        self._corpus: Corpus | None = None

    @property
    def corpus(self) -> Corpus:
        """The loaded corpus (loads it on first access)."""
        if self._corpus is None:
            self._corpus = load_corpus(self.cfg, self.cache_dir)
        return self._corpus

    def setup(self, stage: str | None = None) -> None:
        """Loads the corpus once; later calls are no-ops."""
        _ = self.corpus

    def train_dataloader(self) -> DataLoader:
        """Endless-enough random windows; sharded by rank when a distributed trainer is attached."""
        rank, world = self._rank()
        ds = TokenWindows(self.corpus.train, self.cfg.seq_len, seed=self.seed)
        trainer = getattr(self, "trainer", None)
        start = trainer.global_step if trainer is not None else 0  # a resumed run goes on where it stopped
        sampler = ShardedBatchSampler(len(ds), self.batch_size, rank, world, start)
        # pinned on a GPU: Lightning copies batches with non_blocking=True, which from pageable memory waits for the
        # stream (the host could not queue the next step while the GPU runs this one)
        pin = trainer is not None and trainer.strategy.root_device.type == "cuda"
        return DataLoader(ds, batch_sampler=sampler, collate_fn=as_batch, num_workers=0, pin_memory=pin)

    def val_dataloader(self) -> DataLoader:
        """The fixed validation windows in order, rank r of W taking the r-th of W contiguous shares (the last batch
        may be smaller); the sums LitLM keeps add up over ranks to one process's."""
        rank, world = self._rank()
        ds = TokenWindows(self.corpus.val, self.cfg.seq_len)
        if len(ds) < world:
            raise DataError(
                f"{len(ds)} validation windows cannot give each of {world} ranks one; raise data.val_tokens"
            )
        share = range(rank * len(ds) // world, (rank + 1) * len(ds) // world)
        batches = BatchSampler(share, self.batch_size, drop_last=False)
        return DataLoader(ds, batch_sampler=batches, collate_fn=as_batch, num_workers=0)

    def _rank(self) -> tuple[int, int]:
        """(rank, world) of the attached trainer; (0, 1) without one."""
        trainer = getattr(self, "trainer", None)
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
