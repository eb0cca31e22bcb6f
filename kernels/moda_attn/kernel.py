"""Triton depth kernels of MoDA attention, merged with a sequence attention through the log-sum-exp.

Layout (see op.py for the public contract):
    q, o, do, dq  [B, Hq, T, D]   contiguous
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

One program owns BT positions of one KV head and all G query heads of its group ([BT, GP, D] tiles, GP = G
padded to a power of two), so each depth slot is read from HBM once, the G heads' slot gradients sum in
registers, and no two programs touch the same (position, slot): no atomics. The slots are visited one at a
time; a slot is a [BT, D] tile and the per-position products are broadcast multiply + reduce on the CUDA
cores (a depth "matmul" has one slot per row: tensor-core tiles would be mostly masked). Work is
O(B Hq T S D), memory O(B Hk T S D): the kernels are bandwidth-bound.

Pointer arithmetic only (no ``tl.make_block_ptr``, removed in Triton 3.9); runs on Triton 3.6 (GPU) and
under the 3.9 CPU interpreter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the kernels' copy: Triton reads only constexpr globals


@triton.jit
def _tile(T, Hk, BT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """This program's positions t [BT], row offsets of (position, head) pairs [BT, GP] into [B, Hq, T]."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hk).to(tl.int64)
    hk = (pid_bh % Hk).to(tl.int64)
    t = pid_t * BT + tl.arange(0, BT)
    g = tl.arange(0, GP)
    valid = (t < T)[:, None] & (g < G)[None, :]
    rows = ((b * Hk + hk) * G + g)[None, :] * T + t[:, None]
    return b, hk, t, rows, valid


@triton.jit
def _depth_fwd(
    Q,
    KD,
    VD,
    O,
    LSE,
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
    b, hk, t, rows, valid = _tile(T, Hk, BT, G, GP)
    d = tl.arange(0, D)
    ptr = rows[:, :, None] * D + d[None, None, :]  # [BT, GP, D]
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
    b, hk, t, rows, valid = _tile(T, Hk, BT, G, GP)
    d = tl.arange(0, D)
    ptr = rows[:, :, None] * D + d[None, None, :]  # [BT, GP, D]
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


@dataclass(frozen=True)
class Config:
    """Launch parameters of the depth kernels: (position, head) rows per program, warps."""

    rows: int = 64
    warps: int = 4

    def __post_init__(self):
        if self.rows < 1 or self.rows & (self.rows - 1) or self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Config(rows={self.rows}, warps={self.warps}): rows a power of two, warps 1-16")

    def positions(self, G: int) -> int:
        """BT: whole positions per program (the G heads of a position share a program)."""
        return max(1, self.rows // triton.next_power_of_2(G))


_CPU_CONFIG = Config(rows=16, warps=1)
_GPU_CONFIGS = {64: Config(rows=64, warps=4), 128: Config(rows=32, warps=4)}  # head dim -> config
_override: Config | None = None
LAST_COMPILED: dict[str, object] = {}  # kernel name -> last launched CompiledKernel (n_regs, n_spills)


def set_config(cfg: Config | None) -> None:
    """Force a launch config (tests, tuning); ``None`` restores the defaults."""
    global _override
    _override = cfg


def get_config(device: torch.device, D: int) -> Config:
    if _override is not None:
        return _override
    if device.type != "cuda":
        return _CPU_CONFIG
    return _GPU_CONFIGS.get(D, Config(rows=max(8, 4096 // D), warps=4))


def _empty(shape, dtype, device) -> torch.Tensor:
    """torch.empty, NaN-filled when MIXDEPTH_POISON_EMPTY=1 so that unwritten elements show up in tests."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("MIXDEPTH_POISON_EMPTY", "0") == "1":
        t.fill_(float("nan"))
    return t


def _grid(q, Hk, BT):
    B, _, T, _ = q.shape
    return (triton.cdiv(T, BT), B * Hk)


def depth_fwd(q, kd, vd, o, lse, scale: float, cfg: Config) -> None:
    """Merge the depth slots into the sequence result, in place: o [B,Hq,T,D], lse [B,Hq,T] become joint."""
    Hq, D = q.shape[1], q.shape[3]
    Hk, S = kd.shape[1], kd.shape[3]
    G = Hq // Hk
    BT = cfg.positions(G)
    LAST_COMPILED["_depth_fwd"] = _depth_fwd[_grid(q, Hk, BT)](
        q, kd, vd, o, lse, *kd.stride()[:4], *vd.stride()[:4], q.shape[2], Hk, S, scale * LOG2E,
        G=G, GP=triton.next_power_of_2(G), D=D, BT=BT, num_warps=cfg.warps,
    )  # fmt: skip


def depth_bwd(q, o, do, lse, dq, kd, vd, scale: float, cfg: Config, dkd_acc=None, dvd_acc=None):
    """Add the depth part of dq into dq [B,Hq,T,D] in place; return dkd, dvd (or add them into the
    ``*_acc`` buffers, shaped like kd, vd, unit last stride, kd's dtype or fp32, and return None, None)."""
    Hq, D = q.shape[1], q.shape[3]
    Hk, S = kd.shape[1], kd.shape[3]
    G = Hq // Hk
    BT = cfg.positions(G)
    acc = dkd_acc is not None
    dkd, dvd = (dkd_acc, dvd_acc) if acc else (_empty(kd.shape, kd.dtype, q.device), _empty(vd.shape, vd.dtype, q.device))
    LAST_COMPILED["_depth_bwd"] = _depth_bwd[_grid(q, Hk, BT)](
        q, o, do, lse, dq, kd, vd, dkd, dvd,
        *kd.stride()[:4], *vd.stride()[:4], *dkd.stride()[:4], *dvd.stride()[:4],
        q.shape[2], Hk, S, scale * LOG2E, scale,
        G=G, GP=triton.next_power_of_2(G), D=D, BT=BT, ACC=acc, num_warps=cfg.warps,
    )  # fmt: skip
    return (None, None) if acc else (dkd, dvd)
