"""Public fused linear + cross-entropy (every family's LM loss) with its gradients computed in the forward.

``loss = mean_i(lse(x_i W^T) - (x_i W^T)[t_i])`` without the ``[N, V]`` logits ever existing in full. For row
chunks of x (``kernel.CONFIG.chunk_rows``: a chunk's logits in at most ``chunk_bytes``, 1 GiB):

1. ``z = x_c @ W^T`` by cuBLAS in the compute dtype (autocast's, as ``F.linear`` would use, else x's);
2. one Triton kernel (``kernel.ce_rows``) computing each row's max and log-sum-exp over V in fp32, its loss,
   and overwriting z in place with the logit gradient ``(softmax - onehot) / n_valid``;
3. ``dx_c = z @ W`` (rounded once to x's dtype) and ``dW += z^T x_c`` (fp32 accumulator over the chunks,
   rounded once to W's dtype at the end).

The per-row losses are summed in fp32. Backward only scales the saved ``dx``, ``dW`` by the upstream scalar.
Without grad mode (evaluation), or for inputs that need none, the gradient pass and matmuls are skipped.
Same roundings as the unfused bf16 path (logits rounded by the matmul, read as fp32, gradient rounded once to
the logits dtype), three matmuls of ``2 N D V`` FLOPs as before: all in the forward now.

The chunked function is a ``torch.library.custom_op`` (``mixdepth::linear_cross_entropy``) with a fake
(meta) implementation and a registered backward: opaque to dynamo and Inductor (no graph break, no
recompile, capturable in CUDA graphs: no host sync), and visible to ``FlopCounterMode`` through a registered
formula counting the matmuls it runs.

Triton or reference by ``kernels.common.dispatch.use_triton``: the fused op on CUDA tensors or under the
interpreter (bfloat16 refused there), ``naive.py`` on a plain CPU (bit for bit the models' loss before the op),
for float64, and for vocabularies below ``FUSE_MIN_VOCAB``.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from kernels.common import dispatch
from kernels.common.dispatch import HAS_TRITON, use_triton
from kernels.linear_ce import naive

if HAS_TRITON:
    from kernels.linear_ce import kernel as _k

__all__ = ["linear_cross_entropy"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # compute dtypes of the fused path
# Smaller vocabularies take the reference, which compiled code fuses with the head (a byte model's logits, 256 per
# token, are smaller than its hidden states: nothing to save, and an opaque op would keep Inductor from fusing).
FUSE_MIN_VOCAB = 8192


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``, fp32 accumulation rounded once to out's dtype."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    elif a.is_cuda and out.dtype == torch.float32:
        torch.mm(a, b, torch.float32, out=out)  # 16-bit inputs, fp32 output (torch >= 2.8, CUDA)
    else:
        out.copy_(a.float() @ b.float())


def _mm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into the fp32 accumulator, the 16-bit products summed in fp32."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _chunked(x, weight, targets, compute_dtype, ignore_index, mean, need_dx, need_dw):
    """The fused forward (see the module docstring): ``(loss, dx, dW)``, the gradients of the loss (empty when
    not needed)."""
    n, d = x.shape
    v = weight.shape[0]
    w = weight.to(compute_dtype)  # [V, D]
    count = (targets != ignore_index).sum()
    scale = count.to(torch.float32).reciprocal() if mean else torch.ones((), device=x.device)
    rows = _k.CONFIG.chunk_rows(n, v, w.element_size())
    z_buf = torch.empty((rows, v), dtype=compute_dtype, device=x.device)  # one chunk's logits, reused
    losses = torch.empty(n, dtype=torch.float32, device=x.device)  # [N] per row, fp32
    dx = torch.empty((n, d), dtype=x.dtype, device=x.device) if need_dx else x.new_empty(0)
    dw = torch.zeros((v, d), dtype=torch.float32, device=x.device) if need_dw else None
    for s in range(0, n, rows):
        xc = x[s : s + rows].to(compute_dtype)  # [R, D]
        r = xc.shape[0]
        z = torch.mm(xc, w.T, out=z_buf[:r])  # [R, V]
        _k.ce_rows(z, targets[s : s + r], losses[s : s + r], scale, ignore_index, need_dx or need_dw)
        if need_dx:
            _mm_into(dx[s : s + r], z, w)  # [R, D]
        if need_dw:
            _mm_acc(dw, z.T, xc)  # [V, D]
    loss = losses.sum()
    loss = loss / count if mean else loss
    return loss, dx, dw.to(weight.dtype) if dw is not None else weight.new_empty(0)


@torch.library.custom_op("mixdepth::linear_cross_entropy", mutates_args=())
def _fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    compute_dtype: torch.dtype,
    ignore_index: int,
    mean: bool,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the matmuls run in compute_dtype as given: autocast (still on where the op is called eagerly) must not
    # recast them, nor the fp32 accumulator
    with torch.autocast(x.device.type, enabled=False):
        return _chunked(x, weight, targets, compute_dtype, ignore_index, mean, need_dx, need_dw)


@_fused.register_fake
def _(x, weight, targets, compute_dtype, ignore_index, mean, need_dx, need_dw):
    loss = x.new_empty((), dtype=torch.float32)
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0)
    return loss, dx, weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)


def _setup_context(ctx, inputs, output) -> None:
    _, dx, dw = output
    ctx.mark_non_differentiable(dx, dw)
    ctx.save_for_backward(dx, dw)


def _backward(ctx, g_loss, _g_dx, _g_dw):
    dx, dw = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    return (dx * g_loss) if need_x else None, (dw * g_loss) if need_w else None, None, None, None, None, None, None


_fused.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.mixdepth.linear_cross_entropy)
def _flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """The matmuls the op runs: the logits, and dx and dW when they are computed (in the forward)."""
    need_dx, need_dw = args[-2:]
    return 2 * x_shape[0] * x_shape[1] * w_shape[0] * (1 + need_dx + need_dw)


def _validate(x, weight, targets, ignore_index: int, reduction: str, check: bool | None) -> None:
    if not x.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"x and weight must be floating point, got {x.dtype}, {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [N, D] and weight [V, D], got {tuple(x.shape)}, {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (class), got [0, D]")
    if targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64, got {targets.dtype}")
    if targets.shape != x.shape[:1]:
        raise ValueError(f"targets must be [{x.shape[0]}], got {tuple(targets.shape)}")
    if weight.device != x.device or targets.device != x.device:
        raise ValueError(f"x, weight, targets must be on one device: {x.device}, {weight.device}, {targets.device}")
    if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"weight dtype {weight.dtype} != x dtype {x.dtype} (outside autocast)")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if check or (check is None and not targets.is_cuda and not torch.compiler.is_compiling()):
        v = weight.shape[0]
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= v))
        if bool(bad.any()):
            raise ValueError(f"target out of range [0, {v}) (and not ignore_index={ignore_index})")


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    check: bool | None = None,
) -> torch.Tensor:
    """Cross-entropy of the logits ``x @ weight.T`` against ``targets``, without materialising the logits.

    Equals ``F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=..., reduction=...)``: the
    matmuls run in autocast's dtype where autocast is on (as ``F.linear``), else in x's; the softmax in fp32.
    Gradients reach x and weight (a weight tied to an embedding gets the sum of both, by autograd).

    Args:
        x: ``[N, D]`` hidden states (fp32 / fp16 / bf16; float64 runs the reference).
        weight: ``[V, D]`` output projection; x's dtype unless autocast is on.
        targets: ``[N]`` int64 classes in ``[0, V)``, or ``ignore_index``.
        ignore_index: target value of rows with neither loss nor gradient.
        reduction: ``mean`` over the rows not ignored (NaN when all are), or ``sum``.
        check: range-check targets (ValueError); None checks CPU tensors only (and not while compiling), True
            forces a host sync on CUDA. An unchecked out-of-range target gives a wrong loss, never a bad
            memory access.

    Returns:
        The scalar loss, fp32 (float64 for float64 inputs).
    """
    _validate(x, weight, targets, ignore_index, reduction, check)
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if weight.shape[0] < FUSE_MIN_VOCAB or not use_triton("linear_cross_entropy", x, weight, supported=dt in _DTYPES):
        return naive.linear_cross_entropy_naive(x, weight, targets, ignore_index=ignore_index, reduction=reduction)
    if dispatch.INTERPRET and dt == torch.bfloat16:
        raise TypeError("linear_cross_entropy: bfloat16 autocast is not supported under the Triton interpreter")
    grad = torch.is_grad_enabled()
    loss, _, _ = _fused(
        x.contiguous(),
        weight,
        targets.contiguous(),
        dt,
        ignore_index,
        reduction == "mean",
        grad and x.requires_grad,
        grad and weight.requires_grad,
    )
    return loss
