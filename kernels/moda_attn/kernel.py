"""Triton depth kernels of MoDA attention, merged with a sequence attention through the log-sum-exp.

Layout (see op.py for the public contract):
    q, o, do, dq  [B, Hq, T, D]   one shared layout with a unit last stride (contiguous, or [B, T, Hq, D]
                                  memory: the projections' layout, so no transposing copies around them)
    lse           [B, Hq, T] fp32 contiguous, natural-log units of the scaled logits
    kd, vd        [B, Hk, T, S, D] any strides with a unit last stride (e.g. a prefix view of a slot buffer)
    dkd, dvd      [B, Hk, T, S, D] any strides with a unit last stride: fresh contiguous tensors, or the
                  caller's buffers (views of a slot-gradient buffer) that the backward ADDS into

The joint softmax over {causal sequence keys} U {the S depth slots of the query's own position} splits
exactly at the log-sum-exp:

forward   seq.py runs causal attention -> (o_s, lse_s). ``_depth_fwd`` continues the online softmax from
          that state (m = lse_s, l = 1, acc = o_s) over the S slots and overwrites o, lse with the joint ones.
backward  seq.py's backward, given the joint o and lse, yields the sequence part of dq and all of dk, dv.
          ``_depth_bwd`` recomputes the slot probabilities from the joint lse, adds the depth part of dq into
          dq in place and writes (or adds) dkd, dvd.

One program owns BT positions of one KV head and all G query heads of its group, so each depth slot is
read from HBM once, the G heads' slot gradients sum inside the program, and no two programs touch the same
(position, slot): no atomics. Two variants (``Config`` picks by G):

* slot loop (``_depth_fwd``, ``_depth_bwd``; G = 1): [BT, GP, D] tiles (GP = G padded to a power of two);
  the slots are visited one at a time as [BT, D] tiles, products are broadcast multiply + reduce on the CUDA
  cores. No wasted work, but the G-axis reductions of the backward cost layout shuffles when G > 1.
* tensor-core tiles (``_depth_*_tile``; large G): rows = (position, head) pairs, columns = (position, slot)
  pairs, masked to each row's own position (the paper's group-aware tile); BT positions per tile waste a
  factor BT of tensor-core work (and pad rows to 16), which is cheap next to the bytes (G >= 2).

Work is O(B Hq T S D), memory O(B Hk T S D): both aim at the byte floor.

Pointer arithmetic only (no ``tl.make_block_ptr``, removed in Triton 3.9); runs on Triton 3.6 (GPU) and
under the 3.9 CPU interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.common.launch import dot_precision

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the kernels' copy: Triton reads only constexpr globals


@triton.jit
def _tile(T, Hk, sqb, sqh, sqt, BT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """This program's positions t [BT]; for its (position, head) pairs [BT, GP]: row offsets into [B, Hq, T]
    (lse) and element offsets of the head vectors into q, o, do, dq (query layout strides sqb, sqh, sqt)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hk).to(tl.int64)
    hk = (pid_bh % Hk).to(tl.int64)
    t = pid_t * BT + tl.arange(0, BT)
    g = tl.arange(0, GP)
    valid = (t < T)[:, None] & (g < G)[None, :]
    h = (hk * G + g)[None, :]
    rows = (b * Hk * G + h) * T + t[:, None]
    qoff = b * sqb + h * sqh + t.to(tl.int64)[:, None] * sqt
    return b, hk, t, rows, qoff, valid


