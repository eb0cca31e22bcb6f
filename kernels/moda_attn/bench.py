"""Benchmark entry for MoDA attention (registered by ``kernels/bench.py``).

Workload: forward + backward (``o.backward(do)``), bf16, the paper's Table 2 shapes by default
(B=1, D=64, Hq=64, Hk=8, S=L=64 depth slots). Peers, timed side by side in one process:

* ``moda``: this op (sequence causal + depth slots, one softmax): torch's fused attention for the sequence
  part (cuDNN on Hopper) merged with the Triton depth kernels; ``moda_flash``: the same with flash there;
* ``sdpa_flash`` / ``sdpa_cudnn``: torch SDPA, plain causal attention WITHOUT depth (a lower bound for the
  sequence part), via ``torch.nn.attention.sdpa_kernel``;
* ``flex_moda``: FlexAttention with a MoDA mask: the depth K/V concatenated after the sequence K/V on the key
  axis (the concatenation is inside the timed region: it has to happen every call), the sequence part
  causal, the depth part only the query's own position's slots.

Before timing, the bf16 kernel is checked against the fp32 naive reference (relative L2 <= 1e-2 on the
output and every gradient).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kernels.moda_attn import seq
from kernels.moda_attn.naive import moda_attn_naive
from kernels.moda_attn.op import moda_attn

__all__ = ["bench_moda_attn", "check_moda_attn", "SDPA_FLASH_REF_MS", "SDPA_CUDNN_REF_MS", "BAR"]

# H200 reference measurements (DESIGN.md section 8, 2026-11-30) and the acceptance bar: MoDA time at most
# BAR[T] x SDPA flash at the same T; the goal is 1.10 x (SDPA cuDNN + depth floor).
SDPA_FLASH_REF_MS = {4096: 1.99, 8192: 7.16, 16384: 26.8, 32768: 105.9, 65536: 419.6}
SDPA_CUDNN_REF_MS = {4096: 1.28, 8192: 4.64, 16384: 17.5, 32768: 72.7, 65536: 284.4}
BAR = {4096: 1.349, 8192: 1.234, 16384: 1.094, 32768: 1.046, 65536: 1.028}
HBM_BYTES_PER_S = 4.3e12  # device-to-device copy measured on an H200 of this workplace


def depth_floor_ms(B: int, Hk: int, T: int, S: int, D: int, elem_bytes: int = 2) -> float:
    """Fewest milliseconds the depth part can take: read kd, vd (fwd), read them again and write dkd, dvd."""
    return 3 * (2 * B * Hk * T * S * D * elem_bytes) / HBM_BYTES_PER_S * 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(B, Hq, Hk, T, S, D, dtype, device, seed=0):
    """Random inputs drawn on the device itself, in their dtype: the largest Table 2 shapes hold 4-9 GB of depth
    slots, which take longer to draw in fp32 on the host and copy over than the benchmark itself."""
    g = torch.Generator(device=device).manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).requires_grad_()

    q, k, v = r(B, Hq, T, D), r(B, Hk, T, D), r(B, Hk, T, D)
    kd, vd = r(B, Hk, T, S, D), r(B, Hk, T, S, D)
    return [q, k, v, kd, vd], r(B, Hq, T, D).detach()


def check_moda_attn(
    shapes, dtype=torch.bfloat16, device="cuda", tol: float = 1e-2, verbose: bool = True
) -> list[dict[str, object]]:
    """Kernel (dtype) vs naive (fp32 on the same rounded inputs): relative L2 of o and every gradient.

    Args:
        shapes: iterable of (B, Hq, Hk, T, S, D).
    Returns:
        one row per shape with the errors; raises AssertionError if any exceeds ``tol``.
    """
    rows = []
    names = ("o", "dq", "dk", "dv", "dkd", "dvd")
    for B, Hq, Hk, T, S, D in shapes:
        ins, do = _inputs(B, Hq, Hk, T, S, D, dtype, device, seed=T + S)
        o = moda_attn(*ins)
        got = (o, *torch.autograd.grad(o, ins, do))
        ref_in = [t.detach().float().requires_grad_() for t in ins]
        o_ref = moda_attn_naive(*ref_in)
        ref = (o_ref, *torch.autograd.grad(o_ref, ref_in, do.float(), allow_unused=True, materialize_grads=True))
        errs = {n: _rel(a, b) for n, a, b in zip(names, got, ref, strict=True) if b.numel()}
        row = {"B": B, "Hq": Hq, "Hk": Hk, "T": T, "S": S, "D": D, "dtype": str(dtype).removeprefix("torch.")}
        row.update({f"rel_{n}": e for n, e in errs.items()})
        rows.append(row)
        if verbose:
            print("check", row, flush=True)
        bad = {n: e for n, e in errs.items() if not e <= tol}
        assert not bad, f"MoDA kernel off the reference at {row}: {bad}"
        del got, ref, o_ref, ref_in, ins
    return rows


def _moda_fn(ins, do, backend: str | None) -> Callable[[], None]:
    def fn():
        seq.set_backend(backend)
        try:
            moda_attn(*ins).backward(do)
        finally:
            seq.set_backend(None)

    return fn


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _sdpa_fn(backend, q, k, v, do) -> tuple[Callable[[], None], str]:
    from torch.nn.attention import sdpa_kernel

    F = torch.nn.functional
    G = q.shape[1] // k.shape[1]

    def gqa():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)

    try:
        gqa()
        return gqa, ""
    except RuntimeError:  # backend without GQA support: hand it K/V expanded outside the timed region
        q.grad = k.grad = v.grad = None
        ke = k.detach().repeat_interleave(G, 1).requires_grad_()
        ve = v.detach().repeat_interleave(G, 1).requires_grad_()

        def expanded():
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, ke, ve, is_causal=True).backward(do)

        expanded()
        return expanded, "K/V pre-expanded to Hq heads (backend lacks enable_gqa)"


def _flex_fn(q, k, v, kd, vd, do) -> Callable[[], None]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, Hq, T, D = q.shape
    S = kd.shape[3]
    flex = torch.compile(flex_attention, dynamic=False)

    def mask_mod(b, h, q_idx, kv_idx):
        seq = (kv_idx < T) & (kv_idx <= q_idx)
        dep = (kv_idx >= T) & ((kv_idx - T) // S == q_idx)
        return seq | dep

    bm = create_block_mask(mask_mod, None, None, T, T * (S + 1), device=q.device, _compile=True)

    def fn():
        kk = torch.cat([k, kd.flatten(2, 3)], dim=2)  # [B, Hk, T + T*S, D]
        vv = torch.cat([v, vd.flatten(2, 3)], dim=2)
        flex(q, kk, vv, block_mask=bm, enable_gqa=True).backward(do)

    fn()
    return fn


def bench_moda_attn(
    T_list=(4096, 8192, 16384, 32768, 65536),
    B: int = 1,
    Hq: int = 64,
    Hk: int = 8,
    D: int = 64,
    S: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    check_shapes=((1, 64, 8, 1000, 64, 64), (2, 6, 2, 77, 3, 128)),
    peers=("moda", "moda_flash", "sdpa_flash", "sdpa_cudnn", "flex_moda"),
    flex_max_T: int | None = None,
    warmup_ms: float = 50,
    rep_ms: float = 300,
) -> list[dict[str, object]]:
    """Times MoDA fwd+bwd and its peers side by side (medians of ``triton.testing.do_bench``).

    Args:
        T_list: sequence lengths.
        B, Hq, Hk, D, S: batch, query heads, KV heads, head dim, depth slots per position.
        dtype: input dtype of every peer.
        device: a CUDA device.
        check_shapes: (B, Hq, Hk, T, S, D) checked against the fp32 reference before timing.
        peers: which providers to time.
        flex_max_T: skip FlexAttention above this T (it needs a compile per shape); None = try all.
        warmup_ms, rep_ms: ``do_bench`` warm-up and repetition budgets.

    Returns:
        one row per (T, provider): ``{"op", "provider", "mode", "B", "Hq", "Hk", "T", "S", "D", "dtype",
        "ms", "note"}``; ``ms`` is NaN when the provider did not run (``note`` says why: "OOM", ...).
    """
    import triton.testing
    from torch.nn.attention import SDPBackend

    if check_shapes:
        check_moda_attn(check_shapes, dtype=dtype, device=device)
    rows: list[dict[str, object]] = []
    for T in T_list:
        ins, do = _inputs(B, Hq, Hk, T, S, D, dtype, device, seed=T)
        q, k, v, kd, vd = ins
        base = {"op": "moda_attn", "mode": "fwd+bwd", "B": B, "Hq": Hq, "Hk": Hk, "T": T, "S": S, "D": D}
        base["dtype"] = str(dtype).removeprefix("torch.")
        for provider in peers:
            note, ms = "", math.nan
            try:
                if provider in ("moda", "moda_flash"):
                    backend = "flash" if provider == "moda_flash" else None
                    fn = _moda_fn(ins, do, backend)
                    note = f"sequence causal ({backend or seq.backend_for(q)}) + depth slots"
                elif provider == "sdpa_flash":
                    fn, note = _sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, do)
                    note = "no depth " + note
                elif provider == "sdpa_cudnn":
                    fn, note = _sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, do)
                    note = "no depth " + note
                elif provider == "flex_moda":
                    if flex_max_T is not None and T > flex_max_T:
                        raise _Skip(f"skipped (T > --flex-max-T {flex_max_T})")
                    fn = _flex_fn(q, k, v, kd, vd, do)
                    note = "depth K/V concatenated on the key axis + MoDA mask"
                else:
                    raise ValueError(f"unknown provider {provider}")
                ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=ins, return_mode="median")
            except _Skip as e:
                note = str(e)
            except Exception as e:  # noqa: BLE001 - a peer failing must not stop the others
                note = "OOM" if _is_oom(e) else f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            finally:
                fn = None
                for t in ins:
                    t.grad = None
                torch.cuda.empty_cache()
            rows.append({**base, "provider": provider, "ms": ms, "note": note.strip()})
            print(f"T={T:6d} {provider:12s} {ms:10.3f} ms  {note}", flush=True)
        del ins, do, q, k, v, kd, vd, fn
        torch.cuda.empty_cache()
    return rows


class _Skip(Exception):
    pass


def summary_table(rows: list[dict[str, object]]) -> str:
    """Markdown: one line per T with every provider, ours / SDPA flash, the bar and the goal."""
    by_t: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_t.setdefault(int(r["T"]), {})[str(r["provider"])] = r
    providers = list(dict.fromkeys(str(r["provider"]) for r in rows))

    def fmt(r):
        if r is None:
            return "-"
        return f"{r['ms']:.3f}" if r["ms"] == r["ms"] else str(r["note"] or "n/a")

    head = ["T", *[f"{p} ms" for p in providers], "ours/flash", "bar (x flash)", "depth floor ms", "goal ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for T, pr in sorted(by_t.items()):
        r0 = next(iter(pr.values()))
        floor = depth_floor_ms(r0["B"], r0["Hk"], T, r0["S"], r0["D"])
        ours, fl, cu = (pr.get(p, {}).get("ms", math.nan) for p in ("moda", "sdpa_flash", "sdpa_cudnn"))
        ratio = ours / fl if fl == fl and ours == ours else math.nan
        bar = BAR.get(T)
        bar_s = f"{bar:.3f} ({'met' if ratio <= bar else 'MISSED'})" if bar and ratio == ratio else "-"
        goal = 1.10 * (cu + floor)
        goal_s = f"{goal:.3f} ({'met' if ours <= goal else 'missed'})" if goal == goal and ours == ours else "-"
        cells = [str(T), *[fmt(pr.get(p)) for p in providers], f"{ratio:.3f}", bar_s, f"{floor:.3f}", goal_s]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_args(p) -> None:
    """CLI options of ``python -m kernels.bench moda_attn``."""
    p.add_argument("--T", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--Hq", type=int, default=64)
    p.add_argument("--Hk", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--S", type=int, default=64, help="depth slots per position (L in the paper)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--peers", nargs="+", default=["moda", "moda_flash", "sdpa_flash", "sdpa_cudnn", "flex_moda"])
    p.add_argument("--flex-max-T", type=int, default=None, help="skip FlexAttention above this T")
    p.add_argument("--no-check", action="store_true", help="skip the bf16-vs-fp32-reference check")


def run(args) -> tuple[list[dict[str, object]], str]:
    """CLI entry: rows and a markdown summary."""
    rows = bench_moda_attn(
        T_list=args.T,
        B=args.B,
        Hq=args.Hq,
        Hk=args.Hk,
        D=args.D,
        S=args.S,
        dtype=getattr(torch, args.dtype),
        peers=tuple(args.peers),
        flex_max_T=args.flex_max_T,
        check_shapes=() if args.no_check else ((1, args.Hq, args.Hk, 1000, args.S, args.D), (2, 6, 2, 77, 3, 128)),
    )
    return rows, summary_table(rows)
