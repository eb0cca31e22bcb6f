"""``train.graph_step``: the step's forward, backward and clipping as one CUDA graph (mixdepth.graphs.StepGraph).

GPU: every family's steps replayed from the graph equal the eager steps (objective and LM loss, and the parameters
after each AdamW update, in fp32 and under bf16 autocast), ``train.fit`` with it trains the run the eager trainer
trains, and a run SIGKILLed after a checkpoint resumes (a fresh step graph captured) to the uninterrupted run.
CPU: the configs it cannot capture are refused in one line before anything trains.
"""

import signal
import subprocess
import sys
import time

import pytest
import torch

from mixdepth.checkpoints import saved_step
from mixdepth.config import ConfigError, DataConfig, TrainConfig, check_graph_step
from mixdepth.graphs import StepGraph
from mixdepth.launch import check_devices
from mixdepth.lit import LitLM
from mixdepth.models import MODELS
from mixdepth.models.dense import DenseConfig
from mixdepth.throughput import cadence
from mixdepth.train import RunConfig, fit
from tests.test_models_contract import BASE, CASES, build, tokens

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
STEPS = 8  # 3 eager warm-up steps, the capture, 4 more replays


def train_steps(arch: str, kw: dict, graphed: bool, bf16: bool):
    """STEPS steps of AdamW on fresh batches, the gradients from a StepGraph or eagerly: (losses [STEPS, 2], the
    objective and the LM loss of each step, parameters)."""
    model = build(arch, kw).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    graph = StepGraph(model, grad_clip=0.5) if graphed else None
    losses = []
    for i in range(STEPS):
        x = tokens(model, 3, BASE["seq_len"] + 1, seed=i).cuda()
        with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
            if graph is not None:
                loss, lm = graph.step(x[:, :-1], x[:, 1:])
            else:
                model.zero_grad(set_to_none=True)
                loss, lm = model.loss_terms(x[:, :-1], x[:, 1:])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        losses.append([loss.float().item(), lm.float().item()])
        opt.step()
    return torch.tensor(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


@GPU
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("arch", "kw"), CASES, ids=[f"{a}-{'-'.join(map(str, k.values()))}" for a, k in CASES])
def test_replayed_steps_equal_eager_steps_gpu(arch, kw, bf16):
    """The replays run the kernels the eager steps run, on the same inputs: both loss terms and every parameter after
    the updates agree to rounding (the gradients reach the optimizer through .grad, clipped inside the graph)."""
    kw = {**kw, "attn_impl": kw.get("attn_impl", "sdpa")}
    want_loss, want = train_steps(arch, kw, graphed=False, bf16=bf16)
    got_loss, got = train_steps(arch, kw, graphed=True, bf16=bf16)
    tol = dict(rtol=2e-3, atol=2e-3) if bf16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_loss, want_loss, **tol)
    for n, p in want.items():
        torch.testing.assert_close(got[n], p, **tol, msg=lambda m, n=n: f"{n}: {m}")


def small_run(arch: str, steps: int, ckpt_dir: str | None = None, **train) -> RunConfig:
    """A small run of ``arch`` as a GPU sweep trains it: bf16, compiled per block; ``train``: the other keys."""
    model = MODELS[arch][0](arch=arch, d_model=64, n_layers=4, n_heads=2, n_kv_heads=2, seq_len=64, vocab_size=256)
    data = DataConfig(max_bytes=300_000, val_tokens=4096, seq_len=64)
    base = dict(batch_size=8, accelerator="gpu", compile=True, compile_scope="block", progress=False)
    return RunConfig(model, data, TrainConfig(**base, **train), steps, ckpt_dir)


def assert_same_run(got, want) -> None:
    """Two bf16 runs of one config (``RunResult``) train the same: their curves (objective and LM loss) and held-out
    losses agree to the rounding that separates replayed steps from eager ones, and the run learned."""
    assert [p["step"] for p in got.curve] == [p["step"] for p in want.curve]
    assert [p["lr"] for p in got.curve] == [p["lr"] for p in want.curve]
    losses = [torch.tensor([[p["train_loss"], p["lm_loss"]] for p in r.curve]) for r in (got, want)]  # [points, 2]
    torch.testing.assert_close(*losses, rtol=2e-3, atol=2e-3)
    assert got.metrics.val_loss == pytest.approx(want.metrics.val_loss, abs=2e-3)
    assert losses[1][-1, 0] < losses[1][0, 0] - 0.5  # it learned: the comparison is not of two untrained models


@GPU
@pytest.mark.parametrize("arch", list(MODELS))
def test_fit_with_graph_step_trains_the_eager_run_gpu(arch):
    """Through train.fit (Lightning's manual optimization, bf16, compiled per block): the curve and the held-out loss
    of the run trained with the step graph are the eager trainer's."""
    eager, graphed = (fit(small_run(arch, 30, log_every=5, graph_step=g)) for g in (False, True))
    assert [p["step"] for p in eager.curve] == [1, 5, 10, 15, 20, 25, 30]
    assert_same_run(graphed, eager)


