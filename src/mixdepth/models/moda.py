"""MoDA: mixture-of-depths attention (papers 000/002; DESIGN section 4).

Every attention layer l lets the query at position t attend, in ONE softmax, to the causal sequence K/V of
layer l and to the depth K/V slots of the same position t written by earlier blocks. Per block the slots are,
in write order: the attention's own K/V (reused, no parameters), with ``extra`` an independent attention K/V
projection (Table 3 row 5), with ``ffn`` the K/V of a projection of the FFN input (Table 3 row 4, default).

Design choices (see the docstrings below for the why):

* "Light" FFN K/V projection = one GQA-sized K and V projection ``D -> Hk*hd`` each. Table 3 adds 36.7M
  parameters to a 36-layer D=1024, G=2 model: 35 x 2 x 1024 x 512 = 36.7M, i.e. exactly this projection in
  every block but the last (whose slot no layer reads). We likewise create a projection only where its
  slot is read.
* RoPE on depth keys: a slot lives at the query's own position t and q is rotated at t, so every depth key
  is rotated at t too (the reused attention K already is). Then q_t . k_t is position-free, exactly as if
  neither were rotated; an unrotated depth key would make the depth logits depend on absolute position.
* Depth slots live once in a preallocated buffer ``[n_slots, B, Hk, T, hd]`` (see ``DepthStore``); without
  autograd and with a depth window S, in a buffer of S + slots-per-block rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moda_attn import moda_attn, moda_attn_naive
from mixdepth.models.blocks import (
    Attention,
    RMSNorm,
    Rotary,
    SwiGLU,
    add_branch,
    branch_input,
    causal_mask,
    reference_attention,
)
from mixdepth.models.decoding import Decoder
from mixdepth.models.dense import DenseConfig, DenseLM, ModelConfigError

DEPTH_KV = ("attn", "attn+ffn", "attn+ffn+extra")


@dataclass(frozen=True)
class MoDAConfig(DenseConfig):
    arch: str = "moda"
    depth_kv: str = "attn+ffn"  # attn | attn+ffn | attn+ffn+extra (paper Table 3 rows 3-5)
    depth_window: int = 0  # S: each layer reads only the last S slots (paper Sec. 6.2); 0 = all

    def __post_init__(self):
        super().__post_init__()
        if self.depth_kv not in DEPTH_KV:
            raise ModelConfigError(f"model.depth_kv must be one of {', '.join(DEPTH_KV)}, got {self.depth_kv!r}")
        if self.depth_window < 0:
            raise ModelConfigError(f"model.depth_window must be >= 0 (0 = unbounded), got {self.depth_window}")

    # ---- slot layout --------------------------------------------------------------------------------
    @property
    def slot_kinds(self) -> tuple[str, ...]:
        """Slots one block writes, in write order: attention K/V, extra K/V (after attention), FFN K/V."""
        return (
            ("attn",) + (("extra",) if "extra" in self.depth_kv else ()) + (("ffn",) if "ffn" in self.depth_kv else ())
        )

    def slot_index(self, layer: int, kind: str) -> int:
        """Global write-order index of the ``kind`` slot of block ``layer``."""
        return layer * len(self.slot_kinds) + self.slot_kinds.index(kind)

    def depth_range(self, layer: int) -> tuple[int, int]:
        """Slots [lo, hi) that layer's attention reads: all written before it, or the last ``depth_window``."""
        hi = layer * len(self.slot_kinds)
        return (max(0, hi - self.depth_window) if self.depth_window else 0), hi

    def slot_is_read(self, layer: int, kind: str) -> bool:
        """Whether any later layer reads this slot (windows only move forward, so layer+1 decides)."""
        return layer + 1 < self.n_layers and self.slot_index(layer, kind) >= self.depth_range(layer + 1)[0]

    @property
    def n_slots(self) -> int:
        """Depth buffer size: every slot written before the last layer's attention."""
        return self.depth_range(self.n_layers - 1)[1]

    @property
    def live_slots(self) -> int:
        """Slots held at once without autograd: with a depth window S, S + slots per block (a layer's window and
        the block's own slots, written before its read), at most n_slots; all of them without a window."""
        if not self.depth_window:
            return self.n_slots
        return min(self.n_slots, self.depth_window + len(self.slot_kinds))

    def same_as_dense(self) -> str | None:
        return "no layer reads a depth slot" if self.n_slots == 0 else None

    def n_depth_proj(self) -> int:
        """Number of (extra or FFN) depth K/V projections actually built."""
        kinds = [k for k in self.slot_kinds if k != "attn"]
        return sum(self.slot_is_read(layer, k) for layer in range(self.n_layers) for k in kinds)

    # ---- parameters and FLOPs (DESIGN section 5) ----------------------------------------------------
    def depth_proj_params(self) -> int:
        return 2 * self.d_model * self.n_kv_heads * self.head_dim + (self.head_dim if self.qk_norm else 0)

    def n_params(self) -> dict[str, int]:
        n = super().n_params()
        extra = self.n_depth_proj() * self.depth_proj_params()
        return {k: v + extra for k, v in n.items()}

    def depth_flops_per_token(self) -> float:
        """Depth attention (QK and AV over the slots each layer reads) plus the depth K/V projections."""
        reads = sum(hi - lo for lo, hi in map(self.depth_range, range(self.n_layers)))
        attn = 4 * self.n_heads * self.head_dim * reads
        proj = self.n_depth_proj() * 2 * self.d_model * 2 * self.n_kv_heads * self.head_dim
        return attn + proj

    def flops_per_token(self) -> float:
        return super().flops_per_token() + self.depth_flops_per_token()


