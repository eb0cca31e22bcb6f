"""A run's tokens/s and MFU (mixdepth.throughput): measured every few steps, not with a device sync at each one."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.throughput import Throughput

from mixdepth.config import DataConfig, TrainConfig
from mixdepth.flops import train_flops
from mixdepth.models.dense import DenseConfig
from mixdepth.throughput import cadence
from mixdepth.train import RunConfig, fit


@pytest.mark.parametrize(("steps", "log_every"), [(2, 10), (3, 10), (20, 10), (24, 5), (343, 25), (5172, 25)])
def test_cadence_fills_its_window_from_the_last_half_of_the_run(steps, log_every):
    every, window = cadence(steps, log_every)
    assert 1 <= every <= log_every and window >= 2
    assert steps // every >= window  # enough measurements to fill the window (else no rate at all)
    assert window * every <= max(2 * every, min(100, steps // 2))  # the last half of the run, or two measurements
    if steps >= 4 * log_every:
        assert every == log_every


def test_mfu_is_the_measured_rate_over_the_peak(monkeypatch):
    """Measurements every 5 steps of 24 (4 of them): MFU is tokens/s x training FLOPs per token / peak, so the FLOPs
    handed to each measurement are those of the batches since the last one."""
    calls = []
    update = Throughput.update
    monkeypatch.setattr(Throughput, "update", lambda self, **kw: calls.append((self, kw)) or update(self, **kw))
    model = DenseConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, seq_len=32, vocab_size=256)
    data = DataConfig(max_bytes=200_000, val_tokens=2048, seq_len=32)
    train = TrainConfig(batch_size=4, accelerator="cpu", log_every=5, progress=False, peak_flops=1e9)
    m = fit(RunConfig(model, data, train, 24)).metrics
    training = [kw for tp, kw in calls if tp is calls[0][0]]  # the training stage's (validation has its own)
    assert [c["batches"] for c in training] == [5, 10, 15, 20]
    assert all(c["flops"] == 5 * train_flops(model.flops_per_token(), 4 * 32) for c in training)
    assert m.mfu == pytest.approx(m.tokens_per_s * train_flops(model.flops_per_token(), 1) / 1e9, rel=1e-9)


def test_a_log_step_before_the_first_measurement_logs_nothing():
    """Lightning asks for the rates at its log steps; a run resumed mid-way counts its batches from the resume, so a
    log step can come before this process's first measurement: nothing to log yet, and no error."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import RunningStage

    from mixdepth.throughput import PeakThroughputMonitor

    logged = []
    monitor = PeakThroughputMonitor(None, every=5)
    monitor._throughputs[RunningStage.TRAINING] = Throughput(window_size=2)
    connector = SimpleNamespace(should_update_logs=True, log_metrics=lambda m, step: logged.append(m))
    trainer = SimpleNamespace(state=SimpleNamespace(stage=RunningStage.TRAINING), _logger_connector=connector)
    monitor._compute(trainer, 3)
    assert logged == []
    monitor._throughputs[RunningStage.TRAINING].update(time=1.0, batches=5, samples=20, lengths=640)
    monitor._compute(trainer, 5)
    assert len(logged) == 1 and logged[0]["train/batches"] == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the peak memory of a GPU's allocator")
def test_peak_memory_is_the_training_s_gpu():
    """A run's peak memory holds at least its fp32 weights, gradients and both Adam moments (16 bytes a parameter),
    grows with the batch (activations), and fits the device."""
    model = DenseConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, seq_len=256, vocab_size=256)
    data = DataConfig(max_bytes=1_000_000, val_tokens=4096, seq_len=256)
    peaks = []
    for batch in (4, 32):
        train = TrainConfig(batch_size=batch, accelerator="gpu", compile=False, log_every=5, progress=False)
        peaks.append(fit(RunConfig(model, data, train, 6)).metrics.peak_memory_gib * 2**30)
    total = torch.cuda.get_device_properties(0).total_memory
    assert 16 * model.n_params()["total"] <= peaks[0] < peaks[1] < total, (peaks, total)
