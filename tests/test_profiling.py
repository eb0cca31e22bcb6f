"""mixdepth.profiling: the GPU time of a window of steps counts kernels, not annotations; ``bench mfu --profile``'s
window stays clear of the steps whose rate the run reports."""

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from mixdepth.bench import _profile_start
from mixdepth.config import ConfigError, DataConfig, TrainConfig
from mixdepth.models.dense import DenseConfig
from mixdepth.profiling import GAP_US, StepWindowProfile, kernel_time
from mixdepth.throughput import cadence
from mixdepth.train import RunConfig, fit


def _event(start: float, end: float, device=DeviceType.CUDA, annotation: bool = False):
    return SimpleNamespace(
        device_type=device, is_user_annotation=annotation, time_range=SimpleNamespace(start=start, end=end)
    )


def test_kernel_time_is_the_union_of_kernels_and_the_gaps_between_them():
    """Overlapping kernels count once; an annotation's GPU range (here over the whole window) and host events are not
    GPU work; only idle stretches longer than GAP_US are gaps."""
    gap = GAP_US + 150
    events = [
        _event(0, 100),
        _event(50, 150),  # overlaps the first: 150 µs in all
        _event(150 + GAP_US - 1, 150 + GAP_US + 49),  # after a short idle (launch spacing): 50 µs more
        _event(200 + GAP_US + gap, 300 + GAP_US + gap),  # after a gap
        _event(0, 10_000, annotation=True),
        _event(0, 10_000, device=DeviceType.CPU),
    ]
    busy, gaps = kernel_time(events)
    assert busy == 300 and gaps == [gap + 1]
    assert kernel_time([]) == (0.0, [])


@pytest.mark.parametrize(("steps", "n"), [(120, 4), (120, 30), (300, 20), (24, 3)])
def test_profile_window_ends_before_the_measured_steps(steps, n):
    start = _profile_start(steps, n, 50)
    every, window = cadence(steps, 50)
    assert start >= 6 and start + n - 1 <= steps - window * every


def test_profile_window_that_does_not_fit_is_refused():
    with pytest.raises(ConfigError, match=r"^--profile 9: steps 7-15 would reach the measured steps; raise --steps$"):
        _profile_start(24, 9, 50)


def test_window_profile_through_fit_prints_its_steps(capsys):
    model = DenseConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, seq_len=32, vocab_size=256)
    data = DataConfig(max_bytes=200_000, val_tokens=2048, seq_len=32)
    train = TrainConfig(batch_size=2, accelerator="cpu", progress=False)
    fit(RunConfig(model, data, train, 12), callbacks=[StepWindowProfile(7, 3, " dense")])
    out = capsys.readouterr().out
    assert "--- profile dense: train.fit steps 7-9, synchronised at the window's ends:" in out
    assert "ms per step (no GPU: the heaviest host operations)" in out and "aten::mm" in out
