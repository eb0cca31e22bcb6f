"""Tile and knob sweep for the grouped expert SwiGLU MLP on a GPU: ``python -m kernels.grouped_mlp.tune``.

Builds the bench workload (``bench.make_inputs``, the default shape of ``python -m kernels.bench grouped_mlp``)
and its routing once, then times each launch site of ``op.py`` alone (``kernel.SITES``) in three stages:

1. tiles: every block size in {64, 128, 256} (block_k too), 4 or 8 warps, 3 to 5 stages, pruned to 32..128 fp32
   accumulator registers per thread and pipelines that fit in shared memory (``--quick``: block_k 64, 3 stages);
2. on the fastest ``TOP`` so far: the epilogue sub-tile width ``epi_n`` (row-grouped GEMMs) and a register cap
   ``maxnreg`` that fits one more program per SM (128 with 8 warps, 168 with 4) where shared memory allows;
3. on the fastest ``TOP`` so far: the program group size ``group_m`` (a runtime argument: no recompilation).

Each stage compiles its candidates first, in parallel (Triton's ``AsyncCompileMode``, a thread per core), then
times them one at a time (medians of ``do_bench``, compile and warm-up excluded); candidates that fail to compile
or launch (shared memory) are reported as skipped. A site's fastest candidate is accepted only if the whole op with
it matches ``naive.py`` (rel-L2 <= 1e-2 on the output and every gradient), else the next fastest. Then prints the
op's fwd and fwd+bwd TFLOP/s with the current and the tuned config next to the dense matmul chain
(``bench_grouped_mlp``), and the tuned ``CONFIG = GmmConfig(sites=...)`` as Python text for kernel.py (to ``--out``
too). Expected to take about 3 minutes on an H200 with a cold Triton cache, ``--quick`` about 1.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace

import torch
import triton
import triton.testing

from kernels.common.scatter_backward import scatter_add_backward
from kernels.grouped_mlp import kernel as K
from kernels.grouped_mlp.bench import bench_grouped_mlp, make_inputs
from kernels.grouped_mlp.naive import grouped_swiglu_naive
from kernels.grouped_mlp.op import grouped_swiglu
from kernels.testing import assert_close, poison_empty

GMM_KEYS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m", "epi_n", "maxnreg")
WGRAD_KEYS = ("wgrad_p", "wgrad_q", "wgrad_k", "num_warps", "num_stages", "group_m", "maxnreg")
# site -> (config fields, matmul FLOPs / (M D F), A-side tiles, B-side tiles, fp32 accumulators) of one program
SHAPES = {
    "fwd_up": (GMM_KEYS, 4, 1, 2, 2),
    "fwd_down": (GMM_KEYS, 2, 1, 1, 1),
    "bwd_dh": (GMM_KEYS, 2, 1, 1, 1),
    "bwd_dx": (GMM_KEYS, 4, 2, 2, 1),
    "bwd_dw2": (WGRAD_KEYS, 2, 2, 1, 1),
    "bwd_dw13": (WGRAD_KEYS, 4, 1, 2, 2),
}
NAMES = ("out", "dx", "dw1", "dw3", "dw2", "dweight")
TOP = 3  # candidates refined by stages 2 and 3 (1 with --quick)
EPI_NS = (32, 64, 128, 256)
GROUPS = (1, 2, 4, 8, 16, 32, 64)
SM_REGS = 65536
SM_SMEM = 233472  # bytes of shared memory per SM (Hopper: 228 KiB)
DEFAULTS = {f.name: f.default for f in fields(K.GmmConfig) if f.name != "sites"}


def _smem(site: str, c: dict[str, int]) -> int:
    """Bytes of the 16-bit operand pipeline of one program."""
    keys, _, n_a, n_b, _ = SHAPES[site]
    bm, bn, bk = (c[k] for k in keys[:3])
    return c["num_stages"] * (n_a * bm + n_b * bn) * bk * 2


def tiles(site: str, current: dict[str, int], smem: int, quick: bool) -> list[dict[str, int]]:
    """Stage 1: ``current`` first, then the tile grid (knobs as in ``current``)."""
    keys, _, _, _, n_acc = SHAPES[site]
    bks, stages = ((64,), (3,)) if quick else ((64, 128, 256), (3, 4, 5))
    out = [current]
    for bm, bn, bk, warps, st in itertools.product((64, 128, 256), (64, 128, 256), bks, (4, 8), stages):
        c = {**current, **dict(zip(keys[:5], (bm, bn, bk, warps, st), strict=True))}
        if 32 <= bm * bn * n_acc // (32 * warps) <= 128 and _smem(site, c) <= smem and c != current:
            out.append(c)
    return out


def knobs(site: str, c: dict[str, int]) -> list[dict[str, int]]:
    """Stage 2: ``c`` with each other epilogue width (``block_n``: no split) and register cap (0: none)."""
    out = []
    if "epi_n" in c:
        widths = {min(w, c["block_n"]) for w in EPI_NS} - {min(c["epi_n"], c["block_n"])}
        out += [{**c, "epi_n": w} for w in sorted(widths)]
    caps = {0} | {SM_REGS // (n * 32 * c["num_warps"]) // 8 * 8 for n in (2, 3) if n * _smem(site, c) <= SM_SMEM}
    out += [{**c, "maxnreg": r} for r in sorted(caps - {c["maxnreg"]}) if r == 0 or 96 <= r < 255]
    return out


def _fmt(c: dict[str, int]) -> str:
    return " ".join(f"{re.sub('^(block|wgrad|num)_', '', k)}={v}" for k, v in c.items())


def config_text(sites: dict[str, dict[str, int]]) -> str:
    """``CONFIG = GmmConfig(sites=...)`` as formatted in kernel.py; knobs at their defaults are left out."""
    lines = ["CONFIG = GmmConfig(", "    sites={"]
    for site, c in sites.items():
        keys = SHAPES[site][0]
        items = [f'"{k}": {v}' for k, v in c.items() if keys.index(k) < 5 or v != DEFAULTS[k]]
        one = f'        "{site}": {{{", ".join(items)}}},'
        if len(one) > 120:  # one item a line, as ruff formats it
            one = "\n".join([f'        "{site}": {{', *(f"            {i}," for i in items), "        },"])
        lines.append(one)
    return "\n".join([*lines, "    }", ")"])


class _Warmup:
    """Stands in for a kernel: ``kernel[grid](...)`` compiles it (``warmup``) instead of launching."""

    def __init__(self, fn: triton.JITFunction) -> None:
        self.fn = fn

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]:
        return functools.partial(self.fn.warmup, grid=grid)


def precompile(calls: Iterable[Callable[[], object]]) -> None:
    """Compiles the kernels of ``calls`` in parallel; a failure is left to the timing, which reports it."""
    real = K._gmm_kernel, K._wgrad_kernel
    K._gmm_kernel, K._wgrad_kernel = _Warmup(real[0]), _Warmup(real[1])
    try:
        with ThreadPoolExecutor(os.cpu_count()) as pool, triton.AsyncCompileMode(pool):
            for call in calls:
                call()
    except Exception as e:  # noqa: BLE001 (the rest compiles one by one when timed)
        print(f"  parallel compile stopped: {type(e).__name__}: {str(e).strip()[:100]!r}", flush=True)
    finally:
        K._gmm_kernel, K._wgrad_kernel = real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.grouped_mlp.tune", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--sites", nargs="+", default=list(K.SITES), choices=K.SITES, help="launch sites to sweep")
    ap.add_argument("--quick", action="store_true", help="block_k 64 and 3 stages only; knobs on the best tile")
    ap.add_argument("--rep", type=int, default=50, help="do_bench ms per candidate")
    ap.add_argument("--out", default=None, help="also write the tuned CONFIG (Python text) to this file")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("kernels.grouped_mlp.tune: needs a CUDA GPU (torch.cuda.is_available() is False)")

    t0 = time.perf_counter()
    N, D, F, E, k, M = a.tokens, a.d_model, a.d_ff, a.experts, a.top_k, a.tokens * a.top_k
    dtype, base = getattr(torch, a.dtype), K.CONFIG
    top = 1 if a.quick else TOP
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
        K.CONFIG = cfg
        try:
            with poison_empty():
                got = run_op(grouped_swiglu)
            for name, r, t in zip(NAMES, ref, got, strict=True):
                assert_close(name, r, t, 1e-2)
        except AssertionError as e:
            return str(e)
        finally:
            K.CONFIG = base
        return None

    # the routing (every block_m of the grid) and the inputs of each launch, once, with the current config
    rt = K.build_routing(tok, exp, w, N, E, (64, 128, 256, *base.block_ms(dtype)))
    a_, b_, h = K.gmm(1, x, w1, rt, F, gather=True, n_tok=N, b2=w3, site="fwd_up")
    (y,) = K.gmm(0, h, w2, rt, D, site="fwd_down")
    dys, _ = scatter_add_backward(dy, rt.tok, y, rt.w, True, False)
    da, db = K.gmm(2, dys, w2.transpose(1, 2), rt, F, e1=a_, e2=b_, site="bwd_dh")
    w1t, w3t, w2t = (t.transpose(1, 2) for t in (w1, w3, w2))
    launch: dict[str, Callable[[K.GmmConfig], object]] = {  # the calls of op.py, config from the argument
        "fwd_up": lambda c: K.gmm(1, x, w1, rt, F, gather=True, n_tok=N, b2=w3, cfg=c),
        "fwd_down": lambda c: K.gmm(0, h, w2, rt, D, cfg=c),
        "bwd_dh": lambda c: K.gmm(2, dys, w2t, rt, F, e1=a_, e2=b_, cfg=c),
        "bwd_dx": lambda c: K.gmm(3, da, w1t, rt, D, a2=db, b2=w3t, cfg=c),
        "bwd_dw2": lambda c: K.wgrad(1, a_, dys, rt, E, w2.dtype, e2=b_, cfg=c),
        "bwd_dw13": lambda c: K.wgrad(0, x, da, rt, E, w1.dtype, q2=db, n_tok=N, cfg=c),
    }
    smem = getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", 232448)
    print(f"N={N} D={D} F={F} E={E} top-{k} {a.dtype}; current {base}; setup {time.perf_counter() - t0:.0f} s")

    def call(site: str, c: dict[str, int]) -> Callable[[], object]:
        return functools.partial(launch[site], replace(base, sites={}, **c))

    def measure(site: str, cands: list[dict[str, int]], res: dict[str, tuple[float, dict[str, int]]]) -> None:
        """Compiles ``cands`` in parallel, then times each new one into ``res`` (keyed by ``_fmt``)."""
        cands = [c for c in cands if _fmt(c) not in res]
        t = time.perf_counter()
        precompile(call(site, c) for c in cands)
        print(f"  compiled {len(cands)} in {time.perf_counter() - t:.0f} s", flush=True)
        flop = SHAPES[site][1] * M * D * F
        for c in cands:
            try:
                ms = triton.testing.do_bench(call(site, c), warmup=10, rep=a.rep, return_mode="median")
            except Exception as e:  # noqa: BLE001 (compile / launch failure: out of shared memory, registers)
                print(f"  {_fmt(c)}: skipped, {type(e).__name__}: {str(e).strip()[:100]!r}", flush=True)
                continue
            res[_fmt(c)] = (ms, c)
            tf = flop / ms / 1e9
            print(f"  {_fmt(c)}: {ms:.3f} ms {tf:.0f} TFLOP/s  [{time.perf_counter() - t0:.0f} s]", flush=True)

    def best(res: dict[str, tuple[float, dict[str, int]]], n: int) -> list[dict[str, int]]:
        return [c for _, c in sorted(res.values(), key=lambda r: r[0])[:n]]

    tuned: dict[str, dict[str, int]] = {s: dict(c) for s, c in base.sites.items()}
    for site in a.sites:
        keys = SHAPES[site][0]
        current = {key: getattr(base.at(site, dtype), key) for key in keys}
        res: dict[str, tuple[float, dict[str, int]]] = {}
        stage1 = tiles(site, current, smem, a.quick)
        print(f"== {site}: {len(stage1)} tiles", flush=True)
        measure(site, stage1, res)
        print(f"== {site}: epilogue widths and register caps of the best {top}", flush=True)
        measure(site, [v for c in best(res, top) for v in knobs(site, c)], res)
        print(f"== {site}: group sizes of the best {top}", flush=True)
        measure(site, [{**c, "group_m": g} for c in best(res, top) for g in GROUPS if g != c["group_m"]], res)
        cur_ms = res[_fmt(current)][0] if _fmt(current) in res else float("nan")
        for c in best(res, len(res)):
            err = check(replace(base, sites={**tuned, site: c}))
            if err is None:
                ms = res[_fmt(c)][0]
                print(f"best {site}: {_fmt(c)} {ms:.3f} ms (current {cur_ms:.3f} ms, {cur_ms / ms:.2f}x)", flush=True)
                tuned[site] = c
                break
            print(f"  {_fmt(c)}: rejected, {err}", flush=True)
        else:
            print(f"best {site}: none passed the check; keeping the current config")

    final = replace(base, sites=tuned)
    err = check(final)
    print(f"tuned config vs naive.py (rel-L2 <= 1e-2, all outputs): {'ok' if err is None else 'FAILED: ' + err}")
    from kernels.bench import markdown_table

    rows, cols = [], ("provider", "mode", "ms", "tflops", "vs_dense")
    for name, cfg in (("current", base), ("tuned", final)):
        K.CONFIG = cfg
        try:
            for r in bench_grouped_mlp(N, E, k, D, F, dtype, providers=("triton", "dense")):
                rows.append({"config": name, **{key: r[key] for key in cols}})
        finally:
            K.CONFIG = base
    print(markdown_table(rows))
    text = config_text(tuned)
    print(f"paste into kernels/grouped_mlp/kernel.py:\n{text}")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {a.out}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0 if err is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
