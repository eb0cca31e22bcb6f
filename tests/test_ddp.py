"""A run on two CPU ranks (DDP over gloo) trains the one-device run's curve for the same global batch, whether
``fit`` starts the ranks itself or ``torchrun`` does; bad device settings fail in one line before training.

Tolerance. Two ranks differ from one process only in fp32 summation order: the gradient all-reduce adds two
half-batch means where one backward sums the whole batch, and the logged loss is a mean of two means. Each
reordering moves a result by a few units of fp32 roundoff (u = 2**-24 = 6e-8) relative, Adam's normalised update
carries a relative change of the gradient into the weights unchanged, and over the 20 steps here such changes add
up at most linearly: 20 steps x ~3u = ~4e-6. REL = 1e-5 allows that (measured: <= 1.2e-7 on every point of
30-step runs of both models), while a real fault (ranks drawing the same windows, a rank's gradient left out, an
unreduced loss, a rank missing from the validation sums) moves losses by 1e-2 or more.

The runs take the models' plain CPU path (naive gather/scatter instead of the Triton interpreter that
conftest.py switches on): this file checks the distribution of a run, tests/test_kernels_* check the kernels.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kernels.common import dispatch
from mixdepth.config import ConfigError, DataConfig, TrainConfig, load_config
from mixdepth.flops import train_flops
from mixdepth.launch import LAUNCH_VARS, Cluster, check_devices, cluster, cpu_cores
from mixdepth.models import MODELS
from mixdepth.train import RunConfig, fit

REL = 1e-5
STEPS = 20
PEAK = 1e9  # a supplied per-device peak FLOP/s, so that MFU is reported on the CPU
ARCHS = ("dense", "mod")


def run_config(arch: str, devices: int) -> RunConfig:
    model = MODELS[arch][0](arch=arch, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, seq_len=32, vocab_size=256)
    data = DataConfig(max_bytes=300_000, val_tokens=4096, seq_len=32)
    train = TrainConfig(
        batch_size=8, devices=devices, accelerator="cpu", threads=1, log_every=5, progress=False, peak_flops=PEAK
    )
    return RunConfig(model, data, train, STEPS)


@pytest.fixture(scope="module")
def plain_cpu():
    mp = pytest.MonkeyPatch()
    mp.setattr(dispatch, "INTERPRET", False)  # this process: kernels were imported under the interpreter
    mp.setenv("TRITON_INTERPRET", "0")  # the ranks' processes
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # fit(threads=1) set this process's
    mp.undo()


@pytest.fixture(scope="module")
def one_device(plain_cpu):
    return {arch: fit(run_config(arch, 1)) for arch in ARCHS}


def assert_same_run(got: dict, want: dict) -> None:
    """Two runs' curves and held-out losses (as plain dicts, the JSON a subprocess returns) within REL."""
    assert [(p["step"], p["tokens"], p["flops"]) for p in got["curve"]] == [
        (p["step"], p["tokens"], p["flops"]) for p in want["curve"]
    ]
    for g, w in zip(got["curve"], want["curve"], strict=True):
        assert g["lr"] == w["lr"]
        assert g["train_loss"] == pytest.approx(w["train_loss"], rel=REL), g["step"]
        assert g["lm_loss"] == pytest.approx(w["lm_loss"], rel=REL), g["step"]
    for key in ("val_loss", "val_loss_causal", "train_loss", "train_lm_loss"):
        assert (got[key] is None) == (want[key] is None), key
        if want[key] is not None:
            assert got[key] == pytest.approx(want[key], rel=REL), key
    if want["routing_stats"] is None:
        assert got["routing_stats"] is None
    else:
        assert got["routing_stats"] == pytest.approx(want["routing_stats"], rel=REL, abs=1e-6)


def as_dict(result) -> dict:
    m = result.metrics
    losses = ("val_loss", "val_loss_causal", "train_loss", "train_lm_loss")
    keep = (*losses, "routing_stats", "tokens_per_s", "mfu", "device")
    return {**{k: getattr(m, k) for k in keep}, "curve": result.curve}


