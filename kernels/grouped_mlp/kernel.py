"""Triton kernels for the grouped expert SwiGLU MLP (tokens grouped by expert, grouped GEMMs).

Layout: the M assignments are stably sorted by expert (no-op experts, index -1 or ``>= E``, sorted last and
never computed); "sorted rows" below are positions in that order, expert e owning rows
``[off[e], off[e + 1])``. A tile schedule maps each GEMM program to ``(expert, first row)``; it is built on
the device (no host sync) with a static upper bound on the number of tiles, surplus programs exit at once.

Two kernels:

- ``_gmm_kernel``: row-grouped GEMM ``C[r] = A[r] @ B[e(r)]`` over (tile, column block) programs, with the
  A rows optionally gathered from ``x`` through the token index (the routed gather is fused into the GEMM
  loads, so ``x`` is never copied into expert order). Epilogues (constexpr ``EPI``):
  0 plain store (``y = h @ W2``); 1 SwiGLU forward (``A @ W1``, ``A @ W3`` in one pass over A, stores the
  pre-activations a, b and ``h = silu(a) * b``); 2 SwiGLU backward (``dh = dy @ W2^T``, then
  ``da = dh * b * silu'(a)``, ``db = dh * silu(a)``); 3 sum of two products (``dx = da @ W1^T + db @ W3^T``).
  The epilogue runs on column sub-tiles of ``EPI_N`` (the accumulator halved by reshape / split): each
  sub-tile's loads, math and stores are live alone, so the two extra tiles of EPI 2 do not spill.
- ``_wgrad_kernel``: per-expert reduction over that expert's rows (a grouped "transposed" GEMM) for
  ``dW1 = X^T da``, ``dW3 = X^T db`` (MODE 0, both from one pass over the gathered X) and
  ``dW2 = h^T dy`` (MODE 1, h recomputed from the saved a, b). Every element of dW is written (experts with
  no rows get 0).

Both run on a 1-D grid in grouped order (``_swizzle``): programs sweep the column blocks of ``group_m`` row
tiles (dW row blocks) before the next group, so the row operands are re-read from L2, not from DRAM, by the
programs of the other column blocks.

Accumulation is fp32 everywhere; fp32 inputs use IEEE dots (exact reference path), 16-bit inputs the tensor
cores. Pointer arithmetic only (no ``tl.make_block_ptr``), int64 row offsets: Triton 3.6 and 3.9. Token
indices outside ``[0, N)`` read as zero rows (memory safe); range checks live in ``op.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace

import torch
import triton
import triton.language as tl

from kernels.common.launch import dot_precision
from kernels.common.segments import build_segments

__all__ = ["SITES", "GmmConfig", "Routing", "build_routing", "gmm", "wgrad"]

# Launch sites of op.py: gmm epilogues 1 (x -> a, b, h), 0 (h -> y), 2 (dy -> da, db), 3 (da, db -> dx), then
# wgrad modes 1 (dW2) and 0 (dW1, dW3).
SITES: tuple[str, ...] = ("fwd_up", "fwd_down", "bwd_dh", "bwd_dx", "bwd_dw2", "bwd_dw13")


@dataclass(frozen=True)
class GmmConfig:
    """Tile sizes (powers of two, >= 16 for ``tl.dot``) and launch knobs; the uniform fields are the fp32 and
    fallback tiles.

    ``sites`` overrides fields per launch site (``SITES``) for 16-bit inputs, e.g. ``{"bwd_dx": {"block_n":
    256}}``; ``python -m kernels.grouped_mlp.tune`` prints a tuned ``CONFIG``. fp32 inputs use the uniform fields.
    """

    block_m: int = 128  # rows per tile of the row-grouped GEMMs (also the schedule granularity)
    block_n: int = 128
    block_k: int = 64
    wgrad_p: int = 128  # dW tile rows
    wgrad_q: int = 128  # dW tile columns
    wgrad_k: int = 64  # sorted rows per reduction step
    group_m: int = 8  # row tiles (dW row blocks) per group of the program order (see _swizzle)
    epi_n: int = 32  # columns per epilogue sub-tile of the row-grouped GEMMs (>= block_n: no split)
    num_warps: int = 8
    num_stages: int = 3
    maxnreg: int = 0  # ptxas cap on registers per thread (0: none); a cap can fit one more program per SM
    sites: Mapping[str, Mapping[str, int]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        names = {f.name for f in fields(self)} - {"sites"}
        for site, over in self.sites.items():
            if site not in SITES or not set(over) <= names:
                raise ValueError(f"bad override {site}: {dict(over)} (sites {SITES}, fields {sorted(names)})")
        # resolved once here, not on every launch: at() is on the host path of each kernel call
        plain = replace(self, sites={}) if self.sites else self
        object.__setattr__(self, "_plain", plain)
        object.__setattr__(self, "_by_site", {s: replace(plain, **o) for s, o in self.sites.items()})

    def at(self, site: str | None, dtype: torch.dtype) -> GmmConfig:
        """The uniform tiles with the overrides of ``site`` (16-bit ``dtype`` only) applied."""
        return self._by_site.get(site, self._plain) if dtype.itemsize <= 2 else self._plain

    def block_ms(self, dtype: torch.dtype) -> tuple[int, ...]:
        """The distinct ``block_m`` of the gmm sites (each needs its own tile schedule)."""
        return tuple(sorted({self.at(s, dtype).block_m for s in SITES[:4]}))


# bf16 tiles from `python -m kernels.grouped_mlp.tune --quick` on an H200 (Triton 3.6, torch 2.11, 2026-11-30 12:29 UTC;
# N 16384, d 1024, d_ff 4096, 8 experts, top-2), with the grouped program order and split epilogue: fwd+bwd 6.343 ms
# = 390 TFLOP/s, 0.714x the dense matmul chain in the same run (BENCHMARKS.md).
CONFIG = GmmConfig(
    sites={
        "fwd_up": {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 8, "num_stages": 3},
        "fwd_down": {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3, "epi_n": 64},
        "bwd_dh": {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3, "maxnreg": 128},
        "bwd_dx": {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
        "bwd_dw2": {"wgrad_p": 128, "wgrad_q": 256, "wgrad_k": 64, "num_warps": 8, "num_stages": 3},
        "bwd_dw13": {"wgrad_p": 128, "wgrad_q": 64, "wgrad_k": 64, "num_warps": 8, "num_stages": 3, "maxnreg": 128},
    }
)


def _stages(cfg: GmmConfig, dtype: torch.dtype) -> int:
    # fp32 tiles are twice the bytes: 3 stages of the dual-B tiles (96 KiB each) overflow Hopper's 227 KiB smem
    return cfg.num_stages if dtype.itemsize <= 2 else min(cfg.num_stages, 2)


@triton.jit
def _swizzle(pid, n_m, n_n, group):
    """(row block, column block) of program ``pid``: groups of ``group`` row blocks, each group's blocks
    column by column (1: row-major order; ``>= n_m``: column-major)."""
    width = group * n_n
    first = pid // width * group
    size = tl.minimum(n_m - first, group)
    return first + pid % width % size, pid % width // size


@triton.jit
def _halves(x, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Columns ``[0, WIDTH / 2)`` and ``[WIDTH / 2, WIDTH)`` of ``x [BLOCK_M, WIDTH]``."""
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, WIDTH // 2)), (0, 2, 1)))


