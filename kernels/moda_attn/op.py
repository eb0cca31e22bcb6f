"""Public MoDA attention op: a fused causal sequence attention (seq.py) merged with the Triton depth kernels
(kernel.py) through the log-sum-exp, as one autograd function; the reference (naive.py) where they cannot run."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kernels.common.dispatch import HAS_TRITON, use_triton

from . import seq as _seq
from .naive import moda_attn_naive

if HAS_TRITON:
    from . import kernel as _k

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _MoDAAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kd, vd, scale, dkd_acc):
        backend = _seq.backend_for(q)
        o, lse, aux = _seq.seq_fwd(q, k, v, scale, backend)  # o in q's layout, as the kernels need
        cfg = _k.get_config(q.device, q.shape[-1], q.shape[1] // k.shape[1])
        if kd is not None and kd.shape[3] > 0:
            _k.depth_fwd(q, kd, vd, o, lse, scale, cfg)  # o, lse become the joint ones
        ctx.save_for_backward(q, k, v, kd, vd, o, lse)
        ctx.scale, ctx.cfg, ctx.backend, ctx.aux = scale, cfg, backend, aux
        ctx.acc = dkd_acc  # not an input to differentiate: the buffers (or a function giving them) to add into
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, kd, vd, o, lse = ctx.saved_tensors
        do = _seq.like(do, o)  # fused attention backwards want dO in O's layout; it is q's (forward)
        dq, dk, dv = _seq.seq_bwd(do, q, k, v, o, lse, ctx.aux, ctx.scale, ctx.backend)
        dkd = dvd = None
        acc, add = ctx.acc, True
        if callable(acc):  # the buffers, requested now that the backward needs them
            acc = acc()
            acc, add = (acc[:2], acc[2]) if len(acc) == 3 else (acc, True)
            _check_acc(acc, kd, vd)
        if kd is not None and kd.shape[3] > 0:
            dq = _seq.like(dq, q)
            dkd, dvd = _k.depth_bwd(q, o, do, lse, dq, kd, vd, ctx.scale, ctx.cfg, *(acc or (None, None)), add=add)
        elif kd is not None and acc is None:  # S = 0 slots: empty gradients
            dkd, dvd = torch.zeros_like(kd), torch.zeros_like(vd)
        return dq, dk, dv, dkd, dvd, None, None


def _check_acc(acc, kd: torch.Tensor, vd: torch.Tensor) -> None:
    for name, t, ref in zip(("gkd", "gvd"), acc, (kd, vd), strict=True):
        if t.shape != ref.shape or t.device != ref.device or t.dtype not in (ref.dtype, torch.float32):
            raise ValueError(f"depth_grad_acc {name}: {t.dtype} {tuple(t.shape)} on {t.device} does not match kd")
        if t.stride(-1) != 1:
            raise ValueError(f"depth_grad_acc {name} needs a unit last stride, got strides {t.stride()}")


def _query_layout(q: torch.Tensor) -> torch.Tensor:
    """q as it is when contiguous [B, Hq, T, D] or a transposed view of contiguous [B, T, Hq, D] memory (the
    projections' layout: output and dO then need no transposing copy), else contiguous."""
    return q if q.is_contiguous() or q.transpose(1, 2).is_contiguous() else q.contiguous()


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def moda_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kd: torch.Tensor | None = None,
    vd: torch.Tensor | None = None,
    scale: float | None = None,
    depth_grad_acc: tuple[torch.Tensor, torch.Tensor] | Callable[[], tuple] | None = None,
) -> torch.Tensor:
    """Mixture-of-Depths attention: one softmax over causal sequence keys and same-position depth slots.

    ``o[b, h, t] = sum_s P[s] v[b, h//G, s] + sum_j P[j] vd[b, h//G, t, j]`` with ``P`` the softmax of the
    joint logits ``{scale q.k[s] : s <= t} U {scale q.kd[t, j] : j < S}`` (one shared denominator).

    Args:
        q: queries ``[B, Hq, T, D]``. The kernels take ``D`` a power of two in [16, 256] (64 and 128 are the
            tuned ones); any other ``D`` runs the reference (see below). Contiguous, or a transposed view of
            contiguous ``[B, T, Hq, D]`` memory (the projections' layout), used in place; ``o`` comes back in
            q's layout (any other q is copied contiguous first).
        k: sequence keys of this layer ``[B, Hk, T, D]``; ``Hq = G * Hk`` for any integer ``G >= 1``,
            query head ``h`` reads KV head ``h // G``.
        v: sequence values ``[B, Hk, T, D]``.
        kd: depth keys ``[B, Hk, T, S, D]``: the ``S`` slots written by earlier layers for each position.
            ``S = 0`` or ``None`` gives plain causal attention. Any strides with a unit last stride are
            used in place, so a prefix view ``buf[:, :, :, :n]`` of a preallocated slot buffer
            ``[B, Hk, T, S_max, D]`` costs no copy (its gradient comes back as a contiguous tensor, or is
            added into ``depth_grad_acc``).
        vd: depth values, same shape as ``kd``.
        scale: logit scale, default ``1 / sqrt(D)``.
        depth_grad_acc: ``(gkd, gvd)`` shaped like ``kd``, ``vd`` (unit last stride, ``kd``'s dtype or fp32,
            not overlapping any input), e.g. the matching views of a slot-gradient buffer, or a function
            returning them, called (and its result checked) in the backward pass, so that the buffers need
            not exist before. The kernels' backward ADDS dL/dkd, dL/dvd into them in place (fp32 sum, one
            rounding), and kd, vd get no gradient then. The function may return ``(gkd, gvd, add)``: with
            ``add=False`` the buffers' contents are garbage and get overwritten instead (the first of several
            sums: no zero-filling, no read). The reference ignores them (see below).

    Returns:
        ``o`` ``[B, Hq, T, D]`` in the input dtype (fp16, bf16 or fp32; all inputs share it), in q's layout
        (contiguous from the reference). Differentiable w.r.t. q, k, v, kd, vd.

    Raises:
        TypeError: bfloat16 inputs under the Triton interpreter (its bf16 dots are wrong), and bad dtypes.
        ValueError: inconsistent shapes, devices, scale or ``depth_grad_acc``.

    Where Triton runs (``kernels.common.dispatch.use_triton``: CUDA tensors, or any tensor under
    ``TRITON_INTERPRET=1``, slow, for tests), the sequence part runs on torch's fused causal attention (cuDNN
    for fp16/bf16 on CUDA; see seq.py) and the depth part on the Triton kernels; depth products and
    accumulation are fp32. Elsewhere (a plain CPU) and for head dims the kernels do not take, the op returns
    ``moda_attn_naive`` (the readable fp32 reference, same semantics): there ``depth_grad_acc`` is not used,
    kd and vd get their gradients through autograd and the buffers stay untouched.
    """
    if (kd is None) != (vd is None):
        raise ValueError("kd and vd must both be given or both be None")
    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("kd", kd, 5), ("vd", vd, 5)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise ValueError(f"{name} must have {nd} dims, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: unsupported dtype {t.dtype} (fp16, bf16, fp32)")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype={t.dtype} differs from q.dtype={q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    B, Hq, T, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    Bk, Hk, Tk, Dk = k.shape
    if (Bk, Tk, Dk) != (B, T, D):
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in B, T or D")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"Hq={Hq} must be a positive multiple of Hk={Hk}")
    if kd is not None:
        if kd.shape != vd.shape:
            raise ValueError(f"kd {tuple(kd.shape)} and vd {tuple(vd.shape)} differ")
        if kd.shape[:3] != (B, Hk, T) or kd.shape[4] != D:
            raise ValueError(f"kd/vd {tuple(kd.shape)} must be [B, Hk, T, S, D] = [{B}, {Hk}, {T}, S, {D}]")
    if depth_grad_acc is not None and kd is None:
        raise ValueError("depth_grad_acc needs kd and vd")
    if depth_grad_acc is not None and not callable(depth_grad_acc):
        _check_acc(depth_grad_acc, kd, vd)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if not use_triton("moda_attn", q, k, v, kd, vd, supported=16 <= D <= 256 and D & (D - 1) == 0):
        return moda_attn_naive(q, k, v, kd, vd, scale)

    q, k, v = _query_layout(q), _unit_last(k), _unit_last(v)
    if kd is not None:
        kd, vd = _unit_last(kd), _unit_last(vd)
    if T == 0 or B == 0:
        o = q.new_zeros(q.shape)
        # keep the graph connected so backward returns zeros of the right shapes
        return o + 0 * q.sum() if q.requires_grad else o
    return _MoDAAttn.apply(q, k, v, kd, vd, scale, depth_grad_acc)
