"""Tile sweep for the MoDA kernels on a GPU: ``python -m kernels.moda_attn.tune [--T 8192]``.

Times the forward and the backward launches separately for a few candidate tiles (one kernel varied at a
time), plus SDPA flash fwd / bwd and the depth kernels alone, and prints registers / spills. Used to pick
``kernel._GPU_CONFIGS``; results are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch
import triton
import triton.testing

from kernels.moda_attn import kernel as K

FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (128, 64, 4, 4), (64, 64, 4, 3)]
DKDV = [(64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3), (128, 128, 8, 2)]
DQ = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)]


def _bench(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--Hq", type=int, default=64)
    ap.add_argument("--Hk", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--S", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="first two candidates of each list only")
    ap.add_argument("--fwd", nargs="*", default=None, help="candidates as BM,BN,warps,stages")
    ap.add_argument("--dkdv", nargs="*", default=None, help="candidates as BM,BN,warps,stages")
    ap.add_argument("--dq", nargs="*", default=None, help="candidates as BM,BN,warps,stages")
    ap.add_argument("--no-extras", action="store_true", help="skip the atomic-dq and depth-tile variants")
    a = ap.parse_args(argv)

    def parse(xs, default):
        return default if xs is None else [tuple(int(v) for v in x.split(",")) for x in xs]

    fwd_c, dkdv_c, dq_c = parse(a.fwd, FWD), parse(a.dkdv, DKDV), parse(a.dq, DQ)
    T, Hq, Hk, D, S = a.T, a.Hq, a.Hk, a.D, a.S
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g).to(dev, dt)

    q, k, v, kd, vd, do = (
        r(1, Hq, T, D),
        r(1, Hk, T, D),
        r(1, Hk, T, D),
        r(1, Hk, T, S, D),
        r(1, Hk, T, S, D),
        r(1, Hq, T, D),
    )
    scale = 1 / math.sqrt(D)
    base = K.get_config(q.device, D, T)
    print(f"T={T} Hq={Hq} Hk={Hk} D={D} S={S}; base {base}", flush=True)
    floor = 2 * Hk * T * S * D * 2 / 4.3e12 * 1e3
    print(f"depth KV read floor {floor:.3f} ms (fwd: 1x, bwd: 2x)")

    # reference: SDPA flash, forward and backward separately
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        f = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)  # noqa: E731
        o_s = f()
        t_f = _bench(f)
        t_b = _bench(lambda: torch.autograd.grad(o_s, (qs, ks, vs), do, retain_graph=True))
    print(f"sdpa_flash fwd {t_f:.3f} ms  bwd {t_b:.3f} ms", flush=True)

    def fwd_time(cfg, depth=True):
        kk, vv = (kd, vd) if depth else (None, None)
        return _bench(lambda: K.moda_fwd(q, k, v, kk, vv, scale, cfg))

    def bwd_time(cfg, depth=True):
        kk, vv = (kd, vd) if depth else (None, None)
        o, lse = K.moda_fwd(q, k, v, kk, vv, scale, cfg)
        return _bench(lambda: K.moda_bwd(do, q, k, v, kk, vv, o, lse, scale, cfg))

    def regs(name):
        c = K.LAST_COMPILED.get(name)
        return f"regs={getattr(c, 'n_regs', '?')} spills={getattr(c, 'n_spills', '?')}"

    cut = 2 if a.quick else None
    res = {}
    for c in fwd_c[:cut]:
        try:
            cfg = replace(base, fwd=c)
            t = fwd_time(cfg)
            res[("fwd", c)] = t
            print(f"fwd  {c}: {t:.3f} ms  {regs('_seq_fwd')}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"fwd  {c}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
    for c in dkdv_c[:cut]:
        try:
            cfg = replace(base, dkdv=c)
            t = bwd_time(cfg)
            res[("dkdv", c)] = t
            print(f"bwd dkdv {c}: {t:.3f} ms  {regs('_seq_bwd_dkdv')}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"bwd dkdv {c}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
    for c in dq_c[:cut]:
        try:
            cfg = replace(base, dq=c)
            t = bwd_time(cfg)
            res[("dq", c)] = t
            print(f"bwd dq {c}: {t:.3f} ms  {regs('_seq_bwd_dq')}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"bwd dq {c}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
    for c in [] if a.no_extras else DKDV[:2]:
        try:
            cfg = replace(base, dkdv=c, dq_atomic=True)
            t = bwd_time(cfg)
            print(f"bwd atomic-dq dkdv {c}: {t:.3f} ms  {regs('_seq_bwd_dkdv')}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"bwd atomic {c}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
    for m, w in () if a.no_extras else ((16, 4), (32, 4), (64, 4)):
        try:
            cfg = replace(base, depth_m=m, depth_warps=w)
            tf, tb = fwd_time(cfg), bwd_time(cfg)
            print(f"depth_m={m} warps={w}: fwd {tf:.3f} bwd {tb:.3f} ms  {regs('_depth_bwd')}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"depth_m={m}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
    tf0, tb0 = fwd_time(base, depth=False), bwd_time(base, depth=False)
    tf1, tb1 = fwd_time(base), bwd_time(base)
    print(f"base no-depth fwd {tf0:.3f} bwd {tb0:.3f}; with depth fwd {tf1:.3f} bwd {tb1:.3f} ms", flush=True)
    for kind in ("fwd", "dkdv", "dq"):
        best = min(((t, c) for (k_, c), t in res.items() if k_ == kind), default=None)
        print(f"best {kind}: {best}")


if __name__ == "__main__":
    main()
