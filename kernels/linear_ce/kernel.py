"""Triton kernel of the fused linear + cross-entropy: per-row loss and logit gradient, in place.

``_ce_rows_kernel`` (``BLOCK_R`` rows of a chunk of logits ``z [R, V]``, the matmul's output, per program):

1. one pass over V in blocks of ``BLOCK_V``: each block's row max, then the row's running max ``m`` and sum
   ``s`` of ``exp(z - m)`` in fp32 (one exponential per logit), giving ``lse = m + log(s)``; the row's loss is
   ``lse - z[t]`` (0 when t is ``ignore_index``);
2. with ``WRITE_GRAD``, a second pass overwriting ``z`` with ``(softmax(z) - onehot(t)) * scale`` in z's dtype
   (0 for an ignored row), where ``scale`` (read from a device scalar, so nothing waits on the host) is the
   loss's scale, ``1 / n_valid`` for the mean.

When one block spans the row (``BLOCK_V >= V``) the row is read once: loaded, reduced and its gradient written
from registers (``ONE_PASS``), one read and one write of the logits instead of two reads and one write.

The logits are read as stored (the matmul's rounding, as the unfused ``logits.float()`` reads them) and
every gradient value is rounded once. A target outside ``[0, V)`` reads column 0 (memory safe; the range check
lives in ``op.py``). Pointer arithmetic only, int64 row offsets: Triton 3.6 and 3.9.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.common.dispatch import INTERPRET

__all__ = ["CONFIG", "CeConfig", "ce_rows"]


@dataclass(frozen=True)
class CeConfig:
    """Launch knobs of the op: the logits chunk budget and the row kernel's tile and warps."""

    # logits of one chunk (rows: the largest power of two that fits, at least 1); 1 GiB: 8192 rows of 50304 bf16
    # logits, 4 chunks per GPT-2-small batch, 14.2 ms against 15.4 ms at 256 MiB (H200, 2026-12-04): fewer and
    # longer-K dW products, fewer passes over the fp32 dW accumulator
    chunk_bytes: int = 2**30
    # columns per loop step (power of two; capped at next_pow2(V)) and warps: 16384 and 16 take a chunk of 8192 x 50304
    # bf16 logits in 0.773 ms against 0.828 ms at 4096 and 8 (H100, 2026-12-06); the whole row in one block (one
    # read) 1.13 ms at 65536 and 16: spilled registers
    block_v: int = 16384
    # rows per program (power of two): one on a GPU, where a row of V logits is work enough; 16 under the
    # interpreter, whose cost is per program (~3 ms each on Triton 3.9), not per element
    block_r: int = 16 if INTERPRET else 1
    num_warps: int = 16

    def chunk_rows(self, n: int, v: int, itemsize: int) -> int:
        """Rows per chunk for ``n`` rows of ``v`` logits of ``itemsize`` bytes."""
        fit = max(1, self.chunk_bytes // max(1, v * itemsize))
        return max(1, min(n, 1 << (fit.bit_length() - 1)))


CONFIG = CeConfig()


@triton.jit
def _ce_rows_kernel(
    z_ptr,
    t_ptr,
    loss_ptr,
    scale_ptr,
    R,
    V,
    stride_z,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    z_rows = z_ptr + rows[:, None] * stride_z  # [BLOCK_R, 1] row starts
    t = tl.load(t_ptr + rows, mask=rmask, other=ignore_index)
    valid = t != ignore_index
    t_col = tl.where((t >= 0) & (t < V), t, 0)
    cols = tl.arange(0, BLOCK_V)
    if ONE_PASS:  # the whole row in one block: read once
        mask = rmask[:, None] & (cols < V)[None, :]
        z = tl.load(z_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        m_row = tl.max(z, axis=1)
        m_row = tl.where(m_row == float("-inf"), 0.0, m_row)  # padding rows (and rows of -inf logits)
        s_row = tl.where(rmask, tl.sum(tl.exp(z - m_row[:, None]), axis=1), 1.0)  # padding rows: no log(0)
    else:
        m_row = tl.full([BLOCK_R], float("-inf"), tl.float32)  # running max and sum of exp(z - m_row)
        s_row = tl.zeros([BLOCK_R], dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            mask = rmask[:, None] & (c < V)[None, :]
            zb = tl.load(z_rows + c[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_row, tl.max(zb, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no finite value yet: exp(-inf) = 0
            s_row = s_row * tl.exp(m_row - m_ref) + tl.sum(tl.exp(zb - m_ref[:, None]), axis=1)
            m_row = m_new
        m_row = tl.where(m_row == float("-inf"), 0.0, m_row)
        s_row = tl.where(rmask, s_row, 1.0)
    lse = m_row + tl.log(s_row)  # [BLOCK_R]
    z_t = tl.load(z_ptr + rows * stride_z + t_col, mask=rmask, other=0.0).to(tl.float32)
    tl.store(loss_ptr + rows, tl.where(valid, lse - z_t, 0.0), mask=rmask)
    if WRITE_GRAD:
        scale = tl.load(scale_ptr)
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            mask = rmask[:, None] & (c < V)[None, :]
            if not ONE_PASS:
                z = tl.load(z_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(z - lse[:, None]) - tl.where(c[None, :] == t[:, None], 1.0, 0.0)
            g = tl.where(valid[:, None], p * scale, 0.0)  # [BLOCK_R, BLOCK_V], 0 on ignored rows
            tl.store(z_rows + c[None, :], g.to(z_ptr.dtype.element_ty), mask=mask)


def ce_rows(
    z: torch.Tensor,
    targets: torch.Tensor,
    loss: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    write_grad: bool,
    cfg: CeConfig | None = None,
) -> None:
    """Per-row losses into ``loss`` and, with ``write_grad``, the logit gradient over ``z`` in place.

    Args:
        z: ``[R, V]`` logits, unit column stride; overwritten by ``(softmax - onehot) * scale`` with write_grad.
        targets: ``[R]`` int64, contiguous.
        loss: ``[R]`` fp32, every element written (``lse - z[t]``, 0 for ignored rows).
        scale: fp32 device scalar multiplying the gradient.
        ignore_index: target value of rows without loss or gradient.
        write_grad: whether to overwrite z with the gradient.
        cfg: launch knobs; default ``CONFIG``.
    """
    r, v = z.shape
    if r == 0:
        return
    cfg = cfg or CONFIG
    block_v = min(cfg.block_v, triton.next_power_of_2(v))
    _ce_rows_kernel[(triton.cdiv(r, cfg.block_r),)](
        z,
        targets,
        loss,
        scale,
        r,
        v,
        z.stride(0),
        ignore_index,
        WRITE_GRAD=write_grad,
        ONE_PASS=block_v >= v,
        BLOCK_R=cfg.block_r,
        BLOCK_V=block_v,
        num_warps=cfg.num_warps,
    )
