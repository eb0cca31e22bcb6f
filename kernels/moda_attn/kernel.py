"""Triton kernels for MoDA attention: one softmax over causal sequence keys and same-position depth slots.

Layout (see op.py for the public contract):
    q, o, do, dq  [B, Hq, T, D]   contiguous
    k, v, dk, dv  [B, Hk, T, D]   contiguous
    kd, vd        [B, Hk, T, S, D] any strides with a unit last stride (e.g. a prefix view of a slot buffer)
    dkd, dvd      [B, Hk, T, S, D] any strides with a unit last stride: fresh contiguous tensors, or the
                  caller's buffers (views of a slot-gradient buffer) that the backward ADDS into
    lse, delta    [B, Hq, T] fp32; lse is kept in log2 units of the scaled logits (exp2 is the native op)

The joint softmax splits exactly into two passes that share state through (m, l, acc):

forward
    1. ``_depth_fwd``: per (KV head, run of positions) one program does the depth attention of ALL G query
       heads of the group (the paper's group-aware tile: rows = (position, head) pairs, columns =
       (position, slot) pairs, mask = same position). Every depth slot is read from HBM exactly once.
       It writes the normalised depth output od (fp32) and its log-sum-exp lse_d.
    2. ``_seq_fwd``: flash-attention over causal key blocks whose online-softmax state STARTS from the
       depth result (m = lse_d, l = 1, acc = od), so the final normalisation covers both key sets.
backward
    1. ``_depth_bwd``: delta = rowsum(dO * O) for every row, and, when S > 0, the depth gradients
       dkd, dvd (the G heads of a group sum inside the tile's matmuls: no atomics) plus the depth part
       of dq (fp32, unscaled) for step 3.
    2. ``_seq_bwd_dkdv``: per (key block, KV head), loops over the G query heads and the query blocks at or
       after it; dk/dv of the group accumulate in registers (no atomics). Optionally (``dq_atomic``) also
       adds dS K into an fp32 dq accumulator with atomics, replacing step 3.
    3. ``_seq_bwd_dq``: per (query block, query head), loops over causal key blocks; adds the depth dq.

Pointer arithmetic only (no ``tl.make_block_ptr``, removed in Triton 3.9); runs on Triton 3.6 (GPU) and
under the 3.9 CPU interpreter (fp32/fp16; that interpreter's bf16 ``tl.dot`` is wrong, so bf16 is checked
on the GPU by ``python -m kernels.bench moda_attn``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------------
# depth part (forward)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _depth_fwd(
    Q,
    KD,
    VD,
    OD,
    LSED,
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
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hk).to(tl.int64)
    hk = (pid_bh % Hk).to(tl.int64)
    Hq = Hk * G
    t0 = pid_t * BT
    d = tl.arange(0, D)

    # rows: (position, head) pairs of this group; r = t_local * G + g
    r = tl.arange(0, M)
    rt = r // G
    rpos = t0 + rt
    rvalid = (rt < BT) & (rpos < T)
    row_bh = b * Hq + hk * G + (r % G)  # [M] flat (b, h)
    row_off = (row_bh * T + rpos) * D  # [M] into [B, Hq, T, D]
    q = tl.load(Q + row_off[:, None] + d[None, :], mask=rvalid[:, None], other=0.0)

    # columns: (position, slot) pairs; c = t_local * S + j
    c = tl.arange(0, N)
    ct = c // S
    cpos = t0 + ct
    cvalid = (ct < BT) & (cpos < T)
    cpos64 = cpos.to(tl.int64)
    kd_off = b * skb + hk * skh + cpos64 * skt + (c % S) * sks
    vd_off = b * svb + hk * svh + cpos64 * svt + (c % S) * svs
    kd = tl.load(KD + kd_off[:, None] + d[None, :], mask=cvalid[:, None], other=0.0)
    vd = tl.load(VD + vd_off[:, None] + d[None, :], mask=cvalid[:, None], other=0.0)

    s = tl.dot(q, tl.trans(kd), input_precision=DOT_PREC) * qk_scale  # [M, N], log2 units
    own = (rt[:, None] == ct[None, :]) & cvalid[None, :]
    s = tl.where(own, s, float("-inf"))
    m = tl.max(s, 1)
    m = tl.where(rvalid, m, 0.0)  # padding rows see no slot; keep them finite
    p = tl.exp2(s - m[:, None])
    l = tl.sum(p, 1)
    l = tl.where(rvalid, l, 1.0)
    o = tl.dot(p.to(vd.dtype), vd, input_precision=DOT_PREC) / l[:, None]
    tl.store(OD + row_off[:, None] + d[None, :], o, mask=rvalid[:, None])
    tl.store(LSED + row_bh * T + rpos, m + tl.log2(l), mask=rvalid)


# ----------------------------------------------------------------------------------------------------------
# sequence part (forward): flash attention seeded with the depth state
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _seq_fwd(
    Q,
    K,
    V,
    O,
    LSE,
    OD,
    LSED,
    T,
    Hq,
    qk_scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_DEPTH: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # heaviest (last) query blocks first: better tail balance for the causal triangle
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    Hk = Hq // G
    kv_bh = b * Hk + h // G
    start_m = pid_m * BM
    rows = start_m + tl.arange(0, BM)
    rmask = rows < T
    d = tl.arange(0, D)
    cols = tl.arange(0, BN)

    q_ptrs = Q + (pid_bh * T + rows)[:, None] * D + d[None, :]
    q = tl.load(q_ptrs, mask=rmask[:, None], other=0.0)
    if HAS_DEPTH:
        m_i = tl.load(LSED + pid_bh * T + rows, mask=rmask, other=0.0)
        l_i = tl.full([BM], 1.0, dtype=tl.float32)
        acc = tl.load(OD + (pid_bh * T + rows)[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0)
    else:
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, D], dtype=tl.float32)

    k_base = K + kv_bh * T * D
    v_base = V + kv_bh * T * D
    # keys strictly before this query block: no mask (BM % BN == 0, so no block straddles start_m)
    for start_n in range(0, start_m, BN):
        kv_off = (start_n + cols)[:, None] * D + d[None, :]
        k = tl.load(k_base + kv_off)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_off)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    # the diagonal block(s): causal mask
    for start_n in range(start_m, tl.minimum(start_m + BM, T), BN):
        kn = start_n + cols
        kv_off = kn[:, None] * D + d[None, :]
        kmask = kn < T
        k = tl.load(k_base + kv_off, mask=kmask[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        qk = tl.where(rows[:, None] >= kn[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_off, mask=kmask[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(O + (pid_bh * T + rows)[:, None] * D + d[None, :], o.to(O.dtype.element_ty), mask=rmask[:, None])
    tl.store(LSE + pid_bh * T + rows, m_i + tl.log2(l_i), mask=rmask)


# ----------------------------------------------------------------------------------------------------------
# depth part (backward) + delta
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _depth_bwd(
    Q,
    O,
    DO,
    LSE,
    DELTA,
    DQD,
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
    qk_scale,
    scale,
    G: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    M: tl.constexpr,
    N: tl.constexpr,
    HAS_DEPTH: tl.constexpr,
    ACC: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hk).to(tl.int64)
    hk = (pid_bh % Hk).to(tl.int64)
    Hq = Hk * G
    t0 = pid_t * BT
    d = tl.arange(0, D)

    r = tl.arange(0, M)
    rt = r // G
    rpos = t0 + rt
    rvalid = (rt < BT) & (rpos < T)
    row_bh = b * Hq + hk * G + (r % G)
    row_off = (row_bh * T + rpos) * D
    do = tl.load(DO + row_off[:, None] + d[None, :], mask=rvalid[:, None], other=0.0)
    o = tl.load(O + row_off[:, None] + d[None, :], mask=rvalid[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # [M]
    tl.store(DELTA + row_bh * T + rpos, delta, mask=rvalid)

    if HAS_DEPTH:
        q = tl.load(Q + row_off[:, None] + d[None, :], mask=rvalid[:, None], other=0.0)
        lse = tl.load(LSE + row_bh * T + rpos, mask=rvalid, other=0.0)

        c = tl.arange(0, N)
        ct = c // S
        cpos = t0 + ct
        cvalid = (ct < BT) & (cpos < T)
        cpos64 = cpos.to(tl.int64)
        kd_off = b * skb + hk * skh + cpos64 * skt + (c % S) * sks
        vd_off = b * svb + hk * svh + cpos64 * svt + (c % S) * svs
        kd = tl.load(KD + kd_off[:, None] + d[None, :], mask=cvalid[:, None], other=0.0)
        vd = tl.load(VD + vd_off[:, None] + d[None, :], mask=cvalid[:, None], other=0.0)

        s = tl.dot(q, tl.trans(kd), input_precision=DOT_PREC) * qk_scale  # [M, N]
        own = (rt[:, None] == ct[None, :]) & cvalid[None, :] & rvalid[:, None]
        p = tl.where(own, tl.exp2(s - lse[:, None]), 0.0)  # joint-softmax probabilities of the slots
        dp = tl.dot(do, tl.trans(vd), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dqd = tl.dot(ds.to(kd.dtype), kd, input_precision=DOT_PREC)  # unscaled; dq kernel scales
        tl.store(DQD + row_off[:, None] + d[None, :], dqd, mask=rvalid[:, None])
        # the G heads of this group meet in the same columns: the matmul sums them
        dkd = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC) * scale  # [N, D]
        dvd = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
        dk_ptrs = DKD + (b * sdkb + hk * sdkh + cpos64 * sdkt + (c % S) * sdks)[:, None] + d[None, :]
        dv_ptrs = DVD + (b * sdvb + hk * sdvh + cpos64 * sdvt + (c % S) * sdvs)[:, None] + d[None, :]
        if ACC:  # add into the caller's buffers: each (position, slot) is this program's alone, so no atomics
            dkd += tl.load(dk_ptrs, mask=cvalid[:, None], other=0.0).to(tl.float32)
            dvd += tl.load(dv_ptrs, mask=cvalid[:, None], other=0.0).to(tl.float32)
        tl.store(dk_ptrs, dkd.to(DKD.dtype.element_ty), mask=cvalid[:, None])
        tl.store(dv_ptrs, dvd.to(DVD.dtype.element_ty), mask=cvalid[:, None])


# ----------------------------------------------------------------------------------------------------------
# sequence part (backward)
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _seq_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DQACC,
    T,
    Hk,
    qk_scale,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)  # small start_n = most work, scheduled first
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hk
    start_n = pid_n * BN
    cols = start_n + tl.arange(0, BN)
    cmask = cols < T
    d = tl.arange(0, D)
    kv_off = (pid_bh * T + cols)[:, None] * D + d[None, :]
    k = tl.load(K + kv_off, mask=cmask[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=cmask[:, None], other=0.0)
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, D], dtype=tl.float32)
    rr = tl.arange(0, BM)

    # the G query heads of this KV head: dk/dv summed in registers
    for g in range(G):
        bh = (b * Hk + pid_bh % Hk) * G + g  # flat (b, h)
        # query blocks overlapping the diagonal: causal mask (BN % BM == 0)
        for start_m in range(start_n, start_n + BN, BM):
            rows = start_m + rr
            rmask = rows < T
            row_off = (bh * T + rows)[:, None] * D + d[None, :]
            q = tl.load(Q + row_off, mask=rmask[:, None], other=0.0)
            lse = tl.load(LSE + bh * T + rows, mask=rmask, other=float("inf"))
            qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # [BN, BM]
            pT = tl.exp2(qkT * qk_scale - lse[None, :])
            pT = tl.where(rows[None, :] >= cols[:, None], pT, 0.0)
            do = tl.load(DO + row_off, mask=rmask[:, None], other=0.0)
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
            delta = tl.load(DELTA + bh * T + rows, mask=rmask, other=0.0)
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
            dk = tl.dot(dsT, q, dk, input_precision=DOT_PREC)
            if DQ_ATOMIC:
                dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PREC)
                tl.atomic_add(DQACC + row_off, dq, mask=rmask[:, None], sem="relaxed")
        # later query blocks see the whole key block
        for start_m in range(start_n + BN, T, BM):
            rows = start_m + rr
            rmask = rows < T
            row_off = (bh * T + rows)[:, None] * D + d[None, :]
            q = tl.load(Q + row_off, mask=rmask[:, None], other=0.0)
            lse = tl.load(LSE + bh * T + rows, mask=rmask, other=float("inf"))
            qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
            pT = tl.exp2(qkT * qk_scale - lse[None, :])
            do = tl.load(DO + row_off, mask=rmask[:, None], other=0.0)
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
            delta = tl.load(DELTA + bh * T + rows, mask=rmask, other=0.0)
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
            dk = tl.dot(dsT, q, dk, input_precision=DOT_PREC)
            if DQ_ATOMIC:
                dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PREC)
                tl.atomic_add(DQACC + row_off, dq, mask=rmask[:, None], sem="relaxed")

    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=cmask[:, None])
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=cmask[:, None])


@triton.jit
def _seq_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQD,
    DQ,
    T,
    Hq,
    qk_scale,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_DEPTH: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    Hk = Hq // G
    kv_bh = b * Hk + h // G
    start_m = pid_m * BM
    rows = start_m + tl.arange(0, BM)
    rmask = rows < T
    d = tl.arange(0, D)
    cols = tl.arange(0, BN)
    row_off = (pid_bh * T + rows)[:, None] * D + d[None, :]
    q = tl.load(Q + row_off, mask=rmask[:, None], other=0.0)
    do = tl.load(DO + row_off, mask=rmask[:, None], other=0.0)
    lse = tl.load(LSE + pid_bh * T + rows, mask=rmask, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * T + rows, mask=rmask, other=0.0)
    if HAS_DEPTH:
        dq = tl.load(DQD + row_off, mask=rmask[:, None], other=0.0)
    else:
        dq = tl.zeros([BM, D], dtype=tl.float32)

    k_base = K + kv_bh * T * D
    v_base = V + kv_bh * T * D
    for start_n in range(0, start_m, BN):
        kv_off = (start_n + cols)[:, None] * D + d[None, :]
        k = tl.load(k_base + kv_off)
        v = tl.load(v_base + kv_off)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        p = tl.exp2(qk * qk_scale - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    for start_n in range(start_m, tl.minimum(start_m + BM, T), BN):
        kn = start_n + cols
        kv_off = kn[:, None] * D + d[None, :]
        kmask = kn < T
        k = tl.load(k_base + kv_off, mask=kmask[:, None], other=0.0)
        v = tl.load(v_base + kv_off, mask=kmask[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        p = tl.exp2(qk * qk_scale - lse[:, None])
        p = tl.where(rows[:, None] >= kn[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    tl.store(DQ + row_off, (dq * scale).to(DQ.dtype.element_ty), mask=rmask[:, None])


# ----------------------------------------------------------------------------------------------------------
# launch helpers
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """Tile sizes and launch parameters. ``(m, n, warps, stages)`` per sequence kernel."""

    fwd: tuple[int, int, int, int] = (128, 64, 4, 3)
    dkdv: tuple[int, int, int, int] = (64, 128, 8, 3)  # (query block, key block, ...)
    dq: tuple[int, int, int, int] = (128, 64, 8, 3)
    depth_m: int = 16  # rows (position, head) per depth tile; >= 16 for tensor-core dots
    depth_warps: int = 4
    dq_atomic: bool = False

    def clamp(self, T: int) -> Config:
        """Shrink tiles for short sequences (keeps BM % BN == 0 relations)."""
        cap = max(16, triton.next_power_of_2(T))

        def fit(t):
            m, n, w, s = t
            m2, n2 = min(m, cap), min(n, cap)
            return (m2, n2, w, s)

        return replace(self, fwd=fit(self.fwd), dkdv=fit(self.dkdv), dq=fit(self.dq))


_CPU_CONFIG = Config(fwd=(16, 16, 1, 1), dkdv=(16, 16, 1, 1), dq=(16, 16, 1, 1), depth_m=16, depth_warps=1)
_GPU_CONFIGS = {
    # head dim -> tiles picked on an H200 with kernels/moda_attn/tune.py (BENCHMARKS.md, "MoDA attention")
    64: Config(fwd=(128, 64, 8, 3), dkdv=(64, 64, 4, 3), dq=(64, 64, 4, 3)),
    128: Config(fwd=(128, 64, 8, 3), dkdv=(32, 64, 4, 3), dq=(64, 32, 4, 3)),
}
_override: Config | None = None
LAST_COMPILED: dict[str, object] = {}  # kernel name -> last launched CompiledKernel (n_regs, n_spills)


def set_config(cfg: Config | None) -> None:
    """Force a launch config (tests, tuning); ``None`` restores the defaults."""
    global _override
    _override = cfg


def get_config(device: torch.device, D: int, T: int) -> Config:
    if _override is not None:
        cfg = _override
    elif device.type != "cuda":
        cfg = _CPU_CONFIG
    else:
        cfg = _GPU_CONFIGS.get(D, Config(fwd=(64, 32, 4, 2), dkdv=(32, 64, 4, 2), dq=(64, 32, 4, 2)))
    return cfg.clamp(T)


def _poison() -> bool:
    return os.environ.get("MIXDEPTH_POISON_EMPTY", "0") == "1"


def _empty(shape, dtype, device) -> torch.Tensor:
    """torch.empty, NaN-filled when MIXDEPTH_POISON_EMPTY=1 so that unwritten elements show up in tests."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _poison():
        t.fill_(float("nan"))
    return t


