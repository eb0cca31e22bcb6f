"""Public grouped expert SwiGLU MLP (MoE / MoDE expert layer) with autograd.

Pipeline (all on the device, no host sync in forward or backward):

1. ``build_routing``: stable sort of the assignments by expert (no-op experts last), per-expert row offsets
   by ``searchsorted``, a ``tile -> (expert, first row)`` schedule of static size
   ``cdiv(M, BM) + min(E, M)``, and the token CSR (``kernels.common.segments.build_segments``).
2. Grouped GEMM 1 with the token gather fused into its A loads and a SwiGLU epilogue: pre-activations
   ``a = x W1``, ``b = x W3`` and ``h = silu(a) * b`` per sorted row.
3. Grouped GEMM 2: ``y = h W2`` per sorted row.
4. Router-weighted scatter back: the segmented reduction (``kernels.common.segments.segment_sum``) over the
   token CSR, ``out[t] = sum_r w_r y_r``: fp32, one write per token row, repeated tokens without atomics,
   deterministic; tokens without a real assignment get 0.

Saved for backward: the routing view, x, the weights, a and b (``[M, F]`` each, dtype of x) and y
(``[M, D]``, for the router-weight gradient). h is not saved: the backward kernels recompute it from a, b
in their loads (forward computes h from the rounded a, b too, so both agree bit for bit).

Backward: ``dy_r = w_r dout[t_r]`` and ``dweight_r = <y_r, dout[t_r]>`` (``kernels.common.scatter_backward``);
``dh = dy W2^T`` with the SwiGLU backward in its epilogue (da, db);
``dx_r = da W1^T + db W3^T`` summed per token by ``segment_sum``; ``dW1 = X^T da``, ``dW3 = X^T db``,
``dW2 = h^T dy`` as per-expert reductions over each expert's rows.

Triton or reference by ``kernels.common.dispatch.use_triton``: the kernels on CUDA tensors or under the
interpreter (bfloat16 refused there), ``naive.py`` on a plain CPU.
"""

from __future__ import annotations

import torch

from kernels.common.dispatch import HAS_TRITON, use_triton
from kernels.grouped_mlp import naive

if HAS_TRITON:
    from kernels.common.scatter_backward import scatter_add_backward
    from kernels.common.segments import segment_sum
    from kernels.grouped_mlp import kernel as _k

__all__ = ["grouped_swiglu"]


class _GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, w2, token_idx, expert_idx, weight):
        n, d = x.shape
        n_exp, _, f = w1.shape
        rt = _k.build_routing(token_idx, expert_idx, weight, n, n_exp, _k.CONFIG.block_ms(x.dtype))
        a, b, h = _k.gmm(1, x, w1, rt, f, gather=True, n_tok=n, b2=w3, site="fwd_up")  # [M, F] each
        (y,) = _k.gmm(0, h, w2, rt, d, site="fwd_down")  # [M, D]
        out = segment_sum(None, y, rt.w, rt.seg_order, rt.seg, x.dtype)  # [N, D]
        ctx.rt = rt
        ctx.save_for_backward(x, w1, w3, w2, a, b, y, weight)
        return out

    @staticmethod
    def backward(ctx, dout):  # dout [N, D]
        x, w1, w3, w2, a, b, y, weight = ctx.saved_tensors
        rt = ctx.rt
        n, d = x.shape
        n_exp, _, f = w1.shape
        need_x, need_w1, need_w3, need_w2, _, _, need_w = ctx.needs_input_grad
        dx = dw1 = dw3 = dw2 = dweight = None
        dout = dout.contiguous()
        dys, dws = scatter_add_backward(dout, rt.tok, y, rt.w, True, need_w)  # [M, D], [M]
        if need_w:  # no-op rows (tok -1) never had y written; the kernel reads nothing there (dw 0)
            dweight = torch.empty_like(weight).index_copy_(0, rt.perm, dws)
        if need_w2:
            (dw2,) = _k.wgrad(1, a, dys, rt, n_exp, w2.dtype, e2=b, site="bwd_dw2")  # [E, F, D]
        if need_x or need_w1 or need_w3:
            da, db = _k.gmm(2, dys, w2.transpose(1, 2), rt, f, e1=a, e2=b, site="bwd_dh")  # [M, F] each
            if need_x:
                w1t, w3t = w1.transpose(1, 2), w3.transpose(1, 2)
                (dxs,) = _k.gmm(3, da, w1t, rt, d, a2=db, b2=w3t, site="bwd_dx")  # [M, D]
                dx = segment_sum(None, dxs, None, rt.seg_order, rt.seg, x.dtype)  # [N, D]
            if need_w1 or need_w3:
                dw1, dw3 = _k.wgrad(0, x, da, rt, n_exp, w1.dtype, q2=db, n_tok=n, site="bwd_dw13")  # [E, D, F]
        return dx, dw1, dw3, dw2, None, None, dweight


