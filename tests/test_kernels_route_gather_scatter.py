"""Routed gather / scatter-add: the Triton op against naive.py (outputs and every gradient)."""

from functools import partial

import pytest
import torch

from kernels.common import launch
from kernels.common.scatter_backward import scatter_add_backward
from kernels.route_gather_scatter import kernel as rk
from kernels.route_gather_scatter import op as rop
from kernels.route_gather_scatter import (
    route_gather,
    route_gather_naive,
    route_scatter_add,
    route_scatter_add_naive,
)
from kernels.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# (B, T, D, K): D not a power of two, K=1, K=T, B>1, D over one block (1030 > 1024)
BATCHED = [(1, 1, 1, 1), (2, 9, 37, 4), (3, 16, 64, 1), (2, 8, 33, 8), (2, 5, 1030, 3)]
pytestmark = pytest.mark.usefixtures("poison_empty")  # kernel outputs start as NaN


def _batched_idx(b: int, t: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(t, generator=g)[:k].sort().values for _ in range(b)]  # different per row
    return torch.stack(rows).to(DEVICE)


def _inputs(x_shape, idx_shape, dtype, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = x_shape[-1]
    x = torch.randn(*x_shape, generator=g).to(DEVICE, dtype)
    f = torch.randn(*idx_shape, d, generator=g).to(DEVICE, dtype)
    w = torch.rand(*idx_shape, generator=g).to(DEVICE, w_dtype or dtype)
    return x, f, w


def _grads(fn, inputs, dy_seed=1):
    leaves = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = fn(*leaves)
    g = torch.Generator().manual_seed(dy_seed)
    dy = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    out.backward(dy)
    return out, [t.grad for t in leaves if t.is_floating_point()], dy


def _check_scatter(x, idx, f, w, ratio, distinct=False):
    y_ref, g_ref, _ = _grads(partial(route_scatter_add_naive, distinct=distinct), (x, idx, f, w))
    y_tri, g_tri, dy = _grads(partial(route_scatter_add, distinct=distinct), (x, idx, f, w))
    assert_close("y", y_ref, y_tri, ratio)
    for name, a, b in zip(("dx", "df", "dw"), g_ref, g_tri, strict=True):
        assert_close(name, a, b, ratio)
    assert torch.equal(g_tri[0], dy)  # dx is the identity


def _check_gather(x, idx, ratio, distinct=False):
    xs_ref, (dx_ref,), _ = _grads(partial(route_gather_naive, distinct=distinct), (x, idx))
    xs_tri, (dx_tri,), _ = _grads(partial(route_gather, distinct=distinct), (x, idx))
    assert torch.equal(xs_ref, xs_tri)
    assert_close("dx", dx_ref, dx_tri, ratio)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,t,d,k", BATCHED)
def test_batched(b, t, d, k, dtype):
    idx = _batched_idx(b, t, k)
    x, f, w = _inputs((b, t, d), (b, k), dtype)
    _check_gather(x, idx, TOL[dtype])
    _check_scatter(x, idx, f, w, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("w_dtype", [torch.float32, None])
def test_flat_repeated(dtype, w_dtype):
    n, d, k = 13, 37, 20  # K > N: repeats are certain, indices unsorted
    idx = torch.randint(0, n, (k,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    idx[:3] = 5  # one row hit several times
    x, f, w = _inputs((n, d), (k,), dtype, w_dtype)
    _check_gather(x, idx, TOL[dtype])
    _check_scatter(x, idx, f, w, TOL[dtype])


def test_multi_block_ragged(monkeypatch):
    monkeypatch.setattr(launch, "MAX_BLOCK_D", 16)  # D=37: three column blocks, the last one ragged
    idx = _batched_idx(2, 9, 4)
    x, f, w = _inputs((2, 9, 37), (2, 4), torch.float32)
    _check_gather(x, idx, TOL[torch.float32])
    _check_scatter(x, idx, f, w, TOL[torch.float32])


def test_mod_block_pattern():
    """y = x + w * h(gather(x)): the routed block end to end, dx flows through both paths."""
    idx = _batched_idx(2, 12, 3, seed=5)
    x, _, w = _inputs((2, 12, 24), (2, 3), torch.float32)

    def block(gather, scatter):
        def fn(x, w):
            return scatter(x, idx, torch.tanh(gather(x, idx)), w)

        return fn

    y_ref, g_ref, _ = _grads(block(route_gather_naive, route_scatter_add_naive), (x, w))
    y_tri, g_tri, _ = _grads(block(route_gather, route_scatter_add), (x, w))
    assert_close("y", y_ref, y_tri, 1e-5)
    for name, a, b in zip(("dx", "dw"), g_ref, g_tri, strict=True):
        assert_close(name, a, b, 1e-5)


# ---- distinct=True: the fast path (no sort, no segments, no atomics) against the same reference ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,t,d,k", BATCHED)
def test_distinct_batched(b, t, d, k, dtype):
    idx = _batched_idx(b, t, k, seed=11)
    x, f, w = _inputs((b, t, d), (b, k), dtype, torch.float32, seed=2)
    _check_gather(x, idx, TOL[dtype], distinct=True)
    _check_scatter(x, idx, f, w, TOL[dtype], distinct=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_distinct_matches_general_path(dtype):
    idx = _batched_idx(3, 11, 5, seed=4)
    x, f, w = _inputs((3, 11, 37), (3, 5), dtype, seed=6)
    for fn in (route_gather, partial(route_scatter_add, f=f, w=w)):
        out_gen, g_gen, _ = _grads(lambda x, fn=fn: fn(x, idx), (x,))
        out_fast, g_fast, _ = _grads(lambda x, fn=fn: fn(x, idx, distinct=True), (x,))
        assert torch.equal(out_gen, out_fast) and torch.equal(g_gen[0], g_fast[0])


def test_distinct_unsorted_int32_strided():
    """MoD's causal lists: distinct but not sorted, a column slice of an argsort (strided); int32 here."""
    g = torch.Generator().manual_seed(8)
    idx = torch.stack([torch.randperm(10, generator=g) for _ in range(3)]).to(DEVICE, torch.int32)[:, :6]
    assert not idx.is_contiguous()
    x, f, w = _inputs((3, 10, 29), (3, 6), torch.float32)
    _check_gather(x, idx, 1e-6, distinct=True)
    _check_scatter(x, idx, f, w, 1e-6, distinct=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_distinct_flat(dtype):
    idx = torch.randperm(23, generator=torch.Generator().manual_seed(9))[:9].to(DEVICE)  # unsorted rows
    x, f, w = _inputs((23, 40), (9,), dtype, None)
    _check_gather(x, idx, TOL[dtype], distinct=True)
    _check_scatter(x, idx, f, w, TOL[dtype], distinct=True)


def test_distinct_ragged_blocks(monkeypatch):
    monkeypatch.setattr(launch, "MAX_BLOCK_D", 16)  # D=37: three column blocks, the last one ragged
    monkeypatch.setattr(rk, "ROWS_TILE", 64)  # 4 entries per program: 9 entries in 3 programs, the last ragged
    idx = _batched_idx(3, 9, 3, seed=3)
    x, f, w = _inputs((3, 9, 37), (3, 3), torch.float32)
    _check_gather(x, idx, 1e-6, distinct=True)
    _check_scatter(x, idx, f, w, 1e-6, distinct=True)


@pytest.mark.parametrize("gate", ["sigmoid", "identity"])
def test_distinct_mod_block_pattern(gate):
    """MoD's routed block with either gate: y = x + g(r) * tanh(gather(x)); gradients to x and the logits r."""
    idx = _batched_idx(3, 12, 4, seed=5)
    x, _, r = _inputs((3, 12, 24), (3, 4), torch.float32, seed=1)
    r = r * 4 - 2  # signed logits: the identity gate gives negative weights

    def block(gather, scatter):
        def fn(x, r):
            w = torch.sigmoid(r) if gate == "sigmoid" else r
            return scatter(x, idx, torch.tanh(gather(x, idx, distinct=True)), w, distinct=True)

        return fn

    y_ref, g_ref, _ = _grads(block(route_gather_naive, route_scatter_add_naive), (x, r))
    y_tri, g_tri, _ = _grads(block(route_gather, route_scatter_add), (x, r))
    assert_close("y", y_ref, y_tri, 1e-5)
    for name, a, b in zip(("dx", "dr"), g_ref, g_tri, strict=True):
        assert_close(name, a, b, 1e-5)


def test_distinct_empty_and_untouched_rows():
    x, f, w = _inputs((2, 6, 8), (2, 0), torch.float32)
    _check_scatter(x, torch.empty(2, 0, dtype=torch.int64, device=DEVICE), f, w, 1e-6, distinct=True)
    idx = _batched_idx(2, 16, 4, seed=7)
    x, f, w = _inputs((2, 16, 40), (2, 4), torch.float16)
    assert torch.equal(route_scatter_add(x, idx, torch.zeros_like(f), w, distinct=True), x)
    y = route_scatter_add(x, idx, f, w, distinct=True)
    unselected = torch.ones(2, 16, dtype=torch.bool, device=DEVICE)
    unselected.scatter_(1, idx, False)
    assert torch.equal(y[unselected], x[unselected])


def test_distinct_unchecked_bad_index_is_harmless():
    idx = torch.tensor([[1, 9], [0, 2]], device=DEVICE)
    x, f, w = _inputs((2, 9, 4), (2, 2), torch.float32)
    xs = route_gather(x, idx, check=False, distinct=True)
    assert torch.equal(xs[0, 1], torch.zeros(4, device=DEVICE))
    y = route_scatter_add(x, idx, f, w, check=False, distinct=True)
    assert torch.equal(y[1, 0], (x[1, 0] + w[1, 0] * f[1, 0]))
    assert torch.equal(y[0, 2:], x[0, 2:]) and torch.equal(y[1, 1], x[1, 1])


def test_scatter_backward_reads_nothing_for_invalid_entries():
    """An invalid entry (-1, e.g. a token routed to a no-op expert) gets df 0 and dw 0 even where its f row
    holds garbage (never written: NaN and inf here); valid entries get w dy[row] and f . dy[row]."""
    dy = torch.randn(5, 8, device=DEVICE)
    idx = torch.tensor([3, -1, 0, -1], device=DEVICE)
    f = torch.randn(4, 8, device=DEVICE)
    f[1], f[3] = float("nan"), float("inf")
    w = torch.rand(4, device=DEVICE)
    df, dw = scatter_add_backward(dy, idx, f, w, True, True)
    assert torch.equal(df[1], torch.zeros(8, device=DEVICE)) and torch.equal(df[3], df[1])
    assert dw[1] == 0 and dw[3] == 0
    for j, row in ((0, 3), (2, 0)):
        torch.testing.assert_close(df[j], w[j] * dy[row])
        torch.testing.assert_close(dw[j], (f[j] * dy[row]).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_distinct_indexed_form(dtype):
    """The scatter-add as traced under torch.compile (plain indexing) against the reference: routed rows, and
    unselected rows bit-identical; batched (an invalid position 9 of T 9 writes nothing) and flat."""
    idx = torch.tensor([[1, 9, 4], [0, 2, 7]], device=DEVICE)
    x, f, w = _inputs((2, 9, 33), (2, 3), dtype, torch.float32, seed=4)
    y = rop._scatter_add_indexed(x.reshape(-1, 33), idx, f.reshape(-1, 33), w.reshape(-1)).view(x.shape)
    valid = idx < 9
    y_ref = route_scatter_add_naive(x, idx.clamp(max=8), f * valid[..., None], w, distinct=True)
    assert_close("y", y_ref, y, TOL[dtype])
    untouched = torch.ones(2, 9, dtype=torch.bool, device=DEVICE)
    untouched.scatter_(1, idx.clamp(max=8), ~valid)
    assert torch.equal(y[untouched], x[untouched]) and untouched.sum() == 13
    flat = torch.tensor([5, 0, 11], device=DEVICE)
    x, f, w = _inputs((12, 8), (3,), dtype, torch.float32, seed=5)
    assert_close("y", route_scatter_add_naive(x, flat, f, w), rop._scatter_add_indexed(x, flat, f, w), TOL[dtype])


@pytest.mark.parametrize("naive", [False, True])
def test_distinct_contract_checked(naive):
    """Repeats under distinct=True: the reference and check=True raise; rows of different sequences may match."""
    x, f, w = _inputs((2, 9, 4), (2, 2), torch.float32)
    ok = torch.tensor([[3, 1], [3, 1]], device=DEVICE)
    bad = torch.tensor([[3, 1], [2, 2]], device=DEVICE)
    gather = route_gather_naive if naive else partial(route_gather, check=True)
    scatter = route_scatter_add_naive if naive else partial(route_scatter_add, check=True)
    gather(x, ok, distinct=True)
    with pytest.raises(ValueError, match="repeat"):
        gather(x, bad, distinct=True)
    with pytest.raises(ValueError, match="repeat"):
        scatter(x, bad, f, w, distinct=True)
    with pytest.raises(ValueError, match="repeat"):
        scatter(x[0], bad[1], f[0], w[0], distinct=True)  # flat form


def test_batch_offsets_against_loop():
    """The reference itself: sequence b reads and writes only sequence b."""
    b, t, d, k = 3, 7, 5, 2
    idx = torch.tensor([[0, 6], [0, 6], [2, 3]], device=DEVICE)
    x, f, w = _inputs((b, t, d), (b, k), torch.float32)
    for fn in (route_gather, route_gather_naive):
        xs = fn(x, idx)
        for i in range(b):
            assert torch.equal(xs[i], x[i, idx[i]])
    for fn in (route_scatter_add, route_scatter_add_naive):
        y = fn(x, idx, f, w)
        expect = x.clone()
        for i in range(b):
            expect[i, idx[i]] += w[i, :, None] * f[i]
        assert_close("y", expect, y, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_identity_and_untouched_rows(dtype):
    idx = _batched_idx(2, 16, 4, seed=7)
    x, f, w = _inputs((2, 16, 40), (2, 4), dtype)
    assert torch.equal(route_scatter_add(x, idx, torch.zeros_like(f), w), x)  # f = 0: identity
    y = route_scatter_add(x, idx, f, w)
    unselected = torch.ones(2, 16, dtype=torch.bool, device=DEVICE)
    unselected.scatter_(1, idx, False)
    assert torch.equal(y[unselected], x[unselected])  # bit-identical


def test_empty_capacity():
    x, f, w = _inputs((2, 6, 8), (2, 0), torch.float32)
    idx = torch.empty(2, 0, dtype=torch.int64, device=DEVICE)
    assert route_gather(x, idx).shape == (2, 0, 8)
    _check_scatter(x, idx, f, w, 1e-6)


def test_deterministic_with_repeats():
    idx = torch.tensor([4, 1, 4, 4, 0, 1], device=DEVICE)
    x, f, w = _inputs((6, 19), (6,), torch.float16)
    assert torch.equal(route_scatter_add(x, idx, f, w), route_scatter_add(x, idx, f, w))


def test_non_contiguous_inputs():
    idx = _batched_idx(2, 9, 4)
    x, f, w = _inputs((2, 9, 74), (2, 4), torch.float32)
    x, f = x[..., ::2], f[..., 1::2]  # column stride 2
    _check_gather(x, idx, 1e-6)
    _check_scatter(x, idx, f, w, 1e-6)


@pytest.mark.parametrize("fn", [route_gather, route_gather_naive])
@pytest.mark.parametrize("bad", [-1, 9])
def test_out_of_range_raises_gather(fn, bad):
    idx = torch.tensor([[0, 3], [1, bad]], device=DEVICE)  # 9 == T: < N, would land in the next sequence
    x, _, _ = _inputs((2, 9, 4), (2, 2), torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        fn(x, idx) if fn is route_gather_naive else fn(x, idx, check=True)


@pytest.mark.parametrize("fn", [route_scatter_add, route_scatter_add_naive])
def test_out_of_range_raises_scatter(fn):
    x, f, w = _inputs((5, 4), (2,), torch.float32)
    idx = torch.tensor([0, 5], device=DEVICE)
    with pytest.raises(ValueError, match="out of range"):
        fn(x, idx, f, w) if fn is route_scatter_add_naive else fn(x, idx, f, w, check=True)


def test_unchecked_bad_index_is_harmless():
    """check=False: a bad batched position is neither read (zeros) nor written, nor crosses sequences."""
    idx = torch.tensor([[1, 9], [0, 2]], device=DEVICE)
    x, f, w = _inputs((2, 9, 4), (2, 2), torch.float32)
    xs = route_gather(x, idx, check=False)
    assert torch.equal(xs[0, 1], torch.zeros(4, device=DEVICE))
    y = route_scatter_add(x, idx, f, w, check=False)
    assert torch.equal(y[1, 0], (x[1, 0] + w[1, 0] * f[1, 0]))
    assert torch.equal(y[0, 2:], x[0, 2:]) and torch.equal(y[1, 1], x[1, 1])


def test_validation_errors():
    idx = _batched_idx(2, 9, 4)
    x, f, w = _inputs((2, 9, 8), (2, 4), torch.float32)
    with pytest.raises(ValueError):
        route_gather(x, idx[0])  # batched x, flat idx
    with pytest.raises(ValueError):
        route_scatter_add(x, idx, f[:, :3], w)
    with pytest.raises(ValueError):
        route_scatter_add(x, idx, f, w[:, :3])
    with pytest.raises(TypeError):
        route_scatter_add(x, idx, f.half(), w)
    with pytest.raises(TypeError):
        route_scatter_add(x, idx, f, w.double())
    with pytest.raises(TypeError):
        route_gather(x, idx.float())


def test_reference_gradcheck():
    d64 = dict(dtype=torch.float64)
    x = torch.randn(2, 5, 3, **d64, requires_grad=True)
    idx = torch.tensor([[0, 3], [2, 4]])
    f = torch.randn(2, 2, 3, **d64, requires_grad=True)
    w = torch.randn(2, 2, **d64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: route_gather_naive(x, idx), (x,))
    assert torch.autograd.gradcheck(lambda x, f, w: route_scatter_add_naive(x, idx, f, w), (x, f, w))
    flat = torch.tensor([1, 4, 1, 0])  # repeats
    xf = torch.randn(5, 3, **d64, requires_grad=True)
    ff = torch.randn(4, 3, **d64, requires_grad=True)
    wf = torch.randn(4, **d64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: route_gather_naive(x, flat), (xf,))
    assert torch.autograd.gradcheck(lambda x, f, w: route_scatter_add_naive(x, flat, f, w), (xf, ff, wf))


def test_bench_workloads_smoke():
    from kernels.route_gather_scatter.bench import make_workloads

    workloads, (x, w) = make_workloads(2, 16, 24, 4, torch.float32, DEVICE)
    ref = workloads["naive"]["fwd"]().detach()
    for modes in workloads.values():
        assert_close("y", ref, modes["fwd"]().detach(), 1e-5)
        modes["fwd+bwd"]()
        assert x.grad is not None and w.grad is not None
        x.grad = w.grad = None
