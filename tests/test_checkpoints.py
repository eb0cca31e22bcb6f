"""A run's checkpoints (mixdepth.checkpoints through train.fit): SIGKILLed after a checkpoint and trained again in a
fresh process, a run ends exactly as the uninterrupted one; its folder is removed or reduced to the final weights
once stored; no file is written without ``ckpt_dir`` and ``ckpt_every``.

Exact equality holds on the CPU in fp32: every operation is deterministic for a fixed thread count, and a resumed
run restores every bit the uninterrupted run carries across that step: weights and AdamW moments (Lightning), the
LR scheduler's step (Lightning), the sampler's position (ShardedBatchSampler's start step), the torch RNG that
random routing draws from, and the curve so far (LitLM.on_save_checkpoint).
"""

import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest
import torch
from lightning.pytorch import Callback

from mixdepth.checkpoints import FINAL, STATE, finish_checkpoints, load_model, saved_step
from mixdepth.config import DataConfig, TrainConfig
from mixdepth.lit import LitLM, LMDataModule
from mixdepth.models import MODELS
from mixdepth.train import RunConfig, fit, make_trainer

ARCHS = {"dense": ("dense", {}), "mod_random": ("mod", {"routing": "random"})}
STEPS = {"dense": 40, "mod_random": 20}  # mod trains slowly under TRITON_INTERPRET
EVERY = 10
# threads=1: two OpenMP threads on a loaded 2-core runner are 3-7x slower, and one thread count for every process
TRAIN = TrainConfig(  # the CPU in fp32, where every step is deterministic: resumes compare exactly
    batch_size=4, progress=False, log_every=5, threads=1, ckpt_every=EVERY, accelerator="cpu"
)
DATA = DataConfig(max_bytes=200_000, val_tokens=1024, seq_len=32)

# the child process: train the runs named on its command line (arch, folder, ...), print each result as a JSON line
CHILD = "import sys; from tests.test_checkpoints import train_and_print; train_and_print(sys.argv[1:])"


def run_config(arch: str, ckpt_dir=None, **train) -> RunConfig:
    family, extra = ARCHS[arch]
    model = MODELS[family][0](d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, seq_len=32, **extra)
    return RunConfig(model, DATA, replace(TRAIN, **train), STEPS[arch], None if ckpt_dir is None else str(ckpt_dir))


def summary(result) -> dict:
    """What a resumed run must reproduce, as JSON round-trips it (floats exactly)."""
    m = result.metrics
    return {
        "train_loss": m.train_loss,
        "train_lm_loss": m.train_lm_loss,
        "val_loss": m.val_loss,
        "curve": result.curve,
        "resumed": result.resumed_step,
    }


def train_and_print(args: list[str]) -> None:
    for arch, folder in zip(args[::2], args[1::2], strict=True):
        print(json.dumps(summary(fit(run_config(arch, folder)))), flush=True)


def in_process(run: RunConfig):
    """``fit`` here, leaving this process's thread count as it was."""
    threads = torch.get_num_threads()
    try:
        return fit(run)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, dict]:
    """Each arch's run trained in one go, without checkpoints."""
    return {arch: summary(in_process(run_config(arch, ckpt_every=None))) for arch in ARCHS}