@triton.jit
def _depth_fwd(
    Q,
    KD,
    VD,
    O,
    LSE,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    sks,
    svb,
    svh,
    svt,
    svs,
    T,
    Hk,
    S,
    qk_scale,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
):
    b, hk, t, rows, qoff, valid = _tile(T, Hk, sqb, sqh, sqt, BT, G, GP)
    d = tl.arange(0, D)
    ptr = qoff[:, :, None] + d[None, None, :]  # [BT, GP, D]
    q = tl.load(Q + ptr, mask=valid[:, :, None], other=0.0).to(tl.float32)
    acc = tl.load(O + ptr, mask=valid[:, :, None], other=0.0).to(tl.float32)  # the sequence output
    m = tl.load(LSE + rows, mask=valid, other=0.0) * _LOG2E  # its lse: the state after the sequence keys
    l = tl.full([BT, GP], 1.0, tl.float32)
    tmask = (t < T)[:, None]
    kd_ptr = KD + b * skb + hk * skh + t.to(tl.int64)[:, None] * skt + d[None, :]  # [BT, D]
    vd_ptr = VD + b * svb + hk * svh + t.to(tl.int64)[:, None] * svt + d[None, :]
    for s in range(0, S):
        kd = tl.load(kd_ptr + s * sks, mask=tmask, other=0.0).to(tl.float32)
        vd = tl.load(vd_ptr + s * svs, mask=tmask, other=0.0).to(tl.float32)
        x = tl.sum(q * kd[:, None, :], 2) * qk_scale  # [BT, GP] logits, log2 units
        m_new = tl.maximum(m, x)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(x - m_new)
        l = l * alpha + p
        acc = acc * alpha[:, :, None] + p[:, :, None] * vd[:, None, :]
        m = m_new
    tl.store(O + ptr, (acc / l[:, :, None]).to(O.dtype.element_ty), mask=valid[:, :, None])
    tl.store(LSE + rows, (m + tl.log2(l)) / _LOG2E, mask=valid)


@triton.jit
def _depth_bwd(
    Q,
    O,
    DO,
    LSE,
    DQ,
    KD,
    VD,
    DKD,
    DVD,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    sks,
    svb,
    svh,
    svt,
    svs,
    sdkb,
    sdkh,
    sdkt,
    sdks,
    sdvb,
    sdvh,
    sdvt,
    sdvs,
    T,
    Hk,
    S,
    qk_scale,
    scale,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    ACC: tl.constexpr,
):
    b, hk, t, rows, qoff, valid = _tile(T, Hk, sqb, sqh, sqt, BT, G, GP)
    d = tl.arange(0, D)
    ptr = qoff[:, :, None] + d[None, None, :]  # [BT, GP, D]
    vmask = valid[:, :, None]
    q = tl.load(Q + ptr, mask=vmask, other=0.0).to(tl.float32)
    do = tl.load(DO + ptr, mask=vmask, other=0.0).to(tl.float32)
    delta = tl.sum(do * tl.load(O + ptr, mask=vmask, other=0.0).to(tl.float32), 2)  # rowsum(dO * O) [BT, GP]
    lse = tl.load(LSE + rows, mask=valid, other=0.0) * _LOG2E
    dq = tl.zeros([BT, GP, D], tl.float32)
    tmask = (t < T)[:, None]
    t64 = t.to(tl.int64)[:, None]
    kd_ptr = KD + b * skb + hk * skh + t64 * skt + d[None, :]  # [BT, D]
    vd_ptr = VD + b * svb + hk * svh + t64 * svt + d[None, :]
    dkd_ptr = DKD + b * sdkb + hk * sdkh + t64 * sdkt + d[None, :]
    dvd_ptr = DVD + b * sdvb + hk * sdvh + t64 * sdvt + d[None, :]
    for s in range(0, S):
        kd = tl.load(kd_ptr + s * sks, mask=tmask, other=0.0).to(tl.float32)
        vd = tl.load(vd_ptr + s * svs, mask=tmask, other=0.0).to(tl.float32)
        x = tl.sum(q * kd[:, None, :], 2) * qk_scale
        p = tl.where(valid, tl.exp2(x - lse), 0.0)  # joint-softmax probability of slot s [BT, GP]
        ds = p * (tl.sum(do * vd[:, None, :], 2) - delta)
        dq += ds[:, :, None] * kd[:, None, :]
        dkd = tl.sum(ds[:, :, None] * q, 1) * scale  # the G heads of the group sum here [BT, D]
        dvd = tl.sum(p[:, :, None] * do, 1)
        if ACC:  # add into the caller's buffers (fp32 sum, one rounding)
            dkd += tl.load(dkd_ptr + s * sdks, mask=tmask, other=0.0).to(tl.float32)
            dvd += tl.load(dvd_ptr + s * sdvs, mask=tmask, other=0.0).to(tl.float32)
        tl.store(dkd_ptr + s * sdks, dkd.to(DKD.dtype.element_ty), mask=tmask)
        tl.store(dvd_ptr + s * sdvs, dvd.to(DVD.dtype.element_ty), mask=tmask)
    dq = tl.load(DQ + ptr, mask=vmask, other=0.0).to(tl.float32) + dq * scale  # + the sequence part
    tl.store(DQ + ptr, dq.to(DQ.dtype.element_ty), mask=vmask)


