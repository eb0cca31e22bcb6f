"""Thin LightningModule adapter: loss, torchmetrics, AdamW with warmup + cosine, analytic FLOPs per batch.

The model (models/*) knows nothing of Lightning; this file is the only place that does, with train.py.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torchmetrics
from torch import nn

from mixdepth.config import TrainConfig


def lr_lambda(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


class LitLM(L.LightningModule):
    """Wraps an LM exposing ``loss(x, y)``; records a training curve every ``log_every`` steps."""

    def __init__(self, model: nn.Module, train: TrainConfig, max_steps: int, flops_per_batch: float):
        super().__init__()
        self.model, self.cfg, self.max_steps = model, train, max_steps
        self.flops_per_batch = flops_per_batch  # training FLOPs (3 x forward), read by ThroughputMonitor
        self.val_sums = torchmetrics.MetricCollection({})  # filled lazily: one SumMetric per statistic
        self.curve: list[dict] = []
        self.val_metrics: dict[str, float] = {}

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch  # [B, T], [B, T]
        loss = self.model.loss(x, y)
        step = self.global_step + 1
        if step % self.cfg.log_every == 0 or step == self.max_steps or step == 1:
            value = loss.detach().float().item()
            self.curve.append(
                {
                    "step": step,
                    "tokens": step * x.numel(),
                    "flops": step * self.flops_per_batch,
                    "train_loss": value,
                    "lr": self.lr_schedulers().get_last_lr()[0],
                }
            )
            self.log("loss", value, prog_bar=True, on_step=True, logger=False)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        for name, value in self.model.eval_sums(x, y).items():
            if name not in self.val_sums:
                self.val_sums.add_metrics({name: torchmetrics.SumMetric().to(self.device)})
            self.val_sums[name].update(value.detach().double())

    def on_validation_epoch_end(self) -> None:
        sums = {name: float(v) for name, v in self.val_sums.compute().items()}
        self.val_metrics = self.model.eval_summary(sums)
        loss = self.val_metrics["val_loss"]
        self.log_dict({"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}, prog_bar=True, logger=False)
        self.val_sums.reset()

    def on_before_optimizer_step(self, optimizer) -> None:
        # Clipping here rather than through Trainer(gradient_clip_val): Lightning refuses that with fused
        # AdamW under mixed precision, although bf16 has no grad scaler (grads are already unscaled here).
        if self.cfg.grad_clip > 0:
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
        warmup = max(1, round(c.warmup_frac * self.max_steps))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, self.max_steps, warmup, c.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _fused(self) -> bool | None:
        return True if next(self.model.parameters()).is_cuda else None