def test_sigkill_after_a_checkpoint_then_rerun_resumes_to_the_uninterrupted_run(tmp_path, cli_env, uninterrupted):
    folders = {arch: tmp_path / arch for arch in ARCHS}
    logs = {arch: open(tmp_path / f"{arch}.log", "w") for arch in ARCHS}  # a full pipe would stall the child
    procs = {
        arch: subprocess.Popen([sys.executable, "-c", CHILD, arch, str(d)], env=cli_env, stderr=logs[arch])
        for arch, d in folders.items()
    }
    left = dict(procs)
    deadline = time.monotonic() + 300
    while left and time.monotonic() < deadline:
        for arch, p in list(left.items()):
            if list(folders[arch].glob("step=*.ckpt")):
                p.send_signal(signal.SIGKILL)
                del left[arch]
            assert p.poll() in (None, -signal.SIGKILL), (tmp_path / f"{arch}.log").read_text()
        time.sleep(0.02)
    for arch, p in procs.items():
        p.kill()  # no-op unless the deadline passed
        assert p.wait(timeout=30) == -signal.SIGKILL
        logs[arch].close()
    assert not left, f"no checkpoint within the deadline: {list(left)}"
    saved = {arch: sorted(p.name for p in d.iterdir()) for arch, d in folders.items()}
    for arch, names in saved.items():
        assert len(names) == 1 and names[0].startswith("step="), names  # the newest checkpoint only
        assert int(names[0][5:-5]) < STEPS[arch], names  # killed before the end: the rerun has steps to train
        assert saved_step(folders[arch]) == int(names[0][5:-5])  # what a time limit's scheduler reads

    args = [str(x) for arch, d in folders.items() for x in (arch, d)]
    r = subprocess.run([sys.executable, "-c", CHILD, *args], env=cli_env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    resumed = dict(zip(ARCHS, (json.loads(line) for line in r.stdout.splitlines()), strict=True))
    for arch, got in resumed.items():
        assert got.pop("resumed") == int(saved[arch][0][5:-5])  # it did start from the checkpoint
        want = dict(uninterrupted[arch])
        want.pop("resumed")
        assert got == want, arch
        assert [p["step"] for p in got["curve"]] == sorted({p["step"] for p in got["curve"]})  # no step twice


def held_out_loss(model: torch.nn.Module) -> float:
    """The held-out loss of ``model`` as ``fit`` measures it (LitLM's validation), on as many threads as the run:
    a matmul's reduction order depends on the thread count."""
    lit = LitLM(model, TRAIN, 1, flops_per_batch=0.0)
    trainer = make_trainer(TRAIN, 1, "cpu", "32-true", [])
    trainer.limit_val_batches = 1.0
    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN.threads)
    try:
        trainer.validate(
            lit, dataloaders=LMDataModule(DATA, TRAIN.batch_size, TRAIN.seed).val_dataloader(), verbose=False
        )
    finally:
        torch.set_num_threads(threads)
    return lit.val_metrics["val_loss"]


def test_saved_step_is_the_newest_checkpoints_when_its_name_says_it_and_prunes_nothing(tmp_path):
    import os

    assert saved_step(tmp_path / "none") == 0 and saved_step(tmp_path) == 0
    for i, name in enumerate(["step=10.ckpt", "step=30.ckpt", "step=20.ckpt"]):
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, ns=(i * 10**9, i * 10**9))
    assert saved_step(tmp_path) == 20 and len(list(tmp_path.iterdir())) == 3  # the newest by time, as resumed
    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"")
    os.utime(tmp_path / "hpc_ckpt_1.ckpt", ns=(9 * 10**9, 9 * 10**9))
    assert saved_step(tmp_path) == 0  # its step is inside the file: counted as none


def test_keep_ckpt_leaves_final_weights_that_load_without_lightning(tmp_path, uninterrupted):
    folder = tmp_path / "run"
    result = in_process(run_config("dense", folder, keep_ckpt=True))
    assert sorted(p.name for p in folder.iterdir()) == [FINAL, f"step={STEPS['dense']}.ckpt"]
    got = summary(result)
    assert got.pop("resumed") == 0
    want = dict(uninterrupted["dense"])
    want.pop("resumed")
    assert got == want  # writing checkpoints changes nothing of the run

    finish_checkpoints(folder, keep=True)
    assert [p.name for p in folder.iterdir()] == [FINAL]
    model = load_model(folder / FINAL)
    assert asdict(model.cfg) == asdict(run_config("dense").model)
    assert held_out_loss(model) == result.metrics.val_loss

    finish_checkpoints(folder, keep=False)
    assert not folder.exists()
    finish_checkpoints(folder, keep=False)  # a run whose folder is gone already (or never was): nothing to do


def test_a_checkpoint_from_before_the_lm_loss_resumes_with_its_points_lacking_it(tmp_path, uninterrupted):
    """A checkpoint saved before curve points held the LM loss: the resumed run keeps its restored points as they
    were (no lm_loss, NULL in the store), records the LM loss from the steps it trains on, and its train_lm_loss
    (the mean over train_loss's last points, here the final one, trained after the resume) is the uninterrupted
    run's."""
    folder = tmp_path / "run"

    class StopAt(Callback):  # a run cut off after its checkpoint at step 2 x EVERY
        def on_train_batch_end(self, trainer, *args) -> None:
            trainer.should_stop = trainer.global_step >= 2 * EVERY

    threads = torch.get_num_threads()
    try:
        fit(run_config("dense", folder), callbacks=[StopAt()])
        (ckpt,) = folder.glob("*.ckpt")
        assert ckpt.name == f"step={2 * EVERY}.ckpt"
        saved = torch.load(ckpt, weights_only=False)
        saved[STATE]["curve"] = [{k: v for k, v in p.items() if k != "lm_loss"} for p in saved[STATE]["curve"]]
        torch.save(saved, ckpt)
        result = fit(run_config("dense", folder))
    finally:
        torch.set_num_threads(threads)
    want = uninterrupted["dense"]
    assert result.resumed_step == 2 * EVERY
    assert [p["step"] for p in result.curve] == [p["step"] for p in want["curve"]]
    old = [p for p in result.curve if p["step"] <= 2 * EVERY]
    new = [p for p in result.curve if p["step"] > 2 * EVERY]
    assert old and new and not any("lm_loss" in p for p in old)
    assert [p["lm_loss"] for p in new] == [p["lm_loss"] for p in want["curve"] if p["step"] > 2 * EVERY]
    assert result.metrics.train_lm_loss == want["train_lm_loss"] == new[-1]["lm_loss"]


