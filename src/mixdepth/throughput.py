"""Tokens/s and MFU of a run (Lightning's ThroughputMonitor with a supplied peak, measuring without a device sync
at every step), and the peak device memory of its training."""

from __future__ import annotations

import time

import torch
from lightning.pytorch.callbacks import Callback, ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage


def cadence(steps: int, log_every: int) -> tuple[int, int]:
    """(batches between measurements, measurements in the rolling window) for a run of ``steps`` steps: a point
    every ``log_every`` steps at most (and at least 4 points), a window over the last half of the run (<= 100
    steps), 2 points at least."""
    every = max(1, min(log_every, steps // 4))
    return every, max(2, min(100, steps // 2) // every)


class PeakThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor with a supplied peak, keeping the training Throughput for the summary.

    It measures (synchronises the device and reads the clock) every ``every`` batches, not after each: Lightning's
    sync per step keeps the host from queueing the next step while the GPU runs this one, which slows exactly the
    runs that are short of host time (small models, CUDA graphs, MoD against dense). The rate over a window of
    measurements is the same quantity, taken over ``window_size * every`` batches.
    """

    def __init__(self, peak_flops: float | None, every: int = 1, **kwargs):
        super().__init__(batch_size_fn=lambda b: b[0].shape[0], length_fn=lambda b: b[0].numel(), **kwargs)
        self.peak, self.every = peak_flops, every
        self._pending: dict[RunningStage, int] = {}  # batches since the last measurement, per stage

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        if self.peak:
            for tp in self._throughputs.values():
                tp.available_flops = self.peak

    def _start(self, trainer) -> None:
        super()._start(trainer)
        self._pending[trainer.state.stage] = 0

    @torch.inference_mode()
    def _update(self, trainer, pl_module, batch, iter_num: int) -> None:
        stage = trainer.state.stage
        self._lengths[stage] += self.length_fn(batch)
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        self._pending[stage] = self._pending.get(stage, 0) + 1
        if self._batches[stage] % self.every:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # the clock reads when the queued steps are done
        self._throughputs[stage].update(
            time=time.perf_counter() - self._t0s[stage],
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=self._lengths[stage],
            flops=pl_module.flops_per_batch * self._pending[stage],  # per device, since the last update
        )
        self._pending[stage] = 0

    def _compute(self, trainer, iter_num: int | None = None) -> None:
        # Lightning logs the rates at its own log steps: one may come before this process's first measurement (a
        # run resumed mid-way counts its batches from the resume)
        if self._throughputs[trainer.state.stage]._time:
            super()._compute(trainer, iter_num)

    def summary(self) -> dict[str, float]:
        if not self._batches.get(RunningStage.TRAINING):  # resumed from its final checkpoint: nothing trained here
            return {}
        return self._throughputs[RunningStage.TRAINING].compute()


class PeakMemory(Callback):
    """The most device memory torch's allocator held for tensors while this process trained (compilation and the
    first steps included, the held-out evaluation not), in bytes of this rank's GPU; None on the CPU."""

    def __init__(self) -> None:
        self.bytes: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_end(self, trainer, pl_module) -> None:
        if pl_module.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(pl_module.device)