def _validate(x, w1, w3, w2, token_idx, expert_idx, weight, check: bool | None) -> None:
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got {tuple(x.shape)}")
    n, d = x.shape
    if w1.dim() != 3 or w1.shape[0] < 1 or w1.shape[1] != d:
        raise ValueError(f"w1 must be [E, {d}, F] with E >= 1, got {tuple(w1.shape)}")
    n_exp, _, f = w1.shape
    if w3.shape != w1.shape:
        raise ValueError(f"w3 must be {tuple(w1.shape)}, got {tuple(w3.shape)}")
    if w2.shape != (n_exp, f, d):
        raise ValueError(f"w2 must be {(n_exp, f, d)}, got {tuple(w2.shape)}")
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} dtype {w.dtype} != x dtype {x.dtype}")
    for name, idx in (("token_idx", token_idx), ("expert_idx", expert_idx)):
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be int64 (or int32), got {idx.dtype}")
        if idx.dim() != 1:
            raise ValueError(f"{name} must be [M], got {tuple(idx.shape)}")
    m = token_idx.shape[0]
    if expert_idx.shape[0] != m or weight.shape != (m,):
        raise ValueError(f"token_idx, expert_idx, weight must all be [M]: {m}, {expert_idx.shape}, {weight.shape}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point, got {weight.dtype}")
    if any(t.device != x.device for t in (w1, w3, w2, token_idx, expert_idx, weight)):
        raise ValueError("all inputs must be on one device")
    if check or (check is None and not token_idx.is_cuda):
        real = (expert_idx >= 0) & (expert_idx < n_exp)
        bad = real & ((token_idx < 0) | (token_idx >= n))
        if bool(bad.any()):
            raise ValueError(f"token_idx out of range [0, {n}) for a real expert assignment")


def grouped_swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    token_idx: torch.Tensor,
    expert_idx: torch.Tensor,
    weight: torch.Tensor,
    *,
    check: bool | None = None,
) -> torch.Tensor:
    """Router-weighted sum of SwiGLU experts over token -> expert assignments.

    ``out[t] = sum_{a: token_idx[a] == t} weight[a] * (silu(x[t] @ w1[e]) * (x[t] @ w3[e])) @ w2[e]`` with
    ``e = expert_idx[a]``. Works for token choice (top-k: M = N * k, repeated tokens) and expert choice
    (M = E * capacity; tokens may get no assignment, their row is 0).

    No-op experts: an assignment with ``expert_idx == -1`` or ``>= E`` is skipped (zero FLOPs, no
    contribution, its ``weight`` gradient is 0 and its token index is not checked). A real gradient path
    through the router probability of a no-op expert, if wanted, belongs to the caller's mixing formula.

    Gradients: x, w1, w3, w2 and weight (``dweight[a] = <y_e(x_t), dout[t]>``); indices get none.
    Accumulation is fp32 everywhere; outputs and gradients are rounded once to their input dtype.

    Args:
        x: ``[N, D]`` tokens (fp32 / fp16 / bf16).
        w1: ``[E, D, F]`` gate projection; w3: ``[E, D, F]`` up projection; w2: ``[E, F, D]`` down
            projection; all of x's dtype.
        token_idx: ``[M]`` int64 (or int32) token of each assignment, in ``[0, N)``.
        expert_idx: ``[M]`` int64 (or int32) expert of each assignment (-1 / ``>= E``: no-op).
        weight: ``[M]`` router weight of each assignment (fp32 recommended; any float dtype).
        check: range-check token_idx (ValueError); None checks CPU tensors only, True forces a host sync
            on CUDA. Unchecked out-of-range tokens read as zero rows and are never written.

    Returns:
        ``out [N, D]`` in x's dtype.
    """
    _validate(x, w1, w3, w2, token_idx, expert_idx, weight, check)
    if not use_triton("grouped_swiglu", x, w1, w3, w2, weight):
        return naive.grouped_swiglu_naive(x, w1, w3, w2, token_idx, expert_idx, weight)
    return _GroupedSwiGLU.apply(
        x.contiguous(),
        w1.contiguous(),
        w3.contiguous(),
        w2.contiguous(),
        token_idx.to(torch.int64).contiguous(),
        expert_idx.to(torch.int64).contiguous(),
        weight.contiguous(),
    )