# ---- the depth buffer -------------------------------------------------------------------------------
def _slots(buf: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Slots [lo, hi) of a slot-major buffer ``[n_slots, B, H, T, hd]`` as a ``[B, H, T, hi-lo, hd]`` view."""
    return buf[lo:hi].permute(1, 2, 3, 0, 4)


def _alias(buf: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``_slots(buf, lo, hi)`` as a tensor sharing buf's storage but with its OWN autograd version counter.

    Writes of later slots go through ``buf`` (bumping only buf's counter), so a read saved for backward by
    an earlier layer's attention does not trip autograd's in-place check. That is sound because writes only
    touch slot indices >= hi of every read already made (slot write order = index order).
    """
    view = _slots(buf, lo, hi)
    return buf.new_empty(0).set_(buf.untyped_storage(), view.storage_offset(), view.shape, view.stride())


class SlotGrads:
    """The slot-gradient buffers dL/dk, dL/dv ``[n_slots, B, Hk, T, hd]`` (slot dtype), summed over each
    slot's reads. Allocated on the first request, which comes in the backward pass, after the head's logits
    and their gradient are freed: the buffers never add to the forward-time peak. Not zero-filled: a read's
    backward whose slots all lack a sum so far overwrites them (without a depth window the first request, the
    last layer's, covers every slot: no fill, no read of zeros); otherwise the slots new to it are zeroed and
    it adds."""

    def __init__(self, like_k: torch.Tensor, like_v: torch.Tensor, shape: tuple[int, ...]):
        self.shape, self.like = shape, (like_k, like_v)  # like_*: 0-element tensors (dtype, device)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.summed = [False] * shape[0]  # per slot: holds a sum (else garbage)

    def request(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Slots [lo, hi) of both buffers, ``[B, Hk, T, hi-lo, hd]`` each, for one read's gradient, and whether
        to add it (False: overwrite, no slot of the range holds a sum yet)."""
        self._alloc()
        new = [i for i in range(lo, hi) if not self.summed[i]]
        add = len(new) < hi - lo
        for i in new:
            if add:
                self.k[i].zero_()
                self.v[i].zero_()
            self.summed[i] = True
        return _slots(self.k, lo, hi), _slots(self.v, lo, hi), add

    def slot(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot i's summed gradients, contiguous ``[B, Hk, T, hd]`` each (zeros if no read's backward ran)."""
        self._alloc()
        if not self.summed[i]:
            self.k[i].zero_()
            self.v[i].zero_()
            self.summed[i] = True
        return self.k[i], self.v[i]

    def _alloc(self) -> None:
        if self.k is None:
            self.k, self.v = (t.new_empty(self.shape) for t in self.like)


class _SlotWrite(torch.autograd.Function):
    """Slot i := (k, v); returns a token (empty tensor) that every read of slot i takes as an input.

    Backward hands slot i's summed gradient to k and v, once per slot, as views of the gradient buffers.
    The sum is complete then: autograd runs a node only after all nodes consuming its outputs, i.e. after
    every read of slot i, and each read only after the attention that consumed it (which may have added
    into the buffers itself). This holds for every slot kind and ``depth_window``: a block writes its own
    slots and reads only slots of earlier blocks (``depth_range(l)`` ends at l's first slot), so a slot's
    readers are later layers, whose backward runs first.
    """

    @staticmethod
    def forward(ctx, store, i, k, v):
        ctx.set_materialize_grads(False)  # the token's gradient is always None
        store.k[i].copy_(k)  # contiguous slot: a plain copy when k is [B, Hk, T, hd] contiguous
        store.v[i].copy_(v)
        ctx.grad = None if store.grad is None else (store.grad, i)
        return k.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        if ctx.grad is None:  # handed out already: a second backward would re-add into the same sums
            raise RuntimeError("MoDA depth slots support one backward pass per forward pass")
        (grads, i), ctx.grad = ctx.grad, None
        return None, None, *grads.slot(i)  # [B, Hk, T, hd] contiguous


class _SlotRead(torch.autograd.Function):
    """A zero-copy read of slots [lo, hi). Backward adds (or writes, see ``SlotGrads``) its gradient for all
    hi-lo slots into the gradient buffers in one op per buffer (nothing when the kernel already did, in place:
    it then passes None) and returns nothing per slot: each slot's write hands the sum on."""

    @staticmethod
    def forward(ctx, store, lo, hi, *tokens):
        ctx.set_materialize_grads(False)
        ctx.grad = store.grad, lo, hi
        return _alias(store.k, lo, hi), _alias(store.v, lo, hi)  # [B, Hk, T, hi-lo, hd] each

    @staticmethod
    def backward(ctx, gkd, gvd):
        grads, lo, hi = ctx.grad
        if gkd is not None or gvd is not None:
            *bufs, add = grads.request(lo, hi)
            for buf, g in zip(bufs, (gkd, gvd), strict=True):
                if g is None:
                    if not add:
                        buf.zero_()
                elif add:
                    buf.add_(g)
                else:
                    buf.copy_(g)
        return (None,) * len(ctx.needs_input_grad)


class DepthStore:
    """Preallocated depth K/V buffers ``[rows, B, Hk, T, hd]``, each slot written once, read as views.

    With autograd on (training) the buffers hold every slot (rows = n_slots): memory is O(L) slots, each held
    once, and reads are strided prefix (or window) views handed to the attention (the Triton kernel reads them
    in place). Two gradient buffers of the same shape (``SlotGrads``, allocated in the backward pass) collect
    every read's depth gradient (one add or write per buffer and read, or none: the kernel does it in place),
    and each slot's write hands its sum on once: O(L) ops per step, not one per (slot, read). They use the slot
    dtype, not fp32: autograd summed these gradients in that dtype before (so no precision is lost; the kernel
    even adds its fp32 values with one rounding per read), and bf16 halves their memory and every read's add
    traffic.

    Without autograd (evaluation, prefill, generation) a slot is dead after its last read, so with a depth
    window S the buffers have only ``live`` = S + slots-per-block rows (paper Sec. 6.2): rows hold the slots
    ``base, base + 1, ...``; a write that finds no free row first moves the slots a later read may still need
    (from ``release``'s bound on) to the front. Reads stay views of one contiguous row range. Identical values:
    writes are the same copies, reads the same slots.

    The buffers are allocated on the first write (dtype and shape of that slot, which also decides the mode);
    ``allocations`` counts them (2). Slot-major: each slot is one contiguous ``[B, Hk, T, hd]`` block, the layout
    the compiled projections write k, v in, so a write is a plain copy, a slot's summed gradient is handed on as
    a contiguous tensor, and a read is a ``[B, Hk, T, S, hd]`` view with strides the kernels take as they are.
    """

    def __init__(self, n_slots: int, live: int | None = None):
        self.n_slots = n_slots
        self.live = n_slots if live is None else live  # rows without autograd
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.autograd = False  # decided by the first write
        self.grad: SlotGrads | None = None  # with autograd on
        self.tokens: list[torch.Tensor | None] = [None] * n_slots  # with autograd on
        self.written = [False] * n_slots
        self.src_k: list[torch.Tensor | None] = [None] * n_slots  # the tensors written (autograd on), for inspection
        self.src_v: list[torch.Tensor | None] = [None] * n_slots
        self.allocations = 0
        self.base = 0  # the slot in row 0 (without autograd)
        self.floor = 0  # no later read needs a slot below this one

    def release(self, lo: int) -> None:
        """No later read needs the slots below lo (read windows only move forward): without autograd their rows
        may be reused."""
        self.floor = max(self.floor, lo)

    @torch.compiler.disable  # aliasing storage is opaque to aot_autograd: run store ops eagerly, graph-break
    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, Hk, T, hd] into slot i."""
        if self.k is None:
            self.autograd = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
            shape = (self.n_slots if self.autograd else self.live, *k.shape)
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
            self.allocations += 2
            if self.autograd:
                self.grad = SlotGrads(k.new_empty(0), v.new_empty(0), shape)
        self.written[i] = True
        if self.autograd:
            self.tokens[i] = _SlotWrite.apply(self, i, k, v)
            self.src_k[i], self.src_v[i] = k, v
            return
        if i - self.base >= self.k.shape[0]:
            self._shift()
        if i - self.base >= self.k.shape[0]:
            raise RuntimeError(f"depth store: slot {i} does not fit {self.k.shape[0]} rows from slot {self.floor}")
        self.k[i - self.base].copy_(k)
        self.v[i - self.base].copy_(v)

    def _shift(self) -> None:
        """Moves the slots from ``floor`` on to the front rows, in order (a row is read before it is overwritten)."""
        s = self.floor - self.base
        for r in range(self.k.shape[0] - s):
            self.k[r].copy_(self.k[s + r])
            self.v[r].copy_(self.v[s + r])
        self.base = self.floor

    @torch.compiler.disable
    def read(self, lo: int, hi: int):
        """Slots [lo, hi) as ``[B, Hk, T, hi-lo, hd]`` views kd, vd of the buffers, and a function returning
        the matching views (gk, gv) of the gradient buffers and whether to add (``SlotGrads.request``; None
        without autograd; call it in the backward pass), into which an attention may add (or write) kd's and
        vd's gradients itself instead of returning them; (None, None, None) when empty."""
        if hi <= lo:
            return None, None, None
        assert all(self.written[lo:hi]), "reading an unwritten depth slot"
        if not self.autograd:
            assert lo >= self.base, "reading a released depth slot"
            return _slots(self.k, lo - self.base, hi - self.base), _slots(self.v, lo - self.base, hi - self.base), None
        grad = None if self.grad is None else partial(self.grad.request, lo, hi)
        return *_SlotRead.apply(self, lo, hi, *self.tokens[lo:hi]), grad


# ---- attention ----------------------------------------------------------------------------------------
def joint_attention(q, k, v, kd, vd, impl: str, depth_grad: Callable[[], tuple] | None = None) -> torch.Tensor:
    """One softmax over causal sequence K/V and same-position depth slots.

    q: [B, Hq, T, hd]; k, v: [B, Hk, T, hd]; kd, vd: [B, Hk, T, S, hd] or None -> [B, Hq, T, hd].
    ``impl='naive'``: the explicit fp32 reference ``moda_attn_naive`` (FLOP counting). Otherwise the
    ``moda_attn`` op, which picks its kernels or its reference itself; without slots (layer 0) SDPA's fused
    causal kernels. ``depth_grad``: a function returning (gk, gv, add), gk and gv shaped like kd, vd, into which
    the op's kernels add (or with add False write) kd's and vd's gradients in place (they then flow back as
    None); the references ignore it and return those gradients through autograd.
    """
    if impl == "naive":
        return moda_attn_naive(q, k, v, kd, vd)
    if kd is None:  # no depth slots (layer 0): plain causal attention
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return moda_attn(q, k, v, kd, vd, depth_grad_acc=depth_grad)


class DepthKV(nn.Module):
    """A depth K/V projection (FFN input or extra attention K/V): ``D -> Hk*hd`` each, RoPE at the slot's position."""

    def __init__(self, d_model: int, n_kv_heads: int, head_dim: int, qk_norm: bool):
        super().__init__()
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.wkv = nn.Linear(d_model, 2 * n_kv_heads * head_dim, bias=False)  # K rows, then V rows: one matmul
        self.k_norm = RMSNorm(head_dim) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor | None):
        """x: [B, T, D] -> k, v [B, Hk, T, hd]."""
        B, T, _ = x.shape
        k, v = self.wkv(x).view(B, T, 2, self.n_kv_heads, self.head_dim).unbind(2)  # [B, T, Hk, hd] each
        if self.k_norm is not None:
            k = self.k_norm(k)
        # the norm's fp32 weight can promote k under autocast; contiguous [B, Hk, T, hd] = the slot layout
        return rope(k, pos).to(v.dtype).transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


