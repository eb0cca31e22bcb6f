"""Benchmark entry for the grouped expert SwiGLU MLP (registered by ``kernels/bench.py``).

Workload: token-choice top-k routing (distinct experts per token, softmax-renormalised weights, fp32) of
N tokens over E SwiGLU experts, ``out = grouped_swiglu(x, w1, w3, w2, tok, exp, w)``, forward and
forward+backward (gradients of x, all weights and the router weights).

Peers:

- ``triton``: this op.
- ``naive``: ``naive.py`` (per-expert loop, fp32 math: the reference, not a speed target).
- ``torch_loop``: idiomatic per-expert PyTorch loop in the native dtype (index_select, three matmuls,
  router-weighted index_add).
- ``dense``: one dense SwiGLU MLP over ``M = N * k`` rows (three ``[M, D] x [D, F]``-sized matmuls), the same
  FLOPs with no routing: the roofline the op is measured against (goal: >= 0.7x its TFLOP/s).

TFLOP/s count the matmuls only: ``6 M D F`` forward, ``18 M D F`` forward+backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.grouped_mlp.naive import grouped_swiglu_naive
from kernels.grouped_mlp.op import grouped_swiglu

__all__ = ["add_args", "bench_grouped_mlp", "make_inputs", "make_workloads", "run"]


def _torch_loop(x, w1, w3, w2, tok, exp, w):
    out = torch.zeros_like(x)  # [N, D]
    for e in range(w1.shape[0]):
        sel = (exp == e).nonzero().squeeze(1)
        rows = tok.index_select(0, sel)
        xe = x.index_select(0, rows)  # [M_e, D]
        ye = (F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e]  # [M_e, D]
        out = out.index_add(0, rows, w.index_select(0, sel).to(x.dtype)[:, None] * ye)
    return out


def make_inputs(
    N: int, E: int, k: int, D: int, F_: int, dtype: torch.dtype, device: str | torch.device, g: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """The op's inputs and output gradient ``(x, w1, w3, w2, tok, exp, w, dy)``; x, w1, w3, w2, w are leaves."""
    x = torch.randn(N, D, generator=g).to(device, dtype).requires_grad_()
    w1 = (torch.randn(E, D, F_, generator=g) * D**-0.5).to(device, dtype).requires_grad_()
    w3 = (torch.randn(E, D, F_, generator=g) * D**-0.5).to(device, dtype).requires_grad_()
    w2 = (torch.randn(E, F_, D, generator=g) * F_**-0.5).to(device, dtype).requires_grad_()
    probs, exp = torch.randn(N, E, generator=g).softmax(-1).topk(k, dim=-1)  # [N, k]
    w = (probs / probs.sum(-1, keepdim=True)).reshape(-1).to(device).requires_grad_()  # [N*k] fp32
    exp = exp.reshape(-1).to(device)
    tok = torch.arange(N).repeat_interleave(k).to(device)
    dy = torch.randn(N, D, generator=g).to(device, dtype)
    return x, w1, w3, w2, tok, exp, w, dy


def make_workloads(
    N: int, E: int, k: int, D: int, F_: int, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[dict[str, dict[str, Callable[[], object]]], list[torch.Tensor]]:
    """Builds the timed closures.

    Returns:
        ``({provider: {"fwd": fn, "fwd+bwd": fn}}, leaves)``; ``leaves`` are passed as ``grad_to_none``.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    x, w1, w3, w2, tok, exp, w, dy = make_inputs(N, E, k, D, F_, dtype, device, g)
    m = N * k
    xd = torch.randn(m, D, generator=g).to(device, dtype).requires_grad_()  # dense peer: M rows, one expert
    dyd = torch.randn(m, D, generator=g).to(device, dtype)
    # own leaf weights, so the dense backward does not pay for zero-filling E-expert gradient buffers
    d1, d3, d2 = (t[0].detach().clone().requires_grad_() for t in (w1, w3, w2))

    def dense() -> torch.Tensor:
        return (F.silu(xd @ d1) * (xd @ d3)) @ d2  # [M, D]

    fns = {
        "triton": lambda: grouped_swiglu(x, w1, w3, w2, tok, exp, w),
        "naive": lambda: grouped_swiglu_naive(x, w1, w3, w2, tok, exp, w),
        "torch_loop": lambda: _torch_loop(x, w1, w3, w2, tok, exp, w),
    }
    out: dict[str, dict[str, Callable[[], object]]] = {}
    for name, fwd in fns.items():
        out[name] = {"fwd": fwd, "fwd+bwd": lambda fwd=fwd: fwd().backward(dy)}
    out["dense"] = {"fwd": dense, "fwd+bwd": lambda: dense().backward(dyd)}
    return out, [x, w1, w3, w2, w, xd, d1, d3, d2]


def bench_grouped_mlp(
    N: int = 16384,
    E: int = 8,
    k: int = 2,
    D: int = 1024,
    F_: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    providers: tuple[str, ...] = ("triton", "torch_loop", "dense", "naive"),
) -> list[dict[str, object]]:
    """Times every peer, forward and forward+backward, in one process (medians of ``do_bench``).

    Returns:
        One row per (provider, mode) with ``ms``, ``tflops`` and ``vs_dense`` (TFLOP/s ratio to the dense
        peer of the same mode).
    """
    import triton.testing

    workloads, leaves = make_workloads(N, E, k, D, F_, dtype, device)
    m = N * k
    flops = {"fwd": 6 * m * D * F_, "fwd+bwd": 18 * m * D * F_}
    rows: list[dict[str, object]] = []
    for provider in providers:
        for mode, fn in workloads[provider].items():
            ms = triton.testing.do_bench(fn, grad_to_none=leaves, return_mode="median")
            shape = {"N": N, "E": E, "k": k, "D": D, "F": F_, "dtype": str(dtype).removeprefix("torch.")}
            row = {"op": "grouped_mlp", "provider": provider, "mode": mode, **shape, "ms": ms}
            rows.append({**row, "tflops": flops[mode] / ms / 1e9})
    dense = {r["mode"]: r["tflops"] for r in rows if r["provider"] == "dense"}
    for r in rows:
        if r["mode"] in dense:
            r["vs_dense"] = r["tflops"] / dense[r["mode"]]
    return rows


def add_args(p) -> None:
    p.add_argument("--N", type=int, nargs="+", default=[16384])
    p.add_argument("--E", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--D", type=int, default=1024)
    p.add_argument("--F", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--providers", nargs="+", default=["triton", "torch_loop", "dense", "naive"])


def run(args):
    from kernels.bench import markdown_table

    dtype = getattr(torch, args.dtype)
    rows = [
        r
        for n in args.N
        for r in bench_grouped_mlp(n, args.E, args.k, args.D, args.F, dtype, providers=tuple(args.providers))
    ]
    return rows, markdown_table(rows)


if __name__ == "__main__":
    for row in bench_grouped_mlp():
        print(row)