@triton.jit
def _tile_rows(
    T, Hk, sqb, sqh, sqt, G: tl.constexpr, S: tl.constexpr, BT: tl.constexpr, M: tl.constexpr, N: tl.constexpr
):
    """Tensor-core tiles: rows = (position, head) pairs r = t_local * G + g [M], columns = (position, slot)
    pairs c = t_local * S + j [N]; a row meets only its own position's columns. Returns the rows' offsets into
    [B, Hq, T] (lse) and into q, o, do, dq (query layout strides sqb, sqh, sqt)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hk).to(tl.int64)
    hk = (pid_bh % Hk).to(tl.int64)
    t0 = pid_t * BT
    r = tl.arange(0, M)
    rvalid = (r // G < BT) & (t0 + r // G < T)
    h = hk * G + r % G
    rows = (b * Hk * G + h) * T + t0 + r // G  # [M] into [B, Hq, T]
    qoff = b * sqb + h * sqh + (t0 + r // G).to(tl.int64) * sqt
    c = tl.arange(0, N)
    cvalid = (c // S < BT) & (t0 + c // S < T)
    own = (r // G)[:, None] == (c // S)[None, :]
    return b, hk, (t0 + c // S).to(tl.int64), c % S, rows, qoff, rvalid, cvalid, own


@triton.jit
def _depth_fwd_tile(
    Q,
    KD,
    VD,
    O,
    LSE,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    sks,
    svb,
    svh,
    svt,
    svs,
    T,
    Hk,
    qk_scale,
    G: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    M: tl.constexpr,
    N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b, hk, cpos, cs, rows, qoff, rvalid, cvalid, own = _tile_rows(T, Hk, sqb, sqh, sqt, G, S, BT, M, N)
    d = tl.arange(0, D)
    ptr = qoff[:, None] + d[None, :]  # [M, D]
    q = tl.load(Q + ptr, mask=rvalid[:, None], other=0.0)
    kd = tl.load(
        KD + (b * skb + hk * skh + cpos * skt + cs * sks)[:, None] + d[None, :], mask=cvalid[:, None], other=0.0
    )
    vd = tl.load(
        VD + (b * svb + hk * svh + cpos * svt + cs * svs)[:, None] + d[None, :], mask=cvalid[:, None], other=0.0
    )
    x = tl.dot(q, tl.trans(kd), input_precision=DOT_PREC) * qk_scale  # [M, N] logits, log2 units
    x = tl.where(own & cvalid[None, :], x, float("-inf"))
    lse_s = tl.load(LSE + rows, mask=rvalid, other=0.0) * _LOG2E  # the sequence part's state
    m = tl.maximum(tl.max(x, 1), lse_s)
    p = tl.exp2(x - m[:, None])
    w_s = tl.exp2(lse_s - m)
    l = w_s + tl.sum(p, 1)
    acc = tl.load(O + ptr, mask=rvalid[:, None], other=0.0).to(tl.float32) * w_s[:, None]
    acc += tl.dot(p.to(vd.dtype), vd, input_precision=DOT_PREC)
    tl.store(O + ptr, (acc / l[:, None]).to(O.dtype.element_ty), mask=rvalid[:, None])
    tl.store(LSE + rows, (m + tl.log2(l)) / _LOG2E, mask=rvalid)


@triton.jit
def _depth_bwd_tile(
    Q,
    O,
    DO,
    LSE,
    DQ,
    KD,
    VD,
    DKD,
    DVD,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    sks,
    svb,
    svh,
    svt,
    svs,
    sdkb,
    sdkh,
    sdkt,
    sdks,
    sdvb,
    sdvh,
    sdvt,
    sdvs,
    T,
    Hk,
    qk_scale,
    scale,
    G: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    M: tl.constexpr,
    N: tl.constexpr,
    ACC: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b, hk, cpos, cs, rows, qoff, rvalid, cvalid, own = _tile_rows(T, Hk, sqb, sqh, sqt, G, S, BT, M, N)
    d = tl.arange(0, D)
    ptr = qoff[:, None] + d[None, :]  # [M, D]
    q = tl.load(Q + ptr, mask=rvalid[:, None], other=0.0)
    do = tl.load(DO + ptr, mask=rvalid[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * tl.load(O + ptr, mask=rvalid[:, None], other=0.0).to(tl.float32), 1)
    lse = tl.load(LSE + rows, mask=rvalid, other=0.0) * _LOG2E
    kd = tl.load(
        KD + (b * skb + hk * skh + cpos * skt + cs * sks)[:, None] + d[None, :], mask=cvalid[:, None], other=0.0
    )
    vd = tl.load(
        VD + (b * svb + hk * svh + cpos * svt + cs * svs)[:, None] + d[None, :], mask=cvalid[:, None], other=0.0
    )
    x = tl.dot(q, tl.trans(kd), input_precision=DOT_PREC) * qk_scale
    p = tl.where(own & cvalid[None, :] & rvalid[:, None], tl.exp2(x - lse[:, None]), 0.0)  # slot probabilities
    ds = p * (tl.dot(do, tl.trans(vd), input_precision=DOT_PREC) - delta[:, None])
    dq = tl.load(DQ + ptr, mask=rvalid[:, None], other=0.0).to(tl.float32)  # the sequence part
    dq += tl.dot(ds.to(kd.dtype), kd, input_precision=DOT_PREC) * scale
    tl.store(DQ + ptr, dq.to(DQ.dtype.element_ty), mask=rvalid[:, None])
    # the G heads of a position meet in the same columns: the matmuls sum them
    dkd = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC) * scale  # [N, D]
    dvd = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
    dk_ptr = DKD + (b * sdkb + hk * sdkh + cpos * sdkt + cs * sdks)[:, None] + d[None, :]
    dv_ptr = DVD + (b * sdvb + hk * sdvh + cpos * sdvt + cs * sdvs)[:, None] + d[None, :]
    if ACC:
        dkd += tl.load(dk_ptr, mask=cvalid[:, None], other=0.0).to(tl.float32)
        dvd += tl.load(dv_ptr, mask=cvalid[:, None], other=0.0).to(tl.float32)
    tl.store(dk_ptr, dkd.to(DKD.dtype.element_ty), mask=cvalid[:, None])
    tl.store(dv_ptr, dvd.to(DVD.dtype.element_ty), mask=cvalid[:, None])


@dataclass(frozen=True)
class Config:
    """Launch parameters of the depth kernels.

    Groups of ``tile_min_g`` or more query heads per KV head use the tensor-core tiles (``_depth_*_tile``:
    G heads x BT positions against BT positions x S slots, masked to each position's own slots, BT chosen so
    that the tile has at most ``tile_cols`` columns); smaller groups the slot loop (``_depth_fwd``/``_bwd``)
    with ``rows`` (position, head) rows per program and ``warps`` warps.
    """

    rows: int = 16
    warps: int = 4
    tile_min_g: int = 2
    tile_cols: int = 128
    tile_warps: int = 4

    def __post_init__(self):
        pow2 = (self.rows, self.tile_cols, self.warps, self.tile_warps)
        if any(v < 1 or v & (v - 1) for v in pow2) or max(self.warps, self.tile_warps) > 16:
            raise ValueError(f"{self}: rows, tile_cols and warps must be powers of two (warps <= 16)")

    def tile(self, G: int, S: int) -> tuple[int, int, int]:
        """(BT, M, N) of the tensor-core tiles: BT positions, M >= 16 rows, N >= 16 columns."""
        BT = max(1, min(max(16, triton.next_power_of_2(G)) // G, self.tile_cols // triton.next_power_of_2(S)))
        return BT, max(16, triton.next_power_of_2(BT * G)), max(16, triton.next_power_of_2(BT * S))

    def positions(self, G: int) -> int:
        """BT: whole positions per program (the G heads of a position share a program)."""
        return max(1, self.rows // triton.next_power_of_2(G))


_CPU_CONFIG = Config(rows=16, warps=1, tile_warps=1)
# (head dim, G) -> config, from `python -m kernels.moda_attn.tune` on an H200 (BENCHMARKS.md). D 64: at G = 8 the
# tiles beat the loop 2.2x; at G = 1 the loop with 16 rows / 4 warps runs at 1.2-1.3x the byte floor; at G = 2 (the
# model's GQA shape, S 22) the loop with 32 positions per program (64 rows) / 4 warps beats the best tiles by 12%
# (0.282 vs 0.316 ms fwd+bwd), while 16 rows / 4 warps costs 7x in its backward (G-axis shuffles). D 128: half the
# tile columns (the backward holds two [N, D] fp32 tiles); G = 2 not measured there, so it takes the tiles.
_GPU_CONFIGS = {
    (64, 1): Config(rows=16, warps=4),
    (64, 2): Config(rows=64, warps=4, tile_min_g=3),
    (128, 1): Config(rows=8, warps=4, tile_cols=64),
}
_override: Config | None = None
LAST_COMPILED: dict[str, object] = {}  # kernel name -> last launched CompiledKernel (n_regs, n_spills)


def set_config(cfg: Config | None) -> None:
    """Force a launch config (tests, tuning); ``None`` restores the defaults."""
    global _override
    _override = cfg


def get_config(device: torch.device, D: int, G: int) -> Config:
    if _override is not None:
        return _override
    if device.type != "cuda":
        return _CPU_CONFIG
    cfg = _GPU_CONFIGS.get((D, G)) or _GPU_CONFIGS.get((D, 1))
    return cfg or Config(rows=max(1, 1024 // D), warps=4)


def _launch(q, kd, cfg: Config):
    """(use the tensor-core tiles?, grid, constexprs common to both kernels of that variant)."""
    B, Hq, T, D = q.shape
    Hk, S = kd.shape[1], kd.shape[3]
    G = Hq // Hk
    if G >= cfg.tile_min_g:
        BT, M, N = cfg.tile(G, S)
        meta = dict(G=G, S=S, D=D, BT=BT, M=M, N=N, DOT_PREC=dot_precision(q.dtype), num_warps=cfg.tile_warps)
        return True, (triton.cdiv(T, BT), B * Hk), meta
    BT = cfg.positions(G)
    return False, (triton.cdiv(T, BT), B * Hk), dict(G=G, GP=triton.next_power_of_2(G), D=D, BT=BT, num_warps=cfg.warps)


def depth_fwd(q, kd, vd, o, lse, scale: float, cfg: Config) -> None:
    """Merge the depth slots into the sequence result, in place: o [B,Hq,T,D], lse [B,Hq,T] become joint."""
    T, Hk, S = q.shape[2], kd.shape[1], kd.shape[3]
    assert o.stride() == q.stride(), "q and o must share one layout"
    tile, grid, meta = _launch(q, kd, cfg)
    args = (q, kd, vd, o, lse, *q.stride()[:3], *kd.stride()[:4], *vd.stride()[:4], T, Hk)
    if tile:
        LAST_COMPILED["_depth_fwd"] = _depth_fwd_tile[grid](*args, scale * LOG2E, **meta)
    else:
        LAST_COMPILED["_depth_fwd"] = _depth_fwd[grid](*args, S, scale * LOG2E, **meta)


def depth_bwd(q, o, do, lse, dq, kd, vd, scale: float, cfg: Config, dkd_acc=None, dvd_acc=None, add: bool = True):
    """Add the depth part of dq into dq [B,Hq,T,D] in place; return dkd, dvd (or add them into the
    ``*_acc`` buffers, shaped like kd, vd, unit last stride, kd's dtype or fp32, and return None, None;
    ``add=False``: write them there, overwriting)."""
    T, Hk, S = q.shape[2], kd.shape[1], kd.shape[3]
    assert o.stride() == do.stride() == dq.stride() == q.stride(), "q, o, do and dq must share one layout"
    acc = dkd_acc is not None
    if acc:
        dkd, dvd = dkd_acc, dvd_acc
    else:  # contiguous, whatever the strides of kd, vd (a strided view of a slot buffer)
        dkd = torch.empty(kd.shape, dtype=kd.dtype, device=q.device)
        dvd = torch.empty(vd.shape, dtype=vd.dtype, device=q.device)
    tile, grid, meta = _launch(q, kd, cfg)
    args = (
        q,
        o,
        do,
        lse,
        dq,
        kd,
        vd,
        dkd,
        dvd,
        *q.stride()[:3],
        *kd.stride()[:4],
        *vd.stride()[:4],
        *dkd.stride()[:4],
        *dvd.stride()[:4],
    )
    if tile:
        LAST_COMPILED["_depth_bwd"] = _depth_bwd_tile[grid](*args, T, Hk, scale * LOG2E, scale, ACC=acc and add, **meta)
    else:
        LAST_COMPILED["_depth_bwd"] = _depth_bwd[grid](*args, T, Hk, S, scale * LOG2E, scale, ACC=acc and add, **meta)
    return (None, None) if acc else (dkd, dvd)
