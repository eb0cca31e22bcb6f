"""``python -m mixdepth.bench mfu``'s ratios: each arch against the first trained the same way, and each way against
the arch's first; its loss cells."""

from types import SimpleNamespace

import pytest

from mixdepth.bench import loss_cells, speed_ratios


def test_speed_ratios_compare_archs_trained_the_same_way():
    """MoD with the step graph is set against dense with it (not against dense without: 170/100 would read 1.7 x)."""
    rows = [("dense", "", 100.0), ("dense", " +graph_step", 110.0), ("mod", "", 130.0), ("mod", " +graph_step", 170.0)]
    got = speed_ratios(rows)
    want = [(1.0, 1.0), (1.0, 1.1), (1.3, 1.0), (170 / 110, 170 / 130)]
    assert got == [pytest.approx(w) for w in want]


def test_speed_ratios_of_one_arch_on_more_devices_are_against_one_device():
    got = speed_ratios([("dense", " x1 auto", 100.0), ("dense", " x2 ddp", 190.0)])
    assert got == [pytest.approx((1.0, 1.0)), pytest.approx((1.0, 1.9))]


def test_loss_cells_of_a_diverged_run_say_so():
    """A diverged run's losses are NULL: its row says "diverged" (the table printed up to it, then failed, before)."""
    assert loss_cells(SimpleNamespace(status="diverged", val_loss=None, train_loss=None)) == "diverged | diverged"
    assert loss_cells(SimpleNamespace(status="ok", val_loss=5.54631, train_loss=5.5458)) == "5.5463 | 5.5458"
