"""Causal sequence attention with its log-sum-exp, on the fused kernels torch ships.

MoDA's joint softmax splits exactly at the log-sum-exp (see kernel.py): the sequence part is plain causal
attention, so it runs on the fastest kernel available, and the depth kernels merge into its output. Its
backward is then called with the JOINT output and log-sum-exp: a flash-style backward recomputes
``P = exp(scale q.k - lse)`` and uses ``delta = rowsum(dO * O)``, so given the joint ``lse`` and ``O`` it
returns exactly the sequence part of the joint gradients (dq's sequence share, dk, dv).

Backends (private ATen ops of ``F.scaled_dot_product_attention``; all return ``lse`` in natural-log units of
the scaled logits):

* ``cudnn``: CUDA, fp16/bf16, head dim <= 128; GQA native. The default on Hopper and newer.
* ``flash``: CUDA, fp16/bf16, Ampere or newer; GQA native. The default on Ampere.
* ``efficient``: CUDA, fp32 or pre-Ampere GPUs (memory-efficient kernel; K/V expanded to the query heads).
* ``cpu``: the CPU flash kernel (K/V expanded); used by the tests under the Triton interpreter.
"""

from __future__ import annotations

import torch

BACKENDS = ("cudnn", "flash", "efficient", "cpu")
_override: str | None = None
aten = torch.ops.aten


def set_backend(name: str | None) -> None:
    """Force a sequence backend (tests, benchmarks); ``None`` restores the automatic choice."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown sequence backend {name!r}; one of {', '.join(BACKENDS)}")
    global _override
    _override = name


def backend_for(q: torch.Tensor) -> str:
    """The sequence backend for queries q [B, Hq, T, D]: the forced one (``set_backend``), else ``choose``'s."""
    if _override is not None:
        return _override
    if q.device.type != "cuda":
        return "cpu"
    major, _ = torch.cuda.get_device_capability(q.device)
    return choose(major, q.dtype, q.shape[2], q.shape[-1], torch.backends.cudnn.is_available())


def choose(major: int, dtype: torch.dtype, T: int, D: int, cudnn: bool) -> str:
    """The fastest CUDA backend that takes the shape, for compute capability ``major``, T positions, head dim D.

    cuDNN refuses s_q = s_kv = 1 ("cuDNN Frontend error: s_q = s_kv = 1 is not supported", cuDNN 9.19 with
    torch 2.11 on an H200, in the backward), and a process whose cuDNN call failed so segfaulted on its next
    one: such shapes never reach it. Probed on that H200 (bf16; B 1-2, G 1/2/4, D 64/128, T in 1-9, 15-17,
    31-33, 63-65, 127-129, 255-257; forward and backward): T = 1 was the only refusal, and no other shape gave
    non-finite or wrong results. Flash takes every T.
    """
    if dtype == torch.float32 or major < 8:  # flash and cuDNN attention need fp16/bf16 and Ampere or newer
        return "efficient"
    if major >= 9 and D <= 128 and T > 1 and cudnn:
        return "cudnn"  # the fastest on Hopper (BENCHMARKS.md: 1.6x flash's fwd+bwd on an H200)
    return "flash"


def like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """t in ref's layout (same shape): t itself when the strides match, else a copy."""
    if t.stride() == ref.stride():
        return t
    return torch.empty_strided(ref.shape, ref.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _expand(t: torch.Tensor, G: int) -> torch.Tensor:
    return t if G == 1 else t.repeat_interleave(G, 1)


def _reduce(g: torch.Tensor, G: int) -> torch.Tensor:
    """Sum the gradient of K/V expanded to Hq heads back over each group: [B, Hk*G, T, D] -> [B, Hk, T, D]."""
    return g if G == 1 else g.unflatten(1, (-1, G)).sum(2)


def seq_fwd(q, k, v, scale: float, backend: str):
    """q [B, Hq, T, D], k/v [B, Hk, T, D] with a unit last stride (e.g. views of [B, T, H, D])
    -> (o [B, Hq, T, D] in q's layout, lse [B, Hq, T] fp32 contiguous, aux)."""
    B, Hq, T, _ = q.shape
    G = Hq // k.shape[1]
    if backend == "cudnn":
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        o, lse, aux = r[0], r[1], (r[2], r[3], r[4], r[5], r[6], r[7])
    elif backend == "flash":
        r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        o, lse, aux = r[0], r[1], (r[2], r[3], r[4], r[5], r[6], r[7])
    elif backend == "efficient":
        o, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, _expand(k, G), _expand(v, G), None, True, 0.0, True, scale=scale
        )
        aux = (seed, offset, lse.shape[-1])  # its lse rows are padded (to a multiple of 32)
        lse = lse[..., :T]
    elif backend == "cpu":
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, _expand(k, G), _expand(v, G), 0.0, True, scale=scale
        )
        aux = ()
    else:
        raise ValueError(f"unknown sequence backend {backend!r}")
    return like(o, q), lse.reshape(B, Hq, T).contiguous(), aux


def seq_bwd(do, q, k, v, o, lse, aux, scale: float, backend: str):
    """Gradients of the sequence part given the (joint) output o and lse [B, Hq, T] -> dq, dk, dv."""
    G = q.shape[1] // k.shape[1]
    if backend == "cudnn":
        cq, ck, mq, mk, seed, offset = aux
        return aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse.unsqueeze(-1), seed, offset, None, cq, ck, mq, mk, 0.0, True, scale=scale
        )
    if backend == "flash":
        cq, ck, mq, mk, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale
        )
    ke, ve = _expand(k, G), _expand(v, G)
    if backend == "efficient":
        seed, offset, padded = aux
        lse_p = lse.new_zeros(*lse.shape[:2], padded)
        lse_p[..., : lse.shape[-1]] = lse
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, ke, ve, None, o, lse_p, seed, offset, 0.0, [True, True, True, False], True, scale=scale
        )
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, ke, ve, o, lse, 0.0, True, scale=scale
        )
    return dq, _reduce(dk, G), _reduce(dv, G)
