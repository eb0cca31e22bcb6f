"""Training-loop benchmarks (scripts, not tests): ``python -m mixdepth.bench loop|mfu|compile|step|ddp``.

loop: the Lightning path every run takes (train.make_trainer + LitLM) against a plain PyTorch loop with the
      same model, data, optimizer, schedule and clipping, alternated in one process; prints the ratio.
mfu:  tokens/s, MFU and peak memory through train.fit (bf16, torch.compile) of archs at one shape (GPT-2 small by
      default), on one or more device counts (--devices 1,2, DDP or FSDP); with --profile N, where N of each fit's
      steps went (GPU kernels, GPU idle, the host waiting on the GPU).
compile: where one small sweep run's time goes (GPU): train.fit of archs at a shape with empty compile caches, with
      the on-disk caches warm, and compiled in-process already; fit wall, steady steps, compile time, MFU.
step: training-step time and peak memory of several archs at one shape (e.g. MoD vs dense), GPU.
ddp:  the same run through train.fit on 1 and on N CPU processes (DDP over gloo), alternated; tokens/s and ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixdepth.config import (
    COMPILE_MODES,
    COMPILE_SCOPES,
    CUDA_GRAPH_MODES,
    ConfigError,
    DataConfig,
    TrainConfig,
    model_options,
)
from mixdepth.flops import train_flops
from mixdepth.lit import LitLM, LMDataModule
from mixdepth.models import MODELS
from mixdepth.models.dense import DenseConfig, DenseLM
from mixdepth.profiling import StepWindowProfile, kernel_time
from mixdepth.results import RunMetrics
from mixdepth.throughput import cadence
from mixdepth.train import RunConfig, _quiet, fit, make_trainer, resolve_device


def _setup(model_cfg: DenseConfig, data: DataConfig, train: TrainConfig, steps: int):
    torch.manual_seed(train.seed)
    dm = LMDataModule(data, batch_size=train.batch_size, seed=train.seed)
    dm.setup("fit")
    model = DenseLM(model_cfg)
    lit = LitLM(
        model, train, steps, flops_per_batch=train_flops(model_cfg.flops_per_token(), train.batch_size * data.seq_len)
    )
    return dm, lit


def time_lightning(model_cfg, data, train, steps) -> float:
    dm, lit = _setup(model_cfg, data, train, steps)
    accelerator, precision = resolve_device(train)
    trainer = make_trainer(train, steps, accelerator, precision, [])
    start = time.perf_counter()
    trainer.fit(lit, train_dataloaders=dm.train_dataloader())
    return time.perf_counter() - start


def time_plain(model_cfg, data, train, steps) -> float:
    dm, lit = _setup(model_cfg, data, train, steps)
    opts = lit.configure_optimizers()
    opt, sched = opts["optimizer"], opts["lr_scheduler"]["scheduler"]
    model = lit.model.train()
    start = time.perf_counter()
    for step, (x, y) in enumerate(dm.train_dataloader()):
        if step == steps:
            break
        loss = model.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % train.log_every == 0:
            loss.item()  # the adapter reads the loss at the same cadence
    return time.perf_counter() - start


def bench_loop(args) -> None:
    _quiet()
    model_cfg = DenseConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=4, n_kv_heads=4, seq_len=128)
    data = DataConfig(seq_len=128, max_bytes=1_000_000, val_tokens=8192)
    train = TrainConfig(batch_size=16, progress=False)
    plain, light = [], []
    for _ in range(args.repeats):
        plain.append(time_plain(model_cfg, data, train, args.steps))
        light.append(time_lightning(model_cfg, data, train, args.steps))
    p, lt = statistics.median(plain), statistics.median(light)
    print(
        f"model d_model={args.d_model} layers={args.n_layers} batch=16x128, {args.steps} steps, "
        f"{args.repeats} alternating repeats, torch threads={torch.get_num_threads()}"
    )
    print(f"plain PyTorch loop: {p:.2f}s median ({', '.join(f'{v:.2f}' for v in plain)})")
    print(f"Lightning (fit path): {lt:.2f}s median ({', '.join(f'{v:.2f}' for v in light)})")
    print(f"ratio Lightning / plain = {lt / p:.3f}")


SCOPE_HELP = "what torch.compile wraps: model (one graph), block (one graph per kind of block)"


def synthetic_data(folder: Path, vocab: int, tokens: int, seq_len: int, val_tokens: int) -> DataConfig:
    """A .bin corpus of uniform random token ids in ``folder``: speed only, no learnable structure."""
    path = folder / "tokens.bin"
    np.random.default_rng(0).integers(0, vocab, size=tokens, dtype=np.uint16).tofile(path)
    return DataConfig(corpus=str(path), bin_vocab_size=vocab, seq_len=seq_len, val_tokens=val_tokens)


def bench_mfu(args) -> None:
    """Tokens/s and MFU through ``train.fit`` (the path every sweep run takes) of each arch at one shape, on each
    device count of ``--devices`` (same global batch), side by side in one process; the speed of each relative to
    the first arch trained the same way (MoD vs dense, both with the step graph or both without) and to its own first
    way (the step graph's gain; two GPUs vs one), its peak memory and losses."""
    vocab = args.vocab
    with tempfile.TemporaryDirectory() as tmp:
        T, d, H = args.seq_len, args.d_model, args.d_model // 64
        if args.corpus == "synthetic":
            data = synthetic_data(Path(tmp), vocab, args.tokens, T, val_tokens=T * 64)
        elif vocab != 256:
            raise ConfigError(f"--corpus {args.corpus}: text is tokenised to bytes; give --vocab 256")
        else:
            data = DataConfig(corpus=args.corpus, seq_len=T, max_bytes=args.tokens, val_tokens=T * 64)
        train = TrainConfig(
            batch_size=args.batch_size,
            compile=not args.no_compile,
            compile_mode=args.compile_mode,
            compile_scope=args.compile_scope,
            accelerator=args.accelerator,
            strategy=args.strategy,
            progress=False,
            log_every=50,
            lr=6e-4,
        )
        # --graph-step: each arch again with the step as one CUDA graph (Inductor without graphs of its own)
        mode = "default" if args.compile_mode in CUDA_GRAPH_MODES else args.compile_mode
        graphed = replace(train, compile_mode=mode, graph_step=True)
        trains = [("", train)] + [(" +graph_step", graphed)] * args.graph_step
        counts = [int(n) for n in args.devices.split(",")]
        start = _profile_start(args.steps, args.profile, train.log_every)
        rows = []
        for arch in args.archs.split(","):
            model = MODELS[arch][0](
                arch=arch, d_model=d, n_layers=args.n_layers, n_heads=H, n_kv_heads=H, seq_len=T, vocab_size=vocab,
                tie_embeddings=True, **step_options(arch, args.set),
            )  # fmt: skip
            for n in counts:
                for label, t in trains:
                    # beside more devices, one device trains as a run on one does (no DDP/FSDP wrapper)
                    how = "auto" if n == 1 and len(counts) > 1 else args.strategy
                    label = f"{label} x{n} {how}" if len(counts) > 1 else label
                    torch._dynamo.reset()
                    prof = [StepWindowProfile(start, args.profile, f" {arch}{label}")] if args.profile else []
                    run = RunConfig(model, data, replace(t, devices=n, strategy=how), args.steps)
                    rows.append((arch, label, model, fit(run, callbacks=prof).metrics))
    print(
        f"d{d} L{args.n_layers} H{H} T{T} vocab {vocab} tied, {args.corpus} corpus, global batch {args.batch_size}x{T},"
        f" steps {args.steps}, compile {not args.no_compile} (mode {args.compile_mode}, scope {args.compile_scope}),"
        f" window of the last {min(100, args.steps // 2)} steps; device {rows[0][3].device}, precision"
        f" {rows[0][3].precision}, devices {args.devices} (strategy {args.strategy}, beside them 1 auto; tokens/s"
        " over all of them, MFU and peak memory per device)"
        + (f"; +graph_step: train.graph_step=true, compile mode {mode}" if args.graph_step else "")
    )
    ratios = speed_ratios([(arch, label, res.tokens_per_s) for arch, label, _, res in rows])
    print("| arch | params | fwd FLOPs/token | tokens/s | MFU (peak FLOP/s) | speed vs first arch, same way |"
          " speed vs its first way | peak GiB | val loss | train objective | wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (arch, label, model, res), (vs_arch, vs_way) in zip(rows, ratios, strict=True):
        mfu = f"{res.mfu:.1%} ({res.peak_flops:.4g})" if res.mfu else "n/a (no known peak)"
        memory = "n/a" if res.peak_memory_gib is None else f"{res.peak_memory_gib:.2f}"
        print(
            f"| {arch}{label} | {model.n_params()['total']:,} | {model.flops_per_token():.4g} |"
            f" {res.tokens_per_s:,.0f} | {mfu} | {vs_arch:.3f}x | {vs_way:.3f}x | {memory} | {loss_cells(res)} |"
            f" {res.wall_s:.1f} |"
        )


def loss_cells(res: RunMetrics) -> str:
    """A row's val loss (the LM loss) and train objective (MoD's adds its router's and predictor's BCE) cells;
    "diverged" for a run whose losses are NULL (a loss not finite, or the training objective blew up; a speed
    benchmark's synthetic tokens at its learning rate can do that to routed models)."""
    return "diverged | diverged" if res.status == "diverged" else f"{res.val_loss:.4f} | {res.train_loss:.4f}"


def speed_ratios(rows: list[tuple[str, str, float]]) -> list[tuple[float, float]]:
    """(arch, way, tokens/s) rows -> per row, its speed over that of the first arch trained the same way (MoD vs dense,
    both with the step graph or both without) and over its own arch's first way (the step graph's gain; 2 GPUs vs 1)."""
    first_arch, first_way = {}, {}
    for arch, way, tps in rows:
        first_arch.setdefault(way, tps)
        first_way.setdefault(arch, tps)
    return [(tps / first_arch[way], tps / first_way[arch]) for arch, way, tps in rows]


def _profile_start(steps: int, n: int, log_every: int) -> int:
    """The first step of ``mfu --profile n``'s window: after compilation and the step graph's capture (step 6 at
    the earliest), a quarter into the run, ending before the steps whose rate the run reports.

    Raises:
        ConfigError: the window does not fit before them.
    """
    every, window = cadence(steps, log_every)
    start, last = max(6, steps // 4 + 1), steps - window * every
    if n and start + n - 1 > last:
        raise ConfigError(f"--profile {n}: steps {start}-{start + n - 1} would reach the measured steps; raise --steps")
    return start


def bench_ddp(args) -> None:
    """One process against ``--ranks`` processes, same global batch: tokens/s over the ThroughputMonitor's window
    (steady state), and fit's wall time (with the ranks' startup). ``--threads 0``: the one process has every core,
    the ranks share them (launch's OMP_NUM_THREADS); ``--threads N``: N torch threads in every process."""
    _quiet()
    model = DenseConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=4, n_kv_heads=4, seq_len=128)
    data = DataConfig(seq_len=128, max_bytes=1_000_000, val_tokens=8192)
    rows: dict[int, list[tuple[float, float]]] = {1: [], args.ranks: []}
    for _ in range(args.repeats):
        for devices in rows:
            train = TrainConfig(
                batch_size=args.batch_size, devices=devices, accelerator="cpu", threads=args.threads, progress=False
            )
            start = time.perf_counter()
            m = fit(RunConfig(model, data, train, args.steps)).metrics
            rows[devices].append((m.tokens_per_s, time.perf_counter() - start))
    print(
        f"dense d_model={args.d_model} layers={args.n_layers}, global batch {args.batch_size}x128, {args.steps} steps,"
        f" {args.repeats} alternating repeats, torch threads per process: "
        + (f"{args.threads}" if args.threads else f"{torch.get_num_threads()} alone, cores / ranks as ranks")
    )
    tps = {}
    for devices, runs in rows.items():
        tps[devices] = statistics.median(r[0] for r in runs)
        walls = statistics.median(r[1] for r in runs)
        each = ", ".join(f"{r[0]:,.0f}" for r in runs)
        print(f"{devices} process(es): {tps[devices]:,.0f} tokens/s median ({each}); fit wall {walls:.1f}s median")
    print(f"ratio {args.ranks} processes / 1 = {tps[args.ranks] / tps[1]:.3f}")


def _profile(step, label: str, rows: int) -> None:
    """The GPU kernels of three steps, heaviest first (self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(f"--- profile: {label}, 3 steps ---")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))


def _gpu_busy_ms(step, n: int = 3) -> float:
    """Mean time per step covered by at least one GPU kernel (union of kernel intervals) over n steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    return kernel_time(prof.events())[0] / n / 1e3


def bench_compile(args) -> None:
    """One run's fit at a shape three times per arch: with empty on-disk Inductor/Triton caches (a folder of its own;
    kernels an earlier arch loaded in this process can still be reused), with those caches warm after
    ``torch._dynamo.reset()`` (dynamo traces again, as a new process would, less its imports), and in-process (no
    reset: dynamo's compiled code is reused)."""
    import os

    from torch._dynamo.utils import compilation_time_metrics, compile_times, counters

    from mixdepth.models import dense

    if args.cache_rules == "torch":  # torch's own rules: the baseline of compile_cache.cache_compiled_graphs
        dense.cache_compiled_graphs = lambda: None
    T, d, L = args.seq_len, args.d_model, args.n_layers
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic_data(Path(tmp), 256, args.tokens, T, val_tokens=T * 256)
        train = TrainConfig(
            batch_size=args.batch_size, lr=1.5e-3, accelerator=args.accelerator, compile=True,
            compile_mode=args.compile_mode, compile_scope=args.compile_scope, graph_step=args.graph_step,
            log_every=25, progress=False,
        )  # fmt: skip
        print(
            f"d{d} L{L} T{T} byte vocabulary, batch {args.batch_size}x{T}, {args.steps} steps, compile mode"
            f" {args.compile_mode}, scope {args.compile_scope}, graph_step {args.graph_step}, cache rules"
            f" {args.cache_rules}; compile = dynamo's _compile.compile_inner (the forward frames; the backward compiles"
            " at the first backward, inside the fit wall-clock); AOTAutograd's cache: hits/misses/bypasses of the fit"
        )
        print("| arch | caches | fit wall s | steady s | compile s | MFU | AOTAutograd cache |")
        print("|---|---|---|---|---|---|---|")
        for arch in args.archs.split(","):
            for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
                os.environ[var] = str(Path(tmp) / arch / var)
            for caches, reset in (("empty", True), ("on disk", True), ("in-process", False)):
                if reset:
                    torch._dynamo.reset()
                compilation_time_metrics.clear()
                aot = dict(counters["aot_autograd"])
                model = MODELS[arch][0](
                    arch=arch, d_model=d, n_layers=L, n_heads=d // 64, n_kv_heads=d // 64, seq_len=T, vocab_size=256,
                    **step_options(arch, args.set),
                )  # fmt: skip
                res = fit(RunConfig(model, data, train, args.steps)).metrics
                names, values = compile_times(repr="csv", aggregate=True) or ([], [])
                took = float(dict(zip(names, values, strict=True)).get("_compile.compile_inner", 0.0))
                steady = args.steps * args.batch_size * T / res.tokens_per_s
                mfu = f"{res.mfu:.1%}" if res.mfu else "n/a"
                cached = "/".join(
                    str(counters["aot_autograd"][f"autograd_cache_{k}"] - aot.get(f"autograd_cache_{k}", 0))
                    for k in ("hit", "miss", "bypass")
                )
                print(f"| {arch} | {caches} | {res.wall_s:.1f} | {steady:.1f} | {took:.1f} | {mfu} | {cached} |")


def step_options(arch: str, sets: list[str]) -> dict[str, Any]:
    """The ``--set arch.key=value`` options of ``arch``, typed as config overrides are (``false`` is False)."""
    return model_options(arch, [kv.split(".", 1)[1] for kv in sets if kv.startswith(f"{arch}.")])


def bench_step(args) -> None:
    """Training-step time and peak memory of several archs at one shape, side by side (GPU, bf16)."""
    from torch._dynamo.utils import counters

    dev = torch.device("cuda")
    T, d = args.seq_len, args.d_model
    options = {arch: step_options(arch, args.set) for arch in args.archs.split(",")}  # bad input fails first
    rows = []
    for arch, extra in options.items():
        cfg = MODELS[arch][0](
            arch=arch,
            d_model=d,
            n_layers=args.n_layers,
            n_heads=d // 64,
            n_kv_heads=args.kv_heads or d // 64,
            seq_len=T,
            vocab_size=args.vocab,
            tie_embeddings=True,
            **extra,
        )
        torch.manual_seed(0)
        torch._dynamo.reset()
        counters.clear()
        model = MODELS[arch][1](cfg).to(dev)
        if args.compile:
            model.compile(mode=args.compile_mode, scope=args.compile_scope)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randint(0, args.vocab, (args.batch_size, T + 1), device=dev)

        def step(model=model, opt=opt, x=x):
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration for CUDA graphs (reduce-overhead)
            with torch.autocast("cuda", torch.bfloat16):
                loss = model.loss(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record()
            step()
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1))
        # CUDA graphs allocate their memory pool while recording (warm-up), so the timed steps' peak misses it
        peak = None if args.compile_mode == "reduce-overhead" else torch.cuda.max_memory_allocated() / 2**30
        busy = _gpu_busy_ms(step)
        frames = counters["frames"]
        dynamo = f"{frames['ok']}/{frames['total']}, {sum(counters['graph_break'].values())}" if args.compile else "-"
        if args.profile:
            _profile(step, arch, args.profile)
        n = cfg.n_params()
        rows.append(
            (
                arch,
                n["total"],
                cfg.flops_per_token(),
                statistics.median(times),
                busy,
                peak,
                extra,
                dynamo,
            )
        )
        del model, opt
        torch.cuda.empty_cache()
    base = rows[0]
    print(
        f"d_model {d}, {args.n_layers} layers, {d // 64} heads, {args.kv_heads or d // 64} KV heads, T {T},"
        f" batch {args.batch_size}, vocab {args.vocab}, bf16 autocast, fused AdamW,"
        f" compile {args.compile} (mode {args.compile_mode or 'default'}, scope {args.compile_scope}),"
        f" {torch.cuda.get_device_name(0)},"
        f" torch {torch.__version__}"
    )
    print(
        "| arch | options | params | fwd FLOPs/token | step ms (median) | vs first | FLOP ratio | peak GiB |"
        " GPU busy ms | dynamo frames ok/total, graph breaks |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arch, p, f, ms, busy, mem, extra, dynamo in rows:
        print(
            f"| {arch} | {extra or ''} | {p / 1e6:.1f}M | {f:.4g} | {ms:.2f} | {base[3] / ms:.3f}x faster |"
            f" {base[2] / f:.3f}x | {'-' if mem is None else f'{mem:.2f}'} | {busy:.2f} | {dynamo} |"
        )
    print(
        "GPU busy ms: time per step in which some GPU kernel runs (3 profiled steps); well below the step time"
        " means the step waits on the host (launches). peak GiB: torch.cuda.max_memory_allocated, timed steps"
        " (not shown under reduce-overhead: its CUDA graph pool is allocated during warm-up)."
    )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m mixdepth.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("loop", help="Lightning vs plain PyTorch loop, CPU")
    lp.add_argument("--steps", type=int, default=150)
    lp.add_argument("--repeats", type=int, default=3)
    lp.add_argument("--d-model", type=int, default=128)
    lp.add_argument("--n-layers", type=int, default=4)
    mp = sub.add_parser("mfu", help="tokens/s and MFU through train.fit, archs side by side (GPU)")
    mp.add_argument("--archs", default="dense", help="comma-separated, timed in this order (ratios vs the first)")
    mp.add_argument("--steps", type=int, default=300)
    mp.add_argument("--batch-size", type=int, default=32)
    mp.add_argument("--no-compile", action="store_true")
    mp.add_argument("--compile-mode", default="default", choices=COMPILE_MODES)
    mp.add_argument("--compile-scope", default="model", choices=COMPILE_SCOPES, help=SCOPE_HELP)
    mp.add_argument("--graph-step", action="store_true", help="each arch also with train.graph_step (compile default)")
    mp.add_argument("--d-model", type=int, default=768)
    mp.add_argument("--n-layers", type=int, default=12)
    mp.add_argument("--seq-len", type=int, default=1024)
    mp.add_argument("--vocab", type=int, default=50304, help="vocabulary (tied embeddings); 256 = byte-level")
    mp.add_argument("--tokens", type=int, default=64_000_000, help="synthetic .bin corpus size")
    mp.add_argument("--set", nargs="*", default=[], help="arch.key=value model options, e.g. mod.capacity=0.125")
    mp.add_argument("--profile", type=int, default=0, help="profile N steps of each fit (kernels, idle, host waits)")
    mp.add_argument("--devices", default="1", help="comma-separated device counts, e.g. 1,2: each run on each")
    mp.add_argument(
        "--strategy", default="auto", choices=("auto", "ddp", "fsdp"), help="train.strategy (1 beside more: auto)"
    )
    mp.add_argument("--accelerator", default="auto", choices=("auto", "gpu", "cpu"), help="cpu: a smoke run")
    mp.add_argument(
        "--corpus", default="synthetic", help="synthetic (random ids: speed only) or a data.corpus, e.g. stdlib (bytes)"
    )
    cp = sub.add_parser("compile", help="one run's fit with empty, on-disk and in-process compile caches (GPU)")
    cp.add_argument("--archs", default="dense,mod,mode")
    cp.add_argument("--d-model", type=int, default=384)
    cp.add_argument("--n-layers", type=int, default=6)
    cp.add_argument("--seq-len", type=int, default=1024)
    cp.add_argument("--batch-size", type=int, default=32)
    cp.add_argument("--steps", type=int, default=300)
    cp.add_argument("--compile-mode", default="reduce-overhead", choices=COMPILE_MODES)
    cp.add_argument("--compile-scope", default="model", choices=COMPILE_SCOPES, help=SCOPE_HELP)
    cp.add_argument("--graph-step", action="store_true", help="train.graph_step (with --compile-mode default)")
    cp.add_argument("--tokens", type=int, default=40_000_000, help="synthetic .bin corpus size")
    cp.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"), help="cpu: a smoke run of the command")
    cp.add_argument("--set", nargs="*", default=[], help="arch.key=value model options, e.g. mod.capacity=0.125")
    cp.add_argument(
        "--cache-rules", default="ours", choices=("ours", "torch"),
        help="what the on-disk caches may serve: ours (compile_cache.cache_compiled_graphs) or torch's defaults",
    )  # fmt: skip
    sp = sub.add_parser("step", help="training-step time and peak memory of archs at one shape (GPU)")
    sp.add_argument("--archs", default="dense,mod")
    sp.add_argument("--d-model", type=int, default=1024)
    sp.add_argument("--n-layers", type=int, default=12)
    sp.add_argument("--seq-len", type=int, default=2048)
    sp.add_argument("--batch-size", type=int, default=8)
    sp.add_argument("--steps", type=int, default=20)
    sp.add_argument("--kv-heads", type=int, default=0, help="KV heads (GQA); 0 = as many as query heads (d/64)")
    sp.add_argument("--vocab", type=int, default=50304, help="vocabulary (tied embeddings); 256 = byte-level")
    sp.add_argument("--compile", action="store_true", help="torch.compile every model")
    sp.add_argument(
        "--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs); default: default"
    )
    sp.add_argument("--compile-scope", default="model", choices=COMPILE_SCOPES, help=SCOPE_HELP)
    sp.add_argument("--profile", type=int, default=0, help="print the N heaviest GPU kernels per arch")
    sp.add_argument("--set", nargs="*", default=[], help="arch.key=value model options, e.g. mod.capacity=0.125")
    dp = sub.add_parser("ddp", help="one CPU process vs several (DDP over gloo), same global batch")
    dp.add_argument("--ranks", type=int, default=2)
    dp.add_argument("--steps", type=int, default=100)
    dp.add_argument("--repeats", type=int, default=3)
    dp.add_argument("--batch-size", type=int, default=16)
    dp.add_argument("--d-model", type=int, default=128)
    dp.add_argument("--n-layers", type=int, default=4)
    dp.add_argument("--threads", type=int, default=0, help="torch threads per process; 0: cores shared out")
    args = p.parse_args()
    try:
        {"loop": bench_loop, "mfu": bench_mfu, "compile": bench_compile, "step": bench_step, "ddp": bench_ddp}[
            args.cmd
        ](args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
