"""Benchmark entry for routed gather + scatter-add (registered by ``kernels/bench.py``).

Workload: the MoD routed block with an identity body,
``y = route_scatter_add(x, idx, route_gather(x, idx), w)``, so forward runs
gather + scatter and backward runs scatter-bwd (df, dw) + gather-bwd (dx) + the dx sum.
Peers: ``triton`` (this op, general path: sort + CSR segments), ``triton_distinct`` (this op with
``distinct=True``, MoD's case: no segments), ``naive`` (the fp32-accumulating reference in naive.py) and
``torch`` (idiomatic native-dtype PyTorch: ``index_select`` + out-of-place ``index_add`` with batch offsets).
The indices are sorted and distinct per sequence, so every peer computes the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from kernels.route_gather_scatter.naive import flatten_index, route_gather_naive, route_scatter_add_naive
from kernels.route_gather_scatter.op import route_gather, route_scatter_add

__all__ = ["bench_route_gather_scatter", "make_workloads"]


def _torch_gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    return x.reshape(b * t, d).index_select(0, flatten_index(idx, t)).view(b, -1, d)


def _torch_scatter_add(x: torch.Tensor, idx: torch.Tensor, f: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    upd = (w.to(f.dtype)[..., None] * f).reshape(-1, d)  # [B*K, D]
    return x.reshape(b * t, d).index_add(0, flatten_index(idx, t), upd).view(b, t, d)


PROVIDERS = {
    "triton": (route_gather, route_scatter_add),
    "triton_distinct": (partial(route_gather, distinct=True), partial(route_scatter_add, distinct=True)),
    "naive": (route_gather_naive, route_scatter_add_naive),
    "torch": (_torch_gather, _torch_scatter_add),
}


def make_workloads(
    B: int, T: int, D: int, K: int, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[dict[str, dict[str, Callable[[], object]]], list[torch.Tensor]]:
    """Builds the timed closures.

    Args:
        B, T, D, K: batch, sequence length, width, capacity per sequence.
        dtype: activation dtype (router weights stay fp32).
        device: where the tensors live.
        seed: RNG seed for inputs and the per-sequence random top-K positions.

    Returns:
        ``({provider: {"fwd": fn, "fwd+bwd": fn}}, leaves)``; ``leaves`` (x, w) are to be passed as
        ``grad_to_none``.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, T, D, generator=g).to(device, dtype).requires_grad_()
    w = torch.rand(B, K, generator=g).to(device).requires_grad_()
    idx = torch.stack([torch.randperm(T, generator=g)[:K].sort().values for _ in range(B)]).to(device)
    dy = torch.randn(B, T, D, generator=g).to(device, dtype)
    out: dict[str, dict[str, Callable[[], object]]] = {}
    for name, (gather, scatter) in PROVIDERS.items():

        def fwd(gather=gather, scatter=scatter) -> torch.Tensor:
            return scatter(x, idx, gather(x, idx), w)  # [B, T, D]

        def fwd_bwd(fwd=fwd) -> None:
            fwd().backward(dy)

        out[name] = {"fwd": fwd, "fwd+bwd": fwd_bwd}
    return out, [x, w]


def bench_route_gather_scatter(
    B: int = 8,
    T: int = 2048,
    D: int = 1024,
    K: int = 256,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
) -> list[dict[str, object]]:
    """Times routed gather + scatter-add, forward and forward+backward, for every peer in one process.

    Args:
        B, T, D, K: shape (defaults: the MoD paper's best point, T=2048 with 12.5% capacity).
        dtype: activation dtype.
        device: a CUDA device (``do_bench`` times with CUDA events).

    Returns:
        One row per (provider, mode): ``{"op", "provider", "mode", "B", "T", "D", "K", "dtype", "ms",
        "graph_ms"}`` with ``ms`` the median of ``triton.testing.do_bench`` (eager: host launch overhead
        included, and at the default shape it dominates) and ``graph_ms`` the median of ``do_bench_cudagraph``
        (device time: launches replayed from a CUDA graph, no L2 flush; nan for ``naive``, whose range check
        syncs the host and cannot be captured).
    """
    import triton.testing

    workloads, leaves = make_workloads(B, T, D, K, dtype, device)
    shape = {"B": B, "T": T, "D": D, "K": K, "dtype": str(dtype).removeprefix("torch.")}
    rows: list[dict[str, object]] = []
    for provider, modes in workloads.items():
        for mode, fn in modes.items():
            ms = triton.testing.do_bench(fn, grad_to_none=leaves, return_mode="median")
            rows.append({"op": "route_gather_scatter", "provider": provider, "mode": mode, **shape, "ms": ms})
    for row in rows:  # after every eager timing, so a failed capture cannot disturb them
        fn = workloads[row["provider"]][row["mode"]]
        graph = row["provider"] != "naive"
        row["graph_ms"] = (
            triton.testing.do_bench_cudagraph(fn, grad_to_none=leaves, return_mode="median") if graph else float("nan")
        )
    return rows


if __name__ == "__main__":
    for row in bench_route_gather_scatter():
        print(row)