def assert_mfu_per_device(m: dict, arch: str, world: int) -> None:
    """MFU is one device's training FLOP/s over the per-device peak; tokens/s is the run's, over all ranks."""
    fpt = run_config(arch, world).model.flops_per_token()
    assert m["mfu"] == pytest.approx(m["tokens_per_s"] / world * train_flops(fpt, 1) / PEAK, rel=1e-9)


def test_two_local_ranks_train_the_one_device_curve(one_device, plain_cpu):
    # The routed model: its statistics are sums over the validation windows, which the two ranks share out.
    # Dense is left to the torchrun test: each launch costs two processes importing torch and Lightning.
    arch = "mod"
    two = as_dict(fit(run_config(arch, 2)))  # no launcher: fit starts two local ranks and returns rank 0's result
    one = as_dict(one_device[arch])
    assert_same_run(two, one)
    assert two["device"].endswith("(2 ranks)") and "ranks" not in one["device"]
    assert_mfu_per_device(two, arch, 2)
    assert_mfu_per_device(one, arch, 1)


def test_a_one_process_ddp_run_leaves_no_launch_behind(plain_cpu, monkeypatch):
    # Lightning's DDP strategy sets MASTER_PORT, LOCAL_RANK, ... in os.environ even for one process: the next run in
    # this process (two ranks, say) would take itself for a rank of an external launch and stop.
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    run = run_config("dense", 1)
    result = fit(replace(run, train=replace(run.train, strategy="ddp"), steps=4))
    assert result.metrics.status == "ok"
    assert {v: os.environ.get(v) for v in LAUNCH_VARS} == dict.fromkeys(LAUNCH_VARS)
    assert not cluster().external
    assert result.metrics.peak_memory_gib is None  # the CPU's: only a GPU's allocator is measured


TORCHRUN_SCRIPT = """
import dataclasses, json, os, sys
sys.path.insert(0, {tests!r})
from test_ddp import ARCHS, as_dict, run_config
from mixdepth.launch import cluster
from mixdepth.train import fit

out = {{"cluster": dataclasses.asdict(cluster())}}
out.update({{arch: as_dict(fit(run_config(arch, 2))) for arch in ARCHS}})  # two runs in one process group
with open(os.path.join({out!r}, f"rank{{os.environ['RANK']}}.json"), "w") as f:
    json.dump(out, f)
"""


