"""The learning-rate schedule: linear warmup over a share of the run's steps with a floor in steps (at most half the
run), then cosine decay; the floor is a key added after sweeps were stored, so at 0 it leaves their ids as they were."""

import math
from pathlib import Path

import duckdb
import pytest

from mixdepth.config import DataConfig, TrainConfig, load_config
from mixdepth.lit import warmup_steps
from mixdepth.models import MODELS
from mixdepth.train import RunConfig, fit
from sweeps.plan import plan, sweep_id

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "frac,floor,total,expected",
    [
        (0.05, 0, 300, 15),  # the share alone
        (0.05, 0, 10, 1),  # at least one step
        (0.05, 60, 300, 60),  # the floor, above the share
        (0.05, 60, 2000, 100),  # the share, above the floor
        (0.05, 60, 100, 50),  # the floor, capped at half the run
        (0.0, 150, 3, 1),  # a run too short for the floor
    ],
)
def test_warmup_is_the_share_with_a_floor_at_most_half_the_run(frac, floor, total, expected):
    assert warmup_steps(TrainConfig(warmup_frac=frac, warmup_steps=floor), total) == expected


def test_a_fit_warms_up_over_the_floor_then_decays():
    """Through train.fit: the curve's lr rises linearly to the peak over the floor's steps (4 of a 10-step run whose 5%
    share is 1 step), the peak at the floor's last step and the next, then the cosine towards lr x min_lr_ratio."""
    lr, total, floor = 1e-3, 10, 4
    model = MODELS["dense"][0](d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, seq_len=16, vocab_size=256)
    train = TrainConfig(batch_size=2, lr=lr, warmup_steps=floor, log_every=1, progress=False, accelerator="cpu")
    res = fit(RunConfig(model, DataConfig(seq_len=16, max_bytes=50_000, val_tokens=512), train, total))
    got = [p["lr"] for p in res.curve]
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - floor) / (total - floor))) for s in range(floor, total)]
    expected = [lr * s / floor for s in range(1, floor + 1)] + [lr * c for c in cosine]
    assert [p["step"] for p in res.curve] == list(range(1, total + 1))
    assert got == pytest.approx(expected, rel=1e-12)


def test_the_floor_at_0_keeps_the_published_sweep_and_run_ids():
    """The reference study's preset plans the sweep it published (same sweep id and every planned run id among its
    runs); a floor set makes another sweep."""
    lab = load_config(ROOT / "conf", "reference_h200")
    sid = sweep_id(lab, "reference_h200")
    runs = ROOT / "docs" / "results" / "reference_h200" / "runs.parquet"
    published = dict(duckdb.sql(f"SELECT run_id, sweep_id FROM '{runs}'").fetchall())
    planned = [t.run_id for t in plan(lab, sid)[0]]
    assert set(published.values()) == {sid}
    assert len(planned) == 105 and set(planned) <= set(published)
    floored = load_config(ROOT / "conf", "reference_h200", ["train.warmup_steps=100"])
    assert sweep_id(floored, "reference_h200") != sid
