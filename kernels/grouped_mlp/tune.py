"""Tile sweep for the grouped expert SwiGLU MLP on a GPU: ``python -m kernels.grouped_mlp.tune [--out F]``.

Builds the bench workload (``bench.make_inputs``, the default shape of ``python -m kernels.bench grouped_mlp``)
and its routing once, then times each launch site of ``op.py`` alone (``kernel.SITES``) over a pruned grid of
tiles: medians of ``do_bench``, compile and warm-up excluded; tiles that fail to compile or launch (shared memory)
are reported as skipped. A site's fastest tile is accepted only if the whole op with it matches ``naive.py``
(rel-L2 <= 1e-2 on the output and every gradient), else the next fastest. Then prints the op's fwd and fwd+bwd
TFLOP/s with the current and the tuned tiles next to the dense matmul chain (``bench_grouped_mlp``), and the
tuned table (JSON, also a Python literal; to ``--out`` too) for ``CONFIG = GmmConfig(sites=...)`` in kernel.py.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import triton.testing

from kernels.grouped_mlp import kernel as K
from kernels.grouped_mlp.bench import bench_grouped_mlp, make_inputs
from kernels.grouped_mlp.naive import grouped_swiglu_naive
from kernels.grouped_mlp.op import grouped_swiglu
from kernels.route_gather_scatter import kernel as RK
from kernels.testing import assert_close

GMM_KEYS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
WGRAD_KEYS = ("wgrad_p", "wgrad_q", "wgrad_k", "num_warps", "num_stages")
# site -> (tile fields, matmul FLOPs / (M D F), A-side tiles, B-side tiles, fp32 accumulators) of one program
SHAPES = {
    "fwd_up": (GMM_KEYS, 4, 1, 2, 2),
    "fwd_down": (GMM_KEYS, 2, 1, 1, 1),
    "bwd_dh": (GMM_KEYS, 2, 1, 1, 1),
    "bwd_dx": (GMM_KEYS, 4, 2, 2, 1),
    "bwd_dw2": (WGRAD_KEYS, 2, 2, 1, 1),
    "bwd_dw13": (WGRAD_KEYS, 4, 1, 2, 2),
}
NAMES = ("out", "dx", "dw1", "dw3", "dw2", "dweight")


def candidates(site: str, current: dict[str, int], smem: int, quick: bool) -> list[dict[str, int]]:
    """``current`` first, then the grid pruned to 64..128 accumulator registers per thread and 16-bit stages
    that fit in ``smem`` bytes."""
    keys, _, n_a, n_b, n_acc = SHAPES[site]
    ks = ((64, 3),) if quick else ((32, 4), (64, 3), (64, 4))  # (block_k, stages)
    out = [current]
    for bm, bn, (bk, stages), warps in itertools.product((64, 128), (64, 128, 256), ks, (4, 8)):
        c = dict(zip(keys, (bm, bn, bk, warps, stages), strict=True))
        regs = bm * bn * n_acc // (32 * warps)
        if 64 <= regs <= 128 and stages * (n_a * bm + n_b * bn) * bk * 2 <= smem and c != current:
            out.append(c)
    return out


def _fmt(c: dict[str, int]) -> str:
    return " ".join(f"{k.split('_')[-1]}={v}" for k, v in c.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.grouped_mlp.tune", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--sites", nargs="+", default=list(K.SITES), choices=K.SITES, help="launch sites to sweep")
    ap.add_argument("--quick", action="store_true", help="block_k 64 and 3 stages only")
    ap.add_argument("--rep", type=int, default=50, help="do_bench ms per candidate")
    ap.add_argument("--out", default=None, help="also write the tuned sites table (JSON) to this file")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("kernels.grouped_mlp.tune: needs a CUDA GPU (torch.cuda.is_available() is False)")

    t0 = time.perf_counter()
    N, D, F, E, k, M = a.tokens, a.d_model, a.d_ff, a.experts, a.top_k, a.tokens * a.top_k
    dtype, base, poison = getattr(torch, a.dtype), K.CONFIG, (K.POISON_EMPTY, RK.POISON_EMPTY)
    x, w1, w3, w2, tok, exp, w, dy = make_inputs(N, E, k, D, F, dtype, "cuda", torch.Generator().manual_seed(0))
    leaves = [t.detach() for t in (x, w1, w3, w2, w)]
    x, w1, w3, w2, w = leaves

    def run_op(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        ls = [t.detach().requires_grad_() for t in leaves]
        out = fn(*ls[:4], tok, exp, ls[4])
        out.backward(dy)
        return [out.detach()] + [t.grad for t in ls]

    ref = run_op(grouped_swiglu_naive)

    def check(cfg: K.GmmConfig) -> str | None:
        """None when the op with ``cfg`` (unwritten outputs poisoned) matches naive.py, else the mismatch."""
        K.CONFIG, K.POISON_EMPTY, RK.POISON_EMPTY = cfg, True, True
        try:
            for name, r, t in zip(NAMES, ref, run_op(grouped_swiglu), strict=True):
                assert_close(name, r, t, 1e-2)
        except AssertionError as e:
            return str(e)
        finally:
            K.CONFIG, (K.POISON_EMPTY, RK.POISON_EMPTY) = base, poison
        return None

    # the routing (every block_m of the grid) and the inputs of each launch, once, with the current tiles
    rt = K.build_routing(tok, exp, w, N, E, (64, 128, *base.block_ms(dtype)))
    a_, b_, h = K.gmm(1, x, w1, rt, F, gather=True, n_tok=N, b2=w3, site="fwd_up")
    (y,) = K.gmm(0, h, w2, rt, D, site="fwd_down")
    dys, _ = RK.scatter_add_backward(dy, rt.tok, y, rt.w, True, False)
    da, db = K.gmm(2, dys, w2.transpose(1, 2), rt, F, e1=a_, e2=b_, site="bwd_dh")
    w1t, w3t, w2t = (t.transpose(1, 2) for t in (w1, w3, w2))
    launch: dict[str, Callable[[K.GmmConfig], object]] = {  # the calls of op.py, tiles from the argument
        "fwd_up": lambda c: K.gmm(1, x, w1, rt, F, gather=True, n_tok=N, b2=w3, cfg=c),
        "fwd_down": lambda c: K.gmm(0, h, w2, rt, D, cfg=c),
        "bwd_dh": lambda c: K.gmm(2, dys, w2t, rt, F, e1=a_, e2=b_, cfg=c),
        "bwd_dx": lambda c: K.gmm(3, da, w1t, rt, D, a2=db, b2=w3t, cfg=c),
        "bwd_dw2": lambda c: K.wgrad(1, a_, dys, rt, E, w2.dtype, e2=b_, cfg=c),
        "bwd_dw13": lambda c: K.wgrad(0, x, da, rt, E, w1.dtype, q2=db, n_tok=N, cfg=c),
    }
    smem = getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", 232448)
    print(f"N={N} D={D} F={F} E={E} top-{k} {a.dtype}; current {base}; setup {time.perf_counter() - t0:.0f} s")

    tuned: dict[str, dict[str, int]] = {s: dict(c) for s, c in base.sites.items()}
    for site in a.sites:
        keys, flop, *_ = SHAPES[site]
        current = {key: getattr(base.at(site, dtype), key) for key in keys}
        cands = candidates(site, current, smem, a.quick)
        print(f"== {site}: {len(cands)} candidates", flush=True)
        res: list[tuple[float, dict[str, int]]] = []
        for c in cands:
            fn = functools.partial(launch[site], replace(base, sites={}, **c))
            try:
                ms = triton.testing.do_bench(fn, warmup=10, rep=a.rep, return_mode="median")
            except Exception as e:  # noqa: BLE001 (compile / launch failure: out of shared memory, registers)
                print(f"  {_fmt(c)}: skipped, {type(e).__name__}: {str(e).strip()[:100]!r}", flush=True)
                continue
            res.append((ms, c))
            tf = flop * M * D * F / ms / 1e9
            print(f"  {_fmt(c)}: {ms:.3f} ms {tf:.0f} TFLOP/s  [{time.perf_counter() - t0:.0f} s]", flush=True)
        for ms, c in sorted(res, key=lambda r: r[0]):
            err = check(replace(base, sites={**tuned, site: c}))
            if err is None:
                cur_ms = next((t for t, c2 in res if c2 == current), float("nan"))
                print(f"best {site}: {_fmt(c)} {ms:.3f} ms (current {cur_ms:.3f} ms, {cur_ms / ms:.2f}x)")
                tuned[site] = c
                break
            print(f"  {_fmt(c)}: rejected, {err}", flush=True)
        else:
            print(f"best {site}: none passed the check; keeping the current tiles")

    final = replace(base, sites=tuned)
    err = check(final)
    print(f"tuned tiles vs naive.py (rel-L2 <= 1e-2, all outputs): {'ok' if err is None else 'FAILED: ' + err}")
    from kernels.bench import markdown_table

    rows, cols = [], ("provider", "mode", "ms", "tflops", "vs_dense")
    for name, cfg in (("current", base), ("tuned", final)):
        K.CONFIG = cfg
        try:
            for r in bench_grouped_mlp(N, E, k, D, F, dtype, providers=("triton", "dense")):
                rows.append({"tiles": name, **{key: r[key] for key in cols}})
        finally:
            K.CONFIG = base
    print(markdown_table(rows))
    text = "{\n" + ",\n".join(f'    "{s}": {json.dumps(c)}' for s, c in tuned.items()) + "\n}"
    print(f"paste into kernels/grouped_mlp/kernel.py as CONFIG = GmmConfig(sites=...):\n{text}")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {a.out}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0 if err is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