class MoDABlock(nn.Module):
    """Attention with depth slots + SwiGLU, ``norm`` pre or post as in blocks.Block; writes this block's slots."""

    def __init__(self, cfg: MoDAConfig, layer: int):
        super().__init__()
        c = cfg
        self.pre_norm, self.impl = c.norm == "pre", c.attn_impl
        self.attn = Attention(c)
        self.mlp = SwiGLU(c.d_model, c.d_ff)
        self.norm1, self.norm2 = RMSNorm(c.d_model), RMSNorm(c.d_model)
        self.reads = c.depth_range(layer)
        # slot index per kind, None when no later layer reads it (then it is neither built nor written)
        self.slot = {k: c.slot_index(layer, k) if c.slot_is_read(layer, k) else None for k in c.slot_kinds}
        kv = lambda: DepthKV(c.d_model, c.n_kv_heads, c.head_dim, c.qk_norm)  # noqa: E731
        self.extra_kv = kv() if self.slot.get("extra") is not None else None
        self.ffn_kv = kv() if self.slot.get("ffn") is not None else None
        # the previous block's FFN slot, written by this block (its K/V arrive as ``pending``)
        prev_ffn = layer > 0 and "ffn" in c.slot_kinds and c.slot_is_read(layer - 1, "ffn")
        self.prev_ffn = c.slot_index(layer - 1, "ffn") if prev_ffn else None

    def _write(self, store: DepthStore, k, v, extra: tuple | None, pending: tuple | None) -> None:
        """This block's slots (attention K/V, extra K/V) and the previous block's FFN slot (``pending``)."""
        for i, kv in ((self.prev_ffn, pending), (self.slot["attn"], (k, v)), (self.slot.get("extra"), extra)):
            if i is not None:
                store.write(i, *kv)

    def pre(self, x: torch.Tensor, rope: Rotary, pos: torch.Tensor | None):
        """The attention's inputs: x [B, T, D] -> q [B, T, Hq, hd], k, v [B, Hk, T, hd], extra K/V or None."""
        h = branch_input(x, self.norm1, self.pre_norm)
        q, k, v = self.attn.qkv(h, rope, pos)
        extra = self.extra_kv(h, rope, pos) if self.extra_kv is not None else None
        # QK-norm's fp32 weight can promote q, k under autocast. q as contiguous [B, T, Hq, hd], the projections'
        # layout (a contiguous output: compiled code takes its gradient as it comes): the attention's output, in
        # q's layout, then feeds wo and its gradient comes back without transposing copies. k, v contiguous
        # [B, Hk, T, hd], the slot layout: the compiled code writes them so (fused with RoPE, or one copy of v),
        # each slot write is then a plain copy, and their gradients meet the slots' in one layout.
        return q.to(v.dtype).transpose(1, 2).contiguous(), k.to(v.dtype).contiguous(), v.contiguous(), extra

    @torch.compiler.disable  # the store's aliased views and in-place gradient adds are opaque to aot_autograd
    def attend(self, store: DepthStore, q, k, v, extra, pending, cache: tuple | None = None, start: int = 0):
        """Slot writes (this block's, and the previous block's FFN slot ``pending``), then joint attention over
        k, v and the slots this block reads -> y [B, Hq, T, hd]: the eager island between compiled regions. Every
        per-block integer (slot indices, read range) is used only in here, so the compiled code around it is the
        same for all blocks (no recompilation per block). Writing before reading is safe: a block reads only
        slots written by earlier blocks (``depth_range``). q: [B, T, Hq, hd]. With ``cache`` = (k_cache, v_cache)
        [B, Hk, T_max, hd], q holds positions start..start+T-1 and attends over the cached prefix."""
        q = q.transpose(1, 2)  # [B, Hq, T, hd] view
        store.release(self.reads[0])
        self._write(store, k, v, extra, pending)
        kd, vd, dkv = store.read(*self.reads)
        if cache is None:
            return joint_attention(q, k, v, kd, vd, self.impl, dkv)
        kc, vc = cache
        T, P = q.shape[2], start + q.shape[2]
        kc[:, :, start:P], vc[:, :, start:P] = k, v
        return reference_attention(q, kc[:, :, :P], vc[:, :, :P], causal_mask(T, P, q.device), kd, vd)

    def post(self, x: torch.Tensor, y: torch.Tensor, rope: Rotary, pos: torch.Tensor | None):
        """Output projection, residual and FFN: (x, y [B, Hq, T, hd]) -> (x [B, T, D], FFN slot K/V or None)."""
        B, T, D = x.shape
        x = add_branch(x, self.attn.wo(y.transpose(1, 2).reshape(B, T, D)), self.norm1, self.pre_norm)
        h = branch_input(x, self.norm2, self.pre_norm)  # the FFN input, projected into this block's FFN slot
        pending = self.ffn_kv(h, rope, pos) if self.ffn_kv is not None else None
        return add_branch(x, self.mlp(h), self.norm2, self.pre_norm), pending