def test_torchrun_ranks_each_return_the_run(tmp_path, one_device, plain_cpu):
    script = tmp_path / "ddp_fit.py"
    script.write_text(TORCHRUN_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(torchrun, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        c = got["cluster"]
        assert (c["launcher"], c["external"], c["global_rank"], c["world_size"]) == ("torchrun", True, r, 2)
        for arch in ARCHS:
            assert_same_run(got[arch], as_dict(one_device[arch]))
            assert_mfu_per_device(got[arch], arch, 2)
    assert ranks[0]["dense"] == ranks[1]["dense"] and ranks[0]["mod"] == ranks[1]["mod"]  # rank 0's figures


@pytest.mark.parametrize(
    ("train", "says"),
    [
        (TrainConfig(devices=cpu_cores() + 1, batch_size=8 * (cpu_cores() + 1), accelerator="cpu"), "CPU cores"),
        (TrainConfig(strategy="deepspeed"), "train.strategy must be one of auto, ddp, fsdp"),
        (TrainConfig(devices=2, strategy="fsdp", accelerator="cpu"), "train.strategy=fsdp needs GPUs"),
        (TrainConfig(devices=2, batch_size=5, accelerator="cpu"), "train.batch_size=5 must split evenly"),
        (TrainConfig(num_nodes=2, batch_size=8, accelerator="cpu"), "train.num_nodes=2 needs a launcher"),
    ],
)
def test_bad_devices_fail_in_one_line_before_training(train, says, tmp_path):
    with pytest.raises(ConfigError, match=says) as e:
        check_devices(train)
    assert "\n" not in str(e.value)
    run = RunConfig(run_config("dense", 1).model, DataConfig(corpus=str(tmp_path / "none.txt")), train, STEPS)
    with pytest.raises(ConfigError, match=says):  # before the corpus is opened (it does not exist)
        fit(run)


def test_load_config_refuses_a_batch_the_ranks_cannot_split():
    conf = Path(__file__).resolve().parents[1] / "conf"
    with pytest.raises(ConfigError, match=r"train.batch_size=6 must split evenly over .* 4 \* 1 ranks"):
        load_config(conf, overrides=["train.batch_size=6", "train.devices=4"])
    with pytest.raises(ConfigError, match="train.strategy=fsdp needs GPUs"):
        load_config(conf, overrides=["train.strategy=fsdp", "train.accelerator=cpu"])
    assert load_config(conf, overrides=["train.batch_size=8", "train.devices=4"]).train.devices == 4


def test_cluster_reads_the_launch(monkeypatch):
    launchers = ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "LSB_JOBID")
    for name in (*launchers, "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert cluster() == Cluster(0, 1, 0, 0, "127.0.0.1", 0, False, "none")
    local = {"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0", "MASTER_PORT": "29511"}
    for name, value in local.items():  # what launch gives the ranks it starts
        monkeypatch.setenv(name, value)
    assert cluster() == Cluster(1, 2, 1, 0, "127.0.0.1", 29511, True, "local")
    with pytest.raises(ConfigError, match="train.devices \\* train.num_nodes = 1 \\* 1 but local started 2 processes"):
        check_devices(TrainConfig(accelerator="cpu"))


def test_rank_zero_s_result_stands_when_a_rank_dies_in_teardown(tmp_path):
    """Rank 0 wrote its value (its fit returned: every collective of the run is done), then a rank aborted while its
    process group was torn down ("terminate called without an active exception", SIGABRT): the run stands. A rank
    that fails before rank 0 has a value ends the run with its exception, or with how it died."""
    import pickle

    from mixdepth.launch import _outcome

    (tmp_path / "rank0.pkl").write_bytes(pickle.dumps(("ok", 42)))
    assert _outcome(tmp_path, [-6, None]) == 42 and _outcome(tmp_path, [0, -6]) == 42
    (tmp_path / "rank0.pkl").unlink()
    (tmp_path / "rank1.pkl").write_bytes(pickle.dumps(("error", ValueError("bad batch"))))
    with pytest.raises(ValueError, match="bad batch"):
        _outcome(tmp_path, [None, 1])
    (tmp_path / "rank1.pkl").unlink()
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 died \(signal 9\)"):
        _outcome(tmp_path, [None, -9])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL and FSDP need a GPU")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_gpu_under_ddp_and_fsdp_trains_the_plain_run_gpu(strategy):
    """The distributed strategies' code paths (NCCL process group, DDP's reducer or FSDP's flat parameters and
    sharded clipping), compiled, in bf16 on one GPU: the curve and held-out loss of the single-device run, within
    bf16's rounding of the losses, and a peak memory that holds the fp32 weights, gradients and Adam moments."""
    model = MODELS["dense"][0](
        arch="dense", d_model=128, n_layers=2, n_heads=2, n_kv_heads=2, seq_len=64, vocab_size=256
    )
    data = DataConfig(max_bytes=300_000, val_tokens=4096, seq_len=64)
    train = TrainConfig(batch_size=8, accelerator="gpu", compile=True, log_every=5, progress=False)
    plain, spread = (fit(RunConfig(model, data, replace(train, strategy=s), STEPS)) for s in ("auto", strategy))
    assert [p["step"] for p in spread.curve] == [p["step"] for p in plain.curve]
    got, want = (torch.tensor([p["train_loss"] for p in r.curve]) for r in (spread, plain))
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    assert spread.metrics.val_loss == pytest.approx(plain.metrics.val_loss, abs=2e-3)
    assert want[-1] < want[0] - 0.3  # it learned
    assert spread.metrics.peak_memory_gib * 2**30 >= 16 * model.n_params()["total"]
