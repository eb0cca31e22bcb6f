"""Benchmark entry for the fused linear + cross-entropy (registered by ``kernels/bench.py``).

Workload: the LM head and its loss, ``loss = CE(x W^T, t)`` (mean), forward + backward (gradients of x and W),
with ``x [N, D]``, ``W [V, D]`` (the GPT-2-small shape: N = 32 x 1024 tokens, D = 768, V = 50304). Inputs are
in ``--dtype`` (bf16 by default), or fp32 leaves under bf16 autocast with ``--autocast`` (the trainer's case).

Peers, timed side by side in this process (median of ``triton.testing.do_bench``, ``grad_to_none`` the leaves):

- ``ours``: ``kernels.linear_ce.linear_cross_entropy`` (chunked logits, gradients in the forward);
- ``torch``: eager ``F.cross_entropy(F.linear(x, W).float(), t)``, the models' loss before the op;
- ``compile``: the same function under ``torch.compile`` (Inductor fuses the upcast and log-softmax);
- ``liger``: ``liger_kernel``'s fused linear cross-entropy, when it is installed (skipped otherwise).

Each row also has the peak memory of one forward + backward above what was allocated before it (the inputs),
the TFLOP/s of its three ``2 N D V`` matmuls, and the relative L2 errors (``||a - r|| / ||r||``, as
``kernels.testing.assert_close``) of the loss, dx and dW against the fp32 reference (``naive.py`` on the
inputs upcast to fp32). ``--block-v``, ``--block-r``, ``--num-warps`` and ``--chunk-mb`` override the op's
``kernel.CONFIG`` (for tuning).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from kernels.linear_ce import kernel as lk
from kernels.linear_ce.naive import linear_cross_entropy_naive
from kernels.linear_ce.op import linear_cross_entropy

__all__ = ["add_args", "bench_linear_ce", "make_peers", "run"]

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _unfused(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(x, w).float(), t)


def make_peers(providers: tuple[str, ...]) -> dict[str, LossFn]:
    """``{provider: loss_fn(x, w, t)}`` for the providers asked for that can run here (liger may be missing)."""
    peers: dict[str, LossFn] = {"ours": linear_cross_entropy, "torch": _unfused, "compile": torch.compile(_unfused)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        pass
    else:
        liger = LigerFusedLinearCrossEntropyLoss()
        peers["liger"] = lambda x, w, t: liger(w, x, t)
    return {p: peers[p] for p in providers if p in peers}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def bench_linear_ce(
    N: int = 32768,
    D: int = 768,
    V: int = 50304,
    dtype: torch.dtype = torch.bfloat16,
    autocast: bool = False,
    providers: tuple[str, ...] = ("ours", "torch", "compile", "liger"),
    device: str = "cuda",
    seed: int = 0,
) -> list[dict[str, object]]:
    """Times every peer's forward + backward in one process and checks it against the fp32 reference.

    Returns:
        One row per provider: ``{"op", "provider", "N", "D", "V", "dtype", "ms", "tflops", "peak_mb",
        "err_loss", "err_dx", "err_dw"}``.
    """
    import triton.testing

    g = torch.Generator(device="cpu").manual_seed(seed)
    leaf = torch.float32 if autocast else dtype
    x = torch.randn(N, D, generator=g).to(device, leaf).requires_grad_()
    w = (torch.randn(V, D, generator=g) * D**-0.5).to(device, leaf).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(device)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref_loss = linear_cross_entropy_naive(xr, wr, t)
    ref_loss.backward()
    ref = (ref_loss.detach(), xr.grad, wr.grad)
    del xr, wr, ref_loss

    def step(fn: LossFn) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(x, w, t)
        loss.backward()
        return loss

    shape = {"N": N, "D": D, "V": V, "dtype": "fp32+autocast-bf16" if autocast else str(dtype).removeprefix("torch.")}
    rows: list[dict[str, object]] = []
    for provider, fn in make_peers(providers).items():
        x.grad = w.grad = None
        loss = step(fn).detach()  # warm-up (and compilation) outside the timing; its results are checked
        errs = {
            f"err_{k}": _rel(a, r) for k, a, r in zip(("loss", "dx", "dw"), (loss, x.grad, w.grad), ref, strict=True)
        }
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(fn)
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = triton.testing.do_bench(lambda fn=fn: step(fn), grad_to_none=[x, w], return_mode="median")
        tflops = 6 * N * D * V / ms / 1e9
        rows.append({"op": "linear_ce", "provider": provider, **shape, "ms": ms, "tflops": tflops, "peak_mb": peak_mb})
        rows[-1].update(errs)
        x.grad = w.grad = None
    return rows


def add_args(p) -> None:
    p.add_argument("--shapes", nargs="+", default=["32768,768,50304", "16384,1024,50304"], help="N,D,V ...")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--autocast", action="store_true", help="fp32 leaves under bf16 autocast (the trainer's case)")
    p.add_argument("--providers", nargs="+", default=["ours", "torch", "compile", "liger"])
    p.add_argument("--block-v", type=int, default=None)
    p.add_argument("--block-r", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--chunk-mb", type=int, default=None, help="logits per chunk, MiB")


def run(args):
    from kernels.bench import markdown_table

    over = {"block_v": args.block_v, "block_r": args.block_r, "num_warps": args.num_warps}
    over = {k: v for k, v in over.items() if v is not None}
    if args.chunk_mb is not None:
        over["chunk_bytes"] = args.chunk_mb * 2**20
    lk.CONFIG = replace(lk.CONFIG, **over)
    dtype = getattr(torch, args.dtype)
    rows = []
    for s in args.shapes:
        n, d, v = map(int, s.split(","))
        rows += bench_linear_ce(n, d, v, dtype, args.autocast, tuple(args.providers))
    return rows, markdown_table(rows)


if __name__ == "__main__":
    for row in bench_linear_ce():
        print(row)