def _dot_prec(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (the reference path); 16-bit inputs use the tensor cores anyway
    return "ieee" if dtype == torch.float32 else "tf32"


def _depth_tile(G: int, S: int, depth_m: int) -> tuple[int, int, int]:
    M = max(depth_m, triton.next_power_of_2(G), 16)
    BT = M // G  # whole positions per tile
    N = max(16, triton.next_power_of_2(BT * max(S, 1)))
    return BT, M, N


def moda_fwd(q, k, v, kd, vd, scale: float, cfg: Config):
    """Forward launch. q [B,Hq,T,D], k/v [B,Hk,T,D] contiguous; kd/vd [B,Hk,T,S,D] (unit last stride) or None.

    Returns o [B,Hq,T,D] (q.dtype) and lse [B,Hq,T] (fp32, log2 units of the scaled logits).
    """
    B, Hq, T, D = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    S = 0 if kd is None else kd.shape[3]
    dev = q.device
    qk_scale = scale * LOG2E
    prec = _dot_prec(q.dtype)
    o = _empty((B, Hq, T, D), q.dtype, dev)
    lse = _empty((B, Hq, T), torch.float32, dev)
    if S > 0:
        od = _empty((B, Hq, T, D), torch.float32, dev)
        lsed = _empty((B, Hq, T), torch.float32, dev)
        BT, M, N = _depth_tile(G, S, cfg.depth_m)
        LAST_COMPILED["_depth_fwd"] = _depth_fwd[(triton.cdiv(T, BT), B * Hk)](
            q,
            kd,
            vd,
            od,
            lsed,
            *kd.stride()[:4],
            *vd.stride()[:4],
            T,
            Hk,
            qk_scale,
            G=G,
            S=S,
            D=D,
            BT=BT,
            M=M,
            N=N,
            DOT_PREC=prec,
            num_warps=cfg.depth_warps,
            num_stages=1,
        )
    else:
        od, lsed = o, lse  # unused placeholders
    BM, BN, w, st = cfg.fwd
    LAST_COMPILED["_seq_fwd"] = _seq_fwd[(triton.cdiv(T, BM), B * Hq)](
        q,
        k,
        v,
        o,
        lse,
        od,
        lsed,
        T,
        Hq,
        qk_scale,
        G=G,
        D=D,
        BM=BM,
        BN=BN,
        HAS_DEPTH=S > 0,
        DOT_PREC=prec,
        num_warps=w,
        num_stages=st,
    )
    return o, lse


def moda_bwd(do, q, k, v, kd, vd, o, lse, scale: float, cfg: Config, dkd_acc=None, dvd_acc=None):
    """Backward launch; returns dq, dk, dv, dkd, dvd (dkd/dvd None when kd is None).

    With ``dkd_acc``, ``dvd_acc`` (shaped like kd, vd; unit last stride; kd's dtype or fp32) the depth
    gradients are ADDED into those in place (fp32 sum, one rounding) and dkd/dvd come back as None.
    """
    B, Hq, T, D = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    S = 0 if kd is None else kd.shape[3]
    dev = q.device
    qk_scale = scale * LOG2E
    prec = _dot_prec(q.dtype)

    delta = _empty((B, Hq, T), torch.float32, dev)
    if cfg.dq_atomic and S == 0:
        dqd = torch.zeros((B, Hq, T, D), dtype=torch.float32, device=dev)
    else:
        dqd = _empty((B, Hq, T, D), torch.float32, dev) if S > 0 else delta
    acc = dkd_acc is not None
    dkd, dvd = dkd_acc, dvd_acc
    if kd is not None and not acc:  # fresh contiguous [B, Hk, T, S, D]
        dkd, dvd = _empty(kd.shape, kd.dtype, dev), _empty(vd.shape, vd.dtype, dev)
    BT, M, N = _depth_tile(G, S, cfg.depth_m)
    LAST_COMPILED["_depth_bwd"] = _depth_bwd[(triton.cdiv(T, BT), B * Hk)](
        q,
        o,
        do,
        lse,
        delta,
        dqd,
        kd if S > 0 else q,
        vd if S > 0 else q,
        dkd if S > 0 else q,
        dvd if S > 0 else q,
        *(kd.stride()[:4] if S > 0 else (0, 0, 0, 0)),
        *(vd.stride()[:4] if S > 0 else (0, 0, 0, 0)),
        *(dkd.stride()[:4] if S > 0 else (0, 0, 0, 0)),
        *(dvd.stride()[:4] if S > 0 else (0, 0, 0, 0)),
        T,
        Hk,
        qk_scale,
        scale,
        G=G,
        S=max(S, 1),
        D=D,
        BT=BT,
        M=M,
        N=N,
        HAS_DEPTH=S > 0,
        ACC=acc,
        DOT_PREC=prec,
        num_warps=cfg.depth_warps,
        num_stages=1,
    )

    dk = _empty(k.shape, k.dtype, dev)
    dv = _empty(v.shape, v.dtype, dev)
    BM1, BN1, w1, st1 = cfg.dkdv
    LAST_COMPILED["_seq_bwd_dkdv"] = _seq_bwd_dkdv[(triton.cdiv(T, BN1), B * Hk)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        dqd,
        T,
        Hk,
        qk_scale,
        scale,
        G=G,
        D=D,
        BM=BM1,
        BN=BN1,
        DQ_ATOMIC=cfg.dq_atomic,
        DOT_PREC=prec,
        num_warps=w1,
        num_stages=st1,
    )
    if cfg.dq_atomic:
        dq = (dqd * scale).to(q.dtype)
    else:
        dq = _empty(q.shape, q.dtype, dev)
        BM2, BN2, w2, st2 = cfg.dq
        LAST_COMPILED["_seq_bwd_dq"] = _seq_bwd_dq[(triton.cdiv(T, BM2), B * Hq)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dqd,
            dq,
            T,
            Hq,
            qk_scale,
            scale,
            G=G,
            D=D,
            BM=BM2,
            BN=BN2,
            HAS_DEPTH=S > 0,
            DOT_PREC=prec,
            num_warps=w2,
            num_stages=st2,
        )
    return (dq, dk, dv, None, None) if acc else (dq, dk, dv, dkd, dvd)


def default_scale(D: int) -> float:
    return 1.0 / math.sqrt(D)