class MoDALM(Decoder, DenseLM):
    """Decoder-only LM with MoDA attention. forward(idx [B, T], targets=None) -> logits [B, T, V] or loss."""

    cfg: MoDAConfig

    def make_block(self, layer: int) -> nn.Module:
        return MoDABlock(self.cfg, layer)

    def trunk(self, idx: torch.Tensor, cache: list | None = None, start: int = 0):
        """idx [B, T] -> (final hidden [B, T, D] before the norm, the DepthStore of this pass).

        Between two attentions runs ONE function, ``_between`` (block l's output projection and FFN, then block
        l+1's Q/K/V), and ``_first`` (embedding, block 0's Q/K/V) before the first: each residual stream x is
        made and first read in one function, so under ``compile`` its gradient sums inside compiled code."""
        store = DepthStore(self.cfg.n_slots, self.cfg.live_slots)
        pos = None
        if cache is not None:
            pos = torch.arange(start, start + idx.shape[1], device=idx.device).expand(idx.shape[0], -1)  # [B, T]
        x, qkv = self._first(idx, pos)
        pending = None
        for i, block in enumerate(self.blocks):
            y = block.attend(store, *qkv, pending, None if cache is None else cache[i], start)
            nxt = self.blocks[i + 1] if i + 1 < len(self.blocks) else None
            x, pending, qkv = self._between(block, nxt, x, y, pos)
        return x, store

    def _first(self, idx: torch.Tensor, pos: torch.Tensor | None):
        x = self.embed_tokens(idx)  # [B, T, D]
        return x, self.blocks[0].pre(x, self.rope, pos)

    def _between(self, block: MoDABlock, nxt: MoDABlock | None, x, y, pos):
        """Block output (x, FFN slot K/V), then the next block's attention inputs (None after the last)."""
        x, pending = block.post(x, y, self.rope, pos)
        return x, pending, None if nxt is None else nxt.pre(x, self.rope, pos)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.head_loss(self.trunk(idx)[0], targets)

    REGIONS = ("_first", "_between", "head_loss")

    def compile(self, *args, scope: str = "block", **kwargs) -> None:
        """torch.compile the code between attentions (``REGIONS``: ``_first``, ``_between``, the head with the
        loss) at either ``scope``, never the whole forward: the attention of every block is an eager island (a graph
        break), and dynamo runs a frame whose loop body breaks the graph wholly eagerly. The loop over blocks stays
        in Python; the compiled ``_between`` is shared by all blocks (blocks are arguments, their parameters graph
        inputs)."""
        super().compile(*args, scope="block" if scope == "model" else scope, **kwargs)

    # ---- decoding (Decoder) -------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) sequence caches [B, Hk, max_len, hd]; depth slots are never cached (in-flight)."""
        c, w = self.cfg, self.embed.weight
        shape = (batch, c.n_kv_heads, max_len, c.head_dim)
        return [(w.new_zeros(shape), w.new_zeros(shape)) for _ in range(c.n_layers)]

    def prefill(self, idx: torch.Tensor, cache: list) -> torch.Tensor:
        """Prompt idx [B, T0] at positions 0..T0-1, filling ``cache`` -> logits [B, T0, V]."""
        return self.head_loss(self.trunk(idx, cache, 0)[0])

    def decode_step(self, tok: torch.Tensor, pos: int, cache: list) -> torch.Tensor:
        """tok [B, 1] at position ``pos`` over the cached prefix -> logits [B, V]."""
        return self.head_loss(self.trunk(tok, cache, pos)[0])[:, 0]
