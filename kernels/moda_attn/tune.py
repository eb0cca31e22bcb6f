"""Launch sweep for the MoDA depth kernels on a GPU: ``python -m kernels.moda_attn.tune [--T 8192 ...]``.

Times each sequence backend's forward and backward, then the depth forward and backward kernels alone for
every candidate of both variants (slot loop: rows, warps; tensor-core tiles: columns, warps), against the
depth floor (the slot bytes each must move at 4.3 TB/s), and prints registers / spills. Used to pick
``kernel._GPU_CONFIGS``; results are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton.testing

from kernels.moda_attn import kernel as K
from kernels.moda_attn import seq

LOOP = [K.Config(rows=r, warps=w, tile_min_g=1 << 30) for r in (16, 32, 64) for w in (2, 4)]
TILES = [K.Config(tile_min_g=1, tile_cols=c, tile_warps=w) for c in (64, 128, 256) for w in (4, 8)]


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--Hq", type=int, default=64)
    ap.add_argument("--Hk", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--S", type=int, default=64)
    ap.add_argument("--variant", choices=["loop", "tiles", "both"], default="both")
    a = ap.parse_args(argv)
    cands = (LOOP if a.variant != "tiles" else []) + (TILES if a.variant != "loop" else [])
    B, T, Hq, Hk, D, S = a.B, a.T, a.Hq, a.Hk, a.D, a.S
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g).to("cuda", torch.bfloat16)

    q, k, v, do = r(B, Hq, T, D), r(B, Hk, T, D), r(B, Hk, T, D), r(B, Hq, T, D)
    kd, vd = r(B, Hk, T, S, D), r(B, Hk, T, S, D)
    scale = 1 / math.sqrt(D)
    slot_bytes = 2 * B * Hk * T * S * D * 2  # kd + vd
    print(f"B={B} T={T} Hq={Hq} Hk={Hk} D={D} S={S}; default {K.get_config(q.device, D, Hq // Hk)}")
    floor = slot_bytes / 4.3e9
    print(f"depth floor: fwd {floor:.3f} ms (read kd, vd), bwd {2 * floor:.3f} ms (+ write dkd, dvd)")
    for name in ("cudnn", "flash"):
        try:
            o, lse, aux = seq.seq_fwd(q, k, v, scale, name)
            tf = _bench(lambda name=name: seq.seq_fwd(q, k, v, scale, name))
            tb = _bench(lambda name=name, o=o, lse=lse, aux=aux: seq.seq_bwd(do, q, k, v, o, lse, aux, scale, name))
            print(f"sequence {name:6s} fwd {tf:.3f} ms  bwd {tb:.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001 - a backend missing here must not stop the sweep
            print(f"sequence {name}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
    o, lse, _ = seq.seq_fwd(q, k, v, scale, seq.backend_for(q))
    dq = torch.zeros_like(q)
    clones = _bench(lambda: (o.clone(), lse.clone()))  # the forward overwrites o, lse: each call gets fresh copies
    best = None
    for cfg in cands:
        name = f"loop rows={cfg.rows:3d} warps={cfg.warps}"
        if cfg.tile_min_g <= Hq // Hk:
            name = f"tiles cols={cfg.tile_cols:3d} warps={cfg.tile_warps}"
        try:
            tf = _bench(lambda cfg=cfg: K.depth_fwd(q, kd, vd, o.clone(), lse.clone(), scale, cfg)) - clones
            tb = _bench(lambda cfg=cfg: K.depth_bwd(q, o, do, lse, dq, kd, vd, scale, cfg))
        except Exception as e:  # noqa: BLE001 - a config that does not fit must not stop the sweep
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        c = K.LAST_COMPILED["_depth_bwd"]
        spills = f"bwd regs={getattr(c, 'n_regs', '?')} spills={getattr(c, 'n_spills', '?')}"
        print(f"{name}: fwd {tf:.3f} ms  bwd {tb:.3f} ms  {spills}", flush=True)
        if best is None or tf + tb < best[0]:
            best = (tf + tb, cfg)
    print(f"best: {best}")


if __name__ == "__main__":
    main()