RESUMED_STEPS, RESUME_EVERY = 200, 50
# the child process: train the run checkpointing into the folder named on its command line
RESUME_CHILD = (
    "import sys; from tests.test_models_graph_step import resumable; from mixdepth.train import fit; "
    "fit(resumable(sys.argv[1]))"
)


def resumable(ckpt_dir: str | None) -> RunConfig:
    """A MoD run with the step graph, checkpointing every ``RESUME_EVERY`` steps into ``ckpt_dir`` (None: none)."""
    every = RESUME_EVERY if ckpt_dir else None
    return small_run("mod", RESUMED_STEPS, ckpt_dir, log_every=10, graph_step=True, ckpt_every=every)


@GPU
def test_graph_step_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_run_gpu(tmp_path):
    """What a sweep's time limit does to a run that checkpoints (its worker killed, the run trained on by the next
    command): the rerun restores weights, AdamW moments, scheduler and sampler from the checkpoint into a model
    whose step graph is captured anew, and trains the curve and held-out loss of the run trained in one go, to the
    rounding two bf16 runs of the step graph agree to (test_fit_with_graph_step_trains_the_eager_run_gpu). That two
    runs trained in one go agree so is checked first: its failure says the GPU's run-to-run rounding outgrew the
    comparison over these steps, not that the resumed run differs."""
    folder = tmp_path / "ckpt"
    log = tmp_path / "child.log"
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-c", RESUME_CHILD, str(folder)], stdout=out, stderr=out)
        deadline = time.monotonic() + 300
        while not list(folder.glob("step=*.ckpt")) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    saved = saved_step(folder)
    assert 0 < saved < RESUMED_STEPS, log.read_text()[-2000:]  # killed after a checkpoint, before the end

    resumed = fit(resumable(str(folder)))
    want, again = fit(resumable(None)), fit(resumable(None))
    assert resumed.resumed_step == saved
    steps = [p["step"] for p in want.curve]
    assert steps[:3] == [1, 10, 20] and steps[-1] == RESUMED_STEPS
    assert_same_run(again, want)
    assert_same_run(resumed, want)


@GPU
@pytest.mark.parametrize("graph_step", [False, True], ids=["eager", "graph_step"])
def test_training_steps_never_wait_on_the_gpu(graph_step, monkeypatch):
    """Through train.fit, a step that records no curve point and no throughput measurement makes no device sync (CUDA
    sync debug mode set to error for it, through Lightning's end-of-batch bookkeeping): the host queues the next
    step while the GPU runs this one. A progress-bar value left on the GPU made each step wait (2026-12-04)."""
    steps, log_every, warm = 30, 10, 5  # warm: the step graph's warm-up and capture synchronise
    every, _ = cadence(steps, log_every)
    quiet = [s for s in range(warm + 1, steps) if s % log_every and s % every]
    checked = []
    begin = LitLM.on_train_batch_start

    def on_train_batch_start(self, batch, batch_idx):
        step = self.global_step + 1
        torch.cuda.set_sync_debug_mode("error" if step in quiet else "default")
        checked.extend([step] * (step in quiet))
        return begin(self, batch, batch_idx)

    monkeypatch.setattr(LitLM, "on_train_batch_start", on_train_batch_start)
    model = DenseConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=2, seq_len=64, vocab_size=256)
    data = DataConfig(max_bytes=300_000, val_tokens=4096, seq_len=64)
    train = TrainConfig(batch_size=8, accelerator="gpu", graph_step=graph_step, log_every=log_every, progress=False)
    try:
        result = fit(RunConfig(model, data, train, steps))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert checked == quiet and len(quiet) >= 15
    assert [p["step"] for p in result.curve] == [1, 10, 20, 30]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (dict(accelerator="cpu"), "needs a GPU"),
        (dict(accelerator="gpu", devices=2), "one device"),
        (dict(accelerator="gpu", compile=True, compile_mode="reduce-overhead"), "compile_mode=reduce-overhead"),
        (dict(accelerator="gpu", precision="16-mixed"), "fp16"),
    ],
)
def test_configs_it_cannot_capture_are_refused(overrides, says):
    t = TrainConfig(graph_step=True, **overrides)
    with pytest.raises(ConfigError, match=says) as e:
        check_graph_step(t, t.accelerator)
    assert "\n" not in str(e.value) and "train.graph_step" in str(e.value)
    check_graph_step(TrainConfig(**overrides), overrides["accelerator"])  # without graph_step: no objection


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without a GPU")
def test_graph_step_on_a_host_without_a_gpu_is_refused_before_training():
    with pytest.raises(ConfigError, match="needs a GPU"):
        check_devices(TrainConfig(graph_step=True))  # accelerator auto resolves to the CPU here


def test_sweep_with_a_graph_step_it_cannot_capture_stops_at_load_time(tmp_path, capsys):
    """Exit 2, one line naming the key, nothing written where the sweep would keep its store and queue."""
    from sweeps.__main__ import main

    db = str(tmp_path / "results.db")
    assert main(["isoflop", "--db", db, "train.graph_step=true", "train.accelerator=cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: train.graph_step=true captures CUDA graphs: it needs a GPU (train.accelerator=gpu)"]
    assert list(tmp_path.iterdir()) == []