@pytest.mark.parametrize("arch", ["dense", "mod", "moda"])
def test_weights_saved_before_the_projections_were_fused_load(arch):
    """A state dict from before q/k/v and gate/up were one projection each (separate wq, wk, wv; w1, w3) loads
    into the fused model with the same weights, GQA's row counts included."""
    config_cls, model_cls = MODELS[arch]
    cfg = config_cls(arch=arch, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16)
    torch.manual_seed(0)
    model = model_cls(cfg)
    old, hd = {}, cfg.head_dim
    for k, v in model.state_dict().items():
        if k.endswith("wqkv.weight"):
            q, kk, vv = v.split((cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd))
            old |= {k.replace("wqkv", "wq"): q, k.replace("wqkv", "wk"): kk, k.replace("wqkv", "wv"): vv}
        elif k.endswith("w13.weight"):
            old |= dict(zip((k.replace("w13", "w1"), k.replace("w13", "w3")), v.chunk(2), strict=True))
        else:
            old[k] = v
    assert any(k.endswith(".wk.weight") for k in old) and any(k.endswith(".w3.weight") for k in old)
    fresh = model_cls(cfg)
    fresh.load_state_dict(old)  # strict: every key used, none missing
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_keep_without_a_final_checkpoint_is_refused_and_removes_nothing(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "step=10.ckpt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no final checkpoint"):
        finish_checkpoints(folder, keep=True)
    assert [p.name for p in folder.iterdir()] == ["step=10.ckpt"]


@pytest.mark.parametrize("ckpt", ["no ckpt_dir", "no ckpt_every"])
def test_no_checkpoint_is_written_without_ckpt_dir_and_ckpt_every(tmp_path, monkeypatch, ckpt):
    monkeypatch.chdir(tmp_path)  # where Lightning would write without a folder of ours (its default_root_dir)
    run = (
        run_config("dense", None, ckpt_every=EVERY)
        if ckpt == "no ckpt_dir"
        else run_config("dense", "run", ckpt_every=None)
    )
    result = in_process(replace(run, steps=2 * EVERY))
    assert result.resumed_step == 0
    assert list(tmp_path.iterdir()) == []


def test_sigusr1_under_slurm_saves_requeues_and_the_requeued_run_resumes_from_it(tmp_path, cli_env, uninterrupted):
    """Lightning's SLURM auto-requeue in a job environment (the variables srun sets, and an ``scontrol`` first on
    PATH that records its arguments: no SLURM here): SIGUSR1 writes ``hpc_ckpt_1.ckpt`` into the run's folder and
    requeues the job, SIGTERM then stops the process, and the requeued process resumes from that checkpoint. The
    signal lands inside a step (most of a step is spent in torch ops), which the resumed run trains again."""
    bin_dir, folder, log = tmp_path / "bin", tmp_path / "run", tmp_path / "child.log"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "sweep", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0"}
    slurm |= {"SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}
    env = {**cli_env, **slurm, "PATH": f"{bin_dir}:{cli_env['PATH']}"}
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-c", CHILD, "mod_random", str(folder)], env=env, stderr=err)
        hpc = folder / "hpc_ckpt_1.ckpt"
        deadline = time.monotonic() + 300
        sent = None
        while not hpc.exists() and p.poll() is None and time.monotonic() < deadline:
            if sent is None and list(folder.glob("step=*.ckpt")):
                p.send_signal(sent := signal.SIGUSR1)
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=120)
    assert hpc.exists() and code not in (0, -signal.SIGKILL), (code, log.read_text())
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"

    r = subprocess.run(
        [sys.executable, "-c", CHILD, "mod_random", str(folder)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert EVERY <= got.pop("resumed") < STEPS["mod_random"]
    want = dict(uninterrupted["mod_random"])
    want.pop("resumed")
    assert got == want