@triton.jit
def _gmm_epilogue(
    acc,
    acc2,
    rows,
    rmask,
    col0,
    N,
    stride_cm,
    ptrs,
    EPI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    WIDTH: tl.constexpr,
    EPI_N: tl.constexpr,
):
    """Epilogue of columns ``[col0, col0 + WIDTH)``, halved down to sub-tiles of at most ``EPI_N`` columns;
    ``ptrs = (c, c2, c3, e1, e2)`` as in ``_gmm_kernel``."""
    if WIDTH > EPI_N:
        a0, a1 = _halves(acc, BLOCK_M, WIDTH)
        b0, b1 = _halves(acc2, BLOCK_M, WIDTH)  # acc2 is used by EPI 1 only (dead code otherwise)
        _gmm_epilogue(a0, b0, rows, rmask, col0, N, stride_cm, ptrs, EPI, BLOCK_M, WIDTH // 2, EPI_N)
        _gmm_epilogue(a1, b1, rows, rmask, col0 + WIDTH // 2, N, stride_cm, ptrs, EPI, BLOCK_M, WIDTH // 2, EPI_N)
    else:
        cols = col0 + tl.arange(0, WIDTH)
        off = rows[:, None] * stride_cm + cols[None, :]
        mask = rmask[:, None] & (cols < N)[None, :]
        c_ptr, c2_ptr, c3_ptr, e1_ptr, e2_ptr = ptrs
        dt = c_ptr.dtype.element_ty
        if EPI == 1:
            # h from the ROUNDED a, b: the backward recomputes h from the saved (rounded) a, b and must agree
            pa = acc.to(dt)
            pb = acc2.to(dt)
            af = pa.to(tl.float32)
            h = af * tl.sigmoid(af) * pb.to(tl.float32)
            tl.store(c_ptr + off, pa, mask=mask)
            tl.store(c2_ptr + off, pb, mask=mask)
            tl.store(c3_ptr + off, h.to(dt), mask=mask)
        elif EPI == 2:
            af = tl.load(e1_ptr + off, mask=mask, other=0.0).to(tl.float32)
            bf = tl.load(e2_ptr + off, mask=mask, other=0.0).to(tl.float32)
            s = tl.sigmoid(af)
            tl.store(c_ptr + off, (acc * bf * s * (1.0 + af * (1.0 - s))).to(dt), mask=mask)
            tl.store(c2_ptr + off, (acc * af * s).to(dt), mask=mask)
        else:
            tl.store(c_ptr + off, acc.to(dt), mask=mask)


@triton.jit(do_not_specialize=["group_m"])  # one binary for every group_m (a runtime knob)
def _gmm_kernel(
    a_ptr,
    tok_ptr,
    b_ptr,
    a2_ptr,
    b2_ptr,
    c_ptr,
    c2_ptr,
    c3_ptr,
    e1_ptr,
    e2_ptr,
    tile_e_ptr,
    tile_r_ptr,
    off_ptr,
    n_tiles,
    group_m,
    n_tok,
    K,
    N,
    stride_am,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    EPI: tl.constexpr,
    GATHER: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EPI_N: tl.constexpr,
):
    tile, pid_n = _swizzle(tl.program_id(0), n_tiles, tl.cdiv(N, BLOCK_N), group_m)
    e = tl.load(tile_e_ptr + tile)
    if e < 0:  # surplus program of the static-size grid
        return
    row0 = tl.load(tile_r_ptr + tile).to(tl.int64)
    row_end = tl.load(off_ptr + e + 1).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)  # [BM] sorted rows
    rmask = rows < row_end
    if GATHER:  # A row of sorted row r is x[tok[r]]
        src = tl.load(tok_ptr + rows, mask=rmask, other=-1).to(tl.int64)
        amask = rmask & (src >= 0) & (src < n_tok)
        src = tl.where(amask, src, 0)
    else:
        src = rows
        amask = rmask
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    b_base = b_ptr + e.to(tl.int64) * stride_be + cols[None, :] * stride_bn
    b2_base = b2_ptr + e.to(tl.int64) * stride_be + cols[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        kmask = kk < K
        a = tl.load(a_ptr + src[:, None] * stride_am + kk[None, :], mask=amask[:, None] & kmask[None, :], other=0.0)
        bmask = kmask[:, None] & cmask[None, :]
        b = tl.load(b_base + kk[:, None] * stride_bk, mask=bmask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        if EPI == 1:  # second projection over the same A tile
            b2 = tl.load(b2_base + kk[:, None] * stride_bk, mask=bmask, other=0.0)
            acc2 = tl.dot(a, b2, acc2, input_precision=DOT_PREC)
        if EPI == 3:  # second product with its own A
            a2 = tl.load(
                a2_ptr + src[:, None] * stride_am + kk[None, :], mask=amask[:, None] & kmask[None, :], other=0.0
            )
            b2 = tl.load(b2_base + kk[:, None] * stride_bk, mask=bmask, other=0.0)
            acc = tl.dot(a2, b2, acc, input_precision=DOT_PREC)
    ptrs = (c_ptr, c2_ptr, c3_ptr, e1_ptr, e2_ptr)
    _gmm_epilogue(acc, acc2, rows, rmask, pid_n * BLOCK_N, N, stride_cm, ptrs, EPI, BLOCK_M, BLOCK_N, EPI_N)


@triton.jit(do_not_specialize=["group_m"])
def _wgrad_kernel(
    p_ptr,
    tok_ptr,
    e2_ptr,
    q_ptr,
    q2_ptr,
    dw_ptr,
    dw2_ptr,
    off_ptr,
    group_m,
    n_tok,
    P,
    Q,
    stride_pm,
    stride_qm,
    stride_we,
    stride_wp,
    MODE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # MODE 0: dw[e] = X[rows_e]^T @ q[rows_e], dw2[e] = X^T @ q2 (X gathered from p = x via tok)
    # MODE 1: dw[e] = h[rows_e]^T @ q[rows_e] with h = silu(a) * b, a = p, b = e2 (sorted rows)
    n_p = tl.cdiv(P, BLOCK_P)
    n_q = tl.cdiv(Q, BLOCK_Q)
    pid = tl.program_id(0)
    e = pid // (n_p * n_q)  # expert-major: one expert's programs run together
    pid_p, pid_q = _swizzle(pid % (n_p * n_q), n_p, n_q, group_m)
    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BQ]
    pmask = ps < P
    qmask = qs < Q
    start = tl.load(off_ptr + e).to(tl.int64)
    end = tl.load(off_ptr + e + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)  # [BK] sorted rows
        rmask = rows < end
        q = tl.load(q_ptr + rows[:, None] * stride_qm + qs[None, :], mask=rmask[:, None] & qmask[None, :], other=0.0)
        if MODE == 0:
            src = tl.load(tok_ptr + rows, mask=rmask, other=-1).to(tl.int64)
            smask = rmask & (src >= 0) & (src < n_tok)
            src = tl.where(smask, src, 0)
            xmask = pmask[:, None] & smask[None, :]
            pt = tl.load(p_ptr + src[None, :] * stride_pm + ps[:, None], mask=xmask, other=0.0)  # [BP, BK]
            acc = tl.dot(pt, q, acc, input_precision=DOT_PREC)  # [BP, BQ]
            q2 = tl.load(
                q2_ptr + rows[:, None] * stride_qm + qs[None, :], mask=rmask[:, None] & qmask[None, :], other=0.0
            )
            acc2 = tl.dot(pt, q2, acc2, input_precision=DOT_PREC)
        else:
            toff = rows[None, :] * stride_pm + ps[:, None]  # [BP, BK]
            tmask = pmask[:, None] & rmask[None, :]
            af = tl.load(p_ptr + toff, mask=tmask, other=0.0).to(tl.float32)
            bf = tl.load(e2_ptr + toff, mask=tmask, other=0.0).to(tl.float32)
            ht = (af * tl.sigmoid(af) * bf).to(q.dtype)
            acc = tl.dot(ht, q, acc, input_precision=DOT_PREC)
    w_off = e.to(tl.int64) * stride_we + ps[:, None].to(tl.int64) * stride_wp + qs[None, :]
    wmask = pmask[:, None] & qmask[None, :]
    tl.store(dw_ptr + w_off, acc.to(dw_ptr.dtype.element_ty), mask=wmask)
    if MODE == 0:
        tl.store(dw2_ptr + w_off, acc2.to(dw2_ptr.dtype.element_ty), mask=wmask)


@dataclass(frozen=True)
class Routing:
    """Expert-sorted view of the assignments, all on the device (built without a host sync).

    Attributes:
        perm: ``[M]`` stable argsort of the expert key (no-op assignments last).
        tok: ``[M]`` token of each sorted row; -1 for no-op rows (so the scatter skips them).
        w: ``[M]`` router weight of each sorted row.
        off: ``[E + 1]`` int64 row offsets; expert e owns sorted rows ``[off[e], off[e + 1])``.
        seg_order, seg: CSR view of ``tok`` over tokens (``kernels.common.segments.build_segments``).
        tiles: ``{block_m: (tile_e, tile_r)}`` for every block_m built so far (see ``schedule``): tile_e
            ``[T]`` int32 expert of each GEMM tile, -1 for surplus tiles; tile_r ``[T]`` its first sorted row.
    """

    perm: torch.Tensor
    tok: torch.Tensor
    w: torch.Tensor
    off: torch.Tensor
    seg_order: torch.Tensor
    seg: torch.Tensor
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def schedule(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tile_e, tile_r)`` for row tiles of ``block_m``, built on first use and cached."""
        if block_m not in self.tiles:
            self.tiles[block_m] = _schedule(self.off, self.tok.shape[0], block_m)
        return self.tiles[block_m]


def _schedule(off: torch.Tensor, m: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile schedule of static size ``T = cdiv(M, block_m) + min(E, M)`` >= ``sum_e cdiv(M_e, block_m)``, so
    no group size has to reach the host; tiles past the real count get expert -1 and exit at once."""
    n_exp = off.shape[0] - 1
    counts = off[1:] - off[:-1]  # [E]
    tile_end = torch.cumsum((counts + block_m - 1) // block_m, 0)  # [E] inclusive
    n_tiles = triton.cdiv(m, block_m) + min(n_exp, m)
    t = torch.arange(n_tiles, device=off.device, dtype=tile_end.dtype)
    te = torch.searchsorted(tile_end, t, right=True)  # [T] expert of each tile (E: surplus)
    tec = te.clamp_max(n_exp - 1)
    first_tile = tile_end.index_select(0, tec) - (counts.index_select(0, tec) + block_m - 1) // block_m
    tile_r = off.index_select(0, tec) + (t - first_tile) * block_m
    return torch.where(te < n_exp, te, -1).to(torch.int32), tile_r.contiguous()


def build_routing(
    token_idx: torch.Tensor,
    expert_idx: torch.Tensor,
    weight: torch.Tensor,
    n_tok: int,
    n_exp: int,
    block_m: int | Iterable[int],
) -> Routing:
    """Sorts assignments by expert and builds the per-expert offsets and a tile schedule per ``block_m``."""
    dev = token_idx.device
    m = token_idx.shape[0]
    valid = (expert_idx >= 0) & (expert_idx < n_exp)
    key = torch.where(valid, expert_idx, n_exp)
    sorted_key, perm = torch.sort(key, stable=True)
    off = torch.searchsorted(sorted_key, torch.arange(n_exp + 1, device=dev, dtype=sorted_key.dtype))  # [E+1]
    tok = torch.where(valid, token_idx, -1).index_select(0, perm)  # [M]
    w = weight.index_select(0, perm)
    off = off.contiguous()
    bms = (block_m,) if isinstance(block_m, int) else tuple(block_m)
    tiles = {bm: _schedule(off, m, bm) for bm in bms}
    order, seg = build_segments(tok, n_tok)
    return Routing(perm, tok, w, off, order, seg, tiles)


def gmm(
    epi: int,
    a: torch.Tensor,
    b: torch.Tensor,
    rt: Routing,
    out_cols: int,
    *,
    gather: bool = False,
    n_tok: int = 0,
    a2: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    e1: torch.Tensor | None = None,
    e2: torch.Tensor | None = None,
    cfg: GmmConfig | None = None,
    site: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Row-grouped GEMM over sorted rows ``C[r] = A[r] @ B[e(r)]`` with epilogue ``epi`` (see module doc).

    Args:
        epi: 0 plain, 1 SwiGLU forward (``b``, ``b2`` = W1, W3), 2 SwiGLU backward (``e1``, ``e2`` = a, b),
            3 ``A @ B + A2 @ B2``.
        a: ``[N, K]`` (``gather=True``: rows ``a[tok[r]]``) or ``[M, K]`` sorted rows; unit column stride.
        b: ``[E, K, out_cols]`` view (any strides; a transposed weight is a strided view). ``b2`` likewise.
        rt: from ``build_routing`` (a schedule for another ``block_m`` is built and cached on first use).
        out_cols: columns of C.
        n_tok: N, the number of rows of ``a`` when gathering.
        cfg, site: tiles ``(cfg or CONFIG).at(site, a.dtype)``.

    Returns:
        ``(c,)``, or ``(a_pre, b_pre, h)`` for epi 1, or ``(da, db)`` for epi 2; each ``[M, out_cols]`` in
        ``a.dtype`` with only the rows of real experts written.
    """
    cfg = (cfg or CONFIG).at(site, a.dtype)
    m = rt.tok.shape[0]
    k = a.shape[1]
    n_out = {0: 1, 1: 3, 2: 2, 3: 1}[epi]
    outs = tuple(torch.empty((m, out_cols), dtype=a.dtype, device=a.device) for _ in range(n_out))
    if m == 0 or out_cols == 0:
        return outs
    if a2 is not None:
        assert a2.stride() == a.stride()
    if b2 is not None:
        assert b2.stride() == b.stride()
    if e1 is not None:
        assert e1.stride(0) == outs[0].stride(0) and e2.stride(0) == outs[0].stride(0)
    tile_e, tile_r = rt.schedule(cfg.block_m)
    grid = (tile_e.shape[0] * triton.cdiv(out_cols, cfg.block_n),)
    _gmm_kernel[grid](
        a,
        rt.tok,
        b,
        a2 if a2 is not None else a,
        b2 if b2 is not None else b,
        outs[0],
        outs[1] if n_out > 1 else outs[0],
        outs[2] if n_out > 2 else outs[0],
        e1 if e1 is not None else outs[0],
        e2 if e2 is not None else outs[0],
        tile_e,
        tile_r,
        rt.off,
        tile_e.shape[0],
        cfg.group_m,
        n_tok,
        k,
        out_cols,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        outs[0].stride(0),
        EPI=epi,
        GATHER=gather,
        DOT_PREC=dot_precision(a.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EPI_N=min(cfg.epi_n, cfg.block_n),
        num_warps=cfg.num_warps,
        num_stages=_stages(cfg, a.dtype),
        maxnreg=cfg.maxnreg or None,
    )
    return outs


def wgrad(
    mode: int,
    p: torch.Tensor,
    q: torch.Tensor,
    rt: Routing,
    n_exp: int,
    w_dtype: torch.dtype,
    *,
    q2: torch.Tensor | None = None,
    e2: torch.Tensor | None = None,
    n_tok: int = 0,
    cfg: GmmConfig | None = None,
    site: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per-expert weight gradients, reduced over each expert's sorted rows.

    Args:
        mode: 0: ``p = x [N, D]`` (gathered via ``rt.tok``), ``q, q2 = da, db [M, F]`` -> ``(dW1, dW3)``
            ``[E, D, F]``; 1: ``p, e2 = a, b [M, F]`` (h recomputed), ``q = dy [M, D]`` -> ``(dW2,)``
            ``[E, F, D]``.
        rt: from ``build_routing``.
        n_exp: E.
        w_dtype: dtype of the weight gradients (fp32 accumulation, rounded once).
        cfg, site: tiles ``(cfg or CONFIG).at(site, p.dtype)``.

    Returns:
        The weight gradients, every element written.
    """
    cfg = (cfg or CONFIG).at(site, p.dtype)
    pdim, qdim = p.shape[1], q.shape[1]
    outs = tuple(torch.empty((n_exp, pdim, qdim), dtype=w_dtype, device=p.device) for _ in range(2 if mode == 0 else 1))
    if n_exp == 0 or pdim == 0 or qdim == 0:
        return outs
    if q2 is not None:
        assert q2.stride(0) == q.stride(0)
    if e2 is not None:
        assert e2.stride(0) == p.stride(0)
    grid = (n_exp * triton.cdiv(pdim, cfg.wgrad_p) * triton.cdiv(qdim, cfg.wgrad_q),)
    _wgrad_kernel[grid](
        p,
        rt.tok,
        e2 if e2 is not None else p,
        q,
        q2 if q2 is not None else q,
        outs[0],
        outs[-1],
        rt.off,
        cfg.group_m,
        n_tok,
        pdim,
        qdim,
        p.stride(0),
        q.stride(0),
        outs[0].stride(0),
        outs[0].stride(1),
        MODE=mode,
        DOT_PREC=dot_precision(p.dtype),
        BLOCK_P=cfg.wgrad_p,
        BLOCK_Q=cfg.wgrad_q,
        BLOCK_K=cfg.wgrad_k,
        num_warps=cfg.num_warps,
        num_stages=_stages(cfg, p.dtype),
        maxnreg=cfg.maxnreg or None,
    )
    return outs
